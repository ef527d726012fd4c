/*
 * trace.c: recording nodes into the context's trace (which is also the autograd tape) and
 * flushing it: the nodes not yet run are handed to fusion/'s engine (which, on a context without
 * a GPU, plans and compiles them without running anything).
 */
#include <string.h>

#include "../fusion/engine.h"
#include "internal.h"

kiln__node *kiln__record(kiln_ctx *ctx, kiln__op op, int nin, kiln_tensor *const *in,
                         kiln_tensor *out) {
  KILN_ASSERT(nin >= 0 && nin <= KILN__MAX_IN);
  kiln__trace *tr = &ctx->trace;
  if (!KILN__GROW(tr->nodes, tr->cap, tr->n + 1)) {
    kiln__error(ctx, KILN_ERR_OOM, "kiln: out of host memory for the trace (%d nodes)", tr->n);
    return NULL;
  }
  kiln__node *n = &tr->nodes[tr->n];
  memset(n, 0, sizeof *n);
  n->op = op;
  n->nin = nin;
  bool rg = false;
  for (int i = 0; i < nin; i++) {
    n->in[i] = in[i];
    rg = rg || in[i]->requires_grad;
  }
  n->out = out;
  if (out) {
    out->node = tr->n;
    out->requires_grad = rg && ctx->no_grad_depth == 0 && kiln__has_grad(op);
  }
  tr->n++;
  ctx->stats.nodes_recorded++;
  return n;
}

kiln_status kiln__flush(kiln_ctx *ctx) {
  if (!ctx) return KILN_ERR_INVALID;
  kiln__trace *tr = &ctx->trace;
  if (tr->done == tr->n) return ctx->status;
  if (!kiln__ok(ctx)) {
    /* a failed step runs nothing */
    tr->done = tr->n;
    return ctx->status;
  }
  /* without a GPU the engine plans and compiles the nodes and runs nothing */
  int32_t first = tr->done, last = tr->n;
  kiln_status s = kiln__engine_flush(ctx, first, last);
  tr->done = last;
  ctx->stats.flushes++;
  return s;
}
