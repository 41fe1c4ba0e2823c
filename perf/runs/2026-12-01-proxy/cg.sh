#!/usr/bin/env bash
# usage: cg.sh BIN NAME "flags" [N]: callgrind Ir per request over N requests (after 300 warm-up)
set -euo pipefail
bin=$1 name=$2 flags=$3 n=${4:-2000}
conf=/work/wt-proxy/perf/compare
run=perf/runs/2026-12-01-proxy/rundir; mkdir -p $run
[ -f $run/upstreams.pid ] && kill -0 $(cat $run/upstreams.pid) 2>/dev/null || nginx -c "$conf/upstreams.conf" -p "$run/"
workers=(); for p in 19101 19102 19103 19104; do workers+=(--worker "http://127.0.0.1:$p"); done
rm -f perf/runs/2026-12-01-proxy/cg-$name.out*
RUST_LOG=warn valgrind --tool=callgrind --callgrind-out-file=perf/runs/2026-12-01-proxy/cg-$name.out --dump-instr=no $bin serve --shards 1 --listen 127.0.0.1:19011 --admin-listen "" "${workers[@]}" $flags > perf/runs/2026-12-01-proxy/cg-$name.log 2>&1 &
vp=$!
for _ in $(seq 1 100); do curl -sf -o /dev/null -H 'content-type: application/json' -d '{"model":"m","messages":[{"role":"user","content":"hi"}]}' http://127.0.0.1:19011/v1/chat/completions && break; sleep 0.3; done
python3 perf/runs/2026-12-01-proxy/client.py 19011 300
callgrind_control -z $vp >/dev/null
python3 perf/runs/2026-12-01-proxy/client.py 19011 $n
callgrind_control -d $vp >/dev/null
sleep 1
kill -9 $vp; wait $vp 2>/dev/null || true
f=$(ls -S perf/runs/2026-12-01-proxy/cg-$name.out* | head -1)
tot=$(callgrind_annotate $f 2>/dev/null | grep -m1 "PROGRAM TOTALS" | awk '{gsub(",","",$1); print $1}')
echo "$name: Ir total $tot, per request $((tot / n))"
