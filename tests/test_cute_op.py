"""``@cute_op``: the fake implementation runs the op body only under compile-only mode."""

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from quack.compile_only import compile_only_mode
from quack.calls.cute_op import cute_op

CALLS = []


@cute_op("quack_test::scale_into", mutates_args=("out",))
def _scale_into(x: torch.Tensor, out: torch.Tensor, factor: float) -> None:
    """Records its call (a real op would compile and launch a kernel here)."""
    CALLS.append((tuple(x.shape), factor))


def test_compile_only_runs_the_body_through_the_dispatcher():
    CALLS.clear()
    with compile_only_mode():
        x = torch.empty(8, 16, device="cuda")
        torch.ops.quack_test.scale_into(x, torch.empty_like(x), 2.0)
    assert CALLS == [((8, 16), 2.0)]


def test_plain_fake_mode_only_allocates():
    CALLS.clear()
    with FakeTensorMode():
        x = torch.empty(8, 16, device="cuda")
        torch.ops.quack_test.scale_into(x, torch.empty_like(x), 2.0)
    assert CALLS == []


def test_eager_call_bypasses_the_dispatcher():
    CALLS.clear()
    x = torch.empty(3, 4)
    _scale_into(x, torch.empty_like(x), 0.5)  # the CuteOp calls its body directly
    assert CALLS == [((3, 4), 0.5)]
