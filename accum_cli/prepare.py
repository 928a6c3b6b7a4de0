"""Rows -> training sequences, once: tokenised, labelled, packed or not, cached on disk.

Formats, told apart by their columns (first match wins):
- tokens: `input_ids` (optionally `labels` with -100 where a position does not count, and
  `attention_mask`), used as given;
- chat: `messages` (role/content turns) rendered with the tokenizer's chat template; the loss
  counts the assistant turns only, unless train_on_prompt;
- prompt-completion: `prompt` and `completion` columns; the loss counts the completion only,
  unless train_on_prompt;
- text: the text column, documents joined by EOS.

Packing (documents concatenated and cut into seq_len blocks) is the default for text;
one document per row, truncated to seq_len and padded per microbatch, for the others.

The result is saved under the datasets cache keyed by the raw data's fingerprint, the
tokenizer and every option, so a second run, or a second rank, reads it instead of
tokenising again. Rank 0 prepares first; the others then find it in the cache.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from accum_cli.errors import UserError

IGNORE_INDEX = -100
PREP_VERSION = 1
BATCH_ROWS = 1000
PARALLEL_ABOVE_ROWS = 20_000  # below this, worker processes cost more than they save


@dataclass(frozen=True, slots=True)
class Options:
    seq_len: int
    text_column: str = "text"
    packing: bool | None = None  # None: pack text, keep rows for the other formats
    train_on_prompt: bool = False


@dataclass(frozen=True, slots=True)
class Stats:
    format: str
    documents: int
    samples: int
    tokens: int
    loss_tokens: int
    packed: bool
    truncated: int  # documents cut at seq_len

    def describe(self, global_batch: int) -> list[str]:
        steps = self.samples // global_batch
        lines = [
            f"format            {self.format}, {'packed into blocks' if self.packed else 'one document per row'}",
            f"documents         {self.documents:,}",
            f"tokens            {self.tokens:,} ({self.loss_tokens:,} count in the loss)",
            f"samples           {self.samples:,}; one epoch = {steps:,} optimizer steps of {global_batch}",
        ]
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


def check(raw, tokenizer, options: Options) -> str:
    """The cheap checks, on every rank before any collective, so all ranks fail alike."""
    if len(raw) == 0:
        raise UserError("the dataset is empty; pass a dataset with at least one row")
    fmt = detect_format(raw.column_names, options.text_column)
    if fmt != "tokens" and tokenizer is None:
        raise UserError("the model folder has no tokenizer to tokenise text; add one or pass a dataset with input_ids")
    if fmt == "chat" and not getattr(tokenizer, "chat_template", None):
        raise UserError("the dataset has a messages column but the tokenizer has no chat template; add one")
    return fmt


# --- per-format row builders: a batch of raw rows -> lists of input_ids and labels ----------


def _tokens(batch, tokenizer, options: Options):
    ids = batch["input_ids"]
    labels = batch.get("labels", ids)
    if "attention_mask" in batch:  # positions the data itself masks out are padding: drop them
        masks = batch["attention_mask"]
        ids = [[t for t, m in zip(row, mask, strict=True) if m] for row, mask in zip(ids, masks, strict=True)]
        labels = [[t for t, m in zip(row, mask, strict=True) if m] for row, mask in zip(labels, masks, strict=True)]
    return [list(row) for row in ids], [list(row) for row in labels]


def _text(batch, tokenizer, options: Options):
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    ids = [row + eos for row in tokenizer(batch[options.text_column], add_special_tokens=False)["input_ids"]]
    return ids, [list(row) for row in ids]


def _template(tokenizer, messages, **kwargs) -> list[int]:
    out = tokenizer.apply_chat_template(messages, tokenize=True, **kwargs)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def _chat(batch, tokenizer, options: Options):
    all_ids, all_labels = [], []
    for messages in batch["messages"]:
        ids = _template(tokenizer, messages)
        if options.train_on_prompt:
            labels = list(ids)
        else:
            # The tokens an assistant turn adds: the conversation up to and including it, minus
            # the conversation before it with the generation prompt (so the header is not counted).
            labels = [IGNORE_INDEX] * len(ids)
            for i, message in enumerate(messages):
                if message["role"] != "assistant":
                    continue
                start = len(_template(tokenizer, messages[:i], add_generation_prompt=True)) if i else 0
                end = len(_template(tokenizer, messages[: i + 1]))
                if _template(tokenizer, messages[: i + 1]) != ids[:end]:
                    raise UserError(
                        "the chat template does not render conversations prefix by prefix; use --train-on-prompt"
                    )
                labels[start:end] = ids[start:end]
        all_ids.append(ids)
        all_labels.append(labels)
    return all_ids, all_labels


def _prompt_completion(batch, tokenizer, options: Options):
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    prompts = tokenizer(batch["prompt"], add_special_tokens=False)["input_ids"]
    completions = tokenizer(batch["completion"], add_special_tokens=False)["input_ids"]
    ids, labels = [], []
    for p, c in zip(prompts, completions, strict=True):
        ids.append(p + c + eos)
        labels.append(p + c + eos if options.train_on_prompt else [IGNORE_INDEX] * len(p) + c + eos)
    return ids, labels


BUILDERS = {"tokens": _tokens, "text": _text, "chat": _chat, "prompt-completion": _prompt_completion}


def _pack(ids: list[list[int]], labels: list[list[int]], seq_len: int):
    stream = [t for row in ids for t in row]
    label_stream = [t for row in labels for t in row]
    n = len(stream) // seq_len
    return (
        [stream[i * seq_len : (i + 1) * seq_len] for i in range(n)],
        [label_stream[i * seq_len : (i + 1) * seq_len] for i in range(n)],
    )


def _loss_count(labels: list[int]) -> int:
    return sum(1 for t in labels[1:] if t != IGNORE_INDEX)


def make_rows(batch, tokenizer, options: Options, fmt: str, packed: bool):
    """One batched map step: raw rows -> sequences with their token and loss-token counts."""
    ids, labels = BUILDERS[fmt](batch, tokenizer, options)
    truncated = [False] * len(ids)
    if packed:
        ids, labels = _pack(ids, labels, options.seq_len)
        truncated = [False] * len(ids)
    elif fmt != "tokens" or options.packing is False:
        truncated = [len(row) > options.seq_len for row in ids]
        ids = [row[: options.seq_len] for row in ids]
        labels = [row[: options.seq_len] for row in labels]
    return {"input_ids": ids, "labels": labels, "n_tokens": [len(r) for r in ids],
            "n_loss": [_loss_count(r) for r in labels], "truncated": truncated}  # fmt: skip


def cache_root() -> Path:
    import datasets

    return Path(os.environ.get("ACCUM_TRAIN_CACHE", Path(datasets.config.HF_DATASETS_CACHE) / "accum-train"))


def cache_key(raw, tokenizer, options: Options, fmt: str) -> str:
    from datasets.fingerprint import Hasher

    return Hasher.hash([PREP_VERSION, raw._fingerprint, fmt, asdict(options), tokenizer if fmt != "tokens" else None])


def cached(key: str):
    """The prepared dataset and its stats, if a complete one is in the cache."""
    import datasets

    folder = cache_root() / key
    if not (folder / "stats.json").is_file():
        return None
    return datasets.load_from_disk(str(folder / "data")), Stats(**json.loads((folder / "stats.json").read_text()))


def build(raw, tokenizer, options: Options, fmt: str, key: str, show_progress: bool):
    """Tokenise (with worker processes on big data), save atomically, return (dataset, stats)."""
    import datasets

    packed = options.packing if options.packing is not None else fmt == "text"
    num_proc = min(os.cpu_count() or 1, 8) if len(raw) > PARALLEL_ABOVE_ROWS else None
    if show_progress and len(raw) > PARALLEL_ABOVE_ROWS:
        datasets.enable_progress_bars()
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".tmp-{key}-", dir=root))
    try:
        prepared = raw.map(
            make_rows,
            fn_kwargs={"tokenizer": tokenizer, "options": options, "fmt": fmt, "packed": packed},
            batched=True,
            batch_size=BATCH_ROWS,
            remove_columns=raw.column_names,
            num_proc=num_proc,
            cache_file_name=str(work / "map.arrow"),
            desc="tokenising",
        )
        if len(prepared) == 0:
            raise UserError(
                f"the dataset holds fewer than --seq-len {options.seq_len} tokens; lower --seq-len or add data"
            )
        counts = {name: np.asarray(prepared[name]) for name in ("n_tokens", "n_loss", "truncated")}
        stats = Stats(
            format=fmt,
            documents=len(raw),
            samples=len(prepared),
            tokens=int(counts["n_tokens"].sum()),
            loss_tokens=int(counts["n_loss"].sum()),
            packed=packed,
            truncated=int(counts["truncated"].sum()),
        )
        if stats.samples == 0:
            raise UserError(
                f"the dataset holds fewer than --seq-len {options.seq_len} tokens; lower --seq-len or add data"
            )
        prepared.select_columns(["input_ids", "labels", "n_tokens", "n_loss"]).save_to_disk(str(work / "data"))
        (work / "stats.json").write_text(json.dumps(asdict(stats)))
        (work / "map.arrow").unlink(missing_ok=True)
        final = root / key
        if not final.exists():
            work.rename(final)
    finally:
        datasets.disable_progress_bars()
        shutil.rmtree(work, ignore_errors=True)
    return cached(key)


def prepare(raw, tokenizer, options: Options, is_main: bool, barrier) -> tuple[object, Stats, bool]:
    """Collective: rank 0 tokenises, then the others read its result. Returns (dataset, stats,
    whether this rank tokenised)."""
    fmt = check(raw, tokenizer, options)
    key = cache_key(raw, tokenizer, options, fmt)
    if not is_main:
        barrier()
    found = cached(key)
    tokenised = found is None
    if tokenised:  # rank 0 on a fresh cache, or a node that does not share rank 0's disk
        found = build(raw, tokenizer, options, fmt, key, show_progress=is_main)
    if is_main:
        barrier()
    dataset, stats = found
    return dataset, stats, tokenised
