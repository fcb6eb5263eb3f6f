"""``quack-cache preflight``: the objects a manifest's calls need that no cache layer holds,
found without compiling; and the ``quack-cache`` script that adds it (and ``warm``) to the cache
commands (CPU only)."""

import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from cache_fixtures.env import cache_env  # noqa: F401  (fixture)

import quack.cache
from quack import cli
from quack.calls import manifest

REPO = Path(__file__).resolve().parents[1]
# Two softmax calls, a comment, a blank line and an entry written by hand: the inference call
# needs the forward object, the training call (line 5) the forward and the backward ones.
CALLS = f"""# a job's calls
{manifest.HEADER}
{{"op": "softmax", "dtype": "float32", "n": 7, "vec": 1, "backward": false}}

{{"vec": 1,"n": 7,"dtype": "float32","backward": true,"op": "softmax"}}
"""


def _env(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("QUACK_")}
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return dict(env, PYTHONPATH=path, QUACK_ARCH="sm_90a", QUACK_CACHE_DIR=str(tmp_path / "default"))


def _quack_cache(tmp_path, *argv):
    """The ``quack-cache`` script's entry point (``python -m quack.cli``), in a child process."""
    return subprocess.run([sys.executable, "-m", "quack.cli", *map(str, argv)], env=_env(tmp_path),
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def warmed(tmp_path_factory):
    """A manifest and a cache folder that ``quack-cache warm`` filled with its two objects."""
    tmp = tmp_path_factory.mktemp("warmed")
    calls = tmp / "calls.jsonl"
    calls.write_text(CALLS)
    done = _quack_cache(tmp, "warm", calls, "--out", tmp / "cache")
    assert done.returncode == 0, done.stderr
    assert "2 objects (2 exported now, 0 already present), 2 manifest calls" in done.stdout
    return calls, tmp / "cache"


@pytest.fixture
def setup(warmed, cache_env, monkeypatch):  # noqa: F811
    """The manifest, and a copy of the warmed folder this test may damage."""
    calls, cache = warmed
    monkeypatch.setenv("QUACK_ARCH", "sm_90a")
    monkeypatch.delenv(manifest.RECORD_ENV, raising=False)
    copy = cache_env.tmp / "cache"
    shutil.copytree(cache, copy)
    return calls, copy


def _preflight(capsys, *argv):
    code = cli.main(["preflight", *map(str, argv)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _entry(cache: Path, function: str) -> Path:
    """The object of the entry of ``function`` (read from the sidecars, not from preflight)."""
    (sidecar,) = [p for p in cache.glob("softmax/*.json")
                  if json.loads(p.read_text())["key"]["function"] == f"quack.families.softmax.op.{function}"]
    return sidecar.with_suffix(".o")


def test_every_object_present_passes(setup, capsys):
    calls, cache = setup
    code, out, err = _preflight(capsys, calls, "--cache-dir", cache)
    assert (code, err) == (0, "")
    assert out == f"2 calls need 2 objects for sm_90a: 2 present, 0 missing (searched {cache})\n"


def test_a_deleted_entry_is_named_with_the_line_of_its_call(setup, capsys):
    calls, cache = setup
    backward = _entry(cache, "compile_softmax_bwd")
    backward.unlink()
    backward.with_suffix(".json").unlink()
    code, out, _ = _preflight(capsys, calls, "--cache-dir", cache)
    assert code == 1
    header, row, summary = out.splitlines()
    assert header.split()[:5] == ["MANIFEST", "LINE", "ROLE", "MISSING", "OBJECT"]
    assert row.split()[:4] == [f"{calls}:5", "backward", f"softmax/{backward.name}", "compile_softmax_bwd('float32',"]
    assert row.endswith('{"backward": true, "dtype": "float32", "n": 7, "op": "softmax", "vec": 1}')
    assert summary.startswith("2 calls need 2 objects for sm_90a: 1 present, 1 missing")
    code, out, _ = _preflight(capsys, calls, "--cache-dir", cache, "--json")
    report = json.loads(out)
    assert code == 1 and (report["objects"], report["missing_objects"]) == (2, 1)
    (missing,) = report["missing"]
    assert missing == {
        "manifest": str(calls), "line": 5, "role": "backward", "family": "softmax", "key": backward.stem,
        "object": f"softmax/{backward.name}", "kernel": "compile_softmax_bwd('float32', 7, 1)",
        "call": {"op": "softmax", "dtype": "float32", "n": 7, "vec": 1, "backward": True},
    }
    forward = _entry(cache, "compile_softmax_fwd").stem
    assert [(n["line"], n["role"], n["key"]) for n in report["present"]] == [(3, "forward", forward),
                                                                              (5, "forward", forward)]


def test_a_damaged_entry_is_missing_and_warned_about(setup, capsys, caplog):
    calls, cache = setup
    forward = _entry(cache, "compile_softmax_fwd")
    forward.write_bytes(b"not an object")
    code, out, _ = _preflight(capsys, calls, "--cache-dir", cache, "--json")
    assert code == 1
    assert [(n["line"], n["key"]) for n in json.loads(out)["missing"]] == [(3, forward.stem), (5, forward.stem)]
    assert f"bad cache entry {forward}" in caplog.text


def test_read_only_layers_count_and_nothing_is_compiled_or_written(setup, capsys, monkeypatch):
    calls, cache = setup
    empty = cache.parent / "empty"
    code, out, _ = _preflight(capsys, calls, "--cache-dir", empty, "--cache-path", cache)
    assert code == 0 and f"2 present, 0 missing (searched {cache}, {empty})" in out
    monkeypatch.setenv("QUACK_CACHE_PATH", str(cache))
    monkeypatch.setenv("QUACK_CACHE_DIR", str(empty))
    assert _preflight(capsys, calls)[0] == 0
    # Neither layer: every object missing, none compiled, the writable layer not even created.
    code, out, _ = _preflight(capsys, calls, "--cache-path", "")
    assert code == 1 and "0 present, 2 missing" in out
    assert quack.cache.stats()["compiles"] == 0 and not empty.exists()


def test_keys_hold_the_arch(setup, capsys):
    calls, cache = setup
    code, out, _ = _preflight(capsys, calls, "--cache-dir", cache, "--arch", "sm_100a")
    assert code == 1 and "2 calls need 2 objects for sm_100a: 0 present, 2 missing" in out
    code, _, err = _preflight(capsys, calls, "--cache-dir", cache, "--arch", "sm_80")
    assert code == 2 and err.startswith(f"quack-cache preflight: error: {calls}:3: softmax kernels cannot be "
                                        "compiled for sm_80")


def test_only_the_families_asked_for_are_checked(setup, capsys):
    calls, cache = setup
    empty = cache.parent / "empty"
    code, out, _ = _preflight(capsys, calls, "--cache-dir", empty, "--family", "rmsnorm")
    assert code == 0 and out.startswith("0 calls need 0 objects")
    code, out, err = _preflight(capsys, calls, "--cache-dir", empty, "--family", "rmsnrom")
    assert (code, out) == (2, "") and "error: family 'rmsnrom': unknown op 'rmsnrom'" in err


@pytest.mark.parametrize("line, message", [
    ('{"op": "softmax", "dtype": "float32"', "not JSON"),
    ('{"op": "softmax", "dtype": "float32", "n": 7}', "softmax entry fields differ from the signature"),
    ('{"op": "softmax", "dtype": "float32", "n": "7", "vec": 1, "backward": false}', "field 'n' must be int"),
])
def test_a_malformed_line_is_an_error_naming_file_and_line(setup, capsys, line, message):
    _, cache = setup
    bad = cache.parent / "bad.jsonl"
    bad.write_text(f"{CALLS}{line}\n\n")
    code, out, err = _preflight(capsys, bad, "--cache-dir", cache)
    assert (code, out) == (2, "")
    assert err.startswith(f"quack-cache preflight: error: {bad}:6: ") and message in err


def test_a_missing_manifest_is_an_error(setup, capsys):
    _, cache = setup
    code, out, err = _preflight(capsys, cache.parent / "nope.jsonl", "--cache-dir", cache)
    assert (code, out) == (2, "") and "No such file or directory" in err and "nope.jsonl" in err


def test_the_script_lists_preflight_and_warm_and_runs_the_cache_commands(warmed, tmp_path, capsys):
    with pytest.raises(SystemExit) as done:
        cli.main(["--help"])
    assert done.value.code == 0
    commands = capsys.readouterr().out
    assert all(f"\n    {name}" in commands for name in ("ls", "show-config", "preflight", "warm"))
    calls, cache = warmed
    # In a child process, as the installed script runs: exit status and output of a check, then a
    # cache command, delegated, with the output `python -m quack.cache` gives.
    check = _quack_cache(tmp_path, "preflight", calls, "--cache-dir", tmp_path / "empty")
    assert check.returncode == 1 and "0 present, 2 missing" in check.stdout
    listed = _quack_cache(tmp_path, "ls", "--json", "--cache-dir", cache)
    same = subprocess.run([sys.executable, "-m", "quack.cache", "ls", "--json", "--cache-dir", str(cache)],
                          env=_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert listed.returncode == same.returncode == 0 and listed.stdout == same.stdout
    if not (REPO / "pyproject.toml").exists():
        pytest.skip("needs the checkout's pyproject.toml, not only the package")
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["quack-cache"] == "quack.cli:console_main"
