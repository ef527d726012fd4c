/*
 * custom_linear_relu.h: y = relu(x W^T + b) written by hand as kiln custom ops
 * (include/kiln_custom.h): a forward kernel, and a backward made of three more custom kernels,
 * one per gradient. examples/custom_kernel.c runs it against kiln's own fused path; the tests
 * (tests/test_cpu_custom.c, tests/test_gpu_custom.c) use it too.
 *
 * Shapes as torch.nn.Linear's: x (B, K), W (N, K), b (N), y (B, N), all f32. With gz = g (y > 0),
 * the ReLU's gradient (y > 0 exactly where the pre-activation is):
 *   dx = gz W      (B, K), a sum over N
 *   dW = gz^T x    (N, K), a sum over B
 *   db = sum_B gz  (N)
 * The three products share one device function, a 16 x 16 tiled product through shared memory,
 * each with its own way of reading its operands.
 */
#ifndef KILN_EXAMPLE_CUSTOM_LINEAR_RELU_H
#define KILN_EXAMPLE_CUSTOM_LINEAR_RELU_H

#include "kiln.h"

static const char custom_linear_relu_src[] =
    "#define T 16\n"
    "/* C (M, N) = A (M, L) B (L, N), one 16 x 16 tile of C a block of 256 threads: a(i, l) and\n"
    "   b(l, j) read the operands, put(i, j, v) writes a result. */\n"
    "template <class A, class B, class P>\n"
    "__device__ void tile_product(long long M, long long N, long long L, A a, B b, P put) {\n"
    "  __shared__ float as[T][T + 1], bs[T][T + 1];\n"
    "  int tx = threadIdx.x % T, ty = threadIdx.x / T;\n"
    "  long long i = (long long)blockIdx.y * T + ty, j = (long long)blockIdx.x * T + tx;\n"
    "  float acc = 0.f;\n"
    "  for (long long l0 = 0; l0 < L; l0 += T) {\n"
    "    as[ty][tx] = i < M && l0 + tx < L ? a(i, l0 + tx) : 0.f;\n"
    "    bs[ty][tx] = l0 + ty < L && j < N ? b(l0 + ty, j) : 0.f;\n"
    "    __syncthreads();\n"
    "    for (int l = 0; l < T; l++)\n"
    "      acc += as[ty][l] * bs[l][tx];\n"
    "    __syncthreads();\n"
    "  }\n"
    "  if (i < M && j < N) put(i, j, acc);\n"
    "}\n"
    "\n"
    "/* y = relu(x W^T + b): in x, W, b */\n"
    "__device__ void linear_relu_fwd(const kiln_custom_args &a) {\n"
    "  const float *x = (const float *)a.in[0].data, *w = (const float *)a.in[1].data;\n"
    "  const float *bias = (const float *)a.in[2].data;\n"
    "  float *y = (float *)a.out.data;\n"
    "  long long B = a.in[0].shape[0], K = a.in[0].shape[1], N = a.in[1].shape[0];\n"
    "  tile_product(\n"
    "      B, N, K, [=](long long i, long long k) { return x[i * K + k]; },\n"
    "      [=](long long k, long long j) { return w[j * K + k]; },\n"
    "      [=](long long i, long long j, float v) {\n"
    "        float z = v + bias[j];\n"
    "        y[i * N + j] = z > 0.f ? z : 0.f;\n"
    "      });\n"
    "}\n"
    "\n"
    "/* dx = (g (y > 0)) W: in g, y, W */\n"
    "__device__ void linear_relu_dx(const kiln_custom_args &a) {\n"
    "  const float *g = (const float *)a.in[0].data, *y = (const float *)a.in[1].data;\n"
    "  const float *w = (const float *)a.in[2].data;\n"
    "  float *dx = (float *)a.out.data;\n"
    "  long long B = a.in[0].shape[0], N = a.in[0].shape[1], K = a.in[2].shape[1];\n"
    "  tile_product(\n"
    "      B, K, N, [=](long long i, long long j) { return y[i * N + j] > 0.f ? g[i * N + j] : "
    "0.f; },\n"
    "      [=](long long j, long long k) { return w[j * K + k]; },\n"
    "      [=](long long i, long long k, float v) { dx[i * K + k] = v; });\n"
    "}\n"
    "\n"
    "/* dW = (g (y > 0))^T x: in g, y, x */\n"
    "__device__ void linear_relu_dw(const kiln_custom_args &a) {\n"
    "  const float *g = (const float *)a.in[0].data, *y = (const float *)a.in[1].data;\n"
    "  const float *x = (const float *)a.in[2].data;\n"
    "  float *dw = (float *)a.out.data;\n"
    "  long long B = a.in[0].shape[0], N = a.in[0].shape[1], K = a.in[2].shape[1];\n"
    "  tile_product(\n"
    "      N, K, B, [=](long long j, long long i) { return y[i * N + j] > 0.f ? g[i * N + j] : "
    "0.f; },\n"
    "      [=](long long i, long long k) { return x[i * K + k]; },\n"
    "      [=](long long j, long long k, float v) { dw[j * K + k] = v; });\n"
    "}\n"
    "\n"
    "/* db = sum over the batch of g (y > 0): in g, y; a thread per column */\n"
    "__device__ void linear_relu_db(const kiln_custom_args &a) {\n"
    "  const float *g = (const float *)a.in[0].data, *y = (const float *)a.in[1].data;\n"
    "  long long B = a.in[0].shape[0], N = a.in[0].shape[1];\n"
    "  long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x;\n"
    "  if (j >= N) return;\n"
    "  float s = 0.f;\n"
    "  for (long long i = 0; i < B; i++)\n"
    "    s += y[i * N + j] > 0.f ? g[i * N + j] : 0.f;\n"
    "  ((float *)a.out.data)[j] = s;\n"
    "}\n";

/* The four ops: the forward's backward reaches the other three through its user pointer. */
typedef struct custom_linear_relu {
  kiln_custom_op *fwd, *dx, *dw, *db;
} custom_linear_relu;

static int custom_is_matrix(const kiln_tensor *t, int64_t rows, int64_t cols) {
  kiln_shape s = kiln_tensor_shape(t);
  return kiln_tensor_dtype(t) == KILN_DTYPE_F32 && s.ndim == 2 && (rows < 0 || s.d[0] == rows) &&
         (cols < 0 || s.d[1] == cols);
}

/* The output's shape from the inputs': x (B, K), W (N, K), b (N) give (B, N). */
static kiln_status custom_fwd_shape(const kiln_custom_call *c, kiln_shape *out, kiln_dtype *dt) {
  kiln_shape x = kiln_tensor_shape(c->in[0]), w = kiln_tensor_shape(c->in[1]),
             b = kiln_tensor_shape(c->in[2]);
  if (!custom_is_matrix(c->in[0], -1, -1) || !custom_is_matrix(c->in[1], -1, x.d[1]) ||
      kiln_tensor_dtype(c->in[2]) != KILN_DTYPE_F32 || b.ndim != 1 || b.d[0] != w.d[0])
    return KILN_ERR_SHAPE;
  *out = KILN_SHAPE(x.d[0], w.d[0]);
  *dt = KILN_DTYPE_F32;
  return KILN_OK;
}

/* g and y (B, N) and a third (N, K) or (B, K): dx is (B, K), dW (N, K). */
static kiln_status custom_dx_shape(const kiln_custom_call *c, kiln_shape *out, kiln_dtype *dt) {
  kiln_shape g = kiln_tensor_shape(c->in[0]), w = kiln_tensor_shape(c->in[2]);
  if (!custom_is_matrix(c->in[0], -1, -1) || !custom_is_matrix(c->in[1], g.d[0], g.d[1]) ||
      !custom_is_matrix(c->in[2], g.d[1], -1))
    return KILN_ERR_SHAPE;
  *out = KILN_SHAPE(g.d[0], w.d[1]);
  *dt = KILN_DTYPE_F32;
  return KILN_OK;
}

static kiln_status custom_dw_shape(const kiln_custom_call *c, kiln_shape *out, kiln_dtype *dt) {
  kiln_shape g = kiln_tensor_shape(c->in[0]), x = kiln_tensor_shape(c->in[2]);
  if (!custom_is_matrix(c->in[0], -1, -1) || !custom_is_matrix(c->in[1], g.d[0], g.d[1]) ||
      !custom_is_matrix(c->in[2], g.d[0], -1))
    return KILN_ERR_SHAPE;
  *out = KILN_SHAPE(g.d[1], x.d[1]);
  *dt = KILN_DTYPE_F32;
  return KILN_OK;
}

static kiln_status custom_db_shape(const kiln_custom_call *c, kiln_shape *out, kiln_dtype *dt) {
  kiln_shape g = kiln_tensor_shape(c->in[0]);
  if (!custom_is_matrix(c->in[0], -1, -1) || !custom_is_matrix(c->in[1], g.d[0], g.d[1]))
    return KILN_ERR_SHAPE;
  *out = KILN_SHAPE(g.d[1]);
  *dt = KILN_DTYPE_F32;
  return KILN_OK;
}

/* A 16 x 16 tile of the (rows, cols) output a block of 256 threads. */
static kiln_status custom_tile_launch(const kiln_custom_call *c, const kiln_shape *out,
                                      kiln_custom_launch *l) {
  (void)c;
  l->grid[0] = (uint32_t)((out->d[1] + 15) / 16);
  l->grid[1] = (uint32_t)((out->d[0] + 15) / 16);
  l->block = 256;
  return KILN_OK;
}

static kiln_status custom_linear_relu_backward(const kiln_custom_call *c, kiln_tensor *g,
                                               kiln_tensor **grad_in) {
  const custom_linear_relu *ops = c->user;
  kiln_tensor *x = c->in[0], *w = c->in[1], *y = c->out;
  if (kiln_tensor_requires_grad(x))
    grad_in[0] = kiln_custom(ops->dx, (kiln_tensor *[]){g, y, w}, NULL);
  if (kiln_tensor_requires_grad(w))
    grad_in[1] = kiln_custom(ops->dw, (kiln_tensor *[]){g, y, x}, NULL);
  if (kiln_tensor_requires_grad(c->in[2]))
    grad_in[2] = kiln_custom(ops->db, (kiln_tensor *[]){g, y}, NULL);
  return KILN_OK;
}

/* Makes the four ops in ops (which must outlive them: the forward's backward reads it); KILN_OK,
 * or the context's status with its error set. */
static kiln_status custom_linear_relu_new(kiln_ctx *ctx, custom_linear_relu *ops) {
  const char *src = custom_linear_relu_src;
  ops->dx = kiln_custom_op_new(ctx, &(kiln_custom_op_options){.name = "linear_relu_dx",
                                                              .source = src,
                                                              .entry = "linear_relu_dx",
                                                              .nin = 3,
                                                              .output = custom_dx_shape,
                                                              .launch = custom_tile_launch});
  ops->dw = kiln_custom_op_new(ctx, &(kiln_custom_op_options){.name = "linear_relu_dw",
                                                              .source = src,
                                                              .entry = "linear_relu_dw",
                                                              .nin = 3,
                                                              .output = custom_dw_shape,
                                                              .launch = custom_tile_launch});
  ops->db = kiln_custom_op_new(ctx, &(kiln_custom_op_options){.name = "linear_relu_db",
                                                              .source = src,
                                                              .entry = "linear_relu_db",
                                                              .nin = 2,
                                                              .output = custom_db_shape});
  ops->fwd =
      kiln_custom_op_new(ctx, &(kiln_custom_op_options){.name = "linear_relu",
                                                        .source = src,
                                                        .entry = "linear_relu_fwd",
                                                        .nin = 3,
                                                        .output = custom_fwd_shape,
                                                        .launch = custom_tile_launch,
                                                        .backward = custom_linear_relu_backward,
                                                        .user = ops});
  return kiln_ctx_status(ctx);
}

#endif
