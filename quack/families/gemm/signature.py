"""What decides a GEMM call's kernels (``GemmCall``), how each is compiled
(``compile_gemm``), and the plan of a call on its operands.

The compiled object depends on the dtypes, A's and B's layouts, the grouping
(dense, rows, K), the epilogue and the tile configuration, never on M, N, K
or G: those are dynamic, so one object serves every problem size and
compile-only warming works from tests that size their inputs with
``.item()`` on fake tensors.  A varlen-M call's plan holds the objects of
both classes of group size (``config.GROUP_CLASSES``), a dense one those of
each class of M (``config.DENSE_CLASSES``)."""

from __future__ import annotations

from typing import ClassVar, Optional

import torch

from quack.cache import compile_options, jit_cache
from quack.calls import torch_interop as ti
from quack.calls.launches import Launch, in_order
from quack.calls.plan import Kernel, Plan, Signature, blame, fake_tensor, plan_for, signature, torch_dtype
from quack.families.gemm.config import (ALIGN_ELEMENTS, DENSE_CLASSES, GROUP_CLASSES, GROUPINGS, GemmConfig,
                                        gemm_config, weight_grad_grouping)
from quack.families.gemm.dact import activation_grad_kernel
from quack.families.gemm.epilogue import DERIVATIVES, GATED, check_activation, parse_epilogue
from quack.families.gemm.operands import (Operands, call_operands, check_call, check_epilogue, check_gemm,
                                          check_operand, columns)


# The kernel takes its operands as they come (no rows view): the product
# makes the views (``product.py``).
GEMM = Launch("quack.families.gemm.kernel:HopperGemm", rows=frozenset())


@jit_cache("gemm")
def compile_gemm(ab_dtype: str, d_dtype: str, a_m_major: bool, b_n_major: bool, grouping: str,
                 activation: Optional[str], bias_dtype: Optional[str], store_preact: bool, config: tuple):
    """Compile one configuration; every dimension is symbolic.  ``a_m_major``:
    A's M dimension is the contiguous one (a transposed view, as Aᵀ is in a
    weight gradient); ``b_n_major``: B's N dimension is; ``grouping``: one of
    ``GROUPINGS``; the epilogue's activation, bias dtype (None: no bias) and
    whether it also stores the pre-activation (for a backward)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass import Int32

    from quack.families.gemm.kernel import HopperGemm

    cfg = GemmConfig(*config)
    ab, dt = ti.cute_dtype(ab_dtype), ti.cute_dtype(d_dtype)
    m, n, k, groups = cute.sym_int(), cute.sym_int(), cute.sym_int(), cute.sym_int()

    def stride():
        return cute.sym_int64(divisibility=ALIGN_ELEMENTS)

    def fake(dtype, shape, rank):
        # The launcher's convention (quack/launch/launcher.py): dynamic strides
        # lead, the unit stride is the last one.  An M-contiguous A therefore
        # goes to the kernel as its (K, M) transpose.
        return cute.runtime.make_fake_tensor(dtype, shape, (*(stride() for _ in range(rank - 1)), 1), assumed_align=16)

    a = fake(ab, (k, m) if a_m_major else (m, k), 2)
    b = fake(ab, (groups, k, n) if b_n_major else (groups, n, k), 3)
    epilogue = parse_epilogue(activation)
    d_cols = cute.sym_int() if epilogue.gated else n  # gated: half of B's columns, a derivative twice
    d = fake(dt, (m, d_cols), 2)
    # A forward's stored pre-activation, or the one a derivative reads (shaped like D).
    preact = fake(dt, (m, d_cols if epilogue.derivative else n), 2) if store_preact or epilogue.derivative else None
    compact = cute.runtime.make_fake_compact_tensor
    grouped = grouping != "dense"
    cu = compact(Int32, (cute.sym_int(),), assumed_align=4) if grouped else None
    bias = compact(ti.cute_dtype(bias_dtype), (n,), assumed_align=4) if bias_dtype else None
    workspace = counters = None
    if cfg.split_k:
        # (S, W) row-major: ``compact`` would make it column-major.
        workspace = cute.runtime.make_fake_tensor(cutlass.Float32, (cute.sym_int(), cute.sym_int()),
                                                  (cute.sym_int64(divisibility=4), 1), assumed_align=16)
        counters = compact(Int32, (cute.sym_int(),), assumed_align=4)
    kernel = HopperGemm(cfg, a_m_major, b_n_major, varlen_k=grouping == "varlen_k", activation=activation)
    fakes = dict(a=a, b=b, d=d, cu_seqlens=cu, bias=bias, preact=preact, max_clusters=Int32(1),
                 workspace=workspace, counters=counters, stream=cute.runtime.make_fake_stream())
    return cute.compile(kernel, *in_order(HopperGemm, fakes), options=compile_options())


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
        roles = {"varlen_m": [role for role, _ in GROUP_CLASSES], "dense": DENSE_CLASSES}.get(
            self.grouping, [self.grouping])
        own = tuple((role, Kernel(compile_gemm, (*args, tuple(self.config(role))), GEMM)) for role in roles)
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

    def config(self, role: str) -> GemmConfig:
        """The tile configuration of this call's own object ``role``: the
        grouping's, or a class of ``GROUP_CLASSES`` (grouped rows) or of
        ``DENSE_CLASSES``."""
        return gemm_config(self.tile_n, dict(GROUP_CLASSES).get(role), role if role in DENSE_CLASSES else "dense")

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
        grad_b = GemmCall(ab, ab, not self.a_m_major, True, weight_grad_grouping(self.grouping), self.tile_n, False,
                          0, None, None)
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
            check_operand("A", a, None)
        if self.activation in DERIVATIVES:
            check_gemm("quack.mlp", a, b, None, cu_m, cu_k, None, None)
            check_epilogue(None, self.activation, a, b, cu_k)
            ops, _ = call_operands(a, b, a.dtype, cu_m, cu_k, None, self.activation, False)
            return signature_of(ops, False)
        # Each field's own check first, which names it; then all of the op's, in its order.
        gated = self.activation in GATED
        op = "quack.gemm_glu" if gated else "quack.gemm"
        check_call(op, a, b, None, cu_m, cu_k)
        out_dtype = torch_dtype(self, "out_dtype")
        with blame(self, "out_dtype"):
            check_call(op, a, b, out_dtype, cu_m, cu_k)
        with blame(self, "activation"):
            check_activation(self.activation, gated)
        bias = None if gated else fake_tensor(self, "bias_dtype", (n,))
        with blame(self, "bias_dtype"):
            check_epilogue(bias, None, a, b, None)
        out_dtype = check_gemm(op, a, b, out_dtype, cu_m, cu_k, bias, self.activation, gated)
        with blame(self, "backward"):
            ops, _ = call_operands(a, b, out_dtype, cu_m, cu_k, bias, self.activation, self.backward)
        return signature_of(ops, self.backward)


def _dim_for(tile: int) -> int:
    """A dimension for which ``gemm_config`` picks the tile width ``tile``:
    the width itself, as TMA takes it (a multiple of 8)."""
    return max(ALIGN_ELEMENTS, tile - tile % ALIGN_ELEMENTS)


def signature_of(ops: Operands, backward: bool = False) -> GemmCall:
    """The signature of a call on these operands (``backward``: its plan also
    holds the backward's kernels)."""
    tile_n = gemm_config(columns(ops.b3, ops.b_n_major)).tile_n
    if ops.epilogue.gated and ops.epilogue.derivative:
        tile_n = min(tile_n, 128)  # its D tile is twice as wide, at most the MMA's 256
    return GemmCall(
        ti.dtype_name(ops.a.dtype), ti.dtype_name(ops.out.dtype), ops.a_m_major, ops.b_n_major, ops.grouping,
        tile_n, backward, gemm_config(ops.a.shape[1]).tile_n if backward else 0,
        ops.activation, ti.dtype_name(ops.bias.dtype) if ops.bias is not None else None,
    )


def plan_of(ops: Operands, backward: bool = False) -> Optional[Plan]:
    """The plan of the call's signature (``backward``: it also holds the
    backward's kernels), empty products included; None while torch.compile
    traces (no addresses: the registered op takes its plan from the real
    tensors when the graph runs)."""
    if torch.compiler.is_compiling():
        return None
    return plan_for(signature_of(ops, backward))
