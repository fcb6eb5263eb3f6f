"""The persistent backwards' partial dw / db buffers (quack/calls/torch_interop.py):
allocated uninitialised when the kernel writes every row, summed into the
gradient in its dtype."""

import torch

from quack.calls import torch_interop as ti


def test_buffer_is_zeroed_only_when_no_kernel_writes_it(monkeypatch):
    zeroed = []
    real_zeros = torch.zeros
    monkeypatch.setattr(ti.torch, "zeros", lambda *a, **k: zeroed.append(a) or real_zeros(*a, **k))
    assert torch.count_nonzero(ti.partial_rows(4, 8, torch.device("cpu"), m=0)) == 0
    assert zeroed == [(4, 8)]
    assert ti.partial_rows(4, 8, torch.device("cpu"), m=3).shape == (4, 8)
    assert zeroed == [(4, 8)]  # left uninitialised: the kernel writes every row


def test_partial_rows_are_summed_into_the_gradient_dtype():
    partial = torch.arange(24, dtype=torch.float32).reshape(3, 8)
    for dtype in (torch.float32, torch.bfloat16):
        out = torch.full((8,), float("nan"), dtype=dtype)
        ti.sum_partial_rows(partial, out)
        torch.testing.assert_close(out, partial.sum(0).to(dtype))

