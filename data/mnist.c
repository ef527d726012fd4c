/*
 * mnist.c: the MNIST idx reader (raw or gzip, inflated with zlib) for MNIST-format data sets such
 * as Fashion-MNIST. Every header field and length is checked: a missing, truncated or wrong file is
 * an error naming the file and what was wrong, never a crash.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <zlib.h>

#include "../core/internal.h"
#include "readers.h"

/* Reads a whole file into memory; NULL with why filled on failure. */
static uint8_t *read_all(FILE *f, size_t *len, char *why, size_t wlen) {
  uint8_t *raw = NULL;
  size_t rlen = 0, cap = 0;
  for (;;) {
    if (rlen == cap) {
      cap = cap ? 2 * cap : (size_t)1 << 20;
      uint8_t *r = realloc(raw, cap);
      if (!r) {
        free(raw);
        snprintf(why, wlen, "out of host memory");
        return NULL;
      }
      raw = r;
    }
    size_t k = fread(raw + rlen, 1, cap - rlen, f);
    rlen += k;
    if (k == 0) break;
  }
  if (ferror(f)) {
    free(raw);
    snprintf(why, wlen, "read error: %s", strerror(errno));
    return NULL;
  }
  *len = rlen;
  return raw;
}

uint8_t *kiln__gunzip(const uint8_t *raw, size_t rlen, size_t *len, char *why, size_t wlen) {
  z_stream z;
  memset(&z, 0, sizeof z);
  if (inflateInit2(&z, 16 + MAX_WBITS) != Z_OK) {
    snprintf(why, wlen, "out of host memory");
    return NULL;
  }
  size_t olen = 0, ocap = rlen * 4 + 1024;
  uint8_t *out = malloc(ocap);
  if (!out) goto oom;
  z.next_in = (Bytef *)(uintptr_t)raw; /* zlib takes a non-const pointer but only reads */
  z.avail_in = (uInt)rlen;
  for (;;) {
    if (olen == ocap) {
      ocap *= 2;
      uint8_t *o = realloc(out, ocap);
      if (!o) goto oom;
      out = o;
    }
    z.next_out = out + olen;
    z.avail_out = (uInt)(ocap - olen);
    int r = inflate(&z, Z_NO_FLUSH);
    olen = ocap - z.avail_out;
    if (r == Z_STREAM_END) {
      if (z.avail_in == 0) break;
      /* another gzip member may follow; anything else is garbage */
      if (z.avail_in < 2 || z.next_in[0] != 0x1f || z.next_in[1] != 0x8b) {
        snprintf(why, wlen, "%u bytes of trailing garbage after the gzip data", z.avail_in);
        goto fail;
      }
      inflateReset(&z);
      continue;
    }
    if (r == Z_OK) continue;
    if (r == Z_BUF_ERROR && z.avail_in == 0)
      snprintf(why, wlen, "truncated: the gzip data ends early (after %zu bytes inflated)", olen);
    else
      snprintf(why, wlen, "corrupt gzip data: %s", z.msg ? z.msg : zError(r));
    goto fail;
  }
  inflateEnd(&z);
  *len = olen;
  return out;
oom:
  snprintf(why, wlen, "out of host memory");
fail:
  inflateEnd(&z);
  free(out);
  return NULL;
}

/* Reads dir/name, else dir/name.gz, whole into memory; gzip files (every member of them) are
 * inflated. Returns NULL with why filled on failure. */
static uint8_t *load(const char *dir, const char *name, char *path, size_t plen, size_t *len,
                     char *why, size_t wlen, bool *missing) {
  *missing = false;
  snprintf(path, plen, "%s/%s", dir, name);
  FILE *f = fopen(path, "rb");
  if (!f) {
    snprintf(path, plen, "%s/%s.gz", dir, name);
    f = fopen(path, "rb");
  }
  if (!f) {
    snprintf(path, plen, "%s/%s[.gz]", dir, name);
    snprintf(why, wlen, "cannot open: %s", strerror(errno));
    *missing = true;
    return NULL;
  }
  size_t rlen = 0;
  uint8_t *raw = read_all(f, &rlen, why, wlen);
  fclose(f);
  if (!raw) return NULL;
  if (rlen < 2 || raw[0] != 0x1f || raw[1] != 0x8b) {
    *len = rlen; /* not gzip: the raw idx bytes */
    return raw;
  }
  uint8_t *out = kiln__gunzip(raw, rlen, len, why, wlen);
  free(raw);
  return out;
}

static uint32_t be32(const unsigned char *p) {
  return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}

/* The largest dim and data size an idx file may declare (MNIST's are 60000 and 47 MB). */
#define IDX_MAX_DIM 100000000u
#define IDX_MAX_BYTES ((size_t)1 << 34)

uint8_t *kiln__idx_parse(const uint8_t *buf, size_t len, int ndim, uint32_t *dims, char *why,
                         size_t wlen) {
  size_t hlen = 4 + 4 * (size_t)ndim;
  if (len < hlen) {
    snprintf(why, wlen, "truncated: the header needs %zu bytes, the file has %zu", hlen, len);
    return NULL;
  }
  uint32_t magic = be32(buf);
  if (magic != (uint32_t)(0x800 | ndim)) {
    snprintf(why, wlen, "bad magic number 0x%08x (expected 0x%08x: unsigned bytes, %d dims)", magic,
             0x800 | ndim, ndim);
    return NULL;
  }
  size_t total = 1;
  for (int i = 0; i < ndim; i++) {
    dims[i] = be32(buf + 4 + 4 * i);
    if (dims[i] == 0 || dims[i] > IDX_MAX_DIM) {
      snprintf(why, wlen, "dim %d is %u", i, dims[i]);
      return NULL;
    }
    total *= dims[i];
    if (total > IDX_MAX_BYTES) {
      snprintf(why, wlen, "%zu bytes of data is implausibly large", total);
      return NULL;
    }
  }
  if (len - hlen < total) {
    snprintf(why, wlen, "truncated: the data needs %zu bytes, the file has %zu", total, len - hlen);
    return NULL;
  }
  if (len - hlen > total) {
    snprintf(why, wlen, "%zu trailing bytes after %zu bytes of data", len - hlen - total, total);
    return NULL;
  }
  uint8_t *data = malloc(total);
  if (!data) {
    snprintf(why, wlen, "out of host memory for %zu bytes", total);
    return NULL;
  }
  memcpy(data, buf + hlen, total);
  return data;
}

/* Reads one idx file of ndim dims (1: labels, 3: images); returns the data, fills dims. */
static uint8_t *read_idx(kiln_ctx *ctx, const char *dir, const char *name, int ndim,
                         uint32_t *dims) {
  char path[1200], err[512];
  size_t len;
  bool missing;
  uint8_t *buf = load(dir, name, path, sizeof path, &len, err, sizeof err, &missing);
  if (!buf) {
    kiln__error(ctx, missing ? KILN_ERR_IO : KILN_ERR_FORMAT, "kiln_mnist_read: %s: %s", path, err);
    return NULL;
  }
  uint8_t *data = kiln__idx_parse(buf, len, ndim, dims, err, sizeof err);
  free(buf);
  if (!data) kiln__error(ctx, KILN_ERR_FORMAT, "kiln_mnist_read: %s: %s", path, err);
  return data;
}

kiln_status kiln_mnist_read(kiln_ctx *ctx, const char *dir, const char *split, kiln_mnist *out) {
  if (out) memset(out, 0, sizeof *out);
  if (!ctx) return KILN_ERR_INVALID;
  if (!kiln__ok(ctx)) return ctx->status;
  if (out) memset(out, 0, sizeof *out);
  if (!out || !dir)
    return kiln__error(ctx, KILN_ERR_INVALID, "kiln_mnist_read: NULL %s", out ? "dir" : "out");
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
      return kiln__error(ctx, KILN_ERR_FORMAT,
                         "kiln_mnist_read: %s/%s: label %u of record %u is "
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
