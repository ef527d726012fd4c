/*
 * test_gpu_ops_reduce.c: the reductions on the GPU (sum, mean, max over every set of axes, with
 * and without keepdim, of contiguous and viewed inputs, short and long; argmax with ties) against
 * float64 references, and their gradients against central finite differences (max's split evenly
 * among tied maxima). Without a GPU every test skips, saying why.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ref.h"

/* ---------------------------------------------------------------- reductions */

typedef enum rkind { R_SUM, R_MEAN, R_MAX } rkind;
static const char *const rnames[] = {"sum", "mean", "max"};

static kiln_tensor *reduce_op(rkind k, kiln_tensor *x, kiln_axes ax, int keepdim) {
  switch (k) {
  case R_SUM: return kiln_sum(x, ax, keepdim);
  case R_MEAN: return kiln_mean(x, ax, keepdim);
  case R_MAX: return kiln_max(x, ax, keepdim);
  }
  return NULL;
}

/* The float64 reduction k of x (shape s) over the axes in mask, row-major over the kept axes. */
static void reduce_ref(const double *x, kiln_shape s, unsigned mask, rkind k, double *out) {
  kiln_shape os = ref_reduced_shape(s, mask, 0);
  int64_t no = ref_numel(os), n = ref_numel(s), r = no ? n / no : 0;
  for (int64_t o = 0; o < no; o++)
    out[o] = k == R_MAX ? -INFINITY : 0.0;
  int64_t c[KILN_MAX_DIMS];
  for (int64_t i = 0; i < n; i++) {
    ref_coords(s, i, c);
    int64_t o = ref_reduced_index(s, mask, c);
    if (k == R_MAX)
      out[o] = x[i] > out[o] ? x[i] : out[o];
    else
      out[o] += x[i];
  }
  if (k == R_MEAN)
    for (int64_t o = 0; o < no; o++)
      out[o] /= (double)r;
}

static void check_reduce_case(kiln_ctx *ctx, rkind k, kiln_shape s, ref_layout l, kiln_axes ax,
                              int keepdim, uint64_t seed, double atol, double rtol) {
  kiln_step_begin(ctx);
  ref_opnd x = ref_opnd_new(ctx, s, l, seed, &REF_GEN(-1, 1));
  unsigned mask = ref_axes_mask(ax, s.ndim);
  kiln_shape os = ref_reduced_shape(s, mask, keepdim);
  double *want = ref_dalloc(ref_numel(os));
  reduce_ref(x.v, s, mask, k, want);
  char what[1024], d[160], a[48];
  ref_opnd_desc(&x, l, d, sizeof d);
  ref_axes_str(ax, a, sizeof a);
  snprintf(what, sizeof what, "%s over axes %s (keepdim %d) of a %s input", rnames[k], a, keepdim,
           d);
  ref_expect_close(ctx, reduce_op(k, x.t, ax, keepdim), os, want, atol, rtol, what);
  free(want);
  ref_opnd_free(&x);
}

typedef struct red_gc {
  rkind k;
  kiln_axes ax;
  int keepdim;
  int transpose; /* reduce a view with axes 0 and 2 swapped */
} red_gc;

static kiln_tensor *gc_reduce(kiln_tensor *const *in, void *user) {
  const red_gc *u = user;
  kiln_tensor *x = u->transpose ? kiln_transpose(in[0], 0, 2) : in[0];
  return reduce_op(u->k, x, u->ax, u->keepdim);
}

static void check_reduce(kiln_ctx *ctx, rkind k) {
  kiln_axes sets[] = {KILN_ALL_AXES, KILN_AXES(0), KILN_AXES(1), KILN_AXES(0, 2), KILN_AXES(-1)};
  ref_layout lays[] = {REF_PLAIN, REF_TRANS, REF_SLICE, REF_EXPAND};
  double atol = k == R_MAX ? 0 : 1e-5, rtol = k == R_MAX ? 0 : 1e-5;
  uint64_t seed = 500;
  for (size_t si = 0; si < sizeof sets / sizeof *sets; si++)
    for (int keepdim = 0; keepdim < 2; keepdim++)
      for (size_t li = 0; li < sizeof lays / sizeof *lays; li++)
        check_reduce_case(ctx, k, KILN_SHAPE(3, 4, 5), lays[li], sets[si], keepdim, seed++, atol,
                          rtol);
  /* long reductions: along dense rows, across columns, and over split axes */
  struct {
    kiln_shape s;
    kiln_axes ax;
  } big[] = {
      {.s = KILN_SHAPE(5, 1000), .ax = KILN_AXES(1)},
      {.s = KILN_SHAPE(16, 600), .ax = KILN_AXES(0)},
      {.s = KILN_SHAPE(7, 600), .ax = KILN_AXES(0)},
      {.s = KILN_SHAPE(600, 33), .ax = KILN_AXES(1)},
      {.s = KILN_SHAPE(2, 3, 1000), .ax = KILN_AXES(0, 2)},
      {.s = KILN_SHAPE(40, 50), .ax = KILN_ALL_AXES},
  };
  for (size_t i = 0; i < sizeof big / sizeof *big; i++)
    for (int t = 0; t < 2; t++)
      check_reduce_case(ctx, k, big[i].s, t ? REF_TRANS : REF_PLAIN, big[i].ax, 0, seed++,
                        k == R_MAX ? 0 : 2e-4, k == R_MAX ? 0 : 1e-5);
  /* gradients; max gets distinct values so that finite differences keep the argmax */
  char what[1024], a[48];
  for (size_t si = 0; si < sizeof sets / sizeof *sets; si++) {
    for (int keepdim = 0; keepdim < 2; keepdim++) {
      for (int t = 0; t < (keepdim ? 1 : 2); t++) {
        kiln_shape s = t ? KILN_SHAPE(4, 3, 2) : KILN_SHAPE(2, 3, 4);
        float h[24];
        if (k == R_MAX)
          ref_distinct_fill(h, 24, seed++);
        else
          ref_gen_fill(h, 24, seed++, &REF_GEN(-1, 1));
        kiln_tensor *x = ref_upload(ctx, s, h);
        ref_set_grad(ctx, x);
        red_gc u = {.k = k, .ax = sets[si], .keepdim = keepdim, .transpose = t};
        ref_axes_str(sets[si], a, sizeof a);
        snprintf(what, sizeof what, "%s over axes %s (keepdim %d) of a %s [2,3,4] input", rnames[k],
                 a, keepdim, t ? "transposed (axes 0, 2)" : "contiguous");
        ref_expect_gradcheck(ctx, what, gc_reduce, 1, &x, &u);
        kiln_tensor_free(x);
      }
    }
  }
}

Test(gpu_ops, sum) {
  TH_GPU_CTX_EAGER(ctx);
  check_reduce(ctx, R_SUM);
  th_ctx_free(ctx);
}

Test(gpu_ops, mean) {
  TH_GPU_CTX_EAGER(ctx);
  check_reduce(ctx, R_MEAN);
  th_ctx_free(ctx);
}

Test(gpu_ops, max) {
  TH_GPU_CTX_EAGER(ctx);
  check_reduce(ctx, R_MAX);
  th_ctx_free(ctx);
}

/* max's gradient splits evenly among equal maxima (as PyTorch's amax) */
Test(gpu_ops, max_grad_ties) {
  TH_GPU_CTX_EAGER(ctx);
  float h[] = {1, 3, 3, 2, /* row 0: a tie at 1, 2 */ 5, 0, 1, 5 /* row 1: a tie at 0, 3 */};
  kiln_tensor *x = ref_upload(ctx, KILN_SHAPE(2, 4), h);
  ref_set_grad(ctx, x);
  kiln_step_begin(ctx);
  cr_assert_eq(kiln_backward(kiln_sum(kiln_max(x, KILN_AXES(1), 0), KILN_ALL_AXES, 0)), KILN_OK,
               "backward of sum(max over axis 1 of [2,4]): %s", th_err(ctx));
  double want[] = {0, 0.5, 0.5, 0, 0.5, 0, 0, 0.5};
  ref_expect_close(ctx, kiln_tensor_grad(x), KILN_SHAPE(2, 4), want, 1e-6, 0,
                   "gradient of sum(max over axis 1) of [2,4] with tied maxima");
  kiln_tensor_free(x);
  th_assert_ok(ctx);
  th_ctx_free(ctx);
}

/* ---------------------------------------------------------------- argmax */

static void check_argmax_case(kiln_ctx *ctx, kiln_shape s, ref_layout l, int axis, int keepdim,
                              const ref_gen *g, uint64_t seed) {
  kiln_step_begin(ctx);
  ref_opnd x = ref_opnd_new(ctx, s, l, seed, g);
  int ax = ref_norm_axis(axis, s.ndim);
  unsigned mask = 1u << ax;
  kiln_shape os = ref_reduced_shape(s, mask, keepdim);
  int64_t no = ref_numel(os), n = ref_numel(s), c[KILN_MAX_DIMS];
  int32_t *want = ref_malloc((size_t)no * sizeof *want);
  double *best = ref_dalloc(no);
  for (int64_t o = 0; o < no; o++)
    want[o] = -1;
  /* row-major order visits each output's candidates in increasing index: strict > keeps the
   * first of equal maxima */
  for (int64_t i = 0; i < n; i++) {
    ref_coords(s, i, c);
    int64_t o = ref_reduced_index(s, mask, c);
    if (want[o] < 0 || x.v[i] > best[o]) {
      best[o] = x.v[i];
      want[o] = (int32_t)c[ax];
    }
  }
  char what[1024], d[160];
  ref_opnd_desc(&x, l, d, sizeof d);
  snprintf(what, sizeof what, "argmax over axis %d (keepdim %d) of a %s input with ties", axis,
           keepdim, d);
  ref_expect_i32(ctx, kiln_argmax(x.t, axis, keepdim), os, want, what);
  free(want);
  free(best);
  ref_opnd_free(&x);
}

Test(gpu_ops, argmax) {
  TH_GPU_CTX_EAGER(ctx);
  ref_gen nine = {.lo = -1, .hi = 1, .quant = 0.25f}; /* nine levels: many ties */
  ref_gen five = {.lo = -1, .hi = 1, .quant = 0.5f};  /* the maximum repeats along long rows */
  ref_layout lays[] = {REF_PLAIN, REF_TRANS, REF_SLICE, REF_EXPAND};
  int axes[] = {0, 1, 2, -1};
  uint64_t seed = 600;
  for (size_t a = 0; a < sizeof axes / sizeof *axes; a++)
    for (int keepdim = 0; keepdim < 2; keepdim++)
      for (size_t li = 0; li < sizeof lays / sizeof *lays; li++)
        check_argmax_case(ctx, KILN_SHAPE(3, 4, 5), lays[li], axes[a], keepdim, &nine, seed++);
  check_argmax_case(ctx, KILN_SHAPE(4, 1000), REF_PLAIN, 1, 0, &five, seed++);
  check_argmax_case(ctx, KILN_SHAPE(4, 1000), REF_TRANS, 1, 0, &five, seed++);
  check_argmax_case(ctx, KILN_SHAPE(1000, 3), REF_PLAIN, 0, 0, &five, seed++);
  check_argmax_case(ctx, KILN_SHAPE(7, 600), REF_PLAIN, 0, 1, &five, seed++);
  check_argmax_case(ctx, KILN_SHAPE(7, 600), REF_PLAIN, 1, 1, &REF_GEN(-1, 1), seed++);
  th_ctx_free(ctx);
}

/* Sums and means of bf16 over the leading axes of tall, narrow tensors (a bias gradient over a
 * batch of images' pixels), which kiln sums in two steps, the partial sums in f32, the total
 * rounded to bf16 once: against float64 of the bf16 values, the result rounded to bf16 (either
 * neighbour: f32 sums in another order), including a reduction whose rows no block size divides
 * (one sum) and a 4-D one as a conv's bias gradient has. */
Test(gpu_ops, bf16_sums_of_tall_tensors) {
  TH_GPU_CTX_EAGER(ctx);
  struct {
    kiln_shape s;
    kiln_axes ax;
    int mean;
  } cases[] = {
      {KILN_SHAPE(64, 31, 31, 24), KILN_AXES(0, 1, 2), 0},
      {KILN_SHAPE(20000, 10), KILN_AXES(0), 0},
      {KILN_SHAPE(20000, 10), KILN_AXES(0), 1},
      {KILN_SHAPE(9001, 3), KILN_AXES(0), 0}, /* 9001 is prime: no block of rows divides it */
  };
  for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
    kiln_shape s = cases[i].s;
    unsigned mask = ref_axes_mask(cases[i].ax, s.ndim);
    kiln_shape os = ref_reduced_shape(s, mask, 0);
    int64_t n = ref_numel(s), no = ref_numel(os);
    char what[160], sh[96];
    kiln_shape_str(s, sh, sizeof sh);
    snprintf(what, sizeof what, "bf16 %s over the leading axes of %s",
             cases[i].mean ? "mean" : "sum", sh);
    kiln_step_begin(ctx);
    float *h;
    kiln_tensor *x = ref_rand_tensor(ctx, s, 9100 + 10 * i, &REF_GEN(-1, 1), 0, &h);
    kiln_tensor *xb = kiln_cast(x, KILN_DTYPE_BF16);
    kiln_tensor *y = cases[i].mean ? kiln_mean(xb, cases[i].ax, 0) : kiln_sum(xb, cases[i].ax, 0);
    cr_assert(y && kiln_tensor_dtype(y) == KILN_DTYPE_BF16, "%s: %s", what, th_err(ctx));
    double *want = ref_dalloc(no);
    for (int64_t j = 0; j < n; j++) /* over leading axes: output j mod no */
      want[j % no] += kiln_bf16_to_f32(kiln_bf16_from_f32(h[j]));
    for (int64_t o = 0; o < no; o++)
      want[o] = kiln_bf16_to_f32(
          kiln_bf16_from_f32((float)(cases[i].mean ? want[o] / (double)(n / no) : want[o])));
    /* a bf16 result: one ulp (2^-8 relative) either way */
    ref_expect_close(ctx, kiln_cast(y, KILN_DTYPE_F32), os, want, 1e-6, 8e-3, what);
    free(want);
    free(h);
    kiln_tensor_free(x);
  }
  th_ctx_free(ctx);
}
