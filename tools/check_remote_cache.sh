#!/usr/bin/env bash
# End-to-end check of the HTTP remote cache, on a local nginx (tools/remote_cache/)
# on a loopback port with a throwaway store. Every build runs in its own copy of the checkout
# with a fresh output base and no disk cache (--disk_cache=), with --config=remote, on the smoke
# selection (check_lib.sh: a few kernel actions per family, one object each):
#
#   A  cold build of //quack:warm_cache: compiles every kernel, uploads the results;
#   B  another checkout folder: every kernel action is a remote cache hit, none runs, the objects
#      are byte-identical to A's, and B's kernel actions are at least 5x faster than A's;
#   U  another user: a fresh HOME (so its own pinned Python environment, provisioned from the
#      lock in its own cache folder) and another checkout folder: every kernel action is a remote
#      cache hit of A's upload, none runs, the objects are byte-identical (action keys name no
#      home, user, checkout or environment path);
#   C  --config=remote-ro --remote_download_toplevel: `test //tests:test_rmsnorm` (compile-only,
#      strict, against objects fetched only as the test's inputs; nothing uploaded), then
#      `build //quack:warm_cache`: hits, identical;
#   remote-execution readiness: the kernel actions' inputs, command and environment hold no
#      absolute paths, cover the package's modules and hold no test, manifest or list; no output
#      names a checkout or output base;
#   faults (skip with --no-faults), each building one family's target in a fresh output base: two
#      corrupted CAS blobs (exactly their two kernel actions run again), a slow server (within and
#      beyond --remote_timeout), the server down: each build succeeds, warns where it fell back,
#      and its objects verify against their manifest's sha256s and equal A's.
#
# Usage: tools/check_remote_cache.sh [--no-faults]     (3.5 to 5 minutes on 2 cores; exit 0 = pass)
# The last line is the summary: "remote cache: PASS ..." or "remote cache: FAIL ...".
source "$(dirname "${BASH_SOURCE[0]}")/bazel_support/check_lib.sh"

faults=1
[[ "${1:-}" == --no-faults ]] && faults=0

rc_server=$ws/tools/remote_cache/server.sh
rc_faults=$ws/tools/remote_cache/faults.sh
store=$work/store
access=$store/server/access.log
t_start=$(date +%s)
summary_done=0

# check_lib's trap shuts the Bazel servers down and removes $work; stop nginx first, and print
# the summary line on a failure too.
rc_cleanup() {
  local rc=$? keep
  "$rc_server" stop "$store" >/dev/null 2>&1 || true
  if ((rc != 0)) && compgen -G "$work/*.log" >/dev/null; then
    keep=$(mktemp -d "${TMPDIR:-/tmp}/quack-remote-cache-logs.XXXXXX")
    cp "$work"/*.log "$store/server/access.log" "$store/server/error.log" "$keep/" 2>/dev/null || true
    echo "logs kept in $keep" >&2
  fi
  ((summary_done)) || echo "remote cache: FAIL (exit $rc, after $(($(date +%s) - t_start)) s; see the output above)"
  set +e # errexit would end this handler at the next line when rc != 0
  (exit "$rc")
  cleanup
}
trap rc_cleanup EXIT

fail() { printf 'FAIL: %s\n' "$*" >&2; exit 1; }
now() { date +%s.%N; }
secs() { python3 -c "import sys; print('%.1f' % (float(sys.argv[2]) - float(sys.argv[1])))" "$1" "$2"; }

start_server() { url=$("$rc_server" start "$store" --port 0 --lifetime 900 "$@"); }
stop_server() { "$rc_server" stop "$store" 2>/dev/null; }
mark() { mark_line=$(($(wc -l <"$access" 2>/dev/null || echo 0) + 1)); }
net() { "$rc_server" stats "$store" --from "$mark_line"; }

# run_bazel NAME CHECKOUT BASE COMMAND ARGS...: Bazel with --config=${RC_CONFIG:-remote} at $url,
# no disk cache, an execution log $work/NAME.exec.json; its output goes to $work/NAME.log (the
# summary lines and warnings are echoed); sets wall (seconds) and crit (critical path).
run_bazel() {
  local name=$1 checkout=$2 base=$3 command=$4 t0 t1 status=0
  shift 4
  t0=$(now)
  bzl "$checkout" "$base" "$command" "${SMOKE[@]}" --disk_cache= --config="${RC_CONFIG:-remote}" --remote_cache="$url" \
    --execution_log_json_file="$work/$name.exec.json" "$@" >"$work/$name.log" 2>&1 || status=$?
  t1=$(now)
  wall=$(secs "$t0" "$t1")
  crit=$(sed -n 's/.*Critical Path: \([0-9.]*\)s.*/\1/p' "$work/$name.log" | tail -n1)
  grep -E '^(WARNING|ERROR)|INFO: [0-9]+ process|Critical Path|//tests:\S+ +(PASSED|FAILED)' \
    "$work/$name.log" | grep -v host_javabase | sed 's/^/   | /' | cut -c1-220 >&2 || true
  ((status == 0)) || fail "$name: bazel exited $status (log: $work/$name.log)"
}

# spawn_field NAME FIELD: of the QuackKernel spawns (one per object) in NAME's execution log: "ran" (how many
# ran: no cache hit), "hit" (remote cache hits), "count" (all), "time" (total seconds of their
# metrics); tools/bazel_support/exec_log.py reads the log.
spawn_field() { python3 "$ws/tools/bazel_support/exec_log.py" "$work/$1.exec.json" QuackKernel "$2"; }

# objects CHECKOUT BASE OUT [FAMILY]: the warm_cache outputs' digests (one family's only, when
# given) into OUT; every object and sidecar verified against the manifest's sha256 (the objects the
# build produced, not just any bytes).
objects() {
  local checkout=$1 base=$2 out=$3 family=${4:-}
  if [[ -n "$family" ]]; then
    dirs=("$(bzl "$checkout" "$base" info "${SMOKE[@]}" bazel-bin 2>/dev/null)/quack/warm_cache_$family")
  else
    mapfile -t dirs < <(warm_cache_dirs "$checkout" "$base" "${SMOKE[@]}")
  fi
  ((${#dirs[@]} > 0)) || fail "no warm_cache directories in $base"
  python3 - "${dirs[@]}" <<'PY' || fail "objects in $base do not match their manifest"
import hashlib, json, os, sys
n = 0
for d in sys.argv[1:]:
    manifest = json.load(open(os.path.join(d, "manifest.json")))
    for entry in manifest["objects"]:
        obj = os.path.join(d, entry["file"])
        digest = hashlib.sha256(open(obj, "rb").read()).hexdigest()
        sidecar = json.load(open(obj[:-2] + ".json"))
        if digest != entry["sha256"] or sidecar["sha256"] != digest or sidecar["size"] != os.path.getsize(obj):
            sys.exit("mismatch: %s" % obj)
        n += 1
    if n == 0:
        sys.exit("no objects in %s" % d)
PY
  tree_digest "${dirs[@]}" >"$out"
}

same_as_a() { # NAME DIGESTS [FAMILY]
  local ref=$work/a.sha256
  if [[ -n "${3:-}" ]]; then
    ref=$work/a-$3.sha256
    grep -F "  warm_cache_$3/" "$work/a.sha256" >"$ref"
  fi
  diff -q "$ref" "$2" >/dev/null || { diff -u "$ref" "$2" | head -20 >&2; fail "$1: objects differ from A's"; }
}

# The checkouts: A is a copy of the working tree; B and C are copies of A (so edits made to the
# working tree while this runs cannot make them differ), each in a differently named folder.
a=$work/a/quack
copy_checkout "$a"
for c in b/other c/third f/faults u/user2; do
  mkdir -p "$work/${c%%/*}"
  cp -a "$a" "$work/$c"
done
b=$work/b/other c=$work/c/third f=$work/f/faults u=$work/u/user2

log "remote cache: nginx on loopback, store $store"
start_server
echo "   url $url" >&2

# --- A: cold build, uploads ----------------------------------------------------------------------
log "A: cold build in $a (fresh output base, --disk_cache=, --config=remote)"
mark
run_bazel a "$a" "$work/base-a" build //quack:warm_cache
a_wall=$wall a_crit=$crit a_time=$(spawn_field a time) kernel_actions=$(spawn_field a count)
a_net=$(net)
[[ $(spawn_field a ran) == "$kernel_actions" && $kernel_actions -ge 1 ]] || fail "A: expected every kernel action to run"
objects "$a" "$work/base-a" "$work/a.sha256"
n_obj=$(grep -c '\.o$' "$work/a.sha256")
echo "   kernel actions $kernel_actions (ran), objects $n_obj, server: $a_net" >&2

# --- B: another checkout, all remote hits --------------------------------------------------------
log "B: $b (fresh output base, --disk_cache=, --config=remote, --remote_download_all)"
mark
run_bazel b "$b" "$work/base-b" build --remote_download_all //quack:warm_cache
b_wall=$wall b_crit=$crit b_time=$(spawn_field b time) b_hits=$(spawn_field b hit) b_ran=$(spawn_field b ran)
b_net=$(net)
# Bazel's own summary counts the kernel actions and the merges (one per family).
merges=$(python3 "$ws/tools/bazel_support/exec_log.py" "$work/a.exec.json" QuackCacheMerge count)
grep -qE "INFO: [0-9]+ processes?: .*\b$((kernel_actions + merges)) remote cache hit" "$work/b.log" ||
  fail "B: Bazel's process summary does not report $((kernel_actions + merges)) remote cache hits ($kernel_actions kernel actions, $merges merges)"
[[ "$b_ran" == 0 && "$b_hits" == "$kernel_actions" ]] || fail "B: $b_ran kernel actions ran, $b_hits remote hits (expected 0 and $kernel_actions)"
objects "$b" "$work/base-b" "$work/b.sha256"
same_as_a B "$work/b.sha256"
speedup=$(python3 -c "import sys; a, b = map(float, sys.argv[1:]); print('%.1f' % (a / max(b, 0.001)))" "$a_time" "$b_time")
python3 -c "import sys; sys.exit(float(sys.argv[1]) < 5)" "$speedup" ||
  fail "B: kernel actions only ${speedup}x faster than A (${a_time}s vs ${b_time}s)"
echo "   hits $b_hits/$kernel_actions, ran $b_ran, objects identical, kernel actions ${a_time}s -> ${b_time}s (${speedup}x), server: $b_net" >&2

# --- U: another user: its own HOME and pinned environment ----------------------------------------
# The Bazel install (tools/bazel's build root, QUACK_BAZEL_CACHE) is shared: it is the tool, not an
# input of any action. The Python environment is not: the second user provisions its own.
home_u=$work/home-u
mkdir -p "$home_u"
log "U: another user: HOME=$home_u (a fresh pinned environment), $u (fresh output base, --config=remote)"
mark
bazel_install=${QUACK_BAZEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/quack-bazel}
HOME=$home_u XDG_CACHE_HOME= QUACK_PYTHON_ENV_ROOT= QUACK_BAZEL_CACHE=$bazel_install \
  run_bazel u "$u" "$work/base-u" build --remote_download_all //quack:warm_cache
u_wall=$wall u_hits=$(spawn_field u hit) u_ran=$(spawn_field u ran)
env_a=$(readlink "$work"/base-a/external/*quack_python/env)
env_u=$(readlink "$work"/base-u/external/*quack_python/env)
[[ "$env_u" == "$home_u"/* && "$env_a" != "$env_u" ]] || fail "U: not a separate environment ($env_a, $env_u)"
[[ "$u_ran" == 0 && "$u_hits" == "$kernel_actions" ]] || fail "U: $u_ran kernel actions ran, $u_hits remote hits (expected 0 and $kernel_actions)"
objects "$u" "$work/base-u" "$work/u.sha256"
same_as_a U "$work/u.sha256"
echo "   environment $env_u (A: $env_a); hits $u_hits/$kernel_actions, ran 0, objects identical, wall ${u_wall}s; server: $(net)" >&2

# --- C: --remote_download_toplevel, the GPU test, then the objects -------------------------------
log "C: $c: test //tests:test_rmsnorm, --config=remote-ro --remote_download_toplevel (fresh output base)"
mark
RC_CONFIG=remote-ro run_bazel c-test "$c" "$work/base-c" test --remote_download_toplevel --nocache_test_results //tests:test_rmsnorm
c_test_wall=$wall
[[ $(spawn_field c-test ran) == 0 && $(spawn_field c-test hit) == "$kernel_actions" ]] ||
  fail "C: the kernel actions were not all remote hits under the test"
grep -qE '^//tests:test_rmsnorm +PASSED' "$work/c-test.log" || fail "C: //tests:test_rmsnorm did not pass"
c_test_net=$(net)
grep -q ' PUT 0 ' <<<"$c_test_net" || fail "C: --config=remote-ro uploaded ($c_test_net)"
c_pytest=$(grep -hE '^=+ .*passed.* =+$|^[0-9]+ passed' "$work"/base-c/execroot/_main/bazel-out/*/testlogs/tests/test_rmsnorm/test.log 2>/dev/null | tail -n1 || true)
log "C: build //quack:warm_cache, --config=remote-ro --remote_download_toplevel (same output base)"
mark
RC_CONFIG=remote-ro run_bazel c "$c" "$work/base-c" build --remote_download_toplevel //quack:warm_cache
[[ $(spawn_field c ran) == 0 ]] || fail "C: a kernel action ran"
objects "$c" "$work/base-c" "$work/c.sha256"
same_as_a C "$work/c.sha256"
c_net=$(net)
echo "   test PASSED ($c_pytest) in ${c_test_wall}s; server during test: $c_test_net; objects identical after build; server: $c_net" >&2

# --- remote execution readiness ------------------------------------------------------------------
log "remote execution readiness (A's execution log and outputs)"
python3 "$ws/tools/bazel_support/remote_readiness.py" "$work/a.exec.json" "$a" || fail "readiness: see above"
mapfile -t dirs_a < <(warm_cache_dirs "$a" "$work/base-a" "${SMOKE[@]}")
for p in "$a" "$work/base-a" "$work/a" "$b" "$c" "$HOME/.cache/quack-bazel"; do
  if grep -rlF -- "$p" "${dirs_a[@]}" >"$work/grep.txt" 2>/dev/null; then
    head -3 "$work/grep.txt" >&2
    fail "readiness: outputs contain the host path $p"
  fi
done
grep -qE '^[^#]*/(home|root)/' "$work"/base-a/external/*quack_python/python3 && fail "readiness: the interpreter shim names a path"
echo "   no output names the checkout, output base or cache paths ($n_obj objects, sidecars, manifest)" >&2
echo "   note: the interpreter shim (no path in it) runs the environment its link 'env' names, $env_a," \
  "outside the declared inputs (an executor provisions its own from the lock)" >&2

# --- faults ------------------------------------------------------------------------------------------
fault_note="faults skipped"
if ((faults)); then
  # Each fault build needs one family only: the first family's target (the fallbacks compile its units).
  fam=$(basename "${dirs_a[0]}")
  fam=${fam#warm_cache_}
  target=//quack:warm_cache_$fam
  # 1. Garbage: the blobs of two objects are inverted on disk (same size).
  log "fault 1: corrupted CAS blobs (bytes inverted, same size): $f"
  mapfile -t victims < <(find "${dirs_a[0]}" -name '*.o' | LC_ALL=C sort | head -n 2)
  "$rc_faults" corrupt "$store" "${victims[@]}" | sed 's/^/   corrupted /' >&2
  mark
  run_bazel f1 "$f" "$work/base-f1" build "$target"
  grep -A4 'WARNING: Remote Cache' "$work/f1.log" | sed 's/^/   | /' | cut -c1-220 >&2 || true
  grep -A4 'WARNING: Remote Cache' "$work/f1.log" | grep -qiE 'digest|mismatch' || fail "fault 1: no warning about the digest mismatch"
  [[ $(spawn_field f1 ran) == "${#victims[@]}" ]] ||
    fail "fault 1: $(spawn_field f1 ran) kernel actions ran locally (expected the ${#victims[@]} whose objects were corrupted)"
  fam_units=$(spawn_field f1 count)
  objects "$f" "$work/base-f1" "$work/f1.sha256" "$fam"
  same_as_a "fault 1" "$work/f1.sha256" "$fam"
  heal=$("$rc_faults" verify "$store" 2>/dev/null) || fail "fault 1: the store still holds bad blobs ($heal)"
  echo "   fell back, the ${#victims[@]} kernel actions of the corrupted objects ran locally (of $fam_units) in ${wall}s, objects verified and identical; re-upload repaired the store ($heal)" >&2

  # 2. Slow, within --remote_timeout: nginx sends every response at 8 KB/s.
  log "fault 2: slow server (limit_rate 8k per response), within --remote_timeout"
  stop_server
  start_server --limit-rate 8k
  mark
  run_bazel f2 "$f" "$work/base-f2" build "$target"
  f2_wall=$wall
  [[ $(spawn_field f2 ran) == 0 && $(spawn_field f2 hit) == "$fam_units" ]] || fail "fault 2: expected remote hits only"
  objects "$f" "$work/base-f2" "$work/f2.sha256" "$fam"
  same_as_a "fault 2" "$work/f2.sha256" "$fam"
  echo "   remote hits, kernel actions $(spawn_field f2 time)s, wall ${f2_wall}s, objects identical; server: $(net)" >&2

  # 3. Slower than --remote_timeout: one request a minute, the rest wait in nginx's queue.
  # remote-ro: no uploads to wait for (each would wait out the timeout too); one retry, not
  # Bazel's five: each retry of each lookup waits out the timeout again, which tests nothing more.
  log "fault 3: stalled server (limit_req 1r/m), --config=remote-ro --remote_timeout=3 --remote_retries=1"
  stop_server
  start_server --max-rps 1r/m
  mark
  RC_CONFIG=remote-ro run_bazel f3 "$f" "$work/base-f3" build --remote_timeout=3 --remote_retries=1 "$target"
  grep -qE 'WARNING: .*Remote Cache' "$work/f3.log" || fail "fault 3: no remote cache warning"
  [[ $(spawn_field f3 ran) == "$fam_units" ]] || fail "fault 3: the kernel actions did not run locally"
  objects "$f" "$work/base-f3" "$work/f3.sha256" "$fam"
  same_as_a "fault 3" "$work/f3.sha256" "$fam"
  f3_wall=$wall
  echo "   timed out, fell back, ran locally, objects verified and identical (wall ${f3_wall}s); server: $(net)" >&2

  # 4. Server down: nothing listens on the port any more.
  log "fault 4: server down ($url)"
  stop_server
  run_bazel f4 "$f" "$work/base-f4" build "$target"
  grep -qE 'WARNING: .*Remote Cache' "$work/f4.log" || fail "fault 4: no remote cache warning"
  [[ $(spawn_field f4 ran) == "$fam_units" ]] || fail "fault 4: the kernel actions did not run locally"
  objects "$f" "$work/base-f4" "$work/f4.sha256" "$fam"
  same_as_a "fault 4" "$work/f4.sha256" "$fam"
  echo "   fell back, ran locally, objects verified and identical (wall ${wall}s)" >&2
  fault_note="faults 4/4 on $target (corrupt blob, slow, stalled, down)"
fi

summary_done=1
echo "remote cache: PASS: $kernel_actions kernel action(s), $n_obj objects; B: $b_hits remote hit(s), 0 ran, identical;" \
  "kernel action A ${a_time}s vs B ${b_time}s (${speedup}x); build wall A ${a_wall}s vs B ${b_wall}s" \
  "(critical path ${a_crit}s vs ${b_crit}s); B fetched $(sed -n 's/.*GET hits [0-9]* (\([0-9]*\) bytes).*/\1/p' <<<"$b_net") bytes," \
  "A uploaded $(sed -n 's/.*PUT [0-9]* (\([0-9]*\) bytes).*/\1/p' <<<"$a_net") bytes; U (another user, own environment):" \
  "$u_hits remote hit(s), 0 ran, identical; C toplevel + test_rmsnorm PASSED;" \
  "readiness OK; $fault_note; $(($(date +%s) - t_start)) s"
