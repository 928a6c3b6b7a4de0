"""accum-train: exact, FSDP2-sharded gradient accumulation for Hugging Face causal LMs."""

__version__ = "0.1.0"
