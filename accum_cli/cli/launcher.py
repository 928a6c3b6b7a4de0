"""`accum-train --nproc N ...`: start the worker processes through Accelerate's own launcher.

The wrapper builds an `accelerate launch` command line, hands it to Accelerate's Python API
(`launch_command_parser` / `launch_command`), and forwards every other flag unchanged to
`python -m accum_cli` in each worker. Accelerate picks torch's elastic launcher for N > 1;
on a machine without CUDA, ACCELERATE_USE_CPU=1 keeps `--multi_gpu` from meaning GPUs
(`accelerate launch --cpu --num_processes N` would start one process: docs/ARCHITECTURE.md).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from accum_cli.errors import UserError, first_line
from accum_cli.run.signals import EXIT_PREEMPTED

WRAPPED = "ACCUM_TRAIN_WRAPPED"  # set for workers started by the wrapper
# torch's elastic agent forwards a SIGTERM to the workers and SIGKILLs them after its shutdown
# timeout, 30 s by default: a step and a checkpoint that take longer would be cut off mid-save
# (no checkpoint, exit 143, no requeue). The workers stop at the next step boundary and save;
# this is how long they may take. The batch system's own limit still ends a stuck run.
SHUTDOWN_TIMEOUT_ENV = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"
WORKER_STOP_GRACE_S = 900

# Wrapper flags and whether they take a value; they are not forwarded to the workers.
WRAPPER_FLAGS = {
    "--nproc": True,
    "--nnodes": True,
    "--node-rank": True,
    "--master-addr": True,
    "--master-port": True,
    "--accelerate-config": True,
}


@dataclass(frozen=True, slots=True)
class Launch:
    nproc: int | None  # processes on this machine; None: the accelerate config's num_processes
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None  # None: the accelerate config's, else this machine
    master_port: int | None = None  # None: the accelerate config's, else 29500
    accelerate_config: str | None = None
    config_processes: int | None = None  # the accelerate config's num_processes, read by validate

    def validate(self) -> Launch:
        if self.nproc is not None and self.nproc < 1:
            raise UserError(f"--nproc must be >= 1, got {self.nproc}")
        if self.nnodes < 1:
            raise UserError(f"--nnodes must be >= 1, got {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise UserError(f"--node-rank must lie in 0..{self.nnodes - 1}, got {self.node_rank}")
        if self.master_port is not None and not 0 < self.master_port < 65536:
            raise UserError(f"--master-port must be a TCP port (1-65535), got {self.master_port}")
        if self.master_addr is not None and not self.master_addr.strip():
            raise UserError("--master-addr is empty; pass the address of the machine with node rank 0")
        if self.accelerate_config is not None and not self.accelerate_config.strip():
            raise UserError("--accelerate-config is empty; pass a file from recipes/accelerate/, or drop it")
        if self.accelerate_config and self.accelerate_config.startswith("~"):  # `=~/x.yaml`: no shell expands it
            return dataclasses.replace(
                self, accelerate_config=str(Path(self.accelerate_config).expanduser())
            ).validate()
        if self.nnodes > 1 and self.master_addr is None and not self.accelerate_config:
            # 127.0.0.1 would have every machine wait for a node 0 of its own, for ever
            raise UserError(f"--nnodes {self.nnodes} needs --master-addr: the address of the machine with node rank 0")
        if self.accelerate_config and not Path(self.accelerate_config).is_file():
            raise UserError(
                f"--accelerate-config {self.accelerate_config} does not exist; pass a file from recipes/accelerate/"
            )
        if self.nproc is None and not self.accelerate_config:
            raise UserError("pass --nproc N (or --accelerate-config FILE) to start worker processes")
        if self.accelerate_config:
            return dataclasses.replace(self, config_processes=_config_processes(self.accelerate_config))
        return self

    @property
    def world_size(self) -> int | None:
        return self.config_processes if self.nproc is None else self.nproc * self.nnodes


def _config_processes(path: str) -> int | None:
    """The config's num_processes, read by Accelerate's own loader: a file it cannot read (a
    recipe given by mistake, broken YAML) is refused here, before any worker starts."""
    from accelerate.commands.config.config_args import load_config_from_file

    try:
        config = load_config_from_file(path)
    except Exception as exc:
        raise UserError(
            f"--accelerate-config {path} is not an Accelerate config ({first_line(exc)[:120]}); pass a file "
            "written by `accelerate config`, such as those in recipes/accelerate/"
        ) from None
    processes = getattr(config, "num_processes", None)
    return processes if isinstance(processes, int) and processes >= 1 else None


def worker_args(raw_args: list[str]) -> list[str]:
    """The user's flags minus the wrapper's own."""
    forwarded, skip = [], False
    for arg in raw_args:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in WRAPPER_FLAGS:
            skip = WRAPPER_FLAGS[name] and "=" not in arg
            continue
        forwarded.append(arg)
    return forwarded


def accelerate_args(launch: Launch, mixed_precision: str | None, forwarded: list[str]) -> list[str]:
    args: list[str] = []
    if launch.accelerate_config:
        args += ["--config_file", launch.accelerate_config]
    if launch.nproc is not None:
        total = launch.nproc * launch.nnodes
        args += ["--num_processes", str(total), "--num_machines", str(launch.nnodes)]
        if total > 1 and not launch.accelerate_config:
            args.append("--multi_gpu")  # torch's elastic launcher; CPU workers thanks to ACCELERATE_USE_CPU
    if launch.nnodes > 1 or launch.nproc is not None:
        args += ["--machine_rank", str(launch.node_rank)]
    # A flag given wins; else the config's own (a multi-node config names node 0), else this machine.
    addr = launch.master_addr or (None if launch.accelerate_config else "127.0.0.1")
    port = launch.master_port or (None if launch.accelerate_config else 29500)
    if addr is not None:
        args += ["--main_process_ip", addr]
    if port is not None:
        args += ["--main_process_port", str(port)]
    if mixed_precision is not None:
        args += ["--mixed_precision", mixed_precision]
    if not launch.accelerate_config:
        args += ["--dynamo_backend", "no"]
    return [*args, "-m", "accum_cli", *forwarded]


def mixed_precision_for(precision: str, launch: Launch) -> str | None:
    """Our --precision in Accelerate's words; None lets an accelerate config decide."""
    if precision == "auto":
        if launch.accelerate_config:
            return None
        import torch

        return "bf16" if torch.cuda.is_available() else "no"
    return {"bf16": "bf16", "fp32": "no"}[precision]


def run(launch: Launch, mixed_precision: str | None, forwarded: list[str], output_dir: Path) -> tuple[int, str | None]:
    """Start the workers and wait. Returns the first failing worker's exit code, and what
    happened to a worker that died without reporting (killed by a signal), if one did."""
    import torch
    from accelerate.commands import launch as accelerate_launch
    from accelerate.commands.launch import launch_command, launch_command_parser

    if not torch.cuda.is_available():
        os.environ["ACCELERATE_USE_CPU"] = "1"
    os.environ[WRAPPED] = "1"
    if "OMP_NUM_THREADS" not in os.environ:  # yours, if you set one; else a share of the cores each, as torchrun
        from accum_cli.parallel.runtime import WRAPPER_THREADS, available_cores, threads_per_rank

        local_ranks = launch.nproc or max(1, (launch.config_processes or 1) // launch.nnodes)
        os.environ["OMP_NUM_THREADS"] = str(threads_per_rank(local_ranks))
        os.environ[WRAPPER_THREADS] = f"{available_cores()}/{local_ranks}"
    os.environ.setdefault(SHUTDOWN_TIMEOUT_ENV, str(WORKER_STOP_GRACE_S))  # yours, if you set one
    # The workers report their own failures in one line; the agent's log lines would bury it.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    args = launch_command_parser().parse_args(accelerate_args(launch, mixed_precision, forwarded))
    if not launch.accelerate_config:
        # Accelerate would read the user's default config (`accelerate config`, made for other
        # projects) and apply its FSDP, precision and machine settings to this run unasked, or
        # fail with a traceback on a broken one: the wrapper's flags alone decide.
        accelerate_launch.default_config_file = os.devnull  # not a file: Accelerate finds no default
    try:
        launch_command(args)
    except subprocess.CalledProcessError as exc:  # one process: Accelerate's simple launcher
        return _died(0, exc.returncode) if exc.returncode < 0 else (exc.returncode or 1, None)
    except SystemExit as exc:
        # Accelerate turns a signal to the launcher (SIGTERM from Slurm, Ctrl-C) into exit
        # 128 + signal, after the elastic agent forwarded it to the workers and let them stop.
        return after_a_signal(exc.code if isinstance(exc.code, int) else 1, output_dir)
    except Exception as exc:
        # torch elastic's ChildFailedError carries each worker's exit code
        failures = getattr(exc, "failures", None)
        if not failures:
            raise
        return outcome({rank: f.exitcode for rank, f in failures.items()})
    return 0, None


def outcome(exitcodes: dict[int, object]) -> tuple[int, str | None]:
    """The wrapper's exit code, and what happened to a worker killed by a signal, from the failed
    workers' exit codes by rank. When one worker dies, the agent sends the others SIGTERM: a rank
    killed by another signal is the cause, whatever its rank."""
    killed = {rank: code for rank, code in exitcodes.items() if isinstance(code, int) and code < 0}
    by_another_signal = {rank: code for rank, code in killed.items() if code != -signal.SIGTERM}
    if by_another_signal:  # SIGKILL (the OOM killer), SIGSEGV, ...: the cause
        rank = min(by_another_signal)
        return _died(rank, by_another_signal[rank])
    # A worker that exited on its own said why (one line: a refusal's exit 2, a failed save's 74);
    # the SIGTERMs the others got are the agent's answer to it, not the cause.
    exited = {rank: code for rank, code in exitcodes.items() if isinstance(code, int) and code > 0}
    if exited:
        return exited[min(exited)], None
    if killed:
        rank = min(killed)
        return _died(rank, killed[rank])
    return 1, None


def _died(rank: int, exitcode: int) -> tuple[int, str]:
    """A worker killed by a signal (negative exit code): exit as a shell would, 128 + signal."""
    name = signal.Signals(-exitcode).name if -exitcode in signal.Signals._value2member_map_ else f"signal {-exitcode}"
    return 128 - exitcode, f"worker rank {rank} was killed by {name} (out of memory? killed by hand?)"


def after_a_signal(code: int, output_dir: Path) -> tuple[int, str | None]:
    """The wrapper's exit code once a SIGTERM or Ctrl-C reached it, from what the run folder holds:
    0 where the run had finished (final/ written after its last checkpoint: nothing to requeue),
    75 where a checkpoint holds every completed step (requeue and resume), else the signal's code."""
    if code not in (128 + signal.SIGTERM, 128 + signal.SIGINT):
        return code, None
    if _finished(output_dir):
        print("accum-train: the run had finished (final/ written) when the signal arrived", file=sys.stderr)
        return 0, None
    return (EXIT_PREEMPTED, None) if _nothing_lost(output_dir) else (code, None)


def _finished(output_dir: Path) -> bool:
    from accum_cli.rundir import checkpoint_meta

    newest = checkpoint_meta.latest(output_dir)
    final = output_dir / "final" / "config.json"
    if newest is None or not final.is_file():
        return False
    return final.stat().st_mtime >= (newest / checkpoint_meta.META).stat().st_mtime


def _nothing_lost(output_dir: Path) -> bool:
    """The workers saved a checkpoint at the last step they completed, or stopped before their
    first (none saved, none recorded): the run can go on as if never stopped. (The agent does
    not hand their exit codes back, so the folder tells.)"""
    from accum_cli.rundir import checkpoint_meta
    from accum_cli.rundir.metrics import last_logged_step

    newest = checkpoint_meta.latest(output_dir)
    saved = checkpoint_meta.step_of(newest) if newest is not None else 0
    return saved == last_logged_step(output_dir)
