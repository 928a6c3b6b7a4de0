"""A checkpoint's `meta.json`: what it records, validated before anything is believed, and which
checkpoint a `--resume` (a path, `latest` or `auto`) names."""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

from accum_cli.config.settings import RESUME_AUTO, RESUME_LATEST
from accum_cli.errors import UserError, first_line
from accum_cli.rundir import safe_dcp

CHECKPOINTS = "checkpoints"
META = "meta.json"
FORMAT_VERSION = 2
MAX_META_BYTES = 1 << 20
_STEP_DIR = re.compile(r"^step-(\d+)$")
_NAMED_STEP = re.compile(r"^(?:rewound-)?step-(\d+)(?:\.\d+)?$")  # as saved, or as a rewind set it aside
_HEX = re.compile(r"^[0-9a-f]+$")


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
    batch_schedule: str = ""  # --batch-schedule as config/batch_schedule.py writes it ("": none)


def position(meta: Meta | None) -> tuple[int, int]:
    """(steps done, samples consumed) where a run resumed from `meta` (None: a fresh run) takes its first step."""
    return (0, 0) if meta is None else (meta.step, meta.samples)


def step_dir(root: Path, step: int) -> Path:
    return root / CHECKPOINTS / f"step-{step:06d}"


def step_of(folder: Path) -> int | None:
    match = _STEP_DIR.match(folder.name)
    return int(match.group(1)) if match else None


def named_step(folder: Path) -> int | None:
    """The step a checkpoint folder is named for: `step-N`, or `rewound-step-N[.k]` once a rewind set it aside."""
    match = _NAMED_STEP.match(folder.name)
    return int(match.group(1)) if match else None


def furthest_step(root: Path) -> int:
    """The greatest step a checkpoint folder under OUTPUT_DIR/checkpoints is named for (those a rewind set aside
    included); 0 when there is none."""
    try:
        return max((named_step(p) or 0 for p in (root / CHECKPOINTS).iterdir()), default=0)
    except OSError:  # no checkpoints folder, or an unreadable one
        return 0


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
    # A run's first global batch applies from step 0, where no sample was consumed yet; a later one from the
    # resume that changed it, after at least one sample a step.
    origin_step, origin_samples = fields["origin_step"], fields["origin_samples"]
    if origin_samples < origin_step or (origin_step == 0 and origin_samples != 0):
        raise ValueError(f"origin_samples {origin_samples} cannot be the data position at origin_step {origin_step}")
    implied = origin_samples + (fields["step"] - origin_step) * fields["global_batch"]
    if fields["samples"] != implied:
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
    if "batch_schedule" in raw:  # absent from a run without one (and from checkpoints written before it)
        fields["batch_schedule"] = text("batch_schedule", re.compile(r"^[0-9s:,]+$"), 4096)
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
    # A checkpoint is saved under its step's name: a step (and the samples it implies) edited in meta.json would
    # resume another training than the one saved, at another data position and learning rate.
    named = named_step(path)
    if named is not None and named != meta.step:
        raise UserError(
            f"{flag} {path}: {META} is corrupt (it records step {meta.step}, but the folder is named for step {named}); "
            "resume an earlier checkpoint"
        )
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
