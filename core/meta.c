/*
 * meta.c: tensor metadata: dtypes, shapes, strides, broadcasting and the public accessors.
 * Nothing here touches the device.
 */
#include <inttypes.h>
#include <string.h>

#include "internal.h"

size_t kiln_dtype_size(kiln_dtype dt) {
  switch (dt) {
  case KILN_DTYPE_F32: return 4;
  case KILN_DTYPE_BF16: return 2;
  case KILN_DTYPE_F16: return 2;
  case KILN_DTYPE_I32: return 4;
  }
  return 0;
}

uint16_t kiln_bf16_from_f32(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* quiet NaN */
  u += 0x7fffu + ((u >> 16) & 1u); /* round to nearest, ties to even */
  return (uint16_t)(u >> 16);
}

float kiln_bf16_to_f32(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

const char *kiln_dtype_name(kiln_dtype dt) {
  switch (dt) {
  case KILN_DTYPE_F32: return "f32";
  case KILN_DTYPE_BF16: return "bf16";
  case KILN_DTYPE_F16: return "f16";
  case KILN_DTYPE_I32: return "i32";
  }
  return "?";
}

bool kiln__numel_ok(int ndim, const int64_t *shape) {
  int64_t n = 1; /* the product of the dims above 1: zero dims do not excuse the others */
  for (int i = 0; i < ndim; i++) {
    if (shape[i] < 0) return false;
    if (shape[i] <= 1) continue;
    if (n > KILN__MAX_NUMEL / shape[i]) return false;
    n *= shape[i];
  }
  return true;
}

bool kiln__valid_shape(kiln_ctx *ctx, const char *fn, int ndim, const int64_t *shape) {
  if (ndim < 0 || ndim > KILN_MAX_DIMS)
    return kiln__error(ctx, KILN_ERR_SHAPE, "%s: %d dims; kiln takes 0 to %d", fn, ndim,
                       KILN_MAX_DIMS),
           false;
  for (int i = 0; i < ndim; i++)
    if (shape[i] < 0)
      return kiln__error(ctx, KILN_ERR_SHAPE, "%s: dim %d is %" PRId64 "; sizes must be >= 0", fn,
                         i, shape[i]),
             false;
  if (!kiln__numel_ok(ndim, shape)) {
    char sh[160];
    kiln_shape s = {.ndim = ndim};
    memcpy(s.d, shape, (size_t)ndim * sizeof *shape);
    return kiln__error(ctx, KILN_ERR_SHAPE, "%s: shape %s has more than 2^58 elements", fn,
                       kiln_shape_str(s, sh, sizeof sh)),
           false;
  }
  return true;
}

int64_t kiln__numel(int ndim, const int64_t *shape) {
  int64_t n = 1;
  for (int i = 0; i < ndim; i++)
    n *= shape[i];
  return n;
}

void kiln__contiguous_strides(int ndim, const int64_t *shape, int64_t *stride) {
  int64_t s = 1;
  for (int i = ndim - 1; i >= 0; i--) {
    stride[i] = s;
    s *= shape[i] > 0 ? shape[i] : 1;
  }
}

bool kiln__is_contiguous(const kiln_tensor *t) {
  int64_t s = 1;
  for (int i = t->ndim - 1; i >= 0; i--) {
    if (t->shape[i] != 1 && t->stride[i] != s) return false;
    s *= t->shape[i] > 0 ? t->shape[i] : 1;
  }
  return true;
}

bool kiln__same_shape(const kiln_tensor *a, const kiln_tensor *b) {
  if (a->ndim != b->ndim) return false;
  for (int d = 0; d < a->ndim; d++)
    if (a->shape[d] != b->shape[d]) return false;
  return true;
}

char *kiln_shape_str(kiln_shape s, char *buf, size_t n) {
  size_t k = 0;
  if (n == 0) return buf;
  if (s.ndim < 0 || s.ndim > KILN_MAX_DIMS) {
    snprintf(buf, n, "[%d dims?]", s.ndim); /* d[] holds at most KILN_MAX_DIMS */
    return buf;
  }
  k += (size_t)snprintf(buf + k, n - k, "[");
  for (int i = 0; i < s.ndim && k < n; i++)
    k += (size_t)snprintf(buf + k, n - k, i ? ",%" PRId64 : "%" PRId64, s.d[i]);
  if (k < n) snprintf(buf + k, n - k, "]");
  return buf;
}

const char *kiln__shape_of(const kiln_tensor *t, char *buf, size_t n) {
  if (!t) {
    snprintf(buf, n, "NULL");
    return buf;
  }
  kiln_shape s = {.ndim = t->ndim}; /* whatever state t is in: this is for messages */
  if (s.ndim >= 0 && s.ndim <= KILN_MAX_DIMS) memcpy(s.d, t->shape, (size_t)s.ndim * sizeof *s.d);
  return kiln_shape_str(s, buf, n);
}

bool kiln__broadcast_shape(kiln_ctx *ctx, const char *fn, int n, kiln_tensor *const *ts, int *ndim,
                           int64_t *shape) {
  int nd = 0;
  for (int i = 0; i < n; i++)
    if (ts[i]->ndim > nd) nd = ts[i]->ndim;
  for (int d = 0; d < nd; d++)
    shape[d] = 1;
  for (int i = 0; i < n; i++) {
    const kiln_tensor *t = ts[i];
    for (int j = 0; j < t->ndim; j++) {
      int d = nd - t->ndim + j;
      int64_t s = t->shape[j];
      if (s == shape[d] || s == 1) continue;
      if (shape[d] == 1) {
        shape[d] = s;
        continue;
      }
      char buf[512];
      size_t k = 0;
      for (int m = 0; m < n; m++) {
        char sh[96];
        k += (size_t)snprintf(buf + k, sizeof buf - k, "%s%s", m ? " and " : "",
                              kiln__shape_of(ts[m], sh, sizeof sh));
        if (k >= sizeof buf) break;
      }
      return kiln__error(ctx, KILN_ERR_SHAPE,
                         "%s: shapes %s do not broadcast (dim %d: %" PRId64 " vs %" PRId64 ")", fn,
                         buf, d - nd, shape[d], s),
             false;
    }
  }
  *ndim = nd;
  return true;
}

/* ---------------------------------------------------------------- handles and accessors */

kiln_ctx *kiln__handle_ctx(const kiln_tensor *t) {
  return t && (t->magic == KILN__TENSOR_MAGIC || t->magic == KILN__TENSOR_STALE ||
               t->magic == KILN__TENSOR_DEAD)
             ? t->ctx
             : NULL;
}

kiln_ctx *kiln__ctx_of(int n, kiln_tensor *const *ts) {
  for (int i = 0; i < n; i++)
    if (kiln__handle_ctx(ts[i])) return ts[i]->ctx;
  return NULL;
}

bool kiln__check(kiln_ctx *ctx, const kiln_tensor *t, const char *fn) {
  if (!t) return kiln__error(ctx, KILN_ERR_INVALID, "%s: NULL tensor", fn), false;
  if (t->magic == KILN__TENSOR_STALE)
    return kiln__error(ctx ? ctx : t->ctx, KILN_ERR_STATE,
                       "%s: stale tensor handle: an intermediate of a step that ended long ago "
                       "(intermediates are released by kiln_step_begin)",
                       fn),
           false;
  if (t->magic == KILN__TENSOR_DEAD)
    return kiln__error(ctx ? ctx : t->ctx, KILN_ERR_STATE,
                       "%s: a freed tensor (kiln_tensor_free freed it; its handle is no longer "
                       "a tensor)",
                       fn),
           false;
  if (t->magic != KILN__TENSOR_MAGIC)
    return kiln__error(ctx, KILN_ERR_STATE, "%s: invalid or freed tensor handle", fn), false;
  if (ctx && t->ctx != ctx)
    return kiln__error(ctx, KILN_ERR_INVALID, "%s: tensor belongs to another context", fn), false;
  if (!t->persistent && t->gen != t->ctx->gen)
    return kiln__error(t->ctx, KILN_ERR_STATE,
                       "%s: stale tensor handle%s%s%s: an intermediate of step generation "
                       "%" PRIu64 " used in generation %" PRIu64
                       " (intermediates are released by kiln_step_begin)",
                       fn, t->name ? " '" : "", kiln__name(t), t->name ? "'" : "", t->gen,
                       t->ctx->gen),
           false;
  return true;
}

/* t when it is a live handle; else NULL, and a stale or freed handle is an error on its
 * context. The accessors answer 0 (or an empty shape) for such handles. */
static const kiln_tensor *live(const kiln_tensor *t, const char *fn) {
  kiln_ctx *ctx = kiln__handle_ctx(t);
  return ctx && kiln__check(ctx, t, fn) ? t : NULL;
}

kiln_ctx *kiln_tensor_ctx(const kiln_tensor *t) { return kiln__handle_ctx(t); }
kiln_dtype kiln_tensor_dtype(const kiln_tensor *t) {
  return live(t, __func__) ? t->dtype : KILN_DTYPE_F32;
}
int kiln_tensor_ndim(const kiln_tensor *t) { return live(t, __func__) ? t->ndim : 0; }
int64_t kiln_tensor_dim(const kiln_tensor *t, int axis) {
  if (!live(t, __func__)) return 0;
  if (axis < 0) axis += t->ndim;
  return axis >= 0 && axis < t->ndim ? t->shape[axis] : 0;
}
int64_t kiln_tensor_stride(const kiln_tensor *t, int axis) {
  if (!live(t, __func__)) return 0;
  if (axis < 0) axis += t->ndim;
  return axis >= 0 && axis < t->ndim ? t->stride[axis] : 0;
}
kiln_shape kiln_tensor_shape(const kiln_tensor *t) {
  kiln_shape s = {0};
  if (!live(t, __func__)) return s;
  s.ndim = t->ndim;
  memcpy(s.d, t->shape, (size_t)t->ndim * sizeof *s.d);
  return s;
}
int64_t kiln_tensor_numel(const kiln_tensor *t) {
  return live(t, __func__) ? kiln__numel(t->ndim, t->shape) : 0;
}
int kiln_tensor_is_contiguous(const kiln_tensor *t) {
  return live(t, __func__) && kiln__is_contiguous(t);
}
int kiln_tensor_is_persistent(const kiln_tensor *t) { return live(t, __func__) && t->persistent; }
const char *kiln__name(const kiln_tensor *t) { return t->name ? t->name : ""; }
const char *kiln_tensor_name(const kiln_tensor *t) {
  return live(t, __func__) ? kiln__name(t) : "";
}
