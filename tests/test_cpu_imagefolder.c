/*
 * test_cpu_imagefolder.c: image folders without a GPU. Folders of PNG and JPEG files made from
 * the CIFAR-10 sample (written with libpng and TurboJPEG) are listed in torchvision's order,
 * read back (PNG exactly, JPEG within its quantisation; gray and RGBA PNGs as PIL's
 * convert("RGB")), and every hostile file of the contract (empty, not an image, truncated, a
 * directory or a FIFO named as an image, 30000 x 30000 pixels claimed by a few bytes) is
 * reported by name and skipped, or fails the call that meets it. A loader in a no-GPU context
 * reads, decodes and places whole epochs (bad files replaced, batches full) and its step plans
 * and compiles the resize kernel; bad options are errors naming the function. The imagefolder
 * example runs a few steps with --no-gpu on a train/val folder (the data path, its flags, its
 * log), and refuses bad flags.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>
#include <zlib.h>

#include "helpers.h"
#include "imgfolder.h"

TestSuite(imagefolder, .fini = th_remove_tmpdirs);

static kiln_ctx *cpu_ctx(void) {
  kiln_ctx_options no = {.no_gpu = 1};
  kiln_ctx *ctx = kiln_ctx_new(&no);
  cr_assert_not_null(ctx);
  return ctx;
}

static void copy_file(const char *from, const char *to) {
  size_t n;
  char *b = th_read_whole(from, &n);
  th_write_whole(to, b, n);
  free(b);
}

Test(imagefolder, lists_classes_and_files_in_torchvision_order) {
  char root[256], path[1200], from[1200];
  th_tmpdir(root, sizeof root, "imgfolder-order");
  tf_make_folder(root, 3, 4, 0);
  /* passed over: hidden names, other extensions; found: a subfolder's file, an upper-case one */
  snprintf(path, sizeof path, "%s/class_0/.hidden.png", root);
  snprintf(from, sizeof from, "%s/class_0/img_000.png", root);
  copy_file(from, path);
  snprintf(path, sizeof path, "%s/class_2/notes.txt", root);
  th_write_whole(path, "not an image", 12);
  snprintf(path, sizeof path, "%s/class_1/sub", root);
  cr_assert_eq(mkdir(path, 0755), 0);
  snprintf(path, sizeof path, "%s/class_1/sub/extra.PNG", root);
  copy_file(from, path);
  /* class 2: torchvision's order is by folder, then by name: z.png, then a/, a.b/, a/deep/ */
  const char *dirs[] = {"class_2/a", "class_2/a.b", "class_2/a/deep"};
  for (int i = 0; i < 3; i++) {
    snprintf(path, sizeof path, "%s/%s", root, dirs[i]);
    cr_assert_eq(mkdir(path, 0755), 0);
  }
  const char *extra[] = {"class_2/a/x.png", "class_2/a.b/y.png", "class_2/a/deep/w.png",
                         "class_2/z.png"};
  for (int i = 0; i < 4; i++) {
    snprintf(path, sizeof path, "%s/%s", root, extra[i]);
    copy_file(from, path);
  }
  snprintf(path, sizeof path, "%s/.cache", root); /* a hidden folder is no class */
  cr_assert_eq(mkdir(path, 0755), 0);
  snprintf(path, sizeof path, "%s/README", root); /* a file beside the classes is none either */
  th_write_whole(path, "x", 1);

  kiln_ctx *ctx = cpu_ctx();
  kiln_image_folder *f =
      kiln_image_folder_open(ctx, root, &(kiln_image_folder_options){.quiet = 1});
  cr_assert_not_null(f, "%s", th_err(ctx));
  cr_assert_eq(kiln_image_folder_classes(f), 3);
  cr_assert_eq(kiln_image_folder_size(f), 17);
  for (int c = 0; c < 3; c++) {
    snprintf(path, sizeof path, "class_%d", c);
    cr_assert_str_eq(kiln_image_folder_class_name(f, c), path);
  }
  cr_assert_null(kiln_image_folder_class_name(f, 3));
  /* class 1: img_004..img_007, then sub/extra.PNG; class 2 as said above */
  const int labels[17] = {0, 0, 0, 0, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2};
  for (int64_t i = 0; i < 17; i++)
    cr_assert_eq(kiln_image_folder_label(f, i), labels[i], "sample %lld", (long long)i);
  snprintf(path, sizeof path, "%s/class_1/sub/extra.PNG", root);
  cr_assert_str_eq(kiln_image_folder_path(f, 8), path);
  const char *order[] = {"class_2/img_008.png", "class_2/img_009.png", "class_2/img_010.png",
                         "class_2/img_011.png", "class_2/z.png",       "class_2/a/x.png",
                         "class_2/a.b/y.png",   "class_2/a/deep/w.png"};
  for (int i = 0; i < 8; i++) {
    snprintf(path, sizeof path, "%s/%s", root, order[i]);
    cr_assert_str_eq(kiln_image_folder_path(f, 9 + i), path, "sample %d", 9 + i);
  }
  cr_assert_null(kiln_image_folder_path(f, 17));
  cr_assert_eq(kiln_image_folder_label(f, -1), -1);
  cr_assert_eq(kiln_image_folder_bad_count(f), 0);
  kiln_image_folder_free(f);
  th_assert_ok(ctx);
  th_ctx_free(ctx);
}

Test(imagefolder, reads_png_exactly_and_jpeg_within_quantisation) {
  char root[256];
  th_tmpdir(root, sizeof root, "imgfolder-read");
  tf_make_folder(root, 2, 6, 2); /* every second image a JPEG */
  kiln_ctx *ctx = cpu_ctx();
  kiln_image_folder *f = kiln_image_folder_open(ctx, root, NULL);
  cr_assert_not_null(f, "%s", th_err(ctx));
  int jpegs = 0;
  for (int64_t k = 0; k < 12; k++) {
    int rows, cols, want_rows, want_cols;
    uint8_t *px = NULL;
    cr_assert_eq(kiln_image_folder_read(f, k, &px, &rows, &cols), KILN_OK, "%s", th_err(ctx));
    tf_size_of((int)k, &want_rows, &want_cols);
    cr_assert(rows == want_rows && cols == want_cols, "image %lld: %d x %d, want %d x %d",
              (long long)k, rows, cols, want_rows, want_cols);
    uint8_t *want = tf_cifar_image((int)k, rows, cols);
    int64_t n = (int64_t)rows * cols * 3, worst = 0;
    double sum = 0;
    for (int64_t i = 0; i < n; i++) {
      int d = abs((int)px[i] - (int)want[i]);
      worst = d > worst ? d : worst;
      sum += d;
    }
    if (strstr(kiln_image_folder_path(f, k), ".jpg")) {
      /* quality 95, no chroma subsampling: a few levels on average */
      jpegs++;
      cr_assert_lt(sum / (double)n, 2.5, "JPEG %lld: mean error %g", (long long)k, sum / (double)n);
      cr_assert_lt(worst, 48, "JPEG %lld: largest error %lld", (long long)k, (long long)worst);
      cr_assert_gt(sum, 0, "a JPEG that decodes without loss is no test of it");
    } else {
      cr_assert_eq(worst, 0, "PNG %lld differs by %lld", (long long)k, (long long)worst);
    }
    free(px);
    free(want);
  }
  cr_assert_eq(jpegs, 6);
  kiln_image_folder_free(f);
  th_ctx_free(ctx);
}

/* A fresh folder (in root) holding one empty class folder, "a". */
static void one_class(char *root, size_t n, const char *what) {
  char path[1200];
  th_tmpdir(root, n, what);
  snprintf(path, sizeof path, "%s/a", root);
  cr_assert_eq(mkdir(path, 0755), 0);
}

Test(imagefolder, gray_and_rgba_png_as_pil_converts_them) {
  char root[256], path[1200];
  one_class(root, sizeof root, "imgfolder-color");
  uint8_t *rgb = tf_cifar_image(3, 20, 30);
  uint8_t gray[600], rgba[2400];
  for (int i = 0; i < 600; i++) {
    gray[i] = rgb[3 * i + 1];
    memcpy(rgba + 4 * i, rgb + 3 * i, 3);
    rgba[4 * i + 3] = (uint8_t)(i * 7); /* every alpha, 0 included: dropped, not composited */
  }
  snprintf(path, sizeof path, "%s/a/gray.png", root);
  tf_write_png(path, gray, 20, 30, 1);
  snprintf(path, sizeof path, "%s/a/rgba.png", root);
  tf_write_png(path, rgba, 20, 30, 4);
  kiln_ctx *ctx = cpu_ctx();
  kiln_image_folder *f = kiln_image_folder_open(ctx, root, NULL);
  cr_assert_not_null(f, "%s", th_err(ctx));
  uint8_t *px;
  int rows, cols;
  cr_assert_eq(kiln_image_folder_read(f, 0, &px, &rows, &cols), KILN_OK, "%s", th_err(ctx));
  for (int i = 0; i < 600; i++)
    cr_assert(px[3 * i] == gray[i] && px[3 * i + 1] == gray[i] && px[3 * i + 2] == gray[i],
              "gray pixel %d", i);
  free(px);
  cr_assert_eq(kiln_image_folder_read(f, 1, &px, &rows, &cols), KILN_OK, "%s", th_err(ctx));
  cr_assert_eq(memcmp(px, rgb, 1800), 0, "RGBA's colour channels as written");
  free(px);
  free(rgb);
  kiln_image_folder_free(f);
  th_ctx_free(ctx);
}

Test(imagefolder, sixteen_bit_and_gamma_tagged_png_as_pil_reads_them) {
  char root[256], path[1200];
  one_class(root, sizeof root, "imgfolder-png16");
  enum { R = 6, C = 7 };
  uint8_t rgb16[R * C * 3 * 2], gray16[R * C * 2], rgb8[R * C * 3];
  for (int i = 0; i < R * C * 3; i++) {
    rgb16[2 * i] = (uint8_t)(i * 37 + 11); /* big-endian: the high byte first */
    rgb16[2 * i + 1] = (uint8_t)(i * 91 + 5);
    rgb8[i] = (uint8_t)(i * 53 + 7);
  }
  for (int i = 0; i < R * C; i++) {
    gray16[2 * i] = (uint8_t)(i * 29 + 3);
    gray16[2 * i + 1] = 0xff;
  }
  snprintf(path, sizeof path, "%s/a/0_rgb16.png", root);
  tf_write_png_full(path, rgb16, R, C, 3, 16, 0);
  snprintf(path, sizeof path, "%s/a/1_gray16_linear.png", root);
  tf_write_png_full(path, gray16, R, C, 1, 16, 1.0);
  snprintf(path, sizeof path, "%s/a/2_gamma.png", root);
  tf_write_png_full(path, rgb8, R, C, 3, 8, 1 / 1.8);
  kiln_ctx *ctx = cpu_ctx();
  kiln_image_folder *f = kiln_image_folder_open(ctx, root, NULL);
  cr_assert_not_null(f, "%s", th_err(ctx));
  uint8_t *px;
  int rows, cols;
  /* 16-bit samples: their high byte; gamma chunks: ignored (libpng's simplified API would turn
   * both to sRGB: a 128 would read 186) */
  cr_assert_eq(kiln_image_folder_read(f, 0, &px, &rows, &cols), KILN_OK, "%s", th_err(ctx));
  for (int i = 0; i < R * C * 3; i++)
    cr_assert_eq(px[i], rgb16[2 * i], "16-bit RGB sample %d", i);
  free(px);
  cr_assert_eq(kiln_image_folder_read(f, 1, &px, &rows, &cols), KILN_OK, "%s", th_err(ctx));
  for (int i = 0; i < R * C; i++)
    cr_assert(px[3 * i] == gray16[2 * i] && px[3 * i + 2] == gray16[2 * i], "16-bit gray %d", i);
  free(px);
  cr_assert_eq(kiln_image_folder_read(f, 2, &px, &rows, &cols), KILN_OK, "%s", th_err(ctx));
  cr_assert_eq(memcmp(px, rgb8, sizeof rgb8), 0, "a gAMA chunk changed the samples");
  free(px);
  kiln_image_folder_free(f);
  th_ctx_free(ctx);
}

/* A PNG of a few bytes whose header claims rows x cols pixels: its IHDR, the start of an IDAT
 * (where libpng stops reading the header) and IEND. */
static void write_png_claiming(const char *path, uint32_t rows, uint32_t cols) {
  uint8_t b[8 + 25 + 14 + 12] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n',
                                 0,    0,   0,   13,  'I',  'H',  'D',  'R'};
  uint8_t *d = b + 16;
  for (int i = 0; i < 4; i++) {
    d[i] = (uint8_t)(cols >> (24 - 8 * i));
    d[4 + i] = (uint8_t)(rows >> (24 - 8 * i));
  }
  d[8] = 8; /* 8-bit RGB */
  d[9] = 2;
  uLong crc = crc32(0, b + 12, 17);
  for (int i = 0; i < 4; i++)
    b[29 + i] = (uint8_t)(crc >> (24 - 8 * i));
  const uint8_t idat[10] = {0, 0, 0, 2, 'I', 'D', 'A', 'T', 0x78, 0x9c};
  memcpy(b + 33, idat, 10);
  crc = crc32(0, b + 37, 6);
  for (int i = 0; i < 4; i++)
    b[43 + i] = (uint8_t)(crc >> (24 - 8 * i));
  const uint8_t iend[12] = {0, 0, 0, 0, 'I', 'E', 'N', 'D', 0xae, 0x42, 0x60, 0x82};
  memcpy(b + 47, iend, 12);
  th_write_whole(path, b, sizeof b);
}

/* A real JPEG whose frame header is changed to claim rows x cols pixels. */
static void write_jpeg_claiming(const char *path, int rows, int cols) {
  uint8_t *px = tf_cifar_image(0, 32, 32);
  size_t n;
  uint8_t *b = tf_jpeg_bytes(px, 32, 32, 90, &n);
  size_t i = 2;
  while (i + 9 < n && !(b[i] == 0xff && b[i + 1] == 0xc0))
    i++;
  cr_assert_lt(i + 9, n, "no SOF0 marker in TurboJPEG's output");
  b[i + 5] = (uint8_t)(rows >> 8), b[i + 6] = (uint8_t)rows;
  b[i + 7] = (uint8_t)(cols >> 8), b[i + 8] = (uint8_t)cols;
  th_write_whole(path, b, n);
  free(b);
  free(px);
}

/* One class of 6 good images and the hostile files; returns how many of them are bad. */
static int make_hostile(const char *root) {
  char path[1200], good[1200];
  tf_make_folder(root, 1, 6, 3);
  snprintf(good, sizeof good, "%s/class_0/img_002.jpg", root);
#define AT(name) (snprintf(path, sizeof path, "%s/class_0/%s", root, name), path)
  th_write_whole(AT("empty.jpg"), "", 0);
  th_write_whole(AT("text.png"), "this is no image at all, only words", 35);
  copy_file(good, AT("trunc.jpg"));
  th_truncate_half(path);
  snprintf(good, sizeof good, "%s/class_0/img_000.png", root);
  copy_file(good, AT("trunc.png"));
  th_truncate_half(path);
  cr_assert_eq(mkdir(AT("folder.jpg"), 0755), 0);
  cr_assert_eq(mkfifo(AT("fifo.png"), 0644), 0);
  write_png_claiming(AT("huge.png"), 30000, 30000);
  write_jpeg_claiming(AT("huge.jpg"), 30000, 30000);
#undef AT
  return 8;
}

/* The bad list holds the file named `name` with a reason containing `why`. */
static void assert_listed(const kiln_image_folder *f, const char *name, const char *why) {
  for (int64_t k = 0; k < kiln_image_folder_bad_count(f); k++) {
    const char *w, *p = kiln_image_folder_bad(f, k, &w);
    if (strstr(p, name)) {
      cr_assert(strstr(w, why), "%s: \"%s\" does not say \"%s\"", name, w, why);
      return;
    }
  }
  cr_assert_fail("%s is not in the bad list", name);
}

Test(imagefolder, hostile_files_are_reported_by_name_and_skipped) {
  char root[256];
  th_tmpdir(root, sizeof root, "imgfolder-hostile");
  int bad = make_hostile(root);
  kiln_ctx *ctx = cpu_ctx();
  kiln_image_folder *f =
      kiln_image_folder_open(ctx, root, &(kiln_image_folder_options){.quiet = 1});
  cr_assert_not_null(f, "%s", th_err(ctx));
  /* found at opening, from the directory alone: the empty file, the folder and the FIFO */
  cr_assert_eq(kiln_image_folder_bad_count(f), 3);
  assert_listed(f, "empty.jpg", "empty");
  assert_listed(f, "folder.jpg", "directory");
  assert_listed(f, "fifo.png", "regular");
  cr_assert_eq(kiln_image_folder_size(f), 6 + bad - 3);
  /* the others when decoded: one epoch of full batches, each bad file replaced */
  kiln_image_loader *l = kiln_image_loader_new(
      f, &(kiln_image_loader_options){.batch = 4, .height = 16, .width = 16, .threads = 3});
  cr_assert_not_null(l, "%s", th_err(ctx));
  cr_assert_eq(kiln_image_loader_batches(l), 3);
  int batches = 0;
  kiln_tensor *x, *y;
  for (;;) {
    kiln_step_begin(ctx);
    if (!kiln_image_loader_next(l, &x, &y)) break;
    cr_assert_eq(kiln_tensor_shape(x).d[0], batches < 2 ? 4 : 3);
    cr_assert_eq(kiln_step_end(ctx), KILN_OK, "%s", th_err(ctx));
    batches++;
  }
  kiln_step_end(ctx);
  th_assert_ok(ctx);
  cr_assert_eq(batches, 3);
  cr_assert_eq(kiln_image_folder_bad_count(f), bad);
  assert_listed(f, "text.png", "neither a JPEG nor a PNG");
  assert_listed(f, "trunc.jpg", "truncated or corrupted JPEG");
  assert_listed(f, "trunc.png", "truncated or corrupted PNG");
  assert_listed(f, "huge.png", "max_pixels");
  assert_listed(f, "huge.jpg", "max_pixels");
  kiln_image_loader_stats st = kiln_image_loader_stats_get(l);
  cr_assert_eq(st.images, 11);
  cr_assert_geq(st.decoded, 11 + 5, "each bad file tried, then its replacement");
  /* a read names the file whatever the options say */
  int64_t huge = -1;
  for (int64_t i = 0; i < kiln_image_folder_size(f); i++)
    if (strstr(kiln_image_folder_path(f, i), "huge.png")) huge = i;
  cr_assert_geq(huge, 0);
  uint8_t *px = NULL;
  int rows, cols;
  cr_assert_eq(kiln_image_folder_read(f, huge, &px, &rows, &cols), KILN_ERR_FORMAT);
  cr_assert(strstr(th_err(ctx), "huge.png") && strstr(th_err(ctx), "30000 x 30000"), "%s",
            th_err(ctx));
  cr_assert_null(px);
  kiln_ctx_clear_error(ctx);
  kiln_image_loader_free(l);
  kiln_image_folder_free(f);
  th_ctx_free(ctx);
}

Test(imagefolder, hostile_files_fail_the_call_that_meets_them_when_asked) {
  char root[256], path[1200];
  th_tmpdir(root, sizeof root, "imgfolder-fail");
  make_hostile(root);
  kiln_ctx *ctx = cpu_ctx();
  kiln_image_folder_options fail = {.bad = KILN_IMAGE_BAD_FAIL, .quiet = 1};
  cr_assert_null(kiln_image_folder_open(ctx, root, &fail));
  cr_assert(strstr(th_err(ctx), "kiln_image_folder_open") && strstr(th_err(ctx), "empty.jpg"), "%s",
            th_err(ctx));
  kiln_ctx_clear_error(ctx);
  /* only a truncated JPEG left bad: opening works, the batch that reads it fails naming it */
  const char *gone[] = {"empty.jpg", "text.png", "trunc.png", "fifo.png", "huge.png", "huge.jpg"};
  for (int i = 0; i < 6; i++) {
    snprintf(path, sizeof path, "%s/class_0/%s", root, gone[i]);
    cr_assert_eq(unlink(path), 0, "%s", path);
  }
  snprintf(path, sizeof path, "%s/class_0/folder.jpg", root);
  cr_assert_eq(rmdir(path), 0);
  kiln_image_folder *f = kiln_image_folder_open(ctx, root, &fail);
  cr_assert_not_null(f, "%s", th_err(ctx));
  kiln_image_loader *l =
      kiln_image_loader_new(f, &(kiln_image_loader_options){.batch = 7, .height = 8, .width = 8});
  cr_assert_not_null(l, "%s", th_err(ctx));
  kiln_tensor *x = NULL, *y = NULL;
  cr_assert_eq(kiln_image_loader_next(l, &x, &y), 0);
  cr_assert(strstr(th_err(ctx), "kiln_image_loader_next") && strstr(th_err(ctx), "trunc.jpg"), "%s",
            th_err(ctx));
  cr_assert_null(x);
  kiln_ctx_clear_error(ctx);
  kiln_image_loader_free(l);
  kiln_image_folder_free(f);
  th_ctx_free(ctx);
}

Test(imagefolder, empty_class_missing_root_and_bad_options_are_errors) {
  char root[256], path[1200];
  th_tmpdir(root, sizeof root, "imgfolder-errors");
  kiln_ctx *ctx = cpu_ctx();
  cr_assert_null(kiln_image_folder_open(ctx, root, NULL));
  cr_assert(strstr(th_err(ctx), "no class folder"), "%s", th_err(ctx));
  kiln_ctx_clear_error(ctx);
  snprintf(path, sizeof path, "%s/missing", root);
  cr_assert_null(kiln_image_folder_open(ctx, path, NULL));
  cr_assert(strstr(th_err(ctx), "missing") && strstr(th_err(ctx), "cannot read"), "%s",
            th_err(ctx));
  kiln_ctx_clear_error(ctx);
  tf_make_folder(root, 2, 2, 0);
  snprintf(path, sizeof path, "%s/class_9", root);
  cr_assert_eq(mkdir(path, 0755), 0);
  cr_assert_null(kiln_image_folder_open(ctx, root, NULL));
  cr_assert(strstr(th_err(ctx), "class_9") && strstr(th_err(ctx), "holds no image"), "%s",
            th_err(ctx));
  kiln_ctx_clear_error(ctx);
  cr_assert_eq(rmdir(path), 0);
  kiln_image_folder *f = kiln_image_folder_open(ctx, root, NULL);
  cr_assert_not_null(f, "%s", th_err(ctx));
  const kiln_image_loader_options bad[] = {
      {.batch = 0},
      {.batch = 2, .transform = KILN_IMAGE_EVAL, .resize = 100},
      {.batch = 2, .scale_min = 0.5f, .scale_max = 0.25f},
      {.batch = 2, .ratio_min = -1.f},
      {.batch = 2, .std = {0.2f, 0.f, 0.2f}},
      {.batch = 2, .dtype = KILN_DTYPE_I32},
      {.batch = 2, .height = -3},
      {.batch = 2, .shuffle = 2},
      {.batch = 2, .drop_last = -1},
      {.batch = 2, .no_flip = 3},
  };
  const char *says[] = {
      "batch 0",   "resize 100", "scale [0.5, 0.25]",        "ratio [-1",    "channel 1",
      "dtype i32", "height -3",  "shuffle 2 must be 0 or 1", "drop_last -1", "no_flip 3"};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    cr_assert_null(kiln_image_loader_new(f, &bad[i]), "options %zu", i);
    cr_assert(strstr(th_err(ctx), "kiln_image_loader_new") && strstr(th_err(ctx), says[i]),
              "options %zu: %s", i, th_err(ctx));
    kiln_ctx_clear_error(ctx);
  }
  kiln_image_folder_free(f);
  th_ctx_free(ctx);
}

/* Whole epochs in a no-GPU context: the batches' shapes and labels' count, the resize kernel
 * planned and compiled (f32 and bf16, both transforms), a partial last batch and drop_last. */
Test(imagefolder, loader_epochs_plan_and_compile_without_a_gpu) {
  char root[256];
  th_tmpdir(root, sizeof root, "imgfolder-loader");
  tf_make_folder(root, 3, 5, 4);
  kiln_ctx *ctx = cpu_ctx();
  kiln_image_folder *f = kiln_image_folder_open(ctx, root, NULL);
  cr_assert_not_null(f, "%s", th_err(ctx));
  for (int v = 0; v < 4; v++) {
    kiln_image_loader_options o = {.batch = 4,
                                   .height = 24,
                                   .width = 20,
                                   .shuffle = 1,
                                   .seed = 7,
                                   .drop_last = v == 3,
                                   .transform = v % 2 ? KILN_IMAGE_EVAL : KILN_IMAGE_TRAIN,
                                   .dtype = v >= 2 ? KILN_DTYPE_BF16 : KILN_DTYPE_F32,
                                   .threads = 1 + v};
    kiln_image_loader *l = kiln_image_loader_new(f, &o);
    cr_assert_not_null(l, "%s", th_err(ctx));
    int64_t want = v == 3 ? 3 : 4;
    cr_assert_eq(kiln_image_loader_batches(l), want);
    for (int epoch = 0; epoch < 2; epoch++) {
      kiln_image_loader_start(l, epoch);
      int64_t got = 0, images = 0;
      kiln_tensor *x, *y;
      for (;;) {
        kiln_step_begin(ctx);
        if (!kiln_image_loader_next(l, &x, &y)) break;
        kiln_shape xs = kiln_tensor_shape(x), ys = kiln_tensor_shape(y);
        int64_t b = got < 3 ? 4 : 3;
        cr_assert(xs.ndim == 4 && xs.d[0] == b && xs.d[1] == 24 && xs.d[2] == 20 && xs.d[3] == 3,
                  "variant %d batch %lld", v, (long long)got);
        cr_assert(ys.ndim == 1 && ys.d[0] == b);
        cr_assert_eq(kiln_tensor_dtype(x), o.dtype);
        cr_assert_eq(kiln_tensor_dtype(y), KILN_DTYPE_I32);
        /* something reads both, as a training step would */
        kiln_tensor *xf = kiln_cast(x, KILN_DTYPE_F32);
        kiln_tensor *s = kiln_sum(kiln_mul(xf, xf), KILN_ALL_AXES, 0);
        cr_assert_not_null(s, "%s", th_err(ctx));
        cr_assert_eq(kiln_step_end(ctx), KILN_OK, "%s", th_err(ctx));
        got++;
        images += b;
      }
      kiln_step_end(ctx);
      th_assert_ok(ctx);
      cr_assert_eq(got, want);
      cr_assert_eq(images, v == 3 ? 12 : 15);
    }
    kiln_image_loader_stats st = kiln_image_loader_stats_get(l);
    cr_assert_eq(st.images, v == 3 ? 24 : 30);
    cr_assert_eq(st.threads, 1 + v);
    cr_assert_gt(st.bytes_copied, 0);
    kiln_image_loader_free(l);
  }
  kiln_exec_stats es;
  kiln_stats(ctx, &es);
  cr_assert_gt(es.kernels_compiled + es.cache_hits, 0);
  /* a wide training crop (width > height * 8 / 7: resize plays no part in training) */
  kiln_image_loader *wide =
      kiln_image_loader_new(f, &(kiln_image_loader_options){.batch = 5, .height = 16, .width = 24});
  cr_assert_not_null(wide, "%s", th_err(ctx));
  kiln_image_loader_free(wide);
  /* a step that fails gives its batch back: the epoch still has all its batches */
  kiln_image_loader *l = kiln_image_loader_new(f, &(kiln_image_loader_options){.batch = 5});
  cr_assert_not_null(l, "%s", th_err(ctx));
  kiln_tensor *x, *y;
  kiln_step_begin(ctx);
  cr_assert_eq(kiln_image_loader_next(l, &x, &y), 1, "%s", th_err(ctx));
  cr_assert_null(kiln_matmul(x, y), "a bad op fails the step");
  cr_assert_neq(kiln_step_end(ctx), KILN_OK);
  kiln_ctx_clear_error(ctx);
  int batches = 0;
  for (;;) {
    kiln_step_begin(ctx);
    if (!kiln_image_loader_next(l, &x, &y)) break;
    cr_assert_eq(kiln_step_end(ctx), KILN_OK, "%s", th_err(ctx));
    batches++;
  }
  kiln_step_end(ctx);
  cr_assert_eq(batches, 3, "the failed step's batch came back");
  /* misuse: NULL outputs, and the folder freed before its loader */
  cr_assert_eq(kiln_image_loader_next(l, NULL, &y), 0);
  cr_assert(strstr(th_err(ctx), "NULL x or y"), "%s", th_err(ctx));
  kiln_ctx_clear_error(ctx);
  kiln_image_folder_free(f);
  cr_assert(strstr(th_err(ctx), "loaders of the folder are alive"), "%s", th_err(ctx));
  kiln_ctx_clear_error(ctx);
  cr_assert_eq(kiln_image_folder_size(f), 15, "the folder was kept");
  kiln_image_loader_free(l);
  kiln_image_folder_free(f);
  th_ctx_free(ctx);
}

/* Runs the imagefolder example with args; returns its exit status, its output in out. */
static int run_example(const char *args, char *out, size_t n) {
  char cmd[2048];
  /* (an example ends on an error without freeing: no leak reports for it under sanitizers) */
  snprintf(cmd, sizeof cmd, "ASAN_OPTIONS=detect_leaks=0 '%s/imagefolder' %s 2>&1", KILN_BINARY_DIR,
           args);
  FILE *p = popen(cmd, "r");
  cr_assert_not_null(p);
  size_t got = fread(out, 1, n - 1, p);
  out[got] = 0;
  int st = pclose(p);
  return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

Test(imagefolder, the_example_runs_its_data_path_without_a_gpu) {
  char root[256], sub[1200], args[2048], log[1200];
  static char out[1 << 16];
  th_tmpdir(root, sizeof root, "imgfolder-example");
  snprintf(sub, sizeof sub, "%s/train", root);
  tf_make_folder(sub, 3, 6, 3);
  snprintf(sub, sizeof sub, "%s/val", root);
  tf_make_folder(sub, 3, 2, 2);
  snprintf(log, sizeof log, "%s/log.jsonl", root);
  snprintf(
      args, sizeof args,
      "'%s' --no-gpu --epochs 2 --steps 6 --batch 4 --size 32 --width 8 --threads 2 --log '%s'",
      root, log);
  int st = run_example(args, out, sizeof out);
  cr_assert_eq(st, 0, "exit %d:\n%s", st, out);
  cr_assert(strstr(out, "18 images of 3 classes") && strstr(out, "evaluated on") &&
                strstr(out, "epoch 1 (no GPU") && strstr(out, "epoch 2 (no GPU") &&
                strstr(out, "training 16 images") && strstr(out, "training 8 images"),
            "%s", out);
  /* one JSON line an epoch: 4 steps of 4 images, then the 2 left of --steps 6 */
  size_t n;
  char *text = th_read_whole(log, &n);
  cr_assert(strstr(text, "\"epoch\": 1, \"step\": 4,") &&
                strstr(text, "\"epoch\": 2, \"step\": 6,"),
            "%s", text);
  free(text);
  /* bad flags: usage (exit 2), naming what is wrong */
  snprintf(args, sizeof args, "'%s' --batch 0", root);
  cr_assert_eq(run_example(args, out, sizeof out), 2, "%s", out);
  cr_assert(strstr(out, "--batch needs a positive integer"), "%s", out);
  snprintf(args, sizeof args, "'%s' --no-gpu --save x.safetensors", root);
  cr_assert_eq(run_example(args, out, sizeof out), 2, "%s", out);
  cr_assert(strstr(out, "needs a GPU"), "%s", out);
  cr_assert_eq(run_example("", out, sizeof out), 2, "%s", out);
  cr_assert(strstr(out, "usage:"), "%s", out);
  /* a folder that is none: an error naming it */
  snprintf(args, sizeof args, "'%s/nothing' --no-gpu", root);
  cr_assert_eq(run_example(args, out, sizeof out), 1, "%s", out);
  cr_assert(strstr(out, "nothing") && strstr(out, "cannot read the folder"), "%s", out);
}
