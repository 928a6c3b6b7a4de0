"""The same promise in bf16 mixed precision, the path every GPU run takes: accumulated training in
both layouts equals one big batch, within a tolerance that bf16 rounding needs and that the classic
normalisation bug exceeds many times over.

bf16 mixed precision: bf16 compute, fp32 master weights, fp32 gradient accumulation and reduction.
The sharded layout gets it from FSDP2's MixedPrecisionPolicy (bf16 copies of the parameters), the
replicated one from autocast (model/wrap.py `compute_in_bf16`). The runs fuse the output projection
with the loss (loss/fused_loss.py, bf16 GEMMs and fp32 sums: loss/fused_bf16.py) in both layouts, in
every microbatch (ACCUM_TRAIN_FUSED_LOSS=always: these hold far fewer rows than the bf16 rule fuses).
The reference is independent of the code under test: one process, no FSDP, one forward/backward per
step over the whole global batch under autocast, whole logits and Hugging Face's token-mean loss.

The tolerances, measured on 6 Dec 2026 (the data and model of test_equivalence.py, G=13, 3 steps,
the largest relative difference over the steps): the per-step loss differs from the reference by at
most 9.0e-5 (sharded, W=2, m=3, last) and the gradient norm by 3.3e-3 (sharded, W=2, m=2, every;
replicated 9.5e-4). The fused loss sums the weight's gradient over its chunks in fp32 where the
reference's one GEMM rounds it to bf16 once; with the head left alone (ACCUM_TRAIN_FUSED_LOSS=0)
4.2e-5 and 3.6e-3 (sharded, W=2, m=3, last; the replicated layout, which then rounds where the
reference does, 1.3e-5 and 5.4e-4). bf16 keeps 8 bits of mantissa, and FSDP2's
bf16 parameter copies round the weights where autocast rounds each product's inputs. Held to: loss
1e-3, gradient norm 1e-2. The classic bug (each microbatch's loss averaged on its own, then divided
by the number of microbatches, micro batch 3), run the same bf16 way, misses the reference's gradient
norm by 0.81 relative: 81 times its tolerance (and the reported loss by 4.2e-3). The test below
recomputes both.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import read_metrics, rel_err, run_cli, save_tiny_model, write_ragged_tokens
from test_equivalence import CLIP, COMMON, SEED, STEPS, G, adamw, load_rows, pad
from test_equivalence import reference as fp32_training

from accum_cli.data.batches import SampleOrder

TOL_BF16 = {"loss": 1e-3, "grad_norm": 1e-2}
CLASSIC_BUG_MARGIN = 10


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("equiv-bf16")
    save_tiny_model(root / "model")
    write_ragged_tokens(root / "data.jsonl")
    return root


def bf16_reference(model_dir: Path, rows: list[dict], micro: int | None = None) -> dict:
    """One process under autocast: each step one forward/backward over all G sequences, or (micro
    given) the classic bug: microbatches of `micro` sequences, each loss its own token mean divided
    by the number of microbatches."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    params = list(model.parameters())
    opt = adamw(params)
    order = SampleOrder(len(rows), SEED)
    losses, norms = [], []
    for step in range(STEPS):
        batch = [rows[i] for i in order.rows(range(step * G, (step + 1) * G))]
        chunks = [batch] if micro is None else [batch[i : i + micro] for i in range(0, G, micro)]
        total = 0.0
        for chunk in chunks:
            ids, mask, labels = pad(chunk)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            (loss / len(chunks)).backward()
            total += loss.item() / len(chunks)
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, CLIP)))
        losses.append(total)
        opt.step()
        opt.zero_grad()
    return {"loss": losses, "grad_norm": norms}


@pytest.fixture(scope="module")
def reference(workdir) -> dict:
    return bf16_reference(workdir / "model", load_rows(workdir / "data.jsonl"))


@pytest.fixture(scope="module")
def fp32_reference(workdir) -> dict:
    return fp32_training(workdir / "model", load_rows(workdir / "data.jsonl"))


def differences(metrics: list[dict], ref: dict) -> dict[str, float]:
    return {
        "loss": max(rel_err(m["loss"], r) for m, r in zip(metrics, ref["loss"], strict=True)),
        "grad_norm": max(rel_err(m["grad_norm"], r) for m, r in zip(metrics, ref["grad_norm"], strict=True)),
    }


CASES = [
    # (world size, micro batch, sync, layout): G=13 makes every layout ragged.
    (1, 3, "last", "replicate"),
    (2, 2, "every", "shard"),
    (2, 3, "last", "shard"),
    (2, 3, "last", "replicate"),
]


@pytest.mark.distributed
@pytest.mark.parametrize("world, micro, sync, layout", CASES, ids=lambda v: str(v))
def test_bf16_accumulated_training_equals_one_big_batch(
    workdir, reference, fp32_reference, tmp_path, world, micro, sync, layout
):
    out = tmp_path / "run"
    args = ["--model", str(workdir / "model"), "--dataset", str(workdir / "data.jsonl"), "--precision", "bf16",
            "--micro-batch", str(micro), "--sync", sync, "--layout", layout, "--output-dir", str(out), "--verbose",
            *COMMON]  # fmt: skip
    # The output projection fused with the loss (loss/fused_loss.py), against a reference that is not: in
    # every microbatch, which holds far fewer rows than the bf16 rule fuses (fused_loss.fuses).
    result = run_cli(args, nproc=world, env_extra={"ACCUM_TRAIN_FUSED_LOSS": "always"})
    assert result.returncode == 0, result.stdout + result.stderr
    assert "bf16" in result.stdout.split("sharding", 1)[1].splitlines()[0], result.stdout
    assert "fused with the output projection (bf16 GEMMs, fp32 sums)" in result.stdout, result.stdout
    metrics = read_metrics(out)
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    found = differences(metrics, reference)
    print(f"bf16 W={world} m={micro} {sync} {layout}: {found}")
    assert all(found[k] < TOL_BF16[k] for k in TOL_BF16), found
    # and it did compute in bf16: the fp32 training is further away than fp32's own rounding (1e-7)
    assert differences(metrics, fp32_reference)["grad_norm"] > 1e-4, "the run trained in fp32"


def test_the_classic_bug_exceeds_the_bf16_tolerance_tenfold(workdir, reference):
    """The same bf16 reference with each microbatch's loss averaged on its own: its gradient norm
    misses the reference's by more than ten times the tolerance the layouts are held to."""
    naive = bf16_reference(workdir / "model", load_rows(workdir / "data.jsonl"), micro=3)
    found = differences(
        [{"loss": a, "grad_norm": b} for a, b in zip(naive["loss"], naive["grad_norm"], strict=True)], reference
    )
    print(f"classic bug in bf16: {found}, tolerance {TOL_BF16}")
    assert found["grad_norm"] > CLASSIC_BUG_MARGIN * TOL_BF16["grad_norm"], found


def test_bf16_runs_in_the_precision_it_says(workdir, tmp_path):
    """The header's claim checked against the computation: the replicated layout's forward runs its
    matmuls in bf16 (autocast), its parameters and gradients stay fp32."""
    from transformers import AutoModelForCausalLM

    from accum_cli.model import wrap

    model = AutoModelForCausalLM.from_pretrained(workdir / "model", dtype=torch.float32)
    wrap.compute_in_bf16(model, torch.device("cpu"))
    seen = []
    hook = model.model.layers[0].mlp.down_proj.register_forward_hook(lambda m, a, out: seen.append(out.dtype))
    try:
        out = model(input_ids=torch.tensor([[5, 6, 7]]), labels=torch.tensor([[5, 6, 7]]))
    finally:
        hook.remove()
    out.loss.backward()
    assert seen == [torch.bfloat16]
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert {p.grad.dtype for p in model.parameters() if p.grad is not None} == {torch.float32}


@pytest.mark.distributed
def test_a_bf16_resume_continues_the_same_training(workdir, tmp_path, world=2, layout="shard"):
    """Checkpoints hold the fp32 master weights and AdamW state whatever the compute dtype: a bf16
    run resumed from its step-2 checkpoint gives the uninterrupted run's step 3 (sharded on two
    ranks, as a GPU run is; the replicated layout's checkpoints are the same fp32 state)."""
    common = ["--model", str(workdir / "model"), "--dataset", str(workdir / "data.jsonl"), "--precision", "bf16",
              "--micro-batch", "2", "--layout", layout, *COMMON]  # fmt: skip
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    done = run_cli([*common, "--output-dir", str(whole), "--checkpoint-every", "1"], nproc=world)
    assert done.returncode == 0, done.stdout + done.stderr
    again = run_cli([*common, "--output-dir", str(resumed), "--resume", str(whole / "checkpoints/step-000002")],
                    nproc=world)  # fmt: skip
    assert again.returncode == 0, again.stdout + again.stderr
    (last,) = read_metrics(resumed)
    expected = read_metrics(whole)[-1]
    assert last["step"] == expected["step"] == STEPS
    assert rel_err(last["loss"], expected["loss"]) < 1e-6 and rel_err(last["grad_norm"], expected["grad_norm"]) < 1e-6
