/*
 * tmap.c: the TMA-fed convolutions' tensor maps (tmap.h). The driver encodes them
 * (cuTensorMapEncodeIm2col, cuTensorMapEncodeTiled), found through the runtime's driver entry
 * points, so kiln links no libcuda of its own.
 */
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>
#include <pthread.h>
#include <string.h>

#include "tmap.h"

kiln__tmap_desc kiln__tmap_im2col(int operand, const int64_t nhwc[4], const kiln__win *w,
                                  int pixels) {
  kiln__tmap_desc d = {.operand = operand, .rank = 4, .im2col = true, .pixels = (uint32_t)pixels};
  uint64_t n = (uint64_t)nhwc[0], h = (uint64_t)nhwc[1], wd = (uint64_t)nhwc[2],
           c = (uint64_t)nhwc[3];
  d.dims[0] = c, d.dims[1] = wd, d.dims[2] = h, d.dims[3] = n;
  d.strides[0] = c * 2, d.strides[1] = wd * c * 2, d.strides[2] = h * wd * c * 2;
  d.lower[0] = (int)-w->pw, d.lower[1] = (int)-w->ph;
  d.upper[0] = (int)(w->pw - w->dw * (w->kw - 1)), d.upper[1] = (int)(w->ph - w->dh * (w->kh - 1));
  d.elem_strides[0] = 1, d.elem_strides[1] = (uint32_t)w->sw, d.elem_strides[2] = (uint32_t)w->sh;
  d.elem_strides[3] = 1;
  d.box[0] = 64; /* channels a pixel */
  return d;
}

kiln__tmap_desc kiln__tmap_tiled(int operand, int rank, const int64_t *dims, const uint32_t *box) {
  kiln__tmap_desc d = {.operand = operand, .rank = rank};
  uint64_t st = 2;
  for (int i = 0; i < rank; i++) {
    d.dims[i] = (uint64_t)dims[i];
    d.box[i] = box[i];
    d.elem_strides[i] = 1;
    if (i + 1 < rank) d.strides[i] = st *= (uint64_t)dims[i];
  }
  return d;
}

typedef PFN_cuTensorMapEncodeIm2col_v12000 encode_im2col_fn;
typedef PFN_cuTensorMapEncodeTiled_v12000 encode_tiled_fn;

static pthread_once_t found_once = PTHREAD_ONCE_INIT;
static encode_im2col_fn encode_im2col;
static encode_tiled_fn encode_tiled;

static void *entry(const char *name) {
  void *f = NULL;
  enum cudaDriverEntryPointQueryResult q;
  if (cudaGetDriverEntryPointByVersion(name, &f, 12000, cudaEnableDefault, &q) != cudaSuccess ||
      q != cudaDriverEntryPointSuccess) {
    (void)cudaGetLastError();
    return NULL;
  }
  return f;
}

static void find_encoders(void) {
  encode_im2col = (encode_im2col_fn)entry("cuTensorMapEncodeIm2col");
  encode_tiled = (encode_tiled_fn)entry("cuTensorMapEncodeTiled");
}

bool kiln__tmap_encode(kiln_ctx *ctx, const kiln__tmap_desc *d, void *ptr, void *out) {
  pthread_once(&found_once, find_encoders);
  const char *what = d->im2col ? "cuTensorMapEncodeIm2col" : "cuTensorMapEncodeTiled";
  if (!(d->im2col ? (void *)encode_im2col : (void *)encode_tiled)) {
    kiln__error(
        ctx, KILN_ERR_CUDA,
        "kiln_flush: the driver has no %s (CUDA 12.0 or newer is needed for "
        "the TMA-fed convolutions; KILN_CONV_TMA=0 turns them off); nothing of this flush ran",
        what);
    return false;
  }
  cuuint64_t dims[4], strides[3];
  cuuint32_t box[4], es[4];
  for (int i = 0; i < d->rank; i++) {
    dims[i] = d->dims[i];
    box[i] = d->box[i];
    es[i] = d->elem_strides[i];
    if (i + 1 < d->rank) strides[i] = d->strides[i];
  }
  CUtensorMap m;
  CUresult r =
      d->im2col
          ? encode_im2col(&m, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, (cuuint32_t)d->rank, ptr, dims,
                          strides, d->lower, d->upper, d->box[0], d->pixels, es,
                          CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                          CU_TENSOR_MAP_L2_PROMOTION_L2_128B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
          : encode_tiled(&m, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, (cuuint32_t)d->rank, ptr, dims,
                         strides, box, es, CU_TENSOR_MAP_INTERLEAVE_NONE,
                         CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
                         CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    kiln__error(ctx, KILN_ERR_CUDA,
                "kiln_flush: %s refused a map of rank %d (dims %llu x %llu x %llu x %llu, box "
                "corners %d %d / %d %d): CUresult %d; nothing of this flush ran",
                what, d->rank, (unsigned long long)d->dims[0],
                (unsigned long long)(d->rank > 1 ? d->dims[1] : 1),
                (unsigned long long)(d->rank > 2 ? d->dims[2] : 1),
                (unsigned long long)(d->rank > 3 ? d->dims[3] : 1), d->lower[0], d->lower[1],
                d->upper[0], d->upper[1], (int)r);
    return false;
  }
  _Static_assert(sizeof m == KILN__TMAP_BYTES, "CUtensorMap is 128 bytes");
  memcpy(out, &m, sizeof m);
  return true;
}
