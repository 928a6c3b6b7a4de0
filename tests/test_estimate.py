"""The memory estimate held against a measurement on real gloo ranks, and its cache."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import BIN, REPO, env, free_port
from typer.testing import CliRunner

from accum_cli import estimate, fit
from accum_cli.cli import app
from accum_cli.model import EMBEDDED_MODEL_DIR

SEQ_LEN = 128
CASES = [(sync, m) for sync in ("every", "last") for m in (1, 4)]
TOLERANCE = 0.15


def query(model_dir: Path, sync: str, micro_batch: int, world_size: int = 2) -> estimate.Query:
    config = json.loads((model_dir / "config.json").read_text())
    return estimate.Query(config, world_size, 1, micro_batch, SEQ_LEN, sync, bf16=False, activation_checkpointing=False)


def invoke(args: list[str]):
    return CliRunner().invoke(app, args, catch_exceptions=False)


def measured(model_dir: Path) -> dict[tuple[str, int], int]:
    """Peak tensor bytes per rank of real steps on 2 gloo ranks (FSDPMemTracker in real mode)."""
    cmd = [
        str(BIN / "torchrun"), "--nproc_per_node=2", f"--master_port={free_port()}", "--master_addr=127.0.0.1",
        str(REPO / "bench" / "measure_peak.py"), "--model", str(model_dir), "--seq-len", str(SEQ_LEN),
        "--sync", "every", "last", "--micro-batch", "1", "4",
    ]  # fmt: skip
    done = subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return {(row["sync"], row["micro_batch"]): row["peak"] for row in rows}


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    folder = tmp_path_factory.mktemp("estimate-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ACCUM_TRAIN_CACHE", str(folder))
        yield folder


def test_fake_store_import_still_works():
    """The fake process group's store lives in a private torch module: an upgrade that moves it
    must fail here, by name, not as an obscure error in --plan."""
    import torch.distributed as dist

    dist.init_process_group("fake", rank=0, world_size=64, store=estimate.fake_store())
    assert dist.get_world_size() == 64  # a world of 64 in one process: what the estimate plans on
    dist.destroy_process_group()


@pytest.mark.distributed
def test_estimate_matches_real_ranks(cache):
    """The embedded model; the ~30M-parameter Llama takes ~3 min here, so bench/estimate.py holds it."""
    model_dir = EMBEDDED_MODEL_DIR
    got = dict(zip(CASES, (e.peak for e in estimate.estimate([query(model_dir, s, m) for s, m in CASES])), strict=True))
    real = measured(model_dir)
    for case in CASES:
        assert abs(got[case] - real[case]) <= TOLERANCE * real[case], (case, got[case], real[case])
    # The choices made from the estimate need its order to be right, not only its size.
    assert sorted(CASES, key=got.get) == sorted(CASES, key=real.get), (got, real)


def test_second_estimate_comes_from_the_cache(cache):
    q = query(EMBEDDED_MODEL_DIR, "every", 2)
    first, again = estimate.estimate([q]), estimate.estimate([q])
    assert not first[0].cached and again[0].cached
    assert again[0].peak == first[0].peak and again[0].breakdown == first[0].breakdown
    assert sum(first[0].breakdown.values()) == first[0].peak
    assert list(cache.glob("estimates/*.json")), "nothing was written to the cache folder"


def test_estimate_runs_in_a_child_and_leaves_this_process_alone(cache):
    import torch.distributed as dist

    estimate.estimate([query(EMBEDDED_MODEL_DIR, "last", 3)])
    assert not dist.is_initialized(), "the fake process group leaked into the caller"


def plan_args(micro_batch: str, budget_bytes: float, *extra: str) -> list[str]:
    gib = f"{budget_bytes / fit.BUDGET_SHARE / 2**30:.6f}"
    return ["--plan", "--global-batch", "64", "--micro-batch", micro_batch, "--world-size", "2", "--precision", "fp32",
            "--device-memory-gib", gib, *extra]  # fmt: skip


def peaks(sync: str, micro_batches) -> list[int]:
    return [e.peak for e in estimate.estimate([query(EMBEDDED_MODEL_DIR, sync, m) for m in micro_batches])]


def test_auto_policy_is_the_least_communication_that_fits(cache):
    every, last, keep = (peaks(sync, [4])[0] for sync in ("every", "last", "last-keep-params"))
    assert every < last <= keep
    tight = invoke(plan_args("4", (every + last) / 2))
    assert tight.exit_code == 0, tight.output
    assert "chosen: every" in tight.output and "every fits" in tight.output
    roomy = invoke(plan_args("4", keep * 1.01))
    assert "chosen: last-keep-params" in roomy.output, roomy.output


def test_auto_micro_batch_is_the_largest_that_fits(cache):
    by_m = peaks("every", range(1, 7))
    budget = (by_m[3] + by_m[4]) / 2  # m = 4 fits, m = 5 does not
    result = invoke(plan_args("auto", budget, "--sync", "every"))
    assert result.exit_code == 0, result.output
    assert "micro batch       4 sequences per forward/backward" in result.output
    assert "micro batch       4 (largest that fits" in result.output


def test_a_budget_too_small_for_one_sequence_is_refused_in_one_line(cache):
    one = peaks("every", [1])[0]
    result = subprocess.run(
        [sys.executable, "-m", "accum_cli", *plan_args("auto", one * 0.9)],
        cwd=REPO, env=env(ACCUM_TRAIN_CACHE=str(cache)), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    line = result.stderr.strip()
    assert line.count("\n") == 0 and line.startswith("accum-train: error: ") and "Traceback" not in line
    smallest = float(line.split("the smallest device memory that works is ")[1].split(" MiB")[0])
    assert abs(smallest * 2**20 - one / fit.BUDGET_SHARE) < 0.2 * 2**20
    for hint in ("more ranks", "--activation-checkpointing", "--sync every"):
        assert hint in line


def test_gpu_check_imports_and_parses_its_arguments():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "bench" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    args = module.parse_args(["--micro-batch", "1", "4", "--sync", "last"])
    assert (args.micro_batch, args.sync, args.seq_len) == ([1, 4], ["last"], 2048)
