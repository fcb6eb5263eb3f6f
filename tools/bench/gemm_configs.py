"""Tile configurations of the GEMM side by side (the evidence behind ``gemm_config``).

    python tools/bench/gemm_configs.py              # on the GPU: a table in TFLOP/s
    python tools/bench/gemm_configs.py --few-rows   # on the GPU: the configurations for few rows, in us
    python tools/bench/gemm_configs.py --warm DIR   # on any machine: export the objects to DIR

Each row is one problem, each column one (cluster M x N, raster band)
configuration of 128 x 256 tiles, with cuBLAS (dense) or torch._grouped_mm
(grouped) measured in the same run (medians of round-robin passes).  Grouped
"uneven" is the benchmark's 64 uneven groups; "uneven128" the same groups
rounded up to whole 128-row tiles, counted in padded rows (it isolates the
cost of partial tiles).

``--few-rows``: dense products of a few rows at the inference weight shapes,
the default configuration beside the split-K ones (split counts as
``split.split_count`` picks them) and cuBLAS; each configuration's output is
checked against cuBLAS's first ("!" marks a cell whose output differs).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402

from quack.families.gemm.config import GemmConfig  # noqa: E402
from quack.families.gemm.product import launch_gemm  # noqa: E402

CONFIGS = [
    GemmConfig(cluster_m=2, cluster_n=1, band=8),
    GemmConfig(cluster_m=1, cluster_n=2, band=8),
    GemmConfig(cluster_m=2, cluster_n=1, band=16),
]
# The candidates for dense calls of a few rows (config.DENSE_CLASSES).
FEW_ROWS_CONFIGS = {
    "default": GemmConfig(),
    "64x128 split": GemmConfig(tile_m=64, tile_n=128, cluster_m=1, cluster_n=1, split_k=True),
    "128x128 split": GemmConfig(tile_m=128, tile_n=128, cluster_m=1, cluster_n=1, split_k=True),
    "64x64 split": GemmConfig(tile_m=64, tile_n=64, cluster_m=1, cluster_n=1, split_k=True),
    "128x64 split": GemmConfig(tile_m=128, tile_n=64, cluster_m=1, cluster_n=1, split_k=True),
}
FEW_ROWS_M = [1, 16, 64, 65, 128, 192, 256, 384, 512]
PROBLEMS = [("dense", 8192, 8192, 8192, None), ("dense", 4096, 4096, 4096, None), ("dense", 8192, 4096, 4096, None),
            ("grouped", 16384, 4096, 4096, [2048] * 8), ("grouped", 32768, 4096, 4096, [512] * 64),
            ("grouped", 32768, 4096, 4096, "uneven"), ("grouped", 36864, 4096, 4096, "uneven128")]


def _operands(m, n, k, groups):
    from gemm import _uneven_lengths

    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    if groups is None:
        return a, torch.randn(1, k, n, device="cuda", dtype=torch.bfloat16), None, None
    lengths = groups
    if groups in ("uneven", "uneven128"):
        # uneven128: the same groups rounded up to whole 128-row tiles (no partial tiles)
        lengths = [-(-x // 128) * 128 if groups == "uneven128" else x for x in _uneven_lengths(64, 32768)]
    b = torch.randn(len(lengths), k, n, device="cuda", dtype=torch.bfloat16)
    cu = torch.nn.functional.pad(torch.tensor(lengths, device="cuda").cumsum(0), (1, 0)).to(torch.int32)
    b_cm = b.transpose(1, 2).contiguous().transpose(1, 2)
    return a, b, cu, lambda: torch._grouped_mm(a, b_cm, offs=cu[1:])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--warm", help="export every configuration's objects to this cache directory")
    parser.add_argument("--few-rows", action="store_true", help="the configurations for a few rows (us)")
    args = parser.parse_args()
    if args.warm:
        os.environ["QUACK_CACHE_DIR"] = args.warm
        from quack.compile_only import compile_only_mode

        with compile_only_mode():
            for varlen in (False, True):
                a, b = torch.empty(8, 8, device="cuda", dtype=torch.bfloat16), torch.empty(
                    1, 8, 8, device="cuda", dtype=torch.bfloat16)
                cu = torch.zeros(2, device="cuda", dtype=torch.int32) if varlen else None
                configs = CONFIGS if varlen else CONFIGS + list(FEW_ROWS_CONFIGS.values())
                for cfg in configs:
                    launch_gemm(a, b, torch.empty(8, 8, device="cuda", dtype=torch.bfloat16), cu, True, cfg)
        return
    if args.few_rows:
        print_few_rows()
        return
    from harness import interleaved_ms

    names = [f"{c.cluster_m}x{c.cluster_n} band {c.band}" for c in CONFIGS]
    print(f"{'problem':<34}" + "".join(f"{n:>16}" for n in names) + f"{'reference':>12}")
    for kind, m, n, k, groups in PROBLEMS:
        a, b, cu, ref = _operands(m, n, k, groups)
        out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        fns = {name: (lambda cfg=cfg: launch_gemm(a, b, out, cu, True, cfg)) for name, cfg in zip(names, CONFIGS)}
        fns["reference"] = ref or (lambda: a @ b[0])
        ms = interleaved_ms(fns)
        label = f"{kind} {m}x{n}x{k}" + (f" G={len(groups)}" if isinstance(groups, list) else f" {groups or ''}")
        print(f"{label:<34}" + "".join(f"{2 * m * n * k / ms[name] / 1e9:>16.1f}" for name in names)
              + f"{2 * m * n * k / ms['reference'] / 1e9:>12.1f}")


def print_few_rows() -> None:
    from gemm import WEIGHTS
    from harness import interleaved_ms

    names = list(FEW_ROWS_CONFIGS)
    print("Dense bf16 products of a few rows, us (!: output differs from cuBLAS's)")
    print(f"{'K x N':<14}{'M':>6}" + "".join(f"{n:>16}" for n in names) + f"{'cuBLAS':>10}")
    for k, n in WEIGHTS:
        b = torch.randn(1, k, n, device="cuda", dtype=torch.bfloat16) / k**0.5
        for m in FEW_ROWS_M:
            a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = a @ b[0]
            outs = {name: torch.empty(m, n, device="cuda", dtype=torch.bfloat16) for name in names}
            fns = {name: (lambda cfg=cfg, out=outs[name]: launch_gemm(a, b, out, None, True, cfg))
                   for name, cfg in FEW_ROWS_CONFIGS.items()}
            fns["cuBLAS"] = lambda: a @ b[0]
            ms = interleaved_ms(fns)
            wrong = {name: not torch.allclose(outs[name].float(), ref.float(), atol=5e-2, rtol=2e-2)
                     for name in names}
            print(f"{f'{k} x {n}':<14}{m:>6}"
                  + "".join(f"{1e3 * ms[name]:>15.1f}{'!' if wrong[name] else ' '}" for name in names)
                  + f"{1e3 * ms['cuBLAS']:>10.1f}")
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
