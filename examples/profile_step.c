/*
 * profile_step: one training step of the `mlp` workload (docs/design.md) (784-512-512-10 ReLU MLP,
 * batch 128, fp32, cross-entropy, SGD with Nesterov momentum, random inputs of the real shapes)
 * in kiln's three modes, each in a context of its own:
 *   unfused  every trace node its own kernel (KILN_FUSION=0)
 *   fused    the planner's fused kernels, launched one by one every step (KILN_GRAPH=0)
 *   graph    the fused step captured once into a CUDA graph and replayed
 * For each it prints the median ms per step (CUDA events around blocks of steps, after a
 * warm-up), the kernels launched per step and the peak device memory.
 *
 *   profile_step [--steps N] [--blocks N] [--mode unfused|fused|graph] [--json]
 *
 * --json prints one JSON line per mode (bench/compare.py reads them). To see the steps in Nsight
 * Systems, run it under `nsys profile --trace=cuda,nvtx` with KILN_NVTX=1 (see the README).
 */
#include <cuda_runtime_api.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kiln.h"

static const char *const modes[3] = {"unfused", "fused", "graph"};

typedef struct result {
  float ms_median, ms_min, ms_max;
  double kernels_per_step, peak_mib, arena_mib, intermediates_mib;
  uint64_t captures, replays;
} result;

static void die(kiln_ctx *ctx, const char *what) {
  fprintf(stderr, "profile_step: %s: %s\n", what,
          ctx && kiln_ctx_error(ctx) ? kiln_ctx_error(ctx) : "no context");
  exit(1);
}

static int cmp(const void *a, const void *b) {
  float x = *(const float *)a, y = *(const float *)b;
  return (x > y) - (x < y);
}

static result profile(int mode, int steps, int blocks) {
  kiln_ctx *ctx = kiln_ctx_new(NULL);
  if (!ctx || kiln_ctx_error(ctx)) die(ctx, "no usable GPU");
  kiln_set_fusion(ctx, mode > 0);
  kiln_set_graphs(ctx, mode == 2);
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
  for (int b = -1; b < blocks; b++) {
    int n = b < 0 ? 50 : steps; /* block -1 warms up: compiles, captures */
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
  qsort(ms, (size_t)blocks, sizeof *ms, cmp);
  kiln_mem_stats mem;
  kiln_memory_stats(ctx, &mem);
  result r = {
      .ms_median = ms[blocks / 2],
      .ms_min = ms[0],
      .ms_max = ms[blocks - 1],
      .kernels_per_step =
          (double)(st1.kernels_launched - st0.kernels_launched) / ((double)blocks * steps),
      .peak_mib = mem.peak / 1048576.0,
      .arena_mib = st1.arena_bytes / 1048576.0,
      .intermediates_mib = st1.arena_sum_bytes / 1048576.0,
      .captures = st1.graph_captures,
      .replays = st1.graph_replays,
  };
  free(ms);
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  kiln_optim_free(opt);
  kiln_params_free(p);
  kiln_tensor_free(x);
  kiln_tensor_free(y);
  kiln_ctx_free(ctx);
  return r;
}

int main(int argc, char **argv) {
  int steps = 100, blocks = 21, only = -1, json = 0;
  for (int i = 1; i < argc; i++) {
    if (strcmp(argv[i], "--steps") == 0 && i + 1 < argc) {
      steps = atoi(argv[++i]);
    } else if (strcmp(argv[i], "--blocks") == 0 && i + 1 < argc) {
      blocks = atoi(argv[++i]);
    } else if (strcmp(argv[i], "--json") == 0) {
      json = 1;
    } else if (strcmp(argv[i], "--mode") == 0 && i + 1 < argc) {
      const char *m = argv[++i];
      for (int k = 0; k < 3; k++)
        if (strcmp(m, modes[k]) == 0) only = k;
      if (only < 0) {
        fprintf(stderr, "profile_step: --mode is unfused, fused or graph, not %s\n", m);
        return 2;
      }
    } else {
      fprintf(stderr, "usage: %s [--steps N] [--blocks N] [--mode unfused|fused|graph] [--json]\n",
              argv[0]);
      return 2;
    }
  }
  if (steps < 1 || blocks < 1 || blocks > 1000) {
    fprintf(stderr, "profile_step: --steps and --blocks must be positive (blocks <= 1000)\n");
    return 2;
  }
  if (!json)
    printf("mlp step (784-512-512-10, batch 128, SGD Nesterov), median of %d blocks of %d "
           "steps\n\n| mode | ms/step | kernels/step | peak MiB | graph captures / replays |\n"
           "| --- | --- | --- | --- | --- |\n",
           blocks, steps);
  for (int k = 0; k < 3; k++) {
    if (only >= 0 && k != only) continue;
    result r = profile(k, steps, blocks);
    if (json) {
      printf("{\"workload\": \"mlp\", \"framework\": \"kiln\", \"mode\": \"%s\", "
             "\"ms_per_step\": %.4f, \"ms_min\": %.4f, \"ms_max\": %.4f, "
             "\"kernels_per_step\": %.1f, \"peak_mib\": %.2f, \"arena_mib\": %.2f, "
             "\"intermediates_mib\": %.2f, \"steps\": %d}\n",
             modes[k], r.ms_median, r.ms_min, r.ms_max, r.kernels_per_step, r.peak_mib, r.arena_mib,
             r.intermediates_mib, blocks * steps);
    } else {
      printf("| %s | %.3f | %.1f | %.1f | %llu / %llu |\n", modes[k], r.ms_median,
             r.kernels_per_step, r.peak_mib, (unsigned long long)r.captures,
             (unsigned long long)r.replays);
    }
    fflush(stdout);
  }
  return 0;
}
