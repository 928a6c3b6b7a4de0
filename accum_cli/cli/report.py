"""The `accum-report` command: OUTPUT_DIR [--compare OTHER ...] [--out FILE] -> a picture of runs."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from accum_cli.errors import UserError
from accum_cli.rundir.report import FORMATS, REPORT, available, draw


def main(
    run: Path,
    compare: list[Path] | None = None,
    out: Path | None = None,
) -> None:
    """Draw OUTPUT_DIR/report.png (or --out) from a run's metrics.jsonl, other runs overlaid."""
    if not available():
        raise UserError("accum-report needs matplotlib: pip install matplotlib (or 'accum-train[report]')")
    target = out or run / REPORT
    if target.is_dir():
        raise UserError(f"--out {target} is a folder; name the picture's file, e.g. --out {target / REPORT}")
    if target.suffix.lower() not in FORMATS:
        raise UserError(f"--out {target}: name a {', '.join(FORMATS)} file; its suffix says which format to write")
    written = draw([run, *(compare or [])], target)
    print(f"report {written}")


def several_after_compare(args: list[str]) -> list[str]:
    """`--compare A B C` as Typer reads it, `--compare A --compare B --compare C`: an option of click
    takes one value per use, and the folders after the first would be extra arguments. Where the run
    comes after them (`--compare A RUN`, which click read so before), the last of them is the run."""
    spread, taking, run_given, last_taken = [], False, False, None
    for arg in args:
        if taking and not arg.startswith("-"):
            last_taken = len(spread) + (0 if spread[-1] == "--compare" else 1)
            spread += [arg] if spread[-1] == "--compare" else ["--compare", arg]
            continue
        run_given = run_given or not (arg.startswith("-") or (spread and spread[-1] == "--out"))
        taking = arg == "--compare" or arg.startswith("--compare=")
        spread.append(arg)
    if not run_given and last_taken is not None and spread[last_taken - 1] == "--compare" and last_taken > 1:
        del spread[last_taken - 1]  # `--compare` before the run's folder: the folder stands alone
    return spread


def entry() -> None:
    """Console script `accum-report`."""
    from accum_cli.cli.main import OneLineErrors, fail

    class ReportErrors(OneLineErrors):
        prog = "accum-report"

    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, rich_markup_mode=None)

    @app.command(cls=ReportErrors, context_settings={"help_option_names": ["-h", "--help"]})
    def command(
        run: Annotated[Path, typer.Argument(help="A run's --output-dir (it may still be training).")],
        compare: Annotated[
            Optional[list[Path]],
            typer.Option(help="Other runs' output dirs to overlay: --compare A B C (each keeps one colour)."),
        ] = None,
        out: Annotated[
            Optional[Path],
            typer.Option(help="Where to write the picture (.png, .svg or .pdf).  [default: RUN/report.png]"),
        ] = None,
    ) -> None:
        """Draw loss, eval loss, learning rate, gradient norm, tokens/s and memory against the step (the tokens
        trained where compared runs train different numbers of tokens per step), each resume marked."""
        try:
            main(run, compare, out)
        except UserError as exc:
            fail(str(exc), prog=ReportErrors.prog)

    app(args=several_after_compare(sys.argv[1:]), prog_name="accum-report")
