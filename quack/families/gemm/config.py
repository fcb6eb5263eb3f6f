"""The GEMM's configuration decisions on the host: tile and cluster shapes,
groupings, and how many clusters a persistent grid keeps resident.

Tile configuration (``gemm_config``): 128 x 256 x 64 tiles, two consumer
warpgroups, clusters of two CTAs along M sharing each B tile, output tiles
walked in bands of 8 cluster columns.  A varlen GEMM with few rows per group
on average (below ``LARGE_GROUP_ROWS``) pairs CTAs along N instead (sharing
each A tile): a cluster then spans 128 rows, not 256, and the partial tile at
the end of each group wastes half as much.  N <= 128 uses 128 x 128 tiles so
that half of each tile is not wasted.  A dense GEMM of a few rows (at most
``SMALL_M_ROWS``) uses 64 x 128 tiles without clusters, K split over several
CTAs so that every SM streams a share of B (``split.py``); up to
``MID_M_ROWS`` rows, 128 x 128 tiles split the same way, where
``split.dense_class`` says they beat the default (and the 64-row tiles
again up to ``L2_SMALL_M_ROWS`` rows where B fills at most 3/4 of the L2 cache).  Measured in
tools/bench/gemm_configs.py; no autotuning happens at call time.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from quack.calls import occupancy
from quack.families.gemm.threads import cta_threads

ALIGN_ELEMENTS = 8  # TMA: 16 bytes of a 16-bit dtype
LARGE_GROUP_ROWS = 2048  # varlen: from this many rows per group on, clusters pair CTAs along M

# dense; grouped by rows (cu_seqlens_m); grouped along K (cu_seqlens_k).
GROUPINGS = ("dense", "varlen_m", "varlen_k")
SMALL_M_ROWS = 64  # dense: up to this many rows, the 64-row split-K object runs
MID_M_ROWS = 512  # dense: up to this many rows, the 128-row split-K object may run
L2_SMALL_M_ROWS = 256  # dense: up to this many rows, the 64-row one where B fits in L2

# A varlen-M plan holds one object per class of rows per group: which one
# runs depends on a runtime size (and on a sentinel under compile-only).
GROUP_CLASSES = (("small_groups", 1.0), ("large_groups", float(LARGE_GROUP_ROWS)))
# A dense plan likewise holds one object per class of M: a few rows of tokens
# (a decode step) run 64-row tiles with K split (``split.py``), which fills
# the GPU where one row of tiles alone would not; a few hundred rows run
# 128-row tiles split the same way.
DENSE_CLASSES = ("dense", "small_m", "mid_m")


class GemmConfig(NamedTuple):
    """Static tile configuration: part of the object key."""

    tile_m: int = 128
    tile_n: int = 256
    cluster_m: int = 2
    cluster_n: int = 1
    band: int = 8
    split_k: bool = False  # K split over several CTAs at run time (kernel.py)


def gemm_config(n: int, rows_per_group: Optional[float] = None, m_class: str = "dense") -> GemmConfig:
    """The documented heuristic (see the module docstring); ``rows_per_group``
    is total_M / G for a varlen GEMM, None for a dense one; ``m_class``: a
    dense GEMM's class of M, one of ``DENSE_CLASSES``."""
    tile_n = 128 if n <= 128 else 256
    if m_class == "small_m":
        # (128 columns whatever N: twice the tiles to spread over the SMs.)
        return GemmConfig(tile_m=64, tile_n=128, cluster_m=1, cluster_n=1, split_k=True)
    if m_class == "mid_m":
        return GemmConfig(tile_m=128, tile_n=128, cluster_m=1, cluster_n=1, split_k=True)
    if rows_per_group is not None and rows_per_group < LARGE_GROUP_ROWS:
        # Pair CTAs along N: a cluster then spans 128 rows, not 256, and the
        # partial tile that ends each group wastes half as much.
        return GemmConfig(tile_n=tile_n, cluster_m=1, cluster_n=2)
    return GemmConfig(tile_n=tile_n)


def group_class(rows_per_group: float) -> str:
    """The role, among ``GROUP_CLASSES``, of the object a varlen-M call runs."""
    small, large = GROUP_CLASSES
    return small[0] if rows_per_group < LARGE_GROUP_ROWS else large[0]


def call_grouping(cu_seqlens_m: Optional[torch.Tensor], cu_seqlens_k: Optional[torch.Tensor] = None) -> str:
    """A call's grouping from its offsets (the checks allow one at most)."""
    if cu_seqlens_m is not None:
        return "varlen_m"
    return "varlen_k" if cu_seqlens_k is not None else "dense"


def kernel_grouping(out: torch.Tensor, cu_seqlens: Optional[torch.Tensor]) -> str:
    """The grouping of the kernel's arguments, which carry one offsets tensor:
    varlen K writes G stacked (M, N) products."""
    if cu_seqlens is None:
        return "dense"
    return "varlen_k" if out.dim() == 3 else "varlen_m"


def weight_grad_grouping(grouping: str) -> str:
    """The grouping of dB = Aᵀ @ dC: over each group's rows for grouped rows
    (a variable-length K)."""
    return "varlen_k" if grouping == "varlen_m" else "dense"


def resident_clusters(cfg: GemmConfig, device: torch.device) -> int:
    """The persistent grid's clusters: one CTA per SM (the tiles' shared memory)."""
    return occupancy.resident_clusters(
        device.index or 0, cta_threads(cfg.tile_m), cfg.cluster_m * cfg.cluster_n, ctas_per_sm=1
    )
