"""LayerNorm forward and backward: quack vs torch eager vs torch.compile, in TB/s.

    python tools/bench/layernorm.py [--dtype bfloat16] [--plot layernorm.png]

Forward moves x in and y out; backward moves x and dy in and dx out (weight,
bias and statistics vectors are small and not counted).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import quack  # noqa: E402
from quack.families.layernorm.op import layernorm_bwd, layernorm_fwd  # noqa: E402
from harness import STANDARD_SHAPES, Case, parse_args, run  # noqa: E402


def _torch_fwd(x, w, b):
    return F.layer_norm(x, (x.shape[-1],), w, b, eps=1e-5)


def cases(dtype: torch.dtype) -> list[Case]:
    # The backward is timed by replaying one graph (retain_graph=True), which
    # donated buffers forbid.
    import torch._functorch.config

    torch._functorch.config.donated_buffer = False
    # dynamic=False: one specialised graph per shape, as a fixed-shape model gets.
    compiled_fwd = torch.compile(_torch_fwd, dynamic=False)
    out = []
    for m, n in STANDARD_SHAPES:
        x = torch.randn(m, n, device="cuda", dtype=dtype)
        w = torch.randn(n, device="cuda", dtype=dtype)
        b = torch.randn(n, device="cuda", dtype=dtype)
        dy = torch.randn_like(x)
        size = x.element_size()
        out.append(Case(f"fwd {m}x{n}", 2 * m * n * size, {
            "quack": lambda x=x, w=w, b=b: quack.layernorm(x, w, b),
            "torch": lambda x=x, w=w, b=b: _torch_fwd(x, w, b),
            "torch.compile": lambda x=x, w=w, b=b: compiled_fwd(x, w, b),
        }))
        _, mean, rstd = layernorm_fwd(x, w, b)
        inputs = tuple(t.detach().requires_grad_() for t in (x, w, b))
        y_eager = _torch_fwd(*inputs)
        y_comp = compiled_fwd(*inputs)
        out.append(Case(f"bwd {m}x{n}", 3 * m * n * size, {
            "quack": lambda x=x, w=w, dy=dy, mean=mean, rstd=rstd: layernorm_bwd(x, w, dy, mean, rstd, True),
            "torch": lambda y=y_eager, dy=dy, i=inputs: torch.autograd.grad(y, i, dy, retain_graph=True),
            "torch.compile": lambda y=y_comp, dy=dy, i=inputs: torch.autograd.grad(y, i, dy, retain_graph=True),
        }))
    return out


def main() -> None:
    args = parse_args("layernorm.png")
    dtype = getattr(torch, args.dtype)
    run(f"LayerNorm {args.dtype} (H200)", cases(dtype), args.plot or None)


if __name__ == "__main__":
    main()
