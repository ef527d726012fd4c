/*
 * test_cpu_init_optim.c: on a no-GPU context, the initialisers' gains, fans and errors (a failed
 * call leaves the RNG as it was), parameter groups (what they select, the update nodes' rates and
 * weight decays, exclusions freeing and remaking state, a parameter in two groups refused, their
 * errors), and gradient clipping by global norm as recorded nodes; a step that clips and uses
 * groups plans and compiles without a GPU.
 */
#include <math.h>
#include <string.h>

#include "inspect.h"

/* ---------------------------------------------------------------- initialisers */

Test(init, gains_are_torchs) {
  cr_assert_eq(kiln_init_gain(KILN_NONLINEARITY_LINEAR, 0.f), 1.f);
  cr_assert_eq(kiln_init_gain(KILN_NONLINEARITY_SIGMOID, 3.f), 1.f);
  cr_assert_eq(kiln_init_gain(KILN_NONLINEARITY_TANH, 0.f), (float)(5.0 / 3.0));
  cr_assert_eq(kiln_init_gain(KILN_NONLINEARITY_RELU, 0.f), (float)sqrt(2.0));
  cr_assert_eq(kiln_init_gain(KILN_NONLINEARITY_SELU, 0.f), 0.75f);
  /* leaky_relu: param 0 is torch's default slope 0.01, KILN_ZERO a slope of 0 */
  cr_assert_eq(kiln_init_gain(KILN_NONLINEARITY_LEAKY_RELU, 0.f),
               (float)sqrt(2.0 / (1.0 + 0.01 * 0.01)));
  cr_assert_eq(kiln_init_gain(KILN_NONLINEARITY_LEAKY_RELU, KILN_ZERO), (float)sqrt(2.0));
  cr_assert_eq(kiln_init_gain(KILN_NONLINEARITY_LEAKY_RELU, 0.2f),
               (float)sqrt(2.0 / (1.0 + (double)0.2f * 0.2f)));
  /* nn.Linear's a = sqrt(5): gain sqrt(1/3) */
  cr_assert_float_eq(kiln_init_gain(KILN_NONLINEARITY_LEAKY_RELU, sqrtf(5.f)), sqrt(1.0 / 3.0),
                     1e-7);
  cr_assert(isnan(kiln_init_gain((kiln_nonlinearity)99, 0.f)));
}

Test(init, fans_of_linear_and_conv_shapes) {
  kiln_ctx *ctx = th_cpu_ctx();
  struct {
    kiln_shape s;
    int64_t in, out;
  } cases[] = {
      {KILN_SHAPE(512, 784), 784, 512},       /* linear (out, in) */
      {KILN_SHAPE(64, 3, 3, 3), 27, 576},     /* conv (Cout, Cin, kh, kw) */
      {KILN_SHAPE(64, 8, 5, 5), 200, 1600},   /* a grouped conv: Cin / groups = 8 */
      {KILN_SHAPE(32, 1, 3, 3), 9, 288},      /* depthwise */
      {KILN_SHAPE(10, 4, 2, 3, 5), 120, 300}, /* a 3-D conv's weight */
  };
  for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
    kiln_tensor *t = th_f32(ctx, cases[k].s);
    int64_t fi = -1, fo = -1;
    cr_assert_eq(kiln_init_fans(t, &fi, &fo), KILN_OK, "%s", th_err(ctx));
    cr_assert_eq(fi, cases[k].in, "case %zu: fan_in %lld", k, (long long)fi);
    cr_assert_eq(fo, cases[k].out, "case %zu: fan_out %lld", k, (long long)fo);
  }
  cr_assert_eq(kiln_init_fans(th_f32(ctx, KILN_SHAPE(7)), NULL, NULL), KILN_ERR_SHAPE);
  TH_ASSERT_ERROR(ctx, KILN_ERR_SHAPE, "kiln_init_fans", "1 dims", "at least 2");
  kiln_ctx_clear_error(ctx);
  th_free_scratch();
  th_ctx_free(ctx);
}

/* Asserts that call failed with status and a message holding what, and left the RNG alone. */
#define EXPECT_INIT_FAIL(ctx, call, status, ...)                                                   \
  do {                                                                                             \
    uint64_t rng_ = (ctx)->host_rng;                                                               \
    cr_assert_eq((call), (status), "%s", #call);                                                   \
    TH_ASSERT_ERROR(ctx, status, __VA_ARGS__);                                                     \
    cr_assert_eq((ctx)->host_rng, rng_, "%s drew from the RNG while failing", #call);              \
    kiln_ctx_clear_error(ctx);                                                                     \
  } while (0)

Test(init, errors_name_the_function_and_change_nothing) {
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_tensor *w = th_f32(ctx, KILN_SHAPE(6, 4));
  kiln_tensor *b = th_f32(ctx, KILN_SHAPE(6));
  kiln_tensor *i32 = th_i32(ctx, KILN_SHAPE(6, 4));
  kiln_tensor *inter = kiln_full(ctx, KILN_SHAPE(6, 4), 1.f);
  kiln_tensor *view = kiln_transpose(w, 0, 1);
  cr_assert_not_null(inter);
  cr_assert_not_null(view);

  cr_assert_eq(kiln_init_uniform(NULL, 0.f, 1.f), KILN_ERR_INVALID);
  cr_assert_null(kiln_ctx_error(ctx), "a NULL tensor names no context");
  EXPECT_INIT_FAIL(ctx, kiln_init_uniform(inter, 0.f, 1.f), KILN_ERR_INVALID, "kiln_init_uniform",
                   "an intermediate", "persistent");
  EXPECT_INIT_FAIL(ctx, kiln_init_normal(view, 0.f, 1.f), KILN_ERR_INVALID, "kiln_init_normal",
                   "a view");
  EXPECT_INIT_FAIL(ctx, kiln_init_constant(i32, 1.f), KILN_ERR_DTYPE, "kiln_init_constant", "i32",
                   "f32");
  EXPECT_INIT_FAIL(ctx, kiln_init_uniform(w, 1.f, 0.5f), KILN_ERR_INVALID, "kiln_init_uniform",
                   "lo 1 > hi 0.5");
  EXPECT_INIT_FAIL(ctx, kiln_init_uniform(w, -INFINITY, 0.f), KILN_ERR_INVALID, "lo -inf",
                   "finite");
  EXPECT_INIT_FAIL(ctx, kiln_init_normal(w, 0.f, -1.f), KILN_ERR_INVALID, "kiln_init_normal",
                   "std -1", ">= 0");
  EXPECT_INIT_FAIL(ctx, kiln_init_normal(w, NAN, 1.f), KILN_ERR_INVALID, "mean nan", "finite");
  EXPECT_INIT_FAIL(ctx, kiln_init_constant(w, INFINITY), KILN_ERR_INVALID, "kiln_init_constant",
                   "value inf");
  EXPECT_INIT_FAIL(ctx, kiln_init_kaiming_uniform(b, 0.f, KILN_FAN_IN, 0), KILN_ERR_SHAPE,
                   "kiln_init_kaiming_uniform", "[6]", "1 dims");
  EXPECT_INIT_FAIL(ctx, kiln_init_kaiming_normal(w, 0.f, (kiln_fan_mode)7, 0), KILN_ERR_INVALID,
                   "kiln_init_kaiming_normal", "mode 7");
  EXPECT_INIT_FAIL(ctx, kiln_init_kaiming_normal(w, 0.f, KILN_FAN_OUT, (kiln_nonlinearity)42),
                   KILN_ERR_INVALID, "unknown nonlinearity 42");
  EXPECT_INIT_FAIL(ctx, kiln_init_kaiming_uniform(w, NAN, KILN_FAN_OUT, 0), KILN_ERR_INVALID,
                   "a nan");
  EXPECT_INIT_FAIL(ctx, kiln_init_xavier_uniform(b, 1.f), KILN_ERR_SHAPE,
                   "kiln_init_xavier_uniform", "1 dims");
  EXPECT_INIT_FAIL(ctx, kiln_init_xavier_normal(w, -2.f), KILN_ERR_INVALID,
                   "kiln_init_xavier_normal", "gain -2");

  /* a call on a failed context does nothing either */
  kiln_init_uniform(w, 1.f, 0.f);
  uint64_t rng = ctx->host_rng;
  cr_assert_eq(kiln_init_normal(w, 0.f, 1.f), KILN_ERR_INVALID);
  cr_assert_eq(ctx->host_rng, rng);
  kiln_ctx_clear_error(ctx);

  /* good calls are accepted without a GPU (the upload is dropped) and draw from the RNG: one
   * value per element, Box-Muller a pair per two elements, constants none */
  rng = ctx->host_rng;
  cr_assert_eq(kiln_init_constant(w, 0.5f), KILN_OK, "%s", th_err(ctx));
  cr_assert_eq(ctx->host_rng, rng);
  kiln_manual_seed(ctx, 5);
  cr_assert_eq(kiln_init_uniform(w, -1.f, 1.f), KILN_OK, "%s", th_err(ctx));
  uint64_t after_24 = ctx->host_rng;
  kiln_manual_seed(ctx, 5);
  for (int k = 0; k < 24; k++)
    kiln__rng_uniform(ctx);
  cr_assert_eq(ctx->host_rng, after_24, "24 elements: 24 draws");
  kiln_manual_seed(ctx, 5);
  cr_assert_eq(kiln_init_normal(b, 0.f, 1.f), KILN_OK);
  uint64_t after_6 = ctx->host_rng;
  kiln_manual_seed(ctx, 5);
  for (int k = 0; k < 6; k++)
    kiln__rng_uniform(ctx);
  cr_assert_eq(ctx->host_rng, after_6, "6 normals: 3 pairs of draws");
  cr_assert_eq(kiln_init_kaiming_uniform(w, 0.f, KILN_FAN_IN, 0), KILN_OK);
  cr_assert_eq(kiln_init_kaiming_normal(w, 0.1f, KILN_FAN_OUT, KILN_NONLINEARITY_TANH), KILN_OK);
  cr_assert_eq(kiln_init_xavier_uniform(w, 0.f), KILN_OK);
  cr_assert_eq(kiln_init_xavier_normal(w, KILN_ZERO), KILN_OK);
  /* an empty tensor is left alone, drawing nothing */
  kiln_tensor *empty = th_f32(ctx, KILN_SHAPE(0, 5));
  rng = ctx->host_rng;
  cr_assert_eq(kiln_init_kaiming_uniform(empty, 0.f, KILN_FAN_IN, 0), KILN_OK);
  cr_assert_eq(kiln_init_normal(empty, 0.f, 1.f), KILN_OK);
  cr_assert_eq(ctx->host_rng, rng);
  th_assert_ok(ctx);
  th_free_scratch();
  th_ctx_free(ctx);
}

/* ---------------------------------------------------------------- parameter groups */

/* The update nodes of op recorded from first on, in order; returns how many. */
static int updates_from(kiln_ctx *ctx, int32_t first, kiln__op op, kiln__node **out, int max) {
  int k = 0;
  for (int32_t i = first; i < th_tlen(ctx); i++) {
    kiln__node *n = th_node(ctx, i);
    cr_assert_eq(n->op, op, "node #%d is %s, want only %s", i, th_op_name(n->op), th_op_name(op));
    if (k < max) out[k] = n;
    k++;
  }
  return k;
}

/* The index in p of the parameter that node n updates. */
static int param_of(kiln_params *p, const kiln__node *n) {
  for (int i = 0; i < kiln_params_count(p); i++)
    if (kiln_params_get(p, i) == n->in[0]) return i;
  cr_assert_fail("the node updates no parameter of the list");
  return -1;
}

static int select_none(const char *name, const kiln_tensor *t, void *user) {
  (void)name;
  (void)t;
  (void)user;
  return 0;
}

Test(groups, selection_counts_and_errors) {
  kiln_ctx *ctx = th_cpu_ctx();
  th_net m;
  th_net_init(&m, ctx, 4, 3, (int64_t[]){6, 5, 4, 3});
  kiln_tensor *stat = th_new(ctx, KILN_DTYPE_F32, KILN_SHAPE(5));
  cr_assert_eq(kiln_params_add_buffer(m.params, "bn.running_mean", stat), KILN_OK);
  kiln_optim *o = kiln_sgd_new(m.params, &(kiln_sgd_options){.lr = 0.1f, .weight_decay = 0.01f});
  cr_assert_not_null(o, "%s", th_err(ctx));
  /* three biases (the buffer, of one dim too, is in no group) */
  cr_assert_eq(kiln_optim_add_group(o, kiln_select_no_decay, NULL,
                                    &(kiln_param_group){.weight_decay = KILN_ZERO}),
               3);
  cr_assert_eq(kiln_optim_add_group(o, kiln_select_prefix, "fc2.weight", NULL), 1);
  cr_assert_eq(kiln_optim_add_group(o, kiln_select_prefix, "bn.", NULL), 0, "buffers: none");
  cr_assert_eq(kiln_optim_add_group(o, select_none, NULL, NULL), 0);
  th_assert_ok(ctx);

  cr_assert_eq(kiln_optim_add_group(NULL, kiln_select_no_decay, NULL, NULL), -1);
  cr_assert_eq(kiln_optim_add_group(o, NULL, NULL, NULL), -1);
  TH_ASSERT_ERROR(ctx, KILN_ERR_INVALID, "kiln_optim_add_group", "NULL select");
  kiln_ctx_clear_error(ctx);
  cr_assert_eq(
      kiln_optim_add_group(o, kiln_select_no_decay, NULL, &(kiln_param_group){.lr_scale = -1.f}),
      -1);
  TH_ASSERT_ERROR(ctx, KILN_ERR_INVALID, "kiln_optim_add_group", "lr_scale -1", ">= 0");
  kiln_ctx_clear_error(ctx);
  cr_assert_eq(
      kiln_optim_add_group(o, kiln_select_no_decay, NULL, &(kiln_param_group){.weight_decay = NAN}),
      -1);
  TH_ASSERT_ERROR(ctx, KILN_ERR_INVALID, "weight_decay nan");
  kiln_ctx_clear_error(ctx);
  kiln_step_begin(ctx);
  cr_assert_eq(kiln_optim_add_group(o, kiln_select_no_decay, NULL, NULL), -1);
  TH_ASSERT_ERROR(ctx, KILN_ERR_STATE, "kiln_optim_add_group", "outside a step");
  kiln_ctx_clear_error(ctx);
  cr_assert_eq(kiln_step_end(ctx), KILN_OK, "%s", th_err(ctx));

  /* the failed calls changed nothing: the biases have no weight decay, the weights the
   * optimizer's (fc2.weight's group has the optimizer's settings), the weights recorded first */
  th_net_backward(&m);
  int32_t n0 = th_tlen(ctx);
  cr_assert_eq(kiln_optim_step(o), KILN_OK, "%s", th_err(ctx));
  kiln__node *ns[8];
  cr_assert_eq(updates_from(ctx, n0, KILN__OP_SGD, ns, 8), 6);
  int order[6] = {0, 2, 4, 1, 3, 5};
  for (int k = 0; k < 6; k++) {
    int i = param_of(m.params, ns[k]);
    cr_assert_eq(i, order[k], "node %d updates %s", k, kiln_params_name(m.params, i));
    cr_assert_eq(KILN__F(ns[k], SGD, lr), 0.1f);
    cr_assert_eq(KILN__F(ns[k], SGD, weight_decay), i % 2 ? 0.f : 0.01f);
  }
  kiln_optim_free(o);
  th_net_free(&m);
  th_ctx_free(ctx);
}

Test(groups, sgd_nodes_carry_each_groups_rate_and_decay) {
  kiln_ctx *ctx = th_cpu_ctx();
  th_net m;
  th_net_init(&m, ctx, 4, 2, (int64_t[]){6, 5, 3});
  kiln_sgd_options so = {.lr = 0.1f, .momentum = 0.9f, .weight_decay = 0.01f};
  kiln_optim *o = kiln_sgd_new(m.params, &so);
  cr_assert_not_null(o, "%s", th_err(ctx));
  cr_assert_eq(kiln_optim_add_group(o, kiln_select_no_decay, NULL,
                                    &(kiln_param_group){.weight_decay = KILN_ZERO}),
               2);
  cr_assert_eq(kiln_optim_add_group(o, kiln_select_prefix, "fc2.weight",
                                    &(kiln_param_group){.lr_scale = 0.5f}),
               1);
  th_net_backward(&m);
  for (int step = 0; step < 2; step++) {
    if (step == 1) kiln_optim_set_lr(o, 0.2f); /* the groups' rates follow the optimizer's */
    float lr = step ? 0.2f : 0.1f;
    int32_t n0 = th_tlen(ctx);
    cr_assert_eq(kiln_optim_step(o), KILN_OK, "%s", th_err(ctx));
    kiln__node *ns[8];
    cr_assert_eq(updates_from(ctx, n0, KILN__OP_SGD_MOMENTUM, ns, 8), 4);
    /* fc1.weight (the optimizer's own group), the biases (no decay, recorded together),
     * fc2.weight (half the rate, the optimizer's decay) */
    int want_order[4] = {0, 1, 3, 2};
    float want_lr[4] = {lr, lr, (float)(lr * 0.5), lr};
    float want_wd[4] = {0.01f, 0.f, 0.01f, 0.f};
    for (int k = 0; k < 4; k++) {
      int i = param_of(m.params, ns[k]);
      cr_assert_eq(i, want_order[k], "node %d updates parameter %d", k, i);
      cr_assert_eq(KILN__F(ns[k], SGD_MOMENTUM, lr), want_lr[i], "step %d %s: lr %g", step,
                   kiln_params_name(m.params, i), KILN__F(ns[k], SGD_MOMENTUM, lr));
      cr_assert_eq(KILN__F(ns[k], SGD_MOMENTUM, weight_decay), want_wd[i], "%s: weight decay %g",
                   kiln_params_name(m.params, i), KILN__F(ns[k], SGD_MOMENTUM, weight_decay));
      cr_assert_eq(KILN__F(ns[k], SGD_MOMENTUM, momentum), 0.9f);
      cr_assert_eq(KILN__F(ns[k], SGD_MOMENTUM, first), step == 0 ? 1.f : 0.f);
    }
  }
  /* groups of equal settings are recorded together (for one multi-tensor launch each):
   * the weights with decay, then the biases without */
  kiln_optim *p = kiln_sgd_new(m.params, &so);
  cr_assert_eq(kiln_optim_add_group(p, kiln_select_no_decay, NULL,
                                    &(kiln_param_group){.weight_decay = KILN_ZERO}),
               2);
  int32_t n0 = th_tlen(ctx);
  cr_assert_eq(kiln_optim_step(p), KILN_OK, "%s", th_err(ctx));
  kiln__node *ns[8];
  cr_assert_eq(updates_from(ctx, n0, KILN__OP_SGD_MOMENTUM, ns, 8), 4);
  int order[4] = {0, 2, 1, 3};
  for (int k = 0; k < 4; k++)
    cr_assert_eq(param_of(m.params, ns[k]), order[k], "node %d updates %s", k,
                 kiln_params_name(m.params, param_of(m.params, ns[k])));
  kiln_optim_free(o);
  kiln_optim_free(p);
  th_net_free(&m);
  th_ctx_free(ctx);
}

Test(groups, adamw_exclusion_frees_and_remakes_state) {
  kiln_ctx *ctx = th_cpu_ctx();
  th_net m;
  th_net_init(&m, ctx, 4, 2, (int64_t[]){6, 5, 3});
  kiln_optim *o = kiln_adamw_new(m.params, &(kiln_adam_options){.lr = 1e-2f});
  cr_assert_not_null(o, "%s", th_err(ctx));
  int before = ctx->npersistent;
  cr_assert_eq(
      kiln_optim_add_group(o, kiln_select_prefix, "fc1.", &(kiln_param_group){.exclude = 1}), 2);
  cr_assert_eq(ctx->npersistent, before - 4, "fc1's exp_avg and exp_avg_sq are freed");
  cr_assert_eq(
      kiln_optim_add_group(o, kiln_select_prefix, "fc1.", &(kiln_param_group){.exclude = 1}), 2);
  cr_assert_eq(ctx->npersistent, before - 4, "excluding twice frees nothing more");
  th_net_backward(&m);
  for (int step = 1; step <= 2; step++) {
    int32_t n0 = th_tlen(ctx);
    cr_assert_eq(kiln_optim_step(o), KILN_OK, "%s", th_err(ctx));
    kiln__node *ns[8];
    cr_assert_eq(updates_from(ctx, n0, KILN__OP_ADAM, ns, 8), 2, "fc1 is left alone");
    for (int k = 0; k < 2; k++) {
      int i = param_of(m.params, ns[k]);
      cr_assert_eq(i, 2 + k);
      cr_assert_eq(KILN__F(ns[k], ADAM, weight_decay), 1e-2f, "AdamW's default decay");
      cr_assert_eq(KILN__F(ns[k], ADAM, step_size),
                   (float)(1e-2f / (1.0 - pow((double)0.9f, step))));
    }
  }
  /* taken back (with no decay and a tenth of the rate): new zero state, counted from step 1 */
  cr_assert_eq(
      kiln_optim_add_group(o, kiln_select_prefix, "fc1.",
                           &(kiln_param_group){.lr_scale = 0.1f, .weight_decay = KILN_ZERO}),
      2);
  cr_assert_eq(ctx->npersistent, before);
  int32_t n0 = th_tlen(ctx);
  cr_assert_eq(kiln_optim_step(o), KILN_OK, "%s", th_err(ctx));
  kiln__node *ns[8];
  cr_assert_eq(updates_from(ctx, n0, KILN__OP_ADAM, ns, 8), 4);
  for (int k = 0; k < 4; k++) {
    int i = param_of(m.params, ns[k]);
    char want[64];
    snprintf(want, sizeof want, "%s.exp_avg_sq", kiln_params_name(m.params, i));
    cr_assert_str_eq(kiln_tensor_name(ns[k]->in[3]), want);
    float lr = i < 2 ? (float)(1e-2f * (double)0.1f) : 1e-2f;
    int t = i < 2 ? 1 : 3;
    cr_assert_eq(KILN__F(ns[k], ADAM, lr), lr, "%s: lr %g", kiln_params_name(m.params, i),
                 KILN__F(ns[k], ADAM, lr));
    cr_assert_eq(KILN__F(ns[k], ADAM, weight_decay), i < 2 ? 0.f : 1e-2f);
    cr_assert_eq(KILN__F(ns[k], ADAM, step_size), (float)(lr / (1.0 - pow((double)0.9f, t))),
                 "%s: bias correction of step %d", kiln_params_name(m.params, i), t);
  }
  kiln_optim_free(o);
  th_net_free(&m);
  th_ctx_free(ctx);
}

static int select_all(const char *name, const kiln_tensor *t, void *user) {
  (void)name;
  (void)t;
  (void)user;
  return 1;
}

/* As torch.optim, a parameter is in one group at most: a group selecting one that an earlier
 * group trains is refused, naming both, and changes nothing (no group, no state, no group
 * number); a parameter an earlier group excluded may be taken back. */
Test(groups, a_parameter_in_two_groups_is_refused_and_nothing_changes) {
  kiln_ctx *ctx = th_cpu_ctx();
  th_net m;
  th_net_init(&m, ctx, 4, 2, (int64_t[]){6, 5, 3});
  kiln_optim *o = kiln_adamw_new(m.params, &(kiln_adam_options){.lr = 1e-2f});
  cr_assert_not_null(o, "%s", th_err(ctx));
  int full = ctx->npersistent;
  /* group 1 leaves fc1 out (its state freed), group 2 gives fc2.weight half the rate */
  cr_assert_eq(
      kiln_optim_add_group(o, kiln_select_prefix, "fc1.", &(kiln_param_group){.exclude = 1}), 2);
  cr_assert_eq(kiln_optim_add_group(o, kiln_select_prefix, "fc2.weight",
                                    &(kiln_param_group){.lr_scale = 0.5f}),
               1);
  int before = ctx->npersistent;
  cr_assert_eq(before, full - 4, "fc1's exp_avg and exp_avg_sq are freed");

  /* every parameter: fc1's two come first and would be taken back (their state made) before
   * fc2.weight, which group 2 trains, is refused */
  cr_assert_eq(kiln_optim_add_group(o, select_all, NULL, &(kiln_param_group){.lr_scale = 2.f}), -1);
  TH_ASSERT_ERROR(ctx, KILN_ERR_INVALID, "kiln_optim_add_group", "fc2.weight", "already in group 2",
                  "lr_scale 0.5", "weight_decay the optimizer's", "one group at most");
  kiln_ctx_clear_error(ctx);
  cr_assert_eq(ctx->npersistent, before, "the state made for fc1 was freed again");
  /* the same settings again, or an exclusion, are refused too */
  cr_assert_eq(kiln_optim_add_group(o, kiln_select_prefix, "fc2.weight",
                                    &(kiln_param_group){.lr_scale = 0.5f}),
               -1);
  TH_ASSERT_ERROR(ctx, KILN_ERR_INVALID, "kiln_optim_add_group", "fc2.weight",
                  "already in group 2");
  kiln_ctx_clear_error(ctx);
  cr_assert_eq(
      kiln_optim_add_group(o, kiln_select_prefix, "fc2.weight", &(kiln_param_group){.exclude = 1}),
      -1);
  TH_ASSERT_ERROR(ctx, KILN_ERR_INVALID, "kiln_optim_add_group", "fc2.weight",
                  "already in group 2");
  kiln_ctx_clear_error(ctx);
  cr_assert_eq(ctx->npersistent, before);

  /* the biases without decay: fc2.bias from the optimizer's own group, fc1.bias taken back from
   * group 1's exclusion (new state); the failed calls took no number, so this is group 3 */
  cr_assert_eq(kiln_optim_add_group(o, kiln_select_no_decay, NULL,
                                    &(kiln_param_group){.weight_decay = KILN_ZERO}),
               2);
  cr_assert_eq(ctx->npersistent, before + 2, "fc1.bias's exp_avg and exp_avg_sq");
  cr_assert_eq(kiln_optim_add_group(o, kiln_select_prefix, "fc1.bias", NULL), -1);
  TH_ASSERT_ERROR(ctx, KILN_ERR_INVALID, "kiln_optim_add_group", "fc1.bias", "already in group 3",
                  "lr_scale 1", "weight_decay 0");
  kiln_ctx_clear_error(ctx);
  /* ... and excluded once more (group 1's fc1.weight with it): allowed, as it was left out */
  cr_assert_eq(
      kiln_optim_add_group(o, kiln_select_prefix, "fc1.weight", &(kiln_param_group){.exclude = 1}),
      1);
  th_assert_ok(ctx);

  /* what the step records is what the successful calls set: fc1.weight left alone, the biases
   * at the optimizer's rate without decay, fc2.weight at half the rate with AdamW's decay */
  th_net_backward(&m);
  int32_t n0 = th_tlen(ctx);
  cr_assert_eq(kiln_optim_step(o), KILN_OK, "%s", th_err(ctx));
  kiln__node *ns[8];
  cr_assert_eq(updates_from(ctx, n0, KILN__OP_ADAM, ns, 8), 3);
  int want_order[3] = {1, 3, 2};
  for (int k = 0; k < 3; k++) {
    int i = param_of(m.params, ns[k]);
    cr_assert_eq(i, want_order[k], "node %d updates %s", k, kiln_params_name(m.params, i));
    float lr = i == 2 ? (float)((double)1e-2f * 0.5f) : 1e-2f;
    cr_assert_eq(KILN__F(ns[k], ADAM, lr), lr, "%s: lr %g", kiln_params_name(m.params, i),
                 KILN__F(ns[k], ADAM, lr));
    cr_assert_eq(KILN__F(ns[k], ADAM, weight_decay), i == 2 ? 1e-2f : 0.f);
  }
  kiln_optim_free(o);
  th_net_free(&m);
  th_ctx_free(ctx);
}

/* ---------------------------------------------------------------- clipping */

Test(clip, records_the_norm_and_scales_every_gradient) {
  kiln_ctx *ctx = th_cpu_ctx();
  th_net m;
  th_net_init(&m, ctx, 4, 2, (int64_t[]){6, 5, 3});
  kiln_tensor *stat = th_new(ctx, KILN_DTYPE_F32, KILN_SHAPE(5));
  cr_assert_eq(kiln_params_add_buffer(m.params, "bn.running_var", stat), KILN_OK);

  /* bad max_norm: NULL, nothing recorded */
  float bad[] = {0.f, -1.f, INFINITY, NAN};
  for (int k = 0; k < 4; k++) {
    char want[32];
    snprintf(want, sizeof want, "max_norm %g", bad[k]);
    TH_EXPECT_FAIL(ctx, kiln_clip_grad_norm(m.params, bad[k]), KILN_ERR_INVALID,
                   "kiln_clip_grad_norm", want, "finite and > 0");
  }
  cr_assert_null(kiln_clip_grad_norm(NULL, 1.f));

  /* no gradient yet: a zero scalar, no update */
  int32_t n0 = th_tlen(ctx);
  kiln_tensor *z = kiln_clip_grad_norm(m.params, 1.f);
  cr_assert_not_null(z, "%s", th_err(ctx));
  cr_assert_eq(kiln_tensor_numel(z), 1);
  cr_assert_eq(th_count_ops(ctx, n0, th_tlen(ctx), KILN__OP_FILL), 1);
  cr_assert_eq(th_count_ops(ctx, n0, th_tlen(ctx), KILN__OP_SCALE), 0);
  cr_assert_eq(KILN__F(kiln__producer(z), FILL, value), 0.f);

  th_net_backward(&m);
  n0 = th_tlen(ctx);
  kiln_tensor *total = kiln_clip_grad_norm(m.params, 0.25f);
  cr_assert_not_null(total, "%s", th_err(ctx));
  th_assert_shape(total, KILN_SCALAR_SHAPE);
  cr_assert(!kiln_tensor_requires_grad(total));
  int32_t n1 = th_tlen(ctx);
  cr_assert_eq(th_count_ops(ctx, n0, n1, KILN__OP_SUM), 4, "one sum of squares per gradient");
  cr_assert_eq(th_count_ops(ctx, n0, n1, KILN__OP_SQRT), 1);
  cr_assert_eq(th_count_ops(ctx, n0, n1, KILN__OP_SCALE), 4, "each gradient scaled in place");
  cr_assert_eq(th_node(ctx, n1 - 4)->op, KILN__OP_SCALE,
               "the four scales are the last nodes, one after another (one multi-tensor launch)");
  /* the coefficient: max_norm (a fill, a step value) over total + 1e-6, at most 1 */
  bool has_max = false;
  for (int32_t i = n0; i < n1; i++) {
    kiln__node *n = th_node(ctx, i);
    if (n->op == KILN__OP_FILL && KILN__F(n, FILL, value) == 0.25f) has_max = true;
    if (n->op == KILN__OP_ADD_SCALAR) cr_assert_eq(KILN__F(n, ADD_SCALAR, s), 1e-6f);
    if (n->op != KILN__OP_SCALE) continue;
    kiln_tensor *g = n->in[0];
    bool is_grad = false;
    for (int p = 0; p < 4; p++)
      is_grad |= g == kiln_tensor_grad(kiln_params_get(m.params, p));
    cr_assert(is_grad, "a scale writes '%s', not a gradient", kiln_tensor_name(g));
    cr_assert_eq(kiln_tensor_numel(n->in[1]), 1, "the factor is one value");
    cr_assert_eq(kiln__producer(n->in[1])->op, KILN__OP_MINIMUM, "the factor is min(..., 1)");
  }
  cr_assert(has_max, "max_norm is a fill node's value");
  th_assert_ok(ctx);
  th_net_free(&m);
  th_ctx_free(ctx);
}

/* A training step with clipping and groups plans and compiles every group without a GPU. */
Test(clip, a_step_with_clipping_and_groups_plans_without_a_gpu) {
  kiln_ctx *ctx = th_cpu_ctx();
  th_net m;
  th_net_init(&m, ctx, 16, 3, (int64_t[]){32, 24, 16, 10});
  for (int adam = 0; adam < 2; adam++) {
    kiln_optim *o =
        adam ? kiln_adamw_new(m.params, NULL)
             : kiln_sgd_new(m.params, &(kiln_sgd_options){
                                          .lr = 0.05f, .momentum = 0.9f, .weight_decay = 1e-4f});
    cr_assert_not_null(o, "%s", th_err(ctx));
    cr_assert_eq(kiln_optim_add_group(o, kiln_select_no_decay, NULL,
                                      &(kiln_param_group){.weight_decay = KILN_ZERO}),
                 3);
    cr_assert_eq(kiln_optim_add_group(o, kiln_select_prefix, "fc1.weight",
                                      &(kiln_param_group){.exclude = 1}),
                 1);
    for (int step = 0; step < 2; step++) {
      kiln_step_begin(ctx);
      kiln_optim_zero_grad(o);
      cr_assert_eq(kiln_backward(th_net_loss(&m)), KILN_OK, "%s", th_err(ctx));
      cr_assert_not_null(kiln_clip_grad_norm(m.params, 1.f), "%s", th_err(ctx));
      cr_assert_eq(kiln_optim_step(o), KILN_OK, "%s", th_err(ctx));
      int32_t nodes = th_tlen(ctx);
      cr_assert_eq(kiln_step_end(ctx), KILN_OK, "%s step %d: %s", adam ? "AdamW" : "SGD", step,
                   th_err(ctx));
      kiln_exec_stats st;
      kiln_stats(ctx, &st);
      cr_assert_eq(st.last_flush.nodes, (uint64_t)nodes, "the whole step was planned");
      cr_assert_gt(st.last_flush.groups, 0);
      cr_assert_gt(st.last_flush.compiled + st.last_flush.cache_hits, 0,
                   "its kernels were compiled or found compiled");
      cr_assert_eq(st.nodes_executed, 0, "nothing ran");
    }
    cr_assert_eq(kiln_optim_steps(o), 2);
    kiln_optim_free(o);
  }
  th_net_free(&m);
  th_ctx_free(ctx);
}
