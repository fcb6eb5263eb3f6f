"""Cache lookup + load against compile + export, per kernel, in one process.

    CUTE_DSL_DISABLE_FILE_CACHING=1 python tools/bench/cache_load.py [--family rmsnorm|gemm]

For each configuration of the family: compile and export it into a fresh writable
layer (timed), drop the in-process memory, then look it up again so it is
loaded from disk (timed).  Both after ``import cutlass`` (seconds, paid once)
and after the family's source hash is known: hashing the family's sources
(parsing its import closure) is paid once per family and process, and is
reported on its own line.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

os.environ["QUACK_CACHE_DIR"] = tempfile.mkdtemp(prefix="quack-load-bench-")
os.environ.pop("QUACK_CACHE_PATH", None)
os.environ.pop("QUACK_CACHE_STRICT", None)

import cutlass  # noqa: E402,F401

from quack import cache  # noqa: E402
from quack.cache.source_hash import module_source_hash  # noqa: E402
from quack.families.gemm.config import GemmConfig, gemm_config  # noqa: E402
from quack.families.gemm.signature import compile_gemm  # noqa: E402
from quack.families.rmsnorm.op import compile_rmsnorm_bwd, compile_rmsnorm_fwd  # noqa: E402

CONFIGS = {
    "rmsnorm": [
        (compile_rmsnorm_fwd, ("bfloat16", "bfloat16", False, 4096, 8)),
        (compile_rmsnorm_fwd, ("bfloat16", "bfloat16", True, 65536, 8)),
        (compile_rmsnorm_fwd, ("float32", None, False, 262144, 4)),
        (compile_rmsnorm_bwd, ("bfloat16", "bfloat16", False, 16384, 8)),
        (compile_rmsnorm_bwd, ("float16", "float32", True, 4097, 1)),
    ],
    "gemm": [
        (compile_gemm, ("bfloat16", "bfloat16", False, True, "dense", None, None, False, tuple(GemmConfig()))),
        (compile_gemm, ("bfloat16", "bfloat16", False, False, "dense", None, None, False, tuple(GemmConfig()))),
        (compile_gemm, ("bfloat16", "bfloat16", False, True, "varlen_m", None, None, False, tuple(gemm_config(4096, 512.0)))),
        (compile_gemm, ("float16", "float16", False, True, "dense", None, None, False, tuple(gemm_config(128)))),
    ],
}


def main() -> None:
    family = sys.argv[sys.argv.index("--family") + 1] if "--family" in sys.argv else "rmsnorm"
    t0 = time.perf_counter()
    module_source_hash(f"quack.families.{family}.op")
    print(f"source hash of the {family} family (once per process): {(time.perf_counter() - t0) * 1e3:.1f} ms")
    print(f"{'kernel':<70}{'compile+export ms':>18}{'lookup+load ms':>16}{'ratio':>8}")
    ratios = []
    for fn, args in CONFIGS[family]:
        t0 = time.perf_counter()
        fn(*args)
        compile_ms = (time.perf_counter() - t0) * 1e3
        cache.clear()
        module_source_hash(f"quack.families.{family}.op")  # per family, not per kernel: see above
        t0 = time.perf_counter()
        fn(*args)
        load_ms = (time.perf_counter() - t0) * 1e3
        ratios.append(compile_ms / load_ms)
        print(f"{fn.__name__ + str(args):<70}{compile_ms:>18.1f}{load_ms:>16.2f}{ratios[-1]:>7.0f}x")
    print(f"min ratio {min(ratios):.0f}x; stats: {cache.stats()}")


if __name__ == "__main__":
    main()
