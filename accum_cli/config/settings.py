"""The training configuration, declared once: defaults < recipe < CLI flags, validated in one place.

Each field of `TrainConfig` carries its help text, its `--help` panel, what None means, its
choices and its bounds as field metadata (`option(...)`). Everything else derives from it:
the Typer flags and their help (options.py), the recipe keys and their types, the bounds
checks, `--print-config` and the `config.json` a run saves. A dataclass rather than pydantic:
no new dependency, the one-line messages stay ours (`--lr must be a positive number, got
-1`), and the metadata is plain data a test can enumerate.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import sys
import types
import typing
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from accum_cli.config import batch_schedule as schedules
from accum_cli.config import batch_tokens, policy, recipe
from accum_cli.config.fields import (
    BATCH,
    CHECKPOINTS,
    FP32_TINY,
    LAUNCH,
    LORA,
    MODEL_DATA,
    OPTIMISATION,
    OUTPUT,
    PANELS,
    option,
    out_of_bounds,
)
from accum_cli.errors import UserError

LR_SCHEDULES = ("cosine", "constant")
PRECISIONS = ("auto", "bf16", "fp32")
NONFINITE_ACTIONS = ("abort", "skip")
EXPORT_DTYPES = ("auto", "fp32", "bf16", "fp16")
MOE_AUX_LOSSES = ("exact", "microbatch")  # moe.py
ATTENTION_IMPLEMENTATIONS = ("sdpa", "eager", "flex_attention", "flash_attention_2", "flash_attention_3")
# --resume's words (a command flag, not a config field: it says how this invocation treats the
# output dir, and a saved config must reproduce the run from scratch).
RESUME_LATEST = "latest"  # `--resume` alone: the newest checkpoint, which must exist
# Where the model lives (memory/layout.py chooses for auto): sharded by FSDP2, or whole on every rank.
LAYOUT_AUTO, SHARD, REPLICATE = "auto", "shard", "replicate"
LAYOUTS = (LAYOUT_AUTO, SHARD, REPLICATE)

RESUME_AUTO = "auto"  # the newest checkpoint if there is one, else a fresh start
SEED_MAX = 2**64 - 1  # torch.manual_seed takes a uint64; numpy's default_rng any non-negative int
MAX_GLOBAL_BATCH = 2**40  # far past any real step; the plan's arithmetic (--strict-batch: O(sqrt G)) stays instant
DEFAULT_WARMUP_STEPS = 5  # --warmup-steps and --warmup-ratio unset

# The top level of a run's config.json, as run/record.py `run_record_of` writes it: only "config" is read.
RUN_RECORD_KEYS = ("config", "plan", "resumed_from")


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    # Model & data
    model: str | None = option(None, "Model folder (save_pretrained) or hub id.", MODEL_DATA,
                               none_means="the embedded tiny Llama")  # fmt: skip
    dataset: str | None = option(None, "A .txt/.jsonl/.json/.parquet file, a folder of them, or a hub id.",
                                 MODEL_DATA, none_means="the embedded corpus")  # fmt: skip
    dataset_config: str | None = option(None, "Hub datasets: configuration (subset) name.", MODEL_DATA,
                                        none_means="the dataset's default")  # fmt: skip
    split: str = option(
        "train", "The split to train on: a hub dataset's, or a local folder's split by its file names.", MODEL_DATA
    )
    text_column: str = option("text", "Column with raw text (not used for input_ids data).", MODEL_DATA)
    packing: bool | None = option(
        None, "Text: join documents with EOS into --seq-len blocks. Chat, prompt-completion, tokens: place whole rows "
        "into --seq-len sequences, each row attending to itself only (needs a model that takes position ids). "
        "--no-packing: one document per row (truncated, padded).",
        MODEL_DATA, none_means="packing for text, rows for chat/prompt-completion/tokens",
    )  # fmt: skip
    document_masking: bool = option(False, "Packed text: each document attends within itself only (position ids "
                                    "restart after each EOS; changes the training).", MODEL_DATA)  # fmt: skip
    train_on_prompt: bool = option(False, "Chat and prompt-completion data: count every token, not only the answers.",
                                   MODEL_DATA)  # fmt: skip
    chat_eos: bool = option(False, "Chat data: end each assistant turn whose tokens hold no EOS with the tokenizer's "
                            "EOS, counted in the loss (prompt-completion rows always get one).", MODEL_DATA)  # fmt: skip
    eval_dataset: str | None = option(None, "Dataset to evaluate on (same formats as --dataset).", MODEL_DATA,
                                      none_means="none")  # fmt: skip
    eval_split_ratio: float = option(0.0, "Hold out this share of the training sequences for evaluation.",
                                     MODEL_DATA, ge=0, lt=1)  # fmt: skip
    eval_every: int | None = option(None, "Evaluate every N optimizer steps (and at the end).", MODEL_DATA,
                                    none_means="at the end", ge=1)  # fmt: skip
    num_proc: int | None = option(None, "Worker processes that tokenise a big corpus.", MODEL_DATA,
                                  none_means="the CPU cores this process may use", ge=1, le=1024)  # fmt: skip
    streaming: bool = option(False, "Read the dataset as a stream, tokenised and packed on the fly, instead of "
                             "preparing it ahead (needs --max-steps; see docs/DATA.md).", MODEL_DATA)  # fmt: skip
    shuffle_buffer: int = option(10000, "--streaming: samples held in the seeded shuffle buffer; 0 keeps the "
                                 "stream's order.", MODEL_DATA, ge=0)  # fmt: skip
    trust_remote_code: bool = option(False, "Run code shipped with the model or dataset.", MODEL_DATA)
    attn_implementation: str | None = option(
        None, "Attention kernel, checked against the model class and device before any work.", MODEL_DATA,
        none_means="sdpa where the model class supports it, else its own default (eager)",
        choices=ATTENTION_IMPLEMENTATIONS,
    )  # fmt: skip
    seq_len: int | None = option(None, "Tokens per sequence.", MODEL_DATA,
                                 none_means="128 on the embedded corpus, else min(2048, model maximum)",
                                 ge=2)  # fmt: skip
    # Batch
    global_batch: int = option(64, "Sequences per optimizer step, over all ranks and microbatches.", BATCH, ge=1,
                               le=MAX_GLOBAL_BATCH)  # fmt: skip
    global_batch_tokens: str | int | None = option(
        None, "The global batch in tokens per optimizer step, N / --seq-len sequences (needs --seq-len); K, M, B "
        "are decimal: 4M is 4,000,000.", BATCH, none_means="--global-batch",
    )  # fmt: skip
    batch_schedule: str | None = option(
        None, "A global batch that grows: stages THRESHOLD:BATCH, e.g. \"0:256,2B:512\" (from 2e9 tokens trained, "
        "512 sequences); thresholds in tokens (K, M, B) or steps (500s), batches in sequences or tokens (4M); see "
        "docs/PRETRAINING.md.", BATCH, none_means="--global-batch",
    )  # fmt: skip
    batch_schedule_lr: str = option("none", "--batch-schedule: sqrt multiplies the lr by the square root of each "
                                    "increase of the batch (as OLMo-core); none leaves it.", BATCH,
                                    choices=schedules.LR_CHOICES)  # fmt: skip
    micro_batch: str | int = option(8, "Sequences per forward/backward on one rank, or auto: the most that fit "
                                    "(from the memory estimate).", BATCH, ge=1)  # fmt: skip
    strict_batch: bool = option(False, "Refuse a global batch that is not a multiple of micro batch x world size.",
                                BATCH)  # fmt: skip
    max_steps: int | None = option(None, "Optimizer steps.", BATCH, none_means="--epochs passes over the data", ge=1)
    max_tokens: str | int | None = option(
        None, "Train the whole optimizer steps that fit in N tokens (sequences x --seq-len; K, M, B are decimal).",
        BATCH, none_means="--max-steps, else --epochs",
    )  # fmt: skip
    epochs: float = option(1.0, "Passes over the data when --max-steps is not given.", BATCH, gt=0, le=1_000_000)
    sync: str = option(policy.AUTO, "When gradients are reduced across ranks (see docs/MEMORY.md).", BATCH,
                       choices=policy.POLICIES)  # fmt: skip
    device_memory_gib: float | None = option(None, "Memory per rank the auto sync policy may plan with.", BATCH,
                                             none_means="read from the device", gt=0, le=2**30)  # fmt: skip
    # Optimisation
    lr: float | None = option(None, "Peak learning rate.", OPTIMISATION, gt=0,
                              none_means="2e-5 for pretrained weights, 1e-3 for a model built from its config")  # fmt: skip
    warmup_steps: int | None = option(
        None,
        "Linear warmup steps (from lr/warmup_steps to lr).",
        OPTIMISATION,
        none_means=f"{DEFAULT_WARMUP_STEPS}, or --warmup-ratio",
        ge=0,
    )
    warmup_ratio: float | None = option(
        None,
        "Linear warmup as a share of the run's optimizer steps (rounded up).",
        OPTIMISATION,
        none_means="--warmup-steps",
        ge=0,
        lt=1,
    )
    lr_schedule: str = option("cosine", "cosine (decays to --min-lr-ratio x lr at the last step) or constant.",
                              OPTIMISATION, choices=LR_SCHEDULES)  # fmt: skip
    min_lr_ratio: float = option(0.1, "Final learning rate of the cosine schedule, as a share of lr.", OPTIMISATION,
                                 ge=0, le=1)  # fmt: skip
    weight_decay: float = option(0.1, "AdamW decoupled weight decay, on matrices only (not norms or biases).",
                                 OPTIMISATION, ge=0)  # fmt: skip
    adam_beta1: float = option(0.9, "AdamW beta1.", OPTIMISATION, ge=0, lt=1)
    adam_beta2: float = option(0.95, "AdamW beta2.", OPTIMISATION, ge=0, lt=1)
    adam_eps: float = option(
        1e-8, "AdamW epsilon.", OPTIMISATION, ge=FP32_TINY,
        why="smaller values are 0 or subnormal in fp32, where AdamW's update is 0/0 (NaN) for every weight whose "
        "gradient is 0 (a token the data never holds): use 1e-8, the usual value",
    )  # fmt: skip
    grad_clip: float = option(1.0, "Max global gradient L2 norm; 0 disables clipping.", OPTIMISATION, ge=0)
    seed: int = option(0, "Seed of the data order, of dropout and of the weights of a model built from its config.",
                       OPTIMISATION, ge=0, le=SEED_MAX)  # fmt: skip
    moe_aux_loss: str = option(
        "exact", "Mixture-of-experts router balancing loss (when the model config asks for it): exact (the step's "
        "expert choices counted first in one extra forward without gradient) or microbatch (each microbatch's own, "
        "weighted by its token share: approximate under accumulation).", OPTIMISATION, choices=MOE_AUX_LOSSES,
    )  # fmt: skip
    on_nonfinite: str = option("abort", "A NaN/inf loss or grad norm: abort (exit 3) or skip the step.",
                               OPTIMISATION, choices=NONFINITE_ACTIONS)  # fmt: skip
    # LoRA (model/lora.py, docs/LORA.md)
    lora_r: int | None = option(None, "Train LoRA adapters of this rank on the frozen model, through peft (pip install "
                                "'accum-train[lora]').", LORA, none_means="no: every parameter trains", ge=1)  # fmt: skip
    lora_alpha: float | None = option(None, "LoRA scaling: the update is alpha / r x B A.", LORA,
                                      none_means="2 x --lora-r", gt=0)  # fmt: skip
    lora_dropout: float = option(0.0, "Dropout on the input of the LoRA branch.", LORA, ge=0, lt=1)
    lora_target_modules: str = option("all-linear", "Modules to adapt: all-linear (every linear layer of the decoder "
                                      "blocks, not the output layer) or names, comma-separated (q_proj,v_proj).",
                                      LORA)  # fmt: skip
    # Checkpoints
    checkpoint_every: int | None = option(
        None, "Write a sharded checkpoint every N optimizer steps.", CHECKPOINTS,
        none_means="only at the end and on SIGTERM/SIGINT", ge=1,
    )  # fmt: skip
    keep_checkpoints: int = option(2, "Keep the latest K checkpoints.", CHECKPOINTS, ge=1)
    allow_data_change: bool = option(
        False, "Resume although the data, its preparation or its order (seed, eval split) changed since the "
        "checkpoint (the training then differs).", CHECKPOINTS,
    )  # fmt: skip
    # Launch: how the model sits on the devices (the training is the same whatever they are)
    precision: str = option("auto", "bf16 (bf16 params, fp32 gradient reduction) or fp32; auto: the accelerate "
                            "config's, else bf16 on CUDA and fp32 on CPU.", LAUNCH, choices=PRECISIONS)  # fmt: skip
    layout: str = option("auto", "shard (FSDP2) or replicate (the whole state on every rank, one all-reduce per "
                         "step); auto: replicate where its estimated peak memory fits the budget, else shard.", LAUNCH,
                         choices=LAYOUTS)  # fmt: skip
    replicas: int = option(1, "HSDP: model replicas, each sharded over world size / replicas ranks.", LAUNCH, ge=1)
    reshard_after_forward: bool | None = option(None, "Free gathered parameters after forward.", LAUNCH,
                                                none_means="the accelerate config's, else yes")  # fmt: skip
    activation_checkpointing: bool | None = option(None, "Recompute decoder-layer activations in backward.", LAUNCH,
                                                   none_means="the accelerate config's, else no")  # fmt: skip
    compile: bool | None = option(None, "torch.compile each decoder layer's forward (regional: a short compile, "
                                  "hooks stay eager); the same training up to fp32 rounding.", LAUNCH,
                                  none_means="the accelerate config's dynamo backend, else auto: on from "
                                  "step 3 when the steps measured say 20 min or more of training remain")  # fmt: skip
    offload_params: bool | None = option(None, "CUDA only: keep sharded parameters and optimizer state in CPU memory.",
                                         LAUNCH, none_means="the accelerate config's, else no")  # fmt: skip
    rank0_loading: bool | None = option(None, "Load the weights on rank 0 only and broadcast them.", LAUNCH,
                                        none_means="the accelerate config's, else no")  # fmt: skip
    # Output
    output_dir: str = option("runs/accum-train", "Where metrics.jsonl, config.json, checkpoints/ and final/ go.",
                             OUTPUT)  # fmt: skip
    overwrite: bool = option(False, "Start afresh in an output dir that holds a previous accum-train run (only its "
                             "own files are removed).", OUTPUT)  # fmt: skip
    report_to: str = option("none", "Experiment trackers, comma-separated: tensorboard, wandb, mlflow, trackio, ...; "
                            "all (every installed one) or none.", OUTPUT)  # fmt: skip
    run_name: str | None = option(None, "The trackers' run name.", OUTPUT,
                                  none_means="the output dir's name (the same on every restart)")  # fmt: skip
    log_every: int | None = option(None, "Print a console line every N optimizer steps (metrics.jsonl has all).",
                                   OUTPUT, none_means="about 20 lines per run", ge=1)  # fmt: skip
    verbose: bool = option(False, "Print every detail of the plan and the run before the first step (config.json "
                           "holds them all too).", OUTPUT)  # fmt: skip
    export_dtype: str = option("auto", "dtype of final/ (training keeps fp32 master weights); auto: the dtype the "
                               "model's config declares, fp32 if none.", OUTPUT, choices=EXPORT_DTYPES)  # fmt: skip
    sample_prompts: str | None = option(
        None, "Prompts to complete greedily as the model trains, into samples.jsonl and the trackers: one per line, "
        'or in a .jsonl file one {"messages": [...]} per line (chat turns, with the chat template).', OUTPUT,
        none_means="no samples",
    )  # fmt: skip
    sample_every: int | None = option(None, "--sample-prompts: complete them every N optimizer steps (and at the end).",
                                      OUTPUT, none_means="at the end", ge=1)  # fmt: skip
    sample_tokens: int = option(32, "--sample-prompts: tokens per completion (greedy, always this many).", OUTPUT, ge=1)

    def validate(self) -> TrainConfig:
        """Collect every problem, then raise once naming them all."""
        if isinstance(self.micro_batch, str) and self.micro_batch != "auto":  # a flag's text: a number or auto
            text = self.micro_batch.strip()
            self.micro_batch = int(text) if re.fullmatch(r"[-+]?[0-9]+", text) else self.micro_batch
        problems = [p for f in fields(self) if (p := out_of_bounds(f, getattr(self, f.name)))]
        # "" from an unset shell variable: never taken for the default (no tracker, a run named after its folder)
        for name in ("model", "dataset", "eval_dataset", "text_column", "dataset_config", "split", "run_name",
                     "report_to", "sample_prompts", "lora_target_modules"):  # fmt: skip
            value = getattr(self, name)
            if isinstance(value, str) and not value.strip():
                problems.append(f"{flag(name)} is empty; pass a value or leave the flag out")
        if isinstance(self.micro_batch, str) and self.micro_batch != "auto":
            problems.append(f"--micro-batch must be a positive integer or auto, got {recipe.quote(self.micro_batch)}")
        if self.warmup_steps is not None and self.warmup_ratio is not None:
            problems.append("--warmup-steps and --warmup-ratio both given; pick one")
        if self.eval_dataset and self.eval_split_ratio:
            problems.append("--eval-dataset and --eval-split-ratio both given; pick one")
        if self.streaming and self.max_steps is None and self.max_tokens is None:
            problems.append("--streaming needs --max-steps N (or --max-tokens N): a stream has no known length to "
                            "count --epochs in")  # fmt: skip
        problems += schedules.problems(self.max_steps, self.max_tokens, self.batch_schedule, self.batch_schedule_lr)
        if self.streaming and self.document_masking:
            problems.append("--document-masking needs prepared data; it is not available with --streaming")
        if self.streaming and self.eval_split_ratio:
            problems.append("--eval-split-ratio cannot hold out part of a stream; pass --eval-dataset with --streaming")
        if self.sample_every is not None and self.sample_prompts is None:
            problems.append("--sample-every needs --sample-prompts FILE: the prompts to complete")
        if self.lora_r is None and self.lora_alpha is not None:
            problems.append("--lora-alpha needs --lora-r R: the rank of the adapters to train")
        if self.sync == policy.HSDP_DEFER and self.replicas < 2:
            problems.append("--sync hsdp-defer needs --replicas 2 or more (a 2-D mesh)")
        if problems:
            raise UserError("; ".join(problems))
        return self

    def warmup_for(self, total_steps: int) -> int:
        """The warmup in optimizer steps of a run of `total_steps`: --warmup-ratio rounds up, as
        transformers' Trainer does, so a ratio above 0 warms up for at least one step."""
        if self.warmup_ratio is not None:
            return math.ceil(self.warmup_ratio * total_steps)
        return DEFAULT_WARMUP_STEPS if self.warmup_steps is None else self.warmup_steps

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


FIELDS = {f.name: f for f in fields(TrainConfig)}
FIELD_NAMES = tuple(FIELDS)
TYPES = typing.get_type_hints(TrainConfig)


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def base_type(name: str) -> type:
    """int for `int | None`, and so on."""
    hint = TYPES[name]
    kinds = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    return next(k for k in kinds if k is not type(None))


def default_text(name: str) -> str:
    """The default as --help shows it: the value, or what None means."""
    f = FIELDS[name]
    if f.default is None:
        return f.metadata["none_means"]
    if isinstance(f.default, bool):
        return "yes" if f.default else "no"
    return f"{f.default:g}" if isinstance(f.default, float) else str(f.default)


def load_recipe(path: str | Path) -> dict[str, Any]:
    """Read a recipe (YAML, or a run's config.json) into checked overrides: unknown keys and
    wrong types are errors, each named in one line."""
    path = Path(path).expanduser()
    raw = recipe.read_mapping(path)
    if isinstance(raw.get("config"), dict) and "plan" in raw:  # a run's config.json: its resolved config
        # Anything else up here (`lr: 5.0` beside "config", an edit in the wrong place) would be
        # ignored: refused, as an unknown key of a recipe is.
        for key in raw:
            if key not in RUN_RECORD_KEYS:
                raise UserError(
                    f"recipe {path}: unknown top-level key {recipe.quote(key)} in a run's config.json, which "
                    f'holds only {", ".join(RUN_RECORD_KEYS)}; put options under "config"'
                )
        raw = raw["config"]
        if raw.get("global_batch_tokens") is not None or raw.get("batch_schedule") is not None:  # derived from it
            raw = {k: v for k, v in raw.items() if k != "global_batch"}
    overrides = {}
    for key, value in raw.items():
        name = str(key).replace("-", "_") if isinstance(key, str) else None
        if name not in FIELDS:
            close = difflib.get_close_matches(name or "", FIELD_NAMES, n=1)
            hint = f"did you mean {close[0]}? " if close else ""
            raise UserError(
                f"recipe {path}: unknown key {recipe.quote(key)}; {hint}a key is a long flag's name with _ for - "
                "(accum-train --help lists them)"
            )
        if name in overrides:  # global-batch and global_batch: which one was meant?
            raise UserError(f"recipe {path}: key {recipe.quote(key)} sets {name} a second time; keep one of them")
        overrides[name] = _checked(name, value, f"recipe {path}: key {key!r}")
    return overrides


def _checked(name: str, value: Any, where: str) -> Any:
    """Coerce ints to floats where a float is expected (and integral floats such as 1e5 to
    ints where an int is); reject every other mismatch."""
    hint = TYPES[name]
    allowed = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    if value is None and type(None) in allowed:
        return None
    if float in allowed and isinstance(value, int) and not isinstance(value, bool):
        if abs(value) > sys.float_info.max:
            raise UserError(f"{where} is too large for a number, got {recipe.quote(value)}")
        return float(value)
    if int in allowed and isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    for kind in allowed:
        if kind is not type(None) and type(value) is kind:
            return value
    wanted = " or ".join(k.__name__ for k in allowed if k is not type(None))
    raise UserError(f"{where} must be {wanted}, got {type(value).__name__} {recipe.quote(value)}")


def build_config(recipe_path: str | None, cli_overrides: dict[str, Any]) -> TrainConfig:
    """Defaults < recipe < CLI flags (a flag the user did not give is None and overrides nothing)."""
    if recipe_path is not None and not recipe_path.strip():  # "" from an unset shell variable
        raise UserError("--recipe is empty; pass a YAML file (or a run's config.json), or leave the flag out")
    values = load_recipe(recipe_path) if recipe_path else {}
    values = schedules.layered(values, {k: v for k, v in cli_overrides.items() if v is not None}, recipe_path)
    cfg = TrainConfig(**values).validate()
    if cfg.global_batch_tokens is not None:  # downstream sees an ordinary global batch
        cfg.global_batch = batch_tokens.sequences(cfg.global_batch_tokens, cfg.seq_len, MAX_GLOBAL_BATCH)
    if cfg.batch_schedule is not None:  # the largest stage's: the micro batch and the memory are planned for it
        cfg.global_batch = schedules.of_config(cfg).largest
    return cfg


def as_recipe(cfg: TrainConfig, head: str) -> str:
    """The configuration as recipe YAML, its keys grouped by --help panel; a null says in a comment
    what it means (`lr: null  # 2e-5 for pretrained weights, ...`), as --help does."""
    values = cfg.to_dict()
    if cfg.global_batch_tokens is not None or cfg.batch_schedule is not None:  # global_batch follows from it
        del values["global_batch"]
    sections = [(panel, {n: values[n] for n, f in FIELDS.items() if f.metadata["panel"] == panel and n in values})
                for panel in PANELS]  # fmt: skip
    return recipe.dump(sections, head, {n: f.metadata["none_means"] for n, f in FIELDS.items()})
