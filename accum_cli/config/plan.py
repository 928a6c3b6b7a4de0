"""Batch arithmetic: (global batch G, micro batch m, world size W) -> the plan.

Pure Python, no torch: the plan is property-tested and printed by `--plan` on a laptop.

The rules (docs/ARCHITECTURE.md, invariant 2):
- a step uses exactly G samples, the global samples [k*G, (k+1)*G) of the seeded order;
- rank r reads a contiguous block of that range; ranks take floor(G/W) or ceil(G/W)
  samples (the first G mod W ranks take one more);
- every rank runs the same number of microbatches A = ceil(ceil(G/W) / m), because FSDP's
  collectives must match across ranks; microbatches are full (m) except the last, which may
  be smaller or, on a rank with one sample fewer, empty (it then runs a zero-weight pass).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from accum_cli.errors import UserError


@dataclass(frozen=True, slots=True)
class Plan:
    global_batch: int
    micro_batch: int
    world_size: int

    def __post_init__(self) -> None:
        for name in ("global_batch", "micro_batch", "world_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                flag = "--" + name.replace("_", "-")
                raise UserError(f"{flag} must be a positive integer, got {value!r}")
        if self.global_batch < self.world_size:
            raise UserError(
                f"--global-batch {self.global_batch} is smaller than the world size "
                f"{self.world_size}: every rank needs at least one sequence; "
                f"use --global-batch {self.world_size} or more, or fewer processes"
            )

    @property
    def max_rank_samples(self) -> int:
        return -(-self.global_batch // self.world_size)

    @property
    def accum_steps(self) -> int:
        """Forward/backward passes per rank per optimizer step (the same on every rank)."""
        return -(-self.max_rank_samples // self.micro_batch)

    @property
    def divisible(self) -> bool:
        return self.global_batch % (self.micro_batch * self.world_size) == 0

    def rank_samples(self, rank: int) -> int:
        base, extra = divmod(self.global_batch, self.world_size)
        return base + (1 if rank < extra else 0)

    def rank_offset(self, rank: int) -> int:
        """Position of rank's first sample inside the step's G samples."""
        base, extra = divmod(self.global_batch, self.world_size)
        return rank * base + min(rank, extra)

    def microbatch_sizes(self, rank: int) -> list[int]:
        return [self.microbatch_size(rank, micro) for micro in range(self.accum_steps)]

    def microbatch_size(self, rank: int, micro: int) -> int:
        """Every microbatch but a rank's last is full; the last takes the rest (maybe none)."""
        last = self.accum_steps - 1
        return self.micro_batch if micro < last else self.rank_samples(rank) - self.micro_batch * last

    def describe_sizes(self, rank: int) -> str:
        """A rank's microbatch sizes as a list, shortened where it is long: [4 x 998, 2]."""
        if self.accum_steps <= 8:
            return str(self.microbatch_sizes(rank))
        last = self.microbatch_size(rank, self.accum_steps - 1)
        return f"[{self.micro_batch} x {self.accum_steps - 1}, {last}]"

    def microbatch_range(self, step: int, rank: int, micro: int, first_sample: int | None = None) -> range:
        """Global sample indices read by `rank` in microbatch `micro` of optimizer step `step`.

        A step starts at global sample step*G, or at `first_sample` when a resumed run
        continues from a data position saved under another global batch."""
        if not 0 <= micro < self.accum_steps:
            raise ValueError(f"microbatch {micro} outside 0..{self.accum_steps - 1}")
        step_start = step * self.global_batch if first_sample is None else first_sample
        start = step_start + self.rank_offset(rank) + micro * self.micro_batch
        return range(start, start + self.microbatch_size(rank, micro))

    def nearest_valid_global_batches(self) -> tuple[int, int]:
        unit = self.micro_batch * self.world_size
        below = max(unit, self.global_batch // unit * unit)
        above = -(-self.global_batch // unit) * unit
        return below, above

    def valid_micro_batches(self) -> list[int]:
        """Micro batches that divide this G evenly at this world size (for --strict-batch)."""
        if self.global_batch % self.world_size:
            return []
        per_rank = self.global_batch // self.world_size
        small = [m for m in range(1, math.isqrt(per_rank) + 1) if per_rank % m == 0]  # O(sqrt G): G may be huge
        return sorted({*small, *(per_rank // m for m in small)})

    def require_divisible(self) -> None:
        """--strict-batch: refuse a G that is not a multiple of m*W, suggesting the nearest fixes."""
        if self.divisible:
            return
        below, above = self.nearest_valid_global_batches()
        micro = [m for m in self.valid_micro_batches() if m <= self.micro_batch]
        hint = f"--global-batch {below} or {above}" if below != above else f"--global-batch {above}"
        if micro:
            hint += f", or --micro-batch {micro[-1]}"
        raise UserError(
            f"--strict-batch: global batch {self.global_batch} is not a multiple of "
            f"micro batch x world size = {self.micro_batch} x {self.world_size}; use {hint}"
        )

    def tokens_per_step(self, seq_len: int, packed: bool = True) -> str:
        """Packed blocks fill every position; rows are padded per microbatch, so seq len is a bound."""
        bound = f"{self.global_batch * seq_len:,} ({self.global_batch} x seq len {seq_len})"
        return bound if packed else f"at most {bound}: rows are as long as they are"

    @property
    def has_empty_microbatch(self) -> bool:
        return any(self.microbatch_size(rank, self.accum_steps - 1) == 0 for rank in range(self.world_size))

    def summary(self, seq_len: int, packed: bool = True) -> list[str]:
        """The run header's two plan lines; describe() has them all (--plan, --verbose)."""
        g, m, w, a = self.global_batch, self.micro_batch, self.world_size, self.accum_steps
        ranks = f"{w} rank{'s' if w > 1 else ''}"
        if self.divisible:
            split = f"{a} microbatch{'es' if a > 1 else ''} of {m} on each of {ranks}"
        else:
            counts = " or ".join(str(n) for n in sorted({self.rank_samples(r) for r in range(w)}, reverse=True))
            split = (
                f"{a} microbatch{'es' if a > 1 else ''} of at most {m} on each of {ranks}, taking {counts} sequences: "
                f"{g} is not a multiple of m x W = {m * w}, and the loss stays exact"
            )
        return [
            f"global batch      {g} sequences per optimizer step, tokens {self.tokens_per_step(seq_len, packed)}",
            f"accumulation      {split}",
        ]

    def describe(self, seq_len: int | None = None, packed: bool = True) -> list[str]:
        """Human-readable plan lines (printed by rank 0 and by --plan)."""
        g, m, w, a = self.global_batch, self.micro_batch, self.world_size, self.accum_steps
        lines = [
            f"global batch      {g} sequences per optimizer step",
            f"world size        {w} rank{'s' if w > 1 else ''}",
            f"micro batch       {m} sequences per forward/backward",
            f"accumulation      {a} microbatch{'es' if a > 1 else ''} per rank per step",
        ]
        if seq_len:
            lines.append(f"tokens per step   {self.tokens_per_step(seq_len, packed)}")
        counts = sorted({self.rank_samples(r) for r in range(w)}, reverse=True)
        lines.append(f"per rank          {' or '.join(map(str, counts))} sequences per step")
        if self.divisible:
            lines.append(f"microbatches      all full: {a} x {m} on every rank")
            return lines
        base, extra = divmod(g, w)
        sizes_hi, sizes_lo = self.describe_sizes(0), self.describe_sizes(w - 1)
        lines.append(
            f"not divisible     G={g} is not a multiple of m x W = {m * w}: the step still uses exactly {g} sequences"
        )
        if extra:
            lines.append(
                f"                  ranks 0-{extra - 1} take {base + 1}, ranks {extra}-{w - 1} take "
                f"{base}; microbatch sizes {sizes_hi} / {sizes_lo}"
            )
        else:
            lines.append(f"                  every rank takes {base}; microbatch sizes {sizes_hi}")
        empty = "; an empty microbatch runs a zero-weight pass" if self.has_empty_microbatch else ""
        lines.append(f"                  the loss stays exact (normalised by the global loss-token count){empty}")
        below, above = self.nearest_valid_global_batches()
        lines.append(f"                  nearest divisible global batches: {below}, {above}")
        return lines


def usable_micro_batch(micro_batch: int, global_batch: int, world_size: int) -> int:
    """A micro batch above a rank's largest share of the step is that share: no microbatch ever
    holds more, so neither the plan nor the memory estimate should assume it does."""
    return min(micro_batch, -(-global_batch // world_size))
