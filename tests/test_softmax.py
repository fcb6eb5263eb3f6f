"""Softmax against a float64 reference, forward and backward, on the GPU.

Run: ``pytest tests/test_softmax.py`` (needs a GPU), or
``pytest --compile-only tests/test_softmax.py`` to compile and export every
kernel these tests use without one.
"""

import pytest
import torch

import quack
from quack.families.softmax.op import softmax_ref
from quack.testing import matrix

# (atol, rtol) per input dtype, for the hand-written cases below; y is
# rounded to the input dtype once and is at most 1.
TOLERANCE = {
    torch.float32: (1e-5, 1e-4),
    torch.float16: (1e-3, 2e-3),
    torch.bfloat16: (4e-3, 1.6e-2),
}

pytestmark = pytest.mark.gpu

# Every option of quack.softmax, crossed (quack/testing/matrix.py): the dtype,
# whether x requires grad (and inference under torch.no_grad()), the row-wise
# size classes.
TABLE = {
    "dtype": [torch.float32, torch.float16, torch.bfloat16],
    "mode": [matrix.INFERENCE, matrix.EVAL, "grad_x"],
    "n": list(matrix.ROW_N),
    "m": list(matrix.ROW_M),
    "lead": list(matrix.LEAD),
}
CASES = matrix.cases(TABLE, paired=["dtype", "mode", "n", "m"])


def _x(shape, dtype, scale=3.0):
    torch.manual_seed(0)
    return scale * torch.randn(shape, device="cuda", dtype=dtype)


def _softmax(x):
    return torch.softmax(x, -1)


@pytest.mark.parametrize("case", CASES, ids=matrix.case_id)
def test_matrix(case):
    x = _x(matrix.row_case_shape(case), case["dtype"])
    matrix.check_case(quack.softmax, _softmax, _softmax, {"x": x}, (), case["mode"], matrix.random_cotangents)


# fp32 for the exact exponent, bf16 for the fused one (rowwise.fuses_exp).
EXACT_AND_FUSED = [(torch.float32, (1e-5, 1e-4)), (torch.bfloat16, TOLERANCE[torch.bfloat16])]


@pytest.mark.parametrize("dtype, tol", EXACT_AND_FUSED)
def test_large_and_masked_values(dtype, tol):
    # Large offsets (the max subtraction matters) and -inf entries (masked logits).
    x = _x((9, 3000), dtype) + 1000.0
    masked = torch.arange(3000, device="cuda") % 7 == 0
    x = torch.where(masked, float("-inf"), x)
    torch.testing.assert_close(quack.softmax(x), softmax_ref(x), atol=tol[0], rtol=tol[1])


@pytest.mark.parametrize("dtype, tol", EXACT_AND_FUSED)
@pytest.mark.parametrize("n", [3000, 65536])
def test_masked_halves_and_rows(n, dtype, tol):
    # Whole thread and whole cluster-peer slices of -inf (the first half of each
    # row) merge without NaNs; a row of only -inf gives NaN, as in torch.
    cols = torch.arange(n, device="cuda")
    x = torch.where(cols < n // 2, float("-inf"), _x((4, n), dtype))
    x = torch.where(torch.arange(4, device="cuda").unsqueeze(1) == 3, float("-inf"), x)
    ref = softmax_ref(x)
    torch.testing.assert_close(quack.softmax(x), ref, atol=tol[0], rtol=tol[1], equal_nan=True)
    torch.testing.assert_close(ref.narrow(0, 3, 1), torch.full_like(ref.narrow(0, 3, 1), float("nan")),
                               equal_nan=True)


def test_leading_dims_and_empty_batch():
    x = _x((2, 3, 512), torch.bfloat16)
    torch.testing.assert_close(quack.softmax(x), softmax_ref(x), atol=4e-3, rtol=1.6e-2)
    empty = torch.empty(0, 512, device="cuda", dtype=torch.bfloat16)
    assert quack.softmax(empty).shape == (0, 512)


@pytest.mark.parametrize("n", [760, 65536])
def test_torch_compile_fullgraph(n):
    x = _x((37, n), torch.bfloat16)
    fn = matrix.compiled(lambda x: quack.softmax(x) * 2)
    matrix.check_case(fn, lambda x: _softmax(x) * 2, lambda x: _softmax(x) * 2, {"x": x}, (), "grad_x", matrix.random_cotangents)
