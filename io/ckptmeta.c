/*
 * ckptmeta.c: the metadata of a training checkpoint (format, RNG state, optimizer kind, rate and
 * step counts), parsed and checked in full before a load changes anything. No CUDA and no
 * context: the safetensors fuzzer drives it too.
 */
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "safetensors.h"

static const char *meta_str(const cJSON *m, const char *k) {
  const cJSON *v = m ? cJSON_GetObjectItemCaseSensitive(m, k) : NULL;
  return cJSON_IsString(v) ? v->valuestring : NULL;
}

/* An unsigned decimal of at most max: digits only (no sign, no space), no overflow. */
static bool meta_num(const cJSON *m, const char *k, uint64_t max, uint64_t *v) {
  const char *s = meta_str(m, k);
  if (!s || *s < '0' || *s > '9') return false;
  errno = 0;
  char *end;
  unsigned long long x = strtoull(s, &end, 10);
  if (*end != 0 || errno == ERANGE || x > max) return false;
  *v = x;
  return true;
}

char *kiln__ckpt_count_key(const char *name) { return kiln__strf("kiln.optim.count/%s", name); }

/* Fills why and returns it. */
static const char *bad(char *why, size_t n, const char *what, const char *key, const char *val) {
  snprintf(why, n, "metadata %s is '%.40s'; %s was expected", key, val ? val : "(missing)", what);
  return why;
}

const char *kiln__ckpt_meta_parse(const cJSON *m, const char *optim, int np,
                                  const char *const *names, kiln__ckpt_meta *out, char *why,
                                  size_t n) {
  memset(out, 0, sizeof *out);
  const char *format = meta_str(m, "kiln.format");
  if (!format || strcmp(format, KILN__CKPT_FORMAT) != 0) {
    snprintf(why, n, "not a kiln checkpoint (no %s metadata)", KILN__CKPT_FORMAT);
    return why;
  }
  const char *number = "a decimal unsigned 64-bit number";
  if (!meta_num(m, "kiln.rng.seed", UINT64_MAX, &out->seed))
    return bad(why, n, number, "kiln.rng.seed", meta_str(m, "kiln.rng.seed"));
  if (!meta_num(m, "kiln.rng.philox_offset", UINT64_MAX, &out->philox_offset))
    return bad(why, n, number, "kiln.rng.philox_offset", meta_str(m, "kiln.rng.philox_offset"));
  if (!meta_num(m, "kiln.rng.host", UINT64_MAX, &out->host_rng))
    return bad(why, n, number, "kiln.rng.host", meta_str(m, "kiln.rng.host"));
  if (!optim) return NULL;
  const char *kind = meta_str(m, "kiln.optim"), *lrs = meta_str(m, "kiln.optim.lr");
  if (!kind || strcmp(kind, optim) != 0) {
    snprintf(why, n, "it holds %.20s optimizer state; the optimizer is %s", kind ? kind : "no",
             optim);
    return why;
  }
  char *end = NULL;
  if (lrs) out->lr = strtof(lrs, &end);
  if (!lrs || !*lrs || *end != 0 || !(out->lr >= 0.f) || !isfinite(out->lr))
    return bad(why, n, "a finite rate >= 0", "kiln.optim.lr", lrs);
  if (!meta_num(m, "kiln.optim.steps", INT64_MAX, &out->steps))
    return bad(why, n, "a step count", "kiln.optim.steps", meta_str(m, "kiln.optim.steps"));
  out->counts = calloc((size_t)np + 1, sizeof *out->counts);
  if (!out->counts) {
    snprintf(why, n, "out of host memory");
    return why;
  }
  for (int i = 0; i < np; i++) {
    char *key = kiln__ckpt_count_key(names[i]);
    uint64_t c;
    /* a parameter has had no more updates than the optimizer has made steps */
    bool ok = key && meta_num(m, key, out->steps, &c);
    if (!ok) {
      snprintf(why, n, "metadata kiln.optim.count/%.200s is no update count (at most the steps)",
               names[i]);
      free(key);
      return why;
    }
    free(key);
    out->counts[i] = (int64_t)c;
  }
  return NULL;
}
