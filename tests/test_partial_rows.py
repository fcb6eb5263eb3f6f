"""The norm backward's partial dw / db rows (quack/rowwise/partial_sums.py):
one buffer for both gradients, allocated uninitialised when the kernel
writes every row, summed into each gradient in its dtype."""

import torch

from quack.rowwise import partial_sums


def test_buffer_is_zeroed_only_when_no_kernel_writes_it(monkeypatch):
    zeroed = []
    real_zeros = torch.zeros
    monkeypatch.setattr(partial_sums.torch, "zeros", lambda *a, **k: zeroed.append(a) or real_zeros(*a, **k))
    assert torch.count_nonzero(partial_sums.partial_rows(4, 8, 2, torch.device("cpu"), m=0)) == 0
    assert zeroed == [(4, 16)]
    assert partial_sums.partial_rows(4, 8, 1, torch.device("cpu"), m=3).shape == (4, 8)
    assert zeroed == [(4, 16)]  # left uninitialised: the kernel writes every row


def test_each_gradient_has_its_columns_of_one_buffer():
    partials = partial_sums.partial_rows(3, 8, 2, torch.device("cpu"), m=5)
    dw, db = partial_sums.gradient_rows(partials, 8)
    assert dw.shape == db.shape == (3, 8) and dw.stride() == db.stride() == (16, 1)
    assert db.data_ptr() - dw.data_ptr() == 8 * 4  # (16-byte aligned wherever N is a multiple of 4)


def test_partial_rows_are_summed_into_each_gradient_in_its_dtype():
    partials = torch.arange(48, dtype=torch.float32).reshape(3, 16) / 7
    for dw_dtype in (torch.float32, torch.bfloat16):
        dw, db = torch.full((8,), float("nan"), dtype=dw_dtype), torch.full((8,), float("nan"))
        partial_sums.sum_partial_rows(partials, [dw, db])
        torch.testing.assert_close(dw, partials[:, :8].sum(0).to(dw_dtype))
        torch.testing.assert_close(db, partials[:, 8:].sum(0), rtol=0, atol=0)
    alone = torch.full((16,), float("nan"))  # one gradient (RMSNorm's dw) over the whole buffer
    partial_sums.sum_partial_rows(partials, [alone])
    torch.testing.assert_close(alone, partials.sum(0), rtol=0, atol=0)
