#!/usr/bin/env bash
# Interleaved A/B of `kvroute bench fleet` between two builds: run.sh BASE NEW ROUNDS OUTDIR
# [WORKERS TOKENS SECONDS]. Each round runs BASE then NEW; every report is kept as
# OUTDIR/{base,new}-ROUND.json and the medians over rounds are printed (µs).
set -euo pipefail
base=$1 new=$2 rounds=$3 out=$4 workers=${5:-4096} tokens=${6:-32768} seconds=${7:-4}
mkdir -p "$out"
for r in $(seq 1 "$rounds"); do
  for side in base new; do
    bin=$base; [ "$side" = new ] && bin=$new
    "$bin" bench fleet --workers "$workers" --tokens "$tokens" --seconds "$seconds" \
      >"$out/$side-$r.json" 2>"$out/$side-$r.log"
  done
done
python3 - "$out" "$rounds" <<'PY'
import json, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
rows = [("decision p50", lambda r: r["decision_p50_ns"]), ("decision p99", lambda r: r["decision_p99_ns"])]
for stage in ["parse_tokenize", "facts", "decide", "book", "record"]:
    rows.append((f"{stage} p50", lambda r, s=stage: r["stages_p50_ns"][s]))
    rows.append((f"{stage} p99", lambda r, s=stage: r["stages_p99_ns"][s]))
print(f"| median of {rounds} rounds, µs | base | new | new / base |")
print("|---|---|---|---|")
for name, f in rows:
    b = statistics.median(f(json.load(open(f"{out}/base-{i}.json"))) for i in range(1, rounds + 1)) / 1e3
    n = statistics.median(f(json.load(open(f"{out}/new-{i}.json"))) for i in range(1, rounds + 1)) / 1e3
    print(f"| {name} | {b:.1f} | {n:.1f} | {n / b:.2f} |")
PY
