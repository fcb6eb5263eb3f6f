"""Compile-only mode: run kernel calls on fake tensors so each kernel is compiled and
exported to the persistent cache while nothing launches and no GPU memory is used.

Inside :func:`compile_only_mode`, every tensor is a ``FakeTensor``; a ``@cute_op``
op's fake implementation derives the key and calls its ``jit_cache`` compile
function, which exports the object and hands back a no-op launch. ``.item()``,
``.tolist()``, ``int(t)`` and ``float(t)`` return the sentinels ``1`` / ``1.0`` so
test setup that reads tensor values (``total_m = seq_lens.sum().item()``) still
reaches the kernel; the keys never depend on those values because batch
dimensions are symbolic.

Scope: the depth counter is a ``ContextVar`` (``quack.cache._COMPILE_ONLY_DEPTH``),
so it is per thread and per asyncio task, but torch's ``FakeTensorMode`` sits on a
per-*thread* mode stack. While compile-only mode is active in one task, do not run
real GPU work in another asyncio task of the same thread: its tensors would be
fake although ``is_compile_only()`` is false there.

Driver-script use::

    with compile_only_mode():
        for shape in shapes:
            my_kernel(*make_inputs(shape))  # exported, not launched
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Iterator

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from quack.cache import _COMPILE_ONLY_DEPTH

__all__ = [
    "CompileOnlyFakeTensorMode", "compile_only_mode", "grad_enabled", "is_compile_only",
    "warming_gradients",
]

# Set by ``warming_gradients``: the caller will take gradients of what it computes.
_WARMING_GRADIENTS = contextvars.ContextVar("quack_warming_gradients", default=False)

# Small on purpose: test code that really depends on the value should fail
# loudly under compile-only rather than pass with a conveniently aligned number.
_INT_SENTINEL = 1
_FLOAT_SENTINEL = 1.0


class _ScalarSentinelMode(TorchDispatchMode):
    """Answer ``aten._local_scalar_dense`` (the op behind ``.item()``) with a sentinel.

    A separate dispatch mode rather than a ``FakeTensorMode`` subclass: it uses the
    public ``__torch_dispatch__`` protocol and composes with any ``FakeTensorMode``
    configuration. Every other op goes on down the stack to fake dispatch.
    """

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            return _FLOAT_SENTINEL if args[0].dtype.is_floating_point else _INT_SENTINEL
        return func(*args, **(kwargs or {}))


class CompileOnlyFakeTensorMode:
    """A stock ``FakeTensorMode`` (built from ``**fake_kwargs``) plus scalar sentinels."""

    def __init__(self, **fake_kwargs: Any) -> None:
        self.fake_mode = FakeTensorMode(**fake_kwargs)
        self._sentinels = _ScalarSentinelMode()

    def __enter__(self) -> "CompileOnlyFakeTensorMode":
        self.fake_mode.__enter__()
        try:
            self._sentinels.__enter__()
        except BaseException:
            self.fake_mode.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, exc_type, exc_val, exc_tb) -> None:
        # LIFO: the sentinel mode was pushed last.
        try:
            self._sentinels.__exit__(exc_type, exc_val, exc_tb)
        finally:
            self.fake_mode.__exit__(exc_type, exc_val, exc_tb)


@contextlib.contextmanager
def compile_only_mode() -> Iterator[CompileOnlyFakeTensorMode]:
    """Enter compile-only mode; yields the active :class:`CompileOnlyFakeTensorMode`.

    The depth is pushed with a token and reset to exactly its prior value on exit,
    also when the block raises, so nested regions never leak ``False`` (or
    ``True``) to the enclosing scope.
    """
    token = _COMPILE_ONLY_DEPTH.set(_COMPILE_ONLY_DEPTH.get() + 1)
    try:
        with CompileOnlyFakeTensorMode() as mode:
            yield mode
    finally:
        _COMPILE_ONLY_DEPTH.reset(token)


def is_compile_only() -> bool:
    """Whether compile-only mode is active here (live; safe at any call site).

    Prefer it to ``from quack.cache import COMPILE_ONLY``, which copies the value
    once at import time.  False while torch.compile traces: the ops then go
    through the registered custom ops, and Dynamo cannot trace ``ContextVar.get``.
    """
    return not torch.compiler.is_compiling() and _COMPILE_ONLY_DEPTH.get() > 0


@contextlib.contextmanager
def warming_gradients() -> Iterator[None]:
    """Compile-only mode: the calls inside will be differentiated.

    With a CPU-only torch, autograd aborts on fake CUDA leaf tensors, so a
    compile-only gradient (``quack.testing.autograd.vjp``) runs its function
    under ``torch.no_grad()`` inside this context: ops then warm the kernels
    a real backward would run (``grad_enabled``), and build no graph."""
    token = _WARMING_GRADIENTS.set(True)
    try:
        yield
    finally:
        _WARMING_GRADIENTS.reset(token)


def grad_enabled() -> bool:
    """Whether autograd will differentiate calls made here: torch's grad mode,
    or, in compile-only mode, ``warming_gradients``.  Every op decides from
    this (``torch_interop.will_backward``) both which kernels an eager call runs
    and which ones compile-only warms, so the two never disagree."""
    if torch.is_grad_enabled():
        return True
    return is_compile_only() and _WARMING_GRADIENTS.get()
