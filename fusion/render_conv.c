/*
 * render_conv.c: convolutions as implicit GEMMs on tensor cores (fusion/device/igemm.cuh): today
 * a convolution's data gradient, the product dY Wk and the col2im that sums it into the image
 * gradient in one kernel, its elementwise epilogue applied to the accumulators.
 */
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "render.h"

/* col2im of the product dY Wk as one implicit GEMM (igemm.cuh): operand 0 is col2im's input
 * (the column matrix, never read), then the epilogue's operands, then dY and Wk. A block of 128
 * image pixels and BN channels, its accumulators stored through col2im's epilogue, two channels
 * at a time. */
bool kiln__render_conv(const kiln__ew_prog *p, const kiln__gemm *mm, kiln__rendered *r) {
  const kiln__node *n = p->nodes[0];
  const kiln_tensor *X = n->out, *A = mm->a, *B = mm->b;
  kiln__kargs *a = &r->arg.args;
  kiln__operands o = {0};
  kiln__wiring wr;
  int out = kiln__window_operands(p, &o, &wr, r);
  int ka = kiln__operand(&o, A, false, NULL), kb = kiln__operand(&o, B, false, NULL);
  kiln__win w = kiln__win_of(n);
  int64_t N = X->shape[0], H = X->shape[1], W = X->shape[2], CI = X->shape[3];
  int64_t OH = n->in[0]->shape[1], OW = n->in[0]->shape[2], CO = A->shape[1];
  int BN = CI <= 32 ? 32 : 64;
  bool bf16 = X->dtype == KILN_DTYPE_BF16;
  const char *T = kiln__ctype(X->dtype);
  a->n = N * H * W; /* image pixels: the rows of dX */
  kiln__win_epi epi = {.p = p, .o = &o, .w = &wr, .shape = X->shape, .image = true, .vec = false};
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
    kiln__store_lanes(&b, "d", X->dtype, &epi);
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
  kiln__stem_of(p, "k_matmul", suffix, stem, sizeof stem);
  bool ok = kiln__finish_with(&b, stem, &o, r, pre);
  kiln__sb_free(&b);
  r->block = KILN__BLOCK;
  r->grid = (unsigned)((a->n + 127) / 128);
  r->grid_y = (unsigned)((CI + BN - 1) / BN);
  kiln__tally_bytes(&o, r);
  r->bytes_read -= kiln__footprint(o.t[0]); /* operand 0, the column matrix, is never read */
  return ok;
}
