"""The GEMM family: ``quack.gemm``, ``quack.gemm_glu`` and ``quack.mlp`` on Hopper's WGMMA."""

from quack.families.gemm.mlp import mlp
from quack.families.gemm.op import gemm, gemm_glu, gemm_ref

__all__ = ["gemm", "gemm_glu", "gemm_ref", "mlp"]
