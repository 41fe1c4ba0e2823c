#!/usr/bin/env bash
# Dynamo's potential blocks in kv_aware / dynamo_kv: before (BASE) and after (NEW), virtual
# time, so one run each is exact. Usage: bash run.sh BASE_BIN NEW_BIN OUT_DIR
set -euo pipefail
base=$1 new=$2 out=$3
mkdir -p "$out"
M="--trace ../shared/data/traces/mooncake/conversation_trace.jsonl --engines 8 --num-gpu-blocks 365600 --speedup-ratio 1 --load-poll-ms 1000"
W="--trace ../shared/data/traces/weka --engines 8 --capacity-factor 1.25 --speedup-ratio 1 --time-scale 1 --load-poll-ms 1000"
P=kv_aware_events,dynamo_kv
for b in base new; do
  bin=$base; [ $b = new ] && bin=$new
  $bin simulate $M --time-scale 8 --policies $P --out "$out/$b-mooncake-x8.json" > "$out/$b-mooncake-x8.txt"
  $bin simulate $M --time-scale 1 --policies $P --out "$out/$b-mooncake-x1.json" > "$out/$b-mooncake-x1.txt"
  $bin simulate $W --policies $P --out "$out/$b-weka.json" > "$out/$b-weka.txt"
  $bin simulate $W --policies dynamo_kv --runs 10 --out "$out/$b-weka-10-seeds.json" > "$out/$b-weka-10-seeds.txt"
  $bin simulate --policies dynamo_kv --runs 10 --out "$out/$b-builtin.json" > "$out/$b-builtin.txt"
done
