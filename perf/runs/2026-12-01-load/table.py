#!/usr/bin/env python3
"""Medians over the rounds of run.sh's --out files: python3 table.py [out dir]."""
import glob, json, os, re, statistics, sys

out = sys.argv[1] if len(sys.argv) > 1 else "/tmp/kvroute-load-run"
cases = {}
for path in sorted(glob.glob(os.path.join(out, "r*-*.json")), key=os.path.getmtime):
    name = re.sub(r"^r\d+-", "", os.path.basename(path)[:-5])
    cases.setdefault(name, []).append(json.load(open(path)))
med = lambda xs: statistics.median(xs)
print("| case | rate | achieved | corrected p50 / p99 ms | uncorrected p50 / p99 ms "
      "| first chunk p50 ms (from send) | late | generator CPU µs/request (rounds) | cores "
      "| target CPU µs/request |")
print("|---|---|---|---|---|---|---|---|---|---|")
for name, runs in cases.items():
    m = lambda f: med([f(r) for r in runs])
    first = (f"{m(lambda r: r['first_chunk_uncorrected_ms']['p50']):.3f}"
             if runs[0]["stream"] else "–")
    print(f"| {name} | {runs[0]['rate']:.0f} | {m(lambda r: r['achieved_rate']):.0f} "
          f"| {m(lambda r: r['corrected_ms']['p50']):.3f} / {m(lambda r: r['corrected_ms']['p99']):.3f} "
          f"| {m(lambda r: r['uncorrected_ms']['p50']):.3f} / {m(lambda r: r['uncorrected_ms']['p99']):.3f} "
          f"| {first} | {m(lambda r: r['late']):.0f} "
          f"| {m(lambda r: r['cpu_us_per_request']):.1f} "
          f"({', '.join('%.0f' % r['cpu_us_per_request'] for r in runs)}) "
          f"| {m(lambda r: r['cpu_cores']):.2f} "
          f"| {m(lambda r: r.get('target_cpu_us_per_request', float('nan'))):.1f} |")
