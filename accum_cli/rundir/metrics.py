"""What a run reports: metrics.jsonl (one object per optimizer step), progress, summary.

Only rank 0 reports; the values it reports are global (all-reduced), so they do not
depend on which rank writes them.
"""

from __future__ import annotations

import json
import math
import resource
import sys
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from accum_cli import safe_json
from accum_cli.rundir import outdir
from accum_cli.step.loop import StepResult

# Dense bf16 tensor-core peaks (FLOP/s), for MFU on the GPUs people train on.
PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 70e12, "B200": 2250e12}


def flops_per_token(n_params: int, n_layers: int, hidden: int, seq_len: int) -> float:
    """Training FLOPs per token: 6N for the matmuls plus 12*L*H*S for attention (PaLM, appendix B)."""
    return 6 * n_params + 12 * n_layers * hidden * seq_len


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_BF16_FLOPS.items() if key in name), None)


def peak_memory_gib(device: torch.device) -> float:
    """Peak GPU memory allocated, or the process's peak resident memory on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


class Reporter:
    """Writes metrics.jsonl and shows progress; a no-op object on ranks other than 0."""

    def __init__(
        self,
        output_dir: Path | None,
        total_steps: int,
        device: torch.device,
        enabled: bool,
        start_step: int = 0,
        flops_per_token: float | None = None,
        world_size: int = 1,
        log_every: int | None = None,
        tokens_at_most: int | None = None,
    ):
        peak = peak_flops(device)
        # MFU: achieved model FLOP/s over the peak of every GPU in the job (CUDA only).
        self.mfu_denominator = peak * world_size if peak and flops_per_token else None
        self.flops_per_token = flops_per_token
        self.enabled = enabled
        self.log_every = log_every
        self.tokens_at_most = tokens_at_most  # rows, not packed blocks: the header gave only this bound
        self.total_steps = total_steps
        self.start_step = start_step
        self.device = device
        self.started = time.perf_counter()
        self.console = Console(stderr=False, highlight=False)
        self._file = open(output_dir / "metrics.jsonl", "a") if enabled and output_dir else None  # noqa: SIM115 (closed in __exit__)
        self._progress: Progress | None = None
        self._task = None
        self.last: dict | None = None
        self.tokens_total = 0

    def __enter__(self) -> Reporter:
        if self.enabled and self.console.is_terminal:
            self._progress = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[status]}"),
                TimeRemainingColumn(),
                console=self.console,
            )
            self._progress.start()
            self._task = self._progress.add_task("train", total=self.total_steps, completed=self.start_step, status="")
        return self

    def __exit__(self, *exc) -> None:
        if self._progress is not None:
            self._progress.stop()
        if self._file is not None:
            self._file.close()

    def step(self, step: int, result: StepResult, step_seconds: float, extra: dict | None = None) -> dict:
        """Record optimizer step `step` (0-based index); records and lines number it from 1."""
        self.tokens_total += result.tokens
        record = {
            "step": step + 1,  # optimizer steps completed: as the console, checkpoints and trackers say
            "loss": result.loss,
            "loss_tokens": result.loss_tokens,
            "rows": result.rows,
            "tokens": result.tokens,
            "positions": result.positions,
            "grad_norm": result.grad_norm,
            "lr": result.lr,
            "tokens_per_s": result.tokens / step_seconds,
            "step_s": step_seconds,
            "elapsed_s": time.perf_counter() - self.started,
            "peak_mem_gib": peak_memory_gib(self.device),
        }
        if self.mfu_denominator:
            record["mfu"] = record["tokens_per_s"] * self.flops_per_token / self.mfu_denominator
        if result.aux_loss is not None:
            record["aux_loss"] = result.aux_loss
        if result.skipped:
            record["skipped"] = True
        record.update(extra or {})
        self.last = record
        if not self.enabled:
            return record
        self._file.write(json_line(record) + "\n")
        self._file.flush()
        status = (
            ("SKIPPED (non-finite)  " if result.skipped else "")
            + (
                f"loss {result.loss:.4f}  lr {result.lr:.2e}  gnorm {result.grad_norm:.3f}  "
                f"{record['tokens_per_s']:,.0f} tok/s"
            )
            + (f"  eval {record['eval_loss']:.4f}" if "eval_loss" in record else "")
        )
        if self._progress is not None:
            self._progress.update(self._task, completed=step + 1, status=status)
        if self._should_log(step) or "eval_loss" in record:
            self._print(f"step {step + 1}/{self.total_steps}  {status}")
        if self.tokens_at_most and step == self.start_step:
            self._print(
                f"tokens per step   {result.tokens:,} in step {step + 1}, of at most {self.tokens_at_most:,} "
                "(rows are as long as they are)"
            )
        return record

    def _print(self, line: str) -> None:
        if self._progress is not None:  # above the bar, to stay: the bar shows only the latest step
            self._progress.console.print(line, markup=False)
        else:
            print(line, flush=True)

    def _should_log(self, step: int) -> bool:
        if self.log_every:
            return (step + 1) % self.log_every == 0 or step + 1 == self.total_steps
        every = max(1, self.total_steps // 20)
        return step < self.start_step + 3 or (step + 1) % every == 0 or step + 1 == self.total_steps


def json_line(record: dict) -> str:
    """The record as strict JSON: a non-finite value (a skipped step's loss or gradient norm, the
    eval loss of a set without loss tokens) is null. Python would write NaN and Infinity, which
    other parsers refuse and jq turns into 1.8e308."""
    finite = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()}
    return json.dumps(finite, allow_nan=False)


def _record_step(line: str) -> int | None:
    """A metrics line's step; None for a line that is not a record (one torn by a full disk or a kill)."""
    try:
        step = safe_json.loads(line)["step"]
    except (ValueError, TypeError, KeyError):
        return None
    return step if isinstance(step, int) else None


def keep_metrics_until(output_dir: Path, step: int) -> None:
    """On resume from a checkpoint after `step` steps: drop the later records (they are about to be
    redone) and any torn line."""
    keep_records_until(output_dir / "metrics.jsonl", step)


def keep_records_until(path: Path, step: int) -> None:
    """Of a JSON-lines file whose records carry their "step" (metrics.jsonl, samples.jsonl): keep those
    of steps up to `step`, drop the rest and any torn line, atomically; nothing where none would go."""
    if not path.is_file():
        return
    lines = path.read_text(errors="replace").splitlines()
    kept = [line for line in lines if (done := _record_step(line)) is not None and done <= step]
    if kept == lines:
        return
    outdir.replace_text(path, "".join(line + "\n" for line in kept))


def last_logged_step(output_dir: Path) -> int:
    """The last step metrics.jsonl records (0 if none): what the trackers were sent before a resume."""
    path = output_dir / "metrics.jsonl"
    if not path.exists():
        return 0
    steps = (_record_step(line) for line in path.read_text(errors="replace").splitlines())
    return max((s for s in steps if s is not None), default=0)


def print_lines(lines: list[str], title: str) -> None:
    print(f"── {title} " + "─" * max(0, 60 - len(title)), flush=True)
    for line in lines:
        print(f"  {line}")
    sys.stdout.flush()
