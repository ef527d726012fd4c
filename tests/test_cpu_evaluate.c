/*
 * test_cpu_evaluate.c: evaluation without a GPU. kiln_eval_begin / kiln_eval_end switch training
 * and gradients off and give back what they found, nesting and across steps, and refuse an
 * unbalanced end.
 */
#include "inspect.h"

TestSuite(evaluate);

/* ---------------------------------------------------------------- evaluation mode */

Test(evaluate, eval_mode_switches_training_and_gradients_and_gives_them_back) {
  kiln_ctx *ctx = th_cpu_ctx();
  cr_assert(kiln_training(ctx) && kiln_grad_enabled(ctx));
  kiln_eval_begin(ctx);
  cr_assert(!kiln_training(ctx) && !kiln_grad_enabled(ctx), "model.eval() and torch.no_grad()");
  /* inside: a region that switches training on again gets evaluation mode back from a nested
   * region's end, and the outer end gives back the training mode it found */
  kiln_set_training(ctx, 1);
  kiln_eval_begin(ctx);
  cr_assert(!kiln_training(ctx) && !kiln_grad_enabled(ctx));
  kiln_eval_end(ctx);
  cr_assert(kiln_training(ctx), "the inner end gives back what the inner begin found");
  cr_assert(!kiln_grad_enabled(ctx), "the outer no-grad region is still open");
  kiln_set_training(ctx, 0);
  kiln_eval_end(ctx);
  cr_assert(kiln_training(ctx) && kiln_grad_enabled(ctx));
  /* from evaluation mode, it stays in evaluation mode */
  kiln_set_training(ctx, 0);
  kiln_eval_begin(ctx);
  kiln_eval_end(ctx);
  cr_assert(!kiln_training(ctx) && kiln_grad_enabled(ctx));
  kiln_set_training(ctx, 1);
  /* a region spans steps: dropout passes its input through and nothing is differentiated */
  kiln_tensor *w = th_param(ctx, KILN_SHAPE(4, 8));
  kiln_eval_begin(ctx);
  for (int step = 0; step < 2; step++) {
    kiln_step_begin(ctx);
    int32_t n0 = th_tlen(ctx);
    kiln_tensor *y = kiln_dropout(kiln_relu(w), 0.5f, KILN_TRAINING_MODE);
    cr_assert_not_null(y, "%s", th_err(ctx));
    cr_assert_eq(th_count_ops(ctx, n0, th_tlen(ctx), KILN__OP_DROPOUT), 0, "step %d", step);
    cr_assert_eq(kiln_backward(kiln_sum(y, KILN_ALL_AXES, 0)), KILN_ERR_STATE,
                 "no gradient in a no-grad region");
    kiln_ctx_clear_error(ctx);
    cr_assert_eq(kiln_step_end(ctx), KILN_OK, "%s", th_err(ctx));
  }
  kiln_eval_end(ctx);
  cr_assert(kiln_training(ctx) && kiln_grad_enabled(ctx));
  th_assert_ok(ctx);
  th_free_scratch();
  th_ctx_free(ctx);
}

Test(evaluate, an_unbalanced_eval_end_is_an_error_that_changes_nothing) {
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_eval_end(ctx);
  TH_ASSERT_ERROR(ctx, KILN_ERR_STATE, "kiln_eval_end", "no evaluation region is open");
  kiln_ctx_clear_error(ctx);
  cr_assert(kiln_training(ctx) && kiln_grad_enabled(ctx));
  /* a stray kiln_no_grad_end inside closes the region's no-grad region: its end refuses */
  kiln_eval_begin(ctx);
  kiln_no_grad_end(ctx);
  th_assert_ok(ctx);
  kiln_eval_end(ctx);
  TH_ASSERT_ERROR(ctx, KILN_ERR_STATE, "kiln_eval_end", "region 1", "was closed already");
  kiln_ctx_clear_error(ctx);
  cr_assert(!kiln_training(ctx), "a failed end changes nothing");
  kiln_no_grad_begin(ctx);
  kiln_eval_end(ctx);
  th_assert_ok(ctx);
  cr_assert(kiln_training(ctx) && kiln_grad_enabled(ctx));
  /* 64 regions nest; the 65th is refused and opens nothing */
  for (int i = 0; i < 64; i++)
    kiln_eval_begin(ctx);
  th_assert_ok(ctx);
  kiln_eval_begin(ctx);
  TH_ASSERT_ERROR(ctx, KILN_ERR_STATE, "kiln_eval_begin", "64 evaluation regions");
  kiln_ctx_clear_error(ctx);
  for (int i = 0; i < 64; i++) {
    cr_assert(!kiln_grad_enabled(ctx), "region %d", i);
    kiln_eval_end(ctx);
  }
  th_assert_ok(ctx);
  cr_assert(kiln_training(ctx) && kiln_grad_enabled(ctx), "the 65th begin opened no region");
  kiln_eval_begin(NULL);
  kiln_eval_end(NULL);
  th_ctx_free(ctx);
}
