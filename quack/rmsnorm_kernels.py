"""RMSNorm forward and backward kernels (CuTe DSL, sm_90a).

Forward, per row of h = x (+ residual):  y = h * rsqrt(mean(h^2) + eps) * w.
Each CTA owns ``rows_per_cta`` rows (or, in a cluster, one slice of a row),
reads its slice once (16-byte vector loads where N and the pointers allow,
element loads for odd N), into registers or (clusters) shared memory, walking
it in ``rowwise.slice_parts``, reduces the sum of squares through
``rowwise.row_reduce`` and writes y, h (when a residual is given) and rstd.

Backward, per row:  x̂ = h * rstd,  wdy = dy * w,  c = mean(x̂ * wdy),
dh = (wdy - x̂ * c) * rstd (+ the gradient arriving at the h output).
The backward grid is persistent: each CTA (cluster) strides over row tiles and
accumulates dw += dy * x̂ in fp32 registers, writing one partial row per
thread row at the end; the op sums the partials.

Thread mapping, cluster sizes and the reduction are described in
``quack/rowwise.py``.  Tests: tests/test_rmsnorm.py; benchmark:
``python tools/bench/rmsnorm.py``.
"""

from __future__ import annotations

from typing import Optional

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from quack import rowwise
from quack.rowwise import RowConfig


class RMSNormForward:
    """y = rmsnorm(x + residual) * w; also writes x + residual and rstd when given."""

    def __init__(self, cfg: RowConfig):
        self.cfg = cfg

    @cute.jit
    def __call__(
        self,
        mX: cute.Tensor,
        mW: Optional[cute.Tensor],
        mRes: Optional[cute.Tensor],
        mY: cute.Tensor,
        mResOut: Optional[cute.Tensor],
        mRstd: Optional[cute.Tensor],
        eps: Float32,
        stream: cuda.CUstream,
    ):
        cfg = self.cfg
        copy = rowwise.make_row_copy(mX.element_type, cfg)
        rowwise.launch_rows(
            self.kernel(mX, mW, mRes, mY, mResOut, mRstd, eps, copy), cfg, mX.shape[0], stream,
            staged=rowwise.stages_row(cfg, *_row_dtypes(mX, mRes)),
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
            h = _sum_vector(tXsX, tXsRes, valid, v)
            if const_expr(mRes is not None):
                rowwise.part(tXrResOut, v).store(h.to(mResOut.element_type))
                cute.copy(st_res, rowwise.part(tXrResOut, v), rowwise.part(tXgResOut, v), pred=rowwise.part(tXpX, v))
            sum_sq += (h * h).reduce(cute.ReductionOp.ADD, Float32(0.0), reduction_profile=0)
        sum_sq = rowwise.row_reduce(sum_sq, "sum", sRed[None, None, 0], cfg.threads_per_row, cfg.cluster_n, mbar)
        rstd = cute.math.rsqrt(sum_sq / cfg.n + eps, fastmath=True)
        if const_expr(mRstd is not None):
            if tXcX[0][1] == 0 and in_rows:
                mRstd[row] = rstd

        weight = rowwise.broadcast_param(cfg, thr, mW, rank, tXpX)
        tXrY = cute.make_rmem_tensor_like(tXgY)
        st = rowwise.vector_atom(mY.element_type, cfg)
        for group in rowwise.param_groups(cfg, staged):
            normed = {v: _sum_vector(tXsX, tXsRes, valid, v) * rstd for v in group}
            w = rowwise.param_vectors(weight, group)
            for v in group:
                y = rowwise.scale_shift(normed[v], w[v], None)
                rowwise.part(tXrY, v).store(y.to(mY.element_type))
                cute.copy(st, rowwise.part(tXrY, v), rowwise.part(tXgY, v), pred=rowwise.part(tXpX, v))


def _row_dtypes(mX, mRes):
    """Element types of the (M, N) inputs of the forward."""
    return (mX.element_type,) if mRes is None else (mX.element_type, mRes.element_type)


def _sum_vector(tXsX, tXsRes, valid, v):
    """``rowwise.part`` v of h = x (+ residual) in fp32, zero in padded columns."""
    h = rowwise.slice_vector(tXsX, valid, v)
    if const_expr(tXsRes is not None):
        h = h + rowwise.slice_vector(tXsRes, valid, v)
    return h


class RMSNormBackward:
    """dh = (dy*w - x̂ * mean(x̂ * dy*w)) * rstd (+ dh_out); partial dw rows."""

    def __init__(self, cfg: RowConfig):
        self.cfg = cfg
        # Load the next row tile during this one's reduction.  It pays off when
        # the reduction waits on a cluster barrier (measured on the H200: 64 ->
        # 71% of copy at N=16K, 51 -> 60% at 64K), and costs occupancy (80 -> 75%
        # at N=4K) or spills (512-thread CTAs) elsewhere.
        self.prefetch = cfg.cluster_n > 1 and cfg.threads <= 256
        # The dw accumulator: in shared memory it frees registers for more
        # resident CTAs (N=4K: 80 -> 84% of copy; N=256K: no spills, 43 ->
        # 50%); with prefetch the registers go to the next tile anyway and the
        # extra shared-memory traffic costs (N=16K: 71 -> 61%).
        self.dw_in_smem = not self.prefetch

    @cute.jit
    def __call__(
        self,
        mX: cute.Tensor,
        mW: Optional[cute.Tensor],
        mDy: cute.Tensor,
        mDhOut: Optional[cute.Tensor],
        mRstd: cute.Tensor,
        mDx: cute.Tensor,
        mDwPartial: Optional[cute.Tensor],
        num_ctas: Int32,
        stream: cuda.CUstream,
    ):
        cfg = self.cfg
        copy = rowwise.make_row_copy(mX.element_type, cfg)
        self.kernel(mX, mW, mDy, mDhOut, mRstd, mDx, mDwPartial, copy).launch(
            grid=[num_ctas, cfg.cluster_n, 1],
            block=[cfg.threads, 1, 1],
            cluster=[1, cfg.cluster_n, 1] if const_expr(cfg.cluster_n > 1) else None,
            stream=stream,
        )

    @cute.kernel
    def kernel(
        self,
        mX: cute.Tensor,
        mW: Optional[cute.Tensor],
        mDy: cute.Tensor,
        mDhOut: Optional[cute.Tensor],
        mRstd: cute.Tensor,
        mDx: cute.Tensor,
        mDwPartial: Optional[cute.Tensor],
        copy: cute.TiledCopy,
    ):
        cfg = self.cfg
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        num_ctas, _, _ = cute.arch.grid_dim()
        # Two stages: consecutive row tiles alternate, see rowwise.row_reduce.
        rank, smem, sRed, mbar = rowwise.start_row_cta(cfg, stages=2, exchange_sets=2)
        m, n = mX.shape[0], mX.shape[1]
        thr = copy.get_slice(tidx)
        check_cols = not cfg.covers_n_exactly
        atom_x = rowwise.vector_atom(mX.element_type, cfg)
        atom_dy = rowwise.vector_atom(mDy.element_type, cfg)
        atom_dx = rowwise.vector_atom(mDx.element_type, cfg)

        tWcW, weight = rowwise.weight_slice(cfg, thr, mW, m, n, rank)

        tXaDw = None  # the dw accumulator, this thread's slots
        if const_expr(mDwPartial is not None):
            if const_expr(self.dw_in_smem):
                # Each thread only touches its own slots: no barrier needed.
                sDw = smem.allocate_tensor(
                    Float32, cute.make_ordered_layout(cfg.tiler, order=(1, 0)), byte_alignment=16
                )
                tXaDw = thr.partition_D(sDw)
            else:
                tXaDw = cute.make_rmem_tensor(tWcW.shape, Float32)
            tXaDw.fill(0.0)

        if const_expr(cfg.cluster_n > 1):
            cute.arch.cluster_wait()
        num_tiles = cute.ceil_div(m, cfg.rows_per_cta)

        # With prefetch (a software pipeline), the next tile's x and dy are
        # loaded into a second pair of fragments before this tile's row
        # reduction, so they are in flight while the CTA waits at the (cluster)
        # barrier.  A tile past the end loads nothing: its rows fail the row
        # predicate.
        tXgX, tXgDy, _, tXpX = rowwise.row_slices(cfg, thr, bidx, rank, mX, mDy)
        tXrX, tXrDy = cute.make_rmem_tensor_like(tXgX), cute.make_rmem_tensor_like(tXgDy)
        if const_expr(self.prefetch):
            tXrXn, tXrDyn = cute.make_rmem_tensor_like(tXgX), cute.make_rmem_tensor_like(tXgDy)
            rowwise.load_row(atom_x, tXgX, tXrX, tXpX)
            rowwise.load_row(atom_dy, tXgDy, tXrDy, tXpX)
        for tile in cutlass.range(bidx, num_tiles, num_ctas):
            tXgX, tXgDy, tXcX, tXpX = rowwise.row_slices(cfg, thr, tile, rank, mX, mDy)
            if const_expr(not self.prefetch):
                rowwise.load_row(atom_x, tXgX, tXrX, tXpX)
                rowwise.load_row(atom_dy, tXgDy, tXrDy, tXpX)
            row = tXcX[0][0]
            rstd = Float32(0.0)
            if row < m:
                rstd = mRstd[row]
            x_hat = tXrX.load().to(Float32) * rstd
            dy = tXrDy.load().to(Float32)
            wdy = rowwise.times_weight(weight, dy)
            dot = (x_hat * wdy).reduce(cute.ReductionOp.ADD, Float32(0.0), reduction_profile=0)

            if const_expr(self.prefetch):
                tXgXn, tXgDyn, _, tXpXn = rowwise.row_slices(cfg, thr, tile + num_ctas, rank, mX, mDy)
                rowwise.load_row(atom_x, tXgXn, tXrXn, tXpXn)
                rowwise.load_row(atom_dy, tXgDyn, tXrDyn, tXpXn)

            turn, turn_mbar, phase = rowwise.exchange_turn(tile, bidx, num_ctas, mbar)
            dot = rowwise.row_reduce(
                dot, "sum", sRed[None, None, turn], cfg.threads_per_row, cfg.cluster_n, turn_mbar, phase
            )
            dx = (wdy - x_hat * (dot / cfg.n)) * rstd
            gDhOut, gDx = rowwise.row_tiles(cfg, tile, rank, mDhOut, mDx)
            if const_expr(mDhOut is not None):
                tXgDhOut = thr.partition_S(gDhOut)
                tXrDhOut = cute.make_rmem_tensor_like(tXgDhOut)
                rowwise.load_row(rowwise.vector_atom(mDhOut.element_type, cfg), tXgDhOut, tXrDhOut, tXpX)
                dx = dx + tXrDhOut.load().to(Float32)
            tXgDx = thr.partition_D(gDx)
            tXrDx = cute.make_rmem_tensor_like(tXgDx)
            tXrDx.store(dx.to(mDx.element_type))
            rowwise.store_row(atom_dx, tXrDx, tXgDx, tXpX)
            if const_expr(mDwPartial is not None):
                tXaDw.store(tXaDw.load() + dy * x_hat)
            if const_expr(self.prefetch):
                tXrX.store(tXrXn.load())
                tXrDy.store(tXrDyn.load())

        if const_expr(mDwPartial is not None):
            # Partial row (bidx * rows_per_cta + row in CTA) of the (grid * rows, N) buffer.
            gDw = cute.local_tile(mDwPartial, cfg.tiler, (bidx, rank))
            tXgDw = thr.partition_D(gDw)
            cDw = cute.local_tile(
                cute.make_identity_tensor(mDwPartial.shape), cfg.tiler, (bidx, rank)
            )
            tXpDw = rowwise.copy_predicate(
                thr.partition_S(cDw), mDwPartial.shape[0], n, check_cols
            )
            tXrDw = tXaDw
            if const_expr(self.dw_in_smem):
                tXrDw = cute.make_rmem_tensor_like(tXaDw)
                tXrDw.store(tXaDw.load())
            rowwise.store_row(rowwise.vector_atom(Float32, cfg), tXrDw, tXgDw, tXpDw)
