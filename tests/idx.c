/*
 * idx.c: synthetic MNIST files (see idx.h).
 */
#include "idx.h"

#include <stdarg.h>
#include <string.h>
#include <zlib.h>

void th_be32_put(unsigned char *p, uint32_t v) {
  p[0] = (unsigned char)(v >> 24);
  p[1] = (unsigned char)(v >> 16);
  p[2] = (unsigned char)(v >> 8);
  p[3] = (unsigned char)v;
}

unsigned char th_idx_pixel(uint64_t i) {
  th_rng r = {.s = i * 0x2545F4914F6CDD1DULL};
  return (unsigned char)(th_rng_next(&r) >> 56);
}

th_blob th_idx_images(uint32_t n, uint32_t rows, uint32_t cols) {
  size_t data = (size_t)n * rows * cols;
  th_blob b = {malloc(16 + data + 64), 16 + data};
  cr_assert_not_null(b.p);
  th_be32_put(b.p, 0x803);
  th_be32_put(b.p + 4, n);
  th_be32_put(b.p + 8, rows);
  th_be32_put(b.p + 12, cols);
  for (size_t i = 0; i < data; i++)
    b.p[16 + i] = th_idx_pixel(i);
  return b;
}

th_blob th_idx_labels(uint32_t n) {
  th_blob b = {malloc(8 + n + 64), 8 + (size_t)n};
  cr_assert_not_null(b.p);
  th_be32_put(b.p, 0x801);
  th_be32_put(b.p + 4, n);
  for (uint32_t i = 0; i < n; i++)
    b.p[8 + i] = (unsigned char)((i * 7 + 3) % 10);
  return b;
}

void th_idx_put(const char *dir, const char *name, th_blob b, bool gz) {
  char path[1200];
  snprintf(path, sizeof path, "%s/%s%s", dir, name, gz ? ".gz" : "");
  if (!gz) {
    th_write_whole(path, b.p, b.n);
    return;
  }
  gzFile f = gzopen(path, "wb");
  cr_assert_not_null(f, "gzopen %s", path);
  cr_assert_eq(gzwrite(f, b.p, (unsigned)b.n), (int)b.n);
  cr_assert_eq(gzclose(f), Z_OK);
}

void th_idx_synthetic(char *dir, size_t n, bool gz) {
  th_tmpdir(dir, n, "mnist");
  th_blob im = th_idx_images(TH_IDX_N, TH_IDX_ROWS, TH_IDX_COLS), lb = th_idx_labels(TH_IDX_N);
  th_idx_put(dir, TH_IDX_IMAGES, im, gz);
  th_idx_put(dir, TH_IDX_LABELS, lb, gz);
  free(im.p);
  free(lb.p);
}

void th_assert_mnist_zeroed(const kiln_mnist *m) {
  cr_assert(m->n == 0 && m->rows == 0 && m->cols == 0, "n %lld rows %lld cols %lld",
            (long long)m->n, (long long)m->rows, (long long)m->cols);
  cr_assert_null(m->images);
  cr_assert_null(m->labels);
}

void th_expect_mnist_error(const char *dir, kiln_status want, const char *file, ...) {
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_mnist m;
  memset(&m, 0xab, sizeof m);
  kiln_status s = kiln_mnist_read(ctx, dir, "train", &m);
  const char *msg = kiln_ctx_error(ctx);
  cr_assert_eq(s, want, "status '%s', want '%s': %s", kiln_status_name(s), kiln_status_name(want),
               msg ? msg : "no message");
  cr_assert_eq(kiln_ctx_status(ctx), want);
  cr_assert_not_null(msg);
  cr_assert_not_null(strstr(msg, "kiln_mnist_read"), "message: %s", msg);
  cr_assert_not_null(strstr(msg, dir), "the message does not name the directory: %s", msg);
  cr_assert_not_null(strstr(msg, file), "the message does not name %s: %s", file, msg);
  va_list ap;
  va_start(ap, file);
  for (const char *sub = va_arg(ap, const char *); sub; sub = va_arg(ap, const char *))
    cr_assert_not_null(strstr(msg, sub), "the message lacks '%s': %s", sub, msg);
  va_end(ap);
  th_assert_mnist_zeroed(&m);
  th_ctx_free(ctx);
}
