"""The RMSNorm / LayerNorm backward's shared-memory plan (CPU only).

A plan that overflows the SM's shared memory compiles fine and only fails at
launch on the GPU (found there: fp32 rows at N = 256K), so every (N, dtype,
weight, dh_out) combination the ops accept is checked here against the
H200's per-CTA limit, with the reduction buffers the kernel adds.
"""

from __future__ import annotations

import pytest

from quack.calls import occupancy
from quack.rowwise import config as rowwise
from quack.calls import torch_interop as ti
from quack.rowwise.norm_backward_grid import L2, REGISTERS, SMEM, SMEM_BUDGET, _staged_bytes, ctas_per_sm, grid_clusters, pipeline_plan

# Shared memory one CTA may allocate on sm_90 (227 KB).
SM90_MAX_SMEM_PER_CTA = 232448
LENGTHS = [1, 7, 100, 1000, 4096, 4097, 16384, 65536, 65537, 131072, 262143, 262144]


def _vec(n: int, row_bytes: int) -> int:
    return ti.widest_vector(n, row_bytes)


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("row_bytes", [2, 4])
@pytest.mark.parametrize("weight_bytes", [0, 2, 4])
@pytest.mark.parametrize("inputs", [2, 3])
def test_plan_fits_shared_memory(n, row_bytes, weight_bytes, inputs):
    cfg = rowwise.backward_config(n, _vec(n, row_bytes))
    stages, place = pipeline_plan(cfg, row_bytes, weight_bytes, inputs)
    staged = _staged_bytes(cfg, stages, row_bytes, weight_bytes if place == SMEM else 0, inputs)
    reduction = 4 * cfg.rows_per_cta * cfg.warps_per_row * cfg.cluster_n * 4  # c1, c2 x two sets, fp32
    assert staged <= SMEM_BUDGET
    assert staged + reduction + 64 <= SM90_MAX_SMEM_PER_CTA
    per_sm = ctas_per_sm(cfg, row_bytes, weight_bytes, inputs)
    assert per_sm * (staged + reduction) <= 228 * 1024 and per_sm * cfg.threads <= 2048


def test_long_fp32_rows_drop_to_one_stage_then_unstaged_weight():
    cfg = rowwise.backward_config(262144, 4)
    assert pipeline_plan(cfg, 4, 4, 2) == (1, SMEM)
    assert pipeline_plan(cfg, 4, 4, 3) == (1, L2)


def test_two_stages_keep_the_weight_in_registers_before_one_stage():
    assert pipeline_plan(rowwise.backward_config(65536, 8), 2, 2, 2) == (2, SMEM)
    cfg = rowwise.backward_config(262144, 8)
    assert pipeline_plan(cfg, 2, 2, 2) == (2, SMEM)
    # With dh_out two stages fit only without the staged weight.
    assert pipeline_plan(cfg, 2, 2, 3) == (2, REGISTERS)
    # An fp32 weight is too big for the registers: one stage, weight staged.
    assert pipeline_plan(cfg, 2, 4, 3) == (1, SMEM)


def test_grid_is_bounded_by_row_tiles_and_residency(monkeypatch):
    # The SM count's estimate: a GPU's own answer is tests/test_occupancy.py's.
    monkeypatch.setattr(occupancy, "_gpu_visible", lambda: False)
    monkeypatch.setattr(ti, "sm_count", lambda device_index: 132)
    cfg = rowwise.backward_config(65536, 8)
    assert grid_clusters(cfg, 3, 0, 2, 2, False) == 3
    resident = 132 * ctas_per_sm(cfg, 2, 2, 2) // cfg.cluster_n
    assert grid_clusters(cfg, 10**6, 0, 2, 2, False) == resident
    assert grid_clusters(cfg, 0, 0, 2, 2, False) == 1
