#!/usr/bin/env bash
# SSE first-chunk experiment: direct, nginx, kvroute pinned, unpinned, 1 shard.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
run=$(mktemp -d /tmp/sse.XXXX); conf=$PWD/perf/compare
nginx -c "$conf/upstreams.conf" -p "$run/"; nginx -c "$conf/proxy.conf" -p "$run/"
pids=()
RUST_LOG=warn /tmp/kvroute-new3 serve --listen 127.0.0.1:19015 --admin-listen "" --worker http://127.0.0.1:19105 --policy round_robin >/dev/null 2>&1 & pids+=($!)
KVROUTE_NO_PIN=1 RUST_LOG=warn /tmp/kvroute-nopin serve --listen 127.0.0.1:19016 --admin-listen "" --worker http://127.0.0.1:19105 --policy round_robin >/dev/null 2>&1 & pids+=($!)
RUST_LOG=warn /tmp/kvroute-new3 serve --shards 1 --listen 127.0.0.1:19017 --admin-listen "" --worker http://127.0.0.1:19105 --policy round_robin >/dev/null 2>&1 & pids+=($!)
sleep 2
declare -A port=([direct]=19105 [nginx]=19001 [pinned]=19015 [nopin]=19016 [one]=19017)
for r in 1 2 3 4 5; do
  for t in direct nginx pinned nopin one; do
    /tmp/kvroute-new3 load --url "http://127.0.0.1:${port[$t]}" --rate 1000 --duration 3 --model m --system-chars 800 --prompt-tokens 16 --quiet --out $run/l.json --connections 1 --stream >/dev/null
    python3 -c "import json;d=json.load(open('$run/l.json'));print('$t', d['first_chunk_uncorrected_ms']['p50'])"
  done
done | tee /tmp/sse-res.txt
python3 - <<'PY'
import collections,statistics
v=collections.defaultdict(list)
for l in open('/tmp/sse-res.txt'):
    t,x=l.split(); v[t].append(float(x))
d=statistics.median(v['direct'])
for t,xs in v.items(): print(t, f"{statistics.median(xs):.3f}", f"added {statistics.median(xs)-d:.3f}", xs)
PY
kill "${pids[@]}"; kill $(cat $run/upstreams.pid) $(cat $run/proxy.pid); rm -rf $run
