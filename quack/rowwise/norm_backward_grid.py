"""The launch plan of the norm backward (``quack/rowwise/norm_backward.py``), on the
host and without the CuTe DSL: its tile pipeline and where the weight slice
lives (shared memory, registers or L2), the CTAs that fit an SM, and the
persistent grid a call launches; ``run_norm_backward`` launches it."""

from __future__ import annotations

from quack.calls import occupancy
from quack.calls.launches import Launch, Output
from quack.rowwise import partial_sums
from quack.rowwise.config import RowConfig, backward_config

# Where the backward keeps its weight slice, the same for every row tile:
# staged in shared memory, held in registers (16-bit weights: 16 registers at
# 32 values per thread), or read from L2 per vector (slowest: each read is a
# round trip in the middle of a pass).
SMEM, REGISTERS, L2 = "smem", "registers", "l2"
# Bytes of weight a thread may hold in registers.
REGISTER_WEIGHT_BYTES = 64
# Shared memory one CTA may use (bytes): the H200's 227 KB less the reduction
# buffers and mbarriers.
SMEM_BUDGET = 220 * 1024
# Threads of this kernel on one SM: registers are capped at 128 per thread.
THREADS_PER_SM = 512


def _staged_bytes(cfg: RowConfig, stages: int, row_bytes: int, weight_bytes: int, inputs: int) -> int:
    """Shared memory of ``stages`` tiles of ``inputs`` (M, N) tensors of
    ``row_bytes`` per element, plus a staged weight slice (``weight_bytes``
    per element, 0 for none)."""
    return cfg.rows_per_cta * cfg.cols_per_cta * (stages * inputs * row_bytes + weight_bytes)


def pipeline_plan(cfg: RowConfig, row_bytes: int, weight_bytes: int, inputs: int) -> tuple[int, str]:
    """(stages of the tile pipeline, where the weight slice lives): the first
    of these that fits the shared memory: two stages with the weight staged,
    then held in registers (16-bit weights, ``REGISTER_WEIGHT_BYTES``: with
    dh_out at large N, two stages and the weight in registers beat one stage);
    one stage (unpipelined) with the weight staged, then read from L2.
    Measured and not kept: a third stage with the weight in registers where
    two leave one CTA per SM (slower: occupancy matters more there)."""
    in_registers = cfg.vecs_per_thread * cfg.vec * weight_bytes <= REGISTER_WEIGHT_BYTES
    for stages, place in ((2, SMEM), (2, REGISTERS), (1, SMEM), (1, L2)):
        if place == REGISTERS and not in_registers:
            continue
        if _staged_bytes(cfg, stages, row_bytes, weight_bytes if place == SMEM else 0, inputs) <= SMEM_BUDGET:
            return stages, place
    raise ValueError(f"a row slice of {cfg.cols_per_cta} columns does not fit the shared memory")


def ctas_per_sm(cfg: RowConfig, row_bytes: int, weight_bytes: int, inputs: int) -> int:
    """CTAs of the backward that fit on one SM: registers are capped at 128 per
    thread (``THREADS_PER_SM``), and the staged tiles (``pipeline_plan``)
    must fit the shared memory.  The host sizes the persistent grid with it,
    the kernel asks for it at launch: the two must agree."""
    stages, place = pipeline_plan(cfg, row_bytes, weight_bytes, inputs)
    smem = _staged_bytes(cfg, stages, row_bytes, weight_bytes if place == SMEM else 0, inputs)
    return max(1, min(THREADS_PER_SM // cfg.threads, SMEM_BUDGET // smem))


def grid_clusters(cfg: RowConfig, m: int, device_index: int, row_bytes: int, weight_bytes: int, has_dh_out: bool) -> int:
    """Clusters of the persistent grid: as many as run on the GPU at once
    (``ctas_per_sm``, and whole clusters per GPC: ``quack/calls/occupancy.py``), and
    no more than there are row tiles."""
    per_sm = ctas_per_sm(cfg, row_bytes, weight_bytes, 3 if has_dh_out else 2)
    resident = occupancy.resident_clusters(device_index, cfg.threads, cfg.cluster_n, per_sm)
    return max(1, min(-(-m // cfg.rows_per_cta), resident))


# The shared norm backward's arguments (its __call__) that are (M, N) rows
# (the partial-sum buffers are made (rows, N) here), those it realigns, and dx.
NORM_BACKWARD = Launch(
    "quack.rowwise.norm_backward:NormBackward", rows=frozenset({"x", "dy", "dh_out", "dx"}),
    aligned=frozenset({"x", "weight", "dy", "dh_out"}), outputs=(("dx", Output("x")),),
)


def run_norm_backward(kernel, dw, db, **values) -> None:
    """The persistent norm backward on a call's tensors (``values``, by the
    kernel's parameter names; RMSNorm has no ``mean``, LayerNorm no
    ``dh_out``; ``kernel``: the plan's backward), then the sums of its per-CTA
    partial rows into dw and db (given exactly when the kernel writes them).
    The grid and the partial buffers are sized here, on the real tensors,
    never while torch.compile traces (where N and M may be symbolic)."""
    x, weight = values["x"], values.get("weight")
    n = x.shape[-1]
    m = x.numel() // n
    cfg = backward_config(n, kernel.arg("vec"))
    num_ctas = grid_clusters(
        cfg, m, x.device.index or 0, x.element_size(),
        0 if weight is None else weight.element_size(), values.get("dh_out") is not None,
    )
    gradients = [g for g in (dw, db) if g is not None]
    if not gradients:
        kernel.run(**values, dw_partial=None, db_partial=None, num_ctas=num_ctas)
        return
    partials = partial_sums.partial_rows(num_ctas * cfg.rows_per_cta, n, len(gradients), x.device, m)
    views = iter(partial_sums.gradient_rows(partials, n))
    dw_partial = next(views) if dw is not None else None
    db_partial = next(views) if db is not None else None
    kernel.run(**values, dw_partial=dw_partial, db_partial=db_partial, num_ctas=num_ctas)
    partial_sums.sum_partial_rows(partials, gradients)
