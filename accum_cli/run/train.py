"""A training run from a validated config: setup (checks first, heavy work after), loop, save."""

from __future__ import annotations

import contextlib
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist

from accum_cli.config.settings import TrainConfig
from accum_cli.cpu import hostmem
from accum_cli.data import batches as data
from accum_cli.loss import fused_loss, vocab_parallel
from accum_cli.memory import layout
from accum_cli.model import compiling, wrap
from accum_cli.parallel import sharding
from accum_cli.parallel.sharding import COMPILE_DECIDED_AFTER, ShardSettings
from accum_cli.run.data_setup import pad_id_of
from accum_cli.run.header import describe_run, summarize_run, with_default_lr
from accum_cli.run.planning import describe_stages, stage_plan
from accum_cli.run.record import artefacts, refresh_report, run_name, run_record_of, save_final_model, write_run_record
from accum_cli.run.setup import Setup, setup
from accum_cli.run.signals import StopRequest
from accum_cli.rundir import checkpoint, export, outdir, tracking
from accum_cli.rundir.metrics import Reporter, flops_per_token, print_lines
from accum_cli.rundir.samples import SampleLog
from accum_cli.step import optim
from accum_cli.step.evaluate import eval_loss
from accum_cli.step.loop import check_finite_parameters, train_step
from accum_cli.step.sample import greedy


class Preempted(Exception):
    """Every rank agreed to stop after a signal; a checkpoint was saved."""


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
                packed = s.stats is None or s.stats.packed
                if cfg.verbose or prepare_only:  # preparing only: the data's every detail is the report
                    print_lines(
                        s.plan.describe(s.seq_len, packed), "plan" if s.schedule is None else "plan (the largest stage)"
                    )
                    print_lines(describe_run(s, cfg, resume, lr_given), "run")
                else:
                    print_lines(
                        s.plan.summary(s.seq_len, packed), "plan" if s.schedule is None else "plan (the largest stage)"
                    )
                    print_lines(summarize_run(s, cfg, resume, lr_given), "run")
                if s.schedule is not None:
                    lines = describe_stages(s.schedule, s.segments, s.plan, s.seq_len, cfg.batch_schedule_lr)
                    print_lines(lines, "batch schedule")
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


def train(s: Setup, cfg: TrainConfig) -> dict:
    """Build, restore, run the steps, save: the part of a run that changes the world."""
    rt, plan = s.rt, s.plan
    model = build(s, cfg)
    plan_at, scale = step_plans(s), lr_scale(s, cfg)
    optimizer, scheduler = optim.build(model, cfg, s.total_steps, scale)
    read_step, eval_reader = readers(s, cfg)
    # What training draws (a model's dropout) comes from the run's seed, one stream per rank, so
    # a rerun gives the same losses; a resume then restores the checkpoint's state instead.
    torch.manual_seed((cfg.seed + rt.rank) % 2**64)
    start_step, first_sample, origin = 0, 0, (0, 0)
    if s.resume is not None:
        start_step, first_sample, origin = restore(s, model, optimizer)
        scheduler = optim.schedule(optimizer, cfg, s.total_steps, done_steps=start_step, scale=scale)
    trackers = start_record(s, cfg, start_step)
    record = {
        "origin_step": origin[0], "origin_samples": origin[1], "global_batch": plan_at(start_step, first_sample).global_batch,
        "micro_batch": plan.micro_batch, "world_size": plan.world_size, "seed": cfg.seed,
        "fingerprint": s.fingerprint, "data": s.data_id,
        **({"batch_schedule": s.schedule.text} if s.schedule is not None else {}),
    }  # fmt: skip

    def save_checkpoint(step: int, samples: int, draw: bool = True) -> Path:
        # Every save, the last one included (final/ is written from the same weights right after
        # it), is of finite weights only: else the previous checkpoint stays the newest one.
        check_finite_parameters(model, step, rt.device)
        path, seconds = checkpoint.save(
            s.output_dir, step, samples, model, optimizer, record, s.model_config, s.tokenizer,
            cfg.keep_checkpoints, rt.is_main, rt.device,
        )  # fmt: skip
        if rt.is_main:
            print(f"checkpoint {path} saved in {seconds:.2f} s", flush=True)
            if draw:
                refresh_report(s.output_dir)
        return path

    end = s.total_steps  # the last step; earlier when a stream ends first

    def evaluate(done: int) -> dict:
        if eval_reader is None or not (done == end or (cfg.eval_every and done % cfg.eval_every == 0)):
            return {}
        loss, tokens = eval_loss(model, eval_reader, rt.rank, rt.world_size, plan.micro_batch, rt.device)
        return {"eval_loss": loss, "eval_loss_tokens": tokens}

    sample_log = SampleLog(s.output_dir, s.sample_prompts, s.tokenizer, rt.is_main) if s.sample_prompts else None

    def sample(done: int, samples: int, trackers: tracking.Trackers) -> None:
        """Collective: --sample-prompts completed after step `done` (before its checkpoint: see rundir/samples.py)."""
        if sample_log is None or not (done == end or (cfg.sample_every and done % cfg.sample_every == 0)):
            return
        completions = greedy(model, s.sample_prompts.ids, cfg.sample_tokens, rt.device)
        sample_log.write(done, samples, reporter.tokens_total, completions, trackers)

    reporter = Reporter(
        s.output_dir, s.total_steps, rt.device, rt.is_main, start_step, per_token_flops(s), rt.world_size,
        cfg.log_every, None if s.stats is None or s.stats.packed else plan.global_batch * s.seq_len,
    )  # fmt: skip
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # from here the loop's StopRequest answers it, as before
    with StopRequest() as stop, reporter, contextlib.closing(trackers or tracking.Trackers.none()) as trackers:
        samples = first_sample
        for step in range(start_step, s.total_steps):
            started = time.perf_counter()
            now = plan_at(step, samples)  # a --batch-schedule stage's plan; else the run's
            if now.global_batch != record["global_batch"]:  # a new stage: the checkpoint's origin moves to it
                record.update(origin_step=step, origin_samples=samples, global_batch=now.global_batch)
                if rt.is_main:
                    print(
                        f"stage: from step {step + 1} ({samples * s.seq_len:,} tokens trained) the global batch is "
                        f"{now.global_batch} sequences: {now.summary(s.seq_len)[1].split(maxsplit=1)[1]}",
                        flush=True,
                    )
            microbatches = read_step(step, samples, now)
            next_first = samples + now.global_batch
            # A stream's end is seen one step ahead (alike on every rank), so that step is the last for
            # evaluation, checkpoints and stop requests too.
            upcoming = plan_at(step + 1, next_first).global_batch
            if cfg.streaming and step + 1 < end and not s.dataset.has_step(next_first, upcoming):
                end = step + 1
                if rt.is_main:
                    print(f"the stream ends after step {end} ({next_first:,} samples): the last step", flush=True)
            result = train_step(
                model, optimizer, scheduler, microbatches, s.decision.policy, cfg.grad_clip, rt.device, step + 1,
                cfg.on_nonfinite, cfg.moe_aux_loss,
            )  # fmt: skip
            samples += now.global_batch
            done = step + 1
            seconds = time.perf_counter() - started
            trackers.log(reporter.step(step, result, seconds, {"global_batch": now.global_batch, **evaluate(done)}))
            sample(done, samples, trackers)
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
        return finish(s, cfg, model, last, end, reporter)


def build(s: Setup, cfg: TrainConfig):
    """The model in the decided layout, malloc set for it on CPU (hostmem.py); rank 0 says what was built."""
    rt = s.rt
    replicated = s.layout.layout == layout.REPLICATE
    host = None
    if rt.device.type == "cpu" and replicated and hostmem.keep_the_heap():
        host = "freed tensors kept on the heap for the next microbatch (fixed mmap and trim thresholds)"
    elif rt.device.type == "cpu" and not replicated and hostmem.follow_live_tensors():
        host = "freed tensors go back to the system (fixed mmap threshold)"
    if replicated:
        model = wrap.build_replicated(s.source, s.model_config, cfg, s.settings, rt)
        wrapped = wrap.describe_replicated(model)
    else:
        model = wrap.build_sharded(s.source, s.model_config, cfg, s.settings, rt, rt.mesh(cfg.replicas))
        wrapped = wrap.describe_sharding(model)
        gathers = wrap.vocabulary_gathers(model, hostmem.LEAN_THRESHOLD_BYTES) if host else []
        if gathers and hostmem.give_back_before(gathers):  # host is set only where mallopt is
            host += f"; the heap's free pages too, before each gather of {len(gathers)} vocabulary matrix(es)"
    if host and rt.is_main and cfg.verbose:
        print(f"  {'host memory':<18}{host}", flush=True)
    if rt.is_main and cfg.verbose:
        print(f"  {'wrapped':<18}{wrapped}", flush=True)
        print(f"  {'loss':<18}{fused_loss.describe(model, s.settings.bf16)}", flush=True)
        if (in_place := vocab_parallel.describe(model)) is not None:
            print(f"  {'vocabulary':<18}{in_place}", flush=True)
    return model


def step_plans(s: Setup):
    """`plan_at(step, samples)`: the plan of the step that begins there (a --batch-schedule stage's)."""
    if s.schedule is None:
        return lambda step, samples: s.plan
    plans = {}

    def plan_at(step: int, samples: int):
        g = s.schedule.batch_at(step, samples, s.seq_len)
        return plans.get(g) or plans.setdefault(g, stage_plan(s.plan, g))

    return plan_at


def lr_scale(s: Setup, cfg: TrainConfig):
    """--batch-schedule-lr sqrt: step k's lr times the square root of its stage's increase (None: unchanged)."""
    if s.schedule is None or not s.segments:
        return None
    segments = s.segments

    def scale(step: int) -> float:
        here = next((g for g in reversed(segments) if g.first_step <= step), segments[0])
        return s.schedule.lr_scale(here.global_batch, cfg.batch_schedule_lr)

    return scale


def readers(s: Setup, cfg: TrainConfig):
    """`read_step(step, first_sample, plan)`: this rank's microbatches of a step (under the run's plan,
    or a --batch-schedule stage's); and the evaluation's reader."""
    rank = s.rt.rank
    pad_id = pad_id_of(s.tokenizer, s.model_config)
    if cfg.streaming:
        streamed = s.dataset

        def read_step(step: int, first: int, plan=s.plan) -> list[data.Microbatch]:
            return streamed.microbatches(plan, step, rank, first)
    else:
        reader = data.MicrobatchReader(s.dataset, data.SampleOrder(len(s.dataset), cfg.seed), pad_id)

        def read_step(step: int, first: int, plan=s.plan) -> list[data.Microbatch]:
            return [reader.read(plan.microbatch_range(step, rank, j, first)) for j in range(plan.accum_steps)]

    eval_reader = data.MicrobatchReader(s.eval_dataset, None, pad_id) if s.eval_dataset is not None else None
    return read_step, eval_reader


def restore(s: Setup, model, optimizer) -> tuple[int, int, tuple[int, int]]:
    """Collective: the checkpoint's state loaded; (steps done, samples consumed, where the global batch began)."""
    seconds = checkpoint.load(s.resume, model, optimizer)
    start_step, first_sample = s.resume.step, s.resume.samples
    same_batch = s.resume.global_batch == step_plans(s)(start_step, first_sample).global_batch
    origin = (s.resume.origin_step, s.resume.origin_samples) if same_batch else (start_step, first_sample)
    if s.rt.is_main:
        print(f"checkpoint loaded in {seconds:.2f} s", flush=True)
        rewound = checkpoint.set_aside_later(s.output_dir, start_step)
        if rewound:
            print(f"rewound to step {start_step}: later checkpoints kept aside as {', '.join(rewound)}", flush=True)
    return start_step, first_sample, origin


def start_record(s: Setup, cfg: TrainConfig, start_step: int):
    """Collective: rank 0 claims the folder, starts the trackers and writes config.json; the trackers (or None)."""
    trackers = None
    if s.rt.is_main:
        if not outdir.is_marked(s.output_dir):  # claimed before a tracker writes into it
            outdir.mark(s.output_dir, "run")
        run_record = run_record_of(s, cfg)
        names = tracking.parse(cfg.report_to)
        if names:  # before config.json: a tracker that cannot start leaves no run that blocks a rerun
            logged_until = tracking.sent_until(s.output_dir) if s.resume is not None else 0
            trackers = tracking.Trackers(
                names, run_name(cfg), s.output_dir, run_record, resume_step=start_step, logged_until=logged_until
            )
        write_run_record(s, start_step, run_record)
    dist.barrier()
    return trackers


def per_token_flops(s: Setup) -> float:
    config = s.model_config
    layers, hidden = getattr(config, "num_hidden_layers", 0), getattr(config, "hidden_size", 0)
    return flops_per_token(s.size.n_params, layers, hidden, s.seq_len)


def finish(s: Setup, cfg: TrainConfig, model, last: Path, end: int, reporter: Reporter) -> dict:
    """Collective: final/ in the export dtype (of the weights `last` holds, checked finite before
    it was saved); rank 0 prints the summary."""
    export_dtype = export.resolve_export_dtype(cfg.export_dtype, s.model_config)
    save_final_model(s, model, last, export_dtype)
    summary = reporter.last or {}
    if s.rt.is_main:
        print_lines(
            [
                f"steps             {end}",
                f"final loss        {summary.get('loss', float('nan')):.4f}",
                f"tokens            {reporter.tokens_total:,} in {summary.get('elapsed_s', 0):.1f} s",
                f"model             {s.output_dir / 'final'} ({str(export_dtype).removeprefix('torch.')})",
                *artefacts(s.output_dir, last, tracking.parse(cfg.report_to)),
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
        compiling.compile_now(model)
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
