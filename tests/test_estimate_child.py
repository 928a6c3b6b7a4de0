"""The estimating child (memory/child.py): forked from a process that holds no process group, spawned
from one that does, the same answers either way, forked ahead by a rank that will need it, and nothing of
one session's child left in another's."""

from __future__ import annotations

import subprocess
import time

import pytest
import torch.distributed as dist
from helpers import run_cli, save_tiny_model, write_ragged_tokens
from test_estimate import query

from accum_cli.memory import child, estimate
from accum_cli.memory.query import Query
from accum_cli.model.load import EMBEDDED_MODEL_DIR


def test_a_forked_child_answers_as_a_spawned_one(tmp_path, monkeypatch):
    """Without a process group here the child is forked (no interpreter is started); with one, a fresh
    interpreter is (a fork's copy of a real group cannot be torn down for the fake one). The peaks and
    their breakdowns are the same."""
    asked = [query(EMBEDDED_MODEL_DIR, "last", 2)]
    started = []
    real_popen = subprocess.Popen

    def popen(*args, **kwargs):
        started.append(args[0])
        return real_popen(*args, **kwargs)

    monkeypatch.setattr(subprocess, "Popen", popen)
    monkeypatch.setenv("ACCUM_TRAIN_CACHE", str(tmp_path / "forked"))
    forked = estimate.estimate(asked)
    assert started == [], "a child was spawned where it could be forked"
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"file://{tmp_path / 'store'}")
    monkeypatch.setenv("ACCUM_TRAIN_CACHE", str(tmp_path / "spawned"))
    spawned = estimate.estimate(asked)
    assert len(started) == 1 and started[0][1:] == ["-m", "accum_cli.memory.measure"], started
    assert not forked[0].cached and not spawned[0].cached
    assert (forked[0].peak, forked[0].breakdown) == (spawned[0].peak, spawned[0].breakdown)


def test_a_child_forked_after_ops_ran_on_several_threads_does_not_wait_for_them(tmp_path, monkeypatch):
    """This process ran an op on two OpenMP threads; the fork has none of them, and its first parallel op
    (the estimate runs real ones: cpu/linear.py's check) waited for them forever. Cut short here: an
    estimate of the tiny model takes seconds."""
    import torch

    monkeypatch.setenv("ACCUM_TRAIN_CACHE", str(tmp_path))
    monkeypatch.setattr(estimate, "ESTIMATE_TIMEOUT_S", 120)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        torch.randn(512, 512) @ torch.randn(512, 512)  # OpenMP's threads now exist in this process
        torch.nn.functional.linear(torch.randn(64, 256), torch.randn(256, 256))
        found = estimate.estimate([query(EMBEDDED_MODEL_DIR, "every", 3)])
    finally:
        torch.set_num_threads(before)
    assert found[0].peak > 0


def test_a_session_closes_at_once_while_another_sessions_child_lives(tmp_path, monkeypatch):
    """The second session's child is forked while the first one's lives: it must not keep the first
    one's input open, or the first child would never see its end and closing its session would wait
    for the 30 s timeout and kill it."""
    monkeypatch.setenv("ACCUM_TRAIN_CACHE", str(tmp_path))
    first, second = estimate.Session(), estimate.Session()
    try:
        first.estimate([query(EMBEDDED_MODEL_DIR, "every", 1)])
        second.estimate([query(EMBEDDED_MODEL_DIR, "every", 2)])
        began = time.monotonic()
        first.close()
        assert time.monotonic() - began < 10
    finally:
        first.close()
        second.close()


@pytest.mark.parametrize("how", ["forked", "spawned"])
def test_a_query_the_child_cannot_run_is_one_line_naming_why(how, tmp_path, monkeypatch):
    """What the child prints goes to the session's log, whose last line the failure names, forked or
    spawned, however soon after its last words the child is seen to have ended."""
    monkeypatch.setenv("ACCUM_TRAIN_CACHE", str(tmp_path))
    if how == "spawned":
        dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"file://{tmp_path / 'store'}")
    assert child.forkable() == (how == "forked")
    broken = Query({"model_type": "no-such-architecture"}, 2, 1, 1, 16, "last", False, False)
    with pytest.raises(estimate.EstimateFailed) as failed:
        estimate.estimate([broken])
    message = str(failed.value)
    assert "no-such-architecture" in message and "\n" not in message, message


# Loaded at the start of every fresh interpreter of the run (PYTHONPATH): it notes an estimating one.
NOTE_ESTIMATING_INTERPRETERS = """import sys
if "accum_cli.memory.measure" in sys.orig_argv:
    with open({marker!r}, "a") as f:
        f.write(" ".join(sys.orig_argv) + "\\n")
"""


@pytest.mark.distributed
def test_a_rank_that_decides_from_sharded_estimates_starts_no_interpreter_for_them(tmp_path):
    """Rank 0 decides once its process group is up, where a child can only be spawned; it forks the
    child ahead, before the group starts, when the decision may need it (setup.py)."""
    site = tmp_path / "site"
    site.mkdir()
    marker = tmp_path / "estimating-interpreters.txt"
    (site / "sitecustomize.py").write_text(NOTE_ESTIMATING_INTERPRETERS.format(marker=str(marker)))
    args = [
        "--model", str(save_tiny_model(tmp_path / "model")), "--dataset", str(write_ragged_tokens(tmp_path / "d.jsonl")),
        "--global-batch", "8", "--micro-batch", "2", "--layout", "shard", "--max-steps", "1",
        "--output-dir", str(tmp_path / "out"),
    ]  # fmt: skip
    cache = str(tmp_path / "cache")
    done = run_cli(args, nproc=2, env_extra={"PYTHONPATH": str(site), "ACCUM_TRAIN_CACHE": cache})
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(list((tmp_path / "cache" / "estimates").glob("*.json"))) == 3  # each policy's, at m = 2
    assert not marker.exists(), marker.read_text()
