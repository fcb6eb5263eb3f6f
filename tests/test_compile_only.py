"""compile_only_mode, the live read-only quack.cache.COMPILE_ONLY, and scalar sentinels."""

import asyncio
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from copy import deepcopy

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor

import quack.cache
from quack.cache.mode import _COMPILE_ONLY_DEPTH
from quack.compile_only import CompileOnlyFakeTensorMode, compile_only_mode, hinted_message, is_compile_only


def test_compile_only_is_live():
    assert quack.cache.COMPILE_ONLY is False and not is_compile_only()
    with compile_only_mode():
        assert quack.cache.COMPILE_ONLY is True and is_compile_only()
    assert quack.cache.COMPILE_ONLY is False


def test_compile_only_cannot_be_assigned_or_deleted():
    with pytest.raises(AttributeError, match="read-only"):
        quack.cache.COMPILE_ONLY = True
    with pytest.raises(AttributeError):
        del quack.cache.COMPILE_ONLY
    assert quack.cache.COMPILE_ONLY is False
    quack.cache.some_other_name = 1  # other attributes stay assignable
    del quack.cache.some_other_name


def test_nesting_restores_exact_depth():
    with compile_only_mode():
        assert _COMPILE_ONLY_DEPTH.get() == 1
        with compile_only_mode():
            assert _COMPILE_ONLY_DEPTH.get() == 2
        assert _COMPILE_ONLY_DEPTH.get() == 1 and is_compile_only()
    assert _COMPILE_ONLY_DEPTH.get() == 0


def test_exception_restores_prior_depth_and_real_tensors():
    token = _COMPILE_ONLY_DEPTH.set(3)  # a manual outer push
    try:
        with pytest.raises(ValueError):
            with compile_only_mode():
                with compile_only_mode():
                    assert _COMPILE_ONLY_DEPTH.get() == 5
                    raise ValueError
        assert _COMPILE_ONLY_DEPTH.get() == 3
    finally:
        _COMPILE_ONLY_DEPTH.reset(token)
    assert not is_compile_only()
    assert not isinstance(torch.ones(2), FakeTensor)


def test_depth_is_per_thread():
    seen = {}

    def other():
        seen["before"] = is_compile_only()
        with compile_only_mode():
            seen["inside"] = is_compile_only()
        seen["after"] = is_compile_only()

    thread = threading.Thread(target=other)
    with compile_only_mode():
        thread.start()  # made outside the block, started inside: it runs in the mode
        thread.join()
        assert is_compile_only()
    assert seen == {"before": True, "inside": True, "after": True}
    assert not is_compile_only()
    outside = threading.Thread(target=other)
    outside.start()
    outside.join()
    assert seen == {"before": False, "inside": True, "after": False}


def test_threads_started_inside_share_the_mode_and_its_tensors():
    with compile_only_mode() as mode:
        x = torch.randn(8, 16, device="cuda")

        def work(i):
            assert is_compile_only()
            y = torch.randn(8, 16, device="cuda") * i + x  # its own tensors beside the test's
            return isinstance(y, FakeTensor) and y.fake_mode is mode.fake_mode

        with ThreadPoolExecutor(4) as pool:
            assert list(pool.map(work, range(16))) == [True] * 16
        assert (x + 1).shape == (8, 16)
    assert not is_compile_only()
    assert not isinstance(torch.ones(2), FakeTensor)


def test_a_pool_runs_in_the_mode_only_what_the_block_submits():
    pool = ThreadPoolExecutor(2)  # started before the block, outliving it
    made_on = lambda: type(torch.ones(2, device="cuda" if is_compile_only() else "cpu"))  # noqa: E731
    try:
        assert pool.submit(made_on).result() is torch.Tensor
        with compile_only_mode():
            assert pool.submit(made_on).result() is FakeTensor
        assert pool.submit(made_on).result() is torch.Tensor
        assert pool.submit(is_compile_only).result() is False
    finally:
        pool.shutdown()


def test_threads_converting_at_once_each_get_their_own_tensor():
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # thread switches in the middle of each conversion
    wrong = []
    try:
        with compile_only_mode():
            def work(i):
                for j in range(100):
                    n = 1 + (i * 100 + j) % 97
                    t = torch.tensor(list(range(n)), device="cuda")
                    if t.shape != (n,):
                        wrong.append((n, tuple(t.shape)))

            with ThreadPoolExecutor(8) as pool:
                list(pool.map(work, range(8)))
    finally:
        sys.setswitchinterval(interval)
    assert not wrong


@pytest.mark.skipif(not torch.backends.cuda.is_built(), reason="copying a fake CUDA tensor needs a CUDA build of torch")
def test_a_deep_copy_made_in_the_mode_mixes_with_the_original():
    with compile_only_mode():
        model = torch.nn.Linear(4, 4, device="cuda")
        copy = deepcopy(model)
        assert copy.weight is not model.weight
        assert (copy(torch.ones(2, 4, device="cuda")) + model.weight.sum()).shape == (2, 4)


def test_threads_inside_the_mode_at_once_each_leave_it_cleanly():
    # Each thread enters and leaves the shared fake mode: its re-entry
    # bookkeeping is per thread, so exits in any order restore each its own.
    inside = threading.Barrier(3)
    leave_second = threading.Event()
    errors = []

    def work(first: bool):
        try:
            inside.wait(timeout=30)
            if not first:
                leave_second.wait(timeout=30)
            assert isinstance(torch.ones(2, device="cuda"), FakeTensor)
        except BaseException as e:  # reported below, with the assertion's message
            errors.append(e)
        finally:
            if first:
                leave_second.set()

    with compile_only_mode() as mode:
        threads = [threading.Thread(target=work, args=(first,)) for first in (True, False)]
        for t in threads:
            t.start()
        inside.wait(timeout=30)
        for t in threads:
            t.join(timeout=60)
        assert not errors, errors
        assert not mode.fake_mode.in_kernel_invocation and mode.fake_mode.enter_stack
    assert not mode.fake_mode.enter_stack
    assert not isinstance(torch.ones(2), FakeTensor)


def test_a_mode_entered_again_takes_the_tensors_made_in_it_before():
    with compile_only_mode() as mode:
        kept = torch.ones(4, device="cuda")
    with compile_only_mode(mode):
        assert (kept * 2 + torch.ones(4, device="cuda")).shape == (4,)
    with compile_only_mode():
        with pytest.raises(AssertionError, match="Mixing fake modes"):
            kept + torch.ones(4, device="cuda")


def test_errors_the_mode_cannot_avoid_get_a_hint():
    assert "no_compile_only" in hinted_message("RuntimeError: Found no NVIDIA driver on your system.")
    assert "CUDA build of torch" in hinted_message("PyTorch is not linked with support for cuda devices")
    long = "torch.compile with fullgraph=True found no compiled frames\n" + "frame\n" * 500
    assert hinted_message(long).count("\n") < 20
    assert hinted_message("a real bug") is None


def test_depth_is_per_asyncio_task():
    async def warming(entered, release):
        with compile_only_mode():
            entered.set()
            await release.wait()
            return is_compile_only()

    async def observing(entered, release):
        await entered.wait()
        seen = is_compile_only()  # another task: no tensors made here (see module docs)
        release.set()
        return seen

    async def main():
        entered, release = asyncio.Event(), asyncio.Event()
        return await asyncio.gather(warming(entered, release), observing(entered, release))

    assert asyncio.run(main()) == [True, False]


def test_scalar_reads_return_sentinels():
    with compile_only_mode():
        ints = torch.randint(0, 10, (4,), device="cuda")
        floats = torch.randn(4, device="cuda")
        assert isinstance(ints, FakeTensor) and ints.device.type == "cuda"
        assert ints.sum().item() == 1 and isinstance(ints.sum().item(), int)
        assert floats.mean().item() == 1.0 and isinstance(floats.mean().item(), float)
        assert ints.tolist() == [1, 1, 1, 1]
        # int()/float() on a *cuda* fake tensor needs a CUDA build of torch; use CPU ones.
        cpu = torch.ones(3)
        assert int(cpu.sum()) == 1 and float(cpu.sum()) == 1.0
        total_m = ints.sum().item()
        assert torch.empty(total_m * 2, 8, device="cuda").shape == (2, 8)
        assert (floats > 0).any().item() is False  # "is anything non-finite?" answers no
        assert torch.isfinite(floats).all().item() is True  # "is everything finite?" answers yes
        finite = torch.isfinite(torch.randn(4)).all()  # on the CPU: a CPU-only torch cannot view fake CUDA ones
        assert not ~finite and finite.view(1).squeeze().item() and not torch.isnan(torch.randn(4)).any()
        with torch.inference_mode():  # where aten.item reaches the modes undecomposed
            assert floats.max().item() == 1.0 and torch.ones(2, device="cuda").sum().item() == 1.0


def test_fake_mode_kwargs_pass_through():
    mode = CompileOnlyFakeTensorMode(allow_non_fake_inputs=True)
    assert mode.fake_mode.allow_non_fake_inputs
    real = torch.ones(3)
    with mode:
        assert (real + 1).shape == (3,)


@pytest.mark.skipif(torch.backends.cuda.is_built(), reason="a CUDA build of torch indexes fake CUDA tensors")
def test_a_cpu_only_torch_says_what_compile_only_cannot_do():
    # Indexing a fake CUDA tensor needs a CUDA device guard, which a CPU-only
    # torch lacks: the error says so and what to do instead.
    with pytest.raises(RuntimeError, match="create tensors on the CUDA device directly"):
        with compile_only_mode():
            torch.randn(8, 16, device="cuda")[:4]
    assert not is_compile_only()
    with compile_only_mode():
        assert torch.randn(8, 16, device="cuda").narrow(0, 0, 4).shape == (4, 16)  # the way that works
