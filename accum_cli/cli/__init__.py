"""The commands (`accum-train`, `accum-export`, `accum-report`) and the `--nproc` launcher wrapper."""
