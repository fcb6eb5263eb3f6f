"""Sizing persistent grids by the clusters that run at once (quack/calls/occupancy.py)."""

from __future__ import annotations

import pytest
import torch

from quack.calls import occupancy
from quack.calls import torch_interop as ti


def test_without_a_gpu_the_sm_count_estimates(monkeypatch):
    monkeypatch.setattr(occupancy, "_gpu_visible", lambda: False)
    monkeypatch.setattr(ti, "sm_count", lambda device_index: 132)
    assert occupancy.resident_clusters(0, 512, 16, 1) == 8
    assert occupancy.resident_clusters(0, 256, 8, 2) == 33
    assert occupancy.resident_clusters(0, 128, 1, 4) == 528
    # A cluster larger than the SMs' slots still gets a grid of one.
    monkeypatch.setattr(ti, "sm_count", lambda device_index: 8)
    assert occupancy.resident_clusters(0, 1024, 16, 1) == 1


def test_torch_compile_takes_the_answer_as_a_constant(monkeypatch):
    # A caller asking from code that torch.compile(fullgraph=True) traces,
    # such as an autograd backward: Dynamo cannot trace the driver's bindings
    # (a cython object stands in for the query here).
    from cuda.bindings import driver

    def untraceable_answer(*args):
        config = driver.CUlaunchConfig()
        config.gridDimX = 3
        return config.gridDimX

    monkeypatch.setattr(occupancy, "_gpu_visible", lambda: True)
    monkeypatch.setattr(ti, "sm_count", lambda device_index: 132)
    monkeypatch.setattr(occupancy, "_answer", untraceable_answer)

    class TimesClusters(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            return grad * occupancy.resident_clusters(0, 256, 8, 2)

    x = torch.randn(4, requires_grad=True)
    fn = torch.compile(lambda a: TimesClusters.apply(a) * 2, backend="aot_eager", fullgraph=True)
    fn(x).sum().backward()
    assert torch.equal(x.grad, torch.full((4,), 6.0))


def test_the_constant_mark_is_torchs():
    # occupancy marks resident_clusters as Dynamo's decorator would, without
    # importing Dynamo; a torch whose decorator marks otherwise fails here.
    def ours():
        pass

    def torchs():
        pass

    occupancy._constant_while_traced(ours)
    torch.compiler.assume_constant_result(torchs)
    assert vars(ours) == vars(torchs) == {"_dynamo_marked_constant": True}


@pytest.mark.gpu
@pytest.mark.no_compile_only
@pytest.mark.parametrize("cluster_size, ctas_per_sm", [(2, 1), (2, 2), (4, 2), (8, 1), (8, 2), (16, 1)])
def test_driver_answer_is_bounded_by_the_sm_slots(cluster_size, ctas_per_sm):
    # The query itself, not resident_clusters, which would fall back to the
    # estimate (within these bounds too) if the query failed.
    slots = ti.sm_count(0) * ctas_per_sm
    resident = occupancy._query(0, 256, cluster_size, ctas_per_sm)
    assert 1 <= resident <= slots // cluster_size
    # Twice the CTAs per SM hold at least as many clusters.
    assert occupancy._query(0, 256, cluster_size, 2 * ctas_per_sm) >= resident
