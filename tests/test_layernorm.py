"""LayerNorm against a float64 reference, forward and backward, on the GPU.

Run: ``pytest tests/test_layernorm.py`` (needs a GPU), or
``pytest --compile-only tests/test_layernorm.py`` to compile and export every
kernel these tests use without one.
"""

import pytest
import torch

import quack
from quack.families.layernorm.op import layernorm_ref
from quack.testing import matrix

EPS = 1e-5

pytestmark = pytest.mark.gpu

# Every option of quack.layernorm, crossed (quack/testing/matrix.py): x's
# dtype, the weight and the bias (each none, fp32 or x's dtype), which inputs
# require grad (and inference under torch.no_grad()), the row-wise size classes.
TABLE = {
    "dtype": [torch.float32, torch.float16, torch.bfloat16],
    "weight": [None, "float32", "x"],
    "bias": [None, "float32", "x"],
    "mode": list(matrix.MODES),
    "n": list(matrix.ROW_N),
    "m": list(matrix.ROW_M),
    "lead": list(matrix.LEAD),
}
CASES = matrix.cases(TABLE, paired=["dtype", "weight", "bias", "mode", "n", "m"])


def _param(n, dtype, spec, scale, offset):
    if spec is None:
        return None
    return offset + scale * torch.randn(n, device="cuda", dtype=dtype if spec == "x" else getattr(torch, spec))


def _inputs(shape, dtype, weight, bias, offset=0.0):
    torch.manual_seed(0)
    n = shape[-1]
    x = offset + torch.randn(shape, device="cuda", dtype=dtype)
    return {"x": x, "weight": _param(n, dtype, weight, 0.5, 1.0), "bias": _param(n, dtype, bias, 0.5, 0.0)}


def _reference(x, weight, bias):
    """LayerNorm in the inputs' precision (float64 for the matrix reference)."""
    mean = x.mean(-1, keepdim=True)
    y = (x - mean) * torch.rsqrt((x - mean).pow(2).mean(-1, keepdim=True) + EPS)
    if weight is not None:
        y = y * weight
    return y + bias if bias is not None else y


def _torch(x, weight, bias):
    return torch.nn.functional.layer_norm(x, (x.shape[-1],), weight, bias, EPS)


def _ours(x, weight, bias):
    return quack.layernorm(x, weight, bias, eps=EPS)


@pytest.mark.parametrize("case", CASES, ids=matrix.case_id)
def test_matrix(case):
    shape = matrix.row_case_shape(case)
    inputs = _inputs(shape, case["dtype"], case["weight"], case["bias"])
    matrix.check_case(
        _ours, _reference, _torch, inputs, ("weight", "bias"), case["mode"], matrix.random_cotangents
    )


@pytest.mark.parametrize("bias", [None, "float32", "x"])
@pytest.mark.parametrize("weight", ["float32", "x"])
@pytest.mark.parametrize("n", [760, 4096, 65536, 262144])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_mixed_precision_backward(dtype, n, weight, bias):
    # A 16-bit x with an fp32 weight gave a wrong dx (the weight slice staged
    # only its first 16 bytes per vector): the case that found it.
    inputs = _inputs((9, n), dtype, weight, bias)
    matrix.check_case(
        _ours, _reference, _torch, inputs, ("weight", "bias"), "grad_all", matrix.random_cotangents
    )


@pytest.mark.parametrize("n", [4097, 65536])
def test_large_mean(n):
    # The shifted sums keep the variance accurate when the mean dwarfs the
    # spread, in registers (4097) and staged over a cluster (65536).
    inputs = _inputs((16, n), torch.float32, "float32", "float32", offset=1000.0)
    matrix.check_case(_ours, _reference, _torch, inputs, ("weight", "bias"), matrix.EVAL, matrix.random_cotangents)


def test_leading_dims_and_empty_batch():
    x, w, b = _inputs((6, 512), torch.bfloat16, "x", "x").values()
    x3 = x.view(2, 3, 512)
    torch.testing.assert_close(quack.layernorm(x3, w, b), layernorm_ref(x3, w, b), atol=2e-2, rtol=1.6e-2)
    empty = torch.empty(0, 512, device="cuda", dtype=torch.bfloat16)
    assert quack.layernorm(empty, w, b).shape == (0, 512)


@pytest.mark.parametrize("n", [4096, 65536])
def test_torch_compile_fullgraph(n):
    # bf16 with bf16 weight and bias, all requiring grad.  At N = 65536 the
    # backward runs clusters of 8, so the op asks the driver how many run at
    # once (quack/calls/occupancy.py) while the backward is traced.
    inputs = _inputs((37, n), torch.bfloat16, "x", "x")
    fn = matrix.compiled(lambda x, weight, bias: _ours(x, weight, bias) * 2)
    matrix.check_case(
        fn, lambda **a: _reference(**a) * 2, lambda **a: _torch(**a) * 2,
        inputs, ("weight", "bias"), "grad_all", matrix.random_cotangents,
    )
