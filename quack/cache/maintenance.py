"""Offline operations on cache layers: list, verify, prune (LRU), clear.

Used by the command line (``python -m quack.cache``, :mod:`quack.cache.cli`)
and, for the ``QUACK_CACHE_MAX_SIZE`` bound, by the cache after an export.
Nothing here runs on the per-launch path.

An entry is checked on its own here (no expected key is known): the sidecar
must be well formed, its key must hash to the entry's file name, name the
entry's family and its prefix, and the object must match the recorded size
and sha256 (and the sidecar its own checksum, when it has one).

Last use of an entry is its object's mtime: set by the export and touched on
each load from the writable layer (once per key and process). Removal takes
the key's lock without waiting; an entry whose lock is held (being exported
right now) is skipped. Lock files themselves stay: removing one that another
process waits on would let two writers in.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

from .key import CACHE_FORMAT_VERSION, function_prefix, key_hash
from .store import Layer, object_problem, sidecar_problem

KEYHASH = re.compile(r"[0-9a-f]{32}")
FAMILY = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
# Temporary export directories older than this are leftovers of a killed process.
STALE_TEMP_SECONDS = 3600.0


@dataclass
class Entry:
    """One entry found on disk (either file may be missing)."""

    layer: Layer
    family: str
    keyhash: str
    object: Path | None = None
    sidecar: Path | None = None
    size: int = 0  # object + sidecar bytes
    last_use: float = 0.0  # the object's mtime (else the sidecar's)
    meta: dict | None = field(default=None, repr=False)  # parsed sidecar, when it parses

    @property
    def name(self) -> str:
        return f"{self.family}/{self.keyhash}"


def scan(layer: Layer) -> list[Entry]:
    """Every entry of a layer, sorted by family and key hash. Never raises for a
    missing or unreadable layer (an empty list); files are not verified."""
    entries: dict[tuple[str, str], Entry] = {}
    try:
        families = sorted(p for p in layer.root.iterdir() if p.is_dir() and FAMILY.fullmatch(p.name))
    except OSError:
        return []
    for family_dir in families:
        try:
            names = sorted(os.listdir(family_dir))
        except OSError:
            continue
        for name in names:
            stem, dot, suffix = name.partition(".")
            if not KEYHASH.fullmatch(stem) or suffix not in ("o", "json"):
                continue
            path = family_dir / name
            try:
                st = path.lstat()
            except OSError:
                continue
            entry = entries.setdefault((family_dir.name, stem), Entry(layer, family_dir.name, stem))
            entry.size += st.st_size
            if suffix == "o":
                entry.object = path
                entry.last_use = st.st_mtime
            else:
                entry.sidecar = path
                entry.last_use = entry.last_use or st.st_mtime
    for entry in entries.values():
        if entry.sidecar is not None:
            try:
                meta = json.loads(entry.sidecar.read_text())
                entry.meta = meta if isinstance(meta, dict) else None
            except (OSError, ValueError):
                pass
    return [entries[k] for k in sorted(entries)]


def check(entry: Entry, *, confine: bool = True) -> str:
    """What is wrong with an entry on its own (``""``: nothing); reads the object.

    ``confine``: the entry's files must resolve inside the layer's real root
    (as the cache requires before loading).
    """
    if entry.object is None:
        return "sidecar without object"
    if entry.sidecar is None:
        return "object without sidecar"
    if confine:
        root = Path(os.path.realpath(entry.layer.root))
        for path in (entry.object, entry.sidecar):
            if not Path(os.path.realpath(path)).is_relative_to(root):
                return "entry resolves outside its layer"
    try:
        meta = json.loads(entry.sidecar.read_text())
    except (OSError, ValueError) as exc:
        return f"sidecar unreadable ({exc})"
    problem = sidecar_problem(meta)
    if problem:
        return problem
    if meta.get("format") != CACHE_FORMAT_VERSION:
        return f"foreign format version {meta.get('format')!r} (expected {CACHE_FORMAT_VERSION})"
    try:
        if key_hash(meta["key"]) != entry.keyhash:
            return "sidecar key does not hash to the entry's name"
    except (TypeError, ValueError) as exc:
        return f"sidecar key unreadable ({exc})"
    if meta["key"].get("family") != entry.family:
        return f"sidecar names family {meta['key'].get('family')!r}"
    if meta.get("function_prefix") != function_prefix(entry.family, entry.keyhash):
        return "sidecar function prefix does not match the key"
    try:
        data = entry.object.read_bytes()
    except OSError as exc:
        return f"object unreadable ({exc})"
    return object_problem(meta, data)


@contextlib.contextmanager
def _try_key_lock(layer: Layer, family: str, keyhash: str) -> Iterator[bool]:
    """The key's lock without waiting: yields False when another process holds it."""
    try:
        fd = os.open(layer.lock_path(family, keyhash), os.O_RDWR | os.O_CREAT, 0o600)
    except OSError:
        yield True  # no lock file possible (read-only directory): nobody can hold it either
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)


def remove(entry: Entry) -> bool:
    """Delete an entry of a writable layer (sidecar first, so a reader sees a
    miss, never an object passing as valid). False if its key is locked."""
    if not entry.layer.writable:
        raise ValueError(f"{entry.layer.root} is a read-only layer")
    with _try_key_lock(entry.layer, entry.family, entry.keyhash) as locked:
        if not locked:
            return False
        for path in (entry.sidecar, entry.object):
            if path is not None:
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
    return True


def _removable(entry: Entry) -> bool:
    """Whether ``remove`` would delete the entry now (its key is not locked)."""
    with _try_key_lock(entry.layer, entry.family, entry.keyhash) as locked:
        return bool(locked)


def prune(
    layer: Layer, max_bytes: int, keep: Iterable[tuple[str, str]] = (), dry_run: bool = False
) -> tuple[list[Entry], int]:
    """Evict least recently used entries until the layer holds at most ``max_bytes``.

    ``keep`` lists (family, keyhash) pairs never evicted (the entry just
    exported). Returns the removed entries and the bytes left.  ``dry_run``:
    the same walk, removing nothing (an entry whose key is locked right now
    is skipped in both).
    """
    keep = set(keep)
    entries = scan(layer)
    total = sum(e.size for e in entries)
    removed = []
    for entry in sorted(entries, key=lambda e: (e.last_use, e.family, e.keyhash)):
        if total <= max_bytes:
            break
        if (entry.family, entry.keyhash) in keep:
            continue
        if _removable(entry) if dry_run else remove(entry):
            removed.append(entry)
            total -= entry.size
    return removed, total


def clear(layer: Layer) -> list[Entry]:
    """Remove every entry of a writable layer, stale temporary directories and
    unheld lock files; returns the removed entries."""
    removed = [e for e in scan(layer) if remove(e)]
    remove_stale_temps(layer, max_age=0.0)
    for lock in sorted(layer.root.glob("*/*.lock")) if layer.root.is_dir() else []:
        family, keyhash = lock.parent.name, lock.stem
        with _try_key_lock(layer, family, keyhash) as locked:
            if locked:
                with contextlib.suppress(OSError):
                    lock.unlink()
    return removed


def remove_stale_temps(layer: Layer, max_age: float = STALE_TEMP_SECONDS) -> list[Path]:
    """Delete export temp directories (``<family>/.<keyhash>.*``) older than ``max_age`` s."""
    removed = []
    now = time.time()
    for tmp in sorted(layer.root.glob("*/.*")) if layer.root.is_dir() else []:
        keyhash = tmp.name[1:33]
        try:
            if not KEYHASH.fullmatch(keyhash) or not tmp.is_dir() or tmp.is_symlink():
                continue
            if now - tmp.stat().st_mtime < max_age:
                continue
        except OSError:
            continue
        with _try_key_lock(layer, tmp.parent.name, keyhash) as locked:
            if locked:  # else an export is writing it right now
                shutil.rmtree(tmp, ignore_errors=True)
                removed.append(tmp)
    return removed
