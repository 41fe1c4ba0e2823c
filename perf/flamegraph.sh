#!/usr/bin/env bash
# CPU flamegraph of the gateway under perf/load.sh traffic (perf from apt linux-perf; inferno
# from crates.io: cargo install inferno). Writes perf/runs/<date>-<host>/gateway.svg.
set -euo pipefail
cd "$(dirname "$0")/.."
out=perf/runs/$(date +%F)-$(hostname); mkdir -p "$out"
( sleep 4; pid=$(pgrep -f 'kvroute serve --listen 127.0.0.1:18000' | head -1)
  perf record -F 499 -g -p "$pid" -o "$out/perf.data" -- sleep 10 ) &
perf/load.sh "${1:-2000}" 16
wait
perf script -i "$out/perf.data" | inferno-collapse-perf | inferno-flamegraph > "$out/gateway.svg"
echo "wrote $out/gateway.svg"
