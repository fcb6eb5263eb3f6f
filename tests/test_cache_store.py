"""Lookup order, entry verification, strict mode and compile-only with a real tiny kernel."""

import json
import logging
import os

import pytest

import quack.cache
from cache_fixtures.add_kernel import compile_add
from cache_fixtures.env import cache_env, compile_count  # noqa: F401  (fixture)
from quack.cache import CacheError, CacheMissError, KernelHandle, native
from quack.cache import jit as jitmod
from quack.compile_only import compile_only_mode


def _entry(root, suffix):
    [path] = (root / "test_add").glob(f"*.{suffix}")
    return path


def _snapshot(root):
    return {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in root.rglob("*") if p.is_file()}


def _populate(env, root, **static):
    """Export one entry into ``root`` (as a writable layer) and forget it in memory."""
    os.environ["QUACK_CACHE_DIR"] = str(root)
    compile_add(**static)
    os.environ["QUACK_CACHE_DIR"] = str(env.writable)
    quack.cache.clear()


def test_miss_compiles_exports_and_the_next_process_loads(cache_env):
    handle = compile_add(64)
    assert isinstance(handle, KernelHandle)
    s = quack.cache.stats()
    assert (s["misses"], s["compiles"], s["exports"]) == (1, 1, 1)
    sidecar = json.loads(_entry(cache_env.writable, "json").read_text())
    assert sidecar["key"]["args"] == {"n": 64, "dtype": "float32"}
    assert sidecar["size"] == _entry(cache_env.writable, "o").stat().st_size
    assert compile_add(64) is handle and quack.cache.stats()["hits"] == {"memory": 1}

    quack.cache.clear()  # as a fresh process would: the object is loaded, not compiled
    loaded = compile_add(n=64, dtype="float32")
    assert quack.cache.stats()["hits"] == {"writable": 1} and compile_count(cache_env) == 1
    assert type(loaded._fn).__name__ == "FastLauncher"
    # Loaded by the DSL runtime's C loader where it can (a GPU machine), else by the DSL.
    if loaded._fn._runtime is None:
        assert type(loaded._fn._fn).__name__ == "CudaDialectJitCompiledFunction"
    else:
        assert loaded._fn._fn is None
    assert loaded.keyhash == handle.keyhash


def test_writable_layer_is_private(cache_env, caplog):
    """Created private; a layer others can write is bypassed with a warning
    (the kernel still works, compiled in memory), never loaded from."""
    compile_add(64)
    assert cache_env.writable.stat().st_mode & 0o777 == 0o700
    cache_env.writable.chmod(0o777)
    quack.cache.clear()
    with caplog.at_level(logging.WARNING, logger="quack.cache"):
        assert isinstance(compile_add(64), KernelHandle)
    assert "bypassing it" in caplog.text
    assert quack.cache.stats()["hits"] == {}
    cache_env.writable.chmod(0o700)


def _truncate(env):
    obj = _entry(env.writable, "o")
    obj.write_bytes(obj.read_bytes()[:100])


def _garbage(env):
    obj = _entry(env.writable, "o")
    obj.write_bytes(os.urandom(obj.stat().st_size))


def _edit_sidecar(edit_meta):
    def edit(env):
        path = _entry(env.writable, "json")
        meta = json.loads(path.read_text())
        edit_meta(meta)
        path.write_text(json.dumps(meta))

    return edit


def _foreign_version(meta):
    meta["format"] = meta["key"]["format"] = 999


def _garbage_sidecar(env):
    _entry(env.writable, "json").write_text("{not json")


CORRUPTIONS = {
    "truncated": (_truncate, "truncated"),
    "garbage": (_garbage, "sha256"),
    "foreign_version": (_edit_sidecar(_foreign_version), "foreign format version 999"),
    "wrong_arch": (_edit_sidecar(lambda meta: meta["key"].update(arch="sm_80")), "arch 'sm_80'"),
    "key_mismatch": (_edit_sidecar(lambda meta: meta["key"]["args"].update(n=128)), "differs in args"),
    "sidecar_garbage": (_garbage_sidecar, "sidecar unreadable"),
}


@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
def test_bad_entry_is_a_miss_and_is_replaced(cache_env, caplog, corruption):
    damage, problem = CORRUPTIONS[corruption]
    compile_add(64)
    good = _entry(cache_env.writable, "o").read_bytes()
    damage(cache_env)
    quack.cache.clear()
    with caplog.at_level(logging.WARNING, logger="quack.cache"):
        compile_add(64)
    assert problem in caplog.text
    s = quack.cache.stats()
    assert (s["bad_entries"], s["compiles"]) == (1, 1)
    assert _entry(cache_env.writable, "o").read_bytes() == good
    quack.cache.clear()
    compile_add(64)
    assert quack.cache.stats()["hits"] == {"writable": 1}


@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
def test_bad_entry_in_strict_mode_raises_naming_the_problem(cache_env, monkeypatch, corruption):
    damage, problem = CORRUPTIONS[corruption]
    compile_add(64)
    damage(cache_env)
    quack.cache.clear()
    monkeypatch.setenv("QUACK_CACHE_STRICT", "1")
    with pytest.raises(CacheError, match="bad cache entry") as err:
        compile_add(64)
    assert problem in str(err.value) and "compile_add" in str(err.value)
    assert compile_count(cache_env) == 1


def test_bad_entry_warns_once(cache_env, caplog):
    compile_add(64)
    _truncate(cache_env)
    quack.cache.clear()
    with caplog.at_level(logging.WARNING, logger="quack.cache"):
        compile_add(64)
        _truncate(cache_env)
        jitmod._MEMORY.clear()  # forget the handle, keep the warned set
        jitmod._RECENT.clear()
        compile_add(64)
    assert quack.cache.stats()["bad_entries"] == 2  # the damaged entry was really read twice
    assert caplog.text.count("bad cache entry") == 1


def test_load_failure_is_a_miss(cache_env, monkeypatch, caplog):
    compile_add(64)
    quack.cache.clear()

    def broken(*args):
        raise OSError("no CUDA driver")

    monkeypatch.setattr(native, "load_object", broken)
    handle = compile_add(64)  # falls back to compiling in this process
    assert isinstance(handle, KernelHandle) and "load failed" in caplog.text
    assert quack.cache.stats()["bad_entries"] == 1
    quack.cache.clear()
    monkeypatch.setenv("QUACK_CACHE_STRICT", "1")
    with pytest.raises(CacheError, match="no CUDA driver"):
        compile_add(64)


def test_readonly_layer_is_searched_first_and_never_written(cache_env, monkeypatch):
    readonly = cache_env.tmp / "readonly"
    _populate(cache_env, readonly, n=64)
    _populate(cache_env, cache_env.writable, n=64)
    monkeypatch.setenv("QUACK_CACHE_PATH", os.pathsep.join([str(cache_env.tmp / "absent"), str(readonly)]))
    before = _snapshot(readonly)
    compile_add(64)
    assert quack.cache.stats()["hits"] == {str(readonly.resolve()): 1}

    compile_add(32)  # a miss compiles into the writable layer only
    assert len(list((cache_env.writable / "test_add").glob("*.o"))) == 2
    assert _snapshot(readonly) == before


def test_bad_readonly_entry_falls_through_and_stays_untouched(cache_env, monkeypatch):
    readonly = cache_env.tmp / "readonly"
    _populate(cache_env, readonly, n=64)
    obj = _entry(readonly, "o")
    obj.write_bytes(obj.read_bytes()[:10])
    monkeypatch.setenv("QUACK_CACHE_PATH", str(readonly))
    before = _snapshot(readonly)
    compile_add(64)
    s = quack.cache.stats()
    assert (s["bad_entries"], s["compiles"]) == (1, 1)
    assert _snapshot(readonly) == before and _entry(cache_env.writable, "o").exists()


def test_readonly_entry_escaping_its_layer_is_rejected(cache_env, monkeypatch):
    outside = cache_env.tmp / "outside"
    _populate(cache_env, outside, n=64)
    readonly = cache_env.tmp / "readonly" / "test_add"
    readonly.mkdir(parents=True)
    for path in (outside / "test_add").iterdir():
        (readonly / path.name).symlink_to(path)
    monkeypatch.setenv("QUACK_CACHE_PATH", str(readonly.parent))
    monkeypatch.setenv("QUACK_CACHE_STRICT", "1")
    with pytest.raises(CacheError, match="outside its read-only layer"):
        compile_add(64)


def test_readonly_layer_through_a_symlinked_root(cache_env, monkeypatch):
    real = cache_env.tmp / "real"
    _populate(cache_env, real, n=64)
    link = cache_env.tmp / "runfiles_link"
    link.symlink_to(real)
    monkeypatch.setenv("QUACK_CACHE_PATH", str(link))
    monkeypatch.setenv("QUACK_CACHE_STRICT", "1")
    compile_add(64)
    assert quack.cache.stats()["hits"] == {str(real.resolve()): 1}


def test_strict_miss_names_kernel_and_key_fields(cache_env, monkeypatch):
    monkeypatch.setenv("QUACK_CACHE_STRICT", "1")
    with pytest.raises(CacheMissError) as err:
        compile_add(48, dtype="float16")
    message = str(err.value)
    assert isinstance(err.value, RuntimeError)
    for part in ("'test_add'", "cache_fixtures.add_kernel.compile_add", "'n': 48", "'dtype': 'float16'",
                 "arch = 'sm_90a'", "cuda = ", "dsl_version = '4.8.1'", "source = ", "options = "):  # fmt: skip
        assert part in message
    assert compile_count(cache_env) == 0 and not cache_env.writable.exists()


def test_compile_only_exports_without_loading(cache_env, monkeypatch):
    monkeypatch.setattr(native, "load_object", lambda *a: pytest.fail("compile-only must not load"))
    with compile_only_mode():
        handle = compile_add(64)
        assert handle() is None  # the launch is a no-op
        compile_add(n=64)  # same key by keyword: a memory hit
    assert _entry(cache_env.writable, "o").exists()
    s = quack.cache.stats()
    assert (s["compiles"], s["exports"], s["hits"]) == (1, 1, {"memory": 1})
    quack.cache.clear()
    with compile_only_mode():
        compile_add(64)
    assert quack.cache.stats()["hits"] == {"writable": 1}


def test_compile_only_strict_miss_raises_and_hit_passes(cache_env, monkeypatch):
    monkeypatch.setenv("QUACK_CACHE_STRICT", "1")
    with compile_only_mode(), pytest.raises(CacheMissError, match="compile_add"):
        compile_add(64)
    monkeypatch.delenv("QUACK_CACHE_STRICT")
    with compile_only_mode():
        compile_add(64)
    quack.cache.clear()
    monkeypatch.setenv("QUACK_CACHE_STRICT", "1")
    with compile_only_mode():
        assert compile_add(64)() is None
    assert compile_count(cache_env) == 1


def test_clear_disk_removes_writable_entries(cache_env):
    compile_add(64)
    quack.cache.clear(disk=True)
    assert not list(cache_env.writable.rglob("*.o"))
    compile_add(64)
    assert compile_count(cache_env) == 2
