"""The cache against hostile and awkward file systems (no GPU): other users' files, FIFOs,
devices, oversized sidecars, a real full disk, a lock held by a stuck process, folders where
entries belong, and a writable layer pointed at a home folder by mistake.

Fault injection is real where the machine allows it (root: a small tmpfs, a second user, a
device node) and skipped with the reason elsewhere."""

import contextlib
import hashlib
import json
import logging
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import pytest

import quack.cache
from cache_fixtures import fake_kernel
from cache_fixtures.env import cache_env  # noqa: F401  (fixture)
from cache_fixtures.faults import small_tmpfs
from cache_fixtures.fake_kernel import FAMILY, compile_fake
from quack.cache import CacheError, cli, locks, maintenance, store
from quack.cache.key import canonical_json
from quack.compile_only import compile_only_mode

REPO = Path(__file__).resolve().parents[1]
NOBODY = 65534
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (a second user, mount, mknod)")


@pytest.fixture
def fake(cache_env, monkeypatch):
    fake_kernel.use_fakes(monkeypatch)
    yield cache_env


def _entry(root, n):
    """(object, sidecar) of ``compile_fake(n)``'s entry in ``root``."""
    for side in (root / FAMILY).glob("*.json"):
        if json.loads(side.read_text())["key"]["args"]["n"] == n:
            return side.with_suffix(".o"), side
    raise AssertionError(f"no entry for n={n}")


def _finishes(fn, seconds=20.0):
    """Run ``fn`` in a thread; its result, or a failure if it is still running after ``seconds``."""
    out = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed back to the test
            out["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"{fn} still running after {seconds} s (a hang)"
    if "error" in out:
        raise out["error"]
    return out.get("value")


# --- removal: only what the cache wrote -------------------------------------------------------

def _home_like(root):
    """A folder that is somebody's home, not a cache: returns its files and their bytes."""
    files = {
        ".ssh/id_ed25519": b"private key",
        "Documents/report.txt": b"draft",
        "poetry.lock": b"lock",
        "notes.o": b"not a kernel",
        f"{FAMILY}/README": b"a folder named like a family",
        f"{FAMILY}/{'0' * 32}.lock": b"someone's lock file",
        "project/.0123456789abcdef0123456789abcdef.quack-export-x/keep": b"dot folder named like a temporary",
    }
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return files


def test_clear_disk_removes_entries_and_nothing_else(fake):
    fake.writable.mkdir(mode=0o700)
    files = _home_like(fake.writable)
    compile_fake(1)
    compile_fake(2)
    quack.cache.clear(disk=True)
    assert not list((fake.writable / FAMILY).glob("*.o")) and not list((fake.writable / FAMILY).glob("*.json"))
    assert {n: (fake.writable / n).read_bytes() for n in files} == files


@pytest.mark.parametrize("which", ["json", "o"])
def test_a_folder_named_like_an_entry_file_stays_and_prune_goes_on(fake, which):
    # An object beside a folder named like its sidecar (or the reverse): the
    # regular file goes, the folder stays, and pruning removes the rest.
    fake.writable.mkdir(mode=0o700)
    compile_fake(1)
    compile_fake(2)
    first, second = sorted((fake.writable / FAMILY).glob("*.o"))
    odd = first.with_suffix(f".{which}")
    odd.unlink()
    odd.mkdir()
    layer = store.Layer(fake.writable, "writable", True)
    removed, _ = maintenance.prune(layer, 0)
    assert len(removed) == 2 and odd.is_dir()
    assert sorted(p.name for p in (fake.writable / FAMILY).iterdir() if not p.name.endswith(".lock")) == [odd.name]


def test_clear_refuses_an_untrusted_layer_and_removes_nothing(fake):
    compile_fake(1)
    os.chmod(fake.writable, 0o777)
    before = sorted(p.relative_to(fake.writable) for p in fake.writable.rglob("*"))
    with pytest.raises(CacheError, match="nothing was removed"):
        quack.cache.clear(disk=True)
    assert sorted(p.relative_to(fake.writable) for p in fake.writable.rglob("*")) == before


def test_cli_clear_and_verify_leave_foreign_files(fake, capsys):
    fake.writable.mkdir(mode=0o700)
    files = _home_like(fake.writable)
    compile_fake(3)
    assert cli.main(["verify"]) == 0
    assert cli.main(["clear"]) == 0
    capsys.readouterr()
    assert {n: (fake.writable / n).read_bytes() for n in files} == files


# --- private files whatever the umask; the whole path checked ----------------------------------

def test_entries_are_private_whatever_the_umask(fake):
    old = os.umask(0)
    try:
        compile_fake(4)
    finally:
        os.umask(old)
    obj, side = _entry(fake.writable, 4)
    assert stat.S_IMODE(fake.writable.stat().st_mode) == 0o700
    assert stat.S_IMODE(obj.parent.stat().st_mode) == 0o700
    assert stat.S_IMODE(obj.stat().st_mode) == 0o600 and stat.S_IMODE(side.stat().st_mode) == 0o600


def test_missing_parents_of_the_writable_layer_are_created_private(fake, monkeypatch):
    deep = fake.tmp / "a" / "b" / "cache"
    monkeypatch.setenv("QUACK_CACHE_DIR", str(deep))
    old = os.umask(0)
    try:
        compile_fake(4)
    finally:
        os.umask(old)
    assert [stat.S_IMODE(p.stat().st_mode) for p in (fake.tmp / "a", fake.tmp / "a" / "b", deep)] == [0o700] * 3


@pytest.fixture
def traversable(fake, monkeypatch):
    """A writable layer that a second user can reach (its folders are 0711 up from /tmp):
    whether they can change an entry then depends on the cache's own folder and files."""
    base = Path(tempfile.mkdtemp(prefix="quack-hostile-", dir="/tmp"))
    os.chmod(base, 0o711)
    layer = base / "cache"
    layer.mkdir(mode=0o711)
    os.chmod(layer, 0o711)
    monkeypatch.setenv("QUACK_CACHE_DIR", str(layer))
    yield layer
    shutil.rmtree(base, ignore_errors=True)


def _forge_as(uid, obj, side, payload):
    """As user ``uid`` (a forked child), replace an entry's object with ``payload``
    and write a self-consistent sidecar for it."""
    meta = json.loads(side.read_text())
    meta.update(size=len(payload), sha256=hashlib.sha256(payload).hexdigest())
    body = {k: v for k, v in meta.items() if k != "integrity"}
    meta["integrity"] = hashlib.sha256(canonical_json(body).encode()).hexdigest()
    pid = os.fork()
    if pid == 0:  # the other user
        code = 2
        try:
            os.setgid(uid)
            os.setuid(uid)
            code = 1
            for path, data in ((obj, payload), (side, json.dumps(meta).encode())):
                tmp = path.with_name(path.name + ".forged")
                tmp.write_bytes(data)
                os.replace(tmp, path)
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    if code == 2:
        pytest.skip(f"cannot become uid {uid} here (a user namespace without it?)")
    assert code == 0, "the second user could not write the entry"


@needs_root
def test_another_users_entry_in_a_group_writable_folder_is_never_loaded(traversable, monkeypatch, capsys):
    compile_fake(5)
    obj, side = _entry(traversable, 5)
    os.chmod(obj.parent, 0o777)  # as an older version left it under umask 000
    _forge_as(NOBODY, obj, side, b"\xcc" * 4096)
    assert obj.stat().st_uid == NOBODY
    quack.cache.clear()
    monkeypatch.setenv("QUACK_CACHE_STRICT", "1")
    with pytest.raises(CacheError, match="writable by group or others|owned by uid 65534"):
        compile_fake(5)
    assert cli.main(["verify", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["bad"] and "65534" in report["bad"][0]["problem"]


@needs_root
def test_another_users_file_in_a_private_folder_is_a_bad_entry_and_heals(traversable, caplog):
    compile_fake(6)
    obj, side = _entry(traversable, 6)
    os.chmod(obj.parent, 0o777)
    _forge_as(NOBODY, obj, side, fake_kernel.payload("x"))
    os.chmod(obj.parent, 0o700)  # folder private again, the foreign files stay
    quack.cache.clear()
    fake_kernel.LOADS.clear()
    with caplog.at_level(logging.WARNING, logger="quack.cache"):
        compile_fake(6)
    assert "owned by uid 65534" in caplog.text and quack.cache.stats()["compiles"] == 1
    assert obj.stat().st_uid == os.getuid()  # the recompile replaced it
    assert not fake_kernel.LOADS  # nothing was loaded from the forged entry


def test_a_group_writable_family_folder_is_tightened_by_the_next_export(fake):
    compile_fake(7)
    os.chmod(fake.writable / FAMILY, 0o775)
    quack.cache.clear()
    compile_fake(8)
    assert stat.S_IMODE((fake.writable / FAMILY).stat().st_mode) == 0o700


# --- the bytes verified are the bytes loaded ----------------------------------------------------

def test_the_loaded_bytes_are_the_verified_bytes(fake, monkeypatch):
    """An install replacing the object between verification and load cannot
    hand the loader bytes nobody verified."""
    compile_fake(9)
    obj, _ = _entry(fake.writable, 9)
    real = store.read_bounded

    def read_then_swap(path, *args, **kwargs):
        data = real(path, *args, **kwargs)
        if path == obj:
            obj.write_bytes(b"\xcc" * len(data))  # another variant lands right after the hash
        return data

    monkeypatch.setattr(store, "read_bounded", read_then_swap)
    quack.cache.clear()
    fake_kernel.LOADS.clear()
    compile_fake(9)
    assert fake_kernel.LOADS and all(intact for _, intact in fake_kernel.LOADS)


# --- no hangs, bounded reads ----------------------------------------------------------------------

@pytest.mark.parametrize("which", ["object", "sidecar"])
def test_a_fifo_named_like_an_entry_is_a_bad_entry_not_a_hang(fake, monkeypatch, capsys, which):
    compile_fake(10)
    obj, side = _entry(fake.writable, 10)
    target = obj if which == "object" else side
    target.unlink()
    os.mkfifo(target, 0o600)
    quack.cache.clear()
    monkeypatch.setenv("QUACK_CACHE_STRICT", "1")
    with pytest.raises(CacheError, match="not a regular file"):
        _finishes(lambda: compile_fake(10))
    assert _finishes(lambda: cli.main(["ls"])) == 0
    _finishes(lambda: cli.main(["verify"]))
    capsys.readouterr()
    monkeypatch.delenv("QUACK_CACHE_STRICT")
    quack.cache.clear()
    _finishes(lambda: compile_fake(10))  # the recompile replaces the FIFO
    assert stat.S_ISREG(target.stat().st_mode)


@needs_root
def test_a_device_named_like_a_sidecar_is_never_read(fake, monkeypatch, capsys):
    compile_fake(11)
    _, side = _entry(fake.writable, 11)
    side.unlink()
    try:
        os.mknod(side, 0o600 | stat.S_IFCHR, os.makedev(1, 5))  # /dev/zero
    except OSError as exc:
        pytest.skip(f"mknod refused here ({exc})")
    quack.cache.clear()
    monkeypatch.setenv("QUACK_CACHE_STRICT", "1")
    with pytest.raises(CacheError, match="not a regular file"):
        _finishes(lambda: compile_fake(11))
    assert _finishes(lambda: cli.main(["ls"])) == 0
    capsys.readouterr()


def test_an_oversized_sidecar_is_refused_without_reading_it(fake, monkeypatch):
    compile_fake(12)
    _, side = _entry(fake.writable, 12)
    with open(side, "r+b") as f:
        f.truncate(64 << 20)  # sparse: large, costs no disk
    quack.cache.clear()
    monkeypatch.setenv("QUACK_CACHE_STRICT", "1")
    with pytest.raises(CacheError, match="more than the"):
        compile_fake(12)


def test_a_sidecar_naming_a_huge_object_is_refused(fake, monkeypatch):
    compile_fake(13)
    _, side = _entry(fake.writable, 13)
    meta = json.loads(side.read_text())
    meta["size"] = 1 << 40
    meta.pop("integrity")
    side.write_text(json.dumps(meta))
    quack.cache.clear()
    monkeypatch.setenv("QUACK_CACHE_STRICT", "1")
    with pytest.raises(CacheError, match="no valid object size"):
        compile_fake(13)


_HOLDER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    sys.path[:0] = [sys.argv[1]]
    from quack.cache import locks
    with locks.hold(Path(sys.argv[2]), timeout=5):
        print("held", flush=True)
        time.sleep(60)
    """
)


def test_a_lock_held_by_a_stuck_process_times_out_naming_it(fake, monkeypatch):
    compile_fake(14)
    obj, _ = _entry(fake.writable, 14)
    obj.unlink()
    obj.with_suffix(".json").unlink()  # a miss: the lookup must take the lock
    lock = obj.with_suffix(".lock")
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(REPO), str(lock)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        monkeypatch.setenv("QUACK_CACHE_LOCK_TIMEOUT", "1")
        quack.cache.clear()
        start = time.monotonic()
        with pytest.raises(locks.LockTimeout, match=rf"{lock.name}.*pid {holder.pid}"):
            _finishes(lambda: compile_fake(14))
        assert time.monotonic() - start < 10
    finally:
        holder.kill()
        holder.wait()
    quack.cache.clear()
    compile_fake(14)  # the holder is gone: the lock is free again
    assert not list((fake.writable / FAMILY).glob("*.lock")), "lock files outlive their use"


def test_a_long_wait_is_reported_once(fake, monkeypatch, caplog):
    lock = fake.tmp / "k.lock"
    monkeypatch.setattr(locks, "NOTICE_AFTER_SECONDS", 0.2)
    released = threading.Event()

    def hold_briefly():
        with locks.hold(lock, timeout=5):
            released.wait(1.0)

    thread = threading.Thread(target=hold_briefly)
    thread.start()
    time.sleep(0.05)
    with caplog.at_level(logging.WARNING, logger="quack.cache"):
        with locks.hold(lock, timeout=5):
            pass
    thread.join()
    assert caplog.text.count(f"waiting for the cache lock {lock}") == 1
    assert f"pid {os.getpid()}" in caplog.text


def test_lock_files_never_let_two_holders_in_while_clear_runs(fake):
    """Eight threads take one key's lock in turn while ``clear`` and ``prune``
    run beside them: never two holders at once, and no lock file is left."""
    compile_fake(15)
    layer = store.Layer(fake.writable, "writable", True)
    holders, worst, stop = [0], [0], threading.Event()
    guard = threading.Lock()

    def take():
        for _ in range(40):
            with store.key_lock(layer, FAMILY, "f" * 32):
                with guard:
                    holders[0] += 1
                    worst[0] = max(worst[0], holders[0])
                time.sleep(0.0005)
                with guard:
                    holders[0] -= 1

    def clean():
        while not stop.is_set():
            maintenance.clear(layer)
            maintenance.prune(layer, 0)

    cleaner = threading.Thread(target=clean)
    cleaner.start()
    threads = [threading.Thread(target=take) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    stop.set()
    cleaner.join(60)
    assert worst[0] == 1
    assert not list((fake.writable / FAMILY).glob("*.lock"))


def test_a_size_bound_does_not_rescan_the_layer_on_every_export(fake, monkeypatch):
    monkeypatch.setenv("QUACK_CACHE_MAX_SIZE", "1G")
    scans = []
    real = maintenance.scan
    monkeypatch.setattr(maintenance, "scan", lambda *a, **k: scans.append(1) or real(*a, **k))
    for n in range(20, 30):
        compile_fake(n)
    assert len(scans) == 1


def test_a_size_bound_still_evicts(fake, monkeypatch):
    monkeypatch.setenv("QUACK_CACHE_MAX_SIZE", "24K")
    for n in range(30, 45):
        compile_fake(n)
    total = sum(p.stat().st_size for p in (fake.writable / FAMILY).iterdir() if p.is_file())
    assert total <= 24 * 1024 + 4096 + 2048  # the bound, plus the entry just exported


# --- folders where entries belong -------------------------------------------------------------------

def test_a_folder_where_an_object_belongs_is_moved_aside_and_the_entry_heals(fake, caplog):
    compile_fake(16)
    obj, side = _entry(fake.writable, 16)
    obj.unlink()
    side.unlink()
    obj.mkdir()
    (obj / "kept.txt").write_text("not the cache's")
    quack.cache.clear()
    with caplog.at_level(logging.WARNING, logger="quack.cache"):
        compile_fake(16)
    assert obj.is_file() and "moved the folder" in caplog.text
    [aside] = (fake.writable / FAMILY).glob(".displaced-*")
    assert (aside / "kept.txt").read_text() == "not the cache's"
    quack.cache.clear()
    compile_fake(16)
    assert quack.cache.stats()["hits"] == {"writable": 1}


# --- a real full disk -------------------------------------------------------------------------------

def _fill(disk: Path) -> None:
    """Leave almost no room on ``disk``."""
    with open(disk / "filler", "wb", buffering=0) as f, contextlib.suppress(OSError):
        while True:
            f.write(b"\0" * 4096)


def test_a_real_full_disk_falls_back_to_the_compiled_kernel(cache_env, monkeypatch, caplog):
    from cache_fixtures.add_kernel import compile_add

    with small_tmpfs(cache_env.tmp / "disk", "size=256k") as disk:
        monkeypatch.setenv("QUACK_CACHE_DIR", str(disk / "cache"))
        compile_add(32)  # the layer and its family folder exist
        _fill(disk)
        quack.cache.clear()
        with caplog.at_level(logging.WARNING, logger="quack.cache"):
            handle = compile_add(96)
        assert type(handle._fn._fn).__name__ == "CudaDialectJitCompiledFunction"
        assert "without caching it" in caplog.text and "could not write cache entry" in caplog.text
        assert not [p for p in (disk / "cache" / "test_add").iterdir() if p.name.startswith(".")]
        quack.cache.clear()
        with compile_only_mode(), pytest.raises(CacheError, match=r"could not export .*test_add/[0-9a-f]{32}\.o"):
            compile_add(160)
