#!/usr/bin/env bash
# Interleaved wall-time rounds of `kvroute simulate` on the whole Mooncake trace at x8, one
# policy per process, two builds: BASE and NEW (paths to kvroute binaries).
# Usage: speed.sh BASE NEW ROUNDS "POLICY..."  -> TSV: round policy build wall_s process_s faults
set -euo pipefail
base=$1 new=$2 rounds=$3 policies=$4
M="--trace ../shared/data/traces/mooncake/conversation_trace.jsonl --engines 8 --num-gpu-blocks 365600 --speedup-ratio 1 --load-poll-ms 1000 --time-scale 8"
printf 'round\tpolicy\tbuild\twall_s\tprocess_s\tpage_faults\n'
for r in $(seq 1 "$rounds"); do
  for p in $policies; do
    for b in base new; do
      bin=$base; [ $b = new ] && bin=$new
      out=$(perf stat -x, -e page-faults "$bin" simulate $M --policies "$p" 2>&1)
      wall=$(echo "$out" | awk -v p="$p" '$1==p {print $NF}')
      faults=$(echo "$out" | awk -F, '/page-faults/ {print $1}')
      proc=$(echo "$out" | awk '/finished in/ {print $4}')
      printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$r" "$p" "$b" "$wall" "$proc" "$faults"
    done
  done
done
