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
right now) is skipped.

Removal touches only what the cache writes: the ``<keyhash>.o`` and
``<keyhash>.json`` files of entries and its own export temporaries, in a
writable layer that passes the trust check (``CacheError`` otherwise). Any
other file or folder under the layer stays, whatever its name.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

from .errors import CacheError
from .files import MAX_OBJECT_BYTES, MAX_SIDECAR_BYTES, UnsafeFile, read_bounded
from .key import CACHE_FORMAT_VERSION, function_prefix, key_hash
from .store import EXPORT_TEMP_MARK, Layer, object_problem, sidecar_problem, try_key_lock, writable_problem

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


def scan(layer: Layer, *, read_sidecars: bool = True) -> list[Entry]:
    """Every entry of a layer, sorted by family and key hash. Never raises for a
    missing or unreadable layer (an empty list); files are not verified.
    ``read_sidecars``: parse each sidecar into ``Entry.meta`` (bounded reads of
    regular files only; pruning needs sizes and times alone)."""
    entries: dict[tuple[str, str], Entry] = {}
    try:
        families = sorted(
            p for p in layer.root.iterdir() if FAMILY.fullmatch(p.name) and p.is_dir() and not p.is_symlink()
        )
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
                st = path.stat()  # through a link: read-only layers may be symlink trees (Bazel)
            except OSError:
                continue
            if not stat.S_ISREG(st.st_mode):
                continue  # a FIFO, device or folder: not something the cache wrote
            entry = entries.setdefault((family_dir.name, stem), Entry(layer, family_dir.name, stem))
            entry.size += st.st_size
            if suffix == "o":
                entry.object = path
                entry.last_use = st.st_mtime
            else:
                entry.sidecar = path
                entry.last_use = entry.last_use or st.st_mtime
    for entry in entries.values() if read_sidecars else ():
        if entry.sidecar is not None:
            try:
                meta = json.loads(read_bounded(entry.sidecar, MAX_SIDECAR_BYTES))
                entry.meta = meta if isinstance(meta, dict) else None
            except (OSError, ValueError, UnsafeFile):
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
        meta = json.loads(read_bounded(entry.sidecar, MAX_SIDECAR_BYTES, private=entry.layer.writable))
    except (OSError, ValueError, UnsafeFile) as exc:
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
        data = read_bounded(entry.object, MAX_OBJECT_BYTES, private=entry.layer.writable)
    except (OSError, UnsafeFile) as exc:
        return f"object unreadable ({exc})"
    return object_problem(meta, data)


def check_removable(layer: Layer) -> None:
    """Raise unless ``layer`` is a writable layer that passes the trust check:
    removing files anywhere else could delete what is not the cache's."""
    if not layer.writable:
        raise ValueError(f"{layer.root} is a read-only layer")
    problem = writable_problem(layer.root)
    if problem:
        raise CacheError(f"{problem}; nothing was removed")


def remove(entry: Entry) -> bool:
    """Delete an entry of a writable layer (sidecar first, so a reader sees a
    miss, never an object passing as valid). False if its key is locked.

    Both of the key's files go, not only those the scan saw: an export that
    finished between the scan and the lock may have added the one it lacked.
    As in ``scan``, only regular files count: a folder or FIFO of an entry's
    name stays."""
    check_removable(entry.layer)
    layer, family, keyhash = entry.layer, entry.family, entry.keyhash
    with try_key_lock(layer, family, keyhash) as locked:
        if not locked:
            return False
        for path in (layer.sidecar_path(family, keyhash), layer.object_path(family, keyhash)):
            if _regular_file(path):
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
    return True


def _regular_file(path: Path) -> bool:
    """Whether ``path`` is a regular file (through a link, as ``scan`` reads it)."""
    try:
        return stat.S_ISREG(path.stat().st_mode)
    except OSError:
        return False


def _removable(entry: Entry) -> bool:
    """Whether ``remove`` would delete the entry now (its key is not locked)."""
    with try_key_lock(entry.layer, entry.family, entry.keyhash) as locked:
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
    check_removable(layer)
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
    """Remove every entry of a writable layer and the export temporaries that
    nobody uses, nothing else (a later install removes a killed install's
    staging folder); returns the removed entries."""
    check_removable(layer)
    removed = [e for e in scan(layer, read_sidecars=False) if remove(e)]
    remove_stale_temps(layer, max_age=0.0)
    return removed


def _export_temp(path: Path) -> str:
    """The key hash of an export's temporary folder at ``path`` (``""``: not one):
    named as ``write_entry`` names them, ours, holding nothing but that
    export's own files."""
    keyhash, mark = path.name[1:33], path.name[33:]
    if not (path.name.startswith(".") and KEYHASH.fullmatch(keyhash) and mark.startswith(EXPORT_TEMP_MARK)):
        return ""
    st = path.lstat()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        return ""
    own = {f"{keyhash}.o", f"{keyhash}.h", f"{keyhash}.json"}
    for child in path.iterdir():
        if child.name not in own or not stat.S_ISREG(child.lstat().st_mode):
            return ""
    return keyhash


def remove_stale_temps(layer: Layer, max_age: float = STALE_TEMP_SECONDS) -> list[Path]:
    """Delete export temp directories (see ``_export_temp``) older than ``max_age`` s."""
    check_removable(layer)
    removed = []
    now = time.time()
    for tmp in sorted(layer.root.glob(f"*/.*{EXPORT_TEMP_MARK}*")) if layer.root.is_dir() else []:
        try:
            keyhash = _export_temp(tmp)
            if not keyhash or not FAMILY.fullmatch(tmp.parent.name) or now - tmp.lstat().st_mtime < max_age:
                continue
        except OSError:
            continue
        with try_key_lock(layer, tmp.parent.name, keyhash) as locked:
            if locked:  # else an export is writing it right now
                shutil.rmtree(tmp, ignore_errors=True)
                removed.append(tmp)
    return removed
