/*
 * test_cpu_custom.c: custom ops (include/kiln_custom.h) without a GPU: options are checked and a
 * refused op is not kept; a source that does not compile is reported with NVRTC's log and the
 * op's own line numbers; a call records one node (views copied first) with its launch and
 * parameters, and every refusal records nothing; kiln_backward calls the op's backward, whose
 * gradients are checked; the step's kernels compile (the op's from the cache). The values are
 * test_gpu_custom.c's.
 */
#include <string.h>

#include "../examples/custom_linear_relu.h"
#include "fusion/render.h"
#include "inspect.h"

TestSuite(custom);

static const char copy_src[] = "__device__ void copy_rows(const kiln_custom_args &a) {\n"
                               "  long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;\n"
                               "  if (i < a.out.numel)\n"
                               "    ((float *)a.out.data)[i] = ((const float *)a.in[0].data)[i];\n"
                               "}\n";

static kiln_status same_shape(const kiln_custom_call *c, kiln_shape *out, kiln_dtype *dt) {
  *out = kiln_tensor_shape(c->in[0]);
  *dt = kiln_tensor_dtype(c->in[0]);
  return KILN_OK;
}

static kiln_custom_op_options copy_options(void) {
  return (kiln_custom_op_options){.name = "copy_rows",
                                  .source = copy_src,
                                  .entry = "copy_rows",
                                  .nin = 1,
                                  .output = same_shape};
}

/* An option out of range: NULL, the error naming the function and the value, no op kept. */
static void expect_refused(kiln_ctx *ctx, kiln_custom_op_options o, const char *what) {
  int before = ctx->ncustom;
  cr_assert_null(kiln_custom_op_new(ctx, &o), "%s was accepted", what);
  TH_ASSERT_ERROR(ctx, KILN_ERR_INVALID, "kiln_custom_op_new", what);
  cr_assert_eq(ctx->ncustom, before);
  kiln_ctx_clear_error(ctx);
}

Test(custom, options_are_checked) {
  kiln_ctx *ctx = th_cpu_ctx();
  cr_assert_null(kiln_custom_op_new(ctx, NULL));
  TH_ASSERT_ERROR(ctx, KILN_ERR_INVALID, "kiln_custom_op_new", "NULL");
  kiln_ctx_clear_error(ctx);
  cr_assert_null(kiln_custom_op_new(NULL, &(kiln_custom_op_options){0}));
  kiln_custom_op_options o = copy_options();
  o.name = "two words";
  expect_refused(ctx, o, "two words");
  o = copy_options();
  o.name = "n234567890123456789012345678901234567890x"; /* 41 characters */
  expect_refused(ctx, o, "n234567890");
  o = copy_options();
  o.name = NULL;
  expect_refused(ctx, o, "(null)");
  o = copy_options();
  o.entry = "kiln_mine";
  expect_refused(ctx, o, "kiln_mine");
  o = copy_options();
  o.entry = "9lives";
  expect_refused(ctx, o, "9lives");
  o = copy_options();
  o.source = "";
  expect_refused(ctx, o, "no source");
  o = copy_options();
  o.nin = 0;
  expect_refused(ctx, o, "nin 0");
  o.nin = KILN_CUSTOM_MAX_IN + 1;
  expect_refused(ctx, o, "nin 9");
  o = copy_options();
  o.max_block = 1025;
  expect_refused(ctx, o, "max_block 1025");
  o = copy_options();
  o.zero_output = 2;
  expect_refused(ctx, o, "zero_output is 2");
  o = copy_options();
  o.output = NULL;
  expect_refused(ctx, o, "no output function");
  /* a good one after all that, its strings the op's own copies */
  char name[] = "copy_rows";
  o = copy_options();
  o.name = name;
  kiln_custom_op *op = kiln_custom_op_new(ctx, &o);
  cr_assert_not_null(op, "%s", th_err(ctx));
  name[0] = 'X';
  cr_assert_str_eq(kiln_custom_op_name(op), "copy_rows");
  cr_assert_null(kiln_custom_op_name(NULL));
  cr_assert_eq(ctx->ncustom, 1);
  th_ctx_free(ctx);
}

Test(custom, a_compile_error_gives_nvrtc_log_with_the_ops_lines, .timeout = 120) {
  char dir[256];
  th_tmpdir(dir, sizeof dir, "cache");
  cr_assert_eq(setenv("KILN_CACHE_DIR", dir, 1), 0);
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_custom_op_options o = copy_options();
  o.name = "broken";
  o.source = "__device__ void copy_rows(const kiln_custom_args &a) {\n"
             "  float x = 1.f;\n"
             "  x += undeclared_thing;\n"
             "}\n";
  cr_assert_null(kiln_custom_op_new(ctx, &o));
  /* the function, the op, NVRTC's words, and line 3 of the op's source */
  TH_ASSERT_ERROR(ctx, KILN_ERR_CUDA, "kiln_custom_op_new: op 'broken'", "NVRTC",
                  "undeclared_thing", "broken.cu(3)");
  cr_assert_eq(ctx->ncustom, 0, "a failed op was kept");
  kiln_ctx_clear_error(ctx);
  /* an entry the source does not define */
  o = copy_options();
  o.name = "missing";
  o.entry = "not_there";
  cr_assert_null(kiln_custom_op_new(ctx, &o));
  TH_ASSERT_ERROR(ctx, KILN_ERR_CUDA, "op 'missing'", "not_there");
  kiln_ctx_clear_error(ctx);
  th_ctx_free(ctx);
  th_remove_tmpdirs();
}

/* (B, K) -> launch: the default is one thread per element, blocks of max_block. */
Test(custom, a_call_records_one_node_with_its_launch_and_parameters) {
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_custom_op_options o = copy_options();
  o.max_block = 128;
  kiln_custom_op *op = kiln_custom_op_new(ctx, &o);
  cr_assert_not_null(op, "%s", th_err(ctx));
  kiln_tensor *x = th_f32(ctx, KILN_SHAPE(3, 100));
  int32_t n0 = th_tlen(ctx);
  kiln_tensor *y = kiln_custom(op, (kiln_tensor *[]){x}, (int64_t[]){7, -2, 0, 1LL << 40});
  cr_assert_not_null(y, "%s", th_err(ctx));
  th_assert_shape(y, KILN_SHAPE(3, 100));
  TH_ASSERT_OPS_FROM(ctx, n0, KILN__OP_CUSTOM);
  kiln__node *n = th_node(ctx, -1);
  cr_assert_eq(n->nin, 1);
  cr_assert_eq(n->in[0], x, "a contiguous input is read where it lies");
  cr_assert_eq(KILN__I(n, CUSTOM, id), 0);
  cr_assert_eq(KILN__IA(n, CUSTOM, launch, 0), 3); /* 300 elements, 128 a block */
  cr_assert_eq(KILN__IA(n, CUSTOM, launch, 1), 1);
  cr_assert_eq(KILN__IA(n, CUSTOM, launch, 2), 1);
  cr_assert_eq(KILN__IA(n, CUSTOM, launch, 3), 128);
  cr_assert_eq(KILN__IA(n, CUSTOM, launch, 4), 0);
  cr_assert_eq(KILN__IA(n, CUSTOM, param, 0), 7);
  cr_assert_eq(KILN__IA(n, CUSTOM, param, 1), -2);
  cr_assert_eq(KILN__IA(n, CUSTOM, param, 3), 1LL << 40);
  cr_assert_not(kiln_tensor_requires_grad(y));
  /* a transposed view is copied first; so is a slice at an offset that is not 16-byte aligned */
  n0 = th_tlen(ctx);
  cr_assert_not_null(kiln_custom(op, (kiln_tensor *[]){kiln_transpose(x, 0, 1)}, NULL));
  TH_ASSERT_OPS_FROM(ctx, n0, KILN__OP_PERMUTE, KILN__OP_COPY, KILN__OP_CUSTOM);
  n0 = th_tlen(ctx);
  kiln_tensor *flat = kiln_reshape(x, KILN_SHAPE(300));
  cr_assert_not_null(kiln_custom(op, (kiln_tensor *[]){kiln_slice(flat, 0, 1, 5, 1)}, NULL));
  TH_ASSERT_OPS_FROM(ctx, n0, KILN__OP_RESHAPE, KILN__OP_SLICE, KILN__OP_COPY, KILN__OP_CUSTOM);
  n0 = th_tlen(ctx); /* at a 16-byte boundary, a slice is read in place */
  cr_assert_not_null(kiln_custom(op, (kiln_tensor *[]){kiln_slice(flat, 0, 4, 8, 1)}, NULL));
  TH_ASSERT_OPS_FROM(ctx, n0, KILN__OP_SLICE, KILN__OP_CUSTOM);
  /* an empty output is recorded and launches nothing */
  n0 = th_tlen(ctx);
  kiln_tensor *e = kiln_custom(op, (kiln_tensor *[]){th_f32(ctx, KILN_SHAPE(0, 4))}, NULL);
  cr_assert_not_null(e, "%s", th_err(ctx));
  cr_assert_eq(KILN__IA(th_node(ctx, -1), CUSTOM, launch, 3), 0);
  th_free_scratch();
  th_ctx_free(ctx);
}

static kiln_status refuse_shape(const kiln_custom_call *c, kiln_shape *out, kiln_dtype *dt) {
  (void)c, (void)out, (void)dt;
  return KILN_ERR_SHAPE;
}
static kiln_status f16_output(const kiln_custom_call *c, kiln_shape *out, kiln_dtype *dt) {
  *out = kiln_tensor_shape(c->in[0]);
  *dt = KILN_DTYPE_F16;
  return KILN_OK;
}
static kiln_status negative_output(const kiln_custom_call *c, kiln_shape *out, kiln_dtype *dt) {
  (void)c;
  *out = KILN_SHAPE(4, -1);
  *dt = KILN_DTYPE_F32;
  return KILN_OK;
}
/* a launch from the call's first parameter: 0 a good one, then one bad field each */
static kiln_status param_launch(const kiln_custom_call *c, const kiln_shape *out,
                                kiln_custom_launch *l) {
  (void)out;
  *l = (kiln_custom_launch){.grid = {1, 1, 1}, .block = 64};
  switch (c->param[0]) {
  case 1: l->block = 257; break;
  case 2: l->grid[1] = 65536; break;
  case 3: l->smem = 1u << 30; break;
  case 4: l->grid[0] = 0; break;
  case 5: return KILN_ERR_INVALID;
  }
  return KILN_OK;
}

Test(custom, refused_calls_record_nothing) {
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_custom_op_options o = copy_options();
  o.launch = param_launch;
  kiln_custom_op *op = kiln_custom_op_new(ctx, &o);
  o.output = refuse_shape;
  o.name = "refuses";
  kiln_custom_op *refuses = kiln_custom_op_new(ctx, &o);
  o.output = f16_output;
  o.name = "f16";
  kiln_custom_op *f16 = kiln_custom_op_new(ctx, &o);
  o.output = negative_output;
  o.name = "negative";
  kiln_custom_op *negative = kiln_custom_op_new(ctx, &o);
  cr_assert(op && refuses && f16 && negative, "%s", th_err(ctx));
  kiln_tensor *x = th_f32(ctx, KILN_SHAPE(4, 5)), *p = th_param(ctx, KILN_SHAPE(4, 5));
  cr_assert_null(kiln_custom(NULL, (kiln_tensor *[]){x}, NULL));
  TH_EXPECT_FAIL(ctx, kiln_custom(op, NULL, NULL), KILN_ERR_INVALID, "op 'copy_rows'",
                 "in is NULL");
  TH_EXPECT_FAIL(ctx, kiln_custom(op, (kiln_tensor *[]){NULL}, NULL), KILN_ERR_INVALID,
                 "input 0 of 1 is NULL");
  TH_EXPECT_FAIL(ctx, kiln_custom(refuses, (kiln_tensor *[]){x}, NULL), KILN_ERR_SHAPE,
                 "kiln_custom: op 'refuses'", "output function returned", "[4,5] f32");
  TH_EXPECT_FAIL(ctx, kiln_custom(f16, (kiln_tensor *[]){x}, NULL), KILN_ERR_DTYPE, "op 'f16'",
                 "f32, bf16 or i32");
  TH_EXPECT_FAIL(ctx, kiln_custom(negative, (kiln_tensor *[]){x}, NULL), KILN_ERR_SHAPE,
                 "kiln_custom");
  const char *why[] = {"block 257", "65536", "1073741824 bytes", "launch grid (0", "returned"};
  for (int64_t k = 1; k <= 5; k++)
    TH_EXPECT_FAIL(ctx, kiln_custom(op, (kiln_tensor *[]){x}, (int64_t[]){k, 0, 0, 0}),
                   KILN_ERR_INVALID, "op 'copy_rows'", why[k - 1]);
  /* without a backward, an input that requires grad is refused, unless gradients are off */
  TH_EXPECT_FAIL(ctx, kiln_custom(op, (kiln_tensor *[]){p}, NULL), KILN_ERR_STATE,
                 "has no backward", "input 0");
  kiln_no_grad_begin(ctx);
  cr_assert_not_null(kiln_custom(op, (kiln_tensor *[]){p}, NULL), "%s", th_err(ctx));
  kiln_no_grad_end(ctx);
  /* a tensor of another context */
  kiln_ctx *other = th_cpu_ctx();
  kiln_tensor *z = th_new(other, KILN_DTYPE_F32, KILN_SHAPE(4, 5));
  TH_EXPECT_FAIL(ctx, kiln_custom(op, (kiln_tensor *[]){z}, NULL), KILN_ERR_INVALID, "kiln_custom");
  kiln_tensor_free(z);
  th_ctx_free(other);
  th_free_scratch();
  th_ctx_free(ctx);
}

/* The example's linear + ReLU: its backward records the three gradient kernels, and each leaf's
 * gradient lands in its buffer. */
Test(custom, backward_records_the_ops_backward, .timeout = 300) {
  kiln_ctx *ctx = th_cpu_ctx();
  custom_linear_relu ops;
  cr_assert_eq(custom_linear_relu_new(ctx, &ops), KILN_OK, "%s", th_err(ctx));
  kiln_tensor *x = th_param(ctx, KILN_SHAPE(8, 5)), *w = th_param(ctx, KILN_SHAPE(6, 5)),
              *b = th_param(ctx, KILN_SHAPE(6));
  kiln_tensor *y = kiln_custom(ops.fwd, (kiln_tensor *[]){x, w, b}, NULL);
  cr_assert_not_null(y, "%s", th_err(ctx));
  th_assert_shape(y, KILN_SHAPE(8, 6));
  cr_assert(kiln_tensor_requires_grad(y));
  kiln__node *fwd = th_node(ctx, -1);
  cr_assert_eq(KILN__IA(fwd, CUSTOM, launch, 0), 1); /* 6 columns, 8 rows: one 16 x 16 tile */
  cr_assert_eq(KILN__IA(fwd, CUSTOM, launch, 1), 1);
  cr_assert_eq(KILN__IA(fwd, CUSTOM, launch, 3), 256);
  int32_t n0 = th_tlen(ctx);
  cr_assert_eq(kiln_backward(th_sum_all(y)), KILN_OK, "%s", th_err(ctx));
  int32_t n1 = th_tlen(ctx);
  cr_assert_eq(th_count_ops(ctx, n0, n1, KILN__OP_CUSTOM), 3, "dx, dW and db");
  int seen = 0;
  for (int32_t i = n0; i < n1; i++) {
    kiln__node *n = th_node(ctx, i);
    if (n->op != KILN__OP_CUSTOM) continue;
    const kiln_custom_op *op = ctx->customs[KILN__I(n, CUSTOM, id)];
    cr_assert(op == ops.dx || op == ops.dw || op == ops.db);
    cr_assert_eq(n->in[1], y, "each reads the forward's output");
    seen |= op == ops.dx ? 1 : op == ops.dw ? 2 : 4;
  }
  cr_assert_eq(seen, 7);
  for (int k = 0; k < 3; k++) {
    kiln_tensor *leaf = (kiln_tensor *[]){x, w, b}[k];
    cr_assert_not_null(leaf->grad);
    cr_assert(kiln__same_shape(leaf->grad, leaf));
  }
  th_free_scratch();
  th_ctx_free(ctx);
}

/* A backward that misbehaves in each way fails kiln_backward with the op named. */
static kiln_status bad_backward(const kiln_custom_call *c, kiln_tensor *g, kiln_tensor **gin) {
  switch (c->param[0]) {
  case 0: return KILN_ERR_INVALID;                               /* refuses */
  case 1: return KILN_OK;                                        /* gives nothing */
  case 2: gin[0] = kiln_sum(g, KILN_AXES(1), 0); return KILN_OK; /* the wrong shape */
  default: gin[0] = kiln_add_scalar(g, 1.f); return KILN_OK;     /* a good one */
  }
}

Test(custom, a_bad_backward_fails_kiln_backward) {
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_custom_op_options o = copy_options();
  o.backward = bad_backward;
  kiln_custom_op *op = kiln_custom_op_new(ctx, &o);
  cr_assert_not_null(op, "%s", th_err(ctx));
  kiln_tensor *p = th_param(ctx, KILN_SHAPE(4, 5));
  const char *why[] = {"its backward returned invalid argument", "no gradient for input 0",
                       "a gradient of [4] f32"};
  kiln_status want[] = {KILN_ERR_INVALID, KILN_ERR_STATE, KILN_ERR_SHAPE};
  for (int64_t k = 0; k < 4; k++) {
    kiln_step_begin(ctx);
    kiln_tensor *y = kiln_custom(op, (kiln_tensor *[]){p}, (int64_t[]){k, 0, 0, 0});
    cr_assert_not_null(y, "%s", th_err(ctx));
    kiln_status s = kiln_backward(th_sum_all(y));
    if (k < 3) {
      cr_assert_eq(s, want[k]);
      TH_ASSERT_ERROR(ctx, want[k], "kiln_backward: custom op 'copy_rows'", why[k]);
      kiln_ctx_clear_error(ctx);
    } else {
      cr_assert_eq(s, KILN_OK, "%s", th_err(ctx));
      cr_assert_not_null(p->grad);
    }
    kiln_step_end(ctx);
    kiln_ctx_clear_error(ctx);
  }
  th_free_scratch();
  th_ctx_free(ctx);
}

/* The step's kernels compile, the ops' from the cache (each was compiled when it was made); the
 * rendered kernel calls the op's entry, and binds the tensors and the call's parameters. */
Test(custom, kernels_compile_and_render_the_call, .timeout = 600) {
  char dir[256];
  th_tmpdir(dir, sizeof dir, "cache");
  cr_assert_eq(setenv("KILN_CACHE_DIR", dir, 1), 0);
  kiln_ctx *ctx = th_cpu_ctx();
  custom_linear_relu ops;
  cr_assert_eq(custom_linear_relu_new(ctx, &ops), KILN_OK, "%s", th_err(ctx));
  kiln_exec_stats st;
  kiln_stats(ctx, &st);
  cr_assert_eq(st.kernels_compiled, 4, "one kernel per op, when it is made");
  kiln_tensor *x = th_param(ctx, KILN_SHAPE(32, 20)), *w = th_param(ctx, KILN_SHAPE(10, 20)),
              *b = th_param(ctx, KILN_SHAPE(10));
  kiln_tensor *y = kiln_custom(ops.fwd, (kiln_tensor *[]){x, w, b}, (int64_t[]){5, 6, 7, 8});
  cr_assert_not_null(y);
  kiln__node *n = th_node(ctx, -1);
  kiln__target t = {.num_sms = 132, .customs = ctx->customs, .ncustom = ctx->ncustom};
  kiln__rendered r;
  memset(&r, 0, sizeof r);
  cr_assert(kiln__render_custom(&t, n, &r));
  cr_assert(strstr(r.src.s, "linear_relu_fwd(c);"), "%s", r.src.s);
  cr_assert(strstr(r.src.s, "#line 1 \"linear_relu.cu\""));
  cr_assert(strstr(r.src.s, "__launch_bounds__(256)"));
  cr_assert_eq(strncmp(r.name, "k_custom_linear_relu_", 21), 0, "%s", r.name);
  cr_assert_eq(r.arg.nptr, 4);
  cr_assert(r.arg.ptr[0] == x && r.arg.ptr[1] == w && r.arg.ptr[2] == b && r.arg.ptr[3] == y);
  cr_assert_eq(r.arg.args.st[1][0], 10);
  cr_assert_eq(r.arg.args.st[1][1], 20);
  cr_assert_eq(r.arg.args.st[2][1], 1, "past its dims, a shape is 1");
  cr_assert_eq(r.arg.args.st[KILN__CUSTOM_META][2], 1 + 16 * KILN_DTYPE_F32, "b: 1 dim, f32");
  cr_assert_eq(r.arg.args.st[KILN__CUSTOM_META][3], 2, "y: 2 dims, f32");
  cr_assert_eq(r.arg.args.st[KILN__CUSTOM_PARAM][3], 8);
  cr_assert_eq(r.arg.args.i[0], 3);
  cr_assert_eq(r.arg.args.n, 320);
  cr_assert(r.grid == 1 && r.grid_y == 2 && r.grid_z == 1 && r.block == 256 && r.smem == 0);
  cr_assert_eq(r.zero_bytes, 0u);
  cr_assert_null(strstr(r.src.s, "kiln_pdl_begin"));
  /* launched as a programmatic dependent (KILN_PDL=1): the wrapper waits first; another kernel */
  kiln__target tp = t;
  tp.pdl = true;
  kiln__rendered rp;
  memset(&rp, 0, sizeof rp);
  rp.pdl = true;
  cr_assert(kiln__render_custom(&tp, n, &rp));
  cr_assert(strstr(rp.src.s, "(const kiln__kargs a) {\n  kiln_pdl_begin();\n  kiln_custom_args c;"),
            "%s", rp.src.s);
  cr_assert_str_neq(rp.name, r.name);
  kiln__sb_free(&rp.src);
  kiln__sb_free(&r.src);
  cr_assert_eq(kiln_backward(th_sum_all(y)), KILN_OK, "%s", th_err(ctx));
  cr_assert_eq(kiln__engine_compile(ctx, ctx->trace.done, ctx->trace.n), KILN_OK, "%s",
               th_err(ctx));
  kiln_stats(ctx, &st);
  cr_assert_geq(st.cache_hits, 4, "the ops' kernels come from the cache");
  th_free_scratch();
  th_ctx_free(ctx);
  th_remove_tmpdirs();
}

/* With KILN_PDL=1 (sm_90) the kernel compiled when the op is made is the one its calls launch,
 * as a programmatic dependent: the step takes it from the cache (it compiled another before). */
Test(custom, kernels_made_with_the_op_launch_as_dependents_under_pdl, .timeout = 600) {
  char dir[256];
  th_tmpdir(dir, sizeof dir, "cache");
  cr_assert_eq(setenv("KILN_CACHE_DIR", dir, 1), 0);
  kiln_ctx *ctx = th_cpu_ctx();
  const int arch = ctx->arch;
  if (arch < 90) {
    th_ctx_free(ctx);
    cr_skip_test("the build's default architecture is sm_%d: no programmatic launches", arch);
  }
  ctx->pdl = true; /* as KILN_PDL=1 makes it */
  custom_linear_relu ops;
  cr_assert_eq(custom_linear_relu_new(ctx, &ops), KILN_OK, "%s", th_err(ctx));
  kiln_tensor *x = th_param(ctx, KILN_SHAPE(32, 20)), *w = th_param(ctx, KILN_SHAPE(10, 20)),
              *b = th_param(ctx, KILN_SHAPE(10));
  kiln_tensor *y = kiln_custom(ops.fwd, (kiln_tensor *[]){x, w, b}, (int64_t[]){5, 6, 7, 8});
  cr_assert_not_null(y);
  cr_assert_eq(kiln_backward(th_sum_all(y)), KILN_OK, "%s", th_err(ctx));
  kiln_exec_stats st;
  kiln_stats(ctx, &st);
  const uint64_t hits = st.cache_hits;
  cr_assert_eq(kiln__engine_compile(ctx, ctx->trace.done, ctx->trace.n), KILN_OK, "%s",
               th_err(ctx));
  kiln_stats(ctx, &st);
  cr_assert_geq(st.cache_hits - hits, 4u, "the ops' kernels, as dependents, come from the cache");
  th_free_scratch();
  th_ctx_free(ctx);
  th_remove_tmpdirs();
}

/* zero_output: the executor zeroes the output before the launch (a kernel that adds into it). */
Test(custom, zero_output_asks_the_executor_to_zero) {
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_custom_op_options o = copy_options();
  o.zero_output = 1;
  kiln_custom_op *op = kiln_custom_op_new(ctx, &o);
  cr_assert_not_null(op, "%s", th_err(ctx));
  kiln_tensor *y = kiln_custom(op, (kiln_tensor *[]){th_f32(ctx, KILN_SHAPE(7, 3))}, NULL);
  cr_assert_not_null(y);
  kiln__target t = {.num_sms = 132, .customs = ctx->customs, .ncustom = ctx->ncustom};
  kiln__rendered r;
  memset(&r, 0, sizeof r);
  cr_assert(kiln__render_custom(&t, th_node(ctx, -1), &r));
  cr_assert_eq(r.zero_slot, 1);
  cr_assert_eq(r.zero_bytes, 7 * 3 * 4);
  kiln__sb_free(&r.src);
  th_free_scratch();
  th_ctx_free(ctx);
}
