#!/usr/bin/env bash
# Checks which Bazel tools/bazel runs, with fake Bazel binaries that only report a version, in a
# temporary workspace holding a copy of the wrapper and its own .bazelversion (nothing is
# provisioned, no Bazel runs): .bazelversion's release runs; a launcher's BAZEL_REAL of another
# version, or of none, is refused with a message unless QUACK_ALLOW_UNTESTED_BAZEL=1; a Bazel of
# another version on PATH is passed over; a .bazelversion that names no exact release, or one with
# no pinned Debian packages, stops with a message before anything is provisioned.
# Usage: tools/check_bazel_wrapper.sh   (exit 0 = pass; the last line is the summary)
set -euo pipefail
ws=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)
tmp=$(mktemp -d "${TMPDIR:-/tmp}/quack-bazel-wrapper.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
pinned=$(tr -d '[:space:]' <"$ws/.bazelversion")
mkdir -p "$tmp/ws/tools"
cp "$ws/tools/bazel" "$tmp/ws/tools/bazel"

# fake NAME VERSION_LINE: a `bazel` in $tmp/NAME/ that prints VERSION_LINE for --version and
# otherwise says what it ran.
fake() {
  mkdir -p "$tmp/$1"
  printf '#!/bin/sh\nif [ "$1" = --version ]; then echo "%s"; exit 0; fi\necho "ran %s: $*"\n' "$2" "$1" >"$tmp/$1/bazel"
  chmod +x "$tmp/$1/bazel"
}
fake pinned "bazel $pinned"
fake other "bazel 8.4.2"
fake candidate "bazel ${pinned}rc1"

failures=0
cases=0
# expect BAZELVERSION STATUS PATTERN [VAR=VALUE...]: `tools/bazel info` with that .bazelversion and
# those variables (PATH: the fakes named by FAKES, then /usr/bin:/bin) must exit with STATUS and
# print a line matching the extended regular expression PATTERN.
expect() {
  local version=$1 status=$2 pattern=$3 out rc
  shift 3
  printf '%s\n' "$version" >"$tmp/ws/.bazelversion"
  cases=$((cases + 1))
  out=$(cd "$tmp/ws" && env -u BAZEL_REAL -u QUACK_ALLOW_UNTESTED_BAZEL QUACK_BAZEL_CACHE="$tmp/cache" \
    PATH="${FAKES:+$FAKES:}/usr/bin:/bin" "$@" tools/bazel info 2>&1) && rc=0 || rc=$?
  if [[ "$rc" != "$status" ]] || ! grep -Eq -- "$pattern" <<<"$out"; then
    failures=$((failures + 1))
    printf 'FAIL: .bazelversion %s, %s: exit %s (expected %s), output:\n%s\n' "$version" "$*" "$rc" "$status" "$out"
  fi
}

FAKES=
expect "$pinned" 0 "^ran pinned: info$" BAZEL_REAL="$tmp/pinned/bazel"
expect "$pinned" 1 "error: the launcher chose .*Bazel 8\.4\.2, but \.bazelversion names" BAZEL_REAL="$tmp/other/bazel"
expect "$pinned" 1 "error: the launcher chose .*Bazel of unknown version" BAZEL_REAL="$tmp/candidate/bazel"
expect "$pinned" 0 "^ran other: info$" BAZEL_REAL="$tmp/other/bazel" QUACK_ALLOW_UNTESTED_BAZEL=1
expect "$pinned" 0 "warning: running .*Bazel 8\.4\.2" BAZEL_REAL="$tmp/other/bazel" QUACK_ALLOW_UNTESTED_BAZEL=1
expect 7.x 1 "must name one exact Bazel release"
FAKES="$tmp/other:$tmp/pinned"
expect "$pinned" 0 "^ran pinned: info$"
expect "$pinned" 0 "not using .*/other/bazel: Bazel 8\.4\.2"
FAKES="$tmp/other"
expect 9.9.9 1 "no Debian package is pinned for Bazel 9\.9\.9"
[[ ! -e "$tmp/cache" ]] || { failures=$((failures + 1)); echo "FAIL: a refused call left $tmp/cache behind"; }

if ((failures)); then
  echo "bazel wrapper: FAIL ($failures of $cases cases)"
  exit 1
fi
echo "bazel wrapper: PASS ($cases cases: .bazelversion's Bazel runs, other versions are refused or passed over)"
