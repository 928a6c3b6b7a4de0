"""On one CUDA GPU, for the Llama-3.2-1B shape in bf16 at seq len 2048: the memory estimate next to what
the GPU measures, then accum-train side by side with a hand-written FSDP2 loop and the HF Trainer.

    make gpu-check                                   # about 5.5 min on one H100; its own guard stops it by 7
    python3 bench/gpu_check.py --only accum-train raw-fsdp2 --no-memory --json /tmp/g.json
    python3 bench/gpu_check.py --tiny                # a 2-layer toy on whatever device is here: the plumbing only

On the GPU machine its own CUDA torch is used as it is: not `make setup`, which installs the CPU build
the Makefile pins. The script puts this checkout on its sys.path and its children's PYTHONPATH, so it
runs from the checkout uninstalled (`PYTHONPATH=.` and `pip install -e . --no-deps` work as well).
accum-train needs `datasets` (and dill, multiprocess), which a bare GPU image may lack: carry them as
wheels. A package missing makes the accum-train rows say so; the peers still run.

1. Memory: for each sync policy (`replicated`: the layout a model that fits gets) and micro batch, the
   estimate (estimate.py: fake model, fake world of 1, on the CPU) beside bench/measure_peak.py's
   FSDPMemTracker count and torch.cuda.max_memory_allocated of the same step on the GPU (one rank,
   NCCL). Trimmed to the contestants' micro batch (--micro-batch for more); it runs while the workload
   is written, so it costs little of the time.
2. Speed: G=16 sequences per optimizer step, micro batch 4, 8 steps, AdamW lr 1e-4 (betas 0.9/0.999,
   weight decay 0, constant rate), clip 1.0; the same weights (saved once) and token ids for every
   contestant, each in a process of its own with a timeout:
   - accum-train: its real CLI, `python -m accum_cli`, at its defaults (bf16 on CUDA, layout and sync
     auto, no compile) with the workload's flags;
   - raw-fsdp2: the hand-written FSDP2 loop of bench/gpu_peers.py, under torch.distributed.run, NCCL;
   - hf-trainer: transformers.Trainer with bf16=True (bench/gpu_peers.py);
   - accum-train --micro-batch auto: 3 steps at the micro batch its estimate picks: does it fit?
   - accum-train --compile: regional torch.compile of each decoder layer (compiled during step 1).
   tokens/s is the median over steps 3..N of G x seq len over the seconds from the end of the step
   before (accum-train's from the elapsed_s of its metrics.jsonl). MFU is tokens/s x
   accum_cli.rundir.metrics.flops_per_token over the GPU's dense bf16 peak (metrics.peak_flops), the
   same for every row. Peak GiB is torch.cuda.max_memory_allocated of the process (accum-train's
   peak_mem_gib), and estimate GiB accum-train's own estimate of the plan it ran (layout, sync, micro
   batch, read from its config.json). The ratio is to the faster of the two peers.

accum-train is stopped (SIGKILL) once metrics.jsonl holds its last step: its final checkpoint and
export (about 20 GB of fp32 weights and AdamW moments for 1.2B parameters) are not what is timed here,
and three of them would cost minutes and fill the disk.

At the end: one table (contestant | tokens/s | vs best peer | MFU | peak GiB | estimate GiB | note),
also written as JSON to --json and, when OUT is set (the device runner returns what is written
there), to $OUT/ under the same name. A contestant that fails or runs out of time is a row that says
so, and the script exits 0 whatever the figures (1 only when the workload itself could not be written);
without CUDA it says so and exits 0 at once. CI has no GPU: tests/test_gpu_check.py imports this file,
parses its arguments, and runs it without CUDA.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PEERS_SCRIPT = REPO / "bench" / "gpu_peers.py"
NO_CUDA = "gpu_check: no CUDA device here; nothing to measure"
WARMUP = 2  # optimizer steps left out of tokens/s: allocator warm-up, autotuning, compiling
RESERVE_S = 25  # of the budget, kept for the estimates of accum-train's plans, the table and the JSON
MIN_RUN_S = 45  # a contestant given less than this is skipped, not started
# Packages accum-train imports that a bare CUDA image may lack (datasets is the usual one).
ACCUM_TRAIN_NEEDS = ("datasets", "typer", "rich", "yaml", "accelerate", "safetensors", "transformers")


@dataclass(frozen=True, slots=True)
class Contestant:
    name: str
    peer: str | None = None  # a bench/gpu_peers.py role; None: accum-train with `flags`
    flags: tuple[str, ...] = ()
    auto_steps: bool = False  # trained for --auto-steps steps, not --steps
    cap_s: int = 150  # its own timeout; the overall budget may cut it shorter


CONTESTANTS = (
    Contestant("accum-train"),
    Contestant("raw-fsdp2", peer="fsdp2"),
    Contestant("hf-trainer", peer="trainer"),
    Contestant("accum-train --micro-batch auto", flags=("--micro-batch", "auto"), auto_steps=True, cap_s=180),
    Contestant("accum-train --compile", flags=("--compile",), cap_s=240),
)
NAMES = tuple(c.name for c in CONTESTANTS)
PEERS = ("raw-fsdp2", "hf-trainer")


@dataclass(slots=True)
class Row:
    """One contestant's line of the table, and what the JSON keeps beside it."""

    contestant: str
    status: str = "ok"  # ok | failed | timeout | skipped
    tokens_per_s: float | None = None
    vs_best_peer: float | None = None
    mfu: float | None = None
    peak_gib: float | None = None
    estimate_gib: float | None = None
    note: str = ""
    step_s: list[float] = field(default_factory=list)
    mean_loss: float | None = None
    plan: dict | None = None  # accum-train's: layout, sync, micro batch as its config.json records them
    wall_s: float | None = None  # the process, from its start to its end or stop
    log_tail: str = ""  # the end of its output, for a row that did not end well


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=16, help="decoder layers of the Llama-3.2-1B shape")
    parser.add_argument("--micro-batch", type=int, nargs="+", default=[4], help="memory section: micro batches")
    parser.add_argument("--sync", nargs="+", default=["every", "last", "replicated"],
                        help="memory section: sync policies; `replicated` is the layout accum-train picks when it fits")  # fmt: skip
    parser.add_argument("--memory", action=argparse.BooleanOptionalAction, default=True,
                        help="the estimate against the GPU's measured peak (section 1)")  # fmt: skip
    parser.add_argument("--speed", action=argparse.BooleanOptionalAction, default=True,
                        help="the contestants side by side (section 2)")  # fmt: skip
    parser.add_argument("--only", nargs="+", choices=NAMES, default=list(NAMES), metavar="NAME",
                        help=f"contestants to run, of: {', '.join(NAMES)}")  # fmt: skip
    parser.add_argument("--global-batch", type=int, default=16, help="sequences per optimizer step")
    parser.add_argument("--train-micro-batch", type=int, default=4, help="contestants' micro batch")
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps per contestant (the first 2 untimed)")
    parser.add_argument("--auto-steps", type=int, default=3, help="steps of the --micro-batch auto run")
    parser.add_argument("--budget-s", type=float, default=420.0,
                        help="the whole script's time: contestants not started in it are skipped, a running one stopped")  # fmt: skip
    parser.add_argument("--json", default="gpu_check.json", help="where the results go (also to $OUT/ when set)")
    parser.add_argument("--tiny", action="store_true",
                        help="a 2-layer toy at seq len 64 on whatever device is here (CPU too): checks the plumbing")  # fmt: skip
    args = parser.parse_args(argv)
    if args.tiny:
        args.seq_len, args.layers = 64, 2
    return args


def llama_config(args: argparse.Namespace) -> dict:
    """LlamaConfig arguments: the Llama-3.2-1B shape (tied, 128256 vocab, GQA 32/8), or --tiny's toy."""
    if args.tiny:
        return dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=args.layers,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                    tie_word_embeddings=True)  # fmt: skip
    return dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=args.layers,
                num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=8192,
                tie_word_embeddings=True)  # fmt: skip


# ---------------------------------------------------------------- processes
def child_env(work: Path) -> dict[str, str]:
    """This checkout first on the path (uninstalled is fine), one estimate and data cache for all
    (a plan estimated once is read back by the next run), and nothing that reaches for the network."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return dict(os.environ, PYTHONPATH=path, ACCUM_TRAIN_CACHE=str(work / "cache"), PYTHONUNBUFFERED="1",
                HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                TOKENIZERS_PARALLELISM="false")  # fmt: skip


def start(cmd: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    """The command in a process group of its own, its output (both streams) into `log`."""
    with open(log, "w") as out:
        return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def wait(proc: subprocess.Popen, timeout_s: float, done: Callable[[], bool] | None = None, kill: bool = False) -> str:
    """'exited'; 'stopped' once `done()` holds; 'timeout' past `timeout_s`. `kill`: stop with SIGKILL."""
    deadline = time.monotonic() + max(timeout_s, 0.0)
    while proc.poll() is None:
        if done is not None and done():
            stop(proc, kill)
            return "stopped"
        if time.monotonic() > deadline:
            stop(proc, kill)
            return "timeout"
        time.sleep(0.5)
    return "exited"


def stop(proc: subprocess.Popen, kill: bool) -> None:
    """SIGTERM first, so that torch.distributed.run ends its workers (each in a session of its own, out
    of the group's reach); SIGKILL at once for accum-train, whose SIGTERM would save a checkpoint."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL if kill else signal.SIGTERM)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def result_line(log: Path) -> dict | None:
    """The last `RESULT {json}` line a bench/gpu_peers.py process printed, if any."""
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.startswith("RESULT ")]
    return json.loads(lines[-1][len("RESULT ") :]) if lines else None


def tail(log: Path, chars: int = 3000) -> str:
    return log.read_text(errors="replace")[-chars:] if log.exists() else ""


def failure_note(text: str, how: str, rc: int | None) -> str:
    """One short line for the table: out of memory above all, else the last line of the output."""
    if "OutOfMemoryError" in text or "CUDA out of memory" in text:
        return "out of memory"
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    last = lines[-1][:110] if lines else "no output"
    return f"timed out: {last}" if how == "timeout" else f"exit {rc}: {last}"


# ------------------------------------------------------------------- figures
def median_rate(step_s: list[float], tokens_per_step: int, skip: int = WARMUP) -> float | None:
    """Median tokens/s over the steps after the first `skip`; None when none is left."""
    timed = step_s[skip:]
    return statistics.median(tokens_per_step / s for s in timed) if timed else None


def step_seconds(records: list[dict]) -> list[float]:
    """accum-train's step-to-step seconds from the elapsed_s of its metrics records (the first from
    the reporter's start): the work between two steps counts, as it does for the peers."""
    elapsed = [r["elapsed_s"] for r in records]
    return [b - a for a, b in zip([0.0, *elapsed], elapsed, strict=False)]


def finish_rows(rows: list[Row], flops_per_token: float | None, peak_flops: float | None) -> None:
    """MFU of every row from one formula, and each row's tokens/s over the faster peer's."""
    for row in rows:
        if row.tokens_per_s and flops_per_token and peak_flops:
            row.mfu = row.tokens_per_s * flops_per_token / peak_flops
    best = max((r.tokens_per_s for r in rows if r.contestant in PEERS and r.tokens_per_s), default=None)
    for row in rows:
        row.vs_best_peer = row.tokens_per_s / best if best and row.tokens_per_s else None


def table(rows: list[Row]) -> str:
    def num(value: float | None, fmt: str) -> str:
        return "-" if value is None else format(value, fmt)

    width = max(len("contestant"), *(len(r.contestant) for r in rows))
    lines = [
        f"{'contestant':<{width}} | {'tokens/s':>9} | {'vs best peer':>12} | {'MFU':>6} | {'peak GiB':>8} | "
        f"{'estimate GiB':>12} | note"
    ]
    for r in rows:
        lines.append(
            f"{r.contestant:<{width}} | {num(r.tokens_per_s, ',.0f'):>9} | {num(r.vs_best_peer, '.2f'):>12} | "
            f"{num(r.mfu, '.1%'):>6} | {num(r.peak_gib, '.2f'):>8} | {num(r.estimate_gib, '.2f'):>12} | {r.note}"
        )
    return "\n".join(lines)


def write_json(report: dict, path: str) -> list[Path]:
    """The report at `path`, and under $OUT by the same name when OUT is set."""
    targets = [Path(path)]
    if os.environ.get("OUT"):
        targets.append(Path(os.environ["OUT"]) / Path(path).name)
    text = json.dumps(report, indent=1, default=str)
    for target in targets:
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text + "\n")
    return targets


# ------------------------------------------------------------- section 1
def memory_queries(args: argparse.Namespace, config: dict, bf16: bool) -> list:
    from accum_cli.memory.query import Query

    return [
        Query(config, 1, 1, m, args.seq_len, "last" if sync == "replicated" else sync, bf16, False,
              replicated=sync == "replicated", device_type="cuda")
        for sync in args.sync for m in args.micro_batch
    ]  # fmt: skip


def memory_section(cases: list, found: list | str, log: Path, how: str, rc: int | None) -> list[dict]:
    """The estimate beside measure_peak.py's figures, printed; the rows for the JSON."""
    measured = {}
    if how == "exited" and rc == 0:
        for line in log.read_text(errors="replace").splitlines():
            if line.startswith("{"):
                row = json.loads(line)
                measured[(row["sync"], row["micro_batch"])] = row
    if isinstance(found, str):
        print(f"estimate failed: {found}")
    if not measured:
        print(f"measure_peak.py {how} (exit {rc}):\n{tail(log)}")
    print(f"{'sync':<10} {'m':>2} {'estimate GiB':>13} {'tracker GiB':>12} {'max_alloc GiB':>14} {'est/alloc':>9}")
    rows = []
    for i, (sync, m) in enumerate(cases):
        est = found[i].peak / 2**30 if not isinstance(found, str) else None
        got = measured.get((sync, m), {})
        alloc = got.get("cuda_max_allocated", 0) / 2**30 or None
        tracker = got["peak"] / 2**30 if got else None
        ratio = est / alloc if est and alloc else None
        rows.append({"sync": sync, "micro_batch": m, "estimate_gib": est, "tracker_gib": tracker,
                     "cuda_max_allocated_gib": alloc, "estimate_over_allocated": ratio})  # fmt: skip
        cells = [format(v, ".2f") if v is not None else "-" for v in (est, tracker, alloc, ratio)]
        print(f"{sync:<10} {m:>2} {cells[0]:>13} {cells[1]:>12} {cells[2]:>14} {cells[3]:>9}")
    return rows


# ------------------------------------------------------------- section 2
@dataclass(slots=True)
class Workload:
    model_dir: Path
    data: Path
    work: Path
    env: dict[str, str]
    config: dict  # the model's config.json, for the estimates
    cuda: bool


def accum_train_cmd(c: Contestant, args: argparse.Namespace, w: Workload, out: Path) -> list[str]:
    """The CLI as a user runs it: the workload's flags, every other setting at its default."""
    steps = args.auto_steps if c.auto_steps else args.steps
    micro = [] if "--micro-batch" in c.flags else ["--micro-batch", str(args.train_micro_batch)]
    return [sys.executable, "-m", "accum_cli", "--model", str(w.model_dir), "--dataset", str(w.data),
            "--seq-len", str(args.seq_len), "--global-batch", str(args.global_batch), *micro,
            "--max-steps", str(steps), "--lr", "1e-4", "--weight-decay", "0", "--lr-schedule", "constant",
            "--warmup-steps", "0", "--adam-beta2", "0.999", "--grad-clip", "1.0", "--output-dir", str(out),
            *c.flags]  # fmt: skip


def peer_cmd(c: Contestant, args: argparse.Namespace, w: Workload) -> list[str]:
    launcher = [sys.executable]
    if c.peer == "fsdp2":  # as a user launches an FSDP2 script, even on one GPU
        launcher += ["-m", "torch.distributed.run", "--nproc_per_node=1", "--standalone"]
    return [*launcher, str(PEERS_SCRIPT), c.peer, "--model", str(w.model_dir), "--data", str(w.data),
            "--global-batch", str(args.global_batch), "--micro-batch", str(args.train_micro_batch),
            "--steps", str(args.steps), "--lr", "1e-4", "--grad-clip", "1.0"]  # fmt: skip


def read_metrics(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    records = []
    for line in path.read_text(errors="replace").splitlines():
        with contextlib.suppress(ValueError):  # a line being written
            records.append(json.loads(line))
    return records


def run_accum_train(c: Contestant, args: argparse.Namespace, w: Workload, timeout_s: float) -> Row:
    steps = args.auto_steps if c.auto_steps else args.steps
    slug = "-".join(c.name.replace("--", "").split())
    out, log = w.work / f"out-{slug}", w.work / f"{slug}.log"
    started = time.perf_counter()
    proc = start(accum_train_cmd(c, args, w, out), w.env, log)
    how = wait(proc, timeout_s, done=lambda: len(read_metrics(out)) >= steps, kill=True)
    row = Row(c.name, wall_s=time.perf_counter() - started)
    records = read_metrics(out)[:steps]
    with contextlib.suppress(OSError, ValueError, KeyError):
        row.plan = json.loads((out / "config.json").read_text())["plan"]
    row.step_s = step_seconds(records)
    if records:
        row.tokens_per_s = median_rate(row.step_s, records[0]["tokens"])
        row.peak_gib = max(r.get("peak_mem_gib", 0.0) for r in records)
        row.mean_loss = statistics.fmean(r["loss"] for r in records if r.get("loss") is not None)
    plan = row.plan or {}
    described = f"{plan.get('layout')}, sync {plan.get('sync')}, m={plan.get('micro_batch')}" if plan else ""
    if len(records) >= steps and (how == "stopped" or proc.returncode == 0):
        if c.auto_steps:
            row.note = f"auto chose m={plan.get('micro_batch')} ({plan.get('layout')}): {steps} steps, no OOM"
        else:
            row.note = described + (f"; step 1 {row.step_s[0]:.0f} s (compiling)" if "--compile" in c.flags else "")
    else:
        row.status = "timeout" if how == "timeout" else "failed"
        row.log_tail = tail(log)
        row.note = f"{failure_note(row.log_tail, how, proc.returncode)} ({len(records)}/{steps} steps)"
        if c.auto_steps and plan:
            row.note = f"auto chose m={plan.get('micro_batch')}: " + row.note
    shutil.rmtree(out, ignore_errors=True)  # its cache of the data stays, for the next run
    return row


def run_peer(c: Contestant, args: argparse.Namespace, w: Workload, timeout_s: float) -> Row:
    log = w.work / f"{c.name}.log"
    started = time.perf_counter()
    proc = start(peer_cmd(c, args, w), w.env, log)
    how = wait(proc, timeout_s)
    row = Row(c.name, wall_s=time.perf_counter() - started)
    result = result_line(log) if how == "exited" and proc.returncode == 0 else None
    if result is None:
        row.status = "timeout" if how == "timeout" else "failed"
        row.log_tail = tail(log)
        row.note = failure_note(row.log_tail, how, proc.returncode)
        return row
    row.step_s, row.peak_gib, row.mean_loss = result["step_s"], result["peak_gib"], result.get("mean_loss")
    row.tokens_per_s = median_rate(row.step_s, args.global_batch * args.seq_len)
    precision = "bf16" if w.cuda else "fp32"
    row.note = {
        "fsdp2": f"FSDP2 {precision} params/fp32 reduce, sync every microbatch, AdamW (foreach)",
        "trainer": f"Trainer {precision}{' autocast' if w.cuda else ''}, adamw_torch",
    }[c.peer] + f", m={args.train_micro_batch} x {result.get('accum_steps')}"
    return row


def estimate_plans(rows: list[Row], args: argparse.Namespace, w: Workload) -> None:
    """accum-train's estimate of the plan each of its runs chose (cached by section 1 or the run)."""
    from accum_cli.memory import estimate
    from accum_cli.memory.query import Query

    planned = [r for r in rows if r.plan]
    queries = [
        Query(w.config, 1, 1, r.plan["micro_batch"], args.seq_len, r.plan["sync"], w.cuda, False,
              replicated=r.plan["layout"] == "replicate", device_type="cuda")
        for r in planned
    ]  # fmt: skip
    if not queries:
        return
    try:
        found = estimate.estimate(queries)
    except Exception as exc:  # a figure missing from the table, not a failed check
        print(f"estimate of accum-train's plans failed: {type(exc).__name__}: {str(exc)[:200]}")
        return
    for row, got in zip(planned, found, strict=True):
        row.estimate_gib = got.peak / 2**30


def missing_packages() -> list[str]:
    """What accum-train imports but this Python cannot: absent, or there but broken (datasets against an
    older pyarrow or fsspec than it needs), each with the error's type."""
    missing = []
    for name in ACCUM_TRAIN_NEEDS:
        try:
            importlib.import_module(name)
        except Exception as exc:
            missing.append(name if isinstance(exc, ModuleNotFoundError) else f"{name} ({type(exc).__name__})")
    return missing


# ------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available() and not args.tiny:
        print(NO_CUDA)
        return 0
    if str(REPO) not in sys.path:  # run from a checkout, not installed
        sys.path.insert(0, str(REPO))
    began = time.monotonic()
    deadline = began + args.budget_s
    with tempfile.TemporaryDirectory(prefix="gpu_check-") as tmp:
        report = run_all(args, Path(tmp), deadline, torch.cuda.is_available())
    report["seconds"] = round(time.monotonic() - began, 1)
    for path in write_json(report, args.json):
        print(f"wrote {path}")
    return 0 if report.get("workload_ok") else 1


def run_all(args: argparse.Namespace, work: Path, deadline: float, cuda: bool) -> dict:
    from transformers import AutoConfig, LlamaConfig

    def left() -> float:
        return deadline - time.monotonic()

    env = child_env(work)
    os.environ["ACCUM_TRAIN_CACHE"] = env["ACCUM_TRAIN_CACHE"]  # this process's estimates share the cache
    config_dir, model_dir, data = work / "config", work / "model", work / "tokens.jsonl"
    kwargs = llama_config(args)
    # The config.json the workload's save_pretrained writes again (architectures, dtype), so that an
    # estimate made here is the one accum-train's runs ask for, read from the shared cache.
    full = LlamaConfig(**kwargs, architectures=["LlamaForCausalLM"], dtype="float32")
    for folder in (config_dir, model_dir):  # config only: measure_peak builds on the GPU from it
        full.save_pretrained(folder)
    config = json.loads(AutoConfig.from_pretrained(config_dir).to_json_string())  # as accum-train reads it
    rows_needed = args.global_batch * (max(args.steps, args.auto_steps) + 1)
    workload_log = work / "workload.log"
    workload = start([sys.executable, str(PEERS_SCRIPT), "workload", "--model", str(model_dir), "--data", str(data),
                      "--seq-len", str(args.seq_len), "--rows", str(rows_needed),
                      "--vocab-top", str(min(128000, kwargs["vocab_size"]))], env, workload_log)  # fmt: skip
    report: dict = {"args": vars(args), "workload_ok": False, "memory": [], "rows": []}

    if args.memory:  # on the GPU while the workload is written; the estimate on the CPU meanwhile
        cases = [(sync, m) for sync in args.sync for m in args.micro_batch]
        measure_log = work / "measure_peak.log"
        measure = start([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1", "--standalone",
                         str(REPO / "bench" / "measure_peak.py"), "--model", str(config_dir),
                         "--seq-len", str(args.seq_len), *(["--bf16"] if cuda else []), "--sync", *args.sync,
                         "--micro-batch", *map(str, args.micro_batch)], env, measure_log)  # fmt: skip
        started = time.perf_counter()
        try:
            from accum_cli.memory import estimate

            found = estimate.estimate(memory_queries(args, config, cuda))
        except Exception as exc:
            found = f"{type(exc).__name__}: {str(exc)[:300]}"
        print(f"estimated {len(cases)} cases in {time.perf_counter() - started:.0f} s", flush=True)
        how = wait(measure, min(240.0, left() - RESERVE_S))
        print(f"\n1. memory: {_shape(args)}, one rank, estimate vs the GPU")
        try:
            report["memory"] = memory_section(cases, found, measure_log, how, measure.returncode)
        except Exception as exc:  # section 2 still runs
            print(f"the memory section failed: {type(exc).__name__}: {exc}\n{tail(measure_log)}")

    how = wait(workload, min(300.0, left() - RESERVE_S))
    info = result_line(workload_log) if how == "exited" and workload.returncode == 0 else None
    if info is None:
        print(f"the workload could not be written ({how}, exit {workload.returncode}):\n{tail(workload_log)}")
        rows = [Row(c.name, status="skipped", note="not run: no workload") for c in CONTESTANTS if c.name in args.only]
        report["rows"] = [asdict(r) for r in rows]
        print(table(rows))
        return report
    report.update(workload_ok=True, device=info["device"], torch=info["torch"], transformers=info["transformers"],
                  n_params=info["n_params"], flops_per_token=info["flops_per_token"], peak_flops=info["peak_flops"])  # fmt: skip
    if not args.speed:
        return report
    w = Workload(model_dir, data, work, env, config, cuda)
    missing = missing_packages()
    rows = []
    print(f"\n2. speed: {_shape(args)}, G={args.global_batch}, m={args.train_micro_batch}, {args.steps} steps "
          f"(tokens/s: median of steps {WARMUP + 1}-{args.steps}), {info['device']}, torch {info['torch']}", flush=True)  # fmt: skip
    for c in (c for c in CONTESTANTS if c.name in args.only):
        budget = min(c.cap_s, left() - RESERVE_S)
        if c.peer is None and missing:
            row = Row(c.name, status="skipped", note=f"not run: missing {', '.join(missing)}")
        elif budget < MIN_RUN_S:
            row = Row(c.name, status="skipped", note=f"not run: {max(left(), 0):.0f} s of the budget left")
        else:
            try:
                row = (run_peer if c.peer else run_accum_train)(c, args, w, budget)
            except Exception as exc:  # reading its output went wrong: one row, not the whole check
                row = Row(c.name, status="failed", note=f"gpu_check: {type(exc).__name__}: {str(exc)[:100]}")
        rows.append(row)
        shown = f"{row.tokens_per_s:,.0f} tokens/s" if row.tokens_per_s else row.status
        wall = f" ({row.wall_s:.0f} s)" if row.wall_s else ""
        print(f"  {c.name:<32} {shown}{wall}  {row.note}", flush=True)
    if left() > 10:
        started = time.perf_counter()
        estimate_plans(rows, args, w)
        print(f"estimated accum-train's plans in {time.perf_counter() - started:.0f} s", flush=True)
    finish_rows(rows, info["flops_per_token"], info["peak_flops"])
    report["rows"] = [asdict(r) for r in rows]
    print(f"\n{_shape(args)}, G={args.global_batch}, {info['device']}; vs best peer: over the faster of "
          f"{' and '.join(PEERS)}")  # fmt: skip
    print(table(rows))
    return report


def _shape(args: argparse.Namespace) -> str:
    model = "toy Llama (2 layers)" if args.tiny else f"Llama-3.2-1B shape ({args.layers} layers)"
    return f"{model}, seq len {args.seq_len}"


if __name__ == "__main__":
    sys.exit(main())
