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

/* A reduction, its input computed by an elementwise prologue or read from memory. Strategy
 * "rows": one block per output, threads stride over the reduced elements (for reductions along
 * the innermost dim), combined by reduce.cuh's block reductions. Strategy "cols": one thread per
 * output, looping over the reduced elements (neighbouring threads read neighbouring columns). */
bool kiln__render_reduce(const kiln__target *t, const kiln__ew_prog *pro, const kiln__node *rn,
                         kiln__rendered *r) {
  const kiln_tensor *x = rn->in[0];
  unsigned mask = (unsigned)KILN__RI(rn, mask);
  int nd = x->ndim;
  kiln__kargs *a = &r->arg.args;
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
    if (k != out) kiln__align_strides(o.t[k], nd, x->shape, a->st[k]);
    o.lin[k] = false;
    int64_t reach = 0;
    for (int d = 0; d < nd && k != out; d++)
      reach += (x->shape[d] - 1) * llabs(a->st[k][d]);
    if (reach > span) span = reach;
  }
  kiln__tally_bytes(&o, r);
  bool wide = kiln__wide_index(span);
  bool argmax = rn->op == KILN__OP_ARGMAX, isum = rn->op == KILN__OP_SUM;
  bool exact = isum && rn->out->dtype == KILN_DTYPE_I32; /* i32 values, summed in 64 bits */
  const char *acct = exact ? "long long" : "float";
  bool inner = nr > 0 && red[nr - 1] == nd - 1 && (value >= 0 || x->stride[nd - 1] == 1);
  /* a block per output when the reduced axis is innermost (coalesced), or when there are too few
   * outputs for a thread per output to fill the device */
  bool rows = nr > 0 && (inner || a->n < (int64_t)t->num_sms * KILN__FEW_OUTPUTS_PER_SM);
  const char *init = exact ? "0" : (isum ? "0.f" : "-__int_as_float(0x7f800000)");

  kiln__sb b = {0};
  kiln__emit_index_type(&b, wide);
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
    kiln__emit_element(&b, pro, &o, &w, "      ", nd, false);
    kiln__sb_printf(&b, "      const %s v = v%d;\n", acct, value);
  } else {
    kiln__sb_printf(&b, "      const %s v = ((const %s *)a.ptr[0])[", acct, kiln__ctype(x->dtype));
    kiln__offset_expr(&b, 0, nd, false, 0);
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
             kiln__ctype(rn->out->dtype), out, kiln__ctype(rn->out->dtype), scale);
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
    kiln__stem_of(pro, "k", suffix, stem, sizeof stem);
  else
    snprintf(stem, sizeof stem, "k%s", suffix);
  bool ok = kiln__finish(&b, stem, &o, r);
  kiln__sb_free(&b);
  if (rows) {
    row_launch(t, r);
  } else {
    r->block = KILN__BLOCK;
    r->grid = kiln__grid_for(t, a->n);
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

bool kiln__render_rows(const kiln__target *t, const kiln__ew_prog *p, const kiln_tensor *F,
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
    const kiln_tensor *x = o.t[k];
    if (o.row[k])
      kiln__align_strides(x, o.row[k]->ndim, o.row[k]->shape, a->st[k]);
    else
      kiln__align_strides(x, nd, F->shape, a->st[k]);
    if (o.store[k])
      r->bytes_written += kiln__footprint(x);
    else
      r->bytes_read += kiln__footprint(x);
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
    kiln__in_name(&w, j, 0, in0, sizeof in0);
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
    const char *ot = kiln__ctype(p->nodes[j]->out->dtype);
    kiln__sb_printf(&b, "      ((%s *)a.ptr[%d])[", ot, k);
    row_offset(&b, k, nd - 1);
    kiln__sb_printf(&b, "] = (%s)v%d;\n", ot, j);
  }
  kiln__sb_printf(&b, "    }\n  }\n");
  char stem[80];
  char suffix[24];
  snprintf(suffix, sizeof suffix, "_%s_rows", kiln_dtype_name(F->dtype));
  kiln__stem_of(p, "k", suffix, stem, sizeof stem);
  bool ok = kiln__finish(&b, stem, &o, r);
  kiln__sb_free(&b);
  row_launch(t, r);
  return ok;
}

/* ---------------------------------------------------------------- batch norm's sums */

/* Blocks of 32 columns x KILN__MOMENTS_ROWS rows: a warp reads 32 neighbouring columns of a row
 * (128 bytes), the block's 8 warps stride over the rows, and the 8 partial sums of a column are
 * added in a fixed order (the result is the same on every run). blockIdx.y is the block of rows:
 * partial sums (P, 2, C) that a plain sum over P finishes. */
bool kiln__render_moments(const kiln__target *tg, const kiln__node *n, kiln__rendered *r) {
  (void)tg;
  kiln__kargs *a = &r->arg.args;
  kiln__operands o = {0};
  for (int q = 0; q < n->nin; q++) {
    KILN_ASSERT(kiln__is_contiguous(n->in[q]) && kiln__is_float(n->in[q]->dtype));
    kiln__operand(&o, n->in[q], false, NULL);
  }
  const char *t0 = kiln__ctype(n->in[0]->dtype), *t1 = kiln__ctype(n->in[1]->dtype);
  int out = kiln__operand(&o, n->out, true, NULL);
  int64_t R = n->in[0]->shape[0], C = n->in[0]->shape[1], P = n->out->shape[0];
  int64_t rows = KILN__I(n, MOMENTS, rows);
  bool centered = KILN__I(n, MOMENTS, mode) != 0;
  bool wide = kiln__wide_index(R * C);
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
  bool ok = kiln__finish(&b, stem, &o, r);
  kiln__sb_free(&b);
  r->block = KILN__BLOCK;
  r->grid = (unsigned)((C + 31) / 32);
  r->grid_y = (unsigned)P;
  for (int q = 0; q < n->nin; q++)
    r->bytes_read += kiln__footprint(n->in[q]);
  r->bytes_written = kiln__footprint(n->out);
  return ok;
}
