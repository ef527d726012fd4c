// few.cuh: a lab experiment, not yet in the library: the forward product of a convolution with few
// input channels (airbench's first 3x3 conv, 24 channels into 64) from a halo tile in shared
// memory, on mma.sync (sm_80 and newer).
//
// Why: the library serves that conv with conv.cuh's wgmma kernel, which gathers every tap of every
// pixel from L2 (16-byte cp.async chunks, 27 a pixel over 9 taps): on the H100 it took 244 us at
// batch 1024 against cuDNN's 157, 520 us at batch 2000 in the CIFAR-10 example's step (the step's
// costliest kernel, 9.5% of it), where the image is 47 MB (batch 1024) and the output 126 MB.
// Here a block loads a tile's window of the image once (the halo: (TH + 2) x (TW + 2) pixels for
// TH x TW outputs, 1.6x the pixels instead of 9x), keeps the filters in shared memory for all the
// tiles it takes (a persistent block), and reads the A operand of each tap straight from the halo
// with ldmatrix, whose rows (pixels) may lie anywhere: row r of tap (i, j) is halo pixel
// (tr + i, tc + j). The next tile's halo loads while this one multiplies (two buffers).
//
// The reduction runs over K = KH KW CI in 16-byte chunks of 8 channels (27 for 3x3x24); a k16
// step takes two chunks, from the same tap or not, so 3x3x24 is 14 steps (the 28th chunk reads a
// zero chunk) instead of 18 with the channels padded to 32. At 24 channels a pixel is 48 bytes:
// the rows of an 8x8 matrix, 8 pixels in a row, fall on 8 different groups of 4 banks, and the
// filters' rows (432 bytes apart) too: ldmatrix without conflicts, no swizzle.
//
// G is lab_util.h's Shape (N, H, W, CI, OH, OW, CO, the window, M, K). CI a multiple of 8, CO 64
// (a block: 128 pixels x 64 channels, 8 warps of 32 x 32), TH TW = 128 with TW a multiple of 16
// (a 16-row tile of A lies in one output row). Y is (M, CO), bf16. STAGE: the epilogue goes
// through shared memory to store 16 bytes a lane instead of 4.
#pragma once

#include "../../fusion/device/mma.cuh"

template <class G, int TH, int TW> struct Few {
  static_assert(G::CI % 8 == 0 && G::CO == 64 && TH * TW == 128 && TW % 16 == 0, "few.cuh");
  static constexpr int CH = G::CI / 8;           /* 16-byte chunks a pixel */
  static constexpr int NCH = G::KH * G::KW * CH; /* chunks a window (a row of Wk) */
  static constexpr int KS = (NCH + 1) / 2;       /* k16 steps */
  static constexpr int HH = (TH - 1) * G::SH + (G::KH - 1) * G::DH + 1;
  static constexpr int HW = (TW - 1) * G::SW + (G::KW - 1) * G::DW + 1;
  static constexpr int HALO = HH * HW * CH; /* chunks of a halo */
  static constexpr int TILES_W = (G::OW + TW - 1) / TW, TILES_H = (G::OH + TH - 1) / TH;
  static constexpr int TILES = G::N * TILES_H * TILES_W;
  static constexpr int F_BYTES = G::CO * NCH * 16;
  static constexpr int ROW = G::CO * 2 + 16; /* a staged output row: padded, no bank conflicts */
  __host__ __device__ static constexpr int smem(bool stage) { return F_BYTES + 16 + 2 * HALO * 16 + (stage ? 128 * ROW : 0); }
  /* byte offset in the halo of chunk q of a window, from its first pixel */
  __host__ __device__ static constexpr int off(int q) {
    return ((q / CH / G::KW * G::DH) * HW + q / CH % G::KW * G::DW) * CH * 16 + q % CH * 16;
  }
};

template <class G, int TH, int TW, bool STAGE>
__global__ void __launch_bounds__(256, 2)
    few_fprop(const kiln_bf16 *__restrict__ x, const kiln_bf16 *__restrict__ wk, kiln_bf16 *y) {
  using F = Few<G, TH, TW>;
  extern __shared__ __align__(16) unsigned char smem[];
  unsigned char *filt = smem, *zero = smem + F::F_BYTES, *halo = zero + 16;
  unsigned char *stage = halo + 2 * F::HALO * 16;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  /* the filters, once: Wk (CO, K) is CO rows of NCH chunks, as the shared copy */
  for (int i = tid; i < G::CO * F::NCH; i += 256)
    kiln_cp16(filt + i * 16, wk + (long long)i * 8, true);
  if (tid < 4) ((unsigned *)zero)[tid] = 0u;
  auto load = [&](int tile, unsigned char *buf) {
    const int tw = tile % F::TILES_W, r = tile / F::TILES_W, th = r % F::TILES_H;
    const int n = r / F::TILES_H;
    const int h0 = th * TH * G::SH - G::PH, w0 = tw * TW * G::SW - G::PW;
    for (int i = tid; i < F::HALO; i += 256) {
      const int c = i % F::CH, p = i / F::CH, h = h0 + p / F::HW, w = w0 + p % F::HW;
      const bool in = h >= 0 && h < G::H && w >= 0 && w < G::W;
      const kiln_bf16 *src = in ? x + (((long long)n * G::H + h) * G::W + w) * G::CI + c * 8 : x;
      kiln_cp16(buf + i * 16, src, in);
    }
  };
  const int wm = warp & 3, wn = warp >> 2, hi = lane >> 4;
  int abase[2]; /* this lane's pixel (row lane % 16 of each of its two m16 tiles) in the halo */
#pragma unroll
  for (int mt = 0; mt < 2; mt++) {
    const int p = wm * 32 + mt * 16 + (lane & 15), tr = p / TW, tc = p % TW;
    abase[mt] = ((tr * G::SH) * F::HW + tc * G::SW) * F::CH * 16;
  }
  /* B: lanes 0-7 n-tile 0 chunk 2s, 8-15 n-tile 0 chunk 2s + 1, 16-23 and 24-31 n-tile 1 */
  const int bco = wn * 32 + (lane & 7) + 8 * (lane >> 4), bsel = (lane >> 3) & 1;
  load(blockIdx.x, halo);
  kiln_cp_commit();
  int b = 0;
  for (int tile = blockIdx.x; tile < F::TILES; tile += gridDim.x, b ^= 1) {
    const int next = tile + gridDim.x;
    if (next < F::TILES) load(next, halo + (b ^ 1) * F::HALO * 16);
    kiln_cp_commit();
    kiln_cp_wait<1>();
    __syncthreads();
    const unsigned char *h = halo + b * F::HALO * 16;
    float c[2][4][4];
#pragma unroll
    for (int mt = 0; mt < 2; mt++)
#pragma unroll
      for (int nt = 0; nt < 4; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++)
          c[mt][nt][e] = 0.f;
#pragma unroll
    for (int s = 0; s < F::KS; s++) {
      const bool avalid = 2 * s + hi < F::NCH;
      const int aoff = hi ? F::off(2 * s + 1) : F::off(2 * s);
      unsigned a[2][4];
#pragma unroll
      for (int mt = 0; mt < 2; mt++)
        kiln_ldsm4(avalid ? h + abase[mt] + aoff : zero, a[mt]);
      const int q = 2 * s + bsel;
#pragma unroll
      for (int pr = 0; pr < 2; pr++) {
        unsigned bf[4];
        kiln_ldsm4(q < F::NCH ? filt + ((bco + 16 * pr) * F::NCH + q) * 16 : zero, bf);
#pragma unroll
        for (int mt = 0; mt < 2; mt++) {
          kiln_mma_bf16(c[mt][2 * pr], a[mt], bf[0], bf[1]);
          kiln_mma_bf16(c[mt][2 * pr + 1], a[mt], bf[2], bf[3]);
        }
      }
    }
    const int tw = tile % F::TILES_W, r = tile / F::TILES_W, th = r % F::TILES_H;
    const int n = r / F::TILES_H;
    if (!STAGE) {
#pragma unroll
      for (int mt = 0; mt < 2; mt++)
#pragma unroll
        for (int e2 = 0; e2 < 2; e2++) {
          const int p = wm * 32 + mt * 16 + (lane >> 2) + 8 * e2;
          const int oh = th * TH + p / TW, ow = tw * TW + p % TW;
          if (oh < G::OH && ow < G::OW) {
            kiln_bf16 *row = y + (((long long)n * G::OH + oh) * G::OW + ow) * G::CO;
#pragma unroll
            for (int nt = 0; nt < 4; nt++)
              *(unsigned *)&row[wn * 32 + nt * 8 + 2 * (lane & 3)] =
                  kiln_bf16x2_bits(c[mt][nt][2 * e2], c[mt][nt][2 * e2 + 1]);
          }
        }
    } else {
      /* the warp's 32 x 32 block into its own part of the staging rows, then 16 bytes a lane */
#pragma unroll
      for (int mt = 0; mt < 2; mt++)
#pragma unroll
        for (int e2 = 0; e2 < 2; e2++) {
          const int p = wm * 32 + mt * 16 + (lane >> 2) + 8 * e2;
#pragma unroll
          for (int nt = 0; nt < 4; nt++)
            *(unsigned *)(stage + p * F::ROW + (wn * 32 + nt * 8 + 2 * (lane & 3)) * 2) =
                kiln_bf16x2_bits(c[mt][nt][2 * e2], c[mt][nt][2 * e2 + 1]);
        }
      __syncwarp();
#pragma unroll
      for (int k = 0; k < 4; k++) {
        const int i = k * 32 + lane, p = wm * 32 + i / 4, ch = i % 4;
        const int oh = th * TH + p / TW, ow = tw * TW + p % TW;
        if (oh < G::OH && ow < G::OW)
          *(uint4 *)&y[(((long long)n * G::OH + oh) * G::OW + ow) * G::CO + wn * 32 + ch * 8] =
              *(const uint4 *)(stage + p * F::ROW + (wn * 32 + ch * 8) * 2);
      }
      __syncwarp();
    }
    __syncthreads(); /* every warp is done with this halo before the next load refills it */
  }
}
