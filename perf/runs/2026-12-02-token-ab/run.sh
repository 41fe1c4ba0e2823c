#!/usr/bin/env bash
# Issue 15: is token mode's drop from 0.99x to 0.86x nginx (session 11) a regression of the
# merged `decision` branch? perf/compare.sh with the binary of 4b88879 (before the merge) and
# with main's, alternating (old, new, old, new), each run measuring nginx beside it; compare
# each run's ratios to its own nginx. Build the old binary first:
#   git worktree add /work/wt-old 4b88879 --detach && (cd /work/wt-old && cargo build --release -p kvroute-io)
set -euo pipefail
cd "$(dirname "$0")/../../.."
out=perf/runs/2026-12-02-token-ab
old=${OLD_BIN:-/work/wt-old/target/release/kvroute}
new=target/release/kvroute
for r in 1 2; do
  KVROUTE_BIN=$old bash perf/compare.sh --rounds 3 --secs 8 --out $out/old-$r > $out/old-$r.txt 2>&1
  KVROUTE_BIN=$new bash perf/compare.sh --rounds 3 --secs 8 --out $out/new-$r > $out/new-$r.txt 2>&1
done
for f in $out/old-1 $out/new-1 $out/old-2 $out/new-2; do echo "== $f"; cat $f/summary.tsv; done
