/*
 * blas.c: the BLAS backend (blas.h). Plain products go to cuBLAS (strided-batched GEMM);
 * products with an epilogue to cuBLASLt, whose descriptors and chosen algorithm are planned
 * once per shape, layout and epilogue and cached (the heuristic query costs more host time
 * than the launch). kiln's tensors are row-major; cuBLAS is column-major, so C = A B is computed
 * as C^T = B^T A^T.
 */
#include <cublasLt.h>
#include <cublas_v2.h>
#include <stdlib.h>
#include <string.h>

#include "../core/cuda_check.h"
#include "fusion.h"

/* cuBLAS and cuBLASLt may use this much scratch memory: 32 MiB is what cuBLAS recommends for
 * Hopper (its default workspace there), enough for split-K on the products kiln makes. */
#define KILN__BLAS_WORKSPACE ((size_t)32 << 20)

static const struct {
  const char *name;
  unsigned flags;
} epilogues[KILN__EPI_COUNT] = {
#define X(id, nm, fl) [KILN__EPI_##id] = {nm, fl},
    KILN__EPILOGUES(X)
#undef X
};

const char *kiln__epi_name(kiln__epi e) { return epilogues[e].name; }
unsigned kiln__epi_flags(kiln__epi e) { return epilogues[e].flags; }

kiln__epi kiln__epi_forward(bool bias, char act, bool aux) {
  if (act == 'r')
    return bias ? (aux ? KILN__EPI_BIAS_RELU_MASK : KILN__EPI_BIAS_RELU)
                : (aux ? KILN__EPI_RELU_MASK : KILN__EPI_RELU);
  if (act == 'g')
    return bias ? (aux ? KILN__EPI_BIAS_GELU_INPUT : KILN__EPI_BIAS_GELU)
                : (aux ? KILN__EPI_GELU_INPUT : KILN__EPI_GELU);
  return bias ? KILN__EPI_BIAS : KILN__EPI_NONE;
}

kiln__epi kiln__epi_backward(char act, bool bgrad) {
  if (act == 'r') return bgrad ? KILN__EPI_DRELU_BGRAD : KILN__EPI_DRELU;
  return bgrad ? KILN__EPI_DGELU_BGRAD : KILN__EPI_DGELU;
}

static cublasLtEpilogue_t lt_epilogue(kiln__epi e) {
  switch (e) {
  case KILN__EPI_NONE: return CUBLASLT_EPILOGUE_DEFAULT;
  case KILN__EPI_BIAS: return CUBLASLT_EPILOGUE_BIAS;
  case KILN__EPI_RELU: return CUBLASLT_EPILOGUE_RELU;
  case KILN__EPI_RELU_MASK: return CUBLASLT_EPILOGUE_RELU_AUX;
  case KILN__EPI_BIAS_RELU: return CUBLASLT_EPILOGUE_RELU_BIAS;
  case KILN__EPI_BIAS_RELU_MASK: return CUBLASLT_EPILOGUE_RELU_AUX_BIAS;
  case KILN__EPI_GELU: return CUBLASLT_EPILOGUE_GELU;
  case KILN__EPI_GELU_INPUT: return CUBLASLT_EPILOGUE_GELU_AUX;
  case KILN__EPI_BIAS_GELU: return CUBLASLT_EPILOGUE_GELU_BIAS;
  case KILN__EPI_BIAS_GELU_INPUT: return CUBLASLT_EPILOGUE_GELU_AUX_BIAS;
  case KILN__EPI_DRELU: return CUBLASLT_EPILOGUE_DRELU;
  case KILN__EPI_DRELU_BGRAD: return CUBLASLT_EPILOGUE_DRELU_BGRAD;
  case KILN__EPI_DGELU: return CUBLASLT_EPILOGUE_DGELU;
  case KILN__EPI_DGELU_BGRAD: return CUBLASLT_EPILOGUE_DGELU_BGRAD;
  case KILN__EPI_BGRADB: return CUBLASLT_EPILOGUE_BGRADB;
  case KILN__EPI_COUNT: break;
  }
  KILN_ASSERT(!"unknown epilogue");
  return CUBLASLT_EPILOGUE_DEFAULT;
}

/* A cuBLASLt plan for one product shape and epilogue: descriptors and the chosen algorithm.
 * ok is false when cuBLASLt has no algorithm for it. */
typedef struct lt_plan {
  uint64_t m, k, n;
  int lda, ldb;
  kiln__epi epi;
  bool ta, tb, tf32, ok;
  int64_t aux_ld;
  cublasLtMatmulDesc_t desc;
  cublasLtMatrixLayout_t la, lb, ld;
  cublasLtMatmulAlgo_t algo;
  struct lt_plan *next;
} lt_plan;

struct kiln__blas {
  uint32_t allowed; /* epilogues the planner may be told yes for (tests withhold some) */
  cublasHandle_t cublas;
  cublasLtHandle_t lt;
  void *workspace;
  size_t workspace_bytes;
  lt_plan *plans;
};

static kiln__blas *blas_of(kiln_ctx *ctx) { return ctx->fusion_state->blas; }

kiln__blas *kiln__blas_new(kiln_ctx *ctx) {
  kiln__blas *b = calloc(1, sizeof *b);
  if (!b) {
    kiln__error(ctx, KILN_ERR_OOM, "kiln_ctx_new: out of host memory");
    return NULL;
  }
  b->allowed = ~0u;
  if (!ctx->has_gpu) return b;
  cudaStream_t stream = ctx->stream;
  if (KILN_CUBLAS_FAILED(ctx, cublasCreate(&b->cublas)) ||
      KILN_CUBLAS_FAILED(ctx, cublasSetStream(b->cublas, stream)) ||
      KILN_CUBLAS_FAILED(ctx, cublasLtCreate(&b->lt)) ||
      KILN_CUDA_FAILED(ctx, cudaMalloc(&b->workspace, KILN__BLAS_WORKSPACE)) ||
      KILN_CUBLAS_FAILED(ctx, cublasSetWorkspace(b->cublas, b->workspace, KILN__BLAS_WORKSPACE)) ||
      /* KILN_DEBUG=initcheck: the workspace zeroed once, so that initcheck sees written the
       * split-K partials that cuBLAS's products store there (as its outputs: zero_for_initcheck)
       * and its splitKreduce kernels read (H100, 2026-12-06: the first of 235,008 reports in
       * test_gpu_ops_conv's few-channel tests; not yet run with this) */
      ((ctx->debug & KILN__DEBUG_INITCHECK) &&
       KILN_CUDA_FAILED(ctx, cudaMemset(b->workspace, 0, KILN__BLAS_WORKSPACE)))) {
    kiln__blas_free(b);
    return NULL;
  }
  b->workspace_bytes = KILN__BLAS_WORKSPACE;
  return b;
}

void kiln__blas_free(kiln__blas *b) {
  if (!b) return;
  for (lt_plan *q = b->plans; q;) {
    lt_plan *n = q->next;
    if (q->ld) cublasLtMatrixLayoutDestroy(q->ld);
    if (q->la) cublasLtMatrixLayoutDestroy(q->la);
    if (q->lb) cublasLtMatrixLayoutDestroy(q->lb);
    if (q->desc) cublasLtMatmulDescDestroy(q->desc);
    free(q);
    q = n;
  }
  if (b->lt) cublasLtDestroy(b->lt);
  if (b->cublas) cublasDestroy(b->cublas);
  if (b->workspace) cudaFree(b->workspace);
  free(b);
}

void kiln__blas_limit(kiln_ctx *ctx, uint32_t epilogues_allowed) {
  if (ctx && ctx->fusion_state && blas_of(ctx)) blas_of(ctx)->allowed = epilogues_allowed;
}

/* How cuBLAS reads the last two dims of t: transposed or not, and the leading dimension. */
static void mm_layout(const kiln_tensor *t, bool *trans, int *ld, long long *batch_stride) {
  int r = t->ndim - 2;
  int64_t sr = t->stride[r], sc = t->stride[r + 1], R = t->shape[r], C = t->shape[r + 1];
  bool rowmajor = (sc == 1 || C == 1) && (sr >= C || R == 1);
  if (rowmajor) {
    *trans = false;
    *ld = (int)(R == 1 ? (C > 0 ? C : 1) : sr);
    if (*ld < C) *ld = (int)C;
  } else {
    *trans = true;
    *ld = (int)(C == 1 ? (R > 0 ? R : 1) : sc);
    if (*ld < R) *ld = (int)R;
  }
  *batch_stride = (t->ndim == 3 && t->shape[0] > 1) ? t->stride[0] : 0;
}

/* The bit mask's leading dimension (bits; cuBLASLt wants a multiple of 128) or the GELU input's
 * (elements) for an output with ncol columns (the rows of cuBLASLt's column-major D). */
static int64_t aux_ld(kiln__epi e, int64_t ncol) {
  unsigned f = kiln__epi_flags(e);
  if (f & (KILN__EPI_WRITES_MASK | KILN__EPI_READS_MASK)) return (ncol + 127) / 128 * 128;
  return (f & (KILN__EPI_WRITES_INPUT | KILN__EPI_READS_INPUT)) ? ncol : 0;
}

size_t kiln__blas_mask_bytes(int64_t rows, int64_t cols) {
  return (size_t)(aux_ld(KILN__EPI_RELU_MASK, cols) / 8 * rows);
}

/* Whether the epilogue passes a bias vector (read, or a bias gradient written) to cuBLASLt. */
static bool has_bias(kiln__epi e) {
  return kiln__epi_flags(e) & (KILN__EPI_READS_BIAS | KILN__EPI_BGRAD);
}

static lt_plan *plan_of(kiln_ctx *ctx, const kiln_tensor *A, const kiln_tensor *B, kiln__epi epi) {
  kiln__blas *bl = blas_of(ctx);
  uint64_t m = (uint64_t)A->shape[0], k = (uint64_t)A->shape[1], nn = (uint64_t)B->shape[1];
  bool ta, tb;
  int lda, ldb;
  long long sa, sb;
  mm_layout(A, &ta, &lda, &sa);
  mm_layout(B, &tb, &ldb, &sb);
  int64_t ald = aux_ld(epi, (int64_t)nn);
  for (lt_plan *q = bl->plans; q; q = q->next)
    if (q->m == m && q->k == k && q->n == nn && q->lda == lda && q->ldb == ldb && q->ta == ta &&
        q->tb == tb && q->epi == epi && q->tf32 == ctx->tf32)
      return q;
  lt_plan *q = calloc(1, sizeof *q);
  if (!q) {
    kiln__error(ctx, KILN_ERR_OOM, "kiln_flush: out of host memory for a cuBLASLt plan");
    return NULL;
  }
  *q = (lt_plan){.m = m,
                 .k = k,
                 .n = nn,
                 .lda = lda,
                 .ldb = ldb,
                 .epi = epi,
                 .ta = ta,
                 .tb = tb,
                 .tf32 = ctx->tf32,
                 .aux_ld = ald};
  q->next = bl->plans; /* even a failed one, so that free releases what it made */
  bl->plans = q;
  cublasLtMatmulPreference_t pref = NULL;
  cublasOperation_t opb = tb ? CUBLAS_OP_T : CUBLAS_OP_N, opa = ta ? CUBLAS_OP_T : CUBLAS_OP_N;
  cublasLtEpilogue_t e = lt_epilogue(epi);
  cublasComputeType_t ct = ctx->tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
  size_t ws = bl->workspace_bytes;
  /* the heuristic judges alignment from the pointers: stand-ins aligned like real buffers */
  void *aligned = bl->workspace;
  /* column-major: D^T (N x M) = B^T-side (N x K) times A^T-side (K x M), the bias per row */
  bool bad =
      KILN_CUBLAS_FAILED(ctx, cublasLtMatmulDescCreate(&q->desc, ct, CUDA_R_32F)) ||
      KILN_CUBLAS_FAILED(ctx, cublasLtMatmulDescSetAttribute(q->desc, CUBLASLT_MATMUL_DESC_TRANSA,
                                                             &opb, sizeof opb)) ||
      KILN_CUBLAS_FAILED(ctx, cublasLtMatmulDescSetAttribute(q->desc, CUBLASLT_MATMUL_DESC_TRANSB,
                                                             &opa, sizeof opa)) ||
      KILN_CUBLAS_FAILED(ctx, cublasLtMatmulDescSetAttribute(q->desc, CUBLASLT_MATMUL_DESC_EPILOGUE,
                                                             &e, sizeof e)) ||
      KILN_CUBLAS_FAILED(
          ctx, cublasLtMatrixLayoutCreate(&q->lb, CUDA_R_32F, tb ? k : nn, tb ? nn : k, ldb)) ||
      KILN_CUBLAS_FAILED(
          ctx, cublasLtMatrixLayoutCreate(&q->la, CUDA_R_32F, ta ? m : k, ta ? k : m, lda)) ||
      KILN_CUBLAS_FAILED(ctx, cublasLtMatrixLayoutCreate(&q->ld, CUDA_R_32F, nn, m, (int64_t)nn)) ||
      KILN_CUBLAS_FAILED(ctx, cublasLtMatmulPreferenceCreate(&pref)) ||
      KILN_CUBLAS_FAILED(ctx, cublasLtMatmulPreferenceSetAttribute(
                                  pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws));
  if (!bad && has_bias(epi))
    bad = KILN_CUBLAS_FAILED(ctx, cublasLtMatmulDescSetAttribute(q->desc,
                                                                 CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                                                                 &aligned, sizeof aligned));
  if (!bad && ald)
    bad = KILN_CUBLAS_FAILED(ctx, cublasLtMatmulDescSetAttribute(
                                      q->desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &aligned,
                                      sizeof aligned)) ||
          KILN_CUBLAS_FAILED(
              ctx, cublasLtMatmulDescSetAttribute(q->desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD,
                                                  &ald, sizeof ald));
  if (!bad) {
    /* no algorithm (or "not supported") is an answer, not an error: the planner then leaves
     * the epilogue to generated kernels */
    cublasLtMatmulHeuristicResult_t h;
    int found = 0;
    cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(bl->lt, q->desc, q->lb, q->la, q->ld, q->ld,
                                                       pref, 1, &h, &found);
    q->ok = st == CUBLAS_STATUS_SUCCESS && found > 0;
    if (q->ok) q->algo = h.algo;
  }
  if (pref) cublasLtMatmulPreferenceDestroy(pref);
  return bad ? NULL : q;
}

bool kiln__blas_supports(kiln_ctx *ctx, const kiln_tensor *A, const kiln_tensor *B, kiln__epi e) {
  kiln__blas *bl = ctx->fusion_state ? blas_of(ctx) : NULL;
  if (!bl) return e == KILN__EPI_NONE; /* the backend failed to start: plain products only */
  /* bf16 products run through cuBLAS without epilogues: generated kernels do that work */
  if (A->dtype != KILN_DTYPE_F32 || B->dtype != KILN_DTYPE_F32) return e == KILN__EPI_NONE;
  if (!(bl->allowed & (1u << e))) return false;
  if (!ctx->has_gpu || e == KILN__EPI_NONE) return true;
  lt_plan *q = plan_of(ctx, A, B, e);
  return q && q->ok;
}

static bool set_ptr(kiln_ctx *ctx, lt_plan *q, cublasLtMatmulDescAttributes_t attr,
                    const void *ptr) {
  return !KILN_CUBLAS_FAILED(ctx, cublasLtMatmulDescSetAttribute(q->desc, attr, &ptr, sizeof ptr));
}

/* KILN_DEBUG=initcheck: D's bytes, from its first element to its last, zeroed before the product
 * writes them all, so that compute-sanitizer's initcheck, blind to the TMA stores of Hopper's
 * cuBLAS kernels, sees them written. Else nothing. */
static bool zero_for_initcheck(kiln_ctx *ctx, const kiln_tensor *D) {
  if (!(ctx->debug & KILN__DEBUG_INITCHECK)) return true;
  int64_t span = 1; /* elements from the first to the last, strides included */
  for (int d = 0; d < D->ndim; d++)
    span += (D->shape[d] - 1) * D->stride[d];
  size_t bytes = (size_t)span * kiln_dtype_size(D->dtype);
  return !KILN_CUDA_FAILED(ctx, cudaMemsetAsync(kiln__data_ptr(D), 0, bytes, ctx->stream));
}

/* A 2-D product with an epilogue through cuBLASLt. */
static bool run_lt(kiln_ctx *ctx, const kiln__gemm *m) {
  kiln__blas *bl = blas_of(ctx);
  const kiln_tensor *A = m->a, *B = m->b, *D = m->d;
  lt_plan *q = plan_of(ctx, A, B, m->epi);
  if (!q) return false;
  if (!q->ok) {
    char s1[96], s2[96];
    return !kiln__error(ctx, KILN_ERR_CUDA,
                        "kiln_flush: cuBLASLt has no algorithm for %s x %s with the %s epilogue",
                        kiln__shape_of(A, s1, sizeof s1), kiln__shape_of(B, s2, sizeof s2),
                        kiln__epi_name(m->epi));
  }
  if (m->bias && !set_ptr(ctx, q, CUBLASLT_MATMUL_DESC_BIAS_POINTER, kiln__data_ptr(m->bias)))
    return false;
  if (q->aux_ld) {
    unsigned f = kiln__epi_flags(m->epi);
    const void *aux = (f & (KILN__EPI_WRITES_MASK | KILN__EPI_READS_MASK)) ? m->aux->st->relu_mask
                                                                           : kiln__data_ptr(m->aux);
    KILN_ASSERT(aux != NULL);
    if (!set_ptr(ctx, q, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, aux)) return false;
  }
  const float one = 1.f, zero = 0.f;
  if (!zero_for_initcheck(ctx, D)) return false;
  ctx->stats.kernels_launched++;
  cudaStream_t stream = ctx->stream;
  return !KILN_CUBLAS_FAILED(ctx, cublasLtMatmul(bl->lt, q->desc, &one, kiln__data_ptr(B), q->lb,
                                                 kiln__data_ptr(A), q->la, &zero, kiln__data_ptr(D),
                                                 q->ld, kiln__data_ptr(D), q->ld, &q->algo,
                                                 bl->workspace, bl->workspace_bytes, stream));
}

/* cuBLAS's name for a dtype of kiln's products. */
static cudaDataType_t cuda_type(kiln_dtype dt) {
  KILN_ASSERT(dt == KILN_DTYPE_F32 || dt == KILN_DTYPE_BF16);
  return dt == KILN_DTYPE_BF16 ? CUDA_R_16BF : CUDA_R_32F;
}

bool kiln__blas_run(kiln_ctx *ctx, const kiln__gemm *g) {
  if (g->epi != KILN__EPI_NONE) return run_lt(ctx, g);
  const kiln_tensor *A = g->a, *B = g->b, *C = g->d;
  int m = (int)A->shape[A->ndim - 2], k = (int)A->shape[A->ndim - 1];
  int nn = (int)B->shape[B->ndim - 1];
  int batch = C->ndim == 3 ? (int)C->shape[0] : 1;
  bool ta, tb;
  int lda, ldb;
  long long sa, sb;
  mm_layout(A, &ta, &lda, &sa);
  mm_layout(B, &tb, &ldb, &sb);
  if (m == 0 || nn == 0 || batch == 0) return true;
  cudaStream_t stream = ctx->stream;
  if (k == 0)
    return !KILN_CUDA_FAILED(ctx, cudaMemsetAsync(kiln__data_ptr(C), 0, C->st->bytes, stream));
  const float one = 1.f, zero = 0.f;
  /* bf16 operands: tensor cores with f32 accumulation; f32: TF32 when the context allows it */
  bool f32 = A->dtype == KILN_DTYPE_F32;
  cublasComputeType_t ct = f32 && ctx->tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
  if (!zero_for_initcheck(ctx, C)) return false;
  ctx->stats.kernels_launched++;
  return !KILN_CUBLAS_FAILED(
      ctx, cublasGemmStridedBatchedEx(
               blas_of(ctx)->cublas, tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N,
               nn, m, k, &one, kiln__data_ptr(B), cuda_type(B->dtype), ldb, sb, kiln__data_ptr(A),
               cuda_type(A->dtype), lda, sa, &zero, kiln__data_ptr(C), cuda_type(C->dtype), nn,
               (long long)m * nn, batch, ct, CUBLAS_GEMM_DEFAULT));
}

void kiln__blas_name(const kiln__gemm *m, char *buf, size_t n) {
  const kiln_tensor *A = m->a, *D = m->d;
  snprintf(buf, n, "%s%s_%lldx%lldx%lld%s%s", m->epi ? "cublasLt_gemm_" : "cublas_gemm",
           kiln__epi_name(m->epi), (long long)A->shape[A->ndim - 2],
           (long long)D->shape[D->ndim - 1], (long long)A->shape[A->ndim - 1],
           D->ndim == 3 ? "_batched" : "", A->dtype == KILN_DTYPE_BF16 ? "_bf16" : "");
  for (char *c = buf; *c; c++)
    if (*c == '+') *c = '_';
}
