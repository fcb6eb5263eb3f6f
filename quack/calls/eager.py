"""The step every op's eager call takes between its checks and its launch.

An op checks its inputs, then asks ``eager_plan`` for its plan and whether a
backward will run: the one place that decides it (some input requires grad
under grad mode, and in compile-only mode only where autograd can run), so
the plan's signature, the autograd path and compile-only warming agree.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from quack.calls import torch_interop as ti
from quack.calls.plan import Plan, Signature, plan_for
from quack.compile_only import autograd_available, is_compile_only


def eager_plan(signature_of: Callable[[bool], Signature], *inputs: Optional[torch.Tensor]) -> tuple[Optional[Plan], bool]:
    """(plan, backward) of an eager call on ``inputs``: ``signature_of(backward)``
    is the call's signature.  While torch.compile traces there are no
    addresses, so no plan (None): the registered ops take theirs from the
    real tensors when the graph runs.  In compile-only mode every kernel of
    the plan is exported now (launches are no-ops), the backward's too, and a
    graph is built only where autograd can run."""
    backward = ti.will_backward(*inputs)
    plan = None if torch.compiler.is_compiling() else plan_for(signature_of(backward))
    if is_compile_only():
        plan.warm()
        backward = backward and autograd_available()
    return plan, backward
