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

/* GELU, exact: x * Phi(x) */
KILN__FN float kiln_gelu_erf(float x) { return 0.5f * x * (1.f + erff(x * 0.70710678118654752f)); }
KILN__FN float kiln_gelu_erf_grad(float g, float x) {
  float cdf = 0.5f * (1.f + erff(x * 0.70710678118654752f));
  float pdf = 0.39894228040143268f * expf(-0.5f * x * x); /* 1 / sqrt(2 pi) */
  return g * (cdf + x * pdf);
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
