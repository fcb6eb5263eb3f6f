"""Every environment knob of the kernel cache, read in one place.

Knobs are read on each lookup (not once at import) so tests, Bazel actions and
``monkeypatch.setenv`` see their current values.

=====================  ==========  =====================================================
Variable               Type        Meaning (default)
=====================  ==========  =====================================================
``QUACK_CACHE_DIR``    path        Writable layer: compiles are exported here
                                   (``$XDG_CACHE_HOME/quack``, else ``~/.cache/quack``).
``QUACK_CACHE_PATH``   path list   Read-only layers, ``os.pathsep``-separated, searched
                                   in order before the writable layer (none).
``QUACK_CACHE_STRICT`` bool        ``1``: a miss raises ``CacheMissError`` instead of
                                   compiling; a bad entry raises ``CacheError`` (``0``).
``QUACK_ARCH``         str         GPU arch to compile for, e.g. ``sm_90a`` (the visible
                                   GPU's compute capability, else ``sm_90a``).
``QUACK_CACHE_MAX_SIZE`` size      After each export, evict least recently used entries
                                   of the writable layer down to this size, e.g. ``2G``
                                   (no bound). See :func:`parse_size`.
``QUACK_CACHE_LOCK_TIMEOUT`` seconds  How long to wait for another process exporting the
                                   same kernel before giving up with an error naming
                                   its lock file and pid (``300``).
``QUACK_CACHE_RECORD`` path        Append each call's signature to this manifest
                                   (``quack/calls/recording.py``; not recorded).
=====================  ==========  =====================================================
"""

from __future__ import annotations

import functools
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

DEFAULT_ARCH = "sm_90a"
RECORD_ENV = "QUACK_CACHE_RECORD"

# A generic x86-64 host target makes the host half of an object identical on
# every build machine; the native default bakes in the builder's CPU.
HOST_TARGET = "llvm -mtriple=x86_64-unknown-linux-gnu -mcpu=x86-64"

def arch_capability(arch: str) -> tuple[int, int]:
    """(major, minor) of an arch string: "sm_90a" -> (9, 0), "sm_100a" -> (10, 0)."""
    digits = arch.removeprefix("sm_").rstrip("abf")
    if not digits.isdigit() or len(digits) < 2:
        raise ValueError(f"not a GPU arch: {arch!r} (expected sm_XY, e.g. sm_90a)")
    return int(digits[:-1]), int(digits[-1])


_TRUE = {"1", "true", "yes", "on"}


@dataclass(frozen=True)
class CacheConfig:
    """A snapshot of the knobs for one lookup."""

    writable_dir: Path
    readonly_dirs: tuple[Path, ...]  # already resolved to their real roots
    strict: bool
    arch: str
    max_size: int | None = None  # bytes; None: no automatic bound


def read_config() -> CacheConfig:
    """Read every knob from the environment now."""
    return CacheConfig(
        writable_dir=_writable_dir(),
        readonly_dirs=_resolve_layers(os.environ.get("QUACK_CACHE_PATH", "")),
        strict=os.environ.get("QUACK_CACHE_STRICT", "").strip().lower() in _TRUE,
        arch=current_arch(),
        max_size=max_cache_size(),
    )


_SIZE = re.compile(r"(?P<number>\d+(?:\.\d+)?)\s*(?P<unit>[kmgt]?)(?:i?b)?", re.I)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str) -> int:
    """Bytes in ``text``: a number with an optional unit K, M, G or T (powers of 1024;
    ``KB``/``KiB`` spellings accepted), e.g. ``500M``, ``2G``, ``1.5G``, ``4096``.
    Raises ``ValueError`` with a readable message otherwise."""
    match = _SIZE.fullmatch(text.strip())
    if not match:
        raise ValueError(f"not a size: {text!r} (expected e.g. 500M, 2G, 4096)")
    return int(float(match["number"]) * _UNITS[match["unit"].lower()])


@functools.lru_cache(maxsize=8)
def _max_size(raw: str) -> int | None:
    if not raw.strip():
        return None
    try:
        return parse_size(raw)
    except ValueError as exc:
        logging.getLogger("quack.cache").warning("ignoring QUACK_CACHE_MAX_SIZE: %s", exc)
        return None


def max_cache_size() -> int | None:
    """``QUACK_CACHE_MAX_SIZE`` in bytes, or None (unset or unreadable: warned once)."""
    return _max_size(os.environ.get("QUACK_CACHE_MAX_SIZE", ""))


DEFAULT_LOCK_TIMEOUT = 300.0


def lock_timeout() -> float:
    """``QUACK_CACHE_LOCK_TIMEOUT`` in seconds (unset or unreadable: the default, warned once)."""
    return _lock_timeout(os.environ.get("QUACK_CACHE_LOCK_TIMEOUT", ""))


@functools.lru_cache(maxsize=8)
def _lock_timeout(raw: str) -> float:
    if not raw.strip():
        return DEFAULT_LOCK_TIMEOUT
    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1.0
    if not seconds >= 0:
        logging.getLogger("quack.cache").warning(
            "ignoring QUACK_CACHE_LOCK_TIMEOUT=%r (expected seconds, e.g. 300)", raw)
        return DEFAULT_LOCK_TIMEOUT
    return seconds


def current_arch() -> str:
    """``QUACK_ARCH``, else the visible GPU's arch, else ``sm_90a``.

    Major >= 9 gets the ``a`` suffix: Hopper kernels need the arch-specific
    features (wgmma, TMA multicast) that plain ``sm_90`` does not enable.
    """
    arch = os.environ.get("QUACK_ARCH", "").strip()
    if arch:
        return arch
    import torch

    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        return f"sm_{major}{minor}{'a' if major >= 9 else ''}"
    return DEFAULT_ARCH


def _writable_dir() -> Path:
    explicit = os.environ.get("QUACK_CACHE_DIR", "").strip()
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "quack"


@functools.lru_cache(maxsize=None)
def _resolve_layers(raw: str) -> tuple[Path, ...]:
    """Resolve each read-only layer once to its real root.

    Bazel runfiles are symlink trees; entries are later accepted only if their
    own real path stays inside one of these roots.
    """
    return tuple(Path(os.path.realpath(p)) for p in raw.split(os.pathsep) if p.strip())
