#!/usr/bin/env bash
# The bench fleet table of issue 16 for two builds side by side: for each size, BASE then
# NEW, 8 s each: table.sh BASE NEW OUTDIR (run from the repo root).
set -euo pipefail
base=$1 new=$2 out=$3
mkdir -p "$out"
for w in 256 1024 4096; do
  for t in 8192 32768; do
    for side in base new; do
      bin=$base; [ "$side" = new ] && bin=$new
      "$bin" bench fleet --workers "$w" --tokens "$t" --seconds 8 >"$out/$side-$w-$t.json" 2>"$out/$side-$w-$t.log"
      echo "$side $(head -1 "$out/$side-$w-$t.log")"
    done
  done
done
