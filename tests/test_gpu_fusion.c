/*
 * test_gpu_fusion.c: fused execution against unfused execution (kiln_set_fusion). A small
 * generator builds random op DAGs over 1 to 4 leaves: elementwise ops with broadcasting,
 * reductions, softmax, matrix products with bias and activation epilogues, views and concat.
 * Every DAG runs in two contexts, one fused and one unfused, from the same leaves and seeds. The
 * outputs, a weighted-sum loss of them and every leaf's gradient must agree up to fp32 rounding,
 * and fusion must not launch more kernels. The same DAGs are also planned, verified and partly
 * compiled in a context without a GPU (that test runs everywhere, CI included). A short MLP
 * training run closes the file. Without a GPU every other test skips, saying why.
 */
#include <math.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fusion/blas.h"
#include "fusion/fusion.h"
#include "ref.h"

#define MAX_LEAVES 4
#define MAX_OPS 48
#define MAX_VALUES (MAX_LEAVES + MAX_OPS)
#define MAX_OUTS 3
#define BASE_CAP 4096  /* elements of a DAG's base shape */
#define VALUE_CAP 8192 /* elements of any value of a DAG */
#define BOUND_MAX 16.0 /* a value that may grow past this is scaled back to TAME_TO */
#define TAME_TO 4.0
#define EXP_LO -4.f /* exp reads clamp(x, EXP_LO, EXP_HI) */
#define EXP_HI 2.f
#define DROP_P 0.2f
#define MAX_EXCUSED 3 /* gradient differences a Test may put down to near-kinks */

static const char *const mode_name[2] = {"fused", "unfused"};

/* ---------------------------------------------------------------- small utilities */

/* Appends to a fixed buffer, stopping quietly at its end. */
__attribute__((format(printf, 4, 5))) static void app(char *buf, size_t cap, size_t *len,
                                                      const char *fmt, ...) {
  if (*len + 1 >= cap) return;
  va_list ap;
  va_start(ap, fmt);
  int k = vsnprintf(buf + *len, cap - *len, fmt, ap);
  va_end(ap);
  if (k > 0) *len = *len + (size_t)k < cap ? *len + (size_t)k : cap - 1;
}

/* ---------------------------------------------------------------- the ops a DAG is made of */

/* Op families, for choosing what a Test's DAGs may contain. */
enum {
  F_UNARY = 1u << 0,
  F_SAFE = 1u << 1, /* log, sqrt and rsqrt of sigmoid(x) + 0.5 */
  F_BINARY = 1u << 2,
  F_DROPOUT = 1u << 3,
  F_REDUCE = 1u << 4,
  F_SOFTMAX = 1u << 5,
  F_MATMUL = 1u << 6,
  F_VIEW = 1u << 7,
  F_CONCAT = 1u << 8,
};

#define OPS(X)                                                                                     \
  X(NEG, "neg")                                                                                    \
  X(EXP, "exp")                                                                                    \
  X(TANH, "tanh")                                                                                  \
  X(SIGMOID, "sigmoid")                                                                            \
  X(RELU, "relu")                                                                                  \
  X(GELU_ERF, "gelu")                                                                              \
  X(GELU_TANH, "gelu_tanh")                                                                        \
  X(ADD_SCALAR, "add_scalar")                                                                      \
  X(MUL_SCALAR, "mul_scalar")                                                                      \
  X(POW2, "pow_scalar")                                                                            \
  X(CLAMP, "clamp")                                                                                \
  X(LOG, "log")                                                                                    \
  X(SQRT, "sqrt")                                                                                  \
  X(RSQRT, "rsqrt")                                                                                \
  X(ADD, "add")                                                                                    \
  X(SUB, "sub")                                                                                    \
  X(MUL, "mul")                                                                                    \
  X(DIV, "div")                                                                                    \
  X(MAXIMUM, "maximum")                                                                            \
  X(MINIMUM, "minimum")                                                                            \
  X(WHERE, "where")                                                                                \
  X(DROPOUT, "dropout")                                                                            \
  X(SUM, "sum")                                                                                    \
  X(MEAN, "mean")                                                                                  \
  X(MAX, "max")                                                                                    \
  X(SOFTMAX, "softmax")                                                                            \
  X(LOG_SOFTMAX, "log_softmax")                                                                    \
  X(MATMUL, "matmul")                                                                              \
  X(TRANSPOSE, "transpose")                                                                        \
  X(SLICE, "slice")                                                                                \
  X(RESHAPE, "reshape")                                                                            \
  X(EXPAND, "expand")                                                                              \
  X(CONCAT, "concat")                                                                              \
  X(TAME, "mul_scalar")

typedef enum opk {
#define X(id, name) O_##id,
  OPS(X)
#undef X
      O_COUNT
} opk;

static const char *const op_name[O_COUNT] = {
#define X(id, name) name,
    OPS(X)
#undef X
};

static const opk unary_ops[] = {O_NEG,        O_EXP,      O_TANH,      O_SIGMOID,
                                O_RELU,       O_GELU_ERF, O_GELU_TANH, O_ADD_SCALAR,
                                O_MUL_SCALAR, O_POW2,     O_CLAMP};
static const opk safe_ops[] = {O_LOG, O_SQRT, O_RSQRT};
static const opk binary_ops[] = {O_ADD, O_SUB, O_MUL, O_DIV, O_MAXIMUM, O_MINIMUM, O_WHERE};
#define COUNT(a) ((int)(sizeof(a) / sizeof *(a)))

static bool is_binary(opk k) {
  return (k >= O_ADD && k <= O_WHERE) || k == O_MATMUL || k == O_CONCAT;
}
static bool is_view(opk k) {
  return k == O_TRANSPOSE || k == O_SLICE || k == O_RESHAPE || k == O_EXPAND;
}

/* One op of a DAG: the indices of the values it reads and its arguments. */
typedef struct op {
  opk k;
  int in[2];        /* in[1] is in[0] for one-input ops */
  float f[2];       /* add/mul_scalar's scalar, clamp's bounds, the tame factor */
  int axis, axis1;  /* softmax, transpose, slice, concat */
  int start, end;   /* slice: every other element of [start, end) */
  int keepdim;      /* reductions */
  kiln_axes axes;   /* reductions */
  kiln_shape shape; /* reshape and expand targets, -1 allowed */
} op;

/* How a leaf's persistent tensor becomes the value the DAG sees. */
typedef enum access { ACC_PLAIN, ACC_TRANS, ACC_SLICE, ACC_EXPAND } access;
static const char *const access_name[] = {"contiguous", "transposed (last two dims)",
                                          "sliced with step 2", "expanded"};

typedef struct leaf {
  kiln_shape stored; /* the persistent tensor's shape */
  kiln_shape shape;  /* the shape the DAG sees */
  access acc;
  int axis, start; /* ACC_SLICE */
  float *host;     /* the stored values, the same in both contexts */
} leaf;

typedef struct vinfo {
  kiln_shape s;
  double bound;  /* |element| <= bound, by interval reasoning */
  bool consumed; /* some op reads it */
  bool leafish;  /* a leaf, or views of leaves only */
} vinfo;

/* A DAG: leaves are values 0..nleaf-1, op j makes value nleaf + j. */
typedef struct plan {
  uint64_t seed;
  int nleaf, nop, nv, nout;
  leaf leaves[MAX_LEAVES];
  op ops[MAX_OPS];
  vinfo v[MAX_VALUES];
  int out[MAX_OUTS];
  char text[16384]; /* printable: seed, leaves, ops, outputs */
} plan;

/* ---------------------------------------------------------------- shapes and bounds of results */

static void infer(const plan *p, const op *o, kiln_shape *s, double *bound) {
  const vinfo *a = &p->v[o->in[0]], *b = &p->v[o->in[1]];
  double A = a->bound, B = b->bound;
  int nd = a->s.ndim;
  *s = a->s;
  *bound = A;
  switch (o->k) {
  case O_NEG:
  case O_RELU:
  case O_GELU_ERF:
  case O_GELU_TANH: *bound = fmax(A, 0.2); break;
  case O_EXP: *bound = exp(EXP_HI); break;
  case O_TANH:
  case O_SIGMOID:
  case O_SOFTMAX: *bound = 1; break;
  case O_ADD_SCALAR: *bound = A + fabs(o->f[0]); break;
  case O_MUL_SCALAR:
  case O_TAME: *bound = A * fabs(o->f[0]); break;
  case O_POW2: *bound = A * A; break;
  case O_CLAMP: *bound = fmin(A, fmax(fabs(o->f[0]), fabs(o->f[1]))); break;
  case O_LOG: *bound = 0.7; break;
  case O_SQRT: *bound = 1.25; break;
  case O_RSQRT: *bound = 1.42; break;
  case O_ADD:
  case O_SUB:
  case O_MUL:
  case O_DIV:
  case O_MAXIMUM:
  case O_MINIMUM:
  case O_WHERE:
    cr_assert(ref_broadcast(2, (kiln_shape[]){a->s, b->s}, s),
              "the generator paired shapes that do not broadcast");
    *bound = o->k == O_ADD || o->k == O_SUB ? A + B
             : o->k == O_MUL                ? A * B
             : o->k == O_DIV                ? 2 * A
                                            : fmax(A, B);
    break;
  case O_DROPOUT: *bound = A / (1 - DROP_P); break;
  case O_SUM:
  case O_MEAN:
  case O_MAX:
    *s = ref_reduced_shape(a->s, ref_axes_mask(o->axes, nd), o->keepdim);
    if (o->k == O_SUM) *bound = A * (double)(ref_numel(a->s) / ref_numel(*s));
    break;
  case O_LOG_SOFTMAX: *bound = 2 * A + log((double)a->s.d[ref_norm_axis(o->axis, nd)]); break;
  case O_MATMUL: {
    int64_t k = a->s.d[nd - 1], m = a->s.d[nd - 2], n = b->s.d[b->s.ndim - 1];
    if (nd == 3 || b->s.ndim == 3) {
      int64_t ba = nd == 3 ? a->s.d[0] : 1, bb = b->s.ndim == 3 ? b->s.d[0] : 1;
      *s = KILN_SHAPE(ba > bb ? ba : bb, m, n);
    } else {
      *s = KILN_SHAPE(m, n);
    }
    *bound = (double)k * A * B;
    break;
  }
  case O_TRANSPOSE: {
    int x = ref_norm_axis(o->axis, nd), y = ref_norm_axis(o->axis1, nd);
    s->d[x] = a->s.d[y];
    s->d[y] = a->s.d[x];
    break;
  }
  case O_SLICE: s->d[ref_norm_axis(o->axis, nd)] = (o->end - o->start + 1) / 2; break;
  case O_RESHAPE: {
    *s = o->shape;
    int64_t known = 1;
    int infer_at = -1;
    for (int d = 0; d < s->ndim; d++) {
      if (s->d[d] == -1)
        infer_at = d;
      else
        known *= s->d[d];
    }
    if (infer_at >= 0) s->d[infer_at] = ref_numel(a->s) / known;
    break;
  }
  case O_EXPAND:
    *s = o->shape;
    for (int d = 0; d < s->ndim; d++)
      if (s->d[d] == -1) s->d[d] = a->s.d[d - (s->ndim - nd)];
    break;
  case O_CONCAT:
    s->d[ref_norm_axis(o->axis, nd)] += b->s.d[ref_norm_axis(o->axis, nd)];
    *bound = fmax(A, B);
    break;
  case O_COUNT: break;
  }
}

/* Appends o and returns the index of its value. */
static int add_op(plan *p, op o) {
  cr_assert(p->nop < MAX_OPS, "the generator ran past %d ops", MAX_OPS);
  if (!is_binary(o.k)) o.in[1] = o.in[0];
  kiln_shape s;
  double bound;
  infer(p, &o, &s, &bound);
  p->v[o.in[0]].consumed = p->v[o.in[1]].consumed = true;
  p->ops[p->nop++] = o;
  p->v[p->nv] = (vinfo){.s = s, .bound = bound, .leafish = is_view(o.k) && p->v[o.in[0]].leafish};
  return p->nv++;
}

static op op1(opk k, int a) { return (op){.k = k, .in = {a, a}}; }
static op op2(opk k, int a, int b) { return (op){.k = k, .in = {a, b}}; }
static op reshape_op(int a, kiln_shape s) { return (op){.k = O_RESHAPE, .in = {a, a}, .shape = s}; }
static op transpose_op(int a, int x, int y) {
  return (op){.k = O_TRANSPOSE, .in = {a, a}, .axis = x, .axis1 = y};
}

/* Keeps magnitudes tame: a value that may exceed BOUND_MAX is scaled down to TAME_TO. */
static int tame(plan *p, int v) {
  if (p->v[v].bound <= BOUND_MAX) return v;
  op o = op1(O_TAME, v);
  o.f[0] = (float)(TAME_TO / p->v[v].bound);
  return add_op(p, o);
}

/* ---------------------------------------------------------------- picking operands */

typedef bool (*vpred)(const plan *p, int v, const void *arg);

/* A value satisfying ok: the newest one half the time (deep chains), else any; -1 if none.
 * Values that may exceed BOUND_MAX are left to the op that tames them. */
static int pick(const plan *p, th_rng *r, vpred ok, const void *arg) {
  int cand[MAX_VALUES], n = 0;
  for (int v = 0; v < p->nv; v++)
    if (p->v[v].bound <= BOUND_MAX && (!ok || ok(p, v, arg))) cand[n++] = v;
  if (n == 0) return -1;
  return th_rng_chance(r, 0.5) ? cand[n - 1] : cand[th_rng_below(r, n)];
}

static bool min_dims(const plan *p, int v, const void *arg) {
  return p->v[v].s.ndim >= *(const int *)arg;
}

static bool broadcasts_with(const plan *p, int v, const void *arg) {
  int a = *(const int *)arg;
  kiln_shape o;
  return v != a && ref_broadcast(2, (kiln_shape[]){p->v[a].s, p->v[v].s}, &o) &&
         ref_numel(o) <= VALUE_CAP;
}

static bool sliceable(const plan *p, int v, const void *arg) {
  (void)arg;
  for (int d = 0; d < p->v[v].s.ndim; d++)
    if (p->v[v].s.d[d] >= 2) return true;
  return false;
}

static bool expandable(const plan *p, int v, const void *arg) {
  (void)arg;
  return ref_numel(p->v[v].s) * 2 <= VALUE_CAP;
}

typedef struct cat_arg {
  int a, axis;
} cat_arg;

static bool concats_with(const plan *p, int v, const void *arg) {
  const cat_arg *c = arg;
  kiln_shape a = p->v[c->a].s, b = p->v[v].s;
  if (v == c->a || a.ndim != b.ndim || ref_numel(a) + ref_numel(b) > VALUE_CAP) return false;
  for (int d = 0; d < a.ndim; d++)
    if (d != c->axis && a.d[d] != b.d[d]) return false;
  return true;
}

typedef struct bias_arg {
  int64_t n;
  int exclude; /* the product itself */
} bias_arg;

/* A bias over the columns of an (.., n) product: shape (n) or (1, n). */
static bool is_bias(const plan *p, int v, const void *arg) {
  const bias_arg *b = arg;
  kiln_shape s = p->v[v].s;
  return v != b->exclude &&
         ((s.ndim == 1 && s.d[0] == b->n) || (s.ndim == 2 && s.d[0] == 1 && s.d[1] == b->n));
}

/* ---------------------------------------------------------------- generating ops */

static void gen_unary(plan *p, th_rng *r, bool safe) {
  int a = pick(p, r, NULL, NULL);
  op o = op1(safe ? safe_ops[th_rng_below(r, COUNT(safe_ops))]
                  : unary_ops[th_rng_below(r, COUNT(unary_ops))],
             a);
  if (o.k == O_ADD_SCALAR) o.f[0] = th_rng_range(r, -1.5f, 1.5f);
  if (o.k == O_MUL_SCALAR)
    o.f[0] = th_rng_range(r, 0.25f, 2.f) * (th_rng_chance(r, 0.5) ? -1.f : 1.f);
  if (o.k == O_CLAMP) {
    o.f[0] = th_rng_range(r, -1.5f, -0.1f);
    o.f[1] = th_rng_range(r, 0.1f, 1.5f);
  }
  tame(p, add_op(p, o));
}

static bool gen_binary(plan *p, th_rng *r) {
  int a = pick(p, r, NULL, NULL);
  int b = th_rng_chance(r, 0.1) ? -1 : pick(p, r, broadcasts_with, &a);
  if (b < 0) b = a; /* an op of a value with itself */
  if (th_rng_chance(r, 0.5)) {
    int t = a;
    a = b;
    b = t;
  }
  opk k = binary_ops[th_rng_below(r, COUNT(binary_ops))];
  if (a == b && k == O_SUB) k = O_ADD; /* x - x is all zeros: nothing to compare downstream */
  tame(p, add_op(p, op2(k, a, b)));
  return true;
}

static bool gen_dropout(plan *p, th_rng *r) {
  tame(p, add_op(p, op1(O_DROPOUT, pick(p, r, NULL, NULL))));
  return true;
}

/* A random nonempty set of axes (a quarter of the time: all), some given as negative. */
static kiln_axes random_axes(th_rng *r, int nd) {
  kiln_axes ax = {.n = 0};
  if (th_rng_chance(r, 0.25)) return ax;
  int first = th_rng_below(r, nd);
  for (int i = 0; i < nd; i++) {
    int d = (first + i) % nd;
    if (i == 0 || th_rng_chance(r, 0.4)) ax.a[ax.n++] = th_rng_chance(r, 0.3) ? d - nd : d;
  }
  return ax;
}

static bool gen_reduce(plan *p, th_rng *r) {
  static const int one = 1;
  int a = pick(p, r, min_dims, &one);
  if (a < 0) return false;
  static const opk ks[] = {O_SUM, O_MEAN, O_MAX};
  op o = op1(ks[th_rng_below(r, 3)], a);
  o.axes = random_axes(r, p->v[a].s.ndim);
  o.keepdim = th_rng_below(r, 2);
  tame(p, add_op(p, o));
  return true;
}

static bool gen_softmax(plan *p, th_rng *r) {
  static const int one = 1;
  int a = pick(p, r, min_dims, &one);
  if (a < 0) return false;
  int nd = p->v[a].s.ndim;
  op o = op1(th_rng_chance(r, 0.5) ? O_SOFTMAX : O_LOG_SOFTMAX, a);
  o.axis = th_rng_below(r, nd) - (th_rng_chance(r, 0.3) ? nd : 0);
  tame(p, add_op(p, o));
  return true;
}

/* A shape with the same elements: flattened, two dims merged, a dim split or (-1, last). */
static kiln_shape reshape_target(kiln_shape s, th_rng *r) {
  kiln_shape t = s;
  int nd = s.ndim;
  int c = th_rng_below(r, 4);
  if (c == 1 && nd >= 2) {
    int i = th_rng_below(r, nd - 1);
    t.d[i] = s.d[i] * s.d[i + 1];
    for (int d = i + 1; d < nd - 1; d++)
      t.d[d] = s.d[d + 1];
    t.ndim = nd - 1;
  } else if (c == 2 && nd < 5) {
    int i = th_rng_below(r, nd);
    int64_t divs[48], nd_ = 0;
    for (int64_t f = 2; f < s.d[i] && nd_ < 48; f++)
      if (s.d[i] % f == 0) divs[nd_++] = f;
    int64_t f = nd_ ? divs[th_rng_below(r, (int)nd_)] : 1; /* no divisor: insert a 1 */
    for (int d = nd; d > i; d--)
      t.d[d] = s.d[d - 1];
    t.d[i] = f;
    t.d[i + 1] = s.d[i] / f;
    t.ndim = nd + 1;
  } else if (c == 3 && nd >= 1) {
    t = KILN_SHAPE(ref_numel(s) / s.d[nd - 1], s.d[nd - 1]);
  } else {
    t = KILN_SHAPE(ref_numel(s));
  }
  if (th_rng_chance(r, 0.5)) t.d[th_rng_below(r, t.ndim)] = -1;
  return t;
}

/* A dim of size 1 stretched, or a new leading dim; unchanged dims sometimes given as -1. */
static bool expand_target(kiln_shape s, th_rng *r, kiln_shape *t) {
  static const int64_t mult[] = {2, 3, 4, 7, 16, 33};
  int64_t m = mult[th_rng_below(r, COUNT(mult))];
  if (ref_numel(s) * m > VALUE_CAP) m = 2;
  int ones[KILN_MAX_DIMS], no = 0;
  for (int d = 0; d < s.ndim; d++)
    if (s.d[d] == 1) ones[no++] = d;
  *t = s;
  int lead = 0;
  if (no > 0 && (s.ndim >= 5 || th_rng_chance(r, 0.6))) {
    t->d[ones[th_rng_below(r, no)]] = m;
  } else if (s.ndim < 5) {
    for (int d = s.ndim; d > 0; d--)
      t->d[d] = s.d[d - 1];
    t->d[0] = m;
    t->ndim = s.ndim + 1;
    lead = 1;
  } else {
    return false;
  }
  for (int d = lead; d < t->ndim; d++)
    if (t->d[d] == s.d[d - lead] && th_rng_chance(r, 0.3)) t->d[d] = -1;
  return true;
}

static bool gen_view(plan *p, th_rng *r) {
  static const int one = 1, two = 2;
  int a;
  op o;
  switch (th_rng_below(r, 4)) {
  case 0: {
    a = pick(p, r, min_dims, &two);
    if (a < 0) return false;
    int nd = p->v[a].s.ndim;
    if (th_rng_chance(r, 0.5)) {
      o = transpose_op(a, -1, -2);
    } else {
      int x = th_rng_below(r, nd), y = (x + 1 + th_rng_below(r, nd - 1)) % nd;
      o = transpose_op(a, x, th_rng_chance(r, 0.3) ? y - nd : y);
    }
    break;
  }
  case 1: {
    a = pick(p, r, sliceable, NULL);
    if (a < 0) return false;
    kiln_shape s = p->v[a].s;
    int axes[KILN_MAX_DIMS], n = 0;
    for (int d = 0; d < s.ndim; d++)
      if (s.d[d] >= 2) axes[n++] = d;
    int ax = axes[th_rng_below(r, n)];
    o = op1(O_SLICE, a);
    o.axis = th_rng_chance(r, 0.3) ? ax - s.ndim : ax;
    o.start = th_rng_below(r, 2);
    o.end = (int)s.d[ax];
    break;
  }
  case 2:
    a = pick(p, r, min_dims, &one);
    if (a < 0) return false;
    o = reshape_op(a, reshape_target(p->v[a].s, r));
    break;
  default:
    a = pick(p, r, expandable, NULL);
    if (a < 0) return false;
    o = op1(O_EXPAND, a);
    if (!expand_target(p->v[a].s, r, &o.shape)) return false;
    break;
  }
  add_op(p, o);
  return true;
}

static bool gen_concat(plan *p, th_rng *r) {
  static const int one = 1;
  int a = pick(p, r, min_dims, &one);
  if (a < 0) return false;
  cat_arg c = {.a = a, .axis = th_rng_below(r, p->v[a].s.ndim)};
  int b = pick(p, r, concats_with, &c);
  if (b < 0) {
    if (ref_numel(p->v[a].s) * 2 > VALUE_CAP) return false;
    b = a;
  }
  op o = th_rng_chance(r, 0.5) ? op2(O_CONCAT, a, b) : op2(O_CONCAT, b, a);
  o.axis = th_rng_chance(r, 0.3) ? c.axis - p->v[a].s.ndim : c.axis;
  add_op(p, o);
  return true;
}

/* A matrix product: the left operand as (M, K) or (B, M, K), the right one a value that is
 * (K, N) as it is, transposed from (N, K) (a linear layer's weight) or reshaped to (K, N); then
 * sometimes a bias over the columns and an activation, the epilogues the planner fuses. */
static bool gen_matmul(plan *p, th_rng *r) {
  static const int one = 1;
  int a = pick(p, r, min_dims, &one);
  if (a < 0) return false;
  kiln_shape s = p->v[a].s;
  int64_t K = s.d[s.ndim - 1];
  if (s.ndim == 1)
    a = add_op(p, reshape_op(a, KILN_SHAPE(1, -1)));
  else if (s.ndim > 3)
    a = add_op(p, reshape_op(a, th_rng_chance(r, 0.5) ? KILN_SHAPE(-1, K)
                                                      : KILN_SHAPE(-1, s.d[s.ndim - 2], K)));
  s = p->v[a].s;
  int nd = s.ndim;
  int64_t M = s.d[nd - 2], batch = nd == 3 ? s.d[0] : 1;
  enum { AS_IS, TRANSPOSED, RESHAPED };
  struct {
    int v, how;
  } c[3 * MAX_VALUES];
  int nc = 0;
  for (int v = 0; v < p->nv; v++) {
    if (p->v[v].bound > BOUND_MAX) continue;
    kiln_shape t = p->v[v].s;
    int64_t tb = t.ndim == 3 ? t.d[0] : 1, ob = batch > tb ? batch : tb;
    bool batch_ok =
        t.ndim == 2 || (nd == 3 && t.ndim == 3 && (tb == batch || tb == 1 || batch == 1));
    if (batch_ok && t.ndim >= 2) {
      if (t.d[t.ndim - 2] == K && ob * M * t.d[t.ndim - 1] <= VALUE_CAP)
        c[nc].v = v, c[nc++].how = AS_IS;
      if (t.d[t.ndim - 1] == K && ob * M * t.d[t.ndim - 2] <= VALUE_CAP)
        c[nc].v = v, c[nc++].how = TRANSPOSED;
    }
    int64_t n = ref_numel(t);
    if (v != a && t.ndim >= 1 && n % K == 0 && n / K <= 64 && batch * M * (n / K) <= VALUE_CAP)
      c[nc].v = v, c[nc++].how = RESHAPED;
  }
  int left = a, right;
  if (nc == 0) {
    /* A^T A, (K, M) x (M, K): it fits whenever A A^T does not */
    left = add_op(p, transpose_op(a, -1, -2));
    right = a;
  } else {
    int i = th_rng_below(r, nc);
    right = c[i].v;
    if (c[i].how == TRANSPOSED) right = add_op(p, transpose_op(right, -1, -2));
    if (c[i].how == RESHAPED) right = add_op(p, reshape_op(right, KILN_SHAPE(K, -1)));
  }
  int y = add_op(p, op2(O_MATMUL, left, right));
  kiln_shape ys = p->v[y].s;
  if (th_rng_chance(r, 0.6)) {
    bias_arg b = {.n = ys.d[ys.ndim - 1], .exclude = y};
    int bias = pick(p, r, is_bias, &b);
    if (bias >= 0) y = add_op(p, op2(O_ADD, y, bias));
  }
  if (th_rng_chance(r, 0.5)) {
    static const opk act[] = {O_RELU, O_GELU_ERF, O_GELU_TANH};
    y = add_op(p, op1(act[th_rng_below(r, COUNT(act))], y));
  }
  tame(p, y);
  return true;
}

/* Appends one op (or a few, for a matmul and its operands) from the families in fam. */
static void gen_one(plan *p, th_rng *r, unsigned fam) {
  static const struct {
    unsigned f;
    int w;
  } weights[] = {{F_UNARY, 4},   {F_SAFE, 1},   {F_BINARY, 4}, {F_DROPOUT, 1}, {F_REDUCE, 3},
                 {F_SOFTMAX, 2}, {F_MATMUL, 3}, {F_VIEW, 3},   {F_CONCAT, 1}};
  int total = 0;
  for (int i = 0; i < COUNT(weights); i++)
    if (fam & weights[i].f) total += weights[i].w;
  for (int attempt = 0; attempt < 20; attempt++) {
    int x = th_rng_below(r, total), i = 0;
    while (!(fam & weights[i].f) || x >= weights[i].w) {
      if (fam & weights[i].f) x -= weights[i].w;
      i++;
    }
    bool ok = false;
    switch (weights[i].f) {
    case F_UNARY: gen_unary(p, r, false), ok = true; break;
    case F_SAFE: gen_unary(p, r, true), ok = true; break;
    case F_BINARY: ok = gen_binary(p, r); break;
    case F_DROPOUT: ok = gen_dropout(p, r); break;
    case F_REDUCE: ok = gen_reduce(p, r); break;
    case F_SOFTMAX: ok = gen_softmax(p, r); break;
    case F_MATMUL: ok = gen_matmul(p, r); break;
    case F_VIEW: ok = gen_view(p, r); break;
    case F_CONCAT: ok = gen_concat(p, r); break;
    }
    if (ok) return;
  }
  gen_unary(p, r, false);
}

/* ---------------------------------------------------------------- leaves */

/* Sizes where kernels have edges: one, odd, a warp and either side of it, 48. */
static const int64_t special_sizes[] = {1, 2, 3, 4, 5, 7, 8, 16, 31, 32, 33, 47, 48};

static int64_t pick_size(th_rng *r) {
  if (th_rng_chance(r, 0.5)) return special_sizes[th_rng_below(r, COUNT(special_sizes))];
  return 1 + th_rng_below(r, 48);
}

static kiln_shape base_shape(th_rng *r) {
  kiln_shape s = {.ndim = 1 + th_rng_below(r, 4)};
  for (int d = 0; d < s.ndim; d++)
    s.d[d] = pick_size(r);
  while (ref_numel(s) > BASE_CAP) {
    int big = 0;
    for (int d = 1; d < s.ndim; d++)
      if (s.d[d] > s.d[big]) big = d;
    s.d[big] = 1 + th_rng_below(r, (int)(s.d[big] / 2));
  }
  return s;
}

/* The base shape, or one that broadcasts against it: some dims 1, fewer leading dims, or both. */
static kiln_shape leaf_variant(kiln_shape b, th_rng *r) {
  kiln_shape s = b;
  int c = th_rng_below(r, 10);
  if (c >= 7) {
    int drop = 1 + th_rng_below(r, s.ndim);
    if (drop == s.ndim && th_rng_chance(r, 0.5)) drop--; /* a scalar now and then */
    for (int d = 0; d + drop < s.ndim; d++)
      s.d[d] = s.d[d + drop];
    s.ndim -= drop;
  }
  if (c >= 4 && c != 7 && c != 8)
    for (int d = 0; d < s.ndim; d++)
      if (th_rng_chance(r, 0.5)) s.d[d] = 1;
  return s;
}

/* How the DAG reads a leaf: as stored, or through a transpose, a step-2 slice or an expand. */
static void choose_access(leaf *l, th_rng *r) {
  kiln_shape s = l->shape;
  l->stored = s;
  l->acc = ACC_PLAIN;
  int c = th_rng_below(r, 8);
  if (c == 0 && s.ndim >= 2) {
    l->acc = ACC_TRANS;
    l->stored.d[s.ndim - 1] = s.d[s.ndim - 2];
    l->stored.d[s.ndim - 2] = s.d[s.ndim - 1];
  } else if (c == 1 && s.ndim >= 1) {
    /* start 0 reads 2n-1 or 2n stored elements, start 1 reads 2n or 2n+1 */
    l->acc = ACC_SLICE;
    l->axis = th_rng_below(r, s.ndim);
    l->start = th_rng_below(r, 2);
    l->stored.d[l->axis] = 2 * s.d[l->axis] - 1 + l->start + th_rng_below(r, 2);
  } else if (c == 2) {
    kiln_shape t = s;
    for (int d = 0; d < t.ndim; d++)
      if (t.d[d] > 1 && th_rng_chance(r, 0.5)) t.d[d] = 1;
    int drop = 0;
    while (drop < t.ndim && t.d[drop] == 1 && th_rng_chance(r, 0.5))
      drop++;
    for (int d = 0; d + drop < t.ndim; d++)
      t.d[d] = t.d[d + drop];
    t.ndim -= drop;
    if (!ref_shape_eq(t, s)) {
      l->acc = ACC_EXPAND;
      l->stored = t;
    }
  }
}

static void make_leaves(plan *p, th_rng *r, unsigned fam) {
  kiln_shape base = base_shape(r);
  int n = 1 + th_rng_below(r, MAX_LEAVES);
  int64_t bias_n = 0;
  for (int i = 0; i < n; i++) {
    leaf *l = &p->leaves[i];
    if (bias_n) {
      l->shape = KILN_SHAPE(bias_n);
      bias_n = 0;
    } else if (i > 0 && (fam & F_MATMUL) && th_rng_chance(r, 0.5)) {
      /* a linear layer: weight (N, K) for the base's last dim K, often a bias (N) after it */
      int64_t N = pick_size(r), K = base.d[base.ndim - 1];
      l->shape = KILN_SHAPE(N, K);
      if (th_rng_chance(r, 0.7)) bias_n = N;
    } else {
      l->shape = i == 0 ? base : leaf_variant(base, r);
    }
    choose_access(l, r);
    int64_t ne = ref_numel(l->stored);
    l->host = ref_falloc(ne);
    th_fill(l->host, ne, th_rng_next(r), -2.f, 2.f);
    p->v[i] = (vinfo){.s = l->shape, .bound = 2, .leafish = true};
  }
  p->nleaf = p->nv = n;
}

/* ---------------------------------------------------------------- a whole DAG */

static void op_str(const op *o, char *b, size_t n) {
  int x = o->in[0], y = o->in[1];
  const char *name = op_name[o->k];
  char t[96];
  switch (o->k) {
  case O_EXP: snprintf(b, n, "exp(clamp(#%d, %g, %g))", x, (double)EXP_LO, (double)EXP_HI); break;
  case O_LOG:
  case O_SQRT:
  case O_RSQRT: snprintf(b, n, "%s(sigmoid(#%d) + 0.5)", name, x); break;
  case O_ADD_SCALAR:
  case O_MUL_SCALAR: snprintf(b, n, "%s(#%d, %g)", name, x, (double)o->f[0]); break;
  case O_TAME: snprintf(b, n, "mul_scalar(#%d, %g) (tame)", x, (double)o->f[0]); break;
  case O_POW2: snprintf(b, n, "pow_scalar(#%d, 2)", x); break;
  case O_CLAMP: snprintf(b, n, "clamp(#%d, %g, %g)", x, (double)o->f[0], (double)o->f[1]); break;
  case O_DIV: snprintf(b, n, "div(#%d, sigmoid(#%d) + 0.5)", x, y); break;
  case O_WHERE: snprintf(b, n, "where(gt(#%d, #%d), #%d, #%d)", x, y, x, y); break;
  case O_ADD:
  case O_SUB:
  case O_MUL:
  case O_MAXIMUM:
  case O_MINIMUM:
  case O_MATMUL: snprintf(b, n, "%s(#%d, #%d)", name, x, y); break;
  case O_DROPOUT: snprintf(b, n, "dropout(#%d, p %g)", x, (double)DROP_P); break;
  case O_SUM:
  case O_MEAN:
  case O_MAX:
    ref_axes_str(o->axes, t, sizeof t);
    snprintf(b, n, "%s(#%d, axes %s, keepdim %d)", name, x, t, o->keepdim);
    break;
  case O_SOFTMAX:
  case O_LOG_SOFTMAX: snprintf(b, n, "%s(#%d, axis %d)", name, x, o->axis); break;
  case O_TRANSPOSE: snprintf(b, n, "transpose(#%d, %d, %d)", x, o->axis, o->axis1); break;
  case O_SLICE:
    snprintf(b, n, "slice(#%d, axis %d, %d..%d, step 2)", x, o->axis, o->start, o->end);
    break;
  case O_RESHAPE:
  case O_EXPAND:
    snprintf(b, n, "%s(#%d, %s)", name, x, kiln_shape_str(o->shape, t, sizeof t));
    break;
  case O_CONCAT: snprintf(b, n, "concat(#%d, #%d, axis %d)", x, y, o->axis); break;
  default: snprintf(b, n, "%s(#%d)", name, x); break;
  }
}

static void plan_describe(plan *p, const char *suite) {
  char *t = p->text, sh[96], sh2[96], ob[160];
  size_t n = sizeof p->text, k = 0;
  app(t, n, &k, "case seed %llu (%s): %d leaves, %d ops; outputs", (unsigned long long)p->seed,
      suite, p->nleaf, p->nop);
  for (int i = 0; i < p->nout; i++)
    app(t, n, &k, " #%d", p->out[i]);
  app(t, n, &k, "\n");
  for (int i = 0; i < p->nleaf; i++) {
    const leaf *l = &p->leaves[i];
    app(t, n, &k, "  #%d = leaf %s", i, kiln_shape_str(l->shape, sh, sizeof sh));
    if (l->acc != ACC_PLAIN)
      app(t, n, &k, ", stored %s, %s", kiln_shape_str(l->stored, sh2, sizeof sh2),
          access_name[l->acc]);
    if (l->acc == ACC_SLICE) app(t, n, &k, " along axis %d from %d", l->axis, l->start);
    app(t, n, &k, "\n");
  }
  for (int j = 0; j < p->nop; j++) {
    int v = p->nleaf + j;
    op_str(&p->ops[j], ob, sizeof ob);
    app(t, n, &k, "  #%d = %s -> %s%s\n", v, ob, kiln_shape_str(p->v[v].s, sh, sizeof sh),
        p->v[v].consumed ? "" : " (unread)");
  }
}

/* Leaves, then 4 to 24 ops (a matmul's operand views and tames count), then the outputs: the
 * last value and up to two earlier values nothing reads. */
static plan *plan_make(uint64_t seed, unsigned fam, const char *suite) {
  plan *p = calloc(1, sizeof *p);
  cr_assert_not_null(p);
  p->seed = seed;
  th_rng r = {.s = seed * 0x2545f4914f6cdd1dULL + 0x1234567};
  make_leaves(p, &r, fam);
  int target = 4 + th_rng_below(&r, 21);
  while (p->nop < target)
    gen_one(p, &r, fam);
  if (p->v[p->nv - 1].leafish) add_op(p, op1(O_TANH, p->nv - 1));
  p->out[p->nout++] = p->nv - 1;
  int extra = th_rng_below(&r, MAX_OUTS);
  for (int e = 0; e < extra; e++) {
    int cand[MAX_VALUES], nc = 0;
    for (int v = p->nleaf; v < p->nv - 1; v++) {
      bool taken = false;
      for (int i = 0; i < p->nout; i++)
        taken = taken || p->out[i] == v;
      if (!p->v[v].consumed && !p->v[v].leafish && !taken) cand[nc++] = v;
    }
    if (nc == 0) break;
    p->out[p->nout++] = cand[th_rng_below(&r, nc)];
  }
  plan_describe(p, suite);
  return p;
}

static void plan_free(plan *p) {
  for (int i = 0; i < p->nleaf; i++)
    free(p->leaves[i].host);
  free(p);
}

/* ---------------------------------------------------------------- running a DAG in a context */

/* What one context holds for a case. */
typedef struct side {
  kiln_ctx *ctx;
  kiln_tensor *leaf[MAX_LEAVES]; /* persistent, requires grad */
  kiln_tensor *w[MAX_OUTS];      /* persistent loss weights, one per output */
  kiln_tensor *val[MAX_VALUES];  /* this step's values */
} side;

/* sigmoid(x) + 0.5, in (0.5, 1.5): a safe input for log, sqrt, rsqrt and division. */
static kiln_tensor *positive(kiln_tensor *x) { return kiln_add_scalar(kiln_sigmoid(x), 0.5f); }

static kiln_tensor *run_op(const op *o, kiln_tensor *a, kiln_tensor *b) {
  switch (o->k) {
  case O_NEG: return kiln_neg(a);
  case O_EXP: return kiln_exp(kiln_clamp(a, EXP_LO, EXP_HI));
  case O_TANH: return kiln_tanh(a);
  case O_SIGMOID: return kiln_sigmoid(a);
  case O_RELU: return kiln_relu(a);
  case O_GELU_ERF: return kiln_gelu(a, KILN_GELU_ERF);
  case O_GELU_TANH: return kiln_gelu(a, KILN_GELU_TANH);
  case O_ADD_SCALAR: return kiln_add_scalar(a, o->f[0]);
  case O_MUL_SCALAR:
  case O_TAME: return kiln_mul_scalar(a, o->f[0]);
  case O_POW2: return kiln_pow_scalar(a, 2.f);
  case O_CLAMP: return kiln_clamp(a, o->f[0], o->f[1]);
  case O_LOG: return kiln_log(positive(a));
  case O_SQRT: return kiln_sqrt(positive(a));
  case O_RSQRT: return kiln_rsqrt(positive(a));
  case O_ADD: return kiln_add(a, b);
  case O_SUB: return kiln_sub(a, b);
  case O_MUL: return kiln_mul(a, b);
  case O_DIV: return kiln_div(a, positive(b));
  case O_MAXIMUM: return kiln_maximum(a, b);
  case O_MINIMUM: return kiln_minimum(a, b);
  case O_WHERE: return kiln_where(kiln_gt(a, b), a, b);
  case O_DROPOUT: return kiln_dropout(a, DROP_P, 1);
  case O_SUM: return kiln_sum(a, o->axes, o->keepdim);
  case O_MEAN: return kiln_mean(a, o->axes, o->keepdim);
  case O_MAX: return kiln_max(a, o->axes, o->keepdim);
  case O_SOFTMAX: return kiln_softmax(a, o->axis);
  case O_LOG_SOFTMAX: return kiln_log_softmax(a, o->axis);
  case O_MATMUL: return kiln_matmul(a, b);
  case O_TRANSPOSE: return kiln_transpose(a, o->axis, o->axis1);
  case O_SLICE: return kiln_slice(a, o->axis, o->start, o->end, 2);
  case O_RESHAPE: return kiln_reshape(a, o->shape);
  case O_EXPAND: return kiln_expand(a, o->shape);
  case O_CONCAT: {
    kiln_tensor *ts[2] = {a, b};
    return kiln_concat(2, ts, o->axis);
  }
  case O_COUNT: break;
  }
  return NULL;
}

static kiln_tensor *leaf_value(const leaf *l, kiln_tensor *t) {
  switch (l->acc) {
  case ACC_PLAIN: return t;
  case ACC_TRANS: return kiln_transpose(t, -1, -2);
  case ACC_SLICE: return kiln_slice(t, l->axis, l->start, l->stored.d[l->axis], 2);
  case ACC_EXPAND: return kiln_expand(t, l->shape);
  }
  return NULL;
}

/* Records the DAG in sd's context (inside a step), checking every value's shape. */
static void record(const plan *p, side *sd, int mode) {
  char g[96], w[96];
  for (int v = 0; v < p->nv; v++) {
    kiln_tensor *t;
    if (v < p->nleaf) {
      t = leaf_value(&p->leaves[v], sd->leaf[v]);
    } else {
      const op *o = &p->ops[v - p->nleaf];
      t = run_op(o, sd->val[o->in[0]], sd->val[o->in[1]]);
    }
    cr_assert_not_null(t, "%s%s mode: recording #%d failed: %s", p->text, mode_name[mode], v,
                       th_err(sd->ctx));
    cr_assert(ref_shape_eq(kiln_tensor_shape(t), p->v[v].s), "%s%s mode: #%d has shape %s, want %s",
              p->text, mode_name[mode], v, kiln_shape_str(kiln_tensor_shape(t), g, sizeof g),
              kiln_shape_str(p->v[v].s, w, sizeof w));
    sd->val[v] = t;
  }
}

static float *read_tensor(const plan *p, kiln_ctx *ctx, kiln_tensor *t, const char *what,
                          int mode) {
  int64_t n = kiln_tensor_numel(t);
  float *h = ref_falloc(n);
  kiln_status st = kiln_tensor_to_host(t, h, (size_t)n * sizeof *h);
  cr_assert_eq(st, KILN_OK, "%s%s mode: reading %s failed: %s", p->text, mode_name[mode], what,
               th_err(ctx));
  return h;
}

/* The loss: the sum over outputs of sum(out * w). */
static kiln_tensor *weighted_loss(const plan *p, side *sd) {
  kiln_tensor *loss = NULL;
  for (int k = 0; k < p->nout; k++) {
    kiln_tensor *term = kiln_sum(kiln_mul(sd->val[p->out[k]], sd->w[k]), KILN_ALL_AXES, 0);
    loss = loss ? kiln_add(loss, term) : term;
  }
  return loss;
}

/* ---------------------------------------------------------------- comparing the two modes */

static bool close_enough(double a, double b, double atol, double rtol) {
  return isfinite(a) && fabs(a - b) <= atol + rtol * fabs(b);
}

static void compare_outputs(const plan *p, float *const *fu, float *const *un) {
  char sh[96];
  for (int k = 0; k < p->nout; k++) {
    int v = p->out[k];
    int64_t n = ref_numel(p->v[v].s);
    for (int64_t i = 0; i < n; i++) {
      double a = fu[k][i], b = un[k][i];
      cr_assert(isfinite(b),
                "%soutput %d (#%d %s), element %lld: %g in the unfused run; the generator must "
                "keep values finite",
                p->text, k, v, kiln_shape_str(p->v[v].s, sh, sizeof sh), (long long)i, b);
      cr_assert(close_enough(a, b, 1e-5, 1e-4),
                "%soutput %d (#%d %s), element %lld: fused %.9g, unfused %.9g (|diff| %.3g > "
                "1e-5 + 1e-4 |unfused|)",
                p->text, k, v, kiln_shape_str(p->v[v].s, sh, sizeof sh), (long long)i, a, b,
                fabs(a - b));
    }
  }
}

/* Compares every leaf's gradient (1e-4 + 1e-3 relative: gradient sums reorder). Shapes and
 * presence must match exactly; on a value difference writes the first one and the count to msg
 * and returns false. */
static bool compare_grads(const plan *p, side *sd, char *msg, size_t cap) {
  char sh[96];
  bool same = true;
  size_t len = 0;
  for (int l = 0; l < p->nleaf; l++) {
    kiln_tensor *g[2] = {kiln_tensor_grad(sd[0].leaf[l]), kiln_tensor_grad(sd[1].leaf[l])};
    cr_assert(!g[0] == !g[1], "%sleaf #%d has a gradient in the %s run only", p->text, l,
              mode_name[g[0] ? 0 : 1]);
    if (!g[0]) continue;
    float *h[2];
    for (int i = 0; i < 2; i++) {
      cr_assert(ref_shape_eq(kiln_tensor_shape(g[i]), p->leaves[l].stored),
                "%s%s mode: the gradient of leaf #%d has shape %s, want the stored shape", p->text,
                mode_name[i], l, kiln_shape_str(kiln_tensor_shape(g[i]), sh, sizeof sh));
      h[i] = read_tensor(p, sd[i].ctx, g[i], "a leaf's gradient", i);
    }
    int64_t n = ref_numel(p->leaves[l].stored), bad = 0, first = -1;
    for (int64_t i = 0; i < n; i++)
      if (!close_enough(h[0][i], h[1][i], 1e-4, 1e-3)) {
        if (first < 0) first = i;
        bad++;
      }
    if (bad) {
      if (same)
        app(msg, cap, &len,
            "leaf #%d (stored %s): %lld of %lld gradient elements differ, first %lld: fused "
            "%.9g, unfused %.9g",
            l, kiln_shape_str(p->leaves[l].stored, sh, sizeof sh), (long long)bad, (long long)n,
            (long long)first, (double)h[0][first], (double)h[1][first]);
      else
        app(msg, cap, &len, "; leaf #%d: %lld elements differ", l, (long long)bad);
      same = false;
    }
    free(h[0]);
    free(h[1]);
  }
  return same;
}

/* The largest |element| of t, read from the unfused run. */
static double max_abs(const plan *p, kiln_ctx *ctx, kiln_tensor *t) {
  float *h = read_tensor(p, ctx, t, "a kink's input (diagnosis)", 1);
  double m = 0;
  for (int64_t e = 0; e < kiln_tensor_numel(t); e++)
    m = fmax(m, fabs(h[e]));
  free(h);
  return m;
}

/*
 * After a gradient difference: counts the elements of the unfused run that sit near a kink but
 * not on it (relu at 0, clamp at its bounds, a near-tie of maximum, minimum, where(gt) or of a
 * max reduction), near meaning 0 < |distance| <= 1e-5 of the inputs' largest magnitude. There,
 * the rounding differences fusion may make (FMA contraction, another summation order) can send
 * the two modes' gradients down different branches. Exact ties are left out: they come from the
 * DAG's structure (x against a broadcast of itself, relu of zeros) and are exact in both modes.
 * Unfused, every value has memory, so all of them can be read. Writes the first site to msg.
 */
static int64_t near_kinks(const plan *p, side *u, char *msg, size_t cap) {
  kiln_ctx *ctx = u->ctx;
  int64_t near = 0;
  size_t len = 0;
  kiln_no_grad_begin(ctx);
  for (int j = 0; j < p->nop; j++) {
    const op *o = &p->ops[j];
    kiln_tensor *x = u->val[o->in[0]], *y = u->val[o->in[1]];
    kiln_tensor *d[2] = {NULL, NULL};
    switch (o->k) {
    case O_RELU: d[0] = x; break;
    case O_CLAMP:
      d[0] = kiln_add_scalar(x, -o->f[0]);
      d[1] = kiln_add_scalar(x, -o->f[1]);
      break;
    case O_EXP:
      d[0] = kiln_add_scalar(x, -EXP_LO);
      d[1] = kiln_add_scalar(x, -EXP_HI);
      break;
    case O_MAXIMUM:
    case O_MINIMUM:
    case O_WHERE: d[0] = kiln_sub(x, y); break;
    case O_MAX: d[0] = kiln_sub(kiln_max(x, o->axes, 1), x); break;
    default: break;
    }
    if (!d[0]) continue;
    /* about a hundred units in the last place of the inputs' largest element */
    double eps = 1e-5 * fmax(max_abs(p, ctx, x), max_abs(p, ctx, y)) + 1e-30;
    for (int i = 0; i < 2 && d[i]; i++) {
      float *h = read_tensor(p, ctx, d[i], "a kink's distance (diagnosis)", 1);
      int64_t n = kiln_tensor_numel(d[i]), here = 0;
      for (int64_t e = 0; e < n; e++)
        here += h[e] != 0 && fabs(h[e]) <= eps;
      if (here && !near)
        app(msg, cap, &len, "%s #%d: %lld element(s) within %.2g of its kink", op_name[o->k],
            p->nleaf + j, (long long)here, eps);
      near += here;
      free(h);
    }
  }
  kiln_no_grad_end(ctx);
  return near;
}

/* ---------------------------------------------------------------- one case, one Test */

typedef struct suite {
  const char *name;
  unsigned fam;
  side sd[2]; /* 0: fused, 1: unfused */
  uint64_t kernels[2], groups[2];
  int cases, excused;
} suite;

static void run_case(suite *S, uint64_t seed) {
  plan *p = plan_make(seed, S->fam, S->name);
  side *sd = S->sd;
  kiln_exec_stats before[2], after[2];
  float *wh[MAX_OUTS];
  for (int k = 0; k < p->nout; k++) {
    int64_t n = ref_numel(p->v[p->out[k]].s);
    wh[k] = ref_falloc(n);
    th_fill(wh[k], n, seed * 31 + (uint64_t)k, -1.f, 1.f);
  }
  /* the same leaves and loss weights in both contexts */
  for (int i = 0; i < 2; i++) {
    kiln_stats(sd[i].ctx, &before[i]);
    for (int l = 0; l < p->nleaf; l++) {
      sd[i].leaf[l] =
          kiln_tensor_from_host(sd[i].ctx, KILN_DTYPE_F32, p->leaves[l].stored, p->leaves[l].host);
      cr_assert_not_null(sd[i].leaf[l], "%supload of leaf #%d: %s", p->text, l, th_err(sd[i].ctx));
      kiln_tensor_set_requires_grad(sd[i].leaf[l], 1);
    }
    for (int k = 0; k < p->nout; k++) {
      sd[i].w[k] = kiln_tensor_from_host(sd[i].ctx, KILN_DTYPE_F32, p->v[p->out[k]].s, wh[k]);
      cr_assert_not_null(sd[i].w[k], "%supload of a loss weight: %s", p->text, th_err(sd[i].ctx));
    }
    th_assert_ok(sd[i].ctx);
  }

  /* forward: only the outputs are read, nothing else consumes them */
  float *out[2][MAX_OUTS];
  for (int i = 0; i < 2; i++) {
    kiln_ctx *ctx = sd[i].ctx;
    kiln_manual_seed(ctx, seed);
    kiln_step_begin(ctx);
    record(p, &sd[i], i);
    kiln_status st = kiln_sync(ctx);
    cr_assert_eq(st, KILN_OK, "%s%s mode: kiln_sync: %s", p->text, mode_name[i], th_err(ctx));
    for (int k = 0; k < p->nout; k++)
      out[i][k] = read_tensor(p, ctx, sd[i].val[p->out[k]], "an output", i);
    st = kiln_step_end(ctx);
    cr_assert_eq(st, KILN_OK, "%s%s mode: kiln_step_end: %s", p->text, mode_name[i], th_err(ctx));
  }
  compare_outputs(p, out[0], out[1]);

  /* backward: the same DAG again (same seed, same dropout masks) with the loss, in one step */
  double scale = 0;
  for (int k = 0; k < p->nout; k++)
    for (int64_t e = 0; e < ref_numel(p->v[p->out[k]].s); e++)
      scale += fabs((double)out[1][k][e] * wh[k][e]);
  float loss[2];
  for (int i = 0; i < 2; i++) {
    kiln_ctx *ctx = sd[i].ctx;
    kiln_manual_seed(ctx, seed);
    kiln_step_begin(ctx);
    record(p, &sd[i], i);
    kiln_tensor *l = weighted_loss(p, &sd[i]);
    cr_assert_not_null(l, "%s%s mode: recording the loss: %s", p->text, mode_name[i], th_err(ctx));
    kiln_status st = kiln_backward(l);
    cr_assert_eq(st, KILN_OK, "%s%s mode: kiln_backward: %s", p->text, mode_name[i], th_err(ctx));
    st = kiln_step_end(ctx);
    cr_assert_eq(st, KILN_OK, "%s%s mode: kiln_step_end after backward: %s", p->text, mode_name[i],
                 th_err(ctx));
    loss[i] = kiln_tensor_item(l);
    th_assert_ok(ctx);
  }
  cr_assert(close_enough(loss[0], loss[1], 1e-5 * (1 + scale), 1e-4),
            "%sloss sum(out * w): fused %.9g, unfused %.9g (sum |out * w| = %.4g)", p->text,
            (double)loss[0], (double)loss[1], scale);
  char msg[1024] = "";
  bool same = compare_grads(p, sd, msg, sizeof msg);
  for (int i = 0; i < 2; i++) {
    kiln_stats(sd[i].ctx, &after[i]);
    S->kernels[i] += after[i].kernels_launched - before[i].kernels_launched;
    S->groups[i] += after[i].groups - before[i].groups;
  }
  if (!same) {
    char where[512] = "";
    int64_t near = near_kinks(p, &sd[1], where, sizeof where);
    cr_assert(near > 0,
              "%sgradients differ: %s\nno value of the unfused run sits near a relu, clamp, "
              "maximum, minimum, where or max kink, so rounding cannot explain it",
              p->text, msg);
    S->excused++;
    cr_log_warn("%sgradients differ: %s\nput down to rounding at a kink: %s", p->text, msg, where);
  }

  for (int i = 0; i < 2; i++) {
    for (int l = 0; l < p->nleaf; l++)
      kiln_tensor_free(sd[i].leaf[l]);
    for (int k = 0; k < p->nout; k++) {
      kiln_tensor_free(sd[i].w[k]);
      free(out[i][k]);
    }
  }
  for (int k = 0; k < p->nout; k++)
    free(wh[k]);
  plan_free(p);
  S->cases++;
}

/* Runs ncases random DAGs of the families in fam, seeds seed0, seed0 + 1, ... */
static void run_suite(const char *name, unsigned fam, uint64_t seed0, int ncases) {
  TH_GPU_CTX(fused);
  TH_GPU_CTX(unfused);
  kiln_set_fusion(fused, 1);
  kiln_set_fusion(unfused, 0);
  cr_assert_eq(kiln_fusion(fused), 1, "kiln_fusion after kiln_set_fusion(ctx, 1)");
  cr_assert_eq(kiln_fusion(unfused), 0, "kiln_fusion after kiln_set_fusion(ctx, 0)");
  suite S = {.name = name, .fam = fam, .sd = {{.ctx = fused}, {.ctx = unfused}}};
  for (int c = 0; c < ncases; c++)
    run_case(&S, seed0 + (uint64_t)c);
  cr_log_info("%s: %d cases; kernels launched: %llu fused, %llu unfused; groups planned: %llu "
              "fused, %llu unfused; %d gradient difference(s) put down to near-kinks",
              name, S.cases, (unsigned long long)S.kernels[0], (unsigned long long)S.kernels[1],
              (unsigned long long)S.groups[0], (unsigned long long)S.groups[1], S.excused);
  cr_assert(S.kernels[0] <= S.kernels[1],
            "%s: fusion launched more kernels (%llu) than running every node alone (%llu)", name,
            (unsigned long long)S.kernels[0], (unsigned long long)S.kernels[1]);
  cr_assert(S.excused <= MAX_EXCUSED,
            "%s: %d cases had gradient differences put down to near-kinks (at most %d expected "
            "by chance); see the warnings above",
            name, S.excused, MAX_EXCUSED);
  th_ctx_free(fused);
  th_ctx_free(unfused);
}

Test(gpu_fusion, elementwise_dags) {
  run_suite("elementwise", F_UNARY | F_SAFE | F_BINARY | F_DROPOUT, 1000, 80);
}

Test(gpu_fusion, reduction_and_softmax_dags) {
  run_suite("reductions and softmax",
            F_UNARY | F_SAFE | F_BINARY | F_DROPOUT | F_REDUCE | F_SOFTMAX, 2000, 80);
}

Test(gpu_fusion, matmul_and_view_dags) {
  run_suite("matmul and views", F_UNARY | F_BINARY | F_MATMUL | F_VIEW | F_CONCAT, 3000, 80);
}

Test(gpu_fusion, mixed_dags) {
  run_suite("mixed",
            F_UNARY | F_SAFE | F_BINARY | F_DROPOUT | F_REDUCE | F_SOFTMAX | F_MATMUL | F_VIEW |
                F_CONCAT,
            4000, 100);
}

/* Every DAG of the four suites, forward and backward, planned fused and unfused in a context
 * without a GPU, each plan checked by the verifier (fusion/verify.c); one case in eight is also
 * compiled. Needs no GPU. */
Test(gpu_fusion, dags_plan_verify_and_compile_without_a_gpu, .timeout = 1200) {
  static const struct {
    unsigned fam;
    uint64_t seed0;
    int n;
  } suites[] = {
      {F_UNARY | F_SAFE | F_BINARY | F_DROPOUT, 1000, 80},
      {F_UNARY | F_SAFE | F_BINARY | F_DROPOUT | F_REDUCE | F_SOFTMAX, 2000, 80},
      {F_UNARY | F_BINARY | F_MATMUL | F_VIEW | F_CONCAT, 3000, 80},
      {F_UNARY | F_SAFE | F_BINARY | F_DROPOUT | F_REDUCE | F_SOFTMAX | F_MATMUL | F_VIEW |
           F_CONCAT,
       4000, 100},
  };
  kiln_ctx *ctx = th_cpu_ctx();
  ctx->debug |= KILN__DEBUG_VERIFY;
  int cases = 0;
  for (size_t s = 0; s < sizeof suites / sizeof suites[0]; s++) {
    for (int c = 0; c < suites[s].n; c++) {
      plan *p = plan_make(suites[s].seed0 + (uint64_t)c, suites[s].fam, "no-GPU plans");
      side sd = {.ctx = ctx};
      for (int l = 0; l < p->nleaf; l++) {
        sd.leaf[l] =
            kiln_tensor_from_host(ctx, KILN_DTYPE_F32, p->leaves[l].stored, p->leaves[l].host);
        kiln_tensor_set_requires_grad(sd.leaf[l], 1);
      }
      for (int k = 0; k < p->nout; k++)
        sd.w[k] = kiln_tensor_new(ctx, KILN_DTYPE_F32, p->v[p->out[k]].s);
      th_assert_ok(ctx);
      kiln_step_begin(ctx);
      record(p, &sd, 0);
      kiln_tensor *loss = weighted_loss(p, &sd);
      cr_assert_eq(kiln_backward(loss), KILN_OK, "%skiln_backward: %s", p->text, th_err(ctx));
      for (int fuse = 1; fuse >= 0; fuse--) {
        kiln__plan pl;
        cr_assert(kiln__plan_build(ctx, 0, ctx->trace.n, fuse, &pl), "%splanning: %s", p->text,
                  th_err(ctx));
        kiln__plan_free(&pl);
      }
      if (c % 8 == 0) {
        kiln_set_fusion(ctx, c % 16 == 0);
        cr_assert_eq(kiln__engine_compile(ctx, 0, ctx->trace.n), KILN_OK, "%scompiling: %s",
                     p->text, th_err(ctx));
      }
      kiln_step_begin(ctx);
      for (int l = 0; l < p->nleaf; l++)
        kiln_tensor_free(sd.leaf[l]);
      for (int k = 0; k < p->nout; k++)
        kiln_tensor_free(sd.w[k]);
      plan_free(p);
      cases++;
    }
  }
  cr_log_info("%d DAGs planned fused and unfused, forward and backward, and verified", cases);
  th_ctx_free(ctx);
}

/* ---------------------------------------------------------------- a training run */

#define MLP_BATCH 64
#define MLP_IN 784
#define MLP_HIDDEN 128
#define MLP_OUT 10
#define MLP_STEPS 20

typedef struct mlp {
  kiln_ctx *ctx;
  kiln_params *params;
  kiln_linear l1, l2;
  kiln_optim *opt;
  kiln_tensor *x, *y; /* (64, 784) f32, (64) i32 */
} mlp;

static void mlp_init(mlp *m, kiln_ctx *ctx, const float *xh, const int32_t *yh) {
  m->ctx = ctx;
  kiln_manual_seed(ctx, 2024);
  m->params = kiln_params_new(ctx);
  cr_assert_not_null(m->params, "kiln_params_new: %s", th_err(ctx));
  cr_assert_eq(
      kiln_linear_init(&m->l1, m->params,
                       &(kiln_linear_options){.name = "fc1", .in = MLP_IN, .out = MLP_HIDDEN}),
      KILN_OK, "%s", th_err(ctx));
  cr_assert_eq(
      kiln_linear_init(&m->l2, m->params,
                       &(kiln_linear_options){.name = "fc2", .in = MLP_HIDDEN, .out = MLP_OUT}),
      KILN_OK, "%s", th_err(ctx));
  kiln_sgd_options o = kiln_sgd_defaults(0.05f);
  o.momentum = 0.9f;
  o.nesterov = 1;
  m->opt = kiln_sgd_new(m->params, &o);
  cr_assert_not_null(m->opt, "kiln_sgd_new: %s", th_err(ctx));
  m->x = kiln_tensor_from_host(ctx, KILN_DTYPE_F32, KILN_SHAPE(MLP_BATCH, MLP_IN), xh);
  m->y = kiln_tensor_from_host(ctx, KILN_DTYPE_I32, KILN_SHAPE(MLP_BATCH), yh);
  cr_assert(m->x && m->y, "uploading the batch: %s", th_err(ctx));
}

/* One step: forward, cross-entropy, backward, SGD update; returns the loss. */
static float mlp_step(mlp *m, int step, int mode) {
  kiln_ctx *ctx = m->ctx;
  kiln_step_begin(ctx);
  kiln_optim_zero_grad(m->opt);
  kiln_tensor *h = kiln_relu(kiln_linear_forward(&m->l1, m->x));
  kiln_tensor *loss =
      kiln_cross_entropy(kiln_linear_forward(&m->l2, h), m->y, KILN_REDUCTION_MEAN, 0.f);
  cr_assert_not_null(loss, "%s mode, step %d: the forward pass: %s", mode_name[mode], step,
                     th_err(ctx));
  cr_assert_eq(kiln_backward(loss), KILN_OK, "%s mode, step %d: kiln_backward: %s", mode_name[mode],
               step, th_err(ctx));
  cr_assert_eq(kiln_optim_step(m->opt), KILN_OK, "%s mode, step %d: kiln_optim_step: %s",
               mode_name[mode], step, th_err(ctx));
  cr_assert_eq(kiln_step_end(ctx), KILN_OK, "%s mode, step %d: kiln_step_end: %s", mode_name[mode],
               step, th_err(ctx));
  float l = kiln_tensor_item(loss);
  th_assert_ok(ctx);
  return l;
}

static void mlp_free(mlp *m) {
  kiln_optim_free(m->opt);
  kiln_params_free(m->params);
  kiln_tensor_free(m->x);
  kiln_tensor_free(m->y);
}

/* Two MLPs with the same initial parameters and the same random batch (seeds for the images
 * and the labels) in contexts a and b; returns the batch's images for the caller to free. */
static float *mlp_pair_init(mlp *m, kiln_ctx *a, kiln_ctx *b, uint64_t xseed, uint64_t yseed) {
  float *xh = ref_falloc(MLP_BATCH * MLP_IN);
  th_fill(xh, MLP_BATCH * MLP_IN, xseed, -1.f, 1.f);
  int32_t yh[MLP_BATCH];
  th_rng r = {.s = yseed};
  for (int i = 0; i < MLP_BATCH; i++)
    yh[i] = th_rng_below(&r, MLP_OUT);
  mlp_init(&m[0], a, xh, yh);
  mlp_init(&m[1], b, xh, yh);
  return xh;
}

Test(gpu_fusion, mlp_training_fused_equals_unfused) {
  TH_GPU_CTX(fused);
  TH_GPU_CTX(unfused);
  kiln_set_fusion(fused, 1);
  kiln_set_fusion(unfused, 0);
  mlp m[2];
  float *xh = mlp_pair_init(m, fused, unfused, 4242, 77);

  /* the same seed gives the same initial parameters */
  int64_t n[2];
  float *p0[2] = {th_params_values(m[0].params, &n[0]), th_params_values(m[1].params, &n[1])};
  int64_t want = (int64_t)MLP_IN * MLP_HIDDEN + MLP_HIDDEN + MLP_HIDDEN * MLP_OUT + MLP_OUT;
  cr_assert(n[0] == want && n[1] == want, "parameter counts %lld and %lld, want %lld",
            (long long)n[0], (long long)n[1], (long long)want);
  for (int64_t i = 0; i < want; i++)
    cr_assert_eq(p0[0][i], p0[1][i], "initial parameter %lld differs: %.9g vs %.9g", (long long)i,
                 (double)p0[0][i], (double)p0[1][i]);

  kiln_exec_stats s0[2], s1[2];
  kiln_stats(fused, &s0[0]);
  kiln_stats(unfused, &s0[1]);
  float first = 0, last = 0;
  for (int step = 0; step < MLP_STEPS; step++) {
    float lf = mlp_step(&m[0], step, 0), lu = mlp_step(&m[1], step, 1);
    cr_assert(isfinite(lu) && close_enough(lf, lu, 1e-7, 1e-4),
              "step %d: loss %.9g fused, %.9g unfused (want within 1e-4 relative)", step,
              (double)lf, (double)lu);
    if (step == 0) first = lu;
    last = lu;
  }
  kiln_stats(fused, &s1[0]);
  kiln_stats(unfused, &s1[1]);

  float *p1[2] = {th_params_values(m[0].params, &n[0]), th_params_values(m[1].params, &n[1])};
  for (int64_t i = 0; i < want; i++)
    cr_assert(close_enough(p1[0][i], p1[1][i], 1e-4, 0),
              "after %d steps parameter %lld differs: fused %.9g, unfused %.9g (want within "
              "1e-4)",
              MLP_STEPS, (long long)i, (double)p1[0][i], (double)p1[1][i]);
  cr_assert(last < first, "%d steps on one batch did not lower the loss: %.6f -> %.6f", MLP_STEPS,
            (double)first, (double)last);
  uint64_t kf = s1[0].kernels_launched - s0[0].kernels_launched,
           ku = s1[1].kernels_launched - s0[1].kernels_launched;
  cr_log_info("mlp 784-128-10, %d steps: loss %.4f -> %.4f; kernels launched: %llu fused, %llu "
              "unfused",
              MLP_STEPS, (double)first, (double)last, (unsigned long long)kf,
              (unsigned long long)ku);
  cr_assert(kf <= ku, "training: fusion launched more kernels (%llu) than unfused (%llu)",
            (unsigned long long)kf, (unsigned long long)ku);

  for (int i = 0; i < 2; i++) {
    free(p0[i]);
    free(p1[i]);
    mlp_free(&m[i]);
  }
  free(xh);
  th_ctx_free(fused);
  th_ctx_free(unfused);
}

/* The fallback for products whose epilogues the BLAS library does not take: with every epilogue
 * withheld (kiln__blas_limit), biases, ReLUs, their derivatives and the bias gradients run in
 * generated kernels, in graph mode, with the numbers of the epilogue run. */
Test(gpu_fusion, mlp_training_without_blas_epilogues_equals_with_them) {
  TH_GPU_CTX(full);
  TH_GPU_CTX(plain);
  kiln__blas_limit(plain, 1u << KILN__EPI_NONE);
  mlp m[2];
  float *xh = mlp_pair_init(m, full, plain, 4243, 78);
  kiln_exec_stats s[2];
  for (int step = 0; step < MLP_STEPS; step++) {
    float lf = mlp_step(&m[0], step, 0), lp = mlp_step(&m[1], step, 0);
    cr_assert(isfinite(lp) && close_enough(lf, lp, 1e-7, 1e-4),
              "step %d: loss %.9g with epilogues, %.9g without (want within 1e-4 relative)", step,
              (double)lf, (double)lp);
  }
  kiln_stats(full, &s[0]);
  kiln_stats(plain, &s[1]);
  cr_assert_eq(s[1].graph_captures, 1u, "the plain step was captured once");
  cr_assert_gt(s[1].last_flush.kernels, s[0].last_flush.kernels,
               "without epilogues the step runs more kernels (%llu vs %llu)",
               (unsigned long long)s[1].last_flush.kernels,
               (unsigned long long)s[0].last_flush.kernels);
  int64_t n[2];
  float *p[2] = {th_params_values(m[0].params, &n[0]), th_params_values(m[1].params, &n[1])};
  cr_assert_eq(n[0], n[1]);
  for (int64_t i = 0; i < n[0]; i++)
    cr_assert(close_enough(p[0][i], p[1][i], 1e-4, 0),
              "after %d steps parameter %lld differs: %.9g with epilogues, %.9g without", MLP_STEPS,
              (long long)i, (double)p[0][i], (double)p[1][i]);
  for (int i = 0; i < 2; i++) {
    free(p[i]);
    mlp_free(&m[i]);
  }
  free(xh);
  th_ctx_free(full);
  th_ctx_free(plain);
}
