"""The backward of ``quack.gemm(activation=...)`` and ``quack.gemm_glu``
before their two GEMMs: dZ = dY * act'(Z) from the saved pre-activation, one
elementwise kernel (``quack/families/gemm/dact_kernel.py``).  No GEMM produces dY
there (it comes from whatever followed the op), so the step cannot ride in a
GEMM's epilogue as it does in ``quack.mlp``, where the dH GEMM's epilogue
applies it.  One object per dtype and activation serves every shape.
"""

from __future__ import annotations

import torch

from quack.calls import torch_interop as ti
from quack.cache import compile_options, jit_cache
from quack.compile_only import is_compile_only
from quack.calls.cute_op import cute_op
from quack.families.gemm.epilogue import GATED
from quack.calls.launches import Launch, in_order
from quack.calls.plan import Kernel

_VECTOR_BYTES = 16


# The kernel takes its 2-D tensors as they come (rows of 16-byte vectors).
ACTIVATION_GRAD = Launch("quack.families.gemm.dact_kernel:ActivationGrad", rows=frozenset())


@jit_cache("gemm")
def compile_activation_grad(dtype: str, activation: str):
    """Compile dZ = dY * act'(Z) for ``dtype`` (dY, Z and dZ) and an
    activation of ``gemm_epilogue.ACTIVATIONS`` or ``GATED``; rows and
    columns symbolic, every row 16-byte aligned."""
    import cutlass.cute as cute

    from quack.families.gemm.dact_kernel import ActivationGrad

    dt = ti.cute_dtype(dtype)
    vec = _VECTOR_BYTES * 8 // dt.width
    gated = activation in GATED
    m, n = cute.sym_int(), cute.sym_int()
    z_cols = cute.sym_int() if gated else n

    def rows(cols):
        stride = (cute.sym_int64(divisibility=vec), 1)
        return cute.runtime.make_fake_tensor(dt, (m, cols), stride, assumed_align=_VECTOR_BYTES)

    kernel = ActivationGrad(GATED.get(activation, activation), gated, vec)
    fakes = dict(grad_out=rows(n), preact=rows(z_cols), grad_pre=rows(z_cols), stream=cute.runtime.make_fake_stream())
    return cute.compile(kernel, *in_order(ActivationGrad, fakes), options=compile_options())


def activation_grad_kernel(dtype: str, activation: str) -> Kernel:
    """The object a training call's plan lists for its backward's dZ."""
    return Kernel(compile_activation_grad, (dtype, activation), ACTIVATION_GRAD)


def activation_grad(grad_out: torch.Tensor, preact: torch.Tensor, activation: str) -> torch.Tensor:
    """dL/d(preact) from dL/d(out), in ``preact``'s dtype (autograd hands a
    gradient in the output's, which is the pre-activation's); gated: the
    gate and up columns' gradients, interleaved as they are."""
    grad_pre = torch.empty_like(preact, memory_format=torch.contiguous_format)
    if preact.numel():
        _activation_grad(grad_out.to(preact.dtype), preact, grad_pre, activation)
    return grad_pre


def _vector_rows(t: torch.Tensor) -> bool:
    """Rows of 16-byte vectors: unit column stride, aligned start and row stride."""
    vec = _VECTOR_BYTES // t.element_size()
    return t.stride(-1) == 1 and t.stride(0) % vec == 0 and ti.address(t) % _VECTOR_BYTES == 0


@cute_op("quack::gemm_activation_grad", mutates_args=("grad_pre",))
def _activation_grad(grad_out: torch.Tensor, preact: torch.Tensor, grad_pre: torch.Tensor, activation: str) -> None:
    """The registered op (torch.compile's graphs call it): dZ into ``grad_pre``.
    A gradient whose rows are not 16-byte vectors (a transpose, a broadcast
    along columns) is copied first."""
    kernel = activation_grad_kernel(ti.dtype_name(preact.dtype), activation)
    if is_compile_only():
        kernel.load()
        return
    if not _vector_rows(grad_out):
        grad_out = grad_out.clone(memory_format=torch.contiguous_format)
    kernel.run(grad_out=grad_out, preact=preact, grad_pre=grad_pre)
