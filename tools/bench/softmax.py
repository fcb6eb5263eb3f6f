"""Softmax forward and backward: quack vs torch eager vs torch.compile, in TB/s.

    python tools/bench/softmax.py [--dtype bfloat16] [--plot softmax.png]

Forward moves x in and y out; backward moves y and dy in and dx out.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402

import quack  # noqa: E402
from quack.families.softmax.op import softmax_bwd  # noqa: E402
from harness import STANDARD_SHAPES, Case, parse_args, run  # noqa: E402


def _torch_fwd(x):
    return torch.softmax(x, dim=-1)


def _torch_bwd(y, dy):
    return torch._softmax_backward_data(dy, y, -1, y.dtype)


def cases(dtype: torch.dtype) -> list[Case]:
    # dynamic=False: one specialised graph per shape, as a fixed-shape model gets.
    compiled_fwd = torch.compile(_torch_fwd, dynamic=False)
    compiled_bwd = torch.compile(lambda y, dy: y * (dy - (y * dy).sum(-1, keepdim=True)), dynamic=False)
    out = []
    for m, n in STANDARD_SHAPES:
        x = torch.randn(m, n, device="cuda", dtype=dtype)
        size = x.element_size()
        out.append(Case(f"fwd {m}x{n}", 2 * m * n * size, {
            "quack": lambda x=x: quack.softmax(x),
            "torch": lambda x=x: _torch_fwd(x),
            "torch.compile": lambda x=x: compiled_fwd(x),
        }))
        y = quack.softmax(x)
        dy = torch.randn_like(x)
        out.append(Case(f"bwd {m}x{n}", 3 * m * n * size, {
            "quack": lambda y=y, dy=dy: softmax_bwd(y, dy),
            "torch": lambda y=y, dy=dy: _torch_bwd(y, dy),
            "torch.compile": lambda y=y, dy=dy: compiled_bwd(y, dy),
        }))
    return out


def main() -> None:
    args = parse_args("softmax.png")
    dtype = getattr(torch, args.dtype)
    run(f"Softmax {args.dtype} (H200)", cases(dtype), args.plot or None)


if __name__ == "__main__":
    main()
