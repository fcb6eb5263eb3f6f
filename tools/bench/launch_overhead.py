"""Per-call CPU cost of launching a cached kernel, against torch's own eager dispatch.

    python tools/bench/launch_overhead.py

10,000 back-to-back calls at a tiny shape, bf16 (8, 4096), timed on the CPU
(the GPU work per call is far shorter than the launch):

* raw cached kernel: the handle the cache returns, called with preallocated
  outputs (quack's fast launcher: arguments packed into one buffer, the
  object's C entry point called directly);
* the CuTe DSL's own call path for the same loaded object (DLPack conversion
  of every tensor on each call), for comparison;
* ``quack.rmsnorm(x, w)``: the public op, eager, no grad (validation,
  allocation, lookup, launch);
* ``torch.nn.functional.rms_norm(x, (4096,), w)`` and ``torch.add(out=)``.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import quack  # noqa: E402
import quack.torch_interop as ti  # noqa: E402
from quack.rmsnorm import compile_rmsnorm_fwd  # noqa: E402

CALLS = 10_000


def per_call_us(fn) -> float:
    for _ in range(500):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(CALLS):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / CALLS * 1e6


def main() -> None:
    x = torch.randn(8, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    rstd = torch.empty(8, device="cuda")
    stream = ti.current_stream(x.device)
    kernel = compile_rmsnorm_fwd("bfloat16", "bfloat16", False, 4096, 8)
    dsl_fn = kernel._fn._fn  # the JitCompiledFunction the fast launcher wraps
    import cuda.bindings.driver as cuda
    from cutlass import Float32

    cu_stream = cuda.CUstream(stream)
    rows = [
        ("raw cached kernel (fast launcher)", lambda: kernel(x, w, None, y, None, rstd, 1e-6, stream)),
        ("same object, CuTe DSL call path", lambda: dsl_fn(x, w, None, y, None, rstd, Float32(1e-6), cu_stream)),
        ("quack.rmsnorm(x, w), eager", lambda: quack.rmsnorm(x, w)),
        ("F.rms_norm(x, (4096,), w)", lambda: F.rms_norm(x, (4096,), w)),
        ("torch.add(x, x, out=y)", lambda: torch.add(x, x, out=y)),
    ]
    print(f"per-call CPU time, {CALLS} back-to-back calls, bf16 (8, 4096)")
    for name, fn in rows:
        print(f"  {name:<36} {per_call_us(fn):8.2f} us")


if __name__ == "__main__":
    main()
