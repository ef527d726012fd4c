/*
 * test_cpu_cifar10.c: the CIFAR-10 reader (data/cifar10.c, data/cifar10_bytes.c) without a GPU:
 * the byte level (xz round trips, size limits, trailing garbage; record checks and the CHW to HWC
 * change of layout); synthetic batches, raw, gzip and xz, read back exactly; truncated, corrupted,
 * mislabelled, empty, oversized and missing files each refused with a message naming the file and
 * the record or the size, the result untouched; and the sample ($KILN_CIFAR10_SAMPLE) and the full
 * data set ($KILN_CIFAR10), with their known first labels and pixels checked against the raw bytes.
 */
#include <lzma.h>
#include <stdarg.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include "../data/readers.h"
#include "inspect.h"

TestSuite(cifar10, .fini = th_remove_tmpdirs);

#define REC KILN__CIFAR10_RECORD
#define PIX KILN__CIFAR10_PIXELS

/* ---------------------------------------------------------------- synthetic batches */

/* Channel c of pixel p (row-major in 32x32) of record i of synthetic batch `batch`: every
 * record, channel and pixel different enough that a layout mix-up shows. */
static uint8_t synth_pixel(int batch, size_t i, size_t c, size_t p) {
  return (uint8_t)(batch * 101 + i * 31 + c * 87 + p * 3 + (p >> 5) * 5);
}
static uint8_t synth_label(int batch, size_t i) { return (uint8_t)((i * 7 + (size_t)batch) % 10); }

/* A synthetic batch of n records in the file layout (malloc'd, n * 3073 bytes). */
static uint8_t *synth_batch(int batch, size_t n) {
  uint8_t *b = malloc(n * REC + 1);
  cr_assert_not_null(b);
  for (size_t i = 0; i < n; i++) {
    uint8_t *r = b + i * REC;
    r[0] = synth_label(batch, i);
    for (size_t c = 0; c < 3; c++)
      for (size_t p = 0; p < 1024; p++)
        r[1 + c * 1024 + p] = synth_pixel(batch, i, c, p);
  }
  return b;
}

/* Asserts that records [0, n) of c, from `from` on, are synthetic batch `batch`, channels last. */
static void assert_synth(const kiln_cifar10 *c, int64_t from, int batch, size_t n) {
  for (size_t i = 0; i < n; i++) {
    size_t k = (size_t)from + i;
    cr_assert_eq(c->labels[k], synth_label(batch, i), "label of record %zu", k);
    const uint8_t *im = c->images + k * PIX;
    for (size_t p = 0; p < 1024; p++)
      for (size_t ch = 0; ch < 3; ch++)
        cr_assert_eq(im[p * 3 + ch], synth_pixel(batch, i, ch, p),
                     "record %zu, pixel (%zu, %zu), channel %zu", k, p / 32, p % 32, ch);
  }
}

/* xz data of p (n bytes) from liblzma's easy encoder (malloc'd; *out_n its length). */
static uint8_t *xz_encode(const uint8_t *p, size_t n, size_t *out_n) {
  size_t cap = lzma_stream_buffer_bound(n), pos = 0;
  uint8_t *out = malloc(cap);
  cr_assert_not_null(out);
  lzma_ret r = lzma_easy_buffer_encode(1, LZMA_CHECK_CRC64, NULL, p, n, out, &pos, cap);
  cr_assert_eq(r, LZMA_OK, "lzma_easy_buffer_encode: %d", (int)r);
  *out_n = pos;
  return out;
}

/* gzip data of p (n bytes), with zlib (malloc'd; *out_n its length). */
static uint8_t *gz_encode(const uint8_t *p, size_t n, size_t *out_n) {
  z_stream z;
  memset(&z, 0, sizeof z);
  cr_assert_eq(deflateInit2(&z, 6, Z_DEFLATED, 16 + MAX_WBITS, 8, Z_DEFAULT_STRATEGY), Z_OK);
  size_t cap = deflateBound(&z, (uLong)n);
  uint8_t *out = malloc(cap);
  cr_assert_not_null(out);
  z.next_in = (Bytef *)(uintptr_t)p;
  z.avail_in = (uInt)n;
  z.next_out = out;
  z.avail_out = (uInt)cap;
  cr_assert_eq(deflate(&z, Z_FINISH), Z_STREAM_END);
  *out_n = cap - z.avail_out;
  deflateEnd(&z);
  return out;
}

typedef enum { BIN, GZ, XZ } packing;
static const char *suffixes[3] = {".bin", ".bin.gz", ".bin.xz"};

/* Writes p (n bytes) as dir/stem.bin, .bin.gz or .bin.xz, compressed as the name says. */
static void put_batch(const char *dir, const char *stem, const uint8_t *p, size_t n, packing k) {
  char path[1200];
  snprintf(path, sizeof path, "%s/%s%s", dir, stem, suffixes[k]);
  size_t m = n;
  uint8_t *z = k == GZ ? gz_encode(p, n, &m) : k == XZ ? xz_encode(p, n, &m) : NULL;
  th_write_whole(path, z ? z : p, m);
  free(z);
}

static void remove_file(const char *dir, const char *stem, packing k) {
  char path[1200];
  snprintf(path, sizeof path, "%s/%s%s", dir, stem, suffixes[k]);
  cr_assert_eq(unlink(path), 0, "unlink %s", path);
}

/* Reads a split that must fail with status want: *out stays as it was, the context's error is
 * set, and its message names kiln_cifar10_read and holds every substring (the list ends with
 * NULL). */
static void expect_error(const char *dir, const char *split, kiln_status want, ...) {
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_cifar10 c, sentinel;
  memset(&sentinel, 0xab, sizeof sentinel);
  c = sentinel;
  kiln_status st = kiln_cifar10_read(ctx, dir, split, &c);
  cr_assert_eq(st, want, "status %s (%s expected): %s", kiln_status_name(st),
               kiln_status_name(want), th_err(ctx));
  cr_assert_eq(kiln_ctx_status(ctx), want, "the context's status is not the error");
  cr_assert_eq(memcmp(&c, &sentinel, sizeof c), 0, "a failed read changed *out");
  const char *msg = kiln_ctx_error(ctx);
  cr_assert_not_null(msg);
  cr_assert_not_null(strstr(msg, "kiln_cifar10_read: "), "%s", msg);
  va_list ap;
  va_start(ap, want);
  for (const char *s = va_arg(ap, const char *); s; s = va_arg(ap, const char *))
    cr_assert_not_null(strstr(msg, s), "the message does not hold \"%s\": %s", s, msg);
  va_end(ap);
  /* the error is sticky: a later read on the context does nothing, out untouched */
  cr_assert_eq(kiln_cifar10_read(ctx, dir, "test", &c), want);
  cr_assert_eq(memcmp(&c, &sentinel, sizeof c), 0);
  th_ctx_free(ctx);
}
#define EXPECT_ERROR(dir, split, status, ...)                                                      \
  expect_error((dir), (split), (status), __VA_ARGS__, (const char *)NULL)

/* ---------------------------------------------------------------- byte level */

Test(cifar10, unxz_round_trip_and_concatenated_streams) {
  uint8_t *b = synth_batch(0, 3);
  size_t zn, len = 0;
  uint8_t *z = xz_encode(b, 3 * REC, &zn);
  char why[400] = "";
  uint8_t *out = kiln__unxz(z, zn, 3 * REC, &len, why, sizeof why); /* exactly max_out bytes */
  cr_assert_not_null(out, "%s", why);
  cr_assert_eq(len, 3 * REC);
  cr_assert_eq(memcmp(out, b, len), 0);
  free(out);
  /* two streams with four bytes of stream padding between them give both, in order */
  size_t z2n;
  uint8_t *z2 = xz_encode(b + REC, 2 * REC, &z2n);
  uint8_t *cat = malloc(zn + 4 + z2n);
  cr_assert_not_null(cat);
  memcpy(cat, z, zn);
  memset(cat + zn, 0, 4);
  memcpy(cat + zn + 4, z2, z2n);
  out = kiln__unxz(cat, zn + 4 + z2n, 10 * REC, &len, why, sizeof why);
  cr_assert_not_null(out, "%s", why);
  cr_assert_eq(len, 5 * REC);
  cr_assert_eq(memcmp(out, b, 3 * REC), 0);
  cr_assert_eq(memcmp(out + 3 * REC, b + REC, 2 * REC), 0);
  free(out);
  /* padding that is not a multiple of four bytes is not stream padding */
  cr_assert_null(kiln__unxz(cat, zn + 3, 10 * REC, &len, why, sizeof why));
  cr_assert_not_null(strstr(why, "3 bytes of trailing garbage"), "%s", why);
  free(cat);
  free(z2);
  free(z);
  free(b);
}

Test(cifar10, unxz_refuses_more_than_max_out) {
  uint8_t *b = synth_batch(1, 4);
  size_t zn, len = 12345;
  uint8_t *z = xz_encode(b, 4 * REC, &zn);
  char why[400] = "";
  cr_assert_null(kiln__unxz(z, zn, 4 * REC - 1, &len, why, sizeof why));
  char want[100];
  snprintf(want, sizeof want, "decompresses to more than %d bytes", 4 * REC - 1);
  cr_assert_not_null(strstr(why, want), "%s", why);
  cr_assert_eq(len, 12345, "len was written on failure");
  cr_assert_null(kiln__unxz(z, zn, 0, &len, why, sizeof why));
  cr_assert_not_null(strstr(why, "more than 0 bytes"), "%s", why);
  free(z);
  free(b);
}

Test(cifar10, unxz_truncated_corrupted_garbage_and_not_xz) {
  uint8_t *b = synth_batch(2, 2);
  size_t zn, len;
  uint8_t *z = xz_encode(b, 2 * REC, &zn);
  char why[400] = "";
  /* cut anywhere: in the header, the data, the index, the footer */
  size_t cuts[5] = {3, 12, zn / 2, zn - 13, zn - 1};
  for (int i = 0; i < 5; i++) {
    why[0] = 0;
    cr_assert_null(kiln__unxz(z, cuts[i], 1 << 20, &len, why, sizeof why), "cut at %zu", cuts[i]);
    cr_assert_not_null(strstr(why, "truncated"), "cut at %zu: %s", cuts[i], why);
  }
  /* a flipped byte in the compressed data */
  uint8_t *bad = malloc(zn + 8);
  cr_assert_not_null(bad);
  memcpy(bad, z, zn);
  bad[zn / 2] ^= 0x55;
  cr_assert_null(kiln__unxz(bad, zn, 1 << 20, &len, why, sizeof why));
  cr_assert_not_null(strstr(why, "corrupt xz data"), "%s", why);
  /* bytes after the stream */
  memcpy(bad, z, zn);
  memcpy(bad + zn, "garbage!", 8);
  cr_assert_null(kiln__unxz(bad, zn + 8, 1 << 20, &len, why, sizeof why));
  cr_assert_not_null(strstr(why, "8 bytes of trailing garbage after the xz data"), "%s", why);
  /* not xz at all, and nothing */
  cr_assert_null(kiln__unxz(b, 2 * REC, 1 << 20, &len, why, sizeof why));
  cr_assert_not_null(strstr(why, "not xz data"), "%s", why);
  cr_assert_null(kiln__unxz(b, 0, 1 << 20, &len, why, sizeof why));
  cr_assert_not_null(strstr(why, "empty"), "%s", why);
  free(bad);
  free(z);
  free(b);
}

Test(cifar10, record_checks_and_unpacking) {
  uint8_t *b = synth_batch(3, 20);
  int64_t n = -1;
  char why[400] = "";
  cr_assert(kiln__cifar10_check(b, 20 * REC, &n, why, sizeof why), "%s", why);
  cr_assert_eq(n, 20);
  /* sizes: nothing, one byte short, one byte over */
  cr_assert_not(kiln__cifar10_check(b, 0, &n, why, sizeof why));
  cr_assert_not_null(strstr(why, "empty"), "%s", why);
  cr_assert_not(kiln__cifar10_check(b, 20 * REC - 1, &n, why, sizeof why));
  cr_assert_not_null(strstr(why, "61459 bytes"), "%s", why);
  cr_assert_not_null(strstr(why, "19 records and 3072 bytes over"), "%s", why);
  cr_assert_not(kiln__cifar10_check(b, 2 * REC + 1, &n, why, sizeof why));
  cr_assert_not_null(strstr(why, "2 records and 1 bytes over"), "%s", why);
  /* the first bad label is named, by record and value */
  b[17 * REC] = 12;
  b[18 * REC] = 255;
  cr_assert_not(kiln__cifar10_check(b, 20 * REC, &n, why, sizeof why));
  cr_assert_str_eq(why, "record 17: label 12 (expected 0..9)");
  b[17 * REC] = 9;
  cr_assert_not(kiln__cifar10_check(b, 20 * REC, &n, why, sizeof why));
  cr_assert_str_eq(why, "record 18: label 255 (expected 0..9)");
  b[18 * REC] = 0;
  /* unpacking: channels first in the file, channels last out */
  uint8_t *images = malloc(20 * PIX), labels[20];
  cr_assert_not_null(images);
  kiln__cifar10_unpack(b, 20, images, labels);
  for (size_t i = 0; i < 20; i++) {
    cr_assert_eq(labels[i], b[i * REC]);
    for (size_t y = 0; y < 32; y++)
      for (size_t x = 0; x < 32; x++)
        for (size_t c = 0; c < 3; c++)
          cr_assert_eq(images[i * PIX + (y * 32 + x) * 3 + c],
                       b[i * REC + 1 + c * 1024 + y * 32 + x], "record %zu (%zu, %zu, %zu)", i, y,
                       x, c);
  }
  free(images);
  free(b);
}

/* ---------------------------------------------------------------- synthetic files */

Test(cifar10, raw_gzip_and_xz_read_back) {
  char dir[256];
  th_tmpdir(dir, sizeof dir, "cifar10");
  const size_t n = 37;
  for (int k = 0; k < 3; k++) {
    uint8_t *b = synth_batch(k, n);
    put_batch(dir, "test_batch", b, n * REC, (packing)k);
    free(b);
    kiln_ctx *ctx = th_cpu_ctx();
    kiln_cifar10 c;
    cr_assert_eq(kiln_cifar10_read(ctx, dir, "test", &c), KILN_OK, "%s: %s", suffixes[k],
                 th_err(ctx));
    cr_assert_null(kiln_ctx_error(ctx));
    cr_assert_eq(c.n, (int64_t)n);
    assert_synth(&c, 0, k, n);
    /* the batch's own name reads the same */
    kiln_cifar10 d;
    cr_assert_eq(kiln_cifar10_read(ctx, dir, "test_batch", &d), KILN_OK, "%s", th_err(ctx));
    cr_assert_eq(d.n, c.n);
    cr_assert_eq(memcmp(d.images, c.images, n * PIX), 0);
    cr_assert_eq(memcmp(d.labels, c.labels, n), 0);
    kiln_cifar10_free(&c);
    kiln_cifar10_free(&d);
    cr_assert_eq(c.n, 0);
    cr_assert_null(c.images);
    cr_assert_null(c.labels);
    kiln_cifar10_free(&c); /* a freed struct, and NULL, are fine */
    kiln_cifar10_free(NULL);
    th_ctx_free(ctx);
    remove_file(dir, "test_batch", (packing)k);
  }
  th_remove_dir(dir);
}

Test(cifar10, train_concatenates_five_batches_in_order) {
  char dir[256], stem[32];
  th_tmpdir(dir, sizeof dir, "cifar10");
  size_t sizes[5] = {3, 5, 1, 4, 2};
  for (int k = 0; k < 5; k++) {
    uint8_t *b = synth_batch(k + 1, sizes[k]);
    snprintf(stem, sizeof stem, "data_batch_%d", k + 1);
    put_batch(dir, stem, b, sizes[k] * REC, (packing)(k % 3)); /* mixed packings */
    free(b);
  }
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_cifar10 c;
  cr_assert_eq(kiln_cifar10_read(ctx, dir, "train", &c), KILN_OK, "%s", th_err(ctx));
  cr_assert_eq(c.n, 15);
  int64_t at = 0;
  for (int k = 0; k < 5; k++) {
    assert_synth(&c, at, k + 1, sizes[k]);
    at += (int64_t)sizes[k];
  }
  kiln_cifar10_free(&c);
  /* one batch alone */
  cr_assert_eq(kiln_cifar10_read(ctx, dir, "data_batch_4", &c), KILN_OK, "%s", th_err(ctx));
  cr_assert_eq(c.n, 4);
  assert_synth(&c, 0, 4, 4);
  kiln_cifar10_free(&c);
  th_ctx_free(ctx);
  /* the first of .bin, .bin.gz and .bin.xz is read when several files of a batch exist */
  uint8_t *b = synth_batch(9, 2);
  put_batch(dir, "data_batch_2", b, 2 * REC, XZ);
  free(b);
  ctx = th_cpu_ctx();
  cr_assert_eq(kiln_cifar10_read(ctx, dir, "data_batch_2", &c), KILN_OK, "%s", th_err(ctx));
  cr_assert_eq(c.n, 5);
  assert_synth(&c, 0, 2, 5);
  kiln_cifar10_free(&c);
  th_ctx_free(ctx);
  /* a batch missing from the middle is named */
  remove_file(dir, "data_batch_3", XZ);
  EXPECT_ERROR(dir, "train", KILN_ERR_IO, "data_batch_3.bin", ".bin.gz", ".bin.xz", "cannot open",
               "No such file");
  th_remove_dir(dir);
}

Test(cifar10, truncated_and_mislabelled_files) {
  char dir[256];
  th_tmpdir(dir, sizeof dir, "cifar10");
  uint8_t *b = synth_batch(0, 30);
  /* raw, cut inside record 20 */
  put_batch(dir, "test_batch", b, 20 * REC + 1000, BIN);
  EXPECT_ERROR(dir, "test", KILN_ERR_FORMAT, "test_batch.bin: ", "62460 bytes",
               "20 records and 1000 bytes over");
  /* the same inside gzip and xz: the size is checked after decompressing */
  remove_file(dir, "test_batch", BIN);
  put_batch(dir, "test_batch", b, 20 * REC + 1000, GZ);
  EXPECT_ERROR(dir, "test", KILN_ERR_FORMAT, "test_batch.bin.gz: ", "20 records and 1000 bytes");
  remove_file(dir, "test_batch", GZ);
  put_batch(dir, "test_batch", b, 30 * REC - 1, XZ);
  EXPECT_ERROR(dir, "test", KILN_ERR_FORMAT, "test_batch.bin.xz: ", "29 records and 3072 bytes");
  remove_file(dir, "test_batch", XZ);
  /* a bad label, raw and xz */
  b[17 * REC] = 12;
  put_batch(dir, "test_batch", b, 30 * REC, BIN);
  EXPECT_ERROR(dir, "test", KILN_ERR_FORMAT, "test_batch.bin: record 17: label 12 (expected 0..9)");
  remove_file(dir, "test_batch", BIN);
  b[17 * REC] = 3;
  b[29 * REC] = 10;
  put_batch(dir, "test_batch", b, 30 * REC, XZ);
  EXPECT_ERROR(dir, "test", KILN_ERR_FORMAT,
               "test_batch.bin.xz: record 29: label 10 (expected 0..9)");
  free(b);
  th_remove_dir(dir);
}

/* Writes p (n bytes) packed as k into dir/test_batch.*, then changes it with f. */
static void put_changed(const char *dir, const uint8_t *p, size_t n, packing k,
                        void (*f)(const char *path)) {
  put_batch(dir, "test_batch", p, n, k);
  char path[1200];
  snprintf(path, sizeof path, "%s/test_batch%s", dir, suffixes[k]);
  f(path);
}

static void add_garbage(const char *path) {
  size_t n;
  char *p = th_read_whole(path, &n);
  char *q = realloc(p, n + 5);
  cr_assert_not_null(q);
  memcpy(q + n, "junk!", 5);
  th_write_whole(path, q, n + 5);
  free(q);
}

Test(cifar10, corrupted_and_truncated_compressed_files) {
  char dir[256];
  th_tmpdir(dir, sizeof dir, "cifar10");
  uint8_t *b = synth_batch(5, 40);
  put_changed(dir, b, 40 * REC, GZ, th_corrupt_third);
  EXPECT_ERROR(dir, "test", KILN_ERR_FORMAT, "test_batch.bin.gz: ", "corrupt");
  remove_file(dir, "test_batch", GZ);
  put_changed(dir, b, 40 * REC, GZ, th_truncate_half);
  EXPECT_ERROR(dir, "test", KILN_ERR_FORMAT, "test_batch.bin.gz: ", "truncated");
  remove_file(dir, "test_batch", GZ);
  put_changed(dir, b, 40 * REC, XZ, th_corrupt_third);
  EXPECT_ERROR(dir, "test", KILN_ERR_FORMAT, "test_batch.bin.xz: ", "corrupt xz data");
  remove_file(dir, "test_batch", XZ);
  put_changed(dir, b, 40 * REC, XZ, th_truncate_half);
  EXPECT_ERROR(dir, "test", KILN_ERR_FORMAT, "test_batch.bin.xz: ", "truncated");
  remove_file(dir, "test_batch", XZ);
  put_changed(dir, b, 40 * REC, XZ, add_garbage);
  EXPECT_ERROR(dir, "test", KILN_ERR_FORMAT, "test_batch.bin.xz: ", "5 bytes of trailing garbage");
  remove_file(dir, "test_batch", XZ);
  /* a raw batch under an .xz name is no xz data */
  char path[1200];
  snprintf(path, sizeof path, "%s/test_batch.bin.xz", dir);
  th_write_whole(path, b, 40 * REC);
  EXPECT_ERROR(dir, "test", KILN_ERR_FORMAT, "test_batch.bin.xz: ", "not xz data");
  free(b);
  th_remove_dir(dir);
}

Test(cifar10, empty_oversized_and_odd_files) {
  char dir[256], path[1200];
  th_tmpdir(dir, sizeof dir, "cifar10");
  for (int k = 0; k < 3; k++) {
    snprintf(path, sizeof path, "%s/test_batch%s", dir, suffixes[k]);
    th_write_whole(path, "", 0);
    EXPECT_ERROR(dir, "test", KILN_ERR_FORMAT, suffixes[k], "empty file");
    cr_assert_eq(unlink(path), 0);
  }
  /* a raw file of five batches' size (sparse: nothing is written) is refused before reading */
  snprintf(path, sizeof path, "%s/data_batch_1.bin", dir);
  FILE *f = fopen(path, "wb");
  cr_assert_not_null(f);
  cr_assert_eq(ftruncate(fileno(f), (off_t)5 * 10000 * REC), 0);
  fclose(f);
  EXPECT_ERROR(dir, "data_batch_1", KILN_ERR_FORMAT, "data_batch_1.bin: ", "153650000 bytes",
               "more than one CIFAR-10 file may hold");
  cr_assert_eq(unlink(path), 0);
  /* a directory where the file should be */
  snprintf(path, sizeof path, "%s/test_batch.bin", dir);
  cr_assert_eq(mkdir(path, 0700), 0);
  EXPECT_ERROR(dir, "test", KILN_ERR_IO, "test_batch.bin: not a regular file");
  cr_assert_eq(rmdir(path), 0);
  th_remove_dir(dir);
}

Test(cifar10, bad_arguments) {
  EXPECT_ERROR("/nonexistent", "validation", KILN_ERR_INVALID, "split 'validation'", "\"train\"");
  EXPECT_ERROR("/nonexistent", "data_batch_6", KILN_ERR_INVALID, "data_batch_6");
  EXPECT_ERROR("/nonexistent", NULL, KILN_ERR_INVALID, "(null)");
  EXPECT_ERROR(NULL, "test", KILN_ERR_INVALID, "NULL dir");
  EXPECT_ERROR("/nonexistent/kiln-cifar10", "test", KILN_ERR_IO,
               "/nonexistent/kiln-cifar10/test_batch.bin", "cannot open");
  kiln_ctx *ctx = th_cpu_ctx();
  cr_assert_eq(kiln_cifar10_read(ctx, "/nonexistent", "test", NULL), KILN_ERR_INVALID);
  TH_ASSERT_ERROR(ctx, KILN_ERR_INVALID, "kiln_cifar10_read", "NULL out");
  th_ctx_free(ctx);
  kiln_cifar10 c;
  cr_assert_eq(kiln_cifar10_read(NULL, "/nonexistent", "test", &c), KILN_ERR_INVALID);
}

Test(cifar10, dataset_refuses_bad_input_before_uploading) {
  kiln_ctx *ctx = th_cpu_ctx();
  uint8_t images[2 * PIX] = {0}, labels[2] = {3, 10};
  kiln_cifar10 c = {.n = 2, .images = images, .labels = labels};
  float mean[3] = {0.5f, 0.5f, 0.5f}, std[3] = {0.25f, 0.25f, 0.25f};
  cr_assert_null(kiln_dataset_from_cifar10(ctx, &c, mean, std));
  TH_ASSERT_ERROR(ctx, KILN_ERR_INVALID, "kiln_dataset_from_cifar10", "record 1: label 10");
  kiln_ctx_clear_error(ctx);
  labels[1] = 9;
  cr_assert_null(kiln_dataset_from_cifar10(ctx, &c, mean, NULL));
  TH_ASSERT_ERROR(ctx, KILN_ERR_INVALID, "kiln_dataset_from_cifar10", "a mean without a std");
  kiln_ctx_clear_error(ctx);
  cr_assert_null(kiln_dataset_from_cifar10(ctx, &c, NULL, std));
  TH_ASSERT_ERROR(ctx, KILN_ERR_INVALID, "a std without a mean");
  kiln_ctx_clear_error(ctx);
  std[1] = 0.f;
  cr_assert_null(kiln_dataset_from_cifar10(ctx, &c, mean, std));
  TH_ASSERT_ERROR(ctx, KILN_ERR_INVALID, "channel 1");
  kiln_ctx_clear_error(ctx);
  kiln_cifar10 empty = {0};
  cr_assert_null(kiln_dataset_from_cifar10(ctx, &empty, NULL, NULL));
  TH_ASSERT_ERROR(ctx, KILN_ERR_INVALID, "kiln_dataset_from_cifar10", "empty data set");
  kiln_ctx_clear_error(ctx);
  cr_assert_null(kiln_dataset_from_cifar10(ctx, NULL, NULL, NULL));
  TH_ASSERT_ERROR(ctx, KILN_ERR_INVALID, "empty data set");
  th_ctx_free(ctx);
  cr_assert_null(kiln_dataset_from_cifar10(NULL, &c, NULL, NULL));
}

/* ---------------------------------------------------------------- the sample and the data set */

/* The directory named by the environment variable var, or the test is skipped with the reason. */
static const char *dir_or_skip(const char *var, const char *what) {
  const char *dir = getenv(var);
  if (!dir || !*dir) cr_skip_test("%s is not set (it names the directory of %s)", var, what);
  return dir;
}

/* Asserts that c holds exactly the records of the file layout raw (n records), channels last. */
static void assert_matches_raw(const kiln_cifar10 *c, const uint8_t *raw, size_t n) {
  cr_assert_eq(c->n, (int64_t)n);
  for (size_t i = 0; i < n; i++) {
    const uint8_t *r = raw + i * REC, *im = c->images + i * PIX;
    cr_assert_eq(c->labels[i], r[0], "label of record %zu", i);
    for (size_t p = 0; p < 1024; p++)
      for (size_t ch = 0; ch < 3; ch++)
        if (im[p * 3 + ch] != r[1 + ch * 1024 + p])
          cr_assert_fail("record %zu, pixel (%zu, %zu), channel %zu: %u, file %u", i, p / 32,
                         p % 32, ch, im[p * 3 + ch], r[1 + ch * 1024 + p]);
  }
}

/* Asserts the first ten labels, and that every class is there. */
static void assert_labels(const kiln_cifar10 *c, const int first[10]) {
  for (int i = 0; i < 10; i++)
    cr_assert_eq(c->labels[i], first[i], "label %d is %d, not %d", i, c->labels[i], first[i]);
  int64_t hist[10] = {0};
  for (int64_t i = 0; i < c->n; i++)
    hist[c->labels[i]]++;
  for (int k = 0; k < 10; k++)
    cr_assert(hist[k] > c->n / 20, "class %d has only %lld records", k, (long long)hist[k]);
}

static const int test_first[10] = {3, 8, 8, 0, 6, 6, 1, 6, 3, 1};
static const int train_first[10] = {6, 9, 9, 4, 1, 1, 2, 7, 8, 3};

Test(cifar10, sample_files) {
  const char *dir = dir_or_skip("KILN_CIFAR10_SAMPLE", "the CIFAR-10 sample, e.g. "
                                                       "/work/shared/data/cifar10-sample");
  kiln_ctx *ctx = th_cpu_ctx();
  const char *split[2] = {"test", "data_batch_1"}, *file[2] = {"test_batch", "data_batch_1"};
  const int *first[2] = {test_first, train_first};
  for (int s = 0; s < 2; s++) {
    kiln_cifar10 c;
    cr_assert_eq(kiln_cifar10_read(ctx, dir, split[s], &c), KILN_OK, "%s", th_err(ctx));
    cr_assert_eq(c.n, 1000);
    assert_labels(&c, first[s]);
    char path[1200];
    snprintf(path, sizeof path, "%s/%s.bin.gz", dir, file[s]);
    size_t n;
    uint8_t *raw = th_gunzip(path, &n);
    cr_assert_eq(n, 1000 * REC);
    assert_matches_raw(&c, raw, 1000);
    /* a pixel by hand: record 0's red, green and blue at (row 5, column 7) */
    size_t p = 5 * 32 + 7;
    for (size_t ch = 0; ch < 3; ch++)
      cr_assert_eq(c.images[p * 3 + ch], raw[1 + ch * 1024 + p]);
    /* the same records as raw and as xz files read the same */
    char tmp[256];
    th_tmpdir(tmp, sizeof tmp, "cifar10-sample");
    for (int k = 0; k < 3; k += 2) {
      put_batch(tmp, file[s], raw, n, (packing)k);
      kiln_cifar10 d;
      cr_assert_eq(kiln_cifar10_read(ctx, tmp, split[s], &d), KILN_OK, "%s", th_err(ctx));
      cr_assert_eq(d.n, 1000);
      cr_assert_eq(memcmp(d.images, c.images, 1000 * PIX), 0, "%s differs", suffixes[k]);
      cr_assert_eq(memcmp(d.labels, c.labels, 1000), 0);
      kiln_cifar10_free(&d);
      remove_file(tmp, file[s], (packing)k);
    }
    th_remove_dir(tmp);
    free(raw);
    kiln_cifar10_free(&c);
  }
  th_ctx_free(ctx);
  /* the sample has no data_batch_2: "train" is an error naming it */
  EXPECT_ERROR(dir, "train", KILN_ERR_IO, "data_batch_2.bin", "cannot open");
}

Test(cifar10, sample_cut_copy) {
  const char *dir = dir_or_skip("KILN_CIFAR10_SAMPLE", "the CIFAR-10 sample, e.g. "
                                                       "/work/shared/data/cifar10-sample");
  char src[1200], dst[1200], tmp[256];
  snprintf(src, sizeof src, "%s/test_batch.bin.gz", dir);
  th_tmpdir(tmp, sizeof tmp, "cifar10-cut");
  snprintf(dst, sizeof dst, "%s/test_batch.bin.gz", tmp);
  size_t n;
  char *p = th_read_whole(src, &n);
  th_write_whole(dst, p, n / 2);
  free(p);
  EXPECT_ERROR(tmp, "test", KILN_ERR_FORMAT, "test_batch.bin.gz: ", "truncated");
  /* the decompressed records with one label changed */
  uint8_t *raw = th_gunzip(src, &n);
  raw[123 * REC] = 42;
  cr_assert_eq(unlink(dst), 0);
  put_batch(tmp, "test_batch", raw, n, XZ);
  EXPECT_ERROR(tmp, "test", KILN_ERR_FORMAT, "test_batch.bin.xz: record 123: label 42");
  free(raw);
  th_remove_dir(tmp);
}

Test(cifar10, full_data_set) {
  const char *dir = dir_or_skip("KILN_CIFAR10", "the CIFAR-10 binary batches, e.g. "
                                                "/work/shared/data/cifar10");
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_cifar10 te, tr;
  cr_assert_eq(kiln_cifar10_read(ctx, dir, "test", &te), KILN_OK, "%s", th_err(ctx));
  cr_assert_eq(te.n, 10000);
  assert_labels(&te, test_first);
  cr_assert_eq(kiln_cifar10_read(ctx, dir, "train", &tr), KILN_OK, "%s", th_err(ctx));
  cr_assert_eq(tr.n, 50000);
  assert_labels(&tr, train_first);
  int64_t hist[10] = {0};
  for (int64_t i = 0; i < tr.n; i++)
    hist[tr.labels[i]]++;
  for (int k = 0; k < 10; k++)
    cr_assert_eq(hist[k], 5000, "class %d has %lld training records", k, (long long)hist[k]);
  kiln_cifar10_free(&te);
  kiln_cifar10_free(&tr);
  th_ctx_free(ctx);
}

/* ---------------------------------------------------------------- the example's cache */

#include "../examples/cifar10_data.h"

/* The CIFAR-10 example's cache at a path that is not a regular file: a FIFO is not waited on (it
 * was opened with fopen, which blocks for a writer for ever), a directory is named as one, and
 * neither is written over. */
Test(cifar10, the_example_cache_uses_regular_files_only, .timeout = 20) {
  char dir[] = "/tmp/kiln-c10cache-XXXXXX", fifo[96], sub[96], why[256];
  cr_assert_not_null(mkdtemp(dir));
  snprintf(fifo, sizeof fifo, "%s/fifo.cache", dir);
  snprintf(sub, sizeof sub, "%s/dir.cache", dir);
  cr_assert_eq(mkfifo(fifo, 0600), 0);
  cr_assert_eq(mkdir(sub, 0700), 0);
  uint8_t labels[1] = {3}, images[CIFAR10_PIXELS] = {0};
  kiln_cifar10 one = {.n = 1, .labels = labels, .images = images}, got;
  const char *paths[2] = {fifo, sub}, *kinds[2] = {"FIFO", "directory"};
  for (int i = 0; i < 2; i++) {
    cr_assert_eq(cache_load(paths[i], 7, &got, why, sizeof why), 0, "%s", paths[i]);
    cr_assert(strstr(why, kinds[i]) != NULL, "%s: '%s'", paths[i], why);
    cr_assert_eq(cache_store(paths[i], 7, &one, why, sizeof why), -1, "%s", paths[i]);
    cr_assert(strstr(why, kinds[i]) != NULL && strstr(why, "left as it is"), "%s: '%s'", paths[i],
              why);
  }
  struct stat st;
  cr_assert(stat(fifo, &st) == 0 && S_ISFIFO(st.st_mode), "the FIFO is still there");
  cr_assert(stat(sub, &st) == 0 && S_ISDIR(st.st_mode), "the directory is still there");
  /* a regular file round-trips */
  char file[96];
  snprintf(file, sizeof file, "%s/ok.cache", dir);
  cr_assert_eq(cache_store(file, 7, &one, why, sizeof why), 0, "%s", why);
  cr_assert_eq(cache_load(file, 7, &got, why, sizeof why), 1, "%s", why);
  cr_assert(got.n == 1 && got.labels[0] == 3);
  kiln_cifar10_free(&got);
  remove(file);
  remove(fifo);
  rmdir(sub);
  rmdir(dir);
}
