/*
 * profile_step: one training step of a workload of docs/design.md ("Workloads"), random inputs of
 * the real shapes, in kiln's three modes, each in a context of its own:
 *   mlp  784-512-512-10 ReLU MLP, batch 128, fp32, cross-entropy, SGD with Nesterov momentum
 *   cnn  pytorch/examples' MNIST net (conv 1->32 3x3, ReLU, conv 32->64 3x3, ReLU, max pool 2,
 *        dropout 0.25, flatten, fc 9216->128, ReLU, dropout 0.5, fc 128->10), images (128, 28,
 *        28, 1) channels last, fp32, cross-entropy, Adam lr 1e-3 (examples/mnist_cnn's default)
 * The modes:
 *   unfused  every trace node its own kernel (KILN_FUSION=0)
 *   fused    the planner's fused kernels, launched one by one every step (KILN_GRAPH=0)
 *   graph    the fused step captured once into a CUDA graph and replayed
 * For each it prints the median ms per step (CUDA events around blocks of steps, after a
 * warm-up), the kernels launched per step and the peak device memory.
 *
 *   profile_step [--workload mlp|cnn|all] [--steps N] [--blocks N] [--mode unfused|fused|graph]
 *                [--json]
 *
 * --workload defaults to all (mlp, then cnn). --json prints one JSON line per workload and mode
 * (bench/compare.py reads them). To see the steps in Nsight Systems, run it under
 * `nsys profile --trace=cuda,nvtx` with KILN_NVTX=1 (see the README).
 */
#include <cuda_runtime_api.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kiln.h"

static const char *const modes[3] = {"unfused", "fused", "graph"};
static const char *const workloads[2] = {"mlp", "cnn"};
enum { WORKLOAD_MLP, WORKLOAD_CNN };

/* A workload's model, optimizer and batch (persistent, made once per context). */
typedef struct model {
  int workload;
  kiln_params *p;
  kiln_linear l1, l2, l3;   /* mlp: fc1, fc2, fc3; cnn: fc1, fc2 */
  kiln_conv2d_layer c1, c2; /* cnn: conv1, conv2 */
  kiln_optim *opt;
  kiln_tensor *x, *y; /* mlp: x (B, 784); cnn: x (B, 28, 28, 1); y (B) i32 */
} model;

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

/* Uniform values in [-1, 1) from a fixed LCG: random inputs of the real shapes, never zeros. */
static float *random_inputs(int64_t n) {
  float *h = malloc((size_t)n * sizeof *h);
  if (!h) return NULL;
  uint64_t s = 42;
  for (int64_t i = 0; i < n; i++) {
    s = s * 6364136223846793005ULL + 1442695040888963407ULL;
    h[i] = (float)((s >> 40) / 16777216.0) * 2.f - 1.f;
  }
  return h;
}

static void model_init(model *m, kiln_ctx *ctx, int workload) {
  memset(m, 0, sizeof *m);
  m->workload = workload;
  const int64_t B = 128, C = 10;
  int32_t yh[128];
  for (int64_t i = 0; i < B; i++)
    yh[i] = (int32_t)((i * 7 + 3) % C);
  /* the same B * 784 values for both: (B, 784) rows or (B, 28, 28, 1) images */
  float *xh = random_inputs(B * 784);
  if (!xh) die(ctx, "out of host memory");
  kiln_shape xs = workload == WORKLOAD_MLP ? KILN_SHAPE(B, 784) : KILN_SHAPE(B, 28, 28, 1);
  m->x = kiln_tensor_from_host(ctx, KILN_DTYPE_F32, xs, xh);
  free(xh);
  m->y = kiln_tensor_from_host(ctx, KILN_DTYPE_I32, KILN_SHAPE(B), yh);
  m->p = kiln_params_new(ctx);
  if (workload == WORKLOAD_MLP) {
    kiln_linear_init(&m->l1, m->p, "fc1", 784, 512, 1);
    kiln_linear_init(&m->l2, m->p, "fc2", 512, 512, 1);
    kiln_linear_init(&m->l3, m->p, "fc3", 512, C, 1);
    kiln_sgd_options so = kiln_sgd_defaults(0.01f);
    so.momentum = 0.9f;
    so.nesterov = 1;
    m->opt = kiln_sgd_new(m->p, &so);
  } else {
    kiln_conv2d_layer_init(&m->c1, m->p, "conv1", 1, 32, 3, 3, NULL, 1);
    kiln_conv2d_layer_init(&m->c2, m->p, "conv2", 32, 64, 3, 3, NULL, 1);
    kiln_linear_init(&m->l1, m->p, "fc1", 9216, 128, 1);
    kiln_linear_init(&m->l2, m->p, "fc2", 128, C, 1);
    kiln_adam_options ao = kiln_adam_defaults(); /* lr 1e-3 */
    m->opt = kiln_adam_new(m->p, &ao);
  }
}

/* Records one training step: forward, loss, backward, update. */
static void model_step(model *m) {
  kiln_tensor *logits;
  if (m->workload == WORKLOAD_MLP) {
    kiln_tensor *h = kiln_relu(kiln_linear_forward(&m->l1, m->x));
    h = kiln_relu(kiln_linear_forward(&m->l2, h));
    logits = kiln_linear_forward(&m->l3, h);
  } else {
    const kiln_pool2d_options pool2 = {.kernel_h = 2, .kernel_w = 2};
    int training = kiln_training(kiln_tensor_ctx(m->x));
    kiln_tensor *h = kiln_relu(kiln_conv2d_layer_forward(&m->c1, m->x));   /* (B, 26, 26, 32) */
    h = kiln_relu(kiln_conv2d_layer_forward(&m->c2, h));                   /* (B, 24, 24, 64) */
    h = kiln_dropout(kiln_max_pool2d(h, &pool2), 0.25f, training);         /* (B, 12, 12, 64) */
    h = kiln_relu(kiln_linear_forward(&m->l1, kiln_flatten(h)));           /* (B, 128) */
    logits = kiln_linear_forward(&m->l2, kiln_dropout(h, 0.5f, training)); /* (B, 10) */
  }
  kiln_tensor *loss = kiln_cross_entropy(logits, m->y, KILN_REDUCTION_MEAN, 0.f);
  kiln_optim_zero_grad(m->opt);
  kiln_backward(loss);
  kiln_optim_step(m->opt);
}

static result profile(int workload, int mode, int steps, int blocks) {
  kiln_ctx *ctx = kiln_ctx_new(NULL);
  if (!ctx || kiln_ctx_error(ctx)) die(ctx, "no usable GPU");
  kiln_set_fusion(ctx, mode > 0);
  kiln_set_graphs(ctx, mode == 2);
  model m;
  model_init(&m, ctx, workload);
  if (!m.opt || kiln_ctx_error(ctx)) die(ctx, "setting up");

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
      model_step(&m);
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
  kiln_optim_free(m.opt);
  kiln_params_free(m.p);
  kiln_tensor_free(m.x);
  kiln_tensor_free(m.y);
  kiln_ctx_free(ctx);
  return r;
}

int main(int argc, char **argv) {
  int steps = 100, blocks = 21, only = -1, json = 0, workload = -1; /* -1: all */
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
    } else if (strcmp(argv[i], "--workload") == 0 && i + 1 < argc) {
      const char *w = argv[++i];
      workload = -2;
      for (int k = 0; k < 2; k++)
        if (strcmp(w, workloads[k]) == 0) workload = k;
      if (strcmp(w, "all") == 0) workload = -1;
      if (workload == -2) {
        fprintf(stderr, "profile_step: --workload is mlp, cnn or all, not %s\n", w);
        return 2;
      }
    } else {
      fprintf(stderr,
              "usage: %s [--workload mlp|cnn|all] [--steps N] [--blocks N] "
              "[--mode unfused|fused|graph] [--json]\n",
              argv[0]);
      return 2;
    }
  }
  if (steps < 1 || blocks < 1 || blocks > 1000) {
    fprintf(stderr, "profile_step: --steps and --blocks must be positive (blocks <= 1000)\n");
    return 2;
  }
  static const char *const titles[2] = {
      "mlp step (784-512-512-10, batch 128, SGD Nesterov)",
      "cnn step (pytorch/examples MNIST net, batch 128, NHWC, Adam)",
  };
  for (int w = 0; w < 2; w++) {
    if (workload >= 0 && w != workload) continue;
    if (!json)
      printf("%s%s, median of %d blocks of %d steps\n\n| mode | ms/step | kernels/step | peak MiB "
             "| graph captures / replays |\n| --- | --- | --- | --- | --- |\n",
             w > 0 && workload < 0 ? "\n" : "", titles[w], blocks, steps);
    for (int k = 0; k < 3; k++) {
      if (only >= 0 && k != only) continue;
      result r = profile(w, k, steps, blocks);
      if (json) {
        printf("{\"workload\": \"%s\", \"framework\": \"kiln\", \"mode\": \"%s\", "
               "\"ms_per_step\": %.4f, \"ms_min\": %.4f, \"ms_max\": %.4f, "
               "\"kernels_per_step\": %.1f, \"peak_mib\": %.2f, \"arena_mib\": %.2f, "
               "\"intermediates_mib\": %.2f, \"steps\": %d}\n",
               workloads[w], modes[k], r.ms_median, r.ms_min, r.ms_max, r.kernels_per_step,
               r.peak_mib, r.arena_mib, r.intermediates_mib, blocks * steps);
      } else {
        printf("| %s | %.3f | %.1f | %.1f | %llu / %llu |\n", modes[k], r.ms_median,
               r.kernels_per_step, r.peak_mib, (unsigned long long)r.captures,
               (unsigned long long)r.replays);
      }
      fflush(stdout);
    }
  }
  return 0;
}
