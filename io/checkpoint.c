/*
 * checkpoint.c: parameters in safetensors (F32 or BF16, by name) and training checkpoints:
 * parameters, optimizer state, step counts, learning rate, RNG state and the caller's metadata in
 * one safetensors file, of one optimizer or several over the same parameters (Muon beside SGD):
 * optimizer k's tensors under "optim/" (k = 0) or "optim<k>/", its metadata under "kiln.optim"
 * or "kiln.optim<k>". A load checks the whole file against the model first and changes nothing
 * unless everything fits.
 */
#include <errno.h>
#include <inttypes.h>
#include <math.h>
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

/* ---------------------------------------------------------------- the tensors of a file */

/* One tensor of the model that a file holds: where it lives and its host copy. */
typedef struct slot {
  char *name; /* malloc'd */
  kiln_tensor *t;
  void *host; /* in the file's dtype for saving; f32 for loading */
} slot;

typedef struct slots {
  slot *s;
  int n, cap;
} slots;

/* Adds tensor t under the name prefix + name + suffix. */
static bool slots_add(slots *ss, const char *prefix, const char *name, const char *suffix,
                      kiln_tensor *t) {
  char *copy = kiln__strf("%s%s%s", prefix, name, suffix);
  if (!copy || !KILN__GROW(ss->s, ss->cap, ss->n + 1)) {
    free(copy);
    return false;
  }
  ss->s[ss->n++] = (slot){.name = copy, .t = t};
  return true;
}

static void slots_free(slots *ss) {
  for (int i = 0; i < ss->n; i++) {
    free(ss->s[i].host);
    free(ss->s[i].name);
  }
  free(ss->s);
}

static int by_slot_name(const void *a, const void *b) {
  return strcmp(((const slot *)a)->name, ((const slot *)b)->name);
}

/* A name two slots share (a parameter named like another's optimizer state), or NULL. */
static const char *shared_name(const slots *ss) {
  if (ss->n < 2) return NULL; /* (no list to copy: memcpy from NULL is undefined) */
  slot *sorted = malloc((size_t)(ss->n + 1) * sizeof *sorted);
  if (!sorted) return NULL;
  memcpy(sorted, ss->s, (size_t)ss->n * sizeof *sorted);
  qsort(sorted, (size_t)ss->n, sizeof *sorted, by_slot_name);
  const char *dup = NULL;
  for (int i = 1; i < ss->n && !dup; i++)
    if (strcmp(sorted[i - 1].name, sorted[i].name) == 0) dup = sorted[i].name;
  free(sorted);
  return dup;
}

/* The prefix of optimizer k's tensors: "optim/" for the first, "optim<k>/" for the others. */
static void state_prefix(int k, char *buf, size_t n) {
  if (k == 0)
    snprintf(buf, n, "optim/");
  else
    snprintf(buf, n, "optim%d/", k);
}

/* Whether a tensor's name is an optimizer's state: "optim", digits or none, then '/'. */
static bool is_state_name(const char *nm) {
  if (strncmp(nm, "optim", 5) != 0) return false;
  nm += 5;
  while (*nm >= '0' && *nm <= '9')
    nm++;
  return *nm == '/';
}

/* The tensors a checkpoint of p and the nopt optimizers o holds, in a fixed order. */
static bool gather(const kiln_params *p, const kiln_optim *const *o, int nopt, slots *ss) {
  for (int i = 0; i < kiln_params_count(p); i++)
    if (!slots_add(ss, "", kiln_params_name(p, i), "", kiln_params_get(p, i))) return false;
  for (int k = 0; k < nopt; k++) {
    char prefix[24];
    state_prefix(k, prefix, sizeof prefix);
    for (int i = 0; i < kiln_params_count(p); i++)
      for (int w = 0; w < 2; w++) {
        const char *what;
        kiln_tensor *t = kiln__optim_state(o[k], i, w, &what);
        if (!t) continue;
        char suffix[32];
        snprintf(suffix, sizeof suffix, "/%s", what);
        if (!slots_add(ss, prefix, kiln_params_name(p, i), suffix, t)) return false;
      }
  }
  return true;
}

static kiln_status save(const char *fn, const char *path, const kiln_params *p,
                        const kiln_optim *const *o, int nopt, kiln_dtype dtype, const cJSON *meta) {
  kiln_ctx *ctx = kiln_params_ctx(p);
  if (!ctx) return KILN_ERR_INVALID;
  if (!kiln__ok(ctx)) return ctx->status;
  if (!path) return kiln__error(ctx, KILN_ERR_INVALID, "%s: NULL path", fn);
  if (dtype != KILN_DTYPE_F32 && dtype != KILN_DTYPE_BF16)
    return kiln__error(ctx, KILN_ERR_DTYPE, "%s: parameters are saved as f32 or bf16, not %s", fn,
                       kiln_dtype_name(dtype));
  slots ss = {0};
  kiln__st_out *out = NULL;
  if (!gather(p, o, nopt, &ss) || !(out = calloc((size_t)ss.n + 1, sizeof *out))) {
    kiln__error(ctx, KILN_ERR_OOM, "%s: out of host memory", fn);
    goto done;
  }
  const char *dup = shared_name(&ss);
  if (dup) {
    kiln__error(ctx, KILN_ERR_INVALID, "%s: two tensors would be saved as '%s'", fn, dup);
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
        h[k] = kiln_bf16_from_f32(f[k]);
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

/* How a load treats names: strict (every tensor of the model in the file and no other), or not
 * (torch's strict=False: the model's tensors the file lacks keep their values, the file's tensors
 * the model lacks are passed over; both counted); and whether the file's optimizer state
 * ("optim/...") is passed over (a weights-only load of a training checkpoint). */
typedef struct names_rule {
  bool strict, skip_state;
  int missing, unexpected; /* counted when not strict */
} names_rule;

/* Checks the file against the model's tensors, then reads each into slot.host as f32; touches no
 * tensor. Every name, shape and dtype is checked before any tensor's data is read. A slot the
 * file lacks (not strict) is left without host data, and upload passes it over. */
static kiln_status match(kiln_ctx *ctx, const char *fn, const char *path, const kiln__st_file *f,
                         slots *ss, int nparams, names_rule *rule) {
  for (int i = 0; i < ss->n; i++) {
    slot *s = &ss->s[i];
    const kiln__st_entry *e = kiln__st_find(f, s->name);
    char want[96], got[96];
    if (!e && !rule->strict) {
      rule->missing++;
      continue;
    }
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
    bool ok_dt =
        !e->i64 && (e->dtype == KILN_DTYPE_F32 || (e->dtype == KILN_DTYPE_BF16 && i < nparams));
    if (!ok_dt)
      return kiln__error(ctx, KILN_ERR_FORMAT, "%s: %s: tensor '%s' is %s; %s", fn, path, s->name,
                         e->i64 ? "i64" : kiln_dtype_name(e->dtype),
                         i < nparams ? "parameters load from f32 or bf16"
                                     : "optimizer state loads from f32");
  }
  /* a tensor in the file that the model does not have means a different model (names in the
   * file are unique: with every slot's found, any more entries are extra) */
  for (int k = 0; k < f->n && f->n > ss->n - rule->missing; k++) {
    /* PyTorch's batch-norm step counter, which kiln does not keep */
    const char *nm = f->e[k].name, *tail = ".num_batches_tracked";
    size_t ln = strlen(nm), lt = strlen(tail);
    bool known = (f->e[k].i64 && ln >= lt && strcmp(nm + ln - lt, tail) == 0) ||
                 (rule->skip_state && is_state_name(nm));
    for (int i = 0; i < ss->n && !known; i++)
      known = strcmp(ss->s[i].name, nm) == 0;
    if (!known && !rule->strict)
      rule->unexpected++;
    else if (!known)
      return kiln__error(ctx, KILN_ERR_FORMAT,
                         "%s: %s has tensor '%.200s', which the model lacks (a non-strict load, "
                         "kiln_params_load_with, passes such tensors over)",
                         fn, path, f->e[k].name);
  }
  for (int i = 0; i < ss->n; i++) {
    slot *s = &ss->s[i];
    const kiln__st_entry *e = kiln__st_find(f, s->name);
    if (!e) continue; /* not strict: the model's value stays */
    int64_t n = kiln_tensor_numel(s->t);
    float *h = malloc((size_t)(n > 0 ? n : 1) * sizeof *h);
    if (!h) return kiln__error(ctx, KILN_ERR_OOM, "%s: out of host memory for '%s'", fn, s->name);
    s->host = h;
    /* straight into place: bf16 into the buffer's first half, widened from the back */
    if (kiln__st_read(ctx, fn, path, f, e, h) != KILN_OK) return ctx->status;
    if (e->dtype == KILN_DTYPE_BF16)
      for (int64_t k = n - 1; k >= 0; k--) {
        uint16_t b;
        memcpy(&b, (const char *)h + 2 * k, 2);
        h[k] = kiln_bf16_to_f32(b);
      }
  }
  return KILN_OK;
}

static kiln_status upload(slots *ss) {
  for (int i = 0; i < ss->n; i++) {
    kiln_tensor *t = ss->s[i].t;
    if (!ss->s[i].host) continue; /* a non-strict load's tensor the file lacks */
    kiln_status s =
        kiln_tensor_copy_from_host(t, ss->s[i].host, (size_t)kiln_tensor_numel(t) * sizeof(float));
    if (s != KILN_OK) return s;
  }
  return KILN_OK;
}

kiln_status kiln_params_save(const kiln_params *p, const char *path, kiln_dtype dtype) {
  return save(__func__, path, p, NULL, 0, dtype, NULL);
}

/* Opens and checks path's header for fn; NULL (the error set, when there is a context) on
 * failure. */
static kiln_ctx *open_checked(const char *fn, const kiln_params *p, const char *path,
                              kiln__st_file *f) {
  kiln_ctx *ctx = kiln_params_ctx(p);
  memset(f, 0, sizeof *f);
  if (!ctx || !kiln__ok(ctx)) return NULL;
  if (!path) return kiln__error(ctx, KILN_ERR_INVALID, "%s: NULL path", fn), NULL;
  return kiln__st_open(ctx, fn, path, f) == KILN_OK ? ctx : NULL;
}

/* Whether the file's metadata says it is a kiln training checkpoint. */
static bool is_checkpoint(const kiln__st_file *f) {
  const cJSON *fmt =
      f->metadata ? cJSON_GetObjectItemCaseSensitive(f->metadata, "kiln.format") : NULL;
  return cJSON_IsString(fmt) && strcmp(fmt->valuestring, KILN__CKPT_FORMAT) == 0;
}

static kiln_status params_load(const char *fn, kiln_params *p, const char *path,
                               kiln_load_options *o) {
  kiln__st_file f;
  kiln_ctx *ctx = open_checked(fn, p, path, &f);
  if (!ctx) return kiln_params_ctx(p) ? kiln_ctx_status(kiln_params_ctx(p)) : KILN_ERR_INVALID;
  /* a training checkpoint's weights: its optimizer state and RNG are passed over */
  names_rule rule = {.strict = !o || !o->non_strict, .skip_state = is_checkpoint(&f)};
  slots ss = {0};
  if (!gather(p, NULL, 0, &ss))
    kiln__error(ctx, KILN_ERR_OOM, "%s: out of host memory", fn);
  else if (match(ctx, fn, path, &f, &ss, ss.n, &rule) == KILN_OK && upload(&ss) == KILN_OK && o) {
    o->missing = rule.missing;
    o->unexpected = rule.unexpected;
  }
  kiln__st_free(&f);
  slots_free(&ss);
  return ctx->status;
}

kiln_status kiln_params_load(kiln_params *p, const char *path) {
  return params_load(__func__, p, path, NULL);
}

kiln_status kiln_params_load_with(kiln_params *p, const char *path, kiln_load_options *o) {
  return params_load(__func__, p, path, o);
}

/* ---------------------------------------------------------------- checkpoints */

static void meta_u64(cJSON *m, const char *k, uint64_t v) {
  char buf[32];
  snprintf(buf, sizeof buf, "%" PRIu64, v);
  cJSON_AddStringToObject(m, k, buf);
}

/* Whether o[0 .. n-1] are n distinct optimizers over p (with n in range); else the error. */
static bool optims_ok(const char *fn, const kiln_params *p, const kiln_optim *const *o, int n) {
  kiln_ctx *ctx = kiln_params_ctx(p);
  if (n < 0 || n > KILN__CKPT_MAX_OPTIMS || (n > 0 && !o))
    return kiln__error(ctx, KILN_ERR_INVALID, "%s: %d optimizers%s (0 to %d, and a list)", fn, n,
                       n > 0 && !o ? " in a NULL list" : "", KILN__CKPT_MAX_OPTIMS),
           false;
  for (int k = 0; k < n; k++) {
    if (!o[k]) return kiln__error(ctx, KILN_ERR_INVALID, "%s: optimizer %d is NULL", fn, k), false;
    if (kiln__optim_params(o[k]) != p)
      return kiln__error(ctx, KILN_ERR_INVALID,
                         "%s: optimizer %d (%s) updates another parameter list than the one "
                         "given",
                         fn, k, kiln__optim_kind(o[k])),
             false;
    for (int j = 0; j < k; j++)
      if (o[j] == o[k])
        return kiln__error(ctx, KILN_ERR_INVALID, "%s: optimizers %d and %d are the same one", fn,
                           j, k),
               false;
  }
  return true;
}

static kiln_status checkpoint_save(const char *fn, const char *path, const kiln_params *p,
                                   const kiln_optim *const *o, int nopt, const kiln_meta *user) {
  kiln_ctx *ctx = kiln_params_ctx(p);
  if (!ctx) return KILN_ERR_INVALID;
  if (!kiln__ok(ctx)) return ctx->status;
  if (!optims_ok(fn, p, o, nopt)) return ctx->status;
  cJSON *m = cJSON_CreateObject();
  if (!m) return kiln__error(ctx, KILN_ERR_OOM, "%s: out of host memory", fn);
  cJSON_AddStringToObject(m, "kiln.format", KILN__CKPT_FORMAT);
  cJSON_AddStringToObject(m, "kiln.version", kiln_version());
  meta_u64(m, "kiln.rng.seed", ctx->seed);
  meta_u64(m, "kiln.rng.philox_offset", ctx->philox_offset);
  meta_u64(m, "kiln.rng.host", ctx->host_rng);
  if (nopt > 1) meta_u64(m, "kiln.optims", (uint64_t)nopt);
  for (int k = 0; k < nopt; k++) {
    char buf[64], key[64];
    kiln__ckpt_key(k, NULL, key, sizeof key);
    cJSON_AddStringToObject(m, key, kiln__optim_kind(o[k]));
    kiln__ckpt_key(k, "steps", key, sizeof key);
    meta_u64(m, key, (uint64_t)kiln_optim_steps(o[k]));
    snprintf(buf, sizeof buf, "%.9g", kiln_optim_lr(o[k]));
    kiln__ckpt_key(k, "lr", key, sizeof key);
    cJSON_AddStringToObject(m, key, buf);
    for (int i = 0; i < kiln_params_count(p); i++) {
      char *ck = kiln__ckpt_count_key(k, kiln_params_name(p, i));
      if (!ck) {
        cJSON_Delete(m);
        return kiln__error(ctx, KILN_ERR_OOM, "%s: out of host memory", fn);
      }
      meta_u64(m, ck, (uint64_t)kiln__optim_count(o[k], i));
      free(ck);
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
  kiln_status s = save(fn, path, p, o, nopt, KILN_DTYPE_F32, m);
  cJSON_Delete(m);
  return s;
}

kiln_status kiln_checkpoint_save(const char *path, const kiln_params *p, const kiln_optim *o,
                                 const kiln_meta *user) {
  return checkpoint_save(__func__, path, p, &o, o ? 1 : 0, user);
}

kiln_status kiln_checkpoint_save_optims(const char *path, const kiln_params *p,
                                        kiln_optim *const *o, int n, const kiln_meta *user) {
  return checkpoint_save(__func__, path, p, (const kiln_optim *const *)o, n, user);
}

static kiln_status checkpoint_load(const char *fn, const char *path, kiln_params *p,
                                   kiln_optim *const *o, int nopt, kiln_meta *user) {
  kiln_ctx *pctx = kiln_params_ctx(p);
  if (pctx && kiln__ok(pctx) && !optims_ok(fn, p, (const kiln_optim *const *)o, nopt))
    return pctx->status;
  kiln__st_file f;
  kiln_ctx *ctx = open_checked(fn, p, path, &f);
  if (!ctx) return pctx ? kiln_ctx_status(pctx) : KILN_ERR_INVALID;
  slots ss = {0};
  int np = kiln_params_count(p);
  kiln__ckpt_meta cm = {0};
  kiln_meta *got = kiln_meta_new();
  const char **names = malloc((size_t)(np + 1) * sizeof *names);
  if (!got || !names) {
    kiln__error(ctx, KILN_ERR_OOM, "%s: out of host memory", fn);
    goto done;
  }
  /* every piece is parsed and checked before anything changes: metadata, then tensors */
  for (int i = 0; i < np; i++)
    names[i] = kiln_params_name(p, i);
  const char *kinds[KILN__CKPT_MAX_OPTIMS];
  for (int k = 0; k < nopt; k++)
    kinds[k] = kiln__optim_kind(o[k]);
  char why[512];
  if (kiln__ckpt_meta_parse(f.metadata, kinds, nopt, np, names, &cm, why, sizeof why)) {
    kiln__error(ctx, cm.oom ? KILN_ERR_OOM : KILN_ERR_FORMAT, "%s: %s: %s", fn, path, why);
    goto done;
  }
  for (const cJSON *it = f.metadata ? f.metadata->child : NULL; it; it = it->next)
    if (strncmp(it->string, "kiln.", 5) != 0 && kiln_meta_set(got, it->string, it->valuestring)) {
      kiln__error(ctx, KILN_ERR_OOM, "%s: out of host memory", fn);
      goto done;
    }
  if (!gather(p, (const kiln_optim *const *)o, nopt, &ss)) {
    kiln__error(ctx, KILN_ERR_OOM, "%s: out of host memory", fn);
    goto done;
  }
  /* without an optimizer, the weights (and the RNG): the file's optimizer state is passed over */
  names_rule rule = {.strict = true, .skip_state = nopt == 0};
  if (match(ctx, fn, path, &f, &ss, np, &rule) != KILN_OK || upload(&ss) != KILN_OK) goto done;
  /* all tensors are in: now the scalars */
  ctx->seed = cm.seed;
  ctx->philox_offset = cm.philox_offset;
  ctx->host_rng = cm.host_rng;
  for (int k = 0; k < nopt; k++) {
    kiln_optim_set_lr(o[k], cm.opt[k].lr);
    kiln__optim_restore(o[k], (int64_t)cm.opt[k].steps, cm.opt[k].counts);
  }
  for (int i = 0; user && i < kiln_meta_count(got); i++) {
    const char *k = kiln_meta_key(got, i);
    if (kiln_meta_set(user, k, kiln_meta_get(got, k)))
      kiln__error(ctx, KILN_ERR_OOM, "%s: out of host memory for the metadata", fn);
  }
done:
  kiln__st_free(&f);
  slots_free(&ss);
  kiln_meta_free(got);
  free(names);
  kiln__ckpt_meta_free(&cm);
  return ctx->status;
}

kiln_status kiln_checkpoint_load(const char *path, kiln_params *p, kiln_optim *o, kiln_meta *user) {
  return checkpoint_load(__func__, path, p, &o, o ? 1 : 0, user);
}

kiln_status kiln_checkpoint_load_optims(const char *path, kiln_params *p, kiln_optim *const *o,
                                        int n, kiln_meta *user) {
  return checkpoint_load(__func__, path, p, o, n, user);
}
