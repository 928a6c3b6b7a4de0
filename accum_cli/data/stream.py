"""Streaming corpora (--streaming): rows read as they come, tokenised and packed on the fly.

The design, the simplest that is exact: every rank reads the *same* global stream of samples,
deterministically: the rows in the dataset's order, tokenised by prepare.py's own functions,
packed into --seq-len blocks like the prepared path (or one sample per row), then passed
through a shuffle buffer seeded by --seed. Each rank keeps only its slice of each step's G
samples, the slice plan.py gives it, as on the prepared path. So step k trains on global
samples [k*G, (k+1)*G) of one stream whatever W and m, with no communication; every rank sees
the stream end at the same step. The price: each rank tokenises the whole stream (W times the
work of one, small next to a forward/backward of the same tokens) and reads all of it (from the
hub, every rank downloads it).

Resume replays: a checkpoint records the global samples consumed (meta.json's `samples`, as on
the prepared path), and a resumed run reads the stream again from its start, skipping that
many samples without training on them. That is exact (the same partial block carried between
chunks, the same shuffle buffer contents and draws), needs nothing in the checkpoint beyond
the position (no pickle, nothing to verify), and costs the time to read and tokenise again what
was consumed. `datasets`' `IterableDataset.state_dict()` restores a row position but neither
the partial packed block nor the shuffle buffer's contents (up to N samples of tokens), so a
resume from it would not equal an uninterrupted run.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from typing import TypeVar

import numpy as np

from accum_cli.config.plan import Plan
from accum_cli.data import formats, prepare, sources
from accum_cli.data.batches import Microbatch, collate, empty_microbatch
from accum_cli.data.store import IGNORE_INDEX
from accum_cli.errors import UserError, first_line

STREAM_VERSION = 1
ROWS_PER_BATCH = 256  # raw rows tokenised together
SHUFFLE_STREAM = 0x57EA  # keeps the buffer's draws apart from the seed's other uses

# A sample: its ids (the store's dtype) and its labels (int32), or None where the labels are the ids.
Sample = tuple[np.ndarray, np.ndarray | None]
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Source:
    """Everything that decides the global stream of samples."""

    raw: object  # a datasets.IterableDataset
    name: str  # how the user named it, for messages
    job: prepare.Job
    seed: int
    shuffle_buffer: int
    max_positions: int | None  # the model's: longer pre-tokenised rows are refused


def open_source(raw, name: str, tokenizer, options: formats.Options, seed: int, shuffle_buffer: int,
                max_positions: int | None) -> Source:  # fmt: skip
    """Check the stream's format from its first row (a stream of text files has no schema before
    it is read; the rows after it are checked as they come) and describe how to read it."""
    try:
        first = next(iter(raw), None)
    except Exception as exc:  # a malformed file or an unreachable hub: name it, not the parser's stack
        raise UserError(f"--dataset {name}: cannot read it as a stream: {first_line(exc)}") from None
    if first is None:
        raise UserError("the dataset is empty; pass a dataset with at least one row")
    columns = raw.column_names or list(first)
    fmt = formats.check_columns(columns, raw.features, tokenizer, options)
    if fmt != "tokens" and isinstance(first, dict):
        texts = formats.sample_texts({name: [value] for name, value in first.items()}, fmt, options.text_column)
        formats.check_tokenizer(tokenizer, texts)
    if formats.rows_packed(options, fmt):  # whole rows with position ids of their own: prepared data only
        raise UserError(
            f"--packing of {fmt} rows packs whole rows from prepared data; it is not available with --streaming: "
            "drop --streaming, or --packing to train one row per sequence"
        )
    packed = formats.stream_packed(options, fmt)
    job = prepare.Job(tokenizer, options, fmt, packed, prepare.has_mask(fmt, columns, options))
    return Source(raw, name, job, seed, shuffle_buffer, max_positions)


def identity(dataset: str | None, config_name: str | None, split: str, source: Source) -> str:
    """The stream's identity: where its rows come from, the tokenizer, every option, the buffer."""
    from datasets.fingerprint import Hasher

    if dataset is None:
        origin = ["embedded", Hasher.hash(sources.embedded_documents())]
    elif sources.is_local(dataset):  # the files as they are now: an edited file is other data
        origin = sources.local_origin(sources.local_files(dataset, split=split))
    else:  # a hub dataset: its id (a new revision on the hub is not seen)
        origin = [dataset, config_name, split]
    job = source.job
    tokenizer = job.tokenizer if job.fmt != "tokens" else None
    return Hasher.hash([STREAM_VERSION, origin, job.fmt, job.packed, asdict(job.options), tokenizer,
                        source.shuffle_buffer])  # fmt: skip


def describe(source: Source) -> str:
    job = source.job
    layout = f"packed into {job.options.seq_len}-token blocks" if job.packed else "one document per row"
    order = (
        f"shuffle buffer of {source.shuffle_buffer:,} samples (seed {source.seed})"
        if source.shuffle_buffer
        else "in stream order (--shuffle-buffer 0)"
    )
    return f"streaming {job.fmt}, {layout}, tokenised on the fly; {order}"


def samples(source: Source) -> Iterator[Sample]:
    """The global stream of samples: the same on every rank, whatever the world size."""
    chunks = _chunks(source)
    made = _blocks(chunks, source.job.options.seq_len) if source.job.packed else _rows(chunks, source.max_positions)
    return shuffled(made, source.shuffle_buffer, source.seed)


def _chunks(source: Source) -> Iterator[prepare.Chunk]:
    batches = source.raw.iter(batch_size=ROWS_PER_BATCH)
    start = 0
    while True:
        try:
            batch = next(batches)
        except StopIteration:
            return
        except Exception as exc:  # a malformed line further on, a lost connection
            raise UserError(
                f"--dataset {source.name}: cannot read the rows after row {start}: {first_line(exc)}"
            ) from None
        n_rows = len(next(iter(batch.values())))
        yield prepare.tokenise_batch(source.job, batch, start, n_rows)
        start += n_rows


def _labels(chunk: prepare.Chunk) -> np.ndarray | None:
    """The chunk's labels as int32, or None where every position counts (they are the ids)."""
    if chunk.labels is not None:
        return chunk.labels
    if chunk.mask is not None:
        return np.where(chunk.mask != 0, chunk.ids.astype(np.int32), IGNORE_INDEX).astype(np.int32)
    return None


def _blocks(chunks: Iterable[prepare.Chunk], seq_len: int) -> Iterator[Sample]:
    """Rows back to back, cut into seq_len blocks; what is left after the last block is dropped."""
    ids = labels = None
    for chunk in chunks:
        more = _labels(chunk)
        ids = chunk.ids if ids is None else np.concatenate([ids, chunk.ids])
        if more is not None:
            labels = more if labels is None else np.concatenate([labels, more])
        whole = len(ids) // seq_len * seq_len
        for start in range(0, whole, seq_len):
            stop = start + seq_len
            yield ids[start:stop].copy(), None if labels is None else labels[start:stop].copy()
        ids = ids[whole:].copy()
        labels = None if labels is None else labels[whole:].copy()


def _rows(chunks: Iterable[prepare.Chunk], max_positions: int | None) -> Iterator[Sample]:
    """One sample per row (make_rows already truncated all but pre-tokenised rows to seq_len)."""
    for chunk in chunks:
        labels = _labels(chunk)
        bounds = np.concatenate([[0], np.cumsum(chunk.lengths)])
        for start, stop in zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True):
            if max_positions and stop - start > max_positions:
                raise UserError(
                    f"a pre-tokenised row has {stop - start} tokens, above the model's {max_positions} positions; "
                    "shorten the rows or pass --no-packing --seq-len N to truncate them"
                )
            # Copies: a view would keep its whole chunk alive in the shuffle buffer.
            yield chunk.ids[start:stop].copy(), None if labels is None else labels[start:stop].copy()


def shuffled(items: Iterable[T], size: int, seed: int) -> Iterator[T]:
    """A seeded shuffle buffer: hold `size` items; as each new one comes, hand out a random held
    one in its place; at the end, the rest in random order. An item leaves at most ~size places
    early and may stay long: a local shuffle, not a permutation of the whole stream. 0: as they come."""
    if size == 0:
        yield from items
        return
    rng = np.random.default_rng([seed, SHUFFLE_STREAM])
    buffer: list[T] = []
    for item in items:
        if len(buffer) < size:
            buffer.append(item)
            continue
        j = int(rng.integers(size))
        yield buffer[j]
        buffer[j] = item
    for j in rng.permutation(len(buffer)):
        yield buffer[int(j)]


class StreamReader:
    """One rank's reader of the global stream: each step's G samples read in order (the samples
    before them skipped), this rank's microbatches cut from them by the plan."""

    def __init__(self, source: Source, pad_id: int):
        self._samples = samples(source)
        self.pad_id = pad_id
        self.position = 0  # global samples read from the stream so far
        self._step: tuple[int, list[Sample]] | None = None  # the last step read: (first sample, its samples)

    def _take(self, first: int, count: int) -> list[Sample] | None:
        """Global samples [first, first + count), or None when the stream ends before."""
        if self._step is not None and self._step[0] == first and len(self._step[1]) == count:
            return self._step[1]
        if first < self.position:
            raise ValueError(f"a stream reads forward only: sample {first} is behind {self.position}")
        skipped = sum(1 for _ in itertools.islice(self._samples, first - self.position))
        self.position += skipped
        rows = list(itertools.islice(self._samples, count)) if self.position == first else []
        self.position += len(rows)
        if len(rows) < count:
            return None
        self._step = (first, rows)
        return rows

    def has_step(self, first: int, count: int) -> bool:
        """Whether the stream holds global samples [first, first + count) (they are read and kept)."""
        return self._take(first, count) is not None

    def microbatches(self, plan: Plan, step: int, rank: int, first: int) -> list[Microbatch]:
        """This rank's microbatches of the step that starts at global sample `first` (has_step said it is there)."""
        rows = self._take(first, plan.global_batch)
        if rows is None:
            raise ValueError(f"the stream ends inside the step that starts at sample {first}; ask has_step first")
        out = []
        for j in range(plan.accum_steps):
            picked = plan.microbatch_range(step, rank, j, first_sample=first)
            mine = [as_int64(rows[i - first]) for i in picked]
            out.append(collate(mine, self.pad_id) if mine else empty_microbatch(self.pad_id))
        return out


def as_int64(sample: Sample) -> tuple[np.ndarray, np.ndarray]:
    """(input_ids, labels) as int64, as collate and prepared data's samples are."""
    ids = sample[0].astype(np.int64)
    return ids, ids if sample[1] is None else sample[1].astype(np.int64)
