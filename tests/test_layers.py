"""The house's rule, held by a test: the package's imports run one way, in the order data moves.

Every import of the package's own modules counts, a deferred one inside a function too (it
still ties the two modules together). A module may import its own layer or a lower one, never a
higher one, and no chain of imports comes back to where it started. docs/ARCHITECTURE.md
describes the layers; this list is where they are written down.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "accum_cli"

# Lowest first. A top-level module is named by itself, a sub-package by its folder.
LAYERS = [
    ("errors", "torch_compat", "safe_json"),  # words every layer uses; private torch behind one door; bounded JSON
    ("config",),  # the configuration and the pure batch plan: no torch
    ("cpu",),  # speedups that only a CPU run installs
    ("data",),  # rows -> prepared sequences -> microbatches
    ("parallel",),  # the process group, sharding settings, gradient sums over ranks
    ("loss",),  # the token-weighted loss, fused with the output projection, vocabulary-parallel
    ("model",),  # loading any causal LM, mixtures of experts, compiling, wrapping for the layout
    ("step",),  # one optimizer step over the microbatches, the optimizer, evaluation
    ("memory",),  # the memory estimate and the choices made from it (micro batch, policy, layout)
    ("rundir",),  # the run folder: ownership, checkpoints, metrics, trackers, the report, exports
    ("run",),  # a training run: setup, header, loop, record
    ("cli", "__main__"),  # the commands and the launcher wrapper
]
LAYER_OF = {room: i for i, rooms in enumerate(LAYERS) for room in rooms}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def room(module: str) -> str:
    return module.split(".")[1] if "." in module else module


def own_imports(path: Path) -> set[str]:
    """The package's modules this file imports, deferred imports included."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and node.module.startswith("accum_cli"):
            for alias in node.names:  # `from accum_cli.data import cache` names a module
                candidate = f"{node.module}.{alias.name}"
                found.add(candidate if candidate in MODULES else node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("accum_cli"))
    return {m for m in found if m in MODULES and m != "accum_cli"}


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}
GRAPH = {name: own_imports(path) for name, path in MODULES.items()}


def test_every_room_has_a_layer():
    rooms = {room(m) for m in MODULES if m != "accum_cli"}
    assert rooms <= set(LAYER_OF), f"modules outside every layer: {sorted(rooms - set(LAYER_OF))}"


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m != "accum_cli"))
def test_no_import_of_a_higher_layer(module):
    upward = [dep for dep in GRAPH[module] if LAYER_OF[room(dep)] > LAYER_OF[room(module)]]
    assert not upward, f"{module} (layer {room(module)}) imports higher: {upward}"


def test_no_import_cycle():
    """Depth-first search for a back edge; the cycle it finds is named whole."""
    state: dict[str, int] = {}  # 1 on the path, 2 done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for dep in sorted(GRAPH[node]):
            if state.get(dep) == 1:
                return path[path.index(dep) :] + [dep]
            if dep not in state and (cycle := visit(dep)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(GRAPH):
        if start not in state and (cycle := visit(start)):
            pytest.fail("import cycle: " + " -> ".join(cycle))


def test_no_module_over_400_lines():
    long = {m: n for m, p in MODULES.items() if (n := len(p.read_text().splitlines())) > 400}
    assert not long, f"split these by concern: {long}"


def test_private_torch_is_imported_in_one_place():
    """torch_compat.py holds every private torch symbol; nowhere else names one."""
    offenders = []
    for name, path in MODULES.items():
        if name == "accum_cli.torch_compat":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute):
                names = [ast.unparse(node)] if ast.unparse(node).startswith("torch.") else []
            private = [n for n in names if n.startswith("torch") and any(p.startswith("_") for p in n.split("."))]
            offenders += [f"{name}: {n}" for n in private]
    assert not offenders, offenders
