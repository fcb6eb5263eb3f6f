"""The GEMM backward's reading of autograd's gradient (CPU tensors: the
layout decision needs no GPU; tests/test_gemm.py runs the backward itself)."""

import torch

from quack.families.gemm.operands import kernel_ready


def test_unaligned_contiguous_gradient_is_copied_to_an_aligned_one():
    # The backward of torch.cat of flattened tensors hands out contiguous
    # views at unaligned starts, which .contiguous() would return as they are.
    flat = torch.randn(3 + 8 * 16).to(torch.bfloat16)
    unaligned = flat[3:].view(8, 16)
    assert unaligned.is_contiguous() and unaligned.data_ptr() % 16
    ready = kernel_ready(unaligned, torch.bfloat16)
    assert ready.data_ptr() % 16 == 0 and torch.equal(ready, unaligned)


def test_readable_gradient_is_used_as_it_is():
    grad = torch.randn(8, 16).to(torch.bfloat16)
    assert kernel_ready(grad, torch.bfloat16) is grad
    transposed = torch.randn(16, 8).to(torch.bfloat16).t()  # M-contiguous: a layout the kernel reads
    assert kernel_ready(transposed, torch.bfloat16) is transposed
