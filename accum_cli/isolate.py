"""Work done in a forked child, so the trainer never holds the libraries it needs.

Reading and tokenising the dataset takes `datasets` (and with it pandas and pyarrow): ~96 MiB of
resident memory per process once imported, which Python never gives back, held by every rank
for the whole run although training reads only the prepared files (numpy memory maps). A child
forked for the data work imports them, does it, and exits with its memory; the trainer reads
what it wrote. On issue 11's memory workload (bench/memory.py) the resident set before the model
is built fell from 455 to 356 MiB per rank, and the sharded peak from ~1095 to ~1000 MiB.

The child reports back through a pipe as JSON (our own child, our own format; nothing is
unpickled): its return value, or the one line of a UserError, which the parent raises as its
own, so bad input still gives one line and exit 2. Where fork is not what it is on Linux, the
function runs in this process instead: the same result, without the saving.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import sys
import traceback
from collections.abc import Callable

from accum_cli.errors import UserError, first_line


def available() -> bool:
    return sys.platform.startswith("linux") and hasattr(os, "fork")


def in_child(fn: Callable, *args):
    """fn(*args) in a forked child: its JSON-able result, or its UserError raised here."""
    if not available():
        return fn(*args)
    read_end, write_end = os.pipe()
    sys.stdout.flush()  # or the child's exit would print what this process had buffered again
    sys.stderr.flush()
    # The child's garbage collector must leave alone what was made before the fork: a dead process
    # group awaiting collection would run its destructor there and wait forever for gloo's threads,
    # which a forked child does not have.
    gc.freeze()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        os.close(read_end)
        _serve(write_end, fn, args)
    gc.unfreeze()
    os.close(write_end)
    with os.fdopen(read_end) as pipe:
        text = pipe.read()
    _, status = os.waitpid(pid, 0)
    report = json.loads(text) if text else {}
    if "error" in report:
        raise UserError(report["error"])
    if "value" not in report:
        how = f"signal {-os.waitstatus_to_exitcode(status)}" if os.WIFSIGNALED(status) else report.get("crash", "")
        raise RuntimeError(f"the data preparation process failed ({how or 'no report'})")
    return report["value"]


def _exit_on_signal(signum, frame) -> None:
    raise SystemExit(128 + signum)


def _serve(write_end: int, fn: Callable, args) -> None:
    # Ctrl-C or a job's SIGTERM reaches the child too (its process group): it unwinds, so the
    # preparation's own cleanup runs (its private folder removed), and the parent hears a crash.
    # The parent's handlers, whatever they are, mean nothing here.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _exit_on_signal)
    try:
        report = {"value": fn(*args)}
    except UserError as exc:
        report = {"error": str(exc)}
    except BaseException as exc:  # a bug: its stack on stderr, its name to the parent
        traceback.print_exc()
        report = {"crash": f"{type(exc).__name__}: {first_line(exc)}"}
    try:
        with os.fdopen(write_end, "w") as pipe:
            json.dump(report, pipe)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # no atexit handlers, no second flush: they are the parent's
