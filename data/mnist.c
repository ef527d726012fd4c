/*
 * mnist.c: the MNIST idx reader (raw or gzip, inflated with zlib) for MNIST-format data sets such
 * as Fashion-MNIST. Every header field and length is checked: a missing, truncated or wrong file is
 * an error naming the file and what was wrong, never a crash.
 */
#include <errno.h>
#include <limits.h>
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

uint8_t *kiln__gunzip(const uint8_t *raw, size_t rlen, size_t max_out, bool prefix, size_t *len,
                      char *why, size_t wlen) {
  z_stream z;
  memset(&z, 0, sizeof z);
  if (inflateInit2(&z, 16 + MAX_WBITS) != Z_OK) {
    snprintf(why, wlen, "out of host memory");
    return NULL;
  }
  size_t olen = 0, ocap = rlen < max_out / 4 ? rlen * 4 + 1024 : max_out, in_off = 0;
  if (ocap > max_out) ocap = max_out;
  if (ocap == 0) ocap = 1;
  uint8_t *out = malloc(ocap);
  if (!out) goto oom;
  /* zlib counts in uInt: input and output are handed over in pieces of at most UINT_MAX */
  for (;;) {
    if (z.avail_in == 0 && in_off < rlen) {
      size_t piece = rlen - in_off < UINT_MAX ? rlen - in_off : UINT_MAX;
      z.next_in = (Bytef *)(uintptr_t)(raw + in_off); /* zlib only reads it */
      z.avail_in = (uInt)piece;
      in_off += piece;
    }
    if (olen == ocap) {
      if (ocap >= max_out) {
        if (prefix) break; /* as much as was asked for */
        snprintf(why, wlen, "the gzip data inflates to more than %zu bytes", max_out);
        goto fail;
      }
      size_t cap = ocap > max_out / 2 ? max_out : ocap * 2;
      uint8_t *o = realloc(out, cap);
      if (!o) goto oom;
      out = o;
      ocap = cap;
    }
    size_t room = ocap - olen < UINT_MAX ? ocap - olen : UINT_MAX;
    z.next_out = out + olen;
    z.avail_out = (uInt)room;
    int r = inflate(&z, Z_NO_FLUSH);
    olen += room - z.avail_out;
    size_t left = (rlen - in_off) + z.avail_in; /* input not yet inflated */
    if (r == Z_STREAM_END) {
      if (left == 0) break;
      /* another gzip member may follow; anything else is garbage */
      const uint8_t *next = z.avail_in ? z.next_in : raw + in_off;
      if (left < 2 || next[0] != 0x1f || next[1] != 0x8b) {
        snprintf(why, wlen, "%zu bytes of trailing garbage after the gzip data", left);
        goto fail;
      }
      inflateReset(&z);
      continue;
    }
    if (r == Z_OK || (r == Z_BUF_ERROR && (z.avail_out == 0 || (z.avail_in == 0 && left > 0))))
      continue;
    if (r == Z_BUF_ERROR && left == 0)
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

/* Opens dir/name, else dir/name.gz, as a regular file; *path (malloc'd) names the file opened,
 * or what was tried. NULL with why filled, and *missing when neither exists. */
static FILE *open_idx(const char *dir, const char *name, char **path, char *why, size_t wlen,
                      bool *missing) {
  *missing = false;
  const char *suffix[2] = {"", ".gz"};
  for (int k = 0; k < 2; k++) {
    *path = kiln__strf("%s/%s%s", dir, name, suffix[k]);
    if (!*path) {
      snprintf(why, wlen, "out of host memory");
      return NULL;
    }
    bool irregular;
    FILE *f = kiln__fopen_regular(*path, &irregular, NULL);
    if (f) return f;
    if (irregular) {
      snprintf(why, wlen, "not a regular file");
      return NULL;
    }
    int e = errno;
    if (e == ENOENT && k == 0) {
      free(*path);
      continue;
    }
    snprintf(why, wlen, "cannot open: %s", strerror(e));
    *missing = e == ENOENT;
    if (*missing) {
      free(*path);
      *path = kiln__strf("%s/%s[.gz]", dir, name);
    }
    return NULL;
  }
  return NULL;
}

static uint32_t be32(const unsigned char *p) {
  return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}

/* The largest dim and data size an idx file may declare (MNIST's are 60000 and 47 MB). */
#define IDX_MAX_DIM 100000000u
#define IDX_MAX_BYTES ((size_t)1 << 34)

/* Checks an idx header of ndim dims in buf (len bytes, at least its length): the magic and the
 * dims; *total gets the bytes of data it declares. */
static bool idx_header(const uint8_t *buf, size_t len, int ndim, uint32_t *dims, size_t *total,
                       char *why, size_t wlen) {
  size_t hlen = 4 + 4 * (size_t)ndim;
  if (len < hlen) {
    snprintf(why, wlen, "truncated: the header needs %zu bytes, the file has %zu", hlen, len);
    return false;
  }
  uint32_t magic = be32(buf);
  if (magic != (uint32_t)(0x800 | ndim)) {
    snprintf(why, wlen, "bad magic number 0x%08x (expected 0x%08x: unsigned bytes, %d dims)", magic,
             0x800 | ndim, ndim);
    return false;
  }
  *total = 1;
  for (int i = 0; i < ndim; i++) {
    dims[i] = be32(buf + 4 + 4 * i);
    if (dims[i] == 0 || dims[i] > IDX_MAX_DIM) {
      snprintf(why, wlen, "dim %d is %u", i, dims[i]);
      return false;
    }
    *total *= dims[i]; /* each factor is below 2^27 and the product kept below 2^34 */
    if (*total > IDX_MAX_BYTES) {
      snprintf(why, wlen, "%zu bytes of data is implausibly large", *total);
      return false;
    }
  }
  return true;
}

uint8_t *kiln__idx_parse(const uint8_t *buf, size_t len, int ndim, uint32_t *dims, char *why,
                         size_t wlen) {
  size_t hlen = 4 + 4 * (size_t)ndim, total;
  if (!idx_header(buf, len, ndim, dims, &total, why, wlen)) return NULL;
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

uint8_t *kiln__idx_gunzip(const uint8_t *raw, size_t rlen, int ndim, size_t *len, char *why,
                          size_t wlen) {
  /* the header first, then no more than it declares (one byte more tells of trailing data) */
  size_t hlen = 4 + 4 * (size_t)ndim, total, got;
  uint32_t dims[3];
  uint8_t *head = kiln__gunzip(raw, rlen, hlen, true, &got, why, wlen);
  if (!head) return NULL;
  bool ok = idx_header(head, got, ndim, dims, &total, why, wlen);
  free(head);
  if (!ok) return NULL;
  uint8_t *all = kiln__gunzip(raw, rlen, hlen + total + 1, true, len, why, wlen);
  if (all && *len > hlen + total) {
    snprintf(why, wlen,
             "trailing bytes after the %zu bytes of data its header declares (the gzip data "
             "inflates past them)",
             total);
    free(all);
    return NULL;
  }
  return all;
}

/* Reads one idx file of ndim dims (1: labels, 3: images); returns the data, fills dims. */
static uint8_t *read_idx(kiln_ctx *ctx, const char *dir, const char *name, int ndim,
                         uint32_t *dims) {
  char err[512];
  char *path = NULL;
  bool missing; /* neither file exists: the path then names both */
  size_t len = 0;
  FILE *f = open_idx(dir, name, &path, err, sizeof err, &missing);
  uint8_t *raw = f ? read_all(f, &len, err, sizeof err) : NULL, *data = NULL;
  if (f) fclose(f);
  if (!raw) {
    kiln__error(ctx, strstr(err, "out of host memory") ? KILN_ERR_OOM : KILN_ERR_IO,
                "kiln_mnist_read: %s: %s", path ? path : name, err);
    free(path);
    return NULL;
  }
  if (len >= 2 && raw[0] == 0x1f && raw[1] == 0x8b) { /* gzip */
    uint8_t *in = kiln__idx_gunzip(raw, len, ndim, &len, err, sizeof err);
    free(raw);
    raw = in;
  }
  if (raw) data = kiln__idx_parse(raw, len, ndim, dims, err, sizeof err);
  free(raw);
  if (!data) kiln__error(ctx, KILN_ERR_FORMAT, "kiln_mnist_read: %s: %s", path, err);
  free(path);
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
