# Sourced by tools/check_bazel_incremental.sh and tools/check_bazel_determinism.sh --then-incremental
# (after check_lib.sh).  incremental_steps CHECKOUT BASE [FAMILY]: on a copy of the checkout, in
# output base BASE, checks the warm_cache actions' inputs on the smoke selection (check_lib.sh's
# SMOKE), reading Bazel's JSON execution log:
#   1. a no-op rebuild runs no QuackWarmCache action;
#   2. changing one family's module (quack/families/<family>/op.py) reruns exactly that family's action;
#   3. changing a shared module reruns every family's action;
#   4. changing requirements_lock.txt makes a new Python environment and reruns every family.
# FAMILY defaults to the first kernel family package; the environment made for step 4 is removed.
incremental_steps() {
  local c=$1 base=$2 families n family shared step=0 old_env new_env
  families=$(kernel_families "$c")
  n=$(wc -w <<<"$families")
  family=${3:-$(head -n1 <<<"$families")}
  shared=$(cd "$c/quack" && ls *.py | grep -v -x __init__.py | head -n1)
  shared=${shared:-__init__.py}

  # build_and_count EXPECTED WHAT: build, then require EXPECTED QuackWarmCache runs.
  build_and_count() {
    local expected=$1 what=$2 result
    step=$((step + 1))
    log "step $step: $what (expect $expected warm_cache action(s))"
    bzl "$c" "$base" build "${NOCACHE[@]}" "${SMOKE[@]}" --execution_log_json_file="$work/exec$step.json" \
      //quack:warm_cache 2>&1 | grep -E "INFO: [0-9]+ process|ERROR" >&2 || true
    result=$(count_runs "$work/exec$step.json" QuackWarmCache)
    printf '   ran %s\n' "$result" >&2
    [[ "${result%%:*}" == "$expected" ]] || fail "step $step ($what): expected $expected runs, got $result"
  }
  # The environment in use: the repository's `env` link (the interpreter shim names no path).
  env_in_use() { readlink -f "$(bzl "$c" "$base" info output_base 2>/dev/null)"/external/*quack_python/env; }

  log "initial build: //quack:warm_cache ${SMOKE[*]}"
  bzl "$c" "$base" build "${NOCACHE[@]}" "${SMOKE[@]}" //quack:warm_cache
  build_and_count 0 "no change"
  printf '\n# check_bazel_incremental %s\n' "$RANDOM$RANDOM" >>"$c/quack/families/$family/op.py"
  build_and_count 1 "edit quack/families/$family/op.py"
  count_runs "$work/exec$step.json" QuackWarmCache | grep -q ":warm_cache_$family$" ||
    fail "the action that ran is not warm_cache_$family"
  printf '\n# check_bazel_incremental %s\n' "$RANDOM$RANDOM" >>"$c/quack/$shared"
  build_and_count "$n" "edit shared module quack/$shared"

  old_env=$(env_in_use)
  printf '# check_bazel_incremental %s\n' "$RANDOM$RANDOM" >>"$c/requirements_lock.txt"
  build_and_count "$n" "edit requirements_lock.txt (a new environment is made: over a minute)"
  new_env=$(env_in_use)
  [[ -n "$new_env" && "$new_env" != "$old_env" ]] || fail "the lock change did not make a new environment"
  rm -rf "$new_env" "$new_env.lock"
  log "OK: no-op 0, family edit 1 ($family), shared edit $n, lock edit $n warm_cache actions"
}
