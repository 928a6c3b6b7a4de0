"""Peak memory of the loss step, the output projection fused with the loss (fused_loss.py) or not.

    .venv/bin/python bench/fused_memory.py [--rows 2048 8192] [--hidden 2048] [--vocab 32768 131072]
                                           [--device cuda cpu] [--crossover]

The step: the output projection of `rows` hidden states (micro batch 1 and 4 x seq 2048 by default)
onto a 32K and a 128K vocabulary and the loss, forward and backward, as the run computes it: unfused,
`F.linear` then the run's own `tokens.token_loss_sum` on whole logits; fused,
`fused_loss.token_loss_sum` (whatever its rule, `fuses`, would choose). The figure is the most bytes
alive at once beyond the hidden states and the weight themselves, their gradients included. In fp32
and in the two forms of bf16 mixed precision: FSDP2's bf16 copies (bf16 hidden states and gathered
weight) and the replicated layout's autocast over fp32 master weights. `--device` names whose fused
bf16 path is counted: a GPU's (bf16 GEMMs, fused_bf16.py) or a CPU's (the same on fp32 copies of the
bf16 values, cpu/bf16.py); the unfused step and the fp32 one are the same on both.

Counted without computing (a 128K bf16 head takes minutes on this CPU): on fake tensors, each
tensor's bytes from its allocation to its last reference (PyTorch's MemTracker). They lie on the CPU
(autograd cannot run a fake CUDA tensor's backward without CUDA): the fused path is told the device
it stands for, as the memory estimate tells it. Under fake tensors torch's chunked kernel (the fp32
fused path), a custom op, allocates only what it returns, so here its own Python body runs op by op
instead: its chunk buffers are counted too. The method is first held against the allocator's own
record (the profiler's) of the same steps on real CPU tensors at small sizes: they agree but for the
unfused bf16 loss, by the temporary torch.logsumexp allocates inside its kernel for each chunk's fp32
copy of the logits (tokens.py; at most 32 MiB), which no count of tensors sees; the fused bf16 path
has the same one, per part of a chunk. The `estimate` column is what the memory estimate counts for
the fused step (memory/measure.py: the kernel's outputs and fused_loss's stand-in for its buffers,
the first and last chunk). `--crossover`: for each vocabulary and bf16 form, the fewest rows (a
multiple of 256) from which on the fused step holds less than the unfused one, against
fused_loss.BF16_ROWS_PER_FEATURE (its rule, `bf16_min_rows`).
"""

from __future__ import annotations

import argparse
import contextlib
import time
from unittest import mock

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker
from torch.nn.modules import linear_cross_entropy as lce
from torch.profiler import ProfilerActivity, profile

from accum_cli import torch_compat
from accum_cli.loss import fused_loss, tokens
from accum_cli.parallel import runtime

MiB = 2**20
PRECISIONS = ("fp32", "bf16 (FSDP2 copies)", "bf16 (autocast)")


def _decomposed(*args):
    """torch's chunked kernel (torch_compat.linear_cross_entropy_chunked) as its Python body, op by op."""
    *head, _allow_retain_graph, wants_input, wants_weight, wants_bias = args
    return lce._linear_cross_entropy_batch_chunked_accumulator(*head, wants_input, wants_weight, wants_bias)


def step(fused: bool, precision: str, rows: int, hidden_size: int, vocab: int, fake: bool):
    """The inputs (hidden states, weight, labels) and a function running the loss step on them."""
    dtype = torch.bfloat16 if precision.startswith("bf16 (FSDP2") else torch.float32
    compute = torch.float32 if precision == "fp32" else torch.bfloat16
    generator = None if fake else torch.Generator().manual_seed(0)
    hidden = torch.randn(1, rows, hidden_size, generator=generator).to(dtype).requires_grad_()
    weight = (torch.randn(vocab, hidden_size, generator=generator) * hidden_size**-0.5).to(dtype).requires_grad_()
    labels = torch.randint(0, vocab, (1, rows), generator=generator)

    def run():
        if fused:
            placeholder = fused_loss._Placeholder.apply(hidden, vocab)
            recorded = fused_loss.Recorded(hidden, weight, None, placeholder, dtype=compute)
            loss = fused_loss.token_loss_sum(recorded, labels)
        else:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16 (autocast)"):
                logits = F.linear(hidden, weight)
            loss = tokens.token_loss_sum(logits, labels)
            del logits
        (loss / rows).backward()

    return (hidden, weight, labels), run


def _held(tensors) -> int:
    return sum(t.untyped_storage().nbytes() for t in tensors)


def counted(
    fused: bool, precision: str, rows: int, hidden_size: int, vocab: int, device: str = "cpu", estimate: bool = False
) -> int:
    """Peak bytes beyond the inputs, counted on fake tensors: every chunk, torch's op decomposed, the
    fused bf16 path that of `device`; or (estimate) as the memory estimate of a run on `device` sees it."""
    if estimate:
        context = runtime.simulated(device)
    else:
        context = contextlib.ExitStack()
        context.enter_context(mock.patch.object(torch_compat, "linear_cross_entropy_chunked", _decomposed))
        context.enter_context(mock.patch.object(runtime, "device_type", lambda tensor: device))
    with FakeTensorMode(), context:
        inputs, run = step(fused, precision, rows, hidden_size, vocab, fake=True)
        tracker = MemTracker()
        tracker.track_external(*inputs)
        with tracker:
            run()
        return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"] - _held(inputs)


def allocated(fused: bool, precision: str, rows: int, hidden_size: int, vocab: int) -> int:
    """Peak bytes beyond the inputs, from the CPU allocator's record of a real run of the step."""
    _, run = step(fused, precision, rows, hidden_size, vocab, fake=False)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    held = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        held += event.nbytes()
        peak = max(peak, held)
    return peak


def crossover(precision: str, hidden_size: int, vocab: int, device: str, most: int) -> int | None:
    """The fewest rows (a multiple of 256, up to `most`) from which on the fused step holds less, by
    bisection: fused minus unfused falls as the rows grow (a scan of every multiple of 256 up to 5 x
    hidden found it so for hidden 1024-4096 and both vocabularies, on 6 Dec)."""

    def less(rows: int) -> bool:
        fused, unfused = (counted(f, precision, rows, hidden_size, vocab, device, estimate=True) for f in (True, False))
        return fused < unfused

    low, high = 0, most // 256  # less(256 * high) once shown; never at 256 * low
    if not less(256 * high):
        return None
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if less(256 * middle) else (middle, high)
    return 256 * high


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[2048, 8192], help="micro batch x sequence length")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--vocab", type=int, nargs="+", default=[32768, 131072])
    parser.add_argument("--device", nargs="+", default=["cuda", "cpu"], choices=["cuda", "cpu"])
    parser.add_argument("--crossover", action="store_true", help="also find where fused starts to hold less")
    parser.add_argument("--no-check", action="store_true", help="skip the check against the allocator")
    args = parser.parse_args()
    started = time.perf_counter()

    if not args.no_check:
        print("The count against the allocator's, real CPU tensors (rows x hidden -> vocabulary):")
        for shape in ((256, 128, 8192), (64, 256, 8192)):
            for precision in PRECISIONS:
                for fused in (False, True):
                    real, fake = allocated(fused, precision, *shape), counted(fused, precision, *shape)
                    rows, hidden, vocab = shape
                    print(f"  {f'{rows} x {hidden} -> {vocab}':18} {precision:20} {'fused' if fused else 'unfused':8} "
                          f"allocator {real / MiB:6.2f} MiB, counted {fake / MiB:6.2f} MiB ({(fake - real) / MiB:+.2f})")  # fmt: skip

    for device in args.device:
        print(f"\nPeak of the loss step beyond the hidden states and the weight, MiB (hidden {args.hidden}, fused bf16 "
              f"path: {device}'s):")  # fmt: skip
        print(f"  {'rows':>5} {'vocabulary':>10}  {'precision':20} {'unfused':>8} {'fused':>8} {'fused/unfused':>13} "
              f"{'estimate':>8} {'rule':>8}")  # fmt: skip
        for rows in args.rows:
            for vocab in args.vocab:
                for precision in PRECISIONS:
                    unfused, fused = (counted(f, precision, rows, args.hidden, vocab, device) for f in (False, True))
                    estimate = counted(True, precision, rows, args.hidden, vocab, device, estimate=True)
                    compute = torch.float32 if precision == "fp32" else torch.bfloat16
                    rule = "fused" if fused_loss.fuses(rows, args.hidden, vocab, compute) else "unfused"
                    print(f"  {rows:>5} {vocab:>10}  {precision:20} {unfused / MiB:8.0f} {fused / MiB:8.0f} "
                          f"{fused / unfused:13.2f} {estimate / MiB:8.0f} {rule:>8}")  # fmt: skip
        if args.crossover:
            print("  fused holds less from (rows, the estimate's count; where the rule fuses from):")
            for vocab in args.vocab:
                least = fused_loss.bf16_min_rows(args.hidden, vocab)
                for precision in PRECISIONS[1:]:
                    first = crossover(precision, args.hidden, vocab, device, most=8 * args.hidden)
                    found = f"{first} ({first / args.hidden:.2f} x hidden)" if first else "none"
                    print(f"    {vocab:>7} {precision:20} {found:>24}; the rule: {least}")
    print(f"\n{time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
