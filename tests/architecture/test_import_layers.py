"""The package layout stays true: layers as folders, imports only downward, no cycles.

Walks every module of ``python/fastckpt`` with :mod:`ast` (function-level imports included, since a lazy import
is still a dependency) and checks the rules the README's "Layout" section states:

- layer 0: ``errors``, ``_version``, the native ``_core``; 1: ``_format``; 2: ``_io``; 3: ``_state``;
  4: ``_plan``; 5 (public): the package root, ``torch``, ``checkpoint``, ``accelerate``, ``dcp``, ``cli``, ``demo``;
- a module imports only from its own layer or a lower one (so a private module never imports a public one);
- the module graph has no cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "python" / "fastckpt"

LAYERS = {"errors": 0, "_version": 0, "_core": 0, "_format": 1, "_io": 2, "_state": 3, "_plan": 4}
PUBLIC = 5


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer(module: str) -> int:
    parts = module.split(".")
    return LAYERS.get(parts[1], PUBLIC) if len(parts) > 1 else PUBLIC


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in PACKAGE.rglob("*.py")}


def resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports(known: dict[str, Path]) -> dict[str, set[str]]:
    """``{module: {fastckpt modules it imports}}`` (``from pkg import mod`` counts as importing ``pkg.mod``)."""
    graph: dict[str, set[str]] = {}
    native = {"fastckpt._core"}
    for module, path in known.items():
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name.split(".")[0] == "fastckpt"}
            elif isinstance(node, ast.ImportFrom):
                target = resolve(module, path.name == "__init__.py", node)
                if target.split(".")[0] != "fastckpt":
                    continue
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    deps.add(sub if sub in known or sub in native else target)
        deps.discard(module)
        graph[module] = deps
    return graph


GRAPH = imports(modules())


def test_walk_sees_the_package():
    # the walk itself must see the layers, or every rule below would pass vacuously
    assert {"fastckpt._format.tensors", "fastckpt._io.commit", "fastckpt._state.model", "fastckpt._plan.load",
            "fastckpt.checkpoint", "fastckpt.torch"} <= set(GRAPH)
    assert "fastckpt._format.tensors" in GRAPH["fastckpt._io.commit"]
    assert "fastckpt._core" in GRAPH["fastckpt._io.commit"]


@pytest.mark.parametrize("module", sorted(GRAPH))
def test_imports_point_down(module):
    upward = sorted(d for d in GRAPH[module] if layer(d) > layer(module))
    assert not upward, f"{module} (layer {layer(module)}) imports higher layers: " + ", ".join(
        f"{d} (layer {layer(d)})" for d in upward)


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return stack[stack.index(dep):] + [dep]
            if dep not in state and (found := visit(dep)) is not None:
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)) is not None:
            return found
    return None


def test_no_import_cycles():
    cycle = find_cycle(GRAPH)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_cycle_finder_finds_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_every_layer_folder_has_a_docstring_saying_what_it_may_import():
    for folder in ["_format", "_io", "_state", "_plan", "accelerate", "cli", "demo"]:
        doc = ast.get_docstring(ast.parse((PACKAGE / folder / "__init__.py").read_text()))
        assert doc and "import" in doc, f"{folder}/__init__.py needs a docstring saying what the layer may import"
