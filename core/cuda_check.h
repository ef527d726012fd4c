/*
 * cuda_check.h: the one family of checks for CUDA runtime, cuBLAS and NVRTC results. Included
 * only by the files that call those libraries; core/internal.h stays free of CUDA headers.
 */
#ifndef KILN_CUDA_CHECK_H
#define KILN_CUDA_CHECK_H

#include <cublas_api.h>
#include <cuda_runtime_api.h>
#include <nvrtc.h>

#include "internal.h"

/* On failure: a sticky error naming the function, the call and the library's message (an
 * allocation failure is KILN_ERR_OOM); the macros evaluate to true on failure. */
bool kiln__cuda_failed(kiln_ctx *ctx, cudaError_t e, const char *fn, const char *call);
bool kiln__cublas_failed(kiln_ctx *ctx, cublasStatus_t e, const char *fn, const char *call);
bool kiln__nvrtc_failed(kiln_ctx *ctx, nvrtcResult e, const char *fn, const char *call);
#define KILN_CUDA_FAILED(ctx, call) kiln__cuda_failed((ctx), (call), __func__, #call)
#define KILN_CUBLAS_FAILED(ctx, call) kiln__cublas_failed((ctx), (call), __func__, #call)
#define KILN_NVRTC_FAILED(ctx, call) kiln__nvrtc_failed((ctx), (call), __func__, #call)

#endif
