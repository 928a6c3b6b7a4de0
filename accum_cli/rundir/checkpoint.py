"""Sharded checkpoints with torch.distributed.checkpoint (DCP): save and load (meta.json: checkpoint_meta.py;
export: export.py).

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
import json
import os
import shutil
import time
import warnings
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

from accum_cli.errors import UserError, first_line
from accum_cli.model import lora
from accum_cli.model.lora import state_options
from accum_cli.parallel.runtime import all_ok
from accum_cli.rundir import outdir, safe_dcp
from accum_cli.rundir.checkpoint_meta import (
    CHECKPOINTS,
    FORMAT_VERSION,
    META,
    Meta,
    complete_checkpoints,
    latest,
    step_dir,
    step_of,
)

DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


EXIT_SAVE_FAILED = 74  # EX_IOERR: a checkpoint or the final model could not be written


class SaveFailed(Exception):
    """A checkpoint or the final model could not be written (disk full, permissions); the
    previous checkpoint is intact and nothing half-written is left."""


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


def chmod_as_umask(path: Path) -> None:
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
    model_state, optim_state = get_state_dict(model, optimizer, options=state_options(model))
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
        with outdir.safetensors_writes():
            save_file(rng, str(rng_file))
        chmod_as_umask(rng_file)

    def checksum_my_share() -> None:
        # Each rank checksums a share of the shards, so sealing costs no more than writing.
        shards = sorted(p.name for p in tmp.glob("*.distcp"))
        mine = [*shards[rank::world], rng_file.name]
        (tmp / f".digests-rank{rank}.json").write_text(json.dumps(safe_dcp.record_files(tmp, mine)))

    def seal() -> None:
        lora.save_config(model, tmp)  # LoRA: the adapters' settings, listed and checksummed as every file
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


def dcp_load(state: dict, meta: Meta, flag: str, no_dist: bool = False) -> None:
    try:
        metadata = safe_dcp.read_metadata(meta.path, meta.files)
        if "optim" in state:
            _only_saved_optimizer_state(state["optim"], metadata)
        reader = safe_dcp.VerifiedReader(meta.path, meta.files, metadata)
        with warnings.catch_warnings():  # an export loads in one process on purpose: DCP need not say so
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, storage_reader=reader, planner=safe_dcp.WeightsOnlyPlanner(), no_dist=no_dist)
    except (Exception, CheckpointException) as exc:  # CheckpointException is a BaseException
        stopped = _stop_inside(exc)
        if stopped is not None:  # a SIGTERM's or Ctrl-C's stop reached DCP mid-load: not the checkpoint's fault
            raise stopped from None
        raise _refusal(exc, meta.path, flag) from None


def _stop_inside(exc: BaseException) -> BaseException | None:
    """A stop (a BaseException that is no error: the run's SIGTERM handler's, KeyboardInterrupt) that
    DCP wrapped as a failure of the load; the caller reports it as the stop it is."""
    for wrapped, _trace in (getattr(exc, "failures", None) or {}).values():
        if isinstance(wrapped, BaseException) and not isinstance(wrapped, Exception):
            return wrapped
    return None


def optimizer_steps(optimizer: torch.optim.Optimizer) -> float:
    """The most steps the optimizer state of any parameter counts (AdamW keeps a `step` per parameter); 0 for none."""
    taken = 0.0
    for state in optimizer.state.values():
        step = state.get("step")
        if isinstance(step, torch.Tensor):
            step = (step.full_tensor() if hasattr(step, "full_tensor") else step).item()
        if isinstance(step, (int, float)):
            taken = max(taken, float(step))
    return taken


def check_optimizer_steps(meta: Meta, optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """Collective, right after the load and before any step or write: the optimizer state has taken no more steps
    than meta.json records. meta.json's step, and the samples it implies, decide where the data and the learning
    rate continue, and the optimizer state is the record of them that meta.json cannot edit (its bytes are checked
    against their digests). It may have taken fewer: a step skipped for a non-finite loss updates nothing. Read
    after the load, as reading it before would mean reading DCP's files outside DCP."""
    taken = torch.tensor([optimizer_steps(optimizer)], dtype=torch.float64, device=device)
    dist.all_reduce(taken, op=dist.ReduceOp.MAX)  # one verdict on every rank
    if taken.item() > meta.step:
        raise UserError(
            f"--resume {meta.path}: {META} is corrupt (it records step {meta.step}, but the optimizer state saved "
            f"with it has taken {taken.item():.0f} steps); resume an earlier checkpoint"
        )


def load(meta: Meta, model: nn.Module, optimizer: torch.optim.Optimizer) -> float:
    """Collective: restore model, optimizer and this rank's RNG. Returns seconds."""
    started = time.perf_counter()
    options = state_options(model)
    model_state, optim_state = get_state_dict(model, optimizer, options=options)
    state = {"model": model_state, "optim": optim_state}
    dcp_load(state, meta, "--resume")
    set_model_state_dict(model, state["model"], options=options)
    # Not strict: a parameter without saved optimizer state (above) keeps none.
    set_optimizer_state_dict(model, optimizer, state["optim"], options=StateDictOptions(strict=False))
    check_optimizer_steps(meta, optimizer, next(model.parameters()).device)
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
