"""Means over the runs of each configuration's JSON: hit %, TTFT p99 ms, max/mean load."""
import json
import statistics as st
import sys

print("| policy | " + " | ".join(sys.argv[1:]) + " |")
print("|---|" + "---|" * (len(sys.argv) - 1))
rows = {}
for n in sys.argv[1:]:
    for run in json.load(open(f"{n}.json"))["runs"]:
        for p in run["policies"]:
            rows.setdefault(p["policy"], {}).setdefault(n, []).append(p)
for pol, by in rows.items():
    cells = []
    for n in sys.argv[1:]:
        v = by[n]
        cells.append(f'{100 * st.mean(x["hit_rate"] for x in v):.1f} % / '
                     f'{st.mean(x["ttft_ms"]["p99"] for x in v):,.0f} ms / '
                     f'{st.mean(x["max_over_mean_load"] for x in v):.2f}')
    print(f"| {pol} | " + " | ".join(cells) + " |")
