/*
 * custom_kernel: matmul + bias + ReLU written by hand as a custom op
 * (examples/custom_linear_relu.h: a forward kernel and three backward kernels,
 * include/kiln_custom.h), checked against kiln's own fused path (a cuBLAS product with its bias and
 * ReLU epilogue), values and gradients, and both timed as a training step's forward and backward
 * replayed from its step graph.
 *
 *   custom_kernel [--batch B] [--in K] [--out N] [--steps S]
 *
 * Both run in plain f32 (TF32 off), so that they compute the same sums; the check allows for the
 * different order of the additions. Exits 1 when they disagree.
 */
#include <cuda_runtime.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "custom_linear_relu.h"

static void die(kiln_ctx *ctx, const char *what) {
  fprintf(stderr, "custom_kernel: %s: %s\n", what, kiln_ctx_error(ctx) ? kiln_ctx_error(ctx) : "?");
  exit(1);
}

typedef struct layer {
  kiln_tensor *x, *w, *b, *r; /* r weighs the loss, sum(y * r) */
} layer;

static kiln_tensor *random_tensor(kiln_ctx *ctx, kiln_shape s, float scale, int grad) {
  int64_t n = 1;
  for (int d = 0; d < s.ndim; d++)
    n *= s.d[d];
  float *h = malloc((size_t)n * sizeof *h);
  if (!h) exit(1);
  for (int64_t i = 0; i < n; i++)
    h[i] = scale * (2.f * (float)rand() / (float)RAND_MAX - 1.f);
  kiln_tensor *t = kiln_tensor_from_host(ctx, KILN_DTYPE_F32, s, h);
  free(h);
  if (!t) die(ctx, "kiln_tensor_from_host");
  kiln_tensor_set_requires_grad(t, grad);
  return t;
}

/* One step's forward and backward: the custom op's, or kiln's own ops'. With ev, the events
 * ev[0] and ev[1] bracket the step graph's launch, which kiln_step_end makes (the stream idle
 * before it). */
static kiln_tensor *step(kiln_ctx *ctx, const custom_linear_relu *ops, const layer *l, int custom,
                         cudaEvent_t *ev) {
  kiln_tensor_zero_grad(l->x);
  kiln_tensor_zero_grad(l->w);
  kiln_tensor_zero_grad(l->b);
  kiln_step_begin(ctx);
  kiln_tensor *y = custom
                       ? kiln_custom(ops->fwd, (kiln_tensor *[]){l->x, l->w, l->b}, NULL)
                       : kiln_relu(kiln_add(kiln_matmul(l->x, kiln_transpose(l->w, 0, 1)), l->b));
  kiln_backward(kiln_sum(kiln_mul(y, l->r), KILN_ALL_AXES, 0));
  cudaStream_t stream = (cudaStream_t)kiln_ctx_stream(ctx);
  if (ev) { /* the stream idle (kiln_sync would run the step's nodes now, without its graph) */
    cudaStreamSynchronize(stream);
    cudaEventRecord(ev[0], stream);
  }
  if (kiln_step_end(ctx) != KILN_OK) die(ctx, custom ? "the custom step" : "kiln's own step");
  if (ev) cudaEventRecord(ev[1], stream);
  return y;
}

static float *read(kiln_ctx *ctx, kiln_tensor *t) {
  size_t n = (size_t)kiln_tensor_numel(t);
  float *h = malloc(n * sizeof *h);
  if (!h || kiln_tensor_to_host(t, h, n * sizeof *h) != KILN_OK) die(ctx, "reading a result");
  return h;
}

/* The largest difference relative to the largest value: max |a - b| / max |b|. */
static double disagreement(const float *a, const float *b, int64_t n) {
  double diff = 0, big = 1e-30;
  for (int64_t i = 0; i < n; i++) {
    diff = fmax(diff, fabs((double)a[i] - b[i]));
    big = fmax(big, fabs((double)b[i]));
  }
  return diff / big;
}

static int cmp_float(const void *a, const void *b) {
  float x = *(const float *)a, y = *(const float *)b;
  return (x > y) - (x < y);
}

/* The median device time of a step, over steps replays after a warm-up. */
static float time_steps(kiln_ctx *ctx, const custom_linear_relu *ops, const layer *l, int custom,
                        int steps) {
  cudaEvent_t ev[2];
  cudaEventCreate(&ev[0]);
  cudaEventCreate(&ev[1]);
  float *ms = malloc((size_t)steps * sizeof *ms);
  if (!ms) exit(1);
  for (int s = 0; s < 10; s++)
    step(ctx, ops, l, custom, NULL);
  for (int s = 0; s < steps; s++) {
    step(ctx, ops, l, custom, ev);
    cudaEventSynchronize(ev[1]);
    cudaEventElapsedTime(&ms[s], ev[0], ev[1]);
  }
  qsort(ms, (size_t)steps, sizeof *ms, cmp_float);
  float median = ms[steps / 2];
  free(ms);
  cudaEventDestroy(ev[0]);
  cudaEventDestroy(ev[1]);
  return median;
}

int main(int argc, char **argv) {
  int64_t B = 256, K = 1024, N = 1024;
  int steps = 50;
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    int64_t *dst = strcmp(a, "--batch") == 0 ? &B
                   : strcmp(a, "--in") == 0  ? &K
                   : strcmp(a, "--out") == 0 ? &N
                                             : NULL;
    if ((dst || strcmp(a, "--steps") == 0) && i + 1 < argc) {
      long long v = strtoll(argv[++i], NULL, 10);
      if (v < 1 || v > (1 << 20)) {
        fprintf(stderr, "custom_kernel: %s %lld is outside [1, 2^20]\n", a, v);
        return 2;
      }
      if (dst)
        *dst = v;
      else
        steps = (int)v;
      continue;
    }
    fprintf(stderr, "usage: %s [--batch B] [--in K] [--out N] [--steps S]\n", argv[0]);
    return 2;
  }
  kiln_ctx *ctx = kiln_ctx_new(NULL);
  if (!ctx || !kiln_ctx_has_gpu(ctx)) die(ctx, "no GPU");
  kiln_set_tf32(ctx, 0); /* both in plain f32 */
  custom_linear_relu ops;
  if (custom_linear_relu_new(ctx, &ops) != KILN_OK) die(ctx, "making the custom ops");
  srand(1);
  layer l = {.x = random_tensor(ctx, KILN_SHAPE(B, K), 1.f, 1),
             .w = random_tensor(ctx, KILN_SHAPE(N, K), 1.f / sqrtf((float)K), 1),
             .b = random_tensor(ctx, KILN_SHAPE(N), 0.1f, 1),
             .r = random_tensor(ctx, KILN_SHAPE(B, N), 1.f, 0)};

  /* values and gradients, the custom op against kiln's own path */
  kiln_tensor *leaf[3] = {l.x, l.w, l.b};
  const char *names[4] = {"y", "dx", "dW", "db"};
  float *got[4], *want[4];
  int64_t count[4] = {B * N, B * K, N * K, N};
  for (int custom = 1; custom >= 0; custom--) {
    float **dst = custom ? got : want;
    dst[0] = read(ctx, step(ctx, &ops, &l, custom, NULL));
    for (int k = 0; k < 3; k++)
      dst[k + 1] = read(ctx, kiln_tensor_grad(leaf[k]));
  }
  int bad = 0;
  printf("custom_kernel: y = relu(x W^T + b), x (%lld, %lld), W (%lld, %lld), f32\n", (long long)B,
         (long long)K, (long long)N, (long long)K);
  for (int k = 0; k < 4; k++) {
    double d = disagreement(got[k], want[k], count[k]);
    bad |= !(d < 1e-4);
    printf("  %-2s custom vs kiln's own: max |difference| / max |value| = %.2e%s\n", names[k], d,
           d < 1e-4 ? "" : "  <- too large");
    free(got[k]);
    free(want[k]);
  }

  /* time: forward and backward, 6 B K N floating-point operations */
  double flop = 6.0 * (double)B * (double)K * (double)N;
  float tc = time_steps(ctx, &ops, &l, 1, steps), tk = time_steps(ctx, &ops, &l, 0, steps);
  printf("  step (forward + backward), median of %d replays:\n", steps);
  printf("    custom kernels    %8.3f ms  %6.2f TFLOP/s\n", tc, flop / (tc * 1e-3) / 1e12);
  printf("    kiln's own path   %8.3f ms  %6.2f TFLOP/s  (cuBLAS, fused bias and ReLU)\n", tk,
         flop / (tk * 1e-3) / 1e12);
  for (int k = 0; k < 4; k++)
    kiln_tensor_free(k < 3 ? leaf[k] : l.r);
  kiln_ctx_free(ctx);
  return bad;
}
