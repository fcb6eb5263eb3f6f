"""Per-key file locks: one writer per cache entry across processes and threads.

A key's lock is ``<layer>/<family>/<keyhash>.lock``, locked with ``flock``
(per open file, so two threads of one process exclude each other too). The
file exists only while someone holds or waits for it: the holder unlinks it
before releasing. That is safe because a process that got the lock checks,
once it holds it, that the path still names the file it locked; a waiter that
was queued on an unlinked file sees the mismatch and starts again on the new
one. So no lock file outlives its use, and removing one never lets two
holders in.

Waits are bounded: a lock held longer than ``QUACK_CACHE_LOCK_TIMEOUT``
seconds raises ``LockTimeout`` naming the file and the holder's pid (written
into the file), and a wait longer than a few seconds is logged once, saying
what it waits for.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import time
from pathlib import Path
from typing import Callable, Iterator

from .errors import CacheError

log = logging.getLogger("quack.cache")

# A wait longer than this is logged (once per wait).
NOTICE_AFTER_SECONDS = 5.0


class LockTimeout(CacheError):
    """Another process held a key's lock for longer than the configured timeout."""


def _open_locked(path: Path) -> int | None:
    """Open ``path`` (created private) and lock it without blocking; the open
    descriptor when the lock is ours and ``path`` still names the locked file,
    else None."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    try:
        same = os.path.samestat(os.fstat(fd), os.stat(path, follow_symlinks=False))
    except FileNotFoundError:
        same = False  # unlinked by the holder that released it: start again
    if not same:
        os.close(fd)
        return None
    return fd


def _holder(path: Path) -> str:
    """The pid the current holder wrote into the lock file, as text for a message."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return "unknown"
    try:
        text = os.read(fd, 32).decode("ascii", "replace").strip()
    finally:
        os.close(fd)
    return f"pid {text}" if text.isdigit() else "unknown"


def _announce(fd: int) -> None:
    """Write our pid into the lock file, for the messages of those waiting."""
    with contextlib.suppress(OSError):
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())


def _release(fd: int, path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    os.close(fd)


@contextlib.contextmanager
def hold(path: Path, timeout: float, prepare: Callable[[], None] = lambda: None) -> Iterator[None]:
    """Hold the lock at ``path`` for the ``with`` block.

    ``prepare()`` runs before each attempt (it creates the folder, which a
    concurrent ``clear`` may have emptied). Raises ``LockTimeout`` after
    ``timeout`` seconds; ``OSError`` where no lock file can be made (full
    disk, read-only file system).
    """
    start = time.monotonic()
    noticed = False
    pause = 0.001
    while True:
        prepare()
        fd = _open_locked(path)
        if fd is not None:
            break
        waited = time.monotonic() - start
        if waited > timeout:
            raise LockTimeout(
                f"gave up after {timeout:g} s waiting for the cache lock {path}, held by {_holder(path)}; "
                "if that process is stuck, stop it (or raise QUACK_CACHE_LOCK_TIMEOUT)"
            )
        if waited > NOTICE_AFTER_SECONDS and not noticed:
            noticed = True
            log.warning("waiting for the cache lock %s, held by %s (another process is exporting this kernel)",
                        path, _holder(path))
        time.sleep(pause)
        pause = min(pause * 2, 0.05)
    try:
        _announce(fd)
        yield
    finally:
        _release(fd, path)


def held(path: Path) -> bool:
    """Whether another process holds the lock at ``path``, probed without
    creating it (a missing lock: nobody does), unlike ``try_hold``: a
    staging folder's cleanup must not make a lock in a folder it removes."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


@contextlib.contextmanager
def try_hold(path: Path) -> Iterator[bool]:
    """The lock at ``path`` without waiting: yields False while another holds it.

    Yields True without a lock where no lock file can be created (a read-only
    folder: nobody can hold it there either).
    """
    try:
        fd = _open_locked(path)
    except OSError as exc:
        if exc.errno in (errno.EEXIST, errno.ELOOP):
            yield False  # a symlink where the lock belongs: not ours to use
            return
        yield True
        return
    if fd is None:
        yield False
        return
    try:
        yield True
    finally:
        _release(fd, path)
