/*
 * render_window.c: the sliding-window family over images (N, H, W, C): im2col, col2im, max and
 * average pooling and their gradients, each optionally followed by an elementwise epilogue
 * computed per lane of the op's result.
 */
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "render.h"

/* ---------------------------------------------------------------- epilogues */

/* Lane l's share of batch norm's gradient sums (kiln__win_epi's mom), in the lane loop: its
 * element i, its channel c + l. x is the lane's value of an operand the epilogue reads already
 * (x<k>) where one is the same dense memory (batch norm's input, read again by its recomputed
 * apply), else read. */
static void moments_lane(kiln__sb *b, const char *in, const kiln__win_epi *e, const bool *used) {
  if (e->mom.value <= 0) return;
  const kiln__operands *o = e->o;
  const kiln_tensor *x = o->t[e->mom.x];
  char xv[96];
  snprintf(xv, sizeof xv, "(float)((const %s *)a.ptr[%d])[i]", kiln__ctype(x->dtype), e->mom.x);
  for (int k = 0; k < o->n; k++)
    if (used[k] && !o->store[k] && o->lin[k] && o->t[k]->st == x->st &&
        o->t[k]->offset == x->offset && o->t[k]->dtype == x->dtype) {
      snprintf(xv, sizeof xv, "x%d", k);
      break;
    }
  char mv[2][64]; /* mean and invstd: the lane's x<k> where the epilogue reads them by channel */
  for (int t = 0; t < 2; t++) {
    int k = t ? e->mom.invstd : e->mom.mean;
    if (used[k] && o->bcast[k] == 'c')
      snprintf(mv[t], sizeof mv[t], "x%d", k);
    else
      snprintf(mv[t], sizeof mv[t], "((const float *)a.ptr[%d])[c + l]", k);
  }
  kiln__sb_printf(b, "%skiln_ms[l] += v%d;\n%skiln_ms[4 + l] += v%d * ((%s - %s) * %s);\n", in,
                  e->mom.value, in, e->mom.value, xv, mv[0], mv[1]);
}

/* The epilogue over four lanes whose operands are dense like the output: each read and written
 * four values at a time from i0, the first lane's element. */
static void epilogue_vec(kiln__sb *b, const char *name, bool bf16, const kiln__win_epi *e,
                         const bool *used) {
  const kiln__operands *o = e->o;
  const kiln__wiring *w = e->w;
  if (e->image && e->pixel)
    kiln__sb_printf(b, "    {\n      const ix i0 = %s * %lld + c;\n", e->pixel,
                    (long long)e->shape[3]);
  else
    kiln__sb_printf(b, "    {\n      const ix i0 = ((n * %lld + %s) * %lld + %s) * %lld + c;\n",
                    (long long)e->shape[1], e->image ? "h" : "oh", (long long)e->shape[2],
                    e->image ? "w" : "ow", (long long)e->shape[3]);
  for (int k = 0; k < o->n; k++) {
    if (o->store[k] && e->mom.value > 0 && k == e->mom.out) continue;
    if (o->store[k])
      kiln__sb_printf(b, "      float S%d[4];\n", k);
    else if (used[k] && o->bcast[k] == 's')
      kiln__sb_printf(b, "      const float X%d0 = ((const %s *)a.ptr[%d])[0];\n", k,
                      kiln__ctype(o->t[k]->dtype), k);
    else if (used[k] && e->ring && o->lin[k])
      kiln__sb_printf(b, "      float X%d[4];\n      kiln_unpack4(XR%d[%s], X%d);\n", k, k, e->ring,
                      k);
    else if (used[k] && !(e->hoist && (o->bcast[k] == 'c' || o->lin[k]))) /* else loaded ahead */
      kiln__sb_printf(b,
                      "      float X%d[4];\n      kiln_load4((const %s *)a.ptr[%d] + %s, X%d);\n",
                      k, kiln__ctype(o->t[k]->dtype), k, o->bcast[k] == 'c' ? "c" : "i0", k);
  }
  kiln__sb_printf(b,
                  "#pragma unroll\n"
                  "      for (int l = 0; l < 4; l++) {\n"
                  "        const ix i = i0 + l;\n"
                  "        (void)i;\n"
                  "        const float v0 = %s%s[l];\n",
                  bf16 && !e->rounded ? "(float)(kiln_bf16)" : "", name);
  for (int k = 0; k < o->n; k++)
    if (used[k] && !o->store[k])
      kiln__sb_printf(b,
                      o->bcast[k] == 's' ? "        const float x%d = X%d0;\n"
                                         : "        const float x%d = X%d[l];\n",
                      k, k);
  for (int j = 0; j < e->p->n; j++) {
    if (j > 0) kiln__emit_node_value(b, "        ", w, j, e->p->nodes[j]);
    if (w->store_slot[j] >= 0)
      kiln__sb_printf(b, "        S%d[l] = (float)v%d;\n", w->store_slot[j], j);
  }
  moments_lane(b, "        ", e, used);
  kiln__sb_printf(b, "      }\n");
  for (int k = 0; k < o->n; k++)
    if (o->store[k] && !(e->mom.value > 0 && k == e->mom.out))
      kiln__sb_printf(b, "      kiln_store4((%s *)a.ptr[%d] + i0, S%d);\n",
                      kiln__ctype(o->t[k]->dtype), k, k);
  kiln__sb_printf(b, "    }\n");
}

/* The epilogue lane by lane, each operand read and written at its own strides. */
static void epilogue_lanes(kiln__sb *b, const char *name, bool bf16, const kiln__win_epi *e,
                           const bool *used) {
  const kiln__operands *o = e->o;
  const kiln__wiring *w = e->w;
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
    kiln__sb_printf(b, "      const %s x%d = ((const %s *)a.ptr[%d])[", kiln__rtype(o->t[k]->dtype),
                    k, kiln__ctype(o->t[k]->dtype), k);
    if (o->bcast[k])
      kiln__sb_printf(b, o->bcast[k] == 'c' ? "c3" : "0");
    else
      kiln__offset_expr(b, k, 4, o->lin[k], 0);
    kiln__sb_printf(b, "];\n");
  }
  for (int j = 0; j < e->p->n; j++) {
    const kiln__node *nd = e->p->nodes[j];
    if (j > 0) kiln__emit_node_value(b, "      ", w, j, nd);
    int k = w->store_slot[j];
    if (k < 0) continue;
    const char *ot = kiln__ctype(nd->out->dtype);
    kiln__sb_printf(b, "      ((%s *)a.ptr[%d])[", ot, k);
    kiln__offset_expr(b, k, 4, o->lin[k], 0);
    kiln__sb_printf(b, "] = (%s)v%d;\n", ot, j);
  }
  moments_lane(b, "      ", e, used);
  kiln__sb_printf(b, "    }\n");
}

void kiln__prog_reads(const kiln__ew_prog *p, const kiln__wiring *w, int from, bool *used) {
  for (int j = from; j < p->n; j++)
    for (int q = 0; q < p->nodes[j]->nin; q++)
      if (w->opnd[j][q] >= 0) used[w->opnd[j][q]] = true;
}

/* The operands epilogue e reads (used[k]): its nodes after the window op's, and with a ring
 * batch norm's sums' x (where dense), mean and invstd (one value a channel), fetched with them. */
static void epilogue_reads(const kiln__win_epi *e, bool *used) {
  kiln__prog_reads(e->p, e->w, 1, used);
  if (!e->ring || e->mom.value <= 0) return;
  if (e->o->lin[e->mom.x]) used[e->mom.x] = true;
  if (e->o->bcast[e->mom.mean] == 'c') used[e->mom.mean] = true;
  if (e->o->bcast[e->mom.invstd] == 'c') used[e->mom.invstd] = true;
}

void kiln__hoist_channel_loads(kiln__sb *b, const kiln__win_epi *e, const char *c,
                               const char *limit, const char *ind) {
  KILN_ASSERT(e->hoist && e->vec);
  bool used[KILN__KMAX_PTR] = {0};
  epilogue_reads(e, used);
  for (int k = 0; k < e->o->n; k++)
    if (used[k] && !e->o->store[k] && e->o->bcast[k] == 'c')
      kiln__sb_printf(b,
                      "%sfloat X%d[4] = {0.f, 0.f, 0.f, 0.f};\n"
                      "%sif (%s < %s) kiln_load4((const %s *)a.ptr[%d] + %s, X%d);\n",
                      ind, k, ind, c, limit, kiln__ctype(e->o->t[k]->dtype), k, c, k);
}

void kiln__ahead_rows(kiln__sb *b, const kiln__win_epi *e, bool first, const char *depth,
                      const char *rows, const char *row, const char *ok, const char *c,
                      const char *ind) {
  KILN_ASSERT(e->hoist && e->vec && e->image);
  bool used[KILN__KMAX_PTR] = {0};
  epilogue_reads(e, used);
  for (int k = 0; k < e->o->n; k++) {
    if (!used[k] || e->o->store[k] || !e->o->lin[k] || e->o->bcast[k]) continue;
    const char *T = kiln__ctype(e->o->t[k]->dtype), *zero = e->o->t[k]->dtype == KILN_DTYPE_BF16
                                                                ? "make_uint2(0u, 0u)"
                                                                : "make_float4(0.f, 0.f, 0.f, 0.f)";
    long long C = (long long)e->shape[3];
    if (first)
      kiln__sb_printf(b,
                      "%s%s XR%d[%s];\n"
                      "#pragma unroll\n"
                      "%sfor (int kiln_r = 0; kiln_r < %s; kiln_r++) {\n"
                      "%s  XR%d[kiln_r] = %s;\n"
                      "%s  if (%s(kiln_r)) kiln_fetch4((const %s *)a.ptr[%d] + %s(kiln_r) * %lld + "
                      "%s, XR%d[kiln_r]);\n"
                      "%s}\n",
                      ind, e->o->t[k]->dtype == KILN_DTYPE_BF16 ? "uint2" : "float4", k, depth, ind,
                      depth, ind, k, zero, ind, ok, T, k, row, C, c, k, ind);
    else
      kiln__sb_printf(b,
                      "%sfloat X%d[4];\n"
                      "%skiln_unpack4(XR%d[kiln_r %% %s], X%d);\n"
                      "%sif (kiln_r + %s < %s) {\n"
                      "%s  XR%d[kiln_r %% %s] = %s;\n"
                      "%s  if (%s(kiln_r + %s)) kiln_fetch4((const %s *)a.ptr[%d] + %s(kiln_r + "
                      "%s) * %lld + %s, XR%d[kiln_r %% %s]);\n"
                      "%s}\n",
                      ind, k, ind, k, depth, k, ind, depth, rows, ind, k, depth, zero, ind, ok,
                      depth, T, k, row, depth, C, c, k, depth, ind);
  }
}

void kiln__store_lanes(kiln__sb *b, const char *name, kiln_dtype dt, const kiln__win_epi *e) {
  bool used[KILN__KMAX_PTR] = {0}; /* the operands the epilogue reads */
  epilogue_reads(e, used);
  bool bf16 = dt == KILN_DTYPE_BF16; /* the op's value, rounded as its store would round it */
  if (e->vec)
    epilogue_vec(b, name, bf16, e, used);
  else
    epilogue_lanes(b, name, bf16, e, used);
}

/* The operands of a window op's kernel: its inputs (operands 0..) and output, or with an
 * epilogue the program's wiring (whose strides and dense flags the epilogue reads). Returns the
 * output's operand, -1 when the epilogue stores. */
int kiln__window_operands(const kiln__ew_prog *p, kiln__operands *o, kiln__wiring *wr,
                          kiln__rendered *r) {
  const kiln__node *n = p->nodes[0];
  if (p->n == 1) {
    for (int q = 0; q < n->nin; q++)
      kiln__operand(o, n->in[q], false, NULL);
    return kiln__operand(o, n->out, true, NULL);
  }
  int nf = 0, ni = 0, nu = 0;
  kiln__wire(p, NULL, o, wr, &r->arg, &nf, &ni, &nu); /* the op's inputs are operands 0.. */
  for (int q = 0; q < n->nin; q++)
    KILN_ASSERT(wr->opnd[0][q] == q);
  for (int k = 0; k < o->n; k++) {
    const long long *st = r->arg.args.st[k];
    kiln__align_strides(o->t[k], 4, n->out->shape, r->arg.args.st[k]);
    o->lin[k] = kiln__dense(o->t[k], kiln_tensor_numel(n->out)); /* the epilogue indexes it by i */
    if (!o->lin[k] && st[0] == 0 && st[1] == 0 && st[2] == 0)
      o->bcast[k] = st[3] == 1 ? 'c' : st[3] == 0 ? 's' : 0; /* a batch norm's per-channel terms */
  }
  return -1;
}

/* The window op's geometry and sizes as the struct of constants window.cuh reads (ops.def: its
 * attribute win, and groups or exclude_pad where the op has them). */
static void emit_geometry(kiln__sb *pre, const kiln__node *n, const kiln__win *w, const int64_t *sz,
                          int V, bool wide) {
  kiln__sb_printf(pre,
                  "#include \"window.cuh\"\n"
                  "struct G { /* the window op's geometry and sizes */\n"
                  "  typedef %s ix;\n"
                  "  static constexpr int KH = %lld, KW = %lld, SH = %lld, SW = %lld, PH = %lld, "
                  "PW = %lld, DH = %lld, DW = %lld, V = %d;\n"
                  "  static constexpr ix H = %lld, W = %lld, C = %lld, OH = %lld, OW = %lld, KP = "
                  "%lld;\n",
                  wide ? "long long" : "int", (long long)w->kh, (long long)w->kw, (long long)w->sh,
                  (long long)w->sw, (long long)w->ph, (long long)w->pw, (long long)w->dh,
                  (long long)w->dw, V, (long long)sz[1], (long long)sz[2], (long long)sz[3],
                  (long long)sz[4], (long long)sz[5], (long long)sz[6]);
  if (kiln__has_attr(n->op, "groups"))
    kiln__sb_printf(pre, "  static constexpr int GROUPS = %lld;\n",
                    (long long)KILN__I_NAMED(n, "groups"));
  if (kiln__has_attr(n->op, "exclude_pad"))
    kiln__sb_printf(pre, "  static constexpr bool EXCLUDE_PAD = %s;\n",
                    KILN__I_NAMED(n, "exclude_pad") ? "true" : "false");
  kiln__sb_printf(pre, "};\n");
}

/* Whether the op is a max pool that writes its windows' positions, or the gradient that reads
 * them (ops.def: index). */
static bool pool_index(const kiln__node *n) {
  return (n->op == KILN__OP_MAX_POOL || n->op == KILN__OP_MAX_POOL_GRAD) &&
         KILN__I_NAMED(n, "index") != 0;
}

const char *kiln__pool_positions(char *buf, size_t len, const kiln_tensor *y, int slot, bool read) {
  const char *c = read ? "const " : "";
  snprintf(buf, len, "(%sunsigned char *)((%s%s *)a.ptr[%d] + %lldLL)", c, c, kiln__ctype(y->dtype),
           slot, (long long)kiln_tensor_numel(y));
  return buf;
}

/* For an epilogue with a ring (tg->window_ahead: a col2im, or a max pool gradient a block of
 * SH x SW pixels a thread, `blocks`): the loop's header `range`, then, opening its body, the
 * operands the epilogue reads one value a channel (X<k>) and, for each of the thread's pixels,
 * those it reads element by element (XR<k>[pixel]), all issued before the op's own loads, so that
 * a thread waits on one round trip an iteration, not one for the op's loads, then one for the
 * epilogue's of each pixel: the stores of a pixel's epilogue would keep the next pixel's loads
 * from starting (the compiler cannot tell the operands apart). The window function stores the
 * pixels row by row, as they are fetched; the epilogue unpacks pixel kiln_p's. */
static void emit_ahead(kiln__sb *b, const kiln__win_epi *e, const char *range, bool blocks) {
  bool used[KILN__KMAX_PTR] = {0};
  epilogue_reads(e, used);
  const char *bh = blocks ? "G::SH" : "1", *bw = blocks ? "G::SW" : "1";
  kiln__sb_printf(b,
                  "%s  {\n"
                  "    constexpr int BH = %s, BW = %s; /* the thread's pixels */\n"
                  "    ix kiln_n, kiln_bh, kiln_bw, kiln_c;\n"
                  "    kiln_win_split<G>(e, G::H / BH, G::W / BW, kiln_n, kiln_bh, kiln_bw, "
                  "kiln_c);\n",
                  range, bh, bw);
  kiln__hoist_channel_loads(b, e, "kiln_c", "G::C", "    ");
  for (int k = 0; k < e->o->n; k++) {
    if (!used[k] || e->o->store[k] || !e->o->lin[k]) continue;
    bool bf16 = e->o->t[k]->dtype == KILN_DTYPE_BF16;
    kiln__sb_printf(b,
                    "    %s XR%d[BH * BW];\n"
                    "#pragma unroll\n"
                    "    for (int kiln_i = 0; kiln_i < BH * BW; kiln_i++)\n"
                    "      kiln_fetch4((const %s *)a.ptr[%d] + ((kiln_n * G::H + kiln_bh * BH + "
                    "kiln_i / BW) * G::W + kiln_bw * BW + kiln_i %% BW) * G::C + kiln_c, "
                    "XR%d[kiln_i]);\n",
                    bf16 ? "uint2" : "float4", k, kiln__ctype(e->o->t[k]->dtype), k, k);
  }
  kiln__sb_printf(b, "    int kiln_p = 0;\n");
}

/* The kernel's loop over lane groups: window.cuh's function of the op (kiln_<op name>, ops.def),
 * given the op's inputs, and the lambda that stores its lanes at the output's coordinates, plainly
 * to operand out or through the epilogue e, then the code tail (or none). A max pool with positions
 * passes where they go: behind the values of its output, operand y; its gradient, where they are:
 * behind its second input's; with prologue, the op's first input (the gradient's dy, the pool's
 * image) comes from kiln_dy. The loop is a grid-stride one over a.n lane groups, or `range` (its
 * header, or NULL). */
static void emit_loop(kiln__sb *b, const kiln__node *n, const char *variant, int out, int y,
                      const kiln__win_epi *e, bool prologue, const char *range, const char *tail) {
  bool image = kiln__ops[n->op].space == KILN__SPACE_IMAGE, index = pool_index(n);
  const int64_t *o = n->out->shape;
  if (!range)
    range = "  for (ix e = (ix)blockIdx.x * blockDim.x + threadIdx.x; e < (ix)a.n;\n"
            "       e += (ix)gridDim.x * blockDim.x)\n";
  if (e && e->ring) { /* the body opened by the fetches, the pixel counted after each store */
    emit_ahead(b, e, range, n->op == KILN__OP_MAX_POOL_GRAD); /* else a col2im: a pixel */
    range = "";
    tail = "      kiln_p++;\n";
  }
  kiln__sb_printf(b, "%s    kiln_%s%s%s%s<G>(%s", range, kiln__ops[n->op].name, variant,
                  index ? "_at" : "", prologue ? "_by" : "", prologue ? "kiln_dy, " : "");
  char at[96];
  for (int q = prologue ? 1 : 0; q < n->nin; q++)
    if (index && q == 1) /* the gradient's positions, behind the pool's output */
      kiln__sb_printf(b, "%s, ", kiln__pool_positions(at, sizeof at, n->in[1], 1, true));
    else
      kiln__sb_printf(b, "(const %s *)a.ptr[%d], ", kiln__ctype(n->in[q]->dtype), q);
  if (index && n->op == KILN__OP_MAX_POOL)
    kiln__sb_printf(b, "%s, ", kiln__pool_positions(at, sizeof at, n->out, y, false));
  kiln__sb_printf(b, "e, [&](ix n, ix %s, ix %s, ix c, const float(&lanes)[V]) {\n",
                  image ? "h" : "oh", image ? "w" : "ow");
  if (e)
    kiln__store_lanes(b, "lanes", n->out->dtype, e);
  else
    kiln__sb_printf(
        b,
        "    kiln_win_put<V>((%s *)a.ptr[%d], ((n * %lld + %s) * %lld + %s) * %lld + c, "
        "lanes);\n",
        kiln__ctype(n->out->dtype), out, (long long)o[1], image ? "h" : "oh", (long long)o[2],
        image ? "w" : "ow", (long long)o[3]);
  kiln__sb_printf(b, "%s  });\n%s", tail ? tail : "", e && e->ring ? "  }\n" : "");
}

/* The loader of a value computed by an elementwise prologue (pro, over the value's shape: the
 * operands it reads, classified here as dense like it, one value a channel, or one in all): a
 * window op's first input (a pool gradient's dy, a max pool's image), a few-channel weight
 * gradient's dY (render_conv.c). kiln_dy(o, c, gv) gives the four lanes from element o (channel
 * c). */
void kiln__emit_prologue(kiln__sb *b, const kiln__ew_prog *pro, kiln__operands *o,
                         const kiln__wiring *w, kiln__argplan *ap) {
  const kiln_tensor *dy = pro->nodes[pro->n - 1]->out;
  bool used[KILN__KMAX_PTR] = {0};
  kiln__prog_reads(pro, w, 0, used);
  kiln__sb_printf(b, "  auto kiln_dy = [&](ix i0, ix c, float(&gv)[4]) {\n");
  for (int k = 0; k < o->n; k++) {
    if (!used[k]) continue;
    long long *st = ap->args.st[k];
    kiln__align_strides(o->t[k], 4, dy->shape, st);
    bool lin = kiln__dense(o->t[k], kiln_tensor_numel(dy));
    bool chan = !lin && st[0] == 0 && st[1] == 0 && st[2] == 0 && st[3] == 1;
    KILN_ASSERT(lin || chan || kiln_tensor_numel(o->t[k]) == 1); /* the planner's condition */
    const char *T = kiln__ctype(o->t[k]->dtype);
    if (lin || chan)
      kiln__sb_printf(b, "    float X%d[4];\n    kiln_load4((const %s *)a.ptr[%d] + %s, X%d);\n", k,
                      T, k, lin ? "i0" : "c", k);
    else
      kiln__sb_printf(b, "    const float X%d0 = (float)((const %s *)a.ptr[%d])[0];\n", k, T, k);
  }
  kiln__sb_printf(b, "#pragma unroll\n"
                     "    for (int l = 0; l < 4; l++) {\n"
                     "      const ix i = i0 + l;\n"
                     "      (void)i;\n");
  for (int k = 0; k < o->n; k++)
    if (used[k])
      kiln__sb_printf(b,
                      kiln_tensor_numel(o->t[k]) == 1 && kiln_tensor_numel(dy) != 1
                          ? "      const float x%d = X%d0;\n"
                          : "      const float x%d = X%d[l];\n",
                      k, k);
  for (int j = 0; j < pro->n; j++)
    kiln__emit_node_value(b, "      ", w, j, pro->nodes[j]);
  kiln__sb_printf(b, "      gv[l] = v%d;\n    }\n  };\n", pro->n - 1);
}

/* A max pool that also sums batch norm's statistics of its output (kiln__pool_moments): block b
 * pools rows [128 b, 128 b + 128) of the output, a thread keeping its lane group's four channels
 * (C / 4 of them a row, a divisor of 256), and sums x - k and its square over them, k the pooled
 * row 0 at its channels, pooled again here (the value the moments kernel would read back, as a
 * max of the input's values is one of them); then the block's sums into the moments node's
 * partial sums, operand mout (moments.cuh's kiln_block_moments). */
static void emit_pool_moments(kiln__sb *b, const kiln__node *n, int out, int y, int mout) {
  const char *T = kiln__ctype(n->in[0]->dtype);
  kiln__sb_printf(
      b,
      "  typedef G::ix ix;\n"
      "  const int V = G::V;\n"
      "  constexpr int CHUNKS = (int)(G::C / 4);\n"
      "  static_assert(V == 4 && 256 %% CHUNKS == 0, \"a thread keeps its lane group\");\n"
      "  float kiln_k[4];\n"
      "  kiln_max_pool<G>((const %s *)a.ptr[0], (ix)(threadIdx.x %% CHUNKS), [&](ix, ix, ix, ix, "
      "const float(&lanes)[V]) {\n"
      "#pragma unroll\n"
      "    for (int l = 0; l < 4; l++)\n"
      "      kiln_k[l] = lanes[l];\n"
      "  });\n"
      "  float kiln_ms[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};\n"
      "  const ix e0 = (ix)blockIdx.x * 128 * CHUNKS;\n"
      "  const ix e1 = e0 + 128 * CHUNKS < (ix)a.n ? e0 + 128 * CHUNKS : (ix)a.n;\n",
      T);
  emit_loop(b, n, "", out, y, NULL, false,
            "  for (ix e = e0 + (ix)threadIdx.x; e < e1; e += 256)\n",
            "#pragma unroll\n"
            "    for (int l = 0; l < 4; l++) {\n"
            "      const float d = lanes[l] - kiln_k[l];\n"
            "      kiln_ms[l] += d;\n"
            "      kiln_ms[4 + l] += d * d;\n"
            "    }\n");
  kiln__sb_printf(
      b,
      "  __shared__ float kiln_red[8 * 256];\n"
      "  kiln_block_moments<CHUNKS>(kiln_ms, kiln_red, (float *)a.ptr[%d], blockIdx.x, 0, "
      "(int)G::C);\n",
      mout);
}

/* A window op whose epilogue computes batch norm's g (kiln__window_moments: a col2im, or max
 * pooling's gradient a block of `pixels` pixels a thread) that also sums g and g xhat into the
 * moments node mom's partial sums (e's operand mom.out), each of 128 pixels: a block takes a slice
 * of 64 channels (16 lane groups; all where fewer) of GP partials in a row, a thread keeping its
 * lane group, the epilogue adding each lane's share (moments_lane); then the block's sums go into
 * the first of its partials (moments.cuh's kiln_block_moments) and zeros into the others, the sum
 * over the partials being what the next kernel reads. GP makes about 2,048 blocks, at least one
 * partial each. Returns the grid. */
static unsigned emit_window_moments(kiln__sb *b, const kiln__node *n, const char *variant, int out,
                                    int y, const kiln__win_epi *e, const kiln__node *mom,
                                    int pixels) {
  const int64_t P = mom->out->shape[0], chunks = n->out->shape[3] / 4;
  const int64_t cs = chunks < 16 ? chunks : 16, slices = chunks / cs;
  const int64_t gp = P * slices / 2048 > 1 ? P * slices / 2048 : 1;
  kiln__sb_printf(
      b,
      "  typedef G::ix ix;\n"
      "  const int V = G::V;\n"
      "  constexpr int CHUNKS = (int)(G::C / 4), CS = %lld, SLICES = CHUNKS / CS, Q = 128 / %d;\n"
      "  constexpr long long P = %lldLL, GP = %lldLL;\n"
      "  static_assert(V == 4 && CHUNKS %% CS == 0 && 256 %% CS == 0, \"a thread keeps its lane "
      "group\");\n"
      "  float kiln_ms[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};\n"
      "  const int slice = (int)(blockIdx.x %% SLICES);\n"
      "  const long long p0 = (long long)(blockIdx.x / SLICES) * GP, p1 = p0 + GP < P ? p0 + GP : "
      "P;\n"
      "  const ix q1 = (ix)(a.n / CHUNKS) < (ix)(p1 * Q) ? (ix)(a.n / CHUNKS) : (ix)(p1 * Q);\n"
      "  const ix chunk = (ix)(slice * CS) + (ix)threadIdx.x %% CS;\n",
      (long long)cs, pixels, (long long)P, (long long)gp);
  emit_loop(b, n, variant, out, y, e, false,
            "  for (ix q = (ix)(p0 * Q) + (ix)threadIdx.x / CS, e = q * CHUNKS + chunk; q < q1;\n"
            "       q += 256 / CS, e = q * CHUNKS + chunk)\n",
            NULL);
  kiln__sb_printf(b,
                  "  __shared__ float kiln_red[8 * 256];\n"
                  "  float *kiln_out = (float *)a.ptr[%d];\n"
                  "  kiln_block_moments<CS>(kiln_ms, kiln_red, kiln_out, p0, slice * CS * 4, "
                  "(int)G::C);\n"
                  "  for (int t = (int)threadIdx.x; t < (int)(p1 - p0 - 1) * 8 * CS; t += 256)\n"
                  "    kiln_out[((p0 + 1 + t / (8 * CS)) * 2 + t / (4 * CS) %% 2) * G::C + slice * "
                  "CS * 4 + t %% (4 * CS)] = 0.f;\n",
                  e->mom.out);
  return (unsigned)((P + gp - 1) / gp * slices);
}

/* Four lanes (V = 4) when the channels of a lane group allow it and every operand's first element
 * is aligned to four elements, else one; with few (an im2col of 2 or 3 channels, tg->im2col_lanes:
 * KILN_IM2COL_LANES=1) all of a tap's channels, so that a thread decodes its tap once for them:
 * ResNet-18's 3-channel stem wrote its 472 MB of columns a bf16 a thread in 744 us on the H100.
 * With rows (tg->im2col_rows, on unless KILN_IM2COL_ROWS=0), an im2col of one group over fewer
 * than 8 channels whose rows are 8 to 32 values, a multiple of 8, takes a whole row a thread
 * (V = kp): the stem's blocks, 54 MB written a bf16 a thread in 84.5 us on the H100 (1.1 TB/s),
 * took 87 us less a step (twice) a row a thread. */
static int lanes_of(const kiln__node *n, int64_t channels, int64_t kp, bool few, bool rows) {
  int64_t span = kiln__has_attr(n->op, "groups") ? channels / KILN__I_NAMED(n, "groups") : channels;
  bool aligned = n->out->offset % 4 == 0;
  for (int q = 0; q < n->nin; q++)
    aligned = aligned && n->in[q]->offset % 4 == 0;
  if (rows && n->op == KILN__OP_IM2COL && span == channels && channels < 8 && kp >= 8 && kp <= 32 &&
      kp % 8 == 0 && n->out->offset % 8 == 0)
    return (int)kp; /* a thread a row: window.cuh's kiln_im2col_row */
  /* kp, the windows' values a row (zero columns past a window's own may end it), in lanes */
  if (few && n->op == KILN__OP_IM2COL && (span == 2 || span == 3) && kp % span == 0)
    return (int)span;
  return span % 4 == 0 && kp % 4 == 0 && aligned ? 4 : 1;
}

/* Whether the epilogue reads and writes four lanes at once: every operand it reads dense like the
 * output or broadcast over the image (one value a channel, or one in all), every store dense, and
 * all aligned. */
bool kiln__epilogue_fours(const kiln__ew_prog *p, const kiln__operands *o, const kiln__wiring *wr) {
  for (int j = 0; j < p->n; j++)
    for (int q = -1; q < (j ? p->nodes[j]->nin : 0); q++) {
      int k = q < 0 ? wr->store_slot[j] : wr->opnd[j][q];
      bool read_bcast = q >= 0 && k >= 0 && o->bcast[k]; /* one value a channel, or in all */
      if (k >= 0 && !((o->lin[k] || read_bcast) && o->t[k]->offset % 4 == 0 &&
                      kiln__is_float(o->t[k]->dtype)))
        return false;
    }
  return !wr->coords;
}

/* A window op, alone (p->n == 1) or with the elementwise nodes that follow it in its group as an
 * epilogue computed per lane (p->nodes[0] is the op). */
bool kiln__render_window(const kiln__target *tg, const kiln__ew_prog *p, const kiln__ew_prog *pro,
                         const kiln__node *mom, kiln__rendered *r) {
  const kiln__node *n = p->nodes[0];
  bool image_out = kiln__ops[n->op].space == KILN__SPACE_IMAGE;
  const kiln_tensor *img = image_out ? n->out : n->in[0], *win = image_out ? n->in[0] : n->out;
  for (int q = 0; q < n->nin; q++)
    KILN_ASSERT(kiln__is_contiguous(n->in[q]) && kiln__is_float(n->in[q]->dtype));
  kiln__operands o = {0};
  kiln__wiring wr;
  int out = kiln__window_operands(p, &o, &wr, r);
  /* the operand of the op's own output (stored: a max pool's with positions always is) */
  int y = out >= 0 ? out : wr.store_slot[0];
  KILN_ASSERT(!(pool_index(n) && n->op == KILN__OP_MAX_POOL) || y >= 0);
  int mout = mom ? kiln__operand(&o, mom->out, true, NULL) : -1;
  kiln__wiring pw;
  if (pro && pro->n > 0) {
    int nf = 0, ni = 0, nu = 0;
    KILN_ASSERT(p->n == 1 && !mom); /* the op alone: no epilogue's attribute slots taken */
    kiln__wire(pro, NULL, &o, &pw, &r->arg, &nf, &ni, &nu);
  }
  int64_t sz[7] = {img->shape[0], img->shape[1], img->shape[2], img->shape[3],
                   win->shape[1], win->shape[2], win->shape[3]};
  int V = lanes_of(n, sz[3], sz[6], tg->im2col_lanes,
                   tg->im2col_rows && p->n == 1 && !(pro && pro->n > 0));
  int64_t most = kiln_tensor_numel(n->out); /* the largest offset, in elements */
  for (int k = 0; k < o.n; k++) {
    uint64_t elems = kiln__footprint(o.t[k]) / kiln_dtype_size(o.t[k]->dtype);
    if (elems > (uint64_t)most) most = (int64_t)elems;
  }
  kiln__win w = kiln__win_of(n);
  /* max pooling's gradient over windows that tile the image (no overlap, padding or dilation;
   * the pixels past the last window are zeros): a thread per window finds its maximum once */
  bool tiled = n->op == KILN__OP_MAX_POOL_GRAD && w.sh == w.kh && w.sw == w.kw && w.ph == 0 &&
               w.pw == 0 && w.dh == 1 && w.dw == 1;
  /* ... or overlapping windows at stride 2 (ResNet's 3x3 stem pool): a thread a block of stride
   * x stride pixels reads each window that reaches them once (tg->pool_grad_blocks) */
  bool blocks = !tiled && tg->pool_grad_blocks && n->op == KILN__OP_MAX_POOL_GRAD && w.dh == 1 &&
                w.dw == 1 && w.sh <= 2 && w.sw <= 2 && w.sh * w.sw > 1 && sz[1] % w.sh == 0 &&
                sz[2] % w.sw == 0;
  r->arg.args.n = kiln_tensor_numel(tiled ? win : n->out) / V / (blocks ? w.sh * w.sw : 1);
  const char *variant = tiled ? "_tiled" : blocks ? "_blocks" : "";
  kiln__win_epi epi = {.p = p, .o = &o, .w = &wr, .shape = n->out->shape, .image = image_out};
  epi.vec = p->n > 1 && V == 4 && kiln__epilogue_fours(p, &o, &wr);
  if ((blocks || n->op == KILN__OP_COL2IM) && epi.vec && tg->window_ahead) {
    epi.hoist = true;
    epi.ring = "kiln_p";
    /* room for the rings' registers, without spills (ptxas, sm_90): the stem pool's gradient took
     * 87 a thread unbounded (two blocks an SM), 77 with three asked for; ResNet's col2im 63-64
     * unbounded and with four, 70-72 with three */
    r->min_blocks = blocks ? 3 : 4;
  }
  kiln__sb pre = {0}, b = {0};
  emit_geometry(&pre, n, &w, sz, V, kiln__wide_index(most));
  bool prologue = pro && pro->n > 0;
  unsigned grid = 0; /* set where the kernel does not take a block a partial sum */
  if (mom && n->op == KILN__OP_MAX_POOL) {
    KILN_ASSERT(p->n == 1 && V == 4 && out >= 0);
    kiln__sb_printf(&pre, "#include \"moments.cuh\"\n");
    emit_pool_moments(&b, n, out, y, mout);
  } else if (mom) { /* g the epilogue's last value (kiln__window_moments) */
    KILN_ASSERT(p->n > 1 && V == 4 && !prologue && (n->op == KILN__OP_COL2IM || blocks) &&
                mom->op == KILN__OP_MOMENTS);
    epi.mom.value = p->n - 1;
    epi.mom.x = kiln__operand(&o, mom->in[1], false, NULL);
    epi.mom.mean = kiln__operand(&o, mom->in[2], false, NULL);
    epi.mom.invstd = kiln__operand(&o, mom->in[3], false, NULL);
    epi.mom.out = mout;
    if (epi.ring) { /* dense like the output, one value a channel (kiln__window_moments) */
      o.lin[epi.mom.x] = true;
      for (int k = 0; k < 2; k++) {
        int mk = k ? epi.mom.invstd : epi.mom.mean;
        if (!o.lin[mk]) o.bcast[mk] = 'c';
      }
    }
    kiln__sb_printf(&pre, "#include \"moments.cuh\"\n");
    grid = emit_window_moments(&b, n, variant, out, y, &epi, mom, blocks ? (int)(w.sh * w.sw) : 1);
  } else {
    /* a prologue computes a tiled pool gradient's dy, or a max pool's image (the planner's
     * kiln__pool_grad_prologue and kiln__pool_fwd_prologue) */
    KILN_ASSERT(!prologue || (V == 4 && ((tiled && pool_index(n)) || n->op == KILN__OP_MAX_POOL)));
    kiln__sb_printf(&b, "  typedef G::ix ix;\n  const int V = G::V;\n");
    if (prologue) kiln__emit_prologue(&b, pro, &o, &pw, &r->arg);
    emit_loop(&b, n, variant, out, y, p->n > 1 ? &epi : NULL, prologue, NULL, NULL);
  }
  char stem[80], suffix[48];
  snprintf(suffix, sizeof suffix, "_%lldx%lld_s%lld_%s%s%s%s", (long long)w.kh, (long long)w.kw,
           (long long)w.sh, kiln_dtype_name(n->in[0]->dtype),
           V == 4   ? "_v4"
           : V == 3 ? "_v3"
           : V == 2 ? "_v2"
           : V > 4  ? "_row"
                    : "",
           variant,
           pool_index(n) ? (mom        ? "_at_moments"
                            : prologue ? "_at_pro"
                                       : "_at")
           : mom         ? "_moments"
           : prologue    ? "_pro"
                         : "");
  kiln__stem_of(p, "k", suffix, stem, sizeof stem);
  if (!kiln__finish_loop(&b, &pre, stem, &o, tg, r)) return false;
  if (mom) r->grid = grid ? grid : (unsigned)mom->out->shape[0]; /* else a block a partial sum */
  if (prologue) r->bytes_read -= kiln__footprint(o.t[0]);        /* dy: computed, never read */
  if (pool_index(n)) { /* the positions: a byte a value, written, or read instead of the values */
    if (n->op == KILN__OP_MAX_POOL)
      r->bytes_written += (uint64_t)kiln_tensor_numel(n->out);
    else
      r->bytes_read -= kiln__footprint(n->in[1]) - (uint64_t)kiln_tensor_numel(n->in[1]);
  }
  return true;
}
