"""Sync policies: when gradients are reduced across ranks during a step's microbatches.

Pure Python, no torch. `choose` resolves `auto` from the plan and the model size; the
memory figures are per rank, in bytes, from a simple model of FSDP2 with AdamW:

- sharded training state: fp32 master params, fp32 grads and two Adam moments = 16 B/param / W
- `last` also holds the whole model's unsharded gradients between microbatches
- `last-keep-params` also holds the unsharded parameters between microbatches
- with HSDP (`replicas` > 1) the state is sharded over world_size / replicas ranks only;
  `hsdp-defer` reduce-scatters inside a replica every microbatch and all-reduces across
  replicas once per step, so it holds no more than `every`
"""

from __future__ import annotations

from dataclasses import dataclass

from accum_cli.errors import UserError
from accum_cli.plan import Plan

EVERY = "every"
LAST = "last"
LAST_KEEP_PARAMS = "last-keep-params"
HSDP_DEFER = "hsdp-defer"
AUTO = "auto"
POLICIES = (AUTO, EVERY, LAST, LAST_KEEP_PARAMS, HSDP_DEFER)

# `last` is chosen only when its extra memory fits in this share of what is left on the
# device after the sharded state: activations and allocator slack need the rest.
COMFORT_SHARE = 0.25

SHARDED_STATE_BYTES_PER_PARAM = 16


@dataclass(frozen=True, slots=True)
class ModelSize:
    n_params: int
    compute_bytes: int  # bytes per parameter in forward/backward: 4 (fp32) or 2 (bf16)


@dataclass(frozen=True, slots=True)
class Decision:
    policy: str
    reason: str


def sharded_state_bytes(size: ModelSize, world_size: int) -> int:
    return -(-size.n_params * SHARDED_STATE_BYTES_PER_PARAM // world_size)


def extra_bytes(policy: str, size: ModelSize) -> int:
    """Memory a policy holds between microbatches on top of the sharded state."""
    if policy == LAST:
        return size.n_params * size.compute_bytes
    if policy == LAST_KEEP_PARAMS:
        return 2 * size.n_params * size.compute_bytes
    return 0


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


def choose(requested: str, plan: Plan, size: ModelSize, device_memory_bytes: int, replicas: int = 1) -> Decision:
    """Resolve the requested policy; `auto` picks `last` when its extra memory fits comfortably,
    else the lean policy: `hsdp-defer` on a 2-D mesh, `every` otherwise."""
    validate(requested)
    shards = shard_size(plan, replicas)
    if requested == HSDP_DEFER and replicas < 2:
        raise UserError("--sync hsdp-defer needs --replicas 2 or more (a 2-D mesh)")
    if requested != AUTO:
        return Decision(requested, "as requested")
    if plan.world_size == 1 or plan.accum_steps == 1:
        why = "one rank" if plan.world_size == 1 else "one microbatch per step"
        return Decision(LAST, f"{why}: nothing to defer, so no extra memory and no extra traffic")
    left = device_memory_bytes - sharded_state_bytes(size, shards)
    need = extra_bytes(LAST, size)
    budget = int(max(left, 0) * COMFORT_SHARE)
    numbers = (
        f"unsharded grads {_gib(need)} vs {COMFORT_SHARE:.0%} of the {_gib(max(left, 0))} left "
        f"after the sharded state = {_gib(budget)}"
    )
    if need <= budget:
        return Decision(LAST, f"{numbers}: fits, so reduce once per step")
    if replicas > 1:
        return Decision(
            HSDP_DEFER, f"{numbers}: too tight, so reduce-scatter in a replica every microbatch, all-reduce once"
        )
    return Decision(EVERY, f"{numbers}: too tight, so reduce-scatter every microbatch")


def describe(plan: Plan, size: ModelSize, device_memory_bytes: int, replicas: int = 1) -> list[str]:
    """The sync-policy table with this model's numbers (per rank)."""
    shards = shard_size(plan, replicas)
    state = sharded_state_bytes(size, shards)
    mesh = f"{replicas} replicas x {shards} shards" if replicas > 1 else f"{shards} ranks"
    lines = [
        f"model             {size.n_params:,} parameters, {size.compute_bytes} B each in compute",
        f"sharded state     {_gib(state)} per rank (params, grads, AdamW moments over {mesh})",
        f"device memory     {_gib(device_memory_bytes)} per rank",
    ]
    for policy in (EVERY, LAST, LAST_KEEP_PARAMS, HSDP_DEFER):
        if policy == HSDP_DEFER and replicas < 2:
            continue
        extra = extra_bytes(policy, size)
        lines.append(
            f"  {policy:<17} +{_gib(extra):>10} held between microbatches; "
            f"{collectives_per_step(policy, plan.accum_steps, replicas)} per decoder layer per step"
        )
    return lines


def _gib(n_bytes: int) -> str:
    return f"{n_bytes / 2**30:.3f} GiB" if n_bytes < 2**30 else f"{n_bytes / 2**30:.1f} GiB"
