"""Datasets -> token sequences -> the deterministic global sample order -> microbatches.

Every prepared dataset is a `datasets.Dataset` with an `input_ids` column (and optionally
`labels`, -100 where a position does not count). Plain text is tokenised and packed into
blocks of `seq_len` tokens, documents joined by EOS. Pre-tokenised rows are used as given.

The order of samples depends only on the seed and the data, never on the world size:
global sample i is row `permutation(seed, epoch)[i mod N]` of epoch `i div N`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from accum_cli.errors import UserError

IGNORE_INDEX = -100
FILE_BUILDERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
EMBEDDED = "embedded"


def embedded_documents() -> list[str]:
    """~465 KB of real English: the help topics every CPython ships (no download)."""
    from pydoc_data.topics import topics

    return [topics[key] for key in sorted(topics)]


def load_raw(dataset: str | None, trust_remote_code: bool = False):
    """The dataset as the user gave it: embedded corpus, local file(s), or a hub id."""
    import datasets

    datasets.disable_progress_bars()
    if dataset is None:
        return datasets.Dataset.from_dict({"text": embedded_documents()})
    path = Path(dataset).expanduser()
    if path.exists():
        files = _data_files(path)
        builder = FILE_BUILDERS[files[0].suffix]
        kwargs = {"sample_by": "paragraph"} if builder == "text" else {}
        try:
            return datasets.load_dataset(builder, data_files=[str(f) for f in files], split="train", **kwargs)
        except Exception as exc:  # a malformed file: name it, do not dump the parser's stack
            raise UserError(f"--dataset {dataset}: cannot read it as {builder}: {_first_line(exc)}") from None
    if dataset.startswith((".", "/", "~")):
        raise UserError(f"--dataset {dataset} does not exist; pass an existing file, folder or hub id")
    try:
        return datasets.load_dataset(dataset, split="train", trust_remote_code=trust_remote_code)
    except Exception as exc:
        raise UserError(
            f"--dataset {dataset} is neither a local path nor a loadable hub dataset: {_first_line(exc)}"
        ) from None


def _data_files(path: Path) -> list[Path]:
    if path.is_file():
        if path.suffix not in FILE_BUILDERS:
            raise UserError(
                f"--dataset {path}: unsupported file type {path.suffix!r}; use one of {', '.join(FILE_BUILDERS)}"
            )
        return [path]
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in FILE_BUILDERS)
    if not files:
        raise UserError(f"--dataset {path} holds no {', '.join(FILE_BUILDERS)} files")
    kinds = {FILE_BUILDERS[f.suffix] for f in files}
    if len(kinds) > 1:
        raise UserError(f"--dataset {path} mixes file kinds ({', '.join(sorted(kinds))}); keep one kind per folder")
    return files


def is_pretokenised(raw) -> bool:
    return "input_ids" in raw.column_names


def check_raw(raw, tokenizer, text_column: str) -> None:
    """The cheap checks, run on every rank before any collective, so all ranks fail alike."""
    if len(raw) == 0:
        raise UserError("the dataset is empty; pass a dataset with at least one row")
    if is_pretokenised(raw):
        return
    if text_column not in raw.column_names:
        raise UserError(
            f"the dataset has no column {text_column!r} (columns: {', '.join(raw.column_names)}); "
            "pass --text-column NAME"
        )
    if tokenizer is None:
        raise UserError("the model folder has no tokenizer to tokenise text; add one or pass a dataset with input_ids")


def prepare(raw, tokenizer, seq_len: int, text_column: str):
    """Tokenise and pack plain text; pass pre-tokenised rows through unchanged."""
    check_raw(raw, tokenizer, text_column)
    if is_pretokenised(raw):
        return raw.select_columns([c for c in ("input_ids", "labels") if c in raw.column_names])
    eos = tokenizer.eos_token_id

    def pack(batch):
        ids = tokenizer(batch[text_column], add_special_tokens=False)["input_ids"]
        stream = [t for doc in ids for t in ([*doc, eos] if eos is not None else doc)]
        n_blocks = len(stream) // seq_len
        return {"input_ids": [stream[i * seq_len : (i + 1) * seq_len] for i in range(n_blocks)]}

    packed = raw.map(pack, batched=True, batch_size=1000, remove_columns=raw.column_names)
    if len(packed) == 0:
        raise UserError(f"the dataset holds fewer than --seq-len {seq_len} tokens; lower --seq-len or add data")
    return packed


class SampleOrder:
    """Maps global sample indices to dataset rows: a fresh seeded shuffle each epoch."""

    def __init__(self, n_rows: int, seed: int):
        self.n_rows = n_rows
        self.seed = seed
        self._cache: dict[int, np.ndarray] = {}

    def permutation(self, epoch: int) -> np.ndarray:
        if epoch not in self._cache:
            if len(self._cache) > 2:
                self._cache.pop(min(self._cache))
            self._cache[epoch] = np.random.default_rng([self.seed, epoch]).permutation(self.n_rows)
        return self._cache[epoch]

    def rows(self, indices: range) -> list[int]:
        return [int(self.permutation(i // self.n_rows)[i % self.n_rows]) for i in indices]


@dataclass(slots=True)
class Microbatch:
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    labels: torch.Tensor

    @property
    def loss_tokens(self) -> int:
        """Positions that count after the one-token shift (the first token predicts nothing)."""
        return int((self.labels[:, 1:] != IGNORE_INDEX).sum())

    @property
    def tokens(self) -> int:
        return int(self.attention_mask.sum())

    def to(self, device: torch.device) -> Microbatch:
        return Microbatch(
            *(t.to(device, non_blocking=True) for t in (self.input_ids, self.attention_mask, self.labels))
        )


def collate(rows: dict[str, list], pad_id: int) -> Microbatch:
    """Right-pad rows to the longest; padding is masked out of attention and of the loss."""
    ids = rows["input_ids"]
    labels = rows.get("labels") or ids
    width = max(len(r) for r in ids)
    input_ids = torch.full((len(ids), width), pad_id, dtype=torch.long)
    target = torch.full((len(ids), width), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(ids), width), dtype=torch.long)
    for i, (row, row_labels) in enumerate(zip(ids, labels, strict=True)):
        input_ids[i, : len(row)] = torch.tensor(row)
        target[i, : len(row)] = torch.tensor(row_labels)
        mask[i, : len(row)] = 1
    return Microbatch(input_ids, mask, target)


def empty_microbatch(pad_id: int) -> Microbatch:
    """One pad token that counts nowhere: an empty microbatch still joins FSDP's collectives."""
    one = torch.full((1, 1), pad_id, dtype=torch.long)
    return Microbatch(one, torch.ones_like(one), torch.full_like(one, IGNORE_INDEX))


class MicrobatchReader:
    """Reads the microbatches of a plan from a prepared dataset in the global order."""

    def __init__(self, dataset, order: SampleOrder, pad_id: int):
        self.dataset = dataset
        self.order = order
        self.pad_id = pad_id

    def read(self, indices: range) -> Microbatch:
        if len(indices) == 0:
            return empty_microbatch(self.pad_id)
        return collate(self.dataset[self.order.rows(indices)], self.pad_id)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
