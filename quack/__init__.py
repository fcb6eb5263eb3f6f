"""quack: Hopper kernels in the CuTe DSL whose compiled objects are cached build artifacts.

Public ops: :func:`rmsnorm`.  The kernel cache is :mod:`quack.cache`;
compile-only warming is :mod:`quack.compile_only` and the pytest plugin
``quack.testing.pytest_plugin``.
"""

from quack.rmsnorm import rmsnorm, rmsnorm_ref

__all__ = ["rmsnorm", "rmsnorm_ref"]
