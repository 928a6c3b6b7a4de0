"""A warm parent for the suite's launches: real processes without paying the imports each time.

Starting `python -m accum_cli` costs ~8 s of imports (torch, transformers' model classes, datasets,
matplotlib) before a tiny test run's ~1 s of work, and a 2-rank torchrun launch pays it twice more.
This server imports all of that once, with no thread started, and forks a fresh process per rank
for each request: each rank is a real OS process with its own interpreter state, its own gloo
process group on a real TCP store, the environment torchrun gives its workers (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR/PORT, ...) and `python -m`'s entry (runpy, `__main__`). A rank that fails
ends the rest, as torchrun does. What it does not reproduce is a launcher: tests about torchrun,
`accelerate launch` or the `--nproc` wrapper, about signals to a launcher, or needing a variable that
torch or transformers read at import (helpers.IMPORT_TIME_ENV) start the real thing instead.

Why not multiprocessing's forkserver (`set_forkserver_preload` forks warm too): its children run
inside multiprocessing's bootstrap (its exit path and atexit handling, not `python -m`'s), share no
stdout a test can read apart per launch, and have no process group of their own for a timeout to kill
with the ranks they started.

Protocol (one request per connection on a Unix socket): the client sends one JSON line
{target, kind: module|path|code, argv, env, cwd, umask (None: this server's), ranks, nnodes, node_rank, stdout,
stderr, apart (each rank on its own: none ended when another fails, output to stdout.RANK and stderr.RANK)}; a session process (its own
process group, so a client timing out kills it and its ranks with one killpg) answers
{"session": pid} at once and {"codes": [...]} when every rank has ended.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
import time
import traceback
from pathlib import Path

GRACE_S = 30.0  # torchrun's own wait between SIGTERM and SIGKILL for the survivors of a failed rank


def preload() -> None:
    import datasets  # noqa: F401  (pyarrow; its allocator's thread is off: JE_ARROW_MALLOC_CONF)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot  # noqa: F401
    import torch  # noqa: F401
    import torch.distributed.checkpoint  # noqa: F401
    import transformers  # noqa: F401
    from transformers.models.llama import modeling_llama  # noqa: F401

    import accum_cli.cli.main  # noqa: F401
    import accum_cli.run.train  # noqa: F401

    warm_matplotlib()
    warm_a_run_start()


def warm_a_run_start() -> None:
    """What every run does on its way to the first step, done once here, so that each launch does not
    redo it: parse a command line (typer imports pydantic for it), resolve torch_compat's private names,
    and load a tiny Llama and its tokenizer with from_pretrained (transformers builds its table of
    checkpoint conversions, ~1,000 compiled patterns, on a process's first load or save, and imports
    the tokenizer classes). Measured 6 Dec 2026: a 1-rank 3-step tiny run forked from here took
    1.2-1.5 s of CPU before, 0.6-0.8 s after. The random state is left as it was, and no thread is
    left running (the loading progress bar's monitor would be one; the loading pool's
    threads are waited for)."""
    import tempfile

    import torch
    import typer
    from helpers import save_tiny_model
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging

    from accum_cli import torch_compat
    from accum_cli.cli.main import app

    typer.main.get_command(app).make_context("accum-train", ["--max-steps", "1"])
    for name in torch_compat.PRIVATE:
        getattr(torch_compat, name)
    logging.disable_progress_bar()
    with tempfile.TemporaryDirectory(prefix="accum-zygote-warm-") as folder, torch.random.fork_rng():
        save_tiny_model(Path(folder))
        AutoModelForCausalLM.from_pretrained(folder)
        AutoTokenizer.from_pretrained(folder)
    logging.enable_progress_bar()
    for thread in threading.enumerate():  # the loading pool is shut down without waiting for its threads
        if thread is not threading.main_thread():
            thread.join(timeout=30)
    assert threading.active_count() == 1, f"a thread outlived the warm-up: {threading.enumerate()}"


def warm_matplotlib() -> None:
    """One tiny picture drawn here, so that each run's report.png does not pay for the fonts, the text
    layout and the PNG writer it would load on its first draw (measured: a run's first draw 1.9 s in a
    child forked from a parent that had only imported matplotlib, 0.7 s after this)."""
    import io

    from matplotlib.figure import Figure

    figure = Figure(figsize=(2, 2), layout="constrained")
    axes = figure.add_subplot()
    axes.plot([1, 2], [1, 10], label="warm")
    axes.set_yscale("log")
    axes.set_title("warm")
    axes.legend(fontsize=8)
    figure.suptitle("warm", fontsize=9, family="monospace")
    figure.savefig(io.BytesIO(), dpi=30, format="png")


def run_rank(request: dict, rank: int) -> None:
    """In the forked rank: become the process `python -m target argv` would have been, then exit."""
    code = 1
    try:
        ranks, nodes, node = request["ranks"], request["nnodes"], request["node_rank"]
        os.environ.clear()
        os.environ.update(request["env"])
        if ranks > 1 or nodes > 1:
            world, global_rank = ranks * nodes, node * ranks + rank
            os.environ.update(
                RANK=str(global_rank), LOCAL_RANK=str(rank), GROUP_RANK=str(node), ROLE_RANK=str(global_rank),
                WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(ranks), ROLE_WORLD_SIZE=str(world),
                GROUP_WORLD_SIZE=str(nodes), TORCHELASTIC_RESTART_COUNT="0",
            )  # fmt: skip
        os.chdir(request["cwd"])
        if request.get("umask") is not None:
            os.umask(request["umask"])
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        suffix = f".{rank}" if request.get("apart") else ""
        for fd, path in ((1, request["stdout"] + suffix), (2, request["stderr"] + suffix)):
            os.dup2(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644), fd)
        import runpy

        target, kind = request["target"], request["kind"]
        if kind == "module":
            sys.argv = [target, *request["argv"]]
            sys.path[0] = request["cwd"]
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        elif kind == "path":
            sys.argv = [target, *request["argv"]]
            sys.path[0] = os.path.dirname(os.path.abspath(target))
            runpy.run_path(target, run_name="__main__")
        else:  # python -c
            sys.argv = ["-c", *request["argv"]]
            sys.path[0] = ""
            exec(compile(target, "<string>", "exec"), {"__name__": "__main__"})
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, int | None):
            print(exc.code, file=sys.stderr)
    except KeyboardInterrupt:
        code = 130
    except BaseException:
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def session(conn: socket.socket, request: dict) -> None:
    """Fork the ranks, wait for them (ending the rest when one fails), report their exit codes."""
    os.setpgid(0, 0)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    conn.sendall((json.dumps({"session": os.getpid()}) + "\n").encode())
    pids = {}
    for rank in range(request["ranks"]):
        pid = os.fork()
        if pid == 0:
            conn.close()
            run_rank(request, rank)
        pids[pid] = rank
    codes: list[int | None] = [None] * len(pids)
    deadline = None
    while None in codes:
        if deadline is not None and time.monotonic() > deadline:
            for pid, rank in pids.items():
                if codes[rank] is None:
                    os.kill(pid, signal.SIGKILL)
            deadline = None
        pid, status = os.waitpid(-1, os.WNOHANG) if deadline is not None else os.waitpid(-1, 0)
        if pid == 0:
            time.sleep(0.05)
            continue
        codes[pids[pid]] = os.waitstatus_to_exitcode(status)
        if codes[pids[pid]] != 0 and deadline is None and None in codes and not request.get("apart"):
            for other, rank in pids.items():
                if codes[rank] is None:
                    os.kill(other, signal.SIGTERM)
            deadline = time.monotonic() + GRACE_S
    conn.sendall((json.dumps({"codes": codes}) + "\n").encode())
    os._exit(0)


def serve(path: str) -> None:
    preload()
    parent = os.getppid()
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # sessions are reaped by the kernel
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(8)
    server.settimeout(1.0)
    print("ready", flush=True)
    while os.getppid() == parent:  # the test worker that started it is gone: so is it
        try:
            conn, _ = server.accept()
        except TimeoutError:
            continue
        conn.settimeout(None)
        request = json.loads(conn.makefile().readline())
        if os.fork() == 0:
            server.close()
            session(conn, request)
        conn.close()


if __name__ == "__main__":
    serve(sys.argv[1])
