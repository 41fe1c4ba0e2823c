#!/usr/bin/env bash
set -euo pipefail
cd "$(dirname "$0")/../../.."
flags=$1; bin=${BIN:-target/release/kvroute}
run=$(mktemp -d /tmp/kvp.XXXX)
conf=$PWD/perf/compare
nginx -c "$conf/upstreams.conf" -p "$run/"
workers=(); for p in 19101 19102 19103 19104; do workers+=(--worker "http://127.0.0.1:$p"); done
RUST_LOG=warn $bin serve --listen 127.0.0.1:19021 --admin-listen "" "${workers[@]}" $flags > $run/k.log 2>&1 &
kp=$!
sleep 1.5
wrk -t2 -c64 -d2s -s "$conf/chat.lua" http://127.0.0.1:19021 > /dev/null
perf stat -e 'io_uring:io_uring_submit_req,io_uring:io_uring_poll_arm,io_uring:io_uring_complete,syscalls:sys_enter_io_uring_enter,io_uring:io_uring_queue_async_work,io_uring:io_uring_task_work_run' -p $kp -o $run/stat.txt -- sleep 4 &
wrk -t2 -c64 -d6s -s "$conf/chat.lua" http://127.0.0.1:19021 > $run/wrk.txt
wait %2 || true
grep Requests/sec $run/wrk.txt
rps=$(awk '/Requests\/sec/ {print $2}' $run/wrk.txt)
awk -v r=$rps '/io_uring|syscalls/ {gsub(",","",$1); printf "%-45s %10.0f  per req %.2f\n", $2, $1, $1/(r*4)}' $run/stat.txt
kill $kp; kill $(cat $run/upstreams.pid) || true
