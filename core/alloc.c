/*
 * alloc.c: the caching device allocator. Freed blocks stay cached and are reused best-fit; when
 * cudaMalloc fails, the cache is emptied and the call retried once before it reports failure.
 * All work runs on the context's one stream, so a block freed after its last use was recorded
 * can be handed out again at once.
 */
#include <stdlib.h>

#include "cuda_check.h"
#include "internal.h"

struct kiln__block {
  void *ptr;
  size_t size;
  kiln__block *next;
};

/* Live blocks, by pointer, so that a free knows its size. */
#define KILN__LIVE_BUCKETS 1024
typedef struct live_table {
  kiln__block *b[KILN__LIVE_BUCKETS];
} live_table;

static live_table *live_of(kiln_ctx *ctx) { return (live_table *)ctx->alloc.live; }

/* Block addresses are spread by their bits above the allocation granularity. */
static size_t bucket(const void *p) {
  return ((uintptr_t)p / KILN__ALLOC_ALIGN) % KILN__LIVE_BUCKETS;
}

static void live_put(kiln_ctx *ctx, kiln__block *b) {
  live_table *t = live_of(ctx);
  size_t i = bucket(b->ptr);
  b->next = t->b[i];
  t->b[i] = b;
}

static kiln__block *live_take(kiln_ctx *ctx, void *p) {
  live_table *t = live_of(ctx);
  if (!t) return NULL;
  kiln__block **pp = &t->b[bucket(p)];
  for (; *pp; pp = &(*pp)->next) {
    if ((*pp)->ptr == p) {
      kiln__block *b = *pp;
      *pp = b->next;
      return b;
    }
  }
  return NULL;
}

static void empty_cache(kiln_ctx *ctx) {
  kiln__block *b = ctx->alloc.free_list;
  while (b) {
    kiln__block *n = b->next;
    cudaFree(b->ptr);
    ctx->alloc.cached -= b->size;
    free(b);
    b = n;
  }
  ctx->alloc.free_list = NULL;
}

void *kiln__dev_alloc(kiln_ctx *ctx, size_t bytes) {
  KILN_ASSERT(ctx->has_gpu);
  if (!ctx->alloc.live) {
    ctx->alloc.live = calloc(1, sizeof(live_table));
    if (!ctx->alloc.live) return NULL;
  }
  size_t size = (bytes + KILN__ALLOC_ALIGN - 1) & ~(size_t)(KILN__ALLOC_ALIGN - 1);
  if (size == 0) size = 512;
  /* best fit among cached blocks no more than twice the size asked for */
  kiln__block **pp = &ctx->alloc.free_list;
  for (; *pp; pp = &(*pp)->next) {
    if ((*pp)->size >= size && (*pp)->size <= 2 * size) {
      kiln__block *b = *pp;
      *pp = b->next;
      ctx->alloc.cached -= b->size;
      ctx->alloc.in_use += b->size;
      if (ctx->alloc.in_use > ctx->alloc.peak) ctx->alloc.peak = ctx->alloc.in_use;
      live_put(ctx, b);
      return b->ptr;
    }
    if ((*pp)->size > 2 * size) break;
  }
  void *p = NULL;
  cudaError_t e = cudaMalloc(&p, size);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    empty_cache(ctx);
    e = cudaMalloc(&p, size);
    if (e != cudaSuccess) {
      (void)cudaGetLastError();
      return NULL;
    }
  }
  /* cudaMalloc aligns to 256 bytes at least; sizes that are multiples of KILN__ALLOC_ALIGN keep
   * the blocks it hands out at such boundaries, which generated kernels rely on (render.c) */
  KILN_ASSERT((uintptr_t)p % 256 == 0);
  kiln__block *b = malloc(sizeof *b);
  if (!b) {
    cudaFree(p);
    return NULL;
  }
  b->ptr = p;
  b->size = size;
  ctx->alloc.device_mallocs++;
  ctx->alloc.in_use += size;
  if (ctx->alloc.in_use > ctx->alloc.peak) ctx->alloc.peak = ctx->alloc.in_use;
  live_put(ctx, b);
  return p;
}

void kiln__dev_free(kiln_ctx *ctx, void *p) {
  if (!p) return;
  kiln__block *b = live_take(ctx, p);
  KILN_ASSERT(b != NULL);
  ctx->alloc.in_use -= b->size;
  ctx->alloc.cached += b->size;
  kiln__block **pp = &ctx->alloc.free_list;
  while (*pp && (*pp)->size < b->size)
    pp = &(*pp)->next;
  b->next = *pp;
  *pp = b;
}

void kiln_memory_empty_cache(kiln_ctx *ctx) {
  if (ctx && ctx->has_gpu) empty_cache(ctx);
}

void kiln__alloc_release_all(kiln_ctx *ctx) {
  live_table *t = live_of(ctx);
  if (t) {
    for (int i = 0; i < KILN__LIVE_BUCKETS; i++) {
      for (kiln__block *b = t->b[i]; b;) {
        kiln__block *n = b->next;
        cudaFree(b->ptr);
        free(b);
        b = n;
      }
    }
    free(t);
    ctx->alloc.live = NULL;
  }
  if (ctx->has_gpu) empty_cache(ctx);
  ctx->alloc.in_use = 0;
}
