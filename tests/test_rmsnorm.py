"""RMSNorm against the fp32 reference, forward and backward, on the GPU.

Run: ``pytest tests/test_rmsnorm.py`` (needs a GPU), or
``pytest --compile-only tests/test_rmsnorm.py`` to compile and export every
kernel these tests use without one.
"""

import pytest
import torch

import quack
from quack.rmsnorm import rmsnorm_ref
from quack.testing.autograd import vjp

# (atol, rtol) per input dtype; outputs are rounded to the input dtype once.
TOLERANCE = {
    torch.float32: (1e-4, 1e-4),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (2e-2, 1.6e-2),
}
# Gradients of the weight sum over M rows: their error grows with M.
WEIGHT_GRAD_SCALE = 4.0

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# N: tiny, odd (no vector copies for 16-bit data), 4-byte vectors (1026), the
# largest single-CTA row, cluster sizes 2, 4 and 16.
SIZES_N = [1, 7, 100, 1000, 1026, 4096, 4097, 16384, 32768, 65536, 262144]
SIZES_M = [1, 37]

pytestmark = pytest.mark.gpu


def _inputs(m, n, dtype, weight_dtype, residual):
    torch.manual_seed(0)
    x = torch.randn(m, n, device="cuda", dtype=dtype)
    w = None
    if weight_dtype is not None:
        w = 1 + 0.1 * torch.randn(n, device="cuda", dtype=weight_dtype)
    r = torch.randn(m, n, device="cuda", dtype=dtype) if residual else None
    return x, w, r


@pytest.mark.parametrize("n", SIZES_N)
@pytest.mark.parametrize("m", SIZES_M)
@pytest.mark.parametrize("dtype", DTYPES)
def test_forward(m, n, dtype):
    x, w, _ = _inputs(m, n, dtype, dtype, residual=False)
    y = quack.rmsnorm(x, w)
    torch.testing.assert_close(y, rmsnorm_ref(x, w), atol=TOLERANCE[dtype][0], rtol=TOLERANCE[dtype][1])


@pytest.mark.parametrize("weight_dtype", [None, torch.float32])
@pytest.mark.parametrize("n", [100, 4097, 65536])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_forward_weight_variants_and_residual(n, dtype, weight_dtype):
    x, w, r = _inputs(33, n, dtype, weight_dtype, residual=True)
    y, h = quack.rmsnorm(x, w, eps=1e-5, residual=r)
    y_ref, h_ref = rmsnorm_ref(x, w, eps=1e-5, residual=r)
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(h, h_ref, atol=atol, rtol=rtol)
    torch.testing.assert_close(y, y_ref, atol=atol, rtol=rtol)


def test_leading_dims_and_empty_batch():
    x, w, _ = _inputs(6, 512, torch.bfloat16, torch.bfloat16, residual=False)
    x3 = x.view(2, 3, 512)
    torch.testing.assert_close(quack.rmsnorm(x3, w), rmsnorm_ref(x3, w), atol=2e-2, rtol=1.6e-2)
    empty = torch.empty(0, 512, device="cuda", dtype=torch.bfloat16)
    assert quack.rmsnorm(empty, w).shape == (0, 512)


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("n", [7, 1000, 4096, 16384, 65536, 262144])
@pytest.mark.parametrize("dtype", DTYPES)
def test_backward(n, dtype, residual):
    _check_backward(37 if n <= 65536 else 9, n, dtype, residual)


@pytest.mark.parametrize("residual", [False, True])
def test_backward_many_tiles_per_cta(residual):
    # The persistent grid has at most 8 clusters at N = 256K: each loops
    # over 9 or more row tiles and so reuses both exchange sets in both
    # mbarrier phases.
    _check_backward(77, 262144, torch.bfloat16, residual)


def _check_backward(m, n, dtype, residual):
    x, w, r = _inputs(m, n, dtype, dtype, residual)
    inputs = (x, w, r) if residual else (x, w)
    cotangents = tuple(torch.randn_like(x) for _ in range(2 if residual else 1))

    def fn(norm):
        return lambda *a: norm(*a[:2], residual=a[2] if residual else None)

    _, grads = vjp(fn(quack.rmsnorm), inputs, cotangents)
    _, ref_grads = vjp(
        fn(rmsnorm_ref), tuple(t.float() for t in inputs), tuple(c.float() for c in cotangents)
    )
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(grads[0].float(), ref_grads[0], atol=atol * 2, rtol=rtol * 2)
    scale = WEIGHT_GRAD_SCALE * max(1.0, m ** 0.5)
    torch.testing.assert_close(grads[1].float(), ref_grads[1], atol=atol * scale, rtol=rtol * scale)
    if residual:
        torch.testing.assert_close(grads[2].float(), ref_grads[2], atol=atol * 2, rtol=rtol * 2)


def test_backward_without_weight():
    x, _, _ = _inputs(5, 300, torch.float32, None, residual=False)
    dy = torch.randn_like(x)
    _, (dx,) = vjp(quack.rmsnorm, (x,), (dy,))
    _, (dx_ref,) = vjp(rmsnorm_ref, (x,), (dy,))
    torch.testing.assert_close(dx, dx_ref, atol=1e-4, rtol=1e-4)


@pytest.mark.no_compile_only
@pytest.mark.parametrize("n", [4096, 16384])
def test_torch_compile_fullgraph(n):
    # bf16 with a bf16 weight, both requiring grad: test_backward warms the
    # objects.  At N = 16384 the backward runs clusters of 2, so the op asks
    # the driver how many run at once (quack/occupancy.py) while the
    # backward is traced.
    x, w, _ = _inputs(64, n, torch.bfloat16, torch.bfloat16, residual=False)
    inputs = [t.requires_grad_() for t in (x, w)]
    fn = torch.compile(lambda a, b: quack.rmsnorm(a, b) * 2, fullgraph=True)
    y = fn(*inputs)
    torch.testing.assert_close(y, rmsnorm_ref(x.detach(), w.detach()) * 2, atol=4e-2, rtol=1.6e-2)
    dy = torch.randn_like(y)
    grads = torch.autograd.grad(y, inputs, dy)
    ref_inputs = [t.detach().float().requires_grad_() for t in inputs]
    ref_grads = torch.autograd.grad(rmsnorm_ref(*ref_inputs) * 2, ref_inputs, dy.float())
    torch.testing.assert_close(grads[0].float(), ref_grads[0], atol=8e-2, rtol=3.2e-2)
    torch.testing.assert_close(grads[1].float(), ref_grads[1], atol=1.0, rtol=0.1)
