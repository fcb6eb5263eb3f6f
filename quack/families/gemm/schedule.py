"""Work order of the persistent GEMM: which output tile a cluster computes next.

Each cluster walks work items ``w = cluster_id, cluster_id + num_clusters, ...``.
Items are numbered group by group (one group for a dense GEMM); group ``g``
owns ``ceil(rows_g / cluster_rows) * n_clusters`` items, empty groups none.
Inside a group, items run along bands of ``band`` cluster columns (N fastest
within a band, then down M), so that the clusters in flight cover a roughly
square patch of the output and share A row blocks and B column blocks in L2.

A ``GroupCursor`` says where a walk stands: the group the last item fell in.

The producer warp and the consumer warpgroups each run their own copy of this
walk; it is deterministic, so they agree without exchanging messages.
"""

from __future__ import annotations

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Int32


class GroupCursor(NamedTuple):
    """A group of the walk (``num_groups`` once the groups ran out) and where
    it starts: its first work item, its first row and row count, and its
    number of M clusters.  A NamedTuple, so the DSL carries it through a
    dynamic loop like the plain values it holds."""

    group: Int32
    first_item: Int32
    row_start: Int32
    rows: Int32
    m_clusters: Int32


def group_rows(cu_seqlens, group, num_groups, total_rows):
    """(first row, row count) of ``group``: all rows for a dense GEMM
    (``cu_seqlens`` None); (cu[G], 0) past the last group, so the walk can step
    one past the end without reading out of bounds.

    Bounds are clamped into [0, total_rows] and made non-decreasing, so a
    malformed ``cu_seqlens`` (negative, decreasing, past A's end) can give
    wrong rows but never an access outside A and D, nor a negative count."""
    if cutlass.const_expr(cu_seqlens is None):
        return Int32(0), total_rows
    start = _clamp(cu_seqlens[cutlass.min(group, num_groups)], Int32(0), total_rows)
    end = _clamp(cu_seqlens[cutlass.min(group + 1, num_groups)], start, total_rows)
    return start, end - start


def _clamp(value, low, high):
    return cutlass.min(cutlass.max(value, low), high)


def first_cursor(cu_seqlens, num_groups, total_rows, cluster_rows: int):
    """The cursor at group 0."""
    row_start, rows = group_rows(cu_seqlens, Int32(0), num_groups, total_rows)
    return GroupCursor(Int32(0), Int32(0), row_start, rows, (rows + (cluster_rows - 1)) // cluster_rows)


@cute.jit
def find_group(cu_seqlens, num_groups: Int32, total_rows: Int32, item: Int32, cursor: GroupCursor,
               cluster_rows: cutlass.Constexpr, n_clusters: Int32) -> GroupCursor:
    """Advance a group cursor until ``item`` lies in its group or the groups run
    out (then its group is ``num_groups``).  Items only grow, so each walk is
    linear in the number of groups overall."""
    group, first_item, m_clusters = cursor.group, cursor.first_item, cursor.m_clusters
    row_start, rows = cursor.row_start, cursor.rows
    items = m_clusters * n_clusters
    if cutlass.const_expr(cu_seqlens is None):
        if item >= items:
            group = num_groups
    else:
        while (item >= first_item + items) & (group < num_groups):
            first_item = first_item + items
            group = group + 1
            row_start, rows = group_rows(cu_seqlens, group, num_groups, total_rows)
            m_clusters = (rows + (cluster_rows - 1)) // cluster_rows
            items = m_clusters * n_clusters
    return GroupCursor(group, first_item, row_start, rows, m_clusters)


def tile_in_group(local_item, m_clusters, n_clusters, band: int):
    """(M cluster, N cluster) of the ``local_item``-th item of a group: bands of
    ``band`` N clusters, N fastest inside a band (the last band may be narrower)."""
    band_items = m_clusters * band
    band_index = local_item // band_items
    rest = local_item - band_index * band_items
    width = cutlass.min(Int32(band), n_clusters - band_index * band)
    return rest // width, band_index * band + rest % width
