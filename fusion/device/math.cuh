/*
 * math.cuh: the helpers that op-table expressions (core/ops.def) call.
 */
#ifndef KILN_MATH_CUH
#define KILN_MATH_CUH

#include "defs.cuh"
#include "kargs.cuh"

/* Records a bad value v (n: the limit it broke) in *err with its code, if no other is there
 * (a relaxed race between bad values: one of them is kept). */
KILN__FN void kiln_dev_fail(long long v, long long n, int code, kiln__dev_error *err) {
  if (err && atomicCAS(&err->code, 0, code) == 0) {
    err->value = v;
    err->limit = n;
  }
}
/* Whether v lies in [0, n); the first value of a launch that does not is recorded. */
KILN__FN bool kiln_in_range(long long v, long long n, int code, kiln__dev_error *err) {
  if (v >= 0 && v < n) return true;
  kiln_dev_fail(v, n, code, err);
  return false;
}

/* A one-hot entry: 1 where the label is the class c; a label outside [0, classes) is an error */
KILN__FN float kiln_onehot(int label, long long c, long long classes, kiln__dev_error *err) {
  if (!kiln_in_range(label, classes, KILN__DEV_ERR_LABEL, err)) return 0.f;
  return label == c ? 1.f : 0.f;
}

/* An i32 sum, accumulated in 64 bits: a total outside the i32 range is an error */
KILN__FN int kiln_i32_total(long long v, kiln__dev_error *err) {
  if (v >= -2147483648ll && v <= 2147483647ll) return (int)v;
  kiln_dev_fail(v, 2147483648ll, KILN__DEV_ERR_OVERFLOW, err);
  return v < 0 ? (int)-2147483647 - 1 : 2147483647;
}

/* NaN wins, as in PyTorch */
KILN__FN float kiln_maximum(float a, float b) { return (a > b || a != a) ? a : b; }
KILN__FN float kiln_minimum(float a, float b) { return (a < b || a != a) ? a : b; }
KILN__FN float kiln_sigmoid(float x) { return 1.f / (1.f + expf(-x)); }
KILN__FN float kiln_clamp(float x, float lo, float hi) { return x < lo ? lo : (x > hi ? hi : x); }

/* GELU, exact: x * Phi(x), from Phi(-|x|) = t P(t) exp(-x^2 / 2), t = 1 / (1 + 0.35 |x|): one
 * exponential, shared with the density, and no erff (whose 1 + erf(x / sqrt 2) loses every digit
 * from x = -5.5 down). P, degree 8: fitted by least squares in float64 to Phi(-a) exp(a^2 / 2) / t
 * (relative error) over t in [1 / (1 + 0.35 * 14.5), 1], as past |x| = 14.43 the exponential is 0
 * in float32; the fitted Phi(-a)'s max relative error with these float32 coefficients: 3.7e-8
 * (dev/gelu_fit.py). The exponent is s + r, r the rounding error of s = -x^2 / 2, and the callers
 * take exp(s + r) as exp(s) (1 + r), so that the tail keeps its relative accuracy. |x| is capped at
 * 15 (the exponential is 0 there) where it meets the exponential, so that +-inf makes no inf * 0;
 * NaN gets through t. Returns t P(t) = Phi(-|x|) exp(x^2 / 2); *a: min(|x|, 15); *e: exp(s);
 * *r: s's rounding error. */
KILN__FN float kiln__gelu_tail(float x, float *a, float *e, float *r) {
  float t = __fdividef(1.f, fmaf(0.35f, fabsf(x), 1.f)); /* 0 for +-inf */
  float p = -0.029529655f;
  p = fmaf(p, t, 0.14578344f);
  p = fmaf(p, t, -0.25932795f);
  p = fmaf(p, t, 0.16313544f);
  p = fmaf(p, t, -0.025708536f);
  p = fmaf(p, t, 0.10654787f);
  p = fmaf(p, t, 0.11958619f);
  p = fmaf(p, t, 0.13989344f);
  p = fmaf(p, t, 0.13961974f);
  *a = fminf(fabsf(x), 15.f);
  float h = -0.5f * *a; /* exact */
  float s = h * *a;
  *r = fmaf(h, *a, -s);
  *e = expf(s);
  return t * p;
}
/* With q = Phi(-|x|): x (1 - q) from 0 on, x q = -|x| q below (0 at -inf, inf at inf) */
KILN__FN float kiln_gelu_erf(float x) {
  float a, e, r;
  float q = kiln__gelu_tail(x, &a, &e, &r) * e;
  q = fmaf(q, r, q);
  return fmaf(-a, q, fmaxf(x, 0.f));
}
/* g (Phi(x) + x pdf(x)), pdf(x) = exp(-x^2 / 2) / sqrt(2 pi): with d = Phi(-|x|) - |x| pdf(x),
 * g d below 0, g (1 - d) from 0 on (g at inf, 0 at -inf) */
KILN__FN float kiln_gelu_erf_grad(float g, float x) {
  float a, e, r;
  float q = kiln__gelu_tail(x, &a, &e, &r);
  float d = fmaf(-a, 0.39894228040143268f, q) * e;
  d = fmaf(d, r, d);
  return g * (x < 0.f ? d : 1.f - d);
}

/* GELU, tanh approximation: sqrt(2 / pi) (x + 0.044715 x^3) */
KILN__FN float kiln_gelu_tanh(float x) {
  float u = 0.79788456080286536f * (x + 0.044715f * x * x * x);
  return 0.5f * x * (1.f + tanhf(u));
}
KILN__FN float kiln_gelu_tanh_grad(float g, float x) {
  float u = 0.79788456080286536f * (x + 0.044715f * x * x * x);
  float t = tanhf(u);
  float du = 0.79788456080286536f * (1.f + 3.f * 0.044715f * x * x);
  return g * (0.5f * (1.f + t) + 0.5f * x * (1.f - t * t) * du);
}

#endif
