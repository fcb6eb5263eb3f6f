"""Every op on a second GPU: alone with cuda:0 current, interleaved with cuda:0,
from two threads (one per device), and on non-default streams.

Skipped (with the reason) where fewer than two GPUs are visible, including
under ``--compile-only``: the calls use the production manifest's shapes,
which the artifact already holds.  Each kernel must be loaded at most once
per device (``KernelHandle``'s per-device modules).
"""

import threading

import pytest
import torch

import quack
from quack.cache import jit

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs"),
]

N = 4096
BF16 = torch.bfloat16


def _inputs(device):
    torch.manual_seed(0)
    x = torch.randn(64, N, device=device, dtype=BF16, requires_grad=True)
    w = torch.nn.Parameter(1 + 0.5 * torch.randn(N, device=device, dtype=BF16))
    b = torch.nn.Parameter(0.5 * torch.randn(N, device=device, dtype=BF16))
    target = torch.randint(0, N, (64,), device=device)
    return x, w, b, target


def _every_op(device):
    """Forward and backward of each op on ``device``; returns their results (on that device)."""
    x, w, b, target = _inputs(device)
    outs = [quack.rmsnorm(x, w), quack.layernorm(x, w, b), quack.softmax(x), quack.cross_entropy(x, target)]
    loss = sum(o.float().sum() for o in outs)
    loss.backward()
    a = torch.randn(256, N, device=device, dtype=BF16)
    c = quack.gemm(a, torch.randn(N, 512, device=device, dtype=BF16))
    return [o.detach() for o in outs] + [x.grad, w.grad, b.grad, c]


def _reference(device):
    x, w, b, target = _inputs(device)
    outs = [
        quack.rmsnorm_ref(x, w), quack.layernorm_ref(x, w, b), quack.softmax_ref(x),
        quack.cross_entropy_ref(x, target),
    ]
    loss = sum(o.float().sum() for o in outs)
    loss.backward()
    return [o.detach() for o in outs] + [x.grad, w.grad, b.grad]


def _check(results, device):
    for got in results:
        assert got.device == torch.device(device)
    ref = _reference(device)
    for got, want in zip(results[: len(ref)], ref):
        torch.testing.assert_close(got.float(), want.float(), atol=5e-2, rtol=5e-2)


def _loads_per_device():
    """(keyhash, device) of every module loaded so far, with repeats."""
    loaded = []
    for handle in jit._MEMORY.values():
        if handle.device is not None:
            loaded.append((handle.keyhash, handle.device))
        loaded += [(handle.keyhash, d) for d in handle._per_device]
    return loaded


def test_second_gpu_alone_with_the_first_current():
    torch.cuda.set_device(0)
    results = _every_op("cuda:1")
    torch.cuda.synchronize(1)
    assert torch.cuda.current_device() == 0
    _check(results, "cuda:1")


def test_interleaved_on_both_gpus():
    torch.cuda.set_device(0)
    for _ in range(2):
        for device in ("cuda:0", "cuda:1"):
            _check(_every_op(device), device)
    loaded = _loads_per_device()
    assert len(loaded) == len(set(loaded)), "a kernel was loaded twice on one device"
    assert {d for _, d in loaded} == {0, 1}


def test_two_threads_one_device_each_on_side_streams():
    errors = []

    def drive(index):
        try:
            torch.cuda.set_device(index)
            stream = torch.cuda.Stream(index)
            with torch.cuda.stream(stream):
                results = _every_op(f"cuda:{index}")
            stream.synchronize()
            _check(results, f"cuda:{index}")
        except BaseException as e:  # reported below, in the test's thread
            errors.append((index, e))

    threads = [threading.Thread(target=drive, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
