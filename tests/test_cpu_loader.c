/*
 * test_cpu_loader.c: a loader's shard of each epoch for one of several processes
 * (kiln_loader_options' rank and world), without a GPU: the options are checked, and every rank
 * gets ceil(n / world) samples an epoch in batches of its own. The indices themselves are
 * data/shard.c's (test_cpu_dist.c) and test_gpu_loader.c's.
 */
#include "inspect.h"

/* A data set of n one-value samples. */
static kiln_dataset *tiny(kiln_ctx *ctx, int n) {
  float x[64];
  int32_t y[64] = {0};
  cr_assert_leq(n, 64);
  for (int i = 0; i < n; i++)
    x[i] = (float)i;
  kiln_dataset *ds = kiln_dataset_from_host(ctx, KILN_HOST_F32, KILN_SHAPE(n, 1), x,
                                            (kiln_host_labels){.i32 = y}, NULL);
  cr_assert_not_null(ds, "%s", th_err(ctx));
  return ds;
}

Test(loader, a_rank_takes_ceil_n_over_world_samples_an_epoch) {
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_dataset *ds = tiny(ctx, 10);
  for (int rank = 0; rank < 3; rank++) {
    kiln_loader *l = kiln_loader_new(
        ds, &(kiln_loader_options){.batch = 3, .shuffle = 1, .seed = 5, .rank = rank, .world = 3});
    cr_assert_not_null(l, "%s", th_err(ctx));
    cr_assert_eq(kiln_loader_batches(l), 2, "4 samples a rank: a batch of 3 and one of 1");
    int64_t sizes[2];
    kiln_step_begin(ctx);
    for (int b = 0; b < 2; b++) {
      kiln_tensor *x, *y;
      cr_assert(kiln_loader_next(l, &x, &y), "%s", th_err(ctx));
      sizes[b] = kiln_tensor_dim(x, 0);
    }
    kiln_tensor *x, *y;
    cr_assert_not(kiln_loader_next(l, &x, &y), "a third batch");
    kiln_step_end(ctx);
    cr_assert(sizes[0] == 3 && sizes[1] == 1);
    kiln_loader_free(l);
  }
  /* drop_last drops the rank's partial batch; more ranks than samples: one each, padded */
  kiln_loader *l = kiln_loader_new(
      ds, &(kiln_loader_options){.batch = 3, .drop_last = 1, .rank = 2, .world = 3});
  cr_assert_eq(kiln_loader_batches(l), 1);
  kiln_loader_free(l);
  l = kiln_loader_new(ds, &(kiln_loader_options){.batch = 4, .rank = 11, .world = 12});
  cr_assert_eq(kiln_loader_batches(l), 1);
  kiln_loader_free(l);
  /* one process: every sample */
  l = kiln_loader_new(ds, &(kiln_loader_options){.batch = 4});
  cr_assert_eq(kiln_loader_batches(l), 3);
  kiln_loader_free(l);
  kiln_dataset_free(ds);
  th_ctx_free(ctx);
}

Test(loader, rank_and_world_are_checked) {
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_dataset *ds = tiny(ctx, 4);
  const kiln_loader_options bad[] = {{.batch = 2, .rank = 3, .world = 3},
                                     {.batch = 2, .rank = -1, .world = 2},
                                     {.batch = 2, .world = -2},
                                     {.batch = 2, .rank = 1}};
  const char *why[] = {"rank 3 of world 3", "rank -1 of world 2", "rank 0 of world -2",
                       "rank 1 of world 0"};
  for (int k = 0; k < 4; k++) {
    cr_assert_null(kiln_loader_new(ds, &bad[k]), "case %d accepted", k);
    TH_ASSERT_ERROR(ctx, KILN_ERR_INVALID, "kiln_loader_new", why[k]);
    kiln_ctx_clear_error(ctx);
  }
  kiln_dataset_free(ds);
  th_ctx_free(ctx);
}
