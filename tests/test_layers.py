"""The package's layers (docs/architecture.md): no module imports from a layer
above its own, and no two modules import each other, directly or around a
circle, lazy imports inside functions included."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "quack"

# Bottom to top, as docs/architecture.md lists them: a module's layer is its
# first package folder (the top-level modules and quack/testing/ form the top).
# The root, quack/__init__.py, is below them all: every import runs it, and it
# imports no module of the package (it binds the public ops on first use).
LAYERS = ["root", "launch", "cache", "compile_only", "calls", "rowwise", "families", "top"]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def layer_of(module: str) -> str:
    if module == "quack":
        return "root"
    parts = module.split(".")
    if len(parts) > 1 and parts[1] in LAYERS:
        return parts[1]
    return "top"


def _resolve(name: str) -> str | None:
    """The package module an import of ``name`` loads (a name inside a module: that module)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(module: str) -> set[str]:
    """The package modules ``module`` imports (``from pkg import sub`` names the submodule)."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                base = f"{base}.{node.module}" if node.module else base
            else:
                base = node.module
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]
        else:
            continue
        found.update(m for m in map(_resolve, names) if m and m != module)
    return found


GRAPH = {module: imports_of(module) for module in MODULES}


def _is_parent_package(importer: str, imported: str) -> bool:
    # Importing a submodule runs its packages' __init__ files first; a package
    # re-exporting its own submodules is not a circle of its own.
    return importer.startswith(imported + ".") or imported.startswith(importer + ".")


def test_no_module_imports_from_a_layer_above_its_own():
    upward = [
        f"{module} ({layer_of(module)}) imports {other} ({layer_of(other)})"
        for module, imported in GRAPH.items()
        for other in sorted(imported)
        if LAYERS.index(layer_of(other)) > LAYERS.index(layer_of(module))
    ]
    assert not upward, "imports from a higher layer:\n" + "\n".join(upward)


def test_no_import_circle():
    edges = {m: {o for o in imported if not _is_parent_package(m, o)} for m, imported in GRAPH.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    circles = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for other in sorted(edges[module]):
            if state.get(other) == 1:
                circles.append(" -> ".join(path[path.index(other):] + [module, other]) if other in path else f"{module} -> {other}")
            elif other not in state:
                visit(other, path + [module])
        state[module] = 2

    for module in sorted(edges):
        if module not in state:
            visit(module, [])
    assert not circles, "import circles:\n" + "\n".join(circles)


@pytest.mark.parametrize("layer", ["cache", "launch"])
def test_the_cache_and_the_launcher_import_no_torch_op_or_plan(layer):
    reached = {m for m in GRAPH if layer_of(m) == layer}
    pending = list(reached)
    while pending:
        for other in GRAPH[pending.pop()]:
            if other not in reached:
                reached.add(other)
                pending.append(other)
    assert {layer_of(m) for m in reached} <= {"root", "launch", "cache"}, sorted(reached)


def test_the_root_imports_no_module_of_the_package():
    assert GRAPH["quack"] == set()


def test_the_layer_check_sees_every_import_form():
    # Fails if the AST walk missed lazy, relative or from-package imports.
    assert "quack.calls.plan" in GRAPH["quack.calls.manifest"]  # inside functions
    assert "quack.launch.handle" in GRAPH["quack.cache.jit"]
    assert "quack.cache.key" in GRAPH["quack.cache.native"]  # from . import key
