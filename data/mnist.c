/*
 * mnist.c: the MNIST idx reader (raw or gzip, through zlib) and MNIST-format data sets such as
 * Fashion-MNIST. Every header field and length is checked: a missing, truncated or wrong file is
 * an error naming the file and what was wrong, never a crash.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <zlib.h>

#include "../core/internal.h"

/* Opens dir/name, else dir/name.gz; gzread reads both raw and gzip files. */
static gzFile open_idx(const char *dir, const char *name, char *path, size_t n) {
  snprintf(path, n, "%s/%s", dir, name);
  gzFile f = gzopen(path, "rb");
  if (f) return f;
  snprintf(path, n, "%s/%s.gz", dir, name);
  return gzopen(path, "rb");
}

/* Reads exactly n bytes; on failure says why in err. */
static bool read_exact(gzFile f, void *buf, size_t n, const char *what, char *err, size_t elen) {
  size_t got = 0;
  while (got < n) {
    unsigned chunk = n - got > (1u << 30) ? (1u << 30) : (unsigned)(n - got);
    int k = gzread(f, (char *)buf + got, chunk);
    if (k < 0) {
      int zerr;
      const char *msg = gzerror(f, &zerr);
      snprintf(err, elen, "corrupt data reading %s: %s", what, msg ? msg : "zlib error");
      return false;
    }
    if (k == 0) break;
    got += (size_t)k;
  }
  if (got < n) {
    int zerr = Z_OK;
    const char *msg = gzerror(f, &zerr);
    if (zerr != Z_OK && zerr != Z_STREAM_END && msg && *msg)
      snprintf(err, elen, "corrupt data reading %s: %s", what, msg);
    else
      snprintf(err, elen, "truncated: %s needs %zu bytes, the file has %zu", what, n, got);
    return false;
  }
  return true;
}

static uint32_t be32(const unsigned char *p) {
  return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}

/* Reads one idx file of ndim dims (1: labels, 3: images); returns the data, fills dims. */
static uint8_t *read_idx(kiln_ctx *ctx, const char *dir, const char *name, int ndim,
                         uint32_t *dims) {
  char path[1200], err[512];
  gzFile f = open_idx(dir, name, path, sizeof path);
  if (!f) {
    snprintf(path, sizeof path, "%s/%s[.gz]", dir, name);
    kiln__error(ctx, KILN_ERR_IO, "kiln_mnist_read: cannot open %s: %s", path,
                errno ? strerror(errno) : "not found");
    return NULL;
  }
  unsigned char head[16];
  uint8_t *data = NULL;
  size_t hlen = 4 + 4 * (size_t)ndim;
  if (!read_exact(f, head, hlen, "the header", err, sizeof err)) goto fail;
  uint32_t magic = be32(head);
  if (magic != (uint32_t)(0x800 | ndim)) {
    snprintf(err, sizeof err, "bad magic number 0x%08x (expected 0x%08x: unsigned bytes, %d dims)",
             magic, 0x800 | ndim, ndim);
    goto fail;
  }
  size_t total = 1;
  for (int i = 0; i < ndim; i++) {
    dims[i] = be32(head + 4 + 4 * i);
    if (dims[i] == 0 || dims[i] > 100000000u) {
      snprintf(err, sizeof err, "dim %d is %u", i, dims[i]);
      goto fail;
    }
    total *= dims[i];
    if (total > ((size_t)1 << 34)) {
      snprintf(err, sizeof err, "%zu bytes of data is implausibly large", total);
      goto fail;
    }
  }
  data = malloc(total);
  if (!data) {
    snprintf(err, sizeof err, "out of host memory for %zu bytes", total);
    goto fail;
  }
  if (!read_exact(f, data, total, "the data", err, sizeof err)) goto fail;
  unsigned char extra;
  int k = gzread(f, &extra, 1);
  if (k != 0) {
    snprintf(err, sizeof err, k > 0 ? "trailing bytes after %zu bytes of data"
                                    : "corrupt data after the last record",
             total);
    goto fail;
  }
  gzclose(f);
  return data;
fail:
  kiln__error(ctx, KILN_ERR_FORMAT, "kiln_mnist_read: %s: %s", path, err);
  free(data);
  gzclose(f);
  return NULL;
}

kiln_status kiln_mnist_read(kiln_ctx *ctx, const char *dir, const char *split, kiln_mnist *out) {
  if (!ctx) return KILN_ERR_INVALID;
  if (!kiln__ok(ctx)) return ctx->status;
  if (!out || !dir)
    return kiln__error(ctx, KILN_ERR_INVALID, "kiln_mnist_read: NULL %s", out ? "dir" : "out");
  memset(out, 0, sizeof *out);
  if (!split || (strcmp(split, "train") != 0 && strcmp(split, "t10k") != 0))
    return kiln__error(ctx, KILN_ERR_INVALID,
                       "kiln_mnist_read: split '%s' is neither \"train\" nor \"t10k\"",
                       split ? split : "(null)");
  char iname[64], lname[64];
  snprintf(iname, sizeof iname, "%s-images-idx3-ubyte", split);
  snprintf(lname, sizeof lname, "%s-labels-idx1-ubyte", split);
  uint32_t idims[3], ldims[1];
  uint8_t *images = read_idx(ctx, dir, iname, 3, idims);
  if (!images) return ctx->status;
  uint8_t *labels = read_idx(ctx, dir, lname, 1, ldims);
  if (!labels) {
    free(images);
    return ctx->status;
  }
  if (idims[0] != ldims[0]) {
    free(images);
    free(labels);
    return kiln__error(ctx, KILN_ERR_FORMAT,
                       "kiln_mnist_read: %s/%s has %u images but %s %u labels", dir, iname,
                       idims[0], lname, ldims[0]);
  }
  for (uint32_t i = 0; i < ldims[0]; i++) {
    if (labels[i] > 9) {
      unsigned bad = labels[i];
      free(images);
      free(labels);
      return kiln__error(ctx, KILN_ERR_FORMAT, "kiln_mnist_read: %s/%s: label %u of record %u is "
                         "not a digit class 0-9",
                         dir, lname, bad, i);
    }
  }
  out->n = idims[0];
  out->rows = idims[1];
  out->cols = idims[2];
  out->images = images;
  out->labels = labels;
  return KILN_OK;
}

void kiln_mnist_free(kiln_mnist *m) {
  if (!m) return;
  free(m->images);
  free(m->labels);
  memset(m, 0, sizeof *m);
}
