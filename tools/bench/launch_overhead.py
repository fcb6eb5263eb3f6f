"""What a call costs on the CPU, against the torch op it replaces, and what a cold start costs.

    QUACK_CACHE_PATH=<objects> python tools/bench/launch_overhead.py [--calls N] [--no-cold]

Per-call table: each eager op (no grad) at a decode-sized shape beside its torch
op, then the raw cached launch (the handle, preallocated outputs), the same
object's entry point called from C with no packing (``FastLauncher.bare``: the
floor), the CuTe DSL's own call path, the eager fast path's parts (its direct
launcher, its key, an output's allocation), ``torch.add(out=)``, and softmax's
call layer by layer (the op, its table's call, the C dispatch, the closure, the
direct launcher) beside ``torch.softmax``.  Calls are timed
in batches of 200 on the CPU clock only, with a synchronize between batches
(untimed), so the GPU queue never fills and throttles the loop.  The header says
which launcher ran (C or ctypes).

Cold start (each in a fresh interpreter): ``import torch``; ``import quack``;
a family's module import; the first call of each family once torch has made
the CUDA context, with the cache's verify and load times (of the load, the
DSL runtime's C loader's two stages); its second call; whether the process
imported the CuTe DSL's Python package, and that import's cost, timed after;
then an fp16 call in the same process: the stages of an object loaded once the
runtime library is open (what every load after a family's first costs).  Run
against objects that hold every kernel here (the
Bazel-built bundle): a miss would time a compile, so the cold runs are strict.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path.insert(0, REPO)

BATCH = 200


def per_call_us(fn, calls: int) -> float:
    import torch

    for _ in range(BATCH):
        fn()
    torch.cuda.synchronize()
    elapsed = 0.0
    for _ in range(max(1, calls // BATCH)):
        start = time.perf_counter()
        for _ in range(BATCH):
            fn()
        elapsed += time.perf_counter() - start
        torch.cuda.synchronize()
    return elapsed / (max(1, calls // BATCH) * BATCH) * 1e6


def op_pairs(gemm_k: int = 4096, gemm_m: int = 16):
    """(label, quack call, torch call) at decode-sized shapes, where the launch
    is most of the cost (the GEMM's M and K pick its object: up to 64 rows the
    small-M split-K one, whatever K; from 513 rows the default one)."""
    import torch
    import torch.nn.functional as F

    import quack

    def randn(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, device="cuda", dtype=dtype)

    x1, w = randn(1, 4096), randn(4096)
    x8, b = randn(8, 4096), randn(4096)
    target = torch.randint(0, 4096, (8,), device="cuda")
    a, bm = randn(gemm_m, gemm_k), randn(gemm_k, 4096)
    return [
        ("rmsnorm (1, 4096), bf16 weight", lambda: quack.rmsnorm(x1, w), lambda: F.rms_norm(x1, (4096,), w)),
        ("softmax (8, 4096)", lambda: quack.softmax(x8), lambda: torch.softmax(x8, -1)),
        ("layernorm (8, 4096)", lambda: quack.layernorm(x8, w, b), lambda: F.layer_norm(x8, (4096,), w, b)),
        ("cross_entropy (8, 4096), mean", lambda: quack.cross_entropy(x8, target),
         lambda: F.cross_entropy(x8, target)),
        (f"gemm ({gemm_m}, {gemm_k}) x ({gemm_k}, 4096)", lambda: quack.gemm(a, bm), lambda: torch.matmul(a, bm)),
    ]


def raw_rows():
    """The raw launch of one cached object, its floor and the DSL's call path, beside torch.add."""
    import torch

    import quack.calls.torch_interop as ti
    from quack.families.rmsnorm.op import compile_rmsnorm_fwd

    x = torch.randn(8, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    y, rstd = torch.empty_like(x), torch.empty(8, device="cuda")
    stream = ti.current_stream(x.device)
    kernel = compile_rmsnorm_fwd("bfloat16", "bfloat16", False, 4096, 8)
    kernel(x, w, None, y, None, rstd, 1e-6, stream)
    fast = kernel._fn  # the FastLauncher of the object loaded on this device
    rows = [("raw cached launch, rmsnorm fwd (8, 4096)", lambda: kernel(x, w, None, y, None, rstd, 1e-6, stream))]
    bare = fast.bare
    rows.append(("  its entry point from C, no packing", (lambda: bare(BATCH), BATCH) if fast._c else None))
    if fast._fn is not None:  # loaded by the DSL's load_module (not by the runtime's C loader)
        import cuda.bindings.driver as cuda
        from cutlass import Float32

        cu_stream = cuda.CUstream(stream)
        dsl_fn = fast._fn
        rows.append(("  same object, CuTe DSL call path",
                     lambda: dsl_fn(x, w, None, y, None, rstd, Float32(1e-6), cu_stream)))
    # What the eager fast path (quack/calls/fastpath.py) spends per call, part by part.
    direct = kernel.direct(x.device.index, frozenset((0, 2, 3, 4)))
    rows.append(("  direct launcher (the fast path's)", lambda: direct(x, w, None, y, None, rstd, 1e-6, None)))
    from quack.calls import fastpath

    rows.append(("  fast path key (describe x, w, None)", lambda: fastpath.describe(x, w, None)))
    rows.append(("  torch.empty_like(x)", lambda: torch.empty_like(x)))
    rows.append(("torch.add(x, x, out=y)", lambda: torch.add(x, x, out=y)))
    rows.extend(softmax_rows())
    return rows


def softmax_rows():
    """quack.softmax (8, 4096) through the fast path's layers, outermost first:
    the op; its table's call (the fast path's checks in Python); the C
    dispatch (describe, look up, run the closure); the closure (allocate,
    launch); the direct launcher alone."""
    import importlib

    import torch

    from quack.calls import fastpath

    op = importlib.import_module("quack.families.softmax.op")
    x = torch.randn(8, 4096, device="cuda", dtype=torch.bfloat16)
    y = op.softmax(x)
    table = op._FAST._by_key
    if not table:
        return [("softmax's fast path", None)]
    closure, dispatch = next(iter(table.values())), fastpath._c_module().dispatch
    launch = fastpath.direct(op.plan_for(op.call_signature(x, False)), "forward", x.device)
    return [
        ("softmax (8, 4096), part by part", lambda: op.softmax(x)),
        ("  its table's call (_FAST.call)", lambda: op._FAST.call(1, x)),
        ("  the C dispatch", lambda: dispatch(table, False, 1, x)),
        ("  the closure: allocate, launch", lambda: closure(x)),
        ("  the direct launcher alone", lambda: launch(x, y, None)),
        ("  torch.softmax(x, -1)", lambda: torch.softmax(x, -1)),
    ]


def bare_us(fn_batch, calls: int) -> float:
    """``bare(n)`` returns seconds for n calls made from C."""
    import torch

    fn, n = fn_batch
    total, done = 0.0, 0
    while done < calls:
        total += fn()
        done += n
        torch.cuda.synchronize()
    return total / done * 1e6


_COLD = r"""
import json, sys, time
t0 = time.perf_counter(); import torch; t1 = time.perf_counter()
import quack; t2 = time.perf_counter()
torch.empty(1, device="cuda"); torch.cuda.synchronize(); t3 = time.perf_counter()
import importlib; family_module = importlib.import_module("quack.{family}"); t4 = time.perf_counter()
from quack import cache
x = torch.randn(8, 4096, device="cuda", dtype=torch.bfloat16)
w = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
call = {call}
torch.cuda.synchronize(); t5 = time.perf_counter()
call(); torch.cuda.synchronize(); t6 = time.perf_counter()
call(); torch.cuda.synchronize(); t7 = time.perf_counter()
first = cache.stats()
x, w = x.half(), w.half()  # another object of the family: a load with the runtime library already open
try:
    call(); torch.cuda.synchronize()
except Exception:  # not among the objects (strict): no figure
    pass
dsl_imported = "cutlass" in sys.modules
import cutlass.cute; t8 = time.perf_counter()
s = cache.stats()
assert s["compiles"] == 0
later = dict((k, s[k] - first[k]) for k in ("verify_seconds", "load_seconds", "runtime_create_seconds",
                                             "runtime_function_seconds"))
print(json.dumps(dict(import_torch=t1 - t0, import_quack=t2 - t1, cuda_context=t3 - t2, import_family=t4 - t3,
                      first_call=t6 - t5, second_call=t7 - t6, dsl_imported=dsl_imported, import_dsl=t8 - t7,
                      loads=sum(v for k, v in first["hits"].items() if k != "memory"),
                      verify=first["verify_seconds"], load=first["load_seconds"],
                      create=first["runtime_create_seconds"], function=first["runtime_function_seconds"],
                      later_loads=sum(v for k, v in s["hits"].items() if k != "memory") - sum(
                          v for k, v in first["hits"].items() if k != "memory"),
                      later_verify=later["verify_seconds"], later_load=later["load_seconds"],
                      later_create=later["runtime_create_seconds"], later_function=later["runtime_function_seconds"])))
"""

_COLD_CALLS = {
    "rmsnorm": "lambda: family_module.rmsnorm(x, w)",
    "softmax": "lambda: family_module.softmax(x)",
    "layernorm": "lambda: family_module.layernorm(x, w, w)",
    "cross_entropy": "lambda: family_module.cross_entropy(x, torch.zeros(8, dtype=torch.long, device='cuda'))",
    "gemm": "lambda: family_module.gemm(x, torch.randn(4096, 4096, device='cuda', dtype=torch.bfloat16))",
}


def cold_start() -> None:
    env = dict(os.environ, QUACK_CACHE_STRICT="1", PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get(
        "PYTHONPATH")])))
    print("\ncold start, fresh interpreter each (seconds; strict: every kernel from the cache); 'DSL' is whether the"
          "\nprocess imported the CuTe DSL's Python package by its second call, 'DSL import' that import's cost,"
          "\ntimed after the calls for reference")
    print(f"  {'family':<14} {'torch':>6} {'quack':>6} {'ctx':>6} {'module':>7} {'1st call':>9} {'verify':>7} "
          f"{'load':>7} {'create':>7} {'funct.':>7} {'loads':>5} {'2nd call':>9} {'DSL':>5} {'DSL import':>10}")
    later = []
    for family, call in _COLD_CALLS.items():
        done = subprocess.run([sys.executable, "-c", _COLD.format(family=family, call=call)], env=env,
                              capture_output=True, text=True)
        if done.returncode != 0:
            print(f"  {family:<14} failed: {done.stderr.strip().splitlines()[-1]}")
            continue
        r = dict(json.loads(done.stdout.strip().splitlines()[-1]), family=family)
        print(f"  {family:<14} {r['import_torch']:6.2f} {r['import_quack']:6.3f} {r['cuda_context']:6.2f} "
              f"{r['import_family']:7.3f} {r['first_call']:9.4f} {r['verify']:7.4f} {r['load']:7.4f} "
              f"{r['create']:7.4f} {r['function']:7.4f} {r['loads']:5d} {r['second_call']:9.5f} "
              f"{str(r['dsl_imported']):>5} {r['import_dsl']:10.2f}")
        later.append(r)
    print("\nthe same processes' fp16 call after those: objects loaded with the runtime library already open"
          "\n(ms per object; 'ours' is the load less the DSL runtime's two calls)")
    print(f"  {'family':<14} {'loads':>5} {'verify':>7} {'load':>7} {'create':>7} {'funct.':>7} {'ours':>7}")
    for r in later:
        if not r["later_loads"]:
            print(f"  {r['family']:<14} no fp16 object in the cache")
            continue
        n = r["later_loads"]
        ours = r["later_load"] - r["later_create"] - r["later_function"]
        print(f"  {r['family']:<14} {r['later_loads']:5d} {1e3 * r['later_verify'] / n:7.3f} "
              f"{1e3 * r['later_load'] / n:7.3f} {1e3 * r['later_create'] / n:7.3f} "
              f"{1e3 * r['later_function'] / n:7.3f} {1e3 * ours / n:7.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=10_000)
    parser.add_argument("--no-cold", action="store_true", help="skip the fresh-interpreter cold starts")
    args = parser.parse_args()

    import torch

    from quack.launch.launcher import launcher_kind

    print(f"per-call CPU time (us), {args.calls} calls in batches of {BATCH}; launcher: {launcher_kind()}; "
          f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    print(f"  {'call':<40} {'quack':>8} {'torch':>8} {'ratio':>6}")
    with torch.no_grad():
        for label, ours, theirs in op_pairs():
            q, t = per_call_us(ours, args.calls), per_call_us(theirs, args.calls)
            print(f"  {label:<40} {q:8.2f} {t:8.2f} {q / t:6.2f}")
        for label, fn in raw_rows():
            if fn is None:
                print(f"  {label:<40} {'(no C launcher)':>8}")
            elif isinstance(fn, tuple):
                print(f"  {label:<40} {bare_us(fn, args.calls):8.2f}")
            else:
                print(f"  {label:<40} {per_call_us(fn, args.calls):8.2f}")
    if not args.no_cold:
        cold_start()


if __name__ == "__main__":
    main()
