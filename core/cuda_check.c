/*
 * cuda_check.c: CUDA, cuBLAS and NVRTC failures as context errors (see cuda_check.h).
 */
#include "cuda_check.h"

bool kiln__cuda_failed(kiln_ctx *ctx, cudaError_t e, const char *fn, const char *call) {
  if (e == cudaSuccess) return false;
  kiln_status s = e == cudaErrorMemoryAllocation ? KILN_ERR_OOM : KILN_ERR_CUDA;
  kiln__error(ctx, s, "%s: %s failed: %s (%s)", fn, call, cudaGetErrorString(e),
              cudaGetErrorName(e));
  return true;
}

bool kiln__cublas_failed(kiln_ctx *ctx, cublasStatus_t e, const char *fn, const char *call) {
  if (e == CUBLAS_STATUS_SUCCESS) return false;
  kiln_status s = e == CUBLAS_STATUS_ALLOC_FAILED ? KILN_ERR_OOM : KILN_ERR_CUDA;
  kiln__error(ctx, s, "%s: %s failed: %s", fn, call, cublasGetStatusString(e));
  return true;
}

bool kiln__nvrtc_failed(kiln_ctx *ctx, nvrtcResult e, const char *fn, const char *call) {
  if (e == NVRTC_SUCCESS) return false;
  kiln__error(ctx, KILN_ERR_CUDA, "%s: %s failed: %s", fn, call, nvrtcGetErrorString(e));
  return true;
}
