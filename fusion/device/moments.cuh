/*
 * moments.cuh: batch norm's column sums (the moments op, fusion/render_reduce.c) over an (R, C)
 * matrix, by blocks of 32 V columns x ROWS rows: a warp reads 32 V neighbouring columns of a row,
 * V of them a thread (V = 1, 2 or 4, as C allows: 128 or 256 bytes of bf16 a warp where one column
 * a thread read 64), the block's WARPS warps stride over the rows, and their partial sums of a
 * column are added in a fixed order (the same for every V), so the result is the same on every
 * run. blockIdx.y is the block of rows: the block writes partial sums (P, 2, C), which a plain sum
 * over P finishes.
 */
#ifndef KILN_MOMENTS_CUH
#define KILN_MOMENTS_CUH

#include "bf16.cuh"
#include "defs.cuh"

/* V neighbouring values from p (V = 4: one 8- or 16-byte load; 2: two values of bf16 in one
 * 4-byte load, of f32 in one 8-byte load), as floats. */
template <int V, typename T> KILN__FN void kiln_moments_load(const T *p, float (&v)[V]) {
  if constexpr (V == 4) {
    kiln_load4(p, v);
  } else if constexpr (V == 2 && sizeof(T) == 2) {
    const unsigned t = *(const unsigned *)p;
    v[0] = __uint_as_float(t << 16), v[1] = __uint_as_float(t & 0xffff0000u);
  } else if constexpr (V == 2) {
    const float2 t = *(const float2 *)p;
    v[0] = t.x, v[1] = t.y;
  } else {
    v[0] = (float)p[0];
  }
}

/* The first of the V columns this thread sums: a warp reads 32 V neighbouring columns of a row
 * (V = 2 or 4: 128 or 256 bytes of bf16 where V = 1 would read 64). */
template <int V, typename ix> KILN__FN ix kiln_moments_col() {
  return ((ix)blockIdx.x * 32 + (threadIdx.x & 31)) * V;
}

/* The block's rows [r0, r1) of columns [c, c + V) (C a multiple of V), each row's values
 * value(i, s0, s1) adding into s0[v] and s1[v] (i the row's element of column c), then the warps'
 * sums combined into out in a fixed order. */
template <int ROWS, int WARPS, int V, typename ix, class F>
KILN__FN void kiln_moments(ix R, ix C, float *out, F value) {
  const int tx = threadIdx.x & 31, ty = threadIdx.x >> 5;
  const ix c = kiln_moments_col<V, ix>(), r0 = (ix)blockIdx.y * ROWS;
  const ix r1 = r0 + ROWS < R ? r0 + ROWS : R;
  __shared__ float part[2][WARPS][32 * V];
  float s0[V], s1[V];
#pragma unroll
  for (int v = 0; v < V; v++)
    s0[v] = s1[v] = 0.f;
  if (c < C)
    for (ix r = r0 + ty; r < r1; r += WARPS)
      value(r * C + c, s0, s1);
#pragma unroll
  for (int v = 0; v < V; v++) {
    part[0][ty][tx * V + v] = s0[v];
    part[1][ty][tx * V + v] = s1[v];
  }
  __syncthreads();
  for (int t = threadIdx.x; t < 2 * 32 * V; t += WARPS * 32) {
    const int which = t / (32 * V), col = t % (32 * V);
    const ix cc = (ix)blockIdx.x * 32 * V + col;
    if (cc >= C) continue;
    float sum = 0.f;
#pragma unroll
    for (int w = 0; w < WARPS; w++)
      sum += part[which][w][col];
    out[((ix)blockIdx.y * 2 + which) * C + cc] = sum;
  }
}

/* The block's sums of red (8 x 256 floats: term k of thread t at k * 256 + t) for its chunks,
 * added in a fixed order, into out's row `row`; this thread takes entries t, t + step, ... */
template <int CHUNKS>
KILN__FN void kiln_block_moments_add(const float *red, float *out, long long row, int c0, int C,
                                     int t, int step) {
  static_assert(256 % CHUNKS == 0, "a thread keeps its chunk");
  constexpr int SHARE = 256 / CHUNKS;
  for (; t < 2 * 4 * CHUNKS; t += step) {
    const int col = t % (4 * CHUNKS), which = t / (4 * CHUNKS), chunk = col / 4, l = col % 4;
    float v = 0.f;
#pragma unroll
    for (int j = 0; j < SHARE; j++)
      v += red[(which * 4 + l) * 256 + chunk + j * CHUNKS];
    if (c0 + col < C) out[(row * 2 + which) * C + c0 + col] = v;
  }
}

/* The partial sums of a block of 256 threads that summed rows of four channels each, in a kernel
 * that writes the moments op's output itself (its rows' block `row` of out's (P, 2, C)):
 * thread t took channels [c0 + (t % CHUNKS) 4, + 4), s[l] the sum of its first terms and s[4 + l]
 * of its second for channel l; the threads that share a chunk are added in a fixed order (the
 * same result every run) through red, 8 x 256 floats of shared memory free until the first
 * barrier (a named one of the block's 256 threads: a TMA kernel's producer warp has left). */
template <int CHUNKS>
KILN__FN void kiln_block_moments(const float (&s)[8], float *red, float *out, long long row, int c0,
                                 int C) {
  asm volatile("bar.sync 1, 256;\n" ::: "memory"); /* red is free: every thread is past it */
#pragma unroll
  for (int k = 0; k < 8; k++)
    red[k * 256 + threadIdx.x] = s[k];
  asm volatile("bar.sync 1, 256;\n" ::: "memory");
  kiln_block_moments_add<CHUNKS>(red, out, row, c0, C, threadIdx.x, 256);
}

/* kiln_block_moments for 256 threads that are not the block's first (a TMA data gradient's
 * epilogue warps, render_conv.c's KILN_CONV_DGRAD_WS): this thread is t of them, and they meet
 * at named barrier `bar`; the same sums, in the same order. */
template <int CHUNKS>
KILN__FN void kiln_block_moments_at(const float (&s)[8], float *red, float *out, long long row,
                                    int c0, int C, int t, int bar) {
  asm volatile("bar.sync %0, 256;\n" ::"r"(bar) : "memory"); /* red is free */
#pragma unroll
  for (int k = 0; k < 8; k++)
    red[k * 256 + t] = s[k];
  asm volatile("bar.sync %0, 256;\n" ::"r"(bar) : "memory");
  kiln_block_moments_add<CHUNKS>(red, out, row, c0, C, t, 256);
}

/* Mode 0: the sums of x - k and of its square, k (1, C) a row of x (a shift that keeps the
 * variance from cancelling). */
template <int ROWS, int WARPS, int V, typename ix, typename TX, typename TK>
KILN__FN void kiln_moments_shifted(const TX *x, const TK *k, float *out, ix R, ix C) {
  const ix c = kiln_moments_col<V, ix>();
  float kv[V] = {};
  if (c < C) kiln_moments_load<V>(k + c, kv);
  kiln_moments<ROWS, WARPS, V, ix>(R, C, out, [&](ix i, float(&s0)[V], float(&s1)[V]) {
    float xv[V];
    kiln_moments_load<V>(x + i, xv);
#pragma unroll
    for (int v = 0; v < V; v++) {
      const float d = xv[v] - kv[v];
      s0[v] += d;
      s1[v] += d * d;
    }
  });
}

/* Mode 1: the sums of g and of g (x - mean) invstd (batch norm's gradient). */
template <int ROWS, int WARPS, int V, typename ix, typename TG, typename TX>
KILN__FN void kiln_moments_grad(const TG *g, const TX *x, const float *mean, const float *invstd,
                                float *out, ix R, ix C) {
  const ix c = kiln_moments_col<V, ix>();
  float mv[V] = {}, iv[V] = {};
  if (c < C) {
    kiln_moments_load<V>(mean + c, mv);
    kiln_moments_load<V>(invstd + c, iv);
  }
  kiln_moments<ROWS, WARPS, V, ix>(R, C, out, [&](ix i, float(&s0)[V], float(&s1)[V]) {
    float gv[V], xv[V];
    kiln_moments_load<V>(g + i, gv);
    kiln_moments_load<V>(x + i, xv);
#pragma unroll
    for (int v = 0; v < V; v++) {
      s0[v] += gv[v];
      s1[v] += gv[v] * ((xv[v] - mv[v]) * iv[v]);
    }
  });
}

#endif
