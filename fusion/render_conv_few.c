/*
 * render_conv_few.c: the convolution products that render_conv.c's TMA-fed and wgmma kernels
 * leave to kernels of their own: a tiny convolution's forward product without tensor cores
 * (fusion/device/conv_direct.cuh), and the forward product and weight gradient of a convolution
 * with few input channels into 64 from a halo tile of the image (fusion/device/conv_few.cuh,
 * mma.sync; kiln__conv_few_shape, unless KILN_CONV_FEW=0). render_conv.c's kiln__render_conv
 * calls them; with the helpers that every convolution kernel takes its operands and name through
 * (kiln__conv_operands, kiln__finish_conv), here so that render_conv.c alone calls the other.
 */
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "render.h"

/* Every convolution kernel's operands and name (render.h), render_conv.c's too. */
void kiln__conv_operands(const kiln__node *n, const kiln_tensor *t, const kiln_tensor *out,
                         int64_t co, const char *header, kiln__operands *o, int slot[3], char *pre,
                         size_t len) {
  const kiln_tensor *X = n->in[0], *C = n->out;
  slot[0] = kiln__operand(o, X, false, NULL);
  slot[1] = kiln__operand(o, t, false, NULL);
  slot[2] = kiln__operand(o, out, true, NULL);
  kiln__win w = kiln__win_of(n);
  snprintf(
      pre, len,
      "#include \"%s\"\n"
      "struct G { /* the convolution's geometry */\n"
      "  static constexpr int N = %lld, H = %lld, W = %lld, CI = %lld, OH = %lld, OW = %lld, "
      "CO = %lld;\n"
      "  static constexpr int KH = %lld, KW = %lld, SH = %lld, SW = %lld, PH = %lld, PW = %lld, "
      "DH = %lld, DW = %lld;\n"
      "  static constexpr int M = N * OH * OW, K = KH * KW * CI;\n"
      "};\n",
      header, (long long)X->shape[0], (long long)X->shape[1], (long long)X->shape[2],
      (long long)X->shape[3], (long long)C->shape[1], (long long)C->shape[2], (long long)co,
      (long long)w.kh, (long long)w.kw, (long long)w.sh, (long long)w.sw, (long long)w.ph,
      (long long)w.pw, (long long)w.dh, (long long)w.dw);
}

bool kiln__finish_conv(kiln__sb *b, const char *stem, const kiln__operands *o, kiln__rendered *r,
                       const char *pre) {
  bool ok = kiln__finish_with(b, stem, o, r, pre);
  kiln__sb_free(b);
  kiln__tally_bytes(o, r);
  return ok;
}

/* The forward product of a tiny convolution (kiln__conv_direct_shape) without the column matrix
 * or tensor cores: conv_direct.cuh, a thread an output pixel, 256 a block; with epi (n > 0, the
 * unary chain of kiln__direct_epilogue) each value goes through epi's nodes before the store,
 * rounded as each of their stores would round it, and epi's last value is stored. */
bool kiln__render_conv_direct(const kiln__node *n, const kiln__gemm *mm, const kiln__ew_prog *epi,
                              kiln__rendered *r) {
  const kiln_tensor *Y = mm->d, *out = epi->n ? epi->nodes[epi->n - 1]->out : Y;
  int64_t M = Y->shape[0], CO = Y->shape[1];
  KILN_ASSERT(out->dtype == KILN_DTYPE_BF16 && kiln_tensor_numel(out) == M * CO);
  kiln__operands o = {0};
  int slot[3];
  char geometry[640];
  kiln__conv_operands(n, mm->b, out, CO, "conv_direct.cuh", &o, slot, geometry, sizeof geometry);
  kiln__sb pre = {0};
  kiln__sb_printf(&pre, "%s", geometry);
  if (epi->n) {
    kiln__sb_printf(&pre, "struct kiln_epi { /* the elementwise nodes after the product */\n"
                          "  static constexpr bool on = true;\n"
                          "  __device__ __forceinline__ float operator()(float v0) const {\n");
    kiln__wiring w; /* the product's value is v0, epi's node j - 1 makes vj from v(j - 1) */
    memset(&w, 0, sizeof w);
    for (int j = 1; j <= epi->n; j++) {
      w.val[j][0] = j - 1;
      kiln__emit_node_value(&pre, "    ", &w, j, epi->nodes[j - 1]);
    }
    kiln__sb_printf(&pre, "    return v%d;\n  }\n};\n", epi->n);
  }
  kiln__sb b = {0};
  kiln__sb_printf(
      &b,
      "  kiln_conv_direct<G%s>((const kiln_bf16 *)a.ptr[%d], (const kiln_bf16 *)a.ptr[%d], "
      "(kiln_bf16 *)a.ptr[%d]);\n",
      epi->n ? ", kiln_epi" : "", slot[0], slot[1], slot[2]);
  kiln__win w = kiln__win_of(n);
  char stem[80], suffix[48];
  snprintf(suffix, sizeof suffix, "_%lldx%lld_s%lld_bf16", (long long)w.kh, (long long)w.kw,
           (long long)w.sh);
  kiln__stem_of(epi, "k_conv_direct", suffix, stem, sizeof stem);
  r->block = KILN__BLOCK;
  r->arg.args.n = M;
  bool ok = !pre.oom && kiln__finish_with(&b, stem, &o, r, pre.s);
  kiln__sb_free(&pre);
  kiln__sb_free(&b);
  r->grid = (unsigned)((M + KILN__BLOCK - 1) / KILN__BLOCK);
  kiln__tally_bytes(&o, r);
  return ok;
}

/* A conv_few.cuh kernel's tiles over im2col node n's output (TH x TW pixels: 4 x 32, or 8 x 16
 * where those cover fewer pixels past the output's edges: 15 wide, or ResNet's stem, 112), their
 * count, its halo's 16-byte chunks (kiln_few::HALO, a pixel's padded to an odd count), and the
 * grid of persistent blocks (two an SM, at most one a tile). */
typedef struct {
  int th, tw;
  int64_t tiles, halo, grid;
} few_tiling;

static few_tiling few_tiles(const kiln__target *t, const kiln__node *n) {
  const kiln_tensor *X = n->in[0], *C = n->out;
  const kiln__win w = kiln__win_of(n);
  const int64_t oh = C->shape[1], ow = C->shape[2];
  /* tiles a 4 x 32 tiling takes against an 8 x 16 one; the same pixels: 4 x 32 (airbench's 31) */
  const int64_t wide = ((oh + 3) / 4) * ((ow + 31) / 32), tall = ((oh + 7) / 8) * ((ow + 15) / 16);
  few_tiling f = {.tw = wide <= tall ? 32 : 16};
  f.th = 128 / f.tw;
  f.tiles = X->shape[0] * (f.tw == 32 ? wide : tall);
  f.halo = (f.th + w.kh - 1) * (f.tw + w.kw - 1) * ((X->shape[3] / 8) | 1);
  const int64_t most = 2 * (int64_t)(t->num_sms > 0 ? t->num_sms : 132);
  f.grid = f.tiles < most ? f.tiles : most;
  return f;
}

/* Names, wraps and launches a conv_few.cuh kernel: 256 threads a block and two blocks an SM
 * (the launch bounds' least), smem bytes of dynamic shared memory, f's grid. */
static bool finish_few(kiln__sb *b, const char *what, const kiln__node *n, const char *pre,
                       const kiln__operands *o, const few_tiling *f, int64_t smem, int64_t M,
                       kiln__rendered *r) {
  const kiln__win w = kiln__win_of(n);
  char stem[80];
  snprintf(stem, sizeof stem, "k_conv_%s_%lldx%lld_s1_%dx%d_bf16", what, (long long)w.kh,
           (long long)w.kw, f->th, f->tw);
  r->block = KILN__BLOCK;
  r->min_blocks = 2;
  r->smem = (unsigned)smem;
  r->arg.args.n = M;
  r->grid = (unsigned)f->grid;
  return kiln__finish_conv(b, stem, o, r, pre);
}

/* The forward product of a few-channel convolution (kiln__conv_few_shape; KILN_CONV_FEW=0: not)
 * from a halo tile: conv_few.cuh's kiln_conv_few, persistent blocks; with pool (kiln__conv_pool's
 * node) the product's 2x2 max pool is written instead, and the pool's window positions behind its
 * values where its gradient reads them (ops.def's index, as render_window.c's pools). */
bool kiln__render_conv_few(const kiln__target *t, const kiln__node *n, const kiln__gemm *mm,
                           const kiln__node *pool, const kiln__node *mom, kiln__rendered *r) {
  const kiln_tensor *Y = mm->d, *X = n->in[0], *out = pool ? pool->out : Y;
  const int64_t CO = Y->shape[1];
  const kiln__win w = kiln__win_of(n);
  few_tiling f = few_tiles(t, n);
  /* kiln_few's SMEM: the filters (rows of an odd count of chunks), a zero chunk, two halos, the
   * staged rows */
  const int64_t smem = CO * ((w.kh * w.kw * (X->shape[3] / 8)) | 1) * 16 + 16 + 2 * f.halo * 16 +
                       128 * (CO * 2 + 16);
  kiln__operands o = {0};
  int slot[3];
  char pre[640];
  kiln__conv_operands(n, mm->b, out, CO, "conv_few.cuh", &o, slot, pre, sizeof pre);
  char at[96], sums[96] = "";
  bool index = pool && KILN__I(pool, MAX_POOL, index);
  if (mom) { /* batch norm's statistics (kiln__fprop_moments): a block a partial sum */
    const int64_t P = mom->out->shape[0];
    int ks = kiln__operand(&o, mom->in[1], false, NULL),
        mo = kiln__operand(&o, mom->out, true, NULL);
    snprintf(sums, sizeof sums, ", nullptr, (const float *)a.ptr[%d], (float *)a.ptr[%d], %lld", ks,
             mo, (long long)P);
    if (f.grid > P) f.grid = P;
  }
  kiln__sb b = {0};
  kiln__sb_printf(&b,
                  "  extern __shared__ __align__(16) unsigned char kiln_smem[];\n"
                  "  static_assert(kiln_few<G, %d, %d>::SMEM == %lld && kiln_few<G, %d, %d>::TILES "
                  "== %lld, \"the launch's shared memory and tiles\");\n"
                  "  kiln_conv_few<G, %d, %d, %s%s>((const kiln_bf16 *)a.ptr[%d], (const kiln_bf16 "
                  "*)a.ptr[%d], (kiln_bf16 *)a.ptr[%d], kiln_smem%s%s%s);\n",
                  f.th, f.tw, (long long)smem, f.th, f.tw, (long long)f.tiles, f.th, f.tw,
                  pool ? "true" : "false", mom ? ", true" : "", slot[0], slot[1], slot[2],
                  index ? ", " : "",
                  index ? kiln__pool_positions(at, sizeof at, out, slot[2], false) : "", sums);
  bool ok = finish_few(&b,
                       pool  ? "few_pool"
                       : mom ? "few_moments"
                             : "few",
                       n, pre, &o, &f, smem, Y->shape[0], r);
  if (index) r->bytes_written += (uint64_t)kiln_tensor_numel(out); /* a position byte a value */
  return ok;
}

/* The weight gradient dW (CO, K) of a few-channel convolution (KILN_CONV_FEW_WGRAD=0: not) from the
 * forward product's halo tiles: conv_few.cuh's kiln_conv_few_wgrad, the blocks' partial dWt in
 * the split-K workspace (a.ptr[o.n]) and summed inside the kernel, its two counters the
 * workspace's (a.ptr[o.n + 1]). mm->a is dY^T, a transpose of the dense dY (M, CO). With a
 * prologue (pro->n > 0, kiln__phase_few_prologue's), dY is computed by it where it is loaded, from
 * its operands (after the product's), and never read. */
bool kiln__render_conv_few_wgrad(const kiln__target *t, const kiln__node *n, const kiln__gemm *mm,
                                 const kiln__ew_prog *pro, kiln__rendered *r) {
  const kiln_tensor *dY = mm->a, *D = mm->d, *X = n->in[0];
  const int64_t CO = D->shape[0];
  const kiln__win w = kiln__win_of(n);
  few_tiling f = few_tiles(t, n);
  /* kiln_few_w's: K padded to 16-row tiles; a zero chunk, two halos, two tiles' dY rows */
  const int64_t kp = (w.kh * w.kw * (X->shape[3] / 8) + 1) / 2 * 16;
  const int64_t smem = 16 + 2 * f.halo * 16 + 2 * 128 * (CO * 2 + 16);
  while (f.grid > 1 && f.grid * kp * CO * (int64_t)sizeof(float) > (int64_t)KILN__CONV_WS_BYTES)
    f.grid--;
  kiln__operands o = {0};
  int slot[3];
  char pre[640];
  kiln__conv_operands(n, dY, D, CO, "conv_few.cuh", &o, slot, pre, sizeof pre);
  kiln__sb b = {0};
  bool by = pro->n > 0;
  if (by) {
    const kiln_tensor *v = pro->nodes[pro->n - 1]->out;
    KILN_ASSERT(kiln_tensor_numel(v) == kiln_tensor_numel(dY) && v->shape[v->ndim - 1] == CO);
    kiln__wiring pw;
    int nf = 0, ni = 0, nu = 0;
    kiln__wire(pro, NULL, &o, &pw, &r->arg, &nf, &ni, &nu);
    kiln__emit_index_type(&b, kiln__wide_index(kiln_tensor_numel(v)));
    kiln__emit_prologue(&b, pro, &o, &pw, &r->arg);
  }
  kiln__sb_printf(&b,
                  "  extern __shared__ __align__(16) unsigned char kiln_smem[];\n"
                  "  static_assert(kiln_few_w<G, %d, %d>::SMEM == %lld && kiln_few_w<G, %d, "
                  "%d>::KP == %lld, \"the launch's shared memory and workspace\");\n"
                  "  kiln_conv_few_wgrad<G, %d, %d>((const kiln_bf16 *)a.ptr[%d], (const kiln_bf16 "
                  "*)a.ptr[%d], (kiln_bf16 *)a.ptr[%d], (float *)a.ptr[%d], (unsigned *)a.ptr[%d], "
                  "kiln_smem%s);\n",
                  f.th, f.tw, (long long)smem, f.th, f.tw, (long long)kp, f.th, f.tw, slot[0],
                  slot[1], slot[2], o.n, o.n + 1,
                  by ? ", kiln_few_dy_by<decltype(kiln_dy)>{kiln_dy}" : "");
  r->ws_slot = o.n;
  bool ok =
      finish_few(&b, by ? "few_wgrad_pro" : "few_wgrad", n, pre, &o, &f, smem, dY->shape[1], r);
  if (by) r->bytes_read -= kiln__footprint(dY); /* computed, never read */
  return ok;
}
