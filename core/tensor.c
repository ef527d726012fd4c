/*
 * tensor.c: tensor handles. Persistent tensors own their device memory from creation on;
 * intermediates are handles from a host arena whose storage is allocated when the trace that
 * produces them is flushed and released at the next kiln_step_begin.
 */
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "../fusion/engine.h"
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
  kiln_tensor *t = calloc(1, sizeof *t);
  kiln__storage *st = calloc(1, sizeof *st);
  if (!t || !st || !track_persistent(ctx, t)) {
    free(t);
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
      free(t);
      return NULL;
    }
    if (zero && KILN_CUDA_FAILED(ctx, cudaMemsetAsync(st->ptr, 0, st->bytes, ctx->stream))) {
      kiln_tensor_free(t);
      return NULL;
    }
  }
  return t;
}

static bool check_dtype_supported(kiln_ctx *ctx, const char *fn, kiln_dtype dt) {
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
  if (!check_dtype_supported(ctx, __func__, dtype) ||
      !kiln__valid_shape(ctx, __func__, shape.ndim, shape.d))
    return NULL;
  return kiln__tensor_persistent(ctx, dtype, shape.ndim, shape.d, true);
}

kiln_tensor *kiln_tensor_from_host(kiln_ctx *ctx, kiln_dtype dtype, kiln_shape shape,
                                   const void *data) {
  if (!kiln__ok(ctx)) return NULL;
  if (!data) return kiln__error(ctx, KILN_ERR_INVALID, "%s: NULL data", __func__), NULL;
  if (!check_dtype_supported(ctx, __func__, dtype) ||
      !kiln__valid_shape(ctx, __func__, shape.ndim, shape.d))
    return NULL;
  kiln_tensor *t = kiln__tensor_persistent(ctx, dtype, shape.ndim, shape.d, false);
  if (!t) return NULL;
  if (kiln_tensor_copy_from_host(t, data, t->st->bytes) != KILN_OK) {
    kiln_tensor_free(t);
    return NULL;
  }
  return t;
}

/* Marks the trace's nodes that read t (or its storage) as gone: the tape may not use them. */
static void forget(kiln_ctx *ctx, const kiln_tensor *t) {
  for (int32_t i = 0; i < ctx->trace.n; i++) {
    kiln__node *n = &ctx->trace.nodes[i];
    for (int k = 0; k < n->nin && !n->gone; k++)
      n->gone = n->in[k] == t || n->in[k]->st == t->st; /* the tensor or a view of it */
  }
}

void kiln_tensor_free(kiln_tensor *t) {
  if (!t || t->magic != KILN__TENSOR_MAGIC) return;
  kiln_ctx *ctx = t->ctx;
  if (!t->persistent) return; /* intermediates go at the next step */
  if (t->owned) {
    kiln__error(ctx, KILN_ERR_INVALID,
                "kiln_tensor_free: '%s' belongs to a parameter list, which frees it "
                "(kiln_params_free)",
                kiln__name(t));
    return;
  }
  /* recorded work may still read the tensor: run it before the memory can be reused; the
   * nodes that read it stay in the tape, unusable by kiln_backward */
  if (ctx->has_gpu && ctx->trace.done < ctx->trace.n) kiln__flush(ctx);
  forget(ctx, t);
  kiln__undo_forget(ctx, t);
  if (t->grad) kiln_tensor_free(t->grad);
  for (int i = 0; i < ctx->npersistent; i++) {
    if (ctx->persistents[i] == t) {
      ctx->persistents[i] = ctx->persistents[--ctx->npersistent];
      break;
    }
  }
  if (t->st->ptr) kiln__dev_free(ctx, t->st->ptr);
  free(t->st);
  free(t->name);
  t->magic = KILN__TENSOR_DEAD;
  free(t);
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

/* ---------------------------------------------------------------- host copies */

/*
 * Host data reaches the device through pinned staging buffers, so that a copy is queued on the
 * stream without waiting for it (a copy from pageable memory may synchronise the stream) and the
 * caller's memory is free again when the call returns. The buffers form a ring; an event recorded
 * after each copy says when its buffer may be written again, and only a ring that has come round
 * to a copy still in flight waits, for that copy alone. Large copies go in chunks, so the pinned
 * memory stays bounded.
 */
#define KILN__STAGE_SLOTS 8
#define KILN__STAGE_CHUNK ((size_t)4 << 20)
#define KILN__STAGE_MIN ((size_t)64 << 10)

typedef struct kiln__stage_slot {
  void *host; /* pinned, cap bytes */
  size_t cap;
  cudaEvent_t done; /* recorded after the slot's last copy */
} kiln__stage_slot;

typedef struct kiln__staging {
  kiln__stage_slot slot[KILN__STAGE_SLOTS];
  int next; /* the slot the next copy takes */
} kiln__staging;

void kiln__staging_free(kiln_ctx *ctx) {
  kiln__staging *sg = ctx->staging;
  if (!sg) return;
  for (int i = 0; i < KILN__STAGE_SLOTS; i++) {
    if (sg->slot[i].host) cudaFreeHost(sg->slot[i].host);
    if (sg->slot[i].done) cudaEventDestroy(sg->slot[i].done);
  }
  free(sg);
  ctx->staging = NULL;
}

/* A slot of at least len bytes whose last copy has finished; NULL when pinned memory cannot be
 * had (the caller copies from pageable memory instead) or with an error set. */
static kiln__stage_slot *stage_slot(kiln_ctx *ctx, size_t len, const char *fn) {
  kiln__staging *sg = ctx->staging;
  kiln__stage_slot *s = &sg->slot[sg->next];
  if (!s->done && kiln__cuda_failed(ctx, cudaEventCreateWithFlags(&s->done, cudaEventDisableTiming),
                                    fn, "cudaEventCreateWithFlags"))
    return NULL;
  /* the copy this slot staged last, a ring ago, must be done before its buffer is written */
  if (kiln__cuda_failed(ctx, cudaEventSynchronize(s->done), fn, "cudaEventSynchronize"))
    return NULL;
  if (s->cap < len) {
    size_t cap = s->cap > KILN__STAGE_MIN ? s->cap : KILN__STAGE_MIN;
    while (cap < len)
      cap *= 2;
    void *p = NULL;
    if (cudaMallocHost(&p, cap) != cudaSuccess) {
      (void)cudaGetLastError(); /* no pinned memory: not an error, only slower */
      return NULL;
    }
    if (s->host) cudaFreeHost(s->host);
    s->host = p;
    s->cap = cap;
  }
  sg->next = (sg->next + 1) % KILN__STAGE_SLOTS;
  return s;
}

/* Queues the copy of n host bytes at src to dst on the context's stream. */
static bool stage_copy(kiln_ctx *ctx, void *dst, const void *src, size_t n, const char *fn) {
  if (!ctx->staging && !(ctx->staging = calloc(1, sizeof *ctx->staging)))
    return !kiln__error(ctx, KILN_ERR_OOM, "%s: out of host memory", fn);
  for (size_t off = 0; off < n;) {
    size_t len = n - off < KILN__STAGE_CHUNK ? n - off : KILN__STAGE_CHUNK;
    char *d = (char *)dst + off;
    const char *h = (const char *)src + off;
    kiln__stage_slot *s = stage_slot(ctx, len, fn);
    if (!s && !kiln__ok(ctx)) return false;
    if (s) {
      memcpy(s->host, h, len);
      if (kiln__cuda_failed(ctx,
                            cudaMemcpyAsync(d, s->host, len, cudaMemcpyHostToDevice, ctx->stream),
                            fn, "cudaMemcpyAsync") ||
          kiln__cuda_failed(ctx, cudaEventRecord(s->done, ctx->stream), fn, "cudaEventRecord"))
        return false;
    } else if (kiln__cuda_failed(ctx,
                                 cudaMemcpyAsync(d, h, len, cudaMemcpyHostToDevice, ctx->stream),
                                 fn, "cudaMemcpyAsync") ||
               kiln__cuda_failed(ctx, cudaStreamSynchronize(ctx->stream), fn,
                                 "cudaStreamSynchronize")) {
      return false; /* from pageable memory, h must stay until the copy is done */
    }
    off += len;
  }
  return true;
}

kiln_status kiln_tensor_to_host(kiln_tensor *t, void *dst, size_t bytes) {
  kiln_ctx *ctx = kiln__handle_ctx(t);
  if (!ctx) return KILN_ERR_INVALID;
  if (!kiln__ok(ctx)) return ctx->status;
  if (!kiln__check(ctx, t, __func__)) return ctx->status;
  size_t need = (size_t)kiln_tensor_numel(t) * kiln_dtype_size(t->dtype);
  char sh[96];
  if (!dst || bytes != need)
    return kiln__error(ctx, KILN_ERR_INVALID,
                       "%s: buffer of %zu bytes for a %s %s tensor of %zu bytes", __func__, bytes,
                       kiln__shape_of(t, sh, sizeof sh), kiln_dtype_name(t->dtype), need);
  if (!ctx->has_gpu)
    return kiln__error(ctx, KILN_ERR_STATE, "%s: the context has no GPU (no_gpu or no device)",
                       __func__);
  if (ctx->in_step && ctx->graphs && ctx->trace.done < ctx->trace.n)
    return kiln__error(ctx, KILN_ERR_STATE,
                       "%s: a %s value read inside an open step: with step graphs on the step "
                       "runs whole at kiln_step_end, so read it after kiln_step_end (the loss, "
                       "say, every N steps), or turn graphs off (KILN_GRAPH=0, "
                       "kiln_set_graphs(ctx, 0))",
                       __func__, kiln__shape_of(t, sh, sizeof sh));
  kiln_tensor *src = kiln__is_contiguous(t) ? t : kiln_contiguous(t);
  if (!src) return ctx->status;
  /* a pending value the host asks for is written, fused or not (a persistent tensor always is:
   * marking it would change the signature of every later step that reads it) */
  if (!src->persistent) src->keep = true;
  kiln_status s = kiln__flush(ctx);
  if (s != KILN_OK) return s;
  if (need == 0) return KILN_OK;
  if (!src->st->ptr && src->st->fused)
    return kiln__error(ctx, KILN_ERR_STATE,
                       "%s: this %s intermediate lived in a fused kernel's registers and was never "
                       "written: read it before the flush that ran it (before kiln_step_end), "
                       "or set KILN_FUSION=0",
                       __func__, kiln__shape_of(t, sh, sizeof sh));
  if (!src->st->ptr)
    return kiln__error(ctx, KILN_ERR_STATE, "%s: the tensor has no data (its step failed)",
                       __func__);
  if (src->st->clobbered)
    return kiln__error(ctx, KILN_ERR_STATE,
                       "%s: this %s intermediate was consumed inside its step graph, whose "
                       "memory plan gave its memory to a later value: read the step's outputs "
                       "(values nothing in the step consumes), or turn graphs off "
                       "(KILN_GRAPH=0)",
                       __func__, kiln__shape_of(t, sh, sizeof sh));
  const char *p = (const char *)src->st->ptr + src->offset * (int64_t)kiln_dtype_size(t->dtype);
  if (KILN_CUDA_FAILED(ctx, cudaMemcpyAsync(dst, p, need, cudaMemcpyDeviceToHost, ctx->stream)))
    return ctx->status;
  kiln__engine_fetch_errors(ctx);
  if (KILN_CUDA_FAILED(ctx, cudaStreamSynchronize(ctx->stream))) return ctx->status;
  return kiln__engine_check_errors(ctx);
}

kiln_status kiln_tensor_copy_from_host(kiln_tensor *t, const void *src, size_t bytes) {
  kiln_ctx *ctx = kiln__handle_ctx(t);
  if (!ctx) return KILN_ERR_INVALID;
  if (!kiln__ok(ctx)) return ctx->status;
  if (!kiln__check(ctx, t, __func__)) return ctx->status;
  char sh[96];
  if (!t->persistent || !kiln__is_contiguous(t))
    return kiln__error(
        ctx, KILN_ERR_INVALID, "%s: the target must be a persistent contiguous tensor (got %s%s)",
        __func__, t->persistent ? "a view " : "an intermediate ", kiln__shape_of(t, sh, sizeof sh));
  size_t need = (size_t)kiln_tensor_numel(t) * kiln_dtype_size(t->dtype);
  if (!src || bytes != need)
    return kiln__error(ctx, KILN_ERR_INVALID, "%s: %zu bytes given for a %s %s tensor of %zu bytes",
                       __func__, bytes, kiln__shape_of(t, sh, sizeof sh), kiln_dtype_name(t->dtype),
                       need);
  if (!ctx->has_gpu) return KILN_OK; /* a no-GPU context records and plans; it keeps no data */
  /* what was recorded before runs first (nothing, when the copy opens a step: its graph stays
   * whole); the copy is queued after it on the stream, and nothing waits for the device */
  kiln_status s = kiln__flush(ctx);
  if (s != KILN_OK) return s;
  if (need == 0) return KILN_OK;
  return stage_copy(ctx, t->st->ptr, src, need, __func__) ? KILN_OK : ctx->status;
}

float kiln_tensor_item(kiln_tensor *t) {
  kiln_ctx *ctx = kiln__handle_ctx(t);
  if (!ctx) return NAN;
  if (!kiln__ok(ctx) || !kiln__check(ctx, t, __func__)) return NAN;
  if (kiln_tensor_numel(t) != 1 || t->dtype == KILN_DTYPE_F16) {
    char sh[96];
    kiln__error(ctx, KILN_ERR_SHAPE, "%s: needs a one-element f32, bf16 or i32 tensor, got %s %s",
                __func__, kiln__shape_of(t, sh, sizeof sh), kiln_dtype_name(t->dtype));
    return NAN;
  }
  if (t->dtype == KILN_DTYPE_I32) {
    int32_t i = 0;
    return kiln_tensor_to_host(t, &i, sizeof i) == KILN_OK ? (float)i : NAN;
  }
  if (t->dtype == KILN_DTYPE_BF16) {
    uint16_t h = 0;
    return kiln_tensor_to_host(t, &h, sizeof h) == KILN_OK ? kiln_bf16_to_f32(h) : NAN;
  }
  float v = NAN;
  if (kiln_tensor_to_host(t, &v, sizeof v) != KILN_OK) return NAN;
  return v;
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
