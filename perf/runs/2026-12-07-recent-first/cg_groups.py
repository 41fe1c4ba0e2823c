"""Last-level misses per timed turn of a `callgrind --cache-sim=yes` profile, grouped by
function: the allocator (mimalloc and `io/src/alloc.rs`), `memchr`, `memcpy`, the tokenizer's
word lookup, the candidates' snapshot, the rest.
usage: python3 cg_groups.py CALLGRIND_OUT TURNS [CALLGRIND_OUT TURNS ...]"""
import re, subprocess, sys

GROUPS = [('allocator', ('mimalloc', 'io/src/alloc.rs')), ('memchr', ('memchr',)),
          ('memcpy', ('memmove',)), ('push_word', ('push_word',)),
          ('snapshot_among', ('snapshot_among',))]

def groups(path):
    out = subprocess.run(['callgrind_annotate', '--inclusive=no', '--auto=no',
                          '--threshold=100', path], capture_output=True, text=True).stdout
    sums = {}
    for line in out.splitlines():
        toks = re.sub(r'\([^)]*\)', '', line).split()
        if len(toks) < 10 or not re.fullmatch(r'[\d,]+', toks[0]) or 'PROGRAM' in line:
            continue
        # Ir Dr Dw I1mr D1mr D1mw ILmr DLmr DLmw function
        vals = [0 if t == '.' else int(t.replace(',', '')) for t in toks[:9]]
        name = ' '.join(toks[9:])
        key = next((g for g, pats in GROUPS if any(p in name for p in pats)), 'other')
        acc = sums.setdefault(key, [0] * 9)
        for i, v in enumerate(vals):
            acc[i] += v
    return sums

args = sys.argv[1:]
for path, turns in zip(args[::2], map(int, args[1::2])):
    sums = groups(path)
    total = sum(v[7] + v[8] for v in sums.values()) / turns
    print(f'{path}: {turns} turns, {total:.0f} last-level misses per turn')
    for key, v in sorted(sums.items(), key=lambda kv: -(kv[1][7] + kv[1][8])):
        print(f'  {key:15s} instructions {v[0] / turns:8.0f}  misses {(v[7] + v[8]) / turns:6.1f}'
              f' (read {v[7] / turns:.1f}, write {v[8] / turns:.1f})')
