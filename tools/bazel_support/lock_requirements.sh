#!/usr/bin/env bash
# Regenerates a lock with pip-compile (hash-pinned, every transitive dependency listed). Run with
# the CPython 3.11 that builds use (the locks are for CPython 3.11 on x86-64 Linux).
#
#   tools/bazel_support/lock_requirements.sh         requirements.in -> requirements_lock.txt
#       (torch is the CPU build `2.13.0+cpu`, served by PyTorch's CPU wheel index, which
#       requirements.in names; the host's pip configuration may serve it from disk)
#   tools/bazel_support/lock_requirements.sh --gpu   requirements_gpu.in -> requirements_lock_gpu.txt
#       (PyPI's torch, built with CUDA, and its CUDA wheels; resolved from PyPI alone, without the
#       host's pip configuration, whose wheel folder would offer the CPU build)
#
# pip-tools lives in a throwaway venv, so nothing is installed on the host.
set -euo pipefail
ws=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd -P)
python=${QUACK_PYTHON:-python3}
src=requirements.in lock=requirements_lock.txt
if [[ "${1:-}" == --gpu ]]; then
  src=requirements_gpu.in lock=requirements_lock_gpu.txt
  export PIP_CONFIG_FILE=/dev/null
  unset PIP_FIND_LINKS PIP_EXTRA_INDEX_URL PIP_INDEX_URL PIP_CONSTRAINT
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$python" -m venv "$tmp/venv"
"$tmp/venv/bin/pip" install --quiet "pip-tools==7.6.2"
cd "$ws"
"$tmp/venv/bin/pip-compile" --quiet --generate-hashes --allow-unsafe --strip-extras \
  --no-emit-index-url --no-emit-find-links --output-file="$lock" "$src"
# The lock names the indexes of its .in file (not this machine's pip configuration), after
# pip-compile's header: every pinned file is then served by PyPI or by an index the lock names.
python3 - "$src" "$lock" <<'PY'
import re, sys
src, lock = sys.argv[1:]
indexes = [l for l in open(src).read().splitlines() if re.match(r"--(extra-)?index-url ", l)]
lines = open(lock).read().splitlines(keepends=True)
first = next(i for i, line in enumerate(lines) if not line.startswith("#"))  # after the header
open(lock, "w").writelines(lines[:first] + [i + "\n" for i in indexes] + lines[first:])
PY
echo "wrote $ws/$lock; rebuilds now re-create that Python environment (and, for requirements_lock.txt, recompile every kernel)"
