"""Errors raised inside compile-only mode reach the caller as a bounded,
clear message, however long torch's is (no GPU needed)."""

import pytest
import torch

from quack.compile_only import _NO_CUDA_GUARD, compile_only_mode
from quack.compile_only.gpu import CUDA_BUILD


def _many_frames(count: int):
    """A function calling ``count`` distinct functions: torch lists each frame it skipped."""
    namespace = {}
    exec("\n".join(f"def f{i}(x): return x" for i in range(count)), namespace)
    functions = [namespace[f"f{i}"] for i in range(count)]

    def run(x):
        for f in functions:
            f(x)
        return x * 2

    return run


@pytest.mark.skipif(CUDA_BUILD, reason="a CUDA build of torch traces inside compile-only mode")
def test_torch_compile_fullgraph_inside_compile_only_fails_briefly():
    compiled = torch.compile(_many_frames(3000), fullgraph=True)
    with pytest.raises(RuntimeError) as e:
        with compile_only_mode():
            compiled(torch.empty(4, device="cuda"))
    message = str(e.value)
    assert message.startswith("torch.compile(fullgraph=True) cannot trace inside compile-only mode")
    assert "torch.compile with fullgraph=True found no compiled frames" in message
    assert message.count("\n") < 20 and len(message) < 6000 and "more lines" in message
    assert e.value.__cause__ is None and e.value.__suppress_context__  # not the 3000 lines again


def test_torch_compile_without_fullgraph_runs_inside_compile_only():
    compiled = torch.compile(_many_frames(3))
    with compile_only_mode():
        assert compiled(torch.empty(4, device="cuda")).shape == (4,)


@pytest.mark.skipif(not CUDA_BUILD, reason="Dynamo traces inside compile-only mode on a CUDA build of torch")
def test_torch_compile_fullgraph_traces_inside_compile_only():
    compiled = torch.compile(_many_frames(3), fullgraph=True)
    with compile_only_mode():
        assert compiled(torch.empty(4, device="cuda")).shape == (4,)


def test_the_hint_for_a_cpu_only_torch_keeps_torch_message_short():
    with pytest.raises(RuntimeError) as e:
        with compile_only_mode():
            raise RuntimeError(_NO_CUDA_GUARD + "".join(f"\n  frame {i}" for i in range(10000)))
    message = str(e.value)
    assert message.startswith(_NO_CUDA_GUARD) and "create tensors on the CUDA device directly" in message
    assert message.count("\n") < 20 and "more lines" in message
