"""Cross-entropy forward and backward: quack vs torch eager vs torch.compile, in TB/s.

    python tools/bench/cross_entropy.py [--dtype bfloat16] [--plot cross_entropy.png]

Forward reads the logits (targets and per-row outputs are small and not
counted); backward reads the logits and writes their gradient.  Reduction "none".
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import quack  # noqa: E402
from quack.families.cross_entropy.op import cross_entropy_bwd, cross_entropy_fwd  # noqa: E402
from harness import STANDARD_SHAPES, Case, parse_args, run  # noqa: E402


def _torch_fwd(x, t):
    return F.cross_entropy(x, t, reduction="none")


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
        t = torch.randint(0, n, (m,), device="cuda")
        size = x.element_size()
        out.append(Case(f"fwd {m}x{n}", m * n * size, {
            "quack": lambda x=x, t=t: quack.cross_entropy(x, t, reduction="none"),
            "torch": lambda x=x, t=t: _torch_fwd(x, t),
            "torch.compile": lambda x=x, t=t: compiled_fwd(x, t),
        }))
        lse = cross_entropy_fwd(x, t)[1]
        g = torch.randn(m, device="cuda")
        xg = x.detach().requires_grad_()
        loss_eager = _torch_fwd(xg, t)
        loss_comp = compiled_fwd(xg, t)
        out.append(Case(f"bwd {m}x{n}", 2 * m * n * size, {
            "quack": lambda x=x, t=t, lse=lse, g=g: cross_entropy_bwd(x, t, lse, g),
            "torch": lambda l=loss_eager, g=g, i=xg: torch.autograd.grad(l, i, g, retain_graph=True),
            "torch.compile": lambda l=loss_comp, g=g, i=xg: torch.autograd.grad(l, i, g, retain_graph=True),
        }))
    return out


def main() -> None:
    args = parse_args("cross_entropy.png")
    dtype = getattr(torch, args.dtype)
    run(f"Cross-entropy {args.dtype} (H200)", cases(dtype), args.plot or None)


if __name__ == "__main__":
    main()
