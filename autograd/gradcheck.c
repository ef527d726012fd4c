/*
 * gradcheck.c: compares kiln_backward's gradients with central finite differences. The scalar
 * checked is sum(fn(inputs) * w) for a fixed random w, so that every output element counts.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../core/internal.h"

static double eval(kiln_ctx *ctx, kiln_gradcheck_fn fn, kiln_tensor *const *inputs, void *user,
                   kiln_tensor *w, bool backward) {
  kiln_step_begin(ctx);
  kiln_tensor *out = fn(inputs, user);
  if (!out) return NAN;
  kiln_tensor *loss = kiln_sum(kiln_mul(out, w), KILN_ALL_AXES, 0);
  if (backward && kiln_backward(loss) != KILN_OK) return NAN;
  /* read after the step ends: with step graphs on, the step runs whole at kiln_step_end */
  if (kiln_step_end(ctx) != KILN_OK) return NAN;
  return kiln_tensor_item(loss);
}

kiln_status kiln_gradcheck(kiln_ctx *ctx, kiln_gradcheck_fn fn, int n, kiln_tensor *const *inputs,
                           void *user, const kiln_gradcheck_options *opts, char *report,
                           size_t report_len) {
  if (!kiln__ok(ctx)) return kiln_ctx_status(ctx);
  if (!fn || n < 1 || !inputs)
    return kiln__error(
        ctx, KILN_ERR_INVALID,
        "kiln_gradcheck: needs a function and n >= 1 inputs (fn %s, n %d, inputs %s)",
        fn ? "given" : "NULL", n, inputs ? "given" : "NULL");
  kiln_gradcheck_options o = {.eps = 1e-2f, .atol = 1e-2f, .rtol = 1e-2f, .seed = 1};
  if (opts) { /* zero fields are the defaults; KILN_ZERO is an exact 0 */
    o.eps = kiln__opt_or(opts->eps, o.eps);
    o.atol = kiln__opt_or(opts->atol, o.atol);
    o.rtol = kiln__opt_or(opts->rtol, o.rtol);
    o.seed = opts->seed;
  }
  if (!(o.eps > 0.f && isfinite(o.eps)) || !(o.atol >= 0.f && isfinite(o.atol)) ||
      !(o.rtol >= 0.f && isfinite(o.rtol)))
    return kiln__error(ctx, KILN_ERR_INVALID,
                       "kiln_gradcheck: eps %g must be finite and > 0, atol %g and rtol %g finite "
                       "and >= 0",
                       o.eps, o.atol, o.rtol);
  if (report && report_len) report[0] = 0;
  for (int i = 0; i < n; i++) {
    if (!kiln__check(ctx, inputs[i], __func__)) return ctx->status;
    if (!inputs[i]->persistent || !inputs[i]->requires_grad || !kiln__is_contiguous(inputs[i]))
      return kiln__error(ctx, KILN_ERR_INVALID,
                         "kiln_gradcheck: input %d must be persistent, contiguous and require "
                         "grad",
                         i);
  }
  /* the output's shape, for w */
  kiln_step_begin(ctx);
  kiln_tensor *probe = fn(inputs, user);
  if (!probe)
    return kiln__ok(ctx) ? kiln__error(ctx, KILN_ERR_INVALID,
                                       "kiln_gradcheck: fn returned NULL without an error: nothing "
                                       "to check")
                         : ctx->status;
  kiln_shape os = kiln_tensor_shape(probe);
  int64_t on = kiln_tensor_numel(probe);
  float *wh = malloc((size_t)(on > 0 ? on : 1) * sizeof *wh);
  if (!wh) return kiln__error(ctx, KILN_ERR_OOM, "kiln_gradcheck: out of host memory");
  uint64_t saved = ctx->host_rng;
  ctx->host_rng = o.seed * 0x9e3779b97f4a7c15ULL + 7;
  for (int64_t k = 0; k < on; k++)
    wh[k] = (float)(kiln__rng_uniform(ctx) * 2.0 - 1.0);
  ctx->host_rng = saved;
  kiln_tensor *w = kiln_tensor_from_host(ctx, KILN_DTYPE_F32, os, wh);
  free(wh);
  if (!w) return ctx->status;

  for (int i = 0; i < n; i++)
    kiln_tensor_zero_grad(inputs[i]);
  double base = eval(ctx, fn, inputs, user, w, true);
  kiln_status st = kiln_ctx_status(ctx);
  double worst = -1;
  for (int i = 0; i < n && st == KILN_OK && !isnan(base); i++) {
    kiln_tensor *x = inputs[i];
    int64_t m = kiln_tensor_numel(x);
    float *xh = malloc((size_t)m * sizeof *xh), *gh = malloc((size_t)m * sizeof *gh);
    if (!xh || !gh) {
      free(xh);
      free(gh);
      st = kiln__error(ctx, KILN_ERR_OOM, "kiln_gradcheck: out of host memory");
      break;
    }
    kiln_tensor *g = kiln_tensor_grad(x);
    if (g)
      kiln_tensor_to_host(g, gh, (size_t)m * sizeof *gh);
    else
      memset(gh, 0, (size_t)m * sizeof *gh); /* no path from x: its gradient is zero */
    kiln_tensor_to_host(x, xh, (size_t)m * sizeof *xh);
    for (int64_t k = 0; k < m && kiln__ok(ctx); k++) {
      float keep = xh[k];
      xh[k] = keep + o.eps;
      kiln_tensor_copy_from_host(x, xh, (size_t)m * sizeof *xh);
      double lp = eval(ctx, fn, inputs, user, w, false);
      xh[k] = keep - o.eps;
      kiln_tensor_copy_from_host(x, xh, (size_t)m * sizeof *xh);
      double lm = eval(ctx, fn, inputs, user, w, false);
      xh[k] = keep;
      kiln_tensor_copy_from_host(x, xh, (size_t)m * sizeof *xh);
      double num = (lp - lm) / (2.0 * o.eps);
      double err = fabs(num - gh[k]);
      double tol = o.atol + o.rtol * fabs(num);
      if (!(err <= tol) && err - tol > worst) {
        worst = err - tol;
        if (report)
          snprintf(report, report_len,
                   "input %d element %lld: analytic %.6g, numeric %.6g (|diff| %.3g > tol %.3g)", i,
                   (long long)k, gh[k], num, err, tol);
      }
    }
    free(xh);
    free(gh);
    st = kiln_ctx_status(ctx);
  }
  kiln_step_begin(ctx);
  kiln_tensor_free(w);
  if (st != KILN_OK) return st;
  if (isnan(base)) return kiln_ctx_status(ctx) != KILN_OK ? kiln_ctx_status(ctx) : KILN_ERR_STATE;
  return worst >= 0 ? KILN_ERR_INVALID : KILN_OK;
}
