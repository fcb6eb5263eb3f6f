"""quack: Hopper kernels in the CuTe DSL whose compiled objects are cached build artifacts.

Public ops: :func:`rmsnorm`, :func:`softmax`.  The kernel cache is :mod:`quack.cache`;
compile-only warming is :mod:`quack.compile_only` and the pytest plugin
``quack.testing.pytest_plugin``.
"""

from quack.rmsnorm import rmsnorm, rmsnorm_ref
from quack.softmax import softmax, softmax_ref

__all__ = ["rmsnorm", "rmsnorm_ref", "softmax", "softmax_ref"]
