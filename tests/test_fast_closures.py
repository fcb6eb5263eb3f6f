"""The row-wise ops' launch closures (``fastpath.like_launch``) on the CPU:
each passes its direct launcher the arguments the kernel's ``__call__``
declares (x, weight, residual or bias, outputs, eps), in that order, viewing
the rows arguments as rows, and returns what the op returns.  A recording launcher stands in for the C launcher (the GPU
tests launch the real one)."""

import importlib

import pytest
import torch

from quack.calls import fastpath
from quack.calls import torch_interop as ti

# The modules (``quack.softmax`` and the like name the ops themselves).
softmax, rmsnorm, layernorm = (importlib.import_module(f"quack.families.{name}.op") for name in ("softmax", "rmsnorm", "layernorm"))

pytest.importorskip("quack.launch._fastlaunch")


@pytest.fixture
def recorded(monkeypatch):
    """The closures get a launcher that records its arguments."""
    calls = []
    def direct(plan, role, device, rows=None, per_stream=frozenset()):
        rows = fastpath.row_positions(plan, role) if rows is None else rows
        return lambda *a: calls.append((rows, a))

    monkeypatch.setattr(fastpath, "direct", direct)
    return calls


def test_softmax_closure(recorded):
    x = torch.randn(4, 8)
    plan = softmax.plan_for(softmax.SoftmaxCall("float32", 8, 4, False))
    y = softmax._inference_closure(plan, x.device)(x)
    assert recorded == [({0, 1}, (x, y, None))] and y.shape == x.shape and y.data_ptr() != x.data_ptr()


@pytest.mark.parametrize("with_residual", [False, True])
def test_rmsnorm_closure(recorded, with_residual):
    x, w = torch.randn(4, 8), torch.randn(8)
    residual = torch.randn(4, 8) if with_residual else None
    plan = rmsnorm.plan_for(rmsnorm.RMSNormCall("float32", "float32", with_residual, 8, 4, False))
    result = rmsnorm._inference_closure(plan, x.device, with_residual)(x, w, residual, 1e-6)
    rows = {0, 2, 3, 4}  # x, residual and both outputs
    if with_residual:
        y, h = result
        assert recorded == [(rows, (x, w, residual, y, h, None, 1e-6, None))] and y.data_ptr() != h.data_ptr()
    else:
        assert recorded == [(rows, (x, w, None, result, None, None, 1e-6, None))]


def test_layernorm_closure(recorded):
    x, w, b = torch.randn(4, 8), torch.randn(8), torch.randn(8)
    plan = layernorm.plan_for(layernorm.LayerNormCall("float32", "float32", "float32", 8, 4, False))
    y = layernorm._inference_closure(plan, x.device)(x, w, b, 1e-5)
    assert recorded == [({0, 3}, (x, w, b, y, None, None, 1e-5, None))]


def test_cross_entropy_closure(monkeypatch):
    """The reducing forward's scratch (row losses, counter) goes to the
    launcher as dicts by stream; a stream without scratch yet is declined,
    and the closure adds the stream's and launches again.  Under a capture
    the launcher declines the dicts (as the C launcher does), and the
    closure launches with scratch of the capture's own."""
    cross_entropy = importlib.import_module("quack.families.cross_entropy.op")
    counter, rows = torch.zeros(1, dtype=torch.int32), torch.empty(4)
    calls, directs = [], []

    def direct(plan, role, device, rows=None, per_stream=frozenset()):
        directs.append((rows, per_stream))

        def launch(*a):
            calls.append(a)
            if len(calls) == 1 or (capturing[0] and isinstance(a[2], dict)):  # no scratch yet; a capture
                return NotImplemented
            return None
        return launch

    capturing = [False]
    own_counter, own_rows = torch.zeros(1, dtype=torch.int32), torch.empty(4)
    monkeypatch.setattr(fastpath, "direct", direct)
    monkeypatch.setattr(cross_entropy, "reduction_scratch",
                        lambda device, m: (own_counter, own_rows) if capturing[0] else (counter, rows))
    monkeypatch.setattr(ti, "current_stream", lambda device: 5)
    monkeypatch.setattr(ti, "capturing", lambda device: capturing[0])
    logits, target = torch.randn(4, 8), torch.zeros(4, dtype=torch.int64)
    plan = cross_entropy.plan_for(cross_entropy.CrossEntropyCall("float32", "int64", 8, 4, "mean", False))
    run = cross_entropy._inference_closure(plan, logits, target)
    loss = run(logits, target, -100, 0)
    assert directs == [(None, frozenset({2, 6}))]  # (rows: those the launch names)
    assert loss.shape == () and len(calls) == 2
    assert calls[1] == (logits, target, {5: rows}, None, loss, None, {5: counter}, -100, None)
    run(logits, target, -100, 0)
    assert len(calls) == 3 and calls[2][2] == {5: rows}  # kept: one launch
    capturing[0] = True  # a capture never launches with the kept scratch: it gets its own
    run(logits, target, -100, 0)
    assert len(calls) == 5 and calls[4][2] is own_rows and calls[4][6] is own_counter
    capturing[0] = False  # the stream's eager calls keep theirs
    run(logits, target, -100, 0)
    assert len(calls) == 6 and calls[5][2] is calls[1][2] and calls[5][2][5] is rows and calls[5][6][5] is counter


def test_cross_entropy_scratch_grows_per_stream_and_keeps_views_valid(monkeypatch):
    """A stream's row-loss buffer grows for a larger M (doubling) and never
    shrinks: a smaller M gets a view of it, so a closure's kept view stays
    valid; another stream gets its own; a capture gets fresh scratch."""
    cross_entropy = importlib.import_module("quack.families.cross_entropy.op")
    stream, capturing = [1], [False]
    monkeypatch.setattr(cross_entropy, "_SCRATCH", {})
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: stream[0], raising=False)
    monkeypatch.setattr(ti, "capturing", lambda device: capturing[0])
    device = torch.device("cpu", 0)
    counter, small = cross_entropy.reduction_scratch(device, 8)
    assert small.shape == (8,) and counter.shape == (1,) and not counter.any()
    _, large = cross_entropy.reduction_scratch(device, 12)
    assert large.shape == (12,) and cross_entropy._SCRATCH[(0, 1)][1].shape == (16,)
    again_counter, smaller = cross_entropy.reduction_scratch(device, 4)
    assert again_counter is counter and smaller.data_ptr() == large.data_ptr()  # a view: no reallocation
    stream[0] = 2
    other_counter, other = cross_entropy.reduction_scratch(device, 4)
    assert other_counter is not counter and other.data_ptr() != large.data_ptr()
    capturing[0] = True
    own_counter, own = cross_entropy.reduction_scratch(device, 4)
    assert own_counter is not other_counter and own.data_ptr() != other.data_ptr()
