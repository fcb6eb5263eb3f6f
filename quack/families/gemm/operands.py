"""A GEMM call's operands on the host: the checks that raise before any
launch, and the views the kernel takes (no copies where a layout allows).

TMA needs 16-byte aligned bases and strides (8 elements) but the unit one:
checked with a clear error before any launch.  The sizes are free but N, the
columns of the output the kernel stores row by row; a backward's dA over a K
that is no multiple of 8 is stored into rows padded to one (a view)."""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from quack.calls import torch_interop as ti
from quack.compile_only import is_compile_only
from quack.families.gemm.config import ALIGN_ELEMENTS, call_grouping
from quack.families.gemm.epilogue import Epilogue, check_activation, parse_epilogue

INPUT_DTYPES = (torch.bfloat16, torch.float16)
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # fp32: weight gradients kept unrounded


def check_gemm(op: str, A, B, out_dtype, cu_seqlens_m, cu_seqlens_k, bias, activation, gated: bool = False):
    """Every check of a ``gemm`` (``gated``: ``gemm_glu``) call that raises
    before a launch; returns the output dtype."""
    check_activation_type(activation)
    check_activation(activation, gated=gated)
    out_dtype = check_call(op, A, B, out_dtype, cu_seqlens_m, cu_seqlens_k)
    if gated:
        check_gated_columns("B", B, "N")
    check_epilogue(bias, activation, A, B, cu_seqlens_k)
    return out_dtype


def check_activation_type(activation) -> None:
    """An activation is named by a str (or None): TypeError for anything else."""
    if activation is not None and not isinstance(activation, str):
        raise TypeError(f"activation must be a str or None, got {type(activation).__name__} {activation!r}")


def check_call(op: str, A, B, out_dtype, cu_seqlens_m, cu_seqlens_k) -> torch.dtype:
    """Every check of a call's operands that raises before a launch; returns the output dtype."""
    check_operand("A", A, None)
    check_operand("B", B, A)
    ti.check_arch(op, A.device, "an sm_90 GPU (Hopper's WGMMA)", (9, 0), maximum=(9, 0))
    out_dtype = A.dtype if out_dtype is None else out_dtype
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype must be torch.bfloat16, torch.float16 or torch.float32, got {out_dtype}")
    _check_dims(tuple(A.shape), B, cu_seqlens_m, cu_seqlens_k, A)
    return out_dtype


def check_b(B, like: torch.Tensor, a_shape: tuple, cu_seqlens_m) -> None:
    """The checks of B for a product whose A of ``a_shape`` the op computes
    itself, in ``like``'s dtype and on its device (``quack.mlp``'s second GEMM)."""
    check_operand("B", B, like)
    _check_dims(a_shape, B, cu_seqlens_m, None, like)


def check_gated_columns(name: str, B, half: str) -> None:
    """A gated product's B holds 2 ``half`` columns (gate and up interleaved)."""
    if B.shape[-1] % (2 * ALIGN_ELEMENTS):
        raise ValueError(
            f"{name}'s {B.shape[-1]} columns must be 2 {half} with {half} a multiple of {ALIGN_ELEMENTS} (TMA)"
        )


def check_epilogue(bias, activation, A, B, cu_seqlens_k) -> None:
    if (bias is not None or activation is not None) and cu_seqlens_k is not None:
        raise ValueError("bias and activation are not fused into a variable-length-K GEMM")
    if bias is None:
        return
    ti.check_float("bias", bias, (A.dtype, torch.float32))
    ti.check_cuda("bias", bias, A)
    n = B.shape[-1]
    if bias.dim() != 1 or bias.shape[0] != n or (n > 1 and bias.stride(0) != 1):
        raise ValueError(f"bias must be a contiguous vector of N = {n}, got shape {tuple(bias.shape)}")


def check_operand(name: str, t: torch.Tensor, like: Optional[torch.Tensor]) -> None:
    ti.check_float(name, t, INPUT_DTYPES if like is None else (like.dtype,))
    ti.check_cuda(name, t, like)


def check_tma(name: str, t: torch.Tensor, unit_dim: int = -1) -> None:
    """TMA wants a 16-byte aligned base and 16-byte multiples for every
    stride but the unit one (``unit_dim``)."""
    if ti.address(t) % 16:
        raise ValueError(f"{name} must start at a 16-byte aligned address (TMA)")
    for dim, stride in enumerate(t.stride()):
        if dim == unit_dim % t.dim():
            continue
        if stride == 0 and t.shape[dim] > 1:
            raise ValueError(f"{name} is broadcast along dim {dim} (stride 0): pass a copy (TMA)")
        if stride % ALIGN_ELEMENTS:
            raise ValueError(
                f"{name} stride {stride} of dim {dim} must be a multiple of {ALIGN_ELEMENTS} elements "
                f"(16 bytes, TMA): shape {tuple(t.shape)}, strides {t.stride()}"
            )


def _check_cu(name: str, cu: torch.Tensor, like: torch.Tensor, groups: Optional[int]) -> None:
    """cu_seqlens: int32, on A's device (``like``'s), 1-D of G + 1 entries
    (``groups``: G, where B says it)."""
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"{name} must be an int32 torch.Tensor, got {type(cu).__name__}")
    if cu.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {cu.dtype}")
    ti.check_cuda(name, cu, like)
    if cu.dim() != 1 or cu.shape[0] < 1 or (groups is not None and cu.shape[0] != groups + 1):
        want = f"({groups + 1},) for {groups} groups" if groups is not None else "(G + 1,)"
        raise ValueError(f"{name} must have shape {want}, got {tuple(cu.shape)}")


def _check_dims(a_shape: tuple, b, cu_seqlens_m, cu_seqlens_k, like: torch.Tensor) -> None:
    """The shapes of A (``a_shape``), B and the offsets (on ``like``'s device)."""
    if len(a_shape) != 2:
        raise ValueError(f"A must be 2-D (M, K), got shape {a_shape}")
    if cu_seqlens_m is not None and cu_seqlens_k is not None:
        raise ValueError("give cu_seqlens_m or cu_seqlens_k, not both")
    if cu_seqlens_m is None:
        if b.dim() != 2:
            grouped = " with cu_seqlens_k" if cu_seqlens_k is not None else " for a dense GEMM"
            raise ValueError(f"B must be 2-D (K, N){grouped}, got shape {tuple(b.shape)}")
        if cu_seqlens_k is not None:
            _check_cu("cu_seqlens_k", cu_seqlens_k, like, None)
    else:
        if b.dim() != 3:
            raise ValueError(f"B must be 3-D (G, K, N) with cu_seqlens_m, got shape {tuple(b.shape)}")
        _check_cu("cu_seqlens_m", cu_seqlens_m, like, b.shape[0])
    if a_shape[1] != b.shape[-2]:
        raise ValueError(f"K mismatch: A is {a_shape}, B is {tuple(b.shape)}")
    m, k, n = a_shape[0], a_shape[1], b.shape[-1]
    if n % ALIGN_ELEMENTS:
        raise ValueError(f"N = {n} must be a multiple of {ALIGN_ELEMENTS}: TMA stores the output's rows, "
                         "which must start 16-byte aligned")
    groups = b.shape[0] if b.dim() == 3 else 1
    if cu_seqlens_k is not None:
        groups = cu_seqlens_k.shape[0] - 1
        m = m * max(groups, 1)  # the rows of D
    if max(m, n, k) + groups * 256 >= 2**31:
        raise ValueError(f"M = {a_shape[0]}, N = {n}, K = {k} with {groups} groups: dims must stay below 2^31 (int32)")
    if cu_seqlens_m is not None and groups == 0 and a_shape[0] > 0:
        raise ValueError(f"cu_seqlens_m has no groups but A has {a_shape[0]} rows")


class Operands(NamedTuple):
    """A call's tensors as the kernel takes them (``_a_view``, ``_b_view``),
    its grouping (``config.GROUPINGS``), its epilogue (the name and its parse)
    and its outputs (``preact``: the pre-activation a backward
    differentiates, stored for a training call with an activation)."""

    a: torch.Tensor
    a_m_major: bool
    b3: torch.Tensor
    b_n_major: bool
    out: torch.Tensor
    grouping: str
    bias: Optional[torch.Tensor] = None
    activation: Optional[str] = None
    epilogue: Epilogue = Epilogue(None, False, False)
    preact: Optional[torch.Tensor] = None

    @property
    def b_kn(self) -> torch.Tensor:
        """B as (L, K, N), the view its kernel read (what dA's product transposes)."""
        return self.b3 if self.b_n_major else self.b3.transpose(-1, -2)

    @property
    def empty(self) -> bool:
        """No output, or K = 0: nothing to launch."""
        return self.out.numel() == 0 or self.a.shape[1] == 0


def kernel_operands(A, B, out_dtype, cu, grouping: str, bias=None, activation=None, backward: bool = False,
                    preact=None) -> Operands:
    """The kernel's views of checked operands (any sizes: the backward's
    products contract over M) and new outputs: (M, N), or (G, M, N) for
    varlen K.  ``preact``: the saved pre-activation a derivative epilogue reads."""
    a, a_m_major = _a_view(A, grouping)
    b3, b_n_major = _b_view(B if B.dim() == 3 else B.unsqueeze(0))
    n = columns(b3, b_n_major)
    epilogue = parse_epilogue(activation)
    out_n = epilogue.out_columns(n)
    shape = (cu.shape[0] - 1, a.shape[0], out_n) if grouping == "varlen_k" else (a.shape[0], out_n)
    out = _stored_by_tma(shape, out_dtype, A.device)
    if backward and activation:
        preact = torch.empty((a.shape[0], n), device=A.device, dtype=out_dtype)
    return Operands(a if a_m_major else _unit_strides(a), a_m_major, _unit_strides(b3), b_n_major, out, grouping,
                    bias, activation, epilogue, preact)


def call_operands(A, B, out_dtype, cu_seqlens_m, cu_seqlens_k, bias, activation, backward: bool):
    """A checked call's ``Operands`` (detached for a call that will be
    differentiated: kernels take plain tensors, DLPack refuses ones that
    require grad) and its grouping offsets."""
    grouping = call_grouping(cu_seqlens_m, cu_seqlens_k)
    cu = cu_seqlens_m if cu_seqlens_m is not None else cu_seqlens_k
    cu = cu.contiguous() if cu is not None else None
    if not backward:
        return kernel_operands(A, B, out_dtype, cu, grouping, bias, activation), cu
    if grouping == "varlen_k":
        raise NotImplementedError("quack.gemm: gradients of a variable-length-K GEMM are not implemented")
    detached = bias.detach() if bias is not None else None
    return kernel_operands(A.detach(), B.detach(), out_dtype, cu, grouping, detached, activation, backward=True), cu


def columns(b3: torch.Tensor, b_n_major: bool) -> int:
    """B's N (the accumulator's columns) from its kernel view."""
    return b3.shape[2] if b_n_major else b3.shape[1]


def _a_view(a: torch.Tensor, grouping: str):
    """(A as the kernel takes it, M-major?): K-contiguous as it is; an
    M-contiguous A (a transposed view, with a stride TMA takes) as it is,
    except for grouped rows (whose tiles start at any row); anything else
    copied row-major."""
    if a.stride(-1) == 1:
        return a, False
    if a.stride(-2) == 1 and a.stride(-1) % ALIGN_ELEMENTS == 0 and grouping != "varlen_m":
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


def _stored_by_tma(shape: tuple, dtype: torch.dtype, device) -> torch.Tensor:
    """A new output whose rows TMA can store: where the last dim is no
    multiple of 8 (the backward's dA of such a K), a view of rows padded to
    one, the last row too (the kernel's predicated stores write whole 16-byte
    vectors).  (``as_strided``, not a slice: fake CUDA tensors cannot be
    sliced under a CPU-only torch.)"""
    n = shape[-1]
    padded = _aligned(n)
    rows = torch.empty((*shape[:-1], padded), device=device, dtype=dtype)
    return rows if padded == n else rows.as_strided(shape, rows.stride())


def _aligned(elements: int) -> int:
    """``elements`` rounded up to a multiple of 8 (16 bytes of a 16-bit dtype)."""
    return -(-elements // ALIGN_ELEMENTS) * ALIGN_ELEMENTS


def _row_major(t: torch.Tensor) -> torch.Tensor:
    """A row-major copy of ``t``; under compile-only, a new tensor of its
    shape (only its layout matters there, and fake strided tensors cannot be
    copied)."""
    if is_compile_only():
        return torch.empty(t.shape, dtype=t.dtype, device=t.device)
    return t.contiguous()


def _unit_strides(t: torch.Tensor) -> torch.Tensor:
    """The same view with each size-1 dim's (meaningless) stride replaced by
    the extent of what follows it rounded up to 8 elements, so every stride
    meets TMA's rules (a tensor whose last dim is the contiguous one): a
    single row of any K is read."""
    if 1 not in t.shape[:-1]:
        return t
    strides = list(t.stride())
    for dim in range(t.dim() - 2, -1, -1):
        if t.shape[dim] == 1:
            strides[dim] = _aligned(t.shape[dim + 1] * strides[dim + 1])
    # (``t`` itself where nothing changes, as for a contiguous decode row: the
    # fast path passes the caller's tensor and takes only an operand that is.)
    return t if tuple(strides) == t.stride() else t.as_strided(t.shape, strides)


def kernel_ready(grad: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Autograd's gradient as the kernel reads it: in ``dtype`` (an
    out_dtype other than the inputs'), copied where its layout (a transpose,
    a slice, a broadcast, an unaligned start such as the backward of
    ``torch.cat`` hands out) does not suit TMA."""
    grad = grad.to(dtype)
    return grad if _tma_ready(grad) else grad.clone(memory_format=torch.contiguous_format)


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
            if t.shape[other] == 1 or (stride > 0 and stride % ALIGN_ELEMENTS == 0):
                return True
    return False
