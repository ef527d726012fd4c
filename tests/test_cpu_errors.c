/*
 * test_cpu_errors.c: sticky errors on a no-GPU context: the first error wins and later calls
 * record nothing until kiln_ctx_clear_error; NULL inputs, tensors of another context, what a
 * context without a GPU refuses to run, kiln_ctx_new's message where there is no usable GPU, and
 * a step ended inside an autocast region.
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

/* A step ended inside an open autocast region fails as any failed step: nothing is planned or
 * run, its host state (optimizer step counts, gradients' presence, loader positions) is undone,
 * and the region stays open until the caller closes it. */
Test(errors, a_step_ended_in_an_autocast_region_fails_and_changes_nothing, .timeout = 300) {
  kiln_ctx *ctx = th_cpu_ctx();
  uint8_t images[6 * 4], labels[6] = {0, 1, 2, 0, 1, 2};
  for (int i = 0; i < 24; i++)
    images[i] = (uint8_t)(i * 11);
  kiln_dataset *ds = kiln_dataset_from_host(ctx, KILN_HOST_U8, KILN_SHAPE(6, 2, 2, 1), images,
                                            (kiln_host_labels){.u8 = labels, .classes = 3}, NULL);
  kiln_loader *l = kiln_loader_new(ds, &(kiln_loader_options){.batch = 2}); /* three batches */
  kiln_params *p = kiln_params_new(ctx);
  kiln_linear fc;
  cr_assert_eq(kiln_linear_init(&fc, p, &(kiln_linear_options){.name = "fc", .in = 4, .out = 3}),
               KILN_OK);
  kiln_optim *o = kiln_sgd_new(p, &(kiln_sgd_options){.lr = 0.1f, .momentum = 0.9f});
  cr_assert(ds && l && o, "%s", th_err(ctx));
  for (int regions = 1; regions <= 2; regions++) {
    kiln_exec_stats s0, s1;
    kiln_stats(ctx, &s0);
    kiln_step_begin(ctx);
    kiln_tensor *x, *y;
    cr_assert(kiln_loader_next(l, &x, &y));
    for (int i = 0; i < regions; i++)
      kiln_autocast_begin(ctx, KILN_DTYPE_BF16);
    kiln_tensor *loss =
        kiln_cross_entropy(kiln_linear_forward(&fc, kiln_flatten(x)), y, KILN_REDUCTION_MEAN, 0.f);
    kiln_optim_zero_grad(o);
    cr_assert_eq(kiln_backward(loss), KILN_OK, "%s", th_err(ctx));
    cr_assert_eq(kiln_optim_step(o), KILN_OK, "%s", th_err(ctx));
    cr_assert_eq(kiln_optim_steps(o), 1, "recorded");
    cr_assert_eq(kiln_step_end(ctx), KILN_ERR_STATE);
    if (regions == 1)
      TH_ASSERT_ERROR(ctx, KILN_ERR_STATE, "kiln_step_end", "1 autocast region is open",
                      "close it inside the step", "not run");
    else
      TH_ASSERT_ERROR(ctx, KILN_ERR_STATE, "kiln_step_end", "2 autocast regions are open",
                      "close them");
    kiln_ctx_clear_error(ctx);
    kiln_stats(ctx, &s1);
    cr_assert_eq(s1.groups, s0.groups, "the failed step was planned");
    cr_assert_eq(s1.kernels_compiled + s1.cache_hits, s0.kernels_compiled + s0.cache_hits);
    cr_assert_eq(kiln_optim_steps(o), 0, "the optimizer's step count was not undone");
    cr_assert_null(kiln_tensor_grad(fc.weight), "the gradient's presence was not undone");
    /* the regions stay open: each end closes one, and one more is an error */
    for (int i = 0; i < regions; i++) {
      kiln_autocast_end(ctx);
      th_assert_ok(ctx);
    }
    kiln_autocast_end(ctx);
    TH_ASSERT_ERROR(ctx, KILN_ERR_STATE, "kiln_autocast_end", "no autocast region is open");
    kiln_ctx_clear_error(ctx);
  }
  /* closed inside the step, the same step runs, from the same first batch */
  kiln_step_begin(ctx);
  kiln_tensor *x, *y;
  cr_assert(kiln_loader_next(l, &x, &y));
  kiln_autocast_begin(ctx, KILN_DTYPE_BF16);
  kiln_tensor *logits = kiln_linear_forward(&fc, kiln_flatten(x));
  kiln_autocast_end(ctx);
  kiln_tensor *loss = kiln_cross_entropy(logits, y, KILN_REDUCTION_MEAN, 0.f);
  kiln_optim_zero_grad(o);
  kiln_backward(loss);
  kiln_optim_step(o);
  cr_assert_eq(kiln_step_end(ctx), KILN_OK, "%s", th_err(ctx));
  cr_assert_eq(kiln_optim_steps(o), 1);
  int left = 0;
  for (;; left++) {
    kiln_step_begin(ctx);
    int got = kiln_loader_next(l, &x, &y);
    cr_assert_eq(kiln_step_end(ctx), KILN_OK, "%s", th_err(ctx));
    if (!got) break;
  }
  cr_assert_eq(left, 2, "the failed steps' batches were not given back");
  /* an autocast region outside any step is no step's business */
  kiln_autocast_begin(ctx, KILN_DTYPE_BF16);
  cr_assert_eq(kiln_step_end(ctx), KILN_OK, "no step is open: %s", th_err(ctx));
  kiln_autocast_end(ctx);
  th_assert_ok(ctx);
  kiln_optim_free(o);
  kiln_params_free(p);
  kiln_loader_free(l);
  kiln_dataset_free(ds);
  th_ctx_free(ctx);
}
