"""Every way to start accum-train gives the same training (docs/ARCHITECTURE.md, invariant 1).

Real launchers in subprocesses on CPU: `accelerate launch` with an Accelerate config,
the `--nproc` wrapper (Accelerate's launcher underneath), and two "nodes" on one machine
rendezvousing on 127.0.0.1. Each run's metrics.jsonl and final weights are compared with
a single-process run of the same command.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest
from helpers import (
    BIN,
    REPO,
    env,
    free_port,
    python,
    read_metrics,
    rel_err,
    run_cli,
    run_cli_after,
    save_tiny_model,
    write_ragged_tokens,
)
from safetensors.torch import load_file

pytestmark = pytest.mark.distributed
TOL = 1e-5


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("launch")
    save_tiny_model(root / "model")
    write_ragged_tokens(root / "data.jsonl", n_rows=24)
    return root


def common(setup, out, global_batch: int = 11) -> list[str]:
    return ["--model", str(setup / "model"), "--dataset", str(setup / "data.jsonl"), "--global-batch",
            str(global_batch), "--micro-batch", "2", "--max-steps", "3", "--lr", "3e-3", "--warmup-steps", "1",
            "--output-dir", str(out)]  # fmt: skip


@pytest.fixture(scope="module")
def single(setup, tmp_path_factory):
    out = tmp_path_factory.mktemp("single") / "run"
    result = run_cli(common(setup, out))
    assert result.returncode == 0, result.stdout + result.stderr
    return out


def assert_same_run(out, expected) -> None:
    got, want = read_metrics(out), read_metrics(expected)
    assert [m["step"] for m in got] == [m["step"] for m in want] == [1, 2, 3]
    for g, w in zip(got, want, strict=True):
        assert g["loss_tokens"] == w["loss_tokens"]
        assert rel_err(g["loss"], w["loss"]) < TOL and rel_err(g["grad_norm"], w["grad_norm"]) < TOL
        assert g["lr"] == w["lr"]
    a, b = load_file(out / "final/model.safetensors"), load_file(expected / "final/model.safetensors")
    assert a.keys() == b.keys()
    for name in a:
        assert rel_err(a[name], b[name]) < TOL, name


def run(cmd: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=timeout)


def test_accelerate_launch_with_a_cpu_fsdp_config(setup, single, tmp_path):
    """Two processes started by `accelerate launch`; the config's fsdp_cpu_ram_efficient_loading
    is honoured (weights read on rank 0 and broadcast)."""
    out = tmp_path / "run"
    result = run(
        [str(BIN / "accelerate"), "launch", "--config_file", "recipes/accelerate/cpu-2proc.yaml",
         "--main_process_port", str(free_port()), "-m", "accum_cli", *common(setup, out), "--verbose"]
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "cpu x 2 (gloo)" in result.stdout
    assert "weights loaded on rank 0 and broadcast" in result.stdout
    # rank 1 builds on meta, where the fused loss's probe cannot run: it goes with rank 0's
    assert "fused with the output projection" in result.stdout
    assert_same_run(out, single)
    # config.json holds what the accelerate config decided, as flags: a rerun from it without
    # that config (`--recipe config.json` under torchrun) gets the same settings.
    recorded = json.loads((out / "config.json").read_text())["config"]
    assert {k: recorded[k] for k in ("precision", "rank0_loading", "reshard_after_forward", "compile")} == {
        "precision": "fp32", "rank0_loading": True, "reshard_after_forward": True, "compile": None,
    }  # fmt: skip


@pytest.fixture(scope="module")
def wrapper_run(setup, tmp_path_factory):
    """A 2-rank wrapper run whose user has OMP_NUM_THREADS=2 and a broken default Accelerate config."""
    root = tmp_path_factory.mktemp("wrapper")
    out = root / "run"
    # `accelerate config` writes a default for every project (under HF_HOME): a broken one here.
    default = root / "hf" / "accelerate" / "default_config.yaml"
    default.parent.mkdir(parents=True)
    default.write_text("compute_environment: [LOCAL_MACHINE\n")  # broken YAML
    command = [sys.executable, "-m", "accum_cli", "--nproc", "2", "--master-port", str(free_port()), *common(setup, out)]  # fmt: skip
    # Two threads per rank, not the share of the cores (1 on two cores): the user's OMP_NUM_THREADS is kept.
    environment = env(threads=2, HF_HOME=str(root / "hf"))
    result = subprocess.run(command, cwd=REPO, env=environment, capture_output=True, text=True, timeout=300)
    return out, result


def test_the_wrapper_starts_real_gloo_ranks(single, wrapper_run):
    out, result = wrapper_run
    assert result.returncode == 0, result.stdout + result.stderr
    assert "cpu x 2 (gloo), threads 2 per rank (OMP_NUM_THREADS)" in result.stdout
    assert result.stdout.count("── plan") == 1
    assert_same_run(out, single)


def test_two_nodes_on_one_machine_equal_the_single_node_run(setup, wrapper_run, tmp_path):
    """Two wrapper invocations, one process each, machine ranks 0 and 1, rendezvous on 127.0.0.1."""
    single_node, _ = wrapper_run
    out, port = tmp_path / "run", str(free_port())
    nodes = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "accum_cli",
                "--nproc",
                "1",
                "--nnodes",
                "2",
                "--node-rank",
                str(rank),
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                port,
                *common(setup, out),
            ],
            cwd=REPO,
            env=env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for rank in (0, 1)
    ]
    outputs = [node.communicate(timeout=300) for node in nodes]
    for node, (stdout, stderr) in zip(nodes, outputs, strict=True):
        assert node.returncode == 0, stdout + stderr
    assert "cpu x 2 (gloo)" in outputs[0][0]
    assert "── plan" not in outputs[1][0], "only global rank 0 reports"
    assert_same_run(out, single_node)


def test_the_wrapper_refuses_bad_launch_flags_before_starting_anything(setup, tmp_path):
    out = tmp_path / "run"
    for flags, message in [
        (["--nproc", "0"], "--nproc must be >= 1"),
        (["--nproc", "2", "--node-rank", "1"], "--node-rank must lie in 0..0"),
        (["--nproc", "4", "--global-batch", "3"], "smaller than the world size 4"),  # the last flag wins
        (["--nproc", "3", "--replicas", "2"], "--replicas 2 does not divide the world size 3"),
        (["--nproc", "2", "--plan"], "--plan does not start processes"),
        (["--accelerate-config", "nope.yaml"], "--accelerate-config nope.yaml does not exist"),
        # Without --nproc each machine of a multi-node command trained alone, unsaid.
        (["--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1"], "apply with --nproc N"),
        (["--master-port", "99999"], "apply with --nproc N"),
        # An unset variable, or no address at all: every node waited for a node 0 of its own.
        (["--nproc", "1", "--nnodes", "2", "--node-rank", "1", "--master-addr", ""], "--master-addr is empty"),
        (["--nproc", "1", "--nnodes", "2", "--node-rank", "1"], "--nnodes 2 needs --master-addr"),
        (["--nproc", "2", "--accelerate-config", ""], "--accelerate-config is empty"),
    ]:
        result = python(["-m", "accum_cli", *common(setup, out), *flags], timeout=60)  # refused in the parent
        assert result.returncode == 2, (flags, result.stdout + result.stderr)
        assert result.stderr.strip().splitlines() == [result.stderr.strip()] and message in result.stderr, result.stderr
        assert not out.exists()


def test_the_wrapper_ignores_the_users_default_accelerate_config(wrapper_run):
    """`accelerate config` writes a default for every project; the wrapper's flags alone decide
    (Accelerate read it: a broken one ended in a traceback, a valid one turned on its FSDP settings).
    `wrapper_run`'s user has a broken one."""
    out, result = wrapper_run
    assert (out.parent / "hf" / "accelerate" / "default_config.yaml").read_text().startswith("compute_environment: [")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "cpu x 2 (gloo)" in result.stdout, "the wrapper's --nproc 2 decided, not the config"


def test_the_worker_killed_first_is_named_not_those_the_agent_stopped_after_it():
    """Rank 1 killed (-9), rank 0 then stopped by the agent's SIGTERM (-15): rank 1 is the cause
    (CI once named rank 0). Only SIGTERMs: the lowest rank; exit codes alone: the lowest rank's."""
    from accum_cli.cli.launcher import outcome

    assert outcome({0: -15, 1: -9}) == (137, "worker rank 1 was killed by SIGKILL (out of memory? killed by hand?)")
    assert outcome({1: -15, 0: -15}) == (143, "worker rank 0 was killed by SIGTERM (out of memory? killed by hand?)")
    assert outcome({1: 2, 0: 74}) == (74, None)
    # Rank 0 refused (exit 2, its one line printed), rank 1 was then stopped by the agent: the
    # refusal's code and no word of a kill (it was exit 143 and "rank 1 was killed by SIGTERM").
    assert outcome({0: 2, 1: -15}) == (2, None)


SLOW_SAVE = """
import time
from accum_cli.rundir import checkpoint

saved = checkpoint.save


def slow_save(*args, **kwargs):  # a big model's checkpoint: longer than torch's 30 s shutdown timeout
    time.sleep(32)
    return saved(*args, **kwargs)


checkpoint.save = slow_save
"""


@pytest.fixture(scope="module")
def slow_save_stopped(setup, tmp_path_factory):
    """A 2-rank wrapper run, without OMP_NUM_THREADS, whose every process saves a checkpoint in over
    30 s, stopped by a SIGTERM to the wrapper after its first step: its folder and its completed process."""
    root = tmp_path_factory.mktemp("slow-save")
    hooks = root / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(SLOW_SAVE)  # every process of the run saves slowly
    out = root / "run"
    cmd = [str(BIN / "accum-train"), "--nproc", "2", "--master-port", str(free_port()),
           *common(setup, out, global_batch=4), "--max-steps", "400"]  # fmt: skip
    run_env = env(PYTHONPATH=f"{hooks}:{REPO}")
    run_env.pop("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", None)
    run_env.pop("OMP_NUM_THREADS")  # the wrapper sets each rank's share of the cores
    proc = subprocess.Popen(cmd, cwd=REPO, env=run_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.exists() and metrics.read_text().strip()):
        assert proc.poll() is None and time.monotonic() < deadline, "the run ended before it could be signalled"
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)  # as Slurm signals the batch step
    stdout, stderr = proc.communicate(timeout=180)
    return out, subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def test_a_sigterm_to_the_wrapper_waits_for_a_save_longer_than_torchs_30_s(slow_save_stopped):
    """torch's elastic agent SIGKILLs its workers 30 s after forwarding a SIGTERM: a checkpoint that
    takes longer (a big model) was cut off mid-save, exit 143, no requeue. The wrapper gives them longer.
    Also the plain case: a SIGTERM to the wrapper, as Slurm sends it, ends the run in exit 75 with a checkpoint."""
    out, result = slow_save_stopped
    assert result.returncode == 75, result.stdout + result.stderr
    done = len(read_metrics(out))
    assert (out / "checkpoints" / f"step-{done:06d}" / "meta.json").is_file()
    assert not list((out / "checkpoints").glob(".tmp-*"))


STOPPED_WHILE_LOADING = """
import os
import signal
import time
from accum_cli.model import wrap

load = wrap.load_model


def load_and_be_preempted(*args, **kwargs):  # the SIGTERM lands while the weights load
    if os.environ.get("ACCUM_TRAIN_WRAPPED"):  # to the wrapper, as Slurm sends it: it forwards it
        if os.environ["RANK"] == "0":
            os.kill(os.getppid(), signal.SIGTERM)
        time.sleep(30)  # interrupted by the forwarded signal
    else:
        os.kill(os.getpid(), signal.SIGTERM)
    return load(*args, **kwargs)


wrap.load_model = load_and_be_preempted
"""


@pytest.mark.parametrize("how", ["one process", "wrapper"])
def test_a_sigterm_before_the_first_step_exits_75_and_the_same_command_then_trains(setup, tmp_path, how):
    """Preempted while loading (no step begun): exit 75, which the Slurm script requeues on, not a
    death by signal that would end the job; the same command line then trains from the start."""
    out = tmp_path / "run"
    args = [*common(setup, out, global_batch=4), "--resume", "auto"]
    if how == "wrapper":  # the wrapper and its workers: real launches, with the patch in every process
        hooks = tmp_path / "hooks"
        hooks.mkdir()
        (hooks / "sitecustomize.py").write_text(STOPPED_WHILE_LOADING)
        cmd = [str(BIN / "accum-train"), "--nproc", "2", "--master-port", str(free_port()), *args]
        stopped = subprocess.run(cmd, cwd=REPO, env=env(PYTHONPATH=f"{hooks}:{REPO}"), capture_output=True,
                                 text=True, timeout=300)  # fmt: skip
    else:  # one process: forked warm, the patch applied first
        stopped = run_cli_after(STOPPED_WHILE_LOADING, args)
    assert stopped.returncode == 75, stopped.stdout + stopped.stderr
    assert "stopped by SIGTERM before this attempt's first step, nothing trained in it" in stopped.stderr
    assert not (out / "metrics.jsonl").exists() and not (out / "checkpoints").exists()
    again = run(cmd) if how == "wrapper" else run_cli(args)
    assert again.returncode == 0, again.stdout + again.stderr
    assert [m["step"] for m in read_metrics(out)] == [1, 2, 3]


def test_an_accelerate_config_under_home_written_with_an_equals_sign_is_found(tmp_path, monkeypatch):
    """`--accelerate-config=~/cpu.yaml`: the shell leaves a tilde after `=` as it is."""
    import shutil

    from accum_cli.cli.launcher import Launch

    monkeypatch.setenv("HOME", str(tmp_path))
    shutil.copy(REPO / "recipes" / "accelerate" / "cpu-2proc.yaml", tmp_path / "cpu.yaml")
    launch = Launch(None, 1, 0, None, None, "~/cpu.yaml").validate()
    assert launch.accelerate_config == str(tmp_path / "cpu.yaml") and launch.world_size == 2


def test_the_wrapper_gives_each_rank_its_share_of_the_cores_unless_omp_num_threads_is_set(slow_save_stopped):
    """Without OMP_NUM_THREADS each rank would take every core and the ranks fight over them: the wrapper sets
    the cores (the affinity mask's) divided by the local ranks, at least 1, as torchrun sets 1, and the header
    says so (`slow_save_stopped` leaves it unset). A value the user set is kept: `wrapper_run` sets 2,
    test_the_wrapper_starts_real_gloo_ranks reads it."""
    import os

    cores = len(os.sched_getaffinity(0))
    _, result = slow_save_stopped
    assert f"threads {max(1, cores // 2)} per rank (--nproc: {cores} cores / 2 ranks here; " in result.stdout
