"""Softmax input validation: clear errors before any launch (no GPU needed)."""

import pytest
import torch

import quack
from cache_fixtures.fake_cuda import cuda_empty as _cuda
from cache_fixtures.fake_cuda import fake  # noqa: F401  (the fixture below)

# Fake CUDA tensors throughout: validation runs before anything touches a device.
pytestmark = pytest.mark.usefixtures("fake")


def test_wrong_dtype():
    with pytest.raises(TypeError, match="dtype int32"):
        quack.softmax(_cuda(4, 8, dtype=torch.int32))
    with pytest.raises(TypeError, match="dtype float64"):
        quack.softmax(_cuda(4, 8, dtype=torch.float64))


def test_cpu_tensor_rejected():
    with pytest.raises(ValueError, match="CUDA device"):
        quack.softmax(torch.randn(4, 8))


def test_non_contiguous():
    with pytest.raises(ValueError, match="contiguous"):
        quack.softmax(_cuda(8, 4).t())


def test_too_long_and_empty_rows():
    with pytest.raises(ValueError, match="larger than the supported"):
        quack.softmax(_cuda(1, 262145))
    with pytest.raises(ValueError, match="N >= 1"):
        quack.softmax(_cuda(4, 0))
    with pytest.raises(ValueError, match="N >= 1"):
        quack.softmax(_cuda(()))


def test_not_a_tensor():
    with pytest.raises(TypeError, match="torch.Tensor"):
        quack.softmax([1.0, 2.0])
