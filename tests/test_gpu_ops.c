/*
 * test_gpu_ops.c: every op on the GPU against a float64 reference computed on the host from the
 * same inputs (forward), and against central finite differences through kiln_gradcheck
 * (backward). Inputs come contiguous and as views: transposed (kiln_transpose), sliced with
 * step 2 (kiln_slice, along the last axis or along rows) and expanded (kiln_expand). The host
 * references read views through an index map built independently of kiln (hmap below).
 * Without a GPU every test skips, saying why.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "helpers.h"
#include "philox.h"

#define TEST_PI 3.14159265358979323846

/* ---------------------------------------------------------------- small utilities */

static const char *err_of(kiln_ctx *ctx) {
  const char *e = kiln_ctx_error(ctx);
  return e ? e : "no error set";
}

static void *xmalloc(size_t n) {
  void *p = malloc(n ? n : 1);
  cr_assert_not_null(p, "out of host memory (%zu bytes)", n);
  return p;
}
static double *dalloc(int64_t n) { return xmalloc((size_t)(n > 0 ? n : 1) * sizeof(double)); }
static float *falloc(int64_t n) { return xmalloc((size_t)(n > 0 ? n : 1) * sizeof(float)); }

static int64_t numel_of(kiln_shape s) {
  int64_t n = 1;
  for (int i = 0; i < s.ndim; i++)
    n *= s.d[i];
  return n;
}

static int shape_eq(kiln_shape a, kiln_shape b) {
  if (a.ndim != b.ndim) return 0;
  for (int i = 0; i < a.ndim; i++)
    if (a.d[i] != b.d[i]) return 0;
  return 1;
}

static int norm_ax(int a, int nd) { return a < 0 ? a + nd : a; }

/* Row-major coordinates of linear index lin in s, and back. */
static void coords_of(kiln_shape s, int64_t lin, int64_t *c) {
  for (int d = s.ndim - 1; d >= 0; d--) {
    c[d] = s.d[d] ? lin % s.d[d] : 0;
    lin = s.d[d] ? lin / s.d[d] : 0;
  }
}
static int64_t lin_of(kiln_shape s, const int64_t *c) {
  int64_t l = 0;
  for (int d = 0; d < s.ndim; d++)
    l = l * s.d[d] + c[d];
  return l;
}

/* NumPy broadcasting of n shapes. */
static kiln_shape bcast_shape(int n, const kiln_shape *in) {
  kiln_shape o = {.ndim = 0};
  for (int i = 0; i < n; i++)
    if (in[i].ndim > o.ndim) o.ndim = in[i].ndim;
  for (int d = 0; d < o.ndim; d++)
    o.d[d] = 1;
  for (int i = 0; i < n; i++)
    for (int j = 0; j < in[i].ndim; j++) {
      int d = o.ndim - in[i].ndim + j;
      if (in[i].d[j] != 1) o.d[d] = in[i].d[j];
    }
  return o;
}
/* The linear index into a dense tensor of shape in that the output coordinate co reads. */
static int64_t bcast_src(kiln_shape out, const int64_t *co, kiln_shape in) {
  int lead = out.ndim - in.ndim;
  int64_t l = 0;
  for (int j = 0; j < in.ndim; j++)
    l = l * in.d[j] + (in.d[j] == 1 ? 0 : co[j + lead]);
  return l;
}

/* Asserts t is not NULL and has shape want. */
static void expect_shape(kiln_ctx *ctx, kiln_tensor *t, kiln_shape want, const char *what) {
  cr_assert_not_null(t, "%s: the op returned NULL: %s", what, err_of(ctx));
  char g[96], w[96];
  kiln_shape_str(kiln_tensor_shape(t), g, sizeof g);
  kiln_shape_str(want, w, sizeof w);
  cr_assert(shape_eq(kiln_tensor_shape(t), want), "%s: output shape %s, want %s", what, g, w);
}

static float *read_f32(kiln_ctx *ctx, kiln_tensor *t, const char *what) {
  cr_assert_not_null(t, "%s: NULL tensor: %s", what, err_of(ctx));
  cr_assert_eq(kiln_tensor_dtype(t), KILN_DTYPE_F32, "%s: dtype %s, want f32", what,
               kiln_dtype_name(kiln_tensor_dtype(t)));
  int64_t n = kiln_tensor_numel(t);
  float *h = falloc(n);
  kiln_status st = kiln_tensor_to_host(t, h, (size_t)n * sizeof *h);
  cr_assert_eq(st, KILN_OK, "%s: reading the output failed: %s", what, err_of(ctx));
  return h;
}

static int32_t *read_i32(kiln_ctx *ctx, kiln_tensor *t, const char *what) {
  cr_assert_not_null(t, "%s: NULL tensor: %s", what, err_of(ctx));
  cr_assert_eq(kiln_tensor_dtype(t), KILN_DTYPE_I32, "%s: dtype %s, want i32", what,
               kiln_dtype_name(kiln_tensor_dtype(t)));
  int64_t n = kiln_tensor_numel(t);
  int32_t *h = xmalloc((size_t)(n > 0 ? n : 1) * sizeof *h);
  kiln_status st = kiln_tensor_to_host(t, h, (size_t)n * sizeof *h);
  cr_assert_eq(st, KILN_OK, "%s: reading the output failed: %s", what, err_of(ctx));
  return h;
}

/* Asserts t has shape ws and f32 values within atol + rtol * |want| of want. */
static void expect_close(kiln_ctx *ctx, kiln_tensor *t, kiln_shape ws, const double *want,
                         double atol, double rtol, const char *what) {
  expect_shape(ctx, t, ws, what);
  float *got = read_f32(ctx, t, what);
  th_assert_close(got, want, numel_of(ws), atol, rtol, what);
  free(got);
  th_assert_ok(ctx);
}

static void expect_i32(kiln_ctx *ctx, kiln_tensor *t, kiln_shape ws, const int32_t *want,
                       const char *what) {
  expect_shape(ctx, t, ws, what);
  int32_t *got = read_i32(ctx, t, what);
  for (int64_t i = 0; i < numel_of(ws); i++)
    cr_assert_eq(got[i], want[i], "%s: element %lld: got %d, want %d", what, (long long)i,
                 (int)got[i], (int)want[i]);
  free(got);
  th_assert_ok(ctx);
}

/* Runs kiln_gradcheck with its defaults (eps 1e-2, atol 1e-2, rtol 1e-2) and asserts it passed. */
static void expect_gradcheck(kiln_ctx *ctx, const char *what, kiln_gradcheck_fn fn, int n,
                             kiln_tensor *const *in, void *user) {
  char report[512] = "";
  kiln_status st = kiln_gradcheck(ctx, fn, n, in, user, NULL, report, sizeof report);
  cr_assert_eq(st, KILN_OK, "gradcheck of %s: %s: %s (context error: %s)", what,
               kiln_status_name(st), report[0] ? report : "no element reported", err_of(ctx));
  th_assert_ok(ctx);
}

/* ---------------------------------------------------------------- random inputs */

/* Uniform in [lo, hi); quant > 0 rounds to qoff + k * quant (ties between inputs); values are
 * kept at least margin away from each kink (so finite differences do not straddle it). */
typedef struct gen {
  float lo, hi;
  float quant, qoff;
  int nkinks;
  float kinks[2];
  float margin;
} gen;
#define GEN(l, h) ((gen){.lo = (l), .hi = (h)})

static void gen_fill(float *p, int64_t n, uint64_t seed, const gen *g) {
  th_fill(p, n, seed, g->lo, g->hi);
  for (int64_t i = 0; i < n; i++) {
    if (g->quant > 0) p[i] = g->qoff + g->quant * roundf((p[i] - g->qoff) / g->quant);
    for (int k = 0; k < g->nkinks; k++)
      if (fabsf(p[i] - g->kinks[k]) < g->margin)
        p[i] = g->kinks[k] + (p[i] >= g->kinks[k] ? g->margin : -g->margin);
  }
}

/* Distinct values 0.1 apart in a scrambled order (no ties, even after a 1e-2 perturbation). */
static void distinct_fill(float *p, int64_t n, uint64_t seed) {
  int64_t step = 7 + 2 * (int64_t)(seed % 4);
  for (;;) {
    int64_t a = step, b = n;
    while (b) {
      int64_t t = a % b;
      a = b;
      b = t;
    }
    if (a == 1) break;
    step += 2;
  }
  for (int64_t i = 0; i < n; i++)
    p[i] = 0.1f * (float)((i * step + (int64_t)seed) % n) - 0.05f * (float)n;
}

static kiln_tensor *upload(kiln_ctx *ctx, kiln_shape s, const float *h) {
  kiln_tensor *t = kiln_tensor_from_host(ctx, KILN_DTYPE_F32, s, h);
  char b[96];
  kiln_shape_str(s, b, sizeof b);
  cr_assert_not_null(t, "kiln_tensor_from_host f32 %s: %s", b, err_of(ctx));
  return t;
}

static kiln_tensor *upload_i32(kiln_ctx *ctx, kiln_shape s, const int32_t *h) {
  kiln_tensor *t = kiln_tensor_from_host(ctx, KILN_DTYPE_I32, s, h);
  char b[96];
  kiln_shape_str(s, b, sizeof b);
  cr_assert_not_null(t, "kiln_tensor_from_host i32 %s: %s", b, err_of(ctx));
  return t;
}

static void set_grad(kiln_ctx *ctx, kiln_tensor *t) {
  kiln_tensor_set_requires_grad(t, 1);
  th_assert_ok(ctx);
}

/* A persistent f32 tensor of values from g; grad: it requires grad; host: a malloc'd copy. */
static kiln_tensor *rand_tensor(kiln_ctx *ctx, kiln_shape s, uint64_t seed, const gen *g, int grad,
                                float **host) {
  int64_t n = numel_of(s);
  float *h = falloc(n);
  gen_fill(h, n, seed, g);
  kiln_tensor *t = upload(ctx, s, h);
  if (grad) set_grad(ctx, t);
  if (host)
    *host = h;
  else
    free(h);
  return t;
}

/* ---------------------------------------------------------------- views, on both sides */

typedef enum vkind { V_T, V_PERMUTE, V_SLICE, V_EXPAND, V_RESHAPE, V_CONTIG } vkind;

/* One view step: V_T (axis, axis1), V_PERMUTE (order), V_SLICE (axis, start, end, step),
 * V_EXPAND / V_RESHAPE (shape, -1 allowed), V_CONTIG. */
typedef struct vstep {
  vkind k;
  int axis, axis1;
  int64_t start, end, step;
  kiln_axes order;
  kiln_shape shape;
} vstep;

#define MAX_STEPS 3
typedef struct vchain {
  int n;
  vstep st[MAX_STEPS];
} vchain;

static kiln_tensor *vstep_apply(kiln_tensor *x, const vstep *v) {
  switch (v->k) {
  case V_T: return kiln_transpose(x, v->axis, v->axis1);
  case V_PERMUTE: return kiln_permute(x, v->order);
  case V_SLICE: return kiln_slice(x, v->axis, v->start, v->end, v->step);
  case V_EXPAND: return kiln_expand(x, v->shape);
  case V_RESHAPE: return kiln_reshape(x, v->shape);
  case V_CONTIG: return kiln_contiguous(x);
  }
  return NULL;
}

static kiln_tensor *chain_apply(kiln_tensor *x, const vchain *c) {
  for (int i = 0; i < c->n && x; i++)
    x = vstep_apply(x, &c->st[i]);
  return x;
}

/* The host side: idx[i] is the element of the base tensor that element i (row-major) of the
 * view reads. */
typedef struct hmap {
  kiln_shape s;
  int64_t *idx;
} hmap;

static hmap hmap_identity(kiln_shape s) {
  hmap m = {.s = s};
  int64_t n = numel_of(s);
  m.idx = xmalloc((size_t)(n > 0 ? n : 1) * sizeof *m.idx);
  for (int64_t i = 0; i < n; i++)
    m.idx[i] = i;
  return m;
}

static hmap hmap_step(hmap m, const vstep *v) {
  int nd = m.s.ndim;
  hmap r = {.s = m.s};
  kiln_axes order = {.n = nd};
  int ax = 0, lead = 0;
  int64_t start = 0, step = 1;
  switch (v->k) {
  case V_CONTIG: return m;
  case V_RESHAPE: {
    r.s = v->shape;
    int64_t known = 1;
    int infer = -1;
    for (int d = 0; d < r.s.ndim; d++) {
      if (r.s.d[d] == -1)
        infer = d;
      else
        known *= r.s.d[d];
    }
    if (infer >= 0) r.s.d[infer] = known ? numel_of(m.s) / known : 0;
    r.idx = m.idx;
    return r;
  }
  case V_T:
  case V_PERMUTE:
    for (int i = 0; i < nd; i++)
      order.a[i] = i;
    if (v->k == V_T) {
      int a0 = norm_ax(v->axis, nd), a1 = norm_ax(v->axis1, nd);
      order.a[a0] = a1;
      order.a[a1] = a0;
    } else {
      for (int i = 0; i < nd; i++)
        order.a[i] = norm_ax(v->order.a[i], nd);
    }
    for (int i = 0; i < nd; i++)
      r.s.d[i] = m.s.d[order.a[i]];
    break;
  case V_SLICE: {
    ax = norm_ax(v->axis, nd);
    int64_t len = m.s.d[ax], end = v->end;
    start = v->start;
    step = v->step;
    if (start < 0) start += len;
    if (end < 0) end += len;
    if (start < 0) start = 0;
    if (end > len) end = len;
    if (start > len) start = len;
    if (end < start) end = start;
    r.s.d[ax] = (end - start + step - 1) / step;
    break;
  }
  case V_EXPAND:
    r.s = v->shape;
    lead = r.s.ndim - nd;
    for (int d = 0; d < r.s.ndim; d++)
      if (d >= lead && r.s.d[d] == -1) r.s.d[d] = m.s.d[d - lead];
    break;
  }
  int64_t n = numel_of(r.s);
  r.idx = xmalloc((size_t)(n > 0 ? n : 1) * sizeof *r.idx);
  int64_t co[KILN_MAX_DIMS], ci[KILN_MAX_DIMS];
  for (int64_t i = 0; i < n; i++) {
    coords_of(r.s, i, co);
    switch (v->k) {
    case V_T:
    case V_PERMUTE:
      for (int d = 0; d < nd; d++)
        ci[order.a[d]] = co[d];
      break;
    case V_SLICE:
      for (int d = 0; d < nd; d++)
        ci[d] = co[d];
      ci[ax] = start + co[ax] * step;
      break;
    case V_EXPAND:
      for (int j = 0; j < nd; j++)
        ci[j] = m.s.d[j] == 1 ? 0 : co[j + lead];
      break;
    default: break;
    }
    r.idx[i] = m.idx[lin_of(m.s, ci)];
  }
  free(m.idx);
  return r;
}

static hmap chain_map(kiln_shape base, const vchain *c) {
  hmap m = hmap_identity(base);
  for (int i = 0; i < c->n; i++)
    m = hmap_step(m, &c->st[i]);
  return m;
}

/* ---------------------------------------------------------------- operands in several layouts */

typedef enum layout { L_PLAIN, L_TRANS, L_SLICE, L_ROWS, L_EXPAND } layout;
static const char *const layout_names[] = {"contiguous", "transposed", "sliced (last axis, step 2)",
                                           "sliced (rows, step 2)", "expanded (axis 0)"};

static int layout_fits(kiln_shape s, layout l) {
  switch (l) {
  case L_PLAIN: return 1;
  case L_TRANS:
  case L_ROWS: return s.ndim >= 2;
  case L_SLICE: return s.ndim >= 1;
  case L_EXPAND: return s.ndim >= 1 && s.d[0] > 1;
  }
  return 0;
}

/* The base shape and the one view step that turn a base tensor into shape s laid out as l. */
static kiln_shape layout_base(kiln_shape s, layout l, vchain *c) {
  kiln_shape b = s;
  int nd = s.ndim;
  memset(c, 0, sizeof *c);
  switch (l) {
  case L_PLAIN: break;
  case L_TRANS:
    b.d[nd - 1] = s.d[nd - 2];
    b.d[nd - 2] = s.d[nd - 1];
    c->st[c->n++] = (vstep){.k = V_T, .axis = -1, .axis1 = -2};
    break;
  case L_SLICE:
    b.d[nd - 1] = 2 * s.d[nd - 1];
    c->st[c->n++] = (vstep){.k = V_SLICE, .axis = -1, .start = 1, .end = b.d[nd - 1], .step = 2};
    break;
  case L_ROWS:
    b.d[nd - 2] = 2 * s.d[nd - 2];
    c->st[c->n++] = (vstep){.k = V_SLICE, .axis = -2, .start = 0, .end = b.d[nd - 2], .step = 2};
    break;
  case L_EXPAND:
    b.d[0] = 1;
    c->st[c->n++] = (vstep){.k = V_EXPAND, .shape = s};
    break;
  }
  return b;
}

/* An op input: a persistent base tensor, the view of it the op reads, and the view's values. */
typedef struct opnd {
  kiln_tensor *base;
  float *host; /* the base's values */
  kiln_tensor *t;
  double *v; /* the view's values, row-major */
  kiln_shape s;
} opnd;

static opnd opnd_new(kiln_ctx *ctx, kiln_shape s, layout l, uint64_t seed, const gen *g) {
  vchain c;
  kiln_shape bs = layout_base(s, l, &c);
  opnd o = {.s = s};
  o.base = rand_tensor(ctx, bs, seed, g, 0, &o.host);
  o.t = chain_apply(o.base, &c);
  char what[1024], b[96];
  kiln_shape_str(s, b, sizeof b);
  snprintf(what, sizeof what, "making a %s %s input", layout_names[l], b);
  expect_shape(ctx, o.t, s, what);
  hmap m = chain_map(bs, &c);
  int64_t n = numel_of(s);
  o.v = dalloc(n);
  for (int64_t i = 0; i < n; i++)
    o.v[i] = o.host[m.idx[i]];
  free(m.idx);
  return o;
}

static void opnd_free(opnd *o) {
  kiln_tensor_free(o->base);
  free(o->host);
  free(o->v);
}

static void opnd_desc(const opnd *o, layout l, char *buf, size_t n) {
  char b[96];
  kiln_shape_str(o->s, b, sizeof b);
  snprintf(buf, n, "%s %s", b, layout_names[l]);
}

/* ---------------------------------------------------------------- unary elementwise ops */

typedef struct unop {
  const char *name;
  kiln_tensor *(*fn)(kiln_tensor *a, const float *p);
  double (*ref)(double x, const float *p);
  float p[2];    /* the op's scalar arguments */
  gen fwd, grad; /* input values for the forward and the gradient checks */
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
  kiln_shape shapes[] = {KILN_SHAPE(5), KILN_SHAPE(4, 3), KILN_SHAPE(2, 3, 4), KILN_SHAPE(37, 65)};
  layout lays[] = {L_PLAIN, L_TRANS, L_SLICE, L_ROWS, L_EXPAND};
  double atol = op->atol > 0 ? op->atol : 1e-5, rtol = op->rtol > 0 ? op->rtol : 1e-5;
  uint64_t seed = 100;
  char what[1024], d[160];
  for (size_t si = 0; si < sizeof shapes / sizeof *shapes; si++) {
    for (size_t li = 0; li < sizeof lays / sizeof *lays; li++) {
      if (!layout_fits(shapes[si], lays[li])) continue;
      kiln_step_begin(ctx);
      opnd x = opnd_new(ctx, shapes[si], lays[li], seed++, &op->fwd);
      int64_t n = numel_of(x.s);
      double *want = dalloc(n);
      for (int64_t i = 0; i < n; i++)
        want[i] = op->ref(x.v[i], op->p);
      opnd_desc(&x, lays[li], d, sizeof d);
      snprintf(what, sizeof what, "%s of a %s input", op->name, d);
      expect_close(ctx, op->fn(x.t, op->p), x.s, want, atol, rtol, what);
      free(want);
      opnd_free(&x);
    }
  }
  for (int t = 0; t < 2; t++) {
    kiln_tensor *x = rand_tensor(ctx, KILN_SHAPE(3, 4), 7 + (uint64_t)t, &op->grad, 1, NULL);
    un_gc u = {.op = op, .transpose = t};
    snprintf(what, sizeof what, "%s of a %s [3,4] input", op->name,
             t ? "transposed" : "contiguous");
    expect_gradcheck(ctx, what, gc_unary, 1, &x, &u);
    kiln_tensor_free(x);
  }
}

#define KINK(k0, m) .nkinks = 1, .kinks = {k0}, .margin = (m)

Test(gpu_ops, neg) {
  TH_GPU_CTX_EAGER(ctx);
  unop op = {.name = "neg", .fn = un_neg, .ref = ur_neg, .fwd = GEN(-2, 2), .grad = GEN(-2, 2)};
  check_unary(ctx, &op);
  kiln_ctx_free(ctx);
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
               .fwd = GEN(-2, 2),
               .grad = GEN(-2, 2)};
    check_unary(ctx, &op);
  }
  kiln_ctx_free(ctx);
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
               .fwd = GEN(-2, 2),
               .grad = GEN(-2, 2)};
    check_unary(ctx, &op);
  }
  kiln_ctx_free(ctx);
}

Test(gpu_ops, pow_scalar) {
  TH_GPU_CTX_EAGER(ctx);
  /* integer exponents on signed inputs; 0.5 and -1 on positive ones */
  struct {
    float e;
    gen fwd, grad;
  } cases[] = {
      {.e = 2.f, .fwd = GEN(-2, 2), .grad = GEN(-1.5f, 1.5f)},
      {.e = 3.f, .fwd = GEN(-2, 2), .grad = GEN(-1.5f, 1.5f)},
      {.e = 0.5f, .fwd = GEN(0.05f, 4), .grad = GEN(0.5f, 2)},
      {.e = -1.f, .fwd = GEN(0.1f, 4), .grad = GEN(0.5f, 2)},
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
  kiln_ctx_free(ctx);
}

Test(gpu_ops, exp) {
  TH_GPU_CTX_EAGER(ctx);
  unop op = {.name = "exp", .fn = un_exp, .ref = ur_exp, .fwd = GEN(-3, 3), .grad = GEN(-2, 2)};
  check_unary(ctx, &op);
  kiln_ctx_free(ctx);
}

Test(gpu_ops, log) {
  TH_GPU_CTX_EAGER(ctx);
  unop op = {
      .name = "log", .fn = un_log, .ref = ur_log, .fwd = GEN(0.05f, 5), .grad = GEN(0.5f, 2)};
  check_unary(ctx, &op);
  kiln_ctx_free(ctx);
}

Test(gpu_ops, sqrt) {
  TH_GPU_CTX_EAGER(ctx);
  unop op = {
      .name = "sqrt", .fn = un_sqrt, .ref = ur_sqrt, .fwd = GEN(0.01f, 4), .grad = GEN(0.5f, 2)};
  check_unary(ctx, &op);
  kiln_ctx_free(ctx);
}

Test(gpu_ops, rsqrt) {
  TH_GPU_CTX_EAGER(ctx);
  unop op = {
      .name = "rsqrt", .fn = un_rsqrt, .ref = ur_rsqrt, .fwd = GEN(0.05f, 4), .grad = GEN(0.5f, 2)};
  check_unary(ctx, &op);
  kiln_ctx_free(ctx);
}

Test(gpu_ops, tanh) {
  TH_GPU_CTX_EAGER(ctx);
  unop op = {.name = "tanh", .fn = un_tanh, .ref = ur_tanh, .fwd = GEN(-3, 3), .grad = GEN(-2, 2)};
  check_unary(ctx, &op);
  kiln_ctx_free(ctx);
}

Test(gpu_ops, sigmoid) {
  TH_GPU_CTX_EAGER(ctx);
  unop op = {.name = "sigmoid",
             .fn = un_sigmoid,
             .ref = ur_sigmoid,
             .fwd = GEN(-6, 6),
             .grad = GEN(-3, 3)};
  check_unary(ctx, &op);
  kiln_ctx_free(ctx);
}

Test(gpu_ops, relu) {
  TH_GPU_CTX_EAGER(ctx);
  unop op = {.name = "relu",
             .fn = un_relu,
             .ref = ur_relu,
             .fwd = GEN(-2, 2),
             .grad = {.lo = -1.5f, .hi = 1.5f, KINK(0.f, 0.06f)}};
  check_unary(ctx, &op);
  kiln_ctx_free(ctx);
}

Test(gpu_ops, gelu_erf) {
  TH_GPU_CTX_EAGER(ctx);
  unop op = {.name = "gelu (erf)",
             .fn = un_gelu_erf,
             .ref = ur_gelu_erf,
             .fwd = GEN(-4, 4),
             .grad = GEN(-3, 3)};
  check_unary(ctx, &op);
  kiln_ctx_free(ctx);
}

Test(gpu_ops, gelu_tanh) {
  TH_GPU_CTX_EAGER(ctx);
  unop op = {.name = "gelu (tanh)",
             .fn = un_gelu_tanh,
             .ref = ur_gelu_tanh,
             .fwd = GEN(-4, 4),
             .grad = GEN(-3, 3)};
  check_unary(ctx, &op);
  kiln_ctx_free(ctx);
}

Test(gpu_ops, clamp) {
  TH_GPU_CTX_EAGER(ctx);
  unop op = {
      .name = "clamp(-0.5, 0.75)",
      .fn = un_clamp,
      .ref = ur_clamp,
      .p = {-0.5f, 0.75f},
      .fwd = GEN(-2, 2),
      .grad = {.lo = -1.5f, .hi = 1.5f, .nkinks = 2, .kinks = {-0.5f, 0.75f}, .margin = 0.06f}};
  check_unary(ctx, &op);
  kiln_ctx_free(ctx);
}

/* ---------------------------------------------------------------- binary elementwise ops */

typedef struct binop {
  const char *name;
  kiln_tensor *(*fn)(kiln_tensor *, kiln_tensor *);
  double (*ref)(double, double);
  gen fa, fb; /* forward inputs */
  gen ga, gb; /* gradient-check inputs */
  int grad;   /* 0: comparisons, no gradient */
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
  };
  layout pairs[][2] = {{L_PLAIN, L_PLAIN}, {L_TRANS, L_PLAIN},  {L_PLAIN, L_TRANS},
                       {L_SLICE, L_SLICE}, {L_EXPAND, L_PLAIN}, {L_PLAIN, L_EXPAND},
                       {L_TRANS, L_SLICE}, {L_ROWS, L_EXPAND}};
  double atol = op->atol > 0 ? op->atol : 1e-5, rtol = op->rtol > 0 ? op->rtol : 1e-5;
  if (!op->grad) atol = rtol = 0; /* comparisons are exact */
  uint64_t seed = 300;
  char what[1024], da[160], db[160], so[96];
  for (size_t ci = 0; ci < sizeof cases / sizeof *cases; ci++) {
    for (size_t pi = 0; pi < sizeof pairs / sizeof *pairs; pi++) {
      kiln_shape sa = cases[ci].a, sb = cases[ci].b;
      layout la = pairs[pi][0], lb = pairs[pi][1];
      if (!layout_fits(sa, la) || !layout_fits(sb, lb)) continue;
      kiln_step_begin(ctx);
      opnd A = opnd_new(ctx, sa, la, seed++, &op->fa);
      opnd B = opnd_new(ctx, sb, lb, seed++, &op->fb);
      kiln_shape both[2] = {sa, sb};
      kiln_shape os = bcast_shape(2, both);
      int64_t n = numel_of(os);
      double *want = dalloc(n);
      int64_t co[KILN_MAX_DIMS];
      for (int64_t i = 0; i < n; i++) {
        coords_of(os, i, co);
        want[i] = op->ref(A.v[bcast_src(os, co, sa)], B.v[bcast_src(os, co, sb)]);
      }
      opnd_desc(&A, la, da, sizeof da);
      opnd_desc(&B, lb, db, sizeof db);
      kiln_shape_str(os, so, sizeof so);
      snprintf(what, sizeof what, "%s of %s and %s (output %s)", op->name, da, db, so);
      expect_close(ctx, op->fn(A.t, B.t), os, want, atol, rtol, what);
      free(want);
      opnd_free(&A);
      opnd_free(&B);
    }
  }
  /* equal elements: an input against itself and against its transpose (ties on the diagonal) */
  {
    kiln_step_begin(ctx);
    float *h;
    kiln_tensor *x = rand_tensor(ctx, KILN_SHAPE(4, 4), 999, &op->fb, 0, &h);
    double want[16], want_t[16];
    for (int r = 0; r < 4; r++)
      for (int c = 0; c < 4; c++) {
        want[r * 4 + c] = op->ref(h[r * 4 + c], h[r * 4 + c]);
        want_t[r * 4 + c] = op->ref(h[r * 4 + c], h[c * 4 + r]);
      }
    snprintf(what, sizeof what, "%s of a [4,4] input and itself", op->name);
    expect_close(ctx, op->fn(x, x), KILN_SHAPE(4, 4), want, atol, rtol, what);
    snprintf(what, sizeof what, "%s of a [4,4] input and its transpose", op->name);
    expect_close(ctx, op->fn(x, kiln_transpose(x, 0, 1)), KILN_SHAPE(4, 4), want_t, atol, rtol,
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
    kiln_tensor *in[2] = {rand_tensor(ctx, gcases[ci].a, 50 + ci, &op->ga, 1, NULL),
                          rand_tensor(ctx, gcases[ci].b, 70 + ci, &op->gb, 1, NULL)};
    bin_gc u = {.op = op, .transpose_a = gcases[ci].ta};
    kiln_shape_str(gcases[ci].a, da, sizeof da);
    kiln_shape_str(gcases[ci].b, db, sizeof db);
    snprintf(what, sizeof what, "%s of %s%s and %s", op->name, da,
             gcases[ci].ta ? " (transposed view)" : "", db);
    expect_gradcheck(ctx, what, gc_binary, 2, in, &u);
    kiln_tensor_free(in[0]);
    kiln_tensor_free(in[1]);
  }
}

/* maximum/minimum gradient inputs: a on the grid 0.2k, b on 0.2k + 0.1, so |a - b| >= 0.1 */
#define GRID_A ((gen){.lo = -1, .hi = 1, .quant = 0.2f})
#define GRID_B ((gen){.lo = -1, .hi = 1, .quant = 0.2f, .qoff = 0.1f})
/* comparison inputs: five levels, so many elements are equal */
#define LEVELS ((gen){.lo = -1, .hi = 1, .quant = 0.5f})

#define BINARY_TEST(id, ...)                                                                       \
  Test(gpu_ops, id) {                                                                              \
    TH_GPU_CTX_EAGER(ctx);                                                                         \
    binop op = {.name = #id, .fn = kiln_##id, .ref = br_##id, __VA_ARGS__};                        \
    check_binary(ctx, &op);                                                                        \
    kiln_ctx_free(ctx);                                                                            \
  }

BINARY_TEST(add, .fa = GEN(-2, 2), .fb = GEN(-2, 2), .ga = GEN(-2, 2), .gb = GEN(-2, 2), .grad = 1)
BINARY_TEST(sub, .fa = GEN(-2, 2), .fb = GEN(-2, 2), .ga = GEN(-2, 2), .gb = GEN(-2, 2), .grad = 1)
BINARY_TEST(mul, .fa = GEN(-2, 2), .fb = GEN(-2, 2), .ga = GEN(-2, 2), .gb = GEN(-2, 2), .grad = 1)
BINARY_TEST(div, .fa = GEN(-2, 2), .fb = GEN(0.5f, 2), .ga = GEN(-2, 2), .gb = GEN(0.5f, 2),
            .grad = 1)
BINARY_TEST(maximum, .fa = GEN(-2, 2), .fb = GEN(-2, 2), .ga = GRID_A, .gb = GRID_B, .grad = 1)
BINARY_TEST(minimum, .fa = GEN(-2, 2), .fb = GEN(-2, 2), .ga = GRID_A, .gb = GRID_B, .grad = 1)
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
    layout lc, la, lb;
  } cases[] = {
      {.c = KILN_SHAPE(4, 3), .a = KILN_SHAPE(4, 3), .b = KILN_SHAPE(4, 3)},
      {.c = KILN_SHAPE(4, 3),
       .a = KILN_SHAPE(4, 3),
       .b = KILN_SHAPE(4, 3),
       .lc = L_TRANS,
       .la = L_SLICE,
       .lb = L_EXPAND},
      {.c = KILN_SHAPE(4, 1), .a = KILN_SHAPE(4, 3), .b = KILN_SHAPE(3)},
      {.c = KILN_SHAPE(4, 1), .a = KILN_SHAPE(4, 3), .b = KILN_SHAPE(3), .la = L_TRANS},
      {.c = KILN_SHAPE(3), .a = KILN_SHAPE(2, 1, 3), .b = KILN_SHAPE(4, 1)},
      {.c = KILN_SHAPE(33, 70), .a = KILN_SHAPE(70), .b = KILN_SHAPE(33, 1), .lc = L_ROWS},
  };
  /* cond values -1, 0, 1: both nonzero values select a */
  gen cgen = {.lo = -1.4f, .hi = 1.4f, .quant = 1};
  char what[1024], dc[160], da[160], db[160];
  for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
    kiln_step_begin(ctx);
    opnd C = opnd_new(ctx, cases[i].c, cases[i].lc, 400 + i, &cgen);
    opnd A = opnd_new(ctx, cases[i].a, cases[i].la, 420 + i, &GEN(-2, 2));
    opnd B = opnd_new(ctx, cases[i].b, cases[i].lb, 440 + i, &GEN(-2, 2));
    kiln_shape all[3] = {C.s, A.s, B.s};
    kiln_shape os = bcast_shape(3, all);
    int64_t n = numel_of(os), co[KILN_MAX_DIMS];
    double *want = dalloc(n);
    for (int64_t k = 0; k < n; k++) {
      coords_of(os, k, co);
      want[k] = C.v[bcast_src(os, co, C.s)] != 0 ? A.v[bcast_src(os, co, A.s)]
                                                 : B.v[bcast_src(os, co, B.s)];
    }
    opnd_desc(&C, cases[i].lc, dc, sizeof dc);
    opnd_desc(&A, cases[i].la, da, sizeof da);
    opnd_desc(&B, cases[i].lb, db, sizeof db);
    snprintf(what, sizeof what, "where(cond %s, a %s, b %s)", dc, da, db);
    expect_close(ctx, kiln_where(C.t, A.t, B.t), os, want, 0, 0, what);
    free(want);
    opnd_free(&C);
    opnd_free(&A);
    opnd_free(&B);
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
    where_gc u = {.cond = upload(ctx, gcases[i].c, gcases[i].ch)};
    kiln_tensor *in[2] = {rand_tensor(ctx, gcases[i].a, 460 + i, &GEN(-2, 2), 1, NULL),
                          rand_tensor(ctx, gcases[i].b, 480 + i, &GEN(-2, 2), 1, NULL)};
    kiln_shape_str(gcases[i].c, dc, sizeof dc);
    kiln_shape_str(gcases[i].a, da, sizeof da);
    kiln_shape_str(gcases[i].b, db, sizeof db);
    snprintf(what, sizeof what, "where(cond %s, a %s, b %s)", dc, da, db);
    expect_gradcheck(ctx, what, gc_where, 2, in, &u);
    kiln_tensor_free(in[0]);
    kiln_tensor_free(in[1]);
    kiln_tensor_free(u.cond);
  }
  kiln_ctx_free(ctx);
}

/* ---------------------------------------------------------------- reductions */

typedef enum rkind { R_SUM, R_MEAN, R_MAX } rkind;
static const char *const rnames[] = {"sum", "mean", "max"};

static kiln_tensor *reduce_op(rkind k, kiln_tensor *x, kiln_axes ax, int keepdim) {
  switch (k) {
  case R_SUM: return kiln_sum(x, ax, keepdim);
  case R_MEAN: return kiln_mean(x, ax, keepdim);
  case R_MAX: return kiln_max(x, ax, keepdim);
  }
  return NULL;
}

static unsigned mask_of(kiln_axes ax, int nd) {
  if (ax.n == 0) return (1u << nd) - 1;
  unsigned m = 0;
  for (int i = 0; i < ax.n; i++)
    m |= 1u << norm_ax(ax.a[i], nd);
  return m;
}

static kiln_shape reduced_shape(kiln_shape s, unsigned mask, int keepdim) {
  kiln_shape o = {.ndim = 0};
  for (int d = 0; d < s.ndim; d++) {
    if (mask & (1u << d)) {
      if (keepdim) o.d[o.ndim++] = 1;
    } else {
      o.d[o.ndim++] = s.d[d];
    }
  }
  return o;
}

/* The output element (row-major over the kept axes) that input coordinate c reduces into. */
static int64_t reduced_index(kiln_shape s, unsigned mask, const int64_t *c) {
  int64_t o = 0;
  for (int d = 0; d < s.ndim; d++)
    if (!(mask & (1u << d))) o = o * s.d[d] + c[d];
  return o;
}

static void reduce_ref(const double *x, kiln_shape s, unsigned mask, rkind k, double *out) {
  kiln_shape os = reduced_shape(s, mask, 0);
  int64_t no = numel_of(os), n = numel_of(s), r = no ? n / no : 0;
  for (int64_t o = 0; o < no; o++)
    out[o] = k == R_MAX ? -INFINITY : 0.0;
  int64_t c[KILN_MAX_DIMS];
  for (int64_t i = 0; i < n; i++) {
    coords_of(s, i, c);
    int64_t o = reduced_index(s, mask, c);
    if (k == R_MAX)
      out[o] = x[i] > out[o] ? x[i] : out[o];
    else
      out[o] += x[i];
  }
  if (k == R_MEAN)
    for (int64_t o = 0; o < no; o++)
      out[o] /= (double)r;
}

static void axes_str(kiln_axes ax, char *buf, size_t n) {
  if (ax.n == 0) {
    snprintf(buf, n, "{all}");
    return;
  }
  size_t k = (size_t)snprintf(buf, n, "{");
  for (int i = 0; i < ax.n && k < n; i++)
    k += (size_t)snprintf(buf + k, n - k, i ? ",%d" : "%d", ax.a[i]);
  if (k < n) snprintf(buf + k, n - k, "}");
}

static void check_reduce_case(kiln_ctx *ctx, rkind k, kiln_shape s, layout l, kiln_axes ax,
                              int keepdim, uint64_t seed, double atol, double rtol) {
  kiln_step_begin(ctx);
  opnd x = opnd_new(ctx, s, l, seed, &GEN(-1, 1));
  unsigned mask = mask_of(ax, s.ndim);
  kiln_shape os = reduced_shape(s, mask, keepdim);
  double *want = dalloc(numel_of(os));
  reduce_ref(x.v, s, mask, k, want);
  char what[1024], d[160], a[48];
  opnd_desc(&x, l, d, sizeof d);
  axes_str(ax, a, sizeof a);
  snprintf(what, sizeof what, "%s over axes %s (keepdim %d) of a %s input", rnames[k], a, keepdim,
           d);
  expect_close(ctx, reduce_op(k, x.t, ax, keepdim), os, want, atol, rtol, what);
  free(want);
  opnd_free(&x);
}

typedef struct red_gc {
  rkind k;
  kiln_axes ax;
  int keepdim;
  int transpose; /* reduce a view with axes 0 and 2 swapped */
} red_gc;

static kiln_tensor *gc_reduce(kiln_tensor *const *in, void *user) {
  const red_gc *u = user;
  kiln_tensor *x = u->transpose ? kiln_transpose(in[0], 0, 2) : in[0];
  return reduce_op(u->k, x, u->ax, u->keepdim);
}

static void check_reduce(kiln_ctx *ctx, rkind k) {
  kiln_axes sets[] = {KILN_ALL_AXES, KILN_AXES(0), KILN_AXES(1), KILN_AXES(0, 2), KILN_AXES(-1)};
  layout lays[] = {L_PLAIN, L_TRANS, L_SLICE, L_EXPAND};
  double atol = k == R_MAX ? 0 : 1e-5, rtol = k == R_MAX ? 0 : 1e-5;
  uint64_t seed = 500;
  for (size_t si = 0; si < sizeof sets / sizeof *sets; si++)
    for (int keepdim = 0; keepdim < 2; keepdim++)
      for (size_t li = 0; li < sizeof lays / sizeof *lays; li++)
        check_reduce_case(ctx, k, KILN_SHAPE(3, 4, 5), lays[li], sets[si], keepdim, seed++, atol,
                          rtol);
  /* long reductions: along dense rows, across columns, and over split axes */
  struct {
    kiln_shape s;
    kiln_axes ax;
  } big[] = {
      {.s = KILN_SHAPE(5, 1000), .ax = KILN_AXES(1)},
      {.s = KILN_SHAPE(16, 600), .ax = KILN_AXES(0)},
      {.s = KILN_SHAPE(7, 600), .ax = KILN_AXES(0)},
      {.s = KILN_SHAPE(600, 33), .ax = KILN_AXES(1)},
      {.s = KILN_SHAPE(2, 3, 1000), .ax = KILN_AXES(0, 2)},
      {.s = KILN_SHAPE(40, 50), .ax = KILN_ALL_AXES},
  };
  for (size_t i = 0; i < sizeof big / sizeof *big; i++)
    for (int t = 0; t < 2; t++)
      check_reduce_case(ctx, k, big[i].s, t ? L_TRANS : L_PLAIN, big[i].ax, 0, seed++,
                        k == R_MAX ? 0 : 2e-4, k == R_MAX ? 0 : 1e-5);
  /* gradients; max gets distinct values so that finite differences keep the argmax */
  char what[1024], a[48];
  for (size_t si = 0; si < sizeof sets / sizeof *sets; si++) {
    for (int keepdim = 0; keepdim < 2; keepdim++) {
      for (int t = 0; t < (keepdim ? 1 : 2); t++) {
        kiln_shape s = t ? KILN_SHAPE(4, 3, 2) : KILN_SHAPE(2, 3, 4);
        float h[24];
        if (k == R_MAX)
          distinct_fill(h, 24, seed++);
        else
          gen_fill(h, 24, seed++, &GEN(-1, 1));
        kiln_tensor *x = upload(ctx, s, h);
        set_grad(ctx, x);
        red_gc u = {.k = k, .ax = sets[si], .keepdim = keepdim, .transpose = t};
        axes_str(sets[si], a, sizeof a);
        snprintf(what, sizeof what, "%s over axes %s (keepdim %d) of a %s [2,3,4] input", rnames[k],
                 a, keepdim, t ? "transposed (axes 0, 2)" : "contiguous");
        expect_gradcheck(ctx, what, gc_reduce, 1, &x, &u);
        kiln_tensor_free(x);
      }
    }
  }
}

Test(gpu_ops, sum) {
  TH_GPU_CTX_EAGER(ctx);
  check_reduce(ctx, R_SUM);
  kiln_ctx_free(ctx);
}

Test(gpu_ops, mean) {
  TH_GPU_CTX_EAGER(ctx);
  check_reduce(ctx, R_MEAN);
  kiln_ctx_free(ctx);
}

Test(gpu_ops, max) {
  TH_GPU_CTX_EAGER(ctx);
  check_reduce(ctx, R_MAX);
  kiln_ctx_free(ctx);
}

/* max's gradient splits evenly among equal maxima (as PyTorch's amax) */
Test(gpu_ops, max_grad_ties) {
  TH_GPU_CTX_EAGER(ctx);
  float h[] = {1, 3, 3, 2, /* row 0: a tie at 1, 2 */ 5, 0, 1, 5 /* row 1: a tie at 0, 3 */};
  kiln_tensor *x = upload(ctx, KILN_SHAPE(2, 4), h);
  set_grad(ctx, x);
  kiln_step_begin(ctx);
  cr_assert_eq(kiln_backward(kiln_sum(kiln_max(x, KILN_AXES(1), 0), KILN_ALL_AXES, 0)), KILN_OK,
               "backward of sum(max over axis 1 of [2,4]): %s", err_of(ctx));
  double want[] = {0, 0.5, 0.5, 0, 0.5, 0, 0, 0.5};
  expect_close(ctx, kiln_tensor_grad(x), KILN_SHAPE(2, 4), want, 1e-6, 0,
               "gradient of sum(max over axis 1) of [2,4] with tied maxima");
  kiln_tensor_free(x);
  th_assert_ok(ctx);
  kiln_ctx_free(ctx);
}

/* ---------------------------------------------------------------- argmax */

static void check_argmax_case(kiln_ctx *ctx, kiln_shape s, layout l, int axis, int keepdim,
                              const gen *g, uint64_t seed) {
  kiln_step_begin(ctx);
  opnd x = opnd_new(ctx, s, l, seed, g);
  int ax = norm_ax(axis, s.ndim);
  unsigned mask = 1u << ax;
  kiln_shape os = reduced_shape(s, mask, keepdim);
  int64_t no = numel_of(os), n = numel_of(s), c[KILN_MAX_DIMS];
  int32_t *want = xmalloc((size_t)no * sizeof *want);
  double *best = dalloc(no);
  for (int64_t o = 0; o < no; o++)
    want[o] = -1;
  /* row-major order visits each output's candidates in increasing index: strict > keeps the
   * first of equal maxima */
  for (int64_t i = 0; i < n; i++) {
    coords_of(s, i, c);
    int64_t o = reduced_index(s, mask, c);
    if (want[o] < 0 || x.v[i] > best[o]) {
      best[o] = x.v[i];
      want[o] = (int32_t)c[ax];
    }
  }
  char what[1024], d[160];
  opnd_desc(&x, l, d, sizeof d);
  snprintf(what, sizeof what, "argmax over axis %d (keepdim %d) of a %s input with ties", axis,
           keepdim, d);
  expect_i32(ctx, kiln_argmax(x.t, axis, keepdim), os, want, what);
  free(want);
  free(best);
  opnd_free(&x);
}

Test(gpu_ops, argmax) {
  TH_GPU_CTX_EAGER(ctx);
  gen nine = {.lo = -1, .hi = 1, .quant = 0.25f}; /* nine levels: many ties */
  gen five = {.lo = -1, .hi = 1, .quant = 0.5f};  /* the maximum repeats along long rows */
  layout lays[] = {L_PLAIN, L_TRANS, L_SLICE, L_EXPAND};
  int axes[] = {0, 1, 2, -1};
  uint64_t seed = 600;
  for (size_t a = 0; a < sizeof axes / sizeof *axes; a++)
    for (int keepdim = 0; keepdim < 2; keepdim++)
      for (size_t li = 0; li < sizeof lays / sizeof *lays; li++)
        check_argmax_case(ctx, KILN_SHAPE(3, 4, 5), lays[li], axes[a], keepdim, &nine, seed++);
  check_argmax_case(ctx, KILN_SHAPE(4, 1000), L_PLAIN, 1, 0, &five, seed++);
  check_argmax_case(ctx, KILN_SHAPE(4, 1000), L_TRANS, 1, 0, &five, seed++);
  check_argmax_case(ctx, KILN_SHAPE(1000, 3), L_PLAIN, 0, 0, &five, seed++);
  check_argmax_case(ctx, KILN_SHAPE(7, 600), L_PLAIN, 0, 1, &five, seed++);
  check_argmax_case(ctx, KILN_SHAPE(7, 600), L_PLAIN, 1, 1, &GEN(-1, 1), seed++);
  kiln_ctx_free(ctx);
}

/* ---------------------------------------------------------------- softmax, log_softmax */

static void softmax_ref(const double *x, kiln_shape s, int axis, int logsm, double *out) {
  int ax = norm_ax(axis, s.ndim);
  int64_t outer = 1, len = s.d[ax], inner = 1;
  for (int d = 0; d < ax; d++)
    outer *= s.d[d];
  for (int d = ax + 1; d < s.ndim; d++)
    inner *= s.d[d];
  for (int64_t o = 0; o < outer; o++)
    for (int64_t in = 0; in < inner; in++) {
      const double *px = x + o * len * inner + in;
      double *po = out + o * len * inner + in;
      double m = -INFINITY, sum = 0;
      for (int64_t j = 0; j < len; j++)
        m = px[j * inner] > m ? px[j * inner] : m;
      for (int64_t j = 0; j < len; j++)
        sum += exp(px[j * inner] - m);
      for (int64_t j = 0; j < len; j++)
        po[j * inner] = logsm ? (px[j * inner] - m) - log(sum) : exp(px[j * inner] - m) / sum;
    }
}

typedef struct sm_gc {
  int logsm, axis, transpose;
} sm_gc;

static kiln_tensor *gc_softmax(kiln_tensor *const *in, void *user) {
  const sm_gc *u = user;
  kiln_tensor *x = u->transpose ? kiln_transpose(in[0], 0, 1) : in[0];
  return u->logsm ? kiln_log_softmax(x, u->axis) : kiln_softmax(x, u->axis);
}

static void check_softmax(kiln_ctx *ctx, int logsm) {
  const char *name = logsm ? "log_softmax" : "softmax";
  struct {
    kiln_shape s;
    int axis;
  } cases[] = {
      {.s = KILN_SHAPE(4, 5), .axis = 1},     {.s = KILN_SHAPE(4, 5), .axis = 0},
      {.s = KILN_SHAPE(6, 33), .axis = 1},    {.s = KILN_SHAPE(6, 33), .axis = 0},
      {.s = KILN_SHAPE(3, 300), .axis = 1},   {.s = KILN_SHAPE(2, 3, 4), .axis = 1},
      {.s = KILN_SHAPE(2, 3, 4), .axis = -1},
  };
  layout lays[] = {L_PLAIN, L_TRANS, L_SLICE};
  /* inputs around +50: exp would overflow-prone without the max shift */
  gen g = GEN(47, 53);
  uint64_t seed = 700;
  char what[1024], d[160];
  for (size_t i = 0; i < sizeof cases / sizeof *cases; i++)
    for (size_t li = 0; li < sizeof lays / sizeof *lays; li++) {
      kiln_step_begin(ctx);
      opnd x = opnd_new(ctx, cases[i].s, lays[li], seed++, &g);
      double *want = dalloc(numel_of(x.s));
      softmax_ref(x.v, x.s, cases[i].axis, logsm, want);
      opnd_desc(&x, lays[li], d, sizeof d);
      snprintf(what, sizeof what, "%s along axis %d of a %s input (values in [47, 53])", name,
               cases[i].axis, d);
      kiln_tensor *y =
          logsm ? kiln_log_softmax(x.t, cases[i].axis) : kiln_softmax(x.t, cases[i].axis);
      expect_close(ctx, y, x.s, want, 1e-5, 1e-5, what);
      free(want);
      opnd_free(&x);
    }
  for (int axis = 0; axis < 2; axis++)
    for (int t = 0; t < 2; t++) {
      kiln_tensor *x =
          rand_tensor(ctx, KILN_SHAPE(3, 4), 750 + (uint64_t)(axis * 2 + t), &GEN(-2, 2), 1, NULL);
      sm_gc u = {.logsm = logsm, .axis = axis, .transpose = t};
      snprintf(what, sizeof what, "%s along axis %d of a %s [3,4] input", name, axis,
               t ? "transposed" : "contiguous");
      expect_gradcheck(ctx, what, gc_softmax, 1, &x, &u);
      kiln_tensor_free(x);
    }
}

Test(gpu_ops, softmax) {
  TH_GPU_CTX_EAGER(ctx);
  check_softmax(ctx, 0);
  kiln_ctx_free(ctx);
}

Test(gpu_ops, log_softmax) {
  TH_GPU_CTX_EAGER(ctx);
  check_softmax(ctx, 1);
  kiln_ctx_free(ctx);
}

/* ---------------------------------------------------------------- cross_entropy */

static const char *const red_names[] = {"mean", "sum", "none"};

/* loss_i = -(1 - ls) logp[i, y_i] - ls / C sum_j logp[i, j]; then mean, sum or none. */
static kiln_shape ce_ref(const double *logits, int64_t n, int64_t c, const int32_t *y,
                         kiln_reduction red, double ls, double *out) {
  double *logp = dalloc(n * c);
  softmax_ref(logits, KILN_SHAPE(n, c), 1, 1, logp);
  double total = 0;
  for (int64_t i = 0; i < n; i++) {
    double s = 0;
    for (int64_t j = 0; j < c; j++)
      s += logp[i * c + j];
    double l = -(1 - ls) * logp[i * c + y[i]] - ls / (double)c * s;
    if (red == KILN_REDUCTION_NONE) out[i] = l;
    total += l;
  }
  free(logp);
  if (red == KILN_REDUCTION_NONE) return KILN_SHAPE(n);
  out[0] = red == KILN_REDUCTION_MEAN ? total / (double)n : total;
  return KILN_SCALAR_SHAPE;
}

typedef struct ce_gc {
  kiln_tensor *labels;
  kiln_reduction red;
  float ls;
} ce_gc;

static kiln_tensor *gc_ce(kiln_tensor *const *in, void *user) {
  const ce_gc *u = user;
  return kiln_cross_entropy(in[0], u->labels, u->red, u->ls);
}

Test(gpu_ops, cross_entropy) {
  TH_GPU_CTX_EAGER(ctx);
  struct {
    int64_t n, c;
    gen g;
    layout l;
  } cases[] = {
      {.n = 6, .c = 5, .g = GEN(-3, 3)},
      {.n = 6, .c = 5, .g = GEN(-3, 3), .l = L_TRANS},
      {.n = 64, .c = 10, .g = GEN(47, 53)},
      {.n = 64, .c = 10, .g = GEN(47, 53), .l = L_SLICE},
  };
  kiln_reduction reds[] = {KILN_REDUCTION_MEAN, KILN_REDUCTION_SUM, KILN_REDUCTION_NONE};
  float lss[] = {0.f, 0.1f};
  char what[1024], d[160];
  uint64_t seed = 800;
  for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
    int64_t n = cases[i].n, c = cases[i].c;
    int32_t *y = xmalloc((size_t)n * sizeof *y);
    for (int64_t k = 0; k < n; k++)
      y[k] = (int32_t)((k * 3) % c); /* 0 and C-1 both occur */
    for (size_t r = 0; r < 3; r++)
      for (size_t s = 0; s < 2; s++) {
        kiln_step_begin(ctx);
        opnd x = opnd_new(ctx, KILN_SHAPE(n, c), cases[i].l, seed++, &cases[i].g);
        kiln_tensor *labels = upload_i32(ctx, KILN_SHAPE(n), y);
        double *want = dalloc(n);
        kiln_shape ws = ce_ref(x.v, n, c, y, reds[r], lss[s], want);
        opnd_desc(&x, cases[i].l, d, sizeof d);
        snprintf(what, sizeof what, "cross_entropy (reduction %s, label_smoothing %g) of %s logits",
                 red_names[r], (double)lss[s], d);
        expect_close(ctx, kiln_cross_entropy(x.t, labels, reds[r], lss[s]), ws, want, 1e-5, 1e-5,
                     what);
        free(want);
        kiln_tensor_free(labels);
        opnd_free(&x);
      }
    free(y);
  }
  /* gradients through the logits */
  int32_t y4[] = {0, 4, 2, 4};
  kiln_tensor *labels = upload_i32(ctx, KILN_SHAPE(4), y4);
  for (size_t r = 0; r < 3; r++)
    for (size_t s = 0; s < 2; s++) {
      kiln_tensor *x = rand_tensor(ctx, KILN_SHAPE(4, 5), 850 + r * 2 + s, &GEN(-2, 2), 1, NULL);
      ce_gc u = {.labels = labels, .red = reds[r], .ls = lss[s]};
      snprintf(what, sizeof what, "cross_entropy (reduction %s, label_smoothing %g) of [4,5]",
               red_names[r], (double)lss[s]);
      expect_gradcheck(ctx, what, gc_ce, 1, &x, &u);
      kiln_tensor_free(x);
    }
  kiln_tensor_free(labels);
  kiln_ctx_free(ctx);
}

/* ---------------------------------------------------------------- matmul */

/* C = A B for (M,K) x (K,N), (B,M,K) x (B,K,N), (B,M,K) x (K,N), a batch of 1 broadcasting. */
static kiln_shape mm_ref(const double *a, kiln_shape as, const double *b, kiln_shape bs,
                         double *c) {
  int64_t m = as.d[as.ndim - 2], k = as.d[as.ndim - 1], n = bs.d[bs.ndim - 1];
  int64_t ba = as.ndim == 3 ? as.d[0] : 1, bb = bs.ndim == 3 ? bs.d[0] : 1;
  int64_t batch = ba > bb ? ba : bb;
  for (int64_t t = 0; t < batch; t++) {
    const double *pa = a + (ba == 1 ? 0 : t) * m * k, *pb = b + (bb == 1 ? 0 : t) * k * n;
    for (int64_t i = 0; i < m; i++)
      for (int64_t j = 0; j < n; j++) {
        double s = 0;
        for (int64_t q = 0; q < k; q++)
          s += pa[i * k + q] * pb[q * n + j];
        c[t * m * n + i * n + j] = s;
      }
  }
  if (as.ndim == 3 || bs.ndim == 3) return KILN_SHAPE(batch, m, n);
  return KILN_SHAPE(m, n);
}

static void check_mm(kiln_ctx *ctx, kiln_shape as, layout la, kiln_shape bs, layout lb,
                     uint64_t seed) {
  kiln_step_begin(ctx);
  opnd A = opnd_new(ctx, as, la, seed, &GEN(-1, 1));
  opnd B = opnd_new(ctx, bs, lb, seed + 1, &GEN(-1, 1));
  int64_t m = as.d[as.ndim - 2], n = bs.d[bs.ndim - 1];
  int64_t batch = (as.ndim == 3 ? as.d[0] : 1) > (bs.ndim == 3 ? bs.d[0] : 1)
                      ? (as.ndim == 3 ? as.d[0] : 1)
                      : (bs.ndim == 3 ? bs.d[0] : 1);
  double *want = dalloc(batch * m * n);
  kiln_shape cs = mm_ref(A.v, as, B.v, bs, want);
  char what[1024], da[160], db[160];
  opnd_desc(&A, la, da, sizeof da);
  opnd_desc(&B, lb, db, sizeof db);
  snprintf(what, sizeof what, "matmul of %s x %s (TF32 off)", da, db);
  expect_close(ctx, kiln_matmul(A.t, B.t), cs, want, 1e-4, 1e-4, what);
  free(want);
  opnd_free(&A);
  opnd_free(&B);
}

Test(gpu_ops, matmul_2d) {
  TH_GPU_CTX_EAGER(ctx);
  cr_assert_eq(kiln_tf32(ctx), 0, "TH_GPU_CTX must turn TF32 off");
  struct {
    kiln_shape a, b;
  } cases[] = {
      {.a = KILN_SHAPE(3, 5), .b = KILN_SHAPE(5, 4)},
      {.a = KILN_SHAPE(33, 70), .b = KILN_SHAPE(70, 17)},
      {.a = KILN_SHAPE(128, 784), .b = KILN_SHAPE(784, 16)},
      {.a = KILN_SHAPE(1, 5), .b = KILN_SHAPE(5, 4)},
      {.a = KILN_SHAPE(3, 5), .b = KILN_SHAPE(5, 1)},
  };
  layout pairs[][2] = {{L_PLAIN, L_PLAIN}, {L_TRANS, L_PLAIN}, {L_PLAIN, L_TRANS},
                       {L_TRANS, L_TRANS}, {L_ROWS, L_PLAIN},  {L_PLAIN, L_ROWS},
                       {L_SLICE, L_PLAIN}, {L_PLAIN, L_SLICE}, {L_EXPAND, L_PLAIN}};
  uint64_t seed = 900;
  for (size_t i = 0; i < sizeof cases / sizeof *cases; i++)
    for (size_t p = 0; p < sizeof pairs / sizeof *pairs; p++) {
      if (!layout_fits(cases[i].a, pairs[p][0]) || !layout_fits(cases[i].b, pairs[p][1])) continue;
      check_mm(ctx, cases[i].a, pairs[p][0], cases[i].b, pairs[p][1], seed);
      seed += 2;
    }
  kiln_ctx_free(ctx);
}

Test(gpu_ops, matmul_batched) {
  TH_GPU_CTX_EAGER(ctx);
  struct {
    kiln_shape a, b;
    layout la, lb;
  } cases[] = {
      /* (B,M,K) x (B,K,N) */
      {.a = KILN_SHAPE(3, 7, 9), .b = KILN_SHAPE(3, 9, 5)},
      {.a = KILN_SHAPE(3, 7, 9), .b = KILN_SHAPE(3, 9, 5), .la = L_TRANS},
      {.a = KILN_SHAPE(3, 7, 9), .b = KILN_SHAPE(3, 9, 5), .lb = L_TRANS},
      {.a = KILN_SHAPE(3, 7, 9), .b = KILN_SHAPE(3, 9, 5), .la = L_TRANS, .lb = L_TRANS},
      {.a = KILN_SHAPE(3, 7, 9), .b = KILN_SHAPE(3, 9, 5), .la = L_ROWS, .lb = L_ROWS},
      {.a = KILN_SHAPE(3, 7, 9), .b = KILN_SHAPE(3, 9, 5), .la = L_EXPAND},
      {.a = KILN_SHAPE(3, 7, 9), .b = KILN_SHAPE(3, 9, 5), .lb = L_EXPAND},
      {.a = KILN_SHAPE(3, 7, 9), .b = KILN_SHAPE(3, 9, 5), .la = L_SLICE, .lb = L_SLICE},
      {.a = KILN_SHAPE(2, 40, 300), .b = KILN_SHAPE(2, 300, 24), .la = L_TRANS},
      /* (B,M,K) x (K,N) */
      {.a = KILN_SHAPE(4, 6, 8), .b = KILN_SHAPE(8, 3)},
      {.a = KILN_SHAPE(4, 6, 8), .b = KILN_SHAPE(8, 3), .la = L_TRANS, .lb = L_TRANS},
      {.a = KILN_SHAPE(4, 6, 8), .b = KILN_SHAPE(8, 3), .la = L_ROWS},
      {.a = KILN_SHAPE(4, 6, 8), .b = KILN_SHAPE(8, 3), .la = L_EXPAND, .lb = L_SLICE},
      /* a batch of 1 broadcasts */
      {.a = KILN_SHAPE(1, 5, 6), .b = KILN_SHAPE(3, 6, 4)},
      {.a = KILN_SHAPE(1, 5, 6), .b = KILN_SHAPE(3, 6, 4), .la = L_TRANS, .lb = L_TRANS},
      {.a = KILN_SHAPE(3, 5, 6), .b = KILN_SHAPE(1, 6, 4)},
      {.a = KILN_SHAPE(3, 5, 6), .b = KILN_SHAPE(1, 6, 4), .la = L_TRANS, .lb = L_TRANS},
  };
  uint64_t seed = 1000;
  for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
    check_mm(ctx, cases[i].a, cases[i].la, cases[i].b, cases[i].lb, seed);
    seed += 2;
  }
  kiln_ctx_free(ctx);
}

typedef struct mm_gc {
  int ta, tb; /* the input is stored transposed and viewed back through kiln_transpose */
} mm_gc;

static kiln_tensor *gc_matmul(kiln_tensor *const *in, void *user) {
  const mm_gc *u = user;
  kiln_tensor *a = u->ta ? kiln_transpose(in[0], -1, -2) : in[0];
  kiln_tensor *b = u->tb ? kiln_transpose(in[1], -1, -2) : in[1];
  return kiln_matmul(a, b);
}

Test(gpu_ops, matmul_grad) {
  TH_GPU_CTX_EAGER(ctx);
  /* stored shapes: a transposed input is stored with its last two dims swapped */
  struct {
    kiln_shape a, b;
    int ta, tb;
    const char *desc;
  } cases[] = {
      {.a = KILN_SHAPE(3, 4), .b = KILN_SHAPE(4, 2), .desc = "[3,4] x [4,2]"},
      {.a = KILN_SHAPE(4, 3), .b = KILN_SHAPE(4, 2), .ta = 1, .desc = "[3,4]^T view x [4,2]"},
      {.a = KILN_SHAPE(3, 4), .b = KILN_SHAPE(2, 4), .tb = 1, .desc = "[3,4] x [4,2]^T view"},
      {.a = KILN_SHAPE(4, 3),
       .b = KILN_SHAPE(2, 4),
       .ta = 1,
       .tb = 1,
       .desc = "[3,4]^T view x [4,2]^T view"},
      {.a = KILN_SHAPE(2, 3, 4), .b = KILN_SHAPE(2, 4, 2), .desc = "[2,3,4] x [2,4,2]"},
      {.a = KILN_SHAPE(2, 4, 3),
       .b = KILN_SHAPE(2, 2, 4),
       .ta = 1,
       .tb = 1,
       .desc = "[2,3,4]^T view x [2,4,2]^T view"},
      {.a = KILN_SHAPE(2, 3, 4), .b = KILN_SHAPE(4, 2), .desc = "[2,3,4] x [4,2]"},
      {.a = KILN_SHAPE(2, 4, 3), .b = KILN_SHAPE(4, 2), .ta = 1, .desc = "[2,3,4]^T view x [4,2]"},
      {.a = KILN_SHAPE(1, 3, 4), .b = KILN_SHAPE(2, 4, 2), .desc = "[1,3,4] x [2,4,2]"},
      {.a = KILN_SHAPE(2, 3, 4), .b = KILN_SHAPE(1, 4, 2), .desc = "[2,3,4] x [1,4,2]"},
  };
  char what[1024];
  for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
    kiln_tensor *in[2] = {rand_tensor(ctx, cases[i].a, 1100 + i, &GEN(-1, 1), 1, NULL),
                          rand_tensor(ctx, cases[i].b, 1120 + i, &GEN(-1, 1), 1, NULL)};
    mm_gc u = {.ta = cases[i].ta, .tb = cases[i].tb};
    snprintf(what, sizeof what, "matmul of %s", cases[i].desc);
    expect_gradcheck(ctx, what, gc_matmul, 2, in, &u);
    kiln_tensor_free(in[0]);
    kiln_tensor_free(in[1]);
  }
  kiln_ctx_free(ctx);
}

/* ---------------------------------------------------------------- views and movement */

/* A chain of view steps applied to a base tensor: values, shape, contiguity, the gradient of
 * sum(view * w) (scattered back through the host map: zero where the view does not read, summed
 * where it reads an element more than once) and a gradcheck. */
typedef struct vcase {
  const char *name;
  kiln_shape base, want;
  vchain c;
  int contiguous; /* 1 or 0: asserted; -1: either */
} vcase;

static kiln_tensor *gc_chain(kiln_tensor *const *in, void *user) {
  return chain_apply(in[0], (const vchain *)user);
}

static void check_view(kiln_ctx *ctx, const vcase *v, uint64_t seed) {
  char what[1024], b[96];
  kiln_shape_str(v->base, b, sizeof b);
  snprintf(what, sizeof what, "%s of a %s input", v->name, b);
  hmap m = chain_map(v->base, &v->c);
  char ms[96], ws[96];
  kiln_shape_str(m.s, ms, sizeof ms);
  kiln_shape_str(v->want, ws, sizeof ws);
  cr_assert(shape_eq(m.s, v->want), "%s: the test's own map gives %s, want %s", what, ms, ws);
  int64_t n = numel_of(v->want), nb = numel_of(v->base);

  kiln_step_begin(ctx);
  float *h, *wh;
  kiln_tensor *x = rand_tensor(ctx, v->base, seed, &GEN(-2, 2), 1, &h);
  kiln_tensor *w = rand_tensor(ctx, v->want, seed + 1, &GEN(-1, 1), 0, &wh);
  kiln_tensor *y = chain_apply(x, &v->c);
  expect_shape(ctx, y, v->want, what);
  if (v->contiguous >= 0)
    cr_assert_eq(!!kiln_tensor_is_contiguous(y), v->contiguous, "%s: is_contiguous %d, want %d",
                 what, kiln_tensor_is_contiguous(y), v->contiguous);
  double *want = dalloc(n), *gwant = dalloc(nb);
  for (int64_t i = 0; i < n; i++)
    want[i] = h[m.idx[i]];
  for (int64_t i = 0; i < nb; i++)
    gwant[i] = 0;
  for (int64_t i = 0; i < n; i++)
    gwant[m.idx[i]] += wh[i];
  expect_close(ctx, y, v->want, want, 0, 0, what);

  cr_assert_eq(kiln_backward(kiln_sum(kiln_mul(y, w), KILN_ALL_AXES, 0)), KILN_OK,
               "%s: backward of sum(view * w): %s", what, err_of(ctx));
  char gwhat[1200];
  snprintf(gwhat, sizeof gwhat, "gradient of sum(%s * w) with respect to the base", what);
  cr_assert_not_null(kiln_tensor_grad(x), "%s: no gradient", gwhat);
  expect_close(ctx, kiln_tensor_grad(x), v->base, gwant, 1e-5, 1e-5, gwhat);

  expect_gradcheck(ctx, what, gc_chain, 1, &x, (void *)&v->c);
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

#define STEP_T(a0, a1) ((vstep){.k = V_T, .axis = (a0), .axis1 = (a1)})
#define STEP_PERMUTE(...) ((vstep){.k = V_PERMUTE, .order = KILN_AXES(__VA_ARGS__)})
#define STEP_SLICE(ax, s, e, st)                                                                   \
  ((vstep){.k = V_SLICE, .axis = (ax), .start = (s), .end = (e), .step = (st)})
#define STEP_EXPAND(...) ((vstep){.k = V_EXPAND, .shape = KILN_SHAPE(__VA_ARGS__)})
#define STEP_RESHAPE(...) ((vstep){.k = V_RESHAPE, .shape = KILN_SHAPE(__VA_ARGS__)})
#define STEP_CONTIG ((vstep){.k = V_CONTIG})
#define CHAIN(...)                                                                                 \
  {                                                                                                \
    .n = sizeof((vstep[]){__VA_ARGS__}) / sizeof(vstep), .st = { __VA_ARGS__ }                     \
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
  kiln_ctx_free(ctx);
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
  kiln_ctx_free(ctx);
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
  kiln_ctx_free(ctx);
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
  kiln_ctx_free(ctx);
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
  kiln_ctx_free(ctx);
}

/* ---------------------------------------------------------------- concat */

static void check_concat(kiln_ctx *ctx, int n, const kiln_shape *shapes, const layout *lays,
                         int axis, uint64_t seed) {
  kiln_step_begin(ctx);
  opnd o[4];
  kiln_tensor *ts[4];
  char what[1024], d[160];
  int ax = norm_ax(axis, shapes[0].ndim);
  kiln_shape os = shapes[0];
  os.d[ax] = 0;
  size_t k = (size_t)snprintf(what, sizeof what, "concat along axis %d of", axis);
  for (int i = 0; i < n; i++) {
    o[i] = opnd_new(ctx, shapes[i], lays[i], seed + (uint64_t)i, &GEN(-2, 2));
    ts[i] = o[i].t;
    os.d[ax] += shapes[i].d[ax];
    opnd_desc(&o[i], lays[i], d, sizeof d);
    if (k < sizeof what) k += (size_t)snprintf(what + k, sizeof what - k, "%s %s", i ? "," : "", d);
  }
  int64_t total = numel_of(os), co[KILN_MAX_DIMS];
  double *want = dalloc(total);
  for (int64_t i = 0; i < total; i++) {
    coords_of(os, i, co);
    int j = 0;
    while (co[ax] >= shapes[j].d[ax])
      co[ax] -= shapes[j++].d[ax];
    want[i] = o[j].v[lin_of(shapes[j], co)];
  }
  expect_close(ctx, kiln_concat(n, ts, axis), os, want, 0, 0, what);
  free(want);
  for (int i = 0; i < n; i++)
    opnd_free(&o[i]);
}

typedef struct cat_gc {
  int axis;
  int transpose_last; /* the last input is stored transposed and viewed back */
} cat_gc;

static kiln_tensor *gc_concat(kiln_tensor *const *in, void *user) {
  const cat_gc *u = user;
  kiln_tensor *ts[4];
  int n = 0;
  for (; n < 4 && in[n]; n++)
    ts[n] = in[n];
  if (u->transpose_last) ts[n - 1] = kiln_transpose(ts[n - 1], 0, 1);
  return kiln_concat(n, ts, u->axis);
}

Test(gpu_ops, concat) {
  TH_GPU_CTX_EAGER(ctx);
  struct {
    int n, axis;
    kiln_shape s[3];
  } cases[] = {
      {.n = 2, .axis = 0, .s = {KILN_SHAPE(2, 3), KILN_SHAPE(4, 3)}},
      {.n = 3, .axis = 0, .s = {KILN_SHAPE(2, 3), KILN_SHAPE(1, 3), KILN_SHAPE(3, 3)}},
      {.n = 2, .axis = 1, .s = {KILN_SHAPE(2, 3), KILN_SHAPE(2, 5)}},
      {.n = 3, .axis = 1, .s = {KILN_SHAPE(2, 1), KILN_SHAPE(2, 3), KILN_SHAPE(2, 2)}},
      {.n = 2, .axis = -1, .s = {KILN_SHAPE(3, 2), KILN_SHAPE(3, 4)}},
      {.n = 2, .axis = 1, .s = {KILN_SHAPE(2, 3, 4), KILN_SHAPE(2, 1, 4)}},
      {.n = 3, .axis = 0, .s = {KILN_SHAPE(40, 33), KILN_SHAPE(7, 33), KILN_SHAPE(20, 33)}},
  };
  layout mixes[][3] = {
      {L_PLAIN, L_PLAIN, L_PLAIN}, {L_TRANS, L_SLICE, L_EXPAND}, {L_ROWS, L_TRANS, L_SLICE}};
  uint64_t seed = 1700;
  for (size_t i = 0; i < sizeof cases / sizeof *cases; i++)
    for (size_t m = 0; m < sizeof mixes / sizeof *mixes; m++) {
      layout l[3];
      for (int j = 0; j < 3; j++)
        l[j] = j < cases[i].n && layout_fits(cases[i].s[j], mixes[m][j]) ? mixes[m][j] : L_PLAIN;
      check_concat(ctx, cases[i].n, cases[i].s, l, cases[i].axis, seed);
      seed += 4;
    }
  /* gradients: each input gets its own slice of the output's gradient */
  struct {
    int n, axis, tlast;
    kiln_shape s[3]; /* stored shapes */
    const char *desc;
  } gcases[] = {
      {.n = 2, .axis = 0, .s = {KILN_SHAPE(2, 3), KILN_SHAPE(1, 3)}, .desc = "[2,3], [1,3]"},
      {.n = 3,
       .axis = 0,
       .s = {KILN_SHAPE(2, 3), KILN_SHAPE(1, 3), KILN_SHAPE(2, 3)},
       .desc = "[2,3], [1,3], [2,3]"},
      {.n = 2, .axis = 1, .s = {KILN_SHAPE(2, 3), KILN_SHAPE(2, 2)}, .desc = "[2,3], [2,2]"},
      {.n = 3,
       .axis = 1,
       .s = {KILN_SHAPE(2, 1), KILN_SHAPE(2, 3), KILN_SHAPE(2, 2)},
       .desc = "[2,1], [2,3], [2,2]"},
      {.n = 2,
       .axis = 1,
       .tlast = 1,
       .s = {KILN_SHAPE(3, 2), KILN_SHAPE(2, 3)},
       .desc = "[3,2], [3,2] (transposed view)"},
  };
  char what[1024];
  for (size_t i = 0; i < sizeof gcases / sizeof *gcases; i++) {
    kiln_tensor *in[4] = {NULL, NULL, NULL, NULL};
    for (int j = 0; j < gcases[i].n; j++)
      in[j] = rand_tensor(ctx, gcases[i].s[j], 1800 + 4 * i + (uint64_t)j, &GEN(-2, 2), 1, NULL);
    cat_gc u = {.axis = gcases[i].axis, .transpose_last = gcases[i].tlast};
    snprintf(what, sizeof what, "concat along axis %d of %s", gcases[i].axis, gcases[i].desc);
    expect_gradcheck(ctx, what, gc_concat, gcases[i].n, in, &u);
    for (int j = 0; j < gcases[i].n; j++)
      kiln_tensor_free(in[j]);
  }
  kiln_ctx_free(ctx);
}

/* ---------------------------------------------------------------- index_select, cast, full */

static void check_index_select(kiln_ctx *ctx, kiln_shape s, layout l, const int32_t *idx, int64_t k,
                               uint64_t seed) {
  kiln_step_begin(ctx);
  opnd a = opnd_new(ctx, s, l, seed, &GEN(-2, 2));
  kiln_tensor *it = upload_i32(ctx, KILN_SHAPE(k), idx);
  int64_t rows = s.d[0], row = rows ? numel_of(s) / rows : 0;
  kiln_shape os = s;
  os.d[0] = k;
  double *want = dalloc(k * row);
  for (int64_t i = 0; i < k; i++)
    for (int64_t j = 0; j < row; j++)
      want[i * row + j] = idx[i] >= 0 && idx[i] < rows ? a.v[idx[i] * row + j] : 0.0;
  char what[1024], d[160];
  opnd_desc(&a, l, d, sizeof d);
  snprintf(what, sizeof what, "index_select of %lld rows (some out of range) from %s", (long long)k,
           d);
  expect_close(ctx, kiln_index_select(a.t, it), os, want, 0, 0, what);
  free(want);
  kiln_tensor_free(it);
  opnd_free(&a);
}

Test(gpu_ops, index_select) {
  TH_GPU_CTX_EAGER(ctx);
  int32_t idx1[] = {4, 0, 0, 7, -1, 2};
  check_index_select(ctx, KILN_SHAPE(5, 3), L_PLAIN, idx1, 6, 1900);
  check_index_select(ctx, KILN_SHAPE(5, 3), L_TRANS, idx1, 6, 1901);
  check_index_select(ctx, KILN_SHAPE(5, 3), L_SLICE, idx1, 6, 1902);
  int32_t idx2[] = {3, 1, 4, 3};
  check_index_select(ctx, KILN_SHAPE(4, 2, 3), L_PLAIN, idx2, 4, 1903);
  int32_t idx3[] = {9, 0};
  check_index_select(ctx, KILN_SHAPE(10), L_PLAIN, idx3, 2, 1904);
  /* an i32 table */
  kiln_step_begin(ctx);
  int32_t tab[] = {10, 11, 20, 21, 30, 31, 40, 41, 50, 51};
  int32_t pick[] = {2, 5, 0, 4};
  int32_t want[] = {30, 31, 0, 0, 10, 11, 50, 51};
  kiln_tensor *t = upload_i32(ctx, KILN_SHAPE(5, 2), tab);
  kiln_tensor *p = upload_i32(ctx, KILN_SHAPE(4), pick);
  expect_i32(ctx, kiln_index_select(t, p), KILN_SHAPE(4, 2), want,
             "index_select of rows {2,5,0,4} from an i32 [5,2] table");
  kiln_tensor_free(t);
  kiln_tensor_free(p);
  kiln_ctx_free(ctx);
}

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
  kiln_tensor *x = upload(ctx, KILN_SHAPE(3, 5), h);
  kiln_tensor *xi = kiln_cast(x, KILN_DTYPE_I32);
  expect_i32(ctx, xi, KILN_SHAPE(3, 5), want_i, "cast f32 -> i32 of [3,5] (truncation)");
  expect_close(ctx, kiln_cast(xi, KILN_DTYPE_F32), KILN_SHAPE(3, 5), want_f, 0, 0,
               "cast f32 -> i32 -> f32 of [3,5]");
  /* of a transposed view */
  int32_t want_t[15];
  for (int r = 0; r < 5; r++)
    for (int c = 0; c < 3; c++)
      want_t[r * 3 + c] = want_i[c * 5 + r];
  expect_i32(ctx, kiln_cast(kiln_transpose(x, 0, 1), KILN_DTYPE_I32), KILN_SHAPE(5, 3), want_t,
             "cast f32 -> i32 of a transposed [5,3] view");
  kiln_tensor_free(x);
  /* i32 -> f32 is exact below 2^24 */
  int32_t ih[8] = {-1000000, -3, 0, 7, 123456, 16777215, -16777215, 42};
  double want_if[8];
  for (int i = 0; i < 8; i++)
    want_if[i] = (double)ih[i];
  kiln_tensor *y = upload_i32(ctx, KILN_SHAPE(2, 4), ih);
  expect_close(ctx, kiln_cast(y, KILN_DTYPE_F32), KILN_SHAPE(2, 4), want_if, 0, 0,
               "cast i32 -> f32 of [2,4]");
  kiln_tensor_free(y);
  kiln_ctx_free(ctx);
}

Test(gpu_ops, full) {
  TH_GPU_CTX_EAGER(ctx);
  kiln_step_begin(ctx);
  double want[12];
  for (int i = 0; i < 12; i++)
    want[i] = 2.5;
  expect_close(ctx, kiln_full(ctx, KILN_SHAPE(3, 4), 2.5f), KILN_SHAPE(3, 4), want, 0, 0,
               "full([3,4], 2.5)");
  double ws = -1.25;
  expect_close(ctx, kiln_full(ctx, KILN_SCALAR_SHAPE, -1.25f), KILN_SCALAR_SHAPE, &ws, 0, 0,
               "full([], -1.25)");
  double *wbig = dalloc(1000 * 37);
  for (int i = 0; i < 1000 * 37; i++)
    wbig[i] = 0.125;
  expect_close(ctx, kiln_full(ctx, KILN_SHAPE(1000, 37), 0.125f), KILN_SHAPE(1000, 37), wbig, 0, 0,
               "full([1000,37], 0.125)");
  free(wbig);
  /* in arithmetic, broadcast */
  float *h;
  kiln_tensor *x = rand_tensor(ctx, KILN_SHAPE(3, 4), 2000, &GEN(-2, 2), 0, &h);
  for (int i = 0; i < 12; i++)
    want[i] = (double)h[i] + 0.5;
  expect_close(ctx, kiln_add(x, kiln_full(ctx, KILN_SHAPE(4), 0.5f)), KILN_SHAPE(3, 4), want, 1e-6,
               1e-6, "add of a [3,4] input and full([4], 0.5)");
  kiln_tensor_free(x);
  free(h);
  kiln_ctx_free(ctx);
}

/* ---------------------------------------------------------------- detach */

static kiln_tensor *gc_detach(kiln_tensor *const *in, void *user) {
  return kiln_mul(kiln_detach((kiln_tensor *)user), in[0]);
}

Test(gpu_ops, detach) {
  TH_GPU_CTX_EAGER(ctx);
  float *xh, *yh;
  kiln_tensor *x = rand_tensor(ctx, KILN_SHAPE(3, 4), 2100, &GEN(-2, 2), 1, &xh);
  kiln_tensor *y = rand_tensor(ctx, KILN_SHAPE(3, 4), 2101, &GEN(-2, 2), 1, &yh);
  double wx[12];
  for (int i = 0; i < 12; i++)
    wx[i] = xh[i];
  kiln_step_begin(ctx);
  kiln_tensor *d = kiln_detach(x);
  expect_close(ctx, d, KILN_SHAPE(3, 4), wx, 0, 0, "detach of [3,4]: values");
  cr_assert_eq(kiln_tensor_requires_grad(d), 0, "detach of [3,4]: the result requires grad");
  cr_assert_eq(kiln_backward(kiln_sum(kiln_mul(d, y), KILN_ALL_AXES, 0)), KILN_OK,
               "backward of sum(detach(x) * y): %s", err_of(ctx));
  kiln_tensor *gx = kiln_tensor_grad(x);
  if (gx) {
    float *g = read_f32(ctx, gx, "gradient of x through detach");
    for (int i = 0; i < 12; i++)
      cr_assert_eq(g[i], 0.f,
                   "sum(detach(x) * y): gradient of x element %d is %.9g, want 0 (or "
                   "no gradient)",
                   i, (double)g[i]);
    free(g);
  }
  expect_close(ctx, kiln_tensor_grad(y), KILN_SHAPE(3, 4), wx, 1e-6, 1e-6,
               "sum(detach(x) * y): gradient of y (= x)");
  /* gradcheck through y alone: x is a constant to the check */
  expect_gradcheck(ctx, "detach(x) * y with respect to y", gc_detach, 1, &y, x);
  kiln_tensor_free(x);
  kiln_tensor_free(y);
  free(xh);
  free(yh);
  kiln_ctx_free(ctx);
}

/* ---------------------------------------------------------------- dropout */

Test(gpu_ops, dropout_values_rate_and_philox_mask) {
  TH_GPU_CTX_EAGER(ctx);
  const int64_t n = 100000;
  const float p = 0.3f;
  float *h;
  kiln_tensor *x = rand_tensor(ctx, KILN_SHAPE(n), 2200, &GEN(0.5f, 1.5f), 0, &h);
  kiln_manual_seed(ctx, 7);
  kiln_step_begin(ctx);
  float *y = read_f32(ctx, kiln_dropout(x, p, 1), "dropout(p 0.3) of [100000]");
  int64_t zeros = 0;
  for (int64_t i = 0; i < n; i++) {
    double kept = (double)h[i] / (1.0 - (double)p);
    cr_assert(y[i] == 0.f || fabs(y[i] - kept) <= 1e-6 + 1e-6 * kept,
              "dropout(p 0.3) of [100000]: element %lld is %.9g, neither 0 nor x/(1-p) = %.9g",
              (long long)i, (double)y[i], kept);
    zeros += y[i] == 0.f;
    int keep = kiln_philox_uniform(7, 0, (unsigned long long)i) >= p;
    cr_assert_eq(y[i] != 0.f, keep,
                 "dropout(p 0.3) of [100000] after kiln_manual_seed(7): element %lld is %s, but "
                 "Philox(seed 7, offset 0, %lld) = %.9g says %s",
                 (long long)i, y[i] != 0.f ? "kept" : "dropped", (long long)i,
                 (double)kiln_philox_uniform(7, 0, (unsigned long long)i), keep ? "keep" : "drop");
  }
  double frac = (double)zeros / (double)n;
  cr_assert(fabs(frac - p) <= 0.01,
            "dropout(p 0.3) of [100000]: %.4f of elements are zero, want "
            "0.3 +- 0.01",
            frac);
  free(y);
  /* a transposed view: every output is still 0 or x / (1 - p) */
  float *ht;
  kiln_tensor *b = rand_tensor(ctx, KILN_SHAPE(40, 50), 2201, &GEN(0.5f, 1.5f), 0, &ht);
  float *yt = read_f32(ctx, kiln_dropout(kiln_transpose(b, 0, 1), p, 1),
                       "dropout(p 0.3) of a transposed [50,40] view");
  int64_t tz = 0;
  for (int r = 0; r < 50; r++)
    for (int c = 0; c < 40; c++) {
      float v = yt[r * 40 + c];
      double kept = (double)ht[c * 50 + r] / (1.0 - (double)p);
      cr_assert(v == 0.f || fabs(v - kept) <= 1e-6 + 1e-6 * kept,
                "dropout(p 0.3) of a transposed [50,40] view: element (%d,%d) is %.9g, neither 0 "
                "nor x/(1-p) = %.9g",
                r, c, (double)v, kept);
      tz += v == 0.f;
    }
  cr_assert(tz > 0 && tz < 2000, "dropout(p 0.3) of a transposed [50,40] view: %lld of 2000 zero",
            (long long)tz);
  free(yt);
  kiln_tensor_free(b);
  free(ht);
  kiln_tensor_free(x);
  free(h);
  th_assert_ok(ctx);
  kiln_ctx_free(ctx);
}

Test(gpu_ops, dropout_seed_and_offsets) {
  TH_GPU_CTX_EAGER(ctx);
  const int64_t n = 4096;
  kiln_tensor *x = rand_tensor(ctx, KILN_SHAPE(n), 2300, &GEN(0.5f, 1.5f), 0, NULL);
  float *run[2];
  for (int r = 0; r < 2; r++) {
    kiln_manual_seed(ctx, 7);
    kiln_step_begin(ctx);
    run[r] = read_f32(ctx, kiln_dropout(x, 0.3f, 1), "dropout(p 0.3) of [4096] after seed 7");
  }
  for (int64_t i = 0; i < n; i++)
    cr_assert_eq(run[0][i], run[1][i],
                 "dropout(p 0.3) of [4096], two runs after kiln_manual_seed(7): element %lld "
                 "differs: %.9g vs %.9g",
                 (long long)i, (double)run[0][i], (double)run[1][i]);
  /* two calls in a row draw different offsets, hence different masks */
  kiln_manual_seed(ctx, 7);
  kiln_step_begin(ctx);
  kiln_tensor *a = kiln_dropout(x, 0.3f, 1), *b = kiln_dropout(x, 0.3f, 1);
  float *ya = read_f32(ctx, a, "first of two dropout calls"),
        *yb = read_f32(ctx, b, "second of two dropout calls");
  int64_t differ = 0;
  for (int64_t i = 0; i < n; i++)
    differ += (ya[i] == 0.f) != (yb[i] == 0.f);
  cr_assert(differ > n / 10,
            "two consecutive dropout(p 0.3) calls on [4096]: masks differ in %lld elements, want "
            "about 42%%",
            (long long)differ);
  /* the first call after the seed is the one reproduced above */
  for (int64_t i = 0; i < n; i++)
    cr_assert_eq(ya[i], run[0][i],
                 "the first dropout call after kiln_manual_seed(7), element %lld: %.9g, earlier "
                 "run %.9g",
                 (long long)i, (double)ya[i], (double)run[0][i]);
  /* a different seed gives a different mask */
  kiln_manual_seed(ctx, 8);
  kiln_step_begin(ctx);
  float *y8 = read_f32(ctx, kiln_dropout(x, 0.3f, 1), "dropout(p 0.3) of [4096] after seed 8");
  differ = 0;
  for (int64_t i = 0; i < n; i++)
    differ += (y8[i] == 0.f) != (run[0][i] == 0.f);
  cr_assert(differ > n / 10, "dropout masks for seeds 7 and 8 differ in only %lld of 4096",
            (long long)differ);
  free(run[0]);
  free(run[1]);
  free(ya);
  free(yb);
  free(y8);
  kiln_tensor_free(x);
  kiln_ctx_free(ctx);
}

typedef struct drop_gc {
  uint64_t seed;
  float p;
} drop_gc;

static kiln_tensor *gc_dropout(kiln_tensor *const *in, void *user) {
  const drop_gc *u = user;
  kiln_manual_seed(kiln_tensor_ctx(in[0]), u->seed); /* every evaluation draws the same mask */
  return kiln_dropout(in[0], u->p, 1);
}

Test(gpu_ops, dropout_backward) {
  TH_GPU_CTX_EAGER(ctx);
  const float p = 0.4f;
  float *wh;
  kiln_tensor *x = rand_tensor(ctx, KILN_SHAPE(6, 5), 2400, &GEN(0.5f, 1.5f), 1, NULL);
  kiln_tensor *w = rand_tensor(ctx, KILN_SHAPE(6, 5), 2401, &GEN(-1, 1), 0, &wh);
  kiln_manual_seed(ctx, 3);
  kiln_step_begin(ctx);
  kiln_tensor *y = kiln_dropout(x, p, 1);
  cr_assert_eq(kiln_backward(kiln_sum(kiln_mul(y, w), KILN_ALL_AXES, 0)), KILN_OK,
               "backward of sum(dropout(x, 0.4) * w): %s", err_of(ctx));
  float *yv = read_f32(ctx, y, "dropout(p 0.4) of [6,5]");
  double want[30];
  int kept = 0;
  for (int i = 0; i < 30; i++) {
    int keep = kiln_philox_uniform(3, 0, (unsigned long long)i) >= p;
    cr_assert_eq(yv[i] != 0.f, keep,
                 "dropout(p 0.4) of [6,5] after seed 3: element %d is %s, "
                 "Philox says %s",
                 i, yv[i] != 0.f ? "kept" : "dropped", keep ? "keep" : "drop");
    want[i] = keep ? (double)wh[i] / (1.0 - (double)p) : 0.0;
    kept += keep;
  }
  cr_assert(kept > 0 && kept < 30, "dropout(p 0.4) of [6,5]: %d of 30 kept", kept);
  expect_close(ctx, kiln_tensor_grad(x), KILN_SHAPE(6, 5), want, 1e-6, 1e-6,
               "gradient of sum(dropout(x, 0.4) * w): w / (1 - p) where kept, 0 where dropped");
  free(yv);
  drop_gc u = {.seed = 3, .p = p};
  expect_gradcheck(ctx, "dropout(p 0.4, re-seeded each evaluation) of [6,5]", gc_dropout, 1, &x,
                   &u);
  kiln_tensor_free(x);
  kiln_tensor_free(w);
  free(wh);
  kiln_ctx_free(ctx);
}

Test(gpu_ops, dropout_eval) {
  TH_GPU_CTX_EAGER(ctx);
  float *h;
  kiln_tensor *x = rand_tensor(ctx, KILN_SHAPE(7, 9), 2500, &GEN(-2, 2), 0, &h);
  double want[63], want_t[63];
  for (int i = 0; i < 63; i++)
    want[i] = h[i];
  for (int r = 0; r < 9; r++)
    for (int c = 0; c < 7; c++)
      want_t[r * 7 + c] = h[c * 9 + r];
  kiln_step_begin(ctx);
  expect_close(ctx, kiln_dropout(x, 0.3f, 0), KILN_SHAPE(7, 9), want, 0, 0,
               "dropout(p 0.3, training 0) of [7,9] must return the input");
  expect_close(ctx, kiln_dropout(kiln_transpose(x, 0, 1), 0.5f, 0), KILN_SHAPE(9, 7), want_t, 0, 0,
               "dropout(p 0.5, training 0) of a transposed [9,7] view must return the input");
  kiln_tensor_free(x);
  free(h);
  kiln_ctx_free(ctx);
}

/* ---------------------------------------------------------------- memory statistics */

Test(gpu_ops, memory_stats) {
  TH_GPU_CTX_EAGER(ctx);
  const size_t bytes = (size_t)(1 << 20) * sizeof(float);
  kiln_mem_stats s0, s1, s2;
  cr_assert_eq(kiln_sync(ctx), KILN_OK, "kiln_sync: %s", err_of(ctx));
  kiln_memory_stats(ctx, &s0);
  kiln_tensor *t = kiln_tensor_new(ctx, KILN_DTYPE_F32, KILN_SHAPE(1 << 20));
  cr_assert_not_null(t, "kiln_tensor_new f32 [1048576]: %s", err_of(ctx));
  kiln_memory_stats(ctx, &s1);
  cr_assert(s1.in_use >= s0.in_use + bytes,
            "memory stats: in_use %zu after a new [1048576] f32 tensor, was %zu: want a growth "
            "of at least %zu",
            s1.in_use, s0.in_use, bytes);
  cr_assert(s1.peak >= s1.in_use, "memory stats: peak %zu < in_use %zu", s1.peak, s1.in_use);
  cr_assert_eq(s1.reserved, s1.in_use + s1.cached,
               "memory stats: reserved %zu != in_use %zu + cached %zu", s1.reserved, s1.in_use,
               s1.cached);
  kiln_tensor_free(t);
  kiln_memory_stats(ctx, &s2);
  cr_assert(s2.in_use + bytes <= s1.in_use,
            "memory stats: in_use %zu after freeing the [1048576] tensor, was %zu: want a drop of "
            "at least %zu",
            s2.in_use, s1.in_use, bytes);
  cr_assert(s2.cached >= s1.cached + bytes,
            "memory stats: cached %zu after freeing the [1048576] tensor, was %zu: want a growth "
            "of at least %zu",
            s2.cached, s1.cached, bytes);
  cr_assert(s2.peak >= s1.in_use, "memory stats: peak %zu fell below the earlier in_use %zu",
            s2.peak, s1.in_use);
  th_assert_ok(ctx);
  kiln_ctx_free(ctx);
}
