/*
 * moments.cuh: batch norm's column sums (the moments op, fusion/render_reduce.c) over an (R, C)
 * matrix, by blocks of 32 columns x ROWS rows: a warp reads 32 neighbouring columns of a row
 * (128 bytes), the block's WARPS warps stride over the rows, and their partial sums of a column
 * are added in a fixed order, so the result is the same on every run. blockIdx.y is the block of
 * rows: the block writes partial sums (P, 2, C), which a plain sum over P finishes.
 */
#ifndef KILN_MOMENTS_CUH
#define KILN_MOMENTS_CUH

#include "bf16.cuh"
#include "defs.cuh"

/* The block's rows [r0, r1) of column c, each row's value(r) summed in s0 and its second value in
 * s1 (value(r, s0, s1) adds both), then the warps' sums combined into out. */
template <int ROWS, int WARPS, typename ix, class F>
KILN__FN void kiln_moments(ix R, ix C, float *out, F value) {
  const int tx = threadIdx.x & 31, ty = threadIdx.x >> 5;
  const ix c = (ix)blockIdx.x * 32 + tx, r0 = (ix)blockIdx.y * ROWS;
  const ix r1 = r0 + ROWS < R ? r0 + ROWS : R;
  __shared__ float part[2][WARPS][32];
  float s0 = 0.f, s1 = 0.f;
  if (c < C)
    for (ix r = r0 + ty; r < r1; r += WARPS)
      value(r * C + c, c, s0, s1);
  part[0][ty][tx] = s0;
  part[1][ty][tx] = s1;
  __syncthreads();
  if (ty < 2 && c < C) {
    float t = 0.f;
#pragma unroll
    for (int w = 0; w < WARPS; w++)
      t += part[ty][w][tx];
    out[((ix)blockIdx.y * 2 + ty) * C + c] = t;
  }
}

/* Mode 0: the sums of x - k and of its square, k (1, C) a row of x (a shift that keeps the
 * variance from cancelling). */
template <int ROWS, int WARPS, typename ix, typename TX, typename TK>
KILN__FN void kiln_moments_shifted(const TX *x, const TK *k, float *out, ix R, ix C) {
  kiln_moments<ROWS, WARPS, ix>(R, C, out, [&](ix i, ix c, float &s0, float &s1) {
    const float v = (float)x[i] - (float)k[c];
    s0 += v;
    s1 += v * v;
  });
}

/* Mode 1: the sums of g and of g (x - mean) invstd (batch norm's gradient). */
template <int ROWS, int WARPS, typename ix, typename TG, typename TX>
KILN__FN void kiln_moments_grad(const TG *g, const TX *x, const float *mean, const float *invstd,
                                float *out, ix R, ix C) {
  kiln_moments<ROWS, WARPS, ix>(R, C, out, [&](ix i, ix c, float &s0, float &s1) {
    const float gv = g[i];
    s0 += gv;
    s1 += gv * (((float)x[i] - mean[c]) * invstd[c]);
  });
}

#endif
