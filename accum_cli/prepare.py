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
A training run reads and prepares the rows in forked children (isolate.py, train.data_keys and
train.build_data), so its ranks never hold `datasets` and its libraries: they read the cache.
"""

from __future__ import annotations

import errno
import glob
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

from accum_cli import isolate
from accum_cli.errors import UserError, first_line
from accum_cli.sources import Rows, rows_of
from accum_cli.store import IGNORE_INDEX, Chunk, Prepared, Writer, damaged, read_meta, token_dtype

PREP_VERSION = 3  # 3: block digests in meta.json
FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # a full disk, a quota, a file-size limit
BATCH_ROWS = 1000  # rows per chunk at most
BATCH_BYTES = 4 << 20  # raw bytes per chunk, about: long documents make chunks of fewer rows
PARALLEL_ABOVE_BYTES = 16 << 20  # below this, worker processes cost more than they save
TMP_PREFIX = ".tmp-"  # + host@pid-random: a preparation in progress ("@" is in no hostname)
PROGRESS_AFTER_S = 2.0  # a progress bar only for preparations that take a while

__all__ = ["IGNORE_INDEX", "Options", "Stats", "cache_key", "check", "collect", "make_rows", "prepare"]


@dataclass(frozen=True, slots=True)
class Options:
    seq_len: int
    text_column: str = "text"
    packing: bool | None = None  # None: pack text, keep rows for the other formats
    train_on_prompt: bool = False
    vocab_size: int | None = None  # the model's: ids must lie below it; picks the storage type


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


def detect_format(columns: list[str], text_column: str) -> str:
    if "input_ids" in columns:
        return "tokens"
    if "messages" in columns:
        return "chat"
    if "prompt" in columns and "completion" in columns:
        return "prompt-completion"
    if text_column in columns:
        return "text"
    raise UserError(
        f"the dataset has no column {text_column!r} (columns: {', '.join(columns)}); pass --text-column NAME, "
        "or give input_ids, messages, or prompt and completion columns"
    )


def as_rows(raw) -> Rows:
    """sources.Rows, or a datasets.Dataset made into them."""
    return raw if isinstance(raw, Rows) else rows_of(raw)


def check(raw, tokenizer, options: Options) -> str:
    """The cheap checks, on every rank before any collective, so all ranks fail alike."""
    rows = as_rows(raw)
    if rows.num_rows == 0:
        raise UserError("the dataset is empty; pass a dataset with at least one row")
    return check_columns(rows.columns, rows.features, tokenizer, options)


def check_columns(columns: list[str], features, tokenizer, options: Options) -> str:
    """The format and what it needs, from the columns (and their types, when the schema is known)."""
    fmt = detect_format(columns, options.text_column)
    if fmt != "tokens" and tokenizer is None:
        raise UserError("the model folder has no tokenizer to tokenise text; add one or pass a dataset with input_ids")
    if fmt == "chat" and not getattr(tokenizer, "chat_template", None):
        raise UserError("the dataset has a messages column but the tokenizer has no chat template; add one")
    if features is not None:  # a stream of text files has no schema: its rows are checked as they come
        _check_column_types(features, fmt, options.text_column)
    return fmt


def _check_column_types(features, fmt: str, text_column: str) -> None:
    """Column types, from the schema alone: a text column of numbers, token ids that are strings."""
    text_columns = {"text": [text_column], "prompt-completion": ["prompt", "completion"]}.get(fmt, [])
    for name in text_columns:
        dtype = getattr(features[name], "dtype", None)
        if dtype not in ("string", "large_string"):
            raise UserError(
                f"column {name!r} holds {_type_name(features[name])}, not text; pass --text-column NAME of a text column"
            )
    if fmt == "tokens":
        for name in ("input_ids", "labels", "attention_mask"):
            if name in features:
                inner = getattr(features[name], "feature", None)
                # "null": every list is empty (refused later, as data with nothing to learn)
                if not str(getattr(inner, "dtype", "")).startswith(("int", "uint", "bool", "null")):
                    raise UserError(
                        f"column {name!r} holds {_type_name(features[name])}; it must hold lists of integer token ids"
                    )


def _type_name(feature) -> str:
    inner = getattr(feature, "feature", None)
    if inner is not None:
        return f"lists of {getattr(inner, 'dtype', type(inner).__name__)}"
    return str(getattr(feature, "dtype", type(feature).__name__))


# --- per-format row builders: a batch of raw rows -> lists of input_ids and labels ----------
# Labels None: every position counts, the labels are the ids.


class BadRow(Exception):
    """A row that cannot be trained on: its index in the batch and the problem."""

    def __init__(self, index: int, problem: str):
        super().__init__(problem)
        self.index, self.problem = index, problem


def _texts(batch, column: str) -> list[str]:
    values = batch[column]
    for i, value in enumerate(values):
        if not isinstance(value, str):
            raise BadRow(i, f"column {column!r} is {'null' if value is None else type(value).__name__}, not text")
    return values


def _tokens(batch, tokenizer, options: Options):
    ids = batch["input_ids"]
    labels = batch.get("labels")
    masks = batch.get("attention_mask")
    for i, row in enumerate(ids):
        if row is None:
            raise BadRow(i, "input_ids is null")
        for name, other in (("labels", labels), ("attention_mask", masks)):
            if other is not None and (other[i] is None or len(other[i]) != len(row)):
                size = "null" if other[i] is None else f"{len(other[i])} long"
                raise BadRow(i, f"{name} is {size} but input_ids holds {len(row)} tokens")
    if masks is not None:  # positions the data itself masks out are padding: drop them
        for i, mask in enumerate(masks):
            if not all(m in (0, 1) for m in mask):  # a null would drop its token silently
                raise BadRow(i, "attention_mask holds a value other than 0 and 1")
        ids = [[t for t, m in zip(row, mask, strict=True) if m] for row, mask in zip(ids, masks, strict=True)]
        if labels is not None:
            labels = [[t for t, m in zip(row, mask, strict=True) if m] for row, mask in zip(labels, masks, strict=True)]
    return ids, labels


def _text(batch, tokenizer, options: Options):
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    ids = tokenizer(_texts(batch, options.text_column), add_special_tokens=False)["input_ids"]
    for row in ids:  # in place: a copy per document costs as much as converting it
        row.extend(eos)
    return ids, None


def _template(tokenizer, messages, row: int, **kwargs) -> list[int]:
    try:
        out = tokenizer.apply_chat_template(messages, tokenize=True, **kwargs)
    except Exception as exc:  # the template's own raise_exception (roles must alternate, ...), jinja errors
        raise BadRow(row, f"the chat template cannot render it ({first_line(exc)})") from None
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def _turn(turn):
    """A turn as a dict. Where the turns of a file have differing keys (a `name`, tool calls),
    `datasets` types them as JSON, and Arrow hands each over as its JSON text: decoded here, as
    streaming already gives them."""
    if isinstance(turn, str):
        try:
            return json.loads(turn)
        except ValueError:
            return turn  # plain text, not a turn: refused below
    return turn


def _chat(batch, tokenizer, options: Options):
    all_ids, all_labels = [], []
    for row, messages in enumerate(batch["messages"]):
        if isinstance(messages, list):
            messages = [_turn(m) for m in messages]
        if not isinstance(messages, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages
        ):
            raise BadRow(row, "messages is not a list of turns, each with a role")
        if not messages:
            raise BadRow(row, "messages is empty: a conversation needs at least one turn")
        ids = _template(tokenizer, messages, row)
        if options.train_on_prompt:
            labels = list(ids)
        else:
            # The tokens an assistant turn adds: the conversation up to and including it, minus
            # the conversation before it with the generation prompt (so the header is not counted).
            labels = [IGNORE_INDEX] * len(ids)
            for i, message in enumerate(messages):
                if message["role"] != "assistant":
                    continue
                start = len(_template(tokenizer, messages[:i], row, add_generation_prompt=True)) if i else 0
                end = len(_template(tokenizer, messages[: i + 1], row))
                if _template(tokenizer, messages[: i + 1], row) != ids[:end]:
                    raise UserError(
                        "the chat template does not render conversations prefix by prefix; use --train-on-prompt"
                    )
                labels[start:end] = ids[start:end]
        all_ids.append(ids)
        all_labels.append(labels)
    return all_ids, all_labels


def _prompt_completion(batch, tokenizer, options: Options):
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    prompts = tokenizer(_texts(batch, "prompt"), add_special_tokens=False)["input_ids"]
    completions = tokenizer(_texts(batch, "completion"), add_special_tokens=False)["input_ids"]
    ids, labels = [], []
    for p, c in zip(prompts, completions, strict=True):
        ids.append(p + c + eos)
        labels.append(p + c + eos if options.train_on_prompt else [IGNORE_INDEX] * len(p) + c + eos)
    return ids, labels


BUILDERS = {"tokens": _tokens, "text": _text, "chat": _chat, "prompt-completion": _prompt_completion}


def row_error(row: int, problem: str, fix: str = "fix or remove that row") -> UserError:
    """The one-line refusal of a dataset row, by its index in the dataset."""
    return UserError(f"row {row} of the dataset (counting from 0): {problem}; {fix}")


def make_rows(batch, tokenizer, options: Options, fmt: str, packed: bool, first_row: int = 0):
    """Raw rows -> token ids and labels per row, truncated to seq_len unless they will be packed."""
    try:
        ids, labels = BUILDERS[fmt](batch, tokenizer, options)
    except BadRow as exc:
        raise row_error(first_row + exc.index, exc.problem) from None
    labels = ids if labels is None else labels
    truncated = [False] * len(ids)
    if not packed and (fmt != "tokens" or options.packing is False):
        truncated = [len(row) > options.seq_len for row in ids]
        ids = [row[: options.seq_len] for row in ids]
        labels = [row[: options.seq_len] for row in labels]
    return {"input_ids": ids, "labels": labels, "truncated": truncated}


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
                 loss_tokens)  # fmt: skip


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


# --- the cache -------------------------------------------------------------------------------


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
        os.chmod(work, 0o777 & ~_umask())  # mkdtemp's 0700 would hide a shared cache from colleagues
        packed = options.packing if options.packing is not None else fmt == "text"
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
                      writer.truncated, writer.longest, sum(meta["files"].values()))  # fmt: skip
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
    if stats.loss_tokens == 0:
        raise UserError(
            "no position of the dataset counts in the loss (every label is -100, or the rows are empty or one "
            "token long); give labels that count, or --train-on-prompt for chat and prompt-completion data"
        )


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


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


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
        result = cached(key)
        if result is None:
            raise RuntimeError(f"the prepared data {cache_root() / key} is not in the cache after preparing it")
        return result

    if is_main:
        found = cached(key)
        if found is None:
            found, made = made_here(True), True
    barrier()  # rank 0's copy is published
    if not is_main:
        found = cached(key)
        if found is None and is_node_leader:  # this node has a disk of its own
            found, made = made_here(False), True
    barrier()  # every node leader's copy is published
    if found is None:  # a sibling of a node leader: the leader's copy, or (another cache still) our own
        found = cached(key)
        if found is None:
            found, made = made_here(False), True
    data, stats = found
    check_trainable(stats, options)
    return data, stats, made
