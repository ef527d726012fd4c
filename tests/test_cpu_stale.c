/*
 * test_cpu_stale.c: step lifetimes on a no-GPU context: an intermediate of a previous step is a
 * stale handle that every op (and kiln_backward) refuses by name; persistent tensors never go
 * stale.
 */
#include "inspect.h"

Test(stale, intermediates_of_a_previous_step) {
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_tensor *w = th_param(ctx, KILN_SHAPE(4)), *x = th_f32(ctx, KILN_SHAPE(4));
  kiln_tensor *h = kiln_mul(w, x);
  kiln_tensor_set_name(h, "hidden");
  kiln_tensor *loss = th_sum_all(h);
  kiln_step_begin(ctx);
  int32_t n0 = th_tlen(ctx);
  cr_assert_null(kiln_relu(h));
  TH_ASSERT_ERROR(ctx, KILN_ERR_STATE, "kiln_relu", "stale", "'hidden'");
  cr_assert_eq(th_tlen(ctx), n0);
  kiln_ctx_clear_error(ctx);
  cr_assert_null(kiln_add(x, h), "a stale second operand");
  TH_ASSERT_ERROR(ctx, KILN_ERR_STATE, "kiln_add", "stale");
  kiln_ctx_clear_error(ctx);
  cr_assert_eq(kiln_backward(loss), KILN_ERR_STATE);
  TH_ASSERT_ERROR(ctx, KILN_ERR_STATE, "kiln_backward", "stale");
  kiln_ctx_clear_error(ctx);
  /* persistent tensors never go stale */
  cr_assert_not_null(kiln_mul(w, x));
  th_assert_ok(ctx);
  th_free_scratch();
  th_ctx_free(ctx);
}
