"""The Hopper GEMM against torch, dense and grouped (variable-length M), on the GPU.

Run: ``pytest tests/test_gemm.py`` (needs an sm_90 GPU), or
``pytest --compile-only tests/test_gemm.py`` to compile and export every
object these tests use without one.  One object per (dtypes, B layout, dense
or varlen, tile config) serves every size below: the dims are dynamic.
"""

import pytest
import torch

import quack
from quack.gemm import gemm_ref

pytestmark = pytest.mark.gpu


def _randn(*shape, dtype=torch.bfloat16):
    return torch.randn(*shape, device="cuda", dtype=dtype)


def _close(out, ref):
    # fp32 accumulation in a different order, one rounding to 16 bits.
    torch.testing.assert_close(out.float(), ref.float(), atol=5e-2, rtol=2e-2)


def _cu(lengths):
    """cu_seqlens from group lengths; the total comes back through .item()
    (a sentinel under --compile-only, as in user test code)."""
    lens = torch.tensor(lengths, device="cuda", dtype=torch.int32)
    cu = torch.nn.functional.pad(torch.cumsum(lens, 0, dtype=torch.int32), (1, 0))
    return cu, int(lens.sum().item())


# M, N, K: tile multiples, ragged edges in every dim, one row, one tile, N < 128.
DENSE_SHAPES = [
    (256, 256, 64),
    (1, 8, 8),
    (129, 264, 72),
    (1000, 1000, 1000),
    (4096, 4096, 4096),
    (333, 128, 4104),
    (8, 4096, 512),
]


@pytest.mark.parametrize("m,n,k", DENSE_SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dense(m, n, k, dtype):
    torch.manual_seed(0)
    a, b = _randn(m, k, dtype=dtype), _randn(k, n, dtype=dtype)
    _close(quack.gemm(a, b), gemm_ref(a, b))


@pytest.mark.parametrize("m,n,k", [(300, 520, 136), (4096, 1024, 2048)])
def test_dense_column_major_b(m, n, k):
    torch.manual_seed(0)
    a = _randn(m, k)
    b = _randn(n, k).t()  # (K, N), K contiguous
    _close(quack.gemm(a, b), gemm_ref(a, b))


def test_out_dtype_and_strided_a():
    torch.manual_seed(0)
    big = _randn(100, 256)
    a = big.as_strided((100, 128), (256, 1))  # not contiguous, TMA-compatible
    b = _randn(128, 64)
    out = quack.gemm(a, b, out_dtype=torch.float16)
    assert out.dtype == torch.float16
    _close(out, gemm_ref(a, b, torch.float16))


@pytest.mark.no_compile_only  # launches nothing; compares values
def test_zero_k_and_empty():
    a, b = _randn(16, 0), _randn(0, 32)
    assert torch.equal(quack.gemm(a, b), torch.zeros(16, 32, device="cuda", dtype=torch.bfloat16))
    assert quack.gemm(_randn(0, 64), _randn(64, 32)).shape == (0, 32)


GROUPS = [
    [2048] * 8,
    [1, 0, 300, 129, 0, 0, 1000, 7],  # empty groups, partial tiles
    [0, 0, 0],  # total_M = 0
    [513],
    [100, 37] * 32,  # 64 groups: the scan crosses several hundred items
    [256, 7] * 16,  # whole-tile (TMA) and predicated stores alternating, with a short K loop
]


@pytest.mark.parametrize("lengths", GROUPS, ids=lambda g: f"G{len(g)}-M{sum(g)}")
@pytest.mark.parametrize("n,k", [(256, 128), (520, 72)])
def test_varlen(lengths, n, k):
    torch.manual_seed(0)
    cu, total_m = _cu(lengths)
    a = _randn(total_m, k)
    b = _randn(len(lengths), k, n)
    out = quack.gemm(a, b, cu_seqlens_m=cu)
    assert out.shape == (total_m, n)
    _close(out, gemm_ref(a, b, cu_seqlens_m=cu))


def test_varlen_column_major_b():
    torch.manual_seed(0)
    cu, total_m = _cu([200, 0, 333])
    a = _randn(total_m, 256)
    b = _randn(3, 512, 256).transpose(1, 2)  # (G, K, N), K contiguous
    _close(quack.gemm(a, b, cu_seqlens_m=cu), gemm_ref(a, b, cu_seqlens_m=cu))


def test_varlen_leaves_rows_outside_groups_alone():
    # Rows past cu[G] belong to no group: the kernel must not write them.
    torch.manual_seed(0)
    cu = torch.tensor([0, 100, 190], device="cuda", dtype=torch.int32)
    a, b = _randn(256, 64), _randn(2, 64, 128)
    out = quack.gemm(a, b, cu_seqlens_m=cu)
    _close(out.narrow(0, 0, 190), gemm_ref(a.narrow(0, 0, 190), b, cu_seqlens_m=cu))


def test_varlen_groups_past_the_end_of_a():
    # cu[G] > total_M (a caller bug): rows past A's end are neither read nor
    # written out of bounds; the rows that exist are still right.
    torch.manual_seed(0)
    cu = torch.tensor([0, 300], device="cuda", dtype=torch.int32)
    a, b = _randn(200, 64), _randn(1, 64, 256)
    out = quack.gemm(a, b, cu_seqlens_m=cu)
    _close(out, gemm_ref(a, b.select(0, 0)))


@pytest.mark.no_compile_only  # torch.compile refuses the fake-tensor mode; test_dense warms the object
def test_torch_compile_fullgraph():
    torch.manual_seed(0)
    a, b = _randn(300, 256), _randn(256, 512)
    fn = torch.compile(lambda x, y: quack.gemm(x, y) * 2, fullgraph=True)
    _close(fn(a, b), gemm_ref(a, b) * 2)


def test_varlen_malformed_cu_seqlens_stays_in_bounds():
    # Negative, decreasing and past-the-end bounds are clamped into [0, total_M]
    # and made non-decreasing: no crash, no access outside A or D, and the rows
    # that only one clamped group covers are right.
    torch.manual_seed(0)
    cu = torch.tensor([-50, 50, 30, 1000], device="cuda", dtype=torch.int32)
    a, b = _randn(100, 64), _randn(3, 64, 128)
    out = quack.gemm(a, b, cu_seqlens_m=cu)
    _close(out.narrow(0, 0, 30), gemm_ref(a.narrow(0, 0, 30), b.select(0, 0)))
    _close(out.narrow(0, 50, 50), gemm_ref(a.narrow(0, 50, 50), b.select(0, 2)))


@pytest.mark.no_compile_only  # copies a fake strided tensor; other varlen tests warm the objects
def test_varlen_strided_cu_seqlens():
    torch.manual_seed(0)
    spaced = torch.tensor([0, -1, 70, -1, 300], device="cuda", dtype=torch.int32)
    cu = spaced.as_strided((3,), (2,))  # [0, 70, 300], not contiguous
    a, b = _randn(300, 64), _randn(2, 64, 128)
    _close(quack.gemm(a, b, cu_seqlens_m=cu), gemm_ref(a, b, cu_seqlens_m=cu.contiguous()))


def test_single_row_with_odd_row_stride():
    # A size-1 dim's stride means nothing, but TMA would reject it: it is replaced.
    torch.manual_seed(0)
    a = _randn(1, 200).as_strided((1, 64), (12, 1))
    b = _randn(64, 128)
    _close(quack.gemm(a, b), gemm_ref(a, b))
