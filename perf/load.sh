#!/usr/bin/env bash
# Fixed-rate latency run against the gateway on loopback, with simulated engines behind it.
# wrk2 is not packaged; `oha -q RATE` is the nearest fixed-rate (open-loop) tool, so use it
# (cargo install oha); falls back to wrk (closed loop, apt install wrk).
# Usage: perf/load.sh [rate req/s, default 2000] [seconds, default 20] [engines, default 2]
# Engines run with --speedup-ratio 0 (no modelled delay) so the numbers are the router's.
set -euo pipefail
cd "$(dirname "$0")/.."
rate=${1:-2000}; secs=${2:-20}; engines=${3:-2}
cargo build --release -p kvroute-io >/dev/null 2>&1
bin=target/release/kvroute
pids=(); workers=()
trap 'kill "${pids[@]}" 2>/dev/null || true' EXIT
for i in $(seq 1 "$engines"); do
  port=$((18100 + i))
  $bin engine --listen 127.0.0.1:$port --speedup-ratio 0 >/dev/null 2>&1 & pids+=($!)
  workers+=(--worker http://127.0.0.1:$port)
done
$bin serve --listen 127.0.0.1:18000 "${workers[@]}" >/dev/null 2>&1 & pids+=($!)
sleep 2
body='{"model":"m","prompt":"The quick brown fox jumps over the lazy dog","max_tokens":1}'
if command -v oha >/dev/null; then
  oha -q "$rate" -z "${secs}s" -m POST -H 'content-type: application/json' -d "$body" \
    --no-tui http://127.0.0.1:18000/v1/completions
else
  printf 'wrk.method = "POST"\nwrk.body = [[%s]]\nwrk.headers["content-type"] = "application/json"\n' "$body" > /tmp/kvroute-wrk.lua
  wrk -t2 -c64 -d"${secs}s" --latency -s /tmp/kvroute-wrk.lua http://127.0.0.1:18000/v1/completions
fi
echo "--- baseline: the same load straight at engine 1 (no gateway)"
if command -v oha >/dev/null; then
  oha -q "$rate" -z "${secs}s" -m POST -H 'content-type: application/json' -d "$body" \
    --no-tui http://127.0.0.1:18101/v1/completions
else
  wrk -t2 -c64 -d"${secs}s" --latency -s /tmp/kvroute-wrk.lua http://127.0.0.1:18101/v1/completions
fi
curl -s http://127.0.0.1:18000/metrics | grep -E '^kvroute_(requests|decisions)_total' || true
