"""LayerNorm forward kernel (CuTe DSL, sm_90a).

Forward, per row:  mean = sum(x) / N,  xc = x - mean,
rstd = rsqrt(sum(xc^2) / N + eps),  y = xc * rstd * w + b.
Each CTA owns ``rows_per_cta`` rows (or, in a cluster, one slice of a row) and
reads its slice once, into registers or (clusters) shared memory, walking it
in ``rowwise.slice_parts``.  Each thread takes the count, sum and
squared deviations of its values in one pass, from sums of x - (one of its
own values); those triples are merged over the row in one exchange (Chan et
al.'s pairwise update), so the variance stays accurate for rows with a large
mean without a second pass or row reduction (a second pass over a staged
slice was slower on long rows, and spilled).  Padded
columns are zeroed after the shift.  Writes y and, for a
backward pass, mean and rstd (fp32).

The backward (dx, partial dw and db rows) is quack/rowwise/norm_backward.py's
persistent kernel, shared with RMSNorm.

Thread mapping, cluster sizes and the reduction are described in
``quack/rowwise/device.py``.  Tests: tests/test_layernorm.py; benchmark:
``python tools/bench/layernorm.py``.
"""

from __future__ import annotations

from typing import Optional

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, const_expr

from quack.rowwise import device as rowwise


def _masked(values, valid):
    """Zero the padded columns (``valid`` is None when there are none)."""
    if const_expr(valid is None):
        return values
    return cute.where(valid, values, Float32(0.0))


def _centred(tXsX, valid, v, centre):
    """``rowwise.part`` v of a slice minus ``centre``, zero in padded columns."""
    return _masked(rowwise.slice_vector(tXsX, None, v) - centre, None if valid is None else rowwise.part(valid, v).load())


def _inverse(count):
    """1 / count, and 0 for an empty part (whose sums are 0 too)."""
    return cute.arch.rcp_approx(cutlass.max(count, Float32(1.0)))


def _merge_moments(a, b):
    """(count, sum, squared deviations from the mean) of two disjoint parts."""
    count = a[0] + b[0]
    delta = b[1] * _inverse(b[0]) - a[1] * _inverse(a[0])
    return count, a[1] + b[1], a[2] + b[2] + delta * delta * (a[0] * b[0] * _inverse(count))


class LayerNormForward(rowwise.RowKernel):
    """y = (x - mean) * rstd * w + b; also writes mean and rstd when given."""

    @cute.jit
    def __call__(
        self,
        x: cute.Tensor,
        weight: Optional[cute.Tensor],
        bias: Optional[cute.Tensor],
        out: cute.Tensor,
        mean: Optional[cute.Tensor],
        rstd: Optional[cute.Tensor],
        eps: Float32,
        stream: cuda.CUstream,
    ):
        cfg = self.cfg
        copy = rowwise.make_row_copy(x.element_type, cfg)
        rowwise.launch_rows(
            self.kernel(x, weight, bias, out, mean, rstd, eps, copy), cfg, x.shape[0], stream,
            staged=rowwise.stages_row(cfg, x.element_type),
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
        # Count, sum and squared deviations of this thread's values, in one
        # pass over its slice: the sums are of x - shift, shift being one of
        # its own values (so close to their mean, which keeps the variance
        # accurate for rows with a large mean), then merged over the row in
        # one exchange (Chan et al.'s pairwise update).
        count = Float32(cute.size(tXsX))
        if const_expr(valid is not None):
            count = valid.load().to(Float32).reduce(cute.ReductionOp.ADD, Float32(0.0), reduction_profile=0)
        shift = rowwise.slice_vector(tXsX, valid, parts[0])[0]
        shifted_sum, shifted_sq = Float32(0.0), Float32(0.0)
        for v in parts:
            dev = _centred(tXsX, valid, v, shift)
            shifted_sum += dev.reduce(cute.ReductionOp.ADD, Float32(0.0), reduction_profile=0)
            shifted_sq += (dev * dev).reduce(cute.ReductionOp.ADD, Float32(0.0), reduction_profile=0)
        total = shifted_sum + count * shift
        sq = cutlass.max(shifted_sq - shifted_sum * shifted_sum * _inverse(count), Float32(0.0))
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
