"""Cross-entropy against a float64 reference, forward and backward, on the GPU.

Run: ``pytest tests/test_cross_entropy.py`` (needs a GPU), or
``pytest --compile-only tests/test_cross_entropy.py`` to compile and export
every kernel these tests use without one.
"""

import pytest
import torch

import quack
from quack.families.cross_entropy.op import cross_entropy_ref
from quack.testing import matrix

# (atol, rtol) per logits dtype, for the hand-written cases below: losses
# are computed in fp32 and rounded to the logits' dtype once; a loss is about
# log(N) (up to ~12.5 at N = 262144).
TOLERANCE = {
    torch.float32: (1e-4, 1e-5),
    torch.float16: (1e-3, 2e-3),
    torch.bfloat16: (1e-2, 1.6e-2),
}
IGNORE = -100

pytestmark = pytest.mark.gpu

# Every option of quack.cross_entropy, crossed (quack/testing/matrix.py): the
# logits' dtype, the targets' dtype, rows with ignore_index (none, every fifth,
# all), the reduction, whether the logits require grad (and inference under
# torch.no_grad()), the row-wise size classes.
TABLE = {
    "dtype": [torch.float32, torch.float16, torch.bfloat16],
    "target_dtype": [torch.int32, torch.int64],
    "ignored": ["none", "some", "all"],
    "reduction": ["mean", "sum", "none"],
    "mode": [matrix.INFERENCE, matrix.EVAL, "grad_x"],
    "n": list(matrix.ROW_N),
    "m": list(matrix.ROW_M),
    "lead": list(matrix.LEAD),
}
CASES = matrix.cases(TABLE, paired=["dtype", "target_dtype", "ignored", "reduction", "mode", "n", "m"])


def _inputs(shape, dtype, target_dtype=torch.int64, ignored="some"):
    """Logits (as ``x``) and targets; ``ignored``: which rows are ignore_index
    (none, every fifth, all)."""
    torch.manual_seed(0)
    n = shape[-1]
    logits = 4 * torch.randn(shape, device="cuda", dtype=dtype)
    target = torch.randint(0, n, shape[:-1], device="cuda", dtype=target_dtype)
    if ignored != "none":
        rows = torch.arange(target.numel(), device="cuda").view(target.shape)
        skip = rows % 5 == 1 if ignored == "some" else torch.ones_like(rows, dtype=torch.bool)
        target = torch.where(skip, IGNORE, target).to(target_dtype)
    return logits, target


def _fns(reduction, ignore_index=IGNORE):
    """(ours, reference, torch's) as functions of x and target."""
    def ours(x, target):
        return quack.cross_entropy(x, target, ignore_index=ignore_index, reduction=reduction)

    def theirs(x, target):
        n = x.shape[-1]
        loss = torch.nn.functional.cross_entropy(
            x.reshape(-1, n), target.reshape(-1).long(), ignore_index=ignore_index, reduction=reduction
        )
        return loss.view(target.shape) if reduction == "none" else loss

    return ours, theirs, theirs


@pytest.mark.parametrize("case", CASES, ids=matrix.case_id)
def test_matrix(case):
    shape = matrix.row_case_shape(case)
    logits, target = _inputs(shape, case["dtype"], case["target_dtype"], case["ignored"])
    inputs = {"x": logits, "target": target}
    matrix.check_case(*_fns(case["reduction"]), inputs, (), case["mode"], matrix.random_cotangents)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [3000, 65536])
def test_large_and_masked_logits(n, dtype):
    # A large offset and -inf logits (a masked vocabulary) filling whole thread
    # and cluster-peer slices, with the exact (fp32) and fused (bf16) exponent.
    logits, target = _inputs((4, n), dtype, ignored="none")
    cols = torch.arange(n, device="cuda")
    logits = torch.where(cols < n // 2, float("-inf"), logits + 100.0)
    target = n // 2 + target % (n - n // 2)
    atol, rtol = TOLERANCE[dtype]
    loss = quack.cross_entropy(logits, target, reduction="none")
    torch.testing.assert_close(loss, cross_entropy_ref(logits, target, reduction="none"), atol=atol, rtol=rtol)


def test_custom_ignore_index_and_empty_batch():
    logits, target = _inputs((3, 4, 512), torch.bfloat16, ignored="none")
    target = torch.where(target % 3 == 0, 7, target)  # 7 is also the ignore_index
    for reduction in ("mean", "none"):
        matrix.check_case(*_fns(reduction, 7), {"x": logits, "target": target}, (), "grad_x", matrix.random_cotangents)
    empty = torch.empty(0, 512, device="cuda", dtype=torch.bfloat16)
    empty_t = torch.empty(0, device="cuda", dtype=torch.int64)
    assert quack.cross_entropy(empty, empty_t, reduction="none").shape == (0,)


def test_out_of_range_target_gives_nan_row():
    # Rows 2 and 3 have targets N and -5: never read out of bounds, loss NaN.
    logits, target = _inputs((6, 1000), torch.float32, ignored="none")
    bad = torch.tensor([0, 0, 1, 1, 0, 0], device="cuda", dtype=torch.bool)
    target = torch.where(bad, torch.tensor([0, 0, 1000, -5, 0, 0], device="cuda"), target)
    loss = quack.cross_entropy(logits, target, reduction="none")
    torch.testing.assert_close(torch.isnan(loss), bad)
    ref = cross_entropy_ref(logits, torch.where(bad, 0, target), reduction="none")
    torch.testing.assert_close(torch.where(bad, 0.0, loss), torch.where(bad, 0.0, ref), atol=1e-4, rtol=1e-5)


@pytest.mark.no_compile_only
def test_check_targets_names_the_row(monkeypatch):
    logits, target = _inputs((6, 1000), torch.float32, ignored="none")
    target[4] = 1000
    with pytest.raises(ValueError, match=r"target\[4\] = 1000 is outside \[0, 1000\)"):
        quack.cross_entropy(logits, target, check_targets=True)
    monkeypatch.setenv("QUACK_CHECK_TARGETS", "1")
    with pytest.raises(ValueError, match=r"target\[4\]"):
        quack.cross_entropy(logits, target)


def test_check_targets_lets_ignore_index_through(monkeypatch):
    """A launching call, so compile-only warms its objects (the check itself
    reads values: skipped there)."""
    logits, target = _inputs((6, 1000), torch.float32)  # every fifth row ignore_index: not out of range
    monkeypatch.setenv("QUACK_CHECK_TARGETS", "1")
    torch.testing.assert_close(quack.cross_entropy(logits, target), quack.cross_entropy_ref(logits, target))


@pytest.mark.parametrize("n", [760, 65536])
def test_torch_compile_fullgraph(n):
    logits, target = _inputs((37, n), torch.bfloat16)
    ours, ref, theirs = _fns("mean")
    matrix.check_case(
        matrix.compiled(lambda x, target: ours(x, target) * 2), lambda **a: ref(**a) * 2,
        lambda **a: theirs(**a) * 2, {"x": logits, "target": target}, (), "grad_x", matrix.random_cotangents,
    )


@pytest.mark.no_compile_only  # streams and graphs of fake tensors; the matrix warms the same objects
def test_reducing_calls_on_streams_threads_and_a_graph_keep_their_scratch_apart():
    """A reducing call's scratch (row losses, the CTAs' counter) is its
    stream's, and a capture's its own: four threads, each with its own
    logits and stream, give their first call's loss 50 times; a graph
    captured on a stream that has run eager calls, replayed on another
    stream while eager calls run on the first, gives its loss too."""
    import threading

    def inputs(m, n):
        return torch.randn(m, n, device="cuda", dtype=torch.bfloat16), torch.randint(0, n, (m,), device="cuda")

    calls = [inputs(*shape) for shape in [(8, 4096), (64, 4096), (8, 4096), (64, 4096)]]  # (warmed objects)
    with torch.no_grad():
        refs = [quack.cross_entropy(*args) for args in calls]  # (also sets up the fast path)
    errors = []

    def work(i):
        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.default_stream())
            with torch.no_grad(), torch.cuda.stream(stream):  # (grad mode is per thread)
                losses = [quack.cross_entropy(*calls[i]) for _ in range(50)]
            stream.synchronize()
            assert all(torch.equal(loss, refs[i]) for loss in losses)
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors

    side, graph = torch.cuda.Stream(), torch.cuda.CUDAGraph()
    side.wait_stream(torch.cuda.default_stream())
    with torch.no_grad():
        with torch.cuda.stream(side):
            quack.cross_entropy(*calls[0])  # the side stream's kept scratch
        with torch.cuda.graph(graph, stream=side):
            captured = quack.cross_entropy(*calls[0])
        for _ in range(3):
            graph.replay()  # on the default stream
            with torch.cuda.stream(side):
                eager = [quack.cross_entropy(*calls[0]) for _ in range(5)]
            torch.cuda.synchronize()
            assert torch.equal(captured, refs[0]) and all(torch.equal(loss, refs[0]) for loss in eager)
