/*
 * test_cpu_philox.c: the Philox 4x32-10 generator that dropout draws from
 * (fusion/device/philox.cuh, compiled here as C), on the host: Random123's published known
 * answers, and uniforms in [0, 1) that are balanced and change with the seed, the offset and the
 * index.
 */
#include "fusion/device/philox.cuh"
#include "helpers.h"

Test(philox, random123_known_answers) {
  /* Random123's kat_vectors for philox4x32-10: counter (c0..c3), key (k0, k1); kiln passes the
   * element index as (c0, c1), the offset as (c2, c3) and the seed as the key. */
  cr_assert_eq(kiln_philox(0, 0, 0), 0x6627e8d5u, "zero counter and key: 0x%08x",
               kiln_philox(0, 0, 0));
  cr_assert_eq(kiln_philox(~0ull, ~0ull, ~0ull), 0x408f276du, "all-ones: 0x%08x",
               kiln_philox(~0ull, ~0ull, ~0ull));
  /* the digits of pi: counter 243f6a88 85a308d3 13198a2e 03707344, key a4093822 299f31d0 */
  unsigned v = kiln_philox(0x299f31d0a4093822ull, 0x0370734413198a2eull, 0x85a308d3243f6a88ull);
  cr_assert_eq(v, 0xd16cfe09u, "pi vector: 0x%08x", v);
}

Test(philox, uniform_is_in_range_and_balanced) {
  double sum = 0;
  int below_quarter = 0;
  for (unsigned long long i = 0; i < 20000; i++) {
    unsigned bits = kiln_philox(12345, 3, i);
    float u = kiln_philox_uniform(12345, 3, i);
    cr_assert_eq(u, (float)(bits >> 8) / 16777216.0f);
    cr_assert(u >= 0.f && u < 1.f, "u %g", u);
    sum += u;
    below_quarter += u < 0.25f;
  }
  cr_assert_float_eq(sum / 20000, 0.5, 0.01);
  cr_assert(below_quarter > 4700 && below_quarter < 5300, "%d of 20000 below 0.25", below_quarter);
  /* the offset and the seed change the stream */
  cr_assert_neq(kiln_philox(1, 0, 5), kiln_philox(1, 1, 5));
  cr_assert_neq(kiln_philox(1, 0, 5), kiln_philox(2, 0, 5));
  cr_assert_neq(kiln_philox(1, 0, 5), kiln_philox(1, 0, 6));
}
