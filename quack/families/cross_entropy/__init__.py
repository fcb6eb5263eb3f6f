"""The cross_entropy family: kernels in ``kernels.py``, the op in ``op.py``."""

from quack.families.cross_entropy.op import cross_entropy, cross_entropy_ref

__all__ = ["cross_entropy", "cross_entropy_ref"]
