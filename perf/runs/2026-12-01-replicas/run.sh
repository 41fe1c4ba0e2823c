#!/usr/bin/env bash
# The replica table of issue 16 from the simulator: the built-in workload, 20 seeds (runs),
# 4 engines (the demo's fleet), one router against two replicas without sync, with sync
# (1 virtual ms delivery), and with sync plus engine load reports every second.
set -euo pipefail
cd "$(dirname "$0")"
bin=${KVROUTE_BIN:-../../../target/release/kvroute}
p=cache_aware,smg_cache_aware,cache_aware_events,dynamo_kv,default
for cfg in "one:--replicas 1" "two:--replicas 2" "two_sync:--replicas 2 --sync-delay-ms 1" \
           "two_sync_poll:--replicas 2 --sync-delay-ms 1 --load-poll-ms 1000"; do
  n=${cfg%%:*}
  # shellcheck disable=SC2086
  "$bin" simulate ${cfg#*:} --runs 20 --policies "$p" --out "$n.json" > "$n.txt" 2>&1
done
python3 table.py one two two_sync two_sync_poll
