/*
 * test_gpu_conv_switches.c: the convolution switches that must change no value, each against its
 * absence on conv_cases.h's cases, bitwise: KILN_CONV_AHEAD (short reductions issued at once),
 * KILN_CONV_WGRAD_INTO (weight gradients written into .grad), KILN_CAST_BATCH (the parameters'
 * casts in one launch), KILN_CAST_TILES (filter casts through shared memory), KILN_CONV_DIRECT_EPI
 * (a direct product's activation in its kernel), KILN_CONV_RECOMPUTE_INPUT (a block's ReLU recorded
 * again for the weight gradient, on a conv, norm, ReLU, conv block), KILN_IM2COL_ROWS (blocks
 * gathered a row a thread), KILN_CONV_FEW_POOL and KILN_CONV_TMA_POOL (a max pool in a halo-tile or
 * TMA-fed product's epilogue), KILN_CONV_FPROP_BN (TMA-fed forward products two blocks an SM),
 * KILN_CONV_FEW_PROLOGUE (a halo-tile weight gradient computing its dY as it loads it),
 * KILN_POOL_FWD_PROLOGUE (a max pool computing its image as it reads it), KILN_WINDOW_AHEAD (a
 * window gradient's epilogue operands fetched before its own loads), KILN_CONV_DGRAD_WS (data
 * gradients with warps of their own for the epilogue). Without a GPU every test skips,
 * saying why.
 */
#include <stdlib.h>
#include <string.h>

#include "conv_cases.h"

/* y (as f32) and x's and w's gradients (malloc'd f32, in that order, n[3] values) for
 * loss = sum(y g) of case c in bf16, in an eager context made with the environment variable
 * `var` set to `value`. */
static void conv_results(const conv_case *c, const char *var, const char *value, uint64_t seed,
                         float *out[3], int64_t n[3]) {
  setenv(var, value, 1); /* read when the context is made */
  TH_GPU_CTX_EAGER(ctx);
  unsetenv(var);
  ref_win g = conv_win(c);
  kiln_shape xs = KILN_SHAPE(c->n, c->h, c->w, c->cin);
  kiln_shape ws = KILN_SHAPE(c->cout, c->cin, c->kh, c->kw);
  kiln_step_begin(ctx);
  kiln_tensor *x = ref_rand_tensor(ctx, xs, seed, &REF_GEN(-1, 1), 1, NULL);
  kiln_tensor *w = ref_rand_tensor(ctx, ws, seed + 1, &REF_GEN(-1, 1), 1, NULL);
  kiln_autocast_begin(ctx, KILN_DTYPE_BF16);
  kiln_tensor *y = kiln_cast(kiln_conv2d(x, w, NULL, &c->o), KILN_DTYPE_F32);
  kiln_autocast_end(ctx);
  free(ref_backward_weighted(ctx, y, seed + 2, c->desc));
  out[0] = ref_read_f32(ctx, y, "y");
  out[1] = ref_read_f32(ctx, kiln_tensor_grad(x), "x's gradient");
  out[2] = ref_read_f32(ctx, kiln_tensor_grad(w), "w's gradient");
  n[0] = ref_numel(ref_win_out(xs, &g, c->cout)), n[1] = ref_numel(xs), n[2] = ref_numel(ws);
  cr_assert_eq(kiln_step_end(ctx), KILN_OK, "%s: %s", c->desc, th_err(ctx));
  kiln_tensor_free(x);
  kiln_tensor_free(w);
  th_ctx_free(ctx);
}

/* Asserts that `var` set to `value` changes none of case c's three results (conv_results) from
 * those with `var` at `base`. */
static void value_changes_nothing(const conv_case *c, const char *var, const char *base,
                                  const char *value, uint64_t seed) {
  float *off[3], *on[3];
  int64_t n[3];
  conv_results(c, var, base, seed, off, n);
  conv_results(c, var, value, seed, on, n);
  const char *names[3] = {"y", "x's gradient", "w's gradient"};
  for (int q = 0; q < 3; q++) {
    cr_assert_eq(memcmp(on[q], off[q], (size_t)n[q] * sizeof(float)), 0, "%s, %s=%s: %s differs",
                 c->desc, var, value, names[q]);
    free(on[q]);
    free(off[q]);
  }
}

/* Asserts that switch `var` (0 or 1) changes none of case c's three results. */
static void switch_changes_nothing(const conv_case *c, const char *var, uint64_t seed) {
  value_changes_nothing(c, var, "0", "1", seed);
}

/* KILN_CONV_AHEAD=1 (a cp.async product whose reduction fits its stages issues every step's
 * copies before its first product: 24->64 3x3's four steps, 8->32's two) changes no value: the
 * forward product and both gradients of the implicit-GEMM cases bitwise those without it. */
Test(gpu_ops, conv2d_short_reductions_issued_at_once) {
  setenv("KILN_CONV_FEW", "0", 1); /* 24->64 on the cp.async kernel, not from a halo tile */
  for (size_t i = 0; i < sizeof wgmma_cases / sizeof *wgmma_cases; i++)
    switch_changes_nothing(&wgmma_cases[i], "KILN_CONV_AHEAD", 5300 + 10 * i);
  unsetenv("KILN_CONV_FEW");
}

/* KILN_CONV_FPROP_BN=256 (the default: TMA-fed forward products' tiles of at most 128 channels
 * in 96 KB of stages, two blocks an SM) and 128 (the wider ones narrowed to tiles of 128 too)
 * change no value: the TMA cases' three results bitwise those with 0 (tiles up to 256 wide, one
 * block an SM). */
Test(gpu_ops, conv2d_forward_tiles_two_blocks_an_sm) {
  skip_unless_sm90();
  for (size_t i = 0; i < sizeof tma_cases / sizeof *tma_cases; i++) {
    value_changes_nothing(&tma_cases[i], "KILN_CONV_FPROP_BN", "0", "256", 6800 + 10 * i);
    value_changes_nothing(&tma_cases[i], "KILN_CONV_FPROP_BN", "0", "128", 6900 + 10 * i);
  }
}

/* KILN_CONV_WGRAD_INTO=1 (an implicit weight gradient stores the weight's f32 gradient itself,
 * in place of its bf16 result, the cast of that and the assignment to .grad) changes no value:
 * the implicit-GEMM cases' (cp.async) and the TMA cases' three results bitwise those without it,
 * split reductions included. */
Test(gpu_ops, conv2d_weight_gradients_written_into_grad) {
  for (size_t i = 0; i < sizeof wgmma_cases / sizeof *wgmma_cases; i++)
    switch_changes_nothing(&wgmma_cases[i], "KILN_CONV_WGRAD_INTO", 5400 + 10 * i);
  for (size_t i = 0; i < sizeof tma_cases / sizeof *tma_cases; i++)
    switch_changes_nothing(&tma_cases[i], "KILN_CONV_WGRAD_INTO", 5600 + 10 * i);
}

/* KILN_CAST_BATCH=1 (autocast's casts of the parameters, x and the filters, in one multi-tensor
 * launch) changes no value: the implicit-GEMM and TMA cases' three results bitwise those without
 * it. */
Test(gpu_ops, conv2d_parameters_cast_in_one_launch) {
  for (size_t i = 0; i < sizeof wgmma_cases / sizeof *wgmma_cases; i++)
    switch_changes_nothing(&wgmma_cases[i], "KILN_CAST_BATCH", 5800 + 10 * i);
  for (size_t i = 0; i < sizeof tma_cases / sizeof *tma_cases; i++)
    switch_changes_nothing(&tma_cases[i], "KILN_CAST_BATCH", 5900 + 10 * i);
}

/* KILN_CAST_TILES=1 (the filters' casts to bf16 in their (O, KH, KW, I) order and their
 * gradients' back to (O, I, KH, KW) through dense blocks in shared memory, an image's four values
 * at a time) changes no value: the implicit-GEMM and TMA cases' three results bitwise those
 * without it. */
Test(gpu_ops, conv2d_filter_casts_through_shared_memory) {
  for (size_t i = 0; i < sizeof wgmma_cases / sizeof *wgmma_cases; i++)
    switch_changes_nothing(&wgmma_cases[i], "KILN_CAST_TILES", 6100 + 10 * i);
  for (size_t i = 0; i < sizeof tma_cases / sizeof *tma_cases; i++)
    switch_changes_nothing(&tma_cases[i], "KILN_CAST_TILES", 6200 + 10 * i);
}

/* act(conv2d(x, w)) (malloc'd f32, *n values) for direct case c in bf16, act 0 GELU, 1 SiLU then
 * ReLU, in an eager context made with KILN_CONV_DIRECT_EPI set to `on`. */
static float *direct_chain(const conv_case *c, int act, const char *on, uint64_t seed, int64_t *n) {
  setenv("KILN_CONV_DIRECT_EPI", on, 1); /* read when the context is made */
  TH_GPU_CTX_EAGER(ctx);
  unsetenv("KILN_CONV_DIRECT_EPI");
  ref_win g = conv_win(c);
  kiln_shape xs = KILN_SHAPE(c->n, c->h, c->w, c->cin);
  kiln_tensor *x = ref_rand_tensor(ctx, xs, seed, &REF_GEN(-2, 2), 0, NULL);
  kiln_tensor *w = ref_rand_tensor(ctx, KILN_SHAPE(c->cout, c->cin, c->kh, c->kw), seed + 1,
                                   &REF_GEN(-1, 1), 0, NULL);
  kiln_step_begin(ctx);
  kiln_autocast_begin(ctx, KILN_DTYPE_BF16);
  kiln_tensor *y = kiln_conv2d(x, w, NULL, &c->o);
  y = act == 0 ? kiln_gelu(y, KILN_GELU_ERF) : kiln_relu(kiln_silu(y));
  kiln_autocast_end(ctx);
  float *out = ref_read_f32(ctx, kiln_cast(y, KILN_DTYPE_F32), c->desc);
  *n = ref_numel(ref_win_out(xs, &g, c->cout));
  cr_assert_eq(kiln_step_end(ctx), KILN_OK, "%s: %s", c->desc, th_err(ctx));
  kiln_tensor_free(x);
  kiln_tensor_free(w);
  th_ctx_free(ctx);
  return out;
}

/* KILN_CONV_DIRECT_EPI=1 (a direct forward product applies the GELU, or the SiLU and ReLU, after
 * it before it stores) changes no value: bitwise the results without it, on the direct cases. */
Test(gpu_ops, tiny_conv2d_direct_products_apply_their_activation) {
  for (size_t i = 0; i < sizeof direct_cases / sizeof *direct_cases; i++)
    for (int act = 0; act < 2; act++) {
      int64_t n;
      float *off = direct_chain(&direct_cases[i], act, "0", 6000 + 10 * i, &n);
      float *on = direct_chain(&direct_cases[i], act, "1", 6000 + 10 * i, &n);
      cr_assert_eq(memcmp(on, off, (size_t)n * sizeof(float)), 0, "%s, activation %d differs",
                   direct_cases[i].desc, act);
      free(on);
      free(off);
    }
}

/* The gradients of x, both filters and the norm's weight and bias (malloc'd f32, in that order)
 * for loss = sum(conv2d(relu(batch_norm(conv2d(x, w1))), w2) g) under bf16 autocast, x
 * (img[0], img[1], img[2], C), C channels throughout, 3x3 filters, the second at `stride` (1 or 2,
 * which divides the image's sides), after the second of two steps (a step graph's capture, then
 * its replay), in a fused context made with switch `var` set to `on`. */
static void block_grads(const char *var, int64_t C, const int64_t img[3], int stride,
                        const char *on, uint64_t seed, float *out[5]) {
  setenv(var, on, 1); /* read when the context is made */
  TH_GPU_CTX(ctx);
  unsetenv(var);
  kiln_shape xs = KILN_SHAPE(img[0], img[1], img[2], C), fs = KILN_SHAPE(C, C, 3, 3);
  kiln_shape ys = KILN_SHAPE(img[0], img[1] / stride, img[2] / stride, C); /* 3x3, padding 1 */
  kiln_tensor *p[5] = {ref_rand_tensor(ctx, xs, seed, &REF_GEN(-1, 1), 1, NULL),
                       ref_rand_tensor(ctx, fs, seed + 1, &REF_GEN(-0.2f, 0.2f), 1, NULL),
                       ref_rand_tensor(ctx, fs, seed + 2, &REF_GEN(-0.2f, 0.2f), 1, NULL),
                       ref_rand_tensor(ctx, KILN_SHAPE(C), seed + 3, &REF_GEN(0.5f, 1.5f), 1, NULL),
                       ref_rand_tensor(ctx, KILN_SHAPE(C), seed + 4, &REF_GEN(-1, 1), 1, NULL)};
  kiln_tensor *g = ref_rand_tensor(ctx, ys, seed + 5, &REF_GEN(-1, 1), 0, NULL);
  kiln_conv2d_options same = {.pad_h = 1, .pad_w = 1};
  kiln_conv2d_options second = {.stride_h = stride, .stride_w = stride, .pad_h = 1, .pad_w = 1};
  for (int s = 0; s < 2; s++) {
    for (int q = 0; q < 5; q++)
      kiln_tensor_zero_grad(p[q]);
    kiln_step_begin(ctx);
    kiln_autocast_begin(ctx, KILN_DTYPE_BF16);
    kiln_tensor *h = kiln_conv2d(p[0], p[1], NULL, &same);
    h = kiln_relu(kiln_batch_norm(h, p[3], p[4], NULL, NULL, 1, 0.1f, 1e-5f));
    kiln_tensor *y = kiln_cast(kiln_conv2d(h, p[2], NULL, &second), KILN_DTYPE_F32);
    kiln_autocast_end(ctx);
    kiln_tensor *loss = kiln_sum(kiln_mul(y, g), KILN_ALL_AXES, 0);
    cr_assert_eq(kiln_backward(loss), KILN_OK, "%lld channels: %s", (long long)C, th_err(ctx));
    cr_assert_eq(kiln_step_end(ctx), KILN_OK, "%lld channels: %s", (long long)C, th_err(ctx));
  }
  for (int q = 0; q < 5; q++) {
    out[q] = ref_read_f32(ctx, kiln_tensor_grad(p[q]), "a gradient");
    kiln_tensor_free(p[q]);
  }
  kiln_tensor_free(g);
  th_ctx_free(ctx);
}

/* Asserts that switch `var` set to `on` changes none of block_grads' five gradients over images
 * img, at each of the nc channel counts, the second convolution at `stride`. */
static void block_unchanged_at(const char *var, const char *on, const int64_t img[3],
                               const int64_t *channels, int nc, int stride, uint64_t seed) {
  const char *names[5] = {"x", "w1", "w2", "the norm's weight", "the norm's bias"};
  for (int c = 0; c < nc; c++) {
    int64_t C = channels[c], n[5] = {img[0] * img[1] * img[2] * C, C * C * 9, C * C * 9, C, C};
    float *off[5], *got[5];
    block_grads(var, C, img, stride, "0", seed + 10 * c, off);
    block_grads(var, C, img, stride, on, seed + 10 * c, got);
    for (int q = 0; q < 5; q++) {
      cr_assert_eq(memcmp(got[q], off[q], (size_t)n[q] * sizeof(float)), 0,
                   "%s=%s, %lld channels, stride %d: %s's gradient differs", var, on, (long long)C,
                   stride, names[q]);
      free(got[q]);
      free(off[q]);
    }
  }
}

/* block_unchanged_at "1" on 8 images of 12x10, over 32 channels (cp.async products) and 64
 * (TMA-fed). */
static void block_unchanged(const char *var, int stride, uint64_t seed) {
  block_unchanged_at(var, "1", (const int64_t[]){8, 12, 10}, (const int64_t[]){32, 64}, 2, stride,
                     seed);
}

/* KILN_CONV_DGRAD_WS=1 and =2 (a stride-1 TMA data gradient with an epilogue on persistent
 * blocks, one an SM, two warpgroups multiplying, two more running the epilogue of the tile staged
 * before in one room or in one of two, numbered as the two-block kernel's threads) change no value:
 * the five gradients of the conv, norm, ReLU, conv block bitwise those without it, over 64
 * channels (tiles 64 wide) and 256 (two tiles of 128 across), on 64 images of 24x24 (288 and 576
 * tiles: every block takes two or more, its stages and rooms carried from tile to tile) and 8 of
 * 12x10 (8 and 16 tiles: one a block), in replayed step graphs. */
Test(gpu_ops, conv2d_data_gradients_store_on_warps_of_their_own) {
  const int64_t channels[2] = {64, 256};
  for (int rooms = 1; rooms <= 2; rooms++) {
    const char *on = rooms == 1 ? "1" : "2";
    block_unchanged_at("KILN_CONV_DGRAD_WS", on, (const int64_t[]){64, 24, 24}, channels, 2, 1,
                       8100);
    block_unchanged_at("KILN_CONV_DGRAD_WS", on, (const int64_t[]){8, 12, 10}, channels, 2, 1,
                       8200);
  }
}

/* KILN_CONV_RECOMPUTE_INPUT=1 (a convolution's input that is the ReLU of a batch norm is recorded
 * again for its weight gradient, from the norm's input, instead of kept from the forward pass)
 * changes no value: the five gradients of a conv, norm, ReLU, conv block bitwise those without it,
 * over 32 channels (cp.async products) and 64 (TMA-fed), in a replayed step graph. */
Test(gpu_ops, conv2d_input_recomputed_from_its_batch_norm) {
  block_unchanged("KILN_CONV_RECOMPUTE_INPUT", 1, 6200);
}

/* KILN_IM2COL_ROWS=1 (the image's blocks, and the filters', gathered a row a thread: 2x2 taps of
 * 3 channels and 4 zeros, instead of a value a thread) changes no value: two strided convolutions
 * over RGB on blocks (ResNet's stem, 7x7 at stride 2, and a 3x3), their three results bitwise
 * those without it. */
Test(gpu_ops, conv2d_blocks_gathered_a_row_a_thread) {
  static const conv_case stems[] = {
      {"3->64 7x7 stride 2 pad 3 (ResNet's stem)", 2, 21, 18, 3, 64, 7, 7,
       CO(.stride_h = 2, .stride_w = 2, .pad_h = 3, .pad_w = 3), 0, 0, 0},
      {"3->32 3x3 stride 2 pad 1", 3, 15, 17, 3, 32, 3, 3,
       CO(.stride_h = 2, .stride_w = 2, .pad_h = 1, .pad_w = 1), 0, 0, 0}};
  for (size_t i = 0; i < sizeof stems / sizeof *stems; i++)
    switch_changes_nothing(&stems[i], "KILN_IM2COL_ROWS", 6300 + 10 * i);
}

/* For case c in bf16, in a context made with switch `var` set to `on`: the second of two
 * steps (a step graph's capture, then its replay) of y = max_pool2d(conv2d(x, w)), 2x2 windows at
 * stride 2, and loss = sum(y g): y as f32 (read as g's gradient: the loss consumes y, whose memory
 * the step graph's plan gives to later values) and x's and w's gradients (out[0..2]), then a
 * forward step without gradients (no window positions written): its y (out[3]). malloc'd, n[q]
 * values. */
static void pooled_results(const conv_case *c, const char *var, const char *on, uint64_t seed,
                           float *out[4], int64_t n[4]) {
  setenv(var, on, 1); /* read when the context is made */
  TH_GPU_CTX(ctx);
  unsetenv(var);
  ref_win g = conv_win(c);
  kiln_shape xs = KILN_SHAPE(c->n, c->h, c->w, c->cin);
  kiln_shape ws = KILN_SHAPE(c->cout, c->cin, c->kh, c->kw), os = ref_win_out(xs, &g, c->cout);
  kiln_shape ps = KILN_SHAPE(c->n, os.d[1] / 2, os.d[2] / 2, c->cout);
  kiln_tensor *x = ref_rand_tensor(ctx, xs, seed, &REF_GEN(-1, 1), 1, NULL);
  kiln_tensor *w = ref_rand_tensor(ctx, ws, seed + 1, &REF_GEN(-1, 1), 1, NULL);
  kiln_tensor *gy = ref_rand_tensor(ctx, ps, seed + 2, &REF_GEN(-1, 1), 0, NULL);
  kiln_pool2d_options two = {.kernel_h = 2, .kernel_w = 2};
  for (int s = 0; s < 3; s++) {
    bool grads = s < 2;
    kiln_tensor_set_requires_grad(x, grads);
    kiln_tensor_set_requires_grad(w, grads);
    kiln_tensor_set_requires_grad(gy, grads);
    if (grads) {
      kiln_tensor_zero_grad(x);
      kiln_tensor_zero_grad(w);
      kiln_tensor_zero_grad(gy);
    }
    kiln_step_begin(ctx);
    kiln_autocast_begin(ctx, KILN_DTYPE_BF16);
    kiln_tensor *y =
        kiln_cast(kiln_max_pool2d(kiln_conv2d(x, w, NULL, &c->o), &two), KILN_DTYPE_F32);
    kiln_autocast_end(ctx);
    cr_assert_not_null(y, "%s: %s", c->desc, th_err(ctx));
    if (grads)
      cr_assert_eq(kiln_backward(kiln_sum(kiln_mul(y, gy), KILN_ALL_AXES, 0)), KILN_OK, "%s: %s",
                   c->desc, th_err(ctx));
    cr_assert_eq(kiln_step_end(ctx), KILN_OK, "%s: %s", c->desc, th_err(ctx));
    if (s == 1) out[0] = ref_read_f32(ctx, kiln_tensor_grad(gy), "y (g's gradient)");
    if (s == 2) out[3] = ref_read_f32(ctx, y, "y"); /* the step's output: read after its end */
  }
  out[1] = ref_read_f32(ctx, kiln_tensor_grad(x), "x's gradient");
  out[2] = ref_read_f32(ctx, kiln_tensor_grad(w), "w's gradient");
  n[0] = n[3] = ref_numel(ps), n[1] = ref_numel(xs), n[2] = ref_numel(ws);
  kiln_tensor_free(x);
  kiln_tensor_free(w);
  kiln_tensor_free(gy);
  th_ctx_free(ctx);
}

/* Asserts that switch `var` changes none of pooled_results' four results on the n cases. */
static void pooling_changes_nothing(const conv_case *cases, size_t ncases, const char *var,
                                    uint64_t seed) {
  const char *names[4] = {"y", "x's gradient", "w's gradient", "y without gradients"};
  for (size_t i = 0; i < ncases; i++) {
    float *off[4], *on[4];
    int64_t n[4];
    pooled_results(&cases[i], var, "0", seed + 10 * i, off, n);
    pooled_results(&cases[i], var, "1", seed + 10 * i, on, n);
    for (int q = 0; q < 4; q++) {
      cr_assert_eq(memcmp(on[q], off[q], (size_t)n[q] * sizeof(float)), 0, "%s, %s: %s differs",
                   cases[i].desc, var, names[q]);
      free(on[q]);
      free(off[q]);
    }
  }
}

/* KILN_CONV_FEW_POOL=1 (a 2x2 max pool after a halo-tile forward product pooled in its epilogue,
 * its window positions written there for its gradient) changes no value: the pooled image, both
 * gradients and a forward pass without gradients bitwise the pool's own kernel's, on the few
 * cases (odd sizes: the last row or column dropped; both tilings), in a replayed step graph. */
Test(gpu_ops, conv2d_few_channel_products_pool_in_their_epilogue) {
  pooling_changes_nothing(few_cases, sizeof few_cases / sizeof *few_cases, "KILN_CONV_FEW_POOL",
                          6400);
}

/* KILN_CONV_TMA_POOL=1 (the same after a TMA-fed forward product, its blocks pairs of whole
 * output rows) changes no value either, on the TMA cases (strides, dilation, 72 channels, 3x3
 * and 7x7 outputs, copies of 8 or 16 pixels a row) and on rows copied 32 and 64 pixels at a time
 * (one or two pairs of rows a block), with KILN_CONV_FPROP_BN at its default (tiles of at most
 * 128 two blocks an SM), at 0 (one block an SM) and at 128 (tiles of 128). The TMA-fed kernels are
 * sm_90a's. */
Test(gpu_ops, conv2d_tma_products_pool_in_their_epilogue) {
  skip_unless_sm90();
  const conv_case wide[] = {
      {"64->64 3x3 pad 1 on 6x33 images (copies of 32 pixels)", 2, 6, 33, 64, 64, 3, 3,
       CO(.pad_h = 1, .pad_w = 1), 0, 0, 0},
      {"64->128 3x3 pad 1 on 5x40 images (copies of 64 pixels)", 3, 5, 40, 64, 128, 3, 3,
       CO(.pad_h = 1, .pad_w = 1), 0, 0, 0},
  };
  const size_t n = sizeof tma_cases / sizeof *tma_cases;
  pooling_changes_nothing(tma_cases, n, "KILN_CONV_TMA_POOL", 6600);
  pooling_changes_nothing(wide, 2, "KILN_CONV_TMA_POOL", 6650);
  const char *widths[2] = {"0", "128"};
  for (int i = 0; i < 2; i++) {
    setenv("KILN_CONV_FPROP_BN", widths[i], 1); /* read when each context is made */
    pooling_changes_nothing(tma_cases, n, "KILN_CONV_TMA_POOL", 6700 + 100 * i);
    pooling_changes_nothing(wide, 2, "KILN_CONV_TMA_POOL", 6750 + 100 * i);
  }
  unsetenv("KILN_CONV_FPROP_BN");
}

/* For case c in bf16 with x given no gradient (an image), in a context made with the environment
 * variable `var` set to `on`: after the second of two steps (a step graph's capture, then its
 * replay) of loss = sum(y g), y = relu(batch_norm(conv2d(x, w))) in training, with pool then max
 * pooled as ResNet's stem is (3x3 at stride 2, padding 1), the gradients of w and of the norm's
 * weight and bias and y (as g's gradient: the loss consumes y, whose memory the step graph's plan
 * gives to later values), out[0..3]; then y of a forward step without gradients (no window
 * positions written), out[4]. malloc'd f32, n[q] values. */
static void normed_results(const conv_case *c, const char *var, const char *on, bool pool,
                           uint64_t seed, float *out[5], int64_t n[5]) {
  setenv(var, on, 1); /* read when the context is made */
  TH_GPU_CTX(ctx);
  unsetenv(var);
  ref_win g = conv_win(c);
  kiln_shape xs = KILN_SHAPE(c->n, c->h, c->w, c->cin), os = ref_win_out(xs, &g, c->cout);
  kiln_pool2d_options stem = {
      .kernel_h = 3, .kernel_w = 3, .stride_h = 2, .stride_w = 2, .pad_h = 1, .pad_w = 1};
  if (pool) os = KILN_SHAPE(c->n, (os.d[1] + 1) / 2, (os.d[2] + 1) / 2, c->cout);
  kiln_tensor *x = ref_rand_tensor(ctx, xs, seed, &REF_GEN(-1, 1), 0, NULL);
  kiln_tensor *p[4] = {
      ref_rand_tensor(ctx, KILN_SHAPE(c->cout, c->cin, c->kh, c->kw), seed + 1,
                      &REF_GEN(-0.3f, 0.3f), 1, NULL),
      ref_rand_tensor(ctx, KILN_SHAPE(c->cout), seed + 2, &REF_GEN(0.5f, 1.5f), 1, NULL),
      ref_rand_tensor(ctx, KILN_SHAPE(c->cout), seed + 3, &REF_GEN(-1, 1), 1, NULL),
      ref_rand_tensor(ctx, os, seed + 4, &REF_GEN(-1, 1), 1, NULL)}; /* g */
  for (int s = 0; s < 3; s++) {
    bool grads = s < 2;
    for (int q = 0; q < 4; q++) {
      kiln_tensor_set_requires_grad(p[q], grads);
      if (grads) kiln_tensor_zero_grad(p[q]);
    }
    kiln_step_begin(ctx);
    kiln_autocast_begin(ctx, KILN_DTYPE_BF16);
    kiln_tensor *h = kiln_conv2d(x, p[0], NULL, &c->o);
    h = kiln_relu(kiln_batch_norm(h, p[1], p[2], NULL, NULL, 1, 0.1f, 1e-5f));
    if (pool) h = kiln_max_pool2d(h, &stem);
    kiln_tensor *y = kiln_cast(h, KILN_DTYPE_F32);
    kiln_autocast_end(ctx);
    cr_assert_not_null(y, "%s: %s", c->desc, th_err(ctx));
    if (grads)
      cr_assert_eq(kiln_backward(kiln_sum(kiln_mul(y, p[3]), KILN_ALL_AXES, 0)), KILN_OK, "%s: %s",
                   c->desc, th_err(ctx));
    cr_assert_eq(kiln_step_end(ctx), KILN_OK, "%s: %s", c->desc, th_err(ctx));
    if (s == 2) out[4] = ref_read_f32(ctx, y, "y"); /* the step's output: read after its end */
  }
  for (int q = 0; q < 4; q++) {
    out[q] = ref_read_f32(ctx, kiln_tensor_grad(p[q]), "a gradient");
    n[q] = kiln_tensor_numel(p[q]);
    kiln_tensor_free(p[q]);
  }
  n[4] = n[3];
  kiln_tensor_free(x);
  th_ctx_free(ctx);
}

/* Asserts that switch `var` changes none of normed_results' five results on the n cases. */
static void norm_block_unchanged(const conv_case *cases, size_t ncases, const char *var, bool pool,
                                 uint64_t seed) {
  const char *names[5] = {"w's gradient", "the norm's weight's gradient",
                          "the norm's bias's gradient", "y", "y without gradients"};
  for (size_t i = 0; i < ncases; i++) {
    float *off[5], *on[5];
    int64_t n[5];
    normed_results(&cases[i], var, "0", pool, seed + 10 * i, off, n);
    normed_results(&cases[i], var, "1", pool, seed + 10 * i, on, n);
    for (int q = 0; q < 5; q++) {
      cr_assert_eq(memcmp(on[q], off[q], (size_t)n[q] * sizeof(float)), 0, "%s, %s: %s differs",
                   cases[i].desc, var, names[q]);
      free(on[q]);
      free(off[q]);
    }
  }
}

/* ResNet's stem, 3->64 7x7 at stride 2 (on its blocks), on small odd images. */
static const conv_case stem_case = {
    "3->64 7x7 stride 2 pad 3 (ResNet's stem) on 45x38 images", 3, 45, 38, 3, 64, 7, 7,
    CO(.stride_h = 2, .stride_w = 2, .pad_h = 3, .pad_w = 3),   0, 0,  0};

/* KILN_CONV_FEW_PROLOGUE (on: a halo-tile weight gradient computes its dY, batch norm's dx, as
 * it loads it, from the run that would have written it) changes no value: the filters' and the
 * norm's gradients and y of a conv, norm, ReLU block over an image bitwise those without it, on the
 * few cases and ResNet's stem, in a replayed step graph. */
Test(gpu_ops, conv2d_few_channel_weight_gradients_compute_their_dy) {
  conv_case cases[sizeof few_cases / sizeof *few_cases + 1];
  memcpy(cases, few_cases, sizeof few_cases);
  cases[sizeof cases / sizeof *cases - 1] = stem_case;
  norm_block_unchanged(cases, sizeof cases / sizeof *cases, "KILN_CONV_FEW_PROLOGUE", false, 7000);
}

/* KILN_POOL_FWD_PROLOGUE (on: a max pool computes its image, batch norm's application and the
 * ReLU, as it reads it, from the run that would have written it) changes no value: the same five
 * results through ResNet's stem pool (3x3 at stride 2, padding 1) after the block, on ResNet's
 * stem and two of the few cases (odd and even image sizes), in a replayed step graph, and a
 * forward step without gradients (a pool without positions). */
Test(gpu_ops, max_pools_compute_their_image_as_they_read_it) {
  const conv_case cases[3] = {stem_case, few_cases[1], few_cases[3]};
  norm_block_unchanged(cases, 3, "KILN_POOL_FWD_PROLOGUE", true, 7500);
}

/* KILN_WINDOW_AHEAD (on: the epilogue of a window gradient, a max pool's a block of 2x2 pixels a
 * thread or a col2im's, fetches what it reads before the op's own loads) changes no value, with
 * batch norm's backward sums in those kernels (KILN_WINDOW_MOMENTS, on) and without: the five
 * results of normed_results through ResNet's stem pool over images of even sides (ResNet's stem
 * and a TMA-fed 3x3), and the five gradients of a conv, norm, ReLU, stride-2 conv block (its data
 * gradient's col2im), bitwise, in replayed step graphs. */
Test(gpu_ops, window_gradients_fetch_their_epilogue_operands_ahead) {
  static const conv_case even[] = {
      {"3->64 7x7 stride 2 pad 3 (ResNet's stem) on 44x40 images", 3, 44, 40, 3, 64, 7, 7,
       CO(.stride_h = 2, .stride_w = 2, .pad_h = 3, .pad_w = 3), 0, 0, 0},
      {"64->64 3x3 pad 1 on 16x12 images", 2, 16, 12, 64, 64, 3, 3, CO(.pad_h = 1, .pad_w = 1), 0,
       0, 0}};
  for (int sums = 1; sums >= 0; sums--) {
    setenv("KILN_WINDOW_MOMENTS", sums ? "1" : "0", 1); /* read when each context is made */
    norm_block_unchanged(even, 2, "KILN_WINDOW_AHEAD", true, 7700 + 100 * sums);
    block_unchanged("KILN_WINDOW_AHEAD", 2, 7900 + 100 * sums);
  }
  unsetenv("KILN_WINDOW_MOMENTS");
}
