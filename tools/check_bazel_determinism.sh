#!/usr/bin/env bash
# Checks that //quack:warm_cache is deterministic: built in two checkout folders (different paths
# and folder names), each in a fresh output base, every kernel object, sidecar and manifest is
# byte-identical. Build 2 uses no cache, so it executes every action; build 1 may take outputs
# from the disk cache, which only an earlier execution of the same actions can have put there
# (in CI, the main build's, a minute before): two executions are compared either way, and the
# log says how many of build 1's actions the cache served. Then WORKSPACE mode
# (--config=workspace) must build what Bzlmod builds, on the smoke selection (check_lib.sh). With --then-incremental, the incremental
# checks (tools/check_bazel_incremental.sh) follow in the second checkout's output base.
# Usage: tools/check_bazel_determinism.sh [--then-incremental]   (exit 0 when identical)
source "$(dirname "${BASH_SOURCE[0]}")/bazel_support/check_lib.sh"
source "$(dirname "${BASH_SOURCE[0]}")/bazel_support/incremental_steps.sh"
case "${1:-}" in
  "" | --then-incremental) ;;
  *) fail "unknown argument: $1 (usage: tools/check_bazel_determinism.sh [--then-incremental])" ;;
esac

a=$work/a/quack
b=$work/b/elsewhere
copy_checkout "$a"
copy_checkout "$b"

log "build 1: $a (Bzlmod, fresh output base, the disk cache allowed)"
bzl "$a" "$work/base-a" build --execution_log_json_file="$work/build1.json" //quack:warm_cache
executed=$(python3 "$ws/tools/bazel_support/exec_log.py" "$work/build1.json" QuackKernel ran)
units=$(python3 "$ws/tools/bazel_support/exec_log.py" "$work/build1.json" QuackKernel count)
printf '   kernel actions executed now: %s of %s (the rest served by the disk cache: executed earlier)\n' \
  "$executed" "$units" >&2
log "build 2: $b (Bzlmod, fresh output base, no cache: every action executes)"
bzl "$b" "$work/base-b" build "${NOCACHE[@]}" //quack:warm_cache
mapfile -t dirs_a < <(warm_cache_dirs "$a" "$work/base-a")
mapfile -t dirs_b < <(warm_cache_dirs "$b" "$work/base-b")
tree_digest "${dirs_a[@]}" >"$work/a.sha256"
tree_digest "${dirs_b[@]}" >"$work/b.sha256"
objects=$(grep -c '\.o$' "$work/a.sha256" || true)
((objects > 0)) || fail "the warm_cache outputs hold no .o files"
diff -u "$work/a.sha256" "$work/b.sha256" || fail "checkout folders differ (above)"

log "build 3: $b ${SMOKE[*]} (Bzlmod, output base of build 2)"
bzl "$b" "$work/base-b" build "${NOCACHE[@]}" "${SMOKE[@]}" //quack:warm_cache
log "build 4: $b ${SMOKE[*]} (WORKSPACE mode, fresh output base)"
bzl "$b" "$work/base-w" build --config=workspace "${NOCACHE[@]}" "${SMOKE[@]}" //quack:warm_cache
mapfile -t dirs_s < <(warm_cache_dirs "$b" "$work/base-b" "${SMOKE[@]}")
mapfile -t dirs_w < <(warm_cache_dirs "$b" "$work/base-w" --config=workspace "${SMOKE[@]}")
tree_digest "${dirs_s[@]}" >"$work/s.sha256"
tree_digest "${dirs_w[@]}" >"$work/w.sha256"
grep -q '\.o$' "$work/s.sha256" || fail "the smoke build holds no .o files"
diff -u "$work/s.sha256" "$work/w.sha256" || fail "WORKSPACE mode differs from Bzlmod (above)"
log "OK: $(wc -l <"$work/a.sha256") files ($objects objects) byte-identical across 2 checkouts, output bases and executions;" \
  "WORKSPACE mode's $(grep -c '\.o$' "$work/w.sha256") smoke objects identical to Bzlmod's"
if [[ "${1:-}" == --then-incremental ]]; then
  incremental_steps "$b" "$work/base-b"
fi
