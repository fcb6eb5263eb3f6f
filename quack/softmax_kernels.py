"""Softmax forward and backward kernels (CuTe DSL, sm_90a).

Forward, per row:  y = exp(x - max(x)) / sum(exp(x - max(x))).
Each CTA owns ``rows_per_cta`` rows (or, in a cluster, one slice of a row) and
loads its slice into registers once; masked columns read as -inf so they add
nothing.  The row max and the sum of exponentials come from one exchange
(``rowwise.row_max_and_exp``: each thread exponentiates against its own max,
the (max, sum) pairs are merged, the kept exponentials rescaled once).

Backward, per row:  dx = y * (dy - sum(y * dy)); one row reduction.

Thread mapping, cluster sizes and the reduction are described in
``quack/rowwise.py``.  Constraints: N <= 262144, fp32/fp16/bf16; odd N with
16-bit data uses element copies (correct, slower).  Tests:
tests/test_softmax.py; benchmark: ``python tools/bench/softmax.py``.
"""

from __future__ import annotations

import math

import cuda.bindings.driver as cuda
import cutlass.cute as cute
from cutlass import Float32, const_expr

from quack import rowwise
from quack.rowwise import RowConfig

LOG2_E = math.log2(math.e)


class SoftmaxForward:
    """y = softmax(x) over each row."""

    def __init__(self, cfg: RowConfig):
        self.cfg = cfg

    @cute.jit
    def __call__(self, mX: cute.Tensor, mY: cute.Tensor, stream: cuda.CUstream):
        copy = rowwise.make_row_copy(mX.element_type, self.cfg)
        rowwise.launch_rows(self.kernel(mX, mY, copy), self.cfg, mX.shape[0], stream)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mY: cute.Tensor, copy: cute.TiledCopy):
        cfg = self.cfg
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        # Stage 0: the max; stage 1: the sum.
        rank, smem, sRed = rowwise.start_row_cta(cfg, stages=2)
        m, n = mX.shape[0], mX.shape[1]
        gX = cute.local_tile(mX, cfg.tiler, (bidx, rank))
        gY = cute.local_tile(mY, cfg.tiler, (bidx, rank))
        gC = cute.local_tile(cute.make_identity_tensor((m, n)), cfg.tiler, (bidx, rank))
        # gX: (rows_per_cta, cols_per_cta) tile of this CTA
        thr = copy.get_slice(tidx)
        tXgX, tXgY, tXcX = thr.partition_S(gX), thr.partition_D(gY), thr.partition_S(gC)
        # tXgX: ((vec), 1, vecs_per_thread) per thread
        tXpX = rowwise.copy_predicate(tXcX, m, n, not cfg.covers_n_exactly)

        tXrX = cute.make_rmem_tensor_like(tXgX)
        rowwise.load_row_filled(
            rowwise.vector_atom(mX.element_type, cfg), tXgX, tXrX, tXpX, -math.inf
        )
        x = tXrX.load().to(Float32)
        if const_expr(cfg.cluster_n > 1):
            cute.arch.cluster_wait()
        _, denom, p = rowwise.row_max_and_exp(
            x, sRed[None, None, 0], sRed[None, None, 1], cfg.threads_per_row, cfg.cluster_n
        )
        y = p * cute.arch.rcp_approx(denom)
        tXrY = cute.make_rmem_tensor_like(tXgY)
        tXrY.store(y.to(mY.element_type))
        rowwise.store_row(rowwise.vector_atom(mY.element_type, cfg), tXrY, tXgY, tXpX)


class SoftmaxBackward:
    """dx = y * (dy - sum(y * dy)) over each row."""

    def __init__(self, cfg: RowConfig):
        self.cfg = cfg

    @cute.jit
    def __call__(self, mY: cute.Tensor, mDy: cute.Tensor, mDx: cute.Tensor, stream: cuda.CUstream):
        copy = rowwise.make_row_copy(mY.element_type, self.cfg)
        rowwise.launch_rows(self.kernel(mY, mDy, mDx, copy), self.cfg, mY.shape[0], stream)

    @cute.kernel
    def kernel(self, mY: cute.Tensor, mDy: cute.Tensor, mDx: cute.Tensor, copy: cute.TiledCopy):
        cfg = self.cfg
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        rank, smem, sRed = rowwise.start_row_cta(cfg)
        m, n = mY.shape[0], mY.shape[1]
        gY = cute.local_tile(mY, cfg.tiler, (bidx, rank))
        gDy = cute.local_tile(mDy, cfg.tiler, (bidx, rank))
        gDx = cute.local_tile(mDx, cfg.tiler, (bidx, rank))
        gC = cute.local_tile(cute.make_identity_tensor((m, n)), cfg.tiler, (bidx, rank))
        # gY: (rows_per_cta, cols_per_cta) tile of this CTA
        thr = copy.get_slice(tidx)
        tXgY, tXgDy, tXgDx = thr.partition_S(gY), thr.partition_S(gDy), thr.partition_D(gDx)
        tXcX = thr.partition_S(gC)
        # tXgY: ((vec), 1, vecs_per_thread) per thread
        tXpX = rowwise.copy_predicate(tXcX, m, n, not cfg.covers_n_exactly)

        tXrY, tXrDy = cute.make_rmem_tensor_like(tXgY), cute.make_rmem_tensor_like(tXgDy)
        rowwise.load_row(rowwise.vector_atom(mY.element_type, cfg), tXgY, tXrY, tXpX)
        rowwise.load_row(rowwise.vector_atom(mDy.element_type, cfg), tXgDy, tXrDy, tXpX)
        y = tXrY.load().to(Float32)
        dy = tXrDy.load().to(Float32)
        if const_expr(cfg.cluster_n > 1):
            cute.arch.cluster_wait()
        dot = (y * dy).reduce(cute.ReductionOp.ADD, Float32(0.0), reduction_profile=0)
        dot = rowwise.row_reduce(dot, "sum", sRed[None, None, 0], cfg.threads_per_row, cfg.cluster_n)
        dx = y * (dy - dot)
        tXrDx = cute.make_rmem_tensor_like(tXgDx)
        tXrDx.store(dx.to(mDx.element_type))
        rowwise.store_row(rowwise.vector_atom(mDx.element_type, cfg), tXrDx, tXgDx, tXpX)
