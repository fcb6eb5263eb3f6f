"""On-disk layers and entries: paths, sidecar verification, atomic writes, key locks.

An entry is ``<layer>/<family>/<keyhash>.o`` plus ``<keyhash>.json``, a sidecar
holding the format version, the full key, the object's size and sha256. An entry
is used only after the sidecar matches the expected key and the object's bytes;
anything else (truncated, garbage, foreign version, other arch, other key) is
reported as bad, never loaded.

Sidecars written since the ``integrity`` field exists also carry the sha256 of
their own canonical JSON (without that field), so a damaged argument layout or
prefix is caught as well; sidecars without it (older writers) are still read.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import stat
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from . import locks
from .config import lock_timeout
from .errors import CacheError
from .files import MAX_OBJECT_BYTES, MAX_SIDECAR_BYTES, UnsafeFile, ownership_problem, private_folder, read_bounded
from .key import CACHE_FORMAT_VERSION, canonical_json
from quack.launch.launcher import parse_abi

log = logging.getLogger("quack.cache")


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


class ExportError(CacheError):
    """Writing an entry failed (full disk, read-only file system...).

    ``abi`` is the argument layout when the export got far enough to read it,
    so the caller can still use the compiled kernel without caching it.
    """

    def __init__(self, message: str, abi: list | None = None) -> None:
        super().__init__(message)
        self.abi = abi


# An export's temporary folder is ``<family>/.<keyhash>.quack-export-<random>``.
EXPORT_TEMP_MARK = ".quack-export-"

# Every field a sidecar may hold; anything else means damage (a flipped bit in a name).
SIDECAR_FIELDS = frozenset({"abi", "format", "key", "function_prefix", "size", "sha256", "integrity"})


def sidecar_integrity(meta: dict) -> str:
    """sha256 over the canonical JSON of a sidecar without its ``integrity`` field."""
    body = {k: v for k, v in meta.items() if k != "integrity"}
    return hashlib.sha256(canonical_json(body).encode()).hexdigest()


def sidecar_problem(meta: Any) -> str:
    """What is wrong with the structure of a parsed sidecar (``""``: nothing)."""
    if not isinstance(meta, dict) or not isinstance(meta.get("key"), dict) or not isinstance(meta.get("abi"), list):
        return "sidecar is not a cache sidecar"
    unknown = sorted(str(k) for k in meta.keys() - SIDECAR_FIELDS)
    if unknown:
        return "sidecar has unknown fields " + ", ".join(unknown)
    return ""


def object_problem(meta: dict, data: bytes) -> str:
    """Check an object's bytes and the sidecar's own checksum (``""``: fine)."""
    if len(data) != meta.get("size"):
        return f"object is {len(data)} bytes, sidecar says {meta.get('size')!r} (truncated?)"
    if hashlib.sha256(data).hexdigest() != meta.get("sha256"):
        return "object sha256 does not match its sidecar (corrupted?)"
    if "integrity" in meta and meta["integrity"] != sidecar_integrity(meta):
        return "sidecar checksum does not match its content (corrupted?)"
    return ""


@dataclass(frozen=True)
class Verdict:
    """Outcome of checking one entry: ``state`` is ``ok``, ``absent`` or ``bad``."""

    state: str
    problem: str = ""
    sidecar: dict | None = None  # the parsed sidecar of an ``ok`` entry
    data: bytes | None = field(default=None, repr=False)  # an ``ok`` entry's object: the bytes to load


ABSENT = Verdict("absent")
# An entry whose files vanish while it is checked was removed under the reader
# (prune, clear, install replacing it): a miss, never a bad entry.
REMOVED = Verdict("absent", "removed while it was being read")


def _removed(obj: Path, side: Path, wait: float = 0.05) -> bool:
    """A file of the entry was not found while it was read: removed under the
    reader (``remove`` unlinks the sidecar, then the object) if both are gone
    within ``wait`` seconds; a file missing for good beside the other is a
    broken entry."""
    deadline = time.monotonic() + wait
    while os.path.lexists(obj) or os.path.lexists(side):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.002)
    return True


def verify_entry(layer: Layer, family: str, keyhash: str, key: dict[str, Any]) -> Verdict:
    """Check an entry against ``key`` without loading it.

    An ``ok`` verdict carries the object's bytes, read once: the caller loads
    exactly the bytes that were hashed. In the writable layer the family
    folder and both files must be the user's own and writable by nobody else.
    """
    obj, side = layer.object_path(family, keyhash), layer.sidecar_path(family, keyhash)
    # Both there at first and one gone when read: removed under us (a miss).
    # One missing from the start: a broken entry (bad).
    if not os.path.lexists(obj) and not os.path.lexists(side):
        return ABSENT
    # Read-only roots are resolved once (config); the writable root is resolved here.
    root = layer.root if not layer.writable else Path(os.path.realpath(layer.root))
    if not all(_inside(p, root) for p in (obj, side)):
        kind = "writable" if layer.writable else "read-only"
        return Verdict("bad", f"entry resolves outside its {kind} layer")
    private = layer.writable
    if private:
        problem = _family_problem(layer, family)
        if problem:
            return Verdict("bad", problem)
    try:
        meta = json.loads(read_bounded(side, MAX_SIDECAR_BYTES, private=private))
    except FileNotFoundError:
        return REMOVED if _removed(obj, side) else Verdict("bad", "sidecar missing beside its object")
    except (OSError, ValueError, UnsafeFile) as exc:
        return Verdict("bad", f"sidecar unreadable ({exc})")
    problem = sidecar_problem(meta)
    if problem:
        return Verdict("bad", problem)
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
    size = meta.get("size")
    if type(size) is not int or not 0 < size <= MAX_OBJECT_BYTES:
        return Verdict("bad", f"sidecar records no valid object size ({size!r})")
    try:
        data = read_bounded(obj, MAX_OBJECT_BYTES, private=private, expected_size=size)
    except FileNotFoundError:
        return REMOVED if _removed(obj, side) else Verdict("bad", "object missing beside its sidecar")
    except UnsafeFile as exc:
        return Verdict("bad", f"object unusable ({exc})")
    except OSError as exc:
        return Verdict("bad", f"object unreadable ({exc})")
    problem = object_problem(meta, data)
    if problem:
        return Verdict("bad", problem)
    return Verdict("ok", sidecar=meta, data=data)


def _family_problem(layer: Layer, family: str) -> str:
    """Why the writable layer's family folder may not hold trusted entries (``""``: it may)."""
    try:
        st = os.lstat(layer.root / family)
    except OSError as exc:
        return f"family folder unreadable ({exc})"
    if not stat.S_ISDIR(st.st_mode):
        return "family folder is not a real folder"
    return ownership_problem(st, "family folder")


def write_entry(
    layer: Layer,
    family: str,
    keyhash: str,
    key: dict[str, Any],
    prefix: str,
    export: Callable[[Path, str], None],
) -> list:
    """Export into a temp dir next to the entry, then ``os.replace`` object and sidecar.

    ``export(directory, name)`` must write ``directory/name.o`` and the C header
    ``name.h``, whose argument layout the sidecar records for the fast
    launcher (see launcher.py). The sidecar goes
    last: a reader that sees a new object with an old sidecar finds a sha256
    mismatch (a miss), never a half-written object that passes verification.
    Files are private (0600 in a 0700 folder) whatever the umask.

    Returns the argument layout (abi). A failed write raises ``ExportError``
    carrying the abi if it was read, and leaves no temporary files behind:
    ``OSError`` (full disk, read-only file system), an unsafe family folder,
    or an error of the exporter itself (the DSL reports a full disk as its
    own internal error).
    """
    abi = None
    tmp = None
    target = layer.object_path(family, keyhash)
    try:
        family_dir = family_folder(layer, family)
        tmp = Path(tempfile.mkdtemp(prefix=f".{keyhash}{EXPORT_TEMP_MARK}", dir=family_dir))
        try:
            export(tmp, keyhash)
        except (OSError, MemoryError):
            raise
        except Exception as exc:
            raise ExportError(f"could not write cache entry {target}: the export failed ({summary(exc)})") from exc
        data = read_bounded(tmp / f"{keyhash}.o", MAX_OBJECT_BYTES)
        abi = parse_abi(read_bounded(tmp / f"{keyhash}.h", MAX_SIDECAR_BYTES).decode(), prefix)
        sidecar = {
            "abi": abi,
            "format": CACHE_FORMAT_VERSION,
            "key": key,
            "function_prefix": prefix,
            "size": len(data),
            "sha256": hashlib.sha256(data).hexdigest(),
        }
        sidecar["integrity"] = sidecar_integrity(sidecar)
        os.chmod(tmp / f"{keyhash}.o", 0o600)
        _write_private(tmp / f"{keyhash}.json", (json.dumps(sidecar, sort_keys=True, indent=1) + "\n").encode())
        for name in (f"{keyhash}.o", f"{keyhash}.json"):
            _make_room(family_dir / name)
            os.replace(tmp / name, family_dir / name)
    except (OSError, UnsafeFile) as exc:
        # The object may be in place without its new sidecar: readers see a
        # mismatch (a miss), and the next successful export replaces both.
        raise ExportError(f"could not write cache entry {target}: {exc}", abi) from exc
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return abi


def summary(exc: BaseException, lines: int = 3, width: int = 300) -> str:
    """The first lines of an exception's message, for an error that must stay readable."""
    text = "\n".join(str(exc).strip().splitlines()[:lines])[:width]
    return f"{type(exc).__name__}: {text}"


def _write_private(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)


def _make_room(path: Path) -> None:
    """A folder where an entry's file belongs (made by hand, or by a tool gone
    wrong) would fail every export of that key: it is moved aside under a name
    the cache never reads or removes, so the entry heals and nothing is lost."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        aside = path.with_name(f".displaced-{path.name}-{os.getpid()}-{time.time_ns()}")
        os.rename(path, aside)
        log.warning("moved the folder %s, which stood where a cache entry belongs, to %s", path, aside)


def family_folder(layer: Layer, family: str) -> Path:
    """The writable layer's folder for ``family``, created private (``UnsafeFile``
    when it is not a folder of ours)."""
    return private_folder(ensure_layer_dir(layer) / family)


@contextlib.contextmanager
def key_lock(layer: Layer, family: str, keyhash: str, timeout: float | None = None) -> Iterator[None]:
    """Hold the key's lock (see locks.py): one exporter per entry across
    processes and threads. ``timeout`` defaults to ``QUACK_CACHE_LOCK_TIMEOUT``."""
    path = layer.lock_path(family, keyhash)
    with locks.hold(path, lock_timeout() if timeout is None else timeout, lambda: family_folder(layer, family)):
        yield


def try_key_lock(layer: Layer, family: str, keyhash: str) -> contextlib.AbstractContextManager[bool]:
    """The key's lock without waiting: yields False while an export holds it."""
    return locks.try_hold(layer.lock_path(family, keyhash))


def ensure_layer_dir(layer: Layer) -> Path:
    """Create the writable layer private to this user, and refuse one others can write.

    Objects are native code loaded into the process: a layer another user can
    write would let them run code as us. Missing parent folders are created
    private too.
    """
    missing = []
    for folder in (layer.root, *layer.root.parents):
        if os.path.lexists(folder):
            break
        missing.append(folder)
    for folder in reversed(missing):
        with contextlib.suppress(FileExistsError):
            folder.mkdir(mode=0o700)
            os.chmod(folder, 0o700)  # the umask may have taken bits mkdir asked for
    check_private(layer.root)
    return layer.root


def writable_problem(root: Path) -> str:
    """Why ``root`` may not serve as the writable layer (``""``: it may, or does not exist yet).

    The layer must be owned by the current user and not writable by group or
    others: its objects are native code loaded into this process. The check is
    on the real directory (a symlinked root is followed).
    """
    try:
        st = root.stat()
    except FileNotFoundError:
        return ""
    except OSError as exc:
        return f"cannot use writable cache layer {root} ({exc})"
    if not stat.S_ISDIR(st.st_mode):
        return f"writable cache layer {root} is not a directory"
    if st.st_uid != os.getuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return (
            f"refusing writable cache layer {root}: it must be owned by uid {os.getuid()} "
            "and not writable by group or others (chmod go-w, or set QUACK_CACHE_DIR)"
        )
    return ""


def check_private(root: Path) -> None:
    """Raise ``CacheError`` unless ``root`` (if it exists) is ours and not group/world-writable."""
    problem = writable_problem(root)
    if problem:
        raise CacheError(problem)


def touch_last_use(layer: Layer, family: str, keyhash: str) -> None:
    """Record a use of a writable entry: its object's mtime is its last use (what
    ``prune`` evicts by). Once per key and process, never on a memory hit."""
    if layer.writable:
        try:
            os.utime(layer.object_path(family, keyhash))
        except OSError:
            pass


def _inside(path: Path, root: Path) -> bool:
    return Path(os.path.realpath(path)).is_relative_to(root)
