"""Each kernel's argument order is written once, in its class's ``__call__``:
``launches.parameters`` reads it from the source without the DSL, and every
launch the ops declare names arguments the kernel has."""

import importlib
import inspect

import pytest
import torch

from quack.calls import launches
from quack.calls import torch_interop as ti
from quack.calls.launches import Launch, in_order

# The modules that declare launches (module constants of type Launch).
DECLARING = (
    "quack.families.rmsnorm.op", "quack.families.layernorm.op", "quack.families.softmax.op",
    "quack.families.cross_entropy.op", "quack.families.gemm.signature", "quack.families.gemm.dact",
    "quack.rowwise.norm_backward_grid",
)


def _declared() -> list[tuple[str, Launch]]:
    found = []
    for name in DECLARING:
        module = importlib.import_module(name)
        found += [(f"{name}.{attr}", v) for attr, v in vars(module).items() if isinstance(v, Launch)]
    return found


def test_every_family_declares_its_launches():
    classes = {launch.kernel_class for _, launch in _declared()}
    assert len(classes) == 9  # 4 row-wise forwards, 2 backwards, the norm backward, the GEMM, its dZ


@pytest.mark.parametrize("where, launch", _declared(), ids=lambda v: v if isinstance(v, str) else "")
def test_the_source_reading_matches_the_class(where, launch):
    module, _, name = launch.kernel_class.partition(":")
    cls = getattr(importlib.import_module(module), name)  # (imports the DSL)
    assert launch.parameters == tuple(inspect.signature(cls.__call__).parameters)[1:]
    assert launch.parameters[-1] == launches.STREAM
    assert launch.rows <= set(launch.parameters) and launch.aligned <= set(launch.parameters), where


def test_unknown_classes_and_arguments_are_refused():
    with pytest.raises(LookupError, match="no class"):
        launches.parameters("quack.families.softmax.kernels:NoSuchKernel")
    with pytest.raises(LookupError, match="no source"):
        launches.parameters("quack.no_such_module:Kernel")

    class Kernel:
        def __call__(self, x, out, stream):
            pass

    Kernel.__module__, Kernel.__qualname__ = "quack.families.softmax.kernels", "SoftmaxForward"
    assert in_order(Kernel, {"out": 2, "x": 1}) == [1, 2, None]
    with pytest.raises(TypeError, match="no argument"):
        in_order(Kernel, {"y": 1})


def test_arguments_view_rows_and_skip_empty_calls(monkeypatch):
    monkeypatch.setattr(ti, "current_stream", lambda device: 7)  # (no GPU here)
    launch = Launch("quack.families.softmax.kernels:SoftmaxBackward", frozenset({"y", "dy", "dx"}),
                    aligned=frozenset({"y", "dy"}))
    y, dy, dx = torch.randn(2, 3, 8), torch.randn(2, 3, 8), torch.empty(2, 3, 8)
    args, empty = launch.arguments({"y": y, "dy": dy, "dx": dx})
    assert [a.shape for a in args[:3]] == [(6, 8)] * 3 and args[3] == 7 and not empty
    assert args[2].data_ptr() == dx.data_ptr()  # a view: the kernel writes the caller's tensor
    with pytest.raises(TypeError, match="no argument"):
        launch.arguments({"y": y, "dy": dy, "dx": dx, "out": dx})
    _, empty = launch.arguments({"y": y[:0], "dy": dy[:0], "dx": dx[:0]})
    assert empty


def test_positional_closures_are_checked_against_the_launch():
    from quack.calls import fastpath
    from quack.families.softmax import op as softmax

    plan = softmax.plan_for(softmax.SoftmaxCall("float32", 8, 4, False))
    assert fastpath.trailing_arguments(plan, "forward", ("x",), out=3) == (3, None)
    with pytest.raises(TypeError, match="begin"):
        fastpath.trailing_arguments(plan, "forward", ("out", "x"))


def test_outputs_are_allocated_where_the_call_asks():
    from quack.calls.launches import NEW, PER_ROW, Output

    launch = Launch("quack.families.rmsnorm.kernels:RMSNormForward", frozenset({"x", "out"}), outputs=(
        ("out", Output("x")), ("residual_out", Output("x")), ("rstd", Output("x", PER_ROW, "float32")),
    ))
    x = torch.randn(2, 3, 8, dtype=torch.bfloat16)
    given = torch.empty_like(x)
    values = launch.allocate({"x": x, "out": given, "residual_out": None, "rstd": NEW})
    assert values["out"] is given and values["residual_out"] is None
    assert values["rstd"].shape == (6,) and values["rstd"].dtype == torch.float32
    fixed = Output("x", (2,), "float32").allocate({"x": x})
    assert fixed.shape == (2,) and Output("x").allocate({"x": x}).shape == x.shape


def test_a_registered_backward_names_its_line_without_recording(tmp_path, monkeypatch):
    from quack.calls import recording
    from quack.calls.plan import entry_line, kernel_for
    from quack.families.rmsnorm import op as rmsnorm

    record = tmp_path / "calls.jsonl"
    monkeypatch.setenv(recording.RECORD_ENV, str(record))
    sig = rmsnorm.RMSNormCall("bfloat16", "float32", False, 4096, 8, True)
    kernel = kernel_for(sig, "backward")
    assert kernel.origin == entry_line(sig) and kernel.launch.kernel_class.endswith(":NormBackward")
    assert not record.exists()  # planned calls are recorded; a backward's kernel is not a call
