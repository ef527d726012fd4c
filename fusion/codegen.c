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

/* Room for more bytes after the n held; false (and oom set) when there is no host memory. */
static bool sb_reserve(kiln__sb *b, size_t more) {
  if (b->oom) return false;
  if (b->n + more < b->cap) return true;
  size_t cap = b->cap ? b->cap * 2 : 4096;
  while (cap <= b->n + more)
    cap *= 2;
  char *s = realloc(b->s, cap);
  if (!s) {
    b->oom = true;
    return false;
  }
  b->s = s;
  b->cap = cap;
  return true;
}

void kiln__sb_put(kiln__sb *b, const void *p, size_t n) {
  if (!sb_reserve(b, n)) return;
  memcpy(b->s + b->n, p, n);
  b->n += n;
}

void kiln__sb_printf(kiln__sb *b, const char *fmt, ...) {
  for (;;) {
    if (b->oom) return;
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
    sb_reserve(b, (size_t)k + 1);
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

/* Bytes of t a kernel touches: each element once, broadcast dims counted once. */
static uint64_t footprint(const kiln_tensor *t) {
  uint64_t n = kiln_dtype_size(t->dtype);
  for (int d = 0; d < t->ndim; d++)
    if (t->stride[d] != 0) n *= (uint64_t)t->shape[d];
  return n;
}

/* The tensors a kernel reads and writes, each through a.ptr[k]. */
typedef struct operands {
  int n;
  const kiln_tensor *t[KILN__KMAX_PTR];
  bool lin[KILN__KMAX_PTR];
  bool store[KILN__KMAX_PTR];
  /* a row program's operand read or written once per row: the row-shaped space it is indexed
   * over (NULL: the program's whole iteration space) */
  const kiln_tensor *row[KILN__KMAX_PTR];
} operands;

static int operand(operands *o, const kiln_tensor *t, bool store, const kiln_tensor *row) {
  for (int k = 0; k < o->n && !store; k++)
    if (o->t[k] == t && !o->store[k] && !o->row[k] == !row &&
        (!row || row->ndim == o->row[k]->ndim))
      return k;
  KILN_ASSERT(o->n < KILN__KMAX_PTR);
  o->t[o->n] = t;
  o->store[o->n] = store;
  o->row[o->n] = row;
  return o->n++;
}

/* How an elementwise program's nodes read their inputs and where their attributes live. */
typedef struct wiring {
  char in[KILN__MAX_GROUP][KILN__MAX_IN][16]; /* the name of node j's input q */
  int fb[KILN__MAX_GROUP], ib[KILN__MAX_GROUP], ub[KILN__MAX_GROUP];
  int store_slot[KILN__MAX_GROUP]; /* operand written with node j's value, -1 for none */
  bool coords;                     /* some read needs the element's coordinates */
} wiring;

void kiln__attr_use(const char *e, int *nf, int *ni, int *nu) {
  *nf = *ni = *nu = 0;
  for (const char *c = e; *c; c++) {
    if (c[0] != '$' || !c[1] || c[2] < '0' || c[2] > '9') continue;
    int k = c[2] - '0' + 1;
    if (c[1] == 'f' && k > *nf) *nf = k;
    if (c[1] == 'i' && k > *ni) *ni = k;
    if (c[1] == 'u' && k > *nu) *nu = k;
  }
}

/* Float attribute slot s of g's kernel is node n's attribute k (and 64-bit slot s for attr_u):
 * the executor copies it into the step values before every run or graph replay. */
static void attr_f(kiln__group *g, int s, const kiln__node *n, int k) {
  g->args.f[s] = n->f[k];
  g->fsrc[s] = n;
  g->fk[s] = (int8_t)k;
}
static void attr_u(kiln__group *g, int s, const kiln__node *n, int k) {
  g->args.u[s] = n->u[k];
  g->usrc[s] = n;
  g->uk[s] = (int8_t)k;
}

/* Assigns operands, value names and attribute slots for prog; fills a's attributes. In a row
 * program (row non-NULL) row[j] says node j computes one value per row; a reduction's output is
 * one value per row too, and its scale takes a float slot. */
static void wire(const kiln__ew_prog *p, const bool *row, operands *o, wiring *w, kiln__group *g) {
  kiln__kargs *a = &g->args;
  int nf = 0, ni = 0, nu = 0;
  w->coords = false;
  for (int j = 0; j < p->n; j++) {
    const kiln__node *nd = p->nodes[j];
    const kiln__op_info *info = &kiln__ops[nd->op];
    bool update = info->kind == KILN__KIND_UPDATE, red = info->kind == KILN__KIND_REDUCE;
    const kiln_tensor *in_row = row && row[j] ? nd->out : NULL;
    const kiln_tensor *out_row = row && (row[j] || red) ? nd->out : NULL;
    for (int q = 0; q < nd->nin; q++) {
      const kiln_tensor *x = nd->in[q];
      for (int k = 0; k < p->nalias; k++)
        if (p->alias[k][0] == x) x = p->alias[k][1];
      int m = -1; /* an update reads only operands, input q as operand q */
      for (int k = 0; k < j && !update; k++)
        if (p->nodes[k]->out == x) m = k;
      if (m >= 0)
        snprintf(w->in[j][q], sizeof w->in[j][q], "v%d", m);
      else {
        int k = operand(o, nd->in[q], false, in_row);
        KILN_ASSERT(!update || k == q);
        snprintf(w->in[j][q], sizeof w->in[j][q], "x%d", k);
      }
    }
    int f, i, u;
    kiln__attr_use(info->expr, &f, &i, &u);
    if (red) f = 1, i = u = 0; /* the scale (a mean's 1/n) */
    w->fb[j] = nf;
    w->ib[j] = ni;
    w->ub[j] = nu;
    for (int k = 0; k < f; k++)
      attr_f(g, nf + k, nd, k);
    for (int k = 0; k < i; k++)
      a->i[ni + k] = (int)nd->i[k];
    for (int k = 0; k < u; k++)
      attr_u(g, nu + k, nd, k);
    nf += f;
    ni += i;
    nu += u;
    KILN_ASSERT(nf <= KILN__KMAX_F && ni <= KILN__KMAX_I && nu <= KILN__KMAX_U);
    if (strstr(info->expr, "$c")) w->coords = true;
    w->store_slot[j] = !update && p->store[j] ? operand(o, nd->out, true, out_row) : -1;
  }
}

/* Writes an op-table template with node j's names and attribute slots. */
static void expand(kiln__sb *b, const char *tpl, const wiring *w, int j, const kiln__node *nd) {
  for (const char *p = tpl; *p; p++) {
    if (*p != '$') {
      kiln__sb_printf(b, "%c", *p);
      continue;
    }
    p++;
    if (*p >= '0' && *p <= '9') {
      kiln__sb_printf(b, "%s", w->in[j][*p - '0']);
    } else if ((*p == 'f' || *p == 'i' || *p == 'u') && p[1] >= '0' && p[1] <= '9') {
      int base = *p == 'f' ? w->fb[j] : (*p == 'i' ? w->ib[j] : w->ub[j]);
      kiln__sb_printf(b, "a.%s[%d]", *p == 'f' ? "fv" : (*p == 'i' ? "i" : "uv"),
                      base + (p[1] - '0'));
      p++;
    } else if (strncmp(p, "idx", 3) == 0) {
      kiln__sb_printf(b, "i");
      p += 2;
    } else if (*p == 'c') {
      kiln__sb_printf(b, "c%d", (int)nd->i[7]);
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

/* The loads (scalar), values and stores of prog for one element, indented by ind. In vector
 * mode loads come from the lanes L<k>[e] and stores go to S<k>[e]. */
static void emit_element(kiln__sb *b, const kiln__ew_prog *p, const operands *o, const wiring *w,
                         const char *ind, int nd, bool vec) {
  bool update = p->n == 1 && kiln__ops[p->nodes[0]->op].kind == KILN__KIND_UPDATE;
  for (int k = 0; k < o->n; k++) {
    if (o->store[k]) continue;
    const char *ct = ctype(o->t[k]->dtype);
    kiln__sb_printf(b, "%s%s%s x%d = ", ind, update ? "" : "const ", ct, k);
    if (vec) {
      kiln__sb_printf(b, "((const float *)&L%d)[e];\n", k);
    } else {
      kiln__sb_printf(b, "((const %s *)a.ptr[%d])[", ct, k);
      offset_expr(b, k, nd, o->lin[k]);
      kiln__sb_printf(b, "];\n");
    }
  }
  for (int j = 0; j < p->n; j++) {
    const kiln__node *n = p->nodes[j];
    const kiln__op_info *info = &kiln__ops[n->op];
    if (info->kind == KILN__KIND_UPDATE) {
      kiln__sb_printf(b, "%s", ind);
      expand(b, info->expr, w, j, n);
      kiln__sb_printf(b, "\n");
      for (int q = 0; q < n->nin; q++) {
        if (!(info->stores & (1u << q))) continue;
        int k = w->in[j][q][1] - '0'; /* "x<k>": updates read only operands */
        if (vec)
          kiln__sb_printf(b, "%s((float *)&L%d)[e] = x%d;\n", ind, k, k);
        else {
          kiln__sb_printf(b, "%s((float *)a.ptr[%d])[", ind, k);
          offset_expr(b, k, nd, o->lin[k]);
          kiln__sb_printf(b, "] = x%d;\n", k);
        }
      }
      continue;
    }
    kiln__sb_printf(b, "%sconst auto v%d = ", ind, j);
    expand(b, info->expr, w, j, n);
    kiln__sb_printf(b, "; // %s\n", info->name);
    int k = w->store_slot[j];
    if (k < 0) continue;
    const char *ot = ctype(n->out->dtype);
    if (vec) {
      kiln__sb_printf(b, "%s((float *)&S%d)[e] = (float)v%d;\n", ind, k, j);
    } else {
      kiln__sb_printf(b, "%s((%s *)a.ptr[%d])[", ind, ot, k);
      offset_expr(b, k, nd, o->lin[k]);
      kiln__sb_printf(b, "] = (%s)v%d;\n", ot, j);
    }
  }
}

static void emit_coords(kiln__sb *b, const char *ind, int nd, const char *idx) {
  if (nd == 0) return;
  kiln__sb_printf(b, "%six r = %s;\n", ind, idx);
  for (int d = nd - 1; d > 0; d--)
    kiln__sb_printf(b, "%sconst ix c%d = r %% (ix)a.shape[%d]; r /= (ix)a.shape[%d];\n", ind, d, d,
                    d);
  kiln__sb_printf(b, "%sconst ix c0 = r;\n", ind);
}

/* A kernel name from the ops it runs, like k_add_relu_f32, kept short. */
static void stem_of(const kiln__ew_prog *p, const char *prefix, const char *suffix, char *stem,
                    size_t n) {
  size_t k = (size_t)snprintf(stem, n, "%s", prefix);
  for (int j = 0; j < p->n && k < n; j++) {
    if (k > 40) {
      k += (size_t)snprintf(stem + k, n - k, "_etc%d", p->n - j);
      break;
    }
    k += (size_t)snprintf(stem + k, n - k, "_%s", kiln__ops[p->nodes[j]->op].name);
  }
  if (k < n) snprintf(stem + k, n - k, "%s", suffix);
}

static void finish(kiln_ctx *ctx, kiln__sb *body, const char *stem, kiln__group *g,
                   const char *comment, bool *ok) {
  if (body->oom) {
    kiln__error(ctx, KILN_ERR_OOM, "kiln: out of host memory generating %s", stem);
    *ok = false;
    return;
  }
  uint64_t h = kiln__hash(body->s, body->n, 0);
  snprintf(g->name, sizeof g->name, "%s_%08" PRIx64, stem, h & 0xffffffffu);
  kiln__sb src = {0};
  kiln__sb_printf(&src,
                  "extern \"C\" __global__ void __launch_bounds__(256) %s(const kiln__kargs a) {\n"
                  "%s}\n",
                  g->name, body->s);
  if (src.oom) {
    kiln__error(ctx, KILN_ERR_OOM, "kiln: out of host memory generating %s", stem);
    *ok = false;
    return;
  }
  g->k = kiln__kernel_get(ctx, g->name, src.s, comment);
  kiln__sb_free(&src);
  *ok = g->k != NULL;
}

static unsigned grid_for(const kiln_ctx *ctx, int64_t threads) {
  int64_t blocks = (threads + 255) / 256, cap = (int64_t)ctx->num_sms * 8;
  return (unsigned)(blocks < 1 ? 1 : (blocks > cap ? cap : blocks));
}

bool kiln__gen_ew(kiln_ctx *ctx, const kiln__ew_prog *p, kiln__group *g, const char *comment) {
  int nd = p->ndim;
  int64_t n = kiln__numel(nd, p->shape);
  kiln__kargs *a = &g->args;
  memset(a, 0, sizeof *a);
  a->n = n;
  for (int d = 0; d < nd; d++)
    a->shape[d] = p->shape[d];
  operands o = {0};
  wiring w;
  wire(p, NULL, &o, &w, g);
  bool coords = w.coords, vec = n % 4 == 0 && n > 0 && !w.coords, f32 = true;
  int64_t span = n; /* the largest offset any operand reaches, for the index type */
  g->bytes_read = g->bytes_written = 0;
  for (int k = 0; k < o.n; k++) {
    const kiln_tensor *t = o.t[k];
    a->ptr[k] = kiln__data_ptr(t);
    align_strides(t, nd, p->shape, a->st[k]);
    o.lin[k] = dense(t, n);
    int64_t reach = 0;
    for (int d = 0; d < nd; d++)
      reach += (p->shape[d] - 1) * llabs(a->st[k][d]);
    if (reach > span) span = reach;
    if (!o.lin[k]) coords = true;
    vec = vec && o.lin[k] && (((uintptr_t)a->ptr[k] | (uintptr_t)(t->offset * 4)) % 16 == 0);
    f32 = f32 && t->dtype == KILN_DTYPE_F32;
    if (o.store[k])
      g->bytes_written += footprint(t);
    else
      g->bytes_read += footprint(t);
  }
  for (int j = 0; j < p->n; j++) /* updates write their inputs back */
    if (kiln__ops[p->nodes[j]->op].kind == KILN__KIND_UPDATE)
      for (int q = 0; q < p->nodes[j]->nin; q++)
        if (kiln__ops[p->nodes[j]->op].stores & (1u << q))
          g->bytes_written += footprint(p->nodes[j]->in[q]);
  vec = vec && f32 && !coords;
  bool wide = span >= ((int64_t)1 << 31) - 1024;

  kiln__sb b = {0};
  kiln__sb_printf(&b, "  typedef %s ix; // %s indexing\n", wide ? "long long" : "int",
                  wide ? "64-bit" : "32-bit");
  if (vec) {
    /* 16-byte loads and stores: four elements a thread per iteration */
    kiln__sb_printf(&b, "  const ix n4 = (ix)(a.n >> 2);\n"
                        "  for (ix q = (ix)blockIdx.x * blockDim.x + threadIdx.x; q < n4;\n"
                        "       q += (ix)gridDim.x * blockDim.x) {\n");
    for (int k = 0; k < o.n; k++) {
      if (o.store[k])
        kiln__sb_printf(&b, "    float4 S%d;\n", k);
      else
        kiln__sb_printf(
            &b, "    %sfloat4 L%d = ((const float4 *)a.ptr[%d])[q];\n",
            p->n == 1 && kiln__ops[p->nodes[0]->op].kind == KILN__KIND_UPDATE ? "" : "const ", k,
            k);
    }
    kiln__sb_printf(&b, "#pragma unroll\n    for (int e = 0; e < 4; e++) {\n"
                        "      const ix i = q * 4 + e;\n      (void)i;\n");
    emit_element(&b, p, &o, &w, "      ", nd, true);
    kiln__sb_printf(&b, "    }\n");
    for (int k = 0; k < o.n; k++) {
      if (o.store[k])
        kiln__sb_printf(&b, "    ((float4 *)a.ptr[%d])[q] = S%d;\n", k, k);
      else if (p->n == 1 && (kiln__ops[p->nodes[0]->op].stores & (1u << k)))
        kiln__sb_printf(&b, "    ((float4 *)a.ptr[%d])[q] = L%d;\n", k, k);
    }
    kiln__sb_printf(&b, "  }\n");
  } else {
    kiln__sb_printf(&b, "  for (ix i = (ix)blockIdx.x * blockDim.x + threadIdx.x; i < (ix)a.n;\n"
                        "       i += (ix)gridDim.x * blockDim.x) {\n");
    if (coords) emit_coords(&b, "    ", nd, "i");
    emit_element(&b, p, &o, &w, "    ", nd, false);
    kiln__sb_printf(&b, "  }\n");
  }
  const kiln__node *last = p->nodes[p->n - 1];
  const kiln_tensor *typed = last->out ? last->out : last->in[0];
  char stem[80];
  char suffix[24];
  snprintf(suffix, sizeof suffix, "_%s%s", kiln_dtype_name(typed->dtype), vec ? "_v4" : "");
  stem_of(p, "k", suffix, stem, sizeof stem);
  bool ok;
  finish(ctx, &b, stem, g, comment, &ok);
  kiln__sb_free(&b);
  g->block = 256;
  g->grid = grid_for(ctx, vec ? n / 4 : n);
  return ok;
}

/* A multi-tensor update: one launch runs the same update over g's T tensors, tensor t in
 * blockIdx.y, its inputs in a.ptr[t * nin ...] and its length in a.st[t][0]. */
bool kiln__gen_update_multi(kiln_ctx *ctx, const kiln__node *const *nodes, int T, kiln__group *g,
                            const char *comment) {
  const kiln__node *n0 = nodes[0];
  const kiln__op_info *info = &kiln__ops[n0->op];
  int nin = n0->nin;
  kiln__kargs *a = &g->args;
  memset(a, 0, sizeof *a);
  int nf, ni, nu;
  kiln__attr_use(info->expr, &nf, &ni, &nu);
  for (int k = 0; k < nf; k++)
    attr_f(g, k, n0, k);
  for (int k = 0; k < ni; k++)
    a->i[k] = (int)n0->i[k];
  for (int k = 0; k < nu; k++)
    attr_u(g, k, n0, k);
  int64_t most = 0;
  g->bytes_read = g->bytes_written = 0;
  for (int t = 0; t < T; t++) {
    int64_t len = kiln_tensor_numel(nodes[t]->in[0]);
    a->st[t][0] = len;
    a->n += len;
    if (len > most) most = len;
    for (int q = 0; q < nin; q++) {
      a->ptr[t * nin + q] = kiln__data_ptr(nodes[t]->in[q]);
      g->bytes_read += footprint(nodes[t]->in[q]);
      if (info->stores & (1u << q)) g->bytes_written += footprint(nodes[t]->in[q]);
    }
  }
  wiring w = {0};
  for (int q = 0; q < nin; q++)
    snprintf(w.in[0][q], sizeof w.in[0][q], "x%d", q);
  kiln__sb b = {0};
  kiln__sb_printf(&b, "  const int t = blockIdx.y;\n  const long long n = a.st[t][0];\n"
                      "  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; "
                      "i < n;\n       i += (long long)gridDim.x * blockDim.x) {\n");
  for (int q = 0; q < nin; q++)
    kiln__sb_printf(&b, "    float x%d = ((const float *)a.ptr[t * %d + %d])[i];\n", q, nin, q);
  kiln__sb_printf(&b, "    ");
  expand(&b, info->expr, &w, 0, n0);
  kiln__sb_printf(&b, "\n");
  for (int q = 0; q < nin; q++)
    if (info->stores & (1u << q))
      kiln__sb_printf(&b, "    ((float *)a.ptr[t * %d + %d])[i] = x%d;\n", nin, q, q);
  kiln__sb_printf(&b, "  }\n");
  char stem[64];
  snprintf(stem, sizeof stem, "k_%s_f32_x%d", info->name, T);
  bool ok;
  finish(ctx, &b, stem, g, comment, &ok);
  kiln__sb_free(&b);
  g->block = 256;
  g->grid = grid_for(ctx, most);
  g->grid_y = (unsigned)T;
  return ok;
}

/* One block a row (a.n rows of a.nred elements): a power of two of 32 to 256 threads. */
static void row_launch(const kiln_ctx *ctx, kiln__group *g) {
  int64_t bl = 32, rows = g->args.n, cap = (int64_t)ctx->num_sms * 16;
  while (bl < g->args.nred && bl < 256)
    bl *= 2;
  g->block = (unsigned)bl;
  g->grid = (unsigned)(rows < 1 ? 1 : (rows > cap ? cap : rows));
}

/* A reduction, its input computed by an elementwise prologue or read from memory. Strategy
 * "rows": one block per output, threads stride over the reduced elements (for reductions along
 * the innermost dim). Strategy "cols": one thread per output, looping over the reduced elements
 * (neighbouring threads read neighbouring columns). */
bool kiln__gen_reduce(kiln_ctx *ctx, const kiln__ew_prog *pro, const kiln__node *r, kiln__group *g,
                      const char *comment) {
  const kiln_tensor *x = r->in[0];
  unsigned mask = (unsigned)r->i[0];
  int nd = x->ndim;
  kiln__kargs *a = &g->args;
  memset(a, 0, sizeof *a);
  operands o = {0};
  wiring w;
  int value = -1; /* the prologue node whose value is reduced */
  if (pro && pro->n > 0) {
    wire(pro, NULL, &o, &w, g);
    for (int j = 0; j < pro->n; j++)
      if (pro->nodes[j]->out == x) value = j;
    KILN_ASSERT(value >= 0);
  } else {
    operand(&o, x, false, NULL);
  }
  int out = operand(&o, r->out, true, NULL);
  int outer[KILN_MAX_DIMS], red[KILN_MAX_DIMS], no = 0, nr = 0;
  a->n = 1;
  a->nred = 1;
  for (int d = 0; d < nd; d++) {
    if (mask & (1u << d)) {
      a->rshape[nr] = x->shape[d];
      red[nr++] = d;
      a->nred *= x->shape[d];
    } else {
      a->shape[no] = x->shape[d];
      outer[no++] = d;
      a->n *= x->shape[d];
    }
  }
  g->bytes_read = g->bytes_written = 0;
  for (int k = 0; k < o.n; k++) {
    a->ptr[k] = kiln__data_ptr(o.t[k]);
    if (k != out) align_strides(o.t[k], nd, x->shape, a->st[k]);
    o.lin[k] = false;
    if (o.store[k])
      g->bytes_written += footprint(o.t[k]);
    else
      g->bytes_read += footprint(o.t[k]);
  }
  attr_f(g, KILN__KMAX_F - 1, r, 0); /* the mean's scale, after any prologue attributes */
  bool argmax = r->op == KILN__OP_ARGMAX, isum = r->op == KILN__OP_SUM;
  bool inner = nr > 0 && red[nr - 1] == nd - 1 && (value >= 0 || x->stride[nd - 1] == 1);
  bool rows = nr > 0 && (inner || a->n < (int64_t)ctx->num_sms * 4);
  const char *init = isum ? "0.f" : "-__int_as_float(0x7f800000)";

  kiln__sb b = {0};
  kiln__sb_printf(&b, "  typedef long long ix;\n");
  if (rows) {
    kiln__sb_printf(&b, "  __shared__ float sv[32];\n");
    if (argmax) kiln__sb_printf(&b, "  __shared__ long long si[32];\n");
    kiln__sb_printf(&b, "  for (ix o = blockIdx.x; o < a.n; o += gridDim.x) {\n");
  } else {
    kiln__sb_printf(&b, "  for (ix o = (ix)blockIdx.x * blockDim.x + threadIdx.x; o < a.n;\n"
                        "       o += (ix)gridDim.x * blockDim.x) {\n");
  }
  kiln__sb_printf(&b, "    ix r = o;\n");
  for (int k = no - 1; k >= 0; k--)
    kiln__sb_printf(&b, "    const ix c%d = r %% a.shape[%d]; r /= a.shape[%d];\n", outer[k], k, k);
  kiln__sb_printf(&b, "    float acc = %s;\n    long long ai = 0x7fffffffffffffffll;\n", init);
  if (rows)
    kiln__sb_printf(&b, "    for (ix j = threadIdx.x; j < a.nred; j += blockDim.x) {\n");
  else
    kiln__sb_printf(&b, "    for (ix j = 0; j < a.nred; j++) {\n");
  kiln__sb_printf(&b, "      ix q = j;\n");
  for (int k = nr - 1; k >= 0; k--)
    kiln__sb_printf(&b, "      const ix c%d = q %% a.rshape[%d]; q /= a.rshape[%d];\n", red[k], k,
                    k);
  if (value >= 0) {
    emit_element(&b, pro, &o, &w, "      ", nd, false);
    kiln__sb_printf(&b, "      const float v = v%d;\n", value);
  } else {
    kiln__sb_printf(&b, "      const float v = ((const float *)a.ptr[0])[");
    offset_expr(&b, 0, nd, false);
    kiln__sb_printf(&b, "];\n");
  }
  if (argmax)
    kiln__sb_printf(&b, "      kiln_argmax_step(acc, ai, v, j);\n");
  else if (isum)
    kiln__sb_printf(&b, "      acc += v;\n");
  else
    kiln__sb_printf(&b, "      acc = kiln_maximum(acc, v);\n");
  kiln__sb_printf(&b, "    }\n");
  char store[96];
  if (argmax)
    snprintf(store, sizeof store, "((int *)a.ptr[%d])[o] = (int)ai;", out);
  else
    snprintf(store, sizeof store, "((float *)a.ptr[%d])[o] = acc * a.fv[%d];", out,
             KILN__KMAX_F - 1);
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
      if (!pass)
        kiln__sb_printf(&b, "    if (lane == 0) { sv[w] = acc;%s }\n",
                        argmax ? " si[w] = ai;" : "");
    }
    kiln__sb_printf(&b, "      if (lane == 0) %s\n    }\n    __syncthreads();\n", store);
  } else {
    kiln__sb_printf(&b, "    %s\n", store);
  }
  kiln__sb_printf(&b, "  }\n");

  char stem[80], prefix[40], suffix[40];
  snprintf(prefix, sizeof prefix, "k");
  snprintf(suffix, sizeof suffix, "_%s_f32_%dd_%dr_%s", kiln__ops[r->op].name, no, nr,
           rows ? "rows" : "cols");
  if (value >= 0)
    stem_of(pro, prefix, suffix, stem, sizeof stem);
  else
    snprintf(stem, sizeof stem, "k%s", suffix);
  bool ok;
  finish(ctx, &b, stem, g, comment, &ok);
  kiln__sb_free(&b);
  if (rows) {
    row_launch(ctx, g);
  } else {
    g->block = 256;
    g->grid = grid_for(ctx, a->n);
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
  attr_u(g, 0, n, 0);
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
      "    const long long r = idx[a.uv[0] + k]; // u0: where this step's indices start\n"
      "    y[e] = (r >= 0 && r < a.shape[0]) ? x[r * a.nred + j] : (%s)0;\n"
      "  }\n",
      t, t, t, t, t);
  char stem[64];
  snprintf(stem, sizeof stem, "k_index_select_%s", kiln_dtype_name(x->dtype));
  bool ok;
  finish(ctx, &b, stem, g, comment, &ok);
  kiln__sb_free(&b);
  g->block = 256;
  g->grid = grid_for(ctx, a->n);
  g->bytes_read = footprint(y) + footprint(idx); /* the rows picked, not the whole table */
  g->bytes_written = footprint(y);
  return ok;
}

/* The offset of a once-per-row operand k: its strides over the row's outer coordinates. */
static void row_offset(kiln__sb *b, int k, int nouter) {
  if (nouter == 0) kiln__sb_printf(b, "0");
  for (int d = 0; d < nouter; d++)
    kiln__sb_printf(b, "%sc%d * a.st[%d][%d]", d ? " + " : "", d, k, d);
}

/* Loads of the operands that the nodes marked in use[] read, once per element or per row. */
static void emit_loads(kiln__sb *b, const kiln__ew_prog *p, const bool *use, const operands *o,
                       const wiring *w, bool *loaded, const char *ind, int nd, bool per_row) {
  for (int j = 0; j < p->n; j++) {
    if (!use[j]) continue;
    for (int q = 0; q < p->nodes[j]->nin; q++) {
      if (w->in[j][q][0] != 'x') continue;
      int k = atoi(w->in[j][q] + 1);
      if (loaded[k]) continue;
      loaded[k] = true;
      const char *ct = ctype(o->t[k]->dtype);
      kiln__sb_printf(b, "%sconst %s x%d = ((const %s *)a.ptr[%d])[", ind, ct, k, ct, k);
      if (per_row)
        row_offset(b, k, nd - 1);
      else
        offset_expr(b, k, nd, false);
      kiln__sb_printf(b, "];\n");
    }
  }
}

/* Node j's value (an op-table expression), and its store when it is written. */
static void emit_value(kiln__sb *b, const kiln__ew_prog *p, const wiring *w, int j, const char *ind,
                       int nd, bool store, bool per_row) {
  const kiln__node *n = p->nodes[j];
  kiln__sb_printf(b, "%sconst auto v%d = ", ind, j);
  expand(b, kiln__ops[n->op].expr, w, j, n);
  kiln__sb_printf(b, "; // %s\n", kiln__ops[n->op].name);
  int k = w->store_slot[j];
  if (!store || k < 0) return;
  const char *ot = ctype(n->out->dtype);
  kiln__sb_printf(b, "%s((%s *)a.ptr[%d])[", ind, ot, k);
  if (per_row)
    row_offset(b, k, nd - 1);
  else
    offset_expr(b, k, nd, false);
  kiln__sb_printf(b, "] = (%s)v%d;\n", ot, j);
}

bool kiln__gen_rows(kiln_ctx *ctx, const kiln__ew_prog *p, const kiln_tensor *F, kiln__group *g,
                    const char *comment) {
  int nd = F->ndim;
  enum { FULL, ROW, RED } cls[KILN__MAX_GROUP];
  bool row[KILN__MAX_GROUP];
  int last_red = -1;
  bool final_pass = false; /* some per-element value is written or computed after the last sum */
  for (int j = 0; j < p->n; j++) {
    const kiln__node *n = p->nodes[j];
    bool full = n->out->ndim == nd && !memcmp(n->out->shape, F->shape, (size_t)nd * 8);
    cls[j] = kiln__ops[n->op].kind == KILN__KIND_REDUCE ? RED : (full ? FULL : ROW);
    row[j] = cls[j] == ROW;
    if (cls[j] == RED) last_red = j;
  }
  KILN_ASSERT(last_red >= 0);
  for (int j = 0; j < p->n; j++)
    if (cls[j] == FULL && (j > last_red || p->store[j])) final_pass = true;
  kiln__kargs *a = &g->args;
  memset(a, 0, sizeof *a);
  operands o = {0};
  wiring w;
  wire(p, row, &o, &w, g);
  a->n = 1;
  for (int d = 0; d + 1 < nd; d++) {
    a->shape[d] = F->shape[d];
    a->n *= F->shape[d];
  }
  a->nred = F->shape[nd - 1];
  g->bytes_read = g->bytes_written = 0;
  for (int k = 0; k < o.n; k++) {
    const kiln_tensor *t = o.t[k];
    a->ptr[k] = kiln__data_ptr(t);
    if (o.row[k])
      align_strides(t, o.row[k]->ndim, o.row[k]->shape, a->st[k]);
    else
      align_strides(t, nd, F->shape, a->st[k]);
    if (o.store[k])
      g->bytes_written += footprint(t);
    else
      g->bytes_read += footprint(t);
  }

  kiln__sb b = {0};
  kiln__sb_printf(&b, "  typedef long long ix;\n  __shared__ float sv[32];\n"
                      "  for (ix o = blockIdx.x; o < a.n; o += gridDim.x) {\n    ix r = o;\n");
  for (int d = nd - 2; d >= 0; d--)
    kiln__sb_printf(&b, "    const ix c%d = r %% a.shape[%d]; r /= a.shape[%d];\n", d, d, d);
  bool row_loaded[KILN__KMAX_PTR] = {0};
  for (int j = 0; j < p->n; j++) {
    if (cls[j] == ROW) {
      bool use[KILN__MAX_GROUP] = {0};
      use[j] = true;
      emit_loads(&b, p, use, &o, &w, row_loaded, "    ", nd, true);
      emit_value(&b, p, &w, j, "    ", nd, false, true);
      continue;
    }
    if (cls[j] != RED) continue;
    /* a pass over the row: every per-element value before this reduction, recomputed */
    bool isum = p->nodes[j]->op == KILN__OP_SUM;
    bool use[KILN__MAX_GROUP] = {0}, loaded[KILN__KMAX_PTR] = {0};
    for (int m = 0; m < j; m++)
      use[m] = cls[m] == FULL;
    use[j] = true; /* its own input may come from memory */
    kiln__sb_printf(&b,
                    "    float acc%d = %s;\n"
                    "    for (ix q = threadIdx.x; q < a.nred; q += blockDim.x) {\n"
                    "      const ix c%d = q;\n",
                    j, isum ? "0.f" : "-__int_as_float(0x7f800000)", nd - 1);
    emit_loads(&b, p, use, &o, &w, loaded, "      ", nd, false);
    for (int m = 0; m < j; m++)
      if (cls[m] == FULL) emit_value(&b, p, &w, m, "      ", nd, false, false);
    if (isum)
      kiln__sb_printf(&b, "      acc%d += %s;\n    }\n", j, w.in[j][0]);
    else
      kiln__sb_printf(&b, "      acc%d = kiln_maximum(acc%d, %s);\n    }\n", j, j, w.in[j][0]);
    kiln__sb_printf(&b, "    const float v%d = kiln_block_%s(acc%d, sv) * a.fv[%d]; // %s\n", j,
                    isum ? "sum" : "max", j, w.fb[j], kiln__ops[p->nodes[j]->op].name);
  }
  if (final_pass) {
    bool use[KILN__MAX_GROUP] = {0}, loaded[KILN__KMAX_PTR] = {0};
    for (int m = 0; m < p->n; m++)
      use[m] = cls[m] == FULL;
    kiln__sb_printf(&b,
                    "    for (ix q = threadIdx.x; q < a.nred; q += blockDim.x) {\n"
                    "      const ix c%d = q;\n",
                    nd - 1);
    emit_loads(&b, p, use, &o, &w, loaded, "      ", nd, false);
    for (int m = 0; m < p->n; m++)
      if (cls[m] == FULL) emit_value(&b, p, &w, m, "      ", nd, p->store[m], false);
    kiln__sb_printf(&b, "    }\n");
  }
  kiln__sb_printf(&b, "    if (threadIdx.x == 0) {\n");
  for (int j = 0; j < p->n; j++) {
    int k = w.store_slot[j];
    if (cls[j] == FULL || k < 0) continue;
    const char *ot = ctype(p->nodes[j]->out->dtype);
    kiln__sb_printf(&b, "      ((%s *)a.ptr[%d])[", ot, k);
    row_offset(&b, k, nd - 1);
    kiln__sb_printf(&b, "] = (%s)v%d;\n", ot, j);
  }
  kiln__sb_printf(&b, "    }\n  }\n");
  char stem[80];
  stem_of(p, "k", "_f32_rows", stem, sizeof stem);
  bool ok;
  finish(ctx, &b, stem, g, comment, &ok);
  kiln__sb_free(&b);
  row_launch(ctx, g);
  return ok;
}
