#!/usr/bin/env bash
# tools/remote_cache/server.sh: a local HTTP remote cache for Bazel (Debian's nginx with WebDAV
# PUT) on a loopback port, its entries stored under a folder you give it.
#
#   tools/remote_cache/server.sh start DIR [--port N] [--lifetime SECS] [--limit-rate RATE] [--max-rps RATE]
#   tools/remote_cache/server.sh stop DIR
#   tools/remote_cache/server.sh url DIR      # the --remote_cache URL of a running server
#   tools/remote_cache/server.sh status DIR   # exit 0 when running
#   tools/remote_cache/server.sh stats DIR [--from LINE]  # requests and bytes (access log)
#
# start prints the URL (http://127.0.0.1:PORT/cache) on stdout once the server answers a PUT and
# a GET. Then: tools/bazel build --config=remote --remote_cache=URL //quack:warm_cache, or put
# `build:remote --remote_cache=URL` in .bazelrc.user (the default in .bazelrc is port 8088).
#
# DIR layout: DIR/cache/ac/<sha256>, DIR/cache/cas/<sha256> (the entries: plain files, delete
# them to empty the cache) and DIR/server/ (nginx.conf, nginx.pid, access.log, error.log, tmp/).
#
# Options:
#   --port N          loopback port (default 8088; 0 picks a free one)
#   --lifetime SECS   the server stops itself after SECS seconds (default 7200): never left running
#   --limit-rate R    fault injection: nginx limit_rate per response, bytes/s (e.g. 200k)
#   --max-rps R       fault injection: nginx limit_req, requests over R (e.g. 1r/m, 5r/s) wait
#                     in a queue instead of being served at once
#
# nginx: Debian's package (bookworm: `nginx`, 1.22, WebDAV module built in) is installed with
# apt-get when missing and this runs as root. Its workers run as the user who owns DIR (root:
# `user root;`), otherwise PUT answers 500.
set -euo pipefail

self_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd -P)
log() { printf 'remote_cache: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

usage() { sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed -e '$d' -e 's/^# \{0,1\}//' >&2; exit 2; }

nginx_bin() {
  command -v nginx 2>/dev/null || { [[ -x /usr/sbin/nginx ]] && echo /usr/sbin/nginx; } || true
}

ensure_nginx() {
  local bin
  bin=$(nginx_bin)
  if [[ -z "$bin" ]]; then
    [[ $(id -u) == 0 ]] || die "nginx is not installed: apt-get install nginx (as root)"
    log "installing nginx (apt-get, Debian's package; its service is not started)"
    # policy-rc.d (present in containers) keeps the packaged service from starting; without it
    # the package's own service would start on port 80: stop it at once.
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends nginx >/dev/null 2>&1 ||
      { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends nginx >/dev/null; } ||
      die "apt-get install nginx failed"
    bin=$(nginx_bin)
    [[ -n "$bin" ]] || die "no nginx binary after apt-get install nginx"
  fi
  "$bin" -V 2>&1 | grep -q -- --with-http_dav_module ||
    die "$bin has no WebDAV module (http_dav_module); Debian's nginx package has it"
  printf '%s\n' "$bin"
}

http_code() { # METHOD URL [FILE]
  local method=$1 url=$2 file=${3:-} code
  if command -v curl >/dev/null; then
    if [[ -n "$file" ]]; then
      code=$(curl -s -o /dev/null -w '%{http_code}' --max-time 5 -X "$method" --data-binary "@$file" "$url") || true
    else
      code=$(curl -s -o /dev/null -w '%{http_code}' --max-time 5 -X "$method" "$url") || true
    fi
    echo "${code:-000}"
  else
    python3 - "$method" "$url" "$file" <<'PY'
import sys, urllib.request, urllib.error
method, url, path = sys.argv[1:4]
data = open(path, "rb").read() if path else None
try:
    with urllib.request.urlopen(urllib.request.Request(url, data=data, method=method), timeout=5) as r:
        print(r.status, end="")
except urllib.error.HTTPError as e:
    print(e.code, end="")
except Exception:
    print("000", end="")
PY
  fi
}

free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

alive() { [[ -n "${1:-}" ]] && kill -0 "$1" 2>/dev/null; }

master_pid() { cat "$srv/nginx.pid" 2>/dev/null || true; }

cmd=${1:-}
[[ -n "$cmd" && "$cmd" != -h && "$cmd" != --help ]] || usage
shift
[[ $# -ge 1 ]] || usage
dir=$1
shift
mkdir -p "$dir"
dir=$(cd "$dir" && pwd -P)
srv=$dir/server

case "$cmd" in
start)
  port=8088 lifetime=7200 limit_rate=0 max_rps=
  while [[ $# -gt 0 ]]; do
    case "$1" in
      --port) port=$2; shift 2 ;;
      --lifetime) lifetime=$2; shift 2 ;;
      --limit-rate) limit_rate=$2; shift 2 ;;
      --max-rps) max_rps=$2; shift 2 ;;
      *) die "unknown option $1" ;;
    esac
  done
  [[ "$lifetime" =~ ^[1-9][0-9]*$ ]] || die "--lifetime must be a positive number of seconds"
  if alive "$(master_pid)"; then
    die "already running for $dir: $(cat "$srv/url")"
  fi
  nginx=$(ensure_nginx)
  [[ "$port" == 0 ]] && port=$(free_port)
  mkdir -p "$dir/cache/ac" "$dir/cache/cas" "$srv/tmp"
  rm -f "$srv/nginx.pid" "$srv/url"
  user_line=""
  [[ $(id -u) == 0 ]] && user_line="user root;"
  zone="" req=""
  if [[ -n "$max_rps" ]]; then
    zone="limit_req_zone \$server_name zone=quack_slow:1m rate=$max_rps;"
    req="limit_req zone=quack_slow burst=100000;"
  fi
  sed -e "s|@SERVER@|$srv|g" -e "s|@STORE@|$dir|g" -e "s|@PORT@|$port|g" \
    -e "s|@USER_LINE@|$user_line|" -e "s|@LIMIT_RATE@|$limit_rate|" \
    -e "s|@LIMIT_REQ_ZONE@|$zone|" -e "s|@LIMIT_REQ@|$req|" \
    "$self_dir/nginx.conf.in" >"$srv/nginx.conf"
  "$nginx" -t -q -p "$srv" -e "$srv/error.log" -c "$srv/nginx.conf" ||
    die "nginx rejected $srv/nginx.conf (see $srv/error.log)"
  # Foreground nginx under timeout, in its own session: it stops by itself after $lifetime s.
  setsid timeout "$lifetime" "$nginx" -p "$srv" -e "$srv/error.log" -c "$srv/nginx.conf" \
    -g 'daemon off;' </dev/null >>"$srv/stdout.log" 2>&1 &
  echo $! >"$srv/timeout.pid"
  url=http://127.0.0.1:$port/cache
  probe=$srv/tmp/probe
  echo "quack remote cache probe $$" >"$probe"
  for _ in $(seq 1 100); do
    code=$(http_code PUT "$url/probe/$$" "$probe")
    [[ "$code" != 000 ]] && break
    alive "$(cat "$srv/timeout.pid")" || die "nginx exited at start (see $srv/error.log, $srv/stdout.log)"
    sleep 0.1
  done
  [[ "$code" == 201 || "$code" == 204 ]] || {
    "$0" stop "$dir" >/dev/null 2>&1 || true
    die "PUT answered $code (500: the worker cannot write $dir; see $srv/error.log)"
  }
  code=$(http_code GET "$url/probe/$$")
  rm -rf "$dir/cache/probe"
  [[ "$code" == 200 ]] || { "$0" stop "$dir" >/dev/null 2>&1 || true; die "GET after PUT answered $code"; }
  echo "$url" >"$srv/url"
  log "serving $dir/cache at $url (pid $(master_pid), stops by itself in ${lifetime}s)"
  echo "$url"
  ;;
stop)
  pid=$(master_pid)
  tpid=$(cat "$srv/timeout.pid" 2>/dev/null || true)
  if alive "$pid"; then
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 1 50); do alive "$pid" || break; sleep 0.1; done
    alive "$pid" && kill -KILL "$pid" 2>/dev/null || true
  fi
  if alive "$tpid"; then
    for _ in $(seq 1 20); do alive "$tpid" || break; sleep 0.1; done
    alive "$tpid" && kill -TERM "$tpid" 2>/dev/null || true
  fi
  rm -f "$srv/nginx.pid" "$srv/timeout.pid" "$srv/url"
  log "stopped (store kept: $dir/cache)"
  ;;
url)
  alive "$(master_pid)" || die "not running for $dir"
  cat "$srv/url"
  ;;
status)
  if alive "$(master_pid)"; then
    echo "running: $(cat "$srv/url") (pid $(master_pid))"
  else
    echo "not running"
    exit 1
  fi
  ;;
stats)
  # GET 200 = hit, GET 404 = miss, PUT 201/204 = upload; bytes from the access log, from line
  # --from (1-based) on: a caller notes `wc -l < DIR/server/access.log` before a step.
  from=1
  [[ "${1:-}" == --from ]] && from=$2
  tail -n "+$from" "$srv/access.log" 2>/dev/null | awk '
    $3 !~ "^/cache/(ac|cas)/" { next }
    $2 == "GET" && $4 == 200 { hits++; down += $5 }
    $2 == "GET" && $4 == 404 { miss++ }
    $2 == "HEAD" { head++ }
    $2 == "PUT" && ($4 == 201 || $4 == 204) { puts++; up += $6 }
    $4 >= 500 { err++ }
    END { printf "GET hits %d (%d bytes), GET misses %d, HEAD %d, PUT %d (%d bytes), 5xx %d\n",
          hits, down, miss, head, puts, up, err }'
  ;;
*)
  usage
  ;;
esac
