#!/usr/bin/env bash
# A/B of bench decision, pinned to core 1, interleaved.
cd /work/main
for r in 1 2 3; do
  for b in base:/tmp/s20/wt-target/release/kvroute new:target/release/kvroute; do
    n=${b%%:*}; bin=${b#*:}
    taskset -c 1 $bin bench decision --out /tmp/s20/ab-$n-$r.json > /dev/null 2>&1
    python3 -c "
import json;j=json.load(open('/tmp/s20/ab-$n-$r.json'))
r=j['runs'][2]; s=r['turn10_stages']
print('$n', $r, r.get('policy'), {k:v for k,v in s.items()})
"
  done
done
