#!/usr/bin/env bash
# Regenerates requirements_lock.txt from requirements.in with pip-compile (hash-pinned, every
# transitive dependency listed). Run with the CPython 3.11 that builds use (the lock is for
# CPython 3.11 on x86-64 Linux).
#
#   tools/bazel_support/lock_requirements.sh [PIP-COMPILE OPTIONS]
#       e.g. `-P nvidia-nvjitlink==13.4.92` to move one pin (--upgrade-package)
#
# The lock is resolved from PyPI alone, without the host's pip configuration (its local wheel
# folders and indexes, which may hold files PyPI does not serve): every hash in it is then the
# sha256 of a file PyPI serves. Installing it may still take those files from the host's wheel
# folders (make_python_env.py), where their hashes match. Pins already in the lock are kept where
# they still satisfy requirements.in (pip-compile's default). Where a newer release is allowed,
# the lock may keep one that CI machines carry on disk (nvidia-nvjitlink: 13.4.92, not 13.5).
# pip-tools lives in a throwaway venv, so nothing is installed on the host.
set -euo pipefail
ws=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd -P)
python=${QUACK_PYTHON:-python3}
export PIP_CONFIG_FILE=/dev/null
unset PIP_FIND_LINKS PIP_EXTRA_INDEX_URL PIP_INDEX_URL PIP_CONSTRAINT
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$python" -m venv "$tmp/venv"
"$tmp/venv/bin/pip" install --quiet "pip-tools==7.6.2"
cd "$ws"
"$tmp/venv/bin/pip-compile" --quiet --generate-hashes --allow-unsafe --strip-extras \
  --no-emit-index-url --no-emit-find-links --output-file=requirements_lock.txt "$@" requirements.in
echo "wrote $ws/requirements_lock.txt; rebuilds now re-create the Python environment and recompile every kernel"
