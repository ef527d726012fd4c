/*
 * plan_conv.c: the planner's convolution products (plan.c's implicit phase): which convolutions
 * run their products as implicit GEMMs, the column matrix never written (fusion/render_conv.c
 * renders them): a data gradient as col2im's group (kiln__implicit_dgrad), a forward product
 * with its im2col and the weight gradient that shares the columns (kiln__implicit_conv).
 */
#include <stdlib.h>
#include <string.h>

#include "fusion.h"

/* The implicit data gradient (fusion/device/igemm.cuh) runs where a convolution's data gradient
 * is short: cuBLAS then mostly writes the column matrix (H200: the cnn workload's 73728 x 288
 * product with 64 output channels moved 75 MB in 55 us, and col2im read it back in 34 us). With
 * more output channels cuBLAS's product wins (dev/README.md). */
#ifndef KILN__IMPLICIT_MAX_CO /* a build may set it, to measure */
#define KILN__IMPLICIT_MAX_CO 64
#endif

/* Whether the data gradient of col2im node c (image gradient dX (N, H, W, CI) from dY with CO
 * channels) runs on Hopper's wgmma as the forward product of dY with the filters flipped
 * (device/conv.cuh): bf16 on sm_90, stride 1 and dilation 1 (padding at most the window less
 * one), channels in multiples of 8, and either few output channels (where it replaces the
 * mma.sync kernel) or many input channels (wide tiles: H200, air's 7x7x256->256 conv's forward
 * product took 133 us on wgmma; cuBLAS's dcols and col2im about 220 us under Nsight Compute).
 * Also wherever the TMA-fed kernel takes the shape (conv_tma.cuh; KILN_CONV_TMA=0: not). */
bool kiln__dgrad_on_wgmma(const kiln_ctx *ctx, const kiln__node *cn, kiln_dtype dt, int64_t co,
                          int64_t ci) {
  kiln__win w = kiln__win_of(cn);
  if (ctx->arch != 90 || dt != KILN_DTYPE_BF16) return false;
  if (ctx->conv_tma && kiln__conv_tma_dgrad(&w, co, ci)) return true; /* conv_tma.cuh's */
  if (ctx->conv_tma && ctx->conv_phases && kiln__dgrad_phases(cn, co)) return true;
  return w.sh == 1 && w.sw == 1 && w.dh == 1 && w.dw == 1 && w.ph <= w.kh - 1 && w.pw <= w.kw - 1 &&
         co % 8 == 0 && ci % 8 == 0 && (co <= KILN__IMPLICIT_MAX_CO || ci >= 128);
}

int64_t kiln__phase_corner(int64_t k, int64_t s, int64_t p, int64_t *most) {
  int64_t least = 0;
  *most = 0;
  for (int64_t r = 0; r < s; r++)
    for (int64_t kh = (r + p) % s; kh < k; kh += s) {
      int64_t d = (r + p - kh) / s; /* exact */
      least = d < least ? d : least;
      *most = d > *most ? d : *most;
    }
  return least;
}

int kiln__phase_taps(int64_t k, int64_t s, int64_t p, int64_t r) {
  int64_t k0 = (r + p) % s;
  return k0 < k ? (int)((k - k0 + s - 1) / s) : 0;
}

bool kiln__dgrad_phases(const kiln__node *cn, int64_t co) {
  if (cn->op != KILN__OP_COL2IM) return false;
  kiln__win w = kiln__win_of(cn);
  const kiln_tensor *X = cn->out, *C = cn->in[0];
  if (X->ndim != 4 || C->ndim != 4 || w.dh != 1 || w.dw != 1 || (w.sh == 1 && w.sw == 1) ||
      w.sh > 8 || w.sw > 8 || co % 64 != 0 || X->shape[3] % 64 != 0 ||
      X->shape[1] != C->shape[1] * w.sh || X->shape[2] != C->shape[2] * w.sw)
    return false;
  const int64_t k[2] = {w.kh, w.kw}, s[2] = {w.sh, w.sw}, p[2] = {w.ph, w.pw};
  for (int i = 0; i < 2; i++) {
    int64_t most, least = kiln__phase_corner(k[i], s[i], p[i], &most);
    if (least < -128 || most - least > 255) return false; /* corners and offsets of a copy */
  }
  return true;
}

/* Whether col2im node c and the product dcols = dY Wk whose rows it sums (read through a reshape
 * to (N, OH, OW, K)) can run as one implicit GEMM: the product has no other reader, dY (M, CO)
 * and Wk (CO, KH*KW*CI) are dense in f32 (with TF32 allowed) or bf16, one group, channel counts
 * the tiles take (mma.sync, sm_80 or newer) or the wgmma kernel takes (dgrad_on_wgmma), and
 * nothing between the two nodes writes memory in place. Returns the product's node, or -1. */
int32_t kiln__implicit_dgrad(const kiln_ctx *ctx, const kiln__plan *p, int32_t c) {
  const kiln__node *nodes = ctx->trace.nodes, *cn = &nodes[c];
  if (cn->op != KILN__OP_COL2IM || KILN__I(cn, COL2IM, groups) != 1 || ctx->arch < 80) return -1;
  int32_t r = kiln__plan_producer(ctx, p, cn->in[0]);
  if (r < 0 || nodes[r].op != KILN__OP_RESHAPE || p->readers[r - p->first] != 1 ||
      nodes[r].out->keep)
    return -1;
  int32_t mm = kiln__plan_producer(ctx, p, nodes[r].in[0]);
  if (mm < 0 || nodes[mm].op != KILN__OP_MATMUL || p->readers[mm - p->first] != 1 ||
      nodes[mm].out->keep || p->group_of[mm - p->first] >= 0 || p->claim[mm - p->first] >= 0)
    return -1;
  const kiln_tensor *A = nodes[mm].in[0], *B = nodes[mm].in[1], *D = nodes[mm].out, *X = cn->out;
  kiln_dtype dt = D->dtype;
  bool f32 = dt == KILN_DTYPE_F32 && ctx->tf32;
  int64_t vec = f32 ? 4 : 8, bk = f32 ? 16 : 32;
  if ((!f32 && dt != KILN_DTYPE_BF16) || A->dtype != dt || B->dtype != dt || X->dtype != dt ||
      A->ndim != 2 || B->ndim != 2 || !kiln__is_contiguous(A) || !kiln__is_contiguous(B) ||
      !kiln__is_contiguous(X) || A->offset % vec || B->offset % vec || X->offset % vec)
    return -1;
  int64_t co = A->shape[1], ci = X->shape[3];
  if (kiln__columns_padded(cn)) return -1;
  bool mma = co % bk == 0 && co <= KILN__IMPLICIT_MAX_CO && ci % vec == 0;
  if ((!mma && !kiln__dgrad_on_wgmma(ctx, cn, dt, co, ci)) || kiln_tensor_numel(A) >= INT32_MAX ||
      kiln_tensor_numel(X) >= INT32_MAX || kiln_tensor_numel(B) >= INT32_MAX)
    return -1;
  for (int32_t j = mm + 1; j < c; j++) /* dY and Wk keep their values until c runs */
    if (kiln__ops[nodes[j].op].kind == KILN__KIND_UPDATE || nodes[j].op == KILN__OP_ASSIGN)
      return -1;
  return mm;
}

/* The node of the flush whose output t shows through views, or -1. */
static int32_t through_views(const kiln_ctx *ctx, const kiln__plan *p, const kiln_tensor *t) {
  for (;;) {
    int32_t v = kiln__plan_producer(ctx, p, t);
    if (v < 0 || kiln__ops[ctx->trace.nodes[v].op].kind != KILN__KIND_VIEW) return v;
    t = ctx->trace.nodes[v].in[0];
  }
}

/* Whether moments node m (mode 1: g, x, mean, invstd) sums what group g computes last: g its last
 * member's value seen through views, (R, C) and dense, R C = n; x (R, C) dense, bf16 or f32, and
 * not the group's own value; mean and invstd C f32 values. */
static bool sums_group_value(const kiln_ctx *ctx, const kiln__plan *p, const kiln__group *g,
                             const kiln__node *m, int64_t C, int64_t n) {
  const kiln_tensor *gv = m->in[0], *x = m->in[1], *mean = m->in[2], *invstd = m->in[3];
  int32_t last = p->members[g->first + g->n - 1], gx = through_views(ctx, p, x);
  if (through_views(ctx, p, gv) != last || (gx >= 0 && p->group_of[gx - p->first] == g - p->g))
    return false;
  int64_t R = gv->ndim == 2 ? gv->shape[0] : 0;
  return gv->ndim == 2 && gv->shape[1] == C && R * C == n && kiln__is_contiguous(gv) &&
         kiln__is_contiguous(x) && x->ndim == 2 && x->shape[0] == R && x->shape[1] == C &&
         (x->dtype == KILN_DTYPE_BF16 || x->dtype == KILN_DTYPE_F32) &&
         mean->dtype == KILN_DTYPE_F32 && invstd->dtype == KILN_DTYPE_F32 &&
         kiln__is_contiguous(mean) && kiln__is_contiguous(invstd) && kiln_tensor_numel(mean) == C &&
         kiln_tensor_numel(invstd) == C;
}

/* Batch norm's backward sums the gradient g of its output and g xhat over each channel (a moments
 * node of mode 1: g, x, mean, invstd), in a pass of its own over g and x. Where g is what a data
 * gradient's epilogue computes (a convolution's dX times an activation's derivative at the
 * recomputed batch norm before it), the TMA kernel's staged epilogue, which holds g and has x at
 * hand, sums its block's 128 rows instead and writes the moments node's partial sums (P, 2, C),
 * P blocks of 128 rows (KILN__MOMENTS_ROWS): the pass over g and x is saved (H100, air: the six
 * moments kernels took 113 us a step). x must not be the group's own value; all dense. */
bool kiln__dgrad_moments(const kiln_ctx *ctx, const kiln__plan *p, const kiln__group *g,
                         int32_t i) {
  const kiln__node *nodes = ctx->trace.nodes, *m = &nodes[i];
  if (!ctx->conv_moments || m->op != KILN__OP_MOMENTS || KILN__I(m, MOMENTS, mode) != 1 ||
      KILN__I(m, MOMENTS, rows) != 128 || g->implicit != KILN__IMPLICIT_DGRAD || !g->wgmma ||
      g->n < 3 || ctx->arch != 90 || !ctx->conv_tma || !ctx->conv_staged)
    return false;
  const kiln__node *cn = &nodes[g->node], *mm = &nodes[p->members[g->first]];
  const kiln_tensor *X = cn->out;
  int64_t co = mm->in[0]->shape[1], ci = X->shape[3];
  kiln__win w = kiln__win_of(cn);
  /* by phases, a block's rows are one phase's: every block of 128 rows when a phase's are */
  bool phased = !kiln__conv_tma_dgrad(&w, co, ci) && ctx->conv_phases &&
                kiln__dgrad_phases(cn, co) && kiln_tensor_numel(X) / ci / (w.sh * w.sw) % 128 == 0;
  if (!(phased || kiln__conv_tma_dgrad(&w, co, ci)) || X->offset % 4 != 0)
    return false; /* not staged */
  return sums_group_value(ctx, p, g, m, ci, kiln_tensor_numel(X));
}

/* Batch norm's backward sums (a moments node of mode 1: g, x, mean, invstd) where g is what a
 * window op's elementwise epilogue computes: the gradient of ResNet's stem pool (at stride 2, a
 * block of 2x2 pixels a thread: render_window.c's blocks) or a col2im (a strided convolution's data
 * gradient on columns), times an activation's derivative at the recomputed batch norm before it.
 * The kernel holds g and reads x: a block sums g and g xhat over a slice of 64 channels of runs of
 * 128 pixels (render_window.c's emit_window_moments), its threads keeping their four channels (C /
 * 4 divides 256), and writes the moments node's partial sums, the pass of their own over g and x
 * saved. KILN_WINDOW_MOMENTS=0: not. H100, resnet18: the
 * step 7.340 ms against 7.428, four moments kernels (220 us) gone, the stem pool's gradient 75 us
 * slower and the three col2im 47 us (dev/README.md). x not the group's own value; all dense. */
bool kiln__window_moments(const kiln_ctx *ctx, const kiln__plan *p, const kiln__group *g,
                          int32_t i) {
  const kiln__node *nodes = ctx->trace.nodes, *m = &nodes[i], *op = &nodes[g->node];
  if (!ctx->window_moments || m->op != KILN__OP_MOMENTS || KILN__I(m, MOMENTS, mode) != 1 ||
      KILN__I(m, MOMENTS, rows) != 128 || g->implicit != KILN__IMPLICIT_NONE || g->prologue ||
      g->n < 2 || p->members[g->first] != g->node ||
      (op->op != KILN__OP_COL2IM && op->op != KILN__OP_MAX_POOL_GRAD))
    return false;
  const kiln_tensor *Y = op->out;
  if (Y->ndim != 4 || (op->op == KILN__OP_COL2IM && KILN__I(op, COL2IM, groups) != 1)) return false;
  const int64_t C = Y->shape[3];
  if (C % 4 != 0 || 256 % (C / 4) != 0 || Y->offset % 4 != 0) return false;
  for (int q = 0; q < op->nin; q++) /* the op's four lanes (render_window.c's lanes_of) */
    if (op->in[q]->offset % 4 != 0 || !kiln__is_contiguous(op->in[q])) return false;
  if (op->in[0]->ndim != 4 || op->in[0]->shape[3] % 4 != 0) return false;
  if (op->op == KILN__OP_MAX_POOL_GRAD) { /* render_window.c's blocks, 4 pixels a thread */
    kiln__win w = kiln__win_of(op);
    if (!ctx->pool_grad_blocks || (w.sh == w.kh && w.sw == w.kw && w.ph == 0 && w.pw == 0) ||
        w.dh != 1 || w.dw != 1 || w.sh != 2 || w.sw != 2 || Y->shape[1] % 2 != 0 ||
        Y->shape[2] % 2 != 0)
      return false;
  }
  return kiln__same_shape(nodes[p->members[g->first + g->n - 1]].out, Y) &&
         m->in[1]->offset % 4 == 0 && sums_group_value(ctx, p, g, m, C, kiln_tensor_numel(Y));
}

/* (KILN_POOL_MOMENTS=1, off until it has run on a GPU.) Batch norm's statistics after a max pool
 * (air's pooled layers) sum the pooled image x - k and
 * its square, k x's first row (a moments node of mode 0), in a pass of their own over x. The pool
 * kernel holds x as it writes it: with four channels a lane group and 256 threads a block each
 * keeping its lane group's channels (C / 4 divides 256), a block pools 128 rows and sums them,
 * every thread taking k from pooling row 0 at its channels again (render_window.c). The pool
 * alone in its group, x its output seen through views, k that view's first row. */
bool kiln__pool_moments(const kiln_ctx *ctx, const kiln__plan *p, const kiln__group *g, int32_t i) {
  const kiln__node *nodes = ctx->trace.nodes, *m = &nodes[i], *pool = &nodes[g->node];
  if (!ctx->pool_moments || m->op != KILN__OP_MOMENTS || KILN__I(m, MOMENTS, mode) != 0 ||
      KILN__I(m, MOMENTS, rows) != 128 || g->n != 1 || g->implicit != KILN__IMPLICIT_NONE ||
      pool->op != KILN__OP_MAX_POOL)
    return false;
  const kiln_tensor *Y = pool->out, *x = m->in[0], *k = m->in[1];
  int64_t C = Y->ndim == 4 ? Y->shape[3] : 0;
  bool fours = C % 4 == 0 && 256 % (C / 4) == 0 && Y->offset % 4 == 0 &&
               pool->in[0]->offset % 4 == 0 && kiln__is_contiguous(pool->in[0]);
  return fours && through_views(ctx, p, x) == g->node && through_views(ctx, p, k) == g->node &&
         x->ndim == 2 && x->shape[1] == C && x->shape[0] * C == kiln_tensor_numel(Y) &&
         kiln__is_contiguous(x) && x->offset == Y->offset && k->ndim == 2 && k->shape[0] == 1 &&
         k->shape[1] == C && k->offset == Y->offset && k->stride[1] == 1;
}

/* (KILN_POOL_PROLOGUE=0 turns it off.) A max pool's gradient over windows that tile the image
 * (stride = window, no padding or dilation), from the positions its forward pass wrote, reads each
 * value of dy once, where the elementwise run before it wrote it: batch norm's dx after air's
 * pooled layers (its per-channel terms, and the cast to bf16). That run can be the gradient's
 * prologue, dy computed where it is read and never written (kiln__prologue_run: each of its values
 * read only inside the run, the last only by the gradient, its inputs from outside dense like dy,
 * one value a channel or one in all, float, no op reading coordinates, four channels a lane
 * group). */
bool kiln__pool_grad_prologue(const kiln_ctx *ctx, const kiln__plan *p, const kiln__group *g,
                              int32_t i) {
  const kiln__node *nodes = ctx->trace.nodes, *pg = &nodes[i];
  if (!ctx->pool_prologue || pg->op != KILN__OP_MAX_POOL_GRAD ||
      !KILN__I(pg, MAX_POOL_GRAD, index) || g->kind != KILN__KIND_EW || g->n < 1)
    return false;
  kiln__win w = kiln__win_of(pg);
  return w.sh == w.kh && w.sw == w.kw && !w.ph && !w.pw && w.dh == 1 && w.dw == 1 &&
         nodes[p->members[g->first + g->n - 1]].out == pg->in[0] && pg->out->offset % 4 == 0 &&
         pg->in[1]->offset % 4 == 0 && kiln__prologue_run(ctx, p, g);
}

/* (KILN_POOL_FWD_PROLOGUE=0 turns it off.) A max pool reads each value of its image up to
 * (KH / SH) (KW / SW) times, rounded up: ResNet's stem pool (3x3 at stride 2) about 2.25 times,
 * after the elementwise run that wrote the image: batch norm's application and the ReLU. That run
 * can be the pool's prologue, the image computed where it is read and never written
 * (kiln__prologue_run's conditions, the image's channels four a lane group): the run's write and
 * the pool's read of the image become one read of the run's input. */
bool kiln__pool_fwd_prologue(const kiln_ctx *ctx, const kiln__plan *p, const kiln__group *g,
                             int32_t i) {
  const kiln__node *nodes = ctx->trace.nodes, *pool = &nodes[i];
  if (!ctx->pool_fwd_prologue || pool->op != KILN__OP_MAX_POOL || g->kind != KILN__KIND_EW ||
      g->n < 1)
    return false;
  const kiln_tensor *x = pool->in[0];
  return nodes[p->members[g->first + g->n - 1]].out == x && x->ndim == 4 &&
         pool->out->offset % 4 == 0 && kiln__prologue_run(ctx, p, g);
}

bool kiln__rule_reads_input(const kiln__node *nd, int q) {
  unsigned saves = nd->out && nd->out->requires_grad ? kiln__ops[nd->op].saves : 0;
  return (saves & (1u << q)) && !(q == 0 && kiln__recomputes_input(nd)); /* else from its inputs */
}

bool kiln__prologue_run(const kiln_ctx *ctx, const kiln__plan *p, const kiln__group *g) {
  const kiln__node *nodes = ctx->trace.nodes;
  if (g->kind != KILN__KIND_EW || g->full || g->batch || g->n < 1 || g->n >= KILN__MAX_GROUP)
    return false;
  int32_t last = p->members[g->first + g->n - 1];
  const kiln_tensor *dy = nodes[last].out;
  int64_t C = dy->ndim >= 1 ? dy->shape[dy->ndim - 1] : 0;
  if (C % 4 != 0 || dy->keep || dy->offset % 4 != 0 || !kiln__is_contiguous(dy)) return false;
  int32_t gi = (int32_t)(g - p->g);
  for (int m = 0; m < g->n; m++) {
    int32_t j = p->members[g->first + m];
    const kiln__node *nd = &nodes[j];
    if (strstr(kiln__ops[nd->op].expr, "$c") || nd->out->keep || !kiln__same_shape(nd->out, dy))
      return false;
    int inside = j == last; /* the one reader outside the run reads the last */
    for (int q = m + 1; q < g->n; q++)
      for (int k = 0; k < nodes[p->members[g->first + q]].nin; k++)
        inside += nodes[p->members[g->first + q]].in[k] == nd->out;
    if (p->readers[j - p->first] != inside) return false;
    /* nor kept for a backward pass recorded later (plan.c's stores): a forward run's own rule
     * reading its output (a ReLU's not recomputed from a batch norm's) or an input from the run */
    if (kiln__keeps_output(nd)) return false;
    for (int k = 0; k < nd->nin; k++) {
      const kiln_tensor *x = nd->in[k];
      int32_t from = kiln__plan_producer(ctx, p, x);
      if (from >= 0 && p->group_of[from - p->first] == gi) { /* a value of the run */
        if (kiln__rule_reads_input(nd, k)) return false;
        continue;
      }
      int32_t seen = through_views(ctx, p, x);
      if (seen >= 0 && p->group_of[seen - p->first] == gi) return false; /* a view of one */
      int64_t n = kiln_tensor_numel(x);
      bool dense = kiln__same_shape(x, dy) && kiln__is_contiguous(x) && x->offset % 4 == 0;
      bool channel =
          n == C && x->shape[x->ndim - 1] == C && kiln__is_contiguous(x) && x->offset % 4 == 0;
      if (!kiln__is_float(x->dtype) || !(dense || channel || n == 1)) return false;
    }
  }
  return true;
}

/* The implicit forward product and weight gradient (fusion/device/conv.cuh, wgmma: bf16 on
 * sm_90) replace im2col and the two products that read its columns where the columns are large
 * against the products: few output channels. H200, batch 1024 (dev/README.md): air's 31x31x24->64
 * conv took 140 us for im2col, 155 for cuBLAS's forward product and 134 for its weight gradient,
 * against 235 + 211 us implicit, and its 425 MB of columns were kept from the forward pass to the
 * backward; with 256 output channels cuBLAS's products ran at 620-700 TFLOP/s, the implicit ones
 * at 300-450, and im2col stays. */
/* (The most output channels they take: kiln__implicit_conv_max_co, core/conv.c.) */

/* Whether t is dense bf16, its first element 16-byte aligned, with fewer than 2^31 elements. */
static bool dense_bf16(const kiln_tensor *t) {
  return t->dtype == KILN_DTYPE_BF16 && kiln__is_contiguous(t) && t->offset % 8 == 0 &&
         kiln_tensor_numel(t) < INT32_MAX;
}

/* The im2col node of the flush whose columns x shows through views, or -1. */
static int32_t columns_of(const kiln_ctx *ctx, const kiln__plan *p, const kiln_tensor *x) {
  int32_t v = through_views(ctx, p, x);
  return v >= 0 && ctx->trace.nodes[v].op == KILN__OP_IM2COL ? v : -1;
}

/* Whether the weight gradient w = dY^T cols of im2col node c (image X) can gather its columns
 * from X: dY^T (CO, M) the transpose of a dense bf16 dY, the result (CO, K) dense bf16 and not
 * written through, and no update or assignment between c and w writes X's memory. */
static bool implicit_wgrad(const kiln_ctx *ctx, const kiln__plan *p, int32_t c, int32_t w,
                           int64_t co) {
  const kiln__node *nodes = ctx->trace.nodes, *wn = &nodes[w];
  const kiln_tensor *X = nodes[c].in[0], *dyt = wn->in[0], *d = wn->out;
  if (dyt->dtype != KILN_DTYPE_BF16 || dyt->ndim != 2 || dyt->shape[0] != co ||
      dyt->stride[0] != 1 || dyt->stride[1] != co || dyt->offset % 8 != 0 ||
      kiln_tensor_numel(dyt) >= INT32_MAX || !dense_bf16(d) || p->claim[w - p->first] >= 0 ||
      p->write_to[w - p->first])
    return false;
  for (int32_t j = c + 1; j < w; j++) {
    kiln__kind kind = kiln__ops[nodes[j].op].kind;
    if (kind != KILN__KIND_UPDATE && nodes[j].op != KILN__OP_ASSIGN) continue;
    for (int q = 0; q < nodes[j].nin; q++)
      if (nodes[j].in[q]->st == X->st) return false;
  }
  return true;
}

/* Whether im2col node c and the products that read its columns can run as implicit GEMMs: one
 * group, X dense bf16 with channels in 16-byte chunks, an sm_90 device, and the columns (as the
 * rows (M, K) of a reshape) read by exactly one forward product cols Wk^T (Wk (CO, K) dense: the
 * product's operand its transpose; the caller asks that it takes no forward epilogue), as its
 * first operand, and at most
 * one weight gradient dY^T cols, as its second, which must be in the flush when the forward
 * product's result takes a gradient (the columns exist nowhere after it). Sets *f and *w (-1:
 * none). */
bool kiln__implicit_conv(kiln_ctx *ctx, const kiln__plan *p, int32_t c, int32_t *f, int32_t *w) {
  const kiln__node *nodes = ctx->trace.nodes, *cn = &nodes[c];
  *f = *w = -1;
  if (cn->op != KILN__OP_IM2COL ||
      !(kiln__implicit_conv_image(ctx, cn) || kiln__conv_direct_image(ctx, cn)) || cn->out->keep ||
      !dense_bf16(cn->in[0]) || p->claim[c - p->first] >= 0)
    return false;
  bool direct = !kiln__implicit_conv_image(ctx, cn); /* forward only: no columns for a dW */
  int64_t K = cn->out->shape[3], M = kiln_tensor_numel(cn->out) / K;
  for (int32_t j = c + 1; j < p->last; j++) {
    const kiln__node *r = &nodes[j];
    if (kiln__ops[r->op].kind == KILN__KIND_VIEW) { /* a view of the columns the host reads */
      if (r->out->keep && columns_of(ctx, p, r->in[0]) == c) return false;
      continue;
    }
    for (int q = 0; q < r->nin; q++) {
      if (columns_of(ctx, p, r->in[q]) != c) continue;
      const kiln_tensor *a = r->in[q];
      if (r->op != KILN__OP_MATMUL || a->ndim != 2 || a->shape[0] != M || a->shape[1] != K ||
          a->stride[0] != K || a->stride[1] != 1)
        return false;
      int32_t *slot = q == 0 ? f : w;
      if (*slot >= 0) return false;
      *slot = j;
    }
  }
  if (*f < 0) { /* columns gathered again for a weight gradient alone (core/conv.c's image_again) */
    int64_t co = *w >= 0 ? nodes[*w].in[0]->shape[0] : 0;
    return !direct && *w >= 0 && K * co < INT32_MAX && kiln__implicit_conv_channels(ctx, cn, co) &&
           implicit_wgrad(ctx, p, c, *w, co);
  }
  const kiln__node *fn = &nodes[*f];
  const kiln_tensor *B = fn->in[1], *Y = fn->out;
  int64_t co = Y->shape[1];
  if (!dense_bf16(Y) || B->dtype != KILN_DTYPE_BF16 || B->stride[0] != 1 || B->stride[1] != K ||
      B->offset % 8 != 0 || K * co >= INT32_MAX ||
      !(direct ? kiln__conv_direct_shape(K, cn->in[0]->shape[3], co)
               : kiln__implicit_conv_channels(ctx, cn, co)) ||
      p->claim[*f - p->first] >= 0)
    return false;
  if (direct) return *w < 0 && !Y->requires_grad;
  if (*w >= 0 && !implicit_wgrad(ctx, p, c, *w, co)) return false;
  return *w >= 0 || !Y->requires_grad || kiln__gathers_again(cn);
}

bool kiln__implicit_fprop(const kiln_ctx *ctx, const kiln__plan *p, int32_t i) {
  int32_t c = p->window[i - p->first];
  return c >= 0 && columns_of(ctx, p, ctx->trace.nodes[i].in[0]) == c;
}

/* The one node of the flush after i that reads node i's output, if i has one reader and is not
 * kept; else -1. */
static int32_t sole_reader(const kiln_ctx *ctx, const kiln__plan *p, int32_t i) {
  const kiln__node *nodes = ctx->trace.nodes;
  if (p->readers[i - p->first] != 1 || nodes[i].out->keep) return -1;
  for (int32_t j = i + 1; j < p->last; j++)
    for (int q = 0; q < nodes[j].nin; q++)
      if (nodes[j].in[q] == nodes[i].out) return j;
  return -1;
}

/* The first node that is no view reached from node i through sole readers (views between), or
 * -1. */
static int32_t sole_use(const kiln_ctx *ctx, const kiln__plan *p, int32_t i) {
  int32_t j = sole_reader(ctx, p, i);
  while (j >= 0 && kiln__ops[ctx->trace.nodes[j].op].kind == KILN__KIND_VIEW)
    j = sole_reader(ctx, p, j);
  return j;
}

/* (KILN_CONV_WGRAD_INTO=1; off: slower on the H200, its scattered stores.) An implicit weight
 * gradient w, whose
 * bf16 result D (CO, K) kiln_conv2d's autocast rules turn into the weight's f32 gradient (D seen
 * permuted as the weight's (CO, CI, KH, KW), cast to f32 and assigned to its gradient buffer G;
 * or, in a trace of before the cast's gradient rule read permuted views, D seen as (CO, KH, KW,
 * CI), cast, and that seen permuted assigned), can store that itself: each value rounded to bf16
 * as D's store does, widened, and written at its place in G, the cast and the assignment members
 * of its group (D never written). The views between are checked by what they show (storage,
 * offset, shape and strides), each value has that one reader, G is dense f32, and no node of the
 * flush before the assignment reads or writes G (the group writes it at w's place in the flush).
 * Sets *cast and *assign; where the cast was to write through to G, the caller takes that back. */
static bool shows(const kiln_tensor *t, const int64_t shape[4], const int64_t stride[4]) {
  if (t->ndim != 4) return false;
  for (int d = 0; d < 4; d++)
    if (t->shape[d] != shape[d] || (t->stride[d] != stride[d] && shape[d] != 1))
      return false; /* any stride along 1 */
  return true;
}

bool kiln__wgrad_into_grad(const kiln_ctx *ctx, const kiln__plan *p, int32_t w, int32_t *cast,
                           int32_t *assign) {
  const kiln__node *nodes = ctx->trace.nodes;
  *cast = *assign = -1;
  int32_t c = p->window[w - p->first];
  if (!ctx->conv_wgrad_into || c < 0) return false;
  kiln__win win = kiln__win_of(&nodes[c]);
  const kiln_tensor *X = nodes[c].in[0], *D = nodes[w].out;
  int64_t CO = D->shape[0], CI = X->shape[3];
  int32_t cv = sole_use(ctx, p, w), a = cv >= 0 ? sole_use(ctx, p, cv) : -1;
  /* the assignment may have been given to the cast to write through (a 1x1 window: the permuted
   * view shows the cast's bytes in their order), which the group then takes over */
  if (a < 0 || nodes[cv].op != KILN__OP_CAST || nodes[a].op != KILN__OP_ASSIGN ||
      p->group_of[cv - p->first] >= 0 || p->group_of[a - p->first] >= 0 ||
      p->claim[cv - p->first] >= 0 ||
      (p->claim[a - p->first] >= 0 &&
       (p->claim[a - p->first] != cv || p->write_to[cv - p->first] != nodes[a].in[0])))
    return false;
  /* the cast reads D's bytes as (CO, KH, KW, CI); the assignment its result as (CO, CI, KH, KW) */
  const kiln_tensor *R = nodes[cv].in[0], *F = nodes[cv].out, *T = nodes[a].in[1],
                    *G = nodes[a].in[0];
  const int64_t r[4] = {CO, win.kh, win.kw, CI}, g[4] = {CO, CI, win.kh, win.kw};
  /* dense strides over r and over g; r's seen permuted as g */
  const int64_t rs[4] = {win.kh * win.kw * CI, win.kw * CI, CI, 1},
                gs[4] = {CI * win.kh * win.kw, win.kh * win.kw, win.kw, 1},
                ps[4] = {rs[0], rs[3], rs[1], rs[2]};
  bool shapes = R->st == D->st && R->offset == D->offset && kiln__is_contiguous(D) &&
                F->dtype == KILN_DTYPE_F32 && F->offset == 0 && T->st == F->st && T->offset == 0 &&
                G->dtype == KILN_DTYPE_F32 && G->persistent && shows(G, g, gs) && G->offset == 0 &&
                ((shows(R, g, ps) && shows(F, g, gs) && shows(T, g, gs)) ||
                 (shows(R, r, rs) && shows(F, r, rs) && shows(T, g, ps)));
  if (!shapes) return false;
  /* G keeps its old value until the assignment: nothing of the flush before it reads or writes
   * G (a reader before w could otherwise be moved after it, by the sink phase) */
  for (int32_t j = p->first; j < a; j++)
    for (int q = 0; q < nodes[j].nin; q++)
      if (nodes[j].in[q]->st == G->st && kiln__ops[nodes[j].op].kind != KILN__KIND_VIEW)
        return false;
  *cast = cv;
  *assign = a;
  return true;
}

/* Whether op's expression reads its one input ($0) and nothing else: no attribute, coordinate
 * or index. */
static bool reads_only_its_input(kiln__op op) {
  int nf, ni, nu;
  kiln__kernel_slots(op, &nf, &ni, &nu);
  if (nf || ni || nu || kiln__ops[op].nin != 1 || kiln__ops[op].kind != KILN__KIND_EW) return false;
  for (const char *e = kiln__ops[op].expr; (e = strchr(e, '$')) != NULL; e++)
    if (e[1] != '0') return false;
  return true;
}

int kiln__direct_epilogue(const kiln_ctx *ctx, const kiln__plan *p, const kiln__group *g,
                          int32_t *take, int most) {
  const kiln__node *nodes = ctx->trace.nodes;
  if (!ctx->conv_direct_epi || g->implicit != KILN__IMPLICIT_FPROP || g->window < 0 ||
      kiln__implicit_conv_image(ctx, &nodes[g->window]))
    return 0; /* not the direct kernel */
  const kiln_tensor *Y = nodes[g->node].out, *prev = NULL;
  int n = 0;
  for (int32_t i = g->node; n < most;) {
    int32_t j = n == 0 ? sole_use(ctx, p, i) : sole_reader(ctx, p, i);
    if (j < 0 || !reads_only_its_input(nodes[j].op) || p->group_of[j - p->first] >= 0 ||
        p->claim[j - p->first] >= 0 || p->write_to[j - p->first] ||
        !kiln__is_float(nodes[j].out->dtype))
      break;
    const kiln_tensor *in = nodes[j].in[0];
    bool image = n == 0 ? in->st == Y->st && in->offset == Y->offset && kiln__is_contiguous(in) &&
                              kiln_tensor_numel(in) == kiln_tensor_numel(Y)
                        : in == prev;
    if (!image || !kiln__same_shape(nodes[j].out, in)) break;
    take[n++] = j;
    prev = nodes[j].out;
    i = j;
  }
  while (n > 0 && nodes[take[n - 1]].out->dtype != KILN_DTYPE_BF16) /* the kernel stores bf16 */
    n--;
  return n;
}

int kiln__conv_pool_rows(int64_t ow) {
  int b = 8;
  while (b < 64 && b < ow / 2 * 2)
    b *= 2;
  return ow >= 2 && ow / 2 * 2 <= b ? b : 0;
}

/* (KILN_CONV_FPROP_MOMENTS=0 turns it off.) Batch norm after a convolution reads
 * the product's image once for its statistics (k_moments_shifted: 20 launches, 252 us of
 * resnet18's step on the H100) and once more to apply them. The TMA-fed forward product's kernel
 * holds its block's 128 rows as it stores them: it sums them there, through the staged tile
 * (conv_tma.cuh's kiln_tma_store_tile_moments), and writes the moments node's partial sums (P, 2,
 * C), P blocks of 128 rows, which needs the shift k before the product runs: batch norm then takes
 * its running mean for k (core/conv.c), not the image's first row. The halo-tile product
 * (ResNet's stem) sums every tile a persistent block stores into a partial of its own, the
 * others zero (conv_few.cuh's kiln_few_moments). */
int32_t kiln__fprop_moments(const kiln_ctx *ctx, const kiln__plan *p, const kiln__group *g) {
  const kiln__node *nodes = ctx->trace.nodes;
  if (!ctx->fprop_moments || g->implicit != KILN__IMPLICIT_FPROP || g->window < 0 || g->n != 2 ||
      ctx->arch != 90)
    return -1;
  const kiln__node *cn = &nodes[g->window];
  const kiln_tensor *X = cn->in[0], *Y = nodes[g->node].out;
  kiln__win w = kiln__win_of(cn);
  int64_t ci = X->shape[3], co = Y->ndim == 2 ? Y->shape[1] : 0;
  /* render_conv.c's TMA-fed product, or the halo-tile one (conv_few.cuh's kiln_few_moments); not
   * the direct one */
  bool few = ctx->conv_few && kiln__conv_few_shape(&w, ci, co);
  if (kiln__conv_direct_shape(cn->out->shape[3], ci, co) ||
      !(few || (ctx->conv_tma && kiln__conv_tma_window(&w, ci))) || co % 4 != 0 || !dense_bf16(Y))
    return -1;
  for (int32_t j = g->node + 1; j < p->last; j++) { /* its first reader that is a moments node */
    const kiln__node *m = &nodes[j];
    if (m->op != KILN__OP_MOMENTS || through_views(ctx, p, m->in[0]) != g->node) continue;
    const kiln_tensor *x = m->in[0], *k = m->in[1];
    int32_t kp = through_views(ctx, p, k);
    bool sums = KILN__I(m, MOMENTS, mode) == 0 && KILN__I(m, MOMENTS, rows) == 128 &&
                x->ndim == 2 && x->shape[1] == co && kiln_tensor_numel(x) == kiln_tensor_numel(Y) &&
                x->st == Y->st && x->offset == Y->offset && kiln__is_contiguous(x);
    bool shift = k->dtype == KILN_DTYPE_F32 && kiln__is_contiguous(k) &&
                 kiln_tensor_numel(k) == co && k->offset % 4 == 0 && k->st != Y->st &&
                 (kp < 0 || kp < g->node);
    for (int32_t q = g->node + 1; q < j && shift; q++) /* read at the product's place: unchanged */
      shift = !kiln__node_stores_into(&nodes[q], k->st);
    return sums && shift && p->group_of[j - p->first] < 0 && p->claim[j - p->first] < 0 ? j : -1;
  }
  return -1;
}

int32_t kiln__conv_pool(const kiln_ctx *ctx, const kiln__plan *p, const kiln__group *g) {
  const kiln__node *nodes = ctx->trace.nodes;
  if (g->implicit != KILN__IMPLICIT_FPROP || g->window < 0 || g->n != 2) return -1;
  const kiln__node *cn = &nodes[g->window];
  const kiln_tensor *X = cn->in[0], *C = cn->out, *Y = nodes[g->node].out;
  kiln__win w = kiln__win_of(cn);
  int64_t ci = X->shape[3], co = Y->shape[1];
  /* the kernel render_conv.c gives the product: conv_few.cuh's (not the direct one), or the
   * TMA-fed one, whose tile then takes pairs of whole rows */
  if (kiln__conv_direct_shape(C->shape[3], ci, co)) return -1;
  bool few = ctx->conv_few && kiln__conv_few_shape(&w, ci, co);
  if (few ? !ctx->conv_few_pool
          : !ctx->conv_tma_pool || !ctx->conv_tma || !kiln__conv_tma_window(&w, ci) ||
                kiln__conv_pool_rows(C->shape[2]) == 0 || co % 8 != 0)
    return -1;
  int32_t j = sole_use(ctx, p, g->node);
  if (j < 0 || nodes[j].op != KILN__OP_MAX_POOL || p->group_of[j - p->first] >= 0 ||
      p->claim[j - p->first] >= 0 || p->write_to[j - p->first])
    return -1;
  const kiln_tensor *in = nodes[j].in[0], *out = nodes[j].out;
  kiln__win pw = kiln__win_of(&nodes[j]);
  const int64_t image[4] = {C->shape[0], C->shape[1], C->shape[2], co};
  bool seen = in->st == Y->st && in->offset == Y->offset && in->ndim == 4 &&
              kiln__is_contiguous(in) && memcmp(in->shape, image, sizeof image) == 0;
  /* 2x2 windows at stride 2 tile the tiles (TH and TW even; pairs of rows), the pixels past them
   * dropped */
  bool windows = pw.kh == 2 && pw.kw == 2 && pw.sh == 2 && pw.sw == 2 && pw.ph == 0 && pw.pw == 0 &&
                 pw.dh == 1 && pw.dw == 1;
  return seen && windows && dense_bf16(out) ? j : -1;
}
