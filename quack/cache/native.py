"""The two calls into the CuTe DSL runtime: export a compiled function, load an object.

Kept apart from the lookup logic so tests can replace them, and so ``import
quack.cache`` does not import cutlass (2 to 3 s) until a kernel is needed.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path
from typing import Any

from .handle import KernelHandle
from .launcher import FastLauncher


@functools.lru_cache(maxsize=None)
def _load_runtime_globally() -> None:
    """``export_to_c`` resolves ``_cudaLibraryLoadData`` and friends from the CuTe
    runtime library, which must therefore be loaded ``RTLD_GLOBAL`` first."""
    import cutlass.runtime

    for lib in cutlass.runtime.find_runtime_libraries(enable_tvm_ffi=False):
        ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)


def export_object(compiled: Any, directory: Path, name: str, prefix: str) -> None:
    """Write ``directory/name.o`` (and ``name.h``) with symbols prefixed ``prefix``."""
    _load_runtime_globally()
    compiled.export_to_c(str(directory), name, prefix)


def load_object(path: Path, prefix: str, keyhash: str, abi: list) -> KernelHandle:
    """Load an exported object and wrap its host entry point.

    ``load_module`` links the object into a JIT execution engine; indexing the
    module by the export's function prefix decodes the stored signature and
    returns a ``JitCompiledFunction``; ``FastLauncher`` calls its entry point
    directly after the first launch, with the argument layout ``abi`` that the
    sidecar recorded at export.
    """
    import cutlass.cute as cute

    module = cute.runtime.load_module(str(path))
    return KernelHandle(FastLauncher(module[prefix], abi), keyhash, owner=module)
