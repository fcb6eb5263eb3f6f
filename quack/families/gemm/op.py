"""Hopper GEMM as cached, torch-callable ops: ``quack.gemm(A, B, out_dtype,
cu_seqlens_m, cu_seqlens_k, bias, activation)`` and ``quack.gemm_glu``.

Dense: A (M, K) @ B (K, N), each row- or column-major.  Variable-length M:
A (total_M, K) packed by groups, B (G, K, N), ``cu_seqlens_m`` (G + 1,) int32
with cu[0] = 0, non-decreasing, cu[G] = total_M; group g's rows
``A[cu[g]:cu[g+1]]`` multiply ``B[g]`` (empty groups are fine).  bf16 or fp16
inputs, fp32 accumulation, bf16, fp16 or fp32 output (the input dtype by default).
Variable-length K: A (M, total_K), B (total_K, N), ``cu_seqlens_k`` (G + 1,)
int32 splitting total_K; returns (G, M, N), group g contracting over
``cu[g]:cu[g+1]`` (an empty group gives zeros): the weight gradient of a
grouped GEMM, whose A is a transposed view (an M-contiguous A, not copied).

Gated (``gemm_glu``): act(A @ B_gate) * (A @ B_up) with B's gate and up
columns interleaved, (M, N) from B's 2N columns, in the same kernel's
epilogue (``quack/families/gemm/kernel.py``).

Autograd: dA = dC @ Bᵀ and dB = Aᵀ @ dC are this same kernel on views, the
transposes flipping those operands' layouts (an M-contiguous A is one of the
kernel's two A layouts), so nothing is copied; the forward saves A and B
themselves.  A call that will be differentiated plans the backward's
products with its own kernel, so warming it warms them too.  A call grouped
by rows has dB[g] = A[rows of g]ᵀ @ dC[rows of g], the variable-length-K
product.  With an activation, the backward's dZ = dC * act'(Z) comes first,
from the saved pre-activation Z (``quack/families/gemm/dact.py``).

The compiled object depends on the dtypes, A's and B's layouts, the
grouping (dense, rows, K) and the tile configuration, never on M, N, K or G: those are dynamic, so one object
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

The kernel lives in ``quack/families/gemm/kernel.py`` (work order:
``quack/families/gemm/schedule.py``).  Test: ``pytest tests/test_gemm.py``; benchmark:
``python tools/bench/gemm.py``.
"""

from __future__ import annotations

from typing import ClassVar, NamedTuple, Optional

import torch

from quack.calls import occupancy
from quack.calls import torch_interop as ti
from quack.cache import compile_options, jit_cache
from quack.calls import fastpath
from quack.compile_only import autograd_available, differentiable_outputs, is_compile_only
from quack.calls.cute_op import cute_op
from quack.calls.plan import Kernel, Plan, Signature, blame, fake_tensor, plan_for, signature, torch_dtype
from quack.families.gemm.dact import activation_grad, activation_grad_kernel
from quack.families.gemm.epilogue import (DERIVATIVES, GATED, TORCH_ACTIVATIONS, check_activation, out_columns,
                                 parse_epilogue)
from quack.families.gemm.threads import cta_threads

INPUT_DTYPES = (torch.bfloat16, torch.float16)
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # fp32: weight gradients kept unrounded
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


# This op's eager fast path (quack/calls/fastpath.py).
_FAST = fastpath.Closures()


@jit_cache("gemm")
def compile_gemm(ab_dtype: str, d_dtype: str, a_m_major: bool, b_n_major: bool, grouping: str,
                 activation: Optional[str], bias_dtype: Optional[str], store_preact: bool, config: tuple):
    """Compile one configuration; every dimension is symbolic.  ``a_m_major``:
    A's M dimension is the contiguous one (a transposed view, as Aᵀ is in a
    weight gradient); ``b_n_major``: B's N dimension is; ``grouping``: one of
    ``GROUPINGS``; the epilogue's activation, bias dtype (None: no bias) and
    whether it also stores the pre-activation (for a backward)."""
    import cutlass.cute as cute
    from cutlass import Int32

    from quack.families.gemm.kernel import HopperGemm

    cfg = GemmConfig(*config)
    ab, dt = ti.cute_dtype(ab_dtype), ti.cute_dtype(d_dtype)
    m, n, k, groups = cute.sym_int(), cute.sym_int(), cute.sym_int(), cute.sym_int()

    def stride():
        return cute.sym_int64(divisibility=_ALIGN_ELEMENTS)

    def fake(dtype, shape, rank):
        # The launcher's convention (quack/launch/launcher.py): dynamic strides
        # lead, the unit stride is the last one.  An M-contiguous A therefore
        # goes to the kernel as its (K, M) transpose.
        return cute.runtime.make_fake_tensor(dtype, shape, (*(stride() for _ in range(rank - 1)), 1), assumed_align=16)

    a = fake(ab, (k, m) if a_m_major else (m, k), 2)
    b = fake(ab, (groups, k, n) if b_n_major else (groups, n, k), 3)
    _, gated, derivative = parse_epilogue(activation)
    d_cols = cute.sym_int() if gated else n  # gated: half of B's columns, a derivative twice
    d = fake(dt, (m, d_cols), 2)
    # A forward's stored pre-activation, or the one a derivative reads (shaped like D).
    preact = fake(dt, (m, d_cols if derivative else n), 2) if store_preact or derivative else None
    compact = cute.runtime.make_fake_compact_tensor
    grouped = grouping != "dense"
    cu = compact(Int32, (cute.sym_int(),), assumed_align=4) if grouped else None
    bias = compact(ti.cute_dtype(bias_dtype), (n,), assumed_align=4) if bias_dtype else None
    kernel = HopperGemm(cfg.tile_m, cfg.tile_n, cfg.cluster_m, cfg.cluster_n, cfg.band, a_m_major, b_n_major,
                        varlen_k=grouping == "varlen_k", activation=activation)
    return cute.compile(kernel, a, b, d, cu, bias, preact, Int32(1), cute.runtime.make_fake_stream(),
                        options=compile_options())

# dense; grouped by rows (cu_seqlens_m); grouped along K (cu_seqlens_k).
GROUPINGS = ("dense", "varlen_m", "varlen_k")
# A varlen-M plan holds one object per class of rows per group: which one
# runs depends on a runtime size (and on a sentinel under compile-only).
GROUP_CLASSES = (("small_groups", 1.0), ("large_groups", float(LARGE_GROUP_ROWS)))


@signature
class GemmCall(Signature):
    """What decides a ``quack.gemm`` call's kernels: the input and output
    dtypes, A's and B's layouts (M- or N-contiguous, or K-contiguous), the
    grouping (``GROUPINGS``), the tile width ``gemm_config`` picks for B's N, whether autograd
    will run the call's backward and, if so, the tile width of dA's product
    (``gemm_config`` of K; 0 without a backward), and the fused epilogue:
    activation (gated ones: ``gemm_glu``) and bias dtype (None: none).  A
    training call with an activation also stores the pre-activation."""

    OP: ClassVar[str] = "gemm"
    ARCHS: ClassVar[tuple[str, ...]] = ("sm_90a",)  # WGMMA and TMA multicast: Hopper's own
    ab_dtype: str
    out_dtype: str
    a_m_major: bool
    b_n_major: bool
    grouping: str
    tile_n: int
    backward: bool
    grad_a_tile_n: int
    activation: Optional[str]
    bias_dtype: Optional[str]

    def kernels(self):
        if self.grouping not in GROUPINGS:
            raise ValueError(f"gemm grouping must be one of {GROUPINGS}, got {self.grouping!r}")
        store_preact = self.backward and self.activation is not None
        args = (self.ab_dtype, self.out_dtype, self.a_m_major, self.b_n_major, self.grouping, self.activation,
                self.bias_dtype, store_preact)
        if self.grouping != "varlen_m":
            own = ((self.grouping, Kernel(compile_gemm, (*args, tuple(gemm_config(self.tile_n))))),)
        else:
            own = tuple(
                (role, Kernel(compile_gemm, (*args, tuple(gemm_config(self.tile_n, rows)))))
                for role, rows in GROUP_CLASSES
            )
        # The backward's products are GEMM calls of their own, listed here so
        # that warming this call warms them too; with an activation, the
        # elementwise kernel of dZ comes before them.
        grads = tuple(
            (f"{name}:{role}", kernel)
            for name, call in self.gradient_calls()
            for role, kernel in call.kernels()
        )
        if store_preact:
            grads = (("activation_grad", activation_grad_kernel(self.out_dtype, self.activation)),) + grads
        return own + grads

    def gradient_calls(self) -> tuple[tuple[str, "GemmCall"], ...]:
        """The calls the backward makes when autograd hands it a row-major dC
        (torch's ops mostly do; a column-major one has plans of its own, and
        one the kernel cannot read is copied row-major): dA = dC @ Bᵀ and dB = Aᵀ @ dC (for grouped rows: over each
        group's rows, a variable-length K).  Both in the inputs' dtype,
        through views: Bᵀ and Aᵀ flip those operands' layouts."""
        if not self.backward:
            return ()
        ab = self.ab_dtype
        grad_a = GemmCall(ab, ab, False, not self.b_n_major, self.grouping, self.grad_a_tile_n, False, 0, None, None)
        grad_b_grouping = "varlen_k" if self.grouping == "varlen_m" else "dense"
        grad_b = GemmCall(ab, ab, not self.a_m_major, True, grad_b_grouping, self.tile_n, False, 0, None, None)
        return (("grad_a", grad_a), ("grad_b", grad_b))

    def rebuild(self) -> "GemmCall":
        """The op's checks and signature of a call whose operands have these
        fields (``plan.from_entry``): A (M, K), B (K, N) or (G, K, N) in the
        fields' layouts, with N the tile width (K dA's), so that ``gemm_config``
        can give it back; a derivative epilogue as ``quack.mlp``'s backward
        makes its dZ product (no bias, the inputs' dtype, no backward)."""
        m, k, n, groups = 256, _dim_for(self.grad_a_tile_n), _dim_for(self.tile_n), 2
        a = fake_tensor(self, "ab_dtype", (k, m)).t() if self.a_m_major else fake_tensor(self, "ab_dtype", (m, k))
        batch = (groups,) if self.grouping == "varlen_m" else ()
        if self.b_n_major:
            b = fake_tensor(self, "ab_dtype", (*batch, k, n))
        else:
            b = fake_tensor(self, "ab_dtype", (*batch, n, k)).transpose(-1, -2)
        cu = torch.empty(groups + 1, device="cuda", dtype=torch.int32)
        cu_m = cu if self.grouping == "varlen_m" else None
        cu_k = cu if self.grouping == "varlen_k" else None
        with blame(self, "ab_dtype"):
            _check_operand("A", a, None)
        if self.activation in DERIVATIVES:
            _check_gemm("quack.mlp", a, b, None, cu_m, cu_k, None, None)
            _check_epilogue(None, self.activation, a, b, cu_k)
            ops, cu = _call_operands(a, b, a.dtype, cu_m, cu_k, None, self.activation, False)
            return _signature(ops, cu, False)
        # Each field's own check first, which names it; then all of the op's, in its order.
        gated = self.activation in GATED
        op = "quack.gemm_glu" if gated else "quack.gemm"
        _check_call(op, a, b, None, cu_m, cu_k)
        out_dtype = torch_dtype(self, "out_dtype")
        with blame(self, "out_dtype"):
            _check_call(op, a, b, out_dtype, cu_m, cu_k)
        with blame(self, "activation"):
            check_activation(self.activation, gated)
        bias = None if gated else fake_tensor(self, "bias_dtype", (n,))
        with blame(self, "bias_dtype"):
            _check_epilogue(bias, None, a, b, None)
        out_dtype = _check_gemm(op, a, b, out_dtype, cu_m, cu_k, bias, self.activation, gated)
        with blame(self, "backward"):
            ops, cu = _call_operands(a, b, out_dtype, cu_m, cu_k, bias, self.activation, self.backward)
        return _signature(ops, cu, self.backward)


def _dim_for(tile: int) -> int:
    """A dimension for which ``gemm_config`` picks the tile width ``tile``:
    the width itself, as TMA takes it (a multiple of 8)."""
    return max(_ALIGN_ELEMENTS, tile - tile % _ALIGN_ELEMENTS)


def call_signature(a, b3, out, cu_seqlens, a_m_major: bool, b_n_major: bool, backward: bool = False,
                   activation: Optional[str] = None, bias: Optional[torch.Tensor] = None) -> GemmCall:
    """The signature of a call on validated operands (a and b3 as ``_a_view``
    and ``_b_view`` give them; out (G, M, N) for varlen K)."""
    tile_n = gemm_config(_columns(b3, b_n_major)).tile_n
    _, gated, derivative = parse_epilogue(activation)
    if gated and derivative:
        tile_n = min(tile_n, 128)  # its D tile is twice as wide, at most the MMA's 256
    return GemmCall(
        ti.dtype_name(a.dtype), ti.dtype_name(out.dtype), a_m_major, b_n_major, grouping_of(out, cu_seqlens),
        tile_n, backward, gemm_config(a.shape[1]).tile_n if backward else 0,
        activation, ti.dtype_name(bias.dtype) if bias is not None else None,
    )


def _columns(b3: torch.Tensor, b_n_major: bool) -> int:
    """B's N (the accumulator's columns) from its kernel view."""
    return b3.shape[2] if b_n_major else b3.shape[1]


def grouping_of(out: torch.Tensor, cu_seqlens: Optional[torch.Tensor]) -> str:
    """A call's grouping: varlen K writes G stacked (M, N) products."""
    if cu_seqlens is None:
        return "dense"
    return "varlen_k" if out.dim() == 3 else "varlen_m"


def _run(plan: Plan, a, b3, out, cu_seqlens, bias=None, preact=None) -> None:
    """Check TMA's alignment rules on the tensors the kernel gets, then warm
    (compile-only) or launch the plan's object for this size."""
    _check_tma("A", a, 0 if plan.signature.a_m_major else -1)
    _check_tma("B", b3)
    if bias is not None and ti.address(bias) % 4:  # here, not in gemm(): torch.compile traces that
        raise ValueError("bias must start at a 4-byte aligned address")
    if is_compile_only():
        plan.warm()
        return
    role = plan.signature.grouping
    if role == "varlen_m":
        small = a.shape[0] / max(1, b3.shape[0]) < LARGE_GROUP_ROWS
        role = GROUP_CLASSES[0][0] if small else GROUP_CLASSES[1][0]
    kernel = plan.kernel_of(role)
    a = a.t() if plan.signature.a_m_major else a  # the kernel takes an M-contiguous A as (K, M)
    _launch(kernel.load(), GemmConfig(*kernel.args[-1]), a, b3, out.flatten(0, -2), cu_seqlens, bias, preact)


@cute_op("quack::gemm", mutates_args=("out", "preact"))
def _gemm(a: torch.Tensor, b3: torch.Tensor, out: torch.Tensor, cu_seqlens: Optional[torch.Tensor],
          bias: Optional[torch.Tensor], preact: Optional[torch.Tensor], a_m_major: bool, b_n_major: bool,
          activation: Optional[str]) -> None:
    """The registered op, which torch.compile's graphs call: a is (M, K),
    M-contiguous if ``a_m_major``; b3 is (L, K, N) if ``b_n_major`` else
    (L, N, K); out is (M, N), or (G, M, N) for varlen K; ``preact`` given for
    a training call with an activation; the plan comes from the real
    tensors."""
    backward = preact is not None and not parse_epilogue(activation)[2]  # a derivative reads preact
    sig = call_signature(a, b3, out, cu_seqlens, a_m_major, b_n_major, backward, activation, bias)
    _run(plan_for(sig), a, b3, out, cu_seqlens, bias, preact)


def launch_gemm(a, b3, out, cu_seqlens, b_n_major: bool, cfg: GemmConfig, a_m_major: bool = False) -> None:
    """Run a configuration of the caller's choice on validated operands
    (tools/bench/gemm_configs.py compares them; the op runs its plan's)."""
    kernel = compile_gemm(ti.dtype_name(a.dtype), ti.dtype_name(out.dtype), a_m_major, b_n_major,
                          grouping_of(out, cu_seqlens), None, None, False, tuple(cfg))
    _launch(kernel, cfg, a.t() if a_m_major else a, b3, out.flatten(0, -2), cu_seqlens)


def _launch(kernel, cfg: GemmConfig, a, b3, out, cu_seqlens, bias=None, preact=None) -> None:
    """Launch on the kernel's views (an M-contiguous A as (K, M)); one CTA per
    SM (the tiles' shared memory)."""
    max_clusters = occupancy.resident_clusters(
        a.device.index or 0, cta_threads(cfg.tile_m), cfg.cluster_m * cfg.cluster_n, ctas_per_sm=1
    )
    kernel(a, b3, out, cu_seqlens, bias, preact, max_clusters, ti.current_stream(a.device))


def _check_operand(name: str, t: torch.Tensor, like: Optional[torch.Tensor]) -> None:
    ti.check_float(name, t, INPUT_DTYPES if like is None else (like.dtype,))
    ti.check_cuda(name, t, like)


def _check_tma(name: str, t: torch.Tensor, unit_dim: int = -1) -> None:
    """TMA wants a 16-byte aligned base and 16-byte multiples for every
    stride but the unit one (``unit_dim``)."""
    if ti.address(t) % 16:
        raise ValueError(f"{name} must start at a 16-byte aligned address (TMA)")
    for dim, stride in enumerate(t.stride()):
        if dim == unit_dim % t.dim():
            continue
        if stride % _ALIGN_ELEMENTS or (stride == 0 and t.shape[dim] > 1):
            raise ValueError(
                f"{name} stride {stride} of dim {dim} must be a nonzero multiple of {_ALIGN_ELEMENTS} (TMA; "
                "pass a copy of a broadcast view)"
            )


def _a_view(a: torch.Tensor, grouping: str):
    """(A as the kernel takes it, M-major?): K-contiguous as it is; an
    M-contiguous A (a transposed view, with a stride TMA takes) as it is,
    except for grouped rows (whose tiles start at any row); anything else
    copied row-major."""
    if a.stride(-1) == 1:
        return a, False
    if a.stride(-2) == 1 and a.stride(-1) % _ALIGN_ELEMENTS == 0 and grouping != "varlen_m":
        return a, True
    if a.shape[-1] == 1:
        return a, False  # K = 1: K's stride means nothing (``_unit_strides``)
    return _row_major(a), False


def _b_view(b: torch.Tensor):
    """B (L, K, N) as the kernel takes it: (L, K, N) N-contiguous, or (L, N, K)
    K-contiguous for column-major B; anything else is copied row-major."""
    if b.stride(-1) == 1 or b.shape[-1] == 1:
        return b, True
    if b.stride(-2) == 1:
        return b.transpose(-1, -2), False
    return _row_major(b), True


def _row_major(t: torch.Tensor) -> torch.Tensor:
    """A row-major copy of ``t``; under compile-only, a new tensor of its
    shape (only its layout matters there, and fake strided tensors cannot be
    copied)."""
    if is_compile_only():
        return torch.empty(t.shape, dtype=t.dtype, device=t.device)
    return t.contiguous()


def _check_cu(name: str, cu: torch.Tensor, a: torch.Tensor, groups: Optional[int]) -> None:
    """cu_seqlens: int32, on A's device, 1-D of G + 1 entries (``groups``: G,
    where B says it)."""
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"{name} must be an int32 torch.Tensor, got {type(cu).__name__}")
    if cu.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {cu.dtype}")
    ti.check_cuda(name, cu, a)
    if cu.dim() != 1 or cu.shape[0] < 1 or (groups is not None and cu.shape[0] != groups + 1):
        want = f"({groups + 1},) for {groups} groups" if groups is not None else "(G + 1,)"
        raise ValueError(f"{name} must have shape {want}, got {tuple(cu.shape)}")


def _check_dims(a, b, cu_seqlens_m, cu_seqlens_k) -> None:
    if a.dim() != 2:
        raise ValueError(f"A must be 2-D (M, K), got shape {tuple(a.shape)}")
    if cu_seqlens_m is not None and cu_seqlens_k is not None:
        raise ValueError("give cu_seqlens_m or cu_seqlens_k, not both")
    if cu_seqlens_m is None:
        if b.dim() != 2:
            grouped = " with cu_seqlens_k" if cu_seqlens_k is not None else " for a dense GEMM"
            raise ValueError(f"B must be 2-D (K, N){grouped}, got shape {tuple(b.shape)}")
        if cu_seqlens_k is not None:
            _check_cu("cu_seqlens_k", cu_seqlens_k, a, None)
    else:
        if b.dim() != 3:
            raise ValueError(f"B must be 3-D (G, K, N) with cu_seqlens_m, got shape {tuple(b.shape)}")
        _check_cu("cu_seqlens_m", cu_seqlens_m, a, b.shape[0])
    if a.shape[1] != b.shape[-2]:
        raise ValueError(f"K mismatch: A is {tuple(a.shape)}, B is {tuple(b.shape)}")
    m, k, n = a.shape[0], a.shape[1], b.shape[-1]
    if k % _ALIGN_ELEMENTS or n % _ALIGN_ELEMENTS:
        raise ValueError(f"K = {k} and N = {n} must be multiples of {_ALIGN_ELEMENTS} (TMA)")
    groups = b.shape[0] if b.dim() == 3 else 1
    if cu_seqlens_k is not None:
        groups = cu_seqlens_k.shape[0] - 1
        m = m * max(groups, 1)  # the rows of D
    if max(m, n, k) + groups * 256 >= 2**31:
        raise ValueError(f"M = {a.shape[0]}, N = {n}, K = {k} with {groups} groups: dims must stay below 2^31 (int32)")
    if cu_seqlens_m is not None and groups == 0 and a.shape[0] > 0:
        raise ValueError(f"cu_seqlens_m has no groups but A has {a.shape[0]} rows")


def gemm(A: torch.Tensor, B: torch.Tensor, out_dtype: Optional[torch.dtype] = None,
         cu_seqlens_m: Optional[torch.Tensor] = None, cu_seqlens_k: Optional[torch.Tensor] = None,
         bias: Optional[torch.Tensor] = None, activation: Optional[str] = None) -> torch.Tensor:
    """A @ B (dense) or one of the grouped products in the module docstring.

    Raises TypeError for wrong dtypes and ValueError for wrong devices, shapes,
    strides or alignment, before any launch.  A may be row-major or (except
    with cu_seqlens_m) column-major, a transposed view; B row- or
    column-major (per group); other layouts are copied.  Differentiable,
    dense and with cu_seqlens_m (not with cu_seqlens_k: NotImplementedError).
    ``bias`` (N,) in A's dtype or fp32 and ``activation`` (``gemm_epilogue.ACTIVATIONS``)
    are fused into the epilogue: act(A @ B + bias), not with cu_seqlens_k.
    Grouped rows: output rows outside [cu[0], cu[G]) are left unwritten (and
    so is their gradient, which the bias gradient would then sum: train with
    cu[0] = 0 and cu[G] = total_M); a malformed cu_seqlens gives wrong
    values, never an access outside A, B or D.
    """
    # (Not while torch.compile traces: _call compares addresses for the fast path.)
    plain = bias is None and activation is None and fastpath.applies()
    described = (A, B, cu_seqlens_m, cu_seqlens_k, _out_dtype_code(out_dtype)) if plain else None
    out = _FAST.call(5, *described) if plain else NotImplemented
    if out is not NotImplemented:
        return out
    out_dtype = _check_gemm("quack.gemm", A, B, out_dtype, cu_seqlens_m, cu_seqlens_k, bias, activation)
    return _call(A, B, out_dtype, cu_seqlens_m, cu_seqlens_k, bias, activation, described)


def gemm_glu(A: torch.Tensor, B: torch.Tensor, activation: str = "swiglu", out_dtype: Optional[torch.dtype] = None,
             cu_seqlens_m: Optional[torch.Tensor] = None) -> torch.Tensor:
    """act(A @ B_gate) * (A @ B_up) in one GEMM: B (K, 2N), or (G, K, 2N)
    with ``cu_seqlens_m``, holds the gate and up projections interleaved
    column by column (gate j at column 2 j, up j at 2 j + 1); returns (M, N).
    ``activation``: swiglu (silu), geglu (GELU's tanh approximation) or
    reglu (relu) of the gate, in fp32 before the one rounding.

    A call that autograd will differentiate also stores the (M, 2N)
    pre-activation A @ B (memory: twice the output), from which the backward
    recomputes the gate's activation (one elementwise kernel,
    ``quack/families/gemm/dact.py``) before its two GEMMs.  Layouts, dtypes and
    errors as ``gemm``; N a multiple of 8.
    """
    out_dtype = _check_gemm("quack.gemm_glu", A, B, out_dtype, cu_seqlens_m, None, None, activation, gated=True)
    return _call(A, B, out_dtype, cu_seqlens_m, None, None, activation, None)


def _check_gemm(op: str, A, B, out_dtype, cu_seqlens_m, cu_seqlens_k, bias, activation, gated: bool = False):
    """Every check of a ``gemm`` (``gated``: ``gemm_glu``) call that raises
    before a launch; returns the output dtype."""
    check_activation_type(activation)
    check_activation(activation, gated=gated)
    out_dtype = _check_call(op, A, B, out_dtype, cu_seqlens_m, cu_seqlens_k)
    if gated and B.shape[-1] % (2 * _ALIGN_ELEMENTS):
        raise ValueError(f"B's {B.shape[-1]} columns must be 2 N with N a multiple of {_ALIGN_ELEMENTS} (TMA)")
    _check_epilogue(bias, activation, A, B, cu_seqlens_k)
    return out_dtype


def check_activation_type(activation) -> None:
    """An activation is named by a str (or None): TypeError for anything else."""
    if activation is not None and not isinstance(activation, str):
        raise TypeError(f"activation must be a str or None, got {type(activation).__name__} {activation!r}")


def _check_call(op: str, A, B, out_dtype, cu_seqlens_m, cu_seqlens_k) -> torch.dtype:
    """Every check of a call's operands that raises before a launch; returns the output dtype."""
    _check_operand("A", A, None)
    _check_operand("B", B, A)
    ti.check_arch(op, A.device, "an sm_90 GPU (Hopper's WGMMA)", (9, 0), maximum=(9, 0))
    out_dtype = A.dtype if out_dtype is None else out_dtype
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype must be torch.bfloat16, torch.float16 or torch.float32, got {out_dtype}")
    _check_dims(A, B, cu_seqlens_m, cu_seqlens_k)
    return out_dtype


def _call(A, B, out_dtype, cu_seqlens_m, cu_seqlens_k, bias, activation, described) -> torch.Tensor:
    """A checked call: its product, through autograd when it will be differentiated."""
    backward = ti.will_backward(A, B, bias)
    ops, cu = _call_operands(A, B, out_dtype, cu_seqlens_m, cu_seqlens_k, bias, activation, backward)
    if not backward:
        if described is not None and not (ops.a is A and ops.b3.data_ptr() == B.data_ptr()):
            described = None  # a copy: the fast path would launch A and B themselves
        return _product(ops, cu, described=described)
    plan = _plan(ops, cu, backward=True)
    if not autograd_available():
        # Warm the forward's and the backward's kernels; no graph (compile-only, CPU-only torch).
        return differentiable_outputs(_product(ops, cu, plan), True)
    return _GemmFunction.apply(A, B, bias, ops, cu, plan)


def _call_operands(A, B, out_dtype, cu_seqlens_m, cu_seqlens_k, bias, activation, backward: bool):
    """A checked call's ``_Operands`` (detached for a call that will be
    differentiated: kernels take plain tensors, DLPack refuses ones that
    require grad) and its grouping offsets."""
    grouping = "varlen_m" if cu_seqlens_m is not None else "varlen_k" if cu_seqlens_k is not None else "dense"
    cu = cu_seqlens_m if cu_seqlens_m is not None else cu_seqlens_k
    cu = cu.contiguous() if cu is not None else None
    if not backward:
        return _operands(A, B, out_dtype, cu, grouping, bias, activation), cu
    if grouping == "varlen_k":
        raise NotImplementedError("quack.gemm: gradients of a variable-length-K GEMM are not implemented")
    detached = bias.detach() if bias is not None else None
    return _operands(A.detach(), B.detach(), out_dtype, cu, grouping, detached, activation, backward=True), cu


def _check_epilogue(bias, activation, A, B, cu_seqlens_k) -> None:
    if (bias is not None or activation is not None) and cu_seqlens_k is not None:
        raise ValueError("bias and activation are not fused into a variable-length-K GEMM")
    if bias is None:
        return
    ti.check_float("bias", bias, (A.dtype, torch.float32))
    ti.check_cuda("bias", bias, A)
    n = B.shape[-1]
    if bias.dim() != 1 or bias.shape[0] != n or (n > 1 and bias.stride(0) != 1):
        raise ValueError(f"bias must be a contiguous vector of N = {n}, got shape {tuple(bias.shape)}")


class _Operands(NamedTuple):
    """A call's tensors as the kernel takes them (``_a_view``, ``_b_view``),
    its epilogue and its outputs (``preact``: the pre-activation a backward
    differentiates, stored for a training call with an activation)."""

    a: torch.Tensor
    a_m_major: bool
    b3: torch.Tensor
    b_n_major: bool
    out: torch.Tensor
    bias: Optional[torch.Tensor] = None
    activation: Optional[str] = None
    preact: Optional[torch.Tensor] = None


def _operands(A, B, out_dtype, cu, grouping: str, bias=None, activation=None, backward: bool = False,
              preact=None) -> _Operands:
    """The kernel's views of checked operands (any sizes: the backward's
    products contract over M) and new outputs: (M, N), or (G, M, N) for
    varlen K.  ``preact``: the saved pre-activation a derivative epilogue reads."""
    a, a_m_major = _a_view(A, grouping)
    b3, b_n_major = _b_view(B if B.dim() == 3 else B.unsqueeze(0))
    n = _columns(b3, b_n_major)
    out_n = out_columns(activation, n)
    shape = (cu.shape[0] - 1, a.shape[0], out_n) if grouping == "varlen_k" else (a.shape[0], out_n)
    out = torch.empty(shape, device=A.device, dtype=out_dtype)
    if backward and activation:
        preact = torch.empty((a.shape[0], n), device=A.device, dtype=out_dtype)
    return _Operands(a if a_m_major else _unit_strides(a), a_m_major, _unit_strides(b3), b_n_major, out, bias,
                     activation, preact)


def _plan(ops: _Operands, cu, backward: bool = False) -> Optional[Plan]:
    """The plan of the call's signature (``backward``: it also holds the
    backward's kernels), empty products included; None while torch.compile
    traces (no addresses: the registered op takes its plan from the real
    tensors when the graph runs)."""
    if torch.compiler.is_compiling():
        return None
    return plan_for(_signature(ops, cu, backward))


def _signature(ops: _Operands, cu, backward: bool) -> GemmCall:
    """The signature of a call on these operands (``backward``: its plan also holds the backward's kernels)."""
    return call_signature(ops.a, ops.b3, ops.out, cu, ops.a_m_major, ops.b_n_major, backward, ops.activation, ops.bias)


def _product(ops: _Operands, cu, plan: Optional[Plan] = None, described: Optional[tuple] = None,
             warm_empty: bool = True) -> torch.Tensor:
    """Run one product into ``ops.out`` through ``plan`` (None: this call's
    own, planned here).  ``described``: the fast path's described arguments
    of the call, to leave a closure for its like.  An empty product launches nothing
    (compile-only mode still warms the plan of a call, ``warm_empty``; not
    that of a backward's product, whose kernels the call's plan holds)."""
    out = ops.out
    plan = plan if plan is not None else _plan(ops, cu)
    if out.numel() == 0 or ops.a.shape[1] == 0:
        if plan is not None and warm_empty and is_compile_only():
            plan.warm()
        return _empty_product(ops)
    if plan is None:
        _gemm(ops.a, ops.b3, out, cu, ops.bias, ops.preact, ops.a_m_major, ops.b_n_major, ops.activation)
        return out
    _run(plan, ops.a, ops.b3, out, cu, ops.bias, ops.preact)
    if described is not None and cu is None and not ops.a_m_major:  # the closure passes A as it comes
        _FAST.remember(described, lambda: _dense_closure(plan, ops.b3, out))
    return out


def _empty_product(ops: _Operands) -> torch.Tensor:
    """An empty product: K = 0 gives act(bias) (zeros without a bias; a gated
    product gives act(0) * 0 = 0, a derivative 0 * act'(Z) = 0)."""
    z = ops.out.zero_()
    _, gated, derivative = parse_epilogue(ops.activation)
    if derivative:
        return z  # (its preact is an input)
    if gated:
        if ops.preact is not None:
            ops.preact.zero_()
        return z
    if z.numel() and ops.bias is not None:
        z.add_(ops.bias)
    if ops.preact is not None:
        ops.preact.copy_(z)
    if z.numel() and ops.activation is not None:
        z.copy_(TORCH_ACTIVATIONS[ops.activation](z.float()))
    return z


class _GemmFunction(torch.autograd.Function):
    """dA = dC @ Bᵀ and dB = Aᵀ @ dC, each one GEMM on views (no transposed
    copies).  The forward saves what the backward needs of what its kernel
    read: A (for dB), B as (L, K, N) (for dA), cu_seqlens_m, the
    pre-activation."""

    @staticmethod
    def forward(ctx, A, B, bias, ops, cu, plan):
        out = _product(ops, cu, plan)
        b_kn = ops.b3 if ops.b_n_major else ops.b3.transpose(-1, -2)
        wants_a, wants_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        ctx.save_for_backward(ops.a if wants_b else None, b_kn if wants_a else None, cu, ops.preact)
        ctx.dtypes = (A.dtype, B.dtype, bias.dtype if bias is not None else None)
        ctx.activation = ops.activation
        return out

    @staticmethod
    def backward(ctx, dc):
        a, b_kn, cu, preact = ctx.saved_tensors
        a_dtype, b_dtype, bias_dtype = ctx.dtypes
        if ctx.activation is not None:
            dc = activation_grad(dc, preact, ctx.activation)  # one elementwise kernel (quack/families/gemm/dact.py)
        dbias = dc.float().sum(0).to(bias_dtype) if ctx.needs_input_grad[2] else None
        dc = kernel_ready(dc, a_dtype)
        da, db = input_grads(dc, a, b_kn, cu, ctx.needs_input_grad[0], ctx.needs_input_grad[1], b_dtype)
        return da, db, dbias, None, None, None


def kernel_ready(grad: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Autograd's gradient as the kernel reads it: in ``dtype`` (an
    out_dtype other than the inputs'), copied where its layout (a transpose,
    a slice, a broadcast, an unaligned start such as the backward of
    ``torch.cat`` hands out) does not suit TMA."""
    grad = grad.to(dtype)
    return grad if _tma_ready(grad) else grad.clone(memory_format=torch.contiguous_format)


def input_grads(dc, a, b_kn, cu, wants_a: bool, wants_b: bool, b_dtype: torch.dtype):
    """(dA, dB) of C = A @ B from dC, each one GEMM on views: dA = dC @ Bᵀ,
    dB = Aᵀ @ dC (grouped rows: group g's dB contracts over its rows, a
    variable-length K); None where not wanted."""
    da = db = None
    if wants_a:
        grouping = "dense" if cu is None else "varlen_m"
        da = _product(_operands(dc, b_kn.transpose(-1, -2), dc.dtype, cu, grouping), cu, warm_empty=False)
    if wants_b:
        db = _product(_operands(a.t(), dc, b_dtype, cu, "dense" if cu is None else "varlen_k"), cu, warm_empty=False)
    return da, db


def _tma_ready(t: torch.Tensor) -> bool:
    """Can the 2-D ``t`` go to the kernel as it is, as A or as B: one dim of
    unit stride, the other's stride a nonzero multiple of 8 elements (or
    that dim of size 1), a 16-byte aligned base (unknown while torch.compile
    traces: the strides decide, and the op checks the address when it runs)."""
    if not torch.compiler.is_compiling() and ti.address(t) % 16:
        return False
    for unit, other in ((1, 0), (0, 1)):
        if t.stride(unit) == 1 or t.shape[unit] == 1:
            stride = t.stride(other)
            if t.shape[other] == 1 or (stride > 0 and stride % _ALIGN_ELEMENTS == 0):
                return True
    return False


# The fast path's key spells out_dtype as a number (-1: one the checks refuse).
_OUT_DTYPE_CODES = {None: 0, torch.bfloat16: 1, torch.float16: 2, torch.float32: 3}


def _out_dtype_code(out_dtype) -> int:
    """out_dtype's number in the fast path's key (anything, unhashable too)."""
    return _OUT_DTYPE_CODES.get(out_dtype, -1) if out_dtype is None or isinstance(out_dtype, torch.dtype) else -1


def _dense_closure(plan: Plan, b3: torch.Tensor, out: torch.Tensor):
    """The eager fast path's launch for dense calls like this one
    (``quack/calls/fastpath.py``): the same shapes and strides, so B's view and
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

    def run(A, B, _cu_m, _cu_k, _out_dtype_code):  # the key fixed these
        out = empty(out_shape, device=device, dtype=out_dtype)
        b = B.as_strided(b_shape, b_strides)
        return out if launch(A, b, out, None, None, None, max_clusters, None) is None else NotImplemented

    return run


def _unit_strides(t: torch.Tensor) -> torch.Tensor:
    """The same view with each size-1 dim's (meaningless) stride replaced by
    the extent of what follows it, so every stride meets TMA's rules (a
    tensor whose last dim is the contiguous one)."""
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
