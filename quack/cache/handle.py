"""Callable kernel handles returned by ``jit_cache``-decorated compile functions."""

from __future__ import annotations

from typing import Any


class KernelHandle:
    """Launches one compiled kernel: ``handle(*runtime_args)``.

    Wraps the ``JitCompiledFunction`` from ``cute.compile`` or from
    ``ExternalBinaryModule[function_prefix]``; ``owner`` keeps the loaded module
    (and its execution engine holding the machine code) alive as long as the handle.
    """

    __slots__ = ("_fn", "_owner", "keyhash")

    def __init__(self, fn: Any, keyhash: str, owner: Any = None) -> None:
        self._fn = fn
        self._owner = owner
        self.keyhash = keyhash

    def __call__(self, *args: Any) -> Any:
        return self._fn(*args)

    def __repr__(self) -> str:
        return f"<KernelHandle {self.keyhash}>"


def _noop_kernel(*args: Any, **kwargs: Any) -> None:
    """The handle under compile-only mode: the object is exported, nothing launches."""
