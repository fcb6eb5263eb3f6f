"""Every op's allocating wrapper traces under torch.compile(fullgraph=True) with
symbolic sizes, on the CPU.

torch.compile makes a dimension symbolic when a compiled function meets a
second size (automatic dynamic shapes) or under ``dynamic=True``, and Dynamo
traces an autograd Function's backward together with its forward.  Host code
in a traced wrapper that needs N or M as a Python int (a kernel
configuration, a grid) then fails to trace: the norm backwards did (found on
the H200).  Fake CUDA tensors stand in for the GPU; the ops' fake
implementations run, nothing is launched.  The wrappers are traced directly,
without autograd, which CPU-only torch cannot record for CUDA tensors.
"""

import importlib

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

# The modules, not the package's same-named functions.
ce, ln, rms, sm = (importlib.import_module(f"quack.families.{name}.op") for name in ("cross_entropy", "layernorm", "rmsnorm", "softmax"))


def _stats(x):
    return torch.empty(x.shape[0], device=x.device, dtype=torch.float32)


WRAPPERS = {
    "layernorm_fwd": lambda x, w: ln.layernorm_fwd(x, w, w)[0],
    "layernorm_bwd": lambda x, w: ln.layernorm_bwd(x, w, x, _stats(x), _stats(x), True)[0],
    "rmsnorm_fwd": lambda x, w: rms.rmsnorm_fwd(x, w, x)[0],
    "rmsnorm_bwd": lambda x, w: rms.rmsnorm_bwd(x, w, x, _stats(x), eps=1e-6)[0],
    "rmsnorm_bwd_dh_out": lambda x, w: rms.rmsnorm_bwd(x, w, x, _stats(x), x, eps=1e-6)[0],
    "softmax_fwd": lambda x, w: sm.softmax_fwd(x),
    "softmax_bwd": lambda x, w: sm.softmax_bwd(x, x),
    "cross_entropy_fwd": lambda x, w: ce.cross_entropy_fwd(x, _stats(x).long())[0],
    "cross_entropy_bwd": lambda x, w: ce.cross_entropy_bwd(x, _stats(x).long(), _stats(x), _stats(x)),
}


@pytest.mark.parametrize("name", WRAPPERS)
def test_wrapper_traces_with_symbolic_sizes(name):
    compiled = torch.compile(WRAPPERS[name], backend="eager", fullgraph=True, dynamic=True)
    with FakeTensorMode():
        for m, n in ((37, 4096), (5, 16384)):
            x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(n, device="cuda", dtype=torch.bfloat16)
            assert compiled(x, w).shape[0] == m
