/*
 * ref.c: float64 host references and the steps of an op test (see ref.h). Nothing here calls
 * kiln to compute a reference: index maps, broadcasting and reductions are worked out on the host.
 */
#include "ref.h"

#include <math.h>
#include <string.h>

/* ---------------------------------------------------------------- host memory */

void *ref_malloc(size_t n) {
  void *p = malloc(n ? n : 1);
  cr_assert_not_null(p, "out of host memory (%zu bytes)", n);
  return p;
}
double *ref_dalloc(int64_t n) { return ref_malloc((size_t)(n > 0 ? n : 1) * sizeof(double)); }
float *ref_falloc(int64_t n) { return ref_malloc((size_t)(n > 0 ? n : 1) * sizeof(float)); }

/* ---------------------------------------------------------------- shapes and indices */

int64_t ref_numel(kiln_shape s) {
  int64_t n = 1;
  for (int i = 0; i < s.ndim; i++)
    n *= s.d[i];
  return n;
}

bool ref_shape_eq(kiln_shape a, kiln_shape b) {
  if (a.ndim != b.ndim) return false;
  for (int i = 0; i < a.ndim; i++)
    if (a.d[i] != b.d[i]) return false;
  return true;
}

int ref_norm_axis(int axis, int ndim) { return axis < 0 ? axis + ndim : axis; }

/* Row-major coordinates of linear index lin in s, and back. */
void ref_coords(kiln_shape s, int64_t lin, int64_t *c) {
  for (int d = s.ndim - 1; d >= 0; d--) {
    c[d] = s.d[d] ? lin % s.d[d] : 0;
    lin = s.d[d] ? lin / s.d[d] : 0;
  }
}
int64_t ref_linear(kiln_shape s, const int64_t *c) {
  int64_t l = 0;
  for (int d = 0; d < s.ndim; d++)
    l = l * s.d[d] + c[d];
  return l;
}

bool ref_broadcast(int n, const kiln_shape *in, kiln_shape *out) {
  kiln_shape o = {.ndim = 0};
  for (int i = 0; i < n; i++)
    if (in[i].ndim > o.ndim) o.ndim = in[i].ndim;
  for (int d = 0; d < o.ndim; d++)
    o.d[d] = 1;
  bool ok = true;
  for (int i = 0; i < n; i++)
    for (int j = 0; j < in[i].ndim; j++) {
      int d = o.ndim - in[i].ndim + j;
      if (in[i].d[j] == 1) continue;
      ok = ok && (o.d[d] == 1 || o.d[d] == in[i].d[j]);
      o.d[d] = in[i].d[j];
    }
  *out = o;
  return ok;
}

/* The linear index into a dense tensor of shape in that the output coordinate co reads. */
int64_t ref_broadcast_src(kiln_shape out, const int64_t *co, kiln_shape in) {
  int lead = out.ndim - in.ndim;
  int64_t l = 0;
  for (int j = 0; j < in.ndim; j++)
    l = l * in.d[j] + (in.d[j] == 1 ? 0 : co[j + lead]);
  return l;
}

/* ---------------------------------------------------------------- reading and comparing */

/* Asserts t is not NULL and has shape want. */
void ref_expect_shape(kiln_ctx *ctx, kiln_tensor *t, kiln_shape want, const char *what) {
  cr_assert_not_null(t, "%s: the op returned NULL: %s", what, th_err(ctx));
  char g[96], w[96];
  kiln_shape_str(kiln_tensor_shape(t), g, sizeof g);
  kiln_shape_str(want, w, sizeof w);
  cr_assert(ref_shape_eq(kiln_tensor_shape(t), want), "%s: output shape %s, want %s", what, g, w);
}

float *ref_read_f32(kiln_ctx *ctx, kiln_tensor *t, const char *what) {
  cr_assert_not_null(t, "%s: NULL tensor: %s", what, th_err(ctx));
  cr_assert_eq(kiln_tensor_dtype(t), KILN_DTYPE_F32, "%s: dtype %s, want f32", what,
               kiln_dtype_name(kiln_tensor_dtype(t)));
  int64_t n = kiln_tensor_numel(t);
  float *h = ref_falloc(n);
  kiln_status st = kiln_tensor_to_host(t, h, (size_t)n * sizeof *h);
  cr_assert_eq(st, KILN_OK, "%s: reading the output failed: %s", what, th_err(ctx));
  return h;
}

int32_t *ref_read_i32(kiln_ctx *ctx, kiln_tensor *t, const char *what) {
  cr_assert_not_null(t, "%s: NULL tensor: %s", what, th_err(ctx));
  cr_assert_eq(kiln_tensor_dtype(t), KILN_DTYPE_I32, "%s: dtype %s, want i32", what,
               kiln_dtype_name(kiln_tensor_dtype(t)));
  int64_t n = kiln_tensor_numel(t);
  int32_t *h = ref_malloc((size_t)(n > 0 ? n : 1) * sizeof *h);
  kiln_status st = kiln_tensor_to_host(t, h, (size_t)n * sizeof *h);
  cr_assert_eq(st, KILN_OK, "%s: reading the output failed: %s", what, th_err(ctx));
  return h;
}

/* Asserts t has shape ws and f32 values within atol + rtol * |want| of want. */
void ref_expect_close(kiln_ctx *ctx, kiln_tensor *t, kiln_shape ws, const double *want, double atol,
                      double rtol, const char *what) {
  ref_expect_shape(ctx, t, ws, what);
  float *got = ref_read_f32(ctx, t, what);
  th_assert_close(got, want, ref_numel(ws), atol, rtol, what);
  free(got);
  th_assert_ok(ctx);
}

void ref_expect_i32(kiln_ctx *ctx, kiln_tensor *t, kiln_shape ws, const int32_t *want,
                    const char *what) {
  ref_expect_shape(ctx, t, ws, what);
  int32_t *got = ref_read_i32(ctx, t, what);
  for (int64_t i = 0; i < ref_numel(ws); i++)
    cr_assert_eq(got[i], want[i], "%s: element %lld: got %d, want %d", what, (long long)i,
                 (int)got[i], (int)want[i]);
  free(got);
  th_assert_ok(ctx);
}

/* Runs kiln_gradcheck with its defaults (eps 1e-2, atol 1e-2, rtol 1e-2) and asserts it passed. */
void ref_expect_gradcheck(kiln_ctx *ctx, const char *what, kiln_gradcheck_fn fn, int n,
                          kiln_tensor *const *in, void *user) {
  char report[512] = "";
  kiln_status st = kiln_gradcheck(ctx, fn, n, in, user, NULL, report, sizeof report);
  cr_assert_eq(st, KILN_OK, "gradcheck of %s: %s: %s (context error: %s)", what,
               kiln_status_name(st), report[0] ? report : "no element reported", th_err(ctx));
  th_assert_ok(ctx);
}

/* ---------------------------------------------------------------- reductions */

unsigned ref_axes_mask(kiln_axes ax, int ndim) {
  if (ax.n == 0) return (1u << ndim) - 1;
  unsigned m = 0;
  for (int i = 0; i < ax.n; i++)
    m |= 1u << ref_norm_axis(ax.a[i], ndim);
  return m;
}

kiln_shape ref_reduced_shape(kiln_shape s, unsigned mask, int keepdim) {
  kiln_shape o = {.ndim = 0};
  for (int d = 0; d < s.ndim; d++) {
    if (mask & (1u << d)) {
      if (keepdim) o.d[o.ndim++] = 1;
    } else {
      o.d[o.ndim++] = s.d[d];
    }
  }
  return o;
}

/* The output element (row-major over the kept axes) that input coordinate c reduces into. */
int64_t ref_reduced_index(kiln_shape s, unsigned mask, const int64_t *c) {
  int64_t o = 0;
  for (int d = 0; d < s.ndim; d++)
    if (!(mask & (1u << d))) o = o * s.d[d] + c[d];
  return o;
}

void ref_axes_str(kiln_axes ax, char *buf, size_t n) {
  if (ax.n == 0) {
    snprintf(buf, n, "{all}");
    return;
  }
  size_t k = (size_t)snprintf(buf, n, "{");
  for (int i = 0; i < ax.n && k < n; i++)
    k += (size_t)snprintf(buf + k, n - k, i ? ",%d" : "%d", ax.a[i]);
  if (k < n) snprintf(buf + k, n - k, "}");
}

/* ---------------------------------------------------------------- random inputs */

void ref_gen_fill(float *p, int64_t n, uint64_t seed, const ref_gen *g) {
  th_fill(p, n, seed, g->lo, g->hi);
  for (int64_t i = 0; i < n; i++) {
    if (g->quant > 0) p[i] = g->qoff + g->quant * roundf((p[i] - g->qoff) / g->quant);
    for (int k = 0; k < g->nkinks; k++)
      if (fabsf(p[i] - g->kinks[k]) < g->margin)
        p[i] = g->kinks[k] + (p[i] >= g->kinks[k] ? g->margin : -g->margin);
  }
}

/* Distinct values 0.1 apart in a scrambled order (no ties, even after a 1e-2 perturbation). */
void ref_distinct_fill(float *p, int64_t n, uint64_t seed) {
  int64_t step = 7 + 2 * (int64_t)(seed % 4);
  for (;;) {
    int64_t a = step, b = n;
    while (b) {
      int64_t t = a % b;
      a = b;
      b = t;
    }
    if (a == 1) break;
    step += 2;
  }
  for (int64_t i = 0; i < n; i++)
    p[i] = 0.1f * (float)((i * step + (int64_t)seed) % n) - 0.05f * (float)n;
}

/* ---------------------------------------------------------------- device tensors */

kiln_tensor *ref_upload(kiln_ctx *ctx, kiln_shape s, const float *h) {
  kiln_tensor *t = kiln_tensor_from_host(ctx, KILN_DTYPE_F32, s, h);
  char b[96];
  kiln_shape_str(s, b, sizeof b);
  cr_assert_not_null(t, "kiln_tensor_from_host f32 %s: %s", b, th_err(ctx));
  return t;
}

kiln_tensor *ref_upload_i32(kiln_ctx *ctx, kiln_shape s, const int32_t *h) {
  kiln_tensor *t = kiln_tensor_from_host(ctx, KILN_DTYPE_I32, s, h);
  char b[96];
  kiln_shape_str(s, b, sizeof b);
  cr_assert_not_null(t, "kiln_tensor_from_host i32 %s: %s", b, th_err(ctx));
  return t;
}

void ref_set_grad(kiln_ctx *ctx, kiln_tensor *t) {
  kiln_tensor_set_requires_grad(t, 1);
  th_assert_ok(ctx);
}

/* A persistent f32 tensor of values from g; grad: it requires grad; host: a malloc'd copy. */
kiln_tensor *ref_rand_tensor(kiln_ctx *ctx, kiln_shape s, uint64_t seed, const ref_gen *g, int grad,
                             float **host) {
  int64_t n = ref_numel(s);
  float *h = ref_falloc(n);
  ref_gen_fill(h, n, seed, g);
  kiln_tensor *t = ref_upload(ctx, s, h);
  if (grad) ref_set_grad(ctx, t);
  if (host)
    *host = h;
  else
    free(h);
  return t;
}

/* ---------------------------------------------------------------- chains of views */

static kiln_tensor *vstep_apply(kiln_tensor *x, const ref_vstep *v) {
  switch (v->k) {
  case REF_V_T: return kiln_transpose(x, v->axis, v->axis1);
  case REF_V_PERMUTE: return kiln_permute(x, v->order);
  case REF_V_SLICE: return kiln_slice(x, v->axis, v->start, v->end, v->step);
  case REF_V_EXPAND: return kiln_expand(x, v->shape);
  case REF_V_RESHAPE: return kiln_reshape(x, v->shape);
  case REF_V_CONTIG: return kiln_contiguous(x);
  }
  return NULL;
}

kiln_tensor *ref_chain_apply(kiln_tensor *x, const ref_vchain *c) {
  for (int i = 0; i < c->n && x; i++)
    x = vstep_apply(x, &c->st[i]);
  return x;
}

static ref_hmap hmap_identity(kiln_shape s) {
  ref_hmap m = {.s = s};
  int64_t n = ref_numel(s);
  m.idx = ref_malloc((size_t)(n > 0 ? n : 1) * sizeof *m.idx);
  for (int64_t i = 0; i < n; i++)
    m.idx[i] = i;
  return m;
}

static ref_hmap hmap_step(ref_hmap m, const ref_vstep *v) {
  int nd = m.s.ndim;
  ref_hmap r = {.s = m.s};
  kiln_axes order = {.n = nd};
  int ax = 0, lead = 0;
  int64_t start = 0, step = 1;
  switch (v->k) {
  case REF_V_CONTIG: return m;
  case REF_V_RESHAPE: {
    r.s = v->shape;
    int64_t known = 1;
    int infer = -1;
    for (int d = 0; d < r.s.ndim; d++) {
      if (r.s.d[d] == -1)
        infer = d;
      else
        known *= r.s.d[d];
    }
    if (infer >= 0) r.s.d[infer] = known ? ref_numel(m.s) / known : 0;
    r.idx = m.idx;
    return r;
  }
  case REF_V_T:
  case REF_V_PERMUTE:
    for (int i = 0; i < nd; i++)
      order.a[i] = i;
    if (v->k == REF_V_T) {
      int a0 = ref_norm_axis(v->axis, nd), a1 = ref_norm_axis(v->axis1, nd);
      order.a[a0] = a1;
      order.a[a1] = a0;
    } else {
      for (int i = 0; i < nd; i++)
        order.a[i] = ref_norm_axis(v->order.a[i], nd);
    }
    for (int i = 0; i < nd; i++)
      r.s.d[i] = m.s.d[order.a[i]];
    break;
  case REF_V_SLICE: {
    ax = ref_norm_axis(v->axis, nd);
    int64_t len = m.s.d[ax], end = v->end;
    start = v->start;
    step = v->step;
    if (start < 0) start += len;
    if (end < 0) end += len;
    if (start < 0) start = 0;
    if (end > len) end = len;
    if (start > len) start = len;
    if (end < start) end = start;
    r.s.d[ax] = (end - start + step - 1) / step;
    break;
  }
  case REF_V_EXPAND:
    r.s = v->shape;
    lead = r.s.ndim - nd;
    for (int d = 0; d < r.s.ndim; d++)
      if (d >= lead && r.s.d[d] == -1) r.s.d[d] = m.s.d[d - lead];
    break;
  }
  int64_t n = ref_numel(r.s);
  r.idx = ref_malloc((size_t)(n > 0 ? n : 1) * sizeof *r.idx);
  int64_t co[KILN_MAX_DIMS], ci[KILN_MAX_DIMS];
  for (int64_t i = 0; i < n; i++) {
    ref_coords(r.s, i, co);
    switch (v->k) {
    case REF_V_T:
    case REF_V_PERMUTE:
      for (int d = 0; d < nd; d++)
        ci[order.a[d]] = co[d];
      break;
    case REF_V_SLICE:
      for (int d = 0; d < nd; d++)
        ci[d] = co[d];
      ci[ax] = start + co[ax] * step;
      break;
    case REF_V_EXPAND:
      for (int j = 0; j < nd; j++)
        ci[j] = m.s.d[j] == 1 ? 0 : co[j + lead];
      break;
    default: break;
    }
    r.idx[i] = m.idx[ref_linear(m.s, ci)];
  }
  free(m.idx);
  return r;
}

ref_hmap ref_chain_map(kiln_shape base, const ref_vchain *c) {
  ref_hmap m = hmap_identity(base);
  for (int i = 0; i < c->n; i++)
    m = hmap_step(m, &c->st[i]);
  return m;
}

/* ---------------------------------------------------------------- operands in several layouts */

const char *ref_layout_name(ref_layout l) {
  static const char *const names[] = {"contiguous", "transposed", "sliced (last axis, step 2)",
                                      "sliced (rows, step 2)", "expanded (axis 0)"};
  return names[l];
}

int ref_layout_fits(kiln_shape s, ref_layout l) {
  switch (l) {
  case REF_PLAIN: return 1;
  case REF_TRANS:
  case REF_ROWS: return s.ndim >= 2;
  case REF_SLICE: return s.ndim >= 1;
  case REF_EXPAND: return s.ndim >= 1 && s.d[0] > 1;
  }
  return 0;
}

/* The base shape and the one view step that turn a base tensor into shape s laid out as l. */
static kiln_shape layout_base(kiln_shape s, ref_layout l, ref_vchain *c) {
  kiln_shape b = s;
  int nd = s.ndim;
  memset(c, 0, sizeof *c);
  switch (l) {
  case REF_PLAIN: break;
  case REF_TRANS:
    b.d[nd - 1] = s.d[nd - 2];
    b.d[nd - 2] = s.d[nd - 1];
    c->st[c->n++] = (ref_vstep){.k = REF_V_T, .axis = -1, .axis1 = -2};
    break;
  case REF_SLICE:
    b.d[nd - 1] = 2 * s.d[nd - 1];
    c->st[c->n++] =
        (ref_vstep){.k = REF_V_SLICE, .axis = -1, .start = 1, .end = b.d[nd - 1], .step = 2};
    break;
  case REF_ROWS:
    b.d[nd - 2] = 2 * s.d[nd - 2];
    c->st[c->n++] =
        (ref_vstep){.k = REF_V_SLICE, .axis = -2, .start = 0, .end = b.d[nd - 2], .step = 2};
    break;
  case REF_EXPAND:
    b.d[0] = 1;
    c->st[c->n++] = (ref_vstep){.k = REF_V_EXPAND, .shape = s};
    break;
  }
  return b;
}

ref_opnd ref_opnd_new(kiln_ctx *ctx, kiln_shape s, ref_layout l, uint64_t seed, const ref_gen *g) {
  ref_vchain c;
  kiln_shape bs = layout_base(s, l, &c);
  ref_opnd o = {.s = s};
  o.base = ref_rand_tensor(ctx, bs, seed, g, 0, &o.host);
  o.t = ref_chain_apply(o.base, &c);
  char what[1024], b[96];
  kiln_shape_str(s, b, sizeof b);
  snprintf(what, sizeof what, "making a %s %s input", ref_layout_name(l), b);
  ref_expect_shape(ctx, o.t, s, what);
  ref_hmap m = ref_chain_map(bs, &c);
  int64_t n = ref_numel(s);
  o.v = ref_dalloc(n);
  for (int64_t i = 0; i < n; i++)
    o.v[i] = o.host[m.idx[i]];
  free(m.idx);
  return o;
}

void ref_opnd_free(ref_opnd *o) {
  kiln_tensor_free(o->base);
  free(o->host);
  free(o->v);
}

void ref_opnd_desc(const ref_opnd *o, ref_layout l, char *buf, size_t n) {
  char b[96];
  kiln_shape_str(o->s, b, sizeof b);
  snprintf(buf, n, "%s %s", b, ref_layout_name(l));
}

void ref_check_unary_forward(kiln_ctx *ctx, const char *name, ref_unary_fn fn, ref_scalar_fn ref,
                             const float *p, const ref_gen *fwd, uint64_t seed, double atol,
                             double rtol) {
  kiln_shape shapes[] = {KILN_SHAPE(5), KILN_SHAPE(4, 3), KILN_SHAPE(2, 3, 4), KILN_SHAPE(37, 65)};
  ref_layout lays[] = {REF_PLAIN, REF_TRANS, REF_SLICE, REF_ROWS, REF_EXPAND};
  if (!(atol > 0)) atol = 1e-5;
  if (!(rtol > 0)) rtol = 1e-5;
  char what[1024], d[160];
  for (size_t si = 0; si < sizeof shapes / sizeof *shapes; si++) {
    for (size_t li = 0; li < sizeof lays / sizeof *lays; li++) {
      if (!ref_layout_fits(shapes[si], lays[li])) continue;
      kiln_step_begin(ctx);
      ref_opnd x = ref_opnd_new(ctx, shapes[si], lays[li], seed++, fwd);
      int64_t n = ref_numel(x.s);
      double *want = ref_dalloc(n);
      for (int64_t i = 0; i < n; i++)
        want[i] = ref(x.v[i], p);
      ref_opnd_desc(&x, lays[li], d, sizeof d);
      snprintf(what, sizeof what, "%s of a %s input", name, d);
      ref_expect_close(ctx, fn(x.t, p), x.s, want, atol, rtol, what);
      free(want);
      ref_opnd_free(&x);
    }
  }
}
