"""Trust, round three (issue 37): what used to end in success unsaid. A run whose weights are no
longer finite, a hyper-parameter that makes them so, a model whose own code transformers would
skip, and a run's config.json with keys it never reads.

Every test runs the real command on a real tiny model saved to a folder: the attack as reported,
then what must be left on disk.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from helpers import (
    ranks_apart,
    read_metrics,
    run_cli,
    save_tiny_model,
    write_first_step_without_loss_tokens,
    write_ragged_tokens,
)
from safetensors.torch import load_file, save_file

from accum_cli.config.fields import FP32_MAX, FP32_TINY
from accum_cli.config.settings import RUN_RECORD_KEYS

slow = pytest.mark.distributed  # real training subprocesses: the slow set


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("weights")
    save_tiny_model(root / "model")
    write_ragged_tokens(root / "data.jsonl", n_rows=40)
    return root


def args(root: Path, out: Path, steps: int, *extra: str) -> list[str]:
    return ["--model", str(root / "model"), "--dataset", str(root / "data.jsonl"), "--global-batch", "8",
            "--micro-batch", "4", "--max-steps", str(steps), "--output-dir", str(out), *extra]  # fmt: skip


def ok(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert result.returncode == 0, result.stdout + result.stderr
    return result


def error_line(result: subprocess.CompletedProcess, code: int) -> str:
    """The run's one line on stderr, after checking the exit code and that nothing else was said there."""
    assert result.returncode == code, result.stdout + result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("accum-train: error: "), result.stderr
    return lines[0]


@pytest.fixture(scope="module")
def trained(root, tmp_path_factory) -> Path:
    """A real, healthy one-step run: checkpoint step-000001, final/ and config.json."""
    out = tmp_path_factory.mktemp("trained") / "run"
    ok(run_cli(args(root, out, 1)))
    return out


# --- (a) weights that are not finite are never saved as a result --------------------------------


@slow
def test_an_update_that_overflows_ends_the_run_and_keeps_the_last_checkpoint(root, tmp_path):
    """lr x weight decay past fp32 (each finite and representable alone): the step's loss and
    gradient norm are finite, the update makes every matrix inf. That used to be saved as a
    checkpoint and as final/, exit 0. Step 1 here has no loss token (skipped, as --on-nonfinite skip
    asks), so its checkpoint holds healthy weights; step 2 trains and overflows: exit 3 names the
    parameter and the step, step 1's checkpoint stays the newest, no final/ appears. Skipping never
    applies to it: the weights themselves are lost."""
    model = save_tiny_model(tmp_path / "model")
    n_rows, global_batch, seed = 8, 4, 5
    write_first_step_without_loss_tokens(tmp_path / "data.jsonl", n_rows, global_batch, seed)
    out = tmp_path / "run"
    result = run_cli(["--model", str(model), "--dataset", str(tmp_path / "data.jsonl"), "--global-batch",
                      str(global_batch), "--micro-batch", "2", "--max-steps", "2", "--seed", str(seed),
                      "--checkpoint-every", "1", "--on-nonfinite", "skip", "--lr", "1e30", "--weight-decay", "1e10",
                      "--output-dir", str(out)])  # fmt: skip
    # (stderr also holds the warnings torch and matplotlib give a run whose first step was skipped)
    assert result.returncode == 3, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    assert [line for line in result.stderr.splitlines() if line.startswith("accum-train:")] == [
        "accum-train: error: non-finite values at step 2: parameter model.embed_tokens.weight holds NaN or inf after "
        "the update, so no checkpoint or final/ was written from it (check the model's weights, --lr, --weight-decay "
        "and --adam-eps); the last checkpoint is untouched"
    ]
    assert [(m["step"], m.get("skipped", False)) for m in read_metrics(out)] == [(1, True), (2, False)]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000001"]
    assert not (out / "final").exists()
    assert (out / "checkpoints" / "step-000001" / "meta.json").is_file()  # complete: sealed, as saved


def nan_row_model(folder: Path, row: int) -> Path:
    """The tiny model with one embedding row NaN: a row no token of the data reads, so the loss
    and the gradient norm stay finite and the loss guard never sees it."""
    save_tiny_model(folder)
    weights = load_file(folder / "model.safetensors")
    weights["model.embed_tokens.weight"][row] = float("nan")
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


@slow
def test_a_nan_in_one_ranks_shard_ends_every_rank_before_anything_is_saved(tmp_path):
    """Two sharded ranks: embedding rows 192..383 live on rank 1 alone, as a DTensor's local
    shard. Rank 1 sees the NaN, rank 0 does not, yet both end with exit 3 (a rank that went on
    would wait in the save forever), and rank 0's one line names the parameter rank 1 found."""
    model = nan_row_model(tmp_path / "model", row=300)
    g = torch.Generator().manual_seed(0)
    with open(tmp_path / "data.jsonl", "w") as f:
        for _ in range(16):  # ids below 192: rank 0's rows only, row 300 never read
            f.write(json.dumps({"input_ids": torch.randint(3, 192, (12,), generator=g).tolist()}) + "\n")
    out = tmp_path / "run"
    rank0, rank1 = ranks_apart(["--model", str(model), "--dataset", str(tmp_path / "data.jsonl"), "--global-batch",
                              "8", "--micro-batch", "2", "--max-steps", "1", "--layout", "shard",
                              "--output-dir", str(out), "--verbose"])  # fmt: skip
    assert error_line(rank0, 3) == (
        "accum-train: error: non-finite values at step 1: parameter model.embed_tokens.weight holds NaN or inf after "
        "the update, so no checkpoint or final/ was written from it (check the model's weights, --lr, --weight-decay "
        "and --adam-eps); the last checkpoint is untouched"
    )
    assert rank1.returncode == 3 and not rank1.stderr.strip(), rank1.stderr  # one line for the run, from rank 0
    assert "FSDP units" in rank0.stdout  # sharded: each rank holds half the embedding's rows
    assert [m["step"] for m in read_metrics(out)] == [1]
    assert not (out / "final").exists()
    assert not list(out.glob("checkpoints/step-*"))


# --- (b) hyper-parameters that make non-finite weights are refused up front ---------------------


def test_the_fp32_limits_are_torchs():
    assert torch.finfo(torch.float32).max == FP32_MAX and torch.finfo(torch.float32).tiny == FP32_TINY


@pytest.mark.parametrize("eps", ["0", "1e-40"], ids=["zero", "subnormal"])
def test_an_adam_eps_that_makes_nan_weights_is_refused_before_anything_is_written(root, tmp_path, eps):
    """The reported attack, as a real run: --adam-eps 0 trained, exited 0 and saved a final/ whose
    embedding was NaN wherever no token of the data reached (AdamW's 0/0)."""
    out = tmp_path / "run"
    line = error_line(run_cli([*args(root, out, 1), "--adam-eps", eps]), 2)
    assert line == (
        f"accum-train: error: --adam-eps must be >= 1.1754943508222875e-38, got {float(eps)!r}; smaller values are 0 "
        "or subnormal in fp32, where AdamW's update is 0/0 (NaN) for every weight whose gradient is 0 (a token the "
        "data never holds): use 1e-8, the usual value"
    )
    assert not out.exists()


@pytest.mark.parametrize("flag", ["--lr", "--weight-decay", "--grad-clip", "--adam-eps"])
def test_a_float_option_past_fp32_is_refused(root, tmp_path, flag):
    """Finite in Python, inf in the fp32 arithmetic that uses it: --lr 1e39 made every weight inf."""
    out = tmp_path / "run"
    line = error_line(run_cli([*args(root, out, 1), flag, "1e39"]), 2)
    assert line == (
        f"accum-train: error: {flag} must be a finite fp32 number (at most 3.40282e+38: training computes in fp32), "
        "got 1e+39"
    )
    assert not out.exists()


def test_the_fp32_limits_themselves_are_accepted(root, tmp_path):
    ok(run_cli(["--plan", "--adam-eps", repr(FP32_TINY), "--lr", repr(FP32_MAX), "--weight-decay", repr(FP32_MAX)]))


# --- remote code: refused by name, never dropped unsaid -----------------------------------------


@pytest.mark.parametrize(
    "auto_map",
    [{"AutoModelForCausalLM": "evil_modeling.EvilForCausalLM"},
     {"AutoConfig": "evil_modeling.EvilConfig", "AutoModelForCausalLM": "evil_modeling.EvilForCausalLM"}],
    ids=["model class", "config and model class"],
)  # fmt: skip
def test_code_shipped_with_a_known_model_type_is_refused_by_name(root, tmp_path, auto_map):
    """model_type llama, an auto_map naming a code file: transformers would train its own Llama
    and skip the author's code, exit 0, not a word. Refused in the preflight, naming the entry and
    the flag; with --trust-remote-code the code is used, as before."""
    model = tmp_path / "model"
    shutil.copytree(root / "model", model)
    sentinel = tmp_path / "remote-code-ran"
    (model / "evil_modeling.py").write_text(
        f"import pathlib\npathlib.Path({str(sentinel)!r}).touch()\n"
        "from transformers import LlamaConfig as EvilConfig, LlamaForCausalLM as EvilForCausalLM\n"
    )
    config = json.loads((model / "config.json").read_text()) | {"auto_map": auto_map}
    (model / "config.json").write_text(json.dumps(config))
    out = tmp_path / "run"
    line = error_line(run_cli(["--model", str(model), *args(root, out, 1)[2:]]), 2)
    assert line == (
        f"accum-train: error: --model {model}: its config's auto_map names code to run at load "
        '({"AutoModelForCausalLM": "evil_modeling.EvilForCausalLM"}), which transformers would skip for its own '
        "llama classes without a word; read it, then pass --trust-remote-code if you trust it"
    )
    assert not out.exists() and not sentinel.exists()
    ok(run_cli(["--plan", "--model", str(model), "--trust-remote-code"]))
    assert sentinel.exists(), "with the flag the author's code is what loads"


# --- a run's config.json as a recipe ------------------------------------------------------------


def test_a_runs_config_json_with_an_unknown_top_level_key_is_refused(trained, tmp_path):
    """`lr: 5.0` beside "config" and "plan" used to be ignored, while a recipe refuses unknown keys."""
    record = json.loads((trained / "config.json").read_text())
    assert tuple(record) == RUN_RECORD_KEYS  # what accum-train writes is what it reads back
    ok(run_cli(["--recipe", str(trained / "config.json"), "--print-config"]))
    for key, value in (("lr", 5.0), ("max_steps", 999)):
        edited = tmp_path / f"{key}.json"
        edited.write_text(json.dumps(record | {key: value}))
        line = error_line(run_cli(["--recipe", str(edited), "--print-config"]), 2)
        assert line == (
            f"accum-train: error: recipe {edited}: unknown top-level key '{key}' in a run's config.json, which holds "
            'only config, plan, resumed_from; put options under "config"'
        )
