"""Shared pieces of the row-wise memory-bound kernels (RMSNorm, softmax, ...).

Every row-wise kernel maps a (M, N) row-major tensor the same way:

* a CTA owns ``rows_per_cta`` rows and, when a cluster splits a row, one
  ``cols_per_cta`` slice of it (cluster rank r owns columns
  ``[r * cols_per_cta, (r + 1) * cols_per_cta)``);
* inside a CTA, ``threads_per_row`` consecutive threads share a row and each
  moves ``vec`` contiguous elements per copy (16 bytes when N allows), so a
  warp reads contiguous 512-byte runs;
* a thread holds a bounded number of values of a row (64 in a forward, 32
  in a backward: the budget decides the cluster size), so the data is read
  from global memory exactly once: in registers when the row fits one CTA,
  and, when a cluster splits it, staged in shared memory with ``cp.async``
  (``stages_row``) and read back a vector at a time, so a CTA needs few
  registers and several fit per SM to cover each other's exchanges.

Row reductions go lane -> warp (butterfly shuffles) -> CTA (one shared-memory
slot per warp) -> cluster (each warp writes its partial into every peer CTA's
shared memory through DSMEM, as ``st.async`` stores counted on each
receiver's mbarrier, so a CTA waits only for its own slots to fill).
Reductions always run in fp32.

Host side: ``RowConfig`` picks the launch settings from N and the element
width; ``fake_rows`` builds the compile-time stand-ins of (M, N) tensors with a
symbolic M and a symbolic 64-bit row stride, so one object serves every M and
address arithmetic never overflows 32 bits.
"""

from __future__ import annotations

import functools
import math

import cutlass
import cutlass.cute as cute
from cutlass import Boolean, Float32, Int32, const_expr

LOG2_E = math.log2(math.e)
FLT_MAX = 3.4028234663852886e38

# The host-side settings (shared with the ops, which must not import the DSL).
from quack.rowwise.config import STAGED_CTAS_PER_SM, RowConfig  # noqa: E402


class RowKernel:
    """Base of the row-wise kernel classes: each is built from its launch
    settings (``RowConfig``), which its host and device code read."""

    def __init__(self, cfg: RowConfig):
        self.cfg = cfg


def fake_rows(dtype, m, n: int, vec: int):
    """A compile-time (M, N) row-major tensor: M symbolic (shared object ``m``),
    row stride a symbolic 64-bit multiple of ``vec``."""
    stride = cute.sym_int64(divisibility=vec)
    return cute.runtime.make_fake_tensor(
        dtype, (m, n), (stride, 1), assumed_align=_copy_bytes(dtype, vec)
    )


def fake_vector(dtype, n, align_elems: int = 1):
    """A compile-time contiguous vector of length ``n`` (static or symbolic)."""
    return cute.runtime.make_fake_compact_tensor(
        dtype, (n,), assumed_align=max(4, _copy_bytes(dtype, align_elems))
    )


def _copy_bytes(dtype, vec: int) -> int:
    """Bytes one copy of ``vec`` elements moves; copies never exceed 16 bytes."""
    return min(16, vec * dtype.width // 8)


# --------------------------------------------------------------------------
# Device-side helpers.
# --------------------------------------------------------------------------


def vector_atom(dtype, cfg: RowConfig) -> cute.CopyAtom:
    """Copy atom for ``dtype`` tensors of the row: one ``cfg.vec``-element
    vector per copy, or 16-byte pieces of it for wider dtypes (an fp32 weight
    beside bf16 activations)."""
    return cute.make_copy_atom(
        cute.nvgpu.CopyUniversalOp(), dtype, num_bits_per_copy=8 * _copy_bytes(dtype, cfg.vec)
    )


def make_row_copy(dtype, cfg: RowConfig) -> cute.TiledCopy:
    """Tiled copy that gives each thread ``vecs_per_thread`` vectors of one row."""
    atom = vector_atom(dtype, cfg)
    thr_layout = cute.make_ordered_layout(
        (cfg.rows_per_cta, cfg.threads_per_row), order=(1, 0)
    )
    val_layout = cute.make_layout((1, cfg.vec))
    return cute.make_tiled_copy_tv(atom, thr_layout, val_layout)


def copy_predicate(tXcX: cute.Tensor, m, n, check_cols: bool) -> cute.Tensor:
    """One predicate per vector copy: is its row < M (skipped when ``m`` is
    None) and, when the tile does not cover N exactly, its first column < N?

    Plain Python, traced inline: the loops unroll at trace time.  (Passing a
    predicate tensor into a ``@cute.jit`` helper loses its tensor type.)"""
    tXpX = cute.make_rmem_tensor(
        cute.make_layout(
            (cute.size(tXcX, mode=[0, 1]), cute.size(tXcX, mode=[1]), cute.size(tXcX, mode=[2])),
            stride=(cute.size(tXcX, mode=[2]), 0, 1),
        ),
        Boolean,
    )
    for v in range(tXpX.shape[0]):
        for k in range(tXpX.shape[2]):
            coord = tXcX[(0, v), 0, k]
            ok = cute.elem_less(coord[0], m) if m is not None else True
            if check_cols:
                ok = cute.elem_less(coord[1], n) & ok
            tXpX[v, 0, k] = ok
    return tXpX


def load_row(atom: cute.CopyAtom, src: cute.Tensor, dst: cute.Tensor, pred: cute.Tensor):
    """Global -> registers; masked vectors read as zero."""
    dst.fill(0)
    cute.copy(atom, src, dst, pred=pred)


def store_row(atom: cute.CopyAtom, src: cute.Tensor, dst: cute.Tensor, pred: cute.Tensor):
    """Registers -> global, skipping masked vectors."""
    cute.copy(atom, src, dst, pred=pred)


def reduction_buffer_layout(cfg: RowConfig, stages: int = 1) -> cute.Layout:
    """Shared slots: (row in CTA, (warp in row, cluster rank), stage)."""
    return cute.make_ordered_layout(
        (cfg.rows_per_cta, (cfg.warps_per_row, cfg.cluster_n), stages), order=(1, 0, 2)
    )


def load_row_filled(atom: cute.CopyAtom, src: cute.Tensor, dst: cute.Tensor, pred: cute.Tensor, fill):
    """Global -> registers; masked vectors read as ``fill`` (e.g. -inf for a
    max or a softmax, where a zero would count as a real value)."""
    dst.fill(fill)
    cute.copy(atom, src, dst, pred=pred)


def stages_row(cfg: RowConfig, *dtypes) -> bool:
    """Can a kernel stage its rows (of these dtypes) in shared memory
    (``stage_row``)?  Rows split over a cluster can, when every vector is a
    legal ``cp.async`` (4 to 16 bytes: not the element copies of odd-length
    16-bit rows).  The forwards stage whenever they can; the softmax backward
    only at 512-thread configurations."""
    return cfg.cluster_n > 1 and all(cfg.vec * dtype.width >= 32 for dtype in dtypes)


def stage_atom(dtype, cfg: RowConfig) -> cute.CopyAtom:
    """Global -> shared copy atom for one vector: ``cp.async`` when the
    vector is 4 to 16 bytes (``stages_row``), else plain loads and stores
    (synchronous; for the element copies of odd-length 16-bit rows)."""
    bits = 8 * _copy_bytes(dtype, cfg.vec)
    if bits >= 32:
        return cute.make_copy_atom(cute.nvgpu.cpasync.CopyG2SOp(), dtype, num_bits_per_copy=bits)
    return cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dtype, num_bits_per_copy=bits)


def stage_row(smem, cfg: RowConfig, thr, tXgX: cute.Tensor, tXpX: cute.Tensor) -> cute.Tensor:
    """Start copying this thread's slice of the CTA's tile into shared memory
    with ``cp.async``: no registers are held while the loads fly, so a long
    row split over a cluster costs few registers and more CTAs fit on an SM
    to cover its exchange.  The caller waits with ``cp_async_wait_group(0)``;
    each thread reads back only the vectors it copied, so no barrier is
    needed.  Masked vectors are left unwritten (``slice_vector`` masks them)."""
    dtype = tXgX.element_type
    sX = smem.allocate_tensor(dtype, cute.make_ordered_layout(cfg.tiler, order=(1, 0)), byte_alignment=16)
    tXsX = thr.partition_D(sX)
    cute.copy(stage_atom(dtype, cfg), tXgX, tXsX, pred=tXpX)
    cute.arch.cp_async_commit_group()
    return tXsX


def load_slice(smem, cfg: RowConfig, thr, tXgX: cute.Tensor, tXpX: cute.Tensor, staged: bool) -> cute.Tensor:
    """This thread's slice of a row tile, where the kernel reads it from: in
    shared memory (``stage_row``) when ``staged`` (``stages_row``), else in
    registers.  Padded vectors hold anything: read them with ``slice_vector``."""
    if const_expr(staged):
        return stage_row(smem, cfg, thr, tXgX, tXpX)
    regs = cute.make_rmem_tensor_like(tXgX)
    # Filled first: without it the compiler moves each vector's conversion
    # under its load's predicate, and the loads no longer overlap.
    load_row(vector_atom(tXgX.element_type, cfg), tXgX, regs, tXpX)
    return regs


def slice_ready(cfg: RowConfig, staged: bool) -> None:
    """Wait for this thread's ``load_slice`` copies (staged ones are
    asynchronous) and for the cluster's start-up barrier: after this, the
    kernel may read its slice and exchange with its peers."""
    if const_expr(staged):
        cute.arch.cp_async_wait_group(0)
    if const_expr(cfg.cluster_n > 1):
        cute.arch.cluster_wait()


def slice_parts(cfg: RowConfig, staged: bool) -> list:
    """How a forward walks its slice (``part``): a staged slice one vector at
    a time, so registers hold one; a register-held slice whole (None)."""
    return list(range(cfg.vecs_per_thread)) if staged else [None]


def part(t: cute.Tensor, v):
    """The v-th vector of a thread's slice (or partition), or all of it for None."""
    return t if v is None else t[None, None, v]


def slice_vector(tXsX: cute.Tensor, valid, v, fill=0.0):
    """``part`` v of a thread's slice in fp32, ``fill`` in padded columns
    (``valid``: ``column_mask`` of the slice, None when there are none)."""
    x = part(tXsX, v).load().to(Float32)
    if const_expr(valid is None):
        return x
    return cute.where(part(valid, v).load(), x, Float32(fill))


def exp_shifted(x, row_max, fused: bool = False):
    """exp(x - max).  Exact: the subtraction first (-FLT_MAX * log2(e) would
    overflow to -inf, and -inf - -inf is NaN).  ``fused`` (``fuses_exp``):
    x * log2(e) - max * log2(e), one FFMA per value instead of a subtraction
    and a multiplication, the max clamped so its product stays finite; the
    product's rounding (|max| * 2^-24 in the exponent) is far below a 16-bit
    input's own precision."""
    if fused:
        shift = cute.arch.fmax(row_max, Float32(-FLT_MAX / 4)) * LOG2_E
        return cute.math.exp2(x * LOG2_E - shift, fastmath=True)
    return cute.math.exp2((x - row_max) * LOG2_E, fastmath=True)


def fuses_exp(dtype) -> bool:
    """Do kernels exponentiate values of this input dtype in the fused form
    (``exp_shifted``)?  16-bit inputs: one FFMA per value is faster, and its
    rounding is below their precision.  fp32 inputs keep the exact form."""
    return dtype.width < 32


def staged_max_and_sum(tXsX: cute.Tensor, valid, cfg: RowConfig, max_buffer, sum_buffer, mbar=None):
    """Row max M and sum of exp(x - M) of a staged row (``stage_row``): one
    pass over the slice with a running (max, sum) per thread, one vector in
    registers at a time (the sum rescaled when the max grows: one extra
    exponential per vector), then one exchange (``row_max_sum``)."""
    state = (Float32(-FLT_MAX), Float32(0.0))
    for v in range(cfg.vecs_per_thread):
        x = slice_vector(tXsX, valid, v, -math.inf)
        new_max = cute.arch.fmax(state[0], x.reduce(cute.ReductionOp.MAX, Float32(-FLT_MAX), reduction_profile=0))
        vec_sum = exp_shifted(x, new_max, fuses_exp(tXsX.element_type)).reduce(cute.ReductionOp.ADD, Float32(0.0), reduction_profile=0)
        state = (new_max, state[1] * exp_shifted(state[0], new_max) + vec_sum)
    return row_max_sum(state, (max_buffer, sum_buffer), cfg.threads_per_row, cfg.cluster_n, mbar)


@cute.jit
def row_max_sum(
    state: tuple,
    buffers: tuple,
    threads_per_row: cutlass.Constexpr[int],
    cluster_n: cutlass.Constexpr[int],
    mbar=None,
):
    """The row's (M, S) from each thread's (max m, sum s of exp(x - m)): what
    ``row_merge`` with ``merge_max_sum`` gives, with one exchange, but each
    warp first agrees on its max and rescales its sums once, so a thread
    computes two exponentials in all instead of two per shuffle step (for
    short rows the merge would otherwise cost as many exponentials as the
    thread's own values)."""
    return row_merge(
        state, buffers, merge_max_sum, (Float32(-FLT_MAX), Float32(0.0)), threads_per_row, cluster_n, mbar,
        warp_merge=_warp_max_sum,
    )


def _warp_max_sum(state: tuple, width: int) -> tuple:
    """(max, sum) over groups of ``width`` lanes: the group's max, then each
    lane's sum rescaled to it (one exponential) and added up."""
    m, s = state
    group_max = cute.arch.warp_reduction(m, lambda a, b: cute.arch.fmax(a, b), threads_in_group=width)
    s = cute.arch.warp_reduction(s * exp_shifted(m, group_max), lambda a, b: a + b, threads_in_group=width)
    return group_max, s


@cute.jit
def row_reduce(
    val: Float32,
    op: cutlass.Constexpr[str],
    buffer: cute.Tensor,
    threads_per_row: cutlass.Constexpr[int],
    cluster_n: cutlass.Constexpr[int],
    mbar=None,
    phase=0,
) -> Float32:
    """Reduce ``val`` ("sum" or "max") over the threads (and cluster peers)
    that share a row: lane -> warp (shuffles) -> CTA (one shared slot per
    warp) -> cluster (each warp stores its partial into every peer's slots
    through DSMEM, see ``_exchange``).

    With a cluster, the kernel must have called ``start_row_cta`` and
    ``cluster_wait`` before the first call: DSMEM may only be written once
    every peer CTA runs.  ``mbar`` and ``phase``: the mbarrier of the
    buffer's set and the parity of its use (0, 1, 0, ... each time the set
    comes round).

    ``buffer`` is one stage of ``reduction_buffer_layout``: shape
    (rows_per_cta, (warps_per_row, cluster_n)).  Successive exchanges of a
    loop must alternate between two sets of stages: a CTA writes a peer's
    set only after that peer has sent its partials of the other set, which
    it does after reading this set's previous slots, so a fast CTA never
    overwrites slots a slow peer still reads."""
    if const_expr(op == "max"):
        val = cute.arch.warp_reduction(
            val, lambda a, b: cute.arch.fmax(a, b), threads_in_group=min(threads_per_row, 32)
        )
    else:
        val = cute.arch.warp_reduction(
            val, lambda a, b: a + b, threads_in_group=min(threads_per_row, 32)
        )
    if const_expr(threads_per_row <= 32 and cluster_n == 1):
        return val
    row_in_cta, slots = _exchange((val,), (buffer,), threads_per_row, cluster_n, mbar, phase)
    lane = cute.arch.lane_idx()
    if const_expr(op == "max"):
        total = Float32(-math.inf)
        for i in cutlass.range_constexpr(0, slots, 32):
            if lane + i < slots:
                total = cute.arch.fmax(total, buffer[row_in_cta, lane + i])
        return cute.arch.warp_reduction(
            total, lambda a, b: cute.arch.fmax(a, b), threads_in_group=32
        )
    else:
        total = Float32(0.0)
        for i in cutlass.range_constexpr(0, slots, 32):
            if lane + i < slots:
                total += buffer[row_in_cta, lane + i]
        return cute.arch.warp_reduction(total, lambda a, b: a + b, threads_in_group=32)


@cute.jit
def _exchange(values, buffers, threads_per_row: cutlass.Constexpr[int], cluster_n: cutlass.Constexpr[int], mbar, phase):
    """Publish each warp's partials (one per buffer) to the row's slots, in
    this CTA or, through DSMEM, in every peer CTA, and wait until all have
    arrived: one barrier for all of them.  In a cluster the DSMEM writes are
    ``st.async`` stores that count themselves on the receiver's mbarrier
    ``mbar`` (``start_row_cta``), and a CTA waits for that mbarrier's
    ``phase`` to complete, i.e. only for its own slots to fill, not for every
    thread of the cluster.  Returns (row of this warp in the CTA, slots per
    row)."""
    lane = cute.arch.lane_idx()
    warp = cute.arch.warp_idx()
    warps_per_row = const_expr(max(1, threads_per_row // 32))
    row_in_cta = warp // warps_per_row
    warp_in_row = warp % warps_per_row
    if const_expr(cluster_n == 1):
        if lane == 0:
            for i in cutlass.range_constexpr(len(values)):
                buffers[i][row_in_cta, (warp_in_row, 0)] = values[i]
        cute.arch.barrier()
    else:
        rank = cute.arch.block_idx_in_cluster()
        if warp == 0:
            with cute.arch.elect_one():
                # Every slot of every buffer, written once by its sender.
                slot_bytes = const_expr(4 * len(values) * cute.cosize(buffers[0].layout))
                cute.arch.mbarrier_arrive_and_expect_tx(mbar, slot_bytes)
        if lane < cluster_n:
            remote_mbar = cute.arch.map_dsmem_ptr(mbar, lane)
            for i in cutlass.range_constexpr(len(values)):
                offset = cute.crd2idx((row_in_cta, (warp_in_row, rank)), buffers[i].layout)
                remote = cute.arch.map_dsmem_ptr(buffers[i].iterator + offset, lane)
                cute.arch.inline_ptx(
                    "st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [{$r0}], {$r1}, [{$r2}];",
                    read_only_args=[Int32(remote.toint()), values[i], Int32(remote_mbar.toint())],
                )
        cute.arch.mbarrier_wait(mbar, phase)
    return row_in_cta, const_expr(warps_per_row * cluster_n)


@cute.jit
def row_merge(
    values: tuple,
    buffers: tuple,
    merge: cutlass.Constexpr,
    identity: tuple,
    threads_per_row: cutlass.Constexpr[int],
    cluster_n: cutlass.Constexpr[int],
    mbar=None,
    phase=0,
    warp_merge: cutlass.Constexpr = None,
) -> tuple:
    """Combine per-thread states (tuples of fp32, one buffer stage per
    element) over the threads and cluster peers of a row with one exchange:
    butterfly shuffles in the warp, then every warp's state through shared
    memory (DSMEM in a cluster) behind one barrier (in a cluster, one wait
    on the mbarrier ``mbar`` for ``phase``, as ``row_reduce`` describes).

    ``merge(a, b)`` combines two states of disjoint parts of the row (it must
    be associative and commutative); ``identity`` is the state of an empty
    part.  Several statistics of a row thus cost one synchronisation where
    one ``row_reduce`` each would cost one per statistic.  Buffer stages
    follow ``row_reduce``'s rule: a loop alternates between two sets
    (``exchange_turn``).  ``warp_merge(values, width)``: the merge over groups
    of ``width`` lanes, when a state has a cheaper one than ``merge`` at each
    butterfly step (``row_max_sum``)."""
    if const_expr(warp_merge is None):
        warp_merge = functools.partial(_butterfly, merge)
    values = warp_merge(values, const_expr(min(threads_per_row, 32)))
    if const_expr(threads_per_row > 32 or cluster_n > 1):
        row_in_cta, slots = _exchange(values, buffers, threads_per_row, cluster_n, mbar, phase)
        lane = cute.arch.lane_idx()
        values = identity
        for i in cutlass.range_constexpr(0, slots, 32):
            if lane + i < slots:
                values = merge(values, tuple(b[row_in_cta, lane + i] for b in buffers))
        values = warp_merge(values, 32)
    return values


def _butterfly(merge, values: tuple, width: int) -> tuple:
    """``merge`` over groups of ``width`` lanes: butterfly shuffles."""
    for i in range(int(math.log2(width))):
        values = merge(values, _shuffle_xor(values, width >> (i + 1)))
    return values


def _shuffle_xor(values: tuple, offset: int) -> tuple:
    return tuple(cute.arch.shuffle_sync_bfly(v, offset) for v in values)


def merge_max_sum(a, b):
    """(max, sum of exp(x - max)) of two disjoint parts of a row, as one pair."""
    m = cute.arch.fmax(a[0], b[0])
    return m, a[1] * exp_shifted(a[0], m) + b[1] * exp_shifted(b[0], m)


def merge_sums(a, b):
    """Element-wise sum of two states (several row sums in one exchange)."""
    return tuple(x + y for x, y in zip(a, b))


@cute.jit
def row_max_and_exp(
    x: cute.TensorSSA,
    max_buffer: cute.Tensor,
    sum_buffer: cute.Tensor,
    threads_per_row: cutlass.Constexpr[int],
    cluster_n: cutlass.Constexpr[int],
    mbar=None,
    fused: cutlass.Constexpr[bool] = False,
):
    """Online softmax statistics of a row in one exchange: returns (M, S, p)
    with M the row max, S the row sum of exp(x - M) and p = exp(x - M) for
    this thread's values (fp32).

    Each thread exponentiates against its own max and the (max, sum) pairs
    are merged (``row_max_sum``), so the row needs one barrier where a max then
    a sum would need two.  Maxima start at -FLT_MAX, not -inf, so parts made
    only of -inf (padding, masked logits) merge without NaNs; a row of only
    -inf still gives S = 0.  ``fused``: ``exp_shifted``'s form for p."""
    m = x.reduce(cute.ReductionOp.MAX, Float32(-FLT_MAX), reduction_profile=0)
    p = exp_shifted(x, m, fused)
    s = p.reduce(cute.ReductionOp.ADD, Float32(0.0), reduction_profile=0)
    row_max, row_sum = row_max_sum((m, s), (max_buffer, sum_buffer), threads_per_row, cluster_n, mbar)
    return row_max, row_sum, p * exp_shifted(m, row_max)


def row_tiles(cfg: RowConfig, tile_m, tile_n, *tensors):
    """Slice each (M, N) tensor to the (rows_per_cta, cols_per_cta) tile
    (``tile_m``, ``tile_n``); None stays None."""
    return [
        cute.local_tile(t, cfg.tiler, (tile_m, tile_n)) if t is not None else None
        for t in tensors
    ]


def cluster_rank(cfg: RowConfig):
    """This CTA's rank among the cluster peers that split a row (0 without a cluster)."""
    return cute.arch.block_idx()[1] if const_expr(cfg.cluster_n > 1) else Int32(0)


def start_row_cta(cfg: RowConfig, stages: int = 1, exchange_sets: int = 1):
    """The common start of a row-wise kernel: this CTA's cluster rank, the
    arrive half of the start-up cluster barrier (the kernel calls
    ``cluster_wait``, or ``slice_ready``, before its first reduction), and
    the shared memory with the reduction buffer of ``stages`` stages
    allocated first.

    In a cluster, also ``exchange_sets`` mbarriers, one per set of buffer
    stages that the kernel's exchanges take in turn (``_exchange``): 1 for a
    kernel that exchanges once, 2 for a persistent loop alternating between
    two sets.  They are initialised before the start-up barrier makes them
    visible to the peers.  Returns (rank, smem, sRed, mbar): mbar points to
    the first mbarrier (None without a cluster)."""
    rank = cluster_rank(cfg)
    smem = cutlass.memory.SmemAllocator()
    sRed = smem.allocate_tensor(
        Float32, reduction_buffer_layout(cfg, stages=stages), byte_alignment=8
    )
    mbar = None
    if cfg.cluster_n > 1:
        mbar = smem.allocate_array(cutlass.Int64, exchange_sets, byte_alignment=8)
        _init_exchange_barriers(mbar, exchange_sets)
        cute.arch.cluster_arrive_relaxed()
    return rank, smem, sRed, mbar


def exchange_turn(tile, first_tile, tile_step, mbar):
    """A persistent loop's exchange for one row tile: (set of buffer stages,
    0 or 1, alternating per tile; that set's mbarrier; its phase).  The n-th
    tile of a CTA uses set n % 2 for the (n // 2)-th time."""
    turn = (tile - first_tile) // tile_step
    parity = turn % 2
    return parity, (None if mbar is None else mbar + parity), (turn // 2) % 2


@cute.jit
def _init_exchange_barriers(mbar, count: cutlass.Constexpr[int]):
    """One arrival (the expect-tx of ``_exchange``) per phase."""
    if cute.arch.thread_idx()[0] == 0:
        for i in cutlass.range_constexpr(count):
            cute.arch.mbarrier_init(mbar + i, 1)
    cute.arch.mbarrier_init_fence()


def launch_rows(kernel, cfg: RowConfig, m, stream, staged: bool = False) -> None:
    """Launch a row-wise kernel: one CTA (one cluster) per ``rows_per_cta`` rows.
    ``staged`` (``stages_row``): cap registers so that ``STAGED_CTAS_PER_SM``
    CTAs fit on an SM, and state the shared-memory carveout (the largest),
    so the DSL need not query a device: compile-only has none."""
    occupancy = {"min_blocks_per_mp": STAGED_CTAS_PER_SM, "preferred_smem_carveout": 100} if staged else {}
    kernel.launch(
        grid=[cute.ceil_div(m, cfg.rows_per_cta), cfg.cluster_n, 1],
        block=[cfg.threads, 1, 1],
        cluster=[1, cfg.cluster_n, 1] if const_expr(cfg.cluster_n > 1) else None,
        stream=stream,
        **occupancy,
    )


def broadcast_vector(cfg: RowConfig, thr, mV: cute.Tensor, rank):
    """This thread's slice of an (N,) vector (a weight, a bias) broadcast over
    the CTA's rows, laid out like its slice of x."""
    gV = cute.local_tile(mV, (cfg.cols_per_cta,), (rank,))
    gV2 = cute.make_tensor(gV.iterator, cute.make_layout(cfg.tiler, stride=(0, 1)))
    return thr.partition_S(gV2)


def broadcast_param(cfg: RowConfig, thr, mV, rank, pred):
    """An (N,) parameter (a weight, a bias) as kernels read it: (this
    thread's slice, its copy predicate, its copy atom), or None without one."""
    if mV is None:
        return None
    return broadcast_vector(cfg, thr, mV, rank), pred, param_atom(mV.element_type, cfg)


def param_atom(dtype, cfg: RowConfig) -> cute.CopyAtom:
    """Copy atom for a parameter vector: an invariant load (``ld.global.nc``),
    which promises the data does not change while the kernel runs, so the
    compiler may issue it ahead of earlier stores instead of behind them."""
    return cute.make_copy_atom(
        cute.nvgpu.CopyG2ROp(), dtype, num_bits_per_copy=8 * _copy_bytes(dtype, cfg.vec), invariant=True
    )


def load_param(param, v=None):
    """``part`` v of a ``broadcast_param`` slice in fp32 (read from L2, where
    every row's CTAs find it)."""
    gmem, pred, atom = param
    gmem, pred = part(gmem, v), part(pred, v)
    regs = cute.make_rmem_tensor_like(gmem)
    load_row(atom, gmem, regs, pred)
    return regs.load().to(Float32)


# Vectors of a staged slice whose parameters (weight, bias) a forward's output
# pass loads at once, each group one L2 round trip; a whole slice's would not
# fit in the registers of a staged kernel.  Invariant loads (``param_atom``)
# may also pass the previous group's stores.  Two vectors per group measured
# faster than one on long rows (tools/bench/rmsnorm.py).
PARAM_GROUP_VECTORS = 2


def param_groups(cfg: RowConfig, staged: bool) -> list:
    """The groups of ``slice_parts`` of a forward's output pass."""
    parts = slice_parts(cfg, staged)
    return [parts[i:i + PARAM_GROUP_VECTORS] for i in range(0, len(parts), PARAM_GROUP_VECTORS)]


def param_vectors(param, vectors) -> dict:
    """{v: ``part`` v of a ``broadcast_param`` in fp32} for a group of parts,
    loads issued together; {v: None} without the parameter."""
    return {v: None if param is None else load_param(param, v) for v in vectors}


def scale_shift(values, weight, bias):
    """values * weight + bias, either of them possibly None."""
    if weight is not None:
        values = values * weight
    if bias is not None:
        values = values + bias
    return values


def tile_coordinates(cfg: RowConfig, thr, tile, rank, m, n):
    """This thread's (row, column) coordinates in row tile ``tile`` (cluster
    rank ``rank``'s columns) and its copy predicate (rows past M, columns
    past N masked)."""
    (gC,) = row_tiles(cfg, tile, rank, cute.make_identity_tensor((m, n)))
    coords = thr.partition_S(gC)
    return coords, copy_predicate(coords, m, n, not cfg.covers_n_exactly)


def column_mask(tXcX: cute.Tensor, n) -> cute.Tensor:
    """One Boolean per element of a thread's slice: is its column < N?  For
    values that must be zero in padded columns after a shift (a centred x).
    Plain Python, traced inline, like ``copy_predicate``."""
    mask = cute.make_rmem_tensor(tXcX.shape, Boolean)
    for i in range(cute.size(mask)):
        mask[i] = cute.elem_less(tXcX[i][1], n)
    return mask
