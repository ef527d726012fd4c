/*
 * safetensors.c: the safetensors format. The parser trusts nothing: the header length, the JSON,
 * every dtype, shape and byte range are checked before anything is used, so that a truncated,
 * corrupted or foreign file is an error naming what is wrong (the fuzzer in tests/fuzz/ drives
 * this code). Writes go to a temporary file that is synced and renamed over the target, so an
 * interrupted save leaves the previous file whole.
 */
#include "safetensors.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <libgen.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define MAX_HEADER ((uint64_t)100 << 20) /* the format's own limit on the header */
#define MAX_ELEMENTS ((uint64_t)1 << 40) /* a tensor kiln would read: 4 TB of f32 */

static const char *st_dtype_name(kiln_dtype dt) {
  switch (dt) {
  case KILN_DTYPE_F32: return "F32";
  case KILN_DTYPE_BF16: return "BF16";
  case KILN_DTYPE_F16: return "F16";
  case KILN_DTYPE_I32: return "I32";
  }
  return "?";
}

static bool st_dtype(const char *s, kiln_dtype *dt) {
  if (strcmp(s, "F32") == 0)
    *dt = KILN_DTYPE_F32;
  else if (strcmp(s, "BF16") == 0)
    *dt = KILN_DTYPE_BF16;
  else if (strcmp(s, "I32") == 0)
    *dt = KILN_DTYPE_I32;
  else
    return false;
  return true;
}

/* A JSON number that is a non-negative integer exactly representable in a double. */
static bool json_uint(const cJSON *j, uint64_t *v) {
  if (!cJSON_IsNumber(j)) return false;
  double d = cJSON_GetNumberValue(j);
  if (!(d >= 0 && d <= 9007199254740992.0) || floor(d) != d) return false;
  *v = (uint64_t)d;
  return true;
}

static int by_begin(const void *a, const void *b) {
  const kiln__st_entry *x = *(kiln__st_entry *const *)a, *y = *(kiln__st_entry *const *)b;
  return (x->begin > y->begin) - (x->begin < y->begin);
}

static int by_name(const void *a, const void *b) {
  return strcmp((*(kiln__st_entry *const *)a)->name, (*(kiln__st_entry *const *)b)->name);
}

void kiln__st_free(kiln__st_file *f) {
  if (!f) return;
  cJSON_Delete(f->json);
  free(f->e);
  free(f->by_name);
  if (f->fp) fclose(f->fp);
  memset(f, 0, sizeof *f);
}

/* Whether the header text holds a NUL: a raw zero byte, or a \u0000 escape inside a string (a
 * name "w\u0000EVIL" would be read as "w"). */
static bool holds_nul(const char *t, size_t n) {
  bool in = false;
  for (size_t i = 0; i < n; i++) {
    if (t[i] == 0) return true;
    if (!in) {
      in = t[i] == '"';
      continue;
    }
    if (t[i] == '"') {
      in = false;
    } else if (t[i] == '\\' && i + 1 < n) {
      if (t[i + 1] == 'u' && i + 5 < n && strncmp(t + i + 2, "0000", 4) == 0) return true;
      i++; /* the escaped character */
    }
  }
  return false;
}

/* Parses and checks a header of hlen bytes at text for a data section of data_len bytes. */
static kiln_status parse_header(kiln_ctx *ctx, const char *fn, const char *path, const char *text,
                                uint64_t hlen, uint64_t data_len, kiln__st_file *out) {
  kiln__st_entry **order = NULL;
  char why[512] = "";
  const char *end = NULL;
  out->data_len = data_len;
  if (holds_nul(text, hlen)) {
    snprintf(why, sizeof why, "the header holds a NUL character");
    goto bad;
  }
  out->json = cJSON_ParseWithLengthOpts(text, hlen, &end, 0);
  if (!out->json || !cJSON_IsObject(out->json)) {
    snprintf(why, sizeof why, "the header is not a JSON object%s", out->json ? "" : " (bad JSON)");
    goto bad;
  }
  for (const char *c = end; c < text + hlen; c++)
    if (*c != ' ') { /* the format pads the header with spaces, and nothing else */
      snprintf(why, sizeof why, "%zu bytes after the header's JSON are not space padding",
               (size_t)(text + hlen - c));
      goto bad;
    }
  int count = cJSON_GetArraySize(out->json);
  out->e = calloc((size_t)count + 1, sizeof *out->e);
  order = calloc((size_t)count + 1, sizeof *order);
  out->by_name = calloc((size_t)count + 1, sizeof *out->by_name);
  if (!out->e || !order || !out->by_name) {
    snprintf(why, sizeof why, "out of host memory for %d header entries", count);
    goto bad;
  }
  for (const cJSON *it = out->json->child; it; it = it->next) {
    const char *name = it->string ? it->string : "";
    if (strcmp(name, "__metadata__") == 0) {
      if (!cJSON_IsObject(it) || out->metadata) {
        snprintf(why, sizeof why, "__metadata__ is not one object of strings");
        goto bad;
      }
      for (const cJSON *m = it->child; m; m = m->next)
        if (!cJSON_IsString(m)) {
          snprintf(why, sizeof why, "__metadata__ value '%.200s' is not a string",
                   m->string ? m->string : "");
          goto bad;
        }
      out->metadata = it;
      continue;
    }
    kiln__st_entry *e = &out->e[out->n];
    e->name = name;
    const cJSON *dt = cJSON_GetObjectItemCaseSensitive(it, "dtype");
    const cJSON *sh = cJSON_GetObjectItemCaseSensitive(it, "shape");
    const cJSON *off = cJSON_GetObjectItemCaseSensitive(it, "data_offsets");
    if (!cJSON_IsObject(it) || !cJSON_IsString(dt) || !cJSON_IsArray(sh) || !cJSON_IsArray(off)) {
      snprintf(why, sizeof why, "tensor '%.200s' lacks a dtype string, a shape or data_offsets",
               name);
      goto bad;
    }
    e->i64 = strcmp(dt->valuestring, "I64") == 0;
    if (e->i64) {
      e->dtype = KILN_DTYPE_I32;
    } else if (!st_dtype(dt->valuestring, &e->dtype)) {
      snprintf(why, sizeof why,
               "tensor '%.200s' has dtype %.32s; kiln reads F32, BF16 and I32 (and skips I64)",
               name, dt->valuestring);
      goto bad;
    }
    e->ndim = cJSON_GetArraySize(sh);
    if (e->ndim > KILN_MAX_DIMS) {
      snprintf(why, sizeof why, "tensor '%.200s' has %d dims; kiln takes up to %d", name, e->ndim,
               KILN_MAX_DIMS);
      goto bad;
    }
    uint64_t numel = 1;
    int d = 0;
    for (const cJSON *x = sh->child; x; x = x->next, d++) {
      uint64_t v;
      if (!json_uint(x, &v) || v > MAX_ELEMENTS) {
        snprintf(why, sizeof why, "tensor '%.200s' has a bad size in its shape (dim %d)", name, d);
        goto bad;
      }
      e->shape[d] = (int64_t)v;
      if (v != 0 && numel > MAX_ELEMENTS / v) { /* checked: the product must not wrap */
        snprintf(why, sizeof why, "tensor '%.200s' is implausibly large", name);
        goto bad;
      }
      numel *= v;
    }
    uint64_t b, en;
    if (cJSON_GetArraySize(off) != 2 || !json_uint(off->child, &b) ||
        !json_uint(off->child->next, &en)) {
      snprintf(why, sizeof why, "tensor '%.200s' has bad data_offsets (two byte positions wanted)",
               name);
      goto bad;
    }
    if (b > en || en > data_len) {
      snprintf(why, sizeof why,
               "tensor '%.200s' has data_offsets [%" PRIu64 ", %" PRIu64 "] outside the %" PRIu64
               " bytes of data (truncated?)",
               name, b, en, data_len);
      goto bad;
    }
    uint64_t elem = e->i64 ? 8 : kiln_dtype_size(e->dtype);
    if (en - b != numel * elem) {
      snprintf(why, sizeof why,
               "tensor '%.200s' (%s, %" PRIu64 " elements) needs %" PRIu64
               " bytes, its data_offsets give %" PRIu64,
               name, e->i64 ? "I64" : st_dtype_name(e->dtype), numel, numel * elem, en - b);
      goto bad;
    }
    e->begin = b;
    e->end = en;
    order[out->n] = e;
    out->by_name[out->n] = e;
    out->n++;
  }
  /* names are unique: sorted, neighbours differ (n log n, however many entries) */
  qsort(out->by_name, (size_t)out->n, sizeof *out->by_name, by_name);
  for (int k = 1; k < out->n; k++)
    if (strcmp(out->by_name[k - 1]->name, out->by_name[k]->name) == 0) {
      snprintf(why, sizeof why, "tensor '%.200s' appears twice", out->by_name[k]->name);
      goto bad;
    }
  /* the byte ranges must tile the data section: no overlap, no hole */
  qsort(order, (size_t)out->n, sizeof *order, by_begin);
  uint64_t at = 0;
  for (int k = 0; k < out->n; k++) {
    if (order[k]->begin != at) {
      snprintf(why, sizeof why,
               "tensor '%.200s' starts at byte %" PRIu64 " where %" PRIu64 " was due (%s)",
               order[k]->name, order[k]->begin, at,
               order[k]->begin < at ? "it overlaps another" : "a hole before it");
      goto bad;
    }
    at = order[k]->end;
  }
  if (at != data_len) {
    snprintf(why, sizeof why, "%" PRIu64 " bytes of data follow the last tensor", data_len - at);
    goto bad;
  }
  free(order);
  return KILN_OK;
bad:
  free(order);
  kiln__st_free(out);
  return kiln__error(ctx, KILN_ERR_FORMAT, "%s: %s: %s", fn, path, why);
}

/* The header's length from the file's first 8 bytes (little-endian), checked against the size;
 * 0 with why filled when it is not plausible. */
static uint64_t header_length(const uint8_t *first8, uint64_t size, char *why, size_t n) {
  uint64_t hlen = 0;
  for (int i = 7; i >= 0; i--)
    hlen = hlen << 8 | first8[i];
  if (hlen > MAX_HEADER || hlen > size - 8) {
    snprintf(why, n, "header length %" PRIu64 " %s", hlen,
             hlen > size - 8 ? "runs past the end of the file (truncated?)" : "is implausible");
    return 0;
  }
  return hlen;
}

kiln_status kiln__st_parse(kiln_ctx *ctx, const char *fn, const char *path, const uint8_t *buf,
                           size_t len, kiln__st_file *out) {
  memset(out, 0, sizeof *out);
  char why[256] = "";
  if (len < 8) {
    snprintf(why, sizeof why, "truncated: %zu bytes, less than the 8-byte header length", len);
    return kiln__error(ctx, KILN_ERR_FORMAT, "%s: %s: %s", fn, path, why);
  }
  uint64_t hlen = header_length(buf, len, why, sizeof why);
  if (why[0]) return kiln__error(ctx, KILN_ERR_FORMAT, "%s: %s: %s", fn, path, why);
  kiln_status s = parse_header(ctx, fn, path, (const char *)buf + 8, hlen, len - 8 - hlen, out);
  if (s == KILN_OK) out->data = buf + 8 + hlen;
  return s;
}

kiln_status kiln__st_open(kiln_ctx *ctx, const char *fn, const char *path, kiln__st_file *out) {
  memset(out, 0, sizeof *out);
  bool irregular;
  uint64_t size = 0;
  FILE *f = kiln__fopen_regular(path, &irregular, &size);
  if (!f && irregular)
    return kiln__error(ctx, KILN_ERR_IO, "%s: %s is not a regular file", fn, path);
  if (!f) return kiln__error(ctx, KILN_ERR_IO, "%s: cannot open %s: %s", fn, path, strerror(errno));
  uint8_t first8[8];
  char why[256] = "";
  if (size < 8 || fread(first8, 1, 8, f) != 8) {
    fclose(f);
    snprintf(why, sizeof why, "truncated: %" PRIu64 " bytes, less than the 8-byte header length",
             size);
    return kiln__error(ctx, KILN_ERR_FORMAT, "%s: %s: %s", fn, path, why);
  }
  /* only the header is read before it is checked; tensor data is read later, into place */
  uint64_t hlen = header_length(first8, size, why, sizeof why);
  char *text = why[0] ? NULL : malloc(hlen > 0 ? hlen : 1);
  if (!why[0] && !text) {
    fclose(f);
    return kiln__error(ctx, KILN_ERR_OOM, "%s: out of host memory for the header of %s", fn, path);
  }
  if (!why[0] && fread(text, 1, hlen, f) != hlen)
    snprintf(why, sizeof why, "cannot read the header");
  kiln_status s = why[0] ? kiln__error(ctx, KILN_ERR_FORMAT, "%s: %s: %s", fn, path, why)
                         : parse_header(ctx, fn, path, text, hlen, size - 8 - hlen, out);
  free(text);
  if (s != KILN_OK) {
    fclose(f);
    return s;
  }
  out->fp = f;
  out->data_start = 8 + hlen;
  return KILN_OK;
}

kiln_status kiln__st_read(kiln_ctx *ctx, const char *fn, const char *path, const kiln__st_file *f,
                          const kiln__st_entry *e, void *dst) {
  uint64_t n = e->end - e->begin;
  if (f->data) {
    memcpy(dst, f->data + e->begin, n);
    return KILN_OK;
  }
  if (fseeko(f->fp, (off_t)(f->data_start + e->begin), SEEK_SET) != 0 ||
      fread(dst, 1, n, f->fp) != n)
    return kiln__error(ctx, KILN_ERR_IO, "%s: cannot read tensor '%.200s' of %s: %s", fn, e->name,
                       path, feof(f->fp) ? "the file shrank" : strerror(errno));
  return KILN_OK;
}

const kiln__st_entry *kiln__st_find(const kiln__st_file *f, const char *name) {
  size_t lo = 0, hi = (size_t)f->n; /* by_name is sorted */
  while (lo < hi) {
    size_t mid = lo + (hi - lo) / 2;
    int c = strcmp(f->by_name[mid]->name, name);
    if (c == 0) return f->by_name[mid];
    if (c < 0)
      lo = mid + 1;
    else
      hi = mid;
  }
  return NULL;
}

static bool write_all(int fd, const void *p, size_t n) {
  const char *c = p;
  while (n > 0) {
    ssize_t k = write(fd, c, n);
    if (k < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    c += k;
    n -= (size_t)k;
  }
  return true;
}

kiln_status kiln__st_write(kiln_ctx *ctx, const char *fn, const char *path, int n,
                           const kiln__st_out *t, const cJSON *metadata) {
  cJSON *h = cJSON_CreateObject();
  char *text = NULL, *tmp = NULL, *dir = NULL;
  if (!h) goto oom;
  if (metadata) {
    cJSON *m = cJSON_Duplicate(metadata, 1);
    if (!m) goto oom;
    cJSON_AddItemToObject(h, "__metadata__", m);
  }
  uint64_t at = 0;
  for (int i = 0; i < n; i++) {
    cJSON *e = cJSON_CreateObject();
    if (!e) goto oom;
    cJSON_AddItemToObject(h, t[i].name, e);
    cJSON_AddStringToObject(e, "dtype", st_dtype_name(t[i].dtype));
    cJSON *sh = cJSON_AddArrayToObject(e, "shape");
    uint64_t bytes = kiln_dtype_size(t[i].dtype);
    for (int d = 0; d < t[i].ndim; d++) {
      cJSON_AddItemToArray(sh, cJSON_CreateNumber((double)t[i].shape[d]));
      bytes *= (uint64_t)t[i].shape[d];
    }
    cJSON *off = cJSON_AddArrayToObject(e, "data_offsets");
    cJSON_AddItemToArray(off, cJSON_CreateNumber((double)at));
    cJSON_AddItemToArray(off, cJSON_CreateNumber((double)(at + bytes)));
    at += bytes;
  }
  text = cJSON_PrintUnformatted(h);
  if (!text) goto oom;
  size_t tl = strlen(text), padded = (tl + 7) & ~(size_t)7; /* data starts 8-byte aligned */
  size_t pl = strlen(path) + 32;
  tmp = malloc(pl);
  dir = malloc(pl);
  if (!tmp || !dir) goto oom;
  snprintf(tmp, pl, "%s.tmp.%ld", path, (long)getpid());
  int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) {
    kiln__error(ctx, KILN_ERR_IO, "%s: cannot create %s: %s", fn, tmp, strerror(errno));
    goto fail;
  }
  unsigned char len8[8];
  for (int i = 0; i < 8; i++)
    len8[i] = (unsigned char)((uint64_t)padded >> (8 * i));
  bool ok =
      write_all(fd, len8, 8) && write_all(fd, text, tl) && write_all(fd, "        ", padded - tl);
  for (int i = 0; i < n && ok; i++) {
    size_t bytes = kiln_dtype_size(t[i].dtype) * (size_t)kiln__numel(t[i].ndim, t[i].shape);
    ok = write_all(fd, t[i].data, bytes);
  }
  ok = ok && fsync(fd) == 0;
  int err = errno;
  if (close(fd) != 0 && ok) {
    ok = false;
    err = errno;
  }
  if (!ok || rename(tmp, path) != 0) {
    if (ok) err = errno;
    unlink(tmp);
    kiln__error(ctx, KILN_ERR_IO, "%s: cannot write %s: %s", fn, path, strerror(err));
    goto fail;
  }
  /* make the rename itself durable */
  snprintf(dir, pl, "%s", path);
  int dfd = open(dirname(dir), O_RDONLY);
  if (dfd >= 0) {
    fsync(dfd);
    close(dfd);
  }
  free(tmp);
  free(dir);
  cJSON_free(text);
  cJSON_Delete(h);
  return KILN_OK;
oom:
  kiln__error(ctx, KILN_ERR_OOM, "%s: out of host memory writing %s", fn, path);
fail:
  free(tmp);
  free(dir);
  cJSON_free(text);
  cJSON_Delete(h);
  return kiln_ctx_status(ctx);
}
