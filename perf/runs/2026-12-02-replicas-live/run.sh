#!/usr/bin/env bash
# The live replica table (issue 16): kvroute demo on the built-in workload, one router vs two
# replicas without sync vs two replicas synced over NATS (nats-server from PATH, embedded),
# on the text tree, on events, and the default policy. Run from the repo root after
# `cargo build --release -p kvroute-io`; writes one JSON per setting beside this script.
set -euo pipefail
cd "$(dirname "$0")/../../.."
out=perf/runs/2026-12-02-replicas-live
bin=target/release/kvroute
pol=cache_aware,cache_aware_events,default
$bin demo --quiet --policies $pol --replicas 1 --out $out/one.json > $out/one.txt
$bin demo --quiet --policies $pol --replicas 2 --out $out/two.json > $out/two.txt
$bin demo --quiet --policies $pol --replicas 2 --nats embedded --out $out/two-nats.json > $out/two-nats.txt
