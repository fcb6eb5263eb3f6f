"""Threads of the Hopper GEMM's CTAs, on the host and without the CuTe DSL:
the kernel (``quack/families/gemm/kernel.py``) is built with them and a call sizes
its persistent grid with them (``quack/families/gemm/config.py``)."""

THREADS_PER_WARPGROUP = 128


def cta_threads(tile_m: int) -> int:
    """Threads of a CTA: the producer warpgroup and one consumer per 64 rows."""
    return THREADS_PER_WARPGROUP * (1 + tile_m // 64)
