/*
 * exec.c: the executor. A flush is planned into groups (one per node in this version), every
 * output gets device memory, every group's kernel is generated and compiled, and only then is
 * anything launched: a flush that cannot allocate or compile runs nothing.
 */
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "fusion.h"

static void describe(const kiln__node *n, int32_t idx, char *buf, size_t len) {
  char sh[96];
  const kiln_tensor *t = n->out ? n->out : n->in[0];
  snprintf(buf, len, "// trace nodes: #%d %s %s %s\n", idx, kiln__ops[n->op].name,
           kiln__shape_of(t, sh, sizeof sh), kiln_dtype_name(t->dtype));
}

static bool alloc_outputs(kiln_ctx *ctx, int32_t first, int32_t last) {
  kiln__trace *tr = &ctx->trace;
  for (int32_t i = first; i < last; i++) {
    kiln__node *n = &tr->nodes[i];
    if (!n->out || n->out->st->ptr || n->out->st->bytes == 0) continue;
    n->out->st->ptr = kiln__dev_alloc(ctx, n->out->st->bytes);
    if (!n->out->st->ptr) {
      char sh[96];
      size_t bytes = n->out->st->bytes;
      /* give back what this flush took, so that the context stays usable */
      for (int32_t j = first; j < i; j++) {
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

static bool run_matmul(kiln_ctx *ctx, const kiln__node *n) {
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
  if (!ctx->has_gpu) return true;
  if (g->args.n == 0) return true;
  void *params[1] = {&g->args};
  ctx->stats.kernels_launched++;
  dim3 grid = {g->grid, 1, 1}, block = {g->block, 1, 1};
  return !KILN_CUDA_FAILED(
      ctx, cudaLaunchKernel((const void *)g->k->fn, grid, block, params, 0, ctx->stream));
}

/* Plans [first, last) into groups and generates and compiles each group's kernel. */
static bool prepare(kiln_ctx *ctx, int32_t first, int32_t last, kiln__group **out, int *count) {
  kiln__trace *tr = &ctx->trace;
  int cap = 0;
  for (int32_t i = first; i < last; i++) {
    const kiln__node *n = &tr->nodes[i];
    kiln__kind kind = kiln__ops[n->op].kind;
    cap += kind == KILN__KIND_VIEW ? 0 : (n->op == KILN__OP_CONCAT ? n->nin : 1);
  }
  kiln__group *gs = calloc(cap > 0 ? (size_t)cap : 1, sizeof *gs);
  if (!gs) {
    kiln__error(ctx, KILN_ERR_OOM, "kiln_flush: out of host memory planning %d nodes",
                last - first);
    return false;
  }
  int ng = 0;
  bool ok = true;
  char comment[256];
  for (int32_t i = first; i < last && ok; i++) {
    const kiln__node *n = &tr->nodes[i];
    kiln__kind kind = kiln__ops[n->op].kind;
    if (kind == KILN__KIND_VIEW) continue;
    describe(n, i, comment, sizeof comment);
    kiln__group *g = &gs[ng++];
    g->kind = kind;
    g->node = i;
    switch (kind) {
    case KILN__KIND_EW:
    case KILN__KIND_UPDATE: {
      const kiln_tensor *shape_of = n->out ? n->out : n->in[0];
      kiln__ew_spec s = {.op = n->op,
                         .nin = n->nin,
                         .in = n->in,
                         .out = n->out,
                         .attrs = n,
                         .ndim = shape_of->ndim,
                         .shape = shape_of->shape};
      ok = kiln__gen_ew(ctx, &s, g, comment);
      break;
    }
    case KILN__KIND_REDUCE: ok = kiln__gen_reduce(ctx, n, g, comment); break;
    case KILN__KIND_MATMUL: break;
    case KILN__KIND_LIB:
      if (n->op == KILN__OP_INDEX_SELECT) {
        ok = kiln__gen_index_select(ctx, n, g, comment);
        break;
      }
      KILN_ASSERT(n->op == KILN__OP_CONCAT);
      ng--;
      int axis = (int)n->i[0];
      int64_t start = 0;
      for (int k = 0; k < n->nin && ok; k++) {
        /* each input is copied into its slice of the output */
        kiln_tensor slice = *n->out;
        memcpy(slice.shape, n->in[k]->shape, sizeof slice.shape);
        slice.offset = n->out->offset + start * n->out->stride[axis];
        start += n->in[k]->shape[axis];
        kiln__group *gk = &gs[ng++];
        gk->kind = KILN__KIND_EW;
        gk->node = i;
        kiln__ew_spec s = {.op = KILN__OP_COPY,
                           .nin = 1,
                           .in = &n->in[k],
                           .out = &slice,
                           .attrs = n,
                           .ndim = slice.ndim,
                           .shape = slice.shape};
        ok = kiln__gen_ew(ctx, &s, gk, comment);
      }
      break;
    case KILN__KIND_VIEW: break;
    }
  }
  if (!ok) {
    free(gs);
    return false;
  }
  *out = gs;
  *count = ng;
  return true;
}

kiln_status kiln__execute(kiln_ctx *ctx, int32_t first, int32_t last) {
  if (!alloc_outputs(ctx, first, last)) return ctx->status;
  kiln__group *gs;
  int ng;
  if (!prepare(ctx, first, last, &gs, &ng)) return ctx->status;
  bool ok = true;
  for (int i = 0; i < ng && ok; i++) {
    kiln__group *g = &gs[i];
    ok =
        g->kind == KILN__KIND_MATMUL ? run_matmul(ctx, &ctx->trace.nodes[g->node]) : launch(ctx, g);
  }
  free(gs);
  ctx->stats.nodes_executed += (uint64_t)(last - first);
  return ctx->status;
}

kiln_status kiln__compile_pending(kiln_ctx *ctx) {
  if (!kiln__ok(ctx)) return kiln_ctx_status(ctx);
  kiln__group *gs;
  int ng;
  if (!prepare(ctx, ctx->trace.done, ctx->trace.n, &gs, &ng)) return ctx->status;
  free(gs);
  return KILN_OK;
}
