"""Kernel lists: the objects a family's tests and manifests need, found without compiling.

A family's list for one selection of the correctness matrices (``ci``,
``full``, ``smoke``: quack/testing/matrix.py) is a manifest
(quack/calls/manifest.py) of the call signatures that ``pytest
--compile-only`` over the family's tests plans, plus the family's calls of the
given manifests (under ``smoke`` each manifest's first call, as warming
takes them).  It is found in seconds: the run plans every call, but each
object it asks for is only noted (``jit.listing``), never looked up or
compiled.

Each object is a *unit*, one build action: its compile function and static
arguments, the object key without what every object of a build shares
(sources, DSL version, arch).  Its id, a hash of that, names the action's
output, so adding a signature adds actions and moves none.  The units are
every object of the family asked for: the calls' plans, and what a
kernel's own test compiles directly.

    python -m quack.kernel_lists enumerate --family F --selection S --tests T... --configs M... --out FILE
    python -m quack.kernel_lists compile --out DIR UNIT_JSON...

tools/kernel_lists.py writes the committed lists from these runs and checks them.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Sequence

SELECTIONS = ("ci", "full", "smoke")


@dataclasses.dataclass(frozen=True)
class Unit:
    """One object to build: a family's compile function and its static arguments."""

    family: str
    function: str  # module.qualname of the jit_cache compile function
    args: str  # canonical JSON of the bound arguments

    @property
    def text(self) -> str:
        """The unit as one canonical JSON line (an action's argument)."""
        return json.dumps({"family": self.family, "function": self.function, "args": json.loads(self.args)},
                          sort_keys=True, separators=(",", ":"))

    @property
    def id(self) -> str:
        """A name that depends on the unit alone: its action's output folder."""
        return hashlib.sha256(self.text.encode()).hexdigest()[:16]

    @classmethod
    def from_text(cls, text: str) -> "Unit":
        data = json.loads(text)
        if not isinstance(data, dict) or set(data) != {"family", "function", "args"} or not isinstance(data["args"], dict):
            raise ValueError(f"not a kernel unit: {text!r}")
        return cls(data["family"], data["function"], json.dumps(data["args"], sort_keys=True, separators=(",", ":")))


def unit_of(listed) -> Unit:
    """The unit of a ``jit.ListedObject``."""
    return Unit(listed.family, listed.function, json.dumps(listed.args, sort_keys=True, separators=(",", ":")))


def _as_call_value(value: Any) -> Any:
    """A JSON value as the compile function was called with it (lists were tuples)."""
    return tuple(_as_call_value(v) for v in value) if isinstance(value, list) else value


def compile_unit(unit: Unit) -> None:
    """Export ``unit``'s object into the writable layer (QUACK_CACHE_DIR), in compile-only mode."""
    from quack.compile_only import compile_only_mode

    module, _, name = unit.function.rpartition(".")
    compile_function = getattr(importlib.import_module(module), name)
    args = {key: _as_call_value(value) for key, value in json.loads(unit.args).items()}
    with compile_only_mode():
        compile_function(**args)


@dataclasses.dataclass
class FamilyList:
    """What one family's tests and manifests need under one selection."""

    signatures: list[str]  # manifest entry lines, sorted
    units: list[Unit]  # sorted by id


def enumerate_family(family: str, tests: Sequence[str], manifests: Sequence[str], rootdir: Path) -> FamilyList:
    """Run ``tests`` under ``pytest --compile-only`` and plan the family's
    manifest calls, in this process, noting objects instead of compiling
    them (the selection is QUACK_MATRIX's).  The units are every object of
    the family asked for: the calls' plans, and what a test compiles
    directly (a kernel's own test calling its compile function)."""
    from quack import warm
    from quack.cache import jit
    from quack.calls import manifest, plan
    from quack.calls.recording import RECORD_ENV
    from quack.compile_only import compile_only_mode

    with tempfile.TemporaryDirectory(prefix="quack-lists-") as tmp:
        record = Path(tmp) / "calls.jsonl"
        settings = {RECORD_ENV: str(record), "QUACK_CACHE_DIR": tmp, "QUACK_CACHE_PATH": None, "QUACK_CACHE_STRICT": None}
        with warm._environment(settings), jit.listing() as asked:
            if tests:
                warm.warm_tests(tests, rootdir)
            calls = manifest.read(record, [family]) if record.exists() else []
            calls += [sig for _, sig in warm.read_manifests(manifests, {family})]
            os.environ.pop(RECORD_ENV)
            for sig in calls:
                with compile_only_mode():
                    plan.plan_for(sig).warm()
    units = {unit_of(obj) for obj in asked.values() if obj.family == family}
    return FamilyList(sorted({plan.entry_line(sig) for sig in calls}), sorted(units, key=lambda u: u.id))


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m quack.kernel_lists")
    sub = parser.add_subparsers(dest="command", required=True)
    enum = sub.add_parser("enumerate", help="list one family's signatures and units under one selection")
    enum.add_argument("--family", required=True)
    enum.add_argument("--selection", choices=SELECTIONS, required=True)
    enum.add_argument("--tests", nargs="*", default=[])
    enum.add_argument("--configs", nargs="*", default=[])
    enum.add_argument("--rootdir", default=".")
    enum.add_argument("--out", required=True, help="JSON file: {signatures, units}")
    comp = sub.add_parser("compile", help="export units' objects into QUACK_CACHE_DIR")
    comp.add_argument("units", nargs="+", metavar="UNIT_JSON")
    args = parser.parse_args(argv)

    if args.command == "enumerate":
        os.environ["QUACK_MATRIX"] = args.selection
        try:
            found = enumerate_family(args.family, args.tests, args.configs, Path(args.rootdir))
        except ValueError as e:
            print(f"kernel_lists: {e}", file=sys.stderr)
            return 1
        _write_json(Path(args.out), {"signatures": found.signatures, "units": [u.text for u in found.units]})
        return 0
    for text in args.units:
        compile_unit(Unit.from_text(text))
    return 0


if __name__ == "__main__":
    sys.exit(main())
