"""Rows -> training sequences, once: tokenised, labelled, packed or not, cached on disk.

Formats, told apart by their columns (first match wins):
- tokens: `input_ids` (optionally `labels` with -100 where a position does not count, and
  `attention_mask`), used as given;
- chat: `messages` (role/content turns) rendered with the tokenizer's chat template; the loss
  counts the assistant turns only, unless train_on_prompt;
- prompt-completion: `prompt` and `completion` columns; the loss counts the completion only,
  unless train_on_prompt;
- text: the text column, documents joined by EOS.

Packing (the whole corpus as one stream of documents, cut into seq_len blocks) is the default
for text; one document per row, truncated to seq_len and padded per microbatch, for the others.

Preparation streams: the main process reads the rows in order, a few MB at a time (local files
are never converted into a copy first, see sources.py), worker processes tokenise each chunk,
and the main process appends the chunks, in order, to the compact files of store.py, so memory
stays flat whatever the corpus size. The result is published atomically under the cache, keyed by the raw data's fingerprint,
the tokenizer and every option (`cache_key`: the identity of the prepared data), so a second
run, or a second rank, reads it instead of tokenising again. Rank 0 prepares first; on a node
that does not see its cache, that node's first local rank prepares while its siblings wait.
A training run reads and prepares the rows in forked children (isolate.py, run/data_setup.py data_keys and
build_data), so its ranks never hold `datasets` and its libraries: they read the cache.
"""

from __future__ import annotations

import errno
import json
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import tempfile
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from accum_cli.data import isolate
from accum_cli.data.cache import TMP_PREFIX, Stats, cache_key, cache_root, cached, publish, remove_abandoned, umask_now
from accum_cli.data.formats import Options, as_rows, check, make_rows, row_error, stream_packed
from accum_cli.data.sources import Rows
from accum_cli.data.store import IGNORE_INDEX, Chunk, Prepared, Writer, token_dtype
from accum_cli.errors import UserError, first_line

FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # a full disk, a quota, a file-size limit
BATCH_ROWS = 1000  # rows per chunk at most
BATCH_BYTES = 4 << 20  # raw bytes per chunk, about: long documents make chunks of fewer rows
PARALLEL_ABOVE_BYTES = 16 << 20  # below this, worker processes cost more than they save
PROGRESS_AFTER_S = 2.0  # a progress bar only for preparations that take a while


# --- tokenising chunks of rows into the store's arrays -------------------------------------


@dataclass(frozen=True, slots=True)
class Job:
    """How to tokenise a batch of rows: what each worker process is given once."""

    tokenizer: object
    options: Options
    fmt: str
    packed: bool
    with_mask: bool  # some positions may not count: keep a loss mask


def has_mask(fmt: str, columns: list[str], options: Options) -> bool:
    if fmt == "tokens":
        return "labels" in columns
    return fmt in ("chat", "prompt-completion") and not options.train_on_prompt


def tokenise_batch(job: Job, batch: dict, start: int, n_rows: int) -> Chunk:
    """A batch of raw rows (column -> values), the first of them row `start` of the dataset -> one chunk."""
    built = make_rows(batch, job.tokenizer, job.options, job.fmt, job.packed, first_row=start)
    rows = [i for i, row in enumerate(built["input_ids"]) if len(row)]  # an empty row trains nothing
    ids_rows = [built["input_ids"][i] for i in rows]
    lengths = np.fromiter((len(r) for r in ids_rows), np.int64, len(rows))
    total = int(lengths.sum())
    ids = _flat(ids_rows, rows, start, "input_ids")
    vocab = job.options.vocab_size
    _check_range(ids, lengths, rows, start, "input_ids", vocab)
    mask = labels = None
    if job.with_mask:
        all_labels = _flat([built["labels"][i] for i in rows], rows, start, "labels")
        counts = all_labels != IGNORE_INDEX
        mask = counts.astype(np.uint8)
        if np.any(all_labels[counts] != ids[counts]):  # labels of their own (pre-tokenised data)
            _check_range(np.where(counts, all_labels, 0), lengths, rows, start, "labels", vocab)
            labels = all_labels.astype(np.int32)
        firsts = np.cumsum(lengths) - lengths
        loss_tokens = int(mask.sum()) - int(mask[firsts].sum())
    else:
        loss_tokens = total - len(rows)
    return Chunk(ids.astype(token_dtype(vocab)), lengths, mask, labels, n_rows, sum(built["truncated"]),
                 loss_tokens, sum(built["cut_loss_tokens"]), max(built["lengths"], default=0),
                 sum(built["without_eos"]))  # fmt: skip


def _flat(rows: list[list[int]], where: list[int], start: int, name: str) -> np.ndarray:
    """Rows of ids back to back as int64 (numpy's list conversion beats a flat iterator); row k is
    row `start + where[k]` of the dataset, named if it holds something that is not an id."""
    flat = []
    for k, row in enumerate(rows):
        try:
            array = np.asarray(row, dtype=np.int64)
        except (TypeError, ValueError, OverflowError):  # a null or a nested list among the ids
            array = None
        if array is None or array.ndim != 1:
            raise row_error(start + where[k], f"{name} holds something that is not a token id (a null, a nested list)")
        flat.append(array)
    return np.concatenate(flat) if flat else np.zeros(0, np.int64)


def _check_range(values: np.ndarray, lengths: np.ndarray, rows: list[int], start: int, name: str,
                 vocab: int | None) -> None:  # fmt: skip
    limit = vocab if vocab is not None else 1 << 32
    if not len(values) or (values.min() >= 0 and values.max() < limit):
        return
    position = int(np.argmax((values < 0) | (values >= limit)))
    row = rows[int(np.searchsorted(np.cumsum(lengths), position, side="right"))]
    where = f"the model's vocabulary of {vocab:,}" if vocab is not None else "32-bit ids"
    raise row_error(
        start + row, f"{name} holds {int(values[position])}, outside {where}",
        "fix the data or pass the --model it was tokenised for",
    )  # fmt: skip


_JOB: Job | None = None  # a worker process's job, set once when the pool starts


def _init_worker(job: Job) -> None:
    # Ctrl-C is the pool owner's to handle (it terminates the pool): a worker interrupted halfway
    # through a message left the owner blocked for ever on a half-read pipe. The owner's SIGTERM
    # handler is not the worker's (terminate() means now), and a dead owner takes its workers along.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if isolate.available():
        isolate.end_with_parent()
    global _JOB
    _JOB = job


def _work(start: int, table) -> Chunk:
    return tokenise_batch(_JOB, table.to_pydict(), start, table.num_rows)


def tables(rows: Rows, columns: list[str]) -> Iterator[tuple[int, object]]:
    """(the first row's index, an Arrow table of the next rows), in order: at most BATCH_ROWS rows
    and about BATCH_BYTES each, so long documents make chunks of fewer rows."""
    batches = rows.tables(columns, BATCH_ROWS)
    start = 0
    while True:
        try:
            table = next(batches)
        except StopIteration:
            return
        except Exception as exc:  # a malformed line further on in a local file
            raise UserError(
                f"the dataset cannot be read after row {start}: {first_line(exc)}; fix or remove that row"
            ) from None
        step = max(1, table.num_rows * BATCH_BYTES // max(table.nbytes, 1))
        for offset in range(0, table.num_rows, step):
            piece = table.slice(offset, step)
            yield start, piece
            start += piece.num_rows


def chunks(job: Job, rows: Rows, columns: list[str], num_proc: int) -> Iterator[tuple[Chunk, int]]:
    """Every row's chunk, in order, with the Arrow bytes of the rows it came from. With several
    processes, at most 2 x num_proc chunks are in flight, so memory stays bounded whatever the
    corpus size."""
    if num_proc <= 1 or rows.nbytes < PARALLEL_ABOVE_BYTES:
        for start, table in tables(rows, columns):
            yield tokenise_batch(job, table.to_pydict(), start, table.num_rows), table.nbytes
        return
    # A fast (Rust) tokenizer used before the fork would otherwise warn and run single-threaded anyway.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # fork starts the workers with the tokenizer already loaded; elsewhere the job travels by pickle.
    context = multiprocessing.get_context("fork" if sys.platform.startswith("linux") else "spawn")
    with context.Pool(num_proc, _init_worker, (job,)) as pool:
        pending: deque = deque()
        for start, table in tables(rows, columns):
            pending.append((pool.apply_async(_work, (start, table)), table.nbytes))
            if len(pending) >= 2 * num_proc:
                result, nbytes = pending.popleft()
                yield result.get(), nbytes
        while pending:
            result, nbytes = pending.popleft()
            yield result.get(), nbytes


def default_num_proc() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def build(rows: Rows, tokenizer, options: Options, fmt: str, key: str, num_proc: int, show_progress: bool) -> None:
    """Tokenise in a private folder and publish it atomically under the cache, as `key`."""
    root = cache_root()
    try:
        root.mkdir(parents=True, exist_ok=True)
        remove_abandoned(root)
        work = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{socket.gethostname()}@{os.getpid()}-", dir=root))
    except OSError as exc:
        raise UserError(
            f"cannot write the data cache {root} ({exc.strerror}); set ACCUM_TRAIN_CACHE to a writable folder"
        ) from None
    try:
        os.chmod(work, 0o777 & ~umask_now())  # mkdtemp's 0700 would hide a shared cache from colleagues
        packed = stream_packed(options, fmt)  # rows packed by --packing are stored as rows
        needed = {"tokens": ["input_ids", "labels", "attention_mask"], "chat": ["messages"],
                  "prompt-completion": ["prompt", "completion"], "text": [options.text_column]}[fmt]  # fmt: skip
        columns = [c for c in needed if c in rows.columns]
        job = Job(tokenizer, options, fmt, packed, has_mask(fmt, columns, options))
        writer = Writer(work, token_dtype(options.vocab_size), packed, options.seq_len, job.with_mask)
        read = 0
        with writer, _progress(rows.num_rows, show_progress) as bar:
            for chunk, nbytes in chunks(job, rows, columns, num_proc):
                writer.add(chunk)
                read += nbytes
                if rows.num_rows is None:  # JSON, CSV, text: the total, about, from the bytes read so far
                    bar.total = max(bar.n + chunk.documents, round((bar.n + chunk.documents) * rows.nbytes / read))
                bar.update(chunk.documents)
                bar.set_postfix_str(f"{writer.n_tokens / max(bar.format_dict['elapsed'], 1e-9):,.0f} tokens/s", False)
        meta = writer.finish()
        stats = Stats(fmt, writer.documents, meta["samples"], meta["tokens"], writer.loss_tokens, packed,
                      writer.truncated, writer.longest, sum(meta["files"].values()), writer.cut_loss_tokens,
                      writer.longest_document, writer.without_eos)  # fmt: skip
        check_trainable(stats, options)
        (work / "meta.json").write_text(json.dumps(meta | {"key": key, "stats": asdict(stats)}))
        publish(work, root / key)
    except OSError as exc:
        if exc.errno not in FULL:
            raise
        raise UserError(
            f"the data cache {root} has no room for the prepared data ({exc.strerror}); "
            "free space there or set ACCUM_TRAIN_CACHE to a folder on another disk"
        ) from None
    finally:
        shutil.rmtree(work, ignore_errors=True)


def check_trainable(stats: Stats, options: Options) -> None:
    if stats.samples == 0 and stats.packed:
        raise UserError(f"the dataset holds fewer than --seq-len {options.seq_len} tokens; lower --seq-len or add data")
    if stats.loss_tokens == 0 and stats.cut_loss_tokens:
        raise UserError(
            f"no position of the dataset counts in the loss once --seq-len {options.seq_len} cuts the rows: every "
            f"counted position lies past it (the longest row holds {stats.longest_document:,} tokens); raise "
            "--seq-len, or --train-on-prompt for chat and prompt-completion data"
        )
    if stats.loss_tokens == 0:
        raise UserError(
            "no position of the dataset counts in the loss (every label is -100, or the rows are empty or one "
            "token long); give labels that count, or --train-on-prompt for chat and prompt-completion data"
        )


def _progress(rows: int | None, show: bool):
    from tqdm import tqdm

    return tqdm(total=rows, unit=" rows", desc="tokenising", delay=PROGRESS_AFTER_S, disable=not show,
                file=sys.stderr, dynamic_ncols=True)  # fmt: skip


def check_num_proc(num_proc: int | None) -> None:
    if num_proc is not None and num_proc < 1:  # checked alike on every rank, so all fail together
        raise UserError(f"--num-proc must be >= 1, got {num_proc}")


def prepare(raw, tokenizer, options: Options, is_main: bool, is_node_leader: bool, barrier: Callable[[], None],
            num_proc: int | None = None) -> tuple[Prepared, Stats, bool]:  # fmt: skip
    """Collective: `raw` prepared once and cached (see `collect`), in this process."""
    check_num_proc(num_proc)
    rows = as_rows(raw)
    fmt = check(rows, tokenizer, options)
    key = cache_key(rows, tokenizer, options, fmt)
    num_proc = num_proc or default_num_proc()

    def make(show_progress: bool) -> None:
        build(rows, tokenizer, options, fmt, key, num_proc, show_progress)

    return collect(key, make, options, is_main, is_node_leader, barrier)


def collect(key: str, make: Callable[[bool], None], options: Options, is_main: bool, is_node_leader: bool,
            barrier: Callable[[], None]) -> tuple[Prepared, Stats, bool]:  # fmt: skip
    """Collective: the prepared data of `key` from the cache, where `make(show_progress)` publishes it if
    missing. Rank 0 makes it; then on every node that does not see rank 0's cache, the first local
    rank makes it while its siblings wait. Returns (data, stats, whether this rank made it)."""
    found, made = None, False

    def made_here(show_progress: bool) -> tuple[Prepared, Stats]:
        make(show_progress)
        result = cached(key, options)
        if result is None:
            raise RuntimeError(f"the prepared data {cache_root() / key} is not in the cache after preparing it")
        return result

    if is_main:
        found = cached(key, options)
        if found is None:
            found, made = made_here(True), True
    barrier()  # rank 0's copy is published
    if not is_main:
        found = cached(key, options)
        if found is None and is_node_leader:  # this node has a disk of its own
            found, made = made_here(False), True
    barrier()  # every node leader's copy is published
    if found is None:  # a sibling of a node leader: the leader's copy, or (another cache still) our own
        found = cached(key, options)
        if found is None:
            found, made = made_here(False), True
    data, stats = found
    check_trainable(stats, options)
    return data, stats, made
