"""Small bridges between torch tensors and CuTe DSL launches, shared by every family.

Input validation lives here so each op checks the same things, cheaply and
before any launch: dtype (TypeError), device, shape and layout (ValueError).
"""

from __future__ import annotations

import math

import torch
from cutlass import BFloat16, Float16, Float32

from quack import rowwise
from quack.compile_only import is_compile_only

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

_CUTE_DTYPES = {"float32": Float32, "float16": Float16, "bfloat16": BFloat16}
_DTYPE_NAMES = {d: str(d).removeprefix("torch.") for d in (*FLOAT_DTYPES, torch.int32, torch.int64)}
_FakeTensor = torch._subclasses.fake_tensor.FakeTensor
_SM_COUNTS: dict[int, int] = {}


def dtype_name(dtype: torch.dtype) -> str:
    """The key spelling of a torch dtype: "bfloat16", "float32", ..."""
    name = _DTYPE_NAMES.get(dtype)
    return name if name is not None else str(dtype).removeprefix("torch.")


def cute_dtype(name: str):
    """CuTe DSL numeric type for a key dtype name."""
    return _CUTE_DTYPES[name]


def vector_width(n: int, x: torch.Tensor, *others: torch.Tensor | None) -> int:
    """Elements per vector copy of x's rows that every tensor of the launch
    (None entries skipped) can use: 16 bytes of x's dtype when N and every
    base pointer allow it, fewer otherwise (see rowwise.vector_width)."""
    present = (x, *(t for t in others if t is not None))
    if not is_compile_only():
        # The usual case, cheaply: real tensors, every base 16-byte aligned.
        addresses = 0
        for t in present:
            addresses |= t.data_ptr()
        if not addresses & 15:
            return math.gcd(n, 16 // x.element_size())
    return rowwise.vector_width(n, x.element_size(), *((address(t), t.element_size()) for t in present))


def address(t: torch.Tensor) -> int:
    """Byte address used for alignment decisions.

    Fake tensors (compile-only) have no storage; their allocation base is
    aligned like a real CUDA allocation, so only the storage offset counts.
    Only op bodies ask, which torch.compile never traces."""
    if isinstance(t, _FakeTensor):
        return t.storage_offset() * t.element_size()
    return t.data_ptr()


def sm_count(device_index: int) -> int:
    """Streaming multiprocessors of the GPU (132, an H100/H200's, when none is visible)."""
    count = _SM_COUNTS.get(device_index)
    if count is None:
        count = 132
        if torch.cuda.is_available():
            count = torch.cuda.get_device_properties(device_index).multi_processor_count
        _SM_COUNTS[device_index] = count
    return count


def current_stream(device: torch.device) -> int:
    """The raw handle of torch's current CUDA stream on ``device`` (0 under
    compile-only, where nothing launches)."""
    if is_compile_only():
        return 0
    return torch._C._cuda_getCurrentRawStream(device.index if device.index is not None else 0)


def as_rows(t: torch.Tensor, n: int) -> torch.Tensor:
    """View a contiguous (..., N) tensor as (M, N).

    A (1, 1) view has two unit strides, from which CuTe cannot tell the
    leading dimension; giving its (never used) row stride the value 2 keeps
    the layout unambiguous without copying."""
    rows = t if t.dim() == 2 else t.reshape(-1, n)
    if rows.shape == (1, 1):
        rows = rows.as_strided((1, 1), (2, 1))
    return rows


def check_float(name: str, t: torch.Tensor, allowed=FLOAT_DTYPES) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in allowed:
        names = ", ".join(dtype_name(d) for d in allowed)
        raise TypeError(f"{name} has dtype {dtype_name(t.dtype)}; expected one of {names}")


def check_cuda(name: str, t: torch.Tensor, like: torch.Tensor | None = None) -> None:
    """``t`` is a CUDA tensor (on ``like``'s device when given)."""
    if not t.is_cuda:
        raise ValueError(f"{name} must be on a CUDA device, got {t.device}")
    if like is not None and t.get_device() != like.get_device():
        raise ValueError(f"{name} is on {t.device} but the input is on {like.device}")


def check_contiguous(name: str, t: torch.Tensor) -> None:
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (got strides {tuple(t.stride())})")


def partial_rows(rows: int, n: int, device: torch.device, m: int) -> torch.Tensor:
    """The fp32 (rows, N) buffer of a persistent backward's partial sums over
    M rows: left uninitialised when the kernel runs (its launch writes every
    one of the rows), zeros when it does not (M = 0)."""
    allocate = torch.empty if m > 0 else torch.zeros
    return allocate(rows, n, device=device, dtype=torch.float32)


def sum_partial_rows(partial: torch.Tensor | None, out: torch.Tensor | None) -> None:
    """out = the column sums of ``partial``, in out's dtype (nothing if None).
    Skipped in compile-only mode: nothing was launched, and CPU-only torch
    cannot convert fake CUDA tensors."""
    if partial is None or is_compile_only():
        return
    if out.dtype == torch.float32:
        torch.sum(partial, 0, out=out)
    else:
        out.copy_(partial.sum(0))
