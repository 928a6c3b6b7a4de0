"""The model: loading any Hugging Face causal LM, mixtures of experts, compiling, and wrapping it for the layout."""
