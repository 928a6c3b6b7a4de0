"""The memory estimate's child process (estimate.Session's): forked from this process where that is
safe, else a fresh interpreter (`python -m accum_cli.memory.measure`).

Forked, the child starts with what this process has imported: a `--plan`, or any process that has
torch and transformers loaded, saves the fresh interpreter's imports, ~6 CPU-seconds per estimating
child (measured 6 Dec 2026 on 2 cores: a child answering one sharded query took 8-12 CPU-s spawned,
of which a query is ~2). It is forked only where this process holds no process group and no CUDA
state. The child builds a fake process group as the default one, which a process holding a real one
cannot give it (a fork's copy of a gloo or NCCL group cannot be torn down there), and a fork copies
CUDA's state into a child that cannot use it (data/isolate.py): a training rank, which decides after
its process group starts, spawns.

Not multiprocessing's fork context: its child runs multiprocessing's bootstrap and exit path, and
the spawned child's line protocol over pipes would need a second form there; this is a fork and
the same protocol. The child answers over two pipes in `measure.serve`'s line protocol, as the spawned one does over its
stdin and stdout; whatever it prints goes to the session's log file. It keeps no other file of this
process open: a second session's child must not hold the first one's pipe, or the first would never
see the end of its input.
"""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import subprocess
import sys
import time
import traceback

from accum_cli.data import isolate


def start_child(log) -> subprocess.Popen | Forked:
    """The measuring child, with its stderr (and, forked, its stdout) going to `log`, an open file."""
    if forkable():
        return Forked(log)
    env = dict(os.environ)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)  # the child must not join the real run's process group
    env.setdefault("OMP_NUM_THREADS", "1")
    return subprocess.Popen(
        [sys.executable, "-m", "accum_cli.memory.measure"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
        env=env,
    )


def forkable() -> bool:
    """Linux's fork, and nothing in this process that a forked child could not use (torch is looked up
    here, never imported)."""
    if not isolate.available() or isolate.cuda_initialized():
        return False
    dist = sys.modules.get("torch.distributed")
    return not (dist is not None and dist.is_available() and dist.is_initialized())


class Forked:
    """A forked measuring child, behind the part of subprocess.Popen's surface that Session uses."""

    def __init__(self, log) -> None:
        # Imported here, where it stays: every later child of this process starts with it.
        from accum_cli.memory import measure  # noqa: F401

        request_read, request_write = os.pipe()
        answer_read, answer_write = os.pipe()
        sys.stdout.flush()  # or the child's exit would print what this process had buffered again
        sys.stderr.flush()
        gc.freeze()  # as in isolate.in_child: the child's collector leaves this process's objects alone
        parent = os.getpid()
        self.pid = os.fork()
        if self.pid == 0:  # never returns
            _serve(request_read, answer_write, log.fileno(), parent)
        gc.unfreeze()
        os.close(request_read)
        os.close(answer_write)
        self.stdin = os.fdopen(request_write, "w")
        self.stdout = os.fdopen(answer_read)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired("the memory estimate's child", timeout)
            time.sleep(0.01)
        return self.returncode

    def kill(self) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)


def _serve(requests: int, answers: int, log: int, parent: int) -> None:
    """The forked child's whole life: it ends in os._exit, never back in the caller."""
    code = 1
    try:
        isolate.become_child(parent)  # signals, the parent's end, and torch on one thread (OpenMP)
        null = os.open(os.devnull, os.O_RDONLY)
        for target, source in ((0, null), (1, log), (2, log)):
            os.dup2(source, target)
        os.closerange(3, min(requests, answers))  # every other file of the parent's (see above)
        os.closerange(min(requests, answers) + 1, max(requests, answers))
        os.closerange(max(requests, answers) + 1, os.sysconf("SC_OPEN_MAX"))
        sys.stdin = open(0, closefd=False)  # noqa: SIM115
        sys.stdout = sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
        from accum_cli.memory import measure

        with os.fdopen(requests) as lines, os.fdopen(answers, "w") as out:
            measure.serve(lines, out)
        code = 0
    except SystemExit as exc:  # measure.serve's end after a failed query, reported on stderr
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # a bug: its stack in the log, which the parent reads when no answer comes
        with contextlib.suppress(BaseException):
            traceback.print_exc()
    finally:
        with contextlib.suppress(BaseException):
            sys.stderr.flush()
        os._exit(code)
