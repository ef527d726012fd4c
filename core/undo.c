/*
 * undo.c: a failed step leaves nothing behind, host state included. While a step is open, code
 * that changes host state which the step's success would justify (an optimizer's step counts, a
 * parameter's "has a gradient" flag) logs how to undo it; the context's RNG state is saved when
 * the step begins. kiln_step_end undoes the log when the step failed (in recording or in
 * running) and drops it when the step succeeded.
 */
#include <stdlib.h>
#include <string.h>

#include "internal.h"

struct kiln__undo_entry {
  kiln__undo_fn fn;
  void *obj;
  void *saved; /* malloc'd, owned by the log */
};

bool kiln__undo_push(kiln_ctx *ctx, kiln__undo_fn fn, void *obj, void *saved, uint64_t *mark) {
  if (!ctx->in_step) { /* outside a step nothing is undone: the change stands */
    free(saved);
    return true;
  }
  if (!KILN__GROW(ctx->undo, ctx->cap_undo, ctx->nundo + 1)) {
    free(saved);
    return !kiln__error(ctx, KILN_ERR_OOM, "kiln: out of host memory for the step's undo log");
  }
  ctx->undo[ctx->nundo++] = (kiln__undo_entry){.fn = fn, .obj = obj, .saved = saved};
  *mark = ctx->undo_epoch;
  return true;
}

bool kiln__undo_logged(const kiln_ctx *ctx, const uint64_t *mark) {
  return ctx->in_step && *mark == ctx->undo_epoch;
}

void kiln__undo_forget(kiln_ctx *ctx, const void *obj) {
  int k = 0;
  for (int i = 0; i < ctx->nundo; i++) {
    if (ctx->undo[i].obj == obj)
      free(ctx->undo[i].saved);
    else
      ctx->undo[k++] = ctx->undo[i];
  }
  ctx->nundo = k;
}

void kiln__undo_begin(kiln_ctx *ctx) {
  kiln__undo_commit(ctx);
  ctx->undo_epoch++; /* from 1: no object is logged yet */
  ctx->undo_philox = ctx->philox_offset;
  ctx->undo_host_rng = ctx->host_rng;
}

void kiln__undo_commit(kiln_ctx *ctx) {
  for (int i = 0; i < ctx->nundo; i++)
    free(ctx->undo[i].saved);
  ctx->nundo = 0;
}

void kiln__undo_rollback(kiln_ctx *ctx) {
  for (int i = ctx->nundo - 1; i >= 0; i--)
    ctx->undo[i].fn(ctx->undo[i].obj, ctx->undo[i].saved);
  kiln__undo_commit(ctx);
  ctx->philox_offset = ctx->undo_philox;
  ctx->host_rng = ctx->undo_host_rng;
}

void kiln__undo_free(kiln_ctx *ctx) {
  kiln__undo_commit(ctx);
  free(ctx->undo);
  ctx->undo = NULL;
  ctx->cap_undo = 0;
}
