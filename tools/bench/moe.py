"""A mixture-of-experts expert layer, forward + backward: quack.gemm vs torch._grouped_mm.

    python tools/bench/moe.py

The layer of ``quack/testing/moe.py`` at a current MoE's sizes: 64 experts,
hidden 4096, expert width 1536 (up-projection to 2 x 1536), 32768 routed rows
spread unevenly with some experts empty, bf16.  Each contender runs the same
layer (grouped up-projection, SwiGLU, grouped down-projection) with its own
grouped GEMM; quack also with SwiGLU fused into the up-projection
(``quack.gemm_glu``) and as ``quack.mlp`` (whose backward computes SwiGLU's
derivative in a GEMM epilogue).  Forward then backward into every input
(tokens, both weights); torch._grouped_mm gets its weights column-major per expert, the
layout cuBLASLt wants.  Milliseconds per step and TFLOP/s (3 GEMMs per
product: forward, dA, dB), median of three round-robin passes.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402

from harness import interleaved_ms  # noqa: E402
from quack.testing import moe  # noqa: E402

EXPERTS, HIDDEN, WIDTH, ROWS = 64, 4096, 1536, 32768


def _step(grouped_mm, x, w_up, w_down, cu, dy, gated_mm=None, layer=None):
    def run():
        if layer is not None:
            out = layer(x, w_up, w_down, cu)
        else:
            out = moe.expert_layer(x, w_up, w_down, cu, grouped_mm, gated_mm)
        torch.autograd.grad(out, (x, w_up, w_down), dy)

    return run


def main() -> None:
    torch.manual_seed(0)
    lengths = moe.routed_lengths(EXPERTS, ROWS)
    cu = moe.cu_seqlens(lengths)
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(ROWS, HIDDEN, **bf16).requires_grad_()
    w_up = (torch.randn(EXPERTS, HIDDEN, 2 * WIDTH, **bf16) / HIDDEN**0.5).requires_grad_()
    w_down = (torch.randn(EXPERTS, WIDTH, HIDDEN, **bf16) / WIDTH**0.5).requires_grad_()
    dy = torch.randn(ROWS, HIDDEN, **bf16)
    # torch._grouped_mm's weights: the same values, column-major per expert.
    col = [w.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_() for w in (w_up, w_down)]
    steps = {
        "quack": _step(moe.quack_mm, x, w_up, w_down, cu, dy),
        "quack gemm_glu": _step(moe.quack_mm, x, w_up, w_down, cu, dy, moe.quack_glu),
        "quack.mlp": _step(None, x, w_up, w_down, cu, dy, layer=moe.quack_mlp_layer),
        "torch._grouped_mm": _step(moe.torch_grouped_mm, x, *col, cu, dy),
    }
    flops = 3 * 2 * ROWS * HIDDEN * (2 * WIDTH + WIDTH)
    print(f"\nMoE expert layer fwd+bwd, bf16: {EXPERTS} experts ({lengths.count(0)} empty), hidden {HIDDEN}, "
          f"width {WIDTH}, {ROWS} routed rows")
    available = {}
    for name, fn in steps.items():
        try:
            fn()
            available[name] = fn
        except Exception as exc:  # a torch without _grouped_mm's backward is reported, not fatal
            print(f"  {name} failed: {type(exc).__name__}: {exc}")
    ms = interleaved_ms(available)
    print(f"{'contender':<20}{'ms/step':>10}{'TFLOP/s':>10}")
    for name, t in ms.items():
        print(f"{name:<20}{t:>10.3f}{flops / (t * 1e-3) / 1e12:>10.1f}")
    for name in ("quack", "quack gemm_glu", "quack.mlp"):
        if name in ms and "torch._grouped_mm" in ms:
            print(f"{name} / torch._grouped_mm time: {ms[name] / ms['torch._grouped_mm']:.2f}")


if __name__ == "__main__":
    main()
