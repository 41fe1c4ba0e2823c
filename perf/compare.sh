#!/usr/bin/env bash
# kvroute against nginx, the reference proxy, side by side on loopback (issue 15).
#
# Four trivial upstreams (nginx, perf/compare/upstreams.conf: every request gets the same
# 308-byte chat completion), then, in interleaved rounds, `wrk -t2 -c64` POSTing ~1 KB chat
# bodies (perf/compare/chat.lua: a shared 800-character system prompt + one of 1,000 user
# questions) at each target:
#   direct     straight at one upstream (the ceiling)
#   nginx      perf/compare/proxy.conf: 2 workers, keep-alive upstream, round robin
#   rr         kvroute serve --policy round_robin
#   text       kvroute serve --policy cache_aware (string tree on the raw text)
#   default    kvroute serve (the default policy, text tree)
#   token      kvroute serve --policy cache_aware --tokenizer builtin:qwen3 (token mode)
# CPU per request is read from /proc/PID/stat (utime + stime of the proxy's processes) around
# each run. Every server runs for the whole script, so the token server's state grows round
# after round: its last round against its first is the state-growth ratio, printed raw and
# paired (its last round's ratio to nginx over its first's: the machine's drift cancels).
# With KVROUTE_BASE_BIN=PATH (another build, e.g. the commit before a change): also
#   default@base, token@base   the same two servers run by that build, in the same rounds,
# so a change's effect on throughput and CPU per request is read side by side.
# Prints per target the median req/s and CPU µs/request over the rounds and both as ratios
# to nginx's (the median of each round's ratio: paired, so the machine's drift between rounds
# cancels; odd rounds run the targets in order, even rounds in reverse), and writes every
# round to OUT/rounds.tsv and the summary to OUT/summary.tsv.
#
# With --rate R1,R2,..: also fixed-rate runs (`kvroute load`, latency from the scheduled
# send time) through nginx and through kvroute (rr and token), p50/p99 per rate, and the
# time to the first SSE chunk on a reused connection, streaming, straight at an SSE upstream,
# through nginx and through kvroute (interleaved rounds, medians).
#
# Usage: perf/compare.sh [--rounds N (3)] [--secs S (10)] [--connections C (64)]
#                        [--rate R1,R2,..] [--out DIR (perf/runs/DATE-compare)]
# Needs: nginx and wrk (apt install nginx wrk); a release build (made if missing).
# Throughput here is noisy: read ratios from one run of this script, never across runs.
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=3 secs=10 conns=64 rates="" out="perf/runs/$(date +%F)-compare"
while [ $# -gt 0 ]; do
  case "$1" in
    --rounds) rounds=$2; shift 2 ;;
    --secs) secs=$2; shift 2 ;;
    --connections) conns=$2; shift 2 ;;
    --rate) rates=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    *) echo "compare.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
for tool in nginx wrk; do
  command -v "$tool" >/dev/null || { echo "compare.sh: $tool not found (apt install nginx wrk)" >&2; exit 1; }
done
bin=${KVROUTE_BIN:-target/release/kvroute}
[ -x "$bin" ] || cargo build --release -p kvroute-io
mkdir -p "$out"
run=$(mktemp -d /tmp/kvroute-compare.XXXXXX)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  for c in upstreams proxy; do
    [ -f "$run/$c.pid" ] && kill "$(cat "$run/$c.pid")" 2>/dev/null || true
  done
  sleep 0.3; rm -rf "$run"
}
trap cleanup EXIT
conf=$PWD/perf/compare
nginx -c "$conf/upstreams.conf" -p "$run/"
nginx -c "$conf/proxy.conf" -p "$run/"
workers=()
for p in 19101 19102 19103 19104; do workers+=(--worker "http://127.0.0.1:$p"); done
declare -A port=([direct]=19101 [nginx]=19000 [rr]=19011 [text]=19012 [default]=19013 [token]=19014
                 [default@base]=19016 [token@base]=19017)
declare -A flags=([rr]="--policy round_robin" [text]="--policy cache_aware" [default]=""
                  [token]="--policy cache_aware --tokenizer builtin:qwen3")
flags[default@base]=${flags[default]} flags[token@base]=${flags[token]}
declare -A pid
targets=(direct nginx rr text default token)
servers=(rr text default token)
base_bin=${KVROUTE_BASE_BIN:-}
if [ -n "$base_bin" ]; then
  [ -x "$base_bin" ] || { echo "compare.sh: KVROUTE_BASE_BIN=$base_bin is not executable" >&2; exit 1; }
  targets+=(default@base token@base) servers+=(default@base token@base)
fi
for t in "${servers[@]}"; do
  b=$bin; [ "${t#*@}" = base ] && b=$base_bin
  # The access log off, as nginx's (access_log off): both measure the proxy, not its log.
  # shellcheck disable=SC2086
  RUST_LOG=warn "$b" serve --listen "127.0.0.1:${port[$t]}" --admin-listen "" "${workers[@]}" ${flags[$t]} \
    >"$run/$t.log" 2>&1 &
  pids+=($!); pid[$t]=$!
done
pid[nginx]=$(cat "$run/proxy.pid")
body='{"model":"m","messages":[{"role":"user","content":"hi"}]}'
for t in "${targets[@]}"; do
  ok=""
  for _ in $(seq 1 50); do  # bounded: 50 × 0.1 s
    if curl -sf -o /dev/null -H 'content-type: application/json' -d "$body" \
      "http://127.0.0.1:${port[$t]}/v1/chat/completions"; then ok=1; break; fi
    sleep 0.1
  done
  [ -n "$ok" ] || { echo "compare.sh: $t on port ${port[$t]} does not answer" >&2; cat "$run/$t.log" >&2 || true; exit 1; }
done

hz=$(getconf CLK_TCK)
# CPU ticks (utime + stime) of a process and its children processes (nginx's workers).
ticks() {
  local total=0 p
  for p in "$1" $(pgrep -P "$1" || true); do
    total=$((total + $(awk '{print $14 + $15}' "/proc/$p/stat")))
  done
  echo "$total"
}
echo -e "round\ttarget\treq_per_s\tcpu_us_per_req\terrors" > "$out/rounds.tsv"
for r in $(seq 1 "$rounds"); do
  # Odd rounds run the targets in order, even rounds in reverse: a drift of the machine's
  # speed during a round then favours no target over the run.
  order=("${targets[@]}")
  [ $((r % 2)) -eq 1 ] || order=($(printf '%s\n' "${targets[@]}" | tac))
  for t in "${order[@]}"; do
    before=0; [ "$t" = direct ] || before=$(ticks "${pid[$t]}")
    wrk -t2 -c"$conns" -d"${secs}s" -s "$conf/chat.lua" "http://127.0.0.1:${port[$t]}" > "$run/wrk.txt"
    after=0; [ "$t" = direct ] || after=$(ticks "${pid[$t]}")
    reqs=$(awk '/requests in/ {print $1}' "$run/wrk.txt")
    rps=$(awk '/Requests\/sec/ {print $2}' "$run/wrk.txt")
    errs=$(awk '/Non-2xx/ {print $5} /Socket errors/ {gsub(",", ""); print $4 + $6 + $8 + $10}' "$run/wrk.txt" \
      | awk '{s += $1} END {print s + 0}')
    cpu="-"
    [ "$t" = direct ] || cpu=$(awk -v d=$((after - before)) -v hz="$hz" -v n="$reqs" \
      'BEGIN {printf "%.1f", d / hz / n * 1e6}')
    echo -e "$r\t$t\t$rps\t$cpu\t$errs" | tee -a "$out/rounds.tsv"
  done
done

python3 - "$out" "$rounds" <<'EOF'
import csv, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
rows = list(csv.DictReader(open(f"{out}/rounds.tsv"), delimiter="\t"))
targets = list(dict.fromkeys(r["target"] for r in rows))
med = lambda xs: statistics.median(xs) if xs else float("nan")
# The ratios to nginx are paired: each round's value over nginx's in the same round, then
# the median over the rounds. A slow minute of the machine then moves both sides of a ratio
# instead of one median; the range of the per-round ratios is printed beside it.
by = {(int(r["round"]), r["target"]): r for r in rows}
def ratios(t, col):
    out = []
    for k in range(1, rounds + 1):
        a, n = by.get((k, t)), by.get((k, "nginx"))
        if a and n and a[col] != "-" and n[col] != "-" and float(n[col]) > 0:
            out.append(float(a[col]) / float(n[col]))
    return out
summary = {}
for t in targets:
    rs = [r for r in rows if r["target"] == t]
    rps = [float(r["req_per_s"]) for r in rs]
    cpu = [float(r["cpu_us_per_req"]) for r in rs if r["cpu_us_per_req"] != "-"]
    rr = ratios(t, "req_per_s")
    # State growth: the last round against the first, raw and paired (each round's ratio
    # to nginx), so that the machine slowing down over the script is not read as growth.
    summary[t] = (med(rps), med(cpu) if cpu else None, sum(int(r["errors"]) for r in rs),
                  rps[-1] / rps[0] if rps and rps[0] else float("nan"),
                  rr, ratios(t, "cpu_us_per_req"),
                  rr[-1] / rr[0] if len(rr) == rounds and rr[0] else float("nan"))
lines = ["target\treq_per_s\tvs_nginx\tvs_nginx_min\tvs_nginx_max\tcpu_us_per_req\tcpu_vs_nginx\terrors\tlast_over_first\tlast_over_first_paired"]
print(f"\nmedians of {rounds} interleaved rounds; x nginx: median of the per-round ratios (range)")
print(f"{'target':<12} {'req/s':>9} {'× nginx':>8} {'range':>11} {'CPU µs/req':>11} {'× nginx':>8} {'errors':>7} {'last/first':>10} {'paired':>7}")
for t, (rps, cpu, errs, growth, rr, cr, paired) in summary.items():
    cpu_s = f"{cpu:.1f}" if cpu is not None else "-"
    cpu_r = f"{med(cr):.2f}" if cr else "-"
    rng = f"{min(rr):.2f}-{max(rr):.2f}"
    print(f"{t:<12} {rps:>9.0f} {med(rr):>8.2f} {rng:>11} {cpu_s:>11} {cpu_r:>8} {errs:>7} {growth:>10.2f} {paired:>7.2f}")
    lines.append(f"{t}\t{rps:.0f}\t{med(rr):.3f}\t{min(rr):.3f}\t{max(rr):.3f}\t{cpu_s}\t{cpu_r}\t{errs}\t{growth:.3f}\t{paired:.3f}")
open(f"{out}/summary.tsv", "w").write("\n".join(lines) + "\n")
EOF
echo "wrote $out/rounds.tsv and $out/summary.tsv"

[ -n "$rates" ] || exit 0
# Fixed-rate runs: `kvroute load` schedules request i at i / R s and measures from that time
# (coordinated omission cannot hide a stall); same bodies' shape as chat.lua (800-character
# system prompt, a 16-token question).
RUST_LOG=warn "$bin" serve --listen 127.0.0.1:19015 --admin-listen "" --worker http://127.0.0.1:19105 \
  --policy round_robin >"$run/sse.log" 2>&1 &
pids+=($!)
port[sse]=19015 port[sse_direct]=19105 port[sse_nginx]=19001
for _ in $(seq 1 50); do  # bounded: 50 x 0.1 s
  curl -sf -o /dev/null -H 'content-type: application/json' -d "$body" \
    http://127.0.0.1:19015/v1/chat/completions && break
  sleep 0.1
done
load() {  # target rate extra-flags... -> one line of rates.tsv
  local t=$1 r=$2; shift 2
  "$bin" load --url "http://127.0.0.1:${port[$t]}" --rate "$r" --duration "$secs" --model m \
    --system-chars 800 --prompt-tokens 16 --quiet --out "$run/load.json" "$@" >/dev/null
  python3 - "$run/load.json" "$t" "$r" >> "$out/rates.tsv" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
c, f = d["corrected_ms"], d["first_chunk_uncorrected_ms"]
print(f"{sys.argv[3]}\t{sys.argv[2]}\t{c['p50']}\t{c['p99']}\t{f['p50']}\t{d['achieved_rate']:.0f}\t{d['errors'] + d['unsent']}")
PY
}
echo -e "rate\ttarget\tp50_ms\tp99_ms\tfirst_chunk_p50_ms\tachieved\terrors" > "$out/rates.tsv"
for r in ${rates//,/ }; do
  for t in nginx rr token; do load "$t" "$r" --connections "$conns"; done
done
# The first SSE chunk on one reused connection: straight at the SSE upstream, through nginx
# and through kvroute, in interleaved rounds; each proxy's median less the direct median is
# what it adds (nginx's is the floor of one proxy hop on this machine).
for _ in $(seq 1 "$rounds"); do
  for t in sse_direct sse_nginx sse; do load "$t" 1000 --connections 1 --stream; done
done
python3 - "$out" <<'EOF2'
import csv, statistics, sys
rows = list(csv.DictReader(open(f"{sys.argv[1]}/rates.tsv"), delimiter="\t"))
print(f"\n{'rate':>7} {'target':<10} {'p50 ms':>8} {'p99 ms':>8} {'achieved':>9} {'errors':>7}")
for r in rows:
    if not r["target"].startswith("sse"):
        print(f"{r['rate']:>7} {r['target']:<10} {float(r['p50_ms']):>8.3f} {float(r['p99_ms']):>8.3f} {r['achieved']:>9} {r['errors']:>7}")
sse = {}
for r in rows:
    if r["target"].startswith("sse"):
        sse.setdefault(r["target"], []).append(float(r["first_chunk_p50_ms"]))
sse = {t: statistics.median(v) for t, v in sse.items()}
print("first SSE chunk p50 on a reused connection, medians of the rounds:")
print(f"  direct {sse['sse_direct']:.3f} ms; through nginx {sse['sse_nginx']:.3f} ms, added "
      f"{sse['sse_nginx'] - sse['sse_direct']:.3f} ms; through kvroute {sse['sse']:.3f} ms, added "
      f"{sse['sse'] - sse['sse_direct']:.3f} ms")
EOF2
echo "wrote $out/rates.tsv"
