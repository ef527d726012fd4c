/*
 * test_cpu_errors.c: sticky errors on a no-GPU context: the first error wins and later calls
 * record nothing until kiln_ctx_clear_error; NULL inputs, tensors of another context, what a
 * context without a GPU refuses to run, and kiln_ctx_new's message where there is no usable GPU.
 */
#include <dlfcn.h>
#include <math.h>
#include <string.h>

#include "inspect.h"

Test(errors, sticky_until_cleared) {
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_tensor *a = th_f32(ctx, KILN_SHAPE(2, 3)), *b = th_f32(ctx, KILN_SHAPE(4, 3));
  kiln_tensor *labels = th_i32(ctx, KILN_SHAPE(2));
  cr_assert_null(kiln_add(a, b));
  const char *first = "kiln_add: shapes [2,3] and [4,3] do not broadcast";
  cr_assert_not_null(strstr(kiln_ctx_error(ctx), first), "message: %s", kiln_ctx_error(ctx));
  int32_t n0 = th_tlen(ctx);
  kiln_exec_stats st0, st1;
  kiln_stats(ctx, &st0);
  /* every later call records nothing and keeps the first message */
  cr_assert_null(kiln_relu(a));
  cr_assert_null(kiln_matmul(a, kiln_transpose(b, 0, 1)));
  cr_assert_null(kiln_reshape(a, KILN_SHAPE(6)));
  cr_assert_null(kiln_full(ctx, KILN_SHAPE(2), 1.f));
  cr_assert_null(kiln_tensor_new(ctx, KILN_DTYPE_F32, KILN_SHAPE(2)));
  cr_assert_null(kiln_cross_entropy(a, labels, KILN_REDUCTION_MEAN, 0.f));
  cr_assert_null(kiln_clamp(a, 1.f, 0.f));
  cr_assert_eq(kiln_backward(a), KILN_ERR_SHAPE);
  cr_assert_eq(th_tlen(ctx), n0, "a failed context recorded %d nodes", th_tlen(ctx) - n0);
  kiln_stats(ctx, &st1);
  cr_assert_eq(st1.nodes_recorded, st0.nodes_recorded);
  TH_ASSERT_ERROR(ctx, KILN_ERR_SHAPE, first);
  cr_assert_null(strstr(kiln_ctx_error(ctx), "clamp"), "a later error replaced the first");

  kiln_ctx_clear_error(ctx);
  cr_assert_null(kiln_ctx_error(ctx));
  cr_assert_eq(kiln_ctx_status(ctx), KILN_OK);
  kiln_tensor *r = kiln_relu(a);
  cr_assert_not_null(r, "the context works again after kiln_ctx_clear_error");
  cr_assert_eq(th_tlen(ctx), n0 + 1);
  th_free_scratch();
  th_ctx_free(ctx);
}

Test(errors, null_inputs) {
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_tensor *a = th_f32(ctx, KILN_SHAPE(3));
  int32_t n0 = th_tlen(ctx);
  cr_assert_null(kiln_relu(NULL));
  cr_assert_null(kiln_add(NULL, NULL));
  cr_assert_null(kiln_gelu(NULL, KILN_GELU_TANH));
  cr_assert_null(kiln_sum(NULL, KILN_ALL_AXES, 0));
  cr_assert_null(kiln_slice(NULL, 0, 0, 1, 1));
  cr_assert_null(kiln_clamp(NULL, 0.f, 1.f));
  cr_assert_null(kiln_full(NULL, KILN_SHAPE(1), 0.f));
  cr_assert_eq(kiln_backward(NULL), KILN_ERR_INVALID);
  cr_assert_null(kiln_ctx_error(ctx), "NULL inputs with no context touch no context");
  /* NULL next to a real tensor: NULL, nothing recorded, an error naming the op */
  cr_assert_null(kiln_add(a, NULL));
  TH_ASSERT_ERROR(ctx, KILN_ERR_INVALID, "kiln_add", "NULL");
  kiln_ctx_clear_error(ctx);
  kiln_tensor *ts[2] = {a, NULL};
  cr_assert_null(kiln_concat(2, ts, 0));
  TH_ASSERT_ERROR(ctx, KILN_ERR_INVALID, "kiln_concat", "NULL");
  kiln_ctx_clear_error(ctx);
  cr_assert_eq(th_tlen(ctx), n0);
  /* a chain of calls fails once: the first failure is the message */
  kiln_tensor *y = kiln_relu(kiln_exp(kiln_add(a, th_f32(ctx, KILN_SHAPE(4)))));
  cr_assert_null(y);
  TH_ASSERT_ERROR(ctx, KILN_ERR_SHAPE, "kiln_add", "[3]", "[4]");
  cr_assert_eq(th_tlen(ctx), n0);
  th_free_scratch();
  th_ctx_free(ctx);
}

Test(errors, tensors_of_another_context) {
  kiln_ctx *c1 = th_cpu_ctx(), *c2 = th_cpu_ctx();
  kiln_tensor *a = th_f32(c1, KILN_SHAPE(3)), *b = th_f32(c2, KILN_SHAPE(3));
  cr_assert_null(kiln_add(a, b));
  TH_ASSERT_ERROR(c1, KILN_ERR_INVALID, "kiln_add", "another context");
  cr_assert_eq(th_tlen(c1), 0);
  cr_assert_eq(th_tlen(c2), 0);
  th_free_scratch();
  th_ctx_free(c1);
  th_ctx_free(c2);
}

Test(errors, no_gpu_context_cannot_run) {
  kiln_ctx *ctx = th_cpu_ctx();
  cr_assert_eq(kiln_sync(ctx), KILN_OK, "nothing recorded: nothing to run");
  kiln_tensor *a = th_f32(ctx, KILN_SHAPE(3));
  float h[3] = {1, 2, 3};
  cr_assert_eq(kiln_tensor_copy_from_host(a, h, sizeof h), KILN_OK);
  cr_assert_eq(kiln_tensor_copy_from_host(a, h, 2 * sizeof(float)), KILN_ERR_INVALID);
  TH_ASSERT_ERROR(ctx, KILN_ERR_INVALID, "kiln_tensor_copy_from_host", "8 bytes", "12 bytes");
  kiln_ctx_clear_error(ctx);
  cr_assert_eq(kiln_tensor_to_host(a, h, sizeof h), KILN_ERR_STATE);
  TH_ASSERT_ERROR(ctx, KILN_ERR_STATE, "kiln_tensor_to_host", "no GPU");
  kiln_ctx_clear_error(ctx);
  cr_assert(isnan(kiln_tensor_item(kiln_sum(a, KILN_ALL_AXES, 0))));
  kiln_ctx_clear_error(ctx);
  /* what a flush would run is planned and compiled, and nothing runs */
  kiln_relu(a);
  cr_assert_eq(kiln_sync(ctx), KILN_OK, "%s", th_err(ctx));
  kiln_exec_stats st;
  kiln_stats(ctx, &st);
  cr_assert_eq(st.last_flush.groups, 1);
  cr_assert_eq(st.kernels_launched, 0);
  cr_assert_eq(st.nodes_executed, 0);
  th_free_scratch();
  th_ctx_free(ctx);
}

/* Without a usable GPU, kiln_ctx_new says so, why (no driver at all, on a machine without one),
 * in CUDA's words too, and how to make a context anyway. */
Test(errors, without_a_gpu_the_context_says_why_and_names_no_gpu) {
  kiln_ctx *ctx = kiln_ctx_new(NULL);
  cr_assert_not_null(ctx);
  if (kiln_ctx_has_gpu(ctx)) {
    kiln_ctx_free(ctx);
    cr_skip_test("this machine has a usable GPU: no message to check");
  }
  const char *e = kiln_ctx_error(ctx);
  cr_assert_not_null(e);
  cr_assert_eq(kiln_ctx_status(ctx), KILN_ERR_STATE);
  cr_assert(strncmp(e, "kiln_ctx_new: no usable GPU: ", 29) == 0, "%s", e);
  cr_assert_not_null(strstr(e, "CUDA says: \""), "CUDA's own words: %s", e);
  cr_assert_not_null(strstr(e, "kiln_ctx_options.no_gpu = 1"), "the way out: %s", e);
  void *driver = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!driver)
    cr_assert_not_null(strstr(e, "no NVIDIA driver is installed"), "no driver here: %s", e);
  else {
    cr_assert(strstr(e, "the NVIDIA driver supports CUDA up to") ||
                  strstr(e, "the NVIDIA driver sees no GPU") ||
                  strstr(e, "the CUDA driver cannot be used"),
              "%s", e);
    dlclose(driver);
  }
  kiln_ctx_free(ctx);
  /* and no_gpu = 1 makes a context with no error */
  ctx = th_cpu_ctx();
  th_assert_ok(ctx);
  th_ctx_free(ctx);
}
