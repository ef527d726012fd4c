/*
 * verify.c: what a plan must satisfy, checked after planning by tests (KILN_DEBUG=verify) and in
 * debug builds, and the one-line description of a plan that KILN_DEBUG=plan prints and tests
 * compare.
 */
#include <stdarg.h>
#include <string.h>

#include "fusion.h"

void kiln__plan_describe(const kiln_ctx *ctx, const kiln__plan *p, kiln__sb *out) {
  for (int i = 0; i < p->ng; i++) {
    const kiln__group *g = &p->g[i];
    kiln__sb_printf(out, "%s", i ? " | " : "");
    if (g->n == 0) /* a concat copy */
      kiln__sb_printf(out, "%s", kiln__ops[ctx->trace.nodes[g->node].op].name);
    for (int m = 0; m < g->n; m++) {
      int32_t j = p->members[g->first + m];
      const kiln__node *nd = &ctx->trace.nodes[j];
      kiln__sb_printf(out, "%s%s%s", m ? " " : "", kiln__ops[nd->op].name,
                      nd->out && !p->store[j - p->first] ? "*" : "");
    }
    if (g->epi != KILN__EPI_NONE) kiln__sb_printf(out, " [%s]", kiln__epi_name(g->epi));
    if (g->batch) kiln__sb_printf(out, " [multi-tensor]");
    if (g->implicit == KILN__IMPLICIT_FPROP || g->implicit == KILN__IMPLICIT_WGRAD)
      kiln__sb_printf(out, " [implicit %s]",
                      g->implicit == KILN__IMPLICIT_FPROP ? "fprop" : "wgrad");
    bool again = false; /* a forward value recorded again by the backward pass, not kept */
    for (int m = 0; m < g->n; m++) {
      const kiln__node *nd = &ctx->trace.nodes[p->members[g->first + m]];
      again =
          again || (nd->from >= 0 && (nd->op == KILN__OP_BN_APPLY || nd->op == KILN__OP_IM2COL));
    }
    if (again) kiln__sb_printf(out, " [recomputed]");
  }
  if (!out->s) kiln__sb_printf(out, "%s", "");
}

/* Writes the violation and returns why. */
static const char *bad(char *why, size_t n, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static const char *bad(char *why, size_t n, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(why, n, fmt, ap);
  va_end(ap);
  return why;
}

/* The node of the flush that owns t's memory (through views), or -1. */
static int32_t owner(const kiln_ctx *ctx, const kiln__plan *p, const kiln_tensor *t) {
  for (;;) {
    int32_t i = t->node;
    if (t->persistent || i < p->first || i >= p->last || ctx->trace.nodes[i].out != t) return -1;
    const kiln__node *n = &ctx->trace.nodes[i];
    if (kiln__ops[n->op].kind != KILN__KIND_VIEW) return i;
    t = n->in[0];
  }
}

static int32_t direct_producer(const kiln_ctx *ctx, const kiln__plan *p, const kiln_tensor *t) {
  int32_t i = t->node;
  if (t->persistent || i < p->first || i >= p->last || ctx->trace.nodes[i].out != t) return -1;
  return i;
}

/* Operands and attribute slots of a generated kernel for group g, as the renderer will need. */
static const char *check_resources(const kiln_ctx *ctx, const kiln__plan *p, int k, char *why,
                                   size_t n) {
  const kiln__group *g = &p->g[k];
  if (g->n > KILN__MAX_GROUP) return bad(why, n, "group %d has %d nodes", k, g->n);
  const kiln_tensor *seen[KILN__MAX_GROUP * (KILN__MAX_IN + 1)];
  int ops = 0, nf = 0, ni = 0, nu = 0;
  for (int m = 0; m < g->n; m++) {
    const kiln__node *x = &ctx->trace.nodes[p->members[g->first + m]];
    int f, i, u;
    kiln__kernel_slots(x->op, &f, &i, &u);
    nf += f, ni += i, nu += u;
    if (x->out && p->store[p->members[g->first + m] - p->first]) seen[ops++] = x->out;
    for (int j = 0; j < x->nin; j++) {
      int32_t pr = direct_producer(ctx, p, x->in[j]);
      if (pr >= 0 && p->group_of[pr - p->first] == k) continue;
      bool dup = false;
      for (int q = 0; q < ops && !dup; q++)
        dup = seen[q] == x->in[j];
      if (!dup) seen[ops++] = x->in[j];
    }
  }
  if (ops > KILN__KMAX_PTR || nf > KILN__KMAX_F || ni > KILN__KMAX_I || nu > KILN__KMAX_U)
    return bad(why, n, "group %d: %d operands, %d/%d/%d attributes exceed the kernel argument", k,
               ops, nf, ni, nu);
  return NULL;
}

static const char *check_group(const kiln_ctx *ctx, const kiln__plan *p, int k, char *why,
                               size_t n) {
  const kiln__group *g = &p->g[k];
  const kiln__node *nodes = ctx->trace.nodes;
  if (g->n == 0) {
    /* a concat's copies: consecutive groups, one per input in order, the node recorded in the
     * last (the memory plan takes the first as where the output is defined) */
    const kiln__node *c = &nodes[g->node];
    if (g->kind != KILN__KIND_LIB || c->op != KILN__OP_CONCAT || g->sub >= c->nin ||
        k - g->sub < 0 || k - g->sub + c->nin > p->ng ||
        p->group_of[g->node - p->first] != k - g->sub + c->nin - 1)
      return bad(why, n, "group %d has no members and is no concat copy in its place", k);
    for (int q = 0; q < c->nin; q++) {
      const kiln__group *o = &p->g[k - g->sub + q];
      if (o->node != g->node || o->sub != q || o->n != 0)
        return bad(why, n, "concat #%d's copies are not consecutive groups", g->node);
    }
    return NULL;
  }
  for (int m = 0; m < g->n; m++) {
    int32_t i = p->members[g->first + m];
    if (i < p->first || i >= p->last)
      return bad(why, n, "group %d: node #%d outside the flush", k, i);
    /* in trace order; a product's bias gradient (BGRADB) may have been recorded before it */
    bool claimed = g->kind == KILN__KIND_MATMUL && p->claim[i - p->first] == g->node;
    if (m > 0 && i <= p->members[g->first + m - 1] && !claimed)
      return bad(why, n, "group %d: members out of trace order at #%d", k, i);
    if (p->group_of[i - p->first] != k)
      return bad(why, n, "group %d: member #%d is recorded in group %d", k, i,
                 p->group_of[i - p->first]);
  }
  const kiln__node *first = &nodes[p->members[g->first]];
  switch (g->kind) {
  case KILN__KIND_EW:
    if (g->batch) { /* casts of parameters, each over its own shape, all at the first's place */
      if (g->n < 2 || g->n > KILN__MAX_CASTS)
        return bad(why, n, "multi-tensor cast %d of %d casts", k, g->n);
      for (int m = 0; m < g->n; m++) {
        int32_t i = p->members[g->first + m];
        const kiln_tensor *root = kiln__param_root(ctx, p, nodes[i].in[0]);
        if (nodes[i].op != KILN__OP_CAST || !root)
          return bad(why, n, "multi-tensor cast %d holds #%d (%s), no cast of a parameter", k, i,
                     kiln__ops[nodes[i].op].name);
        for (int32_t j = p->members[g->first]; j < i; j++)
          if (kiln__writes_storage(ctx, p, j, root->st))
            return bad(why, n, "multi-tensor cast %d reads #%d's parameter before #%d writes it", k,
                       i, j);
      }
      break;
    }
    for (int m = 0; m < g->n; m++) {
      const kiln__node *x = &nodes[p->members[g->first + m]];
      if (kiln__ops[x->op].kind != KILN__KIND_EW || !kiln__same_shape(x->out, first->out))
        return bad(why, n, "elementwise group %d: #%d (%s) is not elementwise over its space", k,
                   p->members[g->first + m], kiln__ops[x->op].name);
    }
    break;
  case KILN__KIND_REDUCE:
    if (kiln__ops[nodes[g->node].op].kind != KILN__KIND_REDUCE)
      return bad(why, n, "reduction group %d: main node #%d is no reduction", k, g->node);
    if (!g->rows) {
      if (p->members[g->first + g->n - 1] != g->node)
        return bad(why, n, "reduction group %d: the reduction is not its last node", k);
      for (int m = 0; m + 1 < g->n; m++)
        if (kiln__ops[nodes[p->members[g->first + m]].op].kind != KILN__KIND_EW)
          return bad(why, n, "reduction group %d: its prologue holds a non-elementwise node", k);
    } else if (!g->full) {
      return bad(why, n, "row program %d has no iteration space", k);
    }
    break;
  case KILN__KIND_UPDATE:
    for (int m = 0; m < g->n; m++)
      if (nodes[p->members[g->first + m]].op != first->op)
        return bad(why, n, "update group %d mixes ops", k);
    if (g->n * first->nin > KILN__KMAX_UPDATE)
      return bad(why, n, "update group %d: %d pointers", k, g->n * first->nin);
    break;
  case KILN__KIND_MATMUL: {
    unsigned f = kiln__epi_flags(g->epi);
    if (first->op != KILN__OP_MATMUL || g->node != p->members[g->first] || !g->out)
      return bad(why, n, "product group %d does not start with its product", k);
    if (((f & (KILN__EPI_READS_BIAS | KILN__EPI_BGRAD)) != 0) != (g->bias != NULL))
      return bad(why, n, "product group %d: epilogue %s and its bias disagree", k,
                 kiln__epi_name(g->epi));
    if (((f & (KILN__EPI_WRITES_MASK | KILN__EPI_READS_MASK | KILN__EPI_WRITES_INPUT |
               KILN__EPI_READS_INPUT)) != 0) != (g->aux != NULL))
      return bad(why, n, "product group %d: epilogue %s and its aux disagree", k,
                 kiln__epi_name(g->epi));
    break;
  }
  case KILN__KIND_LIB: {
    const kiln__node *win = g->implicit == KILN__IMPLICIT_DGRAD ? &nodes[g->node]
                            : g->implicit != KILN__IMPLICIT_NONE && g->window >= 0
                                ? &nodes[g->window]
                                : NULL;
    if (win && kiln__columns_padded(win))
      return bad(why, n, "group %d: an implicit convolution product over padded columns", k);
    if (g->implicit == KILN__IMPLICIT_FPROP || g->implicit == KILN__IMPLICIT_WGRAD) {
      /* im2col (not written) and the forward product it feeds, or a weight gradient alone */
      bool fprop = g->implicit == KILN__IMPLICIT_FPROP, into = g->grad != NULL;
      int pro = g->prologue; /* a weight gradient's dY computed by the run before it */
      int32_t c = g->window, mm = p->members[g->first + (fprop ? 1 : pro)];
      /* a forward product may have a unary epilogue after it (a direct one's), not written, or
       * batch norm's statistics of its result, written (kiln__fprop_moments) */
      int32_t last = p->members[g->first + g->n - 1];
      if (g->moments && (!fprop || g->n != 3 || nodes[last].op != KILN__OP_MOMENTS ||
                         !p->store[last - p->first] || owner(ctx, p, nodes[last].in[0]) != mm))
        return bad(why, n, "group %d: batch norm statistics that are not its product's", k);
      bool epi = fprop && g->n - g->moments > 2;
      if ((fprop && pro) || (pro && into) || (fprop ? g->n < 2 : g->n != pro + (into ? 3 : 1)) ||
          mm != g->node || nodes[mm].op != KILN__OP_MATMUL || c < p->first || c >= mm ||
          nodes[c].op != KILN__OP_IM2COL ||
          (fprop && (into || p->members[g->first] != c || p->claim[c - p->first] != mm)) ||
          p->store[c - p->first] || p->store[mm - p->first] == (into || epi) ||
          owner(ctx, p, nodes[mm].in[fprop ? 0 : 1]) != c)
        return bad(why, n, "group %d: an implicit convolution product that is not im2col's", k);
      for (int m = 2; epi && m < g->n - g->moments; m++) {
        int32_t e = p->members[g->first + m];
        /* or a max pool, alone (kiln__conv_pool's) */
        bool pool = nodes[e].op == KILN__OP_MAX_POOL && g->n == 3;
        if ((kiln__ops[nodes[e].op].kind != KILN__KIND_EW && !pool) || nodes[e].nin != 1 ||
            owner(ctx, p, nodes[e].in[0]) != p->members[g->first + m - 1] ||
            p->store[e - p->first] != (m == g->n - 1))
          return bad(why, n, "group %d: #%d (%s) is no unary epilogue of its product", k, e,
                     kiln__ops[nodes[e].op].name);
      }
      for (int m = 0; m < pro; m++) {
        int32_t j = p->members[g->first + m];
        if (kiln__ops[nodes[j].op].kind != KILN__KIND_EW || p->store[j - p->first] ||
            kiln_tensor_numel(nodes[j].out) != kiln_tensor_numel(nodes[mm].in[0]) ||
            (m == pro - 1 && owner(ctx, p, nodes[mm].in[0]) != j))
          return bad(why, n, "group %d: prologue node #%d (%s) is not dY's, or is written", k, j,
                     kiln__ops[nodes[j].op].name);
      }
      /* a weight gradient that writes the weight's f32 gradient: its cast and assignment */
      int32_t cv = into ? p->members[g->first + 1] : -1, a = into ? p->members[g->first + 2] : -1;
      if (into && (nodes[cv].op != KILN__OP_CAST || nodes[a].op != KILN__OP_ASSIGN ||
                   nodes[a].in[0] != g->grad || p->store[cv - p->first] ||
                   p->write_to[cv - p->first] || p->claim[a - p->first] >= 0 ||
                   owner(ctx, p, nodes[a].in[1]) != cv || owner(ctx, p, nodes[cv].in[0]) != mm))
        return bad(why, n,
                   "group %d: a weight gradient writing .grad without its cast and assignment", k);
      if (into) { /* the weight's gradient, (CO, CI, KH, KW), unread before the assignment */
        kiln__win w = kiln__win_of(&nodes[c]);
        const int64_t want[4] = {nodes[mm].out->shape[0], nodes[c].in[0]->shape[3], w.kh, w.kw};
        for (int d = 0; d < 4; d++)
          if (g->grad->ndim != 4 || g->grad->shape[d] != want[d])
            return bad(why, n, "group %d: a weight gradient writing .grad of another shape", k);
        for (int32_t j = p->first; j < a; j++)
          for (int q = 0; q < nodes[j].nin; q++)
            if (nodes[j].in[q]->st == g->grad->st && kiln__ops[nodes[j].op].kind != KILN__KIND_VIEW)
              return bad(why, n,
                         "group %d writes .grad, which #%d (%s) reads before its assignment", k, j,
                         kiln__ops[nodes[j].op].name);
      }
      break;
    }
    /* an implicit product first: col2im's, which it claims */
    int h = g->implicit == KILN__IMPLICIT_DGRAD ? 1 : 0;
    const kiln__node *head = &nodes[g->node];
    if (g->prologue) { /* a pool gradient or pool last, the run computing its dy or image first */
      if (h || g->moments ||
          (head->op != KILN__OP_MAX_POOL_GRAD && head->op != KILN__OP_MAX_POOL) ||
          g->n != g->prologue + 1 || p->members[g->first + g->prologue] != g->node ||
          nodes[p->members[g->first + g->prologue - 1]].out != head->in[0])
        return bad(why, n,
                   "group %d: a prologue that is not its max pool's or pool gradient's input", k);
      for (int m = 0; m < g->prologue; m++) {
        int32_t j = p->members[g->first + m];
        if (kiln__ops[nodes[j].op].kind != KILN__KIND_EW ||
            !kiln__same_shape(nodes[j].out, head->in[0]) || p->store[j - p->first])
          return bad(why, n, "group %d: prologue node #%d (%s) is not the input's, or is written",
                     k, j, kiln__ops[nodes[j].op].name);
      }
      break;
    }
    if (h && (g->n < 2 || first->op != KILN__OP_MATMUL || head->op != KILN__OP_COL2IM ||
              p->members[g->first + 1] != g->node ||
              p->claim[p->members[g->first] - p->first] != g->node ||
              p->store[p->members[g->first] - p->first]))
      return bad(why, n, "group %d: an implicit product that is not col2im's, or is written", k);
    /* batch norm's sums last: a data gradient's with an epilogue, a max pool's alone, or a
     * col2im's or a pool gradient's with an epilogue */
    bool sums_of =
        h ? g->wgmma && g->n >= 4
          : (g->n == 2 && head->op == KILN__OP_MAX_POOL) ||
                (g->n >= 3 && (head->op == KILN__OP_COL2IM || head->op == KILN__OP_MAX_POOL_GRAD));
    if (g->moments && (!sums_of || nodes[p->members[g->first + g->n - 1]].op != KILN__OP_MOMENTS ||
                       !p->store[p->members[g->first + g->n - 1] - p->first]))
      return bad(why, n,
                 "group %d: batch norm sums that are not a data gradient's, a max pool's, a "
                 "col2im's or a pool gradient's, or unwritten",
                 k);
    for (int m = h + 1; m < g->n - g->moments; m++) { /* a window op's elementwise epilogue */
      const kiln__node *x = &nodes[p->members[g->first + m]];
      if (!kiln__takes_epilogue(head->op) || kiln__ops[x->op].kind != KILN__KIND_EW ||
          !kiln__same_shape(x->out, head->out))
        return bad(why, n, "group %d: a library call of %d nodes (#%d %s)", k, g->n,
                   p->members[g->first + m], kiln__ops[x->op].name);
    }
    break;
  }
  case KILN__KIND_VIEW:
    if (g->n != 1) return bad(why, n, "group %d: a library call of %d nodes", k, g->n);
    break;
  }
  for (int a = 0; a < g->nalias; a++) {
    const kiln__alias *al = &p->alias[g->alias_first + a];
    int32_t pv = direct_producer(ctx, p, al->value);
    if (!g->rows || pv < 0 || p->group_of[pv - p->first] != k)
      return bad(why, n, "group %d: an alias of a value it does not compute", k);
  }
  if (g->kind == KILN__KIND_EW || g->kind == KILN__KIND_REDUCE ||
      (g->kind == KILN__KIND_LIB && g->n > 1))
    return check_resources(ctx, p, k, why, n);
  return NULL;
}

/* Whether view node v is how product group gi's epilogue reads its own value (a bias add's
 * output reshaped into the image its ReLU or GELU reads, an implicit product's columns as
 * col2im's input, a weight gradient's result as its cast reads it): only that group's nodes
 * read it, directly or through further views. */
static bool epilogue_view(const kiln_ctx *ctx, const kiln__plan *p, int32_t v, int32_t gi) {
  if (p->g[gi].kind != KILN__KIND_MATMUL && !p->g[gi].implicit) return false;
  const kiln_tensor *t = ctx->trace.nodes[v].out;
  bool read = false;
  for (int32_t j = v + 1; j < p->last; j++) {
    const kiln__node *r = &ctx->trace.nodes[j];
    for (int q = 0; q < r->nin; q++) {
      if (r->in[q] != t) continue;
      bool view = kiln__ops[r->op].kind == KILN__KIND_VIEW;
      if (view ? !epilogue_view(ctx, p, j, gi) : p->group_of[j - p->first] != gi) return false;
      read = true;
    }
  }
  return read;
}

const char *kiln__plan_verify(const kiln_ctx *ctx, const kiln__plan *p, char *why, size_t n) {
  const kiln__node *nodes = ctx->trace.nodes;
  for (int k = 0; k < p->ng; k++) {
    const char *e = check_group(ctx, p, k, why, n);
    if (e) return e;
  }
  for (int32_t i = p->first; i < p->last; i++) {
    const kiln__node *nd = &nodes[i];
    int32_t gi = p->group_of[i - p->first], c = p->claim[i - p->first];
    kiln__kind kind = kiln__ops[nd->op].kind;
    if (kind == KILN__KIND_VIEW) {
      if (gi >= 0) return bad(why, n, "view #%d is in group %d", i, gi);
      continue;
    }
    int32_t cg = c >= 0 ? p->group_of[c - p->first] : -1;
    if (c >= 0 && gi < 0 && nd->op == KILN__OP_IM2COL && cg >= 0 &&
        p->g[cg].implicit == KILN__IMPLICIT_WGRAD && p->g[cg].window == i) {
      /* columns gathered again for a weight gradient alone, in its kernel: from an image that an
       * earlier group computes (or one from outside the flush) */
      int32_t o = owner(ctx, p, nd->in[0]), go = o >= 0 ? p->group_of[o - p->first] : -1;
      if (o >= 0 && (go < 0 || go >= cg))
        return bad(why, n,
                   "weight gradient #%d gathers the image of #%d, which no earlier group "
                   "computes",
                   c, i);
      continue;
    }
    if (c >= 0 && gi < 0) { /* an assignment that its value's producer writes through */
      if (nd->op != KILN__OP_ASSIGN || p->write_to[c - p->first] != nd->in[0])
        return bad(why, n, "node #%d is claimed by #%d but not written through", i, c);
      if (!p->store[c - p->first] || !kiln__is_contiguous(nodes[c].out))
        return bad(why, n, "#%d writes through to a gradient but is not written densely", c);
      continue;
    }
    if (gi < 0 || gi >= p->ng)
      return bad(why, n, "node #%d (%s) is in no group", i, kiln__ops[nd->op].name);
    if (c >= 0 && p->group_of[c - p->first] != gi)
      return bad(why, n, "node #%d is claimed by #%d of another group", i, c);
    /* everything it reads is computed by its own group or an earlier one */
    for (int q = 0; q < nd->nin; q++) {
      int32_t o = owner(ctx, p, nd->in[q]);
      if (o < 0) continue;
      int32_t go = p->group_of[o - p->first];
      if (go < 0 && p->claim[o - p->first] < 0)
        return bad(why, n, "node #%d reads #%d, which nothing computes", i, o);
      if (go > gi)
        return bad(why, n, "node #%d (group %d) reads #%d of the later group %d", i, gi, o, go);
    }
    /* a value read outside its group (or through a view), or kept, is written; a claimed
     * im2col's columns exist nowhere, and only implicit products of its image read them */
    if (!nd->out) continue;
    if (nd->op == KILN__OP_IM2COL && c >= 0) {
      for (int32_t j = i + 1; j < p->last; j++) {
        const kiln__node *r = &nodes[j];
        if (kiln__ops[r->op].kind == KILN__KIND_VIEW) {
          if (r->out->keep && owner(ctx, p, r->out) == i)
            return bad(why, n, "the columns of im2col #%d are kept (view #%d) but never written", i,
                       j);
          continue;
        }
        int32_t gr = p->group_of[j - p->first];
        for (int q = 0; q < r->nin; q++)
          if (owner(ctx, p, r->in[q]) == i && (gr < 0 ||
                                               (p->g[gr].implicit != KILN__IMPLICIT_FPROP &&
                                                p->g[gr].implicit != KILN__IMPLICIT_WGRAD) ||
                                               p->g[gr].window != i))
            return bad(why, n,
                       "the columns of im2col #%d are read by #%d (%s), which does not "
                       "gather them from the image",
                       i, j, kiln__ops[r->op].name);
      }
      continue;
    }
    bool stored = p->store[i - p->first];
    if (nd->out->keep && !stored) return bad(why, n, "node #%d is kept but not written", i);
    for (int32_t j = i + 1; j < p->last && !stored; j++) {
      const kiln__node *r = &nodes[j];
      bool view = kiln__ops[r->op].kind == KILN__KIND_VIEW;
      for (int q = 0; q < r->nin; q++)
        if (r->in[q] == nd->out && (view || p->group_of[j - p->first] != gi) &&
            !(view && epilogue_view(ctx, p, j, gi)))
          return bad(why, n, "node #%d (%s) is read by #%d (%s) of another group but not written",
                     i, kiln__ops[nd->op].name, j, kiln__ops[r->op].name);
    }
  }
  return NULL;
}
