/*
 * test_gpu_cnn.c: small convolutional networks trained in kiln's modes against each other. A
 * conv-BN-ReLU-maxpool-linear step fused and unfused: the block's output, the loss, every
 * gradient, the running statistics and the updated parameters agree within fp32 rounding, and
 * fusion launches no more kernels. A tiny CNN (conv 1->4 3x3, ReLU, maxpool 2, flatten, linear,
 * cross-entropy) trained 50 steps with SGD and with Adam, step graphs on and off: the same losses
 * and parameters, bitwise, from one capture; and a conv-BN network likewise, with an evaluation
 * step (kiln_set_training(ctx, 0)) as a second signature that leaves the running statistics
 * alone. Without a GPU every test skips, saying why.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "helpers.h"

/* ---------------------------------------------------------------- the networks */

typedef struct net_cfg {
  int64_t batch, hw, cin, cout, classes;
  int pad, bn, adam;
} net_cfg;

/* conv 3x3 (bias) [-> batch norm] -> ReLU -> maxpool 2 -> flatten -> linear, cross-entropy,
 * on fixed random images and labels. */
typedef struct net {
  kiln_ctx *ctx;
  net_cfg cfg;
  kiln_params *p;
  kiln_conv2d_layer conv;
  kiln_batch_norm_layer bn;
  kiln_linear fc;
  kiln_optim *opt;
  kiln_tensor *x, *y;
} net;

static void net_init(net *n, kiln_ctx *ctx, const net_cfg *cfg, uint64_t seed) {
  memset(n, 0, sizeof *n);
  n->ctx = ctx;
  n->cfg = *cfg;
  kiln_manual_seed(ctx, seed);
  n->p = kiln_params_new(ctx);
  cr_assert_not_null(n->p, "%s", th_err(ctx));
  cr_assert_eq(
      kiln_conv2d_layer_init(
          &n->conv, n->p,
          &(kiln_conv2d_layer_options){
              .name = "conv", .in = cfg->cin, .out = cfg->cout, .kernel = 3, .padding = cfg->pad}),
      KILN_OK, "%s", th_err(ctx));
  if (cfg->bn)
    cr_assert_eq(
        kiln_batch_norm_layer_init(
            &n->bn, n->p, &(kiln_batch_norm_layer_options){.name = "bn", .features = cfg->cout}),
        KILN_OK, "%s", th_err(ctx));
  int64_t pooled = (cfg->hw + 2 * cfg->pad - 2) / 2;
  cr_assert_eq(kiln_linear_init(&n->fc, n->p,
                                &(kiln_linear_options){.name = "fc",
                                                       .in = cfg->cout * pooled * pooled,
                                                       .out = cfg->classes}),
               KILN_OK, "%s", th_err(ctx));
  if (cfg->adam) {
    kiln_adam_options a = kiln_adam_defaults();
    a.lr = 3e-3f;
    n->opt = kiln_adam_new(n->p, &a);
  } else {
    kiln_sgd_options s = kiln_sgd_defaults(0.05f);
    s.momentum = 0.9f;
    s.weight_decay = 1e-4f;
    n->opt = kiln_sgd_new(n->p, &s);
  }
  cr_assert_not_null(n->opt, "%s", th_err(ctx));
  n->x =
      th_rand(ctx, KILN_SHAPE(cfg->batch, cfg->hw, cfg->hw, cfg->cin), seed + 1, -1.f, 1.f, NULL);
  int32_t *lab = malloc((size_t)cfg->batch * sizeof *lab);
  cr_assert_not_null(lab);
  for (int64_t i = 0; i < cfg->batch; i++)
    lab[i] = (int32_t)((i * 7 + 3) % cfg->classes);
  n->y = kiln_tensor_from_host(ctx, KILN_DTYPE_I32, KILN_SHAPE(cfg->batch), lab);
  cr_assert_not_null(n->y, "%s", th_err(ctx));
  free(lab);
}

/* The pooled features (N, H', W', C). */
static kiln_tensor *net_features(net *n) {
  kiln_tensor *h = kiln_conv2d_layer_forward(&n->conv, n->x);
  if (n->cfg.bn) h = kiln_batch_norm_layer_forward(&n->bn, h);
  kiln_pool2d_options pool = {.kernel_h = 2, .kernel_w = 2};
  return kiln_max_pool2d(kiln_relu(h), &pool);
}

static kiln_tensor *net_loss(net *n, kiln_tensor *features) {
  kiln_tensor *logits = kiln_linear_forward(&n->fc, kiln_flatten(features));
  return kiln_cross_entropy(logits, n->y, KILN_REDUCTION_MEAN, 0.f);
}

/* One training step; *features (if given) gets the pooled features, read inside the step (an
 * eager context only). Returns the loss, read after the step. */
static float net_step(net *n, float **features) {
  kiln_step_begin(n->ctx);
  kiln_tensor *f = net_features(n);
  if (features) *features = th_read(f);
  kiln_tensor *loss = net_loss(n, f);
  kiln_optim_zero_grad(n->opt);
  cr_assert_eq(kiln_backward(loss), KILN_OK, "%s", th_err(n->ctx));
  cr_assert_eq(kiln_optim_step(n->opt), KILN_OK, "%s", th_err(n->ctx));
  cr_assert_eq(kiln_step_end(n->ctx), KILN_OK, "%s", th_err(n->ctx));
  float v = kiln_tensor_item(loss);
  th_assert_ok(n->ctx);
  return v;
}

/* An evaluation step: training mode off, no gradients; returns the loss. */
static float net_eval(net *n) {
  kiln_set_training(n->ctx, 0);
  kiln_no_grad_begin(n->ctx);
  kiln_step_begin(n->ctx);
  kiln_tensor *loss = net_loss(n, net_features(n));
  cr_assert_eq(kiln_step_end(n->ctx), KILN_OK, "%s", th_err(n->ctx));
  kiln_no_grad_end(n->ctx);
  kiln_set_training(n->ctx, 1);
  float v = kiln_tensor_item(loss);
  th_assert_ok(n->ctx);
  return v;
}

static void net_free(net *n) {
  kiln_optim_free(n->opt);
  kiln_params_free(n->p);
  kiln_tensor_free(n->x);
  kiln_tensor_free(n->y);
}

/* ---------------------------------------------------------------- comparisons */

/* a and b agree within fp32 rounding of sums: |a - b| <= 1e-4 (|b| + scale) + 1e-6, scale the
 * largest magnitude of the tensor (an element that is a near-cancelling sum differs by the
 * rounding of its terms, not of itself). */
static void expect_near(const float *a, const float *b, int64_t n, const char *what) {
  double scale = 0;
  for (int64_t i = 0; i < n; i++)
    scale = fabs(b[i]) > scale ? fabs(b[i]) : scale;
  for (int64_t i = 0; i < n; i++) {
    cr_assert(isfinite(a[i]) && isfinite(b[i]), "%s[%lld]: %.9g and %.9g", what, (long long)i,
              (double)a[i], (double)b[i]);
    cr_assert(fabs((double)a[i] - b[i]) <= 1e-4 * (fabs(b[i]) + scale) + 1e-6,
              "%s[%lld]: fused %.9g, unfused %.9g (scale %.3g)", what, (long long)i, (double)a[i],
              (double)b[i], scale);
  }
}

/* Every parameter and buffer of a and b, and every gradient: near (bitwise 0) or bitwise
 * equal (bitwise 1). */
static void compare_params(net *a, net *b, int bitwise, const char *when) {
  cr_assert_eq(kiln_params_count(a->p), kiln_params_count(b->p));
  char what[256];
  for (int i = 0; i < kiln_params_count(a->p); i++) {
    kiln_tensor *ta = kiln_params_get(a->p, i), *tb = kiln_params_get(b->p, i);
    const char *name = kiln_params_name(a->p, i);
    int64_t n = kiln_tensor_numel(ta);
    for (int grad = 0; grad < 2; grad++) {
      kiln_tensor *va = grad ? kiln_tensor_grad(ta) : ta, *vb = grad ? kiln_tensor_grad(tb) : tb;
      if (grad && kiln_params_is_buffer(a->p, i)) {
        cr_assert(va == NULL && vb == NULL, "%s: the buffer %s has a gradient", when, name);
        continue;
      }
      if (grad && !va && !vb) continue; /* after an evaluation step */
      cr_assert(va && vb, "%s: %s's gradient exists in one mode only", when, name);
      float *ha = th_read(va), *hb = th_read(vb);
      snprintf(what, sizeof what, "%s: %s%s", when, name, grad ? " (gradient)" : "");
      if (bitwise) {
        for (int64_t k = 0; k < n; k++)
          cr_assert(memcmp(&ha[k], &hb[k], 4) == 0, "%s[%lld]: %.9g and %.9g", what, (long long)k,
                    (double)ha[k], (double)hb[k]);
      } else {
        expect_near(ha, hb, n, what);
      }
      free(ha);
      free(hb);
    }
  }
}

/* ---------------------------------------------------------------- fused against unfused */

Test(gpu_cnn, conv_bn_relu_maxpool_step_fused_equals_unfused) {
  net_cfg cfg = {.batch = 8, .hw = 9, .cin = 3, .cout = 8, .classes = 5, .pad = 1, .bn = 1};
  for (int graphs = 0; graphs < 2; graphs++) {
    TH_GPU_CTX(fused);
    TH_GPU_CTX(unfused);
    kiln_set_fusion(fused, 1);
    kiln_set_fusion(unfused, 0);
    kiln_set_graphs(fused, graphs);
    kiln_set_graphs(unfused, graphs);
    net m[2];
    net_init(&m[0], fused, &cfg, 31);
    net_init(&m[1], unfused, &cfg, 31);
    compare_params(&m[0], &m[1], 1, "the initial parameters (one seed)");
    kiln_exec_stats s0[2], s1[2];
    kiln_stats(fused, &s0[0]);
    kiln_stats(unfused, &s0[1]);
    for (int step = 0; step < 3; step++) {
      char when[128];
      snprintf(when, sizeof when, "graphs %s, step %d", graphs ? "on" : "off", step);
      float *f[2] = {NULL, NULL};
      /* the block's output is read inside the step in eager mode only */
      float lf = net_step(&m[0], graphs ? NULL : &f[0]);
      float lu = net_step(&m[1], graphs ? NULL : &f[1]);
      if (!graphs) {
        char w[160];
        snprintf(w, sizeof w, "%s: the pooled conv-BN-ReLU output", when);
        expect_near(f[0], f[1], 8 * 4 * 4 * 8, w);
      }
      cr_assert(isfinite(lf) && fabsf(lf - lu) <= 1e-5f * (1 + fabsf(lu)),
                "%s: loss %.9g fused, %.9g unfused", when, (double)lf, (double)lu);
      compare_params(&m[0], &m[1], 0, when);
      free(f[0]);
      free(f[1]);
    }
    kiln_stats(fused, &s1[0]);
    kiln_stats(unfused, &s1[1]);
    uint64_t kf = s1[0].kernels_launched - s0[0].kernels_launched,
             ku = s1[1].kernels_launched - s0[1].kernels_launched;
    cr_log_info("conv-BN-ReLU-maxpool step, graphs %s: %llu kernels fused, %llu unfused",
                graphs ? "on" : "off", (unsigned long long)kf, (unsigned long long)ku);
    cr_assert_leq(kf, ku, "fusion launched more kernels (%llu) than unfused (%llu)",
                  (unsigned long long)kf, (unsigned long long)ku);
    net_free(&m[0]);
    net_free(&m[1]);
    th_ctx_free(fused);
    th_ctx_free(unfused);
  }
}

/* ---------------------------------------------------------------- graphs against no graphs */

static kiln_exec_stats stats_of(kiln_ctx *ctx) {
  kiln_exec_stats s;
  kiln_stats(ctx, &s);
  return s;
}

Test(gpu_cnn, tiny_cnn_graph_equals_no_graph_over_50_steps) {
  for (int adam = 0; adam < 2; adam++) {
    net_cfg cfg = {.batch = 32, .hw = 8, .cin = 1, .cout = 4, .classes = 10, .adam = adam};
    TH_GPU_CTX(cg);
    TH_GPU_CTX(ce);
    kiln_set_graphs(cg, 1);
    kiln_set_graphs(ce, 0);
    net g, e;
    net_init(&g, cg, &cfg, 41);
    net_init(&e, ce, &cfg, 41);
    float first = 0, last = 0;
    for (int s = 0; s < 50; s++) {
      float lg = net_step(&g, NULL), le = net_step(&e, NULL);
      cr_assert(memcmp(&lg, &le, 4) == 0, "%s step %d: loss %.9g with graphs, %.9g without",
                adam ? "Adam" : "SGD", s, (double)lg, (double)le);
      if (s == 0) first = lg;
      last = lg;
    }
    compare_params(&g, &e, 1, adam ? "Adam, after 50 steps" : "SGD, after 50 steps");
    cr_log_info("tiny CNN, %s: loss %.4f -> %.4f", adam ? "Adam" : "SGD", (double)first,
                (double)last);
    cr_assert_lt(last, first, "%s: 50 steps on one batch did not lower the loss (%.6f -> %.6f)",
                 adam ? "Adam" : "SGD", (double)first, (double)last);
    kiln_exec_stats sg = stats_of(cg), se = stats_of(ce);
    cr_assert_eq(sg.graph_captures, 1, "one signature, one capture (%llu)",
                 (unsigned long long)sg.graph_captures);
    cr_assert_eq(sg.graph_replays, 49);
    cr_assert_eq(se.graph_captures + se.graph_replays, 0);
    net_free(&g);
    net_free(&e);
    th_ctx_free(cg);
    th_ctx_free(ce);
  }
}

/* Batch norm's running statistics are updated in place by every replay; an evaluation step is a
 * signature of its own that reads them and changes nothing. */
Test(gpu_cnn, conv_bn_net_graph_equals_no_graph_with_an_evaluation_step) {
  net_cfg cfg = {.batch = 16, .hw = 8, .cin = 3, .cout = 6, .classes = 10, .pad = 1, .bn = 1};
  TH_GPU_CTX(cg);
  TH_GPU_CTX(ce);
  kiln_set_graphs(cg, 1);
  kiln_set_graphs(ce, 0);
  net g, e;
  net_init(&g, cg, &cfg, 51);
  net_init(&e, ce, &cfg, 51);
  for (int round = 0; round < 2; round++) {
    for (int s = 0; s < 10; s++) {
      float lg = net_step(&g, NULL), le = net_step(&e, NULL);
      cr_assert(memcmp(&lg, &le, 4) == 0, "round %d step %d: loss %.9g with graphs, %.9g without",
                round, s, (double)lg, (double)le);
    }
    compare_params(&g, &e, 1, round ? "after 20 steps" : "after 10 steps");
    int64_t n;
    float *before = th_params_values(g.p, &n);
    float vg = net_eval(&g), ve = net_eval(&e);
    cr_assert(memcmp(&vg, &ve, 4) == 0, "round %d evaluation: %.9g with graphs, %.9g without",
              round, (double)vg, (double)ve);
    float *after = th_params_values(g.p, &n);
    cr_assert(memcmp(before, after, (size_t)n * sizeof *before) == 0,
              "round %d: the evaluation step changed parameters or buffers", round);
    free(before);
    free(after);
  }
  /* the running statistics moved away from their initial zeros and ones */
  float *rm = th_read(g.bn.running_mean), *rv = th_read(g.bn.running_var);
  int moved = 0;
  for (int c = 0; c < 6; c++)
    moved += rm[c] != 0.f && rv[c] != 1.f;
  cr_assert_eq(moved, 6, "20 training steps updated the running statistics of %d of 6 channels",
               moved);
  free(rm);
  free(rv);
  kiln_exec_stats sg = stats_of(cg);
  cr_assert_eq(sg.graph_captures, 2, "training and evaluation: %llu captures",
               (unsigned long long)sg.graph_captures);
  cr_assert_eq(sg.graph_replays, 20 + 2 - 2);
  net_free(&g);
  net_free(&e);
  th_ctx_free(cg);
  th_ctx_free(ce);
}
