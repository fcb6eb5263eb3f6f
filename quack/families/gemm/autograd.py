"""The GEMM's backward: dA = dC @ Bᵀ and dB = Aᵀ @ dC are the same kernel on
views, the transposes flipping those operands' layouts (an M-contiguous A is
one of the kernel's two A layouts), so nothing is copied; the forward saves
A and B themselves.  A call grouped by rows has dB[g] = A[rows of g]ᵀ @
dC[rows of g], the variable-length-K product.  With an activation, the
backward's dZ = dC * act'(Z) comes first, from the saved pre-activation Z
(``quack/families/gemm/dact.py``)."""

from __future__ import annotations

import torch

from quack.families.gemm.config import call_grouping, weight_grad_grouping
from quack.families.gemm.dact import activation_grad
from quack.families.gemm.operands import kernel_operands, kernel_ready
from quack.families.gemm.product import product


class GemmFunction(torch.autograd.Function):
    """dA = dC @ Bᵀ and dB = Aᵀ @ dC, each one GEMM on views (no transposed
    copies).  The forward saves what the backward needs of what its kernel
    read: A (for dB), B as (L, K, N) (for dA), cu_seqlens_m, the
    pre-activation."""

    @staticmethod
    def forward(ctx, A, B, bias, ops, cu, plan):
        out = product(ops, cu, plan)
        wants_a, wants_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        ctx.save_for_backward(ops.a if wants_b else None, ops.b_kn if wants_a else None, cu, ops.preact)
        ctx.dtypes = (A.dtype, B.dtype, bias.dtype if bias is not None else None)
        ctx.activation = ops.activation
        return out

    @staticmethod
    def backward(ctx, dc):
        a, b_kn, cu, preact = ctx.saved_tensors
        a_dtype, b_dtype, bias_dtype = ctx.dtypes
        if ctx.activation is not None:
            dc = activation_grad(dc, preact, ctx.activation)  # one elementwise kernel (quack/families/gemm/dact.py)
        dbias = dc.float().sum(0).to(bias_dtype) if ctx.needs_input_grad[2] else None
        dc = kernel_ready(dc, a_dtype)
        da, db = input_grads(dc, a, b_kn, cu, ctx.needs_input_grad[0], ctx.needs_input_grad[1], b_dtype)
        return da, db, dbias, None, None, None


def input_grads(dc, a, b_kn, cu, wants_a: bool, wants_b: bool, b_dtype: torch.dtype):
    """(dA, dB) of C = A @ B from dC, each one GEMM on views: dA = dC @ Bᵀ,
    dB = Aᵀ @ dC (grouped rows: group g's dB contracts over its rows, a
    variable-length K); None where not wanted."""
    grouping = call_grouping(cu)
    da = db = None
    if wants_a:
        da = product(kernel_operands(dc, b_kn.transpose(-1, -2), dc.dtype, cu, grouping), cu, warm_empty=False)
    if wants_b:
        db = product(kernel_operands(a.t(), dc, b_dtype, cu, weight_grad_grouping(grouping)), cu, warm_empty=False)
    return da, db
