#!/usr/bin/env bash
# usage: ops.sh BIN "flags" : counts io_uring ops and syscalls per request for N requests at low concurrency
set -euo pipefail
bin=$1 flags=$2
conf=/work/wt-proxy/perf/compare
run=perf/runs/2026-12-01-proxy/rundir; mkdir -p $run
[ -f $run/upstreams.pid ] && kill -0 $(cat $run/upstreams.pid) 2>/dev/null || nginx -c "$conf/upstreams.conf" -p "$run/"
workers=(); for p in 19101 19102 19103 19104; do workers+=(--worker "http://127.0.0.1:$p"); done
RUST_LOG=warn $bin serve --listen 127.0.0.1:19011 --admin-listen "" "${workers[@]}" $flags > perf/runs/2026-12-01-proxy/ops.log 2>&1 &
kp=$!
sleep 1
curl -sf -o /dev/null -H 'content-type: application/json' -d '{"model":"m","messages":[{"role":"user","content":"hi"}]}' http://127.0.0.1:19011/v1/chat/completions
perf record -e io_uring:io_uring_submit_req -e raw_syscalls:sys_enter -p $kp -o perf/runs/2026-12-01-proxy/ops.data -- sleep 4 2>/dev/null >/dev/null &
sleep 0.5
wrk -t2 -c64 -d2s -s $conf/chat.lua http://127.0.0.1:19011 > perf/runs/2026-12-01-proxy/ops-wrk.txt
wait %2 2>/dev/null || true
kill $kp
reqs=$(awk '/requests in/ {print $1}' perf/runs/2026-12-01-proxy/ops-wrk.txt)
echo "requests $reqs"
perf script -i perf/runs/2026-12-01-proxy/ops.data -F event,trace 2>/dev/null | awk -v n=$reqs '
 /io_uring_submit_req/ { for(i=1;i<=NF;i++) if ($i ~ /^opcode/) {op=$(i+1); if(op=="") op=$i; c["op " $i " " $(i+1)]++} }
 /sys_enter/ { for(i=1;i<=NF;i++) if ($i ~ /^NR/) c["syscall " $(i+1)]++ }
 END { for (k in c) printf "%-40s %8d %6.2f/req\n", k, c[k], c[k]/n }' | sort -k3 -nr
