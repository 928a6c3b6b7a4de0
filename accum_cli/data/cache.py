"""The prepared-data cache: where it lives, the key that names a preparation (the raw data's
fingerprint, the tokenizer, every option), reading a published one back, publishing a new one
atomically, and clearing what a stopped preparation left."""

from __future__ import annotations

import errno
import glob
import os
import shutil
import socket
from dataclasses import asdict, dataclass
from pathlib import Path

from accum_cli.data.formats import Options, as_rows
from accum_cli.data.store import Prepared, damaged, read_meta
from accum_cli.errors import UserError

TMP_PREFIX = ".tmp-"  # + host@pid-random: a preparation in progress ("@" is in no hostname)


def cache_root() -> Path:
    """ACCUM_TRAIN_CACHE, or accum-train/ in the datasets cache, found as `datasets.config` finds it:
    reading that would import datasets into a trainer that has no other use for it (isolate.py)."""
    if os.environ.get("ACCUM_TRAIN_CACHE"):
        return Path(os.environ["ACCUM_TRAIN_CACHE"])
    hf_home = os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    datasets_cache = os.environ.get("HF_DATASETS_CACHE") or os.path.join(
        os.path.expanduser(os.environ.get("HF_HOME", hf_home)), "datasets"
    )
    return Path(datasets_cache) / "accum-train"


def cache_key(raw, tokenizer, options: Options, fmt: str) -> str:
    """The identity of the prepared data: the raw data's fingerprint, the tokenizer and every option."""
    from datasets.fingerprint import Hasher

    fingerprint = as_rows(raw).fingerprint
    return Hasher.hash([PREP_VERSION, fingerprint, fmt, asdict(options), tokenizer if fmt != "tokens" else None])


def cached(key: str) -> tuple[Prepared, Stats] | None:
    """The prepared data and its stats, if a complete copy is in the cache."""
    folder = cache_root() / key
    try:
        meta = read_meta(folder)
        if meta is None:
            return None
        return Prepared.load(folder, meta, key), Stats(**meta["stats"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UserError(damaged(folder, exc)) from None


def remove_abandoned(root: Path) -> None:
    """Temporary folders of preparations killed on this host (their process is gone): ours to delete.
    Those of live processes, or of other hosts sharing the cache, are left alone."""
    host = socket.gethostname()
    for folder in root.glob(f"{TMP_PREFIX}{glob.escape(host)}@*-*"):
        pid = folder.name[len(TMP_PREFIX) + len(host) + 1 :].split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def publish(work: Path, final: Path) -> bool:
    """Rename a finished folder into place, atomically. Another process publishing the same key
    at the same time may win: then its copy (the same data) is the cache and ours is dropped.
    Returns whether ours was published."""
    try:
        os.rename(work, final)
        return True
    except OSError as exc:
        if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY, errno.EISDIR, errno.ENOTDIR):
            raise UserError(f"cannot publish the prepared data to {final} ({exc.strerror})") from None
        if read_meta(final) is None:
            raise UserError(
                f"the data cache holds an incomplete {final}; delete that folder to prepare it again"
            ) from None
        return False


def umask_now() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


PREP_VERSION = 3  # 3: block digests in meta.json


@dataclass(frozen=True, slots=True)
class Stats:
    format: str
    documents: int
    samples: int
    tokens: int
    loss_tokens: int
    packed: bool
    truncated: int  # documents cut at seq_len
    longest: int = 0  # tokens in the longest sample
    stored_bytes: int = 0  # the prepared files, all together

    def describe(self, global_batch: int) -> list[str]:
        steps = self.samples // global_batch
        lines = [
            f"format            {self.format}, {'packed into blocks' if self.packed else 'one document per row'}",
            f"documents         {self.documents:,}",
            f"tokens            {self.tokens:,} ({self.loss_tokens:,} count in the loss)",
            f"samples           {self.samples:,}; one epoch = {steps:,} optimizer steps of {global_batch}",
        ]
        if self.stored_bytes:
            lines.append(
                f"stored            {self.stored_bytes / max(self.tokens, 1):.2f} bytes per token, memory-mapped"
            )
        if self.truncated:
            lines.append(f"truncated         {self.truncated:,} documents longer than --seq-len")
        return lines
