/*
 * plan_merge.c: the planner's merges across the trace, groups of nodes that are not neighbours:
 * the casts of parameters that only products read, one multi-tensor launch at the first of them
 * (phase "groups", kiln__batch_casts), an elementwise run read only by a later run of its space
 * moved into that run (phase "sink", kiln__phase_sink), and one read only by a few-channel
 * convolution's weight gradient moved into it as its prologue (phase "few prologue",
 * kiln__phase_few_prologue). plan.c runs the phases.
 */
#include <string.h>

#include "fusion.h"

const kiln_tensor *kiln__param_root(const kiln_ctx *ctx, const kiln__plan *p,
                                    const kiln_tensor *t) {
  for (;;) {
    int32_t v = kiln__plan_producer(ctx, p, t);
    if (v < 0) return t->persistent ? t : NULL;
    if (kiln__ops[ctx->trace.nodes[v].op].kind != KILN__KIND_VIEW) return NULL;
    t = ctx->trace.nodes[v].in[0];
  }
}

/* Whether node i's output is read, and only by products and library calls (directly or through
 * views): no elementwise node or reduction would fuse with i. */
static bool products_read(const kiln_ctx *ctx, const kiln__plan *p, int32_t i) {
  const kiln__node *nodes = ctx->trace.nodes;
  bool read = false;
  for (int32_t j = i + 1; j < p->last; j++)
    for (int q = 0; q < nodes[j].nin; q++) {
      if (nodes[j].in[q] != nodes[i].out) continue;
      kiln__kind kind = kiln__ops[nodes[j].op].kind;
      if (kind == KILN__KIND_VIEW ? !products_read(ctx, p, j)
                                  : kind != KILN__KIND_MATMUL && kind != KILN__KIND_LIB)
        return false;
      read = true;
    }
  return read;
}

/* (KILN_CAST_BATCH=0 turns it off.) Whether node i is a cast that a
 * multi-tensor cast takes: f32 or bf16 to either, of a parameter (through views: a convolution's
 * filters permuted, as autocast casts them before their product), its result dense and read only
 * by products and library calls, so that it would have been a launch of its own. Not one the
 * backward pass records (a recomputation, core/conv.c's image_again: at the batch's first cast
 * it would live from there on). */
bool kiln__batch_cast(const kiln_ctx *ctx, const kiln__plan *p, int32_t i) {
  const kiln__node *n = &ctx->trace.nodes[i];
  return n->op == KILN__OP_CAST && n->from < 0 && kiln__is_float(n->in[0]->dtype) &&
         kiln__is_float(n->out->dtype) && !n->out->keep && kiln__is_contiguous(n->out) &&
         p->group_of[i - p->first] < 0 && p->claim[i - p->first] < 0 &&
         !p->write_to[i - p->first] && kiln__param_root(ctx, p, n->in[0]) &&
         products_read(ctx, p, i);
}

bool kiln__writes_storage(const kiln_ctx *ctx, const kiln__plan *p, int32_t j,
                          const kiln__storage *st) {
  const kiln_tensor *to = p->write_to[j - p->first];
  return (to && to->st == st) || kiln__node_stores_into(&ctx->trace.nodes[j], st);
}

/* Whether a node of the flush in [i, j) writes the memory of t. */
static bool written_between(const kiln_ctx *ctx, const kiln__plan *p, int32_t i, int32_t j,
                            const kiln_tensor *t) {
  for (int32_t k = i; k < j; k++)
    if (kiln__writes_storage(ctx, p, k, t->st)) return true;
  return false;
}

/* Casts that kiln__batch_cast takes from node i on, up to KILN__MAX_CASTS, each of a parameter that
 * nothing writes between i and it: the group runs them all at i. Returns how many (take[]). */
int kiln__batch_casts(const kiln_ctx *ctx, const kiln__plan *p, int32_t i, int32_t *take) {
  int n = 0;
  for (int32_t j = i; j < p->last && n < KILN__MAX_CASTS; j++)
    if (kiln__batch_cast(ctx, p, j) &&
        !written_between(ctx, p, i, j, kiln__param_root(ctx, p, ctx->trace.nodes[j].in[0])))
      take[n++] = j;
  return n;
}

/* The trace index of group g's last member. */
static int32_t last_member(const kiln__plan *p, const kiln__group *g) {
  return p->members[g->first + g->n - 1];
}

/* The kernel slots that groups a and b (b: -1 for none) take together: each member's attribute
 * slots and an operand for its output (if it is stored), one for each tensor they read from
 * outside both (each once). Whether they fit one kernel's, the operands beside `more` others. */
static bool slots_fit(const kiln_ctx *ctx, const kiln__plan *p, int ka, int kb, int more) {
  const kiln__node *nodes = ctx->trace.nodes;
  const kiln__group *a = &p->g[ka], *b = kb >= 0 ? &p->g[kb] : NULL;
  int ops = more, nf = 0, ni = 0, nu = 0, n = a->n + (b ? b->n : 0);
  const kiln_tensor *seen[2 * KILN__MAX_GROUP * (KILN__MAX_IN + 1)];
  int ns = 0;
  for (int m = 0; m < n; m++) {
    const kiln__node *x =
        &nodes[m < a->n ? p->members[a->first + m] : p->members[b->first + m - a->n]];
    int f, k, u;
    kiln__kernel_slots(x->op, &f, &k, &u);
    nf += f, ni += k, nu += u;
    ops++; /* its output, if it is stored */
    for (int q = 0; q < x->nin; q++) {
      int32_t pr = kiln__plan_producer(ctx, p, x->in[q]);
      if (pr >= 0 && (p->group_of[pr - p->first] == ka || p->group_of[pr - p->first] == kb))
        continue;
      int s = 0;
      while (s < ns && seen[s] != x->in[q])
        s++;
      if (s == ns) seen[ns++] = x->in[q], ops++;
    }
  }
  return ops <= KILN__KMAX_PTR && nf <= KILN__KMAX_F && ni <= KILN__KMAX_I && nu <= KILN__KMAX_U;
}

/* Whether what group a reads from memory (from outside a) stays as it is from a's last member
 * to node until: no node between writes it (a then reads it at until's place in the flush). */
static bool inputs_kept(const kiln_ctx *ctx, const kiln__plan *p, int ka, int32_t until) {
  const kiln__node *nodes = ctx->trace.nodes;
  const kiln__group *a = &p->g[ka];
  for (int m = 0; m < a->n; m++) {
    const kiln__node *x = &nodes[p->members[a->first + m]];
    for (int q = 0; q < x->nin; q++) {
      int32_t pr = kiln__plan_producer(ctx, p, x->in[q]);
      if (pr >= 0 && p->group_of[pr - p->first] == ka) continue;
      if (written_between(ctx, p, last_member(p, a) + 1, until, x->in[q])) return false;
    }
  }
  return true;
}

/* Whether the plain elementwise group a (not a multi-tensor cast) can run inside the later
 * elementwise group b, over the same space: every value of a is read only inside a or by b's
 * nodes (no view, no other group), a's and b's operands fit one kernel, and no node between
 * them, nor b's write-throughs, writes what a reads from memory (a then reads it at b's place
 * in the flush, after those nodes). */
static bool can_sink(const kiln_ctx *ctx, const kiln__plan *p, int ka, int kb) {
  const kiln__node *nodes = ctx->trace.nodes;
  const kiln__group *a = &p->g[ka], *b = &p->g[kb];
  if (a->kind != KILN__KIND_EW || b->kind != KILN__KIND_EW || a->batch || b->batch || a->n < 1 ||
      b->n < 1 || a->n + b->n > KILN__MAX_GROUP || last_member(p, a) >= p->members[b->first] ||
      !kiln__same_shape(nodes[p->members[a->first]].out, nodes[p->members[b->first]].out) ||
      !slots_fit(ctx, p, ka, kb, 0) || !inputs_kept(ctx, p, ka, p->members[b->first]))
    return false;
  for (int m = 0; m < a->n; m++) { /* nor b's write-throughs */
    const kiln__node *x = &nodes[p->members[a->first + m]];
    for (int q = 0; q < x->nin; q++)
      for (int mb = 0; mb < b->n; mb++) {
        const kiln_tensor *to = p->write_to[p->members[b->first + mb] - p->first];
        if (to && to->st == x->in[q]->st) return false;
      }
  }
  for (int m = 0; m < a->n; m++) { /* a's values: read by a or b alone */
    const kiln_tensor *t = nodes[p->members[a->first + m]].out;
    for (int32_t j = p->members[a->first + m] + 1; j < p->last; j++)
      for (int q = 0; q < nodes[j].nin; q++)
        if (nodes[j].in[q] == t && p->group_of[j - p->first] != ka &&
            p->group_of[j - p->first] != kb)
          return false;
  }
  return true;
}

/* Group a's members run in the later group b, before b's own (a's all come first in the trace):
 * b's members become a's then b's, at the end of the members array; a's group goes, the groups
 * after it one down. */
static bool merge(kiln_ctx *ctx, kiln__plan *p, int ka, int kb) {
  kiln__group *a = &p->g[ka], *b = &p->g[kb];
  int n = a->n + b->n, first = p->nm;
  if (!KILN__GROW(p->members, p->capm, p->nm + n))
    return !kiln__error(ctx, KILN_ERR_OOM, "kiln_flush: out of host memory planning");
  memcpy(p->members + first, p->members + a->first, (size_t)a->n * sizeof *p->members);
  memcpy(p->members + first + a->n, p->members + b->first, (size_t)b->n * sizeof *p->members);
  p->nm += n;
  b->first = first;
  b->n = n;
  memmove(&p->g[ka], &p->g[ka + 1], (size_t)(p->ng - ka - 1) * sizeof *p->g);
  p->ng--;
  for (int32_t i = p->first; i < p->last; i++) {
    int32_t *gi = &p->group_of[i - p->first];
    if (*gi == ka)
      *gi = kb - 1;
    else if (*gi > ka)
      (*gi)--;
  }
  return true;
}

/* Elementwise runs that a later run of the same space reads, and nothing else: a ResNet block's
 * main-branch batch norm, applied before its shortcut's convolution and batch norm are recorded
 * and read only by the add after them, runs inside the add's kernel, so that its output is never
 * written (KILN_EW_SINK=1; off: no faster on the H200, and one ulp off in a clipping test). The
 * group moves to the later one's place; groups after it shift down. */
bool kiln__phase_sink(kiln_ctx *ctx, kiln__plan *p, bool fuse) {
  if (!fuse || !ctx->ew_sink) return true;
  const kiln__node *nodes = ctx->trace.nodes;
  for (int ka = 0; ka < p->ng; ka++) {
    const kiln__group *a = &p->g[ka];
    if (a->kind != KILN__KIND_EW || a->batch || a->n < 1) continue;
    /* the group of the first node outside a that reads a's last value */
    int kb = -1;
    const kiln_tensor *t = nodes[last_member(p, a)].out;
    for (int32_t j = last_member(p, a) + 1; j < p->last && kb < 0; j++)
      for (int q = 0; q < nodes[j].nin && kb < 0; q++)
        if (nodes[j].in[q] == t && p->group_of[j - p->first] != ka) kb = p->group_of[j - p->first];
    if (kb <= ka || !can_sink(ctx, p, ka, kb)) continue;
    p->g[kb].node = p->members[a->first];
    if (!merge(ctx, p, ka, kb)) return false;
    ka--; /* the group now at ka is the next one */
  }
  return true;
}

/* (KILN_CONV_FEW_PROLOGUE=0 turns it off.) conv_few.cuh's weight gradient
 * (kiln__few_wgrad_shape) reads each value of dY once, as it loads a tile's rows. Where the
 * elementwise run that writes dY has no other reader (ResNet's stem: batch norm's dx, read by the
 * stem's weight gradient alone, the image having no gradient), the run becomes the gradient's
 * prologue (kiln__prologue_run): dY computed as it is loaded, from the run's inputs, and never
 * written. dY^T, the product's operand, reaches the run's last value through views read by nothing
 * else; the run's inputs stay as they are until the gradient runs, and its operands fit the
 * kernel's beside the product's five (the image, dY, dW, the workspace and its counters). */
bool kiln__phase_few_prologue(kiln_ctx *ctx, kiln__plan *p, bool fuse) {
  if (!fuse || !ctx->few_prologue || !ctx->conv_few || !ctx->conv_few_wgrad) return true;
  const kiln__node *nodes = ctx->trace.nodes;
  for (int kb = 0; kb < p->ng; kb++) {
    const kiln__group *b = &p->g[kb];
    if (b->implicit != KILN__IMPLICIT_WGRAD || b->grad || b->prologue || b->n != 1) continue;
    const kiln__node *c = &nodes[b->window], *mm = &nodes[b->node];
    kiln__win w = kiln__win_of(c);
    if (!kiln__few_wgrad_shape(&w, c->in[0]->shape[3], mm->out->shape[0])) continue;
    int32_t v = kiln__plan_producer(ctx, p, mm->in[0]);
    while (v >= 0 && kiln__ops[nodes[v].op].kind == KILN__KIND_VIEW &&
           p->readers[v - p->first] == 1)
      v = kiln__plan_producer(ctx, p, nodes[v].in[0]);
    int ka = v >= 0 ? p->group_of[v - p->first] : -1;
    if (ka < 0 || ka >= kb || v != last_member(p, &p->g[ka]) ||
        p->g[ka].n + b->n > KILN__MAX_GROUP || !kiln__prologue_run(ctx, p, &p->g[ka]) ||
        kiln_tensor_numel(nodes[v].out) != kiln_tensor_numel(mm->in[0]) ||
        !inputs_kept(ctx, p, ka, b->node) || !slots_fit(ctx, p, ka, -1, 5))
      continue;
    p->g[kb].prologue = p->g[ka].n;
    if (!merge(ctx, p, ka, kb)) return false;
    kb--; /* the group now at kb is the next one */
  }
  return true;
}
