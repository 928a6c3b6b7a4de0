"""The heart: accumulated, sharded training equals one big batch (docs/ARCHITECTURE.md, invariant 1).

A tiny Llama saved to a folder and a pre-tokenised dataset with very different loss-token
counts per row go through the real CLI (`python -m accum_cli`, `torchrun -m accum_cli`).
The reference is independent of the code under test: one process, no FSDP, one
forward/backward over the whole global batch with Hugging Face's standard token-mean loss.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import (
    assert_complete_hf_model,
    probe_logits,
    read_metrics,
    rel_err,
    run_cli,
    run_cli_after,
    save_tiny_model,
    write_ragged_tokens,
)

from accum_cli.data.batches import SampleOrder
from accum_cli.memory.query import Query

G, STEPS, SEED, LR, CLIP, WD = 13, 3, 5, 2e-3, 1.0, 0.1
TOL = 1e-5
COMMON = [
    "--global-batch", str(G), "--max-steps", str(STEPS), "--seed", str(SEED), "--lr", str(LR),
    "--warmup-steps", "0", "--lr-schedule", "constant", "--grad-clip", str(CLIP),
    "--weight-decay", str(WD),
]  # fmt: skip


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("equiv")
    save_tiny_model(root / "model")
    save_tiny_model(root / "model-tied", tied=True)
    write_ragged_tokens(root / "data.jsonl")
    return root


def load_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def pad(rows: list[dict]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    width = max(len(r["input_ids"]) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        ids[i, :n], labels[i, :n], mask[i, :n] = torch.tensor(r["input_ids"]), torch.tensor(r["labels"]), 1
    return ids, mask, labels


def adamw(params: list) -> torch.optim.Optimizer:
    """AdamW as accum-train builds it: weight decay on matrices only."""
    return torch.optim.AdamW(
        [
            {"params": [p for p in params if p.ndim >= 2], "weight_decay": WD},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
        ],
        lr=LR,
        betas=(0.9, 0.95),
        eps=1e-8,
    )


def reference(model_dir: Path, rows: list[dict]) -> dict:
    """One process, no sharding, one forward/backward per step over all G sequences."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    params = list(model.parameters())
    opt = adamw(params)
    order = SampleOrder(len(rows), SEED)
    losses, norms = [], []
    for step in range(STEPS):
        batch = [rows[i] for i in order.rows(range(step * G, (step + 1) * G))]
        ids, mask, labels = pad(batch)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss  # HF's token mean
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, CLIP)))
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return {
        "loss": losses,
        "grad_norm": norms,
        "params": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "logits": probe_logits(model),
    }


@pytest.fixture(scope="module")
def references(workdir) -> dict:
    rows = load_rows(workdir / "data.jsonl")
    return {name: reference(workdir / name, rows) for name in ("model", "model-tied")}


def assert_same_training(out: Path, ref: dict) -> None:
    metrics = read_metrics(out)
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    for m, loss, norm in zip(metrics, ref["loss"], ref["grad_norm"], strict=True):
        assert rel_err(m["loss"], loss) < TOL, (m["step"], m["loss"], loss)
        assert rel_err(m["grad_norm"], norm) < TOL, (m["step"], m["grad_norm"], norm)
    assert_complete_hf_model(out / "final", ref["params"], ref["logits"], TOL)


CASES = [
    # (model, world size, micro batch, sync, extra flags) -- G=13 makes every layout ragged;
    # W=2, m=2 gives rank 1 an empty last microbatch (7/6 samples: [2,2,2,1] and [2,2,2,0]).
    ("model", 1, 1, "every", ["--layout", "shard"]),
    ("model", 1, 3, "last", ["--layout", "shard"]),
    ("model", 2, 2, "every", ["--layout", "shard"]),
    ("model", 2, 2, "last", ["--layout", "shard"]),
    ("model", 2, 3, "every", ["--layout", "shard"]),
    ("model", 2, 3, "last", ["--layout", "shard"]),
    ("model", 2, 3, "last-keep-params", ["--layout", "shard"]),
    ("model", 2, 3, "last", ["--activation-checkpointing", "--layout", "shard"]),
    ("model", 4, 2, "hsdp-defer", ["--replicas", "2", "--layout", "shard"]),  # HSDP 2 replicas x 2 shards
    ("model", 4, 1, "every", ["--replicas", "2", "--layout", "shard"]),
    ("model-tied", 1, 3, "every", ["--layout", "shard"]),
    ("model-tied", 2, 3, "last", ["--layout", "shard"]),
    ("model-tied", 2, 2, "every", ["--layout", "shard"]),
    ("model-tied", 4, 2, "hsdp-defer", ["--replicas", "2", "--layout", "shard"]),
    # Replicated layout: whole state on every rank, gradients summed once per step.
    ("model", 2, 3, "last", ["--layout", "replicate"]),
    ("model-tied", 2, 2, "last", ["--layout", "replicate"]),
    ("model", 2, 3, "last", ["--layout", "replicate", "--activation-checkpointing"]),
    # Compiled decoder layers, inside FSDP's hooks and activation checkpointing: inductor fuses and
    # reorders fp32 sums, yet the run stays within the same 1e-5 (measured: 7e-8 on the losses,
    # also at W=2 in both layouts), so compile gets no looser tolerance. One process: compiling
    # costs ~40 s per process on this CPU.
    ("model", 1, 3, "last", ["--layout", "shard", "--compile", "--activation-checkpointing"]),
]


@pytest.mark.distributed
@pytest.mark.parametrize(
    "model_name, world, micro, sync, extra", CASES, ids=lambda v: " ".join(v) if isinstance(v, list) else str(v)
)
def test_accumulated_sharded_training_equals_one_big_batch(
    workdir, references, tmp_path, model_name, world, micro, sync, extra
):
    out = tmp_path / "run"
    args = ["--model", str(workdir / model_name), "--dataset", str(workdir / "data.jsonl"),
            "--micro-batch", str(micro), "--sync", sync, "--output-dir", str(out), *COMMON, *extra]  # fmt: skip
    result = run_cli(args, nproc=world)
    assert result.returncode == 0, result.stdout + result.stderr
    assert_same_training(out, references[model_name])
    plan = json.loads((out / "config.json").read_text())["plan"]
    assert (plan["world_size"], plan["micro_batch"], plan["sync"]) == (world, micro, sync)


# Says, once per process, that a layer's product went through oneDNN (run first in every process:
# helpers.run_cli_after); the probe's own calls come before the count starts.
ONEDNN_SAYS_IT_RAN = """
import sys
from accum_cli.cpu import linear

linear.available()
_onednn = linear._onednn


def _said(x, weight, bias, _first=[True]):
    if _first:
        print("a layer ran through oneDNN", file=sys.stderr, flush=True)
        _first.clear()
    return _onednn(x, weight, bias)


linear._onednn = _said
"""


@pytest.mark.distributed
@pytest.mark.parametrize("layout, sync", [("shard", "every"), ("replicate", "last")])
def test_linear_layers_through_onednn_train_the_same(workdir, references, tmp_path, layout, sync):
    """fp32 CPU linear layers run oneDNN's GEMMs where they are large enough (cpu_linear.py); the tiny
    model's are not, so ACCUM_TRAIN_ONEDNN=1 takes it for all of them: the same 1e-5, and the kernel did
    run on every rank (=0: on none). Its bits are not the proof: on an AVX-512 Xeon oneDNN and MKL give
    the same bits for these sizes, on an AVX2 EPYC other ones. The output projection's own forward is
    among them (ACCUM_TRAIN_FUSED_LOSS=0)."""
    for mode in ("1", "0") if layout == "shard" else ("1",):
        out = tmp_path / f"onednn-{mode}"
        args = ["--model", str(workdir / "model"), "--dataset", str(workdir / "data.jsonl"), "--micro-batch", "3",
                "--sync", sync, "--layout", layout, "--output-dir", str(out), *COMMON]  # fmt: skip
        extra = {"ACCUM_TRAIN_ONEDNN": mode, "ACCUM_TRAIN_FUSED_LOSS": "0"}
        result = run_cli_after(ONEDNN_SAYS_IT_RAN, args, nproc=2, env_extra=extra)
        assert result.returncode == 0, result.stdout + result.stderr
        assert result.stderr.count("a layer ran through oneDNN") == (2 if mode == "1" else 0), result.stderr
        assert_same_training(out, references["model"])


# Dynamo's log on, as TORCH_LOGS=dynamo has it: that variable is read when torch is imported, so only a
# fresh interpreter would take it; this sets the same in a process forked warm.
DYNAMOS_LOG = """
import logging
import torch._logging
torch._logging.set_logs(dynamo=logging.INFO)
"""


@pytest.mark.distributed
@pytest.mark.parametrize("threshold, compiles", [("0", True), ("1e9", False)], ids=["pays", "does not pay"])
def test_compile_decided_by_the_measured_steps_keeps_the_training_exact(
    workdir, references, tmp_path, threshold, compiles
):
    """`--compile` unset: steps 1-2 run eager, then the measured step time decides. With the
    threshold at 0 s the layers compile for step 3 (dynamo's log shows the tracing), and the run
    is the same training; with an unreachable one nothing is ever traced."""
    out = tmp_path / "run"
    args = ["--model", str(workdir / "model"), "--dataset", str(workdir / "data.jsonl"), "--micro-batch", "3",
            "--sync", "last", "--output-dir", str(out), *COMMON, "--layout", "shard", "--activation-checkpointing"]  # fmt: skip
    result = run_cli_after(DYNAMOS_LOG, args, env_extra={"ACCUM_TRAIN_COMPILE_AFTER_S": threshold})
    assert result.returncode == 0, result.stdout + result.stderr
    said = "compiling the decoder layers, in the next step" if compiles else "staying eager"
    assert "compile: 1 step of " in result.stdout and said in result.stdout, result.stdout
    assert ("torchdynamo start tracing" in result.stderr) == compiles
    assert_same_training(out, references["model"])


def test_a_per_microbatch_mean_would_fail_this_comparison(workdir, references):
    """The data has teeth: averaging each microbatch and dividing by A gives other gradients."""
    from transformers import AutoModelForCausalLM

    rows = load_rows(workdir / "data.jsonl")
    batch = [rows[i] for i in SampleOrder(len(rows), SEED).rows(range(G))]

    def grads(loss_fn) -> torch.Tensor:
        model = AutoModelForCausalLM.from_pretrained(workdir / "model", dtype=torch.float32, attn_implementation="sdpa")
        loss_fn(model)
        return torch.cat([p.grad.flatten() for p in model.parameters()])

    def big_batch(model):
        ids, mask, labels = pad(batch)
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()

    def naive(model, micro=3):
        chunks = [batch[i : i + micro] for i in range(0, G, micro)]
        for chunk in chunks:
            ids, mask, labels = pad(chunk)
            (model(input_ids=ids, attention_mask=mask, labels=labels).loss / len(chunks)).backward()

    assert rel_err(grads(naive), grads(big_batch)) > 100 * TOL


@pytest.mark.distributed
def test_auto_micro_batch_under_a_small_budget_trains_the_same(workdir, references, tmp_path):
    """--micro-batch auto with --sync auto on 2 ranks: a budget that holds m = 3 but not m = 4 under
    `every` picks m = 3 (not ceil(13/2) = 7), every rank runs it (else the collectives would not
    match), and the training still equals the one-big-batch reference."""
    from accum_cli.memory import estimate, fit

    model = workdir / "model"
    seq_len = max(len(row["input_ids"]) for row in load_rows(workdir / "data.jsonl"))  # pre-tokenised: the longest
    config = json.loads((model / "config.json").read_text())
    found = estimate.estimate([Query(config, 2, 1, m, seq_len, "every", False, False) for m in (3, 4)])
    gib = (found[0].peak + found[1].peak) / 2 / fit.BUDGET_SHARE / 2**30
    out = tmp_path / "run"
    args = ["--model", str(model), "--dataset", str(workdir / "data.jsonl"), "--micro-batch", "auto",
            "--device-memory-gib", f"{gib:.6f}", "--output-dir", str(out), *COMMON]  # fmt: skip
    result = run_cli(args, nproc=2)
    assert result.returncode == 0, result.stdout + result.stderr
    assert_same_training(out, references["model"])
    record = json.loads((out / "config.json").read_text())
    assert record["config"]["micro_batch"] == "auto" and record["plan"]["micro_batch"] == 3
    assert "largest that fits" in record["plan"]["micro_batch_reason"]
    assert "micro batch       3 (largest that fits" in result.stdout
