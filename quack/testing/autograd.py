"""Gradients in tests that also run under ``--compile-only``.

With a CPU-only torch build, autograd aborts the process (a C++ error in
``AccumulateGrad``) as soon as a graph touches a fake CUDA leaf tensor.  Under
compile-only mode the quack ops therefore warm their backward kernels from the
forward call (when an input requires grad) and return outputs without a
graph, and tests take gradients through :func:`vjp`, which then runs the
function without autograd and returns placeholder gradients.  Values are not
compared under compile-only anyway.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from quack.compile_only import is_compile_only, requires_grad_for_warming, warming_gradients


def vjp(fn: Callable, inputs: Sequence[torch.Tensor], cotangents: Sequence[torch.Tensor] | Callable):
    """Return ``(outputs, grads)``: ``fn(*inputs)`` and the gradients of
    ``sum(out * cot)`` over the outputs with respect to ``inputs``.

    ``cotangents`` may be a callable that builds them from the outputs.
    """
    if is_compile_only():
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
