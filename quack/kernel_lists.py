"""Kernel lists: the objects a family's tests and manifests need, found without compiling.

A family's list for one selection of the correctness matrices (``ci``,
``full``, ``smoke``: quack/testing/matrix.py) is a manifest
(quack/calls/manifest.py) of the call signatures that ``pytest
--compile-only`` over the family's tests plans, plus the family's calls of the
given manifests (under ``smoke`` each manifest's first call, as warming
takes them).  It is found in seconds: the run plans every call, but each
object it asks for is only noted (``jit.listing``), never looked up or
compiled.

Each object is a *unit* (``warm.Unit``), one build action: its compile function and static
arguments, the object key without what every object of a build shares
(sources, DSL version, arch).  Its id, a hash of that, names the action's
output, so adding a signature adds actions and moves none.  The units are
every object of the family asked for: the calls' plans, and what a
kernel's own test compiles directly.

    python -m quack.kernel_lists --family F --selection S --tests T... --configs M... --out FILE

tools/kernel_lists.py writes the committed lists from these runs and checks
them; tools/warm_cache.py --unit compiles a unit (a Bazel kernel action).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from quack.warm import Unit

SELECTIONS = ("ci", "full", "smoke")


@dataclasses.dataclass
class FamilyList:
    """What one family's tests and manifests need under one selection."""

    signatures: list[str]  # manifest entry lines, sorted
    units: list["Unit"]  # sorted by id


def enumerate_family(family: str, tests: Sequence[str], manifests: Sequence[str], rootdir: Path,
                     shard: str | None = None) -> FamilyList:
    """Run ``tests`` under ``pytest --compile-only`` and plan the family's
    manifest calls, in this process, noting objects instead of compiling
    them (the selection is QUACK_MATRIX's).  The units are every object of
    the family asked for: the calls' plans, and what a test compiles
    directly (a kernel's own test calling its compile function).
    ``shard`` ("I/N"): the I-th of N interleaved parts of the tests (the
    manifests in part 0 only); the parts' union is the whole."""
    from quack import warm
    from quack.cache import jit
    from quack.warm import unit_of
    from quack.calls import manifest, plan
    from quack.calls.recording import RECORD_ENV
    from quack.compile_only import compile_only_mode

    with tempfile.TemporaryDirectory(prefix="quack-lists-") as tmp:
        record = Path(tmp) / "calls.jsonl"
        settings = {RECORD_ENV: str(record), "QUACK_CACHE_DIR": tmp, "QUACK_CACHE_PATH": None, "QUACK_CACHE_STRICT": None}
        with warm._environment(settings), jit.listing() as asked:
            if tests:
                warm.warm_tests(tests, rootdir, ["--quack-shard", shard] if shard else [])
            calls = manifest.read(record, [family]) if record.exists() else []
            if shard is None or int(shard.partition("/")[0]) == 0:
                calls += [sig for _, sig in warm.read_manifests(manifests, {family})]
            os.environ.pop(RECORD_ENV)
            for sig in calls:
                with compile_only_mode():
                    plan.plan_for(sig).warm()
    units = {unit_of(obj) for obj in asked.values() if obj.family == family}
    return FamilyList(sorted({plan.entry_line(sig) for sig in calls}), sorted(units, key=lambda u: u.id))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m quack.kernel_lists",
                                     description="List one family's signatures and units under one selection.")
    parser.add_argument("--family", required=True)
    parser.add_argument("--selection", choices=SELECTIONS, required=True)
    parser.add_argument("--tests", nargs="*", default=[], help="the family's test files")
    parser.add_argument("--configs", nargs="*", default=[], help="manifests whose calls of the family to plan")
    parser.add_argument("--rootdir", default=".", help="pytest's root folder")
    parser.add_argument("--out", required=True, help="JSON file to write: {signatures, units}")
    parser.add_argument("--shard", metavar="I/N", help="the I-th of N interleaved parts of the tests")
    args = parser.parse_args(argv)

    os.environ["QUACK_MATRIX"] = args.selection  # read as the tests' cases are collected
    found = enumerate_family(args.family, args.tests, args.configs, Path(args.rootdir), args.shard)
    result = {"signatures": found.signatures, "units": [unit.text for unit in found.units]}
    Path(args.out).write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
