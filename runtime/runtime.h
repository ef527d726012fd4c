/*
 * runtime.h: what runtime/'s files share. runtime/ runs what core/ recorded: it sits above core/
 * (context, tensors, trace) and fusion/ (the engine, through fusion/engine.h) and calls down into
 * both; neither calls it.
 */
#ifndef KILN_RUNTIME_H
#define KILN_RUNTIME_H

#include "../core/internal.h"

/* Hands the trace's nodes not yet run to the engine (flush.c); on any failure nothing of this
 * flush runs. On a context without a GPU the engine plans and compiles them and runs nothing. */
kiln_status kiln__flush(kiln_ctx *ctx);
/* Waits for the context's stream (with a GPU), then reports what its kernels found on the device
 * (a label or index out of range) as the context's error. */
kiln_status kiln__wait(kiln_ctx *ctx);
/* Frees the pinned staging buffers of host-to-device copies (transfer.c; the stream is idle). */
void kiln__staging_free(kiln_ctx *ctx);

#endif
