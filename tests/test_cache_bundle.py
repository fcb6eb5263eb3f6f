"""Cache bundles: deterministic archives, verified and safe installs."""

import fcntl
import hashlib
import io
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

import quack.cache
from cache_fixtures import fake_kernel
from cache_fixtures.env import cache_env, compile_count  # noqa: F401  (fixture)
from cache_fixtures.faults import small_tmpfs
from cache_fixtures.fake_kernel import FAMILY, compile_fake
from quack.cache import bundle, cli, maintenance
from quack.cache.bundle import BundleError, install_bundle, write_bundle
from quack.cache.key import function_prefix, key_hash
from quack.cache.store import Layer, sidecar_integrity

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def fake(cache_env, monkeypatch):
    fake_kernel.use_fakes(monkeypatch)
    yield cache_env


def _fill(env, root, ns):
    os.environ["QUACK_CACHE_DIR"] = str(root)
    for n in ns:
        compile_fake(n)
    os.environ["QUACK_CACHE_DIR"] = str(env.writable)
    quack.cache.clear()


def test_bundles_are_byte_identical(fake):
    a, b = fake.tmp / "a", fake.tmp / "b"
    _fill(fake, a, [1, 2, 3])
    _fill(fake, b, [4, 3])
    first = write_bundle([a, b], fake.tmp / "one.tar")
    # Different mtimes, modes, a lock and a stray file, other umask: the same bytes.
    for p in a.rglob("*.o"):
        os.utime(p, (time.time() - 1000, time.time() - 1000))
        p.chmod(0o600)
    (a / FAMILY / "stray.txt").write_text("ignored")
    old = os.umask(0o077)
    try:
        second = write_bundle([b, a], fake.tmp / "two.tar")
    finally:
        os.umask(old)
    assert first["objects"] == 4 and first["sha256"] == second["sha256"]
    assert (fake.tmp / "one.tar").read_bytes() == (fake.tmp / "two.tar").read_bytes()
    with tarfile.open(fake.tmp / "one.tar") as tar:
        members = tar.getmembers()
    assert members[0].name == "manifest.json"
    assert [m.name for m in members[1:]] == sorted(m.name for m in members[1:])
    assert {(m.mtime, m.uid, m.gid, m.mode, m.uname, m.gname) for m in members} == {(0, 0, 0, 0o644, "", "")}


def test_install_round_trip_then_loads(fake, capsys):
    _fill(fake, fake.writable, [1, 2])
    out = fake.tmp / "b.tar"
    assert cli.main(["bundle", "--out", str(out)]) == 0
    into = fake.tmp / "ïnstalled cache"
    assert cli.main(["install", str(out), "--into", str(into), "--json"]) == 0
    capsys.readouterr()
    assert cli.main(["install", str(out), "--into", str(into), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["already_present"] == 2
    assert into.stat().st_mode & 0o777 == 0o700
    os.environ["QUACK_CACHE_DIR"] = str(into)
    fake_kernel.LOADS.clear()
    compile_fake(1)
    compile_fake(2)
    assert quack.cache.stats()["hits"] == {"writable": 2} and all(ok for _, ok in fake_kernel.LOADS)
    assert not [p for p in into.iterdir() if p.name.startswith(".")]  # staging removed


def test_real_objects_bundle_and_install(cache_env):
    from cache_fixtures.add_kernel import compile_add

    compile_add(64)
    tar = cache_env.tmp / "real.tar"
    write_bundle([cache_env.writable], tar)
    into = cache_env.tmp / "into"
    install_bundle(tar, into)
    os.environ["QUACK_CACHE_DIR"] = str(into)
    quack.cache.clear()
    compile_add(64)
    assert quack.cache.stats()["hits"] == {"writable": 1} and compile_count(cache_env) == 1


def test_bundle_refuses_bad_entries(fake, capsys):
    _fill(fake, fake.writable, [1])
    obj = next((fake.writable / FAMILY).glob("*.o"))
    obj.write_bytes(obj.read_bytes()[:100])
    code = cli.main(["bundle", "--out", str(fake.tmp / "x.tar")])
    err = capsys.readouterr().err
    assert code == 1 and "refusing to bundle bad entries" in err and "truncated" in err
    assert not (fake.tmp / "x.tar").exists()


def _tar(path, members):
    """Write a tar of (TarInfo-kwargs, data) pairs."""
    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tar:
        for fields, data in members:
            info = tarfile.TarInfo(fields.pop("name"))
            for k, v in fields.items():
                setattr(info, k, v)
            info.size = len(data) if data is not None and info.type == tarfile.REGTYPE else 0
            tar.addfile(info, io.BytesIO(data) if data else None)


def _good_members(fake):
    _fill(fake, fake.tmp / "src", [1])
    write_bundle([fake.tmp / "src"], fake.tmp / "good.tar")
    with tarfile.open(fake.tmp / "good.tar") as tar:
        return [(m.name, tar.extractfile(m).read()) for m in tar.getmembers()]


@pytest.mark.parametrize(
    "case, message",
    [
        ("traversal", "unsafe name"),
        ("absolute", "unsafe name"),
        ("symlink", "not a regular file"),
        ("hardlink", "not a regular file"),
        ("directory", "unexpected bundle member"),
        ("unexpected", "unexpected bundle member"),
        ("tampered_object", "does not match the bundle manifest"),
        ("tampered_consistently", "does not match its sidecar"),
        ("no_manifest", "no manifest.json"),
        ("unlisted", "not listed in the manifest"),
        ("not_a_tar", "cannot read bundle"),
    ],
)
def test_install_refuses_unsafe_or_damaged_bundles(fake, capsys, case, message):
    good = _good_members(fake)
    obj_name = next(n for n, _ in good if n.endswith(".o"))
    members = [({"name": n}, d) for n, d in good]
    if case == "traversal":
        members.append(({"name": f"{FAMILY}/../../evil.o"}, b"x"))
    elif case == "absolute":
        members.append(({"name": str(fake.tmp / "evil.o")}, b"x"))
    elif case == "symlink":
        members.append(({"name": f"{FAMILY}/{'a' * 32}.o", "type": tarfile.SYMTYPE, "linkname": "/etc/passwd"}, None))
    elif case == "hardlink":
        members.append(({"name": f"{FAMILY}/{'a' * 32}.o", "type": tarfile.LNKTYPE, "linkname": obj_name}, None))
    elif case == "directory":
        members.append(({"name": f"{FAMILY}/sub", "type": tarfile.DIRTYPE}, None))
    elif case == "unexpected":
        members.append(({"name": f"{FAMILY}/run.sh"}, b"#!/bin/sh\n"))
    elif case == "tampered_object":
        members = [(f, d[:-1] + b"!" if f["name"] == obj_name else d) for f, d in members]
    elif case == "tampered_consistently":
        # A different object with a manifest that matches it: the sidecar still catches it.
        new = os.urandom(len(dict(good)[obj_name]))
        manifest = json.loads(dict(good)["manifest.json"])
        manifest["objects"][0]["sha256"] = hashlib.sha256(new).hexdigest()
        members = [(f, new if f["name"] == obj_name else
                    (json.dumps(manifest).encode() if f["name"] == "manifest.json" else d)) for f, d in members]
    elif case == "no_manifest":
        members = [(f, d) for f, d in members if f["name"] != "manifest.json"]
    elif case == "unlisted":
        members.append(({"name": f"{FAMILY}/{'b' * 32}.o"}, b"x"))
    tar = fake.tmp / "evil.tar"
    if case == "not_a_tar":
        tar.write_bytes(b"not a tar at all" * 100)
    else:
        _tar(tar, members)
    into = fake.tmp / "into"
    code = cli.main(["install", str(tar), "--into", str(into)])
    err = capsys.readouterr().err
    assert code == 1 and message in err and "Traceback" not in err, err
    assert not (fake.tmp / "evil.o").exists() and not (fake.tmp.parent / "evil.o").exists()
    assert not list(into.rglob("*.o")) if into.exists() else True
    assert not [p for p in into.iterdir() if p.name.startswith(".")] if into.exists() else True


def test_bundle_of_bazel_style_linked_directory(fake):
    """Bazel's sandbox links each file of an input directory on its own: bundling follows them."""
    real = fake.tmp / "real"
    _fill(fake, real, [1])
    linked = fake.tmp / "linked"
    (linked / FAMILY).mkdir(parents=True)
    for p in (real / FAMILY).glob("*.[oj]*"):
        (linked / FAMILY / p.name).symlink_to(p)
    a = write_bundle([real], fake.tmp / "a.tar")
    b = write_bundle([linked], fake.tmp / "b.tar")
    assert a["sha256"] == b["sha256"] and a["objects"] == 1


def test_bazel_target_is_declared():
    if not (REPO / "quack" / "BUILD.bazel").exists():
        pytest.skip("needs the checkout's Bazel files (quack/BUILD.bazel), not only the package")
    build = (REPO / "quack" / "BUILD.bazel").read_text()
    assert 'name = "warm_cache_bundle"' in build and "kernel_cache_bundle(" in build
    assert "def _kernel_cache_bundle_impl" in (REPO / "tools" / "kernel_cache.bzl").read_text()


# --- installs: all or nothing, private, never through a link -----------------------------------

def _bundle_of(fake, ns):
    """A bundle of ``compile_fake(n)`` for each n, and the folder it was made from."""
    src = fake.tmp / "src"
    _fill(fake, src, ns)
    return write_bundle([src], fake.tmp / "b.tar")["out"], src


def _entry_files(root):
    """{path under root: bytes} of every entry file (object or sidecar) in ``root``."""
    return {str(p.relative_to(root)): p.read_bytes()
            for p in sorted(root.glob("*/*")) if p.suffix in (".o", ".json") and p.is_file()}


@pytest.mark.parametrize("where", ["family", "object", "sidecar", "lock"])
def test_install_never_follows_a_link_in_the_target(fake, capsys, where):
    """A symlinked family folder sent the entries elsewhere while printing "installed 3 of 3"."""
    tar, src = _bundle_of(fake, [1])
    [obj] = (src / FAMILY).glob("*.o")
    into, elsewhere = fake.tmp / "into", fake.tmp / "elsewhere"
    into.mkdir(mode=0o700)
    elsewhere.mkdir()
    (elsewhere / "kept").write_text("not the cache's")
    if where == "family":
        (into / FAMILY).symlink_to(elsewhere)
    else:
        (into / FAMILY).mkdir(mode=0o700)
        suffix = {"object": ".o", "sidecar": ".json", "lock": ".lock"}[where]
        (into / FAMILY / obj.with_suffix(suffix).name).symlink_to(elsewhere / "kept")
    code = cli.main(["install", tar, "--into", str(into)])
    err = capsys.readouterr().err
    assert code == 1 and "is a symbolic link" in err and "Traceback" not in err, err
    assert [p.name for p in elsewhere.iterdir()] == ["kept"] and (elsewhere / "kept").read_text() == "not the cache's"
    assert not [p for p in into.rglob("*") if p.is_file() and not p.is_symlink()]
    assert not list(into.glob(".*"))


@pytest.mark.parametrize("umask", [0o000, 0o277])
def test_install_creates_everything_private_whatever_the_umask(fake, umask):
    tar, _ = _bundle_of(fake, [1, 2])
    top = fake.tmp / "new"
    old = os.umask(umask)
    try:
        result = install_bundle(tar, top / "parent" / "layer")
    finally:
        os.umask(old)
    assert result["installed"] == 2
    made = [top, *top.rglob("*")]
    files = [p for p in made if p.is_file()]
    assert {stat.S_IMODE(p.lstat().st_mode) for p in made if p.is_dir()} == {0o700}
    assert {stat.S_IMODE(p.lstat().st_mode) for p in files} == {0o600} and len(files) == 4


_KILLED_AT_FIRST_MOVE = """
import os, signal, sys
from quack.cache import bundle
os.replace = lambda *args, **kwargs: os.kill(os.getpid(), signal.SIGKILL)
bundle.install_bundle(sys.argv[1], sys.argv[2])
"""


def test_a_killed_install_leaves_staging_that_a_later_install_removes(fake):
    tar, _ = _bundle_of(fake, [1])
    into = fake.tmp / "into"
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, "-c", _KILLED_AT_FIRST_MOVE, tar, str(into)], capture_output=True,
                          text=True, timeout=120, env=dict(os.environ, PYTHONPATH=path))
    assert done.returncode == -signal.SIGKILL, done.stderr
    [killed] = into.glob(".quack-install-*")
    assert list(killed.rglob("*.o")) and not list(into.glob("*/*.o"))  # staged, never moved
    live = into / ".quack-install-live"  # an install still running: its lock is held
    live.mkdir(mode=0o700)
    lock = os.open(live / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(lock, fcntl.LOCK_EX)
    outside = fake.tmp / "outside"  # a link with a staging folder's name is not one
    outside.mkdir()
    (outside / "kept").write_text("not the cache's")
    (into / ".quack-install-link").symlink_to(outside)
    try:
        assert install_bundle(tar, into)["installed"] == 1
        assert killed.exists()  # recent: it could be an install that has not locked yet
        old = time.time() - bundle.STALE_STAGING_SECONDS - 60
        for p in (killed, live, into / ".quack-install-link"):
            os.utime(p, (old, old), follow_symlinks=False)
        assert install_bundle(tar, into)["already_present"] == 1
    finally:
        os.close(lock)
    assert not killed.exists() and live.exists()
    assert (into / ".quack-install-link").is_symlink() and (outside / "kept").exists()


_INTERRUPTED_AT_THIRD_MOVE = """
import os, signal, sys
from quack.cache import bundle
moves, real = [], os.replace
def replace(*args, **kwargs):
    real(*args, **kwargs)
    moves.append(args)
    if len(moves) == 3:
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C with one entry and a half in place
os.replace = replace
try:
    bundle.install_bundle(sys.argv[1], sys.argv[2])
except KeyboardInterrupt:
    sys.exit(130)
"""


def test_an_interrupted_install_rolls_back(fake):
    tar, _ = _bundle_of(fake, [1, 2])
    into = fake.tmp / "into"
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, "-c", _INTERRUPTED_AT_THIRD_MOVE, tar, str(into)], capture_output=True,
                          text=True, timeout=120, env=dict(os.environ, PYTHONPATH=path))
    assert done.returncode == 130, done.stderr
    assert _entry_files(into) == {} and not list(into.glob(".*"))


def test_an_entry_present_but_not_private_is_replaced(fake):
    """The cache loads only private files: an identical entry readable that way is not "present"."""
    tar, _ = _bundle_of(fake, [1])
    into = fake.tmp / "into"
    install_bundle(tar, into)
    [obj] = (into / FAMILY).glob("*.o")
    obj.chmod(0o666)
    assert install_bundle(tar, into)["installed"] == 1
    assert stat.S_IMODE(obj.stat().st_mode) == 0o600


def _in_family(obj: Path, family: str, root: Path) -> None:
    """Copy the entry of ``obj`` into ``root`` as a valid entry of another family."""
    meta = json.loads(obj.with_suffix(".json").read_text())
    meta["key"]["family"] = family
    keyhash = key_hash(meta["key"])
    meta["function_prefix"] = function_prefix(family, keyhash)
    meta["integrity"] = sidecar_integrity(meta)
    (root / family).mkdir(mode=0o700)
    (root / family / f"{keyhash}.o").write_bytes(obj.read_bytes())
    (root / family / f"{keyhash}.json").write_text(json.dumps(meta, sort_keys=True, indent=1) + "\n")


def test_a_full_disk_during_the_install_installs_nothing(fake):
    """ENOSPC for real, on tmpfs file systems with ever more inodes: whichever step runs out
    (staging, a family folder, a key lock), the install is all or nothing. One that fails
    while moving rolls back what it moved (the damaged entry it replaced comes back byte for
    byte) and says so."""
    tar, src = _bundle_of(fake, [1, 2])
    first = sorted((src / FAMILY).glob("*.o"))[0]
    _in_family(first, FAMILY + "_more", src)  # its family folder is made mid-move
    write_bundle([src], tar)
    rolled_back, installed = [], 0
    for inodes in range(2, 24):
        with small_tmpfs(fake.tmp / f"disk{inodes}", f"size=1m,nr_inodes={inodes}") as into:
            try:
                (into / FAMILY).mkdir(mode=0o700)
                (into / FAMILY / first.name).write_bytes(b"damaged")
                shutil.copy(first.with_suffix(".json"), into / FAMILY)
            except OSError:
                continue  # no room for the damaged entry itself
            before = _entry_files(into)
            try:
                install_bundle(tar, into)
            except BundleError as exc:
                assert "No space left on device" in str(exc) and _entry_files(into) == before, (inodes, str(exc))
                moved = re.search(r"rolled back (\d+)", str(exc))
                rolled_back.append(int(moved.group(1)) if moved else 0)
            else:
                entries = maintenance.scan(Layer(into, str(into), True))
                assert len(entries) == 3 and not [e for e in entries if maintenance.check(e)]
                installed += 1
            assert not list(into.glob(".quack-install-*")), inodes
    assert installed and max(rolled_back) >= 1, (installed, rolled_back)


def test_merge_writes_the_union_with_the_listing_a_warm_run_writes(fake, capsys):
    from quack.cache.folders import write_manifest

    a, b, whole = fake.tmp / "a", fake.tmp / "b", fake.tmp / "whole"
    _fill(fake, a, [1, 2])
    _fill(fake, b, [2, 3])
    _fill(fake, whole, [1, 2, 3])
    write_manifest(whole)
    merged = fake.tmp / "merged"
    assert cli.main(["merge", str(a), str(b), "--into", str(merged)]) == 0
    assert "3 entries from 2 folders" in capsys.readouterr().out
    files = lambda root: {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}  # noqa: E731
    assert files(merged) == {name: data for name, data in files(whole).items() if not name.endswith(".lock")}


def test_merge_refuses_differing_objects_of_one_key_and_a_folder_in_use(fake, capsys):
    a, b = fake.tmp / "a", fake.tmp / "b"
    _fill(fake, a, [1])
    _fill(fake, b, [1])
    (obj,) = (b / FAMILY).glob("*.o")
    obj.write_bytes(obj.read_bytes() + b"\0")
    assert cli.main(["merge", str(a), str(b), "--into", str(fake.tmp / "m")]) == 1
    assert "bad entries" in capsys.readouterr().err and not (fake.tmp / "m").exists()
    used = fake.tmp / "used"
    used.mkdir()
    (used / "notes.txt").write_text("mine")
    assert cli.main(["merge", str(a), "--into", str(used)]) == 1
    assert "not empty" in capsys.readouterr().err
    assert [p.name for p in used.iterdir()] == ["notes.txt"]
