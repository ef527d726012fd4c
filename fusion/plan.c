/*
 * plan.c: the planner. It walks a flush's nodes in trace order and groups them:
 *   - a run of elementwise nodes with the same output shape (views between them do not break the
 *     run) becomes one kernel, its inputs broadcast or strided;
 *   - a reduction directly after such a run, reading one of its values, takes the run in as its
 *     prologue (fuse-on-read);
 *   - a 2-D matrix product followed by the addition of a bias over its columns, and optionally a
 *     ReLU, becomes one cuBLASLt call with the BIAS or RELU_BIAS epilogue;
 *   - consecutive in-place updates of the same kind and settings (an optimizer's parameters,
 *     gradient assignments) become one multi-tensor launch.
 * Then it decides what is written to memory: a value read outside its group (or through a view),
 * one nothing in the flush reads, one the backward pass will read (the op table's saves column),
 * and one the caller asked to keep. The rest stays in registers and gets no memory at all.
 */
#include <stdlib.h>
#include <string.h>

#include "fusion.h"

static bool grow(kiln_ctx *ctx, void **p, int *cap, int need, size_t size) {
  if (need <= *cap) return true;
  int c = *cap ? *cap : 64;
  while (c < need)
    c *= 2;
  void *q = realloc(*p, (size_t)c * size);
  if (!q) {
    kiln__error(ctx, KILN_ERR_OOM, "kiln_flush: out of host memory planning");
    return false;
  }
  *p = q;
  *cap = c;
  return true;
}

static kiln__group *new_group(kiln_ctx *ctx, kiln__plan *p, kiln__kind kind, int32_t node) {
  if (!grow(ctx, (void **)&p->g, &p->capg, p->ng + 1, sizeof *p->g)) return NULL;
  kiln__group *g = &p->g[p->ng++];
  memset(g, 0, sizeof *g);
  g->kind = kind;
  g->node = node;
  g->first = p->nm;
  return g;
}

static bool add_member(kiln_ctx *ctx, kiln__plan *p, kiln__group *g, int32_t node) {
  if (!grow(ctx, (void **)&p->members, &p->capm, p->nm + 1, sizeof *p->members)) return false;
  KILN_ASSERT(g->first + g->n == p->nm);
  p->members[p->nm++] = node;
  g->n++;
  p->group_of[node - p->first] = (int32_t)(g - p->g);
  return true;
}

/* The node in this flush whose output is exactly t, or -1. */
static int32_t producer(const kiln_ctx *ctx, const kiln__plan *p, const kiln_tensor *t) {
  int32_t i = t->node;
  if (i < p->first || i >= p->last) return -1;
  return ctx->trace.nodes[i].out == t ? i : -1;
}

static bool same_shape(const kiln_tensor *a, const kiln_tensor *b) {
  if (a->ndim != b->ndim) return false;
  for (int d = 0; d < a->ndim; d++)
    if (a->shape[d] != b->shape[d]) return false;
  return true;
}

/* Whether elementwise node i can join the open group g (all of g's nodes are elementwise over
 * the shape of g's first node). */
static bool can_join(const kiln_ctx *ctx, const kiln__plan *p, const kiln__group *g, int32_t i) {
  const kiln__node *n = &ctx->trace.nodes[i];
  const kiln__node *first = &ctx->trace.nodes[p->members[g->first]];
  if (g->n >= KILN__MAX_GROUP || !same_shape(n->out, first->out)) return false;
  int ops = 1, nf = 0, ni = 0, nu = 0; /* operand and attribute slots the kernel would need */
  for (int m = 0; m <= g->n; m++) {
    const kiln__node *x = m < g->n ? &ctx->trace.nodes[p->members[g->first + m]] : n;
    int f, k, u;
    kiln__attr_use(kiln__ops[x->op].expr, &f, &k, &u);
    nf += f;
    ni += k;
    nu += u;
    ops++; /* its output, if it is stored */
    for (int j = 0; j < x->nin; j++) {
      int32_t pr = producer(ctx, p, x->in[j]);
      if (pr < 0 || p->group_of[pr - p->first] != (int32_t)(g - p->g)) ops++;
    }
  }
  if (ops > KILN__KMAX_PTR || nf > KILN__KMAX_F || ni > KILN__KMAX_I || nu > KILN__KMAX_U)
    return false;
  for (int j = 0; j < n->nin; j++) {
    const kiln_tensor *x = n->in[j];
    int32_t pr = producer(ctx, p, x);
    if (pr >= 0 && p->group_of[pr - p->first] == (int32_t)(g - p->g)) continue; /* in registers */
    /* a read from memory that the group itself writes (a view of one of its values) would race
     * with the writes */
    for (int m = 0; m < g->n; m++)
      if (ctx->trace.nodes[p->members[g->first + m]].out->st == x->st) return false;
  }
  return true;
}

/* Whether the run g can be computed inside a reduction: no op that needs the element's linear
 * index (dropout), and a free attribute slot for the reduction's scale. */
static bool prologue_ok(const kiln_ctx *ctx, const kiln__plan *p, const kiln__group *g) {
  if (g->n >= KILN__MAX_GROUP) return false;
  int nf = 0;
  for (int m = 0; m < g->n; m++) {
    const char *e = kiln__ops[ctx->trace.nodes[p->members[g->first + m]].op].expr;
    if (strstr(e, "$idx")) return false;
    int f, i, u;
    kiln__attr_use(e, &f, &i, &u);
    nf += f;
  }
  return nf < KILN__KMAX_F;
}

/* Whether update node i can join the update group g in one multi-tensor launch: the same op
 * and attributes, dense operands, room for their pointers, and no operand that an update of
 * the group writes. */
static bool can_batch(const kiln_ctx *ctx, const kiln__plan *p, const kiln__group *g, int32_t i) {
  if (g->kind != KILN__KIND_UPDATE || p->members[g->first + g->n - 1] != i - 1) return false;
  const kiln__node *n = &ctx->trace.nodes[i], *first = &ctx->trace.nodes[p->members[g->first]];
  if (n->op != first->op || (g->n + 1) * n->nin > KILN__KMAX_PTR ||
      memcmp(n->f, first->f, sizeof n->f) != 0 || memcmp(n->i, first->i, sizeof n->i) != 0 ||
      memcmp(n->u, first->u, sizeof n->u) != 0)
    return false;
  for (int m = 0; m <= g->n; m++) {
    const kiln__node *x = m < g->n ? &ctx->trace.nodes[p->members[g->first + m]] : n;
    for (int j = 0; j < x->nin; j++)
      if (!kiln__is_contiguous(x->in[j])) return false;
  }
  for (int m = 0; m < g->n; m++) {
    const kiln__node *x = &ctx->trace.nodes[p->members[g->first + m]];
    for (int j = 0; j < x->nin; j++) {
      if (!(kiln__ops[x->op].stores & (1u << j))) continue;
      for (int q = 0; q < n->nin; q++)
        if (n->in[q]->st == x->in[j]->st) return false;
    }
  }
  return true;
}

/* cuBLASLt's epilogue after the product of node i: D = A B + bias (+ ReLU). Returns how many of
 * the following nodes it takes (0, 1 or 2); *next_out is what the group writes. */
static int matmul_epilogue(const kiln_ctx *ctx, const kiln__plan *p, int32_t i, const int *readers,
                           kiln__group *g) {
  const kiln__node *mm = &ctx->trace.nodes[i];
  if (mm->out->ndim != 2 || readers[i - p->first] != 1 || mm->out->keep) return 0;
  int32_t j = i + 1;
  if (j >= p->last) return 0;
  const kiln__node *add = &ctx->trace.nodes[j];
  if (add->op != KILN__OP_ADD) return 0;
  int side = add->in[0] == mm->out ? 1 : (add->in[1] == mm->out ? 0 : -1);
  if (side < 0 || !same_shape(add->out, mm->out)) return 0;
  const kiln_tensor *b = add->in[side];
  int64_t ncol = mm->out->shape[1];
  bool vec = (b->ndim == 1 || (b->ndim == 2 && b->shape[0] == 1)) &&
             b->shape[b->ndim - 1] == ncol && (ncol == 1 || b->stride[b->ndim - 1] == 1) &&
             b->dtype == KILN_DTYPE_F32 && ((uintptr_t)b->offset * 4) % 16 == 0;
  if (!vec || b->st == mm->out->st) return 0;
  g->bias = b;
  g->out = add->out;
  int32_t k = j + 1;
  if (k < p->last && readers[j - p->first] == 1 && !add->out->keep) {
    const kiln__node *r = &ctx->trace.nodes[k];
    if (r->op == KILN__OP_RELU && r->in[0] == add->out) {
      g->relu = true;
      g->out = r->out;
      return 2;
    }
  }
  return 1;
}

bool kiln__plan_build(kiln_ctx *ctx, int32_t first, int32_t last, bool fuse, kiln__plan *p) {
  memset(p, 0, sizeof *p);
  p->first = first;
  p->last = last;
  int n = last - first;
  p->group_of = malloc((size_t)(n > 0 ? n : 1) * sizeof *p->group_of);
  p->store = calloc((size_t)(n > 0 ? n : 1), sizeof *p->store);
  int *readers = calloc((size_t)(n > 0 ? n : 1), sizeof *readers);
  if (!p->group_of || !p->store || !readers) {
    free(readers);
    kiln__plan_free(p);
    return kiln__error(ctx, KILN_ERR_OOM, "kiln_flush: out of host memory planning"), false;
  }
  const kiln__node *nodes = ctx->trace.nodes;
  for (int32_t i = first; i < last; i++) {
    p->group_of[i - first] = -1;
    for (int j = 0; j < nodes[i].nin; j++) {
      int32_t pr = producer(ctx, p, nodes[i].in[j]);
      if (pr >= 0) readers[pr - first]++;
    }
  }

  kiln__group *open = NULL; /* the elementwise run being grown */
  for (int32_t i = first; i < last; i++) {
    const kiln__node *nd = &nodes[i];
    kiln__kind kind = kiln__ops[nd->op].kind;
    if (kind == KILN__KIND_VIEW || p->group_of[i - first] >= 0) continue;
    if (kind == KILN__KIND_EW) {
      if (fuse && open && can_join(ctx, p, open, i)) {
        if (!add_member(ctx, p, open, i)) goto oom;
        continue;
      }
      open = new_group(ctx, p, KILN__KIND_EW, i);
      if (!open || !add_member(ctx, p, open, i)) goto oom;
      if (!fuse) open = NULL;
      continue;
    }
    if (kind == KILN__KIND_REDUCE && fuse && open) {
      /* fuse-on-read: the run computes the reduction's input */
      int32_t pr = producer(ctx, p, nd->in[0]);
      if (pr >= 0 && p->group_of[pr - first] == (int32_t)(open - p->g) &&
          prologue_ok(ctx, p, open)) {
        open->kind = KILN__KIND_REDUCE;
        open->node = i;
        if (!add_member(ctx, p, open, i)) goto oom;
        open = NULL;
        continue;
      }
    }
    open = NULL;
    if (kind == KILN__KIND_UPDATE && fuse && p->ng > 0 && can_batch(ctx, p, &p->g[p->ng - 1], i)) {
      if (!add_member(ctx, p, &p->g[p->ng - 1], i)) goto oom;
      continue;
    }
    if (nd->op == KILN__OP_CONCAT) {
      for (int k = 0; k < nd->nin; k++) {
        kiln__group *g = new_group(ctx, p, KILN__KIND_LIB, i);
        if (!g) goto oom;
        g->sub = k;
        p->group_of[i - first] = (int32_t)(g - p->g);
      }
      continue;
    }
    kiln__group *g = new_group(ctx, p, kind, i);
    if (!g || !add_member(ctx, p, g, i)) goto oom;
    if (kind == KILN__KIND_MATMUL && fuse) {
      int take = matmul_epilogue(ctx, p, i, readers, g);
      for (int k = 1; k <= take; k++)
        if (!add_member(ctx, p, g, i + k)) goto oom;
    }
  }

  /* what must be written to memory */
  for (int32_t i = first; i < last; i++) {
    const kiln__node *nd = &nodes[i];
    if (!nd->out || kiln__ops[nd->op].kind == KILN__KIND_VIEW) continue;
    p->store[i - first] = !fuse || readers[i - first] == 0 || nd->out->keep;
  }
  for (int32_t i = first; i < last; i++) {
    const kiln__node *nd = &nodes[i];
    bool view = kiln__ops[nd->op].kind == KILN__KIND_VIEW;
    unsigned saves = nd->out && nd->out->requires_grad ? kiln__ops[nd->op].saves : 0;
    if ((saves & 8) && !view) p->store[i - first] = true;
    for (int j = 0; j < nd->nin; j++) {
      int32_t pr = producer(ctx, p, nd->in[j]);
      if (pr < 0) continue;
      bool outside = view || p->group_of[i - first] != p->group_of[pr - first];
      if (outside || (saves & (1u << j))) p->store[pr - first] = true;
    }
  }
  for (int k = 0; k < p->ng; k++) {
    kiln__group *g = &p->g[k];
    if (g->kind != KILN__KIND_MATMUL) continue;
    /* the product's own result is written, or only its epilogue's */
    const kiln_tensor *out = g->out ? g->out : nodes[g->node].out;
    for (int m = 0; m < g->n; m++) {
      int32_t i = p->members[g->first + m];
      p->store[i - first] = nodes[i].out == out;
    }
    g->out = out;
  }
  free(readers);
  return true;
oom:
  free(readers);
  kiln__plan_free(p);
  return false;
}

void kiln__plan_free(kiln__plan *p) {
  free(p->g);
  free(p->members);
  free(p->group_of);
  free(p->store);
  memset(p, 0, sizeof *p);
}
