"""Manifests: lists of call signatures, the one format for every op.

A manifest is a JSON Lines file: a header line ``{"format": "quack-calls",
"version": 4}``, then one signature per line (``quack/plan.py``:
``{"op": "layernorm", "dtype": "bfloat16", "n": 4096, ...}``); blank lines
and lines starting with ``#`` are comments.  tools/warm_cache.py warms every
entry through the plans; ``QUACK_CACHE_RECORD=FILE`` makes any run append the
signature of each call it makes.

Recording is safe with many processes and threads: each new line is appended
under an exclusive ``flock`` after reading what is there, so a line is
written once; a line is one ``write``, and a last line cut short by a
process that died mid-write is skipped by readers and dropped by the next
recorder.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import threading
from pathlib import Path

FORMAT = "quack-calls"
VERSION = 4  # 4: gemm signatures name A's layout and their backward (3: cross_entropy's reduction)
RECORD_ENV = "QUACK_CACHE_RECORD"
HEADER = json.dumps({"format": FORMAT, "version": VERSION}, sort_keys=True)

log = logging.getLogger("quack.manifest")
_RECORDED: set[tuple[str, object]] = set()  # (file, signature) this process has recorded there
_FAILED: set[str] = set()  # record files that could not be written (warned once)
_LOCK = threading.Lock()


class ManifestError(ValueError):
    """A manifest that cannot be read: another format or version, or a bad line."""


def read(path, ops=None) -> list:
    """The signatures of a manifest, in file order, duplicates dropped; only
    those of ``ops`` (op names, which are the kernel families) when given."""
    from quack import plan

    path = Path(path)
    text = path.read_text()
    lines = text.split("\n")
    body = [(i + 1, line.strip()) for i, line in enumerate(lines)]
    body = [(no, line) for no, line in body if line and not line.startswith("#")]
    if not body:
        raise ManifestError(f"{path}: empty; a manifest starts with the header line {HEADER}")
    _check_header(path, body[0])
    out, seen = [], set()
    for no, line in body[1:]:
        try:
            entry = json.loads(line)
        except json.JSONDecodeError as e:
            if no == len(lines) and not text.endswith("\n"):
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


def _is_header(line: str) -> bool:
    try:
        header = json.loads(line)
    except json.JSONDecodeError:
        return False
    return isinstance(header, dict) and header.get("format") == FORMAT and header.get("version") == VERSION


def write(path, signatures, comment: str = "") -> None:
    """Write a manifest of ``signatures`` (sorted lines, so a rewrite diffs cleanly)."""
    from quack import plan

    lines = [f"# {c}" for c in comment.splitlines()] + [HEADER]
    lines += sorted({plan.entry_line(s) for s in signatures})
    Path(path).write_text("\n".join(lines) + "\n")


def record(sig) -> None:
    """Append ``sig`` to the ``QUACK_CACHE_RECORD`` file, if set, unless it is there."""
    path = os.environ.get(RECORD_ENV)
    if not path:
        return
    from quack import plan

    with _LOCK:
        if (path, sig) in _RECORDED:
            return
        _RECORDED.add((path, sig))
        try:
            _append_once(path, plan.entry_line(sig))
        except (OSError, ManifestError) as e:
            # The call itself must not fail for it; say so once per file.
            if path not in _FAILED:
                _FAILED.add(path)
                log.warning("%s=%s: cannot record (%s); calls are not recorded there", RECORD_ENV, path, e)


def _append_once(path: str, line: str) -> None:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        size = os.fstat(fd).st_size
        text = os.pread(fd, size, 0).decode() if size else ""
        present = {x.strip() for x in text.split("\n")}
        if line in present:
            return
        out = ""
        if text and not text.endswith("\n"):
            # Drop a line cut short by a recorder that died mid-write.
            text = text[: text.rfind("\n") + 1]
            os.ftruncate(fd, len(text.encode()))
            present = {x.strip() for x in text.split("\n")}
        body = [x for x in present if x and not x.startswith("#")]
        if not body:
            out += HEADER + "\n"
        elif not any(_is_header(x) for x in body):
            raise ManifestError(f"{path}: {RECORD_ENV} names a file that is not a quack manifest")
        os.write(fd, (out + line + "\n").encode())
    finally:
        os.close(fd)
