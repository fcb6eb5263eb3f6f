"""LayerNorm forward and backward kernels (CuTe DSL, sm_90a).

Forward, per row:  mean = sum(x) / N,  xc = x - mean,
rstd = rsqrt(sum(xc^2) / N + eps),  y = xc * rstd * w + b.
Each CTA owns ``rows_per_cta`` rows (or, in a cluster, one slice of a row) and
reads its slice once, into registers or (clusters) shared memory, walking it
in ``rowwise.slice_parts``.  Each thread takes the count, sum and
squared deviations of its values from their own mean; those triples are
merged over the row in one exchange (Chan et al.'s pairwise update), so the
variance stays accurate for rows with a large mean without a second row
reduction.  Padded columns are zeroed after centring.  Writes y and, for a
backward pass, mean and rstd (fp32).

Backward, per row:  x̂ = (x - mean) * rstd,  wdy = dy * w,
c1 = mean(x̂ * wdy),  c2 = mean(wdy),  dx = (wdy - c2 - x̂ * c1) * rstd.
The grid is persistent, as in the RMSNorm backward: each CTA (cluster) strides
over row tiles, accumulates dw += dy * x̂ and db += dy in fp32 registers and
writes one partial row of each per thread row at the end; the op sums them.
c1 and c2 go through one exchange (``rowwise.row_merge``).

Thread mapping, cluster sizes and the reduction are described in
``quack/rowwise.py``.  Tests: tests/test_layernorm.py; benchmark:
``python tools/bench/layernorm.py``.
"""

from __future__ import annotations

from typing import Optional

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from quack import rowwise
from quack.rowwise import RowConfig


def _masked(values, valid):
    """Zero the padded columns (``valid`` is None when there are none)."""
    if const_expr(valid is None):
        return values
    return cute.where(valid, values, Float32(0.0))


def _centred(tXsX, valid, v, mean):
    """``rowwise.part`` v of a slice minus ``mean``, zero in padded columns."""
    return _masked(rowwise.slice_vector(tXsX, None, v) - mean, None if valid is None else rowwise.part(valid, v).load())


def _inverse(count):
    """1 / count, and 0 for an empty part (whose sums are 0 too)."""
    return cute.arch.rcp_approx(cutlass.max(count, Float32(1.0)))


def _merge_moments(a, b):
    """(count, sum, squared deviations from the mean) of two disjoint parts."""
    count = a[0] + b[0]
    delta = b[1] * _inverse(b[0]) - a[1] * _inverse(a[0])
    return count, a[1] + b[1], a[2] + b[2] + delta * delta * (a[0] * b[0] * _inverse(count))


class LayerNormForward:
    """y = (x - mean) * rstd * w + b; also writes mean and rstd when given."""

    def __init__(self, cfg: RowConfig):
        self.cfg = cfg

    @cute.jit
    def __call__(
        self,
        mX: cute.Tensor,
        mW: Optional[cute.Tensor],
        mB: Optional[cute.Tensor],
        mY: cute.Tensor,
        mMean: Optional[cute.Tensor],
        mRstd: Optional[cute.Tensor],
        eps: Float32,
        stream: cuda.CUstream,
    ):
        cfg = self.cfg
        copy = rowwise.make_row_copy(mX.element_type, cfg)
        rowwise.launch_rows(
            self.kernel(mX, mW, mB, mY, mMean, mRstd, eps, copy), cfg, mX.shape[0], stream,
            staged=rowwise.stages_row(cfg, mX.element_type),
        )

    @cute.kernel
    def kernel(
        self,
        mX: cute.Tensor,
        mW: Optional[cute.Tensor],
        mB: Optional[cute.Tensor],
        mY: cute.Tensor,
        mMean: Optional[cute.Tensor],
        mRstd: Optional[cute.Tensor],
        eps: Float32,
        copy: cute.TiledCopy,
    ):
        cfg = self.cfg
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        # Stages: count, sum and squared deviations of each part of the row.
        rank, smem, sRed, mbar = rowwise.start_row_cta(cfg, stages=3)
        m, n = mX.shape[0], mX.shape[1]
        gX, gY, gC = rowwise.row_tiles(cfg, bidx, rank, mX, mY, cute.make_identity_tensor((m, n)))
        # gX: (rows_per_cta, cols_per_cta) tile of this CTA
        thr = copy.get_slice(tidx)
        tXgX, tXgY, tXcX = thr.partition_S(gX), thr.partition_D(gY), thr.partition_S(gC)
        # tXgX: ((vec), 1, vecs_per_thread) per thread
        row = tXcX[0][0]
        tXpX = rowwise.copy_predicate(tXcX, m, n, not cfg.covers_n_exactly)

        staged = const_expr(rowwise.stages_row(cfg, mX.element_type))
        tXsX = rowwise.load_slice(smem, cfg, thr, tXgX, tXpX, staged)
        valid = rowwise.column_mask(tXcX, n) if const_expr(not cfg.covers_n_exactly) else None
        parts = rowwise.slice_parts(cfg, staged)
        rowwise.slice_ready(cfg, staged)
        # Count, sum and squared deviations from this thread's own mean, merged
        # over the row in one exchange (Chan et al.'s pairwise update).
        count = Float32(cute.size(tXsX))
        if const_expr(valid is not None):
            count = valid.load().to(Float32).reduce(cute.ReductionOp.ADD, Float32(0.0), reduction_profile=0)
        total = Float32(0.0)
        for v in parts:
            total += rowwise.slice_vector(tXsX, valid, v).reduce(cute.ReductionOp.ADD, Float32(0.0), reduction_profile=0)
        own_mean = total * _inverse(count)
        sq = Float32(0.0)
        for v in parts:
            dev = _centred(tXsX, valid, v, own_mean)
            sq += (dev * dev).reduce(cute.ReductionOp.ADD, Float32(0.0), reduction_profile=0)
        _, total, sq = rowwise.row_merge(
            (count, total, sq), (sRed[None, None, 0], sRed[None, None, 1], sRed[None, None, 2]), _merge_moments,
            (Float32(0.0), Float32(0.0), Float32(0.0)), cfg.threads_per_row, cfg.cluster_n, mbar,
        )
        mean = total / cfg.n
        rstd = cute.math.rsqrt(sq / cfg.n + eps, fastmath=True)
        if tXcX[0][1] == 0 and row < m:
            if const_expr(mMean is not None):
                mMean[row] = mean
            if const_expr(mRstd is not None):
                mRstd[row] = rstd

        weight = rowwise.broadcast_param(cfg, thr, mW, rank, tXpX)
        bias = rowwise.broadcast_param(cfg, thr, mB, rank, tXpX)
        tXrY = cute.make_rmem_tensor_like(tXgY)
        st = rowwise.vector_atom(mY.element_type, cfg)
        for group in rowwise.param_groups(cfg, staged):
            normed = {v: _centred(tXsX, valid, v, mean) * rstd for v in group}
            w, b = rowwise.param_vectors(weight, group), rowwise.param_vectors(bias, group)
            for v in group:
                y = rowwise.scale_shift(normed[v], w[v], b[v])
                rowwise.part(tXrY, v).store(y.to(mY.element_type))
                cute.copy(st, rowwise.part(tXrY, v), rowwise.part(tXgY, v), pred=rowwise.part(tXpX, v))


class LayerNormBackward:
    """dx = (dy*w - mean(dy*w) - x̂ * mean(x̂ * dy*w)) * rstd; dw and db partial rows."""

    def __init__(self, cfg: RowConfig):
        self.cfg = cfg
        # Load the next row tile during this one's reductions, where they wait
        # on a cluster barrier (the RMSNorm backward's measured rule).
        self.prefetch = cfg.cluster_n > 1 and cfg.threads <= 256

    @cute.jit
    def __call__(
        self,
        mX: cute.Tensor,
        mW: Optional[cute.Tensor],
        mDy: cute.Tensor,
        mMean: cute.Tensor,
        mRstd: cute.Tensor,
        mDx: cute.Tensor,
        mDwPartial: Optional[cute.Tensor],
        mDbPartial: Optional[cute.Tensor],
        num_ctas: Int32,
        stream: cuda.CUstream,
    ):
        cfg = self.cfg
        copy = rowwise.make_row_copy(mX.element_type, cfg)
        self.kernel(mX, mW, mDy, mMean, mRstd, mDx, mDwPartial, mDbPartial, copy).launch(
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
        mMean: cute.Tensor,
        mRstd: cute.Tensor,
        mDx: cute.Tensor,
        mDwPartial: Optional[cute.Tensor],
        mDbPartial: Optional[cute.Tensor],
        copy: cute.TiledCopy,
    ):
        cfg = self.cfg
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        num_ctas, _, _ = cute.arch.grid_dim()
        # c1 and c2 of a tile go through one exchange, in stages (0, 1) or
        # (2, 3): consecutive tiles alternate, see rowwise.row_merge.
        rank, smem, sRed, mbar = rowwise.start_row_cta(cfg, stages=4, exchange_sets=2)
        m, n = mX.shape[0], mX.shape[1]
        thr = copy.get_slice(tidx)
        check_cols = not cfg.covers_n_exactly
        atom_x = rowwise.vector_atom(mX.element_type, cfg)
        atom_dy = rowwise.vector_atom(mDy.element_type, cfg)
        atom_dx = rowwise.vector_atom(mDx.element_type, cfg)

        tWcW, weight = rowwise.weight_slice(cfg, thr, mW, m, n, rank)

        # The dw and db accumulators live in shared memory, each thread
        # owning the slots of its own values (no synchronisation): in
        # registers, beside x, dy and the weight, they spill at long rows.
        tXsDw = None
        if const_expr(mDwPartial is not None):
            tXsDw = _accumulator(cfg, smem, thr)
        tXsDb = None
        if const_expr(mDbPartial is not None):
            tXsDb = _accumulator(cfg, smem, thr)

        if const_expr(cfg.cluster_n > 1):
            cute.arch.cluster_wait()
        num_tiles = cute.ceil_div(m, cfg.rows_per_cta)

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
            mean = Float32(0.0)
            rstd = Float32(0.0)
            if row < m:
                mean = mMean[row]
                rstd = mRstd[row]
            # Padded columns: x̂ is nonzero there but dy is zero, so they add
            # nothing to c1, c2, dw or db.
            x_hat = (tXrX.load().to(Float32) - mean) * rstd
            dy = tXrDy.load().to(Float32)
            wdy = rowwise.times_weight(weight, dy)
            c1 = (x_hat * wdy).reduce(cute.ReductionOp.ADD, Float32(0.0), reduction_profile=0)
            c2 = wdy.reduce(cute.ReductionOp.ADD, Float32(0.0), reduction_profile=0)

            if const_expr(self.prefetch):
                tXgXn, tXgDyn, _, tXpXn = rowwise.row_slices(cfg, thr, tile + num_ctas, rank, mX, mDy)
                rowwise.load_row(atom_x, tXgXn, tXrXn, tXpXn)
                rowwise.load_row(atom_dy, tXgDyn, tXrDyn, tXpXn)

            turn, turn_mbar, phase = rowwise.exchange_turn(tile, bidx, num_ctas, mbar)
            c1, c2 = rowwise.row_merge(
                (c1, c2), (sRed[None, None, 2 * turn], sRed[None, None, 2 * turn + 1]), rowwise.merge_sums,
                (Float32(0.0), Float32(0.0)), cfg.threads_per_row, cfg.cluster_n, turn_mbar, phase,
            )
            dx = (wdy - c2 / cfg.n - x_hat * (c1 / cfg.n)) * rstd
            (gDx,) = rowwise.row_tiles(cfg, tile, rank, mDx)
            tXgDx = thr.partition_D(gDx)
            tXrDx = cute.make_rmem_tensor_like(tXgDx)
            tXrDx.store(dx.to(mDx.element_type))
            rowwise.store_row(atom_dx, tXrDx, tXgDx, tXpX)
            if const_expr(mDwPartial is not None):
                tXsDw.store(tXsDw.load() + dy * x_hat)
            if const_expr(mDbPartial is not None):
                tXsDb.store(tXsDb.load() + dy)
            if const_expr(self.prefetch):
                tXrX.store(tXrXn.load())
                tXrDy.store(tXrDyn.load())

        if const_expr(mDwPartial is not None):
            _store_partial(cfg, thr, bidx, rank, mDwPartial, tXsDw, n, check_cols)
        if const_expr(mDbPartial is not None):
            _store_partial(cfg, thr, bidx, rank, mDbPartial, tXsDb, n, check_cols)


def _accumulator(cfg: RowConfig, smem, thr):
    """A zeroed fp32 (rows_per_cta, cols_per_cta) shared tile, partitioned
    like the thread's row values."""
    sAcc = smem.allocate_tensor(
        Float32, cute.make_ordered_layout(cfg.tiler, order=(1, 0)), byte_alignment=16
    )
    tXsAcc = thr.partition_D(sAcc)
    tXsAcc.fill(0.0)
    return tXsAcc


def _store_partial(cfg: RowConfig, thr, bidx, rank, mPartial, tXsAcc, n, check_cols: bool):
    """Write a CTA's fp32 accumulator to its partial rows (bidx * rows_per_cta
    + row in CTA) of the (grid * rows_per_cta, N) buffer."""
    acc = cute.make_rmem_tensor(tXsAcc.shape, Float32)
    acc.store(tXsAcc.load())
    gP, cP = rowwise.row_tiles(
        cfg, bidx, rank, mPartial, cute.make_identity_tensor(mPartial.shape)
    )
    pred = rowwise.copy_predicate(thr.partition_S(cP), mPartial.shape[0], n, check_cols)
    rowwise.store_row(rowwise.vector_atom(Float32, cfg), acc, thr.partition_D(gP), pred)
