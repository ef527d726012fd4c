/*
 * test_gpu_ops_unary.c: the elementwise ops of one input on the GPU (neg, exp, log, sqrt, rsqrt,
 * tanh, sigmoid, relu, both GELUs, and the ops with scalar arguments: add_scalar, mul_scalar,
 * pow_scalar, clamp) against float64 references from the same inputs, read contiguous and through
 * transposed, sliced and expanded views, and their gradients against central finite differences
 * (kiln_gradcheck); then cast, which has no gradient, and full, of no input at all.
 * Without a GPU every test skips, saying why.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ref.h"

#define TEST_PI 3.14159265358979323846

/* ---------------------------------------------------------------- unary elementwise ops */

typedef struct unop {
  const char *name;
  kiln_tensor *(*fn)(kiln_tensor *a, const float *p);
  double (*ref)(double x, const float *p);
  float p[2];        /* the op's scalar arguments */
  ref_gen fwd, grad; /* input values for the forward and the gradient checks */
  double atol, rtol;
} unop;

#define UNARY_OP(id, call, refexpr)                                                                \
  static kiln_tensor *un_##id(kiln_tensor *a, const float *p) {                                    \
    (void)p;                                                                                       \
    return call;                                                                                   \
  }                                                                                                \
  static double ur_##id(double x, const float *p) {                                                \
    (void)p;                                                                                       \
    return refexpr;                                                                                \
  }
UNARY_OP(neg, kiln_neg(a), -x)
UNARY_OP(exp, kiln_exp(a), exp(x))
UNARY_OP(log, kiln_log(a), log(x))
UNARY_OP(sqrt, kiln_sqrt(a), sqrt(x))
UNARY_OP(rsqrt, kiln_rsqrt(a), 1.0 / sqrt(x))
UNARY_OP(tanh, kiln_tanh(a), tanh(x))
UNARY_OP(sigmoid, kiln_sigmoid(a), 1.0 / (1.0 + exp(-x)))
UNARY_OP(relu, kiln_relu(a), x > 0 ? x : 0.0)
UNARY_OP(gelu_erf, kiln_gelu(a, KILN_GELU_ERF), 0.5 * x * (1.0 + erf(x / sqrt(2.0))))
UNARY_OP(gelu_tanh, kiln_gelu(a, KILN_GELU_TANH),
         0.5 * x * (1.0 + tanh(sqrt(2.0 / TEST_PI) * (x + 0.044715 * x * x * x))))
UNARY_OP(add_scalar, kiln_add_scalar(a, p[0]), x + (double)p[0])
UNARY_OP(mul_scalar, kiln_mul_scalar(a, p[0]), x *(double)p[0])
UNARY_OP(pow_scalar, kiln_pow_scalar(a, p[0]), pow(x, (double)p[0]))
UNARY_OP(clamp, kiln_clamp(a, p[0], p[1]),
         x < (double)p[0] ? (double)p[0] : (x > (double)p[1] ? (double)p[1] : x))
#undef UNARY_OP

typedef struct un_gc {
  const unop *op;
  int transpose; /* apply the op to a transposed view of the input */
} un_gc;

static kiln_tensor *gc_unary(kiln_tensor *const *in, void *user) {
  const un_gc *u = user;
  kiln_tensor *x = u->transpose ? kiln_transpose(in[0], 0, 1) : in[0];
  return u->op->fn(x, u->op->p);
}

/* Forward over several shapes and layouts; gradcheck on a contiguous and a transposed input. */
static void check_unary(kiln_ctx *ctx, const unop *op) {
  ref_check_unary_forward(ctx, op->name, op->fn, op->ref, op->p, &op->fwd, 100, op->atol, op->rtol);
  char what[1024];
  for (int t = 0; t < 2; t++) {
    kiln_tensor *x = ref_rand_tensor(ctx, KILN_SHAPE(3, 4), 7 + (uint64_t)t, &op->grad, 1, NULL);
    un_gc u = {.op = op, .transpose = t};
    snprintf(what, sizeof what, "%s of a %s [3,4] input", op->name,
             t ? "transposed" : "contiguous");
    ref_expect_gradcheck(ctx, what, gc_unary, 1, &x, &u);
    kiln_tensor_free(x);
  }
}

#define KINK(k0, m) .nkinks = 1, .kinks = {k0}, .margin = (m)

Test(gpu_ops, neg) {
  TH_GPU_CTX_EAGER(ctx);
  unop op = {
      .name = "neg", .fn = un_neg, .ref = ur_neg, .fwd = REF_GEN(-2, 2), .grad = REF_GEN(-2, 2)};
  check_unary(ctx, &op);
  th_ctx_free(ctx);
}

Test(gpu_ops, add_scalar) {
  TH_GPU_CTX_EAGER(ctx);
  float s[] = {1.5f, -0.25f};
  for (int i = 0; i < 2; i++) {
    char name[64];
    snprintf(name, sizeof name, "add_scalar(%g)", (double)s[i]);
    unop op = {.name = name,
               .fn = un_add_scalar,
               .ref = ur_add_scalar,
               .p = {s[i]},
               .fwd = REF_GEN(-2, 2),
               .grad = REF_GEN(-2, 2)};
    check_unary(ctx, &op);
  }
  th_ctx_free(ctx);
}

Test(gpu_ops, mul_scalar) {
  TH_GPU_CTX_EAGER(ctx);
  float s[] = {-2.5f, 0.5f};
  for (int i = 0; i < 2; i++) {
    char name[64];
    snprintf(name, sizeof name, "mul_scalar(%g)", (double)s[i]);
    unop op = {.name = name,
               .fn = un_mul_scalar,
               .ref = ur_mul_scalar,
               .p = {s[i]},
               .fwd = REF_GEN(-2, 2),
               .grad = REF_GEN(-2, 2)};
    check_unary(ctx, &op);
  }
  th_ctx_free(ctx);
}

Test(gpu_ops, pow_scalar) {
  TH_GPU_CTX_EAGER(ctx);
  /* integer exponents on signed inputs; 0.5 and -1 on positive ones */
  struct {
    float e;
    ref_gen fwd, grad;
  } cases[] = {
      {.e = 2.f, .fwd = REF_GEN(-2, 2), .grad = REF_GEN(-1.5f, 1.5f)},
      {.e = 3.f, .fwd = REF_GEN(-2, 2), .grad = REF_GEN(-1.5f, 1.5f)},
      {.e = 0.5f, .fwd = REF_GEN(0.05f, 4), .grad = REF_GEN(0.5f, 2)},
      {.e = -1.f, .fwd = REF_GEN(0.1f, 4), .grad = REF_GEN(0.5f, 2)},
  };
  for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
    char name[64];
    snprintf(name, sizeof name, "pow_scalar(%g)", (double)cases[i].e);
    unop op = {.name = name,
               .fn = un_pow_scalar,
               .ref = ur_pow_scalar,
               .p = {cases[i].e},
               .fwd = cases[i].fwd,
               .grad = cases[i].grad};
    check_unary(ctx, &op);
  }
  th_ctx_free(ctx);
}

Test(gpu_ops, exp) {
  TH_GPU_CTX_EAGER(ctx);
  unop op = {
      .name = "exp", .fn = un_exp, .ref = ur_exp, .fwd = REF_GEN(-3, 3), .grad = REF_GEN(-2, 2)};
  check_unary(ctx, &op);
  th_ctx_free(ctx);
}

Test(gpu_ops, log) {
  TH_GPU_CTX_EAGER(ctx);
  unop op = {.name = "log",
             .fn = un_log,
             .ref = ur_log,
             .fwd = REF_GEN(0.05f, 5),
             .grad = REF_GEN(0.5f, 2)};
  check_unary(ctx, &op);
  th_ctx_free(ctx);
}

Test(gpu_ops, sqrt) {
  TH_GPU_CTX_EAGER(ctx);
  unop op = {.name = "sqrt",
             .fn = un_sqrt,
             .ref = ur_sqrt,
             .fwd = REF_GEN(0.01f, 4),
             .grad = REF_GEN(0.5f, 2)};
  check_unary(ctx, &op);
  th_ctx_free(ctx);
}

Test(gpu_ops, rsqrt) {
  TH_GPU_CTX_EAGER(ctx);
  unop op = {.name = "rsqrt",
             .fn = un_rsqrt,
             .ref = ur_rsqrt,
             .fwd = REF_GEN(0.05f, 4),
             .grad = REF_GEN(0.5f, 2)};
  check_unary(ctx, &op);
  th_ctx_free(ctx);
}

Test(gpu_ops, tanh) {
  TH_GPU_CTX_EAGER(ctx);
  unop op = {
      .name = "tanh", .fn = un_tanh, .ref = ur_tanh, .fwd = REF_GEN(-3, 3), .grad = REF_GEN(-2, 2)};
  check_unary(ctx, &op);
  th_ctx_free(ctx);
}

Test(gpu_ops, sigmoid) {
  TH_GPU_CTX_EAGER(ctx);
  unop op = {.name = "sigmoid",
             .fn = un_sigmoid,
             .ref = ur_sigmoid,
             .fwd = REF_GEN(-6, 6),
             .grad = REF_GEN(-3, 3)};
  check_unary(ctx, &op);
  th_ctx_free(ctx);
}

Test(gpu_ops, relu) {
  TH_GPU_CTX_EAGER(ctx);
  unop op = {.name = "relu",
             .fn = un_relu,
             .ref = ur_relu,
             .fwd = REF_GEN(-2, 2),
             .grad = {.lo = -1.5f, .hi = 1.5f, KINK(0.f, 0.06f)}};
  check_unary(ctx, &op);
  th_ctx_free(ctx);
}

Test(gpu_ops, gelu_erf) {
  TH_GPU_CTX_EAGER(ctx);
  unop op = {.name = "gelu (erf)",
             .fn = un_gelu_erf,
             .ref = ur_gelu_erf,
             .fwd = REF_GEN(-4, 4),
             .grad = REF_GEN(-3, 3)};
  check_unary(ctx, &op);
  th_ctx_free(ctx);
}

Test(gpu_ops, gelu_tanh) {
  TH_GPU_CTX_EAGER(ctx);
  unop op = {.name = "gelu (tanh)",
             .fn = un_gelu_tanh,
             .ref = ur_gelu_tanh,
             .fwd = REF_GEN(-4, 4),
             .grad = REF_GEN(-3, 3)};
  check_unary(ctx, &op);
  th_ctx_free(ctx);
}

Test(gpu_ops, clamp) {
  TH_GPU_CTX_EAGER(ctx);
  unop op = {
      .name = "clamp(-0.5, 0.75)",
      .fn = un_clamp,
      .ref = ur_clamp,
      .p = {-0.5f, 0.75f},
      .fwd = REF_GEN(-2, 2),
      .grad = {.lo = -1.5f, .hi = 1.5f, .nkinks = 2, .kinks = {-0.5f, 0.75f}, .margin = 0.06f}};
  check_unary(ctx, &op);
  th_ctx_free(ctx);
}

/* ---------------------------------------------------------------- cast and full (no gradient) */

Test(gpu_ops, cast) {
  TH_GPU_CTX_EAGER(ctx);
  /* f32 -> i32 truncates towards zero */
  float h[15] = {2.f,    -2.f,   2.999f,  -2.999f,    0.5f, -0.5f, 0.f,   7.25f,
                 -7.75f, 100.9f, -100.9f, 1000000.5f, 3.f,  -1.f,  0.999f};
  int32_t want_i[15];
  double want_f[15];
  for (int i = 0; i < 15; i++) {
    want_i[i] = (int32_t)h[i];
    want_f[i] = (double)want_i[i];
  }
  kiln_step_begin(ctx);
  kiln_tensor *x = ref_upload(ctx, KILN_SHAPE(3, 5), h);
  kiln_tensor *xi = kiln_cast(x, KILN_DTYPE_I32);
  ref_expect_i32(ctx, xi, KILN_SHAPE(3, 5), want_i, "cast f32 -> i32 of [3,5] (truncation)");
  ref_expect_close(ctx, kiln_cast(xi, KILN_DTYPE_F32), KILN_SHAPE(3, 5), want_f, 0, 0,
                   "cast f32 -> i32 -> f32 of [3,5]");
  /* of a transposed view */
  int32_t want_t[15];
  for (int r = 0; r < 5; r++)
    for (int c = 0; c < 3; c++)
      want_t[r * 3 + c] = want_i[c * 5 + r];
  ref_expect_i32(ctx, kiln_cast(kiln_transpose(x, 0, 1), KILN_DTYPE_I32), KILN_SHAPE(5, 3), want_t,
                 "cast f32 -> i32 of a transposed [5,3] view");
  kiln_tensor_free(x);
  /* i32 -> f32 is exact below 2^24 */
  int32_t ih[8] = {-1000000, -3, 0, 7, 123456, 16777215, -16777215, 42};
  double want_if[8];
  for (int i = 0; i < 8; i++)
    want_if[i] = (double)ih[i];
  kiln_tensor *y = ref_upload_i32(ctx, KILN_SHAPE(2, 4), ih);
  ref_expect_close(ctx, kiln_cast(y, KILN_DTYPE_F32), KILN_SHAPE(2, 4), want_if, 0, 0,
                   "cast i32 -> f32 of [2,4]");
  kiln_tensor_free(y);
  th_ctx_free(ctx);
}

Test(gpu_ops, full) {
  TH_GPU_CTX_EAGER(ctx);
  kiln_step_begin(ctx);
  double want[12];
  for (int i = 0; i < 12; i++)
    want[i] = 2.5;
  ref_expect_close(ctx, kiln_full(ctx, KILN_SHAPE(3, 4), 2.5f), KILN_SHAPE(3, 4), want, 0, 0,
                   "full([3,4], 2.5)");
  double ws = -1.25;
  ref_expect_close(ctx, kiln_full(ctx, KILN_SCALAR_SHAPE, -1.25f), KILN_SCALAR_SHAPE, &ws, 0, 0,
                   "full([], -1.25)");
  double *wbig = ref_dalloc(1000 * 37);
  for (int i = 0; i < 1000 * 37; i++)
    wbig[i] = 0.125;
  ref_expect_close(ctx, kiln_full(ctx, KILN_SHAPE(1000, 37), 0.125f), KILN_SHAPE(1000, 37), wbig, 0,
                   0, "full([1000,37], 0.125)");
  free(wbig);
  /* in arithmetic, broadcast */
  float *h;
  kiln_tensor *x = ref_rand_tensor(ctx, KILN_SHAPE(3, 4), 2000, &REF_GEN(-2, 2), 0, &h);
  for (int i = 0; i < 12; i++)
    want[i] = (double)h[i] + 0.5;
  ref_expect_close(ctx, kiln_add(x, kiln_full(ctx, KILN_SHAPE(4), 0.5f)), KILN_SHAPE(3, 4), want,
                   1e-6, 1e-6, "add of a [3,4] input and full([4], 0.5)");
  kiln_tensor_free(x);
  free(h);
  th_ctx_free(ctx);
}
