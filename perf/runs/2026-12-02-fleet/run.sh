#!/usr/bin/env bash
# kvroute bench fleet (issue 16): 256, 1,024 and 4,096 workers × 8k and 32k tokens, 10 s of
# events and decisions each, release build. Run from the repo root (the Mooncake trace is read
# from ../shared/data/traces/mooncake/conversation_trace.jsonl when present).
#   bash perf/runs/2026-12-02-fleet/run.sh
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
dir=perf/runs/2026-12-02-fleet
cargo build --release -p kvroute-io
git rev-parse HEAD > "$dir/commit.txt"
uptime >> "$dir/commit.txt"
for workers in 256 1024 4096; do
  for tokens in 8192 32768; do
    name="fleet-$workers-$tokens"
    target/release/kvroute bench fleet --workers "$workers" --tokens "$tokens" --seconds 10 \
      --out "$dir/$name.json" > "$dir/$name.report.json" 2> "$dir/$name.log"
    grep '^fleet' "$dir/$name.log"
  done
done
