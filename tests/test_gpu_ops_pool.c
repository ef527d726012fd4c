/*
 * test_gpu_ops_pool.c: the pooling ops on the GPU with TF32 off, against the float64 references of
 * ref_conv.h: max and average pooling (padding, dilation, count_include_pad and exclude_pad,
 * ties, views, positions written by the forward pass), global pooling and flatten. Every op's
 * gradients are checked against the analytic float64 gradients of sum(y * g), and against central
 * finite differences (kiln_gradcheck) on the small cases. Without a GPU every test skips, saying
 * why.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ref_conv.h"

/* ---------------------------------------------------------------- pooling */

typedef enum pkind { P_MAX, P_AVG } pkind;

typedef struct pool_case {
  const char *desc;
  pkind k;
  kiln_shape x;
  kiln_pool2d_options o; /* zero fields: kiln's defaults */
  int gc;
} pool_case;

static ref_win pool_win(const kiln_pool2d_options *o) {
  return (ref_win){.kh = o->kernel_h,
                   .kw = o->kernel_w,
                   .sh = o->stride_h ? o->stride_h : o->kernel_h,
                   .sw = o->stride_w ? o->stride_w : o->kernel_w,
                   .ph = o->pad_h,
                   .pw = o->pad_w,
                   .dh = o->dilation_h ? o->dilation_h : 1,
                   .dw = o->dilation_w ? o->dilation_w : 1,
                   .groups = 1};
}

#define PO(...)                                                                                    \
  { __VA_ARGS__ }
#define S4(d0, d1, d2, d3)                                                                         \
  {                                                                                                \
    .ndim = 4, .d = { d0, d1, d2, d3 }                                                             \
  }

static const pool_case pool_cases[] = {
    {"max 2x2 stride 2", P_MAX, S4(2, 7, 5, 3),
     PO(.kernel_h = 2, .kernel_w = 2, .stride_h = 2, .stride_w = 2), 1},
    {"max 2x2, default stride", P_MAX, S4(2, 7, 5, 6), PO(.kernel_h = 2, .kernel_w = 2), 1},
    {"max 3x3 stride 2 pad 1", P_MAX, S4(2, 7, 5, 5),
     PO(.kernel_h = 3, .kernel_w = 3, .stride_h = 2, .stride_w = 2, .pad_h = 1, .pad_w = 1), 1},
    {"max 3x3 stride 1 pad 1 dilation 2", P_MAX, S4(2, 7, 5, 6),
     PO(.kernel_h = 3, .kernel_w = 3, .stride_h = 1, .stride_w = 1, .pad_h = 1, .pad_w = 1,
        .dilation_h = 2, .dilation_w = 2),
     1},
    {"max 3x2 stride (2,1) pad (1,0) dilation (1,2)", P_MAX, S4(1, 7, 5, 5),
     PO(.kernel_h = 3, .kernel_w = 2, .stride_h = 2, .stride_w = 1, .pad_h = 1, .dilation_w = 2),
     1},
    {"max 3x3 stride 3 (rows and columns left over)", P_MAX, S4(2, 7, 5, 3),
     PO(.kernel_h = 3, .kernel_w = 3), 1},
    {"max 2x2 of 64 channels", P_MAX, S4(4, 12, 12, 64), PO(.kernel_h = 2, .kernel_w = 2), 0},
    {"avg 2x2 stride 2", P_AVG, S4(2, 7, 5, 3),
     PO(.kernel_h = 2, .kernel_w = 2, .stride_h = 2, .stride_w = 2), 1},
    {"avg 3x3 stride 2 pad 1 (padding counted)", P_AVG, S4(2, 7, 5, 5),
     PO(.kernel_h = 3, .kernel_w = 3, .stride_h = 2, .stride_w = 2, .pad_h = 1, .pad_w = 1), 1},
    {"avg 3x3 stride 2 pad 1 exclude_pad", P_AVG, S4(2, 7, 5, 5),
     PO(.kernel_h = 3, .kernel_w = 3, .stride_h = 2, .stride_w = 2, .pad_h = 1, .pad_w = 1,
        .exclude_pad = 1),
     1},
    {"avg 3x3 stride 1 pad 1 exclude_pad", P_AVG, S4(1, 7, 5, 6),
     PO(.kernel_h = 3, .kernel_w = 3, .stride_h = 1, .stride_w = 1, .pad_h = 1, .pad_w = 1,
        .exclude_pad = 1),
     1},
    {"avg 2x3 stride (1,2) pad 1 exclude_pad", P_AVG, S4(2, 7, 5, 6),
     PO(.kernel_h = 2, .kernel_w = 3, .stride_h = 1, .stride_w = 2, .pad_h = 1, .pad_w = 1,
        .exclude_pad = 1),
     1},
    {"avg 2x3 stride (1,2) pad 1", P_AVG, S4(2, 7, 5, 6),
     PO(.kernel_h = 2, .kernel_w = 3, .stride_h = 1, .stride_w = 2, .pad_h = 1, .pad_w = 1), 1},
    {"avg 2x2 of 64 channels", P_AVG, S4(4, 12, 12, 64), PO(.kernel_h = 2, .kernel_w = 2), 0},
};

typedef struct pool_gc {
  pkind k;
  kiln_pool2d_options o;
} pool_gc;

static kiln_tensor *gc_pool(kiln_tensor *const *in, void *user) {
  const pool_gc *u = user;
  return u->k == P_MAX ? kiln_max_pool2d(in[0], &u->o) : kiln_avg_pool2d(in[0], &u->o);
}

/* One pooling case; max pooling's inputs are distinct values 0.1 apart (no ties, even after a
 * finite-difference step), or, with ties, quantised values that repeat in most windows. */
static void check_pool(kiln_ctx *ctx, const pool_case *c, int ties, uint64_t seed) {
  ref_win g = pool_win(&c->o);
  kiln_shape xs = c->x, os = ref_win_out(xs, &g, xs.d[3]);
  int64_t nx = ref_numel(xs), no = ref_numel(os);
  char what[1024], wd[96];
  ref_win_str(&g, wd, sizeof wd);
  snprintf(what, sizeof what, "%s (%s%s)%s of [%lld,%lld,%lld,%lld]", c->desc, wd,
           c->o.exclude_pad ? ", exclude_pad" : "", ties ? " with ties" : "", (long long)xs.d[0],
           (long long)xs.d[1], (long long)xs.d[2], (long long)xs.d[3]);
  kiln_step_begin(ctx);
  float *xh = ref_falloc(nx);
  if (c->k == P_MAX && !ties)
    ref_distinct_fill(xh, nx, seed);
  else if (ties)
    ref_gen_fill(xh, nx, seed, &(ref_gen){.lo = -1, .hi = 1, .quant = 0.5f});
  else
    ref_gen_fill(xh, nx, seed, &REF_GEN(-1, 1));
  kiln_tensor *x = ref_upload(ctx, xs, xh);
  ref_set_grad(ctx, x);
  double *xd = ref_to_double(xh, nx), *want = ref_dalloc(no), *dx = ref_dalloc(nx);
  kiln_tensor *y;
  if (c->k == P_MAX) {
    y = kiln_max_pool2d(x, &c->o);
    ref_max_pool2d(xd, xs, &g, want);
  } else {
    y = kiln_avg_pool2d(x, &c->o);
    ref_avg_pool2d(xd, xs, &g, c->o.exclude_pad, want);
  }
  double tol = c->k == P_MAX ? 0 : 1e-5;
  ref_expect_close(ctx, y, os, want, tol, tol, what);
  double *gy = ref_backward_weighted(ctx, y, seed + 1, what);
  if (c->k == P_MAX)
    ref_max_pool2d_backward(xd, xs, &g, gy, dx);
  else
    ref_avg_pool2d_backward(xs, &g, c->o.exclude_pad, gy, dx);
  ref_expect_grad(ctx, x, xs, dx, 1e-5, 1e-5, what, "x");
  if (c->gc && !ties) {
    pool_gc u = {.k = c->k, .o = c->o};
    ref_expect_gradcheck(ctx, what, gc_pool, 1, &x, &u);
  }
  free(xh);
  free(xd);
  free(want);
  free(dx);
  free(gy);
  kiln_tensor_free(x);
  th_assert_ok(ctx);
}

/* check_pool over the cases of kind k, case i seeded seed + 10 i. */
static void check_pools(kiln_ctx *ctx, pkind k, int ties, uint64_t seed) {
  for (size_t i = 0; i < sizeof pool_cases / sizeof *pool_cases; i++)
    if (pool_cases[i].k == k) check_pool(ctx, &pool_cases[i], ties, seed + 10 * i);
}

Test(gpu_ops, max_pool2d) {
  TH_GPU_CTX_EAGER(ctx);
  check_pools(ctx, P_MAX, 0, 3000);
  th_ctx_free(ctx);
}

/* Equal values in a window: the gradient goes to the first of them (rows, then columns), as
 * PyTorch's; overlapping windows add up. */
Test(gpu_ops, max_pool2d_ties_go_to_the_first_maximum) {
  TH_GPU_CTX_EAGER(ctx);
  check_pools(ctx, P_MAX, 1, 3200);
  /* all zeros, as after a ReLU: every window ties everywhere */
  kiln_step_begin(ctx);
  kiln_tensor *x = kiln_tensor_new(ctx, KILN_DTYPE_F32, KILN_SHAPE(1, 4, 4, 2));
  cr_assert_not_null(x, "%s", th_err(ctx));
  ref_set_grad(ctx, x);
  kiln_pool2d_options o = {
      .kernel_h = 3, .kernel_w = 3, .stride_h = 2, .stride_w = 2, .pad_h = 1, .pad_w = 1};
  kiln_tensor *y = kiln_max_pool2d(x, &o);
  cr_assert_eq(kiln_backward(kiln_sum(y, KILN_ALL_AXES, 0)), KILN_OK, "%s", th_err(ctx));
  /* windows start at rows and columns -1 and 1: their first in-image elements are (0,0), (0,1),
   * (1,0) and (1,1) */
  double want[32] = {0};
  for (int ch = 0; ch < 2; ch++) {
    want[(0 * 4 + 0) * 2 + ch] = 1;
    want[(0 * 4 + 1) * 2 + ch] = 1;
    want[(1 * 4 + 0) * 2 + ch] = 1;
    want[(1 * 4 + 1) * 2 + ch] = 1;
  }
  ref_expect_grad(ctx, x, KILN_SHAPE(1, 4, 4, 2), want, 0, 0,
                  "max_pool2d 3x3 stride 2 pad 1 of zeros", "x");
  kiln_tensor_free(x);
  th_ctx_free(ctx);
}

/* ReLU then max pooling whose windows tile the image (stride = kernel, with rows and columns
 * left over or not): the backward pass runs the pooling gradient with the ReLU's derivative as
 * its epilogue, one thread a window; forward and gradient against float64. The ReLU's zeros tie
 * in every window that has no positive value. */
Test(gpu_ops, relu_then_tiling_max_pool2d_fused) {
  TH_GPU_CTX_EAGER(ctx);
  struct {
    kiln_shape x;
    int k;
  } cases[] = {{S4(2, 8, 6, 8), 2}, {S4(2, 7, 5, 8), 2}, {S4(3, 9, 11, 4), 3}, {S4(2, 7, 5, 3), 2}};
  for (size_t ci = 0; ci < sizeof cases / sizeof *cases; ci++) {
    kiln_pool2d_options o = {.kernel_h = cases[ci].k, .kernel_w = cases[ci].k};
    ref_win g = pool_win(&o);
    kiln_shape xs = cases[ci].x, os = ref_win_out(xs, &g, xs.d[3]);
    int64_t nx = ref_numel(xs), no = ref_numel(os);
    char what[160];
    snprintf(what, sizeof what, "relu then max_pool2d %dx%d of [%lld,%lld,%lld,%lld]", cases[ci].k,
             cases[ci].k, (long long)xs.d[0], (long long)xs.d[1], (long long)xs.d[2],
             (long long)xs.d[3]);
    kiln_step_begin(ctx);
    float *xh = ref_falloc(nx);
    ref_distinct_fill(xh, nx, 4000 + ci); /* half of them negative */
    kiln_tensor *x = ref_upload(ctx, xs, xh);
    ref_set_grad(ctx, x);
    double *r = ref_dalloc(nx), *want = ref_dalloc(no), *dr = ref_dalloc(nx);
    for (int64_t i = 0; i < nx; i++)
      r[i] = xh[i] > 0 ? xh[i] : 0;
    kiln_tensor *y = kiln_max_pool2d(kiln_relu(x), &o);
    ref_max_pool2d(r, xs, &g, want);
    ref_expect_close(ctx, y, os, want, 0, 0, what);
    double *gy = ref_backward_weighted(ctx, y, 4100 + ci, what);
    ref_max_pool2d_backward(r, xs, &g, gy, dr);
    for (int64_t i = 0; i < nx; i++)
      dr[i] = xh[i] > 0 ? dr[i] : 0;
    ref_expect_grad(ctx, x, xs, dr, 1e-6, 1e-6, what, "x");
    free(xh);
    free(r);
    free(want);
    free(dr);
    free(gy);
    kiln_tensor_free(x);
    th_assert_ok(ctx);
  }
  th_ctx_free(ctx);
}

/* The gradients of x and w for loss = sum(conv2d(x, w) g), in a context made with
 * KILN_CONV_RECOMPUTE set to `on`, under bf16 autocast or not, two steps (a step graph's capture
 * and replay): the second step's, as f32 (malloc'd). */
static void conv_grads(int on, int bf16, float **dx, float **dw) {
  setenv("KILN_CONV_RECOMPUTE", on ? "1" : "0", 1);
  kiln_ctx *ctx = kiln_ctx_new(NULL);
  unsetenv("KILN_CONV_RECOMPUTE");
  cr_assert(ctx && kiln_ctx_has_gpu(ctx));
  kiln_set_tf32(ctx, 0);
  kiln_shape xs = KILN_SHAPE(8, 13, 11, 32), ws = KILN_SHAPE(96, 32, 3, 3);
  kiln_tensor *x = ref_rand_tensor(ctx, xs, 6100, &REF_GEN(-1, 1), 1, NULL);
  kiln_tensor *w = ref_rand_tensor(ctx, ws, 6101, &REF_GEN(-0.2f, 0.2f), 1, NULL);
  kiln_tensor *g = ref_rand_tensor(ctx, KILN_SHAPE(8, 13, 11, 96), 6102, &REF_GEN(-1, 1), 0, NULL);
  for (int s = 0; s < 2; s++) {
    kiln_tensor_zero_grad(x);
    kiln_tensor_zero_grad(w);
    kiln_step_begin(ctx);
    if (bf16) kiln_autocast_begin(ctx, KILN_DTYPE_BF16);
    kiln_tensor *y = kiln_conv2d(x, w, NULL, &(kiln_conv2d_options){.pad_h = 1, .pad_w = 1});
    if (bf16) kiln_autocast_end(ctx);
    kiln_tensor *loss = kiln_sum(kiln_mul(kiln_cast(y, KILN_DTYPE_F32), g), KILN_ALL_AXES, 0);
    cr_assert_eq(kiln_backward(loss), KILN_OK, "%s", th_err(ctx));
    cr_assert_eq(kiln_step_end(ctx), KILN_OK, "%s", th_err(ctx));
  }
  *dx = ref_read_f32(ctx, kiln_tensor_grad(x), "x's gradient");
  *dw = ref_read_f32(ctx, kiln_tensor_grad(w), "w's gradient");
  kiln_tensor_free(x);
  kiln_tensor_free(w);
  kiln_tensor_free(g);
  th_ctx_free(ctx);
}

/* KILN_CONV_RECOMPUTE=1: a convolution of 96 output channels (its products on the BLAS library)
 * gathers its columns again for the weight gradient; both gradients equal those from the forward
 * pass's columns bit for bit, in f32 and in bf16. */
Test(gpu_ops, conv2d_recomputed_columns_give_the_same_gradients) {
  TH_GPU_CTX(probe); /* skips without a GPU */
  th_ctx_free(probe);
  for (int bf16 = 0; bf16 < 2; bf16++) {
    float *dx[2], *dw[2];
    for (int on = 0; on < 2; on++)
      conv_grads(on, bf16, &dx[on], &dw[on]);
    cr_assert(memcmp(dx[0], dx[1], 8 * 13 * 11 * 32 * sizeof(float)) == 0,
              "%s: x's gradient differs with recomputed columns", bf16 ? "bf16" : "f32");
    cr_assert(memcmp(dw[0], dw[1], 96 * 32 * 3 * 3 * sizeof(float)) == 0,
              "%s: w's gradient differs with recomputed columns", bf16 ? "bf16" : "f32");
    for (int on = 0; on < 2; on++) {
      free(dx[on]);
      free(dw[on]);
    }
  }
}

/* One step of y = max_pool(x) in dt and loss = sum(y g), twice (a step graph's capture, then its
 * replay): y's values and x's gradient after the second, as f32 (malloc'd). Fusion on records
 * the pool with its windows' positions behind y's values and the gradient reads them; off, the
 * gradient searches x's windows again. */
static void pool_twice(kiln_ctx *ctx, kiln_tensor *x, kiln_tensor *g, const kiln_pool2d_options *o,
                       kiln_dtype dt, int fuse, float **y, float **dx, const char *what) {
  kiln_set_fusion(ctx, fuse);
  /* y kept by an assignment: a step graph's plan gives a consumed value's memory away */
  kiln_tensor *yk = kiln_tensor_new(ctx, KILN_DTYPE_F32, kiln_tensor_shape(g));
  cr_assert_not_null(yk, "%s: %s", what, th_err(ctx));
  for (int s = 0; s < 2; s++) {
    kiln_tensor_zero_grad(x);
    kiln_step_begin(ctx);
    kiln_tensor *p = kiln_max_pool2d(dt == KILN_DTYPE_F32 ? x : kiln_cast(x, dt), o);
    kiln_tensor *pf = dt == KILN_DTYPE_F32 ? p : kiln_cast(p, KILN_DTYPE_F32);
    cr_assert_not_null(pf, "%s: %s", what, th_err(ctx));
    cr_assert_eq(kiln_assign(yk, pf), KILN_OK, "%s: %s", what, th_err(ctx));
    cr_assert_eq(kiln_backward(kiln_sum(kiln_mul(pf, g), KILN_ALL_AXES, 0)), KILN_OK, "%s: %s",
                 what, th_err(ctx));
    cr_assert_eq(kiln_step_end(ctx), KILN_OK, "%s: %s", what, th_err(ctx));
  }
  *y = ref_read_f32(ctx, yk, what);
  *dx = ref_read_f32(ctx, kiln_tensor_grad(x), what);
  kiln_tensor_free(yk);
}

/* n values (malloc'd) of four levels, so that most windows tie, and some NaN and -infinity. */
static float *tied_values(int64_t n, uint64_t seed) {
  float *v = ref_falloc(n);
  ref_gen_fill(v, n, seed, &(ref_gen){.lo = -1, .hi = 1, .quant = 0.5f});
  for (int64_t i = 0; i < n; i += 37)
    v[i] = NAN;
  for (int64_t i = 5; i < n; i += 41)
    v[i] = -INFINITY;
  return v;
}

/* Max pooling's gradient from the positions its forward pass wrote agrees bit for bit with the
 * gradient that searches the input's windows again (the unfused reference): ties, NaN and
 * -infinity in the windows, overlapping, padded and dilated windows, rows left over, four lanes
 * and one, f32 and bf16, eager and replayed from a step graph. */
Test(gpu_ops, max_pool2d_positions_match_the_search_bitwise) {
  TH_GPU_CTX(ctx);
  struct {
    kiln_shape x;
    kiln_pool2d_options o;
    kiln_dtype dt;
  } cases[] = {
      {S4(4, 16, 16, 64), PO(.kernel_h = 2, .kernel_w = 2), KILN_DTYPE_BF16},
      {S4(3, 7, 9, 8), PO(.kernel_h = 2, .kernel_w = 2), KILN_DTYPE_BF16},
      {S4(2, 9, 11, 3),
       PO(.kernel_h = 3, .kernel_w = 3, .stride_h = 2, .stride_w = 2, .pad_h = 1, .pad_w = 1),
       KILN_DTYPE_F32},
      {S4(2, 9, 11, 4),
       PO(.kernel_h = 3, .kernel_w = 3, .pad_h = 1, .pad_w = 1, .dilation_h = 2, .dilation_w = 2),
       KILN_DTYPE_BF16},
      {S4(2, 8, 8, 5), PO(.kernel_h = 3, .kernel_w = 3, .stride_h = 2, .stride_w = 2),
       KILN_DTYPE_F32},
  };
  for (size_t ci = 0; ci < sizeof cases / sizeof *cases; ci++) {
    kiln_shape xs = cases[ci].x;
    int64_t nx = ref_numel(xs);
    float *xh = tied_values(nx, 5000 + ci);
    kiln_tensor *x = ref_upload(ctx, xs, xh);
    ref_set_grad(ctx, x);
    ref_win gw = pool_win(&cases[ci].o);
    kiln_shape os = ref_win_out(xs, &gw, xs.d[3]);
    kiln_tensor *g = ref_rand_tensor(ctx, os, 5100 + ci, &REF_GEN(-1, 1), 0, NULL);
    for (int graphs = 0; graphs < 2; graphs++) {
      kiln_set_graphs(ctx, graphs);
      char what[160];
      snprintf(what, sizeof what, "max_pool2d case %zu (%s, [%lld,%lld,%lld,%lld]), graphs %d", ci,
               kiln_dtype_name(cases[ci].dt), (long long)xs.d[0], (long long)xs.d[1],
               (long long)xs.d[2], (long long)xs.d[3], graphs);
      float *y[2], *dx[2];
      for (int fuse = 0; fuse < 2; fuse++)
        pool_twice(ctx, x, g, &cases[ci].o, cases[ci].dt, fuse, &y[fuse], &dx[fuse], what);
      cr_assert(memcmp(y[0], y[1], (size_t)ref_numel(os) * sizeof(float)) == 0,
                "%s: the pooled values differ with positions", what);
      for (int64_t i = 0; i < nx; i++)
        cr_assert(memcmp(&dx[0][i], &dx[1][i], sizeof(float)) == 0,
                  "%s: the gradient at %lld is %.9g from the search, %.9g from the positions", what,
                  (long long)i, dx[0][i], dx[1][i]);
      for (int fuse = 0; fuse < 2; fuse++) {
        free(y[fuse]);
        free(dx[fuse]);
      }
    }
    kiln_set_fusion(ctx, 1);
    free(xh);
    kiln_tensor_free(x);
    kiln_tensor_free(g);
    th_assert_ok(ctx);
  }
  th_ctx_free(ctx);
}

/* KILN_POOL_GRAD_BLOCKS (on by default): max pooling's gradient over overlapping windows at stride
 * 2, a block of 2 x 2 pixels a thread (window.cuh's kiln_max_pool_grad_blocks_from). Against
 * float64 (with and without ties; finite differences on the small cases), then bit for bit against
 * the gradient a pixel a thread: ties, NaN and -infinity in the windows, padded windows and
 * unpadded ones that leave a row uncovered, four lanes and one, f32 and bf16, fused (positions) and
 * unfused (search), eager and replayed from a step graph. */
Test(gpu_ops, max_pool2d_gradient_a_block_of_pixels_a_thread) {
  static const pool_case cases[] = {
      {"max 3x3 stride 2 pad 1 (ResNet's stem pool)", P_MAX, S4(2, 12, 10, 64),
       PO(.kernel_h = 3, .kernel_w = 3, .stride_h = 2, .stride_w = 2, .pad_h = 1, .pad_w = 1), 0},
      {"max 3x3 stride 2 pad 1 of 3 channels", P_MAX, S4(2, 6, 8, 3),
       PO(.kernel_h = 3, .kernel_w = 3, .stride_h = 2, .stride_w = 2, .pad_h = 1, .pad_w = 1), 1},
      {"max 2x2 stride 2 pad 1", P_MAX, S4(2, 8, 6, 4),
       PO(.kernel_h = 2, .kernel_w = 2, .stride_h = 2, .stride_w = 2, .pad_h = 1, .pad_w = 1), 1},
      {"max 3x3 stride 2 (a row and a column uncovered)", P_MAX, S4(3, 10, 12, 8),
       PO(.kernel_h = 3, .kernel_w = 3, .stride_h = 2, .stride_w = 2), 1},
      {"max 3x3 stride (2,1) pad 1", P_MAX, S4(2, 8, 7, 4),
       PO(.kernel_h = 3, .kernel_w = 3, .stride_h = 2, .stride_w = 1, .pad_h = 1, .pad_w = 1), 1},
  };
  const size_t nc = sizeof cases / sizeof *cases;
  setenv("KILN_POOL_GRAD_BLOCKS", "1", 1); /* read when the context is made */
  TH_GPU_CTX_EAGER(ctx);
  unsetenv("KILN_POOL_GRAD_BLOCKS");
  for (size_t i = 0; i < nc; i++)
    for (int ties = 0; ties < 2; ties++)
      check_pool(ctx, &cases[i], ties, 7000 + 10 * i + ties);
  th_ctx_free(ctx);

  for (size_t ci = 0; ci < nc; ci++) {
    kiln_shape xs = cases[ci].x;
    int64_t nx = ref_numel(xs);
    ref_win gw = pool_win(&cases[ci].o);
    kiln_shape os = ref_win_out(xs, &gw, xs.d[3]);
    float *xh = tied_values(nx, 7200 + ci);
    float *dx[2][2][2][2]; /* [blocks][bf16][graphs][fuse] */
    for (int blocks = 0; blocks < 2; blocks++) {
      setenv("KILN_POOL_GRAD_BLOCKS", blocks ? "1" : "0", 1);
      kiln_ctx *bc = kiln_ctx_new(NULL);
      unsetenv("KILN_POOL_GRAD_BLOCKS");
      cr_assert(bc && kiln_ctx_has_gpu(bc));
      kiln_tensor *x = ref_upload(bc, xs, xh);
      ref_set_grad(bc, x);
      kiln_tensor *g = ref_rand_tensor(bc, os, 7300 + ci, &REF_GEN(-1, 1), 0, NULL);
      for (int bf16 = 0; bf16 < 2; bf16++)
        for (int graphs = 0; graphs < 2; graphs++) {
          kiln_set_graphs(bc, graphs);
          for (int fuse = 0; fuse < 2; fuse++) {
            float *y;
            pool_twice(bc, x, g, &cases[ci].o, bf16 ? KILN_DTYPE_BF16 : KILN_DTYPE_F32, fuse, &y,
                       &dx[blocks][bf16][graphs][fuse], cases[ci].desc);
            free(y);
          }
        }
      kiln_tensor_free(x);
      kiln_tensor_free(g);
      th_ctx_free(bc);
    }
    for (int bf16 = 0; bf16 < 2; bf16++)
      for (int graphs = 0; graphs < 2; graphs++)
        for (int fuse = 0; fuse < 2; fuse++) {
          const float *a = dx[0][bf16][graphs][fuse], *b = dx[1][bf16][graphs][fuse];
          for (int64_t i = 0; i < nx; i++)
            cr_assert(memcmp(&a[i], &b[i], sizeof(float)) == 0,
                      "%s, %s, graphs %d, fusion %d: the gradient at %lld is %.9g a pixel a "
                      "thread, %.9g a block a thread",
                      cases[ci].desc, bf16 ? "bf16" : "f32", graphs, fuse, (long long)i, a[i],
                      b[i]);
          free(dx[0][bf16][graphs][fuse]);
          free(dx[1][bf16][graphs][fuse]);
        }
    free(xh);
  }
}

Test(gpu_ops, avg_pool2d) {
  TH_GPU_CTX_EAGER(ctx);
  check_pools(ctx, P_AVG, 0, 3400);
  th_ctx_free(ctx);
}

/* A pooled view: the image transposed (H and W swapped) before pooling. */
Test(gpu_ops, max_pool2d_of_a_view) {
  TH_GPU_CTX_EAGER(ctx);
  float xh[2 * 5 * 7 * 3];
  ref_distinct_fill(xh, 2 * 5 * 7 * 3, 3600);
  kiln_tensor *base = ref_upload(ctx, KILN_SHAPE(2, 5, 7, 3), xh); /* (N, W, H, C) */
  kiln_shape xs = KILN_SHAPE(2, 7, 5, 3);
  double xd[2 * 7 * 5 * 3];
  for (int64_t n = 0; n < 2; n++)
    for (int64_t r = 0; r < 7; r++)
      for (int64_t c = 0; c < 5; c++)
        for (int64_t ch = 0; ch < 3; ch++)
          xd[((n * 7 + r) * 5 + c) * 3 + ch] = xh[((n * 5 + c) * 7 + r) * 3 + ch];
  kiln_pool2d_options o = {
      .kernel_h = 3, .kernel_w = 3, .stride_h = 2, .stride_w = 2, .pad_h = 1, .pad_w = 1};
  ref_win g = pool_win(&o);
  kiln_shape os = ref_win_out(xs, &g, 3);
  double want[2 * 4 * 3 * 3];
  cr_assert_eq(ref_numel(os), 2 * 4 * 3 * 3);
  ref_max_pool2d(xd, xs, &g, want);
  kiln_step_begin(ctx);
  ref_expect_close(ctx, kiln_max_pool2d(kiln_transpose(base, 1, 2), &o), os, want, 0, 0,
                   "max_pool2d 3x3 stride 2 pad 1 of a transposed (N, W, H, C) image");
  kiln_tensor_free(base);
  th_ctx_free(ctx);
}

/* ---------------------------------------------------------------- global pooling */

typedef struct gpool_gc {
  int max;
} gpool_gc;

static kiln_tensor *gc_gpool(kiln_tensor *const *in, void *user) {
  const gpool_gc *u = user;
  return u->max ? kiln_global_max_pool2d(in[0]) : kiln_global_avg_pool2d(in[0]);
}

static void check_gpool(kiln_ctx *ctx, kiln_shape xs, int max, int gc, uint64_t seed) {
  int64_t nx = ref_numel(xs);
  kiln_shape os = KILN_SHAPE(xs.d[0], xs.d[3]);
  char what[512];
  snprintf(what, sizeof what, "global_%s_pool2d of [%lld,%lld,%lld,%lld]", max ? "max" : "avg",
           (long long)xs.d[0], (long long)xs.d[1], (long long)xs.d[2], (long long)xs.d[3]);
  kiln_step_begin(ctx);
  float *xh = ref_falloc(nx);
  if (max)
    ref_distinct_fill(xh, nx, seed);
  else
    ref_gen_fill(xh, nx, seed, &REF_GEN(-1, 1));
  kiln_tensor *x = ref_upload(ctx, xs, xh);
  ref_set_grad(ctx, x);
  double *xd = ref_to_double(xh, nx), *want = ref_dalloc(ref_numel(os)), *dx = ref_dalloc(nx);
  ref_global_pool(xd, xs, max, want);
  kiln_tensor *y = max ? kiln_global_max_pool2d(x) : kiln_global_avg_pool2d(x);
  ref_expect_close(ctx, y, os, want, max ? 0 : 1e-5, max ? 0 : 1e-5, what);
  double *gy = ref_backward_weighted(ctx, y, seed + 1, what);
  ref_global_pool_backward(xd, xs, max, gy, dx);
  ref_expect_grad(ctx, x, xs, dx, 1e-6, 1e-5, what, "x");
  if (gc) {
    gpool_gc u = {.max = max};
    ref_expect_gradcheck(ctx, what, gc_gpool, 1, &x, &u);
  }
  free(xh);
  free(xd);
  free(want);
  free(dx);
  free(gy);
  kiln_tensor_free(x);
}

Test(gpu_ops, global_pool2d) {
  TH_GPU_CTX_EAGER(ctx);
  for (int max = 0; max < 2; max++) {
    uint64_t seed = 3700 + 100 * (uint64_t)max;
    check_gpool(ctx, KILN_SHAPE(2, 7, 5, 6), max, 1, seed);
    check_gpool(ctx, KILN_SHAPE(1, 1, 1, 3), max, 1, seed + 10);
    check_gpool(ctx, KILN_SHAPE(3, 2, 3, 5), max, 1, seed + 20);
    check_gpool(ctx, KILN_SHAPE(4, 16, 16, 64), max, 0, seed + 30);
    check_gpool(ctx, KILN_SHAPE(2, 9, 9, 130), max, 0, seed + 40);
    check_gpool(ctx, KILN_SHAPE(2, 33, 31, 3), max, 0, seed + 50);
  }
  th_ctx_free(ctx);
}

/* ---------------------------------------------------------------- flatten */

static kiln_tensor *gc_flatten(kiln_tensor *const *in, void *user) {
  (void)user;
  return kiln_flatten(in[0]);
}

/* A 4-D image flattens in PyTorch's (C, H, W) order, its gradient back to (H, W, C); other ranks
 * keep their row-major order. */
Test(gpu_ops, flatten) {
  TH_GPU_CTX_EAGER(ctx);
  kiln_shape xs = KILN_SHAPE(2, 3, 4, 5);
  float *xh;
  kiln_tensor *x = ref_rand_tensor(ctx, xs, 3900, &REF_GEN(-1, 1), 1, &xh);
  double *xd = ref_to_double(xh, 120), want[120], dx[120];
  ref_flatten_nhwc(xd, xs, want);
  kiln_step_begin(ctx);
  kiln_tensor *y = kiln_flatten(x);
  const char *what = "flatten of an (N, H, W, C) [2,3,4,5] image";
  ref_expect_close(ctx, y, KILN_SHAPE(2, 60), want, 0, 0, what);
  double *gy = ref_backward_weighted(ctx, y, 3901, what);
  for (int64_t n = 0; n < 2; n++)
    for (int64_t r = 0; r < 3; r++)
      for (int64_t c = 0; c < 4; c++)
        for (int64_t ch = 0; ch < 5; ch++)
          dx[((n * 3 + r) * 4 + c) * 5 + ch] = gy[n * 60 + (ch * 3 + r) * 4 + c];
  ref_expect_grad(ctx, x, xs, dx, 0, 0, what, "x");
  ref_expect_gradcheck(ctx, what, gc_flatten, 1, &x, NULL);
  /* a sliced image: the view's elements in (C, H, W) order */
  kiln_step_begin(ctx);
  kiln_tensor *v = kiln_slice(x, 2, 1, 4, 2); /* (2, 3, 2, 5): columns 1 and 3 */
  double wv[60];
  for (int64_t n = 0; n < 2; n++)
    for (int64_t ch = 0; ch < 5; ch++)
      for (int64_t r = 0; r < 3; r++)
        for (int64_t c = 0; c < 2; c++)
          wv[n * 30 + (ch * 3 + r) * 2 + c] = xd[((n * 3 + r) * 4 + 2 * c + 1) * 5 + ch];
  ref_expect_close(ctx, kiln_flatten(v), KILN_SHAPE(2, 30), wv, 0, 0,
                   "flatten of a [2,3,2,5] slice (columns 1::2)");
  /* other ranks: row-major */
  kiln_step_begin(ctx);
  ref_expect_close(ctx, kiln_flatten(kiln_reshape(x, KILN_SHAPE(2, 60))), KILN_SHAPE(2, 60), xd, 0,
                   0, "flatten of [2,60]");
  ref_expect_close(ctx, kiln_flatten(kiln_reshape(x, KILN_SHAPE(2, 12, 5))), KILN_SHAPE(2, 60), xd,
                   0, 0, "flatten of [2,12,5]");
  ref_expect_close(ctx, kiln_flatten(kiln_reshape(x, KILN_SHAPE(2, 3, 2, 2, 5))), KILN_SHAPE(2, 60),
                   xd, 0, 0, "flatten of [2,3,2,2,5]");
  free(xh);
  free(xd);
  free(gy);
  kiln_tensor_free(x);
  th_ctx_free(ctx);
}
