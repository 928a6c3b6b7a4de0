"""Issue 37, the faults that ended in a traceback or in words that mislead: each now one line and
exit 2, before anything is written (the same command works once the cause is gone)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from helpers import REPO, env, message_lines, python, save_tiny_model
from typer.testing import CliRunner

from accum_cli.cli.main import app
from accum_cli.rundir import metrics

DEEP = "[" * 100_000  # json.loads recurses once per level: RecursionError, not ValueError, before


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("inputs") / "tiny")


def refused(args: list[str], out: Path) -> str:
    result = CliRunner().invoke(app, [*args, "--output-dir", str(out), "--global-batch", "4", "--micro-batch", "2"])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("accum-train: error: ") and "Traceback" not in result.output
    assert not out.exists(), "nothing is written before a refusal"
    return lines[0]


def test_a_dataset_path_that_is_not_a_file_or_a_folder_of_data_is_one_line(model, tmp_path):
    """A device, a pipe, an empty folder or one of other files: refused in the preflight, naming
    the path and what a dataset can be (they reached `datasets`' EmptyDatasetError traceback)."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    (tmp_path / "empty").mkdir()
    (tmp_path / "others").mkdir()
    (tmp_path / "others" / "notes.md").write_text("not data")
    (tmp_path / "others" / ".hidden.jsonl").write_text('{"text": "hidden files are not read"}\n')
    for path, said in [("/dev/null", "is neither a regular file nor a folder"),
                       (fifo, "is neither a regular file nor a folder"),
                       (tmp_path / "empty", "holds no .txt, .jsonl"),
                       (tmp_path / "others", "holds no .txt, .jsonl")]:  # fmt: skip
        line = refused(["--model", str(model), "--dataset", str(path)], tmp_path / "run")
        assert f"--dataset {path} {said}" in line, line


def test_an_empty_resume_is_named_as_empty(model, tmp_path):
    """`--resume "$CKPT"` with CKPT unset: was "--resume . is incomplete"."""
    line = refused(["--model", str(model), "--resume", ""], tmp_path / "run")
    assert "--resume is empty" in line, line


def test_a_metrics_line_nested_too_deep_is_not_json_to_every_reader(tmp_path):
    """accum-report names the line in one line (it was a RecursionError traceback); a resume and the
    launcher's step count read past it as past a torn line."""
    folder = tmp_path / "run"
    folder.mkdir()
    lines = ['{"step": 1, "loss": 2.0}', DEEP, '{"step": 2, "loss": 1.5}']
    (folder / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    done = python(["-c", "from accum_cli.cli.report import entry; entry()", str(folder)],
                          cwd=REPO, env=env(), capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip() == f"accum-report: error: {folder / 'metrics.jsonl'} line 2 is not JSON; is it a " \
                                  "metrics file of accum-train?"  # fmt: skip
    assert metrics.last_logged_step(folder) == 2
    metrics.keep_metrics_until(folder, 1)
    assert (folder / "metrics.jsonl").read_text() == lines[0] + "\n", "the deep line goes as a torn one does"


def test_a_model_whose_weights_cannot_fit_is_refused_before_it_is_built(tmp_path):
    """A config asking for a vocabulary of 1e9 (128e9 parameters): one line with the numbers, before
    any weight is allocated (it was torch's allocator's traceback), nothing written."""
    from transformers import ByT5Tokenizer, LlamaConfig

    model = tmp_path / "huge"
    LlamaConfig(vocab_size=10**9, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2).save_pretrained(model)  # fmt: skip
    ByT5Tokenizer().save_pretrained(model)
    out = tmp_path / "run"
    done = python(["-m", "accum_cli", "--model", str(model), "--global-batch", "4",
                           "--micro-batch", "2", "--max-steps", "1", "--output-dir", str(out)],
                          cwd=REPO, env=env(), capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
    line = done.stderr.strip()
    assert line.count("\n") == 0 and "the model has 128,000,074,048 parameters" in line, line
    assert "use more ranks or a smaller model" in line and not out.exists()


def test_a_signal_after_the_run_finished_is_success_not_a_preemption(tmp_path):
    """The wrapper's code after a SIGTERM reached it: a run that had written final/ after its last
    checkpoint finished (0, nothing to requeue; it was 75), one whose checkpoint holds every logged
    step was preempted (75), anything else keeps the signal's code."""
    import json
    import signal
    import time

    from accum_cli.cli.launcher import after_a_signal

    term = 128 + signal.SIGTERM
    out = tmp_path / "run"
    (out / "checkpoints" / "step-000002").mkdir(parents=True)
    (out / "checkpoints" / "step-000002" / "meta.json").write_text("{}")
    (out / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in (1, 2)))
    assert after_a_signal(term, out) == (75, None), "a checkpoint at the last logged step: requeue"
    time.sleep(0.05)
    (out / "final").mkdir()
    (out / "final" / "config.json").write_text("{}")
    assert after_a_signal(term, out) == (0, None), "final/ after the last checkpoint: it had finished"
    assert after_a_signal(1, out) == (1, None), "no signal: the workers' own code"
    (out / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in (1, 2, 3)))
    os.utime(out / "final" / "config.json", (0, 0))  # an old final/, before the checkpoint
    assert after_a_signal(term, out) == (term, None), "a step after the checkpoint would be lost: the signal's"


def test_a_stop_during_a_checkpoint_load_is_a_stop_not_a_damaged_checkpoint(tmp_path, monkeypatch):
    """DCP wraps whatever interrupts its load (the run's SIGTERM handler raises a BaseException) as a
    failure of the load, which read as "could not be read ... resume an earlier checkpoint": advice that
    rewinds a healthy run. The stop is raised as itself; a real read error is still refused by name."""
    from torch.distributed.checkpoint.api import CheckpointException

    from accum_cli.errors import UserError
    from accum_cli.rundir import checkpoint

    class Stop(BaseException):  # as run/train.py's StoppedBeforeTraining
        pass

    def failing(error):
        def load(*args, **kwargs):
            raise CheckpointException("load failed", {0: (error, [])})

        return load

    monkeypatch.setattr(checkpoint.safe_dcp, "read_metadata", lambda *a: None)
    monkeypatch.setattr(checkpoint.safe_dcp, "VerifiedReader", lambda *a: None)
    meta = type("Meta", (), {"path": tmp_path / "step-000002", "files": {}})()
    monkeypatch.setattr(checkpoint.dcp, "load", failing(Stop()))
    with pytest.raises(Stop):
        checkpoint.dcp_load({}, meta, "--resume")
    monkeypatch.setattr(checkpoint.dcp, "load", failing(ValueError("bytes missing")))
    with pytest.raises(UserError, match="could not be read"):
        checkpoint.dcp_load({}, meta, "--resume")


def test_a_replicated_micro_batch_auto_refusal_is_one_line_without_torchs_warnings(tmp_path):
    """The replicated layout is estimated in this process, where torch's trackers warned ("The module
    hierarchy tracking maybe be messed up") above the refusal; stderr holds the one line alone."""
    out = tmp_path / "run"
    done = python(["-m", "accum_cli", "--micro-batch", "auto", "--layout", "replicate",
                           "--device-memory-gib", "0.03", "--global-batch", "8", "--max-steps", "1",
                           "--output-dir", str(out)],
                          cwd=REPO, env=env(ACCUM_TRAIN_CACHE=str(tmp_path / "cache")), capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 2, done.stderr[-2000:]
    lines = message_lines(done.stderr)
    assert len(lines) == 1 and lines[0].startswith("accum-train: error: one sequence of 128 tokens"), lines
    assert not out.exists()
