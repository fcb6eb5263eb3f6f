"""Cross-entropy forward and backward kernels (CuTe DSL, sm_90a).

Forward, per row of logits x with target t:
    lse = max(x) + log(sum(exp(x - max(x)))),   loss = lse - x[t]
(0 when t is ``ignore_index``; NaN when t lies outside [0, N): that row never
reads x[t]).  The row is read once, into registers or (clusters) shared
memory, as in the softmax forward (max and sum of exponentials in one
exchange); the thread that
owns the row's first column also reads t and x[t] from global memory, before
the reductions so the loads overlap them, and writes loss and lse (fp32).

Backward, per element:  dx = (exp(x - lse) - [col == t]) * g_row,
with g_row the incoming gradient of the row's loss (already divided by the
count of counted rows for a mean), 0 for an ignored row and NaN for a row with
an out-of-range target.  No reduction: the grid is 2-D (row tiles x column
tiles), each CTA reads its tile of x once and writes dx; ``RowConfig.cluster_n``
is reused as the number of column tiles and no cluster is launched.

Reduction ("mean" or "sum", one launch): after its rows, each CTA takes a
ticket from a zeroed int32 counter; the CTA that takes the last ticket sums
every row's loss (and counts the rows whose target is not ignore_index) in a
fixed order, writes the result in the logits' dtype (sum / count for a mean:
NaN when every row is ignored, as torch gives), optionally (sum, count) in
fp32 for the backward, and zeroes the counter for the next launch on its
stream.  The order of the sum does not depend on which CTA ends last, so the
result is the same bits from run to run.

Thread mapping is described in ``quack/rowwise/device.py``.  Tests:
tests/test_cross_entropy.py; benchmark: ``python tools/bench/cross_entropy.py``.
"""

from __future__ import annotations

import math

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, const_expr

from quack.rowwise import device as rowwise
from quack.rowwise.device import RowConfig

LN_2 = math.log(2.0)


@cute.jit
def _read_target(mTarget: cute.Tensor, row: Int32, ignore_index: Int32, n: cutlass.Constexpr[int]):
    """(target as Int32, row's gradient/loss mode): mode 0 counted, 1 ignored,
    2 out of range.  An ignored or out-of-range row gets target -1, which
    matches no column."""
    t = Int64(mTarget[row])
    tgt = Int32(-1)
    mode = Int32(1)
    if t != Int64(ignore_index):
        mode = Int32(2)
        if t >= Int64(0):
            if t < Int64(n):
                mode = Int32(0)
                tgt = Int32(t)
    return tgt, mode


class CrossEntropyForward(rowwise.RowKernel):
    """loss[row] = logsumexp(x[row]) - x[row, target[row]]; also lse[row] given mLse (for a backward).
    ``reduction`` "mean" or "sum" also writes the reduced loss to mOut (and,
    given mStats, the fp32 sum and count); None writes the rows only."""

    def __init__(self, cfg: RowConfig, reduction=None):
        super().__init__(cfg)
        self.reduction = reduction

    @cute.jit
    def __call__(
        self,
        logits: cute.Tensor,
        target: cute.Tensor,
        loss: cute.Tensor,
        lse,
        out,
        stats,
        counter,
        ignore_index: Int32,
        stream: cuda.CUstream,
    ):
        cfg = self.cfg
        copy = rowwise.make_row_copy(logits.element_type, cfg)
        rowwise.launch_rows(
            self.kernel(logits, target, loss, lse, out, stats, counter, ignore_index, copy), cfg, logits.shape[0],
            stream, staged=rowwise.stages_row(cfg, logits.element_type),
        )

    # The DSL needs each kernel's parameters spelled out: __call__'s, in CuTe's names.
    @cute.kernel
    def kernel(
        self,
        mX: cute.Tensor,
        mTarget: cute.Tensor,
        mLoss: cute.Tensor,
        mLse,
        mOut,
        mStats,
        mCounter,
        ignore_index: Int32,
        copy: cute.TiledCopy,
    ):
        cfg = self.cfg
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        # Stage 0: the max; stage 1: the sum.
        rank, smem, sRed, mbar = rowwise.start_row_cta(cfg, stages=2)
        reducing = const_expr(self.reduction is not None)
        if const_expr(reducing):
            sLast = smem.allocate_tensor(Int32, cute.make_layout(1), byte_alignment=4)
            sTotals = smem.allocate_tensor(Float32, cute.make_layout(cfg.threads // 32), byte_alignment=4)
            sCounts = smem.allocate_tensor(Int32, cute.make_layout(cfg.threads // 32), byte_alignment=4)
        m, n = mX.shape[0], mX.shape[1]
        gX, gC = rowwise.row_tiles(cfg, bidx, rank, mX, cute.make_identity_tensor((m, n)))
        # gX: (rows_per_cta, cols_per_cta) tile of this CTA
        thr = copy.get_slice(tidx)
        tXgX, tXcX = thr.partition_S(gX), thr.partition_S(gC)
        # tXgX: ((vec), 1, vecs_per_thread) per thread
        tXpX = rowwise.copy_predicate(tXcX, m, n, not cfg.covers_n_exactly)
        staged = const_expr(rowwise.stages_row(cfg, mX.element_type))
        if const_expr(staged):
            # A row split over a cluster: staged in shared memory, as in the
            # softmax forward (registers hold one vector at a time).
            tXsX = rowwise.stage_row(smem, cfg, thr, tXgX, tXpX)
        else:
            tXrX = cute.make_rmem_tensor_like(tXgX)
            rowwise.load_row_filled(
                rowwise.vector_atom(mX.element_type, cfg), tXgX, tXrX, tXpX, -math.inf
            )

        # The owner of the row's column 0 (in cluster rank 0) reads the target
        # logit now, so its load overlaps the reductions.
        row = tXcX[0][0]
        owner = (tXcX[0][1] == 0) & (row < m)
        x_target = Float32(0.0)
        tgt = Int32(-1)
        mode = Int32(1)
        if owner:
            tgt, mode = _read_target(mTarget, row, ignore_index, cfg.n)
            if mode == 0:
                x_target = Float32(mX[row, tgt])

        if const_expr(staged):
            valid = rowwise.column_mask(tXcX, n) if const_expr(not cfg.covers_n_exactly) else None
            rowwise.slice_ready(cfg, True)
            row_max, denom = rowwise.staged_max_and_sum(
                tXsX, valid, cfg, sRed[None, None, 0], sRed[None, None, 1], mbar
            )
        else:
            if const_expr(cfg.cluster_n > 1):
                cute.arch.cluster_wait()
            row_max, denom, _ = rowwise.row_max_and_exp(
                tXrX.load().to(Float32), sRed[None, None, 0], sRed[None, None, 1], cfg.threads_per_row,
                cfg.cluster_n, mbar, rowwise.fuses_exp(mX.element_type),
            )
        if owner:
            lse = row_max + cute.math.log2(denom, fastmath=True) * LN_2
            loss = Float32(0.0)
            if mode == 0:
                loss = lse - x_target
            if mode == 2:
                loss = Float32(math.nan)
            mLoss[row] = loss
            if const_expr(mLse is not None):
                mLse[row] = lse
        if const_expr(reducing):
            _reduce_in_last_cta(
                mLoss, mTarget, mOut, mStats, mCounter, ignore_index, sLast, sTotals, sCounts, m, cfg.threads,
                self.reduction == "mean",
            )


@cute.jit
def _reduce_in_last_cta(
    mLoss: cute.Tensor,
    mTarget: cute.Tensor,
    mOut: cute.Tensor,
    mStats,
    mCounter: cute.Tensor,
    ignore_index: Int32,
    sLast: cute.Tensor,
    sTotals: cute.Tensor,
    sCounts: cute.Tensor,
    m,
    threads: cutlass.Constexpr[int],
    mean: cutlass.Constexpr[bool],
):
    """The module docstring's reduction: a ticket per CTA, the last one sums."""
    tidx, _, _ = cute.arch.thread_idx()
    # This thread's loss stores are visible device-wide before its CTA's ticket.
    cute.arch.fence_acq_rel_gpu()
    cute.arch.sync_threads()
    if tidx == 0:
        gx, gy, gz = cute.arch.grid_dim()
        ticket = cute.arch.atomic_add(mCounter.iterator, Int32(1), sem="acq_rel", scope="gpu")
        sLast[0] = Int32(0)
        if ticket == gx * gy * gz - 1:
            sLast[0] = Int32(1)
    cute.arch.sync_threads()
    if sLast[0] == 1:
        cute.arch.fence_acq_rel_gpu()
        total = Float32(0.0)
        count = Int32(0)
        for r in cutlass.range(tidx, m, threads, unroll=1):
            total = total + mLoss[r]
            if Int64(mTarget[r]) != Int64(ignore_index):
                count = count + 1
        total = cute.arch.warp_reduction(total, lambda a, b: a + b)
        count = cute.arch.warp_reduction(count, lambda a, b: a + b)
        warp, lane = tidx // 32, tidx % 32
        if lane == 0:
            sTotals[warp] = total
            sCounts[warp] = count
        cute.arch.sync_threads()
        if tidx == 0:
            total = Float32(0.0)
            count = Int32(0)
            for w in cutlass.range_constexpr(threads // 32):
                total = total + sTotals[w]
                count = count + sCounts[w]
            counted = Float32(count)
            value = total
            if const_expr(mean):
                value = total / counted
            mOut[0] = value.to(mOut.element_type)
            if const_expr(mStats is not None):
                mStats[0] = total
                mStats[1] = counted
            mCounter[0] = Int32(0)


class CrossEntropyBackward(rowwise.RowKernel):
    """dx = (softmax(x) - onehot(target)) * dloss_row, from the stored lse."""

    @cute.jit
    def __call__(
        self,
        logits: cute.Tensor,
        target: cute.Tensor,
        lse: cute.Tensor,
        dloss: cute.Tensor,
        dx: cute.Tensor,
        ignore_index: Int32,
        stream: cuda.CUstream,
    ):
        cfg = self.cfg
        copy = rowwise.make_row_copy(logits.element_type, cfg)
        # Not rowwise.launch_rows: the column tiles are independent CTAs, no cluster.
        self.kernel(logits, target, lse, dloss, dx, ignore_index, copy).launch(
            grid=[cute.ceil_div(logits.shape[0], cfg.rows_per_cta), cfg.cluster_n, 1],
            block=[cfg.threads, 1, 1],
            stream=stream,
        )

    @cute.kernel
    def kernel(
        self,
        mX: cute.Tensor,
        mTarget: cute.Tensor,
        mLse: cute.Tensor,
        mDloss: cute.Tensor,
        mDx: cute.Tensor,
        ignore_index: Int32,
        copy: cute.TiledCopy,
    ):
        cfg = self.cfg
        tidx, _, _ = cute.arch.thread_idx()
        bidx, bidy, _ = cute.arch.block_idx()
        m, n = mX.shape[0], mX.shape[1]
        # Column tile bidy of a grid, not a cluster rank: tiled here, not by rowwise.row_tiles.
        gX = cute.local_tile(mX, cfg.tiler, (bidx, bidy))
        gDx = cute.local_tile(mDx, cfg.tiler, (bidx, bidy))
        gC = cute.local_tile(cute.make_identity_tensor((m, n)), cfg.tiler, (bidx, bidy))
        # gX: (rows_per_cta, cols_per_cta) tile: row tile bidx, column tile bidy
        thr = copy.get_slice(tidx)
        tXgX, tXgDx, tXcX = thr.partition_S(gX), thr.partition_D(gDx), thr.partition_S(gC)
        # tXgX: ((vec), 1, vecs_per_thread) per thread
        tXpX = rowwise.copy_predicate(tXcX, m, n, not cfg.covers_n_exactly)
        tXrX = cute.make_rmem_tensor_like(tXgX)
        rowwise.load_row(rowwise.vector_atom(mX.element_type, cfg), tXgX, tXrX, tXpX)

        row = tXcX[0][0]
        lse = Float32(0.0)
        scale = Float32(0.0)
        tgt = Int32(-1)
        mode = Int32(1)
        if row < m:
            lse = mLse[row]
            scale = mDloss[row]
            tgt, mode = _read_target(mTarget, row, ignore_index, cfg.n)
            if mode == 1:
                scale = Float32(0.0)
            if mode == 2:
                scale = Float32(math.nan)

        p = cute.math.exp2(tXrX.load().to(Float32) * rowwise.LOG2_E - lse * rowwise.LOG2_E, fastmath=True)
        tXrG = cute.make_rmem_tensor(tXgX.shape, Float32)
        tXrG.store(p * scale)
        # Subtract the one-hot term where the column is the target.
        for i in cutlass.range_constexpr(cute.size(tXrG)):
            if tXcX[i][1] == tgt:
                tXrG[i] = tXrG[i] - scale
        tXrDx = cute.make_rmem_tensor_like(tXgDx)
        tXrDx.store(tXrG.load().to(mDx.element_type))
        rowwise.store_row(rowwise.vector_atom(mDx.element_type, cfg), tXrDx, tXgDx, tXpX)
