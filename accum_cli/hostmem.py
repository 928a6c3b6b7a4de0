"""Host memory that follows the live tensors, for the runs that shard to save memory.

Left to itself, glibc's malloc raises its mmap threshold to the size of the first large block
freed (up to 32 MiB), and from then on serves tensors of that size from its heap, where freed
blocks fragment and are not returned: the resident set of a CPU run grows step after step
beyond what is alive. Measured on issue 11's memory workload (Llama, 32K vocabulary, 45M
parameters, 2 ranks, sharded, `every`): peak 1717 MiB with the default, 1221 MiB with a fixed
threshold, and the resident set between steps flat at 728 MiB instead of rising.

Where to fix it is a trade: every tensor at or above the threshold is a fresh mapping, paid in
page faults each time it is allocated. Measured (3 Dec 2026, 2 ranks, sharded, `every`; peak MiB
on the memory workload / tokens/s on the peers' speed workload, whose activations are 1-4 MiB):
128 KiB 1032 / ~4,000; 1 MiB 1067 / ~4,100; 2 MiB 1079 / ~5,200; 8 MiB 1088 / ~5,550; 32 MiB
1323 / ~5,300. 8 MiB keeps what makes the peak (parameters, gradients, logits: tens of MiB)
returned, and the activations of a small model on the heap. So that threshold is fixed where
memory is the reason for the layout (sharded, on CPU), and never over a value the user set
(MALLOC_MMAP_THRESHOLD_) or where the C library is not glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

M_MMAP_THRESHOLD = -3  # mallopt's parameter number, <malloc.h>
LEAN_THRESHOLD_BYTES = 8 * 2**20  # fixed: glibc would move it with every large free


def follow_live_tensors() -> bool:
    """Fix glibc's mmap threshold so a freed large tensor's pages go back to the system.
    Returns whether it was set (only allocations made afterwards are affected)."""
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") is not None:
        return False  # the user's choice stands
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to fix
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, LEAN_THRESHOLD_BYTES))
