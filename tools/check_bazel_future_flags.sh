#!/usr/bin/env bash
# Checks that the build relies on no behaviour Bazel 8 and 9 removed, with the Bazel this project
# tests (.bazelversion: 7.7.1):
# 1. every rule and provider Bazel 9 no longer predeclares is loaded by the BUILD and .bzl files
#    that use it (tools/bazel_support/check_loads.py; 7.7.1 has no flag that shows this while
#    Debian's rule sets still call the native rules);
# 2. on a copy of the checkout, in a fresh output base, --config=future (.bazelrc: the defaults
#    Bazel 8 and 9 changed, as far as 7.7.1 has the flags) builds //quack:warm_cache with the smoke
#    selection and runs one GPU test (against those objects; compile-only without a GPU) and one
#    CPU test that loads the C launcher: loading, analysis, the kernel actions, the C build and the
#    tests' runfiles all under the new defaults. The runfiles tree must show them in effect (no
#    legacy external/ links, `+` in repository names), and an edit of the Python environment's
#    script must still re-run its repository rule (Bazel 8 no longer watches path(label) files).
# The changes 7.7.1 cannot express are listed in tools/bazel_support/README.md.
# Usage: tools/check_bazel_future_flags.sh   (exit 0 = pass; the last line is the summary)
source "$(dirname "${BASH_SOURCE[0]}")/bazel_support/check_lib.sh"

log "loads of the rules and providers Bazel 9 no longer predeclares"
mapfile -t build_files < <(cd "$ws" && git ls-files -- '*.bzl' 'BUILD' '*/BUILD' 'BUILD.bazel' '*/BUILD.bazel')
(cd "$ws" && python3 tools/bazel_support/check_loads.py "${build_files[@]}") || fail "a file uses a rule or provider it does not load (above)"

targets=(//quack:warm_cache //tests:test_softmax //tests:test_fast_closures)
a=$work/a
copy_checkout "$a"
log "--config=future ${SMOKE[*]}: build and test ${targets[*]} ($a, fresh output base)"
bzl "$a" "$work/base" test --config=future "${SMOKE[@]}" "${targets[@]}" ||
  fail "the build or a test fails under --config=future (above): it relies on a default Bazel 8 or 9 changed"

runfiles=$(bzl "$a" "$work/base" info --config=future "${SMOKE[@]}" bazel-bin 2>/dev/null)/tests/test_softmax.runfiles
[[ ! -e "$runfiles/_main/external" ]] || fail "$runfiles still has the legacy _main/external/ links"
compgen -G "$runfiles/*+quack_python" >/dev/null || fail "$runfiles names no repository with a +"

log "editing make_python_env.py re-runs the environment's repository rule (no implicit watch)"
marker=$(compgen -G "$work/base/external/@*+quack_python.marker") || fail "no fetch marker of @quack_python"
before=$(stat -c %y "$marker")
echo "# edited by tools/check_bazel_future_flags.sh" >>"$a/tools/bazel_support/make_python_env.py"
bzl "$a" "$work/base" build --nobuild --config=future "${SMOKE[@]}" //quack:warm_cache
[[ "$(stat -c %y "$marker")" != "$before" ]] || fail "@quack_python was not fetched again: python_env.bzl watches no script"
flags=$(grep -c '^common:future ' "$a/.bazelrc")
echo "future flags: PASS (loads checked; ${#targets[@]} targets built and tested with the $flags flags of --config=future)"
