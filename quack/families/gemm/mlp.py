"""A two-GEMM MLP whose activation's backward is a GEMM epilogue: ``quack.mlp``.

y = act(x @ W1) @ W2, dense or grouped by rows (an MoE expert layer), with a
plain activation (relu, relu_sq, gelu_tanh, silu) or a gated one (swiglu,
geglu, reglu: W1's gate and up columns interleaved, as ``quack.gemm_glu``
takes them).  The forward is the two fused-epilogue GEMMs of ``quack.gemm``
and ``quack.gemm_glu``.  The backward needs dZ, the gradient of the
pre-activation Z = x @ W1: it is the epilogue of the GEMM that computes the
hidden layer's gradient, dZ = (dY @ W2ᵀ) * act'(Z) (gated: the gate's and up
column's gradients from act(gate), act'(gate) and up), reading the saved Z
at each value's coordinates, so no elementwise pass runs; then dx = dZ @ W1ᵀ,
dW1 = xᵀ @ dZ and dW2 = Hᵀ @ dY, each one GEMM on views.

Saved for the backward: x, W1, W2, Z (M x W1's columns) and the hidden
layer H (M x W2's rows), both in x's dtype: Z is the one tensor more than a
plain two-GEMM MLP keeps (twice H's size for a gated activation).
"""

from __future__ import annotations

from typing import Optional

import torch

from quack.calls import torch_interop as ti
from quack.compile_only import autograd_available, differentiable_outputs
from quack.families.gemm.autograd import input_grads
from quack.families.gemm.config import call_grouping
from quack.families.gemm.epilogue import ACTIVATIONS, GATED
from quack.families.gemm.op import gemm, gemm_glu
from quack.families.gemm.operands import (check_activation_type, check_b, check_call, check_gated_columns,
                                          kernel_operands, kernel_ready)
from quack.families.gemm.product import product
from quack.families.gemm.signature import plan_of

MLP_ACTIVATIONS = (*ACTIVATIONS[1:], *GATED)


def mlp(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, activation: str = "swiglu",
        cu_seqlens_m: Optional[torch.Tensor] = None) -> torch.Tensor:
    """act(x @ w1) @ w2.  Dense: x (M, K), w1 (K, H) (gated: (K, 2H)), w2
    (H, N); grouped by rows: w1 (G, K, H or 2H) and w2 (G, H, N), rows
    ``cu_seqlens_m[g]:cu_seqlens_m[g + 1]`` of x through expert g.  Dtypes,
    layouts and errors as ``quack.gemm``; returns (M, N) in x's dtype.
    Differentiable in x, w1 and w2 (see the module docstring for what is
    saved)."""
    check_activation_type(activation)
    if activation not in MLP_ACTIVATIONS:
        raise ValueError(f"activation must be one of {MLP_ACTIVATIONS}, got {activation!r}")
    gated = activation in GATED
    check_call("quack.mlp", x, w1, None, cu_seqlens_m, None)
    if gated:
        check_gated_columns("w1", w1, "H")
    ti.check_float("w2", w2, (x.dtype,))
    hidden = w1.shape[-1] // 2 if gated else w1.shape[-1]
    if w2.shape[-2] != hidden:
        raise ValueError(f"w2 must have {hidden} rows (the hidden layer's width), got shape {tuple(w2.shape)}")
    check_b(w2, x, (x.shape[0], hidden), cu_seqlens_m)
    if not ti.will_backward(x, w1, w2):
        h = (gemm_glu if gated else gemm)(x, w1, activation=activation, cu_seqlens_m=cu_seqlens_m)
        return gemm(h, w2, cu_seqlens_m=cu_seqlens_m)
    cu = cu_seqlens_m.contiguous() if cu_seqlens_m is not None else None
    if not autograd_available():
        # Warm the forward's and the backward's kernels; no graph (compile-only, CPU-only torch).
        y, saved = _forward(x, w1, w2, cu, activation)
        _backward(torch.empty_like(y), *saved, cu, activation, (True, True, True))
        return differentiable_outputs(y, True)
    return _MlpFunction.apply(x, w1, w2, cu, activation)


def _forward(x, w1, w2, cu, activation):
    """y and what the backward reads: (x, W1 as (L, K, H'), W2 as (L, H, N), Z, H)."""
    grouping = call_grouping(cu)
    first = kernel_operands(x.detach(), w1.detach(), x.dtype, cu, grouping, None, activation, backward=True)
    h = product(first, cu, plan_of(first, backward=True))
    second = kernel_operands(h, w2.detach(), x.dtype, cu, grouping)
    y = product(second, cu)
    return y, (first.a, first.b_kn, second.b_kn, first.preact, h)


def _backward(dy, x, w1_kn, w2_kn, z, h, cu, activation, wants):
    """(dx, dW1, dW2): dZ in one GEMM with the derivative's epilogue, then three plain ones."""
    dy = kernel_ready(dy, x.dtype)
    dz = product(kernel_operands(dy, w2_kn.transpose(-1, -2), x.dtype, cu, call_grouping(cu), None,
                                 f"d{activation}", preact=z), cu)
    _, dw2 = input_grads(dy, h, None, cu, False, wants[2], w2_kn.dtype)
    dx, dw1 = input_grads(dz, x, w1_kn, cu, wants[0], wants[1], w1_kn.dtype)
    return dx, dw1, dw2


class _MlpFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w1, w2, cu, activation):
        y, saved = _forward(x, w1, w2, cu, activation)
        ctx.save_for_backward(*saved, cu)
        ctx.activation = activation
        return y

    @staticmethod
    def backward(ctx, dy):
        *saved, cu = ctx.saved_tensors
        dx, dw1, dw2 = _backward(dy, *saved, cu, ctx.activation, ctx.needs_input_grad[:3])
        return dx, dw1, dw2, None, None
