/*
 * helpers.h: what the Criterion tests share: contexts (GPU tests skip, saying why, when there is
 * no device), random data that is never all zeros, host copies and float64 comparisons.
 */
#ifndef KILN_TEST_HELPERS_H
#define KILN_TEST_HELPERS_H

#include <criterion/criterion.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "kiln.h"

/* A GPU context, or the test is skipped with the reason. TF32 is off: references are float64. */
#define TH_GPU_CTX(ctx)                                                                            \
  kiln_ctx *ctx = kiln_ctx_new(NULL);                                                              \
  cr_assert_not_null(ctx);                                                                         \
  if (!kiln_ctx_has_gpu(ctx)) {                                                                    \
    char th_reason_[1100];                                                                         \
    snprintf(th_reason_, sizeof th_reason_, "needs a GPU: %s",                                     \
             kiln_ctx_error(ctx) ? kiln_ctx_error(ctx) : "none");                                  \
    kiln_ctx_free(ctx);                                                                            \
    cr_skip_test("%s", th_reason_);                                                                \
  }                                                                                                \
  kiln_set_tf32(ctx, 0)

/* The same with step graphs off: for tests that read values inside open steps (eager semantics;
 * test_gpu_graph.c tests graph mode). */
#define TH_GPU_CTX_EAGER(ctx)                                                                      \
  TH_GPU_CTX(ctx);                                                                                 \
  kiln_set_graphs(ctx, 0)

/* A context that records and plans without a GPU. */
kiln_ctx *th_cpu_ctx(void);

/* Uniform values in [lo, hi) from a fixed seed (splitmix64). */
void th_fill(float *p, int64_t n, uint64_t seed, float lo, float hi);
/* A persistent f32 tensor of random values in [lo, hi); *host (if given) gets a malloc'd copy. */
kiln_tensor *th_rand(kiln_ctx *ctx, kiln_shape s, uint64_t seed, float lo, float hi, float **host);
/* The tensor's values, read to a malloc'd host buffer (asserts on failure). */
float *th_read(kiln_tensor *t);
int32_t *th_read_i32(kiln_tensor *t);
/* Asserts |got - want| <= atol + rtol * |want| everywhere, naming the first bad element. */
void th_assert_close(const float *got, const double *want, int64_t n, double atol, double rtol,
                     const char *what);
/* The benchmark MLP: 784-512-512-10 with ReLU, SGD with Nesterov momentum 0.9 and lr 0.05. */
typedef struct th_mlp {
  kiln_params *params;
  kiln_linear l1, l2, l3;
  kiln_optim *opt;
} th_mlp;
void th_mlp_init(kiln_ctx *ctx, th_mlp *m);
kiln_tensor *th_mlp_logits(const th_mlp *m, kiln_tensor *x); /* (B, 10) */
/* Records one training step on (x, y): forward, loss, backward, update; returns the loss. */
kiln_tensor *th_mlp_record_step(th_mlp *m, kiln_tensor *x, kiln_tensor *y);
void th_mlp_free(th_mlp *m);

/* Asserts the context has no error (and prints it if it has). */
void th_assert_ok(kiln_ctx *ctx);

#endif
