"""The run's data: cache keys and preparation in a child process (the trainer never imports
`datasets`), the evaluation split, the stream's position on a resume, and the padding id."""

from __future__ import annotations

import hashlib
import json
import time

import numpy as np

from accum_cli.config.settings import TrainConfig
from accum_cli.data import cache, formats, prepare, sources, stream
from accum_cli.errors import UserError
from accum_cli.rundir import checkpoint_meta


def epoch_steps(samples: int, global_batch: int, meta: checkpoint_meta.Meta | None) -> int:
    """--epochs as optimizer steps: `samples` in steps of the global batch. Resumed at another
    global batch, the steps done count as they were and what is left of the samples is split
    into steps of the new one: the run trains on the same samples, no more and no fewer."""
    if meta is None or meta.global_batch == global_batch:
        return max(1, samples // global_batch)
    return meta.step + max(0, samples - meta.samples) // global_batch


def check_stream(
    reader: stream.StreamReader, meta: checkpoint_meta.Meta | None, global_batch: int, seq_len: int
) -> float | None:
    """The stream holds the run's first step. A resume reads the stream again up to the checkpoint's
    position (the exact way back, see stream.py); returns the seconds that took (None: a fresh start)."""
    first = meta.samples if meta is not None else 0
    started = time.perf_counter()
    if reader.has_step(first, global_batch):
        return time.perf_counter() - started if meta is not None else None
    if meta is None:
        raise UserError(
            f"the stream holds fewer than one global batch of {global_batch} sequences of up to {seq_len} tokens; "
            "lower --global-batch or --seq-len, or add data"
        )
    raise StreamEnded(
        f"--resume {meta.path}: the stream ends before sample {first + global_batch:,}, so no step is left after "
        "the checkpoint's; the run is complete"
    )


class StreamEnded(UserError):
    """A resume whose stream holds no step after the checkpoint's: the run ended with its stream."""


def _raw(cfg: TrainConfig, evaluation: bool):
    if evaluation:
        return sources.load_raw(cfg.eval_dataset, flag="--eval-dataset")
    return sources.load_raw(cfg.dataset, cfg.dataset_config, cfg.split, cfg.trust_remote_code)


def data_keys(cfg: TrainConfig, tokenizer, options: formats.Options,
              packing_refusal: str | None = None) -> tuple[str, str | None]:  # fmt: skip
    """The cheap checks of the training (and evaluation) data and their cache keys: every rank, before
    any collective, so all fail alike. Run in a child (isolate.py): it reads the rows with datasets.
    `packing_refusal`: the one line refusing --packing of rows or --document-masking (model.positions)."""
    keys = []
    for evaluation in (False, True) if cfg.eval_dataset else (False,):
        rows = formats.as_rows(_raw(cfg, evaluation))
        fmt = formats.check(rows, tokenizer, options)
        if cfg.document_masking and not evaluation and not formats.stream_packed(options, fmt):
            raise UserError(f"--document-masking applies to packed text; the dataset holds {fmt} rows")
        if cfg.document_masking and getattr(tokenizer, "eos_token_id", None) is None:
            raise UserError("--document-masking finds documents by their EOS, and the tokenizer has none")
        masked = formats.rows_packed(options, fmt) or cfg.document_masking
        if packing_refusal and not evaluation and masked:
            raise UserError(packing_refusal)
        keys.append(cache.cache_key(rows, tokenizer, options, fmt))
    return keys[0], (keys[1] if len(keys) > 1 else None)


def build_data(cfg: TrainConfig, tokenizer, options: formats.Options, key: str, evaluation: bool,
               show_progress: bool) -> None:  # fmt: skip
    """Tokenise the rows into the cache as `key` (the key data_keys found). Run in a child, as data_keys."""
    rows = formats.as_rows(_raw(cfg, evaluation))
    fmt = formats.check(rows, tokenizer, options)
    prepare.build(rows, tokenizer, options, fmt, key, cfg.num_proc or prepare.default_num_proc(), show_progress)


def data_identity(prepared_key: str, cfg: TrainConfig) -> str:
    """The prepared data and everything that decides its order and split."""
    text = json.dumps([prepared_key, cfg.seed, cfg.eval_split_ratio])
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def split_for_eval(dataset, ratio: float, seed: int):
    """Hold out a seeded share of the prepared sequences; at least one of each side."""
    n = len(dataset)
    if n < 2:
        raise UserError(
            f"--eval-split-ratio needs at least 2 sequences to hold one out, and the dataset makes {n} of"
            " --seq-len tokens; use a larger dataset or a shorter --seq-len, or pass --eval-dataset"
        )
    held = min(max(1, round(n * ratio)), n - 1)
    order = np.random.default_rng([seed, 0x5EED]).permutation(n)
    return dataset.select(np.sort(order[held:])), dataset.select(np.sort(order[:held]))


def pad_id_of(tokenizer, model_config) -> int:
    """The id padding positions hold. They are masked out of attention and loss, so any id the
    embedding has pads them alike; one outside it (an old Llama config's -1, a pad token added to
    the tokenizer without resizing the embeddings) would crash the lookup, so 0 stands in."""
    vocab = getattr(model_config, "vocab_size", None)
    for candidate in (getattr(tokenizer, "pad_token_id", None), getattr(model_config, "pad_token_id", None)):
        if isinstance(candidate, int) and candidate >= 0 and (not isinstance(vocab, int) or candidate < vocab):
            return candidate
    return 0
