"""The run header: what rank 0 prints about the run before its first step."""

from __future__ import annotations

import dataclasses
import re

from accum_cli.config.plan import Plan
from accum_cli.config.settings import RESUME_AUTO, TrainConfig
from accum_cli.data import packing
from accum_cli.data.batches import SampleOrder
from accum_cli.model import load as modeling
from accum_cli.parallel import runtime
from accum_cli.run.planning import stage_plan
from accum_cli.run.setup import Setup
from accum_cli.rundir import checkpoint_meta


def describe_resume(
    meta: checkpoint_meta.Meta, plan: Plan, data_changed: bool = False, auto: bool = False, scheduled: bool = False
) -> list[str]:
    how = " (auto: the newest complete one)" if auto else ""
    lines = [f"resumed from     {meta.path} (step {meta.step}, {meta.samples:,} samples consumed){how}"]
    before = (meta.world_size, meta.micro_batch)
    now = (plan.world_size, plan.micro_batch)
    if before != now:
        lines.append(
            f"layout changed   world size {meta.world_size} -> {plan.world_size}, "
            f"micro batch {meta.micro_batch} -> {plan.micro_batch}"
        )
    if data_changed:
        lines.append(
            "data changed     --allow-data-change: the data or its order differs from the checkpoint's, "
            "so the training differs from an uninterrupted run"
        )
    elif scheduled:  # the checkpoint's --batch-schedule, continued where it stopped (the stage may have changed)
        lines.append(
            f"unchanged        --batch-schedule {meta.batch_schedule} and the data order (seed {meta.seed}): "
            "the same training as an uninterrupted run"
        )
    elif meta.global_batch == plan.global_batch:
        lines.append(
            f"unchanged        global batch {plan.global_batch} and the data order (seed {meta.seed}): "
            "the same training as an uninterrupted run"
        )
    else:
        lines.append(
            f"global batch     changed {meta.global_batch} -> {plan.global_batch}: the data continues at "
            f"sample {meta.samples:,}, but the steps differ from an uninterrupted run"
        )
    return lines


PRETRAINED_LR = 2e-5  # full fine-tuning of pretrained LLM weights: 1e-3 would wreck them in a few steps
FROM_SCRATCH_LR = 1e-3  # a small model trained from its config (the embedded default)


def with_default_lr(cfg: TrainConfig, pretrained: bool) -> TrainConfig:
    """--lr unset: a rate that fits the weights (pretrained or from scratch)."""
    if cfg.lr is not None:
        return cfg
    return dataclasses.replace(cfg, lr=PRETRAINED_LR if pretrained else FROM_SCRATCH_LR)


def lr_schedule(cfg: TrainConfig, given: bool, pretrained: bool, total_steps: int) -> str:
    origin = "--lr" if given else f"default for {'pretrained weights' if pretrained else 'training from scratch'}"
    ratio = f" (--warmup-ratio {cfg.warmup_ratio:g})" if cfg.warmup_ratio is not None else ""
    return f"{cfg.lr:g} peak ({origin}), {cfg.lr_schedule}, {cfg.warmup_for(total_steps)} warmup steps{ratio}"


def describe_lr(cfg: TrainConfig, given: bool, pretrained: bool, total_steps: int) -> list[str]:
    warmup = cfg.warmup_for(total_steps)
    lines = [f"learning rate     {lr_schedule(cfg, given, pretrained, total_steps)}"]
    if warmup > total_steps:  # the run ends inside the warmup: the peak is never reached
        lines.append(
            f"note              the warmup is longer than the run's {total_steps} steps: the learning rate rises"
            f" to {cfg.lr * total_steps / warmup:.3g} only; --warmup-steps {total_steps} reaches {cfg.lr:g}"
        )
    return lines


def describe_tokenizer(tokenizer) -> str:
    if tokenizer is None:
        return "tokenizer         none (the data is pre-tokenised)"
    return f"tokenizer         {type(tokenizer).__name__}, vocabulary {len(tokenizer):,}"


def stream_position(s: Setup) -> str:
    if s.resume is None:
        return "stream            read from its start"
    return (
        f"stream            read again up to sample {s.resume.samples:,} to resume exactly "
        f"({s.replayed_s:.1f} s, without training)"
    )


def rows_packed(s: Setup) -> int:
    """The rows --packing placed into the samples (0 where the samples are not packed rows)."""
    return s.dataset.n_rows if isinstance(s.dataset, packing.PackedRows) else 0


def describe_packing(s: Setup, seed: int) -> list[str]:
    """--packing of rows: how many rows a step holds, and the share of computed positions that are real tokens,
    packed and as the same rows padded would be (the first epoch's seeded order, microbatches of the plan's)."""
    if isinstance(s.dataset, packing.DocumentMasked):
        return ["packing           documents masked: each attends within itself only (--document-masking)"]
    if not isinstance(s.dataset, packing.PackedRows):
        return []
    packed, g, micro = s.dataset, s.plan.global_batch, s.plan.micro_batch
    rows = packed.n_rows
    share = packing.real_share(packed.sequence_lengths()[SampleOrder(len(packed), seed).permutation(0)], micro)
    padded = packing.real_share(packed.lengths[SampleOrder(rows, seed).permutation(0)], micro)
    per_step = rows * g / len(packed)
    loss_tokens = f", {per_step * s.stats.loss_tokens / max(s.stats.documents, 1):,.0f} loss tokens" if s.stats else ""
    return [
        f"packing           {rows:,} rows whole into {len(packed):,} sequences of up to {packed.seq_len} tokens "
        f"(about {per_step:,.1f} rows{loss_tokens} a step); real tokens per position {share:.0%}, "
        f"padded rows {padded:.0%}"
    ]


def _epoch(s: Setup, lines: list[str]) -> list[str]:
    """With a --batch-schedule an epoch is no fixed number of steps: said in sequences (the stages follow)."""
    if s.schedule is None:
        return lines
    said = f"one epoch = {s.stats.samples:,} sequences (the steps: the batch schedule below)"
    return [re.sub(r"one epoch = [0-9,]+ optimizer steps( of [0-9]+)?", said, line) for line in lines]


def summarize_run(s: Setup, cfg: TrainConfig, resume: str | None, lr_given: bool) -> list[str]:
    """The header by default: one line per decision a user checks before the first step (model, data,
    training, device, layout, precision, output), and the lines that only some runs need (warnings,
    notes, a resume). `--verbose` prints describe_run's every detail instead."""
    rt = s.rt
    initialised = "" if s.source.has_weights else f" (initialised from its config, seed {cfg.seed})"
    attention = getattr(s.model_config, "_attn_implementation", None) or "the model code's"
    schedule = (cfg, lr_given, s.source.has_weights, s.total_steps)
    evaluation = f"; eval on {len(s.eval_dataset):,} sequences" if s.eval_dataset is not None else ""
    mesh = f", HSDP {cfg.replicas} replicas x {rt.world_size // cfg.replicas} shards" if cfg.replicas > 1 else ""
    if s.layout.layout == "replicate":  # one all-reduce per step: the sync policy is `last` by construction
        layout = f"replicate ({s.layout.reason})"
    else:
        layout = f"shard ({s.layout.reason}); sync {s.decision.policy} ({s.decision.reason})"
    lines = [
        f"model             {s.source.name}: {s.size.n_params:,} parameters{initialised}, {attention} attention",
        *modeling.describe_model(s.model_config, cfg.attn_implementation, cfg.moe_aux_loss)[1:],  # the router's
        *([f"lora              {s.lora}"] if s.lora else []),
        describe_tokenizer(s.tokenizer),
        *(
            _epoch(s, s.stats.summary(s.plan.global_batch, rows_packed(s)))
            if s.stats is not None
            else [f"data              {s.streaming}"]
        ),
        *describe_packing(s, cfg.seed),
        *([] if s.stats is not None or s.resume is None else [stream_position(s)]),
        f"training          {s.total_steps} optimizer steps{evaluation}; lr {lr_schedule(*schedule)}",
        *describe_lr(*schedule)[1:],  # a warmup longer than the run
        f"device            {rt.device.type} x {rt.world_size} ({rt.backend}){mesh}, threads {runtime.threads_used()}",
        f"layout            {layout}",
        *([f"micro batch       {s.plan.micro_batch} ({s.micro_reason})"] if s.micro_reason != "as requested" else []),
        f"precision         {s.settings.describe(with_source='accelerate' in s.settings.source)}",
        *(f"note              {note}" for note in s.settings.notes),
        *describe_samples(s, cfg),
        *_conditions(s, resume),
        f"output            {s.output_dir}",
    ]
    return lines


def describe_samples(s: Setup, cfg: TrainConfig) -> list[str]:
    if s.sample_prompts is None:
        return []
    n = len(s.sample_prompts.ids)
    every = f"every {cfg.sample_every} steps and at the end" if cfg.sample_every else "at the end"
    return [
        f"samples           {n} prompt{'s' if n != 1 else ''} ({s.sample_prompts.path}), {cfg.sample_tokens} greedy "
        f"tokens {every} -> samples.jsonl"
    ]


def _conditions(s: Setup, resume: str | None) -> list[str]:
    """What only some runs print: a stale lock taken over, a resume."""
    lines = []
    if s.lock is not None and s.lock.took_over is not None:
        lines.append(
            f"note              took over the stale lock of a run that is gone ({s.lock.took_over.describe()})"
        )
    if s.resume is not None:
        auto = resume == RESUME_AUTO
        plan, meta = s.plan, s.resume
        if s.schedule is not None:  # the stage the run continues in
            plan = stage_plan(s.plan, s.schedule.batch_at(meta.step, meta.samples, s.seq_len))
        now = s.schedule.text if s.schedule is not None else ""
        scheduled = bool(now) and meta.batch_schedule == now
        lines += describe_resume(meta, plan, data_changed=meta.data != s.data_id, auto=auto, scheduled=scheduled)
        if meta.batch_schedule != now:  # --allow-data-change let it through (planning.check_schedule)
            lines.append(f"schedule changed --allow-data-change: {meta.batch_schedule or 'none'} -> {now or 'none'}; "
                         "the training differs from an uninterrupted run")  # fmt: skip
    elif resume == RESUME_AUTO:
        lines.append(
            f"resume            auto: no complete checkpoint in {s.output_dir / checkpoint_meta.CHECKPOINTS}, starting fresh"
        )
    return lines


def describe_run(s: Setup, cfg: TrainConfig, resume: str | None, lr_given: bool) -> list[str]:
    rt = s.rt
    mesh = f", HSDP {cfg.replicas} replicas x {rt.world_size // cfg.replicas} shards" if cfg.replicas > 1 else ""
    tokenised = (
        f"done once (on {s.tokenised_on} of {rt.world_size} ranks) and cached"
        if s.tokenised_on
        else "read from the cache (prepared by an earlier run)"
    )
    lines = [
        f"model             {s.source.name}: {s.size.n_params:,} parameters"
        + ("" if s.source.has_weights else f" (initialised from its config, seed {cfg.seed})"),
        *modeling.describe_model(s.model_config, cfg.attn_implementation, cfg.moe_aux_loss),
        *([f"lora              {s.lora}"] if s.lora else []),
        describe_tokenizer(s.tokenizer),
        *(
            _epoch(s, s.stats.describe(s.plan.global_batch, rows_packed(s)))
            if s.stats is not None
            else [f"data              {s.streaming}"]
        ),
        *describe_packing(s, cfg.seed),
        f"tokenisation      {tokenised}" if s.stats is not None else stream_position(s),
        f"training          {s.total_steps} optimizer steps"
        + (f"; eval on {len(s.eval_dataset):,} sequences" if s.eval_dataset is not None else ""),
        *describe_lr(cfg, lr_given, s.source.has_weights, s.total_steps),
        f"device            {rt.device.type} x {rt.world_size} ({rt.backend}){mesh}",
        runtime.describe_threads(),
        f"layout            {s.layout.layout} ({s.layout.reason})",
        f"sharding          {s.settings.describe()}",
        f"micro batch       {s.plan.micro_batch} ({s.micro_reason})",
        f"sync policy       {s.decision.policy} ({s.decision.reason})",
        *(f"note              {note}" for note in s.settings.notes),
        *describe_samples(s, cfg),
        *_conditions(s, resume),
    ]
    return lines
