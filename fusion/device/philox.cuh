/*
 * philox.cuh: Philox4x32-10, the counter-based generator behind dropout. Compiled into every
 * kernel and, as C, into host code (tests and references), so both compute the same numbers.
 * Counter: the element index (64 bits) and the call's offset (64 bits); key: the seed.
 */
#ifndef KILN_PHILOX_CUH
#define KILN_PHILOX_CUH

#include "defs.cuh"
#ifndef __CUDACC__
#include <math.h>
#endif

KILN__FN unsigned int kiln_philox(unsigned long long seed, unsigned long long offset,
                                  unsigned long long idx) {
  unsigned int c0 = (unsigned int)idx, c1 = (unsigned int)(idx >> 32);
  unsigned int c2 = (unsigned int)offset, c3 = (unsigned int)(offset >> 32);
  unsigned int k0 = (unsigned int)seed, k1 = (unsigned int)(seed >> 32);
  for (int r = 0; r < 10; r++) {
    unsigned long long p0 = (unsigned long long)0xD2511F53u * c0;
    unsigned long long p1 = (unsigned long long)0xCD9E8D57u * c2;
    unsigned int n0 = (unsigned int)(p1 >> 32) ^ c1 ^ k0;
    unsigned int n2 = (unsigned int)(p0 >> 32) ^ c3 ^ k1;
    c1 = (unsigned int)p1;
    c3 = (unsigned int)p0;
    c0 = n0;
    c2 = n2;
    k0 += 0x9E3779B9u; /* the Weyl sequence of the key */
    k1 += 0xBB67AE85u;
  }
  return c0;
}

/* A float in [0, 1) from the top 24 bits. */
KILN__FN float kiln_philox_uniform(unsigned long long seed, unsigned long long offset,
                                   unsigned long long idx) {
  return (float)(kiln_philox(seed, offset, idx) >> 8) * (1.0f / 16777216.0f);
}

/* A standard normal value by Box-Muller from the uniforms of counters 2 idx and 2 idx + 1, the
 * first in (0, 1] so that its logarithm is finite. */
KILN__FN float kiln_philox_normal(unsigned long long seed, unsigned long long offset,
                                  unsigned long long idx) {
  float u1 = (float)((kiln_philox(seed, offset, 2 * idx) >> 8) + 1) * (1.0f / 16777216.0f);
  float u2 = (float)(kiln_philox(seed, offset, 2 * idx + 1) >> 8) * (1.0f / 16777216.0f);
  return sqrtf(-2.0f * logf(u1)) * cosf(6.28318530717958648f * u2);
}

#endif
