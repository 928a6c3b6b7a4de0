"""LoRA (docs/LORA.md): accumulated, sharded or replicated LoRA training equals peft's own model trained
on one big batch in one process; final/ is a peft adapter folder; checkpoints hold the adapters and
resume exactly; `accum-export --merge` writes the merged model.

The reference is independent of the code under test: peft's `get_peft_model` on the base loaded by
transformers (after `torch.manual_seed(SEED)`, which the run's adapters are drawn from as well), one
forward/backward over all G sequences per step with the model's own loss, plain AdamW."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from helpers import probe_logits, read_metrics, rel_err, run_cli, save_tiny_model, write_ragged_tokens
from test_equivalence import pad

from accum_cli.data.batches import SampleOrder

peft = pytest.importorskip("peft")

G, STEPS, SEED, LR, CLIP, WD, R, ALPHA = 13, 2, 5, 2e-3, 1.0, 0.1, 4, 8
# B starts at zero, so its first AdamW updates are about lr x the sign of each gradient element: at
# eps 1e-8 an element whose gradient is near 0 (8.5e-9 here) turns rounding into a full-size step, and
# peft's own model split into 3 token-weighted microbatches then differs from its one big batch by 4e-4
# in a B (measured). At eps 1e-4 the same two agree to 4.2e-7 in every adapter: the comparison is of
# the accumulation, not of AdamW's conditioning.
EPS = 1e-4
TOL = 1e-5
COMMON = [
    "--global-batch", str(G), "--seed", str(SEED), "--lr", str(LR), "--warmup-steps", "0", "--adam-eps", str(EPS),
    "--lr-schedule", "constant", "--grad-clip", str(CLIP), "--weight-decay", str(WD), "--lora-r", str(R),
    "--lora-alpha", str(ALPHA), "--verbose",
]  # fmt: skip
# A mixture of experts with its router loss on (the balancing term exact under accumulation) and a
# shared expert, whose linear layers (and the attention's) are what all-linear adapts.
QWEN2_MOE = dict(
    vocab_size=384, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, num_experts=4, num_experts_per_tok=2,
    moe_intermediate_size=32, shared_expert_intermediate_size=32, output_router_logits=True,
    router_aux_loss_coef=0.5,
)  # fmt: skip


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("lora")
    save_tiny_model(root / "llama")
    torch.manual_seed(7)
    transformers.AutoModelForCausalLM.from_config(transformers.Qwen2MoeConfig(**QWEN2_MOE)).save_pretrained(
        root / "qwen2-moe"
    )
    mixtral = {k: v for k, v in QWEN2_MOE.items() if k not in ("num_experts", "moe_intermediate_size",
               "shared_expert_intermediate_size")} | {"num_local_experts": 4}  # fmt: skip
    torch.manual_seed(7)
    transformers.AutoModelForCausalLM.from_config(transformers.MixtralConfig(**mixtral)).save_pretrained(
        root / "mixtral"
    )
    save_tiny_model(root / "other-llama", seed=2)  # the same architecture, other weights
    write_ragged_tokens(root / "data.jsonl")
    return root


def base_model(folder: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa")


def reference(folder: Path, data: Path, steps: int = STEPS) -> dict:
    """peft's model, one process, one forward/backward per step over all G sequences, plain AdamW."""
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    model = base_model(folder)
    torch.manual_seed(SEED)
    config = peft.LoraConfig(
        r=R, lora_alpha=ALPHA, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM"
    )
    model = peft.get_peft_model(model, config)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.95), eps=EPS, weight_decay=WD)  # all matrices
    order = SampleOrder(len(rows), SEED)
    losses, norms = [], []
    for step in range(steps):
        ids, mask, labels = pad([rows[i] for i in order.rows(range(step * G, (step + 1) * G))])
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, CLIP)))
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    adapters = peft.get_peft_model_state_dict(model)
    return {"loss": losses, "grad_norm": norms, "adapters": {k: v.detach().clone() for k, v in adapters.items()},
            "logits": probe_logits(model)}  # fmt: skip


@pytest.fixture(scope="module")
def references(workdir) -> dict:
    return {name: reference(workdir / name, workdir / "data.jsonl") for name in ("llama", "qwen2-moe", "mixtral")}


def ok(result):
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def assert_same_training(out: Path, ref: dict, base: Path, steps: int = STEPS) -> float:
    """The run's losses, gradient norms, adapters and (loaded by peft onto the base) logits against
    the reference's; the largest relative difference."""
    from safetensors.torch import load_file

    metrics = read_metrics(out)
    assert [m["step"] for m in metrics][-1] == steps
    worst = 0.0
    for m in metrics:
        i = m["step"] - 1
        for key in ("loss", "grad_norm"):
            worst = max(worst, rel_err(m[key], ref[key][i]))
            assert rel_err(m[key], ref[key][i]) < TOL, (m["step"], key, m[key], ref[key][i])
    stored = load_file(out / "final" / "adapter_model.safetensors")
    assert set(stored) == set(ref["adapters"])
    for name, expected in ref["adapters"].items():
        worst = max(worst, rel_err(stored[name], expected))
        assert rel_err(stored[name], expected) < TOL, name
    loaded = peft.PeftModel.from_pretrained(base_model(base), out / "final")
    worst = max(worst, rel_err(probe_logits(loaded), ref["logits"]))
    assert rel_err(probe_logits(loaded), ref["logits"]) < TOL
    print(f"max rel err {worst:.1e}")  # the figure docs/LORA.md quotes (pytest -s)
    return worst


CASES = [
    # (model, world size, micro batch, sync, layout, flags); G=13 makes every split ragged.
    ("llama", 1, 5, "every", "shard", ""),
    ("llama", 2, 3, "last", "shard", ""),
    ("llama", 2, 2, "every", "shard", ""),
    ("llama", 2, 3, "last", "replicate", ""),
    ("llama", 2, 3, "last", "shard", "--activation-checkpointing"),
    ("llama", 2, 2, "every", "shard", "--rank0-loading"),  # the adapters broadcast from rank 0 with the base
    ("llama", 4, 2, "hsdp-defer", "shard", "--replicas 2"),  # HSDP 2 replicas x 2 shards
    ("mixtral", 1, 5, "every", "shard", ""),
    ("mixtral", 2, 3, "last", "shard", ""),
    ("qwen2-moe", 1, 5, "every", "shard", ""),
    ("qwen2-moe", 2, 3, "last", "shard", ""),
    ("qwen2-moe", 2, 2, "last", "replicate", ""),
]


@pytest.mark.distributed
@pytest.mark.parametrize(
    "name,world,micro,sync,layout,flags", CASES, ids=["-".join(map(str, c)).rstrip("-") for c in CASES]
)
def test_lora_step_equals_peft_one_big_batch(workdir, references, tmp_path, name, world, micro, sync, layout, flags):
    out = tmp_path / "run"
    args = ["--model", str(workdir / name), "--dataset", str(workdir / "data.jsonl"), "--output-dir", str(out),
            "--micro-batch", str(micro), "--sync", sync, "--layout", layout, "--max-steps", str(STEPS), *COMMON,
            *flags.split()]  # fmt: skip
    result = ok(run_cli(args, nproc=world))
    assert "lora              r=4 alpha=8" in result.stdout
    assert_same_training(out, references[name], workdir / name)


def lora_args(workdir: Path, out: Path, micro: int, steps: int, *extra: str, model: str = "llama") -> list[str]:
    return ["--model", str(workdir / model), "--dataset", str(workdir / "data.jsonl"), "--output-dir", str(out),
            "--micro-batch", str(micro), "--max-steps", str(steps), *COMMON, *extra]  # fmt: skip


def export(*argv: str):
    from typer.testing import CliRunner

    from accum_cli.cli.main import export_app

    return CliRunner().invoke(export_app, [str(a) for a in argv])


@pytest.fixture(scope="module")
def uninterrupted(workdir, tmp_path_factory) -> Path:
    """3 steps at W=2, sharded, `last`."""
    out = tmp_path_factory.mktemp("lora-runs") / "whole"
    ok(run_cli(lora_args(workdir, out, 3, 3, "--sync", "last", "--layout", "shard"), nproc=2))
    return out


@pytest.mark.distributed
def test_lora_resume_is_exact_and_elastic_and_refuses_another_base(workdir, uninterrupted, tmp_path):
    """2 steps at W=1 (replicated), then the third resumed at W=2 (sharded): the losses, gradient norms and
    adapters of the uninterrupted run; the checkpoint holds the adapters and their AdamW state, not the base."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    out = tmp_path / "resumed"
    ok(run_cli(lora_args(workdir, out, 5, 2, "--layout", "replicate")))
    saved = dcp.FileSystemReader(str(out / "checkpoints" / "step-000002")).read_metadata().state_dict_metadata
    tensors = [k for k in saved if k.startswith(("model.", "optim.state."))]
    assert tensors and all(".lora_" in k for k in tensors), [k for k in tensors if ".lora_" not in k][:3]
    resume = ("--resume", str(out / "checkpoints" / "step-000002"), "--sync", "last", "--layout", "shard")
    refused = run_cli(lora_args(workdir, tmp_path / "other", 3, 3, *resume, model="other-llama"), nproc=1)
    assert refused.returncode == 2 and "LoRA on other base weights" in refused.stdout + refused.stderr
    ok(run_cli(lora_args(workdir, out, 3, 3, *resume), nproc=2))
    got, want = read_metrics(out), {m["step"]: m for m in read_metrics(uninterrupted)}
    assert [m["step"] for m in got] == [1, 2, 3]
    for m in got:
        for key in ("loss", "grad_norm"):
            assert rel_err(m[key], want[m["step"]][key]) < TOL, (m["step"], key)
    resumed, whole = (load_file(o / "final" / "adapter_model.safetensors") for o in (out, uninterrupted))
    worst = max(rel_err(resumed[k], whole[k]) for k in whole)
    print(f"resume: max rel err of the adapters {worst:.1e}")
    assert worst < TOL


def test_the_advice_to_export_a_lora_checkpoint_names_its_base_and_works(workdir, uninterrupted, tmp_path):
    """final/ older than the last checkpoint (killed between the two writes): the refusal's accum-export line
    carries --base (a LoRA checkpoint holds the adapters only), and that line, run as written, exports."""
    import shutil
    import subprocess

    from helpers import BIN

    out = tmp_path / "run"
    shutil.copytree(uninterrupted, out)
    (out / "checkpoints" / "step-000003" / "meta.json").touch()
    refused = run_cli(lora_args(workdir, out, 3, 3, "--sync", "last", "--layout", "shard", "--resume", "auto"))
    assert refused.returncode == 2 and "final/ was not written after it" in refused.stderr, refused.stderr
    advice = refused.stderr.split("`")[1]
    assert f" --base {workdir / 'llama'}" in advice, advice
    done = subprocess.run(
        advice.replace("accum-export", str(BIN / "accum-export")), shell=True, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert (out / "final" / "adapter_model.safetensors").is_file()


def test_lora_export_writes_adapters_and_the_merged_model(workdir, uninterrupted, tmp_path):
    """accum-export: the adapters (loaded by peft on the base: final/'s logits), and --merge: a model
    AutoModelForCausalLM loads with the adapted model's logits; another base, or none, refused in one line."""
    checkpoint = uninterrupted / "checkpoints" / "step-000003"
    trained = probe_logits(peft.PeftModel.from_pretrained(base_model(workdir / "llama"), uninterrupted / "final"))
    assert export(checkpoint, tmp_path / "adapters", "--base", workdir / "llama").exit_code == 0
    adapters = peft.PeftModel.from_pretrained(base_model(workdir / "llama"), tmp_path / "adapters")
    assert rel_err(probe_logits(adapters), trained) < TOL
    assert rel_err(trained, probe_logits(base_model(workdir / "llama"))) > 1e-4  # the adapters change the model
    assert export(checkpoint, tmp_path / "merged", "--base", workdir / "llama", "--merge").exit_code == 0
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    print(f"merged: rel err of the logits {rel_err(probe_logits(merged), trained):.1e}")
    assert rel_err(probe_logits(merged), trained) < TOL
    assert not any(".lora_" in name or "base_layer" in name for name in merged.state_dict())
    for argv, words in [
        (("--base", workdir / "other-llama", "--merge"), "trained on another base model"),
        (("--merge",), "pass --base MODEL"),
    ]:
        result = export(checkpoint, tmp_path / "refused", *argv)
        assert result.exit_code == 2 and words in result.output, result.output
        assert len(result.output.strip().splitlines()) == 1 and not (tmp_path / "refused").exists()


@pytest.mark.parametrize(
    "flags,words",
    [
        (["--lora-alpha", "8"], "--lora-alpha needs --lora-r"),
        (["--lora-r", "4", "--compile"], "--compile with --lora-r is not supported"),
        (["--lora-r", "4", "--lora-target-modules", "nowhere_proj"], "--lora-target-modules"),
        (["--lora-r", "0"], "--lora-r must be >= 1"),
        (["--lora-r", "4", "--peft-missing"], "pip install 'accum-train[lora]'"),
    ],
)
def test_lora_bad_input_is_refused_in_one_line(workdir, tmp_path, monkeypatch, flags, words):
    from typer.testing import CliRunner

    from accum_cli.cli.main import app

    if "--peft-missing" in flags:
        flags = [f for f in flags if f != "--peft-missing"]
        monkeypatch.setitem(__import__("sys").modules, "peft", None)  # `import peft` raises ImportError
    argv = ["--model", str(workdir / "llama"), "--dataset", str(workdir / "data.jsonl"), "--output-dir",
            str(tmp_path / "run"), "--max-steps", "1", *flags]  # fmt: skip
    result = CliRunner().invoke(app, argv)
    assert result.exit_code == 2 and words in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1, result.output


def test_plan_counts_the_frozen_base_without_gradients_or_optimizer_state(tmp_path, monkeypatch):
    """--plan --lora-r: the adapters' share, and the estimated peak per rank (the adapted model built in the
    estimate: gradients and AdamW state for the adapters only) well under full fine-tuning's."""
    import re

    from typer.testing import CliRunner

    from accum_cli.cli.main import app

    monkeypatch.setenv("ACCUM_TRAIN_CACHE", str(tmp_path / "cache"))
    argv = ["--plan", "--lora-r", "8", "--world-size", "2", "--global-batch", "16", "--micro-batch", "2",
            "--layout", "shard", "--sync", "last", "--precision", "fp32", "--device-memory-gib", "64"]  # fmt: skip
    result = CliRunner().invoke(app, argv)
    assert result.exit_code == 0, result.output
    assert re.search(r"lora +r=8 alpha=16 dropout=0 on \d+ modules \(all-linear\): [\d,]+ of [\d,]+ parameters train",
                     result.output), result.output  # fmt: skip
    found = re.search(r"lora peak +([\d.]+) (\w+) per rank vs ([\d.]+) (\w+) for full fine-tuning", result.output)
    assert found, result.output
    scale = {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
    lora_peak, full_peak = float(found[1]) * scale[found[2]], float(found[3]) * scale[found[4]]
    print(f"plan: LoRA {lora_peak / 2**20:.1f} MiB vs full {full_peak / 2**20:.1f} MiB per rank")
    # the embedded model at W=2: full fine-tuning holds 16 bytes per parameter, half on each rank, LoRA ~4
    assert lora_peak < 0.8 * full_peak


@pytest.mark.distributed
@pytest.mark.parametrize("layout", ["shard", "replicate"])
def test_lora_in_bf16_follows_the_fp32_reference(workdir, references, tmp_path, layout):
    """The path users run on GPUs: bf16 compute of the base and of the fp32 adapters (FSDP2's mixed precision
    sharded, autocast replicated), at W=2; within test_equivalence_bf16's tolerances of the fp32 reference."""
    out = tmp_path / "run"
    args = lora_args(workdir, out, 3, STEPS, "--sync", "last", "--layout", layout, "--precision", "bf16")
    ok(run_cli(args, nproc=2))
    ref = references["llama"]
    for m in read_metrics(out):
        errors = {key: rel_err(m[key], ref[key][m["step"] - 1]) for key in ("loss", "grad_norm")}
        print(f"bf16 {layout} step {m['step']}: loss {errors['loss']:.1e}, grad norm {errors['grad_norm']:.1e}")
        assert errors["loss"] < 1e-3 and errors["grad_norm"] < 1e-2, errors
    import torch.distributed.checkpoint as dcp

    saved = dcp.FileSystemReader(str(out / "checkpoints" / f"step-{STEPS:06d}")).read_metadata().state_dict_metadata
    adapters = {k: v.properties.dtype for k, v in saved.items() if k.startswith("model.") and ".lora_" in k}
    assert adapters and set(adapters.values()) == {torch.float32}, "the adapters' master weights are fp32"


def test_verify_checks_a_lora_run_against_its_own_reference(workdir, tmp_path):
    """`accum-train verify --lora-r R` on one rank, where the reference is its own one-process model: the
    adapted model too, and the run passes."""
    args = ["verify", "--model", str(workdir / "llama"), "--dataset", str(workdir / "data.jsonl"), "--output-dir",
            str(tmp_path / "run"), "--micro-batch", "5", "--layout", "shard", "--verify-steps", "2",
            *[a for a in COMMON if a != "--verbose"]]  # fmt: skip
    result = ok(run_cli(args))
    assert "the plain Hugging Face model with the same LoRA adapters (peft)" in result.stdout, result.stdout
    assert "verdict           PASS" in result.stdout, result.stdout
    assert "lora_B" in result.stdout  # the parameters compared are the adapters


@pytest.mark.distributed
def test_the_lora_estimate_matches_real_ranks(tmp_path, monkeypatch):
    """The estimate of a LoRA step (the fake adapted model) against the same step measured on 2 real gloo
    ranks (bench/measure_peak.py --lora-r), sharded `last` and replicated: within test_estimate's 15%."""
    from helpers import REPO, launch

    from accum_cli.memory import estimate
    from accum_cli.memory.query import Query
    from accum_cli.model.load import EMBEDDED_MODEL_DIR

    monkeypatch.setenv("ACCUM_TRAIN_CACHE", str(tmp_path / "cache"))
    config = json.loads((EMBEDDED_MODEL_DIR / "config.json").read_text())
    spec = {"lora_r": 8, "lora_alpha": 16.0, "lora_dropout": 0.0, "lora_target_modules": "all-linear"}
    argv = ["--model", str(EMBEDDED_MODEL_DIR), "--seq-len", "128", "--sync", "last", "replicated", "--micro-batch",
            "4", "--lora-r", "8"]  # fmt: skip
    done = launch(str(REPO / "bench" / "measure_peak.py"), argv, ranks=2, kind="path", timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    real = {r["sync"]: r for r in map(json.loads, (x for x in done.stdout.splitlines() if x.startswith("{")))}
    queries = [Query(config, 2, 1, 4, 128, "last", bf16=False, activation_checkpointing=False, replicated=replicated,
                     lora=spec) for replicated in (False, True)]  # fmt: skip
    for (sync, row), found in zip(real.items(), estimate.estimate(queries), strict=True):
        print(f"{sync}: estimated {found.peak / 2**20:.1f} MiB, measured {row['peak'] / 2**20:.1f} MiB")
        assert abs(found.peak - row["peak"]) <= 0.15 * row["peak"], (sync, found.peak, row["peak"])
        assert found.breakdown["gradients"] < 0.1 * found.breakdown["sharded_params" if sync == "last" else
                                                                    "unsharded_params"]  # fmt: skip
