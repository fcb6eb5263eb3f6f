"""LayerNorm against the fp32 reference, forward and backward, on the GPU.

Run: ``pytest tests/test_layernorm.py`` (needs a GPU), or
``pytest --compile-only tests/test_layernorm.py`` to compile and export every
kernel these tests use without one.
"""

import pytest
import torch

import quack
from quack.layernorm import layernorm_ref
from quack.testing.autograd import vjp

# (atol, rtol) per input dtype; outputs are rounded to the input dtype once.
TOLERANCE = {
    torch.float32: (1e-4, 1e-4),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (2e-2, 1.6e-2),
}
# Gradients of the weight and bias sum over M rows: their error grows with M.
PARAM_GRAD_SCALE = 4.0

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# N: tiny, odd (element copies for 16-bit data), 4-byte vectors (1026), not a
# power of two, the largest single-CTA row, cluster sizes 2, 4, 8/16.
SIZES_N = [1, 7, 100, 1000, 1026, 4097, 16384, 32768, 65536, 262144]
SIZES_M = [1, 37]

pytestmark = pytest.mark.gpu


def _inputs(m, n, dtype, weight_dtype, bias=True, offset=0.0):
    torch.manual_seed(0)
    x = offset + torch.randn(m, n, device="cuda", dtype=dtype)
    w = b = None
    if weight_dtype is not None:
        w = 1 + 0.1 * torch.randn(n, device="cuda", dtype=weight_dtype)
        if bias:
            b = 0.1 * torch.randn(n, device="cuda", dtype=weight_dtype)
    return x, w, b


@pytest.mark.parametrize("n", SIZES_N)
@pytest.mark.parametrize("m", SIZES_M)
@pytest.mark.parametrize("dtype", DTYPES)
def test_forward(m, n, dtype):
    x, w, b = _inputs(m, n, dtype, dtype)
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(quack.layernorm(x, w, b), layernorm_ref(x, w, b), atol=atol, rtol=rtol)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("weight_dtype", [None, torch.float32])
@pytest.mark.parametrize("n", [100, 4097, 65536])
def test_forward_param_variants(n, weight_dtype, bias):
    x, w, b = _inputs(33, n, torch.bfloat16, weight_dtype, bias)
    torch.testing.assert_close(
        quack.layernorm(x, w, b, eps=1e-6), layernorm_ref(x, w, b, eps=1e-6), atol=2e-2, rtol=1.6e-2
    )


@pytest.mark.parametrize("n", [4097, 65536])
def test_large_mean(n):
    # The shifted sums keep the variance accurate when the mean dwarfs the
    # spread, in registers (4097) and staged over a cluster (65536).
    x, w, b = _inputs(16, n, torch.float32, torch.float32, offset=1000.0)
    torch.testing.assert_close(quack.layernorm(x, w, b), layernorm_ref(x, w, b), atol=2e-3, rtol=1e-3)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("n", [7, 1000, 4096, 16384, 65536, 262144])
@pytest.mark.parametrize("dtype", DTYPES)
def test_backward(n, dtype, bias):
    _check_backward(37 if n <= 65536 else 9, n, dtype, bias)


@pytest.mark.parametrize("bias", [False, True])
def test_backward_many_tiles_per_cta(bias):
    # The persistent grid has at most 8 clusters at N = 256K: each loops
    # over 9 or more row tiles and so reuses both exchange sets in both
    # mbarrier phases.
    _check_backward(77, 262144, torch.bfloat16, bias)


def _check_backward(m, n, dtype, bias):
    x, w, b = _inputs(m, n, dtype, dtype, bias)
    inputs = (x, w, b) if bias else (x, w)
    dy = torch.randn_like(x)
    _, grads = vjp(quack.layernorm, inputs, (dy,))
    _, ref_grads = vjp(layernorm_ref, tuple(t.float() for t in inputs), (dy.float(),))
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(grads[0].float(), ref_grads[0], atol=atol * 2, rtol=rtol * 2)
    scale = PARAM_GRAD_SCALE * max(1.0, m ** 0.5)
    for g, ref in zip(grads[1:], ref_grads[1:]):
        torch.testing.assert_close(g.float(), ref, atol=atol * scale, rtol=rtol * scale)


def test_backward_without_weight():
    x, _, _ = _inputs(5, 300, torch.float32, None)
    dy = torch.randn_like(x)
    _, (dx,) = vjp(quack.layernorm, (x,), (dy,))
    _, (dx_ref,) = vjp(layernorm_ref, (x,), (dy,))
    torch.testing.assert_close(dx, dx_ref, atol=1e-4, rtol=1e-4)


def test_leading_dims_and_empty_batch():
    x, w, b = _inputs(6, 512, torch.bfloat16, torch.bfloat16)
    x3 = x.view(2, 3, 512)
    torch.testing.assert_close(quack.layernorm(x3, w, b), layernorm_ref(x3, w, b), atol=2e-2, rtol=1.6e-2)
    empty = torch.empty(0, 512, device="cuda", dtype=torch.bfloat16)
    assert quack.layernorm(empty, w, b).shape == (0, 512)


@pytest.mark.no_compile_only
@pytest.mark.parametrize("n", [4096, 16384])
def test_torch_compile_fullgraph(n):
    # bf16 with bf16 weight and bias, all requiring grad: the
    # test_backward[bias=True] cases warm the forward and backward objects.
    # At N = 16384 the backward runs clusters of 2, so the op asks the driver
    # how many run at once (quack/occupancy.py) while the backward is traced.
    x, w, b = _inputs(37, n, torch.bfloat16, torch.bfloat16)
    inputs = [t.requires_grad_() for t in (x, w, b)]
    fn = torch.compile(lambda a, c, d: quack.layernorm(a, c, d) * 2, fullgraph=True)
    y = fn(*inputs)
    torch.testing.assert_close(y, layernorm_ref(x.detach(), w.detach(), b.detach()) * 2, atol=4e-2, rtol=1.6e-2)
    dy = torch.randn_like(y)
    grads = torch.autograd.grad(y, inputs, dy)
    ref_inputs = [t.detach().float().requires_grad_() for t in inputs]
    ref_grads = torch.autograd.grad(layernorm_ref(*ref_inputs) * 2, ref_inputs, dy.float())
    torch.testing.assert_close(grads[0].float(), ref_grads[0], atol=8e-2, rtol=3.2e-2)
    for g, ref in zip(grads[1:], ref_grads[1:]):
        torch.testing.assert_close(g.float(), ref, atol=1.0, rtol=0.1)
