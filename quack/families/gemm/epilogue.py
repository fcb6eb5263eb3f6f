"""The GEMM's fused epilogues on the host side, without the CuTe DSL: the
activations the kernels apply (``quack/families/gemm/kernel.py`` computes them and
their derivatives in fp32 before its one rounding), their torch definitions
(the tests' reference and the empty product's), and the epilogue names."""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import torch
import torch.nn.functional as F

ACTIVATIONS = (None, "relu", "relu_sq", "gelu_tanh", "silu")
# Gated activations (``quack.gemm_glu``): each name -> the activation of its gate.
GATED = {"swiglu": "silu", "geglu": "gelu_tanh", "reglu": "relu"}
# Backward epilogues ("d" + an activation's name): D = (A @ B) * act'(Z) of a
# saved pre-activation Z; for a gated one, A @ B is dL/d(output) and D the
# gate and up columns' gradients, interleaved (twice A @ B's columns).
DERIVATIVES = tuple(f"d{name}" for name in (*ACTIVATIONS[1:], *GATED))


class Epilogue(NamedTuple):
    """A kernel epilogue's name, parsed once: the activation applied to each
    value, whether it is gated, whether it is a derivative."""

    activation: Optional[str]
    gated: bool
    derivative: bool

    def out_columns(self, n: int) -> int:
        """D's columns for an accumulator of ``n``: halved by a gate, doubled
        by a gate's derivative."""
        if not self.gated:
            return n
        return 2 * n if self.derivative else n // 2


def parse_epilogue(name: Optional[str]) -> Epilogue:
    """"dswiglu" -> Epilogue("silu", gated=True, derivative=True)."""
    if name is None:
        return Epilogue(None, False, False)
    derivative = name in DERIVATIVES
    base = name[1:] if derivative else name
    if base not in GATED and base not in ACTIVATIONS:
        raise ValueError(f"unknown GEMM epilogue {name!r}")
    return Epilogue(GATED.get(base, base), base in GATED, derivative)


TORCH_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "relu": F.relu,
    "relu_sq": lambda z: F.relu(z).square(),
    "gelu_tanh": lambda z: F.gelu(z, approximate="tanh"),
    "silu": F.silu,
}


def check_activation(activation: Optional[str], gated: bool = False) -> None:
    names = tuple(GATED) if gated else ACTIVATIONS
    if activation not in names:
        raise ValueError(f"activation must be one of {names}, got {activation!r}")


def gated_ref(z: torch.Tensor, activation: str) -> torch.Tensor:
    """act(gate) * up of the interleaved columns of ``z`` (gate j at column
    2 j, up j at 2 j + 1), in ``z``'s dtype."""
    gate, up = z.unflatten(-1, (-1, 2)).unbind(-1)
    return TORCH_ACTIVATIONS[GATED[activation]](gate) * up
