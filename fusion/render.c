/*
 * render.c: the renderer. It turns a spec (lower.c) into CUDA C source, a kernel name, a launch
 * shape and an argument plan (which tensor each pointer slot binds to, where each attribute slot
 * comes from). It only renders: it compiles nothing, allocates no device memory and reads no
 * device address. The source depends on the ops, dtypes, ranks, which operands are dense and
 * 16-byte aligned, and whether indices need 64 bits; sizes and strides travel in the argument.
 */
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "fusion.h"

/* ---------------------------------------------------------------- op attributes */

/* Attribute a of op's first value among the node's values of its kind. */
static int node_slot(kiln__op op, int a) {
  kiln__attr_kind kind;
  int slot;
  const char *name = kiln__ops[op].attrs[a].name;
  KILN_ASSERT(kiln__attr_find(op, name, strlen(name), &kind, &slot));
  return slot;
}

/* ---------------------------------------------------------------- operands and wiring */

/* A dtype's type in memory (kiln_bf16: bf16.cuh) and in registers, where bf16 values are floats. */
static const char *ctype(kiln_dtype dt) {
  return dt == KILN_DTYPE_I32 ? "int" : (dt == KILN_DTYPE_BF16 ? "kiln_bf16" : "float");
}
static const char *rtype(kiln_dtype dt) { return dt == KILN_DTYPE_I32 ? "int" : "float"; }

/* Strides of t over an iteration space of nd dims, broadcasting from the right (0 where t is
 * stretched). */
static void align_strides(const kiln_tensor *t, int nd, const int64_t *shape, long long *st) {
  for (int d = 0; d < nd; d++) {
    int j = d - (nd - t->ndim);
    st[d] = (j < 0 || (t->shape[j] == 1 && shape[d] != 1)) ? 0 : t->stride[j];
  }
}

static bool dense(const kiln_tensor *t, int64_t n) {
  return kiln__is_contiguous(t) && kiln_tensor_numel(t) == n;
}

/* Bytes of t a kernel touches: each element once, broadcast dims counted once. */
static uint64_t footprint(const kiln_tensor *t) {
  uint64_t n = kiln_dtype_size(t->dtype);
  for (int d = 0; d < t->ndim; d++)
    if (t->stride[d] != 0) n *= (uint64_t)t->shape[d];
  return n;
}

/* The tensors a kernel reads and writes, each through a.ptr[k]. */
typedef struct operands {
  int n;
  const kiln_tensor *t[KILN__KMAX_PTR];
  bool lin[KILN__KMAX_PTR];
  /* an elementwise operand indexed by the space's last dims alone ('m': offset i % P<k>) or by
   * its first dims alone ('d': i / P<k>), P<k> the product of the last dims' sizes; 0 when its
   * offset is i (lin) or needs the coordinates */
  char tail[KILN__KMAX_PTR];
  bool store[KILN__KMAX_PTR];
  /* a row program's operand read or written once per row: the row-shaped space it is indexed
   * over (NULL: the program's whole iteration space) */
  const kiln_tensor *row[KILN__KMAX_PTR];
} operands;

/* Adds the bytes each operand is read or written with to r's traffic. */
static void tally_bytes(const operands *o, kiln__rendered *r) {
  for (int k = 0; k < o->n; k++) {
    if (o->store[k])
      r->bytes_written += footprint(o->t[k]);
    else
      r->bytes_read += footprint(o->t[k]);
  }
}

static int operand(operands *o, const kiln_tensor *t, bool store, const kiln_tensor *row) {
  for (int k = 0; k < o->n && !store; k++)
    if (o->t[k] == t && !o->store[k] && !o->row[k] == !row &&
        (!row || row->ndim == o->row[k]->ndim))
      return k;
  KILN_ASSERT(o->n < KILN__KMAX_PTR);
  o->t[o->n] = t;
  o->store[o->n] = store;
  o->row[o->n] = row;
  return o->n++;
}

/* How an elementwise program's nodes read their inputs and where their attributes live. */
typedef struct wiring {
  int val[KILN__MAX_GROUP][KILN__MAX_IN];  /* input q of node j: the value of node val (or -1) */
  int opnd[KILN__MAX_GROUP][KILN__MAX_IN]; /* or operand opnd */
  int8_t aslot[KILN__MAX_GROUP][KILN__MAX_ATTRS]; /* attribute a: its kernel slot (-1: unused) */
  int store_slot[KILN__MAX_GROUP]; /* operand written with node j's value, -1 for none */
  bool coords;                     /* some read needs the element's coordinates */
} wiring;

/* Float attribute slot s of the kernel is attribute k of node n (and 64-bit slot s for attr_u):
 * the executor copies it into the step values before every run or graph replay. */
static void attr_f(kiln__argplan *ap, int s, const kiln__node *n, int k) {
  ap->fsrc[s] = n;
  ap->fk[s] = (int8_t)k;
}
static void attr_u(kiln__argplan *ap, int s, const kiln__node *n, int k) {
  ap->usrc[s] = n;
  ap->uk[s] = (int8_t)k;
}

/* Gives node n's used attributes the next kernel slots (*nf, *ni, *nu), recording them in aslot. */
static void wire_attrs(kiln__argplan *ap, const kiln__node *n, int8_t *aslot, int *nf, int *ni,
                       int *nu) {
  const kiln__op_info *info = &kiln__ops[n->op];
  bool used[KILN__MAX_ATTRS];
  kiln__kernel_attrs(n->op, used);
  for (int a = 0; a < info->nattr; a++) {
    aslot[a] = -1;
    if (!used[a]) continue;
    KILN_ASSERT(info->attrs[a].count == 1); /* kernels read no array attribute */
    int k = node_slot(n->op, a);
    switch (info->attrs[a].kind) {
    case KILN__ATTR_F:
      KILN_ASSERT(*nf < KILN__KMAX_F);
      attr_f(ap, *nf, n, k);
      aslot[a] = (int8_t)(*nf)++;
      break;
    case KILN__ATTR_I:
      KILN_ASSERT(*ni < KILN__KMAX_I);
      ap->args.i[*ni] = (int)n->i[k];
      aslot[a] = (int8_t)(*ni)++;
      break;
    case KILN__ATTR_U:
      KILN_ASSERT(*nu < KILN__KMAX_U);
      attr_u(ap, *nu, n, k);
      aslot[a] = (int8_t)(*nu)++;
      break;
    }
  }
}

/* Assigns operands, value names and attribute slots for prog. In a row program (row non-NULL)
 * row[j] says node j computes one value per row; a reduction's output is one value per row too. */
static void wire(const kiln__ew_prog *p, const bool *row, operands *o, wiring *w, kiln__argplan *ap,
                 int *nf, int *ni, int *nu) {
  w->coords = false;
  for (int j = 0; j < p->n; j++) {
    const kiln__node *nd = p->nodes[j];
    const kiln__op_info *info = &kiln__ops[nd->op];
    bool update = info->kind == KILN__KIND_UPDATE, red = info->kind == KILN__KIND_REDUCE;
    const kiln_tensor *in_row = row && row[j] ? nd->out : NULL;
    const kiln_tensor *out_row = row && (row[j] || red) ? nd->out : NULL;
    for (int q = 0; q < nd->nin; q++) {
      const kiln_tensor *x = nd->in[q];
      for (int k = 0; k < p->nalias; k++)
        if (p->alias[k].view == x) x = p->alias[k].value;
      int m = -1; /* an update reads only operands, input q as operand q */
      for (int k = 0; k < j && !update; k++)
        if (p->nodes[k]->out == x) m = k;
      w->val[j][q] = m;
      w->opnd[j][q] = m >= 0 ? -1 : operand(o, nd->in[q], false, in_row);
      KILN_ASSERT(!update || w->opnd[j][q] == q);
    }
    wire_attrs(ap, nd, w->aslot[j], nf, ni, nu);
    if (strstr(info->expr, "$c")) w->coords = true;
    w->store_slot[j] = !update && p->store[j] ? operand(o, nd->out, true, out_row) : -1;
  }
}

/* The name of node j's input q in the kernel: a value (v3) or an operand (x1). */
static void in_name(const wiring *w, int j, int q, char *buf, size_t n) {
  if (w->val[j][q] >= 0)
    snprintf(buf, n, "v%d", w->val[j][q]);
  else
    snprintf(buf, n, "x%d", w->opnd[j][q]);
}

/* Writes an op-table expression with node j's names and attribute slots. */
static void expand(kiln__sb *b, const char *tpl, const wiring *w, int j, const kiln__node *nd) {
  for (const char *p = tpl; *p; p++) {
    if (*p != '$') {
      kiln__sb_put(b, p, 1);
      continue;
    }
    kiln__token t = kiln__expr_token(nd->op, p + 1);
    char name[16];
    switch (t.kind) {
    case KILN__TOK_INPUT:
      in_name(w, j, t.input, name, sizeof name);
      kiln__sb_printf(b, "%s", name);
      break;
    case KILN__TOK_IDX: kiln__sb_printf(b, "i"); break;
    case KILN__TOK_ERR: kiln__sb_printf(b, "a.err"); break;
    case KILN__TOK_COORD: {
      kiln__attr_kind kind;
      int slot;
      KILN_ASSERT(kiln__attr_find(nd->op, "axis", 4, &kind, &slot) && kind == KILN__ATTR_I);
      kiln__sb_printf(b, "c%d", (int)nd->i[slot]);
      break;
    }
    case KILN__TOK_ATTR: {
      kiln__attr_kind kind = kiln__ops[nd->op].attrs[t.attr].kind;
      KILN_ASSERT(w->aslot[j][t.attr] >= 0);
      kiln__sb_printf(b, "a.%s[%d]",
                      kind == KILN__ATTR_F ? "fv" : (kind == KILN__ATTR_I ? "i" : "uv"),
                      w->aslot[j][t.attr]);
      break;
    }
    }
    p += t.len;
  }
}

/* Node j's value v<j>, an op-table expression. A bf16 value is rounded as its store would round
 * it, so that a fused kernel computes what the unfused ones, each storing its result, compute. */
static void emit_node_value(kiln__sb *b, const char *ind, const wiring *w, int j,
                            const kiln__node *nd) {
  bool bf16 = nd->out && nd->out->dtype == KILN_DTYPE_BF16;
  kiln__sb_printf(b, "%sconst %s v%d = %s", ind, bf16 ? "float" : "auto", j,
                  bf16 ? "(float)(kiln_bf16)(" : "");
  expand(b, kiln__ops[nd->op].expr, w, j, nd);
  kiln__sb_printf(b, "%s; // %s\n", bf16 ? ")" : "", kiln__ops[nd->op].name);
}

static void offset_expr(kiln__sb *b, int k, int nd, bool lin, char tail) {
  if (lin) {
    kiln__sb_printf(b, "i");
    return;
  }
  if (tail) {
    kiln__sb_printf(b, "i %s P%d", tail == 'm' ? "%" : "/", k);
    return;
  }
  if (nd == 0) kiln__sb_printf(b, "0");
  for (int d = 0; d < nd; d++)
    kiln__sb_printf(b, "%sc%d * a.st[%d][%d]", d ? " + " : "", d, k, d);
}

/* The loads (scalar), values and stores of prog for one element, indented by ind. In vector
 * mode loads come from the lanes L<k>[e] and stores go to S<k>[e]. */
static void emit_element(kiln__sb *b, const kiln__ew_prog *p, const operands *o, const wiring *w,
                         const char *ind, int nd, bool vec) {
  bool update = p->n == 1 && kiln__ops[p->nodes[0]->op].kind == KILN__KIND_UPDATE;
  for (int k = 0; k < o->n; k++) {
    if (o->store[k]) continue;
    const char *ct = ctype(o->t[k]->dtype);
    kiln__sb_printf(b, "%s%s%s x%d = ", ind, update ? "" : "const ", rtype(o->t[k]->dtype), k);
    if (vec) {
      kiln__sb_printf(b, "L%d[e];\n", k);
    } else {
      kiln__sb_printf(b, "((const %s *)a.ptr[%d])[", ct, k);
      offset_expr(b, k, nd, o->lin[k], o->tail[k]);
      kiln__sb_printf(b, "];\n");
    }
  }
  for (int j = 0; j < p->n; j++) {
    const kiln__node *n = p->nodes[j];
    const kiln__op_info *info = &kiln__ops[n->op];
    if (info->kind == KILN__KIND_UPDATE) {
      kiln__sb_printf(b, "%s", ind);
      expand(b, info->expr, w, j, n);
      kiln__sb_printf(b, "\n");
      for (int q = 0; q < n->nin; q++) {
        if (!(info->stores & (1u << q))) continue;
        int k = w->opnd[j][q]; /* updates read only operands */
        if (vec)
          kiln__sb_printf(b, "%sL%d[e] = x%d;\n", ind, k, k);
        else {
          const char *ct = ctype(o->t[k]->dtype);
          kiln__sb_printf(b, "%s((%s *)a.ptr[%d])[", ind, ct, k);
          offset_expr(b, k, nd, o->lin[k], o->tail[k]);
          kiln__sb_printf(b, "] = (%s)x%d;\n", ct, k);
        }
      }
      continue;
    }
    emit_node_value(b, ind, w, j, n);
    int k = w->store_slot[j];
    if (k < 0) continue;
    const char *ot = ctype(n->out->dtype);
    if (vec) {
      kiln__sb_printf(b, "%sS%d[e] = (float)v%d;\n", ind, k, j);
    } else {
      kiln__sb_printf(b, "%s((%s *)a.ptr[%d])[", ind, ot, k);
      offset_expr(b, k, nd, o->lin[k], o->tail[k]);
      kiln__sb_printf(b, "] = (%s)v%d;\n", ot, j);
    }
  }
}

static void emit_coords(kiln__sb *b, const char *ind, int nd, const char *idx) {
  if (nd == 0) return;
  kiln__sb_printf(b, "%six r = %s;\n", ind, idx);
  for (int d = nd - 1; d > 0; d--)
    kiln__sb_printf(b, "%sconst ix c%d = r %% (ix)a.shape[%d]; r /= (ix)a.shape[%d];\n", ind, d, d,
                    d);
  kiln__sb_printf(b, "%sconst ix c0 = r;\n", ind);
}

/* Characters of op names a kernel name lists before it says "_etc<n>": names stay readable in
 * profiles and fit the 96 bytes kernel names have with their suffix and hash. */
#define KILN__NAME_OPS 40

/* A kernel name from the ops it runs, like k_add_relu_f32, kept short. */
static void stem_of(const kiln__ew_prog *p, const char *prefix, const char *suffix, char *stem,
                    size_t n) {
  size_t k = (size_t)snprintf(stem, n, "%s", prefix);
  for (int j = 0; j < p->n && k < n; j++) {
    if (k > KILN__NAME_OPS) {
      k += (size_t)snprintf(stem + k, n - k, "_etc%d", p->n - j);
      break;
    }
    k += (size_t)snprintf(stem + k, n - k, "_%s", kiln__ops[p->nodes[j]->op].name);
  }
  if (k < n) snprintf(stem + k, n - k, "%s", suffix);
}

/* Names the kernel after its stem, the text pre and its body, and wraps the body into the kernel's
 * source, after the prelude and pre (declarations at file scope; NULL: none). */
static bool finish_with(kiln__sb *body, const char *stem, const operands *o, kiln__rendered *r,
                        const char *pre) {
  if (body->oom) return false;
  uint64_t h = kiln__hash(body->s, body->n, pre ? kiln__hash(pre, strlen(pre), 0) : 0);
  snprintf(r->name, sizeof r->name, "%s_%08" PRIx64, stem, h & 0xffffffffu);
  kiln__sb_printf(&r->src,
                  "#include \"prelude.cuh\"\n%s"
                  "extern \"C\" __global__ void __launch_bounds__(%d) %s(const kiln__kargs a) {\n"
                  "%s}\n",
                  pre ? pre : "", KILN__BLOCK, r->name, body->s);
  if (o) {
    r->arg.nptr = o->n;
    for (int k = 0; k < o->n; k++)
      r->arg.ptr[k] = o->t[k];
  }
  return !r->src.oom;
}

static bool finish(kiln__sb *body, const char *stem, const operands *o, kiln__rendered *r) {
  return finish_with(body, stem, o, r, NULL);
}

/* Blocks for a grid-stride loop over threads: at most this many per SM (enough resident
 * blocks to hide latency; the loop covers the rest). */
#define KILN__BLOCKS_PER_SM 8

static unsigned grid_for(const kiln__target *t, int64_t threads) {
  int64_t blocks = (threads + KILN__BLOCK - 1) / KILN__BLOCK,
          cap = (int64_t)t->num_sms * KILN__BLOCKS_PER_SM;
  return (unsigned)(blocks < 1 ? 1 : (blocks > cap ? cap : blocks));
}

/* ---------------------------------------------------------------- elementwise */

/* Room below 2^31 for a grid-stride index to step past the last element without overflowing. */
#define KILN__INDEX_MARGIN 1024

/* Whether a kernel whose offsets and indices reach span needs 64-bit indices. */
static bool wide_index(int64_t span) { return span >= ((int64_t)1 << 31) - KILN__INDEX_MARGIN; }

static void emit_index_type(kiln__sb *b, bool wide) {
  kiln__sb_printf(b, "  typedef %s ix; // %s indexing\n", wide ? "long long" : "int",
                  wide ? "64-bit" : "32-bit");
}

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

static bool render_ew(const kiln__target *t, const kiln__ew_prog *p, kiln__rendered *r) {
  int nd = p->ndim;
  int64_t n = kiln__numel(nd, p->shape);
  kiln__kargs *a = &r->arg.args;
  a->n = n;
  for (int d = 0; d < nd; d++)
    a->shape[d] = p->shape[d];
  operands o = {0};
  wiring w;
  int nf = 0, ni = 0, nu = 0;
  wire(p, NULL, &o, &w, &r->arg, &nf, &ni, &nu);
  bool update = p->n == 1 && kiln__ops[p->nodes[0]->op].kind == KILN__KIND_UPDATE;
  bool coords = w.coords, vec = n % 4 == 0 && n > 0 && !w.coords, floats = true;
  int64_t span = n; /* the largest offset any operand reaches, for the index type */
  int64_t tail_len[KILN__KMAX_PTR];
  int tail_dim[KILN__KMAX_PTR];
  for (int k = 0; k < o.n; k++) {
    const kiln_tensor *x = o.t[k];
    align_strides(x, nd, p->shape, a->st[k]);
    o.lin[k] = dense(x, n);
    tail_dim[k] = nd;
    o.tail[k] =
        o.lin[k] || o.store[k] || update ? 0 : tail_form(a->st[k], nd, p->shape, &tail_dim[k]);
    tail_len[k] = o.tail[k] ? kiln__numel(nd - tail_dim[k], p->shape + tail_dim[k]) : 1;
    int64_t reach = 0;
    for (int d = 0; d < nd; d++)
      reach += (p->shape[d] - 1) * llabs(a->st[k][d]);
    if (reach > span) span = reach;
    if (!o.lin[k] && !o.tail[k]) coords = true;
    /* four-element accesses: 16-byte (f32) or 8-byte (bf16) aligned, as every storage starts
     * 256-byte aligned (core/alloc.c; the executor asserts it when it binds pointers); a tail
     * operand's four lanes are four neighbours (i % P) or one value (i / P) when 4 divides P */
    vec = vec && (o.tail[k] == 'd'
                      ? tail_len[k] % 4 == 0
                      : (o.lin[k] || (o.tail[k] && tail_len[k] % 4 == 0)) && x->offset % 4 == 0);
    floats = floats && kiln__is_float(x->dtype);
    if (o.store[k])
      r->bytes_written += footprint(x);
    else
      r->bytes_read += footprint(x);
  }
  for (int j = 0; j < p->n; j++) /* updates write their inputs back */
    if (kiln__ops[p->nodes[j]->op].kind == KILN__KIND_UPDATE)
      for (int q = 0; q < p->nodes[j]->nin; q++)
        if (kiln__ops[p->nodes[j]->op].stores & (1u << q))
          r->bytes_written += footprint(p->nodes[j]->in[q]);
  vec = vec && floats && !coords;
  /* 32-bit indices while every offset (and a grid-stride step past the end) fits an int */
  bool wide = wide_index(span);

  kiln__sb b = {0};
  emit_index_type(&b, wide);
  for (int k = 0; k < o.n; k++) {
    if (!o.tail[k]) continue;
    kiln__sb_printf(&b, "  const ix P%d = (ix)(1", k);
    for (int d = tail_dim[k]; d < nd; d++)
      kiln__sb_printf(&b, " * a.shape[%d]", d);
    kiln__sb_printf(&b, "); // operand %d: %s\n", k,
                    o.tail[k] == 'm' ? "its last dims" : "its first dims");
  }
  if (vec) {
    /* four elements a thread per iteration, each operand in one access (bf16.cuh) */
    kiln__sb_printf(&b, "  const ix n4 = (ix)(a.n >> 2);\n"
                        "  for (ix q = (ix)blockIdx.x * blockDim.x + threadIdx.x; q < n4;\n"
                        "       q += (ix)gridDim.x * blockDim.x) {\n");
    for (int k = 0; k < o.n; k++) {
      const char *ct = ctype(o.t[k]->dtype);
      if (o.store[k])
        kiln__sb_printf(&b, "    float S%d[4];\n", k);
      else if (o.tail[k] == 'd')
        kiln__sb_printf(&b,
                        "    float L%d[4];\n    L%d[0] = L%d[1] = L%d[2] = L%d[3] = "
                        "(float)((const %s *)a.ptr[%d])[q * 4 / P%d];\n",
                        k, k, k, k, k, ct, k, k);
      else if (o.tail[k] == 'm')
        kiln__sb_printf(&b,
                        "    float L%d[4];\n    kiln_load4((const %s *)a.ptr[%d] + q * 4 %% P%d, "
                        "L%d);\n",
                        k, ct, k, k, k);
      else
        kiln__sb_printf(&b,
                        "    float L%d[4];\n    kiln_load4((const %s *)a.ptr[%d] + q * 4, L%d);\n",
                        k, ct, k, k);
    }
    kiln__sb_printf(&b, "#pragma unroll\n    for (int e = 0; e < 4; e++) {\n"
                        "      const ix i = q * 4 + e;\n      (void)i;\n");
    emit_element(&b, p, &o, &w, "      ", nd, true);
    kiln__sb_printf(&b, "    }\n");
    for (int k = 0; k < o.n; k++) {
      if (o.store[k] || (update && (kiln__ops[p->nodes[0]->op].stores & (1u << k))))
        kiln__sb_printf(&b, "    kiln_store4((%s *)a.ptr[%d] + q * 4, %s%d);\n",
                        ctype(o.t[k]->dtype), k, o.store[k] ? "S" : "L", k);
    }
    kiln__sb_printf(&b, "  }\n");
  } else {
    kiln__sb_printf(&b, "  for (ix i = (ix)blockIdx.x * blockDim.x + threadIdx.x; i < (ix)a.n;\n"
                        "       i += (ix)gridDim.x * blockDim.x) {\n");
    if (coords) emit_coords(&b, "    ", nd, "i");
    emit_element(&b, p, &o, &w, "    ", nd, false);
    kiln__sb_printf(&b, "  }\n");
  }
  const kiln__node *last = p->nodes[p->n - 1];
  const kiln_tensor *typed = last->out ? last->out : last->in[0];
  char stem[80], suffix[24];
  snprintf(suffix, sizeof suffix, "_%s%s", kiln_dtype_name(typed->dtype), vec ? "_v4" : "");
  stem_of(p, "k", suffix, stem, sizeof stem);
  bool ok = finish(&b, stem, &o, r);
  kiln__sb_free(&b);
  r->block = KILN__BLOCK;
  r->grid = grid_for(t, vec ? n / 4 : n);
  return ok;
}

/* ---------------------------------------------------------------- multi-tensor updates */

/* One launch runs the same update over T tensors, tensor t in blockIdx.y, its inputs in
 * a.ptr[t * nin ...] and its length in a.st[t][0]. */
static bool render_updates(const kiln__target *tg, const kiln__node *const *nodes, int T,
                           kiln__rendered *r) {
  const kiln__node *n0 = nodes[0];
  const kiln__op_info *info = &kiln__ops[n0->op];
  int nin = n0->nin;
  kiln__kargs *a = &r->arg.args;
  wiring w;
  int nf = 0, ni = 0, nu = 0;
  wire_attrs(&r->arg, n0, w.aslot[0], &nf, &ni, &nu);
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
      r->bytes_read += footprint(nodes[t]->in[q]);
      if (info->stores & (1u << q)) r->bytes_written += footprint(nodes[t]->in[q]);
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
  for (int q = 0; q < nin; q++) /* scale's factor is one value for every element */
    kiln__sb_printf(&b, "    float x%d = ((const float *)a.ptr[t * %d + %d])[%s];\n", q, nin, q,
                    n0->op == KILN__OP_SCALE && q == 1 ? "0" : "i");
  kiln__sb_printf(&b, "    ");
  expand(&b, info->expr, &w, 0, n0);
  kiln__sb_printf(&b, "\n");
  for (int q = 0; q < nin; q++)
    if (info->stores & (1u << q))
      kiln__sb_printf(&b, "    ((float *)a.ptr[t * %d + %d])[i] = x%d;\n", nin, q, q);
  kiln__sb_printf(&b, "  }\n");
  char stem[64];
  snprintf(stem, sizeof stem, "k_%s_f32_x%d", info->name, T);
  bool ok = finish(&b, stem, NULL, r);
  kiln__sb_free(&b);
  r->block = KILN__BLOCK;
  r->grid = grid_for(tg, most);
  r->grid_y = (unsigned)T;
  return ok;
}

/* ---------------------------------------------------------------- reductions */

/* Outputs per SM below which a reduction takes a block per output rather than a thread. */
#define KILN__FEW_OUTPUTS_PER_SM 4
/* Blocks a row-wise kernel launches per SM at most (its loop covers the remaining rows). */
#define KILN__ROW_BLOCKS_PER_SM 16

/* One block a row (a.n rows of a.nred elements): a power of two of 32 to 256 threads. */
static void row_launch(const kiln__target *t, kiln__rendered *r) {
  int64_t bl = 32, rows = r->arg.args.n, cap = (int64_t)t->num_sms * KILN__ROW_BLOCKS_PER_SM;
  while (bl < r->arg.args.nred && bl < KILN__BLOCK)
    bl *= 2;
  r->block = (unsigned)bl;
  r->grid = (unsigned)(rows < 1 ? 1 : (rows > cap ? cap : rows));
}

/* A reduction, its input computed by an elementwise prologue or read from memory. Strategy
 * "rows": one block per output, threads stride over the reduced elements (for reductions along
 * the innermost dim), combined by reduce.cuh's block reductions. Strategy "cols": one thread per
 * output, looping over the reduced elements (neighbouring threads read neighbouring columns). */
static bool render_reduce(const kiln__target *t, const kiln__ew_prog *pro, const kiln__node *rn,
                          kiln__rendered *r) {
  const kiln_tensor *x = rn->in[0];
  unsigned mask = (unsigned)KILN__RI(rn, mask);
  int nd = x->ndim;
  kiln__kargs *a = &r->arg.args;
  operands o = {0};
  wiring w;
  int nf = 0, ni = 0, nu = 0, value = -1; /* the prologue node whose value is reduced */
  if (pro->n > 0) {
    wire(pro, NULL, &o, &w, &r->arg, &nf, &ni, &nu);
    for (int j = 0; j < pro->n; j++)
      if (pro->nodes[j]->out == x) value = j;
    KILN_ASSERT(value >= 0);
  } else {
    operand(&o, x, false, NULL);
  }
  int8_t rslot[KILN__MAX_ATTRS];
  wire_attrs(&r->arg, rn, rslot, &nf, &ni, &nu); /* the scale, after the prologue's */
  int scale = rslot[kiln__attr_index(rn->op, "scale")];
  int out = operand(&o, rn->out, true, NULL);
  int outer[KILN_MAX_DIMS], red[KILN_MAX_DIMS], no = 0, nr = 0;
  a->n = 1;
  a->nred = 1;
  for (int d = 0; d < nd; d++) {
    if (mask & (1u << d)) {
      a->rshape[nr] = x->shape[d];
      red[nr++] = d;
      a->nred *= x->shape[d];
    } else {
      a->shape[no] = x->shape[d];
      outer[no++] = d;
      a->n *= x->shape[d];
    }
  }
  int64_t span = a->n * a->nred; /* the largest offset or index, for the index type */
  for (int k = 0; k < o.n; k++) {
    if (k != out) align_strides(o.t[k], nd, x->shape, a->st[k]);
    o.lin[k] = false;
    int64_t reach = 0;
    for (int d = 0; d < nd && k != out; d++)
      reach += (x->shape[d] - 1) * llabs(a->st[k][d]);
    if (reach > span) span = reach;
  }
  tally_bytes(&o, r);
  bool wide = wide_index(span);
  bool argmax = rn->op == KILN__OP_ARGMAX, isum = rn->op == KILN__OP_SUM;
  bool exact = isum && rn->out->dtype == KILN_DTYPE_I32; /* i32 values, summed in 64 bits */
  const char *acct = exact ? "long long" : "float";
  bool inner = nr > 0 && red[nr - 1] == nd - 1 && (value >= 0 || x->stride[nd - 1] == 1);
  /* a block per output when the reduced axis is innermost (coalesced), or when there are too few
   * outputs for a thread per output to fill the device */
  bool rows = nr > 0 && (inner || a->n < (int64_t)t->num_sms * KILN__FEW_OUTPUTS_PER_SM);
  const char *init = exact ? "0" : (isum ? "0.f" : "-__int_as_float(0x7f800000)");

  kiln__sb b = {0};
  emit_index_type(&b, wide);
  if (rows) {
    /* a block reduction's partials: one per warp, at most 32 warps (reduce.cuh) */
    kiln__sb_printf(&b, "  __shared__ %s sv[32];\n", acct);
    if (argmax) kiln__sb_printf(&b, "  __shared__ long long si[32];\n");
    kiln__sb_printf(&b, "  for (ix o = blockIdx.x; o < a.n; o += gridDim.x) {\n");
  } else {
    kiln__sb_printf(&b, "  for (ix o = (ix)blockIdx.x * blockDim.x + threadIdx.x; o < a.n;\n"
                        "       o += (ix)gridDim.x * blockDim.x) {\n");
  }
  /* the coordinates: the first of each kind needs no division (o < a.n, j < a.nred) */
  kiln__sb_printf(&b, "    ix r = o;\n");
  for (int k = no - 1; k > 0; k--)
    kiln__sb_printf(&b, "    const ix c%d = r %% (ix)a.shape[%d]; r /= (ix)a.shape[%d];\n",
                    outer[k], k, k);
  if (no > 0) kiln__sb_printf(&b, "    const ix c%d = r;\n", outer[0]);
  kiln__sb_printf(&b, "    %s acc = %s;\n", acct, init);
  if (argmax) kiln__sb_printf(&b, "    long long ai = 0x7fffffffffffffffll;\n");
  if (rows)
    kiln__sb_printf(&b, "    for (ix j = threadIdx.x; j < a.nred; j += blockDim.x) {\n");
  else
    kiln__sb_printf(&b, "    for (ix j = 0; j < a.nred; j++) {\n");
  kiln__sb_printf(&b, "      ix q = j;\n");
  for (int k = nr - 1; k > 0; k--)
    kiln__sb_printf(&b, "      const ix c%d = q %% (ix)a.rshape[%d]; q /= (ix)a.rshape[%d];\n",
                    red[k], k, k);
  if (nr > 0) kiln__sb_printf(&b, "      const ix c%d = q;\n", red[0]);
  if (value >= 0) {
    emit_element(&b, pro, &o, &w, "      ", nd, false);
    kiln__sb_printf(&b, "      const %s v = v%d;\n", acct, value);
  } else {
    kiln__sb_printf(&b, "      const %s v = ((const %s *)a.ptr[0])[", acct, ctype(x->dtype));
    offset_expr(&b, 0, nd, false, 0);
    kiln__sb_printf(&b, "];\n");
  }
  if (argmax)
    kiln__sb_printf(&b, "      kiln_argmax_step(acc, ai, v, j);\n");
  else if (isum)
    kiln__sb_printf(&b, "      acc += v;\n");
  else
    kiln__sb_printf(&b, "      acc = kiln_maximum(acc, v);\n");
  kiln__sb_printf(&b, "    }\n");
  char store[128];
  if (argmax)
    snprintf(store, sizeof store, "((int *)a.ptr[%d])[o] = (int)ai;", out);
  else if (exact)
    snprintf(store, sizeof store, "((int *)a.ptr[%d])[o] = kiln_i32_total(acc, a.err);", out);
  else
    snprintf(store, sizeof store, "((%s *)a.ptr[%d])[o] = (%s)(acc * a.fv[%d]);",
             ctype(rn->out->dtype), out, ctype(rn->out->dtype), scale);
  if (rows) {
    if (argmax)
      kiln__sb_printf(&b, "    kiln_block_argmax(acc, ai, sv, si);\n");
    else
      kiln__sb_printf(&b, "    acc = kiln_block_%s(acc, sv);\n", isum ? "sum" : "max");
    kiln__sb_printf(&b, "    if (threadIdx.x == 0) %s\n", store);
  } else {
    kiln__sb_printf(&b, "    %s\n", store);
  }
  kiln__sb_printf(&b, "  }\n");

  char stem[80], suffix[40];
  snprintf(suffix, sizeof suffix, "_%s_%s_%dd_%dr_%s", kiln__ops[rn->op].name,
           kiln_dtype_name(argmax ? x->dtype : rn->out->dtype), no, nr, rows ? "rows" : "cols");
  if (value >= 0)
    stem_of(pro, "k", suffix, stem, sizeof stem);
  else
    snprintf(stem, sizeof stem, "k%s", suffix);
  bool ok = finish(&b, stem, &o, r);
  kiln__sb_free(&b);
  if (rows) {
    row_launch(t, r);
  } else {
    r->block = KILN__BLOCK;
    r->grid = grid_for(t, a->n);
  }
  return ok;
}

/* ---------------------------------------------------------------- row gathers */

/* index_add, index_select's gradient: the rows of g (K, ...) added into the rows of y (V, ...)
 * that the indices name. The executor zeroes y first (zero_slot); rows named twice are summed by
 * atomic adds, so their order, and the last bits of such sums, may vary from run to run. */
static bool render_scatter(const kiln__target *tg, const kiln__node *n, const operands *o,
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
  bool ok = finish(&b, "k_index_add_f32", o, r);
  kiln__sb_free(&b);
  r->block = KILN__BLOCK;
  r->grid = grid_for(tg, a->n);
  r->zero_slot = 2;
  r->zero_bytes = footprint(y);
  r->bytes_read = footprint(g) + footprint(idx);
  r->bytes_written = footprint(y);
  return ok;
}

static bool render_gather(const kiln__target *tg, const kiln__node *n, kiln__rendered *r) {
  const kiln_tensor *x = n->in[0], *idx = n->in[1], *y = n->out;
  kiln__kargs *a = &r->arg.args;
  operands o = {0};
  operand(&o, x, false, NULL);
  operand(&o, idx, false, NULL);
  operand(&o, y, true, NULL);
  int8_t aslot[KILN__MAX_ATTRS];
  int nf = 0, ni = 0, nu = 0;
  wire_attrs(&r->arg, n, aslot, &nf, &ni, &nu);
  int start =
      aslot[kiln__attr_index(n->op, "start")]; /* the slot of where this step's indices start */
  if (n->op == KILN__OP_INDEX_ADD) return render_scatter(tg, n, &o, start, r);
  a->n = kiln_tensor_numel(y);
  a->nred = x->shape[0] ? kiln_tensor_numel(x) / x->shape[0] : 0; /* elements per row */
  a->shape[0] = x->shape[0];
  const char *t = ctype(x->dtype);
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
  bool ok = finish(&b, stem, &o, r);
  kiln__sb_free(&b);
  r->block = KILN__BLOCK;
  r->grid = grid_for(tg, a->n);
  r->bytes_read = footprint(y) + footprint(idx); /* the rows picked, not the whole table */
  r->bytes_written = footprint(y);
  return ok;
}

/* ---------------------------------------------------------------- sliding windows */

/* Loads V lanes of channels from p[off] (in one access when V is 4: bf16.cuh's kiln_load4)
 * into float name[V]. */
static void emit_lanes_load(kiln__sb *b, const char *ind, const char *name, const char *p,
                            const char *off, int V) {
  if (V == 4)
    kiln__sb_printf(b, "%sfloat %s[4];\n%skiln_load4(&%s[%s], %s);\n", ind, name, ind, p, off,
                    name);
  else
    kiln__sb_printf(b, "%sconst float %s[1] = {(float)%s[%s]};\n", ind, name, p, off);
}

/* Stores float name[V] to the output, operand `out` of dtype dt, at lane group e. */
static void emit_lanes_store(kiln__sb *b, const char *name, int out, kiln_dtype dt, int V) {
  const char *t = ctype(dt);
  if (V == 4)
    kiln__sb_printf(b, "    kiln_store4(&((%s *)a.ptr[%d])[e * 4], %s);\n", t, out, name);
  else
    kiln__sb_printf(b, "    ((%s *)a.ptr[%d])[e] = (%s)%s[0];\n", t, out, t, name);
}

/* A window kernel's elementwise epilogue: the nodes after the window op in its group (node 0 of
 * p), computed for each lane of the op's result, lane l at output coordinates (n, h, w, c + l)
 * (image-side outputs) or (n, oh, ow, c + l). */
typedef struct win_epi {
  const kiln__ew_prog *p;
  const operands *o;
  const wiring *w;
  const int64_t *shape; /* the output's */
  bool image;
  bool vec; /* four lanes, and every operand of the epilogue dense like the output: each read
             * and written four values at a time */
} win_epi;

/* The memory types of a window op's operands: its inputs' and its output's. */
typedef struct win_types {
  const char *in0, *in1, *out;
  kiln_dtype out_dt;
} win_types;

/* Writes float name[V], the window op's lanes: to operand out, or through the epilogue e. */
static void store_lanes(kiln__sb *b, const char *name, int out, kiln_dtype dt, int V,
                        const win_epi *e) {
  if (!e) {
    emit_lanes_store(b, name, out, dt, V);
    return;
  }
  const operands *o = e->o;
  const wiring *w = e->w;
  bool bf16 = dt == KILN_DTYPE_BF16; /* the op's value, rounded as its store would round it */
  bool used[KILN__KMAX_PTR] = {0};
  for (int j = 1; j < e->p->n; j++)
    for (int q = 0; q < e->p->nodes[j]->nin; q++)
      if (w->opnd[j][q] >= 0) used[w->opnd[j][q]] = true;
  if (e->vec) {
    kiln__sb_printf(b, "    {\n      const ix i0 = ((n * %lld + %s) * %lld + %s) * %lld + c;\n",
                    (long long)e->shape[1], e->image ? "h" : "oh", (long long)e->shape[2],
                    e->image ? "w" : "ow", (long long)e->shape[3]);
    for (int k = 0; k < o->n; k++) {
      if (o->store[k])
        kiln__sb_printf(b, "      float S%d[4];\n", k);
      else if (used[k])
        kiln__sb_printf(b,
                        "      float X%d[4];\n      kiln_load4((const %s *)a.ptr[%d] + i0, X%d);\n",
                        k, ctype(o->t[k]->dtype), k, k);
    }
    kiln__sb_printf(b,
                    "#pragma unroll\n"
                    "      for (int l = 0; l < 4; l++) {\n"
                    "        const ix i = i0 + l;\n"
                    "        (void)i;\n"
                    "        const float v0 = %s%s[l];\n",
                    bf16 ? "(float)(kiln_bf16)" : "", name);
    for (int k = 0; k < o->n; k++)
      if (used[k] && !o->store[k]) kiln__sb_printf(b, "        const float x%d = X%d[l];\n", k, k);
    for (int j = 0; j < e->p->n; j++) {
      if (j > 0) emit_node_value(b, "        ", w, j, e->p->nodes[j]);
      if (w->store_slot[j] >= 0)
        kiln__sb_printf(b, "        S%d[l] = (float)v%d;\n", w->store_slot[j], j);
    }
    kiln__sb_printf(b, "      }\n");
    for (int k = 0; k < o->n; k++)
      if (o->store[k])
        kiln__sb_printf(b, "      kiln_store4((%s *)a.ptr[%d] + i0, S%d);\n", ctype(o->t[k]->dtype),
                        k, k);
    kiln__sb_printf(b, "    }\n");
    return;
  }
  kiln__sb_printf(b,
                  "#pragma unroll\n"
                  "    for (int l = 0; l < V; l++) {\n"
                  "      const ix c0 = n, c1 = %s, c2 = %s, c3 = c + l;\n"
                  "      const ix i = ((c0 * %lld + c1) * %lld + c2) * %lld + c3;\n"
                  "      (void)i;\n"
                  "      const float v0 = %s%s[l];\n",
                  e->image ? "h" : "oh", e->image ? "w" : "ow", (long long)e->shape[1],
                  (long long)e->shape[2], (long long)e->shape[3], bf16 ? "(float)(kiln_bf16)" : "",
                  name);
  for (int k = 0; k < o->n; k++) {
    if (!used[k] || o->store[k]) continue;
    kiln__sb_printf(b, "      const %s x%d = ((const %s *)a.ptr[%d])[", rtype(o->t[k]->dtype), k,
                    ctype(o->t[k]->dtype), k);
    offset_expr(b, k, 4, o->lin[k], 0);
    kiln__sb_printf(b, "];\n");
  }
  for (int j = 0; j < e->p->n; j++) {
    const kiln__node *nd = e->p->nodes[j];
    if (j > 0) emit_node_value(b, "      ", w, j, nd);
    int k = w->store_slot[j];
    if (k < 0) continue;
    const char *ot = ctype(nd->out->dtype);
    kiln__sb_printf(b, "      ((%s *)a.ptr[%d])[", ot, k);
    offset_expr(b, k, 4, o->lin[k], 0);
    kiln__sb_printf(b, "] = (%s)v%d;\n", ot, j);
  }
  kiln__sb_printf(b, "    }\n");
}

/* The image coordinates (n, h, w, channel lane group c) or the window-side ones (n, oh, ow, c)
 * of lane group e. */
static void emit_split(kiln__sb *b, bool image) {
  kiln__sb_printf(b,
                  "    ix m = e;\n"
                  "    const ix c = (m %% (C / V)) * V; m /= C / V;\n"
                  "    const ix %s = m %% %s; m /= %s;\n"
                  "    const ix %s = m %% %s, n = m / %s;\n",
                  image ? "w" : "ow", image ? "W" : "OW", image ? "W" : "OW", image ? "h" : "oh",
                  image ? "H" : "OH", image ? "H" : "OH");
}

/* Loops over the windows (oh, ow) that read image pixel (h, w) through tap (i, j), innermost
 * code at 8 spaces; closed by emit_taps_end. */
static void emit_taps_of_pixel(kiln__sb *b) {
  kiln__sb_printf(b, "    for (int i = 0; i < KH; i++) {\n"
                     "      const ix th = h + PH - i * DH;\n"
                     "      if (th < 0 || th %% SH != 0 || th / SH >= OH) continue;\n"
                     "      const ix oh = th / SH;\n"
                     "      for (int j = 0; j < KW; j++) {\n"
                     "        const ix tw = w + PW - j * DW;\n"
                     "        if (tw < 0 || tw %% SW != 0 || tw / SW >= OW) continue;\n"
                     "        const ix ow = tw / SW;\n");
}
static void emit_taps_end(kiln__sb *b) { kiln__sb_printf(b, "      }\n    }\n"); }

/* The CUDA C body of a window op (ops.def). One thread computes V neighbouring channels of one
 * output element (V = 4, with 16-byte loads and stores, when the channels of a group allow it),
 * in a grid-stride loop over a.n lane groups. Geometry and sizes (but the batch) are constants,
 * so that every division is by a constant. Operand 0 is the input, operand 1 max_pool_grad's
 * image or else the output, operand 2 max_pool_grad's output. */
static void window_body(kiln__sb *b, const kiln__node *n, const kiln__win *w, int64_t flag,
                        const int64_t *sz, int V, bool wide, bool tiled, int out,
                        const win_types *ty, const win_epi *epi) {
  kiln_dtype odt = ty->out_dt;
  kiln__sb_printf(
      b,
      "  typedef %s ix;\n"
      "  const int KH = %lld, KW = %lld, SH = %lld, SW = %lld, PH = %lld, PW = %lld,"
      " DH = %lld, DW = %lld, V = %d;\n"
      "  const ix H = %lld, W = %lld, C = %lld, OH = %lld, OW = %lld;\n"
      "  (void)KH; (void)KW; (void)DH; (void)DW; (void)PH; (void)PW; (void)H; (void)W;\n"
      "  for (ix e = (ix)blockIdx.x * blockDim.x + threadIdx.x; e < (ix)a.n;\n"
      "       e += (ix)gridDim.x * blockDim.x) {\n",
      wide ? "long long" : "int", (long long)w->kh, (long long)w->kw, (long long)w->sh,
      (long long)w->sw, (long long)w->ph, (long long)w->pw, (long long)w->dh, (long long)w->dw, V,
      (long long)sz[1], (long long)sz[2], (long long)sz[3], (long long)sz[4], (long long)sz[5]);
  switch (n->op) {
  case KILN__OP_IM2COL: /* e over (N, OH, OW, K / V), K in (group, i, j, channel of the group) */
    kiln__sb_printf(b,
                    "    const ix G = %lld, CG = C / G, K = KH * KW * C;\n"
                    "    const %s *x = (const %s *)a.ptr[0];\n"
                    "    ix k = (e %% (K / V)) * V, m = e / (K / V);\n"
                    "    const ix cg = k %% CG; k /= CG;\n"
                    "    const int j = (int)(k %% KW); k /= KW;\n"
                    "    const int i = (int)(k %% KH);\n"
                    "    const ix c = (k / KH) * CG + cg;\n"
                    "    const ix ow = m %% OW; m /= OW;\n"
                    "    const ix oh = m %% OH, n = m / OH;\n"
                    "    const ix h = oh * SH - PH + i * DH, w = ow * SW - PW + j * DW;\n"
                    "    float y[V];\n"
                    "    if (h >= 0 && h < H && w >= 0 && w < W) {\n",
                    (long long)flag, ty->in0, ty->in0);
    emit_lanes_load(b, "      ", "xv", "x", "((n * H + h) * W + w) * C + c", V);
    kiln__sb_printf(b, "#pragma unroll\n"
                       "      for (int l = 0; l < V; l++) y[l] = xv[l];\n"
                       "    } else {\n"
                       "#pragma unroll\n"
                       "      for (int l = 0; l < V; l++) y[l] = 0.f;\n"
                       "    }\n");
    store_lanes(b, "y", out, odt, V, epi);
    break;
  case KILN__OP_COL2IM: /* e over the image: the sum of the columns that read it */
    kiln__sb_printf(b,
                    "    const ix G = %lld, CG = C / G, K = KH * KW * C;\n"
                    "    const %s *col = (const %s *)a.ptr[0];\n",
                    (long long)flag, ty->in0, ty->in0);
    emit_split(b, true);
    kiln__sb_printf(b, "    const ix g = c / CG, cg = c %% CG;\n"
                       "    float acc[V] = {};\n");
    emit_taps_of_pixel(b);
    emit_lanes_load(b, "        ", "cv", "col",
                    "((n * OH + oh) * OW + ow) * K + ((g * KH + i) * KW + j) * CG + cg", V);
    kiln__sb_printf(b, "#pragma unroll\n"
                       "        for (int l = 0; l < V; l++) acc[l] += cv[l];\n");
    emit_taps_end(b);
    store_lanes(b, "acc", out, odt, V, epi);
    break;
  case KILN__OP_MAX_POOL: /* the window's first maximum, NaN winning (PyTorch's) */
    kiln__sb_printf(b, "    const %s *x = (const %s *)a.ptr[0];\n", ty->in0, ty->in0);
    emit_split(b, false);
    kiln__sb_printf(b, "    float best[V];\n"
                       "#pragma unroll\n"
                       "    for (int l = 0; l < V; l++) best[l] = -__int_as_float(0x7f800000);\n"
                       "    for (int i = 0; i < KH; i++) {\n"
                       "      const ix h = oh * SH - PH + i * DH;\n"
                       "      if (h < 0 || h >= H) continue;\n"
                       "      for (int j = 0; j < KW; j++) {\n"
                       "        const ix w = ow * SW - PW + j * DW;\n"
                       "        if (w < 0 || w >= W) continue;\n");
    emit_lanes_load(b, "        ", "xv", "x", "((n * H + h) * W + w) * C + c", V);
    kiln__sb_printf(b, "#pragma unroll\n"
                       "        for (int l = 0; l < V; l++)\n"
                       "          if (xv[l] > best[l] || isnan(xv[l])) best[l] = xv[l];\n");
    emit_taps_end(b);
    store_lanes(b, "best", out, odt, V, epi);
    break;
  case KILN__OP_MAX_POOL_GRAD:
    if (tiled) { /* e over the windows, which tile the image: each writes its own pixels */
      kiln__sb_printf(b,
                      "    const %s *dy = (const %s *)a.ptr[0];\n"
                      "    const %s *x = (const %s *)a.ptr[1];\n",
                      ty->in0, ty->in0, ty->in1, ty->in1);
      if (!epi) kiln__sb_printf(b, "    %s *dx = (%s *)a.ptr[%d];\n", ty->out, ty->out, out);
      emit_split(b, false);
      kiln__sb_printf(b, "    float best[V];\n"
                         "    int at[V];\n"
                         "#pragma unroll\n"
                         "    for (int l = 0; l < V; l++) at[l] = -1;\n"
                         "    for (int p = 0; p < KH; p++)\n"
                         "      for (int q = 0; q < KW; q++) {\n");
      emit_lanes_load(b, "        ", "xv", "x", "((n * H + oh * KH + p) * W + ow * KW + q) * C + c",
                      V);
      kiln__sb_printf(b, "#pragma unroll\n"
                         "        for (int l = 0; l < V; l++)\n"
                         "          if (at[l] < 0 || xv[l] > best[l] || isnan(xv[l])) {\n"
                         "            best[l] = xv[l];\n"
                         "            at[l] = p * KW + q;\n"
                         "          }\n"
                         "      }\n");
      emit_lanes_load(b, "    ", "gv", "dy", "((n * OH + oh) * OW + ow) * C + c", V);
      /* the window's pixels, and the last window of a row or column also writes the zeros of
       * the pixels no window covers (the image's last rows or columns when KH or KW does not
       * divide it) */
      kiln__sb_printf(b,
                      "    const ix hend = %s, wend = %s;\n"
                      "    for (ix h = oh * KH; h < hend; h++)\n"
                      "      for (ix w = ow * KW; w < wend; w++) {\n"
                      "        const int p = (int)(h - oh * KH), q = (int)(w - ow * KW);\n"
                      "        float d[V];\n"
                      "#pragma unroll\n"
                      "        for (int l = 0; l < V; l++)\n"
                      "          d[l] = p < KH && q < KW && at[l] == p * KW + q ? gv[l] : 0.f;\n",
                      sz[1] == sz[4] * w->kh ? "oh * KH + KH" : "oh == OH - 1 ? H : oh * KH + KH",
                      sz[2] == sz[5] * w->kw ? "ow * KW + KW" : "ow == OW - 1 ? W : ow * KW + KW");
      if (epi) {
        store_lanes(b, "d", out, odt, V, epi);
      } else {
        kiln__sb_printf(b, "        const ix o = ((n * H + h) * W + w) * C + c;\n");
        if (V == 4)
          kiln__sb_printf(b, "        kiln_store4(&dx[o], d);\n");
        else
          kiln__sb_printf(b, "        dx[o] = (%s)d[0];\n", ty->out);
      }
      kiln__sb_printf(b, "      }\n");
      break;
    }
    /* e over the image: the windows whose first maximum it is */
    kiln__sb_printf(b,
                    "    const %s *dy = (const %s *)a.ptr[0];\n"
                    "    const %s *x = (const %s *)a.ptr[1];\n",
                    ty->in0, ty->in0, ty->in1, ty->in1);
    emit_split(b, true);
    kiln__sb_printf(b, "    float acc[V] = {};\n");
    emit_taps_of_pixel(b);
    kiln__sb_printf(b, "        float best[V];\n"
                       "        int at[V];\n"
                       "#pragma unroll\n"
                       "        for (int l = 0; l < V; l++) at[l] = -1;\n"
                       "        for (int p = 0; p < KH; p++) {\n"
                       "          const ix hh = oh * SH - PH + p * DH;\n"
                       "          if (hh < 0 || hh >= H) continue;\n"
                       "          for (int q = 0; q < KW; q++) {\n"
                       "            const ix ww = ow * SW - PW + q * DW;\n"
                       "            if (ww < 0 || ww >= W) continue;\n");
    emit_lanes_load(b, "            ", "xv", "x", "((n * H + hh) * W + ww) * C + c", V);
    kiln__sb_printf(b, "#pragma unroll\n"
                       "            for (int l = 0; l < V; l++)\n"
                       "              if (at[l] < 0 || xv[l] > best[l] || isnan(xv[l])) {\n"
                       "                best[l] = xv[l];\n"
                       "                at[l] = p * KW + q;\n"
                       "              }\n"
                       "          }\n"
                       "        }\n");
    emit_lanes_load(b, "        ", "gv", "dy", "((n * OH + oh) * OW + ow) * C + c", V);
    kiln__sb_printf(b, "#pragma unroll\n"
                       "        for (int l = 0; l < V; l++)\n"
                       "          if (at[l] == i * KW + j) acc[l] += gv[l];\n");
    emit_taps_end(b);
    store_lanes(b, "acc", out, odt, V, epi);
    break;
  case KILN__OP_AVG_POOL:
    kiln__sb_printf(b, "    const %s *x = (const %s *)a.ptr[0];\n", ty->in0, ty->in0);
    emit_split(b, false);
    kiln__sb_printf(b, "    float acc[V] = {};\n"
                       "    int inside = 0;\n"
                       "    for (int i = 0; i < KH; i++) {\n"
                       "      const ix h = oh * SH - PH + i;\n"
                       "      if (h < 0 || h >= H) continue;\n"
                       "      for (int j = 0; j < KW; j++) {\n"
                       "        const ix w = ow * SW - PW + j;\n"
                       "        if (w < 0 || w >= W) continue;\n"
                       "        inside++;\n");
    emit_lanes_load(b, "        ", "xv", "x", "((n * H + h) * W + w) * C + c", V);
    kiln__sb_printf(b, "#pragma unroll\n"
                       "        for (int l = 0; l < V; l++) acc[l] += xv[l];\n");
    emit_taps_end(b);
    kiln__sb_printf(b,
                    "    (void)inside;\n"
                    "#pragma unroll\n"
                    "    for (int l = 0; l < V; l++) acc[l] /= (float)(%s);\n",
                    flag ? "inside" : "KH * KW");
    store_lanes(b, "acc", out, odt, V, epi);
    break;
  case KILN__OP_AVG_POOL_GRAD: /* e over the image: each window's gradient over its divisor */
    kiln__sb_printf(b, "    const %s *dy = (const %s *)a.ptr[0];\n", ty->in0, ty->in0);
    emit_split(b, true);
    kiln__sb_printf(b, "    float acc[V] = {};\n");
    emit_taps_of_pixel(b);
    if (flag)
      kiln__sb_printf(b, "        const ix h0 = oh * SH - PH, w0 = ow * SW - PW;\n"
                         "        const ix nh = (h0 + KH < H ? h0 + KH : H) - (h0 > 0 ? h0 : 0);\n"
                         "        const ix nw = (w0 + KW < W ? w0 + KW : W) - (w0 > 0 ? w0 : 0);\n"
                         "        const float div = (float)(nh * nw);\n");
    else
      kiln__sb_printf(b, "        const float div = (float)(KH * KW);\n");
    emit_lanes_load(b, "        ", "gv", "dy", "((n * OH + oh) * OW + ow) * C + c", V);
    kiln__sb_printf(b, "#pragma unroll\n"
                       "        for (int l = 0; l < V; l++) acc[l] += gv[l] / div;\n");
    emit_taps_end(b);
    store_lanes(b, "acc", out, odt, V, epi);
    break;
  default: KILN_ASSERT(!"window_body: not a window op");
  }
  kiln__sb_printf(b, "  }\n");
}

/* A window op, alone (p->n == 1) or with the elementwise nodes that follow it in its group as an
 * epilogue computed per lane (p->nodes[0] is the op). */
/* The operands of a window op's kernel: its inputs (operands 0..) and output, or with an
 * epilogue the program's wiring (whose strides and dense flags the epilogue reads). Returns the
 * output's operand, -1 when the epilogue stores. */
static int window_operands(const kiln__ew_prog *p, operands *o, wiring *wr, kiln__rendered *r) {
  const kiln__node *n = p->nodes[0];
  if (p->n == 1) {
    for (int q = 0; q < n->nin; q++)
      operand(o, n->in[q], false, NULL);
    return operand(o, n->out, true, NULL);
  }
  int nf = 0, ni = 0, nu = 0;
  wire(p, NULL, o, wr, &r->arg, &nf, &ni, &nu); /* the op's inputs are operands 0.. */
  for (int q = 0; q < n->nin; q++)
    KILN_ASSERT(wr->opnd[0][q] == q);
  for (int k = 0; k < o->n; k++) {
    align_strides(o->t[k], 4, n->out->shape, r->arg.args.st[k]);
    o->lin[k] = dense(o->t[k], kiln_tensor_numel(n->out)); /* the epilogue indexes it by i */
  }
  return -1;
}

/* col2im of the product dY Wk as one implicit GEMM (igemm.cuh): operand 0 is col2im's input
 * (the column matrix, never read), then the epilogue's operands, then dY and Wk. A block of 128
 * image pixels and BN channels, its accumulators stored through col2im's epilogue, two channels
 * at a time. */
static bool render_dgrad(const kiln__ew_prog *p, const kiln__gemm *mm, kiln__rendered *r) {
  const kiln__node *n = p->nodes[0];
  const kiln_tensor *X = n->out, *A = mm->a, *B = mm->b;
  kiln__kargs *a = &r->arg.args;
  operands o = {0};
  wiring wr;
  int out = window_operands(p, &o, &wr, r);
  int ka = operand(&o, A, false, NULL), kb = operand(&o, B, false, NULL);
  kiln__win w = kiln__win_of(n);
  int64_t N = X->shape[0], H = X->shape[1], W = X->shape[2], CI = X->shape[3];
  int64_t OH = n->in[0]->shape[1], OW = n->in[0]->shape[2], CO = A->shape[1];
  int BN = CI <= 32 ? 32 : 64;
  bool bf16 = X->dtype == KILN_DTYPE_BF16;
  const char *T = ctype(X->dtype);
  a->n = N * H * W; /* image pixels: the rows of dX */
  win_epi epi = {.p = p, .o = &o, .w = &wr, .shape = X->shape, .image = true, .vec = false};
  char pre[512];
  snprintf(
      pre, sizeof pre,
      "#include \"igemm.cuh\"\n"
      "struct G { /* the convolution's geometry */\n"
      "  static constexpr int KH = %lld, KW = %lld, SH = %lld, SW = %lld, PH = %lld, PW = %lld, "
      "DH = %lld, DW = %lld;\n"
      "  static constexpr int H = %lld, W = %lld, OH = %lld, OW = %lld, CO = %lld, CI = %lld, "
      "BN = %d;\n"
      "};\n",
      (long long)w.kh, (long long)w.kw, (long long)w.sh, (long long)w.sw, (long long)w.ph,
      (long long)w.pw, (long long)w.dh, (long long)w.dw, (long long)H, (long long)W, (long long)OH,
      (long long)OW, (long long)CO, (long long)CI, BN);
  kiln__sb b = {0};
  kiln__sb_printf(
      &b,
      "  typedef int ix;\n"
      "  const int V = 2;\n"
      "  (void)V;\n"
      "  const int M = (int)a.n, m0 = (int)blockIdx.x * KILN_IG_BM, n0 = (int)blockIdx.y "
      "* G::BN;\n"
      "  float acc[2][G::BN / 16][4];\n"
      "  kiln_dgrad<%s, G>((const %s *)a.ptr[%d], (const %s *)a.ptr[%d], M, m0, n0, "
      "acc);\n"
      "  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;\n"
      "#pragma unroll\n"
      "  for (int mi = 0; mi < 2; mi++)\n"
      "#pragma unroll\n"
      "  for (int ni = 0; ni < G::BN / 16; ni++)\n"
      "#pragma unroll\n"
      "  for (int hh = 0; hh < 2; hh++) {\n"
      "    const ix m = m0 + (warp >> 1) * 32 + mi * 16 + (lane >> 2) + 8 * hh;\n"
      "    const ix c = n0 + (warp & 1) * (G::BN / 2) + ni * 8 + 2 * (lane & 3);\n"
      "    if (m >= M || c >= G::CI) continue;\n"
      "    const ix n = m / (G::H * G::W), h = m / G::W %% G::H, w = m %% G::W;\n"
      "    (void)n; (void)h; (void)w;\n"
      "    const float d[2] = {acc[mi][ni][2 * hh], acc[mi][ni][2 * hh + 1]};\n",
      T, T, ka, T, kb);
  if (p->n > 1) {
    store_lanes(&b, "d", out, X->dtype, 2, &epi);
  } else if (bf16) {
    kiln__sb_printf(&b,
                    "    ((unsigned *)a.ptr[%d])[(m * G::CI + c) / 2] = kiln_bf16x2_bits(d[0], "
                    "d[1]);\n",
                    out);
  } else {
    kiln__sb_printf(&b,
                    "    *(float2 *)&((float *)a.ptr[%d])[m * G::CI + c] = make_float2(d[0], "
                    "d[1]);\n",
                    out);
  }
  kiln__sb_printf(&b, "  }\n");
  char stem[80], suffix[48];
  snprintf(suffix, sizeof suffix, "_%lldx%lld_s%lld_%s_igemm", (long long)w.kh, (long long)w.kw,
           (long long)w.sh, kiln_dtype_name(X->dtype));
  stem_of(p, "k_matmul", suffix, stem, sizeof stem);
  bool ok = finish_with(&b, stem, &o, r, pre);
  kiln__sb_free(&b);
  r->block = KILN__BLOCK;
  r->grid = (unsigned)((a->n + 127) / 128);
  r->grid_y = (unsigned)((CI + BN - 1) / BN);
  tally_bytes(&o, r);
  r->bytes_read -= footprint(o.t[0]); /* operand 0, the column matrix, is never read */
  return ok;
}

static bool render_window(const kiln__target *tg, const kiln__ew_prog *p, kiln__rendered *r) {
  const kiln__node *n = p->nodes[0];
  bool image_out = n->op == KILN__OP_COL2IM || n->op == KILN__OP_MAX_POOL_GRAD ||
                   n->op == KILN__OP_AVG_POOL_GRAD;
  const kiln_tensor *img = image_out ? n->out : n->in[0], *win = image_out ? n->in[0] : n->out;
  kiln__kargs *a = &r->arg.args;
  operands o = {0};
  wiring wr;
  for (int q = 0; q < n->nin; q++)
    KILN_ASSERT(kiln__is_contiguous(n->in[q]) && kiln__is_float(n->in[q]->dtype));
  win_types ty = {.in0 = ctype(n->in[0]->dtype),
                  .in1 = ctype(n->in[n->nin > 1]->dtype),
                  .out = ctype(n->out->dtype),
                  .out_dt = n->out->dtype};
  int out = window_operands(p, &o, &wr, r);
  int64_t sz[6] = {img->shape[0], img->shape[1], img->shape[2],
                   img->shape[3], win->shape[1], win->shape[2]};
  /* im2col's and col2im's channel groups, average pooling's divisor: named attributes */
  bool cols = kiln__has_attr(n->op, "groups");
  int64_t flag = cols
                     ? KILN__I_NAMED(n, "groups")
                     : (kiln__has_attr(n->op, "exclude_pad") ? KILN__I_NAMED(n, "exclude_pad") : 0);
  int64_t lanes = cols ? sz[3] / flag : sz[3]; /* channels a lane group spans */
  int V = lanes % 4 == 0 ? 4 : 1;
  bool aligned = true; /* four-lane accesses need first elements aligned to four elements */
  for (int q = 0; q < n->nin; q++)
    aligned = aligned && n->in[q]->offset % 4 == 0;
  aligned = aligned && n->out->offset % 4 == 0;
  if (!aligned) V = 1;
  int64_t most = kiln_tensor_numel(n->out); /* the largest offset, in elements */
  for (int k = 0; k < o.n; k++) {
    uint64_t elems = footprint(o.t[k]) / kiln_dtype_size(o.t[k]->dtype);
    if (elems > (uint64_t)most) most = (int64_t)elems;
  }
  bool wide = wide_index(most);
  kiln__win w = kiln__win_of(n);
  /* max pooling's gradient over windows that tile the image (no overlap, padding or dilation;
   * the pixels past the last window are zeros): a thread per window finds its maximum once */
  bool tiled = n->op == KILN__OP_MAX_POOL_GRAD && w.sh == w.kh && w.sw == w.kw && w.ph == 0 &&
               w.pw == 0 && w.dh == 1 && w.dw == 1;
  a->n = kiln_tensor_numel(tiled ? win : n->out) / V;
  win_epi epi = {.p = p, .o = &o, .w = &wr, .shape = n->out->shape, .image = image_out};
  epi.vec = p->n > 1 && V == 4 && !wr.coords;
  for (int j = 0; j < p->n && epi.vec; j++) /* what the epilogue reads, and every store */
    for (int q = -1; q < (j ? p->nodes[j]->nin : 0) && epi.vec; q++) {
      int k = q < 0 ? wr.store_slot[j] : wr.opnd[j][q];
      epi.vec = k < 0 || (o.lin[k] && o.t[k]->offset % 4 == 0 && kiln__is_float(o.t[k]->dtype));
    }
  kiln__sb b = {0};
  window_body(&b, n, &w, flag, sz, V, wide, tiled, out, &ty, p->n > 1 ? &epi : NULL);
  char stem[80], suffix[48];
  snprintf(suffix, sizeof suffix, "_%lldx%lld_s%lld_%s%s%s", (long long)w.kh, (long long)w.kw,
           (long long)w.sh, kiln_dtype_name(n->in[0]->dtype), V == 4 ? "_v4" : "",
           tiled ? "_tiled" : "");
  stem_of(p, "k", suffix, stem, sizeof stem);
  bool ok = finish(&b, stem, &o, r);
  kiln__sb_free(&b);
  r->block = KILN__BLOCK;
  r->grid = grid_for(tg, a->n);
  tally_bytes(&o, r);
  return ok;
}

/* ---------------------------------------------------------------- batch norm's sums */

/* Blocks of 32 columns x KILN__MOMENTS_ROWS rows: a warp reads 32 neighbouring columns of a row
 * (128 bytes), the block's 8 warps stride over the rows, and the 8 partial sums of a column are
 * added in a fixed order (the result is the same on every run). blockIdx.y is the block of rows:
 * partial sums (P, 2, C) that a plain sum over P finishes. */
static bool render_moments(const kiln__target *tg, const kiln__node *n, kiln__rendered *r) {
  (void)tg;
  kiln__kargs *a = &r->arg.args;
  operands o = {0};
  for (int q = 0; q < n->nin; q++) {
    KILN_ASSERT(kiln__is_contiguous(n->in[q]) && kiln__is_float(n->in[q]->dtype));
    operand(&o, n->in[q], false, NULL);
  }
  const char *t0 = ctype(n->in[0]->dtype), *t1 = ctype(n->in[1]->dtype);
  int out = operand(&o, n->out, true, NULL);
  int64_t R = n->in[0]->shape[0], C = n->in[0]->shape[1], P = n->out->shape[0];
  int64_t rows = KILN__I(n, MOMENTS, rows);
  bool centered = KILN__I(n, MOMENTS, mode) != 0;
  bool wide = wide_index(R * C);
  a->n = R;
  a->shape[0] = C;
  kiln__sb b = {0};
  kiln__sb_printf(&b,
                  "  typedef %s ix;\n"
                  "  const ix R = a.n, C = a.shape[0], ROWS = %lld;\n"
                  "  const int tx = threadIdx.x & 31, ty = threadIdx.x >> 5;\n"
                  "  const ix c = (ix)blockIdx.x * 32 + tx, r0 = (ix)blockIdx.y * ROWS;\n"
                  "  const ix r1 = r0 + ROWS < R ? r0 + ROWS : R;\n"
                  "  __shared__ float part[2][%d][32];\n"
                  "  float s0 = 0.f, s1 = 0.f;\n"
                  "  if (c < C) {\n",
                  wide ? "long long" : "int", (long long)rows, KILN__BLOCK / 32);
  if (centered)
    kiln__sb_printf(&b,
                    "    const %s *g = (const %s *)a.ptr[0];\n"
                    "    const %s *x = (const %s *)a.ptr[1];\n"
                    "    const float m = ((const float *)a.ptr[2])[c];\n"
                    "    const float is = ((const float *)a.ptr[3])[c];\n"
                    "    for (ix r = r0 + ty; r < r1; r += %d) {\n"
                    "      const float gv = g[r * C + c];\n"
                    "      s0 += gv;\n"
                    "      s1 += gv * (((float)x[r * C + c] - m) * is);\n"
                    "    }\n",
                    t0, t0, t1, t1, KILN__BLOCK / 32);
  else
    kiln__sb_printf(&b,
                    "    const %s *x = (const %s *)a.ptr[0];\n"
                    "    const float k = ((const %s *)a.ptr[1])[c];\n"
                    "    for (ix r = r0 + ty; r < r1; r += %d) {\n"
                    "      const float v = (float)x[r * C + c] - k;\n"
                    "      s0 += v;\n"
                    "      s1 += v * v;\n"
                    "    }\n",
                    t0, t0, t1, KILN__BLOCK / 32);
  kiln__sb_printf(&b,
                  "  }\n"
                  "  part[0][ty][tx] = s0;\n"
                  "  part[1][ty][tx] = s1;\n"
                  "  __syncthreads();\n"
                  "  if (ty < 2 && c < C) {\n"
                  "    float t = 0.f;\n"
                  "#pragma unroll\n"
                  "    for (int w = 0; w < %d; w++) t += part[ty][w][tx];\n"
                  "    ((float *)a.ptr[%d])[((ix)blockIdx.y * 2 + ty) * C + c] = t;\n"
                  "  }\n",
                  KILN__BLOCK / 32, out);
  char stem[48];
  snprintf(stem, sizeof stem, "k_moments_%s_%s", centered ? "grad" : "shifted",
           kiln_dtype_name(n->in[centered ? 1 : 0]->dtype));
  bool ok = finish(&b, stem, &o, r);
  kiln__sb_free(&b);
  r->block = KILN__BLOCK;
  r->grid = (unsigned)((C + 31) / 32);
  r->grid_y = (unsigned)P;
  for (int q = 0; q < n->nin; q++)
    r->bytes_read += footprint(n->in[q]);
  r->bytes_written = footprint(n->out);
  return ok;
}

/* ---------------------------------------------------------------- image augmentation */

/* kiln_augment: x (N, H, W, C) to y of its shape, one thread per V neighbouring channels of an
 * output pixel (V = 4 with 16-byte loads and stores when the channels allow it, else the whole
 * pixel up to 4 channels, else 1). Each thread of image n draws the image's Philox block
 * (seed, offset, n) itself: the same numbers for all of them, so no thread waits for another.
 * The sizes but the batch, the padding and the modes are constants; the seed, the offset and the
 * epoch are step values. Operand 0 is x, then the data-set indices (alternating flip), then y. */
static bool render_augment(const kiln__target *tg, const kiln__node *n, kiln__rendered *r) {
  const kiln_tensor *x = n->in[0], *y = n->out;
  KILN_ASSERT(kiln__is_contiguous(x) && kiln__is_float(x->dtype) && x->ndim == 4 &&
              y->dtype == x->dtype);
  const char *T = ctype(x->dtype);
  kiln__kargs *a = &r->arg.args;
  operands o = {0};
  for (int q = 0; q < n->nin; q++)
    operand(&o, n->in[q], false, NULL);
  int out = operand(&o, y, true, NULL);
  int8_t aslot[KILN__MAX_ATTRS];
  int nf = 0, ni = 0, nu = 0;
  wire_attrs(&r->arg, n, aslot, &nf, &ni, &nu);
  int seed = aslot[kiln__attr_index(n->op, "seed")],
      offset = aslot[kiln__attr_index(n->op, "offset")],
      epoch = aslot[kiln__attr_index(n->op, "epoch")];
  int64_t H = x->shape[1], W = x->shape[2], C = x->shape[3], total = kiln_tensor_numel(y);
  int64_t pad = KILN__I(n, AUGMENT, pad), flip = KILN__I(n, AUGMENT, flip);
  int64_t shift_h = KILN__I(n, AUGMENT, shift_h), shift_w = KILN__I(n, AUGMENT, shift_w);
  bool moves = pad > 0 || shift_h != 0 || shift_w != 0; /* a translation, random or fixed */
  bool reflect = KILN__I(n, AUGMENT, border) == KILN_AUGMENT_BORDER_REFLECT;
  bool alternate = flip == KILN_AUGMENT_FLIP_ALTERNATE, rnd = flip == KILN_AUGMENT_FLIP_RANDOM;
  KILN_ASSERT(n->nin == (alternate ? 2 : 1) && C >= 1);
  bool vec = C % 4 == 0 && x->offset % 4 == 0 && y->offset % 4 == 0;
  int V = vec ? 4 : (C <= 4 ? (int)C : 1);
  bool wide = wide_index(total);
  a->n = total / V;

  kiln__sb b = {0};
  kiln__sb_printf(&b,
                  "  typedef %s ix; // %s indexing\n"
                  "  const ix H = %lld, W = %lld, C = %lld;\n"
                  "  const int V = %d; // channels a thread moves\n"
                  "  const %s *x = (const %s *)a.ptr[0];\n",
                  wide ? "long long" : "int", wide ? "64-bit" : "32-bit", (long long)H,
                  (long long)W, (long long)C, V, T, T);
  if (alternate) kiln__sb_printf(&b, "  const int *idx = (const int *)a.ptr[1];\n");
  kiln__sb_printf(&b, "  %s *y = (%s *)a.ptr[%d];\n", T, T, out);
  if (pad > 0 || rnd)
    kiln__sb_printf(&b, "  const unsigned long long seed = a.uv[%d], offset = a.uv[%d];\n", seed,
                    offset);
  else if (alternate)
    kiln__sb_printf(&b, "  const unsigned long long seed = a.uv[%d];\n", seed);
  if (pad > 0) kiln__sb_printf(&b, "  const int PAD = %lld;\n", (long long)pad);
  kiln__sb_printf(&b, "  for (ix e = (ix)blockIdx.x * blockDim.x + threadIdx.x; e < (ix)a.n;\n"
                      "       e += (ix)gridDim.x * blockDim.x) {\n"
                      "    ix m = e;\n"
                      "    const ix c = (m %% (C / V)) * V; m /= C / V;\n"
                      "    const ix w = m %% W; m /= W;\n"
                      "    const ix h = m %% H, n = m / H;\n");
  if (pad > 0 || rnd)
    kiln__sb_printf(&b, "    // image n's draws, the same in each of its threads\n"
                        "    unsigned int r[4];\n"
                        "    kiln_philox4(seed, offset, (unsigned long long)n, r);\n");
  if (pad > 0)
    kiln__sb_printf(&b, "    const int dy = (int)kiln_philox_below(r[0], 2 * PAD + 1) - PAD;\n"
                        "    const int dx = (int)kiln_philox_below(r[1], 2 * PAD + 1) - PAD;\n");
  else if (moves)
    kiln__sb_printf(&b, "    const int dy = %lld, dx = %lld; // a fixed translation\n",
                    (long long)shift_h, (long long)shift_w);
  if (rnd)
    kiln__sb_printf(&b, "    const bool flip = (r[2] >> 31) != 0u; // half the images\n");
  else if (flip == KILN_AUGMENT_FLIP_ALL)
    kiln__sb_printf(&b, "    const bool flip = true; // every image\n");
  else if (alternate)
    kiln__sb_printf(&b,
                    "    // a fixed bit of the image's data-set index, complemented on odd epochs\n"
                    "    const unsigned int bit =\n"
                    "        kiln_philox(seed, KILN_PHILOX_FLIP_OFFSET, (unsigned int)idx[n]) "
                    ">> 31;\n"
                    "    const bool flip = (bit ^ (unsigned int)(a.uv[%d] & 1ull)) != 0u;\n",
                    epoch);
  bool zero_fill = moves && !reflect;
  if (moves) {
    kiln__sb_printf(&b,
                    "    // the source: pixel (h + dy, w + dx) of the image, flipped or not, "
                    "%s outside it\n"
                    "    ix sh = h + dy, sw = w + dx;\n",
                    reflect ? "reflected" : "0");
    if (reflect)
      kiln__sb_printf(&b, "    sh = sh < 0 ? -sh : (sh >= H ? 2 * (H - 1) - sh : sh);\n"
                          "    sw = sw < 0 ? -sw : (sw >= W ? 2 * (W - 1) - sw : sw);\n");
    else
      kiln__sb_printf(&b, "    const bool inside = sh >= 0 && sh < H && sw >= 0 && sw < W;\n");
  } else {
    kiln__sb_printf(&b, "    const ix sh = h;\n    %six sw = w;\n",
                    flip != KILN_AUGMENT_FLIP_NONE ? "" : "const ");
  }
  if (flip != KILN_AUGMENT_FLIP_NONE) kiln__sb_printf(&b, "    if (flip) sw = W - 1 - sw;\n");
  kiln__sb_printf(&b, "    const ix src = ((n * H + sh) * W + sw) * C + c;\n");
  char zero[32];
  snprintf(zero, sizeof zero, " : (%s)0.f", T);
  if (vec)
    kiln__sb_printf(&b,
                    "    float v[4] = {0.f, 0.f, 0.f, 0.f};\n"
                    "    %skiln_load4(&x[src], v);\n"
                    "    kiln_store4(&y[e * 4], v);\n",
                    zero_fill ? "if (inside) " : "");
  else
    kiln__sb_printf(&b,
                    "#pragma unroll\n"
                    "    for (int l = 0; l < V; l++) y[e * V + l] = %sx[src + l]%s;\n",
                    zero_fill ? "inside ? " : "", zero_fill ? zero : "");
  kiln__sb_printf(&b, "  }\n");
  static const char *const flips[] = {"", "_flip", "_flip_all", "_flip_alt"};
  KILN_ASSERT(flip >= 0 && flip < 4);
  char stem[128];
  char shift[64] = "";
  if (pad == 0 && moves)
    snprintf(shift, sizeof shift, "_shift%s%lld_%s%lld", shift_h < 0 ? "m" : "",
             (long long)llabs(shift_h), shift_w < 0 ? "m" : "", (long long)llabs(shift_w));
  snprintf(stem, sizeof stem, "k_augment_p%lld%s%s%s_%s%s", (long long)pad, shift,
           moves ? (reflect ? "_reflect" : "_zero") : "", flips[flip], kiln_dtype_name(x->dtype),
           vec ? "_v4" : "");
  bool ok = finish(&b, stem, &o, r);
  kiln__sb_free(&b);
  r->block = KILN__BLOCK;
  r->grid = grid_for(tg, a->n);
  tally_bytes(&o, r);
  return ok;
}

/* ---------------------------------------------------------------- row programs */

/* The offset of a once-per-row operand k: its strides over the row's outer coordinates. */
static void row_offset(kiln__sb *b, int k, int nouter) {
  if (nouter == 0) kiln__sb_printf(b, "0");
  for (int d = 0; d < nouter; d++)
    kiln__sb_printf(b, "%sc%d * a.st[%d][%d]", d ? " + " : "", d, k, d);
}

/* Loads of the operands that the nodes marked in use[] read, once per element or per row. */
static void emit_loads(kiln__sb *b, const kiln__ew_prog *p, const bool *use, const operands *o,
                       const wiring *w, bool *loaded, const char *ind, int nd, bool per_row) {
  for (int j = 0; j < p->n; j++) {
    if (!use[j]) continue;
    for (int q = 0; q < p->nodes[j]->nin; q++) {
      int k = w->opnd[j][q];
      if (k < 0 || loaded[k]) continue;
      loaded[k] = true;
      kiln__sb_printf(b, "%sconst %s x%d = ((const %s *)a.ptr[%d])[", ind, rtype(o->t[k]->dtype), k,
                      ctype(o->t[k]->dtype), k);
      if (per_row)
        row_offset(b, k, nd - 1);
      else
        offset_expr(b, k, nd, false, 0);
      kiln__sb_printf(b, "];\n");
    }
  }
}

/* Node j's value (an op-table expression), and its store when it is written. */
static void emit_value(kiln__sb *b, const kiln__ew_prog *p, const wiring *w, int j, const char *ind,
                       int nd, bool store, bool per_row) {
  const kiln__node *n = p->nodes[j];
  emit_node_value(b, ind, w, j, n);
  int k = w->store_slot[j];
  if (!store || k < 0) return;
  const char *ot = ctype(n->out->dtype);
  kiln__sb_printf(b, "%s((%s *)a.ptr[%d])[", ind, ot, k);
  if (per_row)
    row_offset(b, k, nd - 1);
  else
    offset_expr(b, k, nd, false, 0);
  kiln__sb_printf(b, "] = (%s)v%d;\n", ot, j);
}

/* The scale slot of row-program node j, a reduction. */
static int scale_slot(const wiring *w, int j, const kiln__node *n) {
  return w->aslot[j][kiln__attr_index(n->op, "scale")];
}

static bool render_rows(const kiln__target *t, const kiln__ew_prog *p, const kiln_tensor *F,
                        kiln__rendered *r) {
  int nd = F->ndim;
  enum { FULL, ROW, RED } cls[KILN__MAX_GROUP];
  bool row[KILN__MAX_GROUP];
  int last_red = -1;
  bool final_pass = false; /* some per-element value is written or computed after the last sum */
  for (int j = 0; j < p->n; j++) {
    const kiln__node *n = p->nodes[j];
    bool full = kiln__same_shape(n->out, F);
    cls[j] = kiln__ops[n->op].kind == KILN__KIND_REDUCE ? RED : (full ? FULL : ROW);
    row[j] = cls[j] == ROW;
    if (cls[j] == RED) last_red = j;
  }
  KILN_ASSERT(last_red >= 0);
  for (int j = 0; j < p->n; j++)
    if (cls[j] == FULL && (j > last_red || p->store[j])) final_pass = true;
  kiln__kargs *a = &r->arg.args;
  operands o = {0};
  wiring w;
  int nf = 0, ni = 0, nu = 0;
  wire(p, row, &o, &w, &r->arg, &nf, &ni, &nu);
  a->n = 1;
  for (int d = 0; d + 1 < nd; d++) {
    a->shape[d] = F->shape[d];
    a->n *= F->shape[d];
  }
  a->nred = F->shape[nd - 1];
  for (int k = 0; k < o.n; k++) {
    const kiln_tensor *x = o.t[k];
    if (o.row[k])
      align_strides(x, o.row[k]->ndim, o.row[k]->shape, a->st[k]);
    else
      align_strides(x, nd, F->shape, a->st[k]);
    if (o.store[k])
      r->bytes_written += footprint(x);
    else
      r->bytes_read += footprint(x);
  }

  kiln__sb b = {0};
  kiln__sb_printf(&b, "  typedef long long ix;\n  __shared__ float sv[32];\n"
                      "  for (ix o = blockIdx.x; o < a.n; o += gridDim.x) {\n    ix r = o;\n");
  for (int d = nd - 2; d >= 0; d--)
    kiln__sb_printf(&b, "    const ix c%d = r %% a.shape[%d]; r /= a.shape[%d];\n", d, d, d);
  bool row_loaded[KILN__KMAX_PTR] = {0};
  for (int j = 0; j < p->n; j++) {
    if (cls[j] == ROW) {
      bool use[KILN__MAX_GROUP] = {0};
      use[j] = true;
      emit_loads(&b, p, use, &o, &w, row_loaded, "    ", nd, true);
      emit_value(&b, p, &w, j, "    ", nd, false, true);
      continue;
    }
    if (cls[j] != RED) continue;
    /* a pass over the row: every per-element value before this reduction, recomputed */
    bool isum = p->nodes[j]->op == KILN__OP_SUM;
    bool use[KILN__MAX_GROUP] = {0}, loaded[KILN__KMAX_PTR] = {0};
    for (int m = 0; m < j; m++)
      use[m] = cls[m] == FULL;
    use[j] = true; /* its own input may come from memory */
    kiln__sb_printf(&b,
                    "    float acc%d = %s;\n"
                    "    for (ix q = threadIdx.x; q < a.nred; q += blockDim.x) {\n"
                    "      const ix c%d = q;\n",
                    j, isum ? "0.f" : "-__int_as_float(0x7f800000)", nd - 1);
    emit_loads(&b, p, use, &o, &w, loaded, "      ", nd, false);
    for (int m = 0; m < j; m++)
      if (cls[m] == FULL) emit_value(&b, p, &w, m, "      ", nd, false, false);
    char in0[16];
    in_name(&w, j, 0, in0, sizeof in0);
    if (isum)
      kiln__sb_printf(&b, "      acc%d += %s;\n    }\n", j, in0);
    else
      kiln__sb_printf(&b, "      acc%d = kiln_maximum(acc%d, %s);\n    }\n", j, j, in0);
    bool bf16 = p->nodes[j]->out->dtype == KILN_DTYPE_BF16;
    kiln__sb_printf(&b, "    const float v%d = %s(kiln_block_%s(acc%d, sv) * a.fv[%d]); // %s\n", j,
                    bf16 ? "(float)(kiln_bf16)" : "", isum ? "sum" : "max", j,
                    scale_slot(&w, j, p->nodes[j]), kiln__ops[p->nodes[j]->op].name);
  }
  if (final_pass) {
    bool use[KILN__MAX_GROUP] = {0}, loaded[KILN__KMAX_PTR] = {0};
    for (int m = 0; m < p->n; m++)
      use[m] = cls[m] == FULL;
    kiln__sb_printf(&b,
                    "    for (ix q = threadIdx.x; q < a.nred; q += blockDim.x) {\n"
                    "      const ix c%d = q;\n",
                    nd - 1);
    emit_loads(&b, p, use, &o, &w, loaded, "      ", nd, false);
    for (int m = 0; m < p->n; m++)
      if (cls[m] == FULL) emit_value(&b, p, &w, m, "      ", nd, p->store[m], false);
    kiln__sb_printf(&b, "    }\n");
  }
  kiln__sb_printf(&b, "    if (threadIdx.x == 0) {\n");
  for (int j = 0; j < p->n; j++) {
    int k = w.store_slot[j];
    if (cls[j] == FULL || k < 0) continue;
    const char *ot = ctype(p->nodes[j]->out->dtype);
    kiln__sb_printf(&b, "      ((%s *)a.ptr[%d])[", ot, k);
    row_offset(&b, k, nd - 1);
    kiln__sb_printf(&b, "] = (%s)v%d;\n", ot, j);
  }
  kiln__sb_printf(&b, "    }\n  }\n");
  char stem[80];
  char suffix[24];
  snprintf(suffix, sizeof suffix, "_%s_rows", kiln_dtype_name(F->dtype));
  stem_of(p, "k", suffix, stem, sizeof stem);
  bool ok = finish(&b, stem, &o, r);
  kiln__sb_free(&b);
  row_launch(t, r);
  return ok;
}

/* ---------------------------------------------------------------- entry */

bool kiln__render(const kiln__target *t, const kiln__spec *s, kiln__rendered *r) {
  memset(r, 0, sizeof *r);
  switch (s->kind) {
  case KILN__SPEC_EW: return render_ew(t, &s->prog, r);
  case KILN__SPEC_REDUCE: return render_reduce(t, &s->prog, s->red, r);
  case KILN__SPEC_ROWS: return render_rows(t, &s->prog, s->full, r);
  case KILN__SPEC_UPDATES: return render_updates(t, s->ups, s->nups, r);
  case KILN__SPEC_GATHER: return render_gather(t, s->red, r);
  case KILN__SPEC_WINDOW: return render_window(t, &s->prog, r);
  case KILN__SPEC_CONV: return render_dgrad(&s->prog, &s->gemm, r);
  case KILN__SPEC_MOMENTS: return render_moments(t, s->red, r);
  case KILN__SPEC_AUGMENT: return render_augment(t, s->red, r);
  case KILN__SPEC_BLAS: break;
  }
  KILN_ASSERT(!"nothing to render for a BLAS call");
  return false;
}
