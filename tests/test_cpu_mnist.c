/*
 * test_cpu_mnist.c: the MNIST idx reader (data/mnist.c) without a GPU: synthetic files, raw and
 * gzip, read back exactly; truncated, corrupted, mislabelled, oversized and missing files each
 * refused with a message naming the file and a zeroed result; and the real files (KILN_MNIST),
 * gzip and a raw copy, with their known first labels and class counts, and Fashion-MNIST
 * (KILN_FASHION_MNIST) byte for byte.
 */
#include <string.h>
#include <unistd.h>
#include <zlib.h>

#include "idx.h"
#include "inspect.h"

TestSuite(mnist, .fini = th_remove_tmpdirs);

/* Asserts that m is the synthetic split. */
static void assert_synthetic(const kiln_mnist *m) {
  cr_assert_eq(m->n, TH_IDX_N);
  cr_assert_eq(m->rows, TH_IDX_ROWS);
  cr_assert_eq(m->cols, TH_IDX_COLS);
  for (size_t i = 0; i < (size_t)TH_IDX_N * TH_IDX_ROWS * TH_IDX_COLS; i++)
    cr_assert_eq(m->images[i], th_idx_pixel(i), "pixel %zu", i);
  for (uint32_t i = 0; i < TH_IDX_N; i++)
    cr_assert_eq(m->labels[i], (i * 7 + 3) % 10);
}

static void read_synthetic(bool gz) {
  char dir[256];
  th_idx_synthetic(dir, sizeof dir, gz);
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_mnist m;
  cr_assert_eq(kiln_mnist_read(ctx, dir, "train", &m), KILN_OK, "%s", kiln_ctx_error(ctx));
  assert_synthetic(&m);
  kiln_mnist_free(&m);
  th_assert_mnist_zeroed(&m);
  th_ctx_free(ctx);
  th_remove_dir(dir);
}

Test(mnist, synthetic_gzip_and_raw_read_back) {
  read_synthetic(true);
  read_synthetic(false);
}

Test(mnist, bad_arguments) {
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_mnist m;
  cr_assert_eq(kiln_mnist_read(ctx, "/nonexistent", "validation", &m), KILN_ERR_INVALID);
  TH_ASSERT_ERROR(ctx, KILN_ERR_INVALID, "kiln_mnist_read", "validation");
  th_assert_mnist_zeroed(&m);
  kiln_ctx_clear_error(ctx);
  cr_assert_eq(kiln_mnist_read(ctx, "/nonexistent", "train", NULL), KILN_ERR_INVALID);
  kiln_ctx_clear_error(ctx);
  cr_assert_eq(kiln_mnist_read(NULL, "/nonexistent", "train", &m), KILN_ERR_INVALID);
  th_ctx_free(ctx);
}

Test(mnist, gzip_truncated_in_the_middle) {
  char dir[256], path[1200];
  th_idx_synthetic(dir, sizeof dir, true);
  snprintf(path, sizeof path, "%s/" TH_IDX_IMAGES ".gz", dir);
  th_truncate_half(path);
  /* zlib reports a cut gzip stream as an unexpected end of file */
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_mnist m;
  cr_assert_eq(kiln_mnist_read(ctx, dir, "train", &m), KILN_ERR_FORMAT, "%s", kiln_ctx_error(ctx));
  const char *msg = kiln_ctx_error(ctx);
  cr_assert_not_null(strstr(msg, TH_IDX_IMAGES ".gz"), "%s", msg);
  cr_assert(strstr(msg, "truncated") || strstr(msg, "unexpected end of file"),
            "the message does not say the file is cut short: %s", msg);
  th_assert_mnist_zeroed(&m);
  th_ctx_free(ctx);
  th_remove_dir(dir);
}

Test(mnist, gzip_with_corrupted_deflate_data) {
  char dir[256], path[1200];
  th_idx_synthetic(dir, sizeof dir, true);
  snprintf(path, sizeof path, "%s/" TH_IDX_IMAGES ".gz", dir);
  th_corrupt_third(path);
  TH_EXPECT_MNIST_ERROR(dir, KILN_ERR_FORMAT, TH_IDX_IMAGES, "corrupt");
  th_remove_dir(dir);
}

Test(mnist, raw_truncated_data_and_header) {
  char dir[256];
  th_tmpdir(dir, sizeof dir, "mnist");
  th_blob im = th_idx_images(TH_IDX_N, TH_IDX_ROWS, TH_IDX_COLS), lb = th_idx_labels(TH_IDX_N);
  th_idx_put(dir, TH_IDX_LABELS, lb, false);
  th_blob cut = {im.p, 16 + 1000};
  th_idx_put(dir, TH_IDX_IMAGES, cut, false);
  TH_EXPECT_MNIST_ERROR(dir, KILN_ERR_FORMAT, TH_IDX_IMAGES, "truncated", "the data", "56000",
                        "1000");
  cut.n = 10;
  th_idx_put(dir, TH_IDX_IMAGES, cut, false);
  TH_EXPECT_MNIST_ERROR(dir, KILN_ERR_FORMAT, TH_IDX_IMAGES, "truncated", "the header", "16");
  cut.n = 0;
  th_idx_put(dir, TH_IDX_IMAGES, cut, false);
  TH_EXPECT_MNIST_ERROR(dir, KILN_ERR_FORMAT, TH_IDX_IMAGES, "truncated", "the header");
  /* the labels file cut short, images whole */
  th_idx_put(dir, TH_IDX_IMAGES, im, false);
  th_blob lcut = {lb.p, 8 + TH_IDX_N / 2};
  th_idx_put(dir, TH_IDX_LABELS, lcut, false);
  TH_EXPECT_MNIST_ERROR(dir, KILN_ERR_FORMAT, TH_IDX_LABELS, "truncated");
  free(im.p);
  free(lb.p);
  th_remove_dir(dir);
}

Test(mnist, wrong_magic_numbers) {
  char dir[256];
  th_tmpdir(dir, sizeof dir, "mnist");
  th_blob im = th_idx_images(TH_IDX_N, TH_IDX_ROWS, TH_IDX_COLS), lb = th_idx_labels(TH_IDX_N);
  th_idx_put(dir, TH_IDX_LABELS, lb, true);
  /* the images file with the labels' magic */
  th_be32_put(im.p, 0x801);
  th_idx_put(dir, TH_IDX_IMAGES, im, true);
  TH_EXPECT_MNIST_ERROR(dir, KILN_ERR_FORMAT, TH_IDX_IMAGES, "magic", "0x00000801", "0x00000803");
  /* files swapped: labels where the images belong */
  th_be32_put(im.p, 0x803);
  th_idx_put(dir, TH_IDX_IMAGES, lb, true);
  TH_EXPECT_MNIST_ERROR(dir, KILN_ERR_FORMAT, TH_IDX_IMAGES, "magic");
  /* images fine, labels file with a float dtype (0x0d) */
  th_idx_put(dir, TH_IDX_IMAGES, im, true);
  th_be32_put(lb.p, 0xd01);
  th_idx_put(dir, TH_IDX_LABELS, lb, true);
  TH_EXPECT_MNIST_ERROR(dir, KILN_ERR_FORMAT, TH_IDX_LABELS, "magic", "0x00000d01");
  free(im.p);
  free(lb.p);
  th_remove_dir(dir);
}

Test(mnist, zero_and_huge_dims) {
  char dir[256];
  th_tmpdir(dir, sizeof dir, "mnist");
  th_blob im = th_idx_images(TH_IDX_N, TH_IDX_ROWS, TH_IDX_COLS), lb = th_idx_labels(TH_IDX_N);
  th_idx_put(dir, TH_IDX_LABELS, lb, false);
  th_be32_put(im.p + 8, 0); /* zero rows */
  th_idx_put(dir, TH_IDX_IMAGES, im, false);
  TH_EXPECT_MNIST_ERROR(dir, KILN_ERR_FORMAT, TH_IDX_IMAGES, "dim 1 is 0");
  th_be32_put(im.p + 8, TH_IDX_ROWS);
  th_be32_put(im.p + 4, 0); /* zero images */
  th_idx_put(dir, TH_IDX_IMAGES, im, false);
  TH_EXPECT_MNIST_ERROR(dir, KILN_ERR_FORMAT, TH_IDX_IMAGES, "dim 0 is 0");
  th_be32_put(im.p + 4, 4000000000u); /* an absurd count must not be allocated */
  th_idx_put(dir, TH_IDX_IMAGES, im, false);
  TH_EXPECT_MNIST_ERROR(dir, KILN_ERR_FORMAT, TH_IDX_IMAGES, "dim 0 is 4000000000");
  free(im.p);
  free(lb.p);
  th_remove_dir(dir);
}

Test(mnist, image_and_label_counts_differ) {
  char dir[256];
  th_tmpdir(dir, sizeof dir, "mnist");
  th_blob im = th_idx_images(TH_IDX_N, TH_IDX_ROWS, TH_IDX_COLS), lb = th_idx_labels(TH_IDX_N - 1);
  th_idx_put(dir, TH_IDX_IMAGES, im, true);
  th_idx_put(dir, TH_IDX_LABELS, lb, true);
  TH_EXPECT_MNIST_ERROR(dir, KILN_ERR_FORMAT, TH_IDX_IMAGES, "100 images", "99 labels",
                        TH_IDX_LABELS);
  free(im.p);
  free(lb.p);
  th_remove_dir(dir);
}

Test(mnist, trailing_garbage) {
  char dir[256];
  th_tmpdir(dir, sizeof dir, "mnist");
  th_blob im = th_idx_images(TH_IDX_N, TH_IDX_ROWS, TH_IDX_COLS), lb = th_idx_labels(TH_IDX_N);
  th_idx_put(dir, TH_IDX_LABELS, lb, false);
  memcpy(im.p + im.n, "garbage", 7);
  th_blob longer = {im.p, im.n + 7};
  th_idx_put(dir, TH_IDX_IMAGES, longer, false);
  TH_EXPECT_MNIST_ERROR(dir, KILN_ERR_FORMAT, TH_IDX_IMAGES, "trailing bytes");
  /* the same bytes inside a gzip stream */
  char path[1200];
  snprintf(path, sizeof path, "%s/" TH_IDX_IMAGES, dir);
  unlink(path);
  th_idx_put(dir, TH_IDX_IMAGES, longer, true);
  TH_EXPECT_MNIST_ERROR(dir, KILN_ERR_FORMAT, TH_IDX_IMAGES ".gz", "trailing bytes");
  /* one extra label, images whole */
  th_idx_put(dir, TH_IDX_IMAGES, im, true);
  lb.p[lb.n] = 1;
  th_blob more = {lb.p, lb.n + 1};
  th_idx_put(dir, TH_IDX_LABELS, more, false);
  TH_EXPECT_MNIST_ERROR(dir, KILN_ERR_FORMAT, TH_IDX_LABELS, "trailing bytes");
  free(im.p);
  free(lb.p);
  th_remove_dir(dir);
}

Test(mnist, label_out_of_range) {
  char dir[256];
  th_tmpdir(dir, sizeof dir, "mnist");
  th_blob im = th_idx_images(TH_IDX_N, TH_IDX_ROWS, TH_IDX_COLS), lb = th_idx_labels(TH_IDX_N);
  lb.p[8 + 37] = 12;
  th_idx_put(dir, TH_IDX_IMAGES, im, true);
  th_idx_put(dir, TH_IDX_LABELS, lb, true);
  TH_EXPECT_MNIST_ERROR(dir, KILN_ERR_FORMAT, TH_IDX_LABELS, "label 12", "record 37", "0-9");
  free(im.p);
  free(lb.p);
  th_remove_dir(dir);
}

Test(mnist, missing_files) {
  char dir[256];
  th_tmpdir(dir, sizeof dir, "mnist");
  TH_EXPECT_MNIST_ERROR(dir, KILN_ERR_IO, TH_IDX_IMAGES, "cannot open", "No such file");
  th_blob im = th_idx_images(TH_IDX_N, TH_IDX_ROWS, TH_IDX_COLS);
  th_idx_put(dir, TH_IDX_IMAGES, im, true);
  TH_EXPECT_MNIST_ERROR(dir, KILN_ERR_IO, TH_IDX_LABELS, "cannot open");
  free(im.p);
  th_remove_dir(dir);
  TH_EXPECT_MNIST_ERROR("/nonexistent/kiln-mnist", KILN_ERR_IO, TH_IDX_IMAGES, "cannot open");
}

Test(mnist, random_bytes_that_are_not_gzip) {
  char dir[256];
  th_tmpdir(dir, sizeof dir, "mnist");
  th_blob junk = {malloc(4096), 4096};
  cr_assert_not_null(junk.p);
  th_rng r = {.s = 99};
  for (size_t i = 0; i < junk.n; i++)
    junk.p[i] = (unsigned char)th_rng_next(&r);
  junk.p[0] = 0x42; /* not the gzip magic 1f 8b */
  char path[1200];
  snprintf(path, sizeof path, "%s/" TH_IDX_IMAGES ".gz", dir);
  th_write_whole(path, junk.p, junk.n);
  th_blob lb = th_idx_labels(TH_IDX_N);
  th_idx_put(dir, TH_IDX_LABELS, lb, true);
  TH_EXPECT_MNIST_ERROR(dir, KILN_ERR_FORMAT, TH_IDX_IMAGES, "magic");
  /* random bytes after a real gzip header are corrupt deflate data */
  junk.p[0] = 0x1f;
  junk.p[1] = 0x8b;
  junk.p[2] = 8;
  junk.p[3] = 0;
  th_write_whole(path, junk.p, junk.n);
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_mnist m;
  memset(&m, 0xab, sizeof m);
  kiln_status st = kiln_mnist_read(ctx, dir, "train", &m);
  cr_assert(st == KILN_ERR_FORMAT, "status %s: %s", kiln_status_name(st), kiln_ctx_error(ctx));
  cr_assert_not_null(strstr(kiln_ctx_error(ctx), TH_IDX_IMAGES), "%s", kiln_ctx_error(ctx));
  th_assert_mnist_zeroed(&m);
  th_ctx_free(ctx);
  free(junk.p);
  free(lb.p);
  th_remove_dir(dir);
}

/* The KILN_MNIST directory, or the test is skipped with the reason. */
static const char *mnist_dir_or_skip(void) {
  const char *dir = getenv("KILN_MNIST");
  if (!dir || !*dir)
    cr_skip_test("KILN_MNIST is not set (it names the directory of the MNIST idx files, e.g. "
                 "/work/shared/data/mnist)");
  return dir;
}

static void assert_real_split(const kiln_mnist *m, int64_t n, int first_label) {
  cr_assert_eq(m->n, n);
  cr_assert_eq(m->rows, 28);
  cr_assert_eq(m->cols, 28);
  cr_assert_eq(m->labels[0], first_label, "first label %d", m->labels[0]);
  int64_t hist[10] = {0};
  for (int64_t i = 0; i < m->n; i++) {
    cr_assert_leq(m->labels[i], 9, "label %d of record %lld", m->labels[i], (long long)i);
    hist[m->labels[i]]++;
  }
  for (int c = 0; c < 10; c++)
    cr_assert(hist[c] > n / 20, "class %d has only %lld records", c, (long long)hist[c]);
  /* digits are dark strokes on a zero background: the corners are blank, the middle is not */
  int64_t ink = 0;
  for (int64_t i = 0; i < m->n; i++) {
    const uint8_t *im = m->images + i * 784;
    cr_assert_eq(im[0], 0, "image %lld has ink in its corner", (long long)i);
    for (int p = 0; p < 784; p++)
      ink += im[p] > 0;
  }
  cr_assert(ink > m->n * 784 / 10 && ink < m->n * 784 / 3, "ink in %lld of %lld pixels",
            (long long)ink, (long long)(m->n * 784));
}

Test(mnist, real_files) {
  const char *dir = mnist_dir_or_skip();
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_mnist tr, te;
  cr_assert_eq(kiln_mnist_read(ctx, dir, "train", &tr), KILN_OK, "%s", kiln_ctx_error(ctx));
  assert_real_split(&tr, 60000, 5);
  cr_assert_eq(kiln_mnist_read(ctx, dir, "t10k", &te), KILN_OK, "%s", kiln_ctx_error(ctx));
  assert_real_split(&te, 10000, 7);
  kiln_mnist_free(&tr);
  kiln_mnist_free(&te);
  th_ctx_free(ctx);
}

/* The bytes of a gzip file from offset skip on, read with zlib alone (malloc'd; *n their count). */
static uint8_t *gunzip_from(const char *path, long skip, size_t *n) {
  size_t len;
  uint8_t *buf = th_gunzip(path, &len);
  cr_assert_geq(len, (size_t)skip);
  memmove(buf, buf + skip, len - (size_t)skip);
  *n = len - (size_t)skip;
  return buf;
}

/* Fashion-MNIST (KILN_FASHION_MNIST; Debian's dataset-fashion-mnist: gzip idx files under
 * MNIST's names) through the same reader: every pixel and label as zlib alone decodes them past
 * the idx headers, its known first labels (9, an ankle boot, in both splits), and its ten
 * classes exactly balanced (6,000 and 1,000 each). */
Test(mnist, fashion_mnist_reads_exactly) {
  const char *dir = getenv("KILN_FASHION_MNIST");
  if (!dir || !*dir)
    cr_skip_test("KILN_FASHION_MNIST is not set (Debian's dataset-fashion-mnist installs it in "
                 "/usr/share/datasets/fashion-mnist)");
  const struct {
    const char *split;
    int64_t n;
  } splits[] = {{"train", 60000}, {"t10k", 10000}};
  kiln_ctx *ctx = th_cpu_ctx();
  for (int s = 0; s < 2; s++) {
    kiln_mnist m;
    cr_assert_eq(kiln_mnist_read(ctx, dir, splits[s].split, &m), KILN_OK, "%s",
                 kiln_ctx_error(ctx));
    cr_assert(m.n == splits[s].n && m.rows == 28 && m.cols == 28, "%s: %lld x %lld x %lld",
              splits[s].split, (long long)m.n, (long long)m.rows, (long long)m.cols);
    char path[512];
    size_t ni, nl;
    snprintf(path, sizeof path, "%s/%s-images-idx3-ubyte.gz", dir, splits[s].split);
    uint8_t *im = gunzip_from(path, 16, &ni);
    snprintf(path, sizeof path, "%s/%s-labels-idx1-ubyte.gz", dir, splits[s].split);
    uint8_t *lb = gunzip_from(path, 8, &nl);
    cr_assert_eq(ni, (size_t)m.n * 784);
    cr_assert_eq(nl, (size_t)m.n);
    cr_assert_eq(memcmp(im, m.images, ni), 0, "%s: the images as zlib decodes them",
                 splits[s].split);
    cr_assert_eq(memcmp(lb, m.labels, nl), 0, "%s: the labels", splits[s].split);
    cr_assert_eq(m.labels[0], 9, "%s: an ankle boot first", splits[s].split);
    int64_t hist[10] = {0};
    for (int64_t i = 0; i < m.n; i++)
      hist[m.labels[i]]++;
    for (int c = 0; c < 10; c++)
      cr_assert_eq(hist[c], m.n / 10, "%s: class %d has %lld", splits[s].split, c,
                   (long long)hist[c]);
    free(im);
    free(lb);
    kiln_mnist_free(&m);
  }
  th_ctx_free(ctx);
}

/* Decompresses src (gzip) into dst (raw). */
static void gunzip_file(const char *src, const char *dst) {
  size_t n;
  uint8_t *raw = th_gunzip(src, &n);
  th_write_whole(dst, raw, n);
  free(raw);
}

Test(mnist, real_files_raw_copy_and_cut_copy) {
  const char *dir = mnist_dir_or_skip();
  char raw[256], src[1200], dst[1200];
  th_tmpdir(raw, sizeof raw, "mnist-raw");
  const char *names[2] = {"t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"};
  for (int i = 0; i < 2; i++) {
    snprintf(src, sizeof src, "%s/%s.gz", dir, names[i]);
    snprintf(dst, sizeof dst, "%s/%s", raw, names[i]);
    gunzip_file(src, dst);
  }
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_mnist gz, rw;
  cr_assert_eq(kiln_mnist_read(ctx, dir, "t10k", &gz), KILN_OK, "%s", kiln_ctx_error(ctx));
  cr_assert_eq(kiln_mnist_read(ctx, raw, "t10k", &rw), KILN_OK, "%s", kiln_ctx_error(ctx));
  assert_real_split(&rw, 10000, 7);
  cr_assert_eq(memcmp(gz.images, rw.images, 10000 * 784), 0, "raw and gzip images differ");
  cr_assert_eq(memcmp(gz.labels, rw.labels, 10000), 0, "raw and gzip labels differ");
  kiln_mnist_free(&gz);
  kiln_mnist_free(&rw);

  /* the real gzip file cut in the middle */
  snprintf(dst, sizeof dst, "%s/t10k-images-idx3-ubyte", raw);
  unlink(dst);
  size_t n;
  snprintf(src, sizeof src, "%s/t10k-images-idx3-ubyte.gz", dir);
  char *p = th_read_whole(src, &n);
  snprintf(dst, sizeof dst, "%s/t10k-images-idx3-ubyte.gz", raw);
  th_write_whole(dst, p, n / 2);
  free(p);
  kiln_mnist m;
  memset(&m, 0xab, sizeof m);
  cr_assert_eq(kiln_mnist_read(ctx, raw, "t10k", &m), KILN_ERR_FORMAT, "%s", kiln_ctx_error(ctx));
  const char *msg = kiln_ctx_error(ctx);
  cr_assert_not_null(strstr(msg, "t10k-images-idx3-ubyte.gz"), "%s", msg);
  cr_assert(strstr(msg, "truncated") || strstr(msg, "unexpected end of file"), "%s", msg);
  th_assert_mnist_zeroed(&m);
  th_ctx_free(ctx);
  th_remove_dir(raw);
}
