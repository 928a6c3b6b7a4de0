"""Preemption: SIGTERM or SIGINT asks every rank to stop at the next optimizer-step boundary.

Slurm and Kubernetes send SIGTERM (torchrun and Accelerate's launcher forward it to their
workers); a terminal sends SIGINT to every rank at once. The handler only sets a flag. At each
step boundary the ranks all-reduce their flags, so they agree to stop after the same step,
save a checkpoint, and exit with EXIT_PREEMPTED. A second signal of the same kind restores
the default action, so a user can still force an immediate stop.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import torch
import torch.distributed as dist

EXIT_PREEMPTED = 75  # EX_TEMPFAIL: stopped on request, checkpoint saved, resume with --resume
SIGNALS = (signal.SIGTERM, signal.SIGINT)
LAUNCHER_POLL_S = 0.5
ORPHAN_GRACE_S = 120.0  # after the launcher is gone: time to finish the step and save, then exit


class StopRequest:
    def __init__(self) -> None:
        self.signal_name: str | None = None
        self.received_at: float | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopRequest:
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)

    def _handle(self, signum, frame) -> None:
        self.signal_name = signal.Signals(signum).name
        self.received_at = time.monotonic()
        signal.signal(signum, self._previous.get(signum, signal.SIG_DFL))  # the next one is not polite

    def agreed(self, device: torch.device) -> bool:
        """Collective: True on every rank when any rank was asked to stop."""
        flag = torch.tensor([1 if self.signal_name else 0], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


def watch_launcher() -> None:
    """A worker whose launcher is gone (torchrun or the --nproc wrapper killed with -9) stops.

    Nobody would watch it otherwise: it would train on and write checkpoints unobserved. A
    daemon thread notices that the parent process changed, points stdout and stderr at
    /dev/null (the launcher held the other ends of those pipes), and sends this process
    SIGTERM: the run stops at the next step boundary and saves, as on preemption. A worker
    still alive after ORPHAN_GRACE_S (stuck in a collective with a dead peer) exits anyway."""
    if "LOCAL_RANK" not in os.environ and "TORCHELASTIC_RUN_ID" not in os.environ:
        return  # started by hand: its parent is a shell, not a launcher
    launcher = os.getppid()

    def watch() -> None:
        while os.getppid() == launcher:
            time.sleep(LAUNCHER_POLL_S)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(ORPHAN_GRACE_S)
        os._exit(EXIT_PREEMPTED)

    threading.Thread(target=watch, name="launcher-watch", daemon=True).start()
