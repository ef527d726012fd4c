/*
 * fusion.h: what the planner, code generator and executor share. A flush is planned into groups,
 * each one launch: a chain of elementwise nodes over one iteration space, a reduction with the
 * elementwise nodes that produce its input computed inside it, a matrix product with a bias and
 * activation epilogue, an in-place update, or a library call. With fusion off every node is its
 * own group.
 */
#ifndef KILN_FUSION_H
#define KILN_FUSION_H

#include "../core/internal.h"
#include "kargs.h"

/* A growable string for generated source. */
typedef struct kiln__sb {
  char *s;
  size_t n, cap;
  bool oom;
} kiln__sb;
void kiln__sb_printf(kiln__sb *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void kiln__sb_put(kiln__sb *b, const void *p, size_t n); /* raw bytes */
void kiln__sb_free(kiln__sb *b);

#define KILN__MAX_GROUP 32 /* nodes in one generated kernel */

/* The elementwise part of a kernel: nodes over one iteration space, in trace order. A node's
 * inputs are earlier nodes' outputs (kept in registers) or operands read from memory; store[j]
 * says node j's output is written. */
typedef struct kiln__ew_prog {
  int n;
  const kiln__node *nodes[KILN__MAX_GROUP];
  bool store[KILN__MAX_GROUP];
  int ndim;
  const int64_t *shape;
  /* a row program's views of per-row values read as the values themselves: alias[k][0] is read
   * as alias[k][1] */
  int nalias;
  const kiln_tensor *alias[KILN__MAX_GROUP * 2][2];
} kiln__ew_prog;

typedef struct kiln__group {
  kiln__kind kind;
  int32_t node; /* the group's main node: the reduction, product, update or library call */
  int first, n; /* members: plan->members[first .. first + n), in trace order */
  int sub;      /* concat: which input this copy moves */
  /* a matrix product's cuBLASLt epilogue (a cublasLtEpilogue_t; 0: plain cuBLAS). Forward:
   * D = act(A B + bias), the ReLU bit mask kept on aux's storage or the GELU input written to aux.
   * Backward: D = A B times act'(aux) and bias = the column sums of D; or bias = the row sums of
   * A (BGRADB, the bias gradient beside a weight gradient). */
  int epi;
  const kiln_tensor *bias;
  const kiln_tensor *aux;
  const kiln_tensor *out; /* what the product group writes */
  /* a reduction over the last axis of full (one block per row) that later nodes joined */
  const kiln_tensor *full;
  bool rows;
  /* filled by code generation */
  kiln__kernel *k;
  kiln__kargs args;
  /* where the kernel's float and 64-bit attribute slots come from: node and attribute index */
  const kiln__node *fsrc[KILN__KMAX_F], *usrc[KILN__KMAX_U];
  int8_t fk[KILN__KMAX_F], uk[KILN__KMAX_U];
  int32_t fi[KILN__KMAX_F], ui[KILN__KMAX_U]; /* the same as trace indices (-1: unused) */
  unsigned grid, block, grid_y;               /* grid_y: tensors of a multi-tensor update (0: 1) */
  uint64_t bytes_read, bytes_written;
  char name[96];
} kiln__group;

typedef struct kiln__plan {
  int32_t first, last; /* trace nodes [first, last) */
  kiln__group *g;
  int ng, capg;
  int32_t *members;
  int nm, capm;
  int32_t *group_of; /* per node (index - first): its group, -1 for views */
  bool *store;       /* per node: its output must be written to memory */
  int32_t *claim;    /* per node: the node that does its work (a product's BGRADB epilogue for a
                      * sum; for a dropped assignment, the producer that writes through), or -1 */
  const kiln_tensor **write_to; /* per node: the persistent buffer its output is written to */
} kiln__plan;

/* One group's block of the step values: the float and 64-bit attributes its kernel reads. */
typedef struct kiln__stepvals {
  float f[KILN__KMAX_F];
  unsigned long long u[KILN__KMAX_U];
} kiln__stepvals;

/* How many float, int and 64-bit attribute slots an op expression uses ($f0.., $i0.., $u0..). */
void kiln__attr_use(const char *expr, int *nf, int *ni, int *nu);

/* The per-row value that x, a chain of reshapes between row shapes of F or an expansion of a
 * kept-dim row value over F, views; NULL when x is no such view. */
const kiln_tensor *kiln__row_alias(const kiln_ctx *ctx, const kiln_tensor *F, const kiln_tensor *x);

/* What a cuBLASLt epilogue does, like "bias+relu+mask"; NULL for 0. */
const char *kiln__epilogue_name(int epi);
/* Whether an epilogue writes a GELU input into aux (forward), or a bias gradient. */
bool kiln__epilogue_writes_aux(int epi);
bool kiln__epilogue_bgrad(int epi);
/* Whether an epilogue writes (RELU_AUX) or reads (DRELU) a ReLU bit mask, and its size for y. */
bool kiln__epilogue_writes_mask(int epi);
bool kiln__epilogue_reads_mask(int epi);
size_t kiln__relu_mask_bytes(const kiln_tensor *y);
/* Whether cuBLASLt has an algorithm for A B (2-D) with epilogue epi; true without a GPU. */
bool kiln__lt_usable(kiln_ctx *ctx, const kiln_tensor *A, const kiln_tensor *B, int epi);

/* Plans trace nodes [first, last); fusion off gives one group per node. */
bool kiln__plan_build(kiln_ctx *ctx, int32_t first, int32_t last, bool fuse, kiln__plan *p);
void kiln__plan_free(kiln__plan *p);

/* Code generation: source and kernel arguments for a group; false with the context's error set. */
bool kiln__gen_ew(kiln_ctx *ctx, const kiln__ew_prog *p, kiln__group *g, const char *comment);
/* A reduction node r whose input is computed by prologue (NULL or empty: read from memory). */
bool kiln__gen_reduce(kiln_ctx *ctx, const kiln__ew_prog *prologue, const kiln__node *r,
                      kiln__group *g, const char *comment);
/* One launch of the same update over T tensors (nodes of one op and the same attributes). */
/* A row program: reductions over the last axis of F, one block per row, with the elementwise
 * nodes over F that feed them or read their results (recomputed in each pass over the row) and
 * nodes that compute one value per row. */
bool kiln__gen_rows(kiln_ctx *ctx, const kiln__ew_prog *p, const kiln_tensor *F, kiln__group *g,
                    const char *comment);
bool kiln__gen_update_multi(kiln_ctx *ctx, const kiln__node *const *nodes, int T, kiln__group *g,
                            const char *comment);
bool kiln__gen_index_select(kiln_ctx *ctx, const kiln__node *n, kiln__group *g,
                            const char *comment);
void *kiln__data_ptr(const kiln_tensor *t); /* device address of t's first element */

/* Step values: every group's attributes from the trace into host[0 .. ng); then every group
 * launched in order. */
void kiln__fill_values(const kiln_ctx *ctx, const kiln__plan *p, kiln__stepvals *host);
/* Fills the step values from the trace into dev (one block a group, copied on the stream) and
 * points every group's kernel at its block. */
bool kiln__upload_values(kiln_ctx *ctx, kiln__plan *p, void *dev);
bool kiln__run_groups(kiln_ctx *ctx, kiln__plan *p);
/* Points the outputs that write through at their persistent buffers. */
void kiln__bind_write_through(kiln_ctx *ctx, const kiln__plan *p);
/* Allocates what the plan writes (that has no memory yet), generates and compiles its kernels. */
bool kiln__prepare_plan(kiln_ctx *ctx, kiln__plan *p);
/* Fills kiln_stats' last_flush (and the totals) for a plan that ran. */
void kiln__flush_stats(kiln_ctx *ctx, const kiln__plan *p, const kiln_exec_stats *before);

#endif
