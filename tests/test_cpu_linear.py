"""fp32 linear layers on CPU through oneDNN (accum_cli/cpu/linear.py): what F.linear computes, taken
only where it pays and where it can run, and a model's training unchanged."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from helpers import rel_err
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from accum_cli.cpu import linear as cpu_linear
from accum_cli.errors import UserError


@pytest.fixture
def calls(monkeypatch) -> list[tuple]:
    """Every oneDNN call: (input shape, weight shape); on any CPU, as on an AMD one by default."""
    monkeypatch.setattr(cpu_linear, "measured_to_pay", lambda: True)
    made = []
    assert cpu_linear.available(), "the probe first, so that its own calls are not counted"
    onednn = cpu_linear._onednn
    monkeypatch.setattr(
        cpu_linear, "_onednn", lambda x, w, b: made.append((tuple(x.shape), tuple(w.shape))) or onednn(x, w, b)
    )
    return made


def forward_and_grads(layer: nn.Linear, x: torch.Tensor, grad: torch.Tensor) -> list[torch.Tensor]:
    x = x.clone().requires_grad_(True)
    y = layer(x)
    y.backward(grad)
    return [y.detach(), x.grad, *(p.grad for p in layer.parameters())]


@pytest.mark.parametrize("bias", [True, False])
def test_a_layer_through_onednn_gives_f_linear_and_its_gradients(monkeypatch, calls, bias):
    monkeypatch.delenv("ACCUM_TRAIN_ONEDNN", raising=False)
    torch.manual_seed(0)
    plain = nn.Linear(256, 688, bias=bias)
    ours = copy.deepcopy(plain)
    assert cpu_linear.use_onednn(ours) == 1
    x, grad = torch.randn(4, 64, 256), torch.randn(4, 64, 688)  # 256 rows: 45M multiply-adds
    got, want = forward_and_grads(ours, x, grad), forward_and_grads(plain, x, grad)
    assert calls == [((4, 64, 256), (688, 256)), ((4, 64, 688), (256, 688))], "forward and input gradient"
    assert len(got) == len(want) == (4 if bias else 3)
    for a, b in zip(got, want, strict=True):
        assert rel_err(a, b) < 1e-6


def test_small_products_fake_tensors_and_other_dtypes_keep_torchs_path(monkeypatch, calls):
    from torch._subclasses.fake_tensor import FakeTensorMode

    monkeypatch.delenv("ACCUM_TRAIN_ONEDNN", raising=False)
    layer = nn.Linear(256, 688)
    cpu_linear.use_onednn(layer)
    layer(torch.randn(8, 256))  # 1.4M multiply-adds: oneDNN's call would cost more than it saves
    layer.to(torch.float64)(torch.randn(300, 256, dtype=torch.float64))
    with FakeTensorMode(allow_non_fake_inputs=True):  # the memory estimate
        big = nn.Linear(256, 688)
        cpu_linear.use_onednn(big)
        assert big(torch.randn(300, 256)).shape == (300, 688)
    assert calls == []
    monkeypatch.setenv("ACCUM_TRAIN_ONEDNN", "1")  # every size
    forced = nn.Linear(256, 688)
    cpu_linear.use_onednn(forced)
    forced(torch.randn(8, 256))
    assert calls == [((8, 256), (688, 256))]


def test_the_switch_turns_it_off_and_refuses_what_it_does_not_know(monkeypatch):
    monkeypatch.setenv("ACCUM_TRAIN_ONEDNN", "0")
    assert cpu_linear.use_onednn(nn.Linear(256, 688)) == 0
    monkeypatch.setenv("ACCUM_TRAIN_ONEDNN", "yes")
    with pytest.raises(UserError, match="ACCUM_TRAIN_ONEDNN must be auto, 1 or 0, got 'yes'"):
        cpu_linear.use_onednn(nn.Linear(256, 688))


@pytest.mark.parametrize("vendor, taken", [("AuthenticAMD", 1), ("GenuineIntel", 0)])
def test_by_default_only_an_amd_cpu_takes_onednn(monkeypatch, tmp_path, vendor, taken):
    """oneDNN's GEMMs were measured faster than MKL's on an AMD EPYC and no faster on an Intel Xeon: by
    default only the first takes them; ACCUM_TRAIN_ONEDNN=1 takes them anywhere."""
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nvendor_id\t: {vendor}\nflags\t\t: fpu avx2\n")
    monkeypatch.setattr(cpu_linear, "CPUINFO", str(cpuinfo))
    # a cache of its own, which this machine's answer is not in and the test's leaves no trace in
    monkeypatch.setattr(cpu_linear, "measured_to_pay", functools.cache(cpu_linear.measured_to_pay.__wrapped__))
    monkeypatch.delenv("ACCUM_TRAIN_ONEDNN", raising=False)
    assert cpu_linear.use_onednn(nn.Linear(256, 688)) == taken
    monkeypatch.setenv("ACCUM_TRAIN_ONEDNN", "1")
    assert cpu_linear.use_onednn(nn.Linear(256, 688)) == 1


def test_without_the_op_every_layer_keeps_torchs_path(monkeypatch):
    """A torch without the private op (or one that computes something else) fails the probe."""
    monkeypatch.delenv("ACCUM_TRAIN_ONEDNN", raising=False)
    monkeypatch.setattr(cpu_linear, "measured_to_pay", lambda: True)  # the probe decides, not the CPU
    cpu_linear.available.cache_clear()
    monkeypatch.setattr(cpu_linear, "_onednn", lambda x, w, b: torch.nn.functional.linear(x, w, b) * 1.001)
    try:
        assert not cpu_linear.available()
        assert cpu_linear.use_onednn(nn.Linear(256, 688)) == 0
    finally:
        cpu_linear.available.cache_clear()


def test_a_llama_through_onednn_trains_the_same(monkeypatch, calls):
    monkeypatch.delenv("ACCUM_TRAIN_ONEDNN", raising=False)
    config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=688, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128)  # fmt: skip
    torch.manual_seed(0)
    plain = LlamaForCausalLM(config)
    ours = copy.deepcopy(plain)
    assert cpu_linear.use_onednn(ours) == 7 * config.num_hidden_layers + 1  # q k v o gate up down, and the head
    ids = torch.randint(0, 512, (2, 128))
    losses = [model(input_ids=ids, labels=ids).loss for model in (plain, ours)]
    for loss in losses:
        loss.backward()
    assert len(calls) == 2 * (7 * config.num_hidden_layers + 1)
    assert rel_err(losses[1].detach(), losses[0].detach()) < 1e-6
    for (name, p), q in zip(plain.named_parameters(), ours.parameters(), strict=True):
        assert rel_err(q.grad, p.grad) < 1e-5, name
