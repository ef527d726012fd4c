/*
 * helpers.c: shared test utilities (see helpers.h).
 */
#include "helpers.h"

#include <dirent.h>
#include <math.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include "internal.h"

/* ---------------------------------------------------------------- contexts */

kiln_ctx *th_cpu_ctx(void) {
  kiln_ctx *ctx = kiln_ctx_new(&(kiln_ctx_options){.no_gpu = 1});
  cr_assert_not_null(ctx);
  cr_assert_null(kiln_ctx_error(ctx));
  return ctx;
}

void th_ctx_free(kiln_ctx *ctx) {
  cr_assert_not_null(ctx, "th_ctx_free: NULL context");
  if (ctx->npersistent > 0) {
    char left[1024] = "";
    size_t k = 0;
    for (int i = 0; i < ctx->npersistent && k + 1 < sizeof left; i++) {
      const kiln_tensor *t = ctx->persistents[i];
      char sh[96];
      int w = snprintf(left + k, sizeof left - k, "%s'%s' %s %s", i ? ", " : "",
                       t->name && t->name[0] ? t->name : "(unnamed)", kiln_dtype_name(t->dtype),
                       kiln_shape_str(kiln_tensor_shape(t), sh, sizeof sh));
      k = w > 0 && k + (size_t)w < sizeof left ? k + (size_t)w : sizeof left - 1;
    }
    cr_assert_fail("th_ctx_free: the test left %d persistent tensor(s) in its context: %s",
                   ctx->npersistent, left);
  }
  kiln_ctx_free(ctx);
}

const char *th_err(kiln_ctx *ctx) {
  const char *e = kiln_ctx_error(ctx);
  return e ? e : "no error set";
}

void th_assert_ok(kiln_ctx *ctx) {
  cr_assert_null(kiln_ctx_error(ctx), "context error: %s", kiln_ctx_error(ctx));
}

/* ---------------------------------------------------------------- random numbers */

uint64_t th_rng_next(th_rng *r) { return kiln__splitmix64(&r->s); } /* core/util.h */
int th_rng_below(th_rng *r, int n) { return (int)(th_rng_next(r) % (uint64_t)n); }
double th_rng_unit(th_rng *r) { return (double)(th_rng_next(r) >> 11) * 0x1.0p-53; }
bool th_rng_chance(th_rng *r, double p) { return th_rng_unit(r) < p; }
float th_rng_range(th_rng *r, float lo, float hi) { return lo + (hi - lo) * (float)th_rng_unit(r); }

void th_fill(float *p, int64_t n, uint64_t seed, float lo, float hi) {
  th_rng r = {.s = seed * 0x9e3779b97f4a7c15ULL + 12345};
  for (int64_t i = 0; i < n; i++)
    p[i] = lo + (hi - lo) * (float)th_rng_unit(&r);
}

kiln_tensor *th_rand(kiln_ctx *ctx, kiln_shape s, uint64_t seed, float lo, float hi, float **host) {
  int64_t n = 1;
  for (int i = 0; i < s.ndim; i++)
    n *= s.d[i];
  float *h = malloc((size_t)(n > 0 ? n : 1) * sizeof *h);
  cr_assert_not_null(h);
  th_fill(h, n, seed, lo, hi);
  kiln_tensor *t = kiln_tensor_from_host(ctx, KILN_DTYPE_F32, s, h);
  cr_assert_not_null(t, "kiln_tensor_from_host: %s", kiln_ctx_error(ctx));
  if (host)
    *host = h;
  else
    free(h);
  return t;
}

/* ---------------------------------------------------------------- host copies */

/* Reads any 4-byte-element tensor into a malloc'd host buffer. */
static void *read4(kiln_tensor *t) {
  cr_assert_not_null(t, "th_read: NULL tensor (an op before it failed)");
  int64_t n = kiln_tensor_numel(t);
  void *h = malloc((size_t)(n > 0 ? n : 1) * 4);
  cr_assert_not_null(h);
  kiln_status s = kiln_tensor_to_host(t, h, (size_t)n * 4);
  cr_assert_eq(s, KILN_OK, "kiln_tensor_to_host: %s", kiln_ctx_error(kiln_tensor_ctx(t)));
  return h;
}

float *th_read(kiln_tensor *t) {
  cr_assert(t == NULL || kiln_tensor_dtype(t) == KILN_DTYPE_F32, "th_read: not an f32 tensor");
  return read4(t);
}

int32_t *th_read_i32(kiln_tensor *t) {
  cr_assert(t == NULL || kiln_tensor_dtype(t) == KILN_DTYPE_I32, "th_read_i32: not i32");
  return read4(t);
}

float *th_params_values(kiln_params *p, int64_t *n) {
  *n = kiln_params_numel(p);
  float *all = malloc((size_t)(*n > 0 ? *n : 1) * sizeof *all), *at = all;
  cr_assert_not_null(all);
  for (int i = 0; i < kiln_params_count(p); i++) {
    kiln_tensor *t = kiln_params_get(p, i);
    float *v = th_read(t);
    memcpy(at, v, (size_t)kiln_tensor_numel(t) * sizeof *v);
    at += kiln_tensor_numel(t);
    free(v);
  }
  return all;
}

void th_assert_close(const float *got, const double *want, int64_t n, double atol, double rtol,
                     const char *what) {
  for (int64_t i = 0; i < n; i++) {
    double g = got[i], w = want[i];
    bool both_nan = isnan(g) && isnan(w);
    bool same_inf = isinf(g) && isinf(w) && (g > 0) == (w > 0);
    if (both_nan || same_inf) continue;
    cr_assert(fabs(g - w) <= atol + rtol * fabs(w),
              "%s: element %lld: got %.9g, want %.9g (atol %g, rtol %g)", what, (long long)i, g, w,
              atol, rtol);
  }
}

/* ---------------------------------------------------------------- the benchmark MLP */

void th_mlp_init(kiln_ctx *ctx, th_mlp *m) {
  m->params = kiln_params_new(ctx);
  cr_assert_eq(kiln_linear_init(&m->l1, m->params,
                                &(kiln_linear_options){.name = "fc1", .in = 784, .out = 512}),
               KILN_OK);
  cr_assert_eq(kiln_linear_init(&m->l2, m->params,
                                &(kiln_linear_options){.name = "fc2", .in = 512, .out = 512}),
               KILN_OK);
  cr_assert_eq(kiln_linear_init(&m->l3, m->params,
                                &(kiln_linear_options){.name = "fc3", .in = 512, .out = 10}),
               KILN_OK);
  kiln_sgd_options so = kiln_sgd_defaults(0.05f);
  so.momentum = 0.9f;
  so.nesterov = 1;
  m->opt = kiln_sgd_new(m->params, &so);
  cr_assert_not_null(m->opt, "%s", kiln_ctx_error(ctx));
}

kiln_tensor *th_mlp_logits(const th_mlp *m, kiln_tensor *x) {
  kiln_tensor *h = kiln_relu(kiln_linear_forward(&m->l1, x));
  h = kiln_relu(kiln_linear_forward(&m->l2, h));
  return kiln_linear_forward(&m->l3, h);
}

kiln_tensor *th_mlp_record_step(th_mlp *m, kiln_tensor *x, kiln_tensor *y) {
  kiln_tensor *loss = kiln_cross_entropy(th_mlp_logits(m, x), y, KILN_REDUCTION_MEAN, 0.f);
  kiln_optim_zero_grad(m->opt);
  kiln_backward(loss);
  kiln_optim_step(m->opt);
  return loss;
}

void th_mlp_free(th_mlp *m) {
  kiln_optim_free(m->opt);
  kiln_params_free(m->params);
}

/* ---------------------------------------------------------------- files */

static char tmpdirs[8][256];
static int ntmpdirs;

char *th_tmpdir(char *buf, size_t n, const char *what) {
  static bool at_exit;
  if (!at_exit) /* also when a test skips or fails before its suite's .fini would run */
    at_exit = atexit(th_remove_tmpdirs) == 0;
  snprintf(buf, n, "/tmp/kiln-test-%s-XXXXXX", what);
  cr_assert_not_null(mkdtemp(buf), "mkdtemp %s failed", buf);
  if (ntmpdirs < 8) snprintf(tmpdirs[ntmpdirs++], sizeof tmpdirs[0], "%s", buf);
  return buf;
}

void th_remove_tmpdirs(void) {
  for (int i = 0; i < ntmpdirs; i++)
    th_remove_dir(tmpdirs[i]);
  ntmpdirs = 0;
}

void th_remove_dir(const char *dir) {
  DIR *d = opendir(dir);
  if (!d) return;
  struct dirent *e;
  char path[1200];
  while ((e = readdir(d))) {
    if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0) continue;
    snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
    struct stat st;
    if (lstat(path, &st) == 0 && S_ISDIR(st.st_mode))
      th_remove_dir(path); /* a folder inside (a link to one is unlinked, not followed) */
    else
      unlink(path);
  }
  closedir(d);
  rmdir(dir);
}

int th_list_files(const char *dir, const char *suffix, char paths[][1200], int max) {
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

char *th_read_whole(const char *path, size_t *len) {
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

void th_write_whole(const char *path, const void *p, size_t n) {
  FILE *f = fopen(path, "wb");
  cr_assert_not_null(f, "cannot create %s", path);
  cr_assert_eq(fwrite(p, 1, n, f), n);
  cr_assert_eq(fclose(f), 0);
}

void th_corrupt_third(const char *path) {
  size_t n;
  char *p = th_read_whole(path, &n);
  for (size_t i = n / 3; i < n / 3 + 16 && i < n; i++)
    p[i] ^= 0x5a;
  th_write_whole(path, p, n);
  free(p);
}

void th_truncate_half(const char *path) {
  struct stat sb;
  cr_assert_eq(stat(path, &sb), 0);
  cr_assert_eq(truncate(path, sb.st_size / 2), 0);
}

uint8_t *th_gunzip(const char *path, size_t *n) {
  gzFile in = gzopen(path, "rb");
  cr_assert_not_null(in, "gzopen %s", path);
  size_t cap = 1 << 22, len = 0;
  uint8_t *p = malloc(cap);
  cr_assert_not_null(p);
  int k;
  while ((k = gzread(in, p + len, (unsigned)(cap - len))) > 0) {
    len += (size_t)k;
    if (len == cap) {
      p = realloc(p, cap *= 2);
      cr_assert_not_null(p);
    }
  }
  cr_assert_eq(k, 0, "gzread %s", path);
  gzclose(in);
  *n = len;
  return p;
}

kiln_tensor *th_bn_relu_then_stride2(kiln_tensor *x, kiln_tensor *gamma, kiln_tensor *k) {
  kiln_ctx *ctx = kiln_tensor_ctx(x);
  kiln_autocast_begin(ctx, KILN_DTYPE_BF16);
  kiln_tensor *h =
      kiln_batch_norm(kiln_cast(x, KILN_DTYPE_BF16), gamma, NULL, NULL, NULL, 1, 0.1f, 1e-5f);
  h = kiln_relu(h);
  if (k)
    h = kiln_conv2d(h, k, NULL,
                    &(kiln_conv2d_options){.pad_h = 1, .pad_w = 1, .stride_h = 2, .stride_w = 2});
  else
    h = kiln_max_pool2d(
        h, &(kiln_pool2d_options){
               .kernel_h = 3, .kernel_w = 3, .stride_h = 2, .stride_w = 2, .pad_h = 1, .pad_w = 1});
  kiln_autocast_end(ctx);
  return h;
}
