"""Request threads that hit new shapes at once: each thread's first eager call compiles its own
kernel (compiles are serialised across the process, launches are not) and every result is right.

On a GPU it runs for real in a private cache of its own (the shapes are new on purpose: nothing
in the Bazel-built artifact has them); under ``--compile-only`` each thread warms its kernels in
that cache."""

import contextlib
import threading

import pytest
import torch

import quack
from quack.compile_only import compile_only_mode, is_compile_only

pytestmark = pytest.mark.gpu

TOL = {"rtol": 1e-4, "atol": 1e-4}


def _rmsnorm(n):
    x = torch.randn(7, n, device="cuda")
    w = torch.randn(n, device="cuda")
    torch.testing.assert_close(quack.rmsnorm(x, w), torch.nn.functional.rms_norm(x, (n,), w, eps=1e-6), **TOL)


def _softmax(n):
    x = torch.randn(5, n, device="cuda")
    torch.testing.assert_close(quack.softmax(x), torch.softmax(x, -1), **TOL)


def _layernorm(n):
    x = torch.randn(3, n, device="cuda")
    w = torch.randn(n, device="cuda")
    torch.testing.assert_close(quack.layernorm(x, w), torch.nn.functional.layer_norm(x, (n,), w, eps=1e-6), **TOL)


def _cross_entropy(n):
    x = torch.randn(6, n, device="cuda")
    t = torch.randint(0, n, (6,), device="cuda")
    torch.testing.assert_close(quack.cross_entropy(x, t, reduction="none"),
                               torch.nn.functional.cross_entropy(x, t, reduction="none"), **TOL)


@pytest.fixture
def private_cache(tmp_path, monkeypatch):
    """A writable cache of this test's own, not strict: these shapes compile."""
    monkeypatch.setenv("QUACK_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("QUACK_CACHE_PATH", raising=False)
    monkeypatch.delenv("QUACK_CACHE_STRICT", raising=False)


@pytest.mark.parametrize("round_", range(3))
def test_four_threads_first_calls_at_new_shapes(private_cache, round_):
    warming = is_compile_only()  # threads do not inherit the mode: each enters its own
    n = 2056 + 8 * round_  # a new N every round, so every thread compiles
    errors = []

    def run(check):
        try:
            with compile_only_mode() if warming else contextlib.nullcontext():
                check(n)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(f"{check.__name__}: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=run, args=(f,)) for f in (_rmsnorm, _softmax, _layernorm, _cross_entropy)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not any(t.is_alive() for t in threads), "a thread is still running"
    assert not errors, errors
    if not warming:
        torch.cuda.synchronize()
