/*
 * reduce.c: the reductions (sum, mean, max over sets of axes; var and std, argmax) and the ops made
 * of them (softmax, log-softmax, the losses), as ops.c's ops: each checks its inputs and records
 * its nodes; nothing runs here. A sum over the leading axes of a tall, narrow tensor is recorded as
 * sums of partial sums (split_sum).
 */
#include <math.h>

#include "internal.h"

/* ---------------------------------------------------------------- reductions */

/* Turns axes into a bit mask over ndim dims; an empty set means all. */
static bool axes_mask(kiln_ctx *ctx, const char *fn, const kiln_tensor *a, kiln_axes axes,
                      unsigned *mask) {
  char sh[96];
  if (axes.n < 0 || axes.n > KILN_MAX_DIMS)
    return kiln__error(ctx, KILN_ERR_INVALID, "%s: %d axes given", fn, axes.n), false;
  if (axes.n == 0) {
    *mask = (1u << a->ndim) - 1;
    return true;
  }
  unsigned m = 0;
  for (int i = 0; i < axes.n; i++) {
    int ax = axes.a[i] < 0 ? axes.a[i] + a->ndim : axes.a[i];
    if (ax < 0 || ax >= a->ndim)
      return kiln__error(ctx, KILN_ERR_SHAPE, "%s: axis %d out of range for %s (%d dims)", fn,
                         axes.a[i], kiln__shape_of(a, sh, sizeof sh), a->ndim),
             false;
    if (m & (1u << ax))
      return kiln__error(ctx, KILN_ERR_INVALID, "%s: axis %d given twice", fn, axes.a[i]), false;
    m |= 1u << ax;
  }
  *mask = m;
  return true;
}

/* Records reduction op of a over the axes in mask, its result in dt (a's, or f32 for bf16 sums'
 * partial sums, or i32 for argmax). */
static kiln_tensor *record_reduce(kiln__op op, const char *fn, kiln_tensor *a, unsigned mask,
                                  int keepdim, float scale, kiln_dtype dt) {
  kiln_ctx *ctx = kiln__op_begin(fn, 1, &a);
  if (!ctx) return NULL;
  int nd = 0;
  int64_t shape[KILN_MAX_DIMS];
  for (int d = 0; d < a->ndim; d++) {
    if (mask & (1u << d)) {
      if (op != KILN__OP_SUM && a->shape[d] == 0) {
        char sh[96];
        return kiln__error(ctx, KILN_ERR_SHAPE, "%s: cannot reduce over the empty axis %d of %s",
                           fn, d, kiln__shape_of(a, sh, sizeof sh)),
               NULL;
      }
      if (keepdim) shape[nd++] = 1;
    } else {
      shape[nd++] = a->shape[d];
    }
  }
  kiln_tensor *out = kiln__tensor_intermediate(ctx, fn, dt, nd, shape);
  if (!out) return NULL;
  kiln__node *n = kiln__record(ctx, op, 1, &a, out);
  if (!n) return NULL;
  KILN__RF(n, scale) = scale;
  KILN__RI(n, mask) = mask;
  KILN__RI(n, keepdim) = keepdim != 0;
  return out;
}

/* A sum over the leading axes of a tall, narrow tensor (R rows of C columns: a bias gradient
 * over the pixels of a batch of images, a batch norm's statistics) as two sums, each of which
 * spreads over the whole device: partial sums of blocks of rows, then their sum. One sum over R
 * rows has only C outputs to share among threads (measured on the H200: 57-68 us for cuBLASLt's
 * bias-gradient kernel over 73728 x 64, where reading the 19 MB takes 5; on the H100 a bf16 bias
 * gradient over 1,922,000 x 24, a block an output, added 3.8 ms to each step of the CIFAR-10
 * example's first epochs). bf16 values are summed in f32 (the partial sums are f32) and the total
 * rounded once, as one sum would. */
#define KILN__SPLIT_MIN_ROWS 8192 /* fewer rows: one sum */
#define KILN__SPLIT_MAX_COLS 4096 /* more columns: one sum has outputs enough */
#define KILN__SPLIT_BLOCK 64      /* rows per partial sum, at least (a divisor of R) */
#define KILN__SPLIT_MAX_BLOCK 1024

static kiln_tensor *sum_as(const char *fn, kiln_tensor *a, unsigned mask, int keepdim, float scale,
                           kiln_dtype dt);

/* The sum of split_sum, its result in dt; NULL where it does not split a's sum. */
static kiln_tensor *split_sum(const char *fn, kiln_tensor *a, unsigned mask, int keepdim,
                              float scale, kiln_dtype dt) {
  int lead = 0;
  while (lead < a->ndim && (mask & (1u << lead)))
    lead++;
  if (lead == 0 || mask != (1u << lead) - 1 || !kiln__is_contiguous(a) ||
      (a->dtype != KILN_DTYPE_F32 && a->dtype != KILN_DTYPE_BF16))
    return NULL;
  int64_t R = kiln__numel(lead, a->shape), C = kiln__numel(a->ndim - lead, a->shape + lead);
  if (R < KILN__SPLIT_MIN_ROWS || C > KILN__SPLIT_MAX_COLS || C == 0) return NULL;
  int64_t blk = KILN__SPLIT_BLOCK;
  while (blk <= KILN__SPLIT_MAX_BLOCK && R % blk != 0)
    blk++;
  if (blk > KILN__SPLIT_MAX_BLOCK) return NULL;
  /* (R / blk, C), f32 */
  kiln_tensor *parts = record_reduce(KILN__OP_SUM, fn, kiln_reshape(a, KILN_SHAPE(R / blk, blk, C)),
                                     2u, 0, 1.f, KILN_DTYPE_F32);
  kiln_tensor *sum = sum_as(fn, parts, 1u, 0, scale, dt); /* the total rounded to dt there */
  kiln_shape out = {.ndim = 0};
  for (int d = 0; d < a->ndim; d++)
    if (d >= lead || keepdim) out.d[out.ndim++] = d < lead ? 1 : a->shape[d];
  return kiln_reshape(sum, out);
}

/* A sum of a, split where split_sum splits it, its result in dt. */
static kiln_tensor *sum_as(const char *fn, kiln_tensor *a, unsigned mask, int keepdim, float scale,
                           kiln_dtype dt) {
  kiln_tensor *s = split_sum(fn, a, mask, keepdim, scale, dt);
  if (s || !kiln__ok(a->ctx)) return s;
  return record_reduce(KILN__OP_SUM, fn, a, mask, keepdim, scale, dt);
}

kiln_tensor *kiln__reduce(kiln__op op, const char *fn, kiln_tensor *a, unsigned mask, int keepdim,
                          float scale) {
  kiln_ctx *ctx = kiln__op_begin(fn, 1, &a);
  if (!ctx) return NULL;
  /* argmax gives indices; a sum of i32 values is an exact i32 (accumulated in 64 bits); bf16
   * values are reduced in f32 and the result rounded to bf16 */
  if (op == KILN__OP_SUM) return sum_as(fn, a, mask, keepdim, scale, a->dtype);
  return record_reduce(op, fn, a, mask, keepdim, scale,
                       op == KILN__OP_ARGMAX ? KILN_DTYPE_I32 : a->dtype);
}

static kiln_tensor *reduction(kiln__op op, const char *fn, kiln_tensor *a, kiln_axes axes,
                              int keepdim, bool mean) {
  kiln_ctx *ctx = kiln__op_begin(fn, 1, &a);
  if (!ctx) return NULL;
  bool isum = op == KILN__OP_SUM && !mean && a->dtype == KILN_DTYPE_I32; /* an exact count */
  if (!isum && !kiln__need_float(ctx, fn, 1, &a)) return NULL;
  unsigned mask;
  if (!axes_mask(ctx, fn, a, axes, &mask)) return NULL;
  int64_t r = 1;
  for (int d = 0; d < a->ndim; d++)
    if (mask & (1u << d)) r *= a->shape[d];
  float scale = mean ? (r > 0 ? (float)(1.0 / (double)r) : NAN) : 1.f;
  return kiln__reduce(op, fn, a, mask, keepdim, scale);
}

kiln_tensor *kiln_sum(kiln_tensor *a, kiln_axes axes, int keepdim) {
  return reduction(KILN__OP_SUM, __func__, a, axes, keepdim, false);
}
kiln_tensor *kiln_mean(kiln_tensor *a, kiln_axes axes, int keepdim) {
  return reduction(KILN__OP_SUM, __func__, a, axes, keepdim, true);
}
kiln_tensor *kiln_max(kiln_tensor *a, kiln_axes axes, int keepdim) {
  return reduction(KILN__OP_MAX, __func__, a, axes, keepdim, false);
}

/* The variance about the mean over axes: sum((a - mean)^2) / max(0, count - correction). The
 * mean only centres the values: the gradient through it is zero (the deviations sum to zero),
 * so it is recorded without one. A count not above the correction divides by zero, as PyTorch
 * does: inf, or NaN where every deviation is zero. */
static kiln_tensor *variance(const char *fn, kiln_tensor *a, kiln_axes axes, int correction,
                             int keepdim) {
  kiln_ctx *ctx = kiln__op_begin(fn, 1, &a);
  if (!ctx || !kiln__need_float(ctx, fn, 1, &a) || !kiln__as_f32(1, &a)) return NULL;
  unsigned mask;
  if (!axes_mask(ctx, fn, a, axes, &mask)) return NULL;
  int64_t r = 1;
  for (int d = 0; d < a->ndim; d++)
    if (mask & (1u << d)) r *= a->shape[d];
  double dof = (double)r - (double)correction;
  float scale = dof > 0 ? (float)(1.0 / dof) : INFINITY;
  kiln_no_grad_begin(ctx);
  kiln_tensor *m =
      kiln__reduce(KILN__OP_SUM, fn, a, mask, 1, r > 0 ? (float)(1.0 / (double)r) : NAN);
  kiln_no_grad_end(ctx);
  kiln_tensor *d = kiln_sub(a, m);
  if (!d) return NULL;
  return kiln__reduce(KILN__OP_SUM, fn, kiln_mul(d, d), mask, keepdim, scale);
}

kiln_tensor *kiln_var(kiln_tensor *a, kiln_axes axes, int correction, int keepdim) {
  return variance(__func__, a, axes, correction, keepdim);
}
kiln_tensor *kiln_std(kiln_tensor *a, kiln_axes axes, int correction, int keepdim) {
  return kiln_sqrt(variance(__func__, a, axes, correction, keepdim));
}

/* ---------------------------------------------------------------- softmax and the losses */

kiln_tensor *kiln_argmax(kiln_tensor *a, int axis, int keepdim) {
  kiln_ctx *ctx = kiln__op_begin(__func__, 1, &a);
  if (!ctx || !kiln__need_float(ctx, __func__, 1, &a) || !kiln__norm_axis(ctx, __func__, a, &axis))
    return NULL;
  return kiln__reduce(KILN__OP_ARGMAX, __func__, a, 1u << axis, keepdim, 1.f);
}

/* softmax's and log_softmax's common start: a (checked, in f32) less its max along *axis (made
 * non-negative), or NULL with the context's error. */
static kiln_tensor *less_max(const char *fn, kiln_tensor *a, int *axis) {
  kiln_ctx *ctx = kiln__op_begin(fn, 1, &a);
  if (!ctx || !kiln__need_float(ctx, fn, 1, &a) || !kiln__norm_axis(ctx, fn, a, axis) ||
      !kiln__as_f32(1, &a))
    return NULL;
  /* the max only steadies the exponent: it carries no gradient */
  kiln_no_grad_begin(ctx);
  kiln_tensor *m = kiln__reduce(KILN__OP_MAX, fn, a, 1u << *axis, 1, 1.f);
  kiln_no_grad_end(ctx);
  return kiln_sub(a, m);
}

kiln_tensor *kiln_softmax(kiln_tensor *a, int axis) {
  kiln_tensor *e = kiln_exp(less_max(__func__, a, &axis));
  return kiln_div(e, kiln_sum(e, KILN_AXES(axis), 1));
}

kiln_tensor *kiln_log_softmax(kiln_tensor *a, int axis) {
  kiln_tensor *z = less_max(__func__, a, &axis);
  return kiln_sub(z, kiln_log(kiln_sum(kiln_exp(z), KILN_AXES(axis), 1)));
}

kiln_tensor *kiln_cross_entropy(kiln_tensor *logits, kiln_tensor *labels, kiln_reduction red,
                                float label_smoothing) {
  kiln_tensor *in[2] = {logits, labels};
  const char *fn = __func__;
  kiln_ctx *ctx = kiln__op_begin(fn, 2, in);
  if (!ctx || !kiln__need_float(ctx, fn, 1, &logits)) return NULL;
  char s1[96], s2[96];
  if (logits->ndim != 2 || labels->ndim != 1 || labels->shape[0] != logits->shape[0])
    return kiln__error(
               ctx, KILN_ERR_SHAPE, "%s: logits must be (N, C) and labels (N); got %s and %s", fn,
               kiln__shape_of(logits, s1, sizeof s1), kiln__shape_of(labels, s2, sizeof s2)),
           NULL;
  if (labels->dtype != KILN_DTYPE_I32)
    return kiln__error(ctx, KILN_ERR_DTYPE, "%s: labels are %s; they must be i32", fn,
                       kiln_dtype_name(labels->dtype)),
           NULL;
  if (!(label_smoothing >= 0.f && label_smoothing <= 1.f))
    return kiln__error(ctx, KILN_ERR_INVALID, "%s: label_smoothing %g is not in [0, 1]", fn,
                       label_smoothing),
           NULL;
  if (red != KILN_REDUCTION_MEAN && red != KILN_REDUCTION_SUM && red != KILN_REDUCTION_NONE)
    return kiln__error(ctx, KILN_ERR_INVALID, "%s: unknown reduction %d", fn, red), NULL;
  int64_t n = logits->shape[0], c = logits->shape[1];
  kiln_tensor *logp = kiln_log_softmax(logits, 1); /* f32, whatever the logits' dtype */
  /* the target distribution: one-hot labels, smoothed towards uniform */
  kiln_tensor *lab = kiln_reshape(labels, KILN_SHAPE(n, 1));
  if (!lab) return NULL;
  int64_t oshape[2] = {n, c};
  kiln_tensor *target = kiln__tensor_intermediate(ctx, fn, KILN_DTYPE_F32, 2, oshape);
  if (!target) return NULL;
  kiln__node *nd = kiln__record(ctx, KILN__OP_ONEHOT, 1, &lab, target);
  if (!nd) return NULL;
  KILN__I(nd, ONEHOT, axis) = 1;
  KILN__I(nd, ONEHOT, classes) = c; /* labels outside [0, c) are an error, found on the device */
  if (label_smoothing > 0.f)
    target =
        kiln_add_scalar(kiln_mul_scalar(target, 1.f - label_smoothing), label_smoothing / (float)c);
  kiln_tensor *loss = kiln_neg(kiln_sum(kiln_mul(target, logp), KILN_AXES(1), 0)); /* (N) */
  if (red == KILN_REDUCTION_MEAN) return kiln_mean(loss, KILN_ALL_AXES, 0);
  if (red == KILN_REDUCTION_SUM) return kiln_sum(loss, KILN_ALL_AXES, 0);
  return loss;
}

/* ---------------------------------------------------------------- more losses */

static bool check_reduction(kiln_ctx *ctx, const char *fn, kiln_reduction red) {
  if (red == KILN_REDUCTION_MEAN || red == KILN_REDUCTION_SUM || red == KILN_REDUCTION_NONE)
    return true;
  return kiln__error(ctx, KILN_ERR_INVALID, "%s: unknown reduction %d", fn, red), false;
}

static kiln_tensor *reduce_loss(kiln_tensor *loss, kiln_reduction red) {
  if (red == KILN_REDUCTION_MEAN) return kiln_mean(loss, KILN_ALL_AXES, 0);
  if (red == KILN_REDUCTION_SUM) return kiln_sum(loss, KILN_ALL_AXES, 0);
  return loss;
}

/* Checks a loss's two float operands of one shape and its reduction, and makes them f32 (*x,
 * *t: losses compute in f32); the context or NULL. */
static kiln_ctx *loss_pair(const char *fn, kiln_tensor **xp, kiln_tensor **tp, const char *xname,
                           kiln_reduction red) {
  kiln_tensor *x = *xp, *t = *tp, *in[2] = {x, t};
  kiln_ctx *ctx = kiln__op_begin(fn, 2, in);
  if (!ctx || !kiln__need_float(ctx, fn, 2, in)) return NULL;
  bool same = x->ndim == t->ndim;
  for (int d = 0; same && d < x->ndim; d++)
    same = x->shape[d] == t->shape[d];
  if (!same) {
    char s1[96], s2[96];
    return kiln__error(ctx, KILN_ERR_SHAPE, "%s: %s %s and target %s must have one shape", fn,
                       xname, kiln__shape_of(x, s1, sizeof s1), kiln__shape_of(t, s2, sizeof s2)),
           NULL;
  }
  if (!check_reduction(ctx, fn, red) || !kiln__as_f32(2, in)) return NULL;
  *xp = in[0];
  *tp = in[1];
  return ctx;
}

kiln_tensor *kiln_mse_loss(kiln_tensor *input, kiln_tensor *target, kiln_reduction red) {
  if (!loss_pair(__func__, &input, &target, "input", red)) return NULL;
  kiln_tensor *d = kiln_sub(input, target);
  return reduce_loss(kiln_mul(d, d), red);
}

kiln_tensor *kiln_bce_with_logits(kiln_tensor *logits, kiln_tensor *target, kiln_reduction red) {
  if (!loss_pair(__func__, &logits, &target, "logits", red)) return NULL;
  /* softplus(x) - x t is max(x, 0) - x t + log(1 + exp(-|x|)): softplus is log1p(exp(x)) up to
   * its threshold of 20 and x above it, where log(1 + exp(-x)) is below float's precision of x.
   * Its gradient is sigmoid(x) - t, with no kink at 0. */
  kiln_tensor *sp = kiln_softplus(logits, 1.f, 20.f);
  return reduce_loss(kiln_sub(sp, kiln_mul(logits, target)), red);
}

kiln_tensor *kiln_cross_entropy_soft(kiln_tensor *logits, kiln_tensor *target, kiln_reduction red,
                                     float label_smoothing) {
  const char *fn = __func__;
  kiln_ctx *ctx = loss_pair(fn, &logits, &target, "logits", red);
  if (!ctx) return NULL;
  if (logits->ndim != 2) {
    char s1[96];
    return kiln__error(ctx, KILN_ERR_SHAPE, "%s: logits and target must be (N, C); got %s", fn,
                       kiln__shape_of(logits, s1, sizeof s1)),
           NULL;
  }
  if (!(label_smoothing >= 0.f && label_smoothing <= 1.f))
    return kiln__error(ctx, KILN_ERR_INVALID, "%s: label_smoothing %g is not in [0, 1]", fn,
                       label_smoothing),
           NULL;
  int64_t c = logits->shape[1];
  kiln_tensor *logp = kiln_log_softmax(logits, 1);
  if (label_smoothing > 0.f)
    target =
        kiln_add_scalar(kiln_mul_scalar(target, 1.f - label_smoothing), label_smoothing / (float)c);
  kiln_tensor *loss = kiln_neg(kiln_sum(kiln_mul(target, logp), KILN_AXES(1), 0)); /* (N) */
  return reduce_loss(loss, red);
}
