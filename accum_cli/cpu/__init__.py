"""Speedups that only a CPU run installs (oneDNN linear, closed-form RMSNorm, malloc tuning, the gloo reduce-scatter).

Nothing here is on a CUDA run's path; each piece is applied only where the device is the CPU."""
