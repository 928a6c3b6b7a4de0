"""What report.png shows, read from the Figure that accum-report saves (axes, scales, lines), not from
pixels: a log loss axis, memory from zero, tokens/s smoothed over faint steps, each resume marked,
the tokens trained on the x-axis where compared runs' steps differ, and no empty panel."""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest
from helpers import read_metrics, run_cli, save_tiny_model, write_ragged_tokens

from accum_cli.rundir import report

pytest.importorskip("matplotlib")

RESUME_STEP = 2  # the checkpoint the resumed run starts from; the first attempt went on to step 4


def args(root: Path, out: Path, steps: int, *extra: str, batch: int = 8) -> list[str]:
    return ["--model", str(root / "model"), "--dataset", str(root / "data.jsonl"), "--global-batch", str(batch),
            "--micro-batch", "4", "--max-steps", str(steps), "--output-dir", str(out), *extra]  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """Real runs: `resumed` (batch 8: 4 steps, then from its step-2 checkpoint to step 5), `other_lr` (batch 8,
    another learning rate, 5 steps) and `half_batch` (batch 4, 5 steps)."""
    root = tmp_path_factory.mktemp("picture")
    save_tiny_model(root / "model")
    write_ragged_tokens(root / "data.jsonl", n_rows=40)
    folders = {name: root / name for name in ("resumed", "other_lr", "half_batch")}
    commands = [
        args(root, folders["resumed"], 4, "--checkpoint-every", "2"),
        args(
            root, folders["resumed"], 5, "--resume", str(folders["resumed"] / "checkpoints" / f"step-{RESUME_STEP:06d}")
        ),
        args(root, folders["other_lr"], 5, "--lr", "3e-3"),
        args(root, folders["half_batch"], 5, batch=4),
    ]
    for command in commands:
        result = run_cli(command)
        assert result.returncode == 0, result.stdout + result.stderr
    return folders


def panels(fig) -> dict:
    return {ax.get_title(): ax for ax in fig.axes}


def vertical(line) -> bool:
    """An axvline: y from the axes' bottom (0) to its top (1)."""
    return list(line.get_ydata()) == [0, 1]


def resume_lines(ax) -> list[float]:
    return [line.get_xdata()[0] for line in ax.lines if vertical(line)]


def test_loss_is_on_a_log_axis_memory_from_zero_and_five_panels_fill_the_picture(runs):
    fig = report.figure([runs["other_lr"]])
    by_title = panels(fig)
    assert list(by_title) == [label for _, label in report.PANELS]  # no empty sixth panel
    assert all(ax.lines for ax in fig.axes)
    assert by_title["loss (token-weighted)"].get_yscale() == "log"
    assert by_title["peak memory (GiB)"].get_ylim()[0] == 0
    assert {ax.get_xlabel() for ax in fig.axes} == {"optimizer step"}
    # 3 above 2, the lower row spread over the full width: no empty cell.
    top, bottom = fig.axes[:3], fig.axes[3:]
    assert {round(ax.get_position().width, 2) for ax in top} == {round(top[0].get_position().width, 2)}
    assert all(ax.get_position().width > 1.4 * top[0].get_position().width for ax in bottom)
    assert not resume_lines(by_title["loss (token-weighted)"]), "a run never resumed has no resume line"


def test_a_resume_is_marked_in_every_panel_at_the_checkpoint_it_started_from(runs):
    records = read_metrics(runs["resumed"])
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]  # the steps alone do not show the resume
    assert report.resumes(records) == [RESUME_STEP]  # the index of step 3, the resumed process's first record
    fig = report.figure([runs["resumed"]])
    assert all(resume_lines(ax) == [RESUME_STEP] for ax in fig.axes)
    assert f"resumed after step {RESUME_STEP}" in fig.get_suptitle()


def test_a_resume_whose_first_step_outlasts_the_whole_attempt_before_is_still_seen(tmp_path):
    """A resumed process's clock can pass the earlier one's (a first step that compiles, after an attempt of
    one quick step): where the step began on its own clock tells, not whether elapsed_s went down."""
    import torch

    from accum_cli.rundir.metrics import Reporter, keep_metrics_until
    from accum_cli.step.loop import StepResult

    def attempt(steps: range, pause: float) -> None:
        with Reporter(tmp_path, 3, torch.device("cpu"), True, start_step=steps.start) as reporter:
            for step in steps:
                started = time.perf_counter()
                time.sleep(pause)
                reporter.step(step, StepResult(2.0, 100, 128, 1.0, 1e-3), time.perf_counter() - started)

    attempt(range(2), pause=0.01)
    keep_metrics_until(tmp_path, 1)
    attempt(range(1, 3), pause=0.2)
    records = read_metrics(tmp_path)
    assert records[1]["elapsed_s"] > records[0]["elapsed_s"], "the case under test: no clock going back"
    assert report.resumes(records) == [1]


def test_elapsed_s_summed_from_step_s_marks_no_resume():
    """A file whose elapsed_s is the running sum of its step_s (one converted from another logger, say):
    rounding puts a step's start a hair before the previous record's end, which is no new process."""
    import itertools
    import random

    draw = random.Random(0)
    step_s = [draw.uniform(0.5, 1.5) for _ in range(2000)]
    elapsed = list(itertools.accumulate(step_s))
    records = [
        {"step": i + 1, "step_s": s, "elapsed_s": e} for i, (s, e) in enumerate(zip(step_s, elapsed, strict=True))
    ]
    assert any(r["elapsed_s"] - r["step_s"] < before["elapsed_s"] for before, r in itertools.pairwise(records))
    assert report.resumes(records) == []


def test_tokens_per_s_is_a_trailing_mean_per_process_over_its_faint_steps(runs):
    records = read_metrics(runs["resumed"])
    raw = [r["tokens_per_s"] for r in records]
    ax = panels(report.figure([runs["resumed"]]))["tokens/s"]
    faint = [line for line in ax.lines if line.get_alpha() is not None and line.get_alpha() < 0.5]
    assert len(faint) == 1 and list(faint[0].get_ydata()) == raw and faint[0].get_linestyle() == "None"
    smooth = [line for line in ax.lines if line not in faint and not vertical(line)]
    window = math.ceil(math.sqrt(len(raw)))  # 3 of 5 points
    assert window == 3
    before, after = raw[:RESUME_STEP], raw[RESUME_STEP:]  # each process its own line, its own window
    expected = [[before[0], sum(before) / 2], [after[0], sum(after[:2]) / 2, sum(after) / 3]]
    assert [list(line.get_ydata()) for line in smooth] == [pytest.approx(values) for values in expected]
    assert [list(line.get_xdata()) for line in smooth] == [[1, 2], [3, 4, 5]]


def test_compared_runs_of_other_batches_are_drawn_against_the_tokens_trained(runs):
    fig = report.figure([runs["resumed"], runs["half_batch"]])
    assert {ax.get_xlabel() for ax in fig.axes} == {"tokens trained"}
    loss = panels(fig)["loss (token-weighted)"]
    for folder in (runs["resumed"], runs["half_batch"]):
        (line,) = [line for line in loss.lines if line.get_label() == folder.name]
        tokens = [r["tokens"] for r in read_metrics(folder)]
        assert list(line.get_xdata()) == [sum(tokens[: i + 1]) for i in range(len(tokens))]
    resumed_tokens = [r["tokens"] for r in read_metrics(runs["resumed"])]
    assert resume_lines(loss) == [sum(resumed_tokens[:RESUME_STEP])]
    # One batch at another learning rate: the same tokens in every step, so the steps line up as they are.
    same = report.figure([runs["resumed"], runs["other_lr"]])
    assert {ax.get_xlabel() for ax in same.axes} == {"optimizer step"}


def test_only_panels_with_data_are_drawn(tmp_path):
    """Steps that were all skipped (non-finite) record no gradient norm: four panels, two above two."""
    import torch

    from accum_cli.errors import UserError
    from accum_cli.rundir.metrics import Reporter
    from accum_cli.step.loop import StepResult

    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(UserError, match="no step recorded yet"):
        report.figure([tmp_path])
    with Reporter(tmp_path, 4, torch.device("cpu"), True) as reporter:
        for step in range(4):
            reporter.step(step, StepResult(2.0, 100, 128, math.nan, 1e-3, skipped=True), 0.1)
    fig = report.figure([tmp_path])
    assert list(panels(fig)) == ["loss (token-weighted)", "learning rate", "tokens/s", "peak memory (GiB)"]
    boxes = [ax.get_position() for ax in fig.axes]
    assert len({round(box.x0, 2) for box in boxes}) == 2 and len({round(box.y0, 2) for box in boxes}) == 2
    assert len({round(box.width, 2) for box in boxes}) == 1
