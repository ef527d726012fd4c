/*
 * test_gpu_loader.c: a loader whose batch is larger than its data set, on the GPU, as PyTorch's
 * DataLoader: with drop_last 0 one batch holding every record once (in order, or shuffled) with
 * its label, which trains as any batch does in graph mode; with drop_last 1 no batch.
 */
#include <math.h>
#include <string.h>

#include "helpers.h"

#define N 5 /* records */

/* N images of 2x2 pixels: pixel 0 is the record's index, pixel 3 is 255; label index + 3. */
static kiln_dataset *small_dataset(kiln_ctx *ctx) {
  uint8_t images[N * 4] = {0}, labels[N];
  for (int i = 0; i < N; i++) {
    images[i * 4] = (uint8_t)i;
    images[i * 4 + 3] = 255;
    labels[i] = (uint8_t)(i + 3);
  }
  kiln_mnist m = {.n = N, .rows = 2, .cols = 2, .images = images, .labels = labels};
  kiln_dataset *ds = kiln_dataset_from_mnist(ctx, &m, 0.f, 1.f);
  cr_assert_not_null(ds, "%s", kiln_ctx_error(ctx));
  return ds;
}

Test(gpu_loader, a_batch_larger_than_the_data_set_holds_it_all) {
  TH_GPU_CTX(ctx);
  kiln_dataset *ds = small_dataset(ctx);
  for (int shuffle = 0; shuffle < 2; shuffle++) {
    kiln_loader *l =
        kiln_loader_new(ds, &(kiln_loader_options){.batch = 64, .shuffle = shuffle, .seed = 11});
    cr_assert_not_null(l, "%s", kiln_ctx_error(ctx));
    cr_assert_eq(kiln_loader_batches(l), 1);
    for (int epoch = 0; epoch < 2; epoch++) {
      kiln_loader_start(l, epoch);
      kiln_step_begin(ctx);
      kiln_tensor *x, *y;
      cr_assert(kiln_loader_next(l, &x, &y), "%s", kiln_ctx_error(ctx));
      cr_assert_eq(kiln_tensor_dim(x, 0), N);
      cr_assert_eq(kiln_tensor_dim(y, 0), N);
      cr_assert_eq(kiln_step_end(ctx), KILN_OK, "%s", kiln_ctx_error(ctx));
      float *xv = th_read(x);
      int32_t *yv = th_read_i32(y);
      int seen[N] = {0};
      for (int i = 0; i < N; i++) {
        int idx = (int)lroundf(xv[i * 4] * 255.f);
        cr_assert(idx >= 0 && idx < N, "row %d holds record %d", i, idx);
        cr_assert(shuffle || idx == i, "without shuffling, row %d holds record %d", i, idx);
        cr_assert_float_eq(xv[i * 4 + 3], 1.f, 1e-6);
        cr_assert_eq(yv[i], idx + 3, "labels follow their images");
        seen[idx]++;
      }
      for (int i = 0; i < N; i++)
        cr_assert_eq(seen[i], 1, "record %d seen %d times", i, seen[i]);
      free(xv);
      free(yv);
      kiln_step_begin(ctx);
      cr_assert_not(kiln_loader_next(l, &x, &y), "one batch an epoch");
      cr_assert_eq(kiln_step_end(ctx), KILN_OK, "%s", kiln_ctx_error(ctx));
    }
    kiln_loader_free(l);
  }
  /* drop_last: the only batch is partial, so there is none */
  kiln_loader *l = kiln_loader_new(
      ds, &(kiln_loader_options){.batch = 64, .shuffle = 1, .seed = 11, .drop_last = 1});
  cr_assert_not_null(l, "%s", kiln_ctx_error(ctx));
  cr_assert_eq(kiln_loader_batches(l), 0);
  kiln_step_begin(ctx);
  kiln_tensor *x, *y;
  cr_assert_not(kiln_loader_next(l, &x, &y));
  cr_assert_eq(kiln_step_end(ctx), KILN_OK, "%s", kiln_ctx_error(ctx));
  kiln_loader_free(l);
  kiln_dataset_free(ds);
  th_ctx_free(ctx);
}

Test(gpu_loader, the_whole_set_batch_trains_in_graph_mode) {
  TH_GPU_CTX(ctx);
  kiln_dataset *ds = small_dataset(ctx);
  kiln_loader *l =
      kiln_loader_new(ds, &(kiln_loader_options){.batch = 1000, .shuffle = 1, .seed = 3});
  kiln_params *p = kiln_params_new(ctx);
  kiln_linear fc;
  cr_assert_eq(kiln_linear_init(&fc, p, &(kiln_linear_options){.name = "fc", .in = 4, .out = 10}),
               KILN_OK, "%s", kiln_ctx_error(ctx));
  kiln_sgd_options so = kiln_sgd_defaults(0.5f);
  kiln_optim *opt = kiln_sgd_new(p, &so);
  cr_assert(l && opt, "%s", kiln_ctx_error(ctx));
  float first = 0.f, last = 0.f;
  for (int epoch = 0; epoch < 20; epoch++) {
    kiln_loader_start(l, epoch);
    kiln_step_begin(ctx);
    kiln_tensor *x, *y;
    cr_assert(kiln_loader_next(l, &x, &y));
    kiln_tensor *loss =
        kiln_cross_entropy(kiln_linear_forward(&fc, kiln_flatten(x)), y, KILN_REDUCTION_MEAN, 0.f);
    kiln_optim_zero_grad(opt);
    kiln_backward(loss);
    kiln_optim_step(opt);
    cr_assert_eq(kiln_step_end(ctx), KILN_OK, "%s", kiln_ctx_error(ctx));
    last = kiln_tensor_item(loss);
    cr_assert(isfinite(last), "epoch %d: loss %g", epoch, last);
    if (epoch == 0) first = last;
  }
  /* the classes are nearly alike to a linear layer: the loss falls towards ln 5 (the labels'
   * prior), from about ln 10 */
  cr_assert_lt(last, 0.85f * first, "the loss falls from %g (to %g)", first, last);
  kiln_exec_stats s;
  kiln_stats(ctx, &s);
  cr_assert_eq(s.graph_captures, 1, "every epoch's one batch is the same step");
  cr_assert_eq(s.graph_replays, 19);
  kiln_optim_free(opt);
  kiln_params_free(p);
  kiln_loader_free(l);
  kiln_dataset_free(ds);
  th_ctx_free(ctx);
}

/* A bf16 data set: its images are the f32 ones rounded to nearest even, a loader's batches are
 * bf16, a bf16 autocast convolution of them equals the f32 set's bitwise, and back to f32 the
 * values are the bf16 ones exactly. */
Test(gpu_loader, a_bf16_data_set_feeds_autocast_products_the_same_values) {
  TH_GPU_CTX_EAGER(ctx);
  enum { M = 64, S = 6 };
  float *host = malloc(sizeof(float) * M * S * S * 3);
  cr_assert_not_null(host);
  th_fill(host, M * S * S * 3, 17, -2.f, 2.f);
  int32_t lab[M];
  for (int i = 0; i < M; i++)
    lab[i] = i % 10;
  kiln_dataset *a = kiln_dataset_from_host(ctx, KILN_HOST_F32, KILN_SHAPE(M, S, S, 3), host,
                                           (kiln_host_labels){.i32 = lab}, NULL);
  kiln_dataset *b = kiln_dataset_from_host(ctx, KILN_HOST_F32, KILN_SHAPE(M, S, S, 3), host,
                                           (kiln_host_labels){.i32 = lab}, NULL);
  cr_assert(a && b, "%s", th_err(ctx));
  cr_assert_eq(kiln_dataset_set_dtype(b, KILN_DTYPE_BF16), KILN_OK, "%s", th_err(ctx));
  cr_assert_eq(kiln_tensor_dtype(kiln_dataset_images(b)), KILN_DTYPE_BF16);
  uint16_t *bits = malloc(sizeof(uint16_t) * M * S * S * 3);
  cr_assert_not_null(bits);
  cr_assert_eq(kiln_tensor_to_host(kiln_dataset_images(b), bits, sizeof(uint16_t) * M * S * S * 3),
               KILN_OK);
  for (int i = 0; i < M * S * S * 3; i++)
    cr_assert_eq(bits[i], kiln_bf16_from_f32(host[i]), "value %d", i);
  kiln_tensor *w = th_rand(ctx, KILN_SHAPE(8, 3, 3, 3), 5, -0.5f, 0.5f, NULL);
  kiln_loader *la =
                  kiln_loader_new(a, &(kiln_loader_options){.batch = 16, .shuffle = 1, .seed = 3}),
              *lb =
                  kiln_loader_new(b, &(kiln_loader_options){.batch = 16, .shuffle = 1, .seed = 3});
  cr_assert(la && lb);
  kiln_tensor *xa, *ya, *xb, *yb;
  cr_assert(kiln_loader_next(la, &xa, &ya) && kiln_loader_next(lb, &xb, &yb));
  cr_assert_eq(kiln_tensor_dtype(xb), KILN_DTYPE_BF16);
  kiln_autocast_begin(ctx, KILN_DTYPE_BF16);
  kiln_tensor *ca = kiln_conv2d(xa, w, NULL, NULL), *cb = kiln_conv2d(xb, w, NULL, NULL);
  kiln_autocast_end(ctx);
  float *va = th_read(kiln_cast(ca, KILN_DTYPE_F32)), *vb = th_read(kiln_cast(cb, KILN_DTYPE_F32));
  int64_t nc = kiln_tensor_numel(ca);
  cr_assert_eq(memcmp(va, vb, sizeof(float) * (size_t)nc), 0,
               "the bf16 set's batch computes otherwise");
  free(va);
  free(vb);
  /* back to f32: the bf16 values, exactly */
  cr_assert_eq(kiln_dataset_set_dtype(b, KILN_DTYPE_F32), KILN_OK, "%s", th_err(ctx));
  float *back = th_read(kiln_dataset_images(b));
  for (int i = 0; i < M * S * S * 3; i++)
    cr_assert_eq(back[i], kiln_bf16_to_f32(bits[i]), "value %d", i);
  free(back);
  free(bits);
  free(host);
  kiln_loader_free(la);
  kiln_loader_free(lb);
  kiln_tensor_free(w);
  kiln_dataset_free(a);
  kiln_dataset_free(b);
  th_ctx_free(ctx);
}

/* Three ranks' loaders over one data set of 10, the same seed: each takes 4 samples an epoch (the
 * order padded by its first 2), every sample is in some rank's shard, the shards differ from
 * epoch to epoch, and each batch's rows are the data set's rows of its indices. */
Test(gpu_loader, ranks_shard_each_epoch_as_distributed_sampler) {
  TH_GPU_CTX_EAGER(ctx);
  float x[10];
  int32_t y[10];
  for (int i = 0; i < 10; i++)
    x[i] = (float)(100 + i), y[i] = i % 3;
  kiln_dataset *ds = kiln_dataset_from_host(ctx, KILN_HOST_F32, KILN_SHAPE(10, 1), x,
                                            (kiln_host_labels){.i32 = y}, NULL);
  cr_assert_not_null(ds, "%s", th_err(ctx));
  int32_t shard0[2][4]; /* rank 0's samples in each epoch */
  for (int epoch = 0; epoch < 2; epoch++) {
    int seen[10] = {0}, total = 0;
    for (int rank = 0; rank < 3; rank++) {
      kiln_loader *l = kiln_loader_new(
          ds,
          &(kiln_loader_options){.batch = 3, .shuffle = 1, .seed = 9, .rank = rank, .world = 3});
      cr_assert_not_null(l, "%s", th_err(ctx));
      kiln_loader_start(l, epoch);
      kiln_tensor *bx, *by;
      while (kiln_loader_next(l, &bx, &by)) {
        int32_t *idx = th_read_i32(kiln_loader_indices(l));
        float *v = th_read(bx);
        int32_t *lab = th_read_i32(by);
        for (int64_t k = 0; k < kiln_tensor_dim(bx, 0); k++) {
          cr_assert(idx[k] >= 0 && idx[k] < 10);
          cr_assert_eq(v[k], x[idx[k]], "rank %d: row %d of the batch", rank, (int)k);
          cr_assert_eq(lab[k], y[idx[k]]);
          seen[idx[k]]++;
          if (rank == 0) shard0[epoch][total] = idx[k];
          total++;
        }
        free(idx), free(v), free(lab);
      }
      kiln_loader_free(l);
    }
    cr_assert_eq(total, 12, "3 ranks of 4 samples");
    int twice = 0;
    for (int i = 0; i < 10; i++) {
      cr_assert(seen[i] == 1 || seen[i] == 2, "sample %d seen %d times", i, seen[i]);
      twice += seen[i] == 2;
    }
    cr_assert_eq(twice, 2, "the padding repeats two samples");
  }
  cr_assert_neq(memcmp(shard0[0], shard0[1], sizeof shard0[0]), 0, "rank 0's shard did not change");
  kiln_dataset_free(ds);
  th_ctx_free(ctx);
}
