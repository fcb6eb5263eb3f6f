"""Shared benchmark harness for the memory-bound kernel families (GPU only).

Each family script gives a list of cases (name, shape, callables for ours,
torch eager and torch.compile, bytes moved); the harness times them with
``triton.testing.do_bench`` (median, L2 flushed between runs), measures a
device-to-device copy of at least 1 GiB in the same process as the reference,
prints a table and writes a PNG plot.  Bytes are counted as BENCHMARKS.md's
"How we measure" says: tensors that must be read plus written, once each.
The GEMM scripts reuse its timing (``bench_ms``, ``interleaved_ms``) and ``plot``.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Callable

import torch


@dataclass
class Case:
    label: str  # e.g. "fwd 32768x4096"
    bytes_moved: int
    impls: dict[str, Callable[[], object]]  # name -> zero-argument launcher


def bench_ms(fn: Callable[[], object]) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def interleaved_ms(fns: dict[str, Callable[[], object]], rounds: int = 3) -> dict[str, float]:
    """Median time of each callable over ``rounds`` round-robin passes: clocks
    drift with power and temperature, so alternating the contenders keeps the
    comparison fair (whoever runs first on a cool GPU would win otherwise)."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name].append(bench_ms(fn))
    return {name: sorted(t)[rounds // 2] for name, t in times.items()}


def copy_bandwidth(gib: float = 1.0) -> float:
    """TB/s of a device-to-device copy, counted as bytes read + bytes written."""
    n = int(gib * (1 << 30))
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    return 2 * n / (ms * 1e-3) / 1e12


def run(title: str, cases: list[Case], plot_path: str | None) -> list[dict]:
    copy_tbs = copy_bandwidth()
    rows = []
    print(f"\n{title} (copy reference: {copy_tbs:.2f} TB/s)")
    names = list(cases[0].impls)
    header = f"{'case':<26}" + "".join(f"{n + ' TB/s':>18}{'%copy':>7}" for n in names)
    print(header)
    print("-" * len(header))
    for case in cases:
        line = f"{case.label:<26}"
        row = {"case": case.label}
        for name, fn in case.impls.items():
            try:
                tbs = case.bytes_moved / (bench_ms(fn) * 1e-3) / 1e12
            except Exception as exc:  # a reference that fails (e.g. compile) is reported, not fatal
                print(f"  {name} failed on {case.label}: {type(exc).__name__}: {exc}")
                tbs = float("nan")
            row[name] = tbs
            line += f"{tbs:>18.2f}{100 * tbs / copy_tbs:>6.0f}%"
        rows.append(row)
        print(line)
    if plot_path:
        plot(title, rows, names, (copy_tbs, "D2D copy"), "TB/s", plot_path)
    return rows


def plot(title, rows, names, reference, unit, path) -> None:
    """Grouped bars per case, one per implementation; ``reference`` is an
    optional (value, label) drawn as a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4.5))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        ax.bar([j + i * width for j in range(len(rows))], [r[name] for r in rows], width, label=name)
    if reference:
        ax.axhline(reference[0], color="k", linestyle="--", linewidth=1, label=reference[1])
    ax.set_xticks([j + width * (len(names) - 1) / 2 for j in range(len(rows))])
    ax.set_xticklabels([r["case"] for r in rows], rotation=20, ha="right", fontsize=8)
    ax.set_ylabel(unit)
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot written to {path}")


def parse_args(default_plot: str, tables: tuple[str, ...] = ()) -> argparse.Namespace:
    """--plot, --dtype, and --only TABLE where a benchmark prints several ``tables``."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--plot", default=default_plot, help="PNG path ('' for none)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    if tables:
        parser.add_argument("--only", choices=tables, help="print this table alone")
    return parser.parse_args()


STANDARD_SHAPES = [(32768, 4096), (16384, 16384), (8192, 65536), (4096, 262144)]
