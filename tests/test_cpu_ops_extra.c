/*
 * test_cpu_ops_extra.c: what the activations abs, leaky_relu, silu, softplus and erf, the
 * variance and standard deviation, and the losses beyond cross-entropy with labels (MSE, binary
 * cross-entropy on logits, cross-entropy against class probabilities) record on a no-GPU context:
 * output shapes, the nodes of the trace and their attributes, the nodes their backward records,
 * and the error each misuse sets, naming the function and the values. No GPU needed.
 */
#include <math.h>

#include "inspect.h"

/* The node that made t (asserted to be op). */
static kiln__node *made_by(kiln_tensor *t, kiln__op op) {
  cr_assert_not_null(t);
  kiln__node *n = kiln__producer(t);
  cr_assert_not_null(n);
  cr_assert_eq(n->op, op, "made by %s, expected %s", th_op_name(n->op), th_op_name(op));
  return n;
}

/* Records kiln_backward of sum(y) and asserts that it recorded exactly `count` nodes of op. */
static void expect_backward_records(kiln_ctx *ctx, kiln_tensor *y, kiln__op op, int count) {
  int32_t first = th_tlen(ctx);
  cr_assert_eq(kiln_backward(th_sum_all(y)), KILN_OK, "%s", th_err(ctx));
  cr_assert_eq(th_count_ops(ctx, first, th_tlen(ctx), op), count,
               "kiln_backward recorded %d %s nodes, expected %d",
               th_count_ops(ctx, first, th_tlen(ctx), op), th_op_name(op), count);
}

/* ---------------------------------------------------------------- activations */

Test(ops_extra, activations_record_one_node_of_the_input_shape) {
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_tensor *a = th_f32(ctx, KILN_SHAPE(2, 3, 4));
  struct {
    kiln_tensor *y;
    kiln__op op;
  } cases[] = {
      {kiln_abs(a), KILN__OP_ABS},   {kiln_leaky_relu(a, 0.01f), KILN__OP_LEAKY_RELU},
      {kiln_silu(a), KILN__OP_SILU}, {kiln_softplus(a, 1.f, 20.f), KILN__OP_SOFTPLUS},
      {kiln_erf(a), KILN__OP_ERF},
  };
  for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
    made_by(cases[i].y, cases[i].op);
    th_assert_shape(cases[i].y, KILN_SHAPE(2, 3, 4));
    cr_assert_eq(kiln_tensor_dtype(cases[i].y), KILN_DTYPE_F32);
  }
  /* a transposed view reads through its strides: one node, no copy */
  int32_t n0 = th_tlen(ctx);
  kiln_tensor *t = kiln_silu(kiln_transpose(th_f32(ctx, KILN_SHAPE(3, 5)), 0, 1));
  th_assert_shape(t, KILN_SHAPE(5, 3));
  TH_ASSERT_OPS_FROM(ctx, n0, KILN__OP_PERMUTE, KILN__OP_SILU);
  th_assert_ok(ctx);
  th_free_scratch();
  th_ctx_free(ctx);
}

Test(ops_extra, activation_attributes) {
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_tensor *a = th_f32(ctx, KILN_SHAPE(4));
  kiln__node *n = made_by(kiln_leaky_relu(a, 0.2f), KILN__OP_LEAKY_RELU);
  cr_assert_float_eq(KILN__F(n, LEAKY_RELU, negative_slope), 0.2f, 0);
  /* negative_slope is a plain argument: 0 is ReLU, a negative slope is taken as it is */
  n = made_by(kiln_leaky_relu(a, 0.f), KILN__OP_LEAKY_RELU);
  cr_assert_float_eq(KILN__F(n, LEAKY_RELU, negative_slope), 0.f, 0);
  n = made_by(kiln_leaky_relu(a, -0.5f), KILN__OP_LEAKY_RELU);
  cr_assert_float_eq(KILN__F(n, LEAKY_RELU, negative_slope), -0.5f, 0);
  n = made_by(kiln_softplus(a, 2.f, 5.f), KILN__OP_SOFTPLUS);
  cr_assert_float_eq(KILN__F(n, SOFTPLUS, beta), 2.f, 0);
  cr_assert_float_eq(KILN__F(n, SOFTPLUS, threshold), 5.f, 0);
  /* zero means PyTorch's default: beta 1, threshold 20 */
  n = made_by(kiln_softplus(a, 0.f, 0.f), KILN__OP_SOFTPLUS);
  cr_assert_float_eq(KILN__F(n, SOFTPLUS, beta), 1.f, 0);
  cr_assert_float_eq(KILN__F(n, SOFTPLUS, threshold), 20.f, 0);
  n = made_by(kiln_softplus(a, 0.5f, -3.f), KILN__OP_SOFTPLUS);
  cr_assert_float_eq(KILN__F(n, SOFTPLUS, beta), 0.5f, 0);
  cr_assert_float_eq(KILN__F(n, SOFTPLUS, threshold), -3.f, 0);
  th_assert_ok(ctx);
  th_free_scratch();
  th_ctx_free(ctx);
}

Test(ops_extra, activation_backward_nodes_and_attributes) {
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_shape s = KILN_SHAPE(3, 4);
  expect_backward_records(ctx, kiln_abs(th_param(ctx, s)), KILN__OP_ABS_GRAD, 1);
  expect_backward_records(ctx, kiln_silu(th_param(ctx, s)), KILN__OP_SILU_GRAD, 1);
  /* erf's gradient is recorded with ordinary ops: 2 / sqrt(pi) exp(-x^2) */
  kiln_tensor *x = th_param(ctx, s);
  kiln_tensor *y = kiln_erf(x);
  int32_t first = th_tlen(ctx);
  cr_assert_eq(kiln_backward(th_sum_all(y)), KILN_OK, "%s", th_err(ctx));
  cr_assert_eq(th_count_ops(ctx, first, th_tlen(ctx), KILN__OP_EXP), 1);
  int found = 0;
  for (int32_t i = first; i < th_tlen(ctx); i++) {
    kiln__node *n = th_node(ctx, i);
    if (n->op == KILN__OP_MUL_SCALAR) {
      cr_assert_float_eq(KILN__F(n, MUL_SCALAR, s), 1.12837916709551257f, 1e-7f);
      found++;
    }
  }
  cr_assert_eq(found, 1, "erf's backward: %d mul_scalar nodes", found);

  /* the gradient nodes carry the forward node's attributes */
  x = th_param(ctx, s);
  y = kiln_leaky_relu(x, 0.3f);
  first = th_tlen(ctx);
  expect_backward_records(ctx, y, KILN__OP_LEAKY_RELU_GRAD, 1);
  for (int32_t i = first; i < th_tlen(ctx); i++) {
    kiln__node *n = th_node(ctx, i);
    if (n->op != KILN__OP_LEAKY_RELU_GRAD) continue;
    cr_assert_float_eq(KILN__F(n, LEAKY_RELU_GRAD, negative_slope), 0.3f, 0);
    cr_assert_eq(n->in[1], x, "leaky_relu's gradient reads its input");
  }
  x = th_param(ctx, s);
  y = kiln_softplus(x, 0.f, 7.f);
  first = th_tlen(ctx);
  expect_backward_records(ctx, y, KILN__OP_SOFTPLUS_GRAD, 1);
  for (int32_t i = first; i < th_tlen(ctx); i++) {
    kiln__node *n = th_node(ctx, i);
    if (n->op != KILN__OP_SOFTPLUS_GRAD) continue;
    cr_assert_float_eq(KILN__F(n, SOFTPLUS_GRAD, beta), 1.f, 0);
    cr_assert_float_eq(KILN__F(n, SOFTPLUS_GRAD, threshold), 7.f, 0);
    cr_assert_eq(n->in[1], x, "softplus's gradient reads its input");
  }
  th_assert_ok(ctx);
  th_free_scratch();
  th_ctx_free(ctx);
}

Test(ops_extra, activation_errors_name_the_function) {
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_tensor *a = th_f32(ctx, KILN_SHAPE(2, 3)), *i = th_i32(ctx, KILN_SHAPE(2, 3));
  TH_EXPECT_FAIL(ctx, kiln_abs(i), KILN_ERR_DTYPE, "kiln_abs", "i32");
  TH_EXPECT_FAIL(ctx, kiln_silu(i), KILN_ERR_DTYPE, "kiln_silu", "i32");
  TH_EXPECT_FAIL(ctx, kiln_erf(i), KILN_ERR_DTYPE, "kiln_erf", "i32");
  TH_EXPECT_FAIL(ctx, kiln_leaky_relu(i, 0.01f), KILN_ERR_DTYPE, "kiln_leaky_relu", "i32");
  TH_EXPECT_FAIL(ctx, kiln_softplus(i, 1.f, 20.f), KILN_ERR_DTYPE, "kiln_softplus", "i32");
  TH_EXPECT_FAIL(ctx, kiln_leaky_relu(a, NAN), KILN_ERR_INVALID, "kiln_leaky_relu",
                 "negative_slope nan");
  TH_EXPECT_FAIL(ctx, kiln_softplus(a, INFINITY, 20.f), KILN_ERR_INVALID, "kiln_softplus",
                 "beta inf");
  TH_EXPECT_FAIL(ctx, kiln_softplus(a, 1.f, NAN), KILN_ERR_INVALID, "kiln_softplus",
                 "threshold nan");
  /* a NULL input records nothing and sets no error of its own */
  cr_assert_null(kiln_abs(NULL));
  cr_assert_null(kiln_softplus(NULL, 1.f, 20.f));
  cr_assert_null(kiln_leaky_relu(NULL, 0.01f));
  th_assert_ok(ctx);
  th_free_scratch();
  th_ctx_free(ctx);
}

/* ---------------------------------------------------------------- var and std */

Test(ops_extra, var_and_std_shapes_and_trace) {
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_tensor *a = th_param(ctx, KILN_SHAPE(4, 5, 6));
  int32_t n0 = th_tlen(ctx);
  kiln_tensor *v = kiln_var(a, KILN_AXES(1), 1, 0);
  th_assert_shape(v, KILN_SHAPE(4, 6));
  /* the mean, the deviations, their squares and their sum */
  TH_ASSERT_OPS_FROM(ctx, n0, KILN__OP_SUM, KILN__OP_SUB, KILN__OP_MUL, KILN__OP_SUM);
  kiln__node *mean = th_node(ctx, n0), *sum = th_node(ctx, n0 + 3);
  cr_assert_float_eq(KILN__RF(mean, scale), 1.f / 5.f, 1e-7f);
  cr_assert(!mean->out->requires_grad, "the centring mean carries no gradient");
  th_assert_shape(mean->out, KILN_SHAPE(4, 1, 6));
  cr_assert_float_eq(KILN__RF(sum, scale), 1.f / 4.f, 1e-7f, "correction 1 divides by n - 1");
  cr_assert(v->requires_grad);

  n0 = th_tlen(ctx);
  kiln_tensor *s = kiln_std(a, KILN_AXES(0, 2), 0, 1);
  th_assert_shape(s, KILN_SHAPE(1, 5, 1));
  TH_ASSERT_OPS_FROM(ctx, n0, KILN__OP_SUM, KILN__OP_SUB, KILN__OP_MUL, KILN__OP_SUM,
                     KILN__OP_SQRT);
  cr_assert_float_eq(KILN__RF(th_node(ctx, n0 + 3), scale), 1.f / 24.f, 1e-7f);

  /* all axes, and negative ones */
  th_assert_shape(kiln_var(a, KILN_ALL_AXES, 1, 0), KILN_SCALAR_SHAPE);
  cr_assert_float_eq(KILN__RF(th_node(ctx, -1), scale), 1.f / 119.f, 1e-9f);
  th_assert_shape(kiln_std(a, KILN_AXES(-1), 1, 1), KILN_SHAPE(4, 5, 1));
  /* a correction beyond the count divides by zero, as PyTorch does (inf, or NaN) */
  n0 = th_tlen(ctx);
  th_assert_shape(kiln_var(a, KILN_AXES(1), 5, 0), KILN_SHAPE(4, 6));
  cr_assert(isinf(KILN__RF(th_node(ctx, -1), scale)));
  th_assert_shape(kiln_var(a, KILN_AXES(1), 9, 0), KILN_SHAPE(4, 6));
  cr_assert(isinf(KILN__RF(th_node(ctx, -1), scale)));
  /* a negative correction divides by more than the count */
  kiln_var(a, KILN_AXES(1), -1, 0);
  cr_assert_float_eq(KILN__RF(th_node(ctx, -1), scale), 1.f / 6.f, 1e-7f);

  /* the backward reaches a through the deviations only */
  int32_t first = th_tlen(ctx);
  cr_assert_eq(kiln_backward(th_sum_all(kiln_std(a, KILN_AXES(1), 1, 0))), KILN_OK, "%s",
               th_err(ctx));
  cr_assert_gt(th_count_ops(ctx, first, th_tlen(ctx), KILN__OP_ASSIGN), 0);
  th_assert_ok(ctx);
  th_free_scratch();
  th_ctx_free(ctx);
}

Test(ops_extra, var_and_std_errors_name_the_function) {
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_tensor *a = th_f32(ctx, KILN_SHAPE(2, 3)), *i = th_i32(ctx, KILN_SHAPE(2, 3));
  TH_EXPECT_FAIL(ctx, kiln_var(a, KILN_AXES(2), 1, 0), KILN_ERR_SHAPE, "kiln_var", "axis 2",
                 "[2,3]");
  TH_EXPECT_FAIL(ctx, kiln_std(a, KILN_AXES(-3), 1, 0), KILN_ERR_SHAPE, "kiln_std", "axis -3");
  TH_EXPECT_FAIL(ctx, kiln_var(a, KILN_AXES(1, 1), 1, 0), KILN_ERR_INVALID, "kiln_var",
                 "axis 1 given twice");
  TH_EXPECT_FAIL(ctx, kiln_std(i, KILN_AXES(0), 1, 0), KILN_ERR_DTYPE, "kiln_std", "i32");
  cr_assert_null(kiln_var(NULL, KILN_AXES(0), 1, 0));
  cr_assert_null(kiln_std(NULL, KILN_AXES(0), 1, 0));
  th_assert_ok(ctx);
  th_free_scratch();
  th_ctx_free(ctx);
}

/* ---------------------------------------------------------------- losses */

Test(ops_extra, mse_loss_trace_and_reductions) {
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_tensor *x = th_param(ctx, KILN_SHAPE(4, 3)), *t = th_f32(ctx, KILN_SHAPE(4, 3));
  int32_t n0 = th_tlen(ctx);
  kiln_tensor *l = kiln_mse_loss(x, t, KILN_REDUCTION_MEAN);
  th_assert_shape(l, KILN_SCALAR_SHAPE);
  TH_ASSERT_OPS_FROM(ctx, n0, KILN__OP_SUB, KILN__OP_MUL, KILN__OP_SUM);
  cr_assert_float_eq(KILN__RF(th_node(ctx, -1), scale), 1.f / 12.f, 1e-8f);
  th_assert_shape(kiln_mse_loss(x, t, KILN_REDUCTION_SUM), KILN_SCALAR_SHAPE);
  cr_assert_float_eq(KILN__RF(th_node(ctx, -1), scale), 1.f, 0);
  n0 = th_tlen(ctx);
  th_assert_shape(kiln_mse_loss(x, t, KILN_REDUCTION_NONE), KILN_SHAPE(4, 3));
  TH_ASSERT_OPS_FROM(ctx, n0, KILN__OP_SUB, KILN__OP_MUL);
  cr_assert_eq(kiln_backward(l), KILN_OK, "%s", th_err(ctx));
  th_assert_ok(ctx);
  th_free_scratch();
  th_ctx_free(ctx);
}

Test(ops_extra, bce_with_logits_trace) {
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_tensor *x = th_param(ctx, KILN_SHAPE(8)), *t = th_f32(ctx, KILN_SHAPE(8));
  int32_t n0 = th_tlen(ctx);
  kiln_tensor *l = kiln_bce_with_logits(x, t, KILN_REDUCTION_MEAN);
  th_assert_shape(l, KILN_SCALAR_SHAPE);
  /* softplus(x) - x t, then the mean */
  TH_ASSERT_OPS_FROM(ctx, n0, KILN__OP_SOFTPLUS, KILN__OP_MUL, KILN__OP_SUB, KILN__OP_SUM);
  kiln__node *sp = th_node(ctx, n0);
  cr_assert_float_eq(KILN__F(sp, SOFTPLUS, beta), 1.f, 0);
  cr_assert_float_eq(KILN__F(sp, SOFTPLUS, threshold), 20.f, 0);
  cr_assert_float_eq(KILN__RF(th_node(ctx, -1), scale), 1.f / 8.f, 1e-8f);
  th_assert_shape(kiln_bce_with_logits(x, t, KILN_REDUCTION_NONE), KILN_SHAPE(8));
  /* the gradient, sigmoid(x) - t, comes from softplus's own gradient: no kink at 0 */
  expect_backward_records(ctx, l, KILN__OP_SOFTPLUS_GRAD, 1);
  th_assert_ok(ctx);
  th_free_scratch();
  th_ctx_free(ctx);
}

Test(ops_extra, cross_entropy_soft_trace) {
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_tensor *x = th_param(ctx, KILN_SHAPE(4, 5)), *t = th_f32(ctx, KILN_SHAPE(4, 5));
  int32_t n0 = th_tlen(ctx);
  kiln_tensor *l = kiln_cross_entropy_soft(x, t, KILN_REDUCTION_MEAN, 0.f);
  th_assert_shape(l, KILN_SCALAR_SHAPE);
  /* log_softmax (max, sub, exp, sum, log, sub), -sum(t logp) over classes, the mean over N */
  TH_ASSERT_OPS_FROM(ctx, n0, KILN__OP_MAX, KILN__OP_SUB, KILN__OP_EXP, KILN__OP_SUM, KILN__OP_LOG,
                     KILN__OP_SUB, KILN__OP_MUL, KILN__OP_SUM, KILN__OP_NEG, KILN__OP_SUM);
  cr_assert_float_eq(KILN__RF(th_node(ctx, -1), scale), 1.f / 4.f, 1e-8f);
  /* label smoothing: t (1 - ls) + ls / C */
  n0 = th_tlen(ctx);
  th_assert_shape(kiln_cross_entropy_soft(x, t, KILN_REDUCTION_NONE, 0.2f), KILN_SHAPE(4));
  int ms = -1, as = -1;
  for (int32_t i = n0; i < th_tlen(ctx); i++) {
    if (th_node(ctx, i)->op == KILN__OP_MUL_SCALAR) ms = i;
    if (th_node(ctx, i)->op == KILN__OP_ADD_SCALAR) as = i;
  }
  cr_assert(ms >= 0 && as > ms, "no smoothing of the target recorded");
  cr_assert_float_eq(KILN__F(th_node(ctx, ms), MUL_SCALAR, s), 0.8f, 1e-7f);
  cr_assert_float_eq(KILN__F(th_node(ctx, as), ADD_SCALAR, s), 0.04f, 1e-7f);
  th_assert_shape(kiln_cross_entropy_soft(x, t, KILN_REDUCTION_SUM, 1.f), KILN_SCALAR_SHAPE);
  cr_assert_eq(kiln_backward(l), KILN_OK, "%s", th_err(ctx));
  th_assert_ok(ctx);
  th_free_scratch();
  th_ctx_free(ctx);
}

Test(ops_extra, loss_errors_name_the_function_and_values) {
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_tensor *a = th_f32(ctx, KILN_SHAPE(2, 3)), *b = th_f32(ctx, KILN_SHAPE(3, 2));
  kiln_tensor *row = th_f32(ctx, KILN_SHAPE(3)), *i = th_i32(ctx, KILN_SHAPE(2, 3));
  kiln_tensor *a3 = th_f32(ctx, KILN_SHAPE(2, 3, 4));
  /* no broadcasting between input and target */
  TH_EXPECT_FAIL(ctx, kiln_mse_loss(a, b, KILN_REDUCTION_MEAN), KILN_ERR_SHAPE, "kiln_mse_loss",
                 "[2,3]", "[3,2]");
  TH_EXPECT_FAIL(ctx, kiln_mse_loss(a, row, KILN_REDUCTION_MEAN), KILN_ERR_SHAPE, "kiln_mse_loss",
                 "[2,3]", "[3]");
  TH_EXPECT_FAIL(ctx, kiln_mse_loss(a, i, KILN_REDUCTION_SUM), KILN_ERR_DTYPE, "kiln_mse_loss",
                 "input 1", "i32");
  TH_EXPECT_FAIL(ctx, kiln_mse_loss(a, a, (kiln_reduction)7), KILN_ERR_INVALID, "kiln_mse_loss",
                 "unknown reduction 7");
  TH_EXPECT_FAIL(ctx, kiln_bce_with_logits(a, b, KILN_REDUCTION_MEAN), KILN_ERR_SHAPE,
                 "kiln_bce_with_logits", "logits [2,3]", "target [3,2]");
  TH_EXPECT_FAIL(ctx, kiln_bce_with_logits(i, a, KILN_REDUCTION_MEAN), KILN_ERR_DTYPE,
                 "kiln_bce_with_logits", "input 0", "i32");
  TH_EXPECT_FAIL(ctx, kiln_bce_with_logits(a, a, (kiln_reduction)-1), KILN_ERR_INVALID,
                 "kiln_bce_with_logits", "unknown reduction -1");
  TH_EXPECT_FAIL(ctx, kiln_cross_entropy_soft(a, b, KILN_REDUCTION_MEAN, 0.f), KILN_ERR_SHAPE,
                 "kiln_cross_entropy_soft", "[2,3]", "[3,2]");
  TH_EXPECT_FAIL(ctx, kiln_cross_entropy_soft(a3, a3, KILN_REDUCTION_MEAN, 0.f), KILN_ERR_SHAPE,
                 "kiln_cross_entropy_soft", "(N, C)", "[2,3,4]");
  TH_EXPECT_FAIL(ctx, kiln_cross_entropy_soft(a, i, KILN_REDUCTION_MEAN, 0.f), KILN_ERR_DTYPE,
                 "kiln_cross_entropy_soft", "i32");
  TH_EXPECT_FAIL(ctx, kiln_cross_entropy_soft(a, a, KILN_REDUCTION_MEAN, 1.5f), KILN_ERR_INVALID,
                 "kiln_cross_entropy_soft", "label_smoothing 1.5");
  TH_EXPECT_FAIL(ctx, kiln_cross_entropy_soft(a, a, KILN_REDUCTION_MEAN, NAN), KILN_ERR_INVALID,
                 "kiln_cross_entropy_soft", "label_smoothing nan");
  TH_EXPECT_FAIL(ctx, kiln_cross_entropy_soft(a, a, (kiln_reduction)3, 0.f), KILN_ERR_INVALID,
                 "kiln_cross_entropy_soft", "unknown reduction 3");
  TH_EXPECT_FAIL(ctx, kiln_mse_loss(NULL, a, KILN_REDUCTION_MEAN), KILN_ERR_INVALID,
                 "kiln_mse_loss", "NULL tensor");
  /* one NULL beside a tensor is an error on its context, as for every op of two inputs */
  TH_EXPECT_FAIL(ctx, kiln_bce_with_logits(a, NULL, KILN_REDUCTION_MEAN), KILN_ERR_INVALID,
                 "kiln_bce_with_logits", "NULL tensor");
  cr_assert_null(kiln_cross_entropy_soft(NULL, NULL, KILN_REDUCTION_MEAN, 0.f));
  th_assert_ok(ctx);
  th_free_scratch();
  th_ctx_free(ctx);
}
