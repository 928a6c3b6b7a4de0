"""A run's setup: every check that can fail on user input first (the preflight, also run by the
launcher wrapper before any worker starts), then the data, the plan and the output dir's lock."""

from __future__ import annotations

import dataclasses
import datetime
import os
import shlex
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from accum_cli.config import batch_schedule as schedules
from accum_cli.config import policy
from accum_cli.config.plan import Plan
from accum_cli.config.settings import RESUME_AUTO, TrainConfig
from accum_cli.data import cache, formats, isolate, packing, prepare, prompts, sources, stream
from accum_cli.errors import UserError
from accum_cli.memory import estimate, layout
from accum_cli.model import load as modeling
from accum_cli.model import lora, positions
from accum_cli.parallel import runtime, sharding
from accum_cli.parallel.runtime import env_rank
from accum_cli.parallel.sharding import ShardSettings
from accum_cli.run.data_setup import (
    StreamEnded,
    build_data,
    check_stream,
    data_identity,
    data_keys,
    pad_id_of,
    split_for_eval,
)
from accum_cli.run.planning import (
    check_layout,
    check_schedule,
    decide,
    may_estimate_sharded,
    model_size,
    plan_before_fit,
    resolve_seq_len,
    run_length,
)
from accum_cli.rundir import checkpoint_meta, outdir, tracking

PREPARE_TIMEOUT_H = 24


@dataclass
class Setup:
    rt: runtime.Runtime
    plan: Plan
    seq_len: int
    dataset: object  # prepared data, or a stream.StreamReader (--streaming)
    eval_dataset: object | None
    stats: cache.Stats | None  # None when streaming: the stream is not counted ahead
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
    resume: checkpoint_meta.Meta | None
    data_id: str  # the prepared data and its order: a resume on other data is refused
    layout: layout.Decision
    lock: outdir.RunLock | None  # rank 0's hold on the output dir (None elsewhere, or for --prepare-only)
    streaming: str  # how the stream is read ("" for prepared data)
    replayed_s: float | None  # --streaming resume: seconds spent reading the stream to the checkpoint's sample
    sample_prompts: prompts.Prompts | None  # --sample-prompts as token ids (None without)
    schedule: schedules.Schedule | None = None  # --batch-schedule (None: every step is plan's)
    segments: tuple[schedules.Segment, ...] = ()  # its stages as this run runs them, from its first step
    lora: str = ""  # --lora-r: the adapters and the share of the parameters they are (lora.describe)


def preflight(cfg: TrainConfig, world_size: int | None, resume: str | None = None):
    """The cheap checks that need no process group: run by the launcher wrapper before it
    starts any worker, and by every worker before any collective, so all ranks fail alike."""
    out = outdir.resolve(cfg.output_dir)
    tracking.parse(cfg.report_to)  # a tracker that is not installed is refused before any work
    outdir.check(out, cfg.overwrite, resuming=resume is not None)
    if env_rank() == 0:
        outdir.probe(out)
    meta = checkpoint_meta.resolve_resume(resume, out)
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
    if cfg.sample_prompts is not None:  # the chat template is checked once the tokenizer is loaded (setup)
        prompts.read(cfg.sample_prompts)
    if cfg.lora_r is not None:
        lora.check(cfg)
        shapes = lora.parameter_shapes(model_config, cfg, cfg.trust_remote_code)
    else:
        shapes = modeling.parameter_shapes(model_config, cfg.trust_remote_code)
    if meta is not None and meta.fingerprint != model_fingerprint(cfg, source, shapes):
        adapters = ", other LoRA settings or LoRA on other base weights" if cfg.lora_r is not None else ""
        raise UserError(
            f"--resume {meta.path} was saved from a different model (other parameter names or shapes{adapters}); "
            "pass the --model (and --lora-* options) it was trained with"
        )
    return out, meta, source, model_config, seq_len, shapes


def model_fingerprint(cfg: TrainConfig, source: modeling.ModelSource, shapes: dict) -> str:
    """The checkpoints' model identity: its parameter names and shapes, and under LoRA also which base
    weights the adapters were trained on (a checkpoint holds the adapters only)."""
    names_and_shapes = checkpoint_meta.fingerprint(shapes)
    return names_and_shapes if cfg.lora_r is None else lora.fingerprint(names_and_shapes, lora.base_identity(source))


def setup(cfg: TrainConfig, resume: str | None, prepare_only: bool = False) -> Setup:
    """Every check that can fail on user input runs here, before weights load or files appear."""
    out, meta, source, model_config, seq_len, shapes = preflight(cfg, int(os.environ.get("WORLD_SIZE", "1")), resume)
    tokenizer = modeling.load_tokenizer(source, cfg.trust_remote_code)
    vocab_size = getattr(model_config, "vocab_size", None)
    max_positions = getattr(model_config, "max_position_embeddings", None)
    sample_prompts = prompts.load(cfg.sample_prompts, tokenizer, cfg.sample_tokens, max_positions, vocab_size)
    options = formats.Options(seq_len, cfg.text_column, cfg.packing, cfg.train_on_prompt, vocab_size, cfg.chat_eos)
    prepare.check_num_proc(cfg.num_proc)
    eval_key, raw_eval = None, None
    if cfg.streaming:  # the stream is read as training goes: datasets stays in this process
        raw = sources.load_raw(cfg.dataset, cfg.dataset_config, cfg.split, cfg.trust_remote_code, streaming=True)
        name = cfg.dataset or "(the embedded corpus)"
        streamed = stream.open_source(raw, name, tokenizer, options, cfg.seed, cfg.shuffle_buffer, max_positions)
        data_key = stream.identity(cfg.dataset, cfg.dataset_config, cfg.split, streamed)
        if cfg.eval_dataset:
            raw_eval = sources.load_raw(cfg.eval_dataset, flag="--eval-dataset")
            formats.check(raw_eval, tokenizer, options)
    else:  # read and checked in a child: this process never imports datasets (isolate.py)
        refusal = positions.packing_refusal(model_config) if cfg.packing or cfg.document_masking else None
        refusal = refusal and positions.refusal_line(cfg.model, refusal, cfg.document_masking)
        data_key, eval_key = isolate.in_child(data_keys, cfg, tokenizer, options, refusal)
    data_id = data_identity(data_key, cfg)
    settings = sharding.resolve(cfg, "cuda" if torch.cuda.is_available() else "cpu")
    replayed = None

    if not prepare_only and env_rank() == 0 and may_estimate_sharded(cfg, int(os.environ.get("WORLD_SIZE", "1"))):
        estimate.fork_ahead()  # while no process group is here: forked, not a fresh interpreter (memory/child.py)
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
                cache.remove_abandoned(cache.cache_root())

        return prepare.collect(key, make, options, rt.is_main, leader, barrier)

    if cfg.streaming:
        dataset, stats, tokenised = stream.StreamReader(streamed, pad_id_of(tokenizer, model_config)), None, False
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
    if stats is not None and formats.rows_packed(options, stats.format):  # whole rows into --seq-len sequences
        dataset = packing.PackedRows(dataset, seq_len, cfg.seed)
        stats = dataclasses.replace(stats, samples=len(dataset))  # a sample is a packed sequence
    elif cfg.document_masking:  # text blocks whose documents attend within themselves, evaluated alike
        dataset = packing.DocumentMasked(dataset, tokenizer.eos_token_id)
        if eval_dataset is not None:
            eval_dataset = packing.DocumentMasked(eval_dataset, tokenizer.eos_token_id)
    schedule = schedules.of_config(cfg)
    first_batch = cfg.global_batch if schedule is None else schedule.batch_at(*checkpoint_meta.position(meta), seq_len)
    if cfg.streaming:
        try:
            replayed = check_stream(dataset, meta, first_batch, seq_len)
        except StreamEnded:
            if resume == RESUME_AUTO and finished(out, meta):  # the same command again, after the end
                raise AlreadyFinished(
                    f"nothing to do: the stream ended after step {meta.step}, where {out} finished; it holds"
                    f" {out / 'final'}"
                ) from None
            raise
    elif len(dataset) < first_batch:
        raise UserError(
            f"the dataset holds {len(dataset)} sequences of up to {seq_len} tokens, fewer than one "
            f"global batch of {first_batch}; lower --global-batch or --seq-len, or add data"
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
        chosen_layout, plan, micro_reason, decision = decide(cfg, rt, model_config, seq_len, settings, size)
    check_schedule(schedule, plan, meta, cfg)
    total_steps, segments = run_length(cfg, schedule, meta, seq_len, None if cfg.streaming else len(dataset), plan)
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
                f"write it with `{aside}accum-export {meta.path} {final}{export_base(cfg, source)}`, or raise --max-steps "
                "to train on"
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
        micro_reason, size, model_fingerprint(cfg, source, shapes), total_steps, settings, out, meta, data_id, chosen_layout,
        lock, stream.describe(streamed) if cfg.streaming else "", replayed, sample_prompts, schedule, tuple(segments),
        lora.describe(shapes, cfg) if cfg.lora_r is not None else "",
    )  # fmt: skip


def export_base(cfg: TrainConfig, source: modeling.ModelSource) -> str:
    """What `accum-export` of this run's checkpoint needs besides it: a LoRA checkpoint holds the adapters only."""
    return f" --base {shlex.quote(source.location)}" if cfg.lora_r is not None else ""


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


class AlreadyFinished(Exception):
    """--resume auto on a run that completed: the same command run again (a requeue after the
    end, a restarted pod) succeeds without touching anything."""


def finished(out: Path, meta: checkpoint_meta.Meta) -> bool:
    """final/ was written after the last checkpoint, by the run or by accum-export (both write
    whole folders by a rename, so a config.json there means a complete model)."""
    written = out / "final" / "config.json"
    return written.is_file() and written.stat().st_mtime >= (meta.path / checkpoint_meta.META).stat().st_mtime
