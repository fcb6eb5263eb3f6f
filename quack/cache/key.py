"""The object key: everything that changes an exported object's bytes, nothing else.

Included: family, function, source hash of the family's modules, CuTe DSL version,
the CUDA flavour of the runtime library actually loaded, GPU arch, host target,
compile options, the static arguments, ``CACHE_FORMAT_VERSION`` and the CuTe DSL
environment settings that the DSL marks as changing generated code
(``dsl_settings``: debug, line info, assertions, compiler options, ...). Excluded on
purpose: Python and torch versions, hostname, checkout path, batch size -- none of
them changes the bytes (with a fixed host target, the same kernel compiled under
two Python versions on two machines gives identical objects), and including them
would split the cache between machines that could share it.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import re
from pathlib import Path
from typing import Any

from .config import HOST_TARGET
from .source_hash import record_imported

# Bump when the entry layout, sidecar or key schema changes.
# 2: the sidecar records the argument layout (abi) for the fast launcher.
CACHE_FORMAT_VERSION = 2

_STATIC_SCALARS = (str, int, float, bool, type(None))


def options_for_arch(arch: str) -> str:
    """The ``cute.compile`` options string for ``arch`` with the pinned host target."""
    return f"--gpu-arch {arch} --host-target '{HOST_TARGET}'"


def object_key(
    family: str, module: str, function: str, static_args: dict[str, Any], arch: str
) -> dict[str, Any]:
    """The key dict of one compiled object (JSON-serialisable, canonical)."""
    for name, value in static_args.items():
        _check_static(function, name, value)
    key = {
        "format": CACHE_FORMAT_VERSION,
        "family": family,
        "function": f"{module}.{function}",
        "source": record_imported(module),
        "dsl_version": dsl_version(),
        "cuda": cuda_flavour(),
        "arch": arch,
        "host_target": HOST_TARGET,
        "options": options_for_arch(arch),
        # JSON round trip: tuples become lists, as they read back from a sidecar.
        "args": json.loads(json.dumps(static_args)),
    }
    settings = dsl_settings()
    if settings:
        key["dsl_settings"] = settings
    return key


# The CuTe DSL reads its settings from CUTE_DSL_<NAME> environment variables.
DSL_ENV_PREFIX = "CUTE_DSL"


def dsl_settings() -> dict[str, str]:
    """The CuTe DSL environment variables that are set and that the DSL marks
    as affecting compilation (``affects_compile``), name -> value.  Settings
    the DSL computes rather than reads (the path of its runtime libraries)
    are not variables of their own and stay out: a path would split the
    cache between machines.  Empty (and absent from the key) by default; the
    DSL is imported only when some CUTE_DSL_ variable is set."""
    prefix = DSL_ENV_PREFIX + "_"
    set_here = {name: value for name, value in os.environ.items() if name.startswith(prefix)}
    if not set_here:
        return {}
    affecting = _compile_affecting_variables()
    return {name: value for name, value in sorted(set_here.items()) if name in affecting}


@functools.lru_cache(maxsize=1)
def _compile_affecting_variables() -> frozenset[str]:
    from cutlass.cutlass_dsl.cutlass import CuTeDSLEnvironmentManager

    return frozenset(
        f"{DSL_ENV_PREFIX}_{setting.source}"
        for setting in CuTeDSLEnvironmentManager._ENV_VAR_SPEC
        if setting.affects_compile and isinstance(setting.source, str)
    )


def key_hash(key: dict[str, Any]) -> str:
    """First 32 hex digits of sha256 over the canonical JSON of ``key``."""
    return hashlib.sha256(canonical_json(key).encode()).hexdigest()[:32]


def canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


@functools.lru_cache(maxsize=None)
def dsl_version() -> str:
    """The installed ``nvidia-cutlass-dsl`` version.

    Falls back to ``cutlass.__version__`` where the wheel was unpacked without
    its metadata (the GPU machine's device kit runs from ``PYTHONPATH``): as
    the package's ``__init__.py`` writes it, read without importing the
    package (2-3 s), which is imported only where the file does not say.
    """
    try:
        return importlib.metadata.version("nvidia-cutlass-dsl")
    except importlib.metadata.PackageNotFoundError:
        pass
    written = _written_version()
    if written is not None:
        return written
    import cutlass

    return cutlass.__version__


def _written_version() -> str | None:
    """``__version__`` as ``cutlass/__init__.py`` assigns it, if it does."""
    spec = importlib.util.find_spec("cutlass")
    if spec is None or not spec.origin:
        return None
    written = re.search(r'^__version__ = "([^"]+)"$', Path(spec.origin).read_text(), re.M)
    return written[1] if written else None


@functools.lru_cache(maxsize=None)
def cuda_flavour() -> str:
    """``cu12``/``cu13``: the flavour of the CuTe runtime library this process loads.

    Both ``nvidia-cutlass-dsl-libs-cu12`` and ``-cu13`` may be installed; each puts
    its runtime under ``nvidia_cutlass_dsl/<flavour>/lib``, so the flavour is read
    from the path of the library actually selected, not from the installed list.
    Where exactly one flavour is installed (and ``CUTE_DSL_LIBS`` does not
    choose), it is the one the DSL selects: read from the file system, without
    importing the DSL (2-3 s) on a machine that only loads objects.
    """
    only = _only_installed_flavour()
    if only is not None:
        return only
    import cutlass.runtime

    for lib in cutlass.runtime.find_runtime_libraries(enable_tvm_ffi=False):
        for part in reversed(Path(lib).parts):
            if re.fullmatch(r"cu\d+", part):
                return part
    return "unknown"


RUNTIME_LIBRARY = "libcute_dsl_runtime.so"


def dsl_root() -> Path | None:
    """The folder the DSL takes its runtime libraries from: the nearest
    ancestor of its ``cutlass`` package with ``lib/`` or ``cuXX/lib/``
    holding the runtime library (where the DSL's own search looks), found
    without importing the package; None where there is none."""
    spec = importlib.util.find_spec("cutlass")
    if spec is None or not spec.origin:
        return None
    for parent in Path(spec.origin).parents:
        if (parent / "lib" / RUNTIME_LIBRARY).exists() or any(parent.glob(f"cu*/lib/{RUNTIME_LIBRARY}")):
            return parent
    return None


def _only_installed_flavour() -> str | None:
    """The flavour when the DSL has a single runtime library to choose from."""
    if os.environ.get("CUTE_DSL_LIBS"):
        return None
    root = dsl_root()
    if root is None or (root / "lib" / RUNTIME_LIBRARY).exists():
        return None  # none, or a flavourless layout: the DSL's own answer
    found = sorted(path.parts[-3] for path in root.glob(f"cu*/lib/{RUNTIME_LIBRARY}"))
    return found[0] if len(found) == 1 and re.fullmatch(r"cu\d+", found[0]) else None


def _check_static(function: str, name: str, value: Any) -> None:
    """Static arguments must be plain scalars or tuples of them, so keys are stable."""
    if isinstance(value, (tuple, list)):
        for item in value:
            _check_static(function, name, item)
    elif not isinstance(value, _STATIC_SCALARS):
        raise TypeError(
            f"{function}: static argument {name!r} is a {type(value).__name__}; "
            "cache keys take str, int, float, bool, None or tuples of them"
        )


def function_prefix(family: str, keyhash: str) -> str:
    """Symbol prefix of an exported object, unique per key (two objects loaded into
    one process must never share a symbol name)."""
    return "quack_" + re.sub(r"\W", "_", family) + "_" + keyhash[:16]
