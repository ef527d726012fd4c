/*
 * optable.c: the op table of ops.def as data the planner, code generator and autograd read.
 */
#include "internal.h"

const kiln__op_info kiln__ops[KILN__OP_COUNT] = {
#define X(id, nm, n, k, e, s, g, sv)                                                               \
  [KILN__OP_##id] = {.name = nm,                                                                   \
                     .nin = n,                                                                     \
                     .kind = KILN__KIND_##k,                                                       \
                     .expr = e,                                                                    \
                     .stores = s,                                                                  \
                     .grad = kiln__grad_##g,                                                       \
                     .saves = sv},
#include "ops.def"
#undef X
};
