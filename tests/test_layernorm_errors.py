"""LayerNorm input validation: clear errors before any launch (no GPU needed)."""

import pytest
import torch

import quack
import quack.calls.plan
from cache_fixtures.fake_cuda import cuda_empty as _cuda
from cache_fixtures.fake_cuda import fake  # noqa: F401  (the fixture below)

# Fake CUDA tensors throughout: validation runs before anything touches a device.
pytestmark = pytest.mark.usefixtures("fake")


def test_wrong_dtype():
    with pytest.raises(TypeError, match="dtype int32"):
        quack.layernorm(_cuda(4, 8, dtype=torch.int32), _cuda(8))


def test_param_dtypes_must_be_fp32_or_input_dtype():
    with pytest.raises(TypeError, match="weight has dtype float16"):
        quack.layernorm(_cuda(4, 8), _cuda(8, dtype=torch.float16))
    with pytest.raises(TypeError, match="bias has dtype float16"):
        quack.layernorm(_cuda(4, 8), _cuda(8), _cuda(8, dtype=torch.float16))


def test_cpu_tensor_rejected():
    with pytest.raises(ValueError, match="CUDA device"):
        quack.layernorm(torch.randn(4, 8), torch.ones(8))


def test_cpu_bias_rejected():
    with pytest.raises(ValueError, match="bias must be on a CUDA device"):
        quack.layernorm(_cuda(4, 8), _cuda(8), torch.zeros(8, dtype=torch.bfloat16, device="cpu"))


def test_non_contiguous():
    with pytest.raises(ValueError, match="contiguous"):
        quack.layernorm(_cuda(8, 4).t(), _cuda(8))


def test_param_shapes():
    with pytest.raises(ValueError, match=r"weight must have shape \(8,\)"):
        quack.layernorm(_cuda(4, 8), _cuda(9))
    with pytest.raises(ValueError, match=r"bias must have shape \(8,\)"):
        quack.layernorm(_cuda(4, 8), _cuda(8), _cuda(2, 4))


def test_too_long_and_empty_rows():
    with pytest.raises(ValueError, match="larger than the supported"):
        quack.layernorm(_cuda(1, 262145), None)
    with pytest.raises(ValueError, match="N >= 1"):
        quack.layernorm(_cuda(4, 0), None)


def test_not_a_tensor():
    with pytest.raises(TypeError, match="torch.Tensor"):
        quack.layernorm([1.0, 2.0], None)


@pytest.mark.parametrize("eps, error", [
    ("abc", TypeError), (None, TypeError), (float("nan"), ValueError), (float("-inf"), ValueError),
    (-1e-5, ValueError),
])
def test_eps_must_be_a_finite_real_number_not_negative(eps, error):
    # None too: torch.nn.functional.layer_norm takes a float.
    with pytest.raises(error, match="eps must be"):
        quack.layernorm(_cuda(4, 8), _cuda(8), None, eps)


def test_eps_zero_reaches_the_kernel(monkeypatch):
    launches = []
    monkeypatch.setattr(quack.calls.plan.Kernel, "load", lambda kernel: lambda *args: launches.append(args))
    quack.layernorm(_cuda(4, 8), eps=0)
    (args,) = launches
    assert type(args[6]) is float and args[6] == 0.0
