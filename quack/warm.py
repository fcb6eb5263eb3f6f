"""Warm a kernel cache folder in compile-only mode: no GPU, nothing launched.

    python -m quack.warm calls.jsonl [--out DIR] [--family F] [--arch sm_90a]

compiles every call of the manifests (``quack/calls/manifest.py``: a file
recorded with ``QUACK_CACHE_RECORD=FILE``, or tools/configs/production.jsonl)
into ``DIR`` (default: the writable layer, ``QUACK_CACHE_DIR``), through each
call's plan. Bazel's tools/warm_cache.py runs the same code, with test files
warmed through ``pytest --compile-only`` as well.

The folder ends up holding ``<family>/<key>.o`` + ``.json`` entries and
``manifest.json`` (every entry that verifies: key hash, family, file, sha256,
sorted), byte-identical from run to run. Only the cache's own files are ever
written there, and nothing is deleted: kernels are compiled into a private
staging layer (where the cache keeps its key locks and temporaries), and each
new entry, verified, is copied into the folder (replacing a damaged entry of
the same key, as the cache itself would). Entries already in the folder are
used as they are. A folder that is neither new, empty, nor a cache layer (a
project checkout given by mistake) is refused before anything runs.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import hashlib
import importlib
import json
import logging
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

from quack.cache import maintenance
from quack.cache.errors import CacheError
from quack.cache.key import canonical_json
from quack.cache.stats import stats
from quack.cache.folders import MANIFEST, write_manifest
from quack.cache.store import Layer, ensure_layer_dir, family_folder

if TYPE_CHECKING:
    from quack.calls.plan import Signature

log = logging.getLogger("quack.warm")

# A family folder's own files: entries, key locks beside them, and (hidden) the
# cache's export temporaries and folders it moved aside.
_FAMILY_FILE = re.compile(rf"{maintenance.KEYHASH.pattern}\.(o|json|lock)|\..*")


@dataclasses.dataclass(frozen=True)
class Unit:
    """One object to build: a family's compile function and its static arguments."""

    family: str
    function: str  # module.qualname of the jit_cache compile function
    args: str  # canonical JSON of the bound arguments

    @property
    def text(self) -> str:
        """The unit as one canonical JSON line (an action's argument)."""
        return canonical_json({"family": self.family, "function": self.function, "args": json.loads(self.args)})

    @property
    def id(self) -> str:
        """A name that depends on the unit alone: its action's output folder."""
        return hashlib.sha256(self.text.encode()).hexdigest()[:16]

    @classmethod
    def from_text(cls, text: str) -> "Unit":
        try:
            data = json.loads(text)
        except json.JSONDecodeError:
            data = None
        if not isinstance(data, dict) or set(data) != {"family", "function", "args"} or not isinstance(data["args"], dict):
            raise ValueError(f"not a kernel unit: {text!r}")
        return cls(data["family"], data["function"], canonical_json(data["args"]))


def unit_of(listed) -> Unit:
    """The unit of a ``jit.ListedObject``."""
    return Unit(listed.family, listed.function, canonical_json(listed.args))


def _as_call_value(value: Any) -> Any:
    """A JSON value as the compile function was called with it (lists were tuples)."""
    return tuple(_as_call_value(v) for v in value) if isinstance(value, list) else value


def compile_unit(unit: Unit) -> Callable[[], Any]:
    """What exports ``unit``'s object into the writable layer (QUACK_CACHE_DIR)
    when called in compile-only mode.  Raises ``ValueError`` unless the unit
    names a compile function (a ``jit_cache`` one) of its own kernel family."""
    module, _, name = unit.function.rpartition(".")
    compile_function = getattr(importlib.import_module(module), name, None)
    args = {key: _as_call_value(value) for key, value in json.loads(unit.args).items()}
    if not hasattr(compile_function, "request") or compile_function.request(**args).family != unit.family:
        raise ValueError(f"not a compile function of kernel family {unit.family!r}: {unit.function}")
    return functools.partial(compile_function, **args)


class OutputFolderError(CacheError):
    """The folder to warm is not one this module may write into."""


@dataclasses.dataclass
class WarmResult:
    """What a warm run left in its folder."""

    objects: list[dict]  # manifest.json's entries: every entry of the folder that verifies
    exported: int  # entries this run added
    calls: int  # manifest calls warmed
    compile_seconds: float

    @property
    def already_present(self) -> int:
        return len(self.objects) - self.exported


def foreign_content(out: Path) -> str:
    """The first thing in folder ``out`` a cache layer never holds (``""``:
    none, or ``out`` does not exist): anything but family folders of entries,
    ``manifest.json`` and the cache's hidden folders."""
    try:
        children = sorted(os.scandir(out), key=lambda e: e.name)
    except FileNotFoundError:
        return ""
    for child in children:
        if child.name.startswith(".") and child.is_dir(follow_symlinks=False):
            continue  # the cache's own: key locks, an install's staging
        if child.name == MANIFEST and child.is_file(follow_symlinks=False):
            continue
        if not (maintenance.FAMILY.fullmatch(child.name) and child.is_dir(follow_symlinks=False)):
            return child.name
        for name in sorted(os.listdir(child.path)):
            if not _FAMILY_FILE.fullmatch(name):
                return f"{child.name}/{name}"
    return ""


def check_output_folder(out: Path) -> None:
    """Raise ``OutputFolderError`` unless ``out`` is new, empty, or a cache layer."""
    if os.path.lexists(out) and not out.is_dir():
        raise OutputFolderError(f"{out} is not a folder")
    foreign = foreign_content(out)
    if foreign:
        raise OutputFolderError(
            f"{out} is neither empty nor a kernel cache folder (it holds {foreign!r}): "
            "give a new or empty folder, or a cache folder (<family>/<key>.o and .json entries)"
        )


@contextlib.contextmanager
def _environment(values: dict[str, str | None]) -> Iterator[None]:
    """Set (None: unset) environment variables for the block, then restore them."""
    saved = {name: os.environ.get(name) for name in values}
    try:
        for name, value in values.items():
            _set(name, value)
        yield
    finally:
        for name, value in saved.items():
            _set(name, value)


def _set(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


def read_manifests(paths: Sequence[str | Path], families: set[str]) -> list[tuple[str, Signature]]:
    """(manifest, signature) of every call of the manifests of the selected
    families (an op's name is its family's; none selected: all); under
    ``QUACK_MATRIX=smoke`` only the first call of each manifest (the Bazel
    wiring checks' selection). Raises ``manifest.ManifestError`` for a
    manifest it cannot read, ``OSError`` for one it cannot open."""
    from quack.calls import manifest
    from quack.testing import matrix

    calls = []
    for path in paths:
        signatures = manifest.read(path, families or None)
        if matrix.selection() == "smoke":
            signatures = signatures[:1]
        calls += [(str(path), sig) for sig in signatures]
    return calls


def warm_calls(calls: Sequence[tuple[str, Signature]]) -> None:
    """Warm each call's plan in compile-only mode."""
    from quack.calls import plan
    from quack.compile_only import compile_only_mode

    for path, sig in calls:
        log.info("%s: %s", path, plan.entry_line(sig))
        with compile_only_mode():
            plan.plan_for(sig).warm()


def warm_units(compiles: Sequence[tuple[Unit, Callable[[], Any]]]) -> None:
    """Export each unit's object (``compile_unit``), in compile-only mode."""
    from quack.compile_only import compile_only_mode

    for unit, compile_it in compiles:
        log.info("unit %s", unit.text)
        with compile_only_mode():
            compile_it()


def warm_tests(test_files: Sequence[str], rootdir: Path, pytest_args: Sequence[str] = ()) -> None:
    """``pytest --compile-only`` over ``test_files``, in this process
    (``pytest_args``: more options, such as the plugin's ``--quack-shard``)."""
    import pytest

    log.info("pytest --compile-only %s", " ".join([*pytest_args, *test_files]))
    code = pytest.main(
        ["--compile-only", "-q", "-p", "quack.testing.pytest_plugin", "-p", "no:cacheprovider",
         "--rootdir", str(rootdir), *pytest_args, *test_files]
    )
    if code != 0:
        raise SystemExit(f"pytest --compile-only failed with exit code {int(code)}")


def warm(
    out: Path,
    *,
    manifests: Sequence[str | Path] = (),
    families: Sequence[str] = (),
    tests: Sequence[str] = (),
    units: Sequence[str] = (),
    rootdir: Path | None = None,
    arch: str | None = None,
) -> WarmResult:
    """Warm ``out`` from test files (run under ``rootdir``), manifests and
    units (objects by compile function and arguments: ``kernel_lists.Unit``
    texts, one Bazel action each); see the module docstring.

    Raises ``OutputFolderError`` for a folder it may not write into and
    ``manifest.ManifestError`` for a bad manifest, both before anything runs.
    """
    out = Path(out).resolve()
    check_output_folder(out)
    calls = read_manifests(manifests, set(families))
    # A bad unit is refused before anything runs.
    compiles = [(unit, compile_unit(unit)) for unit in map(Unit.from_text, units)]
    layer = Layer(out, str(out), True)
    ensure_layer_dir(layer)  # created private; one others can write is refused (CacheError)
    before = stats()["compile_seconds"]
    with tempfile.TemporaryDirectory(prefix="quack-warm-") as staging:
        settings = {
            "QUACK_CACHE_DIR": staging,
            "QUACK_CACHE_PATH": str(out),  # what the folder holds already is used, not compiled again
            "QUACK_CACHE_STRICT": None,
            "QUACK_CACHE_MAX_SIZE": None,  # no staged entry may be evicted before it is copied
        }
        if arch:
            settings["QUACK_ARCH"] = arch
        with _environment(settings):
            if tests:
                warm_tests(tests, rootdir or Path.cwd())
            warm_calls(calls)
            warm_units(compiles)
        exported = _copy_entries(Layer(Path(staging), "staging", False), layer)
    objects = write_manifest(out)
    return WarmResult(objects, exported, len(calls), stats()["compile_seconds"] - before)


def _copy_entries(staging: Layer, out: Layer) -> int:
    """Copy every entry of ``staging`` into ``out``; returns how many.

    Each entry is checked first (a bad one is an error: this run wrote it).
    Its two files are copied into a private temporary folder beside their
    place (named as the cache names its export temporaries, so ``quack-cache
    verify`` removes one a killed run left) and moved in with ``os.replace``,
    sidecar last: a reader never takes a half-copied object for valid. No key
    lock is taken: its lock file would land in the folder (a Bazel output
    holds entries and the manifest only). Entries are deterministic, so a
    racing writer of the same key writes the same bytes, and a racing removal
    leaves at worst a broken entry, which readers treat as a miss.
    """
    entries = maintenance.scan(staging, read_sidecars=False)
    for entry in entries:
        problem = maintenance.check(entry)
        if problem:
            raise CacheError(f"warming wrote a bad entry {entry.name}: {problem}")
        folder = family_folder(out, entry.family)
        tmp = Path(tempfile.mkdtemp(prefix=f".{entry.keyhash}.", dir=folder))
        try:
            for source in (entry.object, entry.sidecar):
                shutil.copyfile(source, tmp / source.name)
                os.chmod(tmp / source.name, 0o600)
            for source in (entry.object, entry.sidecar):
                os.replace(tmp / source.name, folder / source.name)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return len(entries)


def summary(result: WarmResult, families: Sequence[str]) -> str:
    """One line: what the run warmed and what the folder holds."""
    return (
        f"warmed {','.join(families) or 'all families'}: {len(result.objects)} objects "
        f"({result.exported} exported now, {result.already_present} already present), "
        f"{result.calls} manifest calls, {result.compile_seconds:.1f} s compiling"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m quack.warm",
        description="Compile the calls of manifests into a kernel cache folder, without a GPU.",
    )
    parser.add_argument("manifests", nargs="+", metavar="MANIFEST",
                        help="manifest of calls (recorded with QUACK_CACHE_RECORD=FILE)")
    parser.add_argument("--out", metavar="DIR",
                        help="cache folder to fill (default: the writable layer, QUACK_CACHE_DIR)")
    parser.add_argument("--family", action="append", default=[], help="only this family's calls (repeatable)")
    parser.add_argument("--arch", help="GPU arch to compile for (default: QUACK_ARCH, else sm_90a)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m quack.warm``; returns the exit status (argparse errors exit 2 themselves)."""
    return run(build_parser().parse_args(argv))


def run(args: argparse.Namespace, prog: str = "python -m quack.warm") -> int:
    """Warm as the parsed ``args`` say (also ``quack-cache warm``, quack/cli.py); returns the exit status."""
    from quack.calls import manifest
    from quack.cache.config import read_config

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    out = Path(args.out).expanduser() if args.out else read_config().writable_dir
    try:
        result = warm(out, manifests=args.manifests, families=args.family, arch=args.arch)
    except (CacheError, manifest.ManifestError, OSError) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 1
    print(f"{summary(result, args.family)} in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
