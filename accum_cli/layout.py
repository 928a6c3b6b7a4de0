"""Layout: shard the training state with FSDP2, or replicate it on every rank.

Sharding is not free (DESIGN.md): with the model, gradients and AdamW state on every rank,
FSDP2 still all-gathers every layer twice per microbatch and runs its hooks, and on two CPU
ranks a replicated layout with one summed all-reduce per step ran ~1.25x faster. So where the
whole training state fits a device, `auto` replicates: plain modules, local accumulation over
the step's microbatches, then one bucketed all-reduce of the gradients (summed: the loss is
already divided by the global loss-token count). Where it does not fit, FSDP2 shards it.

Replicated means one reduction per step, so the sync policy is `last` by construction; the
lean policies (`every`, `hsdp-defer`) exist to save memory and need the sharded layout.
"""

from __future__ import annotations

from dataclasses import dataclass

from accum_cli.errors import UserError

AUTO = "auto"
SHARD = "shard"
REPLICATE = "replicate"
LAYOUTS = (AUTO, SHARD, REPLICATE)

# fp32 parameters, gradients and AdamW's two moments, whole, on every rank.
REPLICATED_STATE_BYTES_PER_PARAM = 16
# The replicated state may take this share of a device: activations, temporaries and the
# allocator's slack need the rest.
REPLICATE_SHARE = 0.5


@dataclass(frozen=True, slots=True)
class Decision:
    layout: str
    reason: str


def replicated_state_bytes(n_params: int) -> int:
    return n_params * REPLICATED_STATE_BYTES_PER_PARAM


def choose(
    requested: str,
    sync: str,
    replicas: int,
    bf16: bool,
    n_params: int,
    device_memory_bytes: int,
    micro_batch_auto: bool = False,
) -> Decision:
    """Resolve --layout. Refuses, in one line, a replicated layout that cannot be honoured."""
    if requested not in LAYOUTS:
        raise UserError(f"--layout {requested!r} is unknown; use one of: {', '.join(LAYOUTS)}")
    state = replicated_state_bytes(n_params)
    budget = int(device_memory_bytes * REPLICATE_SHARE)
    numbers = f"replicated state {_gib(state)} vs {REPLICATE_SHARE:.0%} of {_gib(device_memory_bytes)}"
    blockers = []
    if replicas > 1:
        blockers.append("--replicas (HSDP) shards inside each replica")
    if sync not in ("auto", "last"):
        blockers.append(f"--sync {sync} reduces more than once per step, to save memory only sharding has")
    if bf16:
        blockers.append("bf16 mixed precision is applied by FSDP2's policy")
    if micro_batch_auto:
        blockers.append("--micro-batch auto picks from the memory estimate of the sharded layout")
    if requested == REPLICATE:
        if blockers:
            raise UserError(f"--layout replicate cannot be used: {blockers[0]}; use --layout shard")
        if state > budget:
            raise UserError(f"--layout replicate does not fit: {numbers}; use --layout shard (or auto), or more memory")
        return Decision(REPLICATE, f"as requested; {numbers}")
    if requested == SHARD:
        return Decision(SHARD, "as requested")
    if blockers:
        return Decision(SHARD, blockers[0])
    if state > budget:
        return Decision(SHARD, f"{numbers}: too big to replicate")
    return Decision(REPLICATE, f"{numbers}: fits, so no sharding and one all-reduce per step")


def _gib(n_bytes: int) -> str:
    return f"{n_bytes / 2**30:.3f} GiB" if n_bytes < 2**30 else f"{n_bytes / 2**30:.1f} GiB"
