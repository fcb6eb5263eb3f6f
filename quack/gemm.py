"""Hopper GEMM as a cached, torch-callable op: ``quack.gemm(A, B, out_dtype, cu_seqlens_m)``.

Dense: A (M, K) @ B (K, N), B row- or column-major.  Variable-length M:
A (total_M, K) packed by groups, B (G, K, N), ``cu_seqlens_m`` (G + 1,) int32
with cu[0] = 0, non-decreasing, cu[G] = total_M; group g's rows
``A[cu[g]:cu[g+1]]`` multiply ``B[g]`` (empty groups are fine).  bf16 or fp16
inputs, fp32 accumulation, bf16 or fp16 output (the input dtype by default).

The compiled object depends on the dtypes, B's layout, dense or varlen and the
tile configuration, never on M, N, K or G: those are dynamic, so one object
serves every problem size and compile-only warming works from tests that size
their inputs with ``.item()`` on fake tensors.  TMA needs K and N multiples of
8, row strides multiples of 8 elements and 16-byte aligned bases: checked with
a clear error before any launch.

Tile configuration (``gemm_config``): 128 x 256 x 64 tiles, two consumer
warpgroups, clusters of two CTAs along M sharing each B tile, output tiles
walked in bands of 8 cluster columns.  A varlen GEMM with fewer than 2048 rows
per group on average pairs CTAs along N instead (sharing each A tile): a
cluster then spans 128 rows, not 256, and the partial tile at the end of each
group wastes half as much.  N <= 128 uses 128 x 128 tiles so that half of each
tile is not wasted.  Measured in tools/bench/gemm_configs.py; no autotuning
happens at call time.  A varlen call's plan holds the objects of both
classes of group size (the rows per group are a runtime size, and a sentinel
under compile-only).

The kernel lives in ``quack/gemm_kernels.py`` (work order:
``quack/gemm_schedule.py``).  Test: ``pytest tests/test_gemm.py``; benchmark:
``python tools/bench/gemm.py``.
"""

from __future__ import annotations

from typing import ClassVar, NamedTuple, Optional

import torch

from quack import fastpath, occupancy
from quack import torch_interop as ti
from quack.cache import compile_options, jit_cache
from quack.compile_only import is_compile_only
from quack.cute_op import cute_op
from quack.plan import Kernel, Plan, Signature, plan_for, signature
from quack.gemm_threads import cta_threads

INPUT_DTYPES = (torch.bfloat16, torch.float16)
_ALIGN_ELEMENTS = 8  # 16 bytes of a 16-bit dtype
LARGE_GROUP_ROWS = 2048  # varlen: from this many rows per group on, clusters pair CTAs along M


class GemmConfig(NamedTuple):
    """Static tile configuration: part of the object key."""

    tile_m: int = 128
    tile_n: int = 256
    cluster_m: int = 2
    cluster_n: int = 1
    band: int = 8


def gemm_config(n: int, rows_per_group: Optional[float] = None) -> GemmConfig:
    """The documented heuristic (see the module docstring); ``rows_per_group``
    is total_M / G for a varlen GEMM, None for a dense one."""
    tile_n = 128 if n <= 128 else 256
    if rows_per_group is not None and rows_per_group < LARGE_GROUP_ROWS:
        # Pair CTAs along N: a cluster then spans 128 rows, not 256, and the
        # partial tile that ends each group wastes half as much.
        return GemmConfig(tile_n=tile_n, cluster_m=1, cluster_n=2)
    return GemmConfig(tile_n=tile_n)


# This op's eager fast path (quack/fastpath.py).
_FAST = fastpath.Closures()


@jit_cache("gemm")
def compile_gemm(ab_dtype: str, d_dtype: str, b_n_major: bool, varlen: bool, config: tuple):
    """Compile one configuration; every dimension is symbolic."""
    import cutlass.cute as cute
    from cutlass import Int32

    from quack.gemm_kernels import HopperGemm

    cfg = GemmConfig(*config)
    ab, dt = ti.cute_dtype(ab_dtype), ti.cute_dtype(d_dtype)
    m, n, k, groups = cute.sym_int(), cute.sym_int(), cute.sym_int(), cute.sym_int()

    def stride():
        return cute.sym_int64(divisibility=_ALIGN_ELEMENTS)

    fake = cute.runtime.make_fake_tensor
    a = fake(ab, (m, k), (stride(), 1), assumed_align=16)
    b = fake(ab, (groups, k, n) if b_n_major else (groups, n, k), (stride(), stride(), 1), assumed_align=16)
    d = fake(dt, (m, n), (stride(), 1), assumed_align=16)
    cu = cute.runtime.make_fake_compact_tensor(Int32, (cute.sym_int(),), assumed_align=4) if varlen else None
    kernel = HopperGemm(cfg.tile_m, cfg.tile_n, cfg.cluster_m, cfg.cluster_n, cfg.band, b_n_major)
    return cute.compile(kernel, a, b, d, cu, Int32(1), cute.runtime.make_fake_stream(), options=compile_options())


# A varlen plan holds one object per class of rows per group: which one
# runs depends on a runtime size (and on a sentinel under compile-only).
GROUP_CLASSES = (("small_groups", 1.0), ("large_groups", float(LARGE_GROUP_ROWS)))


@signature
class GemmCall(Signature):
    """What decides a ``quack.gemm`` call's kernels: the input and output
    dtypes, B's layout (N-contiguous or not), dense or varlen, and the tile
    width ``gemm_config`` picks for N."""

    OP: ClassVar[str] = "gemm"
    ab_dtype: str
    out_dtype: str
    b_n_major: bool
    varlen: bool
    tile_n: int

    def kernels(self):
        args = (self.ab_dtype, self.out_dtype, self.b_n_major, self.varlen)
        if not self.varlen:
            return (("dense", Kernel(compile_gemm, (*args, tuple(gemm_config(self.tile_n))))),)
        return tuple(
            (role, Kernel(compile_gemm, (*args, tuple(gemm_config(self.tile_n, rows))))) for role, rows in GROUP_CLASSES
        )


def call_signature(a, b3, out, cu_seqlens, b_n_major: bool) -> GemmCall:
    """The signature of a call on validated operands (b3 as ``_b_view`` gives it)."""
    return GemmCall(
        ti.dtype_name(a.dtype), ti.dtype_name(out.dtype), b_n_major, cu_seqlens is not None,
        gemm_config(out.shape[1]).tile_n,
    )


def _run(plan: Plan, a, b3, out, cu_seqlens) -> None:
    """Check TMA's alignment rules on the tensors the kernel gets, then warm
    (compile-only) or launch the plan's object for this size."""
    _check_tma("A", a)
    _check_tma("B", b3)
    if is_compile_only():
        plan.warm()
        return
    role = "dense"
    if cu_seqlens is not None:
        small = a.shape[0] / max(1, b3.shape[0]) < LARGE_GROUP_ROWS
        role = GROUP_CLASSES[0][0] if small else GROUP_CLASSES[1][0]
    kernel = plan.kernel_of(role)
    _launch(kernel.load(), GemmConfig(*kernel.args[-1]), a, b3, out, cu_seqlens)


@cute_op("quack::gemm", mutates_args=("out",))
def _gemm(a: torch.Tensor, b3: torch.Tensor, out: torch.Tensor, cu_seqlens: Optional[torch.Tensor],
          b_n_major: bool) -> None:
    """The registered op, which torch.compile's graphs call: b3 is (L, K, N)
    if ``b_n_major`` else (L, N, K); the plan comes from the real tensors."""
    _run(plan_for(call_signature(a, b3, out, cu_seqlens, b_n_major)), a, b3, out, cu_seqlens)


def launch_gemm(a, b3, out, cu_seqlens, b_n_major: bool, cfg: GemmConfig) -> None:
    """Run a configuration of the caller's choice on validated operands
    (tools/bench/gemm_configs.py compares them; the op runs its plan's)."""
    kernel = compile_gemm(ti.dtype_name(a.dtype), ti.dtype_name(out.dtype), b_n_major, cu_seqlens is not None,
                          tuple(cfg))
    _launch(kernel, cfg, a, b3, out, cu_seqlens)


def _launch(kernel, cfg: GemmConfig, a, b3, out, cu_seqlens) -> None:
    # One CTA per SM (the tiles' shared memory).
    max_clusters = occupancy.resident_clusters(
        a.device.index or 0, cta_threads(cfg.tile_m), cfg.cluster_m * cfg.cluster_n, ctas_per_sm=1
    )
    kernel(a, b3, out, cu_seqlens, max_clusters, ti.current_stream(a.device))


def _check_operand(name: str, t: torch.Tensor, like: Optional[torch.Tensor]) -> None:
    ti.check_float(name, t, INPUT_DTYPES if like is None else (like.dtype,))
    ti.check_cuda(name, t, like)


def _check_tma(name: str, t: torch.Tensor) -> None:
    """TMA wants a 16-byte aligned base and 16-byte multiples for every
    stride but the unit one."""
    if ti.address(t) % 16:
        raise ValueError(f"{name} must start at a 16-byte aligned address (TMA)")
    for dim, stride in enumerate(t.stride()[:-1]):
        if stride % _ALIGN_ELEMENTS:
            raise ValueError(f"{name} stride {stride} of dim {dim} must be a multiple of {_ALIGN_ELEMENTS} (TMA)")


def _b_view(b: torch.Tensor):
    """B (L, K, N) as the kernel takes it: (L, K, N) N-contiguous, or (L, N, K)
    K-contiguous for column-major B; anything else is copied row-major."""
    if b.stride(-1) == 1 or b.shape[-1] == 1:
        return b, True
    if b.stride(-2) == 1:
        return b.transpose(-1, -2), False
    return b.contiguous(), True


def _check_dims(a, b, cu_seqlens) -> None:
    if a.dim() != 2:
        raise ValueError(f"A must be 2-D (M, K), got shape {tuple(a.shape)}")
    if cu_seqlens is None:
        if b.dim() != 2:
            raise ValueError(f"B must be 2-D (K, N) for a dense GEMM, got shape {tuple(b.shape)}")
    else:
        if b.dim() != 3:
            raise ValueError(f"B must be 3-D (G, K, N) with cu_seqlens_m, got shape {tuple(b.shape)}")
        if cu_seqlens.dtype != torch.int32:
            raise TypeError(f"cu_seqlens_m must be int32, got {cu_seqlens.dtype}")
        ti.check_cuda("cu_seqlens_m", cu_seqlens, a)
        if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] != b.shape[0] + 1:
            raise ValueError(
                f"cu_seqlens_m must have shape ({b.shape[0] + 1},) for {b.shape[0]} groups, "
                f"got {tuple(cu_seqlens.shape)}"
            )
    if a.shape[1] != b.shape[-2]:
        raise ValueError(f"K mismatch: A is {tuple(a.shape)}, B is {tuple(b.shape)}")
    k, n = a.shape[1], b.shape[-1]
    if k % _ALIGN_ELEMENTS or n % _ALIGN_ELEMENTS:
        raise ValueError(f"K = {k} and N = {n} must be multiples of {_ALIGN_ELEMENTS} (TMA)")


def gemm(A: torch.Tensor, B: torch.Tensor, out_dtype: Optional[torch.dtype] = None,
         cu_seqlens_m: Optional[torch.Tensor] = None) -> torch.Tensor:
    """A @ B (dense) or the grouped product described in the module docstring.

    Raises TypeError for wrong dtypes and ValueError for wrong devices, shapes,
    strides or alignment, before any launch.  A is copied to row-major if it is
    not; B may be row- or column-major (per group).  Not differentiable.
    Grouped: output rows outside [cu[0], cu[G]) are left unwritten; a
    malformed cu_seqlens_m gives wrong rows, never an access outside A or D.
    """
    key = fastpath.describe(A, B, cu_seqlens_m, _OUT_DTYPE_CODES.get(out_dtype, -1))
    out = _FAST.call(key, A, B, out_dtype)
    if out is not NotImplemented:
        return out
    _check_operand("A", A, None)
    _check_operand("B", B, A)
    ti.check_arch("quack.gemm", A.device, "an sm_90 GPU (Hopper's WGMMA)", (9, 0), maximum=(9, 0))
    out_dtype = A.dtype if out_dtype is None else out_dtype
    if out_dtype not in INPUT_DTYPES:
        raise TypeError(f"out_dtype must be torch.bfloat16 or torch.float16, got {out_dtype}")
    _check_dims(A, B, cu_seqlens_m)
    a = A if A.stride(-1) == 1 or A.shape[-1] == 1 else A.contiguous()
    b3, b_n_major = _b_view(B if B.dim() == 3 else B.unsqueeze(0))
    m, k, n = a.shape[0], a.shape[1], B.shape[-1]
    groups = b3.shape[0]
    if max(m, n, k) + groups * 256 >= 2**31:
        raise ValueError(f"M = {m}, N = {n}, K = {k} with {groups} groups: dims must stay below 2^31 (int32)")
    if cu_seqlens_m is not None and groups == 0 and m > 0:
        raise ValueError(f"cu_seqlens_m has no groups but A has {m} rows")
    out = torch.empty(m, n, device=A.device, dtype=out_dtype)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    cu = cu_seqlens_m.contiguous() if cu_seqlens_m is not None else None
    a, b3 = _unit_strides(a), _unit_strides(b3)
    if torch.compiler.is_compiling():
        # No addresses while torch.compile traces: the registered op takes
        # its plan from the real tensors when the graph runs.
        _gemm(a, b3, out, cu, b_n_major)
    else:
        plan = plan_for(call_signature(a, b3, out, cu, b_n_major))
        _run(plan, a, b3, out, cu)
        if cu is None and a is A and b3.data_ptr() == B.data_ptr():  # views, no copies
            _FAST.remember(key, lambda: _dense_closure(plan, b3, out))
    return out


# The fast path's key spells out_dtype as a number (-1: one the checks refuse).
_OUT_DTYPE_CODES = {None: 0, torch.bfloat16: 1, torch.float16: 2}


def _dense_closure(plan: Plan, b3: torch.Tensor, out: torch.Tensor):
    """The eager fast path's launch for dense calls like this one
    (``quack/fastpath.py``): the same shapes and strides, so B's view and
    the grid are this call's."""
    kernel = plan.kernel_of("dense")
    launch = fastpath.direct(plan, "dense", out.device)
    if launch is None:
        return None
    cfg = GemmConfig(*kernel.args[-1])
    max_clusters = occupancy.resident_clusters(
        out.device.index or 0, cta_threads(cfg.tile_m), cfg.cluster_m * cfg.cluster_n, ctas_per_sm=1
    )
    b_shape, b_strides = tuple(b3.shape), b3.stride()
    out_shape, out_dtype, device = tuple(out.shape), out.dtype, out.device
    empty = torch.empty

    def run(A, B, _out_dtype):  # the key fixed out_dtype
        out = empty(out_shape, device=device, dtype=out_dtype)
        b = B.as_strided(b_shape, b_strides)
        return out if launch(A, b, out, None, max_clusters, None) is None else NotImplemented

    return run


def _unit_strides(t: torch.Tensor) -> torch.Tensor:
    """The same view with each size-1 dim's (meaningless) stride replaced by
    the extent of what follows it, so every stride meets TMA's rules."""
    if 1 not in t.shape[:-1]:
        return t
    strides = list(t.stride())
    for dim in range(t.dim() - 2, -1, -1):
        if t.shape[dim] == 1:
            strides[dim] = t.shape[dim + 1] * strides[dim + 1]
    return t.as_strided(t.shape, strides)


def gemm_ref(A: torch.Tensor, B: torch.Tensor, out_dtype: Optional[torch.dtype] = None,
             cu_seqlens_m: Optional[torch.Tensor] = None) -> torch.Tensor:
    """fp32 reference, rounded to the output dtype (grouped: rows cu[0] to cu[G])."""
    out_dtype = A.dtype if out_dtype is None else out_dtype
    if cu_seqlens_m is None:
        return (A.float() @ B.float()).to(out_dtype)
    bounds = cu_seqlens_m.tolist()
    pieces = [
        A.narrow(0, bounds[g], bounds[g + 1] - bounds[g]).float() @ B.select(0, g).float()
        for g in range(B.shape[0])
    ]
    if not pieces:
        return torch.empty(0, B.shape[-1], device=A.device, dtype=out_dtype)
    return torch.cat(pieces).to(out_dtype)
