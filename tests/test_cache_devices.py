"""Per-device bookkeeping of kernel handles, on the CPU (the two-GPU run is issue 21's)."""

import contextlib

import pytest
import torch

from quack.cache.handle import KernelHandle


class _Tensor:
    """Stands in for a CUDA tensor: only its device is asked."""

    is_cuda = True

    def __init__(self, device):
        self.device = device

    def get_device(self):
        return self.device


@pytest.fixture
def gpus(monkeypatch):
    """Two fake GPUs: the current device, and a log of (launch, current device)."""
    state = {"current": 0}
    log = []

    @contextlib.contextmanager
    def device(index):
        before, state["current"] = state["current"], index
        try:
            yield
        finally:
            state["current"] = before

    monkeypatch.setattr(torch.cuda, "current_device", lambda: state["current"])
    monkeypatch.setattr(torch.cuda, "device", device)
    return state, log


def _handle(name, log, state):
    return KernelHandle(lambda *args: log.append((name, state["current"])), "k")


def test_each_device_gets_its_own_module_loaded_with_that_device_current(gpus):
    state, log = gpus
    loads = []
    handle = _handle("first", log, state)

    def reload():
        loads.append(state["current"])
        return _handle(f"reloaded-{state['current']}", log, state)

    handle.reload = reload
    handle(_Tensor(1), 5)  # the current device is 0: guarded to 1
    handle(_Tensor(0))
    handle(_Tensor(0))
    handle(_Tensor(1))
    assert log == [("first", 1), ("reloaded-0", 0), ("reloaded-0", 0), ("first", 1)]
    assert loads == [0]  # loaded once for cuda:0, with cuda:0 current
    assert state["current"] == 0  # the caller's device is restored


def test_a_handle_that_cannot_reload_refuses_another_device(gpus):
    state, log = gpus
    handle = _handle("first", log, state)
    handle(_Tensor(0))
    with pytest.raises(RuntimeError, match="loaded on cuda:0 and cannot be loaded again for cuda:1"):
        handle(_Tensor(1))


def test_launches_without_cuda_tensors_are_not_guarded(gpus):
    state, log = gpus
    handle = _handle("first", log, state)
    handle(3, "x")
    assert log == [("first", 0)] and handle.device is None
