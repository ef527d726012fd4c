/*
 * test_gpu_ops_conv.c: the image ops on the GPU with TF32 off, against the float64 references of
 * ref_conv.h (checked against PyTorch's definitions): kiln_conv2d over a grid of geometries
 * (strides 1 and 2, padding 0 to 2, dilation, groups 1, 2 and depthwise, odd sizes, batch 1,
 * channel counts that are not multiples of 8, with and without bias, NULL options, a viewed
 * input), followed by a ReLU as networks use it, and the kernels that serve it (implicit GEMMs,
 * TMA-fed, from a halo tile, direct; their epilogues and switches; the switches that must change
 * no value are test_gpu_conv_switches.c's, the cases both share conv_cases.h's); pooling is
 * test_gpu_ops_pool.c's. Every op's gradients are checked twice: tightly against the analytic
 * float64 gradients of sum(y * g), and against central finite differences (kiln_gradcheck) on the
 * small cases. Without a GPU every test skips, saying why.
 */
#include <cuda_runtime_api.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "conv_cases.h"

#define GRAD_ATOL 5e-4 /* gradients sum up to ~1000 products: float32 accumulation */
#define GRAD_RTOL 1e-4

/* ---------------------------------------------------------------- convolution */

static const conv_case conv_cases[] = {
    {"3->5 3x3", 2, 7, 5, 3, 5, 3, 3, CO(0), 1, 0, 1},
    {"3->5 3x3 stride 2", 2, 7, 5, 3, 5, 3, 3, CO(.stride_h = 2, .stride_w = 2), 1, 0, 1},
    {"3->5 3x3 stride 2 pad 1", 2, 7, 5, 3, 5, 3, 3,
     CO(.stride_h = 2, .stride_w = 2, .pad_h = 1, .pad_w = 1), 1, 0, 1},
    {"5->6 3x3 pad 2, no bias", 2, 7, 5, 5, 6, 3, 3, CO(.pad_h = 2, .pad_w = 2), 0, 0, 1},
    {"5->3 3x3 dilation 2 pad 2", 2, 7, 5, 5, 3, 3, 3,
     CO(.pad_h = 2, .pad_w = 2, .dilation_h = 2, .dilation_w = 2), 1, 0, 1},
    {"6->4 3x3 groups 2 pad 1", 2, 7, 5, 6, 4, 3, 3, CO(.pad_h = 1, .pad_w = 1, .groups = 2), 1, 0,
     1},
    {"6->6 3x3 depthwise stride 2 pad 1, batch 1", 1, 7, 5, 6, 6, 3, 3,
     CO(.stride_h = 2, .stride_w = 2, .pad_h = 1, .pad_w = 1, .groups = 6), 1, 0, 1},
    {"6->12 3x3 depthwise (multiplier 2) pad 1, no bias, batch 1", 1, 7, 5, 6, 12, 3, 3,
     CO(.pad_h = 1, .pad_w = 1, .groups = 6), 0, 0, 1},
    {"3->5 3x3 NULL options", 2, 7, 5, 3, 5, 3, 3, CO(0), 1, 1, 0},
    {"5->3 1x1, batch 1", 1, 7, 5, 5, 3, 1, 1, CO(0), 1, 0, 1},
    {"3->6 2x2 (airbench's whitening)", 2, 7, 5, 3, 6, 2, 2, CO(0), 0, 0, 1},
    {"5->3 3x1 stride (2,1) pad (1,0) dilation (2,1)", 2, 7, 5, 5, 3, 3, 1,
     CO(.stride_h = 2, .stride_w = 1, .pad_h = 1, .dilation_h = 2), 1, 0, 1},
    {"6->5 3x2 stride (1,2) pad (2,1) dilation (2,1)", 2, 6, 7, 6, 5, 3, 2,
     CO(.stride_w = 2, .pad_h = 2, .pad_w = 1, .dilation_h = 2), 1, 0, 1},
    {"3->5 5x5 pad 2 on a 3x3 image, batch 1", 1, 3, 3, 3, 5, 5, 5, CO(.pad_h = 2, .pad_w = 2), 1,
     0, 1},
    {"3->4 3x3 to a 1x1 output", 2, 3, 3, 3, 4, 3, 3, CO(0), 1, 0, 1},
    {"9->6 3x3 groups 3 stride 2", 2, 7, 5, 9, 6, 3, 3,
     CO(.stride_h = 2, .stride_w = 2, .groups = 3), 1, 0, 0},
    /* the benchmark networks' shapes */
    {"1->32 3x3 (MNIST's first layer)", 16, 28, 28, 1, 32, 3, 3, CO(0), 1, 0, 0},
    {"32->64 3x3 pad 1", 8, 12, 12, 32, 64, 3, 3, CO(.pad_h = 1, .pad_w = 1), 1, 0, 0},
    {"24->24 3x3 pad 1 depthwise", 4, 9, 9, 24, 24, 3, 3, CO(.pad_h = 1, .pad_w = 1, .groups = 24),
     1, 0, 0},
};

typedef struct conv_gc {
  kiln_conv2d_options o;
  int bias, null_opts, relu;
} conv_gc;

static kiln_tensor *gc_conv(kiln_tensor *const *in, void *user) {
  const conv_gc *u = user;
  kiln_tensor *y = kiln_conv2d(in[0], in[1], u->bias ? in[2] : NULL, u->null_opts ? NULL : &u->o);
  return u->relu ? kiln_relu(y) : y;
}

/* One case: the forward pass (followed by a ReLU when relu is set) and the gradients of x, the
 * weight and the bias against the reference, then against finite differences when the case
 * asks. */
static void check_conv(kiln_ctx *ctx, const conv_case *c, int relu, uint64_t seed) {
  ref_win g = conv_win(c);
  kiln_shape xs = KILN_SHAPE(c->n, c->h, c->w, c->cin);
  kiln_shape ws = KILN_SHAPE(c->cout, c->cin / g.groups, c->kh, c->kw);
  kiln_shape bs = KILN_SHAPE(c->cout);
  kiln_shape os = ref_win_out(xs, &g, c->cout);
  char what[1024], wd[96];
  ref_win_str(&g, wd, sizeof wd);
  snprintf(what, sizeof what, "conv2d %s (%s)%s, x [%lld,%lld,%lld,%lld]", c->desc, wd,
           relu ? " + relu" : "", (long long)c->n, (long long)c->h, (long long)c->w,
           (long long)c->cin);

  kiln_step_begin(ctx);
  float *xh, *wh, *bh = NULL;
  kiln_tensor *x = ref_rand_tensor(ctx, xs, seed, &REF_GEN(-1, 1), 1, &xh);
  kiln_tensor *w = ref_rand_tensor(ctx, ws, seed + 1, &REF_GEN(-1, 1), 1, &wh);
  kiln_tensor *b = c->bias ? ref_rand_tensor(ctx, bs, seed + 2, &REF_GEN(-1, 1), 1, &bh) : NULL;
  double *xd = ref_to_double(xh, ref_numel(xs)), *wdd = ref_to_double(wh, ref_numel(ws));
  double *bd = bh ? ref_to_double(bh, c->cout) : NULL;

  kiln_tensor *y = kiln_conv2d(x, w, b, c->null_opts ? NULL : &c->o);
  if (relu) y = kiln_relu(y);
  double *want = ref_dalloc(ref_numel(os));
  ref_conv2d(xd, xs, wdd, c->cout, bd, &g, want);
  if (relu)
    for (int64_t i = 0; i < ref_numel(os); i++)
      want[i] = want[i] > 0 ? want[i] : 0;
  ref_expect_close(ctx, y, os, want, 1e-4, 1e-4, what);

  double *gy = ref_backward_weighted(ctx, y, seed + 3, what);
  if (relu) /* relu's derivative: through where the output is positive */
    for (int64_t i = 0; i < ref_numel(os); i++)
      gy[i] = want[i] > 0 ? gy[i] : 0;
  double *dx = ref_dalloc(ref_numel(xs)), *dw = ref_dalloc(ref_numel(ws)),
         *db = ref_dalloc(c->cout);
  ref_conv2d_backward(xd, xs, wdd, c->cout, &g, gy, dx, dw, db);
  ref_expect_grad(ctx, x, xs, dx, GRAD_ATOL, GRAD_RTOL, what, "x");
  ref_expect_grad(ctx, w, ws, dw, GRAD_ATOL, GRAD_RTOL, what, "the weight");
  if (b) ref_expect_grad(ctx, b, bs, db, GRAD_ATOL, GRAD_RTOL, what, "the bias");

  if (c->gc && !relu) {
    kiln_tensor *in[3] = {x, w, b};
    conv_gc u = {.o = c->o, .bias = c->bias, .null_opts = c->null_opts};
    ref_expect_gradcheck(ctx, what, gc_conv, c->bias ? 3 : 2, in, &u);
  }
  free(want);
  free(gy);
  free(dx);
  free(dw);
  free(db);
  free(xd);
  free(wdd);
  free(bd);
  free(xh);
  free(wh);
  free(bh);
  kiln_tensor_free(x);
  kiln_tensor_free(w);
  kiln_tensor_free(b);
  th_assert_ok(ctx);
}

Test(gpu_ops, conv2d) {
  TH_GPU_CTX_EAGER(ctx);
  for (size_t i = 0; i < sizeof conv_cases / sizeof *conv_cases; i++)
    check_conv(ctx, &conv_cases[i], 0, 2000 + 10 * i);
  th_ctx_free(ctx);
}

/* KILN_IM2COL_LANES=0: the im2col of a group of 2 or 3 channels (the 3-channel cases, 6 in 2
 * groups, 9 in 3) takes one value a thread, as before a tap a thread became the default; the same
 * cases against the same references. */
Test(gpu_ops, conv2d_with_a_value_a_thread_im2col) {
  setenv("KILN_IM2COL_LANES", "0", 1); /* read when the context is made */
  TH_GPU_CTX_EAGER(ctx);
  unsetenv("KILN_IM2COL_LANES");
  for (size_t i = 0; i < sizeof conv_cases / sizeof *conv_cases; i++)
    check_conv(ctx, &conv_cases[i], 0, 2000 + 10 * i);
  th_ctx_free(ctx);
}

/* conv + bias + ReLU, the pattern a product's epilogue takes (and its backward, the ReLU's
 * derivative and the bias gradient). */
Test(gpu_ops, conv2d_relu) {
  TH_GPU_CTX_EAGER(ctx);
  for (size_t i = 0; i < sizeof conv_cases / sizeof *conv_cases; i++)
    check_conv(ctx, &conv_cases[i], 1, 2500 + 10 * i);
  th_ctx_free(ctx);
}

/* The same convolution with fusion off: every node its own kernel. */
Test(gpu_ops, conv2d_unfused) {
  TH_GPU_CTX_EAGER(ctx);
  kiln_set_fusion(ctx, 0);
  for (size_t i = 0; i < sizeof conv_cases / sizeof *conv_cases; i++)
    if (!conv_cases[i].gc) check_conv(ctx, &conv_cases[i], 1, 2700 + 10 * i);
  th_ctx_free(ctx);
}

/* ---------------------------------------------------------------- implicit data gradients */

/* Convolutions with few output channels, whose data gradient runs as one implicit GEMM on tensor
 * cores (fusion/device/igemm.cuh): TF32 for f32 (TF32 on), bf16 in an autocast region; output
 * pixels not a multiple of the 128-pixel tile, input channels not a multiple of the channel
 * tile. */
static const conv_case igemm_cases[] = {
    {"32->64 3x3 (the cnn workload's second conv)", 4, 26, 26, 32, 64, 3, 3, CO(0), 1, 0, 0},
    {"24->64 3x3 pad 1 (air's first group)", 3, 11, 9, 24, 64, 3, 3, CO(.pad_h = 1, .pad_w = 1), 0,
     0, 0},
    {"8->32 3x3 stride 2 pad 1", 2, 9, 7, 8, 32, 3, 3,
     CO(.stride_h = 2, .stride_w = 2, .pad_h = 1, .pad_w = 1), 1, 0, 0},
    {"40->32 3x2 dilation (2,1) pad (2,1)", 2, 8, 9, 40, 32, 3, 2,
     CO(.dilation_h = 2, .pad_h = 2, .pad_w = 1), 1, 0, 0},
    {"64->64 2x2 stride 2", 3, 10, 10, 64, 64, 2, 2, CO(.stride_h = 2, .stride_w = 2), 1, 0, 0},
};

static double bf16_round(double v) { return kiln_bf16_to_f32(kiln_bf16_from_f32((float)v)); }

/* The gradient of x0 through relu (when relu is set) and the convolution, against float64 of the
 * operands the tensor cores multiply: TF32 rounds them by 2^-11 (a sum of K products of about
 * 0.25 is off by about sqrt(K) of that), bf16 operands are exact and the bf16 result is rounded
 * (to one of two neighbours). */
static void check_igemm(kiln_ctx *ctx, const conv_case *c, int bf16, int relu, uint64_t seed) {
  ref_win g = conv_win(c);
  kiln_shape xs = KILN_SHAPE(c->n, c->h, c->w, c->cin);
  kiln_shape ws = KILN_SHAPE(c->cout, c->cin, c->kh, c->kw);
  kiln_shape os = ref_win_out(xs, &g, c->cout);
  char what[512], wd[96];
  ref_win_str(&g, wd, sizeof wd);
  snprintf(what, sizeof what, "the data gradient of conv2d %s (%s)%s, %s", c->desc, wd,
           relu ? " after a relu" : "", bf16 ? "bf16" : "TF32");
  kiln_step_begin(ctx);
  float *xh, *wh;
  kiln_tensor *x = ref_rand_tensor(ctx, xs, seed, &REF_GEN(-1, 1), 1, &xh);
  kiln_tensor *w = ref_rand_tensor(ctx, ws, seed + 1, &REF_GEN(-1, 1), 1, &wh);
  kiln_tensor *b =
      c->bias ? ref_rand_tensor(ctx, KILN_SHAPE(c->cout), seed + 2, &REF_GEN(-1, 1), 1, NULL)
              : NULL;
  if (bf16) kiln_autocast_begin(ctx, KILN_DTYPE_BF16);
  kiln_tensor *y = kiln_conv2d(relu ? kiln_relu(x) : x, w, b, &c->o);
  if (bf16) kiln_autocast_end(ctx);
  double *gy = ref_backward_weighted(ctx, y, seed + 3, what);
  int64_t nx = ref_numel(xs), nw = ref_numel(ws), no = ref_numel(os);
  double *xd = ref_to_double(xh, nx), *wdd = ref_to_double(wh, nw), *dx = ref_dalloc(nx);
  if (bf16) { /* y's gradient and the weight as bf16 */
    for (int64_t i = 0; i < no; i++)
      gy[i] = bf16_round(gy[i]);
    for (int64_t i = 0; i < nw; i++)
      wdd[i] = bf16_round(wdd[i]);
  }
  ref_conv2d_backward(xd, xs, wdd, c->cout, &g, gy, dx, NULL, NULL);
  double k = (double)(c->kh * c->kw * c->cout);
  for (int64_t i = 0; i < nx; i++) {
    if (bf16) dx[i] = bf16_round(dx[i]);
    if (relu && xh[i] <= 0) dx[i] = 0;
  }
  if (bf16) /* f32 sums and float64 ones may round to neighbouring bf16 values */
    ref_expect_grad(ctx, x, xs, dx, 1e-5, 8e-3, what, "x");
  else
    ref_expect_grad(ctx, x, xs, dx, 4 * sqrt(k) * 0.25 * 1e-3, 1e-3, what, "x");
  free(gy);
  free(xd);
  free(wdd);
  free(dx);
  free(xh);
  free(wh);
  kiln_tensor_free(x);
  kiln_tensor_free(w);
  kiln_tensor_free(b);
  th_assert_ok(ctx);
}

Test(gpu_ops, conv2d_data_gradient_as_an_implicit_gemm) {
  TH_GPU_CTX_EAGER(ctx);
  kiln_set_tf32(ctx, 1);
  for (int bf16 = 0; bf16 < 2; bf16++)
    for (size_t i = 0; i < sizeof igemm_cases / sizeof *igemm_cases; i++)
      for (int relu = 0; relu < 2; relu++)
        check_igemm(ctx, &igemm_cases[i], bf16, relu, 3300 + 100 * bf16 + 10 * i + relu);
  th_ctx_free(ctx);
}

/* ---------------------------------------------------------------- implicit forward and weight
 * gradient */

/* Whether the planner computes the data gradient of case c as one implicit GEMM, which rounds
 * it to bf16 once: on mma.sync (at most 64 output channels, a multiple of 32), or on wgmma on an
 * sm_90 device (stride 1, dilation 1, channels in multiples of 8, at most 64 output channels or
 * at least 128 input channels; fusion/plan_conv.c, kiln__dgrad_on_wgmma). */
static bool dgrad_implicit(const conv_case *c) {
  int major = 0, minor = 0;
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0);
  cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, 0);
  ref_win g = conv_win(c);
  bool s1 =
      g.sh == 1 && g.sw == 1 && g.dh == 1 && g.dw == 1 && g.ph <= c->kh - 1 && g.pw <= c->kw - 1;
  return (c->cout % 32 == 0 && c->cout <= 64) ||
         (major == 9 && minor == 0 && s1 && c->cout % 8 == 0 && c->cin % 8 == 0 &&
          (c->cout <= 64 || c->cin >= 128));
}

static bool tma_on; /* check_bf16_conv's cases run with KILN_CONV_TMA=1 (dgrad_tma says more) */
static bool dgrad_tma(const conv_case *c);
static bool phases_on; /* and with KILN_CONV_TMA_PHASES=1 (dgrad_phases) */
static bool dgrad_phases(const conv_case *c);

/* Forward product, data gradient and weight gradient in bf16, recorded before anything runs (so
 * that one flush holds the forward product and the weight gradient that share the columns),
 * against float64 of the bf16 operands: results rounded to bf16 may land on either neighbour.
 * With grads false, the forward product alone, x and w taking no gradient. */
static void check_bf16_conv(kiln_ctx *ctx, const conv_case *c, uint64_t seed, bool grads) {
  ref_win g = conv_win(c);
  kiln_shape xs = KILN_SHAPE(c->n, c->h, c->w, c->cin);
  kiln_shape ws = KILN_SHAPE(c->cout, c->cin, c->kh, c->kw);
  kiln_shape os = ref_win_out(xs, &g, c->cout);
  char what[512], wd[96];
  ref_win_str(&g, wd, sizeof wd);
  snprintf(what, sizeof what, "%sbf16 conv2d %s (%s)", grads ? "" : "direct ", c->desc, wd);
  kiln_step_begin(ctx);
  float *xh, *wh;
  kiln_tensor *x = ref_rand_tensor(ctx, xs, seed, &REF_GEN(-1, 1), grads, &xh);
  kiln_tensor *w = ref_rand_tensor(ctx, ws, seed + 1, &REF_GEN(-1, 1), grads, &wh);
  kiln_autocast_begin(ctx, KILN_DTYPE_BF16);
  kiln_tensor *y = kiln_conv2d(x, w, NULL, &c->o);
  kiln_autocast_end(ctx);
  double *gy =
      grads ? ref_backward_weighted(ctx, kiln_cast(y, KILN_DTYPE_F32), seed + 3, what) : NULL;
  int64_t nx = ref_numel(xs), nw = ref_numel(ws), no = ref_numel(os);
  double *xd = ref_to_double(xh, nx), *wdd = ref_to_double(wh, nw), *want = ref_dalloc(no);
  for (int64_t i = 0; i < nx; i++) /* the operands the tensor cores multiply */
    xd[i] = bf16_round(xd[i]);
  for (int64_t i = 0; i < nw; i++)
    wdd[i] = bf16_round(wdd[i]);
  ref_conv2d(xd, xs, wdd, c->cout, NULL, &g, want);
  for (int64_t i = 0; i < no; i++)
    want[i] = bf16_round(want[i]);
  /* f32 sums in another order than float64's may round to the neighbouring bf16 value */
  ref_expect_close(ctx, kiln_cast(y, KILN_DTYPE_F32), os, want, 1e-3, 8e-3, what);
  if (grads) {
    double *dx = ref_dalloc(nx), *dw = ref_dalloc(nw);
    for (int64_t i = 0; i < no; i++) /* y's gradient reaches the products in bf16 */
      gy[i] = bf16_round(gy[i]);
    ref_conv2d_backward(xd, xs, wdd, c->cout, &g, gy, dx, dw, NULL);
    for (int64_t i = 0; i < nx; i++)
      dx[i] = bf16_round(dx[i]);
    for (int64_t i = 0; i < nw; i++)
      dw[i] = bf16_round(dw[i]);
    /* x's gradient where it is one implicit GEMM too; elsewhere cuBLAS writes the column gradient
     * in bf16 and col2im sums kh kw rounded values, which this reference does not model
     * (conv2d_data_gradient_as_an_implicit_gemm and the bf16 tests cover that path); a weight
     * gradient sums up to 18432 products */
    if (dgrad_implicit(c) || (tma_on && dgrad_tma(c)) || (phases_on && dgrad_phases(c)))
      ref_expect_grad(ctx, x, xs, dx, 1e-3, 8e-3, what, "x");
    ref_expect_grad(ctx, w, ws, dw, 1e-2, 8e-3, what, "the weight");
    free(dx);
    free(dw);
  }
  free(gy);
  free(xd);
  free(wdd);
  free(want);
  free(xh);
  free(wh);
  kiln_tensor_free(x);
  kiln_tensor_free(w);
  th_assert_ok(ctx);
}

/* The n cases, each against float64 with its gradients (check_bf16_conv, seeds from seed on), in
 * a context made with KILN_CONV_FEW set to few. */
static void check_cases_few(const char *few, const conv_case *cases, size_t n, uint64_t seed) {
  setenv("KILN_CONV_FEW", few, 1); /* read when the context is made */
  TH_GPU_CTX_EAGER(ctx);
  unsetenv("KILN_CONV_FEW");
  for (size_t i = 0; i < n; i++)
    check_bf16_conv(ctx, &cases[i], seed + 10 * i, true);
  th_ctx_free(ctx);
}

/* wgmma_cases on conv.cuh's kernels: KILN_CONV_FEW=0, or 24->64 and 8->64 would take their
 * forward products from a halo tile (conv2d_few_channels_from_a_halo_tile checks that one) */
Test(gpu_ops, conv2d_forward_and_weight_gradient_as_implicit_gemms) {
  check_cases_few("0", wgmma_cases, sizeof wgmma_cases / sizeof *wgmma_cases, 3700);
}

/* Whether the TMA-fed data gradient takes case c (kiln__conv_tma_dgrad): stride 1, input and
 * output channels in stages of 64, its window's padding d (k - 1) - p not negative. */
static bool dgrad_tma(const conv_case *c) {
  ref_win g = conv_win(c);
  return g.sh == 1 && g.sw == 1 && c->cin % 64 == 0 && c->cout % 64 == 0 &&
         g.dh * (c->kh - 1) >= g.ph && g.dw * (c->kw - 1) >= g.pw;
}

/* Whether the phased data gradient takes case c (plan_conv.c's kiln__dgrad_phases): a stride
 * above 1, dilation 1, the image its output times the strides, channels in stages of 64. */
static bool dgrad_phases(const conv_case *c) {
  ref_win g = conv_win(c);
  kiln_shape os = ref_win_out(KILN_SHAPE(c->n, c->h, c->w, c->cin), &g, c->cout);
  return (g.sh > 1 || g.sw > 1) && g.dh == 1 && g.dw == 1 && c->cin % 64 == 0 &&
         c->cout % 64 == 0 && c->h == os.d[1] * g.sh && c->w == os.d[2] * g.sw;
}

/* KILN_CONV_TMA_PHASES=1: phase_cases' strided data gradients one phase of dX at a time
 * (conv_tma.cuh's kiln_conv_dgrad_tma_phase), each of dX's values one f32 sum of its taps'
 * products rounded to bf16 once, against float64 with the forward product and the weight
 * gradient (check_bf16_conv). */
Test(gpu_ops, conv2d_strided_data_gradients_a_phase_at_a_time) {
  skip_unless_sm90();
  setenv("KILN_CONV_TMA_PHASES", "1", 1); /* read when the context is made */
  TH_GPU_CTX_EAGER(ctx);
  unsetenv("KILN_CONV_TMA_PHASES");
  phases_on = true;
  for (size_t i = 0; i < sizeof phase_cases / sizeof *phase_cases; i++) {
    cr_assert(dgrad_phases(&phase_cases[i]), "%s", phase_cases[i].desc);
    check_bf16_conv(ctx, &phase_cases[i], 5100 + 10 * i, true);
  }
  phases_on = false;
  th_ctx_free(ctx);
}

/* tma_cases with KILN_CONV_TMA=1, KILN_CONV_STAGED set to `staged` and KILN_CONV_DGRAD_BN to
 * dgrad_bn ("": unset). */
static void check_tma_cases(const char *staged, const char *dgrad_bn) {
  skip_unless_sm90();
  setenv("KILN_CONV_TMA", "1", 1); /* all read when the context is made */
  setenv("KILN_CONV_STAGED", staged, 1);
  setenv("KILN_CONV_DGRAD_BN", dgrad_bn, 1);
  TH_GPU_CTX_EAGER(ctx);
  unsetenv("KILN_CONV_TMA");
  unsetenv("KILN_CONV_STAGED");
  unsetenv("KILN_CONV_DGRAD_BN");
  tma_on = true;
  for (size_t i = 0; i < sizeof tma_cases / sizeof *tma_cases; i++)
    check_bf16_conv(ctx, &tma_cases[i], 4700 + 10 * i, true);
  tma_on = false;
  th_ctx_free(ctx);
}

Test(gpu_ops, conv2d_products_fed_by_the_tensor_memory_accelerator) { check_tma_cases("1", ""); }

/* KILN_CONV_STAGED=0: the data gradients' epilogues straight from the registers (two channels of
 * eight rows a warp), as before the staged ones became the default. */
Test(gpu_ops, conv2d_tma_data_gradients_with_register_epilogues) { check_tma_cases("0", ""); }

/* KILN_CONV_DGRAD_BN=256: data gradients of 192 and 256 channels in one tile as wide, one block
 * an SM, as before tiles of 128 (two blocks an SM) became the default. */
Test(gpu_ops, conv2d_tma_data_gradients_in_tiles_as_wide_as_the_channels) {
  check_tma_cases("1", "256");
}

/* The gradients of x and w for loss = sum(conv2d(x, w) g) of a bf16 64->128 convolution in a
 * context made with KILN_CONV_TMA set to `on`, two steps (a step graph's capture and replay, or
 * two eager flushes, whose tensor maps share one buffer): the second step's y, dx and dw as f32
 * (malloc'd). */
static void tma_step_twice(int on, int graphs, float **y, float **dx, float **dw) {
  setenv("KILN_CONV_TMA", on ? "1" : "0", 1);
  kiln_ctx *ctx = kiln_ctx_new(NULL);
  unsetenv("KILN_CONV_TMA");
  cr_assert(ctx && kiln_ctx_has_gpu(ctx));
  kiln_set_graphs(ctx, graphs);
  kiln_shape xs = KILN_SHAPE(6, 13, 11, 64), ws = KILN_SHAPE(128, 64, 3, 3);
  kiln_tensor *x = ref_rand_tensor(ctx, xs, 6200, &REF_GEN(-1, 1), 1, NULL);
  kiln_tensor *w = ref_rand_tensor(ctx, ws, 6201, &REF_GEN(-0.2f, 0.2f), 1, NULL);
  kiln_tensor *g = ref_rand_tensor(ctx, KILN_SHAPE(6, 13, 11, 128), 6202, &REF_GEN(-1, 1), 0, NULL);
  kiln_tensor *yk = kiln_tensor_new(ctx, KILN_DTYPE_F32, KILN_SHAPE(6, 13, 11, 128));
  cr_assert_not_null(yk, "%s", th_err(ctx));
  for (int s = 0; s < 2; s++) {
    kiln_tensor_zero_grad(x);
    kiln_tensor_zero_grad(w);
    kiln_step_begin(ctx);
    kiln_autocast_begin(ctx, KILN_DTYPE_BF16);
    kiln_tensor *yb = kiln_conv2d(x, w, NULL, &(kiln_conv2d_options){.pad_h = 1, .pad_w = 1});
    kiln_autocast_end(ctx);
    kiln_tensor *yf = kiln_cast(yb, KILN_DTYPE_F32);
    cr_assert_eq(kiln_assign(yk, yf), KILN_OK, "%s", th_err(ctx));
    cr_assert_eq(kiln_backward(kiln_sum(kiln_mul(yf, g), KILN_ALL_AXES, 0)), KILN_OK, "%s",
                 th_err(ctx));
    cr_assert_eq(kiln_step_end(ctx), KILN_OK, "%s", th_err(ctx));
  }
  *y = ref_read_f32(ctx, yk, "y");
  *dx = ref_read_f32(ctx, kiln_tensor_grad(x), "x's gradient");
  *dw = ref_read_f32(ctx, kiln_tensor_grad(w), "w's gradient");
  kiln_tensor_free(x);
  kiln_tensor_free(w);
  kiln_tensor_free(g);
  kiln_tensor_free(yk);
  th_ctx_free(ctx);
}

/* The TMA-fed step replayed from a step graph (its maps encoded once, at the capture) gives
 * what two eager steps give (maps encoded at every flush), bit for bit; and both agree with the
 * cp.async kernels' step within bf16's rounding. */
Test(gpu_ops, conv2d_tma_step_graph_replays_match_eager_steps) {
  skip_unless_sm90();
  const int64_t ny = 6 * 13 * 11 * 128, nx = 6 * 13 * 11 * 64, nw = 128 * 64 * 9;
  float *y[3], *dx[3], *dw[3];
  tma_step_twice(1, 1, &y[0], &dx[0], &dw[0]);
  tma_step_twice(1, 0, &y[1], &dx[1], &dw[1]);
  tma_step_twice(0, 1, &y[2], &dx[2], &dw[2]);
  cr_assert(memcmp(y[0], y[1], (size_t)ny * sizeof(float)) == 0, "y: graph against eager");
  cr_assert(memcmp(dx[0], dx[1], (size_t)nx * sizeof(float)) == 0, "dx: graph against eager");
  cr_assert(memcmp(dw[0], dw[1], (size_t)nw * sizeof(float)) == 0, "dw: graph against eager");
  const struct {
    const char *what;
    float *a, *b;
    int64_t n;
  } cmp[] = {{"y", y[0], y[2], ny}, {"dx", dx[0], dx[2], nx}, {"dw", dw[0], dw[2], nw}};
  for (int k = 0; k < 3; k++) {
    double most = 0, diff = 0;
    for (int64_t i = 0; i < cmp[k].n; i++) {
      most = fmax(most, fabs(cmp[k].b[i]));
      diff = fmax(diff, fabs((double)cmp[k].a[i] - cmp[k].b[i]));
    }
    cr_assert_gt(most, 0, "%s: all zero", cmp[k].what);
    cr_assert_leq(diff, 1e-2 * most, "%s: TMA-fed against cp.async: %g of %g", cmp[k].what, diff,
                  most);
  }
  for (int k = 0; k < 3; k++) {
    free(y[k]);
    free(dx[k]);
    free(dw[k]);
  }
}

/* few_cases with KILN_CONV_FEW_WGRAD=0: the forward product from a halo tile (KILN_CONV_FEW, on
 * by default), the weight gradient on the cp.async kernel, each against float64 with its
 * gradients. */
Test(gpu_ops, conv2d_few_channels_from_a_halo_tile) {
  setenv("KILN_CONV_FEW_WGRAD", "0", 1); /* read when the context is made */
  check_cases_few("1", few_cases, sizeof few_cases / sizeof *few_cases, 6100);
  unsetenv("KILN_CONV_FEW_WGRAD");
}

/* few_cases as kiln runs them by default: their weight gradients too from the same halo tiles
 * (KILN_CONV_FEW_WGRAD), summed inside the kernel through the workspace's counters, which each
 * launch leaves zero for the next (the cases run one after another in one context). */
Test(gpu_ops, conv2d_few_channel_weight_gradients_from_the_same_tiles) {
  check_cases_few("1", few_cases, sizeof few_cases / sizeof *few_cases, 6200);
}

/* The input as a view: every other column of a wider image, and a crop of the channels. */

Test(gpu_ops, tiny_conv2d_forward_products_run_direct) {
  TH_GPU_CTX_EAGER(ctx);
  for (size_t i = 0; i < sizeof direct_cases / sizeof *direct_cases; i++)
    check_bf16_conv(ctx, &direct_cases[i], 5700 + 10 * i, false);
  th_ctx_free(ctx);
}

/* By default (KILN_CONV_KPAD=0 turns it off) bf16 convolutions whose windows hold K >= 64 values, K
 * not a multiple of 8, pad their columns and filters with zeros (test_cpu_columns'
 * wide_windows_pad_their_columns_to_ multiples_of_8 checks the widths): the forward product and the
 * weight gradient against float64 of the bf16 operands, and x's gradient (cuBLAS's column gradient,
 * then col2im over rows of the padded width) against the same step's without padding. */
static const conv_case kpad_cases[] = {
    {"3->16 7x7 stride 2 pad 3 (ResNet's stem), 147 values to 168", 2, 20, 18, 3, 16, 7, 7,
     CO(.stride_h = 2, .stride_w = 2, .pad_h = 3, .pad_w = 3), 0, 0, 0},
    {"4->24 5x5 pad 2, 100 values to 104", 3, 9, 11, 4, 24, 5, 5, CO(.pad_h = 2, .pad_w = 2), 0, 0,
     0},
};

/* KILN_CONV_S2D=1: strided convolutions over channels not in 16-byte chunks run on the image's
 * blocks (core/conv.c's to_blocks: the blocks' im2col, then implicit GEMMs over them), their
 * three products against float64 as any other (32 or 64 output channels: x's gradient is one
 * implicit data gradient over the blocks, whose col2im moves each value once). ResNet's stem on
 * sizes whose padded image is odd, 3x3 at stride 2 on odd sizes, 8x8 at stride 4 (48 values a
 * block), 7x5 with paddings (3, 2) over 5 channels, and a batch whose weight gradient splits its
 * reduction. */
static const conv_case block_cases[] = {
    {"3->64 7x7 stride 2 pad 3 (ResNet's stem) on 21x18 images", 2, 21, 18, 3, 64, 7, 7,
     CO(.stride_h = 2, .stride_w = 2, .pad_h = 3, .pad_w = 3), 0, 0, 0},
    {"3->32 3x3 stride 2 pad 1 on 13x11 images", 3, 13, 11, 3, 32, 3, 3,
     CO(.stride_h = 2, .stride_w = 2, .pad_h = 1, .pad_w = 1), 0, 0, 0},
    {"3->32 8x8 stride 4 pad 2", 2, 22, 19, 3, 32, 8, 8,
     CO(.stride_h = 4, .stride_w = 4, .pad_h = 2, .pad_w = 2), 0, 0, 0},
    {"5->64 7x5 stride 2 pad (3, 2)", 2, 15, 12, 5, 64, 7, 5,
     CO(.stride_h = 2, .stride_w = 2, .pad_h = 3, .pad_w = 2), 0, 0, 0},
    {"3->64 7x7 stride 2 pad 3 on 64x64 images, batch 8 (split reduction)", 8, 64, 64, 3, 64, 7, 7,
     CO(.stride_h = 2, .stride_w = 2, .pad_h = 3, .pad_w = 3), 0, 0, 0},
};

Test(gpu_ops, conv2d_on_blocks_of_the_image) {
  setenv("KILN_CONV_S2D", "1", 1); /* read when the context is made */
  TH_GPU_CTX_EAGER(ctx);
  unsetenv("KILN_CONV_S2D");
  for (size_t i = 0; i < sizeof block_cases / sizeof *block_cases; i++)
    check_bf16_conv(ctx, &block_cases[i], 7300 + 10 * i, true);
  th_ctx_free(ctx);
}

/* x's gradient (malloc'd f32) of sum(conv2d(x, w) g) for case c in bf16, in a context made with
 * KILN_CONV_KPAD set to `on`. */
static float *kpad_data_gradient(const conv_case *c, const char *on, uint64_t seed) {
  setenv("KILN_CONV_KPAD", on, 1); /* read when the context is made */
  setenv("KILN_CONV_S2D", "0", 1);
  kiln_ctx *ctx = kiln_ctx_new(NULL);
  unsetenv("KILN_CONV_KPAD");
  unsetenv("KILN_CONV_S2D");
  cr_assert(ctx && kiln_ctx_has_gpu(ctx));
  kiln_set_graphs(ctx, 0);
  ref_win g = conv_win(c);
  kiln_shape xs = KILN_SHAPE(c->n, c->h, c->w, c->cin);
  kiln_tensor *x = ref_rand_tensor(ctx, xs, seed, &REF_GEN(-1, 1), 1, NULL);
  kiln_tensor *w = ref_rand_tensor(ctx, KILN_SHAPE(c->cout, c->cin, c->kh, c->kw), seed + 1,
                                   &REF_GEN(-1, 1), 0, NULL);
  kiln_tensor *gy =
      ref_rand_tensor(ctx, ref_win_out(xs, &g, c->cout), seed + 2, &REF_GEN(-1, 1), 0, NULL);
  kiln_step_begin(ctx);
  kiln_autocast_begin(ctx, KILN_DTYPE_BF16);
  kiln_tensor *y = kiln_conv2d(x, w, NULL, &c->o);
  kiln_autocast_end(ctx);
  cr_assert_eq(
      kiln_backward(kiln_sum(kiln_mul(kiln_cast(y, KILN_DTYPE_F32), gy), KILN_ALL_AXES, 0)),
      KILN_OK, "%s: %s", c->desc, th_err(ctx));
  cr_assert_eq(kiln_step_end(ctx), KILN_OK, "%s: %s", c->desc, th_err(ctx));
  float *dx = ref_read_f32(ctx, kiln_tensor_grad(x), "x's gradient");
  kiln_tensor_free(x);
  kiln_tensor_free(w);
  kiln_tensor_free(gy);
  th_ctx_free(ctx);
  return dx;
}

Test(gpu_ops, conv2d_with_padded_columns) {
  setenv("KILN_CONV_KPAD", "1", 1); /* read when the context is made */
  setenv("KILN_CONV_S2D", "0", 1);  /* the stem's product on its columns, not on blocks */
  TH_GPU_CTX_EAGER(ctx);
  unsetenv("KILN_CONV_KPAD");
  unsetenv("KILN_CONV_S2D");
  for (size_t i = 0; i < sizeof kpad_cases / sizeof *kpad_cases; i++)
    check_bf16_conv(ctx, &kpad_cases[i], 7100 + 10 * i, true);
  th_ctx_free(ctx);
  for (size_t i = 0; i < sizeof kpad_cases / sizeof *kpad_cases; i++) {
    const conv_case *c = &kpad_cases[i];
    int64_t n = c->n * c->h * c->w * c->cin;
    float *on = kpad_data_gradient(c, "1", 7200 + 10 * i),
          *off = kpad_data_gradient(c, "0", 7200 + 10 * i);
    double most = 0, diff = 0;
    for (int64_t j = 0; j < n; j++) {
      most = fmax(most, fabs(off[j]));
      diff = fmax(diff, fabs((double)on[j] - off[j]));
    }
    cr_assert_gt(most, 0.1, "%s: x's gradient is not all small", c->desc);
    cr_assert_leq(diff, 1e-2 * most, "%s: x's gradient differs by %g (largest %g)", c->desc, diff,
                  most);
    free(on);
    free(off);
  }
}

Test(gpu_ops, conv2d_of_a_view) {
  TH_GPU_CTX_EAGER(ctx);
  float *bh, *wh;
  kiln_tensor *base = ref_rand_tensor(ctx, KILN_SHAPE(2, 7, 10, 4), 2900, &REF_GEN(-1, 1), 1, &bh);
  kiln_tensor *w = ref_rand_tensor(ctx, KILN_SHAPE(5, 3, 3, 3), 2901, &REF_GEN(-1, 1), 1, &wh);
  kiln_shape xs = KILN_SHAPE(2, 7, 5, 3);
  double *xd = ref_dalloc(ref_numel(xs)), *wdd = ref_to_double(wh, 5 * 3 * 3 * 3);
  for (int64_t n = 0; n < 2; n++)
    for (int64_t r = 0; r < 7; r++)
      for (int64_t c = 0; c < 5; c++)
        for (int64_t ch = 0; ch < 3; ch++)
          xd[((n * 7 + r) * 5 + c) * 3 + ch] = bh[((n * 7 + r) * 10 + 2 * c + 1) * 4 + ch];
  ref_win g = {.kh = 3, .kw = 3, .sh = 1, .sw = 1, .ph = 1, .pw = 1, .dh = 1, .dw = 1, .groups = 1};
  kiln_shape os = ref_win_out(xs, &g, 5);
  double *want = ref_dalloc(ref_numel(os));
  ref_conv2d(xd, xs, wdd, 5, NULL, &g, want);
  kiln_step_begin(ctx);
  kiln_tensor *x = kiln_slice(kiln_slice(base, 2, 1, 10, 2), 3, 0, 3, 1);
  kiln_conv2d_options o = {.pad_h = 1, .pad_w = 1};
  kiln_tensor *y = kiln_conv2d(x, w, NULL, &o);
  const char *what = "conv2d 3->5 3x3 pad 1 of a view (columns 1::2, channels 0:3)";
  ref_expect_close(ctx, y, os, want, 1e-4, 1e-4, what);
  /* the gradient reaches the viewed elements of the base and only them */
  double *gy = ref_backward_weighted(ctx, y, 2902, what);
  double *dx = ref_dalloc(ref_numel(xs)), *dbase = ref_dalloc(2 * 7 * 10 * 4);
  ref_conv2d_backward(xd, xs, wdd, 5, &g, gy, dx, NULL, NULL);
  memset(dbase, 0, 2 * 7 * 10 * 4 * sizeof *dbase);
  for (int64_t n = 0; n < 2; n++)
    for (int64_t r = 0; r < 7; r++)
      for (int64_t c = 0; c < 5; c++)
        for (int64_t ch = 0; ch < 3; ch++)
          dbase[((n * 7 + r) * 10 + 2 * c + 1) * 4 + ch] = dx[((n * 7 + r) * 5 + c) * 3 + ch];
  ref_expect_grad(ctx, base, KILN_SHAPE(2, 7, 10, 4), dbase, GRAD_ATOL, GRAD_RTOL, what,
                  "the base");
  free(bh);
  free(wh);
  free(xd);
  free(wdd);
  free(want);
  free(gy);
  free(dx);
  free(dbase);
  kiln_tensor_free(base);
  kiln_tensor_free(w);
  th_ctx_free(ctx);
}

/* Skips the test on a device other than sm_90 (the TMA-fed kernels are sm_90a's). */
static void skip_unless_sm90a(void) {
  int major = 0, minor = 0;
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0);
  cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, 0);
  if (major != 9 || minor != 0)
    cr_skip_test("the TMA-fed kernels are sm_90a's; this device is sm_%d%d", major, minor);
}

/* The gradients of a bf16 conv (c -> c, 3x3 pad 1) -> batch norm -> GELU -> conv (c -> c, at
 * stride s, pad 1) block for loss = sum(y gy), x (16, 9, 7, c) (1,008 rows, 7 blocks of 128 and
 * one of 112), or at stride 2 x (32, 10, 8, c) (2,560 rows, five blocks a phase, the second
 * conv's data gradient phased: KILN_CONV_TMA_PHASES=1), in a context made with
 * KILN_CONV_MOMENTS, KILN_CONV_PREFETCH and KILN_CONV_HOIST set to sw[0..2], eagerly: the batch
 * norm's weight and bias gradients (from its sums), x's and the first filters' (malloc'd f32, in
 * that order in g[4]). */
static void bn_block_gradients(int64_t c, int s, const char *const sw[3], uint64_t seed,
                               float *g[4]) {
  static const char *const names[4] = {"KILN_CONV_MOMENTS", "KILN_CONV_PREFETCH", "KILN_CONV_HOIST",
                                       "KILN_CONV_TMA_PHASES"};
  for (int q = 0; q < 4; q++) /* read when the context is made */
    setenv(names[q], q < 3 ? sw[q] : s > 1 ? "1" : "0", 1);
  kiln_ctx *ctx = kiln_ctx_new(NULL);
  for (int q = 0; q < 4; q++)
    unsetenv(names[q]);
  cr_assert(ctx && kiln_ctx_has_gpu(ctx));
  kiln_set_graphs(ctx, 0);
  kiln_shape xs = s > 1 ? KILN_SHAPE(32, 10, 8, c) : KILN_SHAPE(16, 9, 7, c);
  kiln_shape ys = s > 1 ? KILN_SHAPE(32, 5, 4, c) : xs;
  kiln_tensor *x = ref_rand_tensor(ctx, xs, seed, &REF_GEN(-1, 1), 1, NULL);
  kiln_tensor *k1 =
      ref_rand_tensor(ctx, KILN_SHAPE(c, c, 3, 3), seed + 1, &REF_GEN(-0.1, 0.1), 1, NULL);
  kiln_tensor *k2 =
      ref_rand_tensor(ctx, KILN_SHAPE(c, c, 3, 3), seed + 2, &REF_GEN(-0.1, 0.1), 1, NULL);
  kiln_tensor *gamma = ref_rand_tensor(ctx, KILN_SHAPE(c), seed + 3, &REF_GEN(0.5, 1.5), 1, NULL);
  kiln_tensor *beta = ref_rand_tensor(ctx, KILN_SHAPE(c), seed + 4, &REF_GEN(-0.5, 0.5), 1, NULL);
  kiln_tensor *gy = ref_rand_tensor(ctx, ys, seed + 5, &REF_GEN(-1, 1), 0, NULL);
  kiln_conv2d_options o = {.pad_h = 1, .pad_w = 1},
                      o2 = {.pad_h = 1, .pad_w = 1, .stride_h = s, .stride_w = s};
  kiln_step_begin(ctx);
  kiln_autocast_begin(ctx, KILN_DTYPE_BF16);
  kiln_tensor *h = kiln_conv2d(x, k1, NULL, &o);
  h = kiln_gelu(kiln_batch_norm(h, gamma, beta, NULL, NULL, 1, 0, 0), KILN_GELU_ERF);
  kiln_tensor *y = kiln_conv2d(h, k2, NULL, &o2);
  kiln_autocast_end(ctx);
  cr_assert_eq(
      kiln_backward(kiln_sum(kiln_mul(kiln_cast(y, KILN_DTYPE_F32), gy), KILN_ALL_AXES, 0)),
      KILN_OK, "%s", th_err(ctx));
  cr_assert_eq(kiln_step_end(ctx), KILN_OK, "%s", th_err(ctx));
  kiln_tensor *of[4] = {gamma, beta, x, k1};
  for (int q = 0; q < 4; q++)
    g[q] = ref_read_f32(ctx, kiln_tensor_grad(of[q]), "a gradient");
  kiln_tensor *all[6] = {x, k1, k2, gamma, beta, gy};
  for (int q = 0; q < 6; q++)
    kiln_tensor_free(all[q]);
  th_ctx_free(ctx);
}

/* Batch norm's sums in the data gradient's epilogue (plan_conv.c's kiln__dgrad_moments; tiles of
 * 64 channels at 64, two tiles of 128 at 256) against the same step with a moments kernel of their
 * own (KILN_CONV_MOMENTS=0): the same data gradient and the same g, so that only the order of the
 * sums differs: the weight's and bias's gradients agree to 1e-4 of their largest; x's and the
 * filters' come through the batch norm's dx, rounded to bf16, where a sum's last bit can move a
 * value by one bf16 step (H100: x's by 0.0078 where its largest is 4.78): to 1/128 of their
 * largest, two such steps. At stride 1, and at stride 2 with the second conv's data gradient by
 * phases (KILN_CONV_TMA_PHASES=1), its blocks' rows one phase's pixels. */
Test(gpu_ops, conv2d_data_gradients_sum_the_batch_norm_before_them) {
  skip_unless_sm90a();
  const int64_t chans[2] = {64, 256};
  const char *names[4] = {"the weight's", "the bias's", "x's", "the first filters'"};
  for (int s = 1; s <= 2; s++)
    for (int i = 0; i < 2; i++) {
      float *on[4], *off[4];
      uint64_t seed = 7400 + 10 * (uint64_t)i + 100 * (uint64_t)s;
      bn_block_gradients(chans[i], s, (const char *[]){"1", "0", "1"}, seed, on);
      bn_block_gradients(chans[i], s, (const char *[]){"0", "0", "1"}, seed, off);
      int64_t c = chans[i], n[4] = {c, c, (s > 1 ? 32 * 10 * 8 : 16 * 9 * 7) * c, c * c * 9};
      for (int q = 0; q < 4; q++) {
        double most = 0, diff = 0;
        for (int64_t j = 0; j < n[q]; j++) {
          most = fmax(most, fabs(off[q][j]));
          diff = fmax(diff, fabs((double)on[q][j] - off[q][j]));
        }
        cr_assert_gt(most, 1e-3, "%lld channels, stride %d: %s gradient is not all small",
                     (long long)c, s, names[q]);
        cr_assert_leq(diff, (q < 2 ? 1e-4 : 1.0 / 128) * most,
                      "%lld channels, stride %d: %s gradient differs by %g (largest %g)",
                      (long long)c, s, names[q], diff, most);
        free(on[q]);
        free(off[q]);
      }
    }
}

/* KILN_CONV_PREFETCH=1 (the producer thread asks L2 for the epilogue's rows of x) and
 * KILN_CONV_HOIST=0 (the per-channel operands loaded in every row), 2, 4 and 16 (x's rows loaded
 * that many ahead: 16 is all of a thread's rows at 256 channels, past them at 64) change no
 * value: the block's gradients bitwise those of one row ahead without the prefetch, at 64 and
 * 256 channels, at stride 1 and at stride 2 by phases (the rows prefetched and loaded ahead are
 * a phase's pixels). */
Test(gpu_ops, conv2d_data_gradients_prefetching_or_not_hoisting_their_epilogue_loads) {
  skip_unless_sm90a();
  const int64_t chans[2] = {64, 256};
  const char *const variants[5][2] = {{"1", "1"}, {"0", "0"}, {"0", "2"}, {"0", "4"}, {"1", "16"}};
  for (int s = 1; s <= 2; s++)
    for (int i = 0; i < 2; i++) {
      int64_t c = chans[i], n[4] = {c, c, (s > 1 ? 32 * 10 * 8 : 16 * 9 * 7) * c, c * c * 9};
      uint64_t seed = 7500 + 10 * (uint64_t)i + 100 * (uint64_t)s;
      float *base[4];
      bn_block_gradients(c, s, (const char *[]){"1", "0", "1"}, seed, base);
      for (int v = 0; v < 5; v++) {
        float *g[4];
        bn_block_gradients(c, s, (const char *[]){"1", variants[v][0], variants[v][1]}, seed, g);
        for (int q = 0; q < 4; q++) {
          cr_assert_eq(memcmp(g[q], base[q], (size_t)n[q] * sizeof(float)), 0,
                       "%lld channels, stride %d: gradient %d differs with KILN_CONV_PREFETCH=%s "
                       "KILN_CONV_HOIST=%s",
                       (long long)c, s, q, variants[v][0], variants[v][1]);
          free(g[q]);
        }
      }
      for (int q = 0; q < 4; q++)
        free(base[q]);
    }
}
