"""How the model is sharded: our flags, else the Accelerate config that launched us, else defaults.

`accelerate launch` exports its config as environment variables (ACCELERATE_MIXED_PRECISION,
ACCELERATE_USE_FSDP, FSDP_*). They are read through Accelerate's own parser,
`FullyShardedDataParallelPlugin`, never re-implemented. Accelerate does not apply FSDP on a
machine without CUDA (docs/ARCHITECTURE.md), so accum-train applies `fully_shard` itself everywhere and
only takes the settings. A setting it cannot honour is reported in one line, never ignored
silently.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from accum_cli.config.settings import TrainConfig
from accum_cli.errors import UserError

# `--compile` unset: the eager step measured last, at this step, decides (compile_pays); the
# first step includes one-time costs, so it is not the one measured.
COMPILE_DECIDED_AFTER = 2
# Compiling pays where it saves more time than it costs. Measured on the 2-core CPU: +12-14%
# tokens/s once compiled (bench-peers), 20-70 s for a cold compile per process (inductor builds
# C++), ~2 s with a warm cache. So `--compile` unset compiles when at least this much eager
# training remains: 10% of it is 2 min, twice the slowest cold compile seen. The environment
# variable ACCUM_TRAIN_COMPILE_AFTER_S sets another threshold (0: always).
COMPILE_PAYS_AFTER_S = 1200.0


def compile_pays(remaining_steps: int, step_seconds: float, threshold_s: float) -> bool:
    """Whether the rest of the run, at the eager step time measured, is long enough to compile."""
    return remaining_steps * step_seconds >= threshold_s


def compile_threshold(env) -> float:
    text = env.get("ACCUM_TRAIN_COMPILE_AFTER_S")
    if text is None:
        return COMPILE_PAYS_AFTER_S
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):
        raise UserError(f"ACCUM_TRAIN_COMPILE_AFTER_S must be a number of seconds >= 0, got {text!r}")
    return value


@dataclass(frozen=True, slots=True)
class ShardSettings:
    bf16: bool = False
    reshard_after_forward: bool = True
    offload_params: bool = False
    activation_checkpointing: bool = False
    rank0_loading: bool = False
    compile: bool = False  # each decoder layer's forward compiled (model.compile_layers)
    compile_auto: bool = False  # compiled once the first steps measure that it pays (compile_pays)
    compile_after_s: float = COMPILE_PAYS_AFTER_S  # ... when at least this much training remains
    source: str = "defaults"
    notes: tuple[str, ...] = field(default_factory=tuple)

    def describe(self, with_source: bool = True) -> str:
        parts = ["bf16 compute, fp32 master weights and gradient reduction" if self.bf16 else "fp32"]
        if not self.reshard_after_forward:
            parts.append("no reshard after forward")
        if self.offload_params:
            parts.append("params offloaded to CPU")
        if self.activation_checkpointing:
            parts.append("activation checkpointing")
        if self.rank0_loading:
            parts.append("weights loaded on rank 0 and broadcast")
        if self.compile:
            parts.append("decoder layers compiled")
        elif self.compile_auto:
            parts.append(f"decoder layers compiled if it pays (decided after step {COMPILE_DECIDED_AFTER})")
        return ", ".join(parts) + (f" (from {self.source})" if with_source else "")

    def as_flags(self) -> dict:
        """The settings as resolved (flags, else the accelerate config, else defaults), as the flags
        that give them: config.json records these, so `--recipe config.json` without the accelerate
        config trains the same. Compile left to the run's measurement stays unset: it decides again."""
        return {
            "precision": "bf16" if self.bf16 else "fp32",
            "reshard_after_forward": self.reshard_after_forward,
            "activation_checkpointing": self.activation_checkpointing,
            "offload_params": self.offload_params,
            "rank0_loading": self.rank0_loading,
            "compile": None if self.compile_auto else self.compile,
        }


def _truthy(value: str | None) -> bool:
    return str(value).strip().lower() in ("1", "true", "yes", "y", "on")


def resolve(cfg: TrainConfig, device_type: str) -> ShardSettings:
    env = os.environ
    notes: list[str] = []
    launched_by_accelerate = "ACCELERATE_MIXED_PRECISION" in env or _truthy(env.get("ACCELERATE_USE_FSDP"))
    bf16 = _precision(cfg, device_type, env, notes)
    fsdp = _accelerate_fsdp(notes) if _truthy(env.get("ACCELERATE_USE_FSDP")) else {}

    def pick(name: str, default: bool) -> bool:
        ours = getattr(cfg, name)
        return ours if ours is not None else fsdp.get(name, default)

    offload = pick("offload_params", False)
    if offload and device_type != "cuda":
        notes.append("offload_params has no effect on CPU: the parameters already live there")
        offload = False
    compiles = cfg.compile if cfg.compile is not None else _accelerate_compiles(env, notes)
    if compiles and cfg.lora_r is not None:
        raise UserError("--compile (or the accelerate config's dynamo backend) with --lora-r is not supported yet; "
                        "LoRA runs stay eager")  # fmt: skip
    return ShardSettings(
        bf16=bf16,
        reshard_after_forward=pick("reshard_after_forward", True),
        offload_params=offload,
        activation_checkpointing=pick("activation_checkpointing", False),
        rank0_loading=pick("rank0_loading", False),
        compile=compiles,
        compile_auto=cfg.compile is None and not compiles and cfg.lora_r is None,  # LoRA: eager (tested)
        compile_after_s=compile_threshold(env),
        source="flags and the accelerate config" if launched_by_accelerate else "flags and defaults",
        notes=tuple(notes),
    )


def _accelerate_compiles(env, notes: list[str]) -> bool:
    """`accelerate launch` with a dynamo config exports its backend; inductor is what we compile with."""
    backend = env.get("ACCELERATE_DYNAMO_BACKEND", "NO").upper()
    if backend == "NO":
        return False
    if backend != "INDUCTOR":
        notes.append(f"dynamo backend {backend.lower()} asked: accum-train compiles with inductor")
    return True


def _precision(cfg: TrainConfig, device_type: str, env, notes: list[str]) -> bool:
    """bf16 mixed precision (bf16 compute, fp32 master weights and gradient reduction) on any
    device; `auto` is the accelerate config's choice, else bf16 on CUDA and fp32 on CPU."""
    if cfg.precision in ("bf16", "fp32"):
        return cfg.precision == "bf16"
    requested = env.get("ACCELERATE_MIXED_PRECISION")
    if requested is None:
        return device_type == "cuda"
    from accelerate.utils import PrecisionType

    try:
        mode = PrecisionType(requested.lower())
    except ValueError:
        raise UserError(f"the accelerate config's mixed_precision {requested!r} is unknown; use bf16 or no") from None
    if mode == PrecisionType.NO:
        return False
    if mode == PrecisionType.BF16:
        return True
    fallback = "bf16" if device_type == "cuda" else "fp32"
    notes.append(f"mixed_precision {mode.value} is not supported (no loss scaling here): training in {fallback}")
    return device_type == "cuda"


def _accelerate_fsdp(notes: list[str]) -> dict[str, bool]:
    """The FSDP settings of the launching Accelerate config, parsed by Accelerate itself."""
    from accelerate.utils import FullyShardedDataParallelPlugin

    try:
        plugin = FullyShardedDataParallelPlugin()  # reads the FSDP_* variables the launcher set
    except (ValueError, KeyError) as exc:
        raise UserError(f"the accelerate config's FSDP settings are invalid: {exc}") from None
    if plugin.fsdp_version != 2:
        notes.append(f"fsdp_version {plugin.fsdp_version} asked: accum-train always shards with FSDP2 fully_shard")
    reshard = plugin.reshard_after_forward
    if not isinstance(reshard, bool):  # FSDP1 speaks in sharding strategies
        strategy = plugin.sharding_strategy if reshard is None else reshard
        name = getattr(strategy, "name", str(strategy))
        reshard = name != "SHARD_GRAD_OP"
        if name in ("NO_SHARD", "HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"):
            notes.append(f"sharding strategy {name}: use --replicas for HSDP; sharding fully")
    offload = plugin.cpu_offload
    offload = bool(getattr(offload, "offload_params", False)) or type(offload).__name__ == "CPUOffloadPolicy"
    return {
        "reshard_after_forward": reshard,
        "offload_params": offload,
        "activation_checkpointing": bool(plugin.activation_checkpointing),
        "rank0_loading": bool(plugin.cpu_ram_efficient_loading),
    }
