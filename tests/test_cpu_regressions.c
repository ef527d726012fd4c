/*
 * test_cpu_regressions.c: the library bugs found while the tests were written. Each test says
 * what was wrong (file, function, the fix) and fails if it comes back. No GPU needed.
 */
#include <string.h>

#include "fusion/fusion.h"
#include "idx.h"
#include "inspect.h"

TestSuite(regressions, .fini = th_remove_tmpdirs);

/*
 * Regression (kiln_tensor_free, now runtime/transfer.c, fixed): freeing a persistent tensor flushes
 * the pending trace even on a no-GPU context, where a flush is an error, so the context fails with
 * "kiln_flush: the context has no GPU ..." and every later op records nothing. kiln_step_begin
 * guards its flush with ctx->has_gpu; kiln_tensor_free should do the same.
 */
Test(regressions, tensor_free_fails_a_no_gpu_context) {
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_tensor *a = th_f32(ctx, KILN_SHAPE(3)), *tmp = th_new(ctx, KILN_DTYPE_F32, KILN_SHAPE(3));
  kiln_relu(a);
  kiln_tensor_free(tmp);
  cr_assert_null(kiln_ctx_error(ctx), "freeing an unrelated tensor failed the context: %s",
                 kiln_ctx_error(ctx));
  cr_assert_not_null(kiln_exp(a), "the context records nothing after a kiln_tensor_free");
  th_free_scratch();
  th_ctx_free(ctx);
}

/*
 * Regression (core/tensor.c, kiln__is_contiguous, fixed): kiln__contiguous_strides counts a
 * zero-sized dim as 1 but kiln__is_contiguous multiplies by the 0, so a fresh (3,0) tensor is "not
 * contiguous": kiln_tensor_from_host then fails for it ("the target must be a persistent contiguous
 * tensor") and a reshape of it copies. Fix: in kiln__is_contiguous, s *= shape[i] > 0 ? shape[i] :
 * 1 (or treat any tensor with no elements as contiguous).
 */
Test(regressions, empty_tensors_are_not_contiguous) {
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_tensor *t = th_f32(ctx, KILN_SHAPE(3, 0));
  cr_assert(kiln_tensor_is_contiguous(t), "a fresh (3,0) tensor reports non-contiguous strides");
  float dummy = 0;
  kiln_tensor *h = kiln_tensor_from_host(ctx, KILN_DTYPE_F32, KILN_SHAPE(3, 0), &dummy);
  cr_assert_not_null(h, "kiln_tensor_from_host of an empty tensor: %s", kiln_ctx_error(ctx));
  int32_t n0 = th_tlen(ctx);
  th_assert_shape(kiln_reshape(t, KILN_SHAPE(0, 3)), KILN_SHAPE(0, 3));
  TH_ASSERT_OPS_FROM(ctx, n0, KILN__OP_RESHAPE);
  kiln_tensor_free(h);
  th_free_scratch();
  th_ctx_free(ctx);
}

/*
 * Regression (core/ops.c, kiln_slice, fixed): the length (end - start + step - 1) / step overflows
 * int64 (undefined behaviour) for a large step, so kiln_slice(v, 0, 0, 5, INT64_MAX) has 0 elements
 * here instead of 1. Fix: len = end > start ? (end - start - 1) / step + 1 : 0.
 */
Test(regressions, slice_with_a_huge_step) {
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_tensor *v = th_f32(ctx, KILN_SHAPE(5));
  kiln_tensor *s = kiln_slice(v, 0, 0, 5, INT64_MAX);
  cr_assert_not_null(s, "%s", kiln_ctx_error(ctx));
  cr_assert_eq(kiln_tensor_dim(s, 0), 1, "slice [0:5:INT64_MAX] of 5 has %lld elements",
               (long long)kiln_tensor_dim(s, 0));
  th_free_scratch();
  th_ctx_free(ctx);
}

/*
 * Regression (autograd/rules.c, kiln__grad_slice, fixed): the backward of a stepped slice
 * interleaves zeros by inserting a dim, which a 6-D tensor (KILN_MAX_DIMS) has no room for: it
 * writes us.d[6], past the end of kiln_shape.d, and kiln_reshape then fails with "7 dims", so
 * kiln_backward fails. Fix: for a 6-D input merge the dims before the sliced axis (or the ones
 * after it) first, or give slice a scatter backward op.
 */
Test(regressions, backward_of_a_stepped_slice_of_a_6d_tensor) {
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_tensor *w = th_param(ctx, KILN_SHAPE(2, 2, 2, 2, 2, 4));
  kiln_tensor *loss = th_sum_all(kiln_slice(w, 5, 0, 4, 2));
  cr_assert_not_null(loss);
  kiln_status s = kiln_backward(loss);
  cr_assert_eq(s, KILN_OK, "kiln_backward: %s", kiln_ctx_error(ctx));
  cr_assert_not_null(kiln_tensor_grad(w));
  th_free_scratch();
  th_ctx_free(ctx);
}

/*
 * Regression (autograd/rules.c, kiln__grad_slice, fixed): the gradient of a slice of a bf16 tensor
 * pads the sliced gradient with f32 zeros, and kiln_concat refuses the mix ("input 1 is ... bf16,
 * input 0 ... f32"), so kiln_backward fails through any bf16 slice that takes a gradient (an
 * autocast region's view of a parameter, stepped or not). Fix: zeros in the gradient's dtype.
 */
Test(regressions, backward_of_a_slice_of_a_bf16_tensor) {
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_tensor *w = th_param(ctx, KILN_SHAPE(4, 6));
  kiln_tensor *h = kiln_cast(w, KILN_DTYPE_BF16);
  kiln_tensor *s = kiln_slice(kiln_slice(h, 1, 1, 5, 1), 0, 0, 4, 2);
  kiln_tensor *loss = th_sum_all(kiln_cast(s, KILN_DTYPE_F32));
  cr_assert_not_null(loss, "%s", kiln_ctx_error(ctx));
  cr_assert_eq(kiln_backward(loss), KILN_OK, "kiln_backward: %s", kiln_ctx_error(ctx));
  th_assert_shape(kiln_tensor_grad(w), KILN_SHAPE(4, 6));
  th_free_scratch();
  th_ctx_free(ctx);
}

/*
 * Regression (core/ops.c, split_sum, fixed): a bf16 sum over the leading axes of a tall, narrow
 * tensor (a convolution's bias gradient over a batch's pixels: 1,922,000 x 24 in the CIFAR-10
 * example's first epochs) ran as one kernel with a block per output, 24 blocks each reading a
 * column with a stride, 3.8 ms a step on the H100; only f32 sums were split. Fix: bf16 ones are
 * split too, their partial sums in f32 (no rounding between the steps). Planned and compiled:
 * no sum reads more than 1024 values an output, and the first writes f32.
 */
Test(regressions, bf16_sums_of_tall_tensors_split) {
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_step_begin(ctx);
  kiln_tensor *x = kiln_cast(th_f32(ctx, KILN_SHAPE(64, 31, 31, 24)), KILN_DTYPE_BF16);
  kiln_tensor *s = kiln_sum(x, KILN_AXES(0, 1, 2), 0);
  cr_assert(s && kiln_tensor_dtype(s) == KILN_DTYPE_BF16, "%s", kiln_ctx_error(ctx));
  int sums = 0;
  for (int32_t j = 0; j < ctx->trace.n; j++) {
    const kiln__node *n = &ctx->trace.nodes[j];
    if (n->op != KILN__OP_SUM) continue;
    int64_t per = kiln_tensor_numel(n->in[0]) / kiln_tensor_numel(n->out);
    cr_assert_leq(per, 1024, "sum #%d reads %lld values an output", j, (long long)per);
    if (sums++ == 0) cr_assert_eq(n->out->dtype, KILN_DTYPE_F32, "the partial sums are f32");
  }
  cr_assert_geq(sums, 2, "%d sums", sums);
  kiln__program pg;
  cr_assert(kiln__program_build(ctx, ctx->trace.done, ctx->trace.n, &pg), "%s",
            kiln_ctx_error(ctx));
  kiln__program_free(&pg);
  cr_assert_eq(kiln_step_end(ctx), KILN_OK, "%s", kiln_ctx_error(ctx));
  th_free_scratch();
  th_ctx_free(ctx);
}

/*
 * Regression (fusion/plan.c, can_batch, fixed): consecutive updates of one kind run as one
 * multi-tensor launch unless a later one reads or writes what an earlier one writes; a later one
 * that writes what an earlier one reads was let in, so kiln_assign(a, b) then kiln_assign(b, c)
 * ran in one launch, whose threads may write b before others read it (a then holds c's values).
 * Fix: the later update must not write anything the group reads either.
 */
Test(regressions, an_update_writing_what_an_earlier_one_reads_is_not_batched) {
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_tensor *t[3];
  for (int k = 0; k < 3; k++)
    t[k] = th_f32(ctx, KILN_SHAPE(64));
  kiln_step_begin(ctx);
  cr_assert_eq(kiln_assign(t[0], t[1]), KILN_OK, "%s", kiln_ctx_error(ctx));
  cr_assert_eq(kiln_assign(t[1], t[2]), KILN_OK, "%s", kiln_ctx_error(ctx));
  kiln__program pg;
  cr_assert(kiln__program_build(ctx, ctx->trace.done, ctx->trace.n, &pg), "%s",
            kiln_ctx_error(ctx));
  int groups = 0;
  for (int g = 0; g < pg.plan.ng; g++)
    groups += th_node(ctx, pg.plan.members[pg.plan.g[g].first])->op == KILN__OP_ASSIGN;
  cr_assert_eq(groups, 2, "the two assignments in %d launches", groups);
  kiln__program_free(&pg);
  cr_assert_eq(kiln_step_end(ctx), KILN_OK, "%s", kiln_ctx_error(ctx));
  th_free_scratch();
  th_ctx_free(ctx);
}

/*
 * Regression (data/mnist.c, read_idx, fixed): bytes appended after the gzip stream (a .gz file with
 * trailing garbage) are accepted: zlib's gzread silently ignores non-gzip data after a member, so
 * the "trailing bytes" check never sees them. Fix: decode with inflate() (windowBits 16 +
 * MAX_WBITS) and after Z_STREAM_END require the rest of the file to be empty (or another gzip
 * member).
 */
Test(regressions, mnist_accepts_garbage_after_the_gzip_stream) {
  char dir[256], path[1200];
  th_idx_synthetic(dir, sizeof dir, true);
  snprintf(path, sizeof path, "%s/" TH_IDX_IMAGES ".gz", dir);
  FILE *f = fopen(path, "ab");
  cr_assert_not_null(f);
  cr_assert_eq(fwrite("garbage after the stream", 1, 24, f), 24u);
  cr_assert_eq(fclose(f), 0);
  TH_EXPECT_MNIST_ERROR(dir, KILN_ERR_FORMAT, TH_IDX_IMAGES ".gz", "trailing");
  th_remove_dir(dir);
}

/*
 * Regression (data/mnist.c, kiln_mnist_read, fixed): *out is zeroed only after the context and dir
 * checks, so on a context that has already failed (or with a NULL dir) the caller's struct keeps
 * whatever it held, and a caller that frees it on failure frees garbage. Fix: memset(out, 0, sizeof
 * *out) first, whenever out is not NULL.
 */
Test(regressions, mnist_struct_not_zeroed_on_a_failed_context) {
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_tensor *a = th_f32(ctx, KILN_SHAPE(2));
  cr_assert_null(kiln_add(a, th_f32(ctx, KILN_SHAPE(3))));
  kiln_mnist m;
  memset(&m, 0xab, sizeof m);
  cr_assert_eq(kiln_mnist_read(ctx, "/nonexistent", "train", &m), KILN_ERR_SHAPE);
  th_assert_mnist_zeroed(&m);
  kiln_ctx_clear_error(ctx);
  memset(&m, 0xab, sizeof m);
  cr_assert_eq(kiln_mnist_read(ctx, NULL, "train", &m), KILN_ERR_INVALID);
  th_assert_mnist_zeroed(&m);
  th_free_scratch();
  th_ctx_free(ctx);
}
