/*
 * render_window.c: the sliding-window family over images (N, H, W, C): im2col, col2im, max and
 * average pooling and their gradients, each optionally followed by an elementwise epilogue
 * computed per lane of the op's result.
 */
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "render.h"

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
  const char *t = kiln__ctype(dt);
  if (V == 4)
    kiln__sb_printf(b, "    kiln_store4(&((%s *)a.ptr[%d])[e * 4], %s);\n", t, out, name);
  else
    kiln__sb_printf(b, "    ((%s *)a.ptr[%d])[e] = (%s)%s[0];\n", t, out, t, name);
}

/* The memory types of a window op's operands: its inputs' and its output's. */
typedef struct win_types {
  const char *in0, *in1, *out;
  kiln_dtype out_dt;
} win_types;

/* Writes float name[V], the window op's lanes: to operand out, or through the epilogue e. */
void kiln__store_lanes(kiln__sb *b, const char *name, int out, kiln_dtype dt, int V,
                       const kiln__win_epi *e) {
  if (!e) {
    emit_lanes_store(b, name, out, dt, V);
    return;
  }
  const kiln__operands *o = e->o;
  const kiln__wiring *w = e->w;
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
                        k, kiln__ctype(o->t[k]->dtype), k, k);
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
      if (j > 0) kiln__emit_node_value(b, "        ", w, j, e->p->nodes[j]);
      if (w->store_slot[j] >= 0)
        kiln__sb_printf(b, "        S%d[l] = (float)v%d;\n", w->store_slot[j], j);
    }
    kiln__sb_printf(b, "      }\n");
    for (int k = 0; k < o->n; k++)
      if (o->store[k])
        kiln__sb_printf(b, "      kiln_store4((%s *)a.ptr[%d] + i0, S%d);\n",
                        kiln__ctype(o->t[k]->dtype), k, k);
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
    kiln__sb_printf(b, "      const %s x%d = ((const %s *)a.ptr[%d])[", kiln__rtype(o->t[k]->dtype),
                    k, kiln__ctype(o->t[k]->dtype), k);
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
                        const win_types *ty, const kiln__win_epi *epi) {
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
    kiln__store_lanes(b, "y", out, odt, V, epi);
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
    kiln__store_lanes(b, "acc", out, odt, V, epi);
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
    kiln__store_lanes(b, "best", out, odt, V, epi);
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
        kiln__store_lanes(b, "d", out, odt, V, epi);
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
    kiln__store_lanes(b, "acc", out, odt, V, epi);
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
    kiln__store_lanes(b, "acc", out, odt, V, epi);
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
    kiln__store_lanes(b, "acc", out, odt, V, epi);
    break;
  default: KILN_ASSERT(!"window_body: not a window op");
  }
  kiln__sb_printf(b, "  }\n");
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
    kiln__align_strides(o->t[k], 4, n->out->shape, r->arg.args.st[k]);
    o->lin[k] = kiln__dense(o->t[k], kiln_tensor_numel(n->out)); /* the epilogue indexes it by i */
  }
  return -1;
}

/* A window op, alone (p->n == 1) or with the elementwise nodes that follow it in its group as an
 * epilogue computed per lane (p->nodes[0] is the op). */
bool kiln__render_window(const kiln__target *tg, const kiln__ew_prog *p, kiln__rendered *r) {
  const kiln__node *n = p->nodes[0];
  bool image_out = n->op == KILN__OP_COL2IM || n->op == KILN__OP_MAX_POOL_GRAD ||
                   n->op == KILN__OP_AVG_POOL_GRAD;
  const kiln_tensor *img = image_out ? n->out : n->in[0], *win = image_out ? n->in[0] : n->out;
  kiln__kargs *a = &r->arg.args;
  kiln__operands o = {0};
  kiln__wiring wr;
  for (int q = 0; q < n->nin; q++)
    KILN_ASSERT(kiln__is_contiguous(n->in[q]) && kiln__is_float(n->in[q]->dtype));
  win_types ty = {.in0 = kiln__ctype(n->in[0]->dtype),
                  .in1 = kiln__ctype(n->in[n->nin > 1]->dtype),
                  .out = kiln__ctype(n->out->dtype),
                  .out_dt = n->out->dtype};
  int out = kiln__window_operands(p, &o, &wr, r);
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
    uint64_t elems = kiln__footprint(o.t[k]) / kiln_dtype_size(o.t[k]->dtype);
    if (elems > (uint64_t)most) most = (int64_t)elems;
  }
  bool wide = kiln__wide_index(most);
  kiln__win w = kiln__win_of(n);
  /* max pooling's gradient over windows that tile the image (no overlap, padding or dilation;
   * the pixels past the last window are zeros): a thread per window finds its maximum once */
  bool tiled = n->op == KILN__OP_MAX_POOL_GRAD && w.sh == w.kh && w.sw == w.kw && w.ph == 0 &&
               w.pw == 0 && w.dh == 1 && w.dw == 1;
  a->n = kiln_tensor_numel(tiled ? win : n->out) / V;
  kiln__win_epi epi = {.p = p, .o = &o, .w = &wr, .shape = n->out->shape, .image = image_out};
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
  kiln__stem_of(p, "k", suffix, stem, sizeof stem);
  bool ok = kiln__finish(&b, stem, &o, r);
  kiln__sb_free(&b);
  r->block = KILN__BLOCK;
  r->grid = kiln__grid_for(tg, a->n);
  kiln__tally_bytes(&o, r);
  return ok;
}
