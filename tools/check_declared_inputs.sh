#!/usr/bin/env bash
# Checks that every kernel action reads only its declared inputs (the stand-in for remote
# execution, which no REAPI worker installable here can show): //quack:warm_cache (the smoke
# selection, check_lib.sh) is built in a copy of the checkout (its kernel actions in persistent
# workers), then each QuackKernel action it ran (from `bazel aquery`) runs again standalone,
# outside Bazel, in a folder holding only copies of the inputs it declares and its params file,
# with exactly its environment, and its objects must be byte-identical to Bazel's. The pinned
# Python environment is the one input outside the copy: the interpreter shim finds it through its
# `env` link, by design (tools/bazel_support/run_declared_inputs.py).
# Usage: tools/check_declared_inputs.sh   (exit 0 = pass; the last line is the summary)
source "$(dirname "${BASH_SOURCE[0]}")/bazel_support/check_lib.sh"

a=$work/a
copy_checkout "$a"
log "build //quack:warm_cache ${SMOKE[*]} in $a (fresh output base)"
bzl "$a" "$work/base" build "${NOCACHE[@]}" "${SMOKE[@]}" //quack:warm_cache
bzl "$a" "$work/base" aquery "${SMOKE[@]}" --include_param_files --output=jsonproto 'mnemonic("QuackKernel", deps(//quack:warm_cache))' \
  >"$work/aquery.json" 2>/dev/null
execroot=$(bzl "$a" "$work/base" info "${SMOKE[@]}" execution_root 2>/dev/null)
log "each kernel action the build ran, standalone on copies of its declared inputs"
python3 "$ws/tools/bazel_support/run_declared_inputs.py" "$work/aquery.json" "$execroot" "$work/copies"
