# Shared by tools/check_bazel_*.sh (sourced). Each check works on throwaway copies of the checkout
# (tracked and untracked-but-not-ignored files) with their own output bases under one temp folder,
# so the developer's bazel-bin/ and output base are never touched; every Bazel server it starts is
# shut down and the folder removed on exit.

set -euo pipefail
ws=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd -P)
work=$(mktemp -d "${TMPDIR:-/tmp}/quack-bazel-check.XXXXXX")
servers=()

log() { printf '\n== %s\n' "$*" >&2; }
fail() { printf 'FAIL: %s\n' "$*" >&2; exit 1; }

cleanup() {
  local rc=$? s
  for s in ${servers[@]+"${servers[@]}"}; do
    (cd "${s%%|*}" && tools/bazel --output_base="${s##*|}" shutdown >/dev/null 2>&1) || true
  done
  chmod -R u+w "$work" 2>/dev/null || true
  rm -rf "$work"
  exit "$rc"
}
trap cleanup EXIT

# copy_checkout DEST: a copy of the checkout's files (what a fresh clone plus local edits holds).
copy_checkout() {
  local dest=$1
  mkdir -p "$dest"
  if ! git -C "$ws" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    (cd "$ws" && find . -mindepth 1 -maxdepth 1 ! -name 'bazel-*' ! -name .git -print0 |
      xargs -0 cp -a -t "$dest")
    return
  fi
  (cd "$ws" && git ls-files -z -c -o --exclude-standard |
    while IFS= read -r -d '' f; do [[ -e "$f" ]] && printf '%s\0' "$f"; done |
    xargs -0 cp -a --parents -t "$dest")
}

# bzl CHECKOUT OUTPUT_BASE ARGS...: Bazel in CHECKOUT with its own output base and no disk or
# remote cache (so every action that is not up to date really runs).
bzl() {
  local checkout=$1 base=$2
  shift 2
  servers+=("$checkout|$base")
  (cd "$checkout" && tools/bazel --output_base="$base" --max_idle_secs=600 "$@")
}
NOCACHE=(--disk_cache= --noremote_accept_cached --noremote_upload_local_results)
# The checks of the build's wiring build the smoke selection (.bazelrc, --config=smoke): every
# family's units of its smoke list (the matrices' first cases), a few kernel actions per family.
# Determinism builds the whole suite.
SMOKE=(--config=smoke)

# kernel_families CHECKOUT: the checkout's kernel family packages (quack/families/<family>/), one a line.
kernel_families() {
  local init
  for init in "$1"/quack/families/*/__init__.py; do basename "$(dirname "$init")"; done
}

# tree_digest DIR...: one line per file: sha256 and path relative to its directory.
tree_digest() {
  local d
  for d in "$@"; do
    (cd "$d" && find . -type f -print0 | LC_ALL=C sort -z | xargs -0 sha256sum |
      sed "s|  \./|  $(basename "$d")/|")
  done
}

# warm_cache_dirs CHECKOUT OUTPUT_BASE [FLAGS...]: the directories of //quack:warm_cache built
# with FLAGS, one a line.
warm_cache_dirs() {
  local bin
  bin=$(bzl "$1" "$2" info "${@:3}" bazel-bin 2>/dev/null)
  sed "s|^|$bin/|" "$bin/quack/warm_cache.dirs"
}

# count_runs EXEC_LOG MNEMONIC: how many spawns of MNEMONIC ran (not cache hits) per the JSON
# execution log (tools/bazel_support/exec_log.py); prints "count: target labels...".
count_runs() { python3 "$ws/tools/bazel_support/exec_log.py" "$1" "$2" runs; }
