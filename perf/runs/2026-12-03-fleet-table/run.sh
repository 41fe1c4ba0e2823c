#!/usr/bin/env bash
# The bench fleet table of issue 16: 256, 1,024, 4,096 workers x 8k, 32k tokens, 8 s each,
# one after another on one build (run from the repo root).
set -euo pipefail
BIN=${KVROUTE_BIN:-target/release/kvroute}
OUT=${1:-perf/runs/2026-12-03-fleet-table}
for w in 256 1024 4096; do
  for t in 8192 32768; do
    "$BIN" bench fleet --workers "$w" --tokens "$t" --seconds 8 --out "$OUT/$w-$t.json" \
      > "$OUT/$w-$t.log" 2>&1
    head -1 "$OUT/$w-$t.log"
  done
done
