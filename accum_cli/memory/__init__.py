"""Memory: the estimate of a step's peak (measured on a fake model and world) and the choices made from it."""
