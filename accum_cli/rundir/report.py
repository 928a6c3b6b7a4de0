"""A picture of a run: report.png from metrics.jsonl, one run or several overlaid.

Loss (and eval loss), learning rate, gradient norm, tokens/s and memory against the optimizer
step, or against the tokens trained where compared runs train different numbers of tokens per
step; each resume marked; the plan in the title. Only the panels some run has data for are
drawn. matplotlib (Agg) is an optional extra: without it the training run says so once and
goes on. `accum-report` (cli/report.py) draws the picture of a run that is still going, or
compares runs.
"""

from __future__ import annotations

import bisect
import contextlib
import itertools
import math
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
STEPS, TOKENS = "optimizer step", "tokens trained"  # the x-axis's two labels
# Runs whose tokens per step differ by less than this share the step axis. The tokens axis is never wrong
# (runs of one batch with ragged rows in other orders differ a little, and get it), the step axis is only
# where a step trains as much in each run: so a small margin, 1% of a panel's width being a few pixels.
SAME_TOKENS_PER_STEP = 0.01
PANELS_PER_ROW = 3


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


def numeric(value) -> bool:
    """A value to draw: a number, not a bool, nor the null that stands for a non-finite one."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def resumes(records: list[dict]) -> list[int]:
    """The indexes of the records a resumed process wrote first. metrics.jsonl has no field that says
    so: a resume cuts the file back to its checkpoint's step and appends, and the steps go on by one.
    But elapsed_s counts from each process's start: within one process a step begins (elapsed_s -
    step_s) after the previous record was written (its elapsed_s), while a new process's first step
    begins near 0 on its own clock. Half the previous elapsed_s tells the two apart, also where a
    file's elapsed_s is the plain sum of its step_s (rounding then puts the two a hair either side)."""
    return [
        index
        for index, (before, record) in enumerate(itertools.pairwise(records), 1)
        if all(numeric(value) for value in (before.get("elapsed_s"), record.get("elapsed_s"), record.get("step_s")))
        and record["elapsed_s"] - record["step_s"] < before["elapsed_s"] / 2
    ]


def tokens_per_step(records: list[dict]) -> float:
    return sum(r["tokens"] for r in records if numeric(r.get("tokens"))) / len(records)


def by_tokens(loaded: list[tuple[Path, list[dict], str]]) -> bool:
    """Whether the x-axis is the tokens trained: runs compared whose steps train different numbers of tokens
    (another global batch, longer sequences), which the step axis would set side by side as equals."""
    rates = [tokens_per_step(records) for _, records, _ in loaded if records]
    return len(loaded) > 1 and min(rates, default=0) > 0 and max(rates) > min(rates) * (1 + SAME_TOKENS_PER_STEP)


def positions(records: list[dict], tokens: bool) -> list[float]:
    """Each record's place on the x-axis: its step, or the tokens trained up to the end of it."""
    if not tokens:
        return [record["step"] for record in records]
    return list(itertools.accumulate(r["tokens"] if numeric(r.get("tokens")) else 0 for r in records))


def trailing_mean(values: list[float], window: int) -> list[float]:
    """Each value averaged with the window - 1 before it (fewer at the start)."""
    sums = [0.0, *itertools.accumulate(values)]
    return [(sums[end] - sums[max(0, end - window)]) / min(end, window) for end in range(1, len(values) + 1)]


def smoothed(xs: list[float], ys: list[float], processes: list[int]) -> list[tuple[list[float], list[float]]]:
    """(x, y) lines of a series, each process's averaged over a trailing window of about sqrt(points):
    a few points in a short run, a vanishing share of a long one, whose shape stays. A resumed process
    starts a line of its own: its first steps (warm-up, compilation) are no part of the process before."""
    window = math.ceil(math.sqrt(len(ys)))
    lines = []
    for _, group in itertools.groupby(zip(processes, xs, ys, strict=True), key=lambda point: point[0]):
        _, line_x, line_y = zip(*group, strict=True)
        lines.append((list(line_x), trailing_mean(list(line_y), window)))
    return lines


def panel_axes(fig, count: int) -> list:
    """`count` axes, PANELS_PER_ROW to a row at most and rows alike, each row spread over the full width:
    no empty cell (5 panels are 3 above 2, 4 are 2 above 2)."""
    rows = math.ceil(count / PANELS_PER_ROW)
    per_row = math.ceil(count / rows)
    spec = fig.add_gridspec(rows, math.lcm(*range(1, per_row + 1)))
    axes = []
    for row in range(rows):
        in_row = min(per_row, count - row * per_row)
        width = spec.ncols // in_row
        axes += [fig.add_subplot(spec[row, i * width : (i + 1) * width]) for i in range(in_row)]
    return axes


def figure(runs: list[Path]):
    """The matplotlib Figure of one run, or of several overlaid. Made without pyplot: nothing global
    holds it, so a training run that redraws at every checkpoint keeps no figure alive."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import EngFormatter, LogFormatter, MaxNLocator

    loaded = [(folder, *read_run(folder)) for folder in runs]
    drawn = [
        (key, label)
        for key, label in PANELS
        if any(numeric(record.get(key)) for _, records, _ in loaded for record in records)
    ]
    if not drawn:
        raise UserError(f"{', '.join(str(folder) for folder in runs)}: no step recorded yet, nothing to draw")
    tokens = by_tokens(loaded)
    placed = [(folder, records, positions(records, tokens), resumes(records)) for folder, records, _ in loaded]
    fig = Figure(figsize=(15, 8), layout="constrained")
    for ax, (key, label) in zip(panel_axes(fig, len(drawn)), drawn, strict=True):
        # A run's colour is its place in the list, not the panel's next one: the eval series (the loss panel
        # only) would otherwise shift every later run to another colour there than in the other panels.
        for index, (folder, records, xs, starts) in enumerate(placed):
            colour = f"C{index % 10}"
            kept = [i for i, record in enumerate(records) if numeric(record.get(key))]
            x, y = [xs[i] for i in kept], [records[i][key] for i in kept]
            if key == "tokens_per_s" and kept:  # noisy step to step: the trend drawn, the steps faint behind it
                ax.plot(x, y, ".", markersize=3, alpha=0.25, color=colour)
                processes = [bisect.bisect_right(starts, i) for i in kept]
                for number, line in enumerate(smoothed(x, y, processes)):
                    ax.plot(*line, label=None if number else folder.name, linewidth=1.2, color=colour)
            elif kept:
                ax.plot(x, y, label=folder.name, linewidth=1.2, color=colour)
            if key == "loss":
                evals = [(at, r["eval_loss"]) for at, r in zip(xs, records, strict=True) if numeric(r.get("eval_loss"))]
                if evals:
                    ax.plot(*zip(*evals, strict=True), "o--", label=f"{folder.name} eval", markersize=4, color=colour)
            for start in starts:  # at the checkpoint it resumed from: right of the line is the new process
                ax.axvline(xs[start - 1], linestyle="--", linewidth=1, alpha=0.6, color=colour)
            for start in stages(records):  # --batch-schedule: the last step of the stage before
                ax.axvline(xs[start - 1], linestyle=":", linewidth=1.2, alpha=0.8, color=colour)
        ax.set_title(label)
        ax.set_xlabel(TOKENS if tokens else STEPS)
        if tokens:
            ax.xaxis.set_major_formatter(EngFormatter())
        else:
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if key == "loss":  # most of the drop comes first: on a linear axis the rest of the run is a flat line
            ax.set_yscale("log")
            # Plain numbers (5.9, not 5.9x10^0): a loss spans a decade or two, where minor ticks carry the labels.
            ax.yaxis.set_major_formatter(LogFormatter())
            ax.yaxis.set_minor_formatter(LogFormatter(labelOnlyBase=False))
        if key == "peak_mem_gib":  # read against none at all, not against the narrow band it moves in
            ax.set_ylim(0, ax.get_ylim()[1] * 1.05)  # the top as autoscaled, for a flat line, is the line itself
        ax.grid(alpha=0.3)
        if key in ("loss", "lr") and (len(loaded) > 1 or key == "loss"):
            ax.legend(fontsize=8)
    lines = [summary(folder, records, plan) for folder, records, plan in loaded]
    if len(loaded) == 1:
        fig.suptitle(f"accum-train  {lines[0]}")
    else:
        fig.suptitle(f"accum-train: {len(loaded)} runs\n" + "\n".join(lines), fontsize=9, family="monospace")
    return fig


def stages(records: list[dict]) -> list[int]:
    """The indexes of the records whose step's global batch differs from the step before (a --batch-schedule
    stage begins; metrics.jsonl records each step's global_batch)."""
    return [
        index
        for index, (before, record) in enumerate(itertools.pairwise(records), 1)
        if numeric(before.get("global_batch")) and numeric(record.get("global_batch"))
        and before["global_batch"] != record["global_batch"]
    ]  # fmt: skip


def summary(folder: Path, records: list[dict], plan: str) -> str:
    """A run in one line: its name, steps, plan, stages and resumes."""
    resumed = [records[start - 1]["step"] for start in resumes(records)]
    after = f"  resumed after step {', '.join(map(str, resumed))}" if resumed else ""
    staged = [f"{records[i]['global_batch']} from step {records[i]['step']}" for i in stages(records)]
    if staged:
        after = f"  global batch {records[0]['global_batch']}, " + ", ".join(staged) + " (dotted)" + after
    return f"{folder.name}: {len(records)} steps  {plan}{after}"


def draw(runs: list[Path], out: Path) -> Path:
    """Write the picture of one run, or of several overlaid, to `out` (atomically)."""
    fig = figure(runs)
    tmp = outdir.temporary(out)  # a name outdir.check() keeps free of links in a run folder
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(tmp, dpi=80, format=out.suffix[1:].lower())
        os.replace(tmp, out)
    except OSError as exc:
        raise UserError(f"cannot write {out} ({exc.strerror or exc}); check the folder and its permissions") from None
    finally:
        with contextlib.suppress(OSError):  # gone once renamed, or never made
            tmp.unlink()
    return out
