/*
 * emit.c: what the renderer's kernel families share (render.h): operands, the wiring of
 * elementwise programs, op expressions and element loops, kernel names and sources, launch
 * shapes.
 */
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "render.h"

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
const char *kiln__ctype(kiln_dtype dt) {
  return dt == KILN_DTYPE_I32 ? "int" : (dt == KILN_DTYPE_BF16 ? "kiln_bf16" : "float");
}
const char *kiln__rtype(kiln_dtype dt) { return dt == KILN_DTYPE_I32 ? "int" : "float"; }

/* Strides of t over an iteration space of nd dims, broadcasting from the right (0 where t is
 * stretched). */
void kiln__align_strides(const kiln_tensor *t, int nd, const int64_t *shape, long long *st) {
  for (int d = 0; d < nd; d++) {
    int j = d - (nd - t->ndim);
    st[d] = (j < 0 || (t->shape[j] == 1 && shape[d] != 1)) ? 0 : t->stride[j];
  }
}

bool kiln__dense(const kiln_tensor *t, int64_t n) {
  return kiln__is_contiguous(t) && kiln_tensor_numel(t) == n;
}

/* Bytes of t a kernel touches: each element once, broadcast dims counted once. */
uint64_t kiln__footprint(const kiln_tensor *t) {
  uint64_t n = kiln_dtype_size(t->dtype);
  for (int d = 0; d < t->ndim; d++)
    if (t->stride[d] != 0) n *= (uint64_t)t->shape[d];
  return n;
}

/* Adds the bytes each operand is read or written with to r's traffic. */
void kiln__tally_bytes(const kiln__operands *o, kiln__rendered *r) {
  for (int k = 0; k < o->n; k++) {
    if (o->store[k])
      r->bytes_written += kiln__footprint(o->t[k]);
    else
      r->bytes_read += kiln__footprint(o->t[k]);
  }
}

int kiln__operand(kiln__operands *o, const kiln_tensor *t, bool store, const kiln_tensor *row) {
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
void kiln__wire_attrs(kiln__argplan *ap, const kiln__node *n, int8_t *aslot, int *nf, int *ni,
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
void kiln__wire(const kiln__ew_prog *p, const bool *row, kiln__operands *o, kiln__wiring *w,
                kiln__argplan *ap, int *nf, int *ni, int *nu) {
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
      w->opnd[j][q] = m >= 0 ? -1 : kiln__operand(o, nd->in[q], false, in_row);
      KILN_ASSERT(!update || w->opnd[j][q] == q);
    }
    kiln__wire_attrs(ap, nd, w->aslot[j], nf, ni, nu);
    if (strstr(info->expr, "$c")) w->coords = true;
    w->store_slot[j] = !update && p->store[j] ? kiln__operand(o, nd->out, true, out_row) : -1;
  }
}

/* The name of node j's input q in the kernel: a value (v3) or an operand (x1). */
void kiln__in_name(const kiln__wiring *w, int j, int q, char *buf, size_t n) {
  if (w->val[j][q] >= 0)
    snprintf(buf, n, "v%d", w->val[j][q]);
  else
    snprintf(buf, n, "x%d", w->opnd[j][q]);
}

/* Writes an op-table expression with node j's names and attribute slots. */
void kiln__expand(kiln__sb *b, const char *tpl, const kiln__wiring *w, int j,
                  const kiln__node *nd) {
  for (const char *p = tpl; *p; p++) {
    if (*p != '$') {
      kiln__sb_put(b, p, 1);
      continue;
    }
    kiln__token t = kiln__expr_token(nd->op, p + 1);
    char name[16];
    switch (t.kind) {
    case KILN__TOK_INPUT:
      kiln__in_name(w, j, t.input, name, sizeof name);
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
void kiln__emit_node_value(kiln__sb *b, const char *ind, const kiln__wiring *w, int j,
                           const kiln__node *nd) {
  bool bf16 = nd->out && nd->out->dtype == KILN_DTYPE_BF16;
  kiln__sb_printf(b, "%sconst %s v%d = %s", ind, bf16 ? "float" : "auto", j,
                  bf16 ? "(float)(kiln_bf16)(" : "");
  kiln__expand(b, kiln__ops[nd->op].expr, w, j, nd);
  kiln__sb_printf(b, "%s; // %s\n", bf16 ? ")" : "", kiln__ops[nd->op].name);
}

void kiln__offset_expr(kiln__sb *b, int k, int nd, bool lin, char tail) {
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
void kiln__emit_element(kiln__sb *b, const kiln__ew_prog *p, const kiln__operands *o,
                        const kiln__wiring *w, const char *ind, int nd, bool vec) {
  bool update = p->n == 1 && kiln__ops[p->nodes[0]->op].kind == KILN__KIND_UPDATE;
  for (int k = 0; k < o->n; k++) {
    if (o->store[k]) continue;
    const char *ct = kiln__ctype(o->t[k]->dtype);
    kiln__sb_printf(b, "%s%s%s x%d = ", ind, update ? "" : "const ", kiln__rtype(o->t[k]->dtype),
                    k);
    if (vec) {
      kiln__sb_printf(b, "L%d[e];\n", k);
    } else {
      kiln__sb_printf(b, "((const %s *)a.ptr[%d])[", ct, k);
      kiln__offset_expr(b, k, nd, o->lin[k], o->tail[k]);
      kiln__sb_printf(b, "];\n");
    }
  }
  for (int j = 0; j < p->n; j++) {
    const kiln__node *n = p->nodes[j];
    const kiln__op_info *info = &kiln__ops[n->op];
    if (info->kind == KILN__KIND_UPDATE) {
      kiln__sb_printf(b, "%s", ind);
      kiln__expand(b, info->expr, w, j, n);
      kiln__sb_printf(b, "\n");
      for (int q = 0; q < n->nin; q++) {
        if (!(info->stores & (1u << q))) continue;
        int k = w->opnd[j][q]; /* updates read only operands */
        if (vec)
          kiln__sb_printf(b, "%sL%d[e] = x%d;\n", ind, k, k);
        else {
          const char *ct = kiln__ctype(o->t[k]->dtype);
          kiln__sb_printf(b, "%s((%s *)a.ptr[%d])[", ind, ct, k);
          kiln__offset_expr(b, k, nd, o->lin[k], o->tail[k]);
          kiln__sb_printf(b, "] = (%s)x%d;\n", ct, k);
        }
      }
      continue;
    }
    kiln__emit_node_value(b, ind, w, j, n);
    int k = w->store_slot[j];
    if (k < 0) continue;
    const char *ot = kiln__ctype(n->out->dtype);
    if (vec) {
      kiln__sb_printf(b, "%sS%d[e] = (float)v%d;\n", ind, k, j);
    } else {
      kiln__sb_printf(b, "%s((%s *)a.ptr[%d])[", ind, ot, k);
      kiln__offset_expr(b, k, nd, o->lin[k], o->tail[k]);
      kiln__sb_printf(b, "] = (%s)v%d;\n", ot, j);
    }
  }
}

void kiln__emit_coords(kiln__sb *b, const char *ind, int nd, const char *idx) {
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
void kiln__stem_of(const kiln__ew_prog *p, const char *prefix, const char *suffix, char *stem,
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

/* The first statement of a kernel launched as a programmatic dependent (r->pdl), else "". */
const char *kiln__pdl_line(const kiln__rendered *r) {
  return r->pdl ? "  kiln_pdl_begin();\n" : "";
}

/* Names the kernel after its stem, the text pre and its body, and wraps the body into the kernel's
 * source, after the prelude and pre (declarations at file scope; NULL: none), the body after
 * kiln__pdl_line. Its launch bounds are KILN__BLOCK threads, or r->block set beforehand above
 * that (one block an SM). */
bool kiln__finish_with(kiln__sb *body, const char *stem, const kiln__operands *o, kiln__rendered *r,
                       const char *pre) {
  if (body->oom) return false;
  const char *first = kiln__pdl_line(r);
  uint64_t h = kiln__hash(body->s, body->n, pre ? kiln__hash(pre, strlen(pre), 0) : 0);
  h = kiln__hash(first, strlen(first), h);
  snprintf(r->name, sizeof r->name, "%s_%08" PRIx64, stem, h & 0xffffffffu);
  char least[16] = ""; /* blocks an SM the registers must leave room for */
  if (r->block > KILN__BLOCK || r->min_blocks > 0)
    snprintf(least, sizeof least, ", %u", r->min_blocks > 0 ? r->min_blocks : 1u);
  kiln__sb_printf(&r->src,
                  "#include \"prelude.cuh\"\n%s"
                  "extern \"C\" __global__ void __launch_bounds__(%d%s) %s(const kiln__kargs a) {\n"
                  "%s%s}\n",
                  pre ? pre : "", r->block > KILN__BLOCK ? r->block : KILN__BLOCK, least, r->name,
                  first, body->s);
  if (o) {
    r->arg.nptr = o->n;
    for (int k = 0; k < o->n; k++)
      r->arg.ptr[k] = o->t[k];
  }
  return !r->src.oom;
}

bool kiln__finish(kiln__sb *body, const char *stem, const kiln__operands *o, kiln__rendered *r) {
  return kiln__finish_with(body, stem, o, r, NULL);
}

bool kiln__finish_loop(kiln__sb *body, kiln__sb *pre, const char *stem, const kiln__operands *o,
                       const kiln__target *t, kiln__rendered *r) {
  bool ok = !pre->oom && kiln__finish_with(body, stem, o, r, pre->s);
  kiln__sb_free(pre);
  kiln__sb_free(body);
  r->block = KILN__BLOCK;
  r->grid = kiln__grid_for(t, r->arg.args.n);
  kiln__tally_bytes(o, r);
  return ok;
}

/* Blocks for a grid-stride loop over threads: at most this many per SM (enough resident
 * blocks to hide latency; the loop covers the rest). */
#define KILN__BLOCKS_PER_SM 8

unsigned kiln__grid_for(const kiln__target *t, int64_t threads) {
  int64_t blocks = (threads + KILN__BLOCK - 1) / KILN__BLOCK,
          cap = (int64_t)t->num_sms * KILN__BLOCKS_PER_SM;
  return (unsigned)(blocks < 1 ? 1 : (blocks > cap ? cap : blocks));
}

/* ---------------------------------------------------------------- elementwise */

/* Room below 2^31 for a grid-stride index to step past the last element without overflowing. */
#define KILN__INDEX_MARGIN 1024

/* Whether a kernel whose offsets and indices reach span needs 64-bit indices. */
bool kiln__wide_index(int64_t span) { return span >= ((int64_t)1 << 31) - KILN__INDEX_MARGIN; }

void kiln__emit_index_type(kiln__sb *b, bool wide) {
  kiln__sb_printf(b, "  typedef %s ix; // %s indexing\n", wide ? "long long" : "int",
                  wide ? "64-bit" : "32-bit");
}
