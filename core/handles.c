/*
 * handles.c: the handles of intermediates (the kiln_tensor structs that users hold between ops
 * and that go stale at the next kiln_step_begin). Every handle gets an address never used
 * before in the context's life: handles are bump-allocated through a large reserved range of
 * virtual memory, chunk by chunk. When every handle of a chunk is stale, the chunk's memory is
 * given back by mapping over it, read-only, part of a shared template of "stale" handles (each
 * says it is stale and names its context). So a stale handle is still readable memory that says
 * what it is, and the memory in use stays a few chunks and the template. Only after the whole
 * range has been used (2^29 handles) do addresses come round again. Linux: mmap, memfd.
 *
 * Persistent tensors' handles come from the same range: a chunk holding a live one is not retired
 * (nor reused when the addresses come round) until its last one is freed, and a freed one stays
 * readable, saying it was freed, so that using or freeing it again is an error rather than a read
 * of freed memory.
 */
#define _GNU_SOURCE
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "internal.h"

/* A handle's slot: every handle starts at a multiple of this, in every chunk (so that a stale
 * chunk's slots line up with the handles that were there). */
#define SLOT 256
_Static_assert(sizeof(kiln_tensor) <= SLOT, "a tensor handle fits its slot");
/* Handles are committed and retired a chunk at a time (4096 handles). */
#define CHUNK ((size_t)1 << 20)
/* The stale template: retired chunks map it at their offset modulo its size, so that neighbours
 * merge into one kernel mapping per template length (keeping the process's mappings few: at most
 * 16384 for the largest range) for 8 MiB of memory per context. */
#define TEMPLATE ((size_t)1 << 23)
/* Address space reserved for handles: the first size that the system grants, from 128 GiB (2^29
 * handles before the range is used again) down to 4 GiB. */
static const size_t reserve_sizes[] = {(size_t)1 << 37, (size_t)1 << 34, (size_t)1 << 32};

struct kiln__handles {
  char *base;
  size_t size;
  size_t used;      /* bump offset of the next handle */
  size_t committed; /* [0, committed) is readable: live, or retired onto the stale chunk */
  int stale_fd;     /* a memfd holding the stale template */
  /* full chunks not yet retired, oldest first, each with the generation of its last handle */
  size_t *pending_off;
  uint64_t *pending_gen;
  int npending, cap_off, cap_gen;
  uint32_t *live; /* per chunk of the range: its live persistent handles */
};

static size_t chunk_of(const kiln__handles *h, const kiln_tensor *t) {
  return (size_t)((const char *)t - h->base) / CHUNK;
}

/* Sets up the reservation and the stale chunk; false with the error set. */
static bool handles_init(kiln_ctx *ctx) {
  kiln__handles *h = calloc(1, sizeof *h);
  if (!h) return !kiln__error(ctx, KILN_ERR_OOM, "kiln: out of host memory for tensor handles");
  h->stale_fd = -1;
  for (size_t k = 0; k < sizeof reserve_sizes / sizeof reserve_sizes[0] && !h->base; k++) {
    void *p =
        mmap(NULL, reserve_sizes[k], PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p != MAP_FAILED) {
      h->base = p;
      h->size = reserve_sizes[k];
    }
  }
  h->stale_fd = memfd_create("kiln-stale-handles", MFD_CLOEXEC);
  h->live = h->base ? calloc(h->size / CHUNK, sizeof *h->live) : NULL;
  char *stale = MAP_FAILED;
  if (h->live && h->stale_fd >= 0 && ftruncate(h->stale_fd, (off_t)TEMPLATE) == 0)
    stale = mmap(NULL, TEMPLATE, PROT_READ | PROT_WRITE, MAP_SHARED, h->stale_fd, 0);
  if (stale == MAP_FAILED) {
    if (h->base) munmap(h->base, h->size);
    if (h->stale_fd >= 0) close(h->stale_fd);
    free(h->live);
    free(h);
    return !kiln__error(ctx, KILN_ERR_OOM,
                        "kiln: cannot reserve address space for tensor handles (mmap/memfd)");
  }
  for (size_t s = 0; s < TEMPLATE; s += SLOT) {
    kiln_tensor *t = (kiln_tensor *)(stale + s);
    t->magic = KILN__TENSOR_STALE;
    t->ctx = ctx;
    t->node = -1;
  }
  munmap(stale, TEMPLATE); /* the memfd keeps the contents */
  ctx->handles = h;
  return true;
}

/* Maps the stale template over the chunk at off: its memory goes back to the system, and its
 * handles read as stale from now on. */
static void retire(kiln__handles *h, size_t off) {
  void *p = mmap(h->base + off, CHUNK, PROT_READ, MAP_SHARED | MAP_FIXED, h->stale_fd,
                 (off_t)(off % TEMPLATE));
  /* it replaces a mapping of ours, so only the kernel's count of mappings can refuse it: then
   * the chunk's memory simply stays (its handles stay readable, and stale by generation) */
  (void)p;
}

kiln_tensor *kiln__handle_new(kiln_ctx *ctx) {
  if (!ctx->handles && !handles_init(ctx)) return NULL;
  kiln__handles *h = ctx->handles;
  if (h->used + SLOT > h->committed) {
    /* the chunk before (if any) is full: retire it once its last generation is stale */
    if (h->committed > 0) {
      if (!KILN__GROW(h->pending_off, h->cap_off, h->npending + 1) ||
          !KILN__GROW(h->pending_gen, h->cap_gen, h->npending + 1)) {
        kiln__error(ctx, KILN_ERR_OOM, "kiln: out of host memory for tensor handles");
        return NULL;
      }
      h->pending_off[h->npending] = h->committed - CHUNK;
      h->pending_gen[h->npending++] = ctx->gen;
    }
    /* the next chunk, coming round to the start at the end of the range, past the chunks that
     * still hold live persistent handles */
    for (size_t tries = 0;; tries++) {
      if (h->committed + CHUNK > h->size) h->committed = 0;
      if (h->live[h->committed / CHUNK] == 0) break;
      if (tries > h->size / CHUNK) {
        kiln__error(ctx, KILN_ERR_OOM, "kiln: every chunk of tensor handles holds live tensors");
        return NULL;
      }
      h->committed += CHUNK;
    }
    void *p = mmap(h->base + h->committed, CHUNK, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
    if (p == MAP_FAILED) {
      kiln__error(ctx, KILN_ERR_OOM, "kiln: out of host memory for tensor handles");
      return NULL;
    }
    h->used = h->committed;
    h->committed += CHUNK;
  }
  kiln_tensor *t = (kiln_tensor *)(h->base + h->used);
  h->used += SLOT;
  memset(t, 0, sizeof *t);
  return t;
}

kiln_tensor *kiln__handle_new_persistent(kiln_ctx *ctx) {
  kiln_tensor *t = kiln__handle_new(ctx);
  if (t) ctx->handles->live[chunk_of(ctx->handles, t)]++;
  return t;
}

void kiln__handle_free_persistent(kiln_ctx *ctx, kiln_tensor *t) {
  kiln__handles *h = ctx->handles;
  KILN_ASSERT(h->live[chunk_of(h, t)] > 0);
  h->live[chunk_of(h, t)]--;
  memset(t, 0, sizeof *t);
  t->magic = KILN__TENSOR_DEAD;
  t->ctx = ctx;
  t->node = -1;
  t->persistent = true;
}

void kiln__handles_step(kiln_ctx *ctx) {
  kiln__handles *h = ctx->handles;
  if (!h) return;
  /* in order; a chunk that still holds a live persistent handle waits */
  int kept = 0;
  for (int k = 0; k < h->npending; k++) {
    if (h->pending_gen[k] < ctx->gen && h->live[h->pending_off[k] / CHUNK] == 0) {
      retire(h, h->pending_off[k]);
      continue;
    }
    h->pending_off[kept] = h->pending_off[k];
    h->pending_gen[kept++] = h->pending_gen[k];
  }
  h->npending = kept;
}

void kiln__handles_free(kiln_ctx *ctx) {
  kiln__handles *h = ctx->handles;
  if (!h) return;
  munmap(h->base, h->size);
  close(h->stale_fd);
  free(h->pending_off);
  free(h->pending_gen);
  free(h->live);
  free(h);
  ctx->handles = NULL;
}
