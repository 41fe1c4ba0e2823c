#!/usr/bin/env bash
# Two builds of `kvroute bench fleet` side by side, in interleaved rounds (base first in
# each), so that the host's speed changing run to run moves both alike.
# usage: perf/fleet-compare.sh OUT BASE_BIN NEW_BIN ROUNDS "WORKERSxTOKENS ..." [SECONDS]
# Writes OUT/<size>-<build>-<round>.json (the whole report) and .log, then OUT/summary.md:
# per size, the medians over rounds of each build and new / base (perf/fleet_summary.py).
set -euo pipefail
out=$1 base=$2 new=$3 rounds=$4 sizes=$5 secs=${6:-4}
mkdir -p "$out"
for size in $sizes; do
  w=${size%x*} t=${size#*x}
  for r in $(seq 1 "$rounds"); do
    for b in base new; do
      bin=$base; [ "$b" = new ] && bin=$new
      "$bin" bench fleet --workers "$w" --tokens "$t" --seconds "$secs" \
        > "$out/$size-$b-$r.json" 2> "$out/$size-$b-$r.log"
      tail -1 "$out/$size-$b-$r.log"
    done
  done
done
python3 "$(dirname "$0")/fleet_summary.py" "$out" $sizes > "$out/summary.md"
cat "$out/summary.md"
