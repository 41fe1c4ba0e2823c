#include <stdio.h>
#include <time.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <xmmintrin.h>
static inline uint64_t ns(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec*1000000000ull+t.tv_nsec;}
int cmp(const void*a,const void*b){uint64_t x=*(uint64_t*)a,y=*(uint64_t*)b;return x<y?-1:x>y;}
int main(int argc,char**argv){
  int huge=atoi(argv[1]); int k=atoi(argv[2]); int mode=atoi(argv[3]);
  size_t sz=16<<20; char*t=aligned_alloc(1<<21,sz); if(huge) madvise(t,sz,MADV_HUGEPAGE);
  for(size_t i=0;i<sz;i+=64) t[i]=i;
  size_t jsz=128<<20; char*junk=aligned_alloc(1<<21,jsz); madvise(junk,jsz,MADV_HUGEPAGE);
  uint64_t v[500]; uint64_t x=88172645463325252ull; long acc=0;
  size_t idx[64];
  for(int r=0;r<500;r++){
    for(size_t j=0;j<jsz;j+=64) junk[j]++;
    for(int i=0;i<k;i++){x^=x<<13;x^=x>>7;x^=x<<17; idx[i]=(x%(sz/64))*64;}
    uint64_t t0=ns();
    if(mode==0){ for(int i=0;i<k;i++) acc+=t[idx[i]]; }
    else if(mode==1){ for(int i=0;i<k;i++) _mm_prefetch(t+idx[i],_MM_HINT_T0); for(int i=0;i<k;i++) acc+=t[idx[i]]; }
    else { size_t p=0; for(int i=0;i<k;i++){ p=(size_t)t[(idx[i]+p)%sz&~63ul]&0; acc+=p;} }
    v[r]=ns()-t0;
  }
  qsort(v,500,8,cmp);
  printf("huge %d k %d mode %d: p50 %llu p90 %llu (%ld)\n",huge,k,mode,(unsigned long long)v[250],(unsigned long long)v[450],acc);
}
