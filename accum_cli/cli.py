"""The `accum-train` command: options -> config -> plan or run; mistakes -> one line, exit 2."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from typer.core import TyperCommand

from accum_cli import policy
from accum_cli.config import FIELD_NAMES, build_config
from accum_cli.errors import EXIT_USAGE, UserError
from accum_cli.launcher import WRAPPED
from accum_cli.runtime import EXIT_PEER_LOST, env_rank, exit_process, peer_lost

EXIT_NONFINITE = 3  # a NaN/inf loss or gradient norm with --on-nonfinite abort


def fail(message: str, code: int = EXIT_USAGE) -> None:
    """One line on stderr (rank 0 only, so N ranks do not print N copies), then exit."""
    if env_rank() == 0:
        print(f"accum-train: error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(code)


def with_resume_value(args: list[str]) -> list[str]:
    """`--resume` alone means the latest checkpoint in --output-dir (click has no optional values)."""
    out = []
    for i, arg in enumerate(args):
        out.append(arg)
        following = args[i + 1] if i + 1 < len(args) else None
        if arg == "--resume" and (following is None or following.startswith("-")):
            out.append("latest")
    return out


class OneLineErrors(TyperCommand):
    """Click's usage errors (unknown flag, `--micro-batch abc`) as one line, exit code 2."""

    def parse_args(self, ctx, args):
        args = with_resume_value(list(args))
        ctx.meta["raw_args"] = list(args)  # the launcher wrapper forwards them to its workers
        return super().parse_args(ctx, args)

    def main(self, *args, **kwargs):
        kwargs["standalone_mode"] = False
        try:
            result = super().main(*args, **kwargs)
        except typer.Abort:
            fail("aborted", 130)
        except Exception as exc:
            # Typer's parse errors (its vendored click's UsageError family) carry a message and
            # an exit code; anything else is a bug and keeps its traceback.
            if not (hasattr(exc, "format_message") and hasattr(exc, "exit_code")):
                raise
            fail(f"{exc.format_message()} (see accum-train --help)")
        raise SystemExit(result if isinstance(result, int) else 0)


app = typer.Typer(
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    help="Train a Hugging Face causal LM at a large global batch: exact gradient accumulation on FSDP2.",
)

Opt = typer.Option


@app.command(cls=OneLineErrors, context_settings={"help_option_names": ["-h", "--help"]})
def main(
    ctx: typer.Context,
    model: Annotated[
        Optional[str], Opt(help="Model folder (save_pretrained) or hub id. Default: the embedded tiny Llama.")
    ] = None,
    dataset: Annotated[
        Optional[str],
        Opt(help="A .txt/.jsonl/.json/.parquet file, a folder of them, or a hub id. Default: embedded corpus."),
    ] = None,
    dataset_config: Annotated[Optional[str], Opt(help="Hub datasets: configuration (subset) name.")] = None,
    split: Annotated[Optional[str], Opt(help="Hub datasets: the split to train on.  [default: train]")] = None,
    packing: Annotated[
        Optional[bool],
        Opt(
            "--packing/--no-packing",
            help="Join documents with EOS into --seq-len blocks, or one document per row (truncated, padded per microbatch).  [default: packing for text, rows for chat/prompt-completion/tokens]",
        ),
    ] = None,
    train_on_prompt: Annotated[
        Optional[bool],
        Opt(
            "--train-on-prompt/--no-train-on-prompt",
            help="Chat and prompt-completion data: count every token, not only the answers.  [default: no]",
        ),
    ] = None,
    eval_dataset: Annotated[Optional[str], Opt(help="Dataset to evaluate on (same formats as --dataset).")] = None,
    eval_split_ratio: Annotated[
        Optional[float], Opt(help="Hold out this share of the training sequences for evaluation.")
    ] = None,
    eval_every: Annotated[
        Optional[int], Opt(help="Evaluate every N optimizer steps (and at the end).  [default: at the end]")
    ] = None,
    text_column: Annotated[Optional[str], Opt(help="Column with raw text.  [default: text]")] = None,
    trust_remote_code: Annotated[
        Optional[bool],
        Opt(
            "--trust-remote-code/--no-trust-remote-code",
            help="Run code shipped with the model or dataset.  [default: no]",
        ),
    ] = None,
    seq_len: Annotated[
        Optional[int],
        Opt(help="Tokens per sequence.  [default: 128 on the embedded corpus, else min(2048, model maximum)]"),
    ] = None,
    global_batch: Annotated[
        Optional[int], Opt(help="Sequences per optimizer step, over all ranks.  [default: 64]")
    ] = None,
    micro_batch: Annotated[
        Optional[str],
        Opt(
            help="Sequences per forward/backward on one rank, or auto: the most that fit (memory estimate).  [default: 8]"
        ),
    ] = None,
    strict_batch: Annotated[
        Optional[bool],
        Opt(
            "--strict-batch/--no-strict-batch",
            help="Refuse a global batch that is not a multiple of micro batch x world size.",
        ),
    ] = None,
    max_steps: Annotated[Optional[int], Opt(help="Optimizer steps.  [default: one epoch]")] = None,
    epochs: Annotated[
        Optional[float], Opt(help="Passes over the data when --max-steps is not given.  [default: 1]")
    ] = None,
    lr: Annotated[Optional[float], Opt(help="Peak learning rate.  [default: 1e-3]")] = None,
    warmup_steps: Annotated[Optional[int], Opt(help="Linear warmup steps.  [default: 5]")] = None,
    lr_schedule: Annotated[Optional[str], Opt(help="cosine or constant.  [default: cosine]")] = None,
    weight_decay: Annotated[Optional[float], Opt(help="AdamW weight decay on matrices.  [default: 0.1]")] = None,
    grad_clip: Annotated[Optional[float], Opt(help="Max global gradient L2 norm; 0 disables.  [default: 1.0]")] = None,
    seed: Annotated[Optional[int], Opt(help="Seed of the data order and of from-config weights.  [default: 0]")] = None,
    sync: Annotated[
        Optional[str], Opt(help=f"Gradient sync policy: {', '.join(policy.POLICIES)}.  [default: auto]")
    ] = None,
    precision: Annotated[
        Optional[str], Opt(help="auto (bf16 on CUDA, fp32 on CPU), bf16 or fp32.  [default: auto]")
    ] = None,
    device_memory_gib: Annotated[
        Optional[float], Opt(help="Memory per rank for the auto sync policy.  [default: read from the device]")
    ] = None,
    checkpoint_every: Annotated[
        Optional[int],
        Opt(help="Write a sharded checkpoint every N optimizer steps (always at the end and on SIGTERM/SIGINT)."),
    ] = None,
    keep_checkpoints: Annotated[Optional[int], Opt(help="Keep the latest K checkpoints.  [default: 2]")] = None,
    resume: Annotated[
        Optional[str], Opt(help="Continue from a checkpoint: alone, the latest in --output-dir; or a checkpoint PATH.")
    ] = None,
    on_nonfinite: Annotated[
        Optional[str], Opt(help="NaN/inf loss or grad norm: abort (exit 3) or skip the step.  [default: abort]")
    ] = None,
    output_dir: Annotated[
        Optional[str], Opt(help="Where metrics.jsonl, config.json and final/ go.  [default: runs/accum-train]")
    ] = None,
    overwrite: Annotated[
        Optional[bool], Opt("--overwrite/--no-overwrite", help="Write into an output dir that holds a previous run.")
    ] = None,
    allow_data_change: Annotated[
        Optional[bool],
        Opt(
            "--allow-data-change/--no-allow-data-change",
            help="Resume although the data or its order changed since the checkpoint (the training then differs).",
        ),
    ] = None,
    recipe: Annotated[
        Optional[str], Opt(help="YAML recipe; flags given here override it, it overrides the defaults.")
    ] = None,
    replicas: Annotated[
        Optional[int], Opt(help="HSDP: model replicas, each sharded over world size / replicas ranks.  [default: 1]")
    ] = None,
    activation_checkpointing: Annotated[
        Optional[bool],
        Opt(
            "--activation-checkpointing/--no-activation-checkpointing",
            help="Recompute layer activations in backward.  [default: the accelerate config's, else no]",
        ),
    ] = None,
    plan: Annotated[bool, Opt("--plan", help="Print the plan for --world-size and exit without training.")] = False,
    prepare_only: Annotated[
        bool, Opt("--prepare-only", help="Tokenise and cache the data, print its summary, and exit.")
    ] = False,
    world_size: Annotated[Optional[int], Opt(help="World size to plan for (with --plan only).")] = None,
    nproc: Annotated[
        Optional[int],
        Opt(help="Start N worker processes on this machine through Accelerate's launcher.", rich_help_panel="Launch"),
    ] = None,
    nnodes: Annotated[int, Opt(help="Machines taking part (with --nproc).", rich_help_panel="Launch")] = 1,
    node_rank: Annotated[int, Opt(help="This machine's rank, 0..nnodes-1.", rich_help_panel="Launch")] = 0,
    master_addr: Annotated[
        str, Opt(help="Address of the machine with node rank 0.", rich_help_panel="Launch")
    ] = "127.0.0.1",
    master_port: Annotated[
        int, Opt(help="Free TCP port on the machine with node rank 0.", rich_help_panel="Launch")
    ] = 29500,
    accelerate_config: Annotated[
        Optional[str],
        Opt(help="Accelerate config file for the workers (see recipes/accelerate/).", rich_help_panel="Launch"),
    ] = None,
) -> None:
    """Train, or with --plan print the batch plan and exit.

    Example: accum-train --global-batch 2048 --micro-batch 4
    """
    overrides = {k: v for k, v in locals().items() if k in FIELD_NAMES}
    wants_launch = nproc is not None or accelerate_config is not None
    try:
        cfg = build_config(recipe, overrides)
        if wants_launch:
            if plan:
                raise UserError("--plan does not start processes; drop --nproc, or use --world-size with --plan")
            spec = (nproc, nnodes, node_rank, master_addr, master_port, accelerate_config)
            launch(cfg, resume, ctx.meta["raw_args"], *spec)
            return
        if world_size is not None and not plan:
            raise UserError("--world-size only applies with --plan; a training run takes it from the launcher")
        if plan:
            from accum_cli.train import plan_only

            if world_size is not None and world_size < 1:
                raise UserError(f"--world-size must be a positive integer, got {world_size}")
            plan_only(cfg, world_size or 1)
            return
        from accum_cli.checkpoint import EXIT_SAVE_FAILED, SaveFailed
        from accum_cli.loop import NonFiniteError
        from accum_cli.signals import EXIT_PREEMPTED, watch_launcher
        from accum_cli.train import Preempted, run

        watch_launcher()
        try:
            run(cfg, resume, prepare_only)
        except NonFiniteError as exc:
            fail(f"non-finite values at {exc}; the last checkpoint is untouched", EXIT_NONFINITE)
        except SaveFailed as exc:
            fail(str(exc), EXIT_SAVE_FAILED)
        except RuntimeError as exc:
            if not peer_lost(exc):
                raise
            if os.environ.get(WRAPPED):  # the --nproc wrapper names the lost rank in its own line
                raise SystemExit(EXIT_PEER_LOST) from None
            fail(f"lost contact with another rank mid-run (it died or hung); {_last_checkpoint(cfg)}", EXIT_PEER_LOST)
        except Preempted as exc:
            if env_rank() == 0:
                print(f"accum-train: {exc}", file=sys.stderr, flush=True)
            raise SystemExit(EXIT_PREEMPTED) from None
    except UserError as exc:
        fail(str(exc))


def _last_checkpoint(cfg) -> str:
    from accum_cli.checkpoint import latest

    newest = latest(Path(cfg.output_dir).expanduser())
    if newest is None:
        return "no checkpoint was written yet: start again"
    return f"the last checkpoint {newest} is intact: rerun with --resume to continue"


def launch(cfg, resume, raw_args, nproc, nnodes, node_rank, master_addr, master_port, accelerate_config) -> None:
    """The wrapper: check what can be checked here, then start the workers via Accelerate."""
    from accum_cli import launcher
    from accum_cli.train import preflight

    if "RANK" in os.environ:
        raise UserError("--nproc starts its own workers; do not combine it with torchrun or accelerate launch")
    spec = launcher.Launch(nproc, nnodes, node_rank, master_addr, master_port, accelerate_config).validate()
    preflight(cfg, spec.world_size, resume)
    forwarded = launcher.worker_args(raw_args)
    out = Path(cfg.output_dir).expanduser()
    code, lost = launcher.run(spec, launcher.mixed_precision_for(cfg.precision, spec), forwarded, out)
    if lost:  # a worker died without a word of its own (killed, crashed): say which, once
        print(f"accum-train: error: {lost}; {_last_checkpoint(cfg)}", file=sys.stderr, flush=True)
    if code:
        raise SystemExit(code)


def entry() -> None:
    """Console script: run, then end the process without interpreter finalisation (runtime.py)."""
    try:
        app(prog_name="accum-train")
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except KeyboardInterrupt:
        code = 130
    exit_process(code)


export_app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, rich_markup_mode=None)


@export_app.command(cls=OneLineErrors, context_settings={"help_option_names": ["-h", "--help"]})
def export_main(
    checkpoint: Annotated[
        str,
        typer.Argument(help="A checkpoint folder (OUTPUT_DIR/checkpoints/step-XXXXXX) or an output dir (its latest)."),
    ],
    out: Annotated[str, typer.Argument(help="New or empty folder for the Hugging Face model.")],
    trust_remote_code: Annotated[bool, Opt("--trust-remote-code", help="Run code shipped with the model.")] = False,
) -> None:
    """Consolidate a sharded checkpoint into Hugging Face format (safetensors, config, tokenizer)."""
    from accum_cli.checkpoint import export

    try:
        target = export(Path(checkpoint).expanduser(), Path(out).expanduser(), trust_remote_code)
    except UserError as exc:
        fail(str(exc))
    print(f"exported {checkpoint} -> {target}")


def export_entry() -> None:
    """Console script `accum-export`."""
    export_app(prog_name="accum-export")
