"""The output projection fused with the loss (fused_loss.py) computes what the projection and then
the loss compute, holds less, and is used only on models that hand their logits out untouched."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F
import transformers
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


def bf16_steps(layout: str, vocab: int = 301, bias: bool = True):
    """The head's step on one input, three ways: the fused bf16 loss, the unfused bf16 projection and
    loss as the layout computes them (FSDP2's bf16 copies, or autocast over fp32 master weights), and
    exactly (fp64) on the values the bf16 products read. Each: [loss, hidden's, weight's, bias's gradient]."""
    torch.manual_seed(1)
    hidden, head, labels = torch.randn(3, 17, 24), nn.Linear(24, vocab, bias=bias), labelled(vocab)
    with torch.no_grad():
        head.weight.mul_(4)  # logits of a few units, where bf16's rounding of them shows
    operands = [t.detach() for t in (hidden, head.weight, head.bias) if t is not None]

    def run(compute, leaves):
        leaves = [t.detach().clone().requires_grad_() for t in leaves]
        loss = compute(leaves)
        (loss * 0.37).backward()
        return [loss.detach(), *(leaf.grad for leaf in leaves)]

    def fused(leaves):
        if layout == "bf16 copies":  # FSDP2's: the hidden state and the gathered weight are bf16
            leaves = [t.bfloat16() for t in leaves]
        placeholder = fused_loss._Placeholder.apply(leaves[0], vocab)
        rec = fused_loss.Recorded(leaves[0], leaves[1], leaves[2] if bias else None, placeholder, dtype=torch.bfloat16)
        return fused_loss.token_loss_sum(rec, labels)

    def unfused(leaves):
        if layout == "bf16 copies":
            return token_loss_sum(F.linear(*(t.bfloat16() for t in leaves)), labels)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return token_loss_sum(F.linear(*leaves), labels)

    exact = run(lambda leaves: token_loss_sum(F.linear(*leaves), labels), [t.bfloat16().double() for t in operands])
    return run(fused, operands), run(unfused, operands), exact


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm())


@pytest.mark.parametrize("layout", ["autocast", "bf16 copies"])
@pytest.mark.parametrize("rows_per_chunk", [10**6, 7, 1])  # one chunk, several (the last shorter), a row each
def test_in_bf16_the_fused_sums_are_the_unfused_ones_or_nearer_the_exact(monkeypatch, layout, rows_per_chunk):
    """bf16 GEMMs, fp32 sums (fused_bf16.py), against the unfused bf16 step and the exact sums of the
    same bf16 values: each of the loss and the hidden state's, weight's and bias's gradients is at most
    1.05x as far from the exact one as the unfused one is (measured: the loss 5.3e-5 for both, from the
    same bf16 logits, its sums' order aside; the gradients 0.55-0.85x as far, 1.7e-3 to 2.6e-3 against
    3.0e-3 to 3.3e-3, at any chunk size), and the two lie within 2^-7 of each other, a bf16 rounding's
    worth on each side (the loss: the bf16 tolerance of test_equivalence_bf16.py)."""
    from test_equivalence_bf16 import TOL_BF16

    from accum_cli.loss import fused_bf16

    monkeypatch.setattr(fused_bf16, "CPU_CHUNK_ELEMENTS", rows_per_chunk * 301)
    monkeypatch.setattr(fused_bf16, "PARTIAL_ELEMENTS", 100 * 24)  # the weight's gradient in blocks of 100 rows
    got, unfused, exact = bf16_steps(layout)
    for name, o, u, e in zip(("loss", "hidden", "weight", "bias"), got, unfused, exact, strict=True):
        print(f"{layout} {name}: fused {relative(o, e):.2e}, unfused {relative(u, e):.2e} from exact")
        assert relative(o, e) <= 1.05 * relative(u, e), name
        assert relative(o, u) <= (TOL_BF16["loss"] if name == "loss" else 2**-7), name
    assert not got[1][2, 8:].any(), "positions predicting ignored labels get no gradient"


def test_in_bf16_an_ignored_rows_non_finite_state_cannot_poison_the_sums():
    vocab = 50
    hidden, head, labels = torch.randn(3, 17, 8), nn.Linear(8, vocab), labelled(vocab)
    hidden[2, 12] = float("nan")  # predicts an ignored label
    leaves = [t.detach().bfloat16().requires_grad_() for t in (hidden, head.weight, head.bias)]
    rec = fused_loss.Recorded(*leaves, fused_loss._Placeholder.apply(leaves[0], vocab), dtype=torch.bfloat16)
    loss = fused_loss.token_loss_sum(rec, labels)
    loss.backward()
    assert torch.isfinite(loss) and all(bool(leaf.grad.isfinite().all()) for leaf in leaves[1:])


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_the_bf16_products_are_the_devices_own(device):
    """On fake tensors standing for the run's device (as in the memory estimate): a GPU's gradient
    products are torch.mm's bf16 GEMMs with fp32 out (an op no CPU kernel has, whose fake form checks
    its operands); a CPU's are fp32 products of fp32 copies (cpu/bf16.py). The gradients in the dtypes
    the unfused step gives them, on both: bf16 for FSDP2's bf16 copies, fp32 for autocast's fp32
    hidden state and master weights."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from accum_cli.cpu import bf16 as cpu_bf16
    from accum_cli.parallel import runtime

    calls = []
    mm = torch.mm

    def spy(a, b, **kwargs):  # ours, not fake mode's own (its addmm, F.linear's with a bias, calls mm in fp32)
        if sys._getframe(1).f_globals["__name__"] in ("accum_cli.loss.fused_bf16", "accum_cli.cpu.bf16"):
            calls.append((a.dtype, b.dtype, kwargs.get("out_dtype")))
        return mm(a, b, **kwargs)

    with FakeTensorMode(), runtime.simulated(device), pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch, "mm", spy)
        for dtype in (torch.bfloat16, torch.float32):
            hidden = torch.randn(4, 64, 32, dtype=dtype, requires_grad=True)
            weight = torch.randn(1000, 32, dtype=dtype, requires_grad=True)
            bias = torch.randn(1000, dtype=dtype, requires_grad=True)
            placeholder = fused_loss._Placeholder.apply(hidden, 1000)
            rec = fused_loss.Recorded(hidden, weight, bias, placeholder, dtype=torch.bfloat16)
            fused_loss.token_loss_sum(rec, torch.randint(0, 1000, (4, 64))).backward()
            assert (hidden.grad.dtype, weight.grad.dtype, bias.grad.dtype) == (dtype,) * 3
    if device == "cuda":
        assert calls and {(a, b) for a, b, _ in calls} == {(torch.bfloat16, torch.bfloat16)}
        assert {out for *_, out in calls} == {torch.float32}
    else:
        assert calls and {(a, b, out) for a, b, out in calls} == {(torch.float32, torch.float32, None)}
    assert cpu_bf16.mm.__module__ == "accum_cli.cpu.bf16"


@pytest.mark.parametrize("layout", ["replicate", "shard"])
def test_a_bf16_model_trains_fused_as_unfused(monkeypatch, layout):
    """The run's own microbatch step in bf16, the head fused (ACCUM_TRAIN_FUSED_LOSS=always: the rule
    leaves so few rows unfused) and left alone (=0), in each layout: autocast over fp32 master
    weights, and FSDP2's bf16 copies on a one-rank mesh. The loss and the gradient norm within the
    bf16 tolerance of test_equivalence_bf16.py, the head's weight gradient within 2^-7 (measured,
    replicated and sharded: the same loss, gradient norm 3.5e-4 and 4.1e-4 apart, the head's weight
    1.7e-3 and 1.1e-3); the fused loss computed in bf16, in chunks of 5 rows."""
    import torch.distributed as dist
    from test_equivalence_bf16 import TOL_BF16
    from torch.distributed.device_mesh import init_device_mesh

    from accum_cli.loss import fused_bf16
    from accum_cli.parallel.sharding import ShardSettings

    if layout == "shard":
        dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())  # conftest ends it
        mesh = init_device_mesh("cpu", (1,))
    monkeypatch.setattr(fused_bf16, "CPU_CHUNK_ELEMENTS", 5 * 384)  # 11 chunks of 5 rows
    mb = microbatch(384)
    computed_in = []
    fused_sum = fused_bf16.token_loss_sum
    monkeypatch.setattr(fused_bf16, "token_loss_sum", lambda *args: computed_in.append(args[-1]) or fused_sum(*args))
    found = {}
    for setting in ("0", "always"):
        monkeypatch.setenv("ACCUM_TRAIN_FUSED_LOSS", setting)
        model = tiny()
        if layout == "shard":
            wrap.shard(model, mesh, ShardSettings(bf16=True))
        else:
            wrap.prepare_replicated(model, ShardSettings(bf16=True), torch.device("cpu"))
        assert fused_loss.describe(model, bf16=True).startswith("fused" if setting != "0" else "after")
        loss, _ = microbatch_backward(model, mb, "last", True, 41, torch.device("cpu"))
        grads = [p.grad.full_tensor() if layout == "shard" else p.grad for p in model.parameters()]
        head = model.get_output_embeddings().weight.grad
        found[setting] = (float(loss), float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))),
                          head.full_tensor() if layout == "shard" else head)  # fmt: skip
    assert computed_in == [torch.bfloat16], "the fused loss computes in bf16, as the unfused projection does"
    (want_loss, want_norm, want_head), (got_loss, got_norm, got_head) = found["0"], found["always"]
    print(f"bf16 {layout}: loss {got_loss} vs {want_loss}, gradient norm {got_norm} vs {want_norm}, "
          f"head's weight {relative(got_head, want_head):.1e}")  # fmt: skip
    assert abs(got_loss - want_loss) < TOL_BF16["loss"] * abs(want_loss)
    assert abs(got_norm - want_norm) < TOL_BF16["grad_norm"] * want_norm
    assert relative(got_head, want_head) <= 2**-7


def allocated_peak(fn) -> int:
    """The most bytes the CPU allocator held at once while `fn` ran, beyond what it held before it:
    from the profiler's record of every allocation and free, so also those inside torch's
    linear_cross_entropy kernel, a custom op, whose buffers PyTorch's MemTracker does not see."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted(
        (e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"), key=lambda e: e.start_ns()
    )
    held = peak = 0
    for event in events:
        held += event.nbytes()
        peak = max(peak, held)
    return peak


def test_the_fused_loss_holds_less_than_whole_logits(monkeypatch):
    """A large vocabulary against a small model: the fused step's peak lies more than a logits'
    worth below the unfused one's (which holds the logits and their gradient, 8 MiB each).
    Measured: 2.7 MiB against 17.2; the fused loss's logits in one chunk, 10.3."""
    monkeypatch.setattr(fused_loss, "CHUNK_ELEMENTS", 16 * 8192)  # chunks of 16 rows: 0.5 MiB
    mb = microbatch(8192, rows=4, seq=64)
    logits_bytes = 4 * 64 * 8192 * 4
    peaks = {}
    for fused in (False, True):
        model = tiny(vocab=8192)
        if fused:
            assert fused_loss.install(model)
        peaks[fused] = allocated_peak(
            lambda model=model: microbatch_backward(model, mb, "last", True, 200, torch.device("cpu"))
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


def test_the_probe_runs_before_the_layers_are_compiled(tmp_path, monkeypatch):
    """`--compile`: the probe's forward is not the compiled layers' first call, which would compile
    them for a two-token evaluation first and again for training (20-70 s each on a cold cache).
    Dynamo's count of the graphs it captured is the proof; they are handed to its eager backend, not
    to inductor, whose code generation (~25 s of CPU on a cold cache) this test does not look at."""
    import functools

    from helpers import save_tiny_model
    from torch._dynamo.utils import counters

    from accum_cli.config.settings import TrainConfig
    from accum_cli.model import load as modeling
    from accum_cli.parallel.runtime import Runtime
    from accum_cli.parallel.sharding import ShardSettings

    source = modeling.resolve_source(str(save_tiny_model(tmp_path / "model")))
    config = modeling.load_config(source, False)
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
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


def fused_memory_bench():
    import importlib.util

    from helpers import REPO

    spec = importlib.util.spec_from_file_location("bench_fused_memory", REPO / "bench" / "fused_memory.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_in_bf16_the_head_fuses_only_from_the_rows_where_it_holds_less(device):
    """fused_loss.fuses against bench/fused_memory.py's count of both loss steps (hidden 2048, a 32K and
    a 128K vocabulary, both bf16 forms, on fake tensors as the memory estimate counts them): at the
    hidden size's rows whole logits hold less and the rule leaves the head alone; from the rule's
    least rows on the fused step holds less and the rule fuses. In fp32 it fuses any rows."""
    bench = fused_memory_bench()
    hidden = 2048
    assert fused_loss.fuses(1, hidden, 32768, torch.float32)
    assert fused_loss.bf16_min_rows(hidden, hidden) is None  # logits no larger than the head's input: never
    assert not fused_loss.fuses(10**9, hidden, hidden, torch.bfloat16)
    for vocab in (32768, 131072):
        least = fused_loss.bf16_min_rows(hidden, vocab)
        assert not fused_loss.fuses(hidden, hidden, vocab, torch.bfloat16)
        assert not fused_loss.fuses(least - 1, hidden, vocab, torch.bfloat16)
        assert fused_loss.fuses(least, hidden, vocab, torch.bfloat16)
        for precision in bench.PRECISIONS[1:]:
            found = {}
            for rows in (hidden, least, 2 * least):
                fused, unfused = (bench.counted(f, precision, rows, hidden, vocab, device, estimate=True)
                                  for f in (True, False))  # fmt: skip
                found[rows] = round(fused / unfused, 2)
            print(f"{device} {vocab} {precision}: fused/unfused by rows {found}")
            assert found[hidden] > 1 and found[least] < 1 and found[2 * least] < 1, (vocab, precision, found)


@pytest.mark.parametrize("layout", ["replicate", "shard"])
@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_the_memory_estimate_fuses_where_the_run_would(monkeypatch, layout, device):
    """The estimate (memory/measure.py, in this process) runs the step on fake tensors standing for the
    run's device: under bf16 its microbatches fuse from the rule's least rows on and not below, with
    that device's products (cpu/bf16.py on a CPU alone); in fp32 at any rows."""
    import json

    from transformers import LlamaConfig

    from accum_cli.cpu import bf16 as cpu_bf16
    from accum_cli.memory import measure
    from accum_cli.memory.query import Query

    config = LlamaConfig(vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
    seq = 32
    switch = -(-fused_loss.bf16_min_rows(64, 4096) // seq)  # the least micro batch that fuses
    seen, operands = [], []
    recorded = fused_loss.recorded
    monkeypatch.setattr(fused_loss, "recorded", lambda *a: seen.append(r := recorded(*a)) or r)
    operand = cpu_bf16.operand
    monkeypatch.setattr(cpu_bf16, "operand", lambda *a: operands.append(1) or operand(*a))
    for bf16 in (True, False):
        for m in (switch - 1, switch):
            seen.clear()
            query = Query(json.loads(config.to_json_string()), 2, 1, m, seq, "every", bf16, False,
                          replicated=layout == "replicate", device_type=device)  # fmt: skip
            measure.Measurer().measure([query])
            fused = [r is not None for r in seen]
            assert fused == [not bf16 or m >= switch] * 2, (bf16, m, fused)
    assert bool(operands) == (device == "cpu"), "a CPU's bf16 products only where the run's device is the CPU"
