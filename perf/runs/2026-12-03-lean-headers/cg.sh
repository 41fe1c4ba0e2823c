#!/usr/bin/env bash
# callgrind instructions per SSE request through `kvroute serve --shards 1 --policy round_robin`.
# Usage: cg.sh BIN OUTFILE [requests=1000]
set -euo pipefail
cd "$(dirname "$0")/../../.."
BIN=$1 OUT=$2 N=${3:-1000}
run=$(mktemp -d /tmp/cg.XXXXXX)
port=$((19040 + $$ % 50))
nginx -c "$PWD/perf/compare/upstreams.conf" -p "$run/"
RUST_LOG=warn valgrind --tool=callgrind --callgrind-out-file="$run/cg.out" "$BIN" serve --shards 1 \
  --listen 127.0.0.1:$port --admin-listen "" --worker http://127.0.0.1:19105 --policy round_robin >"$run/serve.log" 2>&1 & vp=$!
trap 'kill $(cat $run/upstreams.pid) 2>/dev/null; kill -9 $vp 2>/dev/null; sleep 1' EXIT
body='{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true}'
for _ in $(seq 1 100); do curl -sf -o /dev/null -H 'content-type: application/json' -d "$body" http://127.0.0.1:$port/v1/chat/completions && break; sleep 0.3; done
"$BIN" load --url http://127.0.0.1:$port --rate 200 --duration 1 --model m --system-chars 800 --prompt-tokens 16 --quiet --connections 1 --stream >/dev/null
callgrind_control --zero $vp >/dev/null
"$BIN" load --url http://127.0.0.1:$port --rate 200 --duration $((N / 200)) --model m --system-chars 800 --prompt-tokens 16 --quiet --connections 1 --stream --out "$run/l.json" >/dev/null
callgrind_control --dump $vp >/dev/null
sleep 1
f=$(ls -t "$run"/cg.out* | head -1)
callgrind_annotate --inclusive=yes "$f" > "$OUT"
python3 -c "import json;d=json.load(open('$run/l.json'));print('requests',d.get('sent'),'errors',d['errors'],d.get('errors_by_kind'))"; tail -3 $run/serve.log
grep -m1 "PROGRAM TOTALS" "$OUT"
