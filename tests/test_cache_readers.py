"""Readers against maintenance: an entry removed under a reader is a miss (strict:
an error that says so), and `prune --dry-run` names exactly what prune removes."""

import json
import os
import time

import pytest

import quack.cache
from cache_fixtures import fake_kernel
from cache_fixtures.env import cache_env  # noqa: F401  (fixture)
from cache_fixtures.fake_kernel import FAMILY, compile_fake
from quack.cache import cli, maintenance, store


@pytest.fixture
def fake(cache_env, monkeypatch):
    fake_kernel.use_fakes(monkeypatch)
    yield cache_env


def _vanishing_object(monkeypatch):
    """The object file disappears between the sidecar read and its own (a
    prune or clear that won the race)."""
    real = store.read_bounded

    def read_bounded(path, *args, **kwargs):
        if path.suffix == ".o" and not path.parent.name.startswith("."):  # an entry, not an export's temporary
            # maintenance.remove runs now: sidecar, then object.
            path.with_suffix(".json").unlink()
            path.unlink()
            raise FileNotFoundError(2, "No such file or directory", str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(store, "read_bounded", read_bounded)


def test_an_entry_removed_under_a_reader_is_a_miss_not_a_bad_entry(fake, monkeypatch, caplog):
    compile_fake(7)
    quack.cache.clear()
    _vanishing_object(monkeypatch)
    compile_fake(7)  # recompiled, not reported
    stats = quack.cache.stats()
    assert stats["bad_entries"] == 0 and stats["compiles"] == 1
    assert "bad" not in caplog.text.lower()


def test_strict_mode_says_the_entry_was_removed(fake, monkeypatch):
    compile_fake(8)
    quack.cache.clear()
    monkeypatch.setenv("QUACK_CACHE_STRICT", "1")
    _vanishing_object(monkeypatch)
    with pytest.raises(quack.cache.CacheMissError, match="removed while it was being read"):
        compile_fake(8)


def test_prune_dry_run_names_exactly_what_prune_removes(fake, capsys):
    for n in range(1, 7):
        compile_fake(n)
    now = time.time()
    for i, obj in enumerate(sorted((fake.writable / FAMILY).glob("*.o"))):
        os.utime(obj, (now - 100 + i, now - 100 + i))
    layer = store.Layer(fake.writable, "writable", True)
    size = sum(e.size for e in maintenance.scan(layer))
    bound = size // 2
    oldest = min(maintenance.scan(layer), key=lambda e: e.last_use)
    with store.try_key_lock(layer, oldest.family, oldest.keyhash) as locked:  # a writer holds it
        assert locked
        cli.main(["prune", "--max-size", str(bound), "--dry-run", "--json"])
        planned = [e["key"] for e in json.loads(capsys.readouterr().out)["removed"]]
        cli.main(["prune", "--max-size", str(bound), "--json"])
        removed = [e["key"] for e in json.loads(capsys.readouterr().out)["removed"]]
    assert planned == removed and planned and oldest.keyhash not in removed


def test_a_removal_in_one_layer_does_not_hide_another_layers_copy(fake, monkeypatch):
    # Strict mode: the entry vanishes from the read-only layer (searched
    # first) while it is read, and the writable layer holds it: a hit there.
    import shutil

    compile_fake(9)
    readonly = fake.tmp / "readonly"
    shutil.copytree(fake.writable, readonly)
    quack.cache.clear()
    monkeypatch.setenv("QUACK_CACHE_PATH", str(readonly))
    monkeypatch.setenv("QUACK_CACHE_STRICT", "1")
    real = store.read_bounded

    def read_bounded(path, *args, **kwargs):
        if path.suffix == ".o" and readonly in path.parents:
            path.with_suffix(".json").unlink()
            path.unlink()
            raise FileNotFoundError(2, "No such file or directory", str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(store, "read_bounded", read_bounded)
    assert compile_fake(9) is not None
    assert quack.cache.stats()["hits"] == {"writable": 1}
