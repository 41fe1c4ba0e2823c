#!/usr/bin/env bash
# Soak run: unique chat prompts at a fixed rate through `kvroute serve` and simulated engines,
# all on loopback (free ports), sampling the router's RSS and open fds; fails on growth.
#
# Usage: scripts/soak.sh
# Environment (defaults in brackets):
#   SOAK_SECS    length of the load [600]
#   RATE         requests per second, planned ahead (open loop) [50]
#   ENGINES      simulated engines [4]
#   SPEEDUP      engines' --speedup-ratio (modelled times divided by it) [10]
#   MAX_TOKENS   max_tokens of each request [16]
#   SAMPLE_SECS  RSS / fd sampling period [10]
#   WARMUP_SECS  end of warm-up, the baseline of the growth checks [max(60, SOAK_SECS/10),
#                at most SOAK_SECS/2]
#   SOAK_OUT     directory for samples.csv, load.json and the logs
#                [perf/runs/<UTC date>-<host>-soak]
#   KVROUTE_BIN  router binary [target/release/kvroute, built here with cargo]
#   SERVE_ARGS   extra `kvroute serve` flags, e.g. "--max-tree-size 2000000" (split on spaces) []
# Fails (exit 1) when RSS at the end of the load is more than 20% above RSS at warm-up end,
# when open fds grew by more than 16, when any request did not get a 200, or when the router
# died. Load generator: scripts/soak_load.py (Python 3, standard library).
set -euo pipefail
cd "$(dirname "$0")/.."

secs=${SOAK_SECS:-600}
rate=${RATE:-50}
engines=${ENGINES:-4}
speedup=${SPEEDUP:-10}
max_tokens=${MAX_TOKENS:-16}
sample_secs=${SAMPLE_SECS:-10}
default_warm=$((secs / 10 > 60 ? secs / 10 : 60))
default_warm=$((default_warm > secs / 2 ? secs / 2 : default_warm))
warm=${WARMUP_SECS:-$default_warm}
out=${SOAK_OUT:-perf/runs/$(date -u +%F)-$(hostname -s)-soak}
for v in secs engines sample_secs warm max_tokens; do
    if ! [[ ${!v} =~ ^[0-9]+$ ]]; then
        echo "soak.sh: $v must be a whole number (got '${!v}')" >&2
        exit 2
    fi
done
mkdir -p "$out"

bin=${KVROUTE_BIN:-}
if [[ -z $bin ]]; then
    echo "building the release binary (cargo build --release -p kvroute-io)"
    cargo build --release -p kvroute-io
    bin=target/release/kvroute
fi

pids=()
cleanup() {
    for p in "${pids[@]}"; do
        kill "$p" 2>/dev/null || true
    done
    for p in "${pids[@]}"; do
        wait "$p" 2>/dev/null || true
    done
}
trap cleanup EXIT

# Free loopback ports, asked from the kernel (port 0) and released just before use.
read -r -a ports <<<"$(python3 - "$((engines + 1))" <<'PY'
import socket, sys
socks = [socket.socket() for _ in range(int(sys.argv[1]))]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(" ".join(str(s.getsockname()[1]) for s in socks))
PY
)"
router_port=${ports[0]}

# Polls GET /health on 127.0.0.1:$1 for up to 30 s.
wait_healthy() {
    for _ in $(seq 1 300); do
        if curl -fsS -o /dev/null --max-time 1 "http://127.0.0.1:$1/health" 2>/dev/null; then
            return 0
        fi
        sleep 0.1
    done
    echo "soak.sh: nothing healthy on 127.0.0.1:$1 after 30 s" >&2
    return 1
}

workers=()
for i in $(seq 1 "$engines"); do
    p=${ports[$i]}
    "$bin" engine --listen "127.0.0.1:$p" --speedup-ratio "$speedup" --seed "$i" \
        >"$out/engine-$i.log" 2>&1 &
    pids+=($!)
    workers+=(--worker "http://127.0.0.1:$p")
done
for i in $(seq 1 "$engines"); do
    wait_healthy "${ports[$i]}"
done
"$bin" serve --listen "127.0.0.1:$router_port" --admin-listen 127.0.0.1:0 "${workers[@]}" ${SERVE_ARGS:-} >"$out/router.log" 2>&1 &
router=$!
pids+=("$router")
wait_healthy "$router_port"
echo "router pid $router on 127.0.0.1:$router_port, $engines engines (speedup $speedup);" \
    "load: ${rate} req/s for ${secs}s, warm-up ${warm}s, samples every ${sample_secs}s in $out"

csv="$out/samples.csv"
echo "elapsed_s,rss_kb,fds,threads" >"$csv"
t0=$(date +%s)
sample() {
    local rss fds threads
    rss=$(awk '/^VmRSS:/ {print $2}' "/proc/$router/status")
    threads=$(awk '/^Threads:/ {print $2}' "/proc/$router/status")
    fds=$(ls "/proc/$router/fd" | wc -l)
    echo "$(($(date +%s) - t0)),$rss,$fds,$threads" >>"$csv"
}

python3 scripts/soak_load.py --port "$router_port" --rate "$rate" --secs "$secs" \
    --max-tokens "$max_tokens" >"$out/load.json" 2>"$out/load.err" &
load=$!
pids+=("$load")
# Sample while the load runs; bounded by the schedule's length plus the load's drain time.
for _ in $(seq 0 $(((secs + 120) / sample_secs + 1))); do
    kill -0 "$router" 2>/dev/null || break
    sample
    kill -0 "$load" 2>/dev/null || break
    sleep "$sample_secs"
done
load_rc=0
wait "$load" || load_rc=$?
router_alive=yes
kill -0 "$router" 2>/dev/null || router_alive=no
if [[ $router_alive == yes ]]; then
    sleep 1
    sample # after the load: informational
fi

python3 - "$csv" "$out/load.json" "$warm" "$secs" "$load_rc" "$router_alive" <<'PY'
import csv, json, sys
path, load_path, warm, secs, load_rc, alive = sys.argv[1:]
warm, secs = int(warm), int(secs)
rows = [{k: int(v) for k, v in r.items()} for r in csv.DictReader(open(path))]
try:
    load = json.load(open(load_path))
except (OSError, ValueError):
    load = None
print(f"load: {json.dumps(load)}")
failures = []
if alive != "yes":
    failures.append("the router died")
during = [r for r in rows if r["elapsed_s"] <= secs + 5]
warm_row = next((r for r in during if r["elapsed_s"] >= warm), None)
end_row = during[-1] if during else None
after_row = rows[-1] if rows and rows[-1] is not end_row else None
if warm_row is None or end_row is None or warm_row is end_row:
    failures.append("too few samples to compare warm-up and end")
else:
    for name, r in (("warm-up end", warm_row), ("end of load", end_row), ("after load", after_row)):
        if r:
            print(f"{name:12} t={r['elapsed_s']:>4}s  rss={r['rss_kb']} kB  fds={r['fds']}  threads={r['threads']}")
    growth = end_row["rss_kb"] / warm_row["rss_kb"] - 1
    fd_growth = end_row["fds"] - warm_row["fds"]
    print(f"rss growth after warm-up: {growth * 100:+.1f}% (limit +20%); fd growth: {fd_growth:+d} (limit +16)")
    if growth > 0.20:
        failures.append(f"RSS grew {growth * 100:.1f}% after warm-up")
    if fd_growth > 16:
        failures.append(f"open fds grew by {fd_growth}")
if load is None:
    failures.append("the load generator wrote no summary")
else:
    print(f"requests sent: {load['requests_sent']} (planned {load['requests_planned']}); status: {load['status']}; errors: {load['errors']}")
    if int(load_rc) != 0:
        failures.append("not every request got a 200")
print("SOAK " + ("FAILED: " + "; ".join(failures) if failures else "OK"))
sys.exit(1 if failures else 0)
PY
