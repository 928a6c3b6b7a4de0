"""Layout: shard the training state with FSDP2, or replicate it on every rank.

Sharding is not free (docs/ARCHITECTURE.md): with the model, gradients and AdamW state on every rank,
FSDP2 still all-gathers every layer twice per microbatch and runs its hooks, and on two CPU
ranks a replicated layout with one summed all-reduce per step ran ~1.25x faster. So where the
whole training state fits a device, `auto` replicates: plain modules, local accumulation over
the step's microbatches, then one bucketed all-reduce of the gradients (summed: the loss is
already divided by the global loss-token count). Where it does not fit, FSDP2 shards it.

What fits is the memory estimate's answer (estimate.py), not a rule of thumb: the run's own
step on the replicated model, built whole in FakeTensorMode, at the micro batch the run will
use, against the same budget the sharded policies are held to (fit.py).

Replicated means one reduction per step, so the sync policy is `last` by construction; the
lean policies (`every`, `hsdp-defer`) exist to save memory and need the sharded layout.
"""

from __future__ import annotations

from dataclasses import dataclass

from accum_cli.config import policy
from accum_cli.config.plan import Plan
from accum_cli.config.settings import LAYOUT_AUTO as AUTO
from accum_cli.config.settings import LAYOUTS, REPLICATE, SHARD
from accum_cli.errors import UserError
from accum_cli.memory import estimate, fit
from accum_cli.memory.query import Estimate

ONE_REDUCTION = policy.Decision(policy.LAST, "replicated: one all-reduce per step")


@dataclass(frozen=True, slots=True)
class Decision:
    layout: str
    reason: str


@dataclass(frozen=True, slots=True)
class Choice:
    """The layout, micro batch and sync policy of a run, and the estimates they came from."""

    layout: Decision
    micro_batch: int
    micro_reason: str
    policy: policy.Decision
    sharded: fit.Fit | None = None  # the sharded layout's estimates, where they were made
    replicated: Estimate | None = None  # the replicated layout's, where it was made


def blockers(sync: str, replicas: int) -> list[str]:
    """What only the sharded layout can do, among the flags asked for."""
    found = []
    if replicas > 1:
        found.append("--replicas (HSDP) shards inside each replica")
    if sync not in (policy.AUTO, policy.LAST):
        found.append(f"--sync {sync} reduces more than once per step, to save memory only sharding has")
    return found


def check(requested: str, sync: str, replicas: int) -> None:
    """The cheap refusals, before any estimate: an unknown layout, a replicated one that cannot be honoured."""
    if requested not in LAYOUTS:
        raise UserError(f"--layout {requested!r} is unknown; use one of: {', '.join(LAYOUTS)}")
    blocked = blockers(sync, replicas)
    if requested == REPLICATE and blocked:
        raise UserError(f"--layout replicate cannot be used: {blocked[0]}; use --layout shard")


def decide(
    requested: str, target: fit.Target, micro_batch: int | str, sync: str, budget: fit.Budget, show_all: bool = False
) -> Choice:
    """Resolve --layout with the micro batch and sync policy. `auto` replicates where the replicated
    layout's estimated peak fits the budget at the micro batch the run would use (the sharded
    layout's choice for `--micro-batch auto`: replicating never buys a bigger one), else shards.
    One rank has nothing to shard across, so `auto` replicates there without an estimate.
    `show_all` (--plan) estimates both layouts whatever is chosen."""
    check(requested, sync, target.replicas)
    blocked = blockers(sync, target.replicas)
    if requested == SHARD or blocked:
        return sharded(Decision(SHARD, "as requested" if requested == SHARD else blocked[0]), target, micro_batch,
                       sync, budget, show_all)  # fmt: skip
    if requested == AUTO and target.world_size == 1 and not show_all and micro_batch != fit.AUTO:
        return Choice(
            Decision(REPLICATE, "one rank: nothing to shard across"), micro_batch, "as requested", ONE_REDUCTION
        )
    shard_fit = None
    if (requested == AUTO and target.world_size > 1 and micro_batch == fit.AUTO) or show_all:
        shard_fit = sharded(Decision(SHARD, ""), target, micro_batch, sync, budget, show_all).sharded
    at = shard_fit.micro_batch if shard_fit is not None and requested == AUTO else micro_batch
    try:
        m, micro_reason, found = fit.fit_replicated(target, at, budget)
    except estimate.EstimateFailed as exc:
        if requested == REPLICATE:
            m = 1 if micro_batch == fit.AUTO else micro_batch
            return Choice(Decision(REPLICATE, f"as requested, not estimated: {exc}"), m, "as requested", ONE_REDUCTION)
        why = f"the replicated layout could not be estimated: {exc}"
        return sharded(Decision(SHARD, why), target, micro_batch, sync, budget, show_all, shard_fit)
    except UserError:  # even one sequence per microbatch does not fit it replicated
        if requested == REPLICATE:
            raise
        why = "the replicated layout does not fit one sequence per microbatch"
        return sharded(Decision(SHARD, why), target, micro_batch, sync, budget, show_all, shard_fit)
    if micro_batch == fit.AUTO and at != fit.AUTO:  # m came from the sharded layout's search
        micro_reason = shard_fit.micro_reason
    numbers = (
        f"estimated peak {fit.gib(found.peak)} per rank replicated at micro batch {m} vs budget {fit.gib(budget.bytes)}"
    )
    fits = found.peak <= budget.bytes
    if requested == REPLICATE:
        if not fits:
            raise UserError(
                f"--layout replicate does not fit: {numbers}; use --layout shard (or auto), a smaller "
                "--micro-batch, or more memory"
            )
        return Choice(Decision(REPLICATE, f"as requested; {numbers}"), m, micro_reason, ONE_REDUCTION, shard_fit, found)
    if fits:
        why = f"{numbers}: fits, so no sharding and one all-reduce per step"
        return Choice(Decision(REPLICATE, why), m, micro_reason, ONE_REDUCTION, shard_fit, found)
    choice = sharded(Decision(SHARD, f"{numbers}: too big to replicate"), target, micro_batch, sync, budget,
                     show_all, shard_fit)  # fmt: skip
    return Choice(choice.layout, choice.micro_batch, choice.micro_reason, choice.policy, choice.sharded, found)


def sharded(
    decision: Decision,
    target: fit.Target,
    micro_batch: int | str,
    sync: str,
    budget: fit.Budget,
    show_all: bool,
    done: fit.Fit | None = None,
) -> Choice:
    """The sharded layout's micro batch and sync policy, from its estimates where anything is left to
    choose (`done`: already made). A fixed micro batch still trains when the estimate fails: with
    the policy that holds the least."""
    if done is not None:
        return Choice(decision, done.micro_batch, done.micro_reason, done.decision, done)
    if micro_batch != fit.AUTO and not show_all:
        plan = Plan(target.global_batch, micro_batch, target.world_size)
        if sync != policy.AUTO or target.world_size == 1 or plan.accum_steps == 1:
            return Choice(decision, micro_batch, "as requested", policy.choose(sync, plan, {}, 0, target.replicas))
    try:
        found = fit.fit(target, micro_batch, sync, budget, show_all=show_all)
    except estimate.EstimateFailed as exc:
        if micro_batch == fit.AUTO or show_all:
            raise
        lean = fit.candidates(target.replicas)[-1]
        return Choice(
            decision, micro_batch, "as requested", policy.Decision(lean, f"no estimate, so the leanest: {exc}")
        )
    return Choice(decision, found.micro_batch, found.micro_reason, found.decision, found)
