"""The loss and the gradient reduction are the ones PyTorch would compute, with less memory:
the cross-entropy against `F.cross_entropy`, the gloo reduce-scatter against gloo's own, each
with the bytes it holds measured by PyTorch's MemTracker."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers import REPO, launch, save_tiny_model
from torch.distributed._tools.mem_tracker import MemTracker

from accum_cli.data.store import IGNORE_INDEX
from accum_cli.loss import tokens as loss
from accum_cli.loss.tokens import token_loss_sum


def reference(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The textbook shifted cross-entropy, as the HF models compute it."""
    vocab = logits.size(-1)
    shifted = logits[:, :-1].reshape(-1, vocab).float()
    return F.cross_entropy(shifted, labels[:, 1:].reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum")


def batch(dtype: torch.dtype, vocab: int = 301, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(3, 17, vocab, generator=g) * 3).to(dtype)
    labels = torch.randint(0, vocab, (3, 17), generator=g)
    labels[0, :5] = IGNORE_INDEX  # a prompt
    labels[2, 9:] = IGNORE_INDEX  # padding
    return logits, labels


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_elements", [loss.CHUNK_ELEMENTS, 1000, 1])  # one chunk, 3 rows, 1 row
def test_the_sum_and_its_gradient_are_cross_entropys(monkeypatch, dtype, chunk_elements):
    monkeypatch.setattr(loss, "CHUNK_ELEMENTS", chunk_elements)
    logits, labels = batch(dtype)
    want_leaf, got_leaf = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    want, got = reference(want_leaf, labels), token_loss_sum(got_leaf, labels)
    (want * 0.37).backward()
    (got * 0.37).backward()
    assert got.dtype == torch.float32
    assert torch.allclose(got, want, rtol=1e-6, atol=0), (float(got), float(want))
    assert got_leaf.grad.dtype == dtype
    scale = want_leaf.grad.float().abs().max()
    assert (got_leaf.grad.float() - want_leaf.grad.float()).abs().max() <= 1e-6 * scale
    assert not got_leaf.grad[2, 8:].any(), "positions predicting ignored labels get no gradient"


def test_what_does_not_count_cannot_poison_the_sum():
    logits, labels = batch(torch.float32)
    logits[2, 12] = float("nan")  # predicts an ignored label
    assert torch.isfinite(token_loss_sum(logits, labels))
    labels[:] = IGNORE_INDEX
    assert float(token_loss_sum(logits, labels)) == 0.0
    logits[0, 7, 3] = float("inf")  # ... while a position that counts is reported, not hidden
    labels[0, 8] = 4
    assert not torch.isfinite(token_loss_sum(logits, labels))


def peak_bytes(fn, *tensors) -> int:
    tracker = MemTracker()
    tracker.track_external(*tensors)
    with tracker:
        fn()
    return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]


def test_forward_and_backward_hold_the_logits_and_one_gradient():
    """F.cross_entropy on shifted logits holds the logits, their shifted copy, log_softmax's output
    and its gradient: about four logits' worth. This holds two: the logits and their gradient."""
    logits, labels = batch(torch.float32, vocab=4096)
    size = logits.numel() * logits.element_size()

    def step(compute):
        def run():
            leaf = logits.clone().requires_grad_()
            compute(leaf, labels).backward()
            del leaf

        return run

    ours, textbook = peak_bytes(step(token_loss_sum), logits, labels), peak_bytes(step(reference), logits, labels)
    print(f"peak in logits' sizes: ours {ours / size:.2f}, F.cross_entropy {textbook / size:.2f}")
    assert ours < 3.2 * size, ours / size  # the input, its clone and one gradient, with row vectors
    assert textbook > 4 * size, textbook / size  # so the measurement can tell them apart


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_fake_tensors_two_chunks_give_the_peak_of_all_of_them(monkeypatch, dtype):
    """The memory estimate runs the loss on fake tensors (runtime.simulated), where every chunk costs
    the same time: it runs the first and the last chunk only, so its time does not grow with the micro
    batch. The peak it measures is that of every chunk run (chunks of 5 rows here: 21 of them, the last
    shorter)."""
    from accum_cli import torch_compat
    from accum_cli.parallel import runtime

    monkeypatch.setattr(loss, "CHUNK_ELEMENTS", 5 * 4096)
    calls = []
    logsumexp = torch.logsumexp
    monkeypatch.setattr(torch, "logsumexp", lambda *a, **k: calls.append(1) or logsumexp(*a, **k))

    def peak_and_chunks() -> tuple[int, int]:
        calls.clear()
        with torch_compat.FakeTensorMode():
            logits, labels = torch.randn(2, 51, 4096, dtype=dtype), torch.randint(0, 4096, (2, 51))
            peak = peak_bytes(step_of(logits, labels), logits, labels)
        return peak, len(calls)

    def step_of(logits, labels):
        def run():
            leaf = logits.clone().requires_grad_()
            token_loss_sum(leaf, labels).backward()

        return run

    with runtime.simulated():
        fast = peak_and_chunks()
    every = peak_and_chunks()  # every chunk, as in a run
    assert fast == (every[0], 2) and every[1] == 21, (fast, every)


def test_a_microbatch_frees_its_logits_before_the_output_projections_backward(tmp_path):
    """The step's own code (loop.microbatch_backward) keeps no reference to the model's output
    through backward: the logits are gone once the loss's backward has run, before the output
    projection computes its gradients (with a 32K vocabulary, one logits' worth less at the peak)."""
    import weakref

    from transformers import AutoModelForCausalLM

    from accum_cli.data.batches import Microbatch
    from accum_cli.step.loop import microbatch_backward

    model = AutoModelForCausalLM.from_pretrained(save_tiny_model(tmp_path / "model"), dtype=torch.float32)
    model.train()
    logits, alive_at_head = [], []
    model.register_forward_hook(lambda module, args, kwargs, out: logits.append(weakref.ref(out.logits)),
                                with_kwargs=True)  # fmt: skip
    head = model.get_output_embeddings()
    head.register_full_backward_pre_hook(lambda module, grad: alive_at_head.append(logits[-1]() is not None))
    ids = torch.randint(3, 300, (2, 12), generator=torch.Generator().manual_seed(0))
    microbatch_backward(model, Microbatch(ids, torch.ones_like(ids), ids.clone()), "every", True, 22,
                        torch.device("cpu"))  # fmt: skip
    assert alive_at_head == [False]
    assert head.weight.grad is not None


def reduce_scatter_on_this_rank() -> tuple[bool, int, int, int]:
    """On a rank of a gloo world (torchrun's environment): whether our reduce-scatter sums as gloo's own does,
    the peak bytes each of the two holds, and the staging buffer's bytes."""
    from accum_cli.cpu.gloo import InPlaceReduceScatter

    dist.init_process_group("gloo")
    try:
        world, rank = dist.get_world_size(), dist.get_rank()
        g = torch.Generator().manual_seed(rank)
        grads = torch.randn(world * 2**18, generator=g)  # 1 MiB per rank
        want = torch.empty(2**18)
        dist.reduce_scatter_single(want, grads.clone())
        comm = InPlaceReduceScatter()
        staging = comm.allocate((grads.numel(),), dtype=torch.float32, device=torch.device("cpu"))
        staging.copy_(grads)
        got = comm.allocate((2**18,), dtype=torch.float32, device=torch.device("cpu"))

        def gloos_own():
            dist.reduce_scatter_single(got, staging)

        def ours():
            comm(got, staging, dist.group.WORLD, dist.ReduceOp.SUM)

        staging_copy = staging.clone()
        theirs_peak = peak_bytes(gloos_own, staging, got)
        staging.copy_(staging_copy)
        ours_peak = peak_bytes(ours, staging, got)
        return torch.equal(got, want), ours_peak, theirs_peak, staging.numel() * 4
    finally:
        dist.destroy_process_group()


REDUCE_SCATTER_RANK = """
import json, os
from test_loss import reduce_scatter_on_this_rank
# One write per line: the ranks share stdout, unbuffered (print writes the line and its end apart).
os.write(1, (json.dumps([int(os.environ["RANK"]), *reduce_scatter_on_this_rank()]) + "\\n").encode())
"""


def test_the_gloo_reduce_scatter_sums_like_gloos_own_without_its_copy():
    """FSDP's gradient reduce-scatter on gloo ranks (model.shard sets it on every unit there)."""
    world = 2
    done = launch(REDUCE_SCATTER_RANK, [], ranks=world, kind="code", cwd=REPO / "tests", timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    results = {row[0]: row[1:] for row in map(json.loads, filter(None, done.stdout.splitlines()))}
    assert sorted(results) == list(range(world)), done.stdout
    for rank in range(world):
        same, ours, theirs, staging = results[rank]
        assert same, f"rank {rank}: the sums differ from gloo's reduce-scatter"
        assert ours <= staging * (1 + 1 / world), (rank, ours, staging)  # staging and the shard, no more
        assert theirs >= ours + staging, (rank, theirs, ours)  # gloo's copies the whole input first
