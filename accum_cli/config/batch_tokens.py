"""`--global-batch-tokens N`: the global batch as tokens per optimizer step, as pretraining states it.

Suffixes are decimal (`K` = 1,000, `M` = 1,000,000, `B` = 1,000,000,000, any case), as token counts
are written in OLMo-core and Megatron-LM configs ("250B" tokens is 250e9) and read in papers'
prose; a binary count (2**22) is written out in full: `4194304`. A decimal with a suffix is
taken when it names whole tokens (`1.5M`). The count is turned into sequences once, here, where
the config is built: N / --seq-len must be whole, and everything downstream (plan, memory
estimate, checkpoints, resume) sees an ordinary --global-batch. Pure: no torch.
"""

from __future__ import annotations

import re
from decimal import Decimal
from typing import Any

from accum_cli.errors import UserError

FLAG, KEY, BATCH_KEY = "--global-batch-tokens", "global_batch_tokens", "global_batch"
SUFFIXES = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9}
# digits, an optional fraction, an optional suffix; bounded, so a pasted megabyte is no number
TOKENS = re.compile(r"([0-9]{1,20}(?:\.[0-9]{1,20})?)\s*([KMB]?)", re.I)


def parse_tokens(value: Any) -> int:
    """A token count from a flag's text (`4M`, `500K`, `4194304`) or a recipe's integer."""
    if isinstance(value, int) and not isinstance(value, bool):
        count = value
    else:
        text = str(value).strip()
        match = TOKENS.fullmatch(text.replace("_", "").replace(",", ""))
        if match is None:
            raise UserError(
                f"{FLAG} must be a whole number of tokens, optionally with a suffix K, M or B "
                f"(decimal: 4M is 4,000,000), got {value!r:.60}"
            )
        exact = Decimal(match.group(1)) * SUFFIXES[match.group(2).upper()]
        if exact != exact.to_integral_value():
            raise UserError(f"{FLAG} {text} is {exact:,} tokens, not a whole number; give whole tokens")
        count = int(exact)
    if count < 1:
        raise UserError(f"{FLAG} must be at least 1 token, got {value!r:.60}")
    return count


def sequences(value: Any, seq_len: int | None, most: int) -> int:
    """N tokens as sequences of --seq-len (at most `most`): refused, naming the nearest valid values,
    unless whole."""
    tokens = parse_tokens(value)
    if seq_len is None:
        raise UserError(f"{FLAG} needs --seq-len: the global batch is N / --seq-len sequences")
    below, extra = divmod(tokens, seq_len)
    if below > most:
        raise UserError(f"{FLAG} {value} is more than {most:,} sequences of --seq-len {seq_len}; give fewer tokens")
    if extra == 0:
        return below
    options = [g for g in (below, below + 1) if g >= 1]
    as_tokens = " or ".join(f"{g * seq_len}" for g in options)
    as_batch = " or ".join(str(g) for g in options)
    raise UserError(
        f"{FLAG} {value} ({tokens:,} tokens) is not a whole number of --seq-len {seq_len} sequences "
        f"({tokens / seq_len:.10g}); use {FLAG} {as_tokens} (--global-batch {as_batch})"
    )


def layered(recipe_values: dict[str, Any], flags: dict[str, Any], recipe_path: Any) -> dict[str, Any]:
    """Recipe < flags, where the batch is given once per layer, in sequences or in tokens: both in
    one layer is refused; a flag for either replaces the recipe's batch, however it was given."""
    if KEY in flags and BATCH_KEY in flags:
        raise UserError(f"{FLAG} and --global-batch both given; pick one (tokens or sequences per step)")
    if recipe_values.get(KEY) is not None and BATCH_KEY in recipe_values:
        raise UserError(f"recipe {recipe_path}: keys {KEY} and {BATCH_KEY} both given; keep one")
    if KEY in flags or BATCH_KEY in flags:
        recipe_values = {k: v for k, v in recipe_values.items() if k not in (KEY, BATCH_KEY)}
    return recipe_values | flags
