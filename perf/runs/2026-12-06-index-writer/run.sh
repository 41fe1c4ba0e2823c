#!/usr/bin/env bash
# Interleaved rounds of `kvroute bench fleet`, two builds side by side.
# usage: run.sh BASE_BIN NEW_BIN ROUNDS "WORKERSxTOKENS ..." [SECONDS]
# Writes OUT/<size>-<build>-<round>.json (the whole report) beside this script, then
# summary.md: medians over rounds of each build, and new / base.
set -euo pipefail
base=$1 new=$2 rounds=$3 sizes=$4 secs=${5:-4}
out=$(dirname "$0")
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
python3 "$out/summary.py" "$out" $sizes > "$out/summary.md"
cat "$out/summary.md"
