"""Compile-only warms exactly the objects the eager call's plan names, for every
cell of every op's correctness matrix (CPU only: plans come from metadata).

Each op's ``test_matrix`` runs with ``matrix.check_case`` captured, on fake CUDA
tensors.  The eager side makes the call with grad mode as the GPU run has it
(``torch.no_grad()`` for inference) and stops at the op's first plan; the
compile-only side warms the case as the build does (``matrix.warm``) while
every object it loads is noted instead of compiled.
"""

import contextlib
import importlib
import warnings

import pytest
import torch

import quack
import quack.calls.plan
from quack.calls import torch_interop as ti
from quack.cache.mode import _COMPILE_ONLY_DEPTH
from quack.compile_only import compile_only_mode
from quack.testing import matrix

OPS = ("rmsnorm", "layernorm", "softmax", "cross_entropy", "gemm")


class _Planned(Exception):
    """Raised by the patched plan_for: the eager call has chosen its plan."""

    def __init__(self, plan):
        self.plan = plan


def _objects(plan) -> set[str]:
    return {kernel.describe() for _, kernel in plan.kernels}


def _captured_case(test_module, case, monkeypatch):
    """(ours, inputs, params, mode) that ``test_matrix(case)`` hands to check_case."""
    got = {}

    def capture(ours, reference, torch_impl, inputs, params, mode, *rest):
        got.update(ours=ours, inputs=inputs, params=params, mode=mode)

    monkeypatch.setattr(matrix, "check_case", capture)
    test_module.test_matrix(case)
    if not got:
        pytest.skip("the case checks an error, not a call")
    return got["ours"], got["inputs"], got["params"], got["mode"]


@contextlib.contextmanager
def _eager_decisions():
    """Inside compile-only's fake mode, but with compile-only off: the ops
    decide as an eager call would (fake tensors still stand in for the GPU)."""
    token = _COMPILE_ONLY_DEPTH.set(0)
    try:
        yield
    finally:
        _COMPILE_ONLY_DEPTH.reset(token)


def _eager_plan(op_module, ours, inputs, grads, no_grad, monkeypatch):
    real_plan_for = quack.calls.plan.plan_for

    def stop(sig):
        raise _Planned(real_plan_for(sig))

    monkeypatch.setattr(op_module, "plan_for", stop)
    # The fake tensors stand in for real ones here: the input check that refuses
    # fakes outside compile-only mode must not see them as fakes.
    monkeypatch.setattr(ti, "_FakeTensor", type("NothingIsThis", (), {}))
    flagged = {k: v.detach().requires_grad_(k in grads) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
               for k, v in inputs.items()}
    with _eager_decisions(), (torch.no_grad() if no_grad else contextlib.nullcontext()):
        try:
            ours(**flagged)
        except _Planned as planned:
            return planned.plan
    return None  # nothing to launch (an empty GEMM)


def _warmed_objects(ours, inputs, grads, no_grad, monkeypatch) -> set[str]:
    loaded = set()

    def note(kernel):
        loaded.add(kernel.describe())
        return lambda *args: None

    monkeypatch.setattr(quack.calls.plan.Kernel, "load", note)
    matrix.warm(ours, inputs, grads, no_grad)
    return loaded


def _cases():
    for op in OPS:
        module = importlib.import_module(f"tests.test_{op}")
        for case in module.CASES:
            yield pytest.param(op, case, id=f"{op}-{matrix.case_id(case)}")


@pytest.fixture
def gpu_stand_in(monkeypatch):
    """What the eager path asks of the GPU, answered as an H200 would."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setitem(ti._CAPABILITIES, 0, (9, 0))
    monkeypatch.setenv("QUACK_ARCH", "sm_90a")
    warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")




@pytest.mark.parametrize("op, case", list(_cases()))
def test_compile_only_warms_the_eager_plan(op, case, monkeypatch, gpu_stand_in):
    op_module = importlib.import_module("quack.calls.eager")  # every op's eager step asks its plan_for
    with compile_only_mode():
        ours, inputs, params, mode = _captured_case(importlib.import_module(f"tests.test_{op}"), case, monkeypatch)
        floats = [k for k, v in inputs.items() if isinstance(v, torch.Tensor) and v.is_floating_point()]
        grads = [k for k in floats if matrix.requires_grad(mode, k, params)]
        no_grad = mode == matrix.INFERENCE
        with monkeypatch.context() as patch:
            eager = _eager_plan(op_module, ours, inputs, grads, no_grad, patch)
        with monkeypatch.context() as patch:
            warmed = _warmed_objects(ours, inputs, grads, no_grad, patch)
    if eager is None:
        assert warmed == set()
        return
    assert warmed == _objects(eager), f"eager plan {quack.calls.plan.entry_line(eager.signature)}"
    # A backward runs exactly when the GPU run takes gradients.
    assert eager.signature.backward == bool(grads and not no_grad)


def _in_no_grad(x, weight):
    with torch.no_grad():
        return quack.layernorm(x, weight)


def _in_inference_mode(x, weight):
    with torch.inference_mode():
        return quack.layernorm(x, weight)


def _back_on(x, weight):
    with torch.no_grad():
        with torch.enable_grad():
            return quack.layernorm(x * 2, weight)


def _written_in_place(x, weight):
    y = torch.zeros_like(x)
    y.add_(x)
    return quack.layernorm(y, weight)


def _written_through_view(x, weight):
    y = torch.zeros_like(x)
    y.narrow(0, 0, 4).add_(x.narrow(0, 0, 4))
    return quack.layernorm(y, weight)


def _view_taken_before_write(x, weight):
    y = torch.zeros_like(x)
    view = y.view(8, 4096)
    y.add_(x)
    return quack.layernorm(view, weight)


def _broadcast_partner(x, weight):
    _, ones = torch.broadcast_tensors(x, torch.ones(8, 4096, device=x.device, dtype=x.dtype))
    return quack.layernorm(ones, weight)


# (function differentiated with respect to x alone, whether its layernorm call runs a backward on the GPU)
_GRAD_MODE_CALLS = {
    "plain": (lambda x, weight: quack.layernorm(x, weight), True),
    "derived_input": (lambda x, weight: quack.layernorm(torch.tanh(x) + 1, weight), True),
    "converted_input": (lambda x, weight: quack.layernorm(x.float(), weight), True),
    "written_in_place": (_written_in_place, True),
    "flagged_inside": (lambda x, weight: quack.layernorm(x.detach().requires_grad_(), weight), True),
    "detached": (lambda x, weight: quack.layernorm(x.detach(), weight), False),
    "unflagged_inside": (lambda x, weight: quack.layernorm(x.requires_grad_(False), weight), False),
    "factory_like": (lambda x, weight: quack.layernorm(torch.zeros_like(x) + 1, weight), False),
    "written_through_view": (_written_through_view, True),
    "view_taken_before_write": (_view_taken_before_write, True),
    "type_as_template": (lambda x, weight: quack.layernorm(torch.ones(8, 4096, device=x.device).type_as(x), weight),
                         False),
    "broadcast_partner": (_broadcast_partner, False),
    # A quack op's output carries the gradient on (its own forward runs without a graph).
    "after_layernorm": (lambda x, weight: quack.layernorm(quack.layernorm(x, weight), weight), True),
    "after_rmsnorm": (lambda x, weight: quack.layernorm(quack.rmsnorm(x, weight) * 1, weight), True),
    "after_softmax": (lambda x, weight: quack.layernorm(quack.softmax(x), weight), True),
    "after_inference_rmsnorm": (lambda x, weight: quack.layernorm(quack.rmsnorm(x.detach()), weight), False),
    "no_grad_inside": (_in_no_grad, False),
    "inference_mode_inside": (_in_inference_mode, False),
    "enable_grad_inside_no_grad": (_back_on, True),
}


@pytest.mark.parametrize("name", list(_GRAD_MODE_CALLS))
def test_compile_only_sees_grad_mode_inside_a_differentiated_function(name, monkeypatch, gpu_stand_in):
    # requires_grad propagates as autograd would, under the function's own
    # grad mode (compile_only.warming_gradients): before, warming saw only
    # "differentiated" and warmed the training plan for every call.
    fn, backward = _GRAD_MODE_CALLS[name]
    eager = importlib.import_module("quack.calls.eager")  # where the eager layernorm call plans
    real_plan_for = quack.calls.plan.plan_for
    planned = []
    monkeypatch.setattr(eager, "plan_for", lambda sig: planned.append(sig) or real_plan_for(sig))
    monkeypatch.setattr(quack.calls.plan.Kernel, "load", lambda kernel: lambda *args: None)
    with compile_only_mode():
        x = torch.randn(8, 4096, device="cuda", dtype=torch.bfloat16)
        weight = torch.randn(4096, device="cuda", dtype=torch.float32)
        matrix.warm(fn, {"x": x, "weight": weight}, ["x"], no_grad=False)
    # The last layernorm call is the one each function is about.
    assert planned[-1].backward == backward


def test_warming_detaches_what_is_not_differentiated(monkeypatch, gpu_stand_in):
    # As the GPU run's evaluate(): a Parameter not differentiated reaches the
    # op without its flag, and the call leaves no mark on the caller's tensors.
    eager = importlib.import_module("quack.calls.eager")  # where the eager layernorm call plans
    real_plan_for = quack.calls.plan.plan_for
    planned = []
    monkeypatch.setattr(eager, "plan_for", lambda sig: planned.append(sig) or real_plan_for(sig))
    monkeypatch.setattr(quack.calls.plan.Kernel, "load", lambda kernel: lambda *args: None)

    def written_then_normed(x, weight):
        x.add_(1)
        return quack.layernorm(x, weight)

    with compile_only_mode():
        x = torch.randn(8, 4096, device="cuda", dtype=torch.bfloat16)
        weight = torch.nn.Parameter(torch.randn(4096, device="cuda", dtype=torch.float32))
        matrix.warm(written_then_normed, {"x": x, "weight": weight}, [], no_grad=False)
        matrix.warm(written_then_normed, {"x": x, "weight": weight}, ["weight"], no_grad=False)
        matrix.warm(written_then_normed, {"x": x, "weight": weight}, [], no_grad=False)
    assert [sig.backward for sig in planned] == [False, True, False]
    assert not hasattr(x, "_quack_wants_grad") and not hasattr(weight, "_quack_wants_grad")
