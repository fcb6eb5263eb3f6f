"""Sizes the kernels cannot index and GPUs they cannot run on are refused
before any compile or launch, with a message that names the limit or the
device (no GPU needed: fake tensors, a faked device capability)."""

import pytest
import torch

import quack
from cache_fixtures.env import cache_env  # noqa: F401  (fixture)
from cache_fixtures.fake_cuda import cuda_empty as _cuda
from cache_fixtures.fake_cuda import fake  # noqa: F401  (fixture)
from quack.calls import plan
from quack.calls import torch_interop as ti
from quack.cache import stats
from quack.families.cross_entropy.op import CrossEntropyCall
from quack.families.gemm.signature import GemmCall
from quack.families.layernorm.op import LayerNormCall
from quack.families.rmsnorm.op import RMSNormCall
from quack.families.softmax.op import SoftmaxCall

ROWWISE = {
    "rmsnorm": lambda x: quack.rmsnorm(x),
    "layernorm": lambda x: quack.layernorm(x),
    "softmax": lambda x: quack.softmax(x),
    "cross_entropy": lambda x: quack.cross_entropy(
        x, torch.zeros(x.shape[:-1], device="cuda", dtype=torch.int64)
    ),
}


@pytest.mark.usefixtures("fake")
@pytest.mark.parametrize("op", sorted(ROWWISE))
def test_rows_beyond_32_bit_indexing_refused(op):
    with pytest.raises(ValueError, match=r"2147483648 rows; the kernels index rows with 32 bits"):
        ROWWISE[op](_cuda(2**31, 1))
    with pytest.raises(ValueError, match=r"2147483648 rows"):
        ROWWISE[op](_cuda(2**16, 2**15, 1))  # leading dims count as rows
    # The limit leaves the persistent backward's prefetch room below 2^31.
    with pytest.raises(ValueError, match=rf"{ti.MAX_ROWS + 1} rows"):
        ROWWISE[op](_cuda(ti.MAX_ROWS + 1, 1))


@pytest.mark.parametrize("op", [*sorted(ROWWISE), "gemm"])
def test_compile_target_without_clusters_refused_before_compiling(op, monkeypatch, cache_env):
    from quack.compile_only import compile_only_mode

    monkeypatch.setenv("QUACK_ARCH", "sm_80")
    with compile_only_mode():
        with pytest.raises(ValueError, match=r"needs an sm_90.*QUACK_ARCH=sm_80"):
            if op == "gemm":
                quack.gemm(_cuda(64, 64), _cuda(64, 64))
            else:
                ROWWISE[op](_cuda(4, 64))
    assert stats()["compiles"] == stats()["exports"] == 0 and not cache_env.writable.exists()


def test_gemm_refuses_a_newer_arch_without_wgmma(monkeypatch):
    from quack.compile_only import compile_only_mode

    monkeypatch.setenv("QUACK_ARCH", "sm_100a")
    with compile_only_mode():
        with pytest.raises(ValueError, match=r"quack.gemm needs an sm_90 GPU \(Hopper's WGMMA\).*sm_100a"):
            quack.gemm(_cuda(64, 64), _cuda(64, 64))
        ti.check_row_input("quack.rmsnorm", "x", _cuda(4, 64), 64)  # row-wise kernels run there


@pytest.mark.parametrize("capability, ok", [((8, 0), False), ((8, 9), False), ((9, 0), True), ((10, 0), True)])
def test_a_real_device_is_asked_its_capability(monkeypatch, capability, ok):
    monkeypatch.setattr(ti, "_CAPABILITIES", {})
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index: "Fake GPU")
    check = lambda: ti.check_arch("quack.op", torch.device("cuda", 3), "clusters", (9, 0))  # noqa: E731
    if ok:
        check()
    else:
        expected = rf"quack.op needs clusters; cuda:3 \(Fake GPU\) is sm_{capability[0]}{capability[1]}"
        with pytest.raises(ValueError, match=expected):
            check()


def test_arch_strings():
    assert ti.arch_capability("sm_90a") == (9, 0)
    assert ti.arch_capability("sm_100a") == (10, 0)
    assert ti.arch_capability("sm_80") == (8, 0)
    with pytest.raises(ValueError, match="not a GPU arch"):
        ti.arch_capability("hopper")



CALLS = {
    **ROWWISE,
    "gemm": lambda x: quack.gemm(x, _cuda(64, 64)),
    "gemm_glu": lambda x: quack.gemm_glu(x, _cuda(64, 64)),
    "mlp": lambda x: quack.mlp(x, _cuda(64, 64), _cuda(32, 64)),
}
# A manifest signature of each op family (gemm_glu's and mlp's are gemm's).
SIGNATURES = {
    "rmsnorm": RMSNormCall("bfloat16", None, False, 64, 8, False),
    "layernorm": LayerNormCall("bfloat16", None, None, 64, 8, False),
    "softmax": SoftmaxCall("bfloat16", 64, 8, False),
    "cross_entropy": CrossEntropyCall("bfloat16", "int64", 64, 8, "none", False),
    "gemm": GemmCall("bfloat16", "bfloat16", False, True, "dense", 128, False, 0, None, None),
}


@pytest.mark.parametrize("op, arch", [
    *((op, "sm_95") for op in sorted(ROWWISE)),  # Hopper-or-newer numbers, but no such arch
    *((op, arch) for op in ("gemm", "gemm_glu", "mlp") for arch in ("sm_90", "sm_95")),  # WGMMA needs sm_90a
])
def test_a_compile_target_the_kernels_cannot_build_for_is_refused_before_compiling(op, arch, monkeypatch, cache_env):
    from quack.compile_only import compile_only_mode

    monkeypatch.setenv("QUACK_ARCH", arch)
    with compile_only_mode():
        with pytest.raises(ValueError, match=rf"(cannot be compiled for |needs an sm_90 GPU .*QUACK_ARCH=){arch}"):
            CALLS[op](_cuda(64, 64))
    # A manifest's signature, warmed with no op call, is refused alike, naming what its kernels build for.
    sig = SIGNATURES.get(op, SIGNATURES["gemm"])
    accepted = "sm_90a$" if isinstance(sig, GemmCall) else "sm_90, sm_90a, sm_100, .*, sm_121f$"
    with compile_only_mode(), pytest.raises(ValueError, match=rf"cannot be compiled for {arch} .*build for {accepted}"):
        plan.plan_for(sig).warm()
    assert stats()["compiles"] == stats()["exports"] == 0 and not cache_env.writable.exists()
