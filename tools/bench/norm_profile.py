"""Per-kernel GPU time of the norm kernels at the standard shapes (GPU only).

    python tools/bench/norm_profile.py            # torch.profiler: the kernel and the partial sums apart
    ncu --section SpeedOfLight ... -k regex:quack python tools/bench/norm_profile.py --once

LayerNorm and RMSNorm forward and backward, bf16 x, with an fp32 and a bf16
weight: one JSON line per call with the average time of each kernel it
launches (the backward's partial-row sums are torch kernels of their own).
``--once`` launches each call once at 32768x4096 and 4096x262144, for ncu.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from harness import STANDARD_SHAPES  # noqa: E402

ln, rms = (importlib.import_module(f"quack.families.{name}.op") for name in ("layernorm", "rmsnorm"))
REPEATS = 20


def calls(x: torch.Tensor, w: torch.Tensor) -> dict:
    dy = torch.randn_like(x)
    _, mean, ln_rstd = ln.layernorm_fwd(x, w, w)
    _, _, rms_rstd = rms.rmsnorm_fwd(x, w)
    return {
        "layernorm fwd": lambda: ln.layernorm_fwd(x, w, w, store_stats=False),
        "layernorm bwd": lambda: ln.layernorm_bwd(x, w, dy, mean, ln_rstd, True),
        "rmsnorm fwd": lambda: rms.rmsnorm_fwd(x, w),
        "rmsnorm bwd": lambda: rms.rmsnorm_bwd(x, w, dy, rms_rstd, eps=1e-6),
    }


def kernel_us(fn) -> dict[str, float]:
    """Average GPU time of each kernel one call of ``fn`` launches."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(REPEATS):
            fn()
        torch.cuda.synchronize()
    times: dict[str, float] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            times[event.name] = times.get(event.name, 0.0) + event.device_time / REPEATS
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--once", action="store_true", help="one launch of each call at two shapes (for ncu)")
    args = parser.parse_args()
    shapes = [STANDARD_SHAPES[0], STANDARD_SHAPES[-1]] if args.once else STANDARD_SHAPES
    for m, n in shapes:
        x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        for w_dtype in (torch.float32, torch.bfloat16):
            w = torch.randn(n, device="cuda", dtype=w_dtype)
            for name, fn in calls(x, w).items():
                if args.once:
                    fn()
                    continue
                times = kernel_us(fn)
                print(json.dumps(dict(call=name, weight=str(w_dtype), shape=f"{m}x{n}", total_us=sum(times.values()),
                                      kernels=times)))
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
