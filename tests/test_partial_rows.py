"""The persistent backwards' partial dw / db buffers (quack/torch_interop.py): allocated
uninitialised, so every row that is summed must be written by the kernel or zeroed."""

import pytest
import torch

from quack import torch_interop as ti


def test_buffer_is_zeroed_only_when_no_kernel_writes_it():
    assert torch.count_nonzero(ti.partial_rows(4, 8, torch.device("cpu"), kernel_runs=False)) == 0
    assert ti.partial_rows(4, 8, torch.device("cpu"), kernel_runs=True).shape == (4, 8)


def test_rows_past_the_launch_are_zeroed():
    partial = torch.full((10, 8), float("nan"))
    ti.fit_partial_rows("dw_partial", partial, num_ctas=3, rows_per_cta=2)
    assert torch.isnan(partial[:6]).all()  # the kernel's rows: left to it
    assert torch.count_nonzero(partial[6:]) == 0


def test_a_buffer_too_small_for_the_launch_is_refused():
    with pytest.raises(ValueError, match="dw_partial has 5 rows; this launch writes 6"):
        ti.fit_partial_rows("dw_partial", torch.empty(5, 8), num_ctas=3, rows_per_cta=2)

