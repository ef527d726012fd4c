/*
 * test_cpu_layers.c: the layers' named options on a no-GPU context (test_cpu_images.c has their
 * parameter lists and forwards). Every field is checked, and a bad one is an error naming the
 * function, the layer and the value that adds nothing to the list; batch norm's momentum and eps
 * and layer norm's eps read alike in the op and in the layer, by kiln.h's zero rule (0: PyTorch's
 * default; KILN_ZERO: an exact 0, a momentum that records no update of the running statistics).
 */
#include <math.h>

#include "inspect.h"

/* Every field of a layer's options is checked: a negative size or step, a required size left 0,
 * a square field and its per-axis one that disagree, a flag other than 0 or 1, a momentum outside
 * [0, 1], a negative eps, NULL options. Each is an error naming the function, the layer and the
 * value, and adds nothing to the list; fields that agree are accepted. */
Test(images, layer_options_are_checked_field_by_field) {
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_params *p = kiln_params_new(ctx);
  static const struct {
    kiln_conv2d_layer_options o;
    const char *says;
  } convs[] = {
      {{.in = -1, .out = 4, .kernel = 3}, "'conv': in -1, out 4"},
      {{.in = 3, .out = 0, .kernel = 3}, "out 0"},
      {{.in = 3, .out = 4}, "kernel 0 x 0"},
      {{.in = 3, .out = 4, .kernel_h = 3}, "kernel 3 x 0"},
      {{.in = 3, .out = 4, .kernel = -3}, "kernel -3 must be >= 0"},
      {{.in = 3, .out = 4, .kernel = 3, .kernel_w = 5}, "kernel 3 and kernel_w 5 disagree"},
      {{.in = 3, .out = 4, .kernel = 3, .stride_w = -1}, "stride_w -1 must be >= 0"},
      {{.in = 3, .out = 4, .kernel = 3, .stride = 2, .stride_h = 1}, "stride 2 and stride_h 1"},
      {{.in = 3, .out = 4, .kernel = 3, .padding = -1}, "padding -1"},
      {{.in = 3, .out = 4, .kernel = 3, .pad_w = -2}, "pad_w -2"},
      {{.in = 3, .out = 4, .kernel = 3, .dilation_h = -1}, "dilation_h -1"},
      {{.in = 3, .out = 4, .kernel = 3, .groups = -2}, "groups -2 must be >= 0"},
      {{.in = 6, .out = 4, .kernel = 3, .groups = 4},
       "in 6 and out 4 must be multiples of groups 4"},
      {{.in = 3, .out = 4, .kernel = 3, .no_bias = 2}, "no_bias 2 must be 0 or 1"},
      {{.in = 3, .out = 4, .kernel = 3, .no_bias = -1}, "no_bias -1"},
  };
  kiln_conv2d_layer cl;
  for (size_t i = 0; i < sizeof convs / sizeof convs[0]; i++) {
    cr_assert_eq(kiln_conv2d_layer_init(&cl, p, &convs[i].o), KILN_ERR_INVALID, "conv %zu", i);
    TH_ASSERT_ERROR(ctx, KILN_ERR_INVALID, "kiln_conv2d_layer_init: ", convs[i].says);
    kiln_ctx_clear_error(ctx);
  }
  static const struct {
    kiln_batch_norm_layer_options o;
    const char *says;
  } bns[] = {
      {{.name = "bn1"}, "'bn1': features 0 must be > 0"},
      {{.features = -4}, "'bn': features -4"},
      {{.features = 4, .momentum = 1.5f}, "momentum 1.5 must be in [0, 1]"},
      {{.features = 4, .momentum = -0.1f}, "momentum -0.1"},
      {{.features = 4, .momentum = NAN}, "momentum nan"},
      {{.features = 4, .eps = -1e-3f}, "eps -0.001 must be >= 0"},
      {{.features = 4, .no_affine = 3}, "no_affine 3 must be 0 or 1"},
  };
  kiln_batch_norm_layer bl;
  for (size_t i = 0; i < sizeof bns / sizeof bns[0]; i++) {
    cr_assert_eq(kiln_batch_norm_layer_init(&bl, p, &bns[i].o), KILN_ERR_INVALID, "bn %zu", i);
    TH_ASSERT_ERROR(ctx, KILN_ERR_INVALID, "kiln_batch_norm_layer_init: ", bns[i].says);
    kiln_ctx_clear_error(ctx);
  }
  static const struct {
    kiln_linear_options o;
    const char *says;
  } linears[] = {
      {{.name = "fc", .in = -2, .out = 3}, "'fc': in -2 and out 3 must be > 0"},
      {{.in = 2}, "'linear': in 2 and out 0"},
      {{.in = 2, .out = 3, .no_bias = 2}, "'linear': no_bias 2 must be 0 or 1"},
  };
  kiln_linear fc;
  for (size_t i = 0; i < sizeof linears / sizeof linears[0]; i++) {
    cr_assert_eq(kiln_linear_init(&fc, p, &linears[i].o), KILN_ERR_INVALID, "linear %zu", i);
    TH_ASSERT_ERROR(ctx, KILN_ERR_INVALID, "kiln_linear_init: ", linears[i].says);
    kiln_ctx_clear_error(ctx);
  }
  kiln_layer_norm_layer ll;
  cr_assert_eq(kiln_layer_norm_layer_init(&ll, p, &(kiln_layer_norm_layer_options){.features = -1}),
               KILN_ERR_INVALID);
  TH_ASSERT_ERROR(ctx, KILN_ERR_INVALID, "kiln_layer_norm_layer_init: 'ln': features -1");
  kiln_ctx_clear_error(ctx);
  cr_assert_eq(kiln_layer_norm_layer_init(
                   &ll, p, &(kiln_layer_norm_layer_options){.features = 4, .eps = -1.f}),
               KILN_ERR_INVALID);
  TH_ASSERT_ERROR(ctx, KILN_ERR_INVALID, "kiln_layer_norm_layer_init: 'ln': eps -1");
  kiln_ctx_clear_error(ctx);
  kiln_embedding el;
  cr_assert_eq(kiln_embedding_init(&el, p, &(kiln_embedding_options){.num_embeddings = 5}),
               KILN_ERR_INVALID);
  TH_ASSERT_ERROR(ctx, KILN_ERR_INVALID, "kiln_embedding_init: 'embedding': num_embeddings 5",
                  "dim 0");
  kiln_ctx_clear_error(ctx);
  /* NULL options: the required fields are named */
  cr_assert_eq(kiln_conv2d_layer_init(&cl, p, NULL), KILN_ERR_INVALID);
  TH_ASSERT_ERROR(ctx, KILN_ERR_INVALID, "kiln_conv2d_layer_init: NULL options", "kernel");
  kiln_ctx_clear_error(ctx);
  cr_assert_eq(kiln_batch_norm_layer_init(&bl, p, NULL), KILN_ERR_INVALID);
  TH_ASSERT_ERROR(ctx, KILN_ERR_INVALID, "kiln_batch_norm_layer_init: NULL options", "features");
  kiln_ctx_clear_error(ctx);
  cr_assert_eq(kiln_layer_norm_layer_init(&ll, p, NULL), KILN_ERR_INVALID);
  kiln_ctx_clear_error(ctx);
  cr_assert_eq(kiln_embedding_init(&el, p, NULL), KILN_ERR_INVALID);
  kiln_ctx_clear_error(ctx);
  cr_assert_eq(kiln_linear_init(&fc, p, NULL), KILN_ERR_INVALID);
  TH_ASSERT_ERROR(ctx, KILN_ERR_INVALID, "kiln_linear_init: NULL options", "in and out");
  kiln_ctx_clear_error(ctx);
  cr_assert_eq(kiln_params_count(p), 0, "a failed init adds nothing");
  cr_assert_null(cl.weight, "a failed init leaves its layer empty");
  /* a square field and its per-axis ones that agree; per-axis fields alone */
  cr_assert_eq(kiln_conv2d_layer_init(&cl, p,
                                      &(kiln_conv2d_layer_options){.name = "a",
                                                                   .in = 4,
                                                                   .out = 6,
                                                                   .kernel = 3,
                                                                   .kernel_h = 3,
                                                                   .stride = 2,
                                                                   .stride_w = 2,
                                                                   .pad_h = 1,
                                                                   .pad_w = 2,
                                                                   .dilation_w = 2,
                                                                   .groups = 2}),
               KILN_OK, "%s", th_err(ctx));
  th_assert_shape(cl.weight, KILN_SHAPE(6, 2, 3, 3));
  cr_assert(cl.kernel_h == 3 && cl.kernel_w == 3);
  const kiln_conv2d_options *o = &cl.opt;
  cr_assert(o->stride_h == 2 && o->stride_w == 2 && o->pad_h == 1 && o->pad_w == 2);
  cr_assert(o->dilation_h == 0 && o->dilation_w == 2 && o->groups == 2);
  cr_assert_eq(kiln_params_count(p), 2);
  kiln_params_free(p);
  th_ctx_free(ctx);
}

/* The ADD_SCALAR of the last node from first that is one: batch and layer norm's var + eps. */
static float last_eps(kiln_ctx *ctx, int32_t first) {
  for (int32_t i = th_tlen(ctx) - 1; i >= first; i--)
    if (th_node(ctx, i)->op == KILN__OP_ADD_SCALAR) return KILN__F(th_node(ctx, i), ADD_SCALAR, s);
  cr_assert_fail("no add_scalar from node %d", first);
  return NAN;
}

/* Batch norm's momentum and eps read alike in the op and the layer, by kiln.h's rule: 0 is
 * PyTorch's default (0.1, 1e-5), KILN_ZERO an exact 0 (a momentum of 0 records no update of the
 * running statistics); layer norm's eps too. The layer keeps the values it uses. */
Test(images, batch_norm_momentum_and_eps_read_alike_in_the_op_and_the_layer) {
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_tensor *x = th_f32(ctx, KILN_SHAPE(4, 3, 3, 5)), *c = th_f32(ctx, KILN_SHAPE(5));
  kiln_tensor *rm = th_f32(ctx, KILN_SHAPE(5)), *rv = th_f32(ctx, KILN_SHAPE(5));
  static const struct {
    float momentum, eps;
    int assigns; /* the running statistics' updates recorded */
    float keep, eps_used;
  } cases[] = {{0.f, 0.f, 2, 0.9f, 1e-5f},
               {0.1f, 1e-5f, 2, 0.9f, 1e-5f},
               {0.25f, 1e-3f, 2, 0.75f, 1e-3f},
               {KILN_ZERO, KILN_ZERO, 0, NAN, 0.f}};
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    int32_t n0 = th_tlen(ctx);
    kiln_tensor *y = kiln_batch_norm(x, c, c, rm, rv, 1, cases[i].momentum, cases[i].eps);
    cr_assert_not_null(y, "case %zu: %s", i, th_err(ctx));
    int32_t n1 = th_tlen(ctx);
    cr_assert_eq(th_count_ops(ctx, n0, n1, KILN__OP_ASSIGN), cases[i].assigns, "case %zu", i);
    cr_assert_eq(last_eps(ctx, n0), cases[i].eps_used, "case %zu", i);
    bool kept = cases[i].assigns == 0; /* (1 - momentum) running: the first MUL_SCALAR after */
    for (int32_t k = n0; k < n1 && !kept; k++)
      kept = th_node(ctx, k)->op == KILN__OP_MUL_SCALAR &&
             KILN__F(th_node(ctx, k), MUL_SCALAR, s) == cases[i].keep;
    cr_assert(kept, "case %zu: no running * %g", i, cases[i].keep);
    n0 = th_tlen(ctx);
    cr_assert_not_null(kiln_layer_norm(x, c, c, cases[i].eps), "%s", th_err(ctx));
    cr_assert_eq(last_eps(ctx, n0), cases[i].eps_used, "case %zu: layer norm", i);
  }
  TH_EXPECT_FAIL(ctx, kiln_batch_norm(x, c, c, rm, rv, 1, -0.5f, 0.f), KILN_ERR_INVALID,
                 "kiln_batch_norm", "momentum -0.5");
  TH_EXPECT_FAIL(ctx, kiln_layer_norm(x, c, c, -1.f), KILN_ERR_INVALID, "kiln_layer_norm",
                 "eps -1");
  /* the layer: 0 and KILN_ZERO as the op reads them, and the values in use kept */
  kiln_params *p = kiln_params_new(ctx);
  kiln_batch_norm_layer dflt, frozen;
  kiln_layer_norm_layer ln;
  cr_assert_eq(
      kiln_batch_norm_layer_init(&dflt, p, &(kiln_batch_norm_layer_options){.features = 5}),
      KILN_OK);
  cr_assert_eq(kiln_batch_norm_layer_init(
                   &frozen, p,
                   &(kiln_batch_norm_layer_options){
                       .name = "frozen", .features = 5, .momentum = KILN_ZERO, .eps = KILN_ZERO}),
               KILN_OK, "%s", th_err(ctx));
  cr_assert_eq(kiln_layer_norm_layer_init(
                   &ln, p, &(kiln_layer_norm_layer_options){.features = 5, .eps = KILN_ZERO}),
               KILN_OK);
  cr_assert(dflt.momentum == 0.1f && dflt.eps == 1e-5f);
  cr_assert(frozen.momentum == 0.f && frozen.eps == 0.f && ln.eps == 0.f);
  int32_t n0 = th_tlen(ctx);
  cr_assert_not_null(kiln_batch_norm_layer_forward(&dflt, x), "%s", th_err(ctx));
  cr_assert_eq(th_count_ops(ctx, n0, th_tlen(ctx), KILN__OP_ASSIGN), 2);
  cr_assert_eq(last_eps(ctx, n0), 1e-5f);
  n0 = th_tlen(ctx);
  cr_assert_not_null(kiln_batch_norm_layer_forward(&frozen, x), "%s", th_err(ctx));
  cr_assert_eq(th_count_ops(ctx, n0, th_tlen(ctx), KILN__OP_ASSIGN), 0, "momentum KILN_ZERO");
  cr_assert_eq(last_eps(ctx, n0), 0.f);
  n0 = th_tlen(ctx);
  cr_assert_not_null(kiln_layer_norm_layer_forward(&ln, x), "%s", th_err(ctx));
  cr_assert_eq(last_eps(ctx, n0), 0.f, "layer norm's eps KILN_ZERO");
  kiln_params_free(p);
  th_free_scratch();
  th_ctx_free(ctx);
}
