/*
 * trace.c: recording nodes into the context's trace (which is also the autograd tape). Running
 * them is the runtime's (runtime/context.c, kiln__flush).
 */
#include <string.h>

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
  n->fn = out ? out->fn : NULL;
  n->from = ctx->bw_from;
  if (out) {
    out->node = tr->n;
    out->requires_grad = rg && ctx->no_grad_depth == 0 && kiln__has_grad(op);
  }
  tr->n++;
  ctx->stats.nodes_recorded++;
  return n;
}

bool kiln__node_stores_into(const kiln__node *n, const kiln__storage *st) {
  for (int q = 0; q < n->nin; q++)
    if ((kiln__ops[n->op].stores & (1u << q)) && n->in[q]->st == st) return true;
  return false;
}

kiln_tensor *kiln__record_again(const kiln__node *n) { return kiln__record_again_with(n, n->in); }

kiln_tensor *kiln__record_again_with(const kiln__node *n, kiln_tensor *const *in) {
  const kiln__node src = *n; /* a copy: recording moves the trace when it grows */
  kiln_tensor *args[KILN__MAX_IN];
  memcpy(args, in, (size_t)src.nin * sizeof *args); /* in may be n's own, which may move too */
  kiln_ctx *ctx = src.out->ctx;
  kiln_tensor *y = kiln__tensor_intermediate(ctx, "kiln_backward", src.out->dtype, src.out->ndim,
                                             src.out->shape);
  kiln__node *r = y ? kiln__record(ctx, src.op, src.nin, args, y) : NULL;
  if (!r) return NULL;
  memcpy(r->i, src.i, sizeof r->i);
  memcpy(r->f, src.f, sizeof r->f);
  memcpy(r->u, src.u, sizeof r->u);
  return y;
}
