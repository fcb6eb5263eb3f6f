"""GEMM input validation: clear errors before any launch (no GPU needed)."""

import pytest
import torch

import quack
from cache_fixtures.fake_cuda import cuda_empty as _cuda
from cache_fixtures.fake_cuda import fake  # noqa: F401  (the fixture below)

# Fake CUDA tensors throughout: validation runs before anything touches a device.
pytestmark = pytest.mark.usefixtures("fake")


def test_dtypes():
    with pytest.raises(TypeError, match="dtype float32"):
        quack.gemm(_cuda(8, 8, dtype=torch.float32), _cuda(8, 8, dtype=torch.float32))
    with pytest.raises(TypeError, match="dtype float16"):
        quack.gemm(_cuda(8, 8), _cuda(8, 8, dtype=torch.float16))
    with pytest.raises(TypeError, match="out_dtype"):
        quack.gemm(_cuda(8, 8), _cuda(8, 8), out_dtype=torch.float64)
    with pytest.raises(TypeError, match="int32"):
        quack.gemm(_cuda(8, 8), _cuda(1, 8, 8), cu_seqlens_m=_cuda(2, dtype=torch.int64))


def test_devices():
    with pytest.raises(ValueError, match="CUDA device"):
        quack.gemm(torch.randn(8, 8, dtype=torch.bfloat16), torch.randn(8, 8, dtype=torch.bfloat16))


def test_shapes():
    with pytest.raises(ValueError, match="K mismatch"):
        quack.gemm(_cuda(8, 16), _cuda(8, 8))
    with pytest.raises(ValueError, match="2-D"):
        quack.gemm(_cuda(8, 8), _cuda(2, 8, 8))
    with pytest.raises(ValueError, match="3-D"):
        quack.gemm(_cuda(8, 8), _cuda(8, 8), cu_seqlens_m=_cuda(3, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"shape \(3,\) for 2 groups"):
        quack.gemm(_cuda(8, 8), _cuda(2, 8, 8), cu_seqlens_m=_cuda(4, dtype=torch.int32))


def test_no_groups_with_rows():
    with pytest.raises(ValueError, match="no groups but A has 8 rows"):
        quack.gemm(_cuda(8, 8), _cuda(0, 8, 8), cu_seqlens_m=_cuda(1, dtype=torch.int32))


def test_alignment():
    # K = 12 in a K-contiguous A: its rows start 24 bytes apart, which TMA cannot address.
    with pytest.raises(ValueError, match="A stride 12 of dim 0 must be a multiple of 8"):
        quack.gemm(_cuda(8, 12), _cuda(12, 8))
    with pytest.raises(ValueError, match="B stride 12 of dim 1 must be a multiple of 8"):
        quack.gemm(_cuda(12, 8).t(), _cuda(16, 12).t())
    with pytest.raises(ValueError, match="N = 12 must be a multiple of 8"):
        quack.gemm(_cuda(8, 8), _cuda(8, 12))
    with pytest.raises(ValueError, match="broadcast along dim 0"):
        quack.gemm(_cuda(1, 8).expand(8, 8), _cuda(8, 8).t())
    with pytest.raises(ValueError, match="16-byte aligned"):
        quack.gemm(_cuda(72).as_strided((8, 8), (8, 1), 1), _cuda(8, 8))
    with pytest.raises(ValueError, match="stride 12"):
        quack.gemm(_cuda(96).as_strided((8, 8), (12, 1)), _cuda(8, 8))
    with pytest.raises(ValueError, match=r"below 2\^31"):
        quack.gemm(_cuda(2**31, 8), _cuda(8, 8))


def test_any_k_that_tma_can_address(monkeypatch):
    # A weight gradient over 12 tokens (K): Aᵀ M-contiguous and dC
    # N-contiguous have aligned strides, so K itself is free, dense or
    # grouped along K.  (Accepted calls would warm their plans here.)
    from quack.calls.plan import Plan
    from quack.families.gemm.operands import kernel_operands

    monkeypatch.setattr(Plan, "warm", lambda plan: None)
    assert quack.gemm(_cuda(12, 8).t(), _cuda(12, 16)).shape == (8, 16)
    assert quack.gemm(_cuda(12, 8).t(), _cuda(12, 16), cu_seqlens_k=_cuda(3, dtype=torch.int32)).shape == (2, 8, 16)
    # One row of any K: a size-1 dim's stride means nothing, so it is rounded up.
    assert quack.gemm(_cuda(1, 12), _cuda(12, 16)).shape == (1, 16)
    # dA = dC @ Bᵀ of such a K: its rows are stored padded to 8 columns (a view).
    ops = kernel_operands(_cuda(200, 136), _cuda(612, 136).t(), torch.bfloat16, None, "dense")
    assert ops.out.shape == (200, 612) and ops.out.stride() == (616, 1)


def test_variable_length_k():
    cu = _cuda(3, dtype=torch.int32)
    with pytest.raises(ValueError, match="not both"):
        quack.gemm(_cuda(8, 16), _cuda(2, 16, 8), cu_seqlens_m=cu, cu_seqlens_k=cu)
    with pytest.raises(ValueError, match=r"2-D \(K, N\) with cu_seqlens_k"):
        quack.gemm(_cuda(8, 16), _cuda(2, 16, 8), cu_seqlens_k=cu)
    with pytest.raises(TypeError, match="cu_seqlens_k must be int32"):
        quack.gemm(_cuda(8, 16), _cuda(16, 8), cu_seqlens_k=_cuda(3, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"cu_seqlens_k must have shape \(G \+ 1,\)"):
        quack.gemm(_cuda(8, 16), _cuda(16, 8), cu_seqlens_k=_cuda(0, dtype=torch.int32))
    # 12 tokens: fine as the M-contiguous Aᵀ of a weight gradient, refused K-contiguous.
    with pytest.raises(ValueError, match="A stride 12 of dim 0"):
        quack.gemm(_cuda(8, 12), _cuda(12, 8), cu_seqlens_k=cu)


def test_bias():
    with pytest.raises(ValueError, match="contiguous vector of N = 8"):
        quack.gemm(_cuda(8, 16), _cuda(16, 8), bias=_cuda(16))
    with pytest.raises(ValueError, match="4-byte aligned"):
        quack.gemm(_cuda(8, 16), _cuda(16, 8), bias=_cuda(9).as_strided((8,), (1,), 1))


def test_a_refused_call_warms_nothing(monkeypatch):
    # Compile-only mode warms a call's plan: not before the alignment checks refuse the call.
    from quack.calls.plan import Plan

    warmed = []
    monkeypatch.setattr(Plan, "warm", lambda plan: warmed.append(plan))
    with pytest.raises(ValueError, match="4-byte aligned"):
        quack.gemm(_cuda(8, 16), _cuda(16, 8), bias=_cuda(9).as_strided((8,), (1,), 1))
    assert warmed == []


def test_gated():
    with pytest.raises(ValueError, match="activation must be one of"):
        quack.gemm_glu(_cuda(8, 16), _cuda(16, 16), activation="silu")
    with pytest.raises(ValueError, match="activation must be one of"):
        quack.gemm(_cuda(8, 16), _cuda(16, 16), activation="swiglu")
    with pytest.raises(ValueError, match="2 N with N a multiple of 8"):
        quack.gemm_glu(_cuda(8, 16), _cuda(16, 24))
    with pytest.raises(TypeError, match="dtype float16"):
        quack.gemm_glu(_cuda(8, 16), _cuda(16, 16, dtype=torch.float16))
    with pytest.raises(ValueError, match="3-D"):
        quack.gemm_glu(_cuda(8, 16), _cuda(16, 16), cu_seqlens_m=_cuda(2, dtype=torch.int32))


def test_option_arguments_of_the_wrong_type():
    for out_dtype in ([], "bfloat16", 3):
        with pytest.raises(TypeError, match=r"out_dtype must be torch.bfloat16, torch.float16 or torch.float32, got"):
            quack.gemm(_cuda(8, 8), _cuda(8, 8), out_dtype=out_dtype)
        with pytest.raises(TypeError, match="out_dtype must be"):
            quack.gemm_glu(_cuda(8, 8), _cuda(8, 16), out_dtype=out_dtype)
    for activation in ([], 3, {"relu"}):
        with pytest.raises(TypeError, match="activation must be a str or None, got"):
            quack.gemm(_cuda(8, 8), _cuda(8, 8), activation=activation)
        with pytest.raises(TypeError, match="activation must be a str or None, got"):
            quack.gemm_glu(_cuda(8, 8), _cuda(8, 16), activation=activation)
        with pytest.raises(TypeError, match="activation must be a str or None, got"):
            quack.mlp(_cuda(8, 8), _cuda(8, 16), _cuda(16, 8), activation=activation)
    with pytest.raises(TypeError, match="bias must be a torch.Tensor, got list"):
        quack.gemm(_cuda(8, 8), _cuda(8, 8), bias=[0.0] * 8)
    with pytest.raises(TypeError, match="cu_seqlens_m must be an int32 torch.Tensor, got list"):
        quack.gemm(_cuda(8, 8), _cuda(1, 8, 8), cu_seqlens_m=[0, 8])
    with pytest.raises(TypeError, match="cu_seqlens_k must be an int32 torch.Tensor, got tuple"):
        quack.gemm(_cuda(8, 8), _cuda(8, 8), cu_seqlens_k=(0, 8))
    with pytest.raises(TypeError, match="cu_seqlens_m must be an int32 torch.Tensor, got list"):
        quack.mlp(_cuda(8, 8), _cuda(1, 8, 16), _cuda(1, 16, 8), "relu", cu_seqlens_m=[0, 8])
    with pytest.raises(TypeError, match="w2 must be a torch.Tensor, got list"):
        quack.mlp(_cuda(8, 8), _cuda(8, 16), [[0.0] * 8] * 16, "relu")


def test_an_unhashable_out_dtype_reaches_the_checks_on_the_fast_path(monkeypatch):
    # Outside compile-only mode the call first tries the eager fast path,
    # whose key spells out_dtype as a number.
    from quack.compile_only import _COMPILE_ONLY_DEPTH

    token = _COMPILE_ONLY_DEPTH.set(0)
    try:
        with pytest.raises(ValueError, match="A must be on a CUDA device"):
            quack.gemm(torch.ones(8, 8, dtype=torch.bfloat16, device="cpu"), torch.ones(8, 8, dtype=torch.bfloat16),
                       out_dtype=[])
    finally:
        _COMPILE_ONLY_DEPTH.reset(token)
