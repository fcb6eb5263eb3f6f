"""Cross-entropy against the fp32 reference, forward and backward, on the GPU.

Run: ``pytest tests/test_cross_entropy.py`` (needs a GPU), or
``pytest --compile-only tests/test_cross_entropy.py`` to compile and export
every kernel these tests use without one.
"""

import pytest
import torch

import quack
from quack.cross_entropy import cross_entropy_ref
from quack.testing.autograd import vjp

# (atol, rtol) per logits dtype: losses are computed in fp32 and rounded to
# the logits' dtype once; a loss is about log(N) (up to ~12.5 at N = 262144).
TOLERANCE = {
    torch.float32: (1e-4, 1e-5),
    torch.float16: (1e-3, 2e-3),
    torch.bfloat16: (1e-2, 1.6e-2),
}
# Gradients: softmax values in the logits' dtype; atol is relative to the
# largest reference gradient (a mean divides everything by the row count).
GRAD_TOLERANCE = {
    torch.float32: (1e-5, 1e-4),
    torch.float16: (2e-3, 4e-3),
    torch.bfloat16: (1e-2, 3e-2),
}

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# N: tiny, odd (element copies for 16-bit data), not a power of two, 4-byte
# vectors (1026), the largest single-CTA row, cluster sizes 2, 4, 8/16.
SIZES_N = [1, 7, 100, 1000, 1026, 4097, 16384, 32768, 65536, 262144]
SIZES_M = [1, 37]
IGNORE = -100

pytestmark = pytest.mark.gpu


def _inputs(m, n, dtype, target_dtype=torch.int64, ignore_every=5):
    """Logits and targets; every ``ignore_every``-th row is ignored (0: none)."""
    torch.manual_seed(0)
    logits = 4 * torch.randn(m, n, device="cuda", dtype=dtype)
    target = torch.randint(0, n, (m,), device="cuda", dtype=target_dtype)
    if ignore_every:
        rows = torch.arange(m, device="cuda")
        target = torch.where(rows % ignore_every == 1, IGNORE, target).to(target_dtype)
    return logits, target


@pytest.mark.parametrize("n", SIZES_N)
@pytest.mark.parametrize("m", SIZES_M)
@pytest.mark.parametrize("dtype", DTYPES)
def test_forward(m, n, dtype):
    logits, target = _inputs(m, n, dtype)
    atol, rtol = TOLERANCE[dtype]
    loss = quack.cross_entropy(logits, target, reduction="none")
    torch.testing.assert_close(loss, cross_entropy_ref(logits, target, reduction="none"), atol=atol, rtol=rtol)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("target_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("n", [100, 4097, 65536])
def test_reductions_and_target_dtypes(n, target_dtype, reduction):
    logits, target = _inputs(33, n, torch.bfloat16, target_dtype)
    loss = quack.cross_entropy(logits, target, reduction=reduction)
    ref = cross_entropy_ref(logits, target, reduction=reduction)
    # A sum of 33 losses carries 33 times the rounding of one.
    atol = 1e-2 * (33 if reduction == "sum" else 1)
    torch.testing.assert_close(loss, ref, atol=atol, rtol=1.6e-2)


def _check_grads(logits, target, reduction):
    dtype = logits.dtype

    def cot(outs):
        return tuple(torch.randn_like(o) for o in outs)

    torch.manual_seed(1)
    (loss,), (dx,) = vjp(lambda a: quack.cross_entropy(a, target, reduction=reduction), (logits,), cot)
    torch.manual_seed(1)
    (loss_ref,), (dx_ref,) = vjp(
        lambda a: cross_entropy_ref(a, target, reduction=reduction), (logits.float(),), cot
    )
    atol, rtol = GRAD_TOLERANCE[dtype]
    scale = dx_ref.abs().max().item()
    torch.testing.assert_close(dx.float(), dx_ref, atol=atol * scale, rtol=rtol)


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("n", [7, 1000, 4097, 16384, 65536, 262144])
@pytest.mark.parametrize("dtype", DTYPES)
def test_backward(n, dtype, reduction):
    m = 37 if n <= 65536 else 5
    logits, target = _inputs(m, n, dtype)
    _check_grads(logits, target, reduction)


def test_backward_sum_int32_targets():
    logits, target = _inputs(9, 3000, torch.float32, torch.int32)
    _check_grads(logits, target, "sum")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [3000, 65536])
def test_large_and_masked_logits(n, dtype):
    # A large offset and -inf logits (a masked vocabulary) filling whole thread
    # and cluster-peer slices, with the exact (fp32) and fused (bf16) exponent.
    logits, target = _inputs(4, n, dtype, ignore_every=0)
    cols = torch.arange(n, device="cuda")
    logits = torch.where(cols < n // 2, float("-inf"), logits + 100.0)
    target = n // 2 + target % (n - n // 2)
    atol, rtol = TOLERANCE[dtype]
    loss = quack.cross_entropy(logits, target, reduction="none")
    torch.testing.assert_close(loss, cross_entropy_ref(logits, target, reduction="none"), atol=atol, rtol=rtol)


def test_all_rows_ignored_mean_is_nan():
    logits, _ = _inputs(4, 100, torch.float32)
    target = torch.full((4,), IGNORE, device="cuda", dtype=torch.int64)
    assert torch.isnan(quack.cross_entropy(logits, target)).item()
    assert quack.cross_entropy(logits, target, reduction="sum").item() == 0.0


def test_custom_ignore_index_and_leading_dims():
    logits, target = _inputs(12, 512, torch.bfloat16, ignore_every=0)
    target = torch.where(target % 3 == 0, 7, target)  # 7 is also the ignore_index
    x3, t3 = logits.view(3, 4, 512), target.view(3, 4)
    for reduction in ("mean", "none"):
        torch.testing.assert_close(
            quack.cross_entropy(x3, t3, ignore_index=7, reduction=reduction),
            cross_entropy_ref(x3, t3, ignore_index=7, reduction=reduction),
            atol=1e-2, rtol=1.6e-2,
        )
    empty = torch.empty(0, 512, device="cuda", dtype=torch.bfloat16)
    empty_t = torch.empty(0, device="cuda", dtype=torch.int64)
    assert quack.cross_entropy(empty, empty_t, reduction="none").shape == (0,)


def test_out_of_range_target_gives_nan_row():
    # Rows 2 and 3 have targets N and -5: never read out of bounds, loss NaN.
    logits, target = _inputs(6, 1000, torch.float32, ignore_every=0)
    bad = torch.tensor([0, 0, 1, 1, 0, 0], device="cuda", dtype=torch.bool)
    target = torch.where(bad, torch.tensor([0, 0, 1000, -5, 0, 0], device="cuda"), target)
    loss = quack.cross_entropy(logits, target, reduction="none")
    torch.testing.assert_close(torch.isnan(loss), bad)
    ref = cross_entropy_ref(logits, torch.where(bad, 0, target), reduction="none")
    torch.testing.assert_close(torch.where(bad, 0.0, loss), torch.where(bad, 0.0, ref), atol=1e-4, rtol=1e-5)


@pytest.mark.no_compile_only
def test_check_targets_names_the_row(monkeypatch):
    logits, target = _inputs(6, 1000, torch.float32, ignore_every=0)
    target[4] = 1000
    with pytest.raises(ValueError, match=r"target\[4\] = 1000 is outside \[0, 1000\)"):
        quack.cross_entropy(logits, target, check_targets=True)
    monkeypatch.setenv("QUACK_CHECK_TARGETS", "1")
    with pytest.raises(ValueError, match=r"target\[4\]"):
        quack.cross_entropy(logits, target)
    target[4] = -100  # ignore_index is not out of range
    quack.cross_entropy(logits, target)


@pytest.mark.no_compile_only
def test_torch_compile_fullgraph():
    # N = 1000 bf16 with int64 targets, forward and backward: test_forward and
    # test_backward warm both objects.
    logits, target = _inputs(37, 1000, torch.bfloat16)
    logits.requires_grad_()
    fn = torch.compile(lambda a, t: quack.cross_entropy(a, t) * 2, fullgraph=True)
    loss = fn(logits, target)
    torch.testing.assert_close(loss, cross_entropy_ref(logits.detach(), target) * 2, atol=2e-2, rtol=1.6e-2)
    (dx,) = torch.autograd.grad(loss, logits)
    (dx_ref,) = torch.autograd.grad(cross_entropy_ref(logits.float(), target) * 2, logits)
    torch.testing.assert_close(dx.float(), dx_ref.float(), atol=1e-3, rtol=3e-2)
