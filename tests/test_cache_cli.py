"""`python -m quack.cache` / `quack-cache`: ls, stats, verify, prune (LRU), clear, errors."""

import json
import os
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
    assert f"# writable {fake.writable}: 3 entries" in out and '{"n":2}' in out
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
    assert code == 0 and "3 entries" in out and "QUACK_CACHE_MAX_SIZE: unset" in out


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
    assert code == 0 and "evicted 3 entries" in out
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
        (["install", "/nonexistent/b.tar"], "no such bundle"),
        (["bundle", "--out", "x.tar", "/nonexistent/dir"], "not a directory"),
    ],
)
def test_bad_arguments_exit_2_with_a_message(fake, capsys, argv, message):
    try:
        code = cli.main(argv)
    except SystemExit as exc:
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err


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
    """`python -m quack.cache` runs as a program; pyproject's `quack-cache` names `console_main`."""
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
    assert scripts["quack-cache"] == "quack.cache.cli:console_main"
    assert callable(cli.console_main)
