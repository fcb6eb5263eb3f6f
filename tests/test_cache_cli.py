"""`python -m quack.cache` / `quack-cache`: ls, stats, verify, prune (LRU), clear, show-config,
errors, a reader that goes away."""

import json
import os
import re
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

import quack.cache
from cache_fixtures import fake_kernel
from cache_fixtures.env import cache_env  # noqa: F401  (fixture)
from cache_fixtures.fake_kernel import FAMILY, compile_fake
from quack.cache import cli

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def fake(cache_env, monkeypatch):
    fake_kernel.use_fakes(monkeypatch)
    yield cache_env


def _run(capsys, *argv):
    code = cli.main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _objects(root):
    return sorted((root / FAMILY).glob("*.o"))


def _age(root, n_by_age):
    """Set last use: entry for n gets mtime now - age (seconds)."""
    now = time.time()
    for obj in _objects(root):
        n = json.loads(obj.with_suffix(".json").read_text())["key"]["args"]["n"]
        os.utime(obj, (now - n_by_age[n], now - n_by_age[n]))


def test_ls_and_stats(fake, capsys):
    for n in (1, 2, 3):
        compile_fake(n)
    code, out, _ = _run(capsys, "ls")
    assert code == 0 and out.count("cache_fixtures.fake_kernel.compile_fake") == 3
    lines = out.splitlines()
    size = sum(p.stat().st_size for p in (fake.writable / FAMILY).iterdir())
    assert lines[0] == f"writable layer {fake.writable}: 3 entries, {cli.format_size(size)}"
    assert lines[1].split() == ["FAMILY", "KEY", "SIZE", "LAST", "USE", "ARCH", "KERNEL", "ARGS"]
    # One row per entry, its columns aligned under the header's.
    assert all(line.index(FAMILY) == lines[1].index("FAMILY") for line in lines[2:])
    assert all(line.index("sm_90a") == lines[1].index("ARCH") for line in lines[2:]) and '{"n":2}' in out
    code, out, _ = _run(capsys, "ls", "--json")
    listing = json.loads(out)
    assert code == 0 and len(listing["entries"]) == 3
    entry = listing["entries"][0]
    assert {"family", "key", "function", "args", "arch", "size", "last_use", "layer"} <= entry.keys()
    assert entry["family"] == FAMILY and entry["arch"] == "sm_90a" and entry["size"] > 4096
    assert _run(capsys, "ls", "--family", "other", "--json")[1].count('"key"') == 0
    code, out, _ = _run(capsys, "stats", "--json")
    [layer] = json.loads(out)["layers"]
    assert (layer["entries"], layer["families"][FAMILY]["entries"]) == (3, 3)
    assert layer["bytes"] == sum(e["size"] for e in listing["entries"])
    code, out, _ = _run(capsys, "stats")
    lines = out.splitlines()
    assert code == 0 and lines[0].split() == ["LAYER", "FAMILY", "ENTRIES", "SIZE", "LAST", "USE"]
    assert lines[1].split()[:4] == ["writable", str(fake.writable), "(all)", "3"]
    assert lines[2].split()[:2] == [FAMILY, "3"] and lines[-1] == "QUACK_CACHE_MAX_SIZE: unset"


def test_verify_removes_bad_writable_entries_and_reports_readonly_ones(fake, monkeypatch, capsys):
    readonly = fake.tmp / "ro"
    os.environ["QUACK_CACHE_DIR"] = str(readonly)
    compile_fake(1)
    os.environ["QUACK_CACHE_DIR"] = str(fake.writable)
    quack.cache.clear()
    compile_fake(1)
    compile_fake(2)
    monkeypatch.setenv("QUACK_CACHE_PATH", str(readonly))
    assert _run(capsys, "verify")[0] == 0
    for root in (readonly, fake.writable):
        obj = _objects(root)[0]
        obj.write_bytes(obj.read_bytes()[:-1] + b"!")
    code, out, _ = _run(capsys, "verify")
    assert code == 1 and out.count("BAD ") == 2 and "(removed)" in out and "kept: read-only layer" in out
    assert "3 entries: 1 ok, 2 bad" in out
    assert len(_objects(fake.writable)) == 1 and len(_objects(readonly)) == 1
    assert _run(capsys, "verify", "--cache-path", "")[0] == 0


def test_last_use_is_touched_on_load_not_on_memory_hits(fake):
    compile_fake(1)
    [obj] = _objects(fake.writable)
    os.utime(obj, (1_000_000, 1_000_000))
    quack.cache.clear()
    compile_fake(1)  # loaded from disk: a use
    assert obj.stat().st_mtime > time.time() - 60
    os.utime(obj, (1_000_000, 1_000_000))
    compile_fake(1)  # a memory hit: no file system access at all
    assert obj.stat().st_mtime == 1_000_000


def test_prune_evicts_least_recently_used_first(fake, capsys):
    for n in range(1, 6):
        compile_fake(n)
    _age(fake.writable, {1: 50, 2: 10, 3: 40, 4: 20, 5: 30})
    entry_size = sum(p.stat().st_size for p in (fake.writable / FAMILY).glob("*.[oj]*")) // 5
    code, out, _ = _run(capsys, "prune", "--max-size", str(2 * entry_size + 10), "--dry-run", "--json")
    result = json.loads(out)
    assert code == 0 and [e["args"]["n"] for e in result["removed"]] == [1, 3, 5]
    assert len(_objects(fake.writable)) == 5
    code, out, _ = _run(capsys, "prune", "--max-size", str(2 * entry_size + 10))
    lines = out.splitlines()
    assert code == 0 and lines[0].split() == ["FAMILY", "KEY", "SIZE", "LAST", "USE"] and len(lines) == 5
    assert lines[-1].startswith("evicted 3 entries")
    left = sorted(json.loads(o.with_suffix(".json").read_text())["key"]["args"]["n"] for o in _objects(fake.writable))
    assert left == [2, 4]
    assert _run(capsys, "prune", "--max-size", "1G")[1].startswith("evicted 0 entries")


def test_max_size_bound_after_export(fake, monkeypatch):
    compile_fake(1)
    entry_size = sum(p.stat().st_size for p in (fake.writable / FAMILY).glob("*.[oj]*"))
    monkeypatch.setenv("QUACK_CACHE_MAX_SIZE", str(2 * entry_size + 10))
    for n in (2, 3, 4):
        time.sleep(0.01)
        compile_fake(n)
    left = sorted(json.loads(o.with_suffix(".json").read_text())["key"]["args"]["n"] for o in _objects(fake.writable))
    assert left == [3, 4]


def test_clear(fake, capsys):
    for n in (1, 2):
        compile_fake(n)
    code, out, _ = _run(capsys, "clear", "--json")
    assert code == 0 and json.loads(out)["removed"] == 2
    assert not list((fake.writable / FAMILY).iterdir())


@pytest.mark.parametrize(
    "argv, message",
    [
        (["prune", "--max-size", "lots"], "not a size: 'lots'"),
        (["prune"], "--max-size"),
        (["frobnicate"], "invalid choice"),
        ([], "required"),
        (["ls", "--bogus"], "unrecognized arguments"),
    ],
)
def test_bad_arguments_exit_2_with_a_message(fake, capsys, argv, message):
    try:
        code = cli.main(argv)
    except SystemExit as exc:
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["install", "/nonexistent/b.tar"], "quack-cache install: error: no such bundle: /nonexistent/b.tar"),
        (["install", "/"], "quack-cache install: error: not a file: /"),
        (["bundle", "--out", "x.tar", "/nonexistent/dir"], "quack-cache bundle: error: not a directory: /nonexistent/dir"),
    ],
)
def test_a_missing_file_is_one_line_without_the_usage(fake, capsys, argv, message):
    # The command line was well formed: repeating its usage would suggest otherwise.
    code = cli.main(argv)
    assert (code, capsys.readouterr().err) == (2, message + "\n")


def test_untrusted_writable_layer_is_flagged_and_not_modified(fake, capsys):
    compile_fake(1)
    fake.writable.chmod(0o777)
    try:
        assert "UNTRUSTED" in _run(capsys, "ls")[1]
        code, _, err = _run(capsys, "clear")
        assert code == 1 and "not writable by group or others" in err
        assert len(_objects(fake.writable)) == 1
    finally:
        fake.writable.chmod(0o700)


def test_module_entry_point_and_console_script(tmp_path):
    """`python -m quack.cache` runs as a program; pyproject's `quack-cache` names quack.cli's `console_main`."""
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, QUACK_CACHE_DIR=str(tmp_path / "c"), PYTHONPATH=path)
    env.pop("QUACK_CACHE_MAX_SIZE", None)
    env.pop("QUACK_CACHE_PATH", None)
    ok = subprocess.run([sys.executable, "-m", "quack.cache", "stats", "--json"], env=env,
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and json.loads(ok.stdout)["layers"][0]["entries"] == 0
    bad = subprocess.run([sys.executable, "-m", "quack.cache", "prune", "--max-size", "2Q"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "not a size" in bad.stderr and "Traceback" not in bad.stderr
    if not (REPO / "pyproject.toml").exists():
        pytest.skip("needs the checkout's pyproject.toml, not only the package")
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["quack-cache"] == "quack.cli:console_main"
    assert callable(cli.console_main)


def _subprocess_env(tmp_path):
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, QUACK_CACHE_DIR=str(tmp_path / "c"), PYTHONPATH=path)
    for name in ("QUACK_CACHE_MAX_SIZE", "QUACK_CACHE_PATH"):
        env.pop(name, None)
    return env


@pytest.mark.parametrize("argv", [["stats"], ["ls"]])
def test_a_reader_that_goes_away_ends_the_command_quietly(fake, argv):
    """`quack-cache ls | head`: no "Broken pipe" error, the status of a command SIGPIPE ended."""
    for n in range(60):  # ls: more than one buffer of output, so a write fails mid-listing too
        compile_fake(n)
    env = dict(_subprocess_env(fake.tmp), QUACK_CACHE_DIR=str(fake.writable))
    read, write = os.pipe()
    os.close(read)  # the reader is gone before anything is written
    try:
        done = subprocess.run([sys.executable, "-m", "quack.cache", *argv], stdout=write, stderr=subprocess.PIPE,
                              env=env, text=True, timeout=120)
    finally:
        os.close(write)
    assert (done.returncode, done.stderr) == (141, "")


def test_show_config_reports_versions_layers_and_settings(fake, monkeypatch, capsys):
    import importlib.metadata

    import torch

    monkeypatch.setenv("QUACK_ARCH", "sm_100a")
    monkeypatch.setenv("QUACK_CACHE_STRICT", "1")
    monkeypatch.setenv("QUACK_CACHE_MAX_SIZE", "2G")
    missing = fake.tmp / "missing"
    monkeypatch.setenv("QUACK_CACHE_PATH", str(missing))
    fake.writable.mkdir()
    fake.writable.chmod(0o777)
    try:
        code, out, _ = _run(capsys, "show-config", "--json")
        text = _run(capsys, "show-config")[1]
    finally:
        fake.writable.chmod(0o700)
    config = json.loads(out)
    assert code == 0
    assert config["versions"]["quack-kernels-cached"] == quack.__version__
    assert config["versions"]["torch"] == torch.__version__
    assert config["versions"]["nvidia-cutlass-dsl"].startswith(importlib.metadata.version("nvidia-cutlass-dsl"))
    assert (config["arch"], config["arch_from"]) == ("sm_100a", "QUACK_ARCH")
    assert config["launcher"]["kind"] in ("C", "ctypes")
    readonly, writable = config["layers"]
    assert (readonly["root"], readonly["exists"], readonly["writable"]) == (str(missing), False, False)
    assert (writable["root"], writable["writable"]) == (str(fake.writable), True)
    assert writable["trust"].startswith("UNTRUSTED: ") and "not writable by group or others" in writable["trust"]
    settings = config["settings"]
    assert (settings["QUACK_CACHE_STRICT"], settings["QUACK_CACHE_MAX_SIZE"]) == (True, 2 << 30)
    for row in (r"arch +sm_100a \(from QUACK_ARCH\)", r"strict +yes", r"max size +2\.0 GiB",
                rf"read-only +{missing} +no +trusted: configured read-only layer",
                rf"writable +{fake.writable} +yes +UNTRUSTED: .*"):
        assert re.search(f"^{row}$", text, re.M), row


def test_show_config_names_the_ctypes_launcher_where_the_c_one_is_missing(tmp_path):
    code = """
import sys
sys.modules["quack.launch._fastlaunch"] = None  # as where it was never built
from quack.cache import cli
sys.exit(cli.main(["show-config", "--json"]))
"""
    done = subprocess.run([sys.executable, "-c", code], env=_subprocess_env(tmp_path), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    launcher = json.loads(done.stdout)["launcher"]
    assert launcher["kind"] == "ctypes" and "it is not built" in launcher["detail"]
