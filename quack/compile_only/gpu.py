"""A GPU machine as far as code running on fake CUDA tensors can tell.

Compile-only mode runs tests written for a GPU on a machine without one.
On a CUDA build of torch (which needs no GPU to make and slice fake CUDA
tensors) this module makes the usual GPU idioms behave as on the GPU:

* ``claimed()``: ``torch.cuda.is_available()`` answers True, and the device
  queries a test or library makes (``device_count``, ``get_device_capability``
  from the compile target ``QUACK_ARCH``, ``get_device_properties``,
  ``get_device_name``, ``current_device``, ``is_bf16_supported``,
  ``synchronize``, ``set_device`` and ``with torch.cuda.device(...)``, the
  memory statistics' resets, ``mem_get_info`` and ``memory_summary``)
  answer for that target.  Autocast and ``GradScaler("cuda")``
  are then on, as on the GPU, so a bf16 autocast region warms bf16 kernels.
  The pytest plugin claims during collection too (module-level ``DEVICE = ...``
  and ``skipif(not torch.cuda.is_available())``).
* ``emulated()``, inside compile-only mode: backward passes are walked in
  Python (``quack.compile_only_autograd``), ``Module.cuda()`` can swap fake
  parameters, every ``torch.compile`` backend runs the graph Dynamo captured
  eagerly (Inductor cannot lower for a GPU it cannot query: the captured
  graph calls quack's registered ops, which warm what the compiled GPU run
  loads, not Inductor's own memory planning), and ``GradScaler`` always steps
  (a sentinel is no evidence of an overflow).

Every patch is process-wide while any thread is inside (a counted region):
keep real GPU work out of other threads meanwhile, as the module docs of
``quack.compile_only`` say for the fake mode itself.  The patched functions
read a plain module flag, which Dynamo can trace.

On a CPU-only build of torch nothing here can work: autograd aborts the
process on the first graph node of a fake CUDA tensor, so ``cpu_build_guard``
refuses such calls with an error saying to use the CUDA build of torch.

The private torch names used are checked by ``missing_private_names()``
(which the tests call), and a missing one is reported by name.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from types import SimpleNamespace
from typing import Iterator

import torch
from torch.overrides import TorchFunctionMode

from quack.cache.config import DEFAULT_ARCH, arch_capability

# Whether compile-only mode can run autograd and the GPU idioms: a CUDA build of torch.
CUDA_BUILD = torch.version.cuda is not None
# What compile-only answers for the GPU's streaming multiprocessors (an H100's, an H200's).
SM_COUNT = 132
L2_BYTES = 50 * 2**20  # and for its L2 cache (an H100's)
DEVICE_MEMORY = 141 * 2**30

_LOCK = threading.Lock()
# The files whose code called the claimed torch.cuda.is_available (the
# plugin's test modules that ask at import are GPU tests; a library a module
# imports that asks makes none).
ASKED_FROM: set[str] = set()


def _target_capability() -> tuple[int, int]:
    """(major, minor) of the compile target (``QUACK_ARCH``, else sm_90a); never a GPU query."""

    return arch_capability(os.environ.get("QUACK_ARCH", "").strip() or DEFAULT_ARCH)


def _is_available() -> bool:
    if not torch.compiler.is_compiling():  # (Dynamo cannot trace frame inspection)
        ASKED_FROM.add(sys._getframe(1).f_code.co_filename)
    return True


def _properties(device=None):
    major, minor = _target_capability()
    return SimpleNamespace(
        name=_name(), major=major, minor=minor, multi_processor_count=SM_COUNT, total_memory=DEVICE_MEMORY,
        is_integrated=False, is_multi_gpu_board=False, warp_size=32, max_threads_per_multi_processor=2048,
        L2_cache_size=L2_BYTES, gcnArchName="", uuid="", regs_per_multiprocessor=65536,
    )


def _name(device=None) -> str:
    major, minor = _target_capability()
    return f"compile-only target sm_{major}{minor}"


class _SameDevice(torch.cuda.device):
    """``torch.cuda.device(i)``: the one device, nothing to switch."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> bool:
        return False


_CLAIM_STUBS = {
    "is_available": _is_available,
    "device_count": lambda: 1,
    "get_device_capability": lambda device=None: _target_capability(),
    "get_device_properties": _properties,
    "get_device_name": _name,
    "current_device": lambda: 0,
    "is_bf16_supported": lambda including_emulation=True: True,
    "synchronize": lambda device=None: None,
    # Dynamo saves and restores the CUDA generator around each trace; there is no generator to save.
    "get_rng_state": lambda device="cuda": torch.empty(0, dtype=torch.uint8),
    "set_rng_state": lambda new_state, device="cuda": None,
    "is_current_stream_capturing": lambda: False,
    # The one device: selecting it changes nothing.
    "set_device": lambda device: None,
    "device": _SameDevice,
    # Memory statistics: nothing is ever allocated on the device.
    "reset_peak_memory_stats": lambda device=None: None,
    "reset_accumulated_memory_stats": lambda device=None: None,
    "mem_get_info": lambda device=None: (DEVICE_MEMORY, DEVICE_MEMORY),
    "memory_summary": lambda device=None, abbreviated=False: "compile-only: no device memory is allocated",
}


def patch_attribute(patches: list, owner, name: str, value) -> None:
    patches.append((owner, name, owner.__dict__[name] if name in owner.__dict__ else getattr(owner, name)))
    setattr(owner, name, value)


class SharedPatches:
    """Patches that the first of overlapping regions (in any thread) installs
    and the last one undoes."""

    def __init__(self, install):
        self.install = install
        self.count = 0
        self.patches: list = []

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        with _LOCK:
            if self.count == 0:
                try:
                    self.install(self.patches)
                except BaseException:
                    self._undo()
                    raise
            self.count += 1
        try:
            yield
        finally:
            with _LOCK:
                self.count -= 1
                if self.count == 0:
                    self._undo()

    def _undo(self) -> None:
        while self.patches:
            owner, name, old = self.patches.pop()
            setattr(owner, name, old)


def _install_claim(patches: list) -> None:
    # Dynamo's device interface keeps torch.cuda's functions from its import:
    # imported now, it keeps the real ones, not these stubs.
    import torch._dynamo.device_interface  # noqa: F401

    for name, stub in _CLAIM_STUBS.items():
        patch_attribute(patches, torch.cuda, name, stub)
    # What Dynamo asks of the accelerator when it starts a trace: the current
    # stream, as an object made of ids that never reaches the driver (made
    # here: Dynamo would trace its construction inside a stub).
    stream = torch.Stream(stream_id=0, device_index=0, device_type=1)
    patch_attribute(patches, torch.accelerator, "current_device_index", lambda: 0)
    patch_attribute(patches, torch.accelerator, "current_stream", lambda device=None: stream)
    # Fake CUDA tensors need no CUDA context; older torch releases make one
    # for each fake device whenever CUDA claims to be available.
    fake_tensor = torch._subclasses.fake_tensor
    if hasattr(fake_tensor, "init_gpu_context"):
        patch_attribute(patches, fake_tensor, "init_gpu_context", lambda device: None)


def _install_emulation(patches: list) -> None:
    missing = missing_private_names()
    if missing:
        raise RuntimeError(
            f"compile-only mode needs torch's private {', '.join(missing)}, which this torch "
            f"({torch.__version__}) lacks: run compile-only with a torch release it supports"
        )
    from quack.compile_only.autograd import run_backward

    patch_attribute(patches, torch.autograd, "_engine_run_backward", run_backward)
    patch_attribute(patches, torch.utils, "swap_tensors", _forgetting_swap(torch.utils.swap_tensors))
    for wrapper in (torch._TorchCompileInductorWrapper, torch._TorchCompileAOTInductorWrapper,
                    torch._TorchCompileWrapper):
        patch_attribute(patches, wrapper, "__call__", _run_captured_graph)
    patch_attribute(patches, torch.amp.grad_scaler.GradScaler, "_maybe_opt_step", _always_step)


def _install_cpu_build_guard(patches: list) -> None:
    """``autograd.Function.apply`` (not a torch call a mode sees) refused
    where it would build a graph on a fake CUDA tensor; backward passes refused."""
    original = torch.autograd.Function.apply.__func__

    def apply(cls, *args, **kwargs):
        if _requires_grad_on_fake_cuda((args, kwargs)):
            raise RuntimeError(f"{CPU_BUILD_MESSAGE} (the call: {cls.__name__}.apply)")
        return original(cls, *args, **kwargs)

    patch_attribute(patches, torch.autograd.Function, "apply", classmethod(apply))
    patch_attribute(patches, torch.autograd, "_engine_run_backward", _refuse_backward)


_CLAIM = SharedPatches(_install_claim)
_EMULATION = SharedPatches(_install_emulation)
_CPU_BUILD_GUARD = SharedPatches(_install_cpu_build_guard)


@contextlib.contextmanager
def claimed() -> Iterator[None]:
    """``torch.cuda`` answers as a GPU of the compile target would (a CUDA build of torch only)."""
    if not CUDA_BUILD:
        yield
        return
    with _CLAIM.held():
        yield


@contextlib.contextmanager
def emulated() -> Iterator[None]:
    """Inside compile-only mode: the claim, plus backward, ``Module.cuda()``,
    ``torch.compile`` and ``GradScaler`` as described in the module docs; on
    a CPU-only build, the guard that refuses autograd on fake CUDA tensors
    (with ``thread_modes``, which each thread in the mode enters)."""
    if not CUDA_BUILD:
        with _CPU_BUILD_GUARD.held():
            yield
        return
    with _CLAIM.held(), _EMULATION.held():
        yield


def thread_modes() -> contextlib.AbstractContextManager:
    """The modes of ``emulated`` that live on a thread's own mode stack: on a
    CPU-only build, the guard's ``TorchFunctionMode``."""
    return contextlib.nullcontext() if CUDA_BUILD else _CpuBuildGuard()


def missing_private_names() -> list[str]:
    """The private torch names the emulation relies on that this torch lacks."""
    import torch.amp.grad_scaler
    import torch.autograd.graph

    wanted = [
        (torch.autograd, "_engine_run_backward"),
        (torch, "_TorchCompileInductorWrapper"),
        (torch, "_TorchCompileAOTInductorWrapper"),
        (torch, "_TorchCompileWrapper"),
        (torch.amp.grad_scaler.GradScaler, "_maybe_opt_step"),
        (torch.autograd.graph.Node, "_input_metadata"),
        (torch.autograd.graph.Node, "_sequence_nr"),
        (torch._subclasses.fake_tensor.FakeTensorMode, "avoid_device_init"),
    ]
    missing = [f"{getattr(o, '__name__', o)}.{n}" for o, n in wanted if not hasattr(o, n)]
    if not hasattr(torch._subclasses.fake_tensor.FakeTensorMode(), "fake_tensor_converter"):
        missing.append("FakeTensorMode.fake_tensor_converter")
    return missing


def _run_captured_graph(self, model, inputs):
    """A ``torch.compile`` backend, inside compile-only mode: the captured graph, run eagerly."""
    return model.forward


def _always_step(self, optimizer, optimizer_state, *args, **kwargs):
    """``GradScaler``'s step: no sentinel counts as an inf or NaN found."""
    return optimizer.step(*args, **kwargs)


def _forgetting_swap(swap):
    """``torch.utils.swap_tensors`` for fake tensors: FakeTensorMode's
    converter memo holds a weak reference to every fake tensor, which
    ``swap_tensors`` refuses (``Module.cuda()`` / ``.to()`` swap fake
    parameters); the two tensors are dropped from their modes' memos first."""

    def swap_tensors(t1, t2):
        for t in (t1, t2):
            mode = getattr(t, "fake_mode", None)
            if mode is not None:
                # Other threads in the mode may convert meanwhile (``conversion_lock``).
                with getattr(mode, "conversion_lock", contextlib.nullcontext()):
                    memo = mode.fake_tensor_converter.tensor_memo
                    for key in [k for k, v in list(memo.items()) if v is t1 or v is t2]:
                        memo.pop(key, None)
        return swap(t1, t2)

    return swap_tensors


# --------------------------------------------------------------------------
# A CPU-only build of torch: refuse, never abort.
# --------------------------------------------------------------------------

CPU_BUILD_MESSAGE = (
    "autograd on fake CUDA tensors needs the CUDA build of torch under compile-only mode (it needs no GPU); "
    "this CPU-only build of torch would abort the process here. Install the CUDA build of torch "
    "(e.g. pip install torch from PyPI on Linux), or run this test on a GPU"
)


def _requires_grad_on_fake_cuda(tree) -> bool:
    """Grad mode is on and some fake CUDA tensor in ``tree`` requires grad."""
    if not torch.is_grad_enabled():
        return False
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.utils._pytree import tree_leaves

    return any(
        isinstance(t, FakeTensor) and t.device.type == "cuda" and torch.Tensor.requires_grad.__get__(t)
        for t in tree_leaves(tree)
    )


# Tensor attributes whose reads and writes build no graph node.
_GRAPHLESS_ATTRIBUTES = {"grad", "_grad", "data", "_base", "requires_grad"}


class _CpuBuildGuard(TorchFunctionMode):
    """A clean RuntimeError where a CPU-only torch would abort: a torch call
    whose result autograd would attach to a fake CUDA input requiring grad.
    The call runs without a graph first; its floating-point result says
    whether autograd would have built a node (calls returning sizes, flags,
    indices build none; ``*_like``, ``new_*`` and ``detach`` take no gradient)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        owner = getattr(func, "__self__", None)
        if getattr(owner, "__name__", "") in _GRAPHLESS_ATTRIBUTES or not _requires_grad_on_fake_cuda((args, kwargs)):
            return func(*args, **kwargs)
        with torch.no_grad():
            out = func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if name.endswith("_like") or name.startswith("new_") or name in ("detach", "detach_", "requires_grad_"):
            return out
        from torch.utils._pytree import tree_leaves

        if any(isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex()) for t in tree_leaves(out)):
            raise RuntimeError(f"{CPU_BUILD_MESSAGE} (the call: {getattr(func, '__qualname__', name)})")
        return out


def _refuse_backward(*args, **kwargs):
    raise RuntimeError(f"{CPU_BUILD_MESSAGE} (the call: a backward pass)")
