/*
 * engine.h: all that runtime/ sees of fusion/ (engine.c defines it). core records nodes into the
 * trace; when a flush or a step end needs them run, the runtime hands them here. fusion/ keeps
 * its own state (compiled kernels, step graphs, BLAS handles and plans) behind
 * ctx->fusion_state, opaque to core/. This header includes nothing of core/ or fusion/, so
 * runtime/ sees none of fusion's internals.
 */
#ifndef KILN_ENGINE_H
#define KILN_ENGINE_H

#include <stdbool.h>
#include <stdint.h>

#include "kiln.h"

/* Makes fusion's state for a new context (and, with a GPU, its BLAS handles and workspace). */
kiln_status kiln__engine_init(kiln_ctx *ctx);
/* Frees it (the stream is idle). */
void kiln__engine_free(kiln_ctx *ctx);
/* Plans, compiles and runs trace nodes [first, last); on any failure nothing of them runs. On a
 * context without a GPU it plans and compiles them (and counts that in the statistics) only. */
kiln_status kiln__engine_flush(kiln_ctx *ctx, int32_t first, int32_t last);
/* Runs the open step's whole trace through its step graph: captured on the first occurrence of
 * its signature, replayed after. */
kiln_status kiln__engine_step(kiln_ctx *ctx);
/* Plans and compiles nodes [first, last) without running them (works without a GPU). */
kiln_status kiln__engine_compile(kiln_ctx *ctx, int32_t first, int32_t last);
/* Compiles a custom op's kernel (kiln_custom_op_new), and sets op->smem_max to the dynamic shared
 * memory the device lets a block have (sm_90's without a GPU); errors name the function and op. */
kiln_status kiln__engine_compile_custom(kiln_ctx *ctx, kiln_custom_op *op);
/* Graphs turned off (drop) or on again: cached graphs go at the next step's begin. */
void kiln__engine_drop_graphs(kiln_ctx *ctx, bool drop);
/* Frees the cached step graphs now, once the stream is idle (nothing of them may be read
 * after: call it where the last step's values are released, as at a step's beginning). */
void kiln__engine_free_graphs(kiln_ctx *ctx);
/* A new step begins: frees the cached graphs if they were dropped. */
void kiln__engine_step_begin(kiln_ctx *ctx);
/* Kernels record the first bad value they meet (an out-of-range label or row index) on the
 * device, so that no launch waits for the host. Before a synchronisation, fetch queues the copy
 * of that record; after it, check turns a recorded value into the context's error (naming the
 * op and the value) and clears the record. */
void kiln__engine_fetch_errors(kiln_ctx *ctx);
kiln_status kiln__engine_check_errors(kiln_ctx *ctx);

#endif
