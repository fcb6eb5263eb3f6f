"""``@cute_op``: a CuTe DSL kernel launch as a torch custom op.

Every kernel op in quack writes into output tensors that its caller allocated
(``mutates_args``) and returns nothing.  That keeps the fake implementation
trivial, which is what torch.compile and FakeTensorMode need: shapes are
decided by the allocating wrapper, never inside the op.

The fake implementation does one more thing: under compile-only mode
(``quack.compile_only.compile_only_mode``) it runs the op body itself.  The
body derives its call's plan (``quack/calls/plan.py``) from tensor metadata and asks
the kernel cache for the plan's object, which compiles and exports it; the
launch is a no-op there.  Outside compile-only mode the fake implementation
does nothing.

The public ops launch their plans directly in eager mode; the registered ops
are what torch.compile's graphs call (and what a direct call of an op's
allocating wrapper without a plan goes through).
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch

from quack.compile_only import is_compile_only


class CuteOp:
    """A registered custom op plus direct access to its Python body."""

    def __init__(self, body: Callable, op):
        self.body = body
        self.op = op
        self.__doc__ = body.__doc__

    def __call__(self, *args, **kwargs):
        """Run the op: directly in eager mode, through the dispatcher when
        torch.compile traces (so the graph records the registered op)."""
        if torch.compiler.is_compiling():
            return self.op(*args, **kwargs)
        return self.body(*args, **kwargs)


def cute_op(name: str, *, mutates_args: Iterable[str], schema: str | None = None):
    """Register ``fn`` as the torch custom op ``name`` (e.g. "quack::rmsnorm_fwd").

    ``fn`` must return None and only write into the arguments named in
    ``mutates_args``.
    """

    def wrap(fn: Callable) -> CuteOp:
        op = torch.library.custom_op(
            name, mutates_args=tuple(mutates_args), device_types="cuda", schema=schema
        )(fn)

        @op.register_fake
        def _fake(*args, **kwargs):
            if is_compile_only():
                fn(*args, **kwargs)

        return CuteOp(fn, op)

    return wrap
