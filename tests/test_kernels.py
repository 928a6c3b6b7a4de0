"""The closed-form RMSNorm (accum_cli/cpu/kernels.py): what the model's own norm computes, swapped in only
where a probe shows it, and the whole model's training unchanged."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import rel_err, save_tiny_model
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.mamba2.modeling_mamba2 import Mamba2RMSNormGated

from accum_cli.cpu import kernels


def norm_and_grads(forward, x, weight, g):
    x = x.clone().requires_grad_(True)
    weight.grad = None
    y = forward(x)
    y.backward(g)
    return y.detach(), x.grad, weight.grad.clone()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_closed_form_gives_the_llama_norm_and_its_gradients(dtype):
    torch.manual_seed(0)
    norm = LlamaRMSNorm(64, eps=1e-5).to(dtype)
    nn.init.normal_(norm.weight, 1.0, 0.3)
    x, g = torch.randn(3, 7, 64, dtype=dtype) * 4, torch.randn(3, 7, 64, dtype=dtype)
    theirs = norm_and_grads(norm, x, norm.weight, g)
    ours = norm_and_grads(lambda t: kernels._RMSNormFunction.apply(t, norm.weight, 1e-5), x, norm.weight, g)
    assert torch.equal(ours[0], theirs[0])  # the same ops in the same order: bit for bit
    tolerance = 1e-6 if dtype == torch.float32 else 1e-2  # bf16: the chain rule's roundings differ
    for a, b in zip(ours[1:], theirs[1:], strict=True):
        assert a.dtype == b.dtype and rel_err(a.float(), b.float()) < tolerance


class MeanCentred(nn.Module):
    """Shaped like an RMSNorm (a 1-D weight, an eps) but a layer norm without bias."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = 1e-6

    def forward(self, x):
        x = x - x.mean(-1, keepdim=True)
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


class CastsLate(LlamaRMSNorm):
    """The Llama norm in fp32, but in bf16 it multiplies by the weight before casting back."""

    def forward(self, x):
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (self.weight * x32).to(x.dtype)


class EpsOnTheRms(nn.Module):
    """x / (rms + eps): the Llama norm for rows far larger than eps, not for rows near it."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = 1e-6

    def forward(self, x):
        x32 = x.float()
        return self.weight * (x32 / (x32.pow(2).mean(-1, keepdim=True).sqrt() + self.eps)).to(x.dtype)


def test_only_norms_that_compute_the_same_are_swapped():
    norms = {"llama": LlamaRMSNorm(8), "gemma": GemmaRMSNorm(8), "centred": MeanCentred(8), "late": CastsLate(8),
             "eps_on_rms": EpsOnTheRms(8),
             # the Llama formula when its gate is None (one group), but the model passes a gate
             "gated": Mamba2RMSNormGated(8, group_size=8)}  # fmt: skip
    model = nn.ModuleDict(norms)
    assert kernels.fuse_rms_norms(model) == 1
    assert [name for name, norm in norms.items() if "forward" in vars(norm)] == ["llama"]
    x = torch.randn(2, 3, 8)
    assert norms["gated"](x, torch.randn(2, 3, 8)).shape == x.shape  # still called as the model calls it


def test_a_swapped_norm_takes_a_one_dimensional_input():
    torch.manual_seed(0)
    norm = LlamaRMSNorm(8)
    nn.init.normal_(norm.weight, 1.0, 0.3)
    x, g = torch.randn(8), torch.randn(8)
    theirs = norm_and_grads(norm, x, norm.weight, g)
    assert kernels.fuse_rms_norms(norm) == 1
    ours = norm_and_grads(norm, x, norm.weight, g)
    for a, b in zip(ours, theirs, strict=True):
        assert a.shape == b.shape and rel_err(a, b) < 1e-6


class Switchable(LlamaRMSNorm):
    """One class, two formulas: the instance's flag decides (as an offset-weight option would)."""

    def __init__(self, width: int, offset: bool) -> None:
        super().__init__(width)
        self.offset = offset

    def forward(self, x):
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return ((1.0 + self.weight) if self.offset else self.weight) * x32.to(x.dtype)


class CastsTo(LlamaRMSNorm):
    """One class whose setting is a dtype: fp32 keeps the Llama formula, fp16 rounds the output."""

    def __init__(self, width: int, cast_to: torch.dtype) -> None:
        super().__init__(width)
        self.cast_to = cast_to

    def forward(self, x):
        x32 = x.float()
        y = self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)).to(x.dtype)
        return y.to(self.cast_to).to(y.dtype)


def test_a_verdict_holds_for_one_setting_of_a_class_not_for_its_other_instances():
    model = nn.ModuleList([Switchable(8, offset=False), Switchable(8, offset=True)])
    assert kernels.fuse_rms_norms(model) == 1
    assert "forward" in vars(model[0]) and "forward" not in vars(model[1])
    model = nn.ModuleList([CastsTo(8, torch.float32), CastsTo(8, torch.float16)])
    assert kernels.fuse_rms_norms(model) == 1
    assert "forward" in vars(model[0]) and "forward" not in vars(model[1])


def test_a_llama_with_swapped_norms_trains_the_same():
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
    torch.manual_seed(0)
    plain = LlamaForCausalLM(config)
    fused = copy.deepcopy(plain)
    assert kernels.fuse_rms_norms(fused) == 2 * config.num_hidden_layers + 1
    ids = torch.randint(0, 128, (2, 16))
    losses = [model(input_ids=ids, labels=ids).loss for model in (plain, fused)]
    for loss in losses:
        loss.backward()
    assert rel_err(losses[1].detach(), losses[0].detach()) < 1e-6
    for (name, p), q in zip(plain.named_parameters(), fused.parameters(), strict=True):
        assert rel_err(q.grad, p.grad) < 1e-5, name


@pytest.mark.parametrize(
    "device, bf16, swapped", [("cpu", False, True), ("cuda", False, False), ("cpu", True, False)], ids=str
)
def test_cpu_kernels_only_on_an_fp32_cpu_run(tmp_path, monkeypatch, device, bf16, swapped):
    """The closed-form RMSNorm and the oneDNN linear layers are CPU-only fp32 speedups (cpu/): a CUDA
    run keeps the model's own modules, and so does a bf16 run (autocast and FSDP2's bf16 copies pick
    their own kernels). The install is decided from the device alone, so a CUDA device object is
    enough to check it here; nothing runs on it."""
    from transformers import AutoModelForCausalLM

    from accum_cli.model import wrap
    from accum_cli.parallel.sharding import ShardSettings

    monkeypatch.setenv("ACCUM_TRAIN_ONEDNN", "1")  # whatever the CPU's make: the device and precision decide here
    save_tiny_model(tmp_path / "m")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.float32)
    wrap._eager_kernels_and_fused_loss(model, ShardSettings(bf16=bf16), torch.device(device))
    own = {type(m).__name__ for m in model.model.modules() if "forward" in m.__dict__}  # the head: the loss's
    assert own == ({"LlamaRMSNorm", "Linear"} if swapped else set()), own
