"""RMSNorm against a float64 reference, forward and backward, on the GPU.

Run: ``pytest tests/test_rmsnorm.py`` (needs a GPU), or
``pytest --compile-only tests/test_rmsnorm.py`` to compile and export every
kernel these tests use without one.
"""

import pytest
import torch

import quack
from quack.compile_only import is_compile_only
from quack.families.rmsnorm.op import rmsnorm_ref
from quack.testing import matrix

EPS = 1e-6

pytestmark = pytest.mark.gpu

# Every option of quack.rmsnorm, crossed (quack/testing/matrix.py): x's dtype,
# the weight (none, fp32, x's dtype), a residual, which inputs require grad
# (and inference under torch.no_grad()), and the row-wise size classes.
TABLE = {
    "dtype": [torch.float32, torch.float16, torch.bfloat16],
    "weight": [None, "float32", "x"],
    "residual": [False, True],
    "mode": list(matrix.MODES),
    "n": list(matrix.ROW_N),
    "m": list(matrix.ROW_M),
    "lead": list(matrix.LEAD),
}
CASES = matrix.cases(TABLE, paired=["dtype", "weight", "residual", "mode", "n", "m"])


def _inputs(shape, dtype, weight, residual, seed=0):
    torch.manual_seed(seed)
    n = shape[-1]
    x = torch.randn(shape, device="cuda", dtype=dtype)
    w = None
    if weight is not None:
        w_dtype = dtype if weight == "x" else getattr(torch, weight)
        w = 1 + 0.5 * torch.randn(n, device="cuda", dtype=w_dtype)
    r = torch.randn(shape, device="cuda", dtype=dtype) if residual else None
    return {"x": x, "weight": w, "residual": r}


def _reference(x, weight, residual):
    """RMSNorm in the inputs' precision (float64 for the matrix reference)."""
    h = x + residual if residual is not None else x
    y = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)
    if weight is not None:
        y = y * weight
    return (y, h) if residual is not None else y


def _torch(x, weight, residual):
    """torch's own RMSNorm (the pre-norm sum rounded to x's dtype, as ours)."""
    h = x + residual if residual is not None else x
    y = torch.nn.functional.rms_norm(h, (x.shape[-1],), weight, EPS)
    return (y, h) if residual is not None else y


def _ours(x, weight, residual):
    return quack.rmsnorm(x, weight, eps=EPS, residual=residual)


@pytest.mark.parametrize("case", CASES, ids=matrix.case_id)
def test_matrix(case):
    shape = matrix.row_case_shape(case)
    inputs = _inputs(shape, case["dtype"], case["weight"], case["residual"])
    matrix.check_case(
        _ours, _reference, _torch, inputs, ("weight",), case["mode"], matrix.random_cotangents
    )


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("weight", ["float32", "x"])
@pytest.mark.parametrize("n", [760, 4096, 65536, 262144])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_mixed_precision_backward(dtype, n, weight, residual):
    # A 16-bit x with an fp32 weight gave a wrong dx (the weight slice staged
    # only its first 16 bytes per vector): the case that found it.
    inputs = _inputs((9, n), dtype, weight, residual)
    matrix.check_case(
        _ours, _reference, _torch, inputs, ("weight",), "grad_all", matrix.random_cotangents
    )


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "torch_compile"])
@pytest.mark.parametrize("eps", [EPS, 1e-2])
def test_one_column_gradient_is_accurate_where_its_terms_cancel(eps, compiled):
    # At N = 1, dx = dy * eps * rstd^3, far below dy * rstd once x^2 >> eps:
    # computed as rstd * (dy - x̂^2 dy) it scaled rstd's rounding by
    # 1 / (1 - x̂^2).  |x| from 1e-4 to 10 spans both regimes; an
    # eps other than the default checks that the backward gets the call's.
    # (96, 1) built elementwise: fake CUDA tensors take no views.
    i = torch.arange(96, device="cuda", dtype=torch.float64).as_strided((96, 1), (1, 1))
    x = (torch.pow(10.0, i * (5 / 95) - 4) * (1 - 2 * (i % 2))).float()
    dy = (i * (4 / 95) - 2).float()
    ours = lambda x: quack.rmsnorm(x, eps=eps)  # noqa: E731
    if compiled:
        ours = matrix.compiled(ours)
    if is_compile_only():
        matrix.warm(ours, {"x": x}, ["x"], no_grad=False)
        return

    def reference(x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)

    _, got, _ = matrix.evaluate(ours, {"x": x}, ["x"], [dy])
    _, want, _ = matrix.evaluate(reference, {"x": x.double()}, ["x"], [dy.double()])
    torch.testing.assert_close(got["x"].double(), want["x"], rtol=1e-6, atol=0)


def test_leading_dims_and_empty_batch():
    inputs = _inputs((6, 512), torch.bfloat16, "x", False)
    x, w = inputs["x"], inputs["weight"]
    x3 = x.view(2, 3, 512)
    torch.testing.assert_close(quack.rmsnorm(x3, w), rmsnorm_ref(x3, w), atol=2e-2, rtol=1.6e-2)
    empty = torch.empty(0, 512, device="cuda", dtype=torch.bfloat16)
    assert quack.rmsnorm(empty, w).shape == (0, 512)


@pytest.mark.parametrize("n", [4096, 65536])
def test_torch_compile_fullgraph(n):
    # bf16 with a bf16 weight, both requiring grad.  At N = 65536 the backward
    # runs clusters of 8, so the op asks the driver how many run at once
    # (quack/calls/occupancy.py) while the backward is traced.
    inputs = _inputs((64, n), torch.bfloat16, "x", False)
    del inputs["residual"]
    fn = matrix.compiled(lambda x, weight: quack.rmsnorm(x, weight, eps=EPS) * 2)
    matrix.check_case(
        fn, lambda x, weight: _reference(x, weight, None) * 2, lambda x, weight: _torch(x, weight, None) * 2,
        inputs, ("weight",), "grad_all", matrix.random_cotangents,
    )
