// resident.cuh: a lab experiment, not yet in the library nor run: the TMA-fed forward product of a
// convolution into 64 channels with all of its filters resident in shared memory. Air's
// 15x15x64->64 layer reduces over K = 576 (72 KB of bf16 filters): a block loads them once, then
// streams only the image's im2col tiles, 16 KB a stage for 1 MFLOP where the library's kernel
// brings 24 KB (the filters' 64 x 64 box again with every stage), tile after tile (one block an
// SM, the producer copying the next tile's stages while the multipliers store one). On the H200
// the library's kernel took 58.5 us (290 TFLOP/s) against cuDNN's 46.8; its stages' copies are
// what its two blocks an SM wait for (dev/README.md).
#pragma once

#include "../../fusion/device/conv_tma.cuh"

/* Dynamic shared memory of fprop_tma_rb<G, S>: S stages of 128 x 128 bytes, the KT filter tiles
 * of 64 x 128 bytes, 2 S + 2 mbarriers (the last two: the filters', and 8 bytes so that the room
 * is 16-byte aligned), the room for a staged tile, 1024 to align */
template <class G> __host__ __device__ constexpr int lab_rb_kt() {
  return G::KH * G::KW * (G::CI / 64);
}
#define LAB_TMA_RB_SMEM(G, S)                                                                      \
  ((S)*128 * 128 + lab_rb_kt<G>() * 64 * 128 + (2 * (S) + 2) * 8 + 128 * KILN_TMA_PITCH(64) + 1024)

/* Block b takes the 128-pixel tiles b, b + gridDim.x, ... of Y (M, 64): ta the image's im2col
 * map (128 pixels a copy), tb the filters' tiled map (64 x 64 boxes); each tile stored through
 * the room (kiln_tma_store_tile) into y. */
template <class G, int S>
__global__ void __launch_bounds__(KILN_TMA_THREADS, 1)
    fprop_tma_rb(const __grid_constant__ CUtensorMap ta, const __grid_constant__ CUtensorMap tb,
                 kiln_bf16 *y) {
  constexpr int BN = 64, CH = G::CI / 64, KT = lab_rb_kt<G>(), STAGE = 128 * 128;
  constexpr int TILES = (int)((G::M + 127) / 128);
  static_assert(G::CO == BN && G::CI % 64 == 0 && S >= 2, "fprop_tma_rb: CI % 64 == 0 into 64");
  extern __shared__ unsigned char smem[];
  unsigned char *base = kiln_align1024(smem), *bs = base + S * STAGE;
  unsigned long long *full = (unsigned long long *)(bs + KT * 64 * 128), *bfull = full + 2 * S;
  unsigned char *room = (unsigned char *)(full + 2 * S + 2);
  const kiln_tmap *ma = (const kiln_tmap *)&ta, *mb = (const kiln_tmap *)&tb;
  if (threadIdx.x == 0) kiln_mbar_init(bfull, 1); /* made visible by the stages' fence */
  kiln_tma_init_barriers<S>(full);
  if (threadIdx.x >= 256) {
    if (threadIdx.x != 256) return;
    kiln_tma_mbar_expect(bfull, KT * 64 * 128);
    for (int kt = 0; kt < KT; kt++)
      kiln_tma_tile2(bs + kt * 64 * 128, mb, bfull, kt * 64, 0);
    for (int tile = blockIdx.x, it0 = 0; tile < TILES; tile += gridDim.x, it0 += KT) {
      int w, h, n;
      kiln_tma_origin<G>(tile * 128, w, h, n);
      kiln_tma_produce<S>(
          KT, full, STAGE,
          [&](int kt, int st) {
            const int tap = kt / CH, c = (kt % CH) * 64;
            kiln_tma_im2col4(base + st * STAGE, ma, &full[st], c, w, h, n, (tap % G::KW) * G::DW,
                             (tap / G::KW) * G::DH);
          },
          it0);
    }
    return;
  }
  const int wg = threadIdx.x >> 7;
  float d[BN / 2];
  kiln_tma_mbar_wait(bfull, 0);
  for (int tile = blockIdx.x, it0 = 0; tile < TILES; tile += gridDim.x, it0 += KT) {
    int kt = 0; /* kiln_tma_consume multiplies the stages in order, one call a stage */
    kiln_tma_consume<S>(
        KT, full, d,
        [&](int st) {
          const unsigned long long a = kiln_wg_desc<16, 1024>(base + st * STAGE + wg * 64 * 128),
                                   b = kiln_wg_desc<16, 1024>(bs + kt++ * 64 * 128);
#pragma unroll
          for (int ks = 0; ks < 4; ks++)
            kiln_wgmma<BN, 0, 0>(d, kiln_wg_desc_plus(a, ks * 32), kiln_wg_desc_plus(b, ks * 32));
        },
        it0);
    if ((threadIdx.x & 31) == 0) kiln_mbar_arrive(&full[S + (it0 + KT - 1) % S]); /* its last */
    kiln_tma_store_tile<BN>(y, tile * 128, 0, (int)G::M, G::CO, d, room);
  }
}
