"""Markdown table of a `kvroute simulate --out` file: python3 table.py FILE..."""
import json, sys
for path in sys.argv[1:]:
    d = json.load(open(path))
    print(f"\n{path}\n")
    print("| policy | hit % | bound % | TTFT p50 ms | TTFT p99 ms | e2e p99 ms | max/mean | CV | sticky % |")
    print("|---|---|---|---|---|---|---|---|---|")
    for run in d["runs"]:
        for p in run["policies"]:
            print(f"| {p['policy']} | {100*p['hit_rate']:.1f} | {100*p['bound_hit_rate']:.1f} | "
                  f"{p['ttft_ms']['p50']:,.0f} | {p['ttft_ms']['p99']:,.0f} | {p['e2e_ms']['p99']:,.0f} | "
                  f"{p['max_over_mean_load']:.2f} | {p.get('load_cv', 0):.2f} | {100*p['sticky_share']:.1f} |")
