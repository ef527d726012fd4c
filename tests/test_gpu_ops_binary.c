/*
 * test_gpu_ops_binary.c: the elementwise ops of two inputs on the GPU (add, sub, mul, div,
 * maximum, minimum and the comparisons) and where, against float64 references: every pair of
 * broadcasting shapes (among them inputs that one division of the element's index finds: a
 * vector over the last dims, a value per leading index), with each input contiguous or a
 * transposed, sliced or expanded view, an input against itself and its transpose (ties), and
 * gradients through both inputs against central finite differences (kiln_gradcheck). Without a
 * GPU every test skips, saying why.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ref.h"

/* ---------------------------------------------------------------- binary elementwise ops */

typedef struct binop {
  const char *name;
  kiln_tensor *(*fn)(kiln_tensor *, kiln_tensor *);
  double (*ref)(double, double);
  ref_gen fa, fb; /* forward inputs */
  ref_gen ga, gb; /* gradient-check inputs */
  int grad;       /* 0: comparisons, no gradient */
  double atol, rtol;
} binop;

static double br_add(double a, double b) { return a + b; }
static double br_sub(double a, double b) { return a - b; }
static double br_mul(double a, double b) { return a * b; }
static double br_div(double a, double b) { return a / b; }
static double br_maximum(double a, double b) { return a > b ? a : b; }
static double br_minimum(double a, double b) { return a < b ? a : b; }
static double br_eq(double a, double b) { return a == b ? 1.0 : 0.0; }
static double br_ne(double a, double b) { return a != b ? 1.0 : 0.0; }
static double br_lt(double a, double b) { return a < b ? 1.0 : 0.0; }
static double br_le(double a, double b) { return a <= b ? 1.0 : 0.0; }
static double br_gt(double a, double b) { return a > b ? 1.0 : 0.0; }
static double br_ge(double a, double b) { return a >= b ? 1.0 : 0.0; }

typedef struct bin_gc {
  const binop *op;
  int transpose_a; /* input 0 is stored transposed and viewed back through kiln_transpose */
} bin_gc;

static kiln_tensor *gc_binary(kiln_tensor *const *in, void *user) {
  const bin_gc *u = user;
  kiln_tensor *a = u->transpose_a ? kiln_transpose(in[0], -1, -2) : in[0];
  return u->op->fn(a, in[1]);
}

static void check_binary(kiln_ctx *ctx, const binop *op) {
  struct {
    kiln_shape a, b;
  } cases[] = {
      {.a = KILN_SHAPE(4, 3), .b = KILN_SHAPE(4, 3)},
      {.a = KILN_SHAPE(4, 3), .b = KILN_SHAPE(3)},
      {.a = KILN_SHAPE(3), .b = KILN_SHAPE(4, 3)},
      {.a = KILN_SHAPE(4, 1), .b = KILN_SHAPE(1, 5)},
      {.a = KILN_SHAPE(2, 1, 3), .b = KILN_SHAPE(4, 1)},
      {.a = KILN_SHAPE(4, 1), .b = KILN_SHAPE(2, 1, 3)},
      {.a = KILN_SCALAR_SHAPE, .b = KILN_SHAPE(2, 3)},
      {.a = KILN_SHAPE(2, 3), .b = KILN_SCALAR_SHAPE},
      {.a = KILN_SHAPE(33, 70), .b = KILN_SHAPE(70)},
      /* inputs indexed by the output's last dims (i % P) or first dims (i / P), with four
       * elements a thread where 4 divides P, and one where it does not */
      {.a = KILN_SHAPE(2, 3, 5, 8), .b = KILN_SHAPE(5, 8)},
      {.a = KILN_SHAPE(2, 3, 5, 8), .b = KILN_SHAPE(2, 3, 1, 1)},
      {.a = KILN_SHAPE(2, 3, 1, 1), .b = KILN_SHAPE(2, 3, 5, 7)},
      {.a = KILN_SHAPE(6, 1), .b = KILN_SHAPE(6, 4)},
      {.a = KILN_SHAPE(4, 12), .b = KILN_SHAPE(1, 12)},
  };
  ref_layout pairs[][2] = {{REF_PLAIN, REF_PLAIN}, {REF_TRANS, REF_PLAIN},  {REF_PLAIN, REF_TRANS},
                           {REF_SLICE, REF_SLICE}, {REF_EXPAND, REF_PLAIN}, {REF_PLAIN, REF_EXPAND},
                           {REF_TRANS, REF_SLICE}, {REF_ROWS, REF_EXPAND}};
  double atol = op->atol > 0 ? op->atol : 1e-5, rtol = op->rtol > 0 ? op->rtol : 1e-5;
  if (!op->grad) atol = rtol = 0; /* comparisons are exact */
  uint64_t seed = 300;
  char what[1024], da[160], db[160], so[96];
  for (size_t ci = 0; ci < sizeof cases / sizeof *cases; ci++) {
    for (size_t pi = 0; pi < sizeof pairs / sizeof *pairs; pi++) {
      kiln_shape sa = cases[ci].a, sb = cases[ci].b;
      ref_layout la = pairs[pi][0], lb = pairs[pi][1];
      if (!ref_layout_fits(sa, la) || !ref_layout_fits(sb, lb)) continue;
      kiln_step_begin(ctx);
      ref_opnd A = ref_opnd_new(ctx, sa, la, seed++, &op->fa);
      ref_opnd B = ref_opnd_new(ctx, sb, lb, seed++, &op->fb);
      kiln_shape both[2] = {sa, sb}, os;
      cr_assert(ref_broadcast(2, both, &os), "the test's shapes broadcast");
      int64_t n = ref_numel(os);
      double *want = ref_dalloc(n);
      int64_t co[KILN_MAX_DIMS];
      for (int64_t i = 0; i < n; i++) {
        ref_coords(os, i, co);
        want[i] = op->ref(A.v[ref_broadcast_src(os, co, sa)], B.v[ref_broadcast_src(os, co, sb)]);
      }
      ref_opnd_desc(&A, la, da, sizeof da);
      ref_opnd_desc(&B, lb, db, sizeof db);
      kiln_shape_str(os, so, sizeof so);
      snprintf(what, sizeof what, "%s of %s and %s (output %s)", op->name, da, db, so);
      ref_expect_close(ctx, op->fn(A.t, B.t), os, want, atol, rtol, what);
      free(want);
      ref_opnd_free(&A);
      ref_opnd_free(&B);
    }
  }
  /* equal elements: an input against itself and against its transpose (ties on the diagonal) */
  {
    kiln_step_begin(ctx);
    float *h;
    kiln_tensor *x = ref_rand_tensor(ctx, KILN_SHAPE(4, 4), 999, &op->fb, 0, &h);
    double want[16], want_t[16];
    for (int r = 0; r < 4; r++)
      for (int c = 0; c < 4; c++) {
        want[r * 4 + c] = op->ref(h[r * 4 + c], h[r * 4 + c]);
        want_t[r * 4 + c] = op->ref(h[r * 4 + c], h[c * 4 + r]);
      }
    snprintf(what, sizeof what, "%s of a [4,4] input and itself", op->name);
    ref_expect_close(ctx, op->fn(x, x), KILN_SHAPE(4, 4), want, atol, rtol, what);
    snprintf(what, sizeof what, "%s of a [4,4] input and its transpose", op->name);
    ref_expect_close(ctx, op->fn(x, kiln_transpose(x, 0, 1)), KILN_SHAPE(4, 4), want_t, atol, rtol,
                     what);
    kiln_tensor_free(x);
    free(h);
  }
  if (!op->grad) return;
  struct {
    kiln_shape a, b;
    int ta;
  } gcases[] = {
      {.a = KILN_SHAPE(4, 3), .b = KILN_SHAPE(3)},
      {.a = KILN_SHAPE(4, 1), .b = KILN_SHAPE(1, 5)},
      {.a = KILN_SHAPE(2, 1, 3), .b = KILN_SHAPE(4, 1)},
      {.a = KILN_SHAPE(2, 3), .b = KILN_SCALAR_SHAPE},
      {.a = KILN_SHAPE(3, 4), .b = KILN_SHAPE(4, 1), .ta = 1}, /* viewed as (4,3) */
  };
  for (size_t ci = 0; ci < sizeof gcases / sizeof *gcases; ci++) {
    kiln_tensor *in[2] = {ref_rand_tensor(ctx, gcases[ci].a, 50 + ci, &op->ga, 1, NULL),
                          ref_rand_tensor(ctx, gcases[ci].b, 70 + ci, &op->gb, 1, NULL)};
    bin_gc u = {.op = op, .transpose_a = gcases[ci].ta};
    kiln_shape_str(gcases[ci].a, da, sizeof da);
    kiln_shape_str(gcases[ci].b, db, sizeof db);
    snprintf(what, sizeof what, "%s of %s%s and %s", op->name, da,
             gcases[ci].ta ? " (transposed view)" : "", db);
    ref_expect_gradcheck(ctx, what, gc_binary, 2, in, &u);
    kiln_tensor_free(in[0]);
    kiln_tensor_free(in[1]);
  }
}

/* maximum/minimum gradient inputs: a on the grid 0.2k, b on 0.2k + 0.1, so |a - b| >= 0.1 */
#define GRID_A ((ref_gen){.lo = -1, .hi = 1, .quant = 0.2f})
#define GRID_B ((ref_gen){.lo = -1, .hi = 1, .quant = 0.2f, .qoff = 0.1f})
/* comparison inputs: five levels, so many elements are equal */
#define LEVELS ((ref_gen){.lo = -1, .hi = 1, .quant = 0.5f})

#define BINARY_TEST(id, ...)                                                                       \
  Test(gpu_ops, id) {                                                                              \
    TH_GPU_CTX_EAGER(ctx);                                                                         \
    binop op = {.name = #id, .fn = kiln_##id, .ref = br_##id, __VA_ARGS__};                        \
    check_binary(ctx, &op);                                                                        \
    th_ctx_free(ctx);                                                                              \
  }

BINARY_TEST(add, .fa = REF_GEN(-2, 2), .fb = REF_GEN(-2, 2), .ga = REF_GEN(-2, 2),
            .gb = REF_GEN(-2, 2), .grad = 1)
BINARY_TEST(sub, .fa = REF_GEN(-2, 2), .fb = REF_GEN(-2, 2), .ga = REF_GEN(-2, 2),
            .gb = REF_GEN(-2, 2), .grad = 1)
BINARY_TEST(mul, .fa = REF_GEN(-2, 2), .fb = REF_GEN(-2, 2), .ga = REF_GEN(-2, 2),
            .gb = REF_GEN(-2, 2), .grad = 1)
BINARY_TEST(div, .fa = REF_GEN(-2, 2), .fb = REF_GEN(0.5f, 2), .ga = REF_GEN(-2, 2),
            .gb = REF_GEN(0.5f, 2), .grad = 1)
BINARY_TEST(maximum, .fa = REF_GEN(-2, 2), .fb = REF_GEN(-2, 2), .ga = GRID_A, .gb = GRID_B,
            .grad = 1)
BINARY_TEST(minimum, .fa = REF_GEN(-2, 2), .fb = REF_GEN(-2, 2), .ga = GRID_A, .gb = GRID_B,
            .grad = 1)
BINARY_TEST(eq, .fa = LEVELS, .fb = LEVELS)
BINARY_TEST(ne, .fa = LEVELS, .fb = LEVELS)
BINARY_TEST(lt, .fa = LEVELS, .fb = LEVELS)
BINARY_TEST(le, .fa = LEVELS, .fb = LEVELS)
BINARY_TEST(gt, .fa = LEVELS, .fb = LEVELS)
BINARY_TEST(ge, .fa = LEVELS, .fb = LEVELS)

/* ---------------------------------------------------------------- where */

typedef struct where_gc {
  kiln_tensor *cond;
} where_gc;

static kiln_tensor *gc_where(kiln_tensor *const *in, void *user) {
  const where_gc *u = user;
  return kiln_where(u->cond, in[0], in[1]);
}

Test(gpu_ops, where) {
  TH_GPU_CTX_EAGER(ctx);
  struct {
    kiln_shape c, a, b;
    ref_layout lc, la, lb;
  } cases[] = {
      {.c = KILN_SHAPE(4, 3), .a = KILN_SHAPE(4, 3), .b = KILN_SHAPE(4, 3)},
      {.c = KILN_SHAPE(4, 3),
       .a = KILN_SHAPE(4, 3),
       .b = KILN_SHAPE(4, 3),
       .lc = REF_TRANS,
       .la = REF_SLICE,
       .lb = REF_EXPAND},
      {.c = KILN_SHAPE(4, 1), .a = KILN_SHAPE(4, 3), .b = KILN_SHAPE(3)},
      {.c = KILN_SHAPE(4, 1), .a = KILN_SHAPE(4, 3), .b = KILN_SHAPE(3), .la = REF_TRANS},
      {.c = KILN_SHAPE(3), .a = KILN_SHAPE(2, 1, 3), .b = KILN_SHAPE(4, 1)},
      {.c = KILN_SHAPE(33, 70), .a = KILN_SHAPE(70), .b = KILN_SHAPE(33, 1), .lc = REF_ROWS},
  };
  /* cond values -1, 0, 1: both nonzero values select a */
  ref_gen cgen = {.lo = -1.4f, .hi = 1.4f, .quant = 1};
  char what[1024], dc[160], da[160], db[160];
  for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
    kiln_step_begin(ctx);
    ref_opnd C = ref_opnd_new(ctx, cases[i].c, cases[i].lc, 400 + i, &cgen);
    ref_opnd A = ref_opnd_new(ctx, cases[i].a, cases[i].la, 420 + i, &REF_GEN(-2, 2));
    ref_opnd B = ref_opnd_new(ctx, cases[i].b, cases[i].lb, 440 + i, &REF_GEN(-2, 2));
    kiln_shape all[3] = {C.s, A.s, B.s}, os;
    cr_assert(ref_broadcast(3, all, &os), "the test's shapes broadcast");
    int64_t n = ref_numel(os), co[KILN_MAX_DIMS];
    double *want = ref_dalloc(n);
    for (int64_t k = 0; k < n; k++) {
      ref_coords(os, k, co);
      want[k] = C.v[ref_broadcast_src(os, co, C.s)] != 0 ? A.v[ref_broadcast_src(os, co, A.s)]
                                                         : B.v[ref_broadcast_src(os, co, B.s)];
    }
    ref_opnd_desc(&C, cases[i].lc, dc, sizeof dc);
    ref_opnd_desc(&A, cases[i].la, da, sizeof da);
    ref_opnd_desc(&B, cases[i].lb, db, sizeof db);
    snprintf(what, sizeof what, "where(cond %s, a %s, b %s)", dc, da, db);
    ref_expect_close(ctx, kiln_where(C.t, A.t, B.t), os, want, 0, 0, what);
    free(want);
    ref_opnd_free(&C);
    ref_opnd_free(&A);
    ref_opnd_free(&B);
  }
  /* gradients through a and b (cond carries none) */
  float c41[] = {1, 0, -2, 0};
  float c43[] = {1, 0, 0, 1, 1, 0, 0, 0, 1, -1, 1, 0};
  struct {
    kiln_shape c, a, b;
    const float *ch;
  } gcases[] = {
      {.c = KILN_SHAPE(4, 1), .a = KILN_SHAPE(4, 3), .b = KILN_SHAPE(3), .ch = c41},
      {.c = KILN_SHAPE(4, 3), .a = KILN_SHAPE(4, 3), .b = KILN_SHAPE(4, 3), .ch = c43},
  };
  for (size_t i = 0; i < sizeof gcases / sizeof *gcases; i++) {
    where_gc u = {.cond = ref_upload(ctx, gcases[i].c, gcases[i].ch)};
    kiln_tensor *in[2] = {ref_rand_tensor(ctx, gcases[i].a, 460 + i, &REF_GEN(-2, 2), 1, NULL),
                          ref_rand_tensor(ctx, gcases[i].b, 480 + i, &REF_GEN(-2, 2), 1, NULL)};
    kiln_shape_str(gcases[i].c, dc, sizeof dc);
    kiln_shape_str(gcases[i].a, da, sizeof da);
    kiln_shape_str(gcases[i].b, db, sizeof db);
    snprintf(what, sizeof what, "where(cond %s, a %s, b %s)", dc, da, db);
    ref_expect_gradcheck(ctx, what, gc_where, 2, in, &u);
    kiln_tensor_free(in[0]);
    kiln_tensor_free(in[1]);
    kiln_tensor_free(u.cond);
  }
  th_ctx_free(ctx);
}
