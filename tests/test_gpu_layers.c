/*
 * test_gpu_layers.c: the image layers' values on the GPU: the convolution layer's PyTorch init
 * (U(-1/sqrt(fan_in), 1/sqrt(fan_in)), fan_in = Cin / groups * kh * kw) and its forward against
 * the float64 reference; batch norm's initial values, running statistics that only its forward
 * changes (an optimizer's steps, with weight decay, in graph replays, leave them to it), and its
 * evaluation mode through kiln_set_training; layer norm's init and forward; buffers saved and
 * loaded with the parameters. Without a GPU every test skips, saying why.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ref_conv.h"

/* Asserts the values of t are U(-bound, bound)-like: inside the bound, reaching near it, and (for
 * many values) of mean 0 and root mean square bound / sqrt(3). */
static void expect_uniform(kiln_tensor *t, double bound, double reach, const char *what) {
  float *v = th_read(t);
  int64_t n = kiln_tensor_numel(t);
  double s = 0, s2 = 0, mx = 0;
  for (int64_t i = 0; i < n; i++) {
    s += v[i];
    s2 += (double)v[i] * v[i];
    mx = fabs(v[i]) > mx ? fabs(v[i]) : mx;
  }
  cr_assert_leq(mx, bound, "%s: |value| %.6g beyond the bound %.6g", what, mx, bound);
  cr_assert_gt(mx, reach * bound, "%s: the largest |value| %.6g is far inside the bound %.6g", what,
               mx, bound);
  if (n >= 10000) {
    cr_assert_lt(fabs(s / n), 0.01 * bound, "%s: mean %.6g", what, s / n);
    cr_assert_lt(fabs(sqrt(s2 / n) - bound / sqrt(3.0)), 0.01 * bound, "%s: rms %.6g, want %.6g",
                 what, sqrt(s2 / n), bound / sqrt(3.0));
  }
  free(v);
}

Test(gpu_layers, conv2d_init_matches_pytorch_bounds) {
  TH_GPU_CTX(ctx);
  kiln_params *p = kiln_params_new(ctx);
  kiln_conv2d_layer big, grouped, plain;
  cr_assert_eq(
      kiln_conv2d_layer_init(
          &big, p, &(kiln_conv2d_layer_options){.name = "big", .in = 64, .out = 128, .kernel = 3}),
      KILN_OK, "%s", th_err(ctx));
  cr_assert_eq(
      kiln_conv2d_layer_init(
          &grouped, p,
          &(kiln_conv2d_layer_options){
              .name = "grouped", .in = 8, .out = 16, .kernel_h = 3, .kernel_w = 5, .groups = 4}),
      KILN_OK, "%s", th_err(ctx));
  cr_assert_eq(
      kiln_conv2d_layer_init(&plain, p,
                             &(kiln_conv2d_layer_options){
                                 .name = "plain", .in = 3, .out = 5, .kernel = 2, .no_bias = 1}),
      KILN_OK, "%s", th_err(ctx));
  /* fan_in 64 * 9 = 576 */
  expect_uniform(big.weight, 1 / 24.0, 0.99, "big.weight (fan_in 576)");
  expect_uniform(big.bias, 1 / 24.0, 0.9, "big.bias (fan_in 576)");
  /* fan_in 8 / 4 * 3 * 5 = 30 */
  ref_expect_shape(ctx, grouped.weight, KILN_SHAPE(16, 2, 3, 5), "grouped.weight");
  expect_uniform(grouped.weight, 1 / sqrt(30.0), 0.95, "grouped.weight (fan_in 30)");
  expect_uniform(grouped.bias, 1 / sqrt(30.0), 0.5, "grouped.bias (fan_in 30)");
  cr_assert_null(plain.bias);
  expect_uniform(plain.weight, 1 / sqrt(12.0), 0.8, "plain.weight (fan_in 12)");
  cr_assert_eq(kiln_params_numel(p), 128 * 64 * 9 + 128 + 16 * 2 * 15 + 16 + 5 * 3 * 4);
  /* the same seed, the same weights */
  kiln_manual_seed(ctx, 3);
  kiln_params *p2 = kiln_params_new(ctx), *p3 = kiln_params_new(ctx);
  kiln_conv2d_layer a, b;
  cr_assert_eq(
      kiln_conv2d_layer_init(
          &a, p2, &(kiln_conv2d_layer_options){.name = "c", .in = 5, .out = 7, .kernel = 3}),
      KILN_OK);
  kiln_manual_seed(ctx, 3);
  cr_assert_eq(
      kiln_conv2d_layer_init(
          &b, p3, &(kiln_conv2d_layer_options){.name = "c", .in = 5, .out = 7, .kernel = 3}),
      KILN_OK);
  float *va = th_read(a.weight), *vb = th_read(b.weight);
  cr_assert(memcmp(va, vb, 7 * 5 * 9 * sizeof *va) == 0, "one seed gave two initialisations");
  free(va);
  free(vb);
  kiln_params_free(p);
  kiln_params_free(p2);
  kiln_params_free(p3);
  th_ctx_free(ctx);
}

/* A grouped, strided, padded layer against the reference on its own weights. */
Test(gpu_layers, conv2d_forward_matches_the_reference) {
  TH_GPU_CTX_EAGER(ctx);
  kiln_params *p = kiln_params_new(ctx);
  kiln_conv2d_layer l;
  cr_assert_eq(
      kiln_conv2d_layer_init(
          &l, p,
          &(kiln_conv2d_layer_options){
              .name = "c", .in = 6, .out = 4, .kernel = 3, .stride = 2, .padding = 1, .groups = 2}),
      KILN_OK, "%s", th_err(ctx));
  float *xh, *wh = th_read(l.weight), *bh = th_read(l.bias);
  kiln_shape xs = KILN_SHAPE(2, 7, 5, 6);
  kiln_tensor *x = ref_rand_tensor(ctx, xs, 7000, &REF_GEN(-1, 1), 0, &xh);
  double *xd = ref_to_double(xh, ref_numel(xs)), *wd = ref_to_double(wh, 4 * 3 * 9);
  double *bd = ref_to_double(bh, 4);
  ref_win g = {.kh = 3, .kw = 3, .sh = 2, .sw = 2, .ph = 1, .pw = 1, .dh = 1, .dw = 1, .groups = 2};
  kiln_shape os = ref_win_out(xs, &g, 4);
  double *want = ref_dalloc(ref_numel(os));
  ref_conv2d(xd, xs, wd, 4, bd, &g, want);
  kiln_step_begin(ctx);
  ref_expect_close(ctx, kiln_conv2d_layer_forward(&l, x), os, want, 1e-4, 1e-4,
                   "conv2d layer 6->4 3x3 stride 2 pad 1 groups 2");
  free(xh);
  free(wh);
  free(bh);
  free(xd);
  free(wd);
  free(bd);
  free(want);
  kiln_tensor_free(x);
  kiln_params_free(p);
  th_ctx_free(ctx);
}

/* ---------------------------------------------------------------- batch norm */

static void expect_values(kiln_ctx *ctx, kiln_tensor *t, int64_t n, double v, const char *what) {
  double *want = ref_dalloc(n);
  for (int64_t i = 0; i < n; i++)
    want[i] = v;
  ref_expect_close(ctx, t, KILN_SHAPE(n), want, 0, 0, what);
  free(want);
}

/* Three training steps of sum(bn(x) * g) with SGD (momentum, weight decay) in graph mode. The
 * running statistics follow PyTorch's update with the default momentum (0.1, from 0) and nothing
 * else: no gradient, no optimizer step, no weight decay; the weight and bias follow SGD. */
Test(gpu_layers, batch_norm_buffers_change_only_by_the_forward) {
  TH_GPU_CTX(ctx);
  kiln_params *p = kiln_params_new(ctx);
  kiln_batch_norm_layer l;
  cr_assert_eq(kiln_batch_norm_layer_init(
                   &l, p, &(kiln_batch_norm_layer_options){.name = "bn", .features = 5}),
               KILN_OK, "%s", th_err(ctx));
  expect_values(ctx, l.weight, 5, 1, "bn.weight at first");
  expect_values(ctx, l.bias, 5, 0, "bn.bias at first");
  expect_values(ctx, l.running_mean, 5, 0, "bn.running_mean at first");
  expect_values(ctx, l.running_var, 5, 1, "bn.running_var at first");
  kiln_sgd_options so = kiln_sgd_defaults(0.1f);
  so.momentum = 0.9f;
  so.weight_decay = 0.1f;
  kiln_optim *opt = kiln_sgd_new(p, &so);
  cr_assert_not_null(opt, "%s", th_err(ctx));

  kiln_shape xs = KILN_SHAPE(4, 3, 3, 5);
  float *xh, *gh;
  kiln_tensor *x = ref_rand_tensor(ctx, xs, 7100, &REF_GEN(-1, 3), 0, &xh);
  kiln_tensor *g = ref_rand_tensor(ctx, xs, 7101, &REF_GEN(-1, 1), 0, &gh);
  double *xd = ref_to_double(xh, 180), *gd = ref_to_double(gh, 180), y[180];
  double rm[5] = {0}, rv[5] = {1, 1, 1, 1, 1}, w[5] = {1, 1, 1, 1, 1}, b[5] = {0};
  double mw[5] = {0}, mb[5] = {0}, dw[5], db[5];
  for (int step = 0; step < 3; step++) {
    kiln_step_begin(ctx);
    kiln_optim_zero_grad(opt);
    kiln_tensor *out = kiln_batch_norm_layer_forward(&l, x);
    cr_assert_eq(kiln_backward(kiln_sum(kiln_mul(out, g), KILN_ALL_AXES, 0)), KILN_OK, "%s",
                 th_err(ctx));
    cr_assert_eq(kiln_optim_step(opt), KILN_OK, "%s", th_err(ctx));
    cr_assert_eq(kiln_step_end(ctx), KILN_OK, "%s", th_err(ctx));
    /* the reference: the forward updates the running statistics; SGD (torch.optim's rule)
     * updates the weight and bias from their gradients */
    ref_batch_norm_backward(xd, 36, 5, w, NULL, NULL, 1, 1e-5, gd, NULL, dw, db);
    ref_batch_norm(xd, 36, 5, w, b, rm, rv, 1, 0.1, 1e-5, y);
    for (int c = 0; c < 5; c++) {
      double d = dw[c] + 0.1 * w[c], e = db[c] + 0.1 * b[c];
      mw[c] = step == 0 ? d : 0.9 * mw[c] + d;
      mb[c] = step == 0 ? e : 0.9 * mb[c] + e;
      w[c] -= 0.1 * mw[c];
      b[c] -= 0.1 * mb[c];
    }
    char what[128];
    snprintf(what, sizeof what, "after step %d: bn.running_mean", step + 1);
    ref_expect_close(ctx, l.running_mean, KILN_SHAPE(5), rm, 1e-6, 1e-5, what);
    snprintf(what, sizeof what, "after step %d: bn.running_var", step + 1);
    ref_expect_close(ctx, l.running_var, KILN_SHAPE(5), rv, 1e-6, 1e-5, what);
    snprintf(what, sizeof what, "after step %d: bn.weight", step + 1);
    ref_expect_close(ctx, l.weight, KILN_SHAPE(5), w, 1e-5, 1e-5, what);
    snprintf(what, sizeof what, "after step %d: bn.bias", step + 1);
    ref_expect_close(ctx, l.bias, KILN_SHAPE(5), b, 1e-5, 1e-5, what);
    cr_assert_null(kiln_tensor_grad(l.running_mean), "the running mean got a gradient");
    cr_assert_null(kiln_tensor_grad(l.running_var), "the running variance got a gradient");
    cr_assert(!kiln_tensor_requires_grad(l.running_mean) &&
              !kiln_tensor_requires_grad(l.running_var));
  }
  kiln_exec_stats s;
  kiln_stats(ctx, &s);
  cr_assert_eq(s.graph_replays, 2, "steps 2 and 3 replayed the first's graph (%llu replays)",
               (unsigned long long)s.graph_replays);
  free(xh);
  free(gh);
  free(xd);
  free(gd);
  kiln_tensor_free(x);
  kiln_tensor_free(g);
  kiln_optim_free(opt);
  kiln_params_free(p);
  th_ctx_free(ctx);
}

/* kiln_set_training(ctx, 0): the layer normalises with its running statistics and leaves them;
 * on again, with the batch's, updating them (momentum 0.3, eps 1e-3 given to the layer). */
Test(gpu_layers, batch_norm_follows_the_training_mode) {
  TH_GPU_CTX_EAGER(ctx);
  kiln_params *p = kiln_params_new(ctx);
  kiln_batch_norm_layer l;
  cr_assert_eq(
      kiln_batch_norm_layer_init(&l, p,
                                 &(kiln_batch_norm_layer_options){
                                     .name = "bn", .features = 6, .momentum = 0.3f, .eps = 1e-3f}),
      KILN_OK, "%s", th_err(ctx));
  float wh[6], bh[6], rmh[6], rvh[6];
  ref_gen_fill(wh, 6, 7200, &REF_GEN(0.5f, 1.5f));
  ref_gen_fill(bh, 6, 7201, &REF_GEN(-1, 1));
  ref_gen_fill(rmh, 6, 7202, &REF_GEN(-0.5f, 0.5f));
  ref_gen_fill(rvh, 6, 7203, &REF_GEN(0.5f, 2));
  cr_assert_eq(kiln_tensor_copy_from_host(l.weight, wh, sizeof wh), KILN_OK);
  cr_assert_eq(kiln_tensor_copy_from_host(l.bias, bh, sizeof bh), KILN_OK);
  cr_assert_eq(kiln_tensor_copy_from_host(l.running_mean, rmh, sizeof rmh), KILN_OK);
  cr_assert_eq(kiln_tensor_copy_from_host(l.running_var, rvh, sizeof rvh), KILN_OK);
  double w[6], b[6], rm[6], rv[6];
  for (int c = 0; c < 6; c++) {
    w[c] = wh[c];
    b[c] = bh[c];
    rm[c] = rmh[c];
    rv[c] = rvh[c];
  }
  kiln_shape xs = KILN_SHAPE(2, 4, 3, 6);
  float *xh;
  kiln_tensor *x = ref_rand_tensor(ctx, xs, 7204, &REF_GEN(-1, 3), 0, &xh);
  double *xd = ref_to_double(xh, 144), want[144];

  cr_assert_eq(kiln_training(ctx), 1);
  kiln_set_training(ctx, 0);
  cr_assert_eq(kiln_training(ctx), 0);
  kiln_step_begin(ctx);
  ref_batch_norm(xd, 24, 6, w, b, rm, rv, 0, 0.3, 1e-3, want);
  ref_expect_close(ctx, kiln_batch_norm_layer_forward(&l, x), xs, want, 1e-4, 1e-4,
                   "batch norm layer in evaluation mode (running statistics)");
  ref_expect_close(ctx, l.running_mean, KILN_SHAPE(6), rm, 0, 0,
                   "the running mean after an evaluation forward");
  ref_expect_close(ctx, l.running_var, KILN_SHAPE(6), rv, 0, 0,
                   "the running variance after an evaluation forward");

  kiln_set_training(ctx, 1);
  kiln_step_begin(ctx);
  ref_batch_norm(xd, 24, 6, w, b, rm, rv, 1, 0.3, 1e-3, want);
  ref_expect_close(ctx, kiln_batch_norm_layer_forward(&l, x), xs, want, 1e-4, 1e-4,
                   "batch norm layer in training mode (the batch's statistics)");
  ref_expect_close(ctx, l.running_mean, KILN_SHAPE(6), rm, 1e-6, 1e-5,
                   "the running mean after a training forward (momentum 0.3)");
  ref_expect_close(ctx, l.running_var, KILN_SHAPE(6), rv, 1e-6, 1e-5,
                   "the running variance after a training forward (momentum 0.3)");
  free(xh);
  free(xd);
  kiln_tensor_free(x);
  kiln_params_free(p);
  th_ctx_free(ctx);
}

/* Without affine parameters the layer has only its buffers, and normalises to mean 0, variance 1
 * per channel. */
Test(gpu_layers, batch_norm_without_affine) {
  TH_GPU_CTX_EAGER(ctx);
  kiln_params *p = kiln_params_new(ctx);
  kiln_batch_norm_layer l;
  cr_assert_eq(
      kiln_batch_norm_layer_init(
          &l, p, &(kiln_batch_norm_layer_options){.name = "bn", .features = 3, .no_affine = 1}),
      KILN_OK, "%s", th_err(ctx));
  cr_assert_eq(kiln_params_count(p), 2);
  kiln_shape xs = KILN_SHAPE(10, 3);
  float *xh;
  kiln_tensor *x = ref_rand_tensor(ctx, xs, 7300, &REF_GEN(-2, 5), 0, &xh);
  double *xd = ref_to_double(xh, 30), want[30], rm[3] = {0}, rv[3] = {1, 1, 1};
  ref_batch_norm(xd, 10, 3, NULL, NULL, rm, rv, 1, 0.1, 1e-5, want);
  kiln_step_begin(ctx);
  ref_expect_close(ctx, kiln_batch_norm_layer_forward(&l, x), xs, want, 1e-4, 1e-4,
                   "batch norm layer without affine parameters on (10, 3)");
  ref_expect_close(ctx, l.running_mean, KILN_SHAPE(3), rm, 1e-6, 1e-5, "its running mean");
  ref_expect_close(ctx, l.running_var, KILN_SHAPE(3), rv, 1e-6, 1e-5, "its running variance");
  free(xh);
  free(xd);
  kiln_tensor_free(x);
  kiln_params_free(p);
  th_ctx_free(ctx);
}

/* The buffers go into a weights file with the parameters and come back from it. */
Test(gpu_layers, batch_norm_buffers_are_saved_and_loaded) {
  TH_GPU_CTX_EAGER(ctx);
  kiln_params *p = kiln_params_new(ctx);
  kiln_batch_norm_layer l;
  cr_assert_eq(kiln_batch_norm_layer_init(
                   &l, p, &(kiln_batch_norm_layer_options){.name = "bn", .features = 4}),
               KILN_OK, "%s", th_err(ctx));
  kiln_tensor *x = th_rand(ctx, KILN_SHAPE(8, 4), 7400, -1.f, 3.f, NULL);
  kiln_step_begin(ctx);
  cr_assert_not_null(kiln_batch_norm_layer_forward(&l, x), "%s", th_err(ctx));
  cr_assert_eq(kiln_sync(ctx), KILN_OK, "%s", th_err(ctx));
  int64_t n;
  float *saved = th_params_values(p, &n);
  char dir[256], path[512];
  th_tmpdir(dir, sizeof dir, "bn");
  snprintf(path, sizeof path, "%s/bn.safetensors", dir);
  cr_assert_eq(kiln_params_save(p, path, KILN_DTYPE_F32), KILN_OK, "%s", th_err(ctx));
  /* a second forward moves the running statistics; loading brings the saved ones back */
  kiln_step_begin(ctx);
  cr_assert_not_null(kiln_batch_norm_layer_forward(&l, x), "%s", th_err(ctx));
  float *moved = th_params_values(p, &n);
  cr_assert(memcmp(saved, moved, (size_t)n * sizeof *saved) != 0, "the forward changed nothing");
  cr_assert_eq(kiln_params_load(p, path), KILN_OK, "%s", th_err(ctx));
  float *loaded = th_params_values(p, &n);
  cr_assert(memcmp(saved, loaded, (size_t)n * sizeof *saved) == 0,
            "loading did not restore the parameters and buffers");
  cr_assert(kiln_params_is_buffer(p, 2) && kiln_params_is_buffer(p, 3));
  cr_assert(!kiln_tensor_requires_grad(l.running_mean));
  /* a fresh list of the same layer loads them too */
  kiln_params *q = kiln_params_new(ctx);
  kiln_batch_norm_layer m;
  cr_assert_eq(kiln_batch_norm_layer_init(
                   &m, q, &(kiln_batch_norm_layer_options){.name = "bn", .features = 4}),
               KILN_OK, "%s", th_err(ctx));
  cr_assert_eq(kiln_params_load(q, path), KILN_OK, "%s", th_err(ctx));
  float *fresh = th_params_values(q, &n);
  cr_assert(memcmp(saved, fresh, (size_t)n * sizeof *saved) == 0);
  free(saved);
  free(moved);
  free(loaded);
  free(fresh);
  th_remove_tmpdirs();
  kiln_tensor_free(x);
  kiln_params_free(p);
  kiln_params_free(q);
  th_ctx_free(ctx);
}

/* ---------------------------------------------------------------- layer norm */

Test(gpu_layers, layer_norm_init_and_forward) {
  TH_GPU_CTX_EAGER(ctx);
  kiln_params *p = kiln_params_new(ctx);
  kiln_layer_norm_layer l;
  cr_assert_eq(kiln_layer_norm_layer_init(
                   &l, p, &(kiln_layer_norm_layer_options){.name = "ln", .features = 7}),
               KILN_OK, "%s", th_err(ctx));
  cr_assert_str_eq(kiln_params_name(p, 0), "ln.weight");
  cr_assert_str_eq(kiln_params_name(p, 1), "ln.bias");
  expect_values(ctx, l.weight, 7, 1, "ln.weight at first");
  expect_values(ctx, l.bias, 7, 0, "ln.bias at first");
  kiln_shape xs = KILN_SHAPE(3, 2, 7);
  float *xh;
  kiln_tensor *x = ref_rand_tensor(ctx, xs, 7500, &REF_GEN(-1, 3), 0, &xh);
  double *xd = ref_to_double(xh, 42), want[42];
  ref_layer_norm(xd, 6, 7, NULL, NULL, 1e-5, want); /* eps 0 means 1e-5 */
  kiln_step_begin(ctx);
  ref_expect_close(ctx, kiln_layer_norm_layer_forward(&l, x), xs, want, 1e-4, 1e-4,
                   "layer norm layer of (3, 2, 7)");
  free(xh);
  free(xd);
  kiln_tensor_free(x);
  kiln_params_free(p);
  th_ctx_free(ctx);
}

/* A conv + batch-norm model's weights file goes to PyTorch (tests/torch_bn_roundtrip.py loads it
 * into torch.nn.Conv2d and BatchNorm2d with strict=True and compares their evaluation output
 * with kiln's) and PyTorch's state_dict, num_batches_tracked and all, comes back. */
Test(gpu_layers, conv_batch_norm_weights_round_trip_with_pytorch, .timeout = 300,
     .fini = th_remove_tmpdirs) {
  TH_GPU_CTX(ctx);
  char dir[64], path[128], cmd[400];
  th_tmpdir(dir, sizeof dir, "bn");
  kiln_params *p = kiln_params_new(ctx);
  kiln_conv2d_layer conv;
  kiln_batch_norm_layer bn;
  cr_assert_eq(
      kiln_conv2d_layer_init(&conv, p,
                             &(kiln_conv2d_layer_options){
                                 .name = "conv", .in = 3, .out = 4, .kernel = 3, .padding = 1}),
      KILN_OK);
  cr_assert_eq(kiln_batch_norm_layer_init(
                   &bn, p, &(kiln_batch_norm_layer_options){.name = "bn", .features = 4}),
               KILN_OK);
  float hx[2 * 5 * 5 * 3], y[2 * 5 * 5 * 4], yt[2 * 5 * 5 * 4];
  th_rng r = {.s = 77};
  for (int i = 0; i < 150; i++)
    hx[i] = th_rng_range(&r, -1.f, 1.f);
  kiln_tensor *x = kiln_tensor_from_host(ctx, KILN_DTYPE_F32, KILN_SHAPE(2, 5, 5, 3), hx);
  /* a training step moves the running statistics away from 0 and 1 */
  kiln_step_begin(ctx);
  cr_assert_not_null(kiln_batch_norm_layer_forward(&bn, kiln_conv2d_layer_forward(&conv, x)));
  cr_assert_eq(kiln_step_end(ctx), KILN_OK, "%s", th_err(ctx));
  kiln_set_training(ctx, 0);
  for (int round = 0; round < 2; round++) {
    kiln_step_begin(ctx);
    kiln_tensor *out = kiln_batch_norm_layer_forward(&bn, kiln_conv2d_layer_forward(&conv, x));
    cr_assert_eq(kiln_step_end(ctx), KILN_OK, "%s", th_err(ctx));
    cr_assert_eq(kiln_tensor_to_host(out, y, sizeof y), KILN_OK, "%s", th_err(ctx));
    if (round == 1) break;
    snprintf(path, sizeof path, "%s/kiln.safetensors", dir);
    cr_assert_eq(kiln_params_save(p, path, KILN_DTYPE_F32), KILN_OK, "%s", th_err(ctx));
    snprintf(path, sizeof path, "%s/x.f32", dir);
    th_write_whole(path, hx, sizeof hx);
    snprintf(path, sizeof path, "%s/y.f32", dir);
    th_write_whole(path, y, sizeof y);
    snprintf(cmd, sizeof cmd, "python3 '%s/tests/torch_bn_roundtrip.py' '%s'", KILN_SOURCE_DIR,
             dir);
    int rc = system(cmd);
    if (WEXITSTATUS(rc) == 2) cr_skip_test("PyTorch, numpy or safetensors is not installed");
    cr_assert_eq(rc, 0, "the PyTorch side failed (%s)", cmd);
    snprintf(path, sizeof path, "%s/torch.safetensors", dir);
    cr_assert_eq(kiln_params_load(p, path), KILN_OK, "%s", th_err(ctx));
    snprintf(path, sizeof path, "%s/y_torch.f32", dir);
    size_t len;
    char *want = th_read_whole(path, &len);
    cr_assert_eq(len, sizeof yt);
    memcpy(yt, want, sizeof yt);
    free(want);
  }
  double scale = 0, worst = 0;
  for (int i = 0; i < 100; i++)
    scale = fabs(yt[i]) > scale ? fabs(yt[i]) : scale;
  for (int i = 0; i < 100; i++)
    worst = fabs(y[i] - yt[i]) > worst ? fabs(y[i] - yt[i]) : worst;
  cr_assert(scale > 0 && worst <= 1e-5 * scale,
            "PyTorch's weights in kiln: outputs differ by %g (largest %g)", worst, scale);
  kiln_tensor_free(x);
  kiln_params_free(p);
  th_ctx_free(ctx);
}
