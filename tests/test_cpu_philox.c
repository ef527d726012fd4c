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

Test(philox, all_four_words_match_random123) {
  /* kiln_philox4 gives the whole block (augmentation draws from words 0 to 2) */
  const struct {
    unsigned long long seed, offset, idx;
    unsigned want[4];
  } kat[3] = {
      {0, 0, 0, {0x6627e8d5u, 0xe169c58du, 0xbc57ac4cu, 0x9b00dbd8u}},
      {~0ull, ~0ull, ~0ull, {0x408f276du, 0x41c83b0eu, 0xa20bc7c6u, 0x6d5451fdu}},
      {0x299f31d0a4093822ull,
       0x0370734413198a2eull,
       0x85a308d3243f6a88ull,
       {0xd16cfe09u, 0x94fdccebu, 0x5001e420u, 0x24126ea1u}},
  };
  for (int k = 0; k < 3; k++) {
    unsigned w[4];
    kiln_philox4(kat[k].seed, kat[k].offset, kat[k].idx, w);
    for (int j = 0; j < 4; j++)
      cr_assert_eq(w[j], kat[k].want[j], "vector %d, word %d: 0x%08x, want 0x%08x", k, j, w[j],
                   kat[k].want[j]);
    cr_assert_eq(kiln_philox(kat[k].seed, kat[k].offset, kat[k].idx), w[0]);
  }
}

Test(philox, integers_below_n_are_in_range_and_even) {
  cr_assert_eq(kiln_philox_below(0u, 5), 0u);
  cr_assert_eq(kiln_philox_below(0xffffffffu, 5), 4u);
  cr_assert_eq(kiln_philox_below(0x80000000u, 2), 1u);
  cr_assert_eq(kiln_philox_below(0x7fffffffu, 2), 0u);
  int count[5] = {0};
  for (unsigned long long i = 0; i < 50000; i++) {
    unsigned v = kiln_philox_below(kiln_philox(4, 1, i), 5);
    cr_assert_lt(v, 5u);
    count[v]++;
  }
  for (int v = 0; v < 5; v++)
    cr_assert(count[v] > 9600 && count[v] < 10400, "%d of 50000 draws are %d", count[v], v);
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
