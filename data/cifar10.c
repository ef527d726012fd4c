/*
 * cifar10.c: the CIFAR-10 reader (the official binary batches, raw, gzip or xz) and its data set
 * on the device. Every file's size and every record's label is checked (cifar10_bytes.c): a
 * missing, truncated, corrupted or mislabelled file is an error naming the file and the record or
 * the size, never a crash. Images are kept channels last, (n, 32, 32, 3).
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "../core/internal.h"
#include "dataset.h"
#include "readers.h"

/* A batch of the official files holds 10000 records; a file holding more than four batches'
 * worth (decompressed) is refused, and so is a compressed file larger than that (plus room for
 * incompressible data), before anything is read. */
#define BATCH_RECORDS 10000
#define FILE_MAX ((size_t)4 * BATCH_RECORDS * KILN__CIFAR10_RECORD)
#define PACKED_MAX (FILE_MAX + FILE_MAX / 16)

typedef enum { RAW = 0, GZIP, XZ } packing;

/* Opens dir/stem.bin, else .bin.gz, else .bin.xz, the first that exists, as a regular file; *path
 * (malloc'd, or NULL out of memory) names the file opened, or what was tried. NULL with the error
 * set on ctx. */
static FILE *open_batch(kiln_ctx *ctx, const char *dir, const char *stem, char **path,
                        packing *kind, uint64_t *size) {
  const char *suffix[3] = {".bin", ".bin.gz", ".bin.xz"};
  for (int k = 0; k < 3; k++) {
    *path = kiln__strf("%s/%s%s", dir, stem, suffix[k]);
    if (!*path) {
      kiln__error(ctx, KILN_ERR_OOM, "kiln_cifar10_read: out of host memory");
      return NULL;
    }
    bool irregular;
    FILE *f = kiln__fopen_regular(*path, &irregular, size);
    if (f) {
      *kind = (packing)k;
      return f;
    }
    if (irregular) {
      kiln__error(ctx, KILN_ERR_IO, "kiln_cifar10_read: %s: not a regular file", *path);
      return NULL;
    }
    int e = errno;
    if (e != ENOENT) {
      kiln__error(ctx, KILN_ERR_IO, "kiln_cifar10_read: %s: cannot open: %s", *path, strerror(e));
      return NULL;
    }
    free(*path);
    *path = NULL;
  }
  kiln__error(ctx, KILN_ERR_IO,
              "kiln_cifar10_read: %s/%s.bin (or .bin.gz, .bin.xz): cannot open: %s", dir, stem,
              strerror(ENOENT));
  return NULL;
}

/* Reads the batch stem from dir and decompresses it: *buf (*len bytes, malloc'd) and *path, the
 * file read (malloc'd; the caller frees it, also on failure). false with the error set on ctx. */
static bool load_batch(kiln_ctx *ctx, const char *dir, const char *stem, uint8_t **buf, size_t *len,
                       char **path) {
  packing kind = RAW;
  uint64_t size = 0;
  FILE *f = open_batch(ctx, dir, stem, path, &kind, &size);
  if (!f) return false;
  const char *p = *path;
  uint64_t most = kind == RAW ? FILE_MAX : PACKED_MAX;
  if (size == 0 || size > most) {
    fclose(f);
    if (size == 0)
      return !kiln__error(ctx, KILN_ERR_FORMAT, "kiln_cifar10_read: %s: empty file", p);
    return !kiln__error(ctx, KILN_ERR_FORMAT,
                        "kiln_cifar10_read: %s: %llu bytes is more than one CIFAR-10 file may "
                        "hold (at most %llu: four batches of %d records)",
                        p, (unsigned long long)size, (unsigned long long)most, BATCH_RECORDS);
  }
  size_t rlen = (size_t)size; /* at most PACKED_MAX */
  uint8_t *raw = malloc(rlen);
  if (!raw) {
    fclose(f);
    return !kiln__error(ctx, KILN_ERR_OOM,
                        "kiln_cifar10_read: %s: out of host memory for %zu bytes", p, rlen);
  }
  size_t got = fread(raw, 1, rlen, f);
  bool failed = ferror(f) != 0;
  int e = errno;
  fclose(f);
  if (got != rlen) {
    free(raw);
    if (failed)
      return !kiln__error(ctx, KILN_ERR_IO, "kiln_cifar10_read: %s: read error: %s", p,
                          strerror(e));
    return !kiln__error(ctx, KILN_ERR_IO,
                        "kiln_cifar10_read: %s: the file shrank while being read (%zu of %zu "
                        "bytes)",
                        p, got, rlen);
  }
  if (kind == RAW) {
    *buf = raw;
    *len = rlen;
    return true;
  }
  char why[400];
  uint8_t *out = kind == GZIP ? kiln__gunzip(raw, rlen, FILE_MAX, false, len, why, sizeof why)
                              : kiln__unxz(raw, rlen, FILE_MAX, len, why, sizeof why);
  free(raw);
  if (!out)
    return !kiln__error(ctx, strstr(why, "out of host memory") ? KILN_ERR_OOM : KILN_ERR_FORMAT,
                        "kiln_cifar10_read: %s: %s", p, why);
  *buf = out;
  return true;
}

/* The batch files of a split, in order; 0 for an unknown split. */
static int split_stems(const char *split, const char *stems[5]) {
  static const char *names[6] = {"data_batch_1", "data_batch_2", "data_batch_3",
                                 "data_batch_4", "data_batch_5", "test_batch"};
  if (strcmp(split, "train") == 0) {
    for (int i = 0; i < 5; i++)
      stems[i] = names[i];
    return 5;
  }
  if (strcmp(split, "test") == 0) {
    stems[0] = names[5];
    return 1;
  }
  for (int i = 0; i < 6; i++)
    if (strcmp(split, names[i]) == 0) {
      stems[0] = names[i];
      return 1;
    }
  return 0;
}

kiln_status kiln_cifar10_read(kiln_ctx *ctx, const char *dir, const char *split,
                              kiln_cifar10 *out) {
  if (!ctx) return KILN_ERR_INVALID;
  if (!kiln__ok(ctx)) return ctx->status;
  if (!out || !dir)
    return kiln__error(ctx, KILN_ERR_INVALID, "kiln_cifar10_read: NULL %s", out ? "dir" : "out");
  const char *stems[5];
  int nfiles = split ? split_stems(split, stems) : 0;
  if (nfiles == 0)
    return kiln__error(ctx, KILN_ERR_INVALID,
                       "kiln_cifar10_read: split '%s' is none of \"train\", \"test\", "
                       "\"data_batch_1\" to \"data_batch_5\" and \"test_batch\"",
                       split ? split : "(null)");
  uint8_t *images = NULL, *labels = NULL; /* (n, 32, 32, 3), (n) */
  int64_t n = 0;
  for (int k = 0; k < nfiles; k++) {
    uint8_t *buf = NULL;
    size_t len = 0;
    char *path = NULL, why[400];
    if (!load_batch(ctx, dir, stems[k], &buf, &len, &path)) {
      free(path);
      goto fail;
    }
    int64_t m;
    if (!kiln__cifar10_check(buf, len, &m, why, sizeof why)) {
      kiln__error(ctx, KILN_ERR_FORMAT, "kiln_cifar10_read: %s: %s", path, why);
      free(buf);
      free(path);
      goto fail;
    }
    /* each file holds at most FILE_MAX bytes and there are five: no overflow */
    size_t total = (size_t)(n + m);
    uint8_t *im = realloc(images, total * KILN__CIFAR10_PIXELS);
    if (im) images = im;
    uint8_t *lb = im ? realloc(labels, total) : NULL;
    if (lb) labels = lb;
    if (!im || !lb) {
      kiln__error(ctx, KILN_ERR_OOM, "kiln_cifar10_read: %s: out of host memory for %zu images",
                  path, total);
      free(buf);
      free(path);
      goto fail;
    }
    kiln__cifar10_unpack(buf, m, images + (size_t)n * KILN__CIFAR10_PIXELS, labels + n);
    n += m;
    free(buf);
    free(path);
  }
  out->n = n;
  out->images = images;
  out->labels = labels;
  return KILN_OK;
fail:
  free(images);
  free(labels);
  return ctx->status;
}

void kiln_cifar10_free(kiln_cifar10 *c) {
  if (!c) return;
  free(c->images);
  free(c->labels);
  memset(c, 0, sizeof *c);
}

kiln_dataset *kiln_dataset_from_cifar10(kiln_ctx *ctx, const kiln_cifar10 *c, const float mean[3],
                                        const float std[3]) {
  const char *fn = __func__;
  if (!kiln__ok(ctx)) return NULL;
  if (!c || !c->images || !c->labels || c->n <= 0)
    return kiln__error(ctx, KILN_ERR_INVALID, "%s: empty data set", fn), NULL;
  if (c->n > INT32_MAX)
    return kiln__error(ctx, KILN_ERR_INVALID, "%s: %lld images are more than a data set holds", fn,
                       (long long)c->n),
           NULL;
  if (!mean != !std)
    return kiln__error(ctx, KILN_ERR_INVALID,
                       "%s: a %s without a %s (give both, or neither for no normalisation)", fn,
                       mean ? "mean" : "std", mean ? "std" : "mean"),
           NULL;
  kiln_normalize norm = {.channels = 3, .mean = mean, .std = std};
  return kiln__dataset_from_host(
      ctx, fn, KILN_HOST_U8, KILN_SHAPE(c->n, KILN__CIFAR10_SIDE, KILN__CIFAR10_SIDE, 3), c->images,
      (kiln_host_labels){.u8 = c->labels, .classes = 10}, mean ? &norm : NULL);
}
