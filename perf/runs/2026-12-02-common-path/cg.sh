#!/usr/bin/env bash
# cg.sh BIN NAME "FLAGS" [N]: callgrind instructions (Ir) per request of `kvroute serve --shards 1
# FLAGS` over N requests (default 2000) after 300 warm-up ones, chat bodies of
# perf/compare/chat.lua's shape (perf/runs/2026-12-01-proxy/client.py), 4 nginx upstreams. Instruction counts are stable
# on this noisy machine where req/s and CPU time are not (they miss cross-core cache traffic).
set -euo pipefail
cd "$(dirname "$0")/../../.."
bin=$1 name=$2 flags=$3 n=${4:-2000}
here=perf/runs/2026-12-02-common-path
conf=$PWD/perf/compare
run=$(mktemp -d /tmp/kvcg.XXXX)
nginx -c "$conf/upstreams.conf" -p "$run/"
workers=(); for p in 19101 19102 19103 19104; do workers+=(--worker "http://127.0.0.1:$p"); done
# shellcheck disable=SC2086
RUST_LOG=warn valgrind --tool=callgrind --callgrind-out-file=$run/cg.out --dump-instr=no "$bin" serve --shards 1 \
  --listen 127.0.0.1:19051 --admin-listen "" "${workers[@]}" $flags > "$run/cg.log" 2>&1 &
vp=$!
for _ in $(seq 1 100); do  # bounded: 100 × 0.3 s
  curl -sf -o /dev/null -H 'content-type: application/json' -d '{"model":"m","messages":[{"role":"user","content":"hi"}]}' \
    http://127.0.0.1:19051/v1/chat/completions && break
  sleep 0.3
done
python3 perf/runs/2026-12-01-proxy/client.py 19051 300
callgrind_control -z $vp >/dev/null
python3 perf/runs/2026-12-01-proxy/client.py 19051 "$n"
callgrind_control -d $vp >/dev/null
sleep 1
kill -9 $vp; wait $vp 2>/dev/null || true
kill "$(cat "$run/upstreams.pid")" 2>/dev/null || true
f=$(ls -S $run/cg.out* | head -1)
callgrind_annotate --inclusive=yes "$f" > "$run/annotated.txt" 2>/dev/null
head -80 "$run/annotated.txt" > "$here/callgrind-$name.txt"; cp "$run/annotated.txt" "/tmp/callgrind-$name.full.txt"
tot=$(callgrind_annotate "$f" 2>/dev/null | awk '/PROGRAM TOTALS/ {gsub(",","",$1); print $1; exit}')
echo "$name: Ir total $tot, per request $((tot / n))" | tee -a "$here/callgrind.txt"
rm -rf "$run"
