#!/usr/bin/env bash
# Regenerates requirements_lock.txt from requirements.in with pip-compile (hash-pinned, every
# transitive dependency listed). Run with the CPython 3.11 that builds use (the lock is for
# CPython 3.11 on x86-64 Linux: torch is the local CPU wheel `2.13.0+cpu`, see BUILD_ENV.md).
# pip-tools lives in a throwaway venv, so nothing is installed on the host.
set -euo pipefail
ws=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd -P)
python=${QUACK_PYTHON:-python3}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$python" -m venv "$tmp/venv"
"$tmp/venv/bin/pip" install --quiet "pip-tools==7.6.2"
cd "$ws"
"$tmp/venv/bin/pip-compile" --quiet --generate-hashes --allow-unsafe --strip-extras \
  --no-emit-index-url --no-emit-find-links --output-file=requirements_lock.txt requirements.in
echo "wrote $ws/requirements_lock.txt; rebuilds now re-create the Python environment and recompile every kernel"
