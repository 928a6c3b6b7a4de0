"""What a run writes about itself: config.json (the resolved configuration and the plan), the
picture (report.png), and the final model, as one collective with a one-line failure."""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path

import torch

from accum_cli.config.settings import TrainConfig
from accum_cli.parallel import runtime
from accum_cli.run.setup import Setup
from accum_cli.rundir import checkpoint, export, outdir, report, samples, tracking
from accum_cli.rundir.metrics import keep_metrics_until


def run_name(cfg: TrainConfig) -> str:
    """--run-name, else the output dir's name: the same on every restart of the run."""
    return cfg.run_name or Path(cfg.output_dir).expanduser().resolve().name


def refresh_report(output_dir: Path) -> None:
    """Rank 0: redraw report.png (loss, lr, grad norm, tokens/s, memory) when matplotlib is there, unless
    ACCUM_TRAIN_REPORT=0: a draw holds rank 0 (and the ranks waiting for it) about a second per checkpoint."""
    if not report.available() or os.environ.get("ACCUM_TRAIN_REPORT", "1").strip() == "0":
        return
    try:
        report.draw([output_dir], output_dir / report.REPORT)
    except Exception as exc:  # a picture must never cost the run: say so and go on
        print(f"note: report.png not drawn ({type(exc).__name__}: {str(exc)[:120]})", flush=True)


def save_final_model(s: Setup, model, last_checkpoint: Path, dtype: torch.dtype) -> None:
    """Collective: the HF-format model in `dtype`; a failed write leaves the final checkpoint to export from."""
    error = None
    try:
        export.save_final(model, s.tokenizer, s.output_dir / "final", s.rt.is_main, dtype)
    except OSError as exc:
        error = exc
    if not runtime.all_ok(error is None, s.rt.device):
        need = sum(p.numel() for p in model.parameters()) * dtype.itemsize
        full = checkpoint.full_disk(getattr(error, "errno", None), need, s.output_dir)
        why = full or (f"{error.strerror or error}" if error else "it failed on rank 0")
        raise checkpoint.SaveFailed(
            f"the final model could not be written to {s.output_dir / 'final'}: {why}; the checkpoint "
            f"{last_checkpoint} holds the trained state: {'free space' if full else 'fix that'}, then "
            f"accum-export {last_checkpoint} OUT" + (f" --base {shlex.quote(s.source.location)}" if s.lora else "")
        )


def run_record_of(s: Setup, cfg: TrainConfig) -> dict:
    """What config.json holds, and the trackers' hyper-parameters: the resolved configuration and the plan."""
    return {
        # Not --overwrite: `--recipe config.json` reruns the training, and must not discard this run.
        "config": cfg.to_dict() | {"seq_len": s.seq_len, "overwrite": False} | s.settings.as_flags(),
        "plan": {
            "global_batch": s.plan.global_batch,
            "micro_batch": s.plan.micro_batch,
            "micro_batch_reason": s.micro_reason,
            "world_size": s.plan.world_size,
            "accum_steps": s.plan.accum_steps,
            "rank_samples": [s.plan.rank_samples(r) for r in range(s.plan.world_size)],
            "layout": s.layout.layout,
            "sync": s.decision.policy,
            "sync_reason": s.decision.reason,
            "total_steps": s.total_steps,
        },
        "resumed_from": str(s.resume.path) if s.resume else None,
    }


def write_run_record(s: Setup, start_step: int, record: dict) -> None:
    """Rank 0, under the lock, in a folder already claimed: clear a previous run of ours if asked, write config.json."""
    out = s.output_dir
    if s.resume is not None:
        tracking.remember_sent(out)
        keep_metrics_until(out, start_step)
        samples.keep_until(out, start_step)
    else:  # a fresh run (--overwrite): nothing of the old run may be mistaken for this one's
        outdir.clear_previous_run(out)
        tracking.forget_sent(out)
    removed = checkpoint.tidy(out)
    if removed:
        print(f"removed what an interrupted save left: {', '.join(removed)}", flush=True)
    (out / "config.json").write_text(json.dumps(record, indent=2) + "\n")


def artefacts(output_dir: Path, last_checkpoint: Path, trackers: list[str]) -> list[str]:
    """The closing summary's lines on what this run folder now holds, each named by its path."""
    lines = [f"checkpoint        {last_checkpoint} (--resume auto continues from the newest)"]
    for name, what in (
        ("metrics.jsonl", "metrics      "),
        (outdir.REPORT, "report       "),
        ("samples.jsonl", "samples      "),
        ("config.json", "config       "),
    ):
        if (output_dir / name).is_file():
            lines.append(f"{what}     {output_dir / name}")
    if trackers:  # those that write files put them here (tracking.py); the others name their own place
        lines.append(f"trackers          {output_dir / outdir.TRACKERS} ({', '.join(trackers)})")
    return lines
