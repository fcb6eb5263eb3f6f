"""The fast launcher's argument packing, checked on the CPU against the C header's layout."""

import ctypes

import torch

from quack.launch.launcher import make_packer, parse_abi

HEADER = """
typedef struct {
    void *data;
    int32_t dynamic_shapes[1];
    int64_t dynamic_strides[1];
} p_Tensor_mX_t;

typedef struct {
    void *data;
} p_Tensor_mW_t;

typedef struct {
    void *data;
    int32_t dynamic_shapes[2];
} p_Tensor_mR_t;

static inline int32_t cute_dsl_p_wrapper(p_Kernel_Module_t *module, p_Tensor_mX_t *mX, p_Tensor_mW_t *mW, p_Tensor_mR_t *mR, float eps, int32_t count, cudaStream_t stream) {
"""


class _X(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("s0", ctypes.c_int32), ("t0", ctypes.c_int64)]


class _R(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("s0", ctypes.c_int32), ("s1", ctypes.c_int32)]


def test_parse_abi_reads_structs_scalars_and_stream():
    assert parse_abi(HEADER, "p") == [
        ["tensor", "int32_t", 1, "int64_t", 1],
        ["tensor", "int32_t", 0, "int64_t", 0],
        ["tensor", "int32_t", 2, "int64_t", 0],
        ["scalar", "float"],
        ["scalar", "int32_t"],
        ["stream"],
    ]


def test_packed_words_match_the_c_struct_layout():
    abi = parse_abi(HEADER, "p")
    # Argument 2 (a residual, say) was None at compile time: it has no struct.
    present = [True, True, False, True, True, True, True]
    pack, starts, words = make_packer(abi, present)
    buf = (ctypes.c_int64 * words)()
    x = torch.zeros(37, 100)[:, :64]  # row stride 100
    w = torch.zeros(64)
    r = torch.zeros(5, 3)
    pack(buf, x, w, None, r, 0.5, -100, 0xABC)
    base = ctypes.addressof(buf)
    mx = _X.from_address(base + 8 * starts[0])
    assert (mx.data, mx.s0, mx.t0) == (x.data_ptr(), 37, 100)
    assert ctypes.c_void_p.from_address(base + 8 * starts[1]).value == w.data_ptr()
    mr = _R.from_address(base + 8 * starts[2])
    assert (mr.data, mr.s0, mr.s1) == (r.data_ptr(), 5, 3)
    assert ctypes.c_float.from_address(base + 8 * starts[3]).value == 0.5
    assert ctypes.c_int32.from_address(base + 8 * starts[4]).value == -100
    assert ctypes.c_void_p.from_address(base + 8 * starts[5]).value == 0xABC


def test_header_without_wrapper_is_an_error():
    import pytest

    with pytest.raises(ValueError, match="no cute_dsl_q_wrapper"):
        parse_abi(HEADER, "q")


def test_first_call_hands_the_dsl_tensors_it_can_export():
    # Under torch.compile an op's kernel may receive its leaf inputs, which
    # still require grad; the DSL's first launch exports tensors through
    # DLPack, which refuses those (seen on the H200 with a fresh process).
    from quack.launch.launcher import FastLauncher

    exported = []

    def dsl_entry(x, stream):
        exported.append(torch.from_dlpack(x.__dlpack__()))

    x = torch.randn(4, 8, requires_grad=True)
    FastLauncher(dsl_entry, [["tensor", "int32_t", 0, "int64_t", 0], ["stream"]])(x, 0)
    assert exported[0].data_ptr() == x.data_ptr()
    assert x.requires_grad  # the caller's tensor is untouched
