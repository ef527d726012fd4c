/*
 * inspect.h: what the no-GPU tests read of a context that records without running: its trace
 * (node by node, op names, counts), tensors' shapes and strides, and its sticky error; persistent
 * operands made in one line and freed together; and a small MLP to record steps with.
 */
#ifndef KILN_TEST_INSPECT_H
#define KILN_TEST_INSPECT_H

#include "fusion/fusion.h"
#include "helpers.h"
#include "internal.h"

/* ---------------------------------------------------------------- the trace */

/* The number of nodes in the context's trace. */
int32_t th_tlen(const kiln_ctx *ctx);
/* Node i of the trace; a negative i counts from the end. */
kiln__node *th_node(kiln_ctx *ctx, int32_t i);
const char *th_op_name(kiln__op op);
/* How many nodes of op the trace holds in [first, last). */
int th_count_ops(kiln_ctx *ctx, int32_t first, int32_t last, kiln__op op);

/* Asserts that the trace holds exactly the ops given from node first to its end. */
void th_assert_ops_from(kiln_ctx *ctx, int32_t first, int n, const kiln__op *want);
#define TH_ASSERT_OPS_FROM(ctx, first, ...)                                                        \
  th_assert_ops_from((ctx), (first), (int)(sizeof((kiln__op[]){__VA_ARGS__}) / sizeof(kiln__op)),  \
                     (kiln__op[]){__VA_ARGS__})

/* ---------------------------------------------------------------- tensors */

void th_assert_shape(const kiln_tensor *t, kiln_shape want);
void th_assert_strides(const kiln_tensor *t, int n, const int64_t *want);
#define TH_ASSERT_STRIDES(t, ...)                                                                  \
  th_assert_strides((t), (int)(sizeof((int64_t[]){__VA_ARGS__}) / sizeof(int64_t)),                \
                    (int64_t[]){__VA_ARGS__})

/* A persistent tensor of zeros (asserts it was made); the caller frees it or hands it on. */
kiln_tensor *th_new(kiln_ctx *ctx, kiln_dtype dt, kiln_shape s);
/* Scratch operands: persistent f32 or i32 zeros, or f32 zeros that require grad. Each also goes
 * on the test's scratch list, so that a test making many operands in line frees them all at its
 * end with th_free_scratch(). Do not free a scratch tensor yourself or give it to a parameter
 * list (which would own it too): use th_new for those. */
kiln_tensor *th_f32(kiln_ctx *ctx, kiln_shape s);
kiln_tensor *th_i32(kiln_ctx *ctx, kiln_shape s);
kiln_tensor *th_param(kiln_ctx *ctx, kiln_shape s);
void th_free_scratch(void);

kiln_tensor *th_sum_all(kiln_tensor *t);

/* ---------------------------------------------------------------- errors */

/* Asserts the context's sticky error: its status and that its message holds every substring
 * (the list ends with NULL). */
void th_assert_error(kiln_ctx *ctx, kiln_status want, ...);
#define TH_ASSERT_ERROR(ctx, status, ...)                                                          \
  th_assert_error((ctx), (status), __VA_ARGS__, (const char *)NULL)

/* Asserts that expr (an op) fails: it returns NULL, records nothing and sets the given status
 * with a message holding every substring. Then clears the error. */
#define TH_EXPECT_FAIL(ctx, expr, status, ...)                                                     \
  do {                                                                                             \
    int32_t n0_ = th_tlen(ctx);                                                                    \
    kiln_tensor *r_ = (expr);                                                                      \
    cr_assert_null(r_, "%s should have failed", #expr);                                            \
    cr_assert_eq(th_tlen(ctx), n0_, "%s recorded %d nodes while failing", #expr,                   \
                 th_tlen(ctx) - n0_);                                                              \
    TH_ASSERT_ERROR(ctx, status, __VA_ARGS__);                                                     \
    kiln_ctx_clear_error(ctx);                                                                     \
  } while (0)

/* ---------------------------------------------------------------- a small MLP */

/* dims[0] -> dims[1] -> ... -> dims[nl], ReLU between layers, with its input and labels as
 * persistent tensors (zeros). */
#define TH_NET_MAX 4
typedef struct th_net {
  kiln_ctx *ctx;
  kiln_params *params;
  kiln_linear l[TH_NET_MAX];
  int nl;
  kiln_tensor *x, *y; /* (batch, dims[0]) f32, (batch) i32 */
} th_net;

void th_net_init(th_net *m, kiln_ctx *ctx, int64_t batch, int nl, const int64_t *dims);
kiln_tensor *th_net_logits(th_net *m);
/* The mean cross-entropy of the logits against y (asserted not NULL). */
kiln_tensor *th_net_loss(th_net *m);
/* Records the forward pass and kiln_backward, so that every parameter has a gradient. */
void th_net_backward(th_net *m);
void th_net_free(th_net *m);

/* ---------------------------------------------------------------- programs */

/* The backward pass of sum(y) (cast to f32) recorded, then the open step's program built into pg
 * (its kernels rendered and compiled: NVRTC); asserts each. */
void th_backward_program(kiln_ctx *ctx, kiln_tensor *y, kiln__program *pg, const char *what);
/* Frees pg, ends the step (asserting it ends cleanly), frees the scratch operands and ctx. */
void th_finish_program(kiln_ctx *ctx, kiln__program *pg, const char *what);

#endif
