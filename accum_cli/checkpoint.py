"""Sharded checkpoints with torch.distributed.checkpoint (DCP): save, resume, export.

Layout of `OUTPUT_DIR/checkpoints/step-XXXXXX/`:
- `.accum-train`: the marker, written first, so a later run knows the folder is ours;
- DCP shards and `.metadata`: the model and optimizer state, each rank writing its shards;
  DCP reshards on load, so a run can resume with another world size or micro batch;
- `rng-rankN.safetensors`: each rank's RNG state (tensors only, no pickle);
- `config.json` and tokenizer files: the model's, so the checkpoint exports on its own;
- `meta.json`, written last: step, data position (global samples consumed), the layout, the
  model's and the data's fingerprints, and the size and SHA-256 of every other file. The
  learning-rate schedule is not stored: it is a function of the step.

A checkpoint is written under a hidden temporary name and renamed when complete, so a crash
mid-save leaves the previous checkpoint intact and no half-written one visible. Loading
verifies meta.json's every field and every byte it reads, and never runs code from the
checkpoint (safe_dcp.py).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from accum_cli import model as modeling
from accum_cli import outdir, safe_dcp
from accum_cli.config import RESUME_AUTO, RESUME_LATEST
from accum_cli.errors import UserError, first_line
from accum_cli.runtime import all_ok

CHECKPOINTS = "checkpoints"
META = "meta.json"
FORMAT_VERSION = 2
MAX_META_BYTES = 1 << 20
_STEP_DIR = re.compile(r"^step-(\d+)$")
_HEX = re.compile(r"^[0-9a-f]+$")
DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


EXIT_SAVE_FAILED = 74  # EX_IOERR: a checkpoint or the final model could not be written


class SaveFailed(Exception):
    """A checkpoint or the final model could not be written (disk full, permissions); the
    previous checkpoint is intact and nothing half-written is left."""


@dataclass(frozen=True, slots=True)
class Meta:
    path: Path
    step: int  # optimizer steps completed
    samples: int  # global samples consumed: the data position
    origin_step: int  # the step from which the current global batch applies (0, or an elastic resume's)
    origin_samples: int  # the data position at origin_step
    global_batch: int
    micro_batch: int
    world_size: int
    seed: int
    fingerprint: str  # the model's parameter names and shapes
    data: str  # the prepared data's identity
    files: dict  # file name -> {"bytes", "sha256"}, every file but meta.json


def step_dir(root: Path, step: int) -> Path:
    return root / CHECKPOINTS / f"step-{step:06d}"


def step_of(folder: Path) -> int | None:
    match = _STEP_DIR.match(folder.name)
    return int(match.group(1)) if match else None


def fingerprint(shapes: dict[str, tuple[int, ...]]) -> str:
    """Identifies a model by its parameter names and shapes."""
    text = json.dumps(sorted((name, list(shape)) for name, shape in shapes.items()))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def complete_checkpoints(root: Path) -> list[Path]:
    """Our complete checkpoints under OUTPUT_DIR/checkpoints, oldest first, by step number."""
    folder = root / CHECKPOINTS
    if not folder.is_dir():
        return []
    found = [p for p in folder.iterdir() if step_of(p) is not None and (p / META).is_file()]
    return sorted(found, key=step_of)


def latest(root: Path) -> Path | None:
    """The newest complete checkpoint under OUTPUT_DIR/checkpoints, if any."""
    complete = complete_checkpoints(root)
    return complete[-1] if complete else None


def _validated(raw: object) -> dict:
    """meta.json's fields, each checked for type, range and consistency; ValueError names the first wrong one."""
    if not isinstance(raw, dict):
        raise ValueError("not a JSON object")
    if raw.get("format") != FORMAT_VERSION:
        raise ValueError(f"format {str(raw.get('format'))[:20]}, this accum-train reads format {FORMAT_VERSION}")

    def integer(name: str, low: int, high: int = 2**63) -> int:
        value = raw.get(name)
        if type(value) is not int or not low <= value < high:
            raise ValueError(f"{name} must be an integer >= {low}, got {str(value)[:40]!r}")
        return value

    def text(name: str, pattern: re.Pattern, max_len: int) -> str:
        value = raw.get(name)
        if not isinstance(value, str) or not 0 < len(value) <= max_len or not pattern.match(value):
            raise ValueError(f"{name} is malformed")
        return value

    fields = {
        "step": integer("step", 1),
        "samples": integer("samples", 1),
        "origin_step": integer("origin_step", 0),
        "origin_samples": integer("origin_samples", 0),
        "global_batch": integer("global_batch", 1),
        "micro_batch": integer("micro_batch", 1),
        "world_size": integer("world_size", 1),
        "seed": integer("seed", 0, 2**64),
        "fingerprint": text("fingerprint", _HEX, 64),
        "data": text("data", re.compile(r"^[\w.:-]+$"), 200),
    }
    if fields["origin_step"] >= fields["step"]:
        raise ValueError(f"origin_step {fields['origin_step']} is not before step {fields['step']}")
    implied = fields["origin_samples"] + (fields["step"] - fields["origin_step"]) * fields["global_batch"]
    if fields["samples"] != implied or fields["origin_samples"] < fields["origin_step"]:
        raise ValueError(f"samples {fields['samples']} is not what the steps imply ({implied})")
    files = raw.get("files")
    if not isinstance(files, dict) or ".metadata" not in files or len(files) > 100_000:
        raise ValueError("files must list every file of the checkpoint, .metadata included")
    for name, entry in files.items():
        ok = (
            safe_dcp.valid_file_name(name)
            and name != META
            and isinstance(entry, dict)
            and type(entry.get("bytes")) is int
            and entry["bytes"] >= 0
            and isinstance(entry.get("sha256"), str)
            and len(entry["sha256"]) == 64
            and _HEX.match(entry["sha256"])
        )
        if not ok:
            raise ValueError(f"files entry {str(name)[:60]!r} is malformed")
    fields["files"] = files
    return fields


def read_meta(path: Path, flag: str = "--resume") -> Meta:
    """Validate a checkpoint before any collective touches it: meta.json's every field, every
    file present at its recorded size, and DCP's .metadata verified and safely unpickled."""
    try:
        return _read_meta(path, flag)
    except OSError as exc:  # a folder this user may not list, say a colleague's
        raise _unreadable(path, flag, exc) from None


def _unreadable(path: Path, flag: str, exc: OSError) -> UserError:
    return UserError(f"{flag} {path} cannot be read ({exc.strerror or exc}: {exc.filename}); check its permissions")


def _read_meta(path: Path, flag: str) -> Meta:
    if not path.exists():
        raise UserError(f"{flag} {path} does not exist; pass a checkpoint folder or --resume alone for the latest")
    if not path.is_dir():
        raise UserError(
            f"{flag} {path} is a file; pass a checkpoint folder (OUTPUT_DIR/checkpoints/step-N) or an output dir"
        )
    if (path / CHECKPOINTS).is_dir():  # an output dir: take its latest
        found = latest(path)
        if found is None:
            raise UserError(f"{flag} {path}: no complete checkpoint under {path / CHECKPOINTS}")
        path = found
    meta_file = path / META
    if not meta_file.is_file() and (path / "config.json").is_file() and not (path / ".metadata").exists():
        raise UserError(
            f"{flag} {path} is a model (a final/ or an export), not a checkpoint; pass OUTPUT_DIR/checkpoints/step-N"
        )
    if not meta_file.is_file():
        raise UserError(f"{flag} {path} is incomplete (no {META}: the save did not finish); resume an earlier one")
    try:
        with open(meta_file, "rb") as f:
            raw = f.read(MAX_META_BYTES + 1)
        if len(raw) > MAX_META_BYTES:
            raise ValueError("larger than any meta.json accum-train writes")
        meta = Meta(path=path, **_validated(json.loads(raw)))
    except OSError as exc:
        raise UserError(f"{flag} {path}: {META} cannot be read ({exc.strerror}); check its permissions") from None
    except (ValueError, RecursionError) as exc:
        raise UserError(
            f"{flag} {path}: {META} is corrupt ({first_line(exc)[:200]}); resume an earlier checkpoint"
        ) from None
    for name, entry in meta.files.items():
        file = path / name
        if not file.is_file():
            raise UserError(f"{flag} {path} is corrupt: file {name} is missing; resume an earlier checkpoint")
        if file.stat().st_size != entry["bytes"]:
            raise UserError(
                f"{flag} {path} is corrupt: file {name} is {file.stat().st_size} bytes but {entry['bytes']} were "
                "written (a torn copy, or altered); resume an earlier checkpoint"
            )
    try:
        safe_dcp.read_metadata(path, meta.files)
    except safe_dcp.UnsafeCheckpoint as exc:
        raise safe_dcp.as_user_error(exc, path, flag) from None
    return meta


def resolve_resume(resume: str | None, output_dir: Path) -> Meta | None:
    """The checkpoint to continue from: None for a fresh start (no --resume, or --resume auto
    on an output dir that holds no complete checkpoint yet)."""
    if resume is None:
        return None
    if resume in (RESUME_LATEST, RESUME_AUTO):
        try:
            found = latest(output_dir)
        except OSError as exc:
            raise _unreadable(output_dir / CHECKPOINTS, "--resume", exc) from None
        if found is None and resume == RESUME_AUTO:
            final = output_dir / "final"
            try:
                finished = final.is_dir() and any(final.iterdir())
            except OSError:  # unreadable: not ours to discard either
                finished = True
            if finished:  # starting fresh would discard it (and its metrics)
                raise UserError(
                    f"--resume auto: {output_dir} holds a finished run (final/) but no checkpoint to continue "
                    "from; drop --resume auto and pass --overwrite to train it again, or pick another --output-dir"
                )
            return None
        if found is None:
            raise UserError(
                f"--resume: no complete checkpoint in {output_dir / CHECKPOINTS}; pass --resume PATH or start fresh"
            )
        return read_meta(found)
    return read_meta(Path(resume).expanduser())


def _state_bytes(state: dict, device: torch.device) -> int:
    """Bytes of the whole training state, summed over ranks: what a checkpoint needs on disk."""
    local = 0
    for value in _leaves(state):
        if isinstance(value, torch.Tensor):
            tensor = value.to_local() if hasattr(value, "to_local") else value
            local += tensor.numel() * tensor.element_size()
    total = torch.tensor([local], dtype=torch.int64, device=device)
    dist.all_reduce(total)
    return int(total.item())


def _leaves(tree):
    if isinstance(tree, dict):
        for value in tree.values():
            yield from _leaves(value)
    elif isinstance(tree, (list, tuple)):
        for value in tree:
            yield from _leaves(value)
    else:
        yield tree


def _chmod_as_umask(path: Path) -> None:
    """safetensors writes 0600; everything else here follows the umask, and so must it."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def save(
    root: Path,
    step: int,
    samples: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    record: dict,
    model_config,
    tokenizer,
    keep: int,
    is_main: bool,
    device: torch.device,
) -> tuple[Path, float]:
    """Collective: every rank writes and checksums its shards; rank 0 seals the checkpoint.

    `record` holds the layout, origin and fingerprints stored in meta.json. Returns (path,
    seconds). Raises SaveFailed on every rank when any rank could not write."""
    started = time.perf_counter()
    final = step_dir(root, step)
    tmp = final.parent / f".tmp-{final.name}"
    rank, world = dist.get_rank(), dist.get_world_size()
    untrained = not optimizer.state  # every step so far was skipped (--on-nonfinite skip)
    model_state, optim_state = get_state_dict(model, optimizer)
    if untrained:
        # get_state_dict makes state up for an optimizer that has none by running one AdamW step
        # at lr 0: the live optimizer would count that step, and the next real update would be
        # smaller by its bias correction. Undo it and save none, as the run has none.
        optimizer.state.clear()
        optim_state["state"] = {}
    state = {"model": model_state, "optim": optim_state}
    rng_file = tmp / f"rng-rank{rank}.safetensors"

    def open_folder() -> None:
        if tmp.is_dir() and not tmp.is_symlink() and not outdir.is_marked(tmp):
            with contextlib.suppress(OSError):  # empty: a save that failed before its marker
                tmp.rmdir()
        if outdir.someone_elses(tmp):
            raise FileExistsError(errno.EEXIST, f"{tmp} exists and is not accum-train's; move it away")
        if tmp.exists():  # an interrupted save of ours
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        outdir.mark(tmp, "checkpoint")

    def write_shards() -> None:
        dcp.save(state, checkpoint_id=str(tmp))
        rng = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state()
        with modeling.safetensors_writes():
            save_file(rng, str(rng_file))
        _chmod_as_umask(rng_file)

    def checksum_my_share() -> None:
        # Each rank checksums a share of the shards, so sealing costs no more than writing.
        shards = sorted(p.name for p in tmp.glob("*.distcp"))
        mine = [*shards[rank::world], rng_file.name]
        (tmp / f".digests-rank{rank}.json").write_text(json.dumps(safe_dcp.record_files(tmp, mine)))

    def seal() -> None:
        _seal(tmp, final, step, samples, record, model_config, tokenizer, world)
        prune(root, keep)

    # Each phase ends with every rank agreeing that it succeeded everywhere: a rank that
    # cannot write must not leave the others waiting in a collective it will never join.
    error: BaseException | None = None
    for phase, on_every_rank in ((open_folder, False), (write_shards, True), (checksum_my_share, True), (seal, False)):
        if on_every_rank or is_main:
            try:
                phase()
            except (OSError, CheckpointException) as exc:  # CheckpointException is a BaseException
                error = exc
        if not all_ok(error is None, device):
            need = _state_bytes(state, device)
            if is_main and not outdir.someone_elses(tmp):  # only a folder this save made
                shutil.rmtree(tmp, ignore_errors=True)
            elif is_main:
                with contextlib.suppress(OSError):  # made, but failed before its marker: empty
                    tmp.rmdir()
            raise SaveFailed(_save_failure(final, error, need, root))
    return final, time.perf_counter() - started


def _seal(tmp: Path, final: Path, step: int, samples: int, record: dict, model_config, tokenizer, world: int) -> None:
    """Rank 0: the model's config and tokenizer, then meta.json (fsynced), then the rename."""
    model_config.save_pretrained(tmp)  # so the checkpoint exports on its own
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    files: dict[str, dict] = {}
    for r in range(world):
        digests = tmp / f".digests-rank{r}.json"
        files.update(json.loads(digests.read_text()))
        digests.unlink()
    others = [p.name for p in tmp.iterdir() if p.is_file() and p.name not in files and p.name != outdir.MARKER]
    files.update(safe_dcp.record_files(tmp, others))
    meta = {"format": FORMAT_VERSION, "step": step, "samples": samples, **record, "files": files}
    with open(tmp / META, "w") as f:
        json.dump(meta, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    swap_in(tmp, final)


REPLACED = ".replaced-"  # a checkpoint being replaced by a re-save of its step, for an instant


def swap_in(tmp: Path, final: Path) -> None:
    """Rename the sealed checkpoint into place. A re-save of the same step (a resumed run) sets
    the old one aside by a rename first and removes it after: a kill between the two renames
    leaves it whole, under a name that `tidy` restores."""
    if not (final.exists() and outdir.is_marked(final)):
        tmp.rename(final)
        return
    aside = final.with_name(REPLACED + final.name)
    if aside.exists() and outdir.is_marked(aside):
        shutil.rmtree(aside)
    final.rename(aside)
    tmp.rename(final)
    shutil.rmtree(aside, ignore_errors=True)


def _save_failure(final: Path, error: BaseException | None, need: int, root: Path) -> str:
    code = getattr(error, "errno", None)
    if isinstance(error, CheckpointException):  # DCP wraps each rank's exception
        for pair in error.failures.values():
            inner = pair[0] if isinstance(pair, tuple) else pair
            code = getattr(inner, "errno", None) or code
    previous = latest(root)
    kept = f"the previous checkpoint {previous.name} is intact" if previous else "no earlier checkpoint exists"
    why = full_disk(code, need, final.parent if final.parent.exists() else root)
    if why is not None:
        fix = "free space or pass another --output-dir, then --resume"
    else:
        why = f"{first_line(error) if error else 'another rank failed'}"[:300]
        fix = "check the folder's permissions and space, then --resume"
    return f"checkpoint {final} could not be written: {why}; {kept}; {fix}"


def full_disk(code: int | None, need: int, folder: Path) -> str | None:
    """What to say when a write failed with `code` because the disk is full; None for other failures.
    A failure without an errno counts when the folder has less room than the state needs:
    torch.save's zip writer, inside DCP, reports a short write as a RuntimeError ("unexpected pos")."""
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        free = None
    if code not in DISK_FULL and (code is not None or free is None or free >= need):
        return None
    return f"the disk is full (about {_mb(need)} needed, {_mb(free or 0)} free)"


def _mb(n_bytes: int) -> str:
    return f"{n_bytes / 1e6:,.1f} MB"


def set_aside_later(root: Path, step: int) -> list[str]:
    """A run resumed from step N in a folder holding later checkpoints (a rewind, after a loss
    spike say) makes them another future: renamed `rewound-step-M` (kept, never deleted), so that
    neither pruning nor --resume auto takes them for this run's. Returns the new names."""
    moved = []
    for path in complete_checkpoints(root):
        if step_of(path) > step and outdir.is_marked(path):
            target = path.with_name(f"rewound-{path.name}")
            suffix = 1
            while target.exists():  # rewound twice past the same step
                target, suffix = path.with_name(f"rewound-{path.name}.{suffix}"), suffix + 1
            path.rename(target)
            moved.append(target.name)
    return moved


def prune(root: Path, keep: int) -> None:
    """Keep the newest `keep` complete checkpoints; remove our older ones."""
    complete = complete_checkpoints(root)
    for old in complete[: max(len(complete) - keep, 0)]:
        if outdir.is_marked(old):
            shutil.rmtree(old, ignore_errors=True)


def tidy(root: Path) -> list[str]:
    """At a run's start: remove what an interrupted save of ours left (temporary folders of
    checkpoints and of the final model, checkpoints without meta.json). Returns what was removed."""
    folder = root / CHECKPOINTS
    entries = [*folder.iterdir()] if folder.is_dir() else []
    removed = []
    final_tmp = ".final-"  # modeling.save_final writes final/ in a temporary folder beside it
    entries = [_restored(entry) for entry in entries]
    for entry in [*entries, *root.glob(f"{final_tmp}*")]:
        leftover = entry.name.startswith((".tmp-step-", REPLACED, final_tmp)) or (
            step_of(entry) is not None and not (entry / META).exists()
        )
        if entry.is_dir() and leftover and outdir.is_marked(entry):
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry.name)
    return sorted(removed)


def _restored(entry: Path) -> Path:
    """A checkpoint that a re-save of its step set aside, killed before the new one took its name,
    goes back under its own name."""
    original = entry.with_name(entry.name.removeprefix(REPLACED))
    if entry.name.startswith(REPLACED) and outdir.is_marked(entry) and not original.exists():
        entry.rename(original)
        return original
    return entry


def _refusal(exc: BaseException, path: Path, flag: str) -> UserError:
    problem = safe_dcp.problem_in(exc)
    if problem is not None:
        return UserError(f"{flag} {path} is refused: {problem}; use a checkpoint you trust or an earlier one")
    return UserError(f"{flag} {path} could not be read ({first_line(exc)[:200]}); resume an earlier checkpoint")


def _only_saved_optimizer_state(optim_state: dict, metadata) -> None:
    """Drop the optimizer state the checkpoint does not hold. AdamW creates a parameter's state at
    its first gradient, so a parameter that had none before the save (a layer the training never
    uses, an expert no token reached) has none saved, and must have none after the resume, as in
    the run that saved it; `get_state_dict` makes one up for every parameter, and DCP would refuse
    to load a checkpoint that lacks it."""
    prefix = "optim.state."
    saved = {key[len(prefix) :].rsplit(".", 1)[0] for key in metadata.state_dict_metadata if key.startswith(prefix)}
    for name in [name for name in optim_state["state"] if name not in saved]:
        del optim_state["state"][name]


def _dcp_load(state: dict, meta: Meta, flag: str, no_dist: bool = False) -> None:
    try:
        metadata = safe_dcp.read_metadata(meta.path, meta.files)
        if "optim" in state:
            _only_saved_optimizer_state(state["optim"], metadata)
        reader = safe_dcp.VerifiedReader(meta.path, meta.files, metadata)
        with warnings.catch_warnings():  # an export loads in one process on purpose: DCP need not say so
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, storage_reader=reader, planner=safe_dcp.WeightsOnlyPlanner(), no_dist=no_dist)
    except (Exception, CheckpointException) as exc:  # CheckpointException is a BaseException
        raise _refusal(exc, meta.path, flag) from None


def load(meta: Meta, model: nn.Module, optimizer: torch.optim.Optimizer) -> float:
    """Collective: restore model, optimizer and this rank's RNG. Returns seconds."""
    started = time.perf_counter()
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    _dcp_load(state, meta, "--resume")
    set_model_state_dict(model, state["model"])
    # Not strict: a parameter without saved optimizer state (above) keeps none.
    set_optimizer_state_dict(model, optimizer, state["optim"], options=StateDictOptions(strict=False))
    rng_name = f"rng-rank{dist.get_rank()}.safetensors"
    if rng_name in meta.files:  # a rank that did not exist in the saved layout keeps its seeded state
        try:
            rng = load_file(str(safe_dcp.verify_file(meta.path, rng_name, meta.files)))
        except safe_dcp.UnsafeCheckpoint as exc:
            raise safe_dcp.as_user_error(exc, meta.path, "--resume") from None
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    return time.perf_counter() - started


def export(checkpoint: Path, out_dir: Path, trust_remote_code: bool = False, export_dtype: str = "auto") -> Path:
    """Consolidate a sharded checkpoint into Hugging Face format, in one process, no GPU, in
    `export_dtype` (auto: the dtype the model's config declares)."""
    meta = read_meta(checkpoint, flag="checkpoint")
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise UserError(f"export target {out_dir} is not empty; pass an empty or new folder")
    # transformers reads a folder's config and tokenizer files by name, listed or not (a planted
    # chat_template.jinja would be exported): it reads a private copy of the listed, verified ones.
    with tempfile.TemporaryDirectory(prefix="accum-export-") as listed:
        _export(meta, Path(listed), out_dir, trust_remote_code, export_dtype)
    return out_dir


def _export(meta, listed: Path, out_dir: Path, trust_remote_code: bool, export_dtype: str) -> None:
    """export's work, the config and tokenizer read from `listed`: copies of the files meta.json lists."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    try:  # config and tokenizer files are read by transformers: verified, then verified as copied
        for name in meta.files:
            if not name.endswith(".distcp") and name != ".metadata":
                safe_dcp.verify_file(meta.path, name, meta.files)
                shutil.copyfile(meta.path / name, listed / name)
                safe_dcp.verify_file(listed, name, meta.files)
    except safe_dcp.UnsafeCheckpoint as exc:
        raise safe_dcp.as_user_error(exc, meta.path, "checkpoint") from None
    except OSError as exc:  # the temporary folder's disk
        raise UserError(f"export: cannot copy the checkpoint's files to read them ({exc.strerror or exc})") from None
    try:  # an unknown or non-causal model type, or code the checkpoint's config asks to run
        config = AutoConfig.from_pretrained(listed, trust_remote_code=trust_remote_code)
        dtype = modeling.export_dtype(export_dtype, config)  # before from_config records fp32 in it
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, trust_remote_code=trust_remote_code)
    except (ValueError, KeyError, OSError) as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(
            f"checkpoint {meta.path}: its model cannot be built ({reason}); export it with the accum-train "
            "and --trust-remote-code it was trained with"
        ) from None
    state = {"model": model.state_dict()}
    _dcp_load(state, meta, "checkpoint", no_dist=True)
    model.load_state_dict(state["model"])
    model.to(dtype)
    tmp = out_dir.parent / f".tmp-{out_dir.name}"
    if outdir.someone_elses(tmp):
        raise UserError(f"export: {tmp} exists and is not accum-train's; move it away or pick another target")
    if tmp.exists():  # an earlier export of ours that was interrupted
        shutil.rmtree(tmp)
    created = False
    try:
        tmp.mkdir(parents=True)
        created = True
        outdir.mark(tmp, "export")
        with modeling.safetensors_writes():
            model.save_pretrained(tmp, safe_serialization=True)
        modeling.stamp_dtype(tmp, dtype)
        with contextlib.suppress(OSError, ValueError, TypeError):  # a model trained without a tokenizer
            # Never the code a checkpoint may ship, nor transformers' question whether to run it.
            AutoTokenizer.from_pretrained(listed, trust_remote_code=trust_remote_code).save_pretrained(tmp)
        for written in tmp.glob("*.safetensors"):
            _chmod_as_umask(written)
        (tmp / outdir.MARKER).unlink()  # the exported model is the user's from here on
        if out_dir.exists():
            out_dir.rmdir()
        tmp.rename(out_dir)
    except BaseException as exc:  # Ctrl-C and a full disk alike leave no half-written folder
        if created:
            shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, OSError):
            raise UserError(
                f"export to {out_dir} failed ({exc.strerror or exc}); check its space and permissions"
            ) from None
        raise
