"""Creates the pinned Python environment that Bazel's build actions and tests run in.

Run by the `python_env` repository rule (python_env.bzl) with the host CPython that the lock was
made for; usable by hand as well:

    python3 tools/bazel_support/make_python_env.py --lock=requirements_lock.txt --root=ROOT

It prints a JSON object: the environment's interpreter, the lock's sha256, the Python version.
The environment is ROOT/<lock sha256 prefix>-<interpreter hash prefix>, so every lock (and every
base interpreter) has its own folder and its own interpreter path. It is a venv (no system
site-packages) holding exactly the hash-pinned lock, installed with `pip install --require-hashes`.
pip uses the host's configuration (its local wheel folders and indexes) beside PyPI, so where the
host carries a pinned file (the CUDA torch and nvidia-* wheels on these machines) it comes from
disk: the hashes pin the same files wherever pip finds them.
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
import shutil
import subprocess
import sys
import venv

MARKER = "quack-env-ready"


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
    run([python, "-m", "pip", "install", "-qq", "--require-hashes", "--only-binary=:all:",
         "--no-warn-script-location", "-r", lock], env)
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
