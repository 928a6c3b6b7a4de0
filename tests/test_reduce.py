"""The gradient sum over ranks: the replicated layout's (accum_cli/parallel/reduce.py) exact, launched during
the last backward, in the same order on every rank, with bounded extra memory."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import REPO, launch
from torch import nn

from accum_cli.parallel import reduce

MIB = 2**20


def test_buckets_follow_the_order_close_at_their_cap_and_never_mix_dtypes():
    f32, f64 = torch.float32, torch.float64
    # A model of 400 MiB: DDP's caps (1 MiB first, then 25 MiB).
    sizes = [MIB // 2, MIB // 2, 10 * MIB, 10 * MIB, 10 * MIB, 3 * MIB, 366 * MIB]
    assert reduce.bucket_plan(sizes, [f32] * 7) == [[0, 1], [2, 3, 4], [5, 6]]
    # A dtype change closes a bucket, whatever its fill.
    assert reduce.bucket_plan([MIB // 4, 8, MIB // 4], [f32, f64, f32]) == [[0], [1], [2]]
    # A small model (16 MiB) is still split: an eighth of it per bucket after the first.
    plan = reduce.bucket_plan([MIB] * 16, [f32] * 16)
    assert plan == [[0], [1, 2], [3, 4], [5, 6], [7, 8], [9, 10], [11, 12], [13, 14], [15]]


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(5))
        self.unused = nn.Linear(16, 16)

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x.sum()


class Work:
    """A stand-in for a collective's handle: the 'other rank' doubles the bucket when waited on."""

    live: list[Work] = []

    def __init__(self, flat: torch.Tensor) -> None:
        self.flat = flat
        Work.live.append(self)

    def wait(self) -> None:
        self.flat.mul_(2)
        Work.live.remove(self)


def test_the_sum_lands_in_every_gradient_with_two_buckets_in_flight_at_most(monkeypatch):
    """In one process, with a collective that doubles: every gradient comes back doubled, a
    parameter no rank has a gradient for keeps none, at most MAX_IN_FLIGHT buckets are ever outstanding, and
    the first launches happen while backward still runs."""
    monkeypatch.setattr(reduce, "FIRST_BUCKET_BYTES", 16 * 16 * 4)
    monkeypatch.setattr(reduce, "BUCKET_BYTES", 16 * 16 * 4)
    torch.manual_seed(0)
    model = Tiny()
    x = torch.randn(3, 16)
    model(x).backward()
    local = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    arrived, outstanding = [], []
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: arrived.append(p))

    def collective(flat):
        outstanding.append(len(Work.live) + 1)
        return Work(flat) if len(arrived) > 0 else None

    with reduce.summed_over_ranks(model, collective):
        model(x).backward()
    assert max(outstanding) <= reduce.MAX_IN_FLIGHT + 1  # the third is launched, then the first lands
    assert not Work.live
    for name, p in model.named_parameters():
        if name.startswith("unused"):  # no gradient here nor on the 'other rank': none, as in one process
            assert p.grad is None
        else:
            torch.testing.assert_close(p.grad, 2 * 2 * local[name], rtol=0, atol=0)  # accumulated twice, summed


def test_a_failed_backward_leaves_no_hook_behind():
    model = Tiny()
    launched = []
    with pytest.raises(RuntimeError, match="boom"), reduce.summed_over_ranks(model, launched.append):
        raise RuntimeError("boom")
    model(torch.randn(2, 16)).backward()
    assert not launched


def test_a_gradient_accumulated_twice_in_the_last_backward_is_refused_not_half_summed():
    model = Tiny()
    x = torch.randn(2, 16)
    with pytest.raises(RuntimeError, match="accumulated twice"), reduce.summed_over_ranks(model, lambda flat: None):
        model(x).backward()
        model(x).backward()


@pytest.mark.distributed
def test_two_gloo_ranks_sum_exactly_and_launch_the_same_buckets_in_order_during_backward(tmp_path):
    out = tmp_path / "reduce.json"
    result = launch(str(REPO / "tests/reduce_probe.py"), [str(out)], ranks=2, kind="path", timeout=120)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    ranks = [json.loads(out.with_name(f"reduce.json.{r}").read_text()) for r in range(2)]
    for rank in ranks:
        assert max(rank["errors"].values()) < 1e-6, rank["errors"]
        # No rank had a gradient for `never`: it keeps none (the optimizer skips it, as in one
        # process); rank 1 had none for `rank0_only` either, but rank 0 had one: it gets the sum.
        assert rank["no_grad"] == ["never.weight", "never.bias"]
        # Overlapped: the buckets of the last three layers (the first gradients backward gives) left
        # before its last gradient arrived; the fourth holds a layer no rank used in this microbatch.
        early = [x for x in rank["launches"] if x["arrived"] < rank["arrived_in_last"]]
        assert len(early) == 3, rank["launches"]
    # Same collectives in the same order on both ranks, though rank 1 never saw one layer's gradient.
    shapes = [[(x["numel"], x["dtype"]) for x in rank["launches"]] for rank in ranks]
    assert shapes[0] == shapes[1]
    assert ("2", "torch.float64") in {(str(n), d) for n, d in shapes[0]}  # the float64 scalar and its flag
    assert ranks[0]["arrived_in_last"] > ranks[1]["arrived_in_last"]


@pytest.mark.distributed
@pytest.mark.parametrize(
    "sync, precision", [("every", "fp32"), ("every", "bf16"), ("last", "fp32"), ("last", "bf16"), ("replicate", "fp32")]
)
def test_sharded_ranks_that_use_different_parameters_train_as_one_process(tmp_path, sync, precision):
    """The sharded layout (FSDP2), two steps of the run's own train_step: a layer only rank 0 uses
    in the first step (an expert no token of rank 1 reached) and one no rank ever uses. Zeros stand
    in for a missing gradient, so the ranks' reduce-scatters stay alike (without them gloo aborts
    the run); a parameter no rank had a gradient for in a step keeps none, so AdamW leaves it
    alone, as in one process: the unused layer is never decayed, the expert is not moved by its
    momentum in the second step. In bf16 (fp32 reduction, as on a GPU; FSDP then accumulates in
    fp32 between microbatches) the zeros must be fp32 too, or FSDP refuses the unit's mixed dtypes.
    In the second step a placeholder microbatch (first on one rank, last on the other) reaches the
    expert no real token of that step reached: no use of it, in either layout (`replicate`)."""
    out = tmp_path / "shard.json"
    result = launch(str(REPO / "tests/shard_probe.py"), [str(out), sync, precision], ranks=2, kind="path", timeout=120)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for rank in range(2):
        probe = json.loads(out.with_name(f"shard.json.{rank}").read_text())
        assert {"layers.1.rare.weight", "layers.0.never.weight", "head.weight"} <= probe["errors"].keys()
        if precision == "fp32":
            assert max(probe["errors"].values()) < 1e-6, probe["errors"]
        else:  # bf16 weights: the expert moved by its first step alone (its momentum would double it)
            rare, expected = probe["moved"]["layers.1.rare.weight"], probe["reference_moved"]["layers.1.rare.weight"]
            assert abs(rare - expected) < 0.25 * expected, (rare, expected)
        assert probe["moved"]["layers.0.never.weight"] == probe["moved"]["layers.0.never.bias"] == 0.0
        assert probe["moved"]["frozen"] == 0.0
        trained = {name: moved for name, moved in probe["moved"].items() if ".never." not in name and name != "frozen"}
        assert min(trained.values()) > 1e-3, trained  # every other parameter was
