#!/usr/bin/env bash
# A/B of the first SSE chunk's added latency: BIN_A and BIN_B (kvroute builds) beside
# nginx, interleaved rounds, medians. Usage: ab.sh BIN_A BIN_B [rounds] [secs]
set -euo pipefail
cd "$(dirname "$0")/../../.."
A=$1 B=$2 rounds=${3:-5} secs=${4:-4}
run=$(mktemp -d /tmp/sse-ab.XXXXXX)
conf=$PWD/perf/compare
nginx -c "$conf/upstreams.conf" -p "$run/"
nginx -c "$conf/proxy.conf" -p "$run/"
RUST_LOG=warn "$A" serve --listen 127.0.0.1:19021 --admin-listen "" --worker http://127.0.0.1:19105 --policy round_robin >"$run/a.log" 2>&1 & pa=$!
RUST_LOG=warn "$B" serve --listen 127.0.0.1:19022 --admin-listen "" --worker http://127.0.0.1:19105 --policy round_robin >"$run/b.log" 2>&1 & pb=$!
trap 'kill $pa $pb 2>/dev/null; kill $(cat $run/upstreams.pid) $(cat $run/proxy.pid) 2>/dev/null; sleep 0.3; rm -rf $run' EXIT
declare -A port=([direct]=19105 [nginx]=19001 [a]=19021 [b]=19022)
body='{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true}'
for p in 19021 19022; do for _ in $(seq 1 50); do curl -sf -o /dev/null -H 'content-type: application/json' -d "$body" http://127.0.0.1:$p/v1/chat/completions && break; sleep 0.1; done; done
for r in $(seq 1 "$rounds"); do
  order=(direct nginx a b); [ $((r % 2)) -eq 1 ] || order=(b a nginx direct)
  for t in "${order[@]}"; do
    "$A" load --url "http://127.0.0.1:${port[$t]}" --rate 1000 --duration "$secs" --model m \
      --system-chars 800 --prompt-tokens 16 --quiet --connections 1 --stream --out "$run/l.json" >/dev/null
    python3 -c "import json;d=json.load(open('$run/l.json'));print('$r','$t',d['first_chunk_uncorrected_ms']['p50'])"
  done
done | tee "$run/res.txt"
python3 - "$run/res.txt" <<'PY'
import sys, statistics as st
v = {}
for line in open(sys.argv[1]):
    r, t, x = line.split(); v.setdefault(t, []).append(float(x))
m = {t: st.median(x) for t, x in v.items()}
d = m['direct']
print(' '.join(f"{t} {m[t]:.3f} (added {m[t]-d:.3f})" for t in ['direct', 'nginx', 'a', 'b']))
PY
