/*
 * render_reduce.c: the reduction family: a reduction with its elementwise prologue, a row program
 * (reductions over the last axis and the per-row and per-element nodes that join them, one block
 * a row), and batch norm's column sums by blocks of rows (the moments op).
 */
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "render.h"

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

/* A reduction's iteration: the outer (kept) and reduced axes of its input, in order; the
 * accumulator's type; one block per output (rows) or one thread (cols); 64-bit indices. */
typedef struct red_form {
  int outer[KILN_MAX_DIMS], red[KILN_MAX_DIMS], no, nr;
  bool rows, wide, argmax, isum, exact;
  const char *acct;
} red_form;

/* Splits the input's axes into kept and reduced ones (the argument's shape and rshape), sets
 * every operand's strides, and picks the strategy. */
static red_form red_layout(const kiln__target *t, const kiln__node *rn, bool prologue, int out,
                           kiln__operands *o, kiln__kargs *a) {
  const kiln_tensor *x = rn->in[0];
  unsigned mask = (unsigned)KILN__RI(rn, mask);
  int nd = x->ndim;
  red_form f = {.argmax = rn->op == KILN__OP_ARGMAX, .isum = rn->op == KILN__OP_SUM};
  a->n = 1;
  a->nred = 1;
  for (int d = 0; d < nd; d++) {
    if (mask & (1u << d)) {
      a->rshape[f.nr] = x->shape[d];
      f.red[f.nr++] = d;
      a->nred *= x->shape[d];
    } else {
      a->shape[f.no] = x->shape[d];
      f.outer[f.no++] = d;
      a->n *= x->shape[d];
    }
  }
  int64_t span = a->n * a->nred; /* the largest offset or index, for the index type */
  for (int k = 0; k < o->n; k++) {
    if (k != out) kiln__align_strides(o->t[k], nd, x->shape, a->st[k]);
    o->lin[k] = false;
    int64_t reach = 0;
    for (int d = 0; d < nd && k != out; d++)
      reach += (x->shape[d] - 1) * llabs(a->st[k][d]);
    if (reach > span) span = reach;
  }
  f.wide = kiln__wide_index(span);
  f.exact = f.isum && rn->out->dtype == KILN_DTYPE_I32; /* i32 values, summed in 64 bits */
  f.acct = f.exact ? "long long" : "float";
  bool inner = f.nr > 0 && f.red[f.nr - 1] == nd - 1 && (prologue || x->stride[nd - 1] == 1);
  /* a block per output when the reduced axis is innermost (coalesced), or when there are too few
   * outputs for a thread per output to fill the device */
  f.rows = f.nr > 0 && (inner || a->n < (int64_t)t->num_sms * KILN__FEW_OUTPUTS_PER_SM);
  return f;
}

/* The loops over the outputs and their reduced elements, down to each element's coordinates. */
static void emit_red_loops(kiln__sb *b, const red_form *f) {
  const char *init = f->exact ? "0" : (f->isum ? "0.f" : "-__int_as_float(0x7f800000)");
  kiln__emit_index_type(b, f->wide);
  if (f->rows) {
    /* a block reduction's partials: one per warp, at most 32 warps (reduce.cuh) */
    kiln__sb_printf(b, "  __shared__ %s sv[32];\n", f->acct);
    if (f->argmax) kiln__sb_printf(b, "  __shared__ long long si[32];\n");
    kiln__sb_printf(b, "  for (ix o = blockIdx.x; o < a.n; o += gridDim.x) {\n");
  } else {
    kiln__sb_printf(b, "  for (ix o = (ix)blockIdx.x * blockDim.x + threadIdx.x; o < a.n;\n"
                       "       o += (ix)gridDim.x * blockDim.x) {\n");
  }
  /* the coordinates: the first of each kind needs no division (o < a.n, j < a.nred) */
  kiln__sb_printf(b, "    ix r = o;\n");
  for (int k = f->no - 1; k > 0; k--)
    kiln__sb_printf(b, "    const ix c%d = r %% (ix)a.shape[%d]; r /= (ix)a.shape[%d];\n",
                    f->outer[k], k, k);
  if (f->no > 0) kiln__sb_printf(b, "    const ix c%d = r;\n", f->outer[0]);
  kiln__sb_printf(b, "    %s acc = %s;\n", f->acct, init);
  if (f->argmax) kiln__sb_printf(b, "    long long ai = 0x7fffffffffffffffll;\n");
  if (f->rows)
    kiln__sb_printf(b, "    for (ix j = threadIdx.x; j < a.nred; j += blockDim.x) {\n");
  else
    kiln__sb_printf(b, "    for (ix j = 0; j < a.nred; j++) {\n");
  kiln__sb_printf(b, "      ix q = j;\n");
  for (int k = f->nr - 1; k > 0; k--)
    kiln__sb_printf(b, "      const ix c%d = q %% (ix)a.rshape[%d]; q /= (ix)a.rshape[%d];\n",
                    f->red[k], k, k);
  if (f->nr > 0) kiln__sb_printf(b, "      const ix c%d = q;\n", f->red[0]);
}

/* The output's store after the loops (a block's threads combined first). */
static void emit_red_store(kiln__sb *b, const red_form *f, const kiln__node *rn, int out,
                           int scale) {
  char store[128];
  if (f->argmax)
    snprintf(store, sizeof store, "((int *)a.ptr[%d])[o] = (int)ai;", out);
  else if (f->exact)
    snprintf(store, sizeof store, "((int *)a.ptr[%d])[o] = kiln_i32_total(acc, a.err);", out);
  else
    snprintf(store, sizeof store, "((%s *)a.ptr[%d])[o] = (%s)(acc * a.fv[%d]);",
             kiln__ctype(rn->out->dtype), out, kiln__ctype(rn->out->dtype), scale);
  if (f->rows) {
    if (f->argmax)
      kiln__sb_printf(b, "    kiln_block_argmax(acc, ai, sv, si);\n");
    else
      kiln__sb_printf(b, "    acc = kiln_block_%s(acc, sv);\n", f->isum ? "sum" : "max");
    kiln__sb_printf(b, "    if (threadIdx.x == 0) %s\n", store);
  } else {
    kiln__sb_printf(b, "    %s\n", store);
  }
  kiln__sb_printf(b, "  }\n");
}

/* A reduction, its input computed by an elementwise prologue or read from memory. Strategy
 * "rows": one block per output, threads stride over the reduced elements (for reductions along
 * the innermost dim), combined by reduce.cuh's block reductions. Strategy "cols": one thread per
 * output, looping over the reduced elements (neighbouring threads read neighbouring columns). */
bool kiln__render_reduce(const kiln__target *t, const kiln__ew_prog *pro, const kiln__node *rn,
                         kiln__rendered *r) {
  const kiln_tensor *x = rn->in[0];
  int nd = x->ndim;
  kiln__operands o = {0};
  kiln__wiring w;
  int nf = 0, ni = 0, nu = 0, value = -1; /* the prologue node whose value is reduced */
  if (pro->n > 0) {
    kiln__wire(pro, NULL, &o, &w, &r->arg, &nf, &ni, &nu);
    for (int j = 0; j < pro->n; j++)
      if (pro->nodes[j]->out == x) value = j;
    KILN_ASSERT(value >= 0);
  } else {
    kiln__operand(&o, x, false, NULL);
  }
  int8_t rslot[KILN__MAX_ATTRS];
  kiln__wire_attrs(&r->arg, rn, rslot, &nf, &ni, &nu); /* the scale, after the prologue's */
  int scale = rslot[kiln__attr_index(rn->op, "scale")];
  int out = kiln__operand(&o, rn->out, true, NULL);
  red_form f = red_layout(t, rn, value >= 0, out, &o, &r->arg.args);
  kiln__tally_bytes(&o, r);
  kiln__sb b = {0};
  emit_red_loops(&b, &f);
  if (value >= 0) {
    kiln__emit_element(&b, pro, &o, &w, "      ", nd, false);
    kiln__sb_printf(&b, "      const %s v = v%d;\n", f.acct, value);
  } else {
    kiln__sb_printf(&b, "      const %s v = ((const %s *)a.ptr[0])[", f.acct,
                    kiln__ctype(x->dtype));
    kiln__offset_expr(&b, 0, nd, false, 0);
    kiln__sb_printf(&b, "];\n");
  }
  if (f.argmax)
    kiln__sb_printf(&b, "      kiln_argmax_step(acc, ai, v, j);\n");
  else if (f.isum)
    kiln__sb_printf(&b, "      acc += v;\n");
  else
    kiln__sb_printf(&b, "      acc = kiln_maximum(acc, v);\n");
  kiln__sb_printf(&b, "    }\n");
  emit_red_store(&b, &f, rn, out, scale);
  char stem[80], suffix[40];
  snprintf(suffix, sizeof suffix, "_%s_%s_%dd_%dr_%s", kiln__ops[rn->op].name,
           kiln_dtype_name(f.argmax ? x->dtype : rn->out->dtype), f.no, f.nr,
           f.rows ? "rows" : "cols");
  if (value >= 0)
    kiln__stem_of(pro, "k", suffix, stem, sizeof stem);
  else
    snprintf(stem, sizeof stem, "k%s", suffix);
  bool ok = kiln__finish(&b, stem, &o, r);
  kiln__sb_free(&b);
  if (f.rows) {
    row_launch(t, r);
  } else {
    r->block = KILN__BLOCK;
    r->grid = kiln__grid_for(t, r->arg.args.n);
  }
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
static void emit_loads(kiln__sb *b, const kiln__ew_prog *p, const bool *use,
                       const kiln__operands *o, const kiln__wiring *w, bool *loaded,
                       const char *ind, int nd, bool per_row) {
  for (int j = 0; j < p->n; j++) {
    if (!use[j]) continue;
    for (int q = 0; q < p->nodes[j]->nin; q++) {
      int k = w->opnd[j][q];
      if (k < 0 || loaded[k]) continue;
      loaded[k] = true;
      kiln__sb_printf(b, "%sconst %s x%d = ((const %s *)a.ptr[%d])[", ind,
                      kiln__rtype(o->t[k]->dtype), k, kiln__ctype(o->t[k]->dtype), k);
      if (per_row)
        row_offset(b, k, nd - 1);
      else
        kiln__offset_expr(b, k, nd, false, 0);
      kiln__sb_printf(b, "];\n");
    }
  }
}

/* Node j's value (an op-table expression), and its store when it is written. */
static void emit_value(kiln__sb *b, const kiln__ew_prog *p, const kiln__wiring *w, int j,
                       const char *ind, int nd, bool store, bool per_row) {
  const kiln__node *n = p->nodes[j];
  kiln__emit_node_value(b, ind, w, j, n);
  int k = w->store_slot[j];
  if (!store || k < 0) return;
  const char *ot = kiln__ctype(n->out->dtype);
  kiln__sb_printf(b, "%s((%s *)a.ptr[%d])[", ind, ot, k);
  if (per_row)
    row_offset(b, k, nd - 1);
  else
    kiln__offset_expr(b, k, nd, false, 0);
  kiln__sb_printf(b, "] = (%s)v%d;\n", ot, j);
}

/* The scale slot of row-program node j, a reduction. */
static int scale_slot(const kiln__wiring *w, int j, const kiln__node *n) {
  return w->aslot[j][kiln__attr_index(n->op, "scale")];
}

/* What each node of a row program computes: a value per element of the row (FULL), one per row
 * (ROW), or a reduction over the row (RED). */
typedef enum row_class { FULL, ROW, RED } row_class;

/* Classifies p's nodes over F (row[j]: node j is per row); returns whether a last pass over the
 * row is needed: some per-element value is written, or computed after the last reduction. */
static bool classify(const kiln__ew_prog *p, const kiln_tensor *F, row_class *cls, bool *row) {
  int last_red = -1;
  for (int j = 0; j < p->n; j++) {
    const kiln__node *n = p->nodes[j];
    bool full = kiln__same_shape(n->out, F);
    cls[j] = kiln__ops[n->op].kind == KILN__KIND_REDUCE ? RED : (full ? FULL : ROW);
    row[j] = cls[j] == ROW;
    if (cls[j] == RED) last_red = j;
  }
  KILN_ASSERT(last_red >= 0);
  bool final_pass = false;
  for (int j = 0; j < p->n; j++)
    if (cls[j] == FULL && (j > last_red || p->store[j])) final_pass = true;
  return final_pass;
}

/* Reduction j of a row program: a pass over the row, every per-element value before it
 * recomputed, then the block's combination (v<j>, scaled). */
static void emit_row_reduction(kiln__sb *b, const kiln__ew_prog *p, const kiln__operands *o,
                               const kiln__wiring *w, const row_class *cls, int j, int nd) {
  bool isum = p->nodes[j]->op == KILN__OP_SUM;
  bool use[KILN__MAX_GROUP] = {0}, loaded[KILN__KMAX_PTR] = {0};
  for (int m = 0; m < j; m++)
    use[m] = cls[m] == FULL;
  use[j] = true; /* its own input may come from memory */
  kiln__sb_printf(b,
                  "    float acc%d = %s;\n"
                  "    for (ix q = threadIdx.x; q < a.nred; q += blockDim.x) {\n"
                  "      const ix c%d = q;\n",
                  j, isum ? "0.f" : "-__int_as_float(0x7f800000)", nd - 1);
  emit_loads(b, p, use, o, w, loaded, "      ", nd, false);
  for (int m = 0; m < j; m++)
    if (cls[m] == FULL) emit_value(b, p, w, m, "      ", nd, false, false);
  char in0[16];
  kiln__in_name(w, j, 0, in0, sizeof in0);
  if (isum)
    kiln__sb_printf(b, "      acc%d += %s;\n    }\n", j, in0);
  else
    kiln__sb_printf(b, "      acc%d = kiln_maximum(acc%d, %s);\n    }\n", j, j, in0);
  bool bf16 = p->nodes[j]->out->dtype == KILN_DTYPE_BF16;
  kiln__sb_printf(b, "    const float v%d = %s(kiln_block_%s(acc%d, sv) * a.fv[%d]); // %s\n", j,
                  bf16 ? "(float)(kiln_bf16)" : "", isum ? "sum" : "max", j,
                  scale_slot(w, j, p->nodes[j]), kiln__ops[p->nodes[j]->op].name);
}

/* The last pass: every per-element value, and the stores of those that are written. */
static void emit_final_pass(kiln__sb *b, const kiln__ew_prog *p, const kiln__operands *o,
                            const kiln__wiring *w, const row_class *cls, int nd) {
  bool use[KILN__MAX_GROUP] = {0}, loaded[KILN__KMAX_PTR] = {0};
  for (int m = 0; m < p->n; m++)
    use[m] = cls[m] == FULL;
  kiln__sb_printf(b,
                  "    for (ix q = threadIdx.x; q < a.nred; q += blockDim.x) {\n"
                  "      const ix c%d = q;\n",
                  nd - 1);
  emit_loads(b, p, use, o, w, loaded, "      ", nd, false);
  for (int m = 0; m < p->n; m++)
    if (cls[m] == FULL) emit_value(b, p, w, m, "      ", nd, p->store[m], false);
  kiln__sb_printf(b, "    }\n");
}

bool kiln__render_rows(const kiln__target *t, const kiln__ew_prog *p, const kiln_tensor *F,
                       kiln__rendered *r) {
  int nd = F->ndim;
  row_class cls[KILN__MAX_GROUP];
  bool row[KILN__MAX_GROUP];
  bool final_pass = classify(p, F, cls, row);
  kiln__kargs *a = &r->arg.args;
  kiln__operands o = {0};
  kiln__wiring w;
  int nf = 0, ni = 0, nu = 0;
  kiln__wire(p, row, &o, &w, &r->arg, &nf, &ni, &nu);
  a->n = 1;
  for (int d = 0; d + 1 < nd; d++) {
    a->shape[d] = F->shape[d];
    a->n *= F->shape[d];
  }
  a->nred = F->shape[nd - 1];
  for (int k = 0; k < o.n; k++) {
    if (o.row[k])
      kiln__align_strides(o.t[k], o.row[k]->ndim, o.row[k]->shape, a->st[k]);
    else
      kiln__align_strides(o.t[k], nd, F->shape, a->st[k]);
  }
  kiln__tally_bytes(&o, r);
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
    } else if (cls[j] == RED) {
      emit_row_reduction(&b, p, &o, &w, cls, j, nd);
    }
  }
  if (final_pass) emit_final_pass(&b, p, &o, &w, cls, nd);
  kiln__sb_printf(&b, "    if (threadIdx.x == 0) {\n");
  for (int j = 0; j < p->n; j++) { /* the per-row values that are written */
    int k = w.store_slot[j];
    if (cls[j] == FULL || k < 0) continue;
    const char *ot = kiln__ctype(p->nodes[j]->out->dtype);
    kiln__sb_printf(&b, "      ((%s *)a.ptr[%d])[", ot, k);
    row_offset(&b, k, nd - 1);
    kiln__sb_printf(&b, "] = (%s)v%d;\n", ot, j);
  }
  kiln__sb_printf(&b, "    }\n  }\n");
  char stem[80], suffix[24];
  snprintf(suffix, sizeof suffix, "_%s_rows", kiln_dtype_name(F->dtype));
  kiln__stem_of(p, "k", suffix, stem, sizeof stem);
  bool ok = kiln__finish(&b, stem, &o, r);
  kiln__sb_free(&b);
  row_launch(t, r);
  return ok;
}

/* ---------------------------------------------------------------- batch norm's sums */

/* The columns a thread of the moments kernel takes: 4 or 2 where C is a multiple and holds a
 * warp's 32 V columns (no lane idle: 64 channels take 2), every operand's first element aligned
 * to them; else 1. */
static int moments_lanes(const kiln__node *n, int64_t C) {
  for (int v = 4; v > 1; v /= 2) {
    bool ok = C % v == 0 && C >= 32 * v;
    for (int q = 0; q < n->nin && ok; q++)
      ok = n->in[q]->offset % v == 0;
    if (ok) return v;
  }
  return 1;
}

/* moments.cuh's sums over blocks of 32 V columns x `rows` rows, each block's partial sums
 * (P, 2, C) finished by a plain sum over P. */
bool kiln__render_moments(const kiln__target *tg, const kiln__node *n, kiln__rendered *r) {
  (void)tg;
  kiln__kargs *a = &r->arg.args;
  kiln__operands o = {0};
  for (int q = 0; q < n->nin; q++) {
    KILN_ASSERT(kiln__is_contiguous(n->in[q]) && kiln__is_float(n->in[q]->dtype));
    kiln__operand(&o, n->in[q], false, NULL);
  }
  int out = kiln__operand(&o, n->out, true, NULL);
  int64_t R = n->in[0]->shape[0], C = n->in[0]->shape[1], P = n->out->shape[0];
  bool centered = KILN__I(n, MOMENTS, mode) != 0;
  a->n = R;
  a->shape[0] = C;
  kiln__sb b = {0};
  int V = moments_lanes(n, C);
  kiln__sb_printf(&b,
                  "  typedef %s ix;\n"
                  "  kiln_moments_%s<%lld, %d, %d, ix>(",
                  kiln__wide_index(R * C) ? "long long" : "int", centered ? "grad" : "shifted",
                  (long long)KILN__I(n, MOMENTS, rows), KILN__BLOCK / 32, V);
  for (int q = 0; q < n->nin; q++) /* x and k, or g, x, mean and invstd */
    kiln__sb_printf(&b, "(const %s *)a.ptr[%d], ", q < 2 ? kiln__ctype(n->in[q]->dtype) : "float",
                    q);
  kiln__sb_printf(&b, "(float *)a.ptr[%d], (ix)a.n, (ix)a.shape[0]);\n", out);
  char stem[48];
  snprintf(stem, sizeof stem, "k_moments_%s_%s", centered ? "grad" : "shifted",
           kiln_dtype_name(n->in[centered ? 1 : 0]->dtype));
  bool ok = kiln__finish_with(&b, stem, &o, r, "#include \"moments.cuh\"\n");
  kiln__sb_free(&b);
  r->block = KILN__BLOCK;
  r->grid = (unsigned)((C + 32 * V - 1) / (32 * V));
  r->grid_y = (unsigned)P;
  for (int q = 0; q < n->nin; q++)
    r->bytes_read += kiln__footprint(n->in[q]);
  r->bytes_written = kiln__footprint(n->out);
  return ok;
}
