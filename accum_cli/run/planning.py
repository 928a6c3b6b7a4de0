"""The plan of a run: sequence length, memory budget, and the layout, micro batch and sync policy
decided from the memory estimate (rank 0 decides, every rank follows); `--plan` without training."""

from __future__ import annotations

import dataclasses
import json
import math

from accum_cli.config import batch_schedule as schedules
from accum_cli.config import policy
from accum_cli.config.plan import Plan, usable_micro_batch
from accum_cli.config.settings import TrainConfig
from accum_cli.errors import UserError
from accum_cli.memory import estimate, fit, layout
from accum_cli.model import load as modeling
from accum_cli.model import lora
from accum_cli.parallel import runtime
from accum_cli.parallel.sharding import ShardSettings
from accum_cli.run.data_setup import epoch_steps
from accum_cli.rundir import checkpoint_meta
from accum_cli.rundir.metrics import print_lines

EMBEDDED_SEQ_LEN = 128
DEFAULT_MAX_SEQ_LEN = 2048


def resolve_seq_len(cfg: TrainConfig, model_config) -> int:
    max_positions = getattr(model_config, "max_position_embeddings", None)
    if cfg.seq_len is None:
        if cfg.dataset is None:
            return EMBEDDED_SEQ_LEN
        return min(DEFAULT_MAX_SEQ_LEN, max_positions or DEFAULT_MAX_SEQ_LEN)
    if max_positions and cfg.seq_len > max_positions:
        raise UserError(
            f"--seq-len {cfg.seq_len} exceeds the model's maximum of {max_positions} positions; "
            f"use --seq-len {max_positions} or less"
        )
    return cfg.seq_len


def model_size(shapes: dict[str, tuple[int, ...]], bf16: bool) -> policy.ModelSize:
    n_params = sum(math.prod(shape) for shape in shapes.values())
    return policy.ModelSize(n_params=n_params, compute_bytes=2 if bf16 else 4)


def fit_target(
    cfg: TrainConfig, model_config, seq_len: int, world_size: int, settings: ShardSettings, device_type: str
) -> fit.Target:
    return fit.Target(
        json.loads(model_config.to_json_string()), cfg.global_batch, world_size, cfg.replicas, seq_len,
        settings.bf16, settings.activation_checkpointing, settings.reshard_after_forward, cfg.strict_batch,
        device_type=device_type, lora=lora.spec(cfg),
    )  # fmt: skip


def check_layout(cfg: TrainConfig, world_size: int) -> None:
    """The cheap batch and mesh checks, before any estimate (micro batch auto: m = 1 for now)."""
    plan = plan_before_fit(cfg, world_size)
    if cfg.strict_batch:
        plan.require_divisible()
    policy.shard_size(plan, cfg.replicas)
    check_schedule(schedules.of_config(cfg), plan, None, cfg)  # every stage's, before any worker starts


def plan_before_fit(cfg: TrainConfig, world_size: int) -> Plan:
    """The plan before any estimate: micro batch auto counts as 1 for now."""
    return Plan(cfg.global_batch, 1 if cfg.micro_batch == fit.AUTO else usable(cfg, world_size), world_size)


def usable(cfg: TrainConfig, world_size: int) -> int | str:
    """--micro-batch as the run can use it: auto, or at most a rank's share of the step."""
    if cfg.micro_batch == fit.AUTO:
        return fit.AUTO
    return usable_micro_batch(cfg.micro_batch, cfg.global_batch, world_size)


def micro_reason_of(cfg: TrainConfig, world_size: int, reason: str) -> str:
    """Why the micro batch is what it is; "as requested" would hide that a larger one was capped."""
    used = usable(cfg, world_size)
    if used == fit.AUTO or used == cfg.micro_batch:
        return reason
    return f"--micro-batch {cfg.micro_batch} capped at a rank's share of the step, ceil(G/W) = {used}"


def plan_only(cfg: TrainConfig, world_size: int) -> None:
    """--plan: the plan for any world size, from the model's config alone; no training."""
    check_layout(cfg, world_size)
    source = modeling.resolve_source(cfg.model)
    model_config = modeling.load_config(source, cfg.trust_remote_code)
    seq_len = resolve_seq_len(cfg, model_config)
    modeling.parameter_shapes(model_config, cfg.trust_remote_code)  # refuses a config no model can be built from
    # Planning for a cluster: CUDA with bf16 unless told otherwise.
    settings = ShardSettings(
        bf16=cfg.precision != "fp32",
        reshard_after_forward=cfg.reshard_after_forward is not False,
        activation_checkpointing=bool(cfg.activation_checkpointing),
    )
    budget = budget_for(cfg)
    target = fit_target(cfg, model_config, seq_len, world_size, settings, "cuda")
    choice = layout.decide(cfg.layout, target, usable(cfg, world_size), cfg.sync, budget, show_all=True)
    plan = Plan(cfg.global_batch, choice.micro_batch, world_size)
    if cfg.strict_batch:
        plan.require_divisible()
    schedule = schedules.of_config(cfg)
    print_lines(plan.describe(seq_len), "plan" if schedule is None else "plan (the largest stage)")
    if schedule is not None:
        most = schedules.max_samples(cfg.max_tokens, seq_len) if cfg.max_tokens is not None else None
        segments = schedule.segments(seq_len, max_steps=cfg.max_steps, max_samples=most)
        lines = describe_stages(schedule, segments, plan, seq_len, cfg.batch_schedule_lr, "the data's end (--epochs)")
        print_lines(lines, "batch schedule")
    replicated = fit.describe_replicated(choice.replicated, budget, choice.micro_batch) if choice.replicated else []
    if choice.sharded is not None:
        table = fit.describe(target, choice.sharded, budget, replicated)
    else:
        table = [f"budget            {budget.describe()}", *replicated]
    print_lines(
        [
            *table,
            *lora_lines(cfg, model_config, target, choice),
            f"micro batch       {choice.micro_batch} ({micro_reason_of(cfg, world_size, choice.micro_reason)})",
            f"chosen: {choice.policy.policy} — {choice.policy.reason}",
            f"layout: {choice.layout.layout} — {choice.layout.reason}",
        ],
        f"memory per rank and sync policy ({cfg.sync})",
    )


def lora_lines(cfg: TrainConfig, model_config, target: fit.Target, choice: layout.Choice) -> list[str]:
    """--plan with --lora-r: the adapters' share of the parameters, and the chosen layout's estimated peak
    per rank next to full fine-tuning's at the same micro batch and policy."""
    if cfg.lora_r is None:
        return []
    from accum_cli.memory import estimate

    replicated = choice.layout.layout == layout.REPLICATE
    sync = policy.LAST if replicated else choice.policy.policy
    both = [dataclasses.replace(target, replicated=replicated, lora=spec) for spec in (target.lora, None)]
    try:
        lora_peak, full_peak = (e.peak for e in estimate.estimate([t.query(sync, choice.micro_batch) for t in both]))
        versus = f"{fit.gib(lora_peak)} per rank vs {fit.gib(full_peak)} for full fine-tuning ({choice.layout.layout})"
    except estimate.EstimateFailed as exc:
        versus = f"not estimated ({exc})"
    shapes = lora.parameter_shapes(model_config, cfg, cfg.trust_remote_code)
    return [f"lora              {lora.describe(shapes, cfg)}", f"lora peak         {versus}"]


def budget_for(cfg: TrainConfig, rt: runtime.Runtime | None = None) -> fit.Budget:
    """--device-memory-gib, else this rank's device (a run) or this machine's free RAM (--plan)."""
    if cfg.device_memory_gib is not None:
        return fit.Budget(int(cfg.device_memory_gib * 2**30), "from --device-memory-gib")
    if rt is None:
        return fit.Budget(
            runtime.available_ram_bytes(), "this machine's free RAM; set --device-memory-gib for the target"
        )
    return fit.Budget(runtime.device_memory_bytes(rt), f"{rt.device.type} memory per local rank")


MASTER_BYTES = 4  # per parameter: the fp32 master weights every layout keeps, before any gradient or AdamW state


def check_weights_fit(size: policy.ModelSize, budget: fit.Budget, world_size: int) -> None:
    """The cheapest refusal of a model too big for the machine, before anything is built (a config
    asking for a vocabulary of 1e9 would otherwise fail deep in torch's allocator): its fp32 weights
    alone, sharded over every rank, must fit a rank's budget."""
    need = size.n_params * MASTER_BYTES / world_size
    if need > budget.bytes:
        raise UserError(
            f"the model has {size.n_params:,} parameters: their fp32 weights alone need {fit.gib(need)} per rank over "
            f"{world_size} rank(s), more than the budget of {budget.describe()}; use more ranks or a smaller model"
        )


def decide(
    cfg: TrainConfig, rt: runtime.Runtime, model_config, seq_len: int, settings: ShardSettings, size: policy.ModelSize
):
    """Collective: the layout, micro batch and sync policy, decided by rank 0 from the estimates
    (layout.decide) and sent to every rank, so all ranks run the same plan whatever each one's
    free memory is."""
    answer = ""
    if rt.is_main:
        target = fit_target(cfg, model_config, seq_len, rt.world_size, settings, rt.device.type)
        try:
            budget = budget_for(cfg, rt)
            try:
                choice = layout.decide(cfg.layout, target, usable(cfg, rt.world_size), cfg.sync, budget)
            finally:
                estimate.release_ahead()  # the child forked ahead, if no estimate took it
            # Where no estimate was needed (one rank, a fixed micro batch and policy), this is the check
            # that remains; offloaded, the weights live in host memory, not the device's.
            if not settings.offload_params:
                check_weights_fit(size, budget, rt.world_size)
            answer = json.dumps([choice.layout.layout, choice.layout.reason, choice.micro_batch, choice.micro_reason,
                                 choice.policy.policy, choice.policy.reason])  # fmt: skip
        except UserError as exc:
            answer = json.dumps({"error": str(exc)})
    answer = json.loads(runtime.broadcast_text(answer, rt.device))
    if isinstance(answer, dict):
        raise UserError(answer["error"])  # printed by rank 0 alone
    chosen, why, micro_batch, micro_reason, sync, reason = answer
    micro_reason = micro_reason_of(cfg, rt.world_size, micro_reason)
    # --strict-batch: a fixed m was checked by the preflight, an auto one chosen divisible (fit.py)
    plan = Plan(cfg.global_batch, micro_batch, rt.world_size)
    return layout.Decision(chosen, why), plan, micro_reason, policy.Decision(sync, reason)


def may_estimate_sharded(cfg: TrainConfig, world_size: int) -> bool:
    """Whether rank 0's decision (layout.decide) may ask for an estimate of the sharded layout: more than
    one rank, a layout that may shard, and a micro batch or sync policy left to the estimate."""
    left = cfg.micro_batch == fit.AUTO or cfg.sync == policy.AUTO
    return world_size > 1 and cfg.layout != layout.REPLICATE and left


def stage_plan(plan: Plan, global_batch: int) -> Plan:
    """The plan of a --batch-schedule stage: its global batch, the run's micro batch (at most a rank's share)."""
    if global_batch == plan.global_batch:
        return plan
    return Plan(global_batch, usable_micro_batch(plan.micro_batch, global_batch, plan.world_size), plan.world_size)


def check_schedule(schedule: schedules.Schedule | None, plan: Plan, meta, cfg: TrainConfig) -> None:
    """Every stage's plan is valid (--strict-batch: divisible); a resume keeps the checkpoint's schedule
    unless --allow-data-change says otherwise."""
    if schedule is not None:
        for number, stage in enumerate(schedule.stages, 1):
            try:
                staged = stage_plan(plan, stage.global_batch)
                if cfg.strict_batch:
                    staged.require_divisible()
                policy.shard_size(staged, cfg.replicas)
            except UserError as exc:
                raise UserError(f"--batch-schedule stage {number} ({stage.global_batch} sequences): {exc}") from None
    if meta is None:
        return
    now = schedule.text if schedule is not None else ""
    if meta.batch_schedule != now and not cfg.allow_data_change:
        raise UserError(
            f"--resume {meta.path} was trained with {_schedule_words(meta.batch_schedule)}, this run gives "
            f"{_schedule_words(now)}; resume with the same schedule, or pass --allow-data-change to continue "
            "knowingly (the training then differs from an uninterrupted run)"
        )


def describe_stages(
    schedule: schedules.Schedule, segments, plan: Plan, seq_len: int, lr_rule: str, open_end: str = ""
) -> list[str]:
    """--batch-schedule stage by stage: its steps, tokens and accumulation plan (the header and --plan)."""
    lines = [f"schedule          {schedule.text} (thresholds in {schedule.unit}; batches in sequences)"]
    ran = {g.stage for g in segments}
    for g in segments:
        staged = stage_plan(plan, g.global_batch)
        a, m = staged.accum_steps, staged.micro_batch
        split = f"{a} x {m} per rank" if staged.divisible else (
            f"{a} x at most {m} per rank, ranks take "
            + " or ".join(str(n) for n in sorted({staged.rank_samples(r) for r in range(plan.world_size)}, reverse=True))
        )  # fmt: skip
        first = g.first_sample * seq_len
        if g.steps is None:
            steps, tokens = f"steps {g.first_step + 1:,}-{open_end or '...'}", f"tokens {first:,}-"
        else:
            last = (g.first_sample + g.steps * g.global_batch) * seq_len
            steps = f"steps {g.first_step + 1:,}-{g.first_step + g.steps:,} ({g.steps:,})"
            tokens = f"tokens {first:,}-{last:,}"
        lr = schedule.lr_scale(g.global_batch, lr_rule)
        lines.append(
            f"stage {g.stage + 1:<11} {steps}, {tokens}: global batch {g.global_batch:,} sequences "
            f"({g.global_batch * seq_len:,} tokens), {split}" + (f", lr x {lr:.4g}" if lr != 1.0 else "")
        )
    end = segments[-1] if segments else None
    end_at = None
    if end is not None and end.steps is not None:
        end_at = schedule.position(end.first_step + end.steps, end.first_sample + end.steps * end.global_batch, seq_len)
    for i, stage in enumerate(schedule.stages):
        if i in ran or i < min(ran, default=0):
            continue
        why = "not reached: the run ends first" if end_at is not None and stage.threshold >= end_at else (
            "never runs: a single step passes over its threshold")  # fmt: skip
        lines.append(f"stage {i + 1:<11} {why}")
    return lines


def _schedule_words(text: str) -> str:
    return f"--batch-schedule {text}" if text else "no --batch-schedule"


def run_length(
    cfg: TrainConfig, schedule: schedules.Schedule | None, meta, seq_len: int, n_samples: int | None, plan: Plan
) -> tuple[int, list[schedules.Segment]]:
    """The run's last step, and the stages it runs from its first step (none without a schedule): --max-steps,
    else the whole steps that fit --max-tokens, else --epochs passes over the data."""
    max_samples = None
    if cfg.max_tokens is not None:
        max_samples = schedules.max_samples(cfg.max_tokens, seq_len)
    elif cfg.max_steps is None:
        max_samples = int(cfg.epochs * n_samples)
    if schedule is None:
        return cfg.max_steps or epoch_steps(max_samples, plan.global_batch, meta), []
    step, samples = checkpoint_meta.position(meta)
    segments = schedule.segments(seq_len, step, samples, cfg.max_steps, max_samples)
    if segments:
        return segments[-1].first_step + segments[-1].steps, segments
    if meta is not None:  # nothing left after the checkpoint: the caller says so
        return meta.step, []
    length = f"--max-tokens {cfg.max_tokens}" if cfg.max_tokens is not None else f"--epochs {cfg.epochs:g}"
    raise UserError(
        f"{length} ({max_samples:,} sequences of {seq_len} tokens) holds no whole step of the schedule's first "
        f"stage ({schedule.stages[0].global_batch} sequences); train longer or start with a smaller batch"
    )
