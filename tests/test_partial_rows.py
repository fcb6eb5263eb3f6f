"""The norm backward's partial dw / db rows (quack/rowwise/partial_sums.py):
one buffer for both gradients, allocated uninitialised when the kernel
writes every row, summed into each gradient in its dtype."""

import pytest
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


@pytest.mark.parametrize("widest_gemv", [0, 1 << 20], ids=["column sum", "gemv"])
def test_partial_rows_are_summed_into_each_gradient_in_its_dtype(monkeypatch, widest_gemv):
    monkeypatch.setattr(partial_sums, "GEMV_MAX_COLUMNS", widest_gemv)
    partials = torch.arange(48, dtype=torch.float32).reshape(3, 16) / 7
    exact = partials.double().sum(0)
    for dw_dtype in (torch.float32, torch.bfloat16):
        dw, db = torch.full((8,), float("nan"), dtype=dw_dtype), torch.full((8,), float("nan"))
        partial_sums.sum_partial_rows(partials, [dw, db])
        torch.testing.assert_close(dw, exact[:8].to(dw_dtype))
        torch.testing.assert_close(db, exact[8:].float())
    alone = torch.full((16,), float("nan"))  # one gradient (RMSNorm's dw) over the whole buffer
    partial_sums.sum_partial_rows(partials, [alone])
    torch.testing.assert_close(alone, exact.float())


def test_short_rows_take_the_gemv_and_long_rows_or_autocast_the_column_sum(monkeypatch):
    taken = []
    real_mv, real_sum = torch.mv, torch.Tensor.sum
    monkeypatch.setattr(torch, "mv", lambda *a, **k: taken.append("gemv") or real_mv(*a, **k))
    monkeypatch.setattr(torch.Tensor, "sum", lambda *a, **k: taken.append("sum") or real_sum(*a, **k))
    widest = partial_sums.GEMV_MAX_COLUMNS
    for columns in (widest, widest + 8):
        partial_sums.sum_partial_rows(torch.ones(2, columns), [torch.empty(columns // 2), torch.empty(columns // 2)])
    assert taken == ["gemv", "sum"]
    taken.clear()
    with torch.autocast("cpu", dtype=torch.bfloat16):  # (CUDA's autocast would run the GEMV in bf16)
        partial_sums.sum_partial_rows(torch.ones(2, 8), [torch.empty(4), torch.empty(4)])
    assert taken == ["sum"]


def test_the_vector_of_ones_is_kept_per_stream_and_never_from_a_capture(monkeypatch):
    monkeypatch.setattr(partial_sums, "_ONES", {})
    monkeypatch.setattr(partial_sums.ti, "capturing", lambda device: True)
    assert partial_sums._ones(5, torch.device("cpu")).tolist() == [1.0] * 5
    assert partial_sums._ONES == {}
    monkeypatch.setattr(partial_sums.ti, "capturing", lambda device: False)
    kept = partial_sums._ones(5, torch.device("cpu"))
    assert partial_sums._ones(3, torch.device("cpu")).data_ptr() == kept.data_ptr()  # a view of the kept one
    assert partial_sums._ones(8, torch.device("cpu")).tolist() == [1.0] * 8  # grown
    assert len(partial_sums._ONES) == 1
    # On a GPU, one per stream: a stream must not read ones whose fill is queued on another.
    stream = [1]
    monkeypatch.setattr(partial_sums.ti, "current_stream", lambda device: stream[0])
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(partial_sums.torch, "ones", lambda rows, device, dtype: torch.full((rows,), 1.0 + stream[0]))
    first = partial_sums._ones(4, cuda)
    stream[0] = 2
    second = partial_sums._ones(4, cuda)
    assert first.tolist() == [2.0] * 4 and second.tolist() == [3.0] * 4  # (made per stream)
    assert set(partial_sums._ONES) >= {(cuda, 1), (cuda, 2)}
