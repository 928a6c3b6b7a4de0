"""The replicated layout's overlapped gradient sum (accum_cli/parallel/reduce.py) in a real gloo run,
started by torchrun; each rank writes OUT_JSON.RANK.

Usage: torchrun --nproc_per_node=2 tests/reduce_probe.py OUT_JSON

A chain of small linear layers, with buckets shrunk so each layer is about one, and the cases
that make ranks differ: a layer only rank 0 uses in the last microbatch (its bucket waits for
the end of backward there, not on rank 1, which has no gradient for it at all), a layer no rank
uses in the last microbatch but both used before, a layer nobody ever uses (no gradient on any
rank: it must keep none), and a float64 parameter (a bucket
of its own dtype). Two microbatches are accumulated, the last inside `summed_over_ranks`; the
reference accumulates the same on a copy and sums each gradient with its own all-reduce.
"""

from __future__ import annotations

import copy
import json
import sys

import torch
import torch.distributed as dist
from torch import nn

from accum_cli.parallel import reduce

WIDTH, DEPTH = 32, 6


class Chain(nn.Module):
    """Parameters registered in the order the forward uses them, as in a transformer."""

    def __init__(self) -> None:
        super().__init__()
        self.never = nn.Linear(WIDTH, WIDTH)  # the last bucket: it waits for the end of backward
        self.low = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH // 2))
        self.rank0_only = nn.Linear(WIDTH, WIDTH)  # in the last microbatch, on rank 0 alone
        self.first_only = nn.Linear(WIDTH, WIDTH)  # in the first microbatch only, on both ranks
        self.high = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH // 2))
        self.scale = nn.Parameter(torch.tensor(1.5, dtype=torch.float64))

    def forward(self, x: torch.Tensor, last: bool) -> torch.Tensor:
        for layer in self.low:
            x = torch.tanh(layer(x))
        if not last:
            x = x + self.first_only(x)
        elif dist.get_rank() == 0:
            x = x + self.rank0_only(x)
        for layer in self.high:
            x = torch.tanh(layer(x))
        return (x * self.scale.float()).pow(2).sum()


def main() -> None:
    out_path = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = Chain()
    reference = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(100 + rank)
    inputs = [torch.randn(4, WIDTH, generator=generator) for _ in range(2)]

    reduce.FIRST_BUCKET_BYTES = reduce.BUCKET_BYTES = WIDTH * WIDTH * 4  # about one layer per bucket
    ready = []  # parameter names in the order their last gradient arrived
    names = {id(p): name for name, p in model.named_parameters()}
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: ready.append(names[id(p)]))
    launches = []  # at each launch: how many gradients had arrived, and the bucket's size

    def all_reduce(flat: torch.Tensor):
        launches.append({"arrived": len(ready), "numel": flat.numel(), "dtype": str(flat.dtype)})
        return reduce._all_reduce_async(flat)

    model(inputs[0], last=False).backward()
    ready.clear()
    with reduce.summed_over_ranks(model, all_reduce):
        model(inputs[1], last=True).backward()
    arrived_in_last = len(ready)

    for x, last in zip(inputs, (False, True), strict=True):
        reference(x, last=last).backward()
    errors, no_grad = {}, []
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        expected = q.grad.clone() if q.grad is not None else torch.zeros_like(q)
        dist.all_reduce(expected)
        if p.grad is None:
            no_grad.append(name)
            continue
        errors[name] = float((p.grad - expected).abs().max() / expected.abs().max().clamp_min(1e-30))
    with open(f"{out_path}.{rank}", "w") as f:
        json.dump({"launches": launches, "arrived_in_last": arrived_in_last, "errors": errors, "no_grad": no_grad}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
