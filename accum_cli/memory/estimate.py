"""Peak memory per rank of one training step, measured by PyTorch on a fake model and world.

No formula: the model is built from its config in `FakeTensorMode` (shapes, no storage), sharded
by the run's own `model.shard` on a fake process group of the planned world size, and the run's
own step (`loop.microbatch_backward`, gradient clipping, AdamW) is executed under PyTorch's
`FSDPMemTracker`, which records every tensor's bytes by kind (parameters, gradients, optimizer
state, activations, temporaries) and the peak. An untracked step first creates AdamW's state,
so the tracked step of at least two microbatches shows the steady state.

The fake process group replaces the real one for the life of the process, so estimation runs
in a child process (forked where that is safe, else `python -m accum_cli.memory.measure`: child.py):
a real run's process group is never touched.
One child serves a whole decision (`Session`): torch is imported and the fake model built once,
then reused for every micro batch and policy asked about. Results are cached on disk keyed by
every input, so a second `--plan` is instant.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import tempfile
import warnings
from dataclasses import asdict
from pathlib import Path

from accum_cli.errors import UserError, first_line
from accum_cli.memory.child import Forked, forkable, start_child
from accum_cli.memory.query import KINDS, Estimate, Query

ESTIMATE_TIMEOUT_S = 1800


class EstimateFailed(UserError):
    """The estimate could not be made (a model it cannot build or run, a child that died)."""


def cache_dir() -> Path:
    """Beside the prepared datasets (ACCUM_TRAIN_CACHE, else the datasets cache)."""
    from accum_cli.data.cache import cache_root

    return cache_root() / "estimates"


class Session:
    """Estimates from the cache, else measured in one child process that lives as long as the
    session: torch is imported and the fake model built once for all the queries of a decision
    (a micro batch search asks several questions, each depending on the last answers)."""

    def __init__(self) -> None:
        self._child: subprocess.Popen | Forked | None = None
        self._log = None

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def estimate(self, queries: list[Query]) -> list[Estimate]:
        results: dict[int, Estimate] = {}
        missing = []
        for index, query in enumerate(queries):
            hit = _read_cache(query)
            if hit is None:
                missing.append(index)
            else:
                results[index] = hit
        # A replicated model needs no fake process group, so it is measured here, without the
        # child's start (seconds); a sharded one in the child.
        here = [i for i in missing if queries[i].replicated]
        there = [i for i in missing if not queries[i].replicated]
        fresh = list(zip(here, self._measure_here([queries[i] for i in here]), strict=True))
        if there:
            fresh += zip(there, self._measure([queries[i] for i in there]), strict=True)
        for index, result in fresh:
            _write_cache(queries[index], result)
            results[index] = result
        return [results[i] for i in range(len(queries))]

    def _measure_here(self, queries: list[Query]) -> list[Estimate]:
        if not queries:
            return []
        from accum_cli.memory.measure import Measurer  # torch, only where measured in this process

        try:
            # What torch's trackers warn about (ModTracker's "module hierarchy tracking maybe be messed up"
            # on our second microbatch) is the child's log there; here it would print above the run's
            # one-line refusal, a traceback-like line the user can do nothing about.
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return Measurer().measure(queries)
        except Exception as exc:  # a model the estimate cannot build or run: one line, as from the child
            raise EstimateFailed(
                f"the memory estimate failed ({type(exc).__name__}: {first_line(exc)[:200]})"
            ) from None

    def _measure(self, queries: list[Query]) -> list[Estimate]:
        if self._child is None:
            self._start()
        child = self._child
        try:
            child.stdin.write(json.dumps([asdict(q) for q in queries]) + "\n")
            child.stdin.flush()
            ready, _, _ = select.select([child.stdout], [], [], ESTIMATE_TIMEOUT_S)
            line = child.stdout.readline() if ready else ""
        except OSError:  # the child died before reading
            ready, line = True, ""
        if not line:  # its end (its last words are in the log: _fail waits for it), else the time ran out
            self._fail("" if ready else f"no answer in {ESTIMATE_TIMEOUT_S} s")
        rows = json.loads(line)
        return [Estimate(row["peak"], row["breakdown"], row["seconds"]) for row in rows]

    def _start(self) -> None:
        global _ahead
        if _ahead is not None and _ahead is not self:  # forked ahead (fork_ahead): this session takes it
            self._log, self._child, _ahead._log, _ahead._child = _ahead._log, _ahead._child, None, None
            _ahead = None
            return
        # A file, not a pipe: warnings never block the child. Closed by close().
        self._log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115
        self._child = start_child(self._log)

    def _fail(self, why: str) -> None:
        self.close(keep_log=True)
        if not why:
            self._log.seek(0)
            lines = [line for line in self._log.read().strip().splitlines() if line.strip()]
            why = lines[-1] if lines else "the estimating process ended"
        self._log.close()
        raise EstimateFailed(
            f"the memory estimate failed ({why[:200]}); pass --micro-batch N and --sync every|last to skip it"
        )

    def close(self, keep_log: bool = False) -> None:
        child, self._child = self._child, None
        if child is None:
            return
        if child.poll() is None:
            try:
                child.stdin.close()  # end of input: the child exits
                child.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                child.kill()
                child.wait()
        for stream in (child.stdin, child.stdout, None if keep_log else self._log):
            if stream is not None and not stream.closed:
                stream.close()


_ahead: Session | None = None  # a session whose child was forked ahead of its first query


def fork_ahead() -> None:
    """Fork the estimating child now, while this process holds no process group: a rank about to start
    one, whose decision will ask for sharded estimates, would otherwise spawn a fresh interpreter for
    them (child.py). The next session to need a child takes it; `release_ahead` ends it if none did."""
    global _ahead
    if _ahead is None and forkable():
        _ahead = Session()
        _ahead._start()


def release_ahead() -> None:
    global _ahead
    ahead, _ahead = _ahead, None
    if ahead is not None:
        ahead.close()


def estimate(queries: list[Query]) -> list[Estimate]:
    """Peak per rank for each query: from the cache, else measured in a child process."""
    with Session() as session:
        return session.estimate(queries)


def _read_cache(query: Query) -> Estimate | None:
    path = cache_dir() / f"{query.key()}.json"
    try:
        data = json.loads(path.read_text())
        breakdown = {k: int(data["breakdown"][k]) for k in KINDS}
        return Estimate(int(data["peak"]), breakdown, 0.0, cached=True)
    except (OSError, ValueError, KeyError, TypeError):
        return None  # absent or damaged: measure again


def _write_cache(query: Query, result: Estimate) -> None:
    folder = cache_dir()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".{query.key()}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps({"peak": result.peak, "breakdown": result.breakdown}))
        tmp.replace(folder / f"{query.key()}.json")
    except OSError:
        pass  # a read-only cache only costs time
