/*
 * test_cpu_trace.c: the trace and the autograd tape on a no-GPU context: what a linear layer
 * records, how requires_grad spreads and no-grad regions stop it, the nodes kiln_backward appends
 * (gradients assigned, then accumulated, into persistent .grad buffers), backward's errors,
 * dropout's backward reusing its mask, and kiln_step_begin resetting the trace.
 */
#include <string.h>

#include "inspect.h"

Test(trace, linear_layer_records_permute_matmul_add) {
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_params *p = kiln_params_new(ctx);
  kiln_linear l;
  cr_assert_eq(kiln_linear_init(&l, p, &(kiln_linear_options){.name = "fc", .in = 784, .out = 512}),
               KILN_OK);
  cr_assert_eq(kiln_params_count(p), 2);
  cr_assert_str_eq(kiln_params_name(p, 0), "fc.weight");
  cr_assert_str_eq(kiln_params_name(p, 1), "fc.bias");
  cr_assert_eq(kiln_params_find(p, "fc.bias"), l.bias);
  cr_assert_eq(kiln_params_numel(p), 784 * 512 + 512);
  th_assert_shape(l.weight, KILN_SHAPE(512, 784));
  cr_assert(kiln_tensor_requires_grad(l.weight) && kiln_tensor_requires_grad(l.bias));
  cr_assert_eq(th_tlen(ctx), 0, "initialisation records nothing");

  kiln_tensor *x = th_f32(ctx, KILN_SHAPE(128, 784));
  kiln_tensor *y = kiln_linear_forward(&l, x);
  th_assert_shape(y, KILN_SHAPE(128, 512));
  TH_ASSERT_OPS_FROM(ctx, 0, KILN__OP_PERMUTE, KILN__OP_MATMUL, KILN__OP_ADD);
  kiln__node *perm = th_node(ctx, 0), *mm = th_node(ctx, 1), *add = th_node(ctx, 2);
  cr_assert_eq(perm->in[0], l.weight);
  cr_assert_eq(mm->in[0], x);
  cr_assert_eq(mm->in[1], perm->out, "the transposed weight goes to the matmul uncopied");
  TH_ASSERT_STRIDES(mm->in[1], 1, 784);
  cr_assert_eq(add->in[0], mm->out);
  cr_assert_eq(add->in[1], l.bias);
  cr_assert_eq(add->out, y);
  cr_assert_eq(y->node, 2);
  cr_assert(kiln_tensor_requires_grad(y));

  kiln_exec_stats st;
  kiln_stats(ctx, &st);
  cr_assert_eq(st.nodes_recorded, 3u);
  cr_assert_eq(st.nodes_executed, 0u);

  TH_EXPECT_FAIL(ctx, kiln_linear_forward(&l, th_f32(ctx, KILN_SHAPE(4, 100))), KILN_ERR_SHAPE,
                 "kiln_linear_forward", "[4,100]", "fc.weight", "784");
  kiln_linear l2;
  int np = kiln_params_count(p);
  cr_assert_eq(kiln_linear_init(
                   &l2, p, &(kiln_linear_options){.name = "fc", .in = 3, .out = 4, .no_bias = 1}),
               KILN_ERR_INVALID);
  TH_ASSERT_ERROR(ctx, KILN_ERR_INVALID, "kiln_linear_init", "fc.weight", "taken");
  cr_assert_eq(kiln_params_count(p), np, "a failed init adds nothing");
  kiln_ctx_clear_error(ctx);
  cr_assert_eq(kiln_linear_init(
                   &l2, p, &(kiln_linear_options){.name = "bad", .in = 0, .out = 4, .no_bias = 1}),
               KILN_ERR_INVALID);
  TH_ASSERT_ERROR(ctx, KILN_ERR_INVALID, "kiln_linear_init", "'bad'", "in 0");
  kiln_ctx_clear_error(ctx);
  kiln_params_free(p);
  th_free_scratch();
  th_ctx_free(ctx);
}

Test(trace, requires_grad_propagation_and_no_grad) {
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_tensor *w = th_param(ctx, KILN_SHAPE(3)), *x = th_f32(ctx, KILN_SHAPE(3));
  cr_assert(kiln_tensor_requires_grad(kiln_mul(w, x)));
  cr_assert(kiln_tensor_requires_grad(kiln_mul(x, w)));
  cr_assert(!kiln_tensor_requires_grad(kiln_mul(x, x)));
  cr_assert(kiln_tensor_requires_grad(kiln_exp(kiln_relu(w))));
  cr_assert(kiln_tensor_requires_grad(kiln_transpose(kiln_reshape(w, KILN_SHAPE(1, 3)), 0, 1)));
  /* ops without a gradient cut the path */
  cr_assert(!kiln_tensor_requires_grad(kiln_gt(w, x)));
  cr_assert(!kiln_tensor_requires_grad(kiln_argmax(w, 0, 0)));
  cr_assert(!kiln_tensor_requires_grad(kiln_detach(w)));
  cr_assert(!kiln_tensor_requires_grad(kiln_cast(w, KILN_DTYPE_I32)));
  cr_assert(!kiln_tensor_requires_grad(kiln_mul(kiln_detach(w), x)));

  cr_assert(kiln_grad_enabled(ctx));
  kiln_no_grad_begin(ctx);
  kiln_no_grad_begin(ctx);
  cr_assert(!kiln_grad_enabled(ctx));
  cr_assert(!kiln_tensor_requires_grad(kiln_mul(w, x)));
  kiln_no_grad_end(ctx);
  cr_assert(!kiln_grad_enabled(ctx), "no-grad regions nest");
  cr_assert(!kiln_tensor_requires_grad(kiln_add(w, w)));
  kiln_no_grad_end(ctx);
  cr_assert(kiln_grad_enabled(ctx));
  kiln_no_grad_end(ctx); /* an extra end is an error, and does not go below zero */
  TH_ASSERT_ERROR(ctx, KILN_ERR_STATE, "kiln_no_grad_end", "no no-grad region is open");
  kiln_ctx_clear_error(ctx);
  cr_assert(kiln_grad_enabled(ctx));
  kiln_no_grad_begin(ctx);
  cr_assert(!kiln_grad_enabled(ctx), "an unbalanced end made the depth negative");
  kiln_no_grad_end(ctx);
  cr_assert(kiln_tensor_requires_grad(kiln_mul(w, x)));

  kiln_tensor_set_requires_grad(w, 0);
  cr_assert(!kiln_tensor_requires_grad(kiln_mul(w, x)));
  th_assert_ok(ctx);
  th_free_scratch();
  th_ctx_free(ctx);
}

/* Collects the grads of the MLP's parameters; asserts each has one. */
static void mlp_grads(th_net *m, kiln_tensor **grads) {
  int np = kiln_params_count(m->params);
  for (int i = 0; i < np; i++) {
    kiln_tensor *p = kiln_params_get(m->params, i);
    grads[i] = kiln_tensor_grad(p);
    cr_assert_not_null(grads[i], "%s has no gradient", kiln_params_name(m->params, i));
    cr_assert(kiln_tensor_is_persistent(grads[i]));
    cr_assert(kiln_tensor_is_contiguous(grads[i]));
    th_assert_shape(grads[i], kiln_tensor_shape(p));
    char want[64];
    snprintf(want, sizeof want, "%s.grad", kiln_params_name(m->params, i));
    cr_assert_str_eq(kiln_tensor_name(grads[i]), want);
  }
}

/* Asserts that the last np nodes are update nodes of op writing exactly the given grads. */
static void assert_leaf_writes(kiln_ctx *ctx, kiln__op op, int np, kiln_tensor *const *grads) {
  bool seen[TH_NET_MAX * 2] = {0};
  for (int k = 0; k < np; k++) {
    kiln__node *n = th_node(ctx, -np + k);
    cr_assert_eq(n->op, op, "node %d from the end is %s, want %s", np - k, th_op_name(n->op),
                 th_op_name(op));
    cr_assert_null(n->out);
    int hit = -1;
    for (int i = 0; i < np; i++)
      if (n->in[0] == grads[i]) hit = i;
    cr_assert(hit >= 0, "a %s node writes a tensor that is no parameter's grad", th_op_name(op));
    cr_assert(!seen[hit], "two %s nodes write one grad", th_op_name(op));
    seen[hit] = true;
    cr_assert_eq(kiln_tensor_numel(n->in[1]), kiln_tensor_numel(grads[hit]));
  }
}

Test(trace, backward_appends_gradients_and_assigns_grads) {
  kiln_ctx *ctx = th_cpu_ctx();
  th_net m;
  th_net_init(&m, ctx, 16, 2, (int64_t[]){20, 12, 5});
  for (int i = 0; i < 4; i++)
    cr_assert_null(kiln_tensor_grad(kiln_params_get(m.params, i)), "a grad before backward");
  kiln_tensor *loss = th_net_loss(&m);
  TH_ASSERT_OPS_FROM(ctx, 0, KILN__OP_PERMUTE, KILN__OP_MATMUL, KILN__OP_ADD, KILN__OP_RELU,
                     KILN__OP_PERMUTE, KILN__OP_MATMUL, KILN__OP_ADD, KILN__OP_MAX, KILN__OP_SUB,
                     KILN__OP_EXP, KILN__OP_SUM, KILN__OP_LOG, KILN__OP_SUB, KILN__OP_RESHAPE,
                     KILN__OP_ONEHOT, KILN__OP_MUL, KILN__OP_SUM, KILN__OP_NEG, KILN__OP_SUM);
  int32_t nf = th_tlen(ctx);
  cr_assert_eq(loss->node, nf - 1);
  cr_assert(kiln_tensor_requires_grad(loss));

  cr_assert_eq(kiln_backward(loss), KILN_OK, "kiln_backward: %s", kiln_ctx_error(ctx));
  cr_assert_gt(th_tlen(ctx), nf + 4);
  /* the forward nodes are untouched; the backward starts from a one */
  for (int32_t i = 0; i < nf; i++)
    cr_assert_neq(kiln__ops[th_node(ctx, i)->op].kind, KILN__KIND_UPDATE);
  kiln__node *one = th_node(ctx, nf);
  cr_assert_eq(one->op, KILN__OP_FILL);
  cr_assert_eq(KILN__F(one, FILL, value), 1.f);
  th_assert_shape(one->out, KILN_SCALAR_SHAPE);
  for (int32_t i = nf; i < th_tlen(ctx); i++) {
    kiln__node *n = th_node(ctx, i);
    if (n->out)
      cr_assert(!n->out->requires_grad, "backward node #%d (%s) requires grad", i,
                th_op_name(n->op));
  }
  kiln_tensor *grads[4];
  mlp_grads(&m, grads);
  assert_leaf_writes(ctx, KILN__OP_ASSIGN, 4, grads);
  int32_t nb = th_tlen(ctx);
  cr_assert_eq(th_count_ops(ctx, nf, nb, KILN__OP_ASSIGN), 4);
  cr_assert_eq(th_count_ops(ctx, nf, nb, KILN__OP_ACCUM), 0);
  /* dW2, dh and dW1; the input needs no gradient, so no matmul for it */
  cr_assert_eq(th_count_ops(ctx, nf, nb, KILN__OP_MATMUL), 3);
  cr_assert_eq(th_count_ops(ctx, nf, nb, KILN__OP_RELU_GRAD), 1);
  cr_assert_null(kiln_tensor_grad(m.x), "the input does not require grad");

  /* a second loss's backward without zero_grad accumulates (the same loss twice is an error:
   * test_cpu_api.c); this one shares every node of the first */
  cr_assert_eq(kiln_backward(kiln_mul_scalar(loss, 1.f)), KILN_OK, "second kiln_backward: %s",
               kiln_ctx_error(ctx));
  kiln_tensor *grads2[4];
  mlp_grads(&m, grads2);
  for (int i = 0; i < 4; i++)
    cr_assert_eq(grads2[i], grads[i], "the grad buffer is reused");
  assert_leaf_writes(ctx, KILN__OP_ACCUM, 4, grads);
  cr_assert_eq(th_count_ops(ctx, nb, th_tlen(ctx), KILN__OP_ASSIGN), 0);
  cr_assert_eq(th_count_ops(ctx, nb, th_tlen(ctx), KILN__OP_MATMUL), 3);

  /* zero_grad drops the gradients: the next backward assigns afresh */
  kiln_params_zero_grad(m.params);
  for (int i = 0; i < 4; i++)
    cr_assert_null(kiln_tensor_grad(kiln_params_get(m.params, i)));
  cr_assert_eq(kiln_backward(kiln_mul_scalar(loss, 2.f)), KILN_OK, "%s", kiln_ctx_error(ctx));
  assert_leaf_writes(ctx, KILN__OP_ASSIGN, 4, grads);
  kiln_tensor_zero_grad(kiln_params_get(m.params, 1));
  cr_assert_null(kiln_tensor_grad(kiln_params_get(m.params, 1)));
  cr_assert_not_null(kiln_tensor_grad(kiln_params_get(m.params, 0)));
  th_assert_ok(ctx);
  th_net_free(&m);
  th_ctx_free(ctx);
}

Test(trace, backward_reaches_inputs_that_require_grad) {
  kiln_ctx *ctx = th_cpu_ctx();
  th_net m;
  th_net_init(&m, ctx, 8, 2, (int64_t[]){6, 4, 3});
  kiln_tensor_set_requires_grad(m.x, 1);
  kiln_tensor *loss = th_net_loss(&m);
  int32_t nf = th_tlen(ctx);
  cr_assert_eq(kiln_backward(loss), KILN_OK, "%s", kiln_ctx_error(ctx));
  cr_assert_eq(th_count_ops(ctx, nf, th_tlen(ctx), KILN__OP_MATMUL), 4);
  cr_assert_eq(th_count_ops(ctx, nf, th_tlen(ctx), KILN__OP_ASSIGN), 5);
  kiln_tensor *gx = kiln_tensor_grad(m.x);
  cr_assert_not_null(gx);
  th_assert_shape(gx, KILN_SHAPE(8, 6));
  th_net_free(&m);
  th_ctx_free(ctx);
}

Test(trace, backward_errors) {
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_tensor *w = th_param(ctx, KILN_SHAPE(3)), *x = th_f32(ctx, KILN_SHAPE(3));
  int32_t n0 = th_tlen(ctx);
  kiln_tensor *v = kiln_mul(w, x);
  cr_assert_eq(kiln_backward(v), KILN_ERR_SHAPE);
  TH_ASSERT_ERROR(ctx, KILN_ERR_SHAPE, "kiln_backward", "one f32 element", "[3]");
  kiln_ctx_clear_error(ctx);
  cr_assert_eq(kiln_backward(th_sum_all(kiln_mul(x, x))), KILN_ERR_STATE);
  TH_ASSERT_ERROR(ctx, KILN_ERR_STATE, "kiln_backward", "does not require grad");
  kiln_ctx_clear_error(ctx);
  kiln_no_grad_begin(ctx);
  kiln_tensor *l = th_sum_all(v);
  kiln_no_grad_end(ctx);
  cr_assert_eq(kiln_backward(l), KILN_ERR_STATE);
  TH_ASSERT_ERROR(ctx, KILN_ERR_STATE, "no-grad");
  kiln_ctx_clear_error(ctx);
  cr_assert_eq(th_tlen(ctx), n0 + 4, "failed backward calls recorded nodes");
  cr_assert_null(kiln_tensor_grad(w));
  th_free_scratch();
  th_ctx_free(ctx);
}

Test(trace, dropout_backward_reuses_the_mask) {
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_manual_seed(ctx, 7);
  kiln_tensor *w = th_param(ctx, KILN_SHAPE(5, 4));
  kiln_dropout(w, 0.5f, 1); /* takes offset 0 */
  kiln_tensor *d = kiln_dropout(w, 0.5f, 1);
  kiln__node fwd = *th_node(ctx, d->node);
  cr_assert_eq(KILN__U(&fwd, DROPOUT, offset), 1u);
  int32_t n0 = th_tlen(ctx);
  cr_assert_eq(kiln_backward(th_sum_all(d)), KILN_OK, "%s", kiln_ctx_error(ctx));
  cr_assert_eq(th_count_ops(ctx, n0, th_tlen(ctx), KILN__OP_DROPOUT), 1);
  for (int32_t i = n0; i < th_tlen(ctx); i++) {
    kiln__node *n = th_node(ctx, i);
    if (n->op != KILN__OP_DROPOUT) continue;
    cr_assert_eq(KILN__U(n, DROPOUT, seed), 7u);
    cr_assert_eq(KILN__U(n, DROPOUT, offset), KILN__U(&fwd, DROPOUT, offset),
                 "the backward mask must come from the forward draw");
    cr_assert_eq(KILN__F(n, DROPOUT, p), KILN__F(&fwd, DROPOUT, p));
    cr_assert_eq(KILN__F(n, DROPOUT, scale), KILN__F(&fwd, DROPOUT, scale));
  }
  cr_assert_eq(ctx->philox_offset, 2u, "backward draws no offset");
  th_free_scratch();
  th_ctx_free(ctx);
}

Test(trace, step_begin_resets_the_trace) {
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_tensor *a = th_f32(ctx, KILN_SHAPE(4));
  kiln_relu(kiln_exp(a));
  cr_assert_eq(th_tlen(ctx), 2);
  uint64_t gen = ctx->gen;
  kiln_step_begin(ctx);
  cr_assert_eq(th_tlen(ctx), 0);
  cr_assert_eq(ctx->gen, gen + 1);
  kiln_tensor *r = kiln_relu(a);
  cr_assert_not_null(r, "persistent tensors stay usable across steps");
  cr_assert_eq(r->node, 0);
  kiln_exec_stats st;
  kiln_stats(ctx, &st);
  cr_assert_eq(st.nodes_recorded, 3u);
  /* a no-GPU step is planned and compiled, not run (test_cpu_api.c) */
  cr_assert_eq(kiln_step_end(ctx), KILN_OK, "%s", th_err(ctx));
  th_free_scratch();
  th_ctx_free(ctx);
}
