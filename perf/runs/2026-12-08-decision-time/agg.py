import collections,re,sys
stacks=open(sys.argv[1]).read().split('\n\n')
n=0; leaf=collections.Counter(); kids=collections.Counter(); grand=collections.Counter(); ggrand=collections.Counter()
tot=0
def sym(l):
    l=l.strip()
    p=l.split(' ',1)
    s=p[1] if len(p)>1 else p[0]
    s=re.sub(r'\+0x[0-9a-f]+ \(.*\)$','',s)
    s=re.sub(r' \(.*\)$','',s)
    return s
for st in stacks:
    lines=[l for l in st.strip().split('\n') if l.strip()]
    if len(lines)<2: continue
    syms=[sym(l) for l in lines[1:]]
    tot+=1
    idx=[i for i,s in enumerate(syms) if 'fleet_bench::warm_turn' in s]
    if not idx: continue
    n+=1
    i=idx[0]
    leaf[syms[0][:110]]+=1
    below=syms[:i][::-1]
    below=[b for b in below if 'timed_decision' not in b]
    if below: kids[below[0][:90]]+=1
    if len(below)>1: grand[(below[0][:50]+' > '+below[1][:90])]+=1
    if len(below)>2: ggrand[(below[1][:50]+' > '+below[2][:90])]+=1
print('samples', tot, 'under warm_turn', n)
print('--- children of timed_decision')
for s,c in kids.most_common(20): print(f'{100*c/n:5.1f} {s}')
print('--- grandchildren')
for s,c in grand.most_common(35): print(f'{100*c/n:5.1f} {s}')
print('--- great-grandchildren')
for s,c in ggrand.most_common(35): print(f'{100*c/n:5.1f} {s}')
print('--- leaves')
for s,c in leaf.most_common(45): print(f'{100*c/n:5.1f} {s}')
