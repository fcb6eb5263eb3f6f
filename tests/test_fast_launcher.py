"""The C launcher (quack/launch/_fastlaunch.c) on the CPU: it writes the bytes
the Python packer writes, calls the entry point with the pointer array, and
reports a failed launch; FastLauncher takes it after its first call, and
falls back to ctypes with a notice where it is missing.  The eager fast
path's parts (quack/calls/fastpath.py): what ``describe`` tells apart and refuses,
the direct launcher's row and context fields, the closure table (the ops
taking it: tests/test_user_calls.py, on the GPU).

The entry point here is a ctypes callback standing in for an exported
object's host entry (``void entry(void **args)``), and tensors are CPU ones:
torch's DLPack exchange table serves any device.  Where the extension is not
built in place, the fixture builds it with the project's own setup.py (what
``pip install .`` does)."""

from __future__ import annotations

import array
import collections
import ctypes
import importlib.util
import os
import shutil
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch

import quack.launch

from quack.calls import fastpath
from quack.launch import launcher
from quack.launch.launcher import FastLauncher, layout, make_packer, parse_abi

REPO = Path(__file__).resolve().parents[1]

HEADER = """
typedef struct { void *data; int32_t dynamic_shapes[1]; int64_t dynamic_strides[1]; } p_Tensor_mX_t;
typedef struct { void *data; } p_Tensor_mW_t;
typedef struct { void *data; int32_t dynamic_shapes[2]; } p_Tensor_mR_t;
static inline int32_t cute_dsl_p_wrapper(p_Kernel_Module_t *module, p_Tensor_mX_t *mX, p_Tensor_mW_t *mW,
    p_Tensor_mR_t *mR, float eps, int32_t count, bool flag, double scale, int64_t big, cudaStream_t stream) {
"""
ABI = parse_abi(HEADER, "p")
# Argument 2 (a residual, say) was None at compile time: it has no struct.
PRESENT = [True, True, False, True, True, True, True, True, True, True]
ENTRY = ctypes.CFUNCTYPE(None, ctypes.POINTER(ctypes.c_void_p))


@pytest.fixture(scope="module")
def built_by_setup_py(tmp_path_factory):
    return _build(tmp_path_factory.mktemp("fastlaunch"))


@pytest.fixture(scope="module")
def fastlaunch(request):
    """The package's own build where there is one (Bazel's, an in-place or pip build), else setup.py's."""
    try:
        from quack.launch import _fastlaunch
    except ImportError:
        return request.getfixturevalue("built_by_setup_py")
    return _fastlaunch


def _build(out: Path):
    """The extension built by the project's setup.py (in a copy holding just
    it and the C source) and imported from there."""
    source = out / "src"
    (source / "quack/launch").mkdir(parents=True)
    shutil.copy(REPO / "setup.py", source)
    shutil.copy(REPO / "quack/launch/_fastlaunch.c", source / "quack/launch")
    done = subprocess.run(
        [sys.executable, "setup.py", "build_ext", "--build-lib", str(out / "lib"), "--build-temp", str(out / "tmp")],
        cwd=source, capture_output=True, text=True,
    )
    built = sorted((out / "lib").glob("quack/launch/_fastlaunch*.so"))
    if not built:
        pytest.skip(f"the C launcher could not be built here (no C compiler?): {done.stderr[-500:]}")
    spec = importlib.util.spec_from_file_location("quack.launch._fastlaunch", built[0])
    assert built[0].name == "_fastlaunch.abi3.so"  # the stable ABI: one build for every Python 3.11+
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _args():
    x = torch.zeros(37, 100)[:, :64]  # row stride 100
    w = torch.zeros(64)
    r = torch.zeros(5, 3)
    return [x, w, None, r, 0.5, -100, True, -2.25, -(2**40), 0xABC]


class _Recorder:
    """An entry point that remembers the first pointer of each call's array."""

    def __init__(self):
        self.firsts = []
        self.entry = ENTRY(lambda args: self.firsts.append(args[0]))
        self.address = ctypes.cast(self.entry, ctypes.c_void_p).value


def _c_launcher(fastlaunch, entry_address, result=None):
    placed, starts, words = layout(ABI, PRESENT)
    buf = array.array("q", [0] * words)
    base = buf.buffer_info()[0]
    packed = (ctypes.c_void_p * len(starts))(*[base + 8 * s for s in starts])
    fields = launcher.c_fields(placed)
    c = fastlaunch.Launcher(entry_address, packed, buf, result, len(PRESENT), fields,
                            torch.Tensor.__dlpack_c_exchange_api__, torch.Tensor)
    return c, buf, packed


def test_c_launcher_writes_what_the_python_packer_writes_and_calls_the_entry(fastlaunch):
    recorder = _Recorder()
    c, buf, packed = _c_launcher(fastlaunch, recorder.address)
    args = _args()
    c(*args)
    pack, _, words = make_packer(ABI, PRESENT)
    expected = array.array("q", [0] * words)
    pack(expected, *args)
    # Field by field: the C launcher writes each field's own bytes (a word's
    # spare bytes are nobody's), the Python packer whole words.
    placed, _, _ = layout(ABI, PRESENT)
    assert len(placed) == 13
    for _, what, ctype, _, offset in placed:
        size = {"int32_t": 4, "float": 4, "bool": 1}.get(ctype, 8)
        assert buf.tobytes()[offset:offset + size] == expected.tobytes()[offset:offset + size], (what, ctype)
    assert recorder.firsts == [packed[0]]
    assert ctypes.c_void_p.from_address(packed[0]).value == args[0].data_ptr()


def test_c_launcher_reports_a_failed_launch(fastlaunch):
    status = ctypes.c_int32(0)

    def fail(args):
        status.value = 700  # what the entry point writes for a CUDA error

    entry = ENTRY(fail)
    # The launcher holds its buffers (dropped here): no use after free.
    c, _, _ = _c_launcher(fastlaunch, ctypes.cast(entry, ctypes.c_void_p).value, status)
    with pytest.raises(RuntimeError, match="CUDA error 700"):
        c(*_args())


def test_c_launcher_refuses_bad_arguments(fastlaunch):
    recorder = _Recorder()
    c, _, _ = _c_launcher(fastlaunch, recorder.address)
    args = _args()
    with pytest.raises(TypeError, match="takes 10 arguments, got 9"):
        c(*args[:-1])
    with pytest.raises(TypeError, match="argument 1 must be a torch.Tensor"):
        c(*[args[0], 3.0] + args[2:])
    with pytest.raises(OverflowError, match="32-bit"):
        c(*args[:5] + [2**31] + args[6:])
    with pytest.raises(TypeError):
        c(*args[:4] + ["eps"] + args[5:])
    assert recorder.firsts == []  # nothing launched
    with pytest.raises(ValueError, match="bad field"):
        fastlaunch.Launcher(recorder.address, (ctypes.c_void_p * 1)(), array.array("q", [0]), None, 1,
                            [(0, "x", "i", 0, 0)], torch.Tensor.__dlpack_c_exchange_api__, torch.Tensor)
    with pytest.raises(ValueError, match="bad field"):  # past the buffer's end
        fastlaunch.Launcher(recorder.address, (ctypes.c_void_p * 1)(), array.array("q", [0]), None, 1,
                            [(0, "s", "l", 0, 4)], torch.Tensor.__dlpack_c_exchange_api__, torch.Tensor)


class _Executor:
    """The DSL executor's parts FastLauncher takes over after the first call."""

    def __init__(self, entry):
        self.capi_func = entry
        self.cuda_result = ctypes.c_int32(0)

    def _get_invoke_packed_args(self, addresses):
        return list(addresses) + [ctypes.addressof(self.cuda_result)]


class _DslFunction:
    def __init__(self, entry):
        self.calls = 0
        self._default_executor = _Executor(entry)

    def __call__(self, *args):
        self.calls += 1


@pytest.fixture(autouse=True)
def _forget_the_launcher_choice():
    """Tests that swap the C module (``_use_module``) leave ``_c_module``'s
    cached answer behind: later tests in the process must see the real one."""
    yield
    launcher._c_module.cache_clear()
    fastpath._c_module.cache_clear()


def _use_module(monkeypatch, module):
    """Make ``module`` what ``from . import _fastlaunch`` finds (None: an
    ImportError): the package attribute, where an import set it, comes first."""
    monkeypatch.setitem(sys.modules, "quack.launch._fastlaunch", module)
    monkeypatch.setattr(quack.launch, "_fastlaunch", module, raising=False)
    if module is None:
        monkeypatch.delattr(quack.launch, "_fastlaunch")
    launcher._c_module.cache_clear()


def _launch_twice(monkeypatch, module):
    _use_module(monkeypatch, module)
    launcher._c_module.cache_clear()
    recorder = _Recorder()
    dsl = _DslFunction(recorder.entry)
    fast = FastLauncher(dsl, ABI)
    args = _args()
    fast(*args)  # through the DSL
    fast(*args)  # through the entry point
    launcher._c_module.cache_clear()
    return fast, dsl, recorder, args


def test_fast_launcher_takes_the_c_launcher_after_the_first_call(fastlaunch, monkeypatch):
    fast, dsl, recorder, args = _launch_twice(monkeypatch, fastlaunch)
    assert dsl.calls == 1 and len(recorder.firsts) == 1
    assert fast._c is not None
    assert ctypes.c_void_p.from_address(recorder.firsts[0]).value == args[0].data_ptr()
    assert fast.bare(3) >= 0 and len(recorder.firsts) == 4


def test_without_the_extension_ctypes_launches_after_one_notice(monkeypatch):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fast, dsl, recorder, args = _launch_twice(monkeypatch, None)  # None in sys.modules: ImportError
    assert fast._c is None and fast.bare(1) is None
    assert dsl.calls == 1 and len(recorder.firsts) == 1
    assert ctypes.c_void_p.from_address(recorder.firsts[0]).value == args[0].data_ptr()
    notices = [w for w in caught if "launch through ctypes" in str(w.message)]
    assert len(notices) == 1 and "not built" in str(notices[0].message)


def test_launcher_kind_names_the_launcher(fastlaunch, monkeypatch):
    _use_module(monkeypatch, fastlaunch)
    try:
        assert launcher.launcher_kind() == "C"
        _use_module(monkeypatch, None)
        with pytest.warns(UserWarning, match="ctypes"):
            assert launcher.launcher_kind() == "ctypes"
    finally:
        launcher._c_module.cache_clear()


def test_setup_py_builds_the_launcher(built_by_setup_py):
    # What `pip install .` builds, whichever build the other tests use.
    assert built_by_setup_py.Launcher.__name__ == "Launcher"


@pytest.mark.skipif("TEST_SRCDIR" not in os.environ, reason="only under Bazel: its runfiles carry //quack's build")
def test_bazel_builds_the_launcher_into_the_package():
    # tools/quack_test.bzl gives GPU tests (and this one) //quack:launch/_fastlaunch.abi3.so.
    launcher._c_module.cache_clear()
    try:
        assert launcher.launcher_kind() == "C"
    finally:
        launcher._c_module.cache_clear()


_LOGGING_ENTRY = r"""
#include <stdint.h>
#include <string.h>
/* Logs, per launch, the data pointers of the first and third arguments and the second's float. */
static int64_t entries[200000][3];
static long count;
void entry(void **args) {
    if (count < 200000) {
        float value;
        memcpy(&value, args[1], sizeof value);
        entries[count][0] = *(int64_t *)args[0];
        entries[count][1] = (int64_t)value;
        entries[count][2] = *(int64_t *)args[2];
        count++;
    }
}
long launches(void) { return count; }
int64_t *log_of_launches(void) { return &entries[0][0]; }
"""


class _YieldingFloat:
    """A scalar whose conversion lets another thread run (as a 0-dim tensor's does)."""

    def __init__(self, value):
        self.value = value

    def __float__(self):
        time.sleep(0)
        return self.value


class _YieldingSizes(torch.Tensor):
    """A tensor subclass whose sizes are answered in Python (letting another
    thread run), as a wrapper subclass's are; its data pointer is 0."""

    @staticmethod
    def __new__(cls, inner):
        wrapper = torch.Tensor._make_wrapper_subclass(
            cls, inner.shape, strides=inner.stride(), dtype=inner.dtype, dispatch_sizes_strides_policy="sizes"
        )
        wrapper.inner = inner
        return wrapper

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        time.sleep(0)
        unwrap = [a.inner if isinstance(a, _YieldingSizes) else a for a in args]
        return func(*unwrap, **(kwargs or {}))


@pytest.mark.parametrize("yielding", ["scalar", "tensor_sizes"])
def test_threads_never_launch_with_each_others_arguments(fastlaunch, tmp_path, yielding):
    # Each launch must see its own arguments, also where reading one lets
    # another thread run (the C launcher reads everything, then writes and
    # launches with no Python code in between).
    source = tmp_path / "entry.c"
    source.write_text(_LOGGING_ENTRY)
    done = subprocess.run(["cc", "-shared", "-fPIC", "-O1", "-o", str(tmp_path / "entry.so"), str(source)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"no C compiler for the logging entry point: {done.stderr[-300:]}")
    lib = ctypes.CDLL(str(tmp_path / "entry.so"))
    lib.launches.restype = ctypes.c_long
    lib.log_of_launches.restype = ctypes.POINTER(ctypes.c_int64)
    abi = parse_abi("""
        typedef struct { void *data; } p_Tensor_mX_t;
        static inline int32_t cute_dsl_p_wrapper(p_Kernel_Module_t *module, p_Tensor_mX_t *mX, float eps,
            p_Tensor_mX_t *mR) {
    """, "p")
    placed, starts, words = layout(abi, [True, True, True])
    buf = array.array("q", [0] * words)
    packed = (ctypes.c_void_p * len(starts))(*[buf.buffer_info()[0] + 8 * s for s in starts])
    c = fastlaunch.Launcher(
        ctypes.cast(lib.entry, ctypes.c_void_p).value, packed, buf, None, 3,
        launcher.c_fields(placed),
        torch.Tensor.__dlpack_c_exchange_api__, torch.Tensor,
    )
    # Thread v launches (x[v], v, r[v]), where reading its scalar, or its last
    # tensor (read after the others: a launcher that stores as it reads would
    # have stored them already), lets the other thread run.
    x = {1: torch.zeros(4), 2: torch.zeros(4)}
    # Empty: only a tensor without elements may have a null data pointer (a wrapper subclass has no storage).
    r = {v: _YieldingSizes(torch.zeros(0)) if yielding == "tensor_sizes" else torch.zeros(4) for v in x}
    calls = 20_000

    def launch(value):
        scalar = _YieldingFloat(float(value)) if yielding == "scalar" else float(value)
        for _ in range(calls):
            c(x[value], scalar, r[value])

    threads = [threading.Thread(target=launch, args=(value,)) for value in x]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    log = lib.log_of_launches()
    launched = collections.Counter(tuple(log[3 * i + k] for k in range(3)) for i in range(lib.launches()))
    # A wrapper subclass has no storage: the launcher reads its data pointer as 0.
    expected = {(x[v].data_ptr(), v, 0 if isinstance(r[v], _YieldingSizes) else r[v].data_ptr()): calls for v in x}
    assert launched == expected, f"launches by arguments: {dict(launched)}, expected {expected}"


def test_both_packers_refuse_what_does_not_fit(fastlaunch):
    # A 32-bit size or scalar past its range, or a finite float past float32's,
    # is an error in either launcher, never a wrapped value (inf passes).
    recorder = _Recorder()
    c, buf, packed = _c_launcher(fastlaunch, recorder.address)
    pack, _, words = make_packer(ABI, PRESENT)
    python_buf = array.array("q", [0] * words)
    args = _args()
    big_rows = torch.zeros(1).expand(2**31, 64)  # no storage beyond one element
    for bad in ([big_rows] + args[1:], args[:5] + [2**31] + args[6:], args[:4] + [1e39] + args[5:]):
        with pytest.raises(OverflowError):
            c(*bad)
        with pytest.raises(OverflowError):
            pack(python_buf, *bad)
    for fits in (float("inf"), 3.4028235e38, -3.4028235e38):  # the last two round to float32's largest
        c(*args[:4] + [fits] + args[5:])
        pack(python_buf, *args[:4] + [fits] + args[5:])
        offset = layout(ABI, PRESENT)[0][7][4]
        assert buf.tobytes()[offset:offset + 4] == python_buf.tobytes()[offset:offset + 4]
    assert len(recorder.firsts) == 3


def test_a_layout_the_c_launcher_refuses_launches_through_ctypes(fastlaunch, monkeypatch):
    # Say a kernel had more fields than the C launcher takes: it still launches.
    class Refusing:
        @staticmethod
        def Launcher(*args):
            raise ValueError("quack launcher: at most 256 fields")

    with pytest.warns(UserWarning, match="refused its layout"):
        fast, dsl, recorder, args = _launch_twice(monkeypatch, Refusing)
    assert fast._c is None and dsl.calls == 1 and len(recorder.firsts) == 1


@pytest.fixture()
def described(fastlaunch):
    """The C module with describe() configured as quack.fastpath configures it."""
    fastlaunch.configure(torch.Tensor.__dlpack_c_exchange_api__, (torch.Tensor, torch.nn.Parameter))
    return fastlaunch


def test_describe_tells_apart_what_checks_and_plans_read(described):
    d = described.describe
    x = torch.zeros(8, 64)
    base = d(False, x, None, 3, True)
    assert base == d(False, torch.ones(8, 64), None, 3, True)  # values do not count
    different = [
        d(False, x.half(), None, 3, True),  # dtype
        d(False, torch.zeros(4, 64), None, 3, True),  # shape
        d(False, torch.zeros(64, 8).t(), None, 3, True),  # strides
        d(False, torch.zeros(8 * 64 + 1)[1:].view(8, 64), None, 3, True),  # address mod 16
        d(False, x, x, 3, True),  # None or a tensor
        d(False, x, None, 4, True),  # an option's value
        d(False, x, None, 3, False),
        d(False, x, None, True, True),  # a bool is not the int 1
    ]
    assert base not in different and len(set(different)) == len(different)
    # requires_grad counts under grad mode only (where it decides the plan).
    flagged = torch.zeros(8, 64, requires_grad=True)
    assert d(False, flagged) == d(False, x)
    assert d(True, flagged) != d(True, x)
    assert d(True, torch.nn.Parameter(torch.zeros(8, 64))) == d(True, flagged)


def test_describe_refuses_what_it_cannot_key(described):
    class Sub(torch.Tensor):
        pass

    x = torch.zeros(4)
    assert described.describe(False, x, 1e-6) is None  # floats: eps is passed, not keyed
    assert described.describe(False, x, "mean") is None
    assert described.describe(False, x.as_subclass(Sub)) is None
    assert described.describe(False, x, 2**70) is None


TENSOR_ABI = ["tensor", "int32_t", 1, "int64_t", 1]


def _direct(fastlaunch, entry_address, rows, get_context=0, context=0, device=-1, per_stream=(), capturing=0,
            api=None, header_abi=(TENSOR_ABI, TENSOR_ABI, ["scalar", "float"])):
    present = [True] * len(header_abi)
    placed, starts, words = layout(list(header_abi), present)
    buf = array.array("q", [0] * words)
    base = buf.buffer_info()[0]
    packed = (ctypes.c_void_p * len(starts))(*[base + 8 * s for s in starts])
    fields = []
    for i, w, c, dim, off in launcher.c_fields(placed):
        if i in per_stream and w == "d":
            fields.append((i, "K", "", 0, 0))
        fields.append((i, "S" if i in rows and w == "s" else "T" if i in rows and w == "t" else w, c, dim, off))
    api = torch.Tensor.__dlpack_c_exchange_api__ if api is None else api
    c = fastlaunch.Launcher(entry_address, packed, buf, None, len(header_abi), fields, api, torch.Tensor, get_context,
                            context, 0, 0, device, capturing)
    return c, buf


def test_direct_launcher_reads_contiguous_tensors_as_rows(fastlaunch):
    recorder = _Recorder()
    c, buf = _direct(fastlaunch, recorder.address, rows={0})
    x = torch.zeros(2, 3, 8)  # read as rows: (6, 8)
    v = torch.zeros(5, 7)  # argument 1 keeps its own sizes
    assert c(x, v, 0.5) is None
    words = buf.tolist()
    assert words[0] == x.data_ptr() and ctypes.c_int32(words[1]).value == 6 and words[2] == 8
    assert words[3] == v.data_ptr() and ctypes.c_int32(words[4]).value == 5 and words[5] == 7
    assert len(recorder.firsts) == 1


def test_direct_launcher_reads_a_per_stream_argument_by_the_current_stream(fastlaunch):
    """A per-stream argument is a dict from stream handles to tensors: the
    launcher passes the current stream's (a CPU tensor's stream is handle 0
    here), declines a stream without one, takes a tensor as it is, and
    refuses anything else."""
    recorder = _Recorder()
    c, buf = _direct(fastlaunch, recorder.address, rows=set(), per_stream={1})
    x, mine, other = torch.zeros(4, 8), torch.zeros(3, 5), torch.zeros(2, 2)
    assert c(x, {0: mine, 12345: other}, 1.0) is None
    words = buf.tolist()
    assert words[3] == mine.data_ptr() and ctypes.c_int32(words[4]).value == 3 and words[5] == 5
    assert c(x, {12345: other}, 1.0) is NotImplemented and c(x, {}, 1.0) is NotImplemented
    assert len(recorder.firsts) == 1  # the declined calls launched nothing
    assert c(x, other, 1.0) is None
    words = buf.tolist()
    assert words[3] == other.data_ptr() and ctypes.c_int32(words[4]).value == 2 and words[5] == 2
    with pytest.raises(TypeError, match="dict"):
        c(x, [mine], 1.0)
    with pytest.raises(TypeError, match="torch.Tensor"):
        c(x, {0: "not a tensor"}, 1.0)


CAPTURE_STATUS = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(ctypes.c_int))


def test_direct_launcher_declines_a_per_stream_dict_while_its_stream_is_captured(fastlaunch):
    """Kept per-stream buffers never enter a CUDA graph: the launcher asks the
    driver (cuStreamIsCapturing) about the current stream and declines a dict
    while it captures, or where the driver cannot tell; a capture's own
    tensors, passed as they are, launch."""
    driver = {"status": 0, "error": 0, "asked": []}

    def is_capturing(stream, status):
        driver["asked"].append(stream or 0)
        status[0] = driver["status"]
        return driver["error"]

    getter = CAPTURE_STATUS(is_capturing)
    recorder = _Recorder()
    c, buf = _direct(fastlaunch, recorder.address, rows=set(), per_stream={1},
                     capturing=ctypes.cast(getter, ctypes.c_void_p).value)
    x, kept, own = torch.zeros(4, 8), torch.zeros(3, 5), torch.zeros(2, 2)
    assert c(x, {0: kept}, 1.0) is None and driver["asked"] == [0]  # asked about the current stream
    driver["status"] = 1  # CU_STREAM_CAPTURE_STATUS_ACTIVE
    assert c(x, {0: kept}, 1.0) is NotImplemented
    driver["status"], driver["error"] = 0, 900  # CUDA_ERROR_STREAM_CAPTURE_IMPLICIT
    assert c(x, {0: kept}, 1.0) is NotImplemented
    assert len(recorder.firsts) == 1  # the declined calls launched nothing
    driver["status"], driver["error"], asked = 1, 0, len(driver["asked"])
    assert c(x, own, 1.0) is None and len(driver["asked"]) == asked  # a tensor needs no question
    assert buf.tolist()[3] == own.data_ptr() and len(recorder.firsts) == 2


CONTEXT_GETTER = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_void_p))


def test_direct_launcher_declines_another_current_context(fastlaunch):
    current = {"context": 0x1000}

    def get(out):
        out[0] = current["context"]
        return 0

    getter = CONTEXT_GETTER(get)
    recorder = _Recorder()
    c, _ = _direct(fastlaunch, recorder.address, rows=set(), get_context=ctypes.cast(getter, ctypes.c_void_p).value,
                   context=0x1000)
    x = torch.zeros(4, 8)
    assert c(x, x, 1.0) is None
    current["context"] = 0x2000  # another device made current
    assert c(x, x, 1.0) is NotImplemented
    assert len(recorder.firsts) == 1  # the declined call launched nothing


def test_checked_launcher_declines_tensors_of_another_device(fastlaunch):
    recorder = _Recorder()
    x = torch.zeros(4, 8)  # DLPack: device 0 of its type
    on_zero, _ = _direct(fastlaunch, recorder.address, rows=set(), device=0)
    on_one, _ = _direct(fastlaunch, recorder.address, rows=set(), device=1)
    assert on_zero(x, x, 1.0) is None
    assert on_one(x, x, 1.0) is NotImplemented
    assert len(recorder.firsts) == 1


def test_fast_launcher_direct_only_after_its_first_call(fastlaunch, monkeypatch):
    _use_module(monkeypatch, fastlaunch)
    getter = CONTEXT_GETTER(lambda out: _set(out, 0x1000))
    monkeypatch.setattr(launcher, "current_context", lambda: (ctypes.cast(getter, ctypes.c_void_p).value, 0x1000))
    recorder = _Recorder()
    abi = [["tensor", "int32_t", 1, "int64_t", 1], ["stream"]]
    fast = FastLauncher(_DslFunction(recorder.entry), abi)
    assert fast.direct(frozenset({0})) is None
    fast(torch.zeros(4, 8), 0)
    direct = fast.direct(frozenset({0}))
    assert isinstance(direct, fastlaunch.Launcher) and isinstance(fast.checked, fastlaunch.Launcher)
    # Without a context to check against, neither is made: the handle's guard decides.
    monkeypatch.setattr(launcher, "current_context", lambda: (0, 0))
    other = FastLauncher(_DslFunction(recorder.entry), abi)
    other(torch.zeros(4, 8), 0)
    assert other.direct(frozenset({0})) is None and other.checked is None


def _set(out, value):
    out[0] = value
    return 0


def test_per_stream_direct_launchers_ask_the_driver_about_captures(fastlaunch, monkeypatch):
    """A direct launcher with per-stream arguments gets the driver's
    cuStreamIsCapturing (its address, the constructor's last argument); where
    the driver has none, there is no such launcher (the full path decides
    each call), while one without per-stream arguments needs none."""
    _use_module(monkeypatch, fastlaunch)
    getter = CONTEXT_GETTER(lambda out: _set(out, 0x1000))
    monkeypatch.setattr(launcher, "current_context", lambda: (ctypes.cast(getter, ctypes.c_void_p).value, 0x1000))
    capturing = CAPTURE_STATUS(lambda stream, status: _set(status, 0))
    address = ctypes.cast(capturing, ctypes.c_void_p).value
    monkeypatch.setattr(launcher, "_driver_address", lambda name: address if name == "cuStreamIsCapturing" else 0)
    made = []

    class Recording:
        def Launcher(*args):  # noqa: N805 (called on the class)
            made.append(args)
            return fastlaunch.Launcher(*args)

    _, api, tensor_type = launcher._c_module()
    monkeypatch.setattr(launcher, "_c_module", lambda: (Recording, api, tensor_type))
    recorder = _Recorder()
    abi = [["tensor", "int32_t", 1, "int64_t", 1], ["tensor", "int32_t", 1, "int64_t", 1], ["stream"]]
    fast = FastLauncher(_DslFunction(recorder.entry), abi)
    fast(torch.zeros(4, 8), torch.zeros(2, 2), 0)
    assert fast.direct(frozenset(), frozenset({1})) is not None and made[-1][-1] == address
    monkeypatch.setattr(launcher, "_driver_address", lambda name: 0)
    assert fast.direct(frozenset(), frozenset({1})) is None
    assert fast.direct(frozenset({0})) is not None


class _ExchangeTable(ctypes.Structure):
    """DLPack 1.x's exchange table (``__dlpack_c_exchange_api__``), as far as the C launcher reads it."""
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32), ("prev_api", ctypes.c_void_p),
                ("allocator", ctypes.c_void_p), ("from_py_no_sync", ctypes.c_void_p),
                ("to_py_no_sync", ctypes.c_void_p), ("dltensor_from_py_no_sync", ctypes.c_void_p),
                ("current_work_stream", ctypes.c_void_p)]


WORK_STREAM = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int32, ctypes.c_int32, ctypes.POINTER(ctypes.c_void_p))


def test_the_capture_question_is_about_the_current_stream(fastlaunch):
    """The driver is asked about torch's current stream on the tensors'
    device (here a table whose current stream is 0x5000), the stream the
    dict is read by."""
    get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
    get_pointer.restype, get_pointer.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    table = _ExchangeTable.from_buffer_copy(ctypes.string_at(
        get_pointer(torch.Tensor.__dlpack_c_exchange_api__, b"dlpack_exchange_api"), ctypes.sizeof(_ExchangeTable)))
    current = WORK_STREAM(lambda device_type, device_id, out: _set(out, 0x5000))
    table.current_work_stream = ctypes.cast(current, ctypes.c_void_p).value
    new_capsule = ctypes.pythonapi.PyCapsule_New
    new_capsule.restype, new_capsule.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    capsule = new_capsule(ctypes.addressof(table), b"dlpack_exchange_api", None)
    asked = []
    capturing = CAPTURE_STATUS(lambda stream, status: (asked.append(stream), _set(status, 0))[1])
    c, buf = _direct(fastlaunch, _Recorder().address, rows=set(), per_stream={1},
                     capturing=ctypes.cast(capturing, ctypes.c_void_p).value, api=capsule)
    x, mine = torch.zeros(4, 8), torch.zeros(3, 5)
    assert c(x, {0x5000: mine}, 1.0) is None and asked == [0x5000]
    assert buf.tolist()[3] == mine.data_ptr()
    assert c(x, {0: mine}, 1.0) is NotImplemented  # another stream's entry is not this one's
    # Two per-stream arguments (split K's workspace and counters): one question per call.
    two, buf = _direct(fastlaunch, _Recorder().address, rows=set(), per_stream={1, 2},
                       capturing=ctypes.cast(capturing, ctypes.c_void_p).value, api=capsule,
                       header_abi=(TENSOR_ABI, TENSOR_ABI, TENSOR_ABI))
    asked.clear()
    counters = torch.zeros(7)
    assert two(x, {0x5000: mine}, {0x5000: counters}) is None and asked == [0x5000]
    assert buf.tolist()[3] == mine.data_ptr() and buf.tolist()[6] == counters.data_ptr()


def test_closures_are_kept_per_op_and_description_and_bounded(fastlaunch, monkeypatch):
    _use_module(monkeypatch, fastlaunch)
    fastpath._c_module.cache_clear()
    table, other = fastpath.Closures(), fastpath.Closures()
    x, y = torch.zeros(4, 8), torch.ones(4, 8)
    assert table.call(1, x, 0.5) is NotImplemented  # nothing kept yet
    table.remember((x,), lambda: (lambda t, eps: (t, eps)))
    assert table.call(1, y, 0.5) == (y, 0.5)  # same description: the closure runs on the call's arguments
    assert table.call(1, x.half(), 0.5) is NotImplemented  # another description
    assert other.call(1, x, 0.5) is NotImplemented  # another op's calls on the same tensors
    table.remember((x.double(),), lambda: None)  # no direct launcher: nothing kept
    assert table.call(1, x.double(), 0.5) is NotImplemented
    table.remember((x, 1e-6), lambda: pytest.fail("a call that cannot be described builds nothing"))
    monkeypatch.setattr(fastpath, "MAX_CLOSURES", 2)
    table.remember((torch.zeros(1),), lambda: (lambda *a: 0))
    table.remember((torch.zeros(2),), lambda: (lambda *a: 0))
    assert len(table) == 1  # the table started over at its bound
    fastpath.clear()  # quack.cache.clear() and quack.calls.plan.clear() forget every op's closures
    assert len(table) == 0


def test_dispatch_checks_its_arguments(described):
    closures = {described.describe(False, torch.zeros(2)): lambda t, n: n + 1}
    assert described.dispatch(closures, False, 1, torch.ones(2), 41) == 42
    with pytest.raises(TypeError):
        described.dispatch([], False, 1, torch.ones(2))  # not a dict
    assert described.dispatch(closures, False, 1, torch.ones(3), 41) is NotImplemented  # no closure kept
    assert described.dispatch(closures, False, 2, torch.ones(2), 0.5) is NotImplemented  # a float: never described
    with pytest.raises(ValueError):
        described.dispatch(closures, False, 3, torch.ones(2))  # describes more than it is given
    with pytest.raises(ValueError):
        described.dispatch(closures, False, -1, torch.ones(2))
    with pytest.raises(ZeroDivisionError):  # the closure's own error comes through
        described.dispatch({described.describe(False): lambda: 1 / 0}, False, 0)


def test_dispatcher_reads_the_flags_and_dispatches_in_c(described):
    """``Closures.call`` after its first call: compile-only depth, grad mode,
    description, lookup and closure in one C call."""
    state = {"depth": 0, "grad": False}
    leaf = torch.ones(2, requires_grad=True)
    closures = {described.describe(False, leaf): lambda t, n: n + 1,
                described.describe(True, leaf): lambda t, n: n - 1}
    call = described.Dispatcher(closures, lambda: state["depth"], lambda: state["grad"])
    assert call(1, leaf, 41) == 42
    state["grad"] = True
    assert call(1, leaf, 41) == 40  # described under grad mode: requires_grad counts
    state["depth"] = 1
    assert call(1, torch.ones(2), 41) is NotImplemented  # compile-only mode: nothing launches
    state["depth"] = 0
    assert call(1, torch.ones(3), 41) is NotImplemented  # no closure kept
    with pytest.raises(ValueError):
        call(3, torch.ones(2))  # describes more than it is given
    with pytest.raises(TypeError):
        call("1", torch.ones(2))
    with pytest.raises(TypeError):
        described.Dispatcher([], lambda: 0, lambda: False)  # not a dict


def test_like_launch_allocates_like_the_first_argument_and_fills_the_template(described):
    """The row-wise ops' closure in C: outputs ``empty_like`` the first
    argument, the launcher's arguments from the template, the launcher's
    NotImplemented passed on."""
    launched = []

    def launch(*args):
        launched.append(args)
        return answer["value"]

    answer = {"value": None}
    x, w = torch.zeros(4, 8, dtype=torch.float16), torch.ones(8)
    none, out = -1, lambda j: -2 - j
    one = described.LikeLaunch(launch, torch.empty_like, 1, (0, 1, none, out(0), 2))
    y = one(x, w, 0.5)
    assert y.shape == x.shape and y.dtype == x.dtype and y.data_ptr() != x.data_ptr()
    assert launched[-1][:3] == (x, w, None) and launched[-1][3] is y and launched[-1][4] == 0.5
    two = described.LikeLaunch(launch, torch.empty_like, 2, (out(1), 0, out(0)))
    first, second = two(x)
    assert launched[-1] == (second, x, first) and first.data_ptr() != second.data_ptr()
    answer["value"] = NotImplemented
    assert one(x, w, 0.5) is NotImplemented  # declined (another device current): the full path runs
    with pytest.raises(IndexError):
        one(x, w)  # the template names argument 2
    with pytest.raises(ValueError):
        described.LikeLaunch(launch, torch.empty_like, 1, (out(1),))  # names an output it does not allocate
    with pytest.raises(ValueError):
        described.LikeLaunch(launch, torch.empty_like, 0, (0,))
    closures = {described.describe(False, x): one}
    answer["value"] = None
    assert described.dispatch(closures, False, 1, x, w, 0.25).shape == x.shape  # dispatched in C
    assert launched[-1][4] == 0.25


def test_like_launch_calls_a_c_launcher_directly(fastlaunch, described):
    """With a C Launcher the closure hands it the arguments with no tuple:
    the same fields written, its NotImplemented and its arity error passed on."""
    recorder = _Recorder()
    c, buf = _direct(fastlaunch, recorder.address, rows={0, 1})
    out = lambda j: -2 - j  # noqa: E731
    closure = described.LikeLaunch(c, torch.empty_like, 1, (0, out(0), 1))
    x = torch.zeros(2, 3, 8)
    y = closure(x, 0.5)
    assert y.shape == x.shape and y.data_ptr() != x.data_ptr()
    words = buf.tolist()
    assert words[0] == x.data_ptr() and ctypes.c_int32(words[1]).value == 6 and words[2] == 8
    assert words[3] == y.data_ptr() and ctypes.c_int32(words[4]).value == 6 and words[5] == 8
    assert len(recorder.firsts) == 1
    with pytest.raises(TypeError, match="takes 3 arguments, got 2"):
        described.LikeLaunch(c, torch.empty_like, 1, (0, out(0)))(x)
    getter = CONTEXT_GETTER(lambda out_context: (out_context.__setitem__(0, 0x2000), 0)[1])
    other, _ = _direct(fastlaunch, recorder.address, rows={0, 1},
                       get_context=ctypes.cast(getter, ctypes.c_void_p).value, context=0x1000)
    assert described.LikeLaunch(other, torch.empty_like, 1, (0, out(0), 1))(x, 0.5) is NotImplemented
    assert len(recorder.firsts) == 1  # nothing launched from the other context


def test_closures_decline_every_call_without_the_c_module(monkeypatch):
    _use_module(monkeypatch, None)
    fastpath._c_module.cache_clear()
    table = fastpath.Closures()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the ctypes notice
        assert table.call(1, torch.zeros(2)) is NotImplemented
    assert table.call(1, torch.zeros(2)) is NotImplemented
    assert fastpath.like_closure(lambda *a: None, 1, (0,)) is None
    fastpath._c_module.cache_clear()


RUN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t)


@pytest.mark.parametrize("with_c", [True, False], ids=["C", "ctypes"])
def test_objects_the_runtime_loaded_launch_through_function_run(fastlaunch, monkeypatch, with_c):
    """quack/cache/native.py's C-loader path: no DSL call, ``Function_Run(handle,
    pointers, count)`` with the status's address last, its error raised."""
    _use_module(monkeypatch, fastlaunch if with_c else None)
    calls, status = [], {"value": 0}

    def run(handle, args, count):
        calls.append((handle, count, ctypes.c_void_p.from_address(args[0]).value, args[count - 1]))
        return status["value"]

    run_fn = RUN(run)
    abi = [["tensor", "int32_t", 1, "int64_t", 1], ["scalar", "float"], ["stream"]]
    fast = FastLauncher(None, abi, runtime=launcher.RuntimeFunction(run_fn, 0x1234))
    x = torch.zeros(4, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the ctypes notice
        fast(x, 0.5, 7)
        fast(x, 0.5, 7)
    assert [(handle, count, first) for handle, count, first, _ in calls] == [(0x1234, 4, x.data_ptr())] * 2
    assert calls[0][3] == ctypes.addressof(fast._result)  # the status the function writes
    assert (fast._c is not None) == with_c
    status["value"] = 5
    with pytest.raises(RuntimeError, match="runtime error 5"):
        fast(x, 0.5, 7)


def test_ops_see_dynamo_tracing_without_a_recompile_per_call():
    """``fastpath.tracing`` (what each op tests before the C dispatcher) is
    False in eager mode and True while dynamo traces, with no guard that
    fails on the next call (one graph for three calls)."""
    from torch._dynamo.utils import counters

    def op(x):
        return x * 2 if fastpath.tracing() else x * 3

    assert fastpath.tracing() is False
    x = torch.ones(2)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(op, fullgraph=True, backend="eager")
    assert [compiled(x)[0].item() for _ in range(3)] == [2.0] * 3  # traced: the full path's branch
    assert counters["stats"]["unique_graphs"] == 1
    assert op(x)[0].item() == 3.0
    torch._dynamo.reset()
