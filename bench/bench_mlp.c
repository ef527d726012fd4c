/*
 * bench_mlp: the `mlp` workload of DESIGN.md: a 784-512-512-10 ReLU MLP, batch 128, fp32,
 * cross-entropy, SGD with Nesterov momentum, on random inputs of the real shapes. Prints one
 * JSON line: median ms per training step (over blocks of steps timed with CUDA events after a
 * warm-up), kernels launched per step and peak device memory.
 *
 *   bench_mlp [--steps N] [--blocks N] [--mode fused|unfused]
 */
#include <cuda_runtime_api.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kiln.h"

static void die(kiln_ctx *ctx, const char *what) {
  fprintf(stderr, "bench_mlp: %s: %s\n", what, kiln_ctx_error(ctx) ? kiln_ctx_error(ctx) : "?");
  exit(1);
}

static int cmp(const void *a, const void *b) {
  float x = *(const float *)a, y = *(const float *)b;
  return (x > y) - (x < y);
}

int main(int argc, char **argv) {
  int steps = 100, blocks = 21;
  const char *mode = "fused";
  for (int i = 1; i < argc; i++) {
    if (strcmp(argv[i], "--steps") == 0 && i + 1 < argc)
      steps = atoi(argv[++i]);
    else if (strcmp(argv[i], "--blocks") == 0 && i + 1 < argc)
      blocks = atoi(argv[++i]);
    else if (strcmp(argv[i], "--mode") == 0 && i + 1 < argc)
      mode = argv[++i];
    else {
      fprintf(stderr, "usage: %s [--steps N] [--blocks N] [--mode fused|unfused]\n", argv[0]);
      return 2;
    }
  }
  if (steps < 1 || blocks < 1 || blocks > 1000) {
    fprintf(stderr, "bench_mlp: --steps and --blocks must be positive (blocks <= 1000)\n");
    return 2;
  }
  if (strcmp(mode, "fused") != 0 && strcmp(mode, "unfused") != 0) {
    fprintf(stderr, "bench_mlp: --mode is fused or unfused, not %s\n", mode);
    return 2;
  }
  kiln_ctx *ctx = kiln_ctx_new(NULL);
  if (!ctx || kiln_ctx_error(ctx)) die(ctx, "no usable GPU");
  kiln_set_fusion(ctx, strcmp(mode, "fused") == 0);
  const int64_t B = 128, D = 784, H = 512, C = 10;
  float *xh = malloc((size_t)(B * D) * sizeof *xh);
  int32_t yh[128];
  uint64_t s = 42;
  for (int64_t i = 0; i < B * D; i++) {
    s = s * 6364136223846793005ULL + 1442695040888963407ULL;
    xh[i] = (float)((s >> 40) / 16777216.0) * 2.f - 1.f;
  }
  for (int64_t i = 0; i < B; i++)
    yh[i] = (int32_t)((i * 7 + 3) % C);
  kiln_tensor *x = kiln_tensor_from_host(ctx, KILN_DTYPE_F32, KILN_SHAPE(B, D), xh);
  kiln_tensor *y = kiln_tensor_from_host(ctx, KILN_DTYPE_I32, KILN_SHAPE(B), yh);
  free(xh);
  kiln_params *p = kiln_params_new(ctx);
  kiln_linear l1, l2, l3;
  kiln_linear_init(&l1, p, "fc1", D, H, 1);
  kiln_linear_init(&l2, p, "fc2", H, H, 1);
  kiln_linear_init(&l3, p, "fc3", H, C, 1);
  kiln_sgd_options so = kiln_sgd_defaults(0.01f);
  so.momentum = 0.9f;
  so.nesterov = 1;
  kiln_optim *opt = kiln_sgd_new(p, &so);
  if (!opt || kiln_ctx_error(ctx)) die(ctx, "setting up");

  cudaStream_t stream = (cudaStream_t)kiln_ctx_stream(ctx);
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  float *ms = malloc((size_t)blocks * sizeof *ms);
  kiln_exec_stats st0, st1;
  int warmup = 50;
  for (int b = -1; b < blocks; b++) {
    int n = b < 0 ? warmup : steps;
    if (b == 0) kiln_stats(ctx, &st0);
    cudaEventRecord(e0, stream);
    for (int i = 0; i < n; i++) {
      kiln_step_begin(ctx);
      kiln_tensor *h = kiln_relu(kiln_linear_forward(&l1, x));
      h = kiln_relu(kiln_linear_forward(&l2, h));
      kiln_tensor *loss =
          kiln_cross_entropy(kiln_linear_forward(&l3, h), y, KILN_REDUCTION_MEAN, 0.f);
      kiln_optim_zero_grad(opt);
      kiln_backward(loss);
      kiln_optim_step(opt);
      if (kiln_step_end(ctx) != KILN_OK) die(ctx, "training step");
    }
    cudaEventRecord(e1, stream);
    cudaEventSynchronize(e1);
    if (b >= 0) {
      cudaEventElapsedTime(&ms[b], e0, e1);
      ms[b] /= (float)n;
    }
  }
  kiln_stats(ctx, &st1);
  kiln_step_begin(ctx);
  qsort(ms, (size_t)blocks, sizeof *ms, cmp);
  kiln_mem_stats mem;
  kiln_memory_stats(ctx, &mem);
  double kps = (double)(st1.kernels_launched - st0.kernels_launched) / ((double)blocks * steps);
  printf(
      "{\"workload\": \"mlp\", \"framework\": \"kiln\", \"mode\": \"%s\", \"ms_per_step\": %.4f, "
      "\"ms_min\": %.4f, \"ms_max\": %.4f, \"kernels_per_step\": %.1f, \"peak_mib\": %.2f, "
      "\"steps\": %d}\n",
      mode, ms[blocks / 2], ms[0], ms[blocks - 1], kps, mem.peak / 1048576.0, blocks * steps);
  free(ms);
  kiln_optim_free(opt);
  kiln_params_free(p);
  kiln_tensor_free(x);
  kiln_tensor_free(y);
  kiln_ctx_free(ctx);
  return 0;
}
