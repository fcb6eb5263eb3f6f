"""The correctness-matrix machinery (quack/testing/matrix.py), on the CPU."""

import itertools

import pytest
import torch

from quack.testing import matrix

TABLE = {
    "dtype": ["fp32", "fp16", "bf16"],
    "flag": [False, True],
    "mode": ["a", "b", "c", "d"],
    "n": list(range(7)),
    "m": ["one", "odd", "many"],
}
PAIRED = ["dtype", "flag", "mode", "n"]


def test_covering_has_every_pair_of_paired_axes_and_every_value():
    cases = matrix.covering(TABLE, PAIRED)
    for a, b in itertools.combinations(PAIRED, 2):
        assert {(c[a], c[b]) for c in cases} == set(itertools.product(TABLE[a], TABLE[b])), (a, b)
    for axis, values in TABLE.items():
        assert {c[axis] for c in cases} == set(values), axis
    # Far fewer than the product (504), no more than a few times the largest pair product.
    assert len(cases) <= 2 * len(TABLE["n"]) * len(TABLE["mode"])
    assert matrix.covering(TABLE, PAIRED) == cases  # deterministic


def test_full_selection_is_the_product(monkeypatch):
    monkeypatch.setenv(matrix.MATRIX_ENV, "full")
    cases = matrix.cases(TABLE, PAIRED)
    assert len(cases) == 3 * 2 * 4 * 7 * 3
    assert len({tuple(c.values()) for c in cases}) == len(cases)
    monkeypatch.setenv(matrix.MATRIX_ENV, "ci")
    assert matrix.cases(TABLE, PAIRED) == matrix.covering(TABLE, PAIRED)


def test_smoke_selection_is_the_first_covering_case(monkeypatch):
    monkeypatch.setenv(matrix.MATRIX_ENV, "smoke")
    assert matrix.selection() == "smoke"
    assert matrix.cases(TABLE, PAIRED) == matrix.covering(TABLE, PAIRED)[:1]
    monkeypatch.setenv(matrix.MATRIX_ENV, "everything")  # not a level: the default
    assert matrix.selection() == "ci"


def _rounded(reference, dtype):
    return reference.to(dtype).to(reference.dtype)


def test_tolerance_rule_accepts_torch_like_error_and_refuses_more():
    torch.manual_seed(0)
    reference = torch.randn(1000, dtype=torch.float64)
    torch_result = _rounded(reference, torch.bfloat16).to(torch.bfloat16)
    ours = torch_result.clone()
    matrix.assert_matches_reference("same as torch", ours, reference, torch_result)
    wrong = ours.clone()
    wrong[500:] = 0  # half the values wrong, as the mixed-precision backward was
    with pytest.raises(AssertionError, match="2 x torch's largest error"):
        matrix.assert_matches_reference("half wrong", wrong, reference, torch_result)
    slightly = ours.double() + 3 * matrix.max_error(torch_result, reference)
    with pytest.raises(AssertionError):
        matrix.assert_matches_reference("3x torch's error", slightly.to(torch.bfloat16), reference, torch_result)


def test_tolerance_floor_where_the_result_is_exactly_zero():
    zero = torch.zeros(10, dtype=torch.float64)
    matrix.assert_matches_reference("zeros", torch.zeros(10), zero, torch.zeros(10))
    with pytest.raises(AssertionError):
        matrix.assert_matches_reference("not zero", torch.full((10,), 1e-3), zero, torch.zeros(10))


def test_nan_positions_must_match():
    ref = torch.tensor([float("nan"), 1.0], dtype=torch.float64)
    matrix.assert_matches_reference("nan", torch.tensor([float("nan"), 1.0]), ref, ref.float())
    with pytest.raises(AssertionError):
        matrix.assert_matches_reference("no nan", torch.tensor([0.0, 1.0]), ref, ref.float())


@pytest.mark.parametrize("mode, expected", [
    (matrix.INFERENCE, {"x", "weight"}), (matrix.EVAL, set()), ("grad_x", {"x"}),
    ("grad_params", {"weight"}), ("grad_all", {"x", "weight"}),
])
def test_modes_choose_which_inputs_require_grad(mode, expected):
    assert {k for k in ("x", "weight") if matrix.requires_grad(mode, k, ("weight",))} == expected


def test_row_classes():
    assert matrix.rows("one", 4096, torch.bfloat16) == 1
    assert matrix.rows("odd", 4096, torch.bfloat16) % 2 == 1
    # "loops": at least twice the row tiles of the grid the norm backward
    # launches, at every N, for every weight and with dh_out.
    from quack.rowwise import norm_backward_grid as norm_backward_plan
    from quack.calls import torch_interop as ti
    from quack.rowwise import config as row_config

    for n in matrix.ROW_N:
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            elem = torch.empty((), dtype=dtype).element_size()
            cfg = row_config.backward_config(n, ti.widest_vector(n, elem))
            m = matrix.rows("loops", n, dtype)
            for weight_bytes in (0, 4, elem):
                for dh_out in (False, True):
                    grid = norm_backward_plan.grid_clusters(cfg, m, 0, elem, weight_bytes, dh_out)
                    assert -(-m // cfg.rows_per_cta) >= 2 * grid, (n, dtype, weight_bytes, dh_out)
    assert matrix.row_shape(64, 8, "3d") == (2, 32, 8)
    assert matrix.row_shape(37, 8, "3d") == (1, 37, 8)


# check_case end to end on the CPU, with torch's ops standing in for ours.

def _rms(x, weight):
    return torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, 1e-6)


def _rms_reference(x, weight):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight


class _WrongHalfOfDx(torch.autograd.Function):
    """Identity forward; the backward zeroes the second half of each row, as the
    mixed-precision norm backward did."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, dy):
        dx = dy.clone()
        dx[..., dy.shape[-1] // 2:] = 0
        return dx


def _cotangents(outputs):
    torch.manual_seed(1)
    return [torch.randn_like(o) for o in outputs]


def _norm_inputs(dtype=torch.bfloat16):
    torch.manual_seed(0)
    return {"x": torch.randn(9, 760, dtype=dtype), "weight": 1 + 0.5 * torch.randn(760, dtype=torch.float32)}


@pytest.mark.parametrize("mode", matrix.MODES)
def test_check_case_accepts_torch_itself(mode):
    def ours(x, weight):  # torch in x's dtype with the fp32 weight: at least as precise
        return _rms(x.float(), weight).to(x.dtype)

    matrix.check_case(ours, _rms_reference, _rms, _norm_inputs(), ("weight",), mode, _cotangents)


def test_check_case_catches_a_wrong_gradient_half():
    def ours(x, weight):
        return _rms(_WrongHalfOfDx.apply(x.float()).to(x.dtype), weight.to(x.dtype))

    with pytest.raises(AssertionError, match="grad of x"):
        matrix.check_case(ours, _rms_reference, _rms, _norm_inputs(), ("weight",), "grad_all", _cotangents)


def _ce(x, target):
    return torch.nn.functional.cross_entropy(x, target.long())


class _ZeroNonTarget(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, target):
        ctx.save_for_backward(target)
        return x.clone()

    @staticmethod
    def backward(ctx, dy):
        (target,) = ctx.saved_tensors
        keep = torch.nn.functional.one_hot(target.long(), dy.shape[-1]).bool()
        return torch.where(keep, dy, torch.zeros_like(dy)), None


def test_check_case_catches_zeroed_small_gradient_entries():
    # Non-target entries of a cross-entropy gradient are ~1/N of the target's:
    # the largest error alone would not see them all zeroed; the RMS does.
    torch.manual_seed(0)
    x = 4 * torch.randn(37, 4096, dtype=torch.bfloat16)
    target = torch.randint(0, 4096, (37,), dtype=torch.int32)
    inputs = {"x": x, "target": target}
    matrix.check_case(_ce, _ce, _ce, inputs, (), "grad_x", _cotangents)  # integer target: no grad asked
    with pytest.raises(AssertionError, match="grad of x"):
        matrix.check_case(lambda x, target: _ce(_ZeroNonTarget.apply(x, target), target), _ce, _ce,
                          inputs, (), "grad_x", _cotangents)
