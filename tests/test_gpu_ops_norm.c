/*
 * test_gpu_ops_norm.c: batch and layer normalisation on the GPU against the float64 references
 * of ref_conv.h: batch norm in training (the batch's statistics, and the running statistics
 * after one and three calls with momenta 0.1 and 0.3) and in evaluation (the running
 * statistics, which then stay), with and without affine parameters and running statistics, on
 * (N, H, W, C) and (N, C) inputs, a constant channel; layer norm over the last axis, with and
 * without affine parameters, narrow and wide rows, a viewed input; a momentum or eps of 0
 * (PyTorch's default) and KILN_ZERO (an exact 0) in both; batch norm's sums shifted by the input's
 * first row instead of the running mean, and summed in a pass of their own instead of a
 * convolution's kernel (KILN_CONV_FPROP_MOMENTS=0). Gradients of x, weight and
 * bias are checked against the analytic float64 gradients and against central finite differences
 * (kiln_gradcheck). Without a GPU every test skips, saying why.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ref_conv.h"

#define FWD_TOL 1e-4
#define GRAD_ATOL 5e-4
#define GRAD_RTOL 1e-4

/* Asserts the gradient of t (shape s) against want, within this file's tolerances. */
static void expect_grad(kiln_ctx *ctx, kiln_tensor *t, kiln_shape s, const double *want,
                        const char *what, const char *which) {
  ref_expect_grad(ctx, t, s, want, GRAD_ATOL, GRAD_RTOL, what, which);
}

/* ---------------------------------------------------------------- batch norm */

/* shapes as brace lists, so that the tables below are constant initializers */
#define S2(d0, d1)                                                                                 \
  {                                                                                                \
    .ndim = 2, .d = { d0, d1 }                                                                     \
  }
#define S3(d0, d1, d2)                                                                             \
  {                                                                                                \
    .ndim = 3, .d = { d0, d1, d2 }                                                                 \
  }
#define S4(d0, d1, d2, d3)                                                                         \
  {                                                                                                \
    .ndim = 4, .d = { d0, d1, d2, d3 }                                                             \
  }

typedef struct bn_case {
  const char *desc;
  kiln_shape x;
  int affine, running, training;
  float momentum, eps;
  int calls; /* forward calls, each on a new x: the running statistics accumulate */
  int gc;    /* also check against finite differences */
} bn_case;

static const bn_case bn_cases[] = {
    {"training, affine, running statistics, momentum 0.1", S4(2, 5, 3, 6), 1, 1, 1, 0.1f, 1e-5f, 1,
     1},
    {"training, affine, momentum 0.3, three calls", S4(4, 3, 3, 5), 1, 1, 1, 0.3f, 1e-5f, 3, 0},
    {"evaluation with running statistics", S4(2, 5, 3, 6), 1, 1, 0, 0.1f, 1e-5f, 2, 1},
    {"training, no affine, running statistics", S4(2, 5, 3, 6), 0, 1, 1, 0.1f, 1e-5f, 1, 1},
    {"evaluation, no affine", S4(2, 3, 3, 5), 0, 1, 0, 0.1f, 1e-5f, 1, 1},
    {"(N, C) training, momentum 0.3, three calls", S2(8, 5), 1, 1, 1, 0.3f, 1e-5f, 3, 1},
    {"(N, C) evaluation", S2(8, 5), 1, 1, 0, 0.1f, 1e-5f, 1, 1},
    {"training without running statistics", S4(2, 3, 3, 4), 1, 0, 1, 0.1f, 1e-5f, 1, 1},
    {"evaluation without running statistics (the batch's)", S4(2, 3, 3, 4), 1, 0, 0, 0.1f, 1e-5f, 1,
     1},
    {"training, eps 1e-3", S4(4, 3, 3, 5), 1, 1, 1, 0.1f, 1e-3f, 1, 0},
    {"training, 64 channels of 1024 values", S4(16, 8, 8, 64), 1, 1, 1, 0.1f, 1e-5f, 2, 0},
    {"(N, C) training, 300 channels", S2(128, 300), 1, 1, 1, 0.1f, 1e-5f, 1, 0},
};

typedef struct bn_gc {
  int affine, training;
  kiln_tensor *rm, *rv;
  float momentum, eps;
} bn_gc;

static kiln_tensor *gc_bn(kiln_tensor *const *in, void *user) {
  const bn_gc *u = user;
  return kiln_batch_norm(in[0], u->affine ? in[1] : NULL, u->affine ? in[2] : NULL, u->rm, u->rv,
                         u->training, u->momentum, u->eps);
}

static void check_bn(kiln_ctx *ctx, const bn_case *c, uint64_t seed) {
  kiln_shape xs = c->x, cs = KILN_SHAPE(xs.d[xs.ndim - 1]);
  int64_t nx = ref_numel(xs), C = cs.d[0], M = nx / C;
  char what[1024], sh[96];
  snprintf(what, sizeof what, "batch_norm %s of %s", c->desc, kiln_shape_str(xs, sh, sizeof sh));
  float *wh = NULL, *bh = NULL, *rmh = NULL, *rvh = NULL;
  kiln_tensor *w = NULL, *b = NULL, *rm = NULL, *rv = NULL;
  if (c->affine) {
    w = ref_rand_tensor(ctx, cs, seed, &REF_GEN(0.5f, 1.5f), 1, &wh);
    b = ref_rand_tensor(ctx, cs, seed + 1, &REF_GEN(-1, 1), 1, &bh);
  }
  if (c->running) {
    rm = ref_rand_tensor(ctx, cs, seed + 2, &REF_GEN(-0.5f, 0.5f), 0, &rmh);
    rv = ref_rand_tensor(ctx, cs, seed + 3, &REF_GEN(0.5f, 2), 0, &rvh);
    cr_assert(!kiln_tensor_requires_grad(rm) && !kiln_tensor_requires_grad(rv));
  }
  double *wd = wh ? ref_to_double(wh, C) : NULL, *bd = bh ? ref_to_double(bh, C) : NULL;
  double *rmd = rmh ? ref_to_double(rmh, C) : NULL, *rvd = rvh ? ref_to_double(rvh, C) : NULL;
  double *rm0 = ref_dalloc(C), *rv0 = ref_dalloc(C);
  double *want = ref_dalloc(nx), *dx = ref_dalloc(nx), *dw = ref_dalloc(C), *db = ref_dalloc(C);
  kiln_tensor *x = NULL;
  for (int call = 0; call < c->calls; call++) {
    char wc[1100];
    snprintf(wc, sizeof wc, "%s, call %d", what, call + 1);
    kiln_step_begin(ctx);
    float *xh;
    kiln_tensor_free(x);
    x = ref_rand_tensor(ctx, xs, seed + 10 + (uint64_t)call, &REF_GEN(-1, 3), 1, &xh);
    double *xd = ref_to_double(xh, nx);
    if (rmd) { /* the statistics this call reads, before it updates them */
      memcpy(rm0, rmd, (size_t)C * sizeof *rm0);
      memcpy(rv0, rvd, (size_t)C * sizeof *rv0);
    }
    ref_batch_norm(xd, M, C, wd, bd, rmd, rvd, c->training, c->momentum, c->eps, want);
    if (w) {
      kiln_tensor_zero_grad(w);
      kiln_tensor_zero_grad(b);
    }
    kiln_tensor *y = kiln_batch_norm(x, w, b, rm, rv, c->training, c->momentum, c->eps);
    ref_expect_close(ctx, y, xs, want, FWD_TOL, FWD_TOL, wc);
    double *gy = ref_backward_weighted(ctx, y, seed + 20 + (uint64_t)call, wc);
    ref_batch_norm_backward(xd, M, C, wd, rmd ? rm0 : NULL, rvd ? rv0 : NULL, c->training, c->eps,
                            gy, dx, dw, db);
    expect_grad(ctx, x, xs, dx, wc, "x");
    if (w) {
      expect_grad(ctx, w, cs, dw, wc, "the weight");
      expect_grad(ctx, b, cs, db, wc, "the bias");
    }
    if (rm) {
      char wr[1200];
      snprintf(wr, sizeof wr, "%s: running mean", wc);
      ref_expect_close(ctx, rm, cs, rmd, 1e-5, 1e-5, wr);
      snprintf(wr, sizeof wr, "%s: running variance (unbiased)", wc);
      ref_expect_close(ctx, rv, cs, rvd, 1e-5, 1e-5, wr);
      cr_assert_null(kiln_tensor_grad(rm), "%s: the running mean got a gradient", wc);
      cr_assert_null(kiln_tensor_grad(rv), "%s: the running variance got a gradient", wc);
    }
    free(xh);
    free(xd);
    free(gy);
  }
  if (c->gc) {
    /* finite differences read the function again and again: the running statistics it may
     * update do not enter the batch's output */
    bn_gc u = {.affine = c->affine,
               .training = c->training,
               .rm = rm,
               .rv = rv,
               .momentum = c->momentum,
               .eps = c->eps};
    kiln_tensor *in[3] = {x, w, b};
    ref_expect_gradcheck(ctx, what, gc_bn, c->affine ? 3 : 1, in, &u);
  }
  kiln_tensor_free(x);
  kiln_tensor_free(w);
  kiln_tensor_free(b);
  kiln_tensor_free(rm);
  kiln_tensor_free(rv);
  free(wh);
  free(bh);
  free(rmh);
  free(rvh);
  free(wd);
  free(bd);
  free(rmd);
  free(rvd);
  free(rm0);
  free(rv0);
  free(want);
  free(dx);
  free(dw);
  free(db);
  th_assert_ok(ctx);
}

Test(gpu_ops, batch_norm_training) {
  TH_GPU_CTX_EAGER(ctx);
  for (size_t i = 0; i < sizeof bn_cases / sizeof *bn_cases; i++)
    if (bn_cases[i].training) check_bn(ctx, &bn_cases[i], 4000 + 100 * i);
  th_ctx_free(ctx);
}

/* An activation after a batch norm in training: its gradient recomputes the norm's output from
 * the values the norm's gradient keeps (never written in the forward pass): GELU, SiLU, ReLU, and
 * ReLU then a 2x2 max pool (whose gradient reads its windows' positions, the ReLU's output gone
 * after the pool). The output, and the gradients of x, the weight and the bias, against float64,
 * fused and unfused (the recomputation then a kernel of its own), with and without step graphs
 * (the output checked without). x's values are 0.1 apart: no two in a window are close. */
Test(gpu_ops, activation_after_batch_norm_from_a_recomputed_input) {
  TH_GPU_CTX(ctx);
  kiln_shape xs = KILN_SHAPE(8, 6, 4, 12), cs = KILN_SHAPE(12), ps = KILN_SHAPE(8, 3, 2, 12);
  int64_t nx = ref_numel(xs), np = ref_numel(ps), C = 12, M = nx / C;
  float *xh = ref_falloc(nx), *wh, *bh;
  ref_distinct_fill(xh, nx, 7000);
  kiln_tensor *x = ref_upload(ctx, xs, xh);
  ref_set_grad(ctx, x);
  kiln_tensor *w = ref_rand_tensor(ctx, cs, 7001, &REF_GEN(0.5f, 1.5f), 1, &wh);
  kiln_tensor *b = ref_rand_tensor(ctx, cs, 7002, &REF_GEN(-1, 1), 1, &bh);
  double *xd = ref_to_double(xh, nx), *wd = ref_to_double(wh, C), *bd = ref_to_double(bh, C);
  double *y = ref_dalloc(nx), *z = ref_dalloc(nx), *gz = ref_dalloc(nx), *gy = ref_dalloc(nx),
         *dx = ref_dalloc(nx), *dw = ref_dalloc(C), *db = ref_dalloc(C), *zp = ref_dalloc(np);
  ref_batch_norm(xd, M, C, wd, bd, NULL, NULL, 1, 0.1, 1e-5, y);
  kiln_pool2d_options po = {.kernel_h = 2, .kernel_w = 2};
  ref_win pw = {.kh = 2, .kw = 2, .sh = 2, .sw = 2, .dh = 1, .dw = 1, .groups = 1};
  const char *names[4] = {"GELU", "SiLU", "ReLU", "ReLU then a 2x2 max pool"};
  for (int act = 0; act < 4; act++)
    for (int mode = 0; mode < 4; mode++) { /* fused or not, graphs or not */
      int fuse = mode & 1, graphs = mode >> 1, pool = act == 3;
      char what[160];
      snprintf(what, sizeof what, "batch norm then %s, fusion %d, graphs %d", names[act], fuse,
               graphs);
      kiln_set_fusion(ctx, fuse);
      kiln_set_graphs(ctx, graphs);
      kiln_tensor_zero_grad(x);
      kiln_tensor_zero_grad(w);
      kiln_tensor_zero_grad(b);
      kiln_step_begin(ctx);
      kiln_tensor *n = kiln_batch_norm(x, w, b, NULL, NULL, 1, 0.1f, 1e-5f);
      kiln_tensor *out = act == 0   ? kiln_gelu(n, KILN_GELU_ERF)
                         : act == 1 ? kiln_silu(n)
                                    : kiln_relu(n);
      if (pool) out = kiln_max_pool2d(out, &po);
      float *gh;
      kiln_tensor *g = ref_rand_tensor(ctx, pool ? ps : xs, 7003, &REF_GEN(-1, 1), 0, &gh);
      cr_assert_eq(kiln_backward(kiln_sum(kiln_mul(out, g), KILN_ALL_AXES, 0)), KILN_OK, "%s: %s",
                   what, th_err(ctx));
      cr_assert_eq(kiln_step_end(ctx), KILN_OK, "%s: %s", what, th_err(ctx));
      double *d = ref_dalloc(nx); /* the activation's derivative at y */
      for (int64_t i = 0; i < nx; i++) {
        double v = y[i];
        if (act == 1) {
          double sg = 1 / (1 + exp(-v));
          z[i] = v * sg;
          d[i] = sg * (1 + v * (1 - sg));
        } else if (act == 0) {
          double cdf = 0.5 * erfc(-v / sqrt(2.0));
          z[i] = v * cdf;
          d[i] = cdf + v * exp(-0.5 * v * v) / sqrt(2 * M_PI);
        } else {
          z[i] = v > 0 ? v : 0;
          d[i] = v > 0 ? 1 : 0;
        }
      }
      if (pool) { /* the pool's gradient to the ReLU's output, then through the ReLU */
        double *gp = ref_to_double(gh, np);
        ref_max_pool2d(z, xs, &pw, zp);
        ref_max_pool2d_backward(z, xs, &pw, gp, gz);
        free(gp);
      } else {
        for (int64_t i = 0; i < nx; i++)
          gz[i] = gh[i];
      }
      for (int64_t i = 0; i < nx; i++)
        gy[i] = gz[i] * d[i];
      ref_batch_norm_backward(xd, M, C, wd, NULL, NULL, 1, 1e-5, gy, dx, dw, db);
      if (!graphs) /* a step graph's intermediates may share memory with later ones */
        ref_expect_close(ctx, out, pool ? ps : xs, pool ? zp : z, FWD_TOL, FWD_TOL, what);
      expect_grad(ctx, x, xs, dx, what, "x");
      expect_grad(ctx, w, cs, dw, what, "the weight");
      expect_grad(ctx, b, cs, db, what, "the bias");
      free(d);
      free(gh);
      kiln_tensor_free(g);
    }
  kiln_set_fusion(ctx, 1);
  kiln_tensor_free(x);
  kiln_tensor_free(w);
  kiln_tensor_free(b);
  double *all[] = {xd, wd, bd, y, z, gz, gy, dx, dw, db, zp};
  for (size_t k = 0; k < sizeof all / sizeof *all; k++)
    free(all[k]);
  free(xh);
  free(wh);
  free(bh);
  th_ctx_free(ctx);
}

/* Batch norm in fused steps (training, running statistics, affine), its partial sums summed as
 * the rows of a row program that also computes the per-channel values and writes the running
 * statistics and the weight's and bias's gradients (KILN_BN_ROWS=1), or as one column sum with the
 * values in a kernel of their own (without it); without step graphs, then with them (two
 * steps: the second replays). The output, the running statistics after each step and the
 * gradients of x, the weight and the bias against float64; 3 and 32 partial sums a channel, and
 * without affine parameters (the scale of dx then invstd times a (1, 1) one). */
Test(gpu_ops, batch_norm_sums_as_rows_in_fused_steps) {
  const kiln_shape shapes[3] = {KILN_SHAPE(8, 6, 6, 16), KILN_SHAPE(16, 16, 16, 64),
                                KILN_SHAPE(8, 6, 6, 16)};
  for (int rows = 1; rows >= 0; rows--)
    for (int s = 0; s < 3; s++) /* the third without affine parameters */
      for (int graphs = 0; graphs < 2; graphs++) {
        setenv("KILN_BN_ROWS", rows ? "1" : "0", 1); /* read when the context is made */
        TH_GPU_CTX(ctx);
        unsetenv("KILN_BN_ROWS");
        kiln_set_graphs(ctx, graphs);
        bool affine = s < 2;
        kiln_shape xs = shapes[s], cs = KILN_SHAPE(xs.d[3]);
        int64_t nx = ref_numel(xs), C = cs.d[0], M = nx / C;
        uint64_t seed = 6100 + 10 * (uint64_t)s;
        float *xh, *wh = NULL, *bh = NULL, *rmh, *rvh, *gh;
        kiln_tensor *x = ref_rand_tensor(ctx, xs, seed, &REF_GEN(-1, 3), 1, &xh);
        kiln_tensor *w =
            affine ? ref_rand_tensor(ctx, cs, seed + 1, &REF_GEN(0.5f, 1.5f), 1, &wh) : NULL;
        kiln_tensor *b =
            affine ? ref_rand_tensor(ctx, cs, seed + 2, &REF_GEN(-1, 1), 1, &bh) : NULL;
        kiln_tensor *rm = ref_rand_tensor(ctx, cs, seed + 3, &REF_GEN(-0.5f, 0.5f), 0, &rmh);
        kiln_tensor *rv = ref_rand_tensor(ctx, cs, seed + 4, &REF_GEN(0.5f, 2), 0, &rvh);
        kiln_tensor *g = ref_rand_tensor(ctx, xs, seed + 5, &REF_GEN(-1, 1), 0, &gh);
        double *xd = ref_to_double(xh, nx), *wd = wh ? ref_to_double(wh, C) : NULL;
        double *bd = bh ? ref_to_double(bh, C) : NULL;
        double *rmd = ref_to_double(rmh, C), *rvd = ref_to_double(rvh, C);
        double *gd = ref_to_double(gh, nx), *y = ref_dalloc(nx), *dx = ref_dalloc(nx);
        double *dw = ref_dalloc(C), *db = ref_dalloc(C);
        for (int step = 0; step < 2; step++) {
          char what[200], sh[96];
          snprintf(what, sizeof what, "batch norm of %s, affine %d, bn_rows %d, graphs %d, step %d",
                   kiln_shape_str(xs, sh, sizeof sh), affine, rows, graphs, step + 1);
          ref_batch_norm(xd, M, C, wd, bd, rmd, rvd, 1, 0.1, 1e-5, y); /* updates rmd, rvd */
          ref_batch_norm_backward(xd, M, C, wd, NULL, NULL, 1, 1e-5, gd, dx, dw, db);
          kiln_tensor_zero_grad(x);
          if (affine) {
            kiln_tensor_zero_grad(w);
            kiln_tensor_zero_grad(b);
          }
          kiln_step_begin(ctx);
          kiln_tensor *out = kiln_batch_norm(x, w, b, rm, rv, 1, 0.1f, 1e-5f);
          cr_assert_eq(kiln_backward(kiln_sum(kiln_mul(out, g), KILN_ALL_AXES, 0)), KILN_OK,
                       "%s: %s", what, th_err(ctx));
          cr_assert_eq(kiln_step_end(ctx), KILN_OK, "%s: %s", what, th_err(ctx));
          if (!graphs) /* a step graph's intermediates may share memory with later ones */
            ref_expect_close(ctx, out, xs, y, FWD_TOL, FWD_TOL, what);
          expect_grad(ctx, x, xs, dx, what, "x");
          if (affine) {
            expect_grad(ctx, w, cs, dw, what, "the weight");
            expect_grad(ctx, b, cs, db, what, "the bias");
          }
          char wr[260];
          snprintf(wr, sizeof wr, "%s: running mean", what);
          ref_expect_close(ctx, rm, cs, rmd, 1e-5, 1e-5, wr);
          snprintf(wr, sizeof wr, "%s: running variance (unbiased)", what);
          ref_expect_close(ctx, rv, cs, rvd, 1e-5, 1e-5, wr);
        }
        kiln_tensor *ts[] = {x, w, b, rm, rv, g};
        for (size_t k = 0; k < sizeof ts / sizeof *ts; k++)
          kiln_tensor_free(ts[k]);
        float *fs[] = {xh, wh, bh, rmh, rvh, gh};
        for (size_t k = 0; k < sizeof fs / sizeof *fs; k++)
          free(fs[k]);
        double *ds[] = {xd, wd, bd, rmd, rvd, gd, y, dx, dw, db};
        for (size_t k = 0; k < sizeof ds / sizeof *ds; k++)
          free(ds[k]);
        th_ctx_free(ctx);
      }
}

/* relu(bn(x1) + bn(x2)) and the gradients of x1 and x2 (malloc'd f32, n values each) in a fused
 * step of a context made with KILN_EW_SINK set to `on`: the first batch norm's application,
 * recorded before the second's statistics, runs in the add's kernel with it set. */
static void residual_sum(const char *on, float *out[3], int64_t *n) {
  setenv("KILN_EW_SINK", on, 1); /* read when the context is made */
  TH_GPU_CTX(ctx);
  unsetenv("KILN_EW_SINK");
  kiln_set_graphs(ctx, 0);
  kiln_shape xs = KILN_SHAPE(8, 6, 6, 16), cs = KILN_SHAPE(16);
  kiln_tensor *x1 = ref_rand_tensor(ctx, xs, 6200, &REF_GEN(-1, 3), 1, NULL);
  kiln_tensor *x2 = ref_rand_tensor(ctx, xs, 6201, &REF_GEN(-2, 1), 1, NULL);
  kiln_tensor *w = ref_rand_tensor(ctx, cs, 6202, &REF_GEN(0.5f, 1.5f), 0, NULL);
  kiln_tensor *b = ref_rand_tensor(ctx, cs, 6203, &REF_GEN(-1, 1), 0, NULL);
  kiln_tensor *g = ref_rand_tensor(ctx, xs, 6204, &REF_GEN(-1, 1), 0, NULL);
  kiln_step_begin(ctx);
  kiln_tensor *a = kiln_batch_norm(x1, w, b, NULL, NULL, 1, 0.1f, 1e-5f);
  kiln_tensor *s = kiln_batch_norm(x2, w, b, NULL, NULL, 1, 0.1f, 1e-5f);
  kiln_tensor *y = kiln_relu(kiln_add(a, s));
  cr_assert_eq(kiln_backward(kiln_sum(kiln_mul(y, g), KILN_ALL_AXES, 0)), KILN_OK, "%s",
               th_err(ctx));
  out[0] = ref_read_f32(ctx, y, "y");
  out[1] = ref_read_f32(ctx, kiln_tensor_grad(x1), "x1's gradient");
  out[2] = ref_read_f32(ctx, kiln_tensor_grad(x2), "x2's gradient");
  *n = ref_numel(xs);
  cr_assert_eq(kiln_step_end(ctx), KILN_OK, "%s", th_err(ctx));
  kiln_tensor *ts[] = {x1, x2, w, b, g};
  for (size_t k = 0; k < sizeof ts / sizeof *ts; k++)
    kiln_tensor_free(ts[k]);
  th_ctx_free(ctx);
}

/* KILN_EW_SINK=1 changes no value: a residual sum of two batch norms, its output
 * and both inputs' gradients bitwise those with the switch off. */
Test(gpu_ops, batch_norm_applied_in_the_residual_adds_kernel) {
  float *on[3], *off[3];
  int64_t n;
  residual_sum("1", on, &n);
  residual_sum("0", off, &n);
  const char *names[3] = {"y", "x1's gradient", "x2's gradient"};
  for (int q = 0; q < 3; q++) {
    cr_assert_eq(memcmp(on[q], off[q], (size_t)n * sizeof(float)), 0, "%s differs", names[q]);
    free(on[q]);
    free(off[q]);
  }
}

/* Batch norm shifts its sums by the running mean where it has one (KILN_CONV_FPROP_MOMENTS, on:
 * batch_norm_training above); with KILN_CONV_FPROP_MOMENTS=0 by the input's first row: the
 * training cases against float64 all the same, the running statistics' updates included. */
Test(gpu_ops, batch_norm_training_shifted_by_the_first_row) {
  setenv("KILN_CONV_FPROP_MOMENTS", "0", 1); /* read when the context is made */
  TH_GPU_CTX_EAGER(ctx);
  unsetenv("KILN_CONV_FPROP_MOMENTS");
  for (size_t i = 0; i < sizeof bn_cases / sizeof *bn_cases; i++)
    if (bn_cases[i].training) check_bn(ctx, &bn_cases[i], 4000 + 100 * i);
  th_ctx_free(ctx);
}

/* A convolution (bf16, x (n, h, w, ci), k x k filters into co channels, stride s, padding k / 2),
 * batch norm in training with running statistics (momentum 0.1) and a ReLU, loss sum(y g), two
 * steps (a step graph's capture, then its replay) in a context made with KILN_CONV_FPROP_MOMENTS
 * set to `on`: y (as g's gradient: the loss consumes y), the gradients of the filters and of the
 * norm's weight and bias, then the running mean and variance (malloc'd f32, n[q] values). */
typedef struct {
  const char *desc;
  int64_t n, h, w, ci, co, k, s;
} conv_bn_case;

static void conv_bn_results(const conv_bn_case *c, const char *on, float *out[6], int64_t n[6]) {
  setenv("KILN_CONV_FPROP_MOMENTS", on, 1); /* read when the context is made */
  TH_GPU_CTX(ctx);
  unsetenv("KILN_CONV_FPROP_MOMENTS");
  int p = (int)(c->k / 2), s = (int)c->s;
  int64_t oh = (c->h + 2 * p - c->k) / s + 1, ow = (c->w + 2 * p - c->k) / s + 1;
  kiln_shape cs = KILN_SHAPE(c->co), ys = KILN_SHAPE(c->n, oh, ow, c->co);
  kiln_tensor *x =
      ref_rand_tensor(ctx, KILN_SHAPE(c->n, c->h, c->w, c->ci), 9500, &REF_GEN(-1, 2), 0, NULL);
  kiln_tensor *t[6] = {
      ref_rand_tensor(ctx, ys, 9501, &REF_GEN(-1, 1), 1, NULL), /* g */
      ref_rand_tensor(ctx, KILN_SHAPE(c->co, c->ci, c->k, c->k), 9502, &REF_GEN(-0.1f, 0.1f), 1,
                      NULL),
      ref_rand_tensor(ctx, cs, 9503, &REF_GEN(0.5f, 1.5f), 1, NULL),
      ref_rand_tensor(ctx, cs, 9504, &REF_GEN(-1, 1), 1, NULL),
      ref_rand_tensor(ctx, cs, 9505, &REF_GEN(-0.5f, 0.5f), 0, NULL), /* running mean */
      ref_rand_tensor(ctx, cs, 9506, &REF_GEN(0.5f, 2), 0, NULL)};    /* running variance */
  kiln_conv2d_options o = {.pad_h = p, .pad_w = p, .stride_h = s, .stride_w = s};
  for (int step = 0; step < 2; step++) {
    for (int q = 0; q < 4; q++)
      kiln_tensor_zero_grad(t[q]);
    kiln_step_begin(ctx);
    kiln_autocast_begin(ctx, KILN_DTYPE_BF16);
    kiln_tensor *y =
        kiln_batch_norm(kiln_conv2d(x, t[1], NULL, &o), t[2], t[3], t[4], t[5], 1, 0.1f, 1e-5f);
    y = kiln_cast(kiln_relu(y), KILN_DTYPE_F32);
    kiln_autocast_end(ctx);
    cr_assert_eq(kiln_backward(kiln_sum(kiln_mul(y, t[0]), KILN_ALL_AXES, 0)), KILN_OK, "%s: %s",
                 c->desc, th_err(ctx));
    cr_assert_eq(kiln_step_end(ctx), KILN_OK, "%s: %s", c->desc, th_err(ctx));
  }
  for (int q = 0; q < 6; q++) {
    out[q] = ref_read_f32(ctx, q < 4 ? kiln_tensor_grad(t[q]) : t[q], "a result");
    n[q] = kiln_tensor_numel(t[q]);
    kiln_tensor_free(t[q]);
  }
  kiln_tensor_free(x);
  th_ctx_free(ctx);
}

/* KILN_CONV_FPROP_MOMENTS=1 (batch norm's statistics summed in the TMA-fed forward product's
 * epilogue, shifted by the running mean) against its absence (a pass of their own over the
 * product, shifted by its first row): the same sums in another order, so within a bf16 step for
 * y and the gradients (1/128 of the largest) and 1e-5 for the running statistics, after two steps
 * of a replayed graph, on 64, 128 and 256 output channels (a tile of 64, 128 and 256 columns),
 * strides 1 and 2, 1x1 and 3x3 filters, rows in part of a last block of 128; and on the halo-tile
 * products (24 channels, and ResNet's stem), whose blocks sum a partial each. */
Test(gpu_ops, batch_norm_statistics_in_the_forward_products_kernel) {
  TH_GPU_CTX(probe); /* skips without a GPU */
  th_ctx_free(probe);
  const conv_bn_case cases[] = {
      {"64->64 3x3 on 6x11x9", 6, 11, 9, 64, 64, 3, 1},
      {"64->256 3x3 stride 2 on 8x14x14", 8, 14, 14, 64, 256, 3, 2},
      {"128->128 1x1 stride 2 on 4x16x16", 4, 16, 16, 128, 128, 1, 2},
      {"24->64 3x3 on 3x9x7 (a halo-tile product)", 3, 9, 7, 24, 64, 3, 1},
      {"3->64 7x7 stride 2 on 3x45x38 (ResNet's stem, on its blocks)", 3, 45, 38, 3, 64, 7, 2},
  };
  const char *names[6] = {"y",
                          "the filters' gradient",
                          "the weight's gradient",
                          "the bias's gradient",
                          "the running mean",
                          "the running variance"};
  for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
    float *on[6], *off[6];
    int64_t n[6];
    conv_bn_results(&cases[i], "1", on, n);
    conv_bn_results(&cases[i], "0", off, n);
    for (int q = 0; q < 6; q++) {
      double most = 0, diff = 0;
      for (int64_t j = 0; j < n[q]; j++) {
        most = fmax(most, fabs(off[q][j]));
        diff = fmax(diff, fabs((double)on[q][j] - off[q][j]));
      }
      cr_assert_gt(most, 1e-3, "%s: %s is all small", cases[i].desc, names[q]);
      cr_assert_leq(diff, q < 4 ? most / 128 : 1e-5 * most, "%s: %s differs by %g (largest %g)",
                    cases[i].desc, names[q], diff, most);
      free(on[q]);
      free(off[q]);
    }
  }
}

Test(gpu_ops, batch_norm_eval) {
  TH_GPU_CTX_EAGER(ctx);
  for (size_t i = 0; i < sizeof bn_cases / sizeof *bn_cases; i++)
    if (!bn_cases[i].training) check_bn(ctx, &bn_cases[i], 5000 + 100 * i);
  th_ctx_free(ctx);
}

Test(gpu_ops, batch_norm_unfused) {
  TH_GPU_CTX_EAGER(ctx);
  kiln_set_fusion(ctx, 0);
  for (size_t i = 0; i < sizeof bn_cases / sizeof *bn_cases; i++)
    if (!bn_cases[i].gc) check_bn(ctx, &bn_cases[i], 5500 + 100 * i);
  th_ctx_free(ctx);
}

/* A channel whose values are all equal: variance 0, so eps alone keeps the division finite and
 * the channel's output is its bias; its running variance decays towards 0. */
Test(gpu_ops, batch_norm_constant_channel) {
  TH_GPU_CTX_EAGER(ctx);
  float xh[6 * 3];
  ref_gen_fill(xh, 18, 5900, &REF_GEN(-1, 1));
  for (int i = 0; i < 6; i++)
    xh[i * 3 + 1] = 2.5f;
  float wh[3] = {0.5f, 2.f, 1.5f}, bh[3] = {0.25f, -0.75f, 1.f}, ones[3] = {1, 1, 1};
  kiln_tensor *x = ref_upload(ctx, KILN_SHAPE(6, 3), xh);
  kiln_tensor *w = ref_upload(ctx, KILN_SHAPE(3), wh), *b = ref_upload(ctx, KILN_SHAPE(3), bh);
  kiln_tensor *rm = kiln_tensor_new(ctx, KILN_DTYPE_F32, KILN_SHAPE(3));
  kiln_tensor *rv = ref_upload(ctx, KILN_SHAPE(3), ones);
  cr_assert_not_null(rm, "%s", th_err(ctx));
  double xd[18], wd[3] = {0.5, 2, 1.5}, bd[3] = {0.25, -0.75, 1}, rmd[3] = {0}, rvd[3] = {1, 1, 1};
  double want[18];
  for (int i = 0; i < 18; i++)
    xd[i] = xh[i];
  ref_batch_norm(xd, 6, 3, wd, bd, rmd, rvd, 1, 0.1, 1e-5, want);
  for (int i = 0; i < 6; i++)
    cr_assert_float_eq(want[i * 3 + 1], -0.75, 1e-12, "the reference's constant channel");
  kiln_step_begin(ctx);
  ref_expect_close(ctx, kiln_batch_norm(x, w, b, rm, rv, 1, 0.1f, 1e-5f), KILN_SHAPE(6, 3), want,
                   FWD_TOL, FWD_TOL, "batch_norm of (6, 3) with a constant channel");
  ref_expect_close(ctx, rm, KILN_SHAPE(3), rmd, 1e-6, 1e-5, "its running mean");
  ref_expect_close(ctx, rv, KILN_SHAPE(3), rvd, 1e-6, 1e-5, "its running variance");
  kiln_tensor_free(x);
  kiln_tensor_free(w);
  kiln_tensor_free(b);
  kiln_tensor_free(rm);
  kiln_tensor_free(rv);
  th_ctx_free(ctx);
}

/* kiln.h's zero rule in the ops, as in the layers: batch norm's momentum 0 is PyTorch's 0.1 and
 * KILN_ZERO no update (the running statistics stay), its eps and layer norm's 0 is 1e-5 and
 * KILN_ZERO an exact 0. Values of about 1e-2 (variance about 3e-5) make eps show. */
Test(gpu_ops, zero_momentum_and_eps_are_defaults_and_kiln_zero_exact_zeros) {
  TH_GPU_CTX_EAGER(ctx);
  enum { M = 8, C = 3 };
  float xh[M * C], zeros[C] = {0, 0, 0}, ones[C] = {1, 1, 1};
  ref_gen_fill(xh, M * C, 6100, &REF_GEN(-1e-2f, 1e-2f));
  double xd[M * C], want[M * C];
  for (int i = 0; i < M * C; i++)
    xd[i] = xh[i];
  kiln_tensor *x = ref_upload(ctx, KILN_SHAPE(M, C), xh);
  static const struct {
    float momentum, eps; /* as given */
    double m, e;         /* as meant */
  } cases[] = {{0.f, 0.f, 0.1, 1e-5}, {KILN_ZERO, KILN_ZERO, 0, 0}, {0.5f, KILN_ZERO, 0.5, 0}};
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    char what[96];
    snprintf(what, sizeof what, "momentum %g and eps %g given", cases[i].momentum, cases[i].eps);
    kiln_tensor *rm = ref_upload(ctx, KILN_SHAPE(C), zeros),
                *rv = ref_upload(ctx, KILN_SHAPE(C), ones);
    double rmd[C] = {0, 0, 0}, rvd[C] = {1, 1, 1};
    ref_batch_norm(xd, M, C, NULL, NULL, rmd, rvd, 1, cases[i].m, cases[i].e, want);
    kiln_step_begin(ctx);
    ref_expect_close(ctx,
                     kiln_batch_norm(x, NULL, NULL, rm, rv, 1, cases[i].momentum, cases[i].eps),
                     KILN_SHAPE(M, C), want, FWD_TOL, FWD_TOL, what);
    ref_expect_close(ctx, rm, KILN_SHAPE(C), rmd, 1e-7, 1e-5, what);
    ref_expect_close(ctx, rv, KILN_SHAPE(C), rvd, 1e-7, 1e-5, what);
    ref_layer_norm(xd, M, C, NULL, NULL, cases[i].e, want);
    ref_expect_close(ctx, kiln_layer_norm(x, NULL, NULL, cases[i].eps), KILN_SHAPE(M, C), want,
                     FWD_TOL, FWD_TOL, what);
    kiln_tensor_free(rm);
    kiln_tensor_free(rv);
  }
  kiln_tensor_free(x);
  th_ctx_free(ctx);
}

/* ---------------------------------------------------------------- layer norm */

typedef struct ln_case {
  const char *desc;
  kiln_shape x;
  int affine;
  float eps;
  int gc;
} ln_case;

static const ln_case ln_cases[] = {
    {"affine", S4(2, 3, 5, 6), 1, 1e-5f, 1},
    {"no affine, eps 1e-3", S2(4, 7), 0, 1e-3f, 1},
    {"affine, (N, C)", S2(5, 9), 1, 1e-5f, 1},
    {"affine, rows of 300", S2(3, 300), 1, 1e-5f, 0},
    {"affine, rows of 1024", S2(64, 1024), 1, 1e-5f, 0},
    {"affine, rows of 1 (the bias)", S2(5, 1), 1, 1e-5f, 0},
};

typedef struct ln_gc {
  int affine;
  float eps;
} ln_gc;

static kiln_tensor *gc_ln(kiln_tensor *const *in, void *user) {
  const ln_gc *u = user;
  return kiln_layer_norm(in[0], u->affine ? in[1] : NULL, u->affine ? in[2] : NULL, u->eps);
}

static void check_ln(kiln_ctx *ctx, const ln_case *c, uint64_t seed) {
  kiln_shape xs = c->x, cs = KILN_SHAPE(xs.d[xs.ndim - 1]);
  int64_t nx = ref_numel(xs), C = cs.d[0], M = nx / C;
  char what[1024], sh[96];
  snprintf(what, sizeof what, "layer_norm %s of %s", c->desc, kiln_shape_str(xs, sh, sizeof sh));
  kiln_step_begin(ctx);
  float *xh, *wh = NULL, *bh = NULL;
  kiln_tensor *x = ref_rand_tensor(ctx, xs, seed, &REF_GEN(-1, 3), 1, &xh);
  kiln_tensor *w =
      c->affine ? ref_rand_tensor(ctx, cs, seed + 1, &REF_GEN(0.5f, 1.5f), 1, &wh) : NULL;
  kiln_tensor *b = c->affine ? ref_rand_tensor(ctx, cs, seed + 2, &REF_GEN(-1, 1), 1, &bh) : NULL;
  double *xd = ref_to_double(xh, nx), *wd = wh ? ref_to_double(wh, C) : NULL;
  double *bd = bh ? ref_to_double(bh, C) : NULL;
  double *want = ref_dalloc(nx), *dx = ref_dalloc(nx), *dw = ref_dalloc(C), *db = ref_dalloc(C);
  ref_layer_norm(xd, M, C, wd, bd, c->eps, want);
  kiln_tensor *y = kiln_layer_norm(x, w, b, c->eps);
  ref_expect_close(ctx, y, xs, want, FWD_TOL, FWD_TOL, what);
  double *gy = ref_backward_weighted(ctx, y, seed + 3, what);
  ref_layer_norm_backward(xd, M, C, wd, c->eps, gy, dx, dw, db);
  expect_grad(ctx, x, xs, dx, what, "x");
  if (w) {
    expect_grad(ctx, w, cs, dw, what, "the weight");
    expect_grad(ctx, b, cs, db, what, "the bias");
  }
  if (c->gc) {
    ln_gc u = {.affine = c->affine, .eps = c->eps};
    kiln_tensor *in[3] = {x, w, b};
    ref_expect_gradcheck(ctx, what, gc_ln, c->affine ? 3 : 1, in, &u);
  }
  kiln_tensor_free(x);
  kiln_tensor_free(w);
  kiln_tensor_free(b);
  free(xh);
  free(wh);
  free(bh);
  free(xd);
  free(wd);
  free(bd);
  free(want);
  free(dx);
  free(dw);
  free(db);
  free(gy);
  th_assert_ok(ctx);
}

Test(gpu_ops, layer_norm) {
  TH_GPU_CTX_EAGER(ctx);
  for (size_t i = 0; i < sizeof ln_cases / sizeof *ln_cases; i++)
    check_ln(ctx, &ln_cases[i], 6000 + 10 * i);
  th_ctx_free(ctx);
}

Test(gpu_ops, layer_norm_unfused) {
  TH_GPU_CTX_EAGER(ctx);
  kiln_set_fusion(ctx, 0);
  for (size_t i = 0; i < sizeof ln_cases / sizeof *ln_cases; i++)
    if (!ln_cases[i].gc) check_ln(ctx, &ln_cases[i], 6500 + 10 * i);
  th_ctx_free(ctx);
}

/* Normalising a transposed view: rows whose elements are not adjacent in memory. */
Test(gpu_ops, layer_norm_of_a_view) {
  TH_GPU_CTX_EAGER(ctx);
  float xh[6 * 4];
  ref_gen_fill(xh, 24, 6900, &REF_GEN(-1, 3));
  kiln_tensor *base = ref_upload(ctx, KILN_SHAPE(6, 4), xh);
  double xd[4 * 6], want[4 * 6];
  for (int r = 0; r < 4; r++)
    for (int c = 0; c < 6; c++)
      xd[r * 6 + c] = xh[c * 4 + r];
  ref_layer_norm(xd, 4, 6, NULL, NULL, 1e-5, want);
  kiln_step_begin(ctx);
  ref_expect_close(ctx, kiln_layer_norm(kiln_transpose(base, 0, 1), NULL, NULL, 1e-5f),
                   KILN_SHAPE(4, 6), want, FWD_TOL, FWD_TOL, "layer_norm of a transposed [6,4]");
  kiln_tensor_free(base);
  th_ctx_free(ctx);
}
