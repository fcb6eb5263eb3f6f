"""Every row-wise kernel at the standard shapes, as a share of copy bandwidth (GPU only).

    python tools/bench/rowwise_all.py [--dtype bfloat16 float16] [--only bandwidth|decode]

One bandwidth table per activation dtype, quack's kernels only (and the same
cells in us): the quick
check after a change to the shared row-wise code (quack/rowwise/device.py,
quack/rowwise/norm_backward.py), where the family scripts (softmax.py, ...) also time
torch eager and torch.compile.  Bytes as the family scripts count them; the
copy is measured in the same process.

Then a table of decode-sized calls (1 to 64 rows at N = 4096 and 8192) beside
the torch op: the whole eager call's cost on the CPU clock (what a decode step
pays per call: at these sizes the kernel is shorter than the call) and the
kernel time from ``do_bench``.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402

from harness import STANDARD_SHAPES, bench_ms, copy_bandwidth  # noqa: E402
from launch_overhead import per_call_us  # noqa: E402

import quack  # noqa: E402
from quack.rowwise import partial_sums  # noqa: E402

DECODE_ROWS = (1, 2, 4, 8, 16, 32, 64)
DECODE_N = (4096, 8192)

# The modules, not the package's same-named functions.
ce_mod, ln_mod, rms_mod, sm_mod = (
    importlib.import_module(f"quack.families.{name}.op") for name in ("cross_entropy", "layernorm", "rmsnorm", "softmax")
)


def partial_sum_bytes(call) -> int:
    """Bytes of a norm backward's fp32 weight-gradient partial rows in one
    call: each written by the kernel and read back by the sum (BENCHMARKS.md
    counts them)."""
    allocated = []
    allocate = partial_sums.partial_rows

    def recording(*args, **kwargs):
        allocated.append(allocate(*args, **kwargs))
        return allocated[-1]

    partial_sums.partial_rows = recording
    try:
        call()
    finally:
        partial_sums.partial_rows = allocate
    return sum(2 * p.numel() * p.element_size() for p in allocated)


def kernels(m: int, n: int, dtype: torch.dtype) -> dict:
    """name -> (launcher, bytes moved) for one shape."""
    x = torch.randn(m, n, device="cuda", dtype=dtype)
    dy = torch.randn_like(x)
    target = torch.randint(0, n, (m,), device="cuda")
    y = sm_mod.softmax_fwd(x)
    two = 2 * x.numel() * x.element_size()  # one (M, N) tensor in, one out
    cases = {
        "softmax fwd": (lambda: sm_mod.softmax_fwd(x), two),
        "softmax bwd": (lambda: sm_mod.softmax_bwd(y, dy), 3 * two // 2),
        "cross-entropy fwd": (lambda: ce_mod.cross_entropy_fwd(x, target), two // 2),
    }
    # The norms without a weight, with a weight (and bias) of x's dtype, and
    # with fp32 ones beside 16-bit activations (the usual mixed-precision setup).
    weight_dtypes = {" no w": None, "": dtype}
    if dtype != torch.float32:
        weight_dtypes[" w32"] = torch.float32
    for tag, w_dtype in weight_dtypes.items():
        w = torch.randn(n, device="cuda", dtype=w_dtype) if w_dtype is not None else None
        _, _, rstd = rms_mod.rmsnorm_fwd(x, w)
        _, mean, ln_rstd = ln_mod.layernorm_fwd(x, w, w)
        ln_bwd = lambda w=w, mean=mean, s=ln_rstd: ln_mod.layernorm_bwd(x, w, dy, mean, s, w is not None)  # noqa: E731
        rms_bwd = lambda w=w, s=rstd: rms_mod.rmsnorm_bwd(x, w, dy, s, eps=1e-6)  # noqa: E731
        cases.update({
            f"layernorm fwd{tag}": (lambda w=w: ln_mod.layernorm_fwd(x, w, w, store_stats=False), two),
            f"layernorm bwd{tag}": (ln_bwd, 3 * two // 2 + partial_sum_bytes(ln_bwd)),
            f"rmsnorm fwd{tag}": (lambda w=w: rms_mod.rmsnorm_fwd(x, w), two),
            f"rmsnorm bwd{tag}": (rms_bwd, 3 * two // 2 + partial_sum_bytes(rms_bwd)),
        })
    return cases


def bandwidth_table(dtype: torch.dtype, copy_tbs: float) -> None:
    shares: dict[str, list[float]] = {}
    times: dict[str, list[float]] = {}
    for m, n in STANDARD_SHAPES:
        for name, (fn, nbytes) in kernels(m, n, dtype).items():
            ms = bench_ms(fn)
            times.setdefault(name, []).append(1e3 * ms)
            shares.setdefault(name, []).append(100 * nbytes / (ms * 1e-3) / 1e12 / copy_tbs)
        torch.cuda.empty_cache()
    header = f"{'kernel':<20}" + "".join(f"{f'{m}x{n}':>14}" for m, n in STANDARD_SHAPES)
    print(f"\n% of copy bandwidth ({copy_tbs:.2f} TB/s), {dtype}")
    print(header)
    for name, values in shares.items():
        print(f"{name:<20}" + "".join(f"{v:>13.0f}%" for v in values))
    # The times compare two trees' kernels whatever bytes each tree's script counted.
    print(f"\nkernel us (do_bench median), {dtype}")
    print(header)
    for name, values in times.items():
        print(f"{name:<20}" + "".join(f"{v:>14.1f}" for v in values))


def decode_calls(m: int, n: int, dtype: torch.dtype) -> dict:
    """name -> (quack call, torch call) for one decode-sized shape, inference as a decode step runs it."""
    x = torch.randn(m, n, device="cuda", dtype=dtype)
    w = torch.randn(n, device="cuda", dtype=dtype)
    w32 = w.float()
    b32 = torch.randn(n, device="cuda")
    f = torch.nn.functional
    return {
        "rmsnorm": (lambda: quack.rmsnorm(x, w, eps=1e-6), lambda: f.rms_norm(x, (n,), w, eps=1e-6)),
        # torch's rms_norm wants one dtype: the fp32 weight applied after, as mixed-precision models do
        "rmsnorm w32": (lambda: quack.rmsnorm(x, w32, eps=1e-6),
                        lambda: (f.rms_norm(x.float(), (n,), eps=1e-6) * w32).to(dtype)),
        "layernorm w32": (lambda: quack.layernorm(x, w32, b32, eps=1e-5),
                          lambda: f.layer_norm(x.float(), (n,), w32, b32, eps=1e-5).to(dtype)),
        "softmax": (lambda: quack.softmax(x), lambda: torch.softmax(x, -1)),
    }


def decode_table(dtype: torch.dtype, calls: int = 2000) -> None:
    print(f"\ndecode-sized calls, {dtype}, inference: us per call on the CPU clock (the whole eager call) "
          "and kernel us (do_bench), quack / torch")
    print(f"{'call':<16}{'rows x N':>12}{'call us':>20}{'kernel us':>20}")
    with torch.inference_mode():
        for n in DECODE_N:
            for m in DECODE_ROWS:
                for name, (ours, theirs) in decode_calls(m, n, dtype).items():
                    call = f"{per_call_us(ours, calls):.1f} / {per_call_us(theirs, calls):.1f}"
                    kernel = f"{1e3 * bench_ms(ours):.1f} / {1e3 * bench_ms(theirs):.1f}"
                    print(f"{name:<16}{f'{m}x{n}':>12}{call:>20}{kernel:>20}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", nargs="+", default=["bfloat16", "float16"], choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--only", choices=["bandwidth", "decode"], help="print these tables alone")
    args = parser.parse_args()
    dtypes = [getattr(torch, name) for name in args.dtype]
    if args.only != "decode":
        copy_tbs = copy_bandwidth()
        for dtype in dtypes:
            bandwidth_table(dtype, copy_tbs)
    if args.only != "bandwidth":
        for dtype in dtypes:
            decode_table(dtype)


if __name__ == "__main__":
    main()
