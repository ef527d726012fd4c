/*
 * safetensors.h: reading and writing the safetensors format (an 8-byte little-endian header
 * length, a JSON header naming each tensor's dtype, shape and byte range, then the bytes), shared
 * by parameter files, training checkpoints and the header fuzzer.
 */
#ifndef KILN_SAFETENSORS_H
#define KILN_SAFETENSORS_H

#include <cjson/cJSON.h>

#include "../core/internal.h"

typedef struct kiln__st_entry {
  const char *name; /* points into the parsed JSON */
  kiln_dtype dtype; /* F32, BF16 or I32 */
  int ndim;
  int64_t shape[KILN_MAX_DIMS];
  uint64_t begin, end; /* byte range in the data section */
} kiln__st_entry;

typedef struct kiln__st_file {
  cJSON *json;
  kiln__st_entry *e;
  int n;
  const cJSON *metadata; /* the "__metadata__" object, or NULL */
  const uint8_t *data;   /* the data section */
  uint64_t data_len;
} kiln__st_file;

/* Parses and checks a whole file held in buf: every header field, that byte ranges fit, do not
 * overlap and leave no holes. On failure sets ctx's error (prefixed by fn and path). */
kiln_status kiln__st_parse(kiln_ctx *ctx, const char *fn, const char *path, const uint8_t *buf,
                           size_t len, kiln__st_file *out);
void kiln__st_free(kiln__st_file *f);
const kiln__st_entry *kiln__st_find(const kiln__st_file *f, const char *name);

/* A tensor to write: host data of its dtype, contiguous. */
typedef struct kiln__st_out {
  const char *name;
  kiln_dtype dtype;
  int ndim;
  const int64_t *shape;
  const void *data;
} kiln__st_out;

/* Writes path atomically: a temporary file beside it, flushed and synced, then renamed over it.
 * metadata (string values) may be NULL. */
kiln_status kiln__st_write(kiln_ctx *ctx, const char *fn, const char *path, int n,
                           const kiln__st_out *t, const cJSON *metadata);

/* Reads a whole file into memory (malloc'd). */
kiln_status kiln__read_file(kiln_ctx *ctx, const char *fn, const char *path, uint8_t **buf,
                            size_t *len);

#endif
