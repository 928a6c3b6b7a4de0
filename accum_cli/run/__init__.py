"""A training run, in order: planning, setup (checks first), the header, the loop, the record it leaves."""
