"""`accum-train verify [training flags] [--verify-steps K] [--json]`: the command line's side.

`verify` is a first word, not a flag: `entry()` takes it off (with verify's own two flags, which
training does not know) before Typer reads the training flags, unchanged, so a recipe, every flag
and every launcher work alike. The --nproc wrapper forwards the same words to its workers."""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass

from accum_cli.errors import UserError

VERIFY = "verify"
STEPS_FLAG = "--verify-steps"
JSON_FLAG = "--json"


@dataclass(frozen=True)
class Request:
    steps: int = 1  # optimizer steps to run on both sides
    as_json: bool = False  # print the report as one JSON document


_requested: Request | None = None  # set by entry() for this process's one command


def requested() -> Request | None:
    return _requested


def take(args: list[str]) -> list[str]:
    """The command line without `verify` and its flags; the request remembered for main()."""
    global _requested
    if not args or args[0] != VERIFY:
        _requested = None
        return args
    rest, steps, as_json = [], 1, False
    i = 1
    while i < len(args):
        arg = args[i]
        if arg == JSON_FLAG:
            as_json = True
        elif arg == STEPS_FLAG or arg.startswith(STEPS_FLAG + "="):
            if "=" in arg:
                value = arg.split("=", 1)[1]
            elif i + 1 < len(args):
                i += 1
                value = args[i]
            else:
                raise UserError(f"{STEPS_FLAG} needs a value: the number of optimizer steps to verify")
            if not re.fullmatch(r"[0-9]+", value.strip()) or int(value) < 1:
                raise UserError(f"{STEPS_FLAG} must be a positive integer, got {value!r}")
            steps = int(value)
        else:
            rest.append(arg)
        i += 1
    _requested = Request(steps, as_json)
    return rest


def worker_args() -> list[str]:
    """What the --nproc wrapper puts before the flags it forwards: verify's words, or nothing."""
    if _requested is None:
        return []
    return [VERIFY, STEPS_FLAG, str(_requested.steps), *([JSON_FLAG] if _requested.as_json else [])]


def refuse_other_modes(print_config: bool, plan: bool, prepare_only: bool, resume: str | None) -> None:
    """verify runs the configured run's first steps: none of the flags that do something else."""
    if _requested is None:
        return
    other = [
        name
        for name, given in (
            ("--print-config", print_config),
            ("--plan", plan),
            ("--prepare-only", prepare_only),
            ("--resume", resume is not None),
        )
        if given
    ]
    if other:
        raise UserError(
            f"verify runs the first steps of the run from its initial weights; drop {', '.join(other)} (or drop verify)"
        )


def output_dir_for_launch(cfg):
    """The wrapper's preflight checks --output-dir before starting workers: a scratch one for verify,
    which writes nothing to the user's."""
    if _requested is None:
        return contextlib.nullcontext(cfg)
    from accum_cli.run.verify import scratch_output_dir

    return scratch_output_dir(cfg)
