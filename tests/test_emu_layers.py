"""The emulator's modules import in one direction (docs/emulator.md, Modules): state at the bottom, the ioctl
families above it, the driver table on top. Read from the source with ``ast``: every import counts, also one
under ``if TYPE_CHECKING:``, and none may sit inside a function."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

EMU = Path(__file__).resolve().parent.parent / "amdxdna_direct" / "emu"

# Lower number = lower layer; a module may import only modules of a lower layer (docs/emulator.md, Modules).
LAYERS = {
    "layouts": 0, "usermem": 0, "coherence": 0, "blas": 0, "txn": 0, "profiles": 0, "drivers": 0,
    "memory": 1, "clock": 1,
    "models": 2, "objects": 2,
    "firmware": 3,
    "state": 4,
    "buffers": 5, "contexts": 5, "submit": 5, "queries": 5,
    "driver": 6,
    "__init__": 7,
}


def _modules() -> dict[str, ast.Module]:
    return {path.stem: ast.parse(path.read_text(), str(path)) for path in sorted(EMU.glob("*.py"))}


def _targets(node: ast.Import | ast.ImportFrom, known: set[str]) -> set[str]:
    """The emulator modules an import statement names (relative ``from . import x`` and ``from .x import y``,
    absolute ``amdxdna_direct.emu.x``)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
        return {n.split(".")[2] for n in names if n.startswith("amdxdna_direct.emu.")} & known
    if node.level == 1 or (node.module or "").startswith("amdxdna_direct.emu"):
        base = (node.module or "") if node.level == 1 else (node.module or "").removeprefix("amdxdna_direct.emu")
        base = base.lstrip(".")
        if base:
            return {base.split(".")[0]} & known
        return {alias.name for alias in node.names} & known
    return set()


def import_graph() -> tuple[dict[str, set[str]], list[tuple[str, int, str]]]:
    """(module -> emulator modules it imports, [(module, line, target) of imports inside a function])."""
    modules = _modules()
    known = set(modules)
    graph: dict[str, set[str]] = {name: set() for name in modules}
    nested: list[tuple[str, int, str]] = []
    for name, tree in modules.items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for inner in ast.walk(node):
                    if isinstance(inner, (ast.Import, ast.ImportFrom)):
                        nested += [(name, inner.lineno, t) for t in _targets(inner, known)]
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                graph[name] |= _targets(node, known) - {name}
    return graph, nested


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None (depth-first search, three colours)."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt):], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_cycle_among_the_emulator_modules():
    graph, _ = import_graph()
    assert find_cycle(graph) is None, f"import cycle: {' -> '.join(find_cycle(graph) or [])}"


def test_no_function_level_import_of_an_emulator_module():
    _, nested = import_graph()
    assert nested == [], f"imports inside functions: {nested}"


def test_every_import_runs_down_the_layers():
    graph, _ = import_graph()
    assert set(graph) <= set(LAYERS), f"modules without a layer: {set(graph) - set(LAYERS)}"
    upward = [(m, t) for m, targets in graph.items() for t in targets if LAYERS[t] >= LAYERS[m]]
    assert upward == [], f"imports that do not run down: {upward}"


def test_the_checker_finds_a_cycle_and_a_nested_import():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    tree = ast.parse("def f():\n    from .driver import EmuDevice\n")
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom))
    assert _targets(node, {"driver"}) == {"driver"}
    tree = ast.parse("if TYPE_CHECKING:\n    from . import objects\n")
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom))
    assert _targets(node, {"objects"}) == {"objects"}


@pytest.mark.parametrize("module", ["objects", "firmware", "buffers", "submit"])
def test_no_module_below_the_driver_names_it(module):
    graph, _ = import_graph()
    assert "driver" not in graph[module]
