"""The data work runs in a forked child (isolate.py): the trainer never imports datasets, pandas
or pyarrow (~96 MiB resident per rank), and what the child says comes back as it was said."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import REPO, env, free_port, save_tiny_model

from accum_cli.data import cache, isolate
from accum_cli.errors import UserError

pytestmark = pytest.mark.skipif(not isolate.available(), reason="fork as on Linux")


@pytest.mark.parametrize("extra", [{}, {"HF_HOME": "/srv/hf"}, {"XDG_CACHE_HOME": "/srv/xdg"},
                                   {"HF_DATASETS_CACHE": "/srv/ds", "HF_HOME": "/srv/hf"}])  # fmt: skip
def test_the_cache_is_where_datasets_keeps_its_own_found_without_importing_it(extra):
    """cache_root computes the datasets cache itself (importing datasets is what the trainer
    avoids): the same folder as datasets.config finds, or the cache of earlier runs would be lost."""
    probe = ("import os, sys; from accum_cli.data import cache; print(cache.cache_root(), 'datasets' in sys.modules);"
             "import datasets.config; print(datasets.config.HF_DATASETS_CACHE / 'accum-train')")  # fmt: skip
    environment = {k: v for k, v in env(**extra).items() if k != "ACCUM_TRAIN_CACHE"}
    for name in {"HF_HOME", "XDG_CACHE_HOME", "HF_DATASETS_CACHE"} - set(extra):
        environment.pop(name, None)
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, env=environment, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    ours, theirs = done.stdout.splitlines()
    assert ours == f"{theirs} False"


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
    with pytest.raises(RuntimeError, match="killed by SIGKILL"):
        isolate.in_child(lambda: os.kill(os.getpid(), signal.SIGKILL))


def test_a_signal_ends_the_child_at_once_and_is_told_here():
    """Ctrl-C in the child is Ctrl-C here; another signal is a failure that names it."""

    def signalled(signum):
        os.kill(os.getpid(), signum)
        time.sleep(60)  # not reached: the signal's default action ends the child

    with pytest.raises(RuntimeError, match="killed by SIGTERM"):
        isolate.in_child(signalled, signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt):
        isolate.in_child(signalled, signal.SIGINT)


def test_ctrl_c_while_tokenising_ends_every_process_and_leaves_no_folder(tmp_path):
    """Ctrl-C as a terminal sends it (to the whole process group) while worker processes
    tokenise in the child: the run ends at once (130), no process of it is left, and the
    preparation's private folder is gone. multiprocessing could hang ending a pool whose workers
    were interrupted halfway through a message; the child no longer tries."""
    model = save_tiny_model(tmp_path / "model")
    line = "the quick brown fox jumps over the lazy dog, " * 7  # ~300 bytes a row
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(f'{{"text": "{i} {line}"}}\n' for i in range(72_000)))  # ~24 MB: worker processes
    cache = tmp_path / "cache"
    cmd = [sys.executable, "-m", "accum_cli", "--model", str(model), "--dataset", str(corpus), "--seq-len", "64",
           "--global-batch", "4", "--micro-batch", "2", "--max-steps", "1", "--num-proc", "2",
           "--output-dir", str(tmp_path / "out")]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=REPO, env=env(ACCUM_TRAIN_CACHE=str(cache)), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)  # fmt: skip
    deadline = time.monotonic() + 120
    while not list(cache.glob(".tmp-*")) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert list(cache.glob(".tmp-*")), "the preparation never started"
    time.sleep(0.5)  # the workers are tokenising
    os.killpg(proc.pid, signal.SIGINT)
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, output[-2000:]
    deadline = time.monotonic() + 15
    while _group_alive(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _group_alive(proc.pid), "a process of the run outlived it"
    assert not list(cache.glob(".tmp-*")), list(cache.iterdir())


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


DEAD_GROUP_THEN_CHILD = """
import gc, os, sys
import torch.distributed as dist
from accum_cli.data import isolate
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
import time
from accum_cli.cli import main as cli
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
            "--global-batch", "4", "--micro-batch", "2", "--max-steps", "2", "--verbose"]  # fmt: skip
    cache = {"ACCUM_TRAIN_CACHE": str(tmp_path / "cache")}
    for run, said in (("cold", "done once"), ("warm", "read from the cache")):
        out = ["--output-dir", str(tmp_path / run)]
        done = subprocess.run([sys.executable, "-c", TRAIN_AND_LIST, *args, *out], cwd=REPO, env=env(**cache),
                              capture_output=True, text=True, timeout=300)  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr
        assert said in done.stdout
        assert "HEAVY []" in done.stdout, done.stdout


# The spawned child (a process that holds CUDA is never forked) unpickles its function by name:
# these live at module level.
PARENTS_STATE: list[str] = []  # filled in by the test: a forked child has it, a spawned one imports this afresh


def _report_pid_and_the_parents_state(x):
    return [x * 2, os.getpid(), bool(PARENTS_STATE)]


def _refuse():
    raise UserError("the dataset has no column 'text'; pass --text-column NAME")


def _crash():
    raise KeyError("row")


def _signal_self(signum):
    os.kill(os.getpid(), signum)
    time.sleep(60)


def test_a_process_holding_cuda_spawns_its_child_instead_of_forking(monkeypatch):
    """A fork would copy CUDA's and NCCL's state into the child; a spawned child starts afresh
    (it has none of this process's state, which a forked one inherits), and says what a forked one says."""
    monkeypatch.setattr(sys.modules[__name__], "PARENTS_STATE", ["set in the parent"])
    forked = isolate.in_child(_report_pid_and_the_parents_state, 21)
    assert forked[0] == 42 and forked[1] != os.getpid() and forked[2], "forked: the parent's state"
    monkeypatch.setattr(isolate, "cuda_initialized", lambda: True)
    doubled, pid, inherited = isolate.in_child(_report_pid_and_the_parents_state, 21)
    assert doubled == 42 and pid != os.getpid() and not inherited, "spawned: a fresh interpreter"
    with pytest.raises(UserError, match=r"^the dataset has no column 'text'; pass --text-column NAME$"):
        isolate.in_child(_refuse)
    with pytest.raises(RuntimeError, match="KeyError"):
        isolate.in_child(_crash)
    with pytest.raises(RuntimeError, match="killed by SIGTERM"):
        isolate.in_child(_signal_self, signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt):
        isolate.in_child(_signal_self, signal.SIGINT)


def test_cuda_is_looked_up_not_imported():
    """The data layer's check never imports torch into a process that has not (the estimate's and
    the trainer's own imports decide that), and a CPU torch reports no CUDA state."""
    code = "import sys; from accum_cli.data import isolate; print(isolate.cuda_initialized(), 'torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env(), capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.stdout.split() == ["False", "False"], done.stdout + done.stderr


def test_the_suite_keeps_its_caches_out_of_the_users_home(suite_cache):
    """conftest.py's own cache: what the tests prepare and estimate lands under pytest's folder, never in
    ~/.cache, whose leftovers made earlier runs of the suite look faster than a fresh machine's."""
    from accum_cli.memory import estimate

    assert cache.cache_root() == suite_cache / "accum-cache"
    assert estimate.cache_dir().parent == suite_cache / "accum-cache"
    assert os.environ["HF_DATASETS_CACHE"] == str(suite_cache / "datasets-cache")
    assert not cache.cache_root().is_relative_to(Path.home())
