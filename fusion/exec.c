/*
 * exec.c: the executor. A flush is built into a program: planned (plan.c), lowered (lower.c),
 * rendered (render.c) and compiled (compile.c); then every value that must be written gets device
 * memory, the kernels' pointers are bound, the step values uploaded, and only then is anything
 * launched: a flush that cannot compile or allocate runs nothing. With KILN_NVTX=1 each launch is
 * an NVTX range named like its kernel; while a trace is recorded (ctx->prof) each launch is a
 * region of it (prof/prof.h, profile.c). The engine (engine.c) and the step graphs (graph.c) call
 * it; it calls neither.
 */
#include <inttypes.h>
#include <nvtx3/nvToolsExt.h>
#include <stdlib.h>
#include <string.h>

#include "../core/cuda_check.h"
#include "../prof/prof.h"
#include "fusion.h"

/* ---------------------------------------------------------------- building a program */

/* The trace index of n, which must be a node of the trace. */
static int32_t node_index(const kiln__trace *tr, const kiln__node *n) {
  KILN_ASSERT(n >= tr->nodes && n < tr->nodes + tr->n);
  return (int32_t)(n - tr->nodes);
}

/* Call k's launch, arguments and name from its rendered kernel r, compiled as kernel. */
static void fill_call(const kiln__trace *tr, kiln__call *c, const kiln__rendered *r,
                      kiln__kernel *kernel) {
  c->k = kernel;
  c->arg = r->arg;
  c->grid = r->grid;
  c->block = r->block;
  c->grid_y = r->grid_y;
  c->grid_z = r->grid_z;
  c->smem = r->smem;
  c->ws_slot = r->ws_slot;
  c->bytes_read = r->bytes_read;
  c->bytes_written = r->bytes_written;
  c->zero_slot = r->zero_slot;
  c->zero_bytes = r->zero_bytes;
  c->ntmap = r->ntmap;
  c->tma_slot = r->tma_slot;
  memcpy(c->tmap, r->tmap, sizeof c->tmap);
  c->pdl = r->pdl;
  snprintf(c->name, sizeof c->name, "%s", r->name);
  /* attribute sources are trace nodes (lowering's stand-ins carry no attributes) */
  for (int q = 0; q < KILN__KMAX_F; q++)
    if (r->arg.fsrc[q]) c->fi[q] = node_index(tr, r->arg.fsrc[q]);
  for (int q = 0; q < KILN__KMAX_U; q++)
    if (r->arg.usrc[q]) c->ui[q] = node_index(tr, r->arg.usrc[q]);
}

/* Renders every group's kernel, compiles them all at once (kiln__compile_all: what the caches
 * lack on a pool of threads), then fills the calls. */
static bool build_calls(kiln_ctx *ctx, kiln__program *pg) {
  const kiln__trace *tr = &ctx->trace;
  kiln__target target = {.num_sms = ctx->num_sms,
                         .conv_warp_spec = ctx->conv_warp_spec,
                         .conv_tma = ctx->conv_tma,
                         .conv_staged = ctx->conv_staged,
                         .conv_phases = ctx->conv_phases,
                         .im2col_lanes = ctx->im2col_lanes,
                         .im2col_rows = ctx->im2col_rows,
                         .pool_grad_blocks = ctx->pool_grad_blocks,
                         .window_ahead = ctx->window_ahead,
                         .conv_few = ctx->conv_few,
                         .conv_few_wgrad = ctx->conv_few_wgrad,
                         .pdl = kiln__pdl_launch(ctx),
                         .conv_dgrad_bn = ctx->conv_dgrad_bn,
                         .conv_fprop_bn = ctx->conv_fprop_bn,
                         .conv_prefetch = ctx->conv_prefetch,
                         .conv_dgrad_ws = ctx->conv_dgrad_ws,
                         .conv_hoist = ctx->conv_hoist,
                         .conv_ahead = ctx->conv_ahead,
                         .cast_tiles = ctx->cast_tiles,
                         .customs = ctx->customs,
                         .ncustom = ctx->ncustom};
  int ng = pg->plan.ng, nr = 0;
  size_t slots = (size_t)(ng > 0 ? ng : 1);
  kiln__rendered *r = calloc(slots, sizeof *r);
  kiln__compile_req *req = calloc(slots, sizeof *req);
  int *req_of = malloc(slots * sizeof *req_of);
  bool ok = r && req && req_of;
  if (!ok) kiln__error(ctx, KILN_ERR_OOM, "kiln_flush: out of host memory rendering kernels");
  for (int k = 0; k < ng && ok; k++) {
    const kiln__spec *s = &pg->spec[k];
    kiln__call *c = &pg->call[k];
    for (int q = 0; q < KILN__KMAX_F; q++)
      c->fi[q] = -1;
    for (int q = 0; q < KILN__KMAX_U; q++)
      c->ui[q] = -1;
    req_of[k] = -1;
    if (s->kind == KILN__SPEC_BLAS) {
      kiln__blas_name(&s->gemm, c->name, sizeof c->name);
      continue;
    }
    ok = kiln__render(&target, s, &r[k]);
    if (!ok) {
      kiln__error(ctx, KILN_ERR_OOM, "kiln_flush: out of host memory rendering a kernel");
      break;
    }
    req[nr] = (kiln__compile_req){.name = r[k].name,
                                  .source = r[k].src.s,
                                  .comment = s->comment,
                                  .sm90a = r[k].sm90a,
                                  .smem = r[k].smem};
    req_of[k] = nr++;
  }
  ok = ok && kiln__compile_all(ctx, nr, req);
  for (int k = 0; k < ng && ok; k++)
    if (req_of[k] >= 0) fill_call(tr, &pg->call[k], &r[k], req[req_of[k]].k);
  for (int k = 0; r && k < ng; k++)
    kiln__sb_free(&r[k].src);
  free(r);
  free(req);
  free(req_of);
  return ok;
}

bool kiln__program_build(kiln_ctx *ctx, int32_t first, int32_t last, kiln__program *pg) {
  memset(pg, 0, sizeof *pg);
  for (int32_t i = first; i < last; i++)
    if (ctx->trace.nodes[i].gone)
      return !kiln__error(ctx, KILN_ERR_STATE,
                          "kiln_flush: node #%d (%s) reads a persistent tensor that was freed "
                          "after it was recorded; nothing of this flush ran",
                          i, kiln__ops[ctx->trace.nodes[i].op].name);
  /* anomaly mode: unfused, so that every node's values reach memory, and its check compiled */
  if (ctx->anomaly && !kiln__anomaly_kernel(ctx)) return false;
  if (!kiln__plan_build(ctx, first, last, ctx->fusion && !ctx->anomaly, &pg->plan)) return false;
  if (!kiln__lower(ctx, &pg->plan, &pg->spec)) return false;
  pg->call = calloc((size_t)(pg->plan.ng > 0 ? pg->plan.ng : 1), sizeof *pg->call);
  if (!pg->call) return !kiln__error(ctx, KILN_ERR_OOM, "kiln_flush: out of host memory");
  if (!build_calls(ctx, pg)) return false;
  if (ctx->debug & KILN__DEBUG_TRAFFIC) kiln__print_traffic(ctx, pg);
  return true;
}

void kiln__program_free(kiln__program *pg) {
  kiln__plan_free(&pg->plan);
  free(pg->spec);
  free(pg->call);
  memset(pg, 0, sizeof *pg);
}

/* ---------------------------------------------------------------- memory and arguments */

void kiln__bind_write_through(kiln_ctx *ctx, const kiln__plan *p) {
  for (int32_t i = p->first; i < p->last; i++) {
    const kiln_tensor *D = p->write_to[i - p->first];
    if (!D) continue;
    kiln__storage *st = ctx->trace.nodes[i].out->st;
    st->ptr = D->st->ptr;
    st->borrowed = true;
    st->fused = false;
  }
}

/* Device memory for every value of the flush that is written and has none yet; on failure what
 * this flush took is given back, so that the context stays usable. */
static bool alloc_outputs(kiln_ctx *ctx, const kiln__plan *p) {
  kiln__trace *tr = &ctx->trace;
  for (int32_t i = p->first; i < p->last; i++) {
    kiln__node *n = &tr->nodes[i];
    if (!n->out || kiln__ops[n->op].kind == KILN__KIND_VIEW || n->out->st->ptr) continue;
    if (!p->store[i - p->first]) {
      n->out->st->fused = true; /* kept in registers: never written */
      continue;
    }
    n->out->st->fused = false;
    if (n->out->st->bytes == 0) continue;
    n->out->st->ptr = kiln__dev_alloc(ctx, n->out->st->bytes);
    if (!n->out->st->ptr) {
      char sh[96];
      size_t bytes = n->out->st->bytes;
      for (int32_t j = p->first; j < i; j++) {
        kiln__node *m = &tr->nodes[j];
        if (m->out && !m->out->st->persistent && m->out->st->ptr && !m->out->st->borrowed &&
            kiln__ops[m->op].kind != KILN__KIND_VIEW) {
          kiln__dev_free(ctx, m->out->st->ptr);
          m->out->st->ptr = NULL;
        }
      }
      kiln__error(ctx, KILN_ERR_OOM,
                  "kiln_flush: out of device memory: node #%d (%s %s) needs %zu bytes; %zu in "
                  "use, %zu cached; nothing of this flush ran",
                  i, kiln__ops[n->op].name, kiln__shape_of(n->out, sh, sizeof sh), bytes,
                  ctx->alloc.in_use, ctx->alloc.cached);
      return false;
    }
  }
  return true;
}

size_t kiln__relu_mask_bytes(const kiln_tensor *y) {
  int64_t cols = y->shape[y->ndim - 1]; /* the product's columns; rows are the rest */
  return kiln__blas_mask_bytes(cols ? kiln_tensor_numel(y) / cols : 0, cols);
}

/* The bit masks that forward ReLU epilogues write, kept with their outputs' storage. */
static bool alloc_masks(kiln_ctx *ctx, const kiln__plan *p) {
  for (int k = 0; k < p->ng; k++) {
    const kiln__group *g = &p->g[k];
    if (!(kiln__epi_flags(g->epi) & KILN__EPI_WRITES_MASK)) continue;
    kiln__storage *st = g->aux->st;
    if (st->relu_mask) continue;
    size_t bytes = kiln__relu_mask_bytes(g->aux);
    st->relu_mask = kiln__dev_alloc(ctx, bytes ? bytes : 16);
    if (!st->relu_mask) {
      kiln__error(ctx, KILN_ERR_OOM,
                  "kiln_flush: out of device memory for a ReLU mask of %zu bytes; nothing of this "
                  "flush ran",
                  bytes);
      return false;
    }
  }
  return true;
}

/* The implicit weight gradients' split-K workspace and tile counters, allocated once a context
 * (their addresses stay the same for every step graph) and the counters zeroed. */
static bool conv_workspace(kiln_ctx *ctx) {
  kiln__fusion *fs = ctx->fusion_state;
  if (fs->conv_ws) return true;
  size_t cnt = KILN__CONV_COUNTERS * sizeof *fs->conv_cnt;
  if (cudaMalloc((void **)&fs->conv_ws, KILN__CONV_WS_BYTES) != cudaSuccess ||
      cudaMalloc((void **)&fs->conv_cnt, cnt) != cudaSuccess) {
    (void)cudaGetLastError();
    if (fs->conv_ws) cudaFree(fs->conv_ws);
    fs->conv_ws = NULL;
    return !kiln__error(ctx, KILN_ERR_OOM,
                        "kiln_flush: out of device memory for the convolutions' split-K "
                        "workspace of %zu bytes; nothing of this flush ran",
                        KILN__CONV_WS_BYTES + cnt);
  }
  if (KILN_CUDA_FAILED(ctx, cudaMemset(fs->conv_cnt, 0, cnt))) {
    cudaFree(fs->conv_ws);
    cudaFree(fs->conv_cnt);
    fs->conv_ws = NULL;
    fs->conv_cnt = NULL;
    return false;
  }
  return true;
}

/* Encodes the calls' tensor maps (their tensors bound), copies them into maps on the stream and
 * binds each call's map slot. */
static bool bind_maps(kiln_ctx *ctx, kiln__program *pg, kiln__devbuf *maps) {
  size_t n = 0;
  for (int k = 0; k < pg->plan.ng; k++)
    if (pg->call[k].k) n += (size_t)pg->call[k].ntmap;
  if (n == 0) return true;
  size_t bytes = n * KILN__TMAP_BYTES;
  if (bytes > maps->cap) {
    void *d = kiln__dev_alloc(ctx, bytes);
    if (!d)
      return !kiln__error(ctx, KILN_ERR_OOM,
                          "kiln_flush: out of device memory for %zu tensor maps; nothing of this "
                          "flush ran",
                          n);
    if (maps->p) kiln__dev_free(ctx, maps->p); /* its last readers ran before, on the stream */
    maps->p = d;
    maps->cap = bytes;
  }
  unsigned char *host = aligned_alloc(64, bytes);
  if (!host) return !kiln__error(ctx, KILN_ERR_OOM, "kiln_flush: out of host memory");
  size_t at = 0;
  bool ok = true;
  for (int k = 0; k < pg->plan.ng && ok; k++) {
    kiln__call *c = &pg->call[k];
    if (!c->k || c->ntmap == 0) continue;
    c->arg.args.ptr[c->tma_slot] = (char *)maps->p + at * KILN__TMAP_BYTES;
    for (int i = 0; i < c->ntmap && ok; i++, at++)
      ok = kiln__tmap_encode(ctx, &c->tmap[i], c->arg.args.ptr[c->tmap[i].operand],
                             host + at * KILN__TMAP_BYTES);
  }
  /* pageable memory: the copy has read host when it returns */
  ok = ok && !KILN_CUDA_FAILED(
                 ctx, cudaMemcpyAsync(maps->p, host, bytes, cudaMemcpyHostToDevice, ctx->stream));
  free(host);
  return ok;
}

bool kiln__bind_args(kiln_ctx *ctx, kiln__program *pg, kiln__devbuf *maps) {
  for (int k = 0; k < pg->plan.ng; k++) {
    kiln__call *c = &pg->call[k];
    c->arg.args.err = ctx->fusion_state->err_dev;
    for (int q = 0; q < c->arg.nptr; q++) {
      const kiln_tensor *t = c->arg.ptr[q];
      /* the renderer chose 16-byte vector access from offsets alone, trusting this */
      KILN_ASSERT(!t->st->ptr || (uintptr_t)t->st->ptr % 16 == 0);
      c->arg.args.ptr[q] = kiln__data_ptr(t);
    }
    if (c->k && c->ws_slot > 0) {
      if (!conv_workspace(ctx)) return false;
      c->arg.args.ptr[c->ws_slot] = ctx->fusion_state->conv_ws;
      c->arg.args.ptr[c->ws_slot + 1] = ctx->fusion_state->conv_cnt;
    }
  }
  return bind_maps(ctx, pg, maps);
}

/* ---------------------------------------------------------------- step values */

void kiln__fill_values(const kiln_ctx *ctx, const kiln__program *pg, kiln__stepvals *host) {
  const kiln__node *nodes = ctx->trace.nodes;
  for (int k = 0; k < pg->plan.ng; k++) {
    const kiln__call *c = &pg->call[k];
    for (int s = 0; s < KILN__KMAX_F; s++)
      host[k].f[s] = c->fi[s] >= 0 ? nodes[c->fi[s]].f[c->arg.fk[s]] : 0.f;
    for (int s = 0; s < KILN__KMAX_U; s++)
      host[k].u[s] = c->ui[s] >= 0 ? nodes[c->ui[s]].u[c->arg.uk[s]] : 0;
  }
}

bool kiln__upload_values(kiln_ctx *ctx, kiln__program *pg, void *dev) {
  int ng = pg->plan.ng;
  if (ng == 0) return true;
  kiln__stepvals *host = malloc((size_t)ng * sizeof *host);
  if (!host) return !kiln__error(ctx, KILN_ERR_OOM, "kiln_flush: out of host memory");
  kiln__fill_values(ctx, pg, host);
  kiln__stepvals *v = dev;
  for (int k = 0; k < ng; k++) {
    pg->call[k].arg.args.fv = v[k].f;
    pg->call[k].arg.args.uv = v[k].u;
  }
  cudaStream_t stream = ctx->stream;
  bool ok = !KILN_CUDA_FAILED(
      ctx, cudaMemcpyAsync(dev, host, (size_t)ng * sizeof *host, cudaMemcpyHostToDevice, stream));
  free(host);
  return ok;
}

/* Copies an eager flush's step values to the device (eager flushes share one buffer: the copy
 * is ordered after the kernels that read the previous contents). */
static bool upload_eager_values(kiln_ctx *ctx, kiln__program *pg) {
  kiln__fusion *fs = ctx->fusion_state;
  int ng = pg->plan.ng;
  if (ng == 0) return true;
  if (ng > fs->step_values_cap) {
    int cap = ng < 64 ? 64 : ng * 2; /* room to grow: it is reallocated only when outgrown */
    void *d = kiln__dev_alloc(ctx, (size_t)cap * sizeof(kiln__stepvals));
    if (!d)
      return !kiln__error(ctx, KILN_ERR_OOM,
                          "kiln_flush: out of device memory for the step values (%d groups)", cap);
    if (fs->step_values) kiln__dev_free(ctx, fs->step_values);
    fs->step_values = d;
    fs->step_values_cap = cap;
  }
  return kiln__upload_values(ctx, pg, fs->step_values);
}

/* ---------------------------------------------------------------- launching */

static bool launch(kiln_ctx *ctx, kiln__call *c) {
  if (c->arg.args.n == 0) return true;
  void *params[1] = {&c->arg.args};
  ctx->stats.kernels_launched++;
  dim3 grid = {c->grid, c->grid_y ? c->grid_y : 1, c->grid_z ? c->grid_z : 1},
       block = {c->block, 1, 1};
  cudaStream_t stream = ctx->stream;
  if (c->zero_bytes > 0 && KILN_CUDA_FAILED(ctx, cudaMemsetAsync(c->arg.args.ptr[c->zero_slot], 0,
                                                                 c->zero_bytes, stream)))
    return false;
  if (!c->pdl)
    return !KILN_CUDA_FAILED(
        ctx, cudaLaunchKernel(kiln__kernel_fn(c->k), grid, block, params, c->smem, stream));
  /* a programmatic dependent of the kernel before it (its first statement waits for that one) */
  cudaLaunchAttribute attr = {.id = cudaLaunchAttributeProgrammaticStreamSerialization,
                              .val = {.programmaticStreamSerializationAllowed = 1}};
  cudaLaunchConfig_t cfg = {.gridDim = grid,
                            .blockDim = block,
                            .dynamicSmemBytes = c->smem,
                            .stream = stream,
                            .attrs = &attr,
                            .numAttrs = 1};
  return !KILN_CUDA_FAILED(ctx, cudaLaunchKernelExC(&cfg, kiln__kernel_fn(c->k), params));
}

bool kiln__run_calls(kiln_ctx *ctx, kiln__program *pg, kiln__run_how how, int32_t *records) {
  bool ok = true;
  bool traced = ctx->prof && how != KILN__RUN_CAPTURE; /* a capture runs nothing */
  bool anomaly = ctx->anomaly && how == KILN__RUN_EAGER;
  size_t seen = 0;
  if (records) kiln__captured_records(ctx, &seen); /* what the capture held before */
  if (anomaly && !kiln__anomaly_begin(ctx, pg)) return false;
  for (int k = 0; k < pg->plan.ng && ok; k++) {
    if (anomaly && !kiln__anomaly_gate(ctx, pg, k)) return false;
    kiln__call *c = &pg->call[k];
    if (ctx->nvtx) nvtxRangePushA(c->name);
    if (traced)
      kiln__prof_enter(ctx->prof, how == KILN__RUN_FIRST ? KILN__PROF_FIRST_RUN : KILN__PROF_EAGER,
                       kiln__traced_group(ctx, pg, k), kiln__prof_step_of(ctx),
                       kiln__prof_mode(ctx));
    ok = pg->spec[k].kind == KILN__SPEC_BLAS ? kiln__blas_run(ctx, &pg->spec[k].gemm)
                                             : launch(ctx, c);
    if (traced) kiln__prof_leave(ctx->prof);
    if (ctx->nvtx) nvtxRangePop();
    if (records) records[k] = kiln__captured_records(ctx, &seen);
    if (ok && anomaly) ok = kiln__anomaly_check(ctx, pg, k);
  }
  return ok && (!anomaly || kiln__anomaly_end(ctx, pg));
}

void kiln__flush_stats(kiln_ctx *ctx, const kiln__program *pg, const kiln_exec_stats *before) {
  uint64_t rd = 0, wr = 0;
  const kiln__plan *p = &pg->plan;
  for (int i = 0; pg->call && i < p->ng; i++) {
    rd += pg->call[i].bytes_read;
    wr += pg->call[i].bytes_written;
  }
  kiln_flush_stats *f = &ctx->stats.last_flush;
  f->nodes = (uint64_t)(p->last - p->first);
  f->groups = (uint64_t)p->ng;
  f->kernels = ctx->stats.kernels_launched - before->kernels_launched;
  f->bytes_read = rd;
  f->bytes_written = wr;
  f->compiled = ctx->stats.kernels_compiled - before->kernels_compiled;
  f->cache_hits = ctx->stats.cache_hits - before->cache_hits;
  f->compile_ms = ctx->stats.compile_ms - before->compile_ms;
  ctx->stats.groups += (uint64_t)p->ng;
  ctx->stats.bytes_read += rd;
  ctx->stats.bytes_written += wr;
  ctx->stats.nodes_executed += (uint64_t)(p->last - p->first);
}

bool kiln__program_run(kiln_ctx *ctx, kiln__program *pg) {
  kiln__bind_write_through(ctx, &pg->plan);
  if (!alloc_outputs(ctx, &pg->plan) || !alloc_masks(ctx, &pg->plan)) return false;
  return kiln__bind_args(ctx, pg, &ctx->fusion_state->tmaps) && upload_eager_values(ctx, pg) &&
         kiln__run_calls(ctx, pg, KILN__RUN_EAGER, NULL);
}
