"""The fused output projection and loss under bf16 mixed precision: bf16 products, fp32 sums.

The GEMMs run on bf16 operands, as the unfused projection's do (tensor cores on CUDA; on a CPU, fp32
products of the same bf16 values, cpu/bf16.py): the logits of a chunk of rows, the projection's own
(F.linear's bf16 output), and from their softmax - one-hot, in bf16 as the unfused loss's gradient
is, the rows' and the weight's gradients. What is summed across chunks is summed in fp32: the loss,
the weight's gradient (an fp32 accumulator, each chunk's part of it formed in fp32 by the GEMM
itself, a block of vocabulary rows at a time so that the part is small) and the bias's; the
gradients are scaled by the loss's own and cast once, in the backward, to their operands' dtypes.
The loss is the unfused step's (the same bf16 logits); the gradients are as near the exact ones
(fp64 on the same bf16 values) or nearer, at any chunk size (tests/test_fused_loss.py).

Not torch's F.linear_cross_entropy, which given bf16 operands returns its loss in bf16 and sums the
weight's gradient over its chunks in bf16 (4096 rows x 64 -> 1024, this CPU, against the loss and
gradients of the same bf16 values in fp64): one call per chunk of ours fixes the second, but the loss
still comes back in bf16 (relative error 2.4e-3 for a 4096-row chunk with reduction="sum", 3.6e-5
summed from reduction="none"'s rows, against 4.7e-6 here and in the unfused step), each chunk's
weight gradient is rounded to bf16 before the fp32 sum (2.3e-3 once cast to bf16, against 1.9e-3
unfused), and each call returns a whole vocabulary x hidden gradient besides the sum.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from accum_cli.cpu import bf16 as cpu_bf16
from accum_cli.data.store import IGNORE_INDEX
from accum_cli.loss import tokens
from accum_cli.loss.tokens import chunk_starts, hand_on
from accum_cli.parallel import runtime

# A chunk's logits, in bf16: 256 MiB on a GPU, 1024 rows of a 128K vocabulary, 4096 of a 32K one.
# Fewer rows per chunk would cost it time: each chunk reads and writes the whole fp32 weight-gradient
# accumulator and its fp32 parts (16 bytes a weight) for 6 x rows flops a weight in its three GEMMs;
# at an H100's ~3 TB/s and ~700 TFLOP/s the two take as long at ~600 rows. Not measured on a GPU
# (none here). A CPU computes far slower than it moves memory: there chunks as small as the fp32
# loss's (fused_loss.CHUNK_ELEMENTS, 16 MiB of fp32 logits).
CHUNK_ELEMENTS = 2**27
CPU_CHUNK_ELEMENTS = 2**22
# A block of vocabulary rows whose products are formed in fp32 before they are summed: 32 MiB.
PARTIAL_ELEMENTS = 2**23


def token_loss_sum(rows, weight, bias, placeholder, targets, dtype: torch.dtype) -> torch.Tensor:
    """The sum of the rows' cross-entropies with the head (weight, bias) computed in `dtype` (bf16):
    rows x hidden in the hidden state's dtype, targets IGNORE_INDEX where a row does not count."""
    return _Bf16LinearCrossEntropySum.apply(rows, weight, bias, placeholder, targets, dtype)


def _gemm(example: torch.Tensor):
    """The products, for the device the run computes on: torch's on CUDA (and on the estimate's fake
    tensors, for any device but the CPU), cpu/bf16.py's on a CPU."""
    if runtime.device_type(example) == "cpu":
        return cpu_bf16.linear, cpu_bf16.mm, cpu_bf16.operand, CPU_CHUNK_ELEMENTS
    return _linear, _mm, lambda tensor, dtype: tensor.to(dtype), CHUNK_ELEMENTS


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype):
    """The projection's own bf16 logits, F.linear's: cuBLAS sums in fp32, adds the bias, rounds once."""
    return F.linear(x, weight, bias)


def _mm(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """a @ b on bf16 operands, summed in fp32 (cuBLAS), returned in `out_dtype` (fp32 or bf16)."""
    return torch.mm(a, b) if out_dtype == a.dtype else torch.mm(a, b, out_dtype=out_dtype)


def _softmax_grad_(logits: torch.Tensor, mask: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """A chunk's loss sum (fp32), and in the logits' place (bf16) softmax - one-hot on the rows that
    count, zeros on the others: in fp32 a part of the chunk at a time, as tokens.py does on whole logits."""
    total = torch.zeros((), dtype=torch.float32, device=logits.device)
    step, starts = chunk_starts(logits, tokens.CHUNK_ELEMENTS // logits.size(1))
    for start in starts:
        span = slice(start, start + step)
        part, counts, picks = logits[span].float(), mask[span], target[span].unsqueeze(1)
        log_norm = torch.logsumexp(part, dim=-1)
        picked = part.gather(1, picks).squeeze(1)
        # where, not a product with the mask: an ignored row's non-finite logits must not count
        total += torch.where(counts, log_norm - picked, 0.0).sum()
        part.sub_(log_norm.unsqueeze(1)).exp_()
        part.scatter_add_(1, picks, torch.full_like(part[:, :1], -1.0))
        logits[span] = part.mul_(counts.unsqueeze(1))
        del part
    return total


class _Bf16LinearCrossEntropySum(torch.autograd.Function):
    """Forward: the loss sum and its gradients for the rows, weight and bias, a chunk of rows at a
    time. Backward: those gradients times the loss's own (1 / global loss tokens), as hand_on does."""

    @staticmethod
    def forward(ctx, rows, weight, bias, placeholder, targets, dtype):
        vocab, features = weight.shape
        wants = ctx.needs_input_grad
        linear, mm, operand, chunk_elements = _gemm(rows)
        counts = targets != IGNORE_INDEX
        safe = torch.where(counts, targets, 0)  # an ignored row reads column 0, then is zeroed
        # Zeros for the rows that do not count: a padded position's non-finite hidden state would
        # make 0 * nan = nan in the weight gradient's products.
        h = rows.to(dtype, copy=True).masked_fill_(~counts.unsqueeze(1), 0)
        w = operand(weight, dtype)  # FSDP2's bf16 copy itself; autocast's master weights: a bf16 copy
        b = bias.to(dtype) if bias is not None else None
        grad_rows = torch.empty_like(rows, dtype=torch.float32) if wants[0] else None
        acc = torch.zeros(vocab, features, dtype=torch.float32, device=rows.device) if wants[1] else None
        acc_bias = torch.zeros(vocab, dtype=torch.float32, device=rows.device) if b is not None and wants[2] else None
        total = torch.zeros((), dtype=torch.float32, device=rows.device)
        step, starts = chunk_starts(h, chunk_elements // vocab)
        blocks = range(0, vocab, max(1, PARTIAL_ELEMENTS // features))
        for start in starts:
            span = slice(start, start + step)
            hc = h[span]
            logits = linear(hc, w, b, dtype)
            total += _softmax_grad_(logits, counts[span], safe[span])
            if acc_bias is not None:
                acc_bias += logits.sum(0, dtype=torch.float32)
            part = None  # the chunk's rows' gradient, summed over the blocks in fp32
            for first in blocks:
                vocab_rows = slice(first, first + blocks.step)
                grads = logits[:, vocab_rows]
                if acc is not None:
                    acc[vocab_rows] += mm(grads.t(), hc, torch.float32)
                if grad_rows is not None:
                    product = mm(grads, w[vocab_rows], torch.float32)
                    part = product if part is None else part.add_(product)
                    del product
            if grad_rows is not None:
                grad_rows[span] = part
            del logits, part  # before the next chunk's: one chunk's logits alive, not two
        del h, w
        # Kept in fp32 to the backward, which scales them before the one rounding to the operands'
        # dtypes: scaled after it, a bf16 gradient would be rounded twice (the unfused loss scales
        # its logits' gradient before rounding it).
        ctx.grads = (grad_rows, acc, acc_bias)
        ctx.dtypes = (rows.dtype, weight.dtype, bias.dtype if bias is not None else None)
        ctx.placeholder = (placeholder.shape, placeholder.dtype, placeholder.device)
        return total

    @staticmethod
    def backward(ctx, grad_total):
        *grads, zeros = hand_on(ctx, grad_total)
        return (*(_cast_once(g, dtype) for g, dtype in zip(grads, ctx.dtypes, strict=True)), zeros, None, None)


def _cast_once(grad: torch.Tensor | None, dtype: torch.dtype | None) -> torch.Tensor | None:
    """An fp32 gradient in its operand's dtype: itself for fp32 (autocast's master weights and hidden
    state), a bf16 copy for FSDP2's bf16 copies (which FSDP2 turns back to fp32 to reduce)."""
    return grad if grad is None or dtype == grad.dtype else grad.to(dtype)
