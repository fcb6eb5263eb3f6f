"""The GEMM's fused epilogues on the host side, without the CuTe DSL: the
activations the kernel applies (``quack/gemm_kernels.py`` computes them in
fp32 before its one rounding), their torch definitions (the tests'
reference) and their derivatives in closed form, which the backward applies
to the saved pre-activation (no ``torch.autograd.grad`` inside a backward:
torch.compile traces it)."""

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

# d act(z) / dz times the incoming gradient g, both fp32.
ACTIVATION_GRADS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "relu": lambda g, z: g * (z > 0),
    "relu_sq": lambda g, z: g * 2 * F.relu(z),
    "gelu_tanh": lambda g, z: torch.ops.aten.gelu_backward(g, z, approximate="tanh"),
    "silu": lambda g, z: torch.ops.aten.silu_backward(g, z),
}


def check_activation(activation: Optional[str]) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")


def activation_grad(preact: torch.Tensor, grad_out: torch.Tensor, activation: str) -> torch.Tensor:
    """dL/d(preact) from dL/d(out), in fp32, rounded to ``grad_out``'s dtype:
    one elementwise pass over the saved pre-activation."""
    return ACTIVATION_GRADS[activation](grad_out.float(), preact.float()).to(grad_out.dtype)
