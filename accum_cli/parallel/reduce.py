"""The replicated layout's gradient sum over ranks, overlapped with the last microbatch's backward.

Each rank accumulates its microbatches' gradients locally; the step's one reduction sums them
over ranks (summed, not averaged: the loss is already divided by the global loss-token count).
As DDP does, the reduction is bucketed and starts during the last backward: gradients arrive
roughly in reverse order of the parameters, so the parameters are grouped into buckets in that
order, and a bucket's all-reduce is launched as soon as its last gradient is accumulated, while
backward goes on with the layers below.

Every rank must issue the same collectives in the same order, whatever its timing, so buckets
are launched strictly in order, and a bucket whose parameter saw no gradient on this rank in the
last microbatch (an expert no token was routed to, an unused head) waits for the end of backward,
where the rest are launched with zeros for missing gradients. Each bucket also carries one flag
per parameter (1 where this rank had a gradient), summed with it: a parameter no rank had a
gradient for gets none (`grad=None`, as in one process), not zeros, so the optimizer leaves it
alone instead of moving it by its momentum and weight decay. At most two buckets are in flight:
the extra memory is bounded by two buckets, not a second copy of all gradients.

Why not torch's DDP (`no_sync()` but on the last microbatch, a summing comm hook): measured side by
side (`make bench-replicate`, docs/BENCHMARKS.md, 6 Dec 2026), DDP keeps its buckets, a second copy
of the gradients, for the life of the model: +338 MiB per rank at 116M parameters, for a step time
within the spread of two CPU ranks. Layout by fit replicates only where the state fits a device, so
that copy would shard models that replicate here. DDP would also need the fused loss moved inside
its forward and `find_unused_parameters` for mixtures of experts.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from accum_cli.parallel import runtime

FIRST_BUCKET_BYTES = 2**20  # as DDP: the first gradients can leave early
BUCKET_BYTES = 25 * 2**20  # as DDP's default bucket: few collectives, bounded extra memory
MIN_BUCKETS = 8  # a small model is still split, so that all but its last bucket overlap backward
MAX_IN_FLIGHT = 2


def bucket_plan(sizes: list[int], dtypes: list[torch.dtype]) -> list[list[int]]:
    """Parameter indices grouped into buckets, in the order given (the order gradients arrive).
    A bucket closes at its byte cap or where the dtype changes (one flat tensor per bucket).
    The cap is DDP's, or an eighth of the total for a model smaller than eight of them."""
    total = sum(sizes)
    cap = min(BUCKET_BYTES, max(FIRST_BUCKET_BYTES, total // MIN_BUCKETS))
    buckets: list[list[int]] = []
    current: list[int] = []
    filled = 0
    for i, (size, dtype) in enumerate(zip(sizes, dtypes, strict=True)):
        if current and dtype != dtypes[current[-1]]:
            buckets.append(current)
            current, filled = [], 0
        current.append(i)
        filled += size
        if filled >= (FIRST_BUCKET_BYTES if not buckets else cap):
            buckets.append(current)
            current, filled = [], 0
    if current:
        buckets.append(current)
    return buckets


def _all_reduce_async(flat: torch.Tensor):
    return dist.all_reduce(flat, op=dist.ReduceOp.SUM, async_op=True)


class _Buckets:
    """One backward's worth of bucket bookkeeping (see the module docstring)."""

    def __init__(self, params: list[nn.Parameter], all_reduce: Callable) -> None:
        order = params[::-1]
        self.buckets = [
            [order[i] for i in bucket]
            for bucket in bucket_plan([p.numel() * p.element_size() for p in order], [p.dtype for p in order])
        ]
        self.bucket_of = {id(p): k for k, bucket in enumerate(self.buckets) for p in bucket}
        self.waiting = [len(bucket) for bucket in self.buckets]
        self.arrived: set[int] = set()
        self.all_reduce = all_reduce
        self.launched = 0
        self.in_flight: list[tuple[list[nn.Parameter], torch.Tensor, object, list[int]]] = []

    def ready(self, param: nn.Parameter) -> None:
        """Post-accumulate hook: `param`'s gradient is final for this step."""
        if id(param) in self.arrived:  # its bucket may have left already: a second part would be lost
            raise RuntimeError(
                "a gradient was accumulated twice in the step's last backward (reentrant activation "
                "checkpointing?); the overlapped reduction needs each parameter's gradient once"
            )
        self.arrived.add(id(param))
        self.waiting[self.bucket_of[id(param)]] -= 1
        while self.launched < len(self.buckets) and self.waiting[self.launched] == 0:
            self.launch()

    def launch(self) -> None:
        bucket = self.buckets[self.launched]
        self.launched += 1
        missing = [i for i, p in enumerate(bucket) if p.grad is None]
        for i in missing:  # no gradient on this rank this step: it adds nothing
            bucket[i].grad = torch.zeros_like(bucket[i])
        flags = torch.ones(len(bucket), dtype=bucket[0].grad.dtype, device=bucket[0].grad.device)
        if missing:
            flags[missing] = 0
        flat = torch.cat([*(p.grad.reshape(-1) for p in bucket), flags])
        self.in_flight.append((bucket, flat, self.all_reduce(flat), missing))
        if len(self.in_flight) > MAX_IN_FLIGHT:
            self.land()

    def land(self) -> None:
        """Wait for the oldest bucket in flight and copy its sums back into the gradients."""
        bucket, flat, work, missing = self.in_flight.pop(0)
        if work is not None:
            work.wait()
        offset = 0
        for p in bucket:
            p.grad.copy_(flat[offset : offset + p.numel()].view_as(p.grad))
            offset += p.numel()
        # Only a parameter this rank had no gradient for can have had none anywhere: reading the
        # flags (a device sync on a GPU) is left to the rare bucket that holds one. The memory
        # estimate's world has no values to read.
        if missing and not runtime.is_simulated():
            ranks_with_grad = flat[offset:].tolist()
            for i in missing:
                if ranks_with_grad[i] == 0:
                    bucket[i].grad = None

    def finish(self) -> None:
        while self.launched < len(self.buckets):
            self.launch()
        while self.in_flight:
            self.land()


@contextlib.contextmanager
def summed_over_ranks(model: nn.Module, all_reduce: Callable | None = None) -> Iterator[None]:
    """Around the step's last backward: on exit, every rank holds the sum over ranks of the
    accumulated gradients. `all_reduce(flat)` launches the collective and returns what to wait
    on (or None); the memory estimate passes one that does nothing, for fake tensors."""
    if all_reduce is None:
        if dist.get_world_size() == 1:
            yield
            return
        all_reduce = _all_reduce_async
    params = [p for p in model.parameters() if p.requires_grad]
    buckets = _Buckets(params, all_reduce)
    hooks = [p.register_post_accumulate_grad_hook(buckets.ready) for p in params]
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()
    buckets.finish()
