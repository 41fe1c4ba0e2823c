import sys,struct
pid=int(sys.argv[1]); addr=int(sys.argv[2],16); size=int(sys.argv[3])
pm=open(f'/proc/{pid}/pagemap','rb'); kf=open('/proc/kpageflags','rb')
pages=size//4096; present=thp=0
for i in range(0,pages):
    va=addr+i*4096
    pm.seek(va//4096*8); e=struct.unpack('<Q',pm.read(8))[0]
    if not (e>>63)&1: continue
    present+=1
    pfn=e&((1<<55)-1)
    kf.seek(pfn*8); f=struct.unpack('<Q',kf.read(8))[0]
    if (f>>22)&1: thp+=1
print(f'pages {pages} present {present} thp {thp}')
