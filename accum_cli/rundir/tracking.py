"""Experiment trackers (TensorBoard, W&B, MLflow, trackio, ...) through Accelerate's own classes.

`--report-to` takes names as the HF Trainer spells them (a comma-separated list, `all` for
every installed one, `none`). Rank 0 alone talks to the trackers; every field of a
metrics.jsonl record is logged at its optimizer step, and the resolved configuration and the
plan as hyper-parameters. A tracker whose package is missing is refused before any work.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import secrets
from pathlib import Path

from accum_cli import safe_json
from accum_cli.errors import UserError
from accum_cli.rundir import checkpoint_meta, outdir
from accum_cli.rundir.metrics import last_logged_step

# tracker name -> (the module that must import, the pip package that provides it)
PACKAGES = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb"),
    "mlflow": ("mlflow", "mlflow"),
    "trackio": ("trackio", "trackio"),
    "comet_ml": ("comet_ml", "comet-ml"),
    "aim": ("aim", "aim"),
    "clearml": ("clearml", "clearml"),
    "dvclive": ("dvclive", "dvclive"),
    "swanlab": ("swanlab", "swanlab"),
}
FOLDER = outdir.TRACKERS  # under --output-dir: where trackers that write files put them


def installed(name: str) -> bool:
    return importlib.util.find_spec(PACKAGES[name][0]) is not None


def parse(report_to: str) -> list[str]:
    """`--report-to` -> tracker names, each installed; one clear line otherwise."""
    words = [w.strip().lower() for w in report_to.split(",") if w.strip()]
    if not words or words == ["none"]:
        return []
    if words == ["all"]:
        return [name for name in PACKAGES if installed(name)]
    unknown = [w for w in words if w not in PACKAGES]
    if unknown or "none" in words or "all" in words:
        bad = ", ".join(unknown) or "all/none mixed with names"
        raise UserError(
            f"--report-to {report_to!r}: unknown tracker {bad}; use none, all, or of: {', '.join(PACKAGES)}"
        )
    for name in words:
        if not installed(name):
            package = PACKAGES[name][1]
            raise UserError(
                f"--report-to {name} needs the {package} package: pip install {package} "
                f"(or pip install 'accum-train[{name}]'), or drop it from --report-to"
            )
    return list(dict.fromkeys(words))


def flat_hparams(tree: dict, prefix: str = "") -> dict:
    """Nested config and plan -> flat {name: bool|int|float|str} (lists as text), as trackers want."""
    flat = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flat_hparams(value, f"{name}."))
        elif isinstance(value, (bool, int, float, str)):
            flat[name] = value
        elif value is not None:
            flat[name] = str(value)
    return flat


# What to do when a tracker cannot start, where one thing usually fixes it.
START_FIXES = {"wandb": "log in (wandb login, or WANDB_API_KEY) or log offline with WANDB_MODE=offline"}
PROJECT = "accum-train"  # the W&B / trackio project unless WANDB_PROJECT / TRACKIO_PROJECT says otherwise
IDS = outdir.TRACKER_IDS  # under FOLDER: the tracker run ids of this run, the same across --resume
CONTINUED = ("wandb", "trackio")  # trackers whose run a resume continues, and which keep every step logged


def run_ids(folder: Path, fresh: bool) -> dict:
    """This run's W&B id: new for a fresh run (even in a reused --output-dir, so runs never merge),
    read back on a resume so the tracker continues the same run."""
    ids = {} if fresh else _read_ids(folder)
    if re.fullmatch(r"[a-z0-9]{8,64}", str(ids.get("wandb", ""))):
        return ids
    ids["wandb"] = secrets.token_hex(8)  # none yet, or unreadable: the tracker starts a new run rather than fail
    _write_ids(folder, ids)
    return ids


def _read_ids(folder: Path) -> dict:
    try:
        ids = safe_json.loads((folder / IDS).read_text())
    except (OSError, ValueError):
        return {}
    return ids if isinstance(ids, dict) else {}


def _write_ids(folder: Path, ids: dict) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    outdir.replace_text(folder / IDS, json.dumps(ids) + "\n")


SENT = "sent_until"  # in IDS: the last step W&B and trackio were sent, kept when a rewind drops records


def sent_until(output_dir: Path) -> int:
    """The last step the continued trackers were sent: metrics.jsonl's last record, or further where a
    rewind dropped records that had been sent (a rewound attempt stopped before its old last step).

    The stored step is believed only where the run folder shows the run got that far or meant to: a step past
    every step of the run (an edit, damage) would send W&B and trackio nothing up to it, silently. Such a value,
    or one that is not a whole number, is ignored rather than refused: ids.json only spares the trackers steps
    they already have, and without it the worst is a redone step sent again (W&B drops it with a warning)."""
    logged = last_logged_step(output_dir)
    stored = _read_ids(output_dir / FOLDER).get(SENT)
    if type(stored) is not int or not 0 <= stored <= max(logged, _run_steps(output_dir)):
        stored = 0
    return max(stored, logged)


def _run_steps(output_dir: Path) -> int:
    """How far the run folder shows the run went or meant to go: the steps config.json planned (the last
    attempt's), and the steps of its checkpoints, those a rewind set aside included."""
    try:
        planned = safe_json.loads((output_dir / "config.json").read_text())["plan"]["total_steps"]
    except (OSError, ValueError, KeyError, TypeError):
        planned = 0
    return max(planned if type(planned) is int else 0, checkpoint_meta.furthest_step(output_dir))


def remember_sent(output_dir: Path) -> None:
    """Before a resume drops the records it redoes: how far the trackers were sent, kept in IDS, or
    the next attempt would send W&B and trackio those steps a second time."""
    folder = output_dir / FOLDER
    if (folder / IDS).is_file():  # else no W&B or trackio run was ever continued from here
        _write_ids(folder, _read_ids(folder) | {SENT: sent_until(output_dir)})


def forget_sent(output_dir: Path) -> None:
    """A fresh run in a reused --output-dir: what was sent before belongs to the run it replaces."""
    folder = output_dir / FOLDER
    ids = _read_ids(folder)
    if ids.pop(SENT, None) is not None:
        _write_ids(folder, ids)


class Trackers:
    """The run's trackers on rank 0; logs nothing when none were asked for.

    A resumed run redoes the steps after its checkpoint. TensorBoard drops its old events from the
    checkpoint's step on (purge_step). W&B and trackio continue the same run and cannot rewrite its
    history, so they are sent only the steps they never got (after `logged_until`, the last step of
    the attempt before): each step once, redone steps keep the values first logged. Other trackers
    start a new run on each attempt and get every step.
    """

    def __init__(
        self,
        names: list[str],
        run_name: str,
        output_dir: Path,
        hparams: dict,
        resume_step: int = 0,
        logged_until: int = 0,
    ):
        from accelerate import PartialState
        from accelerate.tracking import LOGGER_TYPE_TO_CLASS

        # Accelerate's tracker classes log through its logger, which refuses to run before its process
        # state exists; TensorBoard's class creates it on the way (main_process_only), W&B's and trackio's
        # do not. The process group already exists: the state adopts it.
        PartialState()
        folder = output_dir / FOLDER
        self.trackers = []  # (tracker, the first step it is sent)
        for name in names:
            cls = LOGGER_TYPE_TO_CLASS[name]
            kwargs, project = {}, run_name
            if name == "tensorboard":
                # From 1 on a fresh run too: an --overwrite run in the same folder hides the old run's steps.
                kwargs["purge_step"] = resume_step + 1
            if name == "wandb":
                # Accelerate passes its first argument as wandb.init's project.
                project = os.environ.get("WANDB_PROJECT") or PROJECT
                kwargs.update(name=run_name, id=run_ids(folder, fresh=not resume_step)["wandb"], resume="allow")
                if not os.environ.get("WANDB_DIR"):  # wandb/ (offline runs too) under the output dir
                    folder.mkdir(parents=True, exist_ok=True)
                    kwargs["dir"] = str(folder)
            if name == "trackio":
                project = os.environ.get("TRACKIO_PROJECT") or PROJECT
                kwargs.update(name=run_name, resume="allow" if resume_step else "never", embed=False)
                # trackio reads TRACKIO_DIR once, when it is imported (in start() below): its local database
                # goes under the output dir unless the user chose a place.
                os.environ.setdefault("TRACKIO_DIR", str(folder / "trackio"))
            args = (run_name, str(folder)) if cls.requires_logging_directory else (project,)
            tracker = cls(*args, **kwargs)
            try:
                tracker.start()
                tracker.store_init_configuration(flat_hparams(hparams))
            except Exception as exc:  # a tracker that cannot start (no login, no server) stops the run here
                fix = START_FIXES.get(name, "fix its setup")
                raise UserError(
                    f"--report-to {name}: the tracker could not start ({str(exc)[:200]}); {fix}, or drop it from --report-to"
                ) from None
            first = logged_until + 1 if name in CONTINUED else 0
            self.trackers.append((tracker, first))
        if set(names) & set(CONTINUED):  # where remember_sent finds it, wherever the tracker keeps its files
            _write_ids(folder, _read_ids(folder) | {SENT: logged_until})

    @classmethod
    def none(cls) -> Trackers:
        """No trackers: what every rank but 0, and a run without --report-to, logs to."""
        empty = cls.__new__(cls)
        empty.trackers = []
        return empty

    def log(self, record: dict) -> None:
        values = {k: v for k, v in record.items() if isinstance(v, (int, float)) and k != "step"}
        for tracker, first in self.trackers:
            if record["step"] >= first:
                tracker.log(values, step=record["step"])

    def log_samples(self, step: int, rows: list[tuple[str, str]]) -> None:
        """A sample step's (prompt, completion) pairs as text: a table in W&B, a Markdown table in
        TensorBoard's text tab (both at the step, each step once as for the metrics); other trackers
        have no text (samples.jsonl has it all)."""
        for tracker, first in self.trackers:
            if step < first:
                continue
            if tracker.name == "wandb":
                tracker.log_table("samples", columns=["prompt", "completion"], data=[list(r) for r in rows], step=step)
            elif tracker.name == "tensorboard":
                table = "".join(f"\n| {_cell(prompt)} | {_cell(completion)} |" for prompt, completion in rows)
                tracker.log({"samples": "| prompt | completion |\n| --- | --- |" + table}, step=step)

    def close(self) -> None:
        """Finish every tracker: W&B's writer runs in a service process and trackio's in a thread, and
        the process ends with os._exit (runtime.exit_process), which waits for neither."""
        for tracker, _ in self.trackers:
            tracker.finish()


def _cell(text: str) -> str:
    """Text as one cell of a Markdown table: its bars escaped, its line breaks as <br>, shown as written."""
    escaped = text.replace("\\", "\\\\").replace("|", "\\|").replace("<", "&lt;").replace("`", "\\`")
    return escaped.replace("\r\n", "<br>").replace("\n", "<br>")
