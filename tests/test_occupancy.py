"""Sizing persistent grids by the clusters that run at once (quack/occupancy.py)."""

from __future__ import annotations

import pytest
import torch

from quack import occupancy
from quack import torch_interop as ti


def test_without_a_gpu_the_sm_count_estimates(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(ti, "sm_count", lambda device_index: 132)
    assert occupancy.resident_clusters(0, 512, 16, 1) == 8
    assert occupancy.resident_clusters(0, 256, 8, 2) == 33
    assert occupancy.resident_clusters(0, 128, 1, 4) == 528
    # A cluster larger than the SMs' slots still gets a grid of one.
    assert occupancy.resident_clusters(0, 1024, 16, 1) >= 1


@pytest.mark.gpu
@pytest.mark.no_compile_only
@pytest.mark.filterwarnings("error")  # a failed driver query falls back with a warning
@pytest.mark.parametrize("cluster_size, ctas_per_sm", [(2, 1), (2, 2), (4, 2), (8, 1), (8, 2), (16, 1)])
def test_driver_answer_is_bounded_by_the_sm_slots(cluster_size, ctas_per_sm):
    slots = ti.sm_count(0) * ctas_per_sm
    resident = occupancy.resident_clusters(0, 256, cluster_size, ctas_per_sm)
    assert 1 <= resident <= slots // cluster_size
    # Twice the CTAs per SM hold at least as many clusters.
    assert occupancy.resident_clusters(0, 256, cluster_size, 2 * ctas_per_sm) >= resident


@pytest.mark.gpu
@pytest.mark.no_compile_only
def test_single_cta_clusters_fill_every_sm():
    assert occupancy.resident_clusters(0, 128, 1, 4) == ti.sm_count(0) * 4
