/*
 * rules.c: the backward rule of every op in ops.def that has one. A rule records the gradients of
 * a node's inputs with the ordinary op functions, so backward ops are traced (and later fused)
 * like forward ones. Rules skip inputs that do not need a gradient.
 */
#include <string.h>

#include "rules.h"

#define NEED(i) (n->in[i]->requires_grad)

/* Sums g over the dims that broadcasting added or stretched, then shapes it as (ndim, shape). */
kiln_tensor *kiln__unbroadcast(kiln_tensor *g, int ndim, const int64_t *shape) {
  if (!g) return NULL;
  unsigned mask = 0;
  int lead = g->ndim - ndim;
  for (int d = 0; d < g->ndim; d++) {
    int j = d - lead;
    if (j < 0 || (shape[j] == 1 && g->shape[d] != 1)) mask |= 1u << d;
  }
  kiln_shape s = {.ndim = ndim};
  memcpy(s.d, shape, (size_t)ndim * sizeof *shape);
  if (mask == 0) return g->ndim == ndim ? g : kiln_reshape(g, s);
  kiln_tensor *r = kiln__reduce(KILN__OP_SUM, "kiln_backward", g, mask, 1, 1.f);
  return kiln_reshape(r, s);
}

static kiln_tensor *ub(kiln_tensor *g, const kiln_tensor *like) {
  return kiln__unbroadcast(g, like->ndim, like->shape);
}

static kiln_tensor *zeros_like_scalar(kiln_ctx *ctx) {
  return kiln_full(ctx, KILN_SCALAR_SHAPE, 0.f);
}

void kiln__grad_NONE(kiln__bw *b, const kiln__node *n, kiln_tensor *g, kiln_tensor **gin) {
  (void)b, (void)n, (void)g, (void)gin;
  KILN_ASSERT(!"backward through an op without a gradient");
}

void kiln__grad_add(kiln__bw *b, const kiln__node *n, kiln_tensor *g, kiln_tensor **gin) {
  (void)b;
  if (NEED(0)) gin[0] = ub(g, n->in[0]);
  if (NEED(1)) gin[1] = ub(g, n->in[1]);
}

void kiln__grad_sub(kiln__bw *b, const kiln__node *n, kiln_tensor *g, kiln_tensor **gin) {
  (void)b;
  if (NEED(0)) gin[0] = ub(g, n->in[0]);
  if (NEED(1)) gin[1] = ub(kiln_neg(g), n->in[1]);
}

void kiln__grad_mul(kiln__bw *b, const kiln__node *n, kiln_tensor *g, kiln_tensor **gin) {
  (void)b;
  if (NEED(0)) gin[0] = ub(kiln_mul(g, n->in[1]), n->in[0]);
  if (NEED(1)) gin[1] = ub(kiln_mul(g, n->in[0]), n->in[1]);
}

void kiln__grad_div(kiln__bw *b, const kiln__node *n, kiln_tensor *g, kiln_tensor **gin) {
  (void)b;
  kiln_tensor *ga = kiln_div(g, n->in[1]);
  if (NEED(0)) gin[0] = ub(ga, n->in[0]);
  /* d(a/b)/db = -(a/b)/b */
  if (NEED(1)) gin[1] = ub(kiln_neg(kiln_mul(ga, n->out)), n->in[1]);
}

/* maximum/minimum: the gradient goes to the chosen input, split evenly on ties (as PyTorch). */
static void grad_minmax(const kiln__node *n, kiln_tensor *g, kiln_tensor **gin, bool max) {
  kiln_tensor *a = n->in[0], *c = n->in[1];
  kiln_tensor *wins = max ? kiln_gt(a, c) : kiln_lt(a, c);
  kiln_tensor *wa = kiln_add(wins, kiln_mul_scalar(kiln_eq(a, c), 0.5f));
  if (NEED(0)) gin[0] = ub(kiln_mul(g, wa), a);
  if (NEED(1)) gin[1] = ub(kiln_mul(g, kiln_add_scalar(kiln_neg(wa), 1.f)), c);
}
void kiln__grad_maximum(kiln__bw *b, const kiln__node *n, kiln_tensor *g, kiln_tensor **gin) {
  (void)b;
  grad_minmax(n, g, gin, true);
}
void kiln__grad_minimum(kiln__bw *b, const kiln__node *n, kiln_tensor *g, kiln_tensor **gin) {
  (void)b;
  grad_minmax(n, g, gin, false);
}

void kiln__grad_where(kiln__bw *b, const kiln__node *n, kiln_tensor *g, kiln_tensor **gin) {
  (void)b;
  kiln_tensor *z = zeros_like_scalar(g->ctx);
  if (NEED(1)) gin[1] = ub(kiln_where(n->in[0], g, z), n->in[1]);
  if (NEED(2)) gin[2] = ub(kiln_where(n->in[0], z, g), n->in[2]);
}

void kiln__grad_neg(kiln__bw *b, const kiln__node *n, kiln_tensor *g, kiln_tensor **gin) {
  (void)b, (void)n;
  gin[0] = kiln_neg(g);
}
void kiln__grad_exp(kiln__bw *b, const kiln__node *n, kiln_tensor *g, kiln_tensor **gin) {
  (void)b;
  gin[0] = kiln_mul(g, n->out);
}
void kiln__grad_log(kiln__bw *b, const kiln__node *n, kiln_tensor *g, kiln_tensor **gin) {
  (void)b;
  gin[0] = kiln_div(g, n->in[0]);
}
void kiln__grad_sqrt(kiln__bw *b, const kiln__node *n, kiln_tensor *g, kiln_tensor **gin) {
  (void)b;
  gin[0] = kiln_div(kiln_mul_scalar(g, 0.5f), n->out);
}
void kiln__grad_rsqrt(kiln__bw *b, const kiln__node *n, kiln_tensor *g, kiln_tensor **gin) {
  (void)b;
  /* d x^-1/2 = -1/2 x^-3/2 = -1/2 y^3 */
  gin[0] = kiln_mul(g, kiln_mul_scalar(kiln_pow_scalar(n->out, 3.f), -0.5f));
}
void kiln__grad_tanh(kiln__bw *b, const kiln__node *n, kiln_tensor *g, kiln_tensor **gin) {
  (void)b;
  gin[0] = kiln_mul(g, kiln_add_scalar(kiln_neg(kiln_mul(n->out, n->out)), 1.f));
}
void kiln__grad_sigmoid(kiln__bw *b, const kiln__node *n, kiln_tensor *g, kiln_tensor **gin) {
  (void)b;
  gin[0] = kiln_mul(g, kiln_mul(n->out, kiln_add_scalar(kiln_neg(n->out), 1.f)));
}
void kiln__grad_relu(kiln__bw *b, const kiln__node *n, kiln_tensor *g, kiln_tensor **gin) {
  (void)b;
  /* the output's sign, or the recomputed input's (the same: x > 0 where relu(x) > 0) */
  kiln_tensor *in[2] = {g, kiln__recomputes_input(n) ? kiln__activation_input(n) : n->out};
  gin[0] = kiln__ew(KILN__OP_RELU_GRAD, "kiln_backward", 2, in);
}
void kiln__grad_gelu_erf(kiln__bw *b, const kiln__node *n, kiln_tensor *g, kiln_tensor **gin) {
  (void)b;
  kiln_tensor *in[2] = {g, kiln__activation_input(n)};
  gin[0] = kiln__ew(KILN__OP_GELU_ERF_GRAD, "kiln_backward", 2, in);
}
void kiln__grad_gelu_tanh(kiln__bw *b, const kiln__node *n, kiln_tensor *g, kiln_tensor **gin) {
  (void)b;
  kiln_tensor *in[2] = {g, kiln__activation_input(n)};
  gin[0] = kiln__ew(KILN__OP_GELU_TANH_GRAD, "kiln_backward", 2, in);
}
void kiln__grad_abs(kiln__bw *b, const kiln__node *n, kiln_tensor *g, kiln_tensor **gin) {
  (void)b;
  kiln_tensor *in[2] = {g, n->in[0]};
  gin[0] = kiln__ew(KILN__OP_ABS_GRAD, "kiln_backward", 2, in);
}
void kiln__grad_silu(kiln__bw *b, const kiln__node *n, kiln_tensor *g, kiln_tensor **gin) {
  (void)b;
  kiln_tensor *in[2] = {g, kiln__activation_input(n)};
  gin[0] = kiln__ew(KILN__OP_SILU_GRAD, "kiln_backward", 2, in);
}
void kiln__grad_erf(kiln__bw *b, const kiln__node *n, kiln_tensor *g, kiln_tensor **gin) {
  (void)b;
  /* d erf(x) / dx = 2 / sqrt(pi) exp(-x^2), recorded with ordinary ops (they fuse into one) */
  kiln_tensor *x = n->in[0];
  kiln_tensor *d = kiln_mul_scalar(kiln_exp(kiln_neg(kiln_mul(x, x))), 1.12837916709551257f);
  gin[0] = kiln_mul(g, d);
}
void kiln__grad_leaky_relu(kiln__bw *b, const kiln__node *n, kiln_tensor *g, kiln_tensor **gin) {
  (void)b;
  kiln_tensor *in[2] = {g, kiln__activation_input(n)};
  kiln_tensor *out = kiln__ew(KILN__OP_LEAKY_RELU_GRAD, "kiln_backward", 2, in);
  if (out)
    KILN__F(kiln__producer(out), LEAKY_RELU_GRAD, negative_slope) =
        KILN__F(n, LEAKY_RELU, negative_slope);
  gin[0] = out;
}
void kiln__grad_softplus(kiln__bw *b, const kiln__node *n, kiln_tensor *g, kiln_tensor **gin) {
  (void)b;
  kiln_tensor *in[2] = {g, n->in[0]};
  kiln_tensor *out = kiln__ew(KILN__OP_SOFTPLUS_GRAD, "kiln_backward", 2, in);
  if (out) {
    kiln__node *m = kiln__producer(out);
    KILN__F(m, SOFTPLUS_GRAD, beta) = KILN__F(n, SOFTPLUS, beta);
    KILN__F(m, SOFTPLUS_GRAD, threshold) = KILN__F(n, SOFTPLUS, threshold);
  }
  gin[0] = out;
}
void kiln__grad_add_scalar(kiln__bw *b, const kiln__node *n, kiln_tensor *g, kiln_tensor **gin) {
  (void)b, (void)n;
  gin[0] = g;
}
void kiln__grad_mul_scalar(kiln__bw *b, const kiln__node *n, kiln_tensor *g, kiln_tensor **gin) {
  (void)b;
  gin[0] = kiln_mul_scalar(g, KILN__F(n, MUL_SCALAR, s));
}
void kiln__grad_pow_scalar(kiln__bw *b, const kiln__node *n, kiln_tensor *g, kiln_tensor **gin) {
  (void)b;
  float e = KILN__F(n, POW_SCALAR, exponent);
  if (e == 0.f) {
    gin[0] = kiln_mul_scalar(g, 0.f);
    return;
  }
  kiln_tensor *d = e == 1.f ? NULL : kiln_mul_scalar(kiln_pow_scalar(n->in[0], e - 1.f), e);
  gin[0] = d ? kiln_mul(g, d) : g;
}
void kiln__grad_clamp(kiln__bw *b, const kiln__node *n, kiln_tensor *g, kiln_tensor **gin) {
  (void)b;
  kiln_tensor *in[2] = {g, n->in[0]};
  kiln_tensor *out = kiln__ew(KILN__OP_CLAMP_GRAD, "kiln_backward", 2, in);
  if (out) {
    kiln__node *m = kiln__producer(out);
    KILN__F(m, CLAMP_GRAD, lo) = KILN__F(n, CLAMP, lo);
    KILN__F(m, CLAMP_GRAD, hi) = KILN__F(n, CLAMP, hi);
  }
  gin[0] = out;
}
/* The order of permute node p and its inverse. */
static void permutation(const kiln__node *p, kiln_axes *order, kiln_axes *inv) {
  order->n = inv->n = p->in[0]->ndim;
  for (int i = 0; i < order->n; i++) {
    order->a[i] = (int)KILN__IA(p, PERMUTE, order, i);
    inv->a[order->a[i]] = i;
  }
}

/* A cast's gradient is the output's, cast back to the input's dtype (f32 and bf16 only: an i32
 * value never requires a gradient). The cast of a permuted view of a dense tensor (autocast's
 * cast of a convolution's filters into im2col's order) casts its gradient in the order of that
 * tensor: seen through the inverse permutation, cast, then permuted back. The gradient the dense
 * tensor gets is then dense (the two permutations' composition is none): a parameter's .grad
 * assignment is written through by the cast's kernel itself, rather than copied from an f32
 * temporary by a kernel of its own. */
void kiln__grad_cast(kiln__bw *b, const kiln__node *n, kiln_tensor *g, kiln_tensor **gin) {
  (void)b;
  if (!NEED(0)) return;
  const kiln__node *p = kiln__producer(n->in[0]);
  if (p && p->op == KILN__OP_PERMUTE && kiln__is_contiguous(p->in[0]) &&
      !kiln__is_contiguous(n->in[0])) {
    kiln_axes order, inv;
    permutation(p, &order, &inv);
    gin[0] = kiln_permute(kiln_cast(kiln_permute(g, inv), n->in[0]->dtype), order);
    return;
  }
  gin[0] = kiln_cast(g, n->in[0]->dtype);
}

void kiln__grad_copy(kiln__bw *b, const kiln__node *n, kiln_tensor *g, kiln_tensor **gin) {
  (void)b, (void)n;
  gin[0] = g;
}
void kiln__grad_dropout(kiln__bw *b, const kiln__node *n, kiln_tensor *g, kiln_tensor **gin) {
  (void)b;
  /* the same Philox draw (seed, offset) recomputes the same mask */
  kiln_tensor *out = kiln__ew(KILN__OP_DROPOUT, "kiln_backward", 1, &g);
  if (out) {
    kiln__node *m = kiln__producer(out);
    KILN__F(m, DROPOUT, p) = KILN__F(n, DROPOUT, p);
    KILN__F(m, DROPOUT, scale) = KILN__F(n, DROPOUT, scale);
    KILN__U(m, DROPOUT, seed) = KILN__U(n, DROPOUT, seed);
    KILN__U(m, DROPOUT, offset) = KILN__U(n, DROPOUT, offset);
  }
  gin[0] = out;
}

/* The gradient of a reduction, broadcast back over the reduced axes (a view, no copy). */
static kiln_tensor *spread(const kiln__node *n, kiln_tensor *g) {
  const kiln_tensor *x = n->in[0];
  kiln_shape keep = {.ndim = x->ndim}, full = {.ndim = x->ndim};
  for (int d = 0; d < x->ndim; d++) {
    keep.d[d] = (KILN__RI(n, mask) & (1u << d)) ? 1 : x->shape[d];
    full.d[d] = x->shape[d];
  }
  return kiln_expand(kiln_reshape(g, keep), full);
}

void kiln__grad_sum(kiln__bw *b, const kiln__node *n, kiln_tensor *g, kiln_tensor **gin) {
  (void)b;
  kiln_tensor *s = spread(n, g);
  float scale = KILN__RF(n, scale);
  gin[0] = scale == 1.f ? s : kiln_mul_scalar(s, scale);
}

void kiln__grad_max(kiln__bw *b, const kiln__node *n, kiln_tensor *g, kiln_tensor **gin) {
  (void)b;
  /* split evenly among the elements equal to the maximum (PyTorch's amax) */
  kiln_tensor *hit = kiln_eq(n->in[0], spread(n, n->out));
  kiln_tensor *count =
      kiln__reduce(KILN__OP_SUM, "kiln_backward", hit, (unsigned)KILN__RI(n, mask), 1, 1.f);
  gin[0] = kiln_div(kiln_mul(spread(n, g), hit), count);
}

void kiln__grad_matmul(kiln__bw *b, const kiln__node *n, kiln_tensor *g, kiln_tensor **gin) {
  (void)b;
  kiln_tensor *a = n->in[0], *c = n->in[1];
  /* a convolution's columns gathered again for the weight gradient: that gradient first, so
   * that they are gone before the data gradient's columns are made */
  bool again = NEED(1) && kiln__recomputes_columns(n);
  if (NEED(0) && !again) gin[0] = ub(kiln_matmul(g, kiln_transpose(c, -1, -2)), a);
  if (NEED(1)) {
    a = kiln__columns_for_gradient(n);
    if (!a) return; /* the context's error says why */
    bool c_transposed = c->ndim == 2 && c->stride[0] == 1 && c->stride[1] == c->shape[0] &&
                        c->shape[0] > 1 && c->shape[1] > 1;
    if (a->ndim == 2 && c_transposed) {
      /* B is a transposed view (x W^T): compute its gradient transposed, g^T A, so that W's
       * gradient comes out dense in W's own layout */
      gin[1] = kiln_transpose(kiln_matmul(kiln_transpose(g, 0, 1), a), 0, 1);
    } else if (a->ndim == 3 && c->ndim == 2 && kiln__is_contiguous(a)) {
      /* (B,M,K) x (K,N): dB = A^T dC over all B*M rows, one product */
      int64_t rows = a->shape[0] * a->shape[1];
      kiln_tensor *a2 = kiln_reshape(a, KILN_SHAPE(rows, a->shape[2]));
      kiln_tensor *g2 = kiln_reshape(g, KILN_SHAPE(rows, g->shape[2]));
      gin[1] = kiln_matmul(kiln_transpose(a2, 0, 1), g2);
    } else {
      gin[1] = ub(kiln_matmul(kiln_transpose(a, -1, -2), g), c);
    }
  }
  if (NEED(0) && again) gin[0] = ub(kiln_matmul(g, kiln_transpose(c, -1, -2)), n->in[0]);
}

void kiln__grad_reshape(kiln__bw *b, const kiln__node *n, kiln_tensor *g, kiln_tensor **gin) {
  (void)b;
  gin[0] = kiln_reshape(g, kiln_tensor_shape(n->in[0]));
}

void kiln__grad_permute(kiln__bw *b, const kiln__node *n, kiln_tensor *g, kiln_tensor **gin) {
  (void)b;
  kiln_axes order, inv;
  permutation(n, &order, &inv);
  gin[0] = kiln_permute(g, inv);
}

void kiln__grad_expand(kiln__bw *b, const kiln__node *n, kiln_tensor *g, kiln_tensor **gin) {
  (void)b;
  gin[0] = ub(g, n->in[0]);
}

/* Zeros of shape s in g's dtype (a bf16 gradient's padding is bf16: concat takes one dtype). */
static kiln_tensor *zeros_as(const kiln_tensor *g, kiln_shape s) {
  kiln_tensor *z = kiln_full(g->ctx, s, 0.f);
  return g->dtype == KILN_DTYPE_F32 ? z : kiln_cast(z, g->dtype);
}

void kiln__grad_slice(kiln__bw *b, const kiln__node *n, kiln_tensor *g, kiln_tensor **gin) {
  (void)b;
  const kiln_tensor *x = n->in[0];
  int axis = (int)KILN__I(n, SLICE, axis);
  int64_t start = KILN__I(n, SLICE, start), step = KILN__I(n, SLICE, step);
  int64_t len = g->shape[axis], full = x->shape[axis];
  /* in three dims (outer, axis, inner), so that any rank works the same way */
  int64_t outer = 1, inner = 1;
  for (int d = 0; d < axis; d++)
    outer *= x->shape[d];
  for (int d = axis + 1; d < x->ndim; d++)
    inner *= x->shape[d];
  kiln_tensor *g3 = kiln_reshape(g, KILN_SHAPE(outer, len, inner));
  if (step > 1 && len > 0) {
    /* step-1 zeros after every element: (outer, len, step, inner), merged to (outer, len*step,
     * inner), then cut to what fits after start */
    kiln_tensor *parts[2] = {kiln_reshape(g3, KILN_SHAPE(outer, len, 1, inner)),
                             zeros_as(g, KILN_SHAPE(outer, len, step - 1, inner))};
    g3 = kiln_reshape(kiln_concat(2, parts, 2), KILN_SHAPE(outer, len * step, inner));
    int64_t keep = full - start < len * step ? full - start : len * step;
    g3 = kiln_slice(g3, 1, 0, keep, 1);
  }
  int64_t have = g3 ? g3->shape[1] : 0;
  kiln_tensor *parts[3];
  int np = 0;
  if (start > 0) parts[np++] = zeros_as(g, KILN_SHAPE(outer, start, inner));
  parts[np++] = g3;
  if (full - start - have > 0)
    parts[np++] = zeros_as(g, KILN_SHAPE(outer, full - start - have, inner));
  kiln_tensor *whole = np == 1 ? g3 : kiln_concat(np, parts, 1);
  gin[0] = kiln_reshape(whole, kiln_tensor_shape(x));
}

void kiln__grad_concat(kiln__bw *b, const kiln__node *n, kiln_tensor *g, kiln_tensor **gin) {
  (void)b;
  int axis = (int)KILN__I(n, CONCAT, axis);
  int64_t start = 0;
  for (int k = 0; k < n->nin; k++) {
    int64_t len = n->in[k]->shape[axis];
    if (NEED(k)) gin[k] = kiln_slice(g, axis, start, start + len, 1);
    start += len;
  }
}

/* ---------------------------------------------------------------- windows */

/* Window op `op` of x with n's geometry, giving an output shaped like `like`. */
static kiln_tensor *window_like(kiln__op op, const kiln__node *n, kiln_tensor *x, kiln_tensor *x2,
                                const kiln_tensor *like) {
  kiln__win w = kiln__win_of(n);
  return kiln__window(op, "kiln_backward", kiln_contiguous(x), x2 ? kiln_contiguous(x2) : NULL,
                      like->shape, &w);
}

void kiln__grad_im2col(kiln__bw *b, const kiln__node *n, kiln_tensor *g, kiln_tensor **gin) {
  (void)b;
  gin[0] = window_like(KILN__OP_COL2IM, n, g, NULL, n->in[0]);
  if (gin[0]) KILN__I(kiln__producer(gin[0]), COL2IM, groups) = KILN__I(n, IM2COL, groups);
}
/* From the windows' positions behind the output's values (index), or from the input's windows. */
void kiln__grad_max_pool(kiln__bw *b, const kiln__node *n, kiln_tensor *g, kiln_tensor **gin) {
  (void)b;
  bool index = KILN__I(n, MAX_POOL, index) != 0;
  gin[0] = window_like(KILN__OP_MAX_POOL_GRAD, n, g, index ? n->out : n->in[0], n->in[0]);
  if (gin[0]) KILN__I(kiln__producer(gin[0]), MAX_POOL_GRAD, index) = index;
}
void kiln__grad_avg_pool(kiln__bw *b, const kiln__node *n, kiln_tensor *g, kiln_tensor **gin) {
  (void)b;
  gin[0] = window_like(KILN__OP_AVG_POOL_GRAD, n, g, NULL, n->in[0]);
  if (gin[0])
    KILN__I(kiln__producer(gin[0]), AVG_POOL_GRAD, exclude_pad) = KILN__I(n, AVG_POOL, exclude_pad);
}

/* ---------------------------------------------------------------- batch norm */

/* y = xhat w + b, xhat = (x - mean) invstd over the last axis (C), R rows. One pass gives the
 * sums of g and g xhat (the bias's and the weight's gradients); with the batch's own statistics
 * dx = (g - sum(g) / R - xhat sum(g xhat) / R) invstd w, else dx = g invstd w. */
void kiln__grad_bn_apply(kiln__bw *b, const kiln__node *n, kiln_tensor *g, kiln_tensor **gin) {
  (void)b;
  kiln_tensor *x = n->in[0], *w = n->in[1], *mean = n->in[2], *invstd = n->in[3];
  int64_t C = x->shape[x->ndim - 1], R = C ? kiln_tensor_numel(x) / C : 0;
  bool batch = KILN__I(n, BN_APPLY, batch) != 0;
  kiln_tensor *s[2] = {NULL, NULL}; /* (1, C): sum g, sum g xhat */
  if (NEED(1) || NEED(4) || (NEED(0) && batch)) {
    kiln_tensor *in[4] = {kiln_reshape(g, KILN_SHAPE(R, C)), kiln_reshape(x, KILN_SHAPE(R, C)),
                          mean, invstd};
    kiln__moments("kiln_backward", 1, in, s);
  }
  if (NEED(4)) gin[4] = s[0] ? ub(kiln_reshape(s[0], KILN_SHAPE(C)), n->in[4]) : NULL;
  if (NEED(1)) gin[1] = s[1] ? ub(kiln_reshape(s[1], KILN_SHAPE(C)), w) : NULL;
  if (NEED(0)) {
    if (batch) {
      /* the per-channel terms over (1, C) first, where they join the sums' kernel, then the
       * full-size chain over their (C) views in one run of trace nodes, which the planner fuses
       * into one kernel (xhat never written) */
      float inv_r = (float)(1.0 / (double)R);
      kiln_tensor *scale = kiln_mul(kiln_reshape(invstd, KILN_SHAPE(1, C)),
                                    kiln_reshape(w, KILN_SHAPE(1, -1))); /* (1, C) or (1, 1) */
      kiln_tensor *mg = kiln_mul_scalar(s[0], inv_r), *mgx = kiln_mul_scalar(s[1], inv_r);
      kiln_tensor *xhat = kiln_mul(kiln_sub(x, mean), invstd);
      kiln_tensor *d = kiln_sub(kiln_sub(g, kiln_reshape(mg, KILN_SHAPE(C))),
                                kiln_mul(xhat, kiln_reshape(mgx, KILN_SHAPE(C))));
      gin[0] = kiln_mul(d, kiln_reshape(scale, KILN_SHAPE(-1)));
    } else {
      gin[0] = kiln_mul(g, kiln_mul(invstd, w)); /* w (C) or broadcast */
    }
  }
}

/* index_select's gradient: the output's gradient rows added into the rows they were taken from
 * (a row picked twice gets both). */
void kiln__grad_index_select(kiln__bw *b, const kiln__node *n, kiln_tensor *g, kiln_tensor **gin) {
  (void)b;
  if (NEED(0))
    gin[0] = kiln__index_add(g, n->in[1], KILN__U(n, INDEX_SELECT, start), n->in[0]->shape[0],
                             "kiln_backward");
}

/* A custom op's gradient: the op's backward (include/kiln_custom.h) records it with kiln's ops;
 * every input that needs a gradient must get one of its shape. */
void kiln__grad_custom(kiln__bw *b, const kiln__node *n, kiln_tensor *g, kiln_tensor **gin) {
  (void)b;
  kiln_ctx *ctx = n->out->ctx;
  const kiln_custom_op *op = kiln__custom_of(ctx, n);
  const char *name = op->o.name;
  int32_t at = n->out->node;
  int64_t par[KILN_CUSTOM_PARAMS];
  for (int k = 0; k < KILN_CUSTOM_PARAMS; k++)
    par[k] = KILN__IA(n, CUSTOM, param, k);
  kiln_custom_call c = {
      .op = op, .nin = n->nin, .in = n->in, .out = n->out, .param = par, .user = op->o.user};
  kiln_tensor *grads[KILN__MAX_IN] = {0};
  KILN_ASSERT(op->o.backward); /* kiln_custom refuses a call that needs it without one */
  kiln_status s = op->o.backward(&c, g, grads);
  if (!kiln__ok(ctx)) return;
  if (s != KILN_OK) {
    kiln__error(ctx, s, "kiln_backward: custom op '%s' (node #%d): its backward returned %s", name,
                at, kiln_status_name(s));
    return;
  }
  for (int q = 0; q < n->nin; q++) {
    if (!NEED(q)) continue;
    char sh[96], gs[96];
    kiln_tensor *gq = grads[q];
    if (!gq) {
      kiln__error(ctx, KILN_ERR_STATE,
                  "kiln_backward: custom op '%s' (node #%d): its backward gave no gradient for "
                  "input %d (%s), which requires grad",
                  name, at, q, kiln__shape_of(n->in[q], sh, sizeof sh));
      return;
    }
    if (!kiln__check(ctx, gq, "kiln_backward")) return;
    if (!kiln__same_shape(gq, n->in[q]) || !kiln__is_float(gq->dtype)) {
      kiln__error(ctx, KILN_ERR_SHAPE,
                  "kiln_backward: custom op '%s' (node #%d): its backward gave a gradient of "
                  "%s %s for input %d, which is %s %s",
                  name, at, kiln__shape_of(gq, gs, sizeof gs), kiln_dtype_name(gq->dtype), q,
                  kiln__shape_of(n->in[q], sh, sizeof sh), kiln_dtype_name(n->in[q]->dtype));
      return;
    }
    gin[q] = gq;
  }
}
