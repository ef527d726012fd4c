/*
 * test_cpu_nvrtc.c: code generation and NVRTC without a GPU: every generated kernel of every op
 * compiles, unfused and fused; the disk cache is reused by a second context and a truncated or
 * corrupted entry is rebuilt, never loaded; KILN_DUMP_KERNELS writes the device files and each
 * kernel's source, which lists its trace nodes.
 */
#include <string.h>

#include "../examples/custom_linear_relu.h"
#include "fusion/fusion.h"
#include "inspect.h"

TestSuite(nvrtc, .fini = th_remove_tmpdirs);

/* Points KILN_CACHE_DIR at a fresh temporary directory (before any context is made). */
static void fresh_cache_dir(char *buf, size_t n) {
  th_tmpdir(buf, n, "cache");
  cr_assert_eq(setenv("KILN_CACHE_DIR", buf, 1), 0);
  unsetenv("KILN_DUMP_KERNELS");
}

/* The kernels a compile of the pending nodes looks up: one per node, none for views and
 * matmuls (cuBLAS), one per input for a concat. */
static uint64_t pending_kernels(kiln_ctx *ctx) {
  uint64_t k = 0;
  for (int32_t i = ctx->trace.done; i < ctx->trace.n; i++) {
    kiln__node *n = &ctx->trace.nodes[i];
    kiln__kind kind = kiln__ops[n->op].kind;
    if (kind == KILN__KIND_VIEW || kind == KILN__KIND_MATMUL) continue;
    k += n->op == KILN__OP_CONCAT ? (uint64_t)n->nin : 1;
  }
  return k;
}

static void compile_ok(kiln_ctx *ctx) {
  kiln_status s = kiln__engine_compile(ctx, ctx->trace.done, ctx->trace.n);
  cr_assert_eq(s, KILN_OK, "kiln__engine_compile: %s", kiln_ctx_error(ctx));
  th_assert_ok(ctx);
}

/* A persistent f32 tensor that requires grad, for a parameter list to own. */
static kiln_tensor *owned_param(kiln_ctx *ctx, kiln_shape s) {
  kiln_tensor *t = th_new(ctx, KILN_DTYPE_F32, s);
  kiln_tensor_set_requires_grad(t, 1);
  cr_assert(kiln_tensor_requires_grad(t));
  return t;
}

#define TH_ZOO_OPTIMS 9 /* the optimizers the op zoo steps */

/* One of each op outside the MLP step, a loss over all of them, two backward passes (assign,
 * then accumulate) and Adam, AdamW, plain and damped SGD and Muon steps, each of Adam, SGD and
 * Muon once more skipping non-finite steps (the guarded updates and found_inf). */
static void record_op_zoo(kiln_ctx *ctx, kiln_params *q, kiln_optim **os) {
  kiln_tensor *a = owned_param(ctx, KILN_SHAPE(4, 5, 6)), *b = owned_param(ctx, KILN_SHAPE(5, 6));
  kiln_tensor *c = owned_param(ctx, KILN_SHAPE(8, 600)); /* columns reduce one per thread */
  cr_assert_eq(kiln_params_add(q, "a", a), KILN_OK);
  cr_assert_eq(kiln_params_add(q, "b", b), KILN_OK);
  cr_assert_eq(kiln_params_add(q, "c", c), KILN_OK);
  kiln_tensor *idx = th_i32(ctx, KILN_SHAPE(3));
  kiln_tensor *pos = kiln_add_scalar(kiln_mul(a, a), 1.f); /* > 0 for log, sqrt, pow */
  kiln_tensor *t[96];
  int n = 0;
  t[n++] = kiln_softmax(a, -1);
  t[n++] = kiln_softmax(a, 1);
  t[n++] = kiln_log_softmax(a, 0);
  t[n++] = kiln_gelu(a, KILN_GELU_ERF);
  t[n++] = kiln_gelu(a, KILN_GELU_TANH);
  t[n++] = kiln_sigmoid(a);
  t[n++] = kiln_tanh(a);
  t[n++] = kiln_clamp(a, -0.5f, 0.5f);
  t[n++] = kiln_where(kiln_gt(a, b), a, b);
  t[n++] = kiln_maximum(a, b);
  t[n++] = kiln_minimum(b, a);
  t[n++] = kiln_pow_scalar(pos, 1.5f);
  t[n++] = kiln_pow_scalar(a, 2.f);
  t[n++] = kiln_rsqrt(pos);
  t[n++] = kiln_sqrt(pos);
  t[n++] = kiln_exp(a);
  t[n++] = kiln_log(pos);
  t[n++] = kiln_neg(a);
  t[n++] = kiln_div(a, kiln_add_scalar(kiln_mul(b, b), 1.f));
  t[n++] = kiln_sub(b, a);
  t[n++] = kiln_mul_scalar(a, -3.f);
  t[n++] = kiln_abs(a);
  t[n++] = kiln_leaky_relu(a, 0.2f);
  t[n++] = kiln_silu(a);
  t[n++] = kiln_softplus(a, 2.f, 15.f);
  t[n++] = kiln_erf(a);
  t[n++] = kiln_std(a, KILN_AXES(1), 1, 0);
  t[n++] = kiln_bce_with_logits(a, kiln_sigmoid(kiln_mul_scalar(a, 0.5f)), KILN_REDUCTION_MEAN);
  /* reductions over several axis sets, innermost and not */
  t[n++] = kiln_max(a, KILN_AXES(0), 0);
  t[n++] = kiln_max(a, KILN_AXES(1), 1);
  t[n++] = kiln_max(a, KILN_AXES(0, 2), 0);
  t[n++] = kiln_max(a, KILN_ALL_AXES, 0);
  t[n++] = kiln_sum(a, KILN_AXES(1), 1);
  t[n++] = kiln_sum(a, KILN_AXES(0, 1), 0);
  t[n++] = kiln_sum(a, KILN_AXES(1, 2), 1);
  t[n++] = kiln_mean(a, KILN_AXES(0), 0);
  t[n++] = kiln_mean(a, KILN_AXES(2), 1);
  t[n++] = kiln_mean(a, KILN_ALL_AXES, 0);
  t[n++] = kiln_sum(c, KILN_AXES(0), 0);
  t[n++] = kiln_max(c, KILN_AXES(0), 1);
  t[n++] = kiln_mean(c, KILN_AXES(1), 0);
  /* movement */
  kiln_tensor *cat2[2] = {a, kiln_slice(a, 1, 1, 5, 2)};
  t[n++] = kiln_concat(2, cat2, 1);
  t[n++] = kiln_slice(a, 2, 1, 6, 2);
  t[n++] = kiln_slice(kiln_transpose(a, 0, 2), 0, -4, -1, 2);
  t[n++] = kiln_contiguous(kiln_transpose(a, 0, 2));
  t[n++] = kiln_mul(kiln_expand(kiln_reshape(b, KILN_SHAPE(1, 5, 6)), KILN_SHAPE(4, 5, 6)), a);
  t[n++] = kiln_mul(kiln_detach(a), a);
  t[n++] = kiln_matmul(a, kiln_transpose(b, 0, 1)); /* (4,5,6) x (6,5) */
  t[n++] = kiln_dropout(a, 0.25f, 1);
  /* no gradient through these, but their kernels compile all the same */
  t[n++] = kiln_eq(a, b);
  t[n++] = kiln_ne(a, b);
  t[n++] = kiln_lt(a, b);
  t[n++] = kiln_le(a, b);
  t[n++] = kiln_ge(a, b);
  t[n++] = kiln_cast(kiln_argmax(a, -1, 0), KILN_DTYPE_F32);
  t[n++] = kiln_cast(kiln_argmax(a, 0, 1), KILN_DTYPE_F32);
  t[n++] = kiln_cast(kiln_argmax(c, 0, 0), KILN_DTYPE_F32);
  t[n++] = kiln_cast(kiln_cast(a, KILN_DTYPE_I32), KILN_DTYPE_F32);
  t[n++] = kiln_index_select(a, idx);
  t[n++] = kiln_cast(kiln_index_select(kiln_cast(b, KILN_DTYPE_I32), idx), KILN_DTYPE_F32);
  /* i32 comparisons (f32 results) and exact i32 sums, by rows, columns and whole */
  kiln_tensor *am = kiln_argmax(a, -1, 0); /* (4, 5) i32 */
  t[n++] = kiln_eq(am, kiln_argmax(kiln_neg(a), -1, 0));
  t[n++] = kiln_lt(am, kiln_sum(a, KILN_AXES(2), 0));
  t[n++] = kiln_cast(kiln_sum(am, KILN_AXES(1), 0), KILN_DTYPE_F32);
  t[n++] = kiln_cast(kiln_sum(am, KILN_AXES(0), 1), KILN_DTYPE_F32);
  t[n++] = kiln_cast(kiln_sum(kiln_cast(c, KILN_DTYPE_I32), KILN_ALL_AXES, 0), KILN_DTYPE_F32);
  /* random tensors */
  t[n++] = kiln_mul(kiln_rand(ctx, KILN_SHAPE(4, 5, 6)), a);
  t[n++] = kiln_mul(kiln_randn(ctx, KILN_SHAPE(5, 6)), b);
  kiln_tensor *icat[2] = {idx, idx};
  t[n++] = kiln_cast(kiln_concat(2, icat, 0), KILN_DTYPE_F32);
  /* images: convolutions (grouped, strided, padded, dilated; pointwise) and pooling */
  kiln_tensor *img = owned_param(ctx, KILN_SHAPE(2, 7, 6, 4));
  kiln_tensor *cw = owned_param(ctx, KILN_SHAPE(6, 2, 3, 3)), *cb = owned_param(ctx, KILN_SHAPE(6));
  kiln_tensor *pw = owned_param(ctx, KILN_SHAPE(3, 4, 1, 1));
  cr_assert_eq(kiln_params_add(q, "img", img), KILN_OK);
  cr_assert_eq(kiln_params_add(q, "cw", cw), KILN_OK);
  cr_assert_eq(kiln_params_add(q, "cb", cb), KILN_OK);
  cr_assert_eq(kiln_params_add(q, "pw", pw), KILN_OK);
  t[n++] = kiln_conv2d(
      img, cw, cb,
      &(kiln_conv2d_options){.stride_h = 2, .pad_h = 1, .pad_w = 2, .dilation_w = 2, .groups = 2});
  t[n++] = kiln_conv2d(img, pw, NULL, NULL);
  t[n++] = kiln_max_pool2d(
      img, &(kiln_pool2d_options){.kernel_h = 3, .kernel_w = 2, .stride_h = 2, .pad_h = 1});
  t[n++] = kiln_avg_pool2d(img, &(kiln_pool2d_options){.kernel_h = 2, .kernel_w = 2});
  t[n++] = kiln_max_pool2d(kiln_slice(img, 1, 0, 6, 1), /* windows that tile the image */
                           &(kiln_pool2d_options){.kernel_h = 2, .kernel_w = 3});
  /* augmentation of data (detached: it carries no gradient) */
  t[n++] = kiln_augment(kiln_detach(img), &(kiln_augment_options){
                                              .pad = 1,
                                              .border = KILN_AUGMENT_BORDER_REFLECT,
                                              .flip = KILN_AUGMENT_FLIP_RANDOM,
                                          });
  t[n++] = kiln_augment(
      kiln_detach(img),
      &(kiln_augment_options){.flip = KILN_AUGMENT_FLIP_ALL, .shift_h = -1, .shift_w = 2});
  /* an image loader's batch to the network's input: pixels and their table, f32 and bf16 */
  kiln_tensor *pixels = th_i32(ctx, KILN_SHAPE(300)),
              *table = th_i32(ctx, KILN_SHAPE(2, KILN__RESIZE_COLS));
  static const float mean[3] = {0.5f, 0.4f, 0.3f}, std[3] = {0.2f, 0.25f, 0.3f};
  t[n++] = kiln__resize_crop(pixels, table, 7, 5, mean, std, KILN_DTYPE_F32, "test");
  t[n++] = kiln__resize_crop(pixels, table, 4, 6, mean, std, KILN_DTYPE_BF16, "test");
  t[n++] = kiln_avg_pool2d(img, &(kiln_pool2d_options){.kernel_h = 3,
                                                       .kernel_w = 3,
                                                       .stride_h = 1,
                                                       .stride_w = 1,
                                                       .pad_h = 1,
                                                       .pad_w = 1,
                                                       .exclude_pad = 1});
  /* batch norm: the batch's statistics (and their running estimates), and given ones */
  kiln_tensor *rm = th_new(ctx, KILN_DTYPE_F32, KILN_SHAPE(4)),
              *rv = th_new(ctx, KILN_DTYPE_F32, KILN_SHAPE(4));
  kiln_tensor *bw = owned_param(ctx, KILN_SHAPE(4));
  cr_assert_eq(kiln_params_add(q, "bw", bw), KILN_OK);
  cr_assert_eq(kiln_params_add_buffer(q, "rm", rm), KILN_OK);
  cr_assert_eq(kiln_params_add_buffer(q, "rv", rv), KILN_OK);
  t[n++] = kiln_batch_norm(img, bw, NULL, rm, rv, 1, 0.1f, 1e-5f);
  t[n++] = kiln_batch_norm(img, NULL, bw, rm, rv, 0, 0.1f, 1e-5f);
  /* a custom op, the example's linear + ReLU, whose backward is three more */
  static custom_linear_relu lin;
  cr_assert_eq(custom_linear_relu_new(ctx, &lin), KILN_OK, "%s", kiln_ctx_error(ctx));
  t[n++] = kiln_custom(
      lin.fwd,
      (kiln_tensor *[]){kiln_reshape(a, KILN_SHAPE(20, 6)), b, kiln_sum(b, KILN_AXES(1), 0)}, NULL);
  kiln_tensor *loss = kiln_full(ctx, KILN_SCALAR_SHAPE, 0.f);
  for (int i = 0; i < n; i++) {
    cr_assert_not_null(t[i], "op zoo term %d: %s", i, kiln_ctx_error(ctx));
    loss = kiln_add(loss, th_sum_all(t[i]));
  }
  cr_assert_not_null(loss, "%s", kiln_ctx_error(ctx));
  /* the first backward assigns the gradients, a second loss's accumulates into them (the same
   * loss twice is an error) */
  cr_assert_eq(kiln_backward(loss), KILN_OK, "kiln_backward: %s", kiln_ctx_error(ctx));
  cr_assert_eq(kiln_backward(kiln_mul_scalar(loss, 0.5f)), KILN_OK, "second kiln_backward: %s",
               kiln_ctx_error(ctx));
  /* clipping: the norm's sums and one multi-tensor scale of every gradient */
  cr_assert_not_null(kiln_clip_grad_norm(q, 1.f), "kiln_clip_grad_norm: %s", kiln_ctx_error(ctx));

  os[0] = kiln_adam_new(q, NULL);
  os[1] = kiln_adamw_new(q, NULL);
  os[2] = kiln_sgd_new(q, &(kiln_sgd_options){.lr = 0.1f, .weight_decay = 1e-3f});
  os[3] = kiln_sgd_new(q, &(kiln_sgd_options){.lr = 0.1f, .momentum = 0.5f, .dampening = 0.1f});
  /* Muon on the matrices (its 1-dim parameters excluded), normalising the weights first */
  os[4] = kiln_muon_new(q, &(kiln_muon_options){.ns_steps = 2, .normalize_weight = 1});
  cr_assert_eq(
      kiln_optim_add_group(os[4], kiln_select_no_decay, NULL, &(kiln_param_group){.exclude = 1}), 2,
      "%s", kiln_ctx_error(ctx));
  os[5] = kiln_adam_new(q, NULL);
  os[6] = kiln_sgd_new(q, &(kiln_sgd_options){.lr = 0.1f});
  os[7] = kiln_sgd_new(q, &(kiln_sgd_options){.lr = 0.1f, .momentum = 0.9f, .nesterov = 1});
  os[8] = kiln_muon_new(q, &(kiln_muon_options){.ns_steps = 1, .normalize_weight = 1});
  cr_assert_eq(
      kiln_optim_add_group(os[8], kiln_select_no_decay, NULL, &(kiln_param_group){.exclude = 1}), 2,
      "%s", kiln_ctx_error(ctx));
  for (int i = 5; i < TH_ZOO_OPTIMS; i++)
    cr_assert_eq(kiln_optim_skip_nonfinite(os[i], 1), KILN_OK, "%s", kiln_ctx_error(ctx));
  for (int i = 0; i < TH_ZOO_OPTIMS; i++) {
    cr_assert_not_null(os[i], "%s", kiln_ctx_error(ctx));
    cr_assert_eq(kiln_optim_step(os[i]), KILN_OK, "%s", kiln_ctx_error(ctx));
  }
}

Test(nvrtc, every_generated_kernel_compiles, .timeout = 1200) {
  char cache[256];
  fresh_cache_dir(cache, sizeof cache);
  kiln_ctx *ctx = th_cpu_ctx();

  /* the benchmark MLP's step: 784-512-512-10, ReLU, SGD with Nesterov momentum */
  th_net m;
  th_net_init(&m, ctx, 128, 3, (int64_t[]){784, 512, 512, 10});
  th_net_backward(&m);
  kiln_sgd_options so = kiln_sgd_defaults(0.01f);
  so.momentum = 0.9f;
  so.nesterov = 1;
  kiln_optim *sgd = kiln_sgd_new(m.params, &so);
  cr_assert_not_null(sgd);
  cr_assert_eq(kiln_optim_step(sgd), KILN_OK);

  kiln_params *q = kiln_params_new(ctx);
  kiln_optim *os[TH_ZOO_OPTIMS]; /* freed after the compile: their state is in the trace */
  record_op_zoo(ctx, q, os);
  th_assert_ok(ctx);

  /* the trace holds every op of the table */
  bool seen[KILN__OP_COUNT] = {0};
  for (int32_t i = 0; i < th_tlen(ctx); i++)
    seen[th_node(ctx, i)->op] = true;
  for (int i = 0; i < KILN__OP_COUNT; i++)
    cr_assert(seen[i], "the op %s is missing from the compile test", kiln__ops[i].name);

  /* unfused first: one kernel per node, so every op's own kernel compiles */
  /* and each custom op's kernel, compiled when the op was made */
  uint64_t want = pending_kernels(ctx) + (uint64_t)ctx->ncustom;
  kiln_set_fusion(ctx, 0);
  compile_ok(ctx);
  kiln_exec_stats st;
  kiln_stats(ctx, &st);
  cr_assert_gt(st.kernels_compiled, 0u);
  cr_assert_eq(st.disk_hits, 0u, "a fresh cache directory had hits");
  cr_assert_eq(st.kernels_compiled + st.cache_hits, want,
               "%llu compiled + %llu cache hits for %llu kernel lookups",
               (unsigned long long)st.kernels_compiled, (unsigned long long)st.cache_hits,
               (unsigned long long)want);
  cr_assert_gt(st.compile_ms, 0.0);
  cr_log_info("%d nodes, %llu kernels compiled, %llu memory cache hits, %.0f ms", th_tlen(ctx),
              (unsigned long long)st.kernels_compiled, (unsigned long long)st.cache_hits,
              st.compile_ms);
  cr_assert_eq(st.nodes_executed, 0u, "a no-GPU context ran nodes");
  char files[1][1200];
  cr_assert_eq((uint64_t)th_list_files(cache, ".cubin", files, 1), st.kernels_compiled,
               "one cache file per compiled kernel");
  /* then fused: the planner's kernels (chains, reductions with prologues) compile too */
  kiln_set_fusion(ctx, 1);
  compile_ok(ctx);
  kiln_exec_stats fused;
  kiln_stats(ctx, &fused);
  cr_assert_gt(fused.kernels_compiled, st.kernels_compiled, "fusion made no kernels of its own");
  cr_log_info("fused: %llu more kernels compiled",
              (unsigned long long)(fused.kernels_compiled - st.kernels_compiled));
  /* and fused with no product epilogues from the BLAS library: their work in generated kernels */
  kiln__blas_limit(ctx, 1u << KILN__EPI_NONE);
  compile_ok(ctx);
  kiln_exec_stats plain;
  kiln_stats(ctx, &plain);
  cr_assert_gt(plain.kernels_compiled, fused.kernels_compiled,
               "the fallback for epilogues made no kernels of its own");
  for (int i = 0; i < TH_ZOO_OPTIMS; i++)
    kiln_optim_free(os[i]);
  kiln_optim_free(sgd);
  kiln_params_free(q);
  th_net_free(&m);
  th_free_scratch();
  th_ctx_free(ctx);
  th_remove_dir(cache);
}

/* bf16 values through every kind of generated kernel: a mixed-precision conv net's step (an
 * autocast region: casts, bf16 products, im2col, pooling, batch norm, GELU and their gradients,
 * col2im), and bf16 elementwise chains, reductions, rows, gathers and concats. */
static void record_bf16_zoo(kiln_ctx *ctx, kiln_params *q) {
  kiln_tensor *img = th_f32(ctx, KILN_SHAPE(2, 6, 6, 4)), *lab = th_i32(ctx, KILN_SHAPE(2));
  kiln_tensor *w1 = owned_param(ctx, KILN_SHAPE(8, 4, 3, 3)),
              *w2 = owned_param(ctx, KILN_SHAPE(10, 8));
  kiln_tensor *bn = owned_param(ctx, KILN_SHAPE(8)), *bias = owned_param(ctx, KILN_SHAPE(10));
  kiln_tensor *rm = th_new(ctx, KILN_DTYPE_F32, KILN_SHAPE(8)),
              *rv = th_new(ctx, KILN_DTYPE_F32, KILN_SHAPE(8));
  cr_assert_eq(kiln_params_add(q, "w1", w1), KILN_OK);
  cr_assert_eq(kiln_params_add(q, "w2", w2), KILN_OK);
  cr_assert_eq(kiln_params_add(q, "bn", bn), KILN_OK);
  cr_assert_eq(kiln_params_add(q, "bias", bias), KILN_OK);
  cr_assert_eq(kiln_params_add_buffer(q, "rm", rm), KILN_OK);
  cr_assert_eq(kiln_params_add_buffer(q, "rv", rv), KILN_OK);
  kiln_autocast_begin(ctx, KILN_DTYPE_BF16);
  kiln_tensor *h = kiln_conv2d(img, w1, NULL, &(kiln_conv2d_options){.pad_h = 1, .pad_w = 1});
  h = kiln_max_pool2d(h, &(kiln_pool2d_options){.kernel_h = 2, .kernel_w = 2});
  h = kiln_gelu(kiln_batch_norm(h, bn, NULL, rm, rv, 1, 0.1f, 1e-5f), KILN_GELU_ERF);
  h = kiln_avg_pool2d(
      h, &(kiln_pool2d_options){
             .kernel_h = 3, .kernel_w = 3, .stride_h = 1, .stride_w = 1, .pad_h = 1, .pad_w = 1});
  kiln_tensor *g = kiln_global_max_pool2d(h); /* (2, 8) bf16 */
  kiln_tensor *logits =
      kiln_add(kiln_matmul(g, kiln_transpose(w2, 0, 1)), kiln_cast(bias, KILN_DTYPE_BF16));
  kiln_autocast_end(ctx);
  cr_assert_not_null(logits, "%s", kiln_ctx_error(ctx));
  cr_assert_eq(kiln_tensor_dtype(logits), KILN_DTYPE_BF16);
  kiln_tensor *loss = kiln_cross_entropy(logits, lab, KILN_REDUCTION_MEAN, 0.2f);
  /* plain bf16 values: chains, broadcasts, reductions along and across rows, a gather */
  kiln_tensor *x = kiln_cast(th_f32(ctx, KILN_SHAPE(5, 7)), KILN_DTYPE_BF16);
  kiln_tensor *y = kiln_mul(kiln_relu(kiln_add(x, x)),
                            kiln_cast(kiln_full(ctx, KILN_SHAPE(7), 2.f), KILN_DTYPE_BF16));
  kiln_tensor *t[] = {kiln_sum(y, KILN_AXES(0), 0),
                      kiln_max(y, KILN_AXES(1), 1),
                      kiln_softmax(y, 1),
                      kiln_layer_norm(y, NULL, NULL, 1e-5f),
                      kiln_cast(kiln_index_select(y, th_i32(ctx, KILN_SHAPE(3))), KILN_DTYPE_F32),
                      kiln_concat(2, (kiln_tensor *[]){y, y}, 0),
                      kiln_dropout(y, 0.3f, 1),
                      kiln_cast(kiln_argmax(y, 1, 0), KILN_DTYPE_BF16)};
  for (size_t i = 0; i < sizeof t / sizeof t[0]; i++) {
    cr_assert_not_null(t[i], "bf16 term %zu: %s", i, kiln_ctx_error(ctx));
    loss = kiln_add(loss, kiln_cast(th_sum_all(t[i]), KILN_DTYPE_F32));
  }
  cr_assert_eq(kiln_tensor_dtype(loss), KILN_DTYPE_F32);
  cr_assert_eq(kiln_backward(loss), KILN_OK, "kiln_backward: %s", kiln_ctx_error(ctx));
  for (int i = 0; i < 4; i++) { /* master weights: f32 gradients */
    kiln_tensor *p = kiln_params_get(q, i);
    cr_assert_eq(kiln_tensor_dtype(kiln_tensor_grad(p)), KILN_DTYPE_F32, "%s's gradient",
                 kiln_tensor_name(p));
  }
}

Test(nvrtc, bf16_kernels_compile, .timeout = 1200) {
  char cache[256];
  fresh_cache_dir(cache, sizeof cache);
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_params *q = kiln_params_new(ctx);
  record_bf16_zoo(ctx, q);
  th_assert_ok(ctx);
  kiln_set_fusion(ctx, 0);
  compile_ok(ctx);
  kiln_exec_stats st;
  kiln_stats(ctx, &st);
  cr_assert_gt(st.kernels_compiled, 20u);
  kiln_set_fusion(ctx, 1);
  compile_ok(ctx);
  kiln_exec_stats fused;
  kiln_stats(ctx, &fused);
  cr_assert_gt(fused.kernels_compiled, st.kernels_compiled, "fusion made no kernels of its own");
  kiln_params_free(q);
  th_free_scratch();
  th_ctx_free(ctx);
  th_remove_dir(cache);
}

/* A few distinct kernels: elementwise, broadcast, row and column reductions, an update. */
static void record_small(kiln_ctx *ctx) {
  kiln_tensor *w = th_param(ctx, KILN_SHAPE(16, 8)), *b = th_f32(ctx, KILN_SHAPE(8));
  kiln_tensor *h = kiln_relu(kiln_add(w, b));
  kiln_tensor *loss = kiln_add(th_sum_all(kiln_sum(h, KILN_AXES(0), 0)), th_sum_all(kiln_exp(h)));
  cr_assert_eq(kiln_backward(loss), KILN_OK, "%s", kiln_ctx_error(ctx));
}

static kiln_exec_stats compile_small_in_fresh_ctx(void) {
  kiln_ctx *ctx = th_cpu_ctx();
  record_small(ctx);
  compile_ok(ctx);
  kiln_exec_stats st;
  kiln_stats(ctx, &st);
  th_free_scratch();
  th_ctx_free(ctx);
  return st;
}

static void flip_byte(const char *path, long at) {
  size_t n;
  char *p = th_read_whole(path, &n);
  size_t k = at < 0 ? n - (size_t)(-at) : (size_t)at;
  cr_assert_lt(k, n);
  p[k] ^= 0xff;
  th_write_whole(path, p, n);
  free(p);
}

Test(nvrtc, disk_cache_is_reused_and_corruption_is_rebuilt, .timeout = 1200) {
  char cache[256];
  fresh_cache_dir(cache, sizeof cache);
  kiln_exec_stats s1 = compile_small_in_fresh_ctx();
  uint64_t k = s1.kernels_compiled;
  cr_assert_geq(k, 4u, "only %llu distinct kernels", (unsigned long long)k);
  cr_assert_eq(s1.disk_hits, 0u);
  char files[64][1200];
  int nf = th_list_files(cache, ".cubin", files, 64);
  cr_assert_eq((uint64_t)nf, k, "%d cache files for %llu kernels", nf, (unsigned long long)k);

  /* a second context in the same process finds every kernel on disk */
  kiln_exec_stats s2 = compile_small_in_fresh_ctx();
  cr_assert_eq(s2.kernels_compiled, 0u);
  cr_assert_eq(s2.disk_hits, k);
  cr_assert_eq(s2.cache_hits, s1.cache_hits + k);

  /* corrupt three entries: one truncated, one with a flipped data byte, one with a flipped
   * header byte; exactly those are rebuilt and none of them is loaded */
  th_truncate_half(files[0]);
  flip_byte(files[1], -1);
  flip_byte(files[2], 9); /* inside the key */
  kiln_exec_stats s3 = compile_small_in_fresh_ctx();
  cr_assert_eq(s3.kernels_compiled, 3u, "%llu kernels recompiled after corrupting 3",
               (unsigned long long)s3.kernels_compiled);
  cr_assert_eq(s3.disk_hits, k - 3);

  /* the rebuilt entries are whole again */
  kiln_exec_stats s4 = compile_small_in_fresh_ctx();
  cr_assert_eq(s4.kernels_compiled, 0u);
  cr_assert_eq(s4.disk_hits, k);
  th_remove_dir(cache);
}

/* Compiles on a pool of threads give the serial compile's cubins, file for file. */
Test(nvrtc, parallel_compiles_give_the_serial_cubins, .timeout = 1200) {
  char serial[256], parallel[256];
  fresh_cache_dir(serial, sizeof serial);
  cr_assert_eq(setenv("KILN_COMPILE_THREADS", "1", 1), 0);
  kiln_exec_stats s1 = compile_small_in_fresh_ctx();
  fresh_cache_dir(parallel, sizeof parallel);
  cr_assert_eq(setenv("KILN_COMPILE_THREADS", "4", 1), 0);
  kiln_exec_stats s4 = compile_small_in_fresh_ctx();
  unsetenv("KILN_COMPILE_THREADS");
  cr_assert_eq(s4.kernels_compiled, s1.kernels_compiled);
  cr_assert_eq(s4.cache_hits, s1.cache_hits);
  char a[64][1200], b[64][1200];
  int na = th_list_files(serial, ".cubin", a, 64), nb = th_list_files(parallel, ".cubin", b, 64);
  cr_assert_eq(na, nb);
  cr_assert_eq((uint64_t)na, s1.kernels_compiled);
  for (int i = 0; i < na; i++) {
    const char *name = strrchr(a[i], '/') + 1;
    char other[1300];
    snprintf(other, sizeof other, "%s/%s", parallel, name);
    size_t la, lb;
    char *ca = th_read_whole(a[i], &la), *cb = th_read_whole(other, &lb);
    cr_assert(la == lb && memcmp(ca, cb, la) == 0, "%s differs between the compiles", name);
    free(ca);
    free(cb);
  }
  th_remove_dir(serial);
  th_remove_dir(parallel);
}

/* A batch with two sources that do not compile reports the first of them in the requests' order
 * (whichever thread finished first), and the good ones before it are loaded. */
Test(nvrtc, a_batch_reports_its_first_failure, .timeout = 300) {
  char cache[256];
  fresh_cache_dir(cache, sizeof cache);
  cr_assert_eq(setenv("KILN_COMPILE_THREADS", "3", 1), 0);
  kiln_ctx *ctx = th_cpu_ctx();
  const char *src[5] = {"extern \"C\" __global__ void k_good_0(int *p) { p[0] = 0; }\n",
                        "extern \"C\" __global__ void k_bad_1(int *p) { p[0] = nope1; }\n",
                        "extern \"C\" __global__ void k_good_2(int *p) { p[0] = 2; }\n",
                        "extern \"C\" __global__ void k_bad_3(int *p) { p[0] = nope3; }\n",
                        "extern \"C\" __global__ void k_good_0(int *p) { p[0] = 0; }\n"};
  const char *names[5] = {"k_good_0", "k_bad_1", "k_good_2", "k_bad_3", "k_good_0"};
  kiln__compile_req r[5];
  for (int i = 0; i < 5; i++)
    r[i] = (kiln__compile_req){.name = names[i], .source = src[i]};
  cr_assert_not(kiln__compile_all(ctx, 5, r));
  TH_ASSERT_ERROR(ctx, KILN_ERR_CUDA, "k_bad_1", "nope1");
  cr_assert_null(strstr(kiln_ctx_error(ctx), "nope3"), "%s", kiln_ctx_error(ctx));
  cr_assert_not_null(r[0].k);
  kiln_ctx_clear_error(ctx);
  /* the good ones again: from the memory cache, the repeat counted as a hit */
  kiln__compile_req good[3] = {r[0], r[2], r[4]};
  cr_assert(kiln__compile_all(ctx, 3, good), "%s", th_err(ctx));
  cr_assert(good[0].k == good[2].k && good[1].k && good[0].k != good[1].k);
  unsetenv("KILN_COMPILE_THREADS");
  th_ctx_free(ctx);
  th_remove_dir(cache);
}

Test(nvrtc, dump_kernels_writes_sources, .timeout = 600) {
  char cache[256], dump[256];
  fresh_cache_dir(cache, sizeof cache);
  th_tmpdir(dump, sizeof dump, "dump");
  cr_assert_eq(setenv("KILN_DUMP_KERNELS", dump, 1), 0);
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_tensor *a = th_f32(ctx, KILN_SHAPE(3, 4)), *b = th_f32(ctx, KILN_SHAPE(4));
  kiln_add(a, b);
  compile_ok(ctx);

  /* the device files the kernel includes, as they are embedded */
  char *text;
  for (int i = 0; i < kiln__device_nfiles; i++) {
    char path[1200];
    snprintf(path, sizeof path, "%s/%s", dump, kiln__device_files[i].name);
    text = th_read_whole(path, NULL);
    cr_assert_str_eq(text, kiln__device_files[i].text, "%s is the device file", path);
    free(text);
  }
  char files[8][1200];
  cr_assert_eq(th_list_files(dump, ".cuh", files, 8), kiln__device_nfiles);
  int n = th_list_files(dump, ".cu", files, 8);
  cr_assert_eq(n, 1, "one kernel, got %d files", n);
  int k = 0;
  const char *base = strrchr(files[k], '/') + 1;
  cr_assert_eq(strncmp(base, "k_add_f32_", 10), 0, "the kernel file is %s", base);
  text = th_read_whole(files[k], NULL);
  cr_assert_not_null(strstr(text, "k_add_f32_"));
  cr_assert_not_null(strstr(text, "#include \"prelude.cuh\""), "source:\n%s", text);
  cr_assert_not_null(strstr(text, "// trace nodes:"), "the source lists its nodes:\n%s", text);
  cr_assert_not_null(strstr(text, "// trace nodes: #0 add [3,4] f32"), "source:\n%s", text);
  char name[128];
  snprintf(name, sizeof name, "%.*s", (int)(strlen(base) - 3), base);
  char decl[192];
  snprintf(decl, sizeof decl, "void __launch_bounds__(256) %s(", name);
  cr_assert_not_null(strstr(text, decl), "the file names its kernel %s:\n%s", name, text);
  free(text);
  th_free_scratch();
  th_ctx_free(ctx);
  th_remove_dir(dump);
  th_remove_dir(cache);
}
