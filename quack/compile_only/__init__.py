"""Compile-only mode: run kernel calls on fake tensors so each kernel is compiled and
exported to the persistent cache while nothing launches and no GPU memory is used.

Inside :func:`compile_only_mode`, every tensor is a ``FakeTensor``; a ``@cute_op``
op's fake implementation derives the key and calls its ``jit_cache`` compile
function, which exports the object and hands back a no-op launch. ``.item()``,
``.tolist()``, ``int(t)`` and ``float(t)`` return the sentinels ``1`` / ``1.0``
(a bool: True for an ``all``, else False) so test setup that reads tensor values (``total_m =
seq_lens.sum().item()``) still reaches the kernel; the keys never depend on
those values because batch dimensions are symbolic.

On a CUDA build of torch (it needs no GPU) the mode also makes the process
look like a GPU machine of the compile target to code on fake tensors:
autograd's backward passes, ``torch.compile``, ``Module.cuda()``, autocast
and ``torch.cuda``'s queries work as on the GPU (``quack.compile_only_gpu``,
``quack.compile_only_autograd``).  On a CPU-only build autograd on fake CUDA
tensors is refused with an error saying so (it would abort the process).

Scope: the depth counter is a ``ContextVar`` (``quack.cache._COMPILE_ONLY_DEPTH``),
so it is per thread and per asyncio task, but torch's ``FakeTensorMode`` sits on a
per-*thread* mode stack. While compile-only mode is active in one task, do not run
real GPU work in another asyncio task of the same thread: its tensors would be
fake although ``is_compile_only()`` is false there.

Driver-script use::

    with compile_only_mode():
        for shape in shapes:
            my_kernel(*make_inputs(shape))  # exported, not launched
"""

from __future__ import annotations

import contextlib
import threading
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures.thread import _worker as _pool_worker
from contextvars import ContextVar
from typing import Any, Iterator, Optional

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from quack.cache.mode import _COMPILE_ONLY_DEPTH
from quack.compile_only.gpu import CUDA_BUILD, SharedPatches, emulated, patch_attribute, thread_modes

__all__ = [
    "CompileOnlyFakeTensorMode", "autograd_available", "compile_only_mode", "differentiable_outputs", "hinted_message",
    "is_compile_only", "requires_grad_for_warming", "warming_gradients",
]

# Small on purpose: test code that really depends on the value should fail
# loudly under compile-only rather than pass with a conveniently aligned number.
_INT_SENTINEL = 1
_FLOAT_SENTINEL = 1.0


# The ops behind .item(): under inference_mode aten.item reaches the modes undecomposed.
_SCALAR_READS = (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default)


class _PerThread:
    """An attribute of a mode kept per thread.  The threads a compile-only
    block starts enter its modes too (``_threads_inherit``), and torch keeps
    each mode's re-entry bookkeeping (its stack of earlier states, fake
    mode's in-kernel flag) on the instance: shared, one thread's exit would
    restore another's state.  Unset in a thread, it reads ``default()``, or
    is missing (AttributeError) without a default: torch then sets it up."""

    def __init__(self, default=None):
        self.default = default

    def __set_name__(self, owner, name: str) -> None:
        self.name = name

    def __get__(self, mode, owner=None):
        if mode is None:
            return self
        local = mode.__dict__[_PER_THREAD]
        if not hasattr(local, self.name):
            if self.default is None:
                raise AttributeError(self.name)
            setattr(local, self.name, self.default())
        return getattr(local, self.name)

    def __set__(self, mode, value) -> None:
        setattr(mode.__dict__[_PER_THREAD], self.name, value)


# Where a mode keeps its ``_PerThread`` attributes.
_PER_THREAD = "_quack_per_thread"


class _SharedAcrossThreads:
    """TorchDispatchMode's bookkeeping of the dispatch flags, per thread
    (``_PerThread``).  A copy of the mode (``copy.deepcopy`` of a module
    whose tensors it made) is the mode itself: the copy's tensors must mix
    with the original's."""

    def __init__(self, *args, **kwargs) -> None:
        self.__dict__[_PER_THREAD] = threading.local()
        super().__init__(*args, **kwargs)

    def __deepcopy__(self, memo) -> "_SharedAcrossThreads":
        return self

    old_dispatch_mode_flags = _PerThread()
    old_non_infra_dispatch_mode_flags = _PerThread()
    old_without_ignore_compile_internals_dispatch_mode_flags = _PerThread()


class _ScalarSentinelMode(_SharedAcrossThreads, TorchDispatchMode):
    """Answer ``aten._local_scalar_dense`` (the op behind ``.item()``) with a sentinel.

    A separate dispatch mode rather than a ``FakeTensorMode`` subclass: it uses the
    public ``__torch_dispatch__`` protocol and composes with any ``FakeTensorMode``
    configuration. Every other op goes on down the stack to fake dispatch.

    A bool reads as healthy GPU data would answer the checks tests and
    training code make on values: the result of ``all`` reads True ("are
    all outputs finite?", ``torch.isfinite(y).all()``), any other bool False
    ("is any gradient non-finite?", ``clip_grad_norm_(error_if_nonfinite=True)``),
    each negated by ``logical_not`` and kept through copies and views
    (``_TRUTH_KEEPING``).  torch.compile traces with this mode off
    (``ignore_compile_internals``) and the compiled graph runs with it on,
    higher-order operators included.
    """

    supports_higher_order_operators = True

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # Only where compile-only can run what Dynamo captures (a CUDA build
        # of torch, quack.compile_only.gpu); elsewhere Dynamo runs the frames
        # eagerly.
        return CUDA_BUILD

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in _SCALAR_READS:
            dtype = args[0].dtype
            if dtype == torch.bool:
                return getattr(args[0], _TRUTH, False)
            return _FLOAT_SENTINEL if dtype.is_floating_point else _INT_SENTINEL
        out = func(*args, **(kwargs or {}))
        packet = func.overloadpacket
        if isinstance(out, torch.Tensor) and out.dtype == torch.bool and packet in _TRUTH_MAKING:
            truth = _TRUTH_MAKING[packet]
            if truth is None:  # kept, or negated, from the input
                truth = getattr(args[0], _TRUTH, False) if isinstance(args[0], torch.Tensor) else False
                truth = not truth if packet in _NEGATING else truth
            setattr(out, _TRUTH, truth)
        return out


# The value a bool tensor's scalar read answers (``_ScalarSentinelMode``), by the op that made it:
# True or False, or None for the input's (negated by ``_NEGATING``).
_TRUTH = "_quack_truth"
_NEGATING = {torch.ops.aten.logical_not, torch.ops.aten.bitwise_not}
_TRUTH_KEEPING = (
    torch.ops.aten._to_copy, torch.ops.aten.clone, torch.ops.aten.detach, torch.ops.aten.alias,
    torch.ops.aten.view, torch.ops.aten._unsafe_view, torch.ops.aten.reshape, torch.ops.aten.squeeze,
    torch.ops.aten.unsqueeze, torch.ops.aten.lift_fresh, *_NEGATING,
)
_TRUTH_MAKING = {torch.ops.aten.all: True, **{op: None for op in _TRUTH_KEEPING}}


class _NoDeviceFakeTensorMode(_SharedAcrossThreads, FakeTensorMode):
    """A ``FakeTensorMode`` that never initialises a device, also while
    ``torch.cuda.is_available()`` is claimed (``quack.compile_only_gpu``):
    it keeps the fake CUDA device guard and makes factory outputs fake
    without asking the (absent) driver.  Several threads may be inside it
    at once (``_PerThread``)."""

    enter_stack = _PerThread(list)
    in_kernel_invocation = _PerThread(lambda: False)

    def __init__(self, **fake_kwargs: Any) -> None:
        super().__init__(**fake_kwargs)
        # The converter's two ways in (a real tensor meeting the mode, an
        # op's output) run under one lock: torch numbers the tensors they
        # memoise with an unlocked counter, and two threads converting at
        # once could be handed each other's fake tensor.
        self.conversion_lock = threading.RLock()
        converter = self.fake_tensor_converter
        for name in ("from_real_tensor", "from_meta_and_device"):
            setattr(converter, name, self._locked(getattr(converter, name)))

    def _locked(self, convert):
        def locked(*args, **kwargs):
            with self.conversion_lock:
                return convert(*args, **kwargs)

        return locked

    @property
    def avoid_device_init(self) -> bool:
        return True


class CompileOnlyFakeTensorMode:
    """A ``FakeTensorMode`` (built from ``**fake_kwargs``; it never
    initialises a device) plus scalar sentinels."""

    def __init__(self, **fake_kwargs: Any) -> None:
        self.fake_mode = _NoDeviceFakeTensorMode(**fake_kwargs)
        self._sentinels = _ScalarSentinelMode()

    def __enter__(self) -> "CompileOnlyFakeTensorMode":
        self.fake_mode.__enter__()
        try:
            self._sentinels.__enter__()
        except BaseException:
            self.fake_mode.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, exc_type, exc_val, exc_tb) -> None:
        # LIFO: the sentinel mode was pushed last.
        try:
            self._sentinels.__exit__(exc_type, exc_val, exc_tb)
        finally:
            self.fake_mode.__exit__(exc_type, exc_val, exc_tb)


# The mode of the compile-only block this thread (or task) runs in, for the threads it starts.
_ACTIVE_MODE: ContextVar[Optional[CompileOnlyFakeTensorMode]] = ContextVar("quack_compile_only_mode", default=None)


@contextlib.contextmanager
def compile_only_mode(mode: Optional[CompileOnlyFakeTensorMode] = None) -> Iterator[CompileOnlyFakeTensorMode]:
    """Enter compile-only mode; yields the active :class:`CompileOnlyFakeTensorMode`.

    ``mode``: one that an earlier block yielded, entered again so that the
    tensors made there (a session fixture's, a module's) can be used here;
    by default a new one.  Threads started inside the block run in it too,
    in the same mode, until they end, and so do tasks submitted to a
    ``ThreadPoolExecutor`` inside it (``_threads_inherit``).

    The depth is pushed with a token and reset to exactly its prior value on exit,
    also when the block raises, so nested regions never leak ``False`` (or
    ``True``) to the enclosing scope.
    """
    mode = CompileOnlyFakeTensorMode() if mode is None else mode
    with _inside(mode, emulated(), _THREADS_INHERIT.held()):
        yield mode


@contextlib.contextmanager
def _inside(mode: CompileOnlyFakeTensorMode, *held) -> Iterator[None]:
    """This thread (or task) in ``mode``, with the process-wide patches ``held``."""
    token = _COMPILE_ONLY_DEPTH.set(_COMPILE_ONLY_DEPTH.get() + 1)
    active = _ACTIVE_MODE.set(mode)
    try:
        with contextlib.ExitStack() as stack:
            for context in (*held, thread_modes(), mode):
                stack.enter_context(context)
            yield
    except RuntimeError as err:
        hinted = hinted_message(str(err))
        if hinted is None:
            raise
        raise RuntimeError(hinted).with_traceback(err.__traceback__) from None
    finally:
        _ACTIVE_MODE.reset(active)
        _COMPILE_ONLY_DEPTH.reset(token)


def _in_mode(mode: CompileOnlyFakeTensorMode, fn):
    """``fn`` run in ``mode`` by another thread.  It holds none of the
    process-wide patches: those stay the starting block's, and end with it."""

    def run(*args, **kwargs):
        with _inside(mode):
            return fn(*args, **kwargs)

    return run


def _threads_inherit(patches: list) -> None:
    """Work handed to other threads inside a compile-only block runs in the
    block's mode (``compile_only_mode``): a thread started inside it, for
    its whole run; a task submitted to a thread pool, for that task (the
    pool's threads themselves inherit nothing, so a pool that outlives the
    block, or was started before it, runs later work outside the mode)."""
    start, submit = threading.Thread.start, ThreadPoolExecutor.submit

    def start_in_mode(thread: threading.Thread) -> None:
        mode = _ACTIVE_MODE.get()
        if mode is not None and getattr(thread, "_target", None) is not _pool_worker:
            thread.run = _in_mode(mode, thread.run)
        start(thread)

    def submit_in_mode(pool: ThreadPoolExecutor, fn, /, *args, **kwargs):
        mode = _ACTIVE_MODE.get()
        return submit(pool, fn if mode is None else _in_mode(mode, fn), *args, **kwargs)

    patch_attribute(patches, threading.Thread, "start", start_in_mode)
    patch_attribute(patches, ThreadPoolExecutor, "submit", submit_in_mode)


_THREADS_INHERIT = SharedPatches(_threads_inherit)


def hinted_message(message: str) -> Optional[str]:
    """torch's error message with what compile-only mode can say about it
    (the pytest plugin adds the same to a failed test's report, where the
    test caught it first), or None where it knows nothing.  torch's message
    may list every frame the block ran: it is cut to its first lines, where
    the frames of the error stay (its traceback)."""
    if _NO_CUDA_GUARD in message:
        return f"{_first_lines(message)}. {_NO_CUDA_GUARD_HINT}"
    if _NO_COMPILED_FRAMES in message:
        return f"{_FULLGRAPH_HINT}\n{_first_lines(message)}"
    if any(e in message for e in _NOT_EMULATED_ERRORS):
        return f"{_first_lines(message)}\n{_NOT_EMULATED_HINT}"
    return None


# What torch says when code in compile-only mode reached the CUDA driver,
# which no GPU machine-to-be has here.
_NOT_EMULATED_ERRORS = ("Found no NVIDIA driver", "CUDA driver version is insufficient")
_NOT_EMULATED_HINT = (
    "Compile-only mode reached the CUDA driver, which it does not emulate: CUDA streams, events, graphs, "
    "pinned memory and CUDA generators need a GPU. Mark such a test @pytest.mark.no_compile_only (skipped "
    "under --compile-only), or keep those calls out of the code it runs there."
)


def _first_lines(text: str, lines: int = 12, chars: int = 4000) -> str:
    """``text`` cut to its first ``lines`` lines and ``chars`` characters, saying what was left out."""
    kept = text[:chars].split("\n")[:lines]
    left = text.count("\n") + 1 - len(kept)
    cut = "\n".join(kept)
    return cut if len(cut) == len(text) else f"{cut}\n... ({left} more lines, {len(text) - len(cut)} characters, cut)"


# A CPU-only build of torch has no CUDA device guard, which indexing, copy_,
# .to("cuda") and contiguous() of a (fake) CUDA tensor ask for; a CUDA build has
# one, which FakeTensor swaps for a no-op where no GPU is visible.
_NO_CUDA_GUARD = "PyTorch is not linked with support for cuda devices"
_NO_CUDA_GUARD_HINT = (
    "Under compile-only mode a CPU-only build of torch cannot index, copy_, move (.to/.cuda) or make "
    "contiguous a fake CUDA tensor: create tensors on the CUDA device directly and take views with "
    "narrow/select/view/reshape, or run compile-only with a CUDA build of torch (it needs no GPU)."
)


# On a CPU-only build of torch Dynamo does not trace under compile-only
# mode's dispatch modes (the scalar sentinels claim to be ignorable only
# where the captured graph can run, a CUDA build): every frame of a
# torch.compile'd function runs eagerly (its kernels are warmed all the
# same), and with fullgraph=True torch then raises, listing each frame it
# skipped.
_NO_COMPILED_FRAMES = "torch.compile with fullgraph=True found no compiled frames"
_FULLGRAPH_HINT = (
    "torch.compile(fullgraph=True) cannot trace inside compile-only mode: Dynamo does not trace under its "
    "dispatch modes with a CPU-only build of torch, so the function ran eagerly (its kernels were warmed) and "
    "fullgraph=True refused that. Run compile-only with the CUDA build of torch (it needs no GPU), or call the "
    "function itself, or compile it without fullgraph=True. torch's message:"
)


def autograd_available() -> bool:
    """Can a call build an autograd graph here?  Always, but in compile-only
    mode on a CPU-only build of torch, which aborts on the first graph node
    of a fake CUDA tensor: there the ops warm their backward kernels at the
    forward and return outputs without a graph (``differentiable_outputs``,
    ``warming_gradients``).  On a CUDA build, backward passes are walked in
    Python (``quack.compile_only_autograd``) and the ops keep their GPU path."""
    return CUDA_BUILD or not is_compile_only()


def is_compile_only() -> bool:
    """Whether compile-only mode is active here (live; safe at any call site).

    Prefer it to ``from quack.cache import COMPILE_ONLY``, which copies the value
    once at import time.  False while torch.compile traces: the ops then go
    through the registered custom ops, and Dynamo cannot trace ``ContextVar.get``.
    """
    return not torch.compiler.is_compiling() and _COMPILE_ONLY_DEPTH.get() > 0


# The attribute that marks a tensor as requiring grad while warming: autograd's flag without
# autograd (a real ``requires_grad`` on a fake CUDA tensor lets a graph be built, which aborts).
_WANTS_GRAD = "_quack_wants_grad"
_FLAG = torch.Tensor.requires_grad  # the descriptor: its __get__ and __set__ reach the mode
# Calls whose outputs never require grad, whatever their inputs (besides ``*_like`` and
# ``new_*`` factories, and outputs that are not floating point).
_DETACHING = {"detach", "detach_", "tensor"}
# Calls whose outputs pair one-to-one with their tensor inputs.
_ELEMENTWISE_OUTPUTS = {"broadcast_tensors", "meshgrid", "atleast_1d", "atleast_2d", "atleast_3d"}


class _GradientsWithoutGraph(TorchFunctionMode):
    """Autograd's bookkeeping without its graph.  Every torch call runs under
    ``torch.no_grad()``, and its floating-point outputs are marked as requiring
    grad where autograd would have made them so: grad mode on *as the caller
    set it* (its ``torch.no_grad()`` and ``inference_mode`` blocks included)
    and some data input requiring grad (not a ``*_as``/``to`` template, not an
    ``out=`` buffer); an in-place call marks the tensor it writes and, for a
    view, its base (which every view of it reads).  ``Tensor.requires_grad``
    reads (and ``requires_grad_`` and the setter write) the mark, so each op
    decides its plan (``torch_interop.will_backward``) as on the GPU; quack's
    ops mark their own outputs (``differentiable_outputs``)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        owner = getattr(func, "__self__", None)
        if owner is _FLAG:
            if name == "__get__":
                return _requires_grad(args[0])
            return _mark(args[0], bool(args[1]))  # the setter
        if name == "requires_grad_":
            return _mark(args[0], bool(args[1]) if len(args) > 1 else kwargs.get("requires_grad", True))
        if func is torch._C._set_grad_enabled:
            # The caller's grad mode (no_grad, enable_grad): run it as is, not
            # inside the no_grad below, whose exit would undo it.
            return func(*args, **kwargs)
        grad_on = torch.is_grad_enabled()
        with torch.no_grad():
            out = func(*args, **kwargs)
        if name == "detach_":
            _mark(args[0], False)
        if not grad_on or name in _DETACHING or name.endswith("_like") or name.startswith("new_"):
            return out
        inputs = _data_inputs(name, args, kwargs)
        if owner is torch.Tensor.data or not any(_requires_grad(t) for t in inputs):
            return out
        if name in _ELEMENTWISE_OUTPUTS and len(_tensors(out)) == len(inputs):
            _mark_differentiable([t for t, i in zip(_tensors(out), inputs) if _requires_grad(i)])
            return out
        written = [args[0]] if name == "__setitem__" or (name.endswith("_") and not name.startswith("_")) else []
        _mark_differentiable(_tensors(out) + written + [t._base for t in written if t._base is not None])
        return out


def _data_inputs(name: str, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors a call's result is computed from: for ``x.view_as(t)``,
    ``x.to(t)`` and the like only ``x`` (``t`` gives a shape or a dtype);
    never an ``out=`` buffer."""
    if name.endswith("_as") or name in ("to", "type"):
        return _tensors(args[:1])
    return _tensors((args, {k: v for k, v in kwargs.items() if k != "out"}))


def _requires_grad(t: torch.Tensor) -> bool:
    """The flag or the mark; a view also follows its base (written in place after the view was taken)."""
    if _FLAG.__get__(t) or getattr(t, _WANTS_GRAD, False):
        return True
    base = t._base
    return base is not None and getattr(base, _WANTS_GRAD, False)


def _mark(t: torch.Tensor, wanted: bool) -> torch.Tensor:
    """``t.requires_grad_(wanted)`` as a mark: the real flag is only ever cleared."""
    if wanted and not (t.is_floating_point() or t.is_complex()):
        raise RuntimeError("only Tensors of floating point and complex dtype can require gradients")
    setattr(t, _WANTS_GRAD, wanted)
    if not wanted and _FLAG.__get__(t):
        _FLAG.__set__(t, False)
    return t


def _mark_differentiable(tensors: list[torch.Tensor]) -> None:
    for t in tensors:
        if t.is_floating_point() or t.is_complex():
            setattr(t, _WANTS_GRAD, True)


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]


def differentiable_outputs(outputs, backward: bool):
    """An op's outputs as autograd would hand them on: in compile-only mode
    an op whose call will run a backward (``backward``, its plan's) runs its
    forward without a graph, so its floating-point outputs are marked as
    requiring grad here; a later op of the same differentiated function
    (``warming_gradients``) then decides its plan as on the GPU."""
    if backward and not autograd_available():
        _mark_differentiable(_tensors(outputs))
    return outputs


def requires_grad_for_warming(t: torch.Tensor) -> torch.Tensor:
    """A leaf that will be differentiated, for ``warming_gradients``: marked,
    not flagged (no graph can then be built on it, even by code the mode does
    not see, such as a custom ``torch.autograd.Function``)."""
    t = t.detach()
    setattr(t, _WANTS_GRAD, True)
    return t


@contextlib.contextmanager
def warming_gradients() -> Iterator[None]:
    """Compile-only mode: stand in for autograd around calls that will be
    differentiated (``quack.testing.autograd.vjp``, the matrix's ``warm``).

    Mark the leaves to differentiate with ``requires_grad_for_warming``; grad
    mode is the caller's.  Nothing builds a graph, but every op sees which of
    its inputs would require grad (``_GradientsWithoutGraph``) and warms the
    kernels the real call and its backward run: the training plan, or the
    inference one inside a ``torch.no_grad()`` block of the differentiated
    function.  Parameters (``requires_grad`` really set) reach only torch
    calls here, which run without a graph; a custom ``torch.autograd.Function``
    applied to one would build a graph on fake CUDA tensors, which aborts.

    Known limits: the outputs of a custom ``torch.autograd.Function`` of the
    caller's are not marked (its ``apply`` is not a torch call the mode sees;
    quack's own ops mark theirs), so a quack op fed only by one warms its
    inference plan; and calls autograd would refuse (``out=`` with an input
    that requires grad, ``requires_grad_(False)`` on a computed tensor) are
    let through."""
    with _GradientsWithoutGraph():
        yield
