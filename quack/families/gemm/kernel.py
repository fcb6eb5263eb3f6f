"""The persistent Hopper GEMM kernel: D = A @ B, dense or variable-length M.

Roles (one CTA per SM): warpgroup 0 is the producer, one warp of which
issues the TMA loads of A and B into a ring of shared-memory stages; one
consumer warpgroup per 64 rows of the tile (two for 128-row tiles, one for
64-row ones) consumes the stages with WGMMA, each owning its
rows (cooperative), then runs the epilogue: accumulators to 16-bit,
``stmatrix`` into a swizzled shared buffer, one TMA store per tile_m x 32
subtile.
Clusters of two CTAs load a shared operand tile once and multicast it: along
M they share B, along N they share A.

Variable-length M (``cu_seqlens`` given): A is the packed (total_M, K) matrix
and group g's rows ``cu[g]:cu[g+1]`` multiply ``B[g]``.  Tiles index group
rows through a coordinate offset on the TMA tensors, so groups need no
alignment.  The last tile of a group is moved up to end at the group's end
(it recomputes rows of the tile before it), so TMA stores it whole; only a
group shorter than one tile has rows past its end, which load the next
group's rows (or zeros past total_M) and are masked out by a predicated copy.

Variable-length K (``varlen_k``): A is (M, total_K), B (total_K, N) and D
holds G stacked (M, N) products, group g contracting over ``cu[g]:cu[g+1]``
(the weight gradient of a grouped GEMM).  Items are numbered group by group
over the same M x N tiles; each loads its K range through coordinate offsets
on the TMA tensors.  A TMA box must start 16-byte aligned along a contiguous
dimension (an unaligned start is an illegal instruction), so where an
operand is K-major a group's K range starts at its first column rounded
down to a multiple of 8 (where both are M- and N-major, as in the weight
gradient, it starts at the column itself); its first K tile then holds
columns of the group before it and its last one columns of the group
after: the consumers zero those columns of the A and B stages before the
WGMMA.  An empty group's tiles run no K step and store zeros.

Fused epilogue (``activation``, ``has_bias``): D = act(A @ B + bias), bias a
vector of N added in fp32 (each tile's columns staged in shared memory while
its main loop runs), the activation applied in fp32 before the one
rounding; with a ``preact`` tensor the pre-activation A @ B + bias is stored
too (what a backward needs), through the same shared-memory buffers.

Gated epilogue (``activation`` one of ``GATED``): B's columns hold the gate
and up projections interleaved (gate j at column 2j, up j at 2j + 1), and D
has half of them: D[:, j] = act(gate j) * (up j), in fp32.  The accumulator
layout gives each thread columns in adjacent pairs, so a thread holds each
of its gate values beside its up value; the products of one 8-column chunk
land on the four lanes of a quad one column each, where the half-width
MMA's layout (the one the store path expects) wants two adjacent columns
per lane: four shuffles within the quad move them there.  ``preact`` is the
(M, 2N) product.

Backward epilogues (``activation`` one of ``DERIVATIVES``, "d" + a name):
``preact`` is an input, the pre-activation Z a forward saved, read at each
value's own coordinates.  D = (A @ B) * act'(Z); for a gated one, A @ B is
the gradient g of the gated output (M, N) and D (M, 2N) the gradients of the
interleaved gate and up columns, g * up * act'(gate) and g * act(gate):
each lane's D columns 2 j and 2 j + 1 need g_j from the lane holding it
(two shuffles), D laid out as a double-width MMA's (tile_n at most 128).

Split K (``cfg.split_k``, dense only): ``workspace`` (S, W) fp32 gives the
split count S, and each output tile becomes S work items that contract over
consecutive ranges of K's 64-column steps (numbered with the split fastest,
so a tile's splits run side by side).  Every split stores its fp32
accumulators to its own slot of the workspace (those of warps whose rows
are all past M excepted) and counts itself in the
tile's ``counters`` entry; the split that counts last sums the S slots in
split order (so the bits do not depend on which split finished last),
resets the counter to zero for the next launch, and runs the epilogue; the
others store nothing else.  No split waits for another.  The last split's
sum is a chain of dependent reads from L2, one slot after another; where
few warps hold rows of the problem (a decode step: one in four), every
consumer warp sums a share of the owner warps' values over several slots
at once and hands the sums over through the epilogue's shared buffers, so
the chain is a few round trips long, not S.  For a problem whose
tiles alone leave most SMs idle (up to a few hundred rows of tokens times a
weight).

Nothing here depends on M, N, K or the number of groups: they are dynamic, so
one compiled object serves every problem size (see ``quack/families/gemm/signature.py``).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.tensor_utils as tensor_utils
import cutlass.utils.hopper_helpers as sm90
from cutlass import Boolean, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, warp, warpgroup

from quack.families.gemm.activation import activate, activation_derivative, gate_gradients
from quack.families.gemm.config import GemmConfig
from quack.families.gemm.epilogue import parse_epilogue
from quack.families.gemm.schedule import find_group, first_cursor, group_rows, tile_in_group
from quack.families.gemm.threads import THREADS_PER_WARPGROUP, cta_threads

PRODUCER_REGISTERS = 40
CONSUMER_REGISTERS = 232
TILE_K = 64
EPILOGUE_N = 32  # columns per epilogue subtile
EPILOGUE_BUFFERS = 4
WARP_ROWS = 16  # accumulator rows per warp: warp i of a warpgroup holds its rows 16 i to 16 i + 15
SPREAD_LOADS = 64  # split K's spread sum: slot values each thread has in flight
BARRIER_BYTES = 1024  # mbarriers, with the padding to the operands' 1024-byte alignment
EPILOGUE_BARRIER_ID = 1
ZERO_BARRIER_ID = 2
K_ALIGN = 8  # varlen K: group K ranges start at multiples of 8 elements (16 bytes; see the module docstring)

# The kernel's state travels in NamedTuples: the DSL flattens a tuple's values
# in field order, both as kernel parameters and as the values a dynamic loop
# carries, so grouping values changes neither the parameters nor the loops.


class TmaStore(NamedTuple):
    """An output written by TMA: the store atom, the TMA view of the tensor,
    and the tensor itself (for the predicated copy of partial tiles).  The
    atom and view are None for a tensor only read (a derivative's saved
    pre-activation)."""

    atom: Optional[cute.CopyAtom]
    tma_tensor: Optional[cute.Tensor]
    tensor: Optional[cute.Tensor]


class EpilogueOperands(NamedTuple):
    """What the epilogue reads and writes in global memory: D, the bias (or
    None), and the pre-activation (stored by a forward, read by a derivative;
    its tensor None without one)."""

    d: TmaStore
    bias: Optional[cute.Tensor]  # (N,)
    preact: TmaStore


class KernelLayouts(NamedTuple):
    """Trace-time layouts of the kernel: the MMA, the MMA whose accumulator
    layout D's registers take (the MMA itself unless gated), and the shared
    memory layouts of the A and B stages and the epilogue buffers."""

    tiled_mma: cute.TiledMma
    out_mma: cute.TiledMma
    sa: cute.ComposedLayout  # (TILE_M, TILE_K, STAGES)
    sb: cute.ComposedLayout  # (TILE_N, TILE_K, STAGES)
    sd: cute.ComposedLayout  # (TILE_M, EPILOGUE_N, EPILOGUE_BUFFERS)


class TmaLoads(NamedTuple):
    """The producer's TMA atoms and views of A (M, K) and B (N, K, L)."""

    tma_a: cute.CopyAtom
    ta: cute.Tensor
    tma_b: cute.CopyAtom
    tb: cute.Tensor


class SharedTensors(NamedTuple):
    """The CTA's shared memory: A and B stages, epilogue buffers, the tile's bias."""

    a: cute.Tensor  # (TILE_M, TILE_K, STAGES)
    b: cute.Tensor  # (TILE_N, TILE_K, STAGES)
    d: cute.Tensor  # (TILE_M, EPILOGUE_N, EPILOGUE_BUFFERS)
    bias: cute.Tensor  # (TILE_N,) fp32


class Work(NamedTuple):
    """What every role needs to walk the same work items (``schedule.py``):
    the groups, the problem's rows and K columns, the grid of clusters, this
    CTA's place in its cluster, and the split count (1 without split K)."""

    cu_seqlens: Optional[cute.Tensor]
    num_groups: Int32
    total_rows: Int32
    total_k: Int32
    n_clusters: Int32  # clusters along N
    cluster_id: Int32  # this cluster's first work item
    cluster_count: Int32  # the stride between its items
    cta_m: Int32
    cta_n: Int32
    splits: Int32


class Tile(NamedTuple):
    """One CTA's share of a work item, from ``HopperGemm._tile``."""

    valid: Boolean  # False once the items ran out
    group: Int32
    a_row: Int32  # first row of the tile in A
    d_row: Int32  # first row of the tile in D
    rows_left: Int32  # rows of the tile to store (at least tile_m: all)
    n_tile: Int32
    k_start: Int32  # first K column
    k_len: Int32  # K columns
    k_lead: Int32  # leading K columns outside the group (varlen K)
    split: Int32  # which of the tile's K ranges (split K; else 0)
    slot: Int32  # the tile's number among the launch's tiles (split K: its workspace slot and counter)


class SplitK(NamedTuple):
    """Split K's global state (see the module docstring): the (S, W) fp32
    partial sums, one (tile_m * tile_n) slot of W per tile, and one int32
    counter per tile, zero between launches.  Both None without split K."""

    workspace: Optional[cute.Tensor]
    counters: Optional[cute.Tensor]


class SubtileTarget(NamedTuple):
    """Where one output's epilogue subtiles of a tile go: the TMA store atom,
    the shared buffers and global subtiles it partitions, the tensor (for
    the predicated copy) and the tile's first column in it."""

    atom: cute.CopyAtom
    smem_boxes: cute.Tensor  # (TMA, EPILOGUE_BUFFERS)
    gmem_boxes: cute.Tensor  # (TMA, (1, subtiles))
    tensor: cute.Tensor
    first_col: Int32


class SubtileRows(NamedTuple):
    """The rows of a tile to store: all of them (``whole``, one TMA store per
    subtile) or ``rows_left`` from ``first_row`` on (a predicated copy)."""

    whole: Boolean
    rows_left: Int32
    first_row: Int32


class RegistersToShared(NamedTuple):
    """A tiled copy of registers into the epilogue buffers, and this
    thread's partition of the buffers."""

    copy: cute.TiledCopy
    smem: cute.Tensor  # (R2S, R2S_M, R2S_N, EPILOGUE_BUFFERS)


class EpilogueSync(NamedTuple):
    """The consumers' epilogue hand-off: the shared buffers, this thread, the
    warp that issues the TMA stores, the store pipeline that keeps a buffer
    until its store has read it, and the barrier of the consumer threads."""

    sd: cute.Tensor  # (TILE_M, EPILOGUE_N, EPILOGUE_BUFFERS)
    tidx: Int32
    store_warp: Boolean
    store_pipe: pipeline.PipelineTmaStore
    barrier: pipeline.NamedBarrier


class EpilogueRegisters(NamedTuple):
    """A consumer thread's epilogue state: the accumulators, a subtile of them
    in fp32 and in D's dtype, and the store path of the MMA's layout."""

    acc: cute.Tensor  # (MMA, MMA_M, MMA_N) fp32
    acc_coords: cute.Tensor  # (MMA, MMA_M, MMA_N) -> (row, col) in the tile
    r2s_acc: cute.Tensor  # acc retiled for r2s: (R2S, R2S_M, R2S_N * subtiles)
    r2s_coords: cute.Tensor  # acc_coords retiled likewise
    sub_acc: cute.Tensor  # (R2S, R2S_M, R2S_N) fp32, one subtile
    sub_out: cute.Tensor  # the same in D's dtype
    r2s: RegistersToShared


class GatedRegisters(NamedTuple):
    """A gated epilogue's D values, in the half- (double-) width MMA's layout,
    and their store path."""

    coords: cute.Tensor  # (MMA, MMA_M, MMA_N') -> (row, col) in D's tile
    values: cute.Tensor  # (MMA, MMA_M, MMA_N') fp32
    r2s_values: cute.Tensor  # values retiled for r2s: (R2S, R2S_M, R2S_N * out_subtiles)
    sub_out: cute.Tensor  # (R2S, R2S_M, R2S_N) in D's dtype, one subtile
    r2s: RegistersToShared


class HopperGemm:
    """One compiled configuration: tile (``tile_m`` x ``tile_n`` x 64), cluster
    (``cluster_m``, ``cluster_n``), raster band width, dense or varlen.  CTAs of a
    cluster along M share (multicast) the B tile, along N the A tile.

    Call arguments (all dims dynamic): ``a`` (M, K) K-contiguous, or (K, M)
    M-contiguous when ``a_m_major`` (every tensor's unit stride is its last,
    as the launcher's packing wants); ``b``
    (L, K, N) N-contiguous when ``b_n_major`` else (L, N, K) K-contiguous;
    ``d`` (M, N) N-contiguous; ``cu_seqlens`` (L + 1,) int32 or None (dense,
    L = 1); ``max_clusters`` the number of clusters that fit on the device at
    once.  With ``varlen_k``: L = 1, ``cu_seqlens`` (G + 1,) splits K, and
    ``d`` is (G * M, N), the G products stacked.  ``workspace`` (S, W)
    fp32 and ``counters`` (W / (tile_m * tile_n),) int32, zeros, with
    ``split_k`` (both None otherwise); ``bias`` (N,) or None;
    ``preact`` like ``d`` or None (``ACTIVATIONS`` names the activations).
    A gated ``activation`` (``GATED``) makes ``d`` (M, N / 2) and ``preact``
    (M, N) for a B of N interleaved gate and up columns; a derivative
    (``DERIVATIVES``) reads ``preact``, shaped like ``d``: (M, N), or (M, 2N)
    for a gated one.
    """

    def __init__(self, cfg: GemmConfig, a_m_major: bool, b_n_major: bool, varlen_k: bool = False,
                 activation: Optional[str] = None):
        tile_m, tile_n = cfg.tile_m, cfg.tile_n
        self.activation, self.gated, self.derivative = parse_epilogue(activation)
        self.tile_mnk = (tile_m, tile_n, TILE_K)
        # D's columns per tile
        self.out_tile_n = (2 * tile_n if self.derivative else tile_n // 2) if self.gated else tile_n
        if self.out_tile_n > 256:
            raise ValueError(f"a gated derivative's tile is at most 128 columns wide, got {tile_n}")
        self.a_m_major = a_m_major
        self.varlen_k = varlen_k
        self.cluster_m = cfg.cluster_m
        self.cluster_n = cfg.cluster_n
        self.band = cfg.band
        self.split_k = cfg.split_k
        if self.split_k and varlen_k:
            raise ValueError("split K is for dense GEMMs: varlen K already splits K by groups")
        self.b_n_major = b_n_major
        self.consumer_warpgroups = tile_m // 64
        self.threads = cta_threads(tile_m)
        self.consumer_threads = THREADS_PER_WARPGROUP * self.consumer_warpgroups
        self.epi_tile = (tile_m, EPILOGUE_N)
        # Set by __call__ from the tensors it is traced with, read by the device code.
        self.ab_dtype = None  # A's and B's element type
        self.d_dtype = None  # D's (and preact's) element type
        self.d_major = None  # D's LayoutEnum
        self.stages = None  # A/B stages in shared memory
        self.shared_storage = None  # the cute.struct of the CTA's shared memory

    # ---------------------------------------------------------------- host side
    @cute.jit
    def __call__(self, a: cute.Tensor, b: cute.Tensor, d: cute.Tensor, cu_seqlens: Optional[cute.Tensor],
                 bias: Optional[cute.Tensor], preact: Optional[cute.Tensor], max_clusters: Int32,
                 workspace: Optional[cute.Tensor], counters: Optional[cute.Tensor], stream: cuda.CUstream):
        # A as (M, K) and B as (N, K, L), the operand order of the MMA.
        if const_expr(self.a_m_major):
            a = cute.make_tensor(a.iterator, cute.select(a.layout, mode=[1, 0]))
        b = cute.make_tensor(b.iterator, cute.select(b.layout, mode=[2, 1, 0] if self.b_n_major else [1, 2, 0]))
        self.ab_dtype = a.element_type
        self.d_dtype = d.element_type
        a_major = tensor_utils.LayoutEnum.from_tensor(a)
        b_major = tensor_utils.LayoutEnum.from_tensor(b)
        self.d_major = tensor_utils.LayoutEnum.from_tensor(d)
        tiled_mma = self._mma(a_major, b_major, self.tile_mnk[1])
        # The layout of D's values in registers: the MMA's, or for a gated
        # epilogue that of an MMA of half the width.
        out_mma = self._mma(a_major, b_major, self.out_tile_n) if const_expr(self.gated) else tiled_mma
        self.stages = self._stages()
        sa_layout = self._operand_smem_layout(a_major, self.tile_mnk[0])  # (TILE_M, TILE_K, STAGES)
        sb_layout = self._operand_smem_layout(b_major, self.tile_mnk[1])  # (TILE_N, TILE_K, STAGES)
        sd_layout = self._epilogue_smem_layout()  # (TILE_M, EPILOGUE_N, EPILOGUE_BUFFERS)

        tma_a, ta = cpasync.make_tiled_tma_atom(
            _load_op(self.cluster_n), a, cute.slice_(sa_layout, (None, None, 0)), (self.tile_mnk[0], TILE_K),
            num_multicast=self.cluster_n,
        )
        tma_b, tb = cpasync.make_tiled_tma_atom(
            _load_op(self.cluster_m), b, cute.slice_(sb_layout, (None, None, 0)), (self.tile_mnk[1], TILE_K),
            num_multicast=self.cluster_m,
        )
        tma_d, td = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileS2GOp(), d, cute.slice_(sd_layout, (None, None, 0)), self.epi_tile
        )
        tma_p, tp = None, None
        if const_expr(preact is not None and not self.derivative):
            tma_p, tp = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileS2GOp(), preact, cute.slice_(sd_layout, (None, None, 0)), self.epi_tile
            )

        @cute.struct
        class SharedStorage:
            barriers: cute.struct.MemRange[cutlass.Int64, self.stages * 2]
            # (Within the barriers' padding: the split K finalizer's flag.)
            split_flag: cute.struct.MemRange[Int32, 2]
            sa: cute.struct.Align[cute.struct.MemRange[self.ab_dtype, cute.cosize(sa_layout)], 1024]
            sb: cute.struct.Align[cute.struct.MemRange[self.ab_dtype, cute.cosize(sb_layout)], 1024]
            sd: cute.struct.Align[cute.struct.MemRange[self.d_dtype, cute.cosize(sd_layout)], 1024]
            sbias: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, self.tile_mnk[1]], 16]

        self.shared_storage = SharedStorage

        cluster_rows = self.tile_mnk[0] * self.cluster_m
        cluster_cols = self.tile_mnk[1] * self.cluster_n
        n_clusters = (b.shape[0] + (cluster_cols - 1)) // cluster_cols
        num_groups = b.shape[2]
        # Work items: exact for dense; for varlen every group may end in a partial cluster.
        m_bound = (a.shape[0] + (cluster_rows - 1)) // cluster_rows
        if const_expr(self.varlen_k):
            num_groups = cu_seqlens.shape[0] - 1
            m_bound = m_bound * num_groups
        elif const_expr(cu_seqlens is not None):
            m_bound = (a.shape[0] + num_groups * (cluster_rows - 1)) // cluster_rows
        splits = Int32(1)
        if const_expr(self.split_k):
            splits = workspace.shape[0]
        clusters = cutlass.max(cutlass.min(m_bound * n_clusters * splits, max_clusters), 1)
        # (The kernel's parameters in this order: the order fixes its parameter
        # buffer, and the leading ones its mangled name.)
        self.kernel(
            tma_a, ta, tma_b, tb, TmaStore(tma_d, td, d), cu_seqlens, bias, TmaStore(tma_p, tp, preact),
            KernelLayouts(tiled_mma, out_mma, sa_layout, sb_layout, sd_layout), n_clusters, num_groups,
            SplitK(workspace, counters), splits,
        ).launch(
            grid=(self.cluster_m, self.cluster_n, clusters),
            block=(self.threads, 1, 1),
            cluster=(self.cluster_m, self.cluster_n, 1),
            min_blocks_per_mp=1,
            stream=stream,
        )

    def _mma(self, a_major, b_major, tile_n: int):
        return sm90.make_trivial_tiled_mma(
            self.ab_dtype, self.ab_dtype, a_major.sm90_mma_major_mode(), b_major.sm90_mma_major_mode(),
            cutlass.Float32, (self.consumer_warpgroups, 1, 1), tiler_mn=(64, tile_n),
        )

    def _stages(self) -> int:
        """A/B stages that fit beside the epilogue buffers and barriers."""
        tile_m, tile_n, tile_k = self.tile_mnk
        stage_bytes = (tile_m + tile_n) * tile_k * self.ab_dtype.width // 8
        epi_bytes = EPILOGUE_BUFFERS * tile_m * EPILOGUE_N * self.d_dtype.width // 8
        bias_bytes = tile_n * 4
        capacity = cutlass.memory.get_smem_capacity_in_bytes("sm_90")
        return (capacity - BARRIER_BYTES - epi_bytes - bias_bytes) // stage_bytes

    def _operand_smem_layout(self, major: tensor_utils.LayoutEnum, rows: int):
        """Swizzled (rows, 64, stages) layout shared by TMA and WGMMA."""
        k_major = major.sm90_mma_major_mode() == cute.nvgpu.OperandMajorMode.K
        atom = warpgroup.make_smem_layout_atom(
            sm90.get_smem_layout_atom(major, self.ab_dtype, TILE_K if k_major else rows), self.ab_dtype
        )
        return cute.tile_to_shape(atom, (rows, TILE_K, self.stages), order=(0, 1, 2) if k_major else (1, 0, 2))

    def _epilogue_smem_layout(self):
        atom = warpgroup.make_smem_layout_atom(
            sm90.get_smem_layout_atom(self.d_major, self.d_dtype, EPILOGUE_N), self.d_dtype
        )
        return cute.tile_to_shape(atom, (*self.epi_tile, EPILOGUE_BUFFERS), order=(0, 1, 2))

    # -------------------------------------------------------------- device side
    @cute.kernel
    def kernel(self, tma_a: cute.CopyAtom, ta: cute.Tensor, tma_b: cute.CopyAtom, tb: cute.Tensor, d: TmaStore,
               cu_seqlens: Optional[cute.Tensor], bias: Optional[cute.Tensor], preact: TmaStore,
               layouts: KernelLayouts, n_clusters: Int32, num_groups: Int32, split: SplitK, splits: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            cpasync.prefetch_descriptor(tma_a)
            cpasync.prefetch_descriptor(tma_b)
            cpasync.prefetch_descriptor(d.atom)
        cta_rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        cta_m, cta_n = cta_rank % self.cluster_m, cta_rank // self.cluster_m
        cluster_layout = cute.make_layout((1, self.cluster_m, self.cluster_n, 1))

        storage = cutlass.memory.SmemAllocator().allocate(self.shared_storage)
        stage_bytes = cute.size_in_bytes(self.ab_dtype, cute.slice_(layouts.sa, (None, None, 0))) + cute.size_in_bytes(
            self.ab_dtype, cute.slice_(layouts.sb, (None, None, 0))
        )
        # A stage is released by every consumer warp of each CTA that wrote
        # into it: this CTA and its multicast peers (along M for B, along N for A).
        mainloop = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.barriers.data_ptr(),
            num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(
                pipeline.Agent.Thread, (self.cluster_m + self.cluster_n - 1) * self.consumer_warpgroups * 4
            ),
            tx_count=stage_bytes,
            cta_layout_vmnk=cluster_layout,
            defer_sync=True,
        )
        pipeline.pipeline_init_arrive(cluster_shape_mn=cluster_layout, is_relaxed=True)

        smem = SharedTensors(
            a=storage.sa.get_tensor(layouts.sa.outer, swizzle=layouts.sa.inner),
            b=storage.sb.get_tensor(layouts.sb.outer, swizzle=layouts.sb.inner),
            d=storage.sd.get_tensor(layouts.sd.outer, swizzle=layouts.sd.inner),
            bias=storage.sbias.get_tensor(cute.make_layout(self.tile_mnk[1])),
        )

        work = Work(
            cu_seqlens=cu_seqlens,
            num_groups=num_groups,
            total_rows=ta.shape[0],
            total_k=ta.shape[1],
            n_clusters=n_clusters,
            cluster_id=cute.arch.block_idx()[2],
            cluster_count=cute.arch.grid_dim()[2],
            cta_m=cta_m,
            cta_n=cta_n,
            splits=splits,
        )
        pipeline.pipeline_init_wait(cluster_shape_mn=cluster_layout)

        warpgroup_idx = cute.arch.make_warp_uniform(tidx // THREADS_PER_WARPGROUP)
        if warpgroup_idx == 0:
            cute.arch.setmaxregister_decrease(PRODUCER_REGISTERS)
            if warp_idx == 0:
                self._produce(TmaLoads(tma_a, ta, tma_b, tb), smem, mainloop, work)
        else:
            cute.arch.setmaxregister_increase(CONSUMER_REGISTERS)
            self._consume(layouts, EpilogueOperands(d, bias, preact), smem, mainloop, work, split,
                          storage.split_flag.get_tensor(cute.make_layout(2)), tidx - THREADS_PER_WARPGROUP, warp_idx)

    @cute.jit
    def _tile(self, work: Work, item, cursor):
        """Advance the cursor (None: start at group 0) to ``item``; returns the
        cursor and this CTA's ``Tile`` of the item.

        The last tile of a group of at least ``tile_m`` rows is moved up to end
        at the group's end (for a K-contiguous A): it recomputes rows of the
        tile before it (both write correct values there) and is stored whole
        by TMA, where a tile hanging over the next group would need a
        predicated store."""
        tile_m = self.tile_mnk[0]
        cu_seqlens, num_groups, total_rows = work.cu_seqlens, work.num_groups, work.total_rows
        split = Int32(0)
        if const_expr(self.split_k):
            # Work items number (tile, split) pairs, the split fastest.
            split = item % work.splits
            item = item // work.splits
        if const_expr(self.varlen_k):
            # Every group has all M rows; only its K range differs.
            m_clusters = (total_rows + (tile_m * self.cluster_m - 1)) // (tile_m * self.cluster_m)
            per_group = cutlass.max(m_clusters * work.n_clusters, 1)
            group = item // per_group
            row_start, rows, first_item = group * total_rows, total_rows, group * per_group
            k_start, k_len = group_rows(cu_seqlens, group, num_groups, work.total_k)
            k_lead = Int32(0)
            if const_expr(not (self.a_m_major and self.b_n_major)):
                # (K is strided in M- and N-major operands: any start will do,
                # and only a group's last stage needs zeroing.)
                if k_len > 0:
                    k_lead = k_start % K_ALIGN
            k_start, k_len = k_start - k_lead, k_len + k_lead
            cursor = group
        else:
            if const_expr(cursor is None):
                cursor = first_cursor(cu_seqlens, num_groups, total_rows, tile_m * self.cluster_m)
            cursor = find_group(cu_seqlens, num_groups, total_rows, item, cursor, tile_m * self.cluster_m,
                                work.n_clusters)
            group, first_item, m_clusters = cursor.group, cursor.first_item, cursor.m_clusters
            row_start, rows = cursor.row_start, cursor.rows
            k_start, k_len, k_lead = Int32(0), work.total_k, Int32(0)
            if const_expr(self.split_k):
                k_start, k_len = _split_range(work.total_k, split, work.splits)
        # max(.., 1): an exhausted cursor (group == num_groups) has no M clusters.
        m_cluster, n_cluster = tile_in_group(item - first_item, cutlass.max(m_clusters, 1), work.n_clusters,
                                             self.band)
        tile_row = (m_cluster * self.cluster_m + work.cta_m) * tile_m
        if const_expr(not self.a_m_major):
            # (An M-contiguous A's box must start at a multiple of 8 rows: its
            # last tile stays in place, stored by the predicated copy.)
            if rows >= tile_m:
                tile_row = cutlass.min(tile_row, rows - tile_m)
        rows_left = rows - tile_row
        a_row = tile_row if const_expr(self.varlen_k) else row_start + tile_row
        tile = Tile(valid=group < num_groups, group=group, a_row=a_row, d_row=row_start + tile_row,
                    rows_left=rows_left, n_tile=n_cluster * self.cluster_n + work.cta_n, k_start=k_start,
                    k_len=k_len, k_lead=k_lead, split=split,
                    slot=item * (self.cluster_m * self.cluster_n) + work.cta_n * self.cluster_m + work.cta_m)
        return cursor, tile

    @cute.jit
    def _produce(self, loads: TmaLoads, smem: SharedTensors, mainloop: pipeline.PipelineTmaAsync, work: Work):
        """Producer warp: TMA loads of A and B tiles, stage by stage."""
        tma_a, ta = loads.tma_a, loads.ta
        tma_b, tb = loads.tma_b, loads.tb
        sa, sb = smem.a, smem.b
        cta_m, cta_n = work.cta_m, work.cta_n
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        cluster = cute.make_layout((self.cluster_m, self.cluster_n, 1))
        a_mask = cute.make_layout_image_mask(cluster, (cta_m, cta_n, 0), mode=1)
        b_mask = cute.make_layout_image_mask(cluster, (cta_m, cta_n, 0), mode=0)
        item = work.cluster_id
        cursor, tile = self._tile(work, item, None)
        while tile.valid:
            # (TILE_M, TILE_K, k_tiles)
            ga = cute.local_tile(cute.domain_offset((tile.a_row, tile.k_start), ta), (self.tile_mnk[0], TILE_K),
                                 (0, None))
            b_group = 0 if const_expr(self.varlen_k) else tile.group
            # (TILE_N, TILE_K, k_tiles)
            gb = cute.local_tile(cute.domain_offset((0, tile.k_start), tb[None, None, b_group]),
                                 (self.tile_mnk[1], TILE_K), (tile.n_tile, None))
            # (TMA, STAGES) and (TMA, k_tiles)
            tas, tag = cpasync.tma_partition(tma_a, cta_n, cute.make_layout(self.cluster_n),
                                             cute.group_modes(sa, 0, 2), cute.group_modes(ga, 0, 2))
            tbs, tbg = cpasync.tma_partition(tma_b, cta_m, cute.make_layout(self.cluster_m),
                                             cute.group_modes(sb, 0, 2), cute.group_modes(gb, 0, 2))
            for k in cutlass.range((tile.k_len + (TILE_K - 1)) // TILE_K, unroll=1):
                mainloop.producer_acquire(state)
                barrier = mainloop.producer_get_barrier(state)
                _tma_load(tma_a, tag[None, k], tas[None, state.index], barrier, a_mask, self.cluster_n)
                _tma_load(tma_b, tbg[None, k], tbs[None, state.index], barrier, b_mask, self.cluster_m)
                mainloop.producer_commit(state)
                state.advance()
            item = item + work.cluster_count
            cursor, tile = self._tile(work, item, cursor)
        mainloop.producer_tail(state)

    @cute.jit
    def _consume(self, layouts: KernelLayouts, operands: EpilogueOperands, smem: SharedTensors,
                 mainloop: pipeline.PipelineTmaAsync, work: Work, split: SplitK, split_flag, tidx, warp_idx):
        """Consumer warpgroups (``tidx`` counts their threads): WGMMA over the
        stages, then the epilogue (with split K, only the tile's last split
        to finish runs it, on the sum of the splits)."""
        tiled_mma = layouts.tiled_mma
        sa, sb = smem.a, smem.b
        thr_mma = tiled_mma.get_slice(tidx)
        frag_a = tiled_mma.make_fragment_A(thr_mma.partition_A(sa))  # (MMA, MMA_M, MMA_K, STAGES)
        frag_b = tiled_mma.make_fragment_B(thr_mma.partition_B(sb))  # (MMA, MMA_N, MMA_K, STAGES)
        acc_shape = thr_mma.partition_C(cute.make_identity_tensor(self.tile_mnk[:2])).shape
        acc = cute.make_rmem_tensor(acc_shape, cutlass.Float32)  # (MMA, MMA_M, MMA_N)
        k_blocks = cute.size(frag_a, mode=[2])
        tiled_mma.set(warpgroup.Field.ACCUMULATE, True)

        regs, gated = self._epilogue_registers(layouts, smem.d, thr_mma, acc, tidx)
        store_pipe = pipeline.PipelineTmaStore.create(
            num_stages=EPILOGUE_BUFFERS,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.consumer_threads),
        )
        epi_barrier = pipeline.NamedBarrier(barrier_id=EPILOGUE_BARRIER_ID, num_threads=self.consumer_threads)
        store_warp = warp_idx == THREADS_PER_WARPGROUP // 32  # the first consumer warp
        sync = EpilogueSync(smem.d, tidx, store_warp, store_pipe, epi_barrier)

        read_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        release_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        item = work.cluster_id
        stores = Int32(0)  # subtiles stored so far: the next shared buffer
        cursor, tile = self._tile(work, item, None)
        while tile.valid:
            if const_expr(operands.bias is not None):
                # The tile's bias columns, read once while the main loop runs
                # (the last tile's epilogue ended on a barrier: no thread
                # still reads them).
                self._stage_bias(operands.bias, smem.bias, tile.n_tile * self.tile_mnk[1],
                                 operands.d.tensor.shape[1], tidx)
            # Mainloop: one WGMMA batch stays in flight; its stage is released one step late.
            acc.fill(0.0)
            k_tiles = (tile.k_len + (TILE_K - 1)) // TILE_K
            for k in cutlass.range(k_tiles, unroll=1):
                mainloop.consumer_wait(read_state)
                if const_expr(self.varlen_k):
                    # The stage's columns outside the group: [lo, hi) are its own.
                    lo, hi = tile.k_lead - k * TILE_K, tile.k_len - k * TILE_K
                    if (lo > 0) | (hi < TILE_K):
                        self._zero_outside_group(sa[None, None, read_state.index], sb[None, None, read_state.index],
                                                 lo, hi, tidx)
                warpgroup.fence()
                for kb in cutlass.range_constexpr(k_blocks):
                    cute.gemm(tiled_mma, acc, frag_a[None, None, kb, read_state.index],
                              frag_b[None, None, kb, read_state.index], acc)
                warpgroup.commit_group()
                warpgroup.wait_group(1)
                if k > 0:
                    mainloop.consumer_release(release_state)
                    release_state.advance()
                read_state.advance()
            warpgroup.wait_group(0)
            # The last stage (none for an empty group of varlen K; the op
            # returns zeros for K = 0 itself).
            if k_tiles > 0:
                mainloop.consumer_release(release_state)
                release_state.advance()

            if const_expr(self.split_k):
                if self._split_sum(acc, split, tile, work.splits, split_flag, sync):
                    stores = self._epilogue(regs, gated, operands, smem.bias, tile, sync, stores)
            else:
                stores = self._epilogue(regs, gated, operands, smem.bias, tile, sync, stores)
            item = item + work.cluster_count
            cursor, tile = self._tile(work, item, cursor)
        store_pipe.producer_tail()

    @cute.jit
    def _split_sum(self, acc, split: SplitK, tile: Tile, splits, flag, sync: EpilogueSync):
        """Split K's hand-off (see the module docstring): store this split's
        accumulators to its workspace slot and count it; True for the split
        that counted last, whose ``acc`` then holds the sum of all S slots,
        added in split order.  One split alone keeps its accumulators."""
        last = Boolean(True)
        tidx, store_warp, barrier, sd = sync.tidx, sync.store_warp, sync.barrier, sync.sd
        if splits > 1:
            # Thread t's value v at v * threads + t: each store and load of a
            # warp covers consecutive words.
            threads = self.consumer_threads
            base = tile.slot * (self.tile_mnk[0] * self.tile_mnk[1])
            # Only warps holding rows of the problem store and sum: the
            # others' rows are past M, which the epilogue does not store (a
            # decode call's 64-row tile has one warp of real rows in four).
            real_warps = cutlass.min((tile.rows_left + (WARP_ROWS - 1)) // WARP_ROWS, threads // 32)
            real_rows = tidx // 32 < real_warps
            batch = self._spread_batch(acc)
            # Spread where its chain (per owner warp: the slot batches and the
            # hand-off) is no longer than the owners' own chain of S slots.
            spread = Boolean(False)
            if const_expr(batch > 0):
                spread = real_warps * ((splits + (batch - 1)) // batch + 1) <= splits
            if real_rows:
                slot = split.workspace[tile.split, None]
                for v in cutlass.range_constexpr(cute.size(acc)):
                    slot[base + tidx + v * threads] = acc[v]
            if store_warp & spread:
                # (The spread sum's scratch is the epilogue's shared buffers:
                # the last tile's TMA stores must have read them.)
                cute.arch.cp_async_bulk_wait_group(0, read=True)
            # The barrier orders every thread's partial sums before thread 0's
            # count, whose release is cumulative; its acquire, and the barrier
            # after it, order the other splits' sums before this CTA's reads
            # (the pattern of CUTLASS's split-K semaphore).
            barrier.arrive_and_wait()
            if tidx == 0:
                counter = split.counters.iterator + tile.slot
                arrived = cute.arch.atomic_add(counter, Int32(1), sem="acq_rel", scope="gpu")
                is_last = arrived == splits - 1
                if is_last:
                    cute.arch.store(counter, Int32(0))  # every split has counted: ready for the next launch
                flag[0] = Int32(is_last)
            barrier.arrive_and_wait()
            last = flag[0] != 0
            if last:
                if spread:
                    self._spread_sum(acc, split.workspace, base, splits, real_warps, batch, sd, tidx, barrier)
                elif real_rows:
                    self._chain_sum(acc, split.workspace, base + tidx, splits)
        return last

    @cute.jit
    def _chain_sum(self, acc, workspace, offset, splits):
        """``acc`` = the sum of this thread's values (from ``offset`` on, one
        every ``consumer_threads`` words) over the S slots, in split order."""
        threads = self.consumer_threads
        # (cg: from L2, where the other SMs' stores went, never a stale L1 line.)
        first = workspace[0, None].iterator + offset
        for v in cutlass.range_constexpr(cute.size(acc)):
            acc[v] = cute.arch.load(first + v * threads, cutlass.Float32, cop="cg")
        for s in cutlass.range(1, splits, unroll=1):
            ptr = workspace[s, None].iterator + offset
            for v in cutlass.range_constexpr(cute.size(acc)):
                acc[v] = acc[v] + cute.arch.load(ptr + v * threads, cutlass.Float32, cop="cg")

    def _spread_batch(self, acc) -> int:
        """Slots each thread of the spread sum loads at once: ``SPREAD_LOADS``
        values over its share of a warp's values; 0 (no spread sum) where a
        warp's values do not share evenly among the warps or do not fit the
        epilogue buffers."""
        values, warps = cute.size(acc), self.consumer_threads // 32
        scratch_bytes = self.tile_mnk[0] * EPILOGUE_N * EPILOGUE_BUFFERS * self.d_dtype.width // 8
        if values % warps or values * 32 * 4 > scratch_bytes:
            return 0
        return max(SPREAD_LOADS // (values // warps), 1)

    @cute.jit
    def _spread_sum(self, acc, workspace, base, splits, real_warps, batch: int, sd, tidx, barrier):
        """The last split's sum where few warps hold rows of the problem: for
        each such warp (the owner), every consumer warp sums its share of the
        owner's values over ``batch`` slots at a time, in split order (the
        same bits as the owner summing alone), into the shared buffers, from
        which the owner reads its ``acc``."""
        threads = self.consumer_threads
        values = cute.size(acc)
        share = values // (threads // 32)
        lane, warp = tidx % 32, tidx // 32
        scratch = cute.make_tensor(cute.recast_ptr(sd.iterator, dtype=cutlass.Float32),
                                   cute.make_layout(values * 32))  # (values, lanes) of the owner
        loaded = cute.make_rmem_tensor(batch * share, cutlass.Float32)
        sums = cute.make_rmem_tensor(share, cutlass.Float32)
        for owner in cutlass.range(real_warps, unroll=1):
            # Value v of thread (owner, lane) sits at v * threads + 32 owner + lane of a slot.
            offset = base + (warp * share) * threads + owner * 32 + lane
            for first in cutlass.range(0, splits, batch, unroll=1):
                for u in cutlass.range_constexpr(batch):
                    if first + u < splits:
                        ptr = workspace[first + u, None].iterator + offset
                        for j in cutlass.range_constexpr(share):
                            loaded[u * share + j] = cute.arch.load(ptr + j * threads, cutlass.Float32, cop="cg")
                for u in cutlass.range_constexpr(batch):
                    if first + u < splits:
                        for j in cutlass.range_constexpr(share):
                            if const_expr(u == 0):
                                if first == 0:
                                    sums[j] = loaded[j]
                                else:
                                    sums[j] = sums[j] + loaded[j]
                            else:
                                sums[j] = sums[j] + loaded[u * share + j]
            for j in cutlass.range_constexpr(share):
                scratch[(warp * share + j) * 32 + lane] = sums[j]
            barrier.arrive_and_wait()
            if warp == owner:
                for v in cutlass.range_constexpr(values):
                    acc[v] = scratch[v * 32 + lane]
            barrier.arrive_and_wait()

    @cute.jit
    def _epilogue_registers(self, layouts: KernelLayouts, sd, thr_mma, acc, tidx):
        """The epilogue's register tensors and store paths around the
        accumulators ``acc``: (``EpilogueRegisters``, ``GatedRegisters`` or
        None)."""
        # Registers -> shared (stmatrix) -> global (TMA or predicated copy).
        r2s = epilogue_copy(layouts.tiled_mma, self.d_major, self.d_dtype)
        thr_r2s = r2s.get_slice(tidx)
        r2s_sd = thr_r2s.partition_D(sd)  # (R2S, R2S_M, R2S_N, EPILOGUE_BUFFERS)
        r2s_acc = r2s.retile(acc)  # (R2S, R2S_M, R2S_N * subtiles)
        sub_shape = cute.shape(thr_r2s.partition_S(sd))[:3]  # (R2S, R2S_M, R2S_N)
        sub_acc = cute.make_rmem_tensor(sub_shape, cutlass.Float32)
        sub_out = cute.make_rmem_tensor(sub_shape, self.d_dtype)
        acc_coords = thr_mma.partition_C(cute.make_identity_tensor(self.tile_mnk[:2]))  # (MMA, MMA_M, MMA_N)
        gated = None
        if const_expr(self.gated):
            # D's values in the half- (double-) width MMA's layout, and its store path.
            out_coords = layouts.out_mma.get_slice(tidx).partition_C(
                cute.make_identity_tensor((self.tile_mnk[0], self.out_tile_n))
            )  # (MMA, MMA_M, MMA_N')
            values = cute.make_rmem_tensor(out_coords.shape, cutlass.Float32)
            r2s_out = epilogue_copy(layouts.out_mma, self.d_major, self.d_dtype)
            r2s_out_sd = r2s_out.get_slice(tidx).partition_D(sd)  # (R2S, R2S_M, R2S_N, EPILOGUE_BUFFERS)
            r2s_values = r2s_out.retile(values)  # (R2S, R2S_M, R2S_N * out_subtiles)
            gated_sub = cute.make_rmem_tensor(cute.shape(r2s_out.get_slice(tidx).partition_S(sd))[:3], self.d_dtype)
            gated = GatedRegisters(out_coords, values, r2s_values, gated_sub, RegistersToShared(r2s_out, r2s_out_sd))
        # (row, col) in the tile of each accumulator, in sub_acc's order (as r2s_acc is built).
        r2s_coords = r2s.retile(thr_mma.partition_C(cute.make_identity_tensor(self.tile_mnk[:2])))
        regs = EpilogueRegisters(acc, acc_coords, r2s_acc, r2s_coords, sub_acc, sub_out, RegistersToShared(r2s, r2s_sd))
        return regs, gated

    @cute.jit
    def _epilogue(self, regs: EpilogueRegisters, gated: Optional[GatedRegisters], operands: EpilogueOperands,
                  sbias, tile: Tile, sync: EpilogueSync, stores):
        """Per 32-column subtile, bias and activation in fp32, then registers
        -> shared (stmatrix) -> global (TMA, or a predicated copy).  Returns
        ``stores`` advanced by the subtiles stored."""
        bias, preact = operands.bias, operands.preact
        stores_preact = preact.tensor is not None and not self.derivative
        rows = SubtileRows(whole=tile.rows_left >= self.tile_mnk[0], rows_left=tile.rows_left, first_row=tile.d_row)
        d_target = self._subtile_target(operands.d, sync.sd, tile, self.out_tile_n)
        p_target = None
        if const_expr(stores_preact):
            p_target = self._subtile_target(preact, sync.sd, tile, self.tile_mnk[1])
        if const_expr(self.derivative and not self.gated):
            self._scale_by_derivative(regs.acc, regs.acc_coords, preact.tensor, rows, d_target.first_col)
        if const_expr(bias is not None):
            sync.barrier.arrive_and_wait()  # every thread's share of the bias is in
        sub_acc, sub_out, r2s_acc = regs.sub_acc, regs.sub_out, regs.r2s_acc
        for sub in cutlass.range_constexpr(self.tile_mnk[1] // EPILOGUE_N):
            for v in cutlass.range_constexpr(cute.size(sub_acc)):
                sub_acc[v] = r2s_acc[sub * cute.size(sub_acc) + v]
            if const_expr(bias is not None):
                for v in cutlass.range_constexpr(cute.size(sub_acc)):
                    sub_acc[v] = sub_acc[v] + sbias[regs.r2s_coords[sub * cute.size(sub_acc) + v][1]]
            if const_expr(stores_preact):
                sub_out.store(sub_acc.load().to(self.d_dtype))
                self._store_subtile(sub_out, regs.r2s, p_target, sub, stores % EPILOGUE_BUFFERS, rows, sync)
                stores = stores + 1
            if const_expr(not self.gated):
                if const_expr(self.activation is not None and not self.derivative):
                    for v in cutlass.range_constexpr(cute.size(sub_acc)):
                        sub_acc[v] = activate(sub_acc[v], self.activation)
                sub_out.store(sub_acc.load().to(self.d_dtype))
                self._store_subtile(sub_out, regs.r2s, d_target, sub, stores % EPILOGUE_BUFFERS, rows, sync)
                stores = stores + 1
        if const_expr(self.gated):
            if const_expr(self.derivative):
                self._gate_gradients(regs.acc, gated, preact.tensor, rows, d_target.first_col, sync.tidx)
            else:
                self._gate(regs.acc, gated.values, sync.tidx)
            gated_sub, r2s_values = gated.sub_out, gated.r2s_values
            per_sub = cute.size(gated_sub)
            for sub in cutlass.range_constexpr(self.out_tile_n // EPILOGUE_N):
                for v in cutlass.range_constexpr(per_sub):
                    gated_sub[v] = r2s_values[sub * per_sub + v].to(self.d_dtype)
                self._store_subtile(gated_sub, gated.r2s, d_target, sub, stores % EPILOGUE_BUFFERS, rows, sync)
                stores = stores + 1
        return stores

    @cute.jit
    def _stage_bias(self, bias, sbias, col0, n, tidx):
        """The tile's bias columns ``col0`` on into shared memory as fp32, each
        consumer thread a share; zeros past N (those columns are not stored)."""
        tile_n = self.tile_mnk[1]
        for j in cutlass.range_constexpr((tile_n + self.consumer_threads - 1) // self.consumer_threads):
            i = tidx + j * self.consumer_threads
            if i < tile_n:
                value = cutlass.Float32(0.0)
                if col0 + i < n:
                    value = bias[col0 + i].to(cutlass.Float32)
                sbias[i] = value

    def _subtile_target(self, store: TmaStore, sd, tile: Tile, tile_n: int) -> SubtileTarget:
        """The TMA store partitions (shared buffers, global subtiles) of
        ``store``'s output tile at ``tile``, of ``tile_n`` columns."""
        # (TILE_M, tile_n)
        g = cute.local_tile(cute.domain_offset((tile.d_row, 0), store.tma_tensor), (self.tile_mnk[0], tile_n),
                            (0, tile.n_tile))
        # (TMA, EPILOGUE_BUFFERS) and (TMA, (1, tile_n / EPILOGUE_N))
        smem_boxes, gmem_boxes = cpasync.tma_partition(store.atom, 0, cute.make_layout(1), cute.group_modes(sd, 0, 2),
                                                       cute.zipped_divide(g, self.epi_tile))
        return SubtileTarget(store.atom, smem_boxes, gmem_boxes, store.tensor, tile.n_tile * tile_n)

    @cute.jit
    def _store_subtile(self, values, r2s: RegistersToShared, target: SubtileTarget, sub: int, buffer,
                       rows: SubtileRows, sync: EpilogueSync):
        """Subtile ``sub`` (32 columns) of ``values`` to the target: through
        shared ``buffer``, stored whole by TMA or row by row (a partial
        tile)."""
        store_warp, store_pipe, epi_barrier = sync.store_warp, sync.store_pipe, sync.barrier
        cute.copy(r2s.copy, values, r2s.smem[None, None, None, buffer])
        cute.arch.fence_proxy("async.shared", space="cta")
        epi_barrier.arrive_and_wait()
        if rows.whole:
            if store_warp:
                cute.copy(target.atom, target.smem_boxes[None, buffer], target.gmem_boxes[None, (0, sub)])
        elif rows.rows_left > 0:
            self._store_rows(sync.sd[None, None, buffer], target.tensor, rows.first_row,
                             target.first_col + sub * EPILOGUE_N, rows.rows_left, sync.tidx)
        if store_warp:
            # Every subtile, stored by TMA or not: the wait keeps a buffer
            # from being refilled while an earlier TMA store still reads it.
            store_pipe.producer_commit()
            store_pipe.producer_acquire()
        epi_barrier.arrive_and_wait()

    @cute.jit
    def _gate(self, acc, gated, tidx):
        """``gated`` = act(gate) * up, from the accumulators of interleaved gate
        and up columns, in the half-width MMA's layout.  Both layouts give lane
        q of a quad columns 2q and 2q + 1 of each 8-column chunk, value index c
        + 2 r + 4 chunk (c the column of the pair, r the row half): D chunk j
        comes from accumulator chunks 2 j (D columns 8 j + q, on lane q) and 2
        j + 1 (8 j + 4 + q), and lane q wants D columns 8 j + 2 q + c, held
        by lane (2 q + c) % 4, in its first chunk when q < 2."""
        lane = tidx % 32
        q = lane % 4
        for j in cutlass.range_constexpr(cute.size(gated) // 4):
            for r in cutlass.range_constexpr(2):
                first = 8 * j + 2 * r  # accumulator chunk 2 j, row half r: (gate, up)
                x0 = activate(acc[first], self.activation) * acc[first + 1]
                x1 = activate(acc[first + 4], self.activation) * acc[first + 5]
                for c in cutlass.range_constexpr(2):
                    source = lane - q + (2 * q + c) % 4
                    low = cute.arch.shuffle_sync(x0, source)
                    high = cute.arch.shuffle_sync(x1, source)
                    gated[4 * j + 2 * r + c] = cutlass.Float32(cutlass.select_(q >= 2, high, low))

    @cute.jit
    def _scale_by_derivative(self, acc, coords, z, rows: SubtileRows, col0):
        """acc *= act'(Z) at each value's coordinates (tile ``coords``; the
        tile's first row ``rows.first_row``, first column ``col0``); values
        outside the group's rows or Z's columns are never stored."""
        tile_start, rows_left = rows.first_row, rows.rows_left
        for i in cutlass.range_constexpr(cute.size(acc)):
            row, col = coords[i]
            if (row < rows_left) & (col0 + col < z.shape[1]):
                acc[i] = acc[i] * activation_derivative(z[tile_start + row, col0 + col].to(cutlass.Float32),
                                                   self.activation)

    @cute.jit
    def _gate_gradients(self, acc, gated: GatedRegisters, z, rows: SubtileRows, col0, tidx):
        """``gated.values`` (the double-width MMA's layout) = the gradients of
        the gate and up columns of the saved Z, from ``acc``, the gated
        output's gradient g.  Lane q of a quad holds D columns 8 c + 2 q and + 1 of
        chunk c: gate and up of g's column j = 4 c + q, which lives on lane
        (j % 8) // 2 at index j % 2 + 2 r + 4 (j // 8)."""
        grads, coords = gated.values, gated.coords
        tile_start, rows_left = rows.first_row, rows.rows_left
        lane = tidx % 32
        q = lane % 4
        for c in cutlass.range_constexpr(cute.size(grads) // 4):
            for r in cutlass.range_constexpr(2):
                first = 2 * r + 4 * (c // 2)
                source = lane - q + (4 * (c % 2) + q) // 2
                low = cute.arch.shuffle_sync(acc[first], source)
                high = cute.arch.shuffle_sync(acc[first + 1], source)
                g = cutlass.Float32(cutlass.select_(q % 2 == 1, high, low))
                row, col = coords[4 * c + 2 * r]
                grads[4 * c + 2 * r] = cutlass.Float32(0.0)
                grads[4 * c + 2 * r + 1] = cutlass.Float32(0.0)
                if (row < rows_left) & (col0 + col < z.shape[1]):
                    gate = z[tile_start + row, col0 + col].to(cutlass.Float32)
                    up = z[tile_start + row, col0 + col + 1].to(cutlass.Float32)
                    grads[4 * c + 2 * r], grads[4 * c + 2 * r + 1] = gate_gradients(g, gate, up, self.activation)

    @cute.jit
    def _zero_outside_group(self, sa_stage, sb_stage, lo, hi, tidx):
        """Zero the K columns of an A and a B stage before ``lo`` and from
        ``hi`` on: they belong to the groups before and after this one (varlen
        K), which the tile's TMA boxes reached into.  Both operands, so that a
        non-finite value in a neighbouring group (0 x inf) stays there.  Every
        consumer thread takes a share, then all of them wait for the writes
        to reach the WGMMA's (async) proxy."""
        for stage, rows, mn_major in ((sa_stage, self.tile_mnk[0], self.a_m_major),
                                      (sb_stage, self.tile_mnk[1], self.b_n_major)):
            if const_expr(mn_major):
                self._zero_columns_mn_major(stage, rows, lo, hi, tidx)
            else:
                zero = self.ab_dtype(0.0)
                for j in cutlass.range_constexpr(rows * TILE_K // self.consumer_threads):
                    i = tidx + j * self.consumer_threads
                    row, col = i % rows, i // rows
                    if (col < lo) | (col >= hi):
                        stage[row, col] = zero
        cute.arch.fence_proxy("async.shared", space="cta")
        pipeline.NamedBarrier(barrier_id=ZERO_BARRIER_ID, num_threads=self.consumer_threads).arrive_and_wait()

    @cute.jit
    def _zero_columns_mn_major(self, stage, rows: int, lo, hi, tidx):
        """The columns outside [lo, hi) of an M- (N-) major stage, 16 bytes per
        store: a column is contiguous there, and the swizzle moves whole
        16-byte chunks.  (The varlen-K weight gradient's operands, Xᵀ and dY,
        are both of this kind.)"""
        vec = 128 // self.ab_dtype.width
        lanes = rows // vec  # threads along a column
        zero_copy = cute.make_tiled_copy_tv(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.ab_dtype, num_bits_per_copy=128),
            cute.make_layout((lanes, self.consumer_threads // lanes), stride=(1, lanes)),
            cute.make_layout((vec, 1)),
        )
        thr = zero_copy.get_slice(tidx)
        dst = thr.partition_D(stage)
        crd = thr.partition_D(cute.make_identity_tensor((rows, TILE_K)))
        zeros = cute.make_rmem_tensor_like(dst[None, 0, 0])
        zeros.fill(0.0)
        for i in cutlass.range_constexpr(cute.size(dst, mode=[1])):
            for j in cutlass.range_constexpr(cute.size(dst, mode=[2])):
                col = crd[0, i, j][1]
                if (col < lo) | (col >= hi):
                    cute.copy(zero_copy, zeros, dst[None, i, j])

    @cute.jit
    def _store_rows(self, sd_buffer, d, tile_start, col0, rows_left, tidx):
        """Predicated copy of one epilogue subtile to global memory: the rows of a
        group's last tile that belong to the group, and columns inside N."""
        vec = 128 // self.d_dtype.width
        lanes_n = EPILOGUE_N // vec
        copy = cute.make_tiled_copy_tv(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.d_dtype, num_bits_per_copy=128),
            cute.make_layout((self.consumer_threads // lanes_n, lanes_n), stride=(lanes_n, 1)),
            cute.make_layout((1, vec)),
        )
        gd = cute.local_tile(cute.domain_offset((tile_start, col0), d), self.epi_tile, (0, 0))
        # Row strides are multiples of 8 elements and col0 of 32: every row starts
        # 16-byte aligned, which the offset arithmetic does not tell the compiler.
        gd = cute.make_tensor(
            cute.make_ptr(self.d_dtype, gd.iterator.toint(), cute.AddressSpace.gmem, assumed_align=16), gd.layout
        )
        coords = cute.make_identity_tensor(self.epi_tile)
        thr = copy.get_slice(tidx)
        src, dst, crd = thr.partition_S(sd_buffer), thr.partition_D(gd), thr.partition_D(coords)
        cols_left = d.shape[1] - col0
        for i in cutlass.range_constexpr(cute.size(src, mode=[1])):
            for j in cutlass.range_constexpr(cute.size(src, mode=[2])):
                row, col = crd[0, i, j]
                if (row < rows_left) & (col < cols_left):
                    cute.copy(copy, src[None, i, j], dst[None, i, j])


def epilogue_copy(tiled_mma, d_major, d_dtype):
    """The epilogue's tiled copy of accumulators to shared memory.  The
    stmatrix atom lays it out for every output dtype (a plain-store atom
    would permute each thread's values); the store itself is
    ``get_smem_store_op``'s: stmatrix for 16-bit outputs, plain stores for
    fp32.  tests/test_gemm_epilogue_layout.py checks where values land."""
    store_atom = cute.make_copy_atom(warp.StMatrix8x8x16bOp(d_major.is_m_major_c(), 4), d_dtype)
    return cute.make_tiled_copy_S(
        sm90.get_smem_store_op(d_major, elem_ty_d=d_dtype, elem_ty_acc=cutlass.Float32),
        cute.make_tiled_copy_C_atom(store_atom, tiled_mma),
    )


def _split_range(total_k, split, splits):
    """(first K column, K columns) of ``split`` of ``splits``: consecutive
    ranges of whole 64-column steps, the first ``steps % splits`` ranges one
    step longer; a split past the steps gets none (and sums zeros)."""
    steps = (total_k + (TILE_K - 1)) // TILE_K
    base, extra = steps // splits, steps % splits
    first = split * base + cutlass.min(split, extra)
    count = base + Int32(split < extra)
    k_start = first * TILE_K
    return k_start, cutlass.max(cutlass.min(count * TILE_K, total_k - k_start), 0)


def _tma_load(atom, src, dst, barrier, mask, multicast: int):
    """One TMA load completing on ``barrier``; multicast with ``mask`` when shared."""
    if const_expr(multicast > 1):
        cute.copy(atom, src, dst, tma_bar_ptr=barrier, mcast_mask=mask)
    else:
        cute.copy(atom, src, dst, tma_bar_ptr=barrier)


def _load_op(multicast: int):
    """TMA load, multicast to the cluster peers that share the tile."""
    return cpasync.CopyBulkTensorTileG2SMulticastOp() if multicast > 1 else cpasync.CopyBulkTensorTileG2SOp()
