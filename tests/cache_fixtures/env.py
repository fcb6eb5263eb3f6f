"""Shared pytest fixture: an isolated cache (fresh writable layer, default knobs, empty memory)."""

from types import SimpleNamespace

import pytest

import quack.cache


@pytest.fixture
def cache_env(tmp_path, monkeypatch):
    writable = tmp_path / "writable"
    log = tmp_path / "compiles.log"
    monkeypatch.setenv("QUACK_CACHE_DIR", str(writable))
    monkeypatch.setenv("QUACK_TEST_COMPILE_LOG", str(log))
    for name in ("QUACK_CACHE_PATH", "QUACK_CACHE_STRICT", "QUACK_ARCH", "QUACK_CACHE_MAX_SIZE"):
        monkeypatch.delenv(name, raising=False)
    quack.cache.clear()
    yield SimpleNamespace(writable=writable, log=log, tmp=tmp_path)
    quack.cache.clear()


def compile_count(env) -> int:
    """Real compiles recorded by the fixture kernel (across processes)."""
    return len(env.log.read_text().splitlines()) if env.log.exists() else 0
