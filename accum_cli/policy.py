"""Sync policies: when gradients are reduced across ranks during a step's microbatches.

Pure Python, no torch. `choose` resolves `auto` from the plan and the model size; the
memory figures are per rank, in bytes, from a simple model of FSDP2 with AdamW:

- sharded training state: fp32 master params, fp32 grads and two Adam moments = 16 B/param / W
- `last` also holds the whole model's unsharded gradients between microbatches
- `last-keep-params` also holds the unsharded parameters between microbatches
"""

from __future__ import annotations

from dataclasses import dataclass

from accum_cli.errors import UserError
from accum_cli.plan import Plan

EVERY = "every"
LAST = "last"
LAST_KEEP_PARAMS = "last-keep-params"
AUTO = "auto"
POLICIES = (AUTO, EVERY, LAST, LAST_KEEP_PARAMS)

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


def collectives_per_step(policy: str, accum_steps: int) -> str:
    a = accum_steps
    if policy == EVERY:
        return f"{2 * a} all-gathers, {a} reduce-scatters"
    if policy == LAST:
        return f"{2 * a} all-gathers, 1 reduce-scatter"
    if policy == LAST_KEEP_PARAMS:
        return f"{a + 1} all-gathers, 1 reduce-scatter"
    raise ValueError(policy)


def validate(policy: str) -> str:
    if policy not in POLICIES:
        raise UserError(f"unknown sync policy {policy!r}; use one of: {', '.join(POLICIES)}")
    return policy


def choose(requested: str, plan: Plan, size: ModelSize, device_memory_bytes: int) -> Decision:
    """Resolve the requested policy; `auto` picks `last` when its extra memory fits comfortably."""
    validate(requested)
    if requested != AUTO:
        return Decision(requested, "as requested")
    if plan.world_size == 1 or plan.accum_steps == 1:
        why = "one rank" if plan.world_size == 1 else "one microbatch per step"
        return Decision(LAST, f"{why}: nothing to defer, so no extra memory and no extra traffic")
    left = device_memory_bytes - sharded_state_bytes(size, plan.world_size)
    need = extra_bytes(LAST, size)
    budget = int(max(left, 0) * COMFORT_SHARE)
    numbers = (
        f"unsharded grads {_gib(need)} vs {COMFORT_SHARE:.0%} of the {_gib(max(left, 0))} left "
        f"after the sharded state = {_gib(budget)}"
    )
    if need <= budget:
        return Decision(LAST, f"{numbers}: fits, so reduce once per step")
    return Decision(EVERY, f"{numbers}: too tight, so reduce-scatter every microbatch")


def describe(plan: Plan, size: ModelSize, device_memory_bytes: int) -> list[str]:
    """The sync-policy table with this model's numbers (per rank)."""
    state = sharded_state_bytes(size, plan.world_size)
    lines = [
        f"model             {size.n_params:,} parameters, {size.compute_bytes} B each in compute",
        f"sharded state     {_gib(state)} per rank (params, grads, AdamW moments over {plan.world_size})",
        f"device memory     {_gib(device_memory_bytes)} per rank",
    ]
    for policy in (EVERY, LAST, LAST_KEEP_PARAMS):
        extra = extra_bytes(policy, size)
        lines.append(
            f"  {policy:<17} +{_gib(extra):>10} held between microbatches; "
            f"{collectives_per_step(policy, plan.accum_steps)} per step"
        )
    return lines


def _gib(n_bytes: int) -> str:
    return f"{n_bytes / 2**30:.3f} GiB" if n_bytes < 2**30 else f"{n_bytes / 2**30:.1f} GiB"
