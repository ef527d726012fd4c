/*
 * helpers.c: shared test utilities (see helpers.h).
 */
#include "helpers.h"

#include <math.h>
#include <string.h>

kiln_ctx *th_cpu_ctx(void) {
  kiln_ctx *ctx = kiln_ctx_new(&(kiln_ctx_options){.no_gpu = 1});
  cr_assert_not_null(ctx);
  cr_assert_null(kiln_ctx_error(ctx));
  return ctx;
}

void th_fill(float *p, int64_t n, uint64_t seed, float lo, float hi) {
  uint64_t s = seed * 0x9e3779b97f4a7c15ULL + 12345;
  for (int64_t i = 0; i < n; i++) {
    uint64_t z = (s += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    z ^= z >> 31;
    p[i] = lo + (hi - lo) * (float)((double)(z >> 11) * 0x1.0p-53);
  }
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

void th_assert_ok(kiln_ctx *ctx) {
  cr_assert_null(kiln_ctx_error(ctx), "context error: %s", kiln_ctx_error(ctx));
}

void th_mlp_init(kiln_ctx *ctx, th_mlp *m) {
  m->params = kiln_params_new(ctx);
  cr_assert_eq(kiln_linear_init(&m->l1, m->params, "fc1", 784, 512, 1), KILN_OK);
  cr_assert_eq(kiln_linear_init(&m->l2, m->params, "fc2", 512, 512, 1), KILN_OK);
  cr_assert_eq(kiln_linear_init(&m->l3, m->params, "fc3", 512, 10, 1), KILN_OK);
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
