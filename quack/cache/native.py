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


def load_object(path: Path, prefix: str, keyhash: str) -> KernelHandle:
    """Load an exported object and wrap its host entry point.

    ``load_module`` links the object into a JIT execution engine; indexing the
    module by the export's function prefix decodes the stored signature and
    returns a ``JitCompiledFunction`` that takes the same runtime arguments as the
    launcher (torch tensors, scalars, a ``CUstream``).
    """
    import cutlass.cute as cute

    module = cute.runtime.load_module(str(path))
    return KernelHandle(module[prefix], keyhash, owner=module)
