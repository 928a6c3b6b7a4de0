"""Next-token cross-entropy summed over the positions that count, lean in memory.

`F.cross_entropy` keeps log_softmax's output (one fp32 value per position and vocabulary entry)
for its backward and returns a gradient of the same size, and shifting the logits by slicing
copies them once more: with the caller's own reference to the logits, about four tensors of
micro batch x sequence x vocabulary are alive at once (31 MiB each for a 32K vocabulary at m=2,
seq 128; 4.8 logits' worth measured against 3.0 here, tests/test_loss.py). Here the labels are
shifted instead of the logits, the
forward keeps only the logits and one log-normaliser per position, and the backward writes
softmax - one-hot straight into the gradient, a chunk of rows at a time: one tensor of that size
besides the logits themselves. The same sums as `F.cross_entropy` up to fp32 rounding (tested).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from accum_cli.cpu import linear as cpu_linear
from accum_cli.data.store import IGNORE_INDEX
from accum_cli.parallel import runtime

# Rows per chunk keep the fp32 working copy of a chunk (bf16 logits, logsumexp's own) near 32 MiB.
CHUNK_ELEMENTS = 2**23


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of next-token cross-entropies over the positions whose label counts, in fp32.

    logits: (batch, seq, vocab) in any float dtype; labels: (batch, seq), IGNORE_INDEX where a
    position does not count. Position t predicts label t + 1; the last position predicts nothing."""
    vocab = logits.size(-1)
    return _CrossEntropySum.apply(logits.reshape(-1, vocab), shifted_targets(labels).reshape(-1))


def shifted_targets(labels: torch.Tensor) -> torch.Tensor:
    """The label each position predicts: the next one; the last position predicts nothing."""
    return torch.cat([labels[:, 1:], labels.new_full((labels.size(0), 1), IGNORE_INDEX)], dim=1)


def chunk_starts(rows: torch.Tensor, rows_per_chunk: int) -> tuple[int, Sequence[int]]:
    """Rows per chunk (at least one), and the first row of each chunk.

    The memory estimate (memory/measure.py) runs this code on fake tensors (runtime.simulated), where a chunk takes the same
    time whatever its size and every chunk allocates and frees what the one before it did: there
    the first and the last (maybe shorter) chunk give the step's peak, in a time that does not grow
    with the micro batch (every chunk took ~15 ms; a 128K vocabulary at seq 2048: ~1 s a sequence)."""
    step = max(1, rows_per_chunk)
    starts = range(0, rows.size(0), step)
    if len(starts) > 2 and runtime.is_simulated():
        return step, (starts[0], starts[-1])
    return step, starts


class _CrossEntropySum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        counts = targets != IGNORE_INDEX
        safe = torch.where(counts, targets, 0)  # an ignored row reads column 0, then is masked out
        log_norm = torch.empty(logits.size(0), dtype=torch.float32, device=logits.device)
        step, starts = chunk_starts(logits, CHUNK_ELEMENTS // logits.size(1))
        for start in starts:
            log_norm[start : start + step] = torch.logsumexp(logits[start : start + step].float(), dim=-1)
        picked = logits.gather(1, safe.unsqueeze(1)).squeeze(1).float()
        # where, not a product with the mask: an ignored row's non-finite logits must not count
        total = torch.where(counts, log_norm - picked, 0.0).sum()
        ctx.save_for_backward(logits, safe, counts, log_norm)
        return total

    @staticmethod
    def backward(ctx, grad_total: torch.Tensor):
        logits, safe, counts, log_norm = ctx.saved_tensors
        grad = torch.empty_like(logits)
        row_scale = torch.where(counts, grad_total.float(), 0.0).unsqueeze(1)
        step, starts = chunk_starts(logits, CHUNK_ELEMENTS // logits.size(1))
        for start in starts:
            rows = slice(start, start + step)
            out = grad[rows] if grad.dtype == torch.float32 else None  # fp32: no working copy at all
            probs = torch.sub(logits[rows], log_norm[rows].unsqueeze(1), out=out).exp_()
            probs.scatter_add_(1, safe[rows].unsqueeze(1), torch.full_like(probs[:, :1], -1.0))
            probs.mul_(row_scale[rows])
            if out is None:
                grad[rows].copy_(probs)
            del probs  # before the next chunk's: one working copy alive, not two
        return grad, None


def add_projection_gradients(probs: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, span: slice, first: bool,
                             grads: tuple) -> None:  # fmt: skip
    """One chunk's part of the vocabulary-parallel projection's gradients (vocab_parallel.py), from its
    softmax - one-hot `probs` (rows x vocabulary) and input rows `h`: the rows' (written at `span`),
    the weight's (the `first` chunk writes it, the others add) and the bias's (added). None: not wanted."""
    grad_rows, grad_weight, grad_bias = grads
    if grad_rows is not None:
        grad_rows[span] = cpu_linear.linear(probs, weight.t())
    if grad_weight is not None:
        if first:
            torch.mm(probs.t(), h, out=grad_weight)
        else:
            grad_weight.addmm_(probs.t(), h)
    if grad_bias is not None:
        grad_bias += probs.sum(0)


def hand_on(ctx, grad_total: torch.Tensor) -> tuple:
    """A fused loss's backward (fused_loss.py, vocab_parallel.py): the gradients its forward computed
    (ctx.grads), times the loss's own (1 / global loss tokens), then zeros for the logits' placeholder
    (ctx.placeholder), whose hooks then run as they would for real logits. Released here, so autograd
    may take them without a copy."""
    grads, ctx.grads = ctx.grads, None
    if grads is None:  # scaled in place and handed on the first time: a second backward has none
        raise RuntimeError("the fused loss's backward ran twice; set ACCUM_TRAIN_FUSED_LOSS=0 to retain its graph")
    for grad in grads:
        if grad is not None:
            grad.mul_(grad_total)
    return (*grads, placeholder_zeros(ctx.placeholder))


def placeholder_zeros(spec: tuple) -> torch.Tensor:
    """Zeros of the logits' (shape, dtype, device) in one element's storage (every stride 0): the fused
    losses' placeholder (fused_loss.py) and its gradient."""
    shape, dtype, device = spec
    return torch.empty_strided(shape, (0,) * len(shape), dtype=dtype, device=device).zero_()
