import getpass
import os
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))

# A run draws report.png at each checkpoint, about half of a tiny test run's CPU time (measured 6 Dec 2026:
# 2.5 of 4.9 s for 3 steps). Only the tests that look at the picture draw it (ACCUM_TRAIN_REPORT=1 there);
# launches inherit this through helpers.env().
os.environ.setdefault("ACCUM_TRAIN_REPORT", "0")
# Inductor keeps its compiled kernels under the temporary folder, which suite_cache moves: they stay where
# torch keeps them by default (a path set here, before any process is started, is the same in all of them).
os.environ.setdefault(
    "TORCHINDUCTOR_CACHE_DIR", os.path.join(tempfile.gettempdir(), "torchinductor_" + getpass.getuser())
)

# `make test`'s two workers share the two cores: each computes on one thread, as every process they launch does
# (helpers.env: OMP_NUM_THREADS=1), not on all of them each (torch's default), which oversubscribes the cores.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)


@pytest.fixture(scope="session", autouse=True)
def suite_cache(tmp_path_factory):
    """The suite's own data and estimate cache, never the user's (~/.cache/huggingface/datasets):
    the tests write nothing there, and a run of the suite costs the same on a fresh machine as on one
    that ran it before. Shared by the test workers of one run (xdist's give each a folder under one
    root), so a preparation or an estimate that several tests ask for is made once; pytest removes it
    with its other old folders. The temporary folder of every process the tests start is there too: the
    launchers' and trackers' leftovers (torchelastic_*, wandb's) go with it, not into /tmp run after run."""
    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    for name, folder in (
        ("ACCUM_TRAIN_CACHE", "accum-cache"),
        ("HF_DATASETS_CACHE", "datasets-cache"),
        ("TMPDIR", "tmp"),
    ):
        (root / folder).mkdir(exist_ok=True)
        os.environ[name] = str(root / folder)
    tempfile.tempdir = os.environ["TMPDIR"]  # this process's own, which tempfile read once already
    yield root


@pytest.fixture(autouse=True)
def no_process_group_leaks():
    """A test that started a process group in this interpreter must not leak it into the next."""
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


# `make test` hands whole files to its workers in collection order (xdist's loadfile): a long file
# handed out last runs alone at the end. These take longest (minutes each, measured 6 Dec 2026), so
# they go first; every other file keeps its place after them, and the tests of a file keep their order.
LONGEST_FIRST = (
    "test_estimate_real.py", "test_launchers.py", "test_estimate.py", "test_lora.py", "test_checkpoint.py",
    "test_equivalence.py", "test_bad_input.py", "test_trust.py", "test_architectures.py", "test_data.py",
    "test_isolate.py", "test_see_the_run.py", "test_reruns.py", "test_readme.py", "test_verify.py", "test_hostmem.py",
    "test_samples.py", "test_report_picture.py",
)  # fmt: skip


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
