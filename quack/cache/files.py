"""File access the cache trusts: bounded reads of regular files, private folders.

Objects are native code loaded into the process, so what the cache reads
must be a regular file of a known size (a FIFO would block the read forever,
a device would never end), and in the writable layer every folder and file
on an entry's path must be the user's own and writable by nobody else.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from .errors import CacheError

# A sidecar is a few kilobytes; anything larger is not one.
MAX_SIDECAR_BYTES = 1 << 20
# An exported kernel object is well under this.
MAX_OBJECT_BYTES = 256 << 20


class UnsafeFile(CacheError):
    """A file or folder the cache must not read or use; the message says why."""


def ownership_problem(st: os.stat_result, what: str) -> str:
    """Why a file or folder with status ``st`` is not private to this user (``""``: it is)."""
    if st.st_uid != os.getuid():
        return f"{what} is owned by uid {st.st_uid}, not {os.getuid()}"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"{what} is writable by group or others (mode {stat.S_IMODE(st.st_mode):o})"
    return ""


def read_bounded(path: Path, limit: int, *, private: bool = False, expected_size: int | None = None) -> bytes:
    """The bytes of the regular file at ``path``, at most ``limit`` of them.

    Never blocks on a FIFO and never reads a device. ``private``: the file must
    be this user's and writable by nobody else. ``expected_size``: the size
    its sidecar records (checked before reading). Raises ``UnsafeFile`` for
    any of these, ``OSError`` where the file cannot be opened.
    """
    st = os.stat(path)
    if not stat.S_ISREG(st.st_mode):
        raise UnsafeFile(f"{path.name} is not a regular file")
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)  # the file actually opened
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeFile(f"{path.name} is not a regular file")
        if private:
            problem = ownership_problem(st, path.name)
            if problem:
                raise UnsafeFile(problem)
        if st.st_size > limit:
            raise UnsafeFile(f"{path.name} is {st.st_size} bytes, more than the {limit} allowed")
        if expected_size is not None and st.st_size != expected_size:
            raise UnsafeFile(f"{path.name} is {st.st_size} bytes, its sidecar says {expected_size} (truncated?)")
        chunks, left = [], limit + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        data = b"".join(chunks)
    finally:
        os.close(fd)
    if len(data) > limit:
        raise UnsafeFile(f"{path.name} grew past the {limit} bytes allowed while it was read")
    return data


def private_folder(path: Path) -> Path:
    """Create ``path`` (one level) as a folder only this user can use, or check
    the existing one: a real folder (not a symlink), ours; group or world
    write permission on our own folder is removed (older versions created
    folders with the umask). Raises ``UnsafeFile`` otherwise."""
    try:
        path.mkdir(mode=0o700)
        os.chmod(path, 0o700)  # the umask may have taken bits mkdir asked for
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeFile(f"{path} is not a folder (a symlink or a file where the cache keeps its entries)")
    if st.st_uid != os.getuid():
        raise UnsafeFile(f"{path} is owned by uid {st.st_uid}, not {os.getuid()}")
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.chmod(path, 0o700, follow_symlinks=False)
    return path
