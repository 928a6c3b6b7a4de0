"""Throughput accounting: model FLOPs per token and MFU only where a peak is known."""


def test_flops_per_token_and_mfu_peaks():
    import torch

    from accum_cli.rundir.metrics import flops_per_token, peak_flops

    # 1B params, 16 layers x 2048, seq 2048: 6e9 + 12*16*2048*2048
    assert flops_per_token(10**9, 16, 2048, 2048) == 6e9 + 805_306_368
    assert peak_flops(torch.device("cpu")) is None  # no MFU claimed on CPU


def test_dropping_redone_records_never_leaves_metrics_half_written(tmp_path, monkeypatch):
    """A resume drops the records it redoes by writing the kept ones beside metrics.jsonl and
    renaming: a full disk mid-write leaves the old file whole, with no temporary beside it."""
    import errno
    import json
    import os

    import pytest

    from accum_cli.rundir import metrics

    path = tmp_path / "metrics.jsonl"
    records = "".join(json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in range(1, 6))
    path.write_text(records + '{"step": 6, "lo')
    full = OSError(errno.ENOSPC, "No space left on device")
    with monkeypatch.context() as m:
        m.setattr(os, "fsync", lambda fd: (_ for _ in ()).throw(full))
        with pytest.raises(OSError):
            metrics.keep_metrics_until(tmp_path, 3)
    assert path.read_text() == records + '{"step": 6, "lo'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]
    metrics.keep_metrics_until(tmp_path, 3)
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]


def test_on_a_terminal_logged_steps_and_evaluations_stay_above_the_progress_bar(tmp_path):
    """The bar shows the latest step only: the --log-every lines and every evaluation are printed
    above it, where they stay (on a terminal they were replaced by the next step's status)."""
    import io
    import re

    import torch
    from rich.console import Console

    from accum_cli.rundir.metrics import Reporter
    from accum_cli.step.loop import StepResult

    screen = io.StringIO()
    reporter = Reporter(tmp_path, 10, torch.device("cpu"), True, log_every=5)
    reporter.console = Console(file=screen, force_terminal=True, width=200, highlight=False)
    with reporter:
        for step in range(10):
            extra = {"eval_loss": 2.5} if step == 2 else None
            reporter.step(step, StepResult(3.0 - step / 10, 100, 128, 1.0, 1e-3), 0.5, extra)
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", screen.getvalue())  # the terminal's colours and cursor moves
    kept = re.findall(r"step (\d+)/10  loss ([\d.]+)[^\n]*?(eval [\d.]+)?\n", text)
    assert kept == [("3", "2.8000", "eval 2.5000"), ("5", "2.6000", ""), ("10", "2.1000", "")], text
