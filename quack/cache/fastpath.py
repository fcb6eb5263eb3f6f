"""The eager fast path: a call's description -> the launch its first call set up.

An op's first eager call with given arguments runs the full path: checks,
signature, plan, kernel load, launch.  Where that call launched its kernel
and will run no backward, the op leaves a *launch closure* here, keyed by
the call's description (``_fastlaunch.describe``: dtypes, devices, shapes,
strides, address alignment, requires_grad under grad mode, and the op's
option values).  Every description is one outcome of the checks and one
plan, so a later call with the same description takes the closure:
allocate the outputs, launch through a C launcher that reads the tensors
and torch's current stream itself, return.  Nothing else runs per call.

Not taken (the full path runs): while torch.compile traces, in compile-only
mode, without the C launcher, for a tensor subclass or a float option, and
when another CUDA device is current (the closure returns NotImplemented and
the full path guards the device).  No closure is kept while calls are
recorded (``QUACK_CACHE_RECORD``, read when a closure would be kept, not on
every call): set it before the process's first call, as ``QUACK_CACHE_RECORD=FILE
<job>`` does, or a call already on the fast path is not recorded again.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Callable, Optional

import torch

from quack.cache import launcher, manifest
from quack.cache.mode import _COMPILE_ONLY_DEPTH, compile_only_active

# A bound on the closures kept (each description is one shape; a process that
# sees more distinct calls than this starts over).
MAX_CLOSURES = 4096

_TABLES: list["Closures"] = []


@functools.lru_cache(maxsize=None)
def _c_module() -> Any:
    """``_fastlaunch`` configured with torch's DLPack table, or None without
    the C launcher."""
    module, api, _ = launcher._c_module()
    if module is None:
        return None
    module.configure(api, (torch.Tensor, torch.nn.Parameter))
    return module


_is_compiling, _grad_enabled = torch.compiler.is_compiling, torch.is_grad_enabled


def _dispatch(*args: Any) -> Any:
    """``_fastlaunch.dispatch``, found on the first call (this function then
    replaces itself: no lookup per call); NotImplemented for every call
    without the C launcher."""
    global _dispatch
    module = _c_module()
    _dispatch = module.dispatch if module is not None else _declined
    return _dispatch(*args)


def _declined(*args: Any) -> Any:
    return NotImplemented


def applies() -> bool:
    """Whether the fast path can take a call now: not while torch.compile
    traces (no addresses), not in compile-only mode (nothing launches)."""
    return not (_is_compiling() or compile_only_active())


def describe(*args: Any) -> Optional[bytes]:
    """The fast path's key of an eager call on ``args`` (tensors, None, bools,
    ints), or None where the fast path does not apply."""
    module = _c_module() if applies() else None
    return module.describe(_grad_enabled(), *args) if module is not None else None


class Closures:
    """One op's launch closures, by call description (each op has its own:
    two ops' calls on the same tensors describe alike)."""

    def __init__(self) -> None:
        self._by_key: dict[bytes, Callable[..., Any]] = {}
        _TABLES.append(self)

    def call(self, described: int, *args: Any) -> Any:
        """The kept closure's ``run(*args)`` for a call whose first
        ``described`` arguments describe as an earlier call's did (one C call:
        describe, look up, run; no key object in Python); NotImplemented where
        there is none or it declined (the caller then takes the full path).
        Runs on every call, so ``applies()`` is inlined: two flag reads."""
        if _is_compiling() or _COMPILE_ONLY_DEPTH.get():
            return NotImplemented
        return _dispatch(self._by_key, _grad_enabled(), described, *args)

    def remember(self, described: tuple, make: Callable[[], Optional[Callable[..., Any]]]) -> None:
        """Keep ``make()``'s closure for calls whose described arguments
        describe as ``described`` does (nothing where they cannot be
        described, while calls are recorded, or when ``make`` returns None: no
        direct launcher).  The closure takes the arguments ``call`` is given."""
        key = describe(*described)
        if key is None or key in self._by_key or manifest.RECORD_ENV in os.environ:
            return
        run = make()
        if run is None:
            return
        if len(self._by_key) >= MAX_CLOSURES:
            self._by_key.clear()
        self._by_key[key] = run

    def __len__(self) -> int:
        return len(self._by_key)

    def clear(self) -> None:
        self._by_key.clear()


def direct(plan, role: str, device: torch.device, rows: frozenset[int] = frozenset()):
    """The direct C launcher of ``plan``'s ``role`` kernel on ``device``
    (``KernelHandle.direct``), or None."""
    handle = plan.kernel(role)
    make = getattr(handle, "direct", None)
    return make(device.index, rows) if make is not None else None


def clear() -> None:
    """Forget every op's closures (``quack.cache.clear``, ``quack.plan.clear``:
    they hold loaded kernels)."""
    for table in _TABLES:
        table.clear()
