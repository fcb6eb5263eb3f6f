"""The layernorm family: kernels in ``kernels.py``, the op in ``op.py``."""

from quack.families.layernorm.op import layernorm, layernorm_ref

__all__ = ["layernorm", "layernorm_ref"]
