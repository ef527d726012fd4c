/*
 * internal.h: the structures behind kiln's opaque handles, shared by core, autograd, fusion, nn,
 * optim and data. Nothing here is public; internal non-static symbols start with kiln__.
 */
#ifndef KILN_INTERNAL_H
#define KILN_INTERNAL_H

#include "kiln.h"

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime_api.h>
#include <nvrtc.h>
#include <stdbool.h>
#include <stdio.h>

/* ---------------------------------------------------------------- asserts and checks */

_Noreturn void kiln__assert_fail(const char *cond, const char *file, int line);
#define KILN_ASSERT(c) ((c) ? (void)0 : kiln__assert_fail(#c, __FILE__, __LINE__))

/* Sets the sticky error (the first one wins) and returns s. */
kiln_status kiln__error(kiln_ctx *ctx, kiln_status s, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* One family of checks for CUDA, cuBLAS and NVRTC results: on failure, a sticky error naming the
 * function, the call and the library's message; the macro evaluates to true on failure. */
bool kiln__cuda_failed(kiln_ctx *ctx, cudaError_t e, const char *fn, const char *call);
bool kiln__cublas_failed(kiln_ctx *ctx, cublasStatus_t e, const char *fn, const char *call);
bool kiln__nvrtc_failed(kiln_ctx *ctx, nvrtcResult e, const char *fn, const char *call);
#define KILN_CUDA_FAILED(ctx, call) kiln__cuda_failed((ctx), (call), __func__, #call)
#define KILN_CUBLAS_FAILED(ctx, call) kiln__cublas_failed((ctx), (call), __func__, #call)
#define KILN_NVRTC_FAILED(ctx, call) kiln__nvrtc_failed((ctx), (call), __func__, #call)

/* ---------------------------------------------------------------- op table */

typedef enum kiln__kind {
  KILN__KIND_EW,
  KILN__KIND_UPDATE,
  KILN__KIND_REDUCE,
  KILN__KIND_MATMUL,
  KILN__KIND_VIEW,
  KILN__KIND_LIB,
} kiln__kind;

typedef enum kiln__op {
#define X(id, name, nin, kind, expr, stores, grad, saves) KILN__OP_##id,
#include "ops.def"
#undef X
  KILN__OP_COUNT
} kiln__op;

#define KILN__MAX_IN 8
#define KILN__NF 8 /* float attributes of a node */
#define KILN__NI 8 /* int attributes (index 7: the axis of $c) */
#define KILN__NU 2 /* 64-bit attributes */

typedef struct kiln__node kiln__node;
typedef struct kiln__bw kiln__bw;
/* A backward rule: records the gradients of n's inputs from g, the gradient of its output. */
typedef void (*kiln__grad_fn)(kiln__bw *b, const kiln__node *n, kiln_tensor *g, kiln_tensor **gin);

typedef struct kiln__op_info {
  const char *name;
  int nin; /* the most inputs (concat takes 1..8) */
  kiln__kind kind;
  const char *expr;
  unsigned stores;    /* UPDATE: bit i set when input i is written back */
  kiln__grad_fn grad; /* kiln__grad_NONE: no gradient */
  unsigned saves;     /* what grad reads: bits 0-2 inputs, bit 3 the output */
} kiln__op_info;

#define X(id, name, nin, kind, expr, stores, grad, saves) \
  void kiln__grad_##grad(kiln__bw *b, const kiln__node *n, kiln_tensor *g, kiln_tensor **gin);
#include "ops.def"
#undef X

extern const kiln__op_info kiln__ops[KILN__OP_COUNT];
static inline bool kiln__has_grad(kiln__op op) { return kiln__ops[op].grad != kiln__grad_NONE; }

/* ---------------------------------------------------------------- allocator */

typedef struct kiln__block kiln__block;
typedef struct kiln__alloc {
  kiln__block *free_list; /* cached blocks, sorted by size */
  void *live;             /* blocks handed out, by pointer */
  size_t in_use, peak, cached;
  uint64_t device_mallocs;
} kiln__alloc;

/* Returns NULL (and sets no error) when the device is out of memory even after emptying the
 * cache. Sizes are rounded up to 512 bytes; blocks are reused best-fit. */
void *kiln__dev_alloc(kiln_ctx *ctx, size_t bytes);
void kiln__dev_free(kiln_ctx *ctx, void *p);
void kiln__alloc_release_all(kiln_ctx *ctx);

/* ---------------------------------------------------------------- tensors */

typedef struct kiln__storage {
  void *ptr; /* device memory, NULL until allocated */
  size_t bytes;
  bool persistent;            /* owned by a persistent tensor; else freed at step begin */
  bool fused;                 /* it lived in a fused kernel's registers and was never written */
  void *relu_mask;            /* a ReLU output's bit mask from cuBLASLt (1 where positive), or NULL */
  bool borrowed;              /* ptr and relu_mask point into a step graph's arena: not freed */
  bool clobbered;             /* in that arena a later value of the step reused its memory */
  struct kiln__storage *next; /* intermediates of a generation, for release */
} kiln__storage;

#define KILN__TENSOR_MAGIC 0x6b696c6e /* "kiln" */
#define KILN__TENSOR_DEAD 0x64656164  /* "dead" */

struct kiln_tensor {
  uint32_t magic;
  kiln_ctx *ctx;
  uint64_t gen; /* 0: persistent; else the step generation of an intermediate */
  kiln_dtype dtype;
  int ndim;
  int64_t shape[KILN_MAX_DIMS];
  int64_t stride[KILN_MAX_DIMS]; /* in elements */
  int64_t offset;                /* in elements, into the storage */
  kiln__storage *st;
  int32_t node; /* index of the producing node in the trace, -1 for none */
  bool persistent;
  bool requires_grad;
  bool grad_valid;     /* persistent: grad holds a gradient */
  bool keep;           /* the planner must write it to memory (a host read asked for it) */
  kiln_tensor *grad;   /* persistent: gradient buffer, allocated on first backward */
  kiln_tensor *bw_acc; /* during backward: the gradient gathered so far */
  char name[48];
};

/* ---------------------------------------------------------------- trace */

struct kiln__node {
  kiln__op op;
  int nin;
  kiln_tensor *in[KILN__MAX_IN];
  kiln_tensor *out; /* NULL for UPDATE nodes */
  float f[KILN__NF];
  int64_t i[KILN__NI];
  uint64_t u[KILN__NU];
};

typedef struct kiln__trace {
  kiln__node *nodes;
  int32_t n, cap;
  int32_t done; /* nodes [0, done) have run */
} kiln__trace;

/* Host handles of intermediates come from one of two arenas, alternating per step, so that a
 * handle from the previous step is still readable memory that says it is stale. */
typedef struct kiln__arena {
  char **chunks;
  int nchunks, cap, cur;
  size_t used; /* in chunk cur */
} kiln__arena;

/* ---------------------------------------------------------------- kernels */

typedef struct kiln__kernel {
  uint64_t key;
  char name[96];
  cudaLibrary_t lib;
  cudaKernel_t fn;
  struct kiln__kernel *next;
} kiln__kernel;

typedef struct kiln__lt_plan kiln__lt_plan;       /* fusion/exec.c */
typedef struct kiln__step_graph kiln__step_graph; /* fusion/graph.c */
#define KILN__MAX_GRAPHS 16                        /* step graphs kept, least recently used out */

/* ---------------------------------------------------------------- context */

struct kiln_ctx {
  int device;
  bool has_gpu;
  int arch; /* compute capability as 90, 80, ... */
  int num_sms;
  cudaStream_t stream;
  cublasHandle_t cublas;
  cublasLtHandle_t cublaslt;
  void *lt_workspace;
  size_t lt_workspace_bytes;

  kiln_status status;
  char error[1024];

  bool tf32;
  bool fusion; /* plan fused groups (KILN_FUSION=0: one node per kernel) */
  bool nvtx;   /* KILN_NVTX=1: an NVTX range around every launch */
  int no_grad_depth;
  uint64_t seed, philox_offset;
  uint64_t host_rng; /* init and shuffles: splitmix64 state */

  uint64_t gen; /* the current step generation, from 1 */
  kiln__arena arenas[2];
  kiln__storage *step_storages; /* intermediates' storages of this generation */
  kiln_tensor **persistents;    /* for ctx_free */
  int npersistent, cap_persistent;

  kiln__trace trace;
  kiln__alloc alloc;

  kiln__kernel *kernels[256]; /* loaded kernels, by key */
  kiln__lt_plan *lt_plans;    /* cuBLASLt products with epilogues, by shape */
  char *cache_dir;
  char *dump_dir;
  int nvrtc_version;
  uint64_t key_seed; /* hash of the prelude, arch and NVRTC version */
  kiln_exec_stats stats;
  void *step_values; /* eager flushes' step values on the device (kiln__stepvals) */
  int step_values_cap;
  bool graphs;  /* capture and replay steps (KILN_GRAPH=0: off) */
  bool in_step; /* between kiln_step_begin and kiln_step_end */
  kiln__step_graph *step_graphs[KILN__MAX_GRAPHS];
  int nstep_graphs;
  uint64_t graph_clock;   /* steps seen, for least-recently-used eviction */
  bool warned_signatures; /* the warning about ever-new signatures was printed */
  bool drop_graphs;       /* graphs were turned off: free the cached ones at the next step */
};

/* ---------------------------------------------------------------- internal API */

bool kiln__ok(kiln_ctx *ctx); /* no sticky error */
/* Validates a tensor handle for function fn: NULL, foreign, freed or stale handles set an error. */
bool kiln__check(kiln_ctx *ctx, const kiln_tensor *t, const char *fn);
/* The context of the first non-NULL tensor, or NULL. */
kiln_ctx *kiln__ctx_of(int n, kiln_tensor *const *ts);

/* A new intermediate with contiguous strides (storage allocated at flush). */
kiln_tensor *kiln__tensor_intermediate(kiln_ctx *ctx, kiln_dtype dt, int ndim,
                                       const int64_t *shape);
/* A view handle sharing a's storage. */
kiln_tensor *kiln__tensor_view(kiln_tensor *a, int ndim, const int64_t *shape,
                               const int64_t *stride, int64_t offset);
kiln_tensor *kiln__tensor_persistent(kiln_ctx *ctx, kiln_dtype dt, int ndim, const int64_t *shape,
                                     bool zero);
void kiln__contiguous_strides(int ndim, const int64_t *shape, int64_t *stride);
int64_t kiln__numel(int ndim, const int64_t *shape);
bool kiln__is_contiguous(const kiln_tensor *t);
const char *kiln__shape_of(const kiln_tensor *t, char *buf, size_t n);
void kiln__arena_reset(kiln__arena *a);
void kiln__arena_free(kiln__arena *a);
void *kiln__arena_alloc(kiln__arena *a, size_t bytes);

/* Appends a node; out may be NULL (UPDATE). Returns the node or NULL when the trace cannot grow. */
kiln__node *kiln__record(kiln_ctx *ctx, kiln__op op, int nin, kiln_tensor *const *in,
                         kiln_tensor *out);
/* Runs the nodes not yet run; on any failure nothing of this flush runs. */
kiln_status kiln__flush(kiln_ctx *ctx);

/* Elementwise op helpers used by the public ops and the backward rules. */
kiln_tensor *kiln__ew(kiln__op op, const char *fn, int nin, kiln_tensor *const *in, const float *f,
                      int nf);
kiln_tensor *kiln__reduce(kiln__op op, const char *fn, kiln_tensor *a, unsigned mask, int keepdim,
                          float scale);
/* Sums g over the axes that broadcasting added or stretched, so that it has shape s. */
kiln_tensor *kiln__unbroadcast(kiln_tensor *g, int ndim, const int64_t *shape);
/* Rows idx[start .. start + count) of a (the index's start is a step value). */
kiln_tensor *kiln__index_select_at(kiln_tensor *a, kiln_tensor *idx, int64_t start, int64_t count,
                                   const char *fn);
/* Records an in-place update of persistent tensors. */
kiln__node *kiln__update(kiln__op op, const char *fn, int nin, kiln_tensor *const *in);
bool kiln__broadcast_shape(kiln_ctx *ctx, const char *fn, int n, kiln_tensor *const *ts, int *ndim,
                           int64_t *shape);

uint64_t kiln__rng_next(kiln_ctx *ctx);                   /* splitmix64 */
double kiln__rng_uniform(kiln_ctx *ctx);                  /* [0, 1) */
uint64_t kiln__hash(const void *p, size_t n, uint64_t h); /* FNV-1a, 64-bit */

kiln_ctx *kiln__params_ctx(const kiln_params *p);
/* optim/: what checkpoints read and restore */
const char *kiln__optim_kind(const kiln_optim *o);
/* State tensor which (0, 1) of parameter i, or NULL; *name is its name in a checkpoint. */
kiln_tensor *kiln__optim_state(const kiln_optim *o, int i, int which, const char **name);
int64_t kiln__optim_count(const kiln_optim *o, int i);
void kiln__optim_restore(kiln_optim *o, int64_t steps, const int64_t *counts);

/* fusion/: planning, code generation, compiling and launching. */
kiln_status kiln__execute(kiln_ctx *ctx, int32_t first, int32_t last);
/* Plans, generates and compiles the pending nodes without running them (works without a GPU). */
kiln_status kiln__compile_pending(kiln_ctx *ctx);
/* Runs the open step's whole trace through its step graph: captured on the first occurrence of
 * its signature, replayed after. */
kiln_status kiln__graph_step(kiln_ctx *ctx);
void kiln__graphs_free(kiln_ctx *ctx);
/* Compiles source (once per process, cached on disk); NULL on failure with the error set. */
kiln__kernel *kiln__kernel_get(kiln_ctx *ctx, const char *name, const char *source,
                               const char *comment);
void kiln__kernels_free(kiln_ctx *ctx);
void kiln__lt_plans_free(kiln_ctx *ctx);
const char *kiln__prelude(void);

#endif
