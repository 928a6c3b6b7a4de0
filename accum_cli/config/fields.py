"""How a config field is declared: `option(...)` puts everything its flag, its recipe key and its
checks need into the dataclass field's metadata (settings.py reads it back), and the --help panels
the fields are shown under."""

from __future__ import annotations

from dataclasses import field
from typing import Any

# --help panels, in the order they are shown.
MODEL_DATA = "Model & data"
BATCH = "Batch"
OPTIMISATION = "Optimisation"
CHECKPOINTS = "Checkpoints & resume"
LAUNCH = "Launch"
OUTPUT = "Output"
LORA = "LoRA"
PANELS = (MODEL_DATA, BATCH, OPTIMISATION, LORA, CHECKPOINTS, LAUNCH, OUTPUT)


def option(
    default: Any,
    help: str,
    panel: str,
    *,
    none_means: str | None = None,
    choices: tuple[str, ...] | None = None,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    why: str | None = None,
) -> Any:
    """A config field with everything the flag, the recipe key and the checks need to know
    (`why`: what an out-of-bounds value would do and what to pass, said after the bounds)."""
    meta = {"help": help, "panel": panel, "none_means": none_means, "choices": choices,
            "ge": ge, "gt": gt, "le": le, "lt": lt, "why": why}  # fmt: skip
    return field(default=default, metadata=meta)
