"""Small bridges between torch tensors and CuTe DSL launches, shared by every family.

Input validation lives here so each op checks the same things, cheaply and
before any launch: dtype (TypeError), device, memory a kernel can read (no
fake tensor outside compile-only mode, no negated view), shape and layout
(ValueError).
"""

from __future__ import annotations

import math

import torch
from quack.cache.config import arch_capability
from quack.compile_only import is_compile_only

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

_ELEMENT_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
_DTYPE_NAMES = {d: str(d).removeprefix("torch.") for d in (*FLOAT_DTYPES, torch.int32, torch.int64)}
_FakeTensor = torch._subclasses.fake_tensor.FakeTensor
_PLAIN = (torch.Tensor, torch.nn.Parameter)  # never fake: the usual inputs skip the slower isinstance
_SM_COUNTS: dict[int, int] = {}
_L2_BYTES: dict[int, int] = {}
# Rows are indexed with 32-bit integers in every kernel (grid, statistics,
# targets), with headroom for the persistent backward's prefetch of the row
# tile after its last, whose (unused) row index must not wrap: at most a
# grid's worth of rows (132 SMs x 4 CTAs x 16 rows) past M.
MAX_ROWS = 2**31 - 2**16


def dtype_name(dtype: torch.dtype) -> str:
    """The key spelling of a torch dtype: "bfloat16", "float32", ..."""
    name = _DTYPE_NAMES.get(dtype)
    return name if name is not None else str(dtype).removeprefix("torch.")


def cute_dtype(name: str):
    """CuTe DSL numeric type for a key dtype name (compile time only: the
    DSL is imported here, never by a call that loads cached objects)."""
    import cutlass

    return {"float32": cutlass.Float32, "float16": cutlass.Float16, "bfloat16": cutlass.BFloat16}[name]


def vector_width(n: int, x: torch.Tensor, *others: torch.Tensor | None) -> int:
    """Elements per vector copy of x's rows that every tensor of the launch
    (None entries skipped) can use: 16 bytes of x's dtype when N and every
    base pointer allow it, fewer otherwise (see ``widest_vector``)."""
    present = (x, *(t for t in others if t is not None))
    if not is_compile_only():
        # The usual case, cheaply: real tensors, every base 16-byte aligned.
        addresses = 0
        for t in present:
            addresses |= t.data_ptr()
        if not addresses & 15:
            return math.gcd(n, 16 // x.element_size())
    return widest_vector(n, x.element_size(), *((address(t), t.element_size()) for t in present))


def full_width(n: int, dtype: str) -> int:
    """The vector width of rows of N ``dtype`` values whose tensors are all
    16-byte aligned (``aligned``): what a backward kernel is compiled for."""
    return widest_vector(n, _ELEMENT_BYTES[dtype])


def aligned(t: torch.Tensor | None) -> torch.Tensor | None:
    """``t``, or a contiguous copy when its base is not 16-byte aligned: the
    backward kernels run at ``full_width`` whatever views autograd hands them."""
    if t is None or address(t) % 16 == 0:
        return t
    copy = t.clone(memory_format=torch.contiguous_format)
    return as_rows(copy, t.shape[-1]) if t.dim() == 2 else copy


def will_backward(*tensors: torch.Tensor | None) -> bool:
    """Will autograd run this call's backward?  Some input requires grad and
    grad mode is on: the one rule by which an eager call chooses its kernels
    and compile-only mode warms them (on a CPU-only torch,
    ``compile_only.warming_gradients`` keeps ``requires_grad`` as autograd
    would without building a graph)."""
    return any(t is not None and t.requires_grad for t in tensors) and torch.is_grad_enabled()


def address(t: torch.Tensor) -> int:
    """Byte address used for alignment decisions.

    Fake tensors (compile-only) have no storage; their allocation base is
    aligned like a real CUDA allocation, so only the storage offset counts.
    Only op bodies ask, which torch.compile never traces."""
    if isinstance(t, _FakeTensor):
        return t.storage_offset() * t.element_size()
    return t.data_ptr()


def sm_count(device_index: int) -> int:
    """Streaming multiprocessors of the GPU (132, an H100/H200's, when none is
    visible).  In compile-only mode the GPU is the compile target, never a
    device query (``torch.cuda`` answers for the target there)."""
    if is_compile_only():
        from quack.compile_only.gpu import SM_COUNT

        return SM_COUNT
    count = _SM_COUNTS.get(device_index)
    if count is None:
        count = 132
        if torch.cuda.is_available():
            count = torch.cuda.get_device_properties(device_index).multi_processor_count
        _SM_COUNTS[device_index] = count
    return count


def l2_bytes(device_index: int) -> int:
    """Bytes of the GPU's L2 cache (an H100's 50 MB when none is visible;
    compile-only's target otherwise, as ``sm_count``)."""
    if is_compile_only():
        from quack.compile_only.gpu import L2_BYTES

        return L2_BYTES
    size = _L2_BYTES.get(device_index)
    if size is None:
        size = 50 * 2**20
        if torch.cuda.is_available():
            size = torch.cuda.get_device_properties(device_index).L2_cache_size
        _L2_BYTES[device_index] = size
    return size


def capturing(device: torch.device) -> bool:
    """Whether a CUDA graph is being captured on ``device``'s current stream
    (never on a CPU device)."""
    if device.type != "cuda":
        return False
    if device.index is None or device.index == torch.cuda.current_device():
        return torch.cuda.is_current_stream_capturing()
    with torch.cuda.device(device.index):
        return torch.cuda.is_current_stream_capturing()


def current_stream(device: torch.device) -> int:
    """The raw handle of torch's current CUDA stream on ``device`` (0 under
    compile-only, where nothing launches)."""
    if is_compile_only():
        return 0
    return torch._C._cuda_getCurrentRawStream(device.index if device.index is not None else 0)


def row_length(t: torch.Tensor) -> int:
    """N, t's last dimension, as an int: a signature field and an object key
    argument must hash, also in a registered op's fake implementation under
    compile-only mode, where torch.compile(dynamic=True) hands it symbolic
    sizes (this specialises the traced graph on N)."""
    return int(t.shape[-1])


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


def check_cuda(name: str, t: torch.Tensor, like: torch.Tensor | None = None, op: str | None = None) -> None:
    """``t`` is a CUDA tensor (on ``like``'s device when given) whose memory
    a kernel can read as it is.  Refused besides: a meta tensor, and a
    FakeTensor outside compile-only mode and tracing (a user's
    FakeTensorMode), which have no memory (a launch would read address 0);
    a negated view (``torch._neg_view``, the imaginary part of a conjugate
    view), whose memory holds the values before the negation.  A conjugate
    view is complex, a dtype no op takes.  ``op`` names the call in these
    errors."""
    if not t.is_cuda:
        if t.is_meta:
            raise ValueError(_no_memory(name, "a meta tensor", op))
        raise ValueError(f"{name} must be on a CUDA device, got {t.device}")
    if like is not None and t.get_device() != like.get_device():
        raise ValueError(f"{name} is on {t.device} but the input is on {like.device}")
    if torch.compiler.is_dynamo_compiling():
        return  # traced on fake tensors; is_neg would break the graph
    fake = type(t) not in _PLAIN and isinstance(t, _FakeTensor)
    if fake and not (torch.compiler.is_compiling() or is_compile_only()):
        raise ValueError(_no_memory(name, "a FakeTensor", op))
    if t.is_neg():
        raise ValueError(
            f"{_called(op)}{name} is a negated view (is_neg()): its memory holds the values before the negation, "
            f"which a kernel would read; pass {name}.resolve_neg()"
        )


def _called(op: str | None) -> str:
    return f"{op}: " if op else ""


def _no_memory(name: str, what: str, op: str | None) -> str:
    return (
        f"{_called(op)}{name} is {what}, which has no memory to launch a kernel on: pass real CUDA tensors, or "
        "call the op inside quack.compile_only.compile_only_mode() to compile and export its kernels from fake "
        "tensors (nothing launches there)"
    )


def check_contiguous(name: str, t: torch.Tensor) -> None:
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (got strides {tuple(t.stride())})")


def check_param(name: str, t: torch.Tensor | None, x: torch.Tensor) -> None:
    """A norm's (N,) parameter (weight, bias), if given: fp32 or x's dtype,
    contiguous, on x's device."""
    if t is None:
        return
    check_float(name, t, (torch.float32, x.dtype))
    check_cuda(name, t, x)
    check_contiguous(name, t)
    if tuple(t.shape) != (x.shape[-1],):
        raise ValueError(f"{name} must have shape ({x.shape[-1]},), got {tuple(t.shape)}")


def widest_vector(n: int, element_bytes: int, *tensors: tuple[int, int]) -> int:
    """Elements per vector copy: the most (at most 16 bytes of the row's dtype)
    that divide N and keep every ``(address, element_bytes)`` tensor aligned
    to its copy size (capped at 16 bytes).  1 for odd N with 16-bit data."""
    vec = math.gcd(n, 16 // element_bytes)
    while vec > 1 and any(addr % min(16, vec * size) for addr, size in tensors):
        vec //= 2
    return vec


def check_rows(name: str, m: int) -> None:
    """At most ``MAX_ROWS`` rows: the kernels index rows with 32-bit integers."""
    if m > MAX_ROWS:
        raise ValueError(f"{name} has {m} rows; the kernels index rows with 32 bits (at most 2^31 - 2^16 rows)")


_CAPABILITIES: dict[int, tuple[int, int]] = {}


def _capability(index: int) -> tuple[int, int]:
    """(major, minor) compute capability of GPU ``index``, asked once."""
    cc = _CAPABILITIES.get(index)
    if cc is None:
        cc = _CAPABILITIES[index] = tuple(torch.cuda.get_device_capability(index))
    return cc


def check_arch(op: str, device: torch.device, needs: str, minimum: tuple[int, int], maximum=None) -> None:
    """Refuse, before any compile or launch, a GPU the op's kernels cannot run
    on: compute capability below ``minimum`` or above ``maximum``.  In
    compile-only mode the GPU is the compile target (``QUACK_ARCH``).  Skipped
    while torch.compile traces (Dynamo cannot trace the driver query): the
    eager call or compile-only warming of the same op checks."""
    if torch.compiler.is_compiling():
        return
    if is_compile_only():
        from quack.cache import current_arch

        arch = current_arch()
        capability = arch_capability(arch)
    else:
        index = device.index if device.index is not None else torch.cuda.current_device()
        capability = _capability(index)
    if capability >= minimum and (maximum is None or capability <= maximum):
        return
    if is_compile_only():
        where = f"the compile target QUACK_ARCH={arch}"
    else:
        where = f"cuda:{index} ({torch.cuda.get_device_name(index)}) is sm_{capability[0]}{capability[1]}"
    raise ValueError(f"{op} needs {needs}; {where}")


def check_row_input(op: str, name: str, x: torch.Tensor, max_n: int) -> None:
    """The (..., N) input of a row-wise op: a contiguous float CUDA tensor,
    1 <= N <= ``max_n``, at most ``MAX_ROWS`` rows, on an sm_90 or newer GPU
    (the kernels use thread block clusters, DSMEM and mbarriers)."""
    check_float(name, x)
    check_cuda(name, x, op=op)
    check_contiguous(name, x)
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(f"{name} must have shape (..., N) with N >= 1, got {tuple(x.shape)}")
    n = x.shape[-1]
    if n > max_n:
        raise ValueError(f"N = {n} is larger than the supported {max_n}")
    check_rows(name, x.numel() // n)
    check_arch(op, x.device, "an sm_90 (Hopper) or newer GPU (its kernels use thread block clusters)", (9, 0))
