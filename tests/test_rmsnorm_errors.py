"""RMSNorm input validation: clear errors before any launch (no GPU needed)."""

import numpy as np
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
        quack.rmsnorm(_cuda(4, 8, dtype=torch.int32))


def test_weight_dtype_must_be_fp32_or_input_dtype():
    with pytest.raises(TypeError, match="weight has dtype float16"):
        quack.rmsnorm(_cuda(4, 8), _cuda(8, dtype=torch.float16))


def test_cpu_tensor_rejected():
    with pytest.raises(ValueError, match="CUDA device"):
        quack.rmsnorm(torch.randn(4, 8))


def test_non_contiguous():
    with pytest.raises(ValueError, match="contiguous"):
        quack.rmsnorm(_cuda(8, 4).t())


def test_weight_shape():
    with pytest.raises(ValueError, match=r"weight must have shape \(8,\)"):
        quack.rmsnorm(_cuda(4, 8), _cuda(9))


def test_residual_shape_and_dtype():
    with pytest.raises(ValueError, match="residual shape"):
        quack.rmsnorm(_cuda(4, 8), residual=_cuda(4, 9))
    with pytest.raises(TypeError, match="residual has dtype float32"):
        quack.rmsnorm(_cuda(4, 8), residual=_cuda(4, 8, dtype=torch.float32))


def test_too_long_and_empty_rows():
    with pytest.raises(ValueError, match="larger than the supported"):
        quack.rmsnorm(_cuda(1, 262145))
    with pytest.raises(ValueError, match="N >= 1"):
        quack.rmsnorm(_cuda(4, 0))


def test_not_a_tensor():
    with pytest.raises(TypeError, match="torch.Tensor"):
        quack.rmsnorm([1.0, 2.0])


@pytest.mark.parametrize("eps, error", [
    ("abc", TypeError), ([1e-6], TypeError), (True, TypeError), (torch.tensor(1e-6), TypeError),
    (float("nan"), ValueError), (float("inf"), ValueError), (-1.0, ValueError), (-1, ValueError),
])
def test_eps_must_be_a_finite_real_number_not_negative(eps, error):
    with pytest.raises(error, match="eps must be"):
        quack.rmsnorm(_cuda(4, 8), eps=eps)
    with pytest.raises(error, match="eps must be"):
        quack.rmsnorm(_cuda(4, 8), _cuda(8), eps, _cuda(4, 8))


@pytest.mark.parametrize("eps, expected", [
    (None, torch.finfo(torch.bfloat16).eps), (0, 0.0), (np.float32(0.5), 0.5), (1e-6, 1e-6),
])
def test_the_kernel_gets_eps_as_a_float(eps, expected, monkeypatch):
    # None: torch.nn.functional.rms_norm's default, the machine epsilon of x's dtype.
    launches = []
    monkeypatch.setattr(quack.calls.plan.Kernel, "load", lambda kernel: lambda *args: launches.append(args))
    quack.rmsnorm(_cuda(4, 8), eps=eps)
    (args,) = launches
    assert type(args[6]) is float and args[6] == expected


def test_vector_width_follows_n_and_alignment():
    from quack.calls.torch_interop import widest_vector as vector_width

    assert vector_width(4096, 2, (0, 2), (256, 2)) == 8  # 16-byte vectors
    assert vector_width(4097, 2, (0, 2)) == 1  # odd N: element copies
    assert vector_width(1026, 2, (0, 2)) == 2
    assert vector_width(4096, 2, (2, 2)) == 1  # a view 1 element into its storage
    assert vector_width(4096, 2, (8, 2)) == 4
    assert vector_width(4096, 4, (0, 4)) == 4
    # An fp32 weight beside bf16 rows only needs 16-byte alignment.
    assert vector_width(4096, 2, (0, 2), (16, 4)) == 8
    assert vector_width(4096, 2, (0, 2), (8, 4)) == 2
