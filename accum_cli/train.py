"""A training run from a validated config: setup (checks first, heavy work after), loop, save."""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from accum_cli import data, optim, policy, runtime, sharding
from accum_cli import model as modeling
from accum_cli.config import TrainConfig
from accum_cli.errors import UserError
from accum_cli.loop import train_step
from accum_cli.metrics import Reporter, print_lines
from accum_cli.plan import Plan
from accum_cli.sharding import ShardSettings

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


def model_size(model_config, cfg: TrainConfig, bf16: bool) -> policy.ModelSize:
    n_params = modeling.count_parameters(model_config, cfg.trust_remote_code)
    return policy.ModelSize(n_params=n_params, compute_bytes=2 if bf16 else 4)


def check_output_dir(cfg: TrainConfig) -> Path:
    """Refuse before any work: an unwritable place, or a previous run we would clobber."""
    out = Path(cfg.output_dir).expanduser()
    if out.exists() and not out.is_dir():
        raise UserError(f"--output-dir {out} is a file; pass a folder")
    if (out / "config.json").exists() and not cfg.overwrite:
        raise UserError(f"--output-dir {out} holds a previous run; pass --overwrite or another --output-dir")
    existing = out
    while not existing.exists():
        existing = existing.parent
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UserError(f"--output-dir {out} cannot be written (no permission on {existing}); pick another folder")
    return out


def plan_only(cfg: TrainConfig, world_size: int) -> None:
    """--plan: the plan for any world size, from the model's config alone; no training."""
    plan = Plan(cfg.global_batch, cfg.micro_batch, world_size)
    if cfg.strict_batch:
        plan.require_divisible()
    source = modeling.resolve_source(cfg.model)
    model_config = modeling.load_config(source, cfg.trust_remote_code)
    seq_len = resolve_seq_len(cfg, model_config)
    bf16 = cfg.precision != "fp32"  # planning for a cluster: CUDA with bf16 unless told otherwise
    size = model_size(model_config, cfg, bf16)
    memory, where = _planning_memory(cfg)
    decision = policy.choose(cfg.sync, plan, size, memory, cfg.replicas)
    print_lines(plan.describe(seq_len), "plan")
    print_lines(
        [
            *policy.describe(plan, size, memory, cfg.replicas),
            f"(device memory {where}; {'bf16' if bf16 else 'fp32'} compute)",
            f"chosen: {decision.policy} — {decision.reason}",
        ],
        f"sync policy ({cfg.sync})",
    )


def _planning_memory(cfg: TrainConfig) -> tuple[int, str]:
    if cfg.device_memory_gib is not None:
        return int(cfg.device_memory_gib * 2**30), "from --device-memory-gib"
    return runtime.available_ram_bytes(), "this machine's free RAM; set --device-memory-gib for the target"


@dataclass
class Setup:
    rt: runtime.Runtime
    plan: Plan
    seq_len: int
    dataset: object
    tokenizer: object
    model_config: object
    source: modeling.ModelSource
    decision: policy.Decision
    size: policy.ModelSize
    total_steps: int
    settings: ShardSettings
    output_dir: Path


def preflight(cfg: TrainConfig, world_size: int | None):
    """The cheap checks that need no process group: run by the launcher wrapper before it
    starts any worker, and by every worker before any collective, so all ranks fail alike."""
    out = check_output_dir(cfg)
    if world_size is not None:
        plan = Plan(cfg.global_batch, cfg.micro_batch, world_size)
        if cfg.strict_batch:
            plan.require_divisible()
        policy.shard_size(plan, cfg.replicas)
    source = modeling.resolve_source(cfg.model)
    model_config = modeling.load_config(source, cfg.trust_remote_code)
    seq_len = resolve_seq_len(cfg, model_config)
    local = cfg.dataset is not None and cfg.dataset.startswith((".", "/", "~"))
    if local and not Path(cfg.dataset).expanduser().exists():
        raise UserError(f"--dataset {cfg.dataset} does not exist; pass an existing file, folder or hub id")
    return out, source, model_config, seq_len


def setup(cfg: TrainConfig) -> Setup:
    """Every check that can fail on user input runs here, before weights load or files appear."""
    out, source, model_config, seq_len = preflight(cfg, int(os.environ.get("WORLD_SIZE", "1")))
    raw = data.load_raw(cfg.dataset, cfg.trust_remote_code)
    tokenizer = modeling.load_tokenizer(source, cfg.trust_remote_code)
    data.check_raw(raw, tokenizer, cfg.text_column)
    settings = sharding.resolve(cfg, "cuda" if torch.cuda.is_available() else "cpu")

    rt = runtime.start()
    plan = Plan(cfg.global_batch, cfg.micro_batch, rt.world_size)
    if not settings.rank0_loading:
        # transformers reads this too, and would leave ranks > 0 with empty (meta) weights
        os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"] = "false"
    # Rank 0 tokenises first; the others then read the datasets cache instead of redoing it.
    if not rt.is_main:
        dist.barrier()
    dataset = data.prepare(raw, tokenizer, seq_len, cfg.text_column)
    if rt.is_main:
        dist.barrier()
    if len(dataset) < plan.global_batch:
        raise UserError(
            f"the dataset holds {len(dataset)} sequences of up to {seq_len} tokens, fewer than one "
            f"global batch of {plan.global_batch}; lower --global-batch or --seq-len, or add data"
        )
    if data.is_pretokenised(dataset):
        longest = max(len(r) for r in dataset["input_ids"])
        limit = getattr(model_config, "max_position_embeddings", None)
        if limit and longest > limit:
            raise UserError(
                f"a pre-tokenised row has {longest} tokens, above the model's {limit} positions; shorten the rows"
            )
        seq_len = longest
    size = model_size(model_config, cfg, settings.bf16)
    memory = int(cfg.device_memory_gib * 2**30) if cfg.device_memory_gib else runtime.device_memory_bytes(rt)
    decision = policy.choose(cfg.sync, plan, size, memory, cfg.replicas)
    total_steps = cfg.max_steps or max(1, int(cfg.epochs * len(dataset)) // plan.global_batch)
    return Setup(
        rt, plan, seq_len, dataset, tokenizer, model_config, source, decision, size, total_steps, settings, out
    )


def run(cfg: TrainConfig) -> dict:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # our own progress output is the one that matters
    s = setup(cfg)
    rt = s.rt
    if rt.is_main:
        print_lines(s.plan.describe(s.seq_len), "plan")
        print_lines(
            [
                f"model             {s.source.name}: {s.size.n_params:,} parameters"
                + ("" if s.source.has_weights else f" (initialised from its config, seed {cfg.seed})"),
                f"data              {len(s.dataset):,} sequences; {s.total_steps} optimizer steps",
                f"device            {rt.device.type} x {rt.world_size} ({rt.backend})"
                + (
                    f", HSDP {cfg.replicas} replicas x {rt.world_size // cfg.replicas} shards"
                    if cfg.replicas > 1
                    else ""
                ),
                f"sharding          {s.settings.describe()}",
                f"sync policy       {s.decision.policy} ({s.decision.reason})",
                *(f"note              {note}" for note in s.settings.notes),
            ],
            "run",
        )

    model = modeling.build_sharded(s.source, s.model_config, cfg, s.settings, rt, rt.mesh(cfg.replicas))
    optimizer, scheduler = optim.build(model, cfg, s.total_steps)
    reader = data.MicrobatchReader(s.dataset, data.SampleOrder(len(s.dataset), cfg.seed), _pad_id(s))

    if rt.is_main:
        s.output_dir.mkdir(parents=True, exist_ok=True)
        (s.output_dir / "metrics.jsonl").unlink(missing_ok=True)
        resolved = cfg.to_dict() | {"seq_len": s.seq_len}
        record = {
            "config": resolved,
            "plan": {
                "global_batch": s.plan.global_batch,
                "micro_batch": s.plan.micro_batch,
                "world_size": s.plan.world_size,
                "accum_steps": s.plan.accum_steps,
                "rank_samples": [s.plan.rank_samples(r) for r in range(rt.world_size)],
                "sync": s.decision.policy,
                "sync_reason": s.decision.reason,
                "total_steps": s.total_steps,
            },
        }
        (s.output_dir / "config.json").write_text(json.dumps(record, indent=2) + "\n")
    dist.barrier()

    with Reporter(s.output_dir, s.total_steps, rt.device, rt.is_main) as reporter:
        for step in range(s.total_steps):
            started = time.perf_counter()
            microbatches = [reader.read(s.plan.microbatch_range(step, rt.rank, j)) for j in range(s.plan.accum_steps)]
            result = train_step(
                model, optimizer, scheduler, microbatches, s.decision.policy, cfg.grad_clip, rt.device, step
            )
            reporter.step(step, result, time.perf_counter() - started)
        modeling.save_final(model, s.tokenizer, s.output_dir / "final", rt.is_main)
        summary = reporter.last or {}
        if rt.is_main:
            print_lines(
                [
                    f"steps             {s.total_steps}",
                    f"final loss        {summary.get('loss', float('nan')):.4f}",
                    f"tokens            {reporter.tokens_total:,} in {summary.get('elapsed_s', 0):.1f} s",
                    f"model             {s.output_dir / 'final'}",
                    f"metrics           {s.output_dir / 'metrics.jsonl'}",
                ],
                "done",
            )
    return summary


def _pad_id(s: Setup) -> int:
    for candidate in (getattr(s.tokenizer, "pad_token_id", None), getattr(s.model_config, "pad_token_id", None)):
        if isinstance(candidate, int):
            return candidate
    return 0
