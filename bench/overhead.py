"""Overhead of accum-train's training step against a minimal hand-written FSDP2 loop.

Both contestants train the same model (same seed), on the same tokens, split into the
same microbatches, on the same 2-rank gloo mesh, in the same processes, for each sync
policy. accum-train runs its real code path (model.shard, optim.build, Plan,
MicrobatchReader -> collate, loop.train_step), timed as accum_cli/run/train.py times a step:
reading the microbatches included. The hand-written loop is the least a user must write to
get the same, correct training: fully_shard per decoder layer and root, sum reductions,
a global loss-token count, sum-CE / count per microbatch, the sync flags, clip, AdamW.

    make bench-overhead                         # or: .venv/bin/python bench/overhead.py
    .venv/bin/python bench/overhead.py --quick  # smoke run, well under a minute

Run directly, it relaunches itself under torchrun (2 ranks, OMP_NUM_THREADS=1 each, so
the two ranks share a 2-core machine without oversubscribing it); rank 0 prints the table.
It exits 0 whatever the ratios are (a benchmark, not a test) and non-zero only on a crash.
"""

from __future__ import annotations

import argparse
import gc
import os
import resource
import socket
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from accum_cli.model import wrap

# transformers, datasets and accum_cli are imported where used: the launcher needs none of them.

TARGET_RATIO = 0.97  # accum-train may cost at most 3% of the hand-written loop's throughput
# Other processes' share of the CPUs above which the ratios say more about them than about us.
BUSY_SHARE = 0.05
POLICIES = ("every", "last", "last-keep-params")
VOCAB = 384  # the embedded model's byte-level vocabulary
DATA_SEED = 1234


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=3, help="timed optimizer steps per contestant per repetition")
    p.add_argument(
        "--reps", type=int, default=4, help="repetitions, each with fresh models; even keeps the build order balanced"
    )
    p.add_argument("--layers", type=int, default=4, help="Llama decoder layers")
    p.add_argument("--hidden", type=int, default=256, help="Llama hidden size (head dim 64)")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--global-batch", type=int, default=32, help="G: sequences per optimizer step, all ranks")
    p.add_argument("--micro-batch", type=int, default=4, help="m: sequences per forward/backward")
    p.add_argument("--policies", default=",".join(POLICIES), help="comma-separated sync policies to compare")
    p.add_argument("--nproc", type=int, default=2, help="gloo ranks (one thread each)")
    p.add_argument(
        "--quick", action="store_true", help="tiny model, few steps: checks the script runs (its ratios are noise)"
    )
    p.add_argument(
        "--control",
        action="store_true",
        help="A/A run: the hand-written loop against itself, to see this machine's noise floor",
    )
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.reps, args.layers, args.hidden, args.seq_len = 2, 2, 2, 128, 64
        args.global_batch, args.micro_batch = 16, 4
    args.policies = [x.strip() for x in args.policies.split(",") if x.strip()]
    unknown = [x for x in args.policies if x not in POLICIES]
    if unknown:
        p.error(f"unknown --policies {', '.join(unknown)}; use some of {', '.join(POLICIES)}")
    if min(args.steps, args.reps, args.layers, args.nproc) < 1 or args.hidden % 64 or args.seq_len < 2:
        p.error("--steps, --reps, --layers, --nproc must be >= 1, --hidden a multiple of 64, --seq-len >= 2")
    # The hand-written loop is minimal: like most user loops it assumes every rank gets whole,
    # equal microbatches. (accum-train would handle the ragged case; it is not what we time.)
    if args.global_batch % (args.micro_batch * args.nproc):
        p.error("--global-batch must be a multiple of --micro-batch x --nproc")
    return args


# --------------------------------------------------------------------------- launcher


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args: argparse.Namespace) -> int:
    """Re-run this file under torchrun; rank 0's output is the report."""
    torchrun = Path(sys.executable).parent / "torchrun"
    cmd = [
        str(torchrun),
        f"--nproc_per_node={args.nproc}",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        str(Path(__file__).resolve()),
        *sys.argv[1:],
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", PYTHONUNBUFFERED="1")
    return subprocess.run(cmd, env=env).returncode


# --------------------------------------------------------------------------- shared setup


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    """The embedded Llama's config at the chosen size; identical initial weights on every rank."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from accum_cli.model.load import EMBEDDED_MODEL_DIR

    heads = args.hidden // 64
    config = LlamaConfig.from_pretrained(
        EMBEDDED_MODEL_DIR,
        vocab_size=VOCAB,
        num_hidden_layers=args.layers,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 688 // 256,  # the embedded model's MLP ratio
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=max(1024, args.seq_len),
        use_cache=False,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    return model.train()


def token_data(args: argparse.Namespace) -> torch.Tensor:
    """The global batch: G random, unpadded sequences; every rank draws the same ones."""
    g = torch.Generator().manual_seed(DATA_SEED)
    return torch.randint(3, VOCAB, (args.global_batch, args.seq_len), generator=g)  # 0-2: pad/eos/unk


def train_config(args: argparse.Namespace):
    from accum_cli.config.settings import TrainConfig

    # A constant LR keeps both contestants on the same numbers step after step; the other
    # values are the product's defaults, which the hand-written loop copies.
    return TrainConfig(
        global_batch=args.global_batch,
        micro_batch=args.micro_batch,
        seq_len=args.seq_len,
        warmup_steps=0,
        lr_schedule="constant",
        precision="fp32",
    ).validate()


# --------------------------------------------------------------------------- contestants


class AccumTrain:
    """accum-train's own code path, step for step as accum_cli/run/train.py runs it."""

    name = "accum-train"

    def __init__(self, args: argparse.Namespace, mesh, rank: int, sync: str, ids: torch.Tensor):
        import numpy as np

        from accum_cli.config.plan import Plan
        from accum_cli.data import batches as data
        from accum_cli.data import store
        from accum_cli.parallel import sharding
        from accum_cli.step import optim
        from accum_cli.step.loop import train_step

        class InOrder(data.SampleOrder):
            """The product's order, unshuffled, so both contestants read identical microbatches."""

            def permutation(self, epoch: int) -> np.ndarray:
                return np.arange(self.n_rows)

        self.cfg = train_config(args)
        self.plan = Plan(args.global_batch, args.micro_batch, args.nproc)
        self.rank, self.sync, self.device = rank, sync, torch.device("cpu")
        # The settings the product derives from this config on CPU (fp32, reshard after forward).
        self.model = wrap.shard(build_model(args), mesh, sharding.resolve(self.cfg, "cpu"))
        self.optimizer, self.scheduler = optim.build(self.model, self.cfg, total_steps=10**6)
        # Prepared data laid out as packed text is (one flat token array, seq_len blocks),
        # read the way the product reads its data every step.
        dataset = store.Prepared(ids.numpy().reshape(-1).astype(store.token_dtype(VOCAB)), ids.shape[1])
        self.reader = data.MicrobatchReader(dataset, InOrder(len(dataset), seed=0), pad_id=0)
        self.train_step = train_step
        self.step_index = 0

    def step(self) -> float:
        microbatches = [
            self.reader.read(self.plan.microbatch_range(self.step_index, self.rank, j))
            for j in range(self.plan.accum_steps)
        ]
        result = self.train_step(
            self.model,
            self.optimizer,
            self.scheduler,
            microbatches,
            self.sync,
            self.cfg.grad_clip,
            self.device,
            self.step_index,
        )
        self.step_index += 1
        return result.grad_norm


class HandWritten:
    """The minimal correct FSDP2 accumulation loop a user would write, with no accum_cli code."""

    name = "hand-written"

    def __init__(self, args: argparse.Namespace, mesh, rank: int, sync: str, ids: torch.Tensor):
        cfg = train_config(args)  # only to copy the same hyperparameter values
        self.sync, self.grad_clip = sync, cfg.grad_clip
        model = build_model(args)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        # The loss is divided by the global token count, so FSDP must sum, not average; on
        # gloo that needs forced SUM reductions too (no PREMUL_SUM), on every FSDP module.
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)
        self.model = model
        params = list(model.parameters())
        self.optimizer = torch.optim.AdamW(
            [
                {"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg.weight_decay},
                {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
            ],
            lr=cfg.lr,
            betas=(cfg.adam_beta1, cfg.adam_beta2),
            eps=cfg.adam_eps,
        )
        per_rank = args.global_batch // args.nproc
        self.rows = ids[rank * per_rank : (rank + 1) * per_rank]  # this rank's share, in memory
        self.micro_batch = args.micro_batch

    def step(self) -> torch.Tensor:
        batches = self.rows.split(self.micro_batch)
        labels = batches  # causal LM on unpadded rows: labels are the inputs, shifted below
        count = sum((y[:, 1:] != -100).sum() for y in labels)
        dist.all_reduce(count)  # every rank divides by the whole global batch's token count
        for i, (x, y) in enumerate(zip(batches, labels, strict=True)):
            is_last = i == len(batches) - 1
            if self.sync != "every":
                self.model.set_requires_gradient_sync(is_last)
            if self.sync == "last-keep-params":
                self.model.set_reshard_after_backward(is_last)
            logits = self.model(input_ids=x).logits
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), y[:, 1:].flatten(), reduction="sum")
            (loss / count).backward()
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm


class HandWrittenTwin(HandWritten):
    """--control: the hand-written loop in accum-train's seat, so the ratio shows the noise floor."""

    name = "hand-written #2"


def contestants_for(args: argparse.Namespace) -> tuple[type, type]:
    """(measured, baseline): the ratio is measured / baseline."""
    return (HandWrittenTwin if args.control else AccumTrain), HandWritten


# --------------------------------------------------------------------------- measurement


@dataclass
class PolicyResult:
    policy: str
    tokens_per_s: dict[str, list[float]]  # contestant -> one figure per repetition
    warmup_grad_norm: dict[str, float]


def as_float(norm: float | torch.Tensor) -> float:
    return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)


def timed_step(contestant) -> float:
    """Seconds for one whole optimizer step, as the slowest rank sees it."""
    gc.collect()  # start from the same heap state, not the other contestant's garbage
    dist.barrier()
    started = time.perf_counter()
    contestant.step()
    dist.barrier()  # the step ends when every rank is done with it
    return time.perf_counter() - started


def measure(args: argparse.Namespace, mesh, rank: int, sync: str, ids: torch.Tensor) -> PolicyResult:
    tokens_per_step = int(ids.numel())  # no padding: every token of the global batch counts
    classes = contestants_for(args)
    rates: dict[str, list[float]] = {cls.name: [] for cls in classes}
    warmup: dict[str, float] = {}
    for rep in range(args.reps):
        # Fresh models every repetition: two identical instances of one loop can differ by a
        # percent or two for the whole life of the instance (where its tensors landed in
        # memory), so a model kept across repetitions could favour one contestant throughout.
        # Who is built first alternates as well, in case the build order matters.
        order = classes if rep % 2 == 0 else classes[::-1]
        contestants = [cls(args, mesh, rank, sync, ids) for cls in order]
        for c in contestants:
            # Not timed: lazy FSDP init, first-call allocations, AdamW state creation.
            warmup.setdefault(c.name, as_float(c.step()))
        seconds = {c.name: 0.0 for c in contestants}
        # Contestants alternate step by step, and who goes first alternates too (A B B A ...),
        # so a burst of machine noise or a drift hits both alike.
        for i in range(args.steps):
            for c in contestants if i % 2 == 0 else contestants[::-1]:
                seconds[c.name] += timed_step(c)
        for name, total in seconds.items():
            rates[name].append(args.steps * tokens_per_step / total)
        del contestants
        gc.collect()  # FSDP modules hold reference cycles: free the old models before new ones
    return PolicyResult(sync, rates, warmup)


def busy_cpu_seconds() -> float | None:
    """CPU seconds spent by everything on this machine so far (Linux /proc/stat), or None."""
    try:
        with open("/proc/stat") as stat:
            ticks = [int(x) for x in stat.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    user, nice, system, idle, iowait, irq, softirq, steal = ticks
    # steal counts as busy: a hypervisor taking our cores is contention too
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def own_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)  # all threads of this rank, gloo's included
    return usage.ru_utime + usage.ru_stime


def ratio_line(values: list[float]) -> str:
    return f"{min(values):.3f}-{max(values):.3f}" if len(values) > 1 else f"{values[0]:.3f}"


def report(args: argparse.Namespace, results: list[PolicyResult], elapsed: float, others_share: float | None) -> None:
    acc, hand = (cls.name for cls in contestants_for(args))
    print(
        f"\nLlama {args.layers} layers x {args.hidden}, vocab {VOCAB}, seq {args.seq_len}, "
        f"G={args.global_batch}, m={args.micro_batch}, {args.nproc} gloo ranks on CPU (1 thread each); "
        f"{args.reps} reps x {args.steps} timed steps per contestant and policy\n"
    )
    wa, wh = len(acc) + 8, len(hand) + 8
    header = f"{'policy':<18}{acc + ' tok/s':>{wa}}{hand + ' tok/s':>{wh}}{'ratio':>8}   {'per-rep ratios'}"
    print(header)
    print("-" * len(header))
    verdicts = []
    for r in results:
        a, h = statistics.median(r.tokens_per_s[acc]), statistics.median(r.tokens_per_s[hand])
        per_rep = [x / y for x, y in zip(r.tokens_per_s[acc], r.tokens_per_s[hand], strict=True)]
        print(f"{r.policy:<18}{a:>{wa}.0f}{h:>{wh}.0f}{a / h:>8.3f}   {ratio_line(per_rep)}")
        verdicts.append((r.policy, a / h, per_rep))
    print(f"(tokens/s: median over repetitions; ratio: {acc} / {hand})\n")
    for r in results:
        na, nh = r.warmup_grad_norm[acc], r.warmup_grad_norm[hand]
        same = abs(na - nh) <= 1e-4 * max(abs(nh), 1e-12)
        note = "same training" if same else "MISMATCH: the contestants do not compute the same step"
        print(f"check {r.policy:<18}first-step grad norm {na:.6f} vs {nh:.6f}: {note}")
    if others_share is not None:
        note = " (noisy: rerun on an idle machine)" if others_share > BUSY_SHARE else ""
        print(f"check machine           other processes used {others_share:.0%} of the CPUs while measuring{note}")
    print()
    busy = others_share is not None and others_share > BUSY_SHARE
    for policy, ratio, per_rep in verdicts:
        verdict = "PASS" if ratio >= TARGET_RATIO else "FAIL"
        print(
            f"{verdict} {policy}: {acc} runs at {ratio:.3f}x the {hand} loop's tokens/s "
            f"(target >= {TARGET_RATIO}; per-rep {ratio_line(per_rep)})"
            + (", inconclusive: machine busy" if busy else "")
        )
    print(f"\nbench took {elapsed:.0f} s")


def run_rank(args: argparse.Namespace) -> None:
    from accum_cli.parallel import runtime

    started = time.perf_counter()
    rt = runtime.start()
    if rt.world_size != args.nproc:
        raise RuntimeError(f"launched with {rt.world_size} ranks; pass --nproc {rt.world_size}")
    mesh = rt.mesh()
    ids = token_data(args)
    dist.barrier()
    busy_before, own_before, measuring = busy_cpu_seconds(), own_cpu_seconds(), time.perf_counter()
    results = []
    for sync in args.policies:
        results.append(measure(args, mesh, rt.rank, sync, ids))
        if rt.is_main:
            print(f"measured {sync} ({time.perf_counter() - started:.0f} s)", flush=True)
    # Whatever CPU time the machine spent beyond our ranks' own went to other work: the
    # one thing that makes these ratios meaningless, so it is measured, not guessed.
    own = torch.tensor(own_cpu_seconds() - own_before, dtype=torch.float64)
    dist.all_reduce(own)
    busy_after, wall = busy_cpu_seconds(), time.perf_counter() - measuring
    others_share = None
    if busy_before is not None and busy_after is not None:
        others = max(busy_after - busy_before - float(own), 0.0)
        others_share = others / (wall * (os.cpu_count() or 1))
    if rt.is_main:
        report(args, results, time.perf_counter() - started, others_share)
    # gloo ranks can abort or hang in interpreter finalisation (docs/ARCHITECTURE.md): barrier,
    # destroy the group, flush, os._exit.
    runtime.exit_process(0)


def main() -> None:
    args = parse_args()
    if "RANK" not in os.environ:
        sys.exit(launch(args))
    from accum_cli.parallel import runtime

    try:
        run_rank(args)  # ends the process itself
    except Exception:
        # A gloo rank can hang in interpreter finalisation after an error too: print, then
        # leave without it; torchrun stops the other ranks and reports the failure.
        traceback.print_exc()
        runtime.exit_process(1)


if __name__ == "__main__":
    main()
