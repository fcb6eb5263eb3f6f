"""quack: Hopper kernels in the CuTe DSL whose compiled objects are cached build artifacts.

Public ops: :func:`rmsnorm`, :func:`softmax`, :func:`cross_entropy`,
:func:`layernorm`, :func:`gemm`.  The kernel cache is :mod:`quack.cache`;
compile-only warming is :mod:`quack.compile_only` and the pytest plugin
``quack.testing.pytest_plugin``.
"""

from quack.cross_entropy import cross_entropy, cross_entropy_ref
from quack.gemm import gemm, gemm_ref
from quack.layernorm import layernorm, layernorm_ref
from quack.rmsnorm import rmsnorm, rmsnorm_ref
from quack.softmax import softmax, softmax_ref

__all__ = [
    "cross_entropy",
    "cross_entropy_ref",
    "gemm",
    "gemm_ref",
    "layernorm",
    "layernorm_ref",
    "rmsnorm",
    "rmsnorm_ref",
    "softmax",
    "softmax_ref",
]
