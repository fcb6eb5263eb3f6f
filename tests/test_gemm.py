"""The Hopper GEMM against torch on the GPU: dense, grouped by rows or along K,
with its autograd and fused epilogue.

Run: ``pytest tests/test_gemm.py`` (needs an sm_90 GPU), or
``pytest --compile-only tests/test_gemm.py`` to compile and export every
object these tests use without one.  One object per (dtypes, A and B layouts,
grouping, epilogue, tile config) serves every size below: the dims are dynamic.
"""

import sys

import pytest
import torch

import quack
from quack.compile_only import is_compile_only
from quack.families.gemm.op import gemm_ref
from quack.families.gemm.dact import activation_grad
from quack.families.gemm.epilogue import ACTIVATIONS, GATED, TORCH_ACTIVATIONS, gated_ref
from quack.testing import matrix
from quack.testing.autograd import vjp

pytestmark = pytest.mark.gpu


def _randn(*shape, dtype=torch.bfloat16):
    return torch.randn(*shape, device="cuda", dtype=dtype)


def _close(out, ref):
    # fp32 accumulation in a different order, one rounding to 16 bits.
    torch.testing.assert_close(out.float(), ref.float(), atol=5e-2, rtol=2e-2)


def _cu(lengths):
    """cu_seqlens from group lengths; the total comes back through .item()
    (a sentinel under --compile-only, as in user test code)."""
    lens = torch.tensor(lengths, device="cuda", dtype=torch.int32)
    cu = torch.nn.functional.pad(torch.cumsum(lens, 0, dtype=torch.int32), (1, 0))
    return cu, int(lens.sum().item())


# Every option of quack.gemm, crossed (quack/testing/matrix.py): the input
# dtype, A's layout (row-major: K contiguous; column-major: M contiguous, a
# transposed view), B's (row-major: N contiguous; column-major: K
# contiguous), the output dtype, dense or grouped by cu_seqlens_m (with empty
# groups, groups of 1-3 rows, large groups), which gradients autograd takes
# (B is the parameter), and the GEMM's size classes:
# M: none, one row, two, around the 64-row tile of the split-K class of a
#    few rows (63, 64, 65), a partial 128-row tile, two whole ones and one
#    row past them (256, 257; dense: the 128-row split-K class), many tiles
#    (the default object; for grouped calls, the total over the groups);
# K: none (zeros), one 8-wide step (below the 64-wide k-tile), an odd
#    multiple of 8 below one k-tile and above it, many k-tiles, and 65 of
#    them (split K: its splits of unequal lengths);
# N: 8, the 128-wide tile exactly and one step past it, around the 256-wide
#    tile (264) and two of them plus a step (520).
TABLE = {
    "dtype": [torch.bfloat16, torch.float16],
    "a_layout": ["row", "col"],
    "b_layout": ["row", "col"],
    "out_dtype": [None, torch.bfloat16, torch.float16, torch.float32],
    "grouping": ["dense", "varlen_empty", "varlen_tiny", "varlen_large"],
    "mode": list(matrix.MODES),
    "m": [0, 1, 2, 63, 64, 65, 200, 256, 257, 1000],
    "k": [0, 8, 24, 72, 1096, 4104],
    "n": [8, 128, 136, 264, 520],
}
CASES = matrix.cases(TABLE, paired=list(TABLE))
PARAMS = ("b",)


def _group_lengths(grouping: str, m: int) -> list[int]:
    """Rows per group for a total of M: two empty groups; groups of 1, 2 and
    3 rows then the rest; two large halves."""
    if grouping == "varlen_empty":
        return [0, m - m // 3, 0, m // 3]
    if grouping == "varlen_tiny":
        head = []
        for size in (1, 2, 3):
            if sum(head) + size <= m:
                head.append(size)
        return head + [m - sum(head)]
    return [m // 2, m - m // 2]


def _grouped_rows(grouping: str, m: int):
    """(cu_seqlens_m or None, total rows, groups or None) of a case's grouping."""
    if grouping == "dense":
        return None, m, None
    lengths = _group_lengths(grouping, m)
    cu, total = _cu(lengths)
    return cu, total, len(lengths)


def _operand(*shape, dtype, layout):
    """A tensor of ``shape`` whose last dim (row-major) or the one before it
    (column-major, a transposed view) is contiguous."""
    if layout == "row":
        return _randn(*shape, dtype=dtype)
    return _randn(*shape[:-2], shape[-1], shape[-2], dtype=dtype).transpose(-1, -2)


def _gemm_fns(cu, out_dtype):
    """(ours, reference, torch's) as functions of a and b: the reference
    multiplies in the inputs' precision (float64), torch's per group with
    torch.matmul in the inputs' dtype, then converts to the output dtype."""
    def ours(a, b):
        return quack.gemm(a, b, out_dtype=out_dtype, cu_seqlens_m=cu)

    def theirs(a, b):
        out = torch.empty(a.shape[0], b.shape[-1], device=a.device, dtype=out_dtype or a.dtype)
        if a.dtype == torch.float64:
            out = out.double()
        if cu is None:
            return out.copy_(a @ b)
        bounds = cu.tolist()
        for g in range(b.shape[0]):
            out[bounds[g]:bounds[g + 1]] = a[bounds[g]:bounds[g + 1]] @ b[g]
        return out

    return ours, theirs, theirs


@pytest.mark.parametrize("case", CASES, ids=matrix.case_id)
def test_matrix(case):
    torch.manual_seed(0)
    k, n, dtype = case["k"], case["n"], case["dtype"]
    cu, m, groups = _grouped_rows(case["grouping"], case["m"])
    b_shape = (k, n) if groups is None else (groups, k, n)
    inputs = {
        "a": _operand(m, k, dtype=dtype, layout=case["a_layout"]),
        "b": _operand(*b_shape, dtype=dtype, layout=case["b_layout"]),
    }
    matrix.check_case(*_gemm_fns(cu, case["out_dtype"]), inputs, PARAMS, case["mode"], matrix.random_cotangents)


# The fused epilogue, act(A @ B + bias): every activation, a bias in A's dtype
# or fp32 or none, dense and grouped rows, and which gradients autograd takes
# (B and the bias are parameters).
TABLE_EPILOGUE = {
    "dtype": [torch.bfloat16, torch.float16],
    "activation": list(ACTIVATIONS),
    "bias": [None, "same", "fp32"],
    "grouping": ["dense", "varlen_tiny"],
    "mode": list(matrix.MODES),
    "m": [1, 40, 200, 1000],
    "k": [8, 1096, 4104],
    "n": [8, 136, 520],
}
CASES_EPILOGUE = matrix.cases(TABLE_EPILOGUE, paired=list(TABLE_EPILOGUE)[:5])


def _epilogue_fns(cu, activation):
    """(ours, reference, torch's): torch's adds the bias and applies the
    activation in the inputs' dtype, after its GEMM's rounding."""
    def ours(a, b, bias):
        return quack.gemm(a, b, cu_seqlens_m=cu, bias=bias, activation=activation)

    _, product, _ = _gemm_fns(cu, None)

    def theirs(a, b, bias):
        z = product(a, b)
        z = z + bias.to(z.dtype) if bias is not None else z
        return TORCH_ACTIVATIONS[activation](z) if activation is not None else z

    return ours, theirs, theirs


@pytest.mark.parametrize("case", CASES_EPILOGUE, ids=matrix.case_id)
def test_epilogue(case):
    torch.manual_seed(0)
    k, n, dtype = case["k"], case["n"], case["dtype"]
    cu, m, groups = _grouped_rows(case["grouping"], case["m"])
    bias = {None: None, "same": dtype, "fp32": torch.float32}[case["bias"]]
    inputs = {
        "a": _randn(m, k, dtype=dtype),
        "b": _randn(*((k, n) if groups is None else (groups, k, n)), dtype=dtype),
        "bias": _randn(n, dtype=bias) if bias is not None else None,
    }
    matrix.check_case(*_epilogue_fns(cu, case["activation"]), inputs, ("b", "bias"), case["mode"],
                      matrix.random_cotangents)


# Enough tiles that every CTA runs several (each stages its tile's bias
# columns in shared memory once the last tile's epilogue has read its own),
# over K of one to many steps; N = 2184 leaves a partial last N tile,
# N = 120 takes 128-column tiles; grouped rows give partial tiles (stored row
# by row), the short groups first or last; fp16 inputs and an fp32 output.
TABLE_EPILOGUE_TILES = {
    "activation": ["gelu_tanh", "silu", "relu_sq"],
    "grouping": ["dense", "varlen_tiny", "varlen_tiny_last"],
    "k": [136, 1096],
    "n": [2184, 120],
    "dtype": [torch.bfloat16, torch.float16],
    "out_dtype": [None, torch.float32],
}


@pytest.mark.parametrize("case", matrix.cases(TABLE_EPILOGUE_TILES, paired=list(TABLE_EPILOGUE_TILES)),
                         ids=matrix.case_id)
def test_epilogue_over_many_tiles_per_cta(case):
    torch.manual_seed(0)
    m = 8192 + 77 if case["n"] > 128 else 40000 + 77
    lengths = None if case["grouping"] == "dense" else _group_lengths("varlen_tiny", m)
    if case["grouping"] == "varlen_tiny_last":
        lengths = lengths[::-1]
    cu = _cu(lengths)[0] if lengths else None
    k, n, dtype, out_dtype = case["k"], case["n"], case["dtype"], case["out_dtype"]
    inputs = {
        "a": _randn(m, k, dtype=dtype),
        "b": _randn(*((k, n) if lengths is None else (len(lengths), k, n)), dtype=dtype),
        "bias": _randn(n, dtype=dtype),
    }
    _, _, theirs = _epilogue_fns(cu, case["activation"])

    def ours(a, b, bias):
        return quack.gemm(a, b, cu_seqlens_m=cu, bias=bias, activation=case["activation"], out_dtype=out_dtype)

    def reference(a, b, bias):  # in float64 for the reference, else in the inputs' dtype, then D's
        return theirs(a, b, bias).to(out_dtype or a.dtype)

    matrix.check_case(ours, reference, reference, inputs, ("b", "bias"), matrix.INFERENCE, matrix.random_cotangents)


# The gated epilogue, act(A @ B_gate) * (A @ B_up) with B's gate and up
# columns interleaved: every gated activation, B's two layouts, dense and
# grouped rows, which gradients autograd takes; N (half of B's columns)
# below one output tile, past one and past two.
TABLE_GLU = {
    "dtype": [torch.bfloat16, torch.float16],
    "activation": list(GATED),
    "b_layout": ["row", "col"],
    "grouping": ["dense", "varlen_tiny"],
    "mode": list(matrix.MODES),
    "m": [1, 40, 200, 1000],
    "k": [8, 1096, 4104],
    "n": [8, 136, 264],
}
CASES_GLU = matrix.cases(TABLE_GLU, paired=list(TABLE_GLU)[:5])


def _glu_fns(cu, activation):
    """(ours, reference, torch's): torch's gates its GEMM's rounded output."""
    def ours(a, b):
        return quack.gemm_glu(a, b, activation=activation, cu_seqlens_m=cu)

    _, product, _ = _gemm_fns(cu, None)

    def theirs(a, b):
        return gated_ref(product(a, b), activation)

    return ours, theirs, theirs


@pytest.mark.parametrize("case", CASES_GLU, ids=matrix.case_id)
def test_glu(case):
    torch.manual_seed(0)
    k, n, dtype = case["k"], 2 * case["n"], case["dtype"]
    cu, m, groups = _grouped_rows(case["grouping"], case["m"])
    b_shape = (k, n) if groups is None else (groups, k, n)
    inputs = {"a": _randn(m, k, dtype=dtype), "b": _operand(*b_shape, dtype=dtype, layout=case["b_layout"])}
    matrix.check_case(*_glu_fns(cu, case["activation"]), inputs, PARAMS, case["mode"], matrix.random_cotangents)


# The MLP act(x @ W1) @ W2, whose backward computes dZ in the epilogue of
# dY @ W2ᵀ: every activation, plain and gated, dense and grouped rows, which
# gradients autograd takes (W1 and W2 are parameters); the hidden width
# below one tile, past one and past two (the gated derivative's tiles are
# 128 accumulator columns wide).  At least 16 rows: the tolerance is twice
# torch's largest error, which the 8 values of a single row do not sample
# (two roundings of ours, h's and y's, exceeded it once on the H200).
TABLE_MLP = {
    "dtype": [torch.bfloat16, torch.float16],
    "activation": [*ACTIVATIONS[1:], *GATED],
    "grouping": ["dense", "varlen_tiny"],
    "mode": list(matrix.MODES),
    "m": [16, 200, 1000],
    "k": [8, 1096],
    "hidden": [8, 136, 264],
    "n": [8, 136],
}
CASES_MLP = matrix.cases(TABLE_MLP, paired=list(TABLE_MLP)[:4])


def _mlp_fns(cu, activation):
    """(ours, reference, torch's): torch's rounds each GEMM's output."""
    def ours(x, w1, w2):
        return quack.mlp(x, w1, w2, activation=activation, cu_seqlens_m=cu)

    _, product, _ = _gemm_fns(cu, None)

    def theirs(x, w1, w2):
        z = product(x, w1)
        h = gated_ref(z, activation) if activation in GATED else TORCH_ACTIVATIONS[activation](z)
        return product(h, w2)

    return ours, theirs, theirs


@pytest.mark.parametrize("case", CASES_MLP, ids=matrix.case_id)
def test_mlp(case):
    torch.manual_seed(0)
    k, hidden, n, dtype = case["k"], case["hidden"], case["n"], case["dtype"]
    cu, m, groups = _grouped_rows(case["grouping"], case["m"])
    width = 2 * hidden if case["activation"] in GATED else hidden
    lead = () if groups is None else (groups,)
    inputs = {
        "x": _randn(m, k, dtype=dtype),
        "w1": _randn(*lead, k, width, dtype=dtype) / k**0.5,
        "w2": _randn(*lead, hidden, n, dtype=dtype) / hidden**0.5,
    }
    matrix.check_case(*_mlp_fns(cu, case["activation"]), inputs, ("w1", "w2"), case["mode"],
                      matrix.random_cotangents)


# Variable-length K (the weight gradient of a grouped GEMM): G products of
# A[:, cu[g]:cu[g+1]] @ B[cu[g]:cu[g+1]], crossed over the dtypes, both
# operands' layouts (a column-major A is the transposed activations of a
# weight gradient), the output dtype, and how K is split: empty groups,
# groups of 1-5 columns, boundaries off the 64-wide k-tile and the 8-wide
# vector, one group, none; M (rows of each product) and N as above.
K_SPLITS = {
    "empty": [0, 100, 0, 36, 0],
    "tiny": [1, 2, 3, 5, 61],
    "uneven": [64, 130, 7, 199, 0, 128],
    "one": [1096],
    "none": [],
}
TABLE_K = {
    "dtype": [torch.bfloat16, torch.float16],
    "a_layout": ["row", "col"],
    "b_layout": ["row", "col"],
    "out_dtype": [None, torch.bfloat16, torch.float16, torch.float32],
    "split": list(K_SPLITS),
    "m": [1, 200, 1000],
    "n": [8, 136, 520],
}
CASES_K = matrix.cases(TABLE_K, paired=list(TABLE_K))


def _varlen_k_fns(cu, out_dtype):
    """(ours, reference, torch's) of the variable-length-K product, torch's a
    loop of per-group matmuls in the inputs' dtype."""
    def ours(a, b):
        return quack.gemm(a, b, out_dtype=out_dtype, cu_seqlens_k=cu)

    def theirs(a, b):
        bounds = cu.tolist()
        out = torch.empty(len(bounds) - 1, a.shape[0], b.shape[1], device=a.device, dtype=out_dtype or a.dtype)
        out = out.double() if a.dtype == torch.float64 else out
        for g in range(len(bounds) - 1):
            out[g] = a[:, bounds[g]:bounds[g + 1]] @ b[bounds[g]:bounds[g + 1]]
        return out

    return ours, theirs, theirs


@pytest.mark.parametrize("case", CASES_K, ids=matrix.case_id)
def test_varlen_k(case):
    torch.manual_seed(0)
    cu, _ = _cu(K_SPLITS[case["split"]])
    total_k = sum(K_SPLITS[case["split"]])  # not through .item(): K's size rules need the real one
    m, n, dtype = case["m"], case["n"], case["dtype"]
    inputs = {
        "a": _operand(m, total_k, dtype=dtype, layout=case["a_layout"]),
        "b": _operand(total_k, n, dtype=dtype, layout=case["b_layout"]),
    }
    matrix.check_case(*_varlen_k_fns(cu, case["out_dtype"]), inputs, PARAMS, matrix.EVAL, None)


def test_varlen_k_refuses_gradients():
    cu, _ = _cu([8, 16])
    a, b = _randn(64, 24).requires_grad_(), _randn(24, 128)
    with pytest.raises(NotImplementedError, match="variable-length-K"):
        quack.gemm(a, b, cu_seqlens_k=cu)


GROUPS = [
    [2048] * 8,
    [1, 0, 300, 129, 0, 0, 1000, 7],  # empty groups, partial tiles
    [0, 0, 0],  # total_M = 0
    [513],
    [100, 37] * 32,  # 64 groups: the scan crosses several hundred items
    [256, 7] * 16,  # whole-tile (TMA) and predicated stores alternating, with a short K loop
]


@pytest.mark.parametrize("lengths", GROUPS, ids=lambda g: f"G{len(g)}-M{sum(g)}")
@pytest.mark.parametrize("n,k", [(256, 128), (520, 72)])
def test_varlen(lengths, n, k):
    torch.manual_seed(0)
    cu, total_m = _cu(lengths)
    a = _randn(total_m, k)
    b = _randn(len(lengths), k, n)
    out = quack.gemm(a, b, cu_seqlens_m=cu)
    assert out.shape == (total_m, n)
    _close(out, gemm_ref(a, b, cu_seqlens_m=cu))


def test_varlen_column_major_b():
    torch.manual_seed(0)
    cu, total_m = _cu([200, 0, 333])
    a = _randn(total_m, 256)
    b = _randn(3, 512, 256).transpose(1, 2)  # (G, K, N), K contiguous
    _close(quack.gemm(a, b, cu_seqlens_m=cu), gemm_ref(a, b, cu_seqlens_m=cu))


def test_varlen_groups_ending_before_the_last_row():
    # Rows past cu[G] belong to no group: their values are unspecified (left
    # unwritten); the rows inside the groups are right.
    torch.manual_seed(0)
    cu = torch.tensor([0, 100, 190], device="cuda", dtype=torch.int32)
    a, b = _randn(256, 64), _randn(2, 64, 128)
    out = quack.gemm(a, b, cu_seqlens_m=cu)
    _close(out.narrow(0, 0, 190), gemm_ref(a.narrow(0, 0, 190), b, cu_seqlens_m=cu))


def test_varlen_groups_past_the_end_of_a():
    # cu[G] > total_M (a caller bug): no crash, and the rows that exist are
    # right.  (Whether rows past A's end are touched is not observable from
    # here; the kernel clamps its row bounds to A's.)
    torch.manual_seed(0)
    cu = torch.tensor([0, 300], device="cuda", dtype=torch.int32)
    a, b = _randn(200, 64), _randn(1, 64, 256)
    out = quack.gemm(a, b, cu_seqlens_m=cu)
    _close(out, gemm_ref(a, b.select(0, 0)))


def test_torch_compile_fullgraph():
    torch.manual_seed(0)
    inputs = {"a": _randn(300, 256), "b": _randn(256, 520)}
    ours, ref, theirs = _gemm_fns(None, None)
    matrix.check_case(
        matrix.compiled(lambda a, b: ours(a, b) * 2), lambda **t: ref(**t) * 2, lambda **t: theirs(**t) * 2,
        inputs, (), matrix.EVAL, None,
    )


def test_varlen_malformed_cu_seqlens():
    # Negative, decreasing and past-the-end bounds are clamped into [0, total_M]
    # and made non-decreasing: no crash, and the rows that only one clamped
    # group covers are right.
    torch.manual_seed(0)
    cu = torch.tensor([-50, 50, 30, 1000], device="cuda", dtype=torch.int32)
    a, b = _randn(100, 64), _randn(3, 64, 128)
    out = quack.gemm(a, b, cu_seqlens_m=cu)
    _close(out.narrow(0, 0, 30), gemm_ref(a.narrow(0, 0, 30), b.select(0, 0)))
    _close(out.narrow(0, 50, 50), gemm_ref(a.narrow(0, 50, 50), b.select(0, 2)))


@pytest.mark.no_compile_only  # copies a fake strided tensor; other varlen tests warm the objects
def test_varlen_strided_cu_seqlens():
    torch.manual_seed(0)
    spaced = torch.tensor([0, -1, 70, -1, 300], device="cuda", dtype=torch.int32)
    cu = spaced.as_strided((3,), (2,))  # [0, 70, 300], not contiguous
    a, b = _randn(300, 64), _randn(2, 64, 128)
    _close(quack.gemm(a, b, cu_seqlens_m=cu), gemm_ref(a, b, cu_seqlens_m=cu.contiguous()))


def test_single_row_with_odd_row_stride():
    # A size-1 dim's stride means nothing, but TMA would reject it: it is replaced.
    torch.manual_seed(0)
    a = _randn(1, 200).as_strided((1, 64), (12, 1))
    b = _randn(64, 128)
    _close(quack.gemm(a, b), gemm_ref(a, b))


def test_single_row_of_any_k():
    # A decode row of K = 613: its row stride means nothing, so it is rounded up to 8.
    torch.manual_seed(0)
    a, b = _randn(1, 613), _randn(613, 136)
    out = quack.gemm(a, b)
    if not is_compile_only():
        _close(out, gemm_ref(a, b))


@pytest.mark.parametrize("tokens", [1, 7, 612, 1001])
def test_weight_gradient_over_any_token_count(tokens):
    # K is the token count in a weight gradient xᵀ @ dy: TMA needs K's
    # stride aligned, not K, where neither operand is K-contiguous.  Dense,
    # and grouped along K with an empty group and group starts off 8.
    torch.manual_seed(0)
    x, dy = _randn(tokens, 256), _randn(tokens, 136)
    dense = quack.gemm(x.t(), dy, out_dtype=torch.float32)
    lengths = [tokens // 3, 0, tokens - tokens // 3]
    cu, _ = _cu(lengths)
    grouped = quack.gemm(x.t(), dy, cu_seqlens_k=cu)
    if not is_compile_only():
        _close(dense, gemm_ref(x.t(), dy, torch.float32))
        start = 0
        for g, length in enumerate(lengths):
            _close(grouped[g], gemm_ref(x.t()[:, start:start + length], dy[start:start + length]))
            start += length


@pytest.mark.parametrize("k", [12, 612])
def test_backward_over_a_k_of_any_size(k):
    # An M-contiguous A (a transposed activation) over K = 12 or 612: dA's
    # rows of K columns are stored padded to a multiple of 8 (a view).
    torch.manual_seed(0)
    a_t = _randn(k, 200).requires_grad_()
    b = _randn(k, 136).requires_grad_()
    dc = _randn(200, 136)
    out = quack.gemm(a_t.t(), b)
    if not is_compile_only():
        out.backward(dc)
        _close(out, gemm_ref(a_t.detach().t(), b.detach()))
        _close(a_t.grad, gemm_ref(dc, b.detach().t()).t())
        _close(b.grad, gemm_ref(a_t.detach(), dc))


def test_torch_compile_fullgraph_with_autograd():
    # dA and dB through the compiled graph's registered ops; B column-major.
    torch.manual_seed(0)
    inputs = {"a": _randn(300, 256), "b": _operand(256, 520, dtype=torch.bfloat16, layout="col")}
    ours, ref, theirs = _gemm_fns(None, None)
    matrix.check_case(
        matrix.compiled(lambda a, b: ours(a, b) * 2), lambda **t: ref(**t) * 2, lambda **t: theirs(**t) * 2,
        inputs, PARAMS, "grad_all", matrix.random_cotangents,
    )


@pytest.mark.no_compile_only  # autograd runs only on the GPU; the matrix warms these plans
@pytest.mark.parametrize("a_layout", ["row", "col"])
@pytest.mark.parametrize("b_layout", ["row", "col"])
def test_backward_runs_the_planned_products(a_layout, b_layout, monkeypatch):
    # The backward's two products are the calls the forward's plan lists, so
    # warming a training call warms what its backward launches.
    seen = []
    real_plan_for = sys.modules["quack.calls.plan"].plan_for
    # Where the eager call plans its signature, and where the backward plans its products.
    for planner in ("quack.calls.eager", "quack.families.gemm.signature"):
        monkeypatch.setattr(sys.modules[planner], "plan_for", lambda sig: seen.append(sig) or real_plan_for(sig))
    a = _operand(200, 136, dtype=torch.bfloat16, layout=a_layout).requires_grad_()
    b = _operand(136, 264, dtype=torch.bfloat16, layout=b_layout).requires_grad_()
    dc = _randn(200, 264)
    quack.gemm(a, b).backward(dc)
    forward, *backward = seen
    assert forward.backward and not any(sig.backward for sig in backward)
    assert backward == [call for _, call in forward.gradient_calls()]
    _close(a.grad, gemm_ref(dc, b.detach().t()))
    _close(b.grad, gemm_ref(a.detach().t(), dc))


@pytest.mark.parametrize("b_layout", ["row", "col"])
def test_m_major_a_every_launch(b_layout):
    # A transposed view of A on repeated launches: the first launch of an
    # object may convert its arguments differently from the later ones.  M =
    # 300 with a row stride of 304: the last M tile cannot be moved up to end
    # at row 300 (an M-contiguous box starts at a multiple of 8 rows).
    torch.manual_seed(0)
    a = _randn(512, 304).narrow(1, 0, 300).t()  # (300, 512), M contiguous
    b = _operand(512, 264, dtype=torch.bfloat16, layout=b_layout)
    ref = gemm_ref(a, b)
    for _ in range(3):
        _close(quack.gemm(a, b), ref)


@pytest.mark.parametrize("layout", [
    "transposed", "sliced", "broadcast",
    # Compile-only's fake CUDA tensors cannot be sliced along their only dim; the other cases warm its objects.
    pytest.param("unaligned", marks=pytest.mark.no_compile_only),
])
def test_backward_takes_any_cotangent_layout(layout):
    # Autograd picks dC's layout: a transpose (q @ k.t() downstream), an
    # unaligned slice (torch.cat along columns), a broadcast (.sum(-1)), a
    # contiguous view at an unaligned start (torch.cat of flattened
    # tensors); the kernel reads none of them as they are, so the backward
    # copies dC once.
    torch.manual_seed(0)
    a, b = _randn(77, 64), _randn(64, 136)
    dc = {
        "transposed": lambda: _randn(136, 77).t(),
        "sliced": lambda: _randn(77, 139).narrow(1, 3, 136),
        "broadcast": lambda: _randn(77, 1).expand(77, 136),
        "unaligned": lambda: _randn(3 + 77 * 136)[3:].view(77, 136),
    }[layout]()
    _, (da, db) = vjp(quack.gemm, (a, b), [dc])
    if not is_compile_only():
        _close(da, gemm_ref(dc.contiguous(), b.t()))
        _close(db, gemm_ref(a.t(), dc.contiguous()))


@pytest.mark.parametrize("dy_layout", ["row", "transposed"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("activation", [*ACTIVATIONS[1:], *GATED])
def test_activation_grad_kernel(activation, dtype, dy_layout):
    # The backward's elementwise step dZ = dY * act'(Z) (quack/families/gemm/dact.py)
    # against autograd through torch's activation in float64: 77 rows (a
    # partial tile of 32), 136 output columns (a partial tile of vectors),
    # the points 0, -0 and +-30, a transposed dY (copied first).
    torch.manual_seed(0)
    n = 136
    z = _randn(77, 2 * n if activation in GATED else n, dtype=dtype) * 3
    if not is_compile_only():
        z[0, :4] = torch.tensor([0.0, -0.0, 30.0, -30.0])
    dy = _randn(n, 77, dtype=dtype).t() if dy_layout == "transposed" else _randn(77, n, dtype=dtype)
    dz = activation_grad(dy, z, activation)
    if is_compile_only():
        return
    z64 = z.double().requires_grad_()
    out = gated_ref(z64, activation) if activation in GATED else TORCH_ACTIVATIONS[activation](z64)
    (expected,) = torch.autograd.grad(out, z64, dy.double())
    assert dz.dtype == dtype and dz.shape == z.shape
    tolerance = dict(atol=1e-2, rtol=1.6e-2) if dtype == torch.bfloat16 else dict(atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(dz.double(), expected.to(dtype).double(), **tolerance)


def test_torch_compile_fullgraph_epilogue_and_groups():
    # Autograd through the fused epilogue (bias, activation) and grouped rows
    # inside one compiled graph.
    torch.manual_seed(0)
    cu, m = _cu([100, 0, 137])
    inputs = {"a": _randn(m, 128), "b": _randn(3, 128, 264), "bias": _randn(264)}
    ours, ref, theirs = _epilogue_fns(cu, "silu")
    matrix.check_case(matrix.compiled(ours), ref, theirs, inputs, ("b", "bias"), "grad_all", matrix.random_cotangents)


@pytest.mark.parametrize("activation", ["gelu_tanh", "swiglu"])
def test_torch_compile_fullgraph_mlp(activation):
    # The MLP's autograd (the derivative's epilogue) inside one compiled graph, grouped rows.
    torch.manual_seed(0)
    cu, m = _cu([100, 0, 137])
    width = 2 * 136 if activation in GATED else 136
    inputs = {"x": _randn(m, 128), "w1": _randn(3, 128, width) / 12, "w2": _randn(3, 136, 264) / 12}
    ours, ref, theirs = _mlp_fns(cu, activation)
    matrix.check_case(matrix.compiled(ours), ref, theirs, inputs, ("w1", "w2"), "grad_all", matrix.random_cotangents)


@pytest.mark.parametrize("a_layout", ["row", "col"])
def test_varlen_k_groups_do_not_mix(a_layout):
    # A non-finite value in one group's rows of A or B never reaches another
    # group's product (the columns a K tile shares with a neighbour are zeroed
    # in both operands' stages).  A row-major (K-major): group 1's first K
    # tile starts 4 columns early and holds group 0's inf; A column-major
    # with B row-major (the weight gradient's layouts): it starts at its own
    # first column and only its last tile, holding group 2's NaN, is zeroed.
    torch.manual_seed(0)
    cu, _ = _cu([100, 36, 24])
    inf = torch.full((64, 1), float("inf"), device="cuda", dtype=torch.bfloat16)
    nan = torch.full((1, 128), float("nan"), device="cuda", dtype=torch.bfloat16)
    if a_layout == "row":  # group 0's last column
        a = torch.cat([_randn(64, 99), inf, _randn(64, 60)], 1)
    else:  # the same, made as Aᵀ and viewed back
        a = torch.cat([_randn(99, 64), inf.t(), _randn(60, 64)]).t()
    b = torch.cat([_randn(136, 128), nan, _randn(23, 128)])  # group 2's first row
    out = quack.gemm(a, b, cu_seqlens_k=cu)
    if not is_compile_only():
        _close(out[1], gemm_ref(a[:, 100:136], b[100:136]))
