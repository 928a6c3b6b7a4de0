"""Configuration and the pure batch plan: flags, recipes, defaults, validation, (G, m, W) -> plan, sync policies. No torch."""
