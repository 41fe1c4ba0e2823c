#!/usr/bin/env bash
# ab.sh "flags" rounds secs : A=/tmp/kvroute-base B=target/release/kvroute (or $A $B), interleaved, CPU µs/req
set -euo pipefail
cd "$(dirname "$0")/../../.."
# Usage: ab.sh FLAGS [ROUNDS] [SECS]; A, B: binaries (A=/tmp/kvroute-base, B=target/release/kvroute), AENV, BENV: VAR=VALUE for each.
flags=$1; rounds=${2:-3}; secs=${3:-6}
A=${A:-/tmp/kvroute-base}; B=${B:-target/release/kvroute}
run=$(mktemp -d /tmp/kvab.XXXX)
conf=$PWD/perf/compare
nginx -c "$conf/upstreams.conf" -p "$run/"
workers=(); for p in 19101 19102 19103 19104; do workers+=(--worker "http://127.0.0.1:$p"); done
env ${AENV:-X=1} RUST_LOG=warn $A serve --listen 127.0.0.1:19031 --admin-listen "" "${workers[@]}" $flags > $run/a.log 2>&1 & pa=$!
env ${BENV:-X=1} RUST_LOG=warn $B serve --listen 127.0.0.1:19032 --admin-listen "" "${workers[@]}" $flags > $run/b.log 2>&1 & pb=$!
sleep 1.5
hz=$(getconf CLK_TCK)
ticks() { awk '{print $14 + $15}' /proc/$1/stat; }
for r in $(seq 1 $rounds); do
  for x in a b; do
    if [ $x = a ]; then p=$pa; port=19031; else p=$pb; port=19032; fi
    t0=$(ticks $p)
    wrk -t2 -c64 -d${secs}s -s "$conf/chat.lua" http://127.0.0.1:$port > $run/w.txt
    t1=$(ticks $p)
    n=$(awk '/requests in/ {print $1}' $run/w.txt); rps=$(awk '/Requests\/sec/ {print $2}' $run/w.txt)
    echo "$r $x $rps $(awk -v d=$((t1-t0)) -v hz=$hz -v n=$n 'BEGIN{printf "%.2f", d/hz/n*1e6}')"
  done
done | tee $run/res.txt
python3 - $run/res.txt <<'PY'
import sys,statistics
rows=[l.split() for l in open(sys.argv[1])]
for x in 'ab':
    rps=[float(r[2]) for r in rows if r[1]==x]; cpu=[float(r[3]) for r in rows if r[1]==x]
    print(x,'median rps',statistics.median(rps),'cpu us/req',statistics.median(cpu))
PY
kill $pa $pb; kill $(cat $run/upstreams.pid) || true
