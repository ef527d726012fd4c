/*
 * test_cpu_api.c: what a new user of the public API runs into (issue 12), without a GPU: options
 * structs whose zero fields are PyTorch's defaults (and KILN_ZERO for an exact 0), fields with no
 * default that are errors naming them, kiln_backward twice and unbalanced no-grad regions, the
 * one-cycle schedule's momentum cycling and Adam's L2 against AdamW's decoupled decay, data sets
 * from host arrays (the readers' uint8 labels, statistics computed from the data) and their
 * statistics, a whole training step planned and compiled by a context without a GPU, and the
 * parameter names the layers make.
 */
#include <math.h>
#include <string.h>

#include "inspect.h"

TestSuite(api, .fini = th_remove_tmpdirs);

/* The first node of op in the trace at or after first; asserts there is one. */
static kiln__node *find_op(kiln_ctx *ctx, int32_t first, kiln__op op) {
  for (int32_t i = first; i < th_tlen(ctx); i++)
    if (th_node(ctx, i)->op == op) return th_node(ctx, i);
  cr_assert_fail("no %s node from #%d on", th_op_name(op), first);
  return NULL;
}

/* A one-layer net whose parameters all have gradients, for optimizers to update. */
static void net_with_grads(kiln_ctx *ctx, th_net *m) {
  th_net_init(m, ctx, 4, 1, (int64_t[]){3, 2});
  th_net_backward(m);
}

/* Records one step of o and returns its first update node of op. */
static kiln__node *one_update(kiln_ctx *ctx, kiln_optim *o, kiln__op op) {
  cr_assert_not_null(o, "%s", th_err(ctx));
  int32_t n0 = th_tlen(ctx);
  cr_assert_eq(kiln_optim_step(o), KILN_OK, "%s", th_err(ctx));
  return find_op(ctx, n0, op);
}

/* ---------------------------------------------------------------- point 2: zero means default */

Test(api, kiln_zero_is_a_negative_zero) {
  cr_assert(KILN_ZERO == 0.f);
  cr_assert(signbit(KILN_ZERO));
}

Test(api, zero_adam_fields_are_torch_defaults) {
  kiln_ctx *ctx = th_cpu_ctx();
  th_net m;
  net_with_grads(ctx, &m);
  /* torch.optim.Adam(lr=1e-3): betas 0.9 and 0.999, eps 1e-8, no weight decay (L2) */
  kiln_optim *o = kiln_adam_new(m.params, &(kiln_adam_options){.lr = 1e-3f});
  kiln__node *n = one_update(ctx, o, KILN__OP_ADAM);
  cr_assert_float_eq(KILN__F(n, ADAM, lr), 1e-3f, 0.f);
  cr_assert_float_eq(KILN__F(n, ADAM, beta1), 0.9f, 0.f);
  cr_assert_float_eq(KILN__F(n, ADAM, beta2), 0.999f, 0.f);
  cr_assert_float_eq(KILN__F(n, ADAM, eps), 1e-8f, 0.f);
  cr_assert_float_eq(KILN__F(n, ADAM, weight_decay), 0.f, 0.f);
  cr_assert_eq(KILN__I(n, ADAM, decoupled), 0, "Adam's weight decay is L2");
  /* bias correction of the first step with beta1 0.9 */
  cr_assert_float_eq(KILN__F(n, ADAM, step_size), 1e-3 / (1 - 0.9), 1e-8);
  kiln_optim_free(o);
  /* an all-zero struct and NULL are the same: every default, lr 1e-3 included */
  kiln_optim *z = kiln_adam_new(m.params, &(kiln_adam_options){0});
  n = one_update(ctx, z, KILN__OP_ADAM);
  cr_assert_float_eq(KILN__F(n, ADAM, lr), 1e-3f, 0.f);
  cr_assert_float_eq(KILN__F(n, ADAM, beta2), 0.999f, 0.f);
  kiln_optim_free(z);
  /* KILN_ZERO is an exact 0 where the default is not: beta1 0 (no bias correction left) */
  kiln_optim *b0 =
      kiln_adam_new(m.params, &(kiln_adam_options){.lr = 0.01f, .beta1 = KILN_ZERO, .eps = 1e-6f});
  n = one_update(ctx, b0, KILN__OP_ADAM);
  cr_assert_float_eq(KILN__F(n, ADAM, beta1), 0.f, 0.f);
  cr_assert(!signbit(KILN__F(n, ADAM, beta1)), "KILN_ZERO reaches the kernel as +0");
  cr_assert_float_eq(KILN__F(n, ADAM, eps), 1e-6f, 0.f, "a set field is kept");
  cr_assert_float_eq(KILN__F(n, ADAM, step_size), 0.01f, 0.f);
  kiln_optim_free(b0);
  th_assert_ok(ctx);
  th_net_free(&m);
  th_ctx_free(ctx);
}

Test(api, adamw_weight_decay_zero_is_torch_default_and_kiln_zero_is_none) {
  kiln_ctx *ctx = th_cpu_ctx();
  th_net m;
  net_with_grads(ctx, &m);
  /* torch.optim.AdamW(lr=1e-3): weight_decay 1e-2, decoupled */
  kiln_optim *w = kiln_adamw_new(m.params, &(kiln_adam_options){.lr = 1e-3f});
  kiln__node *n = one_update(ctx, w, KILN__OP_ADAM);
  cr_assert_float_eq(KILN__F(n, ADAM, weight_decay), 1e-2f, 0.f);
  cr_assert_eq(KILN__I(n, ADAM, decoupled), 1, "AdamW's weight decay is decoupled");
  cr_assert_float_eq(KILN__F(n, ADAM, beta1), 0.9f, 0.f);
  kiln_optim_free(w);
  kiln_optim *none =
      kiln_adamw_new(m.params, &(kiln_adam_options){.lr = 1e-3f, .weight_decay = KILN_ZERO});
  n = one_update(ctx, none, KILN__OP_ADAM);
  cr_assert_float_eq(KILN__F(n, ADAM, weight_decay), 0.f, 0.f);
  kiln_optim_free(none);
  /* a zero read at run time (strtof("0") is +0) through kiln_exactly: no decay either */
  kiln_optim *parsed = kiln_adamw_new(
      m.params, &(kiln_adam_options){.lr = 1e-3f, .weight_decay = kiln_exactly(strtof("0", NULL))});
  n = one_update(ctx, parsed, KILN__OP_ADAM);
  cr_assert_float_eq(KILN__F(n, ADAM, weight_decay), 0.f, 0.f, "kiln_exactly keeps a zero a zero");
  kiln_optim_free(parsed);
  cr_assert_float_eq(kiln_exactly(0.3f), 0.3f, 0.f);
  kiln_optim *some =
      kiln_adamw_new(m.params, &(kiln_adam_options){.lr = 1e-3f, .weight_decay = 0.3f});
  n = one_update(ctx, some, KILN__OP_ADAM);
  cr_assert_float_eq(KILN__F(n, ADAM, weight_decay), 0.3f, 0.f);
  kiln_optim_free(some);
  /* Adam's weight decay, when set, is L2 */
  kiln_optim *l2 = kiln_adam_new(m.params, &(kiln_adam_options){.weight_decay = 0.3f});
  n = one_update(ctx, l2, KILN__OP_ADAM);
  cr_assert_float_eq(KILN__F(n, ADAM, weight_decay), 0.3f, 0.f);
  cr_assert_eq(KILN__I(n, ADAM, decoupled), 0);
  kiln_optim_free(l2);
  th_assert_ok(ctx);
  th_net_free(&m);
  th_ctx_free(ctx);
}

Test(api, zero_sgd_fields_are_torch_defaults) {
  kiln_ctx *ctx = th_cpu_ctx();
  th_net m;
  net_with_grads(ctx, &m);
  /* torch.optim.SGD's lr defaults to 1e-3; momentum, dampening and weight decay to 0 */
  kiln_optim *o = kiln_sgd_new(m.params, &(kiln_sgd_options){0});
  kiln__node *n = one_update(ctx, o, KILN__OP_SGD);
  cr_assert_float_eq(KILN__F(n, SGD, lr), 1e-3f, 0.f);
  cr_assert_float_eq(KILN__F(n, SGD, weight_decay), 0.f, 0.f);
  cr_assert_float_eq(kiln_optim_lr(o), 1e-3f, 0.f);
  kiln_optim_free(o);
  kiln_optim *zero = kiln_sgd_new(m.params, &(kiln_sgd_options){.lr = KILN_ZERO});
  n = one_update(ctx, zero, KILN__OP_SGD);
  cr_assert_float_eq(KILN__F(n, SGD, lr), 0.f, 0.f, "KILN_ZERO: a rate of exactly 0");
  kiln_optim_free(zero);
  kiln_optim *mom = kiln_sgd_new(m.params, &(kiln_sgd_options){.lr = 0.1f, .momentum = 0.9f});
  n = one_update(ctx, mom, KILN__OP_SGD_MOMENTUM);
  cr_assert_float_eq(KILN__F(n, SGD_MOMENTUM, momentum), 0.9f, 0.f);
  cr_assert_float_eq(KILN__F(n, SGD_MOMENTUM, dampening), 0.f, 0.f);
  kiln_optim_free(mom);
  th_assert_ok(ctx);
  th_net_free(&m);
  th_ctx_free(ctx);
}

/* The message kiln_optim_set_schedule gives s on an SGD optimizer of rate 0.2 (with momentum
 * when momentum is set); asserts that it fails with KILN_ERR_INVALID, keeps the optimizer's
 * schedule, and that kiln_schedule_lr gives NAN for s. */
static void expect_bad_schedule(const kiln_schedule *s, bool momentum, const char *field) {
  kiln_ctx *ctx = th_cpu_ctx();
  th_net m;
  net_with_grads(ctx, &m);
  kiln_optim *o =
      kiln_sgd_new(m.params, &(kiln_sgd_options){.lr = 0.2f, .momentum = momentum ? 0.9f : 0.f});
  cr_assert_not_null(o, "%s", th_err(ctx));
  kiln_optim_set_schedule(o, s);
  TH_ASSERT_ERROR(ctx, KILN_ERR_INVALID, "kiln_optim_set_schedule", field);
  kiln_ctx_clear_error(ctx);
  cr_assert_eq(kiln_optim_step(o), KILN_OK, "%s", th_err(ctx));
  cr_assert_float_eq(kiln_optim_lr(o), 0.2f, 0.f, "a refused schedule changed the rate");
  kiln_optim_free(o);
  th_net_free(&m);
  th_ctx_free(ctx);
}

Test(api, schedule_fields_without_a_default_are_errors_naming_them) {
  kiln_schedule oc = {.kind = KILN_SCHEDULE_ONE_CYCLE, .base_lr = 0.1f};
  expect_bad_schedule(&oc, true, "total_steps");
  cr_assert(isnan(kiln_schedule_lr(&oc, 0)), "not 4e-9 forever: %g", kiln_schedule_lr(&oc, 0));
  cr_assert(isnan(kiln_schedule_lr(&oc, 1000)));
  kiln_schedule co = {.kind = KILN_SCHEDULE_COSINE, .base_lr = 0.1f};
  expect_bad_schedule(&co, false, "total_steps");
  cr_assert(isnan(kiln_schedule_lr(&co, 3)));
  kiln_schedule wl = {.kind = KILN_SCHEDULE_WARMUP_LINEAR, .base_lr = 0.1f, .warmup_steps = 2};
  expect_bad_schedule(&wl, false, "total_steps");
  kiln_schedule st = {.kind = KILN_SCHEDULE_STEP, .base_lr = 0.1f};
  expect_bad_schedule(&st, false, "step_size");
  cr_assert(isnan(kiln_schedule_lr(&st, 3)));
  /* one-cycle's base_lr is torch's max_lr, which has no default */
  kiln_schedule nomax = {.kind = KILN_SCHEDULE_ONE_CYCLE, .total_steps = 10};
  expect_bad_schedule(&nomax, true, "max_lr");
  cr_assert(isnan(kiln_schedule_lr(&nomax, 0)));
  /* ranges of the fields that do have defaults */
  kiln_schedule badm = {
      .kind = KILN_SCHEDULE_ONE_CYCLE, .base_lr = 0.1f, .total_steps = 10, .max_momentum = 1.5f};
  expect_bad_schedule(&badm, true, "max_momentum");
  kiln_schedule badp = {
      .kind = KILN_SCHEDULE_ONE_CYCLE, .base_lr = 0.1f, .total_steps = 10, .pct_start = -0.5f};
  expect_bad_schedule(&badp, true, "pct_start");
}

Test(api, zero_schedule_fields_are_torch_defaults) {
  /* StepLR's gamma defaults to 0.1 */
  kiln_schedule st = {.kind = KILN_SCHEDULE_STEP, .base_lr = 1.f, .step_size = 2};
  cr_assert_float_eq(kiln_schedule_lr(&st, 1), 1.f, 0.f);
  cr_assert_float_eq(kiln_schedule_lr(&st, 2), 0.1f, 1e-7);
  cr_assert_float_eq(kiln_schedule_lr(&st, 4), 0.01f, 1e-8);
  kiln_schedule st0 = st;
  st0.gamma = KILN_ZERO;
  cr_assert_float_eq(kiln_schedule_lr(&st0, 2), 0.f, 0.f, "KILN_ZERO: gamma exactly 0");
  /* base_lr 0: the optimizer's rate when attached (torch's schedulers start from it) */
  kiln_ctx *ctx = th_cpu_ctx();
  th_net m;
  net_with_grads(ctx, &m);
  kiln_optim *o = kiln_sgd_new(m.params, &(kiln_sgd_options){.lr = 0.2f});
  kiln_schedule co = {.kind = KILN_SCHEDULE_COSINE, .total_steps = 10};
  kiln_optim_set_schedule(o, &co);
  th_assert_ok(ctx);
  for (int t = 0; t < 3; t++) {
    cr_assert_eq(kiln_optim_step(o), KILN_OK, "%s", th_err(ctx));
    cr_assert_float_eq(kiln_optim_lr(o), 0.2 * (1 + cos(M_PI * t / 10)) / 2, 1e-7, "step %d", t);
  }
  /* ... and KILN_ZERO a rate of exactly 0 */
  kiln_optim_set_schedule(o,
                          &(kiln_schedule){.kind = KILN_SCHEDULE_CONSTANT, .base_lr = KILN_ZERO});
  cr_assert_eq(kiln_optim_step(o), KILN_OK, "%s", th_err(ctx));
  cr_assert_float_eq(kiln_optim_lr(o), 0.f, 0.f);
  kiln_optim_free(o);
  th_net_free(&m);
  th_ctx_free(ctx);
}

static kiln_tensor *identity(kiln_tensor *const *in, void *user) {
  (void)user;
  return in[0];
}

Test(api, gradcheck_options_follow_the_rule) {
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_tensor *x = th_param(ctx, KILN_SHAPE(2));
  char report[200];
  /* eps must be > 0: KILN_ZERO asks for a step of 0, which is refused by name */
  cr_assert_eq(kiln_gradcheck(ctx, identity, 1, &x, NULL,
                              &(kiln_gradcheck_options){.eps = KILN_ZERO}, report, sizeof report),
               KILN_ERR_INVALID);
  TH_ASSERT_ERROR(ctx, KILN_ERR_INVALID, "kiln_gradcheck", "eps 0");
  kiln_ctx_clear_error(ctx);
  cr_assert_eq(kiln_gradcheck(ctx, identity, 1, &x, NULL, &(kiln_gradcheck_options){.atol = -1.f},
                              report, sizeof report),
               KILN_ERR_INVALID);
  TH_ASSERT_ERROR(ctx, KILN_ERR_INVALID, "kiln_gradcheck", "atol -1");
  kiln_ctx_clear_error(ctx);
  th_free_scratch();
  th_ctx_free(ctx);
}

/* ---------------------------------------------------------------- point 3: backward twice */

Test(api, backward_twice_on_one_loss_is_an_error) {
  kiln_ctx *ctx = th_cpu_ctx();
  th_net m;
  th_net_init(&m, ctx, 4, 2, (int64_t[]){3, 5, 2});
  kiln_step_begin(ctx);
  kiln_tensor *loss = th_net_loss(&m);
  cr_assert_eq(kiln_backward(loss), KILN_OK, "%s", th_err(ctx));
  int32_t n1 = th_tlen(ctx);
  cr_assert_eq(kiln_backward(loss), KILN_ERR_STATE);
  TH_ASSERT_ERROR(ctx, KILN_ERR_STATE, "kiln_backward", "already backpropagated", "twice");
  cr_assert_eq(th_tlen(ctx), n1, "the refused backward recorded nodes");
  kiln_ctx_clear_error(ctx);
  /* a part of a loss already backpropagated as the whole: the same double count */
  kiln_tensor *a = th_net_loss(&m), *b = kiln_mul_scalar(th_net_loss(&m), 0.5f);
  kiln_tensor *total = kiln_add(a, b);
  cr_assert_eq(kiln_backward(total), KILN_OK, "%s", th_err(ctx));
  cr_assert_eq(kiln_backward(b), KILN_ERR_STATE);
  TH_ASSERT_ERROR(ctx, KILN_ERR_STATE, "kiln_backward", "already backpropagated");
  kiln_ctx_clear_error(ctx);
  /* different losses, even sharing nodes, accumulate: a second head on the same trunk */
  kiln_tensor *logits = th_net_logits(&m);
  kiln_tensor *l1 = kiln_cross_entropy(logits, m.y, KILN_REDUCTION_MEAN, 0.f);
  kiln_tensor *l2 = th_sum_all(kiln_mul(logits, logits));
  cr_assert_eq(kiln_backward(l1), KILN_OK, "%s", th_err(ctx));
  int32_t n2 = th_tlen(ctx);
  cr_assert_eq(kiln_backward(l2), KILN_OK, "%s", th_err(ctx));
  cr_assert_eq(th_count_ops(ctx, n2, th_tlen(ctx), KILN__OP_ACCUM), 4, "accumulated into 4 grads");
  /* a new step's loss is a new loss */
  kiln_step_begin(ctx);
  kiln_tensor *again = th_net_loss(&m);
  cr_assert_eq(kiln_backward(again), KILN_OK, "%s", th_err(ctx));
  th_assert_ok(ctx);
  th_net_free(&m);
  th_ctx_free(ctx);
}

Test(api, a_failed_backward_marks_nothing) {
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_tensor *w = th_new(ctx, KILN_DTYPE_F32, KILN_SHAPE(3));
  kiln_tensor_set_requires_grad(w, 1);
  kiln_tensor *v = th_param(ctx, KILN_SHAPE(3));
  kiln_step_begin(ctx);
  kiln_tensor *loss = kiln_add(th_sum_all(kiln_mul(v, v)), th_sum_all(kiln_relu(w)));
  kiln_tensor_free(w); /* the tape now reads a freed tensor: backward stops there */
  cr_assert_eq(kiln_backward(loss), KILN_ERR_STATE);
  TH_ASSERT_ERROR(ctx, KILN_ERR_STATE, "kiln_backward", "freed");
  kiln_ctx_clear_error(ctx);
  cr_assert_null(kiln_tensor_grad(v), "a failed backward left a gradient");
  /* tried again, it fails for the same reason, not as a second backward */
  cr_assert_eq(kiln_backward(loss), KILN_ERR_STATE);
  TH_ASSERT_ERROR(ctx, KILN_ERR_STATE, "kiln_backward", "freed");
  cr_assert_null(strstr(kiln_ctx_error(ctx), "already"), "%s", kiln_ctx_error(ctx));
  kiln_ctx_clear_error(ctx);
  th_free_scratch();
  th_ctx_free(ctx);
}

Test(api, unbalanced_no_grad_end_is_an_error) {
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_no_grad_begin(ctx);
  kiln_no_grad_end(ctx);
  th_assert_ok(ctx);
  kiln_no_grad_end(ctx);
  TH_ASSERT_ERROR(ctx, KILN_ERR_STATE, "kiln_no_grad_end", "kiln_no_grad_begin");
  kiln_ctx_clear_error(ctx);
  cr_assert(kiln_grad_enabled(ctx), "the depth went below zero");
  kiln_no_grad_begin(ctx);
  cr_assert(!kiln_grad_enabled(ctx));
  kiln_no_grad_end(ctx);
  cr_assert(kiln_grad_enabled(ctx));
  th_assert_ok(ctx);
  th_ctx_free(ctx);
}

/* ---------------------------------------------------------------- point 6: training mode */

/* kiln_dropout(..., KILN_TRAINING_MODE) follows kiln_set_training, as torch.nn.Dropout follows
 * model.train() and model.eval(); an explicit 0 or 1 overrides it. */
Test(api, dropout_follows_the_training_mode) {
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_tensor *x = th_new(ctx, KILN_DTYPE_F32, KILN_SHAPE(4, 8));
  cr_assert(kiln_training(ctx), "contexts start in training mode");
  for (int mode = 1; mode >= 0; mode--) {
    kiln_set_training(ctx, mode);
    cr_assert_eq(kiln_training(ctx), mode);
    int32_t n0 = th_tlen(ctx);
    kiln_tensor *y = kiln_dropout(x, 0.5f, KILN_TRAINING_MODE);
    cr_assert_not_null(y, "%s", th_err(ctx));
    cr_assert_eq(th_count_ops(ctx, n0, th_tlen(ctx), KILN__OP_DROPOUT), mode,
                 "training mode %d: %d dropout nodes", mode,
                 th_count_ops(ctx, n0, th_tlen(ctx), KILN__OP_DROPOUT));
    cr_assert(mode ? y != x : y == x, "evaluation mode passes the input through");
    /* an explicit argument wins over the mode */
    n0 = th_tlen(ctx);
    cr_assert_not_null(kiln_dropout(x, 0.5f, !mode));
    cr_assert_eq(th_count_ops(ctx, n0, th_tlen(ctx), KILN__OP_DROPOUT), !mode);
  }
  TH_EXPECT_FAIL(ctx, kiln_dropout(x, 0.5f, 2), KILN_ERR_INVALID, "kiln_dropout", "training 2");
  kiln_set_training(ctx, 1);
  th_assert_ok(ctx);
  kiln_tensor_free(x);
  th_ctx_free(ctx);
}

/* ---------------------------------------------------------------- point 4: one-cycle */

/* torch's OneCycleLR(max_lr=1, total_steps=100) with its defaults: the momentum (or beta1) goes
 * from max_momentum 0.95 down to base_momentum 0.85 at step 29 (pct_start 0.3) and back to 0.95
 * at step 99, cosine annealed. */
static double torch_momentum(int t) {
  double up = 0.3 * 100 - 1, last = 99;
  if (t <= up) return 0.85 + (0.95 - 0.85) / 2 * (cos(M_PI * t / up) + 1);
  double pct = (t - up) / (last - up);
  return 0.95 + (0.85 - 0.95) / 2 * (cos(M_PI * pct) + 1);
}

Test(api, one_cycle_cycles_the_momentum_as_torch) {
  kiln_schedule oc = {.kind = KILN_SCHEDULE_ONE_CYCLE, .base_lr = 1.f, .total_steps = 100};
  cr_assert_float_eq(kiln_schedule_momentum(&oc, 0), 0.95f, 1e-7);
  cr_assert_float_eq(kiln_schedule_momentum(&oc, 29), 0.85f, 1e-7);
  cr_assert_float_eq(kiln_schedule_momentum(&oc, 99), 0.95f, 1e-7);
  cr_assert_float_eq(kiln_schedule_momentum(&oc, 500), 0.95f, 1e-7, "past the end: the end");
  for (int t = 0; t < 100; t += 7)
    cr_assert_float_eq(kiln_schedule_momentum(&oc, t), torch_momentum(t), 1e-6, "step %d", t);
  /* the rate as before: 0.04 at step 0, 1 at 29, 4e-6 at 99 */
  cr_assert_float_eq(kiln_schedule_lr(&oc, 0), 0.04f, 1e-7);
  cr_assert_float_eq(kiln_schedule_lr(&oc, 29), 1.f, 1e-6);
  cr_assert_float_eq(kiln_schedule_lr(&oc, 99), 4e-6f, 1e-9);
  /* its own momenta; and none cycled with no_cycle_momentum, or by other kinds */
  kiln_schedule own = oc;
  own.base_momentum = 0.5f;
  own.max_momentum = 0.7f;
  cr_assert_float_eq(kiln_schedule_momentum(&own, 0), 0.7f, 1e-7);
  cr_assert_float_eq(kiln_schedule_momentum(&own, 29), 0.5f, 1e-7);
  kiln_schedule off = oc;
  off.no_cycle_momentum = 1;
  cr_assert(isnan(kiln_schedule_momentum(&off, 5)));
  cr_assert_float_eq(kiln_schedule_lr(&off, 29), 1.f, 1e-6);
  kiln_schedule co = {.kind = KILN_SCHEDULE_COSINE, .base_lr = 1.f, .total_steps = 100};
  cr_assert(isnan(kiln_schedule_momentum(&co, 5)));
}

Test(api, one_cycle_moves_adams_beta1_and_sgds_momentum) {
  kiln_ctx *ctx = th_cpu_ctx();
  th_net m;
  th_net_init(&m, ctx, 4, 1, (int64_t[]){3, 2});
  kiln_schedule oc = {.kind = KILN_SCHEDULE_ONE_CYCLE, .base_lr = 0.01f, .total_steps = 10};
  kiln_optim *adam = kiln_adamw_new(m.params, &(kiln_adam_options){.beta1 = 0.7f});
  kiln_optim *sgd = kiln_sgd_new(m.params, &(kiln_sgd_options){.lr = 0.1f, .momentum = 0.9f});
  kiln_optim *flat = kiln_adam_new(m.params, NULL);
  cr_assert(adam && sgd && flat, "%s", th_err(ctx));
  kiln_optim_set_schedule(adam, &oc);
  kiln_optim_set_schedule(sgd, &oc);
  kiln_schedule off = oc;
  off.no_cycle_momentum = 1;
  kiln_optim_set_schedule(flat, &off);
  th_assert_ok(ctx);
  for (int t = 0; t < 4; t++) {
    kiln_step_begin(ctx);
    th_net_backward(&m);
    float beta1 = kiln_schedule_momentum(&oc, t);
    kiln__node *n = one_update(ctx, adam, KILN__OP_ADAM);
    cr_assert_float_eq(KILN__F(n, ADAM, beta1), beta1, 0.f, "step %d: the cycled beta1", t);
    cr_assert_float_eq(KILN__F(n, ADAM, lr), kiln_schedule_lr(&oc, t), 0.f);
    /* torch corrects the bias with the beta1 of the step */
    double step_size = kiln_schedule_lr(&oc, t) / (1 - pow(beta1, t + 1));
    cr_assert_float_eq(KILN__F(n, ADAM, step_size), step_size, 1e-6 * step_size);
    n = one_update(ctx, sgd, KILN__OP_SGD_MOMENTUM);
    cr_assert_float_eq(KILN__F(n, SGD_MOMENTUM, momentum), beta1, 0.f, "step %d", t);
    n = one_update(ctx, flat, KILN__OP_ADAM);
    cr_assert_float_eq(KILN__F(n, ADAM, beta1), 0.9f, 0.f, "no_cycle_momentum keeps beta1");
  }
  cr_assert_neq(kiln_schedule_momentum(&oc, 0), kiln_schedule_momentum(&oc, 3));
  /* an SGD optimizer without momentum has no buffers to cycle: an error naming the way out */
  kiln_optim *plain = kiln_sgd_new(m.params, &(kiln_sgd_options){.lr = 0.1f});
  kiln_optim_set_schedule(plain, &oc);
  TH_ASSERT_ERROR(ctx, KILN_ERR_INVALID, "kiln_optim_set_schedule", "momentum 0",
                  "no_cycle_momentum");
  kiln_ctx_clear_error(ctx);
  kiln_optim_set_schedule(plain, &off);
  th_assert_ok(ctx);
  kiln_optim_free(plain);
  kiln_optim_free(adam);
  kiln_optim_free(sgd);
  kiln_optim_free(flat);
  th_net_free(&m);
  th_ctx_free(ctx);
}

/* ---------------------------------------------------------------- point 5, 10: own data */

/* kiln_dataset_set_dtype's checks; without a GPU its read-back fails and the data set is as it
 * was (its values are test_gpu_loader.c's). */
Test(api, dataset_set_dtype_checks_and_changes_nothing_on_failure) {
  kiln_ctx *ctx = th_cpu_ctx();
  float f[12];
  int32_t lab[3] = {0, 1, 2};
  for (int i = 0; i < 12; i++)
    f[i] = (float)i / 3.f;
  kiln_dataset *ds = kiln_dataset_from_host(ctx, KILN_HOST_F32, KILN_SHAPE(3, 2, 2, 1), f,
                                            (kiln_host_labels){.i32 = lab}, NULL);
  cr_assert_not_null(ds, "%s", th_err(ctx));
  kiln_tensor *before = kiln_dataset_images(ds);
  cr_assert_eq(kiln_dataset_set_dtype(NULL, KILN_DTYPE_BF16), KILN_ERR_INVALID);
  cr_assert_eq(kiln_dataset_set_dtype(ds, KILN_DTYPE_F32), KILN_OK, "already f32: nothing to do");
  cr_assert_eq(kiln_dataset_set_dtype(ds, KILN_DTYPE_I32), KILN_ERR_DTYPE);
  TH_ASSERT_ERROR(ctx, KILN_ERR_DTYPE, "kiln_dataset_set_dtype", "i32", "f32 or bf16");
  kiln_ctx_clear_error(ctx);
  kiln_step_begin(ctx);
  cr_assert_eq(kiln_dataset_set_dtype(ds, KILN_DTYPE_BF16), KILN_ERR_STATE);
  TH_ASSERT_ERROR(ctx, KILN_ERR_STATE, "kiln_dataset_set_dtype", "inside a step");
  kiln_ctx_clear_error(ctx);
  kiln_step_end(ctx);
  cr_assert_eq(kiln_dataset_set_dtype(ds, KILN_DTYPE_BF16), KILN_ERR_STATE, "no GPU to read from");
  kiln_ctx_clear_error(ctx);
  cr_assert_eq(kiln_dataset_images(ds), before, "a failed conversion changed the images");
  cr_assert_eq(kiln_tensor_dtype(kiln_dataset_images(ds)), KILN_DTYPE_F32);
  kiln_dataset_free(ds);
  th_ctx_free(ctx);
}

Test(api, dataset_from_host_keeps_the_shape) {
  kiln_ctx *ctx = th_cpu_ctx();
  enum { N = 10, H = 4, W = 3, C = 2 };
  uint8_t px[N * H * W * C];
  int32_t lab[N];
  for (int i = 0; i < N * H * W * C; i++)
    px[i] = (uint8_t)(i * 37);
  for (int i = 0; i < N; i++)
    lab[i] = i % 3;
  float mean[C] = {0.5f, 0.4f}, std[C] = {0.2f, 0.3f};
  kiln_normalize norm = {.channels = C, .mean = mean, .std = std};
  kiln_dataset *ds = kiln_dataset_from_host(ctx, KILN_HOST_U8, KILN_SHAPE(N, H, W, C), px,
                                            (kiln_host_labels){.i32 = lab, .classes = 3}, &norm);
  cr_assert_not_null(ds, "%s", th_err(ctx));
  cr_assert_eq(kiln_dataset_size(ds), N);
  th_assert_shape(kiln_dataset_images(ds), KILN_SHAPE(N, H, W, C));
  cr_assert_eq(kiln_tensor_dtype(kiln_dataset_images(ds)), KILN_DTYPE_F32);
  th_assert_shape(kiln_dataset_labels(ds), KILN_SHAPE(N));
  cr_assert_eq(kiln_tensor_dtype(kiln_dataset_labels(ds)), KILN_DTYPE_I32);
  /* the loader's batches keep the sample's shape: images for a convolution */
  kiln_loader *l = kiln_loader_new(ds, &(kiln_loader_options){.batch = 4, .shuffle = 1, .seed = 7});
  cr_assert_not_null(l, "%s", th_err(ctx));
  kiln_step_begin(ctx);
  kiln_tensor *x, *y;
  cr_assert(kiln_loader_next(l, &x, &y), "%s", th_err(ctx));
  th_assert_shape(x, KILN_SHAPE(4, H, W, C));
  th_assert_shape(y, KILN_SHAPE(4));
  kiln_loader_free(l);
  kiln_dataset_free(ds);
  /* floats of any rank, without normalisation; one channel for every value */
  float f[N * 5];
  for (int i = 0; i < N * 5; i++)
    f[i] = (float)i - 7.f;
  kiln_dataset *fd = kiln_dataset_from_host(ctx, KILN_HOST_F32, KILN_SHAPE(N, 5), f,
                                            (kiln_host_labels){.i32 = lab}, NULL);
  cr_assert_not_null(fd, "%s", th_err(ctx));
  th_assert_shape(kiln_dataset_images(fd), KILN_SHAPE(N, 5));
  kiln_dataset_free(fd);
  float one_m = 0.1f, one_s = 2.f;
  kiln_dataset *od = kiln_dataset_from_host(
      ctx, KILN_HOST_F32, KILN_SHAPE(N, 5), f, (kiln_host_labels){.i32 = lab},
      &(kiln_normalize){.channels = 1, .mean = &one_m, .std = &one_s});
  cr_assert_not_null(od, "%s", th_err(ctx));
  kiln_dataset_free(od);
  th_assert_ok(ctx);
  th_ctx_free(ctx);
}

Test(api, dataset_from_host_refuses_bad_input_by_name) {
  kiln_ctx *ctx = th_cpu_ctx();
  uint8_t px[6 * 4] = {0}, lab8[6] = {0, 1, 2, 3, 4, 5};
  int32_t lab[6] = {0}, neg[6] = {0, 1, -2, 0, 0, 0};
  float mean[3] = {0}, std[3] = {1, 1, 1}, bad_std[2] = {1, 0};
  const kiln_host_labels i32 = {.i32 = lab};
  struct {
    kiln_host_type type;
    kiln_shape shape;
    const void *images;
    kiln_host_labels labels;
    kiln_normalize norm;
    bool has_norm;
    kiln_status status;
    const char *what;
  } cases[] = {
      {KILN_HOST_U8,
       KILN_SHAPE(6, 4),
       px,
       i32,
       {3, mean, std, 0},
       true,
       KILN_ERR_SHAPE,
       "3 channels"},
      {KILN_HOST_U8, KILN_SHAPE(6, 4), px, {0}, {0}, false, KILN_ERR_INVALID, "NULL labels"},
      {KILN_HOST_U8, KILN_SHAPE(6, 4), NULL, i32, {0}, false, KILN_ERR_INVALID, "NULL images"},
      {KILN_HOST_U8, KILN_SHAPE(0, 4), px, i32, {0}, false, KILN_ERR_SHAPE, "empty"},
      {KILN_HOST_U8, KILN_SCALAR_SHAPE, px, i32, {0}, false, KILN_ERR_SHAPE, "0 dims"},
      {KILN_HOST_U8,
       KILN_SHAPE(3, 4, 2),
       px,
       i32,
       {2, mean, bad_std, 0},
       true,
       KILN_ERR_INVALID,
       "channel 1"},
      {KILN_HOST_U8, KILN_SHAPE(6, 4), px, i32, {1, NULL, std, 0}, true, KILN_ERR_INVALID, "mean"},
      {(kiln_host_type)9, KILN_SHAPE(6, 4), px, i32, {0}, false, KILN_ERR_INVALID, "host type 9"},
      /* labels: one type, in range */
      {KILN_HOST_U8,
       KILN_SHAPE(6, 4),
       px,
       {.i32 = lab, .u8 = lab8},
       {0},
       false,
       KILN_ERR_INVALID,
       "both as i32 and as u8"},
      {KILN_HOST_U8,
       KILN_SHAPE(6, 4),
       px,
       {.i32 = neg},
       {0},
       false,
       KILN_ERR_INVALID,
       "record 2: label -2 is negative"},
      {KILN_HOST_U8,
       KILN_SHAPE(6, 4),
       px,
       {.u8 = lab8, .classes = 5},
       {0},
       false,
       KILN_ERR_INVALID,
       "record 5: label 5 is outside [0, 5)"},
      {KILN_HOST_U8,
       KILN_SHAPE(6, 4),
       px,
       {.u8 = lab8, .classes = -1},
       {0},
       false,
       KILN_ERR_INVALID,
       "-1 classes"},
      /* statistics from the data: nothing else given, and something to normalise */
      {KILN_HOST_U8,
       KILN_SHAPE(6, 4),
       px,
       i32,
       {.channels = 1, .mean = mean, .from_data = 1},
       true,
       KILN_ERR_INVALID,
       "with a mean given"},
      {KILN_HOST_U8,
       KILN_SHAPE(6, 4),
       px,
       i32,
       {.from_data = 1},
       true,
       KILN_ERR_INVALID,
       "0 channels"},
      {KILN_HOST_U8,
       KILN_SHAPE(6, 4),
       px,
       i32,
       {.channels = 4, .from_data = 1},
       true,
       KILN_ERR_INVALID,
       "channel 0 of the images is constant"},
  };
  for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
    kiln_dataset *ds =
        kiln_dataset_from_host(ctx, cases[k].type, cases[k].shape, cases[k].images, cases[k].labels,
                               cases[k].has_norm ? &cases[k].norm : NULL);
    cr_assert_null(ds, "case %zu", k);
    TH_ASSERT_ERROR(ctx, cases[k].status, "kiln_dataset_from_host", cases[k].what);
    kiln_ctx_clear_error(ctx);
  }
  th_ctx_free(ctx); /* a failed call left no tensor behind */
}

Test(api, the_host_route_takes_the_readers_types_and_computes_statistics) {
  kiln_ctx *ctx = th_cpu_ctx();
  enum { N = 9, R = 4, CO = 3 };
  uint8_t img[N * R * CO], lab8[N];
  for (int i = 0; i < N * R * CO; i++)
    img[i] = (uint8_t)(i * 29 + 3);
  for (int i = 0; i < N; i++)
    lab8[i] = (uint8_t)(9 - i);
  kiln_mnist m = {.n = N, .rows = R, .cols = CO, .images = img, .labels = lab8};
  /* the reader's own struct, as it is: image-shaped, uint8 labels checked against 10 classes */
  kiln_normalize from_data = {.channels = 1, .from_data = 1};
  kiln_dataset *a =
      kiln_dataset_from_host(ctx, KILN_HOST_U8, KILN_SHAPE(m.n, m.rows, m.cols, 1), m.images,
                             (kiln_host_labels){.u8 = m.labels, .classes = 10}, &from_data);
  cr_assert_not_null(a, "%s", th_err(ctx));
  th_assert_shape(kiln_dataset_images(a), KILN_SHAPE(N, R, CO, 1));
  cr_assert_eq(kiln_tensor_dtype(kiln_dataset_labels(a)), KILN_DTYPE_I32);
  /* the statistics it computed are kiln_image_stats's, and are given back */
  float want_m, want_s;
  cr_assert_eq(kiln_image_stats(ctx, KILN_HOST_U8, KILN_SHAPE(N, R, CO), img, 1, &want_m, &want_s),
               KILN_OK);
  kiln_normalize got = kiln_dataset_normalization(a);
  cr_assert_eq(got.channels, 1);
  cr_assert_eq(got.from_data, 0);
  cr_assert(got.mean[0] == want_m && got.std[0] == want_s, "mean %g std %g, want %g %g",
            got.mean[0], got.std[0], want_m, want_s);
  /* kiln_dataset_from_mnist: image-shaped too, NAN asks for the same statistics */
  kiln_dataset *b = kiln_dataset_from_mnist(ctx, &m, NAN, NAN);
  cr_assert_not_null(b, "%s", th_err(ctx));
  th_assert_shape(kiln_dataset_images(b), KILN_SHAPE(N, R, CO, 1));
  kiln_normalize gb = kiln_dataset_normalization(b);
  cr_assert(gb.channels == 1 && gb.mean[0] == want_m && gb.std[0] == want_s);
  /* a test set normalised with the training set's statistics keeps them */
  kiln_dataset *c = kiln_dataset_from_mnist(ctx, &m, gb.mean[0], gb.std[0]);
  cr_assert_not_null(c, "%s", th_err(ctx));
  kiln_normalize gc = kiln_dataset_normalization(c);
  cr_assert(gc.channels == 1 && gc.mean[0] == want_m && gc.std[0] == want_s);
  /* per channel, from the data, and no normalisation at all */
  kiln_dataset *d = kiln_dataset_from_host(ctx, KILN_HOST_U8, KILN_SHAPE(N, R, CO), img,
                                           (kiln_host_labels){.u8 = lab8},
                                           &(kiln_normalize){.channels = CO, .from_data = 1});
  cr_assert_not_null(d, "%s", th_err(ctx));
  float cm[CO], cs[CO];
  cr_assert_eq(kiln_image_stats(ctx, KILN_HOST_U8, KILN_SHAPE(N, R, CO), img, CO, cm, cs), KILN_OK);
  kiln_normalize gd = kiln_dataset_normalization(d);
  cr_assert_eq(gd.channels, CO);
  for (int k = 0; k < CO; k++)
    cr_assert(gd.mean[k] == cm[k] && gd.std[k] == cs[k], "channel %d", k);
  kiln_dataset *e = kiln_dataset_from_host(ctx, KILN_HOST_U8, KILN_SHAPE(N, R * CO), img,
                                           (kiln_host_labels){.u8 = lab8}, NULL);
  cr_assert_not_null(e, "%s", th_err(ctx));
  cr_assert_eq(kiln_dataset_normalization(e).channels, 0);
  cr_assert_null(kiln_dataset_normalization(e).mean);
  cr_assert_eq(kiln_dataset_normalization(NULL).channels, 0);
  /* NAN for one of the two, or a mean that is not finite, is an error naming both */
  cr_assert_null(kiln_dataset_from_mnist(ctx, &m, NAN, 0.3f));
  TH_ASSERT_ERROR(ctx, KILN_ERR_INVALID, "kiln_dataset_from_mnist", "mean nan and std 0.3");
  kiln_ctx_clear_error(ctx);
  cr_assert_null(kiln_dataset_from_mnist(ctx, &m, INFINITY, 0.3f));
  TH_ASSERT_ERROR(ctx, KILN_ERR_INVALID, "kiln_dataset_from_mnist", "mean inf");
  kiln_ctx_clear_error(ctx);
  cr_assert_null(kiln_dataset_from_mnist(ctx, &m, 0.1f, 0.f));
  TH_ASSERT_ERROR(ctx, KILN_ERR_INVALID, "kiln_dataset_from_mnist", "std 0");
  kiln_ctx_clear_error(ctx);
  kiln_dataset_free(a);
  kiln_dataset_free(b);
  kiln_dataset_free(c);
  kiln_dataset_free(d);
  kiln_dataset_free(e);
  th_ctx_free(ctx);
}

/* The population mean and standard deviation of channel c of n values with `channels`
 * channels (channels last), as doubles. */
static void ref_stats(const double *v, int64_t n, int channels, int c, double *mean, double *std) {
  double s = 0, d = 0;
  int64_t k = 0;
  for (int64_t i = c; i < n; i += channels, k++)
    s += v[i];
  *mean = s / (double)k;
  for (int64_t i = c; i < n; i += channels)
    d += (v[i] - *mean) * (v[i] - *mean);
  *std = sqrt(d / (double)k);
}

Test(api, image_stats_per_channel) {
  kiln_ctx *ctx = th_cpu_ctx();
  enum { N = 50, H = 3, W = 5, C = 3, T = N * H * W * C };
  uint8_t *px = malloc(T);
  double *pv = malloc(T * sizeof *pv);
  th_rng r = {.s = 42};
  for (int i = 0; i < T; i++) {
    /* each channel its own range, so that a mixed-up channel shows */
    int c = i % C;
    px[i] = (uint8_t)(c * 60 + th_rng_below(&r, 100 + 30 * c));
    pv[i] = px[i] / 255.0;
  }
  float mean[C], std[C];
  cr_assert_eq(kiln_image_stats(ctx, KILN_HOST_U8, KILN_SHAPE(N, H, W, C), px, C, mean, std),
               KILN_OK, "%s", th_err(ctx));
  for (int c = 0; c < C; c++) {
    double m, s;
    ref_stats(pv, T, C, c, &m, &s);
    cr_assert_float_eq(mean[c], m, 1e-6, "channel %d mean %g, want %g", c, mean[c], m);
    cr_assert_float_eq(std[c], s, 1e-6, "channel %d std %g, want %g", c, std[c], s);
  }
  cr_assert_gt(mean[2], mean[0] + 0.2f);
  /* one channel: every value together */
  float m1, s1;
  cr_assert_eq(kiln_image_stats(ctx, KILN_HOST_U8, KILN_SHAPE(N, H, W, C), px, 1, &m1, &s1),
               KILN_OK);
  double m, s;
  ref_stats(pv, T, 1, 0, &m, &s);
  cr_assert_float_eq(m1, m, 1e-6);
  cr_assert_float_eq(s1, s, 1e-6);
  /* floats, read as they are */
  float *fv = malloc(T * sizeof *fv);
  for (int i = 0; i < T; i++) {
    fv[i] = (float)(pv[i] * 10.0 - 3.0);
    pv[i] = fv[i];
  }
  cr_assert_eq(kiln_image_stats(ctx, KILN_HOST_F32, KILN_SHAPE(N, H * W * C), fv, 1, &m1, &s1),
               KILN_OK, "%s", th_err(ctx));
  ref_stats(pv, T, 1, 0, &m, &s);
  cr_assert_float_eq(m1, m, 1e-5);
  cr_assert_float_eq(s1, s, 1e-5);
  /* what the normalisation of kiln_dataset_from_host takes */
  float *mc = malloc(C * sizeof *mc), *sc = malloc(C * sizeof *sc);
  cr_assert_eq(kiln_image_stats(ctx, KILN_HOST_U8, KILN_SHAPE(N, H, W, C), px, C, mc, sc), KILN_OK);
  int32_t *lab = calloc(N, sizeof *lab);
  kiln_dataset *ds =
      kiln_dataset_from_host(ctx, KILN_HOST_U8, KILN_SHAPE(N, H, W, C), px,
                             (kiln_host_labels){.i32 = lab}, &(kiln_normalize){C, mc, sc, 0});
  cr_assert_not_null(ds, "%s", th_err(ctx));
  kiln_dataset_free(ds);
  /* errors name the value or the mismatch */
  fv[17] = NAN;
  cr_assert_eq(kiln_image_stats(ctx, KILN_HOST_F32, KILN_SHAPE(N, H * W * C), fv, 1, &m1, &s1),
               KILN_ERR_INVALID);
  TH_ASSERT_ERROR(ctx, KILN_ERR_INVALID, "kiln_image_stats", "value 17");
  kiln_ctx_clear_error(ctx);
  cr_assert_eq(kiln_image_stats(ctx, KILN_HOST_U8, KILN_SHAPE(N, H, W, C), px, 2, mc, sc),
               KILN_ERR_SHAPE);
  TH_ASSERT_ERROR(ctx, KILN_ERR_SHAPE, "kiln_image_stats", "2 channels", "(3)");
  kiln_ctx_clear_error(ctx);
  cr_assert_eq(kiln_image_stats(ctx, KILN_HOST_U8, KILN_SHAPE(N, H, W, C), px, 0, mc, sc),
               KILN_ERR_SHAPE, "no statistics of no channels");
  kiln_ctx_clear_error(ctx);
  free(px);
  free(pv);
  free(fv);
  free(mc);
  free(sc);
  free(lab);
  th_ctx_free(ctx);
}

/* ---------------------------------------------------------------- point 8: no GPU */

Test(api, a_no_gpu_context_plans_and_compiles_a_training_step, .timeout = 600) {
  char cache[256];
  th_tmpdir(cache, sizeof cache, "api-cache"); /* a fresh kernel cache: NVRTC must run */
  cr_assert_eq(setenv("KILN_CACHE_DIR", cache, 1), 0);
  kiln_ctx *ctx = th_cpu_ctx();
  th_net m;
  th_net_init(&m, ctx, 32, 3, (int64_t[]){784, 64, 64, 10});
  kiln_optim *o =
      kiln_sgd_new(m.params, &(kiln_sgd_options){.lr = 0.05f, .momentum = 0.9f, .nesterov = 1});
  cr_assert_not_null(o, "%s", th_err(ctx));
  float *xs = calloc(32 * 784, sizeof *xs);
  uint64_t first_lookups = 0, fused_groups = 0;
  for (int step = 0; step < 3; step++) {
    if (step == 2) kiln_set_fusion(ctx, 0); /* one kernel per node: more groups, new kernels */
    kiln_step_begin(ctx);
    /* accepted (and dropped) */
    cr_assert_eq(kiln_tensor_copy_from_host(m.x, xs, 32 * 784 * sizeof *xs), KILN_OK, "%s",
                 th_err(ctx));
    kiln_optim_zero_grad(o);
    kiln_tensor *loss = th_net_loss(&m);
    cr_assert_eq(kiln_backward(loss), KILN_OK, "%s", th_err(ctx));
    cr_assert_eq(kiln_optim_step(o), KILN_OK, "%s", th_err(ctx));
    int32_t nodes = th_tlen(ctx);
    cr_assert_eq(kiln_step_end(ctx), KILN_OK, "step %d: %s", step, th_err(ctx));
    kiln_exec_stats st;
    kiln_stats(ctx, &st);
    cr_assert_eq(st.last_flush.nodes, (uint64_t)nodes, "the whole step was planned");
    cr_assert_geq(st.last_flush.groups, 8, "%llu groups", (unsigned long long)st.last_flush.groups);
    if (step == 0) {
      cr_assert_geq(st.last_flush.compiled, 3, "%llu kernels compiled by NVRTC",
                    (unsigned long long)st.last_flush.compiled);
      first_lookups = st.last_flush.compiled + st.last_flush.cache_hits;
      fused_groups = st.last_flush.groups;
      cr_assert_eq(st.kernels_compiled, st.last_flush.compiled);
    } else if (step == 2) {
      cr_assert_gt(st.last_flush.groups, fused_groups + 10, "unfused: %llu groups, fused %llu",
                   (unsigned long long)st.last_flush.groups, (unsigned long long)fused_groups);
      cr_assert_geq(st.last_flush.compiled, 10, "%llu unfused kernels compiled",
                    (unsigned long long)st.last_flush.compiled);
    } else {
      /* the same plan: every kernel of the first step, found compiled */
      cr_assert_eq(st.last_flush.compiled, 0, "the second step finds its kernels compiled");
      cr_assert_eq(st.last_flush.cache_hits, first_lookups);
    }
    cr_assert_eq(st.kernels_launched, 0);
    cr_assert_eq(st.last_flush.kernels, 0);
    cr_assert_eq(st.nodes_executed, 0, "nothing ran");
    cr_assert_eq(kiln_optim_steps(o), step + 1, "the step succeeded: nothing was rolled back");
    cr_assert_not_null(kiln_tensor_grad(m.l[0].weight));
    /* only reading a value is an error */
    cr_assert(isnan(kiln_tensor_item(loss)));
    TH_ASSERT_ERROR(ctx, KILN_ERR_STATE, "kiln_tensor_to_host", "no GPU");
    kiln_ctx_clear_error(ctx);
  }
  cr_assert_eq(kiln_sync(ctx), KILN_OK, "%s", th_err(ctx));
  free(xs);
  kiln_optim_free(o);
  th_net_free(&m);
  th_ctx_free(ctx);
  unsetenv("KILN_CACHE_DIR");
}

/* ---------------------------------------------------------------- point 9: parameter names */

/* Asserts parameter i of p: its name (the tensor's too), shape and whether it is a buffer. */
static void expect_param(kiln_params *p, int i, const char *name, kiln_shape shape, int buffer) {
  cr_assert_str_eq(kiln_params_name(p, i), name, "parameter %d", i);
  cr_assert_str_eq(kiln_tensor_name(kiln_params_get(p, i)), name);
  th_assert_shape(kiln_params_get(p, i), shape);
  cr_assert_eq(kiln_params_is_buffer(p, i), buffer, "%s", name);
  cr_assert_eq(kiln_params_find(p, name), kiln_params_get(p, i));
}

Test(api, layers_make_pytorch_parameter_names) {
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_params *p = kiln_params_new(ctx);
  kiln_linear fc1, fc2, anon, empty;
  kiln_conv2d_layer conv;
  kiln_batch_norm_layer bn;
  kiln_layer_norm_layer ln;
  cr_assert_eq(
      kiln_linear_init(&fc1, p, &(kiln_linear_options){.name = "fc1", .in = 784, .out = 512}),
      KILN_OK);
  cr_assert_eq(
      kiln_linear_init(&fc2, p,
                       &(kiln_linear_options){.name = "fc2", .in = 512, .out = 10, .no_bias = 1}),
      KILN_OK);
  cr_assert_eq(kiln_linear_init(&anon, p, &(kiln_linear_options){.in = 3, .out = 2}), KILN_OK);
  cr_assert_eq(
      kiln_conv2d_layer_init(&conv, p,
                             &(kiln_conv2d_layer_options){
                                 .name = "conv1", .in = 3, .out = 8, .kernel_h = 3, .kernel_w = 5}),
      KILN_OK);
  cr_assert_eq(kiln_batch_norm_layer_init(
                   &bn, p, &(kiln_batch_norm_layer_options){.name = "bn1", .features = 8}),
               KILN_OK);
  cr_assert_eq(kiln_layer_norm_layer_init(
                   &ln, p, &(kiln_layer_norm_layer_options){.name = "ln1", .features = 10}),
               KILN_OK);
  int i = 0;
  expect_param(p, i++, "fc1.weight", KILN_SHAPE(512, 784), 0); /* (out, in), as nn.Linear */
  expect_param(p, i++, "fc1.bias", KILN_SHAPE(512), 0);
  expect_param(p, i++, "fc2.weight", KILN_SHAPE(10, 512), 0); /* no bias asked for */
  expect_param(p, i++, "linear.weight", KILN_SHAPE(2, 3), 0);
  expect_param(p, i++, "linear.bias", KILN_SHAPE(2), 0);
  expect_param(p, i++, "conv1.weight", KILN_SHAPE(8, 3, 3, 5), 0);
  expect_param(p, i++, "conv1.bias", KILN_SHAPE(8), 0);
  expect_param(p, i++, "bn1.weight", KILN_SHAPE(8), 0);
  expect_param(p, i++, "bn1.bias", KILN_SHAPE(8), 0);
  expect_param(p, i++, "bn1.running_mean", KILN_SHAPE(8), 1);
  expect_param(p, i++, "bn1.running_var", KILN_SHAPE(8), 1);
  expect_param(p, i++, "ln1.weight", KILN_SHAPE(10), 0);
  expect_param(p, i++, "ln1.bias", KILN_SHAPE(10), 0);
  cr_assert_eq(kiln_params_count(p), i);
  /* an empty name is the default one too, and a name taken is an error that adds nothing */
  cr_assert_neq(kiln_linear_init(&empty, p, &(kiln_linear_options){.name = "", .in = 3, .out = 2}),
                KILN_OK);
  TH_ASSERT_ERROR(ctx, KILN_ERR_INVALID, "kiln_linear_init", "'linear.weight' is taken");
  kiln_ctx_clear_error(ctx);
  cr_assert_eq(kiln_params_count(p), i);
  cr_assert_eq(
      kiln_linear_init(&empty, p, &(kiln_linear_options){.name = "fc1", .in = 3, .out = 2}),
      KILN_ERR_INVALID);
  kiln_ctx_clear_error(ctx);
  cr_assert_eq(kiln_params_count(p), i);
  kiln_params_free(p);
  th_ctx_free(ctx);
}
