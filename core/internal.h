/*
 * internal.h: the structures behind kiln's opaque handles and the internal API of core/, shared
 * by every layer (fusion, runtime, autograd, nn, optim, io, data). No CUDA header is included here:
 * CUDA checks live in cuda_check.h, included only by the files that call CUDA. Nothing here is
 * public; internal non-static symbols start with kiln__.
 */
#ifndef KILN_INTERNAL_H
#define KILN_INTERNAL_H

#include "kiln.h"

#include <math.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>

#include "util.h"

/* ---------------------------------------------------------------- asserts and errors */

_Noreturn void kiln__assert_fail(const char *cond, const char *file, int line);
#define KILN_ASSERT(c) ((c) ? (void)0 : kiln__assert_fail(#c, __FILE__, __LINE__))

/* Sets the sticky error (the first one wins) and returns s. */
kiln_status kiln__error(kiln_ctx *ctx, kiln_status s, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
bool kiln__ok(kiln_ctx *ctx); /* no sticky error */

/* A float field of an options struct, by kiln.h's rule: 0 means PyTorch's default dflt,
 * KILN_ZERO (a negative zero) an exact 0, anything else itself. */
static inline float kiln__opt_or(float v, float dflt) {
  return v != 0.f ? v : (signbit(v) ? 0.f : dflt);
}
/* Whether a flag of options (no_bias, shuffle) is 0 or 1, by the same rule; else false with the
 * error "fn: 'layer': field v must be 0 or 1" (layer NULL: left out). */
static inline bool kiln__flag_ok(kiln_ctx *ctx, const char *fn, const char *layer,
                                 const char *field, int v) {
  if (v == 0 || v == 1) return true;
  kiln__error(ctx, KILN_ERR_INVALID, "%s: %s%s%s%s %d must be 0 or 1", fn, layer ? "'" : "",
              layer ? layer : "", layer ? "': " : "", field, v);
  return false;
}

/* ---------------------------------------------------------------- op table */

typedef enum kiln__kind {
  KILN__KIND_EW,
  KILN__KIND_UPDATE,
  KILN__KIND_REDUCE,
  KILN__KIND_MATMUL,
  KILN__KIND_VIEW,
  KILN__KIND_LIB,
} kiln__kind;

/* The kernel family that renders a group led by an op (ops.def, "renderer"). */
typedef enum kiln__renderer {
  KILN__RENDER_NONE,
  KILN__RENDER_EW,
  KILN__RENDER_REDUCE,
  KILN__RENDER_BLAS,
  KILN__RENDER_COPY,
  KILN__RENDER_GATHER,
  KILN__RENDER_WINDOW,
  KILN__RENDER_MOMENTS,
  KILN__RENDER_AUGMENT,
  KILN__RENDER_CUSTOM,
} kiln__renderer;

/* What an op's kernel iterates over (ops.def, "space"). */
typedef enum kiln__space {
  KILN__SPACE_NONE,
  KILN__SPACE_OUT,
  KILN__SPACE_IN,
  KILN__SPACE_RED,
  KILN__SPACE_MAT,
  KILN__SPACE_SLICES,
  KILN__SPACE_COLS,
  KILN__SPACE_WINDOWS,
  KILN__SPACE_IMAGE,
  KILN__SPACE_ROWS,
} kiln__space;

typedef enum kiln__op {
#define X(id, name, nin, kind, renderer, space, expr, stores, grad, saves, attrs) KILN__OP_##id,
#include "ops.def"
#undef X
  KILN__OP_COUNT
} kiln__op;

#define KILN__MAX_IN 8
#define KILN__MAX_AUTOCAST 8 /* nested autocast regions */
#define KILN__MAX_EVAL 64    /* nested evaluation regions: a bit of eval_training each */
#define KILN__NF 8           /* float attributes a node can hold */
#define KILN__NI 10          /* int attributes */
#define KILN__NU 3           /* 64-bit attributes */

/*
 * Named attributes. For every op, three structs of one char per attribute of a kind (floats,
 * ints, 64-bit values) give each name its index among that kind: offsetof(kiln__fa_ADAM, lr) is
 * the slot of Adam's lr in a node's f[]. A misspelt name does not compile.
 */
#define F(x) char x;
#define FK(x) char x;
#define I(x)
#define IA(x, n)
#define U(x)
#define UK(x)
#define X(id, name, nin, kind, renderer, space, expr, stores, grad, saves, attrs)                  \
  typedef struct kiln__fa_##id {                                                                   \
    attrs char kiln__end_;                                                                         \
  } kiln__fa_##id;
#include "ops.def"
#undef X
#undef F
#undef FK
#undef I
#undef IA
#undef U
#undef UK
#define F(x)
#define FK(x)
#define I(x) char x;
#define IA(x, n) char x[n];
#define U(x)
#define UK(x)
#define X(id, name, nin, kind, renderer, space, expr, stores, grad, saves, attrs)                  \
  typedef struct kiln__ia_##id {                                                                   \
    attrs char kiln__end_;                                                                         \
  } kiln__ia_##id;
#include "ops.def"
#undef X
#undef F
#undef FK
#undef I
#undef IA
#undef U
#undef UK
#define F(x)
#define FK(x)
#define I(x)
#define IA(x, n)
#define U(x) char x;
#define UK(x) char x;
#define X(id, name, nin, kind, renderer, space, expr, stores, grad, saves, attrs)                  \
  typedef struct kiln__ua_##id {                                                                   \
    attrs char kiln__end_;                                                                         \
  } kiln__ua_##id;
#include "ops.def"
#undef X
#undef F
#undef FK
#undef I
#undef IA
#undef U
#undef UK

typedef struct kiln__node kiln__node;
/* n itself, after asserting that it is an op node (the accessors below go through these). */
kiln__node *kiln__node_of(kiln__node *n, kiln__op op, const char *file, int line);
const kiln__node *kiln__node_of_c(const kiln__node *n, kiln__op op, const char *file, int line);
#define KILN__NODE_OF(n, OP)                                                                       \
  _Generic((n), const kiln__node *: kiln__node_of_c, default: kiln__node_of)((n), KILN__OP_##OP,   \
                                                                             __FILE__, __LINE__)

/* Node n's attribute name of op OP, as an lvalue (read-only for a const node):
 * KILN__F(n, ADAM, lr) = 1e-3f. Asserts that n is an OP node. KILN__IA gives element k of an
 * array attribute. */
#define KILN__F(n, OP, name) KILN__NODE_OF(n, OP)->f[offsetof(kiln__fa_##OP, name)]
#define KILN__I(n, OP, name) KILN__NODE_OF(n, OP)->i[offsetof(kiln__ia_##OP, name)]
#define KILN__IA(n, OP, name, k) KILN__NODE_OF(n, OP)->i[offsetof(kiln__ia_##OP, name) + (k)]
#define KILN__U(n, OP, name) KILN__NODE_OF(n, OP)->u[offsetof(kiln__ua_##OP, name)]

/* The reductions (SUM, MAX, ARGMAX) share one attribute layout (scale, mask, keepdim; checked in
 * optable.c): KILN__RF(n, scale) and KILN__RI(n, mask) read it for any of them. */
kiln__node *kiln__red_of(kiln__node *n, const char *file, int line);
const kiln__node *kiln__red_of_c(const kiln__node *n, const char *file, int line);
#define KILN__RED_OF(n)                                                                            \
  _Generic((n), const kiln__node *: kiln__red_of_c, default: kiln__red_of)((n), __FILE__, __LINE__)
#define KILN__RF(n, name) KILN__RED_OF(n)->f[offsetof(kiln__fa_SUM, name)]
#define KILN__RI(n, name) KILN__RED_OF(n)->i[offsetof(kiln__ia_SUM, name)]

typedef enum kiln__attr_kind { KILN__ATTR_F, KILN__ATTR_I, KILN__ATTR_U } kiln__attr_kind;
/* One named attribute of an op: its kind, name, how many values it holds, and whether the op's
 * own kernel reads it (FK, UK). */
typedef struct kiln__attr {
  kiln__attr_kind kind;
  const char *name;
  int count;
  bool kernel;
} kiln__attr;
#define KILN__MAX_ATTRS (KILN__NF + KILN__NI + KILN__NU)

typedef struct kiln__op_info {
  const char *name;
  int nin; /* the most inputs (concat takes 1..8) */
  kiln__kind kind;
  kiln__renderer renderer;
  kiln__space space;
  const char *expr;
  unsigned stores; /* UPDATE: bit i set when input i is written back */
  bool has_grad;   /* its backward rule (autograd/) is not NONE */
  unsigned saves;  /* what the rule reads: bits 0-2 inputs, bit 3 the output */
  int nattr;
  kiln__attr attrs[KILN__MAX_ATTRS]; /* in ops.def's order */
} kiln__op_info;

extern const kiln__op_info kiln__ops[KILN__OP_COUNT];
static inline bool kiln__has_grad(kiln__op op) { return kiln__ops[op].has_grad; }
/* op's attribute called name (the first len characters): its kind and its first slot among the
 * node's values of that kind; false when op has no such attribute. */
bool kiln__attr_find(kiln__op op, const char *name, size_t len, kiln__attr_kind *kind, int *slot);
/* Whether op has an attribute called name. */
bool kiln__has_attr(kiln__op op, const char *name);
/* Node n's integer attribute called name (asserting that n's op has one), found through the op
 * table, as an lvalue (read-only for a const node): for code that serves several ops, as the
 * window kernels do. KILN__I(n, OP, name) is the accessor when the op is known. */
int64_t *kiln__attr_i(kiln__node *n, const char *name, const char *file, int line);
const int64_t *kiln__attr_i_c(const kiln__node *n, const char *name, const char *file, int line);
#define KILN__I_NAMED(n, name)                                                                     \
  (*_Generic((n), const kiln__node *: kiln__attr_i_c, default: kiln__attr_i)((n), (name),          \
                                                                             __FILE__, __LINE__))
/* The same for a float attribute (code that records several ops' nodes, as the optimizers do). */
float *kiln__attr_f(kiln__node *n, const char *name, const char *file, int line);
#define KILN__F_NAMED(n, name) (*kiln__attr_f((n), (name), __FILE__, __LINE__))
/* The inputs of update op that hold one value for every element (bit q for input q): scale's
 * factor, found_inf's flag, a guarded update's flag and count (ops.def). */
unsigned kiln__update_scalars(kiln__op op);
/* Whether op is a window op whose kernel takes the elementwise nodes after it as an epilogue: one
 * over WINDOWS or IMAGE (pooling, col2im, the pools' gradients), whose lanes are the output's. */
static inline bool kiln__takes_epilogue(kiln__op op) {
  return kiln__ops[op].renderer == KILN__RENDER_WINDOW &&
         (kiln__ops[op].space == KILN__SPACE_WINDOWS || kiln__ops[op].space == KILN__SPACE_IMAGE);
}

/* A $-token of an op expression: an input ($0), the element's linear index ($idx), the
 * coordinate along the op's `axis` ($c), where a kernel records a bad value ($err), or one of its
 * attributes ($lr). */
typedef struct kiln__token {
  enum { KILN__TOK_INPUT, KILN__TOK_IDX, KILN__TOK_COORD, KILN__TOK_ERR, KILN__TOK_ATTR } kind;
  int input, attr; /* attr: index into the op's attribute list */
  size_t len;      /* characters after the '$' */
} kiln__token;
/* The token after a '$' of op's expression (p points past the '$'). */
kiln__token kiln__expr_token(kiln__op op, const char *p);
/* Which of op's attributes its kernel code reads (used[a] for attribute a of its list): those its
 * expression names and those marked FK or UK. */
void kiln__kernel_attrs(kiln__op op, bool *used);
/* How many float, int and 64-bit attribute slots op's kernel code takes. */
void kiln__kernel_slots(kiln__op op, int *nf, int *ni, int *nu);
/* The position of op's attribute called name in its list (asserting that it has one). */
int kiln__attr_index(kiln__op op, const char *name);

/* ---------------------------------------------------------------- allocator */

typedef struct kiln__block kiln__block;
typedef struct kiln__alloc {
  kiln__block *free_list; /* cached blocks, sorted by size */
  void *live;             /* blocks handed out, by pointer */
  size_t in_use, peak, cached;
  uint64_t device_mallocs;
} kiln__alloc;

/* Device memory, at least 256-byte aligned (cudaMalloc's guarantee; sizes are rounded up to
 * KILN__ALLOC_ALIGN, and step-graph arenas place values at multiples of it, so every storage
 * starts at such a boundary). Returns NULL (and sets no error) when the device is out of memory
 * even after emptying the cache. Blocks are reused best-fit. */
#define KILN__ALLOC_ALIGN 512
void *kiln__dev_alloc(kiln_ctx *ctx, size_t bytes);
void kiln__dev_free(kiln_ctx *ctx, void *p);
void kiln__alloc_release_all(kiln_ctx *ctx);

/* ---------------------------------------------------------------- tensors */

typedef struct kiln__storage {
  void *ptr; /* device memory, NULL until allocated */
  size_t bytes;
  size_t tail; /* of the bytes, those past the values: a max pool's window positions (ops.def) */
  bool persistent; /* owned by a persistent tensor; else freed at step begin */
  bool fused;      /* it lived in a fused kernel's registers and was never written */
  void *relu_mask; /* a ReLU output's bit mask from a product's epilogue, or NULL */
  bool borrowed;   /* ptr and relu_mask point into a step graph's arena: not freed */
  bool clobbered;  /* in that arena a later value of the step reused its memory */
  /* persistent: the step generation and trace position of its last copy from the host
   * (kiln_tensor_copy_from_host), which core/conv.c's unchanged_since checks */
  uint64_t host_step;
  int32_t host_at;
  struct kiln__storage *next; /* intermediates of a generation, for release */
} kiln__storage;

#define KILN__TENSOR_MAGIC 0x6b696c6e /* "kiln" */
#define KILN__TENSOR_DEAD 0x64656164  /* "dead": a freed persistent tensor */
/* "sdlo": an intermediate of a step long over (handles.c) */
#define KILN__TENSOR_STALE 0x6f6c6473

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
  bool owned;          /* persistent: a parameter list owns it (and frees it) */
  uint64_t undo_mark;  /* the step's undo log holds its gradient flag (core/undo.c) */
  kiln_tensor *grad;   /* persistent: gradient buffer, allocated on first backward */
  kiln_tensor *bw_acc; /* during backward: the gradient gathered so far */
  char *name;          /* NULL or: malloc'd (persistent), in the step's arena (intermediate) */
  const char *fn;      /* intermediate: the function that made it (a static string), or NULL */
};
/* t's name, "" when it has none. */
const char *kiln__name(const kiln_tensor *t);

/* ---------------------------------------------------------------- trace */

struct kiln__node {
  kiln__op op;
  int nin;
  bool gone; /* a persistent tensor it reads was freed since it was recorded: it cannot run */
  /* kiln_backward: 1 while the walk under way has reached it, 2 once a finished walk has (a
   * second backward from it would add its gradients twice: autograd/backward.c) */
  uint8_t bw;
  kiln_tensor *in[KILN__MAX_IN];
  kiln_tensor *out; /* NULL for UPDATE nodes */
  const char *fn;   /* the function that recorded it (its output's maker, an update's caller) */
  int32_t from;     /* recorded by kiln_backward for this forward node's rule, or -1 */
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

/* ---------------------------------------------------------------- context */

/* KILN_DEBUG, a comma-separated list: "plan" prints every flush's groups to stderr, "verify"
 * checks every plan's invariants (on in debug builds), "nan" turns anomaly mode on
 * (kiln_set_anomaly), "memory" prints every step graph's memory plan. */
enum {
  KILN__DEBUG_PLAN = 1,
  KILN__DEBUG_VERIFY = 2,
  KILN__DEBUG_NAN = 4,
  KILN__DEBUG_MEMORY = 8,
  KILN__DEBUG_TRAFFIC = 16,
  /* every product on the BLAS library zeroes its output first (cudaMemsetAsync), which
   * compute-sanitizer's initcheck counts as written: it does not count the TMA stores of Hopper's
   * cuBLAS kernels (dev/README.md, "initcheck"), whose every output byte the product writes */
  KILN__DEBUG_INITCHECK = 32
};

struct CUstream_st;                               /* a cudaStream_t, without the CUDA headers */
typedef struct kiln__handles kiln__handles;       /* core/handles.c */
typedef struct kiln__undo_entry kiln__undo_entry; /* core/undo.c */
struct kiln__fusion; /* fusion/'s state: kernels, graphs, BLAS plans (fusion/fusion.h) */
struct kiln__prof;   /* a timeline trace being recorded (prof/prof.h) */

struct kiln_ctx {
  int device;
  bool has_gpu;
  int arch; /* compute capability as 90, 80, ... */
  int num_sms;
  bool conv_warp_spec; /* conv.cuh's kernels warp-specialized (KILN_CONV_WS=1) */
  bool conv_tma;       /* conv_tma.cuh's TMA-fed products where they serve (KILN_CONV_TMA=0: off) */
  bool conv_staged; /* their data gradients' epilogues through shared memory (KILN_CONV_STAGED=1) */
  bool conv_direct; /* direct forward products of tiny convolutions (KILN_CONV_DIRECT=1) */
  bool im2col_lanes; /* im2col of 2 or 3 channels a tap a thread (KILN_IM2COL_LANES=1) */
  bool im2col_rows;  /* im2col of a few channels a row a thread (KILN_IM2COL_ROWS=0: a value) */
  /* max pooling's gradient a block of stride x stride pixels a thread, each window reaching it
   * read once (KILN_POOL_GRAD_BLOCKS=0: a pixel a thread) */
  bool pool_grad_blocks;
  /* the epilogue's operands of a pool gradient a block a thread, or of a col2im, fetched before
   * the op's own loads (KILN_WINDOW_AHEAD=0: each loaded where the epilogue reads it) */
  bool window_ahead;
  /* a forward product with few input channels into 64 (kiln__conv_few_shape) from a halo tile in
   * shared memory (fusion/device/conv_few.cuh; KILN_CONV_FEW=0: the cp.async implicit GEMM) */
  bool conv_few;
  /* their weight gradients from the same halo tiles (KILN_CONV_FEW_WGRAD=0: the cp.async kernel's;
   * only with conv_few) */
  bool conv_few_wgrad;
  /* a 2x2 max pool (stride 2) after such a forward product pooled in its epilogue, the product's
   * own output never written (kiln__conv_pool; KILN_CONV_FEW_POOL=0: a kernel of its own) */
  bool conv_few_pool;
  /* the same after a TMA-fed forward product, its tiles pairs of whole output rows
   * (kiln__conv_pool; KILN_CONV_TMA_POOL=1, off: with copies of 8 or 16 pixels a row, air's
   * 7x7x256->256 product took 244 us under ncu against 103, the step 3% slower) */
  bool conv_tma_pool;
  /* kiln's kernels launched as programmatic dependents of the kernel before them on sm_90, each
   * waiting first, then letting the next launch (KILN_PDL=1; off: slower on the H100) */
  bool pdl;
  int implicit_conv_max_co; /* KILN_IMPLICIT_CONV_MAX_CO, to measure; 0: the planner's default */
  bool conv_recompute;      /* KILN_CONV_RECOMPUTE=1: kiln__recomputes_columns */
  /* a weight gradient's image that an activation's rule recomputes anyway is recomputed for it
   * too, not kept (core/conv.c's image_again; KILN_CONV_RECOMPUTE_INPUT=0: kept) */
  bool conv_recompute_input;
  /* the same for the blocks of a persistent image (KILN_CONV_RECOMPUTE_BLOCKS=0: kept) */
  bool conv_recompute_blocks;
  bool conv_kpad;    /* zero columns to a multiple of 8 (kiln_conv2d); KILN_CONV_KPAD=0: none */
  bool conv_moments; /* batch norm's gradient sums in a data gradient's epilogue (=0: not) */
  /* batch norm's statistics in a forward product's epilogue, the shift of their sums its running
   * mean (fusion/plan_conv.c's kiln__fprop_moments; KILN_CONV_FPROP_MOMENTS=0: not) */
  bool fprop_moments;
  bool pool_moments;   /* KILN_POOL_MOMENTS=1: batch norm's statistics in a max pool's kernel */
  bool window_moments; /* batch norm's gradient sums in a col2im's or pool gradient's (=0: not) */
  bool pool_prologue;  /* KILN_POOL_PROLOGUE=1: a pool gradient computes its dy as it reads it */
  /* a max pool computes its image where it reads it, from the elementwise run that would have
   * written it (kiln__pool_fwd_prologue; KILN_POOL_FWD_PROLOGUE=0: not) */
  bool pool_fwd_prologue;
  /* conv_few.cuh's weight gradient computes its dY where it loads it, from the elementwise run
   * that would have written it (kiln__phase_few_prologue; KILN_CONV_FEW_PROLOGUE=0: not) */
  bool few_prologue;
  /* strided data gradients one phase of dX at a time on the TMA-fed kernel, not cuBLAS's columns
   * and col2im (kiln__dgrad_phases; KILN_CONV_TMA_PHASES=1: off, slower on its first run) */
  bool conv_phases;
  bool conv_prefetch; /* KILN_CONV_PREFETCH=1: TMA data gradients prefetch their epilogue's rows */
  /* stride-1 TMA data gradients with an epilogue on persistent blocks, two warpgroups of their own
   * running a staged tile's epilogue beside the next tile's products (conv_tma.cuh's
   * kiln_conv_dgrad_tma_ws; KILN_CONV_DGRAD_WS=1: the staged tiles in one room, =2: in two) */
  int conv_dgrad_ws;
  /* the staged epilogues of TMA data gradients (KILN_CONV_HOIST=0 to 16): 0, each operand loaded
   * in the row that reads it; d > 0, per-channel ones once before the loop, and the others d rows
   * ahead of the row that reads them */
  int conv_hoist;
  /* KILN_CONV_AHEAD=1: the cp.async forward products (and data gradients) whose reduction fits
   * their stages issue all its copies before their first product (conv.cuh's mainloop) */
  bool conv_ahead;
  /* KILN_BN_ROWS=1: batch norm's partial sums summed as rows, one kernel with the per-channel
   * values after them (kiln__moments; else one column sum, the values in a kernel of their own) */
  bool bn_rows;
  /* KILN_CONV_WGRAD_INTO=1: an implicit weight gradient writes the weight's f32 gradient itself
   * (fusion/plan_conv.c's kiln__wgrad_into_grad) */
  bool conv_wgrad_into;
  /* casts of parameters (through views) that only products read run as one multi-tensor launch
   * (fusion/plan.c's batch_casts; KILN_CAST_BATCH=0: not) */
  bool cast_batch;
  /* (KILN_CAST_TILES=0: not.) A cast whose input is a permutation of dense blocks (a filter's (O,
   * I, KH, KW) read as (O, KH, KW, I), and back) goes through each block in shared memory, read and
   * written in order, and a dense one four values at a time (render_ew.c's kiln__render_casts);
   * lone ones too (lower.c) */
  bool cast_tiles;
  /* a direct forward product applies the unary elementwise chain after it before it stores
   * (fusion/plan_conv.c's kiln__direct_epilogue; KILN_CONV_DIRECT_EPI=0: not) */
  bool conv_direct_epi;
  /* KILN_CONV_S2D=1: a strided convolution over few channels (ResNet's stem) as a stride-1 one
   * over the image's blocks, which the implicit GEMMs take (core/conv.c's to_blocks) */
  bool conv_s2d;
  /* KILN_EW_SINK=1: an elementwise run read only by a later one of its space runs in its kernel
   * (fusion/plan.c's phase_sink) */
  bool ew_sink;
  int conv_dgrad_bn; /* TMA data gradients' widest tile: 128, or KILN_CONV_DGRAD_BN (64; 256: 0) */
  /* KILN_CONV_FPROP_BN (256, the default, 128 or 64): TMA forward products' widest tile, and those
   * of at most 128 take 96 KB of stages, two blocks an SM (0: 256, and 192 KB, one) */
  int conv_fprop_bn;
  struct CUstream_st *stream;

  kiln_status status;
  char error[1024];

  bool tf32;
  bool fusion;     /* plan fused groups (KILN_FUSION=0: one node per kernel) */
  bool graphs;     /* capture and replay steps (KILN_GRAPH=0: off) */
  bool nvtx;       /* KILN_NVTX=1: an NVTX range around every launch */
  unsigned debug;  /* KILN__DEBUG_* */
  bool anomaly;    /* kiln_set_anomaly: every flush unfused, eager and checked (fusion/anomaly.c) */
  int32_t bw_from; /* while kiln_backward records a node's rule: that node (else -1) */
  int no_grad_depth;
  int autocast_depth;                      /* open kiln_autocast_begin regions */
  kiln_dtype autocast[KILN__MAX_AUTOCAST]; /* their dtypes, innermost last */
  bool training;                           /* kiln_set_training: layers' train/eval mode */
  int eval_depth;                          /* open kiln_eval_begin regions */
  uint64_t eval_training; /* bit d: the training mode that region d found (kiln_eval_end) */
  uint64_t seed, philox_offset;
  uint64_t host_rng; /* init and shuffles: splitmix64 state */

  uint64_t gen;                 /* the current step generation, from 1 */
  bool in_step;                 /* between kiln_step_begin and kiln_step_end */
  kiln__arena arenas[2];        /* intermediates' storages, alternating by generation */
  kiln__handles *handles;       /* intermediates' handles, each at an address never used before */
  kiln__storage *step_storages; /* intermediates' storages of this generation */
  kiln_tensor **persistents;    /* for ctx_free */
  int npersistent, cap_persistent;

  kiln__trace trace;
  kiln__alloc alloc;
  kiln_exec_stats stats;
  struct kiln__fusion *fusion_state; /* owned by fusion/ (fusion/engine.h) */
  struct kiln__prof *prof;           /* kiln_trace_begin's trace, or NULL (prof/) */
  struct kiln__anchor *anchor;       /* what objects made from the context hold on to */
  /* what a failed step must undo (core/undo.c) */
  kiln__undo_entry *undo;
  int nundo, cap_undo;
  uint64_t undo_epoch; /* one per step: an object whose mark equals it is in the log */
  uint64_t undo_philox, undo_host_rng;
  struct kiln__staging *staging; /* pinned buffers for host-to-device copies (runtime/) */
  kiln_custom_op **customs;      /* custom ops, by id (core/custom.c) */
  int ncustom, cap_custom;
};

/* ---------------------------------------------------------------- internal API */

/* The parts of the context's lifetime and steps that are core's; runtime/context.c adds fusion's
 * engine and the flushes around them (kiln_ctx_new, kiln_ctx_free, kiln_step_begin). */

/* A new context without the engine: options from the environment, the device and its stream
 * (errors naming kiln_ctx_new); NULL when host memory runs out. */
kiln_ctx *kiln__ctx_create(const kiln_ctx_options *opts);
/* Freeing ctx, first part: objects made from it see it gone, the stream idles, the step's
 * intermediates and every persistent tensor are freed (recorded work is not run). */
void kiln__ctx_close(kiln_ctx *ctx);
/* Freeing ctx, last part (after the engine's state and the staging buffers): the allocator's
 * cache, the stream, arenas, handles, undo log, trace and ctx itself. */
void kiln__ctx_destroy(kiln_ctx *ctx);
/* Frees the device memory of the current generation's intermediates (not that of a graph). */
void kiln__storages_release(kiln_ctx *ctx);
/* Opens a step: a new generation of intermediates, an empty trace and undo log. */
void kiln__step_open(kiln_ctx *ctx);

/* The step's undo log (core/undo.c): fn(obj, saved) puts back what saved (malloc'd; the log
 * frees it) describes. Outside a step nothing is logged. Each object logs once per step: *mark
 * (a field of the object, zero at first) records that it did. */
typedef void (*kiln__undo_fn)(void *obj, void *saved);
bool kiln__undo_push(kiln_ctx *ctx, kiln__undo_fn fn, void *obj, void *saved, uint64_t *mark);
bool kiln__undo_logged(const kiln_ctx *ctx, const uint64_t *mark);
void kiln__undo_forget(kiln_ctx *ctx, const void *obj); /* obj is being freed */
void kiln__undo_begin(kiln_ctx *ctx);                   /* a step begins */
void kiln__undo_commit(kiln_ctx *ctx);                  /* it succeeded */
void kiln__undo_rollback(kiln_ctx *ctx);                /* it failed */
void kiln__undo_free(kiln_ctx *ctx);
/* Logs t's gradient flag before a change to it within a step. */
bool kiln__undo_grad_flag(kiln_tensor *t);

/* Parameter lists, optimizers, data sets and loaders hold their context's anchor, which outlives
 * the context: freed after kiln_ctx_free (which freed their tensors with everything else), they
 * free only their own host memory. */
typedef struct kiln__anchor {
  int refs;
  bool alive; /* the context is not freed yet */
} kiln__anchor;
kiln__anchor *kiln__ctx_anchor(kiln_ctx *ctx); /* a new reference to ctx's anchor */
void kiln__anchor_release(kiln__anchor *a);

/* Validates a tensor handle for function fn: NULL, foreign, freed or stale handles set an error. */
bool kiln__check(kiln_ctx *ctx, const kiln_tensor *t, const char *fn);
/* The context of the first tensor handle among ts that names one (live or stale), or NULL. */
kiln_ctx *kiln__ctx_of(int n, kiln_tensor *const *ts);
/* The ops' first step (core/ops.c, core/reduce.c): the context of in[0..n), every one checked
 * (kiln__check); NULL when one is bad or the context has failed already (then nothing is
 * recorded). */
kiln_ctx *kiln__op_begin(const char *fn, int n, kiln_tensor *const *in);
/* Whether every one of in[0..n) is f32 or bf16; else an error naming fn and the input. */
bool kiln__need_float(kiln_ctx *ctx, const char *fn, int n, kiln_tensor *const *in);
/* in[0..n) as f32: ops that compute in f32 whatever their inputs (softmax, the losses, the
 * normalisations) cast bf16 inputs first, a cast that fuses into their kernels. */
bool kiln__as_f32(int n, kiln_tensor **in);
/* *axis (negative from the end) as an axis of a; an error naming fn when it is out of range. */
bool kiln__norm_axis(kiln_ctx *ctx, const char *fn, const kiln_tensor *a, int *axis);
/* The context of t, live or stale (NULL for NULL, freed or foreign memory). */
kiln_ctx *kiln__handle_ctx(const kiln_tensor *t);
/* A zeroed handle for an intermediate or a view (handles.c); NULL with the error set. */
kiln_tensor *kiln__handle_new(kiln_ctx *ctx);
/* A zeroed handle for a persistent tensor, and its end: the handle stays readable and says it
 * was freed (KILN__TENSOR_DEAD) until its chunk is retired. */
kiln_tensor *kiln__handle_new_persistent(kiln_ctx *ctx);
void kiln__handle_free_persistent(kiln_ctx *ctx, kiln_tensor *t);
/* A new step began: chunks whose handles are all stale give their memory back. */
void kiln__handles_step(kiln_ctx *ctx);
void kiln__handles_free(kiln_ctx *ctx);

/* Shapes (core/meta.c). Every shape a tensor takes is checked: at most KILN_MAX_DIMS dims, no
 * negative size, and at most KILN__MAX_NUMEL elements (so that element counts, byte sizes and
 * strides never overflow 64 bits, whatever the dtype). */
#define KILN__MAX_NUMEL ((int64_t)1 << 58)
bool kiln__numel_ok(int ndim, const int64_t *shape);
/* kiln__numel_ok with the checks on ndim and negative sizes, and an error naming fn. */
bool kiln__valid_shape(kiln_ctx *ctx, const char *fn, int ndim, const int64_t *shape);
void kiln__contiguous_strides(int ndim, const int64_t *shape, int64_t *stride);
int64_t kiln__numel(int ndim, const int64_t *shape);
bool kiln__is_contiguous(const kiln_tensor *t);
/* The dtype products and convolutions compute in: the innermost open autocast region's, or
 * KILN_DTYPE_F32 outside every region (core/ctx.c). */
kiln_dtype kiln__autocast_dtype(const kiln_ctx *ctx);
/* The floating dtypes ops compute with (in f32 registers): f32 and bf16. */
static inline bool kiln__is_float(kiln_dtype dt) {
  return dt == KILN_DTYPE_F32 || dt == KILN_DTYPE_BF16;
}
/* The dtype of an op on values of dtypes a and b, as PyTorch promotes them: bf16 only when both
 * are, i32 only when both are, f32 otherwise. */
static inline kiln_dtype kiln__promote(kiln_dtype a, kiln_dtype b) {
  return a == b ? a : KILN_DTYPE_F32;
}
const char *kiln__shape_of(const kiln_tensor *t, char *buf, size_t n);
bool kiln__same_shape(const kiln_tensor *a, const kiln_tensor *b);
bool kiln__broadcast_shape(kiln_ctx *ctx, const char *fn, int n, kiln_tensor *const *ts, int *ndim,
                           int64_t *shape);

/* A new intermediate with contiguous strides (storage allocated at flush); NULL with an error
 * naming fn when the shape is not valid. */
kiln_tensor *kiln__tensor_intermediate(kiln_ctx *ctx, const char *fn, kiln_dtype dt, int ndim,
                                       const int64_t *shape);
/* A view handle sharing a's storage (the shape checked as above). */
kiln_tensor *kiln__tensor_view(const char *fn, kiln_tensor *a, int ndim, const int64_t *shape,
                               const int64_t *stride, int64_t offset);
kiln_tensor *kiln__tensor_persistent(kiln_ctx *ctx, kiln_dtype dt, int ndim, const int64_t *shape,
                                     bool zero);
/* Whether tensors of dtype dt can be made (f32, bf16, i32); else an error naming fn. */
bool kiln__dtype_check(kiln_ctx *ctx, const char *fn, kiln_dtype dt);
/* Whether kiln_tensor_free has anything to free in t: false for NULL, freed handles and
 * intermediates, and (with an error) for a tensor a parameter list owns. */
bool kiln__tensor_freeable(kiln_tensor *t);
/* kiln_tensor_free without its flush: frees a freeable t and its gradient, and marks the trace's
 * nodes that read it as gone. */
void kiln__tensor_release(kiln_tensor *t);
/* The device address of t's first element. */
void *kiln__data_ptr(const kiln_tensor *t);
void kiln__arena_reset(kiln__arena *a);
void kiln__arena_free(kiln__arena *a);
void *kiln__arena_alloc(kiln__arena *a, size_t bytes);

/* Appends a node; out may be NULL (UPDATE). Returns the node or NULL when the trace cannot grow. */
kiln__node *kiln__record(kiln_ctx *ctx, kiln__op op, int nin, kiln_tensor *const *in,
                         kiln_tensor *out);
/* Whether node n stores into memory st through one of its inputs (ops.def's stores: an update's
 * or an assignment's target). */
bool kiln__node_stores_into(const kiln__node *n, const kiln__storage *st);
/* Records node n again (the backward pass recomputing a forward value instead of keeping it):
 * the same op, inputs and attributes, a new output like n's. Returns that output, or NULL. */
kiln_tensor *kiln__record_again(const kiln__node *n);
/* The same with other inputs in (n->nin of them, in n's order). */
kiln_tensor *kiln__record_again_with(const kiln__node *n, kiln_tensor *const *in);

/* Elementwise op helpers used by the public ops and the backward rules. */
kiln_tensor *kiln__ew(kiln__op op, const char *fn, int nin, kiln_tensor *const *in);
kiln_tensor *kiln__reduce(kiln__op op, const char *fn, kiln_tensor *a, unsigned mask, int keepdim,
                          float scale);
/* Rows idx[start .. start + count) of a (the index's start is a step value). */
kiln_tensor *kiln__index_select_at(kiln_tensor *a, kiln_tensor *idx, int64_t start, int64_t count,
                                   const char *fn);
/* index_select's gradient: g's rows (K, ...) added into `rows` zeroed rows by idx[start + k]. */
kiln_tensor *kiln__index_add(kiln_tensor *g, kiln_tensor *idx, uint64_t start, int64_t rows,
                             const char *fn);
/* Host memory for loaders that fill it themselves (runtime/transfer.c): n bytes, pinned where the
 * context has a GPU and pinned memory can be had (*pinned says which), NULL out of memory. */
void *kiln__host_alloc(kiln_ctx *ctx, size_t n, bool *pinned);
void kiln__host_free(void *p, bool pinned);
/* Queues the copy of n bytes of host memory src to t's device memory from byte `at` on the
 * context's stream, after what was recorded runs (as kiln_tensor_copy_from_host), then records
 * *event (created on first use) after it. Pinned src must stay unchanged until
 * kiln__upload_wait(event) returns; other memory is free on return. A no-GPU context drops it. */
kiln_status kiln__upload(kiln_tensor *t, size_t at, const void *src, size_t n, bool pinned,
                         void **event, const char *fn);
kiln_status kiln__upload_wait(kiln_ctx *ctx, void *event, const char *fn);
/* Frees every cached step graph now (runtime/context.c), after the stream is idle: for a loader
 * that replaces a persistent buffer its steps read (their graphs would never replay again). */
void kiln__forget_step_graphs(kiln_ctx *ctx);
void kiln__event_free(void *event);
/* The image folder's images to the network's input (data/imageloader.c): raw (bytes / 4) i32
 * holds 8-bit RGB pixels, table (N, KILN__RESIZE_COLS) i32 a row per image (KILN__RZ_*:
 * where its staged pixels start in raw and how they map onto the output), mean and std per
 * channel; gives (N, height, width, 3) of dtype dt (f32 or bf16). Image n's source is an image
 * of rows x cols pixels, resized to rrows x rcols (antialiased bilinear, PIL's filter); output
 * pixel (i, j) is pixel (oy + i, ox + j') of the resized image, j' = width - 1 - j when flipped.
 * Only the source's pixels from (r0, c0), a window sw pixels wide, are staged: the rows and
 * columns the filter reads. */
enum {
  KILN__RZ_OFFSET, /* the staged window's first byte in raw */
  KILN__RZ_ROWS,   /* the source */
  KILN__RZ_COLS,
  KILN__RZ_RROWS, /* the size it is resized to */
  KILN__RZ_RCOLS,
  KILN__RZ_OY, /* the output's origin in the resized image */
  KILN__RZ_OX,
  KILN__RZ_R0, /* the staged window's origin in the source, and its width */
  KILN__RZ_C0,
  KILN__RZ_SW,
  KILN__RZ_FLIP, /* 1: flipped left-right */
  KILN__RESIZE_COLS = 12
};
kiln_tensor *kiln__resize_crop(kiln_tensor *raw, kiln_tensor *table, int64_t height, int64_t width,
                               const float mean[3], const float std[3], kiln_dtype dt,
                               const char *fn);
/* A sliding window over an image (N, H, W, C), the `win` attribute of the window ops (ops.def):
 * kernel, stride, padding and dilation, height then width. */
typedef struct kiln__win {
  int64_t kh, kw, sh, sw, ph, pw, dh, dw;
} kiln__win;
#define KILN__WIN_LEN 8
_Static_assert(sizeof(kiln__win) == KILN__WIN_LEN * sizeof(int64_t), "kiln__win: eight int64s");
/* The window geometry node n holds (any window op: its attribute `win`). */
kiln__win kiln__win_of(const kiln__node *n);
/* Records window op `op` of x (contiguous) with geometry w, giving an output of out_shape (4-D);
 * the caller sets the op's other attributes (groups, exclude_pad) by name. x2 is the second
 * input of max_pool_grad (else NULL). */
kiln_tensor *kiln__window(kiln__op op, const char *fn, kiln_tensor *x, kiln_tensor *x2,
                          const int64_t *out_shape, const kiln__win *w);

/* Column sums of an (R, C) matrix in one pass (the moments op): mode 0, in = {x, k}: the sums of
 * x - k and (x - k)^2; mode 1, in = {g, x, mean, invstd}: the sums of g and g (x - mean) invstd.
 * x and g are (R, C), k (1, C), mean and invstd (C). Gives the two sums in s, (1, C) each: the
 * partial sums of the moments op's blocks (P of them) summed as the rows of a (2, C, P) view
 * where ctx->bn_rows and 1 < P <= KILN__MOMENTS_ROW_PARTS (a row program's reductions, which the
 * per-channel values computed from the sums join: one kernel), else as one column sum (2, C).
 * Returns false (s NULL) on error. */
bool kiln__moments(const char *fn, int mode, kiln_tensor *const *in, kiln_tensor *s[2]);
/* The most partial sums in a row of kiln__moments's row sums (at most a row program's longest
 * row, fusion/plan.c's KILN__MAX_ROW). The row program takes a block a channel for both sums
 * where the column sum took one a sum, each thread striding over the partial sums: half the
 * blocks, twice the passes. Above 4096 partial sums a channel (ResNet-18's stem at batch 128 has
 * 12,544) the column sum stays (a guess, not measured: one launch is worth a few us). */
#define KILN__MOMENTS_ROW_PARTS 4096
/* The most output channels an implicit forward product and weight gradient take (fusion/plan.c
 * says why): the context's (KILN_IMPLICIT_CONV_MAX_CO, to measure), else 64. */
#ifndef KILN__IMPLICIT_CONV_MAX_CO /* a build may set it, to measure */
#define KILN__IMPLICIT_CONV_MAX_CO 64
#endif
int64_t kiln__implicit_conv_max_co(const kiln_ctx *ctx);
/* What an implicit forward product and weight gradient ask of im2col node c's image (on the
 * context's device) and of the output channels co, before the planner's checks of the flush:
 * a Hopper device, one group, a bf16 image with channels in 16-byte chunks; co a multiple of 8
 * and at most kiln__implicit_conv_max_co, or any number where the TMA-fed products take the
 * convolution (kiln__conv_tma_window, unless KILN_CONV_TMA=0) unless KILN_IMPLICIT_CONV_MAX_CO says
 * otherwise. */
bool kiln__implicit_conv_image(const kiln_ctx *ctx, const kiln__node *c);
bool kiln__implicit_conv_channels(const kiln_ctx *ctx, const kiln__node *c, int64_t co);
/* A direct forward product (conv_direct.cuh's kiln_conv_direct: a thread an output pixel, no column
 * matrix, no tensor cores) for a convolution of few taps and channels that the implicit kernels
 * do not take, such as a whitening layer's 2x2 over 3 channels (on unless KILN_CONV_DIRECT=0): the
 * shape (K = kh kw ci values a window, ci channels not in 16-byte chunks, co output channels) that
 * it takes, and whether im2col node c's image may be one (the switch on, one group, a bf16 image).
 * The planner asks both, and that nothing takes a gradient through it. */
#define KILN__CONV_DIRECT_MAX_K 32
#define KILN__CONV_DIRECT_MAX_CO 64
bool kiln__conv_direct_shape(int64_t k, int64_t ci, int64_t co);
bool kiln__conv_direct_image(const kiln_ctx *ctx, const kiln__node *c);
/* Whether window node w (im2col, or col2im) has columns padded past its windows' values (zero
 * columns: kiln_conv2d with KILN_CONV_KPAD=1), which no implicit product takes. */
bool kiln__columns_padded(const kiln__node *w);
/* An op's training argument (kiln_dropout, kiln_batch_norm): 0, 1, or KILN_TRAINING_MODE, which
 * becomes the context's mode; any other value is an error naming fn (false). */
bool kiln__training_flag(kiln_ctx *ctx, const char *fn, int *training);
/* Whether the TMA-fed products (fusion/device/conv_tma.cuh) take a window w over ci channels:
 * whole stages of 64 channels, and the geometry an im2col tensor map can hold (strides 1 to 8,
 * box corners within [-128, 127], tap offsets d (k - 1) of at most 255). */
bool kiln__conv_tma_window(const kiln__win *w, int64_t ci);
/* Whether conv_few.cuh's forward product takes a window w over ci channels into co: stride 1, no
 * dilation, 64 output channels, input channels in 16-byte chunks but fewer than a TMA stage of
 * 64, and at most KILN__CONV_FEW_MAX_K values a window (its filters, 64 rows of K bf16, in 36 KB
 * of shared memory, two blocks an SM). */
#define KILN__CONV_FEW_MAX_K 288
bool kiln__conv_few_shape(const kiln__win *w, int64_t ci, int64_t co);
/* Its weight gradient (KILN_CONV_FEW_WGRAD) holds a block's whole dWt in registers: at most
 * 256 values a window (16 tiles of 16 rows, four a warp). */
#define KILN__CONV_FEW_WGRAD_MAX_K 256
/* Whether conv_few.cuh's weight gradient takes it: kiln__conv_few_shape, and K at most that. */
bool kiln__few_wgrad_shape(const kiln__win *w, int64_t ci, int64_t co);
/* The window of a stride-1 convolution's data gradient as a forward product of dY (the filters
 * flipped): padding d (k - 1) - p, stride 1. */
kiln__win kiln__dgrad_window(const kiln__win *w);
/* Whether the TMA-fed data gradient takes a convolution of window w, co output and ci input
 * channels: stride 1, its dgrad window's padding not negative, and kiln__conv_tma_window of
 * that window over co channels, ci in whole 64-channel panels. */
bool kiln__conv_tma_dgrad(const kiln__win *w, int64_t co, int64_t ci);
/* Whether the weight gradient of mm, a convolution's forward product (columns from im2col times
 * the weights), reads columns gathered again in the backward pass rather than the forward's, so
 * that those need not be kept (KILN_CONV_RECOMPUTE=1, for products on the BLAS library: those
 * that kiln__implicit_conv_image and _channels refuse; the implicit ones keep no columns). */
bool kiln__recomputes_columns(const kiln__node *mm);
/* Whether the weight gradient of a product over im2col node c's columns reads columns gathered
 * again from an image recorded again, from values the backward pass reads anyway, so that the
 * image is not kept from the forward pass (KILN_CONV_RECOMPUTE_INPUT=0: kept): where that image
 * is a ReLU whose own rule recomputes its input (kiln__recomputes_input: a batch norm's output;
 * one elementwise pass over the norm's input instead, which the planner mostly fuses into the
 * kernel before the weight gradient), or the blocks of a persistent tensor (core/conv.c's
 * to_blocks, over the tensor or its cast: ResNet's stem; one more im2col, and an error from
 * kiln_backward if the tensor was written or freed since the forward pass read it;
 * KILN_CONV_RECOMPUTE_BLOCKS=0: kept). Not a GELU or SiLU,
 * whose second pass costs more (the air step's after its pools would be kernels of their
 * own). */
bool kiln__gathers_again(const kiln__node *c);
/* The columns for mm's weight gradient: gathered again where kiln__recomputes_columns or
 * kiln__gathers_again (from the image recorded again), else the forward's. */
kiln_tensor *kiln__columns_for_gradient(const kiln__node *mm);

/* Whether the backward rule of n, an activation that reads its input (GELU, SiLU, leaky ReLU)
 * or its output (ReLU, whose gradient needs only the sign: its input's will do), records that
 * input again instead of reading a value of the forward pass: where it is a batch norm's
 * application in
 * training whose inputs are in memory anyway (x, weight and mean, which the norm's own gradient
 * reads; its inverse deviation, which a kernel of its own writes; a bias that is a persistent
 * tensor), so that it need not be kept from the forward pass (the planner fuses the second
 * application into the kernel that reads it). */
bool kiln__recomputes_input(const kiln__node *n);
/* The activation's input for its rule: recorded again where kiln__recomputes_input, else n's. */
kiln_tensor *kiln__activation_input(const kiln__node *n);
/* Whether n's own gradient reads its output (ops.def: saves 8; not a ReLU that
 * kiln__recomputes_input), so that the output is kept to the backward pass. */
bool kiln__keeps_output(const kiln__node *n);
/* Rows each block of the moments kernel sums, at least: 128, a TMA data gradient's tile, so that
 * one can write a block's sums in the kernel's stead (plan_conv.c, kiln__dgrad_moments) */
#define KILN__MOMENTS_ROWS 128
#define KILN__MAX_GRID_Y 65535 /* CUDA's limit on a grid's second dimension */

/* A custom op (include/kiln_custom.h, core/custom.c): the user's options, with its own copies of
 * the strings; a node of the op names it by id, its index in ctx->customs. */
struct kiln_custom_op {
  kiln_ctx *ctx;
  int id;
  kiln_custom_op_options o; /* name, source and entry point at the copies */
  char *name, *source, *entry;
  int max_block;     /* o.max_block, 0 made 256 */
  uint32_t smem_max; /* dynamic shared memory a block may ask for (set by the engine) */
};
#define KILN__CUSTOM_BLOCK 256     /* max_block when the options give 0 */
#define KILN__CUSTOM_NAME_MAX 40   /* characters of a custom op's name */
#define KILN__CUSTOM_ENTRY_MAX 120 /* and of its entry point's */
/* A custom op of o for ctx, checked and copied (errors name kiln_custom_op_new); not yet in the
 * context's list. */
kiln_custom_op *kiln__custom_create(kiln_ctx *ctx, const kiln_custom_op_options *o);
/* Adds op to its context's list (its id); false, with the error set, out of host memory. */
bool kiln__custom_register(kiln_custom_op *op);
void kiln__custom_destroy(kiln_custom_op *op); /* one that is not in the list */
void kiln__customs_free(kiln_ctx *ctx);
/* The op of a custom node of ctx's trace. */
const kiln_custom_op *kiln__custom_of(const kiln_ctx *ctx, const kiln__node *n);

/* Records an in-place update of persistent tensors. */
kiln__node *kiln__update(kiln__op op, const char *fn, int nin, kiln_tensor *const *in);
/* The node that produced t, when t is an op's output of this step's trace; else NULL. */
kiln__node *kiln__producer(const kiln_tensor *t);

uint64_t kiln__rng_next(kiln_ctx *ctx);  /* the context's host RNG (splitmix64) */
double kiln__rng_uniform(kiln_ctx *ctx); /* [0, 1) */

#endif
