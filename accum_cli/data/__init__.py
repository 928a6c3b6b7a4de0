"""Data: where rows come from, their formats, preparation into a cache, streaming, and microbatches."""
