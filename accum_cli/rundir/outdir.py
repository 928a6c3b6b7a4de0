"""The output folder: what in it is accum-train's, and one run in it at a time.

accum-train deletes only what it can prove it wrote (docs/ARCHITECTURE.md, invariant 5). The proof is a
marker file, `.accum-train`, that it writes into every folder it creates: the run folder
itself, each checkpoint (first thing, before any shard), and `final/`. A folder that holds
files but no marker belongs to the user: a run refuses it, with or without --overwrite, and
--overwrite removes only the marked folders and the run's own record files.

One run owns a folder at a time: rank 0 holds an exclusive `flock` on `.accum-train.lock`
for the run's whole life. The kernel drops the lock when the holder dies, so a lock file
whose lock can be taken is stale and is taken over (and said so).
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import json
import os
import re
import shutil
import socket
from dataclasses import dataclass
from pathlib import Path

from accum_cli.errors import UserError

MARKER = ".accum-train"
LOCK = ".accum-train.lock"
RECORD_FILES = ("config.json", "metrics.jsonl", "samples.jsonl")  # written by a run into its folder
OWN_FOLDERS = ("checkpoints", "final")
REPORT = "report.png"  # drawn by report.py
TRACKERS = "trackers"  # the trackers' folder (tracking.py): its ids.json, and what each tracker writes there
TRACKER_IDS = "ids.json"  # in TRACKERS: the trackers' run ids, and how far they were sent
MAX_LOCK_BYTES = 4096


def temporary(path: Path) -> Path:
    """Where a file is written before it is renamed over `path` (replace_text, report.draw)."""
    return path.with_name(f".{path.name}.tmp")


# Every name in a run folder that accum-train writes, appends to, renames over or removes, and whether it is a
# folder there. A link at any of them would take the write to a file or folder elsewhere (`trackers` linked to a
# folder of the user's would get W&B's files and lose its ids.json); a name of the other kind would stop the run
# halfway (no file can be renamed over a folder named ids.json). `checkpoints/` and `trackers/` hold more: see _links.
# Written beside, at temporary(name), first:
_RENAMED_OVER = ("metrics.jsonl", "samples.jsonl", REPORT, f"{TRACKERS}/{TRACKER_IDS}")
OWN_NAMES = {
    **dict.fromkeys((LOCK, MARKER, *RECORD_FILES, REPORT, f"{TRACKERS}/{TRACKER_IDS}"), False),
    **{temporary(Path(name)).as_posix(): False for name in _RENAMED_OVER},
    **dict.fromkeys((*OWN_FOLDERS, TRACKERS), True),
}


def mark(folder: Path, what: str) -> None:
    """Claim a folder we just created, so a later run may delete it."""
    (folder / MARKER).write_text(json.dumps({"tool": "accum-train", "what": what}) + "\n")


def is_marked(folder: Path) -> bool:
    return (folder / MARKER).is_file()


def marked_as(folder: Path) -> str | None:
    """What accum-train wrote `folder` as ("run", "checkpoint", "final model"), or None."""
    try:
        what = json.loads((folder / MARKER).read_text()).get("what")
    except (OSError, ValueError, AttributeError):
        return None
    return what if isinstance(what, str) else None


def someone_elses(path: Path) -> bool:
    """A path where accum-train would stage a folder that is already there and not its own (a
    link counts: what it points at is elsewhere); never removed."""
    return path.is_symlink() or (path.exists() and not is_marked(path))


def resolve(output_dir: str) -> Path:
    """The folder from --output-dir, refused before any work when it cannot be ours."""
    if not output_dir.strip():
        raise UserError("--output-dir is empty; pass a folder for the run, e.g. --output-dir runs/my-run")
    out = Path(output_dir).expanduser()
    if out.exists() and not out.is_dir():
        raise UserError(f"--output-dir {out} is a file; pass a folder")
    existing = out
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise UserError(f"--output-dir {out} cannot be created: {existing} is a file; pick another folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UserError(f"--output-dir {out} cannot be written (no permission on {existing}); pick another folder")
    if existing == out and not os.access(out, os.R_OK):  # its files must be listed before any is written
        raise UserError(f"--output-dir {out} cannot be read (no permission); pick another folder")
    return out


def _foreign_entries(out: Path) -> list[str]:
    """What in `out` accum-train cannot prove it wrote (the lock file aside)."""
    if not out.is_dir():
        return []
    names = sorted(p.name for p in out.iterdir() if p.name != LOCK)
    if not names or MARKER in names:
        return []
    return names


def _links(out: Path) -> list[str]:
    """The names in `out` that accum-train would write through and that are symbolic links: its own names (a lock
    file linked to the user's notes, `trackers` linked to the user's folder); anything in checkpoints/, whose
    folders it renames and removes; and anything at the top of trackers/, each a folder it hands a tracker
    (wandb/, trackio/, TensorBoard's run) or its ids.json. Below those, the links are the trackers' own (W&B's
    `latest-run`, and its `logs/debug-core.log` into W&B's data dir) and are left to them."""
    if not out.is_dir():
        return []
    names = [name for name in OWN_NAMES if (out / name).is_symlink()]
    checkpoints = out / "checkpoints"
    if checkpoints.is_dir() and not checkpoints.is_symlink():
        with contextlib.suppress(OSError):  # unreadable: the resume that reads it says so, in one line
            names += [f"checkpoints/{p.name}" for p in sorted(checkpoints.iterdir()) if p.is_symlink()]
    trackers = out / TRACKERS
    if trackers.is_dir() and not trackers.is_symlink():
        with contextlib.suppress(OSError):  # unreadable: nothing can be written there either
            linked = [f"{TRACKERS}/{p.name}" for p in sorted(trackers.iterdir()) if p.is_symlink()]
            names += [name for name in linked if name not in names]
    return names


def _wrong_kind(out: Path) -> tuple[str, str] | None:
    """The first of accum-train's names in `out` that is not what accum-train keeps there: (name, what it is)."""
    for name, folder in OWN_NAMES.items():
        path = out / name
        if folder and path.exists() and not path.is_dir():
            return name, "not a folder, where accum-train keeps a folder of its own"
        if not folder and path.exists() and not path.is_file():
            what = "a folder" if path.is_dir() else "not a regular file"
            return name, f"{what}, where accum-train keeps a file of its own"
    return None


def check(out: Path, overwrite: bool, resuming: bool) -> None:
    """Refuse a folder of someone else's files, or a previous run we would clobber."""
    links = _links(out)
    if links:
        raise UserError(
            f"--output-dir {out}: {links[0]} is a symbolic link, and accum-train writes and removes only "
            "files and folders of its own there; remove the link or pick another --output-dir"
        )
    wrong = _wrong_kind(out)
    if wrong is not None:
        raise UserError(f"--output-dir {out}: {wrong[0]} is {wrong[1]}; move it away or pick another --output-dir")
    kind = marked_as(out)
    if kind not in (None, "run"):  # training there would write a run's files into a checkpoint or a model
        raise UserError(
            f"--output-dir {out} is a {kind} accum-train wrote, not a run folder; pass the run's own folder "
            "as --output-dir (and a checkpoint to --resume)"
        )
    foreign = _foreign_entries(out)
    if foreign:
        shown = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
        raise UserError(
            f"--output-dir {out} holds files accum-train did not write ({shown}) and is not an accum-train run; "
            "pass an empty or new folder (--overwrite never deletes files that are not accum-train's)"
        )
    if (out / "config.json").exists() and not (overwrite or resuming):
        raise UserError(
            f"--output-dir {out} holds a previous run; pass --resume to continue it, --overwrite, or another --output-dir"
        )
    final = out / "final"
    if not resuming and final.is_dir() and not is_marked(final) and any(final.iterdir()):
        # (a resumed run may find final/ written by accum-export: the run is then complete)
        raise UserError(
            f"--output-dir {out}: its final/ holds files accum-train did not write; move them away or pick "
            "another --output-dir"
        )


def clear_previous_run(out: Path) -> None:
    """--overwrite: remove the previous run's record and the marked folders, nothing else."""
    for name in RECORD_FILES:
        (out / name).unlink(missing_ok=True)
    final = out / "final"
    if final.is_dir() and is_marked(final):
        shutil.rmtree(final)
    checkpoints = out / "checkpoints"
    if checkpoints.is_dir():
        for entry in checkpoints.iterdir():
            if entry.is_dir() and is_marked(entry):
                shutil.rmtree(entry)
        with contextlib.suppress(OSError):  # left in place when it holds anything else
            checkpoints.rmdir()


@dataclass(frozen=True, slots=True)
class Holder:
    host: str
    pid: int
    started: str

    def describe(self) -> str:
        return f"pid {self.pid} on {self.host}, started {self.started}"


def _read_holder(handle) -> Holder | None:
    handle.seek(0)
    try:
        raw = json.loads(handle.read(MAX_LOCK_BYTES) or "null")
        return Holder(str(raw["host"]), int(raw["pid"]), str(raw["started"]))
    except (ValueError, TypeError, KeyError, UnicodeDecodeError):
        return None


class RunLock:
    """Rank 0's exclusive hold on the output folder for the run's whole life."""

    def __init__(self, out: Path):
        self.out = out
        self.path = out / LOCK
        self._handle = None
        self._created_folder = False
        self.took_over: Holder | None = None  # the dead holder of a stale lock we took

    def acquire(self) -> None:
        if not self.out.exists():
            self.out.mkdir(parents=True)
            self._created_folder = True
        while True:
            try:  # never through a link: the holder's record would be written into its target
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o644)
            except OSError as exc:
                raise UserError(
                    f"--output-dir {self.out}: cannot open {self.path} ({exc.strerror}); "
                    "remove it if it is a link, or pick another --output-dir"
                ) from None
            handle = os.fdopen(fd, "a+")
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                holder = _read_holder(handle)
                handle.close()
                if exc.errno not in (errno.EAGAIN, errno.EACCES):
                    raise UserError(f"--output-dir {self.out}: cannot lock {self.path} ({exc.strerror})") from None
                raise _in_use(self.out, holder) from None
            # The holder before us may have unlinked the file between our open and our lock:
            # then we locked an orphan inode and must try again on the file that is there now.
            try:
                same = os.fstat(handle.fileno()).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            handle.close()
        self.took_over = _read_holder(handle)
        handle.seek(0)
        handle.truncate()
        holder = {"host": socket.gethostname(), "pid": os.getpid(), "started": _now()}
        handle.write(json.dumps(holder) + "\n")
        handle.flush()
        self._handle = handle

    def release(self) -> None:
        """Unlock; a folder this run created and left empty (a run refused early) goes too."""
        if self._handle is None:
            return
        with contextlib.suppress(OSError):
            self.path.unlink()
        self._handle.close()  # closing drops the flock
        self._handle = None
        if self._created_folder:
            with contextlib.suppress(OSError):
                self.out.rmdir()  # only succeeds when nothing was written


def probe(out: Path) -> None:
    """Refuse early (before starting workers) when a live run holds the folder."""
    lock = out / LOCK
    if lock.is_symlink() or not lock.is_file():
        return  # a link is refused by check(); the real acquisition never follows one
    try:
        with open(lock) as handle:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        with open(lock) as handle:
            holder = _read_holder(handle)
        raise _in_use(out, holder) from None
    except OSError:
        return  # unreadable lock file: the real acquisition will say why


def _in_use(out: Path, holder: Holder | None) -> UserError:
    who = holder.describe() if holder else "another process"
    return UserError(
        f"--output-dir {out} is in use by another accum-train run ({who}); wait for it to end or pick another --output-dir"
    )


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def replace_text(path: Path, text: str) -> None:
    """Write `text` beside `path` and rename it over: a kill or a full disk mid-write leaves the old
    file whole, and no temporary file stays behind."""
    tmp = temporary(path)
    try:  # never through a link (check() refuses one; this holds should one appear since)
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o666), "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


_OS_ERROR = re.compile(r"\(os error (\d+)\)")


@contextlib.contextmanager
def safetensors_writes():
    """safetensors reports a failed write (a full disk) as its own SafetensorError, not as an
    OSError: give it back as the OSError it wraps, so the callers' one-line reports see it."""
    from safetensors import SafetensorError

    try:
        yield
    except SafetensorError as exc:
        code = _OS_ERROR.search(str(exc))
        if code is None:
            raise
        raise OSError(int(code.group(1)), os.strerror(int(code.group(1)))) from exc
