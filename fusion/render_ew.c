/*
 * render_ew.c: the elementwise family: an elementwise program (one kernel over one iteration
 * space, operands broadcast, four lanes a thread where every operand allows it), one in-place
 * update over several tensors in one launch, and rows picked by index (index_select) or added
 * back by index (index_add).
 */
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "render.h"

/* Whether strides st over a space of nd dims make an operand that one division of the element
 * index i finds: 'm' when it is dense over the last dims from *dim on and constant over the others
 * (a bias or batch norm's per-channel vector: offset i % P), 'd' when it is dense over the dims
 * before *dim and constant over the rest (a per-row value: offset i / P), P the product of the
 * sizes from *dim on; 0 otherwise. Dims of size 1 match either way. */
static char tail_form(const long long *st, int nd, const int64_t *shape, int *dim) {
  /* 'm': walk in from the last dim while the strides are dense, then all the rest must be 0 */
  int64_t dense_st = 1;
  int d = nd;
  while (d > 0 && (shape[d - 1] == 1 || st[d - 1] == dense_st)) {
    dense_st *= shape[d - 1];
    d--;
  }
  int first = d; /* dims [first, nd) are dense */
  while (d > 0 && (shape[d - 1] == 1 || st[d - 1] == 0))
    d--;
  if (d == 0 && first > 0 && first < nd) {
    *dim = first;
    return 'm';
  }
  /* 'd': 0 strides over the last dims, then dense over the first */
  d = nd;
  while (d > 0 && (shape[d - 1] == 1 || st[d - 1] == 0))
    d--;
  int last = d;
  dense_st = 1;
  while (d > 0 && (shape[d - 1] == 1 || st[d - 1] == dense_st)) {
    dense_st *= shape[d - 1];
    d--;
  }
  if (d == 0 && last < nd) {
    *dim = last;
    return 'd';
  }
  return 0;
}

/* How an elementwise program reads its operands: four lanes a thread (vec) or one; the
 * coordinates of each element (coords) or not; 64-bit indices (wide); operand k's tail dims from
 * tail_dim[k] (its offset i % P or i / P). */
typedef struct ew_form {
  bool vec, coords, wide;
  int tail_dim[KILN__KMAX_PTR];
} ew_form;

/* Each operand's strides, dense and tail forms and traffic, and the kernel's form from them. */
static ew_form ew_layout(const kiln__ew_prog *p, int64_t n, bool update, bool coords,
                         kiln__operands *o, kiln__rendered *r) {
  int nd = p->ndim;
  kiln__kargs *a = &r->arg.args;
  ew_form f = {.vec = n % 4 == 0 && n > 0 && !coords, .coords = coords};
  bool floats = true;
  int64_t span = n; /* the largest offset any operand reaches, for the index type */
  for (int k = 0; k < o->n; k++) {
    const kiln_tensor *x = o->t[k];
    kiln__align_strides(x, nd, p->shape, a->st[k]);
    o->lin[k] = kiln__dense(x, n);
    f.tail_dim[k] = nd;
    o->tail[k] =
        o->lin[k] || o->store[k] || update ? 0 : tail_form(a->st[k], nd, p->shape, &f.tail_dim[k]);
    int64_t tail_len = o->tail[k] ? kiln__numel(nd - f.tail_dim[k], p->shape + f.tail_dim[k]) : 1;
    int64_t reach = 0;
    for (int d = 0; d < nd; d++)
      reach += (p->shape[d] - 1) * llabs(a->st[k][d]);
    if (reach > span) span = reach;
    if (!o->lin[k] && !o->tail[k]) f.coords = true;
    /* four-element accesses: 16-byte (f32) or 8-byte (bf16) aligned, as every storage starts
     * 256-byte aligned (core/alloc.c; the executor asserts it when it binds pointers); a tail
     * operand's four lanes are four neighbours (i % P) or one value (i / P) when 4 divides P */
    f.vec = f.vec && (o->tail[k] == 'd'
                          ? tail_len % 4 == 0
                          : (o->lin[k] || (o->tail[k] && tail_len % 4 == 0)) && x->offset % 4 == 0);
    floats = floats && kiln__is_float(x->dtype);
    if (o->store[k])
      r->bytes_written += kiln__footprint(x);
    else
      r->bytes_read += kiln__footprint(x);
  }
  for (int j = 0; j < p->n; j++) /* updates write their inputs back */
    if (kiln__ops[p->nodes[j]->op].kind == KILN__KIND_UPDATE)
      for (int q = 0; q < p->nodes[j]->nin; q++)
        if (kiln__ops[p->nodes[j]->op].stores & (1u << q))
          r->bytes_written += kiln__footprint(p->nodes[j]->in[q]);
  f.vec = f.vec && floats && !f.coords;
  /* 32-bit indices while every offset (and a grid-stride step past the end) fits an int */
  f.wide = kiln__wide_index(span);
  return f;
}

/* Four elements a thread per iteration, each operand in one access (bf16.cuh). */
static void emit_fours(kiln__sb *b, const kiln__ew_prog *p, const kiln__operands *o,
                       const kiln__wiring *w, bool update) {
  kiln__sb_printf(b, "  const ix n4 = (ix)(a.n >> 2);\n"
                     "  for (ix q = (ix)blockIdx.x * blockDim.x + threadIdx.x; q < n4;\n"
                     "       q += (ix)gridDim.x * blockDim.x) {\n");
  for (int k = 0; k < o->n; k++) {
    const char *ct = kiln__ctype(o->t[k]->dtype);
    if (o->store[k])
      kiln__sb_printf(b, "    float S%d[4];\n", k);
    else if (o->tail[k] == 'd')
      kiln__sb_printf(b,
                      "    float L%d[4];\n    L%d[0] = L%d[1] = L%d[2] = L%d[3] = "
                      "(float)((const %s *)a.ptr[%d])[q * 4 / P%d];\n",
                      k, k, k, k, k, ct, k, k);
    else if (o->tail[k] == 'm')
      kiln__sb_printf(b,
                      "    float L%d[4];\n    kiln_load4((const %s *)a.ptr[%d] + q * 4 %% P%d, "
                      "L%d);\n",
                      k, ct, k, k, k);
    else
      kiln__sb_printf(b, "    float L%d[4];\n    kiln_load4((const %s *)a.ptr[%d] + q * 4, L%d);\n",
                      k, ct, k, k);
  }
  kiln__sb_printf(b, "#pragma unroll\n    for (int e = 0; e < 4; e++) {\n"
                     "      const ix i = q * 4 + e;\n      (void)i;\n");
  kiln__emit_element(b, p, o, w, "      ", p->ndim, true);
  kiln__sb_printf(b, "    }\n");
  for (int k = 0; k < o->n; k++) {
    if (o->store[k] || (update && (kiln__ops[p->nodes[0]->op].stores & (1u << k))))
      kiln__sb_printf(b, "    kiln_store4((%s *)a.ptr[%d] + q * 4, %s%d);\n",
                      kiln__ctype(o->t[k]->dtype), k, o->store[k] ? "S" : "L", k);
  }
  kiln__sb_printf(b, "  }\n");
}

bool kiln__render_ew(const kiln__target *t, const kiln__ew_prog *p, kiln__rendered *r) {
  int nd = p->ndim;
  int64_t n = kiln__numel(nd, p->shape);
  kiln__kargs *a = &r->arg.args;
  a->n = n;
  for (int d = 0; d < nd; d++)
    a->shape[d] = p->shape[d];
  kiln__operands o = {0};
  kiln__wiring w;
  int nf = 0, ni = 0, nu = 0;
  kiln__wire(p, NULL, &o, &w, &r->arg, &nf, &ni, &nu);
  bool update = p->n == 1 && kiln__ops[p->nodes[0]->op].kind == KILN__KIND_UPDATE;
  /* found_inf's flag is stored only where it changes: the multi-tensor form's (lower.c) */
  KILN_ASSERT(!update || p->nodes[0]->op != KILN__OP_FOUND_INF);
  ew_form f = ew_layout(p, n, update, w.coords, &o, r);
  kiln__sb b = {0};
  kiln__emit_index_type(&b, f.wide);
  for (int k = 0; k < o.n; k++) {
    if (!o.tail[k]) continue;
    kiln__sb_printf(&b, "  const ix P%d = (ix)(1", k);
    for (int d = f.tail_dim[k]; d < nd; d++)
      kiln__sb_printf(&b, " * a.shape[%d]", d);
    kiln__sb_printf(&b, "); // operand %d: %s\n", k,
                    o.tail[k] == 'm' ? "its last dims" : "its first dims");
  }
  if (f.vec) {
    emit_fours(&b, p, &o, &w, update);
  } else {
    kiln__sb_printf(&b, "  for (ix i = (ix)blockIdx.x * blockDim.x + threadIdx.x; i < (ix)a.n;\n"
                        "       i += (ix)gridDim.x * blockDim.x) {\n");
    if (f.coords) kiln__emit_coords(&b, "    ", nd, "i");
    kiln__emit_element(&b, p, &o, &w, "    ", nd, false);
    kiln__sb_printf(&b, "  }\n");
  }
  const kiln__node *last = p->nodes[p->n - 1];
  const kiln_tensor *typed = last->out ? last->out : last->in[0];
  char stem[80], suffix[24];
  snprintf(suffix, sizeof suffix, "_%s%s", kiln_dtype_name(typed->dtype), f.vec ? "_v4" : "");
  kiln__stem_of(p, "k", suffix, stem, sizeof stem);
  bool ok = kiln__finish(&b, stem, &o, r);
  kiln__sb_free(&b);
  r->block = KILN__BLOCK;
  r->grid = kiln__grid_for(t, f.vec ? n / 4 : n);
  return ok;
}

/* ---------------------------------------------------------------- multi-tensor updates */

/* One launch runs the same update over T tensors, tensor t in blockIdx.y, its inputs in
 * a.ptr[t * nin ...] and its length in a.st[t][0]. An input that holds one value (scale's factor,
 * a guarded update's flag and count) is read at its element 0; one that is also written
 * (found_inf's flag) is stored only by the elements whose expression changed it, all of which
 * store the same value. */
/* Names and wraps a multi-tensor kernel's body b (freed): blockIdx.y picks one of its T tensors,
 * the largest of `most` elements, which a grid-stride loop covers. */
static bool finish_multi(kiln__sb *b, const char *stem, const kiln__target *tg, int64_t most, int T,
                         kiln__rendered *r) {
  bool ok = kiln__finish(b, stem, NULL, r);
  kiln__sb_free(b);
  r->block = KILN__BLOCK;
  r->grid = kiln__grid_for(tg, most);
  r->grid_y = (unsigned)T;
  return ok;
}

bool kiln__render_updates(const kiln__target *tg, const kiln__node *const *nodes, int T,
                          kiln__rendered *r) {
  const kiln__node *n0 = nodes[0];
  const kiln__op_info *info = &kiln__ops[n0->op];
  int nin = n0->nin;
  kiln__kargs *a = &r->arg.args;
  kiln__wiring w;
  int nf = 0, ni = 0, nu = 0;
  kiln__wire_attrs(&r->arg, n0, w.aslot[0], &nf, &ni, &nu);
  int64_t most = 0;
  for (int t = 0; t < T; t++) {
    for (int q = 0; q < nin; q++) /* the planner batches f32 updates only */
      KILN_ASSERT(nodes[t]->in[q]->dtype == KILN_DTYPE_F32);
    int64_t len = kiln_tensor_numel(nodes[t]->in[0]);
    a->st[t][0] = len;
    a->n += len;
    if (len > most) most = len;
    for (int q = 0; q < nin; q++) {
      r->arg.ptr[t * nin + q] = nodes[t]->in[q];
      r->bytes_read += kiln__footprint(nodes[t]->in[q]);
      if (info->stores & (1u << q)) r->bytes_written += kiln__footprint(nodes[t]->in[q]);
    }
  }
  r->arg.nptr = T * nin;
  for (int q = 0; q < nin; q++) {
    w.val[0][q] = -1;
    w.opnd[0][q] = q;
  }
  kiln__sb b = {0};
  kiln__sb_printf(&b, "  const int t = blockIdx.y;\n  const long long n = a.st[t][0];\n"
                      "  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; "
                      "i < n;\n       i += (long long)gridDim.x * blockDim.x) {\n");
  unsigned one = kiln__update_scalars(n0->op);
  for (int q = 0; q < nin; q++) {
    kiln__sb_printf(&b, "    float x%d = ((const float *)a.ptr[t * %d + %d])[%s];\n", q, nin, q,
                    one >> q & 1u ? "0" : "i");
    if ((one & info->stores) >> q & 1u) kiln__sb_printf(&b, "    const float was%d = x%d;\n", q, q);
  }
  kiln__sb_printf(&b, "    ");
  kiln__expand(&b, info->expr, &w, 0, n0);
  kiln__sb_printf(&b, "\n");
  for (int q = 0; q < nin; q++) {
    if (!(info->stores >> q & 1u)) continue;
    if (one >> q & 1u)
      kiln__sb_printf(&b, "    if (x%d != was%d) ((float *)a.ptr[t * %d + %d])[0] = x%d;\n", q, q,
                      nin, q, q);
    else
      kiln__sb_printf(&b, "    ((float *)a.ptr[t * %d + %d])[i] = x%d;\n", nin, q, q);
  }
  kiln__sb_printf(&b, "  }\n");
  char stem[64];
  snprintf(stem, sizeof stem, "k_%s_f32_x%d", info->name, T);
  return finish_multi(&b, stem, tg, most, T, r);
}

/* ---------------------------------------------------------------- multi-tensor casts */

/* The most values a block of kiln__render_casts' shared memory holds (48 KB of floats). */
#define KILN__CAST_BLOCK_MAX 12288

bool kiln__permuted_blocks(const kiln_tensor *x, int64_t *block) {
  if (x->ndim < 2 || kiln__is_contiguous(x)) return false;
  int ax[KILN_MAX_DIMS], na = 0;
  int64_t b = 1;
  for (int d = 1; d < x->ndim; d++) {
    b *= x->shape[d];
    if (x->shape[d] > 1) ax[na++] = d; /* an axis of one value has no stride to keep */
  }
  if ((x->shape[0] > 1 && x->stride[0] != b) || b > KILN__CAST_BLOCK_MAX) return false;
  for (int k = 1; k < na; k++) /* by stride, largest first */
    for (int j = k; j > 0 && x->stride[ax[j]] > x->stride[ax[j - 1]]; j--) {
      int t = ax[j];
      ax[j] = ax[j - 1];
      ax[j - 1] = t;
    }
  int64_t want = 1;
  for (int k = na - 1; k >= 0; want *= x->shape[ax[k]], k--)
    if (x->stride[ax[k]] != want) return false;
  *block = b;
  return true;
}

/* The loop of tensor t's case over a cast's lane groups (y dense): through x's blocks in shared
 * memory (block values each, kiln_blk), four values at a time (`fours`), or one at a time with x's
 * offset from its strides. A lone cast's blocks (runtime) take their sizes and x's strides from the
 * arguments (a.shape, a.nred and a.st[0], set here), so that one kernel serves every weight of a
 * network: a weight's shape would make each its own. */
static void cast_loop(kiln__sb *b, const kiln_tensor *x, const kiln_tensor *y, int64_t block,
                      bool fours, bool runtime, kiln__kargs *a) {
  int64_t n = kiln_tensor_numel(y);
  const char *yt = kiln__ctype(y->dtype);
  if (block > 0) { /* each block of x read in order, then written in y's */
    char O[32], B[32], sz[KILN_MAX_DIMS][32], st[KILN_MAX_DIMS][32];
    snprintf(O, sizeof O, runtime ? "(ix)a.shape[0]" : "%lldll", (long long)y->shape[0]);
    snprintf(B, sizeof B, runtime ? "(int)a.nred" : "%lld", (long long)block);
    for (int d = 1; d < y->ndim; d++) {
      snprintf(sz[d], sizeof sz[d], runtime ? "(int)a.shape[%lld]" : "%lld",
               runtime ? (long long)d : (long long)y->shape[d]);
      snprintf(st[d], sizeof st[d], runtime ? "(int)a.st[0][%lld]" : "%lld",
               runtime ? (long long)d : (long long)x->stride[d]);
      if (runtime) a->shape[d] = y->shape[d], a->st[0][d] = x->stride[d];
    }
    if (runtime) a->shape[0] = y->shape[0], a->nred = block;
    kiln__sb_printf(b,
                    "    for (ix o = blockIdx.x; o < %s; o += gridDim.x) {\n"
                    "      __syncthreads(); /* the last block's values read */\n"
                    "      for (int j = threadIdx.x; j < %s; j += blockDim.x)\n"
                    "        kiln_blk[j] = (float)x[o * %s + j];\n"
                    "      __syncthreads();\n"
                    "      for (int i = threadIdx.x; i < %s; i += blockDim.x) {\n"
                    "        int r = i, at = 0;\n",
                    O, B, B, B);
    for (int d = y->ndim - 1; d >= 1; d--)
      kiln__sb_printf(b, "        at += r %% %s * %s; r /= %s;\n", sz[d], st[d], sz[d]);
    kiln__sb_printf(b,
                    "        y[o * %s + i] = (%s)kiln_blk[at];\n"
                    "      }\n"
                    "    }\n",
                    B, yt);
    return;
  }
  if (fours) {
    kiln__sb_printf(b,
                    "    for (ix q = (ix)blockIdx.x * blockDim.x + threadIdx.x; q < %lldll;\n"
                    "         q += (ix)gridDim.x * blockDim.x) {\n"
                    "      float v[4];\n"
                    "      kiln_load4(x + 4 * q, v);\n"
                    "      kiln_store4(y + 4 * q, v);\n"
                    "    }\n",
                    (long long)(n / 4));
    return;
  }
  kiln__sb_printf(b,
                  "    for (ix i = (ix)blockIdx.x * blockDim.x + threadIdx.x; i < %lldll;\n"
                  "         i += (ix)gridDim.x * blockDim.x) {\n",
                  (long long)n);
  if (kiln__is_contiguous(x)) {
    kiln__sb_printf(b, "      const ix at = i;\n");
  } else {
    kiln__sb_printf(b, "      ix r = i, at = 0;\n");
    for (int d = y->ndim - 1; d >= 0; d--)
      kiln__sb_printf(b, "      at += r %% %lldll * %lldll; r /= %lldll;\n", (long long)y->shape[d],
                      (long long)x->stride[d], (long long)y->shape[d]);
  }
  kiln__sb_printf(b,
                  "      y[i] = (%s)(float)x[at];\n"
                  "    }\n",
                  yt);
}

/* T casts in one launch, tensor t in blockIdx.y (its inputs a.ptr[2 t], outputs a.ptr[2 t + 1]),
 * y dense; with tg->cast_tiles, through x's permuted blocks (kiln__permuted_blocks) in shared
 * memory, and a dense x of f32 or bf16 four values at a time. The values are the same either way.
 */
bool kiln__render_casts(const kiln__target *tg, const kiln__node *const *nodes, int T,
                        kiln__rendered *r) {
  KILN_ASSERT(T >= 1 && T <= KILN__MAX_CASTS);
  int64_t most = 0, blocks = 0, block; /* blocks: the largest block, the shared memory's room */
  for (int t = 0; t < T && tg->cast_tiles; t++)
    if (kiln__permuted_blocks(nodes[t]->in[0], &block) && block > blocks) blocks = block;
  /* The shared memory is dynamic, the largest block's bytes (a lone cast's kernel serves blocks
   * of every size: each launch takes its own block's), not a static array of the most. */
  kiln__sb b = {0};
  if (blocks > 0) kiln__sb_printf(&b, "  extern __shared__ float kiln_blk[];\n");
  kiln__sb_printf(&b, "  typedef long long ix;\n  switch (blockIdx.y) {\n");
  for (int t = 0; t < T; t++) {
    const kiln_tensor *x = nodes[t]->in[0], *y = nodes[t]->out;
    KILN_ASSERT(kiln__is_float(x->dtype) && kiln__is_float(y->dtype) && kiln__is_contiguous(y) &&
                kiln__same_shape(x, y));
    int64_t n = kiln_tensor_numel(y);
    if (n > most) most = n;
    r->arg.args.n += n; /* the executor launches nothing for 0 */
    r->arg.ptr[2 * t] = x;
    r->arg.ptr[2 * t + 1] = y;
    r->bytes_read += kiln__footprint(x);
    r->bytes_written += kiln__footprint(y);
    bool wide = x->dtype != KILN_DTYPE_F16 && y->dtype != KILN_DTYPE_F16; /* kiln_load4's types */
    bool fours = tg->cast_tiles && wide && kiln__is_contiguous(x) && n % 4 == 0 &&
                 x->offset % 4 == 0 && y->offset % 4 == 0;
    if (!tg->cast_tiles || !kiln__permuted_blocks(x, &block)) block = 0;
    /* the output dense, the input through its strides: the shape and strides as constants */
    const char *xt = kiln__ctype(x->dtype), *yt = kiln__ctype(y->dtype);
    kiln__sb_printf(&b,
                    "  case %d: { /* cast to %s (the kernel's comment names its nodes) */\n"
                    "    const %s *x = (const %s *)a.ptr[%d];\n"
                    "    %s *y = (%s *)a.ptr[%d];\n",
                    t, kiln_dtype_name(y->dtype), xt, xt, 2 * t, yt, yt, 2 * t + 1);
    cast_loop(&b, x, y, block, fours, T == 1, &r->arg.args);
    kiln__sb_printf(&b, "  } break;\n");
  }
  kiln__sb_printf(&b, "  }\n");
  r->arg.nptr = 2 * T;
  char stem[64];
  snprintf(stem, sizeof stem, "k_cast_x%d%s", T, tg->cast_tiles ? "_tiles" : "");
  r->smem = (unsigned)(blocks * (int64_t)sizeof(float)); /* at most KILN__CAST_BLOCK_MAX floats */
  return finish_multi(&b, stem, tg, most, T, r);
}

/* ---------------------------------------------------------------- row gathers */

/* index_add, index_select's gradient: the rows of g (K, ...) added into the rows of y (V, ...)
 * that the indices name. The executor zeroes y first (zero_slot); rows named twice are summed by
 * atomic adds, so their order, and the last bits of such sums, may vary from run to run. */
static bool render_scatter(const kiln__target *tg, const kiln__node *n, const kiln__operands *o,
                           int start, kiln__rendered *r) {
  const kiln_tensor *g = n->in[0], *idx = n->in[1], *y = n->out;
  kiln__kargs *a = &r->arg.args;
  a->n = kiln_tensor_numel(g);
  a->nred = g->shape[0] ? a->n / g->shape[0] : 0; /* elements per row */
  a->shape[0] = y->shape[0];
  kiln__sb b = {0};
  kiln__sb_printf(
      &b,
      "  const float *g = (const float *)a.ptr[0];\n"
      "  const int *idx = (const int *)a.ptr[1];\n"
      "  float *y = (float *)a.ptr[2];\n"
      "  for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < a.n;\n"
      "       e += (long long)gridDim.x * blockDim.x) {\n"
      "    const long long k = e / a.nred, j = e - k * a.nred;\n"
      "    const long long r = idx[a.uv[%d] + k]; // where this step's indices start\n"
      "    if (kiln_in_range(r, a.shape[0], KILN__DEV_ERR_INDEX, a.err))\n"
      "      atomicAdd(&y[r * a.nred + j], g[e]);\n"
      "  }\n",
      start);
  bool ok = kiln__finish(&b, "k_index_add_f32", o, r);
  kiln__sb_free(&b);
  r->block = KILN__BLOCK;
  r->grid = kiln__grid_for(tg, a->n);
  r->zero_slot = 2;
  r->zero_bytes = kiln__footprint(y);
  r->bytes_read = kiln__footprint(g) + kiln__footprint(idx);
  r->bytes_written = kiln__footprint(y);
  return ok;
}

bool kiln__render_gather(const kiln__target *tg, const kiln__node *n, kiln__rendered *r) {
  const kiln_tensor *x = n->in[0], *idx = n->in[1], *y = n->out;
  kiln__kargs *a = &r->arg.args;
  kiln__operands o = {0};
  kiln__operand(&o, x, false, NULL);
  kiln__operand(&o, idx, false, NULL);
  kiln__operand(&o, y, true, NULL);
  int8_t aslot[KILN__MAX_ATTRS];
  int nf = 0, ni = 0, nu = 0;
  kiln__wire_attrs(&r->arg, n, aslot, &nf, &ni, &nu);
  int start =
      aslot[kiln__attr_index(n->op, "start")]; /* the slot of where this step's indices start */
  if (n->op == KILN__OP_INDEX_ADD) return render_scatter(tg, n, &o, start, r);
  a->n = kiln_tensor_numel(y);
  a->nred = x->shape[0] ? kiln_tensor_numel(x) / x->shape[0] : 0; /* elements per row */
  a->shape[0] = x->shape[0];
  const char *t = kiln__ctype(x->dtype);
  kiln__sb b = {0};
  kiln__sb_printf(
      &b,
      "  const %s *x = (const %s *)a.ptr[0];\n"
      "  const int *idx = (const int *)a.ptr[1];\n"
      "  %s *y = (%s *)a.ptr[2];\n"
      "  for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < a.n;\n"
      "       e += (long long)gridDim.x * blockDim.x) {\n"
      "    const long long k = e / a.nred, j = e - k * a.nred;\n"
      "    const long long r = idx[a.uv[%d] + k]; // where this step's indices start\n"
      "    y[e] = kiln_in_range(r, a.shape[0], KILN__DEV_ERR_INDEX, a.err) ? x[r * a.nred + j]\n"
      "                                                                     : (%s)0;\n"
      "  }\n",
      t, t, t, t, start, t);
  char stem[64];
  snprintf(stem, sizeof stem, "k_index_select_%s", kiln_dtype_name(x->dtype));
  bool ok = kiln__finish(&b, stem, &o, r);
  kiln__sb_free(&b);
  r->block = KILN__BLOCK;
  r->grid = kiln__grid_for(tg, a->n);
  r->bytes_read =
      kiln__footprint(y) + kiln__footprint(idx); /* the rows picked, not the whole table */
  r->bytes_written = kiln__footprint(y);
  return ok;
}
