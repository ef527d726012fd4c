/*
 * test_gpu_modules.c: a model built from modules against the same model in PyTorch. kiln trains
 * a conv-BN-ReLU-pool-flatten-linear nn.Sequential for a few steps (so that batch norm's running
 * statistics move), saves its parameters, and tests/torch_modules.py loads them into the
 * PyTorch model by name and runs it in eval mode: the logits agree with kiln's within f32
 * rounding, and print(model) is what kiln_module_describe says. Skips without a GPU, and when
 * python3 with torch and safetensors is missing.
 */
#include <math.h>
#include <stdio.h>
#include <string.h>
#include <sys/wait.h>

#include "helpers.h"

TestSuite(gpu_modules, .fini = th_remove_tmpdirs);

Test(gpu_modules, weights_go_to_pytorch_by_name_and_give_its_outputs, .timeout = 300) {
  TH_GPU_CTX(ctx);
  kiln_params *p = kiln_params_new(ctx);
  kiln_module *net = kiln_sequential_new(p);
  kiln_module *f = kiln_seq_sequential(net, "features");
  kiln_seq_conv2d(
      f, &(kiln_conv2d_layer_options){.in = 3, .out = 8, .kernel = 3, .padding = 1, .no_bias = 1});
  kiln_seq_batch_norm(f, &(kiln_batch_norm_layer_options){.features = 8});
  kiln_seq_relu(f);
  kiln_seq_max_pool2d(f, &(kiln_pool2d_options){.kernel_h = 2, .kernel_w = 2});
  kiln_seq_flatten(net);
  kiln_seq_linear(net, &(kiln_linear_options){.name = "head", .in = 128, .out = 5});
  th_assert_ok(ctx);
  /* a few training steps */
  kiln_optim *opt = kiln_sgd_new(p, &(kiln_sgd_options){.lr = 0.05f, .momentum = 0.9f});
  float *xh;
  kiln_tensor *x = th_rand(ctx, KILN_SHAPE(2, 8, 8, 3), 11, -1.f, 1.f, &xh);
  int32_t lab[2] = {1, 3};
  kiln_tensor *y = kiln_tensor_from_host(ctx, KILN_DTYPE_I32, KILN_SHAPE(2), lab);
  for (int s = 0; s < 3; s++) {
    kiln_step_begin(ctx);
    kiln_tensor *loss =
        kiln_cross_entropy(kiln_module_forward(net, x), y, KILN_REDUCTION_MEAN, 0.f);
    kiln_optim_zero_grad(opt);
    kiln_backward(loss);
    kiln_optim_step(opt);
    cr_assert_eq(kiln_step_end(ctx), KILN_OK, "%s", th_err(ctx));
  }
  /* eval mode: the running statistics */
  kiln_set_training(ctx, 0);
  kiln_step_begin(ctx);
  kiln_tensor *logits = kiln_module_forward(net, x);
  cr_assert_eq(kiln_step_end(ctx), KILN_OK, "%s", th_err(ctx));
  float *mine = th_read(logits);
  char dir[256], w[512], in[512], out[512], cmd[2048];
  th_tmpdir(dir, sizeof dir, "modules");
  snprintf(w, sizeof w, "%s/w.safetensors", dir);
  snprintf(in, sizeof in, "%s/x.f32", dir);
  snprintf(out, sizeof out, "%s/torch", dir);
  cr_assert_eq(kiln_params_save(p, w, KILN_DTYPE_F32), KILN_OK, "%s", th_err(ctx));
  th_write_whole(in, xh, sizeof(float) * 2 * 8 * 8 * 3);
  snprintf(cmd, sizeof cmd, "python3 '%s/tests/torch_modules.py' '%s' '%s' '%s'", KILN_SOURCE_DIR,
           w, in, out);
  int st = system(cmd);
  int code = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  if (code == 2) cr_skip_test("python3 with torch, numpy and safetensors is missing");
  cr_assert_eq(code, 0, "%s failed (%d)", cmd, code);
  char path[600];
  snprintf(path, sizeof path, "%s.logits", out);
  size_t n;
  float *theirs = (float *)th_read_whole(path, &n);
  cr_assert_eq(n, sizeof(float) * 10);
  double want[10];
  for (int i = 0; i < 10; i++)
    want[i] = theirs[i];
  th_assert_close(mine, want, 10, 1e-4, 1e-4, "logits against PyTorch's");
  snprintf(path, sizeof path, "%s.txt", out);
  char *text = th_read_whole(path, NULL), *desc = kiln_module_describe(net);
  /* kiln's text is torch's, then the parameter count */
  cr_assert_eq(strncmp(desc, text, strlen(text)), 0, "kiln:\n%s\ntorch:\n%s", desc, text);
  free(desc);
  free(text);
  free(theirs);
  free(mine);
  free(xh);
  kiln_set_training(ctx, 1);
  kiln_tensor_free(x);
  kiln_tensor_free(y);
  kiln_optim_free(opt);
  kiln_module_free(net);
  kiln_params_free(p);
  th_ctx_free(ctx);
}
