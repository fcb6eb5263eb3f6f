"""The GEMM's fused epilogues on the host side, without the CuTe DSL: the
activations the kernel applies (``quack/gemm_kernels.py`` computes them in
fp32 before its one rounding) and their torch definitions, which the
backward differentiates and the tests take as the reference."""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F

ACTIVATIONS = (None, "relu", "relu_sq", "gelu_tanh", "silu")

TORCH_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "relu": F.relu,
    "relu_sq": lambda z: F.relu(z).square(),
    "gelu_tanh": lambda z: F.gelu(z, approximate="tanh"),
    "silu": F.silu,
}


def check_activation(activation: Optional[str]) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")


def activation_grad(preact: torch.Tensor, grad_out: torch.Tensor, activation: str) -> torch.Tensor:
    """dL/d(preact) from dL/d(out), in fp32, rounded to ``grad_out``'s dtype:
    one elementwise pass over the saved pre-activation (torch's own
    derivative of the activation)."""
    with torch.enable_grad():
        z = preact.detach().float().requires_grad_()
        (dz,) = torch.autograd.grad(TORCH_ACTIVATIONS[activation](z), z, grad_out.float())
    return dz.to(grad_out.dtype)
