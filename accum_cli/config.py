"""The training configuration: defaults < recipe YAML < CLI flags, validated in one place."""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import yaml

from accum_cli import policy
from accum_cli.errors import UserError

LR_SCHEDULES = ("cosine", "constant")
PRECISIONS = ("auto", "bf16", "fp32")
NONFINITE_ACTIONS = ("abort", "skip")


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    model: str | None = None
    """Local folder written by save_pretrained, or a hub id. None: the embedded model."""
    dataset: str | None = None
    """A .txt/.jsonl/.json/.parquet file, a folder of them, or a hub id. None: embedded corpus."""
    dataset_config: str | None = None
    """Hub datasets: the configuration (subset) name."""
    split: str = "train"
    """Hub datasets: the split to train on."""
    text_column: str = "text"
    """Column holding raw text (ignored for pre-tokenised data with an input_ids column)."""
    packing: bool | None = None
    """Join documents with EOS and cut them into seq_len blocks. None: yes for plain text,
    no (one document per row, truncated to seq_len) for chat, prompt-completion and tokens."""
    train_on_prompt: bool = False
    """Chat and prompt-completion data: count every token in the loss, not only the answers."""
    eval_dataset: str | None = None
    """A dataset to evaluate on (same formats as --dataset)."""
    eval_split_ratio: float = 0.0
    """Hold out this share of the training sequences for evaluation (when no eval_dataset)."""
    eval_every: int | None = None
    """Evaluate every N optimizer steps (and at the end) when there is an eval set."""
    trust_remote_code: bool = False
    """Run code shipped with a model or dataset. Off unless asked."""
    seq_len: int | None = None
    """Tokens per sequence. None: 128 on the embedded corpus, else min(2048, model maximum)."""
    global_batch: int = 64
    """Sequences per optimizer step, summed over ranks and microbatches."""
    micro_batch: int | str = 8
    """Sequences per forward/backward on one rank, or "auto": the largest that the memory estimate fits."""
    strict_batch: bool = False
    """Refuse a global batch that is not a multiple of micro_batch x world size."""
    max_steps: int | None = None
    """Optimizer steps. None: one pass over the data (`epochs`)."""
    epochs: float = 1.0
    """Passes over the data when max_steps is not given."""
    lr: float = 1e-3
    """Peak learning rate."""
    warmup_steps: int = 5
    """Linear warmup from lr/warmup_steps to lr."""
    lr_schedule: str = "cosine"
    """cosine (decay to min_lr_ratio x lr at the last step) or constant."""
    min_lr_ratio: float = 0.1
    """Final learning rate of the cosine schedule, as a share of lr."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay, applied to matrices only (not norms or biases)."""
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    grad_clip: float = 1.0
    """Clip the global gradient L2 norm to this value; 0 disables clipping."""
    seed: int = 0
    """Seeds the data order and the initial weights of a model trained from its config."""
    sync: str = policy.AUTO
    """When gradients are reduced: auto, every, last, last-keep-params."""
    precision: str = "auto"
    """auto (the accelerate config's mixed_precision if launched by it, else bf16 on CUDA and
    fp32 on CPU), bf16 (bf16 params, fp32 gradient reduction) or fp32."""
    replicas: int = 1
    """HSDP: data-parallel replicas; each shards the model over world_size / replicas ranks."""
    reshard_after_forward: bool | None = None
    """Free gathered parameters after forward (None: the accelerate config's, else True)."""
    activation_checkpointing: bool | None = None
    """Recompute decoder-layer activations in backward (None: the accelerate config's, else False)."""
    offload_params: bool | None = None
    """CUDA only: keep sharded parameters and optimizer state in CPU memory (None: accelerate config's)."""
    rank0_loading: bool | None = None
    """Load the weights on rank 0 only and broadcast them; Accelerate's fsdp_cpu_ram_efficient_loading."""
    device_memory_gib: float | None = None
    """Memory per rank the auto sync policy may plan with. None: read it from the device."""
    checkpoint_every: int | None = None
    """Write a sharded checkpoint every N optimizer steps (always at the end and on SIGTERM/SIGINT)."""
    keep_checkpoints: int = 2
    """Keep the latest K checkpoints."""
    on_nonfinite: str = "abort"
    """A NaN/inf loss or gradient norm: abort (exit 3, last checkpoint untouched) or skip the step."""
    output_dir: str = "runs/accum-train"
    """Where metrics.jsonl, config.json and final/ are written."""
    overwrite: bool = False
    """Start afresh in an output dir that holds a previous accum-train run (only its own files are removed)."""
    allow_data_change: bool = False
    """Resume although the data, its preparation or its order (seed, eval split) changed since the checkpoint."""

    def validate(self) -> TrainConfig:
        """Collect every problem, then raise once naming them all."""
        problems: list[str] = []
        if isinstance(self.micro_batch, str) and self.micro_batch != "auto":
            if self.micro_batch.strip().lstrip("-").isdigit():
                self.micro_batch = int(self.micro_batch)  # from the command line, where auto is also allowed
            else:
                problems.append(f"--micro-batch must be a positive integer or auto, got {self.micro_batch!r}")
                self.micro_batch = 1
        for name in ("global_batch", "micro_batch", "warmup_steps", "seed", "replicas"):
            if name == "micro_batch" and self.micro_batch == "auto":
                continue
            minimum = 0 if name in ("warmup_steps", "seed") else 1
            if getattr(self, name) < minimum:
                problems.append(f"--{_flag(name)} must be >= {minimum}, got {getattr(self, name)}")
        if self.seq_len is not None and self.seq_len < 2:
            problems.append(f"--seq-len must be >= 2 tokens, got {self.seq_len}")
        if self.max_steps is not None and self.max_steps < 1:
            problems.append(f"--max-steps must be >= 1, got {self.max_steps}")
        if not (self.epochs > 0 and math.isfinite(self.epochs)):
            problems.append(f"--epochs must be a positive number, got {self.epochs}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            problems.append(f"--lr must be a positive number, got {self.lr}")
        for name in ("weight_decay", "grad_clip", "adam_eps"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                problems.append(f"--{_flag(name)} must be >= 0, got {value}")
        for name in ("adam_beta1", "adam_beta2", "min_lr_ratio"):
            if not 0 <= getattr(self, name) <= 1:
                problems.append(f"{name} must lie in [0, 1], got {getattr(self, name)}")
        choices = (("sync", policy.POLICIES), ("lr_schedule", LR_SCHEDULES), ("precision", PRECISIONS))
        for name, allowed in choices:
            if getattr(self, name) not in allowed:
                problems.append(f"--{_flag(name)} {getattr(self, name)!r} is unknown; use one of: {', '.join(allowed)}")
        if self.device_memory_gib is not None and self.device_memory_gib <= 0:
            problems.append(f"--device-memory-gib must be positive, got {self.device_memory_gib}")
        if not 0 <= self.eval_split_ratio < 1:
            problems.append(f"--eval-split-ratio must lie in [0, 1), got {self.eval_split_ratio}")
        if self.eval_dataset and self.eval_split_ratio:
            problems.append("--eval-dataset and --eval-split-ratio both given; pick one")
        if self.eval_every is not None and self.eval_every < 1:
            problems.append(f"--eval-every must be >= 1, got {self.eval_every}")
        if self.checkpoint_every is not None and self.checkpoint_every < 1:
            problems.append(f"--checkpoint-every must be >= 1, got {self.checkpoint_every}")
        if self.keep_checkpoints < 1:
            problems.append(f"--keep-checkpoints must be >= 1, got {self.keep_checkpoints}")
        if self.on_nonfinite not in NONFINITE_ACTIONS:
            problems.append(
                f"--on-nonfinite {self.on_nonfinite!r} is unknown; use one of: {', '.join(NONFINITE_ACTIONS)}"
            )
        if self.sync == policy.HSDP_DEFER and self.replicas < 2:
            problems.append("--sync hsdp-defer needs --replicas 2 or more (a 2-D mesh)")
        if problems:
            raise UserError("; ".join(problems))
        return self

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _flag(name: str) -> str:
    return name.replace("_", "-")


FIELD_NAMES = tuple(f.name for f in fields(TrainConfig))


def load_recipe(path: str | Path) -> dict[str, Any]:
    """Read a recipe YAML into checked overrides: unknown keys and wrong types are errors."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"recipe {path} does not exist; pass an existing YAML file to --recipe")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        line = f" (line {where.line + 1})" if where else ""
        raise UserError(f"recipe {path} is not valid YAML{line}; fix its syntax") from None
    if not isinstance(raw, dict):
        raise UserError(f"recipe {path} must be a mapping of option: value")
    overrides = {}
    for key, value in raw.items():
        name = str(key).replace("-", "_")
        if name not in FIELD_NAMES:
            raise UserError(f"recipe {path}: unknown key {key!r}; known keys: {', '.join(FIELD_NAMES)}")
        overrides[name] = _checked(name, value, f"recipe {path}: key {key!r}")
    return overrides


_TYPES = typing.get_type_hints(TrainConfig)


def _checked(name: str, value: Any, where: str) -> Any:
    """Coerce ints to floats where a float is expected; reject every other mismatch."""
    hint = _TYPES[name]
    allowed = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    if value is None and type(None) in allowed:
        return None
    if float in allowed and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    for kind in allowed:
        if kind is not type(None) and type(value) is kind:
            return value
    wanted = " or ".join(k.__name__ for k in allowed if k is not type(None))
    raise UserError(f"{where} must be {wanted}, got {type(value).__name__} {value!r}")


def build_config(recipe: str | None, cli_overrides: dict[str, Any]) -> TrainConfig:
    """Defaults < recipe < CLI flags (a flag the user did not give is None and overrides nothing)."""
    values = load_recipe(recipe) if recipe else {}
    values.update({k: v for k, v in cli_overrides.items() if v is not None})
    return TrainConfig(**values).validate()
