#!/usr/bin/env bash
# The measurements of README.md: `kvroute load` against nginx (a static file), a simulated
# engine (--speedup-ratio 0) and the router in front of two of them; wrk (closed loop) as the
# reference cost of a client. Needs nginx and wrk (apt install nginx wrk).
# Usage: perf/runs/2026-12-01-load/run.sh [out dir, default /tmp/kvroute-load-run] [seconds, default 5]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cd "$here/../../.."
out=${1:-/tmp/kvroute-load-run}; secs=${2:-5}
mkdir -p "$out/www/v1/chat"
bin=target/release/kvroute
[ -x $bin ] || cargo build --release -p kvroute-io
pids=()
trap 'kill "${pids[@]}" 2>/dev/null || true; [ -f "$out/nginx.pid" ] && kill "$(cat "$out/nginx.pid")" 2>/dev/null || true' EXIT

# nginx: a 275-byte chat completion and a 1,637-byte SSE stream (16 chunks + [DONE]), as files.
printf '%s' '{"id":"chatcmpl-1","object":"chat.completion","created":1,"model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"The quick brown fox jumps over the lazy dog."},"finish_reason":"stop"}],"usage":{"prompt_tokens":30,"completion_tokens":10,"total_tokens":40}}' > "$out/www/v1/chat/completions"
{ for i in $(seq 1 16); do printf 'data: {"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":" t%d"}}]}\n\n' "$i"; done; printf 'data: [DONE]\n\n'; } > "$out/www/v1/chat/stream"
cat > "$out/nginx.conf" <<CONF
worker_processes 1;
pid $out/nginx.pid;
error_log $out/nginx-error.log;
events { worker_connections 4096; }
http {
  access_log off;
  keepalive_requests 1000000;
  server {
    listen 127.0.0.1:28200;
    root $out/www;
    # The static module answers POST with 405: serve the file anyway.
    error_page 405 =200 \$uri;
    location = /v1/chat/completions { default_type application/json; }
    location = /v1/chat/stream { default_type text/event-stream; }
  }
}
CONF
nginx -c "$out/nginx.conf"
for port in 28101 28102; do
  $bin engine --listen 127.0.0.1:$port --speedup-ratio 0 >/dev/null 2>&1 & pids+=($!)
done
for port in 28101 28102; do
  for _ in $(seq 1 100); do curl -sf http://127.0.0.1:$port/health >/dev/null && break; sleep 0.1; done
done
$bin serve --listen 127.0.0.1:28000 --admin-listen "" --worker http://127.0.0.1:28101 \
  --worker http://127.0.0.1:28102 >/dev/null 2>&1 & pids+=($!)
for _ in $(seq 1 100); do curl -sf http://127.0.0.1:28000/health >/dev/null && break; sleep 0.1; done

nginx_worker=$(pgrep -f "nginx: worker process" -P "$(cat "$out/nginx.pid")")
engine1=${pids[0]}; router=${pids[2]}
ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; } # utime + stime, clock ticks
hz=$(getconf CLK_TCK)
run() { # name, target pid, then kvroute load flags
  local name=$1 pid=$2; shift 2
  local t0; t0=$(ticks "$pid")
  $bin load --quiet --duration "$secs" --out "$out/$name.json" "$@" > "$out/$name.txt"
  local t1; t1=$(ticks "$pid")
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); d['target_cpu_us_per_request']=($t1-$t0)*1e6/$hz/max(d['ok'],1); json.dump(d,open(sys.argv[1],'w'),indent=1)" "$out/$name.json"
  grep -E "CPU|achieved" "$out/$name.txt" | sed "s/^/$name: /"
}
for round in 1 2 3; do
  for r in 1000 5000 10000; do run "r$round-nginx-$r" "$nginx_worker" --url http://127.0.0.1:28200 --rate $r; done
  run "r$round-nginx-sse-1000" "$nginx_worker" --url http://127.0.0.1:28200/v1/chat/stream --rate 1000 --stream
  run "r$round-nginx-40000" "$nginx_worker" --url http://127.0.0.1:28200 --rate 40000
  run "r$round-nginx-10000-tick1000" "$nginx_worker" --url http://127.0.0.1:28200 --rate 10000 --tick-us 1000
  run "r$round-engine-1000" "$engine1" --url http://127.0.0.1:28101 --rate 1000
  run "r$round-engine-sse-1000" "$engine1" --url http://127.0.0.1:28101 --rate 1000 --stream
  run "r$round-router-sse-1000" "$router" --url http://127.0.0.1:28000 --rate 1000 --stream --system-chars 800
  printf 'wrk.method = "POST"\nwrk.body = [[%s]]\nwrk.headers["content-type"] = "application/json"\n' \
    '{"model":"m","messages":[{"role":"user","content":"alpha bravo charlie delta echo"}]}' > "$out/post.lua"
  /usr/bin/time -f "%U %S" -o "$out/r$round-wrk.time" \
    wrk -t1 -c64 -d"${secs}s" -s "$out/post.lua" http://127.0.0.1:28200/v1/chat/completions > "$out/r$round-wrk.txt"
  n=$(awk '/requests in/ {print $1}' "$out/r$round-wrk.txt")
  echo "r$round-wrk: $n requests, $(awk -v n="$n" '{printf "%.2f µs CPU per request", ($1+$2)*1e6/n}' "$out/r$round-wrk.time")"
done
