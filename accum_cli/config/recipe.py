"""Recipe files as users write them: YAML 1.2 numbers, bounded size, one-line errors.

PyYAML implements YAML 1.1, where a float needs a dot: `3e-4` and `1e5` are strings there,
yet every recipe copied from a paper or another trainer writes them so; and its integers
include `064` (octal: 52) and `1:30` (base 60: 90), which change a value without a word. YAML
1.2 (core schema) reads `3e-4` as a number, `064` as 64 and `1:30` as text. `Yaml12Loader` is
PyYAML's SafeLoader with its int and float resolvers replaced by the YAML 1.2 ones;
`Yaml12Dumper` carries the same resolvers, so a string that would now read as a number
(`"3e-4"`) is written quoted and reads back as a string.

A recipe is a few KB; anything above MAX_BYTES is refused before parsing, and every value
quoted in a message is cut to a few dozen characters (`quote`): a YAML alias bomb (a few
hundred bytes that expand to billions of list items when printed) costs nothing here.
"""

from __future__ import annotations

import json
import re
import reprlib
from pathlib import Path
from typing import Any

import yaml

from accum_cli.errors import UserError

MAX_BYTES = 1 << 20  # 1 MiB: a generous bound for a file of option: value lines
QUOTE_CHARS = 60

FLOAT_TAG = "tag:yaml.org,2002:float"
INT_TAG = "tag:yaml.org,2002:int"
# YAML 1.2 core schema integers: decimal (a leading zero is still decimal), 0o octal, 0x hex.
YAML12_INT = re.compile(r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$")
# YAML 1.2 core schema floats: a dot or an exponent (or both), .inf, .nan. Plain integers stay
# with the int resolver, which comes first for the same leading characters.
YAML12_FLOAT = re.compile(
    r"""^(?:[-+]?(?:\.[0-9]+|[0-9]+\.[0-9]*)(?:[eE][-+]?[0-9]+)?
    |[-+]?[0-9]+[eE][-+]?[0-9]+
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""",
    re.X,
)


def _with_yaml12_numbers(cls: type) -> type:
    cls.yaml_implicit_resolvers = {
        first: [(tag, regexp) for tag, regexp in resolvers if tag not in (INT_TAG, FLOAT_TAG)]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
    }
    cls.add_implicit_resolver(INT_TAG, YAML12_INT, list("-+0123456789"))
    cls.add_implicit_resolver(FLOAT_TAG, YAML12_FLOAT, list("-+0123456789."))
    return cls


def _yaml12_int(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> int:
    text = loader.construct_scalar(node)
    if text.startswith(("0o", "0x")):
        return int(text[2:], 8 if text[1] == "o" else 16)
    return int(text, 10)  # SafeLoader's own would read 064 as octal


class DuplicateKey(ValueError):
    """A key written twice in one mapping: YAML and JSON readers keep the last one, unsaid."""

    def __init__(self, key: str, lines: tuple[int, int] | None = None):
        super().__init__(key)
        self.key, self.lines = key, lines


@_with_yaml12_numbers
class Yaml12Loader(yaml.SafeLoader):
    """SafeLoader (no Python objects) reading numbers per YAML 1.2, refusing a key given twice
    (a copy-paste leftover `lr: 5` below `lr: 1e-3` would win). Keys a `<<` merge brings in may
    be overridden: that is what merging is for."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            first_line: dict[tuple[str, str], int] = {}
            for key_node, _ in node.value:
                if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key, line = (key_node.tag, key_node.value), key_node.start_mark.line + 1
                if key in first_line:
                    raise DuplicateKey(key_node.value, (first_line[key], line))
                first_line[key] = line
        return super().construct_mapping(node, deep=deep)


def _unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    seen: set[str] = set()
    for key, _ in pairs:
        if key in seen:
            raise DuplicateKey(key)
        seen.add(key)
    return dict(pairs)


Yaml12Loader.add_constructor(INT_TAG, _yaml12_int)


@_with_yaml12_numbers
class Yaml12Dumper(yaml.SafeDumper):
    """SafeDumper that quotes any string Yaml12Loader would read as a number."""


_SHORT = reprlib.Repr()  # keyword arguments only from Python 3.12
_SHORT.maxlevel, _SHORT.maxlist, _SHORT.maxdict = 2, 4, 4
_SHORT.maxstring = _SHORT.maxother = _SHORT.maxlong = QUOTE_CHARS


def quote(value: Any) -> str:
    """A value for a one-line message: repr, bounded in depth, items and length."""
    text = _SHORT.repr(value).replace("\n", " ")
    return text if len(text) <= QUOTE_CHARS else text[: QUOTE_CHARS - 3] + "..."


def read_mapping(path: Path) -> dict[Any, Any]:
    """The recipe's top-level mapping. A `.json` file is read as JSON (a run's config.json)."""
    if path.is_dir():
        raise UserError(f"recipe {path} is a folder; pass a YAML file to --recipe")
    if path.exists() and not path.is_file():  # `--recipe <(...)`: a pipe, read once, gone for the workers
        raise UserError(f"recipe {path} is not a regular file (a pipe?); save the recipe to a file and pass that")
    if not path.is_file():
        raise UserError(f"recipe {path} does not exist; pass an existing YAML file to --recipe")
    with open(path, "rb") as f:
        raw = f.read(MAX_BYTES + 1)
    if len(raw) > MAX_BYTES:
        raise UserError(f"recipe {path} is larger than {MAX_BYTES >> 20} MiB; a recipe is a short option: value file")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise UserError(f"recipe {path} is not UTF-8 text (line {line}); save it as UTF-8") from None
    try:
        if path.suffix == ".json":
            data = json.loads(text, object_pairs_hook=_unique_pairs)
        else:
            data = yaml.load(text, Loader=Yaml12Loader)
    except DuplicateKey as exc:
        lines = f" (lines {exc.lines[0]} and {exc.lines[1]})" if exc.lines else ""
        raise UserError(f"recipe {path}: key {quote(exc.key)} appears twice{lines}; keep one") from None
    except yaml.constructor.ConstructorError as exc:  # a tag the safe loader has no constructor for
        tag = re.search(r"tag '(?:tag:yaml\.org,2002:)?([^']+)'", str(exc.problem))
        where = f" (line {exc.problem_mark.line + 1})" if exc.problem_mark else ""
        raise UserError(
            f"recipe {path}: the tag !!{tag.group(1) if tag else '?'}{where} is not allowed; a recipe holds plain"
            " values (numbers, text, lists), never objects to build"
        ) from None
    except (yaml.YAMLError, ValueError) as exc:
        where = getattr(exc, "problem_mark", None)
        line = f" (line {where.line + 1})" if where else f" (line {exc.lineno})" if hasattr(exc, "lineno") else ""
        kind = "JSON" if path.suffix == ".json" else "YAML"
        raise UserError(f"recipe {path} is not valid {kind}{line}; fix its syntax") from None
    except RecursionError:
        raise UserError(f"recipe {path} is nested too deeply; a recipe is a flat option: value mapping") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UserError(f"recipe {path} must be a mapping of option: value")
    return data


def dump(sections: list[tuple[str, dict[str, Any]]], head: str, notes: dict[str, str]) -> str:
    """Recipe YAML: a comment line `head`, then each section's keys under its title; a key whose
    value is null gets `notes[key]` (what null means: the value is chosen at run time) as a comment."""
    lines = [f"# {head}"]
    for title, values in sections:
        lines.append(f"\n# {title}")
        for key, value in values.items():
            line = yaml.dump({key: value}, Dumper=Yaml12Dumper, width=1 << 16).rstrip("\n")
            note = notes.get(key) if value is None else None
            lines.append(f"{line}  # {' '.join(note.split())}" if note else line)
    return "\n".join(lines) + "\n"
