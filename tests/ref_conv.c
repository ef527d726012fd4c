/*
 * ref_conv.c: float64 references for the image ops (see ref_conv.h), direct loops over PyTorch's
 * definitions: no im2col, no kiln call.
 */
#include "ref_conv.h"

#include <math.h>
#include <string.h>

/* ---------------------------------------------------------------- geometry */

int64_t ref_out_size(int64_t in, int k, int stride, int pad, int dil) {
  int64_t span = in + 2 * (int64_t)pad - (int64_t)dil * (k - 1) - 1;
  return span < 0 ? 0 : span / stride + 1;
}

kiln_shape ref_win_out(kiln_shape x, const ref_win *w, int64_t cout) {
  return KILN_SHAPE(x.d[0], ref_out_size(x.d[1], w->kh, w->sh, w->ph, w->dh),
                    ref_out_size(x.d[2], w->kw, w->sw, w->pw, w->dw), cout);
}

void ref_win_str(const ref_win *w, char *buf, size_t n) {
  snprintf(buf, n, "k%dx%d s%dx%d p%dx%d d%dx%d g%d", w->kh, w->kw, w->sh, w->sw, w->ph, w->pw,
           w->dh, w->dw, w->groups);
}

double *ref_to_double(const float *p, int64_t n) {
  double *d = ref_dalloc(n);
  for (int64_t i = 0; i < n; i++)
    d[i] = p[i];
  return d;
}

/* The input row (ih) or column (iw) that output position o, kernel tap t reads, or -1 outside
 * the image (in padding). */
static int64_t tap(int64_t o, int t, int stride, int pad, int dil, int64_t in) {
  int64_t i = o * stride - pad + (int64_t)t * dil;
  return i >= 0 && i < in ? i : -1;
}

/* ---------------------------------------------------------------- convolution */

/* One pass over every (output element, tap) pair of the convolution: forward (y) or backward
 * (dx, dw, db from gy). */
static void conv_pass(const double *x, kiln_shape xs, const double *w, int64_t cout,
                      const double *b, const ref_win *g, double *y, const double *gy, double *dx,
                      double *dw, double *db) {
  int64_t n = xs.d[0], h = xs.d[1], wd = xs.d[2], cin = xs.d[3];
  int64_t oh = ref_out_size(h, g->kh, g->sh, g->ph, g->dh);
  int64_t ow = ref_out_size(wd, g->kw, g->sw, g->pw, g->dw);
  int64_t cig = cin / g->groups, cog = cout / g->groups;
  if (dx) memset(dx, 0, (size_t)(n * h * wd * cin) * sizeof *dx);
  if (dw) memset(dw, 0, (size_t)(cout * cig * g->kh * g->kw) * sizeof *dw);
  if (db) memset(db, 0, (size_t)cout * sizeof *db);
  for (int64_t in = 0; in < n; in++)
    for (int64_t r = 0; r < oh; r++)
      for (int64_t c = 0; c < ow; c++)
        for (int64_t co = 0; co < cout; co++) {
          int64_t yi = ((in * oh + r) * ow + c) * cout + co;
          int64_t grp = co / cog;
          double s = b ? b[co] : 0.0;
          double gv = gy ? gy[yi] : 0.0;
          if (db) db[co] += gv;
          for (int64_t ci = 0; ci < cig; ci++)
            for (int i = 0; i < g->kh; i++) {
              int64_t ih = tap(r, i, g->sh, g->ph, g->dh, h);
              if (ih < 0) continue;
              for (int j = 0; j < g->kw; j++) {
                int64_t iw = tap(c, j, g->sw, g->pw, g->dw, wd);
                if (iw < 0) continue;
                int64_t xi = ((in * h + ih) * wd + iw) * cin + grp * cig + ci;
                int64_t wi = ((co * cig + ci) * g->kh + i) * g->kw + j;
                if (y) s += x[xi] * w[wi];
                if (dx) dx[xi] += gv * w[wi];
                if (dw) dw[wi] += gv * x[xi];
              }
            }
          if (y) y[yi] = s;
        }
}

void ref_conv2d(const double *x, kiln_shape xs, const double *w, int64_t cout, const double *b,
                const ref_win *g, double *y) {
  conv_pass(x, xs, w, cout, b, g, y, NULL, NULL, NULL, NULL);
}

void ref_conv2d_backward(const double *x, kiln_shape xs, const double *w, int64_t cout,
                         const ref_win *g, const double *gy, double *dx, double *dw, double *db) {
  conv_pass(x, xs, w, cout, NULL, g, NULL, gy, dx, dw, db);
}

/* ---------------------------------------------------------------- pooling */

/* The index into x of the first maximum of output element (n, r, c, ch)'s window, or -1 when
 * the window holds no element of the image. */
static int64_t max_arg(const double *x, kiln_shape xs, const ref_win *g, int64_t n, int64_t r,
                       int64_t c, int64_t ch) {
  int64_t h = xs.d[1], wd = xs.d[2], C = xs.d[3], arg = -1;
  double best = -INFINITY;
  for (int i = 0; i < g->kh; i++) {
    int64_t ih = tap(r, i, g->sh, g->ph, g->dh, h);
    if (ih < 0) continue;
    for (int j = 0; j < g->kw; j++) {
      int64_t iw = tap(c, j, g->sw, g->pw, g->dw, wd);
      if (iw < 0) continue;
      int64_t xi = ((n * h + ih) * wd + iw) * C + ch;
      if (arg < 0 || x[xi] > best) { /* strictly greater: the first maximum stays */
        best = x[xi];
        arg = xi;
      }
    }
  }
  return arg;
}

void ref_max_pool2d(const double *x, kiln_shape xs, const ref_win *g, double *y) {
  kiln_shape os = ref_win_out(xs, g, xs.d[3]);
  int64_t k = 0;
  for (int64_t n = 0; n < os.d[0]; n++)
    for (int64_t r = 0; r < os.d[1]; r++)
      for (int64_t c = 0; c < os.d[2]; c++)
        for (int64_t ch = 0; ch < os.d[3]; ch++, k++) {
          int64_t a = max_arg(x, xs, g, n, r, c, ch);
          y[k] = a < 0 ? -INFINITY : x[a];
        }
}

void ref_max_pool2d_backward(const double *x, kiln_shape xs, const ref_win *g, const double *gy,
                             double *dx) {
  kiln_shape os = ref_win_out(xs, g, xs.d[3]);
  memset(dx, 0, (size_t)ref_numel(xs) * sizeof *dx);
  int64_t k = 0;
  for (int64_t n = 0; n < os.d[0]; n++)
    for (int64_t r = 0; r < os.d[1]; r++)
      for (int64_t c = 0; c < os.d[2]; c++)
        for (int64_t ch = 0; ch < os.d[3]; ch++, k++) {
          int64_t a = max_arg(x, xs, g, n, r, c, ch);
          if (a >= 0) dx[a] += gy[k];
        }
}

/* What output element (r, c)'s window divides by: PyTorch's avg_pool2d, which clips the window
 * to the padded image for count_include_pad and to the image itself otherwise. */
static double avg_divisor(kiln_shape xs, const ref_win *g, int exclude_pad, int64_t r, int64_t c) {
  int64_t h = xs.d[1], wd = xs.d[2];
  int64_t hs = r * g->sh - g->ph, ws = c * g->sw - g->pw;
  int64_t he = hs + g->kh < h + g->ph ? hs + g->kh : h + g->ph;
  int64_t we = ws + g->kw < wd + g->pw ? ws + g->kw : wd + g->pw;
  if (!exclude_pad) return (double)((he - hs) * (we - ws));
  int64_t hs0 = hs < 0 ? 0 : hs, ws0 = ws < 0 ? 0 : ws;
  int64_t he0 = he > h ? h : he, we0 = we > wd ? wd : we;
  return (double)((he0 - hs0) * (we0 - ws0));
}

/* Average pooling forward (y) or backward (dx from gy). */
static void avg_pass(const double *x, kiln_shape xs, const ref_win *g, int exclude_pad, double *y,
                     const double *gy, double *dx) {
  kiln_shape os = ref_win_out(xs, g, xs.d[3]);
  int64_t h = xs.d[1], wd = xs.d[2], C = xs.d[3], k = 0;
  if (dx) memset(dx, 0, (size_t)ref_numel(xs) * sizeof *dx);
  for (int64_t n = 0; n < os.d[0]; n++)
    for (int64_t r = 0; r < os.d[1]; r++)
      for (int64_t c = 0; c < os.d[2]; c++)
        for (int64_t ch = 0; ch < C; ch++, k++) {
          double div = avg_divisor(xs, g, exclude_pad, r, c), s = 0;
          for (int i = 0; i < g->kh; i++) {
            int64_t ih = tap(r, i, g->sh, g->ph, 1, h);
            if (ih < 0) continue;
            for (int j = 0; j < g->kw; j++) {
              int64_t iw = tap(c, j, g->sw, g->pw, 1, wd);
              if (iw < 0) continue;
              int64_t xi = ((n * h + ih) * wd + iw) * C + ch;
              if (y) s += x[xi];
              if (dx) dx[xi] += gy[k] / div;
            }
          }
          if (y) y[k] = s / div;
        }
}

void ref_avg_pool2d(const double *x, kiln_shape xs, const ref_win *g, int exclude_pad, double *y) {
  avg_pass(x, xs, g, exclude_pad, y, NULL, NULL);
}

void ref_avg_pool2d_backward(kiln_shape xs, const ref_win *g, int exclude_pad, const double *gy,
                             double *dx) {
  avg_pass(NULL, xs, g, exclude_pad, NULL, gy, dx);
}

void ref_global_pool(const double *x, kiln_shape xs, int max, double *y) {
  int64_t n = xs.d[0], hw = xs.d[1] * xs.d[2], C = xs.d[3];
  for (int64_t in = 0; in < n; in++)
    for (int64_t ch = 0; ch < C; ch++) {
      double s = max ? -INFINITY : 0.0;
      for (int64_t p = 0; p < hw; p++) {
        double v = x[(in * hw + p) * C + ch];
        if (max)
          s = v > s ? v : s;
        else
          s += v;
      }
      y[in * C + ch] = max ? s : s / (double)hw;
    }
}

void ref_global_pool_backward(const double *x, kiln_shape xs, int max, const double *gy,
                              double *dx) {
  int64_t n = xs.d[0], hw = xs.d[1] * xs.d[2], C = xs.d[3];
  memset(dx, 0, (size_t)ref_numel(xs) * sizeof *dx);
  for (int64_t in = 0; in < n; in++)
    for (int64_t ch = 0; ch < C; ch++) {
      double g = gy[in * C + ch];
      if (!max) {
        for (int64_t p = 0; p < hw; p++)
          dx[(in * hw + p) * C + ch] = g / (double)hw;
        continue;
      }
      int64_t arg = -1;
      for (int64_t p = 0; p < hw; p++) {
        int64_t i = (in * hw + p) * C + ch;
        if (arg < 0 || x[i] > x[arg]) arg = i;
      }
      dx[arg] += g;
    }
}

/* ---------------------------------------------------------------- normalisation */

/* The mean and biased variance of column ch of x (M, C). */
static void column_stats(const double *x, int64_t m, int64_t c, int64_t ch, double *mean,
                         double *var) {
  double s = 0, q = 0;
  for (int64_t i = 0; i < m; i++)
    s += x[i * c + ch];
  *mean = s / (double)m;
  for (int64_t i = 0; i < m; i++) {
    double d = x[i * c + ch] - *mean;
    q += d * d;
  }
  *var = q / (double)m;
}

void ref_batch_norm(const double *x, int64_t m, int64_t c, const double *w, const double *b,
                    double *rmean, double *rvar, int training, double momentum, double eps,
                    double *y) {
  for (int64_t ch = 0; ch < c; ch++) {
    double mean, var;
    column_stats(x, m, c, ch, &mean, &var);
    double mu = mean, v = var;
    if (!training && rmean) {
      mu = rmean[ch];
      v = rvar[ch];
    }
    double rstd = 1.0 / sqrt(v + eps);
    for (int64_t i = 0; i < m; i++)
      y[i * c + ch] = (x[i * c + ch] - mu) * rstd * (w ? w[ch] : 1.0) + (b ? b[ch] : 0.0);
    if (training && rmean) {
      rmean[ch] = (1 - momentum) * rmean[ch] + momentum * mean;
      rvar[ch] = (1 - momentum) * rvar[ch] + momentum * var * (double)m / (double)(m - 1);
    }
  }
}

/* The gradients of normalising columns (stride c) of n elements each by their own statistics:
 * dx = rstd / n (n dxh - sum(dxh) - xh sum(dxh xh)), dxh = gy w. */
static void norm_backward_batch(const double *x, int64_t n, int64_t stride, double wv, double eps,
                                const double *gy, double *dx, double *dw, double *db) {
  double mean = 0, var = 0;
  for (int64_t i = 0; i < n; i++)
    mean += x[i * stride];
  mean /= (double)n;
  for (int64_t i = 0; i < n; i++)
    var += (x[i * stride] - mean) * (x[i * stride] - mean);
  var /= (double)n;
  double rstd = 1.0 / sqrt(var + eps), sd = 0, sdx = 0, sw = 0, sb = 0;
  for (int64_t i = 0; i < n; i++) {
    double xh = (x[i * stride] - mean) * rstd, g = gy[i * stride];
    sd += g * wv;
    sdx += g * wv * xh;
    sw += g * xh;
    sb += g;
  }
  for (int64_t i = 0; i < n; i++) {
    double xh = (x[i * stride] - mean) * rstd;
    if (dx) dx[i * stride] = rstd / (double)n * ((double)n * gy[i * stride] * wv - sd - xh * sdx);
  }
  if (dw) *dw += sw;
  if (db) *db += sb;
}

void ref_batch_norm_backward(const double *x, int64_t m, int64_t c, const double *w,
                             const double *rmean, const double *rvar, int training, double eps,
                             const double *gy, double *dx, double *dw, double *db) {
  for (int64_t ch = 0; ch < c; ch++) {
    double wv = w ? w[ch] : 1.0;
    if (dw) dw[ch] = 0;
    if (db) db[ch] = 0;
    if (training || !rmean) {
      norm_backward_batch(x + ch, m, c, wv, eps, gy + ch, dx ? dx + ch : NULL, dw ? dw + ch : NULL,
                          db ? db + ch : NULL);
      continue;
    }
    double rstd = 1.0 / sqrt(rvar[ch] + eps);
    for (int64_t i = 0; i < m; i++) {
      double g = gy[i * c + ch];
      if (dx) dx[i * c + ch] = g * wv * rstd;
      if (dw) dw[ch] += g * (x[i * c + ch] - rmean[ch]) * rstd;
      if (db) db[ch] += g;
    }
  }
}

void ref_layer_norm(const double *x, int64_t m, int64_t c, const double *w, const double *b,
                    double eps, double *y) {
  for (int64_t i = 0; i < m; i++) {
    const double *r = x + i * c;
    double mean = 0, var = 0;
    for (int64_t k = 0; k < c; k++)
      mean += r[k];
    mean /= (double)c;
    for (int64_t k = 0; k < c; k++)
      var += (r[k] - mean) * (r[k] - mean);
    var /= (double)c;
    double rstd = 1.0 / sqrt(var + eps);
    for (int64_t k = 0; k < c; k++)
      y[i * c + k] = (r[k] - mean) * rstd * (w ? w[k] : 1.0) + (b ? b[k] : 0.0);
  }
}

void ref_layer_norm_backward(const double *x, int64_t m, int64_t c, const double *w, double eps,
                             const double *gy, double *dx, double *dw, double *db) {
  if (dw) memset(dw, 0, (size_t)c * sizeof *dw);
  if (db) memset(db, 0, (size_t)c * sizeof *db);
  for (int64_t i = 0; i < m; i++) {
    const double *r = x + i * c, *g = gy + i * c;
    double mean = 0, var = 0;
    for (int64_t k = 0; k < c; k++)
      mean += r[k];
    mean /= (double)c;
    for (int64_t k = 0; k < c; k++)
      var += (r[k] - mean) * (r[k] - mean);
    var /= (double)c;
    double rstd = 1.0 / sqrt(var + eps), sd = 0, sdx = 0;
    for (int64_t k = 0; k < c; k++) {
      double xh = (r[k] - mean) * rstd, d = g[k] * (w ? w[k] : 1.0);
      sd += d;
      sdx += d * xh;
      if (dw) dw[k] += g[k] * xh;
      if (db) db[k] += g[k];
    }
    for (int64_t k = 0; k < c; k++) {
      double xh = (r[k] - mean) * rstd, d = g[k] * (w ? w[k] : 1.0);
      if (dx) dx[i * c + k] = rstd / (double)c * ((double)c * d - sd - xh * sdx);
    }
  }
}

/* ---------------------------------------------------------------- flatten */

void ref_flatten_nhwc(const double *x, kiln_shape xs, double *y) {
  int64_t n = xs.d[0], h = xs.d[1], wd = xs.d[2], C = xs.d[3];
  for (int64_t in = 0; in < n; in++)
    for (int64_t r = 0; r < h; r++)
      for (int64_t c = 0; c < wd; c++)
        for (int64_t ch = 0; ch < C; ch++)
          y[in * C * h * wd + (ch * h + r) * wd + c] = x[((in * h + r) * wd + c) * C + ch];
}

/* ---------------------------------------------------------------- gradients */

void ref_expect_grad(kiln_ctx *ctx, kiln_tensor *t, kiln_shape s, const double *want, double atol,
                     double rtol, const char *what, const char *which) {
  char w[1200];
  snprintf(w, sizeof w, "%s: gradient of %s", what, which);
  ref_expect_close(ctx, kiln_tensor_grad(t), s, want, atol, rtol, w);
}

double *ref_backward_weighted(kiln_ctx *ctx, kiln_tensor *y, uint64_t seed, const char *what) {
  kiln_shape s = kiln_tensor_shape(y);
  float *gh;
  kiln_tensor *g = ref_rand_tensor(ctx, s, seed, &REF_GEN(-1, 1), 0, &gh);
  kiln_status st = kiln_backward(kiln_sum(kiln_mul(y, g), KILN_ALL_AXES, 0));
  cr_assert_eq(st, KILN_OK, "%s: kiln_backward: %s", what, th_err(ctx));
  cr_assert_eq(kiln_sync(ctx), KILN_OK, "%s: running the backward pass: %s", what, th_err(ctx));
  double *gd = ref_to_double(gh, ref_numel(s));
  free(gh);
  kiln_tensor_free(g);
  return gd;
}
