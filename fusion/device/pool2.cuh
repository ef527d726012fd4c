/*
 * pool2.cuh: a 2x2 max pool at stride 2 in a convolution kernel's epilogue (conv_few.cuh's halo
 * tiles, conv_tma.cuh's pairs of rows), over a window's 8 channels: the taps visited in the order
 * window.cuh's kiln_win_argmax visits them, so the maxima and positions are the pool kernel's,
 * bit for bit, by construction (test_gpu_conv_switches.c checks it).
 */
#ifndef KILN_POOL2_CUH
#define KILN_POOL2_CUH

#include "bf16.cuh"

/* Tap t (p * 2 + q) of a window: v its 8 values; the first maximum wins, NaN over all. */
KILN__FN void kiln_pool2_tap(int t, const float (&v)[8], float (&best)[8], int (&pos)[8]) {
#pragma unroll
  for (int l = 0; l < 8; l++)
    if (t == 0 || v[l] > best[l] || isnan(v[l])) best[l] = v[l], pos[l] = t;
}

/* The window's maxima as bf16 at y + o (16-byte aligned), and with at its positions, a byte a
 * value, at at + o (kiln_max_pool_at's layout). */
KILN__FN void kiln_pool2_store(kiln_bf16 *y, unsigned char *at, long long o, const float (&best)[8],
                               const int (&pos)[8]) {
  kiln_store4(y + o, best);
  kiln_store4(y + o + 4, best + 4);
  if (at) {
    unsigned lo = 0, hi = 0;
#pragma unroll
    for (int l = 0; l < 4; l++)
      lo |= (unsigned)pos[l] << (8 * l), hi |= (unsigned)pos[l + 4] << (8 * l);
    *(uint2 *)(at + o) = make_uint2(lo, hi);
  }
}

#endif
