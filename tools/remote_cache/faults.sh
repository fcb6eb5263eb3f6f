#!/usr/bin/env bash
# Fault-injection helpers for a store of tools/remote_cache/server.sh (used by
# tools/check_remote_cache.sh). The other faults are server options: `server.sh stop` (server
# down), `server.sh start ... --limit-rate 20k` (slow responses), `--max-rps 1r/m` (requests
# wait in a queue, longer than --remote_timeout).
#
#   tools/remote_cache/faults.sh corrupt STORE FILE...   # garble the CAS blob holding each FILE
#   tools/remote_cache/faults.sh verify STORE            # every CAS blob's sha256 == its name
#
# corrupt: the blob of FILE is STORE/cache/cas/<sha256 of FILE>; its bytes are inverted in place
# (same size, so only a digest check can tell). Bazel verifies the digest of every blob it
# downloads and must then fall back to running the action.
set -euo pipefail

die() { printf 'faults: error: %s\n' "$*" >&2; exit 1; }
[[ $# -ge 2 ]] || { sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
cmd=$1 store=$2
shift 2
cas=$store/cache/cas
[[ -d "$cas" ]] || die "no CAS folder $cas"

case "$cmd" in
corrupt)
  [[ $# -ge 1 ]] || die "corrupt: name at least one FILE"
  for f in "$@"; do
    sha=$(sha256sum "$f" | cut -d' ' -f1)
    blob=$cas/$sha
    [[ -f "$blob" ]] || die "no blob $blob for $f"
    python3 - "$blob" <<'PY'
import os, sys
path = sys.argv[1]
data = open(path, "rb").read()
tmp = path + ".garbage"
with open(tmp, "wb") as f:
    f.write(bytes(b ^ 0xFF for b in data))
os.replace(tmp, path)
PY
    printf '%s\n' "$blob"
  done
  ;;
verify)
  # Prints "blobs: N, bad: M" and the bad ones; exit 1 when any blob's content is not its name.
  (cd "$cas" && find . -maxdepth 1 -type f -printf '%f\n' | LC_ALL=C sort |
    xargs -r sha256sum | awk '{ n++; if ("./" $2 != "./" $1) { bad++; print "bad blob: " $2 > "/dev/stderr" } }
      END { printf "blobs: %d, bad: %d\n", n, bad; exit (bad > 0) }')
  ;;
*)
  die "unknown command $cmd (corrupt, verify)"
  ;;
esac
