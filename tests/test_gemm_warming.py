"""Compile-only warming of the GEMM from test code sized by ``.item()`` (no GPU needed).

Under compile-only, ``.item()`` returns a sentinel, so a size-dependent tile
heuristic would pick a configuration the real run may not use: the op exports
every configuration the heuristic can pick instead, and each is shape-free.
"""

import json

import torch
from cache_fixtures.env import cache_env  # noqa: F401  (fixture)

import quack
from quack.compile_only import compile_only_mode
from quack.gemm import LARGE_GROUP_ROWS, candidate_configs, gemm_config


def _configs_in(layer):
    keys = [json.loads(p.read_text())["key"] for p in (layer / "gemm").glob("*.json")]
    return sorted((k["args"]["varlen"], tuple(k["args"]["config"])) for k in keys)


def test_sentinel_sized_varlen_call_exports_every_candidate(cache_env):  # noqa: F811
    with compile_only_mode():
        lengths = torch.randint(100, 3000, (8,), device="cuda", dtype=torch.int32)
        total_m = int(lengths.sum().item())  # a sentinel here
        cu = torch.nn.functional.pad(torch.cumsum(lengths, 0, dtype=torch.int32), (1, 0))
        a = torch.empty(total_m, 512, device="cuda", dtype=torch.bfloat16)
        b = torch.empty(8, 512, 1024, device="cuda", dtype=torch.bfloat16)
        quack.gemm(a, b, cu_seqlens_m=cu)
        quack.gemm(a, b.select(0, 0))
    expected = sorted([(True, tuple(c)) for c in candidate_configs(True)]
                      + [(False, tuple(c)) for c in candidate_configs(False)])
    assert _configs_in(cache_env.writable) == expected
    assert len(candidate_configs(True)) == 4 and len(candidate_configs(False)) == 2


def test_candidates_hold_every_config_the_heuristic_picks():
    # The candidates come from the heuristic's own code: sweep the heuristic
    # over N and group sizes, so a configuration outside them cannot hide.
    for n in range(8, 4104, 8):
        assert gemm_config(n) in candidate_configs(False), n
        for rows in (0.5, 1, 100, LARGE_GROUP_ROWS - 1, LARGE_GROUP_ROWS, 1e9):
            assert gemm_config(n, rows) in candidate_configs(True), (n, rows)
