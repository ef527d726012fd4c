/*
 * codegen.c: CUDA C for elementwise groups, reductions and row gathers. The source depends on
 * the ops, dtypes, ranks and which operands are dense, never on sizes, so one compiled kernel
 * serves every shape of a rank; sizes and strides travel in the kernel's argument.
 */
#include <inttypes.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

#include "fusion.h"

void kiln__sb_printf(kiln__sb *b, const char *fmt, ...) {
  if (b->oom) return;
  for (;;) {
    va_list ap;
    va_start(ap, fmt);
    size_t room = b->cap - b->n;
    int k = vsnprintf(b->s ? b->s + b->n : NULL, room, fmt, ap);
    va_end(ap);
    if (k < 0) {
      b->oom = true;
      return;
    }
    if ((size_t)k < room) {
      b->n += (size_t)k;
      return;
    }
    size_t cap = b->cap ? b->cap * 2 : 4096;
    while (cap - b->n <= (size_t)k)
      cap *= 2;
    char *s = realloc(b->s, cap);
    if (!s) {
      b->oom = true;
      return;
    }
    b->s = s;
    b->cap = cap;
  }
}

void kiln__sb_free(kiln__sb *b) {
  free(b->s);
  memset(b, 0, sizeof *b);
}

void *kiln__data_ptr(const kiln_tensor *t) {
  return (char *)t->st->ptr + t->offset * (int64_t)kiln_dtype_size(t->dtype);
}

static const char *ctype(kiln_dtype dt) { return dt == KILN_DTYPE_I32 ? "int" : "float"; }

/* Strides of t over an iteration space of nd dims, broadcasting from the right (0 where t is
 * stretched). */
static void align_strides(const kiln_tensor *t, int nd, const int64_t *shape, long long *st) {
  for (int d = 0; d < nd; d++) {
    int j = d - (nd - t->ndim);
    st[d] = (j < 0 || (t->shape[j] == 1 && shape[d] != 1)) ? 0 : t->stride[j];
  }
}

static bool dense(const kiln_tensor *t, int64_t n) {
  return kiln__is_contiguous(t) && kiln_tensor_numel(t) == n;
}

/* Expands an op-table template: $0..$9 become the operand names, $fK/$iK/$uK attribute reads,
 * $idx the linear index and $c the coordinate along attribute i[7]. */
static void expand(kiln__sb *b, const char *tpl, char names[][16], const kiln__node *attrs) {
  for (const char *p = tpl; *p; p++) {
    if (*p != '$') {
      kiln__sb_printf(b, "%c", *p);
      continue;
    }
    p++;
    if (*p >= '0' && *p <= '9') {
      kiln__sb_printf(b, "%s", names[*p - '0']);
    } else if ((*p == 'f' || *p == 'i' || *p == 'u') && p[1] >= '0' && p[1] <= '9') {
      kiln__sb_printf(b, "a.%c[%c]", *p, p[1]);
      p++;
    } else if (strncmp(p, "idx", 3) == 0) {
      kiln__sb_printf(b, "i");
      p += 2;
    } else if (*p == 'c') {
      kiln__sb_printf(b, "c%d", (int)attrs->i[7]);
    } else {
      KILN_ASSERT(!"bad op template");
    }
  }
}

static void offset_expr(kiln__sb *b, int k, int nd, bool lin) {
  if (lin) {
    kiln__sb_printf(b, "i");
    return;
  }
  if (nd == 0) kiln__sb_printf(b, "0");
  for (int d = 0; d < nd; d++)
    kiln__sb_printf(b, "%sc%d * a.st[%d][%d]", d ? " + " : "", d, k, d);
}

static void finish(kiln_ctx *ctx, kiln__sb *body, const char *stem, kiln__group *g,
                   const char *comment, bool *ok) {
  if (body->oom) {
    kiln__error(ctx, KILN_ERR_OOM, "kiln: out of host memory generating %s", stem);
    *ok = false;
    return;
  }
  uint64_t h = kiln__hash(body->s, body->n, 0);
  char name[96];
  snprintf(name, sizeof name, "%s_%08" PRIx64, stem, h & 0xffffffffu);
  kiln__sb src = {0};
  kiln__sb_printf(
      &src, "extern \"C\" __global__ void __launch_bounds__(256) %s(const kiln__kargs a) {\n%s}\n",
      name, body->s);
  if (src.oom) {
    kiln__error(ctx, KILN_ERR_OOM, "kiln: out of host memory generating %s", stem);
    *ok = false;
    return;
  }
  g->k = kiln__kernel_get(ctx, name, src.s, comment);
  kiln__sb_free(&src);
  *ok = g->k != NULL;
}

bool kiln__gen_ew(kiln_ctx *ctx, const kiln__ew_spec *s, kiln__group *g, const char *comment) {
  const kiln__op_info *info = &kiln__ops[s->op];
  bool update = info->kind == KILN__KIND_UPDATE;
  int nd = s->ndim;
  int64_t n = kiln__numel(nd, s->shape);
  kiln__kargs *a = &g->args;
  memset(a, 0, sizeof *a);
  a->n = n;
  for (int d = 0; d < nd; d++)
    a->shape[d] = s->shape[d];
  for (int k = 0; k < KILN__NF && k < KILN__KMAX_F; k++)
    a->f[k] = s->attrs ? s->attrs->f[k] : 0.f;
  for (int k = 0; k < KILN__KMAX_I; k++)
    a->i[k] = s->attrs ? (int)s->attrs->i[k] : 0;
  for (int k = 0; k < KILN__NU; k++)
    a->u[k] = s->attrs ? s->attrs->u[k] : 0;

  bool lin[KILN__KMAX_PTR];
  int nops = s->nin + (s->out ? 1 : 0);
  KILN_ASSERT(nops <= KILN__KMAX_PTR);
  bool coords = strstr(info->expr, "$c") != NULL;
  for (int k = 0; k < nops; k++) {
    const kiln_tensor *t = k < s->nin ? s->in[k] : s->out;
    a->ptr[k] = kiln__data_ptr(t);
    align_strides(t, nd, s->shape, a->st[k]);
    lin[k] = dense(t, n);
    if (!lin[k]) coords = true;
  }

  kiln__sb b = {0};
  kiln__sb_printf(
      &b, "  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < a.n;\n"
          "       i += (long long)gridDim.x * blockDim.x) {\n");
  if (coords && nd > 0) {
    kiln__sb_printf(&b, "    long long r = i;\n");
    for (int d = nd - 1; d > 0; d--)
      kiln__sb_printf(&b, "    const long long c%d = r %% a.shape[%d]; r /= a.shape[%d];\n", d, d,
                      d);
    kiln__sb_printf(&b, "    const long long c0 = r;\n");
  }
  char names[KILN__MAX_IN][16];
  for (int k = 0; k < s->nin; k++) {
    snprintf(names[k], sizeof names[k], "x%d", k);
    const char *ct = ctype(s->in[k]->dtype);
    kiln__sb_printf(&b, "    %s%s x%d = ((const %s *)a.ptr[%d])[", update ? "" : "const ", ct, k,
                    ct, k);
    offset_expr(&b, k, nd, lin[k]);
    kiln__sb_printf(&b, "];\n");
  }
  if (update) {
    kiln__sb_printf(&b, "    ");
    expand(&b, info->expr, names, s->attrs);
    kiln__sb_printf(&b, "\n");
    for (int k = 0; k < s->nin; k++) {
      if (!(info->stores & (1u << k))) continue;
      kiln__sb_printf(&b, "    ((float *)a.ptr[%d])[", k);
      offset_expr(&b, k, nd, lin[k]);
      kiln__sb_printf(&b, "] = x%d;\n", k);
    }
  } else {
    const char *ot = ctype(s->out->dtype);
    kiln__sb_printf(&b, "    const auto v = ");
    expand(&b, info->expr, names, s->attrs);
    kiln__sb_printf(&b, ";\n    ((%s *)a.ptr[%d])[", ot, s->nin);
    offset_expr(&b, s->nin, nd, lin[s->nin]);
    kiln__sb_printf(&b, "] = (%s)v;\n", ot);
  }
  kiln__sb_printf(&b, "  }\n");

  char stem[64];
  snprintf(stem, sizeof stem, "k_%s_%s", info->name,
           kiln_dtype_name(s->out ? s->out->dtype : s->in[0]->dtype));
  bool ok;
  finish(ctx, &b, stem, g, comment, &ok);
  kiln__sb_free(&b);
  int64_t blocks = (n + 255) / 256;
  int64_t cap = (int64_t)ctx->num_sms * 8;
  g->block = 256;
  g->grid = (unsigned)(blocks < 1 ? 1 : (blocks > cap ? cap : blocks));
  return ok;
}

/* Generated reduction. Strategy "block": one block per output, threads stride over the reduced
 * elements (for reductions along dense rows). Strategy "thread": one thread per output, looping
 * over the reduced elements (neighbouring threads read neighbouring columns). */
bool kiln__gen_reduce(kiln_ctx *ctx, const kiln__node *n, kiln__group *g, const char *comment) {
  const kiln_tensor *x = n->in[0];
  unsigned mask = (unsigned)n->i[0];
  kiln__kargs *a = &g->args;
  memset(a, 0, sizeof *a);
  int no = 0, nr = 0;
  a->n = 1;
  a->nred = 1;
  for (int d = 0; d < x->ndim; d++) {
    if (mask & (1u << d)) {
      a->rshape[nr] = x->shape[d];
      a->rst[nr++] = x->stride[d];
      a->nred *= x->shape[d];
    } else {
      a->shape[no] = x->shape[d];
      a->st[0][no++] = x->stride[d];
      a->n *= x->shape[d];
    }
  }
  a->ptr[0] = kiln__data_ptr(x);
  a->ptr[1] = kiln__data_ptr(n->out);
  a->f[0] = n->f[0];
  bool argmax = n->op == KILN__OP_ARGMAX, isum = n->op == KILN__OP_SUM;
  bool rows = nr > 0 && (a->rst[nr - 1] == 1 || a->n < (int64_t)ctx->num_sms * 4);
  const char *init = isum ? "0.f" : "-__int_as_float(0x7f800000)";

  kiln__sb b = {0};
  kiln__sb_printf(&b, "  const float *x = (const float *)a.ptr[0];\n");
  if (rows) {
    kiln__sb_printf(&b, "  __shared__ float sv[32];\n");
    if (argmax) kiln__sb_printf(&b, "  __shared__ long long si[32];\n");
    kiln__sb_printf(&b, "  for (long long o = blockIdx.x; o < a.n; o += gridDim.x) {\n");
  } else {
    kiln__sb_printf(&b, "  for (long long o = (long long)blockIdx.x * blockDim.x + threadIdx.x; "
                        "o < a.n; o += (long long)gridDim.x * blockDim.x) {\n");
  }
  kiln__sb_printf(&b, "    long long base = 0;\n    { long long r = o;\n");
  for (int d = no - 1; d >= 0; d--)
    kiln__sb_printf(&b, "      base += (r %% a.shape[%d]) * a.st[0][%d]; r /= a.shape[%d];\n", d, d,
                    d);
  kiln__sb_printf(&b, "    }\n    float acc = %s;\n    long long ai = 0x7fffffffffffffffll;\n",
                  init);
  if (rows)
    kiln__sb_printf(&b, "    for (long long j = threadIdx.x; j < a.nred; j += blockDim.x) {\n");
  else
    kiln__sb_printf(&b, "    for (long long j = 0; j < a.nred; j++) {\n");
  kiln__sb_printf(&b, "      long long off = base;\n      { long long r = j;\n");
  for (int d = nr - 1; d >= 0; d--)
    kiln__sb_printf(&b, "        off += (r %% a.rshape[%d]) * a.rst[%d]; r /= a.rshape[%d];\n", d,
                    d, d);
  kiln__sb_printf(&b, "      }\n      const float v = x[off];\n");
  if (argmax)
    kiln__sb_printf(&b, "      kiln_argmax_step(acc, ai, v, j);\n");
  else if (isum)
    kiln__sb_printf(&b, "      acc += v;\n");
  else
    kiln__sb_printf(&b, "      acc = kiln_maximum(acc, v);\n");
  kiln__sb_printf(&b, "    }\n");
  if (rows) {
    const char *warp = argmax ? NULL : (isum ? "kiln_warp_sum" : "kiln_warp_max");
    kiln__sb_printf(&b, "    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;\n"
                        "    const int nw = (blockDim.x + 31) >> 5;\n");
    for (int pass = 0; pass < 2; pass++) {
      const char *ind = pass ? "      " : "    ";
      if (pass) {
        kiln__sb_printf(&b,
                        "    __syncthreads();\n    if (w == 0) {\n"
                        "      acc = lane < nw ? sv[lane] : %s;\n",
                        init);
        if (argmax)
          kiln__sb_printf(&b, "      ai = lane < nw ? si[lane] : 0x7fffffffffffffffll;\n");
      }
      if (warp) {
        kiln__sb_printf(&b, "%sacc = %s(acc);\n", ind, warp);
      } else {
        kiln__sb_printf(&b,
                        "%sfor (int s = 16; s > 0; s >>= 1) {\n"
                        "%s  const float ov = __shfl_down_sync(0xffffffffu, acc, s);\n"
                        "%s  const long long oi = __shfl_down_sync(0xffffffffu, ai, s);\n"
                        "%s  kiln_argmax_step(acc, ai, ov, oi);\n%s}\n",
                        ind, ind, ind, ind, ind);
      }
      if (!pass) {
        kiln__sb_printf(&b, "    if (lane == 0) { sv[w] = acc;%s }\n",
                        argmax ? " si[w] = ai;" : "");
      }
    }
    if (argmax)
      kiln__sb_printf(&b, "      if (lane == 0) ((int *)a.ptr[1])[o] = (int)ai;\n");
    else
      kiln__sb_printf(&b, "      if (lane == 0) ((float *)a.ptr[1])[o] = acc * a.f[0];\n");
    kiln__sb_printf(&b, "    }\n    __syncthreads();\n");
  } else {
    if (argmax)
      kiln__sb_printf(&b, "    ((int *)a.ptr[1])[o] = (int)ai;\n");
    else
      kiln__sb_printf(&b, "    ((float *)a.ptr[1])[o] = acc * a.f[0];\n");
  }
  kiln__sb_printf(&b, "  }\n");

  char stem[64];
  snprintf(stem, sizeof stem, "k_%s_%s_%dd_%dr_%s", kiln__ops[n->op].name, "f32", no, nr,
           rows ? "rows" : "cols");
  bool ok;
  finish(ctx, &b, stem, g, comment, &ok);
  kiln__sb_free(&b);
  if (rows) {
    int64_t bl = 32;
    while (bl < a->nred && bl < 256)
      bl *= 2;
    g->block = (unsigned)bl;
    int64_t cap = (int64_t)ctx->num_sms * 16;
    g->grid = (unsigned)(a->n < 1 ? 1 : (a->n > cap ? cap : a->n));
  } else {
    int64_t blocks = (a->n + 255) / 256, cap = (int64_t)ctx->num_sms * 8;
    g->block = 256;
    g->grid = (unsigned)(blocks < 1 ? 1 : (blocks > cap ? cap : blocks));
  }
  return ok;
}

bool kiln__gen_index_select(kiln_ctx *ctx, const kiln__node *n, kiln__group *g,
                            const char *comment) {
  const kiln_tensor *x = n->in[0], *idx = n->in[1], *y = n->out;
  kiln__kargs *a = &g->args;
  memset(a, 0, sizeof *a);
  a->ptr[0] = kiln__data_ptr(x);
  a->ptr[1] = kiln__data_ptr(idx);
  a->ptr[2] = kiln__data_ptr(y);
  a->n = kiln_tensor_numel(y);
  a->nred = x->shape[0] ? kiln_tensor_numel(x) / x->shape[0] : 0; /* elements per row */
  a->shape[0] = x->shape[0];
  const char *t = ctype(x->dtype);
  kiln__sb b = {0};
  kiln__sb_printf(
      &b,
      "  const %s *x = (const %s *)a.ptr[0];\n"
      "  const int *idx = (const int *)a.ptr[1];\n"
      "  %s *y = (%s *)a.ptr[2];\n"
      "  for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < a.n;\n"
      "       e += (long long)gridDim.x * blockDim.x) {\n"
      "    const long long k = e / a.nred, j = e - k * a.nred;\n"
      "    const long long r = idx[k];\n"
      "    y[e] = (r >= 0 && r < a.shape[0]) ? x[r * a.nred + j] : (%s)0;\n"
      "  }\n",
      t, t, t, t, t);
  char stem[64];
  snprintf(stem, sizeof stem, "k_index_select_%s", kiln_dtype_name(x->dtype));
  bool ok;
  finish(ctx, &b, stem, g, comment, &ok);
  kiln__sb_free(&b);
  int64_t blocks = (a->n + 255) / 256, cap = (int64_t)ctx->num_sms * 8;
  g->block = 256;
  g->grid = (unsigned)(blocks < 1 ? 1 : (blocks > cap ? cap : blocks));
  return ok;
}
