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
the full path guards the device).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import torch

from quack.cache import launcher
from quack.cache.mode import compile_only_active

# A bound on the closures kept (each description is one shape; a process that
# sees more distinct calls than this starts over).
MAX_CLOSURES = 4096

_CLOSURES: dict[bytes, Callable[..., Any]] = {}


@functools.lru_cache(maxsize=None)
def _describer() -> Optional[Callable[..., Any]]:
    """``_fastlaunch.describe`` configured with torch's DLPack table, or None
    without the C launcher."""
    module, api, _ = launcher._c_module()
    if module is None:
        return None
    module.configure(api, (torch.Tensor, torch.nn.Parameter))
    return module.describe


def describe(*args: Any) -> Optional[bytes]:
    """The fast path's key of an eager call on ``args`` (tensors, None, bools,
    ints), or None where the fast path does not apply."""
    if torch.compiler.is_compiling() or compile_only_active():
        return None
    describer = _describer()
    return describer(torch.is_grad_enabled(), *args) if describer is not None else None


def call(key: Optional[bytes], *args: Any) -> Any:
    """Run the launch closure of an earlier call with this description on
    ``args``; NotImplemented where there is none or it declined (the caller
    then takes the full path)."""
    run = _CLOSURES.get(key) if key is not None else None
    return run(*args) if run is not None else NotImplemented


def remember(key: Optional[bytes], make: Callable[[], Optional[Callable[..., Any]]]) -> None:
    """Keep ``make()``'s closure for calls described by ``key`` (nothing when
    ``key`` is None or ``make`` returns None: no direct launcher exists)."""
    if key is None or key in _CLOSURES:
        return
    run = make()
    if run is None:
        return
    if len(_CLOSURES) >= MAX_CLOSURES:
        _CLOSURES.clear()
    _CLOSURES[key] = run


def direct(plan, role: str, device: torch.device, rows: frozenset[int] = frozenset()):
    """The direct C launcher of ``plan``'s ``role`` kernel on ``device``
    (``KernelHandle.direct``), or None."""
    handle = plan.kernel(role)
    make = getattr(handle, "direct", None)
    return make(device.index, rows) if make is not None else None


def clear() -> None:
    """Forget every closure (tests that change the cache's knobs)."""
    _CLOSURES.clear()
