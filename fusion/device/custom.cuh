/*
 * custom.cuh: what a custom op's kernel sees (include/kiln_custom.h). The user's source defines
 * __device__ void ENTRY(const kiln_custom_args &a); the kernel kiln renders for it
 * (fusion/render_custom.c) unpacks its one argument into a kiln_custom_args (kargs.cuh gives the
 * layout) and calls the entry.
 */
#ifndef KILN_CUSTOM_CUH
#define KILN_CUSTOM_CUH

#include "kargs.cuh"

/* dtypes, as kiln.h numbers them (fusion/render_custom.c checks that they agree) */
#define KILN_CUSTOM_F32 0
#define KILN_CUSTOM_BF16 1
#define KILN_CUSTOM_I32 3

struct kiln_custom_tensor {
  void *data; /* the first element: contiguous, C order, 16-byte aligned */
  int ndim;
  int dtype; /* KILN_CUSTOM_F32, KILN_CUSTOM_BF16 or KILN_CUSTOM_I32 */
  long long shape[KILN__KMAX_DIMS];
  long long numel;
};

struct kiln_custom_args {
  kiln_custom_tensor in[8]; /* = KILN_CUSTOM_MAX_IN */
  kiln_custom_tensor out;
  int nin;
  long long param[4]; /* = KILN_CUSTOM_PARAMS */
};

__device__ __forceinline__ void kiln__custom_tensor(const kiln__kargs &a, int q,
                                                    kiln_custom_tensor &t) {
  long long meta = a.st[KILN__CUSTOM_META + q / 6][q % 6];
  t.data = a.ptr[q];
  t.ndim = (int)(meta % 16);
  t.dtype = (int)(meta / 16);
  t.numel = 1;
  for (int d = 0; d < KILN__KMAX_DIMS; d++) {
    t.shape[d] = d < t.ndim ? a.st[q][d] : 1;
    t.numel *= t.shape[d];
  }
}

/* a's tensors and parameters as the entry takes them. */
__device__ __forceinline__ void kiln__custom_unpack(const kiln__kargs &a, kiln_custom_args &c) {
  c.nin = a.i[0];
  for (int q = 0; q < 8; q++) {
    if (q < c.nin) {
      kiln__custom_tensor(a, q, c.in[q]);
    } else {
      c.in[q].data = 0;
      c.in[q].ndim = 0;
      c.in[q].dtype = 0;
      c.in[q].numel = 0;
      for (int d = 0; d < KILN__KMAX_DIMS; d++)
        c.in[q].shape[d] = 0;
    }
  }
  kiln__custom_tensor(a, c.nin, c.out);
  for (int k = 0; k < 4; k++)
    c.param[k] = a.st[KILN__CUSTOM_PARAM][k];
}

#endif
