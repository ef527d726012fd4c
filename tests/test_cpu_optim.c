/*
 * test_cpu_optim.c: optimizers as recorded update nodes on a no-GPU context: SGD (plain, momentum,
 * Nesterov, weight decay), Adam and AdamW with their bias corrections, changes to the parameter
 * list caught, and the learning-rate schedules (against PyTorch's numbers) attached to an
 * optimizer.
 */
#include <math.h>
#include <string.h>

#include "inspect.h"

/* The update nodes of op recorded from first on, in order; returns how many. */
static int update_nodes(kiln_ctx *ctx, int32_t first, kiln__op op, kiln__node **out, int max) {
  int k = 0;
  for (int32_t i = first; i < th_tlen(ctx); i++) {
    kiln__node *n = th_node(ctx, i);
    cr_assert_eq(n->op, op, "node #%d after the step is %s, want only %s", i, th_op_name(n->op),
                 th_op_name(op));
    if (k < max) out[k] = n;
    k++;
  }
  return k;
}

Test(optim, sgd_momentum_nodes) {
  kiln_ctx *ctx = th_cpu_ctx();
  th_net m;
  th_net_init(&m, ctx, 8, 2, (int64_t[]){6, 4, 3});
  kiln_sgd_options o = kiln_sgd_defaults(0.05f);
  o.momentum = 0.9f;
  o.weight_decay = 1e-4f;
  o.nesterov = 1;
  kiln_optim *opt = kiln_sgd_new(m.params, &o);
  cr_assert_not_null(opt, "%s", kiln_ctx_error(ctx));
  cr_assert_float_eq(kiln_optim_lr(opt), 0.05f, 0);
  int32_t n0 = th_tlen(ctx);
  cr_assert_eq(kiln_optim_step(opt), KILN_OK);
  cr_assert_eq(th_tlen(ctx), n0, "parameters without gradients are left alone");
  cr_assert_eq(kiln_optim_steps(opt), 1);

  th_net_backward(&m);
  for (int step = 0; step < 2; step++) {
    n0 = th_tlen(ctx);
    cr_assert_eq(kiln_optim_step(opt), KILN_OK, "%s", kiln_ctx_error(ctx));
    kiln__node *ns[8];
    cr_assert_eq(update_nodes(ctx, n0, KILN__OP_SGD_MOMENTUM, ns, 8), 4);
    for (int i = 0; i < 4; i++) {
      kiln__node *n = ns[i];
      kiln_tensor *p = kiln_params_get(m.params, i);
      cr_assert_eq(n->nin, 3);
      cr_assert_eq(n->in[0], p);
      cr_assert_eq(n->in[1], kiln_tensor_grad(p));
      char want[64];
      snprintf(want, sizeof want, "%s.momentum_buffer", kiln_params_name(m.params, i));
      cr_assert_str_eq(kiln_tensor_name(n->in[2]), want);
      cr_assert(kiln_tensor_is_persistent(n->in[2]));
      th_assert_shape(n->in[2], kiln_tensor_shape(p));
      cr_assert_eq(KILN__F(n, SGD_MOMENTUM, lr), 0.05f);
      cr_assert_eq(KILN__F(n, SGD_MOMENTUM, momentum), 0.9f);
      cr_assert_eq(KILN__F(n, SGD_MOMENTUM, dampening), 0.f);
      cr_assert_eq(KILN__F(n, SGD_MOMENTUM, weight_decay), 1e-4f);
      cr_assert_eq(KILN__I(n, SGD_MOMENTUM, nesterov), 1, "nesterov");
      cr_assert_eq(KILN__F(n, SGD_MOMENTUM, first), step == 0 ? 1.f : 0.f,
                   "step %d: the first update flag is %g", step, KILN__F(n, SGD_MOMENTUM, first));
    }
  }
  cr_assert_eq(kiln_optim_steps(opt), 3);
  kiln_optim_set_lr(opt, 0.01f);
  n0 = th_tlen(ctx);
  kiln_optim_step(opt);
  cr_assert_eq(KILN__F(th_node(ctx, n0), SGD_MOMENTUM, lr), 0.01f);
  kiln_optim_set_lr(opt, -1.f);
  TH_ASSERT_ERROR(ctx, KILN_ERR_INVALID, "kiln_optim_set_lr");
  kiln_ctx_clear_error(ctx);
  cr_assert_eq(kiln_optim_lr(opt), 0.01f);

  /* plain SGD updates (p, g) with lr and weight decay */
  kiln_optim *plain = kiln_sgd_new(m.params, &(kiln_sgd_options){.lr = 0.2f, .weight_decay = 0.5f});
  n0 = th_tlen(ctx);
  cr_assert_eq(kiln_optim_step(plain), KILN_OK);
  kiln__node *ns[8];
  cr_assert_eq(update_nodes(ctx, n0, KILN__OP_SGD, ns, 8), 4);
  cr_assert_eq(ns[0]->nin, 2);
  cr_assert_eq(KILN__F(ns[0], SGD, lr), 0.2f);
  cr_assert_eq(KILN__F(ns[0], SGD, weight_decay), 0.5f);

  /* bad options */
  o = kiln_sgd_defaults(0.1f);
  o.nesterov = 1;
  cr_assert_null(kiln_sgd_new(m.params, &o));
  TH_ASSERT_ERROR(ctx, KILN_ERR_INVALID, "kiln_sgd_new", "Nesterov");
  kiln_ctx_clear_error(ctx);
  o.lr = -1.f;
  o.nesterov = 0;
  cr_assert_null(kiln_sgd_new(m.params, &o));
  TH_ASSERT_ERROR(ctx, KILN_ERR_INVALID, "kiln_sgd_new", "lr -1");
  kiln_ctx_clear_error(ctx);
  /* freed at the end: see bug_tensor_free_fails_a_no_gpu_context */
  kiln_optim_free(opt);
  kiln_optim_free(plain);
  th_net_free(&m);
  th_ctx_free(ctx);
}

/* Asserts one Adam step's nodes against the formulas of optim/optim.c for step t. */
static void assert_adam_step(kiln_ctx *ctx, int32_t first, th_net *m, kiln_optim *opt,
                             const kiln_adam_options *a, float lr, int t, int decoupled) {
  kiln__node *ns[8];
  cr_assert_eq(update_nodes(ctx, first, KILN__OP_ADAM, ns, 8), 4);
  (void)opt;
  float step_size = (float)((double)lr / (1.0 - pow((double)a->beta1, t)));
  float bc2s = (float)sqrt(1.0 - pow((double)a->beta2, t));
  for (int i = 0; i < 4; i++) {
    kiln__node *n = ns[i];
    kiln_tensor *p = kiln_params_get(m->params, i);
    cr_assert_eq(n->nin, 4);
    cr_assert_eq(n->in[0], p);
    cr_assert_eq(n->in[1], kiln_tensor_grad(p));
    char want[64];
    snprintf(want, sizeof want, "%s.exp_avg", kiln_params_name(m->params, i));
    cr_assert_str_eq(kiln_tensor_name(n->in[2]), want);
    snprintf(want, sizeof want, "%s.exp_avg_sq", kiln_params_name(m->params, i));
    cr_assert_str_eq(kiln_tensor_name(n->in[3]), want);
    cr_assert_eq(KILN__F(n, ADAM, lr), lr);
    cr_assert_eq(KILN__F(n, ADAM, beta1), a->beta1);
    cr_assert_eq(KILN__F(n, ADAM, beta2), a->beta2);
    cr_assert_eq(KILN__F(n, ADAM, eps), a->eps);
    cr_assert_eq(KILN__F(n, ADAM, weight_decay), a->weight_decay);
    float got = KILN__F(n, ADAM, step_size);
    cr_assert_eq(got, step_size, "step %d: lr / bias correction 1 is %.9g, want %.9g", t, got,
                 step_size);
    got = KILN__F(n, ADAM, bc2_sqrt);
    cr_assert_eq(got, bc2s, "step %d: sqrt(bias correction 2) is %.9g, want %.9g", t, got, bc2s);
    cr_assert_eq(KILN__I(n, ADAM, decoupled), decoupled);
  }
}

Test(optim, adam_and_adamw_nodes) {
  kiln_ctx *ctx = th_cpu_ctx();
  th_net m;
  th_net_init(&m, ctx, 8, 2, (int64_t[]){6, 4, 3});
  th_net_backward(&m);
  kiln_adam_options a = kiln_adam_defaults();
  cr_assert_eq(a.lr, 1e-3f);
  cr_assert_eq(a.beta1, 0.9f);
  cr_assert_eq(a.beta2, 0.999f);
  cr_assert_eq(a.eps, 1e-8f);
  cr_assert_eq(a.weight_decay, 0.f);
  a.beta1 = 0.7f; /* the fast MNIST recipe's betas */
  a.beta2 = 0.9f;
  a.lr = 1e-2f;
  kiln_optim *adam = kiln_adam_new(m.params, &a);
  cr_assert_not_null(adam, "%s", kiln_ctx_error(ctx));
  for (int t = 1; t <= 3; t++) {
    int32_t n0 = th_tlen(ctx);
    cr_assert_eq(kiln_optim_step(adam), KILN_OK, "%s", kiln_ctx_error(ctx));
    assert_adam_step(ctx, n0, &m, adam, &a, a.lr, t, 0);
  }
  /* the bias corrections follow the step count, the step size the current lr */
  kiln_optim_set_lr(adam, 5e-3f);
  int32_t n0 = th_tlen(ctx);
  kiln_optim_step(adam);
  assert_adam_step(ctx, n0, &m, adam, &a, 5e-3f, 4, 0);

  kiln_adam_options w = kiln_adamw_defaults();
  cr_assert_eq(w.weight_decay, 1e-2f);
  kiln_optim *adamw = kiln_adamw_new(m.params, NULL);
  cr_assert_not_null(adamw, "%s", kiln_ctx_error(ctx));
  n0 = th_tlen(ctx);
  cr_assert_eq(kiln_optim_step(adamw), KILN_OK);
  assert_adam_step(ctx, n0, &m, adamw, &w, w.lr, 1, 1);

  a.beta1 = 1.f;
  cr_assert_null(kiln_adam_new(m.params, &a));
  TH_ASSERT_ERROR(ctx, KILN_ERR_INVALID, "kiln_adam_new", "betas");
  kiln_ctx_clear_error(ctx);
  kiln_optim_free(adam); /* at the end: see bug_tensor_free_fails_a_no_gpu_context */
  kiln_optim_free(adamw);
  th_net_free(&m);
  th_ctx_free(ctx);
}

Test(optim, parameter_list_changes_are_caught) {
  kiln_ctx *ctx = th_cpu_ctx();
  th_net m;
  th_net_init(&m, ctx, 8, 1, (int64_t[]){6, 3});
  kiln_optim *opt = kiln_sgd_new(m.params, NULL);
  cr_assert_not_null(opt);
  cr_assert_eq(kiln_params_add(m.params, "extra", th_new(ctx, KILN_DTYPE_F32, KILN_SHAPE(2))),
               KILN_OK);
  cr_assert_eq(kiln_optim_step(opt), KILN_ERR_STATE);
  TH_ASSERT_ERROR(ctx, KILN_ERR_STATE, "kiln_optim_step", "3 parameters", "made for 2");
  kiln_ctx_clear_error(ctx);
  cr_assert_eq(kiln_params_add(m.params, "view", kiln_relu(m.x)), KILN_ERR_INVALID);
  TH_ASSERT_ERROR(ctx, KILN_ERR_INVALID, "kiln_params_add", "intermediate");
  kiln_ctx_clear_error(ctx);
  kiln_optim_free(opt);
  th_net_free(&m);
  th_ctx_free(ctx);
}

Test(optim, learning_rate_schedules) {
  kiln_schedule c = {.kind = KILN_SCHEDULE_CONSTANT, .base_lr = 0.1f};
  cr_assert_float_eq(kiln_schedule_lr(&c, 1000), 0.1f, 0.f);
  kiln_schedule st = {.kind = KILN_SCHEDULE_STEP, .base_lr = 1.f, .step_size = 10, .gamma = 0.5f};
  cr_assert_float_eq(kiln_schedule_lr(&st, 9), 1.f, 0.f);
  cr_assert_float_eq(kiln_schedule_lr(&st, 10), 0.5f, 0.f);
  cr_assert_float_eq(kiln_schedule_lr(&st, 25), 0.25f, 0.f);
  kiln_schedule co = {
      .kind = KILN_SCHEDULE_COSINE, .base_lr = 1.f, .total_steps = 100, .min_lr = 0.1f};
  cr_assert_float_eq(kiln_schedule_lr(&co, 0), 1.f, 1e-7);
  cr_assert_float_eq(kiln_schedule_lr(&co, 50), 0.55f, 1e-6);
  cr_assert_float_eq(kiln_schedule_lr(&co, 100), 0.1f, 1e-7);
  cr_assert_float_eq(kiln_schedule_lr(&co, 25), 0.1 + 0.9 * (1 + cos(M_PI / 4)) / 2, 1e-6);
  kiln_schedule wl = {
      .kind = KILN_SCHEDULE_WARMUP_LINEAR, .base_lr = 2.f, .total_steps = 110, .warmup_steps = 10};
  cr_assert_float_eq(kiln_schedule_lr(&wl, 0), 0.f, 0.f);
  cr_assert_float_eq(kiln_schedule_lr(&wl, 5), 1.f, 1e-7);
  cr_assert_float_eq(kiln_schedule_lr(&wl, 10), 2.f, 1e-7);
  cr_assert_float_eq(kiln_schedule_lr(&wl, 60), 1.f, 1e-6);
  cr_assert_float_eq(kiln_schedule_lr(&wl, 200), 0.f, 0.f);
  /* torch.optim.lr_scheduler.OneCycleLR(max_lr=1, total_steps=100) with its defaults (pct_start
   * 0.3, cosine, div_factor 25, final_div_factor 1e4): 0.04 at step 0, 1 at step 29, 4e-6 at 99 */
  kiln_schedule oc = {.kind = KILN_SCHEDULE_ONE_CYCLE, .base_lr = 1.f, .total_steps = 100};
  cr_assert_float_eq(kiln_schedule_lr(&oc, 0), 0.04f, 1e-7);
  cr_assert_float_eq(kiln_schedule_lr(&oc, 29), 1.f, 1e-6);
  cr_assert_float_eq(kiln_schedule_lr(&oc, 99), 4e-6f, 1e-9);
  cr_assert_float_eq(kiln_schedule_lr(&oc, 14), 0.04 + 0.96 * (1 - cos(M_PI * 14 / 29)) / 2, 1e-6);
  /* attached to an optimizer, each step takes the rate of its step count */
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_params *p = kiln_params_new(ctx);
  kiln_linear l;
  cr_assert_eq(kiln_linear_init(&l, p, &(kiln_linear_options){.name = "fc", .in = 4, .out = 3}),
               KILN_OK);
  kiln_optim *o = kiln_sgd_new(p, &(kiln_sgd_options){.lr = 9.f});
  kiln_optim_set_schedule(o, &co);
  for (int t = 0; t < 3; t++) {
    kiln_tensor *loss =
        kiln_sum(kiln_linear_forward(&l, kiln_full(ctx, KILN_SHAPE(2, 4), 1.f)), KILN_ALL_AXES, 0);
    cr_assert_eq(kiln_backward(loss), KILN_OK, "%s", kiln_ctx_error(ctx));
    cr_assert_eq(kiln_optim_step(o), KILN_OK, "%s", kiln_ctx_error(ctx));
    cr_assert_float_eq(kiln_optim_lr(o), kiln_schedule_lr(&co, t), 0.f);
    const kiln__node *n = &ctx->trace.nodes[ctx->trace.n - 1];
    cr_assert_eq(n->op, KILN__OP_SGD);
    cr_assert_float_eq(KILN__F(n, SGD, lr), kiln_schedule_lr(&co, t), 0.f,
                       "the update node carries the rate");
    kiln_step_begin(ctx);
  }
  kiln_optim_free(o);
  kiln_params_free(p);
  th_ctx_free(ctx);
}
