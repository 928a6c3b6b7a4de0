"""Eager RMSNorm with a hand-written backward, swapped in only where it computes what the model's own does.

A decoder's RMSNorm is a handful of elementwise ops, and autograd differentiates each one: on
this CPU a Llama norm's forward and backward took 2.3 ms against 1.6 for the closed form below
(nine norms per microbatch of a 4-layer model). `torch.compile` fuses them anyway; this is for the
eager runs that compiling would not pay for.

No architecture list decides where it applies: a module qualifies when it has a 1-D `weight`, an
epsilon attribute and a forward of the hidden states alone, and on probe inputs (random weight;
rows of the usual size and rows as small as the epsilon) its own forward and backward give the
same output and gradients as ours in fp32, to 1e-6 relative, and the same output bit for bit in
bf16. A norm that computes anything else (Gemma's `1 + weight`, a norm with a bias or over
another axis, the epsilon added to the RMS) fails the probe, and one with more inputs (Mamba2's
gated norm) is not probed: both keep their own forward. Each class is probed once per process
and setting of its instances.
"""

from __future__ import annotations

import inspect
import types

import torch
from torch import nn

from accum_cli import torch_compat

PROBE_TOLERANCE = 1e-6  # fp32 reassociation only: the closed-form backward sums in another order
_verdicts: dict[tuple, bool] = {}  # by _kind


class _RMSNormFunction(torch.autograd.Function):
    """y = weight * (x / rms(x)).to(x.dtype), rms in fp32; the backward in closed form:
    dx = r * (g*w - x_hat * mean(g*w * x_hat)), dw = sum over rows of g * x_hat."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x32 = x.float()
        r = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        x_hat = x32 * r
        ctx.save_for_backward(x_hat, r, weight)
        ctx.input_dtype = x.dtype
        return weight * x_hat.to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x_hat, r, weight = ctx.saved_tensors
        g = grad.float()
        gw = g * weight.float()
        grad_x = r * (gw - x_hat * (gw * x_hat).mean(-1, keepdim=True))
        grad_w = (g * x_hat).reshape(-1, g.shape[-1]).sum(0)  # over every row, also of a 1-D input
        return grad_x.to(ctx.input_dtype), grad_w.to(weight.dtype), None


def _eps(module: nn.Module) -> float | None:
    for name in ("variance_epsilon", "eps"):
        value = getattr(module, name, None)
        if isinstance(value, float):
            return value
    return None


def _shaped_like_rms_norm(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    own = dict(module.named_parameters(recurse=False))
    return (
        isinstance(weight, nn.Parameter)
        and weight.dim() == 1
        and list(own) == ["weight"]
        and not list(module.children())
        and _eps(module) is not None
        and _takes_one_input(type(module).forward)
    )


def _takes_one_input(forward) -> bool:
    """Called with the hidden states alone, as the swapped forward is: a norm with more inputs
    (Mamba2's gated norm, `forward(x, gate=None)`, is an RMSNorm when the gate is None) keeps its own."""
    try:
        params = list(inspect.signature(forward).parameters.values())[1:]  # after self
    except (TypeError, ValueError):
        return False
    return len(params) == 1 and params[0].kind in (params[0].POSITIONAL_ONLY, params[0].POSITIONAL_OR_KEYWORD)


def _rms_norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    return _RMSNormFunction.apply(hidden_states, self.weight, _eps(self))


def _agrees(module: nn.Module) -> bool:
    """Probe the module's kind: its own forward and backward against ours, on real tensors (also
    while the memory estimate builds its model in FakeTensorMode)."""
    with torch_compat.unset_fake_temporarily():
        return _agrees_on_real_tensors(module)


def _agrees_on_real_tensors(module: nn.Module) -> bool:
    """fp32: the output and both gradients within PROBE_TOLERANCE. bf16 (FSDP's mixed precision):
    the same output bit for bit, so a norm that casts at another point is left alone."""
    width = module.weight.shape[0]
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(width, generator=generator) + 1.0
    x = torch.randn(2, 3, width, generator=generator) * 3
    g = torch.randn(2, 3, width, generator=generator)
    # Rows as small as the epsilon too: there `x / (rms + eps)` and `x * rsqrt(ms + eps)` part.
    eps = _eps(module)
    tiny = x * (eps**0.5 / 3 if eps > 0 else 1e-3)
    try:
        agree = True
        for probe_x in (x, tiny):
            theirs = _outputs(type(module).forward, _Probe(module, weight), probe_x, g)
            ours = _outputs(_rms_norm_forward, _Probe(module, weight), probe_x, g)
            agree &= all(_close(a, b) for a, b in zip(ours, theirs, strict=True))
        theirs16 = type(module).forward(_Probe(module, weight.bfloat16()), x.bfloat16())
        ours16 = _rms_norm_forward(_Probe(module, weight.bfloat16()), x.bfloat16())
    except Exception:  # a forward that needs more than a weight and an epsilon is not a plain RMSNorm
        return False
    return agree and torch.equal(ours16, theirs16)


def _outputs(forward, probe, x: torch.Tensor, g: torch.Tensor):
    x = x.clone().requires_grad_(True)
    y = forward(probe, x)
    y.backward(g)
    return y.detach(), x.grad, probe.weight.grad


def _close(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return (
        a is not None
        and b is not None
        and a.shape == b.shape
        and bool((a - b).abs().max() <= PROBE_TOLERANCE * b.abs().max().clamp_min(1e-30))
    )


class _Probe:
    """The module's own attributes, but a fresh weight of the probe's: its forward reads `self.weight`."""

    def __init__(self, module: nn.Module, weight: torch.Tensor) -> None:
        self._module = module
        self.weight = nn.Parameter(weight.clone())

    def __getattr__(self, name: str):  # only what the instance itself lacks: the module's eps and the like
        return getattr(self._module, name)


def _kind(module: nn.Module) -> tuple:
    """What a verdict holds for: the class and the plain settings of the instance, since one class
    can switch its formula on a flag (an offset weight, a cast) from instance to instance."""
    settings = tuple(sorted((k, v) for k, v in vars(module).items() if not k.startswith("_") and _plain(v)))
    return type(module), settings


def _plain(value) -> bool:
    """A setting that can be compared and hashed as it is: a number, a string, a dtype, None, or a
    tuple of them (what a norm's formula can switch on)."""
    if isinstance(value, tuple):
        return all(_plain(v) for v in value)
    return value is None or isinstance(value, bool | int | float | str | torch.dtype)


def fuse_rms_norms(model: nn.Module) -> int:
    """Swap the closed-form RMSNorm into every module whose class passes the probe; how many."""
    swapped = 0
    for module in model.modules():
        if not _shaped_like_rms_norm(module):
            continue
        kind = _kind(module)
        if kind not in _verdicts:
            _verdicts[kind] = _agrees(module)
        if _verdicts[kind]:
            module.forward = types.MethodType(_rms_norm_forward, module)
            swapped += 1
    return swapped
