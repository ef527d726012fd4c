/*
 * test_cpu_fusion.c: the planner on known traces, without a GPU: which nodes share a kernel,
 * which values are written to memory and which stay in registers, and that every fused kernel's
 * CUDA C compiles for sm_90.
 */
#include <string.h>

#include "fusion/fusion.h"
#include "inspect.h"

/* The plan of everything recorded so far, with fusion on or off. */
static kiln__plan plan(kiln_ctx *ctx, bool fuse) {
  kiln__plan p;
  cr_assert(kiln__plan_build(ctx, ctx->trace.done, ctx->trace.n, fuse, &p), "%s",
            kiln_ctx_error(ctx));
  return p;
}

/* The plan's description (kiln__plan_describe: "add relu* | sum", '*' for values kept in
 * registers), after checking the plan's invariants. */
static void expect_plan(kiln_ctx *ctx, bool fuse, const char *want) {
  kiln__plan p = plan(ctx, fuse);
  char why[512];
  const char *bad = kiln__plan_verify(ctx, &p, why, sizeof why);
  cr_assert_null(bad, "the plan breaks an invariant: %s", bad);
  kiln__sb got = {0};
  kiln__plan_describe(ctx, &p, &got);
  cr_assert_str_eq(got.s, want);
  kiln__sb_free(&got);
  kiln__plan_free(&p);
}

/* The plan's description into buf. */
static void describe(const kiln_ctx *ctx, const kiln__plan *p, char *buf, size_t n) {
  kiln__sb sb = {0};
  kiln__plan_describe(ctx, p, &sb);
  cr_assert(!sb.oom);
  snprintf(buf, n, "%s", sb.s);
  kiln__sb_free(&sb);
}

/* Plans and compiles everything recorded and not yet run, as kiln_step_end would. */
static kiln_status compile_pending(kiln_ctx *ctx) {
  return kiln__engine_compile(ctx, ctx->trace.done, ctx->trace.n);
}

Test(fusion, elementwise_chain_is_one_kernel_with_broadcast_inputs) {
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_tensor *a = th_f32(ctx, KILN_SHAPE(64, 32)), *b = th_f32(ctx, KILN_SHAPE(32));
  kiln_tensor *c = th_f32(ctx, KILN_SHAPE(64, 1));
  kiln_tensor *y = kiln_mul(kiln_relu(kiln_add(a, b)), c);
  cr_assert_not_null(y);
  expect_plan(ctx, true, "add* relu* mul");
  expect_plan(ctx, false, "add | relu | mul");
  th_free_scratch();
  th_ctx_free(ctx);
}

Test(fusion, a_value_used_outside_is_written) {
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_tensor *a = th_f32(ctx, KILN_SHAPE(16, 8));
  kiln_tensor *e = kiln_exp(a);
  kiln_tensor *s = kiln_sum(kiln_relu(e), KILN_AXES(0), 1); /* a reduction reads relu */
  kiln_tensor *d = kiln_div(e, s); /* e is read again after the reduction */
  cr_assert_not_null(d);
  expect_plan(ctx, true, "exp relu* sum | div");
  th_free_scratch();
  th_ctx_free(ctx);
}

Test(fusion, shape_changes_and_views_split_runs) {
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_tensor *a = th_f32(ctx, KILN_SHAPE(8, 8));
  kiln_tensor *t = kiln_exp(a);
  /* reading t transposed while the kernel writes t would race: a new kernel */
  kiln_tensor *u = kiln_add(kiln_transpose(t, 0, 1), a);
  kiln_tensor *v = kiln_neg(kiln_reshape(u, KILN_SHAPE(64)));
  cr_assert_not_null(v);
  expect_plan(ctx, true, "exp | add | neg");
  th_free_scratch();
  th_ctx_free(ctx);
}

Test(fusion, softmax_is_one_kernel) {
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_tensor *a = th_f32(ctx, KILN_SHAPE(128, 10));
  cr_assert_not_null(kiln_softmax(a, 1));
  /* one block per row: the max, then the sum of exponentials, then the quotient, each a pass
   * over the row that recomputes what it needs */
  expect_plan(ctx, true, "max* sub* exp* sum* div");
  expect_plan(ctx, false, "max | sub | exp | sum | div");
  cr_assert_eq(compile_pending(ctx), KILN_OK, "%s", kiln_ctx_error(ctx));
  th_free_scratch();
  th_ctx_free(ctx);
}

Test(fusion, log_softmax_nll_and_mean_variance_are_row_programs) {
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_tensor *a = th_f32(ctx, KILN_SHAPE(64, 33));
  kiln_tensor *lab = th_i32(ctx, KILN_SHAPE(64));
  /* log_softmax and the NLL of the labels: one kernel per row, then the batch mean */
  cr_assert_not_null(kiln_cross_entropy(a, lab, KILN_REDUCTION_MEAN, 0.f));
  expect_plan(ctx, true, "max* sub* exp* sum* log* sub* onehot* mul* sum* neg | sum");
  cr_assert_eq(compile_pending(ctx), KILN_OK, "%s", kiln_ctx_error(ctx));
  kiln_step_begin(ctx);
  /* mean and variance over the last axis, and the normalised values, in one kernel */
  kiln_tensor *m = kiln_mean(a, KILN_AXES(1), 1);
  kiln_tensor *d = kiln_sub(a, m);
  kiln_tensor *v = kiln_mean(kiln_mul(d, d), KILN_AXES(1), 1);
  cr_assert_not_null(kiln_mul(d, kiln_rsqrt(kiln_add_scalar(v, 1e-5f))));
  expect_plan(ctx, true, "sum* sub* mul* sum* add_scalar* rsqrt* mul");
  cr_assert_eq(compile_pending(ctx), KILN_OK, "%s", kiln_ctx_error(ctx));
  kiln_step_begin(ctx);
  /* a per-row value read as a column vector (no kept dim) is another iteration space */
  kiln_tensor *s = kiln_sum(th_f32(ctx, KILN_SHAPE(16, 16)), KILN_AXES(1), 0);
  cr_assert_not_null(kiln_add(th_f32(ctx, KILN_SHAPE(16, 16)), s));
  expect_plan(ctx, true, "sum | add");
  th_free_scratch();
  th_ctx_free(ctx);
}

Test(fusion, dropout_stays_out_of_reduction_prologues) {
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_tensor *a = th_f32(ctx, KILN_SHAPE(32, 32));
  cr_assert_not_null(kiln_sum(kiln_dropout(kiln_relu(a), 0.5f, 1), KILN_ALL_AXES, 0));
  expect_plan(ctx, true, "relu* dropout | sum");
  th_free_scratch();
  th_ctx_free(ctx);
}

Test(fusion, matmul_bias_relu_epilogue) {
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_params *p = kiln_params_new(ctx);
  kiln_linear l1, l2;
  cr_assert_eq(kiln_linear_init(&l1, p, &(kiln_linear_options){.name = "l1", .in = 20, .out = 16}),
               KILN_OK);
  cr_assert_eq(kiln_linear_init(&l2, p, &(kiln_linear_options){.name = "l2", .in = 16, .out = 4}),
               KILN_OK);
  kiln_tensor *x = th_f32(ctx, KILN_SHAPE(8, 20));
  kiln_no_grad_begin(ctx);
  kiln_tensor *h = kiln_relu(kiln_linear_forward(&l1, x));
  cr_assert_not_null(kiln_linear_forward(&l2, h));
  kiln_no_grad_end(ctx);
  expect_plan(ctx, true, "matmul* add* relu [bias+relu] | matmul* add [bias]");
  expect_plan(ctx, false, "matmul | add | relu | matmul | add");
  /* with gradients the ReLU also writes its bit mask for the backward pass */
  kiln_step_begin(ctx);
  h = kiln_relu(kiln_linear_forward(&l1, x));
  cr_assert_not_null(kiln_linear_forward(&l2, h));
  expect_plan(ctx, true, "matmul* add* relu [bias+relu+mask] | matmul* add [bias]");
  /* but not for a product of more than 2^20 elements (cuBLASLt would write the mask in a
   * kernel of its own): the ReLU's derivative reads the ReLU's output instead */
  kiln_step_begin(ctx);
  kiln_tensor *tall = th_f32(ctx, KILN_SHAPE(65537, 20));
  h = kiln_relu(kiln_linear_forward(&l1, tall));
  cr_assert_not_null(kiln_linear_forward(&l2, h));
  expect_plan(ctx, true, "matmul* add* relu [bias+relu] | matmul* add [bias]");
  /* a product whose result is read elsewhere too keeps it, and gets no epilogue */
  kiln_step_begin(ctx);
  kiln_tensor *y = kiln_linear_forward(&l1, x);
  kiln_tensor *z = kiln_add(kiln_matmul(x, kiln_transpose(l1.weight, 0, 1)), y);
  cr_assert_not_null(z);
  expect_plan(ctx, true, "matmul* add [bias] | matmul | add");
  kiln_params_free(p);
  th_free_scratch();
  th_ctx_free(ctx);
}

/* Records a two-layer MLP's forward and backward with a ReLU or tanh-GELU hidden layer; the
 * caller frees the parameters once it has looked at the plan. */
static kiln_params *two_layer_step(kiln_ctx *ctx, int64_t hidden, bool gelu, bool flush_forward) {
  kiln_params *p = kiln_params_new(ctx);
  kiln_linear l1, l2;
  cr_assert_eq(
      kiln_linear_init(&l1, p, &(kiln_linear_options){.name = "l1", .in = 24, .out = hidden}),
      KILN_OK);
  cr_assert_eq(
      kiln_linear_init(&l2, p, &(kiln_linear_options){.name = "l2", .in = hidden, .out = 4}),
      KILN_OK);
  kiln_tensor *x = th_f32(ctx, KILN_SHAPE(32, 24));
  kiln_tensor *z = kiln_linear_forward(&l1, x);
  kiln_tensor *h = gelu ? kiln_gelu(z, KILN_GELU_TANH) : kiln_relu(z);
  kiln_tensor *loss = kiln_sum(kiln_linear_forward(&l2, h), KILN_ALL_AXES, 0);
  if (flush_forward) ctx->trace.done = ctx->trace.n; /* as if the forward ran in a flush */
  cr_assert_eq(kiln_backward(loss), KILN_OK, "%s", kiln_ctx_error(ctx));
  th_assert_ok(ctx);
  return p;
}

Test(fusion, backward_epilogues) {
  kiln_ctx *ctx = th_cpu_ctx();
  char got[2048];
  /* GELU (tanh) writes its input beside its output; the backward product multiplies by the
   * derivative at it and sums the bias gradient (DGELU_BGRAD); the weight gradient's product
   * sums the last layer's bias gradient (BGRADB) */
  kiln_params *p = two_layer_step(ctx, 16, true, false);
  kiln__plan pl = plan(ctx, true);
  describe(ctx, &pl, got, sizeof got);
  cr_log_info("gelu MLP: %s", got);
  cr_assert(strstr(got, "matmul* add gelu_tanh [bias+gelu+input]") == got, "%s", got);
  cr_assert(strstr(got, "matmul* gelu_tanh_grad sum [dgelu+bgrad]") != NULL ||
                strstr(got, "matmul* gelu_tanh_grad [dgelu]") != NULL,
            "%s", got);
  cr_assert(strstr(got, "matmul sum [bgradb]") != NULL, "%s", got);
  kiln__plan_free(&pl);
  cr_assert_eq(compile_pending(ctx), KILN_OK, "%s", kiln_ctx_error(ctx));
  kiln_params_free(p);
  /* 12 hidden units: cuBLASLt writes a GELU input only with 8k columns, so GELU runs as a kernel */
  kiln_step_begin(ctx);
  p = two_layer_step(ctx, 12, true, false);
  pl = plan(ctx, true);
  describe(ctx, &pl, got, sizeof got);
  cr_assert(strstr(got, "matmul* add [bias] | gelu") == got, "%s", got);
  cr_assert(strstr(got, "dgelu") == NULL, "%s", got);
  kiln__plan_free(&pl);
  kiln_params_free(p);
  /* ReLU's mask from a forward flushed earlier: the backward still uses DRELU, the mask being
   * on the output's storage (here none, as nothing ran: then no DRELU) */
  kiln_step_begin(ctx);
  p = two_layer_step(ctx, 16, false, true);
  pl = plan(ctx, true);
  describe(ctx, &pl, got, sizeof got);
  cr_assert(strstr(got, "drelu") == NULL, "no mask exists: %s", got);
  kiln__plan_free(&pl);
  kiln_params_free(p);
  th_free_scratch();
  th_ctx_free(ctx);
}

Test(fusion, values_backward_reads_are_kept) {
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_tensor *a = th_f32(ctx, KILN_SHAPE(8, 8));
  kiln_tensor_set_requires_grad(a, 1);
  /* exp's backward reads its output and mul's its inputs: written even though a kernel could
   * keep them in registers, because kiln_backward may come after this flush */
  kiln_tensor *y = kiln_tanh(kiln_mul(kiln_exp(a), a));
  cr_assert_not_null(y);
  expect_plan(ctx, true, "exp mul* tanh");
  th_free_scratch();
  th_ctx_free(ctx);
}

/* Records one training step of the benchmark MLP on a batch of 128 into m's context. */
static void record_mlp_step(kiln_ctx *ctx, th_mlp *m) {
  th_mlp_init(ctx, m);
  kiln_tensor *x = th_f32(ctx, KILN_SHAPE(128, 784));
  kiln_tensor *y = th_i32(ctx, KILN_SHAPE(128));
  cr_assert_not_null(th_mlp_record_step(m, x, y));
  th_assert_ok(ctx);
}

Test(fusion, mlp_training_step_groups) {
  kiln_ctx *ctx = th_cpu_ctx();
  th_mlp m;
  record_mlp_step(ctx, &m);
  kiln__plan fused = plan(ctx, true), unfused = plan(ctx, false);
  char got[4096];
  describe(ctx, &fused, got, sizeof got);
  cr_log_info("MLP step: %d groups fused, %d unfused: %s", fused.ng, unfused.ng, got);
  /* forward: 3 products with bias (+ReLU, writing the masks); loss: the cross entropy's rows,
   * its mean (with the backward's seed and scale), the rows of its gradient; backward: 5
   * products, the ReLU derivatives and bias gradients in their epilogues, each gradient written
   * straight into its .grad buffer (the assignments run nothing); update: one launch for all six
   * parameters */
  cr_assert_eq(fused.ng, 12, "%d groups: %s", fused.ng, got);
  cr_assert_eq(unfused.ng, 50);
  const char *want = "matmul* add* relu [bias+relu+mask] | matmul* add* relu [bias+relu+mask] | "
                     "matmul* add [bias] | max* sub* exp sum log* sub onehot mul* sum* neg | "
                     "sum fill mul_scalar* neg | mul* neg* sum div mul* add | "
                     "matmul* relu_grad [drelu] | matmul sum [bgradb] | matmul* relu_grad [drelu] "
                     "| matmul sum [bgradb] | matmul sum [bgradb] | sgd_momentum sgd_momentum "
                     "sgd_momentum sgd_momentum sgd_momentum sgd_momentum";
  cr_assert_str_eq(got, want);
  kiln__plan_free(&fused);
  kiln__plan_free(&unfused);
  /* and every kernel of the fused plan compiles */
  cr_assert_eq(compile_pending(ctx), KILN_OK, "%s", kiln_ctx_error(ctx));
  th_mlp_free(&m);
  th_free_scratch();
  th_ctx_free(ctx);
}

Test(fusion, epilogues_the_blas_backend_refuses_run_as_kernels) {
  kiln_ctx *ctx = th_cpu_ctx();
  th_mlp m;
  record_mlp_step(ctx, &m);
  /* a backend with no epilogues: plain products, the biases, ReLUs, their derivatives and the
   * bias gradients in generated kernels */
  kiln__blas_limit(ctx, 1u << KILN__EPI_NONE);
  /* the bias adds join the ReLUs (the last one the loss's row program), the ReLU derivatives
   * the bias gradients' sums */
  const char *plain =
      "matmul | add* relu | matmul | add* relu | matmul | add* max* sub* exp sum "
      "log* sub onehot mul* sum* neg | sum fill mul_scalar* neg | mul* neg* sum div "
      "mul* add | sum | matmul | matmul | relu_grad sum | matmul | matmul | "
      "relu_grad sum | matmul | sgd_momentum sgd_momentum sgd_momentum "
      "sgd_momentum sgd_momentum sgd_momentum";
  expect_plan(ctx, true, plain);
  cr_assert_eq(compile_pending(ctx), KILN_OK, "%s", kiln_ctx_error(ctx));
  /* bias epilogues only: the ReLU joins no product, so no mask and no DRELU either */
  kiln__blas_limit(ctx, (1u << KILN__EPI_NONE) | (1u << KILN__EPI_BIAS));
  kiln__plan p = plan(ctx, true);
  char got[4096];
  describe(ctx, &p, got, sizeof got);
  cr_assert(strstr(got, "matmul* add [bias] | relu") == got, "%s", got);
  cr_assert_null(strstr(got, "relu ["), "%s", got);
  cr_assert_null(strstr(got, "drelu"), "%s", got);
  cr_assert_null(strstr(got, "bgradb"), "%s", got);
  kiln__plan_free(&p);
  /* everything again: the plan of mlp_training_step_groups */
  kiln__blas_limit(ctx, ~0u);
  p = plan(ctx, true);
  cr_assert_eq(p.ng, 12);
  kiln__plan_free(&p);
  th_mlp_free(&m);
  th_free_scratch();
  th_ctx_free(ctx);
}

Test(fusion, a_reduction_takes_in_a_prologue_only_with_room_for_its_operands) {
  /* a run of KILN__KMAX_PTR - 1 elementwise nodes whose values are all read elsewhere (stored:
   * one operand each, and a read by a reduction outside), then a reduction of its last value:
   * taking the run in as its prologue would need one pointer more than a kernel's argument holds */
  enum { RUN = KILN__KMAX_PTR - 1 };
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_tensor *a = th_f32(ctx, KILN_SHAPE(8, 16));
  kiln_tensor *x[RUN];
  x[0] = kiln_exp(a);
  for (int k = 1; k < RUN; k++)
    x[k] = kiln_add(x[k - 1], a);
  cr_assert_not_null(kiln_sum(x[RUN - 1], KILN_AXES(1), 0));
  for (int k = 0; k < RUN; k++)
    cr_assert_not_null(kiln_sum(x[k], KILN_AXES(0), 0));
  kiln__plan p = plan(ctx, true);
  char why[512];
  const char *bad = kiln__plan_verify(ctx, &p, why, sizeof why);
  cr_assert_null(bad, "%s", bad);
  cr_assert_eq(p.g[0].kind, KILN__KIND_EW, "the run stays a kernel of its own");
  cr_assert_eq(p.g[0].n, RUN);
  kiln__plan_free(&p);
  cr_assert_eq(compile_pending(ctx), KILN_OK, "%s", kiln_ctx_error(ctx));
  th_free_scratch();
  th_ctx_free(ctx);
}

/* A no-GPU context that writes every generated source into a fresh directory dir. */
static kiln_ctx *dumping_ctx(char *dir) {
  cr_assert_not_null(mkdtemp(dir));
  setenv("KILN_DUMP_KERNELS", dir, 1);
  kiln_ctx *ctx = th_cpu_ctx();
  unsetenv("KILN_DUMP_KERNELS");
  return ctx;
}

static void dumping_ctx_free(kiln_ctx *ctx, const char *dir) {
  char cmd[512];
  snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
  cr_assert_eq(system(cmd), 0);
  th_ctx_free(ctx);
}

Test(fusion, generated_source_names_its_ops_and_nodes) {
  char dir[] = "/tmp/kiln-fusion-dump-XXXXXX";
  kiln_ctx *ctx = dumping_ctx(dir);
  kiln_tensor *a = th_f32(ctx, KILN_SHAPE(256, 64)), *b = th_f32(ctx, KILN_SHAPE(64));
  cr_assert_not_null(kiln_mul(kiln_relu(kiln_add(a, b)), a));
  cr_assert_eq(compile_pending(ctx), KILN_OK, "%s", kiln_ctx_error(ctx));
  char cmd[512];
  snprintf(cmd, sizeof cmd,
           "grep -l 'trace nodes: #0 add \\[256,64\\] f32 (in registers), #1 relu' "
           "%s/k_add_relu_mul_f32_*.cu"
           " >/dev/null",
           dir);
  cr_assert_eq(system(cmd), 0, "no k_add_relu_mul_f32_* source listing its nodes in %s", dir);
  th_free_scratch();
  dumping_ctx_free(ctx, dir);
}

Test(fusion, dense_operands_get_vector_loads_and_32_bit_indexing) {
  char dir[] = "/tmp/kiln-fusion-vec-XXXXXX";
  kiln_ctx *ctx = dumping_ctx(dir);
  kiln_tensor *a = th_f32(ctx, KILN_SHAPE(1024, 64)), *c = th_f32(ctx, KILN_SHAPE(1024, 64));
  cr_assert_not_null(kiln_sigmoid(kiln_sub(a, c))); /* dense */
  cr_assert_eq(compile_pending(ctx), KILN_OK, "%s", kiln_ctx_error(ctx));
  ctx->trace.done = ctx->trace.n; /* as if flushed: the next chain is a kernel of its own */
  kiln_tensor *ct = kiln_transpose(kiln_reshape(c, KILN_SHAPE(64, 1024)), 0, 1); /* strided */
  cr_assert_not_null(kiln_tanh(kiln_sub(a, ct)));
  cr_assert_eq(compile_pending(ctx), KILN_OK, "%s", kiln_ctx_error(ctx));
  char cmd[512];
  snprintf(cmd, sizeof cmd,
           "grep -q 'kiln_load4' %s/k_sub_sigmoid_f32_v4_*.cu && "
           "grep -q '32-bit indexing' %s/k_sub_sigmoid_f32_v4_*.cu && "
           "! grep -q 'kiln_load4' %s/k_sub_tanh_f32_[0-9a-f]*.cu",
           dir, dir, dir);
  cr_assert_eq(system(cmd), 0, "vector loads where dense, scalar where strided (%s)", dir);
  th_free_scratch();
  dumping_ctx_free(ctx, dir);
}

Test(fusion, gradients_write_through_their_buffers) {
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_params *ps = kiln_params_new(ctx);
  kiln_linear l;
  cr_assert_eq(kiln_linear_init(&l, ps, &(kiln_linear_options){.name = "fc", .in = 16, .out = 8}),
               KILN_OK);
  kiln_optim *o = kiln_sgd_new(ps, &(kiln_sgd_options){.lr = 0.1f});
  kiln_tensor *x = th_f32(ctx, KILN_SHAPE(4, 16));
  cr_assert_eq(kiln_backward(kiln_sum(kiln_linear_forward(&l, x), KILN_ALL_AXES, 0)), KILN_OK);
  char got[1024];
  kiln__plan p = plan(ctx, true);
  describe(ctx, &p, got, sizeof got);
  kiln__plan_free(&p);
  cr_assert(strstr(got, "assign") == NULL, "the gradients' kernels write the .grad buffers: %s",
            got);
  p = plan(ctx, false);
  describe(ctx, &p, got, sizeof got);
  kiln__plan_free(&p);
  cr_assert(strstr(got, "assign") != NULL, "unfused, an assignment is a kernel: %s", got);
  /* the old weight gradient read in the same flush: its assignment stays, the bias's goes */
  kiln_step_begin(ctx);
  cr_assert_not_null(kiln_mul_scalar(kiln_tensor_grad(l.weight), 2.f));
  kiln_optim_zero_grad(o);
  cr_assert_eq(kiln_backward(kiln_sum(kiln_linear_forward(&l, x), KILN_ALL_AXES, 0)), KILN_OK);
  p = plan(ctx, true);
  describe(ctx, &p, got, sizeof got);
  kiln__plan_free(&p);
  cr_assert(strstr(got, "| assign") != NULL && strstr(got, "assign assign") == NULL, "%s", got);
  kiln_optim_free(o);
  kiln_params_free(ps);
  th_free_scratch();
  th_ctx_free(ctx);
}

/* A buffer updated from its own old value by elementwise nodes (a running statistic: D = 0.9 D
 * + 0.1 v) is written by the kernel that computes the new value, each thread reading an element
 * before it writes it: no assignment is left. The exception stops where it would not hold: a node
 * that reads D after the new value is computed (it would see it early), a reduction of D, a read
 * of D through a view of another shape, and a new value that comes from a product. */
Test(fusion, an_update_from_the_old_value_writes_through) {
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_tensor *d = th_f32(ctx, KILN_SHAPE(16)), *v = th_f32(ctx, KILN_SHAPE(16));
  kiln_tensor *e = th_f32(ctx, KILN_SHAPE(16, 16));
  struct {
    const char *what;
    int through;
  } cases[] = {
      {"the old value read by the update", 1},
      {"the old value read again after the new one is computed", 0},
      {"the old value summed", 0},
      {"the old value read as a 4 x 4 view", 0},
      {"the new value from a product", 0},
  };
  for (int c = 0; c < 5; c++) {
    ctx->trace.done = ctx->trace.n;
    kiln_tensor *nv = kiln_add(kiln_mul_scalar(d, 0.9f), kiln_mul_scalar(v, 0.1f));
    if (c == 1) cr_assert_not_null(kiln_mul(nv, kiln_exp(d)));
    if (c == 2) nv = kiln_add(nv, kiln_sum(d, KILN_ALL_AXES, 1));
    if (c == 3)
      nv = kiln_reshape(
          kiln_add(kiln_reshape(nv, KILN_SHAPE(4, 4)), kiln_reshape(d, KILN_SHAPE(4, 4))),
          KILN_SHAPE(16));
    if (c == 4)
      nv = kiln_reshape(kiln_matmul(kiln_reshape(kiln_mul_scalar(d, 2.f), KILN_SHAPE(1, 16)), e),
                        KILN_SHAPE(16));
    cr_assert_not_null(nv, "%s: %s", cases[c].what, th_err(ctx));
    cr_assert_eq(kiln_assign(d, nv), KILN_OK, "%s: %s", cases[c].what, th_err(ctx));
    kiln__plan p = plan(ctx, true);
    char why[512], got[1024];
    const char *bad = kiln__plan_verify(ctx, &p, why, sizeof why);
    cr_assert_null(bad, "%s: %s", cases[c].what, bad);
    describe(ctx, &p, got, sizeof got);
    int through = 0;
    for (int32_t i = p.first; i < p.last; i++)
      through += p.write_to[i - p.first] == d;
    kiln__plan_free(&p);
    cr_assert_eq(through, cases[c].through, "%s: %s", cases[c].what, got);
    cr_assert_eq(strstr(got, "assign") == NULL, cases[c].through == 1, "%s: %s", cases[c].what,
                 got);
  }
  th_free_scratch();
  th_ctx_free(ctx);
}

/* A step graph's static memory plan is made without a GPU too (kiln_stats reports it). A chain of
 * products holds two of its 1 MiB values at a time, so the arena is two of them, the most that is
 * live at one launch, where the values' sum is four of them and the loss's reduction's. */
Test(fusion, a_step_graphs_memory_plan_packs_a_chain_into_what_is_live) {
  kiln_ctx *ctx = th_cpu_ctx();
  cr_assert(ctx->graphs, "step graphs are on by default");
  kiln_tensor *x = th_f32(ctx, KILN_SHAPE(512, 512)), *w = th_f32(ctx, KILN_SHAPE(512, 512));
  kiln_step_begin(ctx);
  kiln_tensor *h = x;
  for (int k = 0; k < 4; k++)
    h = kiln_matmul(h, w);
  kiln_tensor *loss = kiln_sum(h, KILN_ALL_AXES, 0);
  cr_assert_not_null(loss, "%s", kiln_ctx_error(ctx));
  cr_assert_eq(kiln_step_end(ctx), KILN_OK, "%s", kiln_ctx_error(ctx));
  kiln_exec_stats st;
  kiln_stats(ctx, &st);
  const uint64_t mib = 1 << 20;
  cr_assert(st.arena_sum_bytes > 4 * mib && st.arena_sum_bytes < 4 * mib + mib / 16,
            "the values' sum: %llu bytes", (unsigned long long)st.arena_sum_bytes);
  cr_assert_eq(st.arena_live_bytes, 2 * mib, "the most live: %llu bytes",
               (unsigned long long)st.arena_live_bytes);
  cr_assert_eq(st.arena_bytes, st.arena_live_bytes, "arena %llu bytes, most live %llu",
               (unsigned long long)st.arena_bytes, (unsigned long long)st.arena_live_bytes);
  th_free_scratch();
  th_ctx_free(ctx);
}

/* KILN_CAST_BATCH=1: the casts of parameters that only products read (autocast's casts of two
 * linear layers' weights, one permuted by a transpose) run as one multi-tensor launch at the
 * first of them, which renders and compiles; a cast an elementwise node reads (it fuses with it)
 * and a cast of a parameter assigned between stay out, and so does all of it without the
 * switch. */
Test(fusion, parameters_cast_in_one_launch_with_the_switch) {
  for (int on = 0; on < 2; on++) {
    kiln_ctx *ctx = th_cpu_ctx();
    ctx->cast_batch = on;
    kiln_tensor *x = th_f32(ctx, KILN_SHAPE(8, 32)), *w1 = th_f32(ctx, KILN_SHAPE(32, 16)),
                *w2 = th_f32(ctx, KILN_SHAPE(24, 16)), *w3 = th_f32(ctx, KILN_SHAPE(24, 16)),
                *w4 = th_f32(ctx, KILN_SHAPE(24, 16));
    kiln_tensor *bf = kiln_cast(x, KILN_DTYPE_BF16);
    kiln_tensor *h = kiln_matmul(bf, kiln_cast(w1, KILN_DTYPE_BF16));
    h = kiln_matmul(h, kiln_cast(kiln_transpose(w2, 0, 1), KILN_DTYPE_BF16)); /* (8, 24) */
    cr_assert_not_null(h, "%s", th_err(ctx));
    cr_assert_not_null(kiln_matmul(h, kiln_relu(kiln_cast(w3, KILN_DTYPE_BF16))), "%s",
                       th_err(ctx));
    cr_assert_eq(kiln_assign(w4, kiln_mul_scalar(w4, 0.5f)), KILN_OK, "%s", th_err(ctx));
    cr_assert_not_null(kiln_matmul(h, kiln_cast(w4, KILN_DTYPE_BF16)), "%s", th_err(ctx));
    kiln__plan p = plan(ctx, true);
    char why[512], got[1024];
    const char *bad = kiln__plan_verify(ctx, &p, why, sizeof why);
    cr_assert_null(bad, "the plan breaks an invariant: %s", bad);
    describe(ctx, &p, got, sizeof got);
    int batches = 0;
    for (int k = 0; k < p.ng; k++)
      if (p.g[k].batch) {
        batches++;
        cr_assert_eq(p.g[k].n, 3, "%s: x, w1 and w2 in one launch", got);
        cr_assert_eq(k, 0, "%s: at the first cast", got);
      }
    cr_assert_eq(batches, on, "switch %d: %s", on, got);
    kiln__plan_free(&p);
    cr_assert_eq(compile_pending(ctx), KILN_OK, "%s", th_err(ctx));
    th_free_scratch();
    th_ctx_free(ctx);
  }
}

/* kiln__permuted_blocks: a filter (O, I, KH, KW) read as (O, KH, KW, I) and one (O, KH, KW, I)
 * read as (O, I, KH, KW) hold a dense block of I KH KW values an O; a dense tensor, a transpose
 * (its first stride 1), a block past the shared memory's 12,288 values, and a slice (a block with
 * holes) do not. */
Test(fusion, permuted_casts_read_dense_blocks) {
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_tensor *w = th_f32(ctx, KILN_SHAPE(64, 32, 3, 3)),
              *v = th_f32(ctx, KILN_SHAPE(64, 3, 3, 32));
  kiln_tensor *big = th_f32(ctx, KILN_SHAPE(4, 64, 16, 16));
  struct {
    const char *what;
    kiln_tensor *x;
    int64_t block;
  } cases[] = {
      {"(O, I, KH, KW) as (O, KH, KW, I)", kiln_permute(w, KILN_AXES(0, 2, 3, 1)), 288},
      {"(O, KH, KW, I) as (O, I, KH, KW)", kiln_permute(v, KILN_AXES(0, 3, 1, 2)), 288},
      {"a dense tensor", w, 0},
      {"a transpose", kiln_permute(w, KILN_AXES(1, 0, 2, 3)), 0},
      {"16,384 values a block", kiln_permute(big, KILN_AXES(0, 2, 3, 1)), 0},
      {"a slice", kiln_permute(kiln_slice(w, 1, 0, 16, 1), KILN_AXES(0, 2, 3, 1)), 0},
  };
  for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
    cr_assert_not_null(cases[i].x, "%s: %s", cases[i].what, th_err(ctx));
    int64_t block = -1;
    bool got = kiln__permuted_blocks(cases[i].x, &block);
    cr_assert_eq(got, cases[i].block > 0, "%s", cases[i].what);
    if (got) cr_assert_eq(block, cases[i].block, "%s: %lld", cases[i].what, (long long)block);
  }
  th_free_scratch();
  th_ctx_free(ctx);
}

/* KILN_CAST_TILES=1: a conv2d's filters cast to bf16 in their (O, KH, KW, I) order and their
 * gradient cast back to (O, I, KH, KW) in f32 go through dense blocks in shared memory: the
 * parameters' multi-tensor cast (the image's four values at a time) and the gradient's lone cast,
 * lowered to the multi-tensor form, whose kernel takes its sizes from its arguments (one kernel
 * for every filter); each launch takes its block's bytes of shared memory; all render and compile
 * (NVRTC). Without the switch the lone cast is an elementwise kernel. */
Test(fusion, filter_casts_go_through_shared_memory_with_the_switch) {
  for (int on = 0; on < 2; on++) {
    kiln_ctx *ctx = th_cpu_ctx();
    ctx->cast_tiles = on;
    kiln_step_begin(ctx);
    kiln_tensor *x = th_f32(ctx, KILN_SHAPE(4, 9, 7, 64)),
                *k = th_param(ctx, KILN_SHAPE(32, 64, 3, 3));
    kiln_autocast_begin(ctx, KILN_DTYPE_BF16);
    kiln_tensor *y = kiln_conv2d(x, k, NULL, &(kiln_conv2d_options){.pad_h = 1, .pad_w = 1});
    kiln_autocast_end(ctx);
    cr_assert_not_null(y, "%s", th_err(ctx));
    cr_assert_eq(kiln_backward(kiln_cast(kiln_sum(y, KILN_ALL_AXES, 0), KILN_DTYPE_F32)), KILN_OK,
                 "%s", th_err(ctx));
    kiln__program pg;
    cr_assert(kiln__program_build(ctx, ctx->trace.done, ctx->trace.n, &pg), "%s", th_err(ctx));
    int lone = 0, tiles = 0;
    for (int g = 0; g < pg.plan.ng; g++) {
      const kiln__group *gr = &pg.plan.g[g];
      const kiln__node *n = &ctx->trace.nodes[gr->node];
      if (strstr(pg.call[g].name, "_tiles_")) { /* a block of the filters' 64 * 9 values */
        tiles++;
        cr_assert_eq(pg.call[g].smem, 64 * 9 * sizeof(float), "%s: %u bytes of shared memory",
                     pg.call[g].name, pg.call[g].smem);
      }
      if (n->op != KILN__OP_CAST || gr->batch || n->out->dtype != KILN_DTYPE_F32 ||
          n->out->ndim != 4)
        continue;
      lone++; /* the filters' gradient, back to f32 */
      cr_assert_eq(strncmp(pg.call[g].name, on ? "k_cast_x1_tiles_" : "k_cast_f32", 10 + 6 * on), 0,
                   "switch %d: %s", on, pg.call[g].name);
      if (on)
        cr_assert(pg.call[g].arg.args.nred == 64 * 9 && pg.call[g].arg.args.shape[0] == 32,
                  "%s: a block of %lld values, %lld of them", pg.call[g].name,
                  pg.call[g].arg.args.nred, pg.call[g].arg.args.shape[0]);
    }
    cr_assert_eq(lone, 1, "switch %d: %d casts of the gradient", on, lone);
    cr_assert_eq(tiles, on ? 2 : 0, "switch %d: %d kernels through tiles", on, tiles);
    kiln__program_free(&pg);
    cr_assert_eq(kiln_step_end(ctx), KILN_OK, "%s", th_err(ctx));
    th_free_scratch();
    th_ctx_free(ctx);
  }
}

/* An elementwise run read only by a later run of its space, with other nodes between (a ResNet
 * block's main-branch batch norm and the add after its shortcut), runs inside the later run's
 * kernel, at its place, its values never written; not when another group reads one of its
 * values, nor when a node between writes what it reads, nor without KILN_EW_SINK=1. */
Test(fusion, a_run_read_only_by_a_later_run_joins_it) {
  for (int c = 0; c < 4; c++) {
    kiln_ctx *ctx = th_cpu_ctx();
    ctx->ew_sink = c != 3;
    kiln_tensor *x1 = th_f32(ctx, KILN_SHAPE(64, 32)), *x2 = th_f32(ctx, KILN_SHAPE(64, 32));
    kiln_tensor *z = th_f32(ctx, KILN_SHAPE(16, 8)), *w = th_f32(ctx, KILN_SHAPE(64, 32));
    kiln_tensor *a = kiln_relu(kiln_mul(x1, w));
    cr_assert_not_null(kiln_sum(z, KILN_AXES(1), 0));
    if (c == 1) cr_assert_not_null(kiln_sum(a, KILN_AXES(1), 0));
    if (c == 2) cr_assert_eq(kiln_assign(w, x2), KILN_OK, "%s", th_err(ctx));
    cr_assert_not_null(kiln_add(a, x2), "%s", th_err(ctx));
    const char *want[4] = {"sum | mul* relu* add", "mul* relu | sum | sum add",
                           "mul* relu | sum | assign | add", "mul* relu | sum | add"};
    expect_plan(ctx, true, want[c]);
    cr_assert_eq(compile_pending(ctx), KILN_OK, "%s", th_err(ctx));
    th_free_scratch();
    th_ctx_free(ctx);
  }
}

/* KILN_PDL=1 (sm_90): every kiln kernel of a training step (a convolution with batch norm, ReLU
 * and max pooling, a linear head, cross-entropy, the backward pass and SGD) begins with
 * kiln_pdl_begin, which waits for the kernel before it, and its call launches it as a
 * programmatic dependent; the BLAS library's calls are left as they are. Without the switch, no
 * kernel has it. The kernels are named apart from the others (the line is in their hash) and
 * compile (NVRTC). */
Test(fusion, kernels_wait_first_when_launched_as_dependents) {
  const char *line = "(const kiln__kargs a) {\n  kiln_pdl_begin();\n";
  for (int on = 0; on < 2; on++) {
    kiln_ctx *ctx = th_cpu_ctx();
    ctx->pdl = on;
    static const char *const names[4] = {"w", "g", "b", "fc"};
    const kiln_shape shapes[4] = {KILN_SHAPE(16, 8, 3, 3), KILN_SHAPE(16), KILN_SHAPE(16),
                                  KILN_SHAPE(10, 16 * 4 * 4)};
    kiln_params *p = kiln_params_new(ctx);
    kiln_tensor *ps[4];
    for (int k = 0; k < 4; k++) {
      ps[k] = th_new(ctx, KILN_DTYPE_F32, shapes[k]);
      kiln_tensor_set_requires_grad(ps[k], 1);
      cr_assert_eq(kiln_params_add(p, names[k], ps[k]), KILN_OK);
    }
    kiln_tensor *w = ps[0], *g = ps[1], *b = ps[2], *fc = ps[3];
    kiln_optim *o = kiln_sgd_new(p, &(kiln_sgd_options){.lr = 0.1f, .momentum = 0.9f});
    cr_assert_not_null(o, "%s", th_err(ctx));
    kiln_step_begin(ctx);
    kiln_tensor *x = th_f32(ctx, KILN_SHAPE(4, 8, 8, 8));
    kiln_tensor *h = kiln_conv2d(x, w, NULL, &(kiln_conv2d_options){.pad_h = 1, .pad_w = 1});
    h = kiln_relu(kiln_batch_norm(h, g, b, NULL, NULL, 1, 0.1f, 1e-5f));
    h = kiln_max_pool2d(h, &(kiln_pool2d_options){.kernel_h = 2, .kernel_w = 2});
    kiln_tensor *logits =
        kiln_matmul(kiln_reshape(h, KILN_SHAPE(4, 16 * 4 * 4)), kiln_transpose(fc, 0, 1));
    kiln_tensor *y = th_i32(ctx, KILN_SHAPE(4));
    cr_assert_eq(kiln_backward(kiln_cross_entropy(logits, y, KILN_REDUCTION_MEAN, 0)), KILN_OK,
                 "%s", th_err(ctx));
    kiln_optim_step(o);
    kiln__program pg;
    cr_assert(kiln__program_build(ctx, ctx->trace.done, ctx->trace.n, &pg), "%s", th_err(ctx));
    kiln__target t = {.num_sms = 132, .pdl = on};
    int kernels = 0;
    for (int k = 0; k < pg.plan.ng; k++) {
      if (pg.spec[k].kind == KILN__SPEC_BLAS) {
        cr_assert(!pg.call[k].pdl, "a BLAS call as a dependent");
        continue;
      }
      kernels++;
      cr_assert_eq(pg.call[k].pdl, on, "%s: launched as a dependent %d", pg.call[k].name,
                   pg.call[k].pdl);
      kiln__rendered r;
      cr_assert(kiln__render(&t, &pg.spec[k], &r));
      const char *at = strstr(r.src.s, line);
      cr_assert_eq(at != NULL, on, "%s: %s", r.name, r.src.s);
      cr_assert(!at || !strstr(at + strlen(line), "kiln_pdl_begin"), "%s: twice", r.name);
      kiln__sb_free(&r.src);
    }
    cr_assert_gt(kernels, 8, "%d kernels", kernels);
    kiln__program_free(&pg);
    kiln_step_end(ctx);
    kiln_optim_free(o);
    kiln_params_free(p);
    th_free_scratch();
    th_ctx_free(ctx);
  }
}
