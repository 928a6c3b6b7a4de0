"""Parallelism below the model: the process group and devices, sharding settings, gradient sums over ranks."""
