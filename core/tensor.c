/*
 * tensor.c: tensor handles. Persistent tensors own their device memory from creation on;
 * intermediates are handles from a host arena whose storage is allocated when the trace that
 * produces them is flushed and released at the next kiln_step_begin. What moves data between
 * the host and the device, or must first run recorded work (kiln_tensor_free), is in
 * runtime/transfer.c.
 */
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_check.h"
#include "internal.h"

#define KILN__CHUNK ((size_t)64 << 10)

void *kiln__arena_alloc(kiln__arena *a, size_t bytes) {
  bytes = (bytes + 15) & ~(size_t)15;
  KILN_ASSERT(bytes <= KILN__CHUNK);
  if (a->nchunks == 0 || a->used + bytes > KILN__CHUNK) {
    /* a reset arena keeps its chunks: reuse the next one before growing */
    if (a->cur + 1 < a->nchunks) {
      a->cur++;
    } else {
      if (!KILN__GROW(a->chunks, a->cap, a->nchunks + 1)) return NULL;
      char *chunk = malloc(KILN__CHUNK);
      if (!chunk) return NULL;
      a->chunks[a->nchunks++] = chunk;
      a->cur = a->nchunks - 1;
    }
    a->used = 0;
  }
  void *p = a->chunks[a->cur] + a->used;
  a->used += bytes;
  memset(p, 0, bytes);
  return p;
}

void kiln__arena_reset(kiln__arena *a) {
  a->cur = 0;
  a->used = 0;
  if (a->nchunks == 0) return;
  /* chunk 0 is reused from its start */
}

void kiln__arena_free(kiln__arena *a) {
  for (int i = 0; i < a->nchunks; i++)
    free(a->chunks[i]);
  free(a->chunks);
  memset(a, 0, sizeof *a);
}

kiln_tensor *kiln__tensor_intermediate(kiln_ctx *ctx, const char *fn, kiln_dtype dt, int ndim,
                                       const int64_t *shape) {
  if (!kiln__valid_shape(ctx, fn, ndim, shape)) return NULL;
  kiln_tensor *t = kiln__handle_new(ctx);
  if (!t) return NULL;
  kiln__storage *st = kiln__arena_alloc(&ctx->arenas[ctx->gen & 1], sizeof *st);
  if (!st) {
    kiln__error(ctx, KILN_ERR_OOM, "kiln: out of host memory for tensor storages");
    return NULL;
  }
  t->magic = KILN__TENSOR_MAGIC;
  t->ctx = ctx;
  t->gen = ctx->gen;
  t->dtype = dt;
  t->ndim = ndim;
  memcpy(t->shape, shape, (size_t)ndim * sizeof *shape);
  kiln__contiguous_strides(ndim, shape, t->stride);
  t->node = -1;
  st->bytes = (size_t)kiln__numel(ndim, shape) * kiln_dtype_size(dt);
  t->fn = fn;
  st->next = ctx->step_storages;
  ctx->step_storages = st;
  t->st = st;
  return t;
}

kiln_tensor *kiln__tensor_view(const char *fn, kiln_tensor *a, int ndim, const int64_t *shape,
                               const int64_t *stride, int64_t offset) {
  kiln_ctx *ctx = a->ctx;
  if (!kiln__valid_shape(ctx, fn, ndim, shape)) return NULL;
  kiln_tensor *t = kiln__handle_new(ctx);
  if (!t) return NULL;
  t->magic = KILN__TENSOR_MAGIC;
  t->ctx = ctx;
  t->gen = ctx->gen;
  t->dtype = a->dtype;
  t->ndim = ndim;
  memcpy(t->shape, shape, (size_t)ndim * sizeof *shape);
  memcpy(t->stride, stride, (size_t)ndim * sizeof *stride);
  t->offset = offset;
  t->st = a->st;
  t->node = -1;
  return t;
}

static bool track_persistent(kiln_ctx *ctx, kiln_tensor *t) {
  if (!KILN__GROW(ctx->persistents, ctx->cap_persistent, ctx->npersistent + 1)) return false;
  ctx->persistents[ctx->npersistent++] = t;
  return true;
}

kiln_tensor *kiln__tensor_persistent(kiln_ctx *ctx, kiln_dtype dt, int ndim, const int64_t *shape,
                                     bool zero) {
  kiln_tensor *t = kiln__handle_new_persistent(ctx);
  if (!t) return NULL;
  kiln__storage *st = calloc(1, sizeof *st);
  if (!st || !track_persistent(ctx, t)) {
    kiln__handle_free_persistent(ctx, t);
    free(st);
    kiln__error(ctx, KILN_ERR_OOM, "kiln_tensor_new: out of host memory");
    return NULL;
  }
  t->magic = KILN__TENSOR_MAGIC;
  t->ctx = ctx;
  t->dtype = dt;
  t->ndim = ndim;
  memcpy(t->shape, shape, (size_t)ndim * sizeof *shape);
  kiln__contiguous_strides(ndim, shape, t->stride);
  t->node = -1;
  t->persistent = true;
  st->persistent = true;
  st->bytes = (size_t)kiln__numel(ndim, shape) * kiln_dtype_size(dt);
  t->st = st;
  if (ctx->has_gpu) {
    st->ptr = kiln__dev_alloc(ctx, st->bytes);
    if (!st->ptr) {
      char sh[96];
      kiln__error(ctx, KILN_ERR_OOM,
                  "kiln_tensor_new: out of device memory for a %s %s tensor (%zu bytes; %zu in "
                  "use)",
                  kiln__shape_of(t, sh, sizeof sh), kiln_dtype_name(dt), st->bytes,
                  ctx->alloc.in_use);
      ctx->npersistent--;
      free(st);
      kiln__handle_free_persistent(ctx, t);
      return NULL;
    }
    if (zero && KILN_CUDA_FAILED(ctx, cudaMemsetAsync(st->ptr, 0, st->bytes, ctx->stream))) {
      kiln__tensor_release(t);
      return NULL;
    }
  }
  return t;
}

bool kiln__dtype_check(kiln_ctx *ctx, const char *fn, kiln_dtype dt) {
  if (dt == KILN_DTYPE_F32 || dt == KILN_DTYPE_BF16 || dt == KILN_DTYPE_I32) return true;
  if (dt == KILN_DTYPE_F16)
    return kiln__error(ctx, KILN_ERR_DTYPE,
                       "%s: dtype %s is not supported yet (f32, bf16 and i32 are)", fn,
                       kiln_dtype_name(dt)),
           false;
  return kiln__error(ctx, KILN_ERR_DTYPE, "%s: unknown dtype %d", fn, (int)dt), false;
}

kiln_tensor *kiln_tensor_new(kiln_ctx *ctx, kiln_dtype dtype, kiln_shape shape) {
  if (!kiln__ok(ctx)) return NULL;
  if (!kiln__dtype_check(ctx, __func__, dtype) ||
      !kiln__valid_shape(ctx, __func__, shape.ndim, shape.d))
    return NULL;
  return kiln__tensor_persistent(ctx, dtype, shape.ndim, shape.d, true);
}

/* Marks the trace's nodes that read t (or its storage) as gone: the tape may not use them. */
static void forget(kiln_ctx *ctx, const kiln_tensor *t) {
  for (int32_t i = 0; i < ctx->trace.n; i++) {
    kiln__node *n = &ctx->trace.nodes[i];
    for (int k = 0; k < n->nin && !n->gone; k++)
      n->gone = n->in[k] == t || n->in[k]->st == t->st; /* the tensor or a view of it */
  }
}

bool kiln__tensor_freeable(kiln_tensor *t) {
  if (t && t->magic == KILN__TENSOR_DEAD) {
    kiln__error(t->ctx, KILN_ERR_STATE, "kiln_tensor_free: the tensor was freed already");
    return false;
  }
  if (!t || t->magic != KILN__TENSOR_MAGIC) return false;
  if (!t->persistent) return false; /* intermediates go at the next step */
  if (t->owned) {
    kiln__error(t->ctx, KILN_ERR_INVALID,
                "kiln_tensor_free: '%s' belongs to a parameter list, which frees it "
                "(kiln_params_free)",
                kiln__name(t));
    return false;
  }
  return true;
}

void kiln__tensor_release(kiln_tensor *t) {
  if (!kiln__tensor_freeable(t)) return;
  kiln_ctx *ctx = t->ctx;
  /* the nodes that read it stay in the tape, unusable by kiln_backward */
  forget(ctx, t);
  kiln__undo_forget(ctx, t);
  if (t->grad) kiln__tensor_release(t->grad);
  for (int i = 0; i < ctx->npersistent; i++) {
    if (ctx->persistents[i] == t) {
      ctx->persistents[i] = ctx->persistents[--ctx->npersistent];
      break;
    }
  }
  if (t->st->ptr) kiln__dev_free(ctx, t->st->ptr);
  free(t->st);
  free(t->name);
  kiln__handle_free_persistent(ctx, t);
}

void *kiln__data_ptr(const kiln_tensor *t) {
  return (char *)t->st->ptr + t->offset * (int64_t)kiln_dtype_size(t->dtype);
}

kiln__node *kiln__producer(const kiln_tensor *t) {
  kiln_ctx *ctx = t->ctx;
  int32_t i = t->node;
  if (t->persistent || i < 0 || i >= ctx->trace.n || ctx->trace.nodes[i].out != t) return NULL;
  return &ctx->trace.nodes[i];
}

/* Intermediates' names live in the step's arena, whose allocations are small. */
#define KILN__MAX_STEP_NAME 4096

void kiln_tensor_set_name(kiln_tensor *t, const char *name) {
  kiln_ctx *ctx = kiln__handle_ctx(t);
  if (!ctx || !kiln__check(ctx, t, __func__) || !name) return;
  size_t n = strlen(name) + 1;
  if (!t->persistent && n > KILN__MAX_STEP_NAME)
    return (void)kiln__error(ctx, KILN_ERR_INVALID,
                             "kiln_tensor_set_name: %zu bytes is too long a name for an "
                             "intermediate (at most %d)",
                             n - 1, KILN__MAX_STEP_NAME - 1);
  char *copy = t->persistent ? malloc(n) : kiln__arena_alloc(&ctx->arenas[ctx->gen & 1], n);
  if (!copy) {
    kiln__error(ctx, KILN_ERR_OOM, "kiln_tensor_set_name: out of host memory (%zu bytes)", n);
    return;
  }
  memcpy(copy, name, n);
  if (t->persistent) free(t->name);
  t->name = copy;
}

void kiln_tensor_set_requires_grad(kiln_tensor *t, int on) {
  kiln_ctx *ctx = kiln_tensor_ctx(t);
  if (!ctx || !kiln__check(ctx, t, __func__)) return;
  if (on && (!t->persistent || t->dtype != KILN_DTYPE_F32)) {
    kiln__error(ctx, KILN_ERR_INVALID,
                "%s: only persistent f32 tensors can require grad (got %s %s)", __func__,
                t->persistent ? "persistent" : "an intermediate", kiln_dtype_name(t->dtype));
    return;
  }
  t->requires_grad = on != 0;
}
int kiln_tensor_requires_grad(const kiln_tensor *t) { return t && t->requires_grad; }
kiln_tensor *kiln_tensor_grad(const kiln_tensor *t) {
  return t && t->persistent && t->grad_valid ? t->grad : NULL;
}
static void undo_grad_flag(void *obj, void *saved) {
  ((kiln_tensor *)obj)->grad_valid = *(bool *)saved;
}

bool kiln__undo_grad_flag(kiln_tensor *t) {
  if (!t->ctx->in_step || kiln__undo_logged(t->ctx, &t->undo_mark)) return true;
  bool *saved = malloc(sizeof *saved);
  if (!saved) return !kiln__error(t->ctx, KILN_ERR_OOM, "kiln: out of host memory");
  *saved = t->grad_valid;
  return kiln__undo_push(t->ctx, undo_grad_flag, t, saved, &t->undo_mark);
}

void kiln_tensor_zero_grad(kiln_tensor *t) {
  if (!t || t->magic != KILN__TENSOR_MAGIC || !t->persistent) return;
  if (kiln__undo_grad_flag(t)) t->grad_valid = false;
}
