"""The package layout stays true: layers as folders, imports only downward, no cycles.

Walks every module of ``python/fastckpt`` with :mod:`ast` (function-level imports included, since a lazy import
is still a dependency) and checks the rules the README's "Layout" section states:

- layer 0: ``errors``, ``_version``, the native ``_core``; 1: ``_format``; 2: ``_io``; 3: ``_state``;
  4: ``_plan``; 5 (public): the package root, ``torch``, ``checkpoint``, ``accelerate``, ``dcp``, ``cli``, ``demo``;
- a module imports only from its own layer or a lower one (so a private module never imports a public one);
- the module graph has no cycle;
- inside ``_io`` (layer 2), every module belongs to one declared sub-package, and a sub-package imports only from
  itself and the ones declared before it in :data:`IO_ORDER` (so the sub-packages have no cycle either); each holds
  at most :data:`IO_MAX_MODULES` modules and says in its ``__init__`` docstring what it may import.
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
    assert {"fastckpt._format.tensors", "fastckpt._io.storage.local.commit", "fastckpt._state.model", "fastckpt._plan.load",
            "fastckpt.checkpoint", "fastckpt.torch"} <= set(GRAPH)
    assert "fastckpt._format.tensors" in GRAPH["fastckpt._io.storage.local.commit"]
    assert "fastckpt._core" in GRAPH["fastckpt._io.storage.local.commit"]


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


# The sub-packages of _io, lowest first: each may import only from itself and the ones above it in this list. A module
# belongs to the longest entry its name starts with ("fastckpt._io" itself: the few shared modules at the top of the
# folder). A new storage backend is one more entry between the interface and the resolver.
IO_ORDER = [
    "fastckpt._io",  # shared: files (SavePlan), log, location, safe_open, device_load, tensor_hashes
    "fastckpt._io.group",  # process-group plumbing
    "fastckpt._io.storage.base",  # the storage interface every backend implements
    "fastckpt._io.storage.local",  # local folders: layout, staging, commit, pinned reads, numbering
    "fastckpt._io.async_save",  # background writing into a local staging folder
    "fastckpt._io.dcp",  # DCP metadata and parts, consolidation
    "fastckpt._io.storage.object",  # s3://: manifest object last, in-memory reads
    "fastckpt._io.storage.memory",  # the shared-memory tier
    "fastckpt._io.storage.peer",  # peer replicas
    "fastckpt._io.storage.tiered",  # local then remote
    "fastckpt._io.storage",  # the resolver: a location becomes one Storage (one line per URL scheme)
]
IO_MAX_MODULES = 12


def io_unit(module: str) -> str | None:
    """The declared ``_io`` sub-package of ``module`` (None outside ``_io``)."""
    if module != "fastckpt._io" and not module.startswith("fastckpt._io."):
        return None
    units = [u for u in IO_ORDER if module == u or module.startswith(u + ".")]
    return max(units, key=len)


def io_units_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The import graph between ``_io`` sub-packages."""
    units: dict[str, set[str]] = {}
    for module, deps in graph.items():
        if (unit := io_unit(module)) is not None:
            units.setdefault(unit, set()).update(u for d in deps if (u := io_unit(d)) not in (None, unit))
    return units


def test_every_io_module_is_in_a_declared_sub_package():
    folders = {f"fastckpt._io.{p.relative_to(PACKAGE / '_io').parent.as_posix().replace('/', '.')}".rstrip(".")
               for p in (PACKAGE / "_io").rglob("*.py")}
    undeclared = sorted(f for f in folders if f != "fastckpt._io." and io_unit(f) != f)
    assert not undeclared, "add these _io sub-packages to IO_ORDER: " + ", ".join(undeclared)


@pytest.mark.parametrize("module", sorted(m for m in GRAPH if io_unit(m) is not None))
def test_io_sub_packages_import_only_those_declared_below(module):
    rank = IO_ORDER.index(io_unit(module))
    upward = sorted(d for d in GRAPH[module] if io_unit(d) is not None and IO_ORDER.index(io_unit(d)) > rank)
    assert not upward, f"{module} ({io_unit(module)}) imports _io sub-packages declared after its own: " + ", ".join(
        f"{d} ({io_unit(d)})" for d in upward)


def test_no_cycles_between_io_sub_packages():
    units = io_units_graph(GRAPH)
    assert {"fastckpt._io.storage.local", "fastckpt._io.async_save"} <= set(units)  # the walk sees them
    cycle = find_cycle(units)
    assert cycle is None, "import cycle between _io sub-packages: " + " -> ".join(cycle)


def test_io_sub_packages_are_small_and_say_what_they_may_import():
    for folder in [PACKAGE / "_io", *(p.parent for p in (PACKAGE / "_io").rglob("__init__.py"))]:
        modules = [p for p in folder.glob("*.py") if p.name != "__init__.py"]
        assert len(modules) <= IO_MAX_MODULES, f"{folder}: {len(modules)} modules, split it by concern"
        doc = ast.get_docstring(ast.parse((folder / "__init__.py").read_text()))
        assert doc and "May import" in doc, f"{folder}/__init__.py needs a docstring saying what it may import"
