"""`--batch-schedule`: a global batch that grows as training goes, as pretraining ramps it up.

Grammar (docs/PRETRAINING.md): stages separated by commas (or spaces, as Megatron-LM writes
"0:768 250B:1536"), each `THRESHOLD:BATCH`:

- THRESHOLD: tokens trained, a whole number with an optional decimal suffix K, M or B (`2B` is
  2,000,000,000 tokens, as in --global-batch-tokens), or optimizer steps done, `500s`. One unit per
  schedule (`0` fits both). The first threshold is 0; they strictly increase.
- BATCH: sequences per optimizer step (`256`), or tokens with a suffix K, M or B (`4M`), which must
  be a whole number of --seq-len sequences. Each stage's batch is larger than the one before.

A stage starts at the first optimizer step that begins at or after its threshold: the batch of step k
is the batch of the last stage whose threshold is at most the position where step k begins (tokens
trained before it, counted as sequences x --seq-len, or k). So a stage whose threshold a single step
jumps over never runs. The position (steps done, samples consumed) alone says which stage a step is
in, so a resume needs no state but its checkpoint's data position. Pure: no torch.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from accum_cli.config import batch_tokens
from accum_cli.errors import UserError

FLAG, KEY = "--batch-schedule", "batch_schedule"
TOKENS, STEPS = "tokens", "steps"
LR_NONE, LR_SQRT = "none", "sqrt"
LR_CHOICES = (LR_NONE, LR_SQRT)
MAX_TEXT, MAX_STAGES = 4096, 256
# Sequences in one stage's batch: settings.MAX_GLOBAL_BATCH (tests/test_batch_schedule.py holds them equal).
MOST = 2**40
_ENTRY = re.compile(r"([^:\s]+):([^:\s]+)")
_STEPS = re.compile(r"([0-9]{1,15})\s*s", re.I)
_SEQUENCES = re.compile(r"[0-9]{1,15}")


@dataclass(frozen=True, slots=True)
class Stage:
    threshold: int  # tokens trained or steps done (Schedule.unit) from which the stage applies
    global_batch: int  # sequences per optimizer step


@dataclass(frozen=True, slots=True)
class Segment:
    """The steps a stage runs: `steps` of `global_batch`, from step `first_step` at sample `first_sample`."""

    stage: int
    first_step: int
    first_sample: int
    global_batch: int
    steps: int | None  # None: open-ended (no length given)


@dataclass(frozen=True, slots=True)
class Schedule:
    unit: str  # TOKENS or STEPS
    stages: tuple[Stage, ...]

    @property
    def text(self) -> str:
        """The canonical form (thresholds resolved, batches in sequences): what a checkpoint records."""
        mark = "s" if self.unit == STEPS else ""
        return ",".join(f"{s.threshold}{mark}:{s.global_batch}" for s in self.stages)

    @property
    def largest(self) -> int:
        return self.stages[-1].global_batch

    def position(self, step: int, samples: int, seq_len: int) -> int:
        return step if self.unit == STEPS else samples * seq_len

    def stage_at(self, step: int, samples: int, seq_len: int) -> int:
        """The stage of the step that begins after `step` steps and `samples` samples."""
        here = self.position(step, samples, seq_len)
        return max(i for i, s in enumerate(self.stages) if s.threshold <= here)

    def batch_at(self, step: int, samples: int, seq_len: int) -> int:
        return self.stages[self.stage_at(step, samples, seq_len)].global_batch

    def lr_scale(self, global_batch: int, rule: str) -> float:
        """--batch-schedule-lr: sqrt multiplies the lr by the square root of each increase so far."""
        return math.sqrt(global_batch / self.stages[0].global_batch) if rule == LR_SQRT else 1.0

    def segments(
        self, seq_len: int, step: int = 0, samples: int = 0, max_steps: int | None = None,
        max_samples: int | None = None,
    ) -> list[Segment]:  # fmt: skip
        """The stages as they run from (step, samples): whole steps only, up to `max_steps` steps in all
        and `max_samples` samples consumed (a step that would pass it is not taken)."""
        out: list[Segment] = []
        while True:
            index = self.stage_at(step, samples, seq_len)
            g = self.stages[index].global_batch
            limits = []
            if index + 1 < len(self.stages):
                nxt = self.stages[index + 1].threshold
                if self.unit == STEPS:
                    limits.append(nxt - step)
                else:  # the first step that begins at or after the threshold is the next stage's
                    limits.append(-(-(-(-nxt // seq_len) - samples) // g))
            if max_steps is not None:
                limits.append(max_steps - step)
            if max_samples is not None:
                limits.append(max(0, max_samples - samples) // g)
            n = min(limits) if limits else None
            if n is not None and n <= 0:
                return out
            out.append(Segment(index, step, samples, g, n))
            if n is None:
                return out
            step, samples = step + n, samples + n * g


def parse(text: Any, seq_len: int | None, most: int) -> Schedule:
    """The schedule a flag or recipe gives, or one line saying what is wrong with it."""
    raw = str(text).strip()
    if not raw.strip(", \t\n"):
        raise UserError(f'{FLAG} is empty; give stages THRESHOLD:BATCH, e.g. {FLAG} "0:256,2B:512"')
    if len(raw) > MAX_TEXT:
        raise UserError(f"{FLAG} is longer than {MAX_TEXT} characters; give fewer stages")
    entries = [e for e in re.split(r"[,\s]+", raw) if e]
    if len(entries) > MAX_STAGES:
        raise UserError(f"{FLAG} has {len(entries)} stages, more than {MAX_STAGES}")
    units, stages = set(), []
    for entry in entries:
        match = _ENTRY.fullmatch(entry)
        if match is None:
            raise UserError(f"{FLAG}: stage {entry!r:.40} is not THRESHOLD:BATCH (e.g. 2B:512 or 500s:512)")
        unit, threshold = _threshold(match.group(1))
        if unit:
            units.add(unit)
        stages.append(Stage(threshold, _batch(match.group(2), seq_len, most)))
    if len(units) > 1:
        raise UserError(f"{FLAG} mixes thresholds in tokens and in steps (500s); give all in one unit")
    if stages[0].threshold != 0:
        raise UserError(f"{FLAG}: the first stage must start at 0 (the run's first step), got {entries[0]!r:.40}")
    for before, after, entry in zip(stages, stages[1:], entries[1:], strict=False):
        if after.threshold <= before.threshold:
            word = "starts where" if after.threshold == before.threshold else "starts before"
            raise UserError(f"{FLAG}: stage {entry!r:.40} {word} the stage before it; "
                            "give the stages in increasing order of their thresholds")  # fmt: skip
        if after.global_batch <= before.global_batch:
            word = "the same as" if after.global_batch == before.global_batch else "smaller than"
            raise UserError(f"{FLAG}: stage {entry!r:.40} has a batch of {after.global_batch} sequences, {word} the "
                            f"{before.global_batch} before it; each stage must raise the global batch")  # fmt: skip
    return Schedule(units.pop() if units else TOKENS, tuple(stages))


def _threshold(text: str) -> tuple[str, int]:
    """(unit, value): steps for `500s`, tokens for a count with an optional suffix, no unit for 0."""
    steps = _STEPS.fullmatch(text)
    if steps:
        value = int(steps.group(1))
        return ("" if value == 0 else STEPS), value
    try:
        value = batch_tokens.parse_tokens(text) if text.strip("0") else 0
    except UserError:
        raise UserError(
            f"{FLAG}: threshold {text!r:.40} is neither tokens (2B, 500M, 1000000) nor steps (500s)"
        ) from None
    return ("" if value == 0 else TOKENS), value


def _batch(text: str, seq_len: int | None, most: int) -> int:
    """Sequences (`256`), or tokens with a suffix (`4M`) that make whole --seq-len sequences."""
    if _SEQUENCES.fullmatch(text):
        value = int(text)
        if not 1 <= value <= most:
            raise UserError(f"{FLAG}: batch {text} must be between 1 and {most:,} sequences")
        return value
    try:
        tokens = batch_tokens.parse_tokens(text)
    except UserError:
        raise UserError(f"{FLAG}: batch {text!r:.40} is neither sequences (256) nor tokens (4M)") from None
    if seq_len is None:
        raise UserError(f"{FLAG}: batch {text} is in tokens and needs --seq-len (N / --seq-len sequences)")
    count, extra = divmod(tokens, seq_len)
    if extra or count < 1:
        options = " or ".join(f"{g * seq_len}" for g in (count, count + 1) if g >= 1)
        raise UserError(f"{FLAG}: batch {text} ({tokens:,} tokens) is not a whole number of --seq-len {seq_len} "
                        f"sequences ({tokens / seq_len:.10g}); use {options} tokens")  # fmt: skip
    if count > most:
        raise UserError(f"{FLAG}: batch {text} is more than {most:,} sequences of --seq-len {seq_len}")
    return count


def layered(recipe_values: dict[str, Any], flags: dict[str, Any], recipe_path: Any) -> dict[str, Any]:
    """A schedule is a third way to give the batch: with --global-batch or --global-batch-tokens in one layer it
    is refused; a flag for any of them replaces the recipe's batch however the recipe gave it."""
    others = (batch_tokens.BATCH_KEY, batch_tokens.KEY)
    for key in others:
        if KEY in flags and key in flags:
            raise UserError(f"{FLAG} and --{key.replace('_', '-')} both given; pick one (the schedule gives "
                            "every stage's global batch)")  # fmt: skip
        if recipe_values.get(KEY) is not None and recipe_values.get(key) is not None:
            raise UserError(f"recipe {recipe_path}: keys {KEY} and {key} both given; keep one")
    if KEY in flags:
        recipe_values = {k: v for k, v in recipe_values.items() if k not in others}
    elif any(k in flags for k in others):
        recipe_values = {k: v for k, v in recipe_values.items() if k != KEY}
    return batch_tokens.layered(recipe_values, flags, recipe_path)


def problems(max_steps: int | None, max_tokens: Any, schedule: str | None, lr_rule: str) -> list[str]:
    """TrainConfig.validate's checks of the length in tokens and of the schedule's lr rule."""
    found = []
    if max_steps is not None and max_tokens is not None:
        found.append("--max-steps and --max-tokens both given; pick one")
    if lr_rule != LR_NONE and schedule is None:
        found.append(f"--batch-schedule-lr {lr_rule} needs --batch-schedule")
    if max_tokens is not None:
        try:
            parse_max_tokens(max_tokens)
        except UserError as exc:
            found.append(str(exc))
    return found


def of_config(cfg: Any) -> Schedule | None:
    """A TrainConfig's --batch-schedule (None without one)."""
    if cfg.batch_schedule is None:
        return None
    return parse(cfg.batch_schedule, cfg.seq_len, MOST)


def max_samples(max_tokens: Any, seq_len: int) -> int:
    """--max-tokens N as sequences of --seq-len (whole steps up to it run)."""
    return parse_max_tokens(max_tokens) // seq_len


def parse_max_tokens(value: Any) -> int:
    try:
        return batch_tokens.parse_tokens(value)
    except UserError as exc:
        raise UserError(str(exc).replace(batch_tokens.FLAG, "--max-tokens")) from None
