/*
 * test_cpu_whitening.c: the whitening initialiser's host maths (nn/init.c) without a GPU: the
 * Jacobi eigensolver on matrices Q diag(l) Q^T of known spectrum (eigenvalues, eigenvectors up to
 * sign, orthonormality, reconstruction), repeated eigenvalues, diagonal, zero and bad matrices;
 * the patch covariance of small synthetic images against a direct float64 loop, in the weight's
 * (c, dh, dw) order; that the filters whiten (w_i^T S w_j = delta_ij l_i / (l_i + eps)), on
 * synthetic images and on the CIFAR-10 sample ($KILN_CIFAR10_SAMPLE); and kiln_init_whitening's
 * errors, each naming the function and the values and changing nothing.
 */
#include <math.h>
#include <string.h>

#include "inspect.h"
#include "nn/init.h"

/* ---------------------------------------------------------------- matrices */

/* A random orthogonal n x n matrix (row-major, columns orthonormal): modified Gram-Schmidt,
 * twice, on uniform columns. */
static void random_orthogonal(int n, uint64_t seed, double *q) {
  th_rng r = {seed};
  for (int k = 0; k < n * n; k++)
    q[k] = 2.0 * th_rng_unit(&r) - 1.0;
  for (int j = 0; j < n; j++)
    for (int pass = 0; pass < 2; pass++) {
      for (int i = 0; i < j; i++) {
        double d = 0;
        for (int k = 0; k < n; k++)
          d += q[k * n + i] * q[k * n + j];
        for (int k = 0; k < n; k++)
          q[k * n + j] -= d * q[k * n + i];
      }
      double norm = 0;
      for (int k = 0; k < n; k++)
        norm += q[k * n + j] * q[k * n + j];
      norm = sqrt(norm);
      cr_assert_gt(norm, 1e-6, "a degenerate random matrix");
      for (int k = 0; k < n; k++)
        q[k * n + j] /= norm;
    }
}

/* a = q diag(l) q^T (n x n, row-major). */
static void compose(int n, const double *q, const double *l, double *a) {
  for (int i = 0; i < n; i++)
    for (int j = 0; j < n; j++) {
      double s = 0;
      for (int k = 0; k < n; k++)
        s += q[i * n + k] * l[k] * q[j * n + k];
      a[i * n + j] = s;
    }
}

static double max_abs(const double *p, int n) {
  double m = 0;
  for (int i = 0; i < n; i++)
    m = fmax(m, fabs(p[i]));
  return m;
}

/* Asserts the rows of v (n x n) are orthonormal, each with its largest component positive, and
 * that sum_i w_i v_i v_i^T reconstructs a, all within tol (relative to a's largest value). */
static void assert_decomposition(int n, const double *a, const double *w, const double *v,
                                 double tol, const char *what) {
  double scale = fmax(max_abs(a, n * n), 1e-300);
  for (int i = 0; i < n; i++) {
    if (i > 0)
      cr_assert_geq(w[i - 1], w[i], "%s: eigenvalues %d, %d not descending: %.17g, %.17g", what,
                    i - 1, i, w[i - 1], w[i]);
    for (int j = 0; j < n; j++) {
      double d = 0;
      for (int k = 0; k < n; k++)
        d += v[i * n + k] * v[j * n + k];
      cr_assert_lt(fabs(d - (i == j)), 1e-13, "%s: v_%d . v_%d = %.17g", what, i, j, d);
    }
    int big = 0;
    for (int k = 1; k < n; k++)
      if (fabs(v[i * n + k]) > fabs(v[i * n + big])) big = k;
    cr_assert_gt(v[i * n + big], 0.0, "%s: v_%d's largest component is negative", what, i);
  }
  for (int r = 0; r < n; r++)
    for (int c = 0; c < n; c++) {
      double s = 0;
      for (int i = 0; i < n; i++)
        s += w[i] * v[i * n + r] * v[i * n + c];
      cr_assert_lt(fabs(s - a[r * n + c]), tol * scale,
                   "%s: reconstruction [%d][%d] = %.17g, a has %.17g", what, r, c, s, a[r * n + c]);
    }
}

/* ---------------------------------------------------------------- the eigensolver */

Test(jacobi, known_distinct_spectra) {
  int sizes[] = {1, 2, 3, 5, 12, 24, 48};
  for (size_t s = 0; s < sizeof sizes / sizeof *sizes; s++) {
    int n = sizes[s];
    double *q = malloc(sizeof(double) * n * n), *a = malloc(sizeof(double) * n * n);
    double *v = malloc(sizeof(double) * n * n), *l = malloc(sizeof(double) * n);
    double *w = malloc(sizeof(double) * n);
    cr_assert(q && a && v && l && w);
    random_orthogonal(n, 100 + (uint64_t)n, q);
    /* distinct eigenvalues over several orders of magnitude, some negative, in no order */
    for (int i = 0; i < n; i++)
      l[i] = (i % 3 == 0 ? -1.0 : 1.0) * pow(10.0, 2.0 - 5.0 * i / n) * (1.0 + 0.01 * i);
    compose(n, q, l, a);
    int sweeps = kiln__eigh_jacobi(n, a, w, v);
    cr_assert_geq(sweeps, 0, "n %d: %d", n, sweeps);
    cr_assert_leq(sweeps, 20, "n %d: %d sweeps", n, sweeps);
    char what[32];
    snprintf(what, sizeof what, "n %d", n);
    assert_decomposition(n, a, w, v, 1e-13, what);
    /* each eigenvalue and, up to sign, its eigenvector: the column of q with that eigenvalue */
    for (int i = 0; i < n; i++) {
      int match = -1;
      for (int k = 0; k < n; k++)
        if (fabs(l[k] - w[i]) <= 1e-12 * max_abs(l, n)) match = k;
      cr_assert_geq(match, 0, "n %d: eigenvalue %.17g is none of the spectrum's", n, w[i]);
      int below = 0; /* the known eigenvalues larger than l[match]: its rank */
      for (int k = 0; k < n; k++)
        below += l[k] > l[match];
      cr_assert_eq(below, i, "n %d: eigenvalue %d is the spectrum's %d-th", n, i, below);
      double d = 0;
      for (int k = 0; k < n; k++)
        d += v[i * n + k] * q[k * n + match];
      cr_assert_lt(fabs(fabs(d) - 1.0), 1e-10, "n %d: |v_%d . q_%d| = %.17g", n, i, match, fabs(d));
    }
    free(q), free(a), free(v), free(l), free(w);
  }
}

Test(jacobi, repeated_eigenvalues_span_their_eigenspaces) {
  enum { N = 9 };
  const double l[N] = {3, 1, 3, 0, -2, 1, 3, 0, 1}; /* 3 three times, 1 three times, 0 twice */
  const double want[N] = {3, 3, 3, 1, 1, 1, 0, 0, -2};
  double q[N * N], a[N * N], w[N], v[N * N];
  random_orthogonal(N, 7, q);
  compose(N, q, l, a);
  cr_assert_geq(kiln__eigh_jacobi(N, a, w, v), 0);
  for (int i = 0; i < N; i++)
    cr_assert_lt(fabs(w[i] - want[i]), 1e-13, "eigenvalue %d: %.17g, want %g", i, w[i], want[i]);
  assert_decomposition(N, a, w, v, 1e-13, "repeated");
  /* v_i lies in the eigenspace of w_i: its projection onto the q columns of that eigenvalue has
   * norm 1, and a v_i = w_i v_i */
  for (int i = 0; i < N; i++) {
    double in = 0;
    for (int k = 0; k < N; k++) {
      if (l[k] != want[i]) continue;
      double d = 0;
      for (int r = 0; r < N; r++)
        d += v[i * N + r] * q[r * N + k];
      in += d * d;
    }
    cr_assert_lt(fabs(in - 1.0), 1e-12, "v_%d: %.17g of its norm in its eigenspace", i, in);
    for (int r = 0; r < N; r++) {
      double av = 0;
      for (int k = 0; k < N; k++)
        av += a[r * N + k] * v[i * N + k];
      cr_assert_lt(fabs(av - w[i] * v[i * N + r]), 1e-13, "(a v_%d)[%d]", i, r);
    }
  }
}

Test(jacobi, diagonal_zero_and_bad_matrices) {
  /* a diagonal matrix needs no rotation: its diagonal sorted, unit vectors */
  double d[9] = {2, 0, 0, 0, -1, 0, 0, 0, 5}, w[3], v[9];
  cr_assert_eq(kiln__eigh_jacobi(3, d, w, v), 0);
  const double dw[3] = {5, 2, -1}, dv[9] = {0, 0, 1, 1, 0, 0, 0, 1, 0};
  for (int i = 0; i < 3; i++)
    cr_assert_eq(w[i], dw[i], "eigenvalue %d: %g", i, w[i]);
  for (int k = 0; k < 9; k++)
    cr_assert_eq(v[k], dv[k], "v[%d] = %g", k, v[k]);
  /* zero: zeros, and the identity in order (ties keep the diagonal's order) */
  double z[4] = {0}, zw[2], zv[4];
  cr_assert_eq(kiln__eigh_jacobi(2, z, zw, zv), 0);
  cr_assert(zw[0] == 0 && zw[1] == 0 && zv[0] == 1 && zv[1] == 0 && zv[2] == 0 && zv[3] == 1);
  /* 1 x 1; a negative entry gives a vector of +1 */
  double one = -4, ow, ov;
  cr_assert_eq(kiln__eigh_jacobi(1, &one, &ow, &ov), 0);
  cr_assert(ow == -4 && ov == 1);
  /* only the upper triangle is read (torch's UPLO="U"): the lower one may hold anything */
  double up[4] = {2, 1, NAN, 2}, uw[2], uv[4];
  cr_assert_geq(kiln__eigh_jacobi(2, up, uw, uv), 1);
  cr_assert_lt(fabs(uw[0] - 3) + fabs(uw[1] - 1), 1e-15, "%.17g %.17g", uw[0], uw[1]);
  cr_assert_lt(fabs(uv[0] - M_SQRT1_2) + fabs(uv[1] - M_SQRT1_2), 1e-15);
  /* bad input: nothing written */
  double bad[4] = {1, INFINITY, 0, 1}, bw[2] = {7, 7}, bv[4] = {7, 7, 7, 7};
  cr_assert_eq(kiln__eigh_jacobi(2, bad, bw, bv), KILN__EIGH_BAD);
  bad[1] = NAN;
  cr_assert_eq(kiln__eigh_jacobi(2, bad, bw, bv), KILN__EIGH_BAD);
  cr_assert_eq(kiln__eigh_jacobi(0, bad, bw, bv), KILN__EIGH_BAD);
  cr_assert_eq(kiln__eigh_jacobi(2, NULL, bw, bv), KILN__EIGH_BAD);
  double huge[4] = {1e200, 1, 1, 1}; /* finite, but its norm overflows */
  cr_assert_eq(kiln__eigh_jacobi(2, huge, bw, bv), KILN__EIGH_BAD);
  cr_assert(bw[0] == 7 && bw[1] == 7 && bv[0] == 7 && bv[3] == 7, "a failed call wrote");
  /* values far apart in scale: the tiny eigenvalue keeps its relative accuracy */
  double s[4] = {1e8, 1e-4, 1e-4, 1e-8 + 1e-16}, sw[2], sv[4];
  cr_assert_geq(kiln__eigh_jacobi(2, s, sw, sv), 0);
  double det = 1e8 * (1e-8 + 1e-16) - 1e-8; /* the product of the eigenvalues */
  cr_assert_lt(fabs(sw[0] * sw[1] - det) / det, 1e-6, "%.17g x %.17g, det %.17g", sw[0], sw[1],
               det);
}

/* ---------------------------------------------------------------- patch covariance */

/* Value (b, y, x, c) of images as the reference reads them, in float64. */
static double ref_value(kiln_host_type type, const void *images, const int64_t sh[4], int64_t b,
                        int64_t y, int64_t x, int64_t c, const kiln_normalize *norm) {
  int64_t at = ((b * sh[1] + y) * sh[2] + x) * sh[3] + c;
  double v =
      type == KILN_HOST_U8 ? ((const uint8_t *)images)[at] / 255.0 : ((const float *)images)[at];
  if (norm && norm->channels > 0) {
    int k = norm->channels == 1 ? 0 : (int)c;
    v = (v - norm->mean[k]) / norm->std[k];
  }
  return v;
}

/* The patch covariance by its definition: for each pair of patch elements (c, dh, dw), the mean
 * over images and positions of their product. */
static void ref_covariance(kiln_host_type type, const void *images, const int64_t sh[4],
                           const kiln_normalize *norm, int kh, int kw, double *cov) {
  int64_t K = sh[3] * kh * kw, oh = sh[1] - kh + 1, ow = sh[2] - kw + 1;
  for (int64_t i = 0; i < K; i++)
    for (int64_t j = 0; j < K; j++) {
      int64_t ci = i / (kh * kw), hi = i / kw % kh, wi = i % kw;
      int64_t cj = j / (kh * kw), hj = j / kw % kh, wj = j % kw;
      double s = 0;
      for (int64_t b = 0; b < sh[0]; b++)
        for (int64_t y = 0; y < oh; y++)
          for (int64_t x = 0; x < ow; x++)
            s += ref_value(type, images, sh, b, y + hi, x + wi, ci, norm) *
                 ref_value(type, images, sh, b, y + hj, x + wj, cj, norm);
      cov[i * K + j] = s / (double)(sh[0] * oh * ow);
    }
}

/* Images (n, H, W, C) of bytes, smooth in space and correlated across channels, as photographs
 * are: a random walk along each row, each channel a mix of it and noise. */
static uint8_t *synth_images(const int64_t sh[4], uint64_t seed) {
  int64_t total = sh[0] * sh[1] * sh[2] * sh[3];
  uint8_t *p = malloc((size_t)total);
  cr_assert_not_null(p);
  th_rng r = {seed};
  for (int64_t b = 0; b < sh[0]; b++)
    for (int64_t y = 0; y < sh[1]; y++) {
      double walk = 60 + 120 * th_rng_unit(&r);
      for (int64_t x = 0; x < sh[2]; x++) {
        walk += 24 * (th_rng_unit(&r) - 0.5);
        walk = fmin(fmax(walk, 0), 255);
        for (int64_t c = 0; c < sh[3]; c++) {
          double v = walk * (0.7 + 0.1 * (double)c) + 40 * th_rng_unit(&r);
          p[((b * sh[1] + y) * sh[2] + x) * sh[3] + c] = (uint8_t)fmin(v, 255);
        }
      }
    }
  return p;
}

Test(whitening, patch_covariance_is_the_mean_of_patch_outer_products) {
  const int64_t sh[4] = {3, 5, 6, 2};
  uint8_t *u8 = synth_images(sh, 3);
  const float mean[2] = {0.4f, 0.45f}, std[2] = {0.25f, 0.2f}, one_mean = 0.5f, one_std = 0.3f;
  kiln_normalize per = {.channels = 2, .mean = mean, .std = std};
  kiln_normalize all = {.channels = 1, .mean = &one_mean, .std = &one_std};
  struct {
    int kh, kw;
    const kiln_normalize *norm;
  } cases[] = {{2, 3, &per}, {1, 1, NULL}, {3, 2, &all}, {5, 6, &per}, {2, 2, NULL}};
  for (size_t k = 0; k < sizeof cases / sizeof *cases; k++) {
    int kh = cases[k].kh, kw = cases[k].kw;
    int64_t K = sh[3] * kh * kw;
    double *got = malloc(sizeof(double) * K * K), *want = malloc(sizeof(double) * K * K);
    cr_assert(got && want);
    cr_assert(kiln__patch_covariance(KILN_HOST_U8, sh, u8, cases[k].norm, kh, kw, got));
    ref_covariance(KILN_HOST_U8, u8, sh, cases[k].norm, kh, kw, want);
    /* the implementation normalises in float, as the data set does: float rounding */
    for (int64_t i = 0; i < K * K; i++)
      cr_assert_lt(fabs(got[i] - want[i]), 1e-6 * (1 + fabs(want[i])),
                   "case %zu (%dx%d): [%lld][%lld] = %.17g, want %.17g", k, kh, kw,
                   (long long)(i / K), (long long)(i % K), got[i], want[i]);
    free(got), free(want);
  }
  /* float images without normalisation: the same float64 products, summed in another order */
  int64_t total = sh[0] * sh[1] * sh[2] * sh[3];
  float *f = malloc(sizeof(float) * total);
  cr_assert_not_null(f);
  th_fill(f, total, 9, -2.f, 3.f);
  double got[2 * 2 * 2 * 2 * 2 * 2 * 4], want[2 * 2 * 2 * 2 * 2 * 2 * 4]; /* K = 8 */
  cr_assert(kiln__patch_covariance(KILN_HOST_F32, sh, f, NULL, 2, 2, got));
  ref_covariance(KILN_HOST_F32, f, sh, NULL, 2, 2, want);
  for (int i = 0; i < 64; i++)
    cr_assert_lt(fabs(got[i] - want[i]), 1e-13 * (1 + fabs(want[i])), "[%d]: %.17g, want %.17g", i,
                 got[i], want[i]);
  free(f);
  free(u8);
}

/* ---------------------------------------------------------------- the filters */

/* Asserts that filters (cout, C, kh, kw) whiten the images' patches: with S their covariance (by
 * the direct loop), w_i^T S w_j = delta_ij l_i / (l_i + eps) for i, j < cout / 2, the second
 * half the first's negatives, and l the eigenvalues of S, descending. */
static void assert_whitens(kiln_host_type type, const void *images, const int64_t sh[4],
                           const kiln_normalize *norm, int kh, int kw, int64_t cout, float eps,
                           const float *filters, const double *l, double tol) {
  int64_t K = sh[3] * kh * kw, half = cout / 2;
  double *s = malloc(sizeof(double) * K * K);
  cr_assert_not_null(s);
  ref_covariance(type, images, sh, norm, kh, kw, s);
  double e = eps == 0.f ? 5e-4 : eps;
  for (int64_t i = 0; i < K; i++) {
    if (i > 0) cr_assert_geq(l[i - 1], l[i], "eigenvalues not descending at %lld", (long long)i);
    cr_assert_gt(l[i], -1e-12, "a covariance's eigenvalue %lld is %g", (long long)i, l[i]);
  }
  for (int64_t o = 0; o < half; o++)
    for (int64_t k = 0; k < K; k++)
      cr_assert_eq(filters[(half + o) * K + k], -filters[o * K + k], "filter %lld is not -%lld",
                   (long long)(half + o), (long long)o);
  for (int64_t i = 0; i < half; i++)
    for (int64_t j = 0; j < half; j++) {
      double q = 0;
      for (int64_t a = 0; a < K; a++)
        for (int64_t b = 0; b < K; b++)
          q += (double)filters[i * K + a] * s[a * K + b] * filters[j * K + b];
      double want = i == j ? l[i] / (l[i] + e) : 0.0;
      cr_assert_lt(fabs(q - want), tol, "w_%lld^T S w_%lld = %.9g, want %.9g", (long long)i,
                   (long long)j, q, want);
    }
  free(s);
}

Test(whitening, filters_whiten_synthetic_images) {
  kiln_ctx *ctx = th_cpu_ctx();
  const int64_t sh[4] = {40, 12, 10, 3};
  uint8_t *u8 = synth_images(sh, 11);
  const float mean[3] = {0.4914f, 0.4822f, 0.4465f}, std[3] = {0.2470f, 0.2435f, 0.2616f};
  kiln_normalize norm = {.channels = 3, .mean = mean, .std = std};
  kiln_shape shape = KILN_SHAPE(sh[0], sh[1], sh[2], sh[3]);
  float full[24 * 12], part[8 * 12];
  double l[12], l2[12];
  /* airbench's layer: all 12 eigenvectors and their negatives, eps 5e-4 (0 asks for it) */
  cr_assert_eq(
      kiln__whitening_filters(ctx, "t", KILN_HOST_U8, shape, u8, &norm, 24, 2, 2, 0.f, full, l),
      KILN_OK, "%s", th_err(ctx));
  assert_whitens(KILN_HOST_U8, u8, sh, &norm, 2, 2, 24, 0.f, full, l, 2e-5);
  /* the smallest eigenvalue is far below the largest (neighbouring pixels are alike) */
  cr_assert_gt(l[0] / l[11], 20.0, "eigenvalues %g .. %g", l[0], l[11]);
  /* fewer filters: the first of the full set, those of largest eigenvalue */
  cr_assert_eq(
      kiln__whitening_filters(ctx, "t", KILN_HOST_U8, shape, u8, &norm, 8, 2, 2, 5e-4f, part, l2),
      KILN_OK, "%s", th_err(ctx));
  cr_assert_eq(memcmp(part, full, 4 * 12 * sizeof(float)), 0);
  cr_assert_eq(memcmp(part + 4 * 12, full + 12 * 12, 4 * 12 * sizeof(float)), 0);
  cr_assert_eq(memcmp(l, l2, sizeof l), 0);
  /* another eps and patch shape: 3x3, 27 eigenvectors, half of them kept */
  float *f3 = malloc(sizeof(float) * 26 * 27);
  double l3[27];
  cr_assert_not_null(f3);
  cr_assert_eq(
      kiln__whitening_filters(ctx, "t", KILN_HOST_U8, shape, u8, &norm, 26, 3, 3, 1e-2f, f3, l3),
      KILN_OK, "%s", th_err(ctx));
  assert_whitens(KILN_HOST_U8, u8, sh, &norm, 3, 3, 26, 1e-2f, f3, l3, 2e-5);
  free(f3);
  th_assert_ok(ctx);
  free(u8);
  th_ctx_free(ctx);
}

Test(whitening, filters_whiten_the_cifar10_sample) {
  const char *dir = getenv("KILN_CIFAR10_SAMPLE");
  if (!dir || !*dir)
    cr_skip_test("KILN_CIFAR10_SAMPLE is not set (it names the directory of the CIFAR-10 "
                 "sample, e.g. /work/shared/data/cifar10-sample)");
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_cifar10 c;
  cr_assert_eq(kiln_cifar10_read(ctx, dir, "data_batch_1", &c), KILN_OK, "%s", th_err(ctx));
  /* airbench's normalisation and layer, on the first 200 images (the reference loop is slow) */
  const int64_t sh[4] = {200, 32, 32, 3};
  const float mean[3] = {0.4914f, 0.4822f, 0.4465f}, std[3] = {0.2470f, 0.2435f, 0.2616f};
  kiln_normalize norm = {.channels = 3, .mean = mean, .std = std};
  float f[24 * 12];
  double l[12];
  cr_assert_eq(kiln__whitening_filters(ctx, "t", KILN_HOST_U8, KILN_SHAPE(200, 32, 32, 3), c.images,
                                       &norm, 24, 2, 2, 5e-4f, f, l),
               KILN_OK, "%s", th_err(ctx));
  assert_whitens(KILN_HOST_U8, c.images, sh, &norm, 2, 2, 24, 5e-4f, f, l, 2e-5);
  /* natural images: the first eigenvector is the patch's mean brightness (all components of one
   * sign, here positive), and its eigenvalue holds most of the variance */
  double total = 0;
  for (int i = 0; i < 12; i++)
    total += l[i];
  cr_assert_gt(l[0] / total, 0.8, "l_0 %g of %g", l[0], total);
  for (int k = 0; k < 12; k++)
    cr_assert_gt(f[k], 0.f, "filter 0, element %d: %g", k, f[k]);
  kiln_cifar10_free(&c);
  th_ctx_free(ctx);
}

/* ---------------------------------------------------------------- kiln_init_whitening */

/* Asserts that call failed with status and a message holding what, and left the RNG alone. */
#define EXPECT_FAIL(ctx, call, status, ...)                                                        \
  do {                                                                                             \
    uint64_t rng_ = (ctx)->host_rng;                                                               \
    cr_assert_eq((call), (status), "%s: %s", #call, th_err(ctx));                                  \
    TH_ASSERT_ERROR(ctx, status, __VA_ARGS__);                                                     \
    cr_assert_eq((ctx)->host_rng, rng_, "%s drew from the RNG", #call);                            \
    kiln_ctx_clear_error(ctx);                                                                     \
  } while (0)

Test(whitening, init_checks_its_arguments_and_changes_nothing) {
  kiln_ctx *ctx = th_cpu_ctx();
  const int64_t sh[4] = {4, 6, 6, 3};
  uint8_t *u8 = synth_images(sh, 5);
  float fl[4 * 6 * 6 * 3];
  th_fill(fl, 4 * 6 * 6 * 3, 2, -1.f, 1.f);
  kiln_shape shape = KILN_SHAPE(4, 6, 6, 3);
  const float mean[3] = {0.5f, 0.5f, 0.5f}, std[3] = {0.25f, 0.25f, 0.25f}, zero[3] = {0};
  kiln_normalize norm = {.channels = 3, .mean = mean, .std = std};
  kiln_tensor *w = th_f32(ctx, KILN_SHAPE(24, 3, 2, 2));
  kiln_tensor *w8 = th_f32(ctx, KILN_SHAPE(8, 3, 2, 2));
  kiln_tensor *i32 = th_i32(ctx, KILN_SHAPE(24, 3, 2, 2));
  kiln_tensor *w2d = th_f32(ctx, KILN_SHAPE(24, 12));
  kiln_tensor *odd = th_f32(ctx, KILN_SHAPE(7, 3, 2, 2));
  kiln_tensor *many = th_f32(ctx, KILN_SHAPE(26, 3, 2, 2));
  kiln_tensor *w4 = th_f32(ctx, KILN_SHAPE(24, 4, 2, 2));
  kiln_tensor *big = th_f32(ctx, KILN_SHAPE(2, 3, 19, 19)); /* 1083 values a patch */
  kiln_tensor *inter = kiln_full(ctx, KILN_SHAPE(24, 3, 2, 2), 0.f);
  kiln_tensor *view = kiln_permute(w, KILN_AXES(1, 0, 2, 3));
  cr_assert(inter && view);
  const kiln_host_type U8 = KILN_HOST_U8;

  /* good calls: accepted without a GPU (the upload is dropped), drawing nothing */
  uint64_t rng = ctx->host_rng;
  cr_assert_eq(kiln_init_whitening(w, U8, shape, u8, &norm, 0.f), KILN_OK, "%s", th_err(ctx));
  cr_assert_eq(kiln_init_whitening(w8, U8, shape, u8, NULL, 1e-3f), KILN_OK, "%s", th_err(ctx));
  cr_assert_eq(kiln_init_whitening(w, KILN_HOST_F32, shape, fl, NULL, 5e-4f), KILN_OK, "%s",
               th_err(ctx));
  cr_assert_eq(ctx->host_rng, rng);

  cr_assert_eq(kiln_init_whitening(NULL, U8, shape, u8, &norm, 0.f), KILN_ERR_INVALID);
  cr_assert_null(kiln_ctx_error(ctx), "a NULL weight names no context");
  EXPECT_FAIL(ctx, kiln_init_whitening(i32, U8, shape, u8, &norm, 0.f), KILN_ERR_DTYPE,
              "kiln_init_whitening", "i32");
  EXPECT_FAIL(ctx, kiln_init_whitening(inter, U8, shape, u8, &norm, 0.f), KILN_ERR_INVALID,
              "kiln_init_whitening", "an intermediate");
  EXPECT_FAIL(ctx, kiln_init_whitening(view, U8, shape, u8, &norm, 0.f), KILN_ERR_INVALID,
              "kiln_init_whitening", "a view");
  EXPECT_FAIL(ctx, kiln_init_whitening(w2d, U8, shape, u8, &norm, 0.f), KILN_ERR_SHAPE,
              "kiln_init_whitening", "[24,12]", "(Cout, Cin, kh, kw)");
  EXPECT_FAIL(ctx, kiln_init_whitening(odd, U8, shape, u8, &norm, 0.f), KILN_ERR_SHAPE,
              "kiln_init_whitening", "7 filters", "even", "24");
  EXPECT_FAIL(ctx, kiln_init_whitening(many, U8, shape, u8, &norm, 0.f), KILN_ERR_SHAPE,
              "26 filters", "2 to 2 C kh kw = 24");
  EXPECT_FAIL(ctx, kiln_init_whitening(w4, U8, shape, u8, &norm, 0.f), KILN_ERR_SHAPE,
              "kiln_init_whitening", "images [4,6,6,3] have 3 channels", "[24,4,2,2] takes 4");
  EXPECT_FAIL(ctx, kiln_init_whitening(big, U8, KILN_SHAPE(1, 20, 20, 3), u8, NULL, 0.f),
              KILN_ERR_SHAPE, "3 channels of 19x19", "more than 1024");
  EXPECT_FAIL(ctx, kiln_init_whitening(w, U8, shape, NULL, &norm, 0.f), KILN_ERR_INVALID,
              "kiln_init_whitening", "NULL images");
  EXPECT_FAIL(ctx, kiln_init_whitening(w, (kiln_host_type)9, shape, u8, &norm, 0.f),
              KILN_ERR_INVALID, "unknown host type 9");
  EXPECT_FAIL(ctx, kiln_init_whitening(w, U8, KILN_SHAPE(4, 6, 18), u8, &norm, 0.f), KILN_ERR_SHAPE,
              "images [4,6,18] have 3 dims", "(n, H, W, C)");
  EXPECT_FAIL(ctx, kiln_init_whitening(w, U8, KILN_SHAPE(0, 6, 6, 3), u8, &norm, 0.f),
              KILN_ERR_SHAPE, "images [0,6,6,3]", "n >= 1");
  EXPECT_FAIL(ctx, kiln_init_whitening(w, U8, KILN_SHAPE(4, 1, 6, 3), u8, &norm, 0.f),
              KILN_ERR_SHAPE, "images [4,1,6,3] for 2x2 patches", "H >= 2");
  EXPECT_FAIL(ctx, kiln_init_whitening(w, U8, KILN_SHAPE(-4, 6, 6, 3), u8, &norm, 0.f),
              KILN_ERR_SHAPE, "kiln_init_whitening");
  EXPECT_FAIL(ctx,
              kiln_init_whitening(w, U8, shape, u8,
                                  &(kiln_normalize){.channels = 2, .mean = mean, .std = std}, 0.f),
              KILN_ERR_SHAPE, "a normalisation of 2 channels", "1 or the images' channels, 3");
  EXPECT_FAIL(ctx,
              kiln_init_whitening(w, U8, shape, u8,
                                  &(kiln_normalize){.channels = 3, .mean = mean, .std = zero}, 0.f),
              KILN_ERR_INVALID, "channel 0's mean 0.5", "std 0");
  EXPECT_FAIL(
      ctx,
      kiln_init_whitening(w, U8, shape, u8, &(kiln_normalize){.channels = 3, .mean = mean}, 0.f),
      KILN_ERR_INVALID, "without its std");
  EXPECT_FAIL(
      ctx,
      kiln_init_whitening(w, U8, shape, u8, &(kiln_normalize){.channels = 3, .from_data = 1}, 0.f),
      KILN_ERR_INVALID, "from_data 1", "kiln_image_stats");
  EXPECT_FAIL(ctx, kiln_init_whitening(w, U8, shape, u8, &norm, -1e-3f), KILN_ERR_INVALID,
              "kiln_init_whitening", "eps -0.001", "> 0");
  EXPECT_FAIL(ctx, kiln_init_whitening(w, U8, shape, u8, &norm, KILN_ZERO), KILN_ERR_INVALID,
              "eps -0", "> 0");
  EXPECT_FAIL(ctx, kiln_init_whitening(w, U8, shape, u8, &norm, NAN), KILN_ERR_INVALID, "eps nan");
  EXPECT_FAIL(ctx, kiln_init_whitening(w, U8, shape, u8, &norm, INFINITY), KILN_ERR_INVALID,
              "eps inf");
  fl[100] = NAN;
  EXPECT_FAIL(ctx, kiln_init_whitening(w, KILN_HOST_F32, shape, fl, NULL, 0.f), KILN_ERR_INVALID,
              "kiln_init_whitening", "image value 100 is nan");
  /* a call on a failed context does nothing */
  kiln_init_whitening(w, U8, shape, u8, &norm, -1.f);
  cr_assert_eq(kiln_init_whitening(w, U8, shape, u8, &norm, 0.f), KILN_ERR_INVALID);
  kiln_ctx_clear_error(ctx);
  th_assert_ok(ctx);
  free(u8);
  th_free_scratch();
  th_ctx_free(ctx);
}

/* ---------------------------------------------------------------- kiln_init_whitening_tensor */

/* Without a GPU the covariance is recorded (an im2col and a product per chunk of patches) and its
 * read-back fails; the weight, TF32 and gradient mode are as they were. */
Test(whitening, tensor_init_checks_its_arguments_and_restores_the_modes) {
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_tensor *w = th_f32(ctx, KILN_SHAPE(24, 3, 2, 2)), *odd = th_f32(ctx, KILN_SHAPE(7, 3, 2, 2));
  kiln_tensor *img = th_f32(ctx, KILN_SHAPE(2000, 32, 32, 3));
  kiln_tensor *i32 = th_i32(ctx, KILN_SHAPE(4, 6, 6, 3));
  kiln_tensor *four = th_f32(ctx, KILN_SHAPE(4, 6, 6, 4)),
              *thin = th_f32(ctx, KILN_SHAPE(4, 1, 6, 3));
  kiln_tensor *flat = th_f32(ctx, KILN_SHAPE(4, 108));
  EXPECT_FAIL(ctx, kiln_init_whitening_tensor(w, NULL, 0.f), KILN_ERR_INVALID,
              "kiln_init_whitening_tensor", "NULL images");
  EXPECT_FAIL(ctx, kiln_init_whitening_tensor(w, i32, 0.f), KILN_ERR_SHAPE, "[4,6,6,3] i32",
              "f32 or bf16");
  EXPECT_FAIL(ctx, kiln_init_whitening_tensor(w, four, 0.f), KILN_ERR_SHAPE, "[4,6,6,4]",
              "[24,3,2,2]");
  EXPECT_FAIL(ctx, kiln_init_whitening_tensor(w, thin, 0.f), KILN_ERR_SHAPE, "H >= 2");
  EXPECT_FAIL(ctx, kiln_init_whitening_tensor(w, flat, 0.f), KILN_ERR_SHAPE, "[4,108]");
  EXPECT_FAIL(ctx, kiln_init_whitening_tensor(odd, img, 0.f), KILN_ERR_SHAPE, "7 filters");
  EXPECT_FAIL(ctx, kiln_init_whitening_tensor(w, img, -1.f), KILN_ERR_INVALID, "eps -1");
  kiln_step_begin(ctx);
  EXPECT_FAIL(ctx, kiln_init_whitening_tensor(w, img, 0.f), KILN_ERR_STATE, "inside a step");
  kiln_step_end(ctx);
  /* 2000 images of 31 x 31 patches: eight chunks of 272 images at most */
  int32_t n0 = th_tlen(ctx);
  kiln_set_tf32(ctx, 1);
  cr_assert_eq(kiln_init_whitening_tensor(w, img, 0.f), KILN_ERR_STATE, "a no-GPU context reads");
  kiln_ctx_clear_error(ctx);
  cr_assert_eq(th_count_ops(ctx, n0, th_tlen(ctx), KILN__OP_IM2COL), 8);
  cr_assert_eq(th_count_ops(ctx, n0, th_tlen(ctx), KILN__OP_MATMUL), 8);
  cr_assert(ctx->tf32, "TF32 was left off");
  cr_assert_eq(ctx->no_grad_depth, 0);
  cr_assert_eq(ctx->autocast_depth, 0, "an autocast region was left open");
  th_free_scratch();
  th_ctx_free(ctx);
}
