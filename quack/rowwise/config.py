"""Launch settings of the row-wise kernels, decided on the host from N and
the element width, and the norms' eps: what a call needs before it launches,
without the CuTe DSL (``quack/rowwise/device.py`` holds the kernels' shared device
code and imports it).  See ``quack/rowwise/device.py`` for the thread mapping these
settings drive."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

# CTAs per SM that kernels staging a long row in shared memory (``stage_row``)
# ask for: at most 64 registers per thread in 256-thread CTAs.
STAGED_CTAS_PER_SM = 4

# Registers are the row's home; past this many values per thread the kernels
# spill, so longer rows are split over a cluster instead.  Kernels that keep
# more per-value state (a backward pass: x, dy and the weight-gradient
# accumulator) pass a smaller budget.
MAX_VALUES_PER_THREAD = 64
# Hopper allows 16 CTAs per cluster (a non-portable size that the DSL opts into).
MAX_CLUSTER = 16
# The longest row a row-wise op takes: a full cluster of 256-thread CTAs
# at the forward's values-per-thread budget.
MAX_N = 262144


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@dataclass(frozen=True)
class RowConfig:
    """Launch settings of a row-wise kernel; every field is a compile-time constant."""

    # Columns of one row (the static N of the compiled object).
    n: int
    # Elements per vector copy: 128 bits when N and the pointers allow it.
    vec: int
    # Threads per CTA.
    threads: int
    # Consecutive threads sharing one row.
    threads_per_row: int
    # CTAs of a cluster that split one row between them.
    cluster_n: int

    @staticmethod
    def for_row(n: int, vec: int, max_values: int = MAX_VALUES_PER_THREAD) -> "RowConfig":
        """The heuristic: 128 threads for short rows, 256 beyond 8K columns, and
        threads per row / cluster size grown until a thread holds at most
        ``max_values`` values; a row that would need more than 16 CTAs gets
        wider CTAs (up to 1024 threads) instead."""
        threads = 128 if n <= 8192 else 256
        while threads < 1024 and n > threads * max_values * MAX_CLUSTER:
            threads *= 2
        threads_per_row = min(threads, max(8, _next_pow2(math.ceil(n / 32))))
        cluster_n = _next_pow2(math.ceil(n / (threads_per_row * max_values)))
        # A peer CTA must own at least one vector per thread, or two CTAs would
        # cover the same columns.
        while cluster_n > 1 and threads_per_row * cluster_n * vec > n:
            cluster_n //= 2
        if cluster_n > MAX_CLUSTER:
            raise ValueError(f"N={n} is too long for one cluster of {MAX_CLUSTER} CTAs")
        return RowConfig(n, vec, threads, threads_per_row, cluster_n)

    @property
    def rows_per_cta(self) -> int:
        return self.threads // self.threads_per_row

    @property
    def vecs_per_thread(self) -> int:
        """Vector copies each thread makes to cover its slice of a row."""
        row_chunk = self.threads_per_row * self.vec
        per_cta = math.ceil(self.n / self.cluster_n)
        return math.ceil(per_cta / row_chunk)

    @property
    def cols_per_cta(self) -> int:
        return self.vecs_per_thread * self.threads_per_row * self.vec

    @property
    def tiler(self) -> tuple[int, int]:
        """(rows, cols) of the tile one CTA owns."""
        return (self.rows_per_cta, self.cols_per_cta)

    @property
    def warps_per_row(self) -> int:
        return max(1, self.threads_per_row // 32)

    @property
    def covers_n_exactly(self) -> bool:
        """True when no column predicate is needed."""
        return self.cols_per_cta * self.cluster_n == self.n


# Register budgets of the row-wise kernels (values of a row per thread; they
# decide threads per row and cluster size through RowConfig.for_row).  A
# forward holds at most 64 values of x in registers; a longer row is split
# over a cluster and staged in shared memory (``stages_row``), where the
# budget bounds each CTA's share (32 KB of a 16-bit row, so 4 CTAs fit per
# SM).  A backward holds x or y, dy and an accumulator per value: 64 values
# spill there.
FORWARD_VALUES_PER_THREAD = 64
BACKWARD_VALUES_PER_THREAD = 32


def forward_config(n: int, vec: int) -> RowConfig:
    """Launch settings of a row-wise forward kernel."""
    return RowConfig.for_row(n, vec, max_values=FORWARD_VALUES_PER_THREAD)


def backward_config(n: int, vec: int) -> RowConfig:
    """Launch settings of a row-wise backward kernel (one reduction per row)."""
    return RowConfig.for_row(n, vec, max_values=BACKWARD_VALUES_PER_THREAD)


def check_eps(eps) -> float:
    """A norm's eps as its kernels take it (an fp32 launch argument): a real
    number, finite and >= 0 (0 allowed, as torch does).  TypeError for
    anything else (a string, None, a bool, a tensor), ValueError for NaN,
    inf or a negative number."""
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real):
        raise TypeError(f"eps must be a real number, got {type(eps).__name__} {eps!r}")
    value = float(eps)
    if not 0.0 <= value < math.inf:
        raise ValueError(f"eps must be finite and >= 0, got {eps!r}")
    return value
