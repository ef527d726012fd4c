/*
 * graph.c: step graphs. At kiln_step_end the engine (engine.c) hands the step's whole trace here
 * (kiln__graph_run). Its signature (every
 * node's op, integer attributes, shapes, strides and dtypes, where each input comes from: an
 * earlier node of the step or which persistent tensor at which address) is hashed and looked up
 * in a small cache. A new signature is planned, lowered, rendered and compiled (exec.c), given a
 * static memory plan (every intermediate an offset in an arena, from its lifetime over the
 * step's launches; graphs share arenas), run, and captured into a CUDA graph; a known one binds the
 * step's tensors to the same addresses, writes the step values (every float and 64-bit attribute:
 * learning rates, step counts, dropout offsets, batch offsets) to the device, and replays the
 * graph. A capture counts the device records each group's nodes make, so that a trace (prof/prof.h)
 * can give a replay's kernels to their groups in order.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../core/cuda_check.h"
#include "../prof/prof.h"
#include "fusion.h"

struct kiln__step_graph {
  uint64_t hash;
  uint8_t *sig;
  size_t sig_len;
  kiln__program prog; /* groups, kernels, arguments and where their attributes come from */
  void *arena;        /* shared with the graphs whose plans fit in it (arena_take) */
  size_t arena_bytes, arena_sum, arena_live;
  int64_t *off;       /* per node: its output's offset in the arena, -1 for none */
  int64_t *mask_off;  /* per node: its ReLU mask's offset, -1 for none */
  bool *clobbered;    /* per node: a later value of the step reuses its memory */
  void *values;       /* the step values on the device, one kiln__stepvals per group */
  kiln__devbuf tmaps; /* its TMA-fed convolutions' tensor maps (conv_tma.cuh) */
  cudaGraphExec_t exec;
  uint64_t kernels, last_used;
  kiln_flush_stats flush;
  int32_t *records; /* per group: the device records its captured nodes make (-1: unknown) */
  /* its groups as a program of the trace being recorded: the id, and the session's serial */
  uint32_t traced;
  uint64_t traced_in;
};

/* ---------------------------------------------------------------- signatures */

static void put_layout(kiln__sb *s, const kiln_tensor *t) {
  int32_t h[3] = {t->ndim, (int32_t)t->dtype, (t->requires_grad ? 1 : 0) | (t->keep ? 2 : 0)};
  kiln__sb_put(s, h, sizeof h);
  kiln__sb_put(s, t->shape, (size_t)t->ndim * sizeof t->shape[0]);
  kiln__sb_put(s, t->stride, (size_t)t->ndim * sizeof t->stride[0]);
  kiln__sb_put(s, &t->offset, sizeof t->offset);
}

/* The step's structure: what the plan, the kernels and the graph depend on. Float and 64-bit
 * attributes are left out (they are step values), except whether consecutive updates share
 * their float attributes (multi-tensor batching depends on it). */
static bool signature(const kiln_ctx *ctx, kiln__sb *s) {
  const kiln__node *nodes = ctx->trace.nodes;
  int32_t mode[2] = {ctx->fusion, ctx->tf32};
  kiln__sb_put(s, mode, sizeof mode);
  for (int32_t i = 0; i < ctx->trace.n; i++) {
    const kiln__node *n = &nodes[i];
    int32_t h[3] = {(int32_t)n->op, n->nin, 0};
    if (i > 0 && kiln__ops[n->op].kind == KILN__KIND_UPDATE)
      h[2] = memcmp(n->f, nodes[i - 1].f, sizeof n->f) == 0;
    kiln__sb_put(s, h, sizeof h);
    kiln__sb_put(s, n->i, sizeof n->i);
    if (n->out) put_layout(s, n->out);
    for (int q = 0; q < n->nin; q++) {
      const kiln_tensor *x = n->in[q];
      int64_t src[3] = {-1, 0, 0};
      if (x->node >= 0 && x->node < i && nodes[x->node].out == x) {
        src[0] = x->node;
      } else {
        src[1] = (int64_t)(uintptr_t)x;
        src[2] = (int64_t)(uintptr_t)x->st->ptr;
        put_layout(s, x);
      }
      kiln__sb_put(s, src, sizeof src);
    }
  }
  return !s->oom;
}

/* ---------------------------------------------------------------- static memory plan */

#define ALIGN KILN__ALLOC_ALIGN /* as the allocator's blocks: kernels rely on it (render.c) */

typedef struct item {
  int32_t node;
  bool mask;
  int def, last; /* first and last launch (group) that touch it */
  size_t bytes, off;
} item;

static size_t round_up(size_t n) { return (n + ALIGN - 1) / ALIGN * ALIGN; }

/* Step graphs share arenas: a step's intermediates are dead once the next step begins (their
 * handles go stale), and graphs replay one after another on the context's one stream, so a graph
 * needs its memory only while it runs. A new plan takes the smallest arena it fits in, or a new
 * one of its size: when the largest step comes first (training, then evaluation and test-time
 * augmentation's steps), every graph shares its arena, and the memory is the largest plan's,
 * not the sum of them. An arena goes back to the allocator with its last graph. */
static void *arena_take(kiln_ctx *ctx, size_t bytes) {
  kiln__fusion *fs = ctx->fusion_state;
  if (bytes == 0) return NULL;
  int best = -1;
  for (int k = 0; k < fs->narenas; k++)
    if (fs->arenas[k].bytes >= bytes && (best < 0 || fs->arenas[k].bytes < fs->arenas[best].bytes))
      best = k;
  if (best < 0) {
    KILN_ASSERT(fs->narenas < KILN__MAX_GRAPHS + 1); /* every arena has a graph */
    void *p = kiln__dev_alloc(ctx, bytes);
    if (!p) return NULL;
    best = fs->narenas++;
    fs->arenas[best].ptr = p;
    fs->arenas[best].bytes = bytes;
    fs->arenas[best].refs = 0;
  }
  fs->arenas[best].refs++;
  ctx->stats.graphs_arena_bytes = 0;
  for (int k = 0; k < fs->narenas; k++)
    ctx->stats.graphs_arena_bytes += fs->arenas[k].bytes;
  return fs->arenas[best].ptr;
}

static void arena_drop(kiln_ctx *ctx, void *p) {
  kiln__fusion *fs = ctx->fusion_state;
  if (!p) return;
  int k = 0;
  while (k < fs->narenas && fs->arenas[k].ptr != p)
    k++;
  KILN_ASSERT(k < fs->narenas);
  if (--fs->arenas[k].refs > 0) return;
  ctx->stats.graphs_arena_bytes -= fs->arenas[k].bytes;
  kiln__dev_free(ctx, p);
  fs->arenas[k] = fs->arenas[--fs->narenas];
}

/* The step's intermediates and ReLU masks, each with its lifetime in launch order and, once
 * placed, its offset in the arena. */
typedef struct mplan {
  item *it;
  int ni;
  int32_t *item_of, *mask_of; /* per node: its value's item, its mask's item (-1: none) */
  size_t top, sum;            /* the arena's size; the sum of the items, had each its own memory */
  size_t live;                /* the most live at one launch (no placement needs less), */
  int live_at;                /* at this launch */
} mplan;

static void mplan_free(mplan *m) {
  free(m->it);
  free(m->item_of);
  free(m->mask_of);
}

/* Every written intermediate and ReLU mask of the planned step, with its first and last launch;
 * values nothing in the step reads (the loss) live to its end. */
static bool lifetimes(kiln_ctx *ctx, const kiln__plan *p, mplan *m) {
  const kiln__node *nodes = ctx->trace.nodes;
  int32_t n = ctx->trace.n;
  memset(m, 0, sizeof *m);
  item *it = m->it = malloc((size_t)(2 * n + 1) * sizeof *it);
  int32_t *item_of = m->item_of = malloc((size_t)(n + 1) * sizeof *item_of),
          *mask_of = m->mask_of = malloc((size_t)(n + 1) * sizeof *mask_of);
  if (!it || !item_of || !mask_of) {
    mplan_free(m);
    return !kiln__error(ctx, KILN_ERR_OOM, "kiln_step_end: out of host memory");
  }
  int ni = 0;
  for (int32_t i = 0; i < n; i++) {
    item_of[i] = mask_of[i] = -1;
    const kiln__node *nd = &nodes[i];
    if (!nd->out || kiln__ops[nd->op].kind == KILN__KIND_VIEW || nd->out->st->persistent ||
        !p->store[i] || nd->out->st->bytes == 0 || p->group_of[i] < 0 || p->write_to[i])
      continue;
    item_of[i] = ni;
    /* a concat's output is written by one copy per input, the last of them its group */
    int def = p->group_of[i] - (nd->op == KILN__OP_CONCAT ? nd->nin - 1 : 0);
    it[ni++] = (item){.node = i, .def = def, .last = -1, .bytes = nd->out->st->bytes};
  }
  for (int k = 0; k < p->ng; k++) {
    const kiln__group *g = &p->g[k];
    if (kiln__epi_flags(g->epi) & KILN__EPI_WRITES_MASK) {
      int32_t r = kiln__owner(ctx, g->aux);
      if (r < 0) continue;
      mask_of[r] = ni;
      it[ni++] = (item){
          .node = r, .mask = true, .def = k, .last = -1, .bytes = kiln__relu_mask_bytes(g->aux)};
    }
  }
  /* last uses: every member's inputs, and the masks the backward epilogues read */
  for (int k = 0; k < p->ng; k++) {
    const kiln__group *g = &p->g[k];
    int nm = g->n ? g->n : 1;
    for (int q0 = 0; q0 < nm; q0++) {
      const kiln__node *nd = &nodes[g->n ? p->members[g->first + q0] : g->node];
      for (int q = 0; q < nd->nin; q++) {
        int32_t o = kiln__owner(ctx, nd->in[q]);
        if (o >= 0 && item_of[o] >= 0 && it[item_of[o]].last < k) it[item_of[o]].last = k;
      }
    }
    if (g->implicit == KILN__IMPLICIT_WGRAD) { /* it gathers its columns from the image */
      int32_t o = kiln__owner(ctx, nodes[g->window].in[0]);
      if (o >= 0 && item_of[o] >= 0 && it[item_of[o]].last < k) it[item_of[o]].last = k;
    }
    if (kiln__epi_flags(g->epi) & KILN__EPI_READS_MASK) {
      int32_t o = kiln__owner(ctx, g->aux);
      if (o >= 0 && mask_of[o] >= 0 && it[mask_of[o]].last < k) it[mask_of[o]].last = k;
    }
  }
  for (int j = 0; j < ni; j++) {
    if (it[j].mask) continue;
    /* read by nothing in the step, or by the host: kept to the end */
    if (it[j].last < 0 || nodes[it[j].node].out->keep) it[j].last = p->ng;
    if (it[j].last < it[j].def) it[j].last = it[j].def;
  }
  for (int j = 0; j < ni; j++)
    if (it[j].mask && it[j].last < it[j].def) it[j].last = p->ng; /* a mask no product read */
  m->ni = ni;
  return true;
}

static bool overlap_in_time(const item *a, const item *b) {
  return a->def <= b->last && b->def <= a->last;
}

typedef struct span {
  size_t lo, hi;
} span;
static int by_lo(const void *a, const void *b) {
  const span *x = a, *y = b;
  return x->lo < y->lo ? -1 : x->lo > y->lo;
}

/* Places the items in the given order, each at the lowest offset clear of every placed item whose
 * lifetime overlaps its own (first fit); returns the arena's size. busy: room for ni spans. */
static size_t place_in_order(item *it, const int *order, int ni, span *busy) {
  size_t top = 0;
  for (int a = 0; a < ni; a++) {
    item *x = &it[order[a]];
    size_t need = round_up(x->bytes), at = 0;
    int nb = 0;
    for (int b = 0; b < a; b++) {
      const item *y = &it[order[b]];
      if (overlap_in_time(x, y)) busy[nb++] = (span){y->off, y->off + round_up(y->bytes)};
    }
    qsort(busy, (size_t)nb, sizeof *busy, by_lo);
    for (int b = 0; b < nb && busy[b].lo < at + need; b++) /* the first gap it fits */
      if (busy[b].hi > at) at = busy[b].hi;
    x->off = at;
    if (at + need > top) top = at + need;
  }
  return top;
}

/* Orders in which first fit places the items (place). */
enum { BY_DEFINITION, BY_SIZE, BY_LIFETIME, BY_AREA, NORDERS };

/* An item's key in an order: larger first. */
static double order_key(const item *x, int order) {
  double life = (double)(x->last - x->def + 1), bytes = (double)x->bytes;
  switch (order) {
  case BY_SIZE: return bytes;
  case BY_LIFETIME: return life * 1e15 + bytes; /* longest first, then largest */
  case BY_AREA: return bytes * life;
  default: return -(double)x->def;
  }
}

typedef struct sort_key {
  double key;
  int def, j;
} sort_key;
static int by_key(const void *a, const void *b) { /* larger key first; earlier first among equals */
  const sort_key *x = a, *y = b;
  if (x->key != y->key) return x->key < y->key ? 1 : -1;
  if (x->def != y->def) return x->def < y->def ? -1 : 1;
  return x->j - y->j;
}

/* The indices of the items `idx[0..n)` in the given order. */
static bool sort_items(const item *it, int *idx, int n, int order) {
  sort_key *k = malloc((size_t)(n + 1) * sizeof *k);
  if (!k) return false;
  for (int a = 0; a < n; a++)
    k[a] = (sort_key){.key = order_key(&it[idx[a]], order), .def = it[idx[a]].def, .j = idx[a]};
  qsort(k, (size_t)n, sizeof *k, by_key);
  for (int a = 0; a < n; a++)
    idx[a] = k[a].j;
  free(k);
  return true;
}

/* Offsets for the items: first fit in each of the orders above, the smallest arena of them (first
 * fit in order of definition is the step's own order; largest or longest-lived first keeps
 * long-lived large values from landing above short-lived ones that came before them). */
static bool place(kiln_ctx *ctx, int ng, mplan *m) {
  int ni = m->ni;
  int *order = calloc((size_t)ni + 1, sizeof *order);
  size_t *best = malloc((size_t)(ni + 1) * sizeof *best);
  span *busy = malloc((size_t)(ni + 1) * sizeof *busy);
  if (!order || !best || !busy) {
    free(order), free(best), free(busy);
    return !kiln__error(ctx, KILN_ERR_OOM, "kiln_step_end: out of host memory");
  }
  m->sum = 0;
  for (int j = 0; j < ni; j++)
    m->sum += round_up(m->it[j].bytes);
  m->top = SIZE_MAX;
  for (int o = 0; o < NORDERS; o++) {
    for (int j = 0; j < ni; j++)
      order[j] = j;
    if (!sort_items(m->it, order, ni, o)) {
      free(order), free(best), free(busy);
      return !kiln__error(ctx, KILN_ERR_OOM, "kiln_step_end: out of host memory");
    }
    size_t top = place_in_order(m->it, order, ni, busy);
    if (top < m->top) {
      m->top = top;
      for (int j = 0; j < ni; j++)
        best[j] = m->it[j].off;
    }
  }
  for (int j = 0; j < ni; j++)
    m->it[j].off = best[j];
  if (ni == 0) m->top = 0;
  m->live = 0;
  m->live_at = 0;
  for (int k = 0; k <= ng; k++) {
    size_t live = 0;
    for (int j = 0; j < ni; j++)
      if (m->it[j].def <= k && k <= m->it[j].last) live += round_up(m->it[j].bytes);
    if (live > m->live) m->live = live, m->live_at = k;
  }
  free(order);
  free(best);
  free(busy);
  return true;
}

/* KILN_DEBUG=memory: the arena against the sum of its values and against the most that is live
 * at one launch (no placement does better), and the values live at that launch, largest first. */
static void memory_report(const kiln_ctx *ctx, const kiln__plan *p, const mplan *m) {
  const kiln__node *nodes = ctx->trace.nodes;
  int at = m->live_at;
  fprintf(stderr,
          "kiln: memory plan of %d values: arena %.1f MiB, the values' sum %.1f MiB, the most live "
          "at one launch %.1f MiB (launch %d of %d",
          m->ni, m->top / 1048576.0, m->sum / 1048576.0, m->live / 1048576.0, at, p->ng);
  if (at < p->ng) {
    const kiln__group *g = &p->g[at];
    fprintf(stderr, ", %s", kiln__ops[nodes[g->n ? p->members[g->first] : g->node].op].name);
  }
  fprintf(stderr, "); live there:\n");
  int *order = malloc((size_t)(m->ni + 1) * sizeof *order), nl = 0;
  if (!order) return;
  for (int j = 0; j < m->ni; j++)
    if (m->it[j].def <= at && at <= m->it[j].last) order[nl++] = j;
  if (!sort_items(m->it, order, nl, BY_SIZE)) nl = 0;
  for (int a = 0; a < nl; a++) {
    const item *x = &m->it[order[a]];
    const kiln__node *nd = &nodes[x->node];
    char sh[96];
    fprintf(stderr, "kiln:   %8.2f MiB  #%d %s%s %s %s, launches %d..%d\n", x->bytes / 1048576.0,
            x->node, kiln__ops[nd->op].name, x->mask ? " (its ReLU mask)" : "",
            kiln__shape_of(nd->out, sh, sizeof sh), kiln_dtype_name(nd->out->dtype), x->def,
            x->last);
  }
  free(order);
}

/* The planned step's memory plan (its lifetimes, placed), printed with KILN_DEBUG=memory. */
static bool make_plan(kiln_ctx *ctx, const kiln__plan *p, mplan *m) {
  if (!lifetimes(ctx, p, m)) return false;
  if (!place(ctx, p->ng, m)) {
    mplan_free(m);
    return false;
  }
  if (ctx->debug & KILN__DEBUG_MEMORY) memory_report(ctx, p, m);
  return true;
}

/* Offsets for every written intermediate and ReLU mask of the step, and the arena. */
static bool memory_plan(kiln_ctx *ctx, kiln__step_graph *E) {
  const kiln__node *nodes = ctx->trace.nodes;
  int32_t n = ctx->trace.n;
  mplan m;
  if (!make_plan(ctx, &E->prog.plan, &m)) return false;
  item *it = m.it;
  int ni = m.ni;
  size_t top = m.top;
  E->arena_bytes = top;
  E->arena_sum = m.sum;
  E->arena_live = m.live;
  E->arena = arena_take(ctx, top);
  bool ok = top == 0 || E->arena;
  if (!ok) {
    int big = 0;
    for (int j = 1; j < ni; j++)
      if (it[j].bytes > it[big].bytes) big = j;
    const kiln__node *bn = &nodes[it[big].node];
    char sh[96];
    kiln__error(ctx, KILN_ERR_OOM,
                "kiln_step_end: out of device memory for the step's arena of %zu bytes (the "
                "largest value: node #%d, %s %s, %zu bytes); %zu in use, %zu cached; nothing of "
                "this step ran",
                top, it[big].node, kiln__ops[bn->op].name, kiln__shape_of(bn->out, sh, sizeof sh),
                it[big].bytes, ctx->alloc.in_use, ctx->alloc.cached);
  }
  for (int32_t i = 0; i < n && ok; i++) {
    E->off[i] = m.item_of[i] >= 0 ? (int64_t)it[m.item_of[i]].off : -1;
    E->mask_off[i] = m.mask_of[i] >= 0 ? (int64_t)it[m.mask_of[i]].off : -1;
    E->clobbered[i] = false;
    int j = m.item_of[i];
    for (int q = 0; j >= 0 && q < ni; q++) {
      size_t qe = it[q].off + round_up(it[q].bytes), je = it[j].off + round_up(it[j].bytes);
      if (it[q].def > it[j].last && it[q].off < je && it[j].off < qe) E->clobbered[i] = true;
    }
  }
  mplan_free(&m);
  return ok;
}

/* Points the step's tensors at the graph's arena, as the plan and the capture saw them. */
static void bind(kiln_ctx *ctx, const kiln__step_graph *E) {
  const kiln__plan *p = &E->prog.plan;
  kiln__bind_write_through(ctx, p);
  for (int32_t i = 0; i < ctx->trace.n; i++) {
    kiln__node *nd = &ctx->trace.nodes[i];
    if (!nd->out || kiln__ops[nd->op].kind == KILN__KIND_VIEW || nd->out->st->persistent) continue;
    kiln__storage *st = nd->out->st;
    if (E->off[i] >= 0) {
      st->ptr = (char *)E->arena + E->off[i];
      st->borrowed = true;
      st->fused = false;
      st->clobbered = E->clobbered[i];
    } else if (!p->store[i]) {
      st->fused = true;
    }
    if (E->mask_off[i] >= 0) {
      st->relu_mask = (char *)E->arena + E->mask_off[i];
      st->borrowed = true;
    }
  }
}

/* After a failed capture: the step's tensors have no memory (reading them says the step failed). */
static void unbind(kiln_ctx *ctx, const kiln__step_graph *E) {
  for (int32_t i = 0; i < ctx->trace.n; i++) {
    kiln__node *nd = &ctx->trace.nodes[i];
    if (!nd->out || kiln__ops[nd->op].kind == KILN__KIND_VIEW || !nd->out->st->borrowed) continue;
    if (E->off[i] >= 0) nd->out->st->ptr = NULL;
    if (E->mask_off[i] >= 0) nd->out->st->relu_mask = NULL;
    nd->out->st->borrowed = false;
  }
}

/* ---------------------------------------------------------------- the cache */

static void graph_free(kiln_ctx *ctx, kiln__step_graph *E) {
  if (!E) return;
  if (E->exec) cudaGraphExecDestroy(E->exec);
  arena_drop(ctx, E->arena);
  if (E->values) kiln__dev_free(ctx, E->values);
  if (E->tmaps.p) kiln__dev_free(ctx, E->tmaps.p);
  kiln__program_free(&E->prog);
  free(E->sig);
  free(E->off);
  free(E->mask_off);
  free(E->clobbered);
  free(E->records);
  free(E);
}

void kiln__graphs_free(kiln_ctx *ctx) {
  kiln__fusion *fs = ctx->fusion_state;
  for (int k = 0; k < fs->ngraphs; k++)
    graph_free(ctx, fs->graphs[k]);
  fs->ngraphs = 0;
}

/* Room for one more graph: the least recently used one goes, with a warning when the cache
 * turns over (a loop that makes a new signature every step re-plans every step). */
static void make_room(kiln_ctx *ctx) {
  kiln__fusion *fs = ctx->fusion_state;
  if (fs->ngraphs < KILN__MAX_GRAPHS) return;
  int lru = 0;
  for (int k = 1; k < fs->ngraphs; k++)
    if (fs->graphs[k]->last_used < fs->graphs[lru]->last_used) lru = k;
  (void)cudaStreamSynchronize(ctx->stream); /* its last replay may still be running */
  graph_free(ctx, fs->graphs[lru]);
  fs->graphs[lru] = fs->graphs[--fs->ngraphs];
  ctx->stats.graph_evictions++;
  if (!fs->warned_signatures) {
    fs->warned_signatures = true;
    fprintf(stderr,
            "kiln: warning: %d step signatures seen and the graph cache (%d) is full: each new "
            "signature is planned, compiled and captured again. Keep shapes, ops and persistent "
            "tensors the same from step to step (a new batch tensor every step, say, makes a new "
            "signature), or set KILN_GRAPH=0.\n",
            KILN__MAX_GRAPHS + 1, KILN__MAX_GRAPHS);
  }
}

/* Plans, compiles, runs and captures the step: a new signature. */
static kiln__step_graph *capture(kiln_ctx *ctx, uint64_t hash, kiln__sb *sig) {
  int32_t n = ctx->trace.n;
  kiln__step_graph *E = calloc(1, sizeof *E);
  if (E) {
    E->off = malloc((size_t)n * sizeof *E->off);
    E->mask_off = malloc((size_t)n * sizeof *E->mask_off);
    E->clobbered = malloc((size_t)n * sizeof *E->clobbered);
  }
  if (!E || !E->off || !E->mask_off || !E->clobbered) {
    graph_free(ctx, E);
    kiln__error(ctx, KILN_ERR_OOM, "kiln_step_end: out of host memory");
    return NULL;
  }
  E->hash = hash;
  E->sig = (uint8_t *)sig->s;
  E->sig_len = sig->n;
  sig->s = NULL;
  kiln_exec_stats before = ctx->stats;
  if (!kiln__program_build(ctx, 0, n, &E->prog) || !memory_plan(ctx, E)) {
    graph_free(ctx, E);
    return NULL;
  }
  int ng = E->prog.plan.ng;
  E->records = malloc((size_t)(ng > 0 ? ng : 1) * sizeof *E->records);
  if (!E->records) {
    graph_free(ctx, E);
    kiln__error(ctx, KILN_ERR_OOM, "kiln_step_end: out of host memory");
    return NULL;
  }
  bind(ctx, E);
  if (!kiln__bind_args(ctx, &E->prog, &E->tmaps)) {
    unbind(ctx, E);
    graph_free(ctx, E);
    return NULL;
  }
  E->values = kiln__dev_alloc(ctx, (size_t)(ng > 0 ? ng : 1) * sizeof(kiln__stepvals));
  if (!E->values) kiln__error(ctx, KILN_ERR_OOM, "kiln_step_end: out of device memory");
  /* the step values: ordered after the previous replay's reads on the stream */
  bool ok = E->values && kiln__upload_values(ctx, &E->prog, E->values) &&
            kiln__run_calls(ctx, &E->prog, KILN__RUN_FIRST, NULL);
  kiln__flush_stats(ctx, &E->prog, &before);
  E->flush = ctx->stats.last_flush;
  E->kernels = E->flush.kernels;
  if (!ok) {
    unbind(ctx, E);
    graph_free(ctx, E);
    return NULL;
  }
  /* the same launches again, recorded instead of run */
  cudaGraph_t graph = NULL;
  uint64_t launched = ctx->stats.kernels_launched;
  bool cap =
      !KILN_CUDA_FAILED(ctx, cudaStreamBeginCapture(ctx->stream, cudaStreamCaptureModeThreadLocal));
  if (cap) {
    bool rec = kiln__run_calls(ctx, &E->prog, KILN__RUN_CAPTURE, E->records);
    cap = !KILN_CUDA_FAILED(ctx, cudaStreamEndCapture(ctx->stream, &graph)) && rec;
  }
  ctx->stats.kernels_launched = launched;
  cap = cap && !KILN_CUDA_FAILED(ctx, cudaGraphInstantiate(&E->exec, graph, 0));
  if (graph) cudaGraphDestroy(graph);
  if (!cap) {
    unbind(ctx, E);
    graph_free(ctx, E);
    return NULL;
  }
  ctx->stats.graph_captures++;
  ctx->stats.arena_bytes = E->arena_bytes;
  ctx->stats.arena_sum_bytes = E->arena_sum;
  ctx->stats.arena_live_bytes = E->arena_live;
  return E;
}

/* The step graph's groups as a program of the trace being recorded (described from this step's
 * trace, which has the graph's signature). */
static uint32_t traced_program(kiln_ctx *ctx, kiln__step_graph *E) {
  uint64_t serial = kiln__prof_serial(ctx->prof);
  if (E->traced_in == serial) return E->traced;
  int ng = E->prog.plan.ng;
  uint32_t *ids = malloc((size_t)(ng > 0 ? ng : 1) * sizeof *ids);
  if (!ids) return KILN__PROF_NONE;
  for (int k = 0; k < ng; k++)
    ids[k] = kiln__traced_group(ctx, &E->prog, k);
  E->traced = kiln__prof_program(ctx->prof, ng, ids, E->records);
  E->traced_in = serial;
  free(ids);
  return E->traced;
}

/* Without a GPU: the step planned and compiled as its graph's would be, and its memory plan made
 * (kiln_stats reports it, KILN_DEBUG=memory prints it); nothing is allocated, run or captured. */
static kiln_status plan_only(kiln_ctx *ctx) {
  kiln_exec_stats before = ctx->stats;
  kiln__program pg;
  mplan m;
  if (kiln__program_build(ctx, 0, ctx->trace.n, &pg) && make_plan(ctx, &pg.plan, &m)) {
    ctx->stats.arena_bytes = m.top;
    ctx->stats.arena_sum_bytes = m.sum;
    ctx->stats.arena_live_bytes = m.live;
    mplan_free(&m);
  }
  if (pg.plan.group_of) {
    kiln__flush_stats(ctx, &pg, &before);
    ctx->stats.nodes_executed = before.nodes_executed;
  }
  kiln__program_free(&pg);
  return ctx->status;
}

kiln_status kiln__graph_run(kiln_ctx *ctx) {
  if (!ctx->has_gpu) return plan_only(ctx);
  kiln__fusion *fs = ctx->fusion_state;
  kiln__trace *tr = &ctx->trace;
  kiln__sb sig = {0};
  if (!signature(ctx, &sig)) {
    free(sig.s);
    return kiln__error(ctx, KILN_ERR_OOM, "kiln_step_end: out of host memory for the signature");
  }
  uint64_t h = kiln__hash(sig.s, sig.n, 0);
  fs->graph_clock++;
  kiln__step_graph *E = NULL;
  for (int k = 0; k < fs->ngraphs && !E; k++) {
    kiln__step_graph *c = fs->graphs[k];
    if (c->hash == h && c->sig_len == sig.n && memcmp(c->sig, sig.s, sig.n) == 0) E = c;
  }
  if (E) {
    free(sig.s);
    bind(ctx, E);
    bool ok = kiln__upload_values(ctx, &E->prog, E->values), traced = ok && ctx->prof;
    if (traced) /* the replay's kernels all carry this one call's correlation */
      kiln__prof_enter(ctx->prof, KILN__PROF_REPLAY, traced_program(ctx, E),
                       kiln__prof_step_of(ctx), kiln__prof_mode(ctx));
    ok = ok && !KILN_CUDA_FAILED(ctx, cudaGraphLaunch(E->exec, ctx->stream));
    if (traced) kiln__prof_leave(ctx->prof);
    if (ok) {
      ctx->stats.graph_replays++;
      ctx->stats.kernels_launched += E->kernels;
      ctx->stats.last_flush = E->flush;
      ctx->stats.last_flush.compiled = ctx->stats.last_flush.cache_hits = 0;
      ctx->stats.last_flush.compile_ms = 0;
      ctx->stats.nodes_executed += (uint64_t)tr->n;
    }
  } else {
    make_room(ctx);
    E = capture(ctx, h, &sig);
    free(sig.s);
    if (E) fs->graphs[fs->ngraphs++] = E;
  }
  if (E) E->last_used = fs->graph_clock;
  return ctx->status;
}
