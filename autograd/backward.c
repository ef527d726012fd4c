/*
 * backward.c: kiln_backward reads the trace backwards from the loss and records the gradient of
 * every node that needs one, with the same op functions as the forward pass. Leaf gradients
 * (persistent tensors with requires_grad) are written into their .grad buffers at the end, by
 * one recorded assign or accumulate per leaf. Each node's rule comes from the table of rules by
 * op below.
 */
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "rules.h"

/* Every op's rule, by op, from its ops.def row (kiln__grad_NONE where the op has no gradient:
 * kiln__has_grad). The columns after the rule are not read. */
static const kiln__grad_fn grad_rules[KILN__OP_COUNT] = {
#define X(id, name, nin, kind, renderer, space, expr, stores, grad, ...)                           \
  [KILN__OP_##id] = kiln__grad_##grad,
#include "../core/ops.def"
#undef X
};

struct kiln__bw {
  kiln_ctx *ctx;
  kiln_tensor **leaves;
  int nleaves, cap;
};

static bool add_grad(kiln__bw *b, kiln_tensor *t, kiln_tensor *g) {
  if (!g) return false;
  if (!t->bw_acc) {
    t->bw_acc = g;
    if (t->persistent) {
      if (!KILN__GROW(b->leaves, b->cap, b->nleaves + 1)) {
        kiln__error(b->ctx, KILN_ERR_OOM, "kiln_backward: out of host memory");
        return false;
      }
      b->leaves[b->nleaves++] = t;
    }
    return true;
  }
  t->bw_acc = kiln_add(t->bw_acc, g);
  return t->bw_acc != NULL;
}

static bool write_leaf(kiln__bw *b, kiln_tensor *t) {
  kiln_ctx *ctx = b->ctx;
  kiln_tensor *g = t->bw_acc;
  t->bw_acc = NULL;
  if (!t->grad) {
    t->grad = kiln__tensor_persistent(ctx, KILN_DTYPE_F32, t->ndim, t->shape, false);
    if (!t->grad) return false;
    /* owned by t, not by the context's list */
    KILN_ASSERT(ctx->persistents[ctx->npersistent - 1] == t->grad);
    ctx->npersistent--;
    size_t n = strlen(kiln__name(t)) + 8;
    char *name = malloc(n);
    if (!name) return !kiln__error(ctx, KILN_ERR_OOM, "kiln_backward: out of host memory");
    snprintf(name, n, "%s.grad", kiln__name(t));
    kiln_tensor_set_name(t->grad, name);
    free(name);
    t->grad_valid = false;
  }
  if (g->ndim != t->ndim) g = kiln_reshape(g, kiln_tensor_shape(t));
  kiln_tensor *in[2] = {t->grad, g};
  kiln__node *n =
      kiln__update(t->grad_valid ? KILN__OP_ACCUM : KILN__OP_ASSIGN, "kiln_backward", 2, in);
  if (!n || !kiln__undo_grad_flag(t)) return false;
  t->grad_valid = true;
  return true;
}

kiln_status kiln_backward(kiln_tensor *loss) {
  kiln_ctx *ctx = kiln_tensor_ctx(loss);
  if (!ctx) return KILN_ERR_INVALID;
  if (!kiln__ok(ctx)) return ctx->status;
  if (!kiln__check(ctx, loss, __func__)) return ctx->status;
  char sh[96];
  if (kiln_tensor_numel(loss) != 1 || loss->dtype != KILN_DTYPE_F32)
    return kiln__error(ctx, KILN_ERR_SHAPE,
                       "kiln_backward: the loss must be one f32 element, got "
                       "%s %s",
                       kiln__shape_of(loss, sh, sizeof sh), kiln_dtype_name(loss->dtype));
  if (!loss->requires_grad || loss->node < 0)
    return kiln__error(ctx, KILN_ERR_STATE,
                       "kiln_backward: the loss does not require grad (no tensor with "
                       "requires_grad reaches it, or it was computed under no-grad)");
  /* PyTorch frees the graph after backward and raises on a second one (unless retain_graph):
   * here the tape stays, and a second walk from the same value would add its gradients twice */
  if (ctx->trace.nodes[loss->node].bw == 2)
    return kiln__error(ctx, KILN_ERR_STATE,
                       "kiln_backward: node #%d (%s), the loss, was already backpropagated "
                       "through by an earlier kiln_backward of this step: its gradients would be "
                       "added twice (backpropagate the sum of the losses once, or each loss once)",
                       loss->node, kiln__ops[ctx->trace.nodes[loss->node].op].name);
  kiln__bw b = {.ctx = ctx};
  int32_t top = loss->node;
  kiln_no_grad_begin(ctx);
  loss->bw_acc = kiln_full(ctx, kiln_tensor_shape(loss), 1.f);
  for (int32_t i = top; i >= 0 && kiln__ok(ctx); i--) {
    /* nodes recorded by this walk land after loss->node, so indices below it stay put */
    kiln__node *n = &ctx->trace.nodes[i];
    kiln_tensor *out = n->out;
    if (!out || !out->bw_acc) continue;
    if (n->bw == 0) n->bw = 1;
    kiln_tensor *g = out->bw_acc;
    out->bw_acc = NULL;
    if (!out->requires_grad) continue;
    if (n->gone) {
      kiln__error(ctx, KILN_ERR_STATE,
                  "kiln_backward: node #%d (%s) reads a persistent tensor that was freed after it "
                  "was recorded",
                  i, kiln__ops[n->op].name);
      break;
    }
    kiln_tensor *gin[KILN__MAX_IN] = {0};
    kiln__node copy = *n; /* the trace may move when it grows */
    ctx->bw_from = i; /* the nodes the rule records say whose gradient they are (anomaly mode) */
    grad_rules[copy.op](&b, &copy, g, gin);
    for (int k = 0; k < copy.nin; k++) {
      if (!gin[k] || !copy.in[k]->requires_grad) continue;
      /* a gradient has its value's dtype: an op that promoted a bf16 input to f32 hands back an
       * f32 gradient, cast here (the cast fuses into the kernel that computes it) */
      kiln_tensor *gk =
          gin[k]->dtype == copy.in[k]->dtype ? gin[k] : kiln_cast(gin[k], copy.in[k]->dtype);
      add_grad(&b, copy.in[k], gk);
    }
    ctx->bw_from = -1;
  }
  /* the leaves whose gradients are dense first, one after another, so that their assignments
   * run as multi-tensor launches (the planner batches consecutive updates; under autocast a
   * convolution weight's too, whose cast writes it); then the others (an f32 convolution weight's,
   * a permuted view, each copied by a kernel of its own) */
  for (int pass = 0; pass < 2; pass++)
    for (int k = 0; k < b.nleaves && kiln__ok(ctx); k++)
      if (b.leaves[k]->bw_acc && kiln__is_contiguous(b.leaves[k]->bw_acc) == (pass == 0))
        write_leaf(&b, b.leaves[k]);
  for (int k = 0; k < b.nleaves; k++)
    b.leaves[k]->bw_acc = NULL;
  /* the nodes this walk reached are marked only when it succeeded: a failed call changes
   * nothing (it may have stopped early: stale accumulators of intermediates are dropped too) */
  bool ok = kiln__ok(ctx);
  for (int32_t i = 0; i <= top; i++) {
    kiln__node *n = &ctx->trace.nodes[i];
    if (n->bw == 1) n->bw = ok ? 2 : 0;
    if (n->out) n->out->bw_acc = NULL;
  }
  kiln_no_grad_end(ctx);
  free(b.leaves);
  return ctx->status;
}
