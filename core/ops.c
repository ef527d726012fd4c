/*
 * ops.c: the public ops. Each checks its inputs, makes the output's metadata and records one node
 * (or, for composites such as softmax and cross_entropy, the few nodes they are made of).
 * Nothing runs here.
 */
#include <inttypes.h>
#include <math.h>
#include <string.h>

#include "internal.h"

kiln_ctx *kiln__op_begin(const char *fn, int n, kiln_tensor *const *in) {
  kiln_ctx *ctx = kiln__ctx_of(n, in);
  if (!ctx || !kiln__ok(ctx)) return NULL;
  for (int i = 0; i < n; i++)
    if (!kiln__check(ctx, in[i], fn)) return NULL;
  return ctx;
}

bool kiln__need_float(kiln_ctx *ctx, const char *fn, int n, kiln_tensor *const *in) {
  for (int i = 0; i < n; i++)
    if (!kiln__is_float(in[i]->dtype))
      return kiln__error(ctx, KILN_ERR_DTYPE, "%s: input %d is %s; this op takes f32 or bf16", fn,
                         i, kiln_dtype_name(in[i]->dtype)),
             false;
  return true;
}

bool kiln__as_f32(int n, kiln_tensor **in) {
  for (int i = 0; i < n; i++)
    if (!(in[i] = kiln_cast(in[i], KILN_DTYPE_F32))) return false;
  return true;
}

/* Comparisons also take i32 operands (an argmax against labels): two i32 values compare as
 * integers, an i32 against an f32 as floats. */
static bool comparison(kiln__op op) {
  return op == KILN__OP_EQ || op == KILN__OP_NE || op == KILN__OP_LT || op == KILN__OP_LE ||
         op == KILN__OP_GT || op == KILN__OP_GE;
}

static bool ew_dtypes(kiln_ctx *ctx, kiln__op op, const char *fn, int n, kiln_tensor *const *in) {
  if (!comparison(op)) return kiln__need_float(ctx, fn, n, in);
  for (int i = 0; i < n; i++)
    if (!kiln__is_float(in[i]->dtype) && in[i]->dtype != KILN_DTYPE_I32)
      return kiln__error(ctx, KILN_ERR_DTYPE,
                         "%s: input %d is %s; comparisons take f32, bf16 or i32", fn, i,
                         kiln_dtype_name(in[i]->dtype)),
             false;
  return true;
}

/* An elementwise op's result dtype: comparisons give f32 1/0; batch norm's apply keeps its
 * input's (its statistics and affine parameters are f32); where's condition only selects; the
 * rest promote their inputs (kiln__promote). */
static kiln_dtype ew_out_dtype(kiln__op op, int n, kiln_tensor *const *in) {
  if (comparison(op) || n == 0) return KILN_DTYPE_F32;
  if (op == KILN__OP_BN_APPLY) return in[0]->dtype;
  int first = op == KILN__OP_WHERE ? 1 : 0;
  kiln_dtype dt = in[first]->dtype;
  for (int i = first + 1; i < n; i++)
    dt = kiln__promote(dt, in[i]->dtype);
  return dt;
}

kiln_tensor *kiln__ew(kiln__op op, const char *fn, int nin, kiln_tensor *const *in) {
  kiln_ctx *ctx = kiln__op_begin(fn, nin, in);
  if (!ctx || !ew_dtypes(ctx, op, fn, nin, in)) return NULL;
  int nd;
  int64_t shape[KILN_MAX_DIMS];
  if (!kiln__broadcast_shape(ctx, fn, nin, in, &nd, shape)) return NULL;
  kiln_tensor *out = kiln__tensor_intermediate(ctx, fn, ew_out_dtype(op, nin, in), nd, shape);
  if (!out) return NULL;
  return kiln__record(ctx, op, nin, in, out) ? out : NULL;
}

#define BINARY(fname, OP)                                                                          \
  kiln_tensor *fname(kiln_tensor *a, kiln_tensor *b) {                                             \
    kiln_tensor *in[2] = {a, b};                                                                   \
    return kiln__ew(KILN__OP_##OP, __func__, 2, in);                                               \
  }
BINARY(kiln_add, ADD)
BINARY(kiln_sub, SUB)
BINARY(kiln_mul, MUL)
BINARY(kiln_div, DIV)
BINARY(kiln_maximum, MAXIMUM)
BINARY(kiln_minimum, MINIMUM)
BINARY(kiln_eq, EQ)
BINARY(kiln_ne, NE)
BINARY(kiln_lt, LT)
BINARY(kiln_le, LE)
BINARY(kiln_gt, GT)
BINARY(kiln_ge, GE)
#undef BINARY

#define UNARY(fname, OP)                                                                           \
  kiln_tensor *fname(kiln_tensor *a) { return kiln__ew(KILN__OP_##OP, __func__, 1, &a); }
UNARY(kiln_neg, NEG)
UNARY(kiln_exp, EXP)
UNARY(kiln_log, LOG)
UNARY(kiln_sqrt, SQRT)
UNARY(kiln_rsqrt, RSQRT)
UNARY(kiln_tanh, TANH)
UNARY(kiln_sigmoid, SIGMOID)
UNARY(kiln_relu, RELU)
UNARY(kiln_abs, ABS)
UNARY(kiln_silu, SILU)
UNARY(kiln_erf, ERF)
#undef UNARY

kiln_tensor *kiln_where(kiln_tensor *cond, kiln_tensor *a, kiln_tensor *b) {
  kiln_tensor *in[3] = {cond, a, b};
  return kiln__ew(KILN__OP_WHERE, __func__, 3, in);
}

kiln_tensor *kiln_gelu(kiln_tensor *a, kiln_gelu_approx approx) {
  kiln_ctx *ctx = kiln_tensor_ctx(a);
  if (approx != KILN_GELU_ERF && approx != KILN_GELU_TANH) {
    if (ctx) kiln__error(ctx, KILN_ERR_INVALID, "kiln_gelu: unknown approximation %d", approx);
    return NULL;
  }
  return kiln__ew(approx == KILN_GELU_ERF ? KILN__OP_GELU_ERF : KILN__OP_GELU_TANH, __func__, 1,
                  &a);
}

kiln_tensor *kiln_add_scalar(kiln_tensor *a, float s) {
  kiln_tensor *out = kiln__ew(KILN__OP_ADD_SCALAR, __func__, 1, &a);
  if (out) KILN__F(kiln__producer(out), ADD_SCALAR, s) = s;
  return out;
}
kiln_tensor *kiln_mul_scalar(kiln_tensor *a, float s) {
  kiln_tensor *out = kiln__ew(KILN__OP_MUL_SCALAR, __func__, 1, &a);
  if (out) KILN__F(kiln__producer(out), MUL_SCALAR, s) = s;
  return out;
}
kiln_tensor *kiln_pow_scalar(kiln_tensor *a, float e) {
  kiln_tensor *out = kiln__ew(KILN__OP_POW_SCALAR, __func__, 1, &a);
  if (out) KILN__F(kiln__producer(out), POW_SCALAR, exponent) = e;
  return out;
}
kiln_tensor *kiln_clamp(kiln_tensor *a, float lo, float hi) {
  kiln_ctx *ctx = kiln_tensor_ctx(a);
  if (ctx && kiln__ok(ctx) && !(lo <= hi)) {
    kiln__error(ctx, KILN_ERR_INVALID, "kiln_clamp: lo %g is not <= hi %g", lo, hi);
    return NULL;
  }
  kiln_tensor *out = kiln__ew(KILN__OP_CLAMP, __func__, 1, &a);
  if (out) {
    kiln__node *n = kiln__producer(out);
    KILN__F(n, CLAMP, lo) = lo;
    KILN__F(n, CLAMP, hi) = hi;
  }
  return out;
}

kiln_tensor *kiln_leaky_relu(kiln_tensor *a, float negative_slope) {
  kiln_ctx *ctx = kiln_tensor_ctx(a);
  if (ctx && kiln__ok(ctx) && !isfinite(negative_slope)) {
    kiln__error(ctx, KILN_ERR_INVALID, "kiln_leaky_relu: negative_slope %g is not finite",
                negative_slope);
    return NULL;
  }
  kiln_tensor *out = kiln__ew(KILN__OP_LEAKY_RELU, __func__, 1, &a);
  if (out) KILN__F(kiln__producer(out), LEAKY_RELU, negative_slope) = negative_slope;
  return out;
}

kiln_tensor *kiln_softplus(kiln_tensor *a, float beta, float threshold) {
  kiln_ctx *ctx = kiln_tensor_ctx(a);
  if (beta == 0.f) beta = 1.f; /* zero means PyTorch's default */
  if (threshold == 0.f) threshold = 20.f;
  if (ctx && kiln__ok(ctx) && (!isfinite(beta) || !isfinite(threshold))) {
    kiln__error(ctx, KILN_ERR_INVALID, "kiln_softplus: beta %g and threshold %g must be finite",
                beta, threshold);
    return NULL;
  }
  kiln_tensor *out = kiln__ew(KILN__OP_SOFTPLUS, __func__, 1, &a);
  if (out) {
    kiln__node *n = kiln__producer(out);
    KILN__F(n, SOFTPLUS, beta) = beta;
    KILN__F(n, SOFTPLUS, threshold) = threshold;
  }
  return out;
}

kiln_tensor *kiln_full(kiln_ctx *ctx, kiln_shape shape, float value) {
  const char *fn = __func__;
  if (!kiln__ok(ctx)) return NULL;
  kiln_tensor *out = kiln__tensor_intermediate(ctx, fn, KILN_DTYPE_F32, shape.ndim, shape.d);
  if (!out) return NULL;
  kiln__node *n = kiln__record(ctx, KILN__OP_FILL, 0, NULL, out);
  if (!n) return NULL;
  KILN__F(n, FILL, value) = value;
  return out;
}

static kiln_tensor *random_tensor(kiln_ctx *ctx, kiln__op op, const char *fn, kiln_shape shape) {
  if (!kiln__ok(ctx)) return NULL;
  kiln_tensor *out = kiln__tensor_intermediate(ctx, fn, KILN_DTYPE_F32, shape.ndim, shape.d);
  kiln__node *n = out ? kiln__record(ctx, op, 0, NULL, out) : NULL;
  if (!n) return NULL;
  /* the offset is a step value, as dropout's: a replayed step draws new numbers */
  if (op == KILN__OP_RAND) {
    KILN__U(n, RAND, seed) = ctx->seed;
    KILN__U(n, RAND, offset) = ctx->philox_offset++;
  } else {
    KILN__U(n, RANDN, seed) = ctx->seed;
    KILN__U(n, RANDN, offset) = ctx->philox_offset++;
  }
  return out;
}

kiln_tensor *kiln_rand(kiln_ctx *ctx, kiln_shape shape) {
  return random_tensor(ctx, KILN__OP_RAND, __func__, shape);
}
kiln_tensor *kiln_randn(kiln_ctx *ctx, kiln_shape shape) {
  return random_tensor(ctx, KILN__OP_RANDN, __func__, shape);
}

kiln_tensor *kiln_cast(kiln_tensor *a, kiln_dtype dtype) {
  const char *fn = __func__;
  kiln_ctx *ctx = kiln__op_begin(fn, 1, &a);
  if (!ctx) return NULL;
  bool ok_in = kiln__is_float(a->dtype) || a->dtype == KILN_DTYPE_I32;
  bool ok_out = kiln__is_float(dtype) || dtype == KILN_DTYPE_I32;
  if (!ok_in || !ok_out)
    return kiln__error(ctx, KILN_ERR_DTYPE,
                       "kiln_cast: %s to %s is not supported (f32, bf16 and i32 are)",
                       kiln_dtype_name(a->dtype), kiln_dtype_name(dtype)),
           NULL;
  if (dtype == a->dtype) return a; /* as PyTorch's .to: the same tensor, gradient and all */
  kiln_tensor *out = kiln__tensor_intermediate(ctx, fn, dtype, a->ndim, a->shape);
  if (!out || !kiln__record(ctx, KILN__OP_CAST, 1, &a, out)) return NULL;
  if (dtype == KILN_DTYPE_I32) out->requires_grad = false; /* no gradient through integers */
  return out;
}

/* ---------------------------------------------------------------- matmul */

kiln_tensor *kiln_matmul(kiln_tensor *a, kiln_tensor *b) {
  kiln_tensor *in[2] = {a, b};
  const char *fn = __func__;
  kiln_ctx *ctx = kiln__op_begin(fn, 2, in);
  if (!ctx || !kiln__need_float(ctx, fn, 2, in)) return NULL;
  char s1[96], s2[96];
  kiln_dtype ac = kiln__autocast_dtype(ctx);
  if (a->dtype != b->dtype && ac == KILN_DTYPE_F32)
    return kiln__error(ctx, KILN_ERR_DTYPE,
                       "%s: operands of different dtypes: %s %s x %s %s (cast one, or compute in "
                       "an autocast region)",
                       fn, kiln__shape_of(a, s1, sizeof s1), kiln_dtype_name(a->dtype),
                       kiln__shape_of(b, s2, sizeof s2), kiln_dtype_name(b->dtype)),
           NULL;
  if (a->ndim < 2 || a->ndim > 3 || b->ndim < 2 || b->ndim > 3)
    return kiln__error(ctx, KILN_ERR_SHAPE, "%s: operands must be 2-D or 3-D; got %s x %s", fn,
                       kiln__shape_of(a, s1, sizeof s1), kiln__shape_of(b, s2, sizeof s2)),
           NULL;
  int64_t m = a->shape[a->ndim - 2], k = a->shape[a->ndim - 1];
  int64_t k2 = b->shape[b->ndim - 2], nn = b->shape[b->ndim - 1];
  if (k != k2)
    return kiln__error(ctx, KILN_ERR_SHAPE, "%s: inner dims differ: %s x %s", fn,
                       kiln__shape_of(a, s1, sizeof s1), kiln__shape_of(b, s2, sizeof s2)),
           NULL;
  int64_t ba = a->ndim == 3 ? a->shape[0] : 1, bb = b->ndim == 3 ? b->shape[0] : 1;
  if (ba != bb && ba != 1 && bb != 1)
    return kiln__error(ctx, KILN_ERR_SHAPE, "%s: batch dims differ: %s x %s", fn,
                       kiln__shape_of(a, s1, sizeof s1), kiln__shape_of(b, s2, sizeof s2)),
           NULL;
  if (m > INT32_MAX || k > INT32_MAX || nn > INT32_MAX || ba > INT32_MAX || bb > INT32_MAX)
    return kiln__error(ctx, KILN_ERR_SHAPE, "%s: dims beyond cuBLAS's int range: %s x %s", fn,
                       kiln__shape_of(a, s1, sizeof s1), kiln__shape_of(b, s2, sizeof s2)),
           NULL;
  /* in an autocast region f32 operands are cast first (a cast that fuses into their producers);
   * operands cuBLAS cannot read as they are (neither rows nor columns dense) are copied */
  for (int i = 0; i < 2; i++) {
    if (ac != KILN_DTYPE_F32 && !(in[i] = kiln_cast(in[i], ac))) return NULL;
    kiln_tensor *t = in[i];
    int r = t->ndim - 2;
    int64_t sr = t->stride[r], sc = t->stride[r + 1], R = t->shape[r], C = t->shape[r + 1];
    bool rowmajor = (sc == 1 || C == 1) && (sr >= C || R == 1);
    bool colmajor = (sr == 1 || R == 1) && (sc >= R || C == 1);
    if (!rowmajor && !colmajor) in[i] = kiln_contiguous(t);
    if (!in[i]) return NULL;
  }
  int64_t shape[3];
  int nd = (a->ndim == 3 || b->ndim == 3) ? 3 : 2;
  if (nd == 3) {
    shape[0] = ba > bb ? ba : bb;
    shape[1] = m;
    shape[2] = nn;
  } else {
    shape[0] = m;
    shape[1] = nn;
  }
  kiln_tensor *out = kiln__tensor_intermediate(ctx, fn, in[0]->dtype, nd, shape);
  if (!out || !kiln__record(ctx, KILN__OP_MATMUL, 2, in, out)) return NULL;
  return out;
}

/* ---------------------------------------------------------------- views and movement */

bool kiln__norm_axis(kiln_ctx *ctx, const char *fn, const kiln_tensor *a, int *axis) {
  int ax = *axis < 0 ? *axis + a->ndim : *axis;
  if (ax < 0 || ax >= a->ndim) {
    char sh[96];
    return kiln__error(ctx, KILN_ERR_SHAPE, "%s: axis %d out of range for %s (%d dims)", fn, *axis,
                       kiln__shape_of(a, sh, sizeof sh), a->ndim),
           false;
  }
  *axis = ax;
  return true;
}

static kiln_tensor *view(const char *fn, kiln__op op, kiln_tensor *a, int nd, const int64_t *shape,
                         const int64_t *stride, int64_t offset) {
  kiln_tensor *out = kiln__tensor_view(fn, a, nd, shape, stride, offset);
  if (!out) return NULL;
  kiln__node *n = kiln__record(a->ctx, op, 1, &a, out);
  return n ? out : NULL;
}

kiln_tensor *kiln_contiguous(kiln_tensor *a) {
  const char *fn = __func__;
  kiln_ctx *ctx = kiln__op_begin(fn, 1, &a);
  if (!ctx) return NULL;
  if (kiln__is_contiguous(a)) return a;
  kiln_tensor *out = kiln__tensor_intermediate(ctx, fn, a->dtype, a->ndim, a->shape);
  if (!out || !kiln__record(ctx, KILN__OP_COPY, 1, &a, out)) return NULL;
  return out;
}

kiln_tensor *kiln_reshape(kiln_tensor *a, kiln_shape shape) {
  const char *fn = __func__;
  kiln_ctx *ctx = kiln__op_begin(fn, 1, &a);
  if (!ctx) return NULL;
  char s1[96], s2[96];
  if (shape.ndim < 0 || shape.ndim > KILN_MAX_DIMS)
    return kiln__error(ctx, KILN_ERR_SHAPE, "%s: %d dims; kiln takes 0 to %d", fn, shape.ndim,
                       KILN_MAX_DIMS),
           NULL;
  int infer = -1;
  int64_t known = 1; /* the product of the given sizes, checked */
  bool zero = false;
  for (int i = 0; i < shape.ndim; i++) {
    if (shape.d[i] == -1) {
      if (infer >= 0)
        return kiln__error(ctx, KILN_ERR_SHAPE, "%s: more than one -1 in %s", fn,
                           kiln_shape_str(shape, s1, sizeof s1)),
               NULL;
      infer = i;
    } else if (shape.d[i] < 0) {
      return kiln__error(ctx, KILN_ERR_SHAPE, "%s: bad size %" PRId64 " in %s", fn, shape.d[i],
                         kiln_shape_str(shape, s1, sizeof s1)),
             NULL;
    } else if (shape.d[i] == 0) {
      zero = true;
    } else if (known > KILN__MAX_NUMEL / shape.d[i]) {
      return kiln__error(ctx, KILN_ERR_SHAPE, "%s: shape %s has more than 2^58 elements", fn,
                         kiln_shape_str(shape, s1, sizeof s1)),
             NULL;
    } else {
      known *= shape.d[i];
    }
  }
  if (zero) known = 0;
  int64_t numel = kiln_tensor_numel(a);
  if (infer >= 0) {
    if (known == 0 || numel % known != 0)
      return kiln__error(ctx, KILN_ERR_SHAPE, "%s: cannot reshape %s into %s", fn,
                         kiln__shape_of(a, s2, sizeof s2), kiln_shape_str(shape, s1, sizeof s1)),
             NULL;
    shape.d[infer] = numel / known;
    known *= shape.d[infer];
  }
  if (known != numel)
    return kiln__error(ctx, KILN_ERR_SHAPE,
                       "%s: cannot reshape %s (%" PRId64 " elements) into %s (%" PRId64 ")", fn,
                       kiln__shape_of(a, s2, sizeof s2), numel,
                       kiln_shape_str(shape, s1, sizeof s1), known),
           NULL;
  kiln_tensor *src = kiln_contiguous(a);
  if (!src) return NULL;
  int64_t stride[KILN_MAX_DIMS];
  kiln__contiguous_strides(shape.ndim, shape.d, stride);
  return view(fn, KILN__OP_RESHAPE, src, shape.ndim, shape.d, stride, src->offset);
}

kiln_tensor *kiln_permute(kiln_tensor *a, kiln_axes order) {
  const char *fn = __func__;
  kiln_ctx *ctx = kiln__op_begin(fn, 1, &a);
  if (!ctx) return NULL;
  char sh[96];
  if (order.n != a->ndim)
    return kiln__error(ctx, KILN_ERR_SHAPE, "%s: %d axes given for %s (%d dims)", fn, order.n,
                       kiln__shape_of(a, sh, sizeof sh), a->ndim),
           NULL;
  int64_t shape[KILN_MAX_DIMS], stride[KILN_MAX_DIMS];
  unsigned seen = 0;
  for (int i = 0; i < order.n; i++) {
    int ax = order.a[i] < 0 ? order.a[i] + a->ndim : order.a[i];
    if (ax < 0 || ax >= a->ndim || (seen & (1u << ax)))
      return kiln__error(ctx, KILN_ERR_SHAPE,
                         "%s: axis %d (position %d) is not a permutation of "
                         "the %d axes of %s",
                         fn, order.a[i], i, a->ndim, kiln__shape_of(a, sh, sizeof sh)),
             NULL;
    seen |= 1u << ax;
    shape[i] = a->shape[ax];
    stride[i] = a->stride[ax];
  }
  kiln_tensor *out = view(fn, KILN__OP_PERMUTE, a, a->ndim, shape, stride, a->offset);
  if (out) {
    kiln__node *n = kiln__producer(out);
    for (int i = 0; i < order.n; i++)
      KILN__IA(n, PERMUTE, order, i) = order.a[i] < 0 ? order.a[i] + a->ndim : order.a[i];
  }
  return out;
}

kiln_tensor *kiln_transpose(kiln_tensor *a, int axis0, int axis1) {
  kiln_ctx *ctx = kiln__op_begin(__func__, 1, &a);
  if (!ctx || !kiln__norm_axis(ctx, __func__, a, &axis0) ||
      !kiln__norm_axis(ctx, __func__, a, &axis1))
    return NULL;
  kiln_axes order = {.n = a->ndim};
  for (int i = 0; i < a->ndim; i++)
    order.a[i] = i;
  order.a[axis0] = axis1;
  order.a[axis1] = axis0;
  return kiln_permute(a, order);
}

kiln_tensor *kiln_slice(kiln_tensor *a, int axis, int64_t start, int64_t end, int64_t step) {
  const char *fn = __func__;
  kiln_ctx *ctx = kiln__op_begin(fn, 1, &a);
  if (!ctx || !kiln__norm_axis(ctx, fn, a, &axis)) return NULL;
  if (step <= 0)
    return kiln__error(ctx, KILN_ERR_INVALID, "%s: step %" PRId64 " must be positive", fn, step),
           NULL;
  int64_t len = a->shape[axis];
  if (start < 0) start += len;
  if (end < 0) end += len;
  if (start < 0) start = 0;
  if (end > len) end = len;
  if (start > len) start = len;
  if (end < start) end = start;
  int64_t shape[KILN_MAX_DIMS], stride[KILN_MAX_DIMS];
  memcpy(shape, a->shape, sizeof shape);
  memcpy(stride, a->stride, sizeof stride);
  shape[axis] = end > start ? (end - start - 1) / step + 1 : 0;
  stride[axis] = a->stride[axis] * step;
  kiln_tensor *out =
      view(fn, KILN__OP_SLICE, a, a->ndim, shape, stride, a->offset + start * a->stride[axis]);
  if (out) {
    kiln__node *n = kiln__producer(out);
    KILN__I(n, SLICE, axis) = axis;
    KILN__I(n, SLICE, start) = start;
    KILN__I(n, SLICE, step) = step;
  }
  return out;
}

kiln_tensor *kiln_expand(kiln_tensor *a, kiln_shape shape) {
  const char *fn = __func__;
  kiln_ctx *ctx = kiln__op_begin(fn, 1, &a);
  if (!ctx) return NULL;
  char s1[96], s2[96];
  if (shape.ndim < a->ndim || shape.ndim > KILN_MAX_DIMS)
    return kiln__error(ctx, KILN_ERR_SHAPE, "%s: cannot expand %s to %s", fn,
                       kiln__shape_of(a, s1, sizeof s1), kiln_shape_str(shape, s2, sizeof s2)),
           NULL;
  int64_t st[KILN_MAX_DIMS];
  int lead = shape.ndim - a->ndim;
  for (int d = 0; d < shape.ndim; d++) {
    int j = d - lead;
    if (j < 0) {
      if (shape.d[d] < 0) goto bad;
      st[d] = 0;
      continue;
    }
    if (shape.d[d] == -1) shape.d[d] = a->shape[j];
    if (shape.d[d] == a->shape[j]) {
      st[d] = a->stride[j];
    } else if (a->shape[j] == 1 && shape.d[d] >= 0) {
      st[d] = 0;
    } else {
      goto bad;
    }
  }
  return view(fn, KILN__OP_EXPAND, a, shape.ndim, shape.d, st, a->offset);
bad:
  return kiln__error(ctx, KILN_ERR_SHAPE, "%s: cannot expand %s to %s", fn,
                     kiln__shape_of(a, s1, sizeof s1), kiln_shape_str(shape, s2, sizeof s2)),
         NULL;
}

kiln_tensor *kiln_detach(kiln_tensor *a) {
  const char *fn = __func__;
  kiln_ctx *ctx = kiln__op_begin(fn, 1, &a);
  if (!ctx) return NULL;
  return view(fn, KILN__OP_DETACH, a, a->ndim, a->shape, a->stride, a->offset);
}

kiln_tensor *kiln_concat(int n, kiln_tensor *const *ts, int axis) {
  const char *fn = __func__;
  if (n <= 0 || !ts) return NULL;
  kiln_ctx *ctx = kiln__op_begin(fn, n, ts);
  if (!ctx) return NULL;
  kiln_tensor *a = ts[0];
  if (!kiln__norm_axis(ctx, fn, a, &axis)) return NULL;
  if (n == 1) return a;
  if (n > KILN__MAX_IN) {
    /* in pieces of at most KILN__MAX_IN inputs */
    kiln_tensor *parts[KILN__MAX_IN];
    int np = 0;
    for (int i = 0; i < n; i += KILN__MAX_IN) {
      int k = n - i < KILN__MAX_IN ? n - i : KILN__MAX_IN;
      parts[np++] = kiln_concat(k, ts + i, axis);
      if (np == KILN__MAX_IN && i + k < n) {
        parts[0] = kiln_concat(np, parts, axis);
        np = 1;
      }
    }
    return kiln_concat(np, parts, axis);
  }
  int64_t shape[KILN_MAX_DIMS];
  memcpy(shape, a->shape, sizeof shape);
  shape[axis] = 0;
  for (int i = 0; i < n; i++) {
    kiln_tensor *t = ts[i];
    bool same = t->ndim == a->ndim && t->dtype == a->dtype;
    for (int d = 0; same && d < a->ndim; d++)
      if (d != axis && t->shape[d] != a->shape[d]) same = false;
    if (!same) {
      char s1[96], s2[96];
      return kiln__error(ctx, t->dtype != a->dtype ? KILN_ERR_DTYPE : KILN_ERR_SHAPE,
                         "%s: input %d is %s %s, input 0 %s %s: all but "
                         "axis %d must agree",
                         fn, i, kiln__shape_of(t, s1, sizeof s1), kiln_dtype_name(t->dtype),
                         kiln__shape_of(a, s2, sizeof s2), kiln_dtype_name(a->dtype), axis),
             NULL;
    }
    shape[axis] += t->shape[axis];
  }
  kiln_tensor *out = kiln__tensor_intermediate(ctx, fn, a->dtype, a->ndim, shape);
  if (!out) return NULL;
  kiln__node *nd = kiln__record(ctx, KILN__OP_CONCAT, n, ts, out);
  if (!nd) return NULL;
  KILN__I(nd, CONCAT, axis) = axis;
  return out;
}

kiln_tensor *kiln__index_select_at(kiln_tensor *a, kiln_tensor *idx, int64_t start, int64_t count,
                                   const char *fn) {
  kiln_tensor *in[2] = {a, idx};
  kiln_ctx *ctx = kiln__op_begin(fn, 2, in);
  if (!ctx) return NULL;
  char s1[96], s2[96];
  if (a->ndim < 1 || idx->ndim != 1 || idx->dtype != KILN_DTYPE_I32)
    return kiln__error(ctx, idx->dtype != KILN_DTYPE_I32 ? KILN_ERR_DTYPE : KILN_ERR_SHAPE,
                       "%s: needs a tensor of >= 1 dims and a 1-D i32 index; got %s and %s %s", fn,
                       kiln__shape_of(a, s1, sizeof s1), kiln__shape_of(idx, s2, sizeof s2),
                       kiln_dtype_name(idx->dtype)),
           NULL;
  if (start < 0 || count < 0 || start + count > idx->shape[0])
    return kiln__error(ctx, KILN_ERR_SHAPE, "%s: rows %lld..%lld of an index of %lld", fn,
                       (long long)start, (long long)(start + count), (long long)idx->shape[0]),
           NULL;
  in[0] = kiln_contiguous(a);
  in[1] = kiln_contiguous(idx);
  if (!in[0] || !in[1]) return NULL;
  int64_t shape[KILN_MAX_DIMS];
  memcpy(shape, a->shape, sizeof shape);
  shape[0] = count;
  kiln_tensor *out = kiln__tensor_intermediate(ctx, fn, a->dtype, a->ndim, shape);
  kiln__node *n = out ? kiln__record(ctx, KILN__OP_INDEX_SELECT, 2, in, out) : NULL;
  if (!n) return NULL;
  KILN__U(n, INDEX_SELECT, start) = (uint64_t)start; /* a step value: batches share one graph */
  return out;
}

kiln_tensor *kiln__index_add(kiln_tensor *g, kiln_tensor *idx, uint64_t start, int64_t rows,
                             const char *fn) {
  kiln_tensor *in[2] = {g, idx};
  kiln_ctx *ctx = kiln__op_begin(fn, 2, in);
  if (!ctx || !kiln__need_float(ctx, fn, 1, in)) return NULL;
  KILN_ASSERT(idx->dtype == KILN_DTYPE_I32 && kiln__is_contiguous(idx) && g->ndim >= 1);
  in[0] = kiln_contiguous(kiln_cast(g, KILN_DTYPE_F32)); /* f32 atomic adds */
  if (!in[0]) return NULL;
  int64_t shape[KILN_MAX_DIMS];
  memcpy(shape, g->shape, sizeof shape);
  shape[0] = rows;
  kiln_tensor *out = kiln__tensor_intermediate(ctx, fn, KILN_DTYPE_F32, g->ndim, shape);
  kiln__node *n = out ? kiln__record(ctx, KILN__OP_INDEX_ADD, 2, in, out) : NULL;
  if (!n) return NULL;
  KILN__U(n, INDEX_ADD, start) = start;
  return out;
}

kiln_tensor *kiln_index_select(kiln_tensor *a, kiln_tensor *idx) {
  int64_t n = idx && idx->magic == KILN__TENSOR_MAGIC && idx->ndim == 1 ? idx->shape[0] : 0;
  return kiln__index_select_at(a, idx, 0, n, __func__);
}

bool kiln__training_flag(kiln_ctx *ctx, const char *fn, int *training) {
  if (*training != 0 && *training != 1 && *training != KILN_TRAINING_MODE)
    return kiln__error(ctx, KILN_ERR_INVALID,
                       "%s: training %d is not 0, 1 or KILN_TRAINING_MODE (-1)", fn, *training),
           false;
  if (*training == KILN_TRAINING_MODE) *training = ctx->training;
  return true;
}

kiln_tensor *kiln_dropout(kiln_tensor *a, float p, int training) {
  kiln_ctx *ctx = kiln__op_begin(__func__, 1, &a);
  if (!ctx || !kiln__need_float(ctx, __func__, 1, &a)) return NULL;
  if (!(p >= 0.f && p <= 1.f))
    return kiln__error(ctx, KILN_ERR_INVALID, "kiln_dropout: p %g is not in [0, 1]", p), NULL;
  if (!kiln__training_flag(ctx, "kiln_dropout", &training)) return NULL;
  if (!training || p == 0.f) return a;
  kiln_tensor *out = kiln__ew(KILN__OP_DROPOUT, __func__, 1, &a);
  if (!out) return NULL;
  kiln__node *n = kiln__producer(out);
  KILN__F(n, DROPOUT, p) = p;
  KILN__F(n, DROPOUT, scale) = p < 1.f ? 1.f / (1.f - p) : 0.f;
  KILN__U(n, DROPOUT, seed) = ctx->seed;
  KILN__U(n, DROPOUT, offset) = ctx->philox_offset++;
  return out;
}

kiln_status kiln_assign(kiln_tensor *dst, kiln_tensor *src) {
  const char *fn = __func__;
  kiln_tensor *in[2] = {dst, src};
  kiln_ctx *ctx = kiln__ctx_of(2, in);
  if (!ctx) return KILN_ERR_INVALID;
  if (!kiln__ok(ctx)) return ctx->status;
  if (!dst || !src)
    return kiln__error(ctx, KILN_ERR_INVALID, "%s: %s is NULL", fn, !dst ? "dst" : "src");
  if (!kiln__op_begin(fn, 2, in)) return ctx->status;
  char s1[96], s2[96];
  if (!kiln__same_shape(dst, src) || dst->dtype != KILN_DTYPE_F32 || !kiln__is_float(src->dtype))
    return kiln__error(ctx, KILN_ERR_SHAPE,
                       "%s: dst %s %s and src %s %s: dst is f32 and src a float of its shape", fn,
                       kiln__shape_of(dst, s1, sizeof s1), kiln_dtype_name(dst->dtype),
                       kiln__shape_of(src, s2, sizeof s2), kiln_dtype_name(src->dtype));
  in[1] = kiln_cast(src, KILN_DTYPE_F32);
  if (!in[1]) return ctx->status;
  return kiln__update(KILN__OP_ASSIGN, fn, 2, in) ? KILN_OK : ctx->status;
}

kiln__node *kiln__update(kiln__op op, const char *fn, int nin, kiln_tensor *const *in) {
  kiln_ctx *ctx = kiln__op_begin(fn, nin, in);
  if (!ctx) return NULL;
  for (int i = 0; i < nin; i++) {
    bool store = kiln__ops[op].stores & (1u << i);
    if (store && (!in[i]->persistent || !kiln__is_contiguous(in[i]))) {
      kiln__error(ctx, KILN_ERR_INVALID, "%s: input %d must be a persistent contiguous tensor", fn,
                  i);
      return NULL;
    }
    /* a factor, flag or count: one value for every element */
    bool one = (kiln__update_scalars(op) >> i) & 1u;
    if (kiln_tensor_numel(in[i]) != (one ? 1 : kiln_tensor_numel(in[0])) ||
        in[i]->dtype != KILN_DTYPE_F32) {
      char s1[96], s2[96];
      kiln__error(ctx, KILN_ERR_SHAPE, "%s: input %d is %s %s, input 0 %s: %s", fn, i,
                  kiln__shape_of(in[i], s1, sizeof s1), kiln_dtype_name(in[i]->dtype),
                  kiln__shape_of(in[0], s2, sizeof s2),
                  one ? "it must be one f32 value" : "they must agree (f32)");
      return NULL;
    }
  }
  kiln__node *n = kiln__record(ctx, op, nin, in, NULL);
  if (n) n->fn = fn;
  return n;
}
