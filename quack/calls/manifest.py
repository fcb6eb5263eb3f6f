"""Manifests: lists of call signatures, the one format for every op.

A manifest is a JSON Lines file: a header line ``{"format": "quack-calls",
"version": 4}``, then one signature per line (``quack/calls/plan.py``:
``{"op": "layernorm", "dtype": "bfloat16", "n": 4096, ...}``); blank lines
and lines starting with ``#`` are comments.  tools/warm_cache.py warms every
entry through the plans; ``QUACK_CACHE_RECORD=FILE`` makes any run append the
signature of each call it makes.

Recording (``quack/calls/recording.py``) appends to a manifest; this module
reads manifests, checking each entry through its op (``plan.from_entry``),
and writes them.  A last line cut short by a process that died mid-write is
skipped.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from quack.calls.recording import FORMAT, HEADER, RECORD_ENV, VERSION, ManifestError

__all__ = ["FORMAT", "HEADER", "RECORD_ENV", "VERSION", "ManifestError", "read", "write"]

log = logging.getLogger("quack.manifest")


def read(path, ops=None) -> list:
    """The signatures of a manifest, in file order, duplicates dropped; only
    those of ``ops`` (op names, which are the kernel families) when given.
    Every entry is checked against what its op accepts (``plan.from_entry``)."""
    from quack.calls import plan

    path = Path(path)
    raw = path.read_bytes()
    lines = raw.split(b"\n")
    cut_short = not raw.endswith(b"\n")  # its last line, if it does not parse: a recorder stopped mid-write
    body = []
    for no, line in enumerate(lines, 1):
        try:
            text = line.decode().strip()
        except UnicodeDecodeError as e:
            if no == len(lines) and cut_short:
                text = line.decode(errors="replace").strip()  # skipped below, as a line cut short
            else:
                raise ManifestError(f"{path}:{no}: not UTF-8 text ({e})") from None
        if text and not text.startswith("#"):
            body.append((no, text))
    if not body:
        raise ManifestError(f"{path}: empty; a manifest starts with the header line {HEADER}")
    _check_header(path, body[0])
    out, seen = [], set()
    for no, line in body[1:]:
        try:
            entry = json.loads(line)
        except json.JSONDecodeError as e:
            if no == len(lines) and cut_short:
                log.warning("%s: line %d is cut short (a recorder stopped mid-write); skipped", path, no)
                continue
            raise ManifestError(f"{path}:{no}: not JSON: {e}") from None
        if ops is not None and isinstance(entry, dict) and entry.get("op") not in ops:
            continue
        try:
            sig = plan.from_entry(entry)
        except (TypeError, ValueError) as e:
            raise ManifestError(f"{path}:{no}: {e}") from None
        if sig not in seen:
            seen.add(sig)
            out.append(sig)
    return out


def _check_header(path: Path, first: tuple[int, str]) -> None:
    no, line = first
    try:
        header = json.loads(line)
    except json.JSONDecodeError:
        header = None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise ManifestError(
            f"{path}:{no}: not a quack manifest (expected the header {HEADER}); "
            "manifests of the old {'configs': [...]} format must be regenerated: record the calls "
            f"with {RECORD_ENV}=FILE"
        )
    if header.get("version") != VERSION:
        raise ManifestError(
            f"{path}: manifest version {header.get('version')!r}, this quack reads version {VERSION}; "
            f"re-record it with {RECORD_ENV}=FILE"
        )


def write(path, signatures, comment: str = "") -> None:
    """Write a manifest of ``signatures`` (sorted lines, so a rewrite diffs cleanly)."""
    from quack.calls import plan

    lines = [f"# {c}" for c in comment.splitlines()] + [HEADER]
    lines += sorted({plan.entry_line(s) for s in signatures})
    Path(path).write_text("\n".join(lines) + "\n")
