#!/usr/bin/env bash
# Checks that --config=gpu (how a GPU runner runs the tests) leaves every kernel and bundle action
# exactly as the default build has it: `bazel aquery` of both configurations must give each action
# the same key, so a GPU runner building with --config=gpu gets CI's objects from a shared cache and
# compiles nothing. The config only picks and schedules tests today; this keeps any option added
# to it later (a toolchain, an action environment variable) from re-keying the kernels.
# Usage: tools/check_gpu_config_keys.sh   (exit 0 = pass; the last line is the summary)
source "$(dirname "${BASH_SOURCE[0]}")/bazel_support/check_lib.sh"

a=$work/a
copy_checkout "$a"
query='mnemonic("QuackKernel|QuackCacheMerge|QuackCacheBundle", deps(//quack:warm_cache_bundle + //quack:warm_cache_full_bundle))'
log "aquery, default configuration and --config=gpu ($a, fresh output base)"
bzl "$a" "$work/base" aquery --output=jsonproto "$query" >"$work/default.json" 2>"$work/default.log" ||
  { cat "$work/default.log" >&2; fail "aquery failed"; }
bzl "$a" "$work/base" aquery --config=gpu --output=jsonproto "$query" >"$work/gpu.json" 2>"$work/gpu.log" ||
  { cat "$work/gpu.log" >&2; fail "aquery --config=gpu failed"; }
python3 - "$work/default.json" "$work/gpu.json" <<'PY'
import json, sys

def keys(path):
    query = json.load(open(path))
    fragments = {f["id"]: f for f in query.get("pathFragments", [])}
    def path_of(fid):
        parts = []
        while fid:
            parts.append(fragments[fid]["label"])
            fid = fragments[fid].get("parentId", 0)
        return "/".join(reversed(parts))
    artifacts = {a["id"]: path_of(a["pathFragmentId"]) for a in query.get("artifacts", [])}
    return {(a["mnemonic"], artifacts[a["primaryOutputId"]]): a["actionKey"] for a in query["actions"]}

default, gpu = keys(sys.argv[1]), keys(sys.argv[2])
if not default:
    sys.exit("FAIL: no kernel actions in the query")
changed = sorted(k for k in default if gpu.get(k) != default[k]) + sorted(set(gpu) - set(default))
for k in changed:
    print("   changed under --config=gpu: %s %s" % k)
print("gpu config keys: %s (%d kernel and bundle actions, each with the default build's key under --config=gpu)"
      % ("FAIL" if changed else "PASS", len(default)))
sys.exit(1 if changed else 0)
PY
