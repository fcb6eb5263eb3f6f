"""Hostile bundles: compressed and sparse archives, oversized headers and members, too many
members, links and devices, damaged bytes. Each is refused with a short message before
anything large is read; the archives are small on disk (holes and forged headers)."""

import io
import json
import os
import random
import re
import subprocess
import sys
import tarfile
import tracemalloc
from pathlib import Path

import pytest

from cache_fixtures import fake_kernel
from cache_fixtures.env import cache_env  # noqa: F401  (fixture)
from cache_fixtures.fake_kernel import FAMILY, compile_fake
from quack.cache import bundle, maintenance
from quack.cache.bundle import BundleError, install_bundle, write_bundle
from quack.cache.store import Layer

REPO = Path(__file__).resolve().parents[1]
MiB = 1 << 20


@pytest.fixture
def good(cache_env, monkeypatch):
    """(name, bytes) of every member of a real one-entry bundle, manifest first."""
    fake_kernel.use_fakes(monkeypatch)
    src = cache_env.tmp / "src"
    monkeypatch.setenv("QUACK_CACHE_DIR", str(src))
    compile_fake(1)
    monkeypatch.setenv("QUACK_CACHE_DIR", str(cache_env.writable))
    write_bundle([src], cache_env.tmp / "good.tar")
    with tarfile.open(cache_env.tmp / "good.tar") as tar:
        return [(m.name, tar.extractfile(m).read()) for m in tar.getmembers()]


def _object_name(members):
    return next(name for name, _ in members if name.endswith(".o"))


def _header(name, size, type=tarfile.REGTYPE, **fields):
    """One ustar header block claiming ``size`` bytes of data."""
    info = tarfile.TarInfo(name)
    info.size, info.type = size, type
    for key, value in fields.items():
        setattr(info, key, value)
    return info.tobuf(tarfile.USTAR_FORMAT)


def _checksummed(header: bytearray) -> bytes:
    """A header block edited by hand, with its checksum made right again."""
    header[148:156] = b" " * 8
    header[148:155] = b"%06o\0" % sum(header)
    return bytes(header)


def _member(name, data):
    return _header(name, len(data)) + data + b"\0" * (-len(data) % 512)


def _write(path, parts):
    """An archive of byte strings and holes (an int: that many bytes never written, so a
    member can claim hundreds of MiB while the file holds a few KB)."""
    with open(path, "wb") as f:
        for part in parts:
            if isinstance(part, int):
                f.seek(part, os.SEEK_CUR)
            else:
                f.write(part)
        f.write(b"\0" * 1024)  # end of archive
    return path


def _install_refused(tmp, tar, *patterns):
    """Install ``tar``, which must be refused: returns the message and the peak of Python
    memory during the attempt; nothing may be installed or left behind."""
    into = tmp / "into"
    tracemalloc.start()
    try:
        with pytest.raises(BundleError) as caught:
            install_bundle(tar, into)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    message = str(caught.value)
    for pattern in patterns:
        assert re.search(pattern, message), message
    if into.exists():
        assert not list(into.rglob("*.o")) and not list(into.rglob("*.json"))
        assert not list(into.glob(".*")), "staging folder left behind"
    return message, peak


@pytest.mark.parametrize("compression, name", [("gz", "gzip"), ("bz2", "bzip2"), ("xz", "xz")])
def test_compressed_bundles_are_refused(good, cache_env, compression, name):
    tar = cache_env.tmp / f"b.tar.{compression}"
    with tarfile.open(tar, f"w:{compression}") as out:
        for member, data in good:
            info = tarfile.TarInfo(member)
            info.size = len(data)
            out.addfile(info, io.BytesIO(data))
    _install_refused(cache_env.tmp, tar, rf"{name}-compressed", "plain")
    assert not (cache_env.tmp / "into").exists()  # refused before the target is touched


def test_gnu_sparse_member_is_refused_before_reading(good, cache_env):
    """An old-style GNU sparse member claiming 1 TiB: the read that ended in a MemoryError."""
    header = bytearray(_header(_object_name(good), 0, tarfile.GNUTYPE_SPARSE))
    header[483:495] = tarfile.itn(1 << 40, 12, tarfile.GNU_FORMAT)  # the real size
    tar = _write(cache_env.tmp / "sparse.tar", [_member(*good[0]), _checksummed(header)])
    _, peak = _install_refused(cache_env.tmp, tar, "sparse file")
    assert peak < 16 * MiB


def test_pax_sparse_member_is_refused_before_reading(good, cache_env):
    tar = cache_env.tmp / "sparse.tar"
    with tarfile.open(tar, "w", format=tarfile.PAX_FORMAT) as out:
        for name, data in good:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            if name.endswith(".o"):
                info.pax_headers = {"GNU.sparse.map": "0,0", "GNU.sparse.realsize": str(1 << 40)}
            out.addfile(info, io.BytesIO(data))
    _, peak = _install_refused(cache_env.tmp, tar, "sparse file")
    assert peak < 16 * MiB


def test_huge_pax_header_is_refused_before_reading(good, cache_env):
    """A pax header claiming 512 MiB (a hole here; a comment in the gzip the user saw)."""
    pax = _header("././@PaxHeader", 512 * MiB, tarfile.XHDTYPE)
    tar = _write(cache_env.tmp / "pax.tar", [_member(*good[0]), pax, 512 * MiB, _member(*good[1])])
    _, peak = _install_refused(cache_env.tmp, tar, "tar headers", str(bundle.MAX_HEADER_BYTES))
    assert peak < 16 * MiB


@pytest.mark.parametrize("kind, claimed, expected", [
    ("sidecar", 64 * MiB, "more than a sidecar may have"),
    ("object", 300 * MiB, "the manifest says"),
    # Python 3.12's tarfile ends the archive at such a header: the member is then missing.
    ("sidecar", -512, r"a negative size \(-512\)|listed in the manifest, missing from the archive"),
])
def test_oversized_members_are_refused_before_reading(good, cache_env, kind, claimed, expected):
    name = next(n for n, _ in good[1:] if n.endswith(".json" if kind == "sidecar" else ".o"))
    parts = [_member(*good[0])]
    for member, data in good[1:]:
        if member != name:
            parts.append(_member(member, data))
        elif claimed < 0:  # a base-256 size field can say that
            header = bytearray(_header(name, 0))
            header[124:136] = tarfile.itn(claimed, 12, tarfile.GNU_FORMAT)
            parts.append(_checksummed(header))
        else:
            parts += [_header(name, claimed), claimed]
    tar = _write(cache_env.tmp / "big.tar", parts)
    sizes = (str(claimed),) if claimed > 0 else ()
    _, peak = _install_refused(cache_env.tmp, tar, re.escape(name), expected, *sizes)
    assert peak < 16 * MiB


def test_manifest_beyond_its_cap_is_refused_before_reading(good, cache_env):
    claimed = bundle.MAX_MANIFEST_BYTES + 1
    tar = _write(cache_env.tmp / "m.tar", [_header("manifest.json", claimed), claimed + (-claimed % 512)])
    _, peak = _install_refused(cache_env.tmp, tar, "manifest.json", str(claimed))
    assert peak < 16 * MiB


def test_manifest_must_come_first(good, cache_env):
    tar = _write(cache_env.tmp / "late.tar", [_member(n, d) for n, d in good[1:] + good[:1]])
    _install_refused(cache_env.tmp, tar, "no manifest.json as its first member")


def test_member_count_is_capped(good, cache_env, monkeypatch):
    monkeypatch.setattr(bundle, "MAX_MEMBERS", 10)
    dirs = [_header(FAMILY, 0, tarfile.DIRTYPE)] * 20  # harmless members, too many of them
    tar = _write(cache_env.tmp / "many.tar", [_member(*good[0])] + dirs + [_member(n, d) for n, d in good[1:]])
    _install_refused(cache_env.tmp, tar, "more than 10 members")


def test_messages_stay_short_with_thousands_of_offenders(good, cache_env):
    """Stray members (the user's 200,000 gave a 9.2 MB message) and members the manifest
    lists but the archive lacks: the first few are named, and how many there are."""
    stray = [_member(f"{FAMILY}/{i:032x}.o", b"x") for i in range(3000)]
    tar = _write(cache_env.tmp / "stray.tar", [_member(n, d) for n, d in good] + stray)
    message, _ = _install_refused(cache_env.tmp, tar, "3000 problems", f"{FAMILY}/{0:032x}.o", "not listed")
    assert len(message) < 1500, len(message)

    manifest = json.loads(good[0][1])
    listed = manifest["objects"][0]
    manifest["objects"] += [dict(listed, key=f"{i:032x}", file=f"{FAMILY}/{i:032x}.o",
                                 sidecar=f"{FAMILY}/{i:032x}.json") for i in range(3000)]
    tar = _write(cache_env.tmp / "missing.tar",
                 [_member("manifest.json", json.dumps(manifest).encode())] + [_member(n, d) for n, d in good[1:]])
    message, _ = _install_refused(cache_env.tmp, tar, "6000 problems", "missing from the archive")
    assert len(message) < 1500, len(message)


@pytest.mark.parametrize("type, kind", [
    (tarfile.SYMTYPE, "symbolic link"), (tarfile.LNKTYPE, "hard link"), (tarfile.CHRTYPE, "character device"),
    (tarfile.BLKTYPE, "block device"), (tarfile.FIFOTYPE, "FIFO"), (tarfile.CONTTYPE, "contiguous file"),
])
def test_links_devices_and_fifos_are_refused(good, cache_env, type, kind):
    name = _object_name(good)
    parts = [_header(name, 0, type, linkname="/etc/passwd") if n == name else _member(n, d) for n, d in good]
    tar = _write(cache_env.tmp / "odd.tar", parts)
    _install_refused(cache_env.tmp, tar, re.escape(name), kind, "not a regular file")


def test_family_directories_are_accepted_other_directories_refused(good, cache_env):
    """`tar` adds a folder member before its files when a bundle is repacked by hand."""
    parts = [_member(*good[0]), _header(FAMILY, 0, tarfile.DIRTYPE)] + [_member(n, d) for n, d in good[1:]]
    result = install_bundle(_write(cache_env.tmp / "dirs.tar", parts), cache_env.tmp / "ok")
    assert result["installed"] == 1
    parts.insert(1, _header(f"{FAMILY}/sub", 0, tarfile.DIRTYPE))
    _install_refused(cache_env.tmp, _write(cache_env.tmp / "sub.tar", parts), "sub", "unexpected bundle member")


def test_damaged_archives_are_refused_never_crash(good, cache_env):
    """Flipped bytes anywhere and truncations: installed whole, or refused with a BundleError
    (never another exception), with nothing half-installed or left behind."""
    data = b"".join(_member(n, d) for n, d in good) + b"\0" * 1024
    rng = random.Random(1234)
    outcomes = set()
    for i in range(300):
        damaged = bytearray(data)
        if i % 4 == 0:
            damaged = damaged[: rng.randrange(len(damaged))]
        else:
            for _ in range(rng.randint(1, 3)):
                if i % 4 == 1:  # anywhere
                    at = rng.randrange(len(damaged))
                else:  # early in a block: a header's name, mode, size, checksum, type
                    at = rng.randrange(0, len(damaged), 512) + rng.randrange(160)
                damaged[at % len(damaged)] ^= 1 << rng.randrange(8)
        tar = cache_env.tmp / f"d{i}.tar"
        tar.write_bytes(bytes(damaged))
        into = cache_env.tmp / f"into{i}"
        try:
            install_bundle(tar, into)
            outcomes.add("installed")
        except BundleError:
            outcomes.add("refused")
        entries = maintenance.scan(Layer(into, str(into), True)) if into.exists() else []
        assert len(entries) in (0, 1) and all(not maintenance.check(e) for e in entries)
        assert not into.exists() or not list(into.glob(".*"))
    assert outcomes == {"installed", "refused"}


def test_a_fifo_given_as_the_bundle_is_refused_not_read(cache_env, tmp_path):
    fifo = tmp_path / "b.tar"
    os.mkfifo(fifo)
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    code = ("import sys; from quack.cache.bundle import BundleError, install_bundle\n"
            "try: install_bundle(sys.argv[1], sys.argv[2])\n"
            "except BundleError as exc: print(exc)")
    done = subprocess.run([sys.executable, "-c", code, str(fifo), str(tmp_path / "into")], capture_output=True,
                          text=True, timeout=60, env=dict(os.environ, PYTHONPATH=path))
    assert done.returncode == 0 and "not a regular file" in done.stdout, done.stdout + done.stderr


def test_the_writer_keeps_to_what_an_install_reads(cache_env, monkeypatch):
    fake_kernel.use_fakes(monkeypatch)
    for n in (1, 2, 3):
        compile_fake(n)
    monkeypatch.setattr(bundle, "MAX_OBJECTS", 2)
    with pytest.raises(BundleError, match="at most 2 entries"):
        write_bundle([cache_env.writable], cache_env.tmp / "big.tar")
    assert not (cache_env.tmp / "big.tar").exists()
