/*
 * test_gpu_memory.c: the caching allocator's statistics on the GPU: a new persistent tensor is in
 * use, a freed one is cached for reuse, and the peak never falls.
 * Without a GPU every test skips, saying why.
 */
#include "helpers.h"

/* ---------------------------------------------------------------- memory statistics */

Test(gpu_ops, memory_stats) {
  TH_GPU_CTX_EAGER(ctx);
  const size_t bytes = (size_t)(1 << 20) * sizeof(float);
  kiln_mem_stats s0, s1, s2;
  cr_assert_eq(kiln_sync(ctx), KILN_OK, "kiln_sync: %s", th_err(ctx));
  kiln_memory_stats(ctx, &s0);
  kiln_tensor *t = kiln_tensor_new(ctx, KILN_DTYPE_F32, KILN_SHAPE(1 << 20));
  cr_assert_not_null(t, "kiln_tensor_new f32 [1048576]: %s", th_err(ctx));
  kiln_memory_stats(ctx, &s1);
  cr_assert(s1.in_use >= s0.in_use + bytes,
            "memory stats: in_use %zu after a new [1048576] f32 tensor, was %zu: want a growth "
            "of at least %zu",
            s1.in_use, s0.in_use, bytes);
  cr_assert(s1.peak >= s1.in_use, "memory stats: peak %zu < in_use %zu", s1.peak, s1.in_use);
  cr_assert_eq(s1.reserved, s1.in_use + s1.cached,
               "memory stats: reserved %zu != in_use %zu + cached %zu", s1.reserved, s1.in_use,
               s1.cached);
  kiln_tensor_free(t);
  kiln_memory_stats(ctx, &s2);
  cr_assert(s2.in_use + bytes <= s1.in_use,
            "memory stats: in_use %zu after freeing the [1048576] tensor, was %zu: want a drop of "
            "at least %zu",
            s2.in_use, s1.in_use, bytes);
  cr_assert(s2.cached >= s1.cached + bytes,
            "memory stats: cached %zu after freeing the [1048576] tensor, was %zu: want a growth "
            "of at least %zu",
            s2.cached, s1.cached, bytes);
  cr_assert(s2.peak >= s1.in_use, "memory stats: peak %zu fell below the earlier in_use %zu",
            s2.peak, s1.in_use);
  th_assert_ok(ctx);
  th_ctx_free(ctx);
}
