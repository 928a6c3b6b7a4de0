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
RECORD_FILES = ("config.json", "metrics.jsonl")  # written by a run into its folder
OWN_FOLDERS = ("checkpoints", "final")
MAX_LOCK_BYTES = 4096


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
    """accum-train's own names in `out` that are symbolic links: writing, appending or removing
    through one would reach a file or folder elsewhere (a lock file linked to the user's notes)."""
    if not out.is_dir():
        return []
    names = [name for name in (LOCK, MARKER, *RECORD_FILES, *OWN_FOLDERS) if (out / name).is_symlink()]
    checkpoints = out / "checkpoints"
    if checkpoints.is_dir() and not checkpoints.is_symlink():
        with contextlib.suppress(OSError):  # unreadable: the resume that reads it says so, in one line
            names += [f"checkpoints/{p.name}" for p in sorted(checkpoints.iterdir()) if p.is_symlink()]
    return names


def check(out: Path, overwrite: bool, resuming: bool) -> None:
    """Refuse a folder of someone else's files, or a previous run we would clobber."""
    links = _links(out)
    if links:
        raise UserError(
            f"--output-dir {out}: {links[0]} is a symbolic link, and accum-train writes and removes only "
            "files and folders of its own there; remove the link or pick another --output-dir"
        )
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
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "w") as f:
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
