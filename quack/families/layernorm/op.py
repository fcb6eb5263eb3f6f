"""LayerNorm as a cached, torch-callable op: ``quack.layernorm(x, weight, bias=None, eps=1e-5)``.

    y = (x - mean(x)) * rsqrt(var(x) + eps) * weight + bias

over the last dimension of x (shape (..., N), N up to 262144, any number of
rows, float32/float16/bfloat16; the biased variance, as
``torch.nn.functional.layer_norm``).  weight and bias: (N,), float32 or x's
dtype, each optional.  Autograd gives gradients for x, weight and bias.

The kernels live in ``quack/families/layernorm/kernels.py``; this file holds the cached
compile functions (their arguments are the object key), the ``@cute_op`` ops,
the allocating wrappers, the autograd Function, the public function and the
fp32 reference ``layernorm_ref`` that tests import.

Test: ``pytest tests/test_layernorm.py``; benchmark: ``python tools/bench/layernorm.py``.
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



def _fake_param(dtype: Optional[str], n: int, vec: int):
    from quack.rowwise import device as rowwise

    return rowwise.fake_vector(ti.cute_dtype(dtype), n, vec) if dtype else None


# This op's eager fast path (quack/calls/fastpath.py).
_FAST = fastpath.Closures()

# The forward kernel's launch: the arguments (its __call__'s) that are (M, N)
# rows, and the outputs it allocates.
STATISTIC = Output("x", PER_ROW, "float32")
FORWARD = Launch(
    "quack.families.layernorm.kernels:LayerNormForward", frozenset({"x", "out"}),
    outputs=(("out", Output("x")), ("mean", STATISTIC), ("rstd", STATISTIC)),
)


@jit_cache("layernorm")
def compile_layernorm_fwd(
    dtype: str, weight_dtype: Optional[str], bias_dtype: Optional[str], n: int, vec: int,
    store_stats: bool = True,
):
    """Compile the forward kernel for one static specialisation (M is symbolic).
    ``store_stats``: write mean and rstd per row for a backward pass."""
    import cutlass.cute as cute
    from cutlass import Float32

    from quack.rowwise import device as rowwise
    from quack.families.layernorm.kernels import LayerNormForward

    dt = ti.cute_dtype(dtype)
    m = cute.sym_int()
    fakes = dict(
        x=rowwise.fake_rows(dt, m, n, vec), weight=_fake_param(weight_dtype, n, vec),
        bias=_fake_param(bias_dtype, n, vec), out=rowwise.fake_rows(dt, m, n, vec), eps=Float32(0.0),
        stream=cute.runtime.make_fake_stream(),
    )
    if store_stats:
        fakes.update(mean=rowwise.fake_vector(Float32, m), rstd=rowwise.fake_vector(Float32, m))
    return cute.compile(
        LayerNormForward(forward_config(n, vec)), *in_order(LayerNormForward, fakes), options=compile_options()
    )


@jit_cache("layernorm")
def compile_layernorm_bwd(
    dtype: str, weight_dtype: Optional[str], has_bias: bool, n: int, vec: int
):
    """Compile the backward kernel (dw partials whenever a weight is given, db
    partials whenever a bias is)."""
    import cutlass.cute as cute
    from cutlass import Float32, Int32

    from quack.rowwise import device as rowwise
    from quack.rowwise.norm_backward import NormBackward

    dt = ti.cute_dtype(dtype)
    m = cute.sym_int()
    rows = lambda: rowwise.fake_rows(dt, m, n, vec)  # noqa: E731
    # The dw and db partial buffers share their (symbolic) row count.
    p = cute.sym_int()
    fakes = dict(
        x=rows(), weight=_fake_param(weight_dtype, n, vec), dy=rows(), mean=rowwise.fake_vector(Float32, m),
        rstd=rowwise.fake_vector(Float32, m), dx=rows(), eps=Float32(0.0), num_ctas=Int32(1),
        stream=cute.runtime.make_fake_stream(),
    )
    if weight_dtype:
        fakes["dw_partial"] = rowwise.fake_rows(Float32, p, n, vec)
    if has_bias:
        fakes["db_partial"] = rowwise.fake_rows(Float32, p, n, vec)
    return cute.compile(
        NormBackward(backward_config(n, vec), centred=True), *in_order(NormBackward, fakes),
        options=compile_options(),
    )


@signature
class LayerNormCall(Signature):
    """What decides a ``quack.layernorm`` call's kernels: x's dtype, the
    weight's and the bias's (None without one), N, the forward's vector width
    and whether a backward will run (the forward then stores the statistics)."""

    OP: ClassVar[str] = "layernorm"
    dtype: str
    weight_dtype: Optional[str]
    bias_dtype: Optional[str]
    n: int
    vec: int
    backward: bool

    def kernels(self):
        forward = Kernel(
            compile_layernorm_fwd, (self.dtype, self.weight_dtype, self.bias_dtype, self.n, self.vec, self.backward),
            FORWARD,
        )
        if not self.backward:
            return (("forward", forward),)
        # The backward realigns its inputs (its launch's ``aligned``) and runs at full vector width;
        # it sums db whenever there is a bias (the op drops it unless asked).
        args = (self.dtype, self.weight_dtype, self.bias_dtype is not None, self.n, ti.full_width(self.n, self.dtype))
        backward = Kernel(compile_layernorm_bwd, args, NORM_BACKWARD)
        return (("forward", forward), ("backward", backward))

    def rebuild(self) -> "LayerNormCall":
        """The op's checks and signature of a call on one row of N (``plan.from_entry``):
        x ``vec`` elements into its storage below the full vector width (its
        alignment then gives that width), the parameters aligned."""
        x = fake_rows_input(self, lambda x: _validate(x, None, None))
        weight = fake_tensor(self, "weight_dtype", (self.n,))
        with blame(self, "weight_dtype"):
            _validate(x, weight, None)
        bias = fake_tensor(self, "bias_dtype", (self.n,))
        with blame(self, "bias_dtype"):
            _validate(x, weight, bias)
        return call_signature(x, weight, bias, self.backward)


def call_signature(x, weight, bias, backward: bool) -> LayerNormCall:
    """The signature of a call on these tensors (the vector width from their alignment)."""
    n = ti.row_length(x)
    return LayerNormCall(
        ti.dtype_name(x.dtype), _name(weight), _name(bias), n, ti.vector_width(n, x, weight, bias), backward
    )


def _name(t: Optional[torch.Tensor]) -> Optional[str]:
    return ti.dtype_name(t.dtype) if t is not None else None


# The registered ops, which torch.compile's graphs call: each takes its
# kernel from its own (real) tensors.
@cute_op("quack::layernorm_fwd", mutates_args=("out", "mean", "rstd"))
def _layernorm_fwd(
    x: torch.Tensor,
    weight: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    out: torch.Tensor,
    mean: Optional[torch.Tensor],
    rstd: Optional[torch.Tensor],
    eps: float,
) -> None:
    """Launch the forward kernel (its plan from the tensors themselves)."""
    plan_for(call_signature(x, weight, bias, rstd is not None)).run(
        "forward", x=x, weight=weight, bias=bias, out=out, mean=mean, rstd=rstd, eps=eps
    )


@cute_op("quack::layernorm_bwd", mutates_args=("dx", "dw", "db"))
def _layernorm_bwd(
    x: torch.Tensor,
    weight: Optional[torch.Tensor],
    dy: torch.Tensor,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    dx: torch.Tensor,
    dw: Optional[torch.Tensor],
    db: Optional[torch.Tensor],
) -> None:
    """Launch the backward kernel (its object from the tensors themselves; db
    given exactly when the call had a bias)."""
    dtype, n = ti.dtype_name(x.dtype), ti.row_length(x)
    # The call as the backward sees it (the forward's vector width and the bias's dtype do not
    # change its object).
    call = LayerNormCall(dtype, _name(weight), dtype if db is not None else None, n, ti.full_width(n, dtype), True)
    kernel = kernel_for(call, "backward")
    # eps: RMSNorm's only (its N = 1 dx).
    run_norm_backward(kernel, dw, db, x=x, weight=weight, dy=dy, mean=mean, rstd=rstd, dx=dx, eps=0.0)


def _validate(x, weight, bias) -> None:
    ti.check_row_input("quack.layernorm", "x", x, MAX_N)
    ti.check_param("weight", weight, x)
    ti.check_param("bias", bias, x)


def layernorm_fwd(x, weight=None, bias=None, eps=1e-5, store_stats=True, plan: Optional[Plan] = None):
    """Allocate outputs and run the forward: returns (y, mean, rstd); the
    statistics are None unless ``store_stats``.  ``plan``: the call's
    (eager); None goes through the registered op (torch.compile, direct use)."""
    stats = NEW if store_stats else None
    values = FORWARD.allocate(dict(x=x, weight=weight, bias=bias, out=NEW, mean=stats, rstd=stats, eps=eps))
    if x.numel() > 0:
        plan.run("forward", **values) if plan is not None else _layernorm_fwd(**values)
    return values["out"], values["mean"], values["rstd"]


def layernorm_bwd(x, weight, dy, mean, rstd, has_bias: bool = False, plan: Optional[Plan] = None):
    """Allocate gradients and run the backward: returns (dx, dweight or None,
    dbias in fp32 when ``has_bias``, else None)."""
    dy = dy.contiguous()
    dw = torch.empty_like(weight) if weight is not None else None
    db = torch.empty(x.shape[-1], device=x.device, dtype=torch.float32) if has_bias else None
    values = NORM_BACKWARD.allocate(dict(x=x, weight=weight, dy=dy, mean=mean, rstd=rstd, dx=NEW))
    if plan is not None:
        # eps: RMSNorm's only (its N = 1 dx).
        run_norm_backward(plan.kernel_of("backward"), dw, db, **values, eps=0.0)
    else:
        _layernorm_bwd(**values, dw=dw, db=db)
    return values["dx"], dw, db


class _LayerNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps, plan):
        # Kernels take plain tensors (DLPack refuses ones that require grad).
        x, weight, bias = (t.detach() if t is not None else None for t in (x, weight, bias))
        y, mean, rstd = layernorm_fwd(x, weight, bias, eps, plan=plan)
        ctx.bias_dtype = bias.dtype if bias is not None else None  # db's dtype
        ctx.plan = plan
        ctx.save_for_backward(x, weight, mean, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, mean, rstd = ctx.saved_tensors
        dx, dw, db = layernorm_bwd(x, weight, dy, mean, rstd, ctx.bias_dtype is not None, ctx.plan)
        if weight is None or not ctx.needs_input_grad[1]:
            dw = None
        db = db.to(ctx.bias_dtype) if db is not None and ctx.needs_input_grad[2] else None
        return dx, dw, db, None, None


def layernorm(x, weight=None, bias=None, eps: float = 1e-5):
    """LayerNorm over the last dimension.

    x: (..., N) contiguous CUDA tensor, float32/float16/bfloat16, N <= 262144.
    weight, bias: (N,), float32 or x's dtype, each optional.  eps: a finite
    real number >= 0.  Returns y like x.  Raises TypeError for a wrong dtype
    or eps type and ValueError for a wrong device, shape, layout or eps
    value, before any launch.
    """
    if eps.__class__ is not float or not 0.0 <= eps < math.inf:  # (the usual float, cheaply)
        eps = check_eps(eps)
    y = NotImplemented if fastpath.tracing() else _FAST.call(3, x, weight, bias, eps)
    if y is not NotImplemented:
        return y
    _validate(x, weight, bias)
    plan, backward = eager_plan(lambda backward: call_signature(x, weight, bias, backward), x, weight, bias)
    if backward:
        return _LayerNormFunction.apply(x, weight, bias, eps, plan)
    with torch.no_grad():
        stats = plan is not None and plan.signature.backward
        y = layernorm_fwd(x, weight, bias, eps, store_stats=stats, plan=plan)[0]
    if x.numel() > 0 and not stats:
        _FAST.remember((x, weight, bias), lambda: _inference_closure(plan, x.device))
    return differentiable_outputs(y, stats)


def _inference_closure(plan: Plan, device: torch.device):
    """The eager fast path's launch for calls like this one (``quack/calls/fastpath.py``)."""
    return fastpath.like_launch(plan, "forward", device, ("x", "weight", "bias", "eps"), ("out",))


def layernorm_ref(x, weight=None, bias=None, eps: float = 1e-5):
    """fp32 reference with the same signature, rounded to x's dtype."""
    y = torch.nn.functional.layer_norm(
        x.float(), (x.shape[-1],),
        weight.float() if weight is not None else None,
        bias.float() if bias is not None else None, eps,
    )
    return y.to(x.dtype)
