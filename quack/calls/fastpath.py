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

from quack.launch import launcher
from quack.calls import recording
from quack.calls import torch_interop as ti
from quack.cache import jit
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


# What an op tests before ``Closures.call``: dynamo (torch.compile, strict
# export) folds it to True while it traces, so the C dispatcher, opaque to it,
# is never traced; in eager mode it returns False and costs one small call
# (``is_compiling`` asks torch.jit.is_scripting first: four times the cost).
# Other tracers (non-strict export, make_fx) hand the ops tensor subclasses,
# which the dispatcher declines.  (Reading ``torch.compiler._is_compiling_flag``
# instead makes dynamo guard on the flag: torch 2.13 recompiled on every call.)
tracing = torch.compiler.is_dynamo_compiling
_grad_enabled = torch.is_grad_enabled


def applies() -> bool:
    """Whether the fast path can take a call now: not while torch.compile
    traces (no addresses), not in compile-only mode (nothing launches)."""
    return not (tracing() or compile_only_active())


def describe(*args: Any) -> Optional[bytes]:
    """The fast path's key of an eager call on ``args`` (tensors, None, bools,
    ints), or None where the fast path does not apply."""
    module = _c_module() if applies() else None
    return module.describe(_grad_enabled(), *args) if module is not None else None


def _declined(*args: Any) -> Any:
    return NotImplemented


class Closures:
    """One op's launch closures, by call description (each op has its own:
    two ops' calls on the same tensors describe alike).

    ``call(described, *args)``: the kept closure's result for a call whose
    first ``described`` arguments describe as an earlier call's did;
    NotImplemented where there is none, it declined, or compile-only mode is
    on (the caller then takes the full path).  After the first call it is
    ``_fastlaunch.Dispatcher``: the flags, the description, the lookup and
    the closure in one C call.  The op tests ``tracing()`` first."""

    def __init__(self) -> None:
        self._by_key: dict[bytes, Callable[..., Any]] = {}
        self.call = self._first_call
        _TABLES.append(self)

    def _first_call(self, described: int, *args: Any) -> Any:
        """Finds the C dispatcher (or, without it, declines every call from now on)."""
        module = _c_module()
        self.call = (module.Dispatcher(self._by_key, _COMPILE_ONLY_DEPTH.get, _grad_enabled)
                     if module is not None else _declined)
        return self.call(described, *args)

    def remember(self, described: tuple, make: Callable[[], Optional[Callable[..., Any]]]) -> None:
        """Keep ``make()``'s closure for calls whose described arguments
        describe as ``described`` does (nothing where they cannot be
        described, while calls are recorded, or when ``make`` returns None: no
        direct launcher).  The closure takes the arguments ``call`` is given."""
        key = describe(*described)
        if key is None or key in self._by_key or recording.RECORD_ENV in os.environ:
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


# A ``like_closure`` template's entries other than the call's argument indices.
NONE = -1


def output(j: int) -> int:
    """The template entry of output ``j``."""
    return -2 - j


def like_closure(launch, outputs: int, template: tuple[int, ...]):
    """The launch closure, in C (``_fastlaunch.LikeLaunch``), of a row-wise op
    whose ``outputs`` are each ``torch.empty_like`` its first argument: it
    calls ``launch`` with the call's argument i for each entry i >= 0 of
    ``template``, None for ``NONE`` and the outputs for ``output(j)``, and
    returns the output (the tuple where several).  None without ``launch``."""
    module = _c_module()
    if launch is None or module is None:
        return None
    return module.LikeLaunch(launch, torch.empty_like, outputs, template)


def like_launch(plan, role: str, device: torch.device, call: tuple[str, ...], returns: tuple[str, ...]):
    """``like_closure`` of ``plan``'s ``role`` kernel, derived from its launch
    (``quack/calls/launches.py``): the kernel's arguments named in ``call`` are
    the call's (in the order the op hands ``Closures.call``), those named in
    ``returns`` the outputs, each allocated like the call's first argument;
    every other argument is None (the stream: the launcher reads it)."""
    names = plan.kernel_of(role).launch.parameters
    template = tuple(
        call.index(name) if name in call else output(returns.index(name)) if name in returns else NONE
        for name in names
    )
    return like_closure(direct(plan, role, device, row_positions(plan, role)), len(returns), template)


def trailing_arguments(plan, role: str, leading: tuple[str, ...], **fixed: Any) -> tuple:
    """For a closure that passes the arguments ``leading`` of ``plan``'s
    ``role`` kernel first, in that order (TypeError where the kernel's launch
    orders them otherwise): the rest, ``fixed`` values by name, None for
    others (the stream: the launcher reads it).  Positional arguments keep
    the closure's call as cheap as the launch itself."""
    names = plan.kernel_of(role).launch.parameters
    if names[:len(leading)] != leading:
        raise TypeError(f"the {role} kernel's arguments begin {names[:len(leading)]}, not {leading}")
    return tuple(fixed.get(name) for name in names[len(leading):])


def row_positions(plan, role: str) -> frozenset[int]:
    """The positions of the arguments ``plan``'s ``role`` kernel takes as
    (M, N) rows (its launch's; none for a kernel without a launch)."""
    launch = plan.kernel_of(role).launch
    if launch is None:
        return frozenset()
    return frozenset(i for i, name in enumerate(launch.parameters) if name in launch.rows)


def direct(plan, role: str, device: torch.device, rows: Optional[frozenset[int]] = None,
           per_stream: frozenset[int] = frozenset()):
    """The direct C launcher of ``plan``'s ``role`` kernel on ``device``
    (``KernelHandle.direct``), or None.  ``rows``: the argument positions it
    views as (M, N) rows (None: those its launch names); ``per_stream``:
    those it takes as a dict of each stream's tensor."""
    if rows is None:
        rows = row_positions(plan, role)
    handle = plan.kernel(role)
    make = getattr(handle, "direct", None)
    return make(device.index, rows, per_stream) if make is not None else None


class PerStream:
    """A closure's per-stream launch arguments (scratch a kernel may not
    share with a launch on another stream): one dict per argument, from
    stream handle to tensor, which the C launcher reads itself by the
    current stream (``direct``'s ``per_stream``), so a repeated call costs
    no Python lookup.  The launcher declines a stream without an entry, and
    one a CUDA graph is capturing; the closure then calls ``add_current``
    and launches again."""

    def __init__(self, make: Callable[[], tuple], device: torch.device, count: int):
        self._make, self._device = make, device
        self.dicts = tuple({} for _ in range(count))

    def add_current(self) -> tuple:
        """What to launch with on the current stream: the dicts, now holding
        its tensors (``make()``'s), or, while a CUDA graph is captured, this
        launch's own tensors (a capture's are never kept)."""
        made = self._make()
        if ti.capturing(self._device):
            return made
        stream = ti.current_stream(self._device)
        for kept, tensor in zip(self.dicts, made):
            kept[stream] = tensor
        return self.dicts


def clear() -> None:
    """Forget every op's closures (``quack.cache.clear``, ``quack.calls.plan.clear``:
    they hold loaded kernels)."""
    for table in _TABLES:
        table.clear()


jit.on_clear(clear)
