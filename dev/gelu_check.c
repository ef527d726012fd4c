/*
 * gelu_check.c: the exact GELU and its gradient (fusion/device/math.cuh, compiled here on the host)
 * against long double references, beside the erff forms they replaced. No GPU: __fdividef is a
 * division and expf, erff are glibc's, each optionally pushed by whole ulps (the reciprocal by 1,
 * the exponential and erff by 2: what MUFU.RCP and CUDA's expf may be off by) to bound the
 * device's error. x: every multiple of 2^-16 in [-14, 14], a million random float32 bit patterns
 * with |x| <= 14, a few special values; the end of the output is at +-inf, NaN and a few others.
 *
 *     gcc -O2 -ffp-contract=off -I. -o /tmp/gelu_check dev/gelu_check.c -lm && /tmp/gelu_check
 */
#include <float.h>
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int rcp_ulp, exp_ulp; /* how far the device's approximate parts are pushed */
static float push(float v, int ulps) {
  for (int i = 0; i < abs(ulps); i++)
    v = nextafterf(v, ulps > 0 ? INFINITY : -INFINITY);
  return v;
}
static inline float __fdividef(float a, float b) { return push(a / b, rcp_ulp); }
static inline float dev_expf(float v) { return push(expf(v), exp_ulp); }
static inline float dev_erff(float v) { return push(erff(v), exp_ulp); }
#define atomicCAS(p, a, b)                                                                         \
  ((void)(p), (void)(a), (void)(b), 0) /* for kiln_dev_fail, not called here */
#define expf dev_expf
#include "fusion/device/math.cuh"
#undef expf

/* the erff forms as they were (nvcc contracts cdf + x * pdf to an fma) */
static float old_gelu(float x) { return 0.5f * x * (1.f + dev_erff(x * 0.70710678118654752f)); }
static float old_grad(float g, float x) {
  float cdf = 0.5f * (1.f + dev_erff(x * 0.70710678118654752f));
  float pdf = 0.39894228040143268f * dev_expf(-0.5f * x * x);
  return g * fmaf(x, pdf, cdf);
}

typedef long double ld;
static ld cdf(ld x) { return 0.5L * erfcl(-x / sqrtl(2.L)); }
static ld ref_gelu(ld x) { return isinf(x) ? (x > 0 ? x : 0) : x * cdf(x); }
static ld ref_grad(ld x) {
  return isinf(x) ? (x > 0) : cdf(x) + x * expl(-x * x / 2) / sqrtl(2.L * 3.14159265358979323846L);
}

typedef struct {
  double rel, relx, abs, absx;
} worst;
static void note(worst *w, ld ref, float v, float x, bool rel) {
  if (isnan(v)) {
    printf("NaN at x = %a\n", x);
    exit(1);
  }
  double e = (double)fabsl((ld)v - ref);
  if (rel && fabsl(ref) > 1e-30L && e / fabsl(ref) > w->rel) w->rel = e / fabsl(ref), w->relx = x;
  if (e > w->abs) w->abs = e, w->absx = x;
}

int main(void) {
  static const int pushes[][2] = {{0, 0}, {1, 2}, {-1, -2}, {1, -2}, {-1, 2}};
  static const float special[] = {0.f,    -0.f,    1e-45f, -1e-45f, FLT_MIN, -FLT_MIN,
                                  1e-20f, -1e-20f, 1.f,    -1.f,    5.5f,    -5.5f,
                                  14.43f, -14.43f, 14.5f,  -14.5f,  15.f,    -15.f,
                                  20.f,   -20.f,   1e30f,  -1e30f,  FLT_MAX, -FLT_MAX};
  const long nspecial = sizeof special / sizeof special[0], nrandom = 1000000, grid = 14l << 16;
  for (int m = 0; m < 5; m++) {
    rcp_ulp = pushes[m][0], exp_ulp = pushes[m][1];
    worst ng = {0}, og = {0}, nd = {0}, od = {0};
    uint64_t rng = 88172645463325252ull;
    for (long i = -nrandom - nspecial; i <= 2 * grid; i++) {
      float x;
      if (i < -nspecial) {
        do {
          rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
          uint32_t b = (uint32_t)rng;
          memcpy(&x, &b, 4);
        } while (!(fabsf(x) <= 14.f));
      } else if (i < 0) {
        x = special[i + nspecial];
      } else {
        x = (float)(i - grid) / 65536.f;
      }
      note(&ng, ref_gelu(x), kiln_gelu_erf(x), x, true);
      note(&og, ref_gelu(x), old_gelu(x), x, true);
      /* the gradient's relative error only in the tail: it is 0 at x = -0.75 */
      note(&nd, ref_grad(x), kiln_gelu_erf_grad(1.f, x), x, x < -1.f);
      note(&od, ref_grad(x), old_grad(1.f, x), x, x < -1.f);
    }
    printf("reciprocal pushed %+d ulp, expf and erff %+d ulp%s\n", rcp_ulp, exp_ulp,
           m ? " (the erff form's figures mean nothing here)" : "");
    printf("  gelu, relative, |gelu| > 1e-30: new %.3g at %g, erff %.3g at %g\n", ng.rel, ng.relx,
           og.rel, og.relx);
    printf("  gelu, absolute:                 new %.3g at %g, erff %.3g at %g\n", ng.abs, ng.absx,
           og.abs, og.absx);
    printf("  grad (g = 1), absolute:         new %.3g at %g, erff %.3g at %g\n", nd.abs, nd.absx,
           od.abs, od.absx);
    printf("  grad, relative, x < -1:         new %.3g at %g, erff %.3g at %g\n", nd.rel, nd.relx,
           od.rel, od.relx);
  }
  rcp_ulp = exp_ulp = 0;
  static const float at[] = {INFINITY, -INFINITY, NAN, 0.f, -0.f, 100.f, -100.f, -5.5f, -8.f};
  for (size_t i = 0; i < sizeof at / sizeof at[0]; i++) {
    float x = at[i];
    printf(
        "x = %g: gelu %g (erff %g, ref %Lg), grad(1, x) %g (erff %g, ref %Lg), grad(2.5, x) %g\n",
        x, kiln_gelu_erf(x), old_gelu(x), isnan(x) ? (ld)NAN : ref_gelu(x),
        kiln_gelu_erf_grad(1.f, x), old_grad(1.f, x), isnan(x) ? (ld)NAN : ref_grad(x),
        kiln_gelu_erf_grad(2.5f, x));
  }
  return 0;
}
