"""The two calls into the CuTe DSL runtime: export a compiled function, load an object.

Kept apart from the lookup logic so tests can replace them, and so ``import
quack.cache`` does not import cutlass (seconds) until a kernel is needed.

Loading goes through the DSL runtime library's C loader
(``CuteDSLRT_Module_Create_From_Bytes`` in ``libcute_dsl_runtime.so``, found
beside the DSL's package without importing it): a process that only loads
cached objects never imports the DSL's Python package.  Where that library
is missing or refuses an object, the DSL's own ``load_module`` loads it
(with a one-time notice).  Loaded modules stay loaded for the process.

The DSL's Python package is not thread-safe (its compiler keeps per-process
state: two threads compiling at once crash or corrupt each other), so every
call into it holds ``DSL_LOCK``; loads through the C loader and launches do
not need it and stay concurrent.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Optional

from . import key, stats
from quack.launch.handle import KernelHandle
from quack.launch.launcher import FastLauncher, RuntimeFunction

log = logging.getLogger("quack.cache")
RUNTIME_LIBRARY = key.RUNTIME_LIBRARY
# Held by every call into the DSL's Python package: compile, export, load_module.
DSL_LOCK = threading.RLock()


@functools.lru_cache(maxsize=None)
def _load_runtime_globally() -> None:
    """``export_to_c`` resolves ``_cudaLibraryLoadData`` and friends from the CuTe
    runtime library, which must therefore be loaded ``RTLD_GLOBAL`` first."""
    import cutlass.runtime

    for lib in cutlass.runtime.find_runtime_libraries(enable_tvm_ffi=False):
        ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)


def export_object(compiled: Any, directory: Path, name: str, prefix: str) -> None:
    """Write ``directory/name.o`` (and ``name.h``) with symbols prefixed ``prefix``."""
    with DSL_LOCK:
        _load_runtime_globally()
        compiled.export_to_c(str(directory), name, prefix)


def load_object(data: bytes, prefix: str, keyhash: str, abi: list) -> KernelHandle:
    """Load an exported object from its bytes (those its sidecar verified) and
    wrap its host entry point, with the argument layout ``abi`` that the
    sidecar recorded at export.

    Through the runtime's C loader where it works (``FastLauncher`` calls
    the function through ``CuteDSLRT_Function_Run``).  Otherwise
    ``load_module`` links the object into a JIT execution engine; indexing
    the module by the export's function prefix returns a
    ``JitCompiledFunction``, whose entry point ``FastLauncher`` calls
    directly after the first launch.
    """
    runtime = _runtime()
    if runtime is not None:
        function = _load_with_runtime(runtime, data, prefix)
        if function is not None:
            return KernelHandle(FastLauncher(None, abi, runtime=function), keyhash)
    with DSL_LOCK:
        import cutlass.cute as cute

        # load_module reads a path: a private copy of the verified bytes, never the
        # entry itself, kept (with the module) as long as the handle.
        folder = tempfile.TemporaryDirectory(prefix="quack-load-")
        copy = Path(folder.name) / f"{keyhash}.o"
        copy.write_bytes(data)
        module = cute.runtime.load_module(str(copy))
    return KernelHandle(FastLauncher(module[prefix], abi), keyhash, owner=(module, folder))


@functools.lru_cache(maxsize=None)
def runtime_library_path() -> Optional[Path]:
    """The DSL runtime library the object keys name: ``CUTE_DSL_LIBS``'s
    where it is set, else the one of the key's CUDA flavour
    (``key.cuda_flavour``: read from the file system where one flavour is
    installed, asked of the DSL where several are); None where it is missing."""
    chosen = os.environ.get("CUTE_DSL_LIBS")
    if chosen:
        paths = [Path(p) for p in chosen.split(os.pathsep) if p.endswith(RUNTIME_LIBRARY)]
    else:
        root = key.dsl_root()
        flavour = key.cuda_flavour() if root is not None else None
        paths = [root / ("lib" if flavour == "unknown" else f"{flavour}/lib") / RUNTIME_LIBRARY] if root else []
    return next((p for p in paths if p.is_file()), None)


@functools.lru_cache(maxsize=None)
def _runtime() -> Optional[ctypes.CDLL]:
    """The runtime library, loaded ``RTLD_GLOBAL`` (objects resolve its
    symbols), with the C loader's signatures; None (noticed once) where
    it cannot be loaded."""
    path = runtime_library_path()
    try:
        if path is None:
            raise OSError(f"no {RUNTIME_LIBRARY} beside the nvidia_cutlass_dsl package")
        lib = ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
        lib.CuteDSLRT_Module_Create_From_Bytes.argtypes = [
            ctypes.POINTER(ctypes.c_void_p), ctypes.c_char_p, ctypes.c_size_t,
            ctypes.POINTER(ctypes.c_char_p), ctypes.c_size_t,
        ]
        lib.CuteDSLRT_Module_Get_Function.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p, ctypes.c_char_p]
        lib.CuteDSLRT_Function_Run.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
        lib.CuteDSLRT_GetErrorName.restype = ctypes.c_char_p
        lib.CuteDSLRT_Module_Destroy.argtypes = [ctypes.c_void_p]
        for name in ("CuteDSLRT_Module_Create_From_Bytes", "CuteDSLRT_Module_Get_Function", "CuteDSLRT_Function_Run"):
            getattr(lib, name).restype = ctypes.c_int
    except (OSError, AttributeError) as err:
        log.warning("quack: cached objects load through the CuTe DSL's Python package (seconds to import): "
                    "its runtime library's C loader is not available (%s)", err)
        return None
    return lib


def _load_with_runtime(lib: ctypes.CDLL, data: bytes, prefix: str) -> Optional[RuntimeFunction]:
    """The object's function through the C loader; None (noticed once per
    error) where the loader refuses it.  Times each of its two stages."""
    module = ctypes.c_void_p()
    shared = (ctypes.c_char_p * 1)(str(runtime_library_path()).encode())
    start = time.perf_counter()
    status = lib.CuteDSLRT_Module_Create_From_Bytes(ctypes.byref(module), data, len(data), shared, 1)
    stats.record_seconds("runtime_create", time.perf_counter() - start)
    function = ctypes.c_void_p()
    if status == 0:
        start = time.perf_counter()
        status = lib.CuteDSLRT_Module_Get_Function(ctypes.byref(function), module, prefix.encode())
        stats.record_seconds("runtime_function", time.perf_counter() - start)
    if status != 0:
        if module.value:
            lib.CuteDSLRT_Module_Destroy(module)
        _notice_refusal(lib.CuteDSLRT_GetErrorName(status).decode())
        return None
    return RuntimeFunction(lib.CuteDSLRT_Function_Run, function.value)


@functools.lru_cache(maxsize=None)
def _notice_refusal(error: str) -> None:
    log.warning("quack: the CuTe DSL runtime's C loader refused an object (%s); loading it through the DSL's "
                "Python package instead", error)
