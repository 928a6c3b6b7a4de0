"""The output projection fused with the loss (fused_loss.py) computes what the projection and then
the loss compute, holds less, and is used only on models that hand their logits out untouched."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers
from test_loss import peak_bytes
from torch import nn

from accum_cli.cpu import linear as cpu_linear
from accum_cli.data.batches import Microbatch
from accum_cli.data.store import IGNORE_INDEX
from accum_cli.loss import fused_loss
from accum_cli.loss.tokens import token_loss_sum
from accum_cli.model import wrap
from accum_cli.step.loop import microbatch_backward

TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


def tiny(config_class: str = "LlamaConfig", vocab: int = 384, attention: str = "sdpa", **extra) -> nn.Module:
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(vocab_size=vocab, **TINY, **extra)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=attention)
    return model.train()


def labelled(vocab: int, rows: int = 3, seq: int = 17, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, vocab, (rows, seq), generator=g)
    labels[0, :5] = IGNORE_INDEX  # a prompt
    labels[-1, 9:] = IGNORE_INDEX  # padding
    return labels


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows_per_chunk", [10**6, 7, 1])  # one chunk, several (the last shorter), a row each
def test_the_sum_and_its_gradients_are_the_projections_then_the_losss(monkeypatch, bias, rows_per_chunk):
    vocab = 301
    monkeypatch.setattr(fused_loss, "CHUNK_ELEMENTS", rows_per_chunk * vocab)
    g = torch.Generator().manual_seed(1)
    hidden, head = torch.randn(3, 17, 24, generator=g), nn.Linear(24, vocab, bias=bias)
    labels = labelled(vocab)
    want_leaves = [t.detach().clone().requires_grad_() for t in (hidden, head.weight, head.bias) if t is not None]
    got_leaves = [t.detach().clone().requires_grad_() for t in want_leaves]
    want = token_loss_sum(F.linear(*want_leaves), labels)
    got_hidden, got_weight, *got_bias = got_leaves
    placeholder = fused_loss._Placeholder.apply(got_hidden, vocab)
    recorded = fused_loss.Recorded(got_hidden, got_weight, got_bias[0] if bias else None, placeholder)
    got = fused_loss.token_loss_sum(recorded, labels)
    (want * 0.37).backward()
    (got * 0.37).backward()
    assert torch.allclose(got, want, rtol=1e-6, atol=0), (float(got), float(want))
    for name, w, o in zip(("hidden", "weight", "bias")[: len(want_leaves)], want_leaves, got_leaves, strict=True):
        assert (o.grad - w.grad).abs().max() <= 1e-5 * w.grad.abs().max(), name
    assert not got_hidden.grad[2, 8:].any(), "positions predicting ignored labels get no gradient"


def test_what_does_not_count_cannot_poison_the_sum():
    vocab = 50
    hidden, head, labels = torch.randn(3, 17, 8), nn.Linear(8, vocab), labelled(vocab)

    def loss(hidden, labels):
        return fused_loss.token_loss_sum(fused_loss.Recorded(hidden, head.weight, head.bias, hidden), labels)

    hidden[2, 12] = float("nan")  # predicts an ignored label
    assert torch.isfinite(loss(hidden, labels))
    assert float(loss(hidden, torch.full_like(labels, IGNORE_INDEX))) == 0.0
    hidden[0, 7, 3] = float("inf")  # ... while a position that counts is reported, not hidden
    assert not torch.isfinite(loss(hidden, labels))


def microbatch(vocab: int, rows: int = 3, seq: int = 17) -> Microbatch:
    labels = labelled(vocab, rows, seq)
    ids = labels.clamp(min=0)
    return Microbatch(ids, torch.ones_like(ids), labels)


@pytest.mark.parametrize("tied", [False, True])
def test_a_fused_model_trains_as_the_model_itself(tied):
    """The run's own microbatch step on a fused model and on the untouched model: the same loss
    and the same gradients for every parameter; evaluation (no gradients) still gets real logits."""
    plain, fused = tiny(tie_word_embeddings=tied), tiny(tie_word_embeddings=tied)
    assert fused_loss.install(fused) and fused_loss.describe(fused).startswith("fused")
    mb = microbatch(384)
    want, _ = microbatch_backward(plain, mb, "last", True, 41, torch.device("cpu"))
    got, _ = microbatch_backward(fused, mb, "last", True, 41, torch.device("cpu"))
    assert torch.allclose(got, want, rtol=1e-6, atol=0)
    for (name, p), q in zip(plain.named_parameters(), fused.parameters(), strict=True):
        assert (p.grad - q.grad).abs().max() <= 1e-5 * p.grad.abs().max(), name
    assert list(plain.state_dict()) == list(fused.state_dict()), "nothing added to the checkpoint"
    with torch.no_grad():
        assert torch.equal(fused(input_ids=mb.input_ids).logits, plain(input_ids=mb.input_ids).logits)


def test_the_fused_loss_holds_less_than_whole_logits(monkeypatch):
    """A large vocabulary against a small model: the fused step's peak lies more than a logits'
    worth below the unfused one's (which holds the logits and their gradient, 8 MiB each)."""
    monkeypatch.setattr(fused_loss, "CHUNK_ELEMENTS", 16 * 8192)  # chunks of 16 rows: 0.5 MiB
    mb = microbatch(8192, rows=4, seq=64)
    logits_bytes = 4 * 64 * 8192 * 4
    peaks = {}
    for fused in (False, True):
        model = tiny(vocab=8192)
        if fused:
            assert fused_loss.install(model)
        peaks[fused] = peak_bytes(
            lambda model=model: microbatch_backward(model, mb, "last", True, 200, torch.device("cpu")), model
        )
    print({k: round(v / 2**20, 1) for k, v in peaks.items()}, "MiB")
    assert peaks[True] < peaks[False] - 1.5 * logits_bytes


@pytest.mark.parametrize(
    "config_class, extra",
    [("Gemma2Config", {"head_dim": 8, "final_logit_softcapping": 30.0, "attention": "eager"}), ("OPTConfig", {})],
    ids=["softcapped logits", "logits made contiguous"],
)
def test_a_model_that_changes_its_logits_keeps_its_head(config_class, extra):
    """Gemma 2 softcaps the projection's output and OPT copies it (`.contiguous()`): the probe sees
    logits that are not the placeholder and leaves the head, and its forward, as they were."""
    if config_class == "OPTConfig":
        extra = {"ffn_dim": 64, "word_embed_proj_dim": 32}
    model = tiny(config_class, **extra)
    head = model.get_output_embeddings()
    assert fused_loss.install(model) is False
    assert "forward" not in head.__dict__ and fused_loss.describe(model).startswith("after")
    mb = microbatch(384)
    out = model(input_ids=mb.input_ids)
    assert fused_loss.recorded(model, out.logits) is None


@pytest.mark.parametrize("setting", ["0", "1"])
def test_the_heads_own_forward_survives_the_probe(monkeypatch, setting):
    """oneDNN's forward (cpu_linear.py) set on the head before the probe is the one it projects with
    after, where the fused loss is refused (ACCUM_TRAIN_FUSED_LOSS=0) and in evaluation where not."""
    monkeypatch.setenv("ACCUM_TRAIN_ONEDNN", "1")
    monkeypatch.setenv("ACCUM_TRAIN_FUSED_LOSS", setting)
    model = tiny()
    cpu_linear.use_onednn(model)
    head = model.get_output_embeddings()
    own = head.__dict__["forward"]
    assert fused_loss.install(model) is (setting == "1")
    if setting == "0":
        assert head.__dict__["forward"] is own
        return
    assert head.__dict__["forward"].args[1] is own  # what the recording forward projects with
    calls = []
    onednn = cpu_linear._onednn
    monkeypatch.setattr(cpu_linear, "_onednn", lambda *a: calls.append(a[1].shape) or onednn(*a))
    with torch.no_grad():
        model(input_ids=torch.zeros(1, 3, dtype=torch.long))
    assert head.weight.shape in calls, "evaluation projects through the head's own forward"


def test_a_forward_outside_the_step_gets_real_logits():
    """Only the run's own microbatch step records: a caller's forward in training mode, with
    gradients, gets the model's own logits and loss."""
    plain, fused = tiny(), tiny()
    assert fused_loss.install(fused)
    mb = microbatch(384)
    want, got = (m(input_ids=mb.input_ids, labels=mb.labels) for m in (plain, fused))
    assert torch.equal(got.logits, want.logits) and torch.equal(got.loss, want.loss)
    assert fused_loss.recorded(fused, got.logits) is None


def test_logits_changed_after_the_probe_are_a_fault_not_zeros():
    model = tiny()
    assert fused_loss.install(model)
    with fused_loss.recording(model):
        out = model(input_ids=torch.zeros(1, 3, dtype=torch.long))
    with pytest.raises(RuntimeError, match="ACCUM_TRAIN_FUSED_LOSS=0"):
        fused_loss.recorded(model, out.logits * 2.0)


def test_the_probe_runs_before_the_layers_are_compiled(tmp_path):
    """`--compile`: the probe's forward is not the compiled layers' first call, which would compile
    them for a two-token evaluation first and again for training (20-70 s each on a cold cache)."""
    from helpers import save_tiny_model
    from torch._dynamo.utils import counters

    from accum_cli.config.settings import TrainConfig
    from accum_cli.model import load as modeling
    from accum_cli.parallel.runtime import Runtime
    from accum_cli.parallel.sharding import ShardSettings

    source = modeling.resolve_source(str(save_tiny_model(tmp_path / "model")))
    config = modeling.load_config(source, False)
    torch._dynamo.reset()
    counters.clear()
    rt = Runtime(0, 0, 1, 1, torch.device("cpu"))
    model = wrap.build_replicated(source, config, TrainConfig(), ShardSettings(compile=True), rt)
    assert fused_loss.describe(model).startswith("fused")
    assert not counters["stats"]["unique_graphs"], dict(counters["stats"])
    microbatch_backward(model, microbatch(300, rows=2, seq=8), "last", True, 14, torch.device("cpu"))
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


def recorded_for(hidden: torch.Tensor, head: nn.Linear) -> fused_loss.Recorded:
    hidden = hidden.detach().requires_grad_()
    return fused_loss.Recorded(hidden, head.weight, head.bias, fused_loss._Placeholder.apply(hidden, head.out_features))


def test_no_positions_give_a_zero_weight_gradient_not_uninitialised_memory():
    """A microbatch of no positions runs no chunk: its weight gradient is zeros, as the plain
    projection's is (the buffer it would have been summed into is never written otherwise)."""
    head = nn.Linear(24, 301, bias=False)
    with torch.no_grad():
        head.weight.fill_(float("nan"))  # whatever the allocator hands back, the gradient must not read it
    torch.manual_seed(0)
    for _ in range(3):  # garbage left in freed memory is what an unwritten buffer would show
        torch.randn(301, 24).mul_(1e30)
        fused_loss.token_loss_sum(
            recorded_for(torch.randn(0, 9, 24), head), torch.zeros(0, 9, dtype=torch.long)
        ).backward()
        assert torch.equal(head.weight.grad, torch.zeros_like(head.weight))
        head.weight.grad = None


def test_a_model_that_projects_fewer_positions_than_it_has_labels_is_refused():
    """A head that saw only some positions (a model that slices its hidden states first, as
    `logits_to_keep` does) would pair each row with another position's label: refused by name."""
    head = nn.Linear(24, 301)
    rec = recorded_for(torch.randn(2, 1, 24), head)  # one position kept of nine
    with pytest.raises(RuntimeError, match="2 positions for 18 labels; set ACCUM_TRAIN_FUSED_LOSS=0"):
        fused_loss.token_loss_sum(rec, labelled(301, rows=2, seq=9))


def test_a_second_backward_through_the_fused_loss_is_refused_by_name():
    """Its gradients are scaled in place and handed to autograd the first time."""
    head = nn.Linear(24, 301)
    loss = fused_loss.token_loss_sum(recorded_for(torch.randn(2, 9, 24), head), labelled(301, rows=2, seq=9))
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        loss.backward()


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_a_rank_that_builds_on_meta_goes_with_the_ranks_that_hold_the_weights(attention):
    """Rank-0 loading: the other ranks build on meta and receive their weights by broadcast. The
    probe cannot run there (transformers' eager mask reads values: `.item()` on meta), so such a
    rank installs as the ranks with weights decide (their answer, all_ok'd, is the run's)."""
    with torch.device("meta"):
        model = tiny(attention=attention)
    assert fused_loss.install(model)
    assert fused_loss.describe(model).startswith("fused with the output projection")
