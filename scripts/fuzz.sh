#!/usr/bin/env bash
# Runs every libFuzzer target of fuzz/ (cargo-fuzz, nightly) for a fixed time each, one after
# the other (one core), and prints per target the executions and whether it crashed.
#
# Usage: scripts/fuzz.sh [SECONDS_PER_TARGET]     (default 60)
# Environment:
#   FUZZ_TARGETS    targets to run, space-separated [default: all four]
#   FUZZ_SANITIZER  address (default), none, ... as `cargo fuzz -s`
#   FUZZ_MAX_LEN    libFuzzer -max_len, bytes [default: 4096]
# Seeds come from fuzz/corpus/<target>/ (rewritten by fuzz/make_corpus.py); what libFuzzer
# finds goes to fuzz/target/corpus-work/<target>/ (not committed), crashes to
# fuzz/artifacts/<target>/, full logs to fuzz/target/logs/<target>.log.
# Exits 1 when any target crashed (or found a leak / timeout / OOM), 2 on bad usage.
set -euo pipefail
cd "$(dirname "$0")/.."

secs=${1:-60}
if ! [[ $secs =~ ^[0-9]+$ ]] || ((secs < 1)); then
    echo "usage: $0 [SECONDS_PER_TARGET]" >&2
    exit 2
fi
sanitizer=${FUZZ_SANITIZER:-address}
max_len=${FUZZ_MAX_LEN:-4096}
read -r -a targets <<<"${FUZZ_TARGETS:-http1_request kv_events routing_tokens_header route_key}"

if ! cargo +nightly fuzz --version >/dev/null 2>&1; then
    echo "cargo-fuzz is missing: installing it from crates.io"
    cargo install cargo-fuzz --locked
fi

python3 fuzz/make_corpus.py
echo "building ${#targets[@]} targets (sanitizer: $sanitizer)"
for t in "${targets[@]}"; do
    cargo +nightly fuzz build -s "$sanitizer" "$t"
done

work=fuzz/target/corpus-work
logs=fuzz/target/logs
mkdir -p "$logs"
failed=0
rows=()
for t in "${targets[@]}"; do
    mkdir -p "$work/$t"
    log="$logs/$t.log"
    echo "fuzzing $t for ${secs}s (log: $log)"
    rc=0
    # The outer timeout only guards against a hung process; -max_total_time ends a normal run.
    timeout --kill-after=30 $((secs + 300)) \
        cargo +nightly fuzz run -s "$sanitizer" "$t" "$work/$t" "fuzz/corpus/$t" -- \
        -max_total_time="$secs" -max_len="$max_len" -timeout=10 -rss_limit_mb=2048 \
        -print_final_stats=1 >"$log" 2>&1 || rc=$?
    execs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | tail -n 1 | grep -o '[0-9]*$' || true)
    if [[ -z $execs ]]; then
        # No final stats: take the last "#N ..." status line.
        execs=$(grep -o '^#[0-9]*' "$log" | tail -n 1 | tr -d '#' || true)
    fi
    done_line=$(grep -E '^#[0-9]+[[:space:]]+DONE' "$log" | tail -n 1 || true)
    artifact=$(grep -o 'Test unit written to [^ ]*' "$log" | tail -n 1 | sed 's/Test unit written to //' || true)
    if ((rc == 0)) && [[ -n $done_line ]] && [[ -z $artifact ]]; then
        result="no"
    else
        result="YES (exit $rc${artifact:+, $artifact})"
        failed=1
    fi
    corpus=$(find "$work/$t" -type f | wc -l)
    rows+=("$(printf '%-22s %14s %8s  %s' "$t" "${execs:-?}" "$corpus" "$result")")
    echo "  $t: ${execs:-?} executions, crash: $result"
done

echo
printf '%-22s %14s %8s  %s\n' target executions corpus crashed
for r in "${rows[@]}"; do
    echo "$r"
done
exit "$failed"
