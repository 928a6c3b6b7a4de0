"""--packing of chat, prompt-completion and pre-tokenised rows: whole rows bin-packed into --seq-len sequences.

The rows stay stored one per row (store.py); here each row is placed whole into a sequence of at most
--seq-len tokens by a deterministic, seeded best-fit-decreasing packing (a row longer than --seq-len, which
only pre-tokenised rows can be, gets a sequence of its own). Each row keeps its own position ids, starting at
0, so the model's attention (transformers' masks built from position ids) never crosses a row boundary, and
each row's first label is -100: it would be predicted from the previous row's last token, and unpacked it
predicts nothing. The packed step thus trains exactly the loss of the same rows unpacked.
"""

from __future__ import annotations

import bisect

import numpy as np

from accum_cli.data.store import IGNORE_INDEX, Prepared


def row_lengths(rows: Prepared) -> np.ndarray:
    """Tokens of each of the rows (a view's selected rows, in its order)."""
    lengths = np.diff(np.asarray(rows.offsets, dtype=np.int64))
    return lengths[rows.index] if rows.index is not None else lengths


def pack(lengths: np.ndarray, seq_len: int, seed: int) -> list[np.ndarray]:
    """Row indices per sequence: best fit, longest rows first, ties in a seeded order. Deterministic for
    (lengths, seq_len, seed); within a sequence the rows keep their placing order."""
    order = np.random.default_rng([seed, 0xB1]).permutation(len(lengths))
    order = order[np.argsort(-lengths[order], kind="stable")]
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (room left, bin), sorted: the tightest bin that fits is found by bisection
    for row in order.tolist():
        need = int(lengths[row])
        at = bisect.bisect_left(free, (need, -1))
        if at == len(free):  # no room anywhere (a row over seq_len never fits)
            bins.append([row])
            if seq_len - need > 0:
                bisect.insort(free, (seq_len - need, len(bins) - 1))
            continue
        room, b = free.pop(at)
        bins[b].append(row)
        if room - need > 0:
            bisect.insort(free, (room - need, b))
    return [np.asarray(b, dtype=np.int64) for b in bins]


class PackedRows:
    """Prepared rows seen as packed sequences: sample i is the rows of bin i, back to back, with their
    position ids. Same reading interface as Prepared (len, rows)."""

    def __init__(self, rows: Prepared, seq_len: int, seed: int):
        self.source, self.seq_len = rows, seq_len
        self.lengths = row_lengths(rows)
        self.bins = pack(self.lengths, seq_len, seed)

    def __len__(self) -> int:
        return len(self.bins)

    @property
    def n_rows(self) -> int:
        return len(self.lengths)

    def sequence_lengths(self) -> np.ndarray:
        return np.fromiter((int(self.lengths[b].sum()) for b in self.bins), np.int64, len(self.bins))

    def sample(self, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(input_ids, labels, position_ids) of packed sequence i."""
        parts = [self.source.sample(int(row)) for row in self.bins[i]]
        ids = np.concatenate([p[0] for p in parts])
        labels = np.concatenate([p[1] for p in parts])
        starts = np.cumsum([0] + [len(p[0]) for p in parts[:-1]])
        labels[starts] = IGNORE_INDEX  # a row's first token is predicted from another row: never counts
        positions = np.concatenate([np.arange(len(p[0]), dtype=np.int64) for p in parts])
        return ids, labels, positions

    def rows(self, indices) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        return [self.sample(int(i)) for i in indices]


def real_share(lengths: np.ndarray, micro_batch: int) -> float:
    """Real tokens per position computed when samples of these lengths, in this order, are read `micro_batch`
    at a time, each microbatch padded to its longest sample."""
    groups = np.zeros(-(-len(lengths) // micro_batch) * micro_batch, np.int64)
    groups[: len(lengths)] = lengths
    groups = groups.reshape(-1, micro_batch)
    positions = int(((groups > 0).sum(1) * groups.max(1)).sum())
    return float(groups.sum()) / max(positions, 1)


class DocumentMasked:
    """--document-masking: packed text blocks whose position ids start again at 0 after each EOS, so that each
    document attends within itself only (the same masks as packed rows). The labels stay the block's."""

    def __init__(self, blocks: Prepared, eos: int):
        self.source, self.eos = blocks, eos

    def __len__(self) -> int:
        return len(self.source)

    def sample(self, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        ids, labels = self.source.sample(i)
        return ids, labels, document_positions(ids, self.eos)

    def rows(self, indices) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        return [self.sample(int(i)) for i in indices]


def document_positions(ids: np.ndarray, eos: int) -> np.ndarray:
    """Position ids that start at 0 at the block's start and after each EOS."""
    at = np.arange(len(ids), dtype=np.int64)
    starts = np.zeros(len(ids), dtype=bool)
    starts[:1] = True
    starts[1:] = ids[:-1] == eos
    return at - np.maximum.accumulate(np.where(starts, at, 0))
