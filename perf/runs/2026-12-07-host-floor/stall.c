#include <stdio.h>
#include <time.h>
#include <stdint.h>
#include <stdlib.h>
static inline uint64_t ns(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec*1000000000ull+t.tv_nsec;}
int main(int argc,char**argv){
  double secs=argc>1?atof(argv[1]):5;
  uint64_t start=ns(),prev=start,end=start+(uint64_t)(secs*1e9);
  uint64_t hist[8]={0}; uint64_t lost[8]={0}; uint64_t th[8]={1000,2000,5000,10000,20000,50000,100000,1000000};
  uint64_t n=0;
  while(1){uint64_t t=ns(); uint64_t g=t-prev; prev=t; n++;
    for(int i=7;i>=0;i--) if(g>=th[i]){hist[i]++; lost[i]+=g; break;}
    if(t>end)break;}
  printf("reads %llu over %.1fs\n",(unsigned long long)n,secs);
  for(int i=0;i<8;i++) printf(">=%6llu ns: %8llu stalls (%.1f/s), %.3f%% of time\n",(unsigned long long)th[i],(unsigned long long)hist[i],hist[i]/secs,100.0*lost[i]/(secs*1e9));
}
