#!/usr/bin/env bash
set -euo pipefail
cd "$(dirname "$0")/../../.."
run=$(mktemp -d /tmp/growth.XXXXXX); conf=$PWD/perf/compare
nginx -c "$conf/upstreams.conf" -p "$run/"; nginx -c "$conf/proxy.conf" -p "$run/"
w=(); for p in 19101 19102 19103 19104; do w+=(--worker http://127.0.0.1:$p); done
RUST_LOG=warn ${KVROUTE_BIN:-target/release/kvroute} serve --listen 127.0.0.1:19014 --admin-listen "" "${w[@]}" --policy cache_aware --tokenizer builtin:qwen3 > $run/t.log 2>&1 & tp=$!
trap 'kill $tp; kill $(cat $run/upstreams.pid) $(cat $run/proxy.pid); sleep 0.3; rm -rf $run' EXIT
sleep 2
for r in 1 2 3 4 5; do
  for t in 19014 19000; do
    rps=$(wrk -t2 -c64 -d8s -s $conf/chat.lua http://127.0.0.1:$t | awk '/Requests\/sec/ {print $2}')
    echo "$r $t $rps"
  done
done
