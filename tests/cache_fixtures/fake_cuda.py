"""Shared by the input-validation tests: fake CUDA tensors on a machine without a GPU."""

import pytest
import torch

from quack.compile_only import compile_only_mode


def cuda_empty(*shape, dtype=torch.bfloat16):
    """An uninitialised CUDA tensor (fake inside the ``fake`` fixture)."""
    return torch.empty(*shape, device="cuda", dtype=dtype)


@pytest.fixture
def fake():
    """Fake CUDA tensors: validation runs before anything touches a device."""
    with compile_only_mode():
        yield
