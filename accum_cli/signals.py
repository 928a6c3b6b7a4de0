"""Preemption: SIGTERM or SIGINT asks every rank to stop at the next optimizer-step boundary.

Slurm and Kubernetes send SIGTERM (torchrun and Accelerate's launcher forward it to their
workers); a terminal sends SIGINT to every rank at once. The handler only sets a flag. At each
step boundary the ranks all-reduce their flags, so they agree to stop after the same step,
save a checkpoint, and exit with EXIT_PREEMPTED. A second signal of the same kind restores
the default action, so a user can still force an immediate stop.
"""

from __future__ import annotations

import signal
import time

import torch
import torch.distributed as dist

EXIT_PREEMPTED = 75  # EX_TEMPFAIL: stopped on request, checkpoint saved, resume with --resume
SIGNALS = (signal.SIGTERM, signal.SIGINT)


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
