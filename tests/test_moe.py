"""A mixture-of-experts expert layer on quack.gemm, forward and backward, on the GPU.

Tokens sorted by expert, a grouped up-projection, SwiGLU (in torch, or
fused into the up-projection by quack.gemm_glu), a grouped down-projection
(``quack/testing/moe.py``), or the whole layer as quack.mlp; gradients of the tokens and of
both expert weights (the weights' through the variable-length-K product)
against the float64 reference, with the matrix's tolerance rule (torch's
error: the same layer on torch.matmul in bf16).  Run: ``pytest tests/test_moe.py``.
"""

import pytest
import torch

from quack.testing import matrix, moe

pytestmark = pytest.mark.gpu

# Small enough for the per-expert float64 reference; the benchmark
# (tools/bench/moe.py) runs a current MoE's sizes.
EXPERTS, HIDDEN, WIDTH, ROWS = 16, 512, 384, 3000


@pytest.mark.parametrize("variant", ["swiglu_in_torch", "gemm_glu", "mlp"])
@pytest.mark.parametrize("mode", ["grad_all", "grad_params", matrix.INFERENCE])
def test_expert_layer(mode, variant):
    torch.manual_seed(0)
    lengths = moe.routed_lengths(EXPERTS, ROWS)
    assert 0 in lengths  # some experts get no tokens
    cu = moe.cu_seqlens(lengths)
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    inputs = {
        "x": torch.randn(ROWS, HIDDEN, **bf16),
        "w_up": torch.randn(EXPERTS, HIDDEN, 2 * WIDTH, **bf16) / HIDDEN**0.5,
        "w_down": torch.randn(EXPERTS, WIDTH, HIDDEN, **bf16) / WIDTH**0.5,
    }

    def layer(grouped_mm, gated_mm=None):
        return lambda x, w_up, w_down: moe.expert_layer(x, w_up, w_down, cu, grouped_mm, gated_mm)

    ours = {
        "swiglu_in_torch": layer(moe.quack_mm),
        "gemm_glu": layer(moe.quack_mm, moe.quack_glu),
        "mlp": lambda x, w_up, w_down: moe.quack_mlp_layer(x, w_up, w_down, cu),
    }[variant]
    matrix.check_case(
        ours, layer(moe.loop_mm), layer(moe.loop_mm), inputs, ("w_up", "w_down"), mode,
        matrix.random_cotangents,
    )
