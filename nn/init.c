/*
 * init.c: initialisers as torch.nn.init's, filling an existing persistent f32 tensor in place:
 * uniform, normal (Box-Muller), constant, Kaiming and Xavier (uniform and normal), with
 * calculate_gain's gains and the fans of torch's _calculate_fan_in_and_fan_out. The values are
 * drawn on the host from the context's RNG, as the layers' own parameters are (nn/params.c), and
 * uploaded with one copy; a call that fails leaves the tensor and the RNG as they were.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../core/internal.h"

/* How the host buffer is filled: uniform in [lo, hi), normal (a, b) = (mean, std), or a. */
typedef enum fill_kind { FILL_UNIFORM, FILL_NORMAL, FILL_CONSTANT } fill_kind;

/* t's context after checking that t is a live persistent contiguous f32 tensor, or NULL (with
 * the error set where there is a context to set it on). */
static kiln_ctx *target(kiln_tensor *t, const char *fn) {
  kiln_ctx *ctx = kiln__handle_ctx(t);
  if (!ctx || !kiln__ok(ctx) || !kiln__check(ctx, t, fn)) return NULL;
  char sh[96];
  if (!t->persistent || !kiln__is_contiguous(t) || t->offset != 0) {
    kiln__error(ctx, KILN_ERR_INVALID,
                "%s: '%s' %s is %s; initialisers fill a persistent contiguous tensor in place", fn,
                kiln__name(t), kiln__shape_of(t, sh, sizeof sh),
                t->persistent || t->st->persistent ? "a view" : "an intermediate");
    return NULL;
  }
  if (t->dtype != KILN_DTYPE_F32) {
    kiln__error(ctx, KILN_ERR_DTYPE, "%s: '%s' %s is %s; initialisers fill f32 tensors", fn,
                kiln__name(t), kiln__shape_of(t, sh, sizeof sh), kiln_dtype_name(t->dtype));
    return NULL;
  }
  return ctx;
}

/* Fills t with n values of kind drawn from the context's host RNG and uploads them. On failure
 * the RNG is put back, so that a failed call changes nothing. */
static kiln_status fill(kiln_ctx *ctx, kiln_tensor *t, const char *fn, fill_kind kind, double a,
                        double b) {
  int64_t n = kiln_tensor_numel(t);
  if (n == 0) return KILN_OK; /* torch warns and does nothing */
  float *h = malloc((size_t)n * sizeof *h);
  if (!h) return kiln__error(ctx, KILN_ERR_OOM, "%s: out of host memory", fn);
  uint64_t rng = ctx->host_rng;
  for (int64_t i = 0; i < n; i++) {
    if (kind == FILL_CONSTANT) {
      h[i] = (float)a;
    } else if (kind == FILL_UNIFORM) {
      float v = (float)(a + (b - a) * kiln__rng_uniform(ctx));
      /* rounding to float may reach hi; the interval is [lo, hi) as torch's uniform_ */
      h[i] = v >= (float)b && b > a ? nextafterf((float)b, (float)a) : v;
    } else {
      /* Box-Muller in double: two uniform draws give two independent standard normals */
      double u1 = 1.0 - kiln__rng_uniform(ctx), u2 = kiln__rng_uniform(ctx); /* u1 in (0, 1] */
      double r = sqrt(-2.0 * log(u1)), th = 2.0 * M_PI * u2;
      h[i] = (float)(a + b * r * cos(th));
      if (i + 1 < n) h[++i] = (float)(a + b * r * sin(th));
    }
  }
  kiln_status s = kiln_tensor_copy_from_host(t, h, (size_t)n * sizeof *h);
  free(h);
  if (s != KILN_OK) ctx->host_rng = rng;
  return s;
}

static bool finite_or_error(kiln_ctx *ctx, const char *fn, const char *what, double v) {
  if (isfinite(v)) return true;
  kiln__error(ctx, KILN_ERR_INVALID, "%s: %s %g must be finite", fn, what, v);
  return false;
}

kiln_status kiln_init_uniform(kiln_tensor *t, float lo, float hi) {
  const char *fn = __func__;
  kiln_ctx *ctx = target(t, fn);
  if (!ctx) return kiln__handle_ctx(t) ? kiln__handle_ctx(t)->status : KILN_ERR_INVALID;
  if (!finite_or_error(ctx, fn, "lo", lo) || !finite_or_error(ctx, fn, "hi", hi))
    return ctx->status;
  if (lo > hi)
    return kiln__error(ctx, KILN_ERR_INVALID, "%s: lo %g > hi %g", fn, (double)lo, (double)hi);
  return fill(ctx, t, fn, FILL_UNIFORM, lo, hi);
}

kiln_status kiln_init_normal(kiln_tensor *t, float mean, float std) {
  const char *fn = __func__;
  kiln_ctx *ctx = target(t, fn);
  if (!ctx) return kiln__handle_ctx(t) ? kiln__handle_ctx(t)->status : KILN_ERR_INVALID;
  if (!finite_or_error(ctx, fn, "mean", mean) || !finite_or_error(ctx, fn, "std", std))
    return ctx->status;
  if (std < 0.f) return kiln__error(ctx, KILN_ERR_INVALID, "%s: std %g must be >= 0", fn, std);
  return fill(ctx, t, fn, FILL_NORMAL, mean, std);
}

kiln_status kiln_init_constant(kiln_tensor *t, float value) {
  const char *fn = __func__;
  kiln_ctx *ctx = target(t, fn);
  if (!ctx) return kiln__handle_ctx(t) ? kiln__handle_ctx(t)->status : KILN_ERR_INVALID;
  if (!finite_or_error(ctx, fn, "value", value)) return ctx->status;
  return fill(ctx, t, fn, FILL_CONSTANT, value, 0.0);
}

/* ---------------------------------------------------------------- gains and fans */

/* The gain, or NAN when the nonlinearity is not one of the enum's. */
static double gain_of(kiln_nonlinearity nl, float param) {
  switch (nl) {
  case KILN_NONLINEARITY_LINEAR:
  case KILN_NONLINEARITY_SIGMOID: return 1.0;
  case KILN_NONLINEARITY_TANH: return 5.0 / 3.0;
  case KILN_NONLINEARITY_RELU: return sqrt(2.0);
  case KILN_NONLINEARITY_SELU: return 3.0 / 4.0;
  case KILN_NONLINEARITY_LEAKY_RELU: {
    double a = kiln__opt_or(param, 0.01f); /* torch's negative_slope when param is None */
    return sqrt(2.0 / (1.0 + a * a));
  }
  default: return NAN;
  }
}

float kiln_init_gain(kiln_nonlinearity nonlinearity, float param) {
  return (float)gain_of(nonlinearity, param);
}

/* The fans of a tensor of at least 2 dims (checked by the caller). */
static void fans_of(const kiln_tensor *t, int64_t *fan_in, int64_t *fan_out) {
  int64_t rf = 1; /* the receptive field: the product of the dims after the first two */
  for (int d = 2; d < t->ndim; d++)
    rf *= t->shape[d];
  *fan_in = t->shape[1] * rf;
  *fan_out = t->shape[0] * rf;
}

/* Checks that t has at least 2 dims, as torch's fan computation needs. */
static bool has_fans(kiln_ctx *ctx, const kiln_tensor *t, const char *fn) {
  if (t->ndim >= 2) return true;
  char sh[96];
  kiln__error(ctx, KILN_ERR_SHAPE,
              "%s: '%s' %s has %d dims; fan in and fan out need at least 2 ((out, in, ...))", fn,
              kiln__name(t), kiln__shape_of(t, sh, sizeof sh), t->ndim);
  return false;
}

kiln_status kiln_init_fans(const kiln_tensor *t, int64_t *fan_in, int64_t *fan_out) {
  const char *fn = __func__;
  kiln_ctx *ctx = kiln__handle_ctx(t);
  if (!ctx) return KILN_ERR_INVALID;
  if (!kiln__ok(ctx) || !kiln__check(ctx, t, fn) || !has_fans(ctx, t, fn)) return ctx->status;
  int64_t fi, fo;
  fans_of(t, &fi, &fo);
  if (fan_in) *fan_in = fi;
  if (fan_out) *fan_out = fo;
  return KILN_OK;
}

/* Kaiming: std = gain / sqrt(fan), drawn uniform (bound sqrt(3) std) or normal. */
static kiln_status kaiming(kiln_tensor *t, float a, kiln_fan_mode mode, kiln_nonlinearity nl,
                           bool uniform, const char *fn) {
  kiln_ctx *ctx = target(t, fn);
  if (!ctx) return kiln__handle_ctx(t) ? kiln__handle_ctx(t)->status : KILN_ERR_INVALID;
  if (!finite_or_error(ctx, fn, "a", a)) return ctx->status;
  if (mode != KILN_FAN_IN && mode != KILN_FAN_OUT)
    return kiln__error(ctx, KILN_ERR_INVALID, "%s: mode %d is neither KILN_FAN_IN nor KILN_FAN_OUT",
                       fn, (int)mode);
  /* a is the slope itself: 0 is a slope of 0, torch's default here (ReLU's gain) */
  double gain = gain_of(nl, a == 0.f ? KILN_ZERO : a);
  if (isnan(gain))
    return kiln__error(ctx, KILN_ERR_INVALID, "%s: unknown nonlinearity %d", fn, (int)nl);
  if (!has_fans(ctx, t, fn)) return ctx->status;
  if (kiln_tensor_numel(t) == 0) return KILN_OK; /* torch warns and does nothing */
  int64_t fi, fo;
  fans_of(t, &fi, &fo);
  double std = gain / sqrt((double)(mode == KILN_FAN_IN ? fi : fo));
  if (uniform) return fill(ctx, t, fn, FILL_UNIFORM, -sqrt(3.0) * std, sqrt(3.0) * std);
  return fill(ctx, t, fn, FILL_NORMAL, 0.0, std);
}

kiln_status kiln_init_kaiming_uniform(kiln_tensor *t, float a, kiln_fan_mode mode,
                                      kiln_nonlinearity nonlinearity) {
  return kaiming(t, a, mode, nonlinearity, true, __func__);
}
kiln_status kiln_init_kaiming_normal(kiln_tensor *t, float a, kiln_fan_mode mode,
                                     kiln_nonlinearity nonlinearity) {
  return kaiming(t, a, mode, nonlinearity, false, __func__);
}

/* Xavier: std = gain sqrt(2 / (fan_in + fan_out)), drawn uniform (bound sqrt(3) std) or normal. */
static kiln_status xavier(kiln_tensor *t, float gain, bool uniform, const char *fn) {
  kiln_ctx *ctx = target(t, fn);
  if (!ctx) return kiln__handle_ctx(t) ? kiln__handle_ctx(t)->status : KILN_ERR_INVALID;
  double g = kiln__opt_or(gain, 1.f); /* torch's gain=1.0; KILN_ZERO fills zeros */
  if (!(g >= 0.0) || !isfinite(g))
    return kiln__error(ctx, KILN_ERR_INVALID, "%s: gain %g must be finite and >= 0", fn, gain);
  if (!has_fans(ctx, t, fn)) return ctx->status;
  if (kiln_tensor_numel(t) == 0) return KILN_OK;
  int64_t fi, fo;
  fans_of(t, &fi, &fo);
  double std = g * sqrt(2.0 / (double)(fi + fo));
  if (uniform) return fill(ctx, t, fn, FILL_UNIFORM, -sqrt(3.0) * std, sqrt(3.0) * std);
  return fill(ctx, t, fn, FILL_NORMAL, 0.0, std);
}

kiln_status kiln_init_xavier_uniform(kiln_tensor *t, float gain) {
  return xavier(t, gain, true, __func__);
}
kiln_status kiln_init_xavier_normal(kiln_tensor *t, float gain) {
  return xavier(t, gain, false, __func__);
}
