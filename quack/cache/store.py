"""On-disk layers and entries: paths, sidecar verification, atomic writes, key locks.

An entry is ``<layer>/<family>/<keyhash>.o`` plus ``<keyhash>.json``, a sidecar
holding the format version, the full key, the object's size and sha256. An entry
is used only after the sidecar matches the expected key and the object's bytes;
anything else (truncated, garbage, foreign version, other arch, other key) is
reported as bad, never loaded.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from .errors import CacheError
from .key import CACHE_FORMAT_VERSION, canonical_json
from .launcher import parse_abi


@dataclass(frozen=True)
class Layer:
    """One directory of entries; ``label`` names it in stats and messages."""

    root: Path
    label: str
    writable: bool

    def object_path(self, family: str, keyhash: str) -> Path:
        return self.root / family / f"{keyhash}.o"

    def sidecar_path(self, family: str, keyhash: str) -> Path:
        return self.root / family / f"{keyhash}.json"

    def lock_path(self, family: str, keyhash: str) -> Path:
        return self.root / family / f"{keyhash}.lock"


@dataclass(frozen=True)
class Verdict:
    """Outcome of checking one entry: ``state`` is ``ok``, ``absent`` or ``bad``."""

    state: str
    problem: str = ""
    sidecar: dict | None = None  # the parsed sidecar of an ``ok`` entry


ABSENT = Verdict("absent")


def verify_entry(layer: Layer, family: str, keyhash: str, key: dict[str, Any]) -> Verdict:
    """Check an entry against ``key`` without loading it."""
    obj, side = layer.object_path(family, keyhash), layer.sidecar_path(family, keyhash)
    if layer.writable:
        check_private(layer.root)
    if not obj.exists() and not side.exists():
        return ABSENT
    if not layer.writable and not all(_inside(p, layer.root) for p in (obj, side)):
        return Verdict("bad", "entry resolves outside its read-only layer")
    try:
        meta = json.loads(side.read_text())
    except (OSError, ValueError) as exc:
        return Verdict("bad", f"sidecar unreadable ({exc})")
    if not isinstance(meta, dict) or not isinstance(meta.get("key"), dict) or not isinstance(meta.get("abi"), list):
        return Verdict("bad", "sidecar is not a cache sidecar")
    if meta.get("format") != CACHE_FORMAT_VERSION:
        return Verdict(
            "bad", f"foreign format version {meta.get('format')!r} (expected {CACHE_FORMAT_VERSION})"
        )
    stored = meta["key"]
    if stored.get("arch") != key["arch"]:
        return Verdict("bad", f"built for arch {stored.get('arch')!r}, expected {key['arch']!r}")
    differing = sorted(
        f for f in key.keys() | stored.keys() if canonical_json(stored.get(f)) != canonical_json(key.get(f))
    )
    if differing:
        return Verdict("bad", "sidecar key differs in " + ", ".join(differing))
    try:
        data = obj.read_bytes()
    except OSError as exc:
        return Verdict("bad", f"object unreadable ({exc})")
    if len(data) != meta.get("size"):
        return Verdict("bad", f"object is {len(data)} bytes, sidecar says {meta.get('size')!r} (truncated?)")
    if hashlib.sha256(data).hexdigest() != meta.get("sha256"):
        return Verdict("bad", "object sha256 does not match its sidecar (corrupted?)")
    return Verdict("ok", sidecar=meta)


def write_entry(
    layer: Layer,
    family: str,
    keyhash: str,
    key: dict[str, Any],
    prefix: str,
    export: Callable[[Path, str], None],
) -> None:
    """Export into a temp dir next to the entry, then ``os.replace`` object and sidecar.

    ``export(directory, name)`` must write ``directory/name.o`` and the C header
    ``name.h``, whose argument layout the sidecar records for the fast
    launcher (see launcher.py). The sidecar goes
    last: a reader that sees a new object with an old sidecar finds a sha256
    mismatch (a miss), never a half-written object that passes verification.
    """
    family_dir = ensure_layer_dir(layer) / family
    family_dir.mkdir(exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{keyhash}.", dir=family_dir))
    try:
        export(tmp, keyhash)
        data = (tmp / f"{keyhash}.o").read_bytes()
        sidecar = {
            "abi": parse_abi((tmp / f"{keyhash}.h").read_text(), prefix),
            "format": CACHE_FORMAT_VERSION,
            "key": key,
            "function_prefix": prefix,
            "size": len(data),
            "sha256": hashlib.sha256(data).hexdigest(),
        }
        (tmp / f"{keyhash}.json").write_text(json.dumps(sidecar, sort_keys=True, indent=1) + "\n")
        os.replace(tmp / f"{keyhash}.o", layer.object_path(family, keyhash))
        os.replace(tmp / f"{keyhash}.json", layer.sidecar_path(family, keyhash))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def key_lock(layer: Layer, family: str, keyhash: str) -> Iterator[None]:
    """Exclusive ``flock`` on the key's lock file (left in place: unlinking a lock
    file that another process is waiting on would let two processes in)."""
    family_dir = ensure_layer_dir(layer) / family
    family_dir.mkdir(exist_ok=True)
    fd = os.open(layer.lock_path(family, keyhash), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def ensure_layer_dir(layer: Layer) -> Path:
    """Create the writable layer private to this user, and refuse one others can write.

    Objects are native code loaded into the process: a layer another user can
    write would let them run code as us.
    """
    layer.root.mkdir(mode=0o700, parents=True, exist_ok=True)
    check_private(layer.root)
    return layer.root


def check_private(root: Path) -> None:
    """Raise ``CacheError`` unless ``root`` (if it exists) is ours and not group/world-writable."""
    try:
        st = root.stat()
    except FileNotFoundError:
        return
    if st.st_uid != os.getuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise CacheError(
            f"refusing writable cache layer {root}: it must be owned by uid {os.getuid()} "
            "and not writable by group or others (chmod go-w, or set QUACK_CACHE_DIR)"
        )


def remove_entries(layer: Layer) -> None:
    """Delete every family directory of a writable layer."""
    if layer.root.is_dir():
        for child in layer.root.iterdir():
            if child.is_dir():
                shutil.rmtree(child, ignore_errors=True)


def _inside(path: Path, root: Path) -> bool:
    return Path(os.path.realpath(path)).is_relative_to(root)
