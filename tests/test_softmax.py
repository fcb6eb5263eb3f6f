"""Softmax against the fp32 reference, forward and backward, on the GPU.

Run: ``pytest tests/test_softmax.py`` (needs a GPU), or
``pytest --compile-only tests/test_softmax.py`` to compile and export every
kernel these tests use without one.
"""

import pytest
import torch

import quack
from quack.softmax import softmax_ref
from quack.testing.autograd import vjp

# (atol, rtol) per input dtype; y is rounded to the input dtype once.  Softmax
# values are at most 1, so the absolute tolerance dominates.
TOLERANCE = {
    torch.float32: (1e-5, 1e-4),
    torch.float16: (1e-3, 2e-3),
    torch.bfloat16: (4e-3, 1.6e-2),
}

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# N: tiny, odd (element copies for 16-bit data), not a power of two, 4-byte
# vectors (1026), the largest single-CTA row, cluster sizes 2, 4, 8/16.
SIZES_N = [1, 7, 100, 1000, 1026, 4097, 16384, 32768, 65536, 262144]
SIZES_M = [1, 37]

pytestmark = pytest.mark.gpu


def _x(m, n, dtype, scale=3.0):
    torch.manual_seed(0)
    return scale * torch.randn(m, n, device="cuda", dtype=dtype)


@pytest.mark.parametrize("n", SIZES_N)
@pytest.mark.parametrize("m", SIZES_M)
@pytest.mark.parametrize("dtype", DTYPES)
def test_forward(m, n, dtype):
    x = _x(m, n, dtype)
    y = quack.softmax(x)
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(y, softmax_ref(x), atol=atol, rtol=rtol)


@pytest.mark.parametrize("n", [7, 1000, 4097, 16384, 65536, 262144])
@pytest.mark.parametrize("dtype", DTYPES)
def test_backward(n, dtype):
    m = 37 if n <= 65536 else 5
    x = _x(m, n, dtype)
    dy = torch.randn_like(x)
    (y,), (dx,) = vjp(quack.softmax, (x,), (dy,))
    (y_ref,), (dx_ref,) = vjp(lambda a: torch.softmax(a, -1), (x.float(),), (dy.float(),))
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(y.float(), y_ref, atol=atol, rtol=rtol)
    # dx = y * (dy - <y, dy>): y's rounding to the input dtype enters twice.
    torch.testing.assert_close(dx.float(), dx_ref, atol=atol * 4, rtol=rtol * 4)


# fp32 for the exact exponent, bf16 for the fused one (rowwise.fuses_exp).
EXACT_AND_FUSED = [(torch.float32, (1e-5, 1e-4)), (torch.bfloat16, TOLERANCE[torch.bfloat16])]


@pytest.mark.parametrize("dtype, tol", EXACT_AND_FUSED)
def test_large_and_masked_values(dtype, tol):
    # Large offsets (the max subtraction matters) and -inf entries (masked logits).
    x = _x(9, 3000, dtype) + 1000.0
    masked = torch.arange(3000, device="cuda") % 7 == 0
    x = torch.where(masked, float("-inf"), x)
    torch.testing.assert_close(quack.softmax(x), softmax_ref(x), atol=tol[0], rtol=tol[1])


@pytest.mark.parametrize("dtype, tol", EXACT_AND_FUSED)
@pytest.mark.parametrize("n", [3000, 65536])
def test_masked_halves_and_rows(n, dtype, tol):
    # Whole thread and whole cluster-peer slices of -inf (the first half of each
    # row) merge without NaNs; a row of only -inf gives NaN, as in torch.
    cols = torch.arange(n, device="cuda")
    x = torch.where(cols < n // 2, float("-inf"), _x(4, n, dtype))
    x = torch.where(torch.arange(4, device="cuda").unsqueeze(1) == 3, float("-inf"), x)
    ref = softmax_ref(x)
    torch.testing.assert_close(quack.softmax(x), ref, atol=tol[0], rtol=tol[1], equal_nan=True)
    torch.testing.assert_close(ref.narrow(0, 3, 1), torch.full_like(ref.narrow(0, 3, 1), float("nan")),
                               equal_nan=True)


def test_leading_dims_and_empty_batch():
    x = _x(6, 512, torch.bfloat16).view(2, 3, 512)
    torch.testing.assert_close(quack.softmax(x), softmax_ref(x), atol=4e-3, rtol=1.6e-2)
    empty = torch.empty(0, 512, device="cuda", dtype=torch.bfloat16)
    assert quack.softmax(empty).shape == (0, 512)


@pytest.mark.no_compile_only
def test_torch_compile_fullgraph():
    # N = 1000 bf16, forward and backward: test_forward and test_backward warm both.
    x = _x(37, 1000, torch.bfloat16).requires_grad_()
    fn = torch.compile(lambda a: quack.softmax(a) * 2, fullgraph=True)
    y = fn(x)
    torch.testing.assert_close(y, softmax_ref(x.detach()) * 2, atol=8e-3, rtol=1.6e-2)
    (dx,) = torch.autograd.grad(y, x, torch.ones_like(y))
    # sum(y) == 1 per row, so the gradient of 2 * sum(softmax) is zero.
    torch.testing.assert_close(dx.float(), torch.zeros_like(dx, dtype=torch.float32), atol=2e-2, rtol=0)
