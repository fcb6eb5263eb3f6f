"""Tensors a kernel must not launch on, refused with a clear error and
nothing launched: fake tensors (a user's FakeTensorMode, meta tensors)
outside compile-only mode and negated views, by the ops' input checks; and,
where a tensor with elements and a null data pointer reaches a launcher
anyway, by the C launcher, its ctypes fallback and the first call through
the DSL.

No GPU: the ops refuse before they ask for one, and the launchers call a
ctypes entry point that records its calls (as tests/test_fast_launcher.py)."""

from __future__ import annotations

import array
import ctypes

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import quack
from cache_fixtures.env import cache_env  # noqa: F401  (a fixture)
from cache_fixtures.fake_cuda import cuda_empty as _cuda
from quack.calls import torch_interop as ti
from quack.launch.launcher import FastLauncher, c_fields, layout, make_packer, parse_abi
from quack.compile_only import compile_only_mode

NO_MEMORY = "is a tensor with elements but no memory"

# Each op's first tensor argument under a user's FakeTensorMode: (call, the error).
OPS = {
    "rmsnorm": (lambda x: quack.rmsnorm(x), "quack.rmsnorm: x is a FakeTensor"),
    "layernorm": (lambda x: quack.layernorm(x), "quack.layernorm: x is a FakeTensor"),
    "softmax": (lambda x: quack.softmax(x), "quack.softmax: x is a FakeTensor"),
    "cross_entropy": (
        lambda x: quack.cross_entropy(x, torch.zeros(x.shape[0], device="cuda", dtype=torch.int64)),
        "quack.cross_entropy: logits is a FakeTensor",
    ),
    "gemm": (lambda x: quack.gemm(x, _cuda(64, 64)), "A is a FakeTensor"),
}


@pytest.mark.parametrize("op", sorted(OPS))
def test_ops_refuse_the_fake_tensors_of_a_users_fake_mode(op):
    # Shape propagation or meta initialisation runs the eager op on fake
    # tensors: on a GPU their launch read address 0 (an illegal memory
    # access, which leaves the process's CUDA context unusable).
    call, message = OPS[op]
    with FakeTensorMode():
        x = _cuda(4, 64)
        with pytest.raises(ValueError, match=message) as refused:
            call(x)
    assert "quack.compile_only.compile_only_mode()" in str(refused.value)


def test_every_tensor_argument_is_checked():
    # x is refused first in an op; a parameter's check refuses a fake one too.
    with FakeTensorMode():
        x, weight = _cuda(4, 64), _cuda(64)
        with pytest.raises(ValueError, match="weight is a FakeTensor"):
            ti.check_param("weight", weight, x)


def test_meta_tensors_are_refused():
    with pytest.raises(ValueError, match="quack.rmsnorm: x is a meta tensor.*compile_only_mode"):
        quack.rmsnorm(torch.empty(4, 64, device="meta", dtype=torch.bfloat16))


def test_fake_tensors_pass_where_nothing_launches(monkeypatch):
    # Compile-only mode warms kernels on fake tensors, and a tracer that says
    # it compiles (non-strict export) hands the ops its fakes.
    with compile_only_mode():
        ti.check_cuda("x", _cuda(4, 64), op="quack.rmsnorm")
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    with FakeTensorMode():
        ti.check_cuda("x", _cuda(4, 64), op="quack.rmsnorm")


@pytest.mark.parametrize("which", ["x", "weight", "residual"])
def test_negated_views_are_refused(cache_env, which):  # noqa: F811
    # A negated view's memory holds the values before the negation: a kernel
    # would read them un-negated.  Refused before the plan (nothing compiled).
    with compile_only_mode():
        args = {"x": _cuda(4, 64), "weight": _cuda(64), "residual": _cuda(4, 64)}
        args[which] = torch._neg_view(args[which])
        with pytest.raises(ValueError, match=rf"{which} is a negated view .*{which}\.resolve_neg\(\)"):
            quack.rmsnorm(args["x"], args["weight"], residual=args["residual"])
    assert not [path for path in cache_env.writable.rglob("*") if path.is_file()]


def test_the_imaginary_part_of_a_conjugate_view_is_refused():
    # The one negated view torch makes by itself: a real tensor.
    with compile_only_mode():
        imag = torch.empty(4, 64, device="cuda", dtype=torch.complex64).conj().imag
        assert imag.dtype == torch.float32 and imag.is_neg()
        with pytest.raises(ValueError, match="quack.rmsnorm: x is a negated view"):
            quack.rmsnorm(imag)


def test_conjugate_views_are_refused():
    # A conjugate view is complex: no op takes its dtype, so none reads its memory as it is.
    with compile_only_mode():
        view = torch.empty(4, 64, device="cuda", dtype=torch.complex64).conj()
        assert view.is_conj()
        with pytest.raises(TypeError, match="x has dtype complex64"):
            quack.rmsnorm(view)


# ---- the launchers ----------------------------------------------------------

# A kernel of (x: a tensor with a dynamic size, eps, y: a tensor).
ABI = parse_abi("""
typedef struct { void *data; int32_t dynamic_shapes[1]; } p_Tensor_mX_t;
static inline int32_t cute_dsl_p_wrapper(p_Kernel_Module_t *module, p_Tensor_mX_t *mX, float eps,
    p_Tensor_mX_t *mY, cudaStream_t stream) {
""", "p")
PRESENT = [True, True, True, True]
ENTRY = ctypes.CFUNCTYPE(None, ctypes.POINTER(ctypes.c_void_p))


class _Storageless(torch.Tensor):
    """A wrapper subclass with no storage (its data pointer is 0), as a tensor
    subclass that holds its data elsewhere is."""

    @staticmethod
    def __new__(cls, shape):
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=torch.float32)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError(f"{func} on a tensor without storage")


def _fake(*shape):
    with FakeTensorMode():
        return torch.empty(*shape)


NO_MEMORY_TENSORS = {"fake": lambda: _fake(8), "storageless": lambda: _Storageless((8,))}


@pytest.fixture
def fastlaunch():
    return pytest.importorskip("quack.launch._fastlaunch", reason="the C launcher is not built")


class _Recorder:
    def __init__(self):
        self.calls = 0
        self.entry = ENTRY(self._call)
        self.address = ctypes.cast(self.entry, ctypes.c_void_p).value

    def _call(self, args):
        self.calls += 1


def _c_launcher(fastlaunch, recorder):
    placed, starts, words = layout(ABI, PRESENT)
    buf = array.array("q", [0] * words)
    packed = (ctypes.c_void_p * len(starts))(*[buf.buffer_info()[0] + 8 * s for s in starts])
    launch = fastlaunch.Launcher(recorder.address, packed, buf, None, len(PRESENT), c_fields(placed),
                                 torch.Tensor.__dlpack_c_exchange_api__, torch.Tensor)
    return launch, buf, packed  # the launcher holds its buffers: kept alive with it all the same


@pytest.mark.parametrize("kind", sorted(NO_MEMORY_TENSORS))
def test_c_launcher_refuses_a_tensor_with_elements_and_no_memory(fastlaunch, kind):
    recorder = _Recorder()
    launch, *_ = _c_launcher(fastlaunch, recorder)
    tensor = NO_MEMORY_TENSORS[kind]()
    with pytest.raises(ValueError, match=f"argument 2 {NO_MEMORY}.*compile_only_mode"):
        launch(torch.zeros(8), 0.5, tensor, 0)
    assert recorder.calls == 0
    launch(torch.zeros(8), 0.5, torch.zeros(8), 0)
    assert recorder.calls == 1


def test_c_launcher_takes_an_empty_tensor_without_memory(fastlaunch):
    recorder = _Recorder()
    launch, *_ = _c_launcher(fastlaunch, recorder)
    empty = torch.empty(0)
    assert empty.data_ptr() == 0
    launch(torch.zeros(8), 0.5, empty, 0)
    assert recorder.calls == 1


def test_python_packer_refuses_a_tensor_with_elements_and_no_memory():
    pack, starts, words = make_packer(ABI, PRESENT)
    buf = array.array("q", [-1] * words)
    with pytest.raises(ValueError, match=f"argument 0 {NO_MEMORY}"):
        pack(buf, torch.empty(8, device="meta"), 0.5, torch.zeros(8), 0)
    pack(buf, torch.zeros(8), 0.5, torch.empty(0), 0)  # no elements: a null pointer is fine
    assert buf[starts[2]] == 0


class _DslFunction:
    """A ``JitCompiledFunction`` stand-in: counts the first call's launches."""

    def __init__(self):
        self.calls = 0

    def __call__(self, *args):
        self.calls += 1


def test_the_first_call_refuses_a_tensor_with_elements_and_no_memory():
    dsl = _DslFunction()
    fast = FastLauncher(dsl, ABI)
    with pytest.raises(ValueError, match=f"argument 2 {NO_MEMORY}"):
        fast(torch.zeros(8), 0.5, torch.empty(8, device="meta"), 0)
    assert dsl.calls == 0
