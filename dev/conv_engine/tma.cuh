// tma.cuh: the host side of the lab's TMA experiment (./lab tma): the tensor maps of the
// library's TMA-fed convolution products (fusion/device/conv_tma.cuh, which says what they are),
// made through the driver's entry points (no -lcuda) and passed to the lab's kernels as
// __grid_constant__ parameters. The library makes the same maps in fusion/tmap.c.
#ifndef KILN_LAB_TMA_CUH
#define KILN_LAB_TMA_CUH

#include <cuda.h>
#include <cudaTypedefs.h>

#ifndef KILN_TMA_WAIT_NS
#define KILN_TMA_WAIT_NS 2000000000ull /* a lost arrival traps after 2 s, not the library's 10 */
#endif
#include "../../fusion/device/conv_tma.cuh"

namespace tma {

typedef PFN_cuTensorMapEncodeIm2col_v12000 encode_im2col_fn;
typedef PFN_cuTensorMapEncodeTiled_v12000 encode_tiled_fn;

static void *driver_fn(const char *name) {
  void *f = nullptr;
  cudaDriverEntryPointQueryResult q;
  if (cudaGetDriverEntryPointByVersion(name, &f, 12000, cudaEnableDefault, &q) != cudaSuccess ||
      q != cudaDriverEntryPointSuccess || !f) {
    fprintf(stderr, "tma: the driver has no %s\n", name);
    exit(1);
  }
  return f;
}

static void check_map(CUresult r, const char *what) {
  if (r != CUDA_SUCCESS) {
    fprintf(stderr, "tma: encoding %s failed (CUresult %d)\n", what, (int)r);
    exit(1);
  }
}

/* An NHWC bf16 image (n, h, w, c) read as the im2col of a kh x kw window (stride s, padding p,
 * dilation dl), `pixels` output pixels and 64 channels a copy, 128-byte swizzle. */
static CUtensorMap im2col_map(const void *img, int n, int h, int w, int c, int kh, int kw, int s,
                              int p, int dl, int pixels) {
  static encode_im2col_fn enc = (encode_im2col_fn)driver_fn("cuTensorMapEncodeIm2col");
  CUtensorMap m;
  const cuuint64_t dims[4] = {(cuuint64_t)c, (cuuint64_t)w, (cuuint64_t)h, (cuuint64_t)n};
  const cuuint64_t strides[3] = {(cuuint64_t)c * 2, (cuuint64_t)w * c * 2, (cuuint64_t)h * w * c * 2};
  const int lower[2] = {-p, -p}, upper[2] = {p - dl * (kw - 1), p - dl * (kh - 1)};
  const cuuint32_t es[4] = {1, (cuuint32_t)s, (cuuint32_t)s, 1};
  check_map(enc(&m, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 4, (void *)img, dims, strides, lower, upper,
                64, (cuuint32_t)pixels, es, CU_TENSOR_MAP_INTERLEAVE_NONE,
                CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE),
            "an im2col map");
  return m;
}

/* A row-major bf16 tensor of `rank` dimensions (innermost first) read in boxes of box[] with the
 * 128-byte swizzle (box[0] is 64: 128 bytes). */
static CUtensorMap tiled_map(const void *t, int rank, const cuuint64_t *dims, const cuuint32_t *box) {
  static encode_tiled_fn enc = (encode_tiled_fn)driver_fn("cuTensorMapEncodeTiled");
  CUtensorMap m;
  cuuint64_t strides[4];
  cuuint64_t st = 2;
  for (int i = 0; i + 1 < rank; i++)
    strides[i] = st *= dims[i];
  const cuuint32_t es[5] = {1, 1, 1, 1, 1};
  check_map(enc(&m, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, (cuuint32_t)rank, (void *)t, dims, strides,
                box, es, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                CU_TENSOR_MAP_L2_PROMOTION_L2_128B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE),
            "a tiled map");
  return m;
}

} // namespace tma

#endif
