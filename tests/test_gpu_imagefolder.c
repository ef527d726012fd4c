/*
 * test_gpu_imagefolder.c: the image loader on the GPU. The resize kernel (kiln__resize_crop)
 * against the float64 reference of PIL's antialiased bilinear filter (imgfolder.c), shrinking and
 * enlarging, flipped, with the output a window of the resized image and only part of the source
 * staged, in f32 and bf16. Whole epochs of a folder of PNGs through the loader: evaluation
 * batches (resize and centre crop) against the reference from the decoded files, the same bits
 * unfused, fused and replayed as a step graph; training batches whose crop is the whole image
 * are that image resized, flipped for about half of them. Without a GPU every test skips.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "helpers.h"
#include "imgfolder.h"
#include "internal.h"

TestSuite(gpu_imagefolder, .fini = th_remove_tmpdirs);

static const float mean[3] = {0.485f, 0.456f, 0.406f}, stdev[3] = {0.229f, 0.224f, 0.225f};

/* One image of the kernel test: its source, how it is resized, the output's window, the flip,
 * and the staged rows [r0, r1) and columns [c0, c1) (all the filter reads, and more). */
typedef struct rz_case {
  int rows, cols, rrows, rcols, oy, ox, flip, r0, r1, c0, c1;
} rz_case;

static void kernel_case(kiln_dtype dt) {
  TH_GPU_CTX(ctx);
  enum { N = 6, OH = 24, OW = 20 };
  const rz_case cs[N] = {
      {96, 80, 24, 20, 0, 0, 0, 0, 96, 0, 80},   /* shrunk 4x, whole source staged */
      {12, 9, 24, 20, 0, 0, 1, 0, 12, 0, 9},     /* enlarged, flipped */
      {50, 70, 28, 39, 2, 10, 0, 0, 50, 14, 70}, /* resize then a window, columns cut */
      {70, 50, 39, 28, 8, 4, 1, 10, 64, 4, 50},  /* the same on its side, rows cut, flipped */
      {24, 20, 24, 20, 0, 0, 0, 0, 24, 0, 20},   /* the identity */
      {31, 200, 24, 155, 0, 60, 0, 0, 31, 70, 140},
  };
  th_rng rng = {.s = 42};
  int64_t total = 0;
  for (int n = 0; n < N; n++)
    total += (int64_t)(cs[n].r1 - cs[n].r0) * (cs[n].c1 - cs[n].c0) * 3;
  int64_t words = (total + 3) / 4;
  uint8_t *staged = calloc((size_t)words * 4, 1);
  int32_t table[N * KILN__RESIZE_COLS] = {0};
  double *want = malloc(sizeof(double) * N * OH * OW * 3);
  cr_assert(staged && want);
  int64_t at = 0;
  for (int n = 0; n < N; n++) {
    const rz_case *c = &cs[n];
    uint8_t *px = malloc((size_t)c->rows * c->cols * 3);
    for (int64_t i = 0; i < (int64_t)c->rows * c->cols * 3; i++)
      px[i] = (uint8_t)th_rng_below(&rng, 256);
    int sw = c->c1 - c->c0;
    for (int r = c->r0; r < c->r1; r++)
      memcpy(staged + at + (int64_t)(r - c->r0) * sw * 3, px + ((int64_t)r * c->cols + c->c0) * 3,
             (size_t)sw * 3);
    int32_t *row = table + n * KILN__RESIZE_COLS;
    row[KILN__RZ_OFFSET] = (int32_t)at;
    row[KILN__RZ_ROWS] = c->rows;
    row[KILN__RZ_COLS] = c->cols;
    row[KILN__RZ_RROWS] = c->rrows;
    row[KILN__RZ_RCOLS] = c->rcols;
    row[KILN__RZ_OY] = c->oy;
    row[KILN__RZ_OX] = c->ox;
    row[KILN__RZ_R0] = c->r0;
    row[KILN__RZ_C0] = c->c0;
    row[KILN__RZ_SW] = sw;
    row[KILN__RZ_FLIP] = c->flip;
    at += (int64_t)(c->r1 - c->r0) * sw * 3;
    tf_ref_resize(px, c->rows, c->cols, c->rrows, c->rcols, c->oy, c->ox, OH, OW, c->flip, mean,
                  stdev, want + (int64_t)n * OH * OW * 3);
    free(px);
  }
  kiln_tensor *raw = kiln_tensor_from_host(ctx, KILN_DTYPE_I32, KILN_SHAPE(words), staged);
  kiln_tensor *tab =
      kiln_tensor_from_host(ctx, KILN_DTYPE_I32, KILN_SHAPE(N, KILN__RESIZE_COLS), table);
  kiln_tensor *y = kiln__resize_crop(raw, tab, OH, OW, mean, stdev, dt, "test");
  kiln_tensor *y32 = dt == KILN_DTYPE_F32 ? y : kiln_cast(y, KILN_DTYPE_F32);
  float *got = th_read(y32);
  th_assert_ok(ctx);
  /* f32: the kernel sums in f32 (a few 1e-5 of the normalised range); bf16: its rounding */
  if (dt == KILN_DTYPE_F32)
    th_assert_close(got, want, N * OH * OW * 3, 2e-4, 1e-5, "resize f32");
  else
    th_assert_close(got, want, N * OH * OW * 3, 1e-2, 1.0 / 128, "resize bf16");
  free(got);
  free(want);
  free(staged);
  kiln_tensor_free(raw);
  kiln_tensor_free(tab);
  th_ctx_free(ctx);
}

Test(gpu_imagefolder, resize_kernel_matches_the_float64_reference_f32) {
  kernel_case(KILN_DTYPE_F32);
}
Test(gpu_imagefolder, resize_kernel_matches_the_float64_reference_bf16) {
  kernel_case(KILN_DTYPE_BF16);
}

/* Runs an evaluation epoch of the folder at root in mode (0 unfused, 1 fused, 2 graphs) and
 * returns its images, (n, OH, OW, 3) in the folder's order, and labels. */
enum { EH = 24, EW = 20, ERESIZE = 28 };
static float *eval_epoch(const char *root, int mode, int32_t **labels, int64_t *n) {
  TH_GPU_CTX(ctx);
  kiln_set_fusion(ctx, mode > 0);
  kiln_set_graphs(ctx, mode == 2);
  kiln_image_folder *f = kiln_image_folder_open(ctx, root, NULL);
  cr_assert_not_null(f, "%s", th_err(ctx));
  *n = kiln_image_folder_size(f);
  kiln_image_loader *l =
      kiln_image_loader_new(f, &(kiln_image_loader_options){.batch = 4,
                                                            .height = EH,
                                                            .width = EW,
                                                            .resize = ERESIZE,
                                                            .transform = KILN_IMAGE_EVAL,
                                                            .threads = 2});
  cr_assert_not_null(l, "%s", th_err(ctx));
  const int64_t per = EH * EW * 3;
  float *all = malloc(sizeof(float) * (size_t)(*n * per));
  *labels = malloc(sizeof(int32_t) * (size_t)*n);
  int64_t done = 0;
  kiln_tensor *x, *y;
  for (;;) {
    kiln_step_begin(ctx);
    if (!kiln_image_loader_next(l, &x, &y)) break;
    cr_assert_eq(kiln_step_end(ctx), KILN_OK, "%s", th_err(ctx));
    int64_t b = kiln_tensor_shape(x).d[0];
    cr_assert_eq(kiln_tensor_to_host(x, all + done * per, sizeof(float) * (size_t)(b * per)),
                 KILN_OK, "%s", th_err(ctx));
    cr_assert_eq(kiln_tensor_to_host(y, *labels + done, sizeof(int32_t) * (size_t)b), KILN_OK, "%s",
                 th_err(ctx));
    done += b;
  }
  kiln_step_end(ctx);
  th_assert_ok(ctx);
  cr_assert_eq(done, *n);
  kiln_image_loader_free(l);
  kiln_image_folder_free(f);
  th_ctx_free(ctx);
  return all;
}

Test(gpu_imagefolder, evaluation_batches_match_the_reference_in_every_mode) {
  TH_GPU_CTX(probe); /* skips without a GPU, before any file is made */
  th_ctx_free(probe);
  char root[256];
  th_tmpdir(root, sizeof root, "gpu-imgfolder-eval");
  tf_make_folder(root, 3, 4, 0);
  int64_t n = 0;
  int32_t *labels[3];
  float *got[3];
  for (int mode = 0; mode < 3; mode++)
    got[mode] = eval_epoch(root, mode, &labels[mode], &n);
  cr_assert_eq(n, 12);
  const int64_t per = EH * EW * 3;
  double *want = malloc(sizeof(double) * (size_t)per);
  for (int64_t k = 0; k < n; k++) {
    int rows, cols;
    tf_size_of((int)k, &rows, &cols);
    uint8_t *px = tf_cifar_image((int)k, rows, cols);
    /* Resize(28): the shorter side to 28, the longer in proportion; CenterCrop(24, 20) */
    int rr = rows <= cols ? ERESIZE : ERESIZE * rows / cols;
    int rc = rows <= cols ? ERESIZE * cols / rows : ERESIZE;
    int oy = (int)nearbyint((rr - EH) / 2.0), ox = (int)nearbyint((rc - EW) / 2.0);
    tf_ref_resize(px, rows, cols, rr, rc, oy, ox, EH, EW, 0, mean, stdev, want);
    char what[64];
    snprintf(what, sizeof what, "image %lld", (long long)k);
    th_assert_close(got[2] + k * per, want, per, 2e-4, 1e-5, what);
    cr_assert_eq(labels[2][k], k / 4, "label of %lld", (long long)k);
    free(px);
  }
  for (int mode = 0; mode < 2; mode++) {
    cr_assert_eq(memcmp(got[mode], got[2], sizeof(float) * (size_t)(n * per)), 0,
                 "mode %d differs from the replayed graph", mode);
    cr_assert_eq(memcmp(labels[mode], labels[2], sizeof(int32_t) * (size_t)n), 0);
  }
  for (int mode = 0; mode < 3; mode++) {
    free(got[mode]);
    free(labels[mode]);
  }
  free(want);
}

Test(gpu_imagefolder, training_crop_of_the_whole_image_is_its_resize_flipped_or_not) {
  TH_GPU_CTX(ctx);
  char root[256], path[1200];
  th_tmpdir(root, sizeof root, "gpu-imgfolder-train");
  enum { R = 40, C = 56, N = 16, OH = 16, OW = 24 };
  for (int c = 0; c < 2; c++) {
    snprintf(path, sizeof path, "%s/c%d", root, c);
    cr_assert_eq(mkdir(path, 0755), 0);
  }
  for (int k = 0; k < N; k++) {
    uint8_t *px = tf_cifar_image(k, R, C);
    snprintf(path, sizeof path, "%s/c%d/%02d.png", root, k % 2, k);
    tf_write_png(path, px, R, C, 3);
    free(px);
  }
  kiln_image_folder *f = kiln_image_folder_open(ctx, root, NULL);
  cr_assert_not_null(f, "%s", th_err(ctx));
  /* area 1 and the images' own ratio: the crop is the whole image */
  kiln_image_loader *l =
      kiln_image_loader_new(f, &(kiln_image_loader_options){.batch = N,
                                                            .height = OH,
                                                            .width = OW,
                                                            .scale_min = 1.f,
                                                            .scale_max = 1.f,
                                                            .ratio_min = (float)C / R,
                                                            .ratio_max = (float)C / R,
                                                            .shuffle = 1,
                                                            .seed = 3});
  cr_assert_not_null(l, "%s", th_err(ctx));
  const int64_t per = OH * OW * 3;
  double *plain = malloc(sizeof(double) * per * N), *flipped = malloc(sizeof(double) * per * N);
  for (int64_t i = 0; i < N; i++) {
    int k = (int)(i < N / 2 ? 2 * i : 2 * (i - N / 2) + 1); /* the folder's order: c0, then c1 */
    uint8_t *px = tf_cifar_image(k, R, C);
    tf_ref_resize(px, R, C, OH, OW, 0, 0, OH, OW, 0, mean, stdev, plain + i * per);
    tf_ref_resize(px, R, C, OH, OW, 0, 0, OH, OW, 1, mean, stdev, flipped + i * per);
    free(px);
  }
  int flips = 0;
  float *got = malloc(sizeof(float) * per * N);
  int32_t lab[N];
  for (int epoch = 0; epoch < 3; epoch++) {
    kiln_image_loader_start(l, epoch);
    kiln_tensor *x, *y;
    kiln_step_begin(ctx);
    cr_assert_eq(kiln_image_loader_next(l, &x, &y), 1, "%s", th_err(ctx));
    cr_assert_eq(kiln_step_end(ctx), KILN_OK, "%s", th_err(ctx));
    cr_assert_eq(kiln_tensor_to_host(x, got, sizeof(float) * per * N), KILN_OK, "%s", th_err(ctx));
    cr_assert_eq(kiln_tensor_to_host(y, lab, sizeof lab), KILN_OK, "%s", th_err(ctx));
    bool seen[N] = {0};
    for (int b = 0; b < N; b++) {
      /* which sample it is: the reference it matches, plain or flipped */
      int match = -1, flip = 0;
      for (int i = 0; i < N && match < 0; i++)
        for (int fl = 0; fl < 2 && match < 0; fl++) {
          const double *w = (fl ? flipped : plain) + i * per;
          bool same = true;
          for (int64_t e = 0; e < per && same; e++)
            same = fabs(got[b * per + e] - w[e]) <= 2e-4 + 1e-5 * fabs(w[e]);
          if (same) match = i, flip = fl;
        }
      cr_assert_geq(match, 0, "epoch %d, image %d is no sample's resize", epoch, b);
      cr_assert(!seen[match], "sample %d twice in one epoch", match);
      seen[match] = true;
      cr_assert_eq(lab[b], match < N / 2 ? 0 : 1, "label of sample %d", match);
      flips += flip;
    }
  }
  /* 48 fair coins: between 12 and 36 heads but for a chance below 1e-3 */
  cr_assert(flips >= 12 && flips <= 36, "%d of 48 images flipped", flips);
  free(got);
  free(plain);
  free(flipped);
  kiln_image_loader_free(l);
  kiln_image_folder_free(f);
  th_ctx_free(ctx);
}
