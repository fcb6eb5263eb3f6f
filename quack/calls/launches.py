"""How a plan's kernel is called: its arguments by name, in the order its class declares.

A kernel's argument order is written once, in its class's ``__call__``.
``parameters`` reads it from the class's source file with ``ast``: a
process that only loads cached objects never imports the CuTe DSL, yet its
eager calls, registered ops and fast path all need the order.  A ``Launch``
names that class and which of its arguments are (..., N) tensors the kernel
takes as (M, N) rows; the call supplies every argument by name (an absent
one is None).  ``Kernel.run`` (``quack/calls/plan.py``) launches through it, the C fast
path derives its argument template from it (``fastpath.like_launch``), and
the compile functions order their fake arguments with ``in_order``.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib.util
import pathlib
from typing import Any, Optional, Union

# The one argument a call never supplies: torch's current stream, read at launch.
STREAM = "stream"
# A call's value for an output the launch is to allocate (``Launch.allocate``).
NEW = object()
# An ``Output`` shape: one value per row of the tensor it is made beside.
PER_ROW = "per_row"


@dataclasses.dataclass(frozen=True)
class Output:
    """An argument a launch allocates: beside the call's value ``like`` (its
    device), of its shape (``shape`` None), one value per row of it
    (``PER_ROW``) or a fixed shape, and of its dtype (``dtype`` None) or
    the torch dtype named."""

    like: str
    shape: Union[None, str, tuple[int, ...]] = None
    dtype: Optional[str] = None

    def allocate(self, values: dict[str, Any]):
        import torch

        ref = values[self.like]
        if self.shape is None and self.dtype is None:
            return torch.empty_like(ref)
        dtype = ref.dtype if self.dtype is None else getattr(torch, self.dtype)
        if self.shape == PER_ROW:
            # Shaped by a view, not by reading ``ref.shape``: under torch.compile
            # a size read in Python becomes a graph value, and one the trace
            # specialised to a constant breaks torch 2.11's autograd.Function
            # capture (the C fast path never comes here).
            return torch.empty_like(ref.select(-1, 0), dtype=dtype, memory_format=torch.contiguous_format).view(-1)
        shape = ref.shape if self.shape is None else self.shape
        return torch.empty(shape, device=ref.device, dtype=dtype)


@functools.lru_cache(maxsize=None)
def parameters(kernel_class: str) -> tuple[str, ...]:
    """The ``__call__`` parameters (``self`` left out) of the class named
    ``"module:Class"``, read from the module's source without importing it."""
    module, _, name = kernel_class.partition(":")
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.origin:
        raise LookupError(f"no source file for kernel module {module!r}")
    tree = ast.parse(pathlib.Path(spec.origin).read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == "__call__":
                    return tuple(a.arg for a in item.args.args[1:])
            raise LookupError(f"kernel class {kernel_class} has no __call__")
    raise LookupError(f"module {module} defines no class {name!r}")


@functools.lru_cache(maxsize=None)
def _names(kernel_class: str) -> frozenset[str]:
    return frozenset(parameters(kernel_class))


def _check_names(kernel_class: str, values: dict[str, Any]) -> None:
    """TypeError for a value no parameter of ``kernel_class`` takes."""
    if not values.keys() <= _names(kernel_class):
        raise TypeError(f"{kernel_class} takes no argument {sorted(values.keys() - _names(kernel_class))}")


def in_order(kernel_class: type, values: dict[str, Any]) -> list[Any]:
    """``values`` (by parameter name; absent ones None) in the order of
    ``kernel_class.__call__``: what a compile function hands ``cute.compile``."""
    name = f"{kernel_class.__module__}:{kernel_class.__qualname__}"
    _check_names(name, values)
    return [values.get(parameter) for parameter in parameters(name)]


@dataclasses.dataclass(frozen=True)
class Launch:
    """How a call launches one kernel: the class whose ``__call__`` orders
    its arguments (``"module:Class"``), the arguments viewed as (M, N) rows
    (the first of them gives M and N: no launch for zero rows; a kernel
    without rows takes its tensors as they come), those copied to a 16-byte
    aligned base where they are not (``aligned``: a backward's object runs
    at full vector width, whatever views autograd hands it), and the
    outputs it allocates where a call asks (``allocate``)."""

    kernel_class: str
    rows: frozenset[str]
    aligned: frozenset[str] = frozenset()
    outputs: tuple[tuple[str, Output], ...] = ()

    def allocate(self, values: dict[str, Any]) -> dict[str, Any]:
        """``values`` with each output given as ``NEW`` allocated (``Output``);
        the call's tensors and shapes decide them, not the plan, so a call
        traced by torch.compile allocates as an eager one does."""
        for name, output in self.outputs:
            if values.get(name) is NEW:
                values[name] = output.allocate(values)
        return values

    @property
    def parameters(self) -> tuple[str, ...]:
        return parameters(self.kernel_class)

    def arguments(self, values: dict[str, Any]) -> tuple[list[Any], bool]:
        """The kernel's arguments for a call's ``values`` (by name): realigned,
        rows viewed as (M, N), torch's current stream (on the first
        tensor's device) as ``stream``; and whether there are zero rows."""
        from quack.calls import torch_interop as ti

        names = self.parameters
        _check_names(self.kernel_class, values)
        device = next((v.device for v in map(values.get, names) if hasattr(v, "device")), None)
        if device is None:
            raise TypeError(f"{self.kernel_class} is given no tensor")
        first = next((values[name] for name in names if name in self.rows), None)
        n = first.shape[-1] if first is not None else 0
        args = []
        for name in names:
            value = values.get(name)
            if name in self.aligned:
                value = ti.aligned(value)
            if name == STREAM:
                value = ti.current_stream(device)
            elif name in self.rows and value is not None:
                value = ti.as_rows(value, n)
            args.append(value)
        return args, first is not None and first.numel() == 0
