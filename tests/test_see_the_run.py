"""See the run: TensorBoard receives every metric, report.png pictures the run, accum-report
draws a run from the outside, and the console follows --log-every."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO, env, read_metrics, run_cli, save_tiny_model, write_ragged_tokens
from typer.testing import CliRunner

from accum_cli.cli import app


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("see")
    save_tiny_model(root / "model")
    write_ragged_tokens(root / "data.jsonl", n_rows=40)
    return root


def args(root: Path, out: Path, steps: int, *extra: str) -> list[str]:
    return ["--model", str(root / "model"), "--dataset", str(root / "data.jsonl"), "--global-batch", "8",
            "--micro-batch", "4", "--max-steps", str(steps), "--output-dir", str(out), *extra]  # fmt: skip


def scalars(logdir: Path) -> dict[str, dict[int, float]]:
    """Every scalar TensorBoard holds, read back with its own reader: tag -> step -> value."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    found: dict[str, dict[int, float]] = {}
    for events in sorted(logdir.rglob("events.out.tfevents.*")):
        acc = EventAccumulator(str(events.parent), size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            for event in acc.Scalars(tag):
                found.setdefault(tag, {})[event.step] = event.value
    return found


def test_tensorboard_holds_every_metric_of_every_step_and_a_resume_adds_no_duplicates(root, tmp_path):
    out = tmp_path / "run"
    first = run_cli(args(root, out, 3, "--report-to", "tensorboard", "--checkpoint-every", "2"))
    assert first.returncode == 0, first.stdout + first.stderr
    # The run goes on to step 5 from its step-2 checkpoint: steps 3.. are logged again, once.
    resumed = run_cli(args(root, out, 5, "--report-to", "tensorboard", "--resume",
                           str(out / "checkpoints" / "step-000002")))  # fmt: skip
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    metrics = read_metrics(out)
    logged = scalars(out / "trackers")
    numeric = {k for m in metrics for k, v in m.items() if isinstance(v, (int, float)) and k != "step"}
    assert numeric <= set(logged), numeric - set(logged)
    for m in metrics:
        for key in numeric & set(m):
            assert logged[key][m["step"]] == pytest.approx(m[key], rel=1e-6), (key, m["step"])
    assert sorted(logged["loss"]) == [m["step"] for m in metrics], "one value per step, none twice"


def test_a_missing_tracker_is_one_line_naming_the_package(root, tmp_path):
    result = CliRunner().invoke(app, args(root, tmp_path / "out", 1, "--report-to", "tensorboard,swanlab"))
    assert result.exit_code == 2
    assert result.output.strip() == (
        "accum-train: error: --report-to swanlab needs the swanlab package: pip install swanlab "
        "(or pip install 'accum-train[swanlab]'), or drop it from --report-to"
    )
    assert not (tmp_path / "out").exists()


def test_report_png_pictures_the_run_and_accum_report_compares_runs(root, tmp_path):
    from PIL import Image

    runs = []
    for lr in ("3e-3", "1e-3"):
        out = tmp_path / f"lr-{lr}"
        result = run_cli(args(root, out, 4, "--lr", lr, "--log-every", "2"))
        assert result.returncode == 0, result.stdout + result.stderr
        assert [line.split()[1] for line in result.stdout.splitlines() if line.startswith("step ")] == ["2/4", "4/4"]
        runs.append(out)
    picture = Image.open(runs[0] / "report.png").convert("L")
    assert picture.size[0] >= 800 and picture.size[1] >= 500
    assert sum(1 for count in picture.histogram() if count) > 20, "not a blank picture"

    compared = tmp_path / "compare.png"
    result = subprocess.run(
        [sys.executable, "-c", "from accum_cli.report import entry; entry()", str(runs[0]),
         "--compare", str(runs[1]), "--out", str(compared)],
        cwd=REPO, env=env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert Image.open(compared).size == picture.size
    missing = subprocess.run(
        [sys.executable, "-c", "from accum_cli.report import entry; entry()", str(tmp_path / "nothing")],
        cwd=REPO, env=env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert missing.returncode == 2 and "has no metrics.jsonl" in missing.stderr
