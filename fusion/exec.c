/*
 * exec.c: the executor. A flush is planned into groups (fusion/plan.c), every value that must be
 * written gets device memory, every group's kernel is generated and compiled, and only then is
 * anything launched: a flush that cannot allocate or compile runs nothing. Matrix products go to
 * cuBLAS, or to cuBLASLt when they carry a bias/ReLU epilogue. With KILN_NVTX=1 each launch is
 * an NVTX range named like its kernel.
 */
#include <inttypes.h>
#include <nvtx3/nvToolsExt.h>
#include <stdlib.h>
#include <string.h>

#include "fusion.h"

/* "// trace nodes: #12 add [128,512] f32, #13 relu ..." for a group's source. */
static void describe(const kiln_ctx *ctx, const kiln__plan *p, const kiln__group *g, char *buf,
                     size_t len) {
  size_t k = (size_t)snprintf(buf, len, "// trace nodes:");
  int n = g->n ? g->n : 1;
  for (int m = 0; m < n && k < len; m++) {
    int32_t i = g->n ? p->members[g->first + m] : g->node;
    const kiln__node *nd = &ctx->trace.nodes[i];
    const kiln_tensor *t = nd->out ? nd->out : nd->in[0];
    char sh[96];
    k += (size_t)snprintf(buf + k, len - k, "%s #%d %s %s %s%s", m ? "," : "", i,
                          kiln__ops[nd->op].name, kiln__shape_of(t, sh, sizeof sh),
                          kiln_dtype_name(t->dtype),
                          nd->out && !p->store[i - p->first] ? " (in registers)" : "");
  }
  if (k < len) snprintf(buf + k, len - k, "\n");
}

static bool alloc_outputs(kiln_ctx *ctx, const kiln__plan *p) {
  kiln__trace *tr = &ctx->trace;
  for (int32_t i = p->first; i < p->last; i++) {
    kiln__node *n = &tr->nodes[i];
    if (!n->out || kiln__ops[n->op].kind == KILN__KIND_VIEW || n->out->st->ptr) continue;
    if (!p->store[i - p->first]) {
      n->out->st->fused = true; /* kept in registers: never written */
      continue;
    }
    n->out->st->fused = false;
    if (n->out->st->bytes == 0) continue;
    n->out->st->ptr = kiln__dev_alloc(ctx, n->out->st->bytes);
    if (!n->out->st->ptr) {
      char sh[96];
      size_t bytes = n->out->st->bytes;
      /* give back what this flush took, so that the context stays usable */
      for (int32_t j = p->first; j < i; j++) {
        kiln__node *m = &tr->nodes[j];
        if (m->out && !m->out->st->persistent && m->out->st->ptr &&
            kiln__ops[m->op].kind != KILN__KIND_VIEW) {
          kiln__dev_free(ctx, m->out->st->ptr);
          m->out->st->ptr = NULL;
        }
      }
      kiln__error(ctx, KILN_ERR_OOM,
                  "kiln_flush: out of device memory: node #%d (%s %s) needs %zu bytes; %zu in "
                  "use, %zu cached; nothing of this flush ran",
                  i, kiln__ops[n->op].name, kiln__shape_of(n->out, sh, sizeof sh), bytes,
                  ctx->alloc.in_use, ctx->alloc.cached);
      return false;
    }
  }
  return true;
}

static bool alloc_masks(kiln_ctx *ctx, const kiln__plan *p);

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

/* A cuBLASLt plan for one product shape and epilogue: descriptors and the chosen algorithm,
 * built once and reused (the heuristic query costs more host time than the launch). ok is false
 * when cuBLASLt has no algorithm for it. */
struct kiln__lt_plan {
  uint64_t m, k, n;
  int lda, ldb, epi;
  bool ta, tb, tf32, ok;
  int64_t aux_ld;
  cublasLtMatmulDesc_t desc;
  cublasLtMatrixLayout_t la, lb, ld;
  cublasLtMatmulAlgo_t algo;
  struct kiln__lt_plan *next;
};

void kiln__lt_plans_free(kiln_ctx *ctx) {
  kiln__lt_plan *q = ctx->lt_plans;
  while (q) {
    kiln__lt_plan *n = q->next;
    if (q->ld) cublasLtMatrixLayoutDestroy(q->ld);
    if (q->la) cublasLtMatrixLayoutDestroy(q->la);
    if (q->lb) cublasLtMatrixLayoutDestroy(q->lb);
    if (q->desc) cublasLtMatmulDescDestroy(q->desc);
    free(q);
    q = n;
  }
  ctx->lt_plans = NULL;
}

const char *kiln__epilogue_name(int epi) {
  switch (epi) {
  case CUBLASLT_EPILOGUE_BIAS: return "bias";
  case CUBLASLT_EPILOGUE_RELU: return "relu";
  case CUBLASLT_EPILOGUE_RELU_AUX: return "relu+mask";
  case CUBLASLT_EPILOGUE_RELU_BIAS: return "bias+relu";
  case CUBLASLT_EPILOGUE_RELU_AUX_BIAS: return "bias+relu+mask";
  case CUBLASLT_EPILOGUE_GELU: return "gelu";
  case CUBLASLT_EPILOGUE_GELU_AUX: return "gelu+input";
  case CUBLASLT_EPILOGUE_GELU_BIAS: return "bias+gelu";
  case CUBLASLT_EPILOGUE_GELU_AUX_BIAS: return "bias+gelu+input";
  case CUBLASLT_EPILOGUE_DRELU: return "drelu";
  case CUBLASLT_EPILOGUE_DRELU_BGRAD: return "drelu+bgrad";
  case CUBLASLT_EPILOGUE_DGELU: return "dgelu";
  case CUBLASLT_EPILOGUE_DGELU_BGRAD: return "dgelu+bgrad";
  case CUBLASLT_EPILOGUE_BGRADB: return "bgradb";
  default: return NULL;
  }
}

static bool epi_mask(int epi) {
  return kiln__epilogue_writes_mask(epi) || kiln__epilogue_reads_mask(epi);
}
static bool epi_gelu_input(int epi) {
  return epi == CUBLASLT_EPILOGUE_GELU_AUX || epi == CUBLASLT_EPILOGUE_GELU_AUX_BIAS ||
         epi == CUBLASLT_EPILOGUE_DGELU || epi == CUBLASLT_EPILOGUE_DGELU_BGRAD;
}
/* Whether an epilogue reads a bias or writes a bias gradient through the bias pointer. */
static bool epi_bias(int epi) {
  return epi == CUBLASLT_EPILOGUE_BIAS || epi == CUBLASLT_EPILOGUE_RELU_BIAS ||
         epi == CUBLASLT_EPILOGUE_RELU_AUX_BIAS || epi == CUBLASLT_EPILOGUE_GELU_BIAS ||
         epi == CUBLASLT_EPILOGUE_GELU_AUX_BIAS || kiln__epilogue_bgrad(epi);
}
bool kiln__epilogue_writes_aux(int epi) {
  return epi == CUBLASLT_EPILOGUE_GELU_AUX || epi == CUBLASLT_EPILOGUE_GELU_AUX_BIAS;
}
bool kiln__epilogue_bgrad(int epi) {
  return epi == CUBLASLT_EPILOGUE_DRELU_BGRAD || epi == CUBLASLT_EPILOGUE_DGELU_BGRAD ||
         epi == CUBLASLT_EPILOGUE_BGRADB;
}

bool kiln__epilogue_writes_mask(int epi) {
  return epi == CUBLASLT_EPILOGUE_RELU_AUX || epi == CUBLASLT_EPILOGUE_RELU_AUX_BIAS;
}
bool kiln__epilogue_reads_mask(int epi) {
  return epi == CUBLASLT_EPILOGUE_DRELU || epi == CUBLASLT_EPILOGUE_DRELU_BGRAD;
}

/* The bit mask's leading dimension (bits; cuBLASLt wants a multiple of 128) or the GELU
 * input's (elements) for an output with ncol columns (the rows of cuBLASLt's column-major D). */
static int64_t aux_ld(int epi, int64_t ncol) {
  if (epi_mask(epi)) return (ncol + 127) / 128 * 128;
  return epi_gelu_input(epi) ? ncol : 0;
}

static kiln__lt_plan *lt_plan(kiln_ctx *ctx, const kiln_tensor *A, const kiln_tensor *B, int epi) {
  uint64_t m = (uint64_t)A->shape[0], k = (uint64_t)A->shape[1], nn = (uint64_t)B->shape[1];
  bool ta, tb;
  int lda, ldb;
  long long sa, sb;
  mm_layout(A, &ta, &lda, &sa);
  mm_layout(B, &tb, &ldb, &sb);
  int64_t ald = aux_ld(epi, (int64_t)nn);
  for (kiln__lt_plan *q = ctx->lt_plans; q; q = q->next)
    if (q->m == m && q->k == k && q->n == nn && q->lda == lda && q->ldb == ldb && q->ta == ta &&
        q->tb == tb && q->epi == epi && q->tf32 == ctx->tf32)
      return q;
  kiln__lt_plan *q = calloc(1, sizeof *q);
  if (!q) {
    kiln__error(ctx, KILN_ERR_OOM, "kiln_flush: out of host memory for a cuBLASLt plan");
    return NULL;
  }
  *q = (kiln__lt_plan){.m = m,
                       .k = k,
                       .n = nn,
                       .lda = lda,
                       .ldb = ldb,
                       .epi = epi,
                       .ta = ta,
                       .tb = tb,
                       .tf32 = ctx->tf32,
                       .aux_ld = ald};
  q->next = ctx->lt_plans; /* even a failed one, so that free releases what it made */
  ctx->lt_plans = q;
  cublasLtMatmulPreference_t pref = NULL;
  cublasOperation_t opb = tb ? CUBLAS_OP_T : CUBLAS_OP_N, opa = ta ? CUBLAS_OP_T : CUBLAS_OP_N;
  cublasLtEpilogue_t e = (cublasLtEpilogue_t)epi;
  cublasComputeType_t ct = ctx->tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
  size_t ws = ctx->lt_workspace_bytes;
  /* the heuristic judges alignment from the pointers: stand-ins aligned like real buffers */
  void *aligned = ctx->lt_workspace;
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
  if (!bad && epi_bias(epi))
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
    cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(ctx->cublaslt, q->desc, q->lb, q->la, q->ld,
                                                       q->ld, pref, 1, &h, &found);
    q->ok = st == CUBLAS_STATUS_SUCCESS && found > 0;
    if (q->ok) q->algo = h.algo;
  }
  if (pref) cublasLtMatmulPreferenceDestroy(pref);
  return bad ? NULL : q;
}

size_t kiln__relu_mask_bytes(const kiln_tensor *y) {
  return (size_t)(aux_ld(CUBLASLT_EPILOGUE_RELU_AUX, y->shape[1]) / 8 * y->shape[0]);
}

/* The bit masks that forward ReLU epilogues write, kept with their outputs' storage. */
static bool alloc_masks(kiln_ctx *ctx, const kiln__plan *p) {
  for (int k = 0; k < p->ng; k++) {
    const kiln__group *g = &p->g[k];
    if (!kiln__epilogue_writes_mask(g->epi)) continue;
    kiln__storage *st = g->aux->st;
    if (st->relu_mask) continue;
    size_t bytes = kiln__relu_mask_bytes(g->aux);
    st->relu_mask = kiln__dev_alloc(ctx, bytes ? bytes : 16);
    if (!st->relu_mask) {
      kiln__error(ctx, KILN_ERR_OOM,
                  "kiln_flush: out of device memory for a ReLU mask of %zu bytes; nothing of this "
                  "flush ran",
                  bytes);
      return false;
    }
  }
  return true;
}

bool kiln__lt_usable(kiln_ctx *ctx, const kiln_tensor *A, const kiln_tensor *B, int epi) {
  if (!ctx->has_gpu) return true;
  kiln__lt_plan *q = lt_plan(ctx, A, B, epi);
  return q && q->ok;
}

static bool set_ptr(kiln_ctx *ctx, kiln__lt_plan *q, cublasLtMatmulDescAttributes_t attr,
                    const void *ptr) {
  return !KILN_CUBLAS_FAILED(ctx, cublasLtMatmulDescSetAttribute(q->desc, attr, &ptr, sizeof ptr));
}

/* A 2-D product with an epilogue through cuBLASLt. */
static bool run_matmul_lt(kiln_ctx *ctx, const kiln__node *n, const kiln__group *g) {
  const kiln_tensor *A = n->in[0], *B = n->in[1], *D = g->out;
  kiln__lt_plan *q = lt_plan(ctx, A, B, g->epi);
  if (!q) return false;
  if (!q->ok) {
    char s1[96], s2[96];
    return !kiln__error(ctx, KILN_ERR_CUDA,
                        "kiln_flush: cuBLASLt has no algorithm for %s x %s with the %s epilogue",
                        kiln__shape_of(A, s1, sizeof s1), kiln__shape_of(B, s2, sizeof s2),
                        kiln__epilogue_name(g->epi));
  }
  if (g->bias && !set_ptr(ctx, q, CUBLASLT_MATMUL_DESC_BIAS_POINTER, kiln__data_ptr(g->bias)))
    return false;
  if (q->aux_ld) {
    const void *aux = epi_mask(g->epi) ? g->aux->st->relu_mask : kiln__data_ptr(g->aux);
    KILN_ASSERT(aux != NULL);
    if (!set_ptr(ctx, q, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, aux)) return false;
  }
  const float one = 1.f, zero = 0.f;
  ctx->stats.kernels_launched++;
  return !KILN_CUBLAS_FAILED(
      ctx, cublasLtMatmul(ctx->cublaslt, q->desc, &one, kiln__data_ptr(B), q->lb, kiln__data_ptr(A),
                          q->la, &zero, kiln__data_ptr(D), q->ld, kiln__data_ptr(D), q->ld,
                          &q->algo, ctx->lt_workspace, ctx->lt_workspace_bytes, ctx->stream));
}

static bool run_matmul(kiln_ctx *ctx, const kiln__node *n, const kiln__group *g) {
  if (g->epi) return run_matmul_lt(ctx, n, g);
  const kiln_tensor *A = n->in[0], *B = n->in[1], *C = n->out;
  int m = (int)A->shape[A->ndim - 2], k = (int)A->shape[A->ndim - 1];
  int nn = (int)B->shape[B->ndim - 1];
  int batch = C->ndim == 3 ? (int)C->shape[0] : 1;
  bool ta, tb;
  int lda, ldb;
  long long sa, sb;
  mm_layout(A, &ta, &lda, &sa);
  mm_layout(B, &tb, &ldb, &sb);
  if (m == 0 || nn == 0 || batch == 0) return true;
  if (k == 0)
    return !KILN_CUDA_FAILED(ctx, cudaMemsetAsync(kiln__data_ptr(C), 0, C->st->bytes, ctx->stream));
  const float one = 1.f, zero = 0.f;
  /* row-major C = A B is column-major C^T = B^T A^T */
  cublasComputeType_t ct = ctx->tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
  ctx->stats.kernels_launched++;
  return !KILN_CUBLAS_FAILED(
      ctx, cublasGemmStridedBatchedEx(ctx->cublas, tb ? CUBLAS_OP_T : CUBLAS_OP_N,
                                      ta ? CUBLAS_OP_T : CUBLAS_OP_N, nn, m, k, &one,
                                      kiln__data_ptr(B), CUDA_R_32F, ldb, sb, kiln__data_ptr(A),
                                      CUDA_R_32F, lda, sa, &zero, kiln__data_ptr(C), CUDA_R_32F, nn,
                                      (long long)m * nn, batch, ct, CUBLAS_GEMM_DEFAULT));
}

static bool launch(kiln_ctx *ctx, kiln__group *g) {
  if (g->args.n == 0) return true;
  void *params[1] = {&g->args};
  ctx->stats.kernels_launched++;
  dim3 grid = {g->grid, g->grid_y ? g->grid_y : 1, 1}, block = {g->block, 1, 1};
  return !KILN_CUDA_FAILED(
      ctx, cudaLaunchKernel((const void *)g->k->fn, grid, block, params, 0, ctx->stream));
}

/* The elementwise program of a group's members [from, to). */
static void prog_of(const kiln_ctx *ctx, const kiln__plan *p, const kiln__group *g, int from,
                    int to, kiln__ew_prog *prog) {
  prog->n = 0;
  prog->nalias = 0;
  for (int m = from; m < to; m++) {
    int32_t i = p->members[g->first + m];
    prog->nodes[prog->n] = &ctx->trace.nodes[i];
    prog->store[prog->n] = p->store[i - p->first];
    prog->n++;
  }
  if (prog->n == 0) return;
  const kiln__node *n0 = prog->nodes[0];
  const kiln_tensor *space = n0->out ? n0->out : n0->in[0];
  prog->ndim = space->ndim;
  prog->shape = space->shape;
}

/* Generates and compiles every group's kernel. */
static bool prepare(kiln_ctx *ctx, kiln__plan *p) {
  char comment[1024];
  for (int k = 0; k < p->ng; k++) {
    kiln__group *g = &p->g[k];
    const kiln__node *n = &ctx->trace.nodes[g->node];
    describe(ctx, p, g, comment, sizeof comment);
    kiln__ew_prog prog;
    bool ok = true;
    switch (g->kind) {
    case KILN__KIND_EW:
      prog_of(ctx, p, g, 0, g->n, &prog);
      ok = kiln__gen_ew(ctx, &prog, g, comment);
      break;
    case KILN__KIND_UPDATE:
      if (g->n == 1) {
        prog_of(ctx, p, g, 0, 1, &prog);
        ok = kiln__gen_ew(ctx, &prog, g, comment);
      } else {
        const kiln__node *ups[KILN__KMAX_UPDATE];
        for (int m = 0; m < g->n; m++)
          ups[m] = &ctx->trace.nodes[p->members[g->first + m]];
        ok = kiln__gen_update_multi(ctx, ups, g->n, g, comment);
      }
      break;
    case KILN__KIND_REDUCE:
      if (g->rows) {
        prog_of(ctx, p, g, 0, g->n, &prog);
        for (int j = 0; j < prog.n; j++) /* views of per-row values the program computes */
          for (int q = 0; q < prog.nodes[j]->nin && prog.nalias < KILN__MAX_GROUP * 2; q++) {
            const kiln_tensor *b = kiln__row_alias(ctx, g->full, prog.nodes[j]->in[q]);
            for (int m = 0; m < j && b; m++)
              if (prog.nodes[m]->out == b) {
                prog.alias[prog.nalias][0] = prog.nodes[j]->in[q];
                prog.alias[prog.nalias++][1] = b;
              }
          }
        ok = kiln__gen_rows(ctx, &prog, g->full, g, comment);
        break;
      }
      prog_of(ctx, p, g, 0, g->n - 1, &prog);
      ok = kiln__gen_reduce(ctx, g->n > 1 ? &prog : NULL, n, g, comment);
      break;
    case KILN__KIND_MATMUL:
      snprintf(g->name, sizeof g->name, "%s%s_%lldx%lldx%lld%s",
               g->epi ? "cublasLt_gemm_" : "cublas_gemm", g->epi ? kiln__epilogue_name(g->epi) : "",
               (long long)n->in[0]->shape[n->in[0]->ndim - 2],
               (long long)n->out->shape[n->out->ndim - 1],
               (long long)n->in[0]->shape[n->in[0]->ndim - 1], n->out->ndim == 3 ? "_batched" : "");
      for (char *c = g->name; *c; c++)
        if (*c == '+') *c = '_';
      break;
    case KILN__KIND_LIB:
      if (n->op == KILN__OP_INDEX_SELECT) {
        ok = kiln__gen_index_select(ctx, n, g, comment);
        break;
      }
      KILN_ASSERT(n->op == KILN__OP_CONCAT);
      {
        /* input g->sub is copied into its slice of the output */
        int axis = (int)n->i[0];
        int64_t start = 0;
        for (int q = 0; q < g->sub; q++)
          start += n->in[q]->shape[axis];
        kiln_tensor slice = *n->out;
        memcpy(slice.shape, n->in[g->sub]->shape, sizeof slice.shape);
        slice.offset = n->out->offset + start * n->out->stride[axis];
        kiln__node copy = {.op = KILN__OP_COPY, .nin = 1, .out = &slice};
        copy.in[0] = n->in[g->sub];
        kiln__ew_prog cp = {
            .n = 1, .nodes = {&copy}, .store = {true}, .ndim = slice.ndim, .shape = slice.shape};
        ok = kiln__gen_ew(ctx, &cp, g, comment);
      }
      break;
    case KILN__KIND_VIEW: break;
    }
    if (!ok) return false;
    for (int s = 0; s < KILN__KMAX_F; s++)
      g->fi[s] = g->fsrc[s] ? (int32_t)(g->fsrc[s] - ctx->trace.nodes) : -1;
    for (int s = 0; s < KILN__KMAX_U; s++)
      g->ui[s] = g->usrc[s] ? (int32_t)(g->usrc[s] - ctx->trace.nodes) : -1;
  }
  return true;
}

/* Every group's attribute values as the trace holds them now, into host[0 .. ng). */
void kiln__fill_values(const kiln_ctx *ctx, const kiln__plan *p, kiln__stepvals *host) {
  const kiln__node *nodes = ctx->trace.nodes;
  for (int k = 0; k < p->ng; k++) {
    const kiln__group *g = &p->g[k];
    for (int s = 0; s < KILN__KMAX_F; s++)
      host[k].f[s] = g->fi[s] >= 0 ? nodes[g->fi[s]].f[g->fk[s]] : 0.f;
    for (int s = 0; s < KILN__KMAX_U; s++)
      host[k].u[s] = g->ui[s] >= 0 ? nodes[g->ui[s]].u[g->uk[s]] : 0;
  }
}

bool kiln__upload_values(kiln_ctx *ctx, kiln__plan *p, void *dev) {
  if (p->ng == 0) return true;
  kiln__stepvals *host = malloc((size_t)p->ng * sizeof *host);
  if (!host) return !kiln__error(ctx, KILN_ERR_OOM, "kiln_flush: out of host memory");
  kiln__fill_values(ctx, p, host);
  kiln__stepvals *v = dev;
  for (int k = 0; k < p->ng; k++) {
    p->g[k].args.fv = v[k].f;
    p->g[k].args.uv = v[k].u;
  }
  bool ok = !KILN_CUDA_FAILED(ctx, cudaMemcpyAsync(dev, host, (size_t)p->ng * sizeof *host,
                                                   cudaMemcpyHostToDevice, ctx->stream));
  free(host);
  return ok;
}

/* Copies this flush's step values to the device (eager flushes share one buffer: the copy is
 * ordered after the kernels that read the previous contents). */
static bool upload_values(kiln_ctx *ctx, kiln__plan *p) {
  if (p->ng == 0) return true;
  if (p->ng > ctx->step_values_cap) {
    int cap = p->ng < 64 ? 64 : p->ng * 2;
    void *d = kiln__dev_alloc(ctx, (size_t)cap * sizeof(kiln__stepvals));
    if (!d)
      return !kiln__error(ctx, KILN_ERR_OOM,
                          "kiln_flush: out of device memory for the step values (%d groups)", cap);
    if (ctx->step_values) kiln__dev_free(ctx, ctx->step_values);
    ctx->step_values = d;
    ctx->step_values_cap = cap;
  }
  return kiln__upload_values(ctx, p, ctx->step_values);
}

/* Launches every group of a prepared plan in order. */
bool kiln__run_groups(kiln_ctx *ctx, kiln__plan *p) {
  bool ok = true;
  for (int i = 0; i < p->ng && ok; i++) {
    kiln__group *g = &p->g[i];
    if (ctx->nvtx) nvtxRangePushA(g->name);
    ok = g->kind == KILN__KIND_MATMUL ? run_matmul(ctx, &ctx->trace.nodes[g->node], g)
                                      : launch(ctx, g);
    if (ctx->nvtx) nvtxRangePop();
  }
  return ok;
}

void kiln__bind_write_through(kiln_ctx *ctx, const kiln__plan *p) {
  for (int32_t i = p->first; i < p->last; i++) {
    const kiln_tensor *D = p->write_to[i - p->first];
    if (!D) continue;
    kiln__storage *st = ctx->trace.nodes[i].out->st;
    st->ptr = D->st->ptr;
    st->borrowed = true;
    st->fused = false;
  }
}

bool kiln__prepare_plan(kiln_ctx *ctx, kiln__plan *p) {
  kiln__bind_write_through(ctx, p);
  return alloc_outputs(ctx, p) && alloc_masks(ctx, p) && prepare(ctx, p);
}

void kiln__flush_stats(kiln_ctx *ctx, const kiln__plan *p, const kiln_exec_stats *before) {
  uint64_t rd = 0, wr = 0;
  for (int i = 0; i < p->ng; i++) {
    rd += p->g[i].bytes_read;
    wr += p->g[i].bytes_written;
  }
  kiln_flush_stats *f = &ctx->stats.last_flush;
  f->nodes = (uint64_t)(p->last - p->first);
  f->groups = (uint64_t)p->ng;
  f->kernels = ctx->stats.kernels_launched - before->kernels_launched;
  f->bytes_read = rd;
  f->bytes_written = wr;
  f->compiled = ctx->stats.kernels_compiled - before->kernels_compiled;
  f->cache_hits = ctx->stats.cache_hits - before->cache_hits;
  f->compile_ms = ctx->stats.compile_ms - before->compile_ms;
  ctx->stats.groups += (uint64_t)p->ng;
  ctx->stats.bytes_read += rd;
  ctx->stats.bytes_written += wr;
  ctx->stats.nodes_executed += (uint64_t)(p->last - p->first);
}

kiln_status kiln__execute(kiln_ctx *ctx, int32_t first, int32_t last) {
  kiln__plan p;
  kiln_exec_stats before = ctx->stats;
  if (!kiln__plan_build(ctx, first, last, ctx->fusion, &p)) return ctx->status;
  if (kiln__prepare_plan(ctx, &p) && upload_values(ctx, &p)) kiln__run_groups(ctx, &p);
  kiln__flush_stats(ctx, &p, &before);
  kiln__plan_free(&p);
  return ctx->status;
}

kiln_status kiln__compile_pending(kiln_ctx *ctx) {
  if (!kiln__ok(ctx)) return kiln_ctx_status(ctx);
  kiln__plan p;
  if (!kiln__plan_build(ctx, ctx->trace.done, ctx->trace.n, ctx->fusion, &p)) return ctx->status;
  prepare(ctx, &p);
  kiln__plan_free(&p);
  return ctx->status;
}
