"""bf16 products on a CPU: the bf16 values multiplied and summed in fp32, on fp32 copies of them.

A GPU's bf16 GEMM (tensor cores) reads bf16 operands and sums their products in fp32; the fused
loss's bf16 head (loss/fused_bf16.py) is written for that. A CPU without native bf16 instructions
(AVX512-BF16, AMX) emulates torch's bf16 GEMM: on this project's AVX2 CPU, 512 x 1024 @ 1024 x 8192
took 60.1 s in bf16 against 0.38 s on fp32 copies of the same bf16 values, rounded back to bf16
(0.28 s in plain fp32; 1 thread, best of 3). The same sums either way but for their order, as the
GPU's are. Used only where the device is the CPU (fused_bf16.py chooses).
"""

from __future__ import annotations

import torch


def operand(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A matrix the products read many times (the head's weight), rounded to `dtype` once and kept
    in fp32: one fp32 copy for the whole loss instead of one per product."""
    return tensor.to(dtype).float()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """F.linear's product and bias on bf16 values, summed in fp32 and rounded once to `out_dtype`, as a
    GPU's bf16 F.linear does (its GEMM adds the bias before rounding)."""
    out = torch.mm(x.float(), weight.float().t())
    if bias is not None:
        out += bias.float()
    return out.to(out_dtype)


def mm(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """a @ b in fp32 from operands already rounded to bf16 (or fp32 copies of such), the result in
    `out_dtype`: what torch.mm(a, b, out_dtype=...) computes on CUDA, which no CPU kernel offers."""
    return torch.mm(a.float(), b.float()).to(out_dtype)
