// Fixed work, timed: N windows of the same K dependent integer steps (no memory), each
// window's elapsed recorded; then the same for a memchr-like read of a 128 KiB buffer
// that stays in L2. Prints p50/p90/p99/p999/max of each.
#include <stdio.h>
#include <time.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
static inline uint64_t ns(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec*1000000000ull+t.tv_nsec;}
int cmp(const void*a,const void*b){uint64_t x=*(uint64_t*)a,y=*(uint64_t*)b;return x<y?-1:x>y;}
static void pr(const char*what,uint64_t*v,int n){qsort(v,n,8,cmp);printf("%s: p50 %llu p90 %llu p99 %llu p999 %llu max %llu  p99/p50 %.2f\n",what,(unsigned long long)v[n/2],(unsigned long long)v[n*9/10],(unsigned long long)v[n*99/100],(unsigned long long)v[n*999/1000],(unsigned long long)v[n-1],(double)v[n*99/100]/v[n/2]);}
int main(int argc,char**argv){
  uint64_t k=atoll(argv[1]); int n=atoi(argv[2]);
  uint64_t*v=malloc(8*n); volatile uint64_t sink=0;
  for(int i=0;i<n;i++){uint64_t x=i+1,t0=ns(); for(uint64_t j=0;j<k;j++){x^=x<<13;x^=x>>7;x^=x<<17;} v[i]=ns()-t0; sink+=x; for(volatile int z=0;z<2000;z++);}
  pr("alu",v,n);
  size_t len=128*1024; unsigned char*b=malloc(len); memset(b,1,len);
  for(int i=0;i<n;i++){uint64_t t0=ns(); void*p=memchr(b,0xFF,len); v[i]=ns()-t0; sink+=(uintptr_t)p; for(volatile int z=0;z<2000;z++);}
  pr("memchr128k",v,n);
  return 0;
}
