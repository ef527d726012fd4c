/*
 * test_gpu_ops_views.c: the view ops on the GPU (reshape, permute and transpose, contiguous,
 * slice, expand, and chains of them; detach): each result's values and contiguity against an
 * index map of the base computed on the host (ref_chain_map), the gradient of sum(view * w)
 * scattered back through that map, and a finite-difference check.
 * Without a GPU every test skips, saying why.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ref.h"

/* ---------------------------------------------------------------- views */

/* A chain of view steps applied to a base tensor: values, shape, contiguity, the gradient of
 * sum(view * w) (scattered back through the host map: zero where the view does not read, summed
 * where it reads an element more than once) and a gradcheck. */
typedef struct vcase {
  const char *name;
  kiln_shape base, want;
  ref_vchain c;
  int contiguous; /* 1 or 0: asserted; -1: either */
} vcase;

static kiln_tensor *gc_chain(kiln_tensor *const *in, void *user) {
  return ref_chain_apply(in[0], (const ref_vchain *)user);
}

static void check_view(kiln_ctx *ctx, const vcase *v, uint64_t seed) {
  char what[1024], b[96];
  kiln_shape_str(v->base, b, sizeof b);
  snprintf(what, sizeof what, "%s of a %s input", v->name, b);
  ref_hmap m = ref_chain_map(v->base, &v->c);
  char ms[96], ws[96];
  kiln_shape_str(m.s, ms, sizeof ms);
  kiln_shape_str(v->want, ws, sizeof ws);
  cr_assert(ref_shape_eq(m.s, v->want), "%s: the test's own map gives %s, want %s", what, ms, ws);
  int64_t n = ref_numel(v->want), nb = ref_numel(v->base);

  kiln_step_begin(ctx);
  float *h, *wh;
  kiln_tensor *x = ref_rand_tensor(ctx, v->base, seed, &REF_GEN(-2, 2), 1, &h);
  kiln_tensor *w = ref_rand_tensor(ctx, v->want, seed + 1, &REF_GEN(-1, 1), 0, &wh);
  kiln_tensor *y = ref_chain_apply(x, &v->c);
  ref_expect_shape(ctx, y, v->want, what);
  if (v->contiguous >= 0)
    cr_assert_eq(!!kiln_tensor_is_contiguous(y), v->contiguous, "%s: is_contiguous %d, want %d",
                 what, kiln_tensor_is_contiguous(y), v->contiguous);
  double *want = ref_dalloc(n), *gwant = ref_dalloc(nb);
  for (int64_t i = 0; i < n; i++)
    want[i] = h[m.idx[i]];
  for (int64_t i = 0; i < nb; i++)
    gwant[i] = 0;
  for (int64_t i = 0; i < n; i++)
    gwant[m.idx[i]] += wh[i];
  ref_expect_close(ctx, y, v->want, want, 0, 0, what);

  cr_assert_eq(kiln_backward(kiln_sum(kiln_mul(y, w), KILN_ALL_AXES, 0)), KILN_OK,
               "%s: backward of sum(view * w): %s", what, th_err(ctx));
  char gwhat[1200];
  snprintf(gwhat, sizeof gwhat, "gradient of sum(%s * w) with respect to the base", what);
  cr_assert_not_null(kiln_tensor_grad(x), "%s: no gradient", gwhat);
  ref_expect_close(ctx, kiln_tensor_grad(x), v->base, gwant, 1e-5, 1e-5, gwhat);

  ref_vchain chain = v->c; /* gradcheck's user pointer is not const */
  ref_expect_gradcheck(ctx, what, gc_chain, 1, &x, &chain);
  kiln_tensor_free(x);
  kiln_tensor_free(w);
  free(h);
  free(wh);
  free(want);
  free(gwant);
  free(m.idx);
}

static void check_views(kiln_ctx *ctx, const vcase *cases, size_t n, uint64_t seed) {
  for (size_t i = 0; i < n; i++)
    check_view(ctx, &cases[i], seed + 2 * i);
}

#define STEP_T(a0, a1) ((ref_vstep){.k = REF_V_T, .axis = (a0), .axis1 = (a1)})
#define STEP_PERMUTE(...) ((ref_vstep){.k = REF_V_PERMUTE, .order = KILN_AXES(__VA_ARGS__)})
#define STEP_SLICE(ax, s, e, st)                                                                   \
  ((ref_vstep){.k = REF_V_SLICE, .axis = (ax), .start = (s), .end = (e), .step = (st)})
#define STEP_EXPAND(...) ((ref_vstep){.k = REF_V_EXPAND, .shape = KILN_SHAPE(__VA_ARGS__)})
#define STEP_RESHAPE(...) ((ref_vstep){.k = REF_V_RESHAPE, .shape = KILN_SHAPE(__VA_ARGS__)})
#define STEP_CONTIG ((ref_vstep){.k = REF_V_CONTIG})
#define CHAIN(...)                                                                                 \
  {                                                                                                \
    .n = sizeof((ref_vstep[]){__VA_ARGS__}) / sizeof(ref_vstep), .st = { __VA_ARGS__ }             \
  }

Test(gpu_ops, reshape) {
  TH_GPU_CTX_EAGER(ctx);
  vcase cases[] = {
      {.name = "reshape to [6,4]",
       .base = KILN_SHAPE(2, 3, 4),
       .want = KILN_SHAPE(6, 4),
       .c = CHAIN(STEP_RESHAPE(6, 4)),
       .contiguous = 1},
      {.name = "reshape to [4,-1]",
       .base = KILN_SHAPE(2, 3, 4),
       .want = KILN_SHAPE(4, 6),
       .c = CHAIN(STEP_RESHAPE(4, -1)),
       .contiguous = 1},
      {.name = "reshape to [24]",
       .base = KILN_SHAPE(2, 3, 4),
       .want = KILN_SHAPE(24),
       .c = CHAIN(STEP_RESHAPE(24)),
       .contiguous = 1},
      {.name = "reshape to [2,1,12]",
       .base = KILN_SHAPE(2, 3, 4),
       .want = KILN_SHAPE(2, 1, 12),
       .c = CHAIN(STEP_RESHAPE(2, 1, 12)),
       .contiguous = 1},
      /* views that cannot be reshaped in place: the result must be a copy in row-major order */
      {.name = "reshape of a transposed view to [2,6]",
       .base = KILN_SHAPE(3, 4),
       .want = KILN_SHAPE(2, 6),
       .c = CHAIN(STEP_T(0, 1), STEP_RESHAPE(2, 6)),
       .contiguous = 1},
      {.name = "reshape of a transposed view to [-1]",
       .base = KILN_SHAPE(3, 4),
       .want = KILN_SHAPE(12),
       .c = CHAIN(STEP_T(0, 1), STEP_RESHAPE(-1)),
       .contiguous = 1},
      {.name = "reshape of a step-2 slice to [12]",
       .base = KILN_SHAPE(4, 6),
       .want = KILN_SHAPE(12),
       .c = CHAIN(STEP_SLICE(1, 0, 6, 2), STEP_RESHAPE(12)),
       .contiguous = 1},
      {.name = "reshape of a permuted view to [4,6]",
       .base = KILN_SHAPE(2, 3, 4),
       .want = KILN_SHAPE(4, 6),
       .c = CHAIN(STEP_PERMUTE(2, 0, 1), STEP_RESHAPE(4, 6)),
       .contiguous = 1},
      {.name = "reshape of an expanded view to [6,4]",
       .base = KILN_SHAPE(3, 1),
       .want = KILN_SHAPE(6, 4),
       .c = CHAIN(STEP_EXPAND(2, 3, 4), STEP_RESHAPE(6, 4)),
       .contiguous = 1},
  };
  check_views(ctx, cases, sizeof cases / sizeof *cases, 1200);
  th_ctx_free(ctx);
}

Test(gpu_ops, permute) {
  TH_GPU_CTX_EAGER(ctx);
  vcase cases[] = {
      {.name = "permute (2,0,1)",
       .base = KILN_SHAPE(2, 3, 4),
       .want = KILN_SHAPE(4, 2, 3),
       .c = CHAIN(STEP_PERMUTE(2, 0, 1)),
       .contiguous = 0},
      {.name = "permute (1,2,0)",
       .base = KILN_SHAPE(2, 3, 4),
       .want = KILN_SHAPE(3, 4, 2),
       .c = CHAIN(STEP_PERMUTE(1, 2, 0)),
       .contiguous = 0},
      {.name = "permute (-1,0,1)",
       .base = KILN_SHAPE(2, 3, 4),
       .want = KILN_SHAPE(4, 2, 3),
       .c = CHAIN(STEP_PERMUTE(-1, 0, 1)),
       .contiguous = 0},
      {.name = "permute (0,1,2)",
       .base = KILN_SHAPE(2, 3, 4),
       .want = KILN_SHAPE(2, 3, 4),
       .c = CHAIN(STEP_PERMUTE(0, 1, 2)),
       .contiguous = 1},
      {.name = "transpose (0,2)",
       .base = KILN_SHAPE(2, 3, 4),
       .want = KILN_SHAPE(4, 3, 2),
       .c = CHAIN(STEP_T(0, 2)),
       .contiguous = 0},
      {.name = "transpose (-1,-2)",
       .base = KILN_SHAPE(2, 3, 4),
       .want = KILN_SHAPE(2, 4, 3),
       .c = CHAIN(STEP_T(-1, -2)),
       .contiguous = 0},
      {.name = "permute (2,1,0) of a transposed view",
       .base = KILN_SHAPE(2, 3, 4),
       .want = KILN_SHAPE(4, 2, 3),
       .c = CHAIN(STEP_T(0, 1), STEP_PERMUTE(2, 1, 0)),
       .contiguous = 0},
      {.name = "permute (1,0) of a step-2 slice",
       .base = KILN_SHAPE(6, 5),
       .want = KILN_SHAPE(5, 3),
       .c = CHAIN(STEP_SLICE(0, 1, 6, 2), STEP_PERMUTE(1, 0)),
       .contiguous = 0},
  };
  check_views(ctx, cases, sizeof cases / sizeof *cases, 1300);
  th_ctx_free(ctx);
}

Test(gpu_ops, contiguous) {
  TH_GPU_CTX_EAGER(ctx);
  vcase cases[] = {
      {.name = "contiguous of a permuted (2,0,1) view",
       .base = KILN_SHAPE(2, 3, 4),
       .want = KILN_SHAPE(4, 2, 3),
       .c = CHAIN(STEP_PERMUTE(2, 0, 1), STEP_CONTIG),
       .contiguous = 1},
      {.name = "contiguous of a step-2 slice along axis 1",
       .base = KILN_SHAPE(4, 6),
       .want = KILN_SHAPE(4, 3),
       .c = CHAIN(STEP_SLICE(1, 1, 6, 2), STEP_CONTIG),
       .contiguous = 1},
      {.name = "contiguous of a step-2 slice along axis 0",
       .base = KILN_SHAPE(6, 4),
       .want = KILN_SHAPE(3, 4),
       .c = CHAIN(STEP_SLICE(0, 0, 6, 2), STEP_CONTIG),
       .contiguous = 1},
      {.name = "contiguous of a transposed step-3 slice",
       .base = KILN_SHAPE(7, 5),
       .want = KILN_SHAPE(5, 3),
       .c = CHAIN(STEP_SLICE(0, 0, 7, 3), STEP_T(0, 1), STEP_CONTIG),
       .contiguous = 1},
      {.name = "contiguous of an expanded view",
       .base = KILN_SHAPE(3, 1),
       .want = KILN_SHAPE(2, 3, 4),
       .c = CHAIN(STEP_EXPAND(2, 3, 4), STEP_CONTIG),
       .contiguous = 1},
      {.name = "contiguous of a contiguous tensor",
       .base = KILN_SHAPE(3, 4),
       .want = KILN_SHAPE(3, 4),
       .c = CHAIN(STEP_CONTIG),
       .contiguous = 1},
  };
  check_views(ctx, cases, sizeof cases / sizeof *cases, 1400);
  th_ctx_free(ctx);
}

Test(gpu_ops, slice) {
  TH_GPU_CTX_EAGER(ctx);
  vcase cases[] = {
      {.name = "slice axis 1 [0:7:1]",
       .base = KILN_SHAPE(5, 7),
       .want = KILN_SHAPE(5, 7),
       .c = CHAIN(STEP_SLICE(1, 0, 7, 1)),
       .contiguous = -1},
      {.name = "slice axis 1 [1:6:1]",
       .base = KILN_SHAPE(5, 7),
       .want = KILN_SHAPE(5, 5),
       .c = CHAIN(STEP_SLICE(1, 1, 6, 1)),
       .contiguous = 0},
      {.name = "slice axis 1 [1:7:2]",
       .base = KILN_SHAPE(5, 7),
       .want = KILN_SHAPE(5, 3),
       .c = CHAIN(STEP_SLICE(1, 1, 7, 2)),
       .contiguous = 0},
      {.name = "slice axis 1 [0:7:3]",
       .base = KILN_SHAPE(5, 7),
       .want = KILN_SHAPE(5, 3),
       .c = CHAIN(STEP_SLICE(1, 0, 7, 3)),
       .contiguous = 0},
      {.name = "slice axis 1 [1:7:3]",
       .base = KILN_SHAPE(5, 7),
       .want = KILN_SHAPE(5, 2),
       .c = CHAIN(STEP_SLICE(1, 1, 7, 3)),
       .contiguous = 0},
      {.name = "slice axis 0 [1:4:1]",
       .base = KILN_SHAPE(5, 7),
       .want = KILN_SHAPE(3, 7),
       .c = CHAIN(STEP_SLICE(0, 1, 4, 1)),
       .contiguous = 1},
      {.name = "slice axis 0 [1:5:2]",
       .base = KILN_SHAPE(5, 7),
       .want = KILN_SHAPE(2, 7),
       .c = CHAIN(STEP_SLICE(0, 1, 5, 2)),
       .contiguous = 0},
      {.name = "slice axis 0 [0:5:3]",
       .base = KILN_SHAPE(5, 7),
       .want = KILN_SHAPE(2, 7),
       .c = CHAIN(STEP_SLICE(0, 0, 5, 3)),
       .contiguous = 0},
      {.name = "slice axis -1 [-5:-1:1]",
       .base = KILN_SHAPE(5, 7),
       .want = KILN_SHAPE(5, 4),
       .c = CHAIN(STEP_SLICE(-1, -5, -1, 1)),
       .contiguous = 0},
      {.name = "slice axis 2 [1:6:2]",
       .base = KILN_SHAPE(4, 3, 6),
       .want = KILN_SHAPE(4, 3, 3),
       .c = CHAIN(STEP_SLICE(2, 1, 6, 2)),
       .contiguous = 0},
      {.name = "slice axis 1 [0:3:2]",
       .base = KILN_SHAPE(4, 3, 6),
       .want = KILN_SHAPE(4, 2, 6),
       .c = CHAIN(STEP_SLICE(1, 0, 3, 2)),
       .contiguous = 0},
      {.name = "slice axis 0 [0:6:2] then axis 1 [1:8:3]",
       .base = KILN_SHAPE(6, 8),
       .want = KILN_SHAPE(3, 3),
       .c = CHAIN(STEP_SLICE(0, 0, 6, 2), STEP_SLICE(1, 1, 8, 3)),
       .contiguous = 0},
      {.name = "slice axis 0 [1:6:2] of a transposed view",
       .base = KILN_SHAPE(4, 6),
       .want = KILN_SHAPE(3, 4),
       .c = CHAIN(STEP_T(0, 1), STEP_SLICE(0, 1, 6, 2)),
       .contiguous = 0},
  };
  check_views(ctx, cases, sizeof cases / sizeof *cases, 1500);
  th_ctx_free(ctx);
}

Test(gpu_ops, expand) {
  TH_GPU_CTX_EAGER(ctx);
  vcase cases[] = {
      {.name = "expand to [2,3,4]",
       .base = KILN_SHAPE(3, 1),
       .want = KILN_SHAPE(2, 3, 4),
       .c = CHAIN(STEP_EXPAND(2, 3, 4)),
       .contiguous = 0},
      {.name = "expand to [2,-1,4]",
       .base = KILN_SHAPE(3, 1),
       .want = KILN_SHAPE(2, 3, 4),
       .c = CHAIN(STEP_EXPAND(2, -1, 4)),
       .contiguous = 0},
      {.name = "expand to [3,4]",
       .base = KILN_SHAPE(1, 4),
       .want = KILN_SHAPE(3, 4),
       .c = CHAIN(STEP_EXPAND(3, 4)),
       .contiguous = 0},
      {.name = "expand to [2,3,4]",
       .base = KILN_SHAPE(4),
       .want = KILN_SHAPE(2, 3, 4),
       .c = CHAIN(STEP_EXPAND(2, 3, 4)),
       .contiguous = 0},
      {.name = "expand to [2,5,3]",
       .base = KILN_SHAPE(2, 1, 3),
       .want = KILN_SHAPE(2, 5, 3),
       .c = CHAIN(STEP_EXPAND(2, 5, 3)),
       .contiguous = 0},
      {.name = "expand to the same shape",
       .base = KILN_SHAPE(3, 4),
       .want = KILN_SHAPE(3, 4),
       .c = CHAIN(STEP_EXPAND(3, 4)),
       .contiguous = 1},
      {.name = "expand of a transposed view to [3,5]",
       .base = KILN_SHAPE(1, 3),
       .want = KILN_SHAPE(3, 5),
       .c = CHAIN(STEP_T(0, 1), STEP_EXPAND(3, 5)),
       .contiguous = 0},
  };
  check_views(ctx, cases, sizeof cases / sizeof *cases, 1600);
  th_ctx_free(ctx);
}

/* ---------------------------------------------------------------- detach */

static kiln_tensor *gc_detach(kiln_tensor *const *in, void *user) {
  return kiln_mul(kiln_detach((kiln_tensor *)user), in[0]);
}

Test(gpu_ops, detach) {
  TH_GPU_CTX_EAGER(ctx);
  float *xh, *yh;
  kiln_tensor *x = ref_rand_tensor(ctx, KILN_SHAPE(3, 4), 2100, &REF_GEN(-2, 2), 1, &xh);
  kiln_tensor *y = ref_rand_tensor(ctx, KILN_SHAPE(3, 4), 2101, &REF_GEN(-2, 2), 1, &yh);
  double wx[12];
  for (int i = 0; i < 12; i++)
    wx[i] = xh[i];
  kiln_step_begin(ctx);
  kiln_tensor *d = kiln_detach(x);
  ref_expect_close(ctx, d, KILN_SHAPE(3, 4), wx, 0, 0, "detach of [3,4]: values");
  cr_assert_eq(kiln_tensor_requires_grad(d), 0, "detach of [3,4]: the result requires grad");
  cr_assert_eq(kiln_backward(kiln_sum(kiln_mul(d, y), KILN_ALL_AXES, 0)), KILN_OK,
               "backward of sum(detach(x) * y): %s", th_err(ctx));
  kiln_tensor *gx = kiln_tensor_grad(x);
  if (gx) {
    float *g = ref_read_f32(ctx, gx, "gradient of x through detach");
    for (int i = 0; i < 12; i++)
      cr_assert_eq(g[i], 0.f,
                   "sum(detach(x) * y): gradient of x element %d is %.9g, want 0 (or "
                   "no gradient)",
                   i, (double)g[i]);
    free(g);
  }
  ref_expect_close(ctx, kiln_tensor_grad(y), KILN_SHAPE(3, 4), wx, 1e-6, 1e-6,
                   "sum(detach(x) * y): gradient of y (= x)");
  /* gradcheck through y alone: x is a constant to the check */
  ref_expect_gradcheck(ctx, "detach(x) * y with respect to y", gc_detach, 1, &y, x);
  kiln_tensor_free(x);
  kiln_tensor_free(y);
  free(xh);
  free(yh);
  th_ctx_free(ctx);
}
