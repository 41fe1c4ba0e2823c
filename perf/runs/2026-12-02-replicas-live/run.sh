#!/usr/bin/env bash
# The live replica table (issue 16): kvroute demo on the built-in workload (234 requests, 4
# simulated engines), one router vs two replicas without sync vs two replicas synced over NATS
# (nats-server from PATH, `--nats embedded`), on the text tree, on events, and the default
# policy. Live runs are noisy on this 2-core machine (a TTFT p99 of 234 requests is the 3rd
# worst one), so the three settings run in interleaved rounds; table.py prints medians.
# Run from the repo root after `cargo build --release -p kvroute-io`.
set -euo pipefail
cd "$(dirname "$0")/../../.."
out=perf/runs/2026-12-02-replicas-live
bin=target/release/kvroute
pol=cache_aware,cache_aware_events,default
rounds=${ROUNDS:-3}
for r in $(seq 1 "$rounds"); do
  $bin demo --quiet --policies $pol --replicas 1 --out $out/one-$r.json > $out/one-$r.txt 2>/dev/null
  $bin demo --quiet --policies $pol --replicas 2 --out $out/two-$r.json > $out/two-$r.txt 2>/dev/null
  $bin demo --quiet --policies $pol --replicas 2 --nats embedded --out $out/nats-$r.json > $out/nats-$r.txt 2>/dev/null
done
python3 $out/table.py $out > $out/table.md
cat $out/table.md
