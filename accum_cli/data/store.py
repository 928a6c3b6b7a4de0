"""Prepared data on disk: compact, written in one streaming pass, memory-mapped for training.

A prepared folder holds flat binary files and a meta.json that describes them:

- `tokens.bin`: every sample's token ids back to back, in the smallest unsigned type that holds
  the vocabulary (uint16 below 65,536 ids, else uint32);
- `mask.bin` (uint8, one per token): 1 where the position counts in the loss. Absent when every
  position counts (plain text, --train-on-prompt), where the labels are the ids themselves;
- `labels.bin` (int32): only for pre-tokenised rows whose labels are neither their ids nor -100;
- `offsets.bin` (int64, samples + 1): sample boundaries of unpacked rows. Packed data needs none:
  sample i is tokens [i * seq_len, (i + 1) * seq_len).

Packed text thus costs 2 bytes per token with a vocabulary under 65,536 and 4 above it.
A sample is read by slicing the memory maps, so a step costs O(global batch) whatever the corpus
size, and the page cache, not the process, holds the corpus.

meta.json also records a BLAKE2b digest of every 1 MiB block of each file. A cache is shared
(across nodes, with colleagues) and outlives the run that wrote it, so a flipped byte must not
become a silently wrong token. Hashing a whole corpus at every start would cost minutes at
pretraining scale, so a block is checked the first time a sample in it is read (once per process):
the cost is one read of what the run touches, spread over the run, and a damaged block stops the
run before its bytes reach the model. The digests do not cover meta.json itself: cache.validated checks it when
the folder is read back, against the options of its key and the files (sizes, row boundaries, every id within the
vocabulary: one read of the ids per start, no hashing), before the run writes anything.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from accum_cli import safe_json
from accum_cli.errors import RankError

IGNORE_INDEX = -100
FORMAT_VERSION = 2  # 2: block digests
SCAN_TOKENS = 1 << 24  # tokens per slice when a finished file is scanned (bounded memory)
CHECK_BLOCK_BYTES = 1 << 20  # small: a sample's first read hashes its block (~1 ms), not more
DIGEST_BYTES = 16


def token_dtype(vocab_size: int | None) -> np.dtype:
    """The smallest unsigned type holding every id below vocab_size (unknown: 4 bytes)."""
    return np.dtype(np.uint16 if vocab_size is not None and vocab_size <= 1 << 16 else np.uint32)


@dataclass(slots=True)
class Chunk:
    """Some consecutive rows, tokenised: what one worker hands back."""

    ids: np.ndarray  # every row's ids back to back, in the store's dtype
    lengths: np.ndarray  # int64 tokens per row (rows with no tokens already dropped)
    mask: np.ndarray | None  # uint8 per token, 1 = counts; None: every position counts
    labels: np.ndarray | None  # int32 per token, only when some label is neither the id nor -100
    documents: int
    truncated: int
    loss_tokens: int  # in unpacked rows (each row's first position predicts nothing)
    cut_loss_tokens: int  # positions that counted in the loss past seq_len, cut away with them
    longest_document: int  # tokens in the longest row, before seq_len cut it
    without_eos: int  # chat rows whose answers (the positions that count) hold no EOS


class Writer:
    """Appends chunks to the files of one prepared folder (a context manager that closes them)."""

    def __init__(self, folder: Path, dtype: np.dtype, packed: bool, seq_len: int, with_mask: bool):
        self.folder, self.dtype, self.packed, self.seq_len = folder, dtype, packed, seq_len
        self._files = contextlib.ExitStack()
        self.tokens = self._open("tokens.bin")
        self.mask = self._open("mask.bin") if with_mask else None
        self.labels = None
        self.offsets = None if packed else self._open("offsets.bin")
        if self.offsets is not None:
            self.offsets.write(np.zeros(1, np.int64).tobytes())
        self.n_tokens = 0
        self.rows = 0
        self.documents = 0
        self.truncated = 0
        self.loss_tokens = 0
        self.longest = 0
        self.cut_loss_tokens = 0
        self.longest_document = 0
        self.without_eos = 0

    def _open(self, name: str):
        return self._files.enter_context(open(self.folder / name, "wb"))

    def __enter__(self) -> Writer:
        return self

    def __exit__(self, *exc) -> None:
        self._files.close()

    def add(self, chunk: Chunk) -> None:
        if chunk.labels is not None and self.labels is None:
            self._start_labels()
        self.tokens.write(chunk.ids.tobytes())
        if self.mask is not None:
            self.mask.write((chunk.mask if chunk.mask is not None else np.ones(len(chunk.ids), np.uint8)).tobytes())
        if self.labels is not None:
            labels = chunk.labels if chunk.labels is not None else _labels_of(chunk.ids, chunk.mask)
            self.labels.write(labels.astype(np.int32).tobytes())
        if self.offsets is not None and len(chunk.lengths):
            self.offsets.write((self.n_tokens + np.cumsum(chunk.lengths, dtype=np.int64)).tobytes())
        self.n_tokens += len(chunk.ids)
        self.rows += len(chunk.lengths)
        self.documents += chunk.documents
        self.truncated += chunk.truncated
        self.loss_tokens += chunk.loss_tokens
        self.cut_loss_tokens += chunk.cut_loss_tokens
        self.longest_document = max(self.longest_document, chunk.longest_document)
        self.without_eos += chunk.without_eos
        if len(chunk.lengths):
            self.longest = max(self.longest, int(chunk.lengths.max()))

    def _start_labels(self) -> None:
        """The first free-form labels: write the labels of everything so far, from ids and mask."""
        self.labels = self._open("labels.bin")
        for f in (self.tokens, self.mask):
            if f is not None:
                f.flush()
        for start in range(0, self.n_tokens, SCAN_TOKENS):
            stop = min(start + SCAN_TOKENS, self.n_tokens)
            ids = np.fromfile(self.folder / "tokens.bin", self.dtype, stop - start, offset=start * self.dtype.itemsize)
            mask = np.fromfile(self.folder / "mask.bin", np.uint8, stop - start, offset=start) if self.mask else None
            self.labels.write(_labels_of(ids, mask).astype(np.int32).tobytes())

    def finish(self) -> dict:
        """Close the files, cut a packed stream to whole blocks; return what meta.json records."""
        self._files.close()
        if self.packed:
            samples = self.n_tokens // self.seq_len
            kept = samples * self.seq_len
            os.truncate(self.folder / "tokens.bin", kept * self.dtype.itemsize)
            for name, size in (("mask.bin", 1), ("labels.bin", 4)):
                if (self.folder / name).exists():
                    os.truncate(self.folder / name, kept * size)
            self.n_tokens, self.longest = kept, self.seq_len if samples else 0
            self.loss_tokens = self._packed_loss_tokens(samples)
        else:
            samples = self.rows
        paths = sorted(self.folder.glob("*.bin"))
        files = {p.name: p.stat().st_size for p in paths}
        digests = {p.name: block_digests(p) for p in paths}
        return {"version": FORMAT_VERSION, "dtype": self.dtype.name, "packed": self.packed, "seq_len": self.seq_len,
                "samples": samples, "tokens": self.n_tokens, "files": files, "digests": digests}  # fmt: skip

    def _packed_loss_tokens(self, samples: int) -> int:
        """Each block's first position predicts nothing; the rest count where the mask says so."""
        if self.mask is None:
            return samples * (self.seq_len - 1)
        # Read in slices, not through a memory map, whose touched pages would count in this
        # process's resident memory and grow it with the corpus.
        step = max(1, SCAN_TOKENS // self.seq_len)
        total = 0
        for first in range(0, samples, step):
            n = min(step, samples - first)
            mask = np.fromfile(self.folder / "mask.bin", np.uint8, n * self.seq_len, offset=first * self.seq_len)
            total += int(mask.reshape(n, self.seq_len)[:, 1:].sum())
        return total


def _digest(block: bytes) -> str:
    return hashlib.blake2b(block, digest_size=DIGEST_BYTES).hexdigest()


def block_digests(path: Path) -> str:
    """The hex digests of the file's CHECK_BLOCK_BYTES blocks, back to back (read, not mapped:
    the page cache holds what was read, not this process)."""
    out = []
    with open(path, "rb") as f:
        while block := f.read(CHECK_BLOCK_BYTES):
            out.append(_digest(block))
    return "".join(out)


def damaged(folder: Path, what: object) -> str:
    return f"the prepared data in {folder} is damaged ({what}); delete that folder to prepare it again"


class DamagedError(RankError):
    """A block of a prepared file whose bytes do not match the digest meta.json recorded."""

    def __init__(self, path: Path, what: str):
        super().__init__(damaged(path.parent, what))


class BlockCheck:
    """A prepared file's blocks, each checked against its recorded digest the first time it is read."""

    def __init__(self, path: Path, size: int, digests: str):
        width = 2 * DIGEST_BYTES
        blocks = -(-size // CHECK_BLOCK_BYTES)
        if len(digests) != blocks * width:
            raise OSError(f"meta.json records {len(digests) // width} block digests for {path.name}, not {blocks}")
        self.path, self.digests = path, digests
        self.checked = np.zeros(blocks, dtype=bool)

    def bytes(self, start: int, stop: int) -> None:
        """Raise DamagedError unless every block holding bytes [start, stop) matches its digest."""
        if stop <= start:
            return
        first, last = start // CHECK_BLOCK_BYTES, (stop - 1) // CHECK_BLOCK_BYTES
        if self.checked[first : last + 1].all():
            return
        with open(self.path, "rb") as f:
            for block in range(first, last + 1):
                if self.checked[block]:
                    continue
                f.seek(block * CHECK_BLOCK_BYTES)
                data = f.read(CHECK_BLOCK_BYTES)
                want = self.digests[2 * DIGEST_BYTES * block : 2 * DIGEST_BYTES * (block + 1)]
                if _digest(data) != want:
                    where = f"{self.path.name} bytes {block * CHECK_BLOCK_BYTES:,}+"
                    raise DamagedError(self.path, f"{where} changed since they were written")
                self.checked[block] = True


def _labels_of(ids: np.ndarray, mask: np.ndarray | None) -> np.ndarray:
    labels = ids.astype(np.int64)
    if mask is not None:
        labels[mask == 0] = IGNORE_INDEX
    return labels


class Prepared:
    """Samples of a prepared folder (or of in-memory arrays): ids and labels by index."""

    def __init__(self, tokens: np.ndarray, seq_len: int | None, offsets: np.ndarray | None = None,
                 mask: np.ndarray | None = None, labels: np.ndarray | None = None,
                 index: np.ndarray | None = None, key: str = "",
                 checks: dict[str, BlockCheck] | None = None):  # fmt: skip
        self.tokens, self.seq_len, self.offsets = tokens, seq_len, offsets
        self.mask, self.labels, self.index, self.key = mask, labels, index, key
        self.checks = checks or {}  # by file name; none for arrays made in memory

    @classmethod
    def load(cls, folder: Path, meta: dict, key: str) -> Prepared:
        """Memory-map the files of a folder whose meta.json was validated against them (cache.validated); their
        bytes are checked block by block as samples are read (BlockCheck)."""
        files = meta["files"]
        checks = {name: BlockCheck(folder / name, size, meta["digests"][name]) for name, size in files.items()}

        def mapped(name: str, dtype) -> np.ndarray | None:
            if name not in files:
                return None
            if files[name] == 0:
                return np.zeros(0, dtype)
            return np.memmap(folder / name, dtype, "r")

        return cls(
            mapped("tokens.bin", np.dtype(meta["dtype"])),
            meta["seq_len"] if meta["packed"] else None,
            mapped("offsets.bin", np.int64),
            mapped("mask.bin", np.uint8),
            mapped("labels.bin", np.int32),
            key=key,
            checks=checks,
        )

    def __len__(self) -> int:
        if self.index is not None:
            return len(self.index)
        if self.offsets is not None:
            return len(self.offsets) - 1
        return len(self.tokens) // self.seq_len

    def select(self, indices) -> Prepared:
        """A view on some samples (an eval split); the files are shared, not copied."""
        index = np.asarray(indices, dtype=np.int64)
        if self.index is not None:
            index = self.index[index]
        return Prepared(self.tokens, self.seq_len, self.offsets, self.mask, self.labels, index, self.key, self.checks)

    def sample(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """(input_ids, labels) of sample i, as int64 arrays."""
        row = int(self.index[i]) if self.index is not None else i
        if self.offsets is not None:
            self._check("offsets.bin", self.offsets, row, row + 2)
            start, stop = int(self.offsets[row]), int(self.offsets[row + 1])
        else:
            start, stop = row * self.seq_len, (row + 1) * self.seq_len
        for name, array in (("tokens.bin", self.tokens), ("mask.bin", self.mask), ("labels.bin", self.labels)):
            self._check(name, array, start, stop)
        ids = self.tokens[start:stop].astype(np.int64)
        if self.labels is not None:
            return ids, self.labels[start:stop].astype(np.int64)
        if self.mask is not None:
            return ids, np.where(self.mask[start:stop] != 0, ids, IGNORE_INDEX)
        return ids, ids

    def _check(self, name: str, array: np.ndarray | None, start: int, stop: int) -> None:
        """Elements [start, stop) of the array mapped from file `name`, checked (BlockCheck)."""
        check = self.checks.get(name)
        if check is not None and array is not None:
            check.bytes(start * array.itemsize, stop * array.itemsize)

    def rows(self, indices) -> list[tuple[np.ndarray, np.ndarray]]:
        return [self.sample(int(i)) for i in indices]


def read_meta(folder: Path) -> dict | None:
    """A published folder's meta.json, as written (cache.validated checks it); None where there is none."""
    path = folder / "meta.json"
    if not path.is_file():
        return None
    return safe_json.loads(path.read_text())


# The files a prepared folder may hold, with the type of their elements (tokens.bin's is meta.json's dtype).
FILE_DTYPES = {"tokens.bin": None, "mask.bin": np.dtype(np.uint8), "labels.bin": np.dtype(np.int32),
               "offsets.bin": np.dtype(np.int64)}  # fmt: skip


def slices(path: Path, dtype: np.dtype, count: int) -> Iterator[np.ndarray]:
    """The file's first `count` elements, SCAN_TOKENS at a time: read, not memory-mapped, so that the
    process holds one slice, not the pages of the whole file."""
    for start in range(0, count, SCAN_TOKENS):
        yield np.fromfile(path, dtype, min(SCAN_TOKENS, count - start), offset=start * dtype.itemsize)
