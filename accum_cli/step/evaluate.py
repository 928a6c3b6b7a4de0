"""Evaluation: the token-weighted loss over a whole eval set, across ranks.

Each rank takes a contiguous slice of the eval rows (sizes differ by at most one) and every
rank runs the same number of forward passes, padding with empty ones, because FSDP's
all-gathers must match. The loss is sum(token losses) / (loss tokens), both all-reduced:
the same number whatever the world size or micro batch.
"""

from __future__ import annotations

import torch
from torch import nn

from accum_cli.cpu import attention as cpu_attention
from accum_cli.data.batches import MicrobatchReader
from accum_cli.loss.tokens import token_loss_sum
from accum_cli.parallel.runtime import all_reduce_sum


def rank_rows(n_rows: int, rank: int, world_size: int) -> range:
    base, extra = divmod(n_rows, world_size)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (1 if rank < extra else 0))


@torch.no_grad()
def eval_loss(model: nn.Module, reader: MicrobatchReader, rank: int, world_size: int, micro_batch: int,
              device: torch.device) -> tuple[float, int]:  # fmt: skip
    """Collective. Returns (token-weighted mean loss, global loss tokens)."""
    n_rows = len(reader.dataset)
    mine = rank_rows(n_rows, rank, world_size)
    passes = -(-(n_rows // world_size + (1 if n_rows % world_size else 0)) // micro_batch)
    totals = torch.zeros(2, dtype=torch.float64, device=device)
    was_training = model.training
    model.eval()
    for j in range(passes):
        mb = reader.read(mine[j * micro_batch : (j + 1) * micro_batch]).to(device)
        with cpu_attention.rows_apart(mb.position_ids if device.type == "cpu" else None):  # cpu/attention.py
            logits = model(**mb.model_inputs(), use_cache=False).logits
        totals[0] += token_loss_sum(logits, mb.labels).double()
        totals[1] += mb.loss_tokens
    model.train(was_training)
    loss_sum, tokens = all_reduce_sum(totals).tolist()
    return (loss_sum / tokens if tokens else float("nan")), int(tokens)
