"""Hopper GEMM as cached, torch-callable ops: ``quack.gemm(A, B, out_dtype,
cu_seqlens_m, cu_seqlens_k, bias, activation)`` and ``quack.gemm_glu``, with
the eager fast path of plain dense calls.

Dense: A (M, K) @ B (K, N), each row- or column-major.  Variable-length M:
A (total_M, K) packed by groups, B (G, K, N), ``cu_seqlens_m`` (G + 1,) int32
with cu[0] = 0, non-decreasing, cu[G] = total_M; group g's rows
``A[cu[g]:cu[g+1]]`` multiply ``B[g]`` (empty groups are fine).  bf16 or fp16
inputs, fp32 accumulation, bf16, fp16 or fp32 output (the input dtype by default).
Variable-length K: A (M, total_K), B (total_K, N), ``cu_seqlens_k`` (G + 1,)
int32 splitting total_K; returns (G, M, N), group g contracting over
``cu[g]:cu[g+1]`` (an empty group gives zeros): the weight gradient of a
grouped GEMM, whose A is a transposed view (an M-contiguous A, not copied).

Gated (``gemm_glu``): act(A @ B_gate) * (A @ B_up) with B's gate and up
columns interleaved, (M, N) from B's 2N columns, in the same kernel's
epilogue (``quack/families/gemm/kernel.py``).

A call that will be differentiated plans the backward's products with its
own kernel (``quack/families/gemm/autograd.py``), so warming it warms them
too.  The host code's other parts: ``config.py`` (tile heuristic),
``operands.py`` (checks and views), ``signature.py`` (what decides the
kernels), ``product.py`` (one product's launch).  Test: ``pytest
tests/test_gemm.py``; benchmark: ``python tools/bench/gemm.py``.
"""

from __future__ import annotations

from typing import Optional

import torch

from quack.calls import fastpath
from quack.calls import torch_interop as ti
from quack.calls.plan import Plan
from quack.calls.eager import eager_plan
from quack.compile_only import differentiable_outputs
from quack.families.gemm.autograd import GemmFunction
from quack.families.gemm.config import resident_clusters
from quack.families.gemm.operands import call_operands, check_gemm
from quack.families.gemm.operands import columns
from quack.families.gemm.product import check_alignment, product, run_role
from quack.families.gemm.split import split_buffers, split_plan
from quack.families.gemm.signature import signature_of

# This op's eager fast path (quack/calls/fastpath.py).
_FAST = fastpath.Closures()


def gemm(A: torch.Tensor, B: torch.Tensor, out_dtype: Optional[torch.dtype] = None,
         cu_seqlens_m: Optional[torch.Tensor] = None, cu_seqlens_k: Optional[torch.Tensor] = None,
         bias: Optional[torch.Tensor] = None, activation: Optional[str] = None) -> torch.Tensor:
    """A @ B (dense) or one of the grouped products in the module docstring.

    Raises TypeError for wrong dtypes and ValueError for wrong devices, shapes,
    strides or alignment, before any launch.  A may be row-major or (except
    with cu_seqlens_m) column-major, a transposed view; B row- or
    column-major (per group); other layouts are copied.  Differentiable,
    dense and with cu_seqlens_m (not with cu_seqlens_k: NotImplementedError).
    ``bias`` (N,) in A's dtype or fp32 and ``activation`` (``gemm_epilogue.ACTIVATIONS``)
    are fused into the epilogue: act(A @ B + bias), not with cu_seqlens_k.
    Grouped rows: output rows outside [cu[0], cu[G]) are left unwritten (and
    so is their gradient, which the bias gradient would then sum: train with
    cu[0] = 0 and cu[G] = total_M); a malformed cu_seqlens gives wrong
    values, never an access outside A, B or D.
    """
    # (Not while torch.compile traces: _call compares addresses for the fast path.)
    plain = bias is None and activation is None and fastpath.applies()
    described = (A, B, cu_seqlens_m, cu_seqlens_k, _out_dtype_code(out_dtype)) if plain else None
    out = _FAST.call(5, *described) if plain else NotImplemented
    if out is not NotImplemented:
        return out
    out_dtype = check_gemm("quack.gemm", A, B, out_dtype, cu_seqlens_m, cu_seqlens_k, bias, activation)
    return _call(A, B, out_dtype, cu_seqlens_m, cu_seqlens_k, bias, activation, described)


def gemm_glu(A: torch.Tensor, B: torch.Tensor, activation: str = "swiglu", out_dtype: Optional[torch.dtype] = None,
             cu_seqlens_m: Optional[torch.Tensor] = None) -> torch.Tensor:
    """act(A @ B_gate) * (A @ B_up) in one GEMM: B (K, 2N), or (G, K, 2N)
    with ``cu_seqlens_m``, holds the gate and up projections interleaved
    column by column (gate j at column 2 j, up j at 2 j + 1); returns (M, N).
    ``activation``: swiglu (silu), geglu (GELU's tanh approximation) or
    reglu (relu) of the gate, in fp32 before the one rounding.

    A call that autograd will differentiate also stores the (M, 2N)
    pre-activation A @ B (memory: twice the output), from which the backward
    recomputes the gate's activation (one elementwise kernel,
    ``quack/families/gemm/dact.py``) before its two GEMMs.  Layouts, dtypes and
    errors as ``gemm``; N a multiple of 8.
    """
    out_dtype = check_gemm("quack.gemm_glu", A, B, out_dtype, cu_seqlens_m, None, None, activation, gated=True)
    return _call(A, B, out_dtype, cu_seqlens_m, None, None, activation, None)


def _call(A, B, out_dtype, cu_seqlens_m, cu_seqlens_k, bias, activation, described) -> torch.Tensor:
    """A checked call: its product, through autograd when it will be
    differentiated (``eager_plan`` decides).  ``described``: the fast path's
    described arguments of the call, to leave a closure for its like."""
    # (The operands of a call that will be differentiated hold its pre-activation.)
    ops, cu = call_operands(A, B, out_dtype, cu_seqlens_m, cu_seqlens_k, bias, activation,
                            ti.will_backward(A, B, bias))
    if not ops.empty and not torch.compiler.is_compiling():
        check_alignment(ops)  # before eager_plan warms anything in compile-only mode
    plan, backward = eager_plan(lambda backward: signature_of(ops, backward), A, B, bias)
    if backward:
        return GemmFunction.apply(A, B, bias, ops, cu, plan)
    out = product(ops, cu, plan)
    stores_for_backward = plan is not None and plan.signature.backward
    # The closure passes A and B as they come: not for a copy, an M-major A or an empty product.
    if (described is not None and plan is not None and not stores_for_backward and cu is None
            and not ops.a_m_major and not ops.empty and ops.a is A and ops.b3.data_ptr() == B.data_ptr()):
        _FAST.remember(described, lambda: _dense_closure(plan, run_role(plan, ops), ops, out))
    return differentiable_outputs(out, stores_for_backward)


# The fast path's key spells out_dtype as a number (-1: one the checks refuse).
_OUT_DTYPE_CODES = {None: 0, torch.bfloat16: 1, torch.float16: 2, torch.float32: 3}


def _out_dtype_code(out_dtype) -> int:
    """out_dtype's number in the fast path's key (anything, unhashable too)."""
    return _OUT_DTYPE_CODES.get(out_dtype, -1) if out_dtype is None or isinstance(out_dtype, torch.dtype) else -1


def _dense_closure(plan: Plan, role: str, ops, out: torch.Tensor):
    """The eager fast path's launch for dense calls like this one
    (``quack/calls/fastpath.py``): the same shapes and strides, so B's view,
    the grid and the K split are this call's (the split's buffers are the
    current stream's, which the C launcher looks up)."""
    cfg = plan.signature.config(role)
    # The split kernel takes workspace and counters side by side: each a dict of the streams' buffers.
    workspace_at = plan.kernel_of(role).launch.parameters.index("workspace") if cfg.split_k else -1
    per_stream = frozenset({workspace_at, workspace_at + 1}) if cfg.split_k else frozenset()
    launch = fastpath.direct(plan, role, out.device, per_stream=per_stream)
    if launch is None:
        return None
    b_shape, b_strides = tuple(ops.b3.shape), ops.b3.stride()
    out_shape, out_dtype, device = tuple(out.shape), out.dtype, out.device
    empty = torch.empty
    max_clusters = resident_clusters(cfg, out.device)
    rest = fastpath.trailing_arguments(plan, role, ("a", "b", "d"), max_clusters=max_clusters)
    if cfg.split_k:
        split = split_plan(cfg, out_shape[0], columns(ops.b3, ops.b_n_major), ops.a.shape[1], max_clusters)
        buffers = fastpath.PerStream(lambda: split_buffers(cfg, split, device), device, 2)
        before, after = rest[:workspace_at - 3], rest[workspace_at - 1:]  # (rest follows a, b and d)
        workspaces, counters = buffers.dicts

        def run_split(A, B, _cu_m, _cu_k, _out_dtype_code):  # the key fixed these
            out = empty(out_shape, device=device, dtype=out_dtype)
            b = B.as_strided(b_shape, b_strides)
            done = launch(A, b, out, *before, workspaces, counters, *after)
            # No buffers for this stream yet, or a capture, which gets buffers
            # of its own (or another device: declined again).
            if done is NotImplemented:
                done = launch(A, b, out, *before, *buffers.add_current(), *after)
            return out if done is None else NotImplemented

        return run_split

    def run(A, B, _cu_m, _cu_k, _out_dtype_code):  # the key fixed these
        out = empty(out_shape, device=device, dtype=out_dtype)
        return out if launch(A, B.as_strided(b_shape, b_strides), out, *rest) is None else NotImplemented

    return run


def gemm_ref(A: torch.Tensor, B: torch.Tensor, out_dtype: Optional[torch.dtype] = None,
             cu_seqlens_m: Optional[torch.Tensor] = None) -> torch.Tensor:
    """fp32 reference, rounded to the output dtype (grouped: rows cu[0] to cu[G])."""
    out_dtype = A.dtype if out_dtype is None else out_dtype
    if cu_seqlens_m is None:
        return (A.float() @ B.float()).to(out_dtype)
    bounds = cu_seqlens_m.tolist()
    pieces = [
        A.narrow(0, bounds[g], bounds[g + 1] - bounds[g]).float() @ B.select(0, g).float()
        for g in range(B.shape[0])
    ]
    if not pieces:
        return torch.empty(0, B.shape[-1], device=A.device, dtype=out_dtype)
    return torch.cat(pieces).to(out_dtype)
