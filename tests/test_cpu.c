/*
 * test_cpu.c: the tests that need no GPU. Every context here is a no-GPU one: it records and
 * plans but never executes. They cover the op table's consistency; shapes, broadcasting, views
 * and their error messages; sticky errors; the trace and the autograd tape; optimizer update
 * nodes; stale handles; NVRTC compilation of every generated kernel, with the disk cache and
 * kernel dumps; Philox's published known answers; and the MNIST reader against the real files,
 * a raw copy and corrupted copies.
 *
 * The suite "regressions" keeps the library bugs found while these tests were written: each
 * test says what was wrong and fails if it comes back.
 */
#include <dirent.h>
#include <math.h>
#include <stdarg.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include "helpers.h"
#include "internal.h"
#include "philox.h"

/* ================================================================ helpers */

/* The number of nodes in the context's trace. */
static int32_t tlen(const kiln_ctx *ctx) { return ctx->trace.n; }

/* Node i of the trace; a negative i counts from the end. */
static kiln__node *node_at(kiln_ctx *ctx, int32_t i) {
  if (i < 0) i += ctx->trace.n;
  cr_assert(i >= 0 && i < ctx->trace.n, "node %d of a trace of %d nodes", i, ctx->trace.n);
  return &ctx->trace.nodes[i];
}

static const char *op_name(kiln__op op) { return kiln__ops[op].name; }

/* Writes the op names of nodes [first, last) into buf, for failure messages. */
static const char *ops_str(kiln_ctx *ctx, int32_t first, int32_t last, char *buf, size_t n) {
  size_t k = 0;
  buf[0] = 0;
  for (int32_t i = first; i < last && k + 1 < n; i++)
    k += (size_t)snprintf(buf + k, n - k, "%s%s", i > first ? " " : "",
                          op_name(ctx->trace.nodes[i].op));
  return buf;
}

/* Asserts that the trace holds exactly the ops given from node first to its end. */
static void assert_ops_from(kiln_ctx *ctx, int32_t first, int n, const kiln__op *want) {
  char got[2048], exp[2048];
  size_t k = 0;
  exp[0] = 0;
  for (int i = 0; i < n && k + 1 < sizeof exp; i++)
    k += (size_t)snprintf(exp + k, sizeof exp - k, "%s%s", i ? " " : "", op_name(want[i]));
  ops_str(ctx, first, tlen(ctx), got, sizeof got);
  bool same = tlen(ctx) - first == n;
  for (int i = 0; same && i < n; i++)
    same = ctx->trace.nodes[first + i].op == want[i];
  cr_assert(same, "trace from node %d: got [%s], want [%s]", first, got, exp);
}
#define ASSERT_OPS_FROM(ctx, first, ...)                                                           \
  assert_ops_from((ctx), (first), (int)(sizeof((kiln__op[]){__VA_ARGS__}) / sizeof(kiln__op)),     \
                  (kiln__op[]){__VA_ARGS__})

static void assert_shape(const kiln_tensor *t, kiln_shape want) {
  cr_assert_not_null(t, "a NULL tensor where a shape was expected");
  kiln_shape got = kiln_tensor_shape(t);
  char g[128], w[128];
  bool same = got.ndim == want.ndim;
  for (int i = 0; same && i < got.ndim; i++)
    same = got.d[i] == want.d[i];
  cr_assert(same, "shape %s, want %s", kiln_shape_str(got, g, sizeof g),
            kiln_shape_str(want, w, sizeof w));
}

static void assert_strides(const kiln_tensor *t, int n, const int64_t *want) {
  cr_assert_eq(kiln_tensor_ndim(t), n, "ndim %d, want %d", kiln_tensor_ndim(t), n);
  for (int i = 0; i < n; i++)
    cr_assert_eq(kiln_tensor_stride(t, i), want[i], "stride %d is %lld, want %lld", i,
                 (long long)kiln_tensor_stride(t, i), (long long)want[i]);
}
#define ASSERT_STRIDES(t, ...)                                                                     \
  assert_strides((t), (int)(sizeof((int64_t[]){__VA_ARGS__}) / sizeof(int64_t)),                   \
                 (int64_t[]){__VA_ARGS__})

/* Asserts the context's sticky error: its status and that its message holds every substring
 * (the list ends with NULL). */
static void assert_error(kiln_ctx *ctx, kiln_status want, ...) {
  const char *msg = kiln_ctx_error(ctx);
  cr_assert_eq(kiln_ctx_status(ctx), want, "status '%s', want '%s' (message: %s)",
               kiln_status_name(kiln_ctx_status(ctx)), kiln_status_name(want), msg ? msg : "none");
  cr_assert_not_null(msg, "no error message");
  va_list ap;
  va_start(ap, want);
  for (const char *s = va_arg(ap, const char *); s; s = va_arg(ap, const char *))
    cr_assert_not_null(strstr(msg, s), "the message '%s' lacks '%s'", msg, s);
  va_end(ap);
}
#define ASSERT_ERROR(ctx, status, ...)                                                             \
  assert_error((ctx), (status), __VA_ARGS__, (const char *)NULL)

/* Asserts that expr (an op) fails: it returns NULL, records nothing and sets the given status
 * with a message holding every substring. Then clears the error. */
#define EXPECT_FAIL(ctx, expr, status, ...)                                                        \
  do {                                                                                             \
    int32_t n0_ = tlen(ctx);                                                                       \
    kiln_tensor *r_ = (expr);                                                                      \
    cr_assert_null(r_, "%s should have failed", #expr);                                            \
    cr_assert_eq(tlen(ctx), n0_, "%s recorded %d nodes while failing", #expr, tlen(ctx) - n0_);    \
    ASSERT_ERROR(ctx, status, __VA_ARGS__);                                                        \
    kiln_ctx_clear_error(ctx);                                                                     \
  } while (0)

/* A persistent f32 tensor of zeros. */
static kiln_tensor *f32(kiln_ctx *ctx, kiln_shape s) {
  kiln_tensor *t = kiln_tensor_new(ctx, KILN_DTYPE_F32, s);
  cr_assert_not_null(t, "kiln_tensor_new: %s", kiln_ctx_error(ctx));
  return t;
}

/* A persistent i32 tensor of zeros. */
static kiln_tensor *i32(kiln_ctx *ctx, kiln_shape s) {
  kiln_tensor *t = kiln_tensor_new(ctx, KILN_DTYPE_I32, s);
  cr_assert_not_null(t, "kiln_tensor_new: %s", kiln_ctx_error(ctx));
  return t;
}

/* A persistent f32 tensor that requires grad. */
static kiln_tensor *param(kiln_ctx *ctx, kiln_shape s) {
  kiln_tensor *t = f32(ctx, s);
  kiln_tensor_set_requires_grad(t, 1);
  cr_assert(kiln_tensor_requires_grad(t));
  return t;
}

static kiln_tensor *sum_all(kiln_tensor *t) { return kiln_sum(t, KILN_ALL_AXES, 0); }

/* A small MLP, dims[0] -> dims[1] -> ... -> dims[nl], ReLU between layers, with its input and
 * labels as persistent tensors. */
#define MLP_MAX 4
typedef struct mlp {
  kiln_ctx *ctx;
  kiln_params *params;
  kiln_linear l[MLP_MAX];
  int nl;
  kiln_tensor *x, *y; /* (batch, dims[0]) f32, (batch) i32 */
} mlp;

static void mlp_init(mlp *m, kiln_ctx *ctx, int64_t batch, int nl, const int64_t *dims) {
  cr_assert(nl >= 1 && nl <= MLP_MAX);
  memset(m, 0, sizeof *m);
  m->ctx = ctx;
  m->nl = nl;
  m->params = kiln_params_new(ctx);
  cr_assert_not_null(m->params);
  for (int i = 0; i < nl; i++) {
    char name[16];
    snprintf(name, sizeof name, "fc%d", i + 1);
    kiln_status s = kiln_linear_init(&m->l[i], m->params, name, dims[i], dims[i + 1], 1);
    cr_assert_eq(s, KILN_OK, "kiln_linear_init: %s", kiln_ctx_error(ctx));
  }
  m->x = f32(ctx, KILN_SHAPE(batch, dims[0]));
  m->y = i32(ctx, KILN_SHAPE(batch));
}

static kiln_tensor *mlp_logits(mlp *m) {
  kiln_tensor *h = m->x;
  for (int i = 0; i < m->nl; i++) {
    h = kiln_linear_forward(&m->l[i], h);
    if (i + 1 < m->nl) h = kiln_relu(h);
  }
  return h;
}

static kiln_tensor *mlp_loss(mlp *m) {
  kiln_tensor *loss = kiln_cross_entropy(mlp_logits(m), m->y, KILN_REDUCTION_MEAN, 0.f);
  cr_assert_not_null(loss, "the MLP's loss: %s", kiln_ctx_error(m->ctx));
  return loss;
}

static void mlp_free(mlp *m) {
  kiln_params_free(m->params);
  kiln_tensor_free(m->x);
  kiln_tensor_free(m->y);
}

/* Removes a flat directory and its files. */
static void remove_dir(const char *dir) {
  DIR *d = opendir(dir);
  if (!d) return;
  struct dirent *e;
  char path[1200];
  while ((e = readdir(d))) {
    if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0) continue;
    snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
    unlink(path);
  }
  closedir(d);
  rmdir(dir);
}

/* The temporary directories this test process made, removed by the suites' fini even when an
 * assertion ends the test early. */
static char tmpdirs[8][256];
static int ntmpdirs;

static void remove_tmpdirs(void) {
  for (int i = 0; i < ntmpdirs; i++)
    remove_dir(tmpdirs[i]);
  ntmpdirs = 0;
}

/* A fresh temporary directory (mkdtemp) written into buf. */
static char *make_tmpdir(char *buf, size_t n, const char *what) {
  snprintf(buf, n, "/tmp/kiln-test-%s-XXXXXX", what);
  cr_assert_not_null(mkdtemp(buf), "mkdtemp %s failed", buf);
  if (ntmpdirs < 8) snprintf(tmpdirs[ntmpdirs++], sizeof tmpdirs[0], "%s", buf);
  return buf;
}

TestSuite(nvrtc, .fini = remove_tmpdirs);
TestSuite(mnist, .fini = remove_tmpdirs);
TestSuite(regressions, .fini = remove_tmpdirs);

/* The paths of the files in dir whose names end with suffix (at most max); returns the count. */
static int list_files(const char *dir, const char *suffix, char paths[][1200], int max) {
  DIR *d = opendir(dir);
  cr_assert_not_null(d, "cannot open the directory %s", dir);
  struct dirent *e;
  int n = 0;
  size_t ls = strlen(suffix);
  while ((e = readdir(d))) {
    size_t l = strlen(e->d_name);
    if (l < ls || strcmp(e->d_name + l - ls, suffix) != 0) continue;
    if (n < max) snprintf(paths[n], sizeof paths[n], "%s/%s", dir, e->d_name);
    n++;
  }
  closedir(d);
  return n;
}

/* A whole file, malloc'd and NUL-terminated; *len gets its length. */
static char *read_whole(const char *path, size_t *len) {
  FILE *f = fopen(path, "rb");
  cr_assert_not_null(f, "cannot open %s", path);
  fseek(f, 0, SEEK_END);
  long n = ftell(f);
  fseek(f, 0, SEEK_SET);
  char *p = malloc((size_t)n + 1);
  cr_assert_not_null(p);
  cr_assert_eq(fread(p, 1, (size_t)n, f), (size_t)n);
  p[n] = 0;
  fclose(f);
  if (len) *len = (size_t)n;
  return p;
}

static void write_whole(const char *path, const void *p, size_t n) {
  FILE *f = fopen(path, "wb");
  cr_assert_not_null(f, "cannot create %s", path);
  cr_assert_eq(fwrite(p, 1, n, f), n);
  cr_assert_eq(fclose(f), 0);
}

static uint64_t splitmix(uint64_t *s) {
  uint64_t z = (*s += 0x9e3779b97f4a7c15ULL);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

/* ================================================================ 1. the op table */

/* The ops that carry no gradient; every other op must have a backward rule. */
static bool expect_no_grad(kiln__op op) {
  switch (op) {
  case KILN__OP_EQ:
  case KILN__OP_NE:
  case KILN__OP_LT:
  case KILN__OP_LE:
  case KILN__OP_GT:
  case KILN__OP_GE:
  case KILN__OP_RELU_GRAD:
  case KILN__OP_GELU_ERF_GRAD:
  case KILN__OP_GELU_TANH_GRAD:
  case KILN__OP_CLAMP_GRAD:
  case KILN__OP_FILL:
  case KILN__OP_CAST:
  case KILN__OP_ONEHOT:
  case KILN__OP_ACCUM:
  case KILN__OP_ASSIGN:
  case KILN__OP_SGD:
  case KILN__OP_SGD_MOMENTUM:
  case KILN__OP_ADAM:
  case KILN__OP_ARGMAX:
  case KILN__OP_DETACH:
  case KILN__OP_INDEX_SELECT: return true;
  default: return false;
  }
}

Test(optable, names_are_unique_identifiers) {
  for (int i = 0; i < KILN__OP_COUNT; i++) {
    const char *n = kiln__ops[i].name;
    cr_assert(n && *n, "op %d has no name", i);
    for (const char *p = n; *p; p++)
      cr_assert((*p >= 'a' && *p <= 'z') || *p == '_',
                "op %d's name '%s' is not a lower-case identifier (it names kernels)", i, n);
    for (int j = 0; j < i; j++)
      cr_assert_str_neq(n, kiln__ops[j].name, "ops %d and %d are both named '%s'", j, i, n);
    cr_assert(kiln__ops[i].nin >= 0 && kiln__ops[i].nin <= KILN__MAX_IN, "op %s: nin %d", n,
              kiln__ops[i].nin);
  }
}

/* Checks an expression's placeholders: $N below nin, $fK/$iK/$uK within the attributes. */
static void check_placeholders(const kiln__op_info *o) {
  for (const char *p = o->expr; *p; p++) {
    if (*p != '$') continue;
    char c = p[1];
    if (strncmp(p + 1, "idx", 3) == 0 || c == 'c') {
      continue; /* the linear index, the coordinate along i[7] */
    } else if (c >= '0' && c <= '9') {
      cr_assert(c - '0' < o->nin, "op %s: '%s' reads $%c but has %d inputs", o->name, o->expr, c,
                o->nin);
    } else if (c == 'f' || c == 'i' || c == 'u') {
      int k = p[2] - '0', lim = c == 'f' ? KILN__NF : c == 'i' ? KILN__NI : KILN__NU;
      cr_assert(k >= 0 && k < lim, "op %s: '%s' reads $%c%c beyond its attributes", o->name,
                o->expr, c, p[2]);
    } else {
      cr_assert_fail("op %s: unknown placeholder in '%s'", o->name, o->expr);
    }
  }
}

Test(optable, kinds_expressions_and_stores) {
  int counts[KILN__KIND_LIB + 1] = {0};
  for (int i = 0; i < KILN__OP_COUNT; i++) {
    const kiln__op_info *o = &kiln__ops[i];
    cr_assert_not_null(o->expr, "op %s has a NULL expression", o->name);
    cr_assert_not_null(o->grad, "op %s has a NULL backward rule", o->name);
    counts[o->kind]++;
    switch (o->kind) {
    case KILN__KIND_EW:
      cr_assert(o->expr[0], "elementwise op %s has no expression", o->name);
      cr_assert_eq(o->stores, 0u, "elementwise op %s stores into inputs", o->name);
      check_placeholders(o);
      break;
    case KILN__KIND_UPDATE:
      cr_assert(o->expr[0], "update op %s has no expression", o->name);
      cr_assert_neq(o->stores, 0u, "update op %s stores nothing", o->name);
      cr_assert_eq(o->stores & ~((1u << o->nin) - 1), 0u,
                   "update op %s stores 0x%x beyond its %d inputs", o->name, o->stores, o->nin);
      cr_assert(o->stores & 1u, "update op %s does not write its input 0", o->name);
      cr_assert(!kiln__has_grad((kiln__op)i), "update op %s has a backward rule", o->name);
      check_placeholders(o);
      break;
    case KILN__KIND_REDUCE:
      cr_assert_eq(o->nin, 1, "reduction %s takes %d inputs", o->name, o->nin);
      cr_assert_eq(o->stores, 0u);
      break;
    case KILN__KIND_MATMUL:
      cr_assert_eq(o->nin, 2, "matmul %s takes %d inputs", o->name, o->nin);
      cr_assert_str_empty(o->expr);
      break;
    case KILN__KIND_VIEW:
      cr_assert_eq(o->nin, 1, "view %s takes %d inputs", o->name, o->nin);
      cr_assert_str_empty(o->expr, "view %s has an expression", o->name);
      cr_assert_eq(o->stores, 0u);
      break;
    case KILN__KIND_LIB:
      cr_assert_str_empty(o->expr, "library op %s has an expression", o->name);
      break;
    }
  }
  /* the reductions combine with expressions, except argmax whose kernel is special */
  cr_assert_str_eq(kiln__ops[KILN__OP_SUM].expr, "a + b");
  cr_assert_str_empty(kiln__ops[KILN__OP_ARGMAX].expr);
  cr_assert_eq(kiln__ops[KILN__OP_CONCAT].nin, KILN__MAX_IN);
  cr_assert_eq(kiln__ops[KILN__OP_SGD_MOMENTUM].stores, 5u); /* p and the momentum buffer */
  cr_assert_eq(kiln__ops[KILN__OP_ADAM].stores, 13u);        /* p, m and v */
  cr_assert_eq(counts[KILN__KIND_MATMUL], 1, "one matmul row");
  /* the rows of each kind that the planner and the executor special-case */
  const kiln__op reduce[] = {KILN__OP_SUM, KILN__OP_MAX, KILN__OP_ARGMAX};
  const kiln__op views[] = {KILN__OP_RESHAPE, KILN__OP_PERMUTE, KILN__OP_SLICE, KILN__OP_EXPAND,
                            KILN__OP_DETACH};
  const kiln__op updates[] = {KILN__OP_ACCUM, KILN__OP_ASSIGN, KILN__OP_SGD, KILN__OP_SGD_MOMENTUM,
                              KILN__OP_ADAM};
  for (size_t i = 0; i < sizeof reduce / sizeof *reduce; i++)
    cr_assert_eq(kiln__ops[reduce[i]].kind, KILN__KIND_REDUCE, "%s", kiln__ops[reduce[i]].name);
  for (size_t i = 0; i < sizeof views / sizeof *views; i++)
    cr_assert_eq(kiln__ops[views[i]].kind, KILN__KIND_VIEW, "%s", kiln__ops[views[i]].name);
  for (size_t i = 0; i < sizeof updates / sizeof *updates; i++)
    cr_assert_eq(kiln__ops[updates[i]].kind, KILN__KIND_UPDATE, "%s", kiln__ops[updates[i]].name);
  cr_assert_eq(kiln__ops[KILN__OP_MATMUL].kind, KILN__KIND_MATMUL);
  cr_assert_eq(kiln__ops[KILN__OP_CONCAT].kind, KILN__KIND_LIB);
  cr_assert_eq(kiln__ops[KILN__OP_INDEX_SELECT].kind, KILN__KIND_LIB);
  cr_assert_eq(kiln__ops[KILN__OP_INDEX_SELECT].nin, 2);
  cr_assert_eq(kiln__ops[KILN__OP_FILL].nin, 0, "fill reads no input");
}

Test(optable, backward_rules_where_expected) {
  cr_assert(kiln__has_grad(KILN__OP_ADD));
  cr_assert(kiln__has_grad(KILN__OP_MATMUL));
  cr_assert(kiln__has_grad(KILN__OP_CONCAT));
  cr_assert(kiln__has_grad(KILN__OP_SLICE));
  cr_assert(kiln__has_grad(KILN__OP_DROPOUT));
  cr_assert(!kiln__has_grad(KILN__OP_EQ));
  cr_assert(!kiln__has_grad(KILN__OP_ARGMAX));
  cr_assert(!kiln__has_grad(KILN__OP_DETACH));
  for (int i = 0; i < KILN__OP_COUNT; i++)
    cr_assert_eq(kiln__has_grad((kiln__op)i), !expect_no_grad((kiln__op)i),
                 "op %s: has a backward rule %d, expected %d", kiln__ops[i].name,
                 kiln__has_grad((kiln__op)i), !expect_no_grad((kiln__op)i));
}

/* ================================================================ 2. shapes and broadcasting */

Test(shapes, broadcasting) {
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_tensor *a = f32(ctx, KILN_SHAPE(3, 1)), *b = f32(ctx, KILN_SHAPE(4));
  kiln_tensor *c = kiln_add(a, b);
  assert_shape(c, KILN_SHAPE(3, 4));
  cr_assert(kiln_tensor_is_contiguous(c));
  ASSERT_STRIDES(c, 4, 1);
  assert_shape(kiln_mul(f32(ctx, KILN_SHAPE(2, 1, 5)), f32(ctx, KILN_SHAPE(3, 1))),
               KILN_SHAPE(2, 3, 5));
  assert_shape(kiln_sub(f32(ctx, KILN_SCALAR_SHAPE), f32(ctx, KILN_SHAPE(2, 3))), KILN_SHAPE(2, 3));
  assert_shape(kiln_where(f32(ctx, KILN_SHAPE(4, 1, 1)), f32(ctx, KILN_SHAPE(1, 3, 1)),
                          f32(ctx, KILN_SHAPE(2))),
               KILN_SHAPE(4, 3, 2));
  /* a zero-sized dim broadcasts against 1 */
  assert_shape(kiln_add(f32(ctx, KILN_SHAPE(0, 3)), f32(ctx, KILN_SHAPE(1, 3))), KILN_SHAPE(0, 3));
  th_assert_ok(ctx);
  kiln_ctx_free(ctx);
}

Test(shapes, broadcast_errors_name_the_shapes) {
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_tensor *a = f32(ctx, KILN_SHAPE(2, 3)), *b = f32(ctx, KILN_SHAPE(4, 3));
  EXPECT_FAIL(ctx, kiln_add(a, b), KILN_ERR_SHAPE, "kiln_add", "[2,3]", "[4,3]");
  EXPECT_FAIL(ctx, kiln_maximum(b, a), KILN_ERR_SHAPE, "kiln_maximum", "[4,3]", "[2,3]");
  kiln_tensor *c = f32(ctx, KILN_SHAPE(5));
  EXPECT_FAIL(ctx, kiln_where(a, a, c), KILN_ERR_SHAPE, "kiln_where", "[5]");
  kiln_ctx_free(ctx);
}

Test(shapes, matmul) {
  kiln_ctx *ctx = th_cpu_ctx();
  assert_shape(kiln_matmul(f32(ctx, KILN_SHAPE(128, 784)), f32(ctx, KILN_SHAPE(784, 10))),
               KILN_SHAPE(128, 10));
  assert_shape(kiln_matmul(f32(ctx, KILN_SHAPE(5, 2, 3)), f32(ctx, KILN_SHAPE(3, 4))),
               KILN_SHAPE(5, 2, 4));
  assert_shape(kiln_matmul(f32(ctx, KILN_SHAPE(5, 2, 3)), f32(ctx, KILN_SHAPE(5, 3, 4))),
               KILN_SHAPE(5, 2, 4));
  assert_shape(kiln_matmul(f32(ctx, KILN_SHAPE(2, 3)), f32(ctx, KILN_SHAPE(5, 3, 4))),
               KILN_SHAPE(5, 2, 4));
  /* a batch of 1 broadcasts, on either side */
  assert_shape(kiln_matmul(f32(ctx, KILN_SHAPE(1, 2, 3)), f32(ctx, KILN_SHAPE(6, 3, 4))),
               KILN_SHAPE(6, 2, 4));
  assert_shape(kiln_matmul(f32(ctx, KILN_SHAPE(6, 2, 3)), f32(ctx, KILN_SHAPE(1, 3, 4))),
               KILN_SHAPE(6, 2, 4));
  th_assert_ok(ctx);

  kiln_tensor *x = f32(ctx, KILN_SHAPE(128, 784)), *w = f32(ctx, KILN_SHAPE(512, 10));
  int32_t n0 = tlen(ctx);
  cr_assert_null(kiln_matmul(x, w));
  cr_assert_eq(tlen(ctx), n0);
  cr_assert_eq(kiln_ctx_status(ctx), KILN_ERR_SHAPE);
  cr_assert_str_eq(kiln_ctx_error(ctx), "kiln_matmul: inner dims differ: [128,784] x [512,10]");
  kiln_ctx_clear_error(ctx);

  EXPECT_FAIL(ctx, kiln_matmul(f32(ctx, KILN_SHAPE(2, 4, 3)), f32(ctx, KILN_SHAPE(3, 3, 5))),
              KILN_ERR_SHAPE, "kiln_matmul: batch dims differ", "[2,4,3]", "[3,3,5]");
  EXPECT_FAIL(ctx, kiln_matmul(f32(ctx, KILN_SHAPE(2, 2, 4, 3)), f32(ctx, KILN_SHAPE(3, 5))),
              KILN_ERR_SHAPE, "kiln_matmul", "2-D or 3-D", "[2,2,4,3]");
  EXPECT_FAIL(ctx, kiln_matmul(f32(ctx, KILN_SHAPE(3)), f32(ctx, KILN_SHAPE(3, 5))), KILN_ERR_SHAPE,
              "kiln_matmul", "[3]");
  EXPECT_FAIL(ctx, kiln_matmul(i32(ctx, KILN_SHAPE(2, 3)), f32(ctx, KILN_SHAPE(3, 5))),
              KILN_ERR_DTYPE, "kiln_matmul", "i32");
  kiln_ctx_free(ctx);
}

Test(shapes, matmul_reads_transposed_and_row_strided_operands_without_copies) {
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_tensor *x = f32(ctx, KILN_SHAPE(4, 8)), *w = f32(ctx, KILN_SHAPE(6, 8));
  int32_t n0 = tlen(ctx);
  kiln_tensor *y = kiln_matmul(x, kiln_transpose(w, 0, 1));
  assert_shape(y, KILN_SHAPE(4, 6));
  ASSERT_OPS_FROM(ctx, n0, KILN__OP_PERMUTE, KILN__OP_MATMUL);
  /* the first 5 columns of each row: rows are dense, the leading dimension is 8 */
  n0 = tlen(ctx);
  kiln_tensor *cols = kiln_slice(x, 1, 0, 5, 1);
  ASSERT_STRIDES(cols, 8, 1);
  assert_shape(kiln_matmul(cols, f32(ctx, KILN_SHAPE(5, 2))), KILN_SHAPE(4, 2));
  ASSERT_OPS_FROM(ctx, n0, KILN__OP_SLICE, KILN__OP_MATMUL);
  /* every other column: neither rows nor columns are dense, so the operand is copied */
  n0 = tlen(ctx);
  kiln_tensor *odd = kiln_slice(x, 1, 1, 8, 2);
  ASSERT_STRIDES(odd, 8, 2);
  assert_shape(kiln_matmul(odd, f32(ctx, KILN_SHAPE(4, 2))), KILN_SHAPE(4, 2));
  ASSERT_OPS_FROM(ctx, n0, KILN__OP_SLICE, KILN__OP_COPY, KILN__OP_MATMUL);
  cr_assert(kiln_tensor_is_contiguous(node_at(ctx, -1)->in[0]));
  th_assert_ok(ctx);
  kiln_ctx_free(ctx);
}

Test(shapes, reductions) {
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_tensor *a = f32(ctx, KILN_SHAPE(2, 3, 4, 5));
  kiln_tensor *s = kiln_sum(a, KILN_AXES(1, 3), 0);
  assert_shape(s, KILN_SHAPE(2, 4));
  cr_assert_eq(node_at(ctx, -1)->i[0], 0xa, "mask 0x%llx", (long long)node_at(ctx, -1)->i[0]);
  cr_assert_eq(node_at(ctx, -1)->f[0], 1.f);
  assert_shape(kiln_sum(a, KILN_AXES(1, 3), 1), KILN_SHAPE(2, 1, 4, 1));
  assert_shape(kiln_max(a, KILN_AXES(-1), 0), KILN_SHAPE(2, 3, 4));
  assert_shape(kiln_max(a, KILN_AXES(-4, -2), 1), KILN_SHAPE(1, 3, 1, 5));
  cr_assert_eq(node_at(ctx, -1)->i[0], 0x5);
  kiln_tensor *m = kiln_mean(a, KILN_ALL_AXES, 0);
  assert_shape(m, KILN_SCALAR_SHAPE);
  cr_assert_eq(node_at(ctx, -1)->op, KILN__OP_SUM);
  cr_assert_eq(node_at(ctx, -1)->i[0], 0xf);
  cr_assert_float_eq(node_at(ctx, -1)->f[0], 1.f / 120.f, 1e-9);
  assert_shape(kiln_mean(a, KILN_ALL_AXES, 1), KILN_SHAPE(1, 1, 1, 1));
  assert_shape(kiln_mean(a, KILN_AXES(0), 0), KILN_SHAPE(3, 4, 5));
  cr_assert_float_eq(node_at(ctx, -1)->f[0], 0.5f, 1e-9);
  kiln_tensor *am = kiln_argmax(a, -1, 0);
  assert_shape(am, KILN_SHAPE(2, 3, 4));
  cr_assert_eq(kiln_tensor_dtype(am), KILN_DTYPE_I32);
  assert_shape(kiln_argmax(a, 1, 1), KILN_SHAPE(2, 1, 4, 5));
  /* a sum over an empty axis is zeros; a max over one has no value */
  kiln_tensor *e = f32(ctx, KILN_SHAPE(0, 3));
  assert_shape(kiln_sum(e, KILN_AXES(0), 0), KILN_SHAPE(3));
  th_assert_ok(ctx);

  EXPECT_FAIL(ctx, kiln_max(e, KILN_AXES(0), 0), KILN_ERR_SHAPE, "kiln_max", "empty axis 0",
              "[0,3]");
  EXPECT_FAIL(ctx, kiln_sum(a, KILN_AXES(1, -3), 0), KILN_ERR_INVALID, "kiln_sum",
              "axis -3 given twice");
  EXPECT_FAIL(ctx, kiln_mean(a, KILN_AXES(4), 0), KILN_ERR_SHAPE, "kiln_mean", "axis 4",
              "[2,3,4,5]");
  EXPECT_FAIL(ctx, kiln_max(a, KILN_AXES(-5), 1), KILN_ERR_SHAPE, "kiln_max", "axis -5");
  EXPECT_FAIL(ctx, kiln_argmax(a, 4, 0), KILN_ERR_SHAPE, "kiln_argmax", "axis 4");
  kiln_axes too_many = {.n = 7};
  EXPECT_FAIL(ctx, kiln_sum(a, too_many, 0), KILN_ERR_INVALID, "kiln_sum", "7 axes");
  EXPECT_FAIL(ctx, kiln_sum(i32(ctx, KILN_SHAPE(3)), KILN_ALL_AXES, 0), KILN_ERR_DTYPE, "kiln_sum",
              "i32");
  kiln_ctx_free(ctx);
}

Test(shapes, softmax_and_log_softmax) {
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_tensor *a = param(ctx, KILN_SHAPE(4, 7));
  int32_t n0 = tlen(ctx);
  kiln_tensor *s = kiln_softmax(a, -1);
  assert_shape(s, KILN_SHAPE(4, 7));
  ASSERT_OPS_FROM(ctx, n0, KILN__OP_MAX, KILN__OP_SUB, KILN__OP_EXP, KILN__OP_SUM, KILN__OP_DIV);
  /* the max only steadies the exponent: no gradient goes through it */
  cr_assert(!node_at(ctx, n0)->out->requires_grad);
  cr_assert(kiln_tensor_requires_grad(s));
  assert_shape(node_at(ctx, n0)->out, KILN_SHAPE(4, 1));
  cr_assert(kiln_grad_enabled(ctx), "softmax left grad mode off");
  n0 = tlen(ctx);
  assert_shape(kiln_log_softmax(a, 0), KILN_SHAPE(4, 7));
  ASSERT_OPS_FROM(ctx, n0, KILN__OP_MAX, KILN__OP_SUB, KILN__OP_EXP, KILN__OP_SUM, KILN__OP_LOG,
                  KILN__OP_SUB);
  assert_shape(node_at(ctx, n0)->out, KILN_SHAPE(1, 7));
  EXPECT_FAIL(ctx, kiln_softmax(a, 2), KILN_ERR_SHAPE, "kiln_softmax", "axis 2", "[4,7]");
  kiln_ctx_free(ctx);
}

Test(shapes, reshape) {
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_tensor *a = f32(ctx, KILN_SHAPE(2, 3, 4));
  int32_t n0 = tlen(ctx);
  kiln_tensor *r = kiln_reshape(a, KILN_SHAPE(-1, 4));
  assert_shape(r, KILN_SHAPE(6, 4));
  ASSERT_OPS_FROM(ctx, n0, KILN__OP_RESHAPE);
  cr_assert_eq(r->st, a->st, "a reshape of a contiguous tensor is a view");
  assert_shape(kiln_reshape(a, KILN_SHAPE(4, -1, 2)), KILN_SHAPE(4, 3, 2));
  assert_shape(kiln_reshape(a, KILN_SHAPE(24)), KILN_SHAPE(24));
  assert_shape(
      kiln_reshape(kiln_reshape(f32(ctx, KILN_SHAPE(1)), KILN_SCALAR_SHAPE), KILN_SHAPE(1, 1)),
      KILN_SHAPE(1, 1));
  /* a transposed tensor is copied first */
  n0 = tlen(ctx);
  assert_shape(kiln_reshape(kiln_transpose(a, 0, 2), KILN_SHAPE(4, 6)), KILN_SHAPE(4, 6));
  ASSERT_OPS_FROM(ctx, n0, KILN__OP_PERMUTE, KILN__OP_COPY, KILN__OP_RESHAPE);
  th_assert_ok(ctx);

  EXPECT_FAIL(ctx, kiln_reshape(a, KILN_SHAPE(5, -1)), KILN_ERR_SHAPE,
              "kiln_reshape: cannot reshape [2,3,4] into [5,-1]");
  EXPECT_FAIL(ctx, kiln_reshape(a, KILN_SHAPE(-1, -1)), KILN_ERR_SHAPE, "kiln_reshape",
              "more than one -1");
  EXPECT_FAIL(ctx, kiln_reshape(a, KILN_SHAPE(7, 3)), KILN_ERR_SHAPE,
              "kiln_reshape: cannot reshape [2,3,4] (24 elements) into [7,3] (21)");
  EXPECT_FAIL(ctx, kiln_reshape(a, KILN_SHAPE(-2, -12)), KILN_ERR_SHAPE, "kiln_reshape",
              "bad size -2");
  EXPECT_FAIL(ctx, kiln_reshape(a, KILN_SHAPE(0, -1)), KILN_ERR_SHAPE, "kiln_reshape");
  kiln_shape seven = {.ndim = 7};
  EXPECT_FAIL(ctx, kiln_reshape(a, seven), KILN_ERR_SHAPE, "kiln_reshape", "7 dims");
  kiln_ctx_free(ctx);
}

Test(shapes, permute_and_transpose_are_views) {
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_tensor *a = f32(ctx, KILN_SHAPE(2, 3, 4));
  ASSERT_STRIDES(a, 12, 4, 1);
  int32_t n0 = tlen(ctx);
  kiln_tensor *t = kiln_transpose(a, 0, 2);
  assert_shape(t, KILN_SHAPE(4, 3, 2));
  ASSERT_STRIDES(t, 1, 4, 12);
  cr_assert(!kiln_tensor_is_contiguous(t));
  cr_assert(!kiln_tensor_is_persistent(t));
  cr_assert_eq(t->st, a->st, "a transpose shares its input's storage");
  ASSERT_OPS_FROM(ctx, n0, KILN__OP_PERMUTE); /* one view node, no copy */

  kiln_tensor *p = kiln_permute(a, KILN_AXES(1, 2, 0));
  assert_shape(p, KILN_SHAPE(3, 4, 2));
  ASSERT_STRIDES(p, 4, 1, 12);
  kiln__node *n = node_at(ctx, -1);
  cr_assert(n->i[0] == 1 && n->i[1] == 2 && n->i[2] == 0, "permute order %lld %lld %lld",
            (long long)n->i[0], (long long)n->i[1], (long long)n->i[2]);
  kiln_tensor *q = kiln_permute(a, KILN_AXES(-1, 0, 1));
  assert_shape(q, KILN_SHAPE(4, 2, 3));
  cr_assert_eq(node_at(ctx, -1)->i[0], 2, "negative axes are stored normalised");
  assert_shape(kiln_transpose(a, -1, -2), KILN_SHAPE(2, 4, 3));
  /* permuting back gives contiguous strides */
  cr_assert(kiln_tensor_is_contiguous(kiln_transpose(t, 0, 2)));
  cr_assert_eq(kiln_contiguous(a), a, "kiln_contiguous of a contiguous tensor is itself");
  th_assert_ok(ctx);

  EXPECT_FAIL(ctx, kiln_permute(a, KILN_AXES(0, 1)), KILN_ERR_SHAPE, "kiln_permute", "2 axes given",
              "[2,3,4]");
  EXPECT_FAIL(ctx, kiln_permute(a, KILN_AXES(0, 1, 1)), KILN_ERR_SHAPE, "kiln_permute",
              "not a permutation");
  EXPECT_FAIL(ctx, kiln_permute(a, KILN_AXES(0, 1, 3)), KILN_ERR_SHAPE, "kiln_permute");
  EXPECT_FAIL(ctx, kiln_transpose(a, 0, 3), KILN_ERR_SHAPE, "kiln_transpose", "axis 3");
  kiln_ctx_free(ctx);
}

Test(shapes, slice) {
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_tensor *v = f32(ctx, KILN_SHAPE(10));
  int32_t n0 = tlen(ctx);
  /* [-8:-1:3] of 10 is elements 2, 5, 8 */
  kiln_tensor *s = kiln_slice(v, 0, -8, -1, 3);
  assert_shape(s, KILN_SHAPE(3));
  ASSERT_STRIDES(s, 3);
  cr_assert_eq(s->offset, 2);
  cr_assert_eq(s->st, v->st);
  ASSERT_OPS_FROM(ctx, n0, KILN__OP_SLICE);
  kiln__node *n = node_at(ctx, -1);
  cr_assert(n->i[0] == 0 && n->i[1] == 2 && n->i[2] == 3, "slice attributes %lld %lld %lld",
            (long long)n->i[0], (long long)n->i[1], (long long)n->i[2]);
  /* out-of-range bounds clamp */
  assert_shape(kiln_slice(v, 0, -100, 100, 1), KILN_SHAPE(10));
  cr_assert_eq(node_at(ctx, -1)->out->offset, 0);
  assert_shape(kiln_slice(v, 0, 7, 3, 1), KILN_SHAPE(0));
  assert_shape(kiln_slice(v, 0, 12, 20, 1), KILN_SHAPE(0));
  assert_shape(kiln_slice(v, 0, 0, 10, 4), KILN_SHAPE(3)); /* 0, 4, 8 */
  assert_shape(kiln_slice(v, 0, 3, 5, 10), KILN_SHAPE(1));

  kiln_tensor *a = f32(ctx, KILN_SHAPE(4, 6));
  kiln_tensor *c = kiln_slice(a, -1, 1, 100, 2); /* columns 1, 3, 5 */
  assert_shape(c, KILN_SHAPE(4, 3));
  ASSERT_STRIDES(c, 6, 2);
  cr_assert_eq(c->offset, 1);
  cr_assert(!kiln_tensor_is_contiguous(c));
  kiln_tensor *r = kiln_slice(a, 0, 1, 3, 1); /* rows 1 and 2: still contiguous */
  assert_shape(r, KILN_SHAPE(2, 6));
  ASSERT_STRIDES(r, 6, 1);
  cr_assert_eq(r->offset, 6);
  cr_assert(kiln_tensor_is_contiguous(r));
  /* a slice of a slice composes offsets and strides */
  kiln_tensor *rc = kiln_slice(r, 1, 2, 6, 3); /* columns 2 and 5 of rows 1, 2 */
  assert_shape(rc, KILN_SHAPE(2, 2));
  ASSERT_STRIDES(rc, 6, 3);
  cr_assert_eq(rc->offset, 8);
  th_assert_ok(ctx);

  EXPECT_FAIL(ctx, kiln_slice(v, 0, 0, 5, 0), KILN_ERR_INVALID, "kiln_slice", "step 0");
  EXPECT_FAIL(ctx, kiln_slice(v, 0, 0, 5, -1), KILN_ERR_INVALID, "kiln_slice", "step -1");
  EXPECT_FAIL(ctx, kiln_slice(a, 2, 0, 5, 1), KILN_ERR_SHAPE, "kiln_slice", "axis 2");
  kiln_ctx_free(ctx);
}

Test(shapes, expand) {
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_tensor *a = f32(ctx, KILN_SHAPE(3, 1));
  int32_t n0 = tlen(ctx);
  kiln_tensor *e = kiln_expand(a, KILN_SHAPE(2, 3, 4));
  assert_shape(e, KILN_SHAPE(2, 3, 4));
  ASSERT_STRIDES(e, 0, 1, 0);
  cr_assert_eq(e->st, a->st);
  ASSERT_OPS_FROM(ctx, n0, KILN__OP_EXPAND);
  assert_shape(kiln_expand(a, KILN_SHAPE(-1, 5)), KILN_SHAPE(3, 5));
  assert_shape(kiln_expand(a, KILN_SHAPE(3, 1)), KILN_SHAPE(3, 1));
  th_assert_ok(ctx);
  EXPECT_FAIL(ctx, kiln_expand(f32(ctx, KILN_SHAPE(3, 2)), KILN_SHAPE(3, 4)), KILN_ERR_SHAPE,
              "kiln_expand: cannot expand [3,2] to [3,4]");
  EXPECT_FAIL(ctx, kiln_expand(a, KILN_SHAPE(3)), KILN_ERR_SHAPE, "kiln_expand", "[3,1]");
  EXPECT_FAIL(ctx, kiln_expand(a, KILN_SHAPE(-1, 3, 1)), KILN_ERR_SHAPE, "kiln_expand");
  kiln_ctx_free(ctx);
}

Test(shapes, concat) {
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_tensor *a = f32(ctx, KILN_SHAPE(2, 3)), *b = f32(ctx, KILN_SHAPE(2, 5));
  kiln_tensor *ab[2] = {a, b};
  int32_t n0 = tlen(ctx);
  kiln_tensor *c = kiln_concat(2, ab, 1);
  assert_shape(c, KILN_SHAPE(2, 8));
  ASSERT_OPS_FROM(ctx, n0, KILN__OP_CONCAT);
  cr_assert_eq(node_at(ctx, -1)->i[0], 1);
  cr_assert_eq(node_at(ctx, -1)->nin, 2);
  assert_shape(kiln_concat(2, ab, -1), KILN_SHAPE(2, 8));
  cr_assert_eq(node_at(ctx, -1)->i[0], 1, "the axis is stored normalised");
  cr_assert_eq(kiln_concat(1, ab, 0), a, "a concat of one tensor is that tensor");
  /* more inputs than one node takes: in pieces of at most KILN__MAX_IN */
  kiln_tensor *many[10];
  for (int i = 0; i < 10; i++)
    many[i] = f32(ctx, KILN_SHAPE(i + 1, 3));
  n0 = tlen(ctx);
  kiln_tensor *m = kiln_concat(10, many, 0);
  assert_shape(m, KILN_SHAPE(55, 3));
  for (int32_t i = n0; i < tlen(ctx); i++) {
    cr_assert_eq(node_at(ctx, i)->op, KILN__OP_CONCAT);
    cr_assert_leq(node_at(ctx, i)->nin, KILN__MAX_IN);
  }
  cr_assert_gt(tlen(ctx) - n0, 1);
  /* i32 tensors concatenate too */
  kiln_tensor *ii[2] = {i32(ctx, KILN_SHAPE(4)), i32(ctx, KILN_SHAPE(2))};
  kiln_tensor *ic = kiln_concat(2, ii, 0);
  assert_shape(ic, KILN_SHAPE(6));
  cr_assert_eq(kiln_tensor_dtype(ic), KILN_DTYPE_I32);
  th_assert_ok(ctx);

  kiln_tensor *bad[2] = {a, f32(ctx, KILN_SHAPE(3, 5))};
  EXPECT_FAIL(ctx, kiln_concat(2, bad, 1), KILN_ERR_SHAPE, "kiln_concat", "input 1", "[3,5]",
              "[2,3]", "axis 1");
  kiln_tensor *bad_nd[2] = {a, f32(ctx, KILN_SHAPE(2, 3, 1))};
  EXPECT_FAIL(ctx, kiln_concat(2, bad_nd, 0), KILN_ERR_SHAPE, "kiln_concat", "[2,3,1]");
  kiln_tensor *bad_dt[2] = {a, i32(ctx, KILN_SHAPE(2, 3))};
  EXPECT_FAIL(ctx, kiln_concat(2, bad_dt, 0), KILN_ERR_DTYPE, "kiln_concat", "i32");
  EXPECT_FAIL(ctx, kiln_concat(2, ab, 2), KILN_ERR_SHAPE, "kiln_concat", "axis 2");
  cr_assert_null(kiln_concat(0, ab, 0));
  kiln_ctx_free(ctx);
}

Test(shapes, index_select_cast_full_and_dropout) {
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_tensor *a = f32(ctx, KILN_SHAPE(7, 3, 2)), *idx = i32(ctx, KILN_SHAPE(4));
  kiln_tensor *g = kiln_index_select(a, idx);
  assert_shape(g, KILN_SHAPE(4, 3, 2));
  cr_assert_eq(node_at(ctx, -1)->op, KILN__OP_INDEX_SELECT);
  /* a non-contiguous table is made contiguous first */
  int32_t n0 = tlen(ctx);
  assert_shape(kiln_index_select(kiln_transpose(a, 1, 2), idx), KILN_SHAPE(4, 2, 3));
  ASSERT_OPS_FROM(ctx, n0, KILN__OP_PERMUTE, KILN__OP_COPY, KILN__OP_INDEX_SELECT);

  kiln_tensor *c = kiln_cast(a, KILN_DTYPE_I32);
  assert_shape(c, KILN_SHAPE(7, 3, 2));
  cr_assert_eq(kiln_tensor_dtype(c), KILN_DTYPE_I32);
  cr_assert_eq(kiln_tensor_dtype(kiln_cast(c, KILN_DTYPE_F32)), KILN_DTYPE_F32);
  kiln_tensor *f = kiln_full(ctx, KILN_SHAPE(2, 2), 3.5f);
  assert_shape(f, KILN_SHAPE(2, 2));
  cr_assert_eq(node_at(ctx, -1)->op, KILN__OP_FILL);
  cr_assert_eq(node_at(ctx, -1)->nin, 0);
  cr_assert_eq(node_at(ctx, -1)->f[0], 3.5f);

  kiln_manual_seed(ctx, 42);
  kiln_tensor *d1 = kiln_dropout(a, 0.25f, 1), *d2 = kiln_dropout(a, 0.25f, 1);
  assert_shape(d1, KILN_SHAPE(7, 3, 2));
  kiln__node *n1 = node_at(ctx, d1->node), *n2 = node_at(ctx, d2->node);
  cr_assert_eq(n1->op, KILN__OP_DROPOUT);
  cr_assert_eq(n1->f[0], 0.25f);
  cr_assert_float_eq(n1->f[1], 1.f / 0.75f, 1e-6);
  cr_assert_eq(n1->u[0], 42u, "the seed");
  cr_assert_eq(n1->u[1], 0u, "the first offset after seeding");
  cr_assert_eq(n2->u[1], 1u, "every dropout call draws a fresh offset");
  n0 = tlen(ctx);
  cr_assert_eq(kiln_dropout(a, 0.5f, 0), a, "dropout in eval mode is the identity");
  cr_assert_eq(kiln_dropout(a, 0.f, 1), a, "dropout with p 0 is the identity");
  cr_assert_eq(tlen(ctx), n0);
  th_assert_ok(ctx);

  EXPECT_FAIL(ctx, kiln_index_select(a, f32(ctx, KILN_SHAPE(4))), KILN_ERR_DTYPE,
              "kiln_index_select", "f32");
  EXPECT_FAIL(ctx, kiln_index_select(a, i32(ctx, KILN_SHAPE(2, 2))), KILN_ERR_SHAPE,
              "kiln_index_select", "[2,2]");
  EXPECT_FAIL(ctx, kiln_cast(a, KILN_DTYPE_BF16), KILN_ERR_DTYPE, "kiln_cast", "bf16");
  EXPECT_FAIL(ctx, kiln_dropout(a, 1.5f, 1), KILN_ERR_INVALID, "kiln_dropout", "1.5");
  EXPECT_FAIL(ctx, kiln_full(ctx, KILN_SHAPE(2, -1), 0.f), KILN_ERR_SHAPE, "kiln_full");
  EXPECT_FAIL(ctx, kiln_clamp(a, 1.f, -1.f), KILN_ERR_INVALID, "kiln_clamp");
  EXPECT_FAIL(ctx, kiln_gelu(a, (kiln_gelu_approx)7), KILN_ERR_INVALID, "kiln_gelu", "7");
  kiln_ctx_free(ctx);
}

Test(shapes, cross_entropy) {
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_tensor *logits = param(ctx, KILN_SHAPE(8, 10)), *labels = i32(ctx, KILN_SHAPE(8));
  int32_t n0 = tlen(ctx);
  kiln_tensor *loss = kiln_cross_entropy(logits, labels, KILN_REDUCTION_MEAN, 0.f);
  assert_shape(loss, KILN_SCALAR_SHAPE);
  cr_assert(kiln_tensor_requires_grad(loss));
  ASSERT_OPS_FROM(ctx, n0, KILN__OP_MAX, KILN__OP_SUB, KILN__OP_EXP, KILN__OP_SUM, KILN__OP_LOG,
                  KILN__OP_SUB, KILN__OP_RESHAPE, KILN__OP_ONEHOT, KILN__OP_MUL, KILN__OP_SUM,
                  KILN__OP_NEG, KILN__OP_SUM);
  cr_assert_float_eq(node_at(ctx, -1)->f[0], 1.f / 8.f, 1e-9);
  kiln__node *oh = node_at(ctx, n0 + 7);
  cr_assert_eq(oh->i[7], 1, "one-hot along the class axis");
  assert_shape(oh->out, KILN_SHAPE(8, 10));
  assert_shape(oh->in[0], KILN_SHAPE(8, 1));

  assert_shape(kiln_cross_entropy(logits, labels, KILN_REDUCTION_NONE, 0.f), KILN_SHAPE(8));
  cr_assert_eq(node_at(ctx, -1)->op, KILN__OP_NEG);
  assert_shape(kiln_cross_entropy(logits, labels, KILN_REDUCTION_SUM, 0.f), KILN_SCALAR_SHAPE);
  cr_assert_eq(node_at(ctx, -1)->f[0], 1.f);
  /* label smoothing mixes the one-hot target with the uniform one */
  n0 = tlen(ctx);
  kiln_cross_entropy(logits, labels, KILN_REDUCTION_MEAN, 0.1f);
  kiln__node *ms = node_at(ctx, n0 + 8), *as = node_at(ctx, n0 + 9);
  cr_assert_eq(ms->op, KILN__OP_MUL_SCALAR);
  cr_assert_float_eq(ms->f[0], 0.9f, 1e-7);
  cr_assert_eq(as->op, KILN__OP_ADD_SCALAR);
  cr_assert_float_eq(as->f[0], 0.01f, 1e-7);
  th_assert_ok(ctx);

  EXPECT_FAIL(ctx,
              kiln_cross_entropy(f32(ctx, KILN_SHAPE(8, 10, 1)), labels, KILN_REDUCTION_MEAN, 0.f),
              KILN_ERR_SHAPE, "kiln_cross_entropy", "[8,10,1]", "[8]");
  EXPECT_FAIL(ctx, kiln_cross_entropy(logits, i32(ctx, KILN_SHAPE(7)), KILN_REDUCTION_MEAN, 0.f),
              KILN_ERR_SHAPE, "kiln_cross_entropy", "[8,10]", "[7]");
  EXPECT_FAIL(ctx, kiln_cross_entropy(logits, f32(ctx, KILN_SHAPE(8)), KILN_REDUCTION_MEAN, 0.f),
              KILN_ERR_DTYPE, "kiln_cross_entropy", "labels are f32");
  EXPECT_FAIL(ctx,
              kiln_cross_entropy(i32(ctx, KILN_SHAPE(8, 10)), labels, KILN_REDUCTION_MEAN, 0.f),
              KILN_ERR_DTYPE, "kiln_cross_entropy", "i32");
  EXPECT_FAIL(ctx, kiln_cross_entropy(logits, labels, KILN_REDUCTION_MEAN, 1.5f), KILN_ERR_INVALID,
              "kiln_cross_entropy", "label_smoothing");
  EXPECT_FAIL(ctx, kiln_cross_entropy(logits, labels, (kiln_reduction)9, 0.f), KILN_ERR_INVALID,
              "kiln_cross_entropy", "reduction 9");
  kiln_ctx_free(ctx);
}

Test(shapes, dtypes) {
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_tensor *a = f32(ctx, KILN_SHAPE(3)), *n = i32(ctx, KILN_SHAPE(3));
  cr_assert_eq(kiln_dtype_size(KILN_DTYPE_F32), 4u);
  cr_assert_eq(kiln_dtype_size(KILN_DTYPE_BF16), 2u);
  cr_assert_str_eq(kiln_dtype_name(KILN_DTYPE_I32), "i32");
  EXPECT_FAIL(ctx, kiln_add(n, a), KILN_ERR_DTYPE, "kiln_add: input 0 is i32");
  EXPECT_FAIL(ctx, kiln_add(a, n), KILN_ERR_DTYPE, "kiln_add: input 1 is i32");
  EXPECT_FAIL(ctx, kiln_relu(n), KILN_ERR_DTYPE, "kiln_relu", "i32");
  EXPECT_FAIL(ctx, kiln_argmax(n, 0, 0), KILN_ERR_DTYPE, "kiln_argmax", "i32");
  EXPECT_FAIL(ctx, kiln_tensor_new(ctx, KILN_DTYPE_BF16, KILN_SHAPE(2)), KILN_ERR_DTYPE,
              "kiln_tensor_new", "bf16");
  EXPECT_FAIL(ctx, kiln_tensor_new(ctx, KILN_DTYPE_F16, KILN_SHAPE(2)), KILN_ERR_DTYPE,
              "kiln_tensor_new", "f16");
  float h[2] = {1, 2};
  EXPECT_FAIL(ctx, kiln_tensor_from_host(ctx, KILN_DTYPE_BF16, KILN_SHAPE(2), h), KILN_ERR_DTYPE,
              "kiln_tensor_from_host", "bf16");
  EXPECT_FAIL(ctx, kiln_tensor_new(ctx, (kiln_dtype)17, KILN_SHAPE(2)), KILN_ERR_DTYPE,
              "unknown dtype 17");
  EXPECT_FAIL(ctx, kiln_tensor_new(ctx, KILN_DTYPE_F32, KILN_SHAPE(2, -3)), KILN_ERR_SHAPE,
              "kiln_tensor_new", "-3");
  kiln_shape seven = {.ndim = 7};
  EXPECT_FAIL(ctx, kiln_tensor_new(ctx, KILN_DTYPE_F32, seven), KILN_ERR_SHAPE, "7 dims");
  /* only persistent f32 tensors can require grad */
  kiln_tensor_set_requires_grad(n, 1);
  ASSERT_ERROR(ctx, KILN_ERR_INVALID, "kiln_tensor_set_requires_grad", "i32");
  cr_assert(!kiln_tensor_requires_grad(n));
  kiln_ctx_clear_error(ctx);
  kiln_tensor_set_requires_grad(kiln_relu(a), 1);
  ASSERT_ERROR(ctx, KILN_ERR_INVALID, "kiln_tensor_set_requires_grad", "intermediate");
  kiln_ctx_free(ctx);
}

Test(shapes, accessors_and_shape_strings) {
  kiln_ctx *ctx = th_cpu_ctx();
  cr_assert(!kiln_ctx_has_gpu(ctx));
  kiln_tensor *a = f32(ctx, KILN_SHAPE(2, 3, 4));
  cr_assert_eq(kiln_tensor_ctx(a), ctx);
  cr_assert_eq(kiln_tensor_ndim(a), 3);
  cr_assert_eq(kiln_tensor_dim(a, -1), 4);
  cr_assert_eq(kiln_tensor_dim(a, 0), 2);
  cr_assert_eq(kiln_tensor_dim(a, 3), 0, "an axis out of range has size 0");
  cr_assert_eq(kiln_tensor_numel(a), 24);
  cr_assert(kiln_tensor_is_persistent(a));
  kiln_tensor_set_name(a, "alpha");
  cr_assert_str_eq(kiln_tensor_name(a), "alpha");
  char buf[64];
  cr_assert_str_eq(kiln_shape_str(KILN_SHAPE(128, 784), buf, sizeof buf), "[128,784]");
  cr_assert_str_eq(kiln_shape_str(KILN_SCALAR_SHAPE, buf, sizeof buf), "[]");
  cr_assert_str_eq(kiln_shape_str(KILN_SHAPE(1, 2, 3), buf, 5), "[1,2");
  cr_assert_eq(kiln_tensor_numel(kiln_full(ctx, KILN_SCALAR_SHAPE, 1.f)), 1);
  cr_assert_str_eq(kiln_status_name(KILN_ERR_SHAPE), "shape mismatch");
  cr_assert_str_eq(kiln_version(), "0.1.0");
  kiln_ctx_free(ctx);
}

/* ================================================================ 3. sticky errors */

Test(errors, sticky_until_cleared) {
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_tensor *a = f32(ctx, KILN_SHAPE(2, 3)), *b = f32(ctx, KILN_SHAPE(4, 3));
  kiln_tensor *labels = i32(ctx, KILN_SHAPE(2));
  cr_assert_null(kiln_add(a, b));
  const char *first = "kiln_add: shapes [2,3] and [4,3] do not broadcast";
  cr_assert_not_null(strstr(kiln_ctx_error(ctx), first), "message: %s", kiln_ctx_error(ctx));
  int32_t n0 = tlen(ctx);
  kiln_exec_stats st0, st1;
  kiln_stats(ctx, &st0);
  /* every later call records nothing and keeps the first message */
  cr_assert_null(kiln_relu(a));
  cr_assert_null(kiln_matmul(a, kiln_transpose(b, 0, 1)));
  cr_assert_null(kiln_reshape(a, KILN_SHAPE(6)));
  cr_assert_null(kiln_full(ctx, KILN_SHAPE(2), 1.f));
  cr_assert_null(kiln_tensor_new(ctx, KILN_DTYPE_F32, KILN_SHAPE(2)));
  cr_assert_null(kiln_cross_entropy(a, labels, KILN_REDUCTION_MEAN, 0.f));
  cr_assert_null(kiln_clamp(a, 1.f, 0.f));
  cr_assert_eq(kiln_backward(a), KILN_ERR_SHAPE);
  cr_assert_eq(tlen(ctx), n0, "a failed context recorded %d nodes", tlen(ctx) - n0);
  kiln_stats(ctx, &st1);
  cr_assert_eq(st1.nodes_recorded, st0.nodes_recorded);
  ASSERT_ERROR(ctx, KILN_ERR_SHAPE, first);
  cr_assert_null(strstr(kiln_ctx_error(ctx), "clamp"), "a later error replaced the first");

  kiln_ctx_clear_error(ctx);
  cr_assert_null(kiln_ctx_error(ctx));
  cr_assert_eq(kiln_ctx_status(ctx), KILN_OK);
  kiln_tensor *r = kiln_relu(a);
  cr_assert_not_null(r, "the context works again after kiln_ctx_clear_error");
  cr_assert_eq(tlen(ctx), n0 + 1);
  kiln_ctx_free(ctx);
}

Test(errors, null_inputs) {
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_tensor *a = f32(ctx, KILN_SHAPE(3));
  int32_t n0 = tlen(ctx);
  cr_assert_null(kiln_relu(NULL));
  cr_assert_null(kiln_add(NULL, NULL));
  cr_assert_null(kiln_gelu(NULL, KILN_GELU_TANH));
  cr_assert_null(kiln_sum(NULL, KILN_ALL_AXES, 0));
  cr_assert_null(kiln_slice(NULL, 0, 0, 1, 1));
  cr_assert_null(kiln_clamp(NULL, 0.f, 1.f));
  cr_assert_null(kiln_full(NULL, KILN_SHAPE(1), 0.f));
  cr_assert_eq(kiln_backward(NULL), KILN_ERR_INVALID);
  cr_assert_null(kiln_ctx_error(ctx), "NULL inputs with no context touch no context");
  /* NULL next to a real tensor: NULL, nothing recorded, an error naming the op */
  cr_assert_null(kiln_add(a, NULL));
  ASSERT_ERROR(ctx, KILN_ERR_INVALID, "kiln_add", "NULL");
  kiln_ctx_clear_error(ctx);
  kiln_tensor *ts[2] = {a, NULL};
  cr_assert_null(kiln_concat(2, ts, 0));
  ASSERT_ERROR(ctx, KILN_ERR_INVALID, "kiln_concat", "NULL");
  kiln_ctx_clear_error(ctx);
  cr_assert_eq(tlen(ctx), n0);
  /* a chain of calls fails once: the first failure is the message */
  kiln_tensor *y = kiln_relu(kiln_exp(kiln_add(a, f32(ctx, KILN_SHAPE(4)))));
  cr_assert_null(y);
  ASSERT_ERROR(ctx, KILN_ERR_SHAPE, "kiln_add", "[3]", "[4]");
  cr_assert_eq(tlen(ctx), n0);
  kiln_ctx_free(ctx);
}

Test(errors, tensors_of_another_context) {
  kiln_ctx *c1 = th_cpu_ctx(), *c2 = th_cpu_ctx();
  kiln_tensor *a = f32(c1, KILN_SHAPE(3)), *b = f32(c2, KILN_SHAPE(3));
  cr_assert_null(kiln_add(a, b));
  ASSERT_ERROR(c1, KILN_ERR_INVALID, "kiln_add", "another context");
  cr_assert_eq(tlen(c1), 0);
  cr_assert_eq(tlen(c2), 0);
  kiln_ctx_free(c1);
  kiln_ctx_free(c2);
}

Test(errors, no_gpu_context_cannot_run) {
  kiln_ctx *ctx = th_cpu_ctx();
  cr_assert_eq(kiln_sync(ctx), KILN_OK, "nothing recorded: nothing to run");
  kiln_tensor *a = f32(ctx, KILN_SHAPE(3));
  float h[3] = {1, 2, 3};
  cr_assert_eq(kiln_tensor_copy_from_host(a, h, sizeof h), KILN_OK);
  cr_assert_eq(kiln_tensor_copy_from_host(a, h, 2 * sizeof(float)), KILN_ERR_INVALID);
  ASSERT_ERROR(ctx, KILN_ERR_INVALID, "kiln_tensor_copy_from_host", "8 bytes", "12 bytes");
  kiln_ctx_clear_error(ctx);
  cr_assert_eq(kiln_tensor_to_host(a, h, sizeof h), KILN_ERR_STATE);
  ASSERT_ERROR(ctx, KILN_ERR_STATE, "kiln_tensor_to_host", "no GPU");
  kiln_ctx_clear_error(ctx);
  cr_assert(isnan(kiln_tensor_item(kiln_sum(a, KILN_ALL_AXES, 0))));
  kiln_ctx_clear_error(ctx);
  kiln_relu(a);
  cr_assert_eq(kiln_sync(ctx), KILN_ERR_STATE);
  ASSERT_ERROR(ctx, KILN_ERR_STATE, "no GPU", "cannot run");
  kiln_ctx_free(ctx);
}

/* ================================================================ 4. trace and tape */

Test(trace, linear_layer_records_permute_matmul_add) {
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_params *p = kiln_params_new(ctx);
  kiln_linear l;
  cr_assert_eq(kiln_linear_init(&l, p, "fc", 784, 512, 1), KILN_OK);
  cr_assert_eq(kiln_params_count(p), 2);
  cr_assert_str_eq(kiln_params_name(p, 0), "fc.weight");
  cr_assert_str_eq(kiln_params_name(p, 1), "fc.bias");
  cr_assert_eq(kiln_params_find(p, "fc.bias"), l.bias);
  cr_assert_eq(kiln_params_numel(p), 784 * 512 + 512);
  assert_shape(l.weight, KILN_SHAPE(512, 784));
  cr_assert(kiln_tensor_requires_grad(l.weight) && kiln_tensor_requires_grad(l.bias));
  cr_assert_eq(tlen(ctx), 0, "initialisation records nothing");

  kiln_tensor *x = f32(ctx, KILN_SHAPE(128, 784));
  kiln_tensor *y = kiln_linear_forward(&l, x);
  assert_shape(y, KILN_SHAPE(128, 512));
  ASSERT_OPS_FROM(ctx, 0, KILN__OP_PERMUTE, KILN__OP_MATMUL, KILN__OP_ADD);
  kiln__node *perm = node_at(ctx, 0), *mm = node_at(ctx, 1), *add = node_at(ctx, 2);
  cr_assert_eq(perm->in[0], l.weight);
  cr_assert_eq(mm->in[0], x);
  cr_assert_eq(mm->in[1], perm->out, "the transposed weight goes to the matmul uncopied");
  ASSERT_STRIDES(mm->in[1], 1, 784);
  cr_assert_eq(add->in[0], mm->out);
  cr_assert_eq(add->in[1], l.bias);
  cr_assert_eq(add->out, y);
  cr_assert_eq(y->node, 2);
  cr_assert(kiln_tensor_requires_grad(y));

  kiln_exec_stats st;
  kiln_stats(ctx, &st);
  cr_assert_eq(st.nodes_recorded, 3u);
  cr_assert_eq(st.nodes_executed, 0u);

  EXPECT_FAIL(ctx, kiln_linear_forward(&l, f32(ctx, KILN_SHAPE(4, 100))), KILN_ERR_SHAPE,
              "kiln_linear_forward", "[4,100]", "fc.weight", "784");
  kiln_linear l2;
  cr_assert_eq(kiln_linear_init(&l2, p, "fc", 3, 4, 0), KILN_ERR_INVALID);
  ASSERT_ERROR(ctx, KILN_ERR_INVALID, "kiln_params_add", "fc.weight", "taken");
  kiln_ctx_clear_error(ctx);
  cr_assert_eq(kiln_linear_init(&l2, p, "bad", 0, 4, 0), KILN_ERR_INVALID);
  ASSERT_ERROR(ctx, KILN_ERR_INVALID, "kiln_linear_init", "in_features 0");
  kiln_ctx_clear_error(ctx);
  kiln_params_free(p);
  kiln_ctx_free(ctx);
}

Test(trace, requires_grad_propagation_and_no_grad) {
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_tensor *w = param(ctx, KILN_SHAPE(3)), *x = f32(ctx, KILN_SHAPE(3));
  cr_assert(kiln_tensor_requires_grad(kiln_mul(w, x)));
  cr_assert(kiln_tensor_requires_grad(kiln_mul(x, w)));
  cr_assert(!kiln_tensor_requires_grad(kiln_mul(x, x)));
  cr_assert(kiln_tensor_requires_grad(kiln_exp(kiln_relu(w))));
  cr_assert(kiln_tensor_requires_grad(kiln_transpose(kiln_reshape(w, KILN_SHAPE(1, 3)), 0, 1)));
  /* ops without a gradient cut the path */
  cr_assert(!kiln_tensor_requires_grad(kiln_gt(w, x)));
  cr_assert(!kiln_tensor_requires_grad(kiln_argmax(w, 0, 0)));
  cr_assert(!kiln_tensor_requires_grad(kiln_detach(w)));
  cr_assert(!kiln_tensor_requires_grad(kiln_cast(w, KILN_DTYPE_I32)));
  cr_assert(!kiln_tensor_requires_grad(kiln_mul(kiln_detach(w), x)));

  cr_assert(kiln_grad_enabled(ctx));
  kiln_no_grad_begin(ctx);
  kiln_no_grad_begin(ctx);
  cr_assert(!kiln_grad_enabled(ctx));
  cr_assert(!kiln_tensor_requires_grad(kiln_mul(w, x)));
  kiln_no_grad_end(ctx);
  cr_assert(!kiln_grad_enabled(ctx), "no-grad regions nest");
  cr_assert(!kiln_tensor_requires_grad(kiln_add(w, w)));
  kiln_no_grad_end(ctx);
  cr_assert(kiln_grad_enabled(ctx));
  kiln_no_grad_end(ctx); /* an extra end must not go below zero */
  cr_assert(kiln_grad_enabled(ctx));
  kiln_no_grad_begin(ctx);
  cr_assert(!kiln_grad_enabled(ctx), "an unbalanced end made the depth negative");
  kiln_no_grad_end(ctx);
  cr_assert(kiln_tensor_requires_grad(kiln_mul(w, x)));

  kiln_tensor_set_requires_grad(w, 0);
  cr_assert(!kiln_tensor_requires_grad(kiln_mul(w, x)));
  th_assert_ok(ctx);
  kiln_ctx_free(ctx);
}

/* Collects the grads of the MLP's parameters; asserts each has one. */
static void mlp_grads(mlp *m, kiln_tensor **grads) {
  int np = kiln_params_count(m->params);
  for (int i = 0; i < np; i++) {
    kiln_tensor *p = kiln_params_get(m->params, i);
    grads[i] = kiln_tensor_grad(p);
    cr_assert_not_null(grads[i], "%s has no gradient", kiln_params_name(m->params, i));
    cr_assert(kiln_tensor_is_persistent(grads[i]));
    cr_assert(kiln_tensor_is_contiguous(grads[i]));
    assert_shape(grads[i], kiln_tensor_shape(p));
    char want[64];
    snprintf(want, sizeof want, "%s.grad", kiln_params_name(m->params, i));
    cr_assert_str_eq(kiln_tensor_name(grads[i]), want);
  }
}

/* Asserts that the last np nodes are update nodes of op writing exactly the given grads. */
static void assert_leaf_writes(kiln_ctx *ctx, kiln__op op, int np, kiln_tensor *const *grads) {
  bool seen[MLP_MAX * 2] = {0};
  for (int k = 0; k < np; k++) {
    kiln__node *n = node_at(ctx, -np + k);
    cr_assert_eq(n->op, op, "node %d from the end is %s, want %s", np - k, op_name(n->op),
                 op_name(op));
    cr_assert_null(n->out);
    int hit = -1;
    for (int i = 0; i < np; i++)
      if (n->in[0] == grads[i]) hit = i;
    cr_assert(hit >= 0, "a %s node writes a tensor that is no parameter's grad", op_name(op));
    cr_assert(!seen[hit], "two %s nodes write one grad", op_name(op));
    seen[hit] = true;
    cr_assert_eq(kiln_tensor_numel(n->in[1]), kiln_tensor_numel(grads[hit]));
  }
}

static int count_ops(kiln_ctx *ctx, int32_t first, int32_t last, kiln__op op) {
  int c = 0;
  for (int32_t i = first; i < last; i++)
    c += ctx->trace.nodes[i].op == op;
  return c;
}

Test(trace, backward_appends_gradients_and_assigns_grads) {
  kiln_ctx *ctx = th_cpu_ctx();
  mlp m;
  mlp_init(&m, ctx, 16, 2, (int64_t[]){20, 12, 5});
  for (int i = 0; i < 4; i++)
    cr_assert_null(kiln_tensor_grad(kiln_params_get(m.params, i)), "a grad before backward");
  kiln_tensor *loss = mlp_loss(&m);
  ASSERT_OPS_FROM(ctx, 0, KILN__OP_PERMUTE, KILN__OP_MATMUL, KILN__OP_ADD, KILN__OP_RELU,
                  KILN__OP_PERMUTE, KILN__OP_MATMUL, KILN__OP_ADD, KILN__OP_MAX, KILN__OP_SUB,
                  KILN__OP_EXP, KILN__OP_SUM, KILN__OP_LOG, KILN__OP_SUB, KILN__OP_RESHAPE,
                  KILN__OP_ONEHOT, KILN__OP_MUL, KILN__OP_SUM, KILN__OP_NEG, KILN__OP_SUM);
  int32_t nf = tlen(ctx);
  cr_assert_eq(loss->node, nf - 1);
  cr_assert(kiln_tensor_requires_grad(loss));

  cr_assert_eq(kiln_backward(loss), KILN_OK, "kiln_backward: %s", kiln_ctx_error(ctx));
  cr_assert_gt(tlen(ctx), nf + 4);
  /* the forward nodes are untouched; the backward starts from a one */
  for (int32_t i = 0; i < nf; i++)
    cr_assert_neq(kiln__ops[node_at(ctx, i)->op].kind, KILN__KIND_UPDATE);
  kiln__node *one = node_at(ctx, nf);
  cr_assert_eq(one->op, KILN__OP_FILL);
  cr_assert_eq(one->f[0], 1.f);
  assert_shape(one->out, KILN_SCALAR_SHAPE);
  for (int32_t i = nf; i < tlen(ctx); i++) {
    kiln__node *n = node_at(ctx, i);
    if (n->out)
      cr_assert(!n->out->requires_grad, "backward node #%d (%s) requires grad", i, op_name(n->op));
  }
  kiln_tensor *grads[4];
  mlp_grads(&m, grads);
  assert_leaf_writes(ctx, KILN__OP_ASSIGN, 4, grads);
  int32_t nb = tlen(ctx);
  cr_assert_eq(count_ops(ctx, nf, nb, KILN__OP_ASSIGN), 4);
  cr_assert_eq(count_ops(ctx, nf, nb, KILN__OP_ACCUM), 0);
  /* dW2, dh and dW1; the input needs no gradient, so no matmul for it */
  cr_assert_eq(count_ops(ctx, nf, nb, KILN__OP_MATMUL), 3);
  cr_assert_eq(count_ops(ctx, nf, nb, KILN__OP_RELU_GRAD), 1);
  cr_assert_null(kiln_tensor_grad(m.x), "the input does not require grad");

  /* a second backward without zero_grad accumulates */
  cr_assert_eq(kiln_backward(loss), KILN_OK, "second kiln_backward: %s", kiln_ctx_error(ctx));
  kiln_tensor *grads2[4];
  mlp_grads(&m, grads2);
  for (int i = 0; i < 4; i++)
    cr_assert_eq(grads2[i], grads[i], "the grad buffer is reused");
  assert_leaf_writes(ctx, KILN__OP_ACCUM, 4, grads);
  cr_assert_eq(count_ops(ctx, nb, tlen(ctx), KILN__OP_ASSIGN), 0);
  cr_assert_eq(count_ops(ctx, nb, tlen(ctx), KILN__OP_MATMUL), 3);

  /* zero_grad drops the gradients: the next backward assigns afresh */
  kiln_params_zero_grad(m.params);
  for (int i = 0; i < 4; i++)
    cr_assert_null(kiln_tensor_grad(kiln_params_get(m.params, i)));
  cr_assert_eq(kiln_backward(loss), KILN_OK);
  assert_leaf_writes(ctx, KILN__OP_ASSIGN, 4, grads);
  kiln_tensor_zero_grad(kiln_params_get(m.params, 1));
  cr_assert_null(kiln_tensor_grad(kiln_params_get(m.params, 1)));
  cr_assert_not_null(kiln_tensor_grad(kiln_params_get(m.params, 0)));
  th_assert_ok(ctx);
  mlp_free(&m);
  kiln_ctx_free(ctx);
}

Test(trace, backward_reaches_inputs_that_require_grad) {
  kiln_ctx *ctx = th_cpu_ctx();
  mlp m;
  mlp_init(&m, ctx, 8, 2, (int64_t[]){6, 4, 3});
  kiln_tensor_set_requires_grad(m.x, 1);
  kiln_tensor *loss = mlp_loss(&m);
  int32_t nf = tlen(ctx);
  cr_assert_eq(kiln_backward(loss), KILN_OK, "%s", kiln_ctx_error(ctx));
  cr_assert_eq(count_ops(ctx, nf, tlen(ctx), KILN__OP_MATMUL), 4);
  cr_assert_eq(count_ops(ctx, nf, tlen(ctx), KILN__OP_ASSIGN), 5);
  kiln_tensor *gx = kiln_tensor_grad(m.x);
  cr_assert_not_null(gx);
  assert_shape(gx, KILN_SHAPE(8, 6));
  mlp_free(&m);
  kiln_ctx_free(ctx);
}

Test(trace, backward_errors) {
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_tensor *w = param(ctx, KILN_SHAPE(3)), *x = f32(ctx, KILN_SHAPE(3));
  int32_t n0 = tlen(ctx);
  kiln_tensor *v = kiln_mul(w, x);
  cr_assert_eq(kiln_backward(v), KILN_ERR_SHAPE);
  ASSERT_ERROR(ctx, KILN_ERR_SHAPE, "kiln_backward", "one f32 element", "[3]");
  kiln_ctx_clear_error(ctx);
  cr_assert_eq(kiln_backward(sum_all(kiln_mul(x, x))), KILN_ERR_STATE);
  ASSERT_ERROR(ctx, KILN_ERR_STATE, "kiln_backward", "does not require grad");
  kiln_ctx_clear_error(ctx);
  kiln_no_grad_begin(ctx);
  kiln_tensor *l = sum_all(v);
  kiln_no_grad_end(ctx);
  cr_assert_eq(kiln_backward(l), KILN_ERR_STATE);
  ASSERT_ERROR(ctx, KILN_ERR_STATE, "no-grad");
  kiln_ctx_clear_error(ctx);
  cr_assert_eq(tlen(ctx), n0 + 4, "failed backward calls recorded nodes");
  cr_assert_null(kiln_tensor_grad(w));
  kiln_ctx_free(ctx);
}

Test(trace, dropout_backward_reuses_the_mask) {
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_manual_seed(ctx, 7);
  kiln_tensor *w = param(ctx, KILN_SHAPE(5, 4));
  kiln_dropout(w, 0.5f, 1); /* takes offset 0 */
  kiln_tensor *d = kiln_dropout(w, 0.5f, 1);
  kiln__node fwd = *node_at(ctx, d->node);
  cr_assert_eq(fwd.u[1], 1u);
  int32_t n0 = tlen(ctx);
  cr_assert_eq(kiln_backward(sum_all(d)), KILN_OK, "%s", kiln_ctx_error(ctx));
  cr_assert_eq(count_ops(ctx, n0, tlen(ctx), KILN__OP_DROPOUT), 1);
  for (int32_t i = n0; i < tlen(ctx); i++) {
    kiln__node *n = node_at(ctx, i);
    if (n->op != KILN__OP_DROPOUT) continue;
    cr_assert_eq(n->u[0], 7u);
    cr_assert_eq(n->u[1], fwd.u[1], "the backward mask must come from the forward draw");
    cr_assert_eq(n->f[0], fwd.f[0]);
    cr_assert_eq(n->f[1], fwd.f[1]);
  }
  cr_assert_eq(ctx->philox_offset, 2u, "backward draws no offset");
  kiln_ctx_free(ctx);
}

Test(trace, step_begin_resets_the_trace) {
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_tensor *a = f32(ctx, KILN_SHAPE(4));
  kiln_relu(kiln_exp(a));
  cr_assert_eq(tlen(ctx), 2);
  uint64_t gen = ctx->gen;
  kiln_step_begin(ctx);
  cr_assert_eq(tlen(ctx), 0);
  cr_assert_eq(ctx->gen, gen + 1);
  kiln_tensor *r = kiln_relu(a);
  cr_assert_not_null(r, "persistent tensors stay usable across steps");
  cr_assert_eq(r->node, 0);
  kiln_exec_stats st;
  kiln_stats(ctx, &st);
  cr_assert_eq(st.nodes_recorded, 3u);
  cr_assert_eq(kiln_step_end(ctx), KILN_ERR_STATE, "a no-GPU step cannot run");
  kiln_ctx_free(ctx);
}

/* ================================================================ optimizers */

/* Records an MLP's forward and backward so that every parameter has a gradient. */
static void mlp_backward(mlp *m) {
  cr_assert_eq(kiln_backward(mlp_loss(m)), KILN_OK, "kiln_backward: %s", kiln_ctx_error(m->ctx));
}

/* The update nodes of op recorded from first on, in order; returns how many. */
static int update_nodes(kiln_ctx *ctx, int32_t first, kiln__op op, kiln__node **out, int max) {
  int k = 0;
  for (int32_t i = first; i < tlen(ctx); i++) {
    kiln__node *n = node_at(ctx, i);
    cr_assert_eq(n->op, op, "node #%d after the step is %s, want only %s", i, op_name(n->op),
                 op_name(op));
    if (k < max) out[k] = n;
    k++;
  }
  return k;
}

Test(optim, sgd_momentum_nodes) {
  kiln_ctx *ctx = th_cpu_ctx();
  mlp m;
  mlp_init(&m, ctx, 8, 2, (int64_t[]){6, 4, 3});
  kiln_sgd_options o = kiln_sgd_defaults(0.05f);
  o.momentum = 0.9f;
  o.weight_decay = 1e-4f;
  o.nesterov = 1;
  kiln_optim *opt = kiln_sgd_new(m.params, &o);
  cr_assert_not_null(opt, "%s", kiln_ctx_error(ctx));
  cr_assert_float_eq(kiln_optim_lr(opt), 0.05f, 0);
  int32_t n0 = tlen(ctx);
  cr_assert_eq(kiln_optim_step(opt), KILN_OK);
  cr_assert_eq(tlen(ctx), n0, "parameters without gradients are left alone");
  cr_assert_eq(kiln_optim_steps(opt), 1);

  mlp_backward(&m);
  for (int step = 0; step < 2; step++) {
    n0 = tlen(ctx);
    cr_assert_eq(kiln_optim_step(opt), KILN_OK, "%s", kiln_ctx_error(ctx));
    kiln__node *ns[8];
    cr_assert_eq(update_nodes(ctx, n0, KILN__OP_SGD_MOMENTUM, ns, 8), 4);
    for (int i = 0; i < 4; i++) {
      kiln__node *n = ns[i];
      kiln_tensor *p = kiln_params_get(m.params, i);
      cr_assert_eq(n->nin, 3);
      cr_assert_eq(n->in[0], p);
      cr_assert_eq(n->in[1], kiln_tensor_grad(p));
      char want[64];
      snprintf(want, sizeof want, "%s.momentum_buffer", kiln_params_name(m.params, i));
      cr_assert_str_eq(kiln_tensor_name(n->in[2]), want);
      cr_assert(kiln_tensor_is_persistent(n->in[2]));
      assert_shape(n->in[2], kiln_tensor_shape(p));
      cr_assert_eq(n->f[0], 0.05f);
      cr_assert_eq(n->f[1], 0.9f);
      cr_assert_eq(n->f[2], 0.f);
      cr_assert_eq(n->f[3], 1e-4f);
      cr_assert_eq(n->i[0], 1, "nesterov");
      cr_assert_eq(n->f[4], step == 0 ? 1.f : 0.f, "step %d: the first update flag is %g", step,
                   n->f[4]);
    }
  }
  cr_assert_eq(kiln_optim_steps(opt), 3);
  kiln_optim_set_lr(opt, 0.01f);
  n0 = tlen(ctx);
  kiln_optim_step(opt);
  cr_assert_eq(node_at(ctx, n0)->f[0], 0.01f);
  kiln_optim_set_lr(opt, -1.f);
  ASSERT_ERROR(ctx, KILN_ERR_INVALID, "kiln_optim_set_lr");
  kiln_ctx_clear_error(ctx);
  cr_assert_eq(kiln_optim_lr(opt), 0.01f);

  /* plain SGD updates (p, g) with lr and weight decay */
  kiln_optim *plain = kiln_sgd_new(m.params, &(kiln_sgd_options){.lr = 0.2f, .weight_decay = 0.5f});
  n0 = tlen(ctx);
  cr_assert_eq(kiln_optim_step(plain), KILN_OK);
  kiln__node *ns[8];
  cr_assert_eq(update_nodes(ctx, n0, KILN__OP_SGD, ns, 8), 4);
  cr_assert_eq(ns[0]->nin, 2);
  cr_assert_eq(ns[0]->f[0], 0.2f);
  cr_assert_eq(ns[0]->f[3], 0.5f);

  /* bad options */
  o = kiln_sgd_defaults(0.1f);
  o.nesterov = 1;
  cr_assert_null(kiln_sgd_new(m.params, &o));
  ASSERT_ERROR(ctx, KILN_ERR_INVALID, "kiln_sgd_new", "Nesterov");
  kiln_ctx_clear_error(ctx);
  o.lr = -1.f;
  o.nesterov = 0;
  cr_assert_null(kiln_sgd_new(m.params, &o));
  ASSERT_ERROR(ctx, KILN_ERR_INVALID, "kiln_sgd_new", "lr -1");
  kiln_ctx_clear_error(ctx);
  /* freed at the end: see bug_tensor_free_fails_a_no_gpu_context */
  kiln_optim_free(opt);
  kiln_optim_free(plain);
  mlp_free(&m);
  kiln_ctx_free(ctx);
}

/* Asserts one Adam step's nodes against the formulas of optim/optim.c for step t. */
static void assert_adam_step(kiln_ctx *ctx, int32_t first, mlp *m, kiln_optim *opt,
                             const kiln_adam_options *a, float lr, int t, int decoupled) {
  kiln__node *ns[8];
  cr_assert_eq(update_nodes(ctx, first, KILN__OP_ADAM, ns, 8), 4);
  (void)opt;
  float step_size = (float)((double)lr / (1.0 - pow((double)a->beta1, t)));
  float bc2s = (float)sqrt(1.0 - pow((double)a->beta2, t));
  for (int i = 0; i < 4; i++) {
    kiln__node *n = ns[i];
    kiln_tensor *p = kiln_params_get(m->params, i);
    cr_assert_eq(n->nin, 4);
    cr_assert_eq(n->in[0], p);
    cr_assert_eq(n->in[1], kiln_tensor_grad(p));
    char want[64];
    snprintf(want, sizeof want, "%s.exp_avg", kiln_params_name(m->params, i));
    cr_assert_str_eq(kiln_tensor_name(n->in[2]), want);
    snprintf(want, sizeof want, "%s.exp_avg_sq", kiln_params_name(m->params, i));
    cr_assert_str_eq(kiln_tensor_name(n->in[3]), want);
    cr_assert_eq(n->f[0], lr);
    cr_assert_eq(n->f[1], a->beta1);
    cr_assert_eq(n->f[2], a->beta2);
    cr_assert_eq(n->f[3], a->eps);
    cr_assert_eq(n->f[4], a->weight_decay);
    cr_assert_eq(n->f[5], step_size, "step %d: lr / bias correction 1 is %.9g, want %.9g", t,
                 n->f[5], step_size);
    cr_assert_eq(n->f[6], bc2s, "step %d: sqrt(bias correction 2) is %.9g, want %.9g", t, n->f[6],
                 bc2s);
    cr_assert_eq(n->i[0], decoupled);
  }
}

Test(optim, adam_and_adamw_nodes) {
  kiln_ctx *ctx = th_cpu_ctx();
  mlp m;
  mlp_init(&m, ctx, 8, 2, (int64_t[]){6, 4, 3});
  mlp_backward(&m);
  kiln_adam_options a = kiln_adam_defaults();
  cr_assert_eq(a.lr, 1e-3f);
  cr_assert_eq(a.beta1, 0.9f);
  cr_assert_eq(a.beta2, 0.999f);
  cr_assert_eq(a.eps, 1e-8f);
  cr_assert_eq(a.weight_decay, 0.f);
  a.beta1 = 0.7f; /* the fast MNIST recipe's betas */
  a.beta2 = 0.9f;
  a.lr = 1e-2f;
  kiln_optim *adam = kiln_adam_new(m.params, &a);
  cr_assert_not_null(adam, "%s", kiln_ctx_error(ctx));
  for (int t = 1; t <= 3; t++) {
    int32_t n0 = tlen(ctx);
    cr_assert_eq(kiln_optim_step(adam), KILN_OK, "%s", kiln_ctx_error(ctx));
    assert_adam_step(ctx, n0, &m, adam, &a, a.lr, t, 0);
  }
  /* the bias corrections follow the step count, the step size the current lr */
  kiln_optim_set_lr(adam, 5e-3f);
  int32_t n0 = tlen(ctx);
  kiln_optim_step(adam);
  assert_adam_step(ctx, n0, &m, adam, &a, 5e-3f, 4, 0);

  kiln_adam_options w = kiln_adamw_defaults();
  cr_assert_eq(w.weight_decay, 1e-2f);
  kiln_optim *adamw = kiln_adamw_new(m.params, NULL);
  cr_assert_not_null(adamw, "%s", kiln_ctx_error(ctx));
  n0 = tlen(ctx);
  cr_assert_eq(kiln_optim_step(adamw), KILN_OK);
  assert_adam_step(ctx, n0, &m, adamw, &w, w.lr, 1, 1);

  a.beta1 = 1.f;
  cr_assert_null(kiln_adam_new(m.params, &a));
  ASSERT_ERROR(ctx, KILN_ERR_INVALID, "kiln_adam_new", "betas");
  kiln_ctx_clear_error(ctx);
  kiln_optim_free(adam); /* at the end: see bug_tensor_free_fails_a_no_gpu_context */
  kiln_optim_free(adamw);
  mlp_free(&m);
  kiln_ctx_free(ctx);
}

Test(optim, parameter_list_changes_are_caught) {
  kiln_ctx *ctx = th_cpu_ctx();
  mlp m;
  mlp_init(&m, ctx, 8, 1, (int64_t[]){6, 3});
  kiln_optim *opt = kiln_sgd_new(m.params, NULL);
  cr_assert_not_null(opt);
  cr_assert_eq(kiln_params_add(m.params, "extra", f32(ctx, KILN_SHAPE(2))), KILN_OK);
  cr_assert_eq(kiln_optim_step(opt), KILN_ERR_STATE);
  ASSERT_ERROR(ctx, KILN_ERR_STATE, "kiln_optim_step", "3 parameters", "made for 2");
  kiln_ctx_clear_error(ctx);
  cr_assert_eq(kiln_params_add(m.params, "view", kiln_relu(m.x)), KILN_ERR_INVALID);
  ASSERT_ERROR(ctx, KILN_ERR_INVALID, "kiln_params_add", "intermediate");
  kiln_ctx_clear_error(ctx);
  kiln_optim_free(opt);
  mlp_free(&m);
  kiln_ctx_free(ctx);
}

/* ================================================================ 5. stale handles */

Test(stale, intermediates_of_a_previous_step) {
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_tensor *w = param(ctx, KILN_SHAPE(4)), *x = f32(ctx, KILN_SHAPE(4));
  kiln_tensor *h = kiln_mul(w, x);
  kiln_tensor_set_name(h, "hidden");
  kiln_tensor *loss = sum_all(h);
  kiln_step_begin(ctx);
  int32_t n0 = tlen(ctx);
  cr_assert_null(kiln_relu(h));
  ASSERT_ERROR(ctx, KILN_ERR_STATE, "kiln_relu", "stale", "'hidden'");
  cr_assert_eq(tlen(ctx), n0);
  kiln_ctx_clear_error(ctx);
  cr_assert_null(kiln_add(x, h), "a stale second operand");
  ASSERT_ERROR(ctx, KILN_ERR_STATE, "kiln_add", "stale");
  kiln_ctx_clear_error(ctx);
  cr_assert_eq(kiln_backward(loss), KILN_ERR_STATE);
  ASSERT_ERROR(ctx, KILN_ERR_STATE, "kiln_backward", "stale");
  kiln_ctx_clear_error(ctx);
  /* persistent tensors never go stale */
  cr_assert_not_null(kiln_mul(w, x));
  th_assert_ok(ctx);
  kiln_ctx_free(ctx);
}

/* ================================================================ 6 and 7. NVRTC and kernels */

/* Points KILN_CACHE_DIR at a fresh temporary directory (before any context is made). */
static void fresh_cache_dir(char *buf, size_t n) {
  make_tmpdir(buf, n, "cache");
  cr_assert_eq(setenv("KILN_CACHE_DIR", buf, 1), 0);
  unsetenv("KILN_DUMP_KERNELS");
}

/* The kernels a compile of the pending nodes looks up: one per node, none for views and
 * matmuls (cuBLAS), one per input for a concat. */
static uint64_t pending_kernels(kiln_ctx *ctx) {
  uint64_t k = 0;
  for (int32_t i = ctx->trace.done; i < ctx->trace.n; i++) {
    kiln__node *n = &ctx->trace.nodes[i];
    kiln__kind kind = kiln__ops[n->op].kind;
    if (kind == KILN__KIND_VIEW || kind == KILN__KIND_MATMUL) continue;
    k += n->op == KILN__OP_CONCAT ? (uint64_t)n->nin : 1;
  }
  return k;
}

static void compile_ok(kiln_ctx *ctx) {
  kiln_status s = kiln__compile_pending(ctx);
  cr_assert_eq(s, KILN_OK, "kiln__compile_pending: %s", kiln_ctx_error(ctx));
  th_assert_ok(ctx);
}

/* One of each op outside the MLP step, a loss over all of them, two backward passes (assign,
 * then accumulate) and Adam, AdamW and plain and damped SGD steps. */
static void record_op_zoo(kiln_ctx *ctx, kiln_params *q, kiln_optim **os) {
  kiln_tensor *a = param(ctx, KILN_SHAPE(4, 5, 6)), *b = param(ctx, KILN_SHAPE(5, 6));
  kiln_tensor *c = param(ctx, KILN_SHAPE(8, 600)); /* columns reduce one per thread */
  cr_assert_eq(kiln_params_add(q, "a", a), KILN_OK);
  cr_assert_eq(kiln_params_add(q, "b", b), KILN_OK);
  cr_assert_eq(kiln_params_add(q, "c", c), KILN_OK);
  kiln_tensor *idx = i32(ctx, KILN_SHAPE(3));
  kiln_tensor *pos = kiln_add_scalar(kiln_mul(a, a), 1.f); /* > 0 for log, sqrt, pow */
  kiln_tensor *t[96];
  int n = 0;
  t[n++] = kiln_softmax(a, -1);
  t[n++] = kiln_softmax(a, 1);
  t[n++] = kiln_log_softmax(a, 0);
  t[n++] = kiln_gelu(a, KILN_GELU_ERF);
  t[n++] = kiln_gelu(a, KILN_GELU_TANH);
  t[n++] = kiln_sigmoid(a);
  t[n++] = kiln_tanh(a);
  t[n++] = kiln_clamp(a, -0.5f, 0.5f);
  t[n++] = kiln_where(kiln_gt(a, b), a, b);
  t[n++] = kiln_maximum(a, b);
  t[n++] = kiln_minimum(b, a);
  t[n++] = kiln_pow_scalar(pos, 1.5f);
  t[n++] = kiln_pow_scalar(a, 2.f);
  t[n++] = kiln_rsqrt(pos);
  t[n++] = kiln_sqrt(pos);
  t[n++] = kiln_exp(a);
  t[n++] = kiln_log(pos);
  t[n++] = kiln_neg(a);
  t[n++] = kiln_div(a, kiln_add_scalar(kiln_mul(b, b), 1.f));
  t[n++] = kiln_sub(b, a);
  t[n++] = kiln_mul_scalar(a, -3.f);
  /* reductions over several axis sets, innermost and not */
  t[n++] = kiln_max(a, KILN_AXES(0), 0);
  t[n++] = kiln_max(a, KILN_AXES(1), 1);
  t[n++] = kiln_max(a, KILN_AXES(0, 2), 0);
  t[n++] = kiln_max(a, KILN_ALL_AXES, 0);
  t[n++] = kiln_sum(a, KILN_AXES(1), 1);
  t[n++] = kiln_sum(a, KILN_AXES(0, 1), 0);
  t[n++] = kiln_sum(a, KILN_AXES(1, 2), 1);
  t[n++] = kiln_mean(a, KILN_AXES(0), 0);
  t[n++] = kiln_mean(a, KILN_AXES(2), 1);
  t[n++] = kiln_mean(a, KILN_ALL_AXES, 0);
  t[n++] = kiln_sum(c, KILN_AXES(0), 0);
  t[n++] = kiln_max(c, KILN_AXES(0), 1);
  t[n++] = kiln_mean(c, KILN_AXES(1), 0);
  /* movement */
  kiln_tensor *cat2[2] = {a, kiln_slice(a, 1, 1, 5, 2)};
  t[n++] = kiln_concat(2, cat2, 1);
  t[n++] = kiln_slice(a, 2, 1, 6, 2);
  t[n++] = kiln_slice(kiln_transpose(a, 0, 2), 0, -4, -1, 2);
  t[n++] = kiln_contiguous(kiln_transpose(a, 0, 2));
  t[n++] = kiln_mul(kiln_expand(kiln_reshape(b, KILN_SHAPE(1, 5, 6)), KILN_SHAPE(4, 5, 6)), a);
  t[n++] = kiln_mul(kiln_detach(a), a);
  t[n++] = kiln_matmul(a, kiln_transpose(b, 0, 1)); /* (4,5,6) x (6,5) */
  t[n++] = kiln_dropout(a, 0.25f, 1);
  /* no gradient through these, but their kernels compile all the same */
  t[n++] = kiln_eq(a, b);
  t[n++] = kiln_ne(a, b);
  t[n++] = kiln_lt(a, b);
  t[n++] = kiln_le(a, b);
  t[n++] = kiln_ge(a, b);
  t[n++] = kiln_cast(kiln_argmax(a, -1, 0), KILN_DTYPE_F32);
  t[n++] = kiln_cast(kiln_argmax(a, 0, 1), KILN_DTYPE_F32);
  t[n++] = kiln_cast(kiln_argmax(c, 0, 0), KILN_DTYPE_F32);
  t[n++] = kiln_cast(kiln_cast(a, KILN_DTYPE_I32), KILN_DTYPE_F32);
  t[n++] = kiln_index_select(a, idx);
  t[n++] = kiln_cast(kiln_index_select(kiln_cast(b, KILN_DTYPE_I32), idx), KILN_DTYPE_F32);
  kiln_tensor *icat[2] = {idx, idx};
  t[n++] = kiln_cast(kiln_concat(2, icat, 0), KILN_DTYPE_F32);
  kiln_tensor *loss = kiln_full(ctx, KILN_SCALAR_SHAPE, 0.f);
  for (int i = 0; i < n; i++) {
    cr_assert_not_null(t[i], "op zoo term %d: %s", i, kiln_ctx_error(ctx));
    loss = kiln_add(loss, sum_all(t[i]));
  }
  cr_assert_not_null(loss, "%s", kiln_ctx_error(ctx));
  cr_assert_eq(kiln_backward(loss), KILN_OK, "kiln_backward: %s", kiln_ctx_error(ctx));
  cr_assert_eq(kiln_backward(loss), KILN_OK, "second kiln_backward: %s", kiln_ctx_error(ctx));

  os[0] = kiln_adam_new(q, NULL);
  os[1] = kiln_adamw_new(q, NULL);
  os[2] = kiln_sgd_new(q, &(kiln_sgd_options){.lr = 0.1f, .weight_decay = 1e-3f});
  os[3] = kiln_sgd_new(q, &(kiln_sgd_options){.lr = 0.1f, .momentum = 0.5f, .dampening = 0.1f});
  for (int i = 0; i < 4; i++) {
    cr_assert_not_null(os[i], "%s", kiln_ctx_error(ctx));
    cr_assert_eq(kiln_optim_step(os[i]), KILN_OK, "%s", kiln_ctx_error(ctx));
  }
}

Test(nvrtc, every_generated_kernel_compiles, .timeout = 1200) {
  char cache[256];
  fresh_cache_dir(cache, sizeof cache);
  kiln_ctx *ctx = th_cpu_ctx();
  cr_assert_str_eq(ctx->cache_dir, cache);

  /* the benchmark MLP's step: 784-512-512-10, ReLU, SGD with Nesterov momentum */
  mlp m;
  mlp_init(&m, ctx, 128, 3, (int64_t[]){784, 512, 512, 10});
  mlp_backward(&m);
  kiln_sgd_options so = kiln_sgd_defaults(0.01f);
  so.momentum = 0.9f;
  so.nesterov = 1;
  kiln_optim *sgd = kiln_sgd_new(m.params, &so);
  cr_assert_not_null(sgd);
  cr_assert_eq(kiln_optim_step(sgd), KILN_OK);

  kiln_params *q = kiln_params_new(ctx);
  kiln_optim *os[4]; /* freed after the compile: their state tensors are in the trace */
  record_op_zoo(ctx, q, os);
  th_assert_ok(ctx);

  /* the trace holds every op of the table */
  bool seen[KILN__OP_COUNT] = {0};
  for (int32_t i = 0; i < tlen(ctx); i++)
    seen[node_at(ctx, i)->op] = true;
  for (int i = 0; i < KILN__OP_COUNT; i++)
    cr_assert(seen[i], "the op %s is missing from the compile test", kiln__ops[i].name);

  /* unfused first: one kernel per node, so every op's own kernel compiles */
  uint64_t want = pending_kernels(ctx);
  kiln_set_fusion(ctx, 0);
  compile_ok(ctx);
  kiln_exec_stats st;
  kiln_stats(ctx, &st);
  cr_assert_gt(st.kernels_compiled, 0u);
  cr_assert_eq(st.disk_hits, 0u, "a fresh cache directory had hits");
  cr_assert_eq(st.kernels_compiled + st.cache_hits, want,
               "%llu compiled + %llu cache hits for %llu kernel lookups",
               (unsigned long long)st.kernels_compiled, (unsigned long long)st.cache_hits,
               (unsigned long long)want);
  cr_assert_gt(st.compile_ms, 0.0);
  cr_log_info("%d nodes, %llu kernels compiled, %llu memory cache hits, %.0f ms", tlen(ctx),
              (unsigned long long)st.kernels_compiled, (unsigned long long)st.cache_hits,
              st.compile_ms);
  cr_assert_eq(st.nodes_executed, 0u, "a no-GPU context ran nodes");
  char files[1][1200];
  cr_assert_eq((uint64_t)list_files(cache, ".cubin", files, 1), st.kernels_compiled,
               "one cache file per compiled kernel");
  /* then fused: the planner's kernels (chains, reductions with prologues) compile too */
  kiln_set_fusion(ctx, 1);
  compile_ok(ctx);
  kiln_exec_stats fused;
  kiln_stats(ctx, &fused);
  cr_assert_gt(fused.kernels_compiled, st.kernels_compiled, "fusion made no kernels of its own");
  cr_log_info("fused: %llu more kernels compiled",
              (unsigned long long)(fused.kernels_compiled - st.kernels_compiled));
  for (int i = 0; i < 4; i++)
    kiln_optim_free(os[i]);
  kiln_optim_free(sgd);
  kiln_params_free(q);
  mlp_free(&m);
  kiln_ctx_free(ctx);
  remove_dir(cache);
}

/* A few distinct kernels: elementwise, broadcast, row and column reductions, an update. */
static void record_small(kiln_ctx *ctx) {
  kiln_tensor *w = param(ctx, KILN_SHAPE(16, 8)), *b = f32(ctx, KILN_SHAPE(8));
  kiln_tensor *h = kiln_relu(kiln_add(w, b));
  kiln_tensor *loss = kiln_add(sum_all(kiln_sum(h, KILN_AXES(0), 0)), sum_all(kiln_exp(h)));
  cr_assert_eq(kiln_backward(loss), KILN_OK, "%s", kiln_ctx_error(ctx));
}

static kiln_exec_stats compile_small_in_fresh_ctx(void) {
  kiln_ctx *ctx = th_cpu_ctx();
  record_small(ctx);
  compile_ok(ctx);
  kiln_exec_stats st;
  kiln_stats(ctx, &st);
  kiln_ctx_free(ctx);
  return st;
}

/* Truncates a file to half its length. */
static void truncate_half(const char *path) {
  struct stat sb;
  cr_assert_eq(stat(path, &sb), 0);
  cr_assert_eq(truncate(path, sb.st_size / 2), 0);
}

/* Flips the bits of the byte at offset at (negative: from the end). */
static void flip_byte(const char *path, long at) {
  size_t n;
  char *p = read_whole(path, &n);
  size_t k = at < 0 ? n - (size_t)(-at) : (size_t)at;
  cr_assert_lt(k, n);
  p[k] ^= 0xff;
  write_whole(path, p, n);
  free(p);
}

Test(nvrtc, disk_cache_is_reused_and_corruption_is_rebuilt, .timeout = 1200) {
  char cache[256];
  fresh_cache_dir(cache, sizeof cache);
  kiln_exec_stats s1 = compile_small_in_fresh_ctx();
  uint64_t k = s1.kernels_compiled;
  cr_assert_geq(k, 4u, "only %llu distinct kernels", (unsigned long long)k);
  cr_assert_eq(s1.disk_hits, 0u);
  char files[64][1200];
  int nf = list_files(cache, ".cubin", files, 64);
  cr_assert_eq((uint64_t)nf, k, "%d cache files for %llu kernels", nf, (unsigned long long)k);

  /* a second context in the same process finds every kernel on disk */
  kiln_exec_stats s2 = compile_small_in_fresh_ctx();
  cr_assert_eq(s2.kernels_compiled, 0u);
  cr_assert_eq(s2.disk_hits, k);
  cr_assert_eq(s2.cache_hits, s1.cache_hits + k);

  /* corrupt three entries: one truncated, one with a flipped data byte, one with a flipped
   * header byte; exactly those are rebuilt and none of them is loaded */
  truncate_half(files[0]);
  flip_byte(files[1], -1);
  flip_byte(files[2], 9); /* inside the key */
  kiln_exec_stats s3 = compile_small_in_fresh_ctx();
  cr_assert_eq(s3.kernels_compiled, 3u, "%llu kernels recompiled after corrupting 3",
               (unsigned long long)s3.kernels_compiled);
  cr_assert_eq(s3.disk_hits, k - 3);

  /* the rebuilt entries are whole again */
  kiln_exec_stats s4 = compile_small_in_fresh_ctx();
  cr_assert_eq(s4.kernels_compiled, 0u);
  cr_assert_eq(s4.disk_hits, k);
  remove_dir(cache);
}

Test(nvrtc, dump_kernels_writes_sources, .timeout = 600) {
  char cache[256], dump[256];
  fresh_cache_dir(cache, sizeof cache);
  make_tmpdir(dump, sizeof dump, "dump");
  cr_assert_eq(setenv("KILN_DUMP_KERNELS", dump, 1), 0);
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_tensor *a = f32(ctx, KILN_SHAPE(3, 4)), *b = f32(ctx, KILN_SHAPE(4));
  kiln_add(a, b);
  compile_ok(ctx);

  char pre[1200];
  snprintf(pre, sizeof pre, "%s/prelude.cu", dump);
  char *text = read_whole(pre, NULL);
  cr_assert_str_eq(text, kiln__prelude(), "prelude.cu is the prelude");
  cr_assert_not_null(strstr(text, "kiln_philox"));
  free(text);

  char files[8][1200];
  int n = list_files(dump, ".cu", files, 8);
  cr_assert_eq(n, 2, "prelude.cu and one kernel, got %d files", n);
  int k = strstr(files[0], "prelude.cu") ? 1 : 0;
  const char *base = strrchr(files[k], '/') + 1;
  cr_assert_eq(strncmp(base, "k_add_f32_", 10), 0, "the kernel file is %s", base);
  text = read_whole(files[k], NULL);
  cr_assert_not_null(strstr(text, "k_add_f32_"));
  cr_assert_not_null(strstr(text, "// trace nodes:"), "the source lists its nodes:\n%s", text);
  cr_assert_not_null(strstr(text, "// trace nodes: #0 add [3,4] f32"), "source:\n%s", text);
  char name[128];
  snprintf(name, sizeof name, "%.*s", (int)(strlen(base) - 3), base);
  char decl[192];
  snprintf(decl, sizeof decl, "void __launch_bounds__(256) %s(", name);
  cr_assert_not_null(strstr(text, decl), "the file names its kernel %s:\n%s", name, text);
  free(text);
  kiln_ctx_free(ctx);
  remove_dir(dump);
  remove_dir(cache);
}

/* ================================================================ 8. Philox */

Test(philox, random123_known_answers) {
  /* Random123's kat_vectors for philox4x32-10: counter (c0..c3), key (k0, k1); kiln passes the
   * element index as (c0, c1), the offset as (c2, c3) and the seed as the key. */
  cr_assert_eq(kiln_philox(0, 0, 0), 0x6627e8d5u, "zero counter and key: 0x%08x",
               kiln_philox(0, 0, 0));
  cr_assert_eq(kiln_philox(~0ull, ~0ull, ~0ull), 0x408f276du, "all-ones: 0x%08x",
               kiln_philox(~0ull, ~0ull, ~0ull));
  /* the digits of pi: counter 243f6a88 85a308d3 13198a2e 03707344, key a4093822 299f31d0 */
  unsigned v = kiln_philox(0x299f31d0a4093822ull, 0x0370734413198a2eull, 0x85a308d3243f6a88ull);
  cr_assert_eq(v, 0xd16cfe09u, "pi vector: 0x%08x", v);
}

Test(philox, uniform_is_in_range_and_balanced) {
  double sum = 0;
  int below_quarter = 0;
  for (unsigned long long i = 0; i < 20000; i++) {
    unsigned bits = kiln_philox(12345, 3, i);
    float u = kiln_philox_uniform(12345, 3, i);
    cr_assert_eq(u, (float)(bits >> 8) / 16777216.0f);
    cr_assert(u >= 0.f && u < 1.f, "u %g", u);
    sum += u;
    below_quarter += u < 0.25f;
  }
  cr_assert_float_eq(sum / 20000, 0.5, 0.01);
  cr_assert(below_quarter > 4700 && below_quarter < 5300, "%d of 20000 below 0.25", below_quarter);
  /* the offset and the seed change the stream */
  cr_assert_neq(kiln_philox(1, 0, 5), kiln_philox(1, 1, 5));
  cr_assert_neq(kiln_philox(1, 0, 5), kiln_philox(2, 0, 5));
  cr_assert_neq(kiln_philox(1, 0, 5), kiln_philox(1, 0, 6));
}

/* ================================================================ 9. MNIST */

/* An idx file in memory. */
typedef struct blob {
  unsigned char *p;
  size_t n;
} blob;

static void be32_put(unsigned char *p, uint32_t v) {
  p[0] = (unsigned char)(v >> 24);
  p[1] = (unsigned char)(v >> 16);
  p[2] = (unsigned char)(v >> 8);
  p[3] = (unsigned char)v;
}

/* Pixel i of the synthetic images; pseudo-random so that gzip cannot shrink them much. */
static unsigned char pixel(uint64_t i) {
  uint64_t s = i * 0x2545F4914F6CDD1DULL;
  return (unsigned char)(splitmix(&s) >> 56);
}

static blob images_blob(uint32_t n, uint32_t rows, uint32_t cols) {
  size_t data = (size_t)n * rows * cols;
  blob b = {malloc(16 + data + 64), 16 + data};
  cr_assert_not_null(b.p);
  be32_put(b.p, 0x803);
  be32_put(b.p + 4, n);
  be32_put(b.p + 8, rows);
  be32_put(b.p + 12, cols);
  for (size_t i = 0; i < data; i++)
    b.p[16 + i] = pixel(i);
  return b;
}

static blob labels_blob(uint32_t n) {
  blob b = {malloc(8 + n + 64), 8 + (size_t)n};
  cr_assert_not_null(b.p);
  be32_put(b.p, 0x801);
  be32_put(b.p + 4, n);
  for (uint32_t i = 0; i < n; i++)
    b.p[8 + i] = (unsigned char)((i * 7 + 3) % 10);
  return b;
}

/* Writes dir/name raw, or dir/name.gz through zlib. */
static void put_file(const char *dir, const char *name, blob b, bool gz) {
  char path[1200];
  snprintf(path, sizeof path, "%s/%s%s", dir, name, gz ? ".gz" : "");
  if (!gz) {
    write_whole(path, b.p, b.n);
    return;
  }
  gzFile f = gzopen(path, "wb");
  cr_assert_not_null(f, "gzopen %s", path);
  cr_assert_eq(gzwrite(f, b.p, (unsigned)b.n), (int)b.n);
  cr_assert_eq(gzclose(f), Z_OK);
}

#define IMAGES "train-images-idx3-ubyte"
#define LABELS "train-labels-idx1-ubyte"
#define SYN_N 100
#define SYN_ROWS 28
#define SYN_COLS 20

/* A directory with a valid synthetic "train" split, raw or gzip. */
static void synthetic_split(char *dir, size_t n, bool gz) {
  make_tmpdir(dir, n, "mnist");
  blob im = images_blob(SYN_N, SYN_ROWS, SYN_COLS), lb = labels_blob(SYN_N);
  put_file(dir, IMAGES, im, gz);
  put_file(dir, LABELS, lb, gz);
  free(im.p);
  free(lb.p);
}

static void assert_mnist_zeroed(const kiln_mnist *m) {
  cr_assert(m->n == 0 && m->rows == 0 && m->cols == 0, "n %lld rows %lld cols %lld",
            (long long)m->n, (long long)m->rows, (long long)m->cols);
  cr_assert_null(m->images);
  cr_assert_null(m->labels);
}

/* Reads dir's "train" split with a fresh no-GPU context and asserts that it fails with status
 * want, a message naming file and holding every substring (the list ends with NULL), and a
 * zeroed struct. */
static void expect_mnist_error(const char *dir, kiln_status want, const char *file, ...) {
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_mnist m;
  memset(&m, 0xab, sizeof m);
  kiln_status s = kiln_mnist_read(ctx, dir, "train", &m);
  const char *msg = kiln_ctx_error(ctx);
  cr_assert_eq(s, want, "status '%s', want '%s': %s", kiln_status_name(s), kiln_status_name(want),
               msg ? msg : "no message");
  cr_assert_eq(kiln_ctx_status(ctx), want);
  cr_assert_not_null(msg);
  cr_assert_not_null(strstr(msg, "kiln_mnist_read"), "message: %s", msg);
  cr_assert_not_null(strstr(msg, dir), "the message does not name the directory: %s", msg);
  cr_assert_not_null(strstr(msg, file), "the message does not name %s: %s", file, msg);
  va_list ap;
  va_start(ap, file);
  for (const char *sub = va_arg(ap, const char *); sub; sub = va_arg(ap, const char *))
    cr_assert_not_null(strstr(msg, sub), "the message lacks '%s': %s", sub, msg);
  va_end(ap);
  assert_mnist_zeroed(&m);
  kiln_ctx_free(ctx);
}
#define EXPECT_MNIST_ERROR(dir, status, file, ...)                                                 \
  expect_mnist_error((dir), (status), (file), __VA_ARGS__, (const char *)NULL)

/* Asserts that m is the synthetic split. */
static void assert_synthetic(const kiln_mnist *m) {
  cr_assert_eq(m->n, SYN_N);
  cr_assert_eq(m->rows, SYN_ROWS);
  cr_assert_eq(m->cols, SYN_COLS);
  for (size_t i = 0; i < (size_t)SYN_N * SYN_ROWS * SYN_COLS; i++)
    cr_assert_eq(m->images[i], pixel(i), "pixel %zu", i);
  for (uint32_t i = 0; i < SYN_N; i++)
    cr_assert_eq(m->labels[i], (i * 7 + 3) % 10);
}

static void read_synthetic(bool gz) {
  char dir[256];
  synthetic_split(dir, sizeof dir, gz);
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_mnist m;
  cr_assert_eq(kiln_mnist_read(ctx, dir, "train", &m), KILN_OK, "%s", kiln_ctx_error(ctx));
  assert_synthetic(&m);
  kiln_mnist_free(&m);
  assert_mnist_zeroed(&m);
  kiln_ctx_free(ctx);
  remove_dir(dir);
}

Test(mnist, synthetic_gzip_and_raw_read_back) {
  read_synthetic(true);
  read_synthetic(false);
}

Test(mnist, bad_arguments) {
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_mnist m;
  cr_assert_eq(kiln_mnist_read(ctx, "/nonexistent", "validation", &m), KILN_ERR_INVALID);
  ASSERT_ERROR(ctx, KILN_ERR_INVALID, "kiln_mnist_read", "validation");
  assert_mnist_zeroed(&m);
  kiln_ctx_clear_error(ctx);
  cr_assert_eq(kiln_mnist_read(ctx, "/nonexistent", "train", NULL), KILN_ERR_INVALID);
  kiln_ctx_clear_error(ctx);
  cr_assert_eq(kiln_mnist_read(NULL, "/nonexistent", "train", &m), KILN_ERR_INVALID);
  kiln_ctx_free(ctx);
}

Test(mnist, gzip_truncated_in_the_middle) {
  char dir[256], path[1200];
  synthetic_split(dir, sizeof dir, true);
  snprintf(path, sizeof path, "%s/" IMAGES ".gz", dir);
  truncate_half(path);
  /* zlib reports a cut gzip stream as an unexpected end of file */
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_mnist m;
  cr_assert_eq(kiln_mnist_read(ctx, dir, "train", &m), KILN_ERR_FORMAT, "%s", kiln_ctx_error(ctx));
  const char *msg = kiln_ctx_error(ctx);
  cr_assert_not_null(strstr(msg, IMAGES ".gz"), "%s", msg);
  cr_assert(strstr(msg, "truncated") || strstr(msg, "unexpected end of file"),
            "the message does not say the file is cut short: %s", msg);
  assert_mnist_zeroed(&m);
  kiln_ctx_free(ctx);
  remove_dir(dir);
}

Test(mnist, gzip_with_corrupted_deflate_data) {
  char dir[256], path[1200];
  synthetic_split(dir, sizeof dir, true);
  snprintf(path, sizeof path, "%s/" IMAGES ".gz", dir);
  size_t n;
  char *p = read_whole(path, &n);
  for (size_t i = n / 3; i < n / 3 + 16; i++)
    p[i] ^= 0x5a;
  write_whole(path, p, n);
  free(p);
  EXPECT_MNIST_ERROR(dir, KILN_ERR_FORMAT, IMAGES, "corrupt");
  remove_dir(dir);
}

Test(mnist, raw_truncated_data_and_header) {
  char dir[256];
  make_tmpdir(dir, sizeof dir, "mnist");
  blob im = images_blob(SYN_N, SYN_ROWS, SYN_COLS), lb = labels_blob(SYN_N);
  put_file(dir, LABELS, lb, false);
  blob cut = {im.p, 16 + 1000};
  put_file(dir, IMAGES, cut, false);
  EXPECT_MNIST_ERROR(dir, KILN_ERR_FORMAT, IMAGES, "truncated", "the data", "56000", "1000");
  cut.n = 10;
  put_file(dir, IMAGES, cut, false);
  EXPECT_MNIST_ERROR(dir, KILN_ERR_FORMAT, IMAGES, "truncated", "the header", "16");
  cut.n = 0;
  put_file(dir, IMAGES, cut, false);
  EXPECT_MNIST_ERROR(dir, KILN_ERR_FORMAT, IMAGES, "truncated", "the header");
  /* the labels file cut short, images whole */
  put_file(dir, IMAGES, im, false);
  blob lcut = {lb.p, 8 + SYN_N / 2};
  put_file(dir, LABELS, lcut, false);
  EXPECT_MNIST_ERROR(dir, KILN_ERR_FORMAT, LABELS, "truncated");
  free(im.p);
  free(lb.p);
  remove_dir(dir);
}

Test(mnist, wrong_magic_numbers) {
  char dir[256];
  make_tmpdir(dir, sizeof dir, "mnist");
  blob im = images_blob(SYN_N, SYN_ROWS, SYN_COLS), lb = labels_blob(SYN_N);
  put_file(dir, LABELS, lb, true);
  /* the images file with the labels' magic */
  be32_put(im.p, 0x801);
  put_file(dir, IMAGES, im, true);
  EXPECT_MNIST_ERROR(dir, KILN_ERR_FORMAT, IMAGES, "magic", "0x00000801", "0x00000803");
  /* files swapped: labels where the images belong */
  be32_put(im.p, 0x803);
  put_file(dir, IMAGES, lb, true);
  EXPECT_MNIST_ERROR(dir, KILN_ERR_FORMAT, IMAGES, "magic");
  /* images fine, labels file with a float dtype (0x0d) */
  put_file(dir, IMAGES, im, true);
  be32_put(lb.p, 0xd01);
  put_file(dir, LABELS, lb, true);
  EXPECT_MNIST_ERROR(dir, KILN_ERR_FORMAT, LABELS, "magic", "0x00000d01");
  free(im.p);
  free(lb.p);
  remove_dir(dir);
}

Test(mnist, zero_and_huge_dims) {
  char dir[256];
  make_tmpdir(dir, sizeof dir, "mnist");
  blob im = images_blob(SYN_N, SYN_ROWS, SYN_COLS), lb = labels_blob(SYN_N);
  put_file(dir, LABELS, lb, false);
  be32_put(im.p + 8, 0); /* zero rows */
  put_file(dir, IMAGES, im, false);
  EXPECT_MNIST_ERROR(dir, KILN_ERR_FORMAT, IMAGES, "dim 1 is 0");
  be32_put(im.p + 8, SYN_ROWS);
  be32_put(im.p + 4, 0); /* zero images */
  put_file(dir, IMAGES, im, false);
  EXPECT_MNIST_ERROR(dir, KILN_ERR_FORMAT, IMAGES, "dim 0 is 0");
  be32_put(im.p + 4, 4000000000u); /* an absurd count must not be allocated */
  put_file(dir, IMAGES, im, false);
  EXPECT_MNIST_ERROR(dir, KILN_ERR_FORMAT, IMAGES, "dim 0 is 4000000000");
  free(im.p);
  free(lb.p);
  remove_dir(dir);
}

Test(mnist, image_and_label_counts_differ) {
  char dir[256];
  make_tmpdir(dir, sizeof dir, "mnist");
  blob im = images_blob(SYN_N, SYN_ROWS, SYN_COLS), lb = labels_blob(SYN_N - 1);
  put_file(dir, IMAGES, im, true);
  put_file(dir, LABELS, lb, true);
  EXPECT_MNIST_ERROR(dir, KILN_ERR_FORMAT, IMAGES, "100 images", "99 labels", LABELS);
  free(im.p);
  free(lb.p);
  remove_dir(dir);
}

Test(mnist, trailing_garbage) {
  char dir[256];
  make_tmpdir(dir, sizeof dir, "mnist");
  blob im = images_blob(SYN_N, SYN_ROWS, SYN_COLS), lb = labels_blob(SYN_N);
  put_file(dir, LABELS, lb, false);
  memcpy(im.p + im.n, "garbage", 7);
  blob longer = {im.p, im.n + 7};
  put_file(dir, IMAGES, longer, false);
  EXPECT_MNIST_ERROR(dir, KILN_ERR_FORMAT, IMAGES, "trailing bytes");
  /* the same bytes inside a gzip stream */
  char path[1200];
  snprintf(path, sizeof path, "%s/" IMAGES, dir);
  unlink(path);
  put_file(dir, IMAGES, longer, true);
  EXPECT_MNIST_ERROR(dir, KILN_ERR_FORMAT, IMAGES ".gz", "trailing bytes");
  /* one extra label, images whole */
  put_file(dir, IMAGES, im, true);
  lb.p[lb.n] = 1;
  blob more = {lb.p, lb.n + 1};
  put_file(dir, LABELS, more, false);
  EXPECT_MNIST_ERROR(dir, KILN_ERR_FORMAT, LABELS, "trailing bytes");
  free(im.p);
  free(lb.p);
  remove_dir(dir);
}

Test(mnist, label_out_of_range) {
  char dir[256];
  make_tmpdir(dir, sizeof dir, "mnist");
  blob im = images_blob(SYN_N, SYN_ROWS, SYN_COLS), lb = labels_blob(SYN_N);
  lb.p[8 + 37] = 12;
  put_file(dir, IMAGES, im, true);
  put_file(dir, LABELS, lb, true);
  EXPECT_MNIST_ERROR(dir, KILN_ERR_FORMAT, LABELS, "label 12", "record 37", "0-9");
  free(im.p);
  free(lb.p);
  remove_dir(dir);
}

Test(mnist, missing_files) {
  char dir[256];
  make_tmpdir(dir, sizeof dir, "mnist");
  EXPECT_MNIST_ERROR(dir, KILN_ERR_IO, IMAGES, "cannot open", "No such file");
  blob im = images_blob(SYN_N, SYN_ROWS, SYN_COLS);
  put_file(dir, IMAGES, im, true);
  EXPECT_MNIST_ERROR(dir, KILN_ERR_IO, LABELS, "cannot open");
  free(im.p);
  remove_dir(dir);
  EXPECT_MNIST_ERROR("/nonexistent/kiln-mnist", KILN_ERR_IO, IMAGES, "cannot open");
}

Test(mnist, random_bytes_that_are_not_gzip) {
  char dir[256];
  make_tmpdir(dir, sizeof dir, "mnist");
  blob junk = {malloc(4096), 4096};
  cr_assert_not_null(junk.p);
  uint64_t s = 99;
  for (size_t i = 0; i < junk.n; i++)
    junk.p[i] = (unsigned char)splitmix(&s);
  junk.p[0] = 0x42; /* not the gzip magic 1f 8b */
  char path[1200];
  snprintf(path, sizeof path, "%s/" IMAGES ".gz", dir);
  write_whole(path, junk.p, junk.n);
  blob lb = labels_blob(SYN_N);
  put_file(dir, LABELS, lb, true);
  EXPECT_MNIST_ERROR(dir, KILN_ERR_FORMAT, IMAGES, "magic");
  /* random bytes after a real gzip header are corrupt deflate data */
  junk.p[0] = 0x1f;
  junk.p[1] = 0x8b;
  junk.p[2] = 8;
  junk.p[3] = 0;
  write_whole(path, junk.p, junk.n);
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_mnist m;
  memset(&m, 0xab, sizeof m);
  kiln_status st = kiln_mnist_read(ctx, dir, "train", &m);
  cr_assert(st == KILN_ERR_FORMAT, "status %s: %s", kiln_status_name(st), kiln_ctx_error(ctx));
  cr_assert_not_null(strstr(kiln_ctx_error(ctx), IMAGES), "%s", kiln_ctx_error(ctx));
  assert_mnist_zeroed(&m);
  kiln_ctx_free(ctx);
  free(junk.p);
  free(lb.p);
  remove_dir(dir);
}

/* The KILN_MNIST directory, or the test is skipped with the reason. */
static const char *mnist_dir_or_skip(void) {
  const char *dir = getenv("KILN_MNIST");
  if (!dir || !*dir)
    cr_skip_test("KILN_MNIST is not set (it names the directory of the MNIST idx files, e.g. "
                 "/work/shared/data/mnist)");
  return dir;
}

static void assert_real_split(const kiln_mnist *m, int64_t n, int first_label) {
  cr_assert_eq(m->n, n);
  cr_assert_eq(m->rows, 28);
  cr_assert_eq(m->cols, 28);
  cr_assert_eq(m->labels[0], first_label, "first label %d", m->labels[0]);
  int64_t hist[10] = {0};
  for (int64_t i = 0; i < m->n; i++) {
    cr_assert_leq(m->labels[i], 9, "label %d of record %lld", m->labels[i], (long long)i);
    hist[m->labels[i]]++;
  }
  for (int c = 0; c < 10; c++)
    cr_assert(hist[c] > n / 20, "class %d has only %lld records", c, (long long)hist[c]);
  /* digits are dark strokes on a zero background: the corners are blank, the middle is not */
  int64_t ink = 0;
  for (int64_t i = 0; i < m->n; i++) {
    const uint8_t *im = m->images + i * 784;
    cr_assert_eq(im[0], 0, "image %lld has ink in its corner", (long long)i);
    for (int p = 0; p < 784; p++)
      ink += im[p] > 0;
  }
  cr_assert(ink > m->n * 784 / 10 && ink < m->n * 784 / 3, "ink in %lld of %lld pixels",
            (long long)ink, (long long)(m->n * 784));
}

Test(mnist, real_files) {
  const char *dir = mnist_dir_or_skip();
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_mnist tr, te;
  cr_assert_eq(kiln_mnist_read(ctx, dir, "train", &tr), KILN_OK, "%s", kiln_ctx_error(ctx));
  assert_real_split(&tr, 60000, 5);
  cr_assert_eq(kiln_mnist_read(ctx, dir, "t10k", &te), KILN_OK, "%s", kiln_ctx_error(ctx));
  assert_real_split(&te, 10000, 7);
  kiln_mnist_free(&tr);
  kiln_mnist_free(&te);
  kiln_ctx_free(ctx);
}

/* Decompresses src (gzip) into dst (raw). */
static void gunzip_file(const char *src, const char *dst) {
  gzFile in = gzopen(src, "rb");
  cr_assert_not_null(in, "gzopen %s", src);
  FILE *out = fopen(dst, "wb");
  cr_assert_not_null(out);
  char buf[1 << 16];
  int k;
  while ((k = gzread(in, buf, sizeof buf)) > 0)
    cr_assert_eq(fwrite(buf, 1, (size_t)k, out), (size_t)k);
  cr_assert_eq(k, 0, "gzread %s", src);
  gzclose(in);
  cr_assert_eq(fclose(out), 0);
}

Test(mnist, real_files_raw_copy_and_cut_copy) {
  const char *dir = mnist_dir_or_skip();
  char raw[256], src[1200], dst[1200];
  make_tmpdir(raw, sizeof raw, "mnist-raw");
  const char *names[2] = {"t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"};
  for (int i = 0; i < 2; i++) {
    snprintf(src, sizeof src, "%s/%s.gz", dir, names[i]);
    snprintf(dst, sizeof dst, "%s/%s", raw, names[i]);
    gunzip_file(src, dst);
  }
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_mnist gz, rw;
  cr_assert_eq(kiln_mnist_read(ctx, dir, "t10k", &gz), KILN_OK, "%s", kiln_ctx_error(ctx));
  cr_assert_eq(kiln_mnist_read(ctx, raw, "t10k", &rw), KILN_OK, "%s", kiln_ctx_error(ctx));
  assert_real_split(&rw, 10000, 7);
  cr_assert_eq(memcmp(gz.images, rw.images, 10000 * 784), 0, "raw and gzip images differ");
  cr_assert_eq(memcmp(gz.labels, rw.labels, 10000), 0, "raw and gzip labels differ");
  kiln_mnist_free(&gz);
  kiln_mnist_free(&rw);

  /* the real gzip file cut in the middle */
  snprintf(dst, sizeof dst, "%s/t10k-images-idx3-ubyte", raw);
  unlink(dst);
  size_t n;
  snprintf(src, sizeof src, "%s/t10k-images-idx3-ubyte.gz", dir);
  char *p = read_whole(src, &n);
  snprintf(dst, sizeof dst, "%s/t10k-images-idx3-ubyte.gz", raw);
  write_whole(dst, p, n / 2);
  free(p);
  kiln_mnist m;
  memset(&m, 0xab, sizeof m);
  cr_assert_eq(kiln_mnist_read(ctx, raw, "t10k", &m), KILN_ERR_FORMAT, "%s", kiln_ctx_error(ctx));
  const char *msg = kiln_ctx_error(ctx);
  cr_assert_not_null(strstr(msg, "t10k-images-idx3-ubyte.gz"), "%s", msg);
  cr_assert(strstr(msg, "truncated") || strstr(msg, "unexpected end of file"), "%s", msg);
  assert_mnist_zeroed(&m);
  kiln_ctx_free(ctx);
  remove_dir(raw);
}

/* ================================================================ regressions */

/*
 * Regression (core/tensor.c, kiln_tensor_free, fixed): freeing a persistent tensor flushes the
 * pending trace even on a no-GPU context, where a flush is an error, so the context fails with
 * "kiln_flush: the context has no GPU ..." and every later op records nothing. kiln_step_begin
 * guards its flush with ctx->has_gpu; kiln_tensor_free should do the same.
 */
Test(regressions, tensor_free_fails_a_no_gpu_context) {
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_tensor *a = f32(ctx, KILN_SHAPE(3)), *tmp = f32(ctx, KILN_SHAPE(3));
  kiln_relu(a);
  kiln_tensor_free(tmp);
  cr_assert_null(kiln_ctx_error(ctx), "freeing an unrelated tensor failed the context: %s",
                 kiln_ctx_error(ctx));
  cr_assert_not_null(kiln_exp(a), "the context records nothing after a kiln_tensor_free");
  kiln_ctx_free(ctx);
}

/*
 * Regression (core/tensor.c, kiln__is_contiguous, fixed): kiln__contiguous_strides counts a
 * zero-sized dim as 1 but kiln__is_contiguous multiplies by the 0, so a fresh (3,0) tensor is "not
 * contiguous": kiln_tensor_from_host then fails for it ("the target must be a persistent contiguous
 * tensor") and a reshape of it copies. Fix: in kiln__is_contiguous, s *= shape[i] > 0 ? shape[i] :
 * 1 (or treat any tensor with no elements as contiguous).
 */
Test(regressions, empty_tensors_are_not_contiguous) {
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_tensor *t = f32(ctx, KILN_SHAPE(3, 0));
  cr_assert(kiln_tensor_is_contiguous(t), "a fresh (3,0) tensor reports non-contiguous strides");
  float dummy = 0;
  kiln_tensor *h = kiln_tensor_from_host(ctx, KILN_DTYPE_F32, KILN_SHAPE(3, 0), &dummy);
  cr_assert_not_null(h, "kiln_tensor_from_host of an empty tensor: %s", kiln_ctx_error(ctx));
  int32_t n0 = tlen(ctx);
  assert_shape(kiln_reshape(t, KILN_SHAPE(0, 3)), KILN_SHAPE(0, 3));
  ASSERT_OPS_FROM(ctx, n0, KILN__OP_RESHAPE);
  kiln_ctx_free(ctx);
}

/*
 * Regression (core/ops.c, kiln_slice, fixed): the length (end - start + step - 1) / step overflows
 * int64 (undefined behaviour) for a large step, so kiln_slice(v, 0, 0, 5, INT64_MAX) has 0 elements
 * here instead of 1. Fix: len = end > start ? (end - start - 1) / step + 1 : 0.
 */
Test(regressions, slice_with_a_huge_step) {
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_tensor *v = f32(ctx, KILN_SHAPE(5));
  kiln_tensor *s = kiln_slice(v, 0, 0, 5, INT64_MAX);
  cr_assert_not_null(s, "%s", kiln_ctx_error(ctx));
  cr_assert_eq(kiln_tensor_dim(s, 0), 1, "slice [0:5:INT64_MAX] of 5 has %lld elements",
               (long long)kiln_tensor_dim(s, 0));
  kiln_ctx_free(ctx);
}

/*
 * Regression (autograd/rules.c, kiln__grad_slice, fixed): the backward of a stepped slice
 * interleaves zeros by inserting a dim, which a 6-D tensor (KILN_MAX_DIMS) has no room for: it
 * writes us.d[6], past the end of kiln_shape.d, and kiln_reshape then fails with "7 dims", so
 * kiln_backward fails. Fix: for a 6-D input merge the dims before the sliced axis (or the ones
 * after it) first, or give slice a scatter backward op.
 */
Test(regressions, backward_of_a_stepped_slice_of_a_6d_tensor) {
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_tensor *w = param(ctx, KILN_SHAPE(2, 2, 2, 2, 2, 4));
  kiln_tensor *loss = sum_all(kiln_slice(w, 5, 0, 4, 2));
  cr_assert_not_null(loss);
  kiln_status s = kiln_backward(loss);
  cr_assert_eq(s, KILN_OK, "kiln_backward: %s", kiln_ctx_error(ctx));
  cr_assert_not_null(kiln_tensor_grad(w));
  kiln_ctx_free(ctx);
}

/*
 * Regression (data/mnist.c, read_idx, fixed): bytes appended after the gzip stream (a .gz file with
 * trailing garbage) are accepted: zlib's gzread silently ignores non-gzip data after a member, so
 * the "trailing bytes" check never sees them. Fix: decode with inflate() (windowBits 16 +
 * MAX_WBITS) and after Z_STREAM_END require the rest of the file to be empty (or another gzip
 * member).
 */
Test(regressions, mnist_accepts_garbage_after_the_gzip_stream) {
  char dir[256], path[1200];
  synthetic_split(dir, sizeof dir, true);
  snprintf(path, sizeof path, "%s/" IMAGES ".gz", dir);
  FILE *f = fopen(path, "ab");
  cr_assert_not_null(f);
  cr_assert_eq(fwrite("garbage after the stream", 1, 24, f), 24u);
  cr_assert_eq(fclose(f), 0);
  EXPECT_MNIST_ERROR(dir, KILN_ERR_FORMAT, IMAGES ".gz", "trailing");
  remove_dir(dir);
}

/*
 * Regression (data/mnist.c, kiln_mnist_read, fixed): *out is zeroed only after the context and dir
 * checks, so on a context that has already failed (or with a NULL dir) the caller's struct keeps
 * whatever it held, and a caller that frees it on failure frees garbage. Fix: memset(out, 0, sizeof
 * *out) first, whenever out is not NULL.
 */
Test(regressions, mnist_struct_not_zeroed_on_a_failed_context) {
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_tensor *a = f32(ctx, KILN_SHAPE(2));
  cr_assert_null(kiln_add(a, f32(ctx, KILN_SHAPE(3))));
  kiln_mnist m;
  memset(&m, 0xab, sizeof m);
  cr_assert_eq(kiln_mnist_read(ctx, "/nonexistent", "train", &m), KILN_ERR_SHAPE);
  assert_mnist_zeroed(&m);
  kiln_ctx_clear_error(ctx);
  memset(&m, 0xab, sizeof m);
  cr_assert_eq(kiln_mnist_read(ctx, NULL, "train", &m), KILN_ERR_INVALID);
  assert_mnist_zeroed(&m);
  kiln_ctx_free(ctx);
}

Test(optim, learning_rate_schedules) {
  kiln_schedule c = {.kind = KILN_SCHEDULE_CONSTANT, .base_lr = 0.1f};
  cr_assert_float_eq(kiln_schedule_lr(&c, 1000), 0.1f, 0.f);
  kiln_schedule st = {.kind = KILN_SCHEDULE_STEP, .base_lr = 1.f, .step_size = 10, .gamma = 0.5f};
  cr_assert_float_eq(kiln_schedule_lr(&st, 9), 1.f, 0.f);
  cr_assert_float_eq(kiln_schedule_lr(&st, 10), 0.5f, 0.f);
  cr_assert_float_eq(kiln_schedule_lr(&st, 25), 0.25f, 0.f);
  kiln_schedule co = {
      .kind = KILN_SCHEDULE_COSINE, .base_lr = 1.f, .total_steps = 100, .min_lr = 0.1f};
  cr_assert_float_eq(kiln_schedule_lr(&co, 0), 1.f, 1e-7);
  cr_assert_float_eq(kiln_schedule_lr(&co, 50), 0.55f, 1e-6);
  cr_assert_float_eq(kiln_schedule_lr(&co, 100), 0.1f, 1e-7);
  cr_assert_float_eq(kiln_schedule_lr(&co, 25), 0.1 + 0.9 * (1 + cos(M_PI / 4)) / 2, 1e-6);
  kiln_schedule wl = {
      .kind = KILN_SCHEDULE_WARMUP_LINEAR, .base_lr = 2.f, .total_steps = 110, .warmup_steps = 10};
  cr_assert_float_eq(kiln_schedule_lr(&wl, 0), 0.f, 0.f);
  cr_assert_float_eq(kiln_schedule_lr(&wl, 5), 1.f, 1e-7);
  cr_assert_float_eq(kiln_schedule_lr(&wl, 10), 2.f, 1e-7);
  cr_assert_float_eq(kiln_schedule_lr(&wl, 60), 1.f, 1e-6);
  cr_assert_float_eq(kiln_schedule_lr(&wl, 200), 0.f, 0.f);
  /* torch.optim.lr_scheduler.OneCycleLR(max_lr=1, total_steps=100) with its defaults (pct_start
   * 0.3, cosine, div_factor 25, final_div_factor 1e4): 0.04 at step 0, 1 at step 29, 4e-6 at 99 */
  kiln_schedule oc = {.kind = KILN_SCHEDULE_ONE_CYCLE, .base_lr = 1.f, .total_steps = 100};
  cr_assert_float_eq(kiln_schedule_lr(&oc, 0), 0.04f, 1e-7);
  cr_assert_float_eq(kiln_schedule_lr(&oc, 29), 1.f, 1e-6);
  cr_assert_float_eq(kiln_schedule_lr(&oc, 99), 4e-6f, 1e-9);
  cr_assert_float_eq(kiln_schedule_lr(&oc, 14), 0.04 + 0.96 * (1 - cos(M_PI * 14 / 29)) / 2, 1e-6);
  /* attached to an optimizer, each step takes the rate of its step count */
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_params *p = kiln_params_new(ctx);
  kiln_linear l;
  cr_assert_eq(kiln_linear_init(&l, p, "fc", 4, 3, 1), KILN_OK);
  kiln_optim *o = kiln_sgd_new(p, &(kiln_sgd_options){.lr = 9.f});
  kiln_optim_set_schedule(o, &co);
  for (int t = 0; t < 3; t++) {
    kiln_tensor *loss =
        kiln_sum(kiln_linear_forward(&l, kiln_full(ctx, KILN_SHAPE(2, 4), 1.f)), KILN_ALL_AXES, 0);
    cr_assert_eq(kiln_backward(loss), KILN_OK, "%s", kiln_ctx_error(ctx));
    cr_assert_eq(kiln_optim_step(o), KILN_OK, "%s", kiln_ctx_error(ctx));
    cr_assert_float_eq(kiln_optim_lr(o), kiln_schedule_lr(&co, t), 0.f);
    const kiln__node *n = &ctx->trace.nodes[ctx->trace.n - 1];
    cr_assert_eq(n->op, KILN__OP_SGD);
    cr_assert_float_eq(n->f[0], kiln_schedule_lr(&co, t), 0.f, "the update node carries the rate");
    kiln_step_begin(ctx);
  }
  kiln_optim_free(o);
  kiln_params_free(p);
  kiln_ctx_free(ctx);
}
