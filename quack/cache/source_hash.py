"""Content hash of a kernel family's source and the package modules it imports.

A family's objects must be rebuilt when its module, or any project module it
(transitively) imports, changes -- and only then. Files are hashed by content in
sorted package-relative path order, so the checkout's location never matters.
The ``cache``, ``compile_only``, ``launch`` and ``testing`` subpackages are excluded: they do not shape the
kernels' bytes.

Only modules named by ``import`` statements are followed (anywhere in the file,
lazy imports included). The package's own ``__init__.py`` is included only when
a module imports the package itself (``import quack``, or ``from quack import
name`` where ``name`` is not a submodule); importing ``quack.rmsnorm`` does not
pull in ``quack/__init__.py``.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib
import importlib.util
import os
from pathlib import Path

EXCLUDED_SUBPACKAGES = ("cache", "compile_only", "launch", "testing")

# module name -> source hash taken when the module was imported (``record_imported``).
_AS_IMPORTED: dict[str, str] = {}


def record_imported(module_name: str) -> str:
    """Take (once) the source hash of a module that is being imported: its
    file and the modules it imports as they are now, not as they may be at
    its first compile (an edit after import would otherwise export the old
    code under the new code's key).  ``jit_cache`` calls it as it decorates a
    compile function, i.e. while the family's module executes."""
    found = _AS_IMPORTED.get(module_name)
    if found is None:
        found = _AS_IMPORTED.setdefault(module_name, module_source_hash(module_name))
    return found


@functools.lru_cache(maxsize=None)
def module_source_hash(module_name: str) -> str:
    """Source hash of an imported module, computed once per process.

    Paths are made absolute but symlinks are not resolved: in Bazel runfiles each
    file is a symlink out of the tree, and resolving would break the relative
    paths that make the hash location-independent.
    """
    module_file = Path(os.path.abspath(importlib.import_module(module_name).__file__))
    top = module_name.split(".")[0]
    spec = importlib.util.find_spec(top)
    if spec is None or not spec.submodule_search_locations:
        # A lone module (a script): hash just its own file.
        return package_source_hash(module_file, module_file.parent, top)
    locations = [Path(os.path.abspath(p)) for p in spec.submodule_search_locations]
    package_dir = next((p for p in locations if module_file.is_relative_to(p)), locations[0])
    return package_source_hash(module_file, package_dir, top)


def package_source_hash(module_file: Path, package_dir: Path, package_name: str) -> str:
    """sha256 over ``module_file`` and the files under ``package_dir`` it imports."""
    files = _import_closure(Path(module_file), Path(package_dir), package_name)
    digest = hashlib.sha256()
    for rel in sorted(files):
        digest.update(rel.encode() + b"\0")
        digest.update(hashlib.sha256(files[rel].read_bytes()).digest())
    return digest.hexdigest()


def _import_closure(start: Path, package_dir: Path, package_name: str) -> dict[str, Path]:
    """Map package-relative posix path -> file, for ``start`` and its imports."""
    found: dict[str, Path] = {}
    pending = [start]
    while pending:
        path = pending.pop()
        rel = _relative_name(path, package_dir)
        if rel in found or _excluded(rel):
            continue
        found[rel] = path
        module = _module_name(path, package_dir, package_name)
        for base, members in _imports(path, module):
            pending.extend(_import_targets(base, members, package_dir, package_name))
    return found


def _relative_name(path: Path, package_dir: Path) -> str:
    try:
        return path.relative_to(package_dir).as_posix()
    except ValueError:
        return path.name  # a lone module outside any package


def _excluded(rel: str) -> bool:
    return rel.split("/")[0] in EXCLUDED_SUBPACKAGES and "/" in rel


def _module_name(path: Path, package_dir: Path, package_name: str) -> str:
    """Dotted name of a file inside the package (``pkg.sub`` for ``pkg/sub/__init__.py``)."""
    try:
        parts = list(path.relative_to(package_dir).with_suffix("").parts)
    except ValueError:
        return path.stem
    if parts and parts[-1] == "__init__":
        parts.pop()
    return ".".join([package_name, *parts])


def _imports(path: Path, module: str) -> list[tuple[str, list[str] | None]]:
    """(absolute module, imported members or None) for each import in a file."""
    is_package = path.name == "__init__.py"
    tree = ast.parse(path.read_bytes(), filename=str(path))
    found: list[tuple[str, list[str] | None]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((alias.name, None) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _absolute_base(node, module, is_package)
            if base is not None:
                found.append((base, [alias.name for alias in node.names]))
    return found


def _import_targets(
    base: str, members: list[str] | None, package_dir: Path, package_name: str
) -> list[Path]:
    """Files an import loads: submodules named in ``from base import a, b``, and
    ``base`` itself when it is a plain import or some member is not a submodule."""
    targets = []
    needs_base = members is None
    for member in members or []:
        sub = None if member == "*" else _module_file(f"{base}.{member}", package_dir, package_name)
        if sub is None:
            needs_base = True
        else:
            targets.append(sub)
    if needs_base:
        base_file = _module_file(base, package_dir, package_name)
        if base_file is not None:
            targets.append(base_file)
    return targets


def _absolute_base(node: ast.ImportFrom, module: str, is_package: bool) -> str | None:
    if node.level == 0:
        return node.module
    package = module.split(".") if is_package else module.split(".")[:-1]
    if node.level - 1 > len(package) - 1:
        return None  # relative import beyond the top-level package
    anchor = package[: len(package) - (node.level - 1)]
    return ".".join(anchor + ([node.module] if node.module else []))


def _module_file(name: str, package_dir: Path, package_name: str) -> Path | None:
    """The file inside the package that defines dotted ``name``, if any."""
    parts = name.split(".")
    if parts[0] != package_name:
        return None
    base = package_dir.joinpath(*parts[1:])
    for candidate in (base.with_suffix(".py") if parts[1:] else None, base / "__init__.py"):
        if candidate is not None and candidate.is_file():
            return candidate
    return None
