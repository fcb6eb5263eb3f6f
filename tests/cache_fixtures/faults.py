"""Real fault injection for the cache tests: a small tmpfs, where this machine allows one."""

import contextlib
import os
import subprocess
from pathlib import Path

import pytest


@contextlib.contextmanager
def small_tmpfs(path: Path, options: str):
    """A real tmpfs mounted at ``path`` with mount ``options`` (``size=256k``...): root only,
    skipped with the reason where mounting is refused (Bazel's sandbox, a container)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    path.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"{options},mode=0700", "tmpfs", str(path)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"mount refused here: {done.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)
