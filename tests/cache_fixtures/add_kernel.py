"""Elementwise ``c = a + b`` over a (sym M, N) row-major tensor: one block per row,
one thread per column. Small enough to compile in well under a second, real enough
to export a genuine object.

Setting ``QUACK_TEST_COMPILE_LOG`` to a file path makes every real compile append
a line to it, so tests can count compiles across processes.
"""

import os

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute

import quack.cache

from .shapes import THREADS_PER_ROW

_DTYPES = {"float32": cutlass.Float32, "float16": cutlass.Float16}


@cute.kernel
def _add_kernel(mA: cute.Tensor, mB: cute.Tensor, mC: cute.Tensor):
    row, _, _ = cute.arch.block_idx()
    col, _, _ = cute.arch.thread_idx()
    mC[row, col] = mA[row, col] + mB[row, col]


@cute.jit
def _add(mA: cute.Tensor, mB: cute.Tensor, mC: cute.Tensor, stream: cuda.CUstream):
    _add_kernel(mA, mB, mC).launch(grid=[mA.shape[0], 1, 1], block=[mA.shape[1], 1, 1], stream=stream)


@quack.cache.jit_cache("test_add")
def compile_add(n: int = THREADS_PER_ROW, dtype: str = "float32"):
    log = os.environ.get("QUACK_TEST_COMPILE_LOG")
    if log:
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\n")
    fakes = [
        cute.runtime.make_fake_compact_tensor(
            _DTYPES[dtype], (cute.sym_int(), n), stride_order=(1, 0), assumed_align=16
        )
        for _ in range(3)
    ]
    return cute.compile(
        _add, *fakes, cute.runtime.make_fake_stream(), options=quack.cache.compile_options()
    )
