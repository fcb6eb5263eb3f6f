"""Sweep the per-thread register budget of a row-wise family's kernels (GPU only).

    CUTE_DSL_DISABLE_FILE_CACHING=1 python tools/bench/rowwise_sweep.py --family rmsnorm

The budget (values of a row per thread) decides threads per row and cluster
size (quack.rowwise.device.RowConfig.for_row).  Each setting compiles into a fresh
cache directory and prints the share of copy bandwidth per long-row shape
(bf16); the defaults in quack/rowwise/device.py come from these sweeps.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402

import quack.cache  # noqa: E402
from harness import bench_ms, copy_bandwidth  # noqa: E402
from quack.rowwise import config as rowwise  # noqa: E402

SHAPES = [(16384, 16384), (8192, 65536), (4096, 262144)]
SWEEPS = [
    ("fwd", ("FORWARD_VALUES_PER_THREAD",), [32, 64, 128]),
    ("bwd", ("BACKWARD_VALUES_PER_THREAD",), [16, 32, 64]),
]


def _launchers(family: str, m: int, n: int):
    """(forward, its bytes), (backward, its bytes) for one shape."""
    mod = importlib.import_module(f"quack.families.{family}.op")
    x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    rows = 2 * x.numel() * 2
    if family == "rmsnorm":
        _, _, rstd = mod.rmsnorm_fwd(x, w)
        return (lambda: mod.rmsnorm_fwd(x, w), rows), (lambda: mod.rmsnorm_bwd(x, w, dy, rstd, eps=1e-6), 3 * rows // 2)
    if family == "softmax":
        y = mod.softmax_fwd(x)
        return (lambda: mod.softmax_fwd(x), rows), (lambda: mod.softmax_bwd(y, dy), 3 * rows // 2)
    if family == "layernorm":
        _, mean, rstd = mod.layernorm_fwd(x, w, w)
        return ((lambda: mod.layernorm_fwd(x, w, w, store_stats=False), rows),
                (lambda: mod.layernorm_bwd(x, w, dy, mean, rstd, True), 3 * rows // 2))
    target = torch.randint(0, n, (m,), device="cuda")
    lse = mod.cross_entropy_fwd(x, target)[1]
    g = torch.ones(m, device="cuda")
    return (lambda: mod.cross_entropy_fwd(x, target), rows // 2), (
        lambda: mod.cross_entropy_bwd(x, target, lse, g), rows)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--family", default="rmsnorm", choices=["rmsnorm", "softmax", "cross_entropy", "layernorm"])
    family = parser.parse_args().family
    copy_tbs = copy_bandwidth()
    print(f"{family}: copy {copy_tbs:.2f} TB/s")
    for kind, knobs, budgets in SWEEPS:
        defaults = [getattr(rowwise, k) for k in knobs]
        for budget in budgets:
            for k in knobs:
                setattr(rowwise, k, budget)
            os.environ["QUACK_CACHE_DIR"] = tempfile.mkdtemp(prefix="quack-sweep-")
            quack.cache.clear()
            cells = []
            for m, n in SHAPES:
                fwd, bwd = _launchers(family, m, n)
                fn, nbytes = fwd if kind == "fwd" else bwd
                cfg = (rowwise.forward_config(n, 8) if kind == "fwd"
                       else rowwise.backward_config(n, 8))
                tbs = nbytes / (bench_ms(fn) * 1e-3) / 1e12
                cells.append(f"{n}: {100 * tbs / copy_tbs:.0f}% (threads {cfg.threads}, cluster {cfg.cluster_n})")
            print(f"{kind} budget {budget}: " + " | ".join(cells), flush=True)
        for k, v in zip(knobs, defaults):
            setattr(rowwise, k, v)


if __name__ == "__main__":
    main()
