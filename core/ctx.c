/*
 * ctx.c: the context: device and stream, options from the environment, the host RNG, steps
 * (generations of intermediates) and statistics. Creating and freeing a context, opening a step
 * and releasing its intermediates are here as internal functions; runtime/context.c puts them
 * together with fusion/'s execution state (kernels, step graphs, BLAS handles and plans) into
 * kiln_ctx_new, kiln_ctx_free and the step calls.
 */
#include <dlfcn.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_check.h"
#include "internal.h"

#ifndef KILN_DEFAULT_ARCH
#define KILN_DEFAULT_ARCH 90
#endif
/* The SM count assumed by contexts without a GPU (an H100/H200 has 132): it only shapes the
 * launch grids that compile-only plans would use. */
#define KILN__DEFAULT_SMS 132

static bool env_off(const char *name) {
  const char *v = getenv(name);
  return v && strcmp(v, "0") == 0;
}
static bool env_on(const char *name) {
  const char *v = getenv(name);
  return v && strcmp(v, "1") == 0;
}

/* KILN_DEBUG: "plan", "verify", "nan", "memory", "traffic", "initcheck", comma-separated. Debug
 * builds verify every plan.
 */
static unsigned debug_flags(void) {
  unsigned f = 0;
#ifdef KILN_VERIFY_PLANS
  f |= KILN__DEBUG_VERIFY;
#endif
  const char *v = getenv("KILN_DEBUG");
  while (v && *v) {
    size_t n = strcspn(v, ",");
    if (n == 4 && strncmp(v, "plan", 4) == 0) f |= KILN__DEBUG_PLAN;
    if (n == 6 && strncmp(v, "verify", 6) == 0) f |= KILN__DEBUG_VERIFY;
    if (n == 3 && strncmp(v, "nan", 3) == 0) f |= KILN__DEBUG_NAN;
    if (n == 6 && strncmp(v, "memory", 6) == 0) f |= KILN__DEBUG_MEMORY;
    if (n == 7 && strncmp(v, "traffic", 7) == 0) f |= KILN__DEBUG_TRAFFIC;
    if (n == 9 && strncmp(v, "initcheck", 9) == 0) f |= KILN__DEBUG_INITCHECK;
    v += n + (v[n] == ',');
  }
  return f;
}

/* Why the CUDA runtime found no device, in words for someone who may have no driver at all:
 * whether libcuda (the driver's library) loads, and which CUDA version it supports. */
static void no_device(kiln_ctx *ctx, cudaError_t e) {
  char why[256];
  int runtime = 0, driver = 0;
  (void)cudaRuntimeGetVersion(&runtime);
  void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (lib) {
    /* cuDriverGetVersion(int *) works before cuInit; a CUresult of 0 is success */
    int (*version)(int *) = NULL;
    void *sym = dlsym(lib, "cuDriverGetVersion");
    if (sym) memcpy(&version, &sym, sizeof sym); /* POSIX: a function's address as a void * */
    if (!version || version(&driver) != 0) driver = 0;
    dlclose(lib);
  }
  if (!lib)
    snprintf(why, sizeof why, "no NVIDIA driver is installed (libcuda.so.1 cannot be loaded)");
  else if (e == cudaErrorInsufficientDriver && driver > 0)
    snprintf(why, sizeof why,
             "the NVIDIA driver supports CUDA up to %d.%d, older than the CUDA %d.%d runtime "
             "kiln was built with",
             driver / 1000, driver % 1000 / 10, runtime / 1000, runtime % 1000 / 10);
  else if (e == cudaSuccess || e == cudaErrorNoDevice) {
    const char *vis = getenv("CUDA_VISIBLE_DEVICES");
    snprintf(why, sizeof why, "the NVIDIA driver sees no GPU%s%s%s",
             vis ? " (CUDA_VISIBLE_DEVICES=\"" : "", vis ? vis : "", vis ? "\")" : "");
  } else
    snprintf(why, sizeof why, "the CUDA driver cannot be used");
  kiln__error(ctx, KILN_ERR_STATE,
              "kiln_ctx_new: no usable GPU: %s (CUDA says: \"%s\"). A context made with "
              "kiln_ctx_options.no_gpu = 1 records, plans and compiles without one",
              why, e != cudaSuccess ? cudaGetErrorString(e) : "cudaGetDeviceCount found 0 devices");
}

static void gpu_init(kiln_ctx *ctx, int device) {
  int count = 0;
  cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess || count == 0) {
    no_device(ctx, e);
    (void)cudaGetLastError();
    return;
  }
  if (device < 0 || device >= count) {
    kiln__error(ctx, KILN_ERR_INVALID, "kiln_ctx_new: device %d out of range [0, %d)", device,
                count);
    return;
  }
  struct cudaDeviceProp prop;
  if (KILN_CUDA_FAILED(ctx, cudaSetDevice(device)) ||
      KILN_CUDA_FAILED(ctx, cudaGetDeviceProperties(&prop, device)))
    return;
  if (prop.major < 7) {
    kiln__error(ctx, KILN_ERR_STATE,
                "kiln_ctx_new: device %d (%s) has compute capability %d.%d; kiln needs 7.0 or "
                "newer",
                device, prop.name, prop.major, prop.minor);
    return;
  }
  ctx->arch = prop.major * 10 + prop.minor;
  ctx->num_sms = prop.multiProcessorCount;
  if (KILN_CUDA_FAILED(ctx, cudaStreamCreateWithFlags(&ctx->stream, cudaStreamNonBlocking))) return;
  ctx->has_gpu = true;
}

kiln_ctx *kiln__ctx_create(const kiln_ctx_options *opts) {
  kiln_ctx *ctx = calloc(1, sizeof *ctx);
  kiln__anchor *anchor = calloc(1, sizeof *anchor);
  if (!ctx || !anchor) {
    free(ctx);
    free(anchor);
    return NULL;
  }
  *anchor = (kiln__anchor){.refs = 1, .alive = true};
  ctx->anchor = anchor;
  kiln_ctx_options o = {0};
  if (opts) o = *opts;
  ctx->device = o.device;
  ctx->arch = KILN_DEFAULT_ARCH;
  ctx->num_sms = KILN__DEFAULT_SMS;
  ctx->gen = 1;
  ctx->tf32 = !env_off("KILN_TF32");
  ctx->training = true;
  ctx->fusion = !env_off("KILN_FUSION");
  ctx->graphs = !env_off("KILN_GRAPH");
  ctx->conv_warp_spec = env_on("KILN_CONV_WS"); /* off by default: slower forward products */
  /* on since their first GPU run (H100, 2026-12-05): the GPU suite passed with all three, and
   * the air step took 3.115 ms with them against 3.507 without, resnet18 9.41 against 10.20 */
  ctx->conv_staged = !env_off("KILN_CONV_STAGED");
  ctx->conv_direct = !env_off("KILN_CONV_DIRECT");
  ctx->im2col_lanes = !env_off("KILN_IM2COL_LANES");
  /* on since its first GPU run (H100, 2026-12-06): resnet18's step 8.102 ms with it against 8.189
   * without (bench/ab_steps.sh, medians of three), its bitwise test passed */
  ctx->im2col_rows = !env_off("KILN_IM2COL_ROWS");
  /* on since its first GPU run (H100, 2026-12-06): resnet18's stem pool gradient 300 us against
   * 395 a pixel a thread, the step 8.054 ms against 8.142 (medians of three); its test passed */
  ctx->pool_grad_blocks = !env_off("KILN_POOL_GRAD_BLOCKS");
  /* on since its first GPU run (H100, 2026-12-07): resnet18 6.913 ms a step against 7.024 with
   * it off (bench/ab_steps.sh, medians of three), the values bitwise the same (its test passed) */
  ctx->window_ahead = !env_off("KILN_WINDOW_AHEAD");
  /* on since its first GPU run (H100, 2026-12-06): the air step 2.629 ms with it against 2.770,
   * air_muon 5.127 against 5.454 (bench/ab_steps.sh, medians of two); its test passed */
  ctx->conv_few = !env_off("KILN_CONV_FEW");
  /* on since its first GPU run (H100, 2026-12-06): its lab 131-133 us on air's first conv at batch
   * 1024 against the cp.async kernel's 206.5, the air step 2.567 ms against 2.639, air_muon 5.046
   * against 5.146 (bench/ab_steps.sh, medians of three); its test passed */
  ctx->conv_few_wgrad = !env_off("KILN_CONV_FEW_WGRAD");
  ctx->conv_few_pool = !env_off("KILN_CONV_FEW_POOL"); /* H100: air 2.488 ms a step, 2.550 off */
  ctx->conv_tma_pool = env_on("KILN_CONV_TMA_POOL");   /* off: air's step 3% slower on the H100 */
  ctx->pdl = env_on("KILN_PDL"); /* off: the H100's steps 4-5.5% slower with it (README) */
  ctx->conv_tma =
      !env_off("KILN_CONV_TMA"); /* H100: air 3.86 ms at 387 MiB, against 3.89 at 1,004 */
  const char *max_co = getenv("KILN_IMPLICIT_CONV_MAX_CO");
  if (max_co) ctx->implicit_conv_max_co = (int)strtol(max_co, NULL, 10);
  ctx->conv_recompute = env_on("KILN_CONV_RECOMPUTE"); /* off: one more im2col a layer */
  ctx->conv_recompute_input = !env_off("KILN_CONV_RECOMPUTE_INPUT");
  ctx->conv_recompute_blocks = !env_off("KILN_CONV_RECOMPUTE_BLOCKS");
  /* on since their first GPU run (H100, 2026-12-05, the GPU tests passed with both): resnet18's
   * step 8.72 ms with both against 9.16 without (peak 1,819 MiB against 1,754), air's 3.03 against
   * 3.06 */
  ctx->conv_kpad = !env_off("KILN_CONV_KPAD");
  ctx->conv_moments = !env_off("KILN_CONV_MOMENTS");
  /* the three on since their first GPU run (H100, 2026-12-07: the GPU suite with them on; resnet18
   * 7.004 ms a step with all three against 7.287 without, dev/README.md) */
  ctx->fprop_moments = !env_off("KILN_CONV_FPROP_MOMENTS");
  ctx->pool_moments = env_on("KILN_POOL_MOMENTS"); /* off: the air step slower (README) */
  ctx->window_moments = !env_off("KILN_WINDOW_MOMENTS");
  /* on since the H100 run of 2026-12-05 (bench/ab_steps.sh, medians of three): air 2.839 ms with
   * both against 2.894, resnet18 8.268 against 8.338; KILN_CONV_HOIST=2 took them to 2.830 and
   * 8.261 (4: 2.965 and 8.240) */
  ctx->pool_prologue = !env_off("KILN_POOL_PROLOGUE");
  ctx->pool_fwd_prologue = !env_off("KILN_POOL_FWD_PROLOGUE");
  /* H100: resnet18 7.270 ms a step against 7.327 without it */
  ctx->few_prologue = !env_off("KILN_CONV_FEW_PROLOGUE");
  /* off: slower than cuBLAS and col2im on its first H100 run (dev/README.md) */
  ctx->conv_phases = env_on("KILN_CONV_TMA_PHASES");
  ctx->conv_prefetch = !env_off("KILN_CONV_PREFETCH");
  /* off: bitwise, but no faster on its first H100 run (air 1.019x, resnet18 1.034x; README), nor
   * with one room and five stages (H100, 2026-12-07: air 1.052x, resnet18 1.094x; two rooms the
   * same) */
  const char *dgrad_ws = getenv("KILN_CONV_DGRAD_WS"); /* 1: the staged tiles in one room, 2: two */
  ctx->conv_dgrad_ws = !dgrad_ws ? 0 : strcmp(dgrad_ws, "2") == 0 ? 2 : strcmp(dgrad_ws, "1") == 0;
  const char *hoist = getenv("KILN_CONV_HOIST"); /* 0 to 16 (internal.h); others: the default */
  char *end = NULL;
  long depth = hoist ? strtol(hoist, &end, 10) : -1;
  ctx->conv_hoist = hoist && *hoist && !*end && depth >= 0 && depth <= 16 ? (int)depth : 2;
  /* the H200 run of 2026-12-05 (bench/ab_steps.sh, medians of three rounds; README's table of
   * switches): the multi-tensor casts took the air step from 2.696 ms to 2.681, the whitening
   * conv's GELU in its kernel to 2.678, so they are on; the others stay off: KILN_CONV_AHEAD and
   * KILN_BN_ROWS no faster (2.702 and 2.696 against 2.689), KILN_CONV_WGRAD_INTO slower (2.723),
   * KILN_EW_SINK no faster on resnet18 and one ulp off in a gradient-clipping test */
  ctx->conv_ahead = env_on("KILN_CONV_AHEAD");
  ctx->bn_rows = env_on("KILN_BN_ROWS");
  ctx->ew_sink = env_on("KILN_EW_SINK");
  ctx->conv_wgrad_into = env_on("KILN_CONV_WGRAD_INTO");
  ctx->cast_batch = !env_off("KILN_CAST_BATCH");
  ctx->cast_tiles = !env_off("KILN_CAST_TILES");
  ctx->conv_direct_epi = !env_off("KILN_CONV_DIRECT_EPI");
  /* H100, 2026-12-06: resnet18 7.879 ms against 8.161, peak 1,337 MiB against 1,800 */
  ctx->conv_s2d = !env_off("KILN_CONV_S2D");
  ctx->conv_dgrad_bn = 128; /* KILN_CONV_DGRAD_BN=256: one tile as wide as the channels (0) */
  const char *dgrad_bn = getenv("KILN_CONV_DGRAD_BN");
  if (dgrad_bn && (strcmp(dgrad_bn, "64") == 0 || strcmp(dgrad_bn, "128") == 0))
    ctx->conv_dgrad_bn = atoi(dgrad_bn);
  else if (dgrad_bn && strcmp(dgrad_bn, "256") == 0)
    ctx->conv_dgrad_bn = 0;
  /* 256 (H100: 13 us off air's 15x15x64->64 product, 21 us off each of ResNet-18's 56x56x64->64);
   * 0: every tile in about 192 KB of stages, one block an SM */
  const char *fprop_bn = getenv("KILN_CONV_FPROP_BN");
  ctx->conv_fprop_bn = 256;
  if (fprop_bn &&
      (strcmp(fprop_bn, "0") == 0 || strcmp(fprop_bn, "64") == 0 || strcmp(fprop_bn, "128") == 0))
    ctx->conv_fprop_bn = atoi(fprop_bn);
  ctx->nvtx = env_on("KILN_NVTX");
  ctx->debug = debug_flags();
  ctx->anomaly = (ctx->debug & KILN__DEBUG_NAN) != 0;
  ctx->bw_from = -1;
  const char *seed = getenv("KILN_SEED");
  kiln_manual_seed(ctx, seed ? strtoull(seed, NULL, 0) : 0);
  if (!o.no_gpu) gpu_init(ctx, o.device);
  return ctx;
}

void kiln__storages_release(kiln_ctx *ctx) {
  for (kiln__storage *s = ctx->step_storages; s; s = s->next) {
    if (s->ptr && !s->borrowed) kiln__dev_free(ctx, s->ptr);
    if (s->relu_mask && !s->borrowed) kiln__dev_free(ctx, s->relu_mask);
    s->ptr = s->relu_mask = NULL;
  }
  ctx->step_storages = NULL;
}

kiln__anchor *kiln__ctx_anchor(kiln_ctx *ctx) {
  ctx->anchor->refs++;
  return ctx->anchor;
}

void kiln__anchor_release(kiln__anchor *a) {
  KILN_ASSERT(a->refs > 0);
  if (--a->refs == 0) free(a);
}

void kiln__ctx_close(kiln_ctx *ctx) {
  ctx->anchor->alive = false; /* objects made from it, freed later, free only their host memory */
  kiln__anchor_release(ctx->anchor);
  if (ctx->has_gpu) (void)cudaStreamSynchronize(ctx->stream);
  kiln__storages_release(ctx);
  for (int i = 0; i < ctx->npersistent; i++)
    ctx->persistents[i]->owned = false; /* their lists (freed later, or never) free nothing */
  while (ctx->npersistent > 0)
    kiln__tensor_release(ctx->persistents[ctx->npersistent - 1]);
  free(ctx->persistents);
  ctx->persistents = NULL;
}

void kiln__ctx_destroy(kiln_ctx *ctx) {
  kiln__alloc_release_all(ctx);
  if (ctx->stream) cudaStreamDestroy(ctx->stream);
  kiln__arena_free(&ctx->arenas[0]);
  kiln__arena_free(&ctx->arenas[1]);
  kiln__handles_free(ctx);
  kiln__undo_free(ctx);
  kiln__customs_free(ctx);
  free(ctx->trace.nodes);
  free(ctx);
}

void kiln_ctx_clear_error(kiln_ctx *ctx) {
  if (!ctx) return;
  ctx->status = KILN_OK;
  ctx->error[0] = 0;
  if (ctx->has_gpu) (void)cudaGetLastError(); /* drops a non-sticky CUDA error, such as OOM */
}

int kiln_ctx_has_gpu(const kiln_ctx *ctx) { return ctx && ctx->has_gpu; }
void *kiln_ctx_stream(const kiln_ctx *ctx) { return ctx ? (void *)ctx->stream : NULL; }

const char *kiln_version(void) {
#define KILN__S(x) #x
#define KILN__XS(x) KILN__S(x)
  return KILN__XS(KILN_VERSION_MAJOR) "." KILN__XS(KILN_VERSION_MINOR) "." KILN__XS(
      KILN_VERSION_PATCH);
}

void kiln_set_training(kiln_ctx *ctx, int on) {
  if (ctx) ctx->training = on != 0;
}
int kiln_training(const kiln_ctx *ctx) { return ctx && ctx->training; }

void kiln_eval_begin(kiln_ctx *ctx) {
  if (!ctx) return;
  if (ctx->eval_depth == KILN__MAX_EVAL)
    return (void)kiln__error(ctx, KILN_ERR_STATE,
                             "kiln_eval_begin: %d evaluation regions are open already (the most "
                             "that nest)",
                             KILN__MAX_EVAL);
  uint64_t bit = (uint64_t)1 << ctx->eval_depth;
  ctx->eval_training = ctx->training ? ctx->eval_training | bit : ctx->eval_training & ~bit;
  ctx->eval_depth++;
  ctx->training = false;
  ctx->no_grad_depth++;
}

void kiln_eval_end(kiln_ctx *ctx) {
  if (!ctx) return;
  if (ctx->eval_depth == 0)
    return (void)kiln__error(ctx, KILN_ERR_STATE,
                             "kiln_eval_end: no evaluation region is open (more kiln_eval_end "
                             "calls than kiln_eval_begin)");
  if (ctx->no_grad_depth == 0)
    return (void)kiln__error(
        ctx, KILN_ERR_STATE,
        "kiln_eval_end: the no-grad region of evaluation region %d was closed "
        "already (a kiln_no_grad_end inside it without its kiln_no_grad_begin)",
        ctx->eval_depth);
  ctx->eval_depth--;
  ctx->training = (ctx->eval_training >> ctx->eval_depth) & 1;
  ctx->no_grad_depth--;
}

void kiln_set_tf32(kiln_ctx *ctx, int on) {
  if (ctx) ctx->tf32 = on != 0;
}
int kiln_tf32(const kiln_ctx *ctx) { return ctx && ctx->tf32; }
void kiln_set_fusion(kiln_ctx *ctx, int on) {
  if (ctx) ctx->fusion = on != 0;
}
int kiln_fusion(const kiln_ctx *ctx) { return ctx && ctx->fusion; }
void kiln_set_anomaly(kiln_ctx *ctx, int on) {
  if (ctx) ctx->anomaly = on != 0;
}
int kiln_anomaly(const kiln_ctx *ctx) { return ctx && ctx->anomaly; }

void kiln_manual_seed(kiln_ctx *ctx, uint64_t seed) {
  if (!ctx) return;
  ctx->seed = seed;
  ctx->philox_offset = 0;
  ctx->host_rng = seed ^ 0x5851f42d4c957f2dULL; /* any fixed odd constant: seed 0 is no state 0 */
}

uint64_t kiln__rng_next(kiln_ctx *ctx) { return kiln__splitmix64(&ctx->host_rng); }
double kiln__rng_uniform(kiln_ctx *ctx) { return kiln__splitmix64_unit(&ctx->host_rng); }

void kiln__step_open(kiln_ctx *ctx) {
  for (int i = 0; i < ctx->npersistent; i++)
    ctx->persistents[i]->bw_acc = NULL;
  ctx->trace.n = ctx->trace.done = 0;
  ctx->gen++;
  ctx->in_step = true;
  kiln__undo_begin(ctx);
  kiln__arena_reset(&ctx->arenas[ctx->gen & 1]);
  kiln__handles_step(ctx);
}

void kiln_memory_stats(const kiln_ctx *ctx, kiln_mem_stats *out) {
  if (!out) return;
  memset(out, 0, sizeof *out);
  if (!ctx) return;
  out->in_use = ctx->alloc.in_use;
  out->peak = ctx->alloc.peak;
  out->cached = ctx->alloc.cached;
  out->reserved = ctx->alloc.in_use + ctx->alloc.cached;
  out->device_mallocs = ctx->alloc.device_mallocs;
}

void kiln_memory_reset_peak(kiln_ctx *ctx) {
  if (ctx) ctx->alloc.peak = ctx->alloc.in_use;
}

void kiln_stats(const kiln_ctx *ctx, kiln_exec_stats *out) {
  if (!out) return;
  if (!ctx) {
    memset(out, 0, sizeof *out);
    return;
  }
  *out = ctx->stats;
}

void kiln_no_grad_begin(kiln_ctx *ctx) {
  if (ctx) ctx->no_grad_depth++;
}
void kiln_no_grad_end(kiln_ctx *ctx) {
  if (!ctx) return;
  if (ctx->no_grad_depth > 0)
    ctx->no_grad_depth--;
  else
    kiln__error(ctx, KILN_ERR_STATE,
                "kiln_no_grad_end: no no-grad region is open (more kiln_no_grad_end calls than "
                "kiln_no_grad_begin)");
}
int kiln_grad_enabled(const kiln_ctx *ctx) { return ctx && ctx->no_grad_depth == 0; }

void kiln_autocast_begin(kiln_ctx *ctx, kiln_dtype dtype) {
  if (!ctx || !kiln__ok(ctx)) return;
  if (dtype != KILN_DTYPE_BF16 && dtype != KILN_DTYPE_F32)
    return (void)kiln__error(ctx, KILN_ERR_DTYPE,
                             "kiln_autocast_begin: dtype %s; regions compute in bf16, or in f32 "
                             "(a region without autocast inside one with it)",
                             kiln_dtype_name(dtype));
  if (ctx->autocast_depth == KILN__MAX_AUTOCAST)
    return (void)kiln__error(ctx, KILN_ERR_STATE,
                             "kiln_autocast_begin: %d autocast regions are open already (the most "
                             "that nest)",
                             KILN__MAX_AUTOCAST);
  ctx->autocast[ctx->autocast_depth++] = dtype;
}

void kiln_autocast_end(kiln_ctx *ctx) {
  if (!ctx) return;
  if (ctx->autocast_depth > 0)
    ctx->autocast_depth--;
  else
    kiln__error(ctx, KILN_ERR_STATE,
                "kiln_autocast_end: no autocast region is open (more kiln_autocast_end calls "
                "than kiln_autocast_begin)");
}

kiln_dtype kiln__autocast_dtype(const kiln_ctx *ctx) {
  return ctx->autocast_depth > 0 ? ctx->autocast[ctx->autocast_depth - 1] : KILN_DTYPE_F32;
}
