"""fp32 linear layers on CPU through oneDNN's matmul instead of torch's default, MKL's sgemm.

On the AMD EPYC (Zen 4) CPUs this project is measured on, MKL ran the decoder layers' GEMMs at
88-98 GFLOP/s per core and oneDNN at 103-111 (1 thread; 2 threads: 150-194 against 196-225),
forward and input gradient alike; one microbatch of the speed benchmark's model (forward and
backward, 1 thread) took 4% less time (5 Dec, alternating process pairs: 296 -> 281, 295 -> 298,
311 -> 288, 305 -> 293 ms; with the run's own norms and loss 296 -> 289, 305 -> 289, 305 -> 286).
The weight gradient stays MKL's (oneDNN was no faster there), and so do small products: oneDNN's
call costs a fixed few microseconds, so under MIN_MACS multiply-adds (128 x 128 x 384: 1.01-1.4x
MKL's time; 96 x 256 x 688: 0.96x) it is no faster. MKL is Intel's, and on an Intel Xeon (AVX-512)
oneDNN was no faster either (7 Dec, 1 thread, median of 30: 1.09x MKL's time for 1024 x 256 -> 688, 0.95x
for 688 -> 256, 1.08x and 1.04x at 2048 x 1024 <-> 4096), so by default (`auto`) only an AMD CPU takes
it. ACCUM_TRAIN_ONEDNN=0 keeps torch's path everywhere, =1 takes oneDNN for every fp32 CPU layer
whatever its size and CPU (the exactness tests use it on their tiny models).

The op, `torch.ops.mkldnn._linear_pointwise`, is torch's own (inductor's CPU lowering calls it)
but private, so it is used only where a probe in this process agrees with `F.linear` (output and
all three gradients to 1e-6 relative); otherwise every layer keeps torch's path. Eager only: a
compiled region chooses its own kernels, and fake tensors (the memory estimate) and DTensors take
`F.linear`, whose saved tensors and memory are the same as this function's.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F
from torch import nn

from accum_cli import torch_compat
from accum_cli.errors import UserError

MIN_MACS = 2**24  # rows x input x output features: below it oneDNN's call costs more than it saves
MODES = {"auto": MIN_MACS, "1": 0}  # ACCUM_TRAIN_ONEDNN -> the smallest product taken; "0": never
CPUINFO = "/proc/cpuinfo"  # its vendor_id decides `auto`
PROBE_TOLERANCE = 1e-6  # fp32 reassociation only: another blocking of the same sums


def _onednn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch_compat.mkldnn_linear_pointwise(x, weight, bias, "none", [], "")


class _Linear(torch.autograd.Function):
    """y = x W^T + b by oneDNN; the input's gradient by oneDNN too (g W, W read transposed in
    place), the weight's and the bias's as autograd computes them for F.linear."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return _onednn(x, weight, bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad_x = _onednn(grad, weight.t(), None) if ctx.needs_input_grad[0] else None
        rows = grad.reshape(-1, grad.shape[-1])
        grad_w = rows.t() @ x.reshape(-1, x.shape[-1]) if ctx.needs_input_grad[1] else None
        grad_b = rows.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b


def _applies(x: torch.Tensor, weight: torch.Tensor, min_macs: int) -> bool:
    return (
        type(x) is torch.Tensor  # not a FakeTensor (the estimate) nor a DTensor
        and type(weight) in (torch.Tensor, nn.Parameter)
        and x.dtype == weight.dtype == torch.float32
        and x.device.type == "cpu"
        and x.numel() * weight.shape[0] >= min_macs  # rows x in x out
        and not torch.compiler.is_compiling()
    )


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear's product, by oneDNN where `use_onednn` would take it; no autograd of its own (for
    the vocabulary-parallel loss, vocab_parallel.py, which computes its gradients itself)."""
    smallest = min_macs(os.environ)
    if smallest is not None and _applies(x, weight, smallest) and available():
        return _onednn(x, weight, bias)
    return F.linear(x, weight, bias)


def _forward(self: nn.Linear, min_macs: int, x: torch.Tensor) -> torch.Tensor:
    if _applies(x, self.weight, min_macs):
        return _Linear.apply(x, self.weight, self.bias)
    return F.linear(x, self.weight, self.bias)


@functools.cache
def available() -> bool:
    """The op exists here and computes what F.linear does, forward and backward: probed on real
    tensors, also while the memory estimate builds its model in FakeTensorMode."""
    with torch_compat.unset_fake_temporarily():
        return _agrees()


def _agrees() -> bool:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, 67, 133, generator=generator)  # odd sizes: no blocking divides them
    weight = torch.randn(137, 133, generator=generator)
    bias = torch.randn(137, generator=generator)
    grad = torch.randn(2, 67, 137, generator=generator)
    try:
        ours = _outputs(_Linear.apply, x, weight, bias, grad)
    except Exception:  # the op is gone or refuses these tensors: torch's path everywhere
        return False
    theirs = _outputs(F.linear, x, weight, bias, grad)
    return all(bool((a - b).abs().max() <= PROBE_TOLERANCE * b.abs().max()) for a, b in zip(ours, theirs, strict=True))


def _outputs(linear, x, weight, bias, grad) -> list[torch.Tensor]:
    leaves = [t.clone().requires_grad_(True) for t in (x, weight, bias)]
    y = linear(*leaves)
    y.backward(grad)
    return [y.detach(), *(leaf.grad for leaf in leaves)]


def min_macs(env) -> int | None:
    """The smallest product ACCUM_TRAIN_ONEDNN lets oneDNN take (auto, unset: MIN_MACS on an AMD CPU);
    None: never."""
    mode = env.get("ACCUM_TRAIN_ONEDNN", "auto").strip().lower()
    if mode == "0":
        return None
    if mode not in MODES:
        raise UserError(f"ACCUM_TRAIN_ONEDNN must be auto, 1 or 0, got {mode!r}")
    if mode == "auto" and not measured_to_pay():
        return None
    return MODES[mode]


@functools.cache
def measured_to_pay() -> bool:
    """This CPU is an AMD one, where oneDNN's GEMMs were measured faster than MKL's (the docstring)."""
    try:
        with open(CPUINFO, encoding="utf-8", errors="replace") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[-1].strip() == "AuthenticAMD"
    except OSError:
        pass
    return False


def use_onednn(model: nn.Module) -> int:
    """Route every plain nn.Linear of the model through oneDNN where it applies; how many. Nothing
    if the probe disagrees or ACCUM_TRAIN_ONEDNN=0. Subclasses (quantised or LoRA layers) keep
    their own forward."""
    smallest = min_macs(os.environ)
    if smallest is None or not available():
        return 0
    swapped = 0
    for module in model.modules():
        if type(module) is nn.Linear:
            module.forward = functools.partial(_forward, module, smallest)
            swapped += 1
    return swapped
