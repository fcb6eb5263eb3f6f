"""Cache bundles: one deterministic tar archive of one or more cache directories.

Layout of a bundle (POSIX ustar, no compression)::

    manifest.json               first member; sorted; per object: family, key, file,
                                size, sha256, sidecar, sidecar_sha256
    <family>/<keyhash>.json     the sidecar
    <family>/<keyhash>.o        the object

Members are sorted by path and carry fixed metadata (mtime 0, uid/gid 0, no
owner names, mode 0644), so the same entries give byte-identical archives on
every run and machine. Only entries that verify (see
:func:`quack.cache.maintenance.check`) are bundled; a bad one fails the bundle.

Installing treats the archive as hostile. It is read member by member, and
every size is checked before anything is read:

- only an uncompressed tar (ustar or pax) is read, and only regular files and
  family folders in it: compressed archives, links, devices, FIFOs and sparse
  files are refused. One member's headers (pax records, long names) may
  take ``MAX_HEADER_BYTES``, the archive ``MAX_MEMBERS`` members;
- ``manifest.json`` comes first (``MAX_MANIFEST_BYTES`` at most) and names every
  other member: an object must be the size it records (``MAX_OBJECT_BYTES`` at
  most), a sidecar ``MAX_SIDECAR_BYTES`` at most, and both must match their
  recorded sha256;
- an error names the first few offenders and says how many there are.

Installs are all or nothing. Members are streamed into a private staging
folder inside the target (``.quack-install-<random>``, locked while the
install runs), verified, then moved into place under each key's lock,
sidecar last, so a reader never sees a partial entry. A move that fails
midway (a full disk) rolls back what this install moved, restoring the files
it replaced, and the error says so. The staging folder of a killed install is
removed by a later install once unlocked and ``STALE_STAGING_SECONDS`` old.
Nothing inside the target that is a symbolic link is followed: the install
refuses. Everything it creates is private (0700 folders, 0600 files) whatever
the umask.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import io
import itertools
import json
import os
import re
import shutil
import stat
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Callable, Iterable, Iterator, TypeVar

from .errors import CacheError
from .files import MAX_OBJECT_BYTES, MAX_SIDECAR_BYTES, ownership_problem, private_folder
from . import locks
from .key import CACHE_FORMAT_VERSION
from .maintenance import FAMILY, KEYHASH, Entry, check, scan
from .store import Layer, key_lock, writable_problem

BUNDLE_FORMAT = 1
MANIFEST = "manifest.json"
_MEMBER = re.compile(rf"{FAMILY.pattern}/{KEYHASH.pattern}\.(o|json)")

# What an install reads at most (the writer keeps to the first two).
MAX_OBJECTS = 10_000  # entries in one bundle
MAX_MANIFEST_BYTES = 8 << 20  # about 400 bytes per entry
MAX_MEMBERS = 25_000  # the manifest, two files per entry, family folders
MAX_HEADER_BYTES = 8 << 10  # the tar headers of one member: pax records, long names
# A staging folder this old whose lock nobody holds is a killed install's.
STALE_STAGING_SECONDS = 600.0
STAGING_PREFIX = ".quack-install-"

_SHOWN = 5  # offenders named in one error message
_CHUNK = 1 << 20
_FILE_TYPES = (tarfile.REGTYPE, tarfile.AREGTYPE)
_KINDS = {
    tarfile.SYMTYPE: "symbolic link",
    tarfile.LNKTYPE: "hard link",
    tarfile.CHRTYPE: "character device",
    tarfile.BLKTYPE: "block device",
    tarfile.FIFOTYPE: "FIFO",
    tarfile.CONTTYPE: "contiguous file",
}
_COMPRESSION = {b"\x1f\x8b": "gzip", b"BZh": "bzip2", b"\xfd7zXZ\x00": "xz", b"\x28\xb5\x2f\xfd": "zstd"}
_T = TypeVar("_T")


class BundleError(CacheError):
    """A bundle cannot be written or installed (bad entries, unsafe or inconsistent archive)."""


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _tarinfo(name: str, size: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size = size
    info.mtime = 0
    info.mode = 0o644
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.type = tarfile.REGTYPE
    return info


def collect(dirs: Iterable[Path]) -> dict[tuple[str, str], tuple[bytes, bytes]]:
    """(family, keyhash) -> (object bytes, sidecar bytes) over ``dirs``, every entry verified.

    The same key in two directories must have the same object (the first
    directory's sidecar is kept). Raises ``BundleError`` naming every bad entry.
    """
    found: dict[tuple[str, str], tuple[bytes, bytes]] = {}
    bad = []
    for directory in dirs:
        if not directory.is_dir():
            raise BundleError(f"not a cache directory: {directory}")
        # Not confined to the directory's real path: Bazel's sandbox links each
        # file of an input directory on its own. The bytes are verified instead.
        layer = Layer(Path(os.path.abspath(directory)), str(directory), False)
        for entry in scan(layer):
            problem = check(entry, confine=False)
            if problem:
                bad.append(f"{entry.object or entry.sidecar}: {problem}")
                continue
            data, side = entry.object.read_bytes(), entry.sidecar.read_bytes()
            key = (entry.family, entry.keyhash)
            if key in found and found[key][0] != data:
                bad.append(f"{entry.object}: differs from the same key in an earlier directory")
                continue
            found.setdefault(key, (data, side))
    if bad:
        raise BundleError("refusing to bundle bad entries (run `python -m quack.cache verify`):\n  " + "\n  ".join(bad))
    return found


def write_bundle(dirs: Iterable[Path], out: Path) -> dict:
    """Write the bundle of ``dirs`` to ``out`` atomically; returns a summary."""
    entries = collect(list(dirs))
    objects = []
    members: list[tuple[str, bytes]] = []
    for (family, keyhash), (data, side) in sorted(entries.items()):
        objects.append({
            "family": family,
            "key": keyhash,
            "file": f"{family}/{keyhash}.o",
            "size": len(data),
            "sha256": _sha256(data),
            "sidecar": f"{family}/{keyhash}.json",
            "sidecar_sha256": _sha256(side),
        })
        members += [(f"{family}/{keyhash}.json", side), (f"{family}/{keyhash}.o", data)]
    manifest = {"bundle_format": BUNDLE_FORMAT, "cache_format": CACHE_FORMAT_VERSION, "objects": objects}
    manifest_bytes = (json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode()
    if len(objects) > MAX_OBJECTS or len(manifest_bytes) > MAX_MANIFEST_BYTES:
        raise BundleError(
            f"refusing to write a bundle of {len(objects)} entries ({len(manifest_bytes)} bytes of manifest): "
            f"an install reads at most {MAX_OBJECTS} entries and {MAX_MANIFEST_BYTES} bytes of manifest; "
            "split them over several bundles"
        )
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", dir=out.parent)
    try:
        with os.fdopen(fd, "wb") as raw:
            with tarfile.open(fileobj=raw, mode="w", format=tarfile.USTAR_FORMAT) as tar:
                for name, data in [(MANIFEST, manifest_bytes)] + sorted(members):
                    tar.addfile(_tarinfo(name, len(data)), io.BytesIO(data))
            raw.flush()
            os.fsync(raw.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    digest = hashlib.sha256(out.read_bytes()).hexdigest()
    return {"out": str(out), "objects": len(objects), "bytes": out.stat().st_size, "sha256": digest}


# --- reading a bundle ---------------------------------------------------------------------------


class _HeadersTooLong(Exception):
    """tarfile asked for more header bytes than one member may have."""


class _HeaderBudget:
    """The bundle file as tarfile reads it: while ``left`` is set, reads past it are refused.

    tarfile reads a member's extended headers (pax records, long names, sparse
    maps) with reads of the size they declare; a budget set while it reads
    headers refuses an oversized one before anything is allocated. Member
    data is read with the budget unset, its size checked beforehand.
    """

    def __init__(self, raw: BinaryIO) -> None:
        self.raw = raw
        self.left: int | None = None

    def read(self, size: int = -1) -> bytes:
        if self.left is not None:
            if size is None or size < 0 or size > self.left:
                raise _HeadersTooLong
            self.left -= size
        return self.raw.read(size)

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        return self.raw.seek(offset, whence)

    def tell(self) -> int:
        return self.raw.tell()

    def seekable(self) -> bool:
        return True


class _Bundle:
    """A bundle opened for installing: its members one at a time (``members``), headers bounded."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file = _open_archive(path)
        try:
            self._budget = _HeaderBudget(self._file)
            self._tar = self._headers(lambda: tarfile.open(fileobj=self._budget, mode="r:"), 1)
        except BaseException:
            self._file.close()
            raise
        self.members = self._members()

    def __enter__(self) -> _Bundle:
        return self

    def __exit__(self, *exc_info) -> None:
        self._tar.close()
        self._file.close()

    def _headers(self, read: Callable[[], _T], number: int) -> _T:
        """Run a tarfile call that reads the headers of member ``number``, within ``MAX_HEADER_BYTES``."""
        self._budget.left = MAX_HEADER_BYTES
        try:
            return read()
        except _HeadersTooLong:
            raise BundleError(
                f"refusing bundle {self.path}: the tar headers of its member {number} (pax records, "
                f"long names) take more than {MAX_HEADER_BYTES} bytes"
            ) from None
        except (OSError, tarfile.TarError, EOFError, ValueError) as exc:
            raise BundleError(f"cannot read bundle {self.path}: {exc}") from exc
        finally:
            self._budget.left = None

    def _members(self) -> Iterator[tarfile.TarInfo]:
        for count in itertools.count(1):
            info = self._headers(self._tar.next, count)
            if info is None:
                return
            if count > MAX_MEMBERS:
                raise BundleError(f"refusing bundle {self.path}: more than {MAX_MEMBERS} members")
            if info.size < 0:  # tarfile would read this header again and again
                raise BundleError(
                    f"refusing bundle {self.path}: member {_show(info.name)} has a negative size ({info.size})"
                )
            yield info

    def manifest(self) -> bytes:
        """The first member, which must be the manifest, read once its size is checked."""
        info = next(self.members, None)
        if info is None or info.name != MANIFEST:
            raise BundleError(f"bundle {self.path} has no {MANIFEST} as its first member")
        if info.type not in _FILE_TYPES or info.sparse is not None:
            raise BundleError(f"refusing bundle {self.path}: its {MANIFEST} is not a regular file")
        if info.size > MAX_MANIFEST_BYTES:
            raise BundleError(
                f"refusing bundle {self.path}: its {MANIFEST} is {info.size} bytes, "
                f"more than the {MAX_MANIFEST_BYTES} allowed"
            )
        return b"".join(self.chunks(info))

    def chunks(self, info: tarfile.TarInfo) -> Iterator[bytes]:
        """A member's data (its size checked by the caller) in chunks of bounded size."""
        try:
            data = self._tar.extractfile(info)
            left = info.size
            while left > 0:
                chunk = data.read(min(_CHUNK, left))
                if not chunk:
                    raise tarfile.ReadError("unexpected end of data")
                left -= len(chunk)
                yield chunk
        except (OSError, tarfile.TarError, ValueError) as exc:
            raise BundleError(f"cannot read bundle {self.path}: member {_show(info.name)}: {exc}") from exc


def _open_archive(path: Path) -> BinaryIO:
    """``path`` opened for reading: a regular file (a FIFO would block) and not compressed."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise BundleError(f"cannot read bundle {path}: {exc}") from exc
    file = os.fdopen(fd, "rb")
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise BundleError(f"bundle {path} is not a regular file")
        head = file.read(8)
        file.seek(0)
        for magic, name in _COMPRESSION.items():
            if head.startswith(magic):
                raise BundleError(
                    f"refusing bundle {path}: it is {name}-compressed, and a bundle is a plain "
                    "(uncompressed) tar archive: decompress it first"
                )
    except BaseException:
        file.close()
        raise
    return file


def _show(name: str) -> str:
    """A name from the archive for a message: quoted and cut short."""
    return repr(name) if len(name) <= 80 else repr(name[:80]) + "..."


def _summary(problems: list[str]) -> str:
    """The first few problems and how many there are: a message of bounded length."""
    more = f"\n  ... and {len(problems) - _SHOWN} more" if len(problems) > _SHOWN else ""
    return f"{len(problems)} problem{'s' * (len(problems) != 1)}:\n  " + "\n  ".join(problems[:_SHOWN]) + more


def _manifest_objects(data: bytes) -> list[dict]:
    """The entries a manifest lists, each well formed, safely named and within the limits."""
    try:
        manifest = json.loads(data)
        objects = manifest["objects"]
        if manifest.get("bundle_format") != BUNDLE_FORMAT or not isinstance(objects, list):
            raise ValueError(f"bundle format {manifest.get('bundle_format')!r}, expected {BUNDLE_FORMAT}")
        if len(objects) > MAX_OBJECTS:
            raise ValueError(f"{len(objects)} entries, more than the {MAX_OBJECTS} an install reads")
        keys = set()
        for obj in objects:
            for field in ("family", "key", "file", "sha256", "sidecar", "sidecar_sha256"):
                if not isinstance(obj.get(field), str):
                    raise ValueError(f"object without {field}")
            family, keyhash, size = obj["family"], obj["key"], obj.get("size")
            name = _show(f"{family}/{keyhash}")
            if not FAMILY.fullmatch(family) or not KEYHASH.fullmatch(keyhash):
                raise ValueError(f"bad entry name {name}")
            if obj["file"] != f"{family}/{keyhash}.o" or obj["sidecar"] != f"{family}/{keyhash}.json":
                raise ValueError(f"inconsistent file names for {name}")
            if type(size) is not int or not 0 < size <= MAX_OBJECT_BYTES:
                raise ValueError(f"{name}: object size {size!r} is not between 1 and {MAX_OBJECT_BYTES}")
            if (family, keyhash) in keys:
                raise ValueError(f"{name} is listed twice")
            keys.add((family, keyhash))
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
        raise BundleError(f"bad bundle manifest: {exc}") from exc
    return objects


def _member_problem(info: tarfile.TarInfo, expected: dict[str, tuple[str, int | None]], seen: set[str]) -> str:
    """Why member ``info`` may not follow the manifest (``""``: it may), from its header alone.

    ``expected``: name -> (sha256, exact size or None for a sidecar) of what the manifest lists.
    """
    name, shown = info.name, _show(info.name)
    if name.startswith("/") or ".." in name.split("/") or "\\" in name:
        return f"{shown}: unsafe name"
    if info.sparse is not None or info.type == tarfile.GNUTYPE_SPARSE:
        return f"{shown}: a sparse file, not a plain regular file"
    if info.isdir():
        return "" if FAMILY.fullmatch(name) else f"{shown}: unexpected bundle member (a folder)"
    if info.type not in _FILE_TYPES:
        return f"{shown}: a {_KINDS.get(info.type, f'member of type {info.type!r}')}, not a regular file"
    if name in seen:
        return f"{shown}: appears twice"
    if name not in expected:
        listable = _MEMBER.fullmatch(name)
        return f"{shown}: not listed in the manifest" if listable else f"{shown}: unexpected bundle member"
    size = expected[name][1]
    if size is None and info.size > MAX_SIDECAR_BYTES:
        return f"{shown}: {info.size} bytes, more than a sidecar may have ({MAX_SIDECAR_BYTES})"
    if size is not None and info.size != size:
        return f"{shown}: {info.size} bytes, the manifest says {size}"
    return ""


def _stage_members(bundle: _Bundle, staging: Layer, objects: list[dict]) -> list[str]:
    """Copy the members after the manifest into ``staging``, each checked against the
    manifest before it is read; returns the problems found. After the first problem only
    headers are read, to report the others too."""
    expected: dict[str, tuple[str, int | None]] = {}
    for obj in objects:
        expected[obj["file"]] = (obj["sha256"], obj["size"])
        expected[obj["sidecar"]] = (obj["sidecar_sha256"], None)
    problems: list[str] = []
    seen = {MANIFEST}
    for info in bundle.members:
        problem = _member_problem(info, expected, seen)
        if problem:
            problems.append(problem)
        elif not info.isdir() and not problems:
            if _stage_file(bundle, info, staging.root / info.name) != expected[info.name][0]:
                problems.append(f"{_show(info.name)}: sha256 does not match the bundle manifest")
        if not info.isdir():
            seen.add(info.name)
    problems += [f"{_show(name)}: listed in the manifest, missing from the archive"
                 for name in expected if name not in seen]
    return problems


def _stage_file(bundle: _Bundle, info: tarfile.TarInfo, path: Path) -> str:
    """Write member ``info`` to ``path`` (created private); returns its sha256."""
    private_folder(path.parent)
    digest = hashlib.sha256()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "wb") as out:
        os.fchmod(fd, 0o600)
        for chunk in bundle.chunks(info):
            digest.update(chunk)
            out.write(chunk)
    return digest.hexdigest()


def _verify_staged(staging: Layer, objects: list[dict]) -> list[str]:
    """Each staged entry checked on its own (sidecar against key, name and object)."""
    problems = []
    for obj in objects:
        family, keyhash = obj["family"], obj["key"]
        entry = Entry(staging, family, keyhash, object=staging.object_path(family, keyhash),
                      sidecar=staging.sidecar_path(family, keyhash))
        problem = check(entry)
        if problem:
            problems.append(f"{obj['file']}: {problem}")
    return problems


# --- the target layer -------------------------------------------------------------------------


def _private_root(into: Path) -> Path:
    """The real path of layer ``into``, created private with its missing parents.

    An existing layer must pass the writable layer's trust check; the layer
    itself may be a symlink (as for the cache), nothing inside it may.
    """
    into = Path(os.path.abspath(into))
    problem = writable_problem(into)
    if problem:
        raise BundleError(problem)
    missing = list(itertools.takewhile(lambda p: not os.path.lexists(p), (into, *into.parents)))
    for folder in reversed(missing):
        private_folder(folder)
    problem = writable_problem(into)
    if problem:
        raise BundleError(problem)
    return Path(os.path.realpath(into))


def _node_problem(path: Path, *, folder: bool) -> str:
    """Why the install may not use ``path`` of the target layer (``""``: absent, or a real
    folder / regular file as ``folder`` says)."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return ""
    if stat.S_ISLNK(mode):
        return f"{path} is a symbolic link"
    if not (stat.S_ISDIR if folder else stat.S_ISREG)(mode):
        return f"{path} is not a {'folder' if folder else 'regular file'}"
    return ""


def _target_problems(target: Layer, objects: list[dict]) -> list[str]:
    """Links (and other odd files) where the install would write in the target layer."""
    problems = []
    family_ok: dict[str, bool] = {}
    for obj in objects:
        family, keyhash = obj["family"], obj["key"]
        if family not in family_ok:
            problem = _node_problem(target.root / family, folder=True)
            family_ok[family] = not problem
            problems += [problem] if problem else []
        if family_ok[family]:
            for path in (target.object_path(family, keyhash), target.sidecar_path(family, keyhash),
                         target.lock_path(family, keyhash)):
                problem = _node_problem(path, folder=False)
                problems += [problem] if problem else []
    return problems


def _refuse_links(target: Layer, objects: list[dict]) -> None:
    problems = _target_problems(target, objects)
    if problems:
        raise BundleError(
            f"refusing to install into {target.root}: an install never follows symbolic links or "
            f"replaces other kinds of file inside the layer; {_summary(problems)}"
        )


# --- staging, moving into place, rolling back ---------------------------------------------------


@contextlib.contextmanager
def _staging(root: Path) -> Iterator[Layer]:
    """A private staging folder inside ``root``, its lock held until it is removed on exit."""
    path = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=root))
    lock = None
    try:
        os.chmod(path, 0o700)
        lock = os.open(path / ".lock", os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        os.fchmod(lock, 0o600)
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        yield Layer(path, str(path), True)
    finally:
        shutil.rmtree(path, ignore_errors=True)
        if lock is not None:
            os.close(lock)


def remove_stale_staging(root: Path, max_age: float = STALE_STAGING_SECONDS) -> list[Path]:
    """Remove the staging folders of killed installs from layer ``root``: real folders of
    ours named ``.quack-install-*``, older than ``max_age`` seconds, whose lock nobody holds
    (the age covers an install that has made its folder but not locked it yet)."""
    removed = []
    now = time.time()
    for path in sorted(root.glob(STAGING_PREFIX + "*")):
        try:
            st = path.lstat()
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or now - st.st_mtime < max_age:
                continue
            if locks.held(path / ".lock"):
                continue
        except OSError:
            continue  # unreadable lock: left alone
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


@dataclass
class _Move:
    """A file this install moves into the target layer, recorded before the move (so an
    interrupted move is undone too), and where the file it replaces is set aside."""

    family: str
    keyhash: str
    dest: Path
    backup: Path | None  # in the staging folder; None where nothing was replaced
    inode: tuple[int, int] | None  # (device, inode) of the file moved in


def _inode(path: Path) -> tuple[int, int] | None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


def _holds(path: Path, sha256: str) -> bool:
    """Whether ``path`` is a private regular file of ours (what the cache loads) with this sha256."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False
    with os.fdopen(fd, "rb") as file:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or ownership_problem(st, path.name):
            return False
        return hashlib.file_digest(file, "sha256").hexdigest() == sha256


def _move(moves: list[_Move], family: str, keyhash: str, src: Path, dest: Path) -> None:
    """Move staged ``src`` to ``dest``, setting aside the file it replaces; recorded in ``moves`` first."""
    backup = src.with_name(src.name + ".replaced") if os.path.lexists(dest) else None
    moves.append(_Move(family, keyhash, dest, backup, _inode(src)))
    if backup is not None:
        os.replace(dest, backup)
    os.replace(src, dest)


def _move_into_place(target: Layer, staging: Layer, objects: list[dict]) -> tuple[int, int]:
    """Move every staged entry into the target layer under its key's lock, sidecar last;
    returns (installed, already present). A failure rolls back what was moved."""
    moves: list[_Move] = []
    installed = present = 0
    try:
        for obj in objects:
            family, keyhash = obj["family"], obj["key"]
            files = [(staging.object_path(family, keyhash), target.object_path(family, keyhash), obj["sha256"]),
                     (staging.sidecar_path(family, keyhash), target.sidecar_path(family, keyhash),
                      obj["sidecar_sha256"])]
            private_folder(target.root / family)
            with key_lock(target, family, keyhash):  # refuses a family folder that is a link
                for _, dest, _ in files:
                    problem = _node_problem(dest, folder=False)
                    if problem:
                        raise BundleError(f"{problem} (an install never follows links)")
                if all(_holds(dest, sha256) for _, dest, sha256 in files):
                    present += 1
                    continue
                for src, dest, _ in files:
                    _move(moves, family, keyhash, src, dest)
                installed += 1
    except BaseException as exc:
        _free_staged(staging, objects)
        failed = _roll_back(target, moves)
        if not isinstance(exc, (OSError, CacheError)):
            raise  # interrupted: rolled back all the same
        entries = len({(m.family, m.keyhash) for m in moves})
        if failed:
            raise BundleError(
                f"moving entries into {target.root} failed ({exc}), and so did undoing {len(failed)} of "
                f"its moves: those entries may be missing or stale (`python -m quack.cache verify` "
                f"finds them); {_summary(failed)}"
            ) from exc
        undone = f"rolled back {entries} entr{'y' if entries == 1 else 'ies'} it had moved: " if entries else ""
        raise BundleError(f"moving entries into {target.root} failed ({exc}); {undone}nothing was installed") from exc
    return installed, present


def _free_staged(staging: Layer, objects: list[dict]) -> None:
    """Delete the staged files not moved, so that a full disk has room for the rollback's key locks."""
    for obj in objects:
        family, keyhash = obj["family"], obj["key"]
        for path in (staging.object_path(family, keyhash), staging.sidecar_path(family, keyhash)):
            with contextlib.suppress(OSError):
                path.unlink()


def _roll_back(target: Layer, moves: list[_Move]) -> list[str]:
    """Undo ``moves``, newest first, each under its key's lock; returns those that failed.

    A place is taken back only while it holds what this install left there
    (the file it moved in, or nothing where the move did not happen): a
    file another process wrote since stays.
    """
    failed = []
    for move in reversed(moves):
        try:
            with key_lock(target, move.family, move.keyhash):
                current = _inode(move.dest)
                if current not in (None, move.inode):
                    continue
                if move.backup is not None and os.path.lexists(move.backup):
                    os.replace(move.backup, move.dest)
                elif current is not None:
                    os.unlink(move.dest)
        except (OSError, CacheError) as exc:
            failed.append(f"{move.dest}: {exc}")
    return failed


def install_bundle(path: Path, into: Path) -> dict:
    """Install every entry of bundle ``path`` into cache directory ``into``, or none.

    Raises ``BundleError`` for a refused bundle or target and for a failed
    install (whose moves are rolled back first).
    """
    path = Path(path)
    try:
        with _Bundle(path) as bundle:
            objects = _manifest_objects(bundle.manifest())
            root = _private_root(Path(into))
            target = Layer(root, str(root), True)
            _refuse_links(target, objects)
            remove_stale_staging(root)
            with _staging(root) as staging:
                problems = _stage_members(bundle, staging, objects)
                if problems:
                    raise BundleError(f"refusing bundle {path}: {_summary(problems)}")
                problems = _verify_staged(staging, objects)
                if problems:
                    raise BundleError(f"refusing to install bundle with bad entries: {_summary(problems)}")
                installed, present = _move_into_place(target, staging, objects)
    except OSError as exc:
        raise BundleError(f"installing {path} into {into} failed: {exc}") from exc
    return {"bundle": str(path), "into": str(into), "objects": len(objects),
            "installed": installed, "already_present": present}
