"""glibc's malloc set for what a CPU run's layout is for: memory when sharded, speed when replicated.

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
memory is the reason for the layout (sharded, on CPU).

A replicated run is one whose training state fits: there the heap is worth keeping. glibc's
default still faults: it trims the heap's top whenever 2 x threshold lies free there, and the
next microbatch faults those pages back in (1,000-4,000 minor faults per microbatch of the speed
workload, one process). Fixed at 32 MiB with the top trimmed only past 1 GiB, the heap keeps its
pages: 0-500 faults, and one microbatch's forward and backward 2.4% faster (median of four
alternating process pairs, 4 Dec 2026; faster in all four); in the 2-rank benchmark +0.9% (median
of eight paired rounds). The resident set then stays at its peak instead of following it down.

Below the threshold, a sharded run's smaller tensors (activations, a layer's gradients and
optimizer state) still share the heap, and what a microbatch frees in its middle stays resident:
at the step's peak, the forward's gather of a whole vocabulary matrix (the input embedding's,
the output projection's), 30-40 MiB of free heap pages were still counted on the memory workload.
So a sharded run also hands the heap's free pages back (malloc_trim) just before those gathers,
where the matrix is at least the threshold (a smaller one is served from those free pages): 2-7 ms
each, and that workload's peak 998-1024 -> 977-994 MiB (5 Dec 2026; the resident set read at every
module's forward and backward found where). Before every module's forward and backward instead, the
heap's regrowth cost 20% of a sharded run's speed.

Neither is set over the user's own MALLOC_MMAP_THRESHOLD_ or MALLOC_TRIM_THRESHOLD_, or where the
C library is not glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

M_TRIM_THRESHOLD = -1  # mallopt's parameter numbers, <malloc.h>
M_MMAP_THRESHOLD = -3
LEAN_THRESHOLD_BYTES = 8 * 2**20  # fixed: glibc would move it with every large free
HEAP_THRESHOLD_BYTES = 32 * 2**20  # the ceiling of glibc's own dynamic threshold
HEAP_TRIM_BYTES = 2**30  # mallopt takes an int: below 2 GiB
USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")


def follow_live_tensors() -> bool:
    """Sharded: fix the mmap threshold so a freed large tensor's pages go back to the system.
    Returns whether it was set (only allocations made afterwards are affected)."""
    return _set((M_MMAP_THRESHOLD, LEAN_THRESHOLD_BYTES))


def give_back_before(modules) -> bool:
    """Before each forward of these modules (ahead of FSDP's gather, whose hook runs after this
    one), return the heap's free pages to the system. Only where follow_live_tensors was set (so
    glibc's): with glibc's own threshold the heap is where large tensors live, and trimming it
    would only be paid for again in page faults. Returns whether it was set."""
    try:
        trim = _libc().malloc_trim
    except (OSError, AttributeError):  # a C library with mallopt but no malloc_trim
        return False
    trim.argtypes = [ctypes.c_size_t]

    def give_back(_module, _args) -> None:  # None: the forward's arguments stay as they are
        trim(0)

    for module in modules:
        module.register_forward_pre_hook(give_back, prepend=True)
    return True


def keep_the_heap() -> bool:
    """Replicated: tensors under 32 MiB from a heap whose pages are kept for the next microbatch.
    Returns whether it was set."""
    return _set((M_MMAP_THRESHOLD, HEAP_THRESHOLD_BYTES), (M_TRIM_THRESHOLD, HEAP_TRIM_BYTES))


def _set(*settings: tuple[int, int]) -> bool:
    if any(os.environ.get(name) is not None for name in USER_SETTINGS):
        return False  # the user's choice stands
    try:
        mallopt = _libc().mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to fix
        return False
    return all(mallopt(param, value) == 1 for param, value in settings)


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
