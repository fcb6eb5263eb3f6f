"""Gradients in tests that also run under ``--compile-only``.

On a CUDA build of torch, compile-only mode runs autograd (its backward
walked in Python, ``quack.compile_only_autograd``) and :func:`vjp` is plain
``torch.autograd.grad``.  With a CPU-only build, autograd aborts the process
(a C++ error in ``AccumulateGrad``) as soon as a graph touches a fake CUDA
leaf tensor: there the quack ops warm their backward kernels from the forward
call and return outputs without a graph, and :func:`vjp` runs the function
without autograd and returns placeholder gradients.  Values are not compared
under compile-only anyway.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from quack.compile_only import autograd_available, requires_grad_for_warming, warming_gradients


def vjp(fn: Callable, inputs: Sequence[torch.Tensor], cotangents: Sequence[torch.Tensor] | Callable):
    """Return ``(outputs, grads)``: ``fn(*inputs)`` and the gradients of
    ``sum(out * cot)`` over the outputs with respect to ``inputs``.

    ``cotangents`` may be a callable that builds them from the outputs.
    """
    if not autograd_available():
        # No graph is built (that is what would abort), but the ops warm the
        # backward kernels a real gradient would run.
        inputs = [requires_grad_for_warming(t) for t in inputs]
        with warming_gradients():
            outputs = _as_tuple(fn(*inputs))
        return outputs, tuple(torch.zeros_like(t) for t in inputs)
    inputs = [t.detach().requires_grad_() for t in inputs]
    outputs = _as_tuple(fn(*inputs))
    cots = _as_tuple(cotangents(outputs) if callable(cotangents) else cotangents)
    grads = torch.autograd.grad(outputs, inputs, cots, allow_unused=True)
    return tuple(o.detach() for o in outputs), grads


def _as_tuple(value) -> tuple:
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)
