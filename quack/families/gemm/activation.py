"""Activation math of the GEMM's fused epilogues and of the elementwise
activation backward, one fp32 value at a time (device code, traced inline).

Names follow ``quack/families/gemm/epilogue.py``: relu, relu_sq, gelu_tanh
(GELU's tanh approximation) and silu; the gated epilogues apply the same
functions to the gate column.  exp and tanh go through the fast ``exp2`` and
reciprocal (MUFU) instructions: the exact sequences are long enough to slow
the epilogue behind the main loop.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import const_expr

_GELU_TANH_SCALE = 0.7978845608028654  # sqrt(2 / pi)
# log2(e), as rowwise/device.py has it: written again on purpose, since importing
# that module would put the row-wise device code into the GEMM objects' key.
_LOG2_E = 1.4426950408889634


def activate(x, name: str):
    """The activation ``name`` of one fp32 value (torch's definitions)."""
    if const_expr(name == "relu"):
        return cutlass.max(x, cutlass.Float32(0.0))
    if const_expr(name == "relu_sq"):
        r = cutlass.max(x, cutlass.Float32(0.0))
        return r * r
    if const_expr(name == "gelu_tanh"):
        return 0.5 * x * (1.0 + _tanh(_GELU_TANH_SCALE * (x + 0.044715 * x * x * x)))
    # silu: x / (1 + e^-x)
    return x * cute.arch.rcp_approx(1.0 + cute.math.exp2(x * -_LOG2_E, fastmath=True))


def _tanh(z):
    """tanh of one fp32 value as 1 - 2 / (1 + e^2z): two MUFU operations,
    absolute error about 1e-7, the limits at +-inf exact."""
    return 1.0 - 2.0 * cute.arch.rcp_approx(1.0 + cute.math.exp2(z * (2.0 * _LOG2_E), fastmath=True))


def activation_derivative(x, name: str):
    """d act(x) / dx of one fp32 value (``activate``'s activations)."""
    if const_expr(name == "relu"):
        return cutlass.Float32(cutlass.select_(x > 0.0, cutlass.Float32(1.0), cutlass.Float32(0.0)))
    if const_expr(name == "relu_sq"):
        return 2.0 * cutlass.max(x, cutlass.Float32(0.0))
    if const_expr(name == "gelu_tanh"):
        t = _tanh(_GELU_TANH_SCALE * (x + 0.044715 * x * x * x))
        return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * _GELU_TANH_SCALE * (1.0 + 3.0 * 0.044715 * x * x)
    sigmoid = cute.arch.rcp_approx(1.0 + cute.math.exp2(x * -_LOG2_E, fastmath=True))  # silu
    return sigmoid * (1.0 + x * (1.0 - sigmoid))


def gate_gradients(g, gate, up, name: str):
    """The gradients of a gated pair's (gate, up) from g, the gradient of
    act(gate) * up (fp32 values)."""
    return g * up * activation_derivative(gate, name), g * activate(gate, name)
