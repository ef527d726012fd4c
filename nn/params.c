/*
 * params.c: a named list of parameters. The list owns its tensors; optimizers and (later)
 * checkpoints walk it by index or name. Buffers are members that are saved and loaded but never
 * trained. The layers' parameter makers are here too.
 */
#include <stdlib.h>
#include <string.h>

#include "../core/internal.h"
#include "params.h"

typedef struct param {
  char *name;
  kiln_tensor *t;
  bool buffer; /* saved and loaded, never trained */
} param;

struct kiln_params {
  kiln_ctx *ctx;
  kiln__anchor *anchor;
  param *p;
  int n, cap;
};

kiln_params *kiln_params_new(kiln_ctx *ctx) {
  if (!ctx) return NULL;
  kiln_params *p = calloc(1, sizeof *p);
  if (!p) {
    kiln__error(ctx, KILN_ERR_OOM, "kiln_params_new: out of host memory");
    return NULL;
  }
  p->ctx = ctx;
  p->anchor = kiln__ctx_anchor(ctx);
  return p;
}

static kiln_status add(kiln_params *p, const char *fn, const char *name, kiln_tensor *t,
                       bool buffer) {
  if (!p) return KILN_ERR_INVALID;
  kiln_ctx *ctx = p->ctx;
  if (!kiln__ok(ctx)) return ctx->status;
  if (!name || !*name) return kiln__error(ctx, KILN_ERR_INVALID, "%s: a tensor needs a name", fn);
  if (!kiln__check(ctx, t, fn)) return ctx->status;
  if (!t->persistent)
    return kiln__error(ctx, KILN_ERR_INVALID,
                       "%s: '%s' is an intermediate; parameters and buffers are persistent", fn,
                       name);
  if (kiln_params_find(p, name))
    return kiln__error(ctx, KILN_ERR_INVALID, "%s: the name '%s' is taken", fn, name);
  if (t->owned)
    return kiln__error(ctx, KILN_ERR_INVALID,
                       "%s: '%s' is a tensor a parameter list owns already (as '%s')", fn, name,
                       kiln_tensor_name(t));
  if (!KILN__GROW(p->p, p->cap, p->n + 1))
    return kiln__error(ctx, KILN_ERR_OOM, "%s: out of host memory", fn);
  char *copy = strdup(name);
  if (!copy) return kiln__error(ctx, KILN_ERR_OOM, "%s: out of host memory", fn);
  p->p[p->n].name = copy;
  p->p[p->n].t = t;
  p->p[p->n].buffer = buffer;
  p->n++;
  t->owned = true;
  /* a parameter requires gradients, as nn.Parameter; a buffer never does */
  t->requires_grad = !buffer && t->dtype == KILN_DTYPE_F32;
  kiln_tensor_set_name(t, name);
  return KILN_OK;
}

kiln_status kiln_params_add(kiln_params *p, const char *name, kiln_tensor *t) {
  return add(p, __func__, name, t, false);
}
kiln_status kiln_params_add_buffer(kiln_params *p, const char *name, kiln_tensor *t) {
  return add(p, __func__, name, t, true);
}
int kiln_params_is_buffer(const kiln_params *p, int i) {
  return p && i >= 0 && i < p->n && p->p[i].buffer;
}

void kiln__params_pop(kiln_params *p) {
  KILN_ASSERT(p && p->n > 0);
  p->n--;
  p->p[p->n].t->owned = false;
  kiln_tensor_free(p->p[p->n].t);
  free(p->p[p->n].name);
}

kiln_ctx *kiln_params_ctx(const kiln_params *p) { return p ? p->ctx : NULL; }
int kiln_params_count(const kiln_params *p) { return p ? p->n : 0; }
kiln_tensor *kiln_params_get(const kiln_params *p, int i) {
  return p && i >= 0 && i < p->n ? p->p[i].t : NULL;
}
const char *kiln_params_name(const kiln_params *p, int i) {
  return p && i >= 0 && i < p->n ? p->p[i].name : NULL;
}
kiln_tensor *kiln_params_find(const kiln_params *p, const char *name) {
  if (!p || !name) return NULL;
  for (int i = 0; i < p->n; i++)
    if (strcmp(p->p[i].name, name) == 0) return p->p[i].t;
  return NULL;
}
int64_t kiln_params_numel(const kiln_params *p) {
  int64_t n = 0;
  for (int i = 0; p && i < p->n; i++)
    n += kiln_tensor_numel(p->p[i].t);
  return n;
}
void kiln_params_zero_grad(kiln_params *p) {
  for (int i = 0; p && i < p->n; i++)
    kiln_tensor_zero_grad(p->p[i].t);
}
void kiln_params_free(kiln_params *p) {
  if (!p) return;
  for (int i = 0; i < p->n; i++) {
    if (p->anchor->alive) {     /* else kiln_ctx_free freed the tensors */
      p->p[i].t->owned = false; /* the list frees what it owns */
      kiln_tensor_free(p->p[i].t);
    }
    free(p->p[i].name);
  }
  free(p->p);
  kiln__anchor_release(p->anchor);
  free(p);
}

/* n values of shape from fill(i), uploaded as a persistent f32 tensor. */
static kiln_tensor *param_of(kiln_ctx *ctx, const char *fn, kiln_shape shape, double bound,
                             float value, bool random) {
  if (!kiln__valid_shape(ctx, fn, shape.ndim, shape.d)) return NULL;
  int64_t n = kiln__numel(shape.ndim, shape.d);
  float *h = malloc((size_t)(n > 0 ? n : 1) * sizeof *h);
  if (!h) {
    kiln__error(ctx, KILN_ERR_OOM, "%s: out of host memory", fn);
    return NULL;
  }
  for (int64_t i = 0; i < n; i++)
    h[i] = random ? (float)((kiln__rng_uniform(ctx) * 2.0 - 1.0) * bound) : value;
  kiln_tensor *t = kiln_tensor_from_host(ctx, KILN_DTYPE_F32, shape, h);
  free(h);
  return t;
}

kiln_tensor *kiln__uniform_param(kiln_ctx *ctx, const char *fn, kiln_shape shape, double bound) {
  kiln_tensor *t = param_of(ctx, fn, shape, bound, 0.f, true);
  if (t) kiln_tensor_set_requires_grad(t, 1);
  return t;
}

kiln_tensor *kiln__full_param(kiln_ctx *ctx, const char *fn, kiln_shape shape, float value) {
  return param_of(ctx, fn, shape, 0.0, value, false);
}
