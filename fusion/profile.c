/*
 * profile.c: what a timeline trace (prof/prof.h) learns from fusion/, on the host, at launch
 * and capture. For each group that runs while a trace is recorded: kiln's name for its launch,
 * its kind, the trace nodes it covers (ops and shapes), the bytes it reads and writes (the
 * renderer's count for generated kernels, the operands for products), a product's FLOPs and the
 * launch shape; described once per session, then found by a cheap key. For each step graph
 * capture (traced or not): how many device records each group's captured nodes make, so that a
 * replay's records can be given to their groups in order. exec.c and graph.c call these only
 * where ctx->prof is set, except the capture count, which every capture takes (graphs captured
 * before a trace began are replayed inside it).
 */
#include <stdlib.h>
#include <string.h>

#include "../core/cuda_check.h"
#include "../prof/prof.h"
#include "fusion.h"
#include "render.h"

static const char *kind_name(const kiln__program *pg, int k) {
  switch (pg->spec[k].kind) {
  case KILN__SPEC_EW: return pg->plan.g[k].kind == KILN__KIND_UPDATE ? "update" : "elementwise";
  case KILN__SPEC_REDUCE: return "reduction";
  case KILN__SPEC_ROWS: return "rows";
  case KILN__SPEC_UPDATES: return "update";
  case KILN__SPEC_CASTS: return "elementwise";
  case KILN__SPEC_GATHER: return "gather";
  case KILN__SPEC_WINDOW: return "window";
  case KILN__SPEC_CONV: return "conv";
  case KILN__SPEC_MOMENTS: return "moments";
  case KILN__SPEC_AUGMENT: return "augment";
  case KILN__SPEC_CUSTOM: return "custom";
  case KILN__SPEC_BLAS: return "gemm";
  }
  return "other";
}

/* The trace index of member m of group g (its main node when it lists none). */
static int32_t member(const kiln__plan *p, const kiln__group *g, int m) {
  return g->n ? p->members[g->first + m] : g->node;
}

/* A key for group k that changes when its description would: its name, place, members, their
 * layouts and what is stored. Made from the step's trace, not from the program's tensors (a
 * replayed graph's program holds the tensors of the step that captured it). */
static uint64_t group_key(const kiln_ctx *ctx, const kiln__program *pg, int k) {
  const kiln__call *c = &pg->call[k];
  const kiln__plan *p = &pg->plan;
  const kiln__group *g = &p->g[k];
  uint64_t h = kiln__hash(c->name, strlen(c->name), 0);
  int64_t head[4] = {k, g->n, (int64_t)c->bytes_read, (int64_t)c->bytes_written};
  h = kiln__hash(head, sizeof head, h);
  for (int m = 0; m < (g->n ? g->n : 1); m++) {
    int32_t i = member(p, g, m);
    const kiln__node *nd = &ctx->trace.nodes[i];
    const kiln_tensor *t = nd->out ? nd->out : nd->in[0];
    int32_t w[4] = {i, (int32_t)nd->op, t->ndim, (int32_t)t->dtype * 2 + p->store[i - p->first]};
    h = kiln__hash(w, sizeof w, h);
    h = kiln__hash(t->shape, (size_t)t->ndim * sizeof t->shape[0], h);
  }
  return h;
}

/* The product among the group's nodes (a BLAS call's main node; an implicit GEMM's matmul). */
static const kiln__node *product(const kiln_ctx *ctx, const kiln__plan *p, const kiln__group *g) {
  const kiln__node *n = &ctx->trace.nodes[g->node];
  if (kiln__ops[n->op].kind == KILN__KIND_MATMUL) return n;
  for (int m = 0; m < g->n; m++) {
    const kiln__node *x = &ctx->trace.nodes[member(p, g, m)];
    if (kiln__ops[x->op].kind == KILN__KIND_MATMUL) return x;
  }
  return NULL;
}

/* The bytes group k reads and writes: the renderer's count for a generated kernel; for a
 * product on the BLAS library, its operands, each read or written once. */
static void call_bytes(const kiln_ctx *ctx, const kiln__program *pg, int k, uint64_t *rd,
                       uint64_t *wr) {
  const kiln__call *c = &pg->call[k];
  *rd = c->bytes_read;
  *wr = c->bytes_written;
  const kiln__node *mm = product(ctx, &pg->plan, &pg->plan.g[k]);
  if (mm && pg->spec[k].kind == KILN__SPEC_BLAS) {
    *rd = kiln__footprint(mm->in[0]) + kiln__footprint(mm->in[1]);
    *wr = kiln__footprint(mm->out);
  }
}

static uint32_t describe(kiln_ctx *ctx, const kiln__program *pg, int k, uint64_t key) {
  const kiln__call *c = &pg->call[k];
  const kiln__plan *p = &pg->plan;
  const kiln__group *g = &p->g[k];
  kiln__sb nodes = {0};
  for (int m = 0; m < (g->n ? g->n : 1); m++) {
    int32_t i = member(p, g, m);
    const kiln__node *nd = &ctx->trace.nodes[i];
    const kiln_tensor *t = nd->out ? nd->out : nd->in[0];
    char sh[96];
    kiln__sb_printf(&nodes, "%s#%d %s %s %s%s", m ? "\n" : "", i, kiln__ops[nd->op].name,
                    kiln__shape_of(t, sh, sizeof sh), kiln_dtype_name(t->dtype),
                    nd->out && !p->store[i - p->first] ? " (in registers)" : "");
    if (kiln__ops[nd->op].kind == KILN__KIND_MATMUL) { /* a product: its operands' shapes */
      char sb[96];
      kiln__sb_printf(&nodes, " from %s %s", kiln__shape_of(nd->in[0], sh, sizeof sh),
                      kiln__shape_of(nd->in[1], sb, sizeof sb));
    }
  }
  kiln__tl_group d = {
      .name = c->name,
      .kind = kind_name(pg, k),
      .nodes = nodes.s ? nodes.s : "",
      .index = k,
      .bytes_read = c->bytes_read,
      .bytes_written = c->bytes_written,
      .grid = {c->grid, c->grid_y ? c->grid_y : 1, c->grid_z ? c->grid_z : 1},
      .block = c->block,
      .smem = c->smem,
  };
  if (!c->k) d.grid[0] = d.grid[1] = d.grid[2] = 0; /* a library call: its own launches */
  const kiln__node *mm = product(ctx, p, g);
  if (mm) {
    const kiln_tensor *a = mm->in[0];
    d.flops = 2 * (uint64_t)kiln_tensor_numel(mm->out) * (uint64_t)a->shape[a->ndim - 1];
  }
  call_bytes(ctx, pg, k, &d.bytes_read, &d.bytes_written);
  uint32_t id = nodes.oom ? KILN__PROF_NONE : kiln__prof_group_add(ctx->prof, key, &d);
  kiln__sb_free(&nodes);
  return id;
}

uint32_t kiln__traced_group(kiln_ctx *ctx, const kiln__program *pg, int k) {
  uint64_t key = group_key(ctx, pg, k);
  uint32_t id = kiln__prof_group_find(ctx->prof, key);
  return id != KILN__PROF_NONE ? id : describe(ctx, pg, k, key);
}

int32_t kiln__captured_records(kiln_ctx *ctx, size_t *seen) {
  cudaStream_t stream = ctx->stream;
  enum cudaStreamCaptureStatus st;
  cudaGraph_t graph = NULL;
  const cudaGraphNode_t *deps = NULL;
  size_t ndeps = 0, total = 0;
  if (cudaStreamGetCaptureInfo(stream, &st, NULL, &graph, &deps, NULL, &ndeps) != cudaSuccess ||
      st != cudaStreamCaptureStatusActive ||
      cudaGraphGetNodes(graph, NULL, &total) != cudaSuccess) {
    (void)cudaGetLastError();
    return -1;
  }
  size_t added = total >= *seen ? total - *seen : 0;
  *seen = total;
  if (added == 0) return 0;
  if (ndeps != 1) return -1; /* not a chain: the order of its records is not known */
  /* one stream's capture is a chain: walk back from its tail over the nodes added */
  cudaGraphNode_t node = deps[0];
  int32_t count = 0;
  for (size_t i = 0; i < added; i++) {
    enum cudaGraphNodeType type;
    if (cudaGraphNodeGetType(node, &type) != cudaSuccess) {
      (void)cudaGetLastError();
      return -1;
    }
    if (type == cudaGraphNodeTypeKernel || type == cudaGraphNodeTypeMemcpy ||
        type == cudaGraphNodeTypeMemset)
      count++;
    else if (type == cudaGraphNodeTypeGraph || type == cudaGraphNodeTypeConditional)
      return -1; /* records of their own */
    size_t nd = 0;
    if (i + 1 < added &&
        (cudaGraphNodeGetDependencies(node, NULL, NULL, &nd) != cudaSuccess || nd != 1 ||
         cudaGraphNodeGetDependencies(node, &node, NULL, &nd) != cudaSuccess)) {
      (void)cudaGetLastError();
      return -1;
    }
  }
  return count;
}

/* ---------------------------------------------------------------- KILN_DEBUG=traffic */

/* A kernel's family: its name without the source hash; every BLAS product one family. */
static void family(const kiln__program *pg, int k, char *buf, size_t n) {
  const char *name = pg->call[k].name;
  if (pg->spec[k].kind == KILN__SPEC_BLAS) {
    snprintf(buf, n, "(BLAS products)");
    return;
  }
  size_t len = strlen(name);
  if (len > 9 && name[len - 9] == '_' && strspn(name + len - 8, "0123456789abcdef") == 8) len -= 9;
  snprintf(buf, n, "%.*s", (int)len, name);
}

typedef struct {
  char name[96];
  int launches;
  uint64_t rd, wr;
} traffic_row;

static int by_bytes(const void *a, const void *b) {
  const traffic_row *x = a, *y = b;
  uint64_t tx = x->rd + x->wr, ty = y->rd + y->wr;
  return tx < ty ? 1 : tx > ty ? -1 : strcmp(x->name, y->name);
}

void kiln__print_traffic(const kiln_ctx *ctx, const kiln__program *pg) {
  const kiln__plan *p = &pg->plan;
  traffic_row *rows = calloc((size_t)(p->ng > 0 ? p->ng : 1), sizeof *rows);
  if (!rows) return;
  int nr = 0;
  uint64_t total = 0;
  for (int k = 0; k < p->ng; k++) {
    if (!pg->call[k].k && pg->spec[k].kind != KILN__SPEC_BLAS) continue; /* nothing runs */
    char name[96];
    family(pg, k, name, sizeof name);
    int r = 0;
    while (r < nr && strcmp(rows[r].name, name) != 0)
      r++;
    if (r == nr) snprintf(rows[nr++].name, sizeof rows[0].name, "%s", name);
    uint64_t rd, wr;
    call_bytes(ctx, pg, k, &rd, &wr);
    rows[r].launches++;
    rows[r].rd += rd;
    rows[r].wr += wr;
    total += rd + wr;
  }
  qsort(rows, (size_t)nr, sizeof *rows, by_bytes);
  const double mib = 1024.0 * 1024.0;
  fprintf(stderr,
          "kiln: traffic of trace nodes [%d, %d): %.1f MiB in %d groups, at least %.0f us at the "
          "H200's 4.8 TB/s\n"
          "kiln:   share    MiB read  MiB written  groups  kernel\n",
          p->first, p->last, (double)total / mib, p->ng, (double)total / 4.8e6);
  for (int r = 0; r < nr; r++)
    fprintf(stderr, "kiln:  %5.1f%%  %10.1f  %11.1f  %6d  %s\n",
            total ? 100.0 * (double)(rows[r].rd + rows[r].wr) / (double)total : 0.0,
            (double)rows[r].rd / mib, (double)rows[r].wr / mib, rows[r].launches, rows[r].name);
  free(rows);
}
