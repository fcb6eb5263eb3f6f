"""A mixture-of-experts expert layer, for the tests and the benchmark.

Tokens arrive sorted by expert (``cu_seqlens`` (E + 1,) int32 marks each
expert's rows); each expert multiplies its rows by its up-projection
(hidden -> 2 x width: gate and up columns interleaved, gate j at column 2 j
and up j at 2 j + 1, as ``quack.gemm_glu`` takes them), applies SwiGLU
(silu(gate) * up) and multiplies by its down-projection (width -> hidden).
The grouped products are a parameter, so the same layer runs on quack.gemm,
on torch._grouped_mm and on a loop of torch.matmul (the float64 reference);
the up-projection and SwiGLU may be one gated product (``quack_glu``), or
the whole layer ``quack.mlp`` (``quack_mlp_layer``), whose backward computes
SwiGLU's derivative in a GEMM epilogue.
"""

from __future__ import annotations

import random
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from quack.families.gemm.epilogue import gated_ref

GroupedMM = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def expert_layer(x, w_up, w_down, cu_seqlens, grouped_mm: GroupedMM, gated_mm: Optional[GroupedMM] = None):
    """x (T, H) sorted by expert, w_up (E, H, 2W), w_down (E, W, H) -> (T, H).
    ``gated_mm``: the up-projection and SwiGLU in one call; else SwiGLU in
    torch on ``grouped_mm``'s product."""
    if gated_mm is not None:
        hidden = gated_mm(x, w_up, cu_seqlens)
    else:
        hidden = gated_ref(grouped_mm(x, w_up, cu_seqlens), "swiglu")
    return grouped_mm(hidden, w_down, cu_seqlens)


def quack_mm(a, b, cu_seqlens):
    import quack

    return quack.gemm(a, b, cu_seqlens_m=cu_seqlens)


def quack_mlp_layer(x, w_up, w_down, cu_seqlens):
    import quack

    return quack.mlp(x, w_up, w_down, activation="swiglu", cu_seqlens_m=cu_seqlens)


def quack_glu(a, b, cu_seqlens):
    import quack

    return quack.gemm_glu(a, b, activation="swiglu", cu_seqlens_m=cu_seqlens)


def torch_grouped_mm(a, b, cu_seqlens):
    return torch._grouped_mm(a, b, offs=cu_seqlens[1:])


def loop_mm(a, b, cu_seqlens):
    """Expert by expert with torch.matmul (any dtype, float64 included)."""
    bounds = cu_seqlens.tolist()
    parts = [a[bounds[g]:bounds[g + 1]] @ b[g] for g in range(b.shape[0])]
    return torch.cat(parts) if parts else a.new_empty(0, b.shape[-1])


def routed_lengths(experts: int, rows: int, seed: int = 0) -> list[int]:
    """Uneven rows per expert summing to ``rows``, every ninth expert empty
    (a router's load is skewed, and some experts get no tokens).  Pure
    Python: the same lengths under compile-only, where tensors are fake."""
    rng = random.Random(seed)
    weights = [0.0 if e % 9 == 0 else rng.random() ** 2 for e in range(experts)]
    lengths = [int(w / sum(weights) * rows) for w in weights]
    lengths[-1] += rows - sum(lengths)
    return lengths


def cu_seqlens(lengths: list[int], device="cuda") -> torch.Tensor:
    lens = torch.tensor(lengths, device=device, dtype=torch.int32)
    return F.pad(torch.cumsum(lens, 0, dtype=torch.int32), (1, 0))
