"""Creates the pinned Python environment that Bazel's build actions and tests run in.

Run by the `python_env` repository rule (python_env.bzl) with the host CPython that the lock was
made for; usable by hand as well:

    python3 tools/bazel_support/make_python_env.py --lock=requirements_lock.txt --root=ROOT

It prints a JSON object: the environment's interpreter, the lock's sha256, the Python version.
The environment is ROOT/<lock sha256 prefix>-<interpreter hash prefix>, so every lock (and every
base interpreter) has its own folder and its own interpreter path. It is a venv (no system site-packages) holding exactly the hash-pinned lock, installed with
`pip install --require-hashes`. pip uses the host's configuration (its local wheel folders and
indexes) beside the indexes the lock names, so where the host carries a pinned file (the CPU torch
wheel on these machines) it comes from disk. An index the lock names whose host cannot be reached
(no route, no name) is left out of pip's command, with a notice: pip would otherwise retry it for
every package (seconds each), and the hashes pin the same files wherever pip finds them.
The environment is made once: a marker file
written last records the lock's sha256, and a later call with the same lock returns at once;
a half-made environment (no marker) is removed and made again. Concurrent calls for one environment
serialise on a lock file next to it.
"""

import argparse
import fcntl
import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import urllib.parse
import venv

MARKER = "quack-env-ready"
INDEX_OPTION = re.compile(r"^--(?:extra-)?index-url\s+(\S+)\s*$")
PROXY_VARIABLES = ("https_proxy", "HTTPS_PROXY", "http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY")


def sha256_of(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def is_ready(dest, lock_digest):
    try:
        with open(os.path.join(dest, MARKER)) as f:
            return f.read().split()[0] == lock_digest
    except (OSError, IndexError):
        return False


def run(cmd, env):
    print("+ " + " ".join(cmd), file=sys.stderr, flush=True)
    subprocess.run(cmd, env=env, check=True, stdout=sys.stderr)


def reachable(url, timeout=5.0):
    """Whether an index's host takes a connection (its name resolves, a TCP connect succeeds)."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return True  # file:// and the like: pip reads them without a network
    try:
        socket.create_connection((parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)),
                                 timeout=timeout).close()
        return True
    except OSError:
        return False


def lock_for_pip(lock, folder):
    """The lock as pip is given it: the same pins and hashes, less the index lines whose host
    cannot be reached from here (each named on stderr). Behind a proxy nothing is left out."""
    lines = open(lock).read().splitlines(keepends=True)
    if any(os.environ.get(v) for v in PROXY_VARIABLES):
        return lock
    kept = []
    for line in lines:
        match = INDEX_OPTION.match(line)
        if match and not reachable(match.group(1)):
            print("make_python_env: index %s is not reachable from here; installing from pip's other "
                  "indexes and wheel folders (every file is hash-pinned)" % match.group(1), file=sys.stderr)
            continue
        kept.append(line)
    if len(kept) == len(lines):
        return lock
    path = os.path.join(folder, os.path.basename(lock))
    with open(path, "w") as f:
        f.writelines(kept)
    return path


def create(dest, lock):
    if os.path.lexists(dest):
        shutil.rmtree(dest)
    venv.EnvBuilder(with_pip=True, symlinks=True, clear=True).create(dest)
    python = os.path.join(dest, "bin", "python3")
    env = dict(os.environ)
    # Nothing from the user's site-packages or PYTHONPATH may reach the environment.
    env.pop("PYTHONPATH", None)
    env["PYTHONNOUSERSITE"] = "1"
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    with tempfile.TemporaryDirectory() as folder:
        run([python, "-m", "pip", "install", "-qq", "--require-hashes", "--only-binary=:all:",
             "--no-warn-script-location", "-r", lock_for_pip(lock, folder)], env)
    freeze = subprocess.run([python, "-m", "pip", "freeze", "--all"], env=env, check=True,
                            capture_output=True, text=True).stdout
    with open(os.path.join(dest, "quack-env-freeze.txt"), "w") as f:
        f.write(freeze)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lock", required=True, help="hash-pinned requirements lock")
    parser.add_argument("--root", required=True, help="folder that holds the environments")
    args = parser.parse_args()

    if sys.version_info[:2] != (3, 11):
        sys.exit("make_python_env: the lock is for CPython 3.11 (cp311 wheels); this is %s. "
                 "Set QUACK_PYTHON to a CPython 3.11." % sys.version.split()[0])
    lock = os.path.abspath(args.lock)
    digest = sha256_of(lock)
    base = hashlib.sha256(os.path.realpath(sys.executable).encode()).hexdigest()
    dest = os.path.join(os.path.abspath(args.root), "%s-%s" % (digest[:16], base[:8]))
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    with open(dest + ".lock", "w") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        if not is_ready(dest, digest):
            print("make_python_env: creating %s from %s" % (dest, args.lock), file=sys.stderr)
            create(dest, lock)
            with open(os.path.join(dest, MARKER), "w") as f:
                f.write("%s %s\n" % (digest, sys.version.split()[0]))
    print(json.dumps({
        "python": os.path.join(dest, "bin", "python3"),
        "lock_sha256": digest,
        "python_version": "%d.%d.%d" % sys.version_info[:3],
    }))


if __name__ == "__main__":
    main()
