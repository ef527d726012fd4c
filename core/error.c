/*
 * error.c: the sticky error of a context, the always-on assert, and the one family of checks
 * that turns CUDA, cuBLAS and NVRTC failures into context errors.
 */
#include <stdarg.h>
#include <stdlib.h>

#include "internal.h"

_Noreturn void kiln__assert_fail(const char *cond, const char *file, int line) {
  fprintf(stderr, "kiln: internal error: %s:%d: assertion failed: %s\n", file, line, cond);
  abort();
}

kiln_status kiln__error(kiln_ctx *ctx, kiln_status s, const char *fmt, ...) {
  if (!ctx || ctx->status != KILN_OK) return s;
  ctx->status = s;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(ctx->error, sizeof ctx->error, fmt, ap);
  va_end(ap);
  return s;
}

bool kiln__ok(kiln_ctx *ctx) { return ctx && ctx->status == KILN_OK; }

kiln_status kiln_ctx_status(const kiln_ctx *ctx) { return ctx ? ctx->status : KILN_ERR_INVALID; }

const char *kiln_ctx_error(const kiln_ctx *ctx) {
  if (!ctx) return "kiln_ctx_error: NULL context";
  return ctx->status == KILN_OK ? NULL : ctx->error;
}

void kiln_ctx_clear_error(kiln_ctx *ctx) {
  if (!ctx) return;
  ctx->status = KILN_OK;
  ctx->error[0] = 0;
  if (ctx->has_gpu) (void)cudaGetLastError(); /* drops a non-sticky CUDA error, such as OOM */
}

const char *kiln_status_name(kiln_status s) {
  switch (s) {
  case KILN_OK: return "ok";
  case KILN_ERR_INVALID: return "invalid argument";
  case KILN_ERR_SHAPE: return "shape mismatch";
  case KILN_ERR_DTYPE: return "unsupported dtype";
  case KILN_ERR_OOM: return "out of memory";
  case KILN_ERR_CUDA: return "CUDA error";
  case KILN_ERR_IO: return "I/O error";
  case KILN_ERR_FORMAT: return "bad file format";
  case KILN_ERR_STATE: return "invalid state";
  }
  return "unknown status";
}

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
