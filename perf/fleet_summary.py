"""Medians over rounds of perf/fleet-compare.sh's reports: base, new, new / base (µs)."""
import glob, json, statistics, sys

out, sizes = sys.argv[1], sys.argv[2:]
def after_head(r, q):
    """The stage after the request leaves (`after_head`; a build before it had `record`)."""
    st = r[f"stages_{q}_ns"]
    return st["after_head"] if "after_head" in st else st["record"]


rows = [
    ("decision p50", lambda r: r["decision_p50_ns"]),
    ("decision p99", lambda r: r["decision_p99_ns"]),
    ("parse_tokenize p50", lambda r: r["stages_p50_ns"]["parse_tokenize"]),
    ("parse_tokenize p99", lambda r: r["stages_p99_ns"]["parse_tokenize"]),
    ("facts p50", lambda r: r["stages_p50_ns"]["facts"]),
    ("decide p50", lambda r: r["stages_p50_ns"]["decide"]),
    ("book p50", lambda r: r["stages_p50_ns"]["book"]),
    ("after_head (record) p50", lambda r: after_head(r, "p50")),
    ("after_head (record) p99", lambda r: after_head(r, "p99")),
    ("decide p99", lambda r: r["stages_p99_ns"]["decide"]),
    ("from token ids p50", lambda r: r["from_ids"]["p50_ns"]),
    ("body read once p50 (baseline)", lambda r: r["body_read"]["p50_ns"]),
    ("decision p50 / body read p50", lambda r: r["decision_p50_ns"] / r["body_read"]["p50_ns"] * 1000),
    # The host's speed moves a round's stages together: the decide stage over the parse and
    # tokenize stage of the same round is the ratio to read when only decide's code changed.
    ("decide p50 / parse_tokenize p50", lambda r: r["stages_p50_ns"]["decide"] / r["stages_p50_ns"]["parse_tokenize"] * 1000),
    ("decide p99 / parse_tokenize p99", lambda r: r["stages_p99_ns"]["decide"] / r["stages_p99_ns"]["parse_tokenize"] * 1000),
]
for size in sizes:
    runs = {b: [json.load(open(f)) for f in sorted(glob.glob(f"{out}/{size}-{b}-*.json"))] for b in ("base", "new")}
    n = min(len(runs["base"]), len(runs["new"]))
    print(f"\n## {size} ({n} rounds, medians)\n")
    print("| µs | base | new | new / base |\n|---|---|---|---|")
    for name, f in rows:
        b = statistics.median(f(r) for r in runs["base"]) / 1000
        v = statistics.median(f(r) for r in runs["new"]) / 1000
        print(f"| {name} | {b:.1f} | {v:.1f} | {v / b:.2f} |")
