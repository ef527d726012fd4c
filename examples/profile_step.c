/*
 * profile_step: one training step of a workload of docs/design.md ("Workloads"), random inputs of
 * the real shapes, in kiln's three modes, each in a context of its own:
 *   mlp  784-512-512-10 ReLU MLP, batch 128, fp32, cross-entropy, SGD with Nesterov momentum
 *   cnn  pytorch/examples' MNIST net (conv 1->32 3x3, ReLU, conv 32->64 3x3, ReLU, max pool 2,
 *        dropout 0.25, flatten, fc 9216->128, ReLU, dropout 0.5, fc 128->10), images (128, 28,
 *        28, 1) channels last, fp32, cross-entropy, Adam lr 1e-3 (examples/mnist_cnn's default)
 *   air  airbench94's net as examples/cifar10 trains it (whitening conv 2x2 3->24, random and
 *        frozen here, GELU; three groups of widths 64/256/256, each conv 3x3 -> max pool 2 ->
 *        batch norm -> GELU -> conv 3x3 -> batch norm -> GELU; global max pool, linear 256->10
 *        without bias, x 1/9), images (1024, 32, 32, 3), the forward in a bf16 autocast region,
 *        cross-entropy (label smoothing 0.2) summed, SGD with Nesterov momentum at airbench94's
 *        rates for batch 1024 (batch norm's biases x64), the frozen parameters left out
 *   air_muon  the same net as examples/cifar10's default recipe (airbench94_muon's) trains it
 *        after its first three epochs: images (2000, 32, 32, 3), the logits x 1/256, Muon
 *        (Newton-Schulz in bf16, three steps, weights normalised) for the six 3x3 filters, SGD
 *        with Nesterov momentum for batch norm's biases and the head, the whitening frozen
 *   resnet18  torchvision's ResNet-18 (conv 7x7/2 3->64 without bias, batch norm, ReLU, max pool
 *        3x3/2 pad 1; four stages of two BasicBlocks of widths 64/128/256/512, each conv 3x3 ->
 *        batch norm -> ReLU -> conv 3x3 -> batch norm, plus the input (through conv 1x1/2 and
 *        batch norm in the first block of stages 2-4, whose first conv has stride 2), ReLU;
 *        global average pool, linear 512->1000; 11,689,512 parameters, checked), images (128,
 *        224, 224, 3), the forward in a bf16 autocast region, cross-entropy (mean), SGD with
 *        momentum 0.9 (not Nesterov), lr 0.05 (torchvision's 0.1 per 256 images), weight decay
 *        5e-5 on every parameter, random labels in [0, 1000)
 * The modes:
 *   unfused  every trace node its own kernel (KILN_FUSION=0)
 *   fused    the planner's fused kernels, launched one by one every step (KILN_GRAPH=0)
 *   graph    the fused step captured once into a CUDA graph and replayed
 * For each it prints the median ms per step (CUDA events around blocks of steps, after a
 * warm-up), the kernels launched per step, the peak device memory and the wall time of the first
 * step (host clock, from a synchronised device to kiln_sync after the step: recording, planning,
 * NVRTC compiles or cache loads, the run and, in graph mode, the capture).
 *
 *   profile_step [--workload mlp|cnn|air|resnet18|all] [--steps N] [--blocks N] [--batch N]
 *                [--mode unfused|fused|graph] [--json] [--compile-only] [--trace DIR]
 *   profile_step --report OUT.html TRACE.json...
 *
 * --workload defaults to all, which is mlp, cnn, then air: resnet18 runs only when named (its
 * three modes take tens of seconds more, a cold kernel cache longer, and some 5 GiB of device
 * memory), and so does air_muon (no PyTorch side in bench/compare.py). --steps is the steps per
 * block, 100 by default (20 for air and air_muon and 10 for resnet18, whose steps take
 * milliseconds), --blocks the blocks, 21 by default. --batch replaces every workload's batch (128
 * for mlp, cnn and resnet18, 1024 for air, 2000 for air_muon), for runs under compute-sanitizer,
 * whose tools take minutes a step at full size. --json prints one JSON line per workload and mode
 * (bench/compare.py reads them). To see the steps in Nsight Systems, run it under `nsys profile
 * --trace=cuda,nvtx` with KILN_NVTX=1 (see the README).
 * --compile-only needs no GPU: it records one step per mode in a context without one, which
 * plans and compiles it (nothing runs), and prints the groups and kernels, and for the graph mode
 * the step's memory plan: its arena, the sum of the values in it, and the most of them live at
 * one launch (KILN_DEBUG=memory lists those values); with KILN_DUMP_KERNELS=dir the kernels'
 * sources are written there.
 * --trace DIR records, for each workload and mode, a timeline trace (kiln_trace_begin) of
 * --steps steps (10 by default) after the first step and 20 more to warm up and as many timed
 * untraced: DIR/<workload>_<mode>.json (DIR is made if missing), for ui.perfetto.dev, with the
 * ms/step of the traced and the untraced steps by CUDA events; then DIR/<workload>.html, the report
 * that puts the modes' steps one above the other with their kernels by time (kiln_trace_report).
 * --report writes that report from traces given on the command line (no GPU needed).
 */
#include <cuda_runtime_api.h>
#include <errno.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#include "airbench_muon.h"
#include "kiln.h"
#include "resnet.h"

static const char *const modes[3] = {"unfused", "fused", "graph"};
#define NWORKLOADS 5
static const char *const workloads[NWORKLOADS] = {"mlp", "cnn", "air", "resnet18", "air_muon"};
enum { WORKLOAD_MLP, WORKLOAD_CNN, WORKLOAD_AIR, WORKLOAD_RESNET18, WORKLOAD_AIR_MUON };
#define NDEFAULT 3 /* --workload all: mlp, cnn, air (resnet18 and air_muon only by name) */

/* air: airbench94's recipe as examples/cifar10.c has it */
#define AIR_BATCH 1024
#define AIR_LR 11.5              /* per 1024 examples: see air_sgd_rates */
#define AIR_MOMENTUM 0.85f       /* Nesterov */
#define AIR_WEIGHT_DECAY 0.0153  /* per 1024 examples */
#define AIR_BIAS_SCALER 64.f     /* batch norm's biases: rate x64, weight decay / 64 */
#define AIR_LABEL_SMOOTHING 0.2f /* cross-entropy, summed over the batch */
#define AIR_BN_MOMENTUM 0.4f     /* torch's sense */
#define AIR_BN_EPS 1e-12f        /* airbench's */
#define AIR_OUTPUT_SCALE (1.f / 9)
#define AIR_WHITEN_WIDTH 24
static const int64_t air_widths[3] = {64, 256, 256};
/* air_muon: airbench94_muon's recipe as examples/cifar10.c has it: examples/airbench_muon.h */

/* resnet18: torchvision's ResNet-18 on ImageNet-sized random images */
#define RN_BATCH 128
#define RN_IMAGE 224
#define RN_CLASSES 1000
#define RN_LR 0.05f /* torchvision's reference recipe: 0.1 per 256 images */
#define RN_MOMENTUM 0.9f
#define RN_WEIGHT_DECAY 5e-5f
#define RN_PARAMS 11689512 /* sum(p.numel() for p in resnet18().parameters()), no running stats */
#define RN_WIDTH 64        /* the first stage's width; the others 128, 256, 512 */

/* A workload's model, optimizer and batch (persistent, made once per context). */
typedef struct model {
  int workload;
  kiln_params *p;
  kiln_linear l1, l2, l3;   /* mlp: fc1, fc2, fc3; cnn: fc1, fc2 */
  kiln_conv2d_layer c1, c2; /* cnn: conv1, conv2 */
  /* air: the whitening conv, each group's two convolutions and two batch norms, the head */
  kiln_conv2d_layer whiten, gconv[3][2];
  kiln_batch_norm_layer gnorm[3][2];
  kiln_linear head; /* air: head */
  resnet rn;        /* resnet18 (examples/resnet.h) */
  kiln_optim *opt;
  kiln_optim *muon; /* air_muon: Muon for the filters (opt: SGD for the rest); else NULL */
  /* mlp: x (B, 784); cnn: x (B, 28, 28, 1); air: x (B, 32, 32, 3); resnet18: x (B, 224, 224,
   * 3); y (B) i32 */
  kiln_tensor *x, *y;
  int64_t batch, params; /* B; parameters as torch counts them (buffers left out) */
} model;

typedef struct result {
  float ms_median, ms_min, ms_max;
  double kernels_per_step, peak_mib, arena_mib, intermediates_mib;
  double first_ms;         /* the first step's wall time, kiln_sync included */
  uint64_t first_compiled; /* NVRTC compilations in it (the others were cache hits) */
  uint64_t captures, replays;
  int64_t batch, params;
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

/* The parameters of a list as torch counts them (model.parameters()): buffers left out. */
static int64_t count_params(const kiln_params *p) {
  int64_t n = 0;
  for (int i = 0; i < kiln_params_count(p); i++)
    if (!kiln_params_is_buffer(p, i)) n += kiln_tensor_numel(kiln_params_get(p, i));
  return n;
}

/* air: SGD's rate and weight decay as examples/cifar10.c's sgd_rates turns airbench94's "per
 * 1024 examples" values into torch's: kilostep = 1024 (1 + 1 / (1 - momentum)), lr = LR /
 * kilostep, L2 weight decay = (WEIGHT_DECAY batch / kilostep) / lr. */
static void air_sgd_rates(int64_t batch, float *lr, float *wd) {
  double kilostep = 1024.0 * (1.0 + 1.0 / (1.0 - (double)AIR_MOMENTUM));
  *lr = (float)(AIR_LR / kilostep);
  *wd = (float)(AIR_WEIGHT_DECAY * (double)batch / kilostep / (AIR_LR / kilostep));
}

/* --batch: every workload's batch (0: each one's own). */
static int64_t batch_flag;

/* air_muon: SGD for the norms' biases and the head, Muon for the filters (m->opt, m->muon). */
static void air_muon_optimizers(model *m, kiln_ctx *ctx, int64_t B) {
  kiln_sgd_options so = airbench_muon_sgd(B);
  kiln_muon_options mo = airbench_muon_muon();
  kiln_param_group exclude = {.exclude = 1}, head = airbench_muon_head(B);
  m->opt = kiln_sgd_new(m->p, &so);
  m->muon = kiln_muon_new(m->p, &mo);
  if (!m->opt || !m->muon) die(ctx, "making the optimizers");
  int nh = kiln_optim_add_group(m->opt, kiln_select_prefix, "head.weight", &head);
  int nf = kiln_optim_add_group(m->opt, airbench_select_frozen, NULL, &exclude);
  int nc = kiln_optim_add_group(m->opt, airbench_select_filter, NULL, &exclude);
  int nm = kiln_optim_add_group(m->muon, airbench_select_not_filter, NULL, &exclude);
  int others = -6; /* the parameters but the six filters, the norms' running statistics aside */
  for (int i = 0; i < kiln_params_count(m->p); i++)
    others += !kiln_params_is_buffer(m->p, i);
  if (nh != 1 || nf != 7 || nc != 6 || nm != others) {
    fprintf(stderr,
            "profile_step: air_muon's groups hold %d head, %d frozen, %d filters and %d "
            "parameters but the filters: not 1, 7, 6 and %d (%s)\n",
            nh, nf, nc, nm, others, kiln_ctx_error(ctx) ? kiln_ctx_error(ctx) : "no error");
    exit(1);
  }
}

/* air (and air_muon): the model (random filters, the whitening's too, frozen), the batch and the
 * optimizers. */
static void air_init(model *m, kiln_ctx *ctx, bool muon) {
  const int64_t B = batch_flag ? batch_flag : muon ? MUON_BATCH : AIR_BATCH, C = 10;
  int32_t *yh = malloc((size_t)B * sizeof *yh);
  float *xh = random_inputs(B * 32 * 32 * 3);
  if (!yh || !xh) die(ctx, "out of host memory");
  for (int64_t i = 0; i < B; i++)
    yh[i] = (int32_t)((i * 7 + 3) % C);
  m->x = kiln_tensor_from_host(ctx, KILN_DTYPE_F32, KILN_SHAPE(B, 32, 32, 3), xh);
  m->y = kiln_tensor_from_host(ctx, KILN_DTYPE_I32, KILN_SHAPE(B), yh);
  free(xh);
  free(yh);
  m->p = kiln_params_new(ctx);
  if (!m->p) die(ctx, "setting up");
  kiln_status st = kiln_conv2d_layer_init(
      &m->whiten, m->p,
      &(kiln_conv2d_layer_options){
          .name = "whiten", .in = 3, .out = AIR_WHITEN_WIDTH, .kernel = 2, .no_bias = 1});
  if (st == KILN_OK) kiln_tensor_set_requires_grad(m->whiten.weight, 0);
  int64_t cin = AIR_WHITEN_WIDTH;
  for (int k = 0; k < 3 && st == KILN_OK; k++) {
    int64_t w = air_widths[k];
    for (int j = 0; j < 2 && st == KILN_OK; j++) {
      char name[32];
      snprintf(name, sizeof name, "block%d.conv%d", k + 1, j + 1);
      st = kiln_conv2d_layer_init(
          &m->gconv[k][j], m->p,
          &(kiln_conv2d_layer_options){
              .name = name, .in = j ? w : cin, .out = w, .kernel = 3, .padding = 1, .no_bias = 1});
      snprintf(name, sizeof name, "block%d.norm%d", k + 1, j + 1);
      if (st == KILN_OK)
        st = kiln_batch_norm_layer_init(
            &m->gnorm[k][j], m->p,
            &(kiln_batch_norm_layer_options){
                .name = name, .features = w, .momentum = AIR_BN_MOMENTUM, .eps = AIR_BN_EPS});
      if (st == KILN_OK) kiln_tensor_set_requires_grad(m->gnorm[k][j].weight, 0);
    }
    cin = w;
  }
  if (st == KILN_OK)
    st = kiln_linear_init(
        &m->head, m->p,
        &(kiln_linear_options){.name = "head", .in = air_widths[2], .out = C, .no_bias = 1});
  if (st != KILN_OK) die(ctx, "making the air model");
  m->batch = B;
  m->params = count_params(m->p);
  if (muon) {
    air_muon_optimizers(m, ctx, B);
    return;
  }
  float lr, wd;
  air_sgd_rates(B, &lr, &wd);
  kiln_sgd_options so = {.lr = lr, .momentum = AIR_MOMENTUM, .weight_decay = wd, .nesterov = 1};
  m->opt = kiln_sgd_new(m->p, &so);
  if (!m->opt) die(ctx, "making the optimizer");
  kiln_param_group biases = {.lr_scale = AIR_BIAS_SCALER, .weight_decay = wd / AIR_BIAS_SCALER};
  int nb = kiln_optim_add_group(m->opt, airbench_select_norm_bias, NULL, &biases);
  int nf =
      kiln_optim_add_group(m->opt, airbench_select_frozen, NULL, &(kiln_param_group){.exclude = 1});
  if (nb < 0 || nf < 0) die(ctx, "making the optimizer's groups");
  if (nb != 6 || nf != 7) { /* the six norms' biases; the whitening and the norms' weights */
    fprintf(stderr,
            "profile_step: the groups hold %d norm biases and %d frozen parameters, not 6 "
            "and 7\n",
            nb, nf);
    exit(1);
  }
}

/* air: x (B, 32, 32, 3) to (B, 10) logits, in a bf16 autocast region. */
static kiln_tensor *air_forward(const model *m) {
  const kiln_pool2d_options pool2 = {.kernel_h = 2, .kernel_w = 2};
  kiln_ctx *ctx = kiln_tensor_ctx(m->x);
  kiln_autocast_begin(ctx, KILN_DTYPE_BF16);
  kiln_tensor *h = kiln_gelu(kiln_conv2d_layer_forward(&m->whiten, m->x), KILN_GELU_ERF);
  for (int k = 0; k < 3; k++) { /* (B, 15, 15, 64), (B, 7, 7, 256), (B, 3, 3, 256) */
    h = kiln_max_pool2d(kiln_conv2d_layer_forward(&m->gconv[k][0], h), &pool2);
    h = kiln_gelu(kiln_batch_norm_layer_forward(&m->gnorm[k][0], h), KILN_GELU_ERF);
    h = kiln_conv2d_layer_forward(&m->gconv[k][1], h);
    h = kiln_gelu(kiln_batch_norm_layer_forward(&m->gnorm[k][1], h), KILN_GELU_ERF);
  }
  h = kiln_global_max_pool2d(h); /* (B, 256) */
  kiln_tensor *logits = kiln_mul_scalar(kiln_linear_forward(&m->head, h),
                                        m->muon ? MUON_OUTPUT_SCALE : AIR_OUTPUT_SCALE);
  kiln_autocast_end(ctx);
  return logits;
}

/* resnet18: the model, random images and labels, and the optimizer. */
static void rn_init(model *m, kiln_ctx *ctx) {
  const int64_t B = batch_flag ? batch_flag : RN_BATCH, S = RN_IMAGE;
  int32_t *yh = malloc((size_t)B * sizeof *yh);
  float *xh = random_inputs(B * S * S * 3);
  if (!yh || !xh) die(ctx, "out of host memory");
  uint64_t r = 7; /* labels from an LCG of their own, uniform enough in [0, 1000) */
  for (int64_t i = 0; i < B; i++) {
    r = r * 6364136223846793005ULL + 1442695040888963407ULL;
    yh[i] = (int32_t)((r >> 33) % RN_CLASSES);
  }
  m->x = kiln_tensor_from_host(ctx, KILN_DTYPE_F32, KILN_SHAPE(B, S, S, 3), xh);
  m->y = kiln_tensor_from_host(ctx, KILN_DTYPE_I32, KILN_SHAPE(B), yh);
  free(xh);
  free(yh);
  m->p = kiln_params_new(ctx);
  if (!m->p) die(ctx, "setting up");
  kiln_status st = resnet_init(&m->rn, m->p, RN_WIDTH, RN_CLASSES, 0);
  if (st != KILN_OK) die(ctx, "making the resnet18 model");
  m->batch = B;
  m->params = count_params(m->p);
  if (m->params != RN_PARAMS) {
    fprintf(stderr, "profile_step: resnet18 has %lld parameters, not torchvision's %d\n",
            (long long)m->params, RN_PARAMS);
    exit(1);
  }
  kiln_sgd_options so = {.lr = RN_LR, .momentum = RN_MOMENTUM, .weight_decay = RN_WEIGHT_DECAY};
  m->opt = kiln_sgd_new(m->p, &so);
  if (!m->opt) die(ctx, "making the optimizer");
}

/* resnet18: x (B, 224, 224, 3) to (B, 1000) logits, in a bf16 autocast region. */
static kiln_tensor *rn_forward(const model *m) {
  kiln_ctx *ctx = kiln_tensor_ctx(m->x);
  kiln_autocast_begin(ctx, KILN_DTYPE_BF16);
  kiln_tensor *logits = resnet_forward(&m->rn, m->x);
  kiln_autocast_end(ctx);
  return logits;
}

static void model_init(model *m, kiln_ctx *ctx, int workload) {
  memset(m, 0, sizeof *m);
  m->workload = workload;
  if (workload == WORKLOAD_AIR || workload == WORKLOAD_AIR_MUON) {
    air_init(m, ctx, workload == WORKLOAD_AIR_MUON);
    return;
  }
  if (workload == WORKLOAD_RESNET18) {
    rn_init(m, ctx);
    return;
  }
  const int64_t B = batch_flag ? batch_flag : 128, C = 10;
  int32_t *yh = malloc((size_t)B * sizeof *yh);
  /* the same B * 784 values for both: (B, 784) rows or (B, 28, 28, 1) images */
  float *xh = random_inputs(B * 784);
  if (!yh || !xh) die(ctx, "out of host memory");
  for (int64_t i = 0; i < B; i++)
    yh[i] = (int32_t)((i * 7 + 3) % C);
  kiln_shape xs = workload == WORKLOAD_MLP ? KILN_SHAPE(B, 784) : KILN_SHAPE(B, 28, 28, 1);
  m->x = kiln_tensor_from_host(ctx, KILN_DTYPE_F32, xs, xh);
  free(xh);
  m->y = kiln_tensor_from_host(ctx, KILN_DTYPE_I32, KILN_SHAPE(B), yh);
  free(yh);
  m->p = kiln_params_new(ctx);
  if (workload == WORKLOAD_MLP) {
    kiln_linear_init(&m->l1, m->p, &(kiln_linear_options){.name = "fc1", .in = 784, .out = 512});
    kiln_linear_init(&m->l2, m->p, &(kiln_linear_options){.name = "fc2", .in = 512, .out = 512});
    kiln_linear_init(&m->l3, m->p, &(kiln_linear_options){.name = "fc3", .in = 512, .out = C});
    kiln_sgd_options so = kiln_sgd_defaults(0.01f);
    so.momentum = 0.9f;
    so.nesterov = 1;
    m->opt = kiln_sgd_new(m->p, &so);
  } else {
    kiln_conv2d_layer_init(
        &m->c1, m->p,
        &(kiln_conv2d_layer_options){.name = "conv1", .in = 1, .out = 32, .kernel = 3});
    kiln_conv2d_layer_init(
        &m->c2, m->p,
        &(kiln_conv2d_layer_options){.name = "conv2", .in = 32, .out = 64, .kernel = 3});
    kiln_linear_init(&m->l1, m->p, &(kiln_linear_options){.name = "fc1", .in = 9216, .out = 128});
    kiln_linear_init(&m->l2, m->p, &(kiln_linear_options){.name = "fc2", .in = 128, .out = C});
    kiln_adam_options ao = kiln_adam_defaults(); /* lr 1e-3 */
    m->opt = kiln_adam_new(m->p, &ao);
  }
  m->batch = B;
  m->params = count_params(m->p);
}

/* Records one training step: forward, loss, backward, update. */
static void model_step(model *m) {
  kiln_tensor *logits;
  if (m->workload == WORKLOAD_MLP) {
    kiln_tensor *h = kiln_relu(kiln_linear_forward(&m->l1, m->x));
    h = kiln_relu(kiln_linear_forward(&m->l2, h));
    logits = kiln_linear_forward(&m->l3, h);
  } else if (m->workload == WORKLOAD_AIR || m->workload == WORKLOAD_AIR_MUON) {
    logits = air_forward(m);
  } else if (m->workload == WORKLOAD_RESNET18) {
    logits = rn_forward(m);
  } else {
    const kiln_pool2d_options pool2 = {.kernel_h = 2, .kernel_w = 2};
    int training = kiln_training(kiln_tensor_ctx(m->x));
    kiln_tensor *h = kiln_relu(kiln_conv2d_layer_forward(&m->c1, m->x));   /* (B, 26, 26, 32) */
    h = kiln_relu(kiln_conv2d_layer_forward(&m->c2, h));                   /* (B, 24, 24, 64) */
    h = kiln_dropout(kiln_max_pool2d(h, &pool2), 0.25f, training);         /* (B, 12, 12, 64) */
    h = kiln_relu(kiln_linear_forward(&m->l1, kiln_flatten(h)));           /* (B, 128) */
    logits = kiln_linear_forward(&m->l2, kiln_dropout(h, 0.5f, training)); /* (B, 10) */
  }
  kiln_tensor *loss =
      m->workload == WORKLOAD_AIR || m->workload == WORKLOAD_AIR_MUON
          ? kiln_cross_entropy(logits, m->y, KILN_REDUCTION_SUM, AIR_LABEL_SMOOTHING)
          : kiln_cross_entropy(logits, m->y, KILN_REDUCTION_MEAN, 0.f);
  kiln_optim_zero_grad(m->opt);
  if (m->muon) kiln_optim_zero_grad(m->muon);
  kiln_backward(loss);
  kiln_optim_step(m->opt);
  if (m->muon) kiln_optim_step(m->muon);
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
  kiln_exec_stats st0, st1, sf;
  /* the first step on its own clock, from a device done with the model's uploads */
  if (kiln_sync(ctx) != KILN_OK) die(ctx, "uploading the model");
  kiln_stats(ctx, &sf);
  uint64_t compiled0 = sf.kernels_compiled;
  struct timespec t0, t1;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  kiln_step_begin(ctx);
  model_step(&m);
  if (kiln_step_end(ctx) != KILN_OK || kiln_sync(ctx) != KILN_OK) die(ctx, "first training step");
  clock_gettime(CLOCK_MONOTONIC, &t1);
  kiln_stats(ctx, &sf);
  for (int b = -1; b < blocks; b++) {
    int n = b < 0 ? 50 : steps; /* block -1 warms up (the first step did the compiles) */
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
      .first_ms = (t1.tv_sec - t0.tv_sec) * 1e3 + (t1.tv_nsec - t0.tv_nsec) / 1e6,
      .first_compiled = sf.kernels_compiled - compiled0,
      .captures = st1.graph_captures,
      .replays = st1.graph_replays,
      .batch = m.batch,
      .params = m.params,
  };
  free(ms);
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  kiln_optim_free(m.opt);
  kiln_optim_free(m.muon);
  kiln_params_free(m.p);
  kiln_tensor_free(m.x);
  kiln_tensor_free(m.y);
  kiln_ctx_free(ctx);
  return r;
}

/* One step of the workload planned and compiled in a context without a GPU (nothing runs). */
static void compile_only(int workload, int mode) {
  kiln_ctx_options o = {.no_gpu = 1};
  kiln_ctx *ctx = kiln_ctx_new(&o);
  if (!ctx) die(ctx, "out of host memory");
  kiln_set_fusion(ctx, mode > 0);
  kiln_set_graphs(ctx, mode == 2);
  model m;
  model_init(&m, ctx, workload);
  if (!m.opt || kiln_ctx_error(ctx)) die(ctx, "setting up");
  kiln_exec_stats s0, s1;
  kiln_stats(ctx, &s0);
  kiln_step_begin(ctx);
  model_step(&m);
  if (kiln_step_end(ctx) != KILN_OK) die(ctx, "planning and compiling the step");
  kiln_stats(ctx, &s1);
  {
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (int it = 0; it < 200; it++) {
      kiln_step_begin(ctx);
      model_step(&m);
      kiln_step_end(ctx);
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    fprintf(stderr, "HOST %s %s: %.3f ms/step\n", workloads[workload], modes[mode],
            ((t1.tv_sec - t0.tv_sec) * 1e3 + (t1.tv_nsec - t0.tv_nsec) / 1e6) / 200);
  }
  printf("| %s | %llu | %llu | %llu | %.0f |", modes[mode],
         (unsigned long long)(s1.nodes_recorded - s0.nodes_recorded),
         (unsigned long long)(s1.groups - s0.groups),
         (unsigned long long)(s1.kernels_compiled - s0.kernels_compiled + s1.cache_hits -
                              s0.cache_hits),
         s1.compile_ms - s0.compile_ms);
  if (mode == 2) /* the step graph's static memory plan (no GPU: planned, not allocated) */
    printf(" %.1f | %.1f | %.1f |\n", s1.arena_bytes / 1048576.0, s1.arena_sum_bytes / 1048576.0,
           s1.arena_live_bytes / 1048576.0);
  else
    printf(" - | - | - |\n");
  fflush(stdout);
  kiln_optim_free(m.opt);
  kiln_optim_free(m.muon);
  kiln_params_free(m.p);
  kiln_tensor_free(m.x);
  kiln_tensor_free(m.y);
  kiln_ctx_free(ctx);
}

/* `steps` steps between two CUDA events: ms per step. */
static float timed_steps(kiln_ctx *ctx, model *m, int steps, const char *what) {
  cudaStream_t stream = (cudaStream_t)kiln_ctx_stream(ctx);
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  cudaEventRecord(e0, stream);
  for (int i = 0; i < steps; i++) {
    kiln_step_begin(ctx);
    model_step(m);
    if (kiln_step_end(ctx) != KILN_OK) die(ctx, what);
  }
  cudaEventRecord(e1, stream);
  cudaEventSynchronize(e1);
  float ms = 0;
  cudaEventElapsedTime(&ms, e0, e1);
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  return ms / (float)steps;
}

/* One mode's timeline trace: the first step and a warm-up untraced, five blocks of `steps` more
 * untraced and timed (their median: one block of 10 steps on the H100 once took 3x the others,
 * a host stall between two steps), then `steps` traced (and timed: CUDA events, to set beside
 * the trace's step spans). */
static void trace_mode(int workload, int mode, int steps, const char *path) {
  kiln_ctx *ctx = kiln_ctx_new(NULL);
  if (!ctx || kiln_ctx_error(ctx)) die(ctx, "no usable GPU");
  kiln_set_fusion(ctx, mode > 0);
  kiln_set_graphs(ctx, mode == 2);
  model m;
  model_init(&m, ctx, workload);
  if (!m.opt || kiln_ctx_error(ctx)) die(ctx, "setting up");
  for (int i = 0; i < 21; i++) { /* compiles, the graph's capture, then steady steps */
    kiln_step_begin(ctx);
    model_step(&m);
    if (kiln_step_end(ctx) != KILN_OK) die(ctx, "warm-up step");
  }
  if (kiln_sync(ctx) != KILN_OK) die(ctx, "warm-up");
  float blocks[5];
  for (int b = 0; b < 5; b++)
    blocks[b] = timed_steps(ctx, &m, steps, "untraced step");
  qsort(blocks, 5, sizeof *blocks, cmp);
  float untraced = blocks[2];
  if (kiln_trace_begin(ctx, path) != KILN_OK) die(ctx, "starting the trace");
  float traced = timed_steps(ctx, &m, steps, "traced step");
  if (kiln_sync(ctx) != KILN_OK || kiln_trace_end(ctx) != KILN_OK) die(ctx, "writing the trace");
  printf("%s %s: %.3f ms/step traced, %.3f untraced (CUDA events: %d steps, and the median of 5 "
         "blocks of as many): %s\n",
         workloads[workload], modes[mode], traced, untraced, steps, path);
  kiln_optim_free(m.opt);
  kiln_optim_free(m.muon);
  kiln_params_free(m.p);
  kiln_tensor_free(m.x);
  kiln_tensor_free(m.y);
  kiln_ctx_free(ctx);
}

/* The HTML report of traces (a context without a GPU takes its errors). */
static int report(const char *html, const char *title, int n, const char *const *traces,
                  const char *const *labels) {
  kiln_ctx *ctx = kiln_ctx_new(&(kiln_ctx_options){.no_gpu = 1});
  if (!ctx) die(ctx, "out of host memory");
  if (kiln_trace_report(ctx, html, title, n, traces, labels) != KILN_OK) die(ctx, "the report");
  kiln_ctx_free(ctx);
  printf("report: %s\n", html);
  return 0;
}

int main(int argc, char **argv) {
  /* steps 0: each workload's default (100 steps per block, 20 for air and air_muon, 10 for
   * resnet18) */
  int steps = 0, steps_given = 0, blocks = 21, only = -1, json = 0, workload = -1; /* -1: all */
  int compile = 0;
  const char *trace_dir = NULL;
  if (argc >= 2 && strcmp(argv[1], "--report") == 0) {
    if (argc < 4) {
      fprintf(stderr, "usage: %s --report OUT.html TRACE.json...\n", argv[0]);
      return 2;
    }
    return report(argv[2], "kiln: step timelines", argc - 3, (const char *const *)argv + 3, NULL);
  }
  for (int i = 1; i < argc; i++) {
    if (strcmp(argv[i], "--steps") == 0 && i + 1 < argc) {
      steps = atoi(argv[++i]);
      steps_given = 1;
    } else if (strcmp(argv[i], "--blocks") == 0 && i + 1 < argc) {
      blocks = atoi(argv[++i]);
    } else if (strcmp(argv[i], "--batch") == 0 && i + 1 < argc) {
      char *end;
      long long b = strtoll(argv[++i], &end, 10);
      if (*end || b < 1 || b > 65536) {
        fprintf(stderr, "profile_step: --batch is 1 to 65536, not %s\n", argv[i]);
        return 2;
      }
      batch_flag = b;
    } else if (strcmp(argv[i], "--json") == 0) {
      json = 1;
    } else if (strcmp(argv[i], "--compile-only") == 0) {
      compile = 1;
    } else if (strcmp(argv[i], "--trace") == 0 && i + 1 < argc) {
      trace_dir = argv[++i];
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
      for (int k = 0; k < NWORKLOADS; k++)
        if (strcmp(w, workloads[k]) == 0) workload = k;
      if (strcmp(w, "all") == 0) workload = -1;
      if (workload == -2) {
        fprintf(stderr,
                "profile_step: --workload is mlp, cnn, air, resnet18, air_muon or all, not %s\n",
                w);
        return 2;
      }
    } else {
      fprintf(
          stderr,
          "usage: %s [--workload mlp|cnn|air|resnet18|air_muon|all] [--steps N] [--blocks N] "
          "[--batch N] [--mode unfused|fused|graph] [--json] [--compile-only] [--trace DIR]\n"
          "       %s --report OUT.html TRACE.json...\n"
          "  all (the default) is mlp, cnn and air; resnet18 and air_muon run only when named\n",
          argv[0], argv[0]);
      return 2;
    }
  }
  if ((steps_given && steps < 1) || blocks < 1 || blocks > 1000) {
    fprintf(stderr, "profile_step: --steps and --blocks must be positive (blocks <= 1000)\n");
    return 2;
  }
  if (batch_flag && !json) /* the titles below give each workload's own */
    printf("every workload's batch: %lld (--batch)\n\n", (long long)batch_flag);
  if (trace_dir && !compile && mkdir(trace_dir, 0777) != 0 && errno != EEXIST) {
    fprintf(stderr, "profile_step: --trace %s: the folder cannot be made: %s\n", trace_dir,
            strerror(errno));
    return 1;
  }
  static const char *const titles[NWORKLOADS] = {
      "mlp step (784-512-512-10, batch 128, SGD Nesterov)",
      "cnn step (pytorch/examples MNIST net, batch 128, NHWC, Adam)",
      "air step (airbench94 net, batch 1024, NHWC, bf16 autocast, SGD Nesterov)",
      "resnet18 step (torchvision ResNet-18, 11,689,512 parameters, batch 128 of 224x224, NHWC, "
      "bf16 autocast, SGD momentum)",
      "air_muon step (airbench94 net, batch 2000, NHWC, bf16 autocast, Muon for the filters, SGD "
      "Nesterov for the rest)",
  };
  int nw = workload >= 0 ? NWORKLOADS : NDEFAULT; /* all: the first NDEFAULT */
  for (int w = 0; w < nw && trace_dir && !compile; w++) {
    if (workload >= 0 && w != workload) continue;
    char paths[3][1024], html[1024], title[256];
    const char *tp[3], *labels[3];
    int n = 0;
    for (int k = 0; k < 3; k++) {
      if (only >= 0 && k != only) continue;
      snprintf(paths[k], sizeof paths[k], "%s/%s_%s.json", trace_dir, workloads[w], modes[k]);
      trace_mode(w, k, steps_given ? steps : 10, paths[k]);
      fflush(stdout);
      tp[n] = paths[k];
      labels[n++] = modes[k];
    }
    snprintf(html, sizeof html, "%s/%s.html", trace_dir, workloads[w]);
    snprintf(title, sizeof title, "kiln: %s", titles[w]);
    report(html, title, n, tp, labels);
  }
  if (trace_dir) return 0;
  for (int w = 0; w < nw && compile; w++) {
    if (workload >= 0 && w != workload) continue;
    printf("%s%s, one step planned and compiled without a GPU\n\n| mode | nodes | groups | "
           "kernels | NVRTC ms | arena MiB | values' sum MiB | most live MiB |\n"
           "| --- | --- | --- | --- | --- | --- | --- | --- |\n",
           w > 0 && workload < 0 ? "\n" : "", titles[w]);
    for (int k = 0; k < 3; k++)
      if (only < 0 || k == only) compile_only(w, k);
  }
  for (int w = 0; w < nw && !compile; w++) {
    if (workload >= 0 && w != workload) continue;
    int wsteps = steps_given                                   ? steps
                 : w == WORKLOAD_AIR || w == WORKLOAD_AIR_MUON ? 20
                 : w == WORKLOAD_RESNET18                      ? 10
                                                               : 100;
    if (!json)
      printf(
          "%s%s, median of %d blocks of %d steps\n\n| mode | ms/step | kernels/step | peak MiB "
          "| graph captures / replays | first step ms |\n| --- | --- | --- | --- | --- | --- |\n",
          w > 0 && workload < 0 ? "\n" : "", titles[w], blocks, wsteps);
    for (int k = 0; k < 3; k++) {
      if (only >= 0 && k != only) continue;
      result r = profile(w, k, wsteps, blocks);
      if (json) {
        printf("{\"workload\": \"%s\", \"framework\": \"kiln\", \"mode\": \"%s\", "
               "\"ms_per_step\": %.4f, \"ms_min\": %.4f, \"ms_max\": %.4f, "
               "\"kernels_per_step\": %.1f, \"peak_mib\": %.2f, \"arena_mib\": %.2f, "
               "\"intermediates_mib\": %.2f, \"steps\": %d, \"batch\": %lld, "
               "\"params\": %lld, \"first_step_ms\": %.1f, \"first_step_compiled\": %llu}\n",
               workloads[w], modes[k], r.ms_median, r.ms_min, r.ms_max, r.kernels_per_step,
               r.peak_mib, r.arena_mib, r.intermediates_mib, blocks * wsteps, (long long)r.batch,
               (long long)r.params, r.first_ms, (unsigned long long)r.first_compiled);
      } else {
        printf("| %s | %.3f | %.1f | %.1f | %llu / %llu | %.1f |\n", modes[k], r.ms_median,
               r.kernels_per_step, r.peak_mib, (unsigned long long)r.captures,
               (unsigned long long)r.replays, r.first_ms);
      }
      fflush(stdout);
    }
  }
  return 0;
}
