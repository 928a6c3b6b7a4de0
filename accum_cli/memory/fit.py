"""What fits a rank: the micro batch and the sync policy, chosen from the memory estimate.

The budget is the device memory times BUDGET_SHARE: the estimate counts the bytes of tensors
only, while the CUDA context (0.5-1 GiB), NCCL's buffers and the caching allocator's
fragmentation take the rest. On CPU the device memory is the free RAM shared by the local ranks.

`--micro-batch auto` looks for the largest m <= ceil(G/W) that fits under the leanest policy
(`every`, `hsdp-defer` on a 2-D mesh, or the one requested); the sync policy is then chosen at
that m. The search leans on one fact: the step's peak is the largest, over the moments of the
step, of the bytes live at that moment, and each tensor's size is affine in m (the same ops run
for any m; a batch dimension or none), so the peak is a maximum of affine functions of m: convex.
Which moment holds the peak changes with m (AdamW's state at small m, the activations at large
m), so two small m do not predict a large one. But the line through two micro batches that do
not fit, extended down, stays at or below the peak: every m beyond where it crosses the budget
does not fit either. Walking down from ceil(G/W) along such lines finds the largest m that fits
in a few estimates (3-5), each one proved by measurement, never by extrapolation.
"""

from __future__ import annotations

import bisect
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

from accum_cli.config import policy
from accum_cli.config.plan import Plan
from accum_cli.errors import UserError
from accum_cli.loss import fused_loss
from accum_cli.memory import estimate
from accum_cli.memory.query import KINDS, Estimate, Query

AUTO = "auto"
BUDGET_SHARE = 0.85


@dataclass(frozen=True, slots=True)
class Target:
    """What the estimate needs besides the micro batch and the policy."""

    model_config: dict
    global_batch: int
    world_size: int
    replicas: int
    seq_len: int
    bf16: bool
    activation_checkpointing: bool
    reshard_after_forward: bool = True
    strict_batch: bool = False
    replicated: bool = False  # the replicated layout (layout.py): whole model, one reduction per step
    device_type: str = "cpu"  # the run's devices: "cuda" or "cpu"
    lora: dict | None = None  # LoRA's settings (model/lora.py `spec`), None for full fine-tuning

    def query(self, sync: str, micro_batch: int) -> Query:
        return Query(
            self.model_config, self.world_size, self.replicas, micro_batch, self.seq_len, sync, self.bf16,
            self.activation_checkpointing, self.reshard_after_forward, replicated=self.replicated,
            device_type=self.device_type, lora=self.lora,
        )  # fmt: skip

    def switch(self) -> int | None:
        """Under bf16, the micro batch from which on the fused loss takes the head (fused_loss.fuses: enough
        rows per microbatch), below which the head projects whole logits: the peak is convex in m on either
        side of it, not across it (the fused step holds less from there on). None: no such micro batch known."""
        hidden, vocab = self.model_config.get("hidden_size"), self.model_config.get("vocab_size")
        if not self.bf16 or not isinstance(hidden, int) or not isinstance(vocab, int):
            return None
        least = fused_loss.bf16_min_rows(hidden, vocab)
        return None if least is None else -(-least // self.seq_len)

    def under(self, sync: str) -> str:
        return "--layout replicate" if self.replicated else f"--sync {sync}"


@dataclass(frozen=True, slots=True)
class Budget:
    device_bytes: int
    where: str

    @property
    def bytes(self) -> int:
        return int(self.device_bytes * BUDGET_SHARE)

    def describe(self) -> str:
        return f"{gib(self.bytes)} per rank = {BUDGET_SHARE:.0%} of {gib(self.device_bytes)} ({self.where})"


@dataclass(frozen=True, slots=True)
class Fit:
    micro_batch: int
    micro_reason: str
    decision: policy.Decision
    estimates: dict[str, Estimate]  # per policy, at micro_batch
    per_sequence: int  # bytes one more sequence in a microbatch adds (0: not measured)
    seconds: float
    cached: bool


def candidates(replicas: int) -> tuple[str, ...]:
    """The policies `auto` considers, least communication first."""
    lean = policy.HSDP_DEFER if replicas > 1 else policy.EVERY
    return (policy.LAST_KEEP_PARAMS, policy.LAST, lean)


def fit(target: Target, micro_batch: int | str, sync: str, budget: Budget, show_all: bool = False) -> Fit:
    """Resolve `auto` micro batch and sync policy from estimates (cached); `show_all` (--plan)
    estimates every policy and the per-sequence growth even when nothing is left to choose."""
    started = time.perf_counter()
    spent: list[Estimate] = []
    with estimate.Session() as session:  # one child process for all the estimates of this decision

        def run(queries: list[Query]) -> list[Estimate]:
            found = session.estimate(queries)
            spent.extend(found)
            return found

        lean = sync if sync != AUTO else candidates(target.replicas)[-1]
        cap = -(-target.global_batch // target.world_size)
        per_sequence = 0
        if micro_batch == AUTO:
            micro_batch, micro_reason, per_sequence = _auto_micro_batch(target, lean, cap, budget, run)
        else:
            micro_reason = "as requested"
        plan = Plan(target.global_batch, micro_batch, target.world_size)
        deferring = plan.world_size > 1 and plan.accum_steps > 1
        policies = candidates(target.replicas) if (sync == AUTO and deferring) or show_all else ()
        if sync != AUTO and sync not in policies and show_all:
            policies = (*policies, sync)
        if plan.accum_steps > 1 or not policies:
            found = dict(zip(policies, run([target.query(p, micro_batch) for p in policies]), strict=True))
        else:  # one microbatch is the last one: every policy runs the same step, so one estimate serves all
            found = dict.fromkeys(policies, run([target.query(lean, micro_batch)])[0])
        if show_all and not per_sequence:
            bigger = run([target.query(lean, 2 * micro_batch)])[0]
            per_sequence = max((bigger.peak - found[lean].peak) // micro_batch, 0)
    peaks = {p: e.peak for p, e in found.items()}
    decision = policy.choose(sync, plan, peaks, budget.bytes, target.replicas)
    seconds = time.perf_counter() - started
    return Fit(micro_batch, micro_reason, decision, found, per_sequence, seconds, all(e.cached for e in spent))


def fit_replicated(target: Target, micro_batch: int | str, budget: Budget) -> tuple[int, str, Estimate]:
    """The replicated layout's micro batch (`auto`: the largest that fits it) and its estimate there."""
    target = replace(target, replicated=True)
    cap = -(-target.global_batch // target.world_size)
    with estimate.Session() as session:
        if micro_batch == AUTO:
            micro_batch, micro_reason, _ = _auto_micro_batch(target, policy.LAST, cap, budget, session.estimate)
        else:
            micro_reason = "as requested"
        return micro_batch, micro_reason, session.estimate([target.query(policy.LAST, micro_batch)])[0]


def one_process_forward(target: Target, budget: Budget, extra_per_sample: int = 0) -> tuple[int, int]:
    """The most samples, up to the global batch, that one forward of a one-process replicated step holds
    under the budget, and the estimated peak there. `extra_per_sample`: bytes a caller's step holds per
    sample beyond what the estimate counts (verify's plain reference computes whole fp32 logits), added
    to each estimate (still convex in m). UserError where one sample does not fit."""
    target = replace(target, world_size=1, replicas=1, replicated=True, strict_batch=False)
    with estimate.Session() as session:

        def run(queries: list[Query]) -> list[Estimate]:
            found = session.estimate(queries)
            return [
                replace(e, peak=e.peak + extra_per_sample * q.micro_batch) for e, q in zip(found, queries, strict=True)
            ]

        whole = run([target.query(policy.LAST, target.global_batch)])[0]
        if whole.peak <= budget.bytes:  # the common case: one estimate
            return target.global_batch, whole.peak
        m, _, _ = _auto_micro_batch(target, policy.LAST, target.global_batch, budget, run)
        return m, run([target.query(policy.LAST, m)])[0].peak


def _auto_micro_batch(target: Target, lean: str, cap: int, budget: Budget, run) -> tuple[int, str, int]:
    allowed = _allowed_micro_batches(target, cap)
    peaks: dict[int, int] = {}

    def measure(*micro_batches: int) -> None:
        new = sorted(set(micro_batches) - peaks.keys())
        peaks.update(zip(new, (e.peak for e in run([target.query(lean, m) for m in new])), strict=True))

    measure(1, allowed[-1])
    one = peaks[1]
    if one > budget.bytes:
        raise UserError(
            f"one sequence of {target.seq_len} tokens per microbatch needs an estimated {gib(one)} per rank under "
            f"{target.under(lean)}, above the budget of {budget.describe()}; the smallest device memory that works "
            f"is {gib(int(one / BUDGET_SHARE) + 1)}: use "
            + ("--layout shard (or auto)" if target.replicated else "more ranks, --sync every")
            + ", --activation-checkpointing or a shorter --seq-len"
        )
    while True:
        fitting = max(m for m, peak in peaks.items() if peak <= budget.bytes)
        over = sorted(m for m, peak in peaks.items() if peak > budget.bytes)
        bound = _last_possible(over, peaks, budget.bytes, target.switch()) if len(over) >= 2 else cap
        below = min(over[0] if over else cap + 1, math.floor(bound) + 1)  # the next one measured: under this
        largest = bisect.bisect_left(allowed, below) - 1
        if largest < 0 or allowed[largest] <= fitting:
            break
        measure(allowed[largest])
    m, peak = fitting, peaks[fitting]
    over_m = over[0] if over else None
    per_sequence = (peaks[over_m] - peak) // (over_m - m) if over_m else (peak - one) // max(m - 1, 1)
    limit = f"= ceil(G/W) = {cap}: one microbatch per step" if m == cap else f"<= ceil(G/W) = {cap}"
    under = "the replicated layout" if target.replicated else lean
    reason = f"largest that fits ({limit}): estimated {gib(peak)} under {under} vs budget {gib(budget.bytes)}"
    return m, reason, max(per_sequence, 0)


def _allowed_micro_batches(target: Target, cap: int) -> Sequence[int]:
    """The micro batches auto may choose, ascending: 1..cap, or under --strict-batch those that
    divide G evenly at this world size (1 always). A sequence, not a list: G may be huge."""
    if not target.strict_batch:
        return range(1, cap + 1)
    return Plan(target.global_batch, 1, target.world_size).valid_micro_batches() or [1]


def _last_possible(over: list[int], peaks: dict[int, int], budget: int, switch: int | None = None) -> float:
    """The largest m that may fit, from the two smallest measured micro batches that do not: the
    line through them, extended down, lies at or below the (convex) peak, so no m beyond the point
    where it crosses the budget fits. Under bf16 the peak is convex on either side of `switch`
    (Target.switch), not across it: two on either side give no line (b: the next m measured lies
    below a), and a line through two above it says nothing of an m below it."""
    a, b = over[0], over[1]
    if switch is not None and a < switch <= b:
        return b
    slope = (peaks[b] - peaks[a]) / (b - a)
    bound = a - (peaks[a] - budget) / slope if slope > 0 else a - 1
    return max(bound, switch - 1) if switch is not None and a >= switch else bound


def describe(target: Target, result: Fit, budget: Budget, more: list[str] = ()) -> list[str]:
    """The per-policy table: estimated peak per rank, its breakdown, and the micro batches that fit
    (`more`: rows of the replicated layout, added to the table)."""
    lines = [
        f"budget            {budget.describe()}",
        f"estimated at      micro batch {result.micro_batch}, seq len {target.seq_len}, "
        f"{'bf16' if target.bf16 else 'fp32'}"
        + (", activation checkpointing" if target.activation_checkpointing else "")
        + f" (in {result.seconds:.1f} s{', from the cache' if result.cached else ''})",
    ]
    plan = Plan(target.global_batch, result.micro_batch, target.world_size)
    cap = -(-target.global_batch // target.world_size)
    for name, found in result.estimates.items():
        parts = ", ".join(f"{kind.replace('_', ' ')} {gib(found.breakdown[kind])}" for kind in KINDS)
        verdict = "fits" if found.peak <= budget.bytes else "does NOT fit"
        fits = ""
        if result.per_sequence:
            room = (budget.bytes - found.peak) // result.per_sequence
            largest = max(0, min(cap, result.micro_batch + room))
            fits = f"; micro batches that fit: {'none' if largest < 1 else f'1-{largest}'}"
        lines += [
            f"  {name:<17} peak {gib(found.peak)}, {verdict}{fits}",
            f"  {'':<17} {parts}",
            f"  {'':<17} {policy.collectives_per_step(name, plan.accum_steps, target.replicas)} per decoder layer per step",
        ]
    lines += more
    if result.per_sequence:
        lines.append(f"per sequence      +{gib(result.per_sequence)} per rank for each sequence in a microbatch")
    return lines


def describe_replicated(found: Estimate, budget: Budget, micro_batch: int) -> list[str]:
    """The replicated layout's row of the table: its estimated peak and breakdown."""
    parts = ", ".join(f"{kind.replace('_', ' ')} {gib(found.breakdown[kind])}" for kind in KINDS[1:])
    verdict = "fits" if found.peak <= budget.bytes else "does NOT fit"
    return [
        f"  {'replicated':<17} peak {gib(found.peak)} at micro batch {micro_batch}, {verdict}",
        f"  {'':<17} whole params {parts.removeprefix('unsharded params ')}",
        f"  {'':<17} one bucketed all-reduce of the gradients per step, no per-layer collectives",
    ]


def gib(n_bytes: int) -> str:
    return f"{n_bytes / 2**20:.1f} MiB" if n_bytes < 2**30 else f"{n_bytes / 2**30:.2f} GiB"
