/*
 * test_gpu_custom.c: custom ops' values on the GPU. The example's hand-written linear + ReLU
 * (examples/custom_linear_relu.h) against a float64 reference, forward and gradients, against
 * kiln's own fused path, and through finite differences; training steps replayed from a step
 * graph equal eager ones bitwise; the kernel sees its tensors, dtypes, shapes and parameters as
 * kiln_custom.h says; zero_output clears the output before every launch, replays included.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../examples/custom_linear_relu.h"
#include "helpers.h"

TestSuite(gpu_custom);

enum { B = 37, K = 29, N = 23 }; /* none a multiple of the kernels' 16 x 16 tiles */

/* y = relu(x W^T + b) and, for the loss sum(y * r), dx, dW and db, in float64. */
static void reference(const float *x, const float *w, const float *b, const float *r, double *y,
                      double *dx, double *dw, double *db) {
  memset(dx, 0, sizeof(double) * B * K);
  memset(dw, 0, sizeof(double) * N * K);
  memset(db, 0, sizeof(double) * N);
  for (int i = 0; i < B; i++)
    for (int j = 0; j < N; j++) {
      double z = b[j];
      for (int k = 0; k < K; k++)
        z += (double)x[i * K + k] * w[j * K + k];
      y[i * N + j] = z > 0 ? z : 0;
      double gz = z > 0 ? r[i * N + j] : 0;
      db[j] += gz;
      for (int k = 0; k < K; k++) {
        dx[i * K + k] += gz * w[j * K + k];
        dw[j * K + k] += gz * x[i * K + k];
      }
    }
}

typedef struct operands {
  kiln_tensor *x, *w, *b, *r;
  float *xh, *wh, *bh, *rh;
} operands;

static void make_operands(kiln_ctx *ctx, operands *o) {
  o->x = th_rand(ctx, KILN_SHAPE(B, K), 1, -1.f, 1.f, &o->xh);
  o->w = th_rand(ctx, KILN_SHAPE(N, K), 2, -0.5f, 0.5f, &o->wh);
  o->b = th_rand(ctx, KILN_SHAPE(N), 3, -0.2f, 0.2f, &o->bh);
  o->r = th_rand(ctx, KILN_SHAPE(B, N), 4, -1.f, 1.f, &o->rh);
  kiln_tensor_set_requires_grad(o->x, 1);
  kiln_tensor_set_requires_grad(o->w, 1);
  kiln_tensor_set_requires_grad(o->b, 1);
}

static void free_operands(operands *o) {
  kiln_tensor *t[4] = {o->x, o->w, o->b, o->r};
  for (int k = 0; k < 4; k++)
    kiln_tensor_free(t[k]);
  free(o->xh), free(o->wh), free(o->bh), free(o->rh);
}

/* kiln's own path for the same function: a product with a bias and ReLU epilogue. */
static kiln_tensor *kilns_own(const operands *o) {
  return kiln_relu(kiln_add(kiln_matmul(o->x, kiln_transpose(o->w, 0, 1)), o->b));
}

/* Runs forward and backward of y (custom or kiln's own) for the loss sum(y * r); *y gets y's
 * values, the gradients dx, dW, db (each malloc'd). */
static void run(kiln_ctx *ctx, const custom_linear_relu *ops, operands *o, bool custom, float **y,
                float **g) {
  kiln_tensor_zero_grad(o->x); /* each run writes the gradients afresh */
  kiln_tensor_zero_grad(o->w);
  kiln_tensor_zero_grad(o->b);
  kiln_step_begin(ctx);
  kiln_tensor *out =
      custom ? kiln_custom(ops->fwd, (kiln_tensor *[]){o->x, o->w, o->b}, NULL) : kilns_own(o);
  cr_assert_not_null(out, "%s", th_err(ctx));
  kiln_tensor *loss = kiln_sum(kiln_mul(out, o->r), KILN_ALL_AXES, 0);
  cr_assert_eq(kiln_backward(loss), KILN_OK, "%s", th_err(ctx));
  cr_assert_eq(kiln_step_end(ctx), KILN_OK, "%s", th_err(ctx));
  *y = th_read(out);
  g[0] = th_read(kiln_tensor_grad(o->x));
  g[1] = th_read(kiln_tensor_grad(o->w));
  g[2] = th_read(kiln_tensor_grad(o->b));
}

Test(gpu_custom, linear_relu_matches_float64_and_kilns_own_path, .timeout = 300) {
  TH_GPU_CTX(ctx);
  custom_linear_relu ops;
  cr_assert_eq(custom_linear_relu_new(ctx, &ops), KILN_OK, "%s", th_err(ctx));
  operands o;
  make_operands(ctx, &o);
  double *y = malloc(sizeof(double) * B * N), *dx = malloc(sizeof(double) * B * K),
         *dw = malloc(sizeof(double) * N * K), *db = malloc(sizeof(double) * N);
  reference(o.xh, o.wh, o.bh, o.rh, y, dx, dw, db);
  int positive = 0;
  for (int i = 0; i < B * N; i++)
    positive += y[i] > 0;
  cr_assert(positive > B * N / 4 && positive < 3 * B * N / 4, "the ReLU cuts %d of %d", positive,
            B * N);
  float *cy, *cg[3], *ky, *kg[3];
  run(ctx, &ops, &o, true, &cy, cg);
  th_assert_close(cy, y, B * N, 1e-5, 1e-5, "custom forward");
  th_assert_close(cg[0], dx, B * K, 1e-5, 1e-5, "custom dx");
  th_assert_close(cg[1], dw, N * K, 1e-5, 1e-5, "custom dW");
  th_assert_close(cg[2], db, N, 1e-5, 1e-5, "custom db");
  run(ctx, &ops, &o, false, &ky, kg);
  double *as64 = malloc(sizeof(double) * B * K);
  const struct {
    const float *got, *want;
    int64_t n;
  } pair[4] = {{cy, ky, B * N}, {cg[0], kg[0], B * K}, {cg[1], kg[1], N * K}, {cg[2], kg[2], N}};
  for (int p = 0; p < 4; p++) {
    for (int64_t i = 0; i < pair[p].n; i++)
      as64[i] = pair[p].want[i];
    th_assert_close(pair[p].got, as64, pair[p].n, 1e-5, 1e-5, "custom against kiln's own");
  }
  for (int k = 0; k < 3; k++)
    free(cg[k]), free(kg[k]);
  free(cy), free(ky), free(as64), free(y), free(dx), free(dw), free(db);
  free_operands(&o);
  th_ctx_free(ctx);
}

static kiln_tensor *through_custom(kiln_tensor *const *in, void *user) {
  const custom_linear_relu *ops = user;
  return kiln_custom(ops->fwd, in, NULL);
}

Test(gpu_custom, gradients_pass_finite_differences, .timeout = 300) {
  TH_GPU_CTX(ctx);
  custom_linear_relu ops;
  cr_assert_eq(custom_linear_relu_new(ctx, &ops), KILN_OK, "%s", th_err(ctx));
  /* small, and the pre-activations far from ReLU's kink next to the step of 1e-2 */
  kiln_tensor *x = th_rand(ctx, KILN_SHAPE(5, 7), 5, -1.f, 1.f, NULL),
              *w = th_rand(ctx, KILN_SHAPE(3, 7), 6, -0.3f, 0.3f, NULL);
  float bh[3] = {2.5f, -2.5f, 3.f}; /* one column always cut, two never */
  kiln_tensor *b = kiln_tensor_from_host(ctx, KILN_DTYPE_F32, KILN_SHAPE(3), bh);
  kiln_tensor *in[3] = {x, w, b};
  for (int k = 0; k < 3; k++)
    kiln_tensor_set_requires_grad(in[k], 1);
  char report[512] = "";
  kiln_status s = kiln_gradcheck(ctx, through_custom, 3, in, &ops,
                                 &(kiln_gradcheck_options){.seed = 9}, report, sizeof report);
  cr_assert_eq(s, KILN_OK, "gradcheck: %s %s", report, th_err(ctx));
  for (int k = 0; k < 3; k++)
    kiln_tensor_free(in[k]);
  th_ctx_free(ctx);
}

/* Training steps through the custom op: replayed from the step graph, they give the eager run's
 * parameters bit for bit. */
static float *train(bool graphs, int steps) {
  kiln_ctx *ctx = kiln_ctx_new(NULL);
  kiln_set_tf32(ctx, 0);
  kiln_set_graphs(ctx, graphs);
  custom_linear_relu ops;
  cr_assert_eq(custom_linear_relu_new(ctx, &ops), KILN_OK, "%s", th_err(ctx));
  operands o;
  make_operands(ctx, &o);
  kiln_tensor_set_requires_grad(o.x, 0);
  kiln_params *p = kiln_params_new(ctx);
  kiln_params_add(p, "w", kiln_tensor_from_host(ctx, KILN_DTYPE_F32, KILN_SHAPE(N, K), o.wh));
  kiln_params_add(p, "b", kiln_tensor_from_host(ctx, KILN_DTYPE_F32, KILN_SHAPE(N), o.bh));
  kiln_tensor *w = kiln_params_find(p, "w"), *b = kiln_params_find(p, "b");
  kiln_optim *opt = kiln_sgd_new(p, &(kiln_sgd_options){.lr = 0.05f, .momentum = 0.9f});
  for (int s = 0; s < steps; s++) {
    kiln_step_begin(ctx);
    kiln_tensor *y = kiln_custom(ops.fwd, (kiln_tensor *[]){o.x, w, b}, NULL);
    kiln_tensor *loss = kiln_mean(kiln_mul(kiln_mul(y, y), o.r), KILN_ALL_AXES, 0);
    kiln_optim_zero_grad(opt);
    kiln_backward(loss);
    kiln_optim_step(opt);
    cr_assert_eq(kiln_step_end(ctx), KILN_OK, "%s", th_err(ctx));
  }
  int64_t n;
  float *v = th_params_values(p, &n);
  cr_assert_eq(n, N * K + N);
  kiln_exec_stats st;
  kiln_stats(ctx, &st);
  if (graphs) cr_assert_gt(st.graph_replays, 0u, "no step was replayed");
  kiln_optim_free(opt);
  kiln_params_free(p);
  free_operands(&o);
  th_ctx_free(ctx);
  return v;
}

Test(gpu_custom, graph_replay_equals_eager_bitwise, .timeout = 300) {
  TH_GPU_CTX(probe);
  th_ctx_free(probe);
  float *eager = train(false, 6), *graph = train(true, 6);
  cr_assert_eq(memcmp(eager, graph, sizeof(float) * (N * K + N)), 0,
               "replayed steps differ from eager ones");
  free(eager), free(graph);
}

/* Writes what the kernel sees into an i32 output: nin, then per tensor (the inputs, then the
 * output) ndim, dtype and its first three dims, then the four parameters; and checks a value of
 * each input (they are 1.5, 2.5 and 7). */
static const char probe_src[] = "__device__ void probe(const kiln_custom_args &a) {\n"
                                "  if (blockIdx.x != 0 || threadIdx.x != 0) return;\n"
                                "  int *o = (int *)a.out.data, k = 0;\n"
                                "  o[k++] = a.nin;\n"
                                "  for (int q = 0; q <= a.nin; q++) {\n"
                                "    const kiln_custom_tensor &t = q < a.nin ? a.in[q] : a.out;\n"
                                "    o[k++] = t.ndim;\n"
                                "    o[k++] = t.dtype;\n"
                                "    for (int d = 0; d < 3; d++) o[k++] = (int)t.shape[d];\n"
                                "    o[k++] = (int)t.numel;\n"
                                "  }\n"
                                "  for (int p = 0; p < 4; p++) o[k++] = (int)a.param[p];\n"
                                "  o[k++] = ((const float *)a.in[0].data)[5] == 1.5f;\n"
                                "  o[k++] = (float)((const kiln_bf16 *)a.in[1].data)[3] == 2.5f;\n"
                                "  o[k++] = ((const int *)a.in[2].data)[0] == 7;\n"
                                "}\n";

static kiln_status probe_shape(const kiln_custom_call *c, kiln_shape *out, kiln_dtype *dt) {
  (void)c;
  *out = KILN_SHAPE(40);
  *dt = KILN_DTYPE_I32;
  return KILN_OK;
}

static kiln_status one_thread(const kiln_custom_call *c, const kiln_shape *out,
                              kiln_custom_launch *l) {
  (void)c, (void)out;
  l->grid[0] = 1;
  l->block = 32;
  return KILN_OK;
}

Test(gpu_custom, the_kernel_sees_tensors_and_parameters, .timeout = 120) {
  TH_GPU_CTX_EAGER(ctx);
  kiln_custom_op *op = kiln_custom_op_new(ctx, &(kiln_custom_op_options){.name = "probe",
                                                                         .source = probe_src,
                                                                         .entry = "probe",
                                                                         .nin = 3,
                                                                         .output = probe_shape,
                                                                         .launch = one_thread});
  cr_assert_not_null(op, "%s", th_err(ctx));
  kiln_tensor *a = kiln_full(ctx, KILN_SHAPE(2, 3, 4), 1.5f);
  kiln_tensor *bf = kiln_cast(kiln_full(ctx, KILN_SHAPE(6), 2.5f), KILN_DTYPE_BF16);
  kiln_tensor *i = kiln_tensor_from_host(ctx, KILN_DTYPE_I32, KILN_SHAPE(1, 1), (int32_t[]){7});
  kiln_tensor *o = kiln_custom(op, (kiln_tensor *[]){a, bf, i}, (int64_t[]){-3, 0, 9, 123456});
  cr_assert_not_null(o, "%s", th_err(ctx));
  int32_t *got = th_read_i32(o);
  const int32_t want[] = {3,                        /* nin */
                          3,  0, 2,  3,      4, 24, /* a: (2, 3, 4) f32 */
                          1,  1, 6,  1,      1, 6,  /* bf: (6) bf16 */
                          2,  3, 1,  1,      1, 1,  /* i: (1, 1) i32 */
                          1,  3, 40, 1,      1, 40, /* the output: (40) i32 */
                          -3, 0, 9,  123456, 1, 1,  1};
  for (size_t k = 0; k < sizeof want / sizeof *want; k++)
    cr_assert_eq(got[k], want[k], "word %zu: %d, expected %d", k, got[k], want[k]);
  free(got);
  kiln_tensor_free(i);
  th_ctx_free(ctx);
}

/* Column sums by atomic adds into a zeroed output. */
static const char colsum_src[] =
    "__device__ void colsum(const kiln_custom_args &a) {\n"
    "  long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;\n"
    "  long long cols = a.in[0].shape[1];\n"
    "  if (i < a.in[0].numel) atomicAdd((float *)a.out.data + i % cols, "
    "((const float *)a.in[0].data)[i]);\n"
    "}\n";

static kiln_status colsum_shape(const kiln_custom_call *c, kiln_shape *out, kiln_dtype *dt) {
  *out = KILN_SHAPE(kiln_tensor_shape(c->in[0]).d[1]);
  *dt = KILN_DTYPE_F32;
  return KILN_OK;
}

static kiln_status over_input(const kiln_custom_call *c, const kiln_shape *out,
                              kiln_custom_launch *l) {
  (void)out;
  l->grid[0] = (uint32_t)((kiln_tensor_numel(c->in[0]) + 255) / 256);
  l->block = 256;
  return KILN_OK;
}

Test(gpu_custom, zero_output_clears_before_every_launch, .timeout = 120) {
  TH_GPU_CTX(ctx); /* step graphs on: the replays zero too */
  kiln_custom_op *op = kiln_custom_op_new(ctx, &(kiln_custom_op_options){.name = "colsum",
                                                                         .source = colsum_src,
                                                                         .entry = "colsum",
                                                                         .nin = 1,
                                                                         .zero_output = 1,
                                                                         .output = colsum_shape,
                                                                         .launch = over_input});
  cr_assert_not_null(op, "%s", th_err(ctx));
  float *xh;
  kiln_tensor *x = th_rand(ctx, KILN_SHAPE(300, 9), 12, -1.f, 1.f, &xh);
  double want[9] = {0};
  for (int i = 0; i < 300 * 9; i++)
    want[i % 9] += xh[i];
  for (int s = 0; s < 4; s++) {
    kiln_step_begin(ctx);
    kiln_tensor *y = kiln_custom(op, (kiln_tensor *[]){x}, NULL);
    cr_assert_eq(kiln_step_end(ctx), KILN_OK, "%s", th_err(ctx));
    float *got = th_read(y);
    th_assert_close(got, want, 9, 1e-4, 1e-5, "column sums");
    free(got);
  }
  free(xh);
  kiln_tensor_free(x);
  th_ctx_free(ctx);
}
