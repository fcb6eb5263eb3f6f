"""Checks that the lock installs from PyPI alone, as a stranger's pip would see it (CI).

    python3 tools/bazel_support/check_lock.py [requirements_lock.txt]

1. The lock names no index or wheel folder: everything comes from PyPI.
2. Each pin is looked up on PyPI (its JSON simple index, https://pypi.org/simple/<name>/): every
   one of its hashes must be the sha256 of a file PyPI serves for that version, so no other file
   (a local build of the same version, say) can pass `--require-hashes`.
3. The lock goes through `PIP_CONFIG_FILE=/dev/null pip install --dry-run --ignore-installed
   --require-hashes --only-binary=:all: --no-cache-dir` (no local wheel folders, indexes or
   constraints): it must pass. pip downloads every file to check its hash (about 3 GB with
   torch's CUDA wheels; under a minute on CI's machines) and keeps none of them.
Exit 0 when all three hold; the last line is the summary.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)")
HASH = re.compile(r"--hash=sha256:([0-9a-f]{64})")
SOURCE_OPTION = re.compile(r"^\s*(--(?:extra-)?index-url|--find-links|-[if])\b")


def pins(lock_text: str) -> list[tuple[str, str, set[str]]]:
    """(name, version, sha256s) for each pin of a pip-compile lock."""
    found = []
    for block in re.split(r"\n(?=[A-Za-z0-9])", lock_text):
        match = PIN.match(block)
        if match:
            found.append((match.group(1), match.group(2), set(HASH.findall(block))))
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
            return {}
        raise
    return {f["hashes"]["sha256"]: _version_of(f["filename"]) for f in project.get("files", [])
            if "sha256" in f.get("hashes", {})}


def _version_of(filename: str) -> str:
    """The version in a wheel's or an sdist's file name."""
    if filename.endswith(".whl"):
        return filename.split("-")[1]
    stem = re.sub(r"\.(tar\.gz|tar\.bz2|zip)$", "", filename)
    return stem.rsplit("-", 1)[-1]


def foreign_hashes(name: str, version: str, hashes: set[str]) -> set[str]:
    """The pin's hashes that are not files PyPI serves for that version."""
    files = pypi_files(name)
    return {h for h in hashes if files.get(h) != version}


def main(argv: list[str]) -> int:
    lock = Path(argv[1] if len(argv) > 1 else "requirements_lock.txt")
    text = lock.read_text()
    ok = True
    sources = [line.strip() for line in text.splitlines() if SOURCE_OPTION.match(line)]
    for line in sources:
        print(f"FAIL: the lock names another source of files: {line}")
        ok = False
    found = pins(text)
    if not found:
        print("FAIL: no pins in the lock")
        ok = False
    for name, version, hashes in found:
        if not hashes:
            print(f"FAIL: {name}=={version} has no hash")
            ok = False
        elif foreign := foreign_hashes(name, version, hashes):
            print(f"FAIL: {name}=={version}: {len(foreign)} of its {len(hashes)} hashes are no file PyPI "
                  f"serves for {version}: {', '.join(sorted(foreign))}")
            ok = False
    if ok:
        ok = _pip_dry_run(lock)
    verdict = "PASS (every hash a file PyPI serves; a stranger's pip installs them)" if ok else "FAIL"
    print(f"lock {lock.name}: {len(found)} pins: {verdict}")
    return 0 if ok else 1


def _pip_dry_run(lock: Path) -> bool:
    """Step 3: a stranger's pip (no configuration, PyPI only) installs the lock."""
    env = dict(os.environ, PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1")
    for variable in ("PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL", "PIP_INDEX_URL", "PIP_CONSTRAINT"):
        env.pop(variable, None)
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--require-hashes",
         "--only-binary=:all:", "--no-cache-dir", "--quiet", "-r", str(lock)],
        env=env, capture_output=True, text=True,
    )
    ok = done.returncode == 0
    print("pip --dry-run --require-hashes without local configuration: " + ("OK" if ok else "FAILED"))
    if not ok:
        print(done.stdout + done.stderr)
    return ok


if __name__ == "__main__":
    sys.exit(main(sys.argv))
