/*
 * test_gpu_ops_extra.c: on the GPU, the activations abs, leaky_relu, silu, softplus and erf, the
 * variance and standard deviation with corrections 0 and 1, and the losses MSE, binary
 * cross-entropy on logits and cross-entropy against class probabilities, against float64
 * references from the same inputs (read contiguous and through views), and their gradients
 * against central finite differences (kiln_gradcheck), with inputs kept away from kinks.
 * Without a GPU every test skips, saying why.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ref.h"

#define KINK(k0, m) .nkinks = 1, .kinks = {k0}, .margin = (m)

/* ---------------------------------------------------------------- activations */

typedef struct act {
  const char *name;
  kiln_tensor *(*fn)(kiln_tensor *a, const float *p);
  double (*ref)(double x, const float *p);
  float p[2];        /* the op's scalar arguments */
  ref_gen fwd, grad; /* input values for the forward and the gradient checks */
  double atol, rtol;
} act;

static kiln_tensor *f_abs(kiln_tensor *a, const float *p) {
  (void)p;
  return kiln_abs(a);
}
static double r_abs(double x, const float *p) {
  (void)p;
  return fabs(x);
}
static kiln_tensor *f_leaky(kiln_tensor *a, const float *p) { return kiln_leaky_relu(a, p[0]); }
static double r_leaky(double x, const float *p) { return x > 0 ? x : x * (double)p[0]; }
static kiln_tensor *f_silu(kiln_tensor *a, const float *p) {
  (void)p;
  return kiln_silu(a);
}
static double r_silu(double x, const float *p) {
  (void)p;
  return x / (1.0 + exp(-x));
}
static kiln_tensor *f_softplus(kiln_tensor *a, const float *p) {
  return kiln_softplus(a, p[0], p[1]);
}
/* PyTorch's softplus with kiln's zero-means-default (beta 1, threshold 20); the branch is taken
 * on the float product, as the kernel takes it */
static double r_softplus(double x, const float *p) {
  float beta = p[0] == 0.f ? 1.f : p[0], thr = p[1] == 0.f ? 20.f : p[1];
  float xb = (float)x * beta;
  if (xb > thr) return x;
  return log1p(exp(x * (double)beta)) / (double)beta;
}
static kiln_tensor *f_erf(kiln_tensor *a, const float *p) {
  (void)p;
  return kiln_erf(a);
}
static double r_erf(double x, const float *p) {
  (void)p;
  return erf(x);
}

static kiln_tensor *gc_act(kiln_tensor *const *in, void *user) {
  const act *u = user;
  return u->fn(in[0], u->p);
}

/* Forward over several shapes and layouts; gradcheck on a [3,4] and a [37,5] input. */
static void check_act(kiln_ctx *ctx, act *op) {
  ref_check_unary_forward(ctx, op->name, op->fn, op->ref, op->p, &op->fwd, 300, op->atol, op->rtol);
  char what[1024];
  kiln_shape gs[] = {KILN_SHAPE(3, 4), KILN_SHAPE(37, 5)};
  for (int t = 0; t < 2; t++) {
    kiln_tensor *x = ref_rand_tensor(ctx, gs[t], 17 + (uint64_t)t, &op->grad, 1, NULL);
    snprintf(what, sizeof what, "%s of a %s input", op->name, t ? "[37,5]" : "[3,4]");
    ref_expect_gradcheck(ctx, what, gc_act, 1, &x, op);
    kiln_tensor_free(x);
  }
}

Test(gpu_ops_extra, abs) {
  TH_GPU_CTX_EAGER(ctx);
  act op = {.name = "abs",
            .fn = f_abs,
            .ref = r_abs,
            .fwd = REF_GEN(-3, 3),
            .grad = {.lo = -2.f, .hi = 2.f, KINK(0.f, 0.06f)}};
  check_act(ctx, &op);
  th_ctx_free(ctx);
}

Test(gpu_ops_extra, leaky_relu) {
  TH_GPU_CTX_EAGER(ctx);
  float slopes[] = {0.01f, 0.2f, 0.f, -0.5f, 1.5f};
  for (size_t i = 0; i < sizeof slopes / sizeof *slopes; i++) {
    char name[64];
    snprintf(name, sizeof name, "leaky_relu(%g)", (double)slopes[i]);
    act op = {.name = name,
              .fn = f_leaky,
              .ref = r_leaky,
              .p = {slopes[i]},
              .fwd = REF_GEN(-3, 3),
              .grad = {.lo = -2.f, .hi = 2.f, KINK(0.f, 0.06f)}};
    check_act(ctx, &op);
  }
  th_ctx_free(ctx);
}

Test(gpu_ops_extra, silu) {
  TH_GPU_CTX_EAGER(ctx);
  /* far tails too: exp(-x) overflows to inf for x < -88, and x / inf is -0 */
  act op = {.name = "silu",
            .fn = f_silu,
            .ref = r_silu,
            .fwd = REF_GEN(-100, 100),
            .grad = REF_GEN(-4, 4)};
  check_act(ctx, &op);
  op.name = "silu (near 0)";
  op.fwd = REF_GEN(-4, 4);
  check_act(ctx, &op);
  th_ctx_free(ctx);
}

Test(gpu_ops_extra, softplus) {
  TH_GPU_CTX_EAGER(ctx);
  /* (beta, threshold): the defaults (0, 0 mean 1, 20), then others; the forward reaches past
   * the threshold, where softplus is x; values stay away from it, where softplus jumps by
   * log1p(exp(-threshold)) / beta */
  struct {
    float beta, thr;
    float lo, hi;
  } cases[] = {
      {0.f, 0.f, -40.f, 40.f}, {1.f, 20.f, -5.f, 5.f},  {2.f, 3.f, -4.f, 4.f},
      {0.5f, 1.f, -6.f, 6.f},  {3.f, -1.5f, -3.f, 3.f},
  };
  for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
    float beta = cases[i].beta == 0.f ? 1.f : cases[i].beta;
    float thr = cases[i].thr == 0.f ? 20.f : cases[i].thr;
    float kink = thr / beta;
    char name[96];
    snprintf(name, sizeof name, "softplus(beta %g, threshold %g)", (double)cases[i].beta,
             (double)cases[i].thr);
    act op = {.name = name,
              .fn = f_softplus,
              .ref = r_softplus,
              .p = {cases[i].beta, cases[i].thr},
              .fwd = {.lo = cases[i].lo, .hi = cases[i].hi, KINK(kink, 0.01f)},
              .grad = {.lo = cases[i].lo / 2, .hi = cases[i].hi / 2, KINK(kink, 0.06f)}};
    if (i == 0) op.grad = REF_GEN(-4, 4); /* the kink at 20 is out of reach */
    check_act(ctx, &op);
  }
  th_ctx_free(ctx);
}

Test(gpu_ops_extra, erf) {
  TH_GPU_CTX_EAGER(ctx);
  act op = {
      .name = "erf", .fn = f_erf, .ref = r_erf, .fwd = REF_GEN(-4, 4), .grad = REF_GEN(-2, 2)};
  check_act(ctx, &op);
  th_ctx_free(ctx);
}

/* ---------------------------------------------------------------- var and std */

/* The float64 variance (or its root) of x (shape s) over the axes in mask, row-major over the
 * kept axes, divided by max(0, count - correction): inf or NaN where that is 0, as PyTorch. */
static void var_ref(const double *x, kiln_shape s, unsigned mask, int correction, bool root,
                    double *out) {
  kiln_shape os = ref_reduced_shape(s, mask, 0);
  int64_t no = ref_numel(os), n = ref_numel(s), r = no ? n / no : 0;
  double *mean = ref_dalloc(no);
  for (int64_t o = 0; o < no; o++)
    mean[o] = out[o] = 0.0;
  int64_t c[KILN_MAX_DIMS];
  for (int64_t i = 0; i < n; i++) {
    ref_coords(s, i, c);
    mean[ref_reduced_index(s, mask, c)] += x[i];
  }
  for (int64_t o = 0; o < no; o++)
    mean[o] /= (double)r;
  for (int64_t i = 0; i < n; i++) {
    ref_coords(s, i, c);
    int64_t o = ref_reduced_index(s, mask, c);
    out[o] += (x[i] - mean[o]) * (x[i] - mean[o]);
  }
  double dof = (double)r - correction;
  for (int64_t o = 0; o < no; o++) {
    if (dof > 0)
      out[o] /= dof;
    else
      out[o] = out[o] == 0.0 ? NAN : INFINITY;
    if (root) out[o] = sqrt(out[o]);
  }
  free(mean);
}

static kiln_tensor *var_op(bool root, kiln_tensor *x, kiln_axes ax, int correction, int keepdim) {
  return root ? kiln_std(x, ax, correction, keepdim) : kiln_var(x, ax, correction, keepdim);
}

Test(gpu_ops_extra, var_std) {
  TH_GPU_CTX_EAGER(ctx);
  struct {
    kiln_shape s;
    kiln_axes ax;
    ref_layout l;
    ref_gen g;
  } cases[] = {
      {KILN_SHAPE(5), KILN_AXES(0), REF_PLAIN, REF_GEN(-1, 1)},
      {KILN_SHAPE(4, 3), KILN_AXES(1), REF_PLAIN, REF_GEN(-2, 2)},
      {KILN_SHAPE(4, 3), KILN_AXES(0), REF_TRANS, REF_GEN(-2, 2)},
      {KILN_SHAPE(2, 3, 4), KILN_AXES(0, 2), REF_PLAIN, REF_GEN(-1, 3)},
      {KILN_SHAPE(2, 3, 4), KILN_ALL_AXES, REF_SLICE, REF_GEN(-1, 1)},
      {KILN_SHAPE(37, 65), KILN_AXES(0), REF_PLAIN, REF_GEN(-1, 1)},
      {KILN_SHAPE(37, 65), KILN_AXES(-1), REF_ROWS, REF_GEN(-1, 1)},
      /* values far from 0: the two passes keep the variance from cancelling */
      {KILN_SHAPE(64, 10), KILN_AXES(1), REF_PLAIN, REF_GEN(97, 103)},
      {KILN_SHAPE(9000, 3), KILN_AXES(0), REF_PLAIN, REF_GEN(47, 53)},
  };
  char what[1024], d[160], a[48];
  uint64_t seed = 500;
  for (size_t i = 0; i < sizeof cases / sizeof *cases; i++)
    for (int root = 0; root < 2; root++)
      for (int corr = 0; corr < 2; corr++)
        for (int keep = 0; keep < 2; keep++) {
          kiln_shape s = cases[i].s;
          kiln_step_begin(ctx);
          ref_opnd x = ref_opnd_new(ctx, s, cases[i].l, seed++, &cases[i].g);
          unsigned mask = ref_axes_mask(cases[i].ax, s.ndim);
          double *want = ref_dalloc(ref_numel(ref_reduced_shape(s, mask, 0)));
          var_ref(x.v, s, mask, corr, root != 0, want);
          ref_opnd_desc(&x, cases[i].l, d, sizeof d);
          ref_axes_str(cases[i].ax, a, sizeof a);
          snprintf(what, sizeof what, "%s over axes %s (correction %d, keepdim %d) of a %s input",
                   root ? "std" : "var", a, corr, keep, d);
          ref_expect_close(ctx, var_op(root != 0, x.t, cases[i].ax, corr, keep),
                           ref_reduced_shape(s, mask, keep), want, 1e-5, 1e-4, what);
          free(want);
          ref_opnd_free(&x);
        }
  /* one element with correction 1: 0 / 0, NaN; correction 2 over two distinct values: inf */
  kiln_step_begin(ctx);
  kiln_tensor *one = ref_upload(ctx, KILN_SHAPE(3, 1), (float[]){1.f, 2.f, -3.f});
  double nan3[3] = {NAN, NAN, NAN};
  ref_expect_close(ctx, kiln_var(one, KILN_AXES(1), 1, 0), KILN_SHAPE(3), nan3, 0, 0,
                   "var of one element, correction 1");
  ref_expect_close(ctx, kiln_std(one, KILN_AXES(1), 1, 0), KILN_SHAPE(3), nan3, 0, 0,
                   "std of one element, correction 1");
  double zero3[3] = {0, 0, 0};
  ref_expect_close(ctx, kiln_var(one, KILN_AXES(1), 0, 0), KILN_SHAPE(3), zero3, 0, 0,
                   "var of one element, correction 0");
  kiln_tensor *two = ref_upload(ctx, KILN_SHAPE(2), (float[]){1.f, 2.f});
  double inf1[1] = {INFINITY};
  ref_expect_close(ctx, kiln_var(two, KILN_ALL_AXES, 2, 0), KILN_SCALAR_SHAPE, inf1, 0, 0,
                   "var of two elements, correction 2");
  kiln_tensor_free(one);
  kiln_tensor_free(two);
  th_ctx_free(ctx);
}

typedef struct var_gc {
  bool root;
  kiln_axes ax;
  int correction, keepdim;
} var_gc;

static kiln_tensor *gc_var(kiln_tensor *const *in, void *user) {
  const var_gc *u = user;
  return var_op(u->root, in[0], u->ax, u->correction, u->keepdim);
}

Test(gpu_ops_extra, var_std_gradients) {
  TH_GPU_CTX_EAGER(ctx);
  kiln_axes axes[] = {KILN_AXES(1), KILN_AXES(0), KILN_ALL_AXES};
  char what[256], a[48];
  uint64_t seed = 600;
  for (int root = 0; root < 2; root++)
    for (int corr = 0; corr < 2; corr++)
      for (size_t k = 0; k < sizeof axes / sizeof *axes; k++) {
        kiln_tensor *x = ref_rand_tensor(ctx, KILN_SHAPE(3, 4), seed++, &REF_GEN(-2, 2), 1, NULL);
        var_gc u = {.root = root != 0, .ax = axes[k], .correction = corr, .keepdim = (int)k & 1};
        ref_axes_str(axes[k], a, sizeof a);
        snprintf(what, sizeof what, "%s over axes %s (correction %d) of [3,4]",
                 root ? "std" : "var", a, corr);
        ref_expect_gradcheck(ctx, what, gc_var, 1, &x, &u);
        kiln_tensor_free(x);
      }
  th_ctx_free(ctx);
}

/* ---------------------------------------------------------------- losses */

static const char *const red_names[] = {"mean", "sum", "none"};
static const kiln_reduction reds[] = {KILN_REDUCTION_MEAN, KILN_REDUCTION_SUM, KILN_REDUCTION_NONE};

/* Reduces per-element losses l (n of them, shape s) into out as red asks; the output's shape. */
static kiln_shape reduce_ref(const double *l, int64_t n, kiln_shape s, kiln_reduction red,
                             double *out) {
  if (red == KILN_REDUCTION_NONE) {
    memcpy(out, l, (size_t)n * sizeof *l);
    return s;
  }
  double total = 0;
  for (int64_t i = 0; i < n; i++)
    total += l[i];
  out[0] = red == KILN_REDUCTION_MEAN ? total / (double)n : total;
  return KILN_SCALAR_SHAPE;
}

typedef enum loss_kind { L_MSE, L_BCE, L_CE_SOFT } loss_kind;

typedef struct loss_gc {
  loss_kind k;
  kiln_reduction red;
  float ls;
} loss_gc;

static kiln_tensor *loss_op(loss_kind k, kiln_tensor *x, kiln_tensor *t, kiln_reduction red,
                            float ls) {
  switch (k) {
  case L_MSE: return kiln_mse_loss(x, t, red);
  case L_BCE: return kiln_bce_with_logits(x, t, red);
  case L_CE_SOFT: return kiln_cross_entropy_soft(x, t, red, ls);
  }
  return NULL;
}

static kiln_tensor *gc_loss(kiln_tensor *const *in, void *user) {
  const loss_gc *u = user;
  return loss_op(u->k, in[0], in[1], u->red, u->ls);
}

/* The per-element (or per-row, for cross-entropy) losses of x against t. */
static int64_t loss_ref(loss_kind k, const double *x, const double *t, kiln_shape s, float ls,
                        double *l) {
  int64_t n = ref_numel(s);
  if (k == L_MSE) {
    for (int64_t i = 0; i < n; i++)
      l[i] = (x[i] - t[i]) * (x[i] - t[i]);
    return n;
  }
  if (k == L_BCE) {
    for (int64_t i = 0; i < n; i++)
      l[i] = fmax(x[i], 0.0) - x[i] * t[i] + log1p(exp(-fabs(x[i])));
    return n;
  }
  int64_t rows = s.d[0], c = s.d[1];
  for (int64_t r = 0; r < rows; r++) {
    const double *xr = x + r * c, *tr = t + r * c;
    double m = -INFINITY, z = 0, acc = 0;
    for (int64_t j = 0; j < c; j++)
      m = fmax(m, xr[j]);
    for (int64_t j = 0; j < c; j++)
      z += exp(xr[j] - m);
    for (int64_t j = 0; j < c; j++) {
      double tj = tr[j] * (1.0 - (double)ls) + (double)ls / (double)c;
      acc -= tj * (xr[j] - m - log(z));
    }
    l[r] = acc;
  }
  return rows;
}

/* Target probabilities: rows of positive values that sum to 1 (x holds their view's values). */
static void normalise_rows(float *p, int64_t rows, int64_t c) {
  for (int64_t r = 0; r < rows; r++) {
    double s = 0;
    for (int64_t j = 0; j < c; j++)
      s += p[r * c + j];
    for (int64_t j = 0; j < c; j++)
      p[r * c + j] = (float)(p[r * c + j] / s);
  }
}

static void check_loss_forward(kiln_ctx *ctx, loss_kind k, const char *name, kiln_shape s,
                               ref_layout lx, const ref_gen *gx, const ref_gen *gt, float ls,
                               uint64_t seed) {
  char what[1024], d[160];
  for (size_t r = 0; r < 3; r++) {
    kiln_step_begin(ctx);
    ref_opnd x = ref_opnd_new(ctx, s, lx, seed + r, gx);
    float *th = ref_falloc(ref_numel(s));
    ref_gen_fill(th, ref_numel(s), seed + 100 + r, gt);
    if (k == L_CE_SOFT) normalise_rows(th, s.d[0], s.d[1]);
    kiln_tensor *t = ref_upload(ctx, s, th);
    double *tv = ref_dalloc(ref_numel(s));
    for (int64_t i = 0; i < ref_numel(s); i++)
      tv[i] = th[i];
    double *l = ref_dalloc(ref_numel(s)), *want = ref_dalloc(ref_numel(s));
    int64_t n = loss_ref(k, x.v, tv, s, ls, l);
    kiln_shape ws = reduce_ref(l, n, k == L_CE_SOFT ? KILN_SHAPE(s.d[0]) : s, reds[r], want);
    ref_opnd_desc(&x, lx, d, sizeof d);
    snprintf(what, sizeof what, "%s (reduction %s, label_smoothing %g) of a %s input", name,
             red_names[r], (double)ls, d);
    ref_expect_close(ctx, loss_op(k, x.t, t, reds[r], ls), ws, want, 1e-5, 1e-5, what);
    free(l);
    free(want);
    free(tv);
    free(th);
    kiln_tensor_free(t);
    ref_opnd_free(&x);
  }
}

static void check_loss_grad(kiln_ctx *ctx, loss_kind k, const char *name, kiln_shape s,
                            const ref_gen *gx, const ref_gen *gt, float ls, uint64_t seed) {
  char what[256];
  for (size_t r = 0; r < 3; r++) {
    kiln_tensor *in[2];
    in[0] = ref_rand_tensor(ctx, s, seed + r, gx, 1, NULL);
    float *th = ref_falloc(ref_numel(s));
    ref_gen_fill(th, ref_numel(s), seed + 50 + r, gt);
    if (k == L_CE_SOFT) normalise_rows(th, s.d[0], s.d[1]);
    in[1] = ref_upload(ctx, s, th);
    ref_set_grad(ctx, in[1]); /* the target's gradient too */
    loss_gc u = {.k = k, .red = reds[r], .ls = ls};
    snprintf(what, sizeof what, "%s (reduction %s, label_smoothing %g)", name, red_names[r],
             (double)ls);
    ref_expect_gradcheck(ctx, what, gc_loss, 2, in, &u);
    free(th);
    kiln_tensor_free(in[0]);
    kiln_tensor_free(in[1]);
  }
}

Test(gpu_ops_extra, mse_loss) {
  TH_GPU_CTX_EAGER(ctx);
  check_loss_forward(ctx, L_MSE, "mse_loss", KILN_SHAPE(7), REF_PLAIN, &REF_GEN(-2, 2),
                     &REF_GEN(-2, 2), 0.f, 700);
  check_loss_forward(ctx, L_MSE, "mse_loss", KILN_SHAPE(6, 5), REF_TRANS, &REF_GEN(-2, 2),
                     &REF_GEN(-2, 2), 0.f, 710);
  check_loss_forward(ctx, L_MSE, "mse_loss", KILN_SHAPE(37, 65), REF_ROWS, &REF_GEN(-3, 3),
                     &REF_GEN(-1, 1), 0.f, 720);
  check_loss_grad(ctx, L_MSE, "mse_loss of [3,4]", KILN_SHAPE(3, 4), &REF_GEN(-2, 2),
                  &REF_GEN(-2, 2), 0.f, 730);
  th_ctx_free(ctx);
}

Test(gpu_ops_extra, bce_with_logits) {
  TH_GPU_CTX_EAGER(ctx);
  /* logits far out on both sides: the stable form neither overflows nor loses the x t term */
  check_loss_forward(ctx, L_BCE, "bce_with_logits", KILN_SHAPE(8), REF_PLAIN, &REF_GEN(-4, 4),
                     &REF_GEN(0, 1), 0.f, 800);
  check_loss_forward(ctx, L_BCE, "bce_with_logits", KILN_SHAPE(6, 5), REF_TRANS, &REF_GEN(-60, 60),
                     &REF_GEN(0, 1), 0.f, 810);
  check_loss_forward(ctx, L_BCE, "bce_with_logits", KILN_SHAPE(37, 65), REF_SLICE,
                     &REF_GEN(-30, 30), &REF_GEN(0, 1), 0.f, 820);
  /* hard targets and logits of exactly 0 (loss log 2, gradient 1/2 - t) */
  kiln_step_begin(ctx);
  float xh[6] = {0.f, 0.f, 100.f, -100.f, 100.f, -100.f}, th[6] = {0.f, 1.f, 1.f, 0.f, 0.f, 1.f};
  kiln_tensor *x = ref_upload(ctx, KILN_SHAPE(6), xh), *t = ref_upload(ctx, KILN_SHAPE(6), th);
  ref_set_grad(ctx, x);
  double want[6] = {log(2.0), log(2.0), 0, 0, 100, 100};
  ref_expect_close(ctx, kiln_bce_with_logits(x, t, KILN_REDUCTION_NONE), KILN_SHAPE(6), want, 1e-6,
                   1e-6, "bce_with_logits of hard targets");
  kiln_tensor *loss = kiln_bce_with_logits(x, t, KILN_REDUCTION_SUM);
  cr_assert_eq(kiln_backward(loss), KILN_OK, "%s", th_err(ctx));
  double gwant[6] = {0.5, -0.5, 0, 0, 1, -1};
  ref_expect_close(ctx, kiln_tensor_grad(x), KILN_SHAPE(6), gwant, 1e-6, 1e-6,
                   "the gradient of bce_with_logits (sigmoid(x) - t)");
  kiln_tensor_free(x);
  kiln_tensor_free(t);
  check_loss_grad(ctx, L_BCE, "bce_with_logits of [3,4]", KILN_SHAPE(3, 4), &REF_GEN(-3, 3),
                  &REF_GEN(0, 1), 0.f, 830);
  th_ctx_free(ctx);
}

Test(gpu_ops_extra, cross_entropy_soft) {
  TH_GPU_CTX_EAGER(ctx);
  float lss[] = {0.f, 0.1f};
  for (size_t i = 0; i < 2; i++) {
    check_loss_forward(ctx, L_CE_SOFT, "cross_entropy_soft", KILN_SHAPE(6, 5), REF_PLAIN,
                       &REF_GEN(-3, 3), &REF_GEN(0.05f, 1), lss[i], 900 + 10 * i);
    check_loss_forward(ctx, L_CE_SOFT, "cross_entropy_soft", KILN_SHAPE(6, 5), REF_TRANS,
                       &REF_GEN(-3, 3), &REF_GEN(0.05f, 1), lss[i], 920 + 10 * i);
    check_loss_forward(ctx, L_CE_SOFT, "cross_entropy_soft", KILN_SHAPE(64, 10), REF_SLICE,
                       &REF_GEN(47, 53), &REF_GEN(0.05f, 1), lss[i], 940 + 10 * i);
    check_loss_grad(ctx, L_CE_SOFT, "cross_entropy_soft of [4,5]", KILN_SHAPE(4, 5),
                    &REF_GEN(-2, 2), &REF_GEN(0.05f, 1), lss[i], 960 + 10 * i);
  }
  /* one-hot targets give kiln_cross_entropy's value for the same labels */
  kiln_step_begin(ctx);
  float xh[12], oh[12] = {0};
  ref_gen_fill(xh, 12, 990, &REF_GEN(-2, 2));
  int32_t y[3] = {0, 3, 2};
  for (int r = 0; r < 3; r++)
    oh[r * 4 + y[r]] = 1.f;
  kiln_tensor *x = ref_upload(ctx, KILN_SHAPE(3, 4), xh),
              *t = ref_upload(ctx, KILN_SHAPE(3, 4), oh);
  kiln_tensor *lab = ref_upload_i32(ctx, KILN_SHAPE(3), y);
  float *hard = ref_read_f32(ctx, kiln_cross_entropy(x, lab, KILN_REDUCTION_NONE, 0.1f),
                             "cross_entropy with labels");
  double want[3] = {hard[0], hard[1], hard[2]};
  ref_expect_close(ctx, kiln_cross_entropy_soft(x, t, KILN_REDUCTION_NONE, 0.1f), KILN_SHAPE(3),
                   want, 1e-6, 1e-6, "cross_entropy_soft of one-hot targets");
  free(hard);
  kiln_tensor_free(x);
  kiln_tensor_free(t);
  kiln_tensor_free(lab);
  th_ctx_free(ctx);
}
