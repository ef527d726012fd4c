/*
 * lower.c: lowering, between the planner and the renderer. Each group of a plan becomes a spec:
 * the elementwise program, reduction, row program, multi-tensor update or row gather the
 * renderer turns into a kernel, or the product the BLAS backend runs. A concat is lowered here
 * into one copy per input, each writing the input into its slice of the output: the copy node
 * and the slice view belong to the spec, and no later stage makes stand-ins of its own.
 */
#include <stdlib.h>
#include <string.h>

#include "fusion.h"

/* "// trace nodes: #12 add [128,512] f32, #13 relu ..." for a group's source. */
static void describe(const kiln_ctx *ctx, const kiln__plan *p, const kiln__group *g, char *buf,
                     size_t len) {
  size_t k = (size_t)snprintf(buf, len, "// trace nodes:");
  int n = g->n ? g->n : 1;
  for (int m = 0; m < n && k < len; m++) {
    int32_t i = g->n ? p->members[g->first + m] : g->node;
    const kiln__node *nd = &ctx->trace.nodes[i];
    const kiln_tensor *t = nd->out ? nd->out : nd->in[0];
    char sh[96];
    k += (size_t)snprintf(buf + k, len - k, "%s #%d %s %s %s%s", m ? "," : "", i,
                          kiln__ops[nd->op].name, kiln__shape_of(t, sh, sizeof sh),
                          kiln_dtype_name(t->dtype),
                          nd->out && !p->store[i - p->first] ? " (in registers)" : "");
  }
  if (k < len) snprintf(buf + k, len - k, "\n");
}

/* The elementwise program of a group's members [from, to), over the first one's space. */
static void prog_of(const kiln_ctx *ctx, const kiln__plan *p, const kiln__group *g, int from,
                    int to, kiln__ew_prog *prog) {
  memset(prog, 0, sizeof *prog);
  for (int m = from; m < to; m++) {
    int32_t i = p->members[g->first + m];
    prog->nodes[prog->n] = &ctx->trace.nodes[i];
    prog->store[prog->n] = p->store[i - p->first];
    prog->n++;
  }
  if (prog->n == 0) return;
  const kiln__node *n0 = prog->nodes[0];
  const kiln_tensor *space = n0->out ? n0->out : n0->in[0];
  prog->ndim = space->ndim;
  prog->shape = space->shape;
}

/* Input g->sub of a concat copied into its slice of the output. */
static void lower_concat(const kiln_ctx *ctx, const kiln__group *g, kiln__spec *s) {
  const kiln__node *n = &ctx->trace.nodes[g->node];
  int axis = (int)KILN__I(n, CONCAT, axis);
  int64_t start = 0;
  for (int q = 0; q < g->sub; q++)
    start += n->in[q]->shape[axis];
  s->slice = *n->out;
  memcpy(s->slice.shape, n->in[g->sub]->shape, sizeof s->slice.shape);
  s->slice.offset = n->out->offset + start * n->out->stride[axis];
  memset(&s->copy, 0, sizeof s->copy);
  s->copy.op = KILN__OP_COPY;
  s->copy.nin = 1;
  s->copy.in[0] = n->in[g->sub];
  s->copy.out = &s->slice;
  s->kind = KILN__SPEC_EW;
  s->prog = (kiln__ew_prog){
      .n = 1, .nodes = {&s->copy}, .store = {true}, .ndim = s->slice.ndim, .shape = s->slice.shape};
}

/* Whether a lone cast runs in the multi-tensor form (KILN_CAST_TILES, on): one from a permutation
 * of dense blocks (render_ew.c's kiln__permuted_blocks: a weight's gradient cast back to the
 * weight's layout), which that form takes through shared memory. */
static bool tiled_cast(const kiln_ctx *ctx, const kiln__group *g, const kiln__node *n) {
  int64_t block;
  return ctx->cast_tiles && g->n == 1 && n->op == KILN__OP_CAST && kiln__is_contiguous(n->out) &&
         kiln__is_float(n->in[0]->dtype) && kiln__is_float(n->out->dtype) &&
         kiln__same_shape(n->in[0], n->out) && kiln__permuted_blocks(n->in[0], &block);
}

/* Whether a lone update runs in the multi-tensor form: one with a one-value input (a flag, a
 * factor, a count) over dense tensors, which that form reads once (the elementwise form would
 * broadcast it), and where found_inf stores its flag only where it changes. */
static bool multi_form(const kiln__node *n) {
  if (!kiln__update_scalars(n->op)) return false;
  for (int q = 0; q < n->nin; q++)
    if (!kiln__is_contiguous(n->in[q])) return false;
  return true;
}

static void lower_group(const kiln_ctx *ctx, const kiln__plan *p, const kiln__group *g,
                        kiln__spec *s) {
  const kiln__node *n = &ctx->trace.nodes[g->node];
  describe(ctx, p, g, s->comment, sizeof s->comment);
  switch (kiln__ops[n->op].renderer) { /* the op table's kernel family of the group's main node */
  case KILN__RENDER_EW:
    if (g->batch || tiled_cast(ctx, g, n)) { /* casts over shapes of their own */
      s->kind = KILN__SPEC_CASTS;
      s->nups = g->n;
      for (int m = 0; m < g->n; m++)
        s->ups[m] = &ctx->trace.nodes[p->members[g->first + m]];
      return;
    }
    if (g->kind == KILN__KIND_UPDATE && (g->n > 1 || multi_form(n))) {
      s->kind = KILN__SPEC_UPDATES;
      s->nups = g->n;
      for (int m = 0; m < g->n; m++)
        s->ups[m] = &ctx->trace.nodes[p->members[g->first + m]];
      return;
    }
    s->kind = KILN__SPEC_EW;
    prog_of(ctx, p, g, 0, g->n, &s->prog);
    return;
  case KILN__RENDER_REDUCE:
    if (g->rows) {
      s->kind = KILN__SPEC_ROWS;
      prog_of(ctx, p, g, 0, g->n, &s->prog);
      s->prog.nalias = g->nalias;
      s->prog.alias = g->nalias ? &p->alias[g->alias_first] : NULL;
      s->full = g->full;
      return;
    }
    s->kind = KILN__SPEC_REDUCE;
    prog_of(ctx, p, g, 0, g->n - 1, &s->prog);
    s->red = n;
    return;
  case KILN__RENDER_BLAS:
    if (g->implicit) { /* a forward product or weight gradient gathering from the image */
      s->kind = KILN__SPEC_CONV;
      s->conv = g->implicit;
      s->red = &ctx->trace.nodes[g->window];
      s->gemm = (kiln__gemm){.a = n->in[0], .b = n->in[1], .d = n->out};
      prog_of(ctx, p, g, 0, g->prologue, &s->pro); /* a WGRAD's dY computed as it is loaded */
      s->grad = g->grad;
      if (g->implicit == KILN__IMPLICIT_FPROP) /* its epilogue, then batch norm's statistics */
        prog_of(ctx, p, g, 2, g->n - g->moments, &s->prog);
      s->moments = g->moments ? &ctx->trace.nodes[p->members[g->first + g->n - 1]] : NULL;
      return;
    }
    s->kind = KILN__SPEC_BLAS;
    s->gemm = (kiln__gemm){
        .a = n->in[0], .b = n->in[1], .d = g->out, .epi = g->epi, .bias = g->bias, .aux = g->aux};
    return;
  case KILN__RENDER_GATHER:
    s->kind = KILN__SPEC_GATHER;
    s->red = n;
    return;
  case KILN__RENDER_MOMENTS: /* batch norm's sums */
    s->kind = KILN__SPEC_MOMENTS;
    s->red = n;
    return;
  case KILN__RENDER_AUGMENT:
    s->kind = KILN__SPEC_AUGMENT;
    s->red = n;
    return;
  case KILN__RENDER_CUSTOM:
    s->kind = KILN__SPEC_CUSTOM;
    s->red = n;
    return;
  case KILN__RENDER_WINDOW: /* a window op and its elementwise epilogue */
    s->kind = KILN__SPEC_WINDOW;
    s->red = n;
    /* batch norm's sums (its last member) are no part of the epilogue's program, the run that
     * computes the op's input (its first members) is the prologue's */
    prog_of(ctx, p, g, g->implicit == KILN__IMPLICIT_DGRAD ? 1 : g->prologue, g->n - g->moments,
            &s->prog);
    prog_of(ctx, p, g, 0, g->prologue, &s->pro);
    s->moments = g->moments ? &ctx->trace.nodes[p->members[g->first + g->n - 1]] : NULL;
    if (g->implicit == KILN__IMPLICIT_DGRAD) { /* col2im of dY Wk, the product in the same kernel */
      const kiln__node *mm = &ctx->trace.nodes[p->members[g->first]];
      s->kind = KILN__SPEC_CONV;
      s->conv = KILN__IMPLICIT_DGRAD;
      s->wgmma = g->wgmma;
      s->gemm = (kiln__gemm){.a = mm->in[0], .b = mm->in[1], .d = mm->out};
    }
    return;
  case KILN__RENDER_COPY: lower_concat(ctx, g, s); return;
  case KILN__RENDER_NONE: break;
  }
  KILN_ASSERT(!"a group of views, or an op the op table gives no kernel family");
}

bool kiln__lower(kiln_ctx *ctx, const kiln__plan *p, kiln__spec **specs) {
  *specs = calloc((size_t)(p->ng > 0 ? p->ng : 1), sizeof **specs);
  if (!*specs) return !kiln__error(ctx, KILN_ERR_OOM, "kiln_flush: out of host memory lowering");
  for (int k = 0; k < p->ng; k++)
    lower_group(ctx, p, &p->g[k], &(*specs)[k]);
  return true;
}
