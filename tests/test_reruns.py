"""Recipes and reruns as users write them: a run's config.json reproduces it, one command line
with `--resume auto` survives two real SIGTERMs bit for bit, and final/ keeps the model's dtype."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import BIN, REPO, env, python, read_metrics, run_cli, save_tiny_model, write_ragged_tokens
from safetensors.torch import load_file

slow = pytest.mark.distributed  # real training subprocesses (one rank each): the slow set


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("reruns")
    save_tiny_model(root / "model")
    save_tiny_model(root / "bf16-model", dtype=torch.bfloat16)
    write_ragged_tokens(root / "data.jsonl", n_rows=40)
    return root


def train_args(root: Path, out: Path, steps: int, model: str = "model") -> list[str]:
    return ["--model", str(root / model), "--dataset", str(root / "data.jsonl"), "--global-batch", "10",
            "--micro-batch", "3", "--max-steps", str(steps), "--seed", "3", "--lr", "3e-3", "--warmup-steps", "2",
            "--output-dir", str(out)]  # fmt: skip


def ok(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert result.returncode == 0, result.stdout + result.stderr
    return result


def assert_same_model(a: Path, b: Path) -> None:
    left, right = load_file(a / "final/model.safetensors"), load_file(b / "final/model.safetensors")
    assert left.keys() == right.keys()
    for name in left:
        assert torch.equal(left[name], right[name]), name


@slow
def test_a_runs_config_json_is_a_recipe_that_reproduces_it(root, tmp_path):
    first, again = tmp_path / "first", tmp_path / "again"
    ok(run_cli([*train_args(root, first, 3), "--lr-schedule", "constant", "--adam-beta2", "0.9"]))
    ok(run_cli(["--recipe", str(first / "config.json"), "--output-dir", str(again)]))
    assert [m["loss"] for m in read_metrics(again)] == [m["loss"] for m in read_metrics(first)]
    assert_same_model(first, again)
    saved = json.loads((again / "config.json").read_text())["config"]
    assert saved == json.loads((first / "config.json").read_text())["config"] | {"output_dir": str(again)}


def start(args: list[str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "accum_cli", *args]
    return subprocess.Popen(cmd, cwd=REPO, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def sigterm_after(proc: subprocess.Popen, metrics: Path, lines: int) -> tuple[str, str]:
    """A real SIGTERM to a real run once it has logged `lines` steps; its output after it stopped."""
    deadline = time.monotonic() + 120
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= lines):
        assert proc.poll() is None and time.monotonic() < deadline, "the run ended before it could be signalled"
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 75, stdout + stderr
    return stdout, stderr


@slow
def test_one_command_line_survives_two_preemptions_bit_for_bit(root, tmp_path):
    """The same command (`--resume auto`) run three times, stopped by SIGTERM twice, ends with
    the model and the per-step losses of an uninterrupted run, bit for bit."""
    steps = 60
    reference = tmp_path / "reference"
    ok(run_cli(train_args(root, reference, steps)))
    out = tmp_path / "requeued"
    command = [*train_args(root, out, steps), "--resume", "auto"]

    started = time.monotonic()
    stdout, _ = sigterm_after(start(command), out / "metrics.jsonl", 5)
    assert "auto: no complete checkpoint in" in stdout and "starting fresh" in stdout
    first_stop = len(read_metrics(out))
    stdout, _ = sigterm_after(start(command), out / "metrics.jsonl", first_stop + 5)
    assert f"step-{first_stop:06d} (step {first_stop}," in stdout and "(auto: the newest complete one)" in stdout
    second_stop = len(read_metrics(out))
    assert first_stop < second_stop < steps
    last = ok(run_cli(command))
    assert f"step-{second_stop:06d} (step {second_stop}," in last.stdout
    print(f"three runs of one command, stopped after steps {first_stop} and {second_stop} of {steps}: "
          f"{time.monotonic() - started:.1f} s")  # fmt: skip

    got, want = read_metrics(out), read_metrics(reference)
    assert [m["step"] for m in got] == list(range(1, steps + 1))
    assert [m["loss"] for m in got] == [m["loss"] for m in want]
    assert [m["grad_norm"] for m in got] == [m["grad_norm"] for m in want]
    assert_same_model(out, reference)

    # The same command once more (a requeue after the end, a restarted pod): nothing to do, exit 0,
    # nothing touched.
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    again = ok(run_cli(command))
    assert f"nothing to do: {out} already finished its {steps} steps" in again.stdout
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == before
    # ... but not where final/ is older than the last checkpoint (killed between the two writes):
    # the line says how to write it, and its advice works.
    os.utime(out / f"checkpoints/step-{steps:06d}/meta.json")
    refused = run_cli(command)
    assert refused.returncode == 2 and "but final/ was not written after it; write it with `mv " in refused.stderr
    advice = refused.stderr.split("`")[1]
    ok(subprocess.run(advice.replace("accum-export", str(BIN / "accum-export")), shell=True, capture_output=True))
    assert "nothing to do" in ok(run_cli(command)).stdout


@slow
def test_resume_auto_starts_afresh_where_the_same_run_died_before_its_first_checkpoint(root, tmp_path):
    """kill -9 (a node lost) before any checkpoint: the folder holds the run's record and no
    checkpoint; the requeued command starts over in it instead of refusing it."""
    out = tmp_path / "run"
    ok(run_cli(train_args(root, out, 1)))
    shutil.rmtree(out / "checkpoints")  # as if killed before the first checkpoint was sealed,
    shutil.rmtree(out / "final")  # so before final/ too
    refused = run_cli([*train_args(root, out, 2)])
    assert refused.returncode == 2 and "holds a previous run" in refused.stderr
    again = ok(run_cli([*train_args(root, out, 2), "--resume", "auto"]))
    assert "auto: no complete checkpoint in" in again.stdout and "starting fresh" in again.stdout
    assert [m["step"] for m in read_metrics(out)] == [1, 2]


@slow
def test_a_bf16_model_is_exported_in_bf16_and_readable_by_colleagues(root, tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "run"
    ok(python(["-m", "accum_cli", *train_args(root, out, 2, model="bf16-model")], env=env(), umask=0o022))
    final, source = out / "final", root / "bf16-model"
    size, source_size = (final / "model.safetensors").stat().st_size, (source / "model.safetensors").stat().st_size
    print(f"bf16 model {source_size:,} B -> final/ {size:,} B")
    assert abs(size - source_size) < 0.01 * source_size, "final/ is the size of its input"
    assert json.loads((final / "config.json").read_text())["dtype"] == "bfloat16"
    # final/ follows the umask like every other file (not mkdtemp's 0700, not 0600)
    assert final.stat().st_mode & 0o777 == 0o755
    assert {p.name: p.stat().st_mode & 0o777 for p in final.iterdir()} == {p.name: 0o644 for p in final.iterdir()}

    # The trained fp32 master weights, from the final checkpoint, and the default export (auto: bf16).
    checkpoint = out / "checkpoints/step-000002"
    exports = {}
    for dtype in ("fp32", "auto"):
        exports[dtype] = tmp_path / f"export-{dtype}"
        export = ["-c", "from accum_cli.cli.main import export_entry; export_entry()", str(checkpoint),
                  str(exports[dtype]), "--export-dtype", dtype]  # fmt: skip
        ok(python(export, env=env(), timeout=120, umask=0o022))
    fp32_size = (exports["fp32"] / "model.safetensors").stat().st_size
    print(f"--export-dtype fp32 (the old behaviour): {fp32_size:,} B")
    assert fp32_size > 1.9 * source_size
    assert (exports["auto"] / "model.safetensors").stat().st_mode & 0o777 == 0o644

    master = load_file(exports["fp32"] / "model.safetensors")
    assert {t.dtype for t in master.values()} == {torch.float32}
    for name, tensor in load_file(final / "model.safetensors").items():
        assert torch.equal(tensor, master[name].to(torch.bfloat16)), name
    # The trained model cast to bf16 (as transformers casts it on load) and final/ as it loads.
    trained = AutoModelForCausalLM.from_pretrained(exports["fp32"], dtype=torch.bfloat16)
    reloaded = AutoModelForCausalLM.from_pretrained(final)
    assert next(reloaded.parameters()).dtype == torch.bfloat16
    ids = torch.randint(3, 384, (2, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = trained(ids).logits
        assert torch.equal(reloaded(ids).logits, want)
        assert torch.equal(AutoModelForCausalLM.from_pretrained(exports["auto"])(ids).logits, want)


def test_the_export_dtype_is_the_one_the_model_declares():
    from transformers import LlamaConfig

    from accum_cli.rundir.export import resolve_export_dtype

    bare = LlamaConfig()
    assert resolve_export_dtype("auto", bare) == torch.float32, "a config that declares none: fp32"
    assert resolve_export_dtype("auto", LlamaConfig(dtype="bfloat16")) == torch.bfloat16
    older = LlamaConfig()
    vars(older)["torch_dtype"] = "float16"  # transformers < 4.56 wrote this key
    assert resolve_export_dtype("auto", older) == torch.float16
    assert resolve_export_dtype("auto", LlamaConfig(dtype="float64")) == torch.float32, "one we do not export: fp32"
    assert resolve_export_dtype("fp32", LlamaConfig(dtype="bfloat16")) == torch.float32
