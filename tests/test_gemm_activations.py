"""The GEMM epilogue's activation derivatives (closed forms the backward
applies) against autograd through torch's own activations (CPU)."""

import pytest
import torch

from quack.gemm_epilogue import ACTIVATION_GRADS, TORCH_ACTIVATIONS, activation_grad


@pytest.mark.parametrize("activation", sorted(TORCH_ACTIVATIONS))
def test_closed_form_matches_autograd(activation):
    torch.manual_seed(0)
    z = torch.cat([torch.randn(1000, dtype=torch.float64) * 4, torch.tensor([0.0, -0.0, 1e-30, -30.0, 30.0])])
    g = torch.randn_like(z)
    z_ = z.clone().requires_grad_()
    (expected,) = torch.autograd.grad(TORCH_ACTIVATIONS[activation](z_), z_, g)
    torch.testing.assert_close(ACTIVATION_GRADS[activation](g, z), expected)


def test_activation_grad_keeps_the_gradient_dtype():
    z, g = torch.randn(4, 8, dtype=torch.bfloat16), torch.randn(4, 8, dtype=torch.float16)
    assert activation_grad(z, g, "silu").dtype == torch.float16
