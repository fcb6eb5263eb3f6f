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

Installing refuses anything but regular files named ``manifest.json`` or
``<family>/<32 hex>.o|.json`` (so no absolute names, ``..``, links, devices or
directories), requires the members and the manifest to agree, and verifies
every object and sidecar before anything is installed. Entries are staged in
a temporary directory inside the target and moved into place one by one with
``os.replace`` under the key's lock, sidecar last: a reader never sees a
partial entry, and a refused bundle installs nothing.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import tarfile
import tempfile
from pathlib import Path
from typing import Iterable

from .errors import CacheError
from .key import CACHE_FORMAT_VERSION
from .maintenance import FAMILY, KEYHASH, Entry, check, scan
from .store import Layer, ensure_layer_dir, key_lock, writable_problem

BUNDLE_FORMAT = 1
MANIFEST = "manifest.json"
_MEMBER = re.compile(rf"(?P<family>{FAMILY.pattern})/(?P<keyhash>{KEYHASH.pattern})\.(?P<suffix>o|json)")


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


def _read_members(path: Path) -> dict[str, bytes]:
    """Every member of a bundle by name, refusing anything unsafe or unexpected."""
    try:
        tar = tarfile.open(path, mode="r:*")
    except (OSError, tarfile.TarError) as exc:
        raise BundleError(f"cannot read bundle {path}: {exc}") from exc
    members: dict[str, bytes] = {}
    with tar:
        try:
            for info in tar:
                name = info.name
                if name.startswith("/") or ".." in name.split("/") or "\\" in name:
                    raise BundleError(f"refusing bundle member with an unsafe name: {name!r}")
                if not info.isreg():
                    raise BundleError(f"refusing bundle member {name!r}: not a regular file (links and devices are refused)")
                if name != MANIFEST and not _MEMBER.fullmatch(name):
                    raise BundleError(f"refusing unexpected bundle member {name!r}")
                if name in members:
                    raise BundleError(f"refusing bundle with a duplicate member {name!r}")
                data = tar.extractfile(info).read()
                if len(data) != info.size:
                    raise BundleError(f"bundle member {name!r} is truncated")
                members[name] = data
        except (OSError, tarfile.TarError, EOFError) as exc:
            raise BundleError(f"cannot read bundle {path}: {exc}") from exc
    return members


def _manifest_objects(members: dict[str, bytes]) -> list[dict]:
    if MANIFEST not in members:
        raise BundleError(f"bundle has no {MANIFEST}")
    try:
        manifest = json.loads(members[MANIFEST])
        objects = manifest["objects"]
        if manifest.get("bundle_format") != BUNDLE_FORMAT or not isinstance(objects, list):
            raise ValueError(f"bundle format {manifest.get('bundle_format')!r}, expected {BUNDLE_FORMAT}")
        for obj in objects:
            for field in ("family", "key", "file", "sha256", "sidecar", "sidecar_sha256"):
                if not isinstance(obj.get(field), str):
                    raise ValueError(f"object without {field}")
            if obj["file"] != f"{obj['family']}/{obj['key']}.o" or obj["sidecar"] != f"{obj['family']}/{obj['key']}.json":
                raise ValueError(f"inconsistent file names for {obj['family']}/{obj['key']}")
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise BundleError(f"bad bundle manifest: {exc}") from exc
    listed = {o["file"] for o in objects} | {o["sidecar"] for o in objects}
    present = set(members) - {MANIFEST}
    if listed != present:
        extra, missing = sorted(present - listed), sorted(listed - present)
        raise BundleError(f"bundle members and manifest disagree (unlisted: {extra}, missing: {missing})")
    return objects


def install_bundle(path: Path, into: Path) -> dict:
    """Verify every entry of bundle ``path``, then install them into cache directory ``into``."""
    members = _read_members(Path(path))
    objects = _manifest_objects(members)
    target = Layer(Path(into), str(into), True)
    problem = writable_problem(target.root)
    if problem:
        raise BundleError(problem)
    try:
        ensure_layer_dir(target)
    except OSError as exc:
        raise BundleError(f"cannot create {target.root}: {exc}") from exc
    staging = Path(tempfile.mkdtemp(prefix=".install-", dir=target.root))
    installed = present = 0
    try:
        stage = Layer(staging, str(staging), True)
        problems = []
        for obj in objects:
            data, side = members[obj["file"]], members[obj["sidecar"]]
            if _sha256(data) != obj["sha256"] or _sha256(side) != obj["sidecar_sha256"]:
                problems.append(f"{obj['file']}: sha256 does not match the bundle manifest")
                continue
            (staging / obj["family"]).mkdir(exist_ok=True)
            stage.object_path(obj["family"], obj["key"]).write_bytes(data)
            stage.sidecar_path(obj["family"], obj["key"]).write_bytes(side)
            entry = Entry(stage, obj["family"], obj["key"],
                          object=stage.object_path(obj["family"], obj["key"]),
                          sidecar=stage.sidecar_path(obj["family"], obj["key"]))
            problem = check(entry)
            if problem:
                problems.append(f"{obj['file']}: {problem}")
        if problems:
            raise BundleError("refusing to install bundle with bad entries:\n  " + "\n  ".join(problems))
        for obj in objects:
            family, keyhash = obj["family"], obj["key"]
            (target.root / family).mkdir(mode=0o700, exist_ok=True)
            with key_lock(target, family, keyhash):
                dest_obj, dest_side = target.object_path(family, keyhash), target.sidecar_path(family, keyhash)
                if _same(dest_obj, members[obj["file"]]) and _same(dest_side, members[obj["sidecar"]]):
                    present += 1
                    continue
                os.replace(stage.object_path(family, keyhash), dest_obj)
                os.replace(stage.sidecar_path(family, keyhash), dest_side)
                installed += 1
    except OSError as exc:
        raise BundleError(f"installing {path} into {target.root} failed: {exc}") from exc
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return {"bundle": str(path), "into": str(target.root), "objects": len(objects),
            "installed": installed, "already_present": present}


def _same(path: Path, data: bytes) -> bool:
    try:
        return not path.is_symlink() and path.read_bytes() == data
    except OSError:
        return False
