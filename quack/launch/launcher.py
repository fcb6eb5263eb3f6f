"""A thin launcher over an exported object's C entry point: one C call per launch, no DLPack.

Calling a ``JitCompiledFunction`` converts every torch tensor through DLPack
and re-validates the argument spec on each call, a cost that grows with the
number of arguments.  The object's host entry point itself only
wants an array of pointers: one per present argument (a small struct per
tensor: data pointer, then its dynamic shapes, then its dynamic strides; a
scalar's address; the stream's address), then the executor's trailing slots.

The struct layout of each argument is recorded at export time from the C
header that ``export_to_c`` writes (``parse_abi``) and stored in the entry's
sidecar.  This launcher lays those structs out in one preallocated buffer of
64-bit words (``layout``), and each call fills it and calls the entry point
directly: in C (``_fastlaunch.c``: tensors read through torch's DLPack C
exchange table), or, where that extension is not built, with generated
straight-line Python over ctypes.  For a ``JitCompiledFunction`` (a fresh
compile, or the DSL's ``load_module``) the first call goes through the DSL
instead, which loads the CUDA module onto the device and creates the
executor whose entry point the later calls reuse; an object the DSL
runtime's C loader loaded (``native.py``) launches through the runtime's
``CuteDSLRT_Function_Run`` from its first call.

Convention: a tensor's dynamic dimensions are its leading ones, and so are
its dynamic strides, as every quack fake tensor declares them (a symbolic
batch dimension first, static trailing sizes, unit innermost stride).  The
exported header gives only the counts, so the compile functions keep it (a
transposed operand is declared as its transpose; see ``compile_gemm``).
"""

from __future__ import annotations

import array
import ctypes
import functools
import re
import struct
import threading
import warnings
from typing import Any, Callable, NamedTuple, Sequence

_C_TYPES = {
    "int32_t": ctypes.c_int32,
    "int64_t": ctypes.c_int64,
    "float": ctypes.c_float,
    "double": ctypes.c_double,
    "bool": ctypes.c_bool,
}

_STRUCT = re.compile(r"typedef struct \{\s*void \*data;(?P<body>[^}]*)\}\s*(?P<name>\w+);", re.S)
_FIELD = re.compile(r"(?P<ctype>\w+) (?P<field>dynamic_shapes|dynamic_strides)\[(?P<count>\d+)\];")


def parse_abi(header: str, prefix: str) -> list[list]:
    """The argument layout of ``cute_dsl_<prefix>_wrapper`` as JSON-friendly lists.

    Each entry is ``["tensor", shape_ctype, n_shapes, stride_ctype, n_strides]``,
    ``["scalar", ctype]`` or ``["stream"]``, in call order (absent ``None``
    arguments have no entry).
    """
    structs = {}
    for match in _STRUCT.finditer(header):
        fields = {m["field"]: (m["ctype"], int(m["count"])) for m in _FIELD.finditer(match["body"])}
        shapes = fields.get("dynamic_shapes", ("int32_t", 0))
        strides = fields.get("dynamic_strides", ("int64_t", 0))
        structs[match["name"]] = ["tensor", shapes[0], shapes[1], strides[0], strides[1]]
    wrapper = re.search(rf"cute_dsl_{re.escape(prefix)}_wrapper\((?P<params>[^)]*)\)", header)
    if wrapper is None:
        raise ValueError(f"no cute_dsl_{prefix}_wrapper in the exported header")
    abi = []
    for param in [p.strip() for p in wrapper["params"].split(",")][1:]:  # [0] is the module
        ctype = param.rsplit(" ", 1)[0].rstrip("*").strip()
        if ctype in structs:
            abi.append(structs[ctype])
        elif ctype == "cudaStream_t":
            abi.append(["stream"])
        elif ctype in _C_TYPES:
            abi.append(["scalar", ctype])
        else:
            raise ValueError(f"unsupported parameter type {ctype!r} in {param!r}")
    return abi


_WORD = 8
# One-letter codes shared with the C launcher (_fastlaunch.c).
_CTYPE_CODES = {"int32_t": "i", "int64_t": "l", "float": "f", "double": "d", "bool": "b"}


def c_fields(placed: list[tuple[int, str, str, int, int]]) -> list[tuple[int, str, str, int, int]]:
    """``layout``'s fields as the C launcher takes them (one-letter C types)."""
    return [(index, what, _CTYPE_CODES[ctype], dim, offset) for index, what, ctype, dim, offset in placed]


def fields(spec: Sequence[Any]) -> list[tuple[str, str, int, int]]:
    """(what, C type, dimension, byte offset) of each field of one argument;
    what: "d" a tensor's data pointer, "s"/"t" its size/stride along the
    dimension, "v" a scalar's value, "q" the stream handle."""
    if spec[0] == "scalar":
        return [("v", spec[1], 0, 0)]
    if spec[0] == "stream":
        return [("q", "int64_t", 0, 0)]
    _, shape_ctype, n_shapes, stride_ctype, n_strides = spec
    parts = [("data", ctypes.c_void_p, "d", 0)]
    parts += [(f"s{i}", _C_TYPES[shape_ctype], "s", i) for i in range(n_shapes)]
    parts += [(f"t{i}", _C_TYPES[stride_ctype], "t", i) for i in range(n_strides)]
    layout = type("Layout", (ctypes.Structure,), {"_fields_": [(n, t) for n, t, _, _ in parts]})
    ctypes_names = {ctypes.c_void_p: "int64_t", ctypes.c_int32: "int32_t", ctypes.c_int64: "int64_t"}
    return [(what, ctypes_names[t], dim, getattr(layout, n).offset) for n, t, what, dim in parts]


def layout(abi: list[list], present: list[bool]) -> tuple[list[tuple[int, str, str, int, int]], list[int], int]:
    """Where every field of every present argument goes in the word buffer:
    (argument index, what, C type, dimension, byte offset) per field, the
    first word of each present argument, and the buffer's size in words.
    Argument ``i`` has no fields where ``present[i]`` is false (None at compile time)."""
    placed, starts, word = [], [], 0
    specs = iter(abi)
    for index, is_present in enumerate(present):
        if not is_present:
            continue
        starts.append(word)
        arg_fields = fields(next(specs))
        placed += [(index, what, ctype, dim, _WORD * word + offset) for what, ctype, dim, offset in arg_fields]
        word += max(offset for *_, offset in arg_fields) // _WORD + 1
    return placed, starts, word


# A data pointer is checked only where it is null (``or``): a real one costs nothing more.
_EXPRESSIONS = {
    "d": "(a{i}.data_ptr() or _no_memory({i}, a{i}))",
    "s": "a{i}.size({dim})",
    "t": "a{i}.stride({dim})",
    "v": "a{i}",
    "q": "a{i}",
}


def _word_value(parts: list[tuple[str, str, int]]) -> str:
    """Expression for one 64-bit word holding the given (type, expression, byte-in-word) parts."""
    terms = []
    for ctype, expr, byte in parts:
        if ctype == "float":
            expr = f"_f32_bits({expr})"
        elif ctype == "double":
            expr = f"_f64_bits({expr})"
        elif ctype == "bool":
            expr = f"int({expr})"
        elif ctype == "int32_t":
            expr = f"_i32({expr})"
        if len(parts) > 1:
            expr = f"(({expr}) & 0xFFFFFFFF) << {8 * byte}"
        terms.append(expr)
    return " | ".join(terms)


def make_packer(abi: list[list], present: list[bool]):
    """Build ``pack(buf, *args)``: writes every present argument into the
    64-bit word buffer ``buf``; returns it with each argument's first word
    and the buffer's size in words.

    The function is generated as straight-line code (one assignment per
    word, no loops or per-argument calls), since it runs on every launch
    where the C launcher is not built.
    """
    placed, starts, words = layout(abi, present)
    by_word: dict[int, list] = {}
    for index, what, ctype, dim, offset in placed:
        expr = _EXPRESSIONS[what].format(i=index, dim=dim)
        by_word.setdefault(offset // _WORD, []).append((ctype, expr, offset % _WORD))
    lines = [f"    buf[{w}] = {_word_value(by_word[w])}" for w in sorted(by_word)]
    params = ", ".join(f"a{i}" for i in range(len(present)))
    source = f"def pack(buf, {params}):\n" + ("\n".join(lines) or "    pass") + "\n"
    namespace = {"_f32_bits": _f32_bits, "_f64_bits": _f64_bits, "_i32": _i32, "_no_memory": _no_memory}
    exec(compile(source, "<quack launcher pack>", "exec"), namespace)
    return namespace["pack"], starts, words


@functools.lru_cache(maxsize=256)
def _f32_bits(value) -> int:
    """Bit pattern of a float32 scalar (cached: an eps changes rarely)."""
    return struct.unpack("<I", struct.pack("<f", float(value)))[0]


def _i32(value: int) -> int:
    """A 32-bit field's value, refused (as the C launcher does) where it does not fit."""
    if not -(2**31) <= value < 2**31:
        raise OverflowError(f"quack launcher: {value} does not fit a 32-bit argument")
    return value


def _no_memory(index: int, tensor) -> int:
    """The null data pointer of tensor argument ``index``, where it has no
    elements; one with elements has no memory to launch on (a fake or meta
    tensor) and is refused, as the C launcher refuses it."""
    if tensor.numel():
        raise ValueError(
            f"quack launcher: argument {index} is a tensor with elements but no memory (a null data pointer: a "
            "fake or meta tensor?); nothing was launched. Launch on real CUDA tensors, or warm kernels on fake "
            "ones inside quack.compile_only.compile_only_mode()"
        )
    return 0


def _f64_bits(value) -> int:
    return struct.unpack("<q", struct.pack("<d", float(value)))[0]


class RuntimeFunction(NamedTuple):
    """A function of an object the CuTe DSL runtime's C loader loaded:
    ``CuteDSLRT_Function_Run`` (a ctypes function) and the function's handle."""

    run: Any
    handle: int


class FastLauncher:
    """Calls a compiled or loaded kernel with arguments packed into one word buffer.

    Arguments are passed positionally as the launcher declares them (None
    for absent optional tensors, as at compile time); scalars as Python
    numbers and the stream as a raw handle (``int``).  After the first call
    the C launcher (``_fastlaunch``) packs and calls; where it is not built,
    generated Python does (``launcher_kind`` says which).  Either refuses a
    tensor with elements and a null data pointer (a fake or meta tensor:
    ValueError, nothing launched), as the first call does.

    ``fn`` is a ``JitCompiledFunction`` (a fresh compile, or an object the
    DSL's ``load_module`` loaded), whose first call goes through the DSL;
    or None with ``runtime``, an object the DSL runtime's C loader loaded
    (``quack/cache/native.py``), which every call launches directly.
    """

    def __init__(self, fn: Any, abi: list[list], runtime: RuntimeFunction | None = None):
        self._fn = fn
        self._runtime = runtime
        self._abi = abi
        self._entry = (0, 0, 0)  # (entry point or function handle, Function_Run or 0, pointer count)
        self._c = None  # the C launcher, once the first call has set it up
        self._pack = None  # or the generated Python packer
        self._buf = None
        self._packed = None  # the pointer array handed to the entry point
        self._capi = None
        self._result = None
        self._nargs = 0
        self._placed = None  # the fields' layout for this call's present arguments
        self._context = (0, 0)  # (cuCtxGetCurrent's address, the first launch's context)
        self._device = -1  # the CUDA device of the first launch's tensors
        # After the first call, a C launcher that declines (NotImplemented) a
        # call from another current context or on another device's tensors:
        # KernelHandle tries it before its Python device guard.
        self.checked = None
        # The buffer is shared state: one launch packs and calls at a time
        # (the C launcher converts every argument first, then writes and
        # launches with no Python code in between: the GIL is held throughout).
        self._lock = threading.Lock()

    def __call__(self, *args: Any) -> None:
        if self._c is not None:
            return self._c(*args)
        with self._lock:
            if self._c is not None:  # set up by the first call while this one waited
                return self._c(*args)
            if self._packed is None:
                if self._runtime is None:
                    self._first_call(args)
                    return
                self._set_up(args, *self._runtime_calls())
                if self._c is not None:
                    return self._c(*args)
            if len(args) != self._nargs:
                raise TypeError(f"kernel takes {self._nargs} arguments, got {len(args)}")
            self._pack(self._buf, *args)
            self._capi(self._packed)
            if self._result is not None and self._result.value != 0:
                raise RuntimeError(f"kernel launch failed with CUDA error {self._result.value}")

    def direct(self, rows: frozenset[int], per_stream: frozenset[int] = frozenset()) -> Any:
        """A C launcher for the eager fast path (``quack/calls/fastpath.py``), or
        None before the first call or without the C launcher.

        It takes the arguments of the first call's pattern, with three
        differences: each argument in ``rows`` is a contiguous (..., N)
        tensor read as the (M, N) rows the kernel declares (no view needed);
        each argument in ``per_stream`` is a dict from stream handles to the
        tensor to pass on that stream (a call on a stream without an entry,
        or on one a CUDA graph is capturing, is declined) or a tensor to
        pass as it is; and the stream is torch's current stream on the first
        tensor's device (pass None).  It returns NotImplemented, launching
        nothing, when the current CUDA context is not the one its module was
        loaded in (another device is current: the caller takes the guarded
        path).  None too where the first call found no context to check
        against, or, for ``per_stream`` arguments, where the driver cannot
        say whether the stream is capturing a graph."""
        if self._c is None or not self._context[1]:
            return None
        if per_stream and not _driver_address("cuStreamIsCapturing"):
            return None  # kept buffers could enter a graph: the full path decides per call
        fields = []
        for index, what, ctype, dim, offset in c_fields(self._placed):
            if index in per_stream and what == "d":
                fields.append((index, "K", "", 0, 0))  # before the tensor's own fields
            if index in rows and what in "st" and dim == 0:
                what = "S" if what == "s" else "T"
            elif what == "q":
                what = "Q"
            fields.append((index, what, ctype, dim, offset))
        return self._launcher(fields, checked=True)

    def _launcher(self, fields: list, checked: bool) -> Any:
        """A C launcher over this launcher's buffer and pointer array;
        ``checked``: it declines calls from another current CUDA context
        than the first launch's, or on tensors of another device."""
        module, api, tensor = _c_module()
        entry, run, count = self._entry
        context, device = (self._context, self._device) if checked else ((0, 0), -1)
        return module.Launcher(entry, self._packed, self._buf, self._result, self._nargs, fields, api, tensor,
                               *context, run, count, device, _driver_address("cuStreamIsCapturing"))

    def bare(self, calls: int) -> float | None:
        """Seconds for ``calls`` calls of the entry point from C with the last
        call's arguments (no packing): the floor a launch cannot go below.
        None without the C launcher."""
        return None if self._c is None else self._c.bare(calls)

    def _first_call(self, args: tuple) -> None:
        """Launch through the DSL once (it loads the module onto the device),
        then take over its executor's entry point for every later call."""
        self._check_present(args)
        specs = iter(self._abi)
        self._fn(*[a if a is None else _dsl_value(i, next(specs), a) for i, a in enumerate(args)])
        executor = getattr(self._fn, "_default_executor", None)
        if executor is None or not hasattr(executor, "_get_invoke_packed_args"):
            return  # an unknown DSL layout: stay on the slow path
        self._capi = executor.capi_func
        # Where the DSL wrapped its entry point (profiling), ctypes keeps its call.
        if isinstance(self._capi, ctypes._CFuncPtr) and (
            executor.cuda_result is None or isinstance(executor.cuda_result, ctypes.c_int32)
        ):
            self._entry = (ctypes.cast(self._capi, ctypes.c_void_p).value, 0, 0)
        self._set_up(args, executor._get_invoke_packed_args, executor.cuda_result)

    def _check_present(self, args: tuple) -> list[bool]:
        """Which arguments are present; as many as the object takes, or TypeError."""
        present = [a is not None for a in args]
        if sum(present) != len(self._abi):
            raise TypeError(f"kernel takes {len(self._abi)} non-None arguments, got {sum(present)}")
        return present

    def _runtime_calls(self) -> tuple[Callable[[list[int]], list[int]], ctypes.c_int32]:
        """Calls through the DSL runtime's ``Function_Run``: (the pointer
        array from the arguments' addresses, ending with the address of the
        CUDA status the function writes; that status)."""
        result = ctypes.c_int32(0)
        run, handle = self._runtime

        def call(packed):
            status = run(handle, packed, len(packed))
            if status != 0:
                raise RuntimeError(f"kernel launch failed: CuTe DSL runtime error {status}")

        self._capi = call
        return (lambda addresses: addresses + [ctypes.addressof(result)]), result

    def _set_up(self, args: tuple, packed_args: Callable[[list[int]], list[int]], result) -> None:
        """The word buffer, the pointer array (``packed_args`` turns the
        arguments' addresses into it) and the C launchers, for this call's
        pattern of present arguments."""
        present = self._check_present(args)
        pack, starts, words = make_packer(self._abi, present)
        buf = array.array("q", [0] * max(1, words))
        base = buf.buffer_info()[0]
        addresses = [base + _WORD * w for w in starts]
        packed = packed_args(addresses)
        self._pack, self._buf, self._nargs = pack, buf, len(args)
        self._packed = (ctypes.c_void_p * len(packed))(*packed)
        self._result = result
        if self._runtime is not None:
            self._entry = (self._runtime.handle, ctypes.cast(self._runtime.run, ctypes.c_void_p).value, len(packed))
        self._placed = layout(self._abi, present)[0]
        self._context = current_context()
        self._device = next((a.get_device() for a in args if getattr(a, "is_cuda", False)), -1)
        if not self._entry[0] or _c_module()[0] is None:
            return
        try:
            self._c = self._launcher(c_fields(self._placed), checked=False)
        except (ValueError, TypeError, RuntimeError) as err:  # a layout it does not take: ctypes launches this one
            warnings.warn(f"quack: a kernel launches through ctypes: the C launcher refused its layout ({err})",
                          stacklevel=4)
            return
        if self._context[1]:  # without a context to check against, the handle's guard decides
            self.checked = self._launcher(c_fields(self._placed), checked=True)


@functools.lru_cache(maxsize=None)
def _driver_function(name: str) -> Any:
    """The CUDA driver's function ``name`` (None where there is no driver)."""
    try:
        return getattr(ctypes.CDLL("libcuda.so.1"), name)
    except (OSError, AttributeError):
        return None


def _driver_address(name: str) -> int:
    """The address of the driver's function ``name``, which the C launcher
    calls (0 where there is no driver)."""
    function = _driver_function(name)
    return 0 if function is None else ctypes.cast(function, ctypes.c_void_p).value


@functools.lru_cache(maxsize=None)
def _context_getter() -> Any:
    """The driver's ``cuCtxGetCurrent`` (None where there is no driver)."""
    getter = _driver_function("cuCtxGetCurrent")
    if getter is None:
        return None
    getter.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
    getter.restype = ctypes.c_int
    return getter


def current_context() -> tuple[int, int]:
    """(cuCtxGetCurrent's address, the current CUDA context): what a direct
    launcher checks before each call; (0, 0) without a driver or a context."""
    getter = _context_getter()
    if getter is None:
        return 0, 0
    context = ctypes.c_void_p()
    if getter(ctypes.byref(context)) != 0 or not context.value:
        return 0, 0
    return ctypes.cast(getter, ctypes.c_void_p).value, context.value


@functools.lru_cache(maxsize=None)
def _c_module() -> tuple[Any, Any, Any]:
    """(the built C module, torch's DLPack exchange capsule, torch.Tensor), or
    Nones with a one-time notice where either is missing."""
    import torch

    api = getattr(torch.Tensor, "__dlpack_c_exchange_api__", None)
    try:
        from . import _fastlaunch
    except ImportError as err:
        reason = f"it is not built ({err}); `pip install .` builds it"
    else:
        if api is not None:
            return _fastlaunch, api, torch.Tensor
        reason = f"torch {torch.__version__} has no DLPack C exchange table"
    warnings.warn(f"quack: kernels launch through ctypes, a few microseconds more per call: the C launcher "
                  f"cannot run ({reason})", stacklevel=4)
    return None, None, None


def launcher_kind() -> str:
    """Which launcher later calls take: "C" (quack.launch._fastlaunch) or "ctypes"."""
    return "C" if _c_module()[0] is not None else "ctypes"


def _dsl_value(index: int, spec: list, arg: Any) -> Any:
    """Argument ``index`` as the DSL's own call path wants it: a ``CUstream``,
    typed scalars and tensors that DLPack can export (none that require grad:
    a compiled graph may hand the op its leaf inputs; none without memory,
    refused as the later calls refuse them); the fast path takes raw stream
    handles, Python numbers and data pointers."""
    if spec[0] == "tensor" and not arg.data_ptr():
        _no_memory(index, arg)
    if getattr(arg, "requires_grad", False):
        return arg.detach()
    if spec[0] == "stream" and isinstance(arg, int):
        import cuda.bindings.driver as cuda

        return cuda.CUstream(arg)
    if spec[0] == "scalar" and isinstance(arg, (int, float)):
        import cutlass

        return {"float": cutlass.Float32, "int32_t": cutlass.Int32, "int64_t": cutlass.Int64,
                "double": cutlass.Float64, "bool": cutlass.Boolean}[spec[1]](arg)
    return arg
