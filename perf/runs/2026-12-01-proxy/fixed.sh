#!/usr/bin/env bash
# CPU µs/request of each proxy at a fixed rate (kvroute load), interleaved rounds.
set -euo pipefail
rate=${1:-5000} rounds=${2:-3} secs=${3:-5}
conf=/work/wt-proxy/perf/compare
run=/tmp/prof/fixeddir; mkdir -p $run
nginx -c "$conf/upstreams.conf" -p "$run/"; nginx -c "$conf/proxy.conf" -p "$run/"
workers=(); for p in 19101 19102 19103 19104; do workers+=(--worker "http://127.0.0.1:$p"); done
declare -A pid port
start() { RUST_LOG=warn $2 serve --listen 127.0.0.1:$3 --admin-listen "" "${workers[@]}" $4 > /dev/null 2>&1 & pid[$1]=$!; port[$1]=$3; }
start rr_base /tmp/kvroute-base 19011 "--policy round_robin"
start rr /tmp/kvroute-v1 19012 "--policy round_robin"
start text_base /tmp/kvroute-base 19013 "--policy cache_aware"
start text /tmp/kvroute-v1 19014 "--policy cache_aware"
pid[nginx]=$(cat $run/proxy.pid); port[nginx]=19000
trap 'for p in ${pid[rr_base]} ${pid[rr]} ${pid[text_base]} ${pid[text]}; do kill $p; done; kill $(cat $run/proxy.pid) $(cat $run/upstreams.pid)' EXIT
sleep 1
hz=$(getconf CLK_TCK)
ticks() { local total=0 p; for p in "$1" $(pgrep -P "$1" || true); do total=$((total + $(awk '{print $14 + $15}' "/proc/$p/stat"))); done; echo $total; }
for r in $(seq 1 $rounds); do
  for t in nginx rr_base rr text_base text; do
    b=$(ticks ${pid[$t]})
    /tmp/kvroute-v1 load --url http://127.0.0.1:${port[$t]} --rate $rate --duration $secs --model m --system-chars 800 --prompt-tokens 16 --connections 64 --quiet --out $run/l.json >/dev/null
    a=$(ticks ${pid[$t]})
    python3 -c "
import json; d=json.load(open('$run/l.json')); n=$rate*$secs
print('$r\t$t\t%.1f us/req\tp50 %.3f p99 %.3f ms\tachieved %.0f err %d' % (($a-$b)/$hz/n*1e6, d['corrected_ms']['p50'], d['corrected_ms']['p99'], d['achieved_rate'], d['errors']+d['unsent']))"
  done
done
