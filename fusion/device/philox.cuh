/*
 * philox.cuh: Philox4x32-10, the counter-based generator behind dropout, the random tensors and
 * image augmentation. Compiled into every kernel and, as C, into host code (tests and references),
 * so both compute the same numbers. Counter: the element index (64 bits) and the call's offset
 * (64 bits); key: the seed.
 */
#ifndef KILN_PHILOX_CUH
#define KILN_PHILOX_CUH

#include "defs.cuh"
#ifndef __CUDACC__
#include <math.h>
#endif

/* The four 32-bit words of the block for counter (idx, offset) and key seed, into w. */
KILN__FN void kiln_philox4(unsigned long long seed, unsigned long long offset,
                           unsigned long long idx, unsigned int w[4]) {
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
  w[0] = c0;
  w[1] = c1;
  w[2] = c2;
  w[3] = c3;
}

/* The block's first word: what dropout and the random tensors draw from. */
KILN__FN unsigned int kiln_philox(unsigned long long seed, unsigned long long offset,
                                  unsigned long long idx) {
  unsigned int w[4];
  kiln_philox4(seed, offset, idx, w);
  return w[0];
}

/* An integer in [0, n) from 32 random bits: the high word of bits * n (each value has
 * probability within 2^-32 of 1/n). */
KILN__FN unsigned int kiln_philox_below(unsigned int bits, unsigned int n) {
  return (unsigned int)(((unsigned long long)bits * n) >> 32);
}

/* The Philox offset of the alternating flip's per-sample bits (kiln_augment): a fixed one, so
 * that a sample's bit is the same every epoch, and one no call's offset (counted up from 0)
 * reaches. */
#define KILN_PHILOX_FLIP_OFFSET 0xFFFFFFFFFFFFFFFFull

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
