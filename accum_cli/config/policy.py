"""Sync policies: when gradients are reduced across ranks during a step's microbatches.

Pure Python, no torch. `choose` resolves `auto` from estimated peaks per rank (estimate.py,
measured by PyTorch's FSDPMemTracker on the user's model): the policy with the least
communication whose peak fits the budget. What each policy costs:

- `every` reduce-scatters after every microbatch: only sharded gradients are kept
- `last` holds the whole model's unsharded gradients between microbatches, reduces once
- `last-keep-params` also keeps the parameters gathered between microbatches
- `hsdp-defer` (2-D mesh) reduce-scatters inside a replica every microbatch and all-reduces
  across replicas once per step, so it holds no more than `every`
"""

from __future__ import annotations

from dataclasses import dataclass

from accum_cli.config.plan import Plan
from accum_cli.errors import UserError

EVERY = "every"
LAST = "last"
LAST_KEEP_PARAMS = "last-keep-params"
HSDP_DEFER = "hsdp-defer"
AUTO = "auto"
POLICIES = (AUTO, EVERY, LAST, LAST_KEEP_PARAMS, HSDP_DEFER)


@dataclass(frozen=True, slots=True)
class ModelSize:
    n_params: int
    compute_bytes: int  # bytes per parameter in forward/backward: 4 (fp32) or 2 (bf16)


@dataclass(frozen=True, slots=True)
class Decision:
    policy: str
    reason: str


@dataclass(frozen=True, slots=True)
class Collectives:
    """The collectives one decoder layer's FSDP group issues in one optimizer step, per rank.

    The one source of truth for these numbers: `--plan` prints them and the tests count them
    in real runs. Layers reshard after forward, so every microbatch gathers a layer twice
    (forward and backward) unless its parameters are kept unsharded between microbatches."""

    all_gathers: int
    reduce_scatters: int  # inside a replica when replicas > 1
    all_reduces: int  # of gradients across replicas (HSDP); 0 with one replica


def collectives(policy: str, accum_steps: int, replicas: int = 1) -> Collectives:
    a = accum_steps
    across = replicas > 1
    if policy == EVERY:
        return Collectives(2 * a, a, a if across else 0)
    if policy == LAST:
        return Collectives(2 * a, 1, 1 if across else 0)
    if policy == LAST_KEEP_PARAMS:
        return Collectives(a + 1, 1, 1 if across else 0)
    if policy == HSDP_DEFER:
        return Collectives(2 * a, a, 1)
    raise ValueError(policy)


def collectives_per_step(policy: str, accum_steps: int, replicas: int = 1) -> str:
    c = collectives(policy, accum_steps, replicas)
    parts = [_count(c.all_gathers, "all-gather"), _count(c.reduce_scatters, "reduce-scatter")]
    if replicas > 1:
        parts[-1] += " in a replica"
        parts.append(_count(c.all_reduces, "all-reduce") + " across replicas")
    return ", ".join(parts)


def _count(n: int, what: str) -> str:
    return f"{n} {what}{'' if n == 1 else 's'}"


def shard_size(plan: Plan, replicas: int) -> int:
    """Ranks one copy of the model is sharded over."""
    if replicas < 1 or plan.world_size % replicas:
        raise UserError(
            f"--replicas {replicas} does not divide the world size {plan.world_size}; "
            f"use a divisor of {plan.world_size}"
        )
    return plan.world_size // replicas


def validate(policy: str) -> str:
    if policy not in POLICIES:
        raise UserError(f"unknown sync policy {policy!r}; use one of: {', '.join(POLICIES)}")
    return policy


def choose(requested: str, plan: Plan, peaks: dict[str, int], budget: int, replicas: int = 1) -> Decision:
    """Resolve the requested policy; `auto` takes the first of `peaks` (least communication
    first) whose estimated peak per rank fits the budget, else the one with the smallest peak."""
    validate(requested)
    shard_size(plan, replicas)
    if requested == HSDP_DEFER and replicas < 2:
        raise UserError("--sync hsdp-defer needs --replicas 2 or more (a 2-D mesh)")
    if requested != AUTO:
        return Decision(requested, "as requested")
    if plan.world_size == 1 or plan.accum_steps == 1:
        why = "one rank" if plan.world_size == 1 else "one microbatch per step"
        return Decision(LAST, f"{why}: nothing to defer, so no extra memory and no extra traffic")
    numbers = ", ".join(f"{name} {_gib(peak)}" for name, peak in peaks.items())
    for name, peak in peaks.items():
        if peak <= budget:
            return Decision(name, f"estimated peak per rank {numbers} vs budget {_gib(budget)}: {name} fits")
    leanest = min(peaks, key=peaks.get)
    return Decision(
        leanest,
        f"estimated peak per rank {numbers} vs budget {_gib(budget)}: none fits, {leanest} needs the least "
        "(expect out-of-memory: lower --micro-batch or use --micro-batch auto)",
    )


def _gib(n_bytes: int) -> str:
    return f"{n_bytes / 2**20:.1f} MiB" if n_bytes < 2**30 else f"{n_bytes / 2**30:.2f} GiB"
