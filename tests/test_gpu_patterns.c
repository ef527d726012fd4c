/*
 * test_gpu_patterns.c: each fusion pattern by its kernel count and its numbers on the GPU: an
 * elementwise chain is one kernel, softmax one, a linear layer with ReLU one cuBLASLt call, the
 * backward epilogues (DRELU, DGELU with the bias gradient, BGRADB) against generated kernels, the
 * MLP's whole training step 12 launches; fused results equal unfused ones, and what a flush
 * reports (kernels, bytes) is what it did.
 */
#include <math.h>
#include <string.h>

#include "helpers.h"

/* Runs build(ctx) in one flush with fusion on or off; returns the flush's kernel count and
 * the output read back. */
typedef kiln_tensor *(*builder)(kiln_ctx *ctx, kiln_tensor **in);

static float *run(kiln_ctx *ctx, builder build, kiln_tensor **in, bool fuse, uint64_t *kernels,
                  int64_t *n) {
  kiln_set_fusion(ctx, fuse);
  kiln_step_begin(ctx);
  kiln_tensor *y = build(ctx, in);
  cr_assert_not_null(y, "%s", kiln_ctx_error(ctx));
  cr_assert_eq(kiln_step_end(ctx), KILN_OK, "%s", kiln_ctx_error(ctx));
  kiln_exec_stats s;
  kiln_stats(ctx, &s);
  *kernels = s.last_flush.kernels;
  *n = kiln_tensor_numel(y);
  return th_read(y);
}

static void compare(builder build, kiln_tensor **in, kiln_ctx *ctx, uint64_t want_fused,
                    uint64_t want_unfused, double rtol, const char *what) {
  uint64_t kf, ku;
  int64_t n, m;
  float *f = run(ctx, build, in, true, &kf, &n), *u = run(ctx, build, in, false, &ku, &m);
  cr_assert_eq(n, m);
  cr_assert_eq(kf, want_fused, "%s: %llu kernels fused, want %llu", what, (unsigned long long)kf,
               (unsigned long long)want_fused);
  cr_assert_eq(ku, want_unfused, "%s: %llu kernels unfused, want %llu", what,
               (unsigned long long)ku, (unsigned long long)want_unfused);
  for (int64_t i = 0; i < n; i++)
    cr_assert(fabs(f[i] - u[i]) <= 1e-6 + rtol * fabs(u[i]),
              "%s: element %lld: fused %.9g, "
              "unfused %.9g",
              what, (long long)i, f[i], u[i]);
  free(f);
  free(u);
}

static kiln_tensor *chain(kiln_ctx *ctx, kiln_tensor **in) {
  (void)ctx;
  return kiln_mul(kiln_relu(kiln_add(in[0], in[1])), in[2]);
}

Test(gpu_patterns, elementwise_chain_is_one_kernel) {
  TH_GPU_CTX(ctx);
  kiln_tensor *in[3] = {th_rand(ctx, KILN_SHAPE(1024, 1024), 1, -1.f, 1.f, NULL),
                        th_rand(ctx, KILN_SHAPE(1024), 2, -1.f, 1.f, NULL),
                        th_rand(ctx, KILN_SHAPE(1024, 1), 3, -1.f, 1.f, NULL)};
  compare(chain, in, ctx, 1, 3, 0.0, "add relu mul");
  /* the flush reads a, b and c once and writes y once: the intermediates never touch memory */
  kiln_set_fusion(ctx, 1);
  uint64_t k;
  int64_t n;
  free(run(ctx, chain, in, true, &k, &n));
  kiln_exec_stats s;
  kiln_stats(ctx, &s);
  cr_assert_eq(s.last_flush.bytes_read, (uint64_t)(1024 * 1024 + 1024 + 1024) * 4);
  cr_assert_eq(s.last_flush.bytes_written, (uint64_t)1024 * 1024 * 4);
  for (int i = 0; i < 3; i++)
    kiln_tensor_free(in[i]);
  th_ctx_free(ctx);
}

static kiln_tensor *softmax(kiln_ctx *ctx, kiln_tensor **in) {
  (void)ctx;
  return kiln_softmax(in[0], 1);
}
static kiln_tensor *softmax3(kiln_ctx *ctx, kiln_tensor **in) {
  (void)ctx;
  return kiln_softmax(in[0], 2);
}

/* layer-norm statistics: (x - mean) / sqrt(var + eps) over the last axis */
static kiln_tensor *normalise(kiln_ctx *ctx, kiln_tensor **in) {
  (void)ctx;
  kiln_tensor *d = kiln_sub(in[0], kiln_mean(in[0], KILN_AXES(1), 1));
  kiln_tensor *v = kiln_mean(kiln_mul(d, d), KILN_AXES(1), 1);
  return kiln_mul(d, kiln_rsqrt(kiln_add_scalar(v, 1e-5f)));
}

static kiln_tensor *cross_entropy(kiln_ctx *ctx, kiln_tensor **in) {
  (void)ctx;
  return kiln_cross_entropy(in[0], in[1], KILN_REDUCTION_NONE, 0.1f);
}

Test(gpu_patterns, row_programs) {
  TH_GPU_CTX(ctx);
  kiln_tensor *in[2] = {th_rand(ctx, KILN_SHAPE(300, 77), 15, -3.f, 5.f, NULL), NULL};
  compare(normalise, in, ctx, 1, 7, 1e-5, "mean and variance");
  int32_t lab[300];
  for (int i = 0; i < 300; i++)
    lab[i] = (i * 13) % 77;
  in[1] = kiln_tensor_from_host(ctx, KILN_DTYPE_I32, KILN_SHAPE(300), lab);
  compare(cross_entropy, in, ctx, 1, 12, 1e-5, "cross entropy per row, smoothed");
  kiln_tensor_free(in[0]);
  kiln_tensor_free(in[1]);
  th_ctx_free(ctx);
}

/* Gradients of a two-layer MLP (ReLU or tanh-GELU hidden layer), fused against unfused; with
 * split, the forward runs in a flush of its own (the loss read before backward). */
static void mlp_grads(int64_t hidden, bool gelu, bool split, const char *want) {
  TH_GPU_CTX(ctx);
  float *grad[2][4];
  int64_t n[4];
  char plan_names[2][512];
  for (int fuse = 0; fuse < 2; fuse++) {
    kiln_set_fusion(ctx, fuse);
    kiln_set_graphs(ctx, !split); /* reading the loss inside the step splits it */
    kiln_manual_seed(ctx, 9);
    kiln_params *p = kiln_params_new(ctx);
    kiln_linear l1, l2;
    cr_assert_eq(
        kiln_linear_init(&l1, p, &(kiln_linear_options){.name = "l1", .in = 40, .out = hidden}),
        KILN_OK);
    cr_assert_eq(
        kiln_linear_init(&l2, p, &(kiln_linear_options){.name = "l2", .in = hidden, .out = 24}),
        KILN_OK);
    kiln_tensor *x = th_rand(ctx, KILN_SHAPE(64, 40), 16, -2.f, 2.f, NULL);
    kiln_tensor *w = th_rand(ctx, KILN_SHAPE(64, 24), 17, -1.f, 1.f, NULL);
    kiln_step_begin(ctx);
    kiln_tensor *z = kiln_linear_forward(&l1, x);
    kiln_tensor *h = gelu ? kiln_gelu(z, KILN_GELU_TANH) : kiln_relu(z);
    kiln_tensor *loss = kiln_sum(kiln_mul(kiln_linear_forward(&l2, h), w), KILN_ALL_AXES, 0);
    if (split) (void)kiln_tensor_item(loss);
    cr_assert_eq(kiln_backward(loss), KILN_OK, "%s", kiln_ctx_error(ctx));
    cr_assert_eq(kiln_step_end(ctx), KILN_OK, "%s", kiln_ctx_error(ctx));
    kiln_tensor *t[4] = {l1.weight, l1.bias, l2.weight, l2.bias};
    for (int k = 0; k < 4; k++) {
      grad[fuse][k] = th_read(kiln_tensor_grad(t[k]));
      n[k] = kiln_tensor_numel(t[k]);
    }
    kiln_exec_stats st;
    kiln_stats(ctx, &st);
    snprintf(plan_names[fuse], sizeof plan_names[fuse], "%llu kernels in the last flush",
             (unsigned long long)st.last_flush.kernels);
    kiln_tensor_free(x);
    kiln_tensor_free(w);
    kiln_params_free(p);
  }
  cr_log_info("%s: fused %s, unfused %s", want, plan_names[1], plan_names[0]);
  for (int k = 0; k < 4; k++)
    for (int64_t i = 0; i < n[k]; i++)
      cr_assert(fabsf(grad[1][k][i] - grad[0][k][i]) <= 2e-4f + 1e-4f * fabsf(grad[0][k][i]),
                "%s: gradient %d element %lld: fused %.9g, unfused %.9g", want, k, (long long)i,
                grad[1][k][i], grad[0][k][i]);
  for (int f = 0; f < 2; f++)
    for (int k = 0; k < 4; k++)
      free(grad[f][k]);
  th_ctx_free(ctx);
}

Test(gpu_patterns, relu_backward_epilogues_match_kernels) { mlp_grads(96, false, false, "relu"); }
Test(gpu_patterns, relu_mask_from_an_earlier_flush) { mlp_grads(96, false, true, "relu, split"); }
Test(gpu_patterns, gelu_backward_epilogues_match_kernels) { mlp_grads(96, true, false, "gelu"); }
Test(gpu_patterns, gelu_without_8k_columns) { mlp_grads(100, true, true, "gelu, 100 columns"); }

Test(gpu_patterns, softmax_is_one_kernel) {
  TH_GPU_CTX(ctx);
  kiln_tensor *in[1] = {th_rand(ctx, KILN_SHAPE(256, 100), 4, -8.f, 8.f, NULL)};
  compare(softmax, in, ctx, 1, 5, 1e-6, "softmax");
  kiln_tensor_free(in[0]);
  /* rows longer than a block, and a 3-D input */
  in[0] = th_rand(ctx, KILN_SHAPE(3, 5, 3000), 14, -8.f, 8.f, NULL);
  compare(softmax3, in, ctx, 1, 5, 1e-6, "softmax over 3000");
  kiln_tensor_free(in[0]);
  th_ctx_free(ctx);
}

typedef struct layer {
  kiln_params *p;
  kiln_linear l;
} layer;
static layer g_layer;

static kiln_tensor *linear_relu(kiln_ctx *ctx, kiln_tensor **in) {
  (void)ctx;
  return kiln_relu(kiln_linear_forward(&g_layer.l, in[0]));
}

Test(gpu_patterns, linear_relu_is_one_cublaslt_call) {
  TH_GPU_CTX(ctx);
  g_layer.p = kiln_params_new(ctx);
  cr_assert_eq(kiln_linear_init(&g_layer.l, g_layer.p,
                                &(kiln_linear_options){.name = "fc", .in = 300, .out = 200}),
               KILN_OK);
  kiln_tensor *in[1] = {th_rand(ctx, KILN_SHAPE(64, 300), 5, -1.f, 1.f, NULL)};
  compare(linear_relu, in, ctx, 1, 3, 1e-5, "linear relu");
  kiln_tensor_free(in[0]);
  kiln_params_free(g_layer.p);
  th_ctx_free(ctx);
}

Test(gpu_patterns, mlp_training_step_is_12_launches) {
  TH_GPU_CTX(ctx);
  float loss[2][6];
  uint64_t kernels[2];
  for (int fuse = 0; fuse < 2; fuse++) {
    kiln_set_fusion(ctx, fuse);
    kiln_manual_seed(ctx, 3);
    th_mlp m;
    th_mlp_init(ctx, &m);
    kiln_tensor *x = th_rand(ctx, KILN_SHAPE(128, 784), 6, -1.f, 1.f, NULL);
    int32_t lab[128];
    for (int i = 0; i < 128; i++)
      lab[i] = (i * 7) % 10;
    kiln_tensor *y = kiln_tensor_from_host(ctx, KILN_DTYPE_I32, KILN_SHAPE(128), lab);
    for (int s = 0; s < 6; s++) {
      kiln_step_begin(ctx);
      kiln_tensor *l = th_mlp_record_step(&m, x, y);
      cr_assert_eq(kiln_step_end(ctx), KILN_OK, "%s", kiln_ctx_error(ctx));
      kiln_exec_stats st;
      kiln_stats(ctx, &st);
      kernels[fuse] = st.last_flush.kernels;
      loss[fuse][s] = kiln_tensor_item(l);
    }
    th_mlp_free(&m);
    kiln_tensor_free(x);
    kiln_tensor_free(y);
  }
  cr_log_info("MLP step: %llu launches fused, %llu unfused", (unsigned long long)kernels[1],
              (unsigned long long)kernels[0]);
  cr_assert_eq(kernels[1], 12);
  cr_assert_eq(kernels[0], 50);
  for (int s = 0; s < 6; s++)
    cr_assert(fabsf(loss[1][s] - loss[0][s]) <= 1e-5f * fabsf(loss[0][s]) + 1e-6f,
              "step %d: fused loss %.9g, unfused %.9g", s, loss[1][s], loss[0][s]);
  cr_assert_lt(loss[1][5], loss[1][0], "the loss falls");
  th_ctx_free(ctx);
}

Test(gpu_patterns, reading_a_value_kept_in_registers) {
  TH_GPU_CTX(ctx);
  kiln_set_graphs(ctx, 0); /* reads inside an open step: the eager behaviour */
  kiln_tensor *a = th_rand(ctx, KILN_SHAPE(100), 7, -1.f, 1.f, NULL);
  /* read while pending: the flush writes it because the host asked */
  kiln_step_begin(ctx);
  kiln_tensor *e = kiln_exp(a);
  kiln_tensor *y = kiln_neg(e);
  float *ev = th_read(e), *yv = th_read(y);
  for (int i = 0; i < 100; i++)
    cr_assert_float_eq(yv[i], -ev[i], 0.f);
  free(ev);
  free(yv);
  /* read after the flush that kept it in registers: a clear error */
  kiln_step_begin(ctx);
  e = kiln_exp(a);
  y = kiln_neg(e);
  cr_assert_eq(kiln_step_end(ctx), KILN_OK);
  float v[100];
  cr_assert_eq(kiln_tensor_to_host(e, v, sizeof v), KILN_ERR_STATE);
  cr_assert(strstr(kiln_ctx_error(ctx), "registers") != NULL, "%s", kiln_ctx_error(ctx));
  kiln_ctx_clear_error(ctx);
  cr_assert_eq(kiln_tensor_to_host(y, v, sizeof v), KILN_OK);
  kiln_tensor_free(a);
  th_ctx_free(ctx);
}
