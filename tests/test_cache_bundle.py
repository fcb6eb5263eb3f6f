"""Cache bundles: deterministic archives, verified and safe installs."""

import hashlib
import io
import json
import os
import tarfile
import time
from pathlib import Path

import pytest

import quack.cache
from cache_fixtures import fake_kernel
from cache_fixtures.env import cache_env, compile_count  # noqa: F401  (fixture)
from cache_fixtures.fake_kernel import FAMILY, compile_fake
from quack.cache import cli
from quack.cache.bundle import BundleError, install_bundle, write_bundle

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
        ("directory", "not a regular file"),
        ("unexpected", "unexpected bundle member"),
        ("tampered_object", "does not match the bundle manifest"),
        ("tampered_consistently", "does not match its sidecar"),
        ("no_manifest", "no manifest.json"),
        ("unlisted", "disagree"),
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
        members.append(({"name": FAMILY, "type": tarfile.DIRTYPE}, None))
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
