"""Recording calls: ``QUACK_CACHE_RECORD=FILE`` makes any run append the
signature of each call it makes to a manifest (``quack/calls/manifest.py``),
whose format is defined here.

Recording never fails a call: a record file that cannot be read or written
is warned about once and the call goes on.  It is safe with many processes
and threads: each new line is appended under an exclusive ``flock``, as one
``write`` to a file opened ``O_APPEND``, after this process has read what was
added since it last looked (each byte of the file is read once per process),
so a line is written once.  What a process has seen is kept as one hash per
line, at most ``MAX_SEEN`` of them (a longer file may get duplicate lines,
which readers drop).  A last line cut short by a process that died mid-write
is dropped by the next recorder.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import logging
import os
import threading
from typing import Callable

from quack.cache.config import RECORD_ENV

FORMAT = "quack-calls"
VERSION = 4  # 4: gemm signatures name A's layout and their backward (3: cross_entropy's reduction)
HEADER = json.dumps({"format": FORMAT, "version": VERSION}, sort_keys=True)
# Lines of a record file a process remembers (a hash each: about 20 MB).
MAX_SEEN = 1 << 18
_CHUNK = 1 << 20  # bytes read at a time; a longer line is remembered by its first _CHUNK bytes

log = logging.getLogger("quack.manifest")
_RECORDED: set[tuple[str, object]] = set()  # (file, signature) this process has recorded there
_FAILED: set[str] = set()  # record files that could not be written (warned once)
_LOCK = threading.Lock()


class ManifestError(ValueError):
    """A manifest that cannot be read: another format or version, or a bad line."""


def is_header(line: str) -> bool:
    try:
        header = json.loads(line)
    except json.JSONDecodeError:
        return False
    return isinstance(header, dict) and header.get("format") == FORMAT and header.get("version") == VERSION


def record(sig, entry_line: Callable[[object], str]) -> None:
    """Append ``entry_line(sig)`` to the ``QUACK_CACHE_RECORD`` file, if set,
    unless it is there.  Never raises: a file that cannot be recorded to is
    warned about once and the call goes on."""
    path = os.environ.get(RECORD_ENV)
    if not path:
        return
    with _LOCK:
        if (path, sig) in _RECORDED:
            return
        _RECORDED.add((path, sig))
        try:
            _append_once(path, entry_line(sig))
        except Exception as e:  # noqa: BLE001 (whatever the file holds, the call itself must not fail)
            if path not in _FAILED:
                _FAILED.add(path)
                log.warning("%s=%s: cannot record (%s); calls are not recorded there", RECORD_ENV, path, e)


@dataclasses.dataclass
class _Seen:
    """What this process has read of one record file: up to ``offset`` (the
    end of its last complete line), a hash of each line (stripped), and
    whether those lines hold the header and any other line but comments."""

    file: tuple[int, int]  # (st_dev, st_ino): a file replaced under the same name is read again
    offset: int = 0
    lines: set[int] = dataclasses.field(default_factory=set)
    header: bool = False
    body: bool = False

    def add(self, line: bytes) -> None:
        line = line.strip()
        if not line or line.startswith(b"#"):
            return
        self.body = True
        if not self.header and FORMAT.encode() in line:
            self.header = is_header(line.decode(errors="replace"))
        if len(self.lines) < MAX_SEEN:
            self.lines.add(hash(line))


_SEEN: dict[str, _Seen] = {}  # record file -> what this process has read of it


def _append_once(path: str, line: str) -> None:
    """Append ``line`` to the record file ``path`` unless it is there, under
    an exclusive ``flock`` (the caller holds ``_LOCK``)."""
    data = line.encode()
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        seen = _read_new_lines(path, fd)
        if hash(data) in seen.lines:
            return
        if seen.header:
            out = data + b"\n"
        elif seen.body:
            raise ManifestError(f"{path}: {RECORD_ENV} names a file that is not a quack manifest")
        else:
            out = HEADER.encode() + b"\n" + data + b"\n"
        os.write(fd, out)
        for written in out.split(b"\n"):
            seen.add(written)
        seen.offset += len(out)
    finally:
        os.close(fd)


def _read_new_lines(path: str, fd: int) -> _Seen:
    """Bring what this process has seen of the locked file ``fd`` up to its
    end, reading only what was appended since; a last line cut short (a
    recorder that died mid-write) is dropped from the file."""
    st = os.fstat(fd)
    seen = _SEEN.get(path)
    if seen is None or seen.file != (st.st_dev, st.st_ino) or st.st_size < seen.offset:
        seen = _SEEN[path] = _Seen((st.st_dev, st.st_ino))
    pos, rest = seen.offset, b""
    while pos < st.st_size:
        chunk = os.pread(fd, min(_CHUNK, st.st_size - pos), pos)
        if not chunk:
            break
        *lines, rest = (rest + chunk).split(b"\n")
        for complete in lines:
            seen.add(complete)
        rest = rest[:_CHUNK]
        if lines:
            seen.offset = pos + chunk.rfind(b"\n") + 1
        pos += len(chunk)
    if seen.offset < st.st_size:
        os.ftruncate(fd, seen.offset)
    return seen
