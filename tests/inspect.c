/*
 * inspect.c: trace, tensor and error inspection for the no-GPU tests (see inspect.h).
 */
#include "inspect.h"

#include <stdarg.h>
#include <string.h>

/* ---------------------------------------------------------------- the trace */

int32_t th_tlen(const kiln_ctx *ctx) { return ctx->trace.n; }

kiln__node *th_node(kiln_ctx *ctx, int32_t i) {
  if (i < 0) i += ctx->trace.n;
  cr_assert(i >= 0 && i < ctx->trace.n, "node %d of a trace of %d nodes", i, ctx->trace.n);
  return &ctx->trace.nodes[i];
}

const char *th_op_name(kiln__op op) { return kiln__ops[op].name; }

int th_count_ops(kiln_ctx *ctx, int32_t first, int32_t last, kiln__op op) {
  int c = 0;
  for (int32_t i = first; i < last; i++)
    c += ctx->trace.nodes[i].op == op;
  return c;
}

/* Writes the op names of nodes [first, last) into buf, for failure messages. */
static const char *ops_str(kiln_ctx *ctx, int32_t first, int32_t last, char *buf, size_t n) {
  size_t k = 0;
  buf[0] = 0;
  for (int32_t i = first; i < last && k + 1 < n; i++)
    k += (size_t)snprintf(buf + k, n - k, "%s%s", i > first ? " " : "",
                          th_op_name(ctx->trace.nodes[i].op));
  return buf;
}

void th_assert_ops_from(kiln_ctx *ctx, int32_t first, int n, const kiln__op *want) {
  char got[2048], exp[2048];
  size_t k = 0;
  exp[0] = 0;
  for (int i = 0; i < n && k + 1 < sizeof exp; i++)
    k += (size_t)snprintf(exp + k, sizeof exp - k, "%s%s", i ? " " : "", th_op_name(want[i]));
  ops_str(ctx, first, th_tlen(ctx), got, sizeof got);
  bool same = th_tlen(ctx) - first == n;
  for (int i = 0; same && i < n; i++)
    same = ctx->trace.nodes[first + i].op == want[i];
  cr_assert(same, "trace from node %d: got [%s], want [%s]", first, got, exp);
}

/* ---------------------------------------------------------------- tensors */

void th_assert_shape(const kiln_tensor *t, kiln_shape want) {
  cr_assert_not_null(t, "a NULL tensor where a shape was expected");
  kiln_shape got = kiln_tensor_shape(t);
  char g[128], w[128];
  bool same = got.ndim == want.ndim;
  for (int i = 0; same && i < got.ndim; i++)
    same = got.d[i] == want.d[i];
  cr_assert(same, "shape %s, want %s", kiln_shape_str(got, g, sizeof g),
            kiln_shape_str(want, w, sizeof w));
}

void th_assert_strides(const kiln_tensor *t, int n, const int64_t *want) {
  cr_assert_eq(kiln_tensor_ndim(t), n, "ndim %d, want %d", kiln_tensor_ndim(t), n);
  for (int i = 0; i < n; i++)
    cr_assert_eq(kiln_tensor_stride(t, i), want[i], "stride %d is %lld, want %lld", i,
                 (long long)kiln_tensor_stride(t, i), (long long)want[i]);
}

kiln_tensor *th_new(kiln_ctx *ctx, kiln_dtype dt, kiln_shape s) {
  kiln_tensor *t = kiln_tensor_new(ctx, dt, s);
  cr_assert_not_null(t, "kiln_tensor_new: %s", kiln_ctx_error(ctx));
  return t;
}

/* The test's scratch operands. Criterion runs every test in a process of its own. */
#define SCRATCH_MAX 256
static kiln_tensor *scratch[SCRATCH_MAX];
static int nscratch;

static kiln_tensor *keep_scratch(kiln_tensor *t) {
  cr_assert_lt(nscratch, SCRATCH_MAX, "more than %d scratch tensors in one test", SCRATCH_MAX);
  scratch[nscratch++] = t;
  return t;
}

kiln_tensor *th_f32(kiln_ctx *ctx, kiln_shape s) {
  return keep_scratch(th_new(ctx, KILN_DTYPE_F32, s));
}

kiln_tensor *th_i32(kiln_ctx *ctx, kiln_shape s) {
  return keep_scratch(th_new(ctx, KILN_DTYPE_I32, s));
}

kiln_tensor *th_param(kiln_ctx *ctx, kiln_shape s) {
  kiln_tensor *t = th_f32(ctx, s);
  kiln_tensor_set_requires_grad(t, 1);
  cr_assert(kiln_tensor_requires_grad(t));
  return t;
}

void th_free_scratch(void) {
  while (nscratch > 0)
    kiln_tensor_free(scratch[--nscratch]);
}

kiln_tensor *th_sum_all(kiln_tensor *t) { return kiln_sum(t, KILN_ALL_AXES, 0); }

/* ---------------------------------------------------------------- errors */

void th_assert_error(kiln_ctx *ctx, kiln_status want, ...) {
  const char *msg = kiln_ctx_error(ctx);
  cr_assert_eq(kiln_ctx_status(ctx), want, "status '%s', want '%s' (message: %s)",
               kiln_status_name(kiln_ctx_status(ctx)), kiln_status_name(want), msg ? msg : "none");
  cr_assert_not_null(msg, "no error message");
  va_list ap;
  va_start(ap, want);
  for (const char *s = va_arg(ap, const char *); s; s = va_arg(ap, const char *))
    cr_assert_not_null(strstr(msg, s), "the message '%s' lacks '%s'", msg, s);
  va_end(ap);
}

/* ---------------------------------------------------------------- a small MLP */

void th_net_init(th_net *m, kiln_ctx *ctx, int64_t batch, int nl, const int64_t *dims) {
  cr_assert(nl >= 1 && nl <= TH_NET_MAX);
  memset(m, 0, sizeof *m);
  m->ctx = ctx;
  m->nl = nl;
  m->params = kiln_params_new(ctx);
  cr_assert_not_null(m->params);
  for (int i = 0; i < nl; i++) {
    char name[16];
    snprintf(name, sizeof name, "fc%d", i + 1);
    kiln_status s =
        kiln_linear_init(&m->l[i], m->params,
                         &(kiln_linear_options){.name = name, .in = dims[i], .out = dims[i + 1]});
    cr_assert_eq(s, KILN_OK, "kiln_linear_init: %s", kiln_ctx_error(ctx));
  }
  m->x = th_new(ctx, KILN_DTYPE_F32, KILN_SHAPE(batch, dims[0]));
  m->y = th_new(ctx, KILN_DTYPE_I32, KILN_SHAPE(batch));
}

kiln_tensor *th_net_logits(th_net *m) {
  kiln_tensor *h = m->x;
  for (int i = 0; i < m->nl; i++) {
    h = kiln_linear_forward(&m->l[i], h);
    if (i + 1 < m->nl) h = kiln_relu(h);
  }
  return h;
}

kiln_tensor *th_net_loss(th_net *m) {
  kiln_tensor *loss = kiln_cross_entropy(th_net_logits(m), m->y, KILN_REDUCTION_MEAN, 0.f);
  cr_assert_not_null(loss, "the MLP's loss: %s", kiln_ctx_error(m->ctx));
  return loss;
}

void th_net_backward(th_net *m) {
  cr_assert_eq(kiln_backward(th_net_loss(m)), KILN_OK, "kiln_backward: %s", kiln_ctx_error(m->ctx));
}

void th_net_free(th_net *m) {
  kiln_params_free(m->params);
  kiln_tensor_free(m->x);
  kiln_tensor_free(m->y);
}

void th_backward_program(kiln_ctx *ctx, kiln_tensor *y, kiln__program *pg, const char *what) {
  cr_assert_not_null(y, "%s: %s", what, th_err(ctx));
  cr_assert_eq(kiln_backward(kiln_cast(kiln_sum(y, KILN_ALL_AXES, 0), KILN_DTYPE_F32)), KILN_OK,
               "%s: %s", what, th_err(ctx));
  cr_assert(kiln__program_build(ctx, ctx->trace.done, ctx->trace.n, pg), "%s: %s", what,
            th_err(ctx));
}

void th_finish_program(kiln_ctx *ctx, kiln__program *pg, const char *what) {
  kiln__program_free(pg);
  cr_assert_eq(kiln_step_end(ctx), KILN_OK, "%s: %s", what, th_err(ctx));
  th_free_scratch();
  th_ctx_free(ctx);
}
