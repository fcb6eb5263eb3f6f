# Sourced by tools/check_bazel_incremental.sh and tools/check_bazel_determinism.sh --then-incremental
# (after check_lib.sh).  incremental_steps CHECKOUT BASE [FAMILY]: on a copy of the checkout, in
# output base BASE, checks which kernel actions (QuackKernel, one per object) a rebuild of
# //quack:warm_cache runs, reading Bazel's JSON execution log. On the CI selection:
#   1. a no-op rebuild runs none;
#   2. a GEMM test case that needs one new dense signature, then the lists' refresh
#      (tools/bazel run //tools:kernel_lists -- --update): exactly its three objects run (a dense
#      plan holds one per class of M: the default and the two split-K ones);
#   3. a test edit that needs no new kernel, then the refresh: the lists stay as they are, none runs.
# On the smoke selection (check_lib.sh's SMOKE):
#   4. a no-op rebuild runs none;
#   5. changing a shared module reruns every family's units;
#   6. changing one family's module (quack/families/<family>/op.py) reruns exactly that family's;
#   7. changing requirements_lock.txt makes a new Python environment and reruns every unit.
# FAMILY defaults to the first kernel family package; the environment made for step 7 is removed.
incremental_steps() {
  local c=$1 base=$2 families family shared step=0 old_env new_env every one result
  families=$(kernel_families "$c")
  family=${3:-$(head -n1 <<<"$families")}
  shared=$(cd "$c/quack" && ls *.py | grep -v -x __init__.py | head -n1)
  shared=${shared:-__init__.py}

  # build_and_count WHAT FLAGS...: build //quack:warm_cache with FLAGS; sets `result` to the
  # kernel actions that ran, per target ("//quack:units_<family>=N ...", sorted; empty: none).
  build_and_count() {
    local what=$1
    shift
    step=$((step + 1))
    log "step $step: $what"
    bzl "$c" "$base" build "${NOCACHE[@]}" "$@" --execution_log_json_file="$work/exec$step.json" \
      //quack:warm_cache 2>&1 | grep -E "INFO: [0-9]+ process|ERROR" >&2 || true
    result=$(python3 "$ws/tools/bazel_support/exec_log.py" "$work/exec$step.json" QuackKernel targets)
    printf '   kernel actions that ran: %s\n' "${result:-none}" >&2
  }
  expect() { [[ "$result" == "$1" ]] || fail "step $step: expected kernel actions '${1:-none}', got '${result:-none}'"; }
  # refresh_lists: the kernel lists' update command, as a developer runs it after a test edit.
  refresh_lists() {
    bzl "$c" "$base" run "${NOCACHE[@]}" //tools:kernel_lists -- --update 2>&1 | grep -E "ERROR|wrote" >&2 || true
  }
  # The environment in use: the repository's `env` link (the interpreter shim names no path).
  env_in_use() { readlink -f "$(bzl "$c" "$base" info output_base 2>/dev/null)"/external/*quack_python/env; }

  log "initial build: //quack:warm_cache (the CI selection)"
  bzl "$c" "$base" build "${NOCACHE[@]}" //quack:warm_cache
  build_and_count "no change"
  expect ""

  # A user's new test: an fp16 product with a float32 output and a column-major A, which no list
  # holds (its dense plan's three objects, one per class of M; no gradient is taken).
  cat >>"$c/tests/test_gemm.py" <<'PY'


def test_check_bazel_incremental_new_case():
    a = _randn(40, 96, dtype=torch.float16).t().contiguous().t()
    b = _randn(96, 72, dtype=torch.float16)
    _close(quack.gemm(a, b, out_dtype=torch.float32), gemm_ref(a, b, out_dtype=torch.float32))
PY
  refresh_lists
  build_and_count "a GEMM test case that needs one new signature (lists refreshed)"
  expect "//quack:units_gemm=3"

  cp -a "$c/tools/kernels" "$work/lists-before"
  sed -i 's/atol=5e-2, rtol=2e-2/atol=6e-2, rtol=2e-2/' "$c/tests/test_gemm.py"
  grep -q 'atol=6e-2' "$c/tests/test_gemm.py" || fail "the tolerance edit did not apply"
  refresh_lists
  diff -r "$work/lists-before" "$c/tools/kernels" >&2 || fail "the kernel lists changed after an edit that needs no kernel"
  build_and_count "a GEMM tolerance edit that needs no new kernel (lists refreshed, unchanged)"
  expect ""

  log "initial build: //quack:warm_cache ${SMOKE[*]}"
  bzl "$c" "$base" build "${NOCACHE[@]}" "${SMOKE[@]}" //quack:warm_cache
  build_and_count "no change" "${SMOKE[@]}"
  expect ""
  printf '\n# check_bazel_incremental %s\n' "$RANDOM$RANDOM" >>"$c/quack/$shared"
  build_and_count "edit shared module quack/$shared" "${SMOKE[@]}"
  every=$result
  [[ $(sed 's|//quack:units_\([a-z_]*\)=[0-9]*|\1|g' <<<"$every" | tr ' ' '\n') == "$families" ]] ||
    fail "step $step: expected every family's units ($(echo $families)), got '${every:-none}'"
  one=$(tr ' ' '\n' <<<"$every" | grep "^//quack:units_$family=")
  printf '\n# check_bazel_incremental %s\n' "$RANDOM$RANDOM" >>"$c/quack/families/$family/op.py"
  build_and_count "edit quack/families/$family/op.py" "${SMOKE[@]}"
  expect "$one"

  old_env=$(env_in_use)
  printf '# check_bazel_incremental %s\n' "$RANDOM$RANDOM" >>"$c/requirements_lock.txt"
  build_and_count "edit requirements_lock.txt (a new environment is made: over a minute)" "${SMOKE[@]}"
  expect "$every"
  new_env=$(env_in_use)
  [[ -n "$new_env" && "$new_env" != "$old_env" ]] || fail "the lock change did not make a new environment"
  rm -rf "$new_env" "$new_env.lock"
  log "OK: no-op none; new GEMM signature 3; test edit none; shared and lock edits $every; family edit $one"
}
