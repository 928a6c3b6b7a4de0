"""The loss: token-weighted sums over the global count, fused with the output projection, vocabulary-parallel."""
