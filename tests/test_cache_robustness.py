"""Robustness of the kernel cache (no GPU): fuzzed entries in every layer, 16 processes
against a concurrent prune, a full disk, awkward paths, and the trust rules."""

import errno
import json
import logging
import os
import random
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import quack.cache
from cache_fixtures import fake_kernel
from cache_fixtures.env import cache_env, compile_count  # noqa: F401  (fixture)
from cache_fixtures.fake_kernel import FAMILY, compile_fake
from quack.cache import CacheError, KernelHandle, cli, maintenance, store
from quack.cache import jit as jitmod
from quack.compile_only import compile_only_mode

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def fake(cache_env, monkeypatch):
    fake_kernel.use_fakes(monkeypatch)
    yield cache_env


def _files(root, n=None):
    """(object, sidecar) of the single entry for ``compile_fake(n)`` in ``root``."""
    [obj] = [p for p in (root / FAMILY).glob("*.o") if n is None or json.loads(p.with_suffix(".json").read_text())["key"]["args"]["n"] == n]
    return obj, obj.with_suffix(".json")


def _populate(root, ns):
    """Export ``compile_fake(n)`` for each n into ``root``; forget them in memory."""
    saved = os.environ["QUACK_CACHE_DIR"]
    os.environ["QUACK_CACHE_DIR"] = str(root)
    try:
        for n in ns:
            compile_fake(n)
    finally:
        os.environ["QUACK_CACHE_DIR"] = saved
        quack.cache.clear()


# --- fuzz ------------------------------------------------------------------------------------

def _flip(data: bytes, rng) -> bytes:
    i = rng.randrange(len(data))
    return data[:i] + bytes([data[i] ^ (1 << rng.randrange(8))]) + data[i + 1:]


def _mutations(rng):
    """name -> f(object bytes, sidecar bytes) -> (object bytes, sidecar bytes), all damaging."""
    def json_edit(meta):
        field = rng.choice(["size", "sha256", "format", "key", "abi", "function_prefix", "integrity"])
        choice = rng.randrange(3)
        if field == "integrity" and choice == 0:
            choice = 1  # without it, an intact sidecar is a legitimate older one (still read)
        if choice == 0:
            meta.pop(field, None)
        elif choice == 1:
            meta[field] = rng.choice([None, 0, "x", [], {}, 12345])
        else:
            meta[field + "_"] = meta.pop(field, 1)
        return meta

    return {
        "random_object": lambda o, s: (os.urandom(len(o)), s),
        "random_sidecar": lambda o, s: (o, os.urandom(rng.randrange(1, 2 * len(s)))),
        "truncated_object": lambda o, s: (o[: rng.randrange(len(o))], s),
        "truncated_sidecar": lambda o, s: (o, s[: rng.randrange(len(s) - 2)]),  # cut into the JSON
        "bitflip_object": lambda o, s: (_flip(o, rng), s),
        "bitflip_sidecar": lambda o, s: (o, _flip(s, rng)),
        "empty_object": lambda o, s: (b"", s),
        "sidecar_field": lambda o, s: (o, json.dumps(json_edit(json.loads(s))).encode()),
        "object_missing": lambda o, s: (None, s),
        "sidecar_missing": lambda o, s: (o, None),
    }


def _plant(layer_root, keyhash, obj_bytes, side_bytes):
    family = layer_root / FAMILY
    family.mkdir(parents=True, exist_ok=True)
    obj, side = family / f"{keyhash}.o", family / f"{keyhash}.json"
    for path, data in ((obj, obj_bytes), (side, side_bytes)):
        path.unlink(missing_ok=True)
        if data is not None:
            path.write_bytes(data)
    return obj


def test_fuzzed_entries_in_every_layer_are_never_loaded(fake, monkeypatch, capsys):
    rng = random.Random(1234)
    good = fake.tmp / "good"
    _populate(good, range(4))
    originals = {}
    for obj in sorted((good / FAMILY).glob("*.o")):
        originals[obj.stem] = (obj.read_bytes(), obj.with_suffix(".json").read_bytes())
    layers = [fake.tmp / "ro one", fake.tmp / "ro-two", fake.writable]
    monkeypatch.setenv("QUACK_CACHE_PATH", os.pathsep.join(str(p) for p in layers[:2]))
    mutations = _mutations(rng)
    planted = detected_at_load = detected_by_verify = 0
    keyhash_to_n = {k: json.loads(s)["key"]["args"]["n"] for k, (_, s) in originals.items()}

    # 1. At lookup: plant one damaged entry, ask for its key, it must be reported and not loaded.
    for trial in range(60):
        layer = layers[trial % 3]
        keyhash = rng.choice(sorted(originals))
        name = sorted(mutations)[trial % len(mutations)]
        obj_bytes, side_bytes = mutations[name](*originals[keyhash])
        _plant(layer, keyhash, obj_bytes, side_bytes)
        planted += 1
        quack.cache.clear()
        fake_kernel.LOADS.clear()
        handle = compile_fake(keyhash_to_n[keyhash])
        assert isinstance(handle, KernelHandle)
        label = "writable" if layer == fake.writable else os.path.realpath(layer)
        assert label not in quack.cache.stats()["hits"], (name, layer)  # the damaged entry was not used
        assert all(intact for _, intact in fake_kernel.LOADS)
        if quack.cache.stats()["bad_entries"] >= 1:
            detected_at_load += 1
        if layer != fake.writable:  # the writable one was replaced by the recompile
            shutil.rmtree(layer / FAMILY)

    # 2. Offline: damage many entries at once in every layer; `verify` reports them all,
    # removes them from the writable layer and leaves the read-only layers untouched.
    shutil.rmtree(fake.writable / FAMILY, ignore_errors=True)
    bad_expected = 0
    for layer_index, layer in enumerate(layers):
        for i, (keyhash, pair) in enumerate(sorted(originals.items())):
            name = sorted(mutations)[(3 * layer_index + i) % len(mutations)]
            _plant(layer, keyhash, *mutations[name](*pair))
            bad_expected += 1
    planted += bad_expected
    before = {p: p.read_bytes() for layer in layers[:2] for p in layer.rglob("*") if p.is_file()}
    code = cli.main(["verify", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 1
    detected_by_verify = len(report["bad"])
    assert {b["removed"] for b in report["bad"] if b["writable"]} == {True}
    assert {b["removed"] for b in report["bad"] if not b["writable"]} == {False}
    assert not list((fake.writable / FAMILY).glob("*.[oj]*"))
    assert {p: p.read_bytes() for layer in layers[:2] for p in layer.rglob("*") if p.is_file()} == before

    print(f"fuzz: planted {planted} damaged entries; detected {detected_at_load} at lookup "
          f"(of 60) and {detected_by_verify} by verify (of {bad_expected})")
    assert detected_at_load == 60 and detected_by_verify == bad_expected


def test_fuzzed_real_object_is_detected(cache_env):
    """The same on a genuine exported object: bit flips anywhere are caught before loading."""
    from cache_fixtures.add_kernel import compile_add

    compile_add(64)
    obj = next((cache_env.writable / "test_add").glob("*.o"))
    good = obj.read_bytes()
    rng = random.Random(7)
    for _ in range(20):
        obj.write_bytes(_flip(good, rng))
        entry = next(e for e in maintenance.scan(store.Layer(cache_env.writable, "w", True)))
        assert "sha256" in maintenance.check(entry)
    obj.write_bytes(good)


# --- concurrency -----------------------------------------------------------------------------

_HAMMER = fake_kernel.WORKER_PRELUDE + textwrap.dedent(
    """
    import json, random, time
    from pathlib import Path
    from cache_fixtures.fake_kernel import compile_fake, LOADS
    barrier, parties = Path(os.environ["BARRIER"]), int(os.environ["PARTIES"])
    (barrier / str(os.getpid())).touch()
    while len(list(barrier.iterdir())) < parties:
        time.sleep(0.005)
    rng = random.Random(os.getpid())
    calls = 0
    deadline = time.monotonic() + float(os.environ["SECONDS"])
    while time.monotonic() < deadline:
        quack.cache.clear()  # every round goes to disk again
        for n in rng.sample(range(8), 8):
            compile_fake(n)
            calls += 1
    s = quack.cache.stats()
    print(json.dumps({"calls": calls, "loads": len(LOADS), "corrupt": sum(not ok for _, ok in LOADS)}))
    """
)

_PRUNER = fake_kernel.WORKER_PRELUDE + textwrap.dedent(
    """
    import json, time
    from pathlib import Path
    from quack.cache import maintenance, store
    layer = store.Layer(Path(os.environ["QUACK_CACHE_DIR"]), "writable", True)
    barrier, parties = Path(os.environ["BARRIER"]), int(os.environ["PARTIES"])
    (barrier / str(os.getpid())).touch()
    while len(list(barrier.iterdir())) < parties:
        time.sleep(0.005)
    removed = rounds = 0
    deadline = time.monotonic() + float(os.environ["SECONDS"])
    while time.monotonic() < deadline:
        removed += len(maintenance.prune(layer, 3 * 4400)[0])
        rounds += 1
    print(json.dumps({"removed": removed, "rounds": rounds}))
    """
)


def test_sixteen_processes_and_a_concurrent_prune(tmp_path):
    cache = tmp_path / "cache"
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    env = dict(os.environ, REPO=str(REPO), QUACK_CACHE_DIR=str(cache), QUACK_ARCH="sm_90a",
               BARRIER=str(barrier), PARTIES="17", SECONDS="4", QUACK_TEST_COMPILE_LOG=str(tmp_path / "log"))
    env.pop("QUACK_CACHE_PATH", None)
    env.pop("QUACK_CACHE_STRICT", None)
    procs = []
    for i in range(16):
        worker_env = dict(env, **({"QUACK_CACHE_MAX_SIZE": "24K"} if i % 4 == 0 else {}))
        procs.append(subprocess.Popen([sys.executable, "-c", _HAMMER], env=worker_env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    procs.append(subprocess.Popen([sys.executable, "-c", _PRUNER], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        assert "Traceback" not in err
        results.append(json.loads(out.strip().splitlines()[-1]))
    workers, pruner = results[:16], results[16]
    assert sum(r["corrupt"] for r in workers) == 0
    assert all(r["calls"] > 0 for r in workers)
    assert pruner["removed"] > 0, "the prune never raced with the workers"
    assert sum(r["loads"] for r in workers) > 0
    # What is left verifies, and no temporary directory is left behind.
    layer = store.Layer(cache, "writable", True)
    assert all(maintenance.check(e) == "" for e in maintenance.scan(layer))
    assert not [p for p in (cache / FAMILY).iterdir() if p.name.startswith(".")]
    print(f"16 workers: {sum(r['calls'] for r in workers)} lookups, {sum(r['loads'] for r in workers)} "
          f"loads from disk, 0 corrupt; pruner removed {pruner['removed']} entries in {pruner['rounds']} rounds")


# --- full disk ---------------------------------------------------------------------------------

def _enospc(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_full_disk_falls_back_to_the_uncached_kernel_and_reads_keep_working(fake, monkeypatch, caplog):
    compile_fake(1)  # cached before the disk fills up
    quack.cache.clear()
    monkeypatch.setattr(store.os, "replace", _enospc)
    with caplog.at_level(logging.WARNING, logger="quack.cache"):
        handle = compile_fake(2)
        assert isinstance(handle, KernelHandle) and type(handle._fn).__name__ == "FastLauncher"
        assert handle._fn._abi == [["stream"]]
        jitmod._MEMORY.clear()  # forget the handles, keep the warned set
        jitmod._RECENT.clear()
        compile_fake(3)
    assert caplog.text.count("No space left on device") == 1  # warned once
    assert "without caching" in caplog.text
    assert not [p for p in (fake.writable / FAMILY).iterdir() if p.name.startswith(".")]
    assert len(list((fake.writable / FAMILY).glob("*.json"))) == 1
    quack.cache.clear()
    fake_kernel.LOADS.clear()
    compile_fake(1)  # reads keep working
    assert quack.cache.stats()["hits"] == {"writable": 1} and fake_kernel.LOADS[0][1]

    # Compile-only mode exists to export: a failed export is an error, and a clear one.
    quack.cache.clear()
    with compile_only_mode(), pytest.raises(CacheError, match="could not export .*No space left"):
        compile_fake(4)


def test_full_disk_everywhere_is_a_clear_error(fake, monkeypatch):
    def export_fails(compiled, directory, name, prefix):
        Path(directory, f"{name}.o").write_bytes(b"\0" * 10)  # partly written, then the disk is full
        _enospc()

    monkeypatch.setattr(fake_kernel.native, "export_object", export_fails)
    with pytest.raises(CacheError, match="No space left on device"):
        compile_fake(5)
    assert not list((fake.writable / FAMILY).glob("*.o"))


def test_full_cache_disk_only_uses_a_temporary_export_for_the_layout(fake, monkeypatch):
    real_export = fake_kernel.export_object

    def export(compiled, directory, name, prefix):
        if Path(directory).is_relative_to(fake.writable):
            _enospc()
        real_export(compiled, directory, name, prefix)

    monkeypatch.setattr(fake_kernel.native, "export_object", export)
    handle = compile_fake(6)
    assert handle._fn._abi == [["stream"]] and quack.cache.stats()["exports"] == 0


def test_full_disk_with_a_real_kernel(cache_env, monkeypatch):
    from cache_fixtures.add_kernel import compile_add

    monkeypatch.setattr(store.os, "replace", _enospc)
    handle = compile_add(64)
    assert type(handle._fn._fn).__name__ == "CudaDialectJitCompiledFunction"
    assert [spec[0] for spec in handle._fn._abi] == ["tensor", "tensor", "tensor", "stream"]
    assert not list(cache_env.writable.rglob("*.o"))


# --- paths and trust --------------------------------------------------------------------------

def test_cache_on_a_path_with_spaces_and_non_ascii(cache_env, monkeypatch, capsys):
    from cache_fixtures.add_kernel import compile_add

    odd = cache_env.tmp / "dir with spaces" / "ünïcødé 缓存 é"
    monkeypatch.setenv("QUACK_CACHE_DIR", str(odd))
    compile_add(64)
    quack.cache.clear()
    compile_add(64)
    assert quack.cache.stats()["hits"] == {"writable": 1} and compile_count(cache_env) == 1
    assert cli.main(["verify"]) == 0 and "1 ok, 0 bad" in capsys.readouterr().out
    # The same directory as a read-only layer, and bundled into another odd path.
    monkeypatch.setenv("QUACK_CACHE_DIR", str(cache_env.writable))
    monkeypatch.setenv("QUACK_CACHE_PATH", str(odd))
    quack.cache.clear()
    compile_add(64)
    assert quack.cache.stats()["hits"] == {str(odd.resolve()): 1}
    tar = cache_env.tmp / "bündle dir" / "b ü.tar"
    assert cli.main(["bundle", "--out", str(tar), str(odd)]) == 0
    into = cache_env.tmp / "ïnto here"
    assert cli.main(["install", str(tar), "--into", str(into)]) == 0
    assert cli.main(["ls", "--cache-dir", str(into), "--cache-path", ""]) == 0
    assert "cache_fixtures.add_kernel.compile_add" in capsys.readouterr().out


def test_untrusted_writable_layer_is_warned_once_and_bypassed(fake, caplog):
    _populate(fake.writable, [1])
    fake.writable.chmod(0o777)
    fake_kernel.LOADS.clear()
    with caplog.at_level(logging.WARNING, logger="quack.cache"):
        assert isinstance(compile_fake(1), KernelHandle)
        jitmod._MEMORY.clear()
        jitmod._RECENT.clear()
        compile_fake(1)
        compile_fake(2)
    assert caplog.text.count("refusing writable cache layer") == 1
    assert "bypassing it" in caplog.text
    assert fake_kernel.LOADS == []  # nothing loaded from it
    assert len(list((fake.writable / FAMILY).glob("*.o"))) == 1  # and nothing written to it
    with compile_only_mode(), pytest.raises(CacheError, match="not writable by group or others"):
        compile_fake(3)
    fake.writable.chmod(0o700)


def test_writable_entry_escaping_its_layer_is_not_loaded(fake, caplog):
    outside = fake.tmp / "outside"
    _populate(outside, [1])
    (fake.writable / FAMILY).mkdir(parents=True)
    fake.writable.chmod(0o700)
    for path in (outside / FAMILY).glob("*.[oj]*"):
        (fake.writable / FAMILY / path.name).symlink_to(path)
    fake_kernel.LOADS.clear()
    with caplog.at_level(logging.WARNING, logger="quack.cache"):
        compile_fake(1)
    assert "resolves outside its writable layer" in caplog.text
    assert fake_kernel.LOADS == []


def test_symlinked_writable_root_is_resolved(fake, monkeypatch):
    real = fake.tmp / "real-cache"
    _populate(real, [1])
    link = fake.tmp / "link-cache"
    link.symlink_to(real)
    monkeypatch.setenv("QUACK_CACHE_DIR", str(link))
    compile_fake(1)
    assert quack.cache.stats()["hits"] == {"writable": 1}


def test_runfiles_style_layer_needs_its_real_directory(fake, monkeypatch):
    """Bazel runfiles link each file on its own: the per-file links resolve outside the
    runfiles folder (rejected); the launcher hands the cache the real folder (accepted)."""
    real = fake.tmp / "bazel-out" / "warm_cache_fake"
    _populate(real, [1])
    runfiles = fake.tmp / "runfiles" / "warm_cache_fake"
    (runfiles / FAMILY).mkdir(parents=True)
    for path in (real / FAMILY).glob("*.[oj]*"):
        (runfiles / FAMILY / path.name).symlink_to(path)
    monkeypatch.setenv("QUACK_CACHE_STRICT", "1")
    monkeypatch.setenv("QUACK_CACHE_PATH", str(runfiles))
    with pytest.raises(CacheError, match="outside its read-only layer"):
        compile_fake(1)
    manifest = real / "manifest.json"
    manifest.write_text("{}")
    (runfiles / "manifest.json").symlink_to(manifest)
    real_dir = os.path.dirname(os.path.realpath(runfiles / "manifest.json"))  # what the launcher passes
    monkeypatch.setenv("QUACK_CACHE_PATH", real_dir)
    quack.cache.clear()
    compile_fake(1)
    assert quack.cache.stats()["hits"] == {str(real.resolve()): 1}
