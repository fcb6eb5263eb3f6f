"""Cross-entropy as a cached, torch-callable op:
``quack.cross_entropy(logits, target, ignore_index=-100, reduction="mean")``.

    loss[i] = logsumexp(logits[i]) - logits[i, target[i]]

over the last dimension of the logits (shape (..., N), N up to 262144,
float32/float16/bfloat16; target of shape (...), int32 or int64), reduced
like ``torch.nn.functional.cross_entropy``: "mean" over the rows whose target
is not ``ignore_index``, "sum", or "none" (per-row losses, 0 for ignored rows).
Autograd gives the gradient of the logits.

Targets outside [0, N) that are not ``ignore_index`` are never read out of
bounds: the kernel gives that row a NaN loss (and NaN gradients).  Checking
mode raises instead: ``check_targets=True``, or ``QUACK_CHECK_TARGETS=1`` in
the environment, makes the call validate the targets first and raise a
ValueError naming the first bad row (this reads the targets back to the host,
a synchronisation, so it is off by default).

The kernels live in ``quack/families/cross_entropy/kernels.py``; this file holds the
cached compile functions (their arguments are the object key), the
``@cute_op`` ops, the allocating wrappers, the autograd Function, the public
function and the fp32 reference ``cross_entropy_ref`` that tests import.

Test: ``pytest tests/test_cross_entropy.py``; benchmark:
``python tools/bench/cross_entropy.py``.
"""

from __future__ import annotations

import math
import os
from typing import ClassVar, Optional

import torch

from quack.calls import torch_interop as ti
from quack.cache import compile_options, jit_cache
from quack.calls import fastpath
from quack.compile_only import differentiable_outputs, is_compile_only
from quack.calls.cute_op import cute_op
from quack.calls.eager import eager_plan
from quack.calls.launches import NEW, PER_ROW, Launch, Output, in_order
from quack.calls.plan import (Kernel, Plan, Signature, blame, fake_rows_input, fake_tensor, kernel_for, plan_for,
                              signature)
from quack.rowwise.config import MAX_N, RowConfig, forward_config

REDUCTIONS = ("mean", "sum", "none")


def _reduction_code(reduction) -> int:
    """The reduction as the fast path's key spells it (-1: one the checks refuse)."""
    return REDUCTIONS.index(reduction) if isinstance(reduction, str) and reduction in REDUCTIONS else -1
TARGET_DTYPES = (torch.int32, torch.int64)
# Environment switch for target checking (see the module docstring).
CHECK_TARGETS_ENV = "QUACK_CHECK_TARGETS"
# The forward holds x and its exponentials in registers, as the softmax
# forward does (rowwise.forward_config).  Backward: values per thread of one column tile (no reduction, so tiles are
# independent CTAs; small tiles keep many loads in flight).
BACKWARD_VALUES_PER_THREAD = 32
BACKWARD_THREADS = 256



def backward_tiles(n: int, vec: int) -> RowConfig:
    """Column tiles of at most ``BACKWARD_VALUES_PER_THREAD`` values per
    thread; ``cluster_n`` is the number of column tiles (grid y, no cluster)."""
    threads = BACKWARD_THREADS
    threads_per_row = min(threads, max(8, 1 << max(0, (math.ceil(n / 32) - 1).bit_length())))
    tiles = math.ceil(n / (threads_per_row * BACKWARD_VALUES_PER_THREAD))
    # Every tile must own at least one vector per thread, or tiles overlap.
    while tiles > 1 and threads_per_row * tiles * vec > n:
        tiles -= 1
    return RowConfig(n, vec, threads, threads_per_row, tiles)


# This op's eager fast path (quack/calls/fastpath.py).
_FAST = fastpath.Closures()

# The kernels' launches: the arguments (their __call__'s) that are (M, N)
# rows, and the outputs they allocate: per row, the loss and lse in fp32; a
# reduction's result, one value of the logits' dtype, and its fp32 (sum,
# count) for a backward.
ROW_VALUES = Output("logits", PER_ROW, "float32")
FORWARD = Launch(
    "quack.families.cross_entropy.kernels:CrossEntropyForward", frozenset({"logits"}),
    outputs=(("loss", ROW_VALUES), ("lse", ROW_VALUES), ("out", Output("logits", (1,))),
             ("stats", Output("logits", (2,), "float32"))),
)
BACKWARD = Launch(
    "quack.families.cross_entropy.kernels:CrossEntropyBackward", frozenset({"logits", "dx"}),
    outputs=(("dx", Output("logits")),),
)


def _cute_int(name: str):
    """The CuTe DSL integer type of a target dtype name (compile time only)."""
    import cutlass

    return {"int32": cutlass.Int32, "int64": cutlass.Int64}[name]


@jit_cache("cross_entropy")
def compile_cross_entropy_fwd(dtype: str, target_dtype: str, n: int, vec: int, reduction: str, backward: bool):
    """Compile the forward kernel for one static specialisation (M is symbolic).
    ``reduction`` "mean"/"sum": the kernel also reduces the row losses (to one
    value of the logits' dtype) and, for a ``backward``, writes the fp32
    (sum, count); "none" writes the rows only.  ``backward``: store lse."""
    import cutlass.cute as cute
    from cutlass import Float32, Int32

    from quack.rowwise import device as rowwise
    from quack.families.cross_entropy.kernels import CrossEntropyForward

    dt = ti.cute_dtype(dtype)
    m = cute.sym_int()
    reducing = reduction != "none"
    fakes = dict(
        logits=rowwise.fake_rows(dt, m, n, vec), target=rowwise.fake_vector(_cute_int(target_dtype), m),
        loss=rowwise.fake_vector(Float32, m), ignore_index=Int32(-100), stream=cute.runtime.make_fake_stream(),
    )
    if backward:
        fakes["lse"] = rowwise.fake_vector(Float32, m)
    if reducing:
        fakes.update(out=rowwise.fake_vector(dt, 1), counter=rowwise.fake_vector(Int32, 1))
    if reducing and backward:
        fakes["stats"] = rowwise.fake_vector(Float32, 2)
    kernel = CrossEntropyForward(forward_config(n, vec), reduction if reducing else None)
    return cute.compile(kernel, *in_order(CrossEntropyForward, fakes), options=compile_options())


@jit_cache("cross_entropy")
def compile_cross_entropy_bwd(dtype: str, target_dtype: str, n: int, vec: int):
    """Compile the backward kernel (the logits and their gradient share a dtype)."""
    import cutlass.cute as cute
    from cutlass import Float32, Int32

    from quack.rowwise import device as rowwise
    from quack.families.cross_entropy.kernels import CrossEntropyBackward

    dt = ti.cute_dtype(dtype)
    m = cute.sym_int()
    fakes = dict(
        logits=rowwise.fake_rows(dt, m, n, vec), target=rowwise.fake_vector(_cute_int(target_dtype), m),
        lse=rowwise.fake_vector(Float32, m), dloss=rowwise.fake_vector(Float32, m),
        dx=rowwise.fake_rows(dt, m, n, vec), ignore_index=Int32(-100), stream=cute.runtime.make_fake_stream(),
    )
    return cute.compile(
        CrossEntropyBackward(backward_tiles(n, vec)), *in_order(CrossEntropyBackward, fakes), options=compile_options()
    )


@signature
class CrossEntropyCall(Signature):
    """What decides a ``quack.cross_entropy`` call's kernels: the logits'
    dtype, the target's, N, the vector width of the logits' rows (the
    backward reads the same rows), the reduction (done by the forward
    kernel) and whether a backward will run."""

    OP: ClassVar[str] = "cross_entropy"
    dtype: str
    target_dtype: str
    n: int
    vec: int
    reduction: str
    backward: bool

    def kernels(self):
        args = (self.dtype, self.target_dtype, self.n, self.vec)
        forward = Kernel(compile_cross_entropy_fwd, (*args, self.reduction, self.backward), FORWARD)
        if not self.backward:
            return (("forward", forward),)
        return (("forward", forward), ("backward", Kernel(compile_cross_entropy_bwd, args, BACKWARD)))

    def rebuild(self) -> "CrossEntropyCall":
        """The op's checks and signature of a call on one row of N (``plan.from_entry``):
        the logits ``vec`` elements into their storage below the full vector
        width (their alignment then gives that width)."""
        target = fake_tensor(self, "target_dtype", (1,))
        with blame(self, "target_dtype"):
            ti.check_float("target", target, TARGET_DTYPES)
        logits = fake_rows_input(self, lambda x: _validate(x, target, -100, "none"))
        with blame(self, "reduction"):
            _validate(logits, target, -100, self.reduction)
        return call_signature(logits, target, self.reduction, self.backward)


def call_signature(logits, target, reduction: str, backward: bool) -> CrossEntropyCall:
    """The signature of a call on these tensors (the vector width from the logits' alignment)."""
    n = ti.row_length(logits)
    return CrossEntropyCall(
        ti.dtype_name(logits.dtype), ti.dtype_name(target.dtype), n, ti.vector_width(n, logits), reduction, backward
    )


def _run_forward(kernel: Kernel, shared_scratch: bool = True, **values) -> None:
    """Launch the forward on a call's ``values``; with a reduction (``out``)
    the row losses go to scratch (``reduction_scratch``; the stream's own
    where ``shared_scratch``)."""
    if values.get("out") is not None:
        logits = values["logits"]
        m = math.prod(logits.shape[:-1])
        values["counter"], values["loss"] = reduction_scratch(logits.device, m, shared_scratch)
    kernel.run(**values)


# The registered ops, which torch.compile's graphs call: each takes its
# plan from its own (real) tensors.
@cute_op("quack::cross_entropy_fwd", mutates_args=("loss", "lse", "out", "stats"))
def _cross_entropy_fwd(
    logits: torch.Tensor,
    target: torch.Tensor,
    loss: Optional[torch.Tensor],
    lse: Optional[torch.Tensor],
    out: Optional[torch.Tensor],
    stats: Optional[torch.Tensor],
    ignore_index: int,
    reduction: str,
) -> None:
    """Launch the forward kernel: (M, N) logits, (M,) target, the (M,) row
    losses (None for a reduction: they go to scratch), lse for a backward,
    and for a reduction its (1,) result and, for a backward, its fp32 (sum,
    count)."""
    plan = plan_for(call_signature(logits, target, reduction, lse is not None))
    # Fresh scratch: a compiled graph may run this in a CUDA graph's memory
    # pool (reduce-overhead), which must not hold the stream's shared scratch.
    values = dict(logits=logits, target=target, loss=loss, lse=lse, out=out, stats=stats, ignore_index=ignore_index)
    _run_forward(plan.kernel_of("forward"), shared_scratch=False, **values)


@cute_op("quack::cross_entropy_bwd", mutates_args=("dx",))
def _cross_entropy_bwd(
    logits: torch.Tensor,
    target: torch.Tensor,
    lse: torch.Tensor,
    dloss: torch.Tensor,
    dx: torch.Tensor,
    ignore_index: int,
) -> None:
    """Launch the backward kernel: dloss is the (M,) fp32 gradient of each
    row's loss (the object from the tensors themselves)."""
    n = ti.row_length(logits)
    # The call as the backward sees it (its reduction was the forward's: it does not change this object).
    call = CrossEntropyCall(ti.dtype_name(logits.dtype), ti.dtype_name(target.dtype), n, ti.vector_width(n, logits),
                            "none", True)
    kernel_for(call, "backward").run(logits=logits, target=target, lse=lse, dloss=dloss, dx=dx, ignore_index=ignore_index)


def _validate(logits, target, ignore_index, reduction) -> None:
    ti.check_row_input("quack.cross_entropy", "logits", logits, MAX_N)
    ti.check_float("target", target, TARGET_DTYPES)
    ti.check_cuda("target", target, logits)
    if tuple(target.shape) != tuple(logits.shape[:-1]):
        raise ValueError(
            f"target must have shape {tuple(logits.shape[:-1])} (the logits' leading dims), "
            f"got {tuple(target.shape)}"
        )
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index must be an int, got {type(ignore_index).__name__}")
    if not -(2**31) <= ignore_index < 2**31:
        raise ValueError(f"ignore_index {ignore_index} does not fit in 32 bits")


def check_targets_in_range(target: torch.Tensor, n: int, ignore_index: int) -> None:
    """Raise ValueError naming the first row whose target is outside [0, N) and
    not ``ignore_index``.  Reads the targets back to the host (synchronises)."""
    flat = target.reshape(-1)
    bad = (flat != ignore_index) & ((flat < 0) | (flat >= n))
    if bool(bad.any()):
        row = int(bad.nonzero()[0, 0])
        raise ValueError(
            f"target[{row}] = {int(flat[row])} is outside [0, {n}) and is not "
            f"ignore_index ({ignore_index})"
        )


def cross_entropy_fwd(logits, target, ignore_index: int = -100, reduction: str = "none", backward: bool = True,
                      plan: Optional[Plan] = None):
    """Allocate and run the forward: returns (loss, lse, reduced, stats).

    loss: the (M,) fp32 row losses for reduction "none" (else None); lse:
    (M,) fp32 for a ``backward``, else None; reduced: the ``reduction``
    ("mean" or "sum") of the losses, done by the kernel, a 0-dim tensor of
    the logits' dtype (None for "none");
    stats: that reduction's fp32 (sum, count) for a backward.  ``plan``: the
    call's (eager); None goes through the registered op (torch.compile,
    direct use)."""
    reducing = reduction != "none"
    values = FORWARD.allocate(dict(
        logits=logits, target=target.reshape(-1).contiguous(), loss=None if reducing else NEW,
        lse=NEW if backward else None, out=NEW if reducing else None, stats=NEW if reducing and backward else None,
        ignore_index=ignore_index,
    ))
    reduced, stats = values["out"], values["stats"]
    if logits.numel() == 0:
        if reduced is not None and not is_compile_only():
            reduced.fill_(math.nan if reduction == "mean" else 0.0)  # as torch: the mean of no rows is NaN
            if stats is not None:
                stats.zero_()
    elif plan is not None:
        _run_forward(plan.kernel_of("forward"), **values)
    else:
        _cross_entropy_fwd(**values, reduction=reduction)
    return values["loss"], values["lse"], reduced.view(()) if reduced is not None else None, stats


_SCRATCH: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}


def reduction_scratch(device: torch.device, m: int, shared: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(counter, rows) for a reducing forward of M rows: the zeroed int32
    its CTAs take their tickets from (the last CTA zeroes it again) and the
    (M,) fp32 room for the row losses it sums.  One pair per device and
    stream, since launches on one stream run one after another: rows are a
    view of the stream's buffer, which grows (doubling) for a larger M and
    is never shrunk, so the fast path's closures can keep their views;
    fresh ones while a CUDA graph is captured on the device's current
    stream (the graph's own), in compile-only mode, and where not
    ``shared``.  A stream destroyed with a reducing forward still queued
    must not be followed, before that forward ends, by a new stream with
    the same handle on the same device (torch's pooled streams never are)."""
    if not shared or is_compile_only() or ti.capturing(device):
        return torch.zeros(1, device=device, dtype=torch.int32), torch.empty(m, device=device, dtype=torch.float32)
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, torch._C._cuda_getCurrentRawStream(index))
    scratch = _SCRATCH.get(key)
    if scratch is None or scratch[1].shape[0] < m:
        counter = scratch[0] if scratch is not None else torch.zeros(1, device=device, dtype=torch.int32)
        rows = max(m, 2 * scratch[1].shape[0]) if scratch is not None else m
        scratch = _SCRATCH[key] = (counter, torch.empty(rows, device=device, dtype=torch.float32))
    return scratch[0], scratch[1][:m]


def cross_entropy_bwd(logits, target, lse, dloss_rows, ignore_index: int = -100, *, plan: Optional[Plan] = None):
    """Allocate dlogits and run the backward op; ``dloss_rows`` is the (M,)
    gradient of each row's loss."""
    values = BACKWARD.allocate(dict(
        logits=logits, target=target.reshape(-1).contiguous(), lse=lse, dloss=dloss_rows.float().contiguous(), dx=NEW,
        ignore_index=ignore_index,
    ))
    if logits.numel() > 0:
        plan.run("backward", **values) if plan is not None else _cross_entropy_bwd(**values)
    return values["dx"]


def _rows_out(loss, target, dtype):
    """reduction="none": the fp32 row losses shaped like the target, in the logits' dtype."""
    return loss.view(target.shape).to(dtype)


def _row_grads(dloss, m, reduction, count):
    """The (M,) fp32 gradient of each row's loss from the gradient of the output."""
    if reduction == "none":
        return dloss.reshape(m).float().contiguous()
    g = dloss.float()
    if reduction == "mean":
        g = g / count
    return g.expand(m).contiguous()


class _CrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, ignore_index, reduction, plan):
        # Kernels take plain tensors (DLPack refuses ones that require grad).
        logits = logits.detach()
        loss, lse, reduced, stats = cross_entropy_fwd(logits, target, ignore_index, reduction, True, plan)
        ctx.plan = plan
        out, count = (reduced, stats[1]) if reduced is not None else (_rows_out(loss, target, logits.dtype), None)
        ctx.save_for_backward(logits, target, lse, count)
        ctx.ignore_index, ctx.reduction = ignore_index, reduction
        return out

    @staticmethod
    def backward(ctx, dout):
        logits, target, lse, count = ctx.saved_tensors
        g = _row_grads(dout, lse.shape[0], ctx.reduction, count)
        dx = cross_entropy_bwd(logits, target, lse, g, ctx.ignore_index, plan=ctx.plan)
        return dx, None, None, None, None


def _check_env() -> bool:
    return os.environ.get(CHECK_TARGETS_ENV, "") not in ("", "0")


def cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int = -100,
    reduction: str = "mean",
    check_targets: Optional[bool] = None,
) -> torch.Tensor:
    """Cross-entropy of ``logits`` (..., N) against class indices ``target`` (...).

    logits: contiguous CUDA float32/float16/bfloat16, N <= 262144.  target:
    int32/int64 on the same device.  ``reduction``: "mean" (over rows whose
    target is not ``ignore_index``; NaN when there are none, as in torch),
    "sum" or "none".  The result has the logits' dtype.  A target outside
    [0, N) that is not ignore_index gives a NaN loss for its row; with
    ``check_targets=True`` (default: the ``QUACK_CHECK_TARGETS`` environment
    variable) the call raises a ValueError naming the row instead.  Raises
    TypeError for a wrong dtype and ValueError for a wrong device, shape or
    layout, before any launch.
    """
    if check_targets is None:
        check_targets = _check_env()
    described = None if check_targets else (logits, target, ignore_index, _reduction_code(reduction))
    if described is not None:
        loss = NotImplemented if fastpath.tracing() else _FAST.call(4, *described)
        if loss is not NotImplemented:
            return loss
    _validate(logits, target, ignore_index, reduction)
    if check_targets and not is_compile_only():
        check_targets_in_range(target, logits.shape[-1], ignore_index)
    plan, backward = eager_plan(lambda backward: call_signature(logits, target, reduction, backward), logits)
    if backward:
        return _CrossEntropyFunction.apply(logits, target, ignore_index, reduction, plan)
    with torch.no_grad():
        loss, _, reduced, _ = cross_entropy_fwd(logits, target, ignore_index, reduction, False, plan)
        loss = reduced if reduced is not None else _rows_out(loss, target, logits.dtype)
    stores_for_backward = plan is not None and plan.signature.backward
    if described is not None and reduced is not None and logits.numel() > 0 and not stores_for_backward:
        _FAST.remember(described, lambda: _inference_closure(plan, logits, target))
    return differentiable_outputs(loss, stores_for_backward)


def _inference_closure(plan: Plan, logits: torch.Tensor, target: torch.Tensor):
    """The eager fast path's launch for reducing calls like this one
    (``quack/calls/fastpath.py``): the logits go to the kernel as rows, unviewed;
    the 0-dim result as the kernel's one-element output (it reads only its
    address)."""
    leading = ("logits", "target", "loss", "lse", "out", "stats", "counter", "ignore_index")
    # The row losses ("loss") and the counter are the stream's scratch: dicts the launcher reads.
    per_stream = frozenset({leading.index("loss"), leading.index("counter")})
    launch = fastpath.direct(plan, "forward", logits.device, per_stream=per_stream)
    if launch is None:
        return None
    m, dtype, device = logits.numel() // logits.shape[-1], logits.dtype, logits.device
    flat_target = target.dim() == 1 and target.is_contiguous()
    empty = torch.empty
    rest = fastpath.trailing_arguments(plan, "forward", leading)
    scratch = fastpath.PerStream(lambda: reduction_scratch(device, m)[::-1], device, 2)
    row_losses, counters = scratch.dicts

    def run(logits, target, ignore_index, _reduction):  # the key fixed the reduction
        out = empty((), device=device, dtype=dtype)
        t = target if flat_target else target.reshape(-1).contiguous()
        done = launch(logits, t, row_losses, None, out, None, counters, ignore_index, *rest)
        # No scratch for this stream yet, or a capture, which gets scratch of
        # its own (or another device: declined again).
        if done is NotImplemented:
            rows, count = scratch.add_current()
            done = launch(logits, t, rows, None, out, None, count, ignore_index, *rest)
        return out if done is None else NotImplemented

    return run


def cross_entropy_ref(logits, target, ignore_index: int = -100, reduction: str = "mean"):
    """fp32 reference with the same semantics (out-of-range targets not allowed),
    rounded to the logits' dtype."""
    n = logits.shape[-1]
    loss = torch.nn.functional.cross_entropy(
        logits.float().reshape(-1, n), target.reshape(-1).long(),
        ignore_index=ignore_index, reduction=reduction,
    )
    if reduction == "none":
        loss = loss.view(target.shape)
    return loss.to(logits.dtype)
