"""Softmax forward and backward kernels (CuTe DSL, sm_90a).

Forward, per row:  y = exp(x - max(x)) / sum(exp(x - max(x))).
Each CTA owns ``rows_per_cta`` rows (or, in a cluster, one slice of a row) and
reads its slice once; masked columns read as -inf so they add nothing.  The
row max and the sum of exponentials come from one exchange of (max, sum)
pairs: a row in registers keeps its exponentials and rescales them once
(``rowwise.row_max_and_exp``); a row staged in shared memory (clusters) keeps
a running pair per thread and recomputes exp(x - max) on the way out
(``rowwise.staged_max_and_sum``).

Backward, per row:  dx = y * (dy - sum(y * dy)); one row reduction.

Thread mapping, cluster sizes and the reduction are described in
``quack/rowwise/device.py``.  Constraints: N <= 262144, fp32/fp16/bf16; odd N with
16-bit data uses element copies (correct, slower).  Tests:
tests/test_softmax.py; benchmark: ``python tools/bench/softmax.py``.
"""

from __future__ import annotations

import math

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, const_expr

from quack.rowwise import device as rowwise
from quack.rowwise.device import RowConfig



class SoftmaxForward(rowwise.RowKernel):
    """y = softmax(x) over each row."""

    @cute.jit
    def __call__(self, x: cute.Tensor, out: cute.Tensor, stream: cuda.CUstream):
        copy = rowwise.make_row_copy(x.element_type, self.cfg)
        rowwise.launch_rows(
            self.kernel(x, out, copy), self.cfg, x.shape[0], stream,
            staged=rowwise.stages_row(self.cfg, x.element_type),
        )

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mY: cute.Tensor, copy: cute.TiledCopy):
        cfg = self.cfg
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        # Stage 0: the max; stage 1: the sum.
        rank, smem, sRed, mbar = rowwise.start_row_cta(cfg, stages=2)
        m, n = mX.shape[0], mX.shape[1]
        gX, gY, gC = rowwise.row_tiles(cfg, bidx, rank, mX, mY, cute.make_identity_tensor((m, n)))
        # gX: (rows_per_cta, cols_per_cta) tile of this CTA
        thr = copy.get_slice(tidx)
        tXgX, tXgY, tXcX = thr.partition_S(gX), thr.partition_D(gY), thr.partition_S(gC)
        # tXgX: ((vec), 1, vecs_per_thread) per thread
        tXpX = rowwise.copy_predicate(tXcX, m, n, not cfg.covers_n_exactly)

        tXrY = cute.make_rmem_tensor_like(tXgY)
        atom_y = rowwise.vector_atom(mY.element_type, cfg)
        if const_expr(rowwise.stages_row(cfg, mX.element_type)):
            # A row split over a cluster: staged in shared memory, read back a
            # vector at a time for the statistics and again for the output.
            tXsX = rowwise.stage_row(smem, cfg, thr, tXgX, tXpX)
            valid = rowwise.column_mask(tXcX, n) if const_expr(not cfg.covers_n_exactly) else None
            rowwise.slice_ready(cfg, True)
            row_max, denom = rowwise.staged_max_and_sum(
                tXsX, valid, cfg, sRed[None, None, 0], sRed[None, None, 1], mbar
            )
            scale = cute.arch.rcp_approx(denom)
            for v in cutlass.range_constexpr(cfg.vecs_per_thread):
                x = rowwise.slice_vector(tXsX, valid, v, -math.inf)
                y = rowwise.exp_shifted(x, row_max, rowwise.fuses_exp(mX.element_type)) * scale
                tXrY[None, None, v].store(y.to(mY.element_type))
                cute.copy(atom_y, tXrY[None, None, v], tXgY[None, None, v], pred=tXpX[None, None, v])
        else:
            tXrX = cute.make_rmem_tensor_like(tXgX)
            rowwise.load_row_filled(
                rowwise.vector_atom(mX.element_type, cfg), tXgX, tXrX, tXpX, -math.inf
            )
            if const_expr(cfg.cluster_n > 1):
                cute.arch.cluster_wait()
            _, denom, p = rowwise.row_max_and_exp(
                tXrX.load().to(Float32), sRed[None, None, 0], sRed[None, None, 1], cfg.threads_per_row,
                cfg.cluster_n, mbar, rowwise.fuses_exp(mX.element_type),
            )
            tXrY.store((p * cute.arch.rcp_approx(denom)).to(mY.element_type))
            rowwise.store_row(atom_y, tXrY, tXgY, tXpX)


class SoftmaxBackward(rowwise.RowKernel):
    """dx = y * (dy - sum(y * dy)) over each row."""

    @cute.jit
    def __call__(self, y: cute.Tensor, dy: cute.Tensor, dx: cute.Tensor, stream: cuda.CUstream):
        copy = rowwise.make_row_copy(y.element_type, self.cfg)
        rowwise.launch_rows(
            self.kernel(y, dy, dx, copy), self.cfg, y.shape[0], stream,
            staged=_stages_backward(self.cfg, y.element_type),
        )

    @cute.kernel
    def kernel(self, mY: cute.Tensor, mDy: cute.Tensor, mDx: cute.Tensor, copy: cute.TiledCopy):
        cfg = self.cfg
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        rank, smem, sRed, mbar = rowwise.start_row_cta(cfg)
        m, n = mY.shape[0], mY.shape[1]
        gY, gDy, gDx, gC = rowwise.row_tiles(cfg, bidx, rank, mY, mDy, mDx, cute.make_identity_tensor((m, n)))
        # gY: (rows_per_cta, cols_per_cta) tile of this CTA
        thr = copy.get_slice(tidx)
        tXgY, tXgDy, tXgDx = thr.partition_S(gY), thr.partition_S(gDy), thr.partition_D(gDx)
        tXcX = thr.partition_S(gC)
        # tXgY: ((vec), 1, vecs_per_thread) per thread
        tXpX = rowwise.copy_predicate(tXcX, m, n, not cfg.covers_n_exactly)

        # y, dy and dx share one dtype.
        staged = const_expr(_stages_backward(cfg, mY.element_type))
        tXsY = rowwise.load_slice(smem, cfg, thr, tXgY, tXpX, staged)
        tXsDy = rowwise.load_slice(smem, cfg, thr, tXgDy, tXpX, staged)
        valid = rowwise.column_mask(tXcX, n) if const_expr(not cfg.covers_n_exactly) else None
        rowwise.slice_ready(cfg, staged)
        dot = Float32(0.0)
        parts = rowwise.slice_parts(cfg, staged)
        for v in parts:
            y_dy = rowwise.slice_vector(tXsY, valid, v) * rowwise.slice_vector(tXsDy, valid, v)
            dot += y_dy.reduce(cute.ReductionOp.ADD, Float32(0.0), reduction_profile=0)
        dot = rowwise.row_reduce(dot, "sum", sRed[None, None, 0], cfg.threads_per_row, cfg.cluster_n, mbar)
        tXrDx = cute.make_rmem_tensor_like(tXgDx)
        st = rowwise.vector_atom(mDx.element_type, cfg)
        for v in parts:
            y = rowwise.slice_vector(tXsY, None, v)
            rowwise.part(tXrDx, v).store((y * (rowwise.slice_vector(tXsDy, None, v) - dot)).to(mDx.element_type))
            cute.copy(st, rowwise.part(tXrDx, v), rowwise.part(tXgDx, v), pred=rowwise.part(tXpX, v))


def _stages_backward(cfg: RowConfig, dtype) -> bool:
    """The backward stages y and dy in shared memory only where holding them
    in registers would need 512-thread CTAs, of which one fits per SM; at
    smaller CTAs registers are faster than staging."""
    return cfg.threads > 256 and rowwise.stages_row(cfg, dtype)
