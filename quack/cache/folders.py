"""Cache folders as build outputs: the listing they carry, and the union of several.

A folder a build writes (``python -m quack.warm``, tools/warm_cache.py, one
Bazel kernel action per object) holds ``<family>/<key>.o`` + ``.json`` entries
and ``manifest.json``: every entry that verifies (key hash, family, file,
sha256), sorted, so the same entries give the same bytes on every machine.
``merge`` writes the union of such folders (Bazel's per-family folder from its
per-object actions' outputs), entries verified and byte-equal across inputs.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Iterable

from . import maintenance
from .errors import CacheError
from .bundle import collect
from .files import MAX_OBJECT_BYTES, read_bounded
from .store import Layer, ensure_layer_dir, family_folder

log = logging.getLogger("quack.cache")

MANIFEST = "manifest.json"


def write_manifest(out: Path) -> list[dict]:
    """Write ``out/manifest.json`` listing every entry that verifies, sorted by
    family and key (a bad one is left in place, unlisted, with a warning);
    returns the listed entries."""
    objects = []
    for entry in maintenance.scan(Layer(out, str(out), False), read_sidecars=False):
        problem = maintenance.check(entry)
        if problem:
            log.warning("%s/%s is not listed in %s: %s", out, entry.name, MANIFEST, problem)
            continue
        data = read_bounded(entry.object, MAX_OBJECT_BYTES)
        objects.append({
            "key": entry.keyhash,
            "family": entry.family,
            "file": f"{entry.family}/{entry.keyhash}.o",
            "sha256": hashlib.sha256(data).hexdigest(),
        })
    objects.sort(key=lambda o: (o["family"], o["key"]))
    text = json.dumps({"objects": objects}, indent=1, sort_keys=True) + "\n"
    fd, tmp = tempfile.mkstemp(prefix=f".{MANIFEST}.", dir=out)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, out / MANIFEST)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return objects



def merge(dirs: Iterable[Path], out: Path) -> list[dict]:
    """Write every entry of the cache folders ``dirs`` (verified; one key in
    two folders must have the same object: ``bundle.collect``) into the new
    or empty folder ``out``, then its ``manifest.json``; returns the listing."""
    entries = collect(list(dirs))
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise CacheError(f"{out} is not empty: merge writes a new folder")
    layer = Layer(out, str(out), True)
    ensure_layer_dir(layer)
    for (family, keyhash), (data, side) in entries.items():
        folder = family_folder(layer, family)
        for name, content in ((f"{keyhash}.o", data), (f"{keyhash}.json", side)):
            (folder / name).write_bytes(content)
    return write_manifest(out)
