"""The prepared-data cache: where it lives, the key that names a preparation (the raw data's
fingerprint, the tokenizer, every option), reading a published one back, publishing a new one
atomically, and clearing what a stopped preparation left."""

from __future__ import annotations

import errno
import glob
import os
import shutil
import socket
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np

from accum_cli.data.formats import BUILDERS, Options, as_rows, rows_packed, stream_packed
from accum_cli.data.store import FILE_DTYPES, IGNORE_INDEX, Prepared, damaged, read_meta, slices, token_dtype
from accum_cli.data.store import FORMAT_VERSION as STORE_VERSION
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
    parts = [PREP_VERSION, fingerprint, fmt, asdict(options), tokenizer if fmt != "tokens" else None]
    if rows_packed(options, fmt):  # stored as rows, unlike the stream-packed rows of older versions
        parts.append("rows-bin-packed")
    return Hasher.hash(parts)


def cached(key: str, options: Options) -> tuple[Prepared, Stats] | None:
    """The prepared data and its stats, if a complete copy is in the cache; one that fails `validated` is refused
    as damaged, in one line, before the run writes anything (this is setup's work)."""
    folder = cache_root() / key
    try:
        meta = read_meta(folder)
        if meta is None:
            return None
        stats = validated(folder, meta, key, options)
        return Prepared.load(folder, meta, key), stats
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UserError(damaged(folder, exc)) from None


def validated(folder: Path, meta: object, key: str, options: Options) -> Stats:
    """A published folder's meta.json, checked before any of it is believed: against the options of the key it
    was found under (`cache_key` hashes them, so the key cannot be read back; here they are the caller's), and
    against the files. Its block digests cover the files' bytes, not meta.json, and a cache is shared and outlives
    the run that wrote it: a seq_len, sample count or dtype edited there would train on other sequences than the
    options ask for, and ids outside the vocabulary would crash the model's lookup mid-run. ValueError names the
    first thing wrong. Costs one read of the ids (and of the row boundaries and free-form labels, where there are
    any), slice by slice; the digests stay checked as samples are read (store.BlockCheck)."""
    if not isinstance(meta, dict):
        raise ValueError("meta.json is not a JSON object")
    if meta.get("version") != STORE_VERSION or meta.get("key") != key:
        raise ValueError("meta.json describes other prepared data (its format or its key differ)")
    stats = _stats(meta.get("stats"))
    dtype = token_dtype(options.vocab_size)
    if meta.get("dtype") != dtype.name:
        raise ValueError(f"meta.json records dtype {str(meta.get('dtype'))[:20]!r}, not the {dtype.name} of the ids")
    if meta.get("seq_len") != options.seq_len:
        raise ValueError(f"meta.json records seq_len {str(meta.get('seq_len'))[:20]}, not --seq-len {options.seq_len}")
    packed = stream_packed(options, stats.format)  # as prepare.build decides
    if meta.get("packed") is not packed or stats.packed is not packed:
        raise ValueError(f"meta.json records the {stats.format} rows as {'not ' if packed else ''}packed")
    samples, tokens = meta.get("samples"), meta.get("tokens")
    if (samples, tokens) != (stats.samples, stats.tokens) or (packed and tokens != samples * options.seq_len):
        raise ValueError(
            f"meta.json records {str(samples)[:20]} samples of {str(tokens)[:20]} tokens in all, its stats "
            f"{stats.samples} of {stats.tokens}" + (f", in blocks of {options.seq_len}" if packed else "")
        )
    files = _files(meta, stats.format, packed, options)
    for name, size in files.items():
        element = FILE_DTYPES[name] or dtype
        count = samples + 1 if name == "offsets.bin" else tokens
        if size != count * element.itemsize:
            raise ValueError(
                f"meta.json records {size} bytes for {name}, not the {count * element.itemsize} of its {count} "
                f"{element.name} values"
            )
        path = folder / name
        if not path.is_file() or path.stat().st_size != size:
            raise ValueError(f"{name} is missing or holds other than the {size} bytes meta.json records")
    if sum(files.values()) != stats.stored_bytes or stats.loss_tokens > tokens:
        raise ValueError("meta.json's stats disagree with its files")
    longest = _longest_row(folder, samples, tokens) if not packed else (options.seq_len if samples else 0)
    cut = stats.format != "tokens" or options.packing is False  # rows truncated to --seq-len (formats.make_rows)
    if longest != stats.longest or (cut and longest > options.seq_len):
        raise ValueError(
            f"meta.json records rows of up to {stats.longest} tokens; the files hold rows of up to {longest}, "
            f"with --seq-len {options.seq_len}"
        )
    _ids_in_vocabulary(folder / "tokens.bin", dtype, tokens, options.vocab_size)
    if "labels.bin" in files:
        _ids_in_vocabulary(folder / "labels.bin", FILE_DTYPES["labels.bin"], tokens, options.vocab_size)
    return stats


def _files(meta: dict, fmt: str, packed: bool, options: Options) -> dict[str, int]:
    """meta.json's files (name -> bytes) and their digests, the files being those that `fmt` data prepared with
    `options` holds (store.py): ids; row boundaries unless packed; a loss mask where some position may not count;
    labels of their own for pre-tokenised rows only."""
    files, digests = meta.get("files"), meta.get("digests")
    if not (isinstance(files, dict) and isinstance(digests, dict) and files.keys() == digests.keys()):
        raise ValueError("meta.json's files and digests are malformed")
    if not all(type(size) is int and isinstance(digests[name], str) for name, size in files.items()):
        raise ValueError("meta.json's files and digests are malformed")
    masked = {"text": False, "tokens": "mask.bin" in files}.get(fmt, not options.train_on_prompt)
    needed = {"tokens.bin"} | ({"mask.bin"} if masked else set()) | (set() if packed else {"offsets.bin"})
    optional = {"labels.bin"} if fmt == "tokens" and masked else set()
    if not needed <= files.keys() <= needed | optional:
        raise ValueError(f"meta.json lists other files ({', '.join(files)[:120]}) than {fmt} data holds")
    return files


def _stats(raw: object) -> Stats:
    """meta.json's stats, each field of its type (a bool is no count)."""
    if not isinstance(raw, dict) or raw.keys() != {f.name for f in fields(Stats)}:
        raise ValueError("meta.json's stats are malformed")
    for field in fields(Stats):
        value = raw[field.name]
        ok = {"format": isinstance(value, str) and value in BUILDERS, "packed": type(value) is bool}.get(
            field.name, type(value) is int and value >= 0
        )
        if not ok:
            raise ValueError(f"meta.json's stats record {field.name} {str(value)[:20]!r}")
    return Stats(**raw)


def _longest_row(folder: Path, samples: int, tokens: int) -> int:
    """The longest row that offsets.bin cuts tokens.bin into, once it checks that they are rows: from 0 to the
    last token, none empty (an empty row trains nothing and is never stored)."""
    longest, end = 0, 0
    for i, part in enumerate(slices(folder / "offsets.bin", FILE_DTYPES["offsets.bin"], samples + 1)):
        if i == 0 and part[0] != 0:
            raise ValueError("offsets.bin does not start at 0")
        lengths = np.diff(part) if i == 0 else np.diff(part, prepend=end)
        if len(lengths) and lengths.min() < 1:
            raise ValueError("offsets.bin holds rows that end before they start")
        longest = max(longest, int(lengths.max()) if len(lengths) else 0)
        end = int(part[-1])
    if end != tokens:
        raise ValueError(f"offsets.bin ends at token {end}, tokens.bin holds {tokens}")
    return longest


def _ids_in_vocabulary(path: Path, dtype: np.dtype, count: int, vocab_size: int | None) -> None:
    """Every id in the file lies in the vocabulary (a label may also be IGNORE_INDEX): one outside it would stop
    the run mid-step, at the embedding's lookup or in the loss, with a traceback."""
    if vocab_size is None:  # unknown: any id the 4 bytes hold
        return
    for part in slices(path, dtype, count):
        values = part[part != IGNORE_INDEX] if path.name == "labels.bin" else part
        if len(values) and (values.min() < 0 or values.max() >= vocab_size):
            bad = int(values.max()) if values.max() >= vocab_size else int(values.min())
            raise ValueError(f"{path.name} holds id {bad}, outside the model's vocabulary of {vocab_size:,}")


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


PREP_VERSION = 5  # 3: block digests in meta.json; 4: stats of what --seq-len cut; 5: chat answers without EOS
# A warning above this share of the loss tokens cut by --seq-len: truncation takes the ends of the answers, the EOS
# that teaches the model to stop among them, so a quarter gone already changes what the model learns to say.
TRUNCATION_WARN_SHARE = 0.25


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
    cut_loss_tokens: int = 0  # positions that counted in the loss, cut away by --seq-len
    longest_document: int = 0  # tokens in the longest row before --seq-len cut it
    without_eos: int = 0  # chat rows whose answers hold no EOS

    def shape(self, rows_packed: int) -> str:
        if rows_packed:
            return "rows packed whole into sequences (--packing)"
        return "packed into blocks" if self.packed else "one document per row"

    def describe(self, global_batch: int, rows_packed: int = 0) -> list[str]:
        """Every detail (--verbose, --prepare-only). `rows_packed`: the rows that --packing of rows placed into
        the samples, which are then packed sequences."""
        steps = self.samples // global_batch
        samples = f"{self.samples:,} packed sequences of {rows_packed:,} rows" if rows_packed else f"{self.samples:,}"
        lines = [
            f"format            {self.format}, {self.shape(rows_packed)}",
            f"documents         {self.documents:,}",
            f"tokens            {self.tokens:,} ({self.loss_tokens:,} count in the loss)",
            f"samples           {samples}; one epoch = {steps:,} optimizer steps of {global_batch}",
        ]
        if self.stored_bytes:
            lines.append(
                f"stored            {self.stored_bytes / max(self.tokens, 1):.2f} bytes per token, memory-mapped"
            )
        return lines + self.warnings()

    def summary(self, global_batch: int, rows_packed: int = 0) -> list[str]:
        """The run header's data line, and the warnings; describe() has every detail (--verbose)."""
        return [
            f"data              {self.format}, {self.shape(rows_packed)}: {self.documents:,} documents, {self.tokens:,} tokens "
            f"({self.loss_tokens:,} in the loss); one epoch = {self.samples // global_batch:,} optimizer steps",
            *self.warnings(),
        ]

    def warnings(self) -> list[str]:
        """Lines about what the data loses: truncation (in loss tokens) and chat answers without EOS."""
        lines = []
        if self.truncated:
            before = self.loss_tokens + self.cut_loss_tokens
            share = self.cut_loss_tokens / max(before, 1)
            lines.append(
                f"truncated         {self.truncated:,} documents longer than --seq-len: {share:.0%} of the loss "
                f"tokens cut away ({self.cut_loss_tokens:,} of {before:,})"
            )
            if share > TRUNCATION_WARN_SHARE:
                lines.append(
                    f"warning           --seq-len cuts away {share:.0%} of what the loss counts, the ends of answers "
                    f"first; raise --seq-len (the longest row holds {self.longest_document:,} tokens)"
                )
        if self.without_eos:
            lines.append(
                f"warning           {self.without_eos:,} of {self.documents:,} conversations' answers hold no EOS (the "
                "chat template ends turns with a marker of its own): the model would not learn to stop; --chat-eos "
                "ends each answer with the tokenizer's EOS"
            )
        return lines
