"""RMSNorm forward and backward: quack vs torch eager vs torch.compile, in TB/s.

    python tools/bench/rmsnorm.py [--dtype bfloat16] [--plot rmsnorm.png]

Forward moves x in and y out; backward moves x and dy in and dx out (weight
and statistics vectors are small and not counted).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import quack  # noqa: E402
from quack.families.rmsnorm.op import rmsnorm_bwd, rmsnorm_fwd  # noqa: E402
from harness import STANDARD_SHAPES, Case, parse_args, run  # noqa: E402


def _torch_fwd(x, w):
    return F.rms_norm(x, (x.shape[-1],), w, eps=1e-6)


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
        dy = torch.randn_like(x)
        size = x.element_size()
        out.append(Case(f"fwd {m}x{n}", 2 * m * n * size, {
            "quack": lambda x=x, w=w: quack.rmsnorm(x, w),
            "torch": lambda x=x, w=w: _torch_fwd(x, w),
            "torch.compile": lambda x=x, w=w: compiled_fwd(x, w),
        }))
        _, _, rstd = rmsnorm_fwd(x, w)
        xg = x.detach().requires_grad_()
        wg = w.detach().requires_grad_()
        y_eager = _torch_fwd(xg, wg)
        y_comp = compiled_fwd(xg, wg)
        out.append(Case(f"bwd {m}x{n}", 3 * m * n * size, {
            "quack": lambda x=x, w=w, dy=dy, rstd=rstd: rmsnorm_bwd(x, w, dy, rstd, eps=1e-6),
            "torch": lambda y=y_eager, dy=dy, i=(xg, wg): torch.autograd.grad(y, i, dy, retain_graph=True),
            "torch.compile": lambda y=y_comp, dy=dy, i=(xg, wg): torch.autograd.grad(y, i, dy, retain_graph=True),
        }))
    return out


def main() -> None:
    args = parse_args("rmsnorm.png")
    dtype = getattr(torch, args.dtype)
    run(f"RMSNorm {args.dtype} (H200)", cases(dtype), args.plot or None)


if __name__ == "__main__":
    main()
