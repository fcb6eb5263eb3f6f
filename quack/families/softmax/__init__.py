"""The softmax family: kernels in ``kernels.py``, the op in ``op.py``."""

from quack.families.softmax.op import softmax, softmax_ref

__all__ = ["softmax", "softmax_ref"]
