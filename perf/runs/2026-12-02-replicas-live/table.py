"""Medians over rounds of run.sh's demo JSON: hit %, TTFT p99 ms, max/mean load."""
import glob, json, os, statistics, sys

d = sys.argv[1]
settings = [("one", "1 router"), ("two", "2 replicas, no sync"), ("nats", "2 replicas, NATS")]
cells = {}
for key, _ in settings:
    for f in sorted(glob.glob(os.path.join(d, f"{key}-*.json"))):
        for p in json.load(open(f))["policies"]:
            c = cells.setdefault((key, p["policy"]), [[], [], [], []])
            c[0].append(p["hit_rate"] * 100)
            c[1].append(p["ttft_ms"]["p99"])
            c[2].append(p["max_over_mean_load"])
            c[3].append(p["simulated_hit_rate"] * 100)
policies = sorted({p for _, p in cells}, key=["cache_aware", "cache_aware_events", "default"].index)
rounds = max(len(v[0]) for v in cells.values())
print(f"Medians of {rounds} rounds; each cell: hit % / TTFT p99 ms / max/mean (simulated hit %)\n")
print("| policy | " + " | ".join(n for _, n in settings) + " |")
print("|---" * (len(settings) + 1) + "|")
for pol in policies:
    row = []
    for key, _ in settings:
        c = cells.get((key, pol))
        if not c:
            row.append("–")
            continue
        m = [statistics.median(x) for x in c]
        row.append(f"{m[0]:.1f} % / {m[1]:,.0f} / {m[2]:.2f} ({m[3]:.1f} %)")
    name = {"cache_aware": "cache_aware (text)", "cache_aware_events": "cache_aware_events",
            "default": "default (predicted_ttft, events)"}[pol]
    print(f"| {name} | " + " | ".join(row) + " |")
