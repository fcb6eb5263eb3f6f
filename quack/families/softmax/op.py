"""Softmax as a cached, torch-callable op: ``quack.softmax(x)``.

    y = exp(x - max(x)) / sum(exp(x - max(x)))

over the last dimension of x (shape (..., N), N up to 262144, any number of
rows, float32/float16/bfloat16), with autograd (dx = y * (dy - sum(y * dy))).
The statistics are fp32; y is rounded to x's dtype once.

The kernels live in ``quack/families/softmax/kernels.py``; this file holds the cached
compile functions (their arguments are the object key), the ``@cute_op`` ops,
the allocating wrappers, the autograd Function, the public function and the
fp32 reference ``softmax_ref`` that tests import.

Test: ``pytest tests/test_softmax.py``; benchmark: ``python tools/bench/softmax.py``.
"""

from __future__ import annotations

from typing import ClassVar, Optional

import torch

from quack.calls import torch_interop as ti
from quack.cache import compile_options, jit_cache
from quack.calls import fastpath
from quack.compile_only import differentiable_outputs
from quack.calls.cute_op import cute_op
from quack.calls.eager import eager_plan
from quack.calls.launches import NEW, Launch, Output, in_order
from quack.calls.plan import Kernel, Plan, Signature, fake_rows_input, kernel_for, plan_for, signature
from quack.rowwise.config import MAX_N, backward_config, forward_config



# This op's eager fast path (quack/calls/fastpath.py).
_FAST = fastpath.Closures()

# The kernels' launches: the arguments (their __call__'s) that are (M, N)
# rows, those the backward realigns, and the outputs they allocate.
FORWARD = Launch("quack.families.softmax.kernels:SoftmaxForward", frozenset({"x", "out"}), outputs=(("out", Output("x")),))
BACKWARD = Launch(
    "quack.families.softmax.kernels:SoftmaxBackward", frozenset({"y", "dy", "dx"}), aligned=frozenset({"y", "dy"}),
    outputs=(("dx", Output("y")),),
)


@jit_cache("softmax")
def compile_softmax_fwd(dtype: str, n: int, vec: int):
    """Compile the forward kernel for one static specialisation (M is symbolic)."""
    import cutlass.cute as cute

    from quack.rowwise import device as rowwise
    from quack.families.softmax.kernels import SoftmaxForward

    dt = ti.cute_dtype(dtype)
    m = cute.sym_int()
    fakes = dict(
        x=rowwise.fake_rows(dt, m, n, vec), out=rowwise.fake_rows(dt, m, n, vec),
        stream=cute.runtime.make_fake_stream(),
    )
    return cute.compile(SoftmaxForward(forward_config(n, vec)), *in_order(SoftmaxForward, fakes), options=compile_options())


@jit_cache("softmax")
def compile_softmax_bwd(dtype: str, n: int, vec: int):
    """Compile the backward kernel (y, dy and dx share one dtype)."""
    import cutlass.cute as cute

    from quack.rowwise import device as rowwise
    from quack.families.softmax.kernels import SoftmaxBackward

    dt = ti.cute_dtype(dtype)
    m = cute.sym_int()
    rows = lambda: rowwise.fake_rows(dt, m, n, vec)  # noqa: E731
    fakes = dict(y=rows(), dy=rows(), dx=rows(), stream=cute.runtime.make_fake_stream())
    return cute.compile(
        SoftmaxBackward(backward_config(n, vec)), *in_order(SoftmaxBackward, fakes), options=compile_options()
    )


@signature
class SoftmaxCall(Signature):
    """What decides a ``quack.softmax`` call's kernels: the dtype, N, the
    forward's vector width and whether a backward will run."""

    OP: ClassVar[str] = "softmax"
    dtype: str
    n: int
    vec: int
    backward: bool

    def kernels(self):
        forward = Kernel(compile_softmax_fwd, (self.dtype, self.n, self.vec), FORWARD)
        if not self.backward:
            return (("forward", forward),)
        # The backward realigns its inputs (its launch's ``aligned``) and runs at full vector width.
        backward = Kernel(compile_softmax_bwd, (self.dtype, self.n, ti.full_width(self.n, self.dtype)), BACKWARD)
        return (("forward", forward), ("backward", backward))

    def rebuild(self) -> "SoftmaxCall":
        """The op's checks and signature of a call on one row of N (``plan.from_entry``):
        x ``vec`` elements into its storage below the full vector width (its
        alignment then gives that width)."""
        return call_signature(fake_rows_input(self, _validate), self.backward)


def call_signature(x, backward: bool) -> SoftmaxCall:
    """The signature of a call on x (the vector width from its alignment)."""
    n = ti.row_length(x)
    return SoftmaxCall(ti.dtype_name(x.dtype), n, ti.vector_width(n, x), backward)


# The registered ops, which torch.compile's graphs call: each takes its
# kernel from its own (real) tensors.
@cute_op("quack::softmax_fwd", mutates_args=("out",))
def _softmax_fwd(x: torch.Tensor, out: torch.Tensor) -> None:
    """Launch the forward kernel (its plan from the tensors themselves)."""
    plan_for(call_signature(x, False)).run("forward", x=x, out=out)


@cute_op("quack::softmax_bwd", mutates_args=("dx",))
def _softmax_bwd(y: torch.Tensor, dy: torch.Tensor, dx: torch.Tensor) -> None:
    """Launch the backward kernel (its object from the tensors themselves)."""
    dtype, n = ti.dtype_name(y.dtype), ti.row_length(y)
    # The call as the backward sees it (the forward's vector width does not change its object).
    kernel_for(SoftmaxCall(dtype, n, ti.full_width(n, dtype), True), "backward").run(y=y, dy=dy, dx=dx)


def _validate(x) -> None:
    ti.check_row_input("quack.softmax", "x", x, MAX_N)


def softmax_fwd(x: torch.Tensor, plan: Optional[Plan] = None) -> torch.Tensor:
    """Allocate y and run the forward.  ``plan``: the call's (eager); None
    goes through the registered op (torch.compile, direct use)."""
    values = FORWARD.allocate(dict(x=x, out=NEW))
    if x.numel() > 0:
        plan.run("forward", **values) if plan is not None else _softmax_fwd(**values)
    return values["out"]


def softmax_bwd(y: torch.Tensor, dy: torch.Tensor, plan: Optional[Plan] = None) -> torch.Tensor:
    """Allocate dx and run the backward (dy is made contiguous in y's dtype)."""
    values = BACKWARD.allocate(dict(y=y, dy=dy.to(y.dtype).contiguous(), dx=NEW))
    if y.numel() > 0:
        plan.run("backward", **values) if plan is not None else _softmax_bwd(**values)
    return values["dx"]


class _SoftmaxFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, plan):
        # Kernels take plain tensors (DLPack refuses ones that require grad).
        y = softmax_fwd(x.detach(), plan)
        ctx.plan = plan
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, dy):
        (y,) = ctx.saved_tensors
        return softmax_bwd(y.detach(), dy, ctx.plan), None


def softmax(x: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dimension.

    x: (..., N) contiguous CUDA tensor, float32/float16/bfloat16, N <= 262144.
    Returns y like x.  Differentiable.  Raises TypeError for a wrong dtype and
    ValueError for a wrong device, shape or layout, before any launch.
    """
    y = NotImplemented if fastpath.tracing() else _FAST.call(1, x)
    if y is not NotImplemented:
        return y
    _validate(x)
    plan, backward = eager_plan(lambda backward: call_signature(x, backward), x)
    if backward:
        return _SoftmaxFunction.apply(x, plan)
    with torch.no_grad():
        y = softmax_fwd(x, plan)
    stores_for_backward = plan is not None and plan.signature.backward
    if x.numel() > 0 and not stores_for_backward:
        _FAST.remember((x,), lambda: _inference_closure(plan, x.device))
    return differentiable_outputs(y, stores_for_backward)


def _inference_closure(plan: Plan, device: torch.device):
    """The eager fast path's launch for calls like this one (``quack/calls/fastpath.py``)."""
    return fastpath.like_launch(plan, "forward", device, ("x",), ("out",))


def softmax_ref(x: torch.Tensor) -> torch.Tensor:
    """fp32 reference, rounded to x's dtype."""
    return torch.softmax(x.float(), dim=-1).to(x.dtype)
