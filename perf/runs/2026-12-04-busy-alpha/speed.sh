#!/usr/bin/env bash
# Wall seconds of `kvroute simulate` on the whole Mooncake trace at x8, one policy per
# process, the two binaries alternating (base, after, base, after), ROUNDS rounds.
# Usage: speed.sh BASE_BIN AFTER_BIN [ROUNDS] > speed.txt (run from the repository root).
set -euo pipefail
base=$1 after=$2 rounds=${3:-2}
M="--trace ../shared/data/traces/mooncake/conversation_trace.jsonl --engines 8 --num-gpu-blocks 365600 --speedup-ratio 1 --time-scale 8 --load-poll-ms 1000"
for r in $(seq 1 "$rounds"); do
  for p in default dynamo_kv smg_cache_aware round_robin; do
    for b in base after; do
      bin=$base; [ $b = after ] && bin=$after
      s=$(date +%s.%N)
      row=$($bin simulate $M --policies $p 2>&1 | grep -E "^[a-z_]+ +12031 ")
      e=$(date +%s.%N)
      echo "round $r $b $p wall_s $(echo "$row" | awk '{print $NF}') process_s $(echo "$e - $s" | bc) | $(echo "$row" | awk '{NF--; print}')"
    done
  done
done
