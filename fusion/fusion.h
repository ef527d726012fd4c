/*
 * fusion.h: the stages of fusion/ and the data each hands to the next (docs/design.md has the
 * picture):
 *
 *   trace nodes ──plan.c──▶ kiln__plan     groups: which nodes share a launch, what is written
 *               ──lower.c─▶ kiln__spec     per group: the kernel to render, or the BLAS call
 *               ──render.c▶ kiln__rendered per kernel: CUDA C source, name, launch shape, and
 *                                          the argument plan (which tensor goes where); render.c
 *                                          hands each spec to its kernel family's file (render.h)
 *               ──compile.c▶ kiln__kernel  NVRTC, with a memory and a disk cache
 *               ──exec.c──▶ launches       memory, argument binding, step values, launch
 *               ──graph.c─▶ step graphs    the same launches captured once and replayed
 *
 * Each stage reads only what the one before it produced: the planner asks the BLAS backend
 * (blas.h) what it supports, the renderer only renders, compiling happens in one place.
 * engine.c holds the entry points of engine.h (what the runtime calls) and fusion's state: it
 * hands an eager flush to exec.c and a whole step to graph.c. graph.c runs its programs through
 * exec.c; exec.c calls neither.
 */
#ifndef KILN_FUSION_H
#define KILN_FUSION_H

#include "../core/internal.h"
#include "blas.h"
#include "device/kargs.cuh"
#include "engine.h"
#include "tmap.h"

_Static_assert(KILN__KMAX_DIMS == KILN_MAX_DIMS, "kiln__kargs holds KILN_MAX_DIMS dims");

#define KILN__MAX_GROUP 32  /* nodes in one generated kernel */
#define KILN__MAX_GRAPHS 16 /* step graphs kept, least recently used out */
/* Threads per block of elementwise, update and column kernels, the most a row kernel takes, and
 * every kernel's __launch_bounds__: 8 warps, enough to hide memory latency with several blocks
 * per SM, few enough that a block reduction (reduce.cuh) combines its warps in one warp. */
#define KILN__BLOCK 256
/* The implicit weight gradient's split-K workspace: partial tiles, and one counter a tile. */
#define KILN__CONV_WS_BYTES ((size_t)32 << 20)
#define KILN__CONV_COUNTERS 4096

/* ---------------------------------------------------------------- planner (plan.c) */

typedef enum kiln__implicit {
  KILN__IMPLICIT_NONE,
  KILN__IMPLICIT_DGRAD,
  KILN__IMPLICIT_FPROP,
  KILN__IMPLICIT_WGRAD,
} kiln__implicit;

typedef struct kiln__group {
  kiln__kind kind;
  int32_t node; /* the group's main node: the reduction, product, update or library call */
  int first, n; /* members: plan->members[first .. first + n), in trace order */
  int sub;      /* concat: which input this copy moves */
  /* a matrix product's epilogue (blas.h): the bias read or the bias gradient written, aux the
   * ReLU output whose bit mask is written or read, or the GELU input written or read */
  kiln__epi epi;
  const kiln_tensor *bias;
  const kiln_tensor *aux;
  const kiln_tensor *out; /* what the product group writes */
  /* a row program: reductions over the last axis of full (one block per row) that later nodes
   * joined; its views of per-row values, read as the values, are aliases
   * plan->alias[alias_first .. alias_first + nalias) */
  const kiln_tensor *full;
  bool rows;
  int alias_first, nalias;
  /* a convolution's product as an implicit GEMM, the column matrix never written:
   *   DGRAD: a col2im group whose first member is the product dY Wk it sums (device/igemm.cuh);
   *   FPROP: im2col then the product cols Wk^T, members in that order (device/conv.cuh);
   *   WGRAD: the product cols^T dY alone, its columns gathered from the image (device/conv.cuh).
   * window: FPROP and WGRAD's im2col node, whose input (the image) the kernel reads; wgmma:
   * DGRAD on Hopper's wgmma as a forward product of dY (device/conv.cuh) */
  kiln__implicit implicit;
  int32_t window;
  bool wgmma;
  /* WGRAD: the weight's f32 gradient buffer (CO, CI, KH, KW) it writes in place of its bf16
   * result, the cast and assignment that did so its second and third members
   * (kiln__wgrad_into_grad) */
  const kiln_tensor *grad;
  /* its last member is a moments node over the group's result, each block's 128 rows summed in
   * the group's kernel: batch norm's gradient sums (mode 1) in a DGRAD on the TMA kernel with a
   * staged epilogue (kiln__dgrad_moments), or its statistics (mode 0) in a max pool's
   * (kiln__pool_moments) */
  bool moments;
  /* a max pool's gradient (g->node, the last member) whose first `prologue` members, the
   * elementwise run that computes its dy, run where it reads dy (kiln__pool_grad_prologue); a max
   * pool's, the run that computes its image (kiln__pool_fwd_prologue); or a WGRAD's, the run
   * that computes its dY (kiln__phase_few_prologue), its product after them */
  int prologue;
  /* EW: casts of parameters, each over its own shape, in one multi-tensor launch (plan.c's
   * batch_casts; KILN_CAST_BATCH=0: not) */
  bool batch;
} kiln__group;

/* The most casts one multi-tensor cast takes: two pointers each. */
#define KILN__MAX_CASTS (KILN__KMAX_UPDATE / 2)
/* Whether cast input x (of the cast's shape, not dense) reads, for each index of its first axis, a
 * dense block of the other axes' values in an order of its own: its first stride the block's size
 * and the others, sorted, a dense block's (a filter's (O, I, KH, KW) read as (O, KH, KW, I), and
 * back); *block its size, at most the 12,288 values a kernel's shared memory takes as floats
 * (render_ew.c). */
bool kiln__permuted_blocks(const kiln_tensor *x, int64_t *block);

/* In a row program, the view `view` of a per-row value is read as `value` itself. */
typedef struct kiln__alias {
  const kiln_tensor *view, *value;
} kiln__alias;

typedef struct kiln__plan {
  int32_t first, last; /* trace nodes [first, last) */
  kiln__group *g;
  int ng, capg;
  int32_t *members;
  int nm, capm;
  kiln__alias *alias;
  int nalias, capalias;
  int32_t *group_of; /* per node (index - first): its group, -1 for views */
  bool *store;       /* per node: its output must be written to memory */
  int32_t *claim;    /* per node: the node that does its work (a product's BGRADB epilogue for a
                      * sum; for a dropped assignment, the producer that writes through), or -1 */
  const kiln_tensor **write_to; /* per node: the persistent buffer its output is written to */
  int *readers;                 /* per node: how many inputs of the flush's nodes it is */
  int32_t *window; /* per node: the im2col whose columns an implicit product gathers, or -1 */
} kiln__plan;

/* Plans trace nodes [first, last) as a list of named phases; fusion off gives one group per
 * node. With KILN_DEBUG=plan the groups are printed, with KILN_DEBUG=verify (and in debug
 * builds) the plan is verified. */
bool kiln__plan_build(kiln_ctx *ctx, int32_t first, int32_t last, bool fuse, kiln__plan *p);
/* For the planner's files (plan.c, plan_conv.c): the node of the flush whose output is exactly t,
 * or -1. */
static inline int32_t kiln__plan_producer(const kiln_ctx *ctx, const kiln__plan *p,
                                          const kiln_tensor *t) {
  int32_t i = t->node;
  if (t->persistent || i < p->first || i >= p->last) return -1;
  return ctx->trace.nodes[i].out == t ? i : -1;
}
/* The implicit convolution products (plan_conv.c): col2im node c's product, run in col2im's
 * group, or -1; whether im2col node c and the products that read its columns may run implicit
 * (the forward product *f and the weight gradient *w, or -1), the caller asking that the forward
 * product takes no epilogue. */
int32_t kiln__implicit_dgrad(const kiln_ctx *ctx, const kiln__plan *p, int32_t c);
/* The planner's fusions into a group's kernel (plan_conv.c), each asked once the caller has
 * checked that the kernel has the operands for node i: whether moments node i can join the
 * implicit data gradient group g as its last member (g->moments); ... */
bool kiln__dgrad_moments(const kiln_ctx *ctx, const kiln__plan *p, const kiln__group *g, int32_t i);
/* ... whether moments node i (mode 0) can join the max pool group g, whose output it sums
 * (g->moments); ... */
bool kiln__pool_moments(const kiln_ctx *ctx, const kiln__plan *p, const kiln__group *g, int32_t i);
/* ... whether moments node i (mode 1) can join the window group g (a col2im, or max pooling's
 * gradient a block of pixels a thread) whose epilogue computes its g (g->moments); ... */
bool kiln__window_moments(const kiln_ctx *ctx, const kiln__plan *p, const kiln__group *g,
                          int32_t i);
/* ... whether the open elementwise run g can become the prologue of max pool gradient node i; ...
 */
bool kiln__pool_grad_prologue(const kiln_ctx *ctx, const kiln__plan *p, const kiln__group *g,
                              int32_t i);
/* ... or of max pool node i. */
bool kiln__pool_fwd_prologue(const kiln_ctx *ctx, const kiln__plan *p, const kiln__group *g,
                             int32_t i);
/* Whether elementwise group g can compute its last value where one reader outside it reads it, as
 * that reader's prologue (the value never written): each of its values read only inside the run
 * (the last once, by that reader), all of the last's shape, dense, its channels (last dim) four
 * at a time; its inputs from outside dense like it, one value a channel or one in all, float; no
 * op reading coordinates. */
bool kiln__prologue_run(const kiln_ctx *ctx, const kiln__plan *p, const kiln__group *g);
/* Whether node nd's backward rule reads its input q from the forward pass, so that the value is
 * written (the op table's saves, unless the rule records a batch norm's application again:
 * kiln__recomputes_input); its output likewise: kiln__keeps_output (plan.c's stores). */
bool kiln__rule_reads_input(const kiln__node *nd, int q);
/* A strided convolution's data gradient one phase of dX at a time (conv_tma.cuh's
 * kiln_conv_dgrad_tma_phase; KILN_CONV_TMA_PHASES=1): whether col2im node cn (dX (N, H, W, CI)
 * from the columns of dY (N, OH, OW, .) with co channels) takes it: bf16 checked by the caller,
 * a stride above 1 in some direction (8 at most), dilation 1, H = OH SH and W = OW SW (a phase's
 * pixels are dY's), co and CI multiples of 64, and every tap's dY offset within a copy's reach. */
bool kiln__dgrad_phases(const kiln__node *cn, int64_t co);
/* Along one direction (window k, stride s, padding p): the least dY offset (a + d for dX pixel
 * s a + r) of any phase's taps, its greatest in *most; and the taps of phase r. */
int64_t kiln__phase_corner(int64_t k, int64_t s, int64_t p, int64_t *most);
int kiln__phase_taps(int64_t k, int64_t s, int64_t p, int64_t r);
/* Whether col2im node cn's implicit data gradient (dt, co output and ci input channels) runs on
 * wgmma (device/conv.cuh or conv_tma.cuh; strided, by phases: kiln__dgrad_phases) rather than
 * mma.sync. */
bool kiln__dgrad_on_wgmma(const kiln_ctx *ctx, const kiln__node *cn, kiln_dtype dt, int64_t co,
                          int64_t ci);
bool kiln__implicit_conv(kiln_ctx *ctx, const kiln__plan *p, int32_t c, int32_t *f, int32_t *w);
/* Whether node i, which the implicit GEMMs take (p->window), is a forward product (its columns its
 * first operand), not a weight gradient. */
bool kiln__implicit_fprop(const kiln_ctx *ctx, const kiln__plan *p, int32_t i);
/* (KILN_CONV_DIRECT_EPI=0 turns it off.) The unary elementwise chain that the
 * direct forward product of group g (conv_direct.cuh: a thread an output pixel, its channels in
 * registers) applies before it stores (air's whitening conv and its GELU): nodes without
 * attributes or coordinates, the first reading the product's result as the image, each the only
 * reader of the one before, the last's value bf16 (stored in the product's stead). Returns how
 * many nodes (at most `most`) in take[]; they join the group after the product. */
int kiln__direct_epilogue(const kiln_ctx *ctx, const kiln__plan *p, const kiln__group *g,
                          int32_t *take, int most);
/* The max pool that the forward product of group g pools in its epilogue: 2x2 windows at stride 2
 * over the product's image, its one reader, the pooled image bf16; the pool's window positions
 * too where its gradient reads them. On conv_few.cuh's halo tiles (KILN_CONV_FEW_POOL=1), or
 * on conv_tma.cuh's kernel with tiles of pairs of whole rows (KILN_CONV_TMA_POOL=1; both off until
 * they have run on a GPU) where kiln__conv_pool_rows takes the width. Returns the pool's node, or
 * -1; it joins the group after the product. */
int32_t kiln__conv_pool(const kiln_ctx *ctx, const kiln__plan *p, const kiln__group *g);
/* The moments node of batch norm's statistics (mode 0) over the result of forward product group g
 * (g alone) that the TMA-fed kernel's staged epilogue sums instead of a pass of its own, its
 * shift k a tensor the group does not compute (the running mean: kiln_batch_norm with
 * KILN_CONV_FPROP_MOMENTS, on); or -1. It joins the group last (g->moments). */
int32_t kiln__fprop_moments(const kiln_ctx *ctx, const kiln__plan *p, const kiln__group *g);
/* The pixels a TMA copy takes of an output row for kiln__conv_pool (ow: the product's width): a
 * power of two from 8 to 64 that holds the row's pooled columns, or 0 where none does. */
int kiln__conv_pool_rows(int64_t ow);
/* Whether implicit weight gradient w stores the weight's f32 gradient itself, taking the cast
 * and the assignment that turn its result into it (*cast, *assign) into its group (plan_conv.c;
 * KILN_CONV_WGRAD_INTO=1). */
bool kiln__wgrad_into_grad(const kiln_ctx *ctx, const kiln__plan *p, int32_t w, int32_t *cast,
                           int32_t *assign);
void kiln__plan_free(kiln__plan *p);
/* The planner's merges across the trace (plan_merge.c): the persistent tensor whose memory t
 * shows through views of the flush, or NULL; whether node j of the flush writes storage st (its
 * update's stored input, or the buffer its value is written through to); whether node i is a
 * cast a multi-tensor cast takes, and the casts one takes from node i on (at most
 * KILN__MAX_CASTS, into take[]); the sink phase. */
const kiln_tensor *kiln__param_root(const kiln_ctx *ctx, const kiln__plan *p, const kiln_tensor *t);
bool kiln__writes_storage(const kiln_ctx *ctx, const kiln__plan *p, int32_t j,
                          const kiln__storage *st);
bool kiln__batch_cast(const kiln_ctx *ctx, const kiln__plan *p, int32_t i);
int kiln__batch_casts(const kiln_ctx *ctx, const kiln__plan *p, int32_t i, int32_t *take);
bool kiln__phase_sink(kiln_ctx *ctx, kiln__plan *p, bool fuse);
/* The few-prologue phase: elementwise runs that conv_few.cuh's weight gradients compute as they
 * load dY (g->prologue of an implicit WGRAD). */
bool kiln__phase_few_prologue(kiln_ctx *ctx, kiln__plan *p, bool fuse);
/* The first broken invariant of a plan, written to why (NULL: none). */
const char *kiln__plan_verify(const kiln_ctx *ctx, const kiln__plan *p, char *why, size_t n);
/* "add* relu* mul | sum": each group's ops in order, '*' for values kept in registers, a
 * product's epilogue in brackets. */
void kiln__plan_describe(const kiln_ctx *ctx, const kiln__plan *p, kiln__sb *out);
/* The per-row value that x views (a chain of reshapes between row shapes of F or an expansion of
 * a kept-dim row value over F), or NULL. */
const kiln_tensor *kiln__row_alias(const kiln_ctx *ctx, const kiln_tensor *F, const kiln_tensor *x);

/* ---------------------------------------------------------------- lowering (lower.c) */

/* The elementwise part of a kernel: nodes over one iteration space, in trace order. A node's
 * inputs are earlier nodes' outputs (kept in registers) or operands read from memory; store[j]
 * says node j's output is written. */
typedef struct kiln__ew_prog {
  int n;
  const kiln__node *nodes[KILN__MAX_GROUP];
  bool store[KILN__MAX_GROUP];
  int ndim;
  const int64_t *shape;
  int nalias; /* a row program's views of per-row values, read as the values */
  const kiln__alias *alias;
} kiln__ew_prog;

typedef enum kiln__spec_kind {
  KILN__SPEC_EW,      /* an elementwise program (or one in-place update) */
  KILN__SPEC_REDUCE,  /* a reduction, its input computed by an elementwise prologue */
  KILN__SPEC_ROWS,    /* a row program */
  KILN__SPEC_UPDATES, /* one update over several tensors */
  KILN__SPEC_CASTS,   /* several casts, each over its own shape (ups: the cast nodes) */
  KILN__SPEC_GATHER,  /* rows picked by index */
  KILN__SPEC_WINDOW,  /* a sliding-window op over an image (im2col, col2im, pooling) */
  KILN__SPEC_CONV,    /* a convolution's product as an implicit GEMM (spec.conv says which) */
  KILN__SPEC_MOMENTS, /* batch norm's column sums, by blocks of rows */
  KILN__SPEC_AUGMENT, /* image augmentation: a translation and a flip per image */
  KILN__SPEC_CUSTOM,  /* a custom op's kernel (include/kiln_custom.h) */
  KILN__SPEC_BLAS,    /* a matrix product */
} kiln__spec_kind;

/* What one group runs, in the renderer's (or the BLAS backend's) terms. */
typedef struct kiln__spec {
  kiln__spec_kind kind;
  kiln__ew_prog prog;    /* EW, ROWS; REDUCE: the prologue (n may be 0) */
  const kiln__node *red; /* REDUCE: the reduction; GATHER: the index_select; WINDOW, CONV, MOMENTS,
                          * AUGMENT: the op (CONV: the col2im) */
  const kiln_tensor *full; /* ROWS: the iteration space whose last axis is reduced */
  int nups;                /* UPDATES, CASTS */
  const kiln__node *ups[KILN__KMAX_UPDATE];
  kiln__gemm gemm;     /* BLAS; CONV: the product (a, b and d set) */
  kiln__implicit conv; /* CONV: which product; red is col2im (DGRAD) or im2col (FPROP, WGRAD) */
  bool wgmma;          /* CONV, DGRAD: on wgmma (the group's) */
  const kiln__node *moments; /* CONV (DGRAD), WINDOW (a max pool): batch norm's sums it writes */
  const kiln_tensor *grad;   /* CONV (WGRAD): the f32 gradient it writes (kiln__group's grad) */
  /* WINDOW: the elementwise run computing the op's first input; CONV (WGRAD): the one computing
   * dY (n may be 0) */
  kiln__ew_prog pro;
  /* a concat input's copy into its slice of the output: a node and a view that lowering owns */
  kiln__node copy;
  kiln_tensor slice;
  char comment[1024]; /* "// trace nodes: #12 add [128,512] f32, ..." for the source */
} kiln__spec;

/* One spec per group of p (an array the caller frees); false when host memory runs out. */
bool kiln__lower(kiln_ctx *ctx, const kiln__plan *p, kiln__spec **specs);

/* ---------------------------------------------------------------- renderer (render.c) */

/* What the renderer needs of the device: launch grids are sized by its SM count. */
/* Whether the context's kernels launch as programmatic dependents: KILN_PDL=1 on sm_90 and up. */
static inline bool kiln__pdl_launch(const kiln_ctx *ctx) { return ctx->pdl && ctx->arch >= 90; }

typedef struct kiln__target {
  int num_sms;
  bool conv_warp_spec; /* the conv.cuh kernels warp-specialized (KILN_CONV_WS=1) */
  bool conv_tma;       /* conv_tma.cuh's products where they serve (KILN_CONV_TMA=0: off) */
  bool conv_staged;  /* TMA data gradients' epilogues through shared memory (KILN_CONV_STAGED=1) */
  bool conv_phases;  /* strided data gradients a phase at a time (KILN_CONV_TMA_PHASES=1) */
  bool im2col_lanes; /* im2col of 2 or 3 channels a tap a thread (KILN_IM2COL_LANES=1) */
  bool im2col_rows;  /* im2col of a few channels a row a thread (KILN_IM2COL_ROWS=0: off) */
  bool pool_grad_blocks; /* max pooling's gradient a block of pixels a thread (=0: off) */
  bool window_ahead;     /* window gradients' epilogue operands fetched before their own loads */
  bool conv_few; /* few-channel forward products from a halo tile (conv_few.cuh; KILN_CONV_FEW=0:
                    off) */
  /* their weight gradients from the same tiles (conv_few.cuh; KILN_CONV_FEW_WGRAD=0: not; only
   * with conv_few) */
  bool conv_few_wgrad;
  bool pdl; /* kernels begin with kiln_pdl_begin and launch as dependents (KILN_PDL=1, sm_90) */
  int conv_dgrad_bn;  /* TMA data gradients' widest tile (KILN_CONV_DGRAD_BN; 0: 256) */
  int conv_fprop_bn;  /* TMA forward products' widest tile, two blocks an SM (KILN_CONV_FPROP_BN) */
  bool conv_prefetch; /* TMA data gradients prefetch their epilogue's rows (KILN_CONV_PREFETCH=1) */
  int conv_dgrad_ws;  /* ... with warpgroups for their epilogue: KILN_CONV_DGRAD_WS, 1 or 2 rooms */
  int conv_hoist;     /* staged epilogues' rows loaded ahead: KILN_CONV_HOIST (ctx.c), 0-16 */
  bool conv_ahead;    /* cp.async products issue a short reduction at once (KILN_CONV_AHEAD=1) */
  bool cast_tiles;    /* casts through blocks in shared memory (KILN_CAST_TILES=0: off) */
  kiln_custom_op *const *customs; /* the context's custom ops, by id */
  int ncustom;
} kiln__target;

/* How the executor fills a kernel's argument: sizes, strides and int attributes are in args
 * already; ptr[k] is bound to tensor k's address, and float/64-bit attribute slot s comes from
 * attribute fk[s] (uk[s]) of node fsrc[s] (usrc[s]) of the trace, through the step values. */
typedef struct kiln__argplan {
  kiln__kargs args;
  int nptr;
  const kiln_tensor *ptr[KILN__KMAX_UPDATE];
  const kiln__node *fsrc[KILN__KMAX_F], *usrc[KILN__KMAX_U];
  int8_t fk[KILN__KMAX_F], uk[KILN__KMAX_U];
} kiln__argplan;

typedef struct kiln__rendered {
  char name[96];
  kiln__sb src; /* the kernel's CUDA C, after the prelude's #include */
  kiln__argplan arg;
  unsigned grid, block, grid_y; /* grid_y: tensors of a multi-tensor update (0: 1) */
  unsigned grid_z;              /* 0: 1 */
  unsigned smem;                /* bytes of dynamic shared memory */
  unsigned min_blocks; /* > 0: blocks an SM its launch bounds ask the registers to leave room for */
  bool sm90a;          /* compiled for sm_90a (wgmma): Hopper only */
  bool pdl; /* begins with kiln_pdl_begin: launched with programmatic stream serialization */
  /* with ws_slot > 0: the executor binds the split-K workspace (KILN__CONV_WS_BYTES of floats)
   * to a.ptr[ws_slot] and its tile counters (KILN__CONV_COUNTERS, zero between launches) to
   * a.ptr[ws_slot + 1] */
  int ws_slot;
  uint64_t bytes_read, bytes_written;
  int zero_slot;       /* with zero_bytes > 0: the operand the executor zeroes before the launch */
  uint64_t zero_bytes; /* (a scatter's output, which the kernel only adds to) */
  /* with ntmap > 0: the executor encodes tmap[0 .. ntmap) when it binds the arguments, copies
   * them to the device and binds their address to a.ptr[tma_slot] (conv_tma.cuh's kernels) */
  int ntmap, tma_slot;
  kiln__tmap_desc tmap[KILN__KMAX_TMAP];
} kiln__rendered;

/* Renders spec's kernel; false when host memory runs out (r->src.oom). The caller frees r->src. */
bool kiln__render(const kiln__target *t, const kiln__spec *spec, kiln__rendered *r);
/* A custom op's kernel: its name and source (render_custom.c), the same for every call of it. */
bool kiln__custom_source(const kiln_custom_op *op, kiln__rendered *r);

/* ---------------------------------------------------------------- compiler (compile.c) */

typedef struct kiln__kernel kiln__kernel; /* a loaded kernel: its CUfunction and library */
/* The embedded device files (the .cuh files of fusion/device, made into C by the build). */
typedef struct kiln__device_file {
  const char *name, *text;
} kiln__device_file;
extern const kiln__device_file kiln__device_files[];
extern const int kiln__device_nfiles;

/* A kernel to compile: its name and source, comment (for dumped sources), sm90a (the
 * arch-specific target: ctx's architecture must be 90), smem (the dynamic shared memory its
 * launches ask for); k receives the loaded kernel. */
typedef struct kiln__compile_req {
  const char *name, *source, *comment;
  bool sm90a;
  unsigned smem;
  kiln__kernel *k;
} kiln__compile_req;
/* Compiles every request's source (once per process, cached in memory and on disk) and loads it
 * when there is a GPU. The sources the caches lack are read from the disk cache or compiled by
 * NVRTC on a pool of threads (KILN_COMPILE_THREADS, default the host's processors), each source
 * once; loading and reporting stay on the calling thread. False on the first failure (in the
 * requests' order) with the error set. */
bool kiln__compile_all(kiln_ctx *ctx, int n, kiln__compile_req *r);
/* kiln__compile_all of one source: its kernel, or NULL with the error set. */
kiln__kernel *kiln__compile(kiln_ctx *ctx, const char *name, const char *source,
                            const char *comment, bool sm90a, unsigned smem);
const void *kiln__kernel_fn(const kiln__kernel *k); /* the cudaKernel_t to launch */
typedef struct kiln__kcache kiln__kcache;
kiln__kcache *kiln__kcache_new(void);
void kiln__kcache_free(kiln__kcache *c, bool has_gpu);

/* ---------------------------------------------------------------- executor (exec.c) */

/* One launch of a planned flush: a compiled kernel and its argument, or a BLAS call. */
typedef struct kiln__call {
  kiln__kernel *k; /* NULL: a BLAS call (spec.gemm) or nothing to run */
  kiln__argplan arg;
  int32_t fi[KILN__KMAX_F], ui[KILN__KMAX_U]; /* fsrc/usrc as trace indices (-1: unused) */
  unsigned grid, block, grid_y, grid_z, smem;
  int ws_slot;
  uint64_t bytes_read, bytes_written;
  int zero_slot; /* as kiln__rendered's */
  uint64_t zero_bytes;
  int ntmap, tma_slot; /* as kiln__rendered's */
  kiln__tmap_desc tmap[KILN__KMAX_TMAP];
  bool pdl; /* as kiln__rendered's */
  char name[96];
} kiln__call;

/* A flush made ready to run: plan, specs and calls (one of each per group). */
typedef struct kiln__program {
  kiln__plan plan;
  kiln__spec *spec;
  kiln__call *call;
} kiln__program;

/* A device buffer that grows (the allocator's block, cap bytes). */
typedef struct kiln__devbuf {
  void *p;
  size_t cap;
} kiln__devbuf;

/* One group's block of the step values: the float and 64-bit attributes its kernel reads. */
typedef struct kiln__stepvals {
  float f[KILN__KMAX_F];
  unsigned long long u[KILN__KMAX_U];
} kiln__stepvals;

/* Plans, lowers, renders and compiles trace nodes [first, last) (no memory, no launch). */
bool kiln__program_build(kiln_ctx *ctx, int32_t first, int32_t last, kiln__program *pg);
/* KILN_DEBUG=traffic: the bytes a program's kernels read and write by kernel family, largest
 * first, and the time they take at least at the H200's memory bandwidth (profile.c). */
void kiln__print_traffic(const kiln_ctx *ctx, const kiln__program *pg);
void kiln__program_free(kiln__program *pg);
/* Points the outputs that write through at their persistent buffers. */
void kiln__bind_write_through(kiln_ctx *ctx, const kiln__plan *p);
/* Fills every call's pointers from its tensors' (now allocated) memory, the split-K
 * workspace's (allocated at its first use) and its tensor maps' (encoded now, copied on the
 * stream into maps, grown to fit: a buffer that lives as long as the calls may run); false, with
 * the error set, when that fails. */
bool kiln__bind_args(kiln_ctx *ctx, kiln__program *pg, kiln__devbuf *maps);
/* Every group's attributes from the trace into host[0 .. ng). */
void kiln__fill_values(const kiln_ctx *ctx, const kiln__program *pg, kiln__stepvals *host);
/* Fills the step values from the trace into dev (one block a group, copied on the stream) and
 * points every call's argument at its block. */
bool kiln__upload_values(kiln_ctx *ctx, kiln__program *pg, void *dev);
/* How kiln__run_calls runs a program: as an eager flush, as a step graph's first run, or into
 * the graph being captured; records (CAPTURE only, else NULL) then gets, per group, how many
 * device records its captured nodes make (kiln__captured_records). A trace being recorded
 * hears of every eager and first-run launch. */
typedef enum kiln__run_how { KILN__RUN_EAGER, KILN__RUN_FIRST, KILN__RUN_CAPTURE } kiln__run_how;
/* Launches every call in order. */
bool kiln__run_calls(kiln_ctx *ctx, kiln__program *pg, kiln__run_how how, int32_t *records);
/* Runs a built program as an eager flush: device memory for what it writes, arguments bound,
 * step values uploaded (one buffer that eager flushes share), calls launched. False, with the
 * error set, on any failure; nothing is launched unless all the memory was had. */
bool kiln__program_run(kiln_ctx *ctx, kiln__program *pg);
/* Fills kiln_stats' last_flush (and the totals) for a program that ran. */
void kiln__flush_stats(kiln_ctx *ctx, const kiln__program *pg, const kiln_exec_stats *before);
/* The bytes of the bit mask a ReLU epilogue writes for y (a 2-D product's output). */
size_t kiln__relu_mask_bytes(const kiln_tensor *y);

/* ---------------------------------------------------------------- anomaly mode (anomaly.c) */

/* In anomaly mode (ctx->anomaly) a flush is planned unfused and run eagerly; kiln__run_calls
 * calls begin before its first launch, gate before each group (false, with the error set, when a
 * node already wrote NaN or Inf and the group updates a tensor in place), check after each group
 * (the scans of what its nodes wrote) and end after the last (the error, if any). */
typedef struct kiln__anomaly kiln__anomaly;
bool kiln__anomaly_kernel(kiln_ctx *ctx); /* compiles the check kernel (a no-GPU context too) */
bool kiln__anomaly_begin(kiln_ctx *ctx, const kiln__program *pg);
bool kiln__anomaly_gate(kiln_ctx *ctx, const kiln__program *pg, int k);
bool kiln__anomaly_check(kiln_ctx *ctx, const kiln__program *pg, int k);
bool kiln__anomaly_end(kiln_ctx *ctx, const kiln__program *pg);
void kiln__anomaly_free(kiln_ctx *ctx);

/* ---------------------------------------------------------------- traces (profile.c) */

/* The trace's id for group k of pg (ctx->prof set), described once a session from the step's
 * trace: kiln's name, kind, trace nodes, traffic, a product's FLOPs, the launch shape. */
uint32_t kiln__traced_group(kiln_ctx *ctx, const kiln__program *pg, int k);
/* Under capture, after a group's calls: the device records (kernels, copies, memsets) that the
 * nodes the capture gained since it had *seen make (*seen updated); -1 when that cannot be
 * told (the capture is no chain, or a node launches a graph of its own). */
int32_t kiln__captured_records(kiln_ctx *ctx, size_t *seen);

/* ---------------------------------------------------------------- step graphs (graph.c) */

typedef struct kiln__step_graph kiln__step_graph;
/* Runs the open step's whole trace through its step graph: captured on the first occurrence of
 * its signature, replayed after (kiln__engine_step). Without a GPU it plans and compiles the step
 * and makes its memory plan, for kiln_stats, and runs nothing. */
kiln_status kiln__graph_run(kiln_ctx *ctx);
/* Frees every cached step graph and its arena (their replays are over). */
void kiln__graphs_free(kiln_ctx *ctx);
/* The trace node that owns t's memory (its output is t, or t views it), or -1 (a persistent
 * tensor, or one of another trace). */
int32_t kiln__owner(const kiln_ctx *ctx, const kiln_tensor *t);

/* ---------------------------------------------------------------- fusion's state */

typedef struct kiln__fusion {
  kiln__kcache *kernels; /* compiled kernels, by source key (compile.c) */
  kiln__blas *blas;      /* handles, workspace, plans (blas.c); NULL without a GPU */
  void *step_values;     /* eager flushes' step values on the device (kiln__stepvals) */
  int step_values_cap;
  kiln__devbuf tmaps; /* eager flushes' tensor maps (conv_tma.cuh's kernels) */
  kiln__step_graph *graphs[KILN__MAX_GRAPHS];
  int ngraphs;
  /* the step graphs' arenas of intermediates, each shared by the graphs whose plans fit in it
   * (graph.c): one per graph at most, and one for a graph being captured */
  struct {
    void *ptr;
    size_t bytes;
    int refs;
  } arenas[KILN__MAX_GRAPHS + 1];
  int narenas;
  uint64_t graph_clock;      /* steps seen, for least-recently-used eviction */
  bool warned_signatures;    /* the warning about ever-new signatures was printed */
  bool drop_graphs;          /* graphs were turned off: free the cached ones at the next step */
  kiln__dev_error *err_dev;  /* the kernels' error record on the device */
  float *conv_ws;            /* split-K partial tiles of the implicit weight gradients */
  unsigned *conv_cnt;        /* their tile counters (zeroed once; every launch leaves them 0) */
  kiln__dev_error *err_host; /* its copy, fetched before synchronisations (pinned) */
  kiln__anomaly *anomaly;    /* anomaly mode's kernel and records, once it was used */
} kiln__fusion;

#endif
