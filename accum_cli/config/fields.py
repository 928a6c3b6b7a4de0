"""How a config field is declared: `option(...)` puts everything its flag, its recipe key and its
checks need into the dataclass field's metadata (settings.py reads it back), the check of a value
against them (`out_of_bounds`), and the --help panels the fields are shown under."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import field
from typing import Any

from accum_cli.config import recipe

# Training arithmetic (master weights, AdamW's state) is fp32 whatever --precision says; this layer
# imports no torch, so its limits are written out: torch.finfo(torch.float32).max and .tiny (the
# smallest normal number), tests/test_trust_weights.py checks them against torch.
FP32_MAX = (2 - 2**-23) * 2.0**127
FP32_TINY = 2.0**-126

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


def out_of_bounds(f: dataclasses.Field, value: Any) -> str | None:
    """The one problem with a field's value against its declared choices and bounds, if any."""
    meta, name = f.metadata, "--" + f.name.replace("_", "-")
    if value is None:
        return None
    if meta["choices"] is not None and value not in meta["choices"]:
        return f"{name} {recipe.quote(value)} is unknown; use one of: {', '.join(meta['choices'])}"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    got = recipe.quote(value)
    if isinstance(value, float) and not math.isfinite(value):
        return f"{name} must be a finite number, got {got}"
    ge, gt, le, lt = meta["ge"], meta["gt"], meta["le"], meta["lt"]
    above = (ge is None or value >= ge) and (gt is None or value > gt)
    below = (le is None or value <= le) and (lt is None or value < lt)
    if above and below:
        # Finite here, infinite in the fp32 arithmetic that uses it (--lr 1e39 makes every weight inf).
        if isinstance(value, float) and abs(value) > FP32_MAX:
            return f"{name} must be a finite fp32 number (at most {FP32_MAX:g}: training computes in fp32), got {got}"
        return None
    why = f"; {meta['why']}" if meta["why"] else ""
    # each side as (interval notation, words)
    low = (f"[{ge}", f">= {ge}") if ge is not None else (f"({gt}", f"> {gt}") if gt is not None else None
    high = (f"{le}]", f"<= {le}") if le is not None else (f"{lt})", f"< {lt}") if lt is not None else None
    if low is not None and high is not None:
        return f"{name} must lie in {low[0]}, {high[0]}, got {got}{why}"
    if low is not None:
        return (
            f"{name} must be a positive number, got {got}{why}"
            if gt == 0
            else f"{name} must be {low[1]}, got {got}{why}"
        )
    return f"{name} must be {high[1]}, got {got}{why}"
