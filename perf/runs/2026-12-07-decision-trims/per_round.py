"""Per-round ratios of a `perf/fleet-compare.sh` output, each stage's p50 first divided by
the same run's body-read p50 (a fixed read of the 128 KB body: the host's speed in that run).
usage: python3 per_round.py DIR ROUNDS [WORKERSxTOKENS]"""
import json,sys,statistics
d=sys.argv[1]; n=int(sys.argv[2]); size=sys.argv[3] if len(sys.argv)>3 else "4096x32768"
rows=[]
for r in range(1,n+1):
    try:
        b=json.load(open(f"{d}/{size}-base-{r}.json")); w=json.load(open(f"{d}/{size}-new-{r}.json"))
    except Exception: continue
    def g(x):
        s=x['stages_p50_ns']; br=x['body_read']['p50_ns']
        return s['parse_tokenize']/br, s['decide']/br, x['decision_p50_ns']/br, x['decision_p99_ns']/br, br
    B=g(b); N=g(w)
    rows.append([N[i]/B[i] for i in range(4)]+[B[4],N[4], b['decision_p50_ns'], w['decision_p50_ns'], b['decision_p99_ns'], w['decision_p99_ns']])
    print(f"r{r}: per body-read new/base: parse {rows[-1][0]:.3f} decide {rows[-1][1]:.3f} whole p50 {rows[-1][2]:.3f} p99 {rows[-1][3]:.3f} | bodyread base {B[4]} new {N[4]} | p50 {rows[-1][6]} {rows[-1][7]} p99 {rows[-1][8]} {rows[-1][9]}")
print("median", [round(statistics.median(c),3) for c in zip(*rows)][:4])
