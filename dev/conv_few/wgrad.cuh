// wgrad.cuh: a lab experiment, not yet in the library: the weight gradient of the convolutions
// conv_few.cuh's forward product takes (stride 1, few input channels into 64), from the same halo
// tiles: dWt (K, CO) = im2col(X)^T (K, M) dY (M, CO), the reduction over the pixels.
//
// Why: on the H100 the library's cp.async weight gradient of airbench's first conv (24 channels
// into 64) took 206.5 us at batch 1024 (the air step, ninth session) and 337.7 at batch 2000 (the
// CIFAR-10 example's step, sixteenth session), gathering each tap of each pixel from L2 again.
//
// A persistent block (256 threads, two an SM) takes tiles blockIdx.x, + gridDim.x, ... as the
// forward product does: for each it loads the tile's halo of X and its 128 rows of dY (rows padded
// to 144 bytes) into shared memory, the next tile's while it multiplies (two buffers of each),
// and adds the tile's products into its accumulators, which hold the block's whole dWt (K rows
// padded to whole k16 tiles x 64): warp w takes 16-row tiles w % 4, + 4, ... of K and 32 of the
// 64 columns (w / 4). A product step is 16 pixels: the A operand (16 rows of K = two chunks of 8
// channels, a tap's or two taps') is the halo's chunks of those 16 pixels, read transposed by
// ldmatrix.trans (lane l gives pixel l % 8 + 8 (l / 16)'s chunk), B is the dY rows, transposed
// too. At the end each block stores its partial dWt (f32, K x 64) to part[blockIdx.x], and
// few_wgrad_sum adds the blocks' partials in block order (the same sum every run) into dW (CO, K),
// bf16, the layout of the library's weight gradients.
#pragma once

#include "../../fusion/device/conv_few.cuh"

template <class G, int TH, int TW> struct FewW {
  using F = kiln_few<G, TH, TW>;
  static constexpr int KT = (F::NCH + 1) / 2; /* 16-row tiles of K */
  static constexpr int KP = KT * 16;          /* K padded */
  static constexpr int DY_ROW = G::CO * 2 + 16;
  static constexpr int SMEM = 16 + 2 * F::HALO * 16 + 2 * 128 * DY_ROW;
};

template <class G, int TH, int TW>
__global__ void __launch_bounds__(256, 2)
    few_wgrad(const kiln_bf16 *__restrict__ x, const kiln_bf16 *__restrict__ dy, float *part) {
  using F = kiln_few<G, TH, TW>;
  using W = FewW<G, TH, TW>;
  extern __shared__ __align__(16) unsigned char smem[];
  unsigned char *zero = smem, *halo = smem + 16, *dys = halo + 2 * F::HALO * 16;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, wk = warp & 3, wn = warp >> 2;
  if (tid < 4) ((unsigned *)zero)[tid] = 0u;
  /* tile's dY rows into buf: row p is output pixel p of the tile, zeros past the image */
  auto load_dy = [&](int tile, unsigned char *buf) {
    const int tw = tile % F::TILES_W, r = tile / F::TILES_W, n = r / F::TILES_H;
    const int oh0 = r % F::TILES_H * TH, ow0 = tw * TW;
    for (int i = tid; i < 128 * 8; i += 256) {
      const int p = i / 8, c = i % 8, oh = oh0 + p / TW, ow = ow0 + p % TW;
      const bool in = oh < G::OH && ow < G::OW;
      const kiln_bf16 *src =
          in ? dy + (((long long)n * G::OH + oh) * G::OW + ow) * G::CO + c * 8 : dy;
      kiln_cp16(buf + p * W::DY_ROW + c * 16, src, in);
    }
  };
  float acc[4][4][4];
#pragma unroll
  for (int i = 0; i < 4; i++)
#pragma unroll
    for (int j = 0; j < 4; j++)
#pragma unroll
      for (int e = 0; e < 4; e++)
        acc[i][j][e] = 0.f;
  kiln_few_halo<G, TH, TW>(x, blockIdx.x, halo);
  load_dy(blockIdx.x, dys);
  kiln_cp_commit();
  /* this lane's pixel within a 16-pixel step, for A (and B: l % 8 + 8 ((l / 8) % 2)) */
  const int apx = (lane & 7) + 8 * (lane >> 4), bpx = (lane & 7) + 8 * ((lane >> 3) & 1);
  const int asel = (lane >> 3) & 1, bsel = lane >> 4;
  int b = 0;
  for (int tile = blockIdx.x; tile < F::TILES; tile += gridDim.x, b ^= 1) {
    if (tile + (int)gridDim.x < F::TILES) {
      kiln_few_halo<G, TH, TW>(x, tile + gridDim.x, halo + (b ^ 1) * F::HALO * 16);
      load_dy(tile + gridDim.x, dys + (b ^ 1) * 128 * W::DY_ROW);
    }
    kiln_cp_commit();
    kiln_cp_wait<1>();
    __syncthreads();
    const unsigned char *h = halo + b * F::HALO * 16, *d = dys + b * 128 * W::DY_ROW;
#pragma unroll 1
    for (int s = 0; s < 8; s++) {
      unsigned bf[2][4]; /* n-tiles 4 wn + 2 pr and + 1: b0, b1 of each */
#pragma unroll
      for (int pr = 0; pr < 2; pr++)
        kiln_ldsm4_trans(d + (16 * s + bpx) * W::DY_ROW + (4 * wn + 2 * pr + bsel) * 16, bf[pr]);
      const int p = 16 * s + apx, abase = (p / TW * F::HW + p % TW) * F::CH * 16;
#pragma unroll
      for (int i = 0; i < 4; i++) {
        const int kt = wk + 4 * i;
        if (kt >= W::KT) break;
        const int q = 2 * kt + asel;
        unsigned a[4];
        kiln_ldsm4_trans(q < F::NCH ? h + abase + F::off(q) : zero, a);
        /* a[0]: k 0-7 pixels 0-7, a[1]: k 8-15 pixels 0-7, a[2] and a[3]: pixels 8-15 */
        const unsigned af[4] = {a[0], a[1], a[2], a[3]};
#pragma unroll
        for (int pr = 0; pr < 2; pr++) {
          kiln_mma_bf16(acc[i][2 * pr], af, bf[pr][0], bf[pr][1]);
          kiln_mma_bf16(acc[i][2 * pr + 1], af, bf[pr][2], bf[pr][3]);
        }
      }
    }
    __syncthreads(); /* every warp is done with this tile's buffers */
  }
  /* the block's partial dWt: row k = 16 kt + lane / 4 (+ 8), column 8 nt + 2 (lane % 4) (+ 1) */
  float *out = part + (long long)blockIdx.x * W::KP * G::CO;
#pragma unroll
  for (int i = 0; i < 4; i++) {
    const int kt = wk + 4 * i;
    if (kt >= W::KT) break;
#pragma unroll
    for (int j = 0; j < 4; j++)
#pragma unroll
      for (int e2 = 0; e2 < 2; e2++) {
        const int k = 16 * kt + (lane >> 2) + 8 * e2, co = 32 * wn + 8 * j + 2 * (lane & 3);
        *(float2 *)&out[k * G::CO + co] = make_float2(acc[i][j][2 * e2], acc[i][j][2 * e2 + 1]);
      }
  }
}

/* dW (CO, K) bf16 = the sum of `blocks` partial dWt (KP, CO) in block order: a thread a value. */
template <class G, int TH, int TW>
__global__ void few_wgrad_sum(const float *part, int blocks, kiln_bf16 *dw) {
  using W = FewW<G, TH, TW>;
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= G::K * G::CO) return;
  const int k = i / G::CO, co = i % G::CO;
  float s = 0.f;
  for (int b = 0; b < blocks; b++)
    s += part[(long long)b * W::KP * G::CO + k * G::CO + co];
  dw[co * G::K + k] = kiln_bf16(s);
}
