/*
 * error.c: the sticky error of a context and the always-on assert. No CUDA here (the checks of
 * CUDA, cuBLAS and NVRTC results are in cuda_check.c), so readers and parsers that report
 * through a context link without the CUDA libraries.
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
  case KILN_ERR_NONFINITE: return "non-finite value";
  }
  return "unknown status";
}
