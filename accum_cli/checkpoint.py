"""Sharded checkpoints with torch.distributed.checkpoint (DCP): save, resume, export.

Layout of `OUTPUT_DIR/checkpoints/step-XXXXXX/`:
- DCP shards and `.metadata`: the model and optimizer state, each rank writing its shards;
  DCP reshards on load, so a run can resume with another world size or micro batch.
- `rng-rankN.safetensors`: each rank's RNG state (tensors only, no pickle).
- `config.json` and tokenizer files: the model's, so the checkpoint exports on its own.
- `meta.json`, written last: step, data position (global samples consumed), the LR
  scheduler, the layout it was saved with, the model's fingerprint, the size of every shard
  (a torn copy is refused up front) and the SHA-256 of DCP's `.metadata` file. DCP unpickles that file on load, so it is verified first: a checkpoint
  that this tool did not write completely is refused before anything is unpickled.

A checkpoint is written under a hidden temporary name and renamed when complete, so a crash
mid-save leaves the previous checkpoint intact and no half-written one visible.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from accum_cli import model as modeling
from accum_cli.config import RESUME_AUTO, RESUME_LATEST
from accum_cli.errors import UserError, first_line

CHECKPOINTS = "checkpoints"
META = "meta.json"
FORMAT_VERSION = 1


@dataclass(frozen=True, slots=True)
class Meta:
    path: Path
    step: int  # optimizer steps completed
    samples: int  # global samples consumed: the data position
    global_batch: int
    micro_batch: int
    world_size: int
    seed: int
    fingerprint: str
    scheduler: dict
    metadata_sha256: str
    shard_bytes: dict  # DCP file name -> size: a torn or missing shard is caught before loading


def step_dir(root: Path, step: int) -> Path:
    return root / CHECKPOINTS / f"step-{step:06d}"


def fingerprint(shapes: dict[str, tuple[int, ...]]) -> str:
    """Identifies a model by its parameter names and shapes."""
    text = json.dumps(sorted((name, list(shape)) for name, shape in shapes.items()))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def latest(root: Path) -> Path | None:
    """The newest complete checkpoint under OUTPUT_DIR/checkpoints, if any."""
    folder = root / CHECKPOINTS
    if not folder.is_dir():
        return None
    complete = sorted(p for p in folder.glob("step-*") if (p / META).is_file())
    return complete[-1] if complete else None


def read_meta(path: Path, flag: str = "--resume") -> Meta:
    """Validate a checkpoint folder before any collective or unpickling touches it."""
    if not path.exists():
        raise UserError(f"{flag} {path} does not exist; pass a checkpoint folder or --resume alone for the latest")
    if path.is_dir() and (path / CHECKPOINTS).is_dir():  # an output dir: take its latest
        found = latest(path)
        if found is None:
            raise UserError(f"{flag} {path}: no complete checkpoint under {path / CHECKPOINTS}")
        path = found
    meta_file = path / META
    if not meta_file.is_file():
        raise UserError(f"{flag} {path} is incomplete (no {META}: the save did not finish); resume an earlier one")
    try:
        raw = json.loads(meta_file.read_text())
        if raw.get("format") != FORMAT_VERSION:
            raise ValueError(f"format {raw.get('format')}")
        meta = Meta(path=path, **{k: raw[k] for k in Meta.__dataclass_fields__ if k != "path"})
    except (ValueError, KeyError, TypeError) as exc:
        raise UserError(f"{flag} {path}: {META} is corrupt ({exc}); resume an earlier checkpoint") from None
    metadata = path / ".metadata"
    if not metadata.is_file() or _sha256(metadata) != meta.metadata_sha256:
        raise UserError(
            f"{flag} {path} is corrupt: its DCP .metadata is missing or does not match {META}; "
            "resume an earlier checkpoint"
        )
    for name, size in meta.shard_bytes.items():
        shard = path / name
        if not shard.is_file() or shard.stat().st_size != size:
            raise UserError(
                f"{flag} {path} is corrupt: shard {name} is missing or truncated; resume an earlier checkpoint"
            )
    return meta


def resolve_resume(resume: str | None, output_dir: Path) -> Meta | None:
    """The checkpoint to continue from: None for a fresh start (no --resume, or --resume auto
    on an output dir that holds no complete checkpoint yet)."""
    if resume is None:
        return None
    if resume in (RESUME_LATEST, RESUME_AUTO):
        found = latest(output_dir)
        if found is None and resume == RESUME_AUTO:
            return None
        if found is None:
            raise UserError(
                f"--resume: no complete checkpoint in {output_dir / CHECKPOINTS}; pass --resume PATH or start fresh"
            )
        return read_meta(found)
    return read_meta(Path(resume).expanduser())


def save(
    root: Path,
    step: int,
    samples: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler,
    layout: dict,
    model_fingerprint: str,
    model_config,
    tokenizer,
    keep: int,
    is_main: bool,
) -> tuple[Path, float]:
    """Collective: every rank writes its shards; rank 0 seals the checkpoint. Returns (path, seconds)."""
    started = time.perf_counter()
    final = step_dir(root, step)
    tmp = final.parent / f".tmp-{final.name}"
    if is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(tmp))
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state()
    save_file(rng, str(tmp / f"rng-rank{dist.get_rank()}.safetensors"))
    dist.barrier()
    if is_main:
        model_config.save_pretrained(tmp)  # so the checkpoint exports on its own
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        meta = {
            "format": FORMAT_VERSION,
            "step": step,
            "samples": samples,
            **layout,
            "fingerprint": model_fingerprint,
            "scheduler": scheduler.state_dict(),
            "metadata_sha256": _sha256(tmp / ".metadata"),
            "shard_bytes": {p.name: p.stat().st_size for p in sorted(tmp.glob("*.distcp"))},
        }
        with open(tmp / META, "w") as f:
            json.dump(meta, f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        if final.exists():  # a re-save of the same step (resumed run): replace it whole
            shutil.rmtree(final)
        tmp.rename(final)
        prune(root, keep)
    dist.barrier()
    return final, time.perf_counter() - started


def prune(root: Path, keep: int) -> None:
    folder = root / CHECKPOINTS
    complete = sorted(p for p in folder.glob("step-*") if (p / META).is_file())
    for old in complete[: max(len(complete) - keep, 0)]:
        shutil.rmtree(old, ignore_errors=True)


def load(meta: Meta, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler) -> float:
    """Collective: restore model, optimizer, scheduler and this rank's RNG. Returns seconds."""
    started = time.perf_counter()
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    try:
        dcp.load(state, checkpoint_id=str(meta.path))
    except (Exception, CheckpointException) as exc:  # CheckpointException is a BaseException
        raise UserError(
            f"--resume {meta.path} could not be read ({first_line(exc)}); resume an earlier checkpoint"
        ) from None
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    scheduler.load_state_dict(meta.scheduler)
    rng_file = meta.path / f"rng-rank{dist.get_rank()}.safetensors"
    if rng_file.is_file():  # a rank that did not exist in the saved layout keeps its seeded state
        rng = load_file(str(rng_file))
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    return time.perf_counter() - started


def export(checkpoint: Path, out_dir: Path, trust_remote_code: bool = False, export_dtype: str = "auto") -> Path:
    """Consolidate a sharded checkpoint into Hugging Face format, in one process, no GPU, in
    `export_dtype` (auto: the dtype the model's config declares)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    meta = read_meta(checkpoint, flag="checkpoint")
    if out_dir.exists() and any(out_dir.iterdir()):
        raise UserError(f"export target {out_dir} is not empty; pass an empty or new folder")
    config = AutoConfig.from_pretrained(meta.path, trust_remote_code=trust_remote_code)
    dtype = modeling.export_dtype(export_dtype, config)  # before from_config records fp32 in it
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, trust_remote_code=trust_remote_code)
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=str(meta.path), no_dist=True)
    model.load_state_dict(state["model"])
    model.to(dtype)
    tmp = out_dir.parent / f".tmp-{out_dir.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    modeling.stamp_dtype(tmp, dtype)
    with contextlib.suppress(OSError, ValueError, TypeError):  # a model trained without a tokenizer
        AutoTokenizer.from_pretrained(meta.path).save_pretrained(tmp)
    modeling.follow_umask(tmp)
    if out_dir.exists():
        out_dir.rmdir()
    tmp.rename(out_dir)
    return out_dir
