"""Preflight: which kernel objects a job's calls need that no cache layer holds,
found without compiling anything and without a GPU.

    quack-cache preflight calls.jsonl [MANIFEST...] [--json] [--family F] [--arch sm_90a]

Each call of the manifests (``quack/calls/manifest.py``: a file recorded with
``QUACK_CACHE_RECORD=FILE``, or tools/configs/production.jsonl) is planned
(``quack/calls/plan.py``), and each kernel of its plan resolved to the key the call
would look up (its compile function's ``request``), which holds the arch.
Each key is looked up in the layers a job searches, the read-only
``QUACK_CACHE_PATH`` layers then the writable ``QUACK_CACHE_DIR``
(``--cache-path``, ``--cache-dir`` instead), and verified as the lookup
verifies it: a bad entry is missing, with a warning. Nothing is loaded,
compiled or written (a writable entry found counts as a use, as in a lookup).

The arch is ``--arch``, else ``QUACK_ARCH``, else the visible GPU's, else
sm_90a: run the check where the job runs, or name the job's arch.

Exit status: 0 every object is present; 1 some are missing (listed with the
manifest line of each call that needs them) or the check hit a cache error;
2 bad arguments, or a manifest that cannot be read (its file and line named).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from quack.cache.errors import CacheError

if TYPE_CHECKING:
    from quack.calls.plan import Kernel, Signature

DESCRIPTION = ("Report the kernel objects that the calls of manifests need and no cache layer holds "
               "(exit status 1 when any is missing), without compiling and without a GPU.")


@dataclass(frozen=True)
class Need:
    """One kernel object that one manifest call needs."""

    manifest: str
    line: int | None  # the call's line in the manifest (None: the file changed while read)
    signature: Signature
    role: str  # the kernel's role in the call's plan ("forward", "backward", ...)
    kernel: Kernel
    family: str
    key: str  # the key hash: the entry is <family>/<key>.o and .json in a layer
    present: bool

    @property
    def where(self) -> str:
        return f"{self.manifest}:{self.line}" if self.line else self.manifest

    @property
    def object(self) -> str:
        return f"{self.family}/{self.key}.o"

    @property
    def call(self) -> str:
        """The call's manifest entry, as one line."""
        from quack.calls.plan import entry_line

        return entry_line(self.signature)

    def info(self) -> dict[str, Any]:
        return {"manifest": self.manifest, "line": self.line, "call": self.signature.entry(), "role": self.role,
                "kernel": self.kernel.describe(), "family": self.family, "key": self.key, "object": self.object}


@dataclass
class Report:
    """What a preflight check found."""

    arch: str
    layers: list[Path]  # searched, in order: the read-only layers, then the writable one
    calls: int
    needs: list[Need]  # each kernel of each call, in manifest order

    @property
    def missing(self) -> list[Need]:
        return [n for n in self.needs if not n.present]

    @property
    def objects(self) -> int:
        return len({n.key for n in self.needs})

    @property
    def missing_objects(self) -> int:
        return len({n.key for n in self.missing})


def preflight(
    manifests: Sequence[str | Path],
    *,
    families: Sequence[str] = (),
    arch: str | None = None,
    cache_dir: str | Path | None = None,
    cache_path: str | None = None,
) -> Report:
    """Check the calls of ``manifests`` (only ``families``' when given)
    against the cache layers: the configured ones, or ``cache_dir`` (the
    writable layer) and ``cache_path`` (read-only layers, ``os.pathsep``-separated).

    Raises ``ValueError`` (``manifest.ManifestError`` among them) for an
    unknown family, a manifest it cannot read, or a call whose op does not
    build for the arch, naming the file and line; ``OSError`` for a manifest
    it cannot open. Every manifest is read before any lookup.
    """
    from quack.calls import plan
    from quack.cache import jit
    from quack.calls import manifest
    from quack.cache.config import read_config
    from quack.warm import _environment

    for family in families:  # a misspelt family would select no call: refused
        try:
            plan.signature_class(family)
        except ValueError as e:
            raise ValueError(f"family {family!r}: {e}") from None
    calls = [(str(path), line, sig) for path in manifests for line, sig in _numbered_calls(path, set(families))]
    settings = {"QUACK_CACHE_STRICT": None, manifest.RECORD_ENV: None}  # a bad entry is a miss; nothing recorded
    if arch:
        settings["QUACK_ARCH"] = arch
    if cache_dir is not None:
        settings["QUACK_CACHE_DIR"] = str(cache_dir)
    if cache_path is not None:
        settings["QUACK_CACHE_PATH"] = cache_path
    with _environment(settings):
        config = read_config()
        cached: dict[str, bool] = {}  # key hash -> found: each entry is verified once
        needs = []
        for path, line, sig in calls:
            try:
                plan.check_arch(type(sig))
            except ValueError as e:
                raise ValueError(f"{path}:{line}: {e}") from None
            for role, kernel in plan.plan_for(sig).kernels:
                req = kernel.compile.request(*kernel.args)
                if req.keyhash not in cached:
                    cached[req.keyhash] = jit.is_cached(req)
                needs.append(Need(path, line, sig, role, kernel, req.family, req.keyhash, cached[req.keyhash]))
    return Report(config.arch, [*config.readonly_dirs, config.writable_dir], len(calls), needs)


def _numbered_calls(path: str | Path, families: set[str]) -> list[tuple[int | None, Signature]]:
    """The calls of manifest ``path`` (``manifest.read``) with the line of each:
    the first line whose JSON is the call's entry."""
    from quack.calls import plan
    from quack.calls import manifest

    signatures = manifest.read(path, families or None)
    lines: dict[str, int] = {}
    for no, text in enumerate(Path(path).read_text(errors="replace").split("\n"), 1):
        try:
            entry = json.loads(text)
        except ValueError:
            continue  # a comment, blank, or a last line cut short: no call
        lines.setdefault(json.dumps(entry, sort_keys=True), no)
    return [(lines.get(plan.entry_line(sig)), sig) for sig in signatures]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``quack-cache preflight``."""
    parser.add_argument("manifests", nargs="+", metavar="MANIFEST",
                        help="manifest of calls (recorded with QUACK_CACHE_RECORD=FILE)")
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    parser.add_argument("--family", action="append", default=[], help="only this family's calls (repeatable)")
    parser.add_argument("--arch", help="the job's GPU arch (default: QUACK_ARCH, else the visible GPU's, else sm_90a)")
    parser.add_argument("--cache-dir", metavar="DIR",
                        help="writable layer (default: QUACK_CACHE_DIR, else ~/.cache/quack)")
    parser.add_argument("--cache-path", metavar="DIRS",
                        help=f"read-only layers, '{os.pathsep}'-separated (default: QUACK_CACHE_PATH)")


def run(args: argparse.Namespace, out=None, prog: str = "quack-cache preflight") -> int:
    """Run the check ``args`` describe and print its report; returns the exit status."""
    from quack.cache.cli import format_table

    out = out if out is not None else sys.stdout
    logging.basicConfig(level=logging.WARNING, format=f"{prog}: warning: %(message)s")
    try:
        report = preflight(args.manifests, families=args.family, arch=args.arch,
                           cache_dir=Path(args.cache_dir).expanduser() if args.cache_dir else None,
                           cache_path=args.cache_path)
    except (ValueError, OSError) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    except CacheError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 1
    missing = report.missing
    if args.json:
        json.dump({"arch": report.arch, "layers": [str(p) for p in report.layers], "calls": report.calls,
                   "objects": report.objects, "missing_objects": report.missing_objects,
                   "missing": [n.info() for n in missing],
                   "present": [n.info() for n in report.needs if n.present]}, out, indent=1, sort_keys=True)
        out.write("\n")
    else:
        if missing:
            rows = [[n.where, n.role, n.object, n.kernel.describe(), n.call] for n in missing]
            for line in format_table(["MANIFEST LINE", "ROLE", "MISSING OBJECT", "KERNEL", "CALL"], rows):
                print(line, file=out)
        searched = ", ".join(str(p) for p in report.layers)
        print(f"{report.calls} calls need {report.objects} objects for {report.arch}: "
              f"{report.objects - report.missing_objects} present, {report.missing_objects} missing "
              f"(searched {searched})", file=out)
    return 1 if missing else 0
