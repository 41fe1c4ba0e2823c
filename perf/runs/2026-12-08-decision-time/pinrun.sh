#!/bin/bash
# usage: pinrun.sh MODE OUT   (MODE none|d1|d0)
mode=$1 out=$2
/tmp/kvr-34b0 bench fleet --workers 4096 --tokens 32768 --seconds 8 > $out.json 2> $out.log &
pid=$!
for i in $(seq 1 600); do
  n=$(ls /proc/$pid/task 2>/dev/null | wc -l)
  [ "$n" -ge 3 ] && break
  sleep 0.05
done
if [ "$mode" != none ]; then
  d=${mode#d}; o=$((1 - d))
  taskset -p -c $d $pid > /dev/null
  for t in $(ls /proc/$pid/task); do [ "$t" != "$pid" ] && taskset -p -c $o $t > /dev/null; done
fi
wait $pid
python3 -c "
import json;r=json.load(open('$out.json'));print('$mode', r['decision_p50_ns'], r['decision_p99_ns'], r['decision_max_ns'])"
