"""The GEMM epilogue's activation derivatives (closed forms the backward
applies) against autograd through torch's own activations (CPU)."""

import pytest
import torch

from quack.gemm_epilogue import ACTIVATION_GRADS, GATED, TORCH_ACTIVATIONS, activation_grad, gated_ref


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


@pytest.mark.parametrize("activation", sorted(GATED))
def test_gated_gradient_matches_autograd(activation):
    """The gate and up columns' gradients, interleaved as they came."""
    torch.manual_seed(0)
    z = torch.randn(16, 40, dtype=torch.float64) * 3
    g = torch.randn(16, 20, dtype=torch.float64)
    z_ = z.clone().requires_grad_()
    (expected,) = torch.autograd.grad(gated_ref(z_, activation), z_, g)
    # activation_grad works in fp32, as the backward does.
    torch.testing.assert_close(activation_grad(z, g, activation), expected, rtol=1e-5, atol=1e-5)
