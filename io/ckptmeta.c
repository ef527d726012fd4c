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

void kiln__ckpt_key(int k, const char *field, char *buf, size_t n) {
  char idx[16] = "";
  if (k > 0) snprintf(idx, sizeof idx, "%d", k);
  snprintf(buf, n, "kiln.optim%s%s%s", idx, field ? "." : "", field ? field : "");
}

char *kiln__ckpt_count_key(int k, const char *name) {
  char key[64];
  kiln__ckpt_key(k, "count", key, sizeof key);
  return kiln__strf("%s/%s", key, name);
}

void kiln__ckpt_meta_free(kiln__ckpt_meta *m) {
  for (int k = 0; k < KILN__CKPT_MAX_OPTIMS; k++) {
    free(m->opt[k].counts);
    m->opt[k].counts = NULL;
  }
}

/* Fills why and returns it. */
static const char *bad(char *why, size_t n, const char *what, const char *key, const char *val) {
  snprintf(why, n, "metadata %s is '%.40s'; %s was expected", key, val ? val : "(missing)", what);
  return why;
}

/* Optimizer k's kind, rate, steps and counts (kind optim) into o. */
static const char *parse_optim(const cJSON *m, int k, bool several, const char *optim, int np,
                               const char *const *names, kiln__ckpt_optim *o, bool *oom, char *why,
                               size_t n) {
  char kk[64], lk[64], sk[64];
  kiln__ckpt_key(k, NULL, kk, sizeof kk);
  kiln__ckpt_key(k, "lr", lk, sizeof lk);
  kiln__ckpt_key(k, "steps", sk, sizeof sk);
  const char *kind = meta_str(m, kk), *lrs = meta_str(m, lk);
  if (!kind || strcmp(kind, optim) != 0) {
    if (k == 0 && !several)
      snprintf(why, n, "it holds %.20s optimizer state; the optimizer is %s", kind ? kind : "no",
               optim);
    else
      snprintf(why, n, "its optimizer %d holds %.20s state; the optimizer given there is %s", k,
               kind ? kind : "no", optim);
    return why;
  }
  char *end = NULL;
  if (lrs) o->lr = strtof(lrs, &end);
  if (!lrs || !*lrs || *end != 0 || !(o->lr >= 0.f) || !isfinite(o->lr))
    return bad(why, n, "a finite rate >= 0", lk, lrs);
  if (!meta_num(m, sk, INT64_MAX, &o->steps))
    return bad(why, n, "a step count", sk, meta_str(m, sk));
  o->counts = calloc((size_t)np + 1, sizeof *o->counts);
  if (!o->counts) {
    *oom = true;
    snprintf(why, n, "out of host memory");
    return why;
  }
  char ck[64];
  kiln__ckpt_key(k, "count", ck, sizeof ck);
  for (int i = 0; i < np; i++) {
    char *key = kiln__ckpt_count_key(k, names[i]);
    uint64_t c;
    if (!key) {
      *oom = true;
      snprintf(why, n, "out of host memory");
      return why;
    }
    /* a parameter has had no more updates than the optimizer has made steps */
    if (!meta_num(m, key, o->steps, &c)) {
      snprintf(why, n, "metadata %s/%.200s is no update count (at most the steps)", ck, names[i]);
      free(key);
      return why;
    }
    free(key);
    o->counts[i] = (int64_t)c;
  }
  return NULL;
}

const char *kiln__ckpt_meta_parse(const cJSON *m, const char *const *optims, int nopt, int np,
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
  if (nopt <= 0) return NULL;
  /* how many optimizers' state the file holds: kiln.optims where several (one: kiln.optim) */
  uint64_t held = meta_str(m, "kiln.optim") ? 1 : 0;
  if (meta_str(m, "kiln.optims") &&
      (!meta_num(m, "kiln.optims", KILN__CKPT_MAX_OPTIMS, &held) || held < 2))
    return bad(why, n, "a count of optimizers from 2 to 16", "kiln.optims",
               meta_str(m, "kiln.optims"));
  if (nopt == 1 && held > 1) {
    snprintf(why, n,
             "it holds the state of %llu optimizers; one is given (load it with all of them)",
             (unsigned long long)held);
    return why;
  }
  if (nopt > 1 && held != (uint64_t)nopt) {
    snprintf(why, n, "it holds the state of %llu optimizer%s; %d are given",
             (unsigned long long)held, held == 1 ? "" : "s", nopt);
    return why;
  }
  for (int k = 0; k < nopt && k < KILN__CKPT_MAX_OPTIMS; k++)
    if (parse_optim(m, k, nopt > 1, optims[k], np, names, &out->opt[k], &out->oom, why, n))
      return why;
  return NULL;
}
