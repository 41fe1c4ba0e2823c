#!/usr/bin/env bash
# Fixed-rate latency run against the gateway on loopback, with simulated engines behind it.
# The load is `kvroute load` (wrk2's model: requests at a constant rate, latency counted from
# each request's scheduled time, so a stall cannot hide; `kvroute load --help`). Another
# target: `kvroute load --url http://HOST:PORT[/PATH] --rate R --duration S [--stream]
# [--prompt-tokens N --system-chars C] [--out FILE]`.
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
# The router probes each worker once at start-up; one not up yet joins only after two passed
# health checks (20 s), so wait for the engines first (at most 10 s each).
for i in $(seq 1 "$engines"); do
  for _ in $(seq 1 100); do
    curl -sf http://127.0.0.1:$((18100 + i))/health >/dev/null && break; sleep 0.1
  done
done
$bin serve --listen 127.0.0.1:18000 "${workers[@]}" >/dev/null 2>&1 & pids+=($!)
for _ in $(seq 1 100); do curl -sf http://127.0.0.1:18000/health >/dev/null && break; sleep 0.1; done
$bin load --url http://127.0.0.1:18000 --rate "$rate" --duration "$secs" --stream
echo "--- baseline: the same load straight at engine 1 (no gateway)"
$bin load --url http://127.0.0.1:18101 --rate "$rate" --duration "$secs" --stream
curl -s http://127.0.0.1:18000/metrics | grep -E '^kvroute_(requests|decisions)_total' || true
