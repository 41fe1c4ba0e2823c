#include <stdio.h>
#include <time.h>
#include <stdint.h>
#include <stdlib.h>
static inline uint64_t ns(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec*1000000000ull+t.tv_nsec;}
int cmp(const void*a,const void*b){uint64_t x=*(uint64_t*)a,y=*(uint64_t*)b;return x<y?-1:x>y;}
int main(int argc,char**argv){
  size_t lines=(size_t)atol(argv[1])<<20>>6; int hops=atoi(argv[2]); int n=atoi(argv[3]);
  uint64_t*buf=aligned_alloc(1<<21,lines*64);
  // random cyclic permutation over lines
  size_t*perm=malloc(lines*sizeof(size_t)); for(size_t i=0;i<lines;i++)perm[i]=i;
  srand(1); for(size_t i=lines-1;i>0;i--){size_t j=((size_t)rand()*RAND_MAX+rand())%(i+1);size_t t=perm[i];perm[i]=perm[j];perm[j]=t;}
  for(size_t i=0;i<lines;i++) buf[perm[i]*8]=perm[(i+1)%lines]*8;
  free(perm);
  uint64_t*v=malloc(8*n); size_t p=0;
  for(int i=0;i<n;i++){uint64_t t0=ns(); for(int h=0;h<hops;h++) p=buf[p]; v[i]=ns()-t0; for(volatile int k=0;k<3000;k++);}
  qsort(v,n,8,cmp);
  printf("chase %d hops in %zu MB: p50 %llu p90 %llu p99 %llu p999 %llu (%zu)\n",hops,lines*64>>20,(unsigned long long)v[n/2],(unsigned long long)v[n*9/10],(unsigned long long)v[n*99/100],(unsigned long long)v[n*999/1000],p);
}
