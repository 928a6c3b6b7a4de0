"""`accum-train verify` on every architecture of tests/test_architectures.py, at W=1 and W=2, in both layouts.

Issue 39's sweep: each tiny architecture (the test's own config builders, 2 layers, vocabulary 384, every
dropout 0) is saved to a temporary folder and checked through the real command, one fresh process each
(`python -m accum_cli verify ...`; `verify --nproc 2 --master-port P ...` for two ranks, the --nproc
wrapper forwarding `verify` to its gloo workers), on the ragged pre-tokenised rows of the tests
(helpers.write_ragged_tokens) with tests/test_verify.py's flags: global batch 13, micro batch 3, sync
last, one verified step. `--json` gives the verdict and the relative differences; the table shows, per
run, the reference verify chose, the largest relative difference of the loss, of the gradient norm and
of the parameters over the verified steps, the verdict and the wall seconds (a Python start included).

An architecture that verify refuses (exit 2, one line on stderr, e.g. a model the project cannot train)
shows as `refused: <line>` and does not fail the sweep; a FAIL, a crash or a timeout does (exit 1).

    OMP_NUM_THREADS=1 .venv/bin/python bench/verify_sweep.py                       # make verify-sweep
    .venv/bin/python bench/verify_sweep.py --only llama --worlds 1 --layouts replicate
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # the tests' tiny models and data, as the tests build them
from helpers import free_port, write_ragged_tokens  # noqa: E402
from test_architectures import ARCHITECTURES, save_model  # noqa: E402
from test_verify import COMMON, G  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

LAYOUTS = ("shard", "replicate")
MICRO_BATCH = 3  # ragged against G = 13 at W=1 (3, 3, 3, 3, 1) and W=2
SYNC = "last"
QUANTITIES = ("loss", "grad_norm", "parameters")
ERROR_PREFIX = "accum-train: error: "


@dataclass
class Row:
    architecture: str
    world: int
    layout: str
    outcome: str  # "pass", "fail", "refused" or "error"
    reference_kind: str | None = None
    loss: float | None = None  # the largest relative difference over the verified steps
    grad_norm: float | None = None
    parameters: float | None = None
    worst_parameter: str | None = None
    first_difference: dict | None = None
    message: str | None = None  # the refusal's line, or what went wrong
    seconds: float = 0.0

    @property
    def verdict(self) -> str:
        if self.outcome == "pass":
            return "PASS"
        if self.outcome == "fail":
            first = self.first_difference or {}
            return f"FAIL ({first.get('quantity', '?')}, step {first.get('step', '?')})"
        if self.outcome == "refused":
            return f"refused: {self.message}"
        return f"ERROR: {self.message}"


def _names(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in ARCHITECTURES]
    if not names or unknown:
        raise argparse.ArgumentTypeError(
            f"unknown architecture(s) {', '.join(unknown) or repr(text)}; known: {', '.join(ARCHITECTURES)}"
        )
    return list(dict.fromkeys(names))


def _worlds(text: str) -> list[int]:
    try:
        worlds = [int(w) for w in text.split(",") if w.strip()]
    except ValueError:
        worlds = []
    if not worlds or any(w < 1 for w in worlds):
        raise argparse.ArgumentTypeError(f"world sizes are positive integers separated by commas, got {text!r}")
    return list(dict.fromkeys(worlds))


def _layouts(text: str) -> list[str]:
    layouts = [n.strip() for n in text.split(",") if n.strip()]
    if not layouts or any(n not in LAYOUTS for n in layouts):
        raise argparse.ArgumentTypeError(f"layouts are {' and/or '.join(LAYOUTS)}, separated by commas, got {text!r}")
    return list(dict.fromkeys(layouts))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", type=_names, default=list(ARCHITECTURES), metavar="NAME[,NAME]",
                   help="architectures of tests/test_architectures.py (default: all)")  # fmt: skip
    p.add_argument("--worlds", type=_worlds, default=[1, 2], metavar="1,2", help="world sizes (default: 1,2)")
    p.add_argument("--layouts", type=_layouts, default=list(LAYOUTS), metavar="shard,replicate",
                   help="layouts (default: both)")  # fmt: skip
    p.add_argument("--json-out", type=Path, default=None, metavar="PATH", help="write the rows as JSON here")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per verify run (default: 900)")
    args = p.parse_args(argv)
    if args.timeout <= 0:
        p.error("--timeout must be positive")
    return args


def verify_command(model: Path, data: Path, out: Path, world: int, layout: str) -> list[str]:
    launch = ["--nproc", str(world), "--master-port", str(free_port())] if world > 1 else []
    return [sys.executable, "-m", "accum_cli", "verify", *launch, "--model", str(model), "--dataset", str(data),
            "--output-dir", str(out), *COMMON, "--micro-batch", str(MICRO_BATCH), "--sync", SYNC,
            "--layout", layout, "--json"]  # fmt: skip


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(MASTER_ADDR="127.0.0.1", PYTHONUNBUFFERED="1")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
        env.pop(name, None)
    return env


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def _report(stdout: str) -> dict | None:
    """The --json document: the last stdout line that parses as a JSON object with a verdict."""
    for line in reversed(stdout.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                document = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(document, dict) and "verdict" in document:
                return document
    return None


def _worst(report: dict, quantity: str) -> tuple[float | None, str | None]:
    worst, name = None, None
    for step in report.get("steps", []):
        value = step.get(quantity, {}).get("relative")
        value = float(value) if value is not None else None  # "inf"/"nan" are written as strings
        if value is not None and (worst is None or not value <= worst):
            worst, name = value, step[quantity].get("parameter")
    return worst, name


def run_one(name: str, model: Path, data: Path, scratch: Path, world: int, layout: str, timeout: float) -> Row:
    out = scratch / f"out-{name}-w{world}-{layout}"  # verify writes nothing here; never created
    row = Row(name, world, layout, "error")
    start = time.perf_counter()
    try:
        done = subprocess.run(verify_command(model, data, out, world, layout), cwd=REPO, env=child_env(),
                              capture_output=True, text=True, timeout=timeout)  # fmt: skip
    except subprocess.TimeoutExpired:
        row.seconds = time.perf_counter() - start
        row.message = f"timed out after {timeout:g} s"
        return row
    row.seconds = time.perf_counter() - start
    if done.returncode == 2:
        row.outcome = "refused"
        row.message = _last_line(done.stderr).removeprefix(ERROR_PREFIX) or "exit 2, nothing on stderr"
        return row
    report = _report(done.stdout)
    if done.returncode not in (0, 1) or report is None or report.get("exit_code") != done.returncode:
        row.message = f"exit {done.returncode}: {_last_line(done.stderr) or _last_line(done.stdout) or 'no output'}"
        return row
    row.outcome = "pass" if report["verdict"] == "pass" else "fail"
    row.reference_kind = report.get("reference_kind")
    row.first_difference = report.get("first_difference")
    row.loss, _ = _worst(report, "loss")
    row.grad_norm, _ = _worst(report, "grad_norm")
    row.parameters, row.worst_parameter = _worst(report, "parameters")
    return row


COLUMNS = (("architecture", 13), ("W", 3), ("layout", 10), ("reference", 12), ("loss", 9), ("grad norm", 10),
           ("parameters", 11), ("seconds", 8))  # fmt: skip


def header() -> str:
    names = [f"{title:<{width}}" if i < 4 else f"{title:>{width}}" for i, (title, width) in enumerate(COLUMNS)]
    return " ".join(names) + "  verdict"


def _diff(value: float | None) -> str:
    return "-" if value is None else f"{value:.1e}"


def format_row(row: Row) -> str:
    cells = [row.architecture, str(row.world), row.layout, row.reference_kind or "-", _diff(row.loss),
             _diff(row.grad_norm), _diff(row.parameters), f"{row.seconds:.0f}"]  # fmt: skip
    text = [f"{c:<{w}}" if i < 4 else f"{c:>{w}}" for i, (c, (_, w)) in enumerate(zip(cells, COLUMNS, strict=True))]
    return " ".join(text) + "  " + row.verdict


def write_json(path: Path, rows: list[Row], argv: list[str]) -> None:
    path.write_text(json.dumps({"command": argv, "rows": [asdict(r) | {"verdict": r.verdict} for r in rows]}, indent=1))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rows: list[Row] = []
    hf_logging.disable_progress_bar()  # save_pretrained's, on stderr between the rows
    print(f"accum-train verify: global batch {G}, micro batch {MICRO_BATCH}, sync {SYNC}, fp32, one step; "
          "relative differences (worst over the steps), wall seconds per run", flush=True)  # fmt: skip
    print(header(), flush=True)
    with tempfile.TemporaryDirectory(prefix="verify-sweep-") as tmp:
        scratch = Path(tmp)
        data = write_ragged_tokens(scratch / "data.jsonl")
        for name in args.only:
            model = save_model(scratch / name, name)
            for world in args.worlds:
                for layout in args.layouts:
                    row = run_one(name, model, data, scratch, world, layout, args.timeout)
                    rows.append(row)
                    print(format_row(row), flush=True)
                    if args.json_out:  # after every run, so that an interrupted sweep leaves what it found
                        write_json(args.json_out, rows, sys.argv if argv is None else argv)
    counts = {o: sum(r.outcome == o for r in rows) for o in ("pass", "fail", "refused", "error")}
    print(f"{len(rows)} runs: {counts['pass']} PASS, {counts['fail']} FAIL, {counts['refused']} refused, "
          f"{counts['error']} errors; {sum(r.seconds for r in rows) / 60:.1f} min")  # fmt: skip
    for row in rows:
        if row.outcome != "pass":
            print(f"  {row.architecture} W={row.world} {row.layout}: {row.verdict}")
    return 1 if counts["fail"] or counts["error"] else 0


if __name__ == "__main__":
    sys.exit(main())
