/*
 * engine.c: fusion/'s entry points (engine.h), what the runtime calls to run recorded work. It
 * owns fusion's state (kernel cache, BLAS handles, step graphs, the kernels' error record) and
 * hands a flush to the executor (exec.c: build a program, allocate, bind, upload, launch) and a
 * whole step to the step graphs (graph.c: signature, memory plan, capture, replay).
 */
#include <stdlib.h>
#include <string.h>

#include "../core/cuda_check.h"
#include "fusion.h"

kiln_status kiln__engine_init(kiln_ctx *ctx) {
  kiln__fusion *fs = calloc(1, sizeof *fs);
  if (!fs) return kiln__error(ctx, KILN_ERR_OOM, "kiln_ctx_new: out of host memory");
  ctx->fusion_state = fs;
  fs->kernels = kiln__kcache_new();
  if (!fs->kernels) return kiln__error(ctx, KILN_ERR_OOM, "kiln_ctx_new: out of host memory");
  fs->blas = kiln__blas_new(ctx);
  if (!fs->blas) return ctx->status;
  if (ctx->has_gpu &&
      (KILN_CUDA_FAILED(ctx, cudaMalloc((void **)&fs->err_dev, sizeof *fs->err_dev)) ||
       KILN_CUDA_FAILED(ctx, cudaMemset(fs->err_dev, 0, sizeof *fs->err_dev)) ||
       KILN_CUDA_FAILED(ctx, cudaMallocHost((void **)&fs->err_host, sizeof *fs->err_host))))
    return ctx->status;
  if (fs->err_host) memset(fs->err_host, 0, sizeof *fs->err_host);
  return KILN_OK;
}

void kiln__engine_free(kiln_ctx *ctx) {
  kiln__fusion *fs = ctx->fusion_state;
  if (!fs) return;
  if (ctx->has_gpu) kiln__graphs_free(ctx);
  if (fs->step_values) kiln__dev_free(ctx, fs->step_values);
  if (fs->tmaps.p) kiln__dev_free(ctx, fs->tmaps.p);
  if (fs->err_dev) cudaFree(fs->err_dev);
  if (fs->conv_ws) cudaFree(fs->conv_ws);
  if (fs->conv_cnt) cudaFree(fs->conv_cnt);
  if (fs->err_host) cudaFreeHost(fs->err_host);
  kiln__anomaly_free(ctx);
  kiln__kcache_free(fs->kernels, ctx->has_gpu);
  kiln__blas_free(fs->blas);
  free(fs);
  ctx->fusion_state = NULL;
}

kiln_status kiln__engine_flush(kiln_ctx *ctx, int32_t first, int32_t last) {
  kiln__program pg;
  kiln_exec_stats before = ctx->stats;
  bool ok = kiln__program_build(ctx, first, last, &pg);
  if (!ctx->has_gpu) {
    /* planned and compiled, as with a GPU; nothing is allocated, launched or executed */
    if (pg.plan.group_of) {
      kiln__flush_stats(ctx, &pg, &before);
      ctx->stats.nodes_executed = before.nodes_executed;
    }
    kiln__program_free(&pg);
    return ctx->status;
  }
  if (ok) kiln__program_run(ctx, &pg);
  if (pg.plan.group_of) kiln__flush_stats(ctx, &pg, &before); /* it was planned */
  kiln__program_free(&pg);
  return ctx->status;
}

kiln_status kiln__engine_compile(kiln_ctx *ctx, int32_t first, int32_t last) {
  if (!kiln__ok(ctx)) return kiln_ctx_status(ctx);
  if (!ctx->fusion_state || !ctx->fusion_state->kernels)
    return kiln__error(ctx, KILN_ERR_STATE, "kiln: the context's kernel compiler failed to start");
  kiln__program pg;
  kiln__program_build(ctx, first, last, &pg);
  kiln__program_free(&pg);
  return ctx->status;
}

/* What a block may ask for on sm_90 (H100, H200): the limit without a GPU to ask. */
#define KILN__SMEM_OPTIN_SM90 (227 * 1024)

kiln_status kiln__engine_compile_custom(kiln_ctx *ctx, kiln_custom_op *op) {
  if (!kiln__ok(ctx)) return kiln_ctx_status(ctx);
  if (!ctx->fusion_state || !ctx->fusion_state->kernels)
    return kiln__error(ctx, KILN_ERR_STATE, "kiln: the context's kernel compiler failed to start");
  int optin = KILN__SMEM_OPTIN_SM90;
  if (ctx->has_gpu &&
      KILN_CUDA_FAILED(ctx, cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin,
                                                   ctx->device)))
    return ctx->status;
  kiln__rendered r;
  memset(&r, 0, sizeof r);
  r.pdl = kiln__pdl_launch(ctx); /* the kernel the step will launch, so the step finds it cached */
  bool ok = kiln__custom_source(op, &r);
  char comment[96];
  snprintf(comment, sizeof comment, "// custom op %s\n", op->o.name);
  kiln__kernel *k = ok ? kiln__compile(ctx, r.name, r.src.s, comment, false, 0) : NULL;
  kiln__sb_free(&r.src);
  if (!ok) return kiln__error(ctx, KILN_ERR_OOM, "kiln_custom_op_new: out of host memory");
  if (!k) { /* NVRTC's message, with the function and the op in front */
    char why[sizeof ctx->error];
    kiln_status s = ctx->status;
    memcpy(why, ctx->error, sizeof why);
    kiln_ctx_clear_error(ctx);
    return kiln__error(ctx, s, "kiln_custom_op_new: op '%s': %s", op->o.name, why);
  }
  /* the dynamic shared memory a launch may ask for: what the device lets a block have, less the
   * kernel's static shared memory (CUDA refuses a limit past their sum) */
  op->smem_max = (uint32_t)optin;
  if (ctx->has_gpu) {
    struct cudaFuncAttributes fa;
    if (KILN_CUDA_FAILED(ctx, cudaFuncGetAttributes(&fa, kiln__kernel_fn(k)))) return ctx->status;
    int dyn = optin - (int)fa.sharedSizeBytes;
    if (dyn < 0 ||
        KILN_CUDA_FAILED(ctx, cudaKernelSetAttributeForDevice(
                                  (cudaKernel_t)(uintptr_t)kiln__kernel_fn(k),
                                  cudaFuncAttributeMaxDynamicSharedMemorySize, dyn, ctx->device)))
      return kiln__error(ctx, KILN_ERR_CUDA,
                         "kiln_custom_op_new: op '%s': its kernel's %zu bytes of static shared "
                         "memory leave none of the device's %d",
                         op->o.name, fa.sharedSizeBytes, optin);
    op->smem_max = (uint32_t)dyn;
  }
  return KILN_OK;
}

kiln_status kiln__engine_step(kiln_ctx *ctx) { return kiln__graph_run(ctx); }

void kiln__engine_drop_graphs(kiln_ctx *ctx, bool drop) {
  kiln__fusion *fs = ctx->fusion_state;
  if (fs) fs->drop_graphs = drop && fs->ngraphs > 0;
}

void kiln__engine_free_graphs(kiln_ctx *ctx) {
  kiln__fusion *fs = ctx->fusion_state;
  if (!fs || !ctx->has_gpu || fs->ngraphs == 0) return;
  (void)cudaStreamSynchronize(ctx->stream); /* their last replays finish first */
  kiln__graphs_free(ctx);
}

void kiln__engine_step_begin(kiln_ctx *ctx) {
  kiln__fusion *fs = ctx->fusion_state;
  if (!fs) return;
  if (fs->drop_graphs) kiln__engine_free_graphs(ctx);
  fs->drop_graphs = false;
}

void kiln__engine_fetch_errors(kiln_ctx *ctx) {
  kiln__fusion *fs = ctx->fusion_state;
  if (!ctx->has_gpu || !fs || !fs->err_dev) return;
  cudaStream_t stream = ctx->stream;
  KILN_CUDA_FAILED(ctx, cudaMemcpyAsync(fs->err_host, fs->err_dev, sizeof *fs->err_host,
                                        cudaMemcpyDeviceToHost, stream));
}

kiln_status kiln__engine_check_errors(kiln_ctx *ctx) {
  kiln__fusion *fs = ctx->fusion_state;
  if (!fs || !fs->err_host || fs->err_host->code == 0) return ctx->status;
  kiln__dev_error e = *fs->err_host;
  memset(fs->err_host, 0, sizeof *fs->err_host);
  cudaStream_t stream = ctx->stream;
  KILN_CUDA_FAILED(ctx, cudaMemsetAsync(fs->err_dev, 0, sizeof *fs->err_dev, stream));
  if (e.code == KILN__DEV_ERR_LABEL)
    return kiln__error(ctx, KILN_ERR_INVALID,
                       "kiln_cross_entropy: a label is %lld; labels must be in [0, %lld) (found "
                       "on the device by a step that has run)",
                       e.value, e.limit);
  if (e.code == KILN__DEV_ERR_OVERFLOW)
    return kiln__error(ctx, KILN_ERR_INVALID,
                       "kiln_sum: a sum of i32 values is %lld, outside the i32 range [-%lld, "
                       "%lld) (found on the device by a step that has run)",
                       e.value, e.limit, e.limit);
  return kiln__error(ctx, KILN_ERR_INVALID,
                     "kiln_index_select: a row index is %lld; indices must be in [0, %lld) (found "
                     "on the device by a step that has run)",
                     e.value, e.limit);
}
