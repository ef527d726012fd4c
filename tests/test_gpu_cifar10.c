/*
 * test_gpu_cifar10.c: CIFAR-10 data sets on the GPU (kiln_dataset_from_cifar10): images uploaded
 * as (n, 32, 32, 3) f32 in channels-last order, each value (pixel / 255 - mean[c]) / std[c] of
 * its own channel, or pixel / 255 without a normalisation, labels as i32; and the sample
 * ($KILN_CIFAR10_SAMPLE) normalised by its own statistics (kiln_image_stats), which then have
 * mean 0 and standard deviation 1 per channel. Skipped, saying why, without a GPU.
 */
#include <math.h>
#include <string.h>

#include "helpers.h"

#define N 3 /* records */

/* N records whose channel c of pixel p of record i is a value of its own. */
static void synthetic(kiln_cifar10 *c, uint8_t *images, uint8_t *labels) {
  for (int i = 0; i < N; i++) {
    labels[i] = (uint8_t)(9 - 4 * i);
    for (int p = 0; p < 1024; p++)
      for (int ch = 0; ch < 3; ch++)
        images[(i * 1024 + p) * 3 + ch] = (uint8_t)(i * 50 + p * 7 + ch * 90);
  }
  *c = (kiln_cifar10){.n = N, .images = images, .labels = labels};
}

/* Asserts the data set's values against c's bytes, normalised by mean and std (NULL: none). */
static void assert_uploaded(kiln_dataset *ds, const kiln_cifar10 *c, const float *mean,
                            const float *std) {
  cr_assert_eq(kiln_dataset_size(ds), c->n);
  kiln_shape s = kiln_tensor_shape(kiln_dataset_images(ds));
  cr_assert_eq(s.ndim, 4);
  cr_assert(s.d[0] == c->n && s.d[1] == 32 && s.d[2] == 32 && s.d[3] == 3,
            "images of shape (%lld, %lld, %lld, %lld)", (long long)s.d[0], (long long)s.d[1],
            (long long)s.d[2], (long long)s.d[3]);
  float *x = th_read(kiln_dataset_images(ds));
  int32_t *y = th_read_i32(kiln_dataset_labels(ds));
  for (int64_t i = 0; i < c->n; i++) {
    cr_assert_eq(y[i], c->labels[i], "label %lld", (long long)i);
    for (int64_t k = 0; k < 3072; k++) {
      int ch = (int)(k % 3);
      double want = c->images[i * 3072 + k] / 255.0;
      if (mean) want = (want - mean[ch]) / std[ch];
      double got = x[i * 3072 + k];
      cr_assert(fabs(got - want) <= 1e-5 + 1e-5 * fabs(want),
                "record %lld, pixel (%lld, %lld), channel %d: %g, expected %g", (long long)i,
                (long long)(k / 3 / 32), (long long)(k / 3 % 32), ch, got, want);
    }
  }
  free(x);
  free(y);
}

Test(gpu_cifar10, normalised_per_channel_in_hwc_order) {
  TH_GPU_CTX(ctx);
  uint8_t images[N * 3072], labels[N];
  kiln_cifar10 c;
  synthetic(&c, images, labels);
  const float mean[3] = {0.25f, 0.5f, 0.75f}, std[3] = {0.5f, 0.125f, 2.f};
  kiln_dataset *ds = kiln_dataset_from_cifar10(ctx, &c, mean, std);
  cr_assert_not_null(ds, "%s", th_err(ctx));
  assert_uploaded(ds, &c, mean, std);
  kiln_dataset_free(ds);
  ds = kiln_dataset_from_cifar10(ctx, &c, NULL, NULL);
  cr_assert_not_null(ds, "%s", th_err(ctx));
  assert_uploaded(ds, &c, NULL, NULL);
  kiln_dataset_free(ds);
  th_ctx_free(ctx);
}

Test(gpu_cifar10, the_sample_normalised_by_its_statistics) {
  const char *dir = getenv("KILN_CIFAR10_SAMPLE");
  if (!dir || !*dir)
    cr_skip_test("KILN_CIFAR10_SAMPLE is not set (it names the directory of the CIFAR-10 "
                 "sample, e.g. /work/shared/data/cifar10-sample)");
  TH_GPU_CTX(ctx);
  kiln_cifar10 c;
  cr_assert_eq(kiln_cifar10_read(ctx, dir, "data_batch_1", &c), KILN_OK, "%s", th_err(ctx));
  float mean[3], std[3];
  cr_assert_eq(
      kiln_image_stats(ctx, KILN_HOST_U8, KILN_SHAPE(c.n, 32, 32, 3), c.images, 3, mean, std),
      KILN_OK, "%s", th_err(ctx));
  for (int ch = 0; ch < 3; ch++)
    cr_assert(mean[ch] > 0.3f && mean[ch] < 0.6f && std[ch] > 0.15f && std[ch] < 0.35f,
              "channel %d: mean %g, std %g", ch, mean[ch], std[ch]);
  kiln_dataset *ds = kiln_dataset_from_cifar10(ctx, &c, mean, std);
  cr_assert_not_null(ds, "%s", th_err(ctx));
  assert_uploaded(ds, &c, mean, std);
  /* after normalisation each channel has mean 0 and standard deviation 1 */
  float *x = th_read(kiln_dataset_images(ds));
  double sum[3] = {0}, sq[3] = {0};
  int64_t total = c.n * 3072;
  for (int64_t k = 0; k < total; k++) {
    sum[k % 3] += x[k];
    sq[k % 3] += (double)x[k] * x[k];
  }
  for (int ch = 0; ch < 3; ch++) {
    double m = sum[ch] / (double)(total / 3), v = sq[ch] / (double)(total / 3) - m * m;
    cr_assert(fabs(m) < 1e-4 && fabs(v - 1.0) < 1e-3, "channel %d: mean %g, variance %g", ch, m, v);
  }
  free(x);
  kiln_dataset_free(ds);
  kiln_cifar10_free(&c);
  th_ctx_free(ctx);
}
