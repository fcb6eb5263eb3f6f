"""Manifests of call signatures: round trips, refusals, recording (CPU only)."""

import json
import multiprocessing
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from cache_fixtures.env import cache_env  # noqa: F401  (fixture)

import quack
from quack import plan
from quack.cache import manifest
from quack.cache import CacheMissError
from quack.compile_only import compile_only_mode
from quack.gemm import GemmCall
from quack.layernorm import LayerNormCall
from quack.rmsnorm import RMSNormCall
from quack.softmax import SoftmaxCall

ROOT = Path(__file__).resolve().parent.parent
SIGNATURES = [
    RMSNormCall("bfloat16", "float32", True, 5120, 8, True),
    LayerNormCall("bfloat16", "bfloat16", None, 4096, 4, False),
    SoftmaxCall("float32", 7, 1, True),
    GemmCall("float16", "float16", True, True, "dense", 128, True, 256, "gelu_tanh", "float32"),
]


def test_round_trip_keeps_every_field(tmp_path):
    path = tmp_path / "calls.jsonl"
    manifest.write(path, SIGNATURES + SIGNATURES[:1], comment="two lines\nof comment")
    assert sorted(map(plan.entry_line, manifest.read(path))) == sorted(map(plan.entry_line, SIGNATURES))
    assert path.read_text().startswith("# two lines\n# of comment\n" + manifest.HEADER + "\n")


def test_a_family_reads_only_its_own_entries(tmp_path):
    path = tmp_path / "calls.jsonl"
    manifest.write(path, SIGNATURES)
    assert manifest.read(path, {"softmax"}) == [SIGNATURES[2]]


def test_the_production_manifest_reads_and_covers_inference_without_bias():
    calls = manifest.read(ROOT / "tools/configs/production.jsonl")
    assert LayerNormCall("bfloat16", "bfloat16", None, 4096, 8, False) in calls
    assert LayerNormCall("bfloat16", "float32", None, 16384, 8, True) in calls


@pytest.mark.parametrize("text, message", [
    ('{"configs": []}\n', "not a quack manifest"),
    ('{"format": "quack-calls", "version": 1}\n', "manifest version 1"),
    ("", "empty"),
    (manifest.HEADER + '\n{"op": "rmsnorm"\n{"op": "softmax"}\n', ":2: not JSON"),
    (manifest.HEADER + '\n{"op": "conv2d"}\n', "unknown op 'conv2d'"),
    (manifest.HEADER + '\n{"op": "softmax", "dtype": "float32", "n": 7}\n', "missing ['backward', 'vec']"),
])
def test_bad_manifests_are_refused_clearly(tmp_path, text, message):
    path = tmp_path / "calls.jsonl"
    path.write_text(text)
    with pytest.raises(manifest.ManifestError, match=message.replace("[", r"\[").replace("]", r"\]")):
        manifest.read(path)


def test_a_last_line_cut_short_is_skipped(tmp_path):
    path = tmp_path / "calls.jsonl"
    manifest.write(path, SIGNATURES[:1])
    path.write_text(path.read_text() + '{"op": "softm')
    assert manifest.read(path) == SIGNATURES[:1]
    # The next recorder drops the cut line before adding its own.
    manifest._append_once(str(path), plan.entry_line(SIGNATURES[2]))
    assert "softm\n" not in path.read_text()
    assert manifest.read(path) == [SIGNATURES[0], SIGNATURES[2]]


def _record_all(path: str, signatures: list) -> None:
    for sig in signatures:
        manifest._append_once(path, plan.entry_line(sig))


def test_concurrent_recorders_write_each_line_once(tmp_path):
    path = str(tmp_path / "calls.jsonl")
    sigs = [SoftmaxCall("bfloat16", n, 8, b) for n in range(8, 8 * 41, 8) for b in (True, False)]
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_record_all, args=(path, sigs[i::3] + sigs[::5])) for i in range(6)]
    threads = [threading.Thread(target=_record_all, args=(path, sigs[::2])) for _ in range(4)]
    for worker in procs + threads:
        worker.start()
    for worker in procs + threads:
        worker.join()
    assert all(p.exitcode == 0 for p in procs)
    lines = Path(path).read_text().splitlines()
    assert lines[0] == manifest.HEADER and len(lines) == len(set(lines)) == len(sigs) + 1
    assert set(manifest.read(path)) == set(sigs)


def test_a_recorded_run_replays_into_exactly_its_objects(cache_env, monkeypatch):  # noqa: F811
    record = cache_env.tmp / "recorded.jsonl"
    monkeypatch.setenv(manifest.RECORD_ENV, str(record))
    monkeypatch.setenv("QUACK_ARCH", "sm_90a")
    plan.clear()
    with compile_only_mode():
        x = torch.empty(3, 7, device="cuda", dtype=torch.float32)
        with torch.no_grad():
            quack.softmax(x)
        quack.softmax(torch.empty(4, 5, device="cuda"))  # N = 5, warmed by nothing else
    exported = sorted(p.name for p in (cache_env.writable / "softmax").glob("*.o"))
    calls = manifest.read(record)
    assert calls == [SoftmaxCall("float32", 7, 1, False), SoftmaxCall("float32", 5, 1, False)]
    # Warm the recording into a fresh folder with the build's tool: the same objects.
    out = cache_env.tmp / "replayed"
    subprocess.run(
        [sys.executable, str(ROOT / "tools/warm_cache.py"), f"--out={out}", f"--configs={record}"],
        check=True, cwd=ROOT, env={**_env_without(manifest.RECORD_ENV), "QUACK_ARCH": "sm_90a"},
    )
    assert sorted(p.name for p in (out / "softmax").glob("*.o")) == exported
    entries = json.loads((out / "manifest.json").read_text())["objects"]
    assert len(entries) == len(exported) == 2


def test_a_strict_miss_names_the_manifest_entry(cache_env, monkeypatch):  # noqa: F811
    monkeypatch.setenv("QUACK_CACHE_STRICT", "1")
    monkeypatch.setenv("QUACK_ARCH", "sm_90a")
    plan.clear()
    sig = SoftmaxCall("float32", 9, 1, False)
    with pytest.raises(CacheMissError) as e:
        plan.plan_for(sig).kernel("forward")
    assert plan.entry_line(sig) in str(e.value)


def _env_without(name: str) -> dict:
    import os

    return {k: v for k, v in os.environ.items() if k != name}


def test_a_recorded_misaligned_call_replays_with_its_vector_width(tmp_path, monkeypatch):
    # A contiguous view 2 bytes past an aligned base: 16-bit rows copy one
    # element at a time.  The manifest keeps that width, so its replay warms
    # the object the call ran, not the aligned one.
    from quack.rmsnorm import call_signature

    record = tmp_path / "recorded.jsonl"
    monkeypatch.setenv(manifest.RECORD_ENV, str(record))
    with compile_only_mode():
        x = torch.empty(8 * 4096 + 1, device="cuda", dtype=torch.bfloat16).as_strided((8, 4096), (4096, 1), 1)
        sig = call_signature(x, None, None, False)
        plan.plan_for(sig)
    assert sig.vec == 1
    (replayed,) = manifest.read(record)
    assert replayed == sig
    assert {k.args for _, k in plan.plan_for(replayed).kernels} == {("bfloat16", None, False, 4096, 1, False)}


@pytest.mark.parametrize("field, value", [("vec", 1.0), ("backward", 1), ("dtype", None), ("n", "7")])
def test_entry_fields_must_have_their_types(tmp_path, field, value):
    # 1.0 == 1 and True == 1 in Python, but they hash to other object keys.
    entry = {**SIGNATURES[2].entry(), field: value}
    path = tmp_path / "calls.jsonl"
    path.write_text(manifest.HEADER + "\n" + json.dumps(entry) + "\n")
    with pytest.raises(manifest.ManifestError, match=f"field '{field}' must be"):
        manifest.read(path)


def test_a_record_file_that_cannot_be_written_does_not_fail_the_call(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv(manifest.RECORD_ENV, str(tmp_path / "missing-dir" / "calls.jsonl"))
    sig = SoftmaxCall("float32", 11, 1, False)
    plan.plan_for(sig)
    plan.plan_for(sig)
    assert "cannot record" in caplog.text and caplog.text.count("cannot record") == 1
    # Set later, in the same process: later calls are recorded.
    later = tmp_path / "later.jsonl"
    monkeypatch.setenv(manifest.RECORD_ENV, str(later))
    plan.plan_for(sig)
    assert manifest.read(later) == [sig]


def test_a_signature_without_kernels_is_refused_at_definition():
    with pytest.raises(TypeError, match="defines no kernels"):
        @plan.signature
        class Incomplete(plan.Signature):
            OP = "incomplete"
            n: int
