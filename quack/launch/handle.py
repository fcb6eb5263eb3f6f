"""Callable kernel handles returned by ``jit_cache``-decorated compile functions."""

from __future__ import annotations

import contextlib
from typing import Any, Callable


class _PythonFront:
    """``_fastlaunch.Front`` in Python, where the C module is not built: the
    ``checked`` launcher first, ``_call_guarded`` where there is none or it
    declines (NotImplemented)."""

    __slots__ = ("checked",)

    def __call__(self, *args: Any) -> Any:
        checked = self.checked
        if checked is not None:
            result = checked(*args)
            if result is not NotImplemented:
                return result
        return self._call_guarded(*args)


try:
    from ._fastlaunch import Front as _Front
except ImportError:
    _Front = _PythonFront


class KernelHandle(_Front):
    """Launches one compiled kernel: ``handle(*runtime_args)``.

    Wraps the ``JitCompiledFunction`` from ``cute.compile`` or from
    ``ExternalBinaryModule[function_prefix]``; ``owner`` keeps the loaded module
    (and its execution engine holding the machine code) alive as long as the handle.

    Devices: a loaded module belongs to the CUDA context it was first launched
    in, so the handle runs on the device of its first launch (the device of its
    first CUDA tensor argument), and loads a module of its own for every other
    device, through ``reload`` (``jit_cache`` sets it: the entry is loaded
    again, or compiled again where it could not be cached).  Each launch runs
    with its tensors' device current (a device guard, where it is not).  A
    launch on the first launch's device with its context current takes
    FastLauncher's ``checked`` C launcher, which checks that in C: the base
    class (``_fastlaunch.Front``) calls it with no Python frame, and
    ``_call_guarded`` where it declines.
    """

    __slots__ = ("_fn", "_owner", "keyhash", "device", "reload", "_per_device")

    def __init__(self, fn: Any, keyhash: str, owner: Any = None) -> None:
        self._fn = fn
        self._owner = owner
        self.keyhash = keyhash
        self.device: int | None = None  # of the first launch
        self.reload: Callable[[], "KernelHandle"] | None = None
        self._per_device: dict[int, KernelHandle] = {}
        self.checked = None  # set after the first launch on this handle's device

    def _call_guarded(self, *args: Any) -> Any:
        device = _device_of(args)
        if device is None:
            return self._fn(*args)
        if self.device is None:
            self.device = device
        if device == self.device:
            with _current(device):
                result = self._fn(*args)
            self.checked = getattr(self._fn, "checked", None)  # FastLauncher's, once it has one
            return result
        other = self._per_device.get(device)
        if other is None:
            other = self._load_for(device)
        with _current(device):
            return other._fn(*args)

    def direct(self, device: int, rows: frozenset[int] = frozenset(),
               per_stream: frozenset[int] = frozenset()) -> Any:
        """The C launcher of this kernel's module on ``device`` for the eager
        fast path (``FastLauncher.direct``), or None where there is none yet
        (no launch on that device so far) or at all."""
        handle = self if device == self.device else self._per_device.get(device)
        make = getattr(handle._fn, "direct", None) if handle is not None else None
        return make(rows, per_stream) if make is not None else None

    def _load_for(self, device: int) -> "KernelHandle":
        if self.reload is None:
            raise RuntimeError(
                f"kernel {self.keyhash} was loaded on cuda:{self.device} and cannot be loaded again for cuda:{device}"
            )
        with _current(device):
            other = self.reload()
        other.device = device
        self._per_device[device] = other
        return other

    def __repr__(self) -> str:
        return f"<KernelHandle {self.keyhash}>"


def _device_of(args: tuple) -> int | None:
    """The device index of the first CUDA tensor argument (None: there is none)."""
    for arg in args:
        if getattr(arg, "is_cuda", False):
            return arg.get_device()
    return None


def _current(device: int):
    """``device`` made the current CUDA device for the block, when it is not."""
    import torch

    if torch.cuda.current_device() == device:
        return contextlib.nullcontext()
    return torch.cuda.device(device)


def _noop_kernel(*args: Any, **kwargs: Any) -> None:
    """The handle under compile-only mode: the object is exported, nothing launches."""
