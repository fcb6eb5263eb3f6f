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
from quack.calls import plan
from quack.calls import manifest, recording
from quack.cache import CacheMissError
from quack.compile_only import compile_only_mode
from quack.families.cross_entropy.op import CrossEntropyCall
from quack.families.gemm.signature import GemmCall
from quack.families.layernorm.op import LayerNormCall
from quack.families.rmsnorm.op import RMSNormCall
from quack.families.softmax.op import SoftmaxCall

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
    recording._append_once(str(path), plan.entry_line(SIGNATURES[2]))
    assert "softm\n" not in path.read_text()
    assert manifest.read(path) == [SIGNATURES[0], SIGNATURES[2]]


def _record_all(path: str, signatures: list) -> None:
    for sig in signatures:
        recording._append_once(path, plan.entry_line(sig))


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
    from quack.families.rmsnorm.op import call_signature

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


def test_a_record_file_with_bytes_that_are_not_utf8_still_records(tmp_path, monkeypatch):
    record = tmp_path / "calls.jsonl"
    record.write_bytes(manifest.HEADER.encode() + b"\n# caf\xe9 \xff\n")
    monkeypatch.setenv(manifest.RECORD_ENV, str(record))
    sig = SoftmaxCall("float32", 13, 1, False)
    plan.plan_for(sig)
    assert record.read_bytes().endswith(b"\xff\n" + plan.entry_line(sig).encode() + b"\n")
    # A reader names the line it cannot decode.
    record.write_bytes(record.read_bytes().replace(b"# caf", b"caf"))
    with pytest.raises(manifest.ManifestError, match=r"calls.jsonl:2: not UTF-8"):
        manifest.read(record)


def test_recording_never_fails_the_call(tmp_path, monkeypatch, caplog):
    def broken(path, line):
        raise RuntimeError("something unforeseen")

    monkeypatch.setattr(recording, "_append_once", broken)
    monkeypatch.setenv(manifest.RECORD_ENV, str(tmp_path / "calls.jsonl"))
    for n in (17, 19):
        plan.plan_for(SoftmaxCall("float32", n, 1, False))
    assert caplog.text.count("cannot record") == 1 and "something unforeseen" in caplog.text


def _counting_reads(monkeypatch) -> list:
    reads = []
    real = recording.os.pread

    def pread(fd, size, offset):
        data = real(fd, size, offset)
        reads.append(len(data))
        return data

    monkeypatch.setattr(recording.os, "pread", pread)
    return reads


def test_a_record_file_is_read_once_per_process(tmp_path, monkeypatch):
    record = tmp_path / "calls.jsonl"
    manifest.write(record, [SoftmaxCall("bfloat16", n, 8, True) for n in range(8, 8 * 2000, 8)])
    size = record.stat().st_size
    reads = _counting_reads(monkeypatch)
    monkeypatch.setenv(manifest.RECORD_ENV, str(record))
    new = [SoftmaxCall("float16", n, 8, False) for n in (8, 16, 24)]
    for sig in new + [SoftmaxCall("bfloat16", 8, 8, True)]:  # the last one is there already
        plan.plan_for(sig)
    assert sum(reads) == size
    assert manifest.read(record)[-3:] == new and len(manifest.read(record)) == 1999 + 3


def test_lines_another_process_appended_are_seen(tmp_path):
    path = str(tmp_path / "calls.jsonl")
    mine, theirs = SoftmaxCall("float32", 21, 1, False), SoftmaxCall("float32", 23, 1, False)
    recording._append_once(path, plan.entry_line(mine))  # this process has read the file
    ctx = multiprocessing.get_context("spawn")
    other = ctx.Process(target=_record_all, args=(path, [theirs]))
    other.start()
    other.join()
    assert other.exitcode == 0
    recording._append_once(path, plan.entry_line(theirs))
    assert Path(path).read_text().splitlines() == [manifest.HEADER, plan.entry_line(mine), plan.entry_line(theirs)]
    # A file replaced under the same name is read anew.
    Path(path).unlink()
    recording._append_once(path, plan.entry_line(theirs))
    assert Path(path).read_text().splitlines() == [manifest.HEADER, plan.entry_line(theirs)]


def test_what_a_recorder_remembers_is_bounded(tmp_path, monkeypatch):
    monkeypatch.setattr(recording, "MAX_SEEN", 4)
    record = tmp_path / "calls.jsonl"
    manifest.write(record, [SoftmaxCall("float32", n, 1, False) for n in range(1, 11)])
    recording._append_once(str(record), plan.entry_line(SoftmaxCall("float32", 99, 1, False)))
    assert len(recording._SEEN[str(record)].lines) == 4
    # Past the bound a line may be written twice; readers drop the duplicate.
    recording._append_once(str(record), plan.entry_line(SoftmaxCall("float32", 9, 1, False)))
    assert len(manifest.read(record)) == 11


RMSNORM_ENTRY = RMSNormCall("bfloat16", "float32", True, 4096, 8, True).entry()
GEMM_ENTRY = GemmCall("bfloat16", "bfloat16", False, True, "dense", 256, True, 256, None, None).entry()
SOFTMAX_ENTRY = SoftmaxCall("bfloat16", 4096, 8, True).entry()
CROSS_ENTROPY_ENTRY = CrossEntropyCall("bfloat16", "int64", 4096, 8, "mean", True).entry()


@pytest.mark.parametrize("entry, message", [
    ({**RMSNORM_ENTRY, "n": 0}, "field 'n' = 0: x must have shape"),
    ({**RMSNORM_ENTRY, "n": 262152}, "field 'n' = 262152: N = 262152 is larger than the supported 262144"),
    ({**RMSNORM_ENTRY, "n": -8}, "field 'n' = -8: no tensor has shape"),
    ({**RMSNORM_ENTRY, "vec": 3}, "field 'vec' is 3, which no call has: a call with the entry's other fields has 1"),
    ({**RMSNORM_ENTRY, "vec": 64}, "field 'vec' is 64, which no call has"),
    ({**RMSNORM_ENTRY, "n": 4097}, "field 'vec' is 8, which no call has"),
    ({**RMSNORM_ENTRY, "dtype": "float64"}, "field 'dtype' = \"float64\": x has dtype float64"),
    ({**RMSNORM_ENTRY, "dtype": "bf16"}, "field 'dtype' must name a torch dtype, got 'bf16'"),
    ({**RMSNORM_ENTRY, "weight_dtype": "float16"}, "field 'weight_dtype' = \"float16\": weight has dtype float16"),
    ({**LayerNormCall("float32", None, "bfloat16", 64, 4, False).entry()}, "field 'bias_dtype' = \"bfloat16\""),
    ({**GEMM_ENTRY, "tile_n": 7}, "field 'tile_n' is 7, which no call has"),
    ({**GEMM_ENTRY, "grad_a_tile_n": 0}, "field 'grad_a_tile_n' is 0"),
    ({**GEMM_ENTRY, "ab_dtype": "float32"}, "field 'ab_dtype' = \"float32\": A has dtype float32"),
    ({**GEMM_ENTRY, "out_dtype": "float64"}, "field 'out_dtype' = \"float64\": out_dtype must be"),
    ({**GEMM_ENTRY, "activation": "gelu"}, "field 'activation' = \"gelu\": activation must be one of"),
    ({**GEMM_ENTRY, "bias_dtype": "float16"}, "field 'bias_dtype' = \"float16\": bias has dtype float16"),
    ({**GEMM_ENTRY, "grouping": "varlen_k"}, "field 'backward' = true: .* variable-length-K"),
    ({**GEMM_ENTRY, "grouping": "varlen_m", "a_m_major": True}, "field 'a_m_major' is true"),
    ({**GEMM_ENTRY, "activation": "swiglu", "bias_dtype": "bfloat16"}, "field 'bias_dtype' is \"bfloat16\""),
    ({**GEMM_ENTRY, "activation": "dswiglu", "tile_n": 128}, "field 'backward' is true"),
    ({**SOFTMAX_ENTRY, "n": 0}, "field 'n' = 0: x must have shape"),
    ({**SOFTMAX_ENTRY, "dtype": "float64"}, "field 'dtype' = \"float64\": x has dtype float64"),
    ({**SOFTMAX_ENTRY, "vec": 3}, "field 'vec' is 3, which no call has"),
    ({**CROSS_ENTROPY_ENTRY, "target_dtype": "float32"}, "field 'target_dtype' = \"float32\": target has dtype"),
    ({**CROSS_ENTROPY_ENTRY, "reduction": "avg"}, "field 'reduction' = \"avg\": reduction must be one of"),
    ({**CROSS_ENTROPY_ENTRY, "n": 262152}, "field 'n' = 262152: N = 262152 is larger"),
])
def test_entries_no_call_has_are_refused_by_line_and_field(tmp_path, entry, message):
    path = tmp_path / "calls.jsonl"
    path.write_text("\n".join([manifest.HEADER, plan.entry_line(SIGNATURES[0]), json.dumps(entry)]) + "\n")
    with pytest.raises(manifest.ManifestError, match=f"calls.jsonl:3: {entry['op']} entry {message}"):
        manifest.read(path)


def test_entries_of_every_kind_of_call_are_accepted(tmp_path):
    sigs = [
        RMSNormCall("float16", None, False, 4097, 1, False),
        SoftmaxCall("float32", 4100, 4, True),
        CrossEntropyCall("bfloat16", "int32", 32000, 8, "none", False),
        LayerNormCall("bfloat16", "bfloat16", "float32", 262144, 2, True),
        GemmCall("bfloat16", "float32", True, False, "dense", 128, True, 128, "relu", "float32"),
        GemmCall("float16", "float16", False, True, "varlen_m", 256, False, 0, "swiglu", None),
        GemmCall("bfloat16", "bfloat16", False, False, "varlen_m", 128, False, 0, "dgeglu", None),
        GemmCall("bfloat16", "float32", True, True, "varlen_k", 256, False, 0, None, None),
    ]
    path = tmp_path / "calls.jsonl"
    manifest.write(path, sigs)
    assert set(manifest.read(path)) == set(sigs)


def test_a_signature_without_kernels_is_refused_at_definition():
    with pytest.raises(TypeError, match="defines no kernels"):
        @plan.signature
        class Incomplete(plan.Signature):
            OP = "incomplete"
            n: int
