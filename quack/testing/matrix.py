"""Correctness matrices: an op's options declared once, as a table, and crossed.

A table maps each axis (an option of the op, or a size class) to its values.
Tests parametrize over ``cases(table, ...)``, so a value added to one axis is
crossed with every other axis without touching a test.  Which cases run:

* ``QUACK_MATRIX=full``: the whole product (the GPU run, and the
  ``//quack:warm_cache_full`` objects);
* ``QUACK_MATRIX=smoke``: the covering array's first case, and of the GPU
  tests only ``test_matrix`` (the pytest plugin deselects the rest): the
  Bazel checks of the build's wiring (``--config=smoke``), which need every
  family's action to run, not every kernel;
* otherwise (``ci``, the default): a covering array of the same table, in
  which every value of every axis appears at least once and every pair of
  values of the ``paired`` axes appears together in some case.  CI and
  ``//quack:warm_cache`` use it.

The tolerance rule (``assert_matches_reference``), the same for every op,
output and gradient: the reference is the op evaluated in float64 on the same
inputs; ours may err at most twice as much as torch's own implementation of
the op in the input's dtype, both in the largest absolute difference from the
reference and in the root-mean-square difference, plus a small floor: 16 fp32
units in the last place at the reference's largest magnitude, or, where the
exact result is all zero, at the inputs' or cotangents' largest magnitude
once per input value each result combines.  The floor matters only where
torch is (nearly) exact: results that are exactly zero, fp32 results computed
about as precisely as the reference.  A reference beyond the result dtype's
range counts as the infinity that rounding to it gives.
"""

from __future__ import annotations

import itertools
import os
from typing import Iterable, Sequence

import torch

MATRIX_ENV = "QUACK_MATRIX"
# The floor, in units of the largest magnitude (``floor``): 16 fp32 ulps.
FLOOR = 16 * 2.0**-23


def selection() -> str:
    """``full``, ``smoke`` or ``ci`` (QUACK_MATRIX; any other value means ``ci``)."""
    value = os.environ.get(MATRIX_ENV, "")
    return value if value in ("full", "smoke") else "ci"


def cases(table: dict[str, Sequence], paired: Iterable[str]) -> list[dict]:
    """The cases of ``table`` to run (``selection``): its full product, a
    covering array (``covering``), or that array's first case."""
    chosen = selection()
    if chosen == "full":
        names = list(table)
        return [dict(zip(names, combo)) for combo in itertools.product(*table.values())]
    covered = covering(table, paired)
    return covered[:1] if chosen == "smoke" else covered


def covering(table: dict[str, Sequence], paired: Iterable[str]) -> list[dict]:
    """A small set of cases in which every value of every axis occurs and every
    pair of values of two ``paired`` axes occurs together (greedy and
    deterministic: each case starts from the first pair not yet covered and
    fills the other axes with the values that cover the most new pairs, then
    the least used ones, so unpaired axes such as size classes vary too)."""
    names = list(table)
    paired = [a for a in names if a in set(paired)]
    todo = {
        ((a, i), (b, j))
        for a, b in itertools.combinations(paired, 2)
        for i in range(len(table[a]))
        for j in range(len(table[b]))
    }
    singles = {(a, i) for a in names for i in range(len(table[a]))}
    used = {(a, i): 0 for a in names for i in range(len(table[a]))}
    out = []
    while todo or singles:
        if todo:
            first = min(todo, key=lambda p: (names.index(p[0][0]), p[0][1], names.index(p[1][0]), p[1][1]))
            chosen = dict(first)
        else:
            a, i = min(singles, key=lambda s: (names.index(s[0]), s[1]))
            chosen = {a: i}
        for axis in names:
            if axis in chosen:
                continue

            def gain(i, axis=axis):
                new = sum(
                    tuple(sorted(((axis, i), (b, j)), key=lambda s: names.index(s[0]))) in todo
                    for b, j in chosen.items()
                )
                return (new, (axis, i) in singles, -used[axis, i], -i)

            chosen[axis] = max(range(len(table[axis])), key=gain)
        picked = sorted(chosen.items(), key=lambda s: names.index(s[0]))
        todo -= {(p, q) for p, q in itertools.combinations(picked, 2)}
        singles -= set(picked)
        for p in picked:
            used[p] += 1
        out.append({a: table[a][i] for a, i in picked})
    return out


def case_id(case: dict) -> str:
    """A readable pytest id: ``dtype=bfloat16-n=760-...``."""
    def show(v):
        if isinstance(v, torch.dtype):
            return str(v).removeprefix("torch.")
        return str(v)

    return "-".join(f"{k}={show(v)}" for k, v in case.items())


def _errors(result: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """|result - reference| in float64, 0 where both are NaN (or the same infinity)."""
    same = (result.isnan() & reference.isnan()) | (result.double() == reference)
    diff = (result.double() - reference).abs()
    return torch.where(same, torch.zeros_like(diff), diff)


def max_error(result: torch.Tensor, reference: torch.Tensor) -> float:
    """Largest |result - reference|."""
    diff = _errors(result, reference)
    return float(diff.max()) if diff.numel() else 0.0


def rms_error(result: torch.Tensor, reference: torch.Tensor) -> float:
    """Root mean square of result - reference: small values count as much as
    large ones, which the largest error alone does not see (a kernel writing
    zeros for the many tiny entries of a cross-entropy gradient)."""
    diff = _errors(result, reference)
    return float(diff.pow(2).mean().sqrt()) if diff.numel() else 0.0


def floor(reference: torch.Tensor, inputs=()) -> float:
    """``FLOOR`` at the reference's largest finite magnitude; where the exact
    result is all zero, at the inputs' largest magnitude times the number of
    input values that each result combines (a sum of M losses that are each 0
    carries M roundings)."""
    finite = reference[reference.isfinite()].abs()
    scale = float(finite.max()) if finite.numel() else 0.0
    if scale > 0:
        return FLOOR * scale
    for t in inputs:
        if t.is_floating_point() and t.numel():
            terms = max(1, t.numel() // max(1, reference.numel()))
            return FLOOR * float(t[t.isfinite()].abs().max()) * terms
    return FLOOR


def representable(reference: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The reference as ``dtype`` can hold it: beyond its largest finite value,
    the infinity a rounding to it gives (a sum of fp16 losses past 65504 is
    inf in torch and in ours)."""
    big = torch.finfo(dtype).max
    rounded = torch.where(reference > big, float("inf"), reference)
    return torch.where(rounded < -big, float("-inf"), rounded)


def assert_matches_reference(
    name: str, result: torch.Tensor, reference: torch.Tensor, torch_result: torch.Tensor, inputs=(),
) -> None:
    """Check one output or gradient with the rule above, on both its largest
    and its root-mean-square error (shapes and NaN positions must match)."""
    assert result.shape == reference.shape, f"{name}: shape {tuple(result.shape)} != {tuple(reference.shape)}"
    reference = representable(reference.double(), result.dtype)
    small = floor(reference, inputs)
    torch_max, torch_rms = max_error(torch_result, reference), rms_error(torch_result, reference)
    atol = 2.0 * torch_max + small
    torch.testing.assert_close(
        result.double(), reference.double(), atol=atol, rtol=0, equal_nan=True,
        msg=lambda m: f"{name}: {m}\n(tolerance {atol:.3g} = 2 x torch's largest error {torch_max:.3g} + floor {small:.3g})",
    )
    ours_rms = rms_error(result, reference)
    assert ours_rms <= 2.0 * torch_rms + small, (
        f"{name}: root-mean-square error {ours_rms:.3g} > 2 x torch's {torch_rms:.3g} + floor {small:.3g}"
    )


# --------------------------------------------------------------------------
# Running one case: ours, the float64 reference and torch's implementation.
# --------------------------------------------------------------------------

# How a case asks for gradients: ``mode`` axis values of the op tables.
INFERENCE = "no_grad"  # under torch.no_grad(), every input requiring grad (as Parameters do)
EVAL = "eval"  # grad mode on, nothing requires grad
MODES = (INFERENCE, EVAL, "grad_x", "grad_params", "grad_all")


def requires_grad(mode: str, name: str, params: Sequence[str]) -> bool:
    """Does input ``name`` require grad in ``mode``?  ``params``: the op's
    parameter inputs (weight, bias); every other input is an activation."""
    if mode == EVAL:
        return False
    if mode in (INFERENCE, "grad_all"):
        return True
    return (name in params) == (mode == "grad_params")


def _with_grad_flags(inputs: dict, grads: Sequence[str]) -> dict:
    return {k: v.detach().requires_grad_(k in grads) if _floating(v) else v for k, v in inputs.items()}


def _floating(v) -> bool:
    return isinstance(v, torch.Tensor) and v.is_floating_point()


def evaluate(fn, inputs: dict, grads: Sequence[str], cotangents, no_grad: bool = False):
    """(outputs, {name: gradient}, cotangents): ``fn(**inputs)`` as a tuple and
    the gradients of sum(output * cotangent) with respect to the inputs named
    in ``grads``.  ``cotangents``: a list, or a callable that builds it from
    the outputs.  Under ``no_grad`` the call runs in torch.no_grad() and
    nothing is differentiated."""
    inputs = _with_grad_flags(inputs, grads)
    if no_grad:
        with torch.no_grad():
            return _as_tuple(fn(**inputs)), {}, None
    outputs = _as_tuple(fn(**inputs))
    if not grads:
        return tuple(o.detach() for o in outputs), {}, None
    cots = cotangents(outputs) if callable(cotangents) else cotangents
    pairs = [(o, c) for o, c in zip(outputs, cots) if o.requires_grad]
    got = torch.autograd.grad([o for o, _ in pairs], [inputs[k] for k in grads], [c for _, c in pairs])
    return tuple(o.detach() for o in outputs), dict(zip(grads, got)), cots


def warm(fn, inputs: dict, grads: Sequence[str], no_grad: bool, cotangents=None) -> None:
    """Compile-only: make the call the GPU run makes, so every kernel it needs
    is exported.  On a CUDA build of torch that is ``evaluate`` itself (its
    backward walked in Python, ``quack.compile_only_autograd``); on a
    CPU-only build autograd cannot run on fake CUDA tensors, and
    ``compile_only.warming_gradients`` stands in for it."""
    from quack.compile_only import autograd_available, requires_grad_for_warming, warming_gradients

    if autograd_available():
        _warm_through_autograd(fn, inputs, grads, no_grad, cotangents or random_cotangents)
        return
    if no_grad:
        with torch.no_grad():
            fn(**_with_grad_flags(inputs, grads))
        return
    # As evaluate() (``_with_grad_flags``): inputs not differentiated are
    # detached, so a Parameter's flag does not reach the op, and nothing the
    # call marks stays on the caller's tensor.
    marked = {
        k: requires_grad_for_warming(v) if k in grads else v.detach() if _floating(v) else v
        for k, v in inputs.items()
    }
    with warming_gradients():
        fn(**marked)


def _warm_through_autograd(fn, inputs: dict, grads: Sequence[str], no_grad: bool, cotangents) -> None:
    """``evaluate``'s calls, forgiving where the GPU run's checks would fail
    anyway (an output that needs no gradient, an input the function left
    unused or unflagged): warming only wants the kernels they reach."""
    inputs = _with_grad_flags(inputs, grads)
    if no_grad:
        with torch.no_grad():
            fn(**inputs)
        return
    outputs = _as_tuple(fn(**inputs))
    cots = cotangents(outputs) if callable(cotangents) else cotangents
    pairs = [(o, c) for o, c in zip(outputs, cots) if o.requires_grad]
    wrt = [inputs[k] for k in grads if inputs[k].requires_grad]
    if pairs and wrt:
        torch.autograd.grad([o for o, _ in pairs], wrt, [c for _, c in pairs], allow_unused=True)


def check_case(
    ours, reference, torch_impl, inputs: dict, params: Sequence[str], mode: str, cotangents
) -> None:
    """Run one matrix case on the GPU and check every output and gradient with
    ``assert_matches_reference``; under compile-only, only ``warm``.

    ``reference`` gets the floating-point inputs in float64; ``torch_impl``
    gets them with each parameter (``params``) cast to the activations' dtype:
    torch's implementation "in the same dtype".  ``cotangents(outputs)``
    builds the cotangents from our outputs (random, never all ones: a zero
    gradient must not pass by accident)."""
    from quack.compile_only import is_compile_only

    floats = [k for k, v in inputs.items() if isinstance(v, torch.Tensor) and v.is_floating_point()]
    grads = [k for k in floats if requires_grad(mode, k, params)]
    no_grad = mode == INFERENCE
    if is_compile_only():
        warm(ours, inputs, grads, no_grad, cotangents)
        return
    act_dtype = next(inputs[k].dtype for k in floats if k not in params)
    out, got, cots = evaluate(ours, inputs, grads, cotangents, no_grad)
    if no_grad:
        assert not any(o.requires_grad for o in out), "an output of a call under torch.no_grad() requires grad"
    as64 = {k: v.double() if k in floats else v for k, v in inputs.items()}
    as_dtype = {k: v.to(act_dtype) if k in floats and k in params else v for k, v in inputs.items()}
    cots64 = None if cots is None else [c.double() for c in cots]
    ref_out, ref_grads, _ = evaluate(reference, as64, list(got), cots64)
    torch_out, torch_grads, _ = evaluate(torch_impl, as_dtype, list(got), cots)
    assert len(out) == len(ref_out), f"{len(out)} outputs, the reference has {len(ref_out)}"
    sources = [as64[k] for k in floats]
    for i, (o, r, t) in enumerate(zip(out, ref_out, torch_out)):
        assert o.dtype == t.dtype, f"output {i} has dtype {o.dtype}, torch's {t.dtype}"
        assert_matches_reference(f"output {i}", o, r, t, sources)
    for k in got:
        assert got[k].dtype == inputs[k].dtype, f"grad of {k} has dtype {got[k].dtype}, {k} {inputs[k].dtype}"
        assert_matches_reference(f"grad of {k}", got[k], ref_grads[k], torch_grads[k], cots64 or ())


def random_cotangents(outputs) -> list[torch.Tensor]:
    """Cotangents for ``check_case``: a fixed-seed normal sample like each
    output (never all ones, under which a zero gradient could pass)."""
    torch.manual_seed(1)
    return [torch.randn_like(o) for o in outputs]


def row_case_shape(case: dict) -> tuple[int, ...]:
    """The x shape of a row-wise matrix case (its ``m``, ``n``, ``lead`` and ``dtype``)."""
    return row_shape(rows(case["m"], case["n"], case["dtype"]), case["n"], case["lead"])


def _as_tuple(value) -> tuple:
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)


# --------------------------------------------------------------------------
# Size classes of the row-wise ops (RMSNorm, LayerNorm, softmax, cross-entropy).
# --------------------------------------------------------------------------

# N: one column; odd (element copies of 16-bit rows); 4-, 2- and 8-element
# vectors of 16-bit rows (100, 1026, 760: the last also not a power of two);
# the largest single-CTA rows; each cluster size of the forwards (2 at 32K
# ... 16 at 256K) and the backwards (2 at 16K ... 16 at 128K and 256K); a
# clustered N that is no power of two (40000: the last peers' columns partly
# or, in the backward's cluster of 8, wholly past N); the largest N.
ROW_N = (1, 7, 100, 760, 1026, 4096, 16384, 32768, 40000, 65536, 131072, 262144)
# M: one row; odd; a multiple of every row tile; enough rows that every CTA
# of a persistent backward grid loops over several row tiles.
ROW_M = ("one", "odd", "tile_multiple", "loops")
# Leading dimensions: x as (M, N), or with a batch dimension before the rows.
LEAD = ("2d", "3d")


def rows(m_class: str, n: int, dtype: torch.dtype) -> int:
    """The number of rows of an M class at this N and dtype."""
    from quack.rowwise import norm_backward_grid as norm_backward_plan
    from quack.rowwise import config as row_config

    if m_class == "one":
        return 1
    if m_class == "odd":
        return 37
    if m_class == "tile_multiple":
        return 64
    from quack.calls import torch_interop as ti

    elem = torch.empty((), dtype=dtype).element_size()
    cfg = row_config.backward_config(n, ti.widest_vector(n, elem))
    # At most THREADS_PER_SM // threads CTAs of a backward fit on an SM.
    resident_tiles = ti.sm_count(0) * (norm_backward_plan.THREADS_PER_SM // cfg.threads) // cfg.cluster_n
    return 3 * resident_tiles * cfg.rows_per_cta + 5


def row_shape(m: int, n: int, lead: str) -> tuple[int, ...]:
    """(M, N), or (2, M / 2, N) / (1, M, N) with a leading batch dimension."""
    if lead == "2d":
        return (m, n)
    return (2, m // 2, n) if m % 2 == 0 else (1, m, n)


def compiled(fn):
    """``torch.compile(fn, fullgraph=True)``; under compile-only on a CPU-only
    build of torch ``fn`` itself (Inductor cannot run there, and the eager
    call warms the plan whose objects the compiled graph's registered ops
    launch).  On a CUDA build compile-only runs the graph Dynamo captures
    (``quack.compile_only_gpu``)."""
    from quack.compile_only import autograd_available

    return fn if not autograd_available() else torch.compile(fn, fullgraph=True)
