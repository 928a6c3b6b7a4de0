"""The `accum-train` command: options -> config -> plan or run; mistakes -> one line, exit 2."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from accum_cli.cli import options, verify_cli
from accum_cli.cli.launcher import WRAPPED
from accum_cli.config.settings import (
    BATCH,
    CHECKPOINTS,
    EXPORT_DTYPES,
    LAUNCH,
    MODEL_DATA,
    RESUME_AUTO,
    RESUME_LATEST,
    as_recipe,
    build_config,
)
from accum_cli.errors import EXIT_USAGE, RankError, UserError
from accum_cli.parallel.runtime import EXIT_PEER_LOST, env_rank, exit_process, peer_lost

EXIT_NONFINITE = 3  # a NaN/inf loss or gradient norm with --on-nonfinite abort


def fail(message: str, code: int = EXIT_USAGE, every_rank: bool = False, prog: str = "accum-train") -> None:
    """One line on stderr (rank 0 only, so N ranks do not print N copies, unless the problem is
    one rank's own), then exit."""
    if env_rank() == 0 or every_rank:
        print(f"{prog}: error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(code)


def with_resume_value(args: list[str]) -> list[str]:
    """`--resume` alone means the latest checkpoint in --output-dir (click has no optional values)."""
    out = []
    for i, arg in enumerate(args):
        out.append(arg)
        following = args[i + 1] if i + 1 < len(args) else None
        if arg == "--resume" and (following is None or following.startswith("-")):
            out.append(RESUME_LATEST)
    return out


class OneLineErrors(options.PanelHelp):
    """Click's usage errors (unknown flag, `--micro-batch abc`) as one line, exit code 2."""

    prog = "accum-train"  # the command the line names

    def parse_args(self, ctx, args):
        args = with_resume_value(list(args))
        ctx.meta["raw_args"] = list(args)  # the launcher wrapper forwards them to its workers
        return super().parse_args(ctx, args)

    def main(self, *args, **kwargs):
        kwargs["standalone_mode"] = False
        prog = self.prog
        try:
            result = super().main(*args, **kwargs)
        except typer.Abort:
            fail("aborted", 130, prog=prog)
        except Exception as exc:
            # Typer's parse errors (its vendored click's UsageError family) carry a message and
            # an exit code; anything else is a bug and keeps its traceback.
            if not (hasattr(exc, "format_message") and hasattr(exc, "exit_code")):
                raise
            fail(f"{exc.format_message()} (see {prog} --help)", prog=prog)
        raise SystemExit(result if isinstance(result, int) else 0)


app = typer.Typer(
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    help="Train a Hugging Face causal LM at a large global batch: exact gradient accumulation on FSDP2.",
)

Opt = typer.Option


PRINT_CONFIG_HEAD = "accum-train --recipe THIS_FILE (written by accum-train --print-config)"


@app.command(cls=OneLineErrors, context_settings={"help_option_names": ["-h", "--help"]})
@options.config_flags
def main(
    ctx: typer.Context,
    recipe: Annotated[
        Optional[str],
        Opt(help="YAML recipe (or a run's config.json); flags given here override it, it overrides the defaults."),
    ] = None,
    print_config: Annotated[
        bool,
        Opt(
            "--print-config", help="Print the resolved configuration as a recipe (defaults < recipe < flags) and exit."
        ),
    ] = False,
    prepare_only: Annotated[
        bool,
        Opt(
            "--prepare-only",
            help="Tokenise and cache the data, print its summary, and exit.",
            rich_help_panel=MODEL_DATA,
        ),
    ] = False,
    plan: Annotated[
        bool, Opt("--plan", help="Print the plan for --world-size and exit without training.", rich_help_panel=BATCH)
    ] = False,
    world_size: Annotated[
        Optional[int], Opt(help="World size to plan for (with --plan only).", rich_help_panel=BATCH)
    ] = None,
    resume: Annotated[
        Optional[str],
        Opt(
            help="Continue from a checkpoint: alone, the newest in --output-dir; auto: the newest if there is one, "
            "else start fresh (one command line for the first start and every restart); or a checkpoint PATH.",
            rich_help_panel=CHECKPOINTS,
        ),
    ] = None,
    nproc: Annotated[
        Optional[int],
        Opt(help="Start N worker processes on this machine through Accelerate's launcher.", rich_help_panel=LAUNCH),
    ] = None,
    nnodes: Annotated[int, Opt(help="Machines taking part (with --nproc).", rich_help_panel=LAUNCH)] = 1,
    node_rank: Annotated[int, Opt(help="This machine's rank, 0..nnodes-1.", rich_help_panel=LAUNCH)] = 0,
    master_addr: Annotated[
        Optional[str],
        Opt(
            help="Address of the machine with node rank 0 (default: the accelerate config's, else 127.0.0.1).",
            rich_help_panel=LAUNCH,
        ),
    ] = None,
    master_port: Annotated[
        Optional[int],
        Opt(
            help="Free TCP port on the machine with node rank 0 (default: the accelerate config's, else 29500).",
            rich_help_panel=LAUNCH,
        ),
    ] = None,
    accelerate_config: Annotated[
        Optional[str],
        Opt(help="Accelerate config file for the workers (see recipes/accelerate/).", rich_help_panel=LAUNCH),
    ] = None,
    **flags: Any,
) -> None:
    """Train, or with --plan print the batch plan and exit.

    Example: accum-train --global-batch 2048 --micro-batch 4

    accum-train verify [flags] [--verify-steps K] [--json]: run the first K (1) steps twice, as configured and
    as one big batch, and report whether they agree (exit 0) or not (exit 1); nothing is written.
    """
    wants_launch = nproc is not None or accelerate_config is not None
    try:
        cfg = build_config(recipe, flags)
        verify_cli.refuse_other_modes(print_config, plan, prepare_only, resume)
        if verify_cli.requested() is not None and cfg.batch_schedule is not None:
            raise UserError("verify checks the first steps at one global batch; drop --batch-schedule and verify "
                            "each stage's batch with --global-batch N")  # fmt: skip
        if print_config:
            print(as_recipe(cfg, PRINT_CONFIG_HEAD), end="")
            return
        if prepare_only and plan:
            raise UserError("--plan prints the plan without touching the data; drop --plan or --prepare-only")
        if prepare_only and cfg.streaming:
            raise UserError(
                "--prepare-only has nothing to prepare with --streaming (it tokenises on the fly); drop one"
            )
        if resume is not None and not resume.strip():  # an unset variable: `--resume "$CKPT"`
            raise UserError("--resume is empty; pass a checkpoint folder, latest or auto, or leave the flag out")
        if resume == RESUME_AUTO and cfg.overwrite:
            raise UserError("--resume auto continues a run and --overwrite discards it; pass one of them")
        if world_size is not None and not plan:  # before a launch: the workers would each refuse it
            raise UserError("--world-size only applies with --plan; a training run takes it from the launcher")
        if not wants_launch and (nnodes != 1 or node_rank != 0 or master_addr is not None or master_port is not None):
            # Else each machine of a multi-node command missing --nproc trains alone, unsaid.
            raise UserError(
                "--nnodes, --node-rank, --master-addr and --master-port apply with --nproc N (or "
                "--accelerate-config FILE), which starts the workers; add --nproc"
            )
        if wants_launch:
            if plan:
                raise UserError("--plan does not start processes; drop --nproc, or use --world-size with --plan")
            spec = (nproc, nnodes, node_rank, master_addr, master_port, accelerate_config)
            with verify_cli.output_dir_for_launch(cfg) as checked:
                launch(checked, resume, verify_cli.worker_args() + ctx.meta["raw_args"], *spec)
            return
        if plan:
            from accum_cli.run.planning import plan_only

            if world_size is not None and world_size < 1:
                raise UserError(f"--world-size must be a positive integer, got {world_size}")
            plan_only(cfg, world_size or 1)
            return
        from accum_cli.run.setup import AlreadyFinished
        from accum_cli.run.signals import EXIT_PREEMPTED, watch_launcher
        from accum_cli.run.train import Preempted, StoppedBeforeTraining, run
        from accum_cli.rundir.checkpoint import EXIT_SAVE_FAILED, SaveFailed
        from accum_cli.step.loop import NonFiniteError

        watch_launcher()
        try:
            if verify_cli.requested() is None:
                run(cfg, resume, prepare_only)
            else:
                from accum_cli.run.verify import verify

                code = verify(cfg, verify_cli.requested().steps, verify_cli.requested().as_json)
                if code:
                    raise SystemExit(code)
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
        except AlreadyFinished as exc:
            if env_rank() == 0:
                print(f"accum-train: {exc}", flush=True)
        except Preempted as exc:
            if env_rank() == 0:
                print(f"accum-train: {exc}", file=sys.stderr, flush=True)
            raise SystemExit(EXIT_PREEMPTED) from None
        except StoppedBeforeTraining:
            if env_rank() == 0:
                print(
                    "accum-train: stopped by SIGTERM before this attempt's first step, nothing trained in it;"
                    f" the same command continues ({_last_checkpoint(cfg)})",
                    file=sys.stderr,
                    flush=True,
                )
            raise SystemExit(EXIT_PREEMPTED) from None
    except UserError as exc:
        fail(str(exc), every_rank=isinstance(exc, RankError))


def _last_checkpoint(cfg) -> str:
    from accum_cli.rundir.checkpoint_meta import latest

    newest = latest(Path(cfg.output_dir).expanduser())
    if newest is None:
        return "no checkpoint was written yet: start again"
    return f"the last checkpoint {newest} is intact: rerun with --resume to continue"


def launch(cfg, resume, raw_args, nproc, nnodes, node_rank, master_addr, master_port, accelerate_config) -> None:
    """The wrapper: check what can be checked here, then start the workers via Accelerate."""
    from accum_cli.cli import launcher
    from accum_cli.run.setup import preflight

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
        try:
            args = verify_cli.take(sys.argv[1:])
        except UserError as exc:
            fail(str(exc))
        app(args=args, prog_name="accum-train")
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except KeyboardInterrupt:
        code = 130
    exit_process(code)


export_app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, rich_markup_mode=None)


class ExportErrors(OneLineErrors):
    prog = "accum-export"


@export_app.command(cls=ExportErrors, context_settings={"help_option_names": ["-h", "--help"]})
def export_main(
    checkpoint: Annotated[
        str,
        typer.Argument(help="A checkpoint folder (OUTPUT_DIR/checkpoints/step-XXXXXX) or an output dir (its latest)."),
    ],
    out: Annotated[str, typer.Argument(help="New or empty folder for the Hugging Face model.")],
    trust_remote_code: Annotated[bool, Opt("--trust-remote-code", help="Run code shipped with the model.")] = False,
    export_dtype: Annotated[
        str,
        Opt(
            help="dtype of the exported weights; auto: the dtype the model's config declares, fp32 if none.",
            metavar="[" + "|".join(EXPORT_DTYPES) + "]",
        ),
    ] = "auto",
    base: Annotated[
        Optional[str],
        Opt("--base", help="LoRA checkpoints: the model the adapters were trained on (the run's --model)."),
    ] = None,
    merge: Annotated[
        bool, Opt("--merge", help="LoRA checkpoints: the base with the adapters merged in, not the adapters alone.")
    ] = False,
) -> None:
    """Consolidate a sharded checkpoint into Hugging Face format (safetensors, config, tokenizer); a LoRA
    checkpoint into a peft adapter folder, or with --merge into the merged model."""
    from transformers.utils import logging as hf_logging

    from accum_cli.rundir.export import export

    hf_logging.disable_progress_bar()  # one line on success, one on failure
    previous = signal.signal(signal.SIGTERM, _terminated)  # so the export's cleanup runs, as on Ctrl-C
    try:
        if export_dtype not in EXPORT_DTYPES:
            raise UserError(f"--export-dtype {export_dtype!r} is unknown; use one of: {', '.join(EXPORT_DTYPES)}")
        target = export(
            Path(checkpoint).expanduser(), Path(out).expanduser(), trust_remote_code, export_dtype, base, merge
        )
    except UserError as exc:
        fail(str(exc), prog=ExportErrors.prog)
    except Terminated:
        fail(f"stopped by SIGTERM; nothing was written to {out}", 128 + signal.SIGTERM, prog=ExportErrors.prog)
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(f"exported {checkpoint} -> {target}")


class Terminated(BaseException):
    """SIGTERM during an export: unwinds like Ctrl-C, through the cleanup of the half-written folder."""


def _terminated(signum, frame) -> None:
    raise Terminated


def export_entry() -> None:
    """Console script `accum-export`."""
    export_app(prog_name="accum-export")
