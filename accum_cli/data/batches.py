"""Prepared sequences -> the deterministic global sample order -> microbatches.

The order of samples depends only on the seed and the data, never on the world size:
global sample i is row `permutation(seed, epoch)[i mod N]` of epoch `i div N`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from accum_cli.data.packing import PackedRows
from accum_cli.data.store import IGNORE_INDEX, Prepared


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
    empty: bool = False  # a placeholder that holds no sample (see empty_microbatch)
    position_ids: torch.Tensor | None = None  # packed rows (packing.py): each row's positions from 0

    @property
    def loss_tokens(self) -> int:
        """Positions that count after the one-token shift (the first token predicts nothing)."""
        return int((self.labels[:, 1:] != IGNORE_INDEX).sum())

    @property
    def tokens(self) -> int:
        """Unpadded tokens; none in a placeholder."""
        return 0 if self.empty else int(self.attention_mask.sum())

    @property
    def positions(self) -> int:
        """Positions the forward computes, padding included; none in a placeholder."""
        return 0 if self.empty else int(self.input_ids.numel())

    @property
    def rows(self) -> int:
        """Rows (documents) held: packed rows count one per run of real positions from 0, else one per
        sequence; none in a placeholder."""
        if self.empty:
            return 0
        if self.position_ids is None:
            return int(self.input_ids.shape[0])
        return int(((self.position_ids == 0) & (self.attention_mask == 1)).sum())

    def to(self, device: torch.device) -> Microbatch:
        positions = None if self.position_ids is None else self.position_ids.to(device, non_blocking=True)
        return Microbatch(
            *(t.to(device, non_blocking=True) for t in (self.input_ids, self.attention_mask, self.labels)),
            empty=self.empty,
            position_ids=positions,
        )

    def model_inputs(self) -> dict[str, torch.Tensor]:
        """The model's inputs. Packed rows give position ids and no attention mask: transformers then masks
        attention block-diagonally, one block per run of positions counting up from 0 (padding is a run of
        its own, and counts nowhere)."""
        if self.position_ids is not None:
            return {"input_ids": self.input_ids, "position_ids": self.position_ids}
        return {"input_ids": self.input_ids, "attention_mask": self.attention_mask}


def collate(rows: list[tuple[np.ndarray, ...]], pad_id: int) -> Microbatch:
    """Right-pad (input_ids, labels) rows to the longest; padding is masked out of attention and of the loss.
    Packed rows (input_ids, labels, position_ids) carry position ids; their padding's count up from 0."""
    width = max(len(row[0]) for row in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    target = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    packed = len(rows[0]) == 3
    positions = torch.arange(width).repeat(len(rows), 1) if packed else None
    for i, (ids, labels, *rest) in enumerate(rows):
        input_ids[i, : len(ids)] = torch.from_numpy(ids)
        target[i, : len(ids)] = torch.from_numpy(labels)
        mask[i, : len(ids)] = 1
        if packed:
            positions[i, : len(ids)] = torch.from_numpy(rest[0])
            positions[i, len(ids) :] = torch.arange(width - len(ids))
    return Microbatch(input_ids, mask, target, position_ids=positions)


def empty_microbatch(pad_id: int) -> Microbatch:
    """One pad token that counts nowhere: an empty microbatch still joins FSDP's collectives."""
    one = torch.full((1, 1), pad_id, dtype=torch.long)
    return Microbatch(one, torch.ones_like(one), torch.full_like(one, IGNORE_INDEX), empty=True)


class MicrobatchReader:
    """Reads microbatches from prepared data: by global sample index in the seeded order, or by
    row index when there is no order (evaluation). Each read slices the memory-mapped files for
    just these samples: O(micro batch), whatever the corpus size."""

    def __init__(self, dataset: Prepared | PackedRows, order: SampleOrder | None, pad_id: int):
        self.dataset = dataset
        self.order = order
        self.pad_id = pad_id

    def read(self, indices: range) -> Microbatch:
        if len(indices) == 0:
            return empty_microbatch(self.pad_id)
        rows = self.order.rows(indices) if self.order is not None else list(indices)
        return collate(self.dataset.rows(rows), self.pad_id)
