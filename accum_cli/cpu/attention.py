"""Attention of packed rows one row at a time, on a CPU: the masked blocks of a packed sequence never computed.

Packed rows (data/packing.py) and --document-masking give the model position ids that start again at 0 for each
row, and transformers then attends with sdpa under a block-diagonal mask: the whole seq-len x seq-len square is
computed and the blocks across rows thrown away. On a CPU (which has no variable-length flash attention), at seq
2048 in a small model, that made a packed sequence's forward and backward slower than the same rows padded
(docs/BENCHMARKS.md). Here, while a packed microbatch's forward runs, the model's sdpa attention runs causal sdpa
on each row's span of each sequence instead: what the block-diagonal mask computes, without the masked blocks,
and causal without a mask (the kernel skips the upper triangle).

Only where it computes the same: a layer with a sliding window, an additive position bias or sinks, attention
that is not causal, or a cache keeps transformers' own sdpa. The spans are read once per microbatch from its
position ids (a row starts where a position is 0). Installed by the training step for a CPU device only.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

SDPA = "sdpa"


def spans(position_ids: torch.Tensor) -> list[list[tuple[int, int]]]:
    """Each sequence's rows as (start, end): a row starts where its position is 0."""
    width = position_ids.shape[1]
    out = []
    for row in position_ids.cpu():
        starts = (row == 0).nonzero().flatten().tolist()
        if not starts or starts[0] != 0:
            starts = [0, *starts]
        out.append(list(zip(starts, [*starts[1:], width], strict=True)))
    return out


def _row_attention(original, row_spans):
    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        same = (
            causal
            and getattr(module, "sliding_window", None) is None
            and kwargs.get("position_bias") is None
            and kwargs.get("s_aux") is None
            and kwargs.get("softcap") is None
            and query.shape[2] == key.shape[2] == sum(e - s for s, e in row_spans[0])
            and query.shape[0] == len(row_spans)
        )
        if not same:
            return original(module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs)
        groups = query.shape[1] // key.shape[1]
        if groups > 1:
            key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
        dropout = dropout if module.training else 0.0
        out = []
        for b, row in enumerate(row_spans):
            parts = [
                F.scaled_dot_product_attention(
                    query[b : b + 1, :, s:e],
                    key[b : b + 1, :, s:e],
                    value[b : b + 1, :, s:e],
                    dropout_p=dropout,
                    is_causal=True,
                    scale=scaling,
                )
                for s, e in row
            ]
            out.append(torch.cat(parts, 2) if len(parts) > 1 else parts[0])
        return torch.cat(out, 0).transpose(1, 2).contiguous(), None

    return attention


@contextlib.contextmanager
def rows_apart(position_ids: torch.Tensor | None):
    """Around a packed microbatch's forward (position ids given): sdpa attention one row at a time."""
    if position_ids is None:
        yield
        return
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    before = ALL_ATTENTION_FUNCTIONS[SDPA]
    ALL_ATTENTION_FUNCTIONS[SDPA] = _row_attention(before, spans(position_ids))
    try:
        yield
    finally:
        ALL_ATTENTION_FUNCTIONS[SDPA] = before
