"""RMSNorm forward kernel (CuTe DSL, sm_90a).

Forward, per row of h = x (+ residual):  y = h * rsqrt(mean(h^2) + eps) * w.
Each CTA owns ``rows_per_cta`` rows (or, in a cluster, one slice of a row),
reads its slice once (16-byte vector loads where N and the pointers allow,
element loads for odd N), into registers or (clusters) shared memory, walking
it in ``rowwise.slice_parts``, reduces the sum of squares through
``rowwise.row_reduce`` and writes y, h (when a residual is given) and rstd.

The backward (dh, partial dw rows) is quack/rowwise/norm_backward.py's persistent
kernel, shared with LayerNorm.

Thread mapping, cluster sizes and the reduction are described in
``quack/rowwise/device.py``.  Tests: tests/test_rmsnorm.py; benchmark:
``python tools/bench/rmsnorm.py``.
"""

from __future__ import annotations

from typing import Optional

import cuda.bindings.driver as cuda
import cutlass.cute as cute
from cutlass import Float32, const_expr

from quack.rowwise import device as rowwise


class RMSNormForward(rowwise.RowKernel):
    """y = rmsnorm(x + residual) * w; also writes x + residual and rstd when given."""

    @cute.jit
    def __call__(
        self,
        x: cute.Tensor,
        weight: Optional[cute.Tensor],
        residual: Optional[cute.Tensor],
        out: cute.Tensor,
        residual_out: Optional[cute.Tensor],
        rstd: Optional[cute.Tensor],
        eps: Float32,
        stream: cuda.CUstream,
    ):
        cfg = self.cfg
        copy = rowwise.make_row_copy(x.element_type, cfg)
        rowwise.launch_rows(
            self.kernel(x, weight, residual, out, residual_out, rstd, eps, copy), cfg, x.shape[0], stream,
            staged=rowwise.stages_row(cfg, *_row_dtypes(x, residual)),
        )

    @cute.kernel
    def kernel(
        self,
        mX: cute.Tensor,
        mW: Optional[cute.Tensor],
        mRes: Optional[cute.Tensor],
        mY: cute.Tensor,
        mResOut: Optional[cute.Tensor],
        mRstd: Optional[cute.Tensor],
        eps: Float32,
        copy: cute.TiledCopy,
    ):
        cfg = self.cfg
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        rank, smem, sRed, mbar = rowwise.start_row_cta(cfg)

        m, n = mX.shape[0], mX.shape[1]
        cX = cute.make_identity_tensor((m, n))
        gX, gRes, gY, gResOut, gC = rowwise.row_tiles(cfg, bidx, rank, mX, mRes, mY, mResOut, cX)
        # gX: (rows_per_cta, cols_per_cta) tile of this CTA
        thr = copy.get_slice(tidx)
        tXgX, tXgY = thr.partition_S(gX), thr.partition_D(gY)
        tXcX = thr.partition_S(gC)
        # tXgX: ((vec), 1, vecs_per_thread) per thread
        row = tXcX[0][0]
        in_rows = row < m
        tXpX = rowwise.copy_predicate(tXcX, m, n, not cfg.covers_n_exactly)
        staged = const_expr(rowwise.stages_row(cfg, *_row_dtypes(mX, mRes)))
        tXsX = rowwise.load_slice(smem, cfg, thr, tXgX, tXpX, staged)
        tXsRes = None
        if const_expr(mRes is not None):
            tXsRes = rowwise.load_slice(smem, cfg, thr, thr.partition_S(gRes), tXpX, staged)
            tXgResOut = thr.partition_D(gResOut)
            tXrResOut = cute.make_rmem_tensor_like(tXgResOut)
            st_res = rowwise.vector_atom(mResOut.element_type, cfg)
        valid = rowwise.column_mask(tXcX, n) if const_expr(not cfg.covers_n_exactly) else None
        parts = rowwise.slice_parts(cfg, staged)
        rowwise.slice_ready(cfg, staged)

        sum_sq = Float32(0.0)
        for v in parts:
            h = _sum_vector(tXsX, tXsRes, valid, v, mX.element_type)
            if const_expr(mRes is not None):
                rowwise.part(tXrResOut, v).store(h.to(mResOut.element_type))
                cute.copy(st_res, rowwise.part(tXrResOut, v), rowwise.part(tXgResOut, v), pred=rowwise.part(tXpX, v))
            sum_sq += (h * h).reduce(cute.ReductionOp.ADD, Float32(0.0), reduction_profile=0)
        sum_sq = rowwise.row_reduce(sum_sq, "sum", sRed[None, None, 0], cfg.threads_per_row, cfg.cluster_n, mbar)
        if const_expr(cfg.n == 1):
            # The backward's dx at N = 1 is eps * rstd^3 (quack/rowwise/norm_backward.py):
            # its error is three times rstd's, so round rstd once here (IEEE
            # sqrt and divide, where rsqrt.approx errs up to two units).
            rstd = Float32(1.0) / cute.math.sqrt(sum_sq + eps)
        else:
            rstd = cute.math.rsqrt(sum_sq / cfg.n + eps, fastmath=True)
        if const_expr(mRstd is not None):
            if tXcX[0][1] == 0 and in_rows:
                mRstd[row] = rstd

        weight = rowwise.broadcast_param(cfg, thr, mW, rank, tXpX)
        tXrY = cute.make_rmem_tensor_like(tXgY)
        st = rowwise.vector_atom(mY.element_type, cfg)
        for group in rowwise.param_groups(cfg, staged):
            normed = {v: _sum_vector(tXsX, tXsRes, valid, v, mX.element_type) * rstd for v in group}
            w = rowwise.param_vectors(weight, group)
            for v in group:
                y = rowwise.scale_shift(normed[v], w[v], None)
                rowwise.part(tXrY, v).store(y.to(mY.element_type))
                cute.copy(st, rowwise.part(tXrY, v), rowwise.part(tXgY, v), pred=rowwise.part(tXpX, v))


def _row_dtypes(mX, mRes):
    """Element types of the (M, N) inputs of the forward."""
    return (mX.element_type,) if mRes is None else (mX.element_type, mRes.element_type)


def _sum_vector(tXsX, tXsRes, valid, v, dtype):
    """``rowwise.part`` v of h = x (+ residual) in fp32, zero in padded columns.
    The sum is rounded to x's dtype first: the statistics and y are those of
    the h that is stored and that the backward reads (as torch's pre-norm
    sum in that dtype), not of an fp32 sum the backward never sees (at N = 1
    a 16-bit x with a residual gave dw 0.2% off: x̂ = h_bf16 * rstd(h_fp32))."""
    h = rowwise.slice_vector(tXsX, valid, v)
    if const_expr(tXsRes is not None):
        h = h + rowwise.slice_vector(tXsRes, valid, v)
        if const_expr(dtype.width < 32):
            h = h.to(dtype).to(Float32)
    return h
