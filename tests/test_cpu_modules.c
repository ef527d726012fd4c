/*
 * test_cpu_modules.c: modules without a GPU. PyTorch's MNIST example net (pytorch/examples'
 * mnist) built as a sequential container has PyTorch's state_dict names, its parameter count
 * (1,199,882) and print(model)'s text, and records, differentiates, plans and compiles a training
 * step; nested containers give dotted names with batch norm's buffers beside its parameters (and
 * out of the count), custom layers run their function; bad options and names fail naming the
 * layer and leave the container as it was; a layer's init and its module take one options struct;
 * kiln_module_call runs a module as a forward callback.
 */
#include <string.h>

#include "helpers.h"
#include "inspect.h"

/* pytorch/examples mnist's Net as an nn.Sequential */
static kiln_module *mnist_net(kiln_params *p) {
  kiln_module *net = kiln_sequential_new(p);
  kiln_seq_conv2d(net, &(kiln_conv2d_layer_options){.in = 1, .out = 32, .kernel = 3});
  kiln_seq_relu(net);
  kiln_seq_conv2d(net, &(kiln_conv2d_layer_options){.in = 32, .out = 64, .kernel = 3});
  kiln_seq_relu(net);
  kiln_seq_max_pool2d(net, &(kiln_pool2d_options){.kernel_h = 2, .kernel_w = 2});
  kiln_seq_dropout(net, 0.25f);
  kiln_seq_flatten(net);
  kiln_seq_linear(net, &(kiln_linear_options){.in = 9216, .out = 128});
  kiln_seq_relu(net);
  kiln_seq_dropout(net, 0.5f);
  kiln_seq_linear(net, &(kiln_linear_options){.in = 128, .out = 10});
  return net;
}

Test(modules, mnist_net_has_pytorchs_names_count_and_printout) {
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_params *p = kiln_params_new(ctx);
  kiln_module *net = mnist_net(p);
  th_assert_ok(ctx);
  const char *names[] = {"0.weight", "0.bias", "2.weight",  "2.bias",
                         "7.weight", "7.bias", "10.weight", "10.bias"};
  cr_assert_eq(kiln_params_count(p), 8);
  for (int i = 0; i < 8; i++)
    cr_assert_str_eq(kiln_params_name(p, i), names[i]);
  cr_assert_eq(kiln_module_parameters(net), 1199882); /* sum(p.numel() for p in net.parameters()) */
  char *text = kiln_module_describe(net);
  const char *want = "Sequential(\n"
                     "  (0): Conv2d(1, 32, kernel_size=(3, 3), stride=(1, 1))\n"
                     "  (1): ReLU()\n"
                     "  (2): Conv2d(32, 64, kernel_size=(3, 3), stride=(1, 1))\n"
                     "  (3): ReLU()\n"
                     "  (4): MaxPool2d(kernel_size=2, stride=2, padding=0, dilation=1, "
                     "ceil_mode=False)\n"
                     "  (5): Dropout(p=0.25, inplace=False)\n"
                     "  (6): Flatten(start_dim=1, end_dim=-1)\n"
                     "  (7): Linear(in_features=9216, out_features=128, bias=True)\n"
                     "  (8): ReLU()\n"
                     "  (9): Dropout(p=0.5, inplace=False)\n"
                     "  (10): Linear(in_features=128, out_features=10, bias=True)\n"
                     ")\n"
                     "  0.weight [32,1,3,3] 288\n"
                     "  0.bias [32] 32\n"
                     "  2.weight [64,32,3,3] 18432\n"
                     "  2.bias [64] 64\n"
                     "  7.weight [128,9216] 1179648\n"
                     "  7.bias [128] 128\n"
                     "  10.weight [10,128] 1280\n"
                     "  10.bias [10] 10\n"
                     "1199882 parameters\n";
  cr_assert_str_eq(text, want);
  free(text);
  /* a training step records, differentiates, plans and compiles */
  kiln_sgd_options so = kiln_sgd_defaults(0.01f);
  kiln_optim *opt = kiln_sgd_new(p, &so);
  kiln_tensor *x = kiln_tensor_from_host(ctx, KILN_DTYPE_F32, KILN_SHAPE(4, 28, 28, 1),
                                         (float[4 * 28 * 28]){0.5f});
  int32_t labels[4] = {1, 2, 3, 4};
  kiln_tensor *y = kiln_tensor_from_host(ctx, KILN_DTYPE_I32, KILN_SHAPE(4), labels);
  kiln_step_begin(ctx);
  kiln_tensor *logits = kiln_module_forward(net, x);
  cr_assert_not_null(logits, "%s", th_err(ctx));
  kiln_shape s = kiln_tensor_shape(logits);
  cr_assert(s.ndim == 2 && s.d[0] == 4 && s.d[1] == 10);
  kiln_optim_zero_grad(opt);
  kiln_backward(kiln_cross_entropy(logits, y, KILN_REDUCTION_MEAN, 0.f));
  kiln_optim_step(opt);
  cr_assert_eq(kiln_step_end(ctx), KILN_OK, "%s", th_err(ctx));
  kiln_tensor_free(x);
  kiln_tensor_free(y);
  kiln_optim_free(opt);
  kiln_module_free(net);
  kiln_params_free(p);
  th_ctx_free(ctx);
}

static kiln_tensor *twice(void *state, kiln_tensor *x) {
  (*(int *)state)++;
  return kiln_mul_scalar(x, 2.f);
}

Test(modules, nested_containers_buffers_and_custom_layers) {
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_params *p = kiln_params_new(ctx);
  kiln_module *net = kiln_sequential_new(p);
  kiln_module *features = kiln_seq_sequential(net, "features");
  kiln_seq_conv2d(features, &(kiln_conv2d_layer_options){
                                .in = 3, .out = 8, .kernel = 3, .padding = 1, .no_bias = 1});
  kiln_seq_batch_norm(features, &(kiln_batch_norm_layer_options){.features = 8});
  kiln_seq_gelu(features, KILN_GELU_TANH);
  int calls = 0;
  kiln_seq_custom(features, "Twice", twice, &calls);
  kiln_seq_global_avg_pool2d(net);
  kiln_seq_linear(net, &(kiln_linear_options){.name = "head", .in = 8, .out = 5});
  th_assert_ok(ctx);
  const char *names[] = {
      "features.0.weight",      "features.1.weight", "features.1.bias", "features.1.running_mean",
      "features.1.running_var", "head.weight",       "head.bias"};
  cr_assert_eq(kiln_params_count(p), 7);
  for (int i = 0; i < 7; i++)
    cr_assert_str_eq(kiln_params_name(p, i), names[i]);
  /* 216 + 8 + 8 + 40 + 5: the running statistics are buffers, not parameters */
  cr_assert_eq(kiln_module_parameters(net), 277);
  cr_assert_eq(kiln_params_numel(p), 277 + 16);
  char *text = kiln_module_describe(net);
  cr_assert(strstr(text, "  (features): Sequential(\n"
                         "    (0): Conv2d(3, 8, kernel_size=(3, 3), stride=(1, 1), padding=(1, 1), "
                         "bias=False)\n"
                         "    (1): BatchNorm2d(8, eps=1e-05, momentum=0.1, affine=True, "
                         "track_running_stats=True)\n"
                         "    (2): GELU(approximate='tanh')\n"
                         "    (3): Twice()\n"
                         "  )\n"
                         "  (1): AdaptiveAvgPool2d(output_size=1)\n"
                         "  (head): Linear(in_features=8, out_features=5, bias=True)\n"),
            "%s", text);
  /* the parameters by their state_dict names, without the buffers */
  cr_assert(strstr(text, ")\n"
                         "  features.0.weight [8,3,3,3] 216\n"
                         "  features.1.weight [8] 8\n"
                         "  features.1.bias [8] 8\n"
                         "  head.weight [5,8] 40\n"
                         "  head.bias [5] 5\n"
                         "277 parameters\n"),
            "%s", text);
  free(text);
  kiln_tensor *x = th_new(ctx, KILN_DTYPE_F32, KILN_SHAPE(2, 6, 6, 3));
  kiln_step_begin(ctx);
  kiln_tensor *out = kiln_module_forward(net, x);
  cr_assert_not_null(out, "%s", th_err(ctx));
  cr_assert_eq(calls, 1);
  kiln_shape s = kiln_tensor_shape(out);
  cr_assert(s.ndim == 2 && s.d[0] == 2 && s.d[1] == 5);
  cr_assert_eq(kiln_step_end(ctx), KILN_OK, "%s", th_err(ctx));
  kiln_tensor_free(x);
  kiln_module_free(net);
  kiln_params_free(p);
  th_ctx_free(ctx);
}

Test(modules, bad_options_and_names_leave_the_container_as_it_was) {
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_params *p = kiln_params_new(ctx);
  kiln_module *net = kiln_sequential_new(p);
  kiln_module *relu = kiln_seq_relu(net);
  static const char *const says[] = {"kiln_seq_conv2d: '1': in 3, out 8, kernel 0 x 0",
                                     "NULL options",
                                     "kiln_seq_linear: '1': in 0",
                                     "eps -1",
                                     "p 1 must be in [0, 1)",
                                     "kernel_h 0",
                                     "added to a container",
                                     "without '.'",
                                     "already has a child '0'",
                                     "NULL function",
                                     "kiln_seq_conv2d: '1': no_bias 2 must be 0 or 1",
                                     "kiln_seq_batch_norm: '1': momentum 2 must be in [0, 1]"};
  for (size_t i = 0; i < sizeof says / sizeof says[0]; i++) {
    kiln_module *got = NULL;
    switch (i) {
    case 0: got = kiln_seq_conv2d(net, &(kiln_conv2d_layer_options){.in = 3, .out = 8}); break;
    case 1: got = kiln_seq_conv2d(net, NULL); break;
    case 2: got = kiln_seq_linear(net, &(kiln_linear_options){.in = 0, .out = 3}); break;
    case 3:
      got = kiln_seq_batch_norm(net, &(kiln_batch_norm_layer_options){.features = 4, .eps = -1.f});
      break;
    case 4: got = kiln_seq_dropout(net, 1.f); break;
    case 5: got = kiln_seq_max_pool2d(net, NULL); break;
    case 6: got = kiln_seq_relu(relu); break;
    case 7: got = kiln_seq_sequential(net, "a.b"); break;
    case 8:
      got = kiln_seq_linear(net, &(kiln_linear_options){.name = "0", .in = 2, .out = 3});
      break;
    case 9: got = kiln_seq_custom(net, "Nothing", NULL, NULL); break;
    case 10:
      got = kiln_seq_conv2d(
          net, &(kiln_conv2d_layer_options){.in = 3, .out = 8, .kernel = 3, .no_bias = 2});
      break;
    case 11:
      got =
          kiln_seq_batch_norm(net, &(kiln_batch_norm_layer_options){.features = 4, .momentum = 2});
      break;
    }
    cr_assert_null(got, "case %zu", i);
    cr_assert(strstr(th_err(ctx), says[i]), "case %zu: %s", i, th_err(ctx));
    kiln_ctx_clear_error(ctx);
  }
  /* nothing was added: the next child is still 1, and no parameter was made */
  cr_assert_eq(kiln_params_count(p), 0);
  kiln_module *lin = kiln_seq_linear(net, &(kiln_linear_options){.in = 2, .out = 3});
  cr_assert_not_null(lin, "%s", th_err(ctx));
  cr_assert_str_eq(kiln_params_name(p, 0), "1.weight");
  kiln_module_free(lin); /* a child: an error, and nothing freed */
  cr_assert(strstr(th_err(ctx), "'1' is a child of a container"), "%s", th_err(ctx));
  kiln_ctx_clear_error(ctx);
  kiln_module_free(net);
  kiln_params_free(p);
  th_ctx_free(ctx);
}

/* A layer and a module are made from one options struct: the same value gives the same layer
 * (its parameters' names and shapes, its options, its printout), named .name by the layer's init
 * and, in a container, as its child. */
Test(modules, a_layer_and_a_module_take_the_same_options) {
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_params *lp = kiln_params_new(ctx), *mp = kiln_params_new(ctx);
  kiln_conv2d_layer_options co = {.name = "conv",
                                  .in = 3,
                                  .out = 8,
                                  .kernel_h = 3,
                                  .kernel_w = 1,
                                  .stride = 2,
                                  .padding = 1,
                                  .no_bias = 1};
  kiln_batch_norm_layer_options bo = {
      .name = "bn", .features = 8, .momentum = KILN_ZERO, .no_affine = 1};
  kiln_linear_options lo = {.name = "fc", .in = 8, .out = 4};
  kiln_conv2d_layer conv;
  kiln_batch_norm_layer bn;
  kiln_linear fc;
  cr_assert_eq(kiln_conv2d_layer_init(&conv, lp, &co), KILN_OK, "%s", th_err(ctx));
  cr_assert_eq(kiln_batch_norm_layer_init(&bn, lp, &bo), KILN_OK, "%s", th_err(ctx));
  cr_assert_eq(kiln_linear_init(&fc, lp, &lo), KILN_OK, "%s", th_err(ctx));
  kiln_module *net = kiln_sequential_new(mp);
  cr_assert_not_null(kiln_seq_conv2d(net, &co), "%s", th_err(ctx));
  cr_assert_not_null(kiln_seq_batch_norm(net, &bo), "%s", th_err(ctx));
  cr_assert_not_null(kiln_seq_linear(net, &lo), "%s", th_err(ctx));
  const char *names[] = {"conv.weight", "bn.running_mean", "bn.running_var", "fc.weight",
                         "fc.bias"};
  cr_assert_eq(kiln_params_count(lp), 5);
  cr_assert_eq(kiln_params_count(mp), 5);
  for (int i = 0; i < 5; i++) {
    cr_assert_str_eq(kiln_params_name(lp, i), names[i]);
    cr_assert_str_eq(kiln_params_name(mp, i), names[i]);
    th_assert_shape(kiln_params_get(mp, i), kiln_tensor_shape(kiln_params_get(lp, i)));
  }
  th_assert_shape(conv.weight, KILN_SHAPE(8, 3, 3, 1));
  cr_assert(conv.opt.stride_h == 2 && conv.opt.stride_w == 2 && conv.opt.pad_h == 1 &&
            conv.opt.pad_w == 1);
  cr_assert(bn.momentum == 0.f && bn.eps == 1e-5f && !bn.weight);
  char *text = kiln_module_describe(net);
  cr_assert(strstr(text, "  (conv): Conv2d(3, 8, kernel_size=(3, 1), stride=(2, 2), "
                         "padding=(1, 1), bias=False)\n"
                         "  (bn): BatchNorm2d(8, eps=1e-05, momentum=0, affine=False, "
                         "track_running_stats=True)\n"
                         "  (fc): Linear(in_features=8, out_features=4, bias=True)\n"),
            "%s", text);
  free(text);
  kiln_module_free(net);
  kiln_params_free(mp);
  kiln_params_free(lp);
  th_ctx_free(ctx);
}

/* kiln_module_call is kiln_module_forward behind a kiln_forward_fn (kiln_evaluate's callback),
 * taken as one without a cast; a NULL module is an error naming it. */
Test(modules, module_call_runs_the_module_as_a_forward_callback) {
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_params *p = kiln_params_new(ctx);
  kiln_module *net = mnist_net(p);
  kiln_forward_fn fn = kiln_module_call;
  kiln_tensor *x = th_f32(ctx, KILN_SHAPE(2, 28, 28, 1));
  int32_t n0 = th_tlen(ctx);
  kiln_tensor *y = fn(net, x);
  cr_assert_not_null(y, "%s", th_err(ctx));
  th_assert_shape(y, KILN_SHAPE(2, 10));
  int32_t n_call = th_tlen(ctx) - n0;
  n0 = th_tlen(ctx);
  th_assert_shape(kiln_module_forward(net, x), KILN_SHAPE(2, 10));
  cr_assert_eq(th_tlen(ctx) - n0, n_call, "the same nodes as kiln_module_forward");
  TH_EXPECT_FAIL(ctx, kiln_module_call(NULL, x), KILN_ERR_INVALID, "kiln_module_call",
                 "NULL module");
  cr_assert_null(kiln_module_call(net, NULL), "a NULL input (an earlier failure) passes on");
  th_assert_ok(ctx);
  kiln_module_free(net);
  kiln_params_free(p);
  th_free_scratch();
  th_ctx_free(ctx);
}
