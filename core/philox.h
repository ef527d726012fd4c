/*
 * philox.h: Philox4x32-10, the counter-based generator behind dropout, written once as a macro
 * so that the host (tests, references) and the generated CUDA C compute the same numbers.
 * Counter: the element index (64 bits) and the call's offset (64 bits); key: the seed.
 */
#ifndef KILN_PHILOX_H
#define KILN_PHILOX_H

#define KILN__PHILOX_CODE                                                                          \
  KILN__FN unsigned int kiln_philox(unsigned long long seed, unsigned long long offset,            \
                                    unsigned long long idx) {                                      \
    unsigned int c0 = (unsigned int)idx, c1 = (unsigned int)(idx >> 32);                           \
    unsigned int c2 = (unsigned int)offset, c3 = (unsigned int)(offset >> 32);                     \
    unsigned int k0 = (unsigned int)seed, k1 = (unsigned int)(seed >> 32);                         \
    for (int r = 0; r < 10; r++) {                                                                 \
      unsigned long long p0 = (unsigned long long)0xD2511F53u * c0;                                \
      unsigned long long p1 = (unsigned long long)0xCD9E8D57u * c2;                                \
      unsigned int n0 = (unsigned int)(p1 >> 32) ^ c1 ^ k0;                                        \
      unsigned int n2 = (unsigned int)(p0 >> 32) ^ c3 ^ k1;                                        \
      c1 = (unsigned int)p1;                                                                       \
      c3 = (unsigned int)p0;                                                                       \
      c0 = n0;                                                                                     \
      c2 = n2;                                                                                     \
      k0 += 0x9E3779B9u;                                                                           \
      k1 += 0xBB67AE85u;                                                                           \
    }                                                                                              \
    return c0;                                                                                     \
  }                                                                                                \
  KILN__FN float kiln_philox_uniform(unsigned long long seed, unsigned long long offset,           \
                                     unsigned long long idx) {                                     \
    return (float)(kiln_philox(seed, offset, idx) >> 8) * (1.0f / 16777216.0f);                    \
  }

#ifndef __CUDACC_RTC__
#define KILN__FN static inline
KILN__PHILOX_CODE
#undef KILN__FN
#endif

#endif
