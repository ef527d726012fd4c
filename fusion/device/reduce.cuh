/*
 * reduce.cuh: the warp and block reductions every generated reduction uses. Block reductions
 * take 32 words of shared memory (sv, si) and must be reached by every thread of the block.
 */
#ifndef KILN_REDUCE_CUH
#define KILN_REDUCE_CUH

#include "defs.cuh"
#include "math.cuh"

#define KILN__FULL_MASK 0xffffffffu

/* The warp's sum or max, returned to every lane. Sums are of floats, or of 64-bit integers
 * (exact sums of i32 values). */
template <typename T> KILN__FN T kiln_all_sum(T v) {
  for (int o = 16; o > 0; o >>= 1)
    v += __shfl_xor_sync(KILN__FULL_MASK, v, o);
  return v;
}
KILN__FN float kiln_all_max(float v) {
  for (int o = 16; o > 0; o >>= 1)
    v = kiln_maximum(v, __shfl_xor_sync(KILN__FULL_MASK, v, o));
  return v;
}

/* The whole block's sum or max, returned to every thread. */
template <typename T> KILN__FN T kiln_block_sum(T v, T *sv) {
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
  v = kiln_all_sum(v);
  __syncthreads(); /* the previous reduction's partials have been read */
  if (lane == 0) sv[w] = v;
  __syncthreads();
  return kiln_all_sum(lane < nw ? sv[lane] : (T)0);
}
KILN__FN float kiln_block_max(float v, float *sv) {
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
  v = kiln_all_max(v);
  __syncthreads();
  if (lane == 0) sv[w] = v;
  __syncthreads();
  return kiln_all_max(lane < nw ? sv[lane] : -__int_as_float(0x7f800000));
}

/* argmax: the larger value wins; NaN counts as largest; ties go to the smaller index. */
KILN__FN void kiln_argmax_step(float &bv, long long &bi, float v, long long i) {
  bool take = (v > bv) || (v != v && bv == bv) || ((v == bv || (v != v && bv != bv)) && i < bi);
  if (take) {
    bv = v;
    bi = i;
  }
}
KILN__FN void kiln_warp_argmax(float &v, long long &i) {
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_down_sync(KILN__FULL_MASK, v, o);
    const long long oi = __shfl_down_sync(KILN__FULL_MASK, i, o);
    kiln_argmax_step(v, i, ov, oi);
  }
}
/* The block's argmax (v, i), valid in thread 0. */
KILN__FN void kiln_block_argmax(float &v, long long &i, float *sv, long long *si) {
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
  kiln_warp_argmax(v, i);
  __syncthreads();
  if (lane == 0) {
    sv[w] = v;
    si[w] = i;
  }
  __syncthreads();
  if (w == 0) {
    v = lane < nw ? sv[lane] : -__int_as_float(0x7f800000);
    i = lane < nw ? si[lane] : 0x7fffffffffffffffll;
    kiln_warp_argmax(v, i);
  }
}

#endif
