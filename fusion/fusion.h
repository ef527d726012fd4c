/*
 * fusion.h: what the planner, code generator and executor share. A group is what one launch
 * runs: one or more trace nodes. In this version the planner makes one group per node (the
 * unfused, node-by-node mode); the interfaces are the ones fusion builds on.
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
void kiln__sb_free(kiln__sb *b);

typedef struct kiln__group {
  kiln__kind kind;
  int32_t node; /* the trace node it covers */
  kiln__kernel *k;
  kiln__kargs args;
  unsigned grid, block;
} kiln__group;

/* An elementwise launch: op over the iteration space shape, reading in[], writing out (EW) or
 * the inputs its op stores (UPDATE). out may be a strided view (concat writes into slices). */
typedef struct kiln__ew_spec {
  kiln__op op;
  int nin;
  kiln_tensor *const *in;
  const kiln_tensor *out;
  const kiln__node *attrs; /* f, i, u */
  int ndim;
  const int64_t *shape;
} kiln__ew_spec;

/* Generate source and kernel arguments; false with the context's error set on failure. */
bool kiln__gen_ew(kiln_ctx *ctx, const kiln__ew_spec *s, kiln__group *g, const char *comment);
bool kiln__gen_reduce(kiln_ctx *ctx, const kiln__node *n, kiln__group *g, const char *comment);
bool kiln__gen_index_select(kiln_ctx *ctx, const kiln__node *n, kiln__group *g,
                            const char *comment);
void *kiln__data_ptr(const kiln_tensor *t); /* device address of t's first element */

#endif
