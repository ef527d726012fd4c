/*
 * transfer.c: copies between the host and a tensor's device memory, and kiln_tensor_free: the
 * calls that must first run what was recorded (a read waits for the value, a write or a free
 * for the work that reads the old memory). Host data goes through pinned staging buffers.
 */
#include <stdlib.h>
#include <string.h>

#include "../core/cuda_check.h"
#include "runtime.h"

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
  return kiln__wait(ctx);
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
  /* what was recorded before runs first (nothing, when the copy opens a step: its graph stays
   * whole); the copy is queued after it on the stream, and nothing waits for the device. A no-GPU
   * context records and plans; it keeps no data */
  kiln_status s = ctx->has_gpu ? kiln__flush(ctx) : KILN_OK;
  if (s != KILN_OK) return s;
  t->st->host_step = ctx->gen, t->st->host_at = ctx->trace.n;
  if (!ctx->has_gpu) return KILN_OK;
  if (need == 0) return KILN_OK;
  return stage_copy(ctx, t->st->ptr, src, need, __func__) ? KILN_OK : ctx->status;
}

kiln_tensor *kiln_tensor_from_host(kiln_ctx *ctx, kiln_dtype dtype, kiln_shape shape,
                                   const void *data) {
  if (!kiln__ok(ctx)) return NULL;
  if (!data) return kiln__error(ctx, KILN_ERR_INVALID, "%s: NULL data", __func__), NULL;
  if (!kiln__dtype_check(ctx, __func__, dtype) ||
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

void kiln_tensor_free(kiln_tensor *t) {
  if (!kiln__tensor_freeable(t)) return;
  kiln_ctx *ctx = t->ctx;
  /* recorded work may still read the tensor: run it before the memory can be reused */
  if (ctx->has_gpu && ctx->trace.done < ctx->trace.n) kiln__flush(ctx);
  kiln__tensor_release(t);
}

/* ---------------------------------------------------------------- loaders' own host memory */

void *kiln__host_alloc(kiln_ctx *ctx, size_t n, bool *pinned) {
  void *p = NULL;
  *pinned = false;
  if (ctx->has_gpu && cudaMallocHost(&p, n ? n : 1) == cudaSuccess) {
    *pinned = true;
    return p;
  }
  if (ctx->has_gpu) (void)cudaGetLastError(); /* no pinned memory: not an error, only slower */
  return malloc(n ? n : 1);
}

void kiln__host_free(void *p, bool pinned) {
  if (!p) return;
  if (pinned)
    cudaFreeHost(p);
  else
    free(p);
}

kiln_status kiln__upload(kiln_tensor *t, size_t at, const void *src, size_t n, bool pinned,
                         void **event, const char *fn) {
  kiln_ctx *ctx = kiln__handle_ctx(t);
  KILN_ASSERT(ctx && t->persistent && kiln__is_contiguous(t));
  KILN_ASSERT(at <= t->st->bytes && n <= t->st->bytes - at);
  if (!kiln__ok(ctx)) return ctx->status;
  if (!ctx->has_gpu || n == 0) return KILN_OK;
  /* what was recorded before runs first, as for kiln_tensor_copy_from_host */
  kiln_status s = kiln__flush(ctx);
  if (s != KILN_OK) return s;
  if (!*event &&
      kiln__cuda_failed(ctx, cudaEventCreateWithFlags((cudaEvent_t *)event, cudaEventDisableTiming),
                        fn, "cudaEventCreateWithFlags"))
    return ctx->status;
  if (kiln__cuda_failed(
          ctx,
          cudaMemcpyAsync((char *)t->st->ptr + at, src, n, cudaMemcpyHostToDevice, ctx->stream), fn,
          "cudaMemcpyAsync") ||
      kiln__cuda_failed(ctx, cudaEventRecord((cudaEvent_t)*event, ctx->stream), fn,
                        "cudaEventRecord"))
    return ctx->status;
  /* from pageable memory, src must stay until the copy is done */
  if (!pinned) return kiln__upload_wait(ctx, *event, fn);
  return KILN_OK;
}

kiln_status kiln__upload_wait(kiln_ctx *ctx, void *event, const char *fn) {
  if (!event || !ctx->has_gpu) return KILN_OK;
  if (kiln__cuda_failed(ctx, cudaEventSynchronize((cudaEvent_t)event), fn, "cudaEventSynchronize"))
    return ctx->status;
  return KILN_OK;
}

void kiln__event_free(void *event) {
  if (event) cudaEventDestroy((cudaEvent_t)event);
}
