/*
 * conv_direct.cuh: the forward product of a convolution with few values a window (K = KH KW CI of
 * at most 32) and at most 64 output channels, a multiple of 8, on a bf16 image whose channels the
 * implicit GEMMs do not take (CI not a multiple of 8): a whitening layer's 2x2 over 3 channels.
 * Such a product has so little to multiply (12 values a window and 24 channels: 288 FMAs a pixel)
 * that im2col's column matrix and cuBLAS's product over it cost far more than the reads and
 * writes: on the H100 the air step's whitening conv took 32.1 us of im2col and 89.2 of cuBLAS to
 * write 47 MB. Here a thread computes one output pixel: it reads its window (zeros past the
 * image) into registers and sums it against the filters, which the block keeps in shared memory
 * as floats (K x CO, read by every thread at the same address: a broadcast), in f32 in the order
 * of K as a product of the columns would, and stores its CO channels as bf16, 16 bytes at a time.
 * G is conv.cuh's geometry (render_conv.c's conv_operands): N, H, W, CI, OH, OW, CO, the window,
 * M = N OH OW and K. wk is Wk (CO, K), K innermost; y is (M, CO). E, an epilogue (E::on), maps
 * each value, rounded to bf16 as the product's store would round it, before the store: the
 * generated kernel's unary elementwise chain (render_conv.c's render_direct).
 */
#ifndef KILN_CONV_DIRECT_CUH
#define KILN_CONV_DIRECT_CUH

#include "bf16.cuh"
#include "defs.cuh"

/* No epilogue. */
struct kiln_direct_none {
  static constexpr bool on = false;
  __device__ __forceinline__ float operator()(float v) const { return v; }
};

template <class G, class E = kiln_direct_none>
KILN__FN void kiln_conv_direct(const kiln_bf16 *x, const kiln_bf16 *wk, kiln_bf16 *y) {
  static_assert(G::K <= 32 && G::CO <= 64 && G::CO % 8 == 0, "kiln_conv_direct");
  __shared__ float wt[G::K * G::CO]; /* wt[k CO + co] = Wk[co, k] */
  for (int i = threadIdx.x; i < G::K * G::CO; i += blockDim.x)
    wt[i % G::K * G::CO + i / G::K] = (float)wk[i];
  __syncthreads();
  const int m = (int)(blockIdx.x * blockDim.x + threadIdx.x);
  if (m >= G::M) return;
  const int ow = m % G::OW, r = m / G::OW, oh = r % G::OH, n = r / G::OH;
  float col[G::K];
#pragma unroll
  for (int i = 0; i < G::KH; i++)
#pragma unroll
    for (int j = 0; j < G::KW; j++) {
      const int h = oh * G::SH - G::PH + i * G::DH, w = ow * G::SW - G::PW + j * G::DW;
      const bool in = h >= 0 && h < G::H && w >= 0 && w < G::W;
      const long long at = in ? ((long long)(n * G::H + h) * G::W + w) * G::CI : 0;
#pragma unroll
      for (int c = 0; c < G::CI; c++)
        col[(i * G::KW + j) * G::CI + c] = in ? (float)x[at + c] : 0.f;
    }
  float acc[G::CO];
#pragma unroll
  for (int co = 0; co < G::CO; co++)
    acc[co] = 0.f;
#pragma unroll
  for (int k = 0; k < G::K; k++)
#pragma unroll
    for (int co = 0; co < G::CO; co++)
      acc[co] = fmaf(col[k], wt[k * G::CO + co], acc[co]);
  if constexpr (E::on) {
    const E epi;
#pragma unroll
    for (int co = 0; co < G::CO; co++)
      acc[co] = epi((float)kiln_bf16(acc[co]));
  }
  kiln_bf16 *out = y + (long long)m * G::CO;
#pragma unroll
  for (int co = 0; co < G::CO; co += 8) {
    uint4 v;
    v.x = kiln_bf16x2_bits(acc[co], acc[co + 1]);
    v.y = kiln_bf16x2_bits(acc[co + 2], acc[co + 3]);
    v.z = kiln_bf16x2_bits(acc[co + 4], acc[co + 5]);
    v.w = kiln_bf16x2_bits(acc[co + 6], acc[co + 7]);
    *(uint4 *)&out[co] = v;
  }
}

#endif
