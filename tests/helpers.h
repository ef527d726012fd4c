/*
 * helpers.h: what every Criterion test shares: contexts (GPU tests skip, saying why, when there is
 * no device) and their clean end (th_ctx_free), a seeded RNG and random data that is never all
 * zeros, host copies and float64 comparisons, the benchmark MLP, parameter snapshots, and
 * temporary directories and whole-file reads and writes.
 *
 * The no-GPU tests' trace inspection is in inspect.h, synthetic MNIST files in idx.h and the GPU
 * op tests' float64 host references in ref.h (ref_conv.h for the image ops).
 */
#ifndef KILN_TEST_HELPERS_H
#define KILN_TEST_HELPERS_H

#include <criterion/criterion.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "kiln.h"

/* ---------------------------------------------------------------- contexts */

/* A GPU context, or the test is skipped with the reason. TF32 is off: references are float64. */
#define TH_GPU_CTX(ctx)                                                                            \
  kiln_ctx *ctx = kiln_ctx_new(NULL);                                                              \
  cr_assert_not_null(ctx);                                                                         \
  if (!kiln_ctx_has_gpu(ctx)) {                                                                    \
    char th_reason_[1100];                                                                         \
    snprintf(th_reason_, sizeof th_reason_, "needs a GPU: %s",                                     \
             kiln_ctx_error(ctx) ? kiln_ctx_error(ctx) : "none");                                  \
    th_ctx_free(ctx);                                                                              \
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

/* Every test ends with this instead of kiln_ctx_free: it asserts that the context holds no
 * persistent tensors any more (the test freed its tensors, parameter lists, optimizers, data sets
 * and loaders; gradient buffers belong to their tensors), naming the ones left, then frees it. */
void th_ctx_free(kiln_ctx *ctx);

/* The context's error message, or "no error set": for failure messages. */
const char *th_err(kiln_ctx *ctx);

/* Asserts the context has no error (and prints it if it has). */
void th_assert_ok(kiln_ctx *ctx);

/* ---------------------------------------------------------------- random numbers */

/* splitmix64: one stream per state, the same numbers on every machine. */
typedef struct th_rng {
  uint64_t s;
} th_rng;
uint64_t th_rng_next(th_rng *r);
int th_rng_below(th_rng *r, int n);                /* [0, n) */
double th_rng_unit(th_rng *r);                     /* [0, 1), 53 bits */
bool th_rng_chance(th_rng *r, double p);           /* true with probability p */
float th_rng_range(th_rng *r, float lo, float hi); /* [lo, hi) */

/* Uniform values in [lo, hi) from a fixed seed (splitmix64). */
void th_fill(float *p, int64_t n, uint64_t seed, float lo, float hi);
/* A persistent f32 tensor of random values in [lo, hi); *host (if given) gets a malloc'd copy. */
kiln_tensor *th_rand(kiln_ctx *ctx, kiln_shape s, uint64_t seed, float lo, float hi, float **host);

/* ---------------------------------------------------------------- host copies */

/* The tensor's values, read to a malloc'd host buffer (asserts on failure). */
float *th_read(kiln_tensor *t);
int32_t *th_read_i32(kiln_tensor *t);
/* Every parameter's values, concatenated in the list's order (malloc'd); *n gets the count. */
float *th_params_values(kiln_params *p, int64_t *n);
/* Asserts |got - want| <= atol + rtol * |want| everywhere, naming the first bad element. */
void th_assert_close(const float *got, const double *want, int64_t n, double atol, double rtol,
                     const char *what);

/* ---------------------------------------------------------------- the benchmark MLP */

/* The benchmark MLP: 784-512-512-10 with ReLU, SGD with Nesterov momentum 0.9 and lr 0.05. */
typedef struct th_mlp {
  kiln_params *params;
  kiln_linear l1, l2, l3;
  kiln_optim *opt;
} th_mlp;
/* Under bf16 autocast: batch norm (training, weight gamma, no bias or running statistics) of x cast
 * to bf16, a ReLU, then ResNet's stem pool (3x3 at stride 2, padding 1) where k is NULL, else a
 * 3x3 convolution by k at stride 2, padding 1. */
kiln_tensor *th_bn_relu_then_stride2(kiln_tensor *x, kiln_tensor *gamma, kiln_tensor *k);

void th_mlp_init(kiln_ctx *ctx, th_mlp *m);
kiln_tensor *th_mlp_logits(const th_mlp *m, kiln_tensor *x); /* (B, 10) */
/* Records one training step on (x, y): forward, loss, backward, update; returns the loss. */
kiln_tensor *th_mlp_record_step(th_mlp *m, kiln_tensor *x, kiln_tensor *y);
void th_mlp_free(th_mlp *m);

/* ---------------------------------------------------------------- files */

/* A fresh temporary directory /tmp/kiln-test-<what>-XXXXXX, written into buf. The directories a
 * test process made are removed by th_remove_tmpdirs (a suite's .fini), even when an assertion
 * ends the test early. */
char *th_tmpdir(char *buf, size_t n, const char *what);
void th_remove_tmpdirs(void);
/* Removes a directory and what it holds (folders inside too; links are not followed). */
void th_remove_dir(const char *dir);
/* The paths of the files in dir whose names end with suffix (at most max); returns the count. */
int th_list_files(const char *dir, const char *suffix, char paths[][1200], int max);
/* A whole file, malloc'd and NUL-terminated; *len (if given) gets its length. */
char *th_read_whole(const char *path, size_t *len);
/* A whole gzip file, decompressed with zlib alone (malloc'd; *n its length). */
uint8_t *th_gunzip(const char *path, size_t *n);
void th_write_whole(const char *path, const void *p, size_t n);
/* Truncates a file to half its length. */
void th_truncate_half(const char *path);
/* Flips 16 bytes a third of the way into a file (a compressed stream's data, past its header). */
void th_corrupt_third(const char *path);

#endif
