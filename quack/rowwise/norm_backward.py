"""The persistent backward kernel of RMSNorm and LayerNorm (CuTe DSL, sm_90a).

Per row, with x̂ = (x - mean) * rstd (mean = 0 for RMSNorm) and wdy = dy * w:
    c1 = sum(x̂ * wdy),  c2 = sum(wdy) (LayerNorm only),
    dx = (wdy - c2 / N - x̂ * c1 / N) * rstd  (+ dh_out, RMSNorm's residual path),
    (RMSNorm at N = 1: dx = wdy * eps * rstd^3, the same without cancelling),
    dw += dy * x̂,  db += dy  (LayerNorm), over the rows a CTA visits.

The grid is persistent: each CTA (cluster) strides over row tiles and keeps
its dw and db accumulators in fp32 registers, writing one partial row of each
per thread row at the end (the op sums the partials).  Row tiles are staged
in shared memory through a two-deep ``cp.async`` pipeline: while a tile is
reduced (its c1 and c2 cross the cluster in one exchange) and written, the
next one is already in flight, and registers hold one vector of a row at a
time.  The weight slice, the same for every tile, is staged once.  Where two
stages and the weight do not fit the shared memory (``pipeline_plan``) a
16-bit weight moves to registers (16-bit rows from N = 197K with dh_out);
otherwise (fp32 rows from N = 164K, 16K with dh_out) a single stage runs,
unpipelined, and where even that does not fit the weight is read from L2.
Each thread only reads back what it copied itself, so the pipeline needs no
CTA barrier.
Vectors too narrow for ``cp.async`` (odd N with 16-bit data) are staged with
plain loads and stores instead: correct, not pipelined.

Thread mapping, cluster sizes and the exchange: ``quack/rowwise/device.py``.  Ops:
quack/families/rmsnorm/op.py, quack/families/layernorm/op.py.
"""

from __future__ import annotations

from typing import Optional

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from quack.rowwise import device as rowwise
from quack.rowwise.norm_backward_grid import L2, REGISTERS, SMEM, ctas_per_sm, pipeline_plan
from quack.rowwise.device import RowConfig

class NormBackward(rowwise.RowKernel):
    """dx (and partial dw, db rows) of RMSNorm (``centred`` False) or LayerNorm."""

    def __init__(self, cfg: RowConfig, centred: bool):
        super().__init__(cfg)
        self.centred = centred

    @cute.jit
    def __call__(
        self,
        x: cute.Tensor,
        weight: Optional[cute.Tensor],
        dy: cute.Tensor,
        dh_out: Optional[cute.Tensor],
        mean: Optional[cute.Tensor],
        rstd: cute.Tensor,
        dx: cute.Tensor,
        dw_partial: Optional[cute.Tensor],
        db_partial: Optional[cute.Tensor],
        eps: Float32,
        num_ctas: Int32,
        stream: cuda.CUstream,
    ):
        cfg = self.cfg
        copy = rowwise.make_row_copy(x.element_type, cfg)
        sizes = (
            x.element_type.width // 8, 0 if weight is None else weight.element_type.width // 8,
            2 if dh_out is None else 3,
        )
        per_sm = ctas_per_sm(cfg, *sizes)
        self.stages, self.weight_place = pipeline_plan(cfg, *sizes)
        self.kernel(x, weight, dy, dh_out, mean, rstd, dx, dw_partial, db_partial, eps, copy).launch(
            grid=[num_ctas, cfg.cluster_n, 1],
            block=[cfg.threads, 1, 1],
            cluster=[1, cfg.cluster_n, 1] if const_expr(cfg.cluster_n > 1) else None,
            stream=stream,
            min_blocks_per_mp=per_sm,
            preferred_smem_carveout=100,
        )

    @cute.kernel
    def kernel(
        self,
        mX: cute.Tensor,
        mW: Optional[cute.Tensor],
        mDy: cute.Tensor,
        mDhOut: Optional[cute.Tensor],
        mMean: Optional[cute.Tensor],
        mRstd: cute.Tensor,
        mDx: cute.Tensor,
        mDwPartial: Optional[cute.Tensor],
        mDbPartial: Optional[cute.Tensor],
        eps: Float32,
        copy: cute.TiledCopy,
    ):
        cfg = self.cfg
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        num_ctas, _, _ = cute.arch.grid_dim()
        sums = 2 if self.centred else 1  # c1 (and c2) per exchange
        # Consecutive tiles alternate between two sets of ``sums`` stages.
        rank, smem, sRed, mbar = rowwise.start_row_cta(cfg, stages=2 * sums, exchange_sets=2)
        m, n = mX.shape[0], mX.shape[1]
        thr = copy.get_slice(tidx)
        num_tiles = cute.ceil_div(m, cfg.rows_per_cta)

        inputs = (mX, mDy) if mDhOut is None else (mX, mDy, mDhOut)
        stages = self.stages
        staged = [_stage_buffer(smem, cfg, thr, t.element_type, stages) for t in inputs]
        tWcW, _ = rowwise.tile_coordinates(cfg, thr, 0, rank, m, n)
        # tWcW: coordinates of this thread's columns (in the first row tile)
        valid = rowwise.column_mask(tWcW, n) if const_expr(not cfg.covers_n_exactly) else None
        # The weight: a tensor staged in shared memory or held in registers,
        # a broadcast_param read from L2, or None.
        weight = None
        if const_expr(mW is not None):
            w_pred = rowwise.copy_predicate(tWcW, None, n, not cfg.covers_n_exactly)
            weight = rowwise.broadcast_param(cfg, thr, mW, rank, w_pred)
            if const_expr(self.weight_place == SMEM):
                sW = smem.allocate_tensor(mW.element_type, cute.make_ordered_layout(cfg.tiler, order=(1, 0)), byte_alignment=16)
                _stage_param(cfg, tidx, mW, sW, rank, n)
                weight = thr.partition_D(sW)
            elif const_expr(self.weight_place == REGISTERS):
                gW = rowwise.broadcast_vector(cfg, thr, mW, rank)
                weight = cute.make_rmem_tensor_like(gW)
                rowwise.load_row(rowwise.vector_atom(mW.element_type, cfg), gW, weight, w_pred)
        dw = _zeroed_like(tWcW) if const_expr(mDwPartial is not None) else None
        db = _zeroed_like(tWcW) if const_expr(mDbPartial is not None) else None

        if const_expr(cfg.cluster_n > 1):
            cute.arch.cluster_wait()
        # Prologue: the first stages - 1 tiles in flight (one commit group
        # each, empty past the last tile: its rows fail the predicate).
        for ahead in cutlass.range_constexpr(stages - 1):
            self._issue(cfg, thr, bidx + ahead * num_ctas, rank, inputs, staged, ahead)
        for tile in cutlass.range(bidx, num_tiles, num_ctas):
            turn_count = (tile - bidx) // num_ctas
            self._issue(cfg, thr, tile + (stages - 1) * num_ctas, rank, inputs, staged, (turn_count + stages - 1) % stages)
            tXcX, tXpX = rowwise.tile_coordinates(cfg, thr, tile, rank, m, n)
            row = tXcX[0][0]
            mean = Float32(0.0)
            rstd = Float32(0.0)
            if row < m:
                rstd = mRstd[row]
                if const_expr(self.centred):
                    mean = mMean[row]
            # All but the newest stages - 1 groups have landed: this tile has.
            cute.arch.cp_async_wait_group(stages - 1)
            stage = turn_count % stages
            tiles = [t[None, None, None, stage] for t in staged]

            parts = rowwise.slice_parts(cfg, True)
            in_rows = row < m
            c = (Float32(0.0), Float32(0.0))
            for v in parts:
                x_hat, dy, wdy = self._vectors(tiles, weight, valid, v, mean, rstd)
                c = (
                    c[0] + (x_hat * wdy).reduce(cute.ReductionOp.ADD, Float32(0.0), reduction_profile=0),
                    c[1] + wdy.reduce(cute.ReductionOp.ADD, Float32(0.0), reduction_profile=0),
                )
            turn, turn_mbar, phase = rowwise.exchange_turn(tile, bidx, num_ctas, mbar)
            buffers = tuple(sRed[None, None, sums * turn + i] for i in range(sums))
            c = rowwise.row_merge(
                c[:sums], buffers, rowwise.merge_sums, (Float32(0.0),) * sums,
                cfg.threads_per_row, cfg.cluster_n, turn_mbar, phase,
            )
            c1 = c[0] * (1.0 / cfg.n)
            c2 = c[1] * (1.0 / cfg.n) if const_expr(self.centred) else Float32(0.0)

            (gDx,) = rowwise.row_tiles(cfg, tile, rank, mDx)
            tXgDx = thr.partition_D(gDx)
            tXrDx = cute.make_rmem_tensor_like(tXgDx)
            atom_dx = rowwise.vector_atom(mDx.element_type, cfg)
            for v in parts:
                x_hat, dy, wdy = self._vectors(tiles, weight, valid, v, mean, rstd)
                if const_expr(cfg.n == 1 and not self.centred):
                    # RMSNorm at N = 1: 1 - x̂^2 = eps * rstd^2 exactly, where
                    # the difference would cancel (x̂^2 near 1) and scale its
                    # rounding by 1 / (1 - x̂^2).
                    dx = wdy * (eps * rstd * rstd * rstd)
                else:
                    dx = (wdy - c2 - x_hat * c1) * rstd
                if const_expr(mDhOut is not None):
                    dx = dx + rowwise.slice_vector(tiles[2], None, v)
                rowwise.part(tXrDx, v).store(dx.to(mDx.element_type))
                cute.copy(atom_dx, rowwise.part(tXrDx, v), rowwise.part(tXgDx, v), pred=rowwise.part(tXpX, v))
                # Here, not in the first pass, where accumulating measured slower.
                # Rows past M hold stale staged values: they add nothing.
                if in_rows:
                    if const_expr(dw is not None):
                        rowwise.part(dw, v).store(rowwise.part(dw, v).load() + dy * x_hat)
                    if const_expr(db is not None):
                        rowwise.part(db, v).store(rowwise.part(db, v).load() + dy)
        cute.arch.cp_async_wait_group(0)

        for acc, mPartial in ((dw, mDwPartial), (db, mDbPartial)):
            if const_expr(acc is not None):
                _store_partial(cfg, thr, bidx, rank, mPartial, acc, n)

    def _issue(self, cfg: RowConfig, thr, tile, rank, inputs, staged, stage):
        """Start copying row tile ``tile`` of every input into ``stage``; one commit group."""
        _, pred = rowwise.tile_coordinates(cfg, thr, tile, rank, inputs[0].shape[0], inputs[0].shape[1])
        for t, buf in zip(inputs, staged):
            (gT,) = rowwise.row_tiles(cfg, tile, rank, t)
            _stage(cfg, thr.partition_S(gT), buf[None, None, None, stage], pred)
        cute.arch.cp_async_commit_group()

    def _vectors(self, tiles, weight, valid, v, mean, rstd):
        """(x̂, dy, dy * w) of part v of this thread's staged row, zero in padded columns."""
        x_hat = (rowwise.slice_vector(tiles[0], valid, v) - mean) * rstd
        dy = rowwise.slice_vector(tiles[1], valid, v)
        if const_expr(weight is None):
            return x_hat, dy, dy
        if const_expr(self.weight_place == L2):
            w = rowwise.load_param(weight, v)
        else:
            w = rowwise.slice_vector(weight, valid, v)
        if const_expr(self.cfg.n == 1):
            # At N = 1 LayerNorm's dx terms cancel exactly (wdy - c2: dx is 0,
            # as torch's is; RMSNorm's never subtract there).  ptxas
            # fuses dy * w into the subtraction, so the difference keeps the
            # product's rounding error, times rstd (up to 1/sqrt(eps)).
            # "+ 0.0" rounds the product on its own, the same in both passes.
            # Only here: at other N the fused form is as accurate and one
            # instruction cheaper, and rounding it at every N slowed both
            # backward passes.
            return x_hat, dy, dy * w + 0.0
        return x_hat, dy, dy * w


def _stage_buffer(smem, cfg: RowConfig, thr, dtype, stages: int) -> cute.Tensor:
    """``stages`` shared (rows_per_cta, cols_per_cta) tiles of one input,
    partitioned like this thread's slice: ((vec), 1, vectors, stage)."""
    sT = smem.allocate_tensor(
        dtype, cute.make_ordered_layout((*cfg.tiler, stages), order=(1, 0, 2)), byte_alignment=16
    )
    first = thr.partition_D(sT[None, None, 0])
    stage_mode = cute.make_layout(stages, stride=cfg.rows_per_cta * cfg.cols_per_cta)
    return cute.make_tensor(first.iterator, cute.append(first.layout, stage_mode))


def _stage(cfg: RowConfig, src: cute.Tensor, dst: cute.Tensor, pred: cute.Tensor) -> None:
    """Global -> shared for this thread's vectors (``rowwise.stage_atom``)."""
    cute.copy(rowwise.stage_atom(src.element_type, cfg), src, dst, pred=pred)


def _stage_param(cfg: RowConfig, tidx, mV: cute.Tensor, sV: cute.Tensor, rank, n) -> None:
    """Global -> shared for this thread's slice of an (N,) parameter broadcast
    over the tile, partitioned by a copy of the parameter's own dtype: an fp32
    weight beside 16-bit rows has two 16-byte ``cp.async`` per vector, and a
    predicated ``cp.async`` over a partition of x's dtype (one atom per
    vector) issues only the first of them.  The thread owns the same columns
    as in x's partition, so it reads back only what it copied."""
    thr = rowwise.make_row_copy(mV.element_type, cfg).get_slice(tidx)
    coords, _ = rowwise.tile_coordinates(cfg, thr, 0, rank, 1, n)
    pred = rowwise.copy_predicate(coords, None, n, not cfg.covers_n_exactly)
    _stage(cfg, rowwise.broadcast_vector(cfg, thr, mV, rank), thr.partition_D(sV), pred)


def _zeroed_like(coords: cute.Tensor) -> cute.Tensor:
    """An fp32 register accumulator shaped like this thread's slice, zeroed."""
    acc = cute.make_rmem_tensor(coords.shape, Float32)
    acc.fill(0.0)
    return acc


def _store_partial(cfg: RowConfig, thr, bidx, rank, mPartial, acc, n) -> None:
    """Write a CTA's accumulator to its partial rows (bidx * rows_per_cta +
    row in CTA) of the (grid * rows_per_cta, N) fp32 buffer."""
    gP, cP = rowwise.row_tiles(cfg, bidx, rank, mPartial, cute.make_identity_tensor(mPartial.shape))
    pred = rowwise.copy_predicate(thr.partition_S(cP), mPartial.shape[0], n, not cfg.covers_n_exactly)
    rowwise.store_row(rowwise.vector_atom(Float32, cfg), acc, thr.partition_D(gP), pred)
