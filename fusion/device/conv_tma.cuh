/*
 * conv_tma.cuh: the three convolution products as implicit GEMMs fed by the Tensor Memory
 * Accelerator (sm_90a): an im2col-mode TMA copy gathers a stage's 128 (or 64) pixels x 64
 * channels of one tap straight into the 128-byte swizzle wgmma reads (wgmma.cuh), the padding
 * filled with zeros by the copy engine; the filters and dY come by tiled TMA copies. One thread
 * issues a stage's copies, so a block is two multiplying warpgroups and one producer warp (288
 * threads, KILN_TMA_THREADS: no register split is needed, 224 a thread hold a 64 x 256 tile of
 * accumulators), and every stage has a `full` mbarrier (its copies' bytes) and an `empty` one
 * (the eight multiplying warps), S of each behind the stages in dynamic shared memory
 * (KILN_TMA_SMEM). conv.cuh's products gather with cp.async instead, every thread computing the
 * tap, bounds and address of its 16-byte copies: latency that kept them at 230-450 TFLOP/s on
 * the air workload's 256-channel shapes (dev/README.md).
 *
 * The geometry G is conv.cuh's (NHWC images, filters Wk (CO, K), k = tap CI + c of tap (i, j) =
 * i KW + j). A stage is one tap's 64 channels, so CI % 64 == 0, and for the data gradient also
 * CO % 64 == 0 and stride 1. The tensor maps (kiln_tmap, CUtensorMap's 128 bytes) are made on the
 * host (fusion/tmap.c says what each holds): the image's im2col map, whose box corners make its
 * positions, stepped by the stride, exactly the output pixels; a copy names the first pixel's
 * window origin (c, w, h, n) and the tap's offsets (w, h), and walks along W, then H, then into
 * the next image, past the last one into zeros. The maps live in global memory (the lab passes
 * them as kernel parameters instead); kiln_tma_acquire orders their bytes, written before the
 * launch, before the copy engine reads them.
 */
#ifndef KILN_CONV_TMA_CUH
#define KILN_CONV_TMA_CUH

#include "conv.cuh"
#include "moments.cuh"
#include "pool2.cuh"

/* CUtensorMap: 128 opaque bytes, 64-byte aligned. */
struct __align__(64) kiln_tmap {
  unsigned long long w[16];
};

/* Before the first copy through a map in global memory that the host wrote. */
KILN__FN void kiln_tma_acquire(const kiln_tmap *map) {
  asm volatile("fence.proxy.tensormap::generic.acquire.sys [%0], 128;\n" ::"l"(map) : "memory");
}

#define KILN_TMA_THREADS 288 /* warps 0-7 multiply (two warpgroups), warp 8 produces */

/* Dynamic shared memory: S stages of `stage` bytes, 2 S mbarriers, 1024 to align. */
#define KILN_TMA_SMEM(stage, S) ((S) * (stage) + 16 * (S) + 1024)

KILN__FN void kiln_tma_mbar_expect(unsigned long long *bar, unsigned bytes) {
  asm volatile(
      "mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(kiln_smem_addr(bar)),
      "r"(bytes)
      : "memory");
}

/* kiln_mbar_wait with a deadline: a stage's copies or products that never arrive (a fault in
 * the copy engine's view of a map) trap after KILN_TMA_WAIT_NS of waiting, an error for the
 * host, instead of hanging the device. The deadline is wall time (%globaltimer), which runs on
 * while cuda-gdb holds the device at a breakpoint: resuming after 10 s there traps. */
#ifndef KILN_TMA_WAIT_NS
#define KILN_TMA_WAIT_NS 10000000000ull /* 10 s: a stage takes microseconds */
#endif
KILN__FN void kiln_tma_mbar_wait(unsigned long long *bar, unsigned parity) {
  unsigned long long t0 = 0;
  while (!kiln_mbar_try(bar, parity)) {
    unsigned long long now;
    asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(now));
    if (t0 == 0)
      t0 = now;
    else if (now - t0 > KILN_TMA_WAIT_NS)
      __trap();
  }
}

KILN__FN void kiln_tma_im2col4(void *dst, const kiln_tmap *map, unsigned long long *bar, int c,
                               int w, int h, int n, int off_w, int off_h) {
  asm volatile("cp.async.bulk.tensor.4d.shared::cluster.global.im2col.mbarrier::complete_tx::bytes"
               " [%0], [%1, {%2, %3, %4, %5}], [%6], {%7, %8};\n" ::"r"(kiln_smem_addr(dst)),
               "l"((unsigned long long)map), "r"(c), "r"(w), "r"(h), "r"(n),
               "r"(kiln_smem_addr(bar)), "h"((unsigned short)off_w), "h"((unsigned short)off_h)
               : "memory");
}

KILN__FN void kiln_tma_tile2(void *dst, const kiln_tmap *map, unsigned long long *bar, int x,
                             int y) {
  asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
               " [%0], [%1, {%2, %3}], [%4];\n" ::"r"(kiln_smem_addr(dst)),
               "l"((unsigned long long)map), "r"(x), "r"(y), "r"(kiln_smem_addr(bar))
               : "memory");
}

KILN__FN void kiln_tma_tile3(void *dst, const kiln_tmap *map, unsigned long long *bar, int x, int y,
                             int z) {
  asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
               " [%0], [%1, {%2, %3, %4}], [%5];\n" ::"r"(kiln_smem_addr(dst)),
               "l"((unsigned long long)map), "r"(x), "r"(y), "r"(z), "r"(kiln_smem_addr(bar))
               : "memory");
}

/* The stages' barriers made, seen by the copy engine and every thread. */
template <int S> KILN__FN void kiln_tma_init_barriers(unsigned long long *full) {
  if (threadIdx.x == 0) {
    for (int s = 0; s < S; s++) {
      kiln_mbar_init(&full[s], 1);     /* the producer's arrival, with the stage's bytes */
      kiln_mbar_init(&full[S + s], 8); /* empty: every multiplying warp */
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
}

/* The window origin of output pixel m: (w, h, n) of the first tap's input position. */
template <class G> KILN__FN void kiln_tma_origin(int m, int &w, int &h, int &n) {
  const int ow = m % G::OW, r = m / G::OW, oh = r % G::OH;
  n = r / G::OH;
  w = ow * G::SW - G::PW;
  h = oh * G::SH - G::PH;
}

/* The producer's loop: KT stages, stage kt's copies issued by issue(kt, st) once the stage is
 * free, after the barrier is told the stage's bytes; the KT stages are the it0-th on (a persistent
 * block's later tiles, kiln_tma_consume's). */
template <int S, class F>
KILN__FN void kiln_tma_produce(int KT, unsigned long long *full, int bytes, F issue, int it0 = 0) {
  unsigned long long *empty = full + S;
  int st = it0 % S, ph = (it0 / S) & 1; /* stage it0 + kt's place and its round's parity */
  for (int kt = 0; kt < KT; kt++) {
    if (it0 + kt >= S) kiln_tma_mbar_wait(&empty[st], ph ^ 1);
    kiln_tma_mbar_expect(&full[st], bytes);
    issue(kt, st);
    if (++st == S) st = 0, ph ^= 1;
  }
}

/* The multipliers' loop: d zeroed, then each stage's products once its bytes have landed; a
 * stage is given back when the products after it have been issued and its own are done (the
 * last one is not: the caller's, where more tiles follow). The KT stages are the producer's
 * it0-th to (it0 + KT - 1)-th (a persistent block's later tiles start past 0). */
template <int S, int N, class F>
KILN__FN void kiln_tma_consume(int KT, unsigned long long *full, float (&d)[N], F mma,
                               int it0 = 0) {
  unsigned long long *empty = full + S;
#pragma unroll
  for (int i = 0; i < N; i++)
    d[i] = 0.f;
  int st = it0 % S, ph = (it0 / S) & 1, prev = (st + S - 1) % S; /* kt's stage, parity; kt - 1's */
  for (int kt = 0; kt < KT; kt++) {
    kiln_tma_mbar_wait(&full[st], ph);
    kiln_wg_pin(d);
    kiln_wg_fence();
    mma(st);
    kiln_wg_commit();
    kiln_wg_wait<1>();
    kiln_wg_pin(d);
    if (kt > 0 && (threadIdx.x & 31) == 0) kiln_mbar_arrive(&empty[prev]);
    prev = st;
    if (++st == S) st = 0, ph ^= 1;
  }
  kiln_wg_wait<0>();
  kiln_wg_pin(d);
}

/* What the three products share: KT stages of `stage` bytes from base (1024-aligned), their
 * barriers behind them; thread 256 issues stage kt's copies with issue(kt, st, bar) (bar the
 * stage's `full` barrier, armed with its bytes), threads 0-255 multiply with mma(tile, wg) (tile
 * the stage's bytes, wg the thread's warpgroup) into d. Returns whether this thread holds
 * accumulators (the multipliers). */
template <int S, int N, class I, class M>
KILN__FN bool kiln_tma_run(int KT, unsigned char *base, int stage, float (&d)[N], I issue, M mma) {
  unsigned long long *full = (unsigned long long *)(base + S * stage);
  kiln_tma_init_barriers<S>(full);
  if (threadIdx.x >= 256) {
    if (threadIdx.x == 256)
      kiln_tma_produce<S>(KT, full, stage, [&](int kt, int st) { issue(kt, st, &full[st]); });
    return false;
  }
  const int wg = threadIdx.x >> 7;
  kiln_tma_consume<S>(KT, full, d, [&](int st) { mma(base + st * stage, wg); });
  return true;
}

/* A forward product's stage t multiplied into d by warpgroup wg: its 64 of the 128 rows of A
 * (pixels x one tap's 64 channels) by the BN columns of B (the filters), 16 of the reduction at a
 * time, 32 bytes along the rows. */
template <int BN>
KILN__FN void kiln_tma_fprop_mma(float (&d)[BN / 2], const unsigned char *t, int wg) {
  const unsigned long long a = kiln_wg_desc<16, 1024>(t + wg * 64 * 128),
                           b = kiln_wg_desc<16, 1024>(t + 128 * 128);
#pragma unroll
  for (int ks = 0; ks < 4; ks++)
    kiln_wgmma<BN, 0, 0>(d, kiln_wg_desc_plus(a, ks * 32), kiln_wg_desc_plus(b, ks * 32));
}

/* The forward product Y (M, CO) of pixels [m0, m0 + 128) and channels [n0, n0 + BN): ta the
 * image's im2col map (128 pixels a copy), tb the filters' tiled map (box 64 x BN). */
template <class G, int BN, int S>
KILN__FN bool kiln_conv_fprop_tma(const kiln_tmap *ta, const kiln_tmap *tb, int m0, int n0,
                                  unsigned char *smem, float (&d)[BN / 2]) {
  constexpr int STAGE = (128 + BN) * 128, CH = G::CI / 64, KT = G::KH * G::KW * CH;
  static_assert(G::CI % 64 == 0 && BN % 64 == 0 && BN <= 256 && S >= 2, "kiln_conv_fprop_tma");
  unsigned char *base = kiln_align1024(smem);
  int w, h, n;
  kiln_tma_origin<G>(m0, w, h, n);
  return kiln_tma_run<S>(
      KT, base, STAGE, d,
      [&](int kt, int st, unsigned long long *bar) {
        unsigned char *as = base + st * STAGE;
        const int tap = kt / CH, c = (kt % CH) * 64;
        kiln_tma_im2col4(as, ta, bar, c, w, h, n, (tap % G::KW) * G::DW, (tap / G::KW) * G::DH);
        kiln_tma_tile2(as + 128 * 128, tb, bar, kt * 64, n0);
      },
      [&](const unsigned char *t, int wg) { kiln_tma_fprop_mma<BN>(d, t, wg); });
}

/* The forward product of whole rows for a 2x2 max pool at stride 2 after it (kiln_tma_pool_tile):
 * the block's 128 rows are 128 / (2 B) pairs of output rows (2 r, 2 r + 1) of an image, from pair
 * q0 on (pairs numbered (n, r) over the pooled image's N x OH / 2 rows), each output row B pixels
 * from column 0 (a copy of B pixels a row: B >= OW / 2 * 2, the rest unused; pairs past the last
 * one copy the last one's again, never stored). The rows' values are those the forward product
 * computes for the same pixels. */
template <class G, int BN, int S, int B>
KILN__FN bool kiln_conv_fprop_tma_pairs(const kiln_tmap *ta, const kiln_tmap *tb, int q0, int n0,
                                        unsigned char *smem, float (&d)[BN / 2]) {
  constexpr int STAGE = (128 + BN) * 128, CH = G::CI / 64, KT = G::KH * G::KW * CH;
  constexpr int POH = G::OH / 2, PAIRS = G::N * POH;
  static_assert(G::CI % 64 == 0 && BN % 64 == 0 && BN <= 256 && S >= 2 && B >= 8 && B <= 64 &&
                    (B & (B - 1)) == 0 && G::OW / 2 * 2 <= B,
                "kiln_conv_fprop_tma_pairs");
  unsigned char *base = kiln_align1024(smem);
  return kiln_tma_run<S>(
      KT, base, STAGE, d,
      [&](int kt, int st, unsigned long long *bar) {
        unsigned char *as = base + st * STAGE;
        const int tap = kt / CH, c = (kt % CH) * 64;
#pragma unroll 1
        for (int q = 0; q < 128 / B; q++) {
          const int pr = q0 + q / 2 < PAIRS ? q0 + q / 2 : PAIRS - 1;
          const int oh = pr % POH * 2 + q % 2;
          kiln_tma_im2col4(as + q * B * 128, ta, bar, c, -G::PW, oh * G::SH - G::PH, pr / POH,
                           (tap % G::KW) * G::DW, (tap / G::KW) * G::DH);
        }
        kiln_tma_tile2(as + 128 * 128, tb, bar, kt * 64, n0);
      },
      [&](const unsigned char *t, int wg) { kiln_tma_fprop_mma<BN>(d, t, wg); });
}

/* A data gradient's stage t multiplied into d by warpgroup wg: its 64 of the 128 rows of A (dY's
 * pixels x one tap's 64 channels) by BN / 64 panels of the filters (64 rows of the reduction's
 * co by 64 input channels, MN-major), 16 of the reduction at a time. */
template <int BN>
KILN__FN void kiln_tma_dgrad_mma(float (&d)[BN / 2], const unsigned char *t, int wg) {
  const unsigned long long a = kiln_wg_desc<16, 1024>(t + wg * 64 * 128),
                           b = kiln_wg_desc<8192, 1024>(t + 128 * 128);
#pragma unroll
  for (int ks = 0; ks < 4; ks++) /* B: 16 rows of 128 bytes */
    kiln_wgmma<BN, 0, 1>(d, kiln_wg_desc_plus(a, ks * 32), kiln_wg_desc_plus(b, ks * 2048));
}

/* Stage kt's copies of a stride-1 data gradient's tile (kiln_conv_dgrad_tma) into as, behind its
 * barrier bar: dY's 128 pixels from window origin (w0 - PW, h0 - PH) of image n, one tap's 64
 * channels, and the flipped filters' panels of that tap for columns [n0, n0 + BN). */
template <class G, int BN>
KILN__FN void kiln_tma_dgrad_issue(unsigned char *as, const kiln_tmap *ta, const kiln_tmap *tw,
                                   unsigned long long *bar, int kt, int w0, int h0, int n, int n0) {
  constexpr int CH = G::CO / 64, TAPS = G::KH * G::KW;
  constexpr int PH = G::DH * (G::KH - 1) - G::PH, PW = G::DW * (G::KW - 1) - G::PW;
  unsigned char *bs = as + 128 * 128;
  const int tap = kt / CH, c = (kt % CH) * 64; /* tap t' of the flipped filters */
  kiln_tma_im2col4(as, ta, bar, c, w0 - PW, h0 - PH, n, (tap % G::KW) * G::DW,
                   (tap / G::KW) * G::DH);
#pragma unroll
  for (int p = 0; p < BN / 64; p++)
    kiln_tma_tile3(bs + p * 8192, tw, bar, n0 + 64 * p, TAPS - 1 - tap, c);
}

/* The data gradient of a stride-1 convolution, dX (N H W, CI) for pixels [m0, m0 + 128) of dX
 * and channels [n0, n0 + BN): the forward product of dY with the filters flipped, whose tap t'
 * reads dY at offset t' of a window padded by D (k - 1) - P. ta: dY's im2col map for that
 * geometry (128 pixels a copy); tw: the filters as a 3-D map {CI, taps, CO}, box {64, 1, 64}: a
 * panel of 64 rows (the reduction's co) of 64 input channels, MN-major. */
template <class G, int BN, int S>
KILN__FN bool kiln_conv_dgrad_tma(const kiln_tmap *ta, const kiln_tmap *tw, int m0, int n0,
                                  unsigned char *smem, float (&d)[BN / 2]) {
  constexpr int STAGE = (128 + BN) * 128, KT = G::KH * G::KW * (G::CO / 64);
  static_assert(G::CO % 64 == 0 && G::CI % 64 == 0 && G::SH == 1 && G::SW == 1 && BN % 64 == 0 &&
                    BN <= 256 && S >= 2,
                "kiln_conv_dgrad_tma");
  unsigned char *base = kiln_align1024(smem);
  const int w0 = m0 % G::W, r = m0 / G::W, h0 = r % G::H, n = r / G::H;
  return kiln_tma_run<S>(
      KT, base, STAGE, d,
      [&](int kt, int st, unsigned long long *bar) {
        kiln_tma_dgrad_issue<G, BN>(base + st * STAGE, ta, tw, bar, kt, w0, h0, n, n0);
      },
      [&](const unsigned char *t, int wg) { kiln_tma_dgrad_mma<BN>(d, t, wg); });
}

/* The taps of one phase (py, px) of a strided convolution's data gradient (dilation 1): dX's
 * pixels (SH a + py, SW b + px) sum, over the taps (kh, kw) with kh = py + PH and kw = px + PW
 * modulo the strides, dY at (a + dy, b + dx), dy = (py + PH - kh) / SH, dx likewise: every tap's
 * product lands on a pixel, none on the zeros a stride-1 product over a dilated dY would add. The
 * phase's taps are th x tw, from (kh0, kw0) in steps of the strides. */
struct kiln_tma_phase {
  int kh0, kw0, th, tw;
};
template <class G> KILN__FN kiln_tma_phase kiln_tma_phase_of(int py, int px) {
  kiln_tma_phase f;
  f.kh0 = (py + G::PH) % G::SH;
  f.kw0 = (px + G::PW) % G::SW;
  f.th = f.kh0 < G::KH ? (G::KH - f.kh0 + G::SH - 1) / G::SH : 0;
  f.tw = f.kw0 < G::KW ? (G::KW - f.kw0 + G::SW - 1) / G::SW : 0;
  return f;
}

/* The data gradient of a convolution at stride SH x SW (dilation 1), one phase at a time: dX's
 * pixels (SH a + py, SW b + px), numbered (n, a, b) over N x H / SH x W / SW (= OH x OW), for
 * rows [m0, m0 + 128) of that numbering and channels [n0, n0 + BN), as a product of dY with the
 * phase's taps (kiln_tma_phase) of the filters, unflipped. ta: dY's im2col map over its own
 * pixels, both box corners at (G::LH, G::LW) (the least dy and dx of any phase's taps, <= 0), a
 * tap's offsets dy - LH and dx - LW; tw: kiln_conv_dgrad_tma's filter map. A phase without taps
 * (a 1x1 filter's odd pixels) has no products: its accumulators stay zero. */
template <class G, int BN, int S>
KILN__FN bool kiln_conv_dgrad_tma_phase(const kiln_tmap *ta, const kiln_tmap *tw, int py, int px,
                                        int m0, int n0, unsigned char *smem, float (&d)[BN / 2]) {
  constexpr int STAGE = (128 + BN) * 128, CH = G::CO / 64;
  static_assert(G::CO % 64 == 0 && G::CI % 64 == 0 && G::DH == 1 && G::DW == 1 &&
                    G::H == G::OH * G::SH && G::W == G::OW * G::SW && G::LH <= 0 && G::LW <= 0 &&
                    BN % 64 == 0 && BN <= 256 && S >= 2,
                "kiln_conv_dgrad_tma_phase");
  unsigned char *base = kiln_align1024(smem);
  const kiln_tma_phase f = kiln_tma_phase_of<G>(py, px);
  const int b0 = m0 % G::OW, r = m0 / G::OW, a0 = r % G::OH, n = r / G::OH;
  return kiln_tma_run<S>(
      f.th * f.tw * CH, base, STAGE, d,
      [&](int kt, int st, unsigned long long *bar) {
        unsigned char *as = base + st * STAGE, *bs = as + 128 * 128;
        const int j = kt / CH, c = (kt % CH) * 64;
        const int kh = f.kh0 + G::SH * (j / f.tw), kw = f.kw0 + G::SW * (j % f.tw);
        const int dy = (py + G::PH - kh) / G::SH, dx = (px + G::PW - kw) / G::SW; /* exact */
        kiln_tma_im2col4(as, ta, bar, c, b0 + G::LW, a0 + G::LH, n, dx - G::LW, dy - G::LH);
#pragma unroll
        for (int p = 0; p < BN / 64; p++)
          kiln_tma_tile3(bs + p * 8192, tw, bar, n0 + 64 * p, kh * G::KW + kw, c);
      },
      [&](const unsigned char *t, int wg) { kiln_tma_dgrad_mma<BN>(d, t, wg); });
}

/* The weight gradient's partial sum over pixels [p0, p1) (p0 a multiple of 64) for rows
 * [k0, k0 + 128) of dWt (K, CO) and columns [n0, n0 + BN): a stage is 64 pixels, A two panels of
 * im2col(X) (64 pixels x one tap's 64 channels each: tx, X's im2col map with 64 pixels a copy),
 * B BN / 64 panels of dY (ty: dY (M, CO) as a tiled map, box 64 x 64). Both MN-major. */
template <class G, int BN, int S>
KILN__FN bool kiln_conv_wgrad_tma(const kiln_tmap *tx, const kiln_tmap *ty, int k0, int n0, int p0,
                                  int p1, unsigned char *smem, float (&d)[BN / 2]) {
  constexpr int STAGE = (2 + BN / 64) * 8192;
  static_assert(G::CI % 64 == 0 && BN % 64 == 0 && BN <= 256 && S >= 2, "kiln_conv_wgrad_tma");
  unsigned char *base = kiln_align1024(smem);
  int tap[2], ch[2];
  for (int q = 0; q < 2; q++) {
    const int k = k0 + 64 * q < G::K ? k0 + 64 * q : G::K - 64; /* past K: any tap, unused */
    tap[q] = k / G::CI;
    ch[q] = k % G::CI;
  }
  return kiln_tma_run<S>((p1 - p0 + 63) / 64, base, STAGE, d,
                         [&](int kt, int st, unsigned long long *bar) {
                           unsigned char *as = base + st * STAGE, *bs = as + 2 * 8192;
                           const int p = p0 + kt * 64;
                           int w, h, n;
                           kiln_tma_origin<G>(p, w, h, n);
#pragma unroll
                           for (int q = 0; q < 2; q++)
                             kiln_tma_im2col4(as + q * 8192, tx, bar, ch[q], w, h, n,
                                              (tap[q] % G::KW) * G::DW, (tap[q] / G::KW) * G::DH);
#pragma unroll
                           for (int q = 0; q < BN / 64; q++)
                             kiln_tma_tile2(bs + q * 8192, ty, bar, n0 + 64 * q, p);
                         },
                         [&](const unsigned char *t, int wg) {
                           const unsigned long long a = kiln_wg_desc<8192, 1024>(t + wg * 8192),
                                                    b = kiln_wg_desc<8192, 1024>(t + 2 * 8192);
#pragma unroll
                           for (int ks = 0; ks < 4; ks++) /* 16 pixels: 16 rows of 128 bytes */
                             kiln_wgmma<BN, 1, 1>(d, kiln_wg_desc_plus(a, ks * 2048),
                                                  kiln_wg_desc_plus(b, ks * 2048));
                         });
}

/* A two-warpgroup block's accumulators d (128 rows, BN columns) as bf16 in shared memory at tile,
 * rows of KILN_TMA_PITCH(BN) bytes (the 16 past the row keep a warp's eight rows on distinct
 * banks), for the block to read back a row's neighbouring chunks with neighbouring threads.
 * Every multiplier calls it (a named barrier of 256), after its last products: the stages are
 * free then (every copy has landed and been read). */
#define KILN_TMA_PITCH(BN) ((BN)*2 + 16)
template <int BN> KILN__FN void kiln_tma_stage_tile(const float (&d)[BN / 2], unsigned char *tile) {
  kiln_named_sync(1, 256); /* both warpgroups' last products have read their stages */
  const int r0 = kiln_conv_row0<false>(), lane = threadIdx.x & 31;
#pragma unroll
  for (int j = 0; j < BN / 8; j++)
#pragma unroll
    for (int h = 0; h < 2; h++)
      *(unsigned *)(tile + (r0 + 8 * h) * KILN_TMA_PITCH(BN) + (8 * j + 2 * (lane & 3)) * 2) =
          kiln_bf16x2_bits(d[4 * j + 2 * h], d[4 * j + 2 * h + 1]);
  kiln_named_sync(1, 256);
}

/* Four values of a staged tile: row `row`, columns [col, col + 4) (col a multiple of 4). */
template <int BN>
KILN__FN void kiln_tma_tile_get4(const unsigned char *tile, int row, int col, float *v) {
  kiln_load4((const kiln_bf16 *)(tile + row * KILN_TMA_PITCH(BN)) + col, v);
}

/* A kiln_conv_fprop_tma_pairs block's accumulators d, staged as bf16 through the freed stages at
 * tile (kiln_tma_stage_tile), max-pooled over 2x2 windows at stride 2 into y (N, OH / 2, OW / 2,
 * CO) at columns [n0, n0 + BN): a window's 8-channel chunk a thread at a time. With at, each
 * value's window position p * 2 + q (its first maximum, NaN winning) as a byte indexed like y, as
 * window.cuh's kiln_max_pool_at writes them; by construction the same values (pool2.cuh). */
template <class G, int BN, int B>
KILN__FN void kiln_tma_pool_tile(const float (&d)[BN / 2], unsigned char *tile, int q0, int n0,
                                 kiln_bf16 *__restrict__ y, unsigned char *__restrict__ at) {
  constexpr int POH = G::OH / 2, POW = G::OW / 2, CHUNKS = BN / 8, WINDOWS = 128 / B / 2 * POW;
  static_assert(G::CO % 8 == 0, "kiln_tma_pool_tile: whole chunks");
  kiln_tma_stage_tile<BN>(d, tile);
  for (int i = threadIdx.x; i < WINDOWS * CHUNKS; i += 256) {
    const int ch = i % CHUNKS, win = i / CHUNKS, pair = win / POW, pc = win % POW;
    const int pr = q0 + pair, c = n0 + ch * 8;
    if (pr >= G::N * POH || c >= G::CO) continue;
    const int rows[4] = {2 * pair * B + 2 * pc, 2 * pair * B + 2 * pc + 1,
                         (2 * pair + 1) * B + 2 * pc, (2 * pair + 1) * B + 2 * pc + 1};
    float best[8];
    int pos[8];
#pragma unroll
    for (int t = 0; t < 4; t++) {
      float v[8];
      kiln_tma_tile_get4<BN>(tile, rows[t], ch * 8, v);
      kiln_tma_tile_get4<BN>(tile, rows[t], ch * 8 + 4, v + 4);
      kiln_pool2_tap(t, v, best, pos);
    }
    /* pr = n POH + the pooled row */
    kiln_pool2_store(y, at, ((long long)pr * POW + pc) * G::CO + c, best, pos);
  }
}

/* Asks L2 for `bytes` (a multiple of 16) from p (16-byte aligned), without waiting. */
KILN__FN void kiln_tma_prefetch_l2(const void *p, unsigned bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(p), "r"(bytes) : "memory");
}

/* Batch norm's gradient sums over a staged epilogue's block of 128 rows (render_conv.c): each
 * thread summed, over the rows it took, the four channels of its chunk (the epilogue's
 * q = threadIdx.x + 256 k keeps it), reduced through the tile, free once every thread has read it
 * (moments.cuh's kiln_block_moments). */
template <int BN>
KILN__FN void kiln_tma_tile_moments(const float (&s)[8], unsigned char *tile, float *out, int n0,
                                    int C) {
  static_assert(8 * 256 * 4 <= 128 * KILN_TMA_PITCH(BN), "the tile's room");
  kiln_block_moments<BN / 4>(s, (float *)tile, out, blockIdx.x, n0, C);
}

/* A forward product's accumulators d (128 rows from m0, BN columns from n0) stored as bf16 into y
 * (rows x cols, row-major, cols a multiple of 4) through the staged tile, a thread's four columns
 * of a row at a time, the same four in every row it takes (256 % (BN / 4) == 0), which it sums as
 * batch norm's statistics: the stored values v less k (per column, the shift), and their squares,
 * over the block's rows, into the moments node's partial sums out (P, 2, cols), row blockIdx.x
 * (kiln_tma_tile_moments); the values the moments kernel would read back from y. */
template <int BN>
KILN__FN void kiln_tma_store_tile_moments(kiln_bf16 *__restrict__ y, int m0, int n0, int rows,
                                          int cols, const float (&d)[BN / 2], unsigned char *tile,
                                          const float *__restrict__ k, float *__restrict__ out) {
  constexpr int CHUNKS = BN / 4;
  static_assert(256 % CHUNKS == 0, "kiln_tma_store_tile_moments: a thread keeps its columns");
  kiln_tma_stage_tile<BN>(d, tile);
  const int ch = threadIdx.x % CHUNKS, c = n0 + ch * 4;
  float kv[4] = {0.f, 0.f, 0.f, 0.f}, s[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  if (c < cols) kiln_load4(k + c, kv);
  for (int q = threadIdx.x; q < 128 * CHUNKS; q += 256) {
    const int m = m0 + q / CHUNKS;
    if (m >= rows || c >= cols) continue;
    float v[4];
    kiln_tma_tile_get4<BN>(tile, q / CHUNKS, ch * 4, v);
    kiln_store4(y + (long long)m * cols + c, v);
#pragma unroll
    for (int l = 0; l < 4; l++) {
      const float e = v[l] - kv[l];
      s[l] += e;
      s[4 + l] += e * e;
    }
  }
  kiln_tma_tile_moments<BN>(s, tile, out, n0, cols);
}

/* Stores a two-warpgroup block's accumulators d (128 rows from m0, BN columns from n0) as bf16
 * into out (rows x cols, row-major) through the freed stages at tile (kiln_tma_stage_tile), the
 * block storing whole 16-byte chunks, a row's by neighbouring threads. The 4-byte stores straight
 * from the registers leave half of each 32-byte sector to another warp's store; on air's 256-wide
 * forward products this took 97.7 -> 87.2 us (7x7x256->256) and 180.8 -> 159.4 (15x15x64->256) in
 * dev/conv_engine's lab (H100), and did not pay at 64 or 128 columns. */
template <int BN>
KILN__FN void kiln_tma_store_tile(kiln_bf16 *out, int m0, int n0, int rows, int cols,
                                  const float (&d)[BN / 2], unsigned char *tile) {
  constexpr int CHUNKS = BN / 8;
  kiln_tma_stage_tile<BN>(d, tile);
  for (int q = threadIdx.x; q < 128 * CHUNKS; q += 256) {
    const int row = q / CHUNKS, c = n0 + (q % CHUNKS) * 8, m = m0 + row;
    const unsigned char *src = tile + row * KILN_TMA_PITCH(BN) + (q % CHUNKS) * 16;
    if (m >= rows || c >= cols) continue;
    if (cols % 8 == 0) /* then c + 8 <= cols */
      *(uint4 *)&out[(long long)m * cols + c] = *(const uint4 *)src;
    else
      for (int e = 0; e < 8 && c + e < cols; e++)
        out[(long long)m * cols + c + e] = ((const kiln_bf16 *)src)[e];
  }
}

/* ----------------------------------------------- data gradients with warps for their epilogue */

/* KILN_CONV_DGRAD_WS=1 (render_conv.c): a persistent block (one an SM) takes tiles blockIdx.x,
 * blockIdx.x + gridDim.x, ... of a stride-1 data gradient; its two multiplying warpgroups
 * (threads 0-255) compute a tile as kiln_conv_dgrad_tma's do, stage it as bf16 in one of two
 * rooms and go on to the next tile's products, while two warpgroups of their own (threads
 * 256-511) run the staged tile's epilogue; warp 16 copies the stages. In the two-block kernel
 * both blocks of an SM multiply together and store together, and the tensor cores idle through
 * their epilogues (batch norm applied again, an activation's derivative, batch norm's backward
 * sums: about 75 instructions a value in air's); with warpgroups taking turns (4e7f019, reverted)
 * one warp a scheduler ran the epilogue, which then outlasted the products (dev/README.md). The
 * epilogue threads are numbered as the two-block kernel's (threadIdx.x - 256), so its values and
 * sums are that kernel's, bitwise. Dynamic shared memory: S stages, 2 S + 4 mbarriers in 1024
 * bytes, R rooms (1 or 2) of 128 rows of KILN_TMA_PITCH(BN) bytes, 1024 to align
 * (KILN_TMA_WS_SMEM). One room leaves a stage more (5 of 128 columns, not 4); the products of the
 * next tile wait for it only where a tile's epilogue outlasts a tile's products. */
#define KILN_TMA_WS_THREADS 544 /* warps 0-7 multiply, 8-15 store, 16 produces */
#define KILN_TMA_WS_SMEM(stage, S, BN, R)                                                          \
  ((S) * (stage) + 1024 + (R)*128 * KILN_TMA_PITCH(BN) + 1024)

/* The loop: issue(tile, kt, st, bar) copies stage kt of a tile (the producer), after(tile, r0, r1)
 * follows each stage's copies with the producer's requests for rows [r0, r1) of the tile's
 * epilogue operands, a few a stage (all 128 after the tile's last copies, about 1,000
 * instructions of the one thread, can hold the next tile's first copies back), mma(d, stage, wg)
 * multiplies a stage into a multiplying warpgroup's accumulators, epi(tile, room) stores a staged
 * tile (the epilogue's threads). The stages carry on from tile to tile in the producer's order;
 * room j % R takes the block's tile j once its epilogue has freed it from tile j - R. */
template <int S, int BN, int R, class I, class A, class M, class E>
KILN__FN void kiln_tma_epilogue_ws(int tiles, int KT, unsigned char *base, int stage, I issue,
                                   A after, M mma, E epi) {
  unsigned long long *full = (unsigned long long *)(base + S * stage), *empty = full + S,
                     *ready = full + 2 * S, *freed = ready + 2;
  static_assert((2 * S + 4) * 8 <= 1024 && (R == 1 || R == 2), "kiln_tma_epilogue_ws");
  if (threadIdx.x == 0) {
    for (int s = 0; s < S; s++) {
      kiln_mbar_init(&full[s], 1);  /* the producer's arrival, with the stage's bytes */
      kiln_mbar_init(&empty[s], 8); /* every multiplying warp */
    }
    for (int r = 0; r < R; r++) {
      kiln_mbar_init(&ready[r], 8); /* the multiplying warps, a tile staged */
      kiln_mbar_init(&freed[r], 8); /* the epilogue's warps, done with it */
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  const int lane = threadIdx.x & 31;
  unsigned char *rooms = base + S * stage + 1024;
  if (threadIdx.x >= 512) {
    if (threadIdx.x == 512)
      for (int j = 0, tile = blockIdx.x; tile < tiles; j++, tile += gridDim.x) {
        kiln_tma_produce<S>(
            KT, full, stage,
            [&](int kt, int st) {
              issue(tile, kt, st, &full[st]);
              after(tile, kt * 128 / KT, (kt + 1) * 128 / KT);
            },
            j * KT);
      }
    return;
  }
  if (threadIdx.x >= 256) { /* the epilogue's warps */
    for (int j = 0, tile = blockIdx.x; tile < tiles; j++, tile += gridDim.x) {
      kiln_tma_mbar_wait(&ready[j % R], (j / R) & 1);
      epi(tile, rooms + j % R * 128 * KILN_TMA_PITCH(BN));
      __syncwarp();
      if (lane == 0) kiln_mbar_arrive(&freed[j % R]);
    }
    return;
  }
  const int wg = threadIdx.x >> 7;
  float d[BN / 2];
  for (int j = 0, tile = blockIdx.x; tile < tiles; j++, tile += gridDim.x) {
    kiln_tma_consume<S>(
        KT, full, d, [&](int st) { mma(d, base + st * stage, wg); }, j * KT);
    if (lane == 0) kiln_mbar_arrive(&empty[(j * KT + KT - 1) % S]); /* the tile's last stage */
    if (j >= R) kiln_tma_mbar_wait(&freed[j % R], (j / R - 1) & 1);
    kiln_tma_stage_tile<BN>(d, rooms + j % R * 128 * KILN_TMA_PITCH(BN));
    if (lane == 0) kiln_mbar_arrive(&ready[j % R]); /* after the stage's closing barrier */
  }
}

/* A stride-1 data gradient's tiles with warps for their epilogue: kiln_conv_dgrad_tma's products,
 * tile t of dX's pixels [128 (t / NT), + 128) and channels [BN (t % NT), + BN), NT = ceil(CI / BN)
 * tiles across. after(m0, n0, r0, r1) and epi(m0, n0, room) as kiln_tma_epilogue_ws's, with the
 * tile's corner. */
template <class G, int BN, int S, int R, class A, class E>
KILN__FN void kiln_conv_dgrad_tma_ws(const kiln_tmap *ta, const kiln_tmap *tw, int tiles,
                                     unsigned char *smem, A after, E epi) {
  constexpr int STAGE = (128 + BN) * 128, KT = G::KH * G::KW * (G::CO / 64);
  constexpr int NT = (G::CI + BN - 1) / BN;
  static_assert(G::CO % 64 == 0 && G::CI % 64 == 0 && G::SH == 1 && G::SW == 1 && BN % 64 == 0 &&
                    BN <= 128 && S >= 2,
                "kiln_conv_dgrad_tma_ws");
  unsigned char *base = kiln_align1024(smem);
  kiln_tma_epilogue_ws<S, BN, R>(
      tiles, KT, base, STAGE,
      [&](int tile, int kt, int st, unsigned long long *bar) {
        const int m0 = tile / NT * 128, n0 = tile % NT * BN;
        const int w0 = m0 % G::W, r = m0 / G::W, h0 = r % G::H, n = r / G::H;
        kiln_tma_dgrad_issue<G, BN>(base + st * STAGE, ta, tw, bar, kt, w0, h0, n, n0);
      },
      [&](int tile, int r0, int r1) { after(tile / NT * 128, tile % NT * BN, r0, r1); },
      [&](float(&d)[BN / 2], const unsigned char *t, int wg) { kiln_tma_dgrad_mma<BN>(d, t, wg); },
      [&](int tile, unsigned char *room) { epi(tile / NT * 128, tile % NT * BN, room); });
}

/* kiln_tma_tile_moments for the epilogue's warps of kiln_tma_epilogue_ws (threads 256-511, named
 * barrier 2), m-tile `row` of the partial sums. */
template <int BN>
KILN__FN void kiln_tma_tile_moments_ws(const float (&s)[8], unsigned char *tile, float *out,
                                       int row, int n0, int C) {
  static_assert(8 * 256 * 4 <= 128 * KILN_TMA_PITCH(BN), "the tile's room");
  kiln_block_moments_at<BN / 4>(s, (float *)tile, out, row, n0, C, (int)threadIdx.x - 256, 2);
}

#endif
