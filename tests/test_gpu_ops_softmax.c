/*
 * test_gpu_ops_softmax.c: softmax, log_softmax and the cross-entropy loss on the GPU against
 * float64 references (inputs around 50, where an unshifted exponential would lose everything;
 * every reduction, with and without label smoothing), and their gradients against central finite
 * differences. Without a GPU every test skips, saying why.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ref.h"

/* ---------------------------------------------------------------- softmax, log_softmax */

static void softmax_ref(const double *x, kiln_shape s, int axis, int logsm, double *out) {
  int ax = ref_norm_axis(axis, s.ndim);
  int64_t outer = 1, len = s.d[ax], inner = 1;
  for (int d = 0; d < ax; d++)
    outer *= s.d[d];
  for (int d = ax + 1; d < s.ndim; d++)
    inner *= s.d[d];
  for (int64_t o = 0; o < outer; o++)
    for (int64_t in = 0; in < inner; in++) {
      const double *px = x + o * len * inner + in;
      double *po = out + o * len * inner + in;
      double m = -INFINITY, sum = 0;
      for (int64_t j = 0; j < len; j++)
        m = px[j * inner] > m ? px[j * inner] : m;
      for (int64_t j = 0; j < len; j++)
        sum += exp(px[j * inner] - m);
      for (int64_t j = 0; j < len; j++)
        po[j * inner] = logsm ? (px[j * inner] - m) - log(sum) : exp(px[j * inner] - m) / sum;
    }
}

typedef struct sm_gc {
  int logsm, axis, transpose;
} sm_gc;

static kiln_tensor *gc_softmax(kiln_tensor *const *in, void *user) {
  const sm_gc *u = user;
  kiln_tensor *x = u->transpose ? kiln_transpose(in[0], 0, 1) : in[0];
  return u->logsm ? kiln_log_softmax(x, u->axis) : kiln_softmax(x, u->axis);
}

static void check_softmax(kiln_ctx *ctx, int logsm) {
  const char *name = logsm ? "log_softmax" : "softmax";
  struct {
    kiln_shape s;
    int axis;
  } cases[] = {
      {.s = KILN_SHAPE(4, 5), .axis = 1},     {.s = KILN_SHAPE(4, 5), .axis = 0},
      {.s = KILN_SHAPE(6, 33), .axis = 1},    {.s = KILN_SHAPE(6, 33), .axis = 0},
      {.s = KILN_SHAPE(3, 300), .axis = 1},   {.s = KILN_SHAPE(2, 3, 4), .axis = 1},
      {.s = KILN_SHAPE(2, 3, 4), .axis = -1},
  };
  ref_layout lays[] = {REF_PLAIN, REF_TRANS, REF_SLICE};
  /* inputs around +50: exp would overflow-prone without the max shift */
  ref_gen g = REF_GEN(47, 53);
  uint64_t seed = 700;
  char what[1024], d[160];
  for (size_t i = 0; i < sizeof cases / sizeof *cases; i++)
    for (size_t li = 0; li < sizeof lays / sizeof *lays; li++) {
      kiln_step_begin(ctx);
      ref_opnd x = ref_opnd_new(ctx, cases[i].s, lays[li], seed++, &g);
      double *want = ref_dalloc(ref_numel(x.s));
      softmax_ref(x.v, x.s, cases[i].axis, logsm, want);
      ref_opnd_desc(&x, lays[li], d, sizeof d);
      snprintf(what, sizeof what, "%s along axis %d of a %s input (values in [47, 53])", name,
               cases[i].axis, d);
      kiln_tensor *y =
          logsm ? kiln_log_softmax(x.t, cases[i].axis) : kiln_softmax(x.t, cases[i].axis);
      ref_expect_close(ctx, y, x.s, want, 1e-5, 1e-5, what);
      free(want);
      ref_opnd_free(&x);
    }
  for (int axis = 0; axis < 2; axis++)
    for (int t = 0; t < 2; t++) {
      kiln_tensor *x = ref_rand_tensor(ctx, KILN_SHAPE(3, 4), 750 + (uint64_t)(axis * 2 + t),
                                       &REF_GEN(-2, 2), 1, NULL);
      sm_gc u = {.logsm = logsm, .axis = axis, .transpose = t};
      snprintf(what, sizeof what, "%s along axis %d of a %s [3,4] input", name, axis,
               t ? "transposed" : "contiguous");
      ref_expect_gradcheck(ctx, what, gc_softmax, 1, &x, &u);
      kiln_tensor_free(x);
    }
}

Test(gpu_ops, softmax) {
  TH_GPU_CTX_EAGER(ctx);
  check_softmax(ctx, 0);
  th_ctx_free(ctx);
}

Test(gpu_ops, log_softmax) {
  TH_GPU_CTX_EAGER(ctx);
  check_softmax(ctx, 1);
  th_ctx_free(ctx);
}

/* ---------------------------------------------------------------- cross_entropy */

static const char *const red_names[] = {"mean", "sum", "none"};

/* loss_i = -(1 - ls) logp[i, y_i] - ls / C sum_j logp[i, j]; then mean, sum or none. */
static kiln_shape ce_ref(const double *logits, int64_t n, int64_t c, const int32_t *y,
                         kiln_reduction red, double ls, double *out) {
  double *logp = ref_dalloc(n * c);
  softmax_ref(logits, KILN_SHAPE(n, c), 1, 1, logp);
  double total = 0;
  for (int64_t i = 0; i < n; i++) {
    double s = 0;
    for (int64_t j = 0; j < c; j++)
      s += logp[i * c + j];
    double l = -(1 - ls) * logp[i * c + y[i]] - ls / (double)c * s;
    if (red == KILN_REDUCTION_NONE) out[i] = l;
    total += l;
  }
  free(logp);
  if (red == KILN_REDUCTION_NONE) return KILN_SHAPE(n);
  out[0] = red == KILN_REDUCTION_MEAN ? total / (double)n : total;
  return KILN_SCALAR_SHAPE;
}

typedef struct ce_gc {
  kiln_tensor *labels;
  kiln_reduction red;
  float ls;
} ce_gc;

static kiln_tensor *gc_ce(kiln_tensor *const *in, void *user) {
  const ce_gc *u = user;
  return kiln_cross_entropy(in[0], u->labels, u->red, u->ls);
}

Test(gpu_ops, cross_entropy) {
  TH_GPU_CTX_EAGER(ctx);
  struct {
    int64_t n, c;
    ref_gen g;
    ref_layout l;
  } cases[] = {
      {.n = 6, .c = 5, .g = REF_GEN(-3, 3)},
      {.n = 6, .c = 5, .g = REF_GEN(-3, 3), .l = REF_TRANS},
      {.n = 64, .c = 10, .g = REF_GEN(47, 53)},
      {.n = 64, .c = 10, .g = REF_GEN(47, 53), .l = REF_SLICE},
  };
  kiln_reduction reds[] = {KILN_REDUCTION_MEAN, KILN_REDUCTION_SUM, KILN_REDUCTION_NONE};
  float lss[] = {0.f, 0.1f};
  char what[1024], d[160];
  uint64_t seed = 800;
  for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
    int64_t n = cases[i].n, c = cases[i].c;
    int32_t *y = ref_malloc((size_t)n * sizeof *y);
    for (int64_t k = 0; k < n; k++)
      y[k] = (int32_t)((k * 3) % c); /* 0 and C-1 both occur */
    for (size_t r = 0; r < 3; r++)
      for (size_t s = 0; s < 2; s++) {
        kiln_step_begin(ctx);
        ref_opnd x = ref_opnd_new(ctx, KILN_SHAPE(n, c), cases[i].l, seed++, &cases[i].g);
        kiln_tensor *labels = ref_upload_i32(ctx, KILN_SHAPE(n), y);
        double *want = ref_dalloc(n);
        kiln_shape ws = ce_ref(x.v, n, c, y, reds[r], lss[s], want);
        ref_opnd_desc(&x, cases[i].l, d, sizeof d);
        snprintf(what, sizeof what, "cross_entropy (reduction %s, label_smoothing %g) of %s logits",
                 red_names[r], (double)lss[s], d);
        ref_expect_close(ctx, kiln_cross_entropy(x.t, labels, reds[r], lss[s]), ws, want, 1e-5,
                         1e-5, what);
        free(want);
        kiln_tensor_free(labels);
        ref_opnd_free(&x);
      }
    free(y);
  }
  /* gradients through the logits */
  int32_t y4[] = {0, 4, 2, 4};
  kiln_tensor *labels = ref_upload_i32(ctx, KILN_SHAPE(4), y4);
  for (size_t r = 0; r < 3; r++)
    for (size_t s = 0; s < 2; s++) {
      kiln_tensor *x =
          ref_rand_tensor(ctx, KILN_SHAPE(4, 5), 850 + r * 2 + s, &REF_GEN(-2, 2), 1, NULL);
      ce_gc u = {.labels = labels, .red = reds[r], .ls = lss[s]};
      snprintf(what, sizeof what, "cross_entropy (reduction %s, label_smoothing %g) of [4,5]",
               red_names[r], (double)lss[s]);
      ref_expect_gradcheck(ctx, what, gc_ce, 1, &x, &u);
      kiln_tensor_free(x);
    }
  kiln_tensor_free(labels);
  th_ctx_free(ctx);
}
