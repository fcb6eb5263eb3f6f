"""Cross-entropy input validation: clear errors before any launch (no GPU needed)."""

import pytest
import torch

import quack
from cache_fixtures.fake_cuda import cuda_empty as _cuda
from cache_fixtures.fake_cuda import fake  # noqa: F401  (the fixture below)

# Fake CUDA tensors throughout: validation runs before anything touches a device.
pytestmark = pytest.mark.usefixtures("fake")


def _target(*shape, dtype=torch.int64):
    return torch.zeros(*shape, device="cuda", dtype=dtype)


def test_wrong_logits_dtype():
    with pytest.raises(TypeError, match="logits has dtype int32"):
        quack.cross_entropy(_cuda(4, 8, dtype=torch.int32), _target(4))


def test_wrong_target_dtype():
    with pytest.raises(TypeError, match="target has dtype float32"):
        quack.cross_entropy(_cuda(4, 8), _cuda(4, dtype=torch.float32))
    with pytest.raises(TypeError, match="target has dtype int16"):
        quack.cross_entropy(_cuda(4, 8), _target(4, dtype=torch.int16))


def test_cpu_tensors_rejected():
    with pytest.raises(ValueError, match="logits must be on a CUDA device"):
        quack.cross_entropy(torch.randn(4, 8), torch.zeros(4, dtype=torch.int64))


def test_cpu_target_rejected():
    with pytest.raises(ValueError, match="target must be on a CUDA device"):
        quack.cross_entropy(_cuda(4, 8), torch.zeros(4, dtype=torch.int64, device="cpu"))


def test_non_contiguous_logits():
    with pytest.raises(ValueError, match="contiguous"):
        quack.cross_entropy(_cuda(8, 4).t(), _target(4))


def test_target_shape():
    with pytest.raises(ValueError, match=r"target must have shape \(4,\)"):
        quack.cross_entropy(_cuda(4, 8), _target(5))
    with pytest.raises(ValueError, match=r"target must have shape \(2, 3\)"):
        quack.cross_entropy(_cuda(2, 3, 8), _target(6))


def test_bad_reduction_and_ignore_index():
    with pytest.raises(ValueError, match="reduction must be one of"):
        quack.cross_entropy(_cuda(4, 8), _target(4), reduction="avg")
    with pytest.raises(TypeError, match="ignore_index must be an int"):
        quack.cross_entropy(_cuda(4, 8), _target(4), ignore_index=1.5)
    with pytest.raises(ValueError, match="does not fit in 32 bits"):
        quack.cross_entropy(_cuda(4, 8), _target(4), ignore_index=2**40)


def test_too_long_and_empty_rows():
    with pytest.raises(ValueError, match="larger than the supported"):
        quack.cross_entropy(_cuda(1, 262145), _target(1))
    with pytest.raises(ValueError, match="N >= 1"):
        quack.cross_entropy(_cuda(4, 0), _target(4))


def test_not_a_tensor():
    with pytest.raises(TypeError, match="torch.Tensor"):
        quack.cross_entropy([1.0, 2.0], [0])
