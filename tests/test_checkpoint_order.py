"""Which checkpoint is the newest: by step number, not by name (`step-%06d` outgrows six
digits at step 1,000,000, and "step-1000000" sorts before "step-999999" as a string)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from helpers import run_cli, save_tiny_model, write_ragged_tokens
from typer.testing import CliRunner

from accum_cli.cli.main import app
from accum_cli.rundir import checkpoint, checkpoint_meta, outdir

STEPS = [9, 10, 999_998, 999_999, 1_000_000]


def fake_checkpoints(root: Path, steps: list[int]) -> list[Path]:
    paths = []
    for step in steps:
        path = checkpoint_meta.step_dir(root, step)
        path.mkdir(parents=True)
        outdir.mark(path, "checkpoint")  # ours, as every checkpoint accum-train writes
        (path / checkpoint_meta.META).write_text(json.dumps({"step": step}))
        paths.append(path)
    return paths


def test_latest_is_the_highest_step(tmp_path):
    fake_checkpoints(tmp_path, STEPS)
    unfinished = checkpoint_meta.step_dir(tmp_path, 2_000_000)
    unfinished.mkdir()  # no meta.json: the save did not finish
    assert checkpoint_meta.latest(tmp_path).name == "step-1000000"


def test_pruning_keeps_exactly_the_newest_k(tmp_path):
    fake_checkpoints(tmp_path, STEPS)
    unfinished = checkpoint_meta.step_dir(tmp_path, 5)
    unfinished.mkdir()
    checkpoint.prune(tmp_path, keep=2)
    left = sorted(p.name for p in (tmp_path / checkpoint_meta.CHECKPOINTS).iterdir())
    assert left == ["step-000005", "step-1000000", "step-999999"], "an unfinished save is not ours to prune"


@pytest.mark.distributed
def test_resume_alone_takes_the_numerically_newest_checkpoint(tmp_path):
    """Copies of a real checkpoint at steps 9, 10, 999,998, 999,999 and 1,000,000: `--resume` alone
    must pick step 1,000,000 (here it is past --max-steps, which the one-line error says)."""
    model, data = save_tiny_model(tmp_path / "model"), write_ragged_tokens(tmp_path / "data.jsonl", n_rows=8)
    common = ["--model", str(model), "--dataset", str(data), "--global-batch", "4", "--micro-batch", "2"]
    out = tmp_path / "run"
    result = run_cli([*common, "--max-steps", "1", "--output-dir", str(out)])
    assert result.returncode == 0, result.stderr
    saved = checkpoint_meta.step_dir(out, 1)
    for step in STEPS:
        copy = checkpoint_meta.step_dir(out, step)
        shutil.copytree(saved, copy)
        meta = json.loads((copy / checkpoint_meta.META).read_text())
        (copy / checkpoint_meta.META).write_text(json.dumps(meta | {"step": step, "samples": 4 * step}))
    shutil.rmtree(saved)
    result = CliRunner().invoke(app, [*common, "--max-steps", "20", "--output-dir", str(out), "--resume"])
    assert result.exit_code == 2, result.output
    assert f"--resume {checkpoint_meta.step_dir(out, 1_000_000)} is at step 1000000" in result.output
