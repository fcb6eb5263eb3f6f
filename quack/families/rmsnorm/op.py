"""RMSNorm as a cached, torch-callable op: ``quack.rmsnorm(x, weight, eps, residual)``.

    y = (x + residual) * rsqrt(mean((x + residual)^2) + eps) * weight

over the last dimension of x (shape (..., N), N up to 262144, any number of
rows).  With a residual it returns ``(y, x + residual)``, the pre-norm
pattern.  Autograd gives gradients for x, weight and residual.

The kernels live in ``quack/families/rmsnorm/kernels.py``; this file holds the cached
compile functions (their arguments are the object key), the ``@cute_op`` ops,
the allocating wrappers, the autograd Function, the public function and the
fp32 reference ``rmsnorm_ref`` that tests import.

Test: ``pytest tests/test_rmsnorm.py``; benchmark: ``python tools/bench/rmsnorm.py``.
"""

from __future__ import annotations

import math
from typing import ClassVar, Optional

import torch

from quack.calls import torch_interop as ti
from quack.cache import compile_options, jit_cache
from quack.calls import fastpath
from quack.compile_only import differentiable_outputs
from quack.calls.cute_op import cute_op
from quack.calls.eager import eager_plan
from quack.calls.launches import NEW, PER_ROW, Launch, Output, in_order
from quack.rowwise.norm_backward_grid import NORM_BACKWARD, run_norm_backward
from quack.calls.plan import (Kernel, Plan, Signature, blame, fake_rows_input, fake_tensor, kernel_for, plan_for,
                              signature)
from quack.rowwise.config import MAX_N, backward_config, check_eps, forward_config



# This op's eager fast path (quack/calls/fastpath.py).
_FAST = fastpath.Closures()

# The forward kernel's launch: the arguments (its __call__'s) that are (M, N)
# rows, and the outputs it allocates.
FORWARD = Launch(
    "quack.families.rmsnorm.kernels:RMSNormForward", frozenset({"x", "residual", "out", "residual_out"}),
    outputs=(("out", Output("x")), ("residual_out", Output("x")), ("rstd", Output("x", PER_ROW, "float32"))),
)


@jit_cache("rmsnorm")
def compile_rmsnorm_fwd(
    dtype: str, weight_dtype: Optional[str], has_residual: bool, n: int, vec: int, store_rstd: bool = True
):
    """Compile the forward kernel for one static specialisation (M is symbolic).
    ``store_rstd``: write 1/rms per row for a backward pass (not needed for inference)."""
    import cutlass.cute as cute
    from cutlass import Float32

    from quack.rowwise import device as rowwise
    from quack.families.rmsnorm.kernels import RMSNormForward

    dt = ti.cute_dtype(dtype)
    m = cute.sym_int()
    rows = lambda: rowwise.fake_rows(dt, m, n, vec)  # noqa: E731
    fakes = dict(x=rows(), out=rows(), eps=Float32(0.0), stream=cute.runtime.make_fake_stream())
    if weight_dtype:
        fakes["weight"] = rowwise.fake_vector(ti.cute_dtype(weight_dtype), n, vec)
    if has_residual:
        fakes.update(residual=rows(), residual_out=rows())
    if store_rstd:
        fakes["rstd"] = rowwise.fake_vector(Float32, m)
    return cute.compile(
        RMSNormForward(forward_config(n, vec)), *in_order(RMSNormForward, fakes), options=compile_options()
    )


@jit_cache("rmsnorm")
def compile_rmsnorm_bwd(dtype: str, weight_dtype: Optional[str], has_dh_out: bool, n: int, vec: int):
    """Compile the backward kernel (dw partials are written whenever a weight is given)."""
    import cutlass.cute as cute
    from cutlass import Float32, Int32

    from quack.rowwise import device as rowwise
    from quack.rowwise.norm_backward import NormBackward

    dt = ti.cute_dtype(dtype)
    m = cute.sym_int()
    rows = lambda: rowwise.fake_rows(dt, m, n, vec)  # noqa: E731
    fakes = dict(
        x=rows(), dy=rows(), rstd=rowwise.fake_vector(Float32, m), dx=rows(), eps=Float32(0.0), num_ctas=Int32(1),
        stream=cute.runtime.make_fake_stream(),
    )
    if weight_dtype:
        fakes["weight"] = rowwise.fake_vector(ti.cute_dtype(weight_dtype), n, vec)
        fakes["dw_partial"] = rowwise.fake_rows(Float32, cute.sym_int(), n, vec)
    if has_dh_out:
        fakes["dh_out"] = rows()
    return cute.compile(
        NormBackward(backward_config(n, vec), centred=False), *in_order(NormBackward, fakes),
        options=compile_options(),
    )


@signature
class RMSNormCall(Signature):
    """What decides a ``quack.rmsnorm`` call's kernels: x's dtype, the
    weight's (None without one), a residual, N, the forward's vector width
    and whether a backward will run (the forward then stores 1/rms)."""

    OP: ClassVar[str] = "rmsnorm"
    dtype: str
    weight_dtype: Optional[str]
    residual: bool
    n: int
    vec: int
    backward: bool

    def kernels(self):
        forward = Kernel(
            compile_rmsnorm_fwd, (self.dtype, self.weight_dtype, self.residual, self.n, self.vec, self.backward),
            FORWARD,
        )
        if not self.backward:
            return (("forward", forward),)
        # The backward realigns its inputs (its launch's ``aligned``) and runs at full vector width.
        full = ti.full_width(self.n, self.dtype)
        backward = Kernel(compile_rmsnorm_bwd, (self.dtype, self.weight_dtype, self.residual, self.n, full), NORM_BACKWARD)
        return (("forward", forward), ("backward", backward))

    def rebuild(self) -> "RMSNormCall":
        """The op's checks and signature of a call on one row of N (``plan.from_entry``):
        x ``vec`` elements into its storage below the full vector width (its
        alignment then gives that width), the other tensors aligned."""
        x = fake_rows_input(self, lambda x: _validate(x, None, None))
        weight = fake_tensor(self, "weight_dtype", (self.n,))
        residual = fake_tensor(self, "dtype", (1, self.n)) if self.residual else None
        with blame(self, "weight_dtype"):
            _validate(x, weight, residual)
        return call_signature(x, weight, residual, self.backward)


def call_signature(x, weight, residual, backward: bool) -> RMSNormCall:
    """The signature of a call on these tensors (the vector width from their alignment)."""
    n = ti.row_length(x)
    vec = ti.vector_width(n, x, weight, residual)
    return RMSNormCall(ti.dtype_name(x.dtype), _name(weight), residual is not None, n, vec, backward)


def _name(t: Optional[torch.Tensor]) -> Optional[str]:
    return ti.dtype_name(t.dtype) if t is not None else None


# The registered ops, which torch.compile's graphs call: each derives its
# plan from its own (real) tensors.
@cute_op("quack::rmsnorm_fwd", mutates_args=("out", "residual_out", "rstd"))
def _rmsnorm_fwd(
    x: torch.Tensor,
    weight: Optional[torch.Tensor],
    residual: Optional[torch.Tensor],
    out: torch.Tensor,
    residual_out: Optional[torch.Tensor],
    rstd: Optional[torch.Tensor],
    eps: float,
) -> None:
    """Launch the forward kernel (its plan from the tensors themselves)."""
    plan_for(call_signature(x, weight, residual, rstd is not None)).run(
        "forward", x=x, weight=weight, residual=residual, out=out, residual_out=residual_out, rstd=rstd, eps=eps
    )


@cute_op("quack::rmsnorm_bwd", mutates_args=("dx", "dw"))
def _rmsnorm_bwd(
    x: torch.Tensor,
    weight: Optional[torch.Tensor],
    dy: torch.Tensor,
    dh_out: Optional[torch.Tensor],
    rstd: torch.Tensor,
    dx: torch.Tensor,
    dw: Optional[torch.Tensor],
    eps: float,
) -> None:
    """Launch the backward kernel (its object from the tensors themselves)."""
    dtype, n = ti.dtype_name(x.dtype), ti.row_length(x)
    # The call as the backward sees it (the forward's vector width does not change its object).
    kernel = kernel_for(RMSNormCall(dtype, _name(weight), dh_out is not None, n, ti.full_width(n, dtype), True), "backward")
    run_norm_backward(kernel, dw, None, x=x, weight=weight, dy=dy, dh_out=dh_out, rstd=rstd, dx=dx, eps=eps)


def _validate(x, weight, residual) -> None:
    ti.check_row_input("quack.rmsnorm", "x", x, MAX_N)
    ti.check_param("weight", weight, x)
    if residual is not None:
        ti.check_float("residual", residual, (x.dtype,))
        ti.check_cuda("residual", residual, x)
        ti.check_contiguous("residual", residual)
        if residual.shape != x.shape:
            raise ValueError(
                f"residual shape {tuple(residual.shape)} differs from x shape {tuple(x.shape)}"
            )


def rmsnorm_fwd(x, weight=None, residual=None, eps=1e-6, store_rstd=True, plan: Optional[Plan] = None):
    """Allocate outputs and run the forward: returns (y, x + residual or None,
    rstd or None).  ``plan``: the call's (eager); None goes through the
    registered op (torch.compile, or direct use)."""
    values = FORWARD.allocate(dict(
        x=x, weight=weight, residual=residual, out=NEW, residual_out=NEW if residual is not None else None,
        rstd=NEW if store_rstd else None, eps=eps,
    ))
    if x.numel() > 0:
        plan.run("forward", **values) if plan is not None else _rmsnorm_fwd(**values)
    return values["out"], values["residual_out"], values["rstd"]


def rmsnorm_bwd(h, weight, dy, rstd, dh_out=None, *, eps: float, plan: Optional[Plan] = None):
    """Allocate gradients and run the backward: returns (dh, dweight or None).
    ``eps``: the forward's, required (dx at N = 1 is eps * rstd^3)."""
    dy = dy.contiguous()
    dh_out = dh_out.contiguous() if dh_out is not None else None
    dw = torch.empty_like(weight) if weight is not None else None
    values = NORM_BACKWARD.allocate(dict(x=h, weight=weight, dy=dy, dh_out=dh_out, rstd=rstd, dx=NEW, eps=eps))
    if plan is not None:
        run_norm_backward(plan.kernel_of("backward"), dw, None, **values)
    else:
        _rmsnorm_bwd(**values, dw=dw)
    return values["dx"], dw


class _RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, residual, eps, plan):
        # Kernels take plain tensors (DLPack refuses ones that require grad).
        x, weight, residual = (t.detach() if t is not None else None for t in (x, weight, residual))
        y, h, rstd = rmsnorm_fwd(x, weight, residual, eps, plan=plan)
        ctx.has_residual = residual is not None
        ctx.plan = plan
        ctx.eps = eps
        ctx.save_for_backward(h if h is not None else x, weight, rstd)
        if h is not None:
            return y, h
        return y

    @staticmethod
    def backward(ctx, dy, dh_out=None):
        # A saved output (x + residual) comes back requiring grad; kernels take plain tensors.
        h, weight, rstd = (t.detach() if t is not None else None for t in ctx.saved_tensors)
        dh, dw = rmsnorm_bwd(h, weight, dy, rstd, dh_out if ctx.has_residual else None, eps=ctx.eps, plan=ctx.plan)
        if weight is None or not ctx.needs_input_grad[1]:
            dw = None
        return dh, dw, dh if ctx.has_residual else None, None, None


def rmsnorm(x, weight=None, eps: Optional[float] = 1e-6, residual=None):
    """RMSNorm over the last dimension; ``(y, x + residual)`` when a residual is given.

    x: (..., N) contiguous CUDA tensor, float32/float16/bfloat16.  weight: (N,),
    float32 or x's dtype.  residual: like x.  eps: a finite real number >= 0,
    or None for ``torch.nn.functional.rms_norm``'s default, the machine
    epsilon of x's dtype.  Raises TypeError for a wrong dtype or eps type and
    ValueError for a wrong device, shape, layout or eps value.
    """
    if eps.__class__ is not float or not 0.0 <= eps < math.inf:  # (the usual float, cheaply)
        eps = _eps(eps, x)
    result = NotImplemented if fastpath.tracing() else _FAST.call(3, x, weight, residual, eps)
    if result is not NotImplemented:
        return result
    _validate(x, weight, residual)
    plan, backward = eager_plan(lambda backward: call_signature(x, weight, residual, backward), x, weight, residual)
    if backward:
        return _RMSNormFunction.apply(x, weight, residual, eps, plan)
    store_rstd = plan is not None and plan.signature.backward
    with torch.no_grad():
        y, h, _ = rmsnorm_fwd(x, weight, residual, eps, store_rstd=store_rstd, plan=plan)
    if x.numel() > 0 and not store_rstd:
        _FAST.remember((x, weight, residual), lambda: _inference_closure(plan, x.device, residual is not None))
    return differentiable_outputs((y, h) if residual is not None else y, store_rstd)


def _eps(eps, x) -> float:
    """eps as the kernels take it (``row_config.check_eps``); None is the
    machine epsilon of x's dtype, as in ``torch.nn.functional.rms_norm``."""
    if eps is None and isinstance(x, torch.Tensor) and x.dtype.is_floating_point:
        return torch.finfo(x.dtype).eps
    return check_eps(eps)


def _inference_closure(plan: Plan, device: torch.device, has_residual: bool):
    """The eager fast path's launch for calls like this one (``quack/calls/fastpath.py``)."""
    returns = ("out", "residual_out") if has_residual else ("out",)
    return fastpath.like_launch(plan, "forward", device, ("x", "weight", "residual", "eps"), returns)


def rmsnorm_ref(x, weight=None, eps: Optional[float] = 1e-6, residual=None):
    """fp32 reference with the same signature and return convention."""
    eps = _eps(eps, x)
    h = x.float() + residual.float() if residual is not None else x.float()
    y = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.float()
    y = y.to(x.dtype)
    return (y, h.to(x.dtype)) if residual is not None else y
