"""Compile-only warming of the GEMM from test code sized by ``.item()`` (no GPU needed).

Under compile-only, ``.item()`` returns a sentinel, so the rows per group a
size-dependent tile heuristic reads are not the real run's: a varlen call's
plan holds the object of each class of group size, and each is shape-free.
"""

import json

import torch
from cache_fixtures.env import cache_env  # noqa: F401  (fixture)

import quack
from quack.compile_only import compile_only_mode
from quack.families.gemm.config import GROUP_CLASSES, LARGE_GROUP_ROWS, MID_M_ROWS, SMALL_M_ROWS, gemm_config
from quack.families.gemm.signature import GemmCall
from quack.families.gemm.split import dense_class
from quack.calls.plan import plan_for


def _configs_in(layer):
    keys = [json.loads(p.read_text())["key"] for p in (layer / "gemm").glob("*.json")]
    return sorted((k["args"]["grouping"], tuple(k["args"]["config"])) for k in keys)


def test_sentinel_sized_varlen_call_exports_every_candidate(cache_env):  # noqa: F811
    with compile_only_mode():
        lengths = torch.randint(100, 3000, (8,), device="cuda", dtype=torch.int32)
        total_m = int(lengths.sum().item())  # a sentinel here
        cu = torch.nn.functional.pad(torch.cumsum(lengths, 0, dtype=torch.int32), (1, 0))
        a = torch.empty(total_m, 512, device="cuda", dtype=torch.bfloat16)
        b = torch.empty(8, 512, 1024, device="cuda", dtype=torch.bfloat16)
        quack.gemm(a, b, cu_seqlens_m=cu)
        quack.gemm(a, b.select(0, 0))
    # Exactly the objects of the two calls' plans: both group classes of the
    # varlen call (its rows per group came from a sentinel), each class of
    # M of the dense one (its M too).
    varlen = plan_for(GemmCall("bfloat16", "bfloat16", False, True, "varlen_m", 256, False, 0, None, None))
    dense = plan_for(GemmCall("bfloat16", "bfloat16", False, True, "dense", 256, False, 0, None, None))
    expected = sorted((k.args[4], k.args[-1]) for p in (varlen, dense) for _, k in p.kernels)
    assert _configs_in(cache_env.writable) == expected
    assert len(expected) == 5


def test_plans_hold_every_config_the_heuristic_picks():
    # Sweep the heuristic over N and group sizes: whatever it picks at run
    # time is an object of the call's plan, so warming the plan covers it.
    for n in range(8, 4104, 8):
        for grouping, sizes in (("dense", (None,)), ("varlen_m", (0.5, 1, 100, LARGE_GROUP_ROWS - 1, LARGE_GROUP_ROWS, 1e9))):
            plan = plan_for(GemmCall("bfloat16", "bfloat16", False, True, grouping, gemm_config(n).tile_n, False, 0, None, None))
            configs = {k.args[-1] for _, k in plan.kernels}
            for rows in sizes:
                assert tuple(gemm_config(n, rows)) in configs, (n, rows)
            for m in (1, SMALL_M_ROWS, SMALL_M_ROWS + 1, MID_M_ROWS, 4096) if grouping == "dense" else ():
                for slots in (1, 132, 1024):
                    assert tuple(gemm_config(n, m_class=dense_class(m, n, slots))) in configs, (n, m, slots)
    assert [role for role, _ in GROUP_CLASSES] == ["small_groups", "large_groups"]


def test_training_call_warms_its_backward_products(cache_env):  # noqa: F811
    # A call that will be differentiated warms the forward's object and the
    # backward's two products (dA: B's other layout, K's tile; dB: an
    # M-contiguous A), each in every class of M (dB's M is the forward's K),
    # so a strict GPU run of the same training step misses nothing; a grouped
    # call's plan holds its dA products and the variable-length-K dB.
    with compile_only_mode():
        a = torch.empty(1000, 128, device="cuda", dtype=torch.bfloat16).requires_grad_()
        b = torch.empty(128, 1024, device="cuda", dtype=torch.bfloat16).requires_grad_()
        quack.gemm(a, b)
    sig = GemmCall("bfloat16", "bfloat16", False, True, "dense", 256, True, 128, None, None)
    assert [call for _, call in sig.gradient_calls()] == [
        GemmCall("bfloat16", "bfloat16", False, False, "dense", 128, False, 0, None, None),
        GemmCall("bfloat16", "bfloat16", True, True, "dense", 256, False, 0, None, None),
    ]
    keys = [json.loads(p.read_text())["key"]["args"] for p in (cache_env.writable / "gemm").glob("*.json")]
    exported = sorted((k["a_m_major"], k["b_n_major"], tuple(k["config"])) for k in keys)
    assert exported == sorted((k.args[2], k.args[3], k.args[-1]) for _, k in plan_for(sig).kernels)
    assert len(exported) == 9
