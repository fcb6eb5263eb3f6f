"""Softmax as a cached, torch-callable op: ``quack.softmax(x)``.

    y = exp(x - max(x)) / sum(exp(x - max(x)))

over the last dimension of x (shape (..., N), N up to 262144, any number of
rows, float32/float16/bfloat16), with autograd (dx = y * (dy - sum(y * dy))).
The statistics are fp32; y is rounded to x's dtype once.

The kernels live in ``quack/softmax_kernels.py``; this file holds the cached
compile functions (their arguments are the object key), the ``@cute_op`` ops,
the allocating wrappers, the autograd Function, the public function and the
fp32 reference ``softmax_ref`` that tests import.

Test: ``pytest tests/test_softmax.py``; benchmark: ``python tools/bench/softmax.py``.
"""

from __future__ import annotations


import cutlass.cute as cute
import torch

from quack import rowwise
from quack import torch_interop as ti
from quack.cache import compile_options, jit_cache
from quack.compile_only import is_compile_only
from quack.cute_op import cute_op
from quack.rowwise import backward_config, forward_config
from quack.softmax_kernels import SoftmaxBackward, SoftmaxForward

MAX_N = 262144


@jit_cache("softmax")
def compile_softmax_fwd(dtype: str, n: int, vec: int):
    """Compile the forward kernel for one static specialisation (M is symbolic)."""
    dt = ti.cute_dtype(dtype)
    cfg = forward_config(n, vec)
    m = cute.sym_int()
    return cute.compile(
        SoftmaxForward(cfg), rowwise.fake_rows(dt, m, n, vec), rowwise.fake_rows(dt, m, n, vec),
        cute.runtime.make_fake_stream(), options=compile_options(),
    )


@jit_cache("softmax")
def compile_softmax_bwd(dtype: str, n: int, vec: int):
    """Compile the backward kernel (y, dy and dx share one dtype)."""
    dt = ti.cute_dtype(dtype)
    cfg = backward_config(n, vec)
    m = cute.sym_int()
    rows = lambda: rowwise.fake_rows(dt, m, n, vec)  # noqa: E731
    return cute.compile(
        SoftmaxBackward(cfg), rows(), rows(), rows(), cute.runtime.make_fake_stream(),
        options=compile_options(),
    )


@cute_op("quack::softmax_fwd", mutates_args=("out",))
def _softmax_fwd(x: torch.Tensor, out: torch.Tensor) -> None:
    """Launch the forward kernel on 2-D (M, N) tensors."""
    n = x.shape[1]
    kernel = compile_softmax_fwd(ti.dtype_name(x.dtype), n, ti.vector_width(n, x, out))
    kernel(x, out, ti.current_stream(x.device))


@cute_op("quack::softmax_bwd", mutates_args=("dx",))
def _softmax_bwd(y: torch.Tensor, dy: torch.Tensor, dx: torch.Tensor) -> None:
    """Launch the backward kernel on 2-D (M, N) tensors."""
    n = y.shape[1]
    kernel = compile_softmax_bwd(ti.dtype_name(y.dtype), n, ti.vector_width(n, y, dy, dx))
    kernel(y, dy, dx, ti.current_stream(y.device))


def _validate(x) -> None:
    ti.check_row_input("quack.softmax", "x", x, MAX_N)


def softmax_fwd(x: torch.Tensor) -> torch.Tensor:
    """Allocate y and run the forward op."""
    n = x.shape[-1]
    out = torch.empty_like(x)
    x2 = ti.as_rows(x, n)
    if x2.shape[0] > 0:
        _softmax_fwd(x2, ti.as_rows(out, n))
    return out


def softmax_bwd(y: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    """Allocate dx and run the backward op (dy is made contiguous in y's dtype)."""
    n = y.shape[-1]
    dy = dy.to(y.dtype).contiguous()
    dx = torch.empty_like(y)
    y2 = ti.as_rows(y, n)
    if y2.shape[0] > 0:
        _softmax_bwd(y2, ti.as_rows(dy, n), ti.as_rows(dx, n))
    return dx


class _SoftmaxFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        # Kernels take plain tensors (DLPack refuses ones that require grad).
        y = softmax_fwd(x.detach())
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, dy):
        (y,) = ctx.saved_tensors
        return softmax_bwd(y.detach(), dy)


def softmax(x: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dimension.

    x: (..., N) contiguous CUDA tensor, float32/float16/bfloat16, N <= 262144.
    Returns y like x.  Differentiable.  Raises TypeError for a wrong dtype and
    ValueError for a wrong device, shape or layout, before any launch.
    """
    _validate(x)
    backward = ti.will_backward(x)
    if is_compile_only():
        return _warm(x, backward)
    if backward:
        return _SoftmaxFunction.apply(x)
    return softmax_fwd(x)


@torch.no_grad()
def _warm(x, backward):
    """Compile-only: export the kernels the eager call would run: the forward,
    and the backward when autograd will run one (autograd cannot run on fake
    CUDA tensors with a CPU-only torch, see quack/testing/autograd.py).  The
    output carries no graph."""
    y = softmax_fwd(x)
    if backward:
        softmax_bwd(y, torch.empty_like(y))
    return y


def softmax_ref(x: torch.Tensor) -> torch.Tensor:
    """fp32 reference, rounded to x's dtype."""
    return torch.softmax(x.float(), dim=-1).to(x.dtype)
