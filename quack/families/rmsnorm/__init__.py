"""The rmsnorm family: kernels in ``kernels.py``, the op in ``op.py``."""

from quack.families.rmsnorm.op import rmsnorm, rmsnorm_ref

__all__ = ["rmsnorm", "rmsnorm_ref"]
