/*
 * flush.c: running what was recorded. kiln__flush hands the trace's nodes not yet run to the
 * engine (kiln_sync, the step calls, host transfers and kiln_tensor_free call it); kiln__wait
 * waits for the stream and turns what the kernels found on the device (a bad label or index)
 * into the context's error.
 */
#include "../core/cuda_check.h"
#include "../fusion/engine.h"
#include "runtime.h"

kiln_status kiln__flush(kiln_ctx *ctx) {
  if (!ctx) return KILN_ERR_INVALID;
  kiln__trace *tr = &ctx->trace;
  if (tr->done == tr->n) return ctx->status;
  if (!kiln__ok(ctx)) {
    /* a failed step runs nothing */
    tr->done = tr->n;
    return ctx->status;
  }
  /* without a GPU the engine plans and compiles the nodes and runs nothing */
  int32_t first = tr->done, last = tr->n;
  kiln_status s = kiln__engine_flush(ctx, first, last);
  tr->done = last;
  ctx->stats.flushes++;
  return s;
}

kiln_status kiln__wait(kiln_ctx *ctx) {
  kiln__engine_fetch_errors(ctx);
  if (KILN_CUDA_FAILED(ctx, cudaStreamSynchronize(ctx->stream))) return ctx->status;
  return kiln__engine_check_errors(ctx);
}
