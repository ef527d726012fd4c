/*
 * render_conv.c: a convolution's products as implicit GEMMs on tensor cores, the column matrix
 * never written:
 *   - the data gradient (fusion/device/igemm.cuh, mma.sync, sm_80 and newer, TF32 or bf16): the
 *     product dY Wk and the col2im that sums it into the image gradient in one kernel, its
 *     elementwise epilogue applied to the accumulators;
 *   - the forward product and the weight gradient (fusion/device/conv.cuh, wgmma, bf16 on
 *     sm_90a): the columns gathered from the image as each stage needs them, the weight
 *     gradient's reduction over the pixels split across blocks and summed inside the kernel;
 *   - (render_conv_few.c) a tiny convolution's direct forward product, and the forward product
 *     of a convolution with few input channels into 64 from a halo tile (fusion/device/
 *     conv_few.cuh, mma.sync; kiln__conv_few_shape, unless KILN_CONV_FEW=0), and its weight
 *     gradient from the same tiles (KILN_CONV_FEW_WGRAD=0: not);
 *   - all three on conv_tma.cuh's kernels where they take the shape (KILN_CONV_TMA=0: never)
 *     (kiln__conv_tma_window, kiln__conv_tma_dgrad): the same products with the tiles copied by
 *     the Tensor Memory Accelerator, through tensor maps (tmap.h) that the executor encodes.
 */
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "render.h"

/* A conv.cuh kernel's launch: compiled for sm_90a, S stages of 128 + BN rows of 128 bytes of
 * dynamic shared memory and 1024 bytes to align them (conv.cuh's KILN_CONV_SMEM); warp-specialized
 * (ws), three warpgroups and 2 S mbarriers (KILN_CONV_WS_THREADS, KILN_CONV_SMEM_WS). */
#define WS_THREADS 384 /* conv.cuh's KILN_CONV_WS_THREADS */
static void wgmma_launch(int BN, int S, bool ws, kiln__rendered *r) {
  r->sm90a = true;
  r->block = ws ? WS_THREADS : KILN__BLOCK;
  r->smem = (unsigned)(S * (128 + BN) * 128 + 1024 + (ws ? 16 * S : 0));
}

/* Stages of a conv.cuh kernel with BN-wide tiles: about 192 KB of them warp-specialized (one
 * block an SM), else 3 or 4 (two blocks an SM where they fit). */
static int wgmma_stages(int BN, bool ws) {
  if (ws) return 196608 / ((128 + BN) * 128);
  return BN == 128 ? 3 : 4;
}

/* The tile width of a conv.cuh kernel over n columns: 64, 128 or 256; at most 128
 * warp-specialized, whose 256-wide tiles spill (ptxas, CUDA 13.0: about 1 KB a thread with the
 * gatherers at 24 to 152 registers). */
static int wgmma_width(int64_t n, bool ws) { return n <= 64 ? 64 : (n <= 128 || ws ? 128 : 256); }

/* A conv_tma.cuh kernel's launch: 288 threads (KILN_TMA_THREADS), S stages of `stage` bytes,
 * 2 S mbarriers and 1024 bytes to align them (KILN_TMA_SMEM); stages of about 192 KB in all, one
 * block an SM. Its tensor maps go to a.ptr[slot], after its operands. */
#define TMA_THREADS 288
static int tma_stages(int stage) { return 196608 / stage < 8 ? 196608 / stage : 8; }
/* Stages of 96 KB in all instead: two blocks an SM, one's epilogue beside the other's products. */
static int tma_half_stages(int stage) { return 98304 / stage; }
/* Stages of a data gradient with warps for its epilogue (conv_tma.cuh's KILN_TMA_WS_SMEM): what
 * the sm_90's 227 KB of a block leave beside the barriers, the two rooms and the alignment, at
 * most 8. */
#define TMA_WS_THREADS 544 /* conv_tma.cuh's KILN_TMA_WS_THREADS */
static int ws_rooms(int BN, int R) { return R * 128 * (2 * BN + 16); } /* KILN_TMA_PITCH rows */
static int ws_stages(int stage, int BN, int R) {
  int left = 232448 - 2048 - ws_rooms(BN, R);
  return left / stage < 8 ? left / stage : 8;
}
static void tma_launch(int stage, int S, int slot, kiln__rendered *r) {
  /* the planner's fits() counts a group's every output as an operand, the product's too, which
   * a conv kernel does not take: a slot is left for the maps (and wgrad's workspace has two) */
  KILN_ASSERT(slot >= 0 && slot < KILN__KMAX_PTR);
  r->sm90a = true;
  r->block = TMA_THREADS;
  r->smem = (unsigned)(S * stage + 16 * S + 1024);
  r->tma_slot = slot;
}

/* The code that points tm at the kernel's maps and makes them visible to the copy engine. */
static void tma_maps(kiln__sb *b, int slot, int nmap, int producer) {
  kiln__sb_printf(b,
                  "  const kiln_tmap *tm = (const kiln_tmap *)a.ptr[%d];\n"
                  "  if (threadIdx.x == %d)\n"
                  "    for (int i = 0; i < %d; i++)\n"
                  "      kiln_tma_acquire(tm + i);\n",
                  slot, producer, nmap);
}

/* With KILN_CONV_PREFETCH=1, a TMA data gradient's producer thread, its last copies issued (S
 * stages before the products end), asks L2 for the rows of the block's tile in every operand
 * its epilogue reads at each element (dense like dX, not written by it: a batch norm's input,
 * read again by its recomputed apply), so that the epilogue's loads wait on L2, not on DRAM: on
 * the H200, Nsight Compute put 44% of air's 7x7x256 data gradient's stalls on such loads (140 us,
 * against 85 for the forward product of the same shape). Rows [r0, r1) of the tile (expressions):
 * all 128 at once in the two-block kernel, a few after each stage's copies in the
 * warp-specialized one (kiln_tma_epilogue_ws). */
static void prefetch_rows(kiln__sb *b, const kiln__ew_prog *p, const kiln__operands *o,
                          const kiln__wiring *wr, const kiln__win_epi *epi, const kiln_tensor *X,
                          int producer, const char *r0, const char *r1) {
  bool want[KILN__KMAX_PTR] = {0};
  kiln__prog_reads(p, wr, 1, want); /* the epilogue's, after col2im */
  if (epi->mom.value > 0) want[epi->mom.x] = true;
  for (int k = 0; k < o->n; k++) {
    const kiln_tensor *t = o->t[k];
    size_t es = kiln_dtype_size(t->dtype);
    if (!want[k] || o->store[k] || !kiln__is_contiguous(t) ||
        kiln_tensor_numel(t) != kiln_tensor_numel(X) || (t->offset * (int64_t)es) % 16 != 0)
      continue;
    bool again = false; /* the same memory through another operand (a view of it) */
    for (int q = 0; q < k; q++)
      again |= want[q] && !o->store[q] && o->t[q]->st == t->st && o->t[q]->offset == t->offset;
    if (again) continue;
    kiln__sb_printf(
        b,
        "    if (threadIdx.x == %d) /* the producer, after its copies */\n"
        "      for (int r = %s; r < %s && m0 + r < M; r++)\n"
        "        kiln_tma_prefetch_l2((const unsigned char *)a.ptr[%d] + ((long long)(m0 + "
        "r) * G::CI + n0) * %zu, (G::CI - n0 < BN ? G::CI - n0 : BN) * %zu);\n",
        producer, r0, r1, k, es, es);
  }
}

/* The window of dY's im2col map for a data gradient by phases (kiln_conv_dgrad_tma_phase): both
 * box corners at the least dY offsets of any phase's taps, L = (-ph, -pw), so that the map walks
 * dY's own OH x OW pixels and each tap's copy is offset from L. */
static kiln__win phase_window(const kiln__win *w) {
  int64_t far, lh = kiln__phase_corner(w->kh, w->sh, w->ph, &far),
               lw = kiln__phase_corner(w->kw, w->sw, w->pw, &far);
  return (kiln__win){
      .kh = 1 - 2 * lh, .kw = 1 - 2 * lw, .sh = 1, .sw = 1, .ph = -lh, .pw = -lw, .dh = 1, .dw = 1};
}

/* col2im of the product dY Wk as one implicit GEMM: operand 0 is col2im's input (the column
 * matrix, never read), then the epilogue's operands, then dY and Wk. A block of 128 image pixels
 * and BN channels, its accumulators stored through col2im's epilogue, two channels at a time. On
 * mma.sync (igemm.cuh), or with wg on wgmma as the forward product of dY with the filters flipped
 * (conv.cuh, stride 1: its geometry GD beside the convolution's G). With mom (a moments node of
 * mode 1 over the epilogue's last value: plan_conv.c's kiln__dgrad_moments; staged only) the
 * block also sums batch norm's gradient terms over its rows and writes them as the node's
 * partial sums, its x, mean and invstd operands after Wk, then the sums. */
static bool render_dgrad(const kiln__target *t, const kiln__spec *s, kiln__rendered *r) {
  const kiln__ew_prog *p = &s->prog;
  const kiln__gemm *mm = &s->gemm;
  const kiln__node *mom = s->moments;
  bool wg = s->wgmma, ws = t->conv_warp_spec, tma = t->conv_tma, staged = t->conv_staged;
  int most = t->conv_dgrad_bn;
  const kiln__node *n = p->nodes[0];
  const kiln_tensor *X = n->out, *A = mm->a, *B = mm->b;
  kiln__kargs *a = &r->arg.args;
  kiln__operands o = {0};
  kiln__wiring wr;
  int out = kiln__window_operands(p, &o, &wr, r);
  int ka = kiln__operand(&o, A, false, NULL), kb = kiln__operand(&o, B, false, NULL);
  kiln__win_epi epi = {
      .p = p, .o = &o, .w = &wr, .shape = X->shape, .image = true, .vec = false, .pixel = "md"};
  if (mom) { /* g is the epilogue's last value (the planner's condition) */
    KILN_ASSERT(p->n > 1 && mom->op == KILN__OP_MOMENTS);
    epi.mom.value = p->n - 1;
    epi.mom.x = kiln__operand(&o, mom->in[1], false, NULL);
    epi.mom.mean = kiln__operand(&o, mom->in[2], false, NULL);
    epi.mom.invstd = kiln__operand(&o, mom->in[3], false, NULL);
    epi.mom.out = kiln__operand(&o, mom->out, true, NULL);
  }
  kiln__win w = kiln__win_of(n);
  int64_t N = X->shape[0], H = X->shape[1], W = X->shape[2], CI = X->shape[3];
  int64_t OH = n->in[0]->shape[1], OW = n->in[0]->shape[2], CO = A->shape[1];
  /* strided: a phase of dX at a time (kiln_conv_dgrad_tma_phase), the blocks of the phase with
   * the most taps first; its rows m, numbered within the phase, are dX's pixels md */
  bool phased =
      wg && tma && t->conv_phases && !kiln__conv_tma_dgrad(&w, CO, CI) && kiln__dgrad_phases(n, CO);
  tma = wg && tma && (phased || kiln__conv_tma_dgrad(&w, CO, CI));
  staged = staged && tma;
  KILN_ASSERT(!staged || X->offset % 4 == 0); /* its epilogue stores four channels at once */
  KILN_ASSERT(!mom || staged);
  /* staged, a thread keeps its four channels from one row to the next: their per-channel
   * operands are loaded once, before the loop, and those read element by element KILN_CONV_HOIST
   * rows ahead (0: both in the row that reads them) */
  epi.vec = staged && p->n > 1 && kiln__epilogue_fours(p, &o, &wr);
  epi.hoist = epi.vec && t->conv_hoist > 0;
  epi.rounded = epi.vec; /* the staged tile's values: bf16 (kiln_tma_stage_tile) */
  ws = ws && !tma;
  int BN = wg ? wgmma_width(CI, ws) : (CI <= 32 ? 32 : 64);
  bool narrowed = tma && most && BN > most; /* 128 unless KILN_CONV_DGRAD_BN says */
  if (narrowed) BN = most;
  int stage = tma ? (128 + BN) * 128 : 0;
  /* 64 wide, or narrowed: stages of 96 KB in all (4 of 64 wide, 3 of 128), two blocks an SM, one's
   * epilogue beside the other's products */
  int S = tma ? (BN == 64 || narrowed ? tma_half_stages(stage) : tma_stages(stage))
              : wgmma_stages(BN, ws);
  /* KILN_CONV_DGRAD_WS=1: a persistent block, two warpgroups of its own for the epilogue
   * (conv_tma.cuh's kiln_conv_dgrad_tma_ws), tiles of at most 128 columns (544 threads: at most
   * 120 registers a thread), stages in what the two rooms for staged tiles leave; the epilogue's
   * threads are kiln_t = threadIdx.x - 256, as many as the two-block kernel's */
  bool ws_epi = tma && staged && epi.hoist && !phased && t->conv_dgrad_ws && BN <= 128;
  int rooms = t->conv_dgrad_ws == 2 ? 2 : 1; /* the staged tiles' rooms */
  if (ws_epi) S = ws_stages(stage, BN, rooms);
  const char *tid = ws_epi ? "kiln_t" : "threadIdx.x";
  bool bf16 = X->dtype == KILN_DTYPE_BF16;
  const char *T = kiln__ctype(X->dtype);
  a->n = N * H * W; /* image pixels: the rows of dX */
  int64_t phases = phased ? w.sh * w.sw : 1, rows = a->n / phases; /* a phase's rows */
  char pre[1536];
  int k = snprintf(
      pre, sizeof pre,
      "#include \"%s\"\n"
      "struct G { /* the convolution's geometry */\n"
      "  static constexpr int KH = %lld, KW = %lld, SH = %lld, SW = %lld, PH = %lld, PW = %lld, "
      "DH = %lld, DW = %lld;\n"
      "  static constexpr int H = %lld, W = %lld, OH = %lld, OW = %lld, CO = %lld, CI = %lld, "
      "BN = %d;\n"
      "};\n",
      tma  ? "conv_tma.cuh"
      : wg ? "conv.cuh"
           : "igemm.cuh",
      (long long)w.kh, (long long)w.kw, (long long)w.sh, (long long)w.sw, (long long)w.ph,
      (long long)w.pw, (long long)w.dh, (long long)w.dw, (long long)H, (long long)W, (long long)OH,
      (long long)OW, (long long)CO, (long long)CI, BN);
  if (wg)
    snprintf(pre + k, sizeof pre - (size_t)k,
             "struct GD { /* the data gradient as a forward product of dY */\n"
             "  static constexpr int N = %lld, H = G::OH, W = G::OW, CI = G::CO, OH = G::H, "
             "OW = G::W, CO = G::CI;\n"
             "  static constexpr int KH = G::KH, KW = G::KW, SH = 1, SW = 1, PH = G::KH - 1 - "
             "G::PH, PW = G::KW - 1 - G::PW, DH = 1, DW = 1;\n"
             "};\n",
             (long long)N);
  if (phased) {
    kiln__win f = phase_window(&w);
    size_t at = strlen(pre);
    int q = snprintf(pre + at, sizeof pre - at,
                     "struct GP : G { /* the phases: dY's box corners, the heaviest first */\n"
                     "  static constexpr int LH = %lld, LW = %lld, PHASES = %lld, TILES = %lld;\n"
                     "  static constexpr int ORDER[PHASES] = {",
                     (long long)-f.ph, (long long)-f.pw, (long long)phases,
                     (long long)((rows + 127) / 128));
    for (int most_taps = (int)(w.kh * w.kw); most_taps >= 0 && q > 0; most_taps--)
      for (int64_t ph = 0; ph < phases && q > 0; ph++) {
        at = strlen(pre);
        if (kiln__phase_taps(w.kh, w.sh, w.ph, ph / w.sw) *
                kiln__phase_taps(w.kw, w.sw, w.pw, ph % w.sw) ==
            most_taps)
          q = snprintf(pre + at, sizeof pre - at, "%lld, ", (long long)ph);
      }
    at = strlen(pre);
    if (q > 0) q = snprintf(pre + at, sizeof pre - at, "};\n};\n");
    KILN_ASSERT(q > 0 && strlen(pre) + 1 < sizeof pre);
  }
  kiln__sb b = {0};
  kiln__sb_printf(&b,
                  "  typedef int ix;\n"
                  "  const int V = %d;\n"
                  "  (void)V;\n"
                  "  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;\n"
                  "  (void)warp;\n",
                  staged ? 4 : 2);
  const char *md = phased ? "kiln_drow(m)" : "m"; /* dX's row of the block's row m */
  if (wg) {
    kiln__sb_printf(&b,
                    "  constexpr int BN = %d, S = %d;\n"
                    "  extern __shared__ __align__(1024) unsigned char kiln_smem[];\n",
                    BN, S);
    if (phased)
      kiln__sb_printf(
          &b, "  const int kiln_ph = GP::ORDER[blockIdx.x / GP::TILES], kiln_py = kiln_ph / G::SW, "
              "kiln_px = kiln_ph %% G::SW;\n"
              "  const int M = (int)(a.n / GP::PHASES), m0 = (int)(blockIdx.x %% GP::TILES) * "
              "128, n0 = (int)blockIdx.y * BN;\n"
              "  auto kiln_drow = [&](int m) { /* the phase's pixel m: (n, a, b) */\n"
              "    return ((m / (G::OH * G::OW) * G::H + m / G::OW %% G::OH * G::SH + kiln_py) * "
              "G::W + m %% G::OW * G::SW + kiln_px);\n"
              "  };\n");
    else if (ws_epi)
      kiln__sb_printf(&b, "  const int M = (int)a.n;\n");
    else
      kiln__sb_printf(&b, "  const int M = (int)a.n, m0 = (int)blockIdx.x * 128, n0 = "
                          "(int)blockIdx.y * BN;\n");
    if (!ws_epi) kiln__sb_printf(&b, "  float acc[BN / 2];\n");
    if (ws_epi) {
      tma_maps(&b, o.n, 2, 512);
      /* the producer's prefetches after each tile's copies, then the epilogue of a staged tile */
      kiln__sb_printf(&b,
                      "  kiln_conv_dgrad_tma_ws<G, BN, S, %d>(\n"
                      "      tm, tm + 1, (M + 127) / 128 * ((G::CI + BN - 1) / BN), kiln_smem,\n"
                      "      [&](int m0, int n0, int r0, int r1) {\n"
                      "    (void)m0, (void)n0, (void)r0, (void)r1;\n",
                      rooms);
      if (t->conv_prefetch) prefetch_rows(&b, p, &o, &wr, &epi, X, 512, "r0", "r1");
      kiln__sb_printf(&b, "      },\n"
                          "      [&](int m0, int n0, unsigned char *tile) {\n"
                          "  const int kiln_t = (int)threadIdx.x - 256;\n");
    } else if (tma) {
      tma_maps(&b, o.n, 2, 256);
      kiln__sb_printf(&b, phased
                              ? "  if (!kiln_conv_dgrad_tma_phase<GP, BN, S>(tm, tm + 1, kiln_py, "
                                "kiln_px, m0, n0, kiln_smem, acc)) {\n"
                              : "  if (!kiln_conv_dgrad_tma<G, BN, S>(tm, tm + 1, m0, n0, "
                                "kiln_smem, acc)) {\n");
      /* not by phases: a phase's few stages (2 to 8 in ResNet-18) end long before the producer
       * has issued its 128 prefetches an operand, and the block holds its SM until it has */
      if (t->conv_prefetch && !phased) prefetch_rows(&b, p, &o, &wr, &epi, X, 256, "0", "128");
      kiln__sb_printf(&b, "    return;\n  }\n");
    } else {
      kiln__sb_printf(&b,
                      "  if (!kiln_conv_fprop<GD, BN, S, true, %s%s>((const kiln_bf16 *)a.ptr[%d], "
                      "(const kiln_bf16 *)a.ptr[%d], m0, n0, kiln_smem, acc))\n    return;\n",
                      ws ? "true" : "false", t->conv_ahead ? ", true" : "", ka, kb);
    }
    if (tma) { /* dY's im2col map for the window (a phase's, by phases), the filters' panels */
      kiln__win f = phased ? phase_window(&w) : kiln__dgrad_window(&w);
      const int64_t nhwc[4] = {N, OH, OW, CO}, wk[3] = {CI, w.kh * w.kw, CO};
      r->tmap[0] = kiln__tmap_im2col(ka, nhwc, &f, 128);
      r->tmap[1] = kiln__tmap_tiled(kb, 3, wk, (const uint32_t[]){64, 1, 64});
      r->ntmap = 2;
    }
    kiln__sb hoisted = {0}, ahead = {0};
    if (epi.hoist) { /* the loop unrolled over its BN / 8 rows, KILN_D of them loaded ahead */
      kiln__hoist_channel_loads(&hoisted, &epi, "kiln_c", "G::CI", "  ");
      kiln__sb_printf(
          &hoisted,
          "  constexpr int KILN_D = BN / 8 < %d ? BN / 8 : %d;\n"
          "  auto kiln_prow = [&](int r) { return m0 + (%s + 256 * r) / (BN / 4); };\n"
          "  auto kiln_row = [&](int r) { return %s; };\n"
          "  auto kiln_row_ok = [&](int r) { return kiln_prow(r) < M && kiln_c < G::CI; "
          "};\n",
          t->conv_hoist, t->conv_hoist, tid, phased ? "kiln_drow(kiln_prow(r))" : "kiln_prow(r)");
      kiln__ahead_rows(&hoisted, &epi, true, "KILN_D", "BN / 8", "kiln_row", "kiln_row_ok",
                       "kiln_c", "  ");
      kiln__ahead_rows(&ahead, &epi, false, "KILN_D", "BN / 8", "kiln_row", "kiln_row_ok", "c",
                       "    ");
    }
    if (staged) { /* through shared memory: a thread's four channels of a row, a row's chunks by
                   * neighbouring threads, each operand read and written four values at a time */
      kiln__sb_printf(&b,
                      "%s"
                      "%s"
                      "  static_assert(256 %% (BN / 4) == 0, \"a thread keeps its channels\");\n"
                      "  const ix kiln_c = n0 + %s %% (BN / 4) * 4;\n"
                      "  (void)kiln_c;\n"
                      "%s",
                      ws_epi ? "" /* staged by the multiplying warps */
                             : "  unsigned char *tile = kiln_align1024(kiln_smem);\n"
                               "  kiln_tma_stage_tile<BN>(acc, tile);\n",
                      mom ? "  float kiln_ms[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};\n" : "",
                      tid, hoisted.s ? hoisted.s : "");
      if (epi.hoist)
        kiln__sb_printf(&b,
                        "#pragma unroll\n"
                        "  for (int kiln_r = 0; kiln_r < BN / 8; kiln_r++) {\n"
                        "    const int q = %s + 256 * kiln_r;\n",
                        tid);
      else
        kiln__sb_printf(&b, "  for (int q = %s; q < 128 * (BN / 4); q += 256) {\n", tid);
      kiln__sb_printf(&b,
                      "    const ix m = m0 + q / (BN / 4), c = n0 + q %% (BN / 4) * 4;\n"
                      "    float d[4];\n"
                      "    kiln_tma_tile_get4<BN>(tile, q / (BN / 4), q %% (BN / 4) * 4, d);\n"
                      "%s",
                      ahead.s ? ahead.s : "");
    } else
      kiln__sb_printf(&b,
                      "  const int r0 = kiln_conv_row0<%s>();\n"
                      "#pragma unroll\n"
                      "  for (int j = 0; j < BN / 8; j++)\n"
                      "#pragma unroll\n"
                      "  for (int hh = 0; hh < 2; hh++) {\n"
                      "    const ix m = m0 + r0 + 8 * hh;\n"
                      "    const ix c = n0 + 8 * j + 2 * (lane & 3);\n"
                      "    const float d[2] = {acc[4 * j + 2 * hh], acc[4 * j + 2 * hh + 1]};\n",
                      ws ? "true" : "false");
    b.oom |= hoisted.oom || ahead.oom;
    kiln__sb_free(&hoisted);
    kiln__sb_free(&ahead);
  } else
    kiln__sb_printf(&b,
                    "  const int M = (int)a.n, m0 = (int)blockIdx.x * KILN_IG_BM, n0 = "
                    "(int)blockIdx.y * G::BN;\n"
                    "  float acc[2][G::BN / 16][4];\n"
                    "  kiln_dgrad<%s, G>((const %s *)a.ptr[%d], (const %s *)a.ptr[%d], M, m0, n0, "
                    "acc);\n"
                    "#pragma unroll\n"
                    "  for (int mi = 0; mi < 2; mi++)\n"
                    "#pragma unroll\n"
                    "  for (int ni = 0; ni < G::BN / 16; ni++)\n"
                    "#pragma unroll\n"
                    "  for (int hh = 0; hh < 2; hh++) {\n"
                    "    const ix m = m0 + (warp >> 1) * 32 + mi * 16 + (lane >> 2) + 8 * hh;\n"
                    "    const ix c = n0 + (warp & 1) * (G::BN / 2) + ni * 8 + 2 * (lane & 3);\n"
                    "    const float d[2] = {acc[mi][ni][2 * hh], acc[mi][ni][2 * hh + 1]};\n",
                    T, T, ka, T, kb);
  kiln__sb_printf(&b,
                  "    if (m >= M || c >= G::CI) continue;\n"
                  "    const ix md = %s;\n"
                  "    const ix n = md / (G::H * G::W), h = md / G::W %% G::H, w = md %% G::W;\n"
                  "    (void)n; (void)h; (void)w;\n",
                  md);
  if (p->n > 1) {
    kiln__store_lanes(&b, "d", X->dtype, &epi);
  } else if (staged) {
    kiln__sb_printf(&b, "    kiln_store4((kiln_bf16 *)a.ptr[%d] + md * G::CI + c, d);\n", out);
  } else if (bf16) {
    kiln__sb_printf(&b,
                    "    ((unsigned *)a.ptr[%d])[(md * G::CI + c) / 2] = kiln_bf16x2_bits(d[0], "
                    "d[1]);\n",
                    out);
  } else {
    kiln__sb_printf(&b,
                    "    *(float2 *)&((float *)a.ptr[%d])[md * G::CI + c] = make_float2(d[0], "
                    "d[1]);\n",
                    out);
  }
  kiln__sb_printf(&b, "  }\n");
  if (mom && ws_epi) /* the epilogue warps' sums of the tile's rows */
    kiln__sb_printf(&b,
                    "  kiln_tma_tile_moments_ws<BN>(kiln_ms, tile, (float *)a.ptr[%d], m0 / 128, "
                    "n0, G::CI);\n",
                    epi.mom.out);
  else if (mom) /* the block's sums of its rows, a thread's four channels over the threads that
                   share them */
    kiln__sb_printf(&b,
                    "  kiln_tma_tile_moments<BN>(kiln_ms, tile, (float *)a.ptr[%d], n0, G::CI);\n",
                    epi.mom.out);
  if (ws_epi) kiln__sb_printf(&b, "      });\n");
  char stem[80], suffix[48];
  snprintf(suffix, sizeof suffix, "_%lldx%lld_s%lld_%s_%s", (long long)w.kh, (long long)w.kw,
           (long long)w.sh, kiln_dtype_name(X->dtype),
           tma  ? (ws_epi ? (mom ? "tma_ws_moments" : "tma_ws") : (mom ? "tma_moments" : "tma"))
           : wg ? (ws ? "wgmma_ws" : "wgmma")
                : "igemm");
  kiln__stem_of(p, "k_matmul", suffix, stem, sizeof stem);
  if (tma) /* before the source is written: its launch bounds follow r->block */
    tma_launch(stage, S, o.n, r);
  else if (wg)
    wgmma_launch(BN, S, ws, r);
  else
    r->block = KILN__BLOCK;
  if (ws_epi) { /* conv_tma.cuh's KILN_TMA_WS_THREADS and KILN_TMA_WS_SMEM */
    r->block = TMA_WS_THREADS;
    r->smem = (unsigned)(S * stage + 1024 + ws_rooms(BN, rooms) + 1024);
  }
  bool ok = kiln__finish_with(&b, stem, &o, r, pre);
  kiln__sb_free(&b);
  r->grid = (unsigned)(phases * ((rows + 127) / 128));
  r->grid_y = (unsigned)((CI + BN - 1) / BN);
  if (ws_epi) { /* one block an SM, as many as there are tiles at most */
    int64_t tiles = (int64_t)r->grid * r->grid_y, sms = t->num_sms > 0 ? t->num_sms : 132;
    r->grid = (unsigned)(tiles < sms ? tiles : sms);
    r->grid_y = 1;
  }
  kiln__tally_bytes(&o, r);
  r->bytes_read -= kiln__footprint(o.t[0]); /* operand 0, the column matrix, is never read */
  return ok;
}

/* Stores the block's accumulators d (its rows from row0, its columns from col0) into the bf16
 * matrix at a.ptr[out] of rows x cols, bounds checked, or into its transpose (cols x rows). */
static void store_tile(kiln__sb *b, int out, const char *row0, const char *col0, const char *rows,
                       const char *cols, bool transposed, bool ws) {
  kiln__sb_printf(b,
                  "  const int lane = threadIdx.x & 31, r0 = kiln_conv_row0<%s>();\n"
                  "  kiln_bf16 *out = (kiln_bf16 *)a.ptr[%d];\n"
                  "#pragma unroll\n"
                  "  for (int j = 0; j < BN / 8; j++)\n"
                  "#pragma unroll\n"
                  "    for (int h = 0; h < 2; h++) {\n"
                  "      const int r = %s + r0 + 8 * h, c = %s + 8 * j + 2 * (lane & 3);\n"
                  "      if (r < %s && c < %s) {\n",
                  ws ? "true" : "false", out, row0, col0, rows, cols);
  if (transposed)
    kiln__sb_printf(b,
                    "        out[c * %s + r] = kiln_bf16(d[4 * j + 2 * h]);\n"
                    "        out[(c + 1) * %s + r] = kiln_bf16(d[4 * j + 2 * h + 1]);\n",
                    rows, rows);
  else
    kiln__sb_printf(b,
                    "        *(unsigned *)&out[r * %s + c] = kiln_bf16x2_bits(d[4 * j + 2 * h], "
                    "d[4 * j + 2 * h + 1]);\n",
                    cols);
  kiln__sb_printf(b, "      }\n"
                     "    }\n");
}

/* Stores the block's accumulators d (rows [k0, ...) of dWt (K, CO), columns [n0, ...)) as the
 * weight's f32 gradient (CO, CI, KH, KW) at a.ptr[out] (kiln__wgrad_into_grad): each value rounded
 * to bf16 first, as the bf16 result's store would, so that it is the value the cast of that
 * result made. Row r of dWt is tap r / CI, channel r % CI. */
static void store_grad(kiln__sb *b, int out, bool ws) {
  kiln__sb_printf(
      b,
      "  const int lane = threadIdx.x & 31, r0 = kiln_conv_row0<%s>();\n"
      "  float *out = (float *)a.ptr[%d];\n"
      "#pragma unroll\n"
      "  for (int j = 0; j < BN / 8; j++)\n"
      "#pragma unroll\n"
      "    for (int h = 0; h < 2; h++) {\n"
      "      const int r = k0 + r0 + 8 * h, c = n0 + 8 * j + 2 * (lane & 3);\n"
      "      if (r < K && c < G::CO) {\n"
      "        const int tap = r / G::CI, at = (r - tap * G::CI) * (G::KH * G::KW) + tap;\n"
      "        out[c * K + at] = (float)kiln_bf16(d[4 * j + 2 * h]);\n"
      "        out[(c + 1) * K + at] = (float)kiln_bf16(d[4 * j + 2 * h + 1]);\n"
      "      }\n"
      "    }\n",
      ws ? "true" : "false", out);
}

/* Names, wraps and launches a conv.cuh kernel (256 threads, 384 warp-specialized) or, with
 * stage > 0, a conv_tma.cuh one (tma_launch: stages of `stage` bytes, its maps at a.ptr[slot]):
 * BN-wide tiles, S stages of dynamic shared memory, sm_90a. */
static bool finish_wgmma(kiln__sb *b, const char *what, const kiln__node *n, const char *pre,
                         const kiln__operands *o, int BN, int S, bool ws, int stage, int slot,
                         kiln__rendered *r) {
  kiln__win w = kiln__win_of(n);
  char stem[80];
  snprintf(stem, sizeof stem, "k_conv_%s_%lldx%lld_s%lld_%dx%d_bf16%s", what, (long long)w.kh,
           (long long)w.kw, (long long)w.sh, 128, BN,
           stage ? "_tma"
           : ws  ? "_ws"
                 : "");
  if (stage)
    tma_launch(stage, S, slot, r);
  else
    wgmma_launch(BN, S, ws, r);
  return kiln__finish_conv(b, stem, o, r, pre);
}

/* A TMA-fed forward product's two maps (X's im2col map, `pixels` a copy; Wk (CO, K) tiled in
 * 64 x BN boxes) for operands slot[0] and slot[1]. */
static void fprop_maps(kiln__rendered *r, const int slot[3], const kiln_tensor *X,
                       const kiln__win *w, int64_t K, int64_t CO, int BN, int pixels) {
  const int64_t nhwc[4] = {X->shape[0], X->shape[1], X->shape[2], X->shape[3]};
  const int64_t wk[2] = {K, CO}; /* Wk (CO, K): K innermost */
  r->tmap[0] = kiln__tmap_im2col(slot[0], nhwc, w, pixels);
  r->tmap[1] = kiln__tmap_tiled(slot[1], 2, wk, (const uint32_t[]){64, (uint32_t)BN});
  r->ntmap = 2;
}

/* The rest of render_fprop with a max pool (b: its body's start, m0 unused): B-pixel copies a row,
 * 128 / (2 B) pairs of rows a block (conv_tma.cuh's kiln_conv_fprop_tma_pairs, the grid over the
 * pooled image's N x OH / 2 rows), the pool in the epilogue (kiln_tma_pool_tile). */
static bool render_pooled(const kiln__node *n, const kiln_tensor *X, const kiln__node *pool,
                          kiln__sb *b, kiln__operands *o, const int slot[3], const char *pre,
                          int BN, int S, int stage, kiln__rendered *r) {
  const kiln_tensor *Y = pool->out;
  const int64_t oh = n->out->shape[1], ow = n->out->shape[2], K = n->out->shape[3],
                CO = Y->shape[3];
  const int B = kiln__conv_pool_rows(ow), pairs = 128 / B / 2;
  KILN_ASSERT(B > 0 && Y->shape[1] == oh / 2 && Y->shape[2] == ow / 2);
  char at[96];
  tma_maps(b, o->n, 2, 256);
  kiln__sb_printf(
      b,
      "  constexpr int B = %d;\n"
      "  const int q0 = (int)blockIdx.x * (128 / B / 2);\n"
      "  (void)m0;\n"
      "  if (!kiln_conv_fprop_tma_pairs<G, BN, S, B>(tm, tm + 1, q0, n0, kiln_smem, d))\n"
      "    return;\n"
      "  kiln_tma_pool_tile<G, BN, B>(d, kiln_align1024(kiln_smem), q0, n0, "
      "(kiln_bf16 *)a.ptr[%d], %s);\n",
      B, slot[2],
      KILN__I(pool, MAX_POOL, index) ? kiln__pool_positions(at, sizeof at, Y, slot[2], false)
                                     : "nullptr");
  kiln__win w = kiln__win_of(n);
  fprop_maps(r, slot, X, &w, K, CO, BN, B);
  const int64_t rows = X->shape[0] * (oh / 2); /* pairs of output rows */
  r->arg.args.n = rows;
  r->grid = (unsigned)((rows + pairs - 1) / pairs);
  r->grid_y = (unsigned)((CO + BN - 1) / BN);
  bool ok = finish_wgmma(b, "fprop_pool", n, pre, o, BN, S, false, stage, o->n, r);
  if (KILN__I(pool, MAX_POOL, index)) /* a position byte a value */
    r->bytes_written += (uint64_t)kiln_tensor_numel(Y);
  return ok;
}

/* The forward product Y (M, CO) = im2col(X) Wk^T: a block of 128 pixels by BN channels; TMA-fed
 * with tma, through X's im2col map (128 pixels a copy) and Wk's tiled one (64 x BN boxes). With a
 * max pool in epi (kiln__conv_pool's; TMA-fed), a block's 128 rows are pairs of whole output rows
 * (copies of kiln__conv_pool_rows pixels) and it writes their 2x2 max pool instead, with the
 * window positions behind the pooled values where the pool's gradient reads them. With mom
 * (kiln__fprop_moments' moments node; TMA-fed), the block stores its rows through the staged tile
 * and sums them there as batch norm's statistics, the node's shift and partial sums its operands
 * after the filters'. */
static bool render_fprop(const kiln__target *t, const kiln__node *n, const kiln__gemm *mm,
                         const kiln__ew_prog *epi, const kiln__node *mom, kiln__rendered *r) {
  bool ws = t->conv_warp_spec, tma = t->conv_tma;
  const kiln_tensor *Y = mm->d, *X = n->in[0];
  int64_t M = Y->shape[0], CO = Y->shape[1];
  if (kiln__conv_direct_shape(mm->b->shape[0], X->shape[3], CO))
    return kiln__render_conv_direct(n, mm, epi, r);
  kiln__win w = kiln__win_of(n);
  bool few = t->conv_few && kiln__conv_few_shape(&w, X->shape[3], CO);
  /* an epilogue is kiln__direct_epilogue's chain, or kiln__conv_pool's max pool */
  KILN_ASSERT(epi->n == 0 || (epi->n == 1 && epi->nodes[0]->op == KILN__OP_MAX_POOL));
  const kiln__node *pool = epi->n ? epi->nodes[0] : NULL;
  if (few) return kiln__render_conv_few(t, n, mm, pool, mom, r);
  tma = tma && kiln__conv_tma_window(&w, X->shape[3]);
  KILN_ASSERT((!pool && !mom) || tma); /* the halo-tile product's returned above */
  int BN = wgmma_width(CO, ws && !tma), most = tma ? t->conv_fprop_bn : 0;
  if (most && BN > most) BN = most;
  int stage = tma ? (128 + BN) * 128 : 0;
  /* KILN_CONV_FPROP_BN: tiles of at most 128 take 96 KB of stages (4 of 64 wide, 3 of 128), as
   * the data gradients' do, so that a block's first copies and stores run beside the other's
   * products; else about 192 KB, one block an SM */
  int S = !tma                ? wgmma_stages(BN, ws)
          : most && BN <= 128 ? tma_half_stages(stage)
                              : tma_stages(stage);
  kiln__operands o = {0};
  int slot[3];
  char pre[640];
  kiln__conv_operands(n, mm->b, pool ? pool->out : Y, CO, tma ? "conv_tma.cuh" : "conv.cuh", &o,
                      slot, pre, sizeof pre);
  kiln__sb b = {0};
  kiln__sb_printf(&b,
                  "  constexpr int BN = %d, S = %d, M = %lld;\n"
                  "  extern __shared__ __align__(1024) unsigned char kiln_smem[];\n"
                  "  float d[BN / 2];\n"
                  "  const int m0 = (int)blockIdx.x * 128, n0 = (int)blockIdx.y * BN;\n",
                  BN, S, (long long)M);
  if (pool) return render_pooled(n, X, pool, &b, &o, slot, pre, BN, S, stage, r);
  int ks = mom ? kiln__operand(&o, mom->in[1], false, NULL) : -1, /* before the maps' slot */
      mo = mom ? kiln__operand(&o, mom->out, true, NULL) : -1;
  if (tma) {
    tma_maps(&b, o.n, 2, 256);
    kiln__sb_printf(&b, "  if (!kiln_conv_fprop_tma<G, BN, S>(tm, tm + 1, m0, n0, kiln_smem, d))\n"
                        "    return;\n");
    fprop_maps(r, slot, X, &w, mm->b->shape[0], CO, BN, 128);
  } else {
    kiln__sb_printf(&b,
                    "  if (!kiln_conv_fprop<G, BN, S, false, %s%s>((const kiln_bf16 *)a.ptr[%d], "
                    "(const kiln_bf16 *)a.ptr[%d], m0, n0, kiln_smem, d))\n"
                    "    return;\n",
                    ws ? "true" : "false", t->conv_ahead ? ", true" : "", slot[0], slot[1]);
  }
  if (mom)
    kiln__sb_printf(
        &b,
        "  kiln_tma_store_tile_moments<BN>((kiln_bf16 *)a.ptr[%d], m0, n0, M, G::CO, d, "
        "kiln_align1024(kiln_smem), (const float *)a.ptr[%d], (float *)a.ptr[%d]);\n",
        slot[2], ks, mo);
  else if (tma && BN == 256) /* through shared memory: kiln_tma_store_tile says why at 256 alone */
    kiln__sb_printf(&b,
                    "  kiln_tma_store_tile<BN>((kiln_bf16 *)a.ptr[%d], m0, n0, M, G::CO, d, "
                    "kiln_align1024(kiln_smem));\n",
                    slot[2]);
  else
    store_tile(&b, slot[2], "m0", "n0", "M", "G::CO", false, ws && !tma);
  r->arg.args.n = M;
  r->grid = (unsigned)((M + 127) / 128);
  r->grid_y = (unsigned)((CO + BN - 1) / BN);
  return finish_wgmma(&b, mom ? "fprop_moments" : "fprop", n, pre, &o, BN, S, ws && !tma, stage,
                      o.n, r);
}

/* How many splits of the pixels a weight gradient of `tiles` tiles (128 x BN) over M pixels takes:
 * as many as one wave of blocks holds (one block an SM), each split at least 32 stages of 64
 * pixels and the partial tiles within the workspace. Its tiles of 64-pixel stages bring 32 KB a
 * stage from L2 for 2 MFLOP, and with every SM loading, L2 is what bounds it: on air's
 * 7x7x256->256 conv (36 tiles) 3 splits, 108 blocks, took 126.8 us where 7 (two waves) took 152.4
 * and 4 (144 blocks, the old rule's) more, and 1 split on 36 SMs 295.2 (dev/conv_engine's
 * ./lab tmaw, H100; 15x15x64->256: 13 splits 171.2, 11 185.5). */
static int64_t wgrad_splits(int64_t tiles, int64_t M, int64_t sms, int BN) {
  int64_t splits = tiles < sms ? sms / tiles : 1, most = M / (64 * 32);
  if (splits > most) splits = most;
  while (splits > 1 &&
         tiles * splits * 128 * BN * (int64_t)sizeof(float) > (int64_t)KILN__CONV_WS_BYTES)
    splits--;
  if (splits < 1 || tiles > KILN__CONV_COUNTERS) return 1;
  const int64_t steps = (M + 63) / 64, chunk = (steps + splits - 1) / splits;
  return (steps + chunk - 1) / chunk; /* no empty split */
}

/* The weight gradient dW (CO, K) = dY^T im2col(X), computed as its transpose (K rows, CO
 * columns) and stored transposed: a block of 128 rows by BN columns over a split of the pixels
 * (wgrad_splits), summed inside the kernel: the last block of a tile adds every split's partial
 * tile alone. mm->a is dY^T, a transpose of the dense dY (M, CO). With grad, the weight's f32
 * gradient (CO, CI, KH, KW) is stored instead (store_grad). */
static bool render_wgrad(const kiln__target *t, const kiln__node *n, const kiln__gemm *mm,
                         const kiln_tensor *grad, const kiln__ew_prog *pro, kiln__rendered *r) {
  const kiln_tensor *dY = mm->a, *D = mm->d, *X = n->in[0];
  int64_t CO = D->shape[0], K = D->shape[1], M = dY->shape[1];
  kiln__win w = kiln__win_of(n);
  bool few =
      t->conv_few && t->conv_few_wgrad && !grad && kiln__few_wgrad_shape(&w, X->shape[3], CO);
  KILN_ASSERT(few || pro->n == 0); /* the planner's condition */
  if (few) return kiln__render_conv_few_wgrad(t, n, mm, pro, r);
  bool tma = t->conv_tma && kiln__conv_tma_window(&w, X->shape[3]);
  bool ws = t->conv_warp_spec && !tma;
  /* TMA: 4 stages, not the 6 that fill 192 KB (the lab's 7x7x256->256 weight gradient: 126.8 us
   * against 141.0 at 3 splits; 15x15x64->256 171.2 against 181.0) */
  int BN = CO <= 64 ? 64 : 128, stage = tma ? (2 + BN / 64) * 8192 : 0;
  int S = tma ? (BN == 64 ? tma_stages(stage) : 4) : ws ? wgmma_stages(BN, ws) : 4;
  int64_t tiles = ((K + 127) / 128) * ((CO + BN - 1) / BN), sms = t->num_sms > 0 ? t->num_sms : 132;
  int64_t splits = wgrad_splits(tiles, M, sms, BN);
  int64_t chunk = ((M + 63) / 64 + splits - 1) / splits * 64;
  KILN_ASSERT((M + chunk - 1) / chunk == splits);
  kiln__operands o = {0};
  int slot[3];
  char pre[640];
  kiln__conv_operands(n, dY, grad ? grad : D, CO, tma ? "conv_tma.cuh" : "conv.cuh", &o, slot, pre,
                      sizeof pre);
  int maps = splits > 1 ? o.n + 2 : o.n; /* after the split-K workspace's two */
  kiln__sb b = {0};
  kiln__sb_printf(
      &b,
      "  constexpr int BN = %d, S = %d, M = %lld, K = %lld, CHUNK = %lld;\n"
      "  extern __shared__ __align__(1024) unsigned char kiln_smem[];\n"
      "  float d[BN / 2];\n"
      "  const int k0 = (int)blockIdx.x * 128, n0 = (int)blockIdx.y * BN;\n"
      "  const int p0 = (int)blockIdx.z * CHUNK, p1 = p0 + CHUNK < M ? p0 + CHUNK : M;\n",
      BN, S, (long long)M, (long long)K, (long long)chunk);
  if (tma) {
    tma_maps(&b, maps, 2, 256);
    kiln__sb_printf(&b,
                    "  if (!kiln_conv_wgrad_tma<G, BN, S>(tm, tm + 1, k0, n0, p0, p1, kiln_smem, "
                    "d))\n"
                    "    return;\n");
    const int64_t nhwc[4] = {X->shape[0], X->shape[1], X->shape[2], X->shape[3]};
    const int64_t dy[2] = {CO, M}; /* dY (M, CO): CO innermost */
    r->tmap[0] = kiln__tmap_im2col(slot[0], nhwc, &w, 64);
    r->tmap[1] = kiln__tmap_tiled(slot[1], 2, dy, (const uint32_t[]){64, 64});
    r->ntmap = 2;
  } else {
    kiln__sb_printf(&b,
                    "  if (!kiln_conv_wgrad<G, BN, S, %s>((const kiln_bf16 *)a.ptr[%d], (const "
                    "kiln_bf16 *)a.ptr[%d], k0, n0, p0, p1, kiln_smem, d))\n"
                    "    return;\n",
                    ws ? "true" : "false", slot[0], slot[1]);
  }
  if (splits > 1 && tma)
    kiln__sb_printf(&b,
                    "  if (!kiln_conv_split_sum<BN, false, true>(d, (float *)a.ptr[%d], (unsigned "
                    "*)a.ptr[%d]))\n"
                    "    return;\n",
                    o.n, o.n + 1);
  else if (splits > 1)
    kiln__sb_printf(
        &b,
        "  if (!kiln_conv_split_sum<BN, %s>(d, (float *)a.ptr[%d], (unsigned *)a.ptr[%d]))\n"
        "    return;\n",
        ws ? "true" : "false", o.n, o.n + 1);
  if (grad)
    store_grad(&b, slot[2], ws);
  else
    store_tile(&b, slot[2], "k0", "n0", "K", "G::CO", true, ws);
  r->arg.args.n = M;
  r->grid = (unsigned)((K + 127) / 128);
  r->grid_y = (unsigned)((CO + BN - 1) / BN);
  r->grid_z = (unsigned)splits;
  r->ws_slot = splits > 1 ? o.n : 0;
  return finish_wgmma(&b, grad ? "wgrad_into" : "wgrad", n, pre, &o, BN, S, ws, stage, maps, r);
}

bool kiln__render_conv(const kiln__target *t, const kiln__spec *s, kiln__rendered *r) {
  switch (s->conv) {
  case KILN__IMPLICIT_DGRAD: return render_dgrad(t, s, r);
  case KILN__IMPLICIT_FPROP: return render_fprop(t, s->red, &s->gemm, &s->prog, s->moments, r);
  case KILN__IMPLICIT_WGRAD: return render_wgrad(t, s->red, &s->gemm, s->grad, &s->pro, r);
  case KILN__IMPLICIT_NONE: break;
  }
  KILN_ASSERT(!"a convolution spec without its product");
  return false;
}
