"""The data work runs in a forked child (isolate.py): the trainer never imports datasets, pandas
or pyarrow (~96 MiB resident per rank), and what the child says comes back as it was said."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
from helpers import REPO, env, free_port, save_tiny_model

from accum_cli import isolate
from accum_cli.errors import UserError

pytestmark = pytest.mark.skipif(not isolate.available(), reason="fork as on Linux")


def test_the_childs_value_comes_back_and_its_imports_stay_there():
    name = "wave"  # a standard module nothing here imports
    assert name not in sys.modules

    def work(x):
        import wave

        return [x * 2, wave.__name__, os.getpid()]

    doubled, imported, pid = isolate.in_child(work, 21)
    assert (doubled, imported) == (42, "wave") and pid != os.getpid()
    assert name not in sys.modules


def test_a_user_error_in_the_child_is_raised_here_with_its_line():
    def bad():
        raise UserError("the dataset has no column 'text'; pass --text-column NAME")

    with pytest.raises(UserError, match=r"^the dataset has no column 'text'; pass --text-column NAME$"):
        isolate.in_child(bad)


def test_a_crash_or_a_kill_in_the_child_is_an_error_here_not_a_value():
    def crash():
        raise KeyError("row")

    with pytest.raises(RuntimeError, match="KeyError"):
        isolate.in_child(crash)
    with pytest.raises(RuntimeError, match="signal 9"):
        isolate.in_child(lambda: os.kill(os.getpid(), signal.SIGKILL))


def test_a_signal_unwinds_the_child_so_its_cleanup_runs(tmp_path):
    """Ctrl-C or a job's SIGTERM: the preparation's finally (its private folder removed) still runs."""
    work = tmp_path / "work"

    def prepare_until_signalled(signum):
        work.mkdir()
        try:
            os.kill(os.getpid(), signum)
            signal.pause()  # not reached: the handler raises
        finally:
            work.rmdir()

    for signum, name in ((signal.SIGTERM, "SystemExit"), (signal.SIGINT, "KeyboardInterrupt")):
        with pytest.raises(RuntimeError, match=name):
            isolate.in_child(prepare_until_signalled, signum)
        assert not work.exists()


DEAD_GROUP_THEN_CHILD = """
import gc, os, sys
import torch.distributed as dist
from accum_cli import isolate
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
gc.disable()  # so the dead group below waits for a collector, as one left by earlier work can
dist.init_process_group("gloo", rank=0, world_size=1)
cycle = {"group": dist.group.WORLD}
cycle["self"] = cycle
dist.destroy_process_group()
del cycle
print(isolate.in_child(lambda: gc.collect() >= 0), flush=True)
"""


def test_a_child_collecting_garbage_never_runs_a_dead_process_groups_destructor():
    """A gloo group's destructor waits for its threads; run by a forked child's collector, which
    has none of them, it would wait forever (it hung a test run once)."""
    done = subprocess.run([sys.executable, "-c", DEAD_GROUP_THEN_CHILD, str(free_port())], cwd=REPO, env=env(),
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0 and done.stdout.strip() == "True", done.stdout + done.stderr


TRAIN_AND_LIST = """
import sys
from accum_cli import cli
exit_process = cli.exit_process
def exit_and_list(code):
    print("HEAVY", [m for m in ("datasets", "pandas", "pyarrow") if m in sys.modules], flush=True)
    exit_process(code)
cli.exit_process = exit_and_list
sys.argv = ["accum-train", *sys.argv[1:]]
cli.entry()
"""


def test_a_training_process_never_imports_the_data_libraries(tmp_path):
    """Tokenised (cache cold) and read back (cache warm), with an evaluation set: the data
    libraries are the children's; the trainer reads the prepared files alone."""
    model = save_tiny_model(tmp_path / "model")
    data = tmp_path / "data.jsonl"
    data.write_text("".join(f'{{"text": "document {i} about the lazy dog and the fox"}}\n' for i in range(40)))
    args = ["--model", str(model), "--dataset", str(data), "--eval-dataset", str(data), "--seq-len", "16",
            "--global-batch", "4", "--micro-batch", "2", "--max-steps", "2"]  # fmt: skip
    cache = {"ACCUM_TRAIN_CACHE": str(tmp_path / "cache")}
    for run, said in (("cold", "done once"), ("warm", "read from the cache")):
        out = ["--output-dir", str(tmp_path / run)]
        done = subprocess.run([sys.executable, "-c", TRAIN_AND_LIST, *args, *out], cwd=REPO, env=env(**cache),
                              capture_output=True, text=True, timeout=300)  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr
        assert said in done.stdout
        assert "HEAVY []" in done.stdout, done.stdout
