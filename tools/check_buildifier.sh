#!/usr/bin/env bash
# buildifier over the checkout's BUILD, .bazel and .bzl files: formatting and lint warnings.
#
#   tools/check_buildifier.sh         check (CI); exit 0 = clean
#   tools/check_buildifier.sh --fix   rewrite the files' formatting in place (lint is still reported)
#
# The binary is the npm registry's @bazel/buildifier (its package carries buildifier's static
# binaries), pinned by version and by the sha256 of the linux_amd64 binary; it is unpacked once
# under ${XDG_CACHE_HOME:-~/.cache}/quack-bazel/buildifier-<version>/.
set -euo pipefail
ws=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)
version=8.2.1
sha256=6ceb7b0ab7cf66fceccc56a027d21d9cc557a7f34af37d2101edb56b92fcfa1a
dir=${XDG_CACHE_HOME:-$HOME/.cache}/quack-bazel/buildifier-$version
bin=$dir/buildifier-linux_amd64

[[ "$(uname -sm)" == "Linux x86_64" ]] || { echo "check_buildifier: pinned for Linux x86_64 only" >&2; exit 2; }
if ! echo "$sha256  $bin" | sha256sum --check --status 2>/dev/null; then
  command -v npm >/dev/null || { echo "check_buildifier: needs npm (the binary comes from @bazel/buildifier)" >&2; exit 2; }
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  (cd "$tmp" && npm pack --silent "@bazel/buildifier@$version" >/dev/null && tar -xzf bazel-buildifier-"$version".tgz)
  echo "$sha256  $tmp/package/buildifier-linux_amd64" | sha256sum --check --status ||
    { echo "check_buildifier: @bazel/buildifier@$version's linux_amd64 binary does not match its pinned sha256" >&2; exit 1; }
  mkdir -p "$dir"
  install -m 0755 "$tmp/package/buildifier-linux_amd64" "$bin"
fi

cd "$ws"
mapfile -t files < <(git ls-files -- '*.bazel' '*.bzl' 'BUILD' 'WORKSPACE')
mode=check
[[ "${1:-}" == --fix ]] && mode=fix
if "$bin" --mode="$mode" --lint=warn "${files[@]}"; then
  echo "buildifier $version: ${#files[@]} files formatted and lint-clean"
else
  echo "buildifier $version: FAIL (run tools/check_buildifier.sh --fix for the formatting)"
  exit 1
fi
