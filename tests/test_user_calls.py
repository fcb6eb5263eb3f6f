"""The calls users make, at the production manifest's shapes, hit the artifact.

Inference under ``torch.no_grad()`` and ``torch.inference_mode()`` with
``nn.Parameter`` weights, bias and residual on and off, fp32 and bf16 norm
weights, training forward + backward, and ``torch.compile(fullgraph=True)``.
No test file warms these shapes: only tools/configs/production.jsonl does, so
a strict run (Bazel's GPU test, or the GPU machine against the Bazel-built
artifact) passes exactly when the manifest covers what these calls need.
Values are checked against the fp32 references.  A repeated inference call
takes the eager fast path (quack/calls/fastpath.py) and gives the first call's
bits, on the current stream.
"""

import contextlib

import pytest
import torch

import quack
import quack.cache
from quack.calls import fastpath
from quack.testing import matrix
from quack.testing.autograd import vjp

pytestmark = pytest.mark.gpu

BF16 = torch.bfloat16
ROW_SHAPES = [(32768, 4096), (16384, 16384), (8192, 65536), (4096, 262144)]
MODES = {
    "no_grad": torch.no_grad,
    "inference_mode": torch.inference_mode,
    "train": contextlib.nullcontext,
    "compiled_train": contextlib.nullcontext,
}


def _params(n, weight_dtype, bias):
    torch.manual_seed(0)
    w = torch.nn.Parameter(1 + 0.5 * torch.randn(n, device="cuda", dtype=weight_dtype))
    b = torch.nn.Parameter(0.5 * torch.randn(n, device="cuda", dtype=weight_dtype)) if bias else None
    return w, b


def _run(fn, ref, x, params, mode):
    """The call as a user makes it in ``mode``; training checks every gradient."""
    if mode in ("no_grad", "inference_mode"):
        # The reference too: under --compile-only, autograd on the fake CUDA
        # Parameters would abort the process.
        with MODES[mode]():
            out = fn(x, *params)
            want = ref(x, *params)
        torch.testing.assert_close(out.float(), want.float(), atol=3e-2, rtol=2e-2)
        return
    call = matrix.compiled(fn) if mode == "compiled_train" else fn
    inputs = [x, *(p for p in params if p is not None)]
    n_params = sum(p is not None for p in params)

    def with_params(x, *ps):
        it = iter(ps)
        return call(x, *(next(it) if p is not None else None for p in params))

    def reference(x, *ps):
        it = iter(ps)
        return ref(x.float(), *(next(it).float() if p is not None else None for p in params))

    got, grads = vjp(with_params, inputs, matrix.random_cotangents)
    want, want_grads = vjp(reference, inputs, lambda outs: [c.float() for c in matrix.random_cotangents(got)])
    for g, w in zip(got + grads, want + want_grads):
        torch.testing.assert_close(g.float(), w.float(), atol=2e-2, rtol=5e-2)
    assert len(grads) == 1 + n_params


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("weight_dtype", [BF16, torch.float32], ids=["w_bf16", "w_fp32"])
@pytest.mark.parametrize("shape", ROW_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_norms(shape, weight_dtype, mode):
    x = torch.randn(shape, device="cuda", dtype=BF16)
    for bias in (False, True):
        w, b = _params(shape[1], weight_dtype, bias)
        _run(lambda x, w, b: quack.layernorm(x, w, b), lambda x, w, b: quack.layernorm_ref(x, w, b), x, (w, b), mode)
    w, _ = _params(shape[1], weight_dtype, False)
    _run(lambda x, w: quack.rmsnorm(x, w), lambda x, w: quack.rmsnorm_ref(x, w), x, (w,), mode)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("n", [5120, 8192])
def test_rmsnorm_with_residual(n, mode):
    x, r = torch.randn(8, n, device="cuda", dtype=BF16), torch.randn(8, n, device="cuda", dtype=BF16)
    w, _ = _params(n, torch.float32, False)
    _run(lambda x, w: quack.rmsnorm(x, w, residual=r)[0], lambda x, w: quack.rmsnorm_ref(x, w, residual=r.to(x.dtype))[0],
         x, (w,), mode)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("shape", ROW_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_softmax_and_cross_entropy(shape, mode):
    x = torch.randn(shape, device="cuda", dtype=BF16)
    target = torch.randint(0, shape[1], shape[:1], device="cuda")
    _run(quack.softmax, quack.softmax_ref, x, (), mode)
    _run(lambda x: quack.cross_entropy(x, target), lambda x: quack.cross_entropy_ref(x, target), x, (), mode)


@pytest.mark.parametrize("b_layout", ["row", "col"])
def test_gemm(b_layout):
    a = torch.randn(8192, 8192, device="cuda", dtype=BF16)
    b = torch.randn(8192, 8192, device="cuda", dtype=BF16)
    if b_layout == "col":  # K contiguous: element (k, n) at k + 8192 n
        b = b.as_strided((8192, 8192), (1, 8192))
    with torch.inference_mode():
        torch.testing.assert_close(quack.gemm(a, b).float(), quack.gemm_ref(a, b).float(), atol=0.5, rtol=2e-2)


# ---- the eager fast path (quack/calls/fastpath.py) ----------------------------------


def _inference_calls():
    """(name, call) at shapes the production manifest warms for inference."""
    torch.manual_seed(0)
    x = torch.randn(8, 4096, device="cuda", dtype=BF16)
    x3 = torch.randn(2, 3, 4096, device="cuda", dtype=BF16)  # rows from leading dims
    w = torch.nn.Parameter(torch.randn(4096, device="cuda", dtype=BF16))
    w32 = torch.randn(5120, device="cuda")
    h = torch.randn(4, 5120, device="cuda", dtype=BF16)
    r = torch.randn(4, 5120, device="cuda", dtype=BF16)
    target = torch.randint(0, 4096, (8,), device="cuda")
    target3 = torch.randint(0, 4096, (2, 3), device="cuda")
    a = torch.randn(256, 4096, device="cuda", dtype=BF16)
    b = torch.randn(4096, 4096, device="cuda", dtype=BF16)
    return [
        ("rmsnorm", lambda: quack.rmsnorm(x, w)),
        ("rmsnorm_3d", lambda: quack.rmsnorm(x3, w)),
        ("rmsnorm_residual", lambda: quack.rmsnorm(h, w32, residual=r)),
        ("softmax", lambda: quack.softmax(x)),
        ("layernorm", lambda: quack.layernorm(x, w, w)),
        ("layernorm_no_bias", lambda: quack.layernorm(x, w)),
        ("gemm", lambda: quack.gemm(a, b.t())),
        ("gemm_decode_row", lambda: quack.gemm(x[-1:], b)),  # one row, as a decode step slices it
        ("gemm_decode", lambda: quack.gemm(x, b)),  # split K
        ("cross_entropy", lambda: quack.cross_entropy(x, target)),
        ("cross_entropy_3d", lambda: quack.cross_entropy(x3, target3)),  # a 2-D target, flattened
    ]


def _requires_the_c_launcher():
    from quack.launch.launcher import launcher_kind

    if launcher_kind() != "C":
        pytest.skip("the fast path needs the C launcher (quack/launch/_fastlaunch.c), not built here")


def _memory_hits() -> int:
    return quack.cache.stats()["hits"].get("memory", 0)


def _closures() -> int:
    return sum(len(table) for table in fastpath._TABLES)


def _flat(out):
    return out if isinstance(out, tuple) else (out,)


@pytest.mark.no_compile_only  # counts closures, which compile-only mode never makes
@pytest.mark.parametrize(
    "name", ["rmsnorm", "rmsnorm_3d", "rmsnorm_residual", "softmax", "layernorm", "layernorm_no_bias", "gemm",
             "gemm_decode_row", "gemm_decode", "cross_entropy", "cross_entropy_3d"]
)
def test_a_repeated_call_takes_the_closure_and_gives_the_same_bits(name):
    _requires_the_c_launcher()
    call = dict(_inference_calls())[name]
    with torch.no_grad():
        first = _flat(call())
        kept, lookups = _closures(), _memory_hits()
        again = _flat(call())
    assert _closures() == kept  # the second call added nothing: it found the first's closure
    assert _memory_hits() == lookups  # and asked the cache for no kernel: the closure launched
    assert kept > 0
    for a, b in zip(first, again):
        assert torch.equal(a, b)


@pytest.mark.no_compile_only
def test_the_fast_path_launches_on_the_current_stream():
    x = torch.randn(64, 4096, device="cuda", dtype=BF16)
    w = torch.randn(4096, device="cuda", dtype=BF16)
    with torch.no_grad():
        want = quack.rmsnorm(x, w)  # also sets up the closure
        quack.rmsnorm(x, w)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            y = torch.zeros_like(x)
            torch.cuda._sleep(20_000_000)  # the stream stays busy long after the host moves on
            y.copy_(x)
            out = quack.rmsnorm(y, w)  # must run after the copy, on `side`
        torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(out, want)


@pytest.mark.no_compile_only
def test_a_call_that_will_run_a_backward_takes_the_full_path():
    x = torch.randn(8, 4096, device="cuda", dtype=BF16)
    w = torch.nn.Parameter(torch.randn(4096, device="cuda", dtype=BF16))
    with torch.no_grad():
        quack.rmsnorm(x, w)
        quack.rmsnorm(x, w)
    y = quack.rmsnorm(x, w)  # grad mode, w requires grad: the training plan, with a graph
    assert y.requires_grad and y.grad_fn is not None
    y.float().sum().backward()
    assert w.grad is not None and torch.isfinite(w.grad).all()
