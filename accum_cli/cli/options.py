"""The config's fields as Typer options, and `--help` grouped in panels.

Typer reads a command's parameters from its signature. `config_flags` appends one keyword
parameter per TrainConfig field to a command's signature, each an `Annotated[..., Option]`
built from the field's metadata: the flag name (`--packing/--no-packing` for booleans), the
help text with the default shown from the config, the choices as metavar, the panel. Every
flag defaults to None, so a flag the user did not give overrides nothing (defaults < recipe
< flags). The command receives them in its `**flags`.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Annotated, Any, Optional

import typer
from typer.core import TyperCommand

from accum_cli.config import settings as config

ARGUMENTS = "Arguments"
GENERAL = "Options"


def config_option(name: str) -> Any:
    """The Typer option of one config field."""
    f = config.FIELDS[name]
    meta, long = f.metadata, config.flag(name)
    kind = config.base_type(name)
    decls = [f"{long}/--no-{long[2:]}"] if kind is bool else [long]
    metavar = "[" + "|".join(meta["choices"]) + "]" if meta["choices"] else None
    help_text = f"{meta['help']}  [default: {config.default_text(name)}]"
    info = typer.Option(*decls, help=help_text, metavar=metavar, show_default=False, rich_help_panel=meta["panel"])
    return Annotated[Optional[kind], info]  # Optional, not `kind | None`: built at run time for Typer


def config_flags(command: Callable[..., Any]) -> Callable[..., Any]:
    """Give `command(..., **flags)` one keyword option per config field."""
    signature = inspect.signature(command, eval_str=True)
    own = [p for p in signature.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    added = [
        inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=config_option(name))
        for name in config.FIELD_NAMES
    ]

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return command(*args, **kwargs)

    wrapper.__signature__ = signature.replace(parameters=[*own, *added])
    wrapper.__annotations__ = {}  # the signature carries them
    return wrapper


def command_flags(params: list[Any]) -> list[str]:
    """Names of the flags that are not config fields (recipe, plan, launch...)."""
    return [p.opts[0] for p in params if p.param_type_name == "option" and p.name not in config.FIELDS]


class PanelHelp(TyperCommand):
    """Plain-text --help with the options grouped under the config's panels."""

    def format_options(self, ctx: Any, formatter: Any) -> None:
        groups: dict[str, list[tuple[str, str]]] = {}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is not None:
                panel = ARGUMENTS if param.param_type_name == "argument" else getattr(param, "rich_help_panel", None)
                groups.setdefault(panel or GENERAL, []).append(record)
        for panel in (ARGUMENTS, GENERAL, *config.PANELS):
            if panel in groups:
                with formatter.section(panel):
                    formatter.write_dl(groups.pop(panel))
        for panel, records in groups.items():
            with formatter.section(panel):
                formatter.write_dl(records)
