/*
 * test_gpu_bf16.c: bf16 on the GPU. Casts round as the host's kiln_bf16_from_f32 does, bitwise;
 * elementwise chains, reductions, products, convolutions, pooling and batch norm on bf16 values
 * against float64 references computed from the same bf16 inputs (each op's result rounded to
 * bf16 as kiln stores it: a fused kernel rounds its in-register bf16 values the same way), within
 * one or two bf16 rounding steps; autocast regions (master weights get f32 gradients close to
 * the f32 ones); a mixed-precision conv net's training tracks the f32 one; graph replay equals no
 * graph bitwise and fused equals unfused. Without a GPU every test skips, saying why.
 */
#include <math.h>
#include <string.h>

#include "ref_conv.h"

/* A bf16 rounding step at its largest relative to the value: 8 significant bits make the step
 * 2^-7 of the power of two at or below the value, so 2^-7 of values just above it (2^-8 was
 * half of that, and failed a result one step off at 1.52). */
#define BF16_ULP (1.0 / 128.0)

static double round_bf16(double v) { return kiln_bf16_to_f32(kiln_bf16_from_f32((float)v)); }

/* n random floats in [lo, hi), rounded to bf16 values (so that f32 and bf16 hold the same). */
static float *bf16_values(int64_t n, uint64_t seed, float lo, float hi) {
  float *h = ref_falloc(n);
  th_fill(h, n, seed, lo, hi);
  for (int64_t i = 0; i < n; i++)
    h[i] = (float)round_bf16(h[i]);
  return h;
}

/* A persistent bf16 tensor holding the f32 values h (already bf16 values). */
static kiln_tensor *upload_bf16(kiln_ctx *ctx, kiln_shape s, const float *h) {
  int64_t n = ref_numel(s);
  uint16_t *b = ref_malloc((size_t)n * sizeof *b);
  for (int64_t i = 0; i < n; i++)
    b[i] = kiln_bf16_from_f32(h[i]);
  kiln_tensor *t = kiln_tensor_from_host(ctx, KILN_DTYPE_BF16, s, b);
  cr_assert_not_null(t, "%s", th_err(ctx));
  free(b);
  return t;
}

/* A bf16 tensor's values as floats (malloc'd). */
static float *read_bf16(kiln_ctx *ctx, kiln_tensor *t) {
  cr_assert_not_null(t, "%s", th_err(ctx));
  cr_assert_eq(kiln_tensor_dtype(t), KILN_DTYPE_BF16, "a %s tensor",
               kiln_dtype_name(kiln_tensor_dtype(t)));
  int64_t n = kiln_tensor_numel(t);
  uint16_t *b = ref_malloc((size_t)n * sizeof *b);
  cr_assert_eq(kiln_tensor_to_host(t, b, (size_t)n * sizeof *b), KILN_OK, "%s", th_err(ctx));
  float *f = ref_falloc(n);
  for (int64_t i = 0; i < n; i++)
    f[i] = kiln_bf16_to_f32(b[i]);
  free(b);
  return f;
}

static void expect_bf16_close(kiln_ctx *ctx, kiln_tensor *t, const double *want, int64_t n,
                              double atol, double rtol, const char *what) {
  float *got = read_bf16(ctx, t);
  cr_assert_eq(kiln_tensor_numel(t), n, "%s: %lld values", what, (long long)kiln_tensor_numel(t));
  th_assert_close(got, want, n, atol, rtol, what);
  free(got);
}

/* ---------------------------------------------------------------- casts */

Test(bf16, casts_round_as_the_host_does) {
  TH_GPU_CTX(ctx);
  enum { N = 4096 };
  float h[N];
  th_fill(h, N, 11, -3.f, 3.f);
  uint32_t special[] = {0x7f800000u, 0xff800000u, 0x7fc00000u, 0x00000001u, 0x807fffffu,
                        0x80000000u, 0x3f808000u, 0x3f818000u, 0x3f80c000u, 0x7f7fffffu,
                        0xc0008000u, 0x00800000u, 0x3f7fffffu, 0xff7f8000u};
  int ns = (int)(sizeof special / sizeof special[0]);
  for (int i = 0; i < ns; i++)
    memcpy(&h[i], &special[i], 4);
  for (int i = ns; i < N; i += 7) /* exact ties between two bf16 values, odd and even */
    h[i] = kiln_bf16_to_f32(kiln_bf16_from_f32(h[i])) * (1.f + 1.f / 512.f);
  for (int i = ns + 3; i < N; i += 11) /* magnitudes far from 1 */
    h[i] *= (i % 2) ? 1e-30f : 1e30f;
  kiln_tensor *x = ref_upload(ctx, KILN_SHAPE(N), h);
  kiln_tensor *b = kiln_cast(x, KILN_DTYPE_BF16);
  kiln_tensor *back = kiln_cast(b, KILN_DTYPE_F32);
  uint16_t got[N];
  cr_assert_eq(kiln_tensor_to_host(b, got, sizeof got), KILN_OK, "%s", th_err(ctx));
  float *f = th_read(back);
  for (int i = 0; i < N; i++) {
    uint16_t want = kiln_bf16_from_f32(h[i]);
    if (isnan(h[i])) {
      cr_assert(isnan(kiln_bf16_to_f32(got[i])), "element %d: NaN became 0x%04x", i, got[i]);
      cr_assert(isnan(f[i]));
      continue;
    }
    cr_assert_eq(got[i], want, "element %d: %a rounded to 0x%04x on the device, 0x%04x on the host",
                 i, (double)h[i], got[i], want);
    cr_assert_eq(f[i], kiln_bf16_to_f32(want), "element %d: bf16 back to f32", i);
  }
  cr_assert_eq(
      kiln_tensor_item(kiln_cast(kiln_full(ctx, KILN_SCALAR_SHAPE, 1.5f), KILN_DTYPE_BF16)), 1.5f,
      "kiln_tensor_item reads a bf16 value: %s", th_err(ctx));
  free(f);
  kiln_tensor_free(x);
  th_ctx_free(ctx);
}

/* ---------------------------------------------------------------- elementwise and reductions */

Test(bf16, elementwise_chains_and_reductions_against_float64) {
  TH_GPU_CTX(ctx);
  enum { R = 64, C = 300 };
  float *xh = bf16_values(R * C, 21, -2.f, 2.f), *yh = bf16_values(C, 22, -1.f, 1.f);
  kiln_tensor *x = upload_bf16(ctx, KILN_SHAPE(R, C), xh), *y = upload_bf16(ctx, KILN_SHAPE(C), yh);
  /* z = gelu(x * y + x), every step rounded to bf16; its sums over rows and columns, its row
   * maxima, and a mixed bf16 * f32 product, which is f32 */
  kiln_tensor *z = kiln_gelu(kiln_add(kiln_mul(x, y), x), KILN_GELU_ERF);
  kiln_tensor *s0 = kiln_sum(z, KILN_AXES(0), 0), *s1 = kiln_mean(z, KILN_AXES(1), 0);
  kiln_tensor *mx = kiln_max(z, KILN_AXES(1), 0);
  kiln_tensor *two = ref_upload(ctx, KILN_SHAPE(1), (float[]){0.3f});
  kiln_tensor *mixed = kiln_mul(z, two);
  cr_assert_eq(kiln_tensor_dtype(mixed), KILN_DTYPE_F32);
  double *zw = ref_dalloc(R * C), *s0w = ref_dalloc(C), *s1w = ref_dalloc(R), *mw = ref_dalloc(R),
         *mixw = ref_dalloc(R * C);
  for (int64_t c = 0; c < C; c++)
    s0w[c] = 0;
  for (int64_t r = 0; r < R; r++) {
    double acc = 0, m = -INFINITY;
    for (int64_t c = 0; c < C; c++) {
      double v = round_bf16(round_bf16((double)xh[r * C + c] * yh[c]) + xh[r * C + c]);
      v = round_bf16(0.5 * v * (1.0 + erf(v / sqrt(2.0))));
      zw[r * C + c] = v;
      mixw[r * C + c] = v * (double)0.3f;
      s0w[c] += v;
      acc += v;
      m = v > m ? v : m;
    }
    s1w[r] = round_bf16(acc / C);
    mw[r] = m;
  }
  for (int64_t c = 0; c < C; c++)
    s0w[c] = round_bf16(s0w[c]);
  /* a value within two rounding steps of the reference: the f32 arithmetic before a rounding
   * (erf's, where 1 + erf cancels) may land on the other side of it */
  expect_bf16_close(ctx, z, zw, R * C, 1e-6, 2.01 * BF16_ULP, "gelu(x * y + x)");
  expect_bf16_close(ctx, s0, s0w, C, 1e-3, 1.01 * BF16_ULP, "sum over axis 0");
  expect_bf16_close(ctx, s1, s1w, R, 1e-4, 1.01 * BF16_ULP, "mean over axis 1");
  expect_bf16_close(ctx, mx, mw, R, 0, 1.01 * BF16_ULP, "max over axis 1");
  float *mixg = th_read(mixed);
  th_assert_close(mixg, mixw, R * C, 1e-6, 2.01 * BF16_ULP, "bf16 * f32 (z's two steps)");
  free(mixg);
  free(xh), free(yh), free(zw), free(s0w), free(s1w), free(mw), free(mixw);
  kiln_tensor_free(x), kiln_tensor_free(y), kiln_tensor_free(two);
  th_ctx_free(ctx);
}

/* ---------------------------------------------------------------- products and images */

Test(bf16, matmul_conv_pooling_and_batch_norm_against_float64) {
  TH_GPU_CTX(ctx);
  /* a bf16 product: f32 accumulation, one rounding at the end */
  enum { M = 96, K = 200, N = 72 };
  float *ah = bf16_values(M * K, 31, -1.f, 1.f), *bh = bf16_values(K * N, 32, -1.f, 1.f);
  kiln_tensor *a = upload_bf16(ctx, KILN_SHAPE(M, K), ah),
              *b = upload_bf16(ctx, KILN_SHAPE(K, N), bh);
  kiln_tensor *p = kiln_matmul(a, b);
  double *pw = ref_dalloc(M * N);
  for (int i = 0; i < M; i++)
    for (int j = 0; j < N; j++) {
      double acc = 0;
      for (int k = 0; k < K; k++)
        acc += (double)ah[i * K + k] * bh[k * N + j];
      pw[i * N + j] = acc;
    }
  expect_bf16_close(ctx, p, pw, M * N, 1e-4, 1.01 * BF16_ULP, "bf16 matmul");

  /* a convolution in an autocast region: f32 input and weight, cast to bf16 */
  kiln_shape xs = KILN_SHAPE(2, 9, 7, 5);
  int64_t nx = ref_numel(xs), cout = 6, nw = cout * 5 * 3 * 3;
  float *xh = bf16_values(nx, 33, -1.f, 1.f), *wh = bf16_values(nw, 34, -0.5f, 0.5f);
  kiln_tensor *x = ref_upload(ctx, xs, xh), *w = ref_upload(ctx, KILN_SHAPE(cout, 5, 3, 3), wh);
  ref_win g = {.kh = 3, .kw = 3, .sh = 2, .sw = 1, .ph = 1, .pw = 1, .dh = 1, .dw = 1, .groups = 1};
  kiln_autocast_begin(ctx, KILN_DTYPE_BF16);
  kiln_tensor *y =
      kiln_conv2d(x, w, NULL, &(kiln_conv2d_options){.stride_h = 2, .pad_h = 1, .pad_w = 1});
  kiln_autocast_end(ctx);
  kiln_shape ys = ref_win_out(xs, &g, cout);
  double *xd = ref_to_double(xh, nx), *wd = ref_to_double(wh, nw), *yw = ref_dalloc(ref_numel(ys));
  ref_conv2d(xd, xs, wd, cout, NULL, &g, yw);
  expect_bf16_close(ctx, y, yw, ref_numel(ys), 1e-4, 1.01 * BF16_ULP, "autocast conv2d");

  /* pooling and batch norm keep bf16 values (statistics in f32) */
  float *yh = read_bf16(ctx, y);
  double *yd = ref_to_double(yh, ref_numel(ys));
  ref_win pw2 = {.kh = 2, .kw = 2, .sh = 2, .sw = 2, .dh = 1, .dw = 1, .groups = 1};
  kiln_shape ms = ref_win_out(ys, &pw2, cout);
  double *mw = ref_dalloc(ref_numel(ms));
  ref_max_pool2d(yd, ys, &pw2, mw);
  expect_bf16_close(ctx, kiln_max_pool2d(y, &(kiln_pool2d_options){.kernel_h = 2, .kernel_w = 2}),
                    mw, ref_numel(ms), 0, 0, "max pool of bf16 values: exact");
  int64_t rows = ref_numel(ys) / cout;
  double *bw = ref_dalloc(ref_numel(ys));
  ref_batch_norm(yd, rows, cout, NULL, NULL, NULL, NULL, 1, 0.1, 1e-5, bw);
  for (int64_t i = 0; i < ref_numel(ys); i++)
    bw[i] = round_bf16(bw[i]);
  expect_bf16_close(ctx, kiln_batch_norm(y, NULL, NULL, NULL, NULL, 1, 0.1f, 1e-5f), bw,
                    ref_numel(ys), 1e-3, 1.01 * BF16_ULP, "batch norm of bf16 values");
  free(ah), free(bh), free(pw), free(xh), free(wh), free(xd), free(wd), free(yw), free(yh);
  free(yd), free(mw), free(bw);
  kiln_tensor_free(a), kiln_tensor_free(b), kiln_tensor_free(x), kiln_tensor_free(w);
  th_ctx_free(ctx);
}

/* Batch norm of bf16 images with 64 and 256 channels, whose statistics' kernel takes two and four
 * channels a thread (moments.cuh), 1,000 rows (8 blocks of 128, the last short), values with a
 * mean far from 0 (the shifted sums at work): the output against float64 of the same bf16 values.
 * (f32's 64 and 300 channels: test_gpu_ops_norm's cases; the gradient's sums at 64 and 256 bf16
 * channels: test_gpu_ops_conv's fused against unfused.) */
Test(bf16, batch_norm_of_many_channels_against_float64) {
  TH_GPU_CTX(ctx);
  const int64_t chans[2] = {64, 256}, rows = 1000;
  for (int i = 0; i < 2; i++) {
    int64_t C = chans[i], n = rows * C;
    char what[96];
    snprintf(what, sizeof what, "batch norm of bf16 values, %lld channels", (long long)C);
    float *xh = bf16_values(n, 9100 + (uint64_t)i, 2.f, 6.f);
    double *xd = ref_to_double(xh, n), *want = ref_dalloc(n);
    ref_batch_norm(xd, rows, C, NULL, NULL, NULL, NULL, 1, 0.1, 1e-5, want);
    for (int64_t j = 0; j < n; j++)
      want[j] = round_bf16(want[j]);
    kiln_tensor *x = upload_bf16(ctx, KILN_SHAPE(rows / 10, 2, 5, C), xh);
    expect_bf16_close(ctx, kiln_batch_norm(x, NULL, NULL, NULL, NULL, 1, 0.1f, 1e-5f), want, n,
                      1e-3, 1.01 * BF16_ULP, what);
    free(xh), free(xd), free(want);
    kiln_tensor_free(x);
  }
  th_ctx_free(ctx);
}

/* A 2x2 max pool then batch norm, bf16, 64 and 256 channels, with KILN_POOL_MOMENTS=1 (the pool's
 * kernel sums the norm's statistics as it writes its output: plan_conv.c's kiln__pool_moments)
 * and without (a kernel of their own), 40 x 5 x 5 pooled pixels, 1,000 rows, past a block of 128
 * and short in the last; no step graphs (the values are read inside the step): the pooled image
 * exactly and the norm's output within bf16's rounding against float64. */
Test(bf16, max_pool_then_batch_norm_against_float64) {
  const int64_t chans[2] = {64, 256};
  for (int fused = 1; fused >= 0; fused--) {
    setenv("KILN_POOL_MOMENTS", fused ? "1" : "0", 1); /* read when the context is made */
    TH_GPU_CTX(ctx);
    unsetenv("KILN_POOL_MOMENTS");
    kiln_set_graphs(ctx, 0);
    for (int i = 0; i < 2; i++) {
      int64_t C = chans[i];
      kiln_shape xs = KILN_SHAPE(40, 10, 11, C); /* pooled: 40 x 5 x 5 = 1,000 rows */
      int64_t nx = ref_numel(xs);
      char what[128];
      snprintf(what, sizeof what, "max pool then batch norm, bf16, %lld channels, fused %d",
               (long long)C, fused);
      float *xh = bf16_values(nx, 9200 + (uint64_t)i, 1.f, 5.f);
      double *xd = ref_to_double(xh, nx);
      ref_win pw2 = {.kh = 2, .kw = 2, .sh = 2, .sw = 2, .dh = 1, .dw = 1, .groups = 1};
      kiln_shape ms = ref_win_out(xs, &pw2, C);
      int64_t nm = ref_numel(ms);
      double *pooled = ref_dalloc(nm), *want = ref_dalloc(nm);
      ref_max_pool2d(xd, xs, &pw2, pooled);
      ref_batch_norm(pooled, nm / C, C, NULL, NULL, NULL, NULL, 1, 0.1, 1e-5, want);
      for (int64_t j = 0; j < nm; j++)
        want[j] = round_bf16(want[j]);
      kiln_tensor *x = upload_bf16(ctx, xs, xh);
      kiln_step_begin(ctx);
      kiln_tensor *p = kiln_max_pool2d(x, &(kiln_pool2d_options){.kernel_h = 2, .kernel_w = 2});
      kiln_tensor *y = kiln_batch_norm(p, NULL, NULL, NULL, NULL, 1, 0.1f, 1e-5f);
      char wp[160];
      snprintf(wp, sizeof wp, "%s: the pooled image", what);
      expect_bf16_close(ctx, p, pooled, nm, 0, 0, wp);
      expect_bf16_close(ctx, y, want, nm, 1e-3, 1.01 * BF16_ULP, what);
      cr_assert_eq(kiln_step_end(ctx), KILN_OK, "%s: %s", what, th_err(ctx));
      free(xh), free(xd), free(pooled), free(want);
      kiln_tensor_free(x);
    }
    th_ctx_free(ctx);
  }
}

/* x's gradient (malloc'd f32) through a bf16 2x2 max pool, batch norm in training and GELU of x
 * (40, 10, 11, c), loss sum(y gy), in a context made with KILN_POOL_PROLOGUE set to `on`. */
static float *pool_bn_gradient(int64_t c, const char *on) {
  setenv("KILN_POOL_PROLOGUE", on, 1); /* read when the context is made */
  kiln_ctx *ctx = kiln_ctx_new(NULL);
  unsetenv("KILN_POOL_PROLOGUE");
  cr_assert(ctx && kiln_ctx_has_gpu(ctx));
  kiln_set_graphs(ctx, 0);
  kiln_shape xs = KILN_SHAPE(40, 10, 11, c), ys = KILN_SHAPE(40, 5, 5, c);
  kiln_tensor *x = ref_rand_tensor(ctx, xs, 9300, &REF_GEN(-2, 2), 1, NULL);
  kiln_tensor *gamma = ref_rand_tensor(ctx, KILN_SHAPE(c), 9301, &REF_GEN(0.5, 1.5), 1, NULL);
  kiln_tensor *gy = ref_rand_tensor(ctx, ys, 9302, &REF_GEN(-1, 1), 0, NULL);
  kiln_step_begin(ctx);
  kiln_autocast_begin(ctx, KILN_DTYPE_BF16);
  kiln_tensor *h = kiln_max_pool2d(kiln_cast(x, KILN_DTYPE_BF16),
                                   &(kiln_pool2d_options){.kernel_h = 2, .kernel_w = 2});
  h = kiln_gelu(kiln_batch_norm(h, gamma, NULL, NULL, NULL, 1, 0.1f, 1e-5f), KILN_GELU_ERF);
  kiln_autocast_end(ctx);
  cr_assert_eq(
      kiln_backward(kiln_sum(kiln_mul(kiln_cast(h, KILN_DTYPE_F32), gy), KILN_ALL_AXES, 0)),
      KILN_OK, "%s", th_err(ctx));
  cr_assert_eq(kiln_step_end(ctx), KILN_OK, "%s", th_err(ctx));
  float *dx = ref_read_f32(ctx, kiln_tensor_grad(x), "x's gradient");
  kiln_tensor_free(x), kiln_tensor_free(gamma), kiln_tensor_free(gy);
  th_ctx_free(ctx);
  return dx;
}

/* KILN_POOL_PROLOGUE=1 (the pool gradient computes batch norm's dx where it reads it) against the
 * run as a kernel of its own, 64 and 256 channels: x's gradient within one bf16 step of dx
 * (1/128 of the largest; the same expressions, compiled in two kernels). */
Test(bf16, pool_gradient_prologue_equals_its_own_kernel) {
  TH_GPU_CTX(probe); /* skips without a GPU */
  th_ctx_free(probe);
  const int64_t chans[2] = {64, 256};
  for (int i = 0; i < 2; i++) {
    int64_t n = 40 * 10 * 11 * chans[i];
    float *on = pool_bn_gradient(chans[i], "1"), *off = pool_bn_gradient(chans[i], "0");
    double most = 0, diff = 0;
    for (int64_t j = 0; j < n; j++) {
      most = fmax(most, fabs(off[j]));
      diff = fmax(diff, fabs((double)on[j] - off[j]));
    }
    cr_assert_gt(most, 1e-3, "%lld channels: x's gradient is not all small", (long long)chans[i]);
    cr_assert_leq(diff, most / 128, "%lld channels: x's gradient differs by %g (largest %g)",
                  (long long)chans[i], diff, most);
    free(on), free(off);
  }
}

/* The gradients of x and of batch norm's weight (malloc'd f32, *dx and *dgamma) through batch norm
 * in training, a ReLU and then ResNet's stem pool (3x3 at stride 2, padding 1; x (40, 10, 10, c),
 * or with big (64, 96, 96, c)) or a 3x3 convolution at stride 2 into 128 channels (its data
 * gradient on columns and a col2im; x (16, 10, 10, c)), bf16, loss sum(y gy), in a context made
 * with KILN_WINDOW_MOMENTS set to on.
 */
static void window_moments_gradients(int64_t c, bool pool, bool big, const char *on, float **dx,
                                     float **dgamma) {
  setenv("KILN_WINDOW_MOMENTS", on, 1); /* read when the context is made */
  kiln_ctx *ctx = kiln_ctx_new(NULL);
  unsetenv("KILN_WINDOW_MOMENTS");
  cr_assert(ctx && kiln_ctx_has_gpu(ctx));
  kiln_set_graphs(ctx, 0);
  kiln_shape xs = big    ? KILN_SHAPE(64, 96, 96, c)
                  : pool ? KILN_SHAPE(40, 10, 10, c)
                         : KILN_SHAPE(16, 10, 10, c);
  kiln_shape ys = big    ? KILN_SHAPE(64, 48, 48, c)
                  : pool ? KILN_SHAPE(40, 5, 5, c)
                         : KILN_SHAPE(16, 5, 5, 128);
  kiln_tensor *x = ref_rand_tensor(ctx, xs, 9400, &REF_GEN(-2, 2), 1, NULL);
  kiln_tensor *gamma = ref_rand_tensor(ctx, KILN_SHAPE(c), 9401, &REF_GEN(0.5, 1.5), 1, NULL);
  kiln_tensor *k =
      pool ? NULL
           : ref_rand_tensor(ctx, KILN_SHAPE(128, c, 3, 3), 9402, &REF_GEN(-0.1, 0.1), 0, NULL);
  kiln_tensor *gy = ref_rand_tensor(ctx, ys, 9403, &REF_GEN(-1, 1), 0, NULL);
  kiln_step_begin(ctx);
  kiln_tensor *h = th_bn_relu_then_stride2(x, gamma, k);
  cr_assert_eq(
      kiln_backward(kiln_sum(kiln_mul(kiln_cast(h, KILN_DTYPE_F32), gy), KILN_ALL_AXES, 0)),
      KILN_OK, "%s", th_err(ctx));
  cr_assert_eq(kiln_step_end(ctx), KILN_OK, "%s", th_err(ctx));
  *dx = ref_read_f32(ctx, kiln_tensor_grad(x), "x's gradient");
  *dgamma = ref_read_f32(ctx, kiln_tensor_grad(gamma), "the weight's gradient");
  kiln_tensor_free(x), kiln_tensor_free(gamma), kiln_tensor_free(gy);
  if (k) kiln_tensor_free(k);
  th_ctx_free(ctx);
}

/* The largest difference of n values a and b, and the largest magnitude of b, for a message. */
static void largest_difference(const float *a, const float *b, int64_t n, double *diff,
                               double *most) {
  *diff = 0, *most = 0;
  for (int64_t j = 0; j < n; j++) {
    *most = fmax(*most, fabs(b[j]));
    *diff = fmax(*diff, fabs((double)a[j] - b[j]));
  }
}

/* Batch norm's backward sums in the kernel of the window op whose epilogue computes g
 * (KILN_WINDOW_MOMENTS, on: plan_conv.c's kiln__window_moments; the stem pool's gradient, a
 * stride-2 convolution's col2im) against their kernel of their own, 64 and 128 channels (two
 * slices of 64), pixels past a block of 128 and short in the last, and a pool's gradient whose
 * blocks take two partial sums each: the sums are the same values added in another order,
 * so the weight's gradient (those sums) agrees within 1e-4 of its largest, x's (bf16 values
 * computed from them) within 1/128 of its largest. */
Test(bf16, window_gradients_sum_batch_norm_as_their_own_kernel) {
  TH_GPU_CTX(probe); /* skips without a GPU */
  th_ctx_free(probe);
  const int64_t chans[3] = {64, 128, 64};
  for (int pool = 0; pool < 2; pool++)
    for (int i = 0; i < 2 + pool; i++) {
      bool big = i == 2; /* the stem pool's: 4,608 partials, two a block */
      int64_t c = chans[i], n = (big ? 64 * 96 * 96 : (pool ? 40 : 16) * 10 * 10) * c;
      float *dx[2], *dg[2];
      window_moments_gradients(c, pool, big, "1", &dx[1], &dg[1]);
      window_moments_gradients(c, pool, big, "0", &dx[0], &dg[0]);
      double diff, most;
      largest_difference(dg[1], dg[0], c, &diff, &most);
      cr_assert_gt(most, 1e-3, "%s, %lld channels: the weight's gradient is not all small",
                   pool ? "pool" : "conv", (long long)c);
      cr_assert_leq(diff, most * 1e-4,
                    "%s, %lld channels: the weight's gradient differs by %g "
                    "(largest %g)",
                    pool ? "pool" : "conv", (long long)c, diff, most);
      largest_difference(dx[1], dx[0], n, &diff, &most);
      cr_assert_gt(most, 1e-3, "%s, %lld channels: x's gradient is not all small",
                   pool ? "pool" : "conv", (long long)c);
      cr_assert_leq(diff, most / 128, "%s, %lld channels: x's gradient differs by %g (largest %g)",
                    pool ? "pool" : "conv", (long long)c, diff, most);
      free(dx[0]), free(dx[1]), free(dg[0]), free(dg[1]);
    }
}

/* ---------------------------------------------------------------- training */

/* A small conv net: conv 3->8 3x3, batch norm, GELU, max pool 2, conv 8->16 3x3, batch norm,
 * GELU, global max pool, linear 16->10; SGD with Nesterov momentum. */
typedef struct net {
  kiln_params *params;
  kiln_conv2d_layer c1, c2;
  kiln_batch_norm_layer b1, b2;
  kiln_linear fc;
  kiln_optim *opt;
} net;

static void net_init(kiln_ctx *ctx, net *m) {
  kiln_manual_seed(ctx, 5);
  m->params = kiln_params_new(ctx);
  cr_assert_eq(kiln_conv2d_layer_init(
                   &m->c1, m->params,
                   &(kiln_conv2d_layer_options){
                       .name = "c1", .in = 3, .out = 8, .kernel = 3, .padding = 1, .no_bias = 1}),
               KILN_OK);
  cr_assert_eq(
      kiln_batch_norm_layer_init(&m->b1, m->params,
                                 &(kiln_batch_norm_layer_options){
                                     .name = "b1", .features = 8, .momentum = 0.1f, .eps = 1e-5f}),
      KILN_OK);
  cr_assert_eq(kiln_conv2d_layer_init(
                   &m->c2, m->params,
                   &(kiln_conv2d_layer_options){
                       .name = "c2", .in = 8, .out = 16, .kernel = 3, .padding = 1, .no_bias = 1}),
               KILN_OK);
  cr_assert_eq(
      kiln_batch_norm_layer_init(&m->b2, m->params,
                                 &(kiln_batch_norm_layer_options){
                                     .name = "b2", .features = 16, .momentum = 0.1f, .eps = 1e-5f}),
      KILN_OK);
  cr_assert_eq(kiln_linear_init(&m->fc, m->params,
                                &(kiln_linear_options){.name = "fc", .in = 16, .out = 10}),
               KILN_OK);
  kiln_sgd_options o = kiln_sgd_defaults(0.05f);
  o.momentum = 0.9f;
  o.nesterov = 1;
  m->opt = kiln_sgd_new(m->params, &o);
  cr_assert_not_null(m->opt, "%s", kiln_ctx_error(ctx));
}

static void net_free(net *m) {
  kiln_optim_free(m->opt);
  kiln_params_free(m->params);
}

static kiln_tensor *net_forward(net *m, kiln_tensor *x) {
  kiln_tensor *h = kiln_gelu(
      kiln_batch_norm_layer_forward(&m->b1, kiln_conv2d_layer_forward(&m->c1, x)), KILN_GELU_ERF);
  h = kiln_max_pool2d(h, &(kiln_pool2d_options){.kernel_h = 2, .kernel_w = 2});
  h = kiln_gelu(kiln_batch_norm_layer_forward(&m->b2, kiln_conv2d_layer_forward(&m->c2, h)),
                KILN_GELU_ERF);
  return kiln_linear_forward(&m->fc, kiln_global_max_pool2d(h));
}

/* One training step on (x, y), the forward pass in a bf16 autocast region or not; the loss. */
static float net_step(kiln_ctx *ctx, net *m, kiln_tensor *x, kiln_tensor *y, bool bf16) {
  kiln_step_begin(ctx);
  if (bf16) kiln_autocast_begin(ctx, KILN_DTYPE_BF16);
  kiln_tensor *logits = net_forward(m, x);
  if (bf16) kiln_autocast_end(ctx);
  if (bf16) cr_assert_eq(kiln_tensor_dtype(logits), KILN_DTYPE_BF16, "%s", th_err(ctx));
  kiln_tensor *loss = kiln_cross_entropy(logits, y, KILN_REDUCTION_MEAN, 0.f);
  kiln_optim_zero_grad(m->opt);
  cr_assert_eq(kiln_backward(loss), KILN_OK, "%s", th_err(ctx));
  cr_assert_eq(kiln_optim_step(m->opt), KILN_OK, "%s", th_err(ctx));
  kiln_tensor *keep = kiln_detach(loss);
  cr_assert_eq(kiln_step_end(ctx), KILN_OK, "%s", th_err(ctx));
  return kiln_tensor_item(keep);
}

/* A batch of 32 random 12x12 images and random labels to learn by heart. */
static void batch(kiln_ctx *ctx, kiln_tensor **x, kiln_tensor **y) {
  *x = th_rand(ctx, KILN_SHAPE(32, 12, 12, 3), 41, -1.f, 1.f, NULL);
  int32_t lab[32];
  th_rng r = {42};
  for (int i = 0; i < 32; i++)
    lab[i] = th_rng_below(&r, 10);
  *y = ref_upload_i32(ctx, KILN_SHAPE(32), lab);
}

/* Trains `steps` steps; losses[] gets each step's loss and *params the parameters at the end
 * (malloc'd; *np their count). */
static void train(bool graphs, bool fusion, bool bf16, int steps, float *losses, float **params,
                  int64_t *np) {
  kiln_ctx *ctx = kiln_ctx_new(NULL);
  cr_assert(kiln_ctx_has_gpu(ctx));
  kiln_set_tf32(ctx, 0);
  kiln_set_graphs(ctx, graphs);
  kiln_set_fusion(ctx, fusion);
  net m;
  net_init(ctx, &m);
  kiln_tensor *x, *y;
  batch(ctx, &x, &y);
  for (int s = 0; s < steps; s++)
    losses[s] = net_step(ctx, &m, x, y, bf16);
  *params = th_params_values(m.params, np);
  kiln_tensor_free(x), kiln_tensor_free(y);
  net_free(&m);
  th_ctx_free(ctx);
}

Test(bf16, autocast_training_tracks_f32) {
  TH_GPU_CTX(probe);
  th_ctx_free(probe);
  enum { S = 40 };
  float l32[S], l16[S], *p32, *p16;
  int64_t n32, n16;
  train(true, true, false, S, l32, &p32, &n32);
  train(true, true, true, S, l16, &p16, &n16);
  cr_assert_eq(n32, n16);
  for (int s = 0; s < S; s++) {
    cr_assert(isfinite(l16[s]), "step %d: bf16 loss %g", s, (double)l16[s]);
    cr_assert_lt(fabsf(l16[s] - l32[s]), 0.05f + 0.05f * l32[s], "step %d: bf16 loss %g, f32 %g", s,
                 (double)l16[s], (double)l32[s]);
  }
  cr_assert_lt(l16[S - 1], 0.5f * l16[0], "bf16 training did not learn: %g to %g", (double)l16[0],
               (double)l16[S - 1]);
  cr_assert_lt(l32[S - 1], 0.5f * l32[0], "f32 training did not learn: %g to %g", (double)l32[0],
               (double)l32[S - 1]);
  /* the master weights end near the f32 run's (learning random labels by heart amplifies the
   * differences of rounding: a quarter of their norm) */
  double diff = 0, norm = 0;
  for (int64_t i = 0; i < n32; i++) {
    diff += ((double)p16[i] - p32[i]) * ((double)p16[i] - p32[i]);
    norm += (double)p32[i] * p32[i];
  }
  cr_assert_lt(sqrt(diff), 0.25 * sqrt(norm), "parameters differ by %g of their norm %g",
               sqrt(diff) / sqrt(norm), sqrt(norm));
  cr_log_info("40 steps: f32 loss %.4f -> %.4f, bf16 %.4f -> %.4f", (double)l32[0],
              (double)l32[S - 1], (double)l16[0], (double)l16[S - 1]);
  free(p32), free(p16);
}

Test(bf16, graph_replay_equals_no_graph_and_fused_equals_unfused) {
  TH_GPU_CTX(probe);
  th_ctx_free(probe);
  enum { S = 6 };
  float lg[S], le[S], lu[S], *pg, *pe, *pu;
  int64_t ng, ne, nu;
  train(true, true, true, S, lg, &pg, &ng);
  train(false, true, true, S, le, &pe, &ne);
  train(false, false, true, S, lu, &pu, &nu);
  cr_assert_eq(ng, ne);
  cr_assert_eq(ng, nu);
  for (int s = 0; s < S; s++)
    cr_assert_eq(lg[s], le[s], "step %d: loss %a with graphs, %a without", s, (double)lg[s],
                 (double)le[s]);
  cr_assert_eq(memcmp(pg, pe, (size_t)ng * sizeof *pg), 0, "graph and no-graph parameters differ");
  /* unfused kernels store every bf16 value that fused ones round in registers: the same values
   * but for the order of some sums, and for c2's data gradient, which fused is one implicit GEMM
   * (on sm_90) where unfused rounds the column gradient to bf16 before col2im sums nine of them.
   * Learning random labels by heart amplifies such differences step by step (a single small
   * weight moved by a fifth in six steps on the H200), so the parameters are compared as a
   * whole: their difference against their norm */
  for (int s = 0; s < S; s++)
    cr_assert_lt(fabsf(lu[s] - le[s]), 1e-2f * (1.f + fabsf(le[s])),
                 "step %d: unfused %g, fused %g", s, (double)lu[s], (double)le[s]);
  double diff = 0, norm = 0;
  for (int64_t i = 0; i < ne; i++) {
    diff += ((double)pu[i] - pe[i]) * ((double)pu[i] - pe[i]);
    norm += (double)pe[i] * pe[i];
  }
  cr_log_info("6 steps: unfused parameters differ from fused by %.3g of their norm",
              sqrt(diff / norm));
  cr_assert_lt(sqrt(diff), 0.05 * sqrt(norm), "unfused parameters differ by %g of their norm",
               sqrt(diff / norm));
  free(pg), free(pe), free(pu);
}

/* A step ended inside an open autocast region runs nothing: the parameters and batch norm's
 * running statistics stay bitwise as they were, with step graphs and without, and the optimizer's
 * step count too; the region closed, the next step trains. */
Test(bf16, a_step_ended_inside_an_autocast_region_runs_nothing) {
  for (int graphs = 0; graphs < 2; graphs++) {
    TH_GPU_CTX(ctx);
    kiln_set_graphs(ctx, graphs);
    net m;
    net_init(ctx, &m);
    kiln_tensor *x, *y;
    batch(ctx, &x, &y);
    net_step(ctx, &m, x, y, true); /* in graph mode, this step's graph is captured */
    int64_t n0, n1, n2;
    float *before = th_params_values(m.params, &n0);
    int64_t steps = kiln_optim_steps(m.opt);
    kiln_step_begin(ctx);
    kiln_autocast_begin(ctx, KILN_DTYPE_BF16);
    kiln_tensor *loss = kiln_cross_entropy(net_forward(&m, x), y, KILN_REDUCTION_MEAN, 0.f);
    kiln_optim_zero_grad(m.opt);
    cr_assert_eq(kiln_backward(loss), KILN_OK, "%s", th_err(ctx));
    cr_assert_eq(kiln_optim_step(m.opt), KILN_OK, "%s", th_err(ctx));
    cr_assert_eq(kiln_step_end(ctx), KILN_ERR_STATE, "graphs %d", graphs);
    cr_assert_not_null(strstr(th_err(ctx), "kiln_step_end: 1 autocast region is open"), "%s",
                       th_err(ctx));
    kiln_ctx_clear_error(ctx);
    kiln_autocast_end(ctx);
    float *after = th_params_values(m.params, &n1);
    cr_assert_eq(n1, n0);
    cr_assert(memcmp(before, after, (size_t)n0 * sizeof *before) == 0,
              "graphs %d: the failed step changed the parameters", graphs);
    cr_assert_eq(kiln_optim_steps(m.opt), steps);
    net_step(ctx, &m, x, y, true);
    float *later = th_params_values(m.params, &n2);
    cr_assert(memcmp(before, later, (size_t)n0 * sizeof *before) != 0, "the next step trains");
    cr_assert_eq(kiln_optim_steps(m.opt), steps + 1);
    free(before);
    free(after);
    free(later);
    kiln_tensor_free(x), kiln_tensor_free(y);
    net_free(&m);
    th_ctx_free(ctx);
  }
}
