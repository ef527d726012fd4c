/*
 * checkpoint.c: parameters in safetensors (F32 or BF16, by name) and training checkpoints:
 * parameters, optimizer state, step counts, learning rate, RNG state and the caller's metadata in
 * one safetensors file. A load checks the whole file against the model first and changes nothing
 * unless everything fits.
 */
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "../optim/optim.h"
#include "safetensors.h"

/* ---------------------------------------------------------------- metadata */

typedef struct kv {
  char *k, *v;
} kv;

struct kiln_meta {
  kv *kv;
  int n, cap;
};

kiln_meta *kiln_meta_new(void) { return calloc(1, sizeof(kiln_meta)); }

void kiln_meta_free(kiln_meta *m) {
  if (!m) return;
  for (int i = 0; i < m->n; i++) {
    free(m->kv[i].k);
    free(m->kv[i].v);
  }
  free(m->kv);
  free(m);
}

int kiln_meta_set(kiln_meta *m, const char *key, const char *value) {
  if (!m || !key || !value) return -1;
  char *v = strdup(value);
  if (!v) return -1;
  for (int i = 0; i < m->n; i++)
    if (strcmp(m->kv[i].k, key) == 0) {
      free(m->kv[i].v);
      m->kv[i].v = v;
      return 0;
    }
  char *k = strdup(key);
  if (!k || !KILN__GROW(m->kv, m->cap, m->n + 1)) {
    free(k);
    free(v);
    return -1;
  }
  m->kv[m->n++] = (kv){.k = k, .v = v};
  return 0;
}

const char *kiln_meta_get(const kiln_meta *m, const char *key) {
  for (int i = 0; m && key && i < m->n; i++)
    if (strcmp(m->kv[i].k, key) == 0) return m->kv[i].v;
  return NULL;
}
int kiln_meta_count(const kiln_meta *m) { return m ? m->n : 0; }
const char *kiln_meta_key(const kiln_meta *m, int i) {
  return m && i >= 0 && i < m->n ? m->kv[i].k : NULL;
}

/* ---------------------------------------------------------------- dtype conversion */

static uint16_t to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* quiet NaN */
  u += 0x7fffu + ((u >> 16) & 1u); /* round to nearest, ties to even */
  return (uint16_t)(u >> 16);
}

static float from_bf16(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

/* ---------------------------------------------------------------- the tensors of a file */

/* One tensor of the model that a file holds: where it lives and its host copy. */
typedef struct slot {
  char name[160];
  kiln_tensor *t;
  void *host; /* in the file's dtype for saving; f32 for loading */
} slot;

typedef struct slots {
  slot *s;
  int n, cap;
} slots;

static bool slots_add(slots *ss, const char *name, kiln_tensor *t) {
  if (!KILN__GROW(ss->s, ss->cap, ss->n + 1)) return false;
  slot *s = &ss->s[ss->n++];
  snprintf(s->name, sizeof s->name, "%s", name);
  s->t = t;
  s->host = NULL;
  return true;
}

static void slots_free(slots *ss) {
  for (int i = 0; i < ss->n; i++)
    free(ss->s[i].host);
  free(ss->s);
}

/* The tensors a checkpoint of (p, o) holds, in a fixed order. */
static bool gather(const kiln_params *p, const kiln_optim *o, slots *ss) {
  for (int i = 0; i < kiln_params_count(p); i++)
    if (!slots_add(ss, kiln_params_name(p, i), kiln_params_get(p, i))) return false;
  for (int i = 0; o && i < kiln_params_count(p); i++) {
    for (int w = 0; w < 2; w++) {
      const char *what;
      kiln_tensor *t = kiln__optim_state(o, i, w, &what);
      if (!t) continue;
      char name[160];
      snprintf(name, sizeof name, "optim/%s/%s", kiln_params_name(p, i), what);
      if (!slots_add(ss, name, t)) return false;
    }
  }
  return true;
}

static kiln_status save(const char *fn, const char *path, const kiln_params *p, const kiln_optim *o,
                        kiln_dtype dtype, const cJSON *meta) {
  kiln_ctx *ctx = kiln_params_ctx(p);
  if (!ctx) return KILN_ERR_INVALID;
  if (!kiln__ok(ctx)) return ctx->status;
  if (!path) return kiln__error(ctx, KILN_ERR_INVALID, "%s: NULL path", fn);
  if (dtype != KILN_DTYPE_F32 && dtype != KILN_DTYPE_BF16)
    return kiln__error(ctx, KILN_ERR_DTYPE, "%s: parameters are saved as f32 or bf16, not %s", fn,
                       kiln_dtype_name(dtype));
  slots ss = {0};
  kiln__st_out *out = NULL;
  if (!gather(p, o, &ss) || !(out = calloc((size_t)ss.n + 1, sizeof *out))) {
    kiln__error(ctx, KILN_ERR_OOM, "%s: out of host memory", fn);
    goto done;
  }
  for (int i = 0; i < ss.n; i++) {
    slot *s = &ss.s[i];
    int64_t n = kiln_tensor_numel(s->t);
    float *f = malloc((size_t)(n > 0 ? n : 1) * sizeof *f);
    if (!f) {
      kiln__error(ctx, KILN_ERR_OOM, "%s: out of host memory for '%s'", fn, s->name);
      goto done;
    }
    s->host = f;
    if (kiln_tensor_to_host(s->t, f, (size_t)n * sizeof *f) != KILN_OK) goto done;
    kiln_dtype dt = i < kiln_params_count(p) ? dtype : KILN_DTYPE_F32; /* state stays f32 */
    if (dt == KILN_DTYPE_BF16) {
      uint16_t *h = (uint16_t *)f; /* in place: each bf16 fits where its float was */
      for (int64_t k = 0; k < n; k++)
        h[k] = to_bf16(f[k]);
    }
    out[i] = (kiln__st_out){
        .name = s->name, .dtype = dt, .ndim = s->t->ndim, .shape = s->t->shape, .data = s->host};
  }
  kiln__st_write(ctx, fn, path, ss.n, out, meta);
done:
  free(out);
  slots_free(&ss);
  return ctx->status;
}

/* Checks the file against the model's tensors and reads each into slot.host as f32; touches no
 * tensor. */
static kiln_status match(kiln_ctx *ctx, const char *fn, const char *path, const kiln__st_file *f,
                         slots *ss, int nparams) {
  for (int i = 0; i < ss->n; i++) {
    slot *s = &ss->s[i];
    const kiln__st_entry *e = kiln__st_find(f, s->name);
    char want[96], got[96];
    if (!e)
      return kiln__error(ctx, KILN_ERR_FORMAT, "%s: %s has no tensor '%s' (%s)", fn, path, s->name,
                         kiln__shape_of(s->t, want, sizeof want));
    kiln_shape es = {.ndim = e->ndim};
    memcpy(es.d, e->shape, sizeof es.d);
    bool same = e->ndim == s->t->ndim;
    for (int d = 0; same && d < e->ndim; d++)
      same = e->shape[d] == s->t->shape[d];
    if (!same)
      return kiln__error(ctx, KILN_ERR_FORMAT,
                         "%s: %s: tensor '%s' is %s in the file, %s in the "
                         "model",
                         fn, path, s->name, kiln_shape_str(es, got, sizeof got),
                         kiln__shape_of(s->t, want, sizeof want));
    bool ok_dt = e->dtype == KILN_DTYPE_F32 || (e->dtype == KILN_DTYPE_BF16 && i < nparams);
    if (!ok_dt)
      return kiln__error(ctx, KILN_ERR_FORMAT, "%s: %s: tensor '%s' is %s; %s", fn, path, s->name,
                         kiln_dtype_name(e->dtype),
                         i < nparams ? "parameters load from f32 or bf16"
                                     : "optimizer state loads from f32");
    int64_t n = kiln_tensor_numel(s->t);
    float *h = malloc((size_t)(n > 0 ? n : 1) * sizeof *h);
    if (!h) return kiln__error(ctx, KILN_ERR_OOM, "%s: out of host memory for '%s'", fn, s->name);
    s->host = h;
    const uint8_t *src = f->data + e->begin;
    if (e->dtype == KILN_DTYPE_F32) {
      memcpy(h, src, (size_t)n * sizeof *h);
    } else {
      for (int64_t k = 0; k < n; k++) {
        uint16_t b;
        memcpy(&b, src + 2 * k, 2);
        h[k] = from_bf16(b);
      }
    }
  }
  /* a tensor in the file that the model does not have means a different model */
  for (int k = 0; k < f->n; k++) {
    bool known = false;
    for (int i = 0; i < ss->n && !known; i++)
      known = strcmp(ss->s[i].name, f->e[k].name) == 0;
    if (!known)
      return kiln__error(ctx, KILN_ERR_FORMAT, "%s: %s has tensor '%s', which the model lacks", fn,
                         path, f->e[k].name);
  }
  return KILN_OK;
}

static kiln_status upload(slots *ss) {
  for (int i = 0; i < ss->n; i++) {
    kiln_tensor *t = ss->s[i].t;
    kiln_status s =
        kiln_tensor_copy_from_host(t, ss->s[i].host, (size_t)kiln_tensor_numel(t) * sizeof(float));
    if (s != KILN_OK) return s;
  }
  return KILN_OK;
}

kiln_status kiln_params_save(const kiln_params *p, const char *path, kiln_dtype dtype) {
  return save(__func__, path, p, NULL, dtype, NULL);
}

/* Reads and checks path for fn; NULL (the error set, when there is a context) on failure. */
static kiln_ctx *read_parsed(const char *fn, const kiln_params *p, const char *path, uint8_t **buf,
                             kiln__st_file *f) {
  kiln_ctx *ctx = kiln_params_ctx(p);
  *buf = NULL;
  memset(f, 0, sizeof *f);
  if (!ctx || !kiln__ok(ctx)) return NULL;
  if (!path) return kiln__error(ctx, KILN_ERR_INVALID, "%s: NULL path", fn), NULL;
  size_t len;
  if (kiln__read_file(ctx, fn, path, buf, &len) != KILN_OK) return NULL;
  if (kiln__st_parse(ctx, fn, path, *buf, len, f) != KILN_OK) {
    free(*buf);
    *buf = NULL;
    return NULL;
  }
  return ctx;
}

kiln_status kiln_params_load(kiln_params *p, const char *path) {
  const char *fn = __func__;
  uint8_t *buf;
  kiln__st_file f;
  kiln_ctx *ctx = read_parsed(fn, p, path, &buf, &f);
  if (!ctx) return kiln_params_ctx(p) ? kiln_ctx_status(kiln_params_ctx(p)) : KILN_ERR_INVALID;
  slots ss = {0};
  if (!gather(p, NULL, &ss))
    kiln__error(ctx, KILN_ERR_OOM, "%s: out of host memory", fn);
  else if (match(ctx, fn, path, &f, &ss, ss.n) == KILN_OK)
    upload(&ss);
  kiln__st_free(&f);
  slots_free(&ss);
  free(buf);
  return ctx->status;
}

/* ---------------------------------------------------------------- checkpoints */

#define FORMAT "kiln-checkpoint-1"

static void meta_u64(cJSON *m, const char *k, uint64_t v) {
  char buf[32];
  snprintf(buf, sizeof buf, "%" PRIu64, v);
  cJSON_AddStringToObject(m, k, buf);
}

kiln_status kiln_checkpoint_save(const char *path, const kiln_params *p, const kiln_optim *o,
                                 const kiln_meta *user) {
  const char *fn = __func__;
  kiln_ctx *ctx = kiln_params_ctx(p);
  if (!ctx) return KILN_ERR_INVALID;
  if (!kiln__ok(ctx)) return ctx->status;
  cJSON *m = cJSON_CreateObject();
  if (!m) return kiln__error(ctx, KILN_ERR_OOM, "%s: out of host memory", fn);
  cJSON_AddStringToObject(m, "kiln.format", FORMAT);
  cJSON_AddStringToObject(m, "kiln.version", kiln_version());
  meta_u64(m, "kiln.rng.seed", ctx->seed);
  meta_u64(m, "kiln.rng.philox_offset", ctx->philox_offset);
  meta_u64(m, "kiln.rng.host", ctx->host_rng);
  if (o) {
    char buf[64];
    cJSON_AddStringToObject(m, "kiln.optim", kiln__optim_kind(o));
    meta_u64(m, "kiln.optim.steps", (uint64_t)kiln_optim_steps(o));
    snprintf(buf, sizeof buf, "%.9g", kiln_optim_lr(o));
    cJSON_AddStringToObject(m, "kiln.optim.lr", buf);
    for (int i = 0; i < kiln_params_count(p); i++) {
      char key[200];
      snprintf(key, sizeof key, "kiln.optim.count/%s", kiln_params_name(p, i));
      meta_u64(m, key, (uint64_t)kiln__optim_count(o, i));
    }
  }
  for (int i = 0; i < kiln_meta_count(user); i++) {
    const char *k = kiln_meta_key(user, i);
    if (strncmp(k, "kiln.", 5) == 0) {
      cJSON_Delete(m);
      return kiln__error(ctx, KILN_ERR_INVALID, "%s: metadata key '%s': \"kiln.\" keys are kiln's",
                         fn, k);
    }
    cJSON_AddStringToObject(m, k, kiln_meta_get(user, k));
  }
  kiln_status s = save(fn, path, p, o, KILN_DTYPE_F32, m);
  cJSON_Delete(m);
  return s;
}

static const char *meta_str(const cJSON *m, const char *k) {
  const cJSON *v = m ? cJSON_GetObjectItemCaseSensitive(m, k) : NULL;
  return cJSON_IsString(v) ? v->valuestring : NULL;
}

static bool meta_num(const cJSON *m, const char *k, uint64_t *v) {
  const char *s = meta_str(m, k);
  if (!s || !*s) return false;
  char *end;
  *v = strtoull(s, &end, 10);
  return *end == 0;
}

kiln_status kiln_checkpoint_load(const char *path, kiln_params *p, kiln_optim *o, kiln_meta *user) {
  const char *fn = __func__;
  uint8_t *buf;
  kiln__st_file f;
  kiln_ctx *ctx = read_parsed(fn, p, path, &buf, &f);
  if (!ctx) return kiln_params_ctx(p) ? kiln_ctx_status(kiln_params_ctx(p)) : KILN_ERR_INVALID;
  slots ss = {0};
  int np = kiln_params_count(p);
  int64_t *counts = calloc((size_t)np + 1, sizeof *counts);
  const cJSON *m = f.metadata;
  const char *format = meta_str(m, "kiln.format");
  uint64_t seed, off, host, steps = 0;
  if (!format || strcmp(format, FORMAT) != 0 || !meta_num(m, "kiln.rng.seed", &seed) ||
      !meta_num(m, "kiln.rng.philox_offset", &off) || !meta_num(m, "kiln.rng.host", &host)) {
    kiln__error(ctx, KILN_ERR_FORMAT, "%s: %s is not a kiln checkpoint (no %s metadata)", fn, path,
                FORMAT);
    goto done;
  }
  float lr = 0;
  if (o) {
    const char *kind = meta_str(m, "kiln.optim"), *lrs = meta_str(m, "kiln.optim.lr");
    if (!kind || strcmp(kind, kiln__optim_kind(o)) != 0 || !lrs ||
        !meta_num(m, "kiln.optim.steps", &steps)) {
      kiln__error(ctx, KILN_ERR_FORMAT, "%s: %s holds %s optimizer state; the optimizer is %s", fn,
                  path, kind ? kind : "no", kiln__optim_kind(o));
      goto done;
    }
    lr = strtof(lrs, NULL);
    for (int i = 0; i < np; i++) {
      char key[200];
      uint64_t c;
      snprintf(key, sizeof key, "kiln.optim.count/%s", kiln_params_name(p, i));
      if (!meta_num(m, key, &c)) {
        kiln__error(ctx, KILN_ERR_FORMAT, "%s: %s lacks the update count of '%s'", fn, path,
                    kiln_params_name(p, i));
        goto done;
      }
      counts[i] = (int64_t)c;
    }
  }
  if (!counts || !gather(p, o, &ss)) {
    kiln__error(ctx, KILN_ERR_OOM, "%s: out of host memory", fn);
    goto done;
  }
  if (match(ctx, fn, path, &f, &ss, np) != KILN_OK || upload(&ss) != KILN_OK) goto done;
  /* all tensors are in: now the scalars */
  ctx->seed = seed;
  ctx->philox_offset = off;
  ctx->host_rng = host;
  if (o) {
    kiln_optim_set_lr(o, lr);
    kiln__optim_restore(o, (int64_t)steps, counts);
  }
  for (const cJSON *it = m ? m->child : NULL; it && user; it = it->next)
    if (strncmp(it->string, "kiln.", 5) != 0) kiln_meta_set(user, it->string, it->valuestring);
done:
  kiln__st_free(&f);
  slots_free(&ss);
  free(counts);
  free(buf);
  return ctx->status;
}
