/*
 * test_gpu_whitening.c: kiln_init_whitening on a GPU: the weight it uploads is bitwise the host's
 * filters (nn/init.c), and the convolution of the same images with it, run by kiln, has the
 * channel covariance the eigenvalues predict (the first half uncorrelated, of mean square
 * l_i / (l_i + eps); the second half their negatives), on synthetic images and on the CIFAR-10
 * sample ($KILN_CIFAR10_SAMPLE); a failed call leaves the weight as it was. Without a GPU every
 * test skips, saying why.
 */
#include <math.h>
#include <string.h>

#include "helpers.h"
#include "nn/init.h"

/* airbench's normalisation (CIFAR-10's channel means and standard deviations) */
static const float cifar_mean[3] = {0.4914f, 0.4822f, 0.4465f};
static const float cifar_std[3] = {0.2470f, 0.2435f, 0.2616f};

/* Images (n, H, W, 3) of bytes, smooth along rows and correlated across channels. */
static uint8_t *synth_images(int64_t n, int64_t h, int64_t w, uint64_t seed) {
  uint8_t *p = malloc((size_t)(n * h * w * 3));
  cr_assert_not_null(p);
  th_rng r = {seed};
  for (int64_t b = 0; b < n; b++)
    for (int64_t y = 0; y < h; y++) {
      double walk = 60 + 120 * th_rng_unit(&r);
      for (int64_t x = 0; x < w; x++) {
        walk = fmin(fmax(walk + 24 * (th_rng_unit(&r) - 0.5), 0), 255);
        for (int c = 0; c < 3; c++)
          p[((b * h + y) * w + x) * 3 + c] =
              (uint8_t)fmin(walk * (0.7 + 0.1 * c) + 40 * th_rng_unit(&r), 255);
      }
    }
  return p;
}

/* Whitens images (n, H, W, 3) with a (24, 3, 2, 2) weight on the GPU and checks the weight and
 * the covariance of the convolution's output channels. */
static void check_whitening(kiln_ctx *ctx, const uint8_t *images, int64_t n, int64_t h, int64_t w,
                            float eps) {
  kiln_shape shape = KILN_SHAPE(n, h, w, 3);
  kiln_normalize norm = {.channels = 3, .mean = cifar_mean, .std = cifar_std};
  kiln_tensor *weight = kiln_tensor_new(ctx, KILN_DTYPE_F32, KILN_SHAPE(24, 3, 2, 2));
  cr_assert_not_null(weight, "%s", th_err(ctx));
  cr_assert_eq(kiln_init_whitening(weight, KILN_HOST_U8, shape, images, &norm, eps), KILN_OK, "%s",
               th_err(ctx));
  float want[24 * 12];
  double l[12];
  cr_assert_eq(kiln__whitening_filters(ctx, "test", KILN_HOST_U8, shape, images, &norm, 24, 2, 2,
                                       eps, want, l),
               KILN_OK, "%s", th_err(ctx));
  float *got = th_read(weight);
  cr_assert_eq(memcmp(got, want, sizeof want), 0, "the uploaded weight is not the host's filters");
  free(got);

  /* the images as a data set holds them, convolved by kiln: (n, H - 1, W - 1, 24) */
  int32_t *labels = calloc((size_t)n, sizeof *labels);
  cr_assert_not_null(labels);
  kiln_dataset *ds = kiln_dataset_from_host(ctx, KILN_HOST_U8, shape, images,
                                            (kiln_host_labels){.i32 = labels}, &norm);
  free(labels);
  cr_assert_not_null(ds, "%s", th_err(ctx));
  kiln_tensor *y = kiln_conv2d(kiln_dataset_images(ds), weight, NULL, NULL);
  float *out = th_read(y);
  int64_t pixels = n * (h - 1) * (w - 1);
  double cov[24 * 24] = {0};
  for (int64_t p = 0; p < pixels; p++) {
    const float *v = out + p * 24;
    for (int i = 0; i < 24; i++)
      for (int j = 0; j < 24; j++)
        cov[i * 24 + j] += (double)v[i] * v[j];
  }
  double e = eps == 0.f ? 5e-4 : eps;
  for (int i = 0; i < 24; i++)
    for (int j = 0; j < 24; j++) {
      /* channel 12 + k is -(channel k) */
      double sign = (i < 12) == (j < 12) ? 1.0 : -1.0;
      double want_ij = i % 12 == j % 12 ? sign * l[i % 12] / (l[i % 12] + e) : 0.0;
      double got_ij = cov[i * 24 + j] / (double)pixels;
      cr_assert_lt(fabs(got_ij - want_ij), 1e-4, "channels %d, %d: mean product %.7f, want %.7f", i,
                   j, got_ij, want_ij);
    }
  free(out);

  /* a failed call leaves the weight as it was */
  cr_assert_eq(kiln_init_whitening(weight, KILN_HOST_U8, shape, images, &norm, -1.f),
               KILN_ERR_INVALID);
  kiln_ctx_clear_error(ctx);
  got = th_read(weight);
  cr_assert_eq(memcmp(got, want, sizeof want), 0, "a failed call changed the weight");
  free(got);
  kiln_dataset_free(ds);
  kiln_tensor_free(weight);
}

Test(gpu_whitening, conv_output_of_synthetic_images_is_white) {
  TH_GPU_CTX_EAGER(ctx);
  uint8_t *images = synth_images(64, 16, 16, 21);
  check_whitening(ctx, images, 64, 16, 16, 0.f);
  check_whitening(ctx, images, 64, 16, 16, 1e-2f);
  free(images);
  th_ctx_free(ctx);
}

/* A GPU context ctx and the CIFAR-10 sample's first batch c, or the test skips saying why. */
#define SAMPLE_BATCH(ctx, c)                                                                       \
  const char *dir_ = getenv("KILN_CIFAR10_SAMPLE");                                                \
  if (!dir_ || !*dir_)                                                                             \
    cr_skip_test("KILN_CIFAR10_SAMPLE is not set (it names the directory of the CIFAR-10 "         \
                 "sample, e.g. /work/shared/data/cifar10-sample)");                                \
  TH_GPU_CTX_EAGER(ctx);                                                                           \
  kiln_cifar10 c;                                                                                  \
  cr_assert_eq(kiln_cifar10_read(ctx, dir_, "data_batch_1", &c), KILN_OK, "%s", th_err(ctx))

Test(gpu_whitening, conv_output_of_the_cifar10_sample_is_white) {
  SAMPLE_BATCH(ctx, c);
  check_whitening(ctx, c.images, c.n, 32, 32, 5e-4f);
  kiln_cifar10_free(&c);
  th_ctx_free(ctx);
}

/* kiln_init_whitening_tensor on the first 5000 images of the sample, as a data set holds them:
 * the covariance in f32 on the device gives the host's float64 filters up to f32 rounding, and
 * its filters whiten the images as well. */
Test(gpu_whitening, device_covariance_gives_the_hosts_filters, .timeout = 120) {
  SAMPLE_BATCH(ctx, c);
  int64_t n = c.n < 5000 ? c.n : 5000;
  kiln_dataset *ds = kiln_dataset_from_cifar10(ctx, &c, cifar_mean, cifar_std);
  cr_assert_not_null(ds, "%s", th_err(ctx));
  kiln_tensor *images = kiln_slice(kiln_dataset_images(ds), 0, 0, n, 1);
  kiln_tensor *weight = kiln_tensor_new(ctx, KILN_DTYPE_F32, KILN_SHAPE(24, 3, 2, 2));
  cr_assert_eq(kiln_init_whitening_tensor(weight, images, 5e-4f), KILN_OK, "%s", th_err(ctx));
  float want[24 * 12];
  double l[12];
  kiln_normalize norm = {.channels = 3, .mean = cifar_mean, .std = cifar_std};
  cr_assert_eq(kiln__whitening_filters(ctx, "test", KILN_HOST_U8, KILN_SHAPE(n, 32, 32, 3),
                                       c.images, &norm, 24, 2, 2, 5e-4f, want, l),
               KILN_OK, "%s", th_err(ctx));
  float *got = th_read(weight);
  double worst = 0;
  for (int i = 0; i < 24; i++) {
    double diff = 0, size = 0;
    for (int k = 0; k < 12; k++) {
      diff = fmax(diff, fabs((double)got[i * 12 + k] - want[i * 12 + k]));
      size = fmax(size, fabs((double)want[i * 12 + k]));
    }
    worst = fmax(worst, diff / size);
  }
  cr_log_info("device whitening: worst filter difference %.3g of the filter's largest value "
              "(eigenvalues %.4g .. %.4g)",
              worst, l[0], l[11]);
  cr_assert_lt(worst, 2e-2, "the device's filters differ from the host's by %.3g", worst);
  /* and they whiten: the first half of the output channels uncorrelated, mean square about
   * l / (l + eps) */
  kiln_tensor *y = kiln_conv2d(images, weight, NULL, NULL);
  float *out = th_read(y);
  int64_t pixels = n * 31 * 31;
  double cov[12 * 12] = {0};
  for (int64_t p = 0; p < pixels; p++)
    for (int i = 0; i < 12; i++)
      for (int j = 0; j < 12; j++)
        cov[i * 12 + j] += (double)out[p * 24 + i] * out[p * 24 + j];
  for (int i = 0; i < 12; i++)
    for (int j = 0; j < 12; j++) {
      double want_ij = i == j ? l[i] / (l[i] + 5e-4) : 0.0, got_ij = cov[i * 12 + j] / pixels;
      cr_assert_lt(fabs(got_ij - want_ij), 1e-2, "channels %d, %d: mean product %.5f, want %.5f", i,
                   j, got_ij, want_ij);
    }
  free(out);
  free(got);
  kiln_tensor_free(weight);
  kiln_dataset_free(ds);
  kiln_cifar10_free(&c);
  th_ctx_free(ctx);
}
