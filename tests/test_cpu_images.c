/*
 * test_cpu_images.c: the image ops and layers on a no-GPU context: output shapes of convolution,
 * pooling, normalisation and flatten; misuse (wrong channel counts, groups that do not divide,
 * a kernel of 0, inputs of the wrong rank) failing with a message that names the function and
 * leaving the context errored, without a crash; the layers' parameter lists (names, shapes,
 * gradients, buffers) and the context's training mode; and the planner on a conv-BN-ReLU block,
 * checked only for what must hold whatever the fusion choices.
 */
#include <limits.h>
#include <string.h>

#include "fusion/fusion.h"
#include "inspect.h"

/* ---------------------------------------------------------------- shapes */

Test(images, conv2d_shapes) {
  kiln_ctx *ctx = th_cpu_ctx();
  struct {
    kiln_shape x, w;
    kiln_conv2d_options o;
    int null_opts;
    kiln_shape want;
  } cases[] = {
      {KILN_SHAPE(2, 7, 5, 3), KILN_SHAPE(5, 3, 3, 3), {0}, 1, KILN_SHAPE(2, 5, 3, 5)},
      {KILN_SHAPE(2, 7, 5, 3), KILN_SHAPE(5, 3, 3, 3), {0}, 0, KILN_SHAPE(2, 5, 3, 5)},
      {KILN_SHAPE(2, 7, 5, 3),
       KILN_SHAPE(5, 3, 3, 3),
       {.stride_h = 2, .stride_w = 2},
       0,
       KILN_SHAPE(2, 3, 2, 5)},
      {KILN_SHAPE(2, 7, 5, 3),
       KILN_SHAPE(5, 3, 3, 3),
       {.stride_h = 2, .stride_w = 2, .pad_h = 1, .pad_w = 1},
       0,
       KILN_SHAPE(2, 4, 3, 5)},
      {KILN_SHAPE(2, 7, 5, 5),
       KILN_SHAPE(6, 5, 3, 3),
       {.pad_h = 2, .pad_w = 2},
       0,
       KILN_SHAPE(2, 9, 7, 6)},
      {KILN_SHAPE(2, 7, 5, 5),
       KILN_SHAPE(3, 5, 3, 3),
       {.pad_h = 2, .pad_w = 2, .dilation_h = 2, .dilation_w = 2},
       0,
       KILN_SHAPE(2, 7, 5, 3)},
      {KILN_SHAPE(2, 7, 5, 6),
       KILN_SHAPE(4, 3, 3, 3),
       {.pad_h = 1, .pad_w = 1, .groups = 2},
       0,
       KILN_SHAPE(2, 7, 5, 4)},
      {KILN_SHAPE(1, 7, 5, 6),
       KILN_SHAPE(12, 1, 3, 3),
       {.stride_h = 2, .stride_w = 2, .pad_h = 1, .pad_w = 1, .groups = 6},
       0,
       KILN_SHAPE(1, 4, 3, 12)},
      {KILN_SHAPE(2, 7, 5, 5),
       KILN_SHAPE(3, 5, 3, 1),
       {.stride_h = 2, .pad_h = 1, .dilation_h = 2},
       0,
       KILN_SHAPE(2, 3, 5, 3)},
      {KILN_SHAPE(1, 3, 3, 3),
       KILN_SHAPE(5, 3, 5, 5),
       {.pad_h = 2, .pad_w = 2},
       0,
       KILN_SHAPE(1, 3, 3, 5)},
      {KILN_SHAPE(128, 28, 28, 1), KILN_SHAPE(32, 1, 3, 3), {0}, 0, KILN_SHAPE(128, 26, 26, 32)},
  };
  char what[64];
  for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
    snprintf(what, sizeof what, "case %zu", i);
    kiln_tensor *x = th_f32(ctx, cases[i].x), *w = th_f32(ctx, cases[i].w);
    kiln_tensor *b = th_f32(ctx, KILN_SHAPE(cases[i].w.d[0]));
    for (int bias = 0; bias < 2; bias++) {
      kiln_tensor *y = kiln_conv2d(x, w, bias ? b : NULL, cases[i].null_opts ? NULL : &cases[i].o);
      cr_assert_not_null(y, "%s: %s", what, th_err(ctx));
      th_assert_shape(y, cases[i].want);
      cr_assert_eq(kiln_tensor_dtype(y), KILN_DTYPE_F32);
    }
  }
  th_assert_ok(ctx);
  th_free_scratch();
  th_ctx_free(ctx);
}

Test(images, pool_norm_flatten_shapes) {
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_tensor *x = th_f32(ctx, KILN_SHAPE(2, 7, 5, 6));
  kiln_pool2d_options k2 = {.kernel_h = 2, .kernel_w = 2};
  kiln_pool2d_options k3 = {
      .kernel_h = 3, .kernel_w = 3, .stride_h = 2, .stride_w = 2, .pad_h = 1, .pad_w = 1};
  kiln_pool2d_options d2 = {.kernel_h = 3,
                            .kernel_w = 3,
                            .stride_h = 1,
                            .stride_w = 1,
                            .pad_h = 1,
                            .pad_w = 1,
                            .dilation_h = 2,
                            .dilation_w = 2};
  kiln_pool2d_options ex = {.kernel_h = 3,
                            .kernel_w = 3,
                            .stride_h = 1,
                            .stride_w = 1,
                            .pad_h = 1,
                            .pad_w = 1,
                            .exclude_pad = 1};
  th_assert_shape(kiln_max_pool2d(x, &k2), KILN_SHAPE(2, 3, 2, 6)); /* floor: a row left over */
  th_assert_shape(kiln_avg_pool2d(x, &k2), KILN_SHAPE(2, 3, 2, 6));
  th_assert_shape(kiln_max_pool2d(x, &k3), KILN_SHAPE(2, 4, 3, 6));
  th_assert_shape(kiln_avg_pool2d(x, &k3), KILN_SHAPE(2, 4, 3, 6));
  th_assert_shape(kiln_max_pool2d(x, &d2), KILN_SHAPE(2, 5, 3, 6));
  th_assert_shape(kiln_avg_pool2d(x, &ex), KILN_SHAPE(2, 7, 5, 6));
  th_assert_shape(kiln_global_avg_pool2d(x), KILN_SHAPE(2, 6));
  th_assert_shape(kiln_global_max_pool2d(x), KILN_SHAPE(2, 6));
  th_assert_shape(kiln_flatten(x), KILN_SHAPE(2, 210));
  th_assert_shape(kiln_flatten(th_f32(ctx, KILN_SHAPE(4, 3, 5))), KILN_SHAPE(4, 15));
  th_assert_shape(kiln_flatten(th_f32(ctx, KILN_SHAPE(4, 3))), KILN_SHAPE(4, 3));
  kiln_tensor *c = th_f32(ctx, KILN_SHAPE(6));
  kiln_tensor *rm = th_f32(ctx, KILN_SHAPE(6)), *rv = th_f32(ctx, KILN_SHAPE(6));
  th_assert_shape(kiln_batch_norm(x, c, c, rm, rv, 1, 0.1f, 1e-5f), KILN_SHAPE(2, 7, 5, 6));
  th_assert_shape(kiln_batch_norm(x, NULL, NULL, NULL, NULL, 1, 0.1f, 1e-5f),
                  KILN_SHAPE(2, 7, 5, 6));
  th_assert_shape(kiln_batch_norm(x, c, c, rm, rv, 0, 0.1f, 1e-5f), KILN_SHAPE(2, 7, 5, 6));
  th_assert_shape(kiln_batch_norm(th_f32(ctx, KILN_SHAPE(8, 6)), c, c, rm, rv, 1, 0.1f, 1e-5f),
                  KILN_SHAPE(8, 6));
  th_assert_shape(kiln_layer_norm(x, c, c, 1e-5f), KILN_SHAPE(2, 7, 5, 6));
  th_assert_shape(kiln_layer_norm(th_f32(ctx, KILN_SHAPE(3, 6)), NULL, NULL, 1e-5f),
                  KILN_SHAPE(3, 6));
  th_assert_ok(ctx);
  th_free_scratch();
  th_ctx_free(ctx);
}

/* ---------------------------------------------------------------- misuse */

/* Asserts that expr (an op) fails: NULL, nothing recorded, a shape, argument or dtype error
 * whose message names fname; then that the context stays errored (a later op records nothing
 * and the message stays), and clears it. */
#define EXPECT_FAIL(ctx, expr, fname)                                                              \
  do {                                                                                             \
    int32_t n0_ = th_tlen(ctx);                                                                    \
    kiln_tensor *r_ = (expr);                                                                      \
    cr_assert_null(r_, "%s should have failed", #expr);                                            \
    cr_assert_eq(th_tlen(ctx), n0_, "%s recorded %d nodes while failing", #expr,                   \
                 th_tlen(ctx) - n0_);                                                              \
    expect_errored(ctx, #expr, fname);                                                             \
  } while (0)

static kiln_tensor *probe; /* a good tensor, for "a later op records nothing" */

static void expect_errored(kiln_ctx *ctx, const char *expr, const char *fname) {
  kiln_status st = kiln_ctx_status(ctx);
  const char *msg = kiln_ctx_error(ctx);
  cr_assert(st == KILN_ERR_SHAPE || st == KILN_ERR_INVALID || st == KILN_ERR_DTYPE,
            "%s: status %s, want a shape, argument or dtype error (message: %s)", expr,
            kiln_status_name(st), msg ? msg : "none");
  cr_assert_not_null(msg, "%s: no message", expr);
  cr_assert_not_null(strstr(msg, fname), "%s: the message '%s' does not name %s", expr, msg, fname);
  cr_log_info("%s: %s", expr, msg);
  char keep[1024];
  snprintf(keep, sizeof keep, "%s", msg);
  int32_t n0 = th_tlen(ctx);
  cr_assert_null(kiln_relu(probe), "%s: the context works on after the error", expr);
  cr_assert_eq(th_tlen(ctx), n0);
  cr_assert_str_eq(kiln_ctx_error(ctx), keep, "%s: a later call replaced the message", expr);
  kiln_ctx_clear_error(ctx);
}

Test(images, conv2d_misuse_names_the_function) {
  kiln_ctx *ctx = th_cpu_ctx();
  probe = th_f32(ctx, KILN_SHAPE(3));
  kiln_tensor *x4 = th_f32(ctx, KILN_SHAPE(2, 7, 5, 4)), *x6 = th_f32(ctx, KILN_SHAPE(2, 7, 5, 6));
  kiln_tensor *w = th_f32(ctx, KILN_SHAPE(5, 3, 3, 3)), *b = th_f32(ctx, KILN_SHAPE(5));
  kiln_tensor *x3 = th_f32(ctx, KILN_SHAPE(2, 7, 5, 3));
  /* the input's channels are not the weight's Cin / groups * groups */
  EXPECT_FAIL(ctx, kiln_conv2d(x4, w, b, NULL), "kiln_conv2d");
  /* groups that divide neither Cin nor Cout */
  kiln_conv2d_options g4 = {.groups = 4};
  EXPECT_FAIL(ctx, kiln_conv2d(x6, th_f32(ctx, KILN_SHAPE(4, 3, 3, 3)), NULL, &g4), "kiln_conv2d");
  /* groups that divide Cin (6 / 2 = 3 per group) but not Cout (5) */
  kiln_conv2d_options g2 = {.groups = 2};
  EXPECT_FAIL(ctx, kiln_conv2d(x6, w, b, &g2), "kiln_conv2d");
  /* a 3-D input, a 3-D weight, a 5-D input */
  EXPECT_FAIL(ctx, kiln_conv2d(th_f32(ctx, KILN_SHAPE(7, 5, 3)), w, b, NULL), "kiln_conv2d");
  EXPECT_FAIL(ctx, kiln_conv2d(x3, th_f32(ctx, KILN_SHAPE(5, 3, 3)), NULL, NULL), "kiln_conv2d");
  EXPECT_FAIL(ctx, kiln_conv2d(th_f32(ctx, KILN_SHAPE(1, 2, 7, 5, 3)), w, b, NULL), "kiln_conv2d");
  /* a bias of the wrong length or rank */
  EXPECT_FAIL(ctx, kiln_conv2d(x3, w, th_f32(ctx, KILN_SHAPE(4)), NULL), "kiln_conv2d");
  EXPECT_FAIL(ctx, kiln_conv2d(x3, w, th_f32(ctx, KILN_SHAPE(1, 5)), NULL), "kiln_conv2d");
  /* no weight */
  EXPECT_FAIL(ctx, kiln_conv2d(x3, NULL, b, NULL), "kiln_conv2d");
  /* a kernel larger than the padded image */
  EXPECT_FAIL(ctx, kiln_conv2d(th_f32(ctx, KILN_SHAPE(1, 2, 2, 3)), w, b, NULL), "kiln_conv2d");
  /* negative strides, padding, dilation or groups */
  kiln_conv2d_options bad[] = {{.stride_h = -1}, {.pad_w = -1}, {.dilation_h = -2}, {.groups = -1}};
  for (size_t i = 0; i < sizeof bad / sizeof *bad; i++)
    EXPECT_FAIL(ctx, kiln_conv2d(x3, w, b, &bad[i]), "kiln_conv2d");
  /* an i32 image */
  EXPECT_FAIL(ctx, kiln_conv2d(th_i32(ctx, KILN_SHAPE(2, 7, 5, 3)), w, b, NULL), "kiln_conv2d");
  /* padding or dilation of INT_MAX: a product beyond the int range (refused by kiln_conv2d before
   * it records its columns, not by the product), a window that fits nowhere; padding that makes
   * an output of more than 2^58 elements */
  kiln_conv2d_options huge[] = {{.pad_h = INT_MAX},
                                {.pad_w = INT_MAX},
                                {.dilation_h = INT_MAX},
                                {.pad_h = 1 << 30, .pad_w = 1 << 30}};
  for (size_t i = 0; i < sizeof huge / sizeof *huge; i++)
    EXPECT_FAIL(ctx, kiln_conv2d(x3, w, b, &huge[i]), "kiln_conv2d");
  th_free_scratch();
  th_ctx_free(ctx);
}

Test(images, pool_norm_misuse_names_the_function) {
  kiln_ctx *ctx = th_cpu_ctx();
  probe = th_f32(ctx, KILN_SHAPE(3));
  kiln_tensor *x = th_f32(ctx, KILN_SHAPE(2, 7, 5, 6)), *x3 = th_f32(ctx, KILN_SHAPE(7, 5, 6));
  kiln_pool2d_options k0 = {.kernel_h = 0, .kernel_w = 2};
  kiln_pool2d_options kneg = {.kernel_h = 2, .kernel_w = -1};
  kiln_pool2d_options bigpad = {.kernel_h = 2, .kernel_w = 2, .pad_h = 2};
  kiln_pool2d_options k2 = {.kernel_h = 2, .kernel_w = 2};
  kiln_pool2d_options huge = {.kernel_h = 9, .kernel_w = 2};
  EXPECT_FAIL(ctx, kiln_max_pool2d(x, &k0), "kiln_max_pool2d");
  EXPECT_FAIL(ctx, kiln_avg_pool2d(x, &k0), "kiln_avg_pool2d");
  EXPECT_FAIL(ctx, kiln_max_pool2d(x, &kneg), "kiln_max_pool2d");
  EXPECT_FAIL(ctx, kiln_max_pool2d(x, NULL), "kiln_max_pool2d"); /* the kernel is required */
  EXPECT_FAIL(ctx, kiln_max_pool2d(x, &bigpad), "kiln_max_pool2d");
  EXPECT_FAIL(ctx, kiln_avg_pool2d(x, &bigpad), "kiln_avg_pool2d");
  EXPECT_FAIL(ctx, kiln_max_pool2d(x3, &k2), "kiln_max_pool2d");
  EXPECT_FAIL(ctx, kiln_avg_pool2d(x3, &k2), "kiln_avg_pool2d");
  EXPECT_FAIL(ctx, kiln_max_pool2d(x, &huge), "kiln_max_pool2d");
  kiln_pool2d_options kmax = {.kernel_h = INT_MAX, .kernel_w = 2};
  EXPECT_FAIL(ctx, kiln_max_pool2d(x, &kmax), "kiln_max_pool2d");
  EXPECT_FAIL(ctx, kiln_global_avg_pool2d(x3), "kiln_global_avg_pool2d");
  EXPECT_FAIL(ctx, kiln_global_max_pool2d(th_f32(ctx, KILN_SHAPE(2, 6))), "kiln_global_max_pool2d");
  kiln_tensor *c6 = th_f32(ctx, KILN_SHAPE(6)), *c5 = th_f32(ctx, KILN_SHAPE(5));
  EXPECT_FAIL(ctx, kiln_batch_norm(x, c5, c6, NULL, NULL, 1, 0.1f, 1e-5f), "kiln_batch_norm");
  EXPECT_FAIL(ctx, kiln_batch_norm(x, c6, c5, NULL, NULL, 1, 0.1f, 1e-5f), "kiln_batch_norm");
  EXPECT_FAIL(ctx, kiln_batch_norm(x, c6, c6, c5, c6, 1, 0.1f, 1e-5f), "kiln_batch_norm");
  EXPECT_FAIL(ctx, kiln_batch_norm(x, c6, c6, c6, c5, 0, 0.1f, 1e-5f), "kiln_batch_norm");
  EXPECT_FAIL(ctx,
              kiln_batch_norm(x, th_f32(ctx, KILN_SHAPE(1, 6)), c6, NULL, NULL, 1, 0.1f, 1e-5f),
              "kiln_batch_norm");
  /* batch norm takes (N, H, W, C) or (N, C), as kiln.h says */
  EXPECT_FAIL(ctx, kiln_batch_norm(x3, c6, c6, NULL, NULL, 1, 0.1f, 1e-5f), "kiln_batch_norm");
  EXPECT_FAIL(
      ctx,
      kiln_batch_norm(th_f32(ctx, KILN_SHAPE(2, 3, 7, 5, 6)), c6, c6, NULL, NULL, 1, 0.1f, 1e-5f),
      "kiln_batch_norm");
  EXPECT_FAIL(ctx, kiln_batch_norm(x, c6, c6, NULL, NULL, 2, 0.1f, 1e-5f), "kiln_batch_norm");
  /* KILN_TRAINING_MODE follows the context: one value a channel is too few to train on, and
   * enough to normalise with running statistics */
  kiln_tensor *one = th_f32(ctx, KILN_SHAPE(1, 6)), *rm = th_f32(ctx, KILN_SHAPE(6)),
              *rv = th_f32(ctx, KILN_SHAPE(6));
  EXPECT_FAIL(ctx, kiln_batch_norm(one, c6, c6, rm, rv, KILN_TRAINING_MODE, 0.1f, 1e-5f),
              "kiln_batch_norm");
  kiln_set_training(ctx, 0);
  cr_assert_not_null(kiln_batch_norm(one, c6, c6, rm, rv, KILN_TRAINING_MODE, 0.1f, 1e-5f), "%s",
                     th_err(ctx));
  kiln_set_training(ctx, 1);
  EXPECT_FAIL(ctx, kiln_layer_norm(x, c5, NULL, 1e-5f), "kiln_layer_norm");
  EXPECT_FAIL(ctx, kiln_layer_norm(x, c6, c5, 1e-5f), "kiln_layer_norm");
  th_free_scratch();
  th_ctx_free(ctx);
}

/* A layer's init that fails adds nothing to the list; its forward on a wrong input fails naming
 * the layer's function or the op it calls. */
Test(images, layer_misuse_names_the_function) {
  kiln_ctx *ctx = th_cpu_ctx();
  probe = th_f32(ctx, KILN_SHAPE(3));
  kiln_params *p = kiln_params_new(ctx);
  kiln_conv2d_layer cl;
  kiln_batch_norm_layer bl;
  kiln_layer_norm_layer ll;
  /* groups of 4 divide neither 6 nor 4 channels; a kernel of 0; no channels */
#define INIT_FAILS(expr, fname)                                                                    \
  do {                                                                                             \
    kiln_status st_ = (expr);                                                                      \
    cr_assert_neq(st_, KILN_OK, "%s should have failed", #expr);                                   \
    cr_assert_eq(st_, kiln_ctx_status(ctx), "%s: the status returned is the context's", #expr);    \
    cr_assert_eq(kiln_params_count(p), 0, "%s added to the list while failing", #expr);            \
    expect_errored(ctx, #expr, fname);                                                             \
  } while (0)
  INIT_FAILS(kiln_conv2d_layer_init(&cl, p,
                                    &(kiln_conv2d_layer_options){
                                        .name = "c", .in = 6, .out = 4, .kernel = 3, .groups = 4}),
             "kiln_conv2d_layer_init");
  INIT_FAILS(
      kiln_conv2d_layer_init(&cl, p,
                             &(kiln_conv2d_layer_options){
                                 .name = "c", .in = 3, .out = 4, .kernel_h = 0, .kernel_w = 3}),
      "kiln_conv2d_layer_init");
  INIT_FAILS(kiln_conv2d_layer_init(
                 &cl, p, &(kiln_conv2d_layer_options){.name = "c", .in = 0, .out = 4, .kernel = 3}),
             "kiln_conv2d_layer_init");
  INIT_FAILS(kiln_batch_norm_layer_init(
                 &bl, p, &(kiln_batch_norm_layer_options){.name = "bn", .features = 0}),
             "kiln_batch_norm_layer_init");
  INIT_FAILS(kiln_layer_norm_layer_init(
                 &ll, p, &(kiln_layer_norm_layer_options){.name = "ln", .features = 0}),
             "kiln_layer_norm_layer_init");
#undef INIT_FAILS
  /* a name taken: the second layer of that name adds nothing */
  cr_assert_eq(
      kiln_conv2d_layer_init(
          &cl, p, &(kiln_conv2d_layer_options){.name = "c", .in = 3, .out = 4, .kernel = 3}),
      KILN_OK, "%s", th_err(ctx));
  kiln_conv2d_layer again;
  cr_assert_neq(
      kiln_conv2d_layer_init(
          &again, p, &(kiln_conv2d_layer_options){.name = "c", .in = 3, .out = 4, .kernel = 3}),
      KILN_OK);
  cr_assert_eq(kiln_params_count(p), 2);
  TH_ASSERT_ERROR(ctx, kiln_ctx_status(ctx), "kiln_conv2d_layer_init");
  kiln_ctx_clear_error(ctx);
  cr_assert_eq(kiln_batch_norm_layer_init(
                   &bl, p, &(kiln_batch_norm_layer_options){.name = "bn", .features = 4}),
               KILN_OK, "%s", th_err(ctx));
  cr_assert_eq(kiln_layer_norm_layer_init(
                   &ll, p, &(kiln_layer_norm_layer_options){.name = "ln", .features = 4}),
               KILN_OK, "%s", th_err(ctx));
  /* forwards on inputs of the wrong channel count or rank */
  kiln_tensor *x5 = th_f32(ctx, KILN_SHAPE(2, 6, 6, 5)), *x3d = th_f32(ctx, KILN_SHAPE(6, 6, 3));
  EXPECT_FAIL(ctx, kiln_conv2d_layer_forward(&cl, x5), "kiln_conv2d");
  EXPECT_FAIL(ctx, kiln_conv2d_layer_forward(&cl, x3d), "kiln_conv2d");
  EXPECT_FAIL(ctx, kiln_batch_norm_layer_forward(&bl, x5), "kiln_batch_norm");
  EXPECT_FAIL(ctx, kiln_layer_norm_layer_forward(&ll, x5), "kiln_layer_norm");
  kiln_params_free(p);
  th_free_scratch();
  th_ctx_free(ctx);
}

/* ---------------------------------------------------------------- layers and buffers */

static void expect_param(kiln_params *p, int i, const char *name, kiln_shape s, int buffer) {
  cr_assert_lt(i, kiln_params_count(p));
  cr_assert_str_eq(kiln_params_name(p, i), name);
  kiln_tensor *t = kiln_params_get(p, i);
  th_assert_shape(t, s);
  cr_assert_eq(kiln_params_find(p, name), t);
  cr_assert_eq(kiln_params_is_buffer(p, i), buffer, "%s: is_buffer %d, want %d", name,
               kiln_params_is_buffer(p, i), buffer);
  cr_assert_eq(kiln_tensor_requires_grad(t), !buffer, "%s: requires_grad %d", name,
               kiln_tensor_requires_grad(t));
  cr_assert(kiln_tensor_is_persistent(t));
}

Test(images, layers_parameter_lists) {
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_params *p = kiln_params_new(ctx);
  kiln_conv2d_layer c1, c2;
  cr_assert_eq(kiln_conv2d_layer_init(&c1, p,
                                      &(kiln_conv2d_layer_options){.name = "conv1",
                                                                   .in = 4,
                                                                   .out = 6,
                                                                   .kernel_h = 3,
                                                                   .kernel_w = 5,
                                                                   .stride = 2,
                                                                   .pad_h = 1,
                                                                   .pad_w = 2,
                                                                   .groups = 2}),
               KILN_OK, "%s", th_err(ctx));
  cr_assert_eq(
      kiln_conv2d_layer_init(&c2, p,
                             &(kiln_conv2d_layer_options){
                                 .name = "conv2", .in = 6, .out = 8, .kernel = 1, .no_bias = 1}),
      KILN_OK, "%s", th_err(ctx));
  kiln_batch_norm_layer bn, bn_plain;
  cr_assert_eq(kiln_batch_norm_layer_init(
                   &bn, p, &(kiln_batch_norm_layer_options){.name = "bn", .features = 8}),
               KILN_OK, "%s", th_err(ctx));
  cr_assert_eq(
      kiln_batch_norm_layer_init(
          &bn_plain, p,
          &(kiln_batch_norm_layer_options){
              .name = "bn2", .features = 8, .momentum = 0.3f, .eps = 1e-3f, .no_affine = 1}),
      KILN_OK, "%s", th_err(ctx));
  kiln_layer_norm_layer ln;
  cr_assert_eq(kiln_layer_norm_layer_init(
                   &ln, p, &(kiln_layer_norm_layer_options){.name = "ln", .features = 8}),
               KILN_OK, "%s", th_err(ctx));

  /* PyTorch's names and layouts */
  expect_param(p, 0, "conv1.weight", KILN_SHAPE(6, 2, 3, 5), 0);
  expect_param(p, 1, "conv1.bias", KILN_SHAPE(6), 0);
  expect_param(p, 2, "conv2.weight", KILN_SHAPE(8, 6, 1, 1), 0);
  expect_param(p, 3, "bn.weight", KILN_SHAPE(8), 0);
  expect_param(p, 4, "bn.bias", KILN_SHAPE(8), 0);
  expect_param(p, 5, "bn.running_mean", KILN_SHAPE(8), 1);
  expect_param(p, 6, "bn.running_var", KILN_SHAPE(8), 1);
  expect_param(p, 7, "bn2.running_mean", KILN_SHAPE(8), 1);
  expect_param(p, 8, "bn2.running_var", KILN_SHAPE(8), 1);
  expect_param(p, 9, "ln.weight", KILN_SHAPE(8), 0);
  expect_param(p, 10, "ln.bias", KILN_SHAPE(8), 0);
  cr_assert_eq(kiln_params_count(p), 11);

  /* the layers' fields */
  cr_assert_eq(c1.weight, kiln_params_get(p, 0));
  cr_assert_eq(c1.bias, kiln_params_get(p, 1));
  cr_assert(c1.in_channels == 4 && c1.out_channels == 6 && c1.kernel_h == 3 && c1.kernel_w == 5);
  cr_assert(c1.opt.stride_h == 2 && c1.opt.pad_w == 2 && c1.opt.groups == 2);
  cr_assert_null(c2.bias);
  cr_assert(c2.in_channels == 6 && c2.out_channels == 8);
  cr_assert_eq(bn.weight, kiln_params_get(p, 3));
  cr_assert_eq(bn.running_mean, kiln_params_get(p, 5));
  cr_assert_eq(bn.running_var, kiln_params_get(p, 6));
  cr_assert_eq(bn.channels, 8);
  cr_assert(bn_plain.weight == NULL && bn_plain.bias == NULL);
  cr_assert_eq(bn_plain.running_mean, kiln_params_get(p, 7));
  cr_assert_eq(ln.weight, kiln_params_get(p, 9));
  cr_assert_eq(ln.channels, 8);

  /* the forwards record, and the block's output has the shape PyTorch gives */
  kiln_tensor *x = th_f32(ctx, KILN_SHAPE(2, 9, 7, 4));
  kiln_tensor *h = kiln_conv2d_layer_forward(&c1, x); /* (2, 5, 4, 6) */
  th_assert_shape(h, KILN_SHAPE(2, 5, 4, 6));
  h = kiln_conv2d_layer_forward(&c2, h);
  th_assert_shape(h, KILN_SHAPE(2, 5, 4, 8));
  th_assert_shape(kiln_batch_norm_layer_forward(&bn, h), KILN_SHAPE(2, 5, 4, 8));
  th_assert_shape(kiln_batch_norm_layer_forward(&bn_plain, h), KILN_SHAPE(2, 5, 4, 8));
  th_assert_shape(kiln_layer_norm_layer_forward(&ln, h), KILN_SHAPE(2, 5, 4, 8));
  th_assert_ok(ctx);
  kiln_params_free(p);
  th_free_scratch();
  th_ctx_free(ctx);
}

Test(images, buffers_and_training_mode) {
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_params *p = kiln_params_new(ctx);
  kiln_tensor *w = th_new(ctx, KILN_DTYPE_F32, KILN_SHAPE(3));
  kiln_tensor_set_requires_grad(w, 1);
  kiln_tensor *buf = th_new(ctx, KILN_DTYPE_F32, KILN_SHAPE(3));
  kiln_tensor_set_requires_grad(buf, 1); /* a buffer never requires a gradient: cleared */
  cr_assert_eq(kiln_params_add(p, "w", w), KILN_OK);
  cr_assert_eq(kiln_params_add_buffer(p, "stat", buf), KILN_OK, "%s", th_err(ctx));
  cr_assert_eq(kiln_params_count(p), 2);
  cr_assert_eq(kiln_params_is_buffer(p, 0), 0);
  cr_assert_eq(kiln_params_is_buffer(p, 1), 1);
  cr_assert_eq(kiln_params_find(p, "stat"), buf);
  cr_assert_eq(kiln_tensor_requires_grad(buf), 0);
  /* names are shared between parameters and buffers */
  kiln_tensor *dup = th_new(ctx, KILN_DTYPE_F32, KILN_SHAPE(3));
  cr_assert_neq(kiln_params_add_buffer(p, "w", dup), KILN_OK);
  kiln_ctx_clear_error(ctx);
  kiln_tensor_free(dup);
  cr_assert_eq(kiln_params_count(p), 2);

  /* training mode: on at first, as PyTorch's modules */
  cr_assert_eq(kiln_training(ctx), 1);
  kiln_set_training(ctx, 0);
  cr_assert_eq(kiln_training(ctx), 0);
  kiln_set_training(ctx, 1);
  cr_assert_eq(kiln_training(ctx), 1);
  kiln_params_free(p);
  th_ctx_free(ctx);
}

/* ---------------------------------------------------------------- the planner */

/* The plan of the nodes recorded and not yet run, fused, after checking its invariants; the
 * description goes to the log (KILN_DEBUG=plan prints the same line for every flush). */
static kiln__plan checked_plan(kiln_ctx *ctx, bool fuse, const char *what) {
  kiln__plan p;
  cr_assert(kiln__plan_build(ctx, ctx->trace.done, ctx->trace.n, fuse, &p), "%s: %s", what,
            th_err(ctx));
  char why[512];
  const char *bad = kiln__plan_verify(ctx, &p, why, sizeof why);
  cr_assert_null(bad, "%s: the plan breaks an invariant: %s", what, bad);
  kiln__sb sb = {0};
  kiln__plan_describe(ctx, &p, &sb);
  cr_assert(!sb.oom);
  cr_log_info("%s (%s): %d groups for %d nodes: %s", what, fuse ? "fused" : "unfused", p.ng,
              p.last - p.first, sb.s);
  kiln__sb_free(&sb);
  return p;
}

/* The product groups of a plan, and how many of them read a bias in their epilogue. */
static int product_groups(const kiln__plan *p, int *with_bias) {
  int n = 0;
  *with_bias = 0;
  for (int i = 0; i < p->ng; i++) {
    if (p->g[i].kind != KILN__KIND_MATMUL) continue;
    n++;
    if ((kiln__epi_flags(p->g[i].epi) & KILN__EPI_READS_BIAS) && p->g[i].bias) (*with_bias)++;
  }
  return n;
}

/* A conv (with bias) -> batch norm (training, running statistics) -> ReLU block, recorded on a
 * no-GPU context, forward only and then with its backward pass. Whatever the fusion choices,
 * these must hold:
 *   - the convolution is a matrix product: the plan has a product group (forward), and the
 *     backward adds at least one more (the weight's gradient is a product over the image);
 *   - the conv's bias add is in that product's epilogue (the product group reads a bias);
 *   - the plan verifies, and every kernel it needs renders and compiles (NVRTC, no GPU);
 *   - fusion does something: fewer groups than nodes, and fewer than the unfused plan's.
 * The plan's description is logged, not compared, so that fusion choices may change. */
Test(images, conv_bn_relu_block_plans_and_compiles) {
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_params *p = kiln_params_new(ctx);
  kiln_conv2d_layer conv;
  kiln_batch_norm_layer bn;
  cr_assert_eq(
      kiln_conv2d_layer_init(&conv, p,
                             &(kiln_conv2d_layer_options){
                                 .name = "conv", .in = 3, .out = 16, .kernel = 3, .padding = 1}),
      KILN_OK, "%s", th_err(ctx));
  cr_assert_eq(kiln_batch_norm_layer_init(
                   &bn, p, &(kiln_batch_norm_layer_options){.name = "bn", .features = 16}),
               KILN_OK, "%s", th_err(ctx));
  kiln_tensor *x = th_f32(ctx, KILN_SHAPE(8, 12, 12, 3));

  for (int backward = 0; backward < 2; backward++) {
    const char *what = backward ? "conv-BN-ReLU forward and backward" : "conv-BN-ReLU forward";
    kiln_step_begin(ctx);
    if (!backward) kiln_no_grad_begin(ctx);
    kiln_tensor *y =
        kiln_relu(kiln_batch_norm_layer_forward(&bn, kiln_conv2d_layer_forward(&conv, x)));
    cr_assert_not_null(y, "%s: %s", what, th_err(ctx));
    th_assert_shape(y, KILN_SHAPE(8, 12, 12, 16));
    if (!backward) kiln_no_grad_end(ctx);
    if (backward)
      cr_assert_eq(kiln_backward(kiln_sum(y, KILN_ALL_AXES, 0)), KILN_OK, "%s", th_err(ctx));
    int32_t nodes = ctx->trace.n - ctx->trace.done;
    kiln__plan fused = checked_plan(ctx, true, what), unfused = checked_plan(ctx, false, what);
    int with_bias;
    int products = product_groups(&fused, &with_bias);
    cr_assert_geq(products, backward ? 2 : 1, "%s: %d product groups", what, products);
    cr_assert_geq(with_bias, 1, "%s: no product reads the conv's bias in its epilogue", what);
    cr_assert_lt(fused.ng, nodes, "%s: %d groups for %d nodes", what, fused.ng, nodes);
    cr_assert_lt(fused.ng, unfused.ng, "%s: %d groups fused, %d unfused", what, fused.ng,
                 unfused.ng);
    kiln__plan_free(&fused);
    kiln__plan_free(&unfused);
    cr_assert_eq(kiln__engine_compile(ctx, ctx->trace.done, ctx->trace.n), KILN_OK, "%s: %s", what,
                 th_err(ctx));
  }
  kiln_params_free(p);
  th_free_scratch();
  th_ctx_free(ctx);
}

/* Frees plan p, compiles the open step's kernels (NVRTC), ends the step and frees the context. */
static void compile_and_finish(kiln_ctx *ctx, kiln__plan *p) {
  kiln__plan_free(p);
  cr_assert_eq(kiln__engine_compile(ctx, ctx->trace.done, ctx->trace.n), KILN_OK, "%s",
               th_err(ctx));
  kiln_step_end(ctx);
  th_free_scratch();
  th_ctx_free(ctx);
}

/* The group of the plan that holds node `op` (the first such node), or NULL. */
static const kiln__group *group_with(kiln_ctx *ctx, const kiln__plan *p, kiln__op op) {
  for (int32_t i = p->first; i < p->last; i++)
    if (th_node(ctx, i)->op == op && p->group_of[i - p->first] >= 0)
      return &p->g[p->group_of[i - p->first]];
  return NULL;
}

/* How many members of group g are op. */
static int members_of(kiln_ctx *ctx, const kiln__plan *p, const kiln__group *g, kiln__op op) {
  int n = 0;
  for (int m = 0; m < g->n; m++)
    n += th_node(ctx, p->members[g->first + m])->op == op;
  return n;
}

/* Batch norm's forward in training with running statistics: one pass for the partial sums
 * (moments); their sums over the blocks as two reductions of a row program, each channel a row,
 * which the per-channel values and the running statistics' new values join, writing the new
 * running values into their buffers (no assignment: the thread that writes a channel's new value
 * has read its old one); the normalisation with the ReLU after it in one kernel: three launches.
 * With bn_rows off (without KILN_BN_ROWS=1), the partial sums are one column sum and the values a
 * kernel of their own: four. */
Test(images, batch_norm_forward_is_three_launches) {
  for (int rows = 1; rows >= 0; rows--) {
    kiln_ctx *ctx = th_cpu_ctx();
    ctx->bn_rows = rows;
    kiln_tensor *x = th_f32(ctx, KILN_SHAPE(8, 6, 6, 16)), *w = th_param(ctx, KILN_SHAPE(16)),
                *b = th_param(ctx, KILN_SHAPE(16)), *rm = th_f32(ctx, KILN_SHAPE(16)),
                *rv = th_f32(ctx, KILN_SHAPE(16));
    kiln_step_begin(ctx);
    cr_assert_not_null(kiln_relu(kiln_batch_norm(x, w, b, rm, rv, 1, 0.1f, 1e-5f)), "%s",
                       th_err(ctx));
    kiln__plan p = checked_plan(ctx, true, "batch norm forward");
    cr_assert_eq(p.ng, rows ? 3 : 4, "bn_rows %d: %d launches", rows, p.ng);
    int updates = 0, through = 0;
    for (int k = 0; k < p.ng; k++)
      updates += p.g[k].kind == KILN__KIND_UPDATE;
    for (int32_t i = p.first; i < p.last; i++)
      through += p.write_to[i - p.first] == rm || p.write_to[i - p.first] == rv;
    cr_assert_eq(updates, 0, "the running statistics are not assigned by a kernel of their own");
    cr_assert_eq(through, 2, "both new running values are written into their buffers");
    const kiln__group *sums = group_with(ctx, &p, KILN__OP_SUM);
    cr_assert_not_null(sums);
    if (rows) {
      cr_assert(sums->rows && members_of(ctx, &p, sums, KILN__OP_SUM) == 2 &&
                    members_of(ctx, &p, sums, KILN__OP_RSQRT) == 1,
                "the two sums and the per-channel values in one row program");
      for (int32_t i = p.first; i < p.last; i++)
        if (p.write_to[i - p.first])
          cr_assert_eq(&p.g[p.group_of[i - p.first]], sums, "the row program writes #%d through",
                       i);
    } else {
      cr_assert(!sums->rows && sums->n == 1, "one column sum alone");
    }
    const kiln__group *last = &p.g[p.ng - 1];
    cr_assert(last->n == 2 && th_node(ctx, p.members[last->first])->op == KILN__OP_BN_APPLY &&
                  th_node(ctx, p.members[last->first + 1])->op == KILN__OP_RELU,
              "the normalisation and the ReLU in one kernel");
    compile_and_finish(ctx, &p);
  }
}

/* A residual sum of two batch norms in training (a ResNet block with a downsampling shortcut:
 * the main branch's norm applied before the shortcut's statistics are recorded): both
 * applications, the add and the ReLU in one kernel (fusion/plan.c's sink phase), the first
 * application's output never written (KILN_EW_SINK=1); two without. */
Test(images, a_residual_sums_two_batch_norms_in_one_kernel) {
  for (int sink = 1; sink >= 0; sink--) {
    kiln_ctx *ctx = th_cpu_ctx();
    ctx->ew_sink = sink;
    kiln_tensor *x1 = th_f32(ctx, KILN_SHAPE(8, 6, 6, 16)),
                *x2 = th_f32(ctx, KILN_SHAPE(8, 6, 6, 16));
    kiln_tensor *w = th_param(ctx, KILN_SHAPE(16)), *b = th_param(ctx, KILN_SHAPE(16));
    kiln_step_begin(ctx);
    kiln_tensor *a = kiln_batch_norm(x1, w, b, NULL, NULL, 1, 0.1f, 1e-5f);
    kiln_tensor *s = kiln_batch_norm(x2, w, b, NULL, NULL, 1, 0.1f, 1e-5f);
    cr_assert_not_null(kiln_relu(kiln_add(a, s)), "%s", th_err(ctx));
    kiln__plan p = checked_plan(ctx, true, "a residual sum of two batch norms");
    const kiln__group *add = group_with(ctx, &p, KILN__OP_RELU); /* the add's */
    cr_assert_not_null(add);
    cr_assert_eq(members_of(ctx, &p, add, KILN__OP_BN_APPLY), sink ? 2 : 1,
                 "sink %d: the applications in the add's kernel", sink);
    int applies = 0;
    for (int k = 0; k < p.ng; k++)
      applies += members_of(ctx, &p, &p.g[k], KILN__OP_BN_APPLY) > 0;
    cr_assert_eq(applies, sink ? 1 : 2, "sink %d: %d kernels apply a batch norm", sink, applies);
    compile_and_finish(ctx, &p);
  }
}

/* Batch norm's backward with the batch's statistics: its sums of g and g xhat (a moments pass,
 * then the row program's two reductions) and the per-channel terms of dx (the means, invstd w)
 * in one kernel, which writes the bias's and the weight's gradients (the sums) into their .grad
 * buffers; dx's kernel writes x's: no assignment runs in a kernel of its own. */
Test(images, batch_norm_backward_sums_and_terms_are_one_kernel) {
  kiln_ctx *ctx = th_cpu_ctx();
  ctx->bn_rows = true; /* KILN_BN_ROWS=1 */
  kiln_tensor *x = th_param(ctx, KILN_SHAPE(8, 6, 6, 16)), *w = th_param(ctx, KILN_SHAPE(16)),
              *b = th_param(ctx, KILN_SHAPE(16)), *rm = th_f32(ctx, KILN_SHAPE(16)),
              *rv = th_f32(ctx, KILN_SHAPE(16));
  kiln_step_begin(ctx);
  kiln_tensor *y = kiln_relu(kiln_batch_norm(x, w, b, rm, rv, 1, 0.1f, 1e-5f));
  cr_assert_not_null(y, "%s", th_err(ctx));
  int32_t from = ctx->trace.n;
  cr_assert_eq(kiln_backward(kiln_sum(y, KILN_ALL_AXES, 0)), KILN_OK, "%s", th_err(ctx));
  kiln__plan p = checked_plan(ctx, true, "batch norm forward and backward");
  const kiln__group *terms = NULL;
  for (int32_t i = from; i < p.last && !terms; i++)
    if (th_node(ctx, i)->op == KILN__OP_SUM && p.group_of[i - p.first] >= 0 &&
        p.g[p.group_of[i - p.first]].rows)
      terms = &p.g[p.group_of[i - p.first]];
  cr_assert_not_null(terms, "the backward sums are a row program");
  cr_assert_eq(members_of(ctx, &p, terms, KILN__OP_SUM), 2);
  cr_assert_eq(members_of(ctx, &p, terms, KILN__OP_MUL_SCALAR), 2, "the means of g and g xhat");
  cr_assert_eq(members_of(ctx, &p, terms, KILN__OP_MUL), 1, "invstd w");
  int through = 0, assigns = 0;
  for (int32_t i = p.first; i < p.last; i++) {
    const kiln_tensor *d = p.write_to[i - p.first];
    if (d == kiln_tensor_grad(w) || d == kiln_tensor_grad(b)) {
      through++;
      cr_assert_eq(&p.g[p.group_of[i - p.first]], terms, "#%d writes a gradient elsewhere", i);
    }
    assigns += th_node(ctx, i)->op == KILN__OP_ASSIGN && p.group_of[i - p.first] >= 0;
  }
  cr_assert_eq(through, 2, "the weight's and the bias's gradients written by the row program");
  cr_assert_eq(assigns, 0, "%d gradients assigned by a kernel of their own", assigns);
  compile_and_finish(ctx, &p);
}

/* Whether the fused plan of the pending nodes computes a col2im together with its product (an
 * implicit GEMM); the plan verifies. */
static bool plans_implicit(kiln_ctx *ctx, const char *what) {
  kiln__plan p = checked_plan(ctx, true, what);
  kiln__sb sb = {0};
  kiln__plan_describe(ctx, &p, &sb);
  cr_assert(!sb.oom);
  bool found = strstr(sb.s, "matmul* col2im") != NULL;
  int implicit = 0;
  for (int k = 0; k < p.ng; k++)
    implicit += p.g[k].implicit == KILN__IMPLICIT_DGRAD;
  cr_assert_eq(implicit, found, "%s: %d implicit groups in %s", what, implicit, sb.s);
  kiln__sb_free(&sb);
  kiln__plan_free(&p);
  return found;
}

/* Records, in a new step, y = conv2d(relu(x)) of x (2, 9, 7, cin) with a 3x3 weight (cout,
 * cin / groups), padding 1, in a bf16 autocast region or not, and the backward pass of sum(y)
 * when backward is set (else under no_grad). */
static void record_conv(kiln_ctx *ctx, const char *what, int64_t cin, int64_t cout, int64_t groups,
                        int stride, bool bf16, bool backward) {
  kiln_step_begin(ctx);
  kiln_tensor *x = th_param(ctx, KILN_SHAPE(2, 9, 7, cin));
  kiln_tensor *w = th_param(ctx, KILN_SHAPE(cout, cin / groups, 3, 3));
  kiln_conv2d_options o = {
      .pad_h = 1, .pad_w = 1, .groups = (int)groups, .stride_h = stride, .stride_w = stride};
  if (!backward) kiln_no_grad_begin(ctx);
  if (bf16) kiln_autocast_begin(ctx, KILN_DTYPE_BF16);
  kiln_tensor *y = kiln_conv2d(kiln_relu(x), w, NULL, &o);
  if (bf16) kiln_autocast_end(ctx);
  cr_assert_not_null(y, "%s: %s", what, th_err(ctx));
  kiln_tensor *loss = kiln_sum(y, KILN_ALL_AXES, 0);
  if (bf16) loss = kiln_cast(loss, KILN_DTYPE_F32);
  if (!backward) kiln_no_grad_end(ctx);
  if (backward) cr_assert_eq(kiln_backward(loss), KILN_OK, "%s: %s", what, th_err(ctx));
}

/* The unfused plan of the pending nodes has no implicit group; with compile, every kernel of
 * the fused plan renders and compiles (NVRTC, no GPU), the wgmma ones warp-specialized and not
 * (KILN_CONV_WS=1). */
static void unfused_plain_and_compiles(kiln_ctx *ctx, const char *what, bool compile) {
  kiln__plan unfused = checked_plan(ctx, false, what);
  for (int k = 0; k < unfused.ng; k++)
    cr_assert(unfused.g[k].implicit == KILN__IMPLICIT_NONE, "%s: an implicit group with fusion off",
              what);
  kiln__plan_free(&unfused);
  if (!compile) return;
  bool ws = ctx->conv_warp_spec;
  for (int k = 0; k < 2; k++) {
    ctx->conv_warp_spec = k == 0;
    cr_assert_eq(kiln__engine_compile(ctx, ctx->trace.done, ctx->trace.n), KILN_OK, "%s%s: %s",
                 what, k == 0 ? ", warp-specialized" : "", th_err(ctx));
  }
  ctx->conv_warp_spec = ws;
}

/* A convolution's data gradient with few output channels (at most 64, a multiple of the tile's 16
 * in f32, 32 in bf16) is one implicit GEMM: the product of the output's gradient and the weight
 * that col2im sums is computed in col2im's kernel, the column matrix never written; its kernels
 * compile (NVRTC, no GPU), f32 with TF32 and bf16. On sm_90 a bf16 one of stride 1 and dilation 1
 * runs on wgmma instead, with output channels in multiples of 8, and also where it has 128 input
 * channels or more. TF32 off, more output channels, channel counts the tiles do not take, or
 * groups keep the product and col2im apart; so does fusion off. */
Test(images, conv_data_gradient_is_an_implicit_gemm_where_it_pays) {
  kiln_ctx *ctx = th_cpu_ctx();
  struct {
    const char *what;
    int64_t cin, cout, groups;
    int tf32, bf16, stride, arch;
    bool implicit, wgmma;
  } cases[] = {
      {"32->64 TF32", 32, 64, 1, 1, 0, 1, 90, true, false},
      {"24->32 bf16 on sm_80", 24, 32, 1, 0, 1, 1, 80, true, false},
      {"24->32 bf16 on sm_90", 24, 32, 1, 0, 1, 1, 90, true, true},
      {"24->32 bf16 stride 2 on sm_90", 24, 32, 1, 0, 1, 2, 90, true, false},
      {"32->64 f32 with TF32 off", 32, 64, 1, 0, 0, 1, 90, false, false},
      {"32->128 TF32", 32, 128, 1, 1, 0, 1, 90, false, false},
      {"32->48 bf16 on sm_80 (48 channels: not a multiple of 32)", 32, 48, 1, 0, 1, 1, 80, false,
       false},
      {"32->48 bf16 on sm_90", 32, 48, 1, 0, 1, 1, 90, true, true},
      {"32->128 bf16 on sm_90 (32 input channels)", 32, 128, 1, 0, 1, 1, 90, false, false},
      {"128->128 bf16 on sm_90", 128, 128, 1, 0, 1, 1, 90, true, true},
      {"128->128 bf16 on sm_80", 128, 128, 1, 0, 1, 1, 80, false, false},
      {"6->16 TF32 (6 input channels)", 6, 16, 1, 1, 0, 1, 90, false, false},
      {"32->64 TF32 groups 2", 32, 64, 2, 1, 0, 1, 90, false, false},
  };
  int arch = ctx->arch;
  for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
    ctx->arch = cases[i].arch;
    kiln_set_tf32(ctx, cases[i].tf32);
    record_conv(ctx, cases[i].what, cases[i].cin, cases[i].cout, cases[i].groups, cases[i].stride,
                cases[i].bf16, true);
    cr_assert_eq(plans_implicit(ctx, cases[i].what), cases[i].implicit, "%s", cases[i].what);
    kiln__plan fused = checked_plan(ctx, true, cases[i].what);
    bool wg = false;
    for (int k = 0; k < fused.ng; k++)
      wg |= fused.g[k].implicit == KILN__IMPLICIT_DGRAD && fused.g[k].wgmma;
    cr_assert_eq(wg, cases[i].wgmma, "%s: the data gradient %s on wgmma", cases[i].what,
                 wg ? "is" : "is not");
    kiln__plan_free(&fused);
    unfused_plain_and_compiles(ctx, cases[i].what, cases[i].arch == arch);
  }
  ctx->arch = arch;
  th_free_scratch();
  th_ctx_free(ctx);
}

/* How many groups of the fused plan of the pending nodes compute a convolution's product of the
 * given kind as an implicit GEMM; the plan verifies. */
static int implicit_groups(kiln_ctx *ctx, kiln__implicit kind, const char *what) {
  kiln__plan p = checked_plan(ctx, true, what);
  int found = 0;
  for (int k = 0; k < p.ng; k++)
    found += p.g[k].implicit == kind;
  kiln__plan_free(&p);
  return found;
}

/* A bf16 convolution with few output channels (at most 64, a multiple of 8; input channels a
 * multiple of 8; one group) computes its forward product and its weight gradient as implicit
 * GEMMs (fusion/device/conv.cuh) on sm_90: im2col joins the forward product's group and is never
 * written, the weight gradient gathers its columns from the image. Both render and compile for
 * sm_90a (NVRTC, no GPU). The columns stay where the products cannot gather them: f32, more
 * output channels, channel counts off the 16-byte chunks, groups, fusion off, a forward pass
 * whose weight gradient is not in the flush, a device other than sm_90. */
Test(images, conv_forward_and_weight_gradient_are_implicit_gemms_where_they_pay) {
  kiln_ctx *ctx = th_cpu_ctx();
  struct {
    const char *what;
    int64_t cin, cout, groups;
    int bf16, backward, arch;
    int fprop, wgrad;
  } cases[] = {
      {"24->64 bf16, forward and backward", 24, 64, 1, 1, 1, 90, 1, 1},
      {"8->40 bf16, forward and backward", 8, 40, 1, 1, 1, 90, 1, 1},
      {"24->64 bf16, forward alone (no gradient)", 24, 64, 1, 1, 0, 90, 1, 0},
      {"24->64 f32", 24, 64, 1, 0, 1, 90, 0, 0},
      {"24->128 bf16", 24, 128, 1, 1, 1, 90, 0, 0},
      {"12->64 bf16 (12 input channels)", 12, 64, 1, 1, 1, 90, 0, 0},
      {"24->36 bf16 (36 output channels)", 24, 36, 1, 1, 1, 90, 0, 0},
      {"32->64 bf16 groups 2", 32, 64, 2, 1, 1, 90, 0, 0},
      {"24->64 bf16 on sm_80", 24, 64, 1, 1, 1, 80, 0, 0},
  };
  int arch = ctx->arch;
  for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
    ctx->arch = cases[i].arch;
    record_conv(ctx, cases[i].what, cases[i].cin, cases[i].cout, cases[i].groups, 1, cases[i].bf16,
                cases[i].backward);
    int f = implicit_groups(ctx, KILN__IMPLICIT_FPROP, cases[i].what),
        wg = implicit_groups(ctx, KILN__IMPLICIT_WGRAD, cases[i].what);
    cr_assert_eq(f, cases[i].fprop, "%s: %d implicit forward products", cases[i].what, f);
    cr_assert_eq(wg, cases[i].wgrad, "%s: %d implicit weight gradients", cases[i].what, wg);
    unfused_plain_and_compiles(ctx, cases[i].what, cases[i].arch == arch);
  }
  ctx->arch = arch;
  th_free_scratch();
  th_ctx_free(ctx);
}

/* Only the implicit products read the columns of the im2col they claim: a plan in which another
 * node reads them is refused by the verifier. */
Test(images, an_implicit_forward_product_keeps_its_columns_to_itself) {
  kiln_ctx *ctx = th_cpu_ctx();
  ctx->conv_wgrad_into = false; /* the weight gradient alone in its group */
  kiln_step_begin(ctx);
  kiln_tensor *x = th_param(ctx, KILN_SHAPE(2, 9, 7, 24));
  kiln_tensor *w = th_param(ctx, KILN_SHAPE(64, 24, 3, 3));
  kiln_conv2d_options o = {.pad_h = 1, .pad_w = 1};
  kiln_autocast_begin(ctx, KILN_DTYPE_BF16);
  kiln_tensor *y = kiln_conv2d(x, w, NULL, &o);
  kiln_autocast_end(ctx);
  cr_assert_eq(kiln_backward(kiln_cast(kiln_sum(y, KILN_ALL_AXES, 0), KILN_DTYPE_F32)), KILN_OK,
               "%s", th_err(ctx));
  kiln__plan p = checked_plan(ctx, true, "24->64 bf16");
  int32_t c = -1;
  for (int k = 0; k < p.ng; k++)
    if (p.g[k].implicit == KILN__IMPLICIT_WGRAD) c = p.g[k].window;
  cr_assert_geq(c, 0, "no implicit weight gradient");
  /* pretend the weight gradient is an ordinary product: it then reads columns nobody wrote */
  for (int k = 0; k < p.ng; k++)
    if (p.g[k].implicit == KILN__IMPLICIT_WGRAD) p.g[k].implicit = KILN__IMPLICIT_NONE;
  char why[512];
  const char *bad = kiln__plan_verify(ctx, &p, why, sizeof why);
  cr_assert_not_null(bad, "the verifier accepted columns read outside the implicit products");
  cr_assert(strstr(bad, "columns of im2col") != NULL, "%s", bad);
  kiln__plan_free(&p);
  /* a view of the columns that the host asked for: the columns are written, im2col stays */
  for (int32_t j = c + 1; j < ctx->trace.n; j++)
    if (ctx->trace.nodes[j].op == KILN__OP_RESHAPE && ctx->trace.nodes[j].in[0]->node == c)
      ctx->trace.nodes[j].out->keep = true;
  cr_assert_eq(implicit_groups(ctx, KILN__IMPLICIT_FPROP, "24->64 bf16, a kept view"), 0);
  th_free_scratch();
  th_ctx_free(ctx);
}

/* Compiles what the open step recorded (NVRTC, every kernel) and ends it; its statistics after. */
static kiln_exec_stats compile_and_end(kiln_ctx *ctx, const char *what) {
  cr_assert_eq(kiln__engine_compile(ctx, ctx->trace.done, ctx->trace.n), KILN_OK, "%s: %s", what,
               th_err(ctx));
  cr_assert_eq(kiln_step_end(ctx), KILN_OK, "%s: %s", what, th_err(ctx));
  kiln_exec_stats st;
  kiln_stats(ctx, &st);
  return st;
}

/* The trace's last node of op `op` at or after `from`, or NULL. */
static const kiln__node *last_of(const kiln_ctx *ctx, int32_t from, kiln__op op) {
  const kiln__node *found = NULL;
  for (int32_t i = from; i < ctx->trace.n; i++)
    if (ctx->trace.nodes[i].op == op) found = &ctx->trace.nodes[i];
  return found;
}

/* With fusion on, a max pool whose input needs a gradient writes each value's window position (a
 * byte) behind its output's values, and its gradient reads them there, not from the input, which
 * then dies at the pool in a step graph's memory plan. With fusion off (the unfused reference), in
 * no-grad mode and for windows of 255 taps or more, nothing is written behind the values and the
 * gradient searches the input's windows again. */
Test(images, max_pool_gradient_reads_window_positions_not_the_input) {
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_tensor *x = th_param(ctx, KILN_SHAPE(8, 32, 32, 16)); /* 512 KiB of f32 */
  const uint64_t image = 8 * 32 * 32 * 16 * 4, pooled = 8 * 16 * 16 * 16;
  uint64_t live[2];
  for (int fuse = 1; fuse >= 0; fuse--) {
    kiln_set_fusion(ctx, fuse);
    kiln_step_begin(ctx);
    int32_t from = ctx->trace.n;
    kiln_tensor *h = kiln_mul(x, x); /* an intermediate whose own gradient needs only x */
    kiln_tensor *y = kiln_max_pool2d(h, &(kiln_pool2d_options){.kernel_h = 2, .kernel_w = 2});
    cr_assert_not_null(y, "%s", th_err(ctx));
    const kiln__node *pool = last_of(ctx, from, KILN__OP_MAX_POOL);
    cr_assert_eq(KILN__I(pool, MAX_POOL, index), fuse, "fusion %d: positions %lld", fuse,
                 (long long)KILN__I(pool, MAX_POOL, index));
    cr_assert_eq(y->st->tail, fuse ? pooled : 0, "fusion %d: %zu bytes behind the values", fuse,
                 y->st->tail);
    cr_assert_eq(y->st->bytes, pooled * 4 + y->st->tail);
    cr_assert_eq(kiln_backward(kiln_sum(y, KILN_ALL_AXES, 0)), KILN_OK, "%s", th_err(ctx));
    const kiln__node *grad = last_of(ctx, from, KILN__OP_MAX_POOL_GRAD);
    cr_assert_not_null(grad);
    cr_assert_eq(KILN__I(grad, MAX_POOL_GRAD, index), fuse);
    cr_assert(grad->in[1]->st == (fuse ? y : h)->st, "fusion %d: the gradient reads the %s", fuse,
              grad->in[1]->st == y->st ? "output" : "input");
    int readers = 0; /* of the pool's input: the pool, and the gradient without positions */
    for (int32_t i = from; i < ctx->trace.n; i++)
      for (int q = 0; q < ctx->trace.nodes[i].nin; q++)
        readers += ctx->trace.nodes[i].in[q]->st == h->st;
    cr_assert_eq(readers, fuse ? 1 : 2, "fusion %d: %d nodes read the pool's input", fuse, readers);
    live[fuse] = compile_and_end(ctx, fuse ? "fused" : "unfused").arena_live_bytes;
  }
  /* the pool's input and its gradient are never live together with positions; they are without */
  cr_assert_lt(live[1], 2 * image, "with positions %llu bytes live at once",
               (unsigned long long)live[1]);
  cr_assert_geq(live[0], 2 * image, "without them %llu bytes live at once",
                (unsigned long long)live[0]);

  /* no positions where no gradient is recorded, where a byte cannot hold them, or where the input
   * stays in memory anyway: a parameter, or a ReLU's output (its own gradient reads it), unless
   * the ReLU follows a batch norm (its gradient then recomputes its input) */
  kiln_set_fusion(ctx, 1);
  kiln_step_begin(ctx);
  kiln_tensor *h = kiln_mul(x, x);
  kiln_no_grad_begin(ctx);
  kiln_tensor *y = kiln_max_pool2d(h, &(kiln_pool2d_options){.kernel_h = 2, .kernel_w = 2});
  kiln_no_grad_end(ctx);
  cr_assert_not_null(y, "%s", th_err(ctx));
  cr_assert_eq(KILN__I(kiln__producer(y), MAX_POOL, index), 0);
  cr_assert_eq(y->st->tail, 0);
  struct {
    kiln_tensor *in;
    int k, index;
    const char *what;
  } cases[] = {{h, 16, 0, "256 taps"},
               {h, 15, 1, "240 taps"},
               {x, 2, 0, "a parameter"},
               {kiln_relu(h), 2, 0, "a ReLU's output"},
               {kiln_relu(kiln_batch_norm(h, NULL, th_param(ctx, KILN_SHAPE(16)), NULL, NULL, 1,
                                          0.1f, 1e-5f)),
                2, 1, "a ReLU's output after a batch norm (its gradient recomputes the input)"},
               {kiln_reshape(kiln_sigmoid(h), KILN_SHAPE(8, 32, 16, 32)), 2, 0,
                "a view of a sigmoid's output"},
               {kiln_reshape(h, KILN_SHAPE(8, 32, 16, 32)), 2, 1, "a view of a product"},
               {kiln_cast(h, KILN_DTYPE_BF16), 2, 1, "bf16"},
               {kiln_reshape(h, KILN_SHAPE(8, 32, 512, 1)), 3, 1, "one channel"}};
  kiln_tensor *sum = NULL;
  for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
    y = kiln_max_pool2d(cases[c].in,
                        &(kiln_pool2d_options){.kernel_h = cases[c].k, .kernel_w = 16});
    cr_assert_not_null(y, "%s: %s", cases[c].what, th_err(ctx));
    cr_assert_eq(KILN__I(kiln__producer(y), MAX_POOL, index), cases[c].index, "%s", cases[c].what);
    kiln_tensor *s = kiln_sum(kiln_cast(y, KILN_DTYPE_F32), KILN_ALL_AXES, 0);
    sum = sum ? kiln_add(sum, s) : s;
  }
  /* their kernels and their gradients' compile (bf16 and f32, four lanes and one) */
  cr_assert_eq(kiln_backward(sum), KILN_OK, "%s", th_err(ctx));
  cr_assert_eq(kiln__engine_compile(ctx, ctx->trace.done, ctx->trace.n), KILN_OK, "%s",
               th_err(ctx));
  cr_assert_eq(kiln_step_end(ctx), KILN_OK, "%s", th_err(ctx));
  th_free_scratch();
  th_ctx_free(ctx);
}

/* The description of everything recorded and not yet run, fused, into buf. */
static void describe_pending(kiln_ctx *ctx, char *buf, size_t n) {
  kiln__plan p = checked_plan(ctx, true, "pending");
  kiln__sb sb = {0};
  kiln__plan_describe(ctx, &p, &sb);
  cr_assert(!sb.oom);
  snprintf(buf, n, "%s", sb.s);
  kiln__sb_free(&sb);
  kiln__plan_free(&p);
}

/* An activation after a batch norm in training (GELU, SiLU, leaky ReLU, ReLU): its gradient reads
 * the norm's application recorded again in the backward pass from the values the norm's own
 * gradient keeps (x, weight, mean, inverse deviation; a persistent bias), so the application is
 * never written in the forward pass: it stays in the registers of the activation's kernel, and its
 * second copy in those of the gradient's (a ReLU's gradient takes the sign of its input for that
 * of its output). Not with a bias that is no tensor of the caller's (the application's own zeros)
 * or in evaluation. */
Test(images, activation_after_batch_norm_recomputes_the_normalised_input) {
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_tensor *x = th_param(ctx, KILN_SHAPE(8, 6, 6, 16)), *w = th_param(ctx, KILN_SHAPE(16)),
              *b = th_param(ctx, KILN_SHAPE(16)), *rm = th_f32(ctx, KILN_SHAPE(16)),
              *rv = th_f32(ctx, KILN_SHAPE(16));
  struct {
    int act; /* 0 GELU, 1 GELU tanh, 2 SiLU, 3 leaky ReLU, 4 ReLU */
    int bias, training, recomputed;
    const char *what;
  } cases[] = {{0, 1, 1, 1, "GELU"},
               {1, 1, 1, 1, "GELU (tanh)"},
               {2, 1, 1, 1, "SiLU"},
               {3, 1, 1, 1, "leaky ReLU"},
               {4, 1, 1, 1, "ReLU"},
               {4, 0, 1, 0, "ReLU after a norm without bias"},
               {0, 0, 1, 0, "GELU after a norm without bias"},
               {0, 1, 0, 0, "GELU after a norm in evaluation"}};
  for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
    const char *what = cases[c].what;
    kiln_step_begin(ctx);
    int32_t from = ctx->trace.n;
    kiln_tensor *y =
        kiln_batch_norm(x, w, cases[c].bias ? b : NULL, rm, rv, cases[c].training, 0.1f, 1e-5f);
    cr_assert_not_null(last_of(ctx, from, KILN__OP_BN_APPLY), "%s: %s", what, th_err(ctx));
    /* a copy: recording moves the trace when it grows */
    const kiln__node fwd_node = *last_of(ctx, from, KILN__OP_BN_APPLY), *fwd = &fwd_node;
    switch (cases[c].act) {
    case 0: y = kiln_gelu(y, KILN_GELU_ERF); break;
    case 1: y = kiln_gelu(y, KILN_GELU_TANH); break;
    case 2: y = kiln_silu(y); break;
    case 3: y = kiln_leaky_relu(y, 0.1f); break;
    default: y = kiln_relu(y); break;
    }
    int32_t back = ctx->trace.n;
    cr_assert_eq(kiln_backward(kiln_sum(y, KILN_ALL_AXES, 0)), KILN_OK, "%s: %s", what,
                 th_err(ctx));
    const kiln__node *again = last_of(ctx, back, KILN__OP_BN_APPLY);
    cr_assert_eq(again != NULL, cases[c].recomputed, "%s: the application %s recorded again", what,
                 again ? "is" : "is not");
    if (again) {
      for (int q = 0; q < fwd->nin; q++)
        cr_assert_eq(again->in[q], fwd->in[q], "%s: input %d differs", what, q);
      cr_assert_eq(again->out->dtype, fwd->out->dtype);
      cr_assert_eq(KILN__I(again, BN_APPLY, batch), 1);
      int readers = 0; /* of the forward's application: the activation alone */
      for (int32_t i = from; i < ctx->trace.n; i++)
        for (int q = 0; q < ctx->trace.nodes[i].nin; q++)
          readers += ctx->trace.nodes[i].in[q] == fwd->out;
      cr_assert_eq(readers, 1, "%s: %d nodes read the forward's application", what, readers);
      char plan[4096];
      describe_pending(ctx, plan, sizeof plan);
      int in_registers = 0; /* "bn_apply*": the application, both times */
      for (const char *at = plan; (at = strstr(at, "bn_apply")) != NULL; at++) {
        cr_assert_eq(at[8], '*', "%s: an application is written: %s", what, plan);
        in_registers++;
      }
      cr_assert_eq(in_registers, 2, "%s: %s", what, plan);
      cr_assert(strstr(plan, "[recomputed]"), "%s: KILN_DEBUG=plan does not say so: %s", what,
                plan);
    }
    compile_and_end(ctx, what);
  }
  th_free_scratch();
  th_ctx_free(ctx);
}

/* KILN_CONV_RECOMPUTE=1: a convolution whose products run on the BLAS library (more output
 * channels than the implicit ones take) gathers its columns again for its weight gradient, which
 * is recorded before its data gradient, so that the forward's columns die at the forward product
 * and the two column matrices of the backward pass are never live together. The step graph's
 * memory plan shrinks by about a column matrix. A convolution with few output channels is left as
 * it is (its implicit products keep no columns), and so is everything with the switch off. */
Test(images, recomputed_columns_for_the_weight_gradient) {
  uint64_t arena[2];
  for (int on = 0; on < 2; on++) {
    kiln_ctx *ctx = th_cpu_ctx();
    ctx->conv_recompute = on;
    kiln_tensor *x = th_param(ctx, KILN_SHAPE(16, 12, 12, 32));
    kiln_tensor *wide = th_param(ctx, KILN_SHAPE(128, 32, 3, 3)),
                *narrow = th_param(ctx, KILN_SHAPE(32, 128, 3, 3));
    kiln_conv2d_options same = {.pad_h = 1, .pad_w = 1};
    kiln_step_begin(ctx);
    kiln_autocast_begin(ctx, KILN_DTYPE_BF16);
    kiln_tensor *h = kiln_gelu(kiln_conv2d(x, wide, NULL, &same), KILN_GELU_ERF);
    kiln_tensor *y = kiln_conv2d(h, narrow, NULL, &same);
    kiln_autocast_end(ctx);
    cr_assert_not_null(y, "%s", th_err(ctx));
    int32_t back = ctx->trace.n;
    cr_assert_eq(kiln_backward(kiln_sum(kiln_cast(y, KILN_DTYPE_F32), KILN_ALL_AXES, 0)), KILN_OK,
                 "%s", th_err(ctx));
    int again = 0; /* im2col nodes of the backward pass: of the wide convolution's input x */
    for (int32_t i = back; i < ctx->trace.n; i++) {
      const kiln__node *n = &ctx->trace.nodes[i];
      if (n->op != KILN__OP_IM2COL) continue;
      again++;
      cr_assert(n->in[0] == x || kiln__producer(n->in[0])->in[0] == x,
                "the backward pass gathers the columns of another image");
      /* its columns feed the weight gradient, recorded before the data gradient's product */
      int32_t readers = 0;
      for (int32_t j = i + 1; j < ctx->trace.n; j++)
        for (int q = 0; q < ctx->trace.nodes[j].nin; q++)
          if (ctx->trace.nodes[j].op == KILN__OP_RESHAPE && ctx->trace.nodes[j].in[q] == n->out)
            readers++;
      cr_assert_eq(readers, 1);
    }
    cr_assert_eq(again, on, "switch %d: %d im2col nodes in the backward pass", on, again);
    arena[on] = compile_and_end(ctx, on ? "recomputed" : "kept").arena_bytes;
    th_free_scratch();
    th_ctx_free(ctx);
  }
  cr_log_info("arena %llu bytes with the switch, %llu without", (unsigned long long)arena[1],
              (unsigned long long)arena[0]);
  /* the wide convolution's columns: 16 * 12 * 12 * 288 bf16, 1.27 MiB */
  const uint64_t columns = 16 * 12 * 12 * 288 * 2;
  cr_assert_leq(arena[1] + columns / 2, arena[0], "arena %llu bytes with the switch, %llu without",
                (unsigned long long)arena[1], (unsigned long long)arena[0]);
}
