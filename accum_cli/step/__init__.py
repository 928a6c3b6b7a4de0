"""One optimizer step over the microbatches (the exact loop), the optimizer and schedule, evaluation."""
