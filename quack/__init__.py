"""quack: Hopper kernels in the CuTe DSL whose compiled objects are cached build artifacts.

Public ops: :func:`rmsnorm`, :func:`softmax`, :func:`cross_entropy`,
:func:`layernorm`, :func:`gemm`, :func:`gemm_glu`, :func:`mlp`.  The kernel cache is :mod:`quack.cache`;
compile-only warming is :mod:`quack.compile_only` and the pytest plugin
``quack.testing.pytest_plugin``.

The exports are bound on first use: ``import quack`` imports no kernel family
(nor torch or the CuTe DSL), and a process that uses one family imports that
family's modules only -- what lets a Bazel action declare exactly the modules
it reads.
"""

import importlib
import sys
import types

# Each export -> the submodule defining it.
_EXPORTS = {
    "cross_entropy": "cross_entropy",
    "cross_entropy_ref": "cross_entropy",
    "gemm": "gemm",
    "gemm_glu": "gemm",
    "gemm_ref": "gemm",
    "layernorm": "layernorm",
    "mlp": "gemm_mlp",
    "layernorm_ref": "layernorm",
    "rmsnorm": "rmsnorm",
    "rmsnorm_ref": "rmsnorm",
    "softmax": "softmax",
    "softmax_ref": "softmax",
}

__all__ = sorted(_EXPORTS)


class _Package(types.ModuleType):
    """The package's module type: binds exports on first access, and keeps an
    op bound to its name when its submodule of the same name is imported
    later (the import system then sets ``quack.rmsnorm`` to the module)."""

    def __getattr__(self, name):
        module = _EXPORTS.get(name)
        if module is None:
            raise AttributeError(f"module 'quack' has no attribute {name!r}")
        value = getattr(importlib.import_module(f"quack.{module}"), name)
        super().__setattr__(name, value)
        return value

    def __setattr__(self, name, value):
        if isinstance(value, types.ModuleType) and _EXPORTS.get(name) == name and value.__name__ == f"quack.{name}":
            value = getattr(value, name)
        super().__setattr__(name, value)

    def __dir__(self):
        return sorted(set(super().__dir__()) | set(_EXPORTS))


sys.modules[__name__].__class__ = _Package
