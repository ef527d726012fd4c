/*
 * params.c: a named list of parameters. The list owns its tensors; optimizers and (later)
 * checkpoints walk it by index or name.
 */
#include <stdlib.h>
#include <string.h>

#include "../core/internal.h"
#include "params.h"

typedef struct param {
  char *name;
  kiln_tensor *t;
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

kiln_status kiln_params_add(kiln_params *p, const char *name, kiln_tensor *t) {
  if (!p) return KILN_ERR_INVALID;
  kiln_ctx *ctx = p->ctx;
  if (!kiln__ok(ctx)) return ctx->status;
  if (!name || !*name)
    return kiln__error(ctx, KILN_ERR_INVALID, "kiln_params_add: a parameter needs a name");
  if (!kiln__check(ctx, t, __func__)) return ctx->status;
  if (!t->persistent)
    return kiln__error(ctx, KILN_ERR_INVALID,
                       "kiln_params_add: '%s' is an intermediate; parameters are persistent", name);
  if (kiln_params_find(p, name))
    return kiln__error(ctx, KILN_ERR_INVALID, "kiln_params_add: the name '%s' is taken", name);
  if (t->owned)
    return kiln__error(ctx, KILN_ERR_INVALID,
                       "kiln_params_add: '%s' is a tensor a parameter list owns already (as '%s')",
                       name, kiln_tensor_name(t));
  if (!KILN__GROW(p->p, p->cap, p->n + 1))
    return kiln__error(ctx, KILN_ERR_OOM, "kiln_params_add: out of host memory");
  char *copy = strdup(name);
  if (!copy) return kiln__error(ctx, KILN_ERR_OOM, "kiln_params_add: out of host memory");
  p->p[p->n].name = copy;
  p->p[p->n].t = t;
  p->n++;
  t->owned = true;
  kiln_tensor_set_name(t, name);
  return KILN_OK;
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
