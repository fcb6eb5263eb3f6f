"""Sweep the per-thread register budget of the RMSNorm kernels (GPU only).

    CUTE_DSL_DISABLE_FILE_CACHING=1 python tools/bench/rmsnorm_sweep.py

The budget (values of a row per thread) decides threads per row and cluster
size (quack.rowwise.RowConfig.for_row).  Each setting compiles into a fresh
cache directory and prints the share of copy bandwidth per standard shape.
"""

from __future__ import annotations

import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402
from triton.testing import do_bench  # noqa: E402

import quack.cache  # noqa: E402
import quack.rmsnorm  # noqa: E402,F401
from harness import STANDARD_SHAPES, copy_bandwidth  # noqa: E402
from quack import rowwise  # noqa: E402

R = sys.modules["quack.rmsnorm"]  # the module (quack.rmsnorm is also the function)
SWEEPS = [
    ("fwd", "FORWARD_VALUES_PER_THREAD", [32, 64, 128]),
    ("bwd", "BACKWARD_VALUES_PER_THREAD", [16, 32]),
]


def share(kind: str, m: int, n: int, copy_tbs: float) -> str:
    x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    if kind == "fwd":
        fn, nbytes = (lambda: R.rmsnorm_fwd(x, w)), 2 * x.numel() * 2
        cfg = rowwise.forward_config(n, 8, 2)
    else:
        dy = torch.randn_like(x)
        _, _, rstd = R.rmsnorm_fwd(x, w)
        fn, nbytes = (lambda: R.rmsnorm_bwd(x, w, dy, rstd)), 3 * x.numel() * 2
        cfg = rowwise.backward_config(n, 8)
    tbs = nbytes / do_bench(fn, return_mode="median") / 1e9
    return f"{n}: {100 * tbs / copy_tbs:.0f}% (threads {cfg.threads}, cluster {cfg.cluster_n})"


def main() -> None:
    copy_tbs = copy_bandwidth()
    print(f"copy {copy_tbs:.2f} TB/s")
    for kind, knob, budgets in SWEEPS:
        defaults = (getattr(rowwise, knob), rowwise.FORWARD_VALUES_PER_THREAD_LONG_16BIT)
        for budget in budgets:
            setattr(rowwise, knob, budget)
            if kind == "fwd":
                rowwise.FORWARD_VALUES_PER_THREAD_LONG_16BIT = budget
            os.environ["QUACK_CACHE_DIR"] = tempfile.mkdtemp(prefix="quack-sweep-")
            quack.cache.clear()
            cells = [share(kind, m, n, copy_tbs) for m, n in STANDARD_SHAPES]
            print(f"{kind} budget {budget}: " + " | ".join(cells), flush=True)
        setattr(rowwise, knob, defaults[0])
        rowwise.FORWARD_VALUES_PER_THREAD_LONG_16BIT = defaults[1]


if __name__ == "__main__":
    main()
