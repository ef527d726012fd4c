/*
 * blas.h: the BLAS backend. Every cuBLAS and cuBLASLt call, descriptor and plan lives in blas.c;
 * the rest of kiln speaks of products and epilogues in its own terms, and asks the backend what
 * it supports (as ggml's backends answer supports_op apart from computing).
 */
#ifndef KILN_BLAS_H
#define KILN_BLAS_H

#include "../core/internal.h"

/* What a matrix product D = A B does besides the product. Forward: + a bias over the columns,
 * then ReLU (MASK: also write the bit mask of where it is positive, for the backward pass) or
 * the tanh GELU (INPUT: also write its input). Backward: D times ReLU's derivative (from the
 * mask) or the GELU's (at its saved input), BGRAD: and the column sums of that (the bias
 * gradient); BGRADB: the bias gradient of a weight gradient, the row sums of A's source. */
#define KILN__EPILOGUES(X)                                                                         \
  X(NONE, "", 0)                                                                                   \
  X(BIAS, "bias", KILN__EPI_READS_BIAS)                                                            \
  X(RELU, "relu", 0)                                                                               \
  X(RELU_MASK, "relu+mask", KILN__EPI_WRITES_MASK)                                                 \
  X(BIAS_RELU, "bias+relu", KILN__EPI_READS_BIAS)                                                  \
  X(BIAS_RELU_MASK, "bias+relu+mask", KILN__EPI_READS_BIAS | KILN__EPI_WRITES_MASK)                \
  X(GELU, "gelu", 0)                                                                               \
  X(GELU_INPUT, "gelu+input", KILN__EPI_WRITES_INPUT)                                              \
  X(BIAS_GELU, "bias+gelu", KILN__EPI_READS_BIAS)                                                  \
  X(BIAS_GELU_INPUT, "bias+gelu+input", KILN__EPI_READS_BIAS | KILN__EPI_WRITES_INPUT)             \
  X(DRELU, "drelu", KILN__EPI_READS_MASK)                                                          \
  X(DRELU_BGRAD, "drelu+bgrad", KILN__EPI_READS_MASK | KILN__EPI_BGRAD)                            \
  X(DGELU, "dgelu", KILN__EPI_READS_INPUT)                                                         \
  X(DGELU_BGRAD, "dgelu+bgrad", KILN__EPI_READS_INPUT | KILN__EPI_BGRAD)                           \
  X(BGRADB, "bgradb", KILN__EPI_BGRAD)

enum {
  KILN__EPI_READS_BIAS = 1,   /* reads a bias vector */
  KILN__EPI_WRITES_MASK = 2,  /* writes a ReLU bit mask beside aux's storage */
  KILN__EPI_READS_MASK = 4,   /* reads one */
  KILN__EPI_WRITES_INPUT = 8, /* writes the GELU input into aux */
  KILN__EPI_READS_INPUT = 16, /* reads it from aux */
  KILN__EPI_BGRAD = 32,       /* writes a bias gradient */
};

typedef enum kiln__epi {
#define X(id, name, flags) KILN__EPI_##id,
  KILN__EPILOGUES(X)
#undef X
      KILN__EPI_COUNT
} kiln__epi;

const char *kiln__epi_name(kiln__epi e); /* "bias+relu+mask"; "" for NONE */
unsigned kiln__epi_flags(kiln__epi e);   /* KILN__EPI_* bits */
/* The forward epilogue: bias or not, then act 0 (none), 'r' (ReLU) or 'g' (tanh GELU), aux:
 * write the mask or input the backward pass needs. */
kiln__epi kiln__epi_forward(bool bias, char act, bool aux);
/* The backward one: the derivative of act 'r' or 'g', with the bias gradient or not. */
kiln__epi kiln__epi_backward(char act, bool bgrad);

/* A product as the executor runs it: D = A B (2-D, or batched 3-D without an epilogue). */
typedef struct kiln__gemm {
  const kiln_tensor *a, *b, *d;
  kiln__epi epi;
  const kiln_tensor *bias; /* the bias read, or the bias gradient written */
  const kiln_tensor *aux;  /* the ReLU output whose mask is written or read, or the GELU input */
} kiln__gemm;

typedef struct kiln__blas kiln__blas;
/* The backend of a context: with a GPU, cuBLAS and cuBLASLt handles and a workspace; NULL with
 * the error set on failure. */
kiln__blas *kiln__blas_new(kiln_ctx *ctx);
void kiln__blas_free(kiln__blas *b);

/* Whether the backend can compute A B (2-D) with epilogue e in these layouts. Without a GPU
 * there is no library to ask: yes. The answer is no for every epilogue a test withheld. */
bool kiln__blas_supports(kiln_ctx *ctx, const kiln_tensor *A, const kiln_tensor *B, kiln__epi e);
/* For tests: the epilogues the backend may use, as bits 1 << KILN__EPI_*; the others answer no
 * (the planner then leaves their work to generated kernels). */
void kiln__blas_limit(kiln_ctx *ctx, uint32_t epilogues);
/* Launches the product on the context's stream. */
bool kiln__blas_run(kiln_ctx *ctx, const kiln__gemm *m);
/* A name for profiles: "cublasLt_gemm_bias_relu_128x512x784", "cublas_gemm_10x512x128". */
void kiln__blas_name(const kiln__gemm *m, char *buf, size_t n);
/* Bytes of the bit mask a ReLU epilogue writes for a (rows, cols) output. */
size_t kiln__blas_mask_bytes(int64_t rows, int64_t cols);

#endif
