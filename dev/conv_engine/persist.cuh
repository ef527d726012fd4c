// persist.cuh: a lab experiment, not yet in the library: the TMA-fed forward product with a block
// looping over tiles (one block an SM), so that the producer copies the next tile's stages while
// the multipliers store one. Run (H100, 2026-12-05, dev/README.md): no faster than a block a tile,
// its tiles stored from the registers; fprop_tma_p<..., true> (below) stores them through shared
// memory.
#pragma once

#include "../../fusion/device/conv_tma.cuh"
#include "lab_util.h" /* store_rows */

/* kiln_tma_run over several tiles a block (persistent): block b takes tiles b, b + gridDim.x, ...
 * of `tiles`, each KT stages deep. The producer runs on into the next tile's stages while the
 * multipliers finish one and store it with epi(tile, d); the stages' count and phase carry on
 * from tile to tile, and a tile's last stage is freed when its products are done. */
template <int S, int N, class I, class M, class E>
KILN__FN void kiln_tma_run_tiles(int tiles, int KT, unsigned char *base, int stage, float (&d)[N],
                                 I issue, M mma, E epi) {
  unsigned long long *full = (unsigned long long *)(base + S * stage), *empty = full + S;
  kiln_tma_init_barriers<S>(full);
  if (threadIdx.x >= 256) {
    if (threadIdx.x == 256)
      for (int tile = blockIdx.x, it = 0; tile < tiles; tile += gridDim.x)
        for (int kt = 0; kt < KT; kt++, it++) {
          const int st = it % S;
          if (it >= S) kiln_tma_mbar_wait(&empty[st], (it / S - 1) & 1);
          kiln_tma_mbar_expect(&full[st], stage);
          issue(tile, kt, st, &full[st]);
        }
    return;
  }
  const int wg = threadIdx.x >> 7, lane = threadIdx.x & 31;
  for (int tile = blockIdx.x, it = 0; tile < tiles; tile += gridDim.x) {
#pragma unroll
    for (int i = 0; i < N; i++)
      d[i] = 0.f;
    for (int kt = 0; kt < KT; kt++, it++) {
      const int st = it % S;
      kiln_tma_mbar_wait(&full[st], (it / S) & 1);
      kiln_wg_pin(d);
      kiln_wg_fence();
      mma(base + st * stage, wg);
      kiln_wg_commit();
      kiln_wg_wait<1>();
      kiln_wg_pin(d);
      if (kt > 0 && lane == 0) kiln_mbar_arrive(&empty[(it - 1) % S]);
    }
    kiln_wg_wait<0>();
    kiln_wg_pin(d);
    if (lane == 0) kiln_mbar_arrive(&empty[(it - 1) % S]);
    epi(tile, d);
  }
}

/* kiln_conv_fprop_tma over every tile of 128 pixels by BN channels, NT tiles across the channels
 * (neighbouring tiles share pixels), a block looping over them (kiln_tma_run_tiles): each tile
 * stored by epi(m0, n0, d). */
template <class G, int BN, int S, class E>
KILN__FN void kiln_conv_fprop_tma_tiles(const kiln_tmap *ta, const kiln_tmap *tb,
                                        unsigned char *smem, float (&d)[BN / 2], E epi) {
  constexpr int STAGE = (128 + BN) * 128, CH = G::CI / 64, KT = G::KH * G::KW * CH;
  constexpr int NT = (G::CO + BN - 1) / BN, TILES = (G::M + 127) / 128 * NT;
  static_assert(G::CI % 64 == 0 && BN % 64 == 0 && BN <= 256 && S >= 2, "kiln_conv_fprop_tma");
  unsigned char *base = kiln_align1024(smem);
  kiln_tma_run_tiles<S>(
      TILES, KT, base, STAGE, d,
      [&](int tile, int kt, int st, unsigned long long *bar) {
        unsigned char *as = base + st * STAGE;
        const int tap = kt / CH, c = (kt % CH) * 64;
        int w, h, n;
        kiln_tma_origin<G>(tile / NT * 128, w, h, n);
        kiln_tma_im2col4(as, ta, bar, c, w, h, n, (tap % G::KW) * G::DW, (tap / G::KW) * G::DH);
        kiln_tma_tile2(as + 128 * 128, tb, bar, kt * 64, tile % NT * BN);
      },
      [&](const unsigned char *t, int wg) {
#pragma unroll
        for (int ks = 0; ks < 4; ks++)
          kiln_wgmma<BN, 0, 0>(d, kiln_wg_desc<16, 1024>(t + wg * 64 * 128 + ks * 32),
                               kiln_wg_desc<16, 1024>(t + 128 * 128 + ks * 32));
      },
      [&](int tile, float(&acc)[BN / 2]) { epi(tile / NT * 128, tile % NT * BN, acc); });
}

/* fprop_tma with a block looping over tiles (kiln_conv_fprop_tma_tiles), one block an SM, each
 * tile stored from the registers or (STAGED) as the library's one-tile kernel stores it
 * (kiln_tma_store_tile: staged as bf16 in shared memory, then 16-byte rows) through a room of its
 * own behind the stages and their barriers, so that the producer copies the next tile's stages
 * meanwhile (LAB_TMA_PS_SMEM) */
#define LAB_TMA_PS_SMEM(BN, S) (KILN_TMA_SMEM((128 + (BN)) * 128, S) + 128 * KILN_TMA_PITCH(BN))
template <class G, int BN, int S, bool STAGED>
__global__ void __launch_bounds__(KILN_TMA_THREADS, 1)
    fprop_tma_p(const __grid_constant__ CUtensorMap ta, const __grid_constant__ CUtensorMap tb,
                kiln_bf16 *y) {
  extern __shared__ unsigned char smem[];
  float d[BN / 2];
  unsigned char *room = kiln_align1024(smem) + S * (128 + BN) * 128 + 16 * S; /* STAGED's */
  kiln_conv_fprop_tma_tiles<G, BN, S>(
      (const kiln_tmap *)&ta, (const kiln_tmap *)&tb, smem, d,
      [&](int m0, int n0, const float(&acc)[BN / 2]) {
        if constexpr (STAGED)
          kiln_tma_store_tile<BN>(y, m0, n0, G::M, G::CO, acc, room);
        else
          store_rows<BN>(y, m0 + kiln_conv_row0<false>(), n0, G::M, G::CO, acc);
      });
}
