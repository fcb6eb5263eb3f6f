"""Persistent cache of exported CuTe DSL kernel objects.

A kernel family decorates its compile function with :func:`jit_cache`; the
decorated function returns a handle that launches the kernel, loading the
object from memory, a read-only layer or the writable layer, and compiling
(then exporting) only on a miss. Knobs: see :mod:`quack.cache.config`.

``COMPILE_ONLY`` is a live, read-only view of compile-only mode; enter the mode
with :func:`quack.compile_only.compile_only_mode`. Assigning it raises
``AttributeError``: a plain module global could be set and never reset (the old
leak), and Python ignores a module-level ``__setattr__``, so the module's class
is swapped for a ``ModuleType`` subclass below.
"""

from __future__ import annotations

import sys
import types

from .config import current_arch
from .errors import CacheError, CacheMissError
from quack.launch.handle import KernelHandle
from .jit import clear, jit_cache
from .key import CACHE_FORMAT_VERSION
from .key import options_for_arch
from .mode import compile_only_active
from .stats import stats

__all__ = [
    "CACHE_FORMAT_VERSION",
    "COMPILE_ONLY",
    "CacheError",
    "CacheMissError",
    "KernelHandle",
    "clear",
    "compile_options",
    "current_arch",
    "jit_cache",
    "stats",
]


def compile_options() -> str:
    """Options for ``cute.compile``: the current GPU arch plus the pinned host target."""
    return options_for_arch(current_arch())


class _CacheModule(types.ModuleType):
    """Module class that makes ``COMPILE_ONLY`` a live read-only attribute."""

    @property
    def COMPILE_ONLY(self) -> bool:  # noqa: N802 - public constant-style name
        return compile_only_active()

    def __setattr__(self, name: str, value: object) -> None:
        if name == "COMPILE_ONLY":
            raise AttributeError(
                "quack.cache.COMPILE_ONLY is read-only; use quack.compile_only.compile_only_mode()"
            )
        super().__setattr__(name, value)

    def __delattr__(self, name: str) -> None:
        if name == "COMPILE_ONLY":
            raise AttributeError("quack.cache.COMPILE_ONLY cannot be deleted")
        super().__delattr__(name)


sys.modules[__name__].__class__ = _CacheModule
