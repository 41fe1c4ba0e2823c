#!/usr/bin/env bash
# profile.sh "FLAGS" OUT: kvroute serve FLAGS under wrk -t2 -c64 (perf/compare/chat.lua), 4 nginx
# upstreams; perf record --call-graph dwarf for 6 s after a 4 s warm-up; folded stacks to OUT.
set -euo pipefail
cd "$(dirname "$0")/../../.."
flags=$1; out=$2; bin=${BIN:-target/release/kvroute}
run=$(mktemp -d /tmp/kvprof.XXXX)
conf=$PWD/perf/compare
nginx -c "$conf/upstreams.conf" -p "$run/"
workers=(); for p in 19101 19102 19103 19104; do workers+=(--worker "http://127.0.0.1:$p"); done
RUST_LOG=warn $bin serve --listen 127.0.0.1:19041 --admin-listen "" "${workers[@]}" $flags > $run/s.log 2>&1 & ps=$!
sleep 1.5
wrk -t2 -c64 -d12s -s "$conf/chat.lua" http://127.0.0.1:19041 > $run/w.txt &
sleep 4
perf record -F 1999 --call-graph dwarf,16384 -p $ps -o $run/perf.data -- sleep 6 2>/dev/null
wait %2 || true
grep Requests/sec $run/w.txt
perf script -i $run/perf.data 2>/dev/null | inferno-collapse-perf > "$out"
kill $ps; kill $(cat $run/upstreams.pid) || true; rm -rf $run
