"""Work done in a forked child, so the trainer never holds the libraries it needs.

Reading and tokenising the dataset takes `datasets` (and with it pandas and pyarrow): ~96 MiB of
resident memory per process once imported, which Python never gives back, held by every rank
for the whole run although training reads only the prepared files (numpy memory maps). A child
forked for the data work imports them, does it, and exits with its memory; the trainer reads
what it wrote. On issue 11's memory workload (bench/memory.py) the resident set before the model
is built fell from 455 to 356 MiB per rank, and the sharded peak from ~1095 to ~1000 MiB.

The child reports back through a pipe as JSON (our own child, our own format; nothing is
unpickled): its return value, or the one line of a UserError, which the parent raises as its
own, so bad input still gives one line and exit 2. Ctrl-C or a signal ends the child at once
(its own workers die with it), Ctrl-C there is Ctrl-C here, and the caller removes what a
stopped child left (run/setup.py). Where fork is not what it is on Linux, the function runs in this
process instead: the same result, without the saving.

A process that has initialised CUDA (a GPU run: the process group and the device exist before the
data is prepared) is never forked: a fork copies CUDA's and NCCL's state into a child that cannot
use it. There the child is spawned (a fresh interpreter that imports only what the work needs),
and the function and its arguments reach it through multiprocessing (our own objects, to our own
child); the answer comes back as JSON as from a forked child.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import json
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable

from accum_cli.errors import UserError, first_line

STOP_GRACE_S = 5.0  # for a child told to stop (SIGTERM) to end before SIGKILL


def available() -> bool:
    return sys.platform.startswith("linux") and hasattr(os, "fork")


def cuda_initialized() -> bool:
    """Whether this process holds CUDA state (torch is looked up, never imported, here)."""
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_initialized())


def in_child(fn: Callable, *args):
    """fn(*args) in a child (forked; spawned where CUDA is initialised): its JSON-able result, or
    its UserError raised here."""
    if not available():
        return fn(*args)
    if cuda_initialized():
        return in_spawned_child(fn, *args)
    read_end, write_end = os.pipe()
    sys.stdout.flush()  # or the child's exit would print what this process had buffered again
    sys.stderr.flush()
    # The child's garbage collector must leave alone what was made before the fork: a dead process
    # group awaiting collection would run its destructor there and wait forever for gloo's threads,
    # which a forked child does not have.
    gc.freeze()
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        os.close(read_end)
        _serve(write_end, fn, args, parent)
    gc.unfreeze()
    os.close(write_end)
    try:
        with os.fdopen(read_end) as pipe:
            text = pipe.read()
    except BaseException:  # Ctrl-C, or a stop: the child is ended too (the caller removes what it left)
        _stop(pid)
        raise
    _, status = os.waitpid(pid, 0)
    return _answer(text, status)


def in_spawned_child(fn: Callable, *args):
    """fn(*args) in a spawned child: a module-level function and picklable arguments."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    receive, send = context.Pipe(duplex=False)
    sys.stdout.flush()
    sys.stderr.flush()
    child = context.Process(target=_serve_spawned, args=(send, fn, args, os.getpid()))
    child.start()
    send.close()
    try:
        try:
            text = receive.recv_bytes().decode()
        except EOFError:  # it ended without a word
            text = ""
    except BaseException:  # Ctrl-C, or a stop: the child is ended too
        _stop(child.pid)
        raise
    finally:
        receive.close()
    _, status = os.waitpid(child.pid, 0)
    return _answer(text, status)


def _answer(text: str, status: int):
    """The child's report as the caller's: its value, its UserError, or a failure that names how it ended."""
    report = json.loads(text) if text else {}
    if "error" in report:
        raise UserError(report["error"])
    if "value" in report:
        return report["value"]
    if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGINT:
        raise KeyboardInterrupt  # Ctrl-C reached the child first: this process was interrupted too
    how = f"killed by {signal.Signals(os.WTERMSIG(status)).name}" if os.WIFSIGNALED(status) else report.get("crash")
    raise RuntimeError(f"the data preparation process failed ({how or 'no report'})")


def _stop(pid: int) -> None:
    """SIGTERM, then SIGKILL if the child has not ended within STOP_GRACE_S; waits for its end."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    while time.monotonic() < deadline:
        if os.waitpid(pid, os.WNOHANG)[0]:
            return
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)


def _serve_spawned(connection, fn: Callable, args, parent: int) -> None:
    def send(text: str) -> None:
        connection.send_bytes(text.encode())
        connection.close()

    _serve(send, fn, args, parent)


def _serve(write_end: int | Callable[[str], None], fn: Callable, args, parent: int) -> None:
    """The child's whole life: whatever happens, it ends in os._exit, never back in the caller.
    `write_end` is the pipe's file descriptor (forked) or what sends the report (spawned)."""
    report = {"crash": "no report"}
    try:
        # Ctrl-C or a job's SIGTERM (they reach the child too: its process group) ends the child at
        # once. Unwinding would end its pool of workers, which multiprocessing can hang doing
        # when a worker dies halfway through a message; what a stopped child leaves, the caller
        # removes once it is gone. The parent's handlers, whatever they are, mean nothing here.
        become_child(parent)
        report = {"value": fn(*args)}
    except UserError as exc:
        report = {"error": str(exc)}
    except BaseException as exc:  # a bug: its stack on stderr, its name to the parent
        if not isinstance(exc, (KeyboardInterrupt, SystemExit)):
            traceback.print_exc()
        report = {"crash": f"{type(exc).__name__}: {first_line(exc)}"}
    finally:
        with contextlib.suppress(BaseException):  # a parent gone: nobody to tell
            if callable(write_end):
                write_end(json.dumps(report))
            else:
                with os.fdopen(write_end, "w") as pipe:
                    json.dump(report, pipe)
        with contextlib.suppress(BaseException):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(0)  # no atexit handlers, no second flush: they are the parent's


def become_child(parent: int) -> None:
    """What a child forked (or spawned) to work for `parent` does first: Ctrl-C and SIGTERM end it at
    once, whatever the parent's handlers; it ends with its parent; and it runs torch on one thread.
    OpenMP's worker threads are not copied by a fork, but its record of them is: the child's first op
    run in parallel would wait for them forever, once the parent had run one on several threads (the
    memory estimate's child runs a few real ops: cpu/linear.py's check). On one thread none starts."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    end_with_parent()
    if os.getppid() != parent:  # it died before that took effect
        os._exit(128 + signal.SIGTERM)
    torch = sys.modules.get("torch")  # looked up, never imported
    if torch is not None:
        torch.set_num_threads(1)


PR_SET_PDEATHSIG = 1  # <sys/prctl.h>


def end_with_parent() -> None:
    """This process gets a SIGTERM when its parent dies, however it dies (kill -9, the OOM killer):
    no orphan goes on preparing data nobody waits for, holding its private folder. Linux only."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
