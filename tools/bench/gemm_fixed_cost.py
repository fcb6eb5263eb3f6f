"""Where a GEMM of a few rows spends its time beyond the weight read (GPU only).

    python tools/bench/gemm_fixed_cost.py          # time against K: event timing and graph replay
    ncu --clock-control none --profile-from-start off --section SpeedOfLight --section LaunchStats \\
        --section Occupancy --section MemoryWorkloadAnalysis --section WarpStateStats \\
        python tools/bench/gemm_fixed_cost.py --ncu    # each call once, for the profiler
    python tools/bench/gemm_fixed_cost.py --timeline   # the GPU's timeline of back-to-back calls

The sweep times quack.gemm and ``A @ B`` (cuBLAS) at a few rows over K, two
ways in the same run: ``do_bench`` (L2 flushed before each call) and 20
calls on different weights replayed in one CUDA graph (no host cost, each
weight read from DRAM).  Time against K is a line: its slope is the weight
read, its intercept what a call costs whatever its size, which is what no
split count can remove.

``--ncu`` runs quack's plan, its split-K object with 1 and 4 splits, and
cuBLAS once each between ``torch.cuda.profiler.start()`` and ``stop()``, at
M = 16 and 128 of the 4096 x 4096 and 14336 x 4096 weights, so that ncu's
kernel durations can be set beside the event timing.

``--timeline`` queues six calls behind a GPU sleep (so the CPU's cost does
not show) and lists what the GPU ran for them (torch.profiler, CUPTI):
every kernel and memset with its duration and the gap before it, and the
CUDA API calls that launched them.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402

from harness import copy_bandwidth, interleaved_ms  # noqa: E402

import quack  # noqa: E402
from quack.families.gemm.config import SMALL_M_ROWS, gemm_config  # noqa: E402
from quack.families.gemm.product import launch_gemm  # noqa: E402

SWEEP = ((4096, 16), (4096, 128), (14336, 16))  # (N, M)
SWEEP_K = (1024, 2048, 4096, 8192, 16384)
GRAPH_CALLS = 20
GRAPH_BYTES = 200_000_000  # weights cycled through in the graph: more than the 50 MB L2


def graph_us(calls) -> float:
    """Median us per call of ``calls`` (one callable per captured call) replayed in one graph."""
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):  # first calls (buffers, loads) outside the capture
        for call in calls[:2]:
            call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(calls))
    return sorted(times)[len(times) // 2]


def sweep() -> None:
    print(f"copy {copy_bandwidth():.2f} TB/s; us per call, quack / cuBLAS")
    print(f"{'N':>6} {'M':>4} {'K':>6} {'weights MB':>10} {'do_bench':>16} {'graph replay':>16}")
    for n, m in SWEEP:
        for k in SWEEP_K:
            a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            copies = max(1, GRAPH_BYTES // (k * n * 2))
            weights = [torch.randn(k, n, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(copies)]
            first = weights[0]
            ms = interleaved_ms({"quack": lambda: quack.gemm(a, first), "cublas": lambda: a @ first})
            on_each = [weights[i % copies] for i in range(GRAPH_CALLS)]
            graph_quack = graph_us([lambda b=b: quack.gemm(a, b) for b in on_each])
            graph_cublas = graph_us([lambda b=b: a @ b for b in on_each])
            bench = f"{1e3 * ms['quack']:.1f} / {1e3 * ms['cublas']:.1f}"
            print(f"{n:>6} {m:>4} {k:>6} {k * n * 2 / 1e6:>10.1f} {bench:>16} "
                  f"{f'{graph_quack:.1f} / {graph_cublas:.1f}':>16}", flush=True)


def once_each() -> None:
    calls = []
    for k, n in ((4096, 4096), (14336, 4096)):
        b = torch.randn(1, k, n, device="cuda", dtype=torch.bfloat16) / k**0.5
        for m in (16, 128):
            a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            calls += [(f"{k}x{n} M={m} quack", lambda a=a, b=b: quack.gemm(a, b[0])),
                      (f"{k}x{n} M={m} cuBLAS", lambda a=a, b=b: a @ b[0])]
            if m <= SMALL_M_ROWS:
                out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
                cfg = gemm_config(n, m_class="small_m")
                calls += [(f"{k}x{n} M={m} {s} splits", lambda a=a, b=b, out=out, cfg=cfg, s=s:
                           launch_gemm(a, b, out, None, True, cfg, splits=s)) for s in (1, 4)]
    for _, call in calls:  # loads and first-call setup, outside the profiled range
        call()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for name, call in calls:
        print("profiled:", name, flush=True)
        call()
        torch.cuda.synchronize()
    torch.cuda.profiler.stop()


def timeline() -> None:
    from torch.profiler import ProfilerActivity, profile

    for k, n, m in ((4096, 4096, 16), (4096, 4096, 128), (14336, 4096, 16)):
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        weights = [torch.randn(k, n, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(6)]
        contenders = {"quack": lambda b: quack.gemm(a, b), "cuBLAS": lambda b: a @ b}
        for call in contenders.values():  # loads and first-call setup, outside the profile
            call(weights[0])
        torch.cuda.synchronize()
        for name, call in contenders.items():
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                torch.cuda._sleep(2_000_000)
                for b in weights:
                    call(b)
                torch.cuda.synchronize()
            on_gpu = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                             and "sleep" not in e.name), key=lambda e: e.time_range.start)
            ops, previous_end = [], None
            for e in on_gpu:
                gap = "" if previous_end is None else f" after {e.time_range.start - previous_end:.1f}"
                ops.append(f"{e.name[:32]} {e.time_range.end - e.time_range.start:.1f}{gap}")
                previous_end = e.time_range.end
            span = on_gpu[-1].time_range.end - on_gpu[0].time_range.start
            print(f"{k}x{n} M={m} {name}: {len(on_gpu)} GPU ops in {span:.1f} us, {span / len(weights):.1f} per call")
            print("   " + " | ".join(ops[:8]))
            api: dict[str, list[float]] = {}
            for e in prof.events():
                if e.device_type != torch.autograd.DeviceType.CUDA and (e.name.startswith("cu") or "Launch" in e.name):
                    api.setdefault(e.name, []).append(e.time_range.end - e.time_range.start)
            print("   API: " + ", ".join(f"{call_name} x{len(t)} {sum(t) / len(t):.1f} us" for call_name, t in api.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ncu", action="store_true", help="each call once between profiler start and stop")
    parser.add_argument("--timeline", action="store_true", help="the GPU's timeline of back-to-back calls")
    args = parser.parse_args()
    if args.ncu:
        once_each()
    elif args.timeline:
        timeline()
    else:
        sweep()


if __name__ == "__main__":
    main()
