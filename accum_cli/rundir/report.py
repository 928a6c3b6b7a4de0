"""A picture of a run: report.png from metrics.jsonl, one run or several overlaid.

Loss (and eval loss), learning rate, gradient norm, tokens/s and memory against the optimizer
step, with the plan in the title. matplotlib (Agg) is an optional extra: without it the
training run says so once and goes on. `accum-report` (cli/report.py) draws
the picture of a run that is still going, or compares runs.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from accum_cli import safe_json
from accum_cli.errors import UserError
from accum_cli.rundir import outdir

PANELS = (
    ("loss", "loss (token-weighted)"),
    ("lr", "learning rate"),
    ("grad_norm", "gradient norm (before clipping)"),
    ("tokens_per_s", "tokens/s"),
    ("peak_mem_gib", "peak memory (GiB)"),
)
REPORT = outdir.REPORT
FORMATS = (".png", ".svg", ".pdf")  # what --out may name: matplotlib writes each by its suffix


def available() -> bool:
    import importlib.util

    return importlib.util.find_spec("matplotlib") is not None


def read_run(folder: Path) -> tuple[list[dict], str]:
    """(metrics records, a one-line description of the plan) of a run folder."""
    metrics = folder / "metrics.jsonl"
    if not metrics.is_file():
        raise UserError(f"{folder} has no metrics.jsonl; pass the --output-dir of a run")
    records = []
    lines = metrics.read_text(errors="replace").splitlines()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = safe_json.loads(line)
        except ValueError:
            if number == len(lines):  # a run still writing its last line
                break
            raise UserError(f"{metrics} line {number} is not JSON; is it a metrics file of accum-train?") from None
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            records.append(record)
    return records, describe_plan(folder)


def describe_plan(folder: Path) -> str:
    try:
        plan = safe_json.loads((folder / "config.json").read_text())["plan"]
        return (
            f"G={plan['global_batch']}  m={plan['micro_batch']}  W={plan['world_size']}  "
            f"A={plan['accum_steps']}  sync={plan['sync']}"
        )
    except (OSError, ValueError, KeyError, TypeError):
        return ""


def draw(runs: list[Path], out: Path) -> Path:
    """Write the picture of one run, or of several overlaid, to `out` (atomically)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    loaded = [(folder, *read_run(folder)) for folder in runs]
    fig, axes = plt.subplots(2, 3, figsize=(15, 8), constrained_layout=True)
    for ax, (key, label) in zip(axes.flat, PANELS, strict=False):
        # A run's colour is its place in the list, not the panel's next one: the eval series (the loss panel
        # only) would otherwise shift every later run to another colour there than in the other panels.
        for index, (folder, records, _) in enumerate(loaded):
            colour = f"C{index % 10}"
            points = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float))]
            if points:
                ax.plot(*zip(*points, strict=True), label=folder.name, linewidth=1.2, color=colour)
            if key == "loss":
                evals = [(r["step"], r["eval_loss"]) for r in records if isinstance(r.get("eval_loss"), (int, float))]
                if evals:
                    ax.plot(*zip(*evals, strict=True), "o--", label=f"{folder.name} eval", markersize=4, color=colour)
        ax.set_title(label)
        ax.set_xlabel("optimizer step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        if key in ("loss", "lr") and (len(loaded) > 1 or key == "loss"):
            ax.legend(fontsize=8)
    summary = axes.flat[-1]
    summary.axis("off")
    lines = [f"{folder.name}: {len(records)} steps  {plan}" for folder, records, plan in loaded]
    summary.text(0, 1, "\n".join(lines), va="top", family="monospace", fontsize=8, wrap=True)
    title = loaded[0][2] if len(loaded) == 1 else f"{len(loaded)} runs"
    fig.suptitle(f"accum-train  {loaded[0][0].name}  {title}" if len(loaded) == 1 else f"accum-train: {title}")
    tmp = outdir.temporary(out)  # a name outdir.check() keeps free of links in a run folder
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(tmp, dpi=80, format=out.suffix[1:].lower())
        os.replace(tmp, out)
    except OSError as exc:
        raise UserError(f"cannot write {out} ({exc.strerror or exc}); check the folder and its permissions") from None
    finally:
        plt.close(fig)
        with contextlib.suppress(OSError):  # gone once renamed, or never made
            tmp.unlink()
    return out
