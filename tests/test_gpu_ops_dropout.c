/*
 * test_gpu_ops_dropout.c: dropout on the GPU: every output 0 or x / (1 - p), the rate, the mask
 * element by element against Philox's own draw, seeds and offsets (reproducible after
 * kiln_manual_seed, fresh for every call), the backward reusing the forward's mask, and the
 * identity in evaluation mode. Without a GPU every test skips, saying why.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fusion/device/philox.cuh"
#include "ref.h"

/* ---------------------------------------------------------------- dropout */

Test(gpu_ops, dropout_values_rate_and_philox_mask) {
  TH_GPU_CTX_EAGER(ctx);
  const int64_t n = 100000;
  const float p = 0.3f;
  float *h;
  kiln_tensor *x = ref_rand_tensor(ctx, KILN_SHAPE(n), 2200, &REF_GEN(0.5f, 1.5f), 0, &h);
  kiln_manual_seed(ctx, 7);
  kiln_step_begin(ctx);
  float *y = ref_read_f32(ctx, kiln_dropout(x, p, 1), "dropout(p 0.3) of [100000]");
  int64_t zeros = 0;
  for (int64_t i = 0; i < n; i++) {
    double kept = (double)h[i] / (1.0 - (double)p);
    cr_assert(y[i] == 0.f || fabs(y[i] - kept) <= 1e-6 + 1e-6 * kept,
              "dropout(p 0.3) of [100000]: element %lld is %.9g, neither 0 nor x/(1-p) = %.9g",
              (long long)i, (double)y[i], kept);
    zeros += y[i] == 0.f;
    int keep = kiln_philox_uniform(7, 0, (unsigned long long)i) >= p;
    cr_assert_eq(y[i] != 0.f, keep,
                 "dropout(p 0.3) of [100000] after kiln_manual_seed(7): element %lld is %s, but "
                 "Philox(seed 7, offset 0, %lld) = %.9g says %s",
                 (long long)i, y[i] != 0.f ? "kept" : "dropped", (long long)i,
                 (double)kiln_philox_uniform(7, 0, (unsigned long long)i), keep ? "keep" : "drop");
  }
  double frac = (double)zeros / (double)n;
  cr_assert(fabs(frac - p) <= 0.01,
            "dropout(p 0.3) of [100000]: %.4f of elements are zero, want "
            "0.3 +- 0.01",
            frac);
  free(y);
  /* a transposed view: every output is still 0 or x / (1 - p) */
  float *ht;
  kiln_tensor *b = ref_rand_tensor(ctx, KILN_SHAPE(40, 50), 2201, &REF_GEN(0.5f, 1.5f), 0, &ht);
  float *yt = ref_read_f32(ctx, kiln_dropout(kiln_transpose(b, 0, 1), p, 1),
                           "dropout(p 0.3) of a transposed [50,40] view");
  int64_t tz = 0;
  for (int r = 0; r < 50; r++)
    for (int c = 0; c < 40; c++) {
      float v = yt[r * 40 + c];
      double kept = (double)ht[c * 50 + r] / (1.0 - (double)p);
      cr_assert(v == 0.f || fabs(v - kept) <= 1e-6 + 1e-6 * kept,
                "dropout(p 0.3) of a transposed [50,40] view: element (%d,%d) is %.9g, neither 0 "
                "nor x/(1-p) = %.9g",
                r, c, (double)v, kept);
      tz += v == 0.f;
    }
  cr_assert(tz > 0 && tz < 2000, "dropout(p 0.3) of a transposed [50,40] view: %lld of 2000 zero",
            (long long)tz);
  free(yt);
  kiln_tensor_free(b);
  free(ht);
  kiln_tensor_free(x);
  free(h);
  th_assert_ok(ctx);
  th_ctx_free(ctx);
}

Test(gpu_ops, dropout_seed_and_offsets) {
  TH_GPU_CTX_EAGER(ctx);
  const int64_t n = 4096;
  kiln_tensor *x = ref_rand_tensor(ctx, KILN_SHAPE(n), 2300, &REF_GEN(0.5f, 1.5f), 0, NULL);
  float *run[2];
  for (int r = 0; r < 2; r++) {
    kiln_manual_seed(ctx, 7);
    kiln_step_begin(ctx);
    run[r] = ref_read_f32(ctx, kiln_dropout(x, 0.3f, 1), "dropout(p 0.3) of [4096] after seed 7");
  }
  for (int64_t i = 0; i < n; i++)
    cr_assert_eq(run[0][i], run[1][i],
                 "dropout(p 0.3) of [4096], two runs after kiln_manual_seed(7): element %lld "
                 "differs: %.9g vs %.9g",
                 (long long)i, (double)run[0][i], (double)run[1][i]);
  /* two calls in a row draw different offsets, hence different masks */
  kiln_manual_seed(ctx, 7);
  kiln_step_begin(ctx);
  kiln_tensor *a = kiln_dropout(x, 0.3f, 1), *b = kiln_dropout(x, 0.3f, 1);
  float *ya = ref_read_f32(ctx, a, "first of two dropout calls"),
        *yb = ref_read_f32(ctx, b, "second of two dropout calls");
  int64_t differ = 0;
  for (int64_t i = 0; i < n; i++)
    differ += (ya[i] == 0.f) != (yb[i] == 0.f);
  cr_assert(differ > n / 10,
            "two consecutive dropout(p 0.3) calls on [4096]: masks differ in %lld elements, want "
            "about 42%%",
            (long long)differ);
  /* the first call after the seed is the one reproduced above */
  for (int64_t i = 0; i < n; i++)
    cr_assert_eq(ya[i], run[0][i],
                 "the first dropout call after kiln_manual_seed(7), element %lld: %.9g, earlier "
                 "run %.9g",
                 (long long)i, (double)ya[i], (double)run[0][i]);
  /* a different seed gives a different mask */
  kiln_manual_seed(ctx, 8);
  kiln_step_begin(ctx);
  float *y8 = ref_read_f32(ctx, kiln_dropout(x, 0.3f, 1), "dropout(p 0.3) of [4096] after seed 8");
  differ = 0;
  for (int64_t i = 0; i < n; i++)
    differ += (y8[i] == 0.f) != (run[0][i] == 0.f);
  cr_assert(differ > n / 10, "dropout masks for seeds 7 and 8 differ in only %lld of 4096",
            (long long)differ);
  free(run[0]);
  free(run[1]);
  free(ya);
  free(yb);
  free(y8);
  kiln_tensor_free(x);
  th_ctx_free(ctx);
}

typedef struct drop_gc {
  uint64_t seed;
  float p;
} drop_gc;

static kiln_tensor *gc_dropout(kiln_tensor *const *in, void *user) {
  const drop_gc *u = user;
  kiln_manual_seed(kiln_tensor_ctx(in[0]), u->seed); /* every evaluation draws the same mask */
  return kiln_dropout(in[0], u->p, 1);
}

Test(gpu_ops, dropout_backward) {
  TH_GPU_CTX_EAGER(ctx);
  const float p = 0.4f;
  float *wh;
  kiln_tensor *x = ref_rand_tensor(ctx, KILN_SHAPE(6, 5), 2400, &REF_GEN(0.5f, 1.5f), 1, NULL);
  kiln_tensor *w = ref_rand_tensor(ctx, KILN_SHAPE(6, 5), 2401, &REF_GEN(-1, 1), 0, &wh);
  kiln_manual_seed(ctx, 3);
  kiln_step_begin(ctx);
  kiln_tensor *y = kiln_dropout(x, p, 1);
  cr_assert_eq(kiln_backward(kiln_sum(kiln_mul(y, w), KILN_ALL_AXES, 0)), KILN_OK,
               "backward of sum(dropout(x, 0.4) * w): %s", th_err(ctx));
  float *yv = ref_read_f32(ctx, y, "dropout(p 0.4) of [6,5]");
  double want[30];
  int kept = 0;
  for (int i = 0; i < 30; i++) {
    int keep = kiln_philox_uniform(3, 0, (unsigned long long)i) >= p;
    cr_assert_eq(yv[i] != 0.f, keep,
                 "dropout(p 0.4) of [6,5] after seed 3: element %d is %s, "
                 "Philox says %s",
                 i, yv[i] != 0.f ? "kept" : "dropped", keep ? "keep" : "drop");
    want[i] = keep ? (double)wh[i] / (1.0 - (double)p) : 0.0;
    kept += keep;
  }
  cr_assert(kept > 0 && kept < 30, "dropout(p 0.4) of [6,5]: %d of 30 kept", kept);
  ref_expect_close(ctx, kiln_tensor_grad(x), KILN_SHAPE(6, 5), want, 1e-6, 1e-6,
                   "gradient of sum(dropout(x, 0.4) * w): w / (1 - p) where kept, 0 where dropped");
  free(yv);
  drop_gc u = {.seed = 3, .p = p};
  ref_expect_gradcheck(ctx, "dropout(p 0.4, re-seeded each evaluation) of [6,5]", gc_dropout, 1, &x,
                       &u);
  kiln_tensor_free(x);
  kiln_tensor_free(w);
  free(wh);
  th_ctx_free(ctx);
}

Test(gpu_ops, dropout_eval) {
  TH_GPU_CTX_EAGER(ctx);
  float *h;
  kiln_tensor *x = ref_rand_tensor(ctx, KILN_SHAPE(7, 9), 2500, &REF_GEN(-2, 2), 0, &h);
  double want[63], want_t[63];
  for (int i = 0; i < 63; i++)
    want[i] = h[i];
  for (int r = 0; r < 9; r++)
    for (int c = 0; c < 7; c++)
      want_t[r * 7 + c] = h[c * 9 + r];
  kiln_step_begin(ctx);
  ref_expect_close(ctx, kiln_dropout(x, 0.3f, 0), KILN_SHAPE(7, 9), want, 0, 0,
                   "dropout(p 0.3, training 0) of [7,9] must return the input");
  ref_expect_close(ctx, kiln_dropout(kiln_transpose(x, 0, 1), 0.5f, 0), KILN_SHAPE(9, 7), want_t, 0,
                   0,
                   "dropout(p 0.5, training 0) of a transposed [9,7] view must return the input");
  kiln_tensor_free(x);
  free(h);
  th_ctx_free(ctx);
}
