#include <stdio.h>
#include <time.h>
#include <stdint.h>
#include <stdlib.h>
static inline uint64_t ns(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec*1000000000ull+t.tv_nsec;}
int cmp(const void*a,const void*b){uint64_t x=*(uint64_t*)a,y=*(uint64_t*)b;return x<y?-1:x>y;}
int main(int argc,char**argv){
  uint64_t len=atoi(argv[1]); int n=atoi(argv[2]);
  uint64_t*v=malloc(8*n);
  for(int i=0;i<n;i++){uint64_t t0=ns(),t; while((t=ns())-t0<len); v[i]=t-t0; for(volatile int k=0;k<2000;k++);}
  qsort(v,n,8,cmp);
  printf("spin %llu ns: p50 %llu p90 %llu p99 %llu p999 %llu max %llu\n",(unsigned long long)len,(unsigned long long)v[n/2],(unsigned long long)v[n*9/10],(unsigned long long)v[n*99/100],(unsigned long long)v[n*999/1000],(unsigned long long)v[n-1]);
}
