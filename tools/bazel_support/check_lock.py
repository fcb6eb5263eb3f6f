"""Checks that the lock installs from public indexes, as a stranger's pip would see it (CI).

    python3 tools/bazel_support/check_lock.py [--hashes-only] [requirements_lock.txt]

1. Each pin is looked up on PyPI (its JSON simple index, https://pypi.org/simple/<name>/): it
   is PyPI's when one of the lock's hashes for it is the sha256 of a file PyPI serves.
2. The PyPI pins, as a lock of their own, go through
   `PIP_CONFIG_FILE=/dev/null pip install --dry-run --ignore-installed --require-hashes
   --only-binary=:all:` (no local wheel folders, indexes or constraints): it must pass.
3. Every other pin must come from an index the lock names (`--extra-index-url`); those are
   listed as unchecked, with whether their index is reachable from here.

`--hashes-only` skips step 2 (which downloads every file to check its hash): for the GPU lock,
whose CUDA wheels are several GB; step 1 still requires every hash PyPI's.
Exit 0 when 2 passes and 3 holds; the last line is the summary.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_python_env import INDEX_OPTION, reachable  # noqa: E402

PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)")
HASH = re.compile(r"--hash=sha256:([0-9a-f]{64})")


def pins(lock_text: str) -> list[tuple[str, str, set[str], str]]:
    """(name, version, sha256s, the pin's lines) for each pin of a pip-compile lock."""
    found = []
    for block in re.split(r"\n(?=[A-Za-z0-9])", lock_text):
        match = PIN.match(block)
        if match:
            found.append((match.group(1), match.group(2), set(HASH.findall(block)), block.rstrip("\n") + "\n"))
    return found


def pypi_files(name: str) -> dict[str, str]:
    """sha256 -> version of every file PyPI serves for a project (empty when it has none)."""
    request = urllib.request.Request(
        f"https://pypi.org/simple/{name}/", headers={"Accept": "application/vnd.pypi.simple.v1+json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            project = json.load(response)
    except urllib.error.HTTPError as e:
        if e.code == 404:
            return set()
        raise
    return {f["hashes"]["sha256"]: _version_of(f["filename"]) for f in project.get("files", [])
            if "sha256" in f.get("hashes", {})}


def _version_of(filename: str) -> str:
    """The version in a wheel's or an sdist's file name."""
    if filename.endswith(".whl"):
        return filename.split("-")[1]
    stem = re.sub(r"\.(tar\.gz|tar\.bz2|zip)$", "", filename)
    return stem.rsplit("-", 1)[-1]


def main(argv: list[str]) -> int:
    hashes_only = "--hashes-only" in argv
    args = [a for a in argv[1:] if a != "--hashes-only"]
    lock = Path(args[0] if args else "requirements_lock.txt")
    text = lock.read_text()
    indexes = [m.group(1) for m in map(INDEX_OPTION.match, text.splitlines()) if m]
    on_pypi, elsewhere, wrong = [], [], []
    for name, version, hashes, lines in pins(text):
        files = pypi_files(name)
        if hashes & files.keys():
            on_pypi.append((name, version, lines))
        elif version in files.values():
            wrong.append(f"{name}=={version}")  # PyPI serves this release, but no file the lock allows
        else:
            elsewhere.append((name, version, lines))

    if hashes_only:
        ok = bool(on_pypi)
        print(f"{len(on_pypi)} pins hosted on PyPI (a file PyPI serves among each one's hashes; pip's dry run skipped)")
    else:
        ok = _pip_dry_run(on_pypi)
    for name, version, _ in elsewhere:
        where = ", ".join(f"{url} ({'reachable' if reachable(url) else 'not reachable from here'})" for url in indexes)
        print(f"unchecked (not on PyPI): {name}=={version}, from the lock's index: {where or 'NONE'}")
    if wrong:
        print(f"FAIL: PyPI serves {', '.join(wrong)}, but none of the files the lock's hashes allow")
        ok = False
    if elsewhere and not indexes:
        print("FAIL: pins PyPI does not host, and the lock names no index that serves them")
        ok = False
    print(f"lock {lock.name}: {'PASS' if ok else 'FAIL'} ({len(on_pypi)} checked against PyPI, "
          f"{len(elsewhere)} unchecked)")
    return 0 if ok else 1


def _pip_dry_run(on_pypi) -> bool:
    """Step 2: a stranger's pip (no configuration, PyPI only) resolves the PyPI pins."""
    with tempfile.TemporaryDirectory() as folder:
        subset = Path(folder, "pypi_pins.txt")
        subset.write_text("".join(lines for _, _, lines in on_pypi))
        env = dict(os.environ, PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1")
        env.pop("PIP_FIND_LINKS", None)
        env.pop("PIP_EXTRA_INDEX_URL", None)
        done = subprocess.run(
            [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--require-hashes",
             "--only-binary=:all:", "--quiet", "-r", str(subset)],
            env=env, capture_output=True, text=True,
        )
    ok = done.returncode == 0 and bool(on_pypi)  # none found on PyPI: the lookup is broken
    print(f"{len(on_pypi)} pins hosted on PyPI: pip --dry-run --require-hashes without local configuration: "
          + ("OK" if ok else "FAILED"))
    if not ok:
        print(done.stdout + done.stderr)
    return ok


if __name__ == "__main__":
    sys.exit(main(sys.argv))
