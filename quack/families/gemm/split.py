"""Split K on the host: how many splits a call's tiles get, and the
workspace and counters through which its kernel sums them (the kernel's
side is in ``kernel.py``).

A product with fewer output tiles than the GPU has CTA slots (a few rows of
tokens times a weight) would leave most SMs idle, each busy one walking all
of K; split K gives every tile S consecutive K ranges instead.  S depends on
the tile count, K and the device, never on the data, so a call's bits are
the same from run to run."""

from __future__ import annotations

import threading
from typing import NamedTuple

import torch

from quack.calls import torch_interop as ti
from quack.families.gemm.config import L2_SMALL_M_ROWS, MID_M_ROWS, SMALL_M_ROWS, GemmConfig, gemm_config

TILE_K = 64  # the kernel's K step
MAX_SPLITS = 16
MIN_STEPS = 8  # K steps a split gets at least: fewer would not hide the pipeline's fill


def split_count(tiles: int, k: int, slots: int) -> int:
    """S for ``tiles`` output tiles over ``k`` on ``slots`` resident CTAs:
    the most splits that still run in one wave (``tiles * S <= slots``),
    each of at least ``MIN_STEPS`` K steps; 1 once the tiles alone fill the
    GPU.  (Splits over several waves lost to no split at all in
    tools/bench/gemm.py's inference table: each short split pays the
    pipeline's fill and a partial tile's store and sum.)"""
    steps = -(-k // TILE_K)
    return max(1, min(MAX_SPLITS, slots // max(tiles, 1), steps // MIN_STEPS))


def tile_count(cfg: GemmConfig, m: int, n: int) -> int:
    """Output tiles of a dense (M, N) product, whole clusters counted."""
    cluster_rows, cluster_cols = cfg.tile_m * cfg.cluster_m, cfg.tile_n * cfg.cluster_n
    return -(-m // cluster_rows) * -(-n // cluster_cols) * cfg.cluster_m * cfg.cluster_n


def dense_class(m: int, n: int, slots: int, weight_in_l2: bool = False) -> str:
    """The role, among ``config.DENSE_CLASSES``, of the object a dense call
    of M rows and N columns runs, with ``slots`` resident CTAs of 128 x 128
    tiles: up to ``SMALL_M_ROWS`` rows the 64-row split object; up to
    ``L2_SMALL_M_ROWS`` the 64-row one too where B fits in the L2 cache
    beside the rest (``weight_in_l2``: ``product.run_role`` decides) and its tiles fit in one wave (each tile row then
    rereads B from L2, and its splits sum half the 128-row tiles' bytes);
    up to ``MID_M_ROWS`` the 128-row one where its tiles fit in one wave (else the
    default's larger tiles cost fewer reads of A and B), or where one tile
    row holds all of M (the default's clusters pair two tile rows: half its
    CTAs would get no rows); else the default."""
    if m <= SMALL_M_ROWS:
        return "small_m"
    if weight_in_l2 and m <= L2_SMALL_M_ROWS and tile_count(gemm_config(n, m_class="small_m"), m, n) <= slots:
        return "small_m"
    mid = gemm_config(n, m_class="mid_m")
    if m <= MID_M_ROWS and (m <= mid.tile_m or tile_count(mid, m, n) <= slots):
        return "mid_m"
    return "dense"


class _Buffers:
    """One stream's workspace and counters, grown on demand.  Per stream:
    launches on one stream run one after another, so they can share them;
    launches on two streams may overlap, so they must not."""

    def __init__(self):
        self.workspace = None  # flat fp32
        self.counters = None  # int32 zeros (each launch's finalizers leave them zero)

    def grow(self, workspace: int, counters: int, device: torch.device) -> None:
        """At least ``workspace`` floats and ``counters`` counters (doubling:
        a growing M reallocates them a few times, not at each call)."""
        self.workspace = _at_least(self.workspace, workspace, torch.empty, torch.float32, device)
        self.counters = _at_least(self.counters, counters, torch.zeros, torch.int32, device)


def _at_least(buffer, numel: int, make, dtype: torch.dtype, device: torch.device):
    """``buffer``, or a new one of at least ``numel`` and twice its size.  The
    old one is freed: torch's allocator reuses its memory only for that
    stream's allocations, which follow the launches queued there; the fast
    path's closures may still hold views of it."""
    if buffer is not None and buffer.numel() >= numel:
        return buffer
    if buffer is not None:
        numel = max(numel, 2 * buffer.numel())
    return make(numel, device=device, dtype=dtype)


_BUFFERS: dict[tuple[int, int], _Buffers] = {}
_LOCK = threading.Lock()


class SplitPlan(NamedTuple):
    """How a split-K launch splits: its tiles and their split count."""

    tiles: int
    splits: int


def split_plan(cfg: GemmConfig, m: int, n: int, k: int, max_clusters: int) -> SplitPlan:
    """The split of a dense (M, N) product over ``k`` in ``cfg``, with a
    grid of at most ``max_clusters`` clusters."""
    tiles = tile_count(cfg, m, n)
    return SplitPlan(tiles, split_count(tiles, k, max_clusters * cfg.cluster_m * cfg.cluster_n))


def split_buffers(cfg: GemmConfig, split: SplitPlan, device: torch.device):
    """(workspace (S, W), counters (tiles,)) for a launch split as ``split``
    on the current stream of ``device``.  An unsplit launch (S = 1) touches
    neither: it gets one 16-byte row and one counter.

    While a CUDA graph is captured on that stream, the launch gets buffers
    of its own, not kept: a graph may replay on any stream, beside the
    capture stream's eager calls, which the kept buffers serve; and counters
    allocated in a capture are zeroed by a memset of the graph, which runs
    only when that graph replays."""
    splits = split.splits
    width, tiles = (split.tiles * cfg.tile_m * cfg.tile_n, split.tiles) if splits > 1 else (4, 1)
    if ti.capturing(device):
        workspace = torch.empty(splits, width, device=device, dtype=torch.float32)
        return workspace, torch.zeros(tiles, device=device, dtype=torch.int32)
    stream = torch.cuda.current_stream(device)
    with _LOCK:
        buffers = _BUFFERS.setdefault((device.index or 0, stream.cuda_stream), _Buffers())
        buffers.grow(splits * width, tiles, device)
        return buffers.workspace[: splits * width].view(splits, width), buffers.counters[:tiles]
