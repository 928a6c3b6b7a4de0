"""A training run from a validated config: setup (checks first, heavy work after), loop, save."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import hashlib
import json
import math
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from accum_cli import (
    checkpoint,
    data,
    fit,
    fused_loss,
    hostmem,
    isolate,
    layout,
    optim,
    outdir,
    policy,
    prepare,
    report,
    runtime,
    sharding,
    sources,
    stream,
    tracking,
    vocab_parallel,
)
from accum_cli import model as modeling
from accum_cli.config import RESUME_AUTO, TrainConfig
from accum_cli.errors import UserError
from accum_cli.evaluate import eval_loss
from accum_cli.loop import train_step
from accum_cli.metrics import Reporter, flops_per_token, keep_metrics_until, print_lines
from accum_cli.plan import Plan, usable_micro_batch
from accum_cli.runtime import env_rank
from accum_cli.sharding import COMPILE_DECIDED_AFTER, ShardSettings
from accum_cli.signals import StopRequest

EMBEDDED_SEQ_LEN = 128
PREPARE_TIMEOUT_H = 24
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


def fit_target(cfg: TrainConfig, model_config, seq_len: int, world_size: int, settings: ShardSettings) -> fit.Target:
    return fit.Target(
        json.loads(model_config.to_json_string()), cfg.global_batch, world_size, cfg.replicas, seq_len,
        settings.bf16, settings.activation_checkpointing, settings.reshard_after_forward, cfg.strict_batch,
    )  # fmt: skip


def check_layout(cfg: TrainConfig, world_size: int) -> None:
    """The cheap batch and mesh checks, before any estimate (micro batch auto: m = 1 for now)."""
    plan = plan_before_fit(cfg, world_size)
    if cfg.strict_batch:
        plan.require_divisible()
    policy.shard_size(plan, cfg.replicas)


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
    target = fit_target(cfg, model_config, seq_len, world_size, settings)
    choice = layout.decide(cfg.layout, target, usable(cfg, world_size), cfg.sync, budget, show_all=True)
    plan = Plan(cfg.global_batch, choice.micro_batch, world_size)
    if cfg.strict_batch:
        plan.require_divisible()
    print_lines(plan.describe(seq_len), "plan")
    replicated = fit.describe_replicated(choice.replicated, budget, choice.micro_batch) if choice.replicated else []
    if choice.sharded is not None:
        table = fit.describe(target, choice.sharded, budget, replicated)
    else:
        table = [f"budget            {budget.describe()}", *replicated]
    print_lines(
        [
            *table,
            f"micro batch       {choice.micro_batch} ({micro_reason_of(cfg, world_size, choice.micro_reason)})",
            f"chosen: {choice.policy.policy} — {choice.policy.reason}",
            f"layout: {choice.layout.layout} — {choice.layout.reason}",
        ],
        f"memory per rank and sync policy ({cfg.sync})",
    )


def budget_for(cfg: TrainConfig, rt: runtime.Runtime | None = None) -> fit.Budget:
    """--device-memory-gib, else this rank's device (a run) or this machine's free RAM (--plan)."""
    if cfg.device_memory_gib is not None:
        return fit.Budget(int(cfg.device_memory_gib * 2**30), "from --device-memory-gib")
    if rt is None:
        return fit.Budget(
            runtime.available_ram_bytes(), "this machine's free RAM; set --device-memory-gib for the target"
        )
    return fit.Budget(runtime.device_memory_bytes(rt), f"{rt.device.type} memory per local rank")


def decide(cfg: TrainConfig, rt: runtime.Runtime, model_config, seq_len: int, settings: ShardSettings):
    """Collective: the layout, micro batch and sync policy, decided by rank 0 from the estimates
    (layout.decide) and sent to every rank, so all ranks run the same plan whatever each one's
    free memory is."""
    answer = ""
    if rt.is_main:
        target = fit_target(cfg, model_config, seq_len, rt.world_size, settings)
        try:
            choice = layout.decide(cfg.layout, target, usable(cfg, rt.world_size), cfg.sync, budget_for(cfg, rt))
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


@dataclass
class Setup:
    rt: runtime.Runtime
    plan: Plan
    seq_len: int
    dataset: object  # prepared data, or a stream.StreamReader (--streaming)
    eval_dataset: object | None
    stats: prepare.Stats | None  # None when streaming: the stream is not counted ahead
    tokenised_on: int  # ranks that had to tokenise (0: all read the cache)
    tokenizer: object
    model_config: object
    source: modeling.ModelSource
    decision: policy.Decision
    micro_reason: str  # why this micro batch (auto: the estimate's numbers)
    size: policy.ModelSize
    fingerprint: str
    total_steps: int
    settings: ShardSettings
    output_dir: Path
    resume: checkpoint.Meta | None
    data_id: str  # the prepared data and its order: a resume on other data is refused
    layout: layout.Decision
    lock: outdir.RunLock | None  # rank 0's hold on the output dir (None elsewhere, or for --prepare-only)
    streaming: str  # how the stream is read ("" for prepared data)
    replayed_s: float | None  # --streaming resume: seconds spent reading the stream to the checkpoint's sample


def preflight(cfg: TrainConfig, world_size: int | None, resume: str | None = None):
    """The cheap checks that need no process group: run by the launcher wrapper before it
    starts any worker, and by every worker before any collective, so all ranks fail alike."""
    out = outdir.resolve(cfg.output_dir)
    tracking.parse(cfg.report_to)  # a tracker that is not installed is refused before any work
    outdir.check(out, cfg.overwrite, resuming=resume is not None)
    if env_rank() == 0:
        outdir.probe(out)
    meta = checkpoint.resolve_resume(resume, out)
    if world_size is not None:
        check_layout(cfg, world_size)
    source = modeling.resolve_source(cfg.model)
    model_config = modeling.load_config(source, cfg.trust_remote_code)
    modeling.check_weights(source)
    modeling.set_attention(model_config, cfg.attn_implementation, "cuda" if torch.cuda.is_available() else "cpu")
    modeling.check_router_loss(model_config, cfg.moe_aux_loss)
    seq_len = resolve_seq_len(cfg, model_config)
    sources.check_exists(cfg.dataset)
    sources.check_exists(cfg.eval_dataset, "--eval-dataset")
    shapes = modeling.parameter_shapes(model_config, cfg.trust_remote_code)
    if meta is not None and meta.fingerprint != checkpoint.fingerprint(shapes):
        raise UserError(
            f"--resume {meta.path} was saved from a different model (other parameter names or shapes); "
            "pass the --model it was trained with"
        )
    return out, meta, source, model_config, seq_len, shapes


def setup(cfg: TrainConfig, resume: str | None, prepare_only: bool = False) -> Setup:
    """Every check that can fail on user input runs here, before weights load or files appear."""
    out, meta, source, model_config, seq_len, shapes = preflight(cfg, int(os.environ.get("WORLD_SIZE", "1")), resume)
    tokenizer = modeling.load_tokenizer(source, cfg.trust_remote_code)
    vocab_size = getattr(model_config, "vocab_size", None)
    options = prepare.Options(seq_len, cfg.text_column, cfg.packing, cfg.train_on_prompt, vocab_size)
    prepare.check_num_proc(cfg.num_proc)
    eval_key, raw_eval = None, None
    if cfg.streaming:  # the stream is read as training goes: datasets stays in this process
        raw = sources.load_raw(cfg.dataset, cfg.dataset_config, cfg.split, cfg.trust_remote_code, streaming=True)
        max_positions = getattr(model_config, "max_position_embeddings", None)
        name = cfg.dataset or "(the embedded corpus)"
        streamed = stream.open_source(raw, name, tokenizer, options, cfg.seed, cfg.shuffle_buffer, max_positions)
        data_key = stream.identity(cfg.dataset, cfg.dataset_config, cfg.split, streamed)
        if cfg.eval_dataset:
            raw_eval = sources.load_raw(cfg.eval_dataset, flag="--eval-dataset")
            prepare.check(raw_eval, tokenizer, options)
    else:  # read and checked in a child: this process never imports datasets (isolate.py)
        data_key, eval_key = isolate.in_child(data_keys, cfg, tokenizer, options)
    data_id = data_identity(data_key, cfg)
    settings = sharding.resolve(cfg, "cuda" if torch.cuda.is_available() else "cpu")
    replayed = None

    rt = runtime.start()
    if not settings.rank0_loading:
        # transformers reads this too, and would leave ranks > 0 with empty (meta) weights
        os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"] = "false"
    # Tokenising a big corpus on rank 0 can outlast the process group's timeout, so the other
    # ranks wait for it on a CPU group of their own with a generous one.
    prep_group = dist.new_group(backend="gloo", timeout=datetime.timedelta(hours=PREPARE_TIMEOUT_H))

    def barrier() -> None:
        dist.barrier(group=prep_group)

    leader = rt.local_rank == 0

    def prepared(key: str, evaluation: bool):
        def make(show_progress: bool) -> None:
            try:
                isolate.in_child(build_data, cfg, tokenizer, options, key, evaluation, show_progress)
            finally:  # a child stopped halfway (Ctrl-C, a signal) leaves its private folder: gone with it
                prepare.remove_abandoned(prepare.cache_root())

        return prepare.collect(key, make, options, rt.is_main, leader, barrier)

    if cfg.streaming:
        dataset, stats, tokenised = stream.StreamReader(streamed, _pad_id(tokenizer, model_config)), None, False
    else:
        dataset, stats, tokenised = prepared(data_key, evaluation=False)
    tokenised_on = int(runtime.all_reduce_sum(torch.tensor([int(tokenised)], device=rt.device)).item())
    eval_dataset, eval_stats = None, None
    if cfg.eval_dataset:
        if cfg.streaming:
            eval_dataset, eval_stats, _ = prepare.prepare(
                raw_eval, tokenizer, options, rt.is_main, leader, barrier, cfg.num_proc
            )
        else:
            eval_dataset, eval_stats, _ = prepared(eval_key, evaluation=True)
    elif cfg.eval_split_ratio:
        dataset, eval_dataset = split_for_eval(dataset, cfg.eval_split_ratio, cfg.seed)
    if cfg.streaming:
        try:
            replayed = check_stream(dataset, meta, cfg.global_batch, seq_len)
        except StreamEnded:
            if resume == RESUME_AUTO and finished(out, meta):  # the same command again, after the end
                raise AlreadyFinished(
                    f"nothing to do: the stream ended after step {meta.step}, where {out} finished; it holds"
                    f" {out / 'final'}"
                ) from None
            raise
    elif len(dataset) < cfg.global_batch:
        raise UserError(
            f"the dataset holds {len(dataset)} sequences of up to {seq_len} tokens, fewer than one "
            f"global batch of {cfg.global_batch}; lower --global-batch or --seq-len, or add data"
        )
    # Pre-tokenised rows are not cut to --seq-len unless asked: the longest must fit the model, the
    # evaluation's too (it would stop the run at its first evaluation), and sizes the estimate.
    pretokenised = [x for x in (stats, eval_stats) if x is not None and x.format == "tokens"]
    if pretokenised:
        longest = max(x.longest for x in pretokenised)
        limit = getattr(model_config, "max_position_embeddings", None)
        if limit and longest > limit:
            raise UserError(
                f"a pre-tokenised row has {longest} tokens, above the model's {limit} positions; "
                "shorten the rows or pass --no-packing --seq-len N to truncate them"
            )
        if stats is not None and stats.format == "tokens":
            seq_len = longest
    size = model_size(shapes, settings.bf16)
    if prepare_only:  # nothing trains: no estimate
        plan = plan_before_fit(cfg, rt.world_size)
        chosen_layout, micro_reason = layout.Decision(cfg.layout, "--prepare-only"), "--prepare-only"
        decision = policy.Decision(cfg.sync, "--prepare-only")
    else:
        chosen_layout, plan, micro_reason, decision = decide(cfg, rt, model_config, seq_len, settings)
    total_steps = cfg.max_steps or epoch_steps(int(cfg.epochs * len(dataset)), plan.global_batch, meta)
    if meta is not None and meta.step >= total_steps:
        done = meta.step == total_steps and finished(out, meta)
        if done and resume == RESUME_AUTO:
            raise AlreadyFinished(
                f"nothing to do: {out} already finished its {total_steps} steps and holds {out / 'final'}; "
                "raise --max-steps to train on"
            )
        if meta.step == total_steps and not done:
            final = out / "final"
            aside = f"mv {final} {out / 'final.old'} && " if final.exists() else ""
            raise UserError(
                f"--resume {meta.path} is the run's last step ({total_steps}) but final/ was not written after it; "
                f"write it with `{aside}accum-export {meta.path} {final}`, or raise --max-steps to train on"
            )
        raise UserError(
            f"--resume {meta.path} is at step {meta.step}, already past --max-steps {total_steps}; raise --max-steps"
        )
    final = out / "final"
    if meta is not None and final.is_dir() and not outdir.is_marked(final) and any(final.iterdir()):
        # A finished run's export is fine (above); training on would write final/ at the end.
        raise UserError(
            f"--output-dir {out}: its final/ holds a model accum-train did not write (an export?) and the run "
            f"would write its own there after step {total_steps}; move it away first (mv {final} {out / 'final.old'})"
        )
    if meta is not None and meta.data != data_id and not cfg.allow_data_change:
        raise UserError(
            f"--resume {meta.path} was trained on other data (the dataset, its preparation, --seed or "
            "--eval-split-ratio changed); resume with the same data, or pass --allow-data-change to continue "
            "knowingly (the training then differs from an uninterrupted run)"
        )
    # resuming: also --resume auto that found no checkpoint yet, in a folder that may hold the
    # record of the same run killed before its first one (a fresh start then replaces it)
    lock = None if prepare_only else hold_output_dir(cfg, out, rt, resuming=resume is not None)
    return Setup(
        rt, plan, seq_len, dataset, eval_dataset, stats, tokenised_on, tokenizer, model_config, source, decision,
        micro_reason, size, checkpoint.fingerprint(shapes), total_steps, settings, out, meta, data_id, chosen_layout,
        lock, stream.describe(streamed) if cfg.streaming else "", replayed,
    )  # fmt: skip


def epoch_steps(samples: int, global_batch: int, meta: checkpoint.Meta | None) -> int:
    """--epochs as optimizer steps: `samples` in steps of the global batch. Resumed at another
    global batch, the steps done count as they were and what is left of the samples is split
    into steps of the new one: the run trains on the same samples, no more and no fewer."""
    if meta is None or meta.global_batch == global_batch:
        return max(1, samples // global_batch)
    return meta.step + max(0, samples - meta.samples) // global_batch


def check_stream(
    reader: stream.StreamReader, meta: checkpoint.Meta | None, global_batch: int, seq_len: int
) -> float | None:
    """The stream holds the run's first step. A resume reads the stream again up to the checkpoint's
    position (the exact way back, see stream.py); returns the seconds that took (None: a fresh start)."""
    first = meta.samples if meta is not None else 0
    started = time.perf_counter()
    if reader.has_step(first, global_batch):
        return time.perf_counter() - started if meta is not None else None
    if meta is None:
        raise UserError(
            f"the stream holds fewer than one global batch of {global_batch} sequences of up to {seq_len} tokens; "
            "lower --global-batch or --seq-len, or add data"
        )
    raise StreamEnded(
        f"--resume {meta.path}: the stream ends before sample {first + global_batch:,}, so no step is left after "
        "the checkpoint's; the run is complete"
    )


class StreamEnded(UserError):
    """A resume whose stream holds no step after the checkpoint's: the run ended with its stream."""


def _raw(cfg: TrainConfig, evaluation: bool):
    if evaluation:
        return sources.load_raw(cfg.eval_dataset, flag="--eval-dataset")
    return sources.load_raw(cfg.dataset, cfg.dataset_config, cfg.split, cfg.trust_remote_code)


def data_keys(cfg: TrainConfig, tokenizer, options: prepare.Options) -> tuple[str, str | None]:
    """The cheap checks of the training (and evaluation) data and their cache keys: every rank, before
    any collective, so all fail alike. Run in a child (isolate.py): it reads the rows with datasets."""
    keys = []
    for evaluation in (False, True) if cfg.eval_dataset else (False,):
        rows = prepare.as_rows(_raw(cfg, evaluation))
        keys.append(prepare.cache_key(rows, tokenizer, options, prepare.check(rows, tokenizer, options)))
    return keys[0], (keys[1] if len(keys) > 1 else None)


def build_data(cfg: TrainConfig, tokenizer, options: prepare.Options, key: str, evaluation: bool,
               show_progress: bool) -> None:  # fmt: skip
    """Tokenise the rows into the cache as `key` (the key data_keys found). Run in a child, as data_keys."""
    rows = prepare.as_rows(_raw(cfg, evaluation))
    fmt = prepare.check(rows, tokenizer, options)
    prepare.build(rows, tokenizer, options, fmt, key, cfg.num_proc or prepare.default_num_proc(), show_progress)


def data_identity(prepared_key: str, cfg: TrainConfig) -> str:
    """The prepared data and everything that decides its order and split."""
    text = json.dumps([prepared_key, cfg.seed, cfg.eval_split_ratio])
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def hold_output_dir(cfg: TrainConfig, out: Path, rt: runtime.Runtime, resuming: bool) -> outdir.RunLock | None:
    """Collective: rank 0 locks the output dir for the run's life and checks it again under the
    lock (another run may have written it since the preflight); every rank fails alike."""
    lock, problem = None, ""
    if rt.is_main:
        lock = outdir.RunLock(out)
        try:
            lock.acquire()
            outdir.check(out, cfg.overwrite, resuming)
        except UserError as exc:
            lock.release()
            problem = str(exc)
    if not runtime.all_ok(not problem, rt.device):
        raise UserError(problem)  # printed by rank 0 alone
    return lock


def split_for_eval(dataset, ratio: float, seed: int):
    """Hold out a seeded share of the prepared sequences; at least one of each side."""
    n = len(dataset)
    if n < 2:
        raise UserError(
            f"--eval-split-ratio needs at least 2 sequences to hold one out, and the dataset makes {n} of"
            " --seq-len tokens; use a larger dataset or a shorter --seq-len, or pass --eval-dataset"
        )
    held = min(max(1, round(n * ratio)), n - 1)
    order = np.random.default_rng([seed, 0x5EED]).permutation(n)
    return dataset.select(np.sort(order[held:])), dataset.select(np.sort(order[:held]))


class AlreadyFinished(Exception):
    """--resume auto on a run that completed: the same command run again (a requeue after the
    end, a restarted pod) succeeds without touching anything."""


def finished(out: Path, meta: checkpoint.Meta) -> bool:
    """final/ was written after the last checkpoint, by the run or by accum-export (both write
    whole folders by a rename, so a config.json there means a complete model)."""
    written = out / "final" / "config.json"
    return written.is_file() and written.stat().st_mtime >= (meta.path / checkpoint.META).stat().st_mtime


class Preempted(Exception):
    """Every rank agreed to stop after a signal; a checkpoint was saved."""


def describe_resume(meta: checkpoint.Meta, plan: Plan, data_changed: bool = False, auto: bool = False) -> list[str]:
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


def run(cfg: TrainConfig, resume: str | None = None, prepare_only: bool = False) -> dict:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # our own progress output is the one that matters
    # Until the training loop takes over SIGTERM (StopRequest, at a step boundary), a preemption
    # stops the setup at once: there is nothing to save yet, and the run can be started again.
    previous = signal.signal(signal.SIGTERM, _stop_before_training)
    try:
        s = setup(cfg, resume, prepare_only)
        lr_given = cfg.lr is not None
        cfg = with_default_lr(cfg, s.source.has_weights)
        try:
            if s.rt.is_main:
                print_lines(s.plan.describe(s.seq_len), "plan")
                print_lines(describe_run(s, cfg, resume, lr_given), "run")
            if prepare_only:
                return {"samples": s.stats.samples}
            return train(s, cfg)
        finally:
            if s.lock is not None:
                s.lock.release()
    finally:
        signal.signal(signal.SIGTERM, previous)


class StoppedBeforeTraining(BaseException):
    """SIGTERM before the first step of this attempt (loading, preparing, estimating, resuming):
    a BaseException, as Ctrl-C's, so that no `except Exception` takes it for a failure."""


def _stop_before_training(signum, frame) -> None:
    raise StoppedBeforeTraining


PRETRAINED_LR = 2e-5  # full fine-tuning of pretrained LLM weights: 1e-3 would wreck them in a few steps
FROM_SCRATCH_LR = 1e-3  # a small model trained from its config (the embedded default)


def with_default_lr(cfg: TrainConfig, pretrained: bool) -> TrainConfig:
    """--lr unset: a rate that fits the weights (pretrained or from scratch)."""
    if cfg.lr is not None:
        return cfg
    return dataclasses.replace(cfg, lr=PRETRAINED_LR if pretrained else FROM_SCRATCH_LR)


def describe_lr(cfg: TrainConfig, given: bool, pretrained: bool, total_steps: int) -> list[str]:
    origin = "--lr" if given else f"default for {'pretrained weights' if pretrained else 'training from scratch'}"
    lines = [f"learning rate     {cfg.lr:g} peak ({origin}), {cfg.lr_schedule}, {cfg.warmup_steps} warmup steps"]
    if cfg.warmup_steps > total_steps:  # the run ends inside the warmup: the peak is never reached
        lines.append(
            f"note              the warmup is longer than the run's {total_steps} steps: the learning rate rises"
            f" to {cfg.lr * total_steps / cfg.warmup_steps:.3g} only; --warmup-steps {total_steps} reaches {cfg.lr:g}"
        )
    return lines


def stream_position(s: Setup) -> str:
    if s.resume is None:
        return "stream            read from its start"
    return (
        f"stream            read again up to sample {s.resume.samples:,} to resume exactly "
        f"({s.replayed_s:.1f} s, without training)"
    )


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
        *(s.stats.describe(s.plan.global_batch) if s.stats is not None else [f"data              {s.streaming}"]),
        f"tokenisation      {tokenised}" if s.stats is not None else stream_position(s),
        f"training          {s.total_steps} optimizer steps"
        + (f"; eval on {len(s.eval_dataset):,} sequences" if s.eval_dataset is not None else ""),
        *describe_lr(cfg, lr_given, s.source.has_weights, s.total_steps),
        f"device            {rt.device.type} x {rt.world_size} ({rt.backend}){mesh}",
        f"layout            {s.layout.layout} ({s.layout.reason})",
        f"sharding          {s.settings.describe()}",
        f"micro batch       {s.plan.micro_batch} ({s.micro_reason})",
        f"sync policy       {s.decision.policy} ({s.decision.reason})",
        *(f"note              {note}" for note in s.settings.notes),
    ]
    if s.lock is not None and s.lock.took_over is not None:
        lines.append(
            f"note              took over the stale lock of a run that is gone ({s.lock.took_over.describe()})"
        )
    if s.resume is not None:
        auto = resume == RESUME_AUTO
        lines += describe_resume(s.resume, s.plan, data_changed=s.resume.data != s.data_id, auto=auto)
    elif resume == RESUME_AUTO:
        lines.append(
            f"resume            auto: no complete checkpoint in {s.output_dir / checkpoint.CHECKPOINTS}, starting fresh"
        )
    return lines


def train(s: Setup, cfg: TrainConfig) -> dict:
    """Build, restore, run the steps, save: the part of a run that changes the world."""
    rt, plan = s.rt, s.plan
    replicated = s.layout.layout == layout.REPLICATE
    host = None  # malloc set for what the layout is for (hostmem.py), on CPU
    if rt.device.type == "cpu" and replicated and hostmem.keep_the_heap():
        host = "freed tensors kept on the heap for the next microbatch (fixed mmap and trim thresholds)"
    elif rt.device.type == "cpu" and not replicated and hostmem.follow_live_tensors():
        host = "freed tensors go back to the system (fixed mmap threshold)"
    if replicated:
        model = modeling.build_replicated(s.source, s.model_config, cfg, s.settings, rt)
        wrapped = modeling.describe_replicated(model)
    else:
        model = modeling.build_sharded(s.source, s.model_config, cfg, s.settings, rt, rt.mesh(cfg.replicas))
        wrapped = modeling.describe_sharding(model)
        gathers = modeling.vocabulary_gathers(model, hostmem.LEAN_THRESHOLD_BYTES) if host else []
        if gathers and hostmem.give_back_before(gathers):  # host is set only where mallopt is
            host += f"; the heap's free pages too, before each gather of {len(gathers)} vocabulary matrix(es)"
    if host and rt.is_main:
        print(f"  {'host memory':<18}{host}", flush=True)
    if rt.is_main:
        print(f"  {'wrapped':<18}{wrapped}", flush=True)
        print(f"  {'loss':<18}{fused_loss.describe(model)}", flush=True)
        if (in_place := vocab_parallel.describe(model)) is not None:
            print(f"  {'vocabulary':<18}{in_place}", flush=True)
    optimizer, scheduler = optim.build(model, cfg, s.total_steps)
    pad_id = _pad_id(s.tokenizer, s.model_config)
    if cfg.streaming:
        streamed = s.dataset

        def read_step(step: int, first: int) -> list[data.Microbatch]:
            return streamed.microbatches(plan, step, rt.rank, first)
    else:
        reader = data.MicrobatchReader(s.dataset, data.SampleOrder(len(s.dataset), cfg.seed), pad_id)

        def read_step(step: int, first: int) -> list[data.Microbatch]:
            return [reader.read(plan.microbatch_range(step, rt.rank, j, first)) for j in range(plan.accum_steps)]

    eval_reader = data.MicrobatchReader(s.eval_dataset, None, pad_id) if s.eval_dataset is not None else None

    end = s.total_steps  # the last step; earlier when a stream ends first

    def evaluate(done: int) -> dict:
        if eval_reader is None:
            return {}
        if not (done == end or (cfg.eval_every and done % cfg.eval_every == 0)):
            return {}
        loss, tokens = eval_loss(model, eval_reader, rt.rank, rt.world_size, plan.micro_batch, rt.device)
        return {"eval_loss": loss, "eval_loss_tokens": tokens}

    # What training draws (a model's dropout) comes from the run's seed, one stream per rank, so
    # a rerun gives the same losses; a resume then restores the checkpoint's state instead.
    torch.manual_seed((cfg.seed + rt.rank) % 2**64)
    start_step, first_sample, origin = 0, 0, (0, 0)
    if s.resume is not None:
        seconds = checkpoint.load(s.resume, model, optimizer)
        start_step, first_sample = s.resume.step, s.resume.samples
        scheduler = optim.schedule(optimizer, cfg, s.total_steps, done_steps=start_step)
        same_batch = s.resume.global_batch == plan.global_batch
        origin = (s.resume.origin_step, s.resume.origin_samples) if same_batch else (start_step, first_sample)
        if rt.is_main:
            print(f"checkpoint loaded in {seconds:.2f} s", flush=True)
            rewound = checkpoint.set_aside_later(s.output_dir, start_step)
            if rewound:
                print(f"rewound to step {start_step}: later checkpoints kept aside as {', '.join(rewound)}", flush=True)

    trackers = None
    if rt.is_main:
        if not outdir.is_marked(s.output_dir):  # claimed before a tracker writes into it
            outdir.mark(s.output_dir, "run")
        run_record = _run_record(s, cfg)
        names = tracking.parse(cfg.report_to)
        if names:  # before config.json: a tracker that cannot start leaves no run that blocks a rerun
            logged_until = tracking.sent_until(s.output_dir) if s.resume is not None else 0
            trackers = tracking.Trackers(
                names, run_name(cfg), s.output_dir, run_record, resume_step=start_step, logged_until=logged_until
            )
        _write_run_record(s, start_step, run_record)
    dist.barrier()

    record = {
        "origin_step": origin[0], "origin_samples": origin[1], "global_batch": plan.global_batch,
        "micro_batch": plan.micro_batch, "world_size": plan.world_size, "seed": cfg.seed,
        "fingerprint": s.fingerprint, "data": s.data_id,
    }  # fmt: skip

    def save_checkpoint(step: int, samples: int, draw: bool = True) -> Path:
        path, seconds = checkpoint.save(
            s.output_dir, step, samples, model, optimizer, record, s.model_config, s.tokenizer,
            cfg.keep_checkpoints, rt.is_main, rt.device,
        )  # fmt: skip
        if rt.is_main:
            print(f"checkpoint {path} saved in {seconds:.2f} s", flush=True)
            if draw:
                refresh_report(s.output_dir)
        return path

    per_token = flops_per_token(
        s.size.n_params,
        getattr(s.model_config, "num_hidden_layers", 0),
        getattr(s.model_config, "hidden_size", 0),
        s.seq_len,
    )
    reporter = Reporter(
        s.output_dir, s.total_steps, rt.device, rt.is_main, start_step, per_token, rt.world_size, cfg.log_every
    )
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # from here the loop's StopRequest answers it, as before
    with StopRequest() as stop, reporter, contextlib.closing(trackers or tracking.Trackers.none()) as trackers:
        samples = first_sample
        for step in range(start_step, s.total_steps):
            started = time.perf_counter()
            microbatches = read_step(step, samples)
            next_first = samples + plan.global_batch
            # A stream's end is seen one step ahead (alike on every rank), so that step is the last for
            # evaluation, checkpoints and stop requests too.
            if cfg.streaming and step + 1 < end and not streamed.has_step(next_first, plan.global_batch):
                end = step + 1
                if rt.is_main:
                    print(f"the stream ends after step {end} ({next_first:,} samples): the last step", flush=True)
            result = train_step(
                model, optimizer, scheduler, microbatches, s.decision.policy, cfg.grad_clip, rt.device, step + 1,
                cfg.on_nonfinite, cfg.moe_aux_loss,
            )  # fmt: skip
            samples += plan.global_batch
            done = step + 1
            seconds = time.perf_counter() - started
            trackers.log(reporter.step(step, result, seconds, evaluate(done)))
            if s.settings.compile_auto and done - start_step == COMPILE_DECIDED_AFTER and done < end:
                decide_compile(model, s.settings, end - done, seconds, rt)
            if done < end and stop.agreed(rt.device):  # the last step just finishes
                # Who asked is read now: once a rank has exited, the launcher signals the others too.
                asked_by = stop.signal_name or "a signal on another rank"
                path = save_checkpoint(done, samples, draw=False)  # a preempted job's grace is short
                waited = time.monotonic() - stop.received_at if stop.received_at else 0.0
                raise Preempted(
                    f"stopped by {asked_by} after step {done} "
                    f"({waited:.2f} s after the signal); resume with --resume (checkpoint {path})"
                )
            if cfg.checkpoint_every and done % cfg.checkpoint_every == 0 and done < end:
                save_checkpoint(done, samples)
            if done == end:
                break
        last = save_checkpoint(end, samples)
        export_dtype = modeling.export_dtype(cfg.export_dtype, s.model_config)
        save_final_model(s, model, last, export_dtype)
        summary = reporter.last or {}
        if rt.is_main:
            print_lines(
                [
                    f"steps             {end}",
                    f"final loss        {summary.get('loss', float('nan')):.4f}",
                    f"tokens            {reporter.tokens_total:,} in {summary.get('elapsed_s', 0):.1f} s",
                    f"model             {s.output_dir / 'final'} ({str(export_dtype).removeprefix('torch.')})",
                    f"metrics           {s.output_dir / 'metrics.jsonl'}",
                ],
                "done",
            )
    return summary


def decide_compile(model, settings: ShardSettings, remaining_steps: int, step_seconds: float, rt) -> None:
    """Collective: `--compile` unset compiles the decoder layers from the next step when the rest of
    the run, at the slowest rank's last eager step, is long enough to pay for it (sharding.compile_pays)."""
    slowest = torch.tensor([step_seconds], dtype=torch.float64, device=rt.device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # one time for all ranks: one decision
    step_seconds = float(slowest.item())
    remaining = remaining_steps * step_seconds
    pays = sharding.compile_pays(remaining_steps, step_seconds, settings.compile_after_s)
    if pays:
        modeling.compile_now(model)
    if rt.is_main:
        steps = f"{remaining_steps} step{'s' if remaining_steps != 1 else ''}"
        about = f"{steps} of {step_seconds:.2f} s remain (~{remaining / 60:.1f} min eager)"
        threshold = f"{settings.compile_after_s / 60:g} min"
        print(
            f"compile: {about}, at least {threshold}: compiling the decoder layers, in the next step"
            if pays
            else f"compile: {about}, under the {threshold} that pay for compiling: staying eager (--compile forces it)",
            flush=True,
        )


def run_name(cfg: TrainConfig) -> str:
    """--run-name, else the output dir's name: the same on every restart of the run."""
    return cfg.run_name or Path(cfg.output_dir).expanduser().resolve().name


def refresh_report(output_dir: Path) -> None:
    """Rank 0: redraw report.png (loss, lr, grad norm, tokens/s, memory) when matplotlib is there."""
    if not report.available():
        return
    try:
        report.draw([output_dir], output_dir / report.REPORT)
    except Exception as exc:  # a picture must never cost the run: say so and go on
        print(f"note: report.png not drawn ({type(exc).__name__}: {str(exc)[:120]})", flush=True)


def save_final_model(s: Setup, model, last_checkpoint: Path, dtype: torch.dtype) -> None:
    """Collective: the HF-format model in `dtype`; a failed write leaves the final checkpoint to export from."""
    error = None
    try:
        modeling.save_final(model, s.tokenizer, s.output_dir / "final", s.rt.is_main, dtype)
    except OSError as exc:
        error = exc
    if not runtime.all_ok(error is None, s.rt.device):
        need = sum(p.numel() for p in model.parameters()) * dtype.itemsize
        full = checkpoint.full_disk(getattr(error, "errno", None), need, s.output_dir)
        why = full or (f"{error.strerror or error}" if error else "it failed on rank 0")
        raise checkpoint.SaveFailed(
            f"the final model could not be written to {s.output_dir / 'final'}: {why}; the checkpoint "
            f"{last_checkpoint} holds the trained state: {'free space' if full else 'fix that'}, then "
            f"accum-export {last_checkpoint} OUT"
        )


def _run_record(s: Setup, cfg: TrainConfig) -> dict:
    """What config.json holds, and the trackers' hyper-parameters: the resolved configuration and the plan."""
    return {
        # Not --overwrite: `--recipe config.json` reruns the training, and must not discard this run.
        "config": cfg.to_dict() | {"seq_len": s.seq_len, "overwrite": False} | s.settings.as_flags(),
        "plan": {
            "global_batch": s.plan.global_batch,
            "micro_batch": s.plan.micro_batch,
            "micro_batch_reason": s.micro_reason,
            "world_size": s.plan.world_size,
            "accum_steps": s.plan.accum_steps,
            "rank_samples": [s.plan.rank_samples(r) for r in range(s.plan.world_size)],
            "layout": s.layout.layout,
            "sync": s.decision.policy,
            "sync_reason": s.decision.reason,
            "total_steps": s.total_steps,
        },
        "resumed_from": str(s.resume.path) if s.resume else None,
    }


def _write_run_record(s: Setup, start_step: int, record: dict) -> None:
    """Rank 0, under the lock, in a folder already claimed: clear a previous run of ours if asked, write config.json."""
    out = s.output_dir
    if s.resume is not None:
        tracking.remember_sent(out)
        keep_metrics_until(out, start_step)
    else:  # a fresh run (--overwrite): nothing of the old run may be mistaken for this one's
        outdir.clear_previous_run(out)
        tracking.forget_sent(out)
    removed = checkpoint.tidy(out)
    if removed:
        print(f"removed what an interrupted save left: {', '.join(removed)}", flush=True)
    (out / "config.json").write_text(json.dumps(record, indent=2) + "\n")


def _pad_id(tokenizer, model_config) -> int:
    """The id padding positions hold. They are masked out of attention and loss, so any id the
    embedding has pads them alike; one outside it (an old Llama config's -1, a pad token added to
    the tokenizer without resizing the embeddings) would crash the lookup, so 0 stands in."""
    vocab = getattr(model_config, "vocab_size", None)
    for candidate in (getattr(tokenizer, "pad_token_id", None), getattr(model_config, "pad_token_id", None)):
        if isinstance(candidate, int) and candidate >= 0 and (not isinstance(vocab, int) or candidate < vocab):
            return candidate
    return 0
