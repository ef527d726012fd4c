/*
 * anomaly.cuh: anomaly mode's check (fusion/anomaly.c), launched after every node that wrote
 * values: it scans them for NaN and Inf and records the first node, and its first such element,
 * in the context's record, which the host reads at its next synchronisation. An infinity is
 * allowed where it descends from a constant of the step (the values of a fill, a -inf mask say):
 * the host says so for this node (a fill, or an input from an earlier flush that held allowed
 * infinities), or one of its inputs of the same flush held them (their bytes in allow[]).
 *
 * The argument: ptr[0] the values (n of them, f32 or bf16 as i[0] says: 0 or 1), ptr[1] the
 * record, ptr[2] allow[] (one byte per node of the flush), nred the node's trace index, i[1] its
 * byte in allow[] (-1: none), i[2] whether the host allows infinities, i[3] how many inputs of the
 * flush it has, whose bytes are st[q / 6][q % 6].
 */
#ifndef KILN_ANOMALY_CUH
#define KILN_ANOMALY_CUH

#include "bf16.cuh"
#include "kargs.cuh"

extern "C" __global__ void __launch_bounds__(256) k_anomaly_check(const kiln__kargs a) {
  kiln__anomaly_rec *rec = (kiln__anomaly_rec *)a.ptr[1];
  unsigned char *allow = (unsigned char *)a.ptr[2];
  const long long seen = *(volatile long long *)&rec->node;
  if (seen >= 0 && seen != a.nred) return; /* an earlier node was named: it stays the first */
  bool inf_ok = a.i[2] != 0;
  for (int q = 0; q < a.i[3] && !inf_ok; q++)
    inf_ok = allow[a.st[q / KILN__KMAX_DIMS][q % KILN__KMAX_DIMS]] != 0;
  bool held_inf = false;
  for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < a.n;
       e += (long long)gridDim.x * blockDim.x) {
    const float v = a.i[0] ? (float)((const kiln_bf16 *)a.ptr[0])[e] : ((const float *)a.ptr[0])[e];
    if (isnan(v) || (isinf(v) && !inf_ok)) {
      rec->node = a.nred; /* every writer writes the same index */
      atomicMin(&rec->first, (unsigned long long)e << 2 | (isnan(v)  ? 0ull
                                                           : v > 0.f ? 1ull
                                                                     : 2ull));
    } else if (isinf(v)) {
      held_inf = true;
    }
  }
  if (held_inf && a.i[1] >= 0) allow[a.i[1]] = 1;
}

#endif
