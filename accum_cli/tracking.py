"""Experiment trackers (TensorBoard, W&B, MLflow, trackio, ...) through Accelerate's own classes.

`--report-to` takes names as the HF Trainer spells them (a comma-separated list, `all` for
every installed one, `none`). Rank 0 alone talks to the trackers; every field of a
metrics.jsonl record is logged at its optimizer step, and the resolved configuration and the
plan as hyper-parameters. A tracker whose package is missing is refused before any work.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from accum_cli.errors import UserError

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
FOLDER = "trackers"  # under --output-dir: where trackers that write files put them


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


class Trackers:
    """The run's trackers on rank 0; logs nothing when none were asked for."""

    def __init__(self, names: list[str], run_name: str, output_dir: Path, hparams: dict, resume_step: int = 0):
        from accelerate.tracking import LOGGER_TYPE_TO_CLASS

        self.trackers = []
        for name in names:
            cls = LOGGER_TYPE_TO_CLASS[name]
            kwargs = {}
            if name == "tensorboard" and resume_step:
                # A resumed run redoes the steps after its checkpoint: drop the old ones.
                kwargs["purge_step"] = resume_step + 1
            if name == "wandb":
                kwargs.update(id=run_name, resume="allow")  # a restart continues the same W&B run
            if cls.requires_logging_directory:
                tracker = cls(run_name, str(output_dir / FOLDER), **kwargs)
            else:
                tracker = cls(run_name, **kwargs)
            try:
                tracker.start()
                tracker.store_init_configuration(flat_hparams(hparams))
            except Exception as exc:  # a tracker that cannot start (no login, no server) stops the run here
                raise UserError(f"--report-to {name}: the tracker could not start ({str(exc)[:200]})") from None
            self.trackers.append(tracker)

    @classmethod
    def none(cls) -> Trackers:
        """No trackers: what every rank but 0, and a run without --report-to, logs to."""
        empty = cls.__new__(cls)
        empty.trackers = []
        return empty

    def log(self, record: dict) -> None:
        values = {k: v for k, v in record.items() if isinstance(v, (int, float)) and k != "step"}
        for tracker in self.trackers:
            tracker.log(values, step=record["step"])

    def close(self) -> None:
        for tracker in self.trackers:
            tracker.finish()
