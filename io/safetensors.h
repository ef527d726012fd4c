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
  bool i64;         /* I64 (PyTorch's counters, such as num_batches_tracked): kiln holds no such
                     * tensor, so its range is checked but it is never read; dtype is I32 */
  int ndim;
  int64_t shape[KILN_MAX_DIMS];
  uint64_t begin, end; /* byte range in the data section */
} kiln__st_entry;

typedef struct kiln__st_file {
  cJSON *json;
  kiln__st_entry *e;
  int n;
  kiln__st_entry **by_name; /* e sorted by name */
  const cJSON *metadata;    /* the "__metadata__" object, or NULL */
  const uint8_t *data;      /* the data section, when the file is held in memory */
  FILE *fp;                 /* or the open file, its data section at data_start */
  uint64_t data_start, data_len;
} kiln__st_file;

/* Parses and checks a whole file held in buf: every header field (only space padding after the
 * JSON, no NUL in any name), that byte ranges fit, do not overlap and leave no holes, that names
 * are unique. On failure sets ctx's error (prefixed by fn and path). */
kiln_status kiln__st_parse(kiln_ctx *ctx, const char *fn, const char *path, const uint8_t *buf,
                           size_t len, kiln__st_file *out);
/* The same for a file on disk, of which only the header is read (after its length is checked
 * against the file's size); kiln__st_read reads a tensor's bytes later. */
kiln_status kiln__st_open(kiln_ctx *ctx, const char *fn, const char *path, kiln__st_file *out);
kiln_status kiln__st_read(kiln_ctx *ctx, const char *fn, const char *path, const kiln__st_file *f,
                          const kiln__st_entry *e, void *dst);
void kiln__st_free(kiln__st_file *f);
/* The entry called name (a binary search), or NULL. */
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

/* ---------------------------------------------------------------- checkpoint metadata */

#define KILN__CKPT_FORMAT "kiln-checkpoint-1"

/* The most optimizers one checkpoint holds (kiln_checkpoint_save_optims). */
#define KILN__CKPT_MAX_OPTIMS KILN_CHECKPOINT_MAX_OPTIMS

/* One optimizer's scalars in a checkpoint. */
typedef struct kiln__ckpt_optim {
  float lr;
  uint64_t steps;
  int64_t *counts; /* per parameter (malloc'd) */
} kiln__ckpt_optim;

typedef struct kiln__ckpt_meta {
  uint64_t seed, philox_offset, host_rng;
  kiln__ckpt_optim opt[KILN__CKPT_MAX_OPTIMS];
  bool oom; /* the parse failed for want of host memory */
} kiln__ckpt_meta;

/* Parses and checks a checkpoint's metadata m: the format, the RNG state and, for the nopt
 * optimizers of kinds optims[0 .. nopt-1] (none: their state is not asked for), that the file
 * holds as many, of those kinds in that order, and each one's rate, step count and the update
 * count of each of the np parameters called names. NULL when it all checks out, else why (written
 * there). kiln__ckpt_meta_free frees what it allocated, either way. */
const char *kiln__ckpt_meta_parse(const cJSON *m, const char *const *optims, int nopt, int np,
                                  const char *const *names, kiln__ckpt_meta *out, char *why,
                                  size_t n);
void kiln__ckpt_meta_free(kiln__ckpt_meta *m);
/* The metadata key of optimizer k's field ("kiln.optim" and "kiln.optim.<field>" for the first,
 * the one kiln_checkpoint_save writes; "kiln.optim<k>..." for the others; field NULL: its kind),
 * written to buf (64 bytes are enough). */
void kiln__ckpt_key(int k, const char *field, char *buf, size_t n);
/* "kiln.optim.count/<name>" (k = 0) or "kiln.optim<k>.count/<name>", malloc'd. */
char *kiln__ckpt_count_key(int k, const char *name);

#endif
