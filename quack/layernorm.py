"""LayerNorm as a cached, torch-callable op: ``quack.layernorm(x, weight, bias=None, eps=1e-5)``.

    y = (x - mean(x)) * rsqrt(var(x) + eps) * weight + bias

over the last dimension of x (shape (..., N), N up to 262144, any number of
rows, float32/float16/bfloat16; the biased variance, as
``torch.nn.functional.layer_norm``).  weight and bias: (N,), float32 or x's
dtype, each optional.  Autograd gives gradients for x, weight and bias.

The kernels live in ``quack/layernorm_kernels.py``; this file holds the cached
compile functions (their arguments are the object key), the ``@cute_op`` ops,
the allocating wrappers, the autograd Function, the public function and the
fp32 reference ``layernorm_ref`` that tests import.

Test: ``pytest tests/test_layernorm.py``; benchmark: ``python tools/bench/layernorm.py``.
"""

from __future__ import annotations

from typing import Optional

import cutlass.cute as cute
import torch
from cutlass import Float32, Int32

from quack import rowwise
from quack import torch_interop as ti
from quack.cache import compile_options, jit_cache
from quack.compile_only import is_compile_only
from quack.cute_op import cute_op
from quack.layernorm_kernels import LayerNormForward
from quack.norm_backward import NormBackward, grid_clusters
from quack.rowwise import backward_config, forward_config

MAX_N = 262144


def _fake_param(dtype: Optional[str], n: int, vec: int):
    return rowwise.fake_vector(ti.cute_dtype(dtype), n, vec) if dtype else None


@jit_cache("layernorm")
def compile_layernorm_fwd(
    dtype: str, weight_dtype: Optional[str], bias_dtype: Optional[str], n: int, vec: int,
    store_stats: bool = True,
):
    """Compile the forward kernel for one static specialisation (M is symbolic).
    ``store_stats``: write mean and rstd per row for a backward pass."""
    dt = ti.cute_dtype(dtype)
    cfg = forward_config(n, vec)
    m = cute.sym_int()
    stats = (rowwise.fake_vector(Float32, m), rowwise.fake_vector(Float32, m)) if store_stats else (None, None)
    return cute.compile(
        LayerNormForward(cfg), rowwise.fake_rows(dt, m, n, vec), _fake_param(weight_dtype, n, vec),
        _fake_param(bias_dtype, n, vec), rowwise.fake_rows(dt, m, n, vec), *stats,
        Float32(0.0), cute.runtime.make_fake_stream(), options=compile_options(),
    )


@jit_cache("layernorm")
def compile_layernorm_bwd(
    dtype: str, weight_dtype: Optional[str], has_bias: bool, n: int, vec: int
):
    """Compile the backward kernel (dw partials whenever a weight is given, db
    partials whenever a bias is)."""
    cfg = backward_config(n, vec)
    dt = ti.cute_dtype(dtype)
    m = cute.sym_int()
    rows = lambda: rowwise.fake_rows(dt, m, n, vec)  # noqa: E731
    # The dw and db partial buffers share their (symbolic) row count.
    p = cute.sym_int()
    dw_partial = rowwise.fake_rows(Float32, p, n, vec) if weight_dtype else None
    db_partial = rowwise.fake_rows(Float32, p, n, vec) if has_bias else None
    return cute.compile(
        NormBackward(cfg, centred=True), rows(), _fake_param(weight_dtype, n, vec), rows(), None,
        rowwise.fake_vector(Float32, m), rowwise.fake_vector(Float32, m), rows(), dw_partial,
        db_partial, Int32(1), cute.runtime.make_fake_stream(), options=compile_options(),
    )


def _name(t: Optional[torch.Tensor]) -> Optional[str]:
    return ti.dtype_name(t.dtype) if t is not None else None


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
    """Launch the forward kernel on 2-D (M, N) tensors."""
    n = x.shape[1]
    kernel = compile_layernorm_fwd(
        ti.dtype_name(x.dtype), _name(weight), _name(bias), n, ti.vector_width(n, x, weight, bias, out),
        rstd is not None,
    )
    kernel(x, weight, bias, out, mean, rstd, eps, ti.current_stream(x.device))


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
    """Launch the persistent backward kernel and sum its per-CTA partial rows
    into dw (given exactly when weight is) and db.  The grid and the partial
    buffers are sized here, on the real tensors, never while torch.compile
    traces (where N and M may be symbolic)."""
    m, n = x.shape
    vec = ti.vector_width(n, x, weight, dy, dx)
    cfg = backward_config(n, vec)
    num_ctas = grid_clusters(
        cfg, m, x.device.index or 0, x.element_size(), 0 if weight is None else weight.element_size(), False
    )
    rows = num_ctas * cfg.rows_per_cta
    dw_partial = ti.partial_rows(rows, n, x.device, m) if dw is not None else None
    db_partial = ti.partial_rows(rows, n, x.device, m) if db is not None else None
    if m > 0:
        kernel = compile_layernorm_bwd(ti.dtype_name(x.dtype), _name(weight), db is not None, n, vec)
        kernel(x, weight, dy, None, mean, rstd, dx, dw_partial, db_partial, num_ctas, ti.current_stream(x.device))
    ti.sum_partial_rows(dw_partial, dw)
    ti.sum_partial_rows(db_partial, db)


def _validate(x, weight, bias) -> None:
    ti.check_row_input("quack.layernorm", "x", x, MAX_N)
    ti.check_param("weight", weight, x)
    ti.check_param("bias", bias, x)


def layernorm_fwd(x, weight=None, bias=None, eps=1e-5, store_stats=True):
    """Allocate outputs and run the forward op: returns (y, mean, rstd); the
    statistics are None unless ``store_stats``."""
    n = x.shape[-1]
    x2 = ti.as_rows(x, n)
    out = torch.empty_like(x)
    mean = rstd = None
    if store_stats:
        mean = torch.empty(x2.shape[0], device=x.device, dtype=torch.float32)
        rstd = torch.empty(x2.shape[0], device=x.device, dtype=torch.float32)
    if x2.shape[0] > 0:
        _layernorm_fwd(x2, weight, bias, ti.as_rows(out, n), mean, rstd, eps)
    return out, mean, rstd


def layernorm_bwd(x, weight, dy, mean, rstd, has_bias=False):
    """Allocate gradients and run the backward op: returns (dx, dweight or
    None, dbias in fp32 or None)."""
    n = x.shape[-1]
    dx = torch.empty_like(x)
    dw = torch.empty_like(weight) if weight is not None else None
    db = torch.empty(n, device=x.device, dtype=torch.float32) if has_bias else None
    _layernorm_bwd(ti.as_rows(x, n), weight, ti.as_rows(dy.contiguous(), n), mean, rstd, ti.as_rows(dx, n), dw, db)
    return dx, dw, db


class _LayerNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        # Kernels take plain tensors (DLPack refuses ones that require grad).
        x, weight, bias = (t.detach() if t is not None else None for t in (x, weight, bias))
        y, mean, rstd = layernorm_fwd(x, weight, bias, eps)
        ctx.bias_dtype = bias.dtype if bias is not None else None
        ctx.save_for_backward(x, weight, mean, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, mean, rstd = ctx.saved_tensors
        has_bias = ctx.bias_dtype is not None and ctx.needs_input_grad[2]
        dx, dw, db = layernorm_bwd(x, weight, dy, mean, rstd, has_bias)
        if weight is None or not ctx.needs_input_grad[1]:
            dw = None
        if db is not None:
            db = db.to(ctx.bias_dtype)
        return dx, dw, db, None


def layernorm(x, weight=None, bias=None, eps: float = 1e-5):
    """LayerNorm over the last dimension.

    x: (..., N) contiguous CUDA tensor, float32/float16/bfloat16, N <= 262144.
    weight, bias: (N,), float32 or x's dtype, each optional.  Returns y like
    x.  Raises TypeError for a wrong dtype and ValueError for a wrong device,
    shape or layout, before any launch.
    """
    _validate(x, weight, bias)
    backward = ti.will_backward(x, weight, bias)
    if is_compile_only():
        return _warm(x, weight, bias, eps, backward)
    if backward:
        return _LayerNormFunction.apply(x, weight, bias, eps)
    return layernorm_fwd(x, weight, bias, eps, store_stats=False)[0]


@torch.no_grad()
def _warm(x, weight, bias, eps, backward):
    """Compile-only: export the kernels the eager call would run: the forward,
    and the backward when autograd will run one (autograd cannot run on fake
    CUDA tensors with a CPU-only torch, see quack/testing/autograd.py).  The
    output carries no graph."""
    y, mean, rstd = layernorm_fwd(x, weight, bias, eps, store_stats=backward)
    if backward:
        # The same has_bias as _LayerNormFunction.backward, so the same object.
        has_bias = bias is not None and bias.requires_grad
        layernorm_bwd(x, weight, torch.empty_like(y), mean, rstd, has_bias)
    return y


def layernorm_ref(x, weight=None, bias=None, eps: float = 1e-5):
    """fp32 reference with the same signature, rounded to x's dtype."""
    y = torch.nn.functional.layer_norm(
        x.float(), (x.shape[-1],),
        weight.float() if weight is not None else None,
        bias.float() if bias is not None else None, eps,
    )
    return y.to(x.dtype)
