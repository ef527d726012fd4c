/*
 * kiln.h: the one public header of kiln, a CUDA-only training framework in C.
 *
 * Every tensor operation records a node into the context's trace; nothing runs until the trace is
 * flushed (a host read, kiln_sync, kiln_step_end). The trace doubles as the autograd tape.
 * Errors are sticky: a failing call returns NULL or a status and sets a message on the context
 * that names the function and the values; later ops on a failed context record nothing.
 * Every kiln_*_free function takes NULL and then does nothing, as free() does.
 */
#ifndef KILN_H
#define KILN_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define KILN_VERSION_MAJOR 0
#define KILN_VERSION_MINOR 1
#define KILN_VERSION_PATCH 0

#define KILN_MAX_DIMS 6

typedef enum kiln_status {
  KILN_OK = 0,
  KILN_ERR_INVALID,   /* a bad argument: NULL, out of range, wrong option */
  KILN_ERR_SHAPE,     /* shapes that do not fit the operation */
  KILN_ERR_DTYPE,     /* a dtype the operation does not take */
  KILN_ERR_OOM,       /* out of device or host memory */
  KILN_ERR_CUDA,      /* a CUDA, cuBLAS or NVRTC call failed */
  KILN_ERR_IO,        /* a file could not be opened, read or written */
  KILN_ERR_FORMAT,    /* a file's contents are not what they must be */
  KILN_ERR_STATE,     /* wrong order of calls, stale handle, no GPU */
  KILN_ERR_NONFINITE, /* anomaly mode: a node of the step wrote NaN or Inf (kiln_set_anomaly) */
} kiln_status;

/* Element types. Ops compute f32 and bf16 values in f32 (bf16 is rounded to nearest even where it
 * is stored); i32 holds labels and indices; f16 is not supported yet. Elementwise ops give bf16
 * when every float input is bf16 and f32 otherwise (PyTorch's promotion); reductions of bf16
 * accumulate in f32 and round the result; products and convolutions take one dtype (bf16:
 * tensor cores, f32 accumulation), unless an autocast region casts them (kiln_autocast_begin).
 * softmax, log_softmax, layer_norm, var/std and the losses compute in f32 whatever their input
 * and give f32. On the host a bf16 element is a uint16_t (kiln_bf16_from_f32). */
typedef enum kiln_dtype {
  KILN_DTYPE_F32 = 0,
  KILN_DTYPE_BF16,
  KILN_DTYPE_F16,
  KILN_DTYPE_I32,
} kiln_dtype;

typedef struct kiln_ctx kiln_ctx;
typedef struct kiln_tensor kiln_tensor;

/* A shape by value: KILN_SHAPE(128, 784). */
typedef struct kiln_shape {
  int ndim;
  int64_t d[KILN_MAX_DIMS];
} kiln_shape;

/* A set of axes by value: KILN_AXES(0, 2). KILN_ALL_AXES means every axis. */
typedef struct kiln_axes {
  int n;
  int a[KILN_MAX_DIMS];
} kiln_axes;

/* KILN_SHAPE() is a scalar's shape (no dims) and KILN_AXES() every axis, like KILN_SCALAR_SHAPE
 * and KILN_ALL_AXES: an empty list is told apart by its spelling ("" has size 1). (Their empty
 * braces are C23 and GNU C; in strict C11 write KILN_SCALAR_SHAPE and KILN_ALL_AXES.) */
#define KILN__NARG(...) KILN__NARG_(__VA_ARGS__, 6, 5, 4, 3, 2, 1, 0)
#define KILN__NARG_(_1, _2, _3, _4, _5, _6, N, ...) N
#define KILN__COUNT(...) (sizeof(#__VA_ARGS__) == 1 ? 0 : KILN__NARG(__VA_ARGS__))
#define KILN_SHAPE(...) ((kiln_shape){.ndim = KILN__COUNT(__VA_ARGS__), .d = {__VA_ARGS__}})
#define KILN_SCALAR_SHAPE ((kiln_shape){.ndim = 0})
#define KILN_AXES(...) ((kiln_axes){.n = KILN__COUNT(__VA_ARGS__), .a = {__VA_ARGS__}})
#define KILN_ALL_AXES ((kiln_axes){.n = 0})

/*
 * Options and defaults: the one rule, for every options struct in kiln's headers and for the
 * float arguments that have a PyTorch default (kiln_batch_norm's momentum and eps,
 * kiln_layer_norm's eps). A zero field means PyTorch's default, so (kiln_adam_options){.lr =
 * 1e-3f} is torch.optim.Adam(lr=1e-3) (betas 0.9 and 0.999, eps 1e-8), and a NULL options
 * pointer is every field zero (a NULL schedule detaches one instead: kiln_optim_set_schedule). A
 * field that has no default (a layer's sizes, a loader's batch, a cosine schedule's total_steps,
 * pooling's kernel size) and is left zero is an error naming it. A flag is 0 or 1, named so that 0
 * is PyTorch's choice (.no_bias = 1 is bias=False; layers and loaders refuse other values). Where
 * the default is not 0 and exactly 0 is wanted, write KILN_ZERO, a negative zero that kiln reads
 * as 0: AdamW with .weight_decay = KILN_ZERO decays nothing, where .weight_decay = 0 is torch's
 * 1e-2; batch norm's .momentum = KILN_ZERO never moves its running statistics, 0 is torch's 0.1.
 * A value known only at run time (a command-line flag: strtof("0") is +0, the default) goes
 * through kiln_exactly(v), which keeps a zero a zero. -ffast-math, -Ofast, -fno-signed-zeros and
 * -funsafe-math-optimizations let GCC drop a zero's sign, so that KILN_ZERO would silently mean
 * the default: kiln.h refuses them (__FAST_MATH__ or __NO_SIGNED_ZEROS__ defined) unless
 * KILN_ALLOW_FAST_MATH is defined (for code that never writes KILN_ZERO or kiln_exactly).
 */
#define KILN_ZERO (-0.0f)
#if (defined(__FAST_MATH__) || defined(__NO_SIGNED_ZEROS__)) && !defined(KILN_ALLOW_FAST_MATH)
#error "kiln.h: -ffast-math drops KILN_ZERO's sign (it would mean the default); see KILN_ZERO"
#endif
static inline float kiln_exactly(float v) { return v == 0.0f ? KILN_ZERO : v; }

/* ---------------------------------------------------------------- context */

typedef struct kiln_ctx_options {
  int device; /* CUDA device ordinal */
  /* 1: a context that records, plans and compiles but never executes (CI, tests, machines
   * without a GPU). kiln_step_end and kiln_sync plan every group and compile its kernel with
   * NVRTC, as with a GPU, and return KILN_OK; kiln_stats counts it (groups, kernels_compiled,
   * cache_hits; nothing launched or executed). Only reading values is an error there
   * (kiln_tensor_to_host, kiln_tensor_item: KILN_ERR_STATE); host copies in are accepted and
   * dropped. Where a GPU context flushes on its own, it does not: kiln_step_begin drops what was
   * recorded before the step unplanned, and a tensor freed under pending nodes that read it makes
   * the next flush an error (with a GPU those nodes would have run before the free). */
  int no_gpu;
} kiln_ctx_options;

/*
 * Creates a context. NULL options: device 0, a GPU context. Always returns a context unless host
 * memory runs out; when the device cannot be used, kiln_ctx_error() says why and
 * kiln_ctx_has_gpu() is 0: "kiln_ctx_new: no usable GPU: " and whether no NVIDIA driver is
 * installed, the driver is older than kiln's CUDA runtime (both versions) or sees no GPU, then
 * CUDA's own words and that no_gpu = 1 gives a context that records, plans and compiles.
 * Environment: KILN_TF32=0 turns TF32 matmuls off, KILN_SEED sets the RNG seed, KILN_CACHE_DIR
 * the kernel cache, KILN_DUMP_KERNELS=dir writes generated sources.
 */
kiln_ctx *kiln_ctx_new(const kiln_ctx_options *opts);
/* Frees the context and every tensor it still holds. Parameter lists, optimizers, data sets and
 * loaders made from it may be freed before or after it (after it, they free only their own
 * memory); a tensor may not be used or freed after it. Every kiln_*_free(NULL) does nothing. */
void kiln_ctx_free(kiln_ctx *ctx);
int kiln_ctx_has_gpu(const kiln_ctx *ctx);
/* The cudaStream_t all of the context's work runs on (for events and interop). */
void *kiln_ctx_stream(const kiln_ctx *ctx);

kiln_status kiln_ctx_status(const kiln_ctx *ctx);
const char *kiln_ctx_error(const kiln_ctx *ctx); /* NULL when no error is set */
void kiln_ctx_clear_error(kiln_ctx *ctx);
const char *kiln_status_name(kiln_status s);
const char *kiln_version(void);

void kiln_set_tf32(kiln_ctx *ctx, int on); /* default on, KILN_TF32=0 in the environment: off */
/* Fusion: on by default; KILN_FUSION=0 (or kiln_set_fusion(ctx, 0)) runs every node as its own
 * kernel, with the same results. Applies from the next flush. */
void kiln_set_fusion(kiln_ctx *ctx, int on);
/* Step graphs: on by default; KILN_GRAPH=0 (or kiln_set_graphs(ctx, 0)) runs every step by
 * flushing its trace. With graphs on, kiln_step_end hashes the step's trace (ops, shapes, dtypes,
 * integer attributes, which persistent tensors); the first occurrence of a signature is planned,
 * compiled, run and captured into a CUDA graph, later ones are compared and replayed. Float and
 * 64-bit attributes (learning rates, step counts, dropout offsets, batch offsets) are step values
 * written to the device before each replay, never baked into a graph. Reading a pending value
 * inside an open step is an error in graph mode (it would split the step): read after
 * kiln_step_end, which synchronises only when a value is read. Up to 16 graphs are kept (least
 * recently used out); kiln_set_graphs(ctx, 0) also frees them and their memory (at the next
 * kiln_step_begin). */
void kiln_set_graphs(kiln_ctx *ctx, int on);
/* Whether fusion and step graphs are on (1) or off (0); 0 for a NULL context. */
int kiln_fusion(const kiln_ctx *ctx);
int kiln_graphs(const kiln_ctx *ctx);
int kiln_tf32(const kiln_ctx *ctx);
/* Anomaly mode (torch.autograd.set_detect_anomaly), for finding where NaN or Inf first appears:
 * KILN_DEBUG=nan in the environment, or kiln_set_anomaly(ctx, 1) (from the next flush). Every
 * flush then runs unfused and eagerly, never as a step graph (a value kept in a fused kernel's
 * registers could not be seen), and after each node a small kernel scans what it wrote. The
 * first node of the step that wrote NaN or Inf is named in a KILN_ERR_NONFINITE error: its trace
 * index, op, shape and dtype, the function that recorded it (for a gradient, also the forward
 * node whose backward it is), its first such element, and what each input holds (the batch or a
 * parameter named when the value came from outside the step). The host waits for the device
 * before every in-place update (gradients, optimizer steps, running statistics) and at the end
 * of every flush, so no update after that node runs: parameters and optimizer state stay as they
 * were, and the step fails as any failed step does. An Inf that descends from a constant of the
 * step (kiln_full(-INFINITY) as a mask, through kiln_where and kiln_softmax) is no anomaly; one
 * in a persistent tensor (the batch, a weight, a mask kept across steps) or written into one is.
 * A max reduction's -inf start and pooling's padding never reach memory. Slow: for debugging. */
void kiln_set_anomaly(kiln_ctx *ctx, int on);
int kiln_anomaly(const kiln_ctx *ctx);
/* Seeds parameter init, shuffles drawn from the context, and dropout; dropout's Philox offset
 * restarts at 0, so the same seed gives the same masks. */
void kiln_manual_seed(kiln_ctx *ctx, uint64_t seed);

/* Runs everything recorded so far and waits for the device (without a GPU: plans and compiles
 * it, kiln_ctx_options). */
kiln_status kiln_sync(kiln_ctx *ctx);

/*
 * A training step. kiln_step_begin releases the intermediates of the previous step: their
 * handles become stale and using one, however many steps later, is an error (a handle's address
 * is never given to a later one; after some 500 million handles addresses come round again).
 * kiln_step_end runs the step's trace. A step that fails, in recording or in running, leaves no
 * host state behind: optimizer step counts and rates, gradients' presence, the RNG state and
 * loader positions are as the step found them (device work already run by an earlier flush of
 * the step, with graphs off, stays). Ending a step inside an open autocast region is such a failure
 * (KILN_ERR_STATE, naming how many are open): the region would carry into the next step. The
 * regions stay open; close them (kiln_autocast_end) and clear the error to go on.
 */
void kiln_step_begin(kiln_ctx *ctx);
kiln_status kiln_step_end(kiln_ctx *ctx);

typedef struct kiln_mem_stats {
  size_t in_use;   /* bytes handed out by the caching allocator */
  size_t peak;     /* the most in_use has been */
  size_t cached;   /* bytes held by the allocator but free */
  size_t reserved; /* in_use + cached: what cudaMalloc gave */
  uint64_t device_mallocs;
} kiln_mem_stats;
void kiln_memory_stats(const kiln_ctx *ctx, kiln_mem_stats *out);
void kiln_memory_reset_peak(kiln_ctx *ctx);
void kiln_memory_empty_cache(kiln_ctx *ctx);

/* What one flush did. A context without a GPU plans and compiles each flush and runs nothing:
 * its kernels and nodes_executed stay 0, and nodes counts the nodes planned. */
typedef struct kiln_flush_stats {
  uint64_t nodes;         /* trace nodes run */
  uint64_t groups;        /* launches planned: fused groups and library calls */
  uint64_t kernels;       /* kernels and library calls launched */
  uint64_t bytes_read;    /* by generated kernels, each input element counted once */
  uint64_t bytes_written; /* by generated kernels */
  uint64_t compiled;      /* NVRTC compilations */
  uint64_t cache_hits;    /* kernels found compiled, in memory or on disk */
  double compile_ms;
} kiln_flush_stats;

typedef struct kiln_exec_stats {
  uint64_t nodes_recorded; /* all nodes ever recorded */
  uint64_t nodes_executed;
  uint64_t flushes;
  uint64_t groups;           /* launches planned, all flushes */
  uint64_t kernels_launched; /* generated kernels and library calls (cuBLAS) */
  uint64_t kernels_compiled; /* NVRTC compilations */
  uint64_t cache_hits;       /* kernels found in the memory or disk cache */
  uint64_t disk_hits;
  uint64_t bytes_read, bytes_written; /* by generated kernels */
  double compile_ms;
  kiln_flush_stats last_flush;
  /* step graphs */
  uint64_t graph_captures;  /* steps captured into a CUDA graph (new signatures) */
  uint64_t graph_replays;   /* steps run by replaying their graph */
  uint64_t graph_evictions; /* graphs dropped from the bounded cache */
  uint64_t eager_steps;     /* steps in graph mode that ran without a graph */
  /* the last captured step's plan of intermediates (without a GPU, the last planned step's) */
  uint64_t arena_bytes;        /* its arena's size */
  uint64_t arena_sum_bytes;    /* the sum of that step's intermediates, had each its own memory */
  uint64_t arena_live_bytes;   /* the most of them live at one launch: no plan's arena is smaller */
  uint64_t graphs_arena_bytes; /* the arenas the cached step graphs share, all together */
} kiln_exec_stats;
void kiln_stats(const kiln_ctx *ctx, kiln_exec_stats *out);

/*
 * Timeline traces. kiln_trace_begin starts recording what the context's device runs, through
 * CUPTI's activity records: every kernel, copy and memset (and the CUDA runtime calls on the
 * host) until kiln_trace_end, which waits for the context's stream and writes them to path as
 * Chrome / Perfetto trace-event JSON (open it in ui.perfetto.dev or chrome://tracing): one
 * track per CUDA stream (pid the device, tid CUPTI's stream id), one span per step. Each of
 * kiln's launches is named as kiln names it (a cuBLAS kernel by its call, with the kernel's own
 * name beside it), kernels of replayed step graphs too, and carries the trace nodes it covers
 * (ops and shapes), kiln's estimate of the bytes it reads and writes, a product's FLOPs, the
 * achieved GB/s and TFLOP/s, its launch shape, and its step (the context's, from 0 at its first
 * kiln_step_begin) and mode (unfused, fused, graph). Records are kept for the last
 * $KILN_TRACE_STEPS steps (a count, 100 by default, or a range of steps such as 10-20).
 *
 * CUPTI is loaded when a trace begins, not linked: the file $KILN_CUPTI_LIBRARY names, else
 * libcupti.so.13, libcupti.so, then the toolkit's copy. Without it, or without a GPU,
 * kiln_trace_begin fails with an error that says what is missing (KILN_ERR_STATE, the context's
 * error: kiln_ctx_clear_error to go on untraced). One context of a process is traced at a time
 * (CUPTI's records are the whole process's). With no trace, kiln loads nothing and calls no
 * CUPTI function. KILN_TRACE=path.json in the environment traces every context from kiln_ctx_new
 * to kiln_ctx_free, which writes the file (failing to start is a warning on stderr there).
 */
kiln_status kiln_trace_begin(kiln_ctx *ctx, const char *path);
kiln_status kiln_trace_end(kiln_ctx *ctx);
/* An HTML report of n traces written by kiln_trace_end (the same work in different modes, say),
 * labelled labels[i] (NULL: the file names): for each, the step whose device span is the median
 * of its steps; their timelines one above the other on one time axis, their device time by kind
 * of kernel, and each step's kernels by time with their share of the step, memory traffic and
 * rates. One self-contained file (no script, nothing fetched). Needs no GPU; errors go to ctx. */
kiln_status kiln_trace_report(kiln_ctx *ctx, const char *html_path, const char *title, int n,
                              const char *const *trace_paths, const char *const *labels);

/* ---------------------------------------------------------------- tensors */

/* A persistent tensor (owned by the caller, freed with kiln_tensor_free), filled with zeros.
 * Every shape is checked: at most KILN_MAX_DIMS dims, no negative size, at most 2^58 elements. */
kiln_tensor *kiln_tensor_new(kiln_ctx *ctx, kiln_dtype dtype, kiln_shape shape);
kiln_tensor *kiln_tensor_from_host(kiln_ctx *ctx, kiln_dtype dtype, kiln_shape shape,
                                   const void *data);
/* Frees a persistent tensor and its gradient; intermediates are released by kiln_step_begin.
 * The handle stays readable memory until the context is freed: freeing it again, or passing it
 * to any call, is an error on its context (KILN_ERR_STATE, naming the call). */
void kiln_tensor_free(kiln_tensor *t);
/* (A tensor a parameter list owns is freed with the list; freeing it by hand is an error. Freeing
 * a tensor that the open step's recorded nodes read makes their backward pass an error.) */

/* Flushes, then copies the whole tensor (any view) to host memory, contiguous. With fusion on,
 * an intermediate that other ops consumed may have lived only in a fused kernel's registers:
 * reading it after the flush that ran it is an error (KILN_ERR_STATE) that says so; reading it
 * before (while it is pending) makes that flush write it. */
kiln_status kiln_tensor_to_host(kiln_tensor *t, void *dst, size_t bytes);
/* Copies host data into a persistent contiguous tensor, after what was recorded before. The copy
 * is queued on the context's stream through a pinned staging buffer and the call returns without
 * waiting for the device (src may be reused at once). In a graph-mode step, copy before recording
 * the step's ops (the next batch into an input tensor, say): the step then still runs whole as
 * its graph; a copy after recorded ops runs them first, and the step runs without its graph. A
 * copy into an image that a strided convolution over few channels read (a ResNet stem's input),
 * after that read and before kiln_backward, makes kiln_backward fail (KILN_ERR_STATE): its weight
 * gradient gathers the image's blocks from it again (KILN_CONV_RECOMPUTE_BLOCKS=0 keeps them). */
kiln_status kiln_tensor_copy_from_host(kiln_tensor *t, const void *src, size_t bytes);
/* The value of a one-element f32, bf16 or i32 tensor (an i32 converted to float: exact up to 2^24);
 * NAN (and an error on the context) on failure. */
float kiln_tensor_item(kiln_tensor *t);

kiln_ctx *kiln_tensor_ctx(const kiln_tensor *t);
kiln_dtype kiln_tensor_dtype(const kiln_tensor *t);
int kiln_tensor_ndim(const kiln_tensor *t);
int64_t kiln_tensor_dim(const kiln_tensor *t, int axis); /* negative axes count from the end */
kiln_shape kiln_tensor_shape(const kiln_tensor *t);
int64_t kiln_tensor_stride(const kiln_tensor *t, int axis); /* in elements */
int64_t kiln_tensor_numel(const kiln_tensor *t);
int kiln_tensor_is_contiguous(const kiln_tensor *t);
int kiln_tensor_is_persistent(const kiln_tensor *t);
const char *kiln_tensor_name(const kiln_tensor *t);
void kiln_tensor_set_name(kiln_tensor *t, const char *name);

void kiln_tensor_set_requires_grad(kiln_tensor *t, int on); /* persistent f32 tensors only */
int kiln_tensor_requires_grad(const kiln_tensor *t);
/* The accumulated gradient of a persistent tensor, or NULL while there is none. */
kiln_tensor *kiln_tensor_grad(const kiln_tensor *t);
/* Drops the gradient (the next backward writes it afresh), as PyTorch's set_to_none. */
void kiln_tensor_zero_grad(kiln_tensor *t);

/* Formats a shape as "[128,784]" into buf; returns buf. */
char *kiln_shape_str(kiln_shape s, char *buf, size_t n);
size_t kiln_dtype_size(kiln_dtype dt);
const char *kiln_dtype_name(kiln_dtype dt);
/* bf16 on the host: an f32 rounded to nearest (ties to even; NaN stays NaN), and back (exact). */
uint16_t kiln_bf16_from_f32(float f);
float kiln_bf16_to_f32(uint16_t h);

/* ---------------------------------------------------------------- ops */

/* Elementwise, with NumPy broadcasting. */
kiln_tensor *kiln_add(kiln_tensor *a, kiln_tensor *b);
kiln_tensor *kiln_sub(kiln_tensor *a, kiln_tensor *b);
kiln_tensor *kiln_mul(kiln_tensor *a, kiln_tensor *b);
kiln_tensor *kiln_div(kiln_tensor *a, kiln_tensor *b);
kiln_tensor *kiln_maximum(kiln_tensor *a, kiln_tensor *b);
kiln_tensor *kiln_minimum(kiln_tensor *a, kiln_tensor *b);
/* Comparisons give 1.0f or 0.0f (f32) and carry no gradient. They also take i32 operands: two
 * i32 values compare exactly, an i32 against an f32 as floats. So the number of correct
 * predictions is kiln_sum(kiln_eq(kiln_argmax(logits, 1, 0), labels), KILN_ALL_AXES, 0). */
kiln_tensor *kiln_eq(kiln_tensor *a, kiln_tensor *b);
kiln_tensor *kiln_ne(kiln_tensor *a, kiln_tensor *b);
kiln_tensor *kiln_lt(kiln_tensor *a, kiln_tensor *b);
kiln_tensor *kiln_le(kiln_tensor *a, kiln_tensor *b);
kiln_tensor *kiln_gt(kiln_tensor *a, kiln_tensor *b);
kiln_tensor *kiln_ge(kiln_tensor *a, kiln_tensor *b);
/* cond != 0 ? a : b, broadcasting all three. */
kiln_tensor *kiln_where(kiln_tensor *cond, kiln_tensor *a, kiln_tensor *b);

kiln_tensor *kiln_neg(kiln_tensor *a);
kiln_tensor *kiln_exp(kiln_tensor *a);
kiln_tensor *kiln_log(kiln_tensor *a);
kiln_tensor *kiln_sqrt(kiln_tensor *a);
kiln_tensor *kiln_rsqrt(kiln_tensor *a);
kiln_tensor *kiln_tanh(kiln_tensor *a);
kiln_tensor *kiln_sigmoid(kiln_tensor *a);
kiln_tensor *kiln_relu(kiln_tensor *a);
typedef enum kiln_gelu_approx { KILN_GELU_ERF = 0, KILN_GELU_TANH } kiln_gelu_approx;
kiln_tensor *kiln_gelu(kiln_tensor *a, kiln_gelu_approx approx);
kiln_tensor *kiln_add_scalar(kiln_tensor *a, float s);
kiln_tensor *kiln_mul_scalar(kiln_tensor *a, float s);
kiln_tensor *kiln_pow_scalar(kiln_tensor *a, float exponent);
kiln_tensor *kiln_clamp(kiln_tensor *a, float lo, float hi);
/* |a|; its gradient is sign(a), 0 at 0 (as PyTorch). */
kiln_tensor *kiln_abs(kiln_tensor *a);
/* a where a > 0, else a * negative_slope (PyTorch's default is 0.01; a plain argument, so 0 gives
 * ReLU); the gradient at 0 is negative_slope. */
kiln_tensor *kiln_leaky_relu(kiln_tensor *a, float negative_slope);
/* a * sigmoid(a) (SiLU, swish). */
kiln_tensor *kiln_silu(kiln_tensor *a);
/* PyTorch's softplus: log(1 + exp(beta a)) / beta, and a itself where beta a > threshold.
 * Zero means PyTorch's default: beta 0 is 1, threshold 0 is 20. */
kiln_tensor *kiln_softplus(kiln_tensor *a, float beta, float threshold);
/* The error function. */
kiln_tensor *kiln_erf(kiln_tensor *a);
/* An intermediate filled with value. */
kiln_tensor *kiln_full(kiln_ctx *ctx, kiln_shape shape, float value);
/* Intermediates of random numbers from the context's counter-based Philox stream (the context's
 * seed, kiln_manual_seed; each call draws a fresh offset, as kiln_dropout does, so a replayed step
 * gets new numbers without re-capture): uniform in [0, 1), and standard normal (Box-Muller).
 * To fill a parameter, see the initialisers (kiln_init_*). */
kiln_tensor *kiln_rand(kiln_ctx *ctx, kiln_shape shape);
kiln_tensor *kiln_randn(kiln_ctx *ctx, kiln_shape shape);
/* Converts between f32, bf16 (rounding to nearest even) and i32 (truncating towards zero); the
 * same dtype gives a back (PyTorch's .to). The gradient of a float cast is cast back; none flows
 * through i32. In a fused step a cast costs no kernel of its own: it joins its producer or its
 * consumers. */
kiln_tensor *kiln_cast(kiln_tensor *a, kiln_dtype dtype);

/* Reductions over a set of axes (KILN_ALL_AXES: all of them). kiln_sum also sums i32 values,
 * exactly (in 64 bits), to an i32; a total outside the i32 range is an error found on the device,
 * reported as a bad label is (kiln_cross_entropy). mean and max take f32 and bf16. */
kiln_tensor *kiln_sum(kiln_tensor *a, kiln_axes axes, int keepdim);
kiln_tensor *kiln_mean(kiln_tensor *a, kiln_axes axes, int keepdim);
kiln_tensor *kiln_max(kiln_tensor *a, kiln_axes axes, int keepdim);
/* Variance and standard deviation over axes, as torch.var / torch.std: the sum of squared
 * deviations from the mean divided by count - correction (1: unbiased, Bessel's correction; 0:
 * the population's). Where count - correction <= 0 it divides by zero as PyTorch does (inf, or
 * NaN where the values are all equal); that is not an error. */
kiln_tensor *kiln_var(kiln_tensor *a, kiln_axes axes, int correction, int keepdim);
kiln_tensor *kiln_std(kiln_tensor *a, kiln_axes axes, int correction, int keepdim);
/* Index of the largest value along one axis, as i32 (the first on ties); no gradient. */
kiln_tensor *kiln_argmax(kiln_tensor *a, int axis, int keepdim);
kiln_tensor *kiln_softmax(kiln_tensor *a, int axis);
kiln_tensor *kiln_log_softmax(kiln_tensor *a, int axis);

typedef enum kiln_reduction {
  KILN_REDUCTION_MEAN = 0,
  KILN_REDUCTION_SUM,
  KILN_REDUCTION_NONE,
} kiln_reduction;
/* logits (N, C) f32 or bf16 (the bf16 logits of an autocast region, say), labels (N) i32 in
 * [0, C). It computes in f32 whatever the logits' dtype (bf16 logits are widened inside its
 * kernel, not rounded again) and gives an f32 loss: (N) with KILN_REDUCTION_NONE, else one
 * element; the logits' gradient has their dtype. label_smoothing in [0, 1] mixes the one-hot
 * target with the uniform one, as torch's. A label outside [0, C) is found on the device (no
 * launch waits for the host): the next read of a value, or kiln_sync, returns the error naming
 * it. */
kiln_tensor *kiln_cross_entropy(kiln_tensor *logits, kiln_tensor *labels, kiln_reduction red,
                                float label_smoothing);
/* Cross-entropy against class probabilities (PyTorch's cross_entropy with a floating target):
 * logits and target both (N, C), f32 or bf16 (computed in f32, as above), loss_n = -sum_c t_nc
 * log_softmax(logits)_nc with t = target (1 - label_smoothing) + label_smoothing / C; the mean
 * divides by N. Rows of target are not checked to sum to 1. The target gets a gradient when it
 * requires one. */
kiln_tensor *kiln_cross_entropy_soft(kiln_tensor *logits, kiln_tensor *target, kiln_reduction red,
                                     float label_smoothing);
/* Mean squared error (input - target)^2 (torch's mse_loss); input and target have one shape (no
 * broadcasting, where PyTorch only warns), f32 or bf16, computed in f32. */
kiln_tensor *kiln_mse_loss(kiln_tensor *input, kiln_tensor *target, kiln_reduction red);
/* Binary cross-entropy on logits (torch's binary_cross_entropy_with_logits, without weight or
 * pos_weight): max(x, 0) - x t + log(1 + exp(-|x|)), stable for any x; target in [0, 1] (not
 * checked), of the logits' shape, f32 or bf16, computed in f32. */
kiln_tensor *kiln_bce_with_logits(kiln_tensor *logits, kiln_tensor *target, kiln_reduction red);

/*
 * Matrix product: (M,K) x (K,N), (B,M,K) x (B,K,N), (B,M,K) x (K,N), (M,K) x (B,K,N); a batch
 * of 1 broadcasts.
 * Transposed views are passed to cuBLAS as transposed operands, not copied.
 */
kiln_tensor *kiln_matmul(kiln_tensor *a, kiln_tensor *b);

/* Views and movement. reshape takes one -1; it is a view of a contiguous input and copies a
 * non-contiguous one first. */
kiln_tensor *kiln_reshape(kiln_tensor *a, kiln_shape shape);
kiln_tensor *kiln_permute(kiln_tensor *a, kiln_axes order);
kiln_tensor *kiln_transpose(kiln_tensor *a, int axis0, int axis1);
kiln_tensor *kiln_slice(kiln_tensor *a, int axis, int64_t start, int64_t end, int64_t step);
kiln_tensor *kiln_expand(kiln_tensor *a, kiln_shape shape);
kiln_tensor *kiln_contiguous(kiln_tensor *a);
kiln_tensor *kiln_concat(int n, kiln_tensor *const *ts, int axis);
/* Rows of a (axis 0) picked by idx (K) i32: (K, ...). An index outside the rows is found on the
 * device, as a bad label is (kiln_cross_entropy). The gradient adds each picked row's gradient
 * into a's row (atomic adds: see kiln_embedding for what that means where indices repeat). */
kiln_tensor *kiln_index_select(kiln_tensor *a, kiln_tensor *idx);
/* Inverted dropout with counter-based Philox: each call draws a fresh offset from the context.
 * training: 1 drops, 0 passes a through, KILN_TRAINING_MODE follows the context's training mode
 * (kiln_set_training, as torch.nn.Dropout follows model.train() / model.eval()). */
#define KILN_TRAINING_MODE (-1)
kiln_tensor *kiln_dropout(kiln_tensor *a, float p, int training);
/* The same values without a gradient path. */
kiln_tensor *kiln_detach(kiln_tensor *a);

/* ---------------------------------------------------------------- images
 *
 * Images are (N, H, W, C): channels last, the layout tensor cores want (PyTorch's memory format
 * channels_last). Convolution weights keep PyTorch's (Cout, Cin / groups, kh, kw) in memory and in
 * files. Options follow the header's rule (KILN_ZERO): a zero field means PyTorch's default. */

typedef struct kiln_conv2d_options {
  int stride_h, stride_w;     /* 0: 1 */
  int pad_h, pad_w;           /* zero padding on each side; 0: none */
  int dilation_h, dilation_w; /* 0: 1 */
  int groups;                 /* 0: 1; Cin and Cout must be multiples (Cin groups: depthwise) */
} kiln_conv2d_options;
/* x (N, H, W, Cin), weight (Cout, Cin / groups, kh, kw), bias (Cout) or NULL; gives
 * (N, OH, OW, Cout) with OH = (H + 2 pad_h - dilation_h (kh - 1) - 1) / stride_h + 1 (and OW
 * alike), as torch.nn.functional.conv2d. NULL options: stride 1, no padding, no dilation, one
 * group. Runs as a matrix product over the im2col of x (TF32 tensor cores unless
 * kiln_set_tf32(ctx, 0)). */
kiln_tensor *kiln_conv2d(kiln_tensor *x, kiln_tensor *weight, kiln_tensor *bias,
                         const kiln_conv2d_options *o);

typedef struct kiln_pool2d_options {
  int kernel_h, kernel_w;     /* required, > 0 */
  int stride_h, stride_w;     /* 0: the kernel size (PyTorch's default) */
  int pad_h, pad_w;           /* at most half the kernel, as PyTorch; 0: none */
  int dilation_h, dilation_w; /* max pooling only; 0: 1 */
  int exclude_pad;            /* avg pooling: 1 divides by the window's elements inside the image
                               * (PyTorch's count_include_pad=False); 0 by the whole window */
} kiln_pool2d_options;
/* x (N, H, W, C) to (N, OH, OW, C), the output size as kiln_conv2d's (floor mode). Max pooling's
 * padding is -infinity and its gradient goes to the first maximum of each window (PyTorch's). */
kiln_tensor *kiln_max_pool2d(kiln_tensor *x, const kiln_pool2d_options *o);
kiln_tensor *kiln_avg_pool2d(kiln_tensor *x, const kiln_pool2d_options *o);
/* The mean or the maximum over H and W: (N, H, W, C) to (N, C). The maximum's gradient is split
 * evenly among tied maxima (as kiln_max and torch.amax). */
kiln_tensor *kiln_global_avg_pool2d(kiln_tensor *x);
kiln_tensor *kiln_global_max_pool2d(kiln_tensor *x);

/* Batch normalization over every axis but the last (the channels): x (N, H, W, C), or (N, C).
 * weight and bias (C) or NULL (no affine). running_mean and running_var (C) or NULL (no running
 * statistics: batch statistics always). training 1: normalises with the batch's mean and
 * biased variance and, when running statistics are given, updates them in place as PyTorch does
 * (running = (1 - momentum) running + momentum batch, the variance unbiased); training 0:
 * normalises with the running statistics; KILN_TRAINING_MODE: the context's mode (as
 * kiln_dropout); any other value is an error. By the header's rule, as the layer below and
 * F.batch_norm: momentum in [0, 1], 0 is 0.1 and KILN_ZERO no update; eps >= 0, 0 is 1e-5. */
kiln_tensor *kiln_batch_norm(kiln_tensor *x, kiln_tensor *weight, kiln_tensor *bias,
                             kiln_tensor *running_mean, kiln_tensor *running_var, int training,
                             float momentum, float eps);
/* Layer normalization over the last axis: weight and bias (C) or NULL; eps >= 0, 0 is 1e-5. */
kiln_tensor *kiln_layer_norm(kiln_tensor *x, kiln_tensor *weight, kiln_tensor *bias, float eps);
/* (N, ...) to (N, rest). A 4-D image (N, H, W, C) is flattened in PyTorch's order, (C, H, W),
 * so that a linear layer after it takes a PyTorch model's weights unchanged (one copy); other
 * ranks are a view. */
kiln_tensor *kiln_flatten(kiln_tensor *x);

/* Data augmentation on the device, per image of a batch: a random translation and a left-right
 * flip, in one recorded op (one kernel), for training (and the flip alone for test-time
 * augmentation). */
typedef enum kiln_augment_flip {
  KILN_AUGMENT_FLIP_NONE = 0,  /* no flip */
  KILN_AUGMENT_FLIP_RANDOM,    /* each image with probability 1/2 */
  KILN_AUGMENT_FLIP_ALL,       /* every image: flip test-time augmentation (no randomness) */
  KILN_AUGMENT_FLIP_ALTERNATE, /* airbench's alternating flip: see kiln_augment */
} kiln_augment_flip;
typedef enum kiln_augment_border {
  KILN_AUGMENT_BORDER_ZERO = 0, /* pixels from outside the image are 0 */
  KILN_AUGMENT_BORDER_REFLECT,  /* reflected at the border, the edge not repeated (PyTorch's
                                 * F.pad mode "reflect": -1 reads 1, H reads H - 2) */
} kiln_augment_border;
typedef struct kiln_augment_options {
  int pad;                    /* translation: dy and dx uniform in [-pad, pad]; 0: none */
  kiln_augment_border border; /* what a translation brings in */
  kiln_augment_flip flip;
  /* KILN_AUGMENT_FLIP_ALTERNATE only (NULL otherwise): the images' data-set indices, (N) i32
   * (kiln_loader_indices), and the epoch, whose parity picks the set of images flipped */
  kiln_tensor *idx;
  int64_t epoch;
  /* with pad 0: a fixed translation (dy, dx) = (shift_h, shift_w) of every image (test-time
   * augmentation's translated views), each below the image's size in magnitude */
  int shift_h, shift_w;
} kiln_augment_options;
/* x (N, H, W, C) f32 to an augmented copy of the same shape, in one kernel. For each image n:
 * - flip (o->flip): the image is first flipped left-right (column w reads column W - 1 - w);
 * - translate (o->pad): output pixel (h, w) is the (flipped) image's pixel (h + dy, w + dx), the
 *   content moving by (-dy, -dx), with dy and dx integers uniform in [-pad, pad]; a pixel from
 *   outside the image is 0 (KILN_AUGMENT_BORDER_ZERO) or reflected at the border
 *   (KILN_AUGMENT_BORDER_REFLECT: airbench's reflection padding by pad, then a random crop of the
 *   original size).
 * The random numbers come from the context's counter-based Philox stream, as kiln_dropout's: each
 * call takes a fresh offset, so the same kiln_manual_seed reproduces the same batches, two calls
 * give different ones, and a replayed step graph draws new ones every step (seed, offset and
 * epoch are step values: nothing is re-captured). Image n's numbers are the block
 * Philox(seed, offset, counter n): dy from its word 0, dx from word 1 (each the high 32 bits of
 * word * (2 pad + 1), less pad), the random flip from the top bit of word 2.
 * KILN_AUGMENT_FLIP_ALTERNATE flips image n on even epochs when the top bit of
 * Philox(seed, 2^64 - 1, counter idx[n]) (word 0; idx[n] read as an unsigned 32-bit value) is
 * set, and on odd epochs when it is clear: every sample is flipped every other epoch, about half
 * them in each epoch. KILN_AUGMENT_FLIP_ALL with pad 0 is test-time augmentation's flip.
 * Checks: x 4-D f32 or bf16 (the output has its dtype) with H, W, C >= 1; 0 <= pad < H and
 * pad < W; a shift only with pad 0, |shift_h| < H, |shift_w| < W; known modes; idx (N) i32 given
 * with KILN_AUGMENT_FLIP_ALTERNATE and only then. NULL options: no augmentation (a copy).
 * The op carries no gradient (its input is data): an x that requires one is an error
 * (kiln_detach it). */
kiln_tensor *kiln_augment(kiln_tensor *x, const kiln_augment_options *o);

/* ---------------------------------------------------------------- autograd */

/* Records the backward pass of a one-element loss; gradients accumulate into .grad. Backward of
 * a loss that an earlier kiln_backward of the same step already went through (the same loss
 * twice, or a part of a loss already backpropagated as the whole) is an error (KILN_ERR_STATE):
 * its gradients would be added twice. PyTorch raises there too (without retain_graph). Backward
 * of different losses of one step accumulates, even where they share nodes (where PyTorch needs
 * retain_graph=True): two micro-batches, or two heads of one trunk. */
kiln_status kiln_backward(kiln_tensor *loss);
/* No-grad regions nest (torch.no_grad()); an end without its begin is an error (KILN_ERR_STATE). */
void kiln_no_grad_begin(kiln_ctx *ctx);
void kiln_no_grad_end(kiln_ctx *ctx);
int kiln_grad_enabled(const kiln_ctx *ctx);
/* dst = src in place, recorded like an op (so it fuses with src's producer and replays in a step
 * graph; no gradient flows through it): dst a persistent contiguous f32 tensor, src a float
 * tensor of its shape (bf16 is widened). An exponential moving average of a parameter p is
 * kiln_assign(ema, kiln_add(ema, kiln_mul_scalar(kiln_sub(p, ema), 1 - decay))), with decay a
 * step value. Errors name the function and the shapes, and record nothing. */
kiln_status kiln_assign(kiln_tensor *dst, kiln_tensor *src);
/* Mixed precision, as torch.autocast(dtype=torch.bfloat16): inside a region opened with
 * KILN_DTYPE_BF16, kiln_matmul, kiln_conv2d and the layers built on them (kiln_linear_forward,
 * kiln_conv2d_layer_forward) cast f32 operands (and biases) to bf16 and compute on bf16 tensor
 * cores with f32 accumulation, giving bf16; the ops that follow keep bf16 where their inputs are
 * (activations, pooling, batch norm, whose statistics stay f32); softmax, the losses and layer_norm
 * compute in f32. Parameters stay f32 (master weights): the casts' gradients bring their
 * gradients back to f32, so optimizers, their state and checkpoints never see bf16. A region
 * opened with KILN_DTYPE_F32 turns autocast off inside an outer one. Regions nest (at most 8);
 * an end without its begin is an error (KILN_ERR_STATE). The region is read when ops are
 * recorded: put the forward pass in it, and call kiln_backward and kiln_optim_step after it.
 * A region is closed inside the step that opened it: kiln_step_end inside one is an error. */
void kiln_autocast_begin(kiln_ctx *ctx, kiln_dtype dtype);
void kiln_autocast_end(kiln_ctx *ctx);

/*
 * Gradient check: fn maps inputs to an output; the check compares the analytic gradient of
 * sum(output * w), w fixed random, with central finite differences in each input element.
 * Inputs must be persistent f32 tensors with requires_grad set.
 */
typedef kiln_tensor *(*kiln_gradcheck_fn)(kiln_tensor *const *inputs, void *user);
typedef struct kiln_gradcheck_options {
  float eps;     /* finite-difference step, > 0; 0: 1e-2 */
  float atol;    /* >= 0; 0: 1e-2 (KILN_ZERO: none) */
  float rtol;    /* >= 0; 0: 1e-2 (KILN_ZERO: none) */
  uint64_t seed; /* for w */
} kiln_gradcheck_options;
/* Returns KILN_OK when every element agrees; otherwise writes the worst element to report. */
kiln_status kiln_gradcheck(kiln_ctx *ctx, kiln_gradcheck_fn fn, int n, kiln_tensor *const *inputs,
                           void *user, const kiln_gradcheck_options *opts, char *report,
                           size_t report_len);

/* ---------------------------------------------------------------- nn */

typedef struct kiln_params kiln_params;
kiln_params *kiln_params_new(kiln_ctx *ctx);
kiln_ctx *kiln_params_ctx(const kiln_params *p); /* the context the list belongs to */
/* Takes ownership of t (freed with the list); names must be unique. An f32 parameter is made to
 * require gradients, as torch.nn.Parameter. */
kiln_status kiln_params_add(kiln_params *p, const char *name, kiln_tensor *t);
/* The list's tensors, counted and indexed with its buffers (kiln_params_add_buffer: batch norm's
 * running statistics), as a state_dict holds them; kiln_params_is_buffer tells them apart, and
 * kiln_module_parameters counts a model's parameters alone, as torch's parameters() does. */
int kiln_params_count(const kiln_params *p);
kiln_tensor *kiln_params_get(const kiln_params *p, int i);
const char *kiln_params_name(const kiln_params *p, int i);
kiln_tensor *kiln_params_find(const kiln_params *p, const char *name);
int64_t kiln_params_numel(const kiln_params *p); /* elements of every tensor, buffers included */
void kiln_params_zero_grad(kiln_params *p);
void kiln_params_free(kiln_params *p);

/* Layers. Each is made from an options struct of named fields, checked (a negative size, a
 * required one left 0, a flag other than 0 or 1, NULL options: an error naming the function and
 * the value; the list is left as it was and the layer zeroed), and a container (modules, below)
 * takes the same struct for the same layer. Parameter names: a layer adds its tensors to the list
 * as "name.<member>", PyTorch's names, so that a state dict's keys match (kiln_params_load):
 *   kiln_linear_init(&l, p, &(kiln_linear_options){.name = "fc1", .in = 784, .out = 512})
 * adds "fc1.weight" (512, 784), that is (out, in) as torch.nn.Linear, then "fc1.bias" (512). A
 * NULL or empty name is "linear" ("conv", "bn", "ln", "embedding" for the layers below); a name
 * already in the list is an error. In a container .name is the child's key (NULL: its index).
 * Linear: y = x W^T + b, with PyTorch's default init: W, b ~ U(-1/sqrt(in), 1/sqrt(in)). */
typedef struct kiln_linear_options {
  const char *name;
  int64_t in, out; /* features, required */
  int no_bias;     /* 1: bias=False */
} kiln_linear_options;
typedef struct kiln_linear {
  kiln_tensor *weight; /* (out, in) */
  kiln_tensor *bias;   /* (out) or NULL */
  int64_t in_features, out_features;
} kiln_linear;
kiln_status kiln_linear_init(kiln_linear *l, kiln_params *params, const kiln_linear_options *o);
kiln_tensor *kiln_linear_forward(const kiln_linear *l, kiln_tensor *x);

/* A buffer: a persistent tensor the list owns, saves and loads like a parameter (checkpoints,
 * weights files) but that never requires a gradient and that optimizers never see (batch norm's
 * running statistics). */
kiln_status kiln_params_add_buffer(kiln_params *p, const char *name, kiln_tensor *t);
int kiln_params_is_buffer(const kiln_params *p, int i);

/* Training or evaluation mode of the context, as PyTorch's model.train() / model.eval(): the
 * layers below (batch norm) and kiln_dropout(..., KILN_TRAINING_MODE) follow it. On at first. */
void kiln_set_training(kiln_ctx *ctx, int on);
int kiln_training(const kiln_ctx *ctx);
/* Evaluation mode in one call, as PyTorch's model.eval() with torch.no_grad(): kiln_eval_begin
 * switches training off (kiln_set_training(ctx, 0)) and opens a no-grad region
 * (kiln_no_grad_begin); kiln_eval_end closes that region and gives back the training mode that
 * its kiln_eval_begin found (so training goes on after an evaluation inside a training run, and
 * a region inside another stays in evaluation mode). Regions nest (at most 64) and may span
 * steps: an evaluation loop is kiln_eval_begin, its steps, kiln_eval_end. An end without its
 * begin, or one whose no-grad region a stray kiln_no_grad_end closed, is an error
 * (KILN_ERR_STATE) that changes nothing. kiln_evaluate (kiln_evaluate.h) runs a whole loader
 * this way. */
void kiln_eval_begin(kiln_ctx *ctx);
void kiln_eval_end(kiln_ctx *ctx);

/* Convolution layer: weight "name.weight" (out, in / groups, kh, kw) and bias "name.bias" (out),
 * initialised as torch.nn.Conv2d: U(-1/sqrt(fan_in), 1/sqrt(fan_in)) for both, fan_in = in /
 * groups * kh * kw. A square field (kernel) and its per-axis ones (kernel_h, kernel_w) may both be
 * set only where they agree. */
typedef struct kiln_conv2d_layer_options {
  const char *name;
  int64_t in, out;                      /* channels, required */
  int kernel, kernel_h, kernel_w;       /* required */
  int stride, stride_h, stride_w;       /* 0: 1 */
  int padding, pad_h, pad_w;            /* zero padding on each side; 0: none */
  int dilation, dilation_h, dilation_w; /* 0: 1 */
  int groups;                           /* 0: 1; in and out must be multiples of it */
  int no_bias;                          /* 1: bias=False */
} kiln_conv2d_layer_options;
typedef struct kiln_conv2d_layer {
  kiln_tensor *weight, *bias; /* bias NULL when made without */
  int64_t in_channels, out_channels;
  int kernel_h, kernel_w;
  kiln_conv2d_options opt;
} kiln_conv2d_layer;
kiln_status kiln_conv2d_layer_init(kiln_conv2d_layer *l, kiln_params *params,
                                   const kiln_conv2d_layer_options *o);
kiln_tensor *kiln_conv2d_layer_forward(const kiln_conv2d_layer *l, kiln_tensor *x);

/* Batch norm layer (torch.nn.BatchNorm2d, or BatchNorm1d on (N, C)): parameters "name.weight"
 * (ones) and "name.bias" (zeros) unless no_affine, buffers "name.running_mean" (zeros) and
 * "name.running_var" (ones), PyTorch's names. A PyTorch file's "name.num_batches_tracked" is
 * accepted and ignored by kiln_params_load (kiln's momentum is fixed). Forward follows
 * kiln_training(ctx). The struct holds the momentum and eps in use. */
typedef struct kiln_batch_norm_layer_options {
  const char *name;
  int64_t features; /* channels, required */
  float momentum;   /* in [0, 1]; 0: 0.1 (KILN_ZERO: the running statistics stay) */
  float eps;        /* >= 0; 0: 1e-5 (KILN_ZERO: 0) */
  int no_affine;    /* 1: affine=False */
} kiln_batch_norm_layer_options;
typedef struct kiln_batch_norm_layer {
  kiln_tensor *weight, *bias, *running_mean, *running_var;
  int64_t channels;
  float momentum, eps;
} kiln_batch_norm_layer;
kiln_status kiln_batch_norm_layer_init(kiln_batch_norm_layer *l, kiln_params *params,
                                       const kiln_batch_norm_layer_options *o);
kiln_tensor *kiln_batch_norm_layer_forward(const kiln_batch_norm_layer *l, kiln_tensor *x);

/* Layer norm over the last axis (torch.nn.LayerNorm(features)): "name.weight" (ones),
 * "name.bias" (zeros). */
typedef struct kiln_layer_norm_layer_options {
  const char *name;
  int64_t features; /* the last axis's size, required */
  float eps;        /* >= 0; 0: 1e-5 (KILN_ZERO: 0) */
} kiln_layer_norm_layer_options;
typedef struct kiln_layer_norm_layer {
  kiln_tensor *weight, *bias;
  int64_t channels;
  float eps;
} kiln_layer_norm_layer;
kiln_status kiln_layer_norm_layer_init(kiln_layer_norm_layer *l, kiln_params *params,
                                       const kiln_layer_norm_layer_options *o);
kiln_tensor *kiln_layer_norm_layer_forward(const kiln_layer_norm_layer *l, kiln_tensor *x);

/* ---------------------------------------------------------------- modules
 *
 * A sequential container (torch.nn.Sequential) and the layers added to it, each made from an
 * options struct of named fields. Layers name their parameters as PyTorch's state_dict names the
 * same model: child k of the root is "k" ("0.weight", "3.running_mean"), a child may be given a
 * name instead (options .name, or kiln_seq_sequential's name: "features.3.bias"), so that
 * kiln_params_save and kiln_params_load exchange weights with a PyTorch model of the same
 * structure (convolution weights keep PyTorch's layout; kiln_flatten flattens images in
 * PyTorch's order). Parameters belong to the list given to kiln_sequential_new; the modules hold
 * their layers and children only, and kiln_module_free(root) frees the tree (not the
 * parameters). Batch norm and dropout follow kiln_set_training(ctx), which switches the whole
 * model (and every other) between training and evaluation, as model.train() / model.eval() do
 * for a whole PyTorch model. Each kiln_seq_* returns the new child, or NULL with the error set and
 * the container unchanged (bad options name the layer and the value). A layer's options are the
 * struct its init takes (layers, above), .name the child's key: nonempty, without '.'.
 */
typedef struct kiln_module kiln_module;
kiln_module *kiln_sequential_new(kiln_params *p); /* the root */
/* A container inside seq, called name (NULL: its index). */
kiln_module *kiln_seq_sequential(kiln_module *seq, const char *name);
kiln_module *kiln_seq_conv2d(kiln_module *seq, const kiln_conv2d_layer_options *o);
/* Printed as BatchNorm2d; over (N, C) PyTorch's layer is BatchNorm1d, whose state_dict is the
 * same. */
kiln_module *kiln_seq_batch_norm(kiln_module *seq, const kiln_batch_norm_layer_options *o);
kiln_module *kiln_seq_linear(kiln_module *seq, const kiln_linear_options *o);
kiln_module *kiln_seq_relu(kiln_module *seq);
kiln_module *kiln_seq_gelu(kiln_module *seq, kiln_gelu_approx approx);
kiln_module *kiln_seq_max_pool2d(kiln_module *seq, const kiln_pool2d_options *o);
kiln_module *kiln_seq_avg_pool2d(kiln_module *seq, const kiln_pool2d_options *o);
/* (N, H, W, C) to (N, C): PyTorch's AdaptiveAvgPool2d(1) and Flatten() in one layer, printed as
 * the first. Where the PyTorch model has both, add kiln_seq_flatten after it (on (N, C) a view),
 * so that the layers after them keep the same indices, and so the same state_dict names. */
kiln_module *kiln_seq_global_avg_pool2d(kiln_module *seq);
kiln_module *kiln_seq_dropout(kiln_module *seq, float p); /* p in [0, 1) */
kiln_module *kiln_seq_flatten(kiln_module *seq);          /* kiln_flatten */
/* A layer of your own: fn(state, x) gives its output (built from kiln's ops, so that it is
 * recorded, fused and differentiated as they are); label is its printed name. Its parameters
 * are yours: make them in the list given to kiln_sequential_new under names you choose, and
 * an optimizer over that list trains them; kiln_module_parameters and kiln_module_describe count
 * and list kiln's layers only. */
typedef kiln_tensor *(*kiln_module_fn)(void *state, kiln_tensor *x);
kiln_module *kiln_seq_custom(kiln_module *seq, const char *label, kiln_module_fn fn, void *state);
/* Runs m on x: a container runs its children in order. */
kiln_tensor *kiln_module_forward(const kiln_module *m, kiln_tensor *x);
/* kiln_module_forward for a callback that takes the model as a void pointer (kiln_forward_fn):
 * kiln_evaluate(ctx, loader, kiln_module_call, net, NULL, &result) evaluates a module. */
kiln_tensor *kiln_module_call(void *module, kiln_tensor *x);
/* m's parameters' elements, as sum(p.numel() for p in model.parameters()): without batch
 * norm's running statistics (kiln_params_numel counts those too). */
int64_t kiln_module_parameters(const kiln_module *m);
/* The model as print(model) shows it in PyTorch, then a line a parameter (its name as in the
 * state_dict, shape and elements: "  0.weight [32,1,3,3] 288") and the parameter count, in a
 * malloc'd string (the caller frees it). */
char *kiln_module_describe(const kiln_module *m);
void kiln_module_free(kiln_module *m);

/* Initialisers, as torch.nn.init: each fills an existing persistent contiguous f32 tensor in
 * place (a parameter, say, to replace a layer's default init) with values drawn on the host from
 * the context's RNG (kiln_manual_seed: the same seed gives the same values), uploaded with
 * kiln_tensor_copy_from_host. A bad argument (a NULL, intermediate, view or non-f32 tensor, a
 * non-finite value, lo > hi, std < 0, fewer than 2 dims where fans are needed) is an error
 * naming the function and the value, and changes nothing, the RNG included. A tensor with no
 * elements is left alone. Fans are torch's: fan_in = size(1) * receptive field, fan_out =
 * size(0) * receptive field, the receptive field being the product of dims 2 on, so a linear
 * weight (out, in) has fan_in = in and a convolution weight (Cout, Cin / groups, kh, kw) has
 * fan_in = Cin / groups * kh * kw. */
typedef enum kiln_fan_mode { KILN_FAN_IN = 0, KILN_FAN_OUT } kiln_fan_mode;
/* torch.nn.init.calculate_gain's nonlinearities; LINEAR is also torch's conv and conv_transpose
 * (gain 1). LEAKY_RELU is 0, being kaiming_*_'s default. */
typedef enum kiln_nonlinearity {
  KILN_NONLINEARITY_LEAKY_RELU = 0, /* sqrt(2 / (1 + slope^2)) */
  KILN_NONLINEARITY_LINEAR,         /* 1 */
  KILN_NONLINEARITY_SIGMOID,        /* 1 */
  KILN_NONLINEARITY_TANH,           /* 5/3 */
  KILN_NONLINEARITY_RELU,           /* sqrt(2) */
  KILN_NONLINEARITY_SELU,           /* 3/4 */
} kiln_nonlinearity;
/* torch.nn.init.calculate_gain(nonlinearity, param): param is LEAKY_RELU's negative slope, 0
 * meaning torch's default 0.01 (KILN_ZERO: a slope of 0, which is ReLU's gain); the others
 * ignore it. NAN for a value outside the enum. */
float kiln_init_gain(kiln_nonlinearity nonlinearity, float param);
/* t's fans (either pointer may be NULL); t needs at least 2 dims. */
kiln_status kiln_init_fans(const kiln_tensor *t, int64_t *fan_in, int64_t *fan_out);
/* U(lo, hi), [lo, hi) as torch's uniform_ (plain values: lo = hi = 0 fills zeros). */
kiln_status kiln_init_uniform(kiln_tensor *t, float lo, float hi);
/* N(mean, std), by Box-Muller in double (plain values: std 0 fills mean). */
kiln_status kiln_init_normal(kiln_tensor *t, float mean, float std);
kiln_status kiln_init_constant(kiln_tensor *t, float value);
/* torch's kaiming_uniform_ and kaiming_normal_: std = gain / sqrt(fan), gain =
 * kiln_init_gain(nonlinearity, a), fan = fan_in or fan_out as mode says; uniform U(-b, b) with
 * b = sqrt(3) std, normal N(0, std). a is the negative slope of a leaky ReLU (0: 0, torch's
 * default here), so (t, 0, 0, 0) is torch's kaiming_uniform_(t) (gain sqrt(2), fan_in), and
 * nn.Linear's own init is (t, sqrt(5), KILN_FAN_IN, KILN_NONLINEARITY_LEAKY_RELU). */
kiln_status kiln_init_kaiming_uniform(kiln_tensor *t, float a, kiln_fan_mode mode,
                                      kiln_nonlinearity nonlinearity);
kiln_status kiln_init_kaiming_normal(kiln_tensor *t, float a, kiln_fan_mode mode,
                                     kiln_nonlinearity nonlinearity);
/* torch's xavier_uniform_ and xavier_normal_: std = gain sqrt(2 / (fan_in + fan_out)), uniform
 * U(-b, b) with b = sqrt(3) std, normal N(0, std). gain 0 means torch's 1 (KILN_ZERO: 0, which
 * fills zeros); it must be finite and >= 0. */
kiln_status kiln_init_xavier_uniform(kiln_tensor *t, float gain);
kiln_status kiln_init_xavier_normal(kiln_tensor *t, float gain);
/* kiln_init_whitening, which sets a convolution weight from images (airbench's whitening layer),
 * is declared under "data", after the host image types it takes. */

/* Gradient clipping by global norm, torch.nn.utils.clip_grad_norm_(parameters, max_norm) with
 * norm_type 2: total = sqrt(sum of g^2 over the gradients (kiln_tensor_grad) of the list's
 * parameters, buffers left out), and each such gradient is multiplied in place by
 * min(max_norm / (total + 1e-6), 1) (a factor of 1 leaves it bitwise as it was). Returns total,
 * a one-element intermediate of the step, read with kiln_tensor_item after kiln_step_end. It is
 * recorded like an op (call it between kiln_backward and kiln_optim_step): nothing is read on the
 * host, so a graph-mode step that clips replays as its graph however the norm changes, and
 * max_norm is a step value. Launches: one fused sum of squares per gradient, one or two small
 * kernels for the coefficient, and one multi-tensor kernel that scales every gradient. max_norm
 * must be finite and > 0 (else an error, NULL, and nothing recorded). No gradient at all: total is
 * 0 and nothing is scaled. Unlike torch, a non-finite total is not checked
 * (error_if_nonfinite=False, torch's default): it scales every gradient to NaN. */
kiln_tensor *kiln_clip_grad_norm(kiln_params *p, float max_norm);

/* Embedding (torch.nn.Embedding): "name.weight" (num_embeddings, dim) ~ N(0, 1), as torch's
 * init (drawn from the context's host RNG). Forward takes i32 indices of any shape and gives
 * their rows, shape (..., dim); an index outside [0, num_embeddings) is found on the device, as a
 * bad label is (kiln_cross_entropy). The weight's gradient adds each index's output gradient into
 * its row (kiln_index_select's gradient) with atomic adds: where an index repeats in a batch the
 * order of those additions, and the last bits of the sum, may differ from run to run (as
 * PyTorch's index_add_ on CUDA). torch's padding_idx, max_norm and sparse are not offered. */
typedef struct kiln_embedding_options {
  const char *name;
  int64_t num_embeddings, dim; /* required */
} kiln_embedding_options;
typedef struct kiln_embedding {
  kiln_tensor *weight; /* (num_embeddings, dim) */
  int64_t num_embeddings, dim;
} kiln_embedding;
kiln_status kiln_embedding_init(kiln_embedding *e, kiln_params *params,
                                const kiln_embedding_options *o);
kiln_tensor *kiln_embedding_forward(const kiln_embedding *e, kiln_tensor *idx);

/* ---------------------------------------------------------------- optim */

/* The optimizers of torch.optim, with its defaults for zero fields (the options rule above). */
typedef struct kiln_optim kiln_optim;
typedef struct kiln_sgd_options {
  float lr;           /* 0: 1e-3 */
  float momentum;     /* 0: none (no momentum buffers) */
  float dampening;    /* 0: none */
  float weight_decay; /* L2: weight_decay * p added to the gradient, as torch.optim.SGD; 0: none */
  int nesterov;       /* needs momentum > 0 and dampening 0 */
} kiln_sgd_options;
typedef struct kiln_adam_options {
  float lr;           /* 0: 1e-3 */
  float beta1, beta2; /* in [0, 1); 0: 0.9 and 0.999 (KILN_ZERO for a beta of 0) */
  float eps;          /* 0: 1e-8 */
  /* Adam: L2, weight_decay * p added to the gradient (torch.optim.Adam's weight_decay); 0: none.
   * AdamW: decoupled, p *= 1 - lr * weight_decay before the update (torch.optim.AdamW); 0: 1e-2,
   * torch's default, and KILN_ZERO for none (or kiln_adam_new: the same update, undecayed). */
  float weight_decay;
} kiln_adam_options;
/* Default options, every field spelt out: PyTorch's (Adam lr 1e-3, betas 0.9/0.999, eps 1e-8;
 * AdamW wd 1e-2). */
kiln_sgd_options kiln_sgd_defaults(float lr);
kiln_adam_options kiln_adam_defaults(void);
kiln_adam_options kiln_adamw_defaults(void);
kiln_optim *kiln_sgd_new(kiln_params *params, const kiln_sgd_options *o);
kiln_optim *kiln_adam_new(kiln_params *params, const kiln_adam_options *o);
kiln_optim *kiln_adamw_new(kiln_params *params, const kiln_adam_options *o);

/* Muon (torch.optim.Muon, after Keller Jordan's) for the matrices of a net: linear weights
 * (out, in) and convolution filters (Cout, Cin / groups, kh, kw), each read as the matrix
 * (rows, cols) = (its first dim, the product of the others). Per parameter p, gradient g:
 *   buf = momentum buf + g                       (the momentum buffer starts at zero)
 *   u   = g + momentum buf (Nesterov), or buf
 *   p   = p sqrt(rows) / ||p||_F                 (normalize_weight only, as airbench94_muon)
 *   X   = u / (||u||_F + eps), then ns_steps times (on X^T when rows > cols):
 *         A = X X^T, B = b A + c A A, X = a X + B X   ((a, b, c): ns_a, ns_b, ns_c)
 *   p   = p (1 - lr weight_decay) - lr scale X   (decoupled decay; scale: adjust_lr)
 * All of it is recorded: the iteration as matrix products (TF32 unless kiln_set_tf32(ctx, 0))
 * and elementwise ops, the writes of the buffers and of the parameters as in-place updates
 * (multi-tensor launches: one for the buffers, one per distinct rate, decay and scale for the
 * parameters), so a step replays as its graph and the rate (scheduled, a group's) and a
 * one-cycle schedule's momentum are step values. Against torch: its buffer is (1 -
 * momentum) times this one (a lerp; the same X), it divides by max(||u||_F, eps) and iterates in
 * bf16, and it takes 2-D parameters only.
 * Muon trains matrices only. A parameter of fewer than 2 dims (a bias, a norm's gain) is left to
 * another optimizer over the same list, and excluded here with a group
 * (kiln_optim_add_group(o, kiln_select_no_decay, NULL, &(kiln_param_group){.exclude = 1}));
 * kiln_optim_step while one is not excluded, or a group that takes one back, is an error naming
 * it. The other optimizer excludes the matrices; both may step in the same step (a parameter
 * that both train is updated twice). Checkpoints hold "momentum_buffer" per parameter, as SGD's.
 * A parameter whose norm is 0 gets NaN from normalize_weight (as airbench's). */
typedef enum kiln_muon_adjust_lr {
  KILN_MUON_ADJUST_ORIGINAL = 0,    /* sqrt(max(1, rows / cols)): torch's and Keller Jordan's */
  KILN_MUON_ADJUST_NONE,            /* 1: Muon's first form, as airbench94_muon has it */
  KILN_MUON_ADJUST_MATCH_RMS_ADAMW, /* 0.2 sqrt(max(rows, cols)): Moonshot's, for AdamW's rates */
} kiln_muon_adjust_lr;
typedef struct kiln_muon_options {
  float lr;               /* 0: 1e-3 */
  float momentum;         /* in [0, 1); 0: 0.95 (KILN_ZERO: none) */
  int no_nesterov;        /* 1: u = buf (torch's nesterov=False); 0: Nesterov's, torch's default */
  float weight_decay;     /* decoupled, as AdamW's; 0: 0.1, torch's (KILN_ZERO: none) */
  float eps;              /* 0: 1e-7 (KILN_ZERO: none) */
  int ns_steps;           /* Newton-Schulz iterations, 1 to 99; 0: 5 (airbench94_muon takes 3) */
  float ns_a, ns_b, ns_c; /* 0: 3.4445, -4.775, 2.0315 each (KILN_ZERO: 0) */
  /* The rate's scale by the matrix's shape; 0: ORIGINAL, torch's default. */
  kiln_muon_adjust_lr adjust_lr;
  /* 1: each step first scales p to Frobenius norm sqrt(rows), at any rate (a frozen group's 0
   * too); 0: not. */
  int normalize_weight;
  /* The dtype the iteration runs in: KILN_DTYPE_F32 (0), or KILN_DTYPE_BF16 (torch's and
   * airbench's: bf16 tensor-core products, f32 accumulation, each result rounded to bf16). */
  kiln_dtype ns_dtype;
} kiln_muon_options;
/* torch.optim.Muon's defaults, every field spelt out: lr 1e-3, momentum 0.95, Nesterov, weight
 * decay 0.1, eps 1e-7, 5 steps of (3.4445, -4.775, 2.0315), ORIGINAL, no normalize_weight, F32. */
kiln_muon_options kiln_muon_defaults(void);
/* A field out of range (lr or weight_decay negative or not finite, momentum outside [0, 1),
 * ns_steps outside 1..99, ...) is an error naming it and its value, and NULL. */
kiln_optim *kiln_muon_new(kiln_params *params, const kiln_muon_options *o);
/* Records one update of every parameter that has a gradient. */
kiln_status kiln_optim_step(kiln_optim *o);
void kiln_optim_zero_grad(kiln_optim *o);
void kiln_optim_set_lr(kiln_optim *o, float lr);
float kiln_optim_lr(const kiln_optim *o);
int64_t kiln_optim_steps(const kiln_optim *o);
void kiln_optim_free(kiln_optim *o);
/* Skipping steps whose gradients are not finite (torch.cuda.amp.GradScaler's found-inf, without
 * loss scaling), decided on the device, so that it works inside a replayed step graph with no
 * host sync: with on = 1 each kiln_optim_step first checks the gradients of the parameters it
 * updates, and when one holds NaN or Inf the step changes nothing (parameters, momentum buffers,
 * Adam's moments, each parameter's count of updates) and the device counts it. SGD's first step
 * and Adam's bias corrections then come from counts kept on the device (Adam's computed there in
 * f32, within rounding of the host's double-precision ones); checkpoints save those counts. The
 * schedule's step (kiln_optim_steps) counts calls, skipped ones too, as torch's schedulers do.
 * Each optimizer has its own flag. SGD, Adam, AdamW and Muon; set outside a step (a failed call
 * changes nothing); off again, the counts come back to the host. */
kiln_status kiln_optim_skip_nonfinite(kiln_optim *o, int on);
/* The steps skipped since the option was turned on (reads the device: waits for it, so call it
 * after kiln_step_end); 0 with the option off; -1 with the error set when it cannot be read. */
int64_t kiln_optim_skipped_steps(kiln_optim *o);

/* Parameter groups, as torch.optim's param_groups: some parameters get a rate and a weight decay
 * of their own (no weight decay on biases and norm gains, a smaller rate for a pretrained trunk),
 * or are left to another optimizer. kiln_optim_add_group calls select(name, tensor, user) for
 * every parameter of the optimizer's list (buffers are in no group) and puts those it returns
 * nonzero for in group g; a NULL g is every field zero (the optimizer's own settings). Groups
 * are numbered 1, 2, ... in the order they are made; a parameter no group selected is in the
 * optimizer's own. A parameter is in one group at most, as torch.optim has it: selecting one
 * that an earlier group trains is an error naming it and that group. Only a parameter that an
 * exclude group left out may be selected again (torch's add_param_group of a parameter the
 * optimizer does not hold): a later group takes it back, or excludes it once more. Returns how
 * many parameters it selected, or -1 with an error: a NULL select, a value out of range, a
 * parameter that an earlier group trains, a call inside an open step (groups are set up outside
 * steps), or a parameter list that changed; a failed call changes no group and no state.
 * Groups are configuration, not state: a checkpoint holds none of it. kiln_checkpoint_save
 * writes the state of the parameters this optimizer trains, so load a checkpoint into an
 * optimizer with the same exclusions (a state tensor for an excluded parameter, or none for one
 * that is trained, is an error naming it, and nothing is loaded). */
typedef struct kiln_param_group {
  /* The group's rate is lr_scale times the optimizer's current rate (kiln_optim_set_lr and
   * schedules move every group together). 0: 1; KILN_ZERO: 0 (frozen, state still updated). */
  float lr_scale;
  /* Replaces the optimizer's weight decay (the same kind: L2 for SGD and Adam, decoupled for
   * AdamW and Muon). 0: the optimizer's; KILN_ZERO: none. */
  float weight_decay;
  /* 1: this optimizer leaves these parameters alone (no update, and their state tensors are
   * freed: a group that takes them back later starts them afresh, as a new torch group). */
  int exclude;
} kiln_param_group;
typedef int (*kiln_param_select)(const char *name, const kiln_tensor *t, void *user);
int kiln_optim_add_group(kiln_optim *o, kiln_param_select select, void *user,
                         const kiln_param_group *g);
/* Ready selectors: tensors of fewer than 2 dims (biases, norm weights and biases), the usual
 * no-weight-decay group; names starting with the string user points to ("fc1.", "backbone."). */
int kiln_select_no_decay(const char *name, const kiln_tensor *t, void *user);
int kiln_select_prefix(const char *name, const kiln_tensor *t, void *user);

/* Learning-rate schedules, as functions of the optimizer's step count t (0 for the first step).
 * Attached to an optimizer, each kiln_optim_step first sets lr = kiln_schedule_lr(s, t); the
 * rate is a step value, so a schedule never re-captures a step graph.
 *   CONSTANT      base_lr
 *   STEP          base_lr * gamma^floor(t / step_size)                  (torch StepLR)
 *   COSINE        min_lr + (base_lr - min_lr) (1 + cos(pi t / total)) / 2  (CosineAnnealingLR)
 *   WARMUP_LINEAR base_lr t / warmup for t < warmup, then linearly to 0 at total
 *   ONE_CYCLE     torch's OneCycleLR with its defaults (two phases, cosine annealing), base_lr
 *                 being its max_lr: the rate rises from base_lr / div_factor to base_lr over the
 *                 first pct_start of total_steps, then falls to base_lr / div_factor /
 *                 final_div_factor at total_steps - 1, and stays there after (torch raises).
 *                 Like torch's cycle_momentum (on by default), it also moves SGD's or Muon's
 *                 momentum or Adam's beta1 the other way, from max_momentum down to
 *                 base_momentum and back;
 *                 no_cycle_momentum = 1 leaves them alone (cycle_momentum=False). torch's
 *                 three_phase and anneal_strategy='linear' are not offered.
 * Fields by the options rule: base_lr 0 is the optimizer's rate when the schedule is attached
 * (torch's schedulers start from it), except for ONE_CYCLE, whose base_lr (max_lr) must be set;
 * total_steps (COSINE, WARMUP_LINEAR, ONE_CYCLE) and step_size (STEP) have no default and must
 * be set; gamma 0 is 0.1, min_lr and warmup_steps 0 are none. */
typedef enum kiln_schedule_kind {
  KILN_SCHEDULE_CONSTANT = 0,
  KILN_SCHEDULE_STEP,
  KILN_SCHEDULE_COSINE,
  KILN_SCHEDULE_WARMUP_LINEAR,
  KILN_SCHEDULE_ONE_CYCLE,
} kiln_schedule_kind;
typedef struct kiln_schedule {
  kiln_schedule_kind kind;
  float base_lr;
  int64_t total_steps, warmup_steps, step_size;
  float gamma, min_lr;
  float pct_start, div_factor, final_div_factor; /* one-cycle; 0 means torch's 0.3, 25, 1e4 */
  float base_momentum, max_momentum;             /* one-cycle; 0 means torch's 0.85, 0.95 */
  int no_cycle_momentum; /* one-cycle: 1 leaves momentum and beta1 as the optimizer has them */
} kiln_schedule;
/* The rate at step t; a base_lr of 0 is 0 here (there is no optimizer to take it from). NAN for
 * a schedule that kiln_optim_set_schedule refuses. */
float kiln_schedule_lr(const kiln_schedule *s, int64_t t);
/* The momentum (SGD, Muon) or beta1 (Adam, AdamW) a one-cycle schedule gives step t; NAN for a
 * schedule that leaves them alone (other kinds, or no_cycle_momentum). */
float kiln_schedule_momentum(const kiln_schedule *s, int64_t t);
/* Attaches s (copied, its zero fields resolved); NULL detaches the schedule (the rate stays where
 * it is). A schedule with a field out of range or one that must be set and is not is an error
 * naming it, and the optimizer keeps its schedule; so is a one-cycle schedule that cycles the
 * momentum of an SGD optimizer made without momentum (it keeps no momentum buffers). */
void kiln_optim_set_schedule(kiln_optim *o, const kiln_schedule *s);

/* ---------------------------------------------------------------- checkpoints */

/* Parameters in the safetensors format, by name, stored as KILN_DTYPE_F32 or KILN_DTYPE_BF16.
 * Saving writes a temporary file and renames it over path: an interrupted save leaves the old
 * file whole. Loading accepts F32 or BF16 and checks every name, shape and dtype first: a
 * missing, extra, mis-shaped or corrupted tensor is an error naming it, and nothing is loaded.
 * A training checkpoint (kiln_checkpoint_save) loads too: its weights, its optimizer state and
 * RNG passed over (what evaluating a checkpoint needs, without an optimizer). */
kiln_status kiln_params_save(const kiln_params *p, const char *path, kiln_dtype dtype);
kiln_status kiln_params_load(kiln_params *p, const char *path);
/* kiln_params_load with options. non_strict 1 is torch's load_state_dict(strict=False): the
 * model's parameters that the file lacks keep their values and the file's tensors that the model
 * lacks are passed over, and the load sets missing and unexpected to how many there were (a
 * shape or dtype that differs is still an error, as in torch). */
typedef struct kiln_load_options {
  int non_strict;
  int missing, unexpected; /* set by the load */
} kiln_load_options;
kiln_status kiln_params_load_with(kiln_params *p, const char *path, kiln_load_options *o);

/* String key/value metadata carried by checkpoints (keys starting "kiln." are kiln's own). */
typedef struct kiln_meta kiln_meta;
kiln_meta *kiln_meta_new(void);
int kiln_meta_set(kiln_meta *m, const char *key, const char *value); /* 0, or -1 out of memory */
const char *kiln_meta_get(const kiln_meta *m, const char *key);      /* NULL when absent */
int kiln_meta_count(const kiln_meta *m);
const char *kiln_meta_key(const kiln_meta *m, int i);
void kiln_meta_free(kiln_meta *m);

/* A training checkpoint: parameters, the optimizer's state, step counts and learning rate, the
 * context's RNG state and the caller's metadata (user may be NULL), in one safetensors file.
 * Loading restores all of them (user, if given, receives the caller's metadata), so a resumed
 * run continues bitwise as the uninterrupted one; on any mismatch nothing changes. o must have
 * been made over p (kiln_sgd_new(p, ...)), else an error. o may be NULL on both sides: saving, a
 * checkpoint without optimizer state; loading, the parameters, the RNG and the metadata, the
 * file's optimizer state (every optimizer's) passed over. */
kiln_status kiln_checkpoint_save(const char *path, const kiln_params *p, const kiln_optim *o,
                                 const kiln_meta *user);
kiln_status kiln_checkpoint_load(const char *path, kiln_params *p, kiln_optim *o, kiln_meta *user);
/* The same for several optimizers over p, each updating its own parameters (exclude groups: Muon
 * for the filters beside SGD or AdamW for the rest): o[0] .. o[n-1], n from 0 to
 * KILN_CHECKPOINT_MAX_OPTIMS, distinct, each made over p, each one's state, rate and counts under
 * its place in the list (n 1 is the call above; a file it writes loads there too). Loading takes
 * as many optimizers as the file holds, of the same kinds in the same order (else an error
 * naming the difference, and nothing loaded); n 0 is o NULL above. Saving changes no optimizer. */
#define KILN_CHECKPOINT_MAX_OPTIMS 16
kiln_status kiln_checkpoint_save_optims(const char *path, const kiln_params *p,
                                        kiln_optim *const *o, int n, const kiln_meta *user);
kiln_status kiln_checkpoint_load_optims(const char *path, kiln_params *p, kiln_optim *const *o,
                                        int n, kiln_meta *user);

/* ---------------------------------------------------------------- data */

/* An MNIST-format split read into host memory (raw or gzip idx files). */
typedef struct kiln_mnist {
  int64_t n, rows, cols;
  uint8_t *images; /* (n, rows, cols) */
  uint8_t *labels; /* (n) */
} kiln_mnist;
/* split: "train" or "t10k"; tries NAME and NAME.gz in dir. Errors go on ctx (a no-GPU ctx works).
 */
kiln_status kiln_mnist_read(kiln_ctx *ctx, const char *dir, const char *split, kiln_mnist *out);
void kiln_mnist_free(kiln_mnist *m);

/* A data set on the device: images (n, ...) f32, labels (n) i32. */
typedef struct kiln_dataset kiln_dataset;
/* Uploads m once as images (n, rows, cols, 1) f32, image-shaped and channels last as a
 * convolution takes them (an MLP flattens a batch: kiln_flatten(x), a view, gives (B, rows *
 * cols)), each value (pixel / 255 - mean) / std, and labels (n) i32. mean and std both NAN
 * (math.h): the images' own mean and standard deviation (kiln_image_stats), which
 * kiln_dataset_normalization gives back for the test split; else mean finite and std finite and
 * > 0. */
kiln_dataset *kiln_dataset_from_mnist(kiln_ctx *ctx, const kiln_mnist *m, float mean, float std);

/* Host images: bytes, read as pixel / 255 (torchvision's ToTensor), or floats, read as they are. */
typedef enum kiln_host_type { KILN_HOST_F32 = 0, KILN_HOST_U8 } kiln_host_type;
/* Per-channel normalisation, (x - mean[c]) / std[c] (torchvision's Normalize), with c the index
 * along the images' last axis (channels last), or one mean and std for every value. */
typedef struct kiln_normalize {
  int channels;      /* entries of mean and std: the last axis's size, or 1; 0: no normalisation */
  const float *mean; /* (channels) */
  const float *std;  /* (channels), each > 0 */
  /* 1: mean and std are computed from the images themselves (kiln_image_stats: the population
   * statistics, per channel or of every value) and must be left NULL; a channel whose values are
   * all equal (std 0) is an error. kiln_dataset_normalization gives them back. */
  int from_data;
} kiln_normalize;
/* Labels on the host, (n) values: set i32 or u8 (the readers' type: kiln_mnist's and
 * kiln_cifar10's labels are uint8_t, passed as they are), not both. classes > 0: each label must
 * lie in [0, classes), else an error naming the first that does not; 0: each must be >= 0 (a
 * label of a class the logits do not have is then found by kiln_cross_entropy, on the device).
 * On the device they are (n) i32 either way. */
typedef struct kiln_host_labels {
  const int32_t *i32;
  const uint8_t *u8;
  int64_t classes;
} kiln_host_labels;
/* Your own data: images of any shape (n, ...), the first axis the sample ((n, 28, 28, 1), or
 * (n, H, W, C) for a convolutional net), C order, and their labels; norm NULL: no
 * normalisation. Uploaded once as f32 of the same shape, so the loader's batches are (B, ...).
 * Both arrays are copied: they may be freed on return. MNIST read by hand, normalised by its own
 * statistics:
 *   kiln_dataset_from_host(ctx, KILN_HOST_U8, KILN_SHAPE(m.n, m.rows, m.cols, 1), m.images,
 *                          (kiln_host_labels){.u8 = m.labels, .classes = 10},
 *                          &(kiln_normalize){.channels = 1, .from_data = 1});
 * An error names the argument and the value (a label out of range: its record), and makes
 * nothing. */
kiln_dataset *kiln_dataset_from_host(kiln_ctx *ctx, kiln_host_type type, kiln_shape shape,
                                     const void *images, kiln_host_labels labels,
                                     const kiln_normalize *norm);
/* The normalisation ds was made with: channels 0 for none, else its means and standard
 * deviations (given, or computed from the data), pointing into ds (valid until it is freed);
 * from_data 0. A test set is normalised with its training set's statistics:
 *   kiln_normalize n = kiln_dataset_normalization(train);
 *   kiln_dataset *test = kiln_mnist_load(ctx, dir, "t10k", n.mean[0], n.std[0]);
 * or &n as kiln_dataset_from_host's norm. */
kiln_normalize kiln_dataset_normalization(const kiln_dataset *ds);
/* The per-channel mean and standard deviation of host images (as kiln_dataset_from_host reads
 * them: bytes scaled to [0, 1]), for its normalisation: channels is the last axis's size, or 1
 * for every value together; mean and std receive channels values each. The standard deviation
 * is the population one (over the count; over millions of values the unbiased one agrees to
 * many digits). A float that is NAN or infinite is an error naming it. The training set's
 * statistics are the ones to normalise both the training and the test set with. */
kiln_status kiln_image_stats(kiln_ctx *ctx, kiln_host_type type, kiln_shape shape,
                             const void *images, int channels, float *mean, float *std);
/* An initialiser (as kiln_init_* above) for airbench's whitening layer: sets a convolution weight
 * (Cout, Cin, kh, kw) from images, not from the RNG (which it leaves alone). Every kh x kw patch
 * (stride 1, no padding) of the images (n, H, W, Cin), channels last, read as
 * kiln_dataset_from_host reads them (bytes / 255, then (x - mean[c]) / std[c] under norm; NULL:
 * no normalisation), is a vector p of Cin kh kw values in the order of a filter's (c, dh, dw).
 * Their uncentred covariance S = mean(p p^T) is decomposed in float64 (cyclic Jacobi) as
 * S = sum_i l_i v_i v_i^T with l_0 >= l_1 >= ..., and filter i < Cout / 2 is set to
 * v_i / sqrt(l_i + eps), filter Cout / 2 + i to its negative: over these images the first half's
 * outputs are uncorrelated, of mean square l_i / (l_i + eps) (about 1 where l_i >> eps).
 * Cout = 2 Cin kh kw uses every eigenvector (airbench's 3 -> 24, 2x2); a smaller even Cout keeps
 * the Cout / 2 of largest eigenvalue. An eigenvector's sign is fixed by making its largest
 * component positive (its negative is there too). eps 0 means airbench's 5e-4; else it must be
 * finite and > 0. The work, O(n H W (Cin kh kw)^2), is on the host; patches of more than 1024
 * values are refused. An error, as the other initialisers' (the tensor unchanged): a weight that
 * is not (Cout, Cin, kh, kw) with Cout even and at most 2 Cin kh kw, images that are not
 * (n >= 1, H >= kh, W >= kw, Cin), an unknown type, a normalisation of other than 0, 1 or Cin
 * channels or with a std not finite and > 0 (or from_data set: give the statistics), a float
 * image value that is NAN or infinite.
 * airbench keeps these filters frozen: kiln_tensor_set_requires_grad(weight, 0) after this. */
kiln_status kiln_init_whitening(kiln_tensor *weight, kiln_host_type type, kiln_shape shape,
                                const void *images, const kiln_normalize *norm, float eps);
/* kiln_init_whitening from images already on the device, as a data set holds them (normalised):
 * images (n, H, W, Cin) f32 or bf16, the first rows of kiln_dataset_images say (kiln_slice). The
 * patch covariance is computed there (im2col and a product per chunk of patches, in f32 without
 * TF32 or autocast, summed on the device), read back (Cin kh kw squared values), and decomposed
 * on the host in float64 as kiln_init_whitening does; the filters are the same up to f32
 * rounding. It runs what was recorded and waits for it: call it outside a step (or in one with
 * graphs off). The patches' columns, n (H - kh + 1) (W - kw + 1) Cin kh kw floats (230 MB for
 * 5000 CIFAR-10 images), stay allocated until the next step begins. The errors are
 * kiln_init_whitening's, and images of another shape or dtype. */
kiln_status kiln_init_whitening_tensor(kiln_tensor *weight, kiln_tensor *images, float eps);
/* kiln_mnist_read, then kiln_dataset_from_mnist: images (n, 28, 28, 1), normalised by mean and
 * std, or by the split's own statistics when both are NAN:
 *   kiln_dataset *train = kiln_mnist_load(ctx, dir, "train", NAN, NAN);  (0.1307 and 0.3081) */
kiln_dataset *kiln_mnist_load(kiln_ctx *ctx, const char *dir, const char *split, float mean,
                              float std);
int64_t kiln_dataset_size(const kiln_dataset *ds);
kiln_tensor *kiln_dataset_images(const kiln_dataset *ds);
kiln_tensor *kiln_dataset_labels(const kiln_dataset *ds);
void kiln_dataset_free(kiln_dataset *ds);
/* Keeps the data set's images as dtype, f32 or bf16, from now on (loaders' batches are of that
 * dtype): bf16 takes half the device memory, and a network whose first product casts its input
 * to bf16 anyway (in an autocast region) computes exactly what it did (the same rounding). The
 * conversion goes through host memory, and for a moment the device holds both copies; outside a
 * step. A failure changes nothing. */
kiln_status kiln_dataset_set_dtype(kiln_dataset *ds, kiln_dtype dtype);

/* Batches gathered on the device; shuffled per epoch from seed and the epoch when shuffle is
 * set. The last batch of an epoch is partial when batch does not divide the data set's size, and
 * dropped with drop_last, as PyTorch's DataLoader: a batch larger than the data set gives one
 * batch of the whole set (none with drop_last). Options checked as the layers' (NULL: an error). */
typedef struct kiln_loader_options {
  int64_t batch; /* required */
  int shuffle;   /* 1: a new order each epoch */
  int drop_last; /* 1: no partial last batch */
  uint64_t seed; /* the shuffle's */
  /* Several processes (kiln_dist.h): each takes rank's shard of every epoch's order, as PyTorch's
   * DistributedSampler (drop_last false) does: give every rank the same seed; each gets
   * ceil(n / world) samples, the order padded by repeating its first indices (world 0: one
   * process, every sample). rank in [0, world). */
  int rank, world;
} kiln_loader_options;
typedef struct kiln_loader kiln_loader;
/* A new loader has started epoch 0: kiln_loader_next gives its batches at once. */
kiln_loader *kiln_loader_new(kiln_dataset *ds, const kiln_loader_options *o);
/* Starts an epoch (reshuffles). */
void kiln_loader_start(kiln_loader *l, int epoch);
/* The next batch of the epoch as intermediates, or 0 at its end. */
int kiln_loader_next(kiln_loader *l, kiln_tensor **x, kiln_tensor **y);
/* The data-set indices of the batch the last kiln_loader_next gave, (B) i32 (its rows of the
 * epoch's order), for kiln_augment's alternating flip; NULL with an error before the epoch's
 * first batch. Recorded as a gather of the order, its start a step value (one step graph serves
 * every batch); each call records one. */
kiln_tensor *kiln_loader_indices(kiln_loader *l);
int64_t kiln_loader_batches(const kiln_loader *l);
void kiln_loader_free(kiln_loader *l);

/* CIFAR-10 read into host memory from the official binary batches: each record a label byte 0..9
 * and a 32x32 image stored channels first (1024 red, 1024 green, 1024 blue bytes, each plane
 * row-major), converted here to channels last. */
typedef struct kiln_cifar10 {
  int64_t n;
  uint8_t *images; /* (n, 32, 32, 3) channels last (HWC), converted from the files' (3, 32, 32) */
  uint8_t *labels; /* (n), each 0..9 */
} kiln_cifar10;
/* Reads a split of the CIFAR-10 binary batches in dir: "train" (data_batch_1 to data_batch_5,
 * all five required, concatenated in that order), "test" (test_batch), or one batch by its name
 * ("data_batch_1" ... "data_batch_5", "test_batch"; a sample holding only some batches reads
 * this way). For each batch NAME the first of NAME.bin, NAME.bin.gz and NAME.bin.xz that exists
 * in dir is read: raw, gzip or xz. Every file must hold a whole number of 3073-byte records, at
 * least one and at most four batches' worth (40000 records), and every label must be 0..9. On
 * success *out owns its arrays (free them with kiln_cifar10_free). On failure (NULL ctx, dir or
 * out, an unknown split, a missing, unreadable, truncated, corrupted or oversized file, a bad
 * label) the status is returned, the sticky error on ctx names the function, the file and the
 * record or the size ("kiln_cifar10_read: DIR/test_batch.bin: record 17: label 12 (expected
 * 0..9)"), *out is left untouched and nothing is kept. Runs on the host: a context made without a
 * GPU (kiln_ctx_options.no_gpu) reads too. */
kiln_status kiln_cifar10_read(kiln_ctx *ctx, const char *dir, const char *split, kiln_cifar10 *out);
/* Frees the arrays and zeroes *c; NULL, and a zeroed struct, are fine. */
void kiln_cifar10_free(kiln_cifar10 *c);
/* Uploads c once as a data set of images (n, 32, 32, 3) f32, channels last, each value
 * (pixel / 255 - mean[ch]) / std[ch] for its channel ch (0 red, 1 green, 2 blue), and labels (n)
 * i32. mean and std NULL: no normalisation (pixel / 255); one without the other is an error, as
 * is a std that is not finite and > 0, an empty c or a label outside 0..9. c may be freed on
 * return. The per-channel statistics of the training set, the usual normalisation, come from
 * kiln_image_stats(ctx, KILN_HOST_U8, KILN_SHAPE(c->n, 32, 32, 3), c->images, 3, mean, std). */
kiln_dataset *kiln_dataset_from_cifar10(kiln_ctx *ctx, const kiln_cifar10 *c, const float mean[3],
                                        const float std[3]);

/* Included at the end of this header: image folders and their loader (torchvision's
 * ImageFolder), kiln_imagefolder.h; a classifier's loss and accuracy over a loader
 * (kiln_evaluate), kiln_evaluate.h; kernels you write yourself, called as ops, kiln_custom.h;
 * several processes, one a GPU, started by torchrun or mpirun (kiln_dist_init), kiln_dist.h. */

#ifdef __cplusplus
}
#endif
#include "kiln_custom.h"
#include "kiln_dist.h"
#include "kiln_evaluate.h"
#include "kiln_imagefolder.h"
#endif
