/*
 * test_cpu_shapes.c: what every op records on a no-GPU context: output shapes, strides and views
 * (broadcasting, matmul, reductions, softmax, reshape, permute, slice, expand, concat,
 * index_select, cast, full, dropout, cross-entropy), dtypes, accessors, and the error each misuse
 * sets, naming the function and the shapes.
 */
#include <string.h>

#include "inspect.h"

Test(shapes, broadcasting) {
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_tensor *a = th_f32(ctx, KILN_SHAPE(3, 1)), *b = th_f32(ctx, KILN_SHAPE(4));
  kiln_tensor *c = kiln_add(a, b);
  th_assert_shape(c, KILN_SHAPE(3, 4));
  cr_assert(kiln_tensor_is_contiguous(c));
  TH_ASSERT_STRIDES(c, 4, 1);
  th_assert_shape(kiln_mul(th_f32(ctx, KILN_SHAPE(2, 1, 5)), th_f32(ctx, KILN_SHAPE(3, 1))),
                  KILN_SHAPE(2, 3, 5));
  th_assert_shape(kiln_sub(th_f32(ctx, KILN_SCALAR_SHAPE), th_f32(ctx, KILN_SHAPE(2, 3))),
                  KILN_SHAPE(2, 3));
  th_assert_shape(kiln_where(th_f32(ctx, KILN_SHAPE(4, 1, 1)), th_f32(ctx, KILN_SHAPE(1, 3, 1)),
                             th_f32(ctx, KILN_SHAPE(2))),
                  KILN_SHAPE(4, 3, 2));
  /* a zero-sized dim broadcasts against 1 */
  th_assert_shape(kiln_add(th_f32(ctx, KILN_SHAPE(0, 3)), th_f32(ctx, KILN_SHAPE(1, 3))),
                  KILN_SHAPE(0, 3));
  th_assert_ok(ctx);
  th_free_scratch();
  th_ctx_free(ctx);
}

Test(shapes, broadcast_errors_name_the_shapes) {
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_tensor *a = th_f32(ctx, KILN_SHAPE(2, 3)), *b = th_f32(ctx, KILN_SHAPE(4, 3));
  TH_EXPECT_FAIL(ctx, kiln_add(a, b), KILN_ERR_SHAPE, "kiln_add", "[2,3]", "[4,3]");
  TH_EXPECT_FAIL(ctx, kiln_maximum(b, a), KILN_ERR_SHAPE, "kiln_maximum", "[4,3]", "[2,3]");
  kiln_tensor *c = th_f32(ctx, KILN_SHAPE(5));
  TH_EXPECT_FAIL(ctx, kiln_where(a, a, c), KILN_ERR_SHAPE, "kiln_where", "[5]");
  th_free_scratch();
  th_ctx_free(ctx);
}

Test(shapes, matmul) {
  kiln_ctx *ctx = th_cpu_ctx();
  th_assert_shape(kiln_matmul(th_f32(ctx, KILN_SHAPE(128, 784)), th_f32(ctx, KILN_SHAPE(784, 10))),
                  KILN_SHAPE(128, 10));
  th_assert_shape(kiln_matmul(th_f32(ctx, KILN_SHAPE(5, 2, 3)), th_f32(ctx, KILN_SHAPE(3, 4))),
                  KILN_SHAPE(5, 2, 4));
  th_assert_shape(kiln_matmul(th_f32(ctx, KILN_SHAPE(5, 2, 3)), th_f32(ctx, KILN_SHAPE(5, 3, 4))),
                  KILN_SHAPE(5, 2, 4));
  th_assert_shape(kiln_matmul(th_f32(ctx, KILN_SHAPE(2, 3)), th_f32(ctx, KILN_SHAPE(5, 3, 4))),
                  KILN_SHAPE(5, 2, 4));
  /* a batch of 1 broadcasts, on either side */
  th_assert_shape(kiln_matmul(th_f32(ctx, KILN_SHAPE(1, 2, 3)), th_f32(ctx, KILN_SHAPE(6, 3, 4))),
                  KILN_SHAPE(6, 2, 4));
  th_assert_shape(kiln_matmul(th_f32(ctx, KILN_SHAPE(6, 2, 3)), th_f32(ctx, KILN_SHAPE(1, 3, 4))),
                  KILN_SHAPE(6, 2, 4));
  th_assert_ok(ctx);

  kiln_tensor *x = th_f32(ctx, KILN_SHAPE(128, 784)), *w = th_f32(ctx, KILN_SHAPE(512, 10));
  int32_t n0 = th_tlen(ctx);
  cr_assert_null(kiln_matmul(x, w));
  cr_assert_eq(th_tlen(ctx), n0);
  cr_assert_eq(kiln_ctx_status(ctx), KILN_ERR_SHAPE);
  cr_assert_str_eq(kiln_ctx_error(ctx), "kiln_matmul: inner dims differ: [128,784] x [512,10]");
  kiln_ctx_clear_error(ctx);

  TH_EXPECT_FAIL(ctx,
                 kiln_matmul(th_f32(ctx, KILN_SHAPE(2, 4, 3)), th_f32(ctx, KILN_SHAPE(3, 3, 5))),
                 KILN_ERR_SHAPE, "kiln_matmul: batch dims differ", "[2,4,3]", "[3,3,5]");
  TH_EXPECT_FAIL(ctx,
                 kiln_matmul(th_f32(ctx, KILN_SHAPE(2, 2, 4, 3)), th_f32(ctx, KILN_SHAPE(3, 5))),
                 KILN_ERR_SHAPE, "kiln_matmul", "2-D or 3-D", "[2,2,4,3]");
  TH_EXPECT_FAIL(ctx, kiln_matmul(th_f32(ctx, KILN_SHAPE(3)), th_f32(ctx, KILN_SHAPE(3, 5))),
                 KILN_ERR_SHAPE, "kiln_matmul", "[3]");
  TH_EXPECT_FAIL(ctx, kiln_matmul(th_i32(ctx, KILN_SHAPE(2, 3)), th_f32(ctx, KILN_SHAPE(3, 5))),
                 KILN_ERR_DTYPE, "kiln_matmul", "i32");
  th_free_scratch();
  th_ctx_free(ctx);
}

Test(shapes, matmul_reads_transposed_and_row_strided_operands_without_copies) {
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_tensor *x = th_f32(ctx, KILN_SHAPE(4, 8)), *w = th_f32(ctx, KILN_SHAPE(6, 8));
  int32_t n0 = th_tlen(ctx);
  kiln_tensor *y = kiln_matmul(x, kiln_transpose(w, 0, 1));
  th_assert_shape(y, KILN_SHAPE(4, 6));
  TH_ASSERT_OPS_FROM(ctx, n0, KILN__OP_PERMUTE, KILN__OP_MATMUL);
  /* the first 5 columns of each row: rows are dense, the leading dimension is 8 */
  n0 = th_tlen(ctx);
  kiln_tensor *cols = kiln_slice(x, 1, 0, 5, 1);
  TH_ASSERT_STRIDES(cols, 8, 1);
  th_assert_shape(kiln_matmul(cols, th_f32(ctx, KILN_SHAPE(5, 2))), KILN_SHAPE(4, 2));
  TH_ASSERT_OPS_FROM(ctx, n0, KILN__OP_SLICE, KILN__OP_MATMUL);
  /* every other column: neither rows nor columns are dense, so the operand is copied */
  n0 = th_tlen(ctx);
  kiln_tensor *odd = kiln_slice(x, 1, 1, 8, 2);
  TH_ASSERT_STRIDES(odd, 8, 2);
  th_assert_shape(kiln_matmul(odd, th_f32(ctx, KILN_SHAPE(4, 2))), KILN_SHAPE(4, 2));
  TH_ASSERT_OPS_FROM(ctx, n0, KILN__OP_SLICE, KILN__OP_COPY, KILN__OP_MATMUL);
  cr_assert(kiln_tensor_is_contiguous(th_node(ctx, -1)->in[0]));
  th_assert_ok(ctx);
  th_free_scratch();
  th_ctx_free(ctx);
}

Test(shapes, reductions) {
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_tensor *a = th_f32(ctx, KILN_SHAPE(2, 3, 4, 5));
  kiln_tensor *s = kiln_sum(a, KILN_AXES(1, 3), 0);
  th_assert_shape(s, KILN_SHAPE(2, 4));
  cr_assert_eq(KILN__RI(th_node(ctx, -1), mask), 0xa, "mask 0x%llx",
               (long long)KILN__RI(th_node(ctx, -1), mask));
  cr_assert_eq(KILN__RF(th_node(ctx, -1), scale), 1.f);
  th_assert_shape(kiln_sum(a, KILN_AXES(1, 3), 1), KILN_SHAPE(2, 1, 4, 1));
  th_assert_shape(kiln_max(a, KILN_AXES(-1), 0), KILN_SHAPE(2, 3, 4));
  th_assert_shape(kiln_max(a, KILN_AXES(-4, -2), 1), KILN_SHAPE(1, 3, 1, 5));
  cr_assert_eq(KILN__RI(th_node(ctx, -1), mask), 0x5);
  kiln_tensor *m = kiln_mean(a, KILN_ALL_AXES, 0);
  th_assert_shape(m, KILN_SCALAR_SHAPE);
  cr_assert_eq(th_node(ctx, -1)->op, KILN__OP_SUM);
  cr_assert_eq(KILN__RI(th_node(ctx, -1), mask), 0xf);
  cr_assert_float_eq(KILN__RF(th_node(ctx, -1), scale), 1.f / 120.f, 1e-9);
  th_assert_shape(kiln_mean(a, KILN_ALL_AXES, 1), KILN_SHAPE(1, 1, 1, 1));
  th_assert_shape(kiln_mean(a, KILN_AXES(0), 0), KILN_SHAPE(3, 4, 5));
  cr_assert_float_eq(KILN__RF(th_node(ctx, -1), scale), 0.5f, 1e-9);
  kiln_tensor *am = kiln_argmax(a, -1, 0);
  th_assert_shape(am, KILN_SHAPE(2, 3, 4));
  cr_assert_eq(kiln_tensor_dtype(am), KILN_DTYPE_I32);
  th_assert_shape(kiln_argmax(a, 1, 1), KILN_SHAPE(2, 1, 4, 5));
  /* a sum over an empty axis is zeros; a max over one has no value */
  kiln_tensor *e = th_f32(ctx, KILN_SHAPE(0, 3));
  th_assert_shape(kiln_sum(e, KILN_AXES(0), 0), KILN_SHAPE(3));
  th_assert_ok(ctx);

  TH_EXPECT_FAIL(ctx, kiln_max(e, KILN_AXES(0), 0), KILN_ERR_SHAPE, "kiln_max", "empty axis 0",
                 "[0,3]");
  TH_EXPECT_FAIL(ctx, kiln_sum(a, KILN_AXES(1, -3), 0), KILN_ERR_INVALID, "kiln_sum",
                 "axis -3 given twice");
  TH_EXPECT_FAIL(ctx, kiln_mean(a, KILN_AXES(4), 0), KILN_ERR_SHAPE, "kiln_mean", "axis 4",
                 "[2,3,4,5]");
  TH_EXPECT_FAIL(ctx, kiln_max(a, KILN_AXES(-5), 1), KILN_ERR_SHAPE, "kiln_max", "axis -5");
  TH_EXPECT_FAIL(ctx, kiln_argmax(a, 4, 0), KILN_ERR_SHAPE, "kiln_argmax", "axis 4");
  kiln_axes too_many = {.n = 7};
  TH_EXPECT_FAIL(ctx, kiln_sum(a, too_many, 0), KILN_ERR_INVALID, "kiln_sum", "7 axes");
  TH_EXPECT_FAIL(ctx, kiln_mean(th_i32(ctx, KILN_SHAPE(3)), KILN_ALL_AXES, 0), KILN_ERR_DTYPE,
                 "kiln_mean", "i32");
  TH_EXPECT_FAIL(ctx, kiln_max(th_i32(ctx, KILN_SHAPE(3)), KILN_ALL_AXES, 0), KILN_ERR_DTYPE,
                 "kiln_max", "i32");
  /* an i32 sum is an exact i32; comparisons take i32 and give f32 */
  kiln_tensor *is = kiln_sum(th_i32(ctx, KILN_SHAPE(3, 4)), KILN_AXES(1), 0);
  cr_assert_not_null(is, "%s", th_err(ctx));
  cr_assert_eq(kiln_tensor_dtype(is), KILN_DTYPE_I32);
  cr_assert_eq(kiln_tensor_dim(is, 0), 3);
  kiln_tensor *ce = kiln_eq(th_i32(ctx, KILN_SHAPE(3)), th_i32(ctx, KILN_SHAPE(3)));
  cr_assert_not_null(ce, "%s", th_err(ctx));
  cr_assert_eq(kiln_tensor_dtype(ce), KILN_DTYPE_F32);
  TH_EXPECT_FAIL(ctx, kiln_add(th_i32(ctx, KILN_SHAPE(3)), a), KILN_ERR_DTYPE, "kiln_add", "i32");
  th_free_scratch();
  th_ctx_free(ctx);
}

Test(shapes, softmax_and_log_softmax) {
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_tensor *a = th_param(ctx, KILN_SHAPE(4, 7));
  int32_t n0 = th_tlen(ctx);
  kiln_tensor *s = kiln_softmax(a, -1);
  th_assert_shape(s, KILN_SHAPE(4, 7));
  TH_ASSERT_OPS_FROM(ctx, n0, KILN__OP_MAX, KILN__OP_SUB, KILN__OP_EXP, KILN__OP_SUM, KILN__OP_DIV);
  /* the max only steadies the exponent: no gradient goes through it */
  cr_assert(!th_node(ctx, n0)->out->requires_grad);
  cr_assert(kiln_tensor_requires_grad(s));
  th_assert_shape(th_node(ctx, n0)->out, KILN_SHAPE(4, 1));
  cr_assert(kiln_grad_enabled(ctx), "softmax left grad mode off");
  n0 = th_tlen(ctx);
  th_assert_shape(kiln_log_softmax(a, 0), KILN_SHAPE(4, 7));
  TH_ASSERT_OPS_FROM(ctx, n0, KILN__OP_MAX, KILN__OP_SUB, KILN__OP_EXP, KILN__OP_SUM, KILN__OP_LOG,
                     KILN__OP_SUB);
  th_assert_shape(th_node(ctx, n0)->out, KILN_SHAPE(1, 7));
  TH_EXPECT_FAIL(ctx, kiln_softmax(a, 2), KILN_ERR_SHAPE, "kiln_softmax", "axis 2", "[4,7]");
  th_free_scratch();
  th_ctx_free(ctx);
}

Test(shapes, reshape) {
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_tensor *a = th_f32(ctx, KILN_SHAPE(2, 3, 4));
  int32_t n0 = th_tlen(ctx);
  kiln_tensor *r = kiln_reshape(a, KILN_SHAPE(-1, 4));
  th_assert_shape(r, KILN_SHAPE(6, 4));
  TH_ASSERT_OPS_FROM(ctx, n0, KILN__OP_RESHAPE);
  cr_assert_eq(r->st, a->st, "a reshape of a contiguous tensor is a view");
  th_assert_shape(kiln_reshape(a, KILN_SHAPE(4, -1, 2)), KILN_SHAPE(4, 3, 2));
  th_assert_shape(kiln_reshape(a, KILN_SHAPE(24)), KILN_SHAPE(24));
  th_assert_shape(
      kiln_reshape(kiln_reshape(th_f32(ctx, KILN_SHAPE(1)), KILN_SCALAR_SHAPE), KILN_SHAPE(1, 1)),
      KILN_SHAPE(1, 1));
  /* a transposed tensor is copied first */
  n0 = th_tlen(ctx);
  th_assert_shape(kiln_reshape(kiln_transpose(a, 0, 2), KILN_SHAPE(4, 6)), KILN_SHAPE(4, 6));
  TH_ASSERT_OPS_FROM(ctx, n0, KILN__OP_PERMUTE, KILN__OP_COPY, KILN__OP_RESHAPE);
  th_assert_ok(ctx);

  TH_EXPECT_FAIL(ctx, kiln_reshape(a, KILN_SHAPE(5, -1)), KILN_ERR_SHAPE,
                 "kiln_reshape: cannot reshape [2,3,4] into [5,-1]");
  TH_EXPECT_FAIL(ctx, kiln_reshape(a, KILN_SHAPE(-1, -1)), KILN_ERR_SHAPE, "kiln_reshape",
                 "more than one -1");
  TH_EXPECT_FAIL(ctx, kiln_reshape(a, KILN_SHAPE(7, 3)), KILN_ERR_SHAPE,
                 "kiln_reshape: cannot reshape [2,3,4] (24 elements) into [7,3] (21)");
  TH_EXPECT_FAIL(ctx, kiln_reshape(a, KILN_SHAPE(-2, -12)), KILN_ERR_SHAPE, "kiln_reshape",
                 "bad size -2");
  TH_EXPECT_FAIL(ctx, kiln_reshape(a, KILN_SHAPE(0, -1)), KILN_ERR_SHAPE, "kiln_reshape");
  kiln_shape seven = {.ndim = 7};
  TH_EXPECT_FAIL(ctx, kiln_reshape(a, seven), KILN_ERR_SHAPE, "kiln_reshape", "7 dims");
  th_free_scratch();
  th_ctx_free(ctx);
}

Test(shapes, permute_and_transpose_are_views) {
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_tensor *a = th_f32(ctx, KILN_SHAPE(2, 3, 4));
  TH_ASSERT_STRIDES(a, 12, 4, 1);
  int32_t n0 = th_tlen(ctx);
  kiln_tensor *t = kiln_transpose(a, 0, 2);
  th_assert_shape(t, KILN_SHAPE(4, 3, 2));
  TH_ASSERT_STRIDES(t, 1, 4, 12);
  cr_assert(!kiln_tensor_is_contiguous(t));
  cr_assert(!kiln_tensor_is_persistent(t));
  cr_assert_eq(t->st, a->st, "a transpose shares its input's storage");
  TH_ASSERT_OPS_FROM(ctx, n0, KILN__OP_PERMUTE); /* one view node, no copy */

  kiln_tensor *p = kiln_permute(a, KILN_AXES(1, 2, 0));
  th_assert_shape(p, KILN_SHAPE(3, 4, 2));
  TH_ASSERT_STRIDES(p, 4, 1, 12);
  kiln__node *n = th_node(ctx, -1);
  long long o0 = KILN__IA(n, PERMUTE, order, 0), o1 = KILN__IA(n, PERMUTE, order, 1),
            o2 = KILN__IA(n, PERMUTE, order, 2);
  cr_assert(o0 == 1 && o1 == 2 && o2 == 0, "permute order %lld %lld %lld", o0, o1, o2);
  kiln_tensor *q = kiln_permute(a, KILN_AXES(-1, 0, 1));
  th_assert_shape(q, KILN_SHAPE(4, 2, 3));
  cr_assert_eq(KILN__IA(th_node(ctx, -1), PERMUTE, order, 0), 2,
               "negative axes are stored normalised");
  th_assert_shape(kiln_transpose(a, -1, -2), KILN_SHAPE(2, 4, 3));
  /* permuting back gives contiguous strides */
  cr_assert(kiln_tensor_is_contiguous(kiln_transpose(t, 0, 2)));
  cr_assert_eq(kiln_contiguous(a), a, "kiln_contiguous of a contiguous tensor is itself");
  th_assert_ok(ctx);

  TH_EXPECT_FAIL(ctx, kiln_permute(a, KILN_AXES(0, 1)), KILN_ERR_SHAPE, "kiln_permute",
                 "2 axes given", "[2,3,4]");
  TH_EXPECT_FAIL(ctx, kiln_permute(a, KILN_AXES(0, 1, 1)), KILN_ERR_SHAPE, "kiln_permute",
                 "not a permutation");
  TH_EXPECT_FAIL(ctx, kiln_permute(a, KILN_AXES(0, 1, 3)), KILN_ERR_SHAPE, "kiln_permute");
  TH_EXPECT_FAIL(ctx, kiln_transpose(a, 0, 3), KILN_ERR_SHAPE, "kiln_transpose", "axis 3");
  th_free_scratch();
  th_ctx_free(ctx);
}

Test(shapes, slice) {
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_tensor *v = th_f32(ctx, KILN_SHAPE(10));
  int32_t n0 = th_tlen(ctx);
  /* [-8:-1:3] of 10 is elements 2, 5, 8 */
  kiln_tensor *s = kiln_slice(v, 0, -8, -1, 3);
  th_assert_shape(s, KILN_SHAPE(3));
  TH_ASSERT_STRIDES(s, 3);
  cr_assert_eq(s->offset, 2);
  cr_assert_eq(s->st, v->st);
  TH_ASSERT_OPS_FROM(ctx, n0, KILN__OP_SLICE);
  kiln__node *n = th_node(ctx, -1);
  long long axis = KILN__I(n, SLICE, axis), start = KILN__I(n, SLICE, start),
            step = KILN__I(n, SLICE, step);
  cr_assert(axis == 0 && start == 2 && step == 3, "slice attributes %lld %lld %lld", axis, start,
            step);
  /* out-of-range bounds clamp */
  th_assert_shape(kiln_slice(v, 0, -100, 100, 1), KILN_SHAPE(10));
  cr_assert_eq(th_node(ctx, -1)->out->offset, 0);
  th_assert_shape(kiln_slice(v, 0, 7, 3, 1), KILN_SHAPE(0));
  th_assert_shape(kiln_slice(v, 0, 12, 20, 1), KILN_SHAPE(0));
  th_assert_shape(kiln_slice(v, 0, 0, 10, 4), KILN_SHAPE(3)); /* 0, 4, 8 */
  th_assert_shape(kiln_slice(v, 0, 3, 5, 10), KILN_SHAPE(1));

  kiln_tensor *a = th_f32(ctx, KILN_SHAPE(4, 6));
  kiln_tensor *c = kiln_slice(a, -1, 1, 100, 2); /* columns 1, 3, 5 */
  th_assert_shape(c, KILN_SHAPE(4, 3));
  TH_ASSERT_STRIDES(c, 6, 2);
  cr_assert_eq(c->offset, 1);
  cr_assert(!kiln_tensor_is_contiguous(c));
  kiln_tensor *r = kiln_slice(a, 0, 1, 3, 1); /* rows 1 and 2: still contiguous */
  th_assert_shape(r, KILN_SHAPE(2, 6));
  TH_ASSERT_STRIDES(r, 6, 1);
  cr_assert_eq(r->offset, 6);
  cr_assert(kiln_tensor_is_contiguous(r));
  /* a slice of a slice composes offsets and strides */
  kiln_tensor *rc = kiln_slice(r, 1, 2, 6, 3); /* columns 2 and 5 of rows 1, 2 */
  th_assert_shape(rc, KILN_SHAPE(2, 2));
  TH_ASSERT_STRIDES(rc, 6, 3);
  cr_assert_eq(rc->offset, 8);
  th_assert_ok(ctx);

  TH_EXPECT_FAIL(ctx, kiln_slice(v, 0, 0, 5, 0), KILN_ERR_INVALID, "kiln_slice", "step 0");
  TH_EXPECT_FAIL(ctx, kiln_slice(v, 0, 0, 5, -1), KILN_ERR_INVALID, "kiln_slice", "step -1");
  TH_EXPECT_FAIL(ctx, kiln_slice(a, 2, 0, 5, 1), KILN_ERR_SHAPE, "kiln_slice", "axis 2");
  th_free_scratch();
  th_ctx_free(ctx);
}

Test(shapes, expand) {
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_tensor *a = th_f32(ctx, KILN_SHAPE(3, 1));
  int32_t n0 = th_tlen(ctx);
  kiln_tensor *e = kiln_expand(a, KILN_SHAPE(2, 3, 4));
  th_assert_shape(e, KILN_SHAPE(2, 3, 4));
  TH_ASSERT_STRIDES(e, 0, 1, 0);
  cr_assert_eq(e->st, a->st);
  TH_ASSERT_OPS_FROM(ctx, n0, KILN__OP_EXPAND);
  th_assert_shape(kiln_expand(a, KILN_SHAPE(-1, 5)), KILN_SHAPE(3, 5));
  th_assert_shape(kiln_expand(a, KILN_SHAPE(3, 1)), KILN_SHAPE(3, 1));
  th_assert_ok(ctx);
  TH_EXPECT_FAIL(ctx, kiln_expand(th_f32(ctx, KILN_SHAPE(3, 2)), KILN_SHAPE(3, 4)), KILN_ERR_SHAPE,
                 "kiln_expand: cannot expand [3,2] to [3,4]");
  TH_EXPECT_FAIL(ctx, kiln_expand(a, KILN_SHAPE(3)), KILN_ERR_SHAPE, "kiln_expand", "[3,1]");
  TH_EXPECT_FAIL(ctx, kiln_expand(a, KILN_SHAPE(-1, 3, 1)), KILN_ERR_SHAPE, "kiln_expand");
  th_free_scratch();
  th_ctx_free(ctx);
}

Test(shapes, concat) {
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_tensor *a = th_f32(ctx, KILN_SHAPE(2, 3)), *b = th_f32(ctx, KILN_SHAPE(2, 5));
  kiln_tensor *ab[2] = {a, b};
  int32_t n0 = th_tlen(ctx);
  kiln_tensor *c = kiln_concat(2, ab, 1);
  th_assert_shape(c, KILN_SHAPE(2, 8));
  TH_ASSERT_OPS_FROM(ctx, n0, KILN__OP_CONCAT);
  cr_assert_eq(KILN__I(th_node(ctx, -1), CONCAT, axis), 1);
  cr_assert_eq(th_node(ctx, -1)->nin, 2);
  th_assert_shape(kiln_concat(2, ab, -1), KILN_SHAPE(2, 8));
  cr_assert_eq(KILN__I(th_node(ctx, -1), CONCAT, axis), 1, "the axis is stored normalised");
  cr_assert_eq(kiln_concat(1, ab, 0), a, "a concat of one tensor is that tensor");
  /* more inputs than one node takes: in pieces of at most KILN__MAX_IN */
  kiln_tensor *many[10];
  for (int i = 0; i < 10; i++)
    many[i] = th_f32(ctx, KILN_SHAPE(i + 1, 3));
  n0 = th_tlen(ctx);
  kiln_tensor *m = kiln_concat(10, many, 0);
  th_assert_shape(m, KILN_SHAPE(55, 3));
  for (int32_t i = n0; i < th_tlen(ctx); i++) {
    cr_assert_eq(th_node(ctx, i)->op, KILN__OP_CONCAT);
    cr_assert_leq(th_node(ctx, i)->nin, KILN__MAX_IN);
  }
  cr_assert_gt(th_tlen(ctx) - n0, 1);
  /* i32 tensors concatenate too */
  kiln_tensor *ii[2] = {th_i32(ctx, KILN_SHAPE(4)), th_i32(ctx, KILN_SHAPE(2))};
  kiln_tensor *ic = kiln_concat(2, ii, 0);
  th_assert_shape(ic, KILN_SHAPE(6));
  cr_assert_eq(kiln_tensor_dtype(ic), KILN_DTYPE_I32);
  th_assert_ok(ctx);

  kiln_tensor *bad[2] = {a, th_f32(ctx, KILN_SHAPE(3, 5))};
  TH_EXPECT_FAIL(ctx, kiln_concat(2, bad, 1), KILN_ERR_SHAPE, "kiln_concat", "input 1", "[3,5]",
                 "[2,3]", "axis 1");
  kiln_tensor *bad_nd[2] = {a, th_f32(ctx, KILN_SHAPE(2, 3, 1))};
  TH_EXPECT_FAIL(ctx, kiln_concat(2, bad_nd, 0), KILN_ERR_SHAPE, "kiln_concat", "[2,3,1]");
  kiln_tensor *bad_dt[2] = {a, th_i32(ctx, KILN_SHAPE(2, 3))};
  TH_EXPECT_FAIL(ctx, kiln_concat(2, bad_dt, 0), KILN_ERR_DTYPE, "kiln_concat", "i32");
  TH_EXPECT_FAIL(ctx, kiln_concat(2, ab, 2), KILN_ERR_SHAPE, "kiln_concat", "axis 2");
  cr_assert_null(kiln_concat(0, ab, 0));
  th_free_scratch();
  th_ctx_free(ctx);
}

Test(shapes, index_select_cast_full_and_dropout) {
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_tensor *a = th_f32(ctx, KILN_SHAPE(7, 3, 2)), *idx = th_i32(ctx, KILN_SHAPE(4));
  kiln_tensor *g = kiln_index_select(a, idx);
  th_assert_shape(g, KILN_SHAPE(4, 3, 2));
  cr_assert_eq(th_node(ctx, -1)->op, KILN__OP_INDEX_SELECT);
  /* a non-contiguous table is made contiguous first */
  int32_t n0 = th_tlen(ctx);
  th_assert_shape(kiln_index_select(kiln_transpose(a, 1, 2), idx), KILN_SHAPE(4, 2, 3));
  TH_ASSERT_OPS_FROM(ctx, n0, KILN__OP_PERMUTE, KILN__OP_COPY, KILN__OP_INDEX_SELECT);

  kiln_tensor *c = kiln_cast(a, KILN_DTYPE_I32);
  th_assert_shape(c, KILN_SHAPE(7, 3, 2));
  cr_assert_eq(kiln_tensor_dtype(c), KILN_DTYPE_I32);
  cr_assert_eq(kiln_tensor_dtype(kiln_cast(c, KILN_DTYPE_F32)), KILN_DTYPE_F32);
  kiln_tensor *f = kiln_full(ctx, KILN_SHAPE(2, 2), 3.5f);
  th_assert_shape(f, KILN_SHAPE(2, 2));
  cr_assert_eq(th_node(ctx, -1)->op, KILN__OP_FILL);
  cr_assert_eq(th_node(ctx, -1)->nin, 0);
  cr_assert_eq(KILN__F(th_node(ctx, -1), FILL, value), 3.5f);

  kiln_manual_seed(ctx, 42);
  kiln_tensor *d1 = kiln_dropout(a, 0.25f, 1), *d2 = kiln_dropout(a, 0.25f, 1);
  th_assert_shape(d1, KILN_SHAPE(7, 3, 2));
  kiln__node *n1 = th_node(ctx, d1->node), *n2 = th_node(ctx, d2->node);
  cr_assert_eq(n1->op, KILN__OP_DROPOUT);
  cr_assert_eq(KILN__F(n1, DROPOUT, p), 0.25f);
  cr_assert_float_eq(KILN__F(n1, DROPOUT, scale), 1.f / 0.75f, 1e-6);
  cr_assert_eq(KILN__U(n1, DROPOUT, seed), 42u, "the seed");
  cr_assert_eq(KILN__U(n1, DROPOUT, offset), 0u, "the first offset after seeding");
  cr_assert_eq(KILN__U(n2, DROPOUT, offset), 1u, "every dropout call draws a fresh offset");
  n0 = th_tlen(ctx);
  cr_assert_eq(kiln_dropout(a, 0.5f, 0), a, "dropout in eval mode is the identity");
  cr_assert_eq(kiln_dropout(a, 0.f, 1), a, "dropout with p 0 is the identity");
  cr_assert_eq(th_tlen(ctx), n0);
  th_assert_ok(ctx);

  TH_EXPECT_FAIL(ctx, kiln_index_select(a, th_f32(ctx, KILN_SHAPE(4))), KILN_ERR_DTYPE,
                 "kiln_index_select", "f32");
  TH_EXPECT_FAIL(ctx, kiln_index_select(a, th_i32(ctx, KILN_SHAPE(2, 2))), KILN_ERR_SHAPE,
                 "kiln_index_select", "[2,2]");
  TH_EXPECT_FAIL(ctx, kiln_cast(a, KILN_DTYPE_F16), KILN_ERR_DTYPE, "kiln_cast", "f16");
  TH_EXPECT_FAIL(ctx, kiln_dropout(a, 1.5f, 1), KILN_ERR_INVALID, "kiln_dropout", "1.5");
  TH_EXPECT_FAIL(ctx, kiln_full(ctx, KILN_SHAPE(2, -1), 0.f), KILN_ERR_SHAPE, "kiln_full");
  TH_EXPECT_FAIL(ctx, kiln_clamp(a, 1.f, -1.f), KILN_ERR_INVALID, "kiln_clamp");
  TH_EXPECT_FAIL(ctx, kiln_gelu(a, (kiln_gelu_approx)7), KILN_ERR_INVALID, "kiln_gelu", "7");
  th_free_scratch();
  th_ctx_free(ctx);
}

Test(shapes, cross_entropy) {
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_tensor *logits = th_param(ctx, KILN_SHAPE(8, 10)), *labels = th_i32(ctx, KILN_SHAPE(8));
  int32_t n0 = th_tlen(ctx);
  kiln_tensor *loss = kiln_cross_entropy(logits, labels, KILN_REDUCTION_MEAN, 0.f);
  th_assert_shape(loss, KILN_SCALAR_SHAPE);
  cr_assert(kiln_tensor_requires_grad(loss));
  TH_ASSERT_OPS_FROM(ctx, n0, KILN__OP_MAX, KILN__OP_SUB, KILN__OP_EXP, KILN__OP_SUM, KILN__OP_LOG,
                     KILN__OP_SUB, KILN__OP_RESHAPE, KILN__OP_ONEHOT, KILN__OP_MUL, KILN__OP_SUM,
                     KILN__OP_NEG, KILN__OP_SUM);
  cr_assert_float_eq(KILN__RF(th_node(ctx, -1), scale), 1.f / 8.f, 1e-9);
  kiln__node *oh = th_node(ctx, n0 + 7);
  cr_assert_eq(KILN__I(oh, ONEHOT, axis), 1, "one-hot along the class axis");
  th_assert_shape(oh->out, KILN_SHAPE(8, 10));
  th_assert_shape(oh->in[0], KILN_SHAPE(8, 1));

  th_assert_shape(kiln_cross_entropy(logits, labels, KILN_REDUCTION_NONE, 0.f), KILN_SHAPE(8));
  cr_assert_eq(th_node(ctx, -1)->op, KILN__OP_NEG);
  th_assert_shape(kiln_cross_entropy(logits, labels, KILN_REDUCTION_SUM, 0.f), KILN_SCALAR_SHAPE);
  cr_assert_eq(KILN__RF(th_node(ctx, -1), scale), 1.f);
  /* label smoothing mixes the one-hot target with the uniform one */
  n0 = th_tlen(ctx);
  kiln_cross_entropy(logits, labels, KILN_REDUCTION_MEAN, 0.1f);
  kiln__node *ms = th_node(ctx, n0 + 8), *as = th_node(ctx, n0 + 9);
  cr_assert_eq(ms->op, KILN__OP_MUL_SCALAR);
  cr_assert_float_eq(KILN__F(ms, MUL_SCALAR, s), 0.9f, 1e-7);
  cr_assert_eq(as->op, KILN__OP_ADD_SCALAR);
  cr_assert_float_eq(KILN__F(as, ADD_SCALAR, s), 0.01f, 1e-7);
  th_assert_ok(ctx);

  TH_EXPECT_FAIL(
      ctx, kiln_cross_entropy(th_f32(ctx, KILN_SHAPE(8, 10, 1)), labels, KILN_REDUCTION_MEAN, 0.f),
      KILN_ERR_SHAPE, "kiln_cross_entropy", "[8,10,1]", "[8]");
  TH_EXPECT_FAIL(ctx,
                 kiln_cross_entropy(logits, th_i32(ctx, KILN_SHAPE(7)), KILN_REDUCTION_MEAN, 0.f),
                 KILN_ERR_SHAPE, "kiln_cross_entropy", "[8,10]", "[7]");
  TH_EXPECT_FAIL(ctx,
                 kiln_cross_entropy(logits, th_f32(ctx, KILN_SHAPE(8)), KILN_REDUCTION_MEAN, 0.f),
                 KILN_ERR_DTYPE, "kiln_cross_entropy", "labels are f32");
  TH_EXPECT_FAIL(
      ctx, kiln_cross_entropy(th_i32(ctx, KILN_SHAPE(8, 10)), labels, KILN_REDUCTION_MEAN, 0.f),
      KILN_ERR_DTYPE, "kiln_cross_entropy", "i32");
  TH_EXPECT_FAIL(ctx, kiln_cross_entropy(logits, labels, KILN_REDUCTION_MEAN, 1.5f),
                 KILN_ERR_INVALID, "kiln_cross_entropy", "label_smoothing");
  TH_EXPECT_FAIL(ctx, kiln_cross_entropy(logits, labels, (kiln_reduction)9, 0.f), KILN_ERR_INVALID,
                 "kiln_cross_entropy", "reduction 9");
  th_free_scratch();
  th_ctx_free(ctx);
}

Test(shapes, dtypes) {
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_tensor *a = th_f32(ctx, KILN_SHAPE(3)), *n = th_i32(ctx, KILN_SHAPE(3));
  cr_assert_eq(kiln_dtype_size(KILN_DTYPE_F32), 4u);
  cr_assert_eq(kiln_dtype_size(KILN_DTYPE_BF16), 2u);
  cr_assert_str_eq(kiln_dtype_name(KILN_DTYPE_I32), "i32");
  TH_EXPECT_FAIL(ctx, kiln_add(n, a), KILN_ERR_DTYPE, "kiln_add: input 0 is i32");
  TH_EXPECT_FAIL(ctx, kiln_add(a, n), KILN_ERR_DTYPE, "kiln_add: input 1 is i32");
  TH_EXPECT_FAIL(ctx, kiln_relu(n), KILN_ERR_DTYPE, "kiln_relu", "i32");
  TH_EXPECT_FAIL(ctx, kiln_argmax(n, 0, 0), KILN_ERR_DTYPE, "kiln_argmax", "i32");
  TH_EXPECT_FAIL(ctx, kiln_tensor_new(ctx, KILN_DTYPE_F16, KILN_SHAPE(2)), KILN_ERR_DTYPE,
                 "kiln_tensor_new", "f16");
  float h[2] = {1, 2};
  TH_EXPECT_FAIL(ctx, kiln_tensor_from_host(ctx, KILN_DTYPE_F16, KILN_SHAPE(2), h), KILN_ERR_DTYPE,
                 "kiln_tensor_from_host", "f16");
  TH_EXPECT_FAIL(ctx, kiln_tensor_new(ctx, (kiln_dtype)17, KILN_SHAPE(2)), KILN_ERR_DTYPE,
                 "unknown dtype 17");
  TH_EXPECT_FAIL(ctx, kiln_tensor_new(ctx, KILN_DTYPE_F32, KILN_SHAPE(2, -3)), KILN_ERR_SHAPE,
                 "kiln_tensor_new", "-3");
  kiln_shape seven = {.ndim = 7};
  TH_EXPECT_FAIL(ctx, kiln_tensor_new(ctx, KILN_DTYPE_F32, seven), KILN_ERR_SHAPE, "7 dims");
  /* only persistent f32 tensors can require grad */
  kiln_tensor_set_requires_grad(n, 1);
  TH_ASSERT_ERROR(ctx, KILN_ERR_INVALID, "kiln_tensor_set_requires_grad", "i32");
  cr_assert(!kiln_tensor_requires_grad(n));
  kiln_ctx_clear_error(ctx);
  kiln_tensor_set_requires_grad(kiln_relu(a), 1);
  TH_ASSERT_ERROR(ctx, KILN_ERR_INVALID, "kiln_tensor_set_requires_grad", "intermediate");
  th_free_scratch();
  th_ctx_free(ctx);
}

Test(shapes, accessors_and_shape_strings) {
  kiln_ctx *ctx = th_cpu_ctx();
  cr_assert(!kiln_ctx_has_gpu(ctx));
  kiln_tensor *a = th_f32(ctx, KILN_SHAPE(2, 3, 4));
  cr_assert_eq(kiln_tensor_ctx(a), ctx);
  cr_assert_eq(kiln_tensor_ndim(a), 3);
  cr_assert_eq(kiln_tensor_dim(a, -1), 4);
  cr_assert_eq(kiln_tensor_dim(a, 0), 2);
  cr_assert_eq(kiln_tensor_dim(a, 3), 0, "an axis out of range has size 0");
  cr_assert_eq(kiln_tensor_numel(a), 24);
  cr_assert(kiln_tensor_is_persistent(a));
  kiln_tensor_set_name(a, "alpha");
  cr_assert_str_eq(kiln_tensor_name(a), "alpha");
  char buf[64];
  cr_assert_str_eq(kiln_shape_str(KILN_SHAPE(128, 784), buf, sizeof buf), "[128,784]");
  cr_assert_str_eq(kiln_shape_str(KILN_SCALAR_SHAPE, buf, sizeof buf), "[]");
  cr_assert_str_eq(kiln_shape_str(KILN_SHAPE(1, 2, 3), buf, 5), "[1,2");
  cr_assert_eq(kiln_tensor_numel(kiln_full(ctx, KILN_SCALAR_SHAPE, 1.f)), 1);
  cr_assert_str_eq(kiln_status_name(KILN_ERR_SHAPE), "shape mismatch");
  cr_assert_str_eq(kiln_version(), "0.1.0");
  th_free_scratch();
  th_ctx_free(ctx);
}
