/*
 * plan.c: the planner. It turns a flush's trace nodes into groups, each one launch, in named
 * phases (the list `phases` below):
 *   readers         how many of the flush's inputs each value is;
 *   write-through   an assignment of a fresh gradient to its .grad buffer is dropped and the
 *                   producer writes the buffer itself;
 *   bias gradients  a bias gradient (a sum over rows) that a weight gradient's product computes
 *                   beside it (the BGRADB epilogue);
 *   groups          in trace order: runs of elementwise nodes over one iteration space (views do
 *                   not break a run); a reduction reading such a run takes it in as its prologue
 *                   (fuse-on-read); a reduction over the last axis grows into a row program that
 *                   later per-element and per-row nodes join; a 2-D product takes a bias and
 *                   ReLU/GELU epilogue, or in the backward pass the activation's derivative and
 *                   the bias gradient; a pooling op or an image gradient (col2im, the pools'
 *                   gradients) takes the elementwise nodes after it over its output (an
 *                   epilogue: dropout after pooling, a ReLU's derivative after col2im);
 *                   consecutive in-place updates of the same kind and settings become one
 *                   multi-tensor launch; so do the casts of parameters that
 *                   only products read become one, at the first of them (plan_merge.c);
 *   sink            an elementwise run read only by a later run of its space joins that run
 *                   (plan_merge.c);
 *   stores          what is written to memory: a value read outside its group (or through a
 *                   view), one nothing in the flush reads, one the backward pass will read (the
 *                   op table's saves column), one the caller asked to keep; the rest stays in
 *                   registers and gets no memory at all;
 *   product outputs a product group writes its result, or only its epilogue's, and what the
 *                   epilogue writes beside it.
 * The planner asks the BLAS backend (blas.h) which epilogues it supports, in kiln's terms. Which
 * convolution products run as implicit GEMMs (the implicit phase) is plan_conv.c's.
 */
#include <stdlib.h>
#include <string.h>

#include "fusion.h"

static bool oom(kiln_ctx *ctx) {
  return !kiln__error(ctx, KILN_ERR_OOM, "kiln_flush: out of host memory planning");
}

static kiln__group *new_group(kiln_ctx *ctx, kiln__plan *p, kiln__kind kind, int32_t node) {
  if (!KILN__GROW(p->g, p->capg, p->ng + 1)) return oom(ctx), NULL;
  kiln__group *g = &p->g[p->ng++];
  memset(g, 0, sizeof *g);
  g->kind = kind;
  g->node = node;
  g->first = p->nm;
  return g;
}

static bool add_member(kiln_ctx *ctx, kiln__plan *p, kiln__group *g, int32_t node) {
  if (!KILN__GROW(p->members, p->capm, p->nm + 1)) return oom(ctx);
  KILN_ASSERT(g->first + g->n == p->nm);
  p->members[p->nm++] = node;
  g->n++;
  p->group_of[node - p->first] = (int32_t)(g - p->g);
  return true;
}

/* Records that group g reads view as value (a row program's alias). */
static bool add_alias(kiln_ctx *ctx, kiln__plan *p, kiln__group *g, const kiln_tensor *view,
                      const kiln_tensor *value) {
  for (int k = 0; k < g->nalias; k++)
    if (p->alias[g->alias_first + k].view == view) return true;
  if (!KILN__GROW(p->alias, p->capalias, p->nalias + 1)) return oom(ctx);
  if (g->nalias == 0) g->alias_first = p->nalias;
  KILN_ASSERT(g->alias_first + g->nalias == p->nalias); /* a group's aliases stay together */
  p->alias[p->nalias++] = (kiln__alias){.view = view, .value = value};
  g->nalias++;
  return true;
}

int32_t kiln__owner(const kiln_ctx *ctx, const kiln_tensor *t) {
  for (;;) {
    int32_t i = t->node;
    if (i < 0 || i >= ctx->trace.n || ctx->trace.nodes[i].out != t) return -1;
    const kiln__node *n = &ctx->trace.nodes[i];
    if (kiln__ops[n->op].kind != KILN__KIND_VIEW) return i;
    t = n->in[0];
  }
}

static int32_t producer(const kiln_ctx *ctx, const kiln__plan *p, const kiln_tensor *t) {
  return kiln__plan_producer(ctx, p, t);
}

static bool in_group(const kiln__plan *p, int32_t node, const kiln__group *g) {
  return node >= 0 && p->group_of[node - p->first] == (int32_t)(g - p->g);
}

/* Whether a kernel of group g plus node i stays within the argument's operand and attribute
 * slots, keeping spare float slots free (an elementwise run keeps one for the scale of a
 * reduction that may take it in as its prologue). */
static bool fits(const kiln_ctx *ctx, const kiln__plan *p, const kiln__group *g, int32_t i,
                 int spare) {
  if (g->n >= KILN__MAX_GROUP) return false;
  int ops = 0, nf = spare, ni = 0, nu = 0;
  const kiln_tensor *seen[KILN__MAX_GROUP * KILN__MAX_IN];
  int nseen = 0;
  for (int m = 0; m <= g->n; m++) {
    const kiln__node *x =
        m < g->n ? &ctx->trace.nodes[p->members[g->first + m]] : &ctx->trace.nodes[i];
    int f, k, u;
    kiln__kernel_slots(x->op, &f, &k, &u);
    nf += f;
    ni += k;
    nu += u;
    ops++; /* its output, if it is stored */
    for (int j = 0; j < x->nin; j++) {
      if (in_group(p, producer(ctx, p, x->in[j]), g)) continue;
      int q = 0; /* an operand read twice is loaded through one pointer */
      while (q < nseen && seen[q] != x->in[j])
        q++;
      if (q == nseen) seen[nseen++] = x->in[j], ops++;
    }
  }
  return ops <= KILN__KMAX_PTR && nf <= KILN__KMAX_F && ni <= KILN__KMAX_I && nu <= KILN__KMAX_U;
}

/* Whether node i's operand x, read from memory, is a view of a value the group writes (the
 * read would race with the write). */
static bool reads_own_write(const kiln_ctx *ctx, const kiln__plan *p, const kiln__group *g,
                            const kiln_tensor *x) {
  if (in_group(p, producer(ctx, p, x), g)) return false; /* in registers */
  for (int m = 0; m < g->n; m++)
    if (ctx->trace.nodes[p->members[g->first + m]].out->st == x->st) return true;
  return false;
}

/* Whether elementwise node i can join the open group g (all of g's nodes are elementwise over
 * the shape of g's first node). */
static bool can_join(const kiln_ctx *ctx, const kiln__plan *p, const kiln__group *g, int32_t i) {
  const kiln__node *n = &ctx->trace.nodes[i];
  /* the group's space: its first node's, or an implicit product's col2im's */
  const kiln__node *first = &ctx->trace.nodes[g->implicit ? g->node : p->members[g->first]];
  if (!kiln__same_shape(n->out, first->out) || !fits(ctx, p, g, i, 1)) return false;
  for (int j = 0; j < n->nin; j++)
    if (reads_own_write(ctx, p, g, n->in[j])) return false;
  return true;
}

/* The most elements of a row a row program takes: one block of up to KILN__BLOCK threads strides
 * over the row once per pass (recomputing its prologue each time), so a longer row (more than 64
 * elements a thread) is better reduced by the column-or-block reduction kernel. */
#define KILN__MAX_ROW 16384
_Static_assert(KILN__MOMENTS_ROW_PARTS <= KILN__MAX_ROW, "batch norm's partial sums make a row");

/* A reduction that can start or extend a row program: a sum or max over the last axis alone,
 * of a row long enough to share among a block's threads and short enough for one block. */
static bool row_reduction(const kiln__node *r) {
  if (r->op != KILN__OP_SUM && r->op != KILN__OP_MAX) return false;
  const kiln_tensor *x = r->in[0];
  int nd = x->ndim;
  return nd >= 1 && x->dtype == KILN_DTYPE_F32 && KILN__RI(r, mask) == (int64_t)(1u << (nd - 1)) &&
         x->shape[nd - 1] > 1 && x->shape[nd - 1] <= KILN__MAX_ROW;
}

/* t holds one value per row of F: F's shape without its last axis, or with it as 1. */
static bool row_shaped(const kiln_tensor *F, const kiln_tensor *t, bool keepdim) {
  int nd = F->ndim;
  if (t->ndim != (keepdim ? nd : nd - 1)) return false;
  for (int d = 0; d + 1 < nd; d++)
    if (t->shape[d] != F->shape[d]) return false;
  return !keepdim || t->shape[nd - 1] == 1;
}

const kiln_tensor *kiln__row_alias(const kiln_ctx *ctx, const kiln_tensor *F,
                                   const kiln_tensor *x) {
  const kiln_tensor *b = x;
  for (;;) {
    if (b->persistent || b->node < 0 || b->node >= ctx->trace.n) break;
    const kiln__node *v = &ctx->trace.nodes[b->node];
    if (v->out != b || v->nin != 1) break;
    const kiln_tensor *in = v->in[0];
    bool step = (v->op == KILN__OP_RESHAPE && (row_shaped(F, b, true) || row_shaped(F, b, false)) &&
                 (row_shaped(F, in, true) || row_shaped(F, in, false))) ||
                (v->op == KILN__OP_EXPAND && kiln__same_shape(b, F) && row_shaped(F, in, true));
    if (!step) break;
    b = in;
  }
  return b == x ? NULL : b;
}

/* Whether node i can join the row program g: a reduction over the last axis of g->full, an
 * elementwise node over g->full that reads the program's values per element or per row
 * (kept-dim), or an elementwise node over the rows. A reshaped or expanded view of a per-row
 * value of the program is read as that value: *nalias of them go to alias[]. */
static bool can_join_rows(const kiln_ctx *ctx, const kiln__plan *p, const kiln__group *g, int32_t i,
                          kiln__alias *alias, int *nalias) {
  const kiln__node *n = &ctx->trace.nodes[i];
  const kiln_tensor *F = g->full;
  kiln__kind kind = kiln__ops[n->op].kind;
  bool full;
  *nalias = 0;
  if (kind == KILN__KIND_REDUCE) {
    if (!row_reduction(n) || !kiln__same_shape(n->in[0], F)) return false;
    full = false;
  } else if (kind == KILN__KIND_EW) {
    if (strstr(kiln__ops[n->op].expr, "$idx")) return false;
    full = kiln__same_shape(n->out, F);
    if (!full && !row_shaped(F, n->out, true) && !row_shaped(F, n->out, false)) return false;
  } else {
    return false;
  }
  if (!fits(ctx, p, g, i, 1)) return false;
  for (int j = 0; j < n->nin; j++) {
    const kiln_tensor *x = n->in[j];
    if (in_group(p, producer(ctx, p, x), g)) {
      /* an element-wise node reads values per element or per row (kept dim) */
      if (full && !kiln__same_shape(x, F) && !row_shaped(F, x, true)) return false;
      continue;
    }
    const kiln_tensor *b = kind == KILN__KIND_REDUCE ? NULL : kiln__row_alias(ctx, F, x);
    if (b && in_group(p, producer(ctx, p, b), g) && (!full || !row_shaped(F, x, false))) {
      alias[(*nalias)++] = (kiln__alias){.view = x, .value = b};
      continue;
    }
    if (reads_own_write(ctx, p, g, x)) return false;
  }
  return true;
}

/* Whether the run g can be computed inside reduction r: no op that needs the element's linear
 * index (dropout), and room in the kernel's argument for the reduction too (its output, its
 * scale). */
static bool prologue_ok(const kiln_ctx *ctx, const kiln__plan *p, const kiln__group *g, int32_t r) {
  for (int m = 0; m < g->n; m++) {
    const kiln__node *x = &ctx->trace.nodes[p->members[g->first + m]];
    if (strstr(kiln__ops[x->op].expr, "$idx")) return false;
  }
  return fits(ctx, p, g, r, 0);
}

/* Whether update node i can join the update group g in one multi-tensor launch: the same op
 * and attributes, dense operands, room for their pointers, no operand that an update of the
 * group writes (but found_inf's flag, which its members share: they only ever set it to 1), and
 * nothing i writes that an update of the group reads (the launch orders none of them). */
static bool can_batch(const kiln_ctx *ctx, const kiln__plan *p, const kiln__group *g, int32_t i) {
  /* the node before i, past views and assignments written through (they run nothing) */
  int32_t before = i - 1;
  while (before > p->first &&
         (kiln__ops[ctx->trace.nodes[before].op].kind == KILN__KIND_VIEW ||
          (ctx->trace.nodes[before].op == KILN__OP_ASSIGN && p->claim[before - p->first] >= 0)))
    before--;
  if (g->kind != KILN__KIND_UPDATE || p->members[g->first + g->n - 1] != before) return false;
  const kiln__node *n = &ctx->trace.nodes[i], *first = &ctx->trace.nodes[p->members[g->first]];
  if (n->op != first->op || (g->n + 1) * n->nin > KILN__KMAX_UPDATE || g->n + 1 > KILN__KMAX_PTR ||
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
        if (n->in[q]->st == x->in[j]->st && !(n->op == KILN__OP_FOUND_INF && q == j)) return false;
    }
    for (int q = 0; q < n->nin; q++) {
      if (!(kiln__ops[n->op].stores & (1u << q))) continue;
      for (int j = 0; j < x->nin; j++)
        if (x->in[j]->st == n->in[q]->st && !(n->op == KILN__OP_FOUND_INF && q == j)) return false;
    }
  }
  return true;
}

/* The first node of the flush after i that reads t, or -1. */
static int32_t reader_of(const kiln_ctx *ctx, const kiln__plan *p, int32_t i,
                         const kiln_tensor *t) {
  for (int32_t j = i + 1; j < p->last; j++) {
    const kiln__node *n = &ctx->trace.nodes[j];
    for (int q = 0; q < n->nin; q++)
      if (n->in[q] == t) return j;
  }
  return -1;
}

/* The BLAS library reads vectors and matrices at 16-byte aligned addresses. */
static bool aligned16(const kiln_tensor *t) {
  return ((uint64_t)t->offset * kiln_dtype_size(t->dtype)) % 16 == 0;
}

static bool bias_vector(const kiln_tensor *b, int64_t ncol) {
  return (b->ndim == 1 || (b->ndim == 2 && b->shape[0] == 1)) && b->shape[b->ndim - 1] == ncol &&
         (ncol == 1 || b->stride[b->ndim - 1] == 1) && b->dtype == KILN_DTYPE_F32 && aligned16(b);
}

/* A dense row-major f32 matrix. */
static bool dense_matrix(const kiln_tensor *t) {
  return t->ndim == 2 && t->dtype == KILN_DTYPE_F32 && kiln__is_contiguous(t) && aligned16(t);
}

/* A GELU input is written or read by the BLAS library only with a leading dimension (columns)
 * that is a multiple of 8. */
#define KILN__GELU_INPUT_COLS 8

/* Products with more output elements than this do not write a ReLU's bit mask: for them
 * cuBLASLt writes it in a kernel of its own after the product (measured on the H200 with CUDA
 * 13.0: the conv products of the cnn workload, 86528 x 32 and 73728 x 64, took 25.5 and 69.9 us
 * with the mask against 16.9 and 41.5 us with bias and ReLU alone; a 128 x 128 product, 13.9 us
 * either way). The ReLU's derivative then reads the ReLU's output, in a generated kernel. */
#define KILN__MASK_MAX_ELEMS ((int64_t)1 << 20)

/* The forward epilogue after product i: + a bias over the columns, then ReLU or the tanh GELU
 * (the library's GELU is the tanh form), which may read a reshape of the product. When the
 * backward pass will need it, ReLU also writes its bit mask and GELU its input. Returns how many
 * of the following nodes it takes (a reshape among them stays a view). */
static int forward_epilogue(kiln_ctx *ctx, const kiln__plan *p, int32_t i, kiln__group *g) {
  const kiln__node *nodes = ctx->trace.nodes, *mm = &nodes[i];
  const kiln_tensor *cur = mm->out, *bias = NULL;
  int64_t ncol = cur->shape[1];
  int32_t last = i;
  if (p->readers[i - p->first] == 1 && !cur->keep && i + 1 < p->last) {
    const kiln__node *add = &nodes[i + 1];
    int side = add->op != KILN__OP_ADD ? -1 : add->in[0] == cur ? 1 : (add->in[1] == cur ? 0 : -1);
    if (side >= 0 && kiln__same_shape(add->out, cur) && bias_vector(add->in[side], ncol) &&
        add->in[side]->st != cur->st) {
      bias = add->in[side];
      cur = add->out;
      last = i + 1;
    }
  }
  const kiln__node *act = NULL;
  /* the activation may read a reshape of the product (a convolution's rows as an image) */
  int32_t at = last + 1;
  const kiln_tensor *act_in = cur;
  bool alone = p->readers[last - p->first] == 1 && !cur->keep;
  if (at < p->last && nodes[at].op == KILN__OP_RESHAPE && nodes[at].in[0] == cur && alone) {
    act_in = nodes[at].out;
    alone = p->readers[at - p->first] == 1 && !act_in->keep;
    at++;
  }
  if (at < p->last) {
    /* the GELU input may have other readers: the epilogue writes it */
    const kiln__node *r = &nodes[at];
    if (r->in[0] == act_in && ((r->op == KILN__OP_RELU && alone) || r->op == KILN__OP_GELU_TANH))
      act = r;
  }
  kiln__epi epi = kiln__epi_forward(bias != NULL, 0, false);
  const kiln_tensor *aux = NULL;
  if (act && act->op == KILN__OP_RELU) {
    /* the backward pass's DRELU reads the mask */
    bool mask = act->out->requires_grad && kiln_tensor_numel(act->out) <= KILN__MASK_MAX_ELEMS;
    epi = kiln__epi_forward(bias != NULL, 'r', mask);
    aux = mask ? act->out : NULL;
  } else if (act) {
    /* GELU's backward reads its input, and so may other nodes */
    bool input = act->out->requires_grad || p->readers[last - p->first] > 1 || cur->keep;
    if (input && ncol % KILN__GELU_INPUT_COLS != 0) {
      act = NULL;
    } else {
      epi = kiln__epi_forward(bias != NULL, 'g', input);
      aux = input ? cur : NULL;
    }
  }
  if (act && !kiln__blas_supports(ctx, mm->in[0], mm->in[1], epi)) {
    act = NULL;
    aux = NULL;
    epi = kiln__epi_forward(bias != NULL, 0, false);
  }
  if (epi == KILN__EPI_NONE || !kiln__blas_supports(ctx, mm->in[0], mm->in[1], epi)) return 0;
  g->epi = epi;
  g->bias = bias;
  g->aux = aux;
  g->out = act ? act->out : cur;
  return act ? at - i : last - i;
}

/* The backward epilogue of product i, dY = g W: its one reader multiplies it by the derivative
 * of a ReLU (whose forward product left a bit mask) or of the tanh GELU (at its saved input),
 * and a sum over the rows of that (the bias gradient) may follow. The group takes both nodes
 * (they run at i: everything they read exists by then). Returns false out of memory. */
static bool backward_epilogue(kiln_ctx *ctx, kiln__plan *p, int32_t i, kiln__group *g) {
  const kiln__node *nodes = ctx->trace.nodes, *mm = &nodes[i];
  if (p->readers[i - p->first] != 1 || mm->out->keep) return true;
  int32_t r = reader_of(ctx, p, i, mm->out);
  if (r < 0 || p->group_of[r - p->first] >= 0) return true;
  const kiln__node *d = &nodes[r];
  if ((d->op != KILN__OP_RELU_GRAD && d->op != KILN__OP_GELU_TANH_GRAD) || d->in[0] != mm->out ||
      !kiln__same_shape(d->out, mm->out) || !kiln__same_shape(d->in[1], mm->out) ||
      d->in[1] == mm->out)
    return true;
  const kiln_tensor *aux = d->in[1];
  int32_t pa = producer(ctx, p, aux);
  if (pa >= i) return true;
  bool relu = d->op == KILN__OP_RELU_GRAD;
  if (relu) {
    /* the mask exists (an earlier flush) or this flush's forward product writes it */
    const kiln__group *pg =
        pa >= 0 && p->group_of[pa - p->first] >= 0 ? &p->g[p->group_of[pa - p->first]] : NULL;
    bool mask =
        aux->st->relu_mask != NULL || (pg && pg->aux == aux && pg->kind == KILN__KIND_MATMUL);
    if (!mask) return true;
  } else if (!dense_matrix(aux) || aux->shape[1] % KILN__GELU_INPUT_COLS != 0) {
    return true;
  }
  /* the bias gradient: the sum over the rows of d's output, d's reader */
  int32_t s = -1;
  for (int32_t k = r + 1; k < p->last && s < 0; k++) {
    const kiln__node *n = &nodes[k];
    if (n->op == KILN__OP_SUM && n->in[0] == d->out && KILN__RI(n, mask) == 1 &&
        p->group_of[k - p->first] < 0 && p->claim[k - p->first] < 0 &&
        bias_vector(n->out, d->out->shape[1]))
      s = k;
  }
  kiln__epi epi = kiln__epi_backward(relu ? 'r' : 'g', s >= 0);
  if (!kiln__blas_supports(ctx, mm->in[0], mm->in[1], epi)) return true;
  g->epi = epi;
  g->aux = aux;
  g->bias = s >= 0 ? nodes[s].out : NULL;
  g->out = d->out;
  return add_member(ctx, p, g, r) && (s < 0 || add_member(ctx, p, g, s));
}

/* A weight gradient dW = T^T X (product i, its A a transposed view of T) and a sum of T over its
 * rows (the bias gradient) become one call: the BGRADB epilogue sums the rows of A. Returns the
 * sum's node, or -1. The sum may be anywhere in the flush if nothing reads it before i. */
static int32_t bgradb_sum(kiln_ctx *ctx, const kiln__plan *p, int32_t i) {
  const kiln__node *nodes = ctx->trace.nodes, *mm = &nodes[i];
  const kiln_tensor *A = mm->in[0];
  if (mm->out->ndim != 2 || A->ndim != 2 || A->persistent || A->node < 0 || A->node >= ctx->trace.n)
    return -1;
  const kiln__node *v = &nodes[A->node];
  if (v->op != KILN__OP_PERMUTE || v->out != A) return -1;
  const kiln_tensor *T = v->in[0];
  if (!dense_matrix(T) || T->shape[0] != A->shape[1] || T->shape[1] != A->shape[0]) return -1;
  for (int32_t k = p->first; k < p->last; k++) {
    const kiln__node *n = &nodes[k];
    if (n->op != KILN__OP_SUM || n->in[0] != T || KILN__RI(n, mask) != 1 ||
        !bias_vector(n->out, T->shape[1]))
      continue;
    for (int32_t j = k + 1; j < i; j++) /* read before the product would run: no */
      for (int q = 0; q < nodes[j].nin && kiln__ops[nodes[j].op].kind != KILN__KIND_VIEW; q++)
        if (nodes[j].in[q]->st == n->out->st) return -1;
    if (!kiln__blas_supports(ctx, mm->in[0], mm->in[1], KILN__EPI_BGRADB)) return -1;
    return k;
  }
  return -1;
}

/* Write-through: assignment i of an intermediate S, or of a view of S that is dense from S's
 * first element (the same bytes in the same order), to a persistent buffer D (a gradient) can be
 * dropped when S's producer writes D itself: S is dense and as large as D, nothing in the flush
 * touches D before i, and nothing reads S after i. Returns S's producer, or -1. */
/* Whether node n reads t as write-through's exception below allows: n elementwise and before
 * S's producer, itself elementwise (before: n precedes it), n's output and t of S's shape, t
 * all of its buffer. */
static bool reads_in_step(const kiln__node *n, const kiln_tensor *t, bool before,
                          const kiln__node *s) {
  const kiln_tensor *S = s->out;
  return before && kiln__ops[n->op].kind == KILN__KIND_EW &&
         kiln__ops[s->op].kind == KILN__KIND_EW && n->out && kiln__same_shape(n->out, S) &&
         kiln__same_shape(t, S) && kiln__is_contiguous(t) && t->offset == 0;
}

static int32_t write_through(const kiln_ctx *ctx, const kiln__plan *p, int32_t i) {
  const kiln__node *nodes = ctx->trace.nodes, *a = &nodes[i];
  if (a->op != KILN__OP_ASSIGN) return -1;
  const kiln_tensor *D = a->in[0], *x = a->in[1];
  if (!D->persistent || !kiln__is_contiguous(D) || D->offset != 0 || !kiln__is_contiguous(x) ||
      x->offset != 0 || kiln_tensor_numel(x) != kiln_tensor_numel(D))
    return -1;
  for (;;) { /* through views to the value they show */
    int32_t v = producer(ctx, p, x);
    if (v < 0 || kiln__ops[nodes[v].op].kind != KILN__KIND_VIEW) break;
    x = nodes[v].in[0];
  }
  int32_t s = producer(ctx, p, x);
  if (s < 0) return -1;
  kiln__kind kind = kiln__ops[nodes[s].op].kind;
  const kiln_tensor *S = nodes[s].out;
  if (kind == KILN__KIND_VIEW || kind == KILN__KIND_UPDATE || S->keep || S->offset != 0 ||
      !kiln__is_contiguous(S) || S->dtype != D->dtype || S->st->bytes != D->st->bytes ||
      kiln_tensor_numel(S) != kiln_tensor_numel(D))
    return -1;
  /* nothing of the flush before the assignment touches D (a kernel writing S into D while it
   * reads D elsewhere would race), nothing after it reads S; except, where S is elementwise,
   * elementwise nodes before it that read all of D as S's shape (a running statistic's old value
   * in its update): a group grows over consecutive nodes, so such a node runs in a kernel before
   * S's or in S's own, whose space is then S's, each thread reading D's element before it writes
   * the same element; and a moments node before S that reads D as its shift (the running mean,
   * KILN_CONV_FPROP_MOMENTS' shift), which runs in a kernel of its own or a forward product's,
   * before S's */
  for (int32_t j = p->first; j < p->last; j++) {
    const kiln__node *n = &nodes[j];
    if (j == i || kiln__ops[n->op].kind == KILN__KIND_VIEW) continue;
    for (int q = 0; q < n->nin; q++) {
      if (j > i && n->in[q]->st == S->st) return -1;
      bool shift = n->op == KILN__OP_MOMENTS && q == 1 && j < s;
      if (j < i && n->in[q]->st == D->st && !shift && !reads_in_step(n, n->in[q], j < s, &nodes[s]))
        return -1;
    }
  }
  return s;
}

/* ---------------------------------------------------------------- phases */

typedef bool (*phase_fn)(kiln_ctx *ctx, kiln__plan *p, bool fuse);

static bool phase_readers(kiln_ctx *ctx, kiln__plan *p, bool fuse) {
  (void)fuse;
  const kiln__node *nodes = ctx->trace.nodes;
  for (int32_t i = p->first; i < p->last; i++) {
    p->group_of[i - p->first] = -1;
    p->claim[i - p->first] = -1;
    p->window[i - p->first] = -1;
    for (int j = 0; j < nodes[i].nin; j++) {
      int32_t pr = producer(ctx, p, nodes[i].in[j]);
      if (pr >= 0) p->readers[pr - p->first]++;
    }
  }
  return true;
}

static bool phase_write_through(kiln_ctx *ctx, kiln__plan *p, bool fuse) {
  for (int32_t i = p->first; i < p->last && fuse; i++) {
    int32_t s = write_through(ctx, p, i);
    if (s < 0 || p->write_to[s - p->first]) continue;
    p->write_to[s - p->first] = ctx->trace.nodes[i].in[0];
    p->claim[i - p->first] = s;
  }
  return true;
}

static bool phase_bias_gradients(kiln_ctx *ctx, kiln__plan *p, bool fuse) {
  for (int32_t i = p->first; i < p->last && fuse; i++) {
    if (ctx->trace.nodes[i].op != KILN__OP_MATMUL) continue;
    int32_t s = bgradb_sum(ctx, p, i);
    if (s >= 0 && p->claim[s - p->first] < 0) p->claim[s - p->first] = i;
  }
  return kiln__ok(ctx);
}

static bool phase_implicit(kiln_ctx *ctx, kiln__plan *p, bool fuse) {
  for (int32_t i = p->first; i < p->last && fuse; i++) {
    int32_t mm = kiln__implicit_dgrad(ctx, p, i), f, w;
    if (mm >= 0) p->claim[mm - p->first] = i; /* col2im's group computes the product */
    kiln__group none = {0};
    if (kiln__implicit_conv(ctx, p, i, &f, &w) &&
        (f < 0 || forward_epilogue(ctx, p, f, &none) == 0)) {
      /* the forward product's group computes im2col; without one, the weight gradient's */
      p->claim[i - p->first] = f >= 0 ? f : w;
      if (f >= 0) p->window[f - p->first] = i;
      if (w >= 0) p->window[w - p->first] = i;
    }
  }
  return true;
}

static bool phase_groups(kiln_ctx *ctx, kiln__plan *p, bool fuse) {
  const kiln__node *nodes = ctx->trace.nodes;
  int32_t first = p->first;
  kiln__group *open = NULL; /* the elementwise run or row program being grown */
  for (int32_t i = first; i < p->last; i++) {
    const kiln__node *nd = &nodes[i];
    kiln__kind kind = kiln__ops[nd->op].kind;
    if (kind == KILN__KIND_VIEW || p->group_of[i - first] >= 0 || p->claim[i - first] >= 0)
      continue;
    if (open && open->full) { /* a row program */
      kiln__alias alias[KILN__MAX_IN];
      int na = 0;
      if ((kind == KILN__KIND_EW || kind == KILN__KIND_REDUCE) &&
          can_join_rows(ctx, p, open, i, alias, &na)) {
        if (!add_member(ctx, p, open, i)) return false;
        for (int k = 0; k < na; k++)
          if (!add_alias(ctx, p, open, alias[k].view, alias[k].value)) return false;
        open->rows = true;
        continue;
      }
      open = NULL;
    }
    int32_t casts[KILN__MAX_CASTS];
    int nc = kind == KILN__KIND_EW && fuse && ctx->cast_batch && kiln__batch_cast(ctx, p, i)
                 ? kiln__batch_casts(ctx, p, i, casts)
                 : 0;
    if (nc >= 2 && casts[0] == i) { /* parameters' casts, each over its own shape, at once */
      open = NULL;
      kiln__group *g = new_group(ctx, p, KILN__KIND_EW, i);
      if (!g) return false;
      g->batch = true;
      for (int k = 0; k < nc; k++)
        if (!add_member(ctx, p, g, casts[k])) return false;
      continue;
    }
    if (kind == KILN__KIND_EW) {
      if (fuse && open && can_join(ctx, p, open, i)) {
        if (!add_member(ctx, p, open, i)) return false;
        continue;
      }
      open = new_group(ctx, p, KILN__KIND_EW, i);
      if (!open || !add_member(ctx, p, open, i)) return false;
      if (!fuse) open = NULL;
      continue;
    }
    if (kind == KILN__KIND_REDUCE && fuse && open && open->kind == KILN__KIND_EW) {
      /* fuse-on-read: the run computes the reduction's input */
      if (in_group(p, producer(ctx, p, nd->in[0]), open) && prologue_ok(ctx, p, open, i)) {
        open->kind = KILN__KIND_REDUCE;
        open->node = i;
        if (!add_member(ctx, p, open, i)) return false;
        open->full = row_reduction(nd) ? nd->in[0] : NULL;
        if (!open->full) open = NULL;
        continue;
      }
    }
    bool room = fuse && open && fits(ctx, p, open, i, 0); /* for i in open's kernel */
    if (room && (kiln__dgrad_moments(ctx, p, open, i) || kiln__pool_moments(ctx, p, open, i) ||
                 kiln__window_moments(ctx, p, open, i))) {
      if (!add_member(ctx, p, open, i)) return false; /* the group's kernel sums its block's rows */
      open->moments = true;
      open = NULL;
      continue;
    }
    if (room &&
        (kiln__pool_grad_prologue(ctx, p, open, i) || kiln__pool_fwd_prologue(ctx, p, open, i))) {
      /* the run computes dy where the pool's gradient reads it, or the image where the pool
       * reads it */
      open->prologue = open->n;
      open->kind = kind;
      open->node = i;
      if (!add_member(ctx, p, open, i)) return false;
      open = NULL;
      continue;
    }
    open = NULL;
    if (kind == KILN__KIND_UPDATE && fuse && p->ng > 0 && can_batch(ctx, p, &p->g[p->ng - 1], i)) {
      if (!add_member(ctx, p, &p->g[p->ng - 1], i)) return false;
      continue;
    }
    if (nd->op == KILN__OP_CONCAT) { /* one copy per input (lower.c) */
      for (int k = 0; k < nd->nin; k++) {
        kiln__group *g = new_group(ctx, p, KILN__KIND_LIB, i);
        if (!g) return false;
        g->sub = k;
        p->group_of[i - first] = (int32_t)(g - p->g);
      }
      continue;
    }
    if (p->window[i - first] >= 0) { /* an implicit forward product or weight gradient */
      int32_t c = p->window[i - first];
      kiln__group *g = new_group(ctx, p, KILN__KIND_LIB, i);
      if (!g) return false;
      g->window = c;
      g->implicit = kiln__implicit_fprop(ctx, p, i) ? KILN__IMPLICIT_FPROP : KILN__IMPLICIT_WGRAD;
      if ((g->implicit == KILN__IMPLICIT_FPROP && !add_member(ctx, p, g, c)) ||
          !add_member(ctx, p, g, i))
        return false;
      int32_t epi[8]; /* a direct forward product's unary epilogue */
      int ne = kiln__direct_epilogue(ctx, p, g, epi, 8);
      for (int k = 0; k < ne; k++)
        if (!add_member(ctx, p, g, epi[k])) return false;
      int32_t pool = kiln__conv_pool(ctx, p, g); /* pooled in the product's epilogue */
      if (pool >= 0 && !add_member(ctx, p, g, pool)) return false;
      int32_t mom = kiln__fprop_moments(ctx, p, g); /* batch norm's statistics there too */
      if (mom >= 0 && !add_member(ctx, p, g, mom)) return false;
      g->moments = mom >= 0;
      int32_t cast, assign; /* the weight's f32 gradient written by the kernel */
      if (g->implicit == KILN__IMPLICIT_WGRAD && kiln__wgrad_into_grad(ctx, p, i, &cast, &assign)) {
        g->grad = ctx->trace.nodes[assign].in[0];
        p->claim[assign - first] = -1; /* no longer the cast's to write through */
        p->write_to[cast - first] = NULL;
        if (!add_member(ctx, p, g, cast) || !add_member(ctx, p, g, assign)) return false;
      }
      continue;
    }
    kiln__group *g = new_group(ctx, p, kind, i);
    if (!g) return false;
    if (nd->op == KILN__OP_COL2IM && fuse) { /* the product it sums, as an implicit GEMM */
      int32_t r = producer(ctx, p, nd->in[0]), mm = r >= 0 ? producer(ctx, p, nodes[r].in[0]) : -1;
      if (mm >= 0 && p->claim[mm - first] == i) {
        g->implicit = KILN__IMPLICIT_DGRAD;
        g->wgmma = kiln__dgrad_on_wgmma(ctx, nd, nd->out->dtype, nodes[mm].in[0]->shape[1],
                                        nd->out->shape[3]);
        if (!add_member(ctx, p, g, mm)) return false;
      }
    }
    if (!add_member(ctx, p, g, i)) return false;
    if (fuse && kiln__takes_epilogue(nd->op)) open = g; /* elementwise nodes after it join */
    if (kind == KILN__KIND_REDUCE && fuse && row_reduction(nd)) {
      g->full = nd->in[0];
      open = g;
    }
    if (kind == KILN__KIND_MATMUL && fuse && nd->out->ndim == 2) {
      int32_t s = bgradb_sum(ctx, p, i);
      if (s >= 0 && p->claim[s - first] == i) {
        g->epi = KILN__EPI_BGRADB;
        g->bias = nodes[s].out;
        if (!add_member(ctx, p, g, s)) return false;
        continue;
      }
      int take = forward_epilogue(ctx, p, i, g);
      for (int k = 1; k <= take; k++) /* a reshape between the bias and ReLU stays a view */
        if (kiln__ops[nodes[i + k].op].kind != KILN__KIND_VIEW && !add_member(ctx, p, g, i + k))
          return false;
      if (take == 0 && !backward_epilogue(ctx, p, i, g)) return false;
    }
  }
  return kiln__ok(ctx);
}

static bool phase_stores(kiln_ctx *ctx, kiln__plan *p, bool fuse) {
  const kiln__node *nodes = ctx->trace.nodes;
  int32_t first = p->first;
  for (int32_t i = first; i < p->last; i++) {
    const kiln__node *nd = &nodes[i];
    if (!nd->out || kiln__ops[nd->op].kind == KILN__KIND_VIEW) continue;
    p->store[i - first] = !fuse || p->readers[i - first] == 0 || nd->out->keep;
  }
  for (int32_t i = first; i < p->last; i++) {
    const kiln__node *nd = &nodes[i];
    bool view = kiln__ops[nd->op].kind == KILN__KIND_VIEW;
    if (!view && kiln__keeps_output(nd)) p->store[i - first] = true;
    for (int j = 0; j < nd->nin; j++) {
      int32_t pr = producer(ctx, p, nd->in[j]);
      if (pr < 0) continue;
      bool outside = view || p->group_of[i - first] != p->group_of[pr - first];
      if (outside || kiln__rule_reads_input(nd, j)) p->store[pr - first] = true;
    }
  }
  return true;
}

static bool phase_product_outputs(kiln_ctx *ctx, kiln__plan *p, bool fuse) {
  (void)fuse;
  const kiln__node *nodes = ctx->trace.nodes;
  for (int k = 0; k < p->ng; k++) {
    kiln__group *g = &p->g[k];
    if (g->implicit == KILN__IMPLICIT_DGRAD || g->implicit == KILN__IMPLICIT_FPROP) {
      /* the column matrix exists only in the kernel's tiles; the product is written, or its
       * epilogue's last value (a direct product's) */
      p->store[p->members[g->first] - p->first] = false;
      p->store[p->members[g->first + g->n - 1] - p->first] |= g->implicit != KILN__IMPLICIT_DGRAD;
      if (g->implicit == KILN__IMPLICIT_FPROP && g->n - g->moments > 2)
        p->store[g->node - p->first] = false;
    }
    if (g->implicit == KILN__IMPLICIT_WGRAD) { /* its result, or the gradient made of it */
      if (p->claim[g->window - p->first] == g->node) p->store[g->window - p->first] = false;
      p->store[g->node - p->first] = !g->grad;
      if (g->grad) p->store[p->members[g->first + 1] - p->first] = false;
      for (int m = 0; m < g->prologue; m++) /* its dY's run, computed where dY is loaded */
        p->store[p->members[g->first + m] - p->first] = false;
    }
    if (g->kind != KILN__KIND_MATMUL) continue;
    /* the product's own result is written, or only its epilogue's, and what the epilogue
     * writes beside it: a GELU's input, a bias gradient */
    const kiln_tensor *out = g->out ? g->out : nodes[g->node].out;
    unsigned f = kiln__epi_flags(g->epi);
    for (int m = 0; m < g->n; m++) {
      int32_t i = p->members[g->first + m];
      const kiln_tensor *t = nodes[i].out;
      bool written_aux = t == g->aux && (f & KILN__EPI_WRITES_INPUT);
      p->store[i - p->first] = t == out || written_aux || (t == g->bias && (f & KILN__EPI_BGRAD));
    }
    g->out = out;
  }
  return true;
}

static const struct {
  const char *name;
  phase_fn run;
} phases[] = {
    {"readers", phase_readers},
    {"write-through", phase_write_through},
    {"bias gradients", phase_bias_gradients},
    {"implicit products", phase_implicit},
    {"groups", phase_groups},
    {"sink", kiln__phase_sink},
    {"few prologue", kiln__phase_few_prologue},
    {"stores", phase_stores},
    {"product outputs", phase_product_outputs},
};

/* KILN_DEBUG=plan: the flush's groups on stderr. */
static void print_plan(const kiln_ctx *ctx, const kiln__plan *p) {
  kiln__sb sb = {0};
  kiln__plan_describe(ctx, p, &sb);
  fprintf(stderr, "kiln: plan of trace nodes [%d, %d): %d groups: %s\n", p->first, p->last, p->ng,
          sb.s ? sb.s : "");
  kiln__sb_free(&sb);
}

bool kiln__plan_build(kiln_ctx *ctx, int32_t first, int32_t last, bool fuse, kiln__plan *p) {
  memset(p, 0, sizeof *p);
  p->first = first;
  p->last = last;
  size_t n = (size_t)(last - first > 0 ? last - first : 1);
  p->group_of = malloc(n * sizeof *p->group_of);
  p->store = calloc(n, sizeof *p->store);
  p->claim = malloc(n * sizeof *p->claim);
  p->write_to = calloc(n, sizeof *p->write_to);
  p->readers = calloc(n, sizeof *p->readers);
  p->window = malloc(n * sizeof *p->window);
  bool ok =
      (p->group_of && p->store && p->claim && p->write_to && p->readers && p->window) || oom(ctx);
  for (size_t k = 0; ok && k < sizeof phases / sizeof phases[0]; k++)
    ok = phases[k].run(ctx, p, fuse);
  if (!ok) {
    kiln__plan_free(p);
    return false;
  }
  if (ctx->debug & KILN__DEBUG_PLAN) print_plan(ctx, p);
  if (ctx->debug & KILN__DEBUG_VERIFY) {
    char why[512];
    if (kiln__plan_verify(ctx, p, why, sizeof why)) {
      print_plan(ctx, p);
      kiln__assert_fail(why, __FILE__, __LINE__);
    }
  }
  return true;
}

void kiln__plan_free(kiln__plan *p) {
  free(p->g);
  free(p->members);
  free(p->alias);
  free(p->group_of);
  free(p->store);
  free(p->claim);
  free(p->write_to);
  free(p->readers);
  free(p->window);
  memset(p, 0, sizeof *p);
}
