/*
 * init.c: initialisers as torch.nn.init's, filling an existing persistent f32 tensor in place:
 * uniform, normal (Box-Muller), constant, Kaiming and Xavier (uniform and normal), with
 * calculate_gain's gains and the fans of torch's _calculate_fan_in_and_fan_out. The values are
 * drawn on the host from the context's RNG, as the layers' own parameters are (nn/params.c), and
 * uploaded with one copy; a call that fails leaves the tensor and the RNG as they were.
 * Whitening (airbench's first layer) sets a convolution's filters from images instead: the
 * eigenvectors of their patches' covariance, by a cyclic Jacobi eigensolver in float64.
 */
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "init.h"

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

/* ---------------------------------------------------------------- whitening */

/* Whether |x| is small enough beside the diagonal entries app and aqq (and the matrix's norm
 * fro) for a Jacobi rotation to be skipped: below rounding relative to sqrt(|app aqq|), which
 * keeps small eigenvalues accurate, or negligible against the whole matrix. */
static bool negligible(double x, double app, double aqq, double fro) {
  double ax = fabs(x);
  return ax <= DBL_EPSILON * sqrt(fabs(app) * fabs(aqq)) || ax <= 1e-30 * fro || ax < DBL_MIN;
}

/* One Jacobi rotation of m (n x n, symmetric) in the plane (p, q), chosen to zero m[p][q], and
 * its accumulation into the columns of qv (the eigenvectors so far). */
static void rotate(int n, double *m, double *qv, int p, int q) {
  double apq = m[p * n + q], app = m[p * n + p], aqq = m[q * n + q];
  /* cot(2 phi) = (aqq - app) / (2 apq); t = tan(phi), the smaller root */
  double theta = (aqq - app) / (2.0 * apq);
  double t = fabs(theta) > 1e150 ? 1.0 / (2.0 * theta)
                                 : copysign(1.0, theta) / (fabs(theta) + sqrt(theta * theta + 1.0));
  double c = 1.0 / sqrt(t * t + 1.0), s = t * c;
  for (int k = 0; k < n; k++) { /* m J: columns p and q */
    double kp = m[k * n + p], kq = m[k * n + q];
    m[k * n + p] = c * kp - s * kq;
    m[k * n + q] = s * kp + c * kq;
  }
  for (int k = 0; k < n; k++) { /* J^T (m J): rows p and q */
    double pk = m[p * n + k], qk = m[q * n + k];
    m[p * n + k] = c * pk - s * qk;
    m[q * n + k] = s * pk + c * qk;
  }
  m[p * n + q] = m[q * n + p] = 0.0; /* zero in exact arithmetic */
  for (int k = 0; k < n; k++) {
    double kp = qv[k * n + p], kq = qv[k * n + q];
    qv[k * n + p] = c * kp - s * kq;
    qv[k * n + q] = s * kp + c * kq;
  }
}

int kiln__eigh_jacobi(int n, const double *a, double *w, double *v) {
  if (n < 1 || !a || !w || !v) return KILN__EIGH_BAD;
  size_t nn = (size_t)n * (size_t)n;
  double *m = malloc(2 * nn * sizeof *m);
  int *order = malloc((size_t)n * sizeof *order);
  if (!m || !order) {
    free(m);
    free(order);
    return KILN__EIGH_OOM;
  }
  double *qv = m + nn; /* column j: the j-th eigenvector so far */
  double fro = 0.0;
  for (int i = 0; i < n; i++)
    for (int j = i; j < n; j++) {
      double x = a[i * n + j];
      if (!isfinite(x)) {
        free(m);
        free(order);
        return KILN__EIGH_BAD;
      }
      m[i * n + j] = m[j * n + i] = x;
      fro += (i == j ? 1.0 : 2.0) * x * x;
    }
  fro = sqrt(fro);
  if (!isfinite(fro)) { /* values beyond 1e154: their squares overflow */
    free(m);
    free(order);
    return KILN__EIGH_BAD;
  }
  for (size_t k = 0; k < nn; k++)
    qv[k] = k % ((size_t)n + 1) == 0 ? 1.0 : 0.0;
  /* cyclic sweeps over the pairs (p, q), p < q, until a sweep finds nothing to rotate */
  int sweeps = 0;
  for (;; sweeps++) {
    bool rotated = false;
    for (int p = 0; p < n; p++)
      for (int q = p + 1; q < n; q++) {
        if (negligible(m[p * n + q], m[p * n + p], m[q * n + q], fro)) continue;
        if (!rotated && sweeps == KILN__EIGH_SWEEPS) {
          free(m);
          free(order);
          return KILN__EIGH_NOCONV;
        }
        rotate(n, m, qv, p, q);
        rotated = true;
      }
    if (!rotated) break;
  }
  /* eigenvalues descending (a stable insertion sort of the diagonal's indices) */
  for (int i = 0; i < n; i++) {
    int j = i;
    for (; j > 0 && m[order[j - 1] * (n + 1)] < m[i * (n + 1)]; j--)
      order[j] = order[j - 1];
    order[j] = i;
  }
  for (int r = 0; r < n; r++) {
    int col = order[r];
    w[r] = m[col * (n + 1)];
    int big = 0; /* the component of largest magnitude is made positive */
    for (int k = 1; k < n; k++)
      if (fabs(qv[k * n + col]) > fabs(qv[big * n + col])) big = k;
    double sign = qv[big * n + col] < 0.0 ? -1.0 : 1.0;
    for (int k = 0; k < n; k++)
      v[r * n + k] = sign * qv[k * n + col];
  }
  free(m);
  free(order);
  return sweeps;
}

bool kiln__patch_covariance(kiln_host_type type, const int64_t shape[4], const void *images,
                            const kiln_normalize *norm, int kh, int kw, double *cov) {
  int64_t n = shape[0], H = shape[1], W = shape[2], C = shape[3];
  int64_t K = C * kh * kw, oh = H - kh + 1, ow = W - kw + 1, per = H * W * C;
  int channels = norm ? norm->channels : 0;
  double *img = malloc((size_t)per * sizeof *img), *p = malloc((size_t)K * sizeof *p);
  double *acc = calloc((size_t)(K * K), sizeof *acc);
  if (!img || !p || !acc) {
    free(img);
    free(p);
    free(acc);
    return false;
  }
  for (int64_t b = 0; b < n; b++) {
    /* image b as a data set holds it (float arithmetic), then in double */
    for (int64_t i = 0; i < per; i++) {
      int64_t at = b * per + i;
      float x = type == KILN_HOST_U8 ? (float)((const uint8_t *)images)[at] / 255.f
                                     : ((const float *)images)[at];
      if (channels > 0) {
        int c = channels == 1 ? 0 : (int)(i % C);
        x = (x - norm->mean[c]) / norm->std[c];
      }
      img[i] = x;
    }
    for (int64_t y = 0; y < oh; y++)
      for (int64_t x = 0; x < ow; x++) {
        for (int64_t c = 0; c < C; c++) /* the patch, in (c, dh, dw) order */
          for (int dh = 0; dh < kh; dh++)
            for (int dw = 0; dw < kw; dw++)
              p[(c * kh + dh) * kw + dw] = img[((y + dh) * W + (x + dw)) * C + c];
        for (int64_t i = 0; i < K; i++) { /* p p^T, the upper triangle */
          double pi = p[i], *row = acc + i * K;
          for (int64_t j = i; j < K; j++)
            row[j] += pi * p[j];
        }
      }
  }
  double count = (double)n * (double)oh * (double)ow;
  for (int64_t i = 0; i < K; i++)
    for (int64_t j = i; j < K; j++)
      cov[j * K + i] = cov[i * K + j] = acc[i * K + j] / count;
  free(img);
  free(p);
  free(acc);
  return true;
}

#define WHITENING_EPS 5e-4f /* airbench's */
/* Patches of at most this many elements: the eigensolver's sweeps are O(K^3). */
#define WHITENING_MAX_K 1024

/* Checks the images (n, H, W, C) and their normalisation for kh x kw patches, all but the values
 * themselves. */
static bool whitening_images_ok(kiln_ctx *ctx, const char *fn, kiln_host_type type,
                                kiln_shape shape, const void *images, const kiln_normalize *norm,
                                int kh, int kw) {
  char sh[96];
  if (type != KILN_HOST_F32 && type != KILN_HOST_U8)
    return !kiln__error(ctx, KILN_ERR_INVALID, "%s: unknown host type %d", fn, (int)type);
  if (!images) return !kiln__error(ctx, KILN_ERR_INVALID, "%s: NULL images", fn);
  if (shape.ndim != 4)
    return !kiln__error(ctx, KILN_ERR_SHAPE,
                        "%s: images %s have %d dims; they must be (n, H, W, C), channels last", fn,
                        kiln_shape_str(shape, sh, sizeof sh), shape.ndim);
  if (!kiln__valid_shape(ctx, fn, 4, shape.d)) return false;
  if (shape.d[0] < 1 || shape.d[1] < kh || shape.d[2] < kw || shape.d[3] < 1)
    return !kiln__error(ctx, KILN_ERR_SHAPE,
                        "%s: images %s for %dx%d patches: they must be (n >= 1, H >= %d, W >= %d, "
                        "C >= 1)",
                        fn, kiln_shape_str(shape, sh, sizeof sh), kh, kw, kh, kw);
  if (norm && norm->from_data)
    return !kiln__error(ctx, KILN_ERR_INVALID,
                        "%s: a normalisation from the data (from_data 1) is not computed here: "
                        "give its mean and std (kiln_image_stats, or kiln_dataset_normalization "
                        "of the data set)",
                        fn);
  if (norm && norm->channels != 0) {
    if (norm->channels != 1 && norm->channels != shape.d[3])
      return !kiln__error(ctx, KILN_ERR_SHAPE,
                          "%s: a normalisation of %d channels for images %s: it needs 1 or the "
                          "images' channels, %lld (0: none)",
                          fn, norm->channels, kiln_shape_str(shape, sh, sizeof sh),
                          (long long)shape.d[3]);
    if (!norm->mean || !norm->std)
      return !kiln__error(ctx, KILN_ERR_INVALID, "%s: a normalisation of %d channels without %s",
                          fn, norm->channels, !norm->mean ? "its mean" : "its std");
    for (int c = 0; c < norm->channels; c++)
      if (!isfinite(norm->mean[c]) || !(norm->std[c] > 0.f) || !isfinite(norm->std[c]))
        return !kiln__error(ctx, KILN_ERR_INVALID,
                            "%s: channel %d's mean %g must be finite and its std %g finite and > 0",
                            fn, c, norm->mean[c], norm->std[c]);
  }
  return true;
}

/* The whitening filters (cout, K) from the patch covariance cov (K x K, filter order), checked
 * and eps e applied as kiln__whitening_filters says; on failure filters and eigenvalues are
 * untouched. */
static kiln_status filters_of(kiln_ctx *ctx, const char *fn, int64_t K, const double *cov,
                              int64_t cout, double e, float *filters, double *eigenvalues) {
  double *buf = malloc((size_t)(K * K + K) * sizeof *buf);
  if (!buf) return kiln__error(ctx, KILN_ERR_OOM, "%s: out of host memory", fn);
  double *vec = buf, *val = buf + K * K;
  int sweeps = kiln__eigh_jacobi((int)K, cov, val, vec);
  if (sweeps < 0) {
    free(buf);
    if (sweeps == KILN__EIGH_OOM)
      return kiln__error(ctx, KILN_ERR_OOM, "%s: out of host memory", fn);
    return kiln__error(
        ctx, KILN_ERR_INVALID, "%s: the %lldx%lld patch covariance has no eigen-decomposition (%s)",
        fn, (long long)K, (long long)K,
        sweeps == KILN__EIGH_BAD ? "a value is not finite" : "the Jacobi sweeps did not converge");
  }
  int64_t half = cout / 2;
  if (!(val[half - 1] + e > 0.0)) { /* a covariance's eigenvalues are >= 0, up to rounding */
    double bad = val[half - 1];
    free(buf);
    return kiln__error(ctx, KILN_ERR_INVALID,
                       "%s: eigenvalue %lld of the patch covariance is %g: with eps %g, no square "
                       "root",
                       fn, (long long)(half - 1), bad, e);
  }
  for (int64_t i = 0; i < half; i++) {
    double scale = 1.0 / sqrt(val[i] + e);
    for (int64_t k = 0; k < K; k++) {
      float f = (float)(vec[i * K + k] * scale);
      filters[i * K + k] = f;
      filters[(half + i) * K + k] = -f;
    }
  }
  if (eigenvalues) memcpy(eigenvalues, val, (size_t)K * sizeof *val);
  free(buf);
  return KILN_OK;
}

/* Whether C channels of kh x kw patches (at most WHITENING_MAX_K values) make cout filters: an
 * even number, at most two per patch element. */
static bool filter_count_ok(kiln_ctx *ctx, const char *fn, int64_t C, int kh, int kw,
                            int64_t cout) {
  if (C > WHITENING_MAX_K / kh / kw)
    return !kiln__error(ctx, KILN_ERR_SHAPE,
                        "%s: %lld channels of %dx%d make patches of more than %d elements", fn,
                        (long long)C, kh, kw, WHITENING_MAX_K);
  if (cout < 2 || cout % 2 || cout / 2 > C * kh * kw)
    return !kiln__error(ctx, KILN_ERR_SHAPE,
                        "%s: %lld filters: whitening makes an even number, 2 to 2 C kh kw = %lld "
                        "(eigenvectors and their negatives)",
                        fn, (long long)cout, (long long)(2 * C * kh * kw));
  return true;
}

/* eps as the whitening functions take it (0: WHITENING_EPS) into *e, checked. */
static bool whitening_eps(kiln_ctx *ctx, const char *fn, float eps, double *e) {
  *e = kiln__opt_or(eps, WHITENING_EPS);
  if (*e > 0.0 && isfinite(*e)) return true;
  return !kiln__error(ctx, KILN_ERR_INVALID, "%s: eps %g must be finite and > 0 (0: %g)", fn,
                      (double)eps, (double)WHITENING_EPS);
}

kiln_status kiln__whitening_filters(kiln_ctx *ctx, const char *fn, kiln_host_type type,
                                    kiln_shape shape, const void *images,
                                    const kiln_normalize *norm, int64_t cout, int kh, int kw,
                                    float eps, float *filters, double *eigenvalues) {
  if (!ctx) return KILN_ERR_INVALID;
  if (!kiln__ok(ctx)) return ctx->status;
  double e;
  if (!whitening_eps(ctx, fn, eps, &e)) return ctx->status;
  if (kh < 1 || kw < 1)
    return kiln__error(ctx, KILN_ERR_SHAPE, "%s: %dx%d filters: kh and kw must be >= 1", fn, kh,
                       kw);
  if (!whitening_images_ok(ctx, fn, type, shape, images, norm, kh, kw) ||
      !filter_count_ok(ctx, fn, shape.d[3], kh, kw, cout))
    return ctx->status;
  int64_t K = shape.d[3] * kh * kw;
  if (!filters) return kiln__error(ctx, KILN_ERR_INVALID, "%s: NULL filters", fn);
  if (type == KILN_HOST_F32) {
    const float *f = images;
    int64_t total = kiln__numel(4, shape.d);
    for (int64_t i = 0; i < total; i++)
      if (!isfinite(f[i]))
        return kiln__error(ctx, KILN_ERR_INVALID, "%s: image value %lld is %g", fn, (long long)i,
                           f[i]);
  }
  double *cov = malloc((size_t)(K * K) * sizeof *cov);
  if (!cov) return kiln__error(ctx, KILN_ERR_OOM, "%s: out of host memory", fn);
  kiln_status st = kiln__patch_covariance(type, shape.d, images, norm, kh, kw, cov)
                       ? filters_of(ctx, fn, K, cov, cout, e, filters, eigenvalues)
                       : kiln__error(ctx, KILN_ERR_OOM, "%s: out of host memory", fn);
  free(cov);
  return st;
}

/* Whether weight is a convolution weight (Cout, Cin, kh, kw) with a window of int sizes. */
static bool conv_weight(kiln_ctx *ctx, const char *fn, const kiln_tensor *weight) {
  char sw[96];
  if (weight->ndim == 4 && weight->shape[2] <= INT32_MAX && weight->shape[3] <= INT32_MAX)
    return true;
  return !kiln__error(ctx, KILN_ERR_SHAPE,
                      "%s: '%s' %s: a convolution weight is (Cout, Cin, kh, kw)", fn,
                      kiln__name(weight), kiln__shape_of(weight, sw, sizeof sw));
}

kiln_status kiln_init_whitening(kiln_tensor *weight, kiln_host_type type, kiln_shape shape,
                                const void *images, const kiln_normalize *norm, float eps) {
  const char *fn = __func__;
  kiln_ctx *ctx = target(weight, fn);
  if (!ctx) return kiln__handle_ctx(weight) ? kiln__handle_ctx(weight)->status : KILN_ERR_INVALID;
  char sw[96], si[96];
  if (!conv_weight(ctx, fn, weight)) return ctx->status;
  int64_t cout = weight->shape[0], cin = weight->shape[1];
  if (shape.ndim == 4 && shape.d[3] != cin) /* name the weight, which the filters cannot */
    return kiln__error(ctx, KILN_ERR_SHAPE,
                       "%s: images %s have %lld channels; the weight '%s' %s takes %lld", fn,
                       kiln_shape_str(shape, si, sizeof si), (long long)shape.d[3],
                       kiln__name(weight), kiln__shape_of(weight, sw, sizeof sw), (long long)cin);
  int64_t n = kiln_tensor_numel(weight);
  float *h = n > 0 ? malloc((size_t)n * sizeof *h) : NULL;
  if (n > 0 && !h) return kiln__error(ctx, KILN_ERR_OOM, "%s: out of host memory", fn);
  kiln_status s =
      kiln__whitening_filters(ctx, fn, type, shape, images, norm, cout, (int)weight->shape[2],
                              (int)weight->shape[3], eps, h, NULL);
  if (s == KILN_OK) s = kiln_tensor_copy_from_host(weight, h, (size_t)n * sizeof *h);
  free(h);
  return s;
}

/* Patches of the device covariance are summed a chunk of about this many at a time: each chunk's
 * sum in f32 is short, and the chunks' sums are added on the device (the precision of the small
 * eigenvalues). The chunks run in one flush, so every chunk's columns are in memory together, as
 * intermediates until the next step begins: n (H - kh + 1) (W - kw + 1) C kh kw floats. */
#define WHITENING_CHUNK_PATCHES ((int64_t)1 << 18)

/* The patch covariance of images (n, H, W, C) on the device into cov (K x K, filter order, float64
 * on the host): each chunk's columns (im2col) P and P^T P / count, in f32 without TF32, summed on
 * the device; one read back. */
static kiln_status device_covariance(kiln_ctx *ctx, const char *fn, kiln_tensor *images, int kh,
                                     int kw, double *cov) {
  int64_t n = images->shape[0], H = images->shape[1], W = images->shape[2], C = images->shape[3];
  int64_t oh = H - kh + 1, ow = W - kw + 1, K = C * kh * kw;
  int64_t per = oh * ow,
          chunk = WHITENING_CHUNK_PATCHES / per > 0 ? WHITENING_CHUNK_PATCHES / per : 1;
  float inv = (float)(1.0 / ((double)n * (double)per));
  float *h = malloc((size_t)(K * K) * sizeof *h);
  if (!h) return kiln__error(ctx, KILN_ERR_OOM, "%s: out of host memory", fn);
  bool tf32 = ctx->tf32;
  ctx->tf32 = false; /* plain f32 products: the covariance's small eigenvalues matter */
  kiln_no_grad_begin(ctx);
  kiln_autocast_begin(ctx, KILN_DTYPE_F32); /* not bf16 either, inside a caller's region */
  kiln__win w = {.kh = kh, .kw = kw, .sh = 1, .sw = 1, .dh = 1, .dw = 1};
  kiln_tensor *x = images->dtype == KILN_DTYPE_F32 ? images : kiln_cast(images, KILN_DTYPE_F32);
  kiln_tensor *sum = NULL;
  for (int64_t b = 0; b < n && x; b += chunk) {
    int64_t m = n - b < chunk ? n - b : chunk, cshape[4] = {m, oh, ow, K};
    kiln_tensor *part = kiln_contiguous(kiln_slice(x, 0, b, b + m, 1));
    kiln_tensor *cols = part ? kiln__window(KILN__OP_IM2COL, fn, part, NULL, cshape, &w) : NULL;
    if (!cols) break;
    KILN__I(kiln__producer(cols), IM2COL, groups) = 1;
    kiln_tensor *p = kiln_reshape(cols, KILN_SHAPE(m * per, K));
    kiln_tensor *s = kiln_mul_scalar(kiln_matmul(kiln_transpose(p, 0, 1), p), inv);
    sum = sum ? kiln_add(sum, s) : s;
  }
  kiln_status st = sum ? kiln_tensor_to_host(sum, h, (size_t)(K * K) * sizeof *h) : ctx->status;
  kiln_autocast_end(ctx);
  kiln_no_grad_end(ctx);
  ctx->tf32 = tf32;
  /* im2col's columns are (dh, dw, c); a filter's (c, dh, dw) */
  for (int64_t i = 0; i < K && st == KILN_OK; i++)
    for (int64_t j = 0; j < K; j++) {
      int64_t ci = i / (kh * kw), di = i % (kh * kw), cj = j / (kh * kw), dj = j % (kh * kw);
      cov[i * K + j] = h[(di * C + ci) * K + dj * C + cj];
    }
  free(h);
  return st;
}

kiln_status kiln_init_whitening_tensor(kiln_tensor *weight, kiln_tensor *images, float eps) {
  const char *fn = __func__;
  kiln_ctx *ctx = target(weight, fn);
  if (!ctx) return kiln__handle_ctx(weight) ? kiln__handle_ctx(weight)->status : KILN_ERR_INVALID;
  if (!images) return kiln__error(ctx, KILN_ERR_INVALID, "%s: NULL images", fn);
  if (!kiln__check(ctx, images, fn)) return ctx->status;
  char sw[96], si[96];
  if (!conv_weight(ctx, fn, weight)) return ctx->status;
  int64_t cout = weight->shape[0], cin = weight->shape[1];
  int kh = (int)weight->shape[2], kw = (int)weight->shape[3];
  if (images->ndim != 4 || images->shape[0] < 1 || images->shape[1] < kh || images->shape[2] < kw ||
      images->shape[3] != cin || !kiln__is_float(images->dtype))
    return kiln__error(ctx, KILN_ERR_SHAPE,
                       "%s: images %s %s for the weight '%s' %s: they must be f32 or bf16 (n >= 1, "
                       "H >= %d, W >= %d, %lld), channels last",
                       fn, kiln__shape_of(images, si, sizeof si), kiln_dtype_name(images->dtype),
                       kiln__name(weight), kiln__shape_of(weight, sw, sizeof sw), kh, kw,
                       (long long)cin);
  double e;
  if (!whitening_eps(ctx, fn, eps, &e) || !filter_count_ok(ctx, fn, cin, kh, kw, cout))
    return ctx->status;
  if (ctx->in_step && ctx->graphs)
    return kiln__error(ctx, KILN_ERR_STATE,
                       "%s: inside a step with step graphs on, where nothing is read back; call "
                       "it before kiln_step_begin or after kiln_step_end",
                       fn);
  int64_t K = cin * kh * kw;
  double *cov = malloc((size_t)(K * K) * sizeof *cov);
  float *h = malloc((size_t)(cout * K) * sizeof *h);
  kiln_status st = !cov || !h ? kiln__error(ctx, KILN_ERR_OOM, "%s: out of host memory", fn)
                              : device_covariance(ctx, fn, images, kh, kw, cov);
  if (st == KILN_OK) st = filters_of(ctx, fn, K, cov, cout, e, h, NULL);
  if (st == KILN_OK) st = kiln_tensor_copy_from_host(weight, h, (size_t)(cout * K) * sizeof *h);
  free(cov);
  free(h);
  return st;
}
