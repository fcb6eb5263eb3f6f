"""Per-device bookkeeping of kernel handles, on the CPU (test_two_gpus.py runs it on two GPUs)."""

import contextlib
import inspect

import pytest
import torch

from quack.launch.handle import KernelHandle


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


class _Checked:
    """FastLauncher's stand-in with a ``checked`` launcher: it launches on
    ``accepts`` only (a C launcher declines another device's tensors)."""

    def __init__(self, log, accepts):
        self.log, self.accepts = log, accepts
        self.checked = self.launch_checked

    def launch_checked(self, *args):
        if args[0].device != self.accepts:
            return NotImplemented
        self.log.append(("checked", args[0].device))
        return "launched"

    def __call__(self, *args):
        self.log.append(("guarded", args[0].device))


@pytest.mark.parametrize("front", ["C", "Python"])
def test_a_handle_calls_its_checked_launcher_first_after_its_first_launch(gpus, front):
    """The first launch is guarded and leaves the launcher's ``checked`` on
    the handle; later calls on that device take it (in C with the C front:
    no Python frame), and a call it declines is guarded again."""
    import quack.launch.handle as handle_module

    if front == "C":
        fastlaunch = pytest.importorskip("quack.launch._fastlaunch")
        assert issubclass(KernelHandle, fastlaunch.Front)
        cls = KernelHandle
    else:  # KernelHandle's methods over the Python front, as without the C module
        methods = {name: value for name, value in vars(KernelHandle).items() if inspect.isfunction(value)}
        cls = type("PythonFrontHandle", (handle_module._PythonFront,), {**methods, "__slots__": KernelHandle.__slots__})
    state, log = gpus
    fn = _Checked(log, accepts=0)
    handle = cls(fn, "k")
    assert handle.checked is None
    handle(_Tensor(0))
    assert handle.checked == fn.checked
    assert handle(_Tensor(0)) == "launched"
    handle.reload = lambda: cls(_Checked(log, accepts=1), "k")
    handle(_Tensor(1))  # declined by cuda:0's launcher: guarded, reloaded for cuda:1
    handle.checked = None
    handle(_Tensor(0))
    assert log == [("guarded", 0), ("checked", 0), ("guarded", 1), ("guarded", 0)]
