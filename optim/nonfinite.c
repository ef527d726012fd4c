/*
 * nonfinite.c: skipping optimizer steps whose gradients are not finite (kiln_optim_skip_nonfinite,
 * torch.cuda.amp.GradScaler's found-inf), all on the device, so that a replayed step graph skips
 * a step with no host sync. With the option on, a step is recorded as:
 *
 *   found = 0                           (a fill written into the optimizer's flag)
 *   found_inf(g, found) for every g     (multi-tensor: found = 1 where g holds NaN or Inf)
 *   skipped += found
 *   the guarded updates                 (each changes nothing when found is set)
 *   applied[i] += 1 - found             (each updated parameter's count of updates applied)
 *
 * The host counts calls (the schedule's step) and updates recorded; the device counts updates
 * applied, which SGD's first step and Adam's bias corrections read in the guarded updates. Turning
 * the option on writes the host's counts to the device, turning it off reads them back.
 */
#include <stdlib.h>

#include "optimizer.h"

/* A persistent f32 tensor of one value v, named name (or "<param>.<suffix>"), or NULL with the
 * error set. */
static kiln_tensor *one_value(kiln_optim *o, float v, const char *name) {
  kiln_tensor *t = kiln__tensor_persistent(o->ctx, KILN_DTYPE_F32, 1, (int64_t[]){1}, false);
  if (!t) return NULL;
  if (kiln_tensor_copy_from_host(t, &v, sizeof v) != KILN_OK) {
    kiln_tensor_free(t);
    return NULL;
  }
  kiln_tensor_set_name(t, name);
  return t;
}

static void free_tensors(kiln_optim *o, kiln_tensor *found, kiln_tensor *skipped,
                         kiln_tensor **applied) {
  kiln_tensor_free(found);
  kiln_tensor_free(skipped);
  for (int i = 0; applied && i < o->n; i++)
    kiln_tensor_free(applied[i]);
  free(applied);
}

/* The option on: the flag, the count of skipped steps and each trained parameter's count. */
static kiln_status turn_on(kiln_optim *o, const char *fn) {
  kiln_ctx *ctx = o->ctx;
  kiln_tensor **applied = calloc((size_t)o->n + 1, sizeof *applied);
  if (!applied) return kiln__error(ctx, KILN_ERR_OOM, "%s: out of host memory", fn);
  kiln_tensor *found = one_value(o, 0.f, "found_inf");
  kiln_tensor *skipped = found ? one_value(o, 0.f, "skipped_steps") : NULL;
  bool ok = skipped != NULL;
  for (int i = 0; i < o->n && ok; i++) {
    if (kiln_params_is_buffer(o->params, i)) continue; /* never trained */
    char *name = kiln__strf("%s.step", kiln_params_name(o->params, i));
    if (!name) {
      kiln__error(ctx, KILN_ERR_OOM, "%s: out of host memory", fn);
      ok = false;
      break;
    }
    ok = (applied[i] = one_value(o, (float)o->count[i], name)) != NULL;
    free(name);
  }
  if (!ok) {
    free_tensors(o, found, skipped, applied);
    return ctx->status;
  }
  o->found = found;
  o->skipped = skipped;
  o->applied = applied;
  return KILN_OK;
}

/* The option off: the device's counts back into count[] (a context without a GPU keeps the
 * host's), then its tensors freed. */
static kiln_status turn_off(kiln_optim *o) {
  kiln_ctx *ctx = o->ctx;
  int64_t *counts = malloc(((size_t)o->n + 1) * sizeof *counts);
  if (!counts)
    return kiln__error(ctx, KILN_ERR_OOM, "kiln_optim_skip_nonfinite: out of host memory");
  for (int i = 0; i < o->n; i++) {
    float v = (float)o->count[i];
    if (o->applied[i] && ctx->has_gpu &&
        kiln_tensor_to_host(o->applied[i], &v, sizeof v) != KILN_OK) {
      free(counts);
      return ctx->status;
    }
    counts[i] = (int64_t)v;
  }
  for (int i = 0; i < o->n; i++)
    o->count[i] = counts[i];
  free(counts);
  free_tensors(o, o->found, o->skipped, o->applied);
  o->found = o->skipped = NULL;
  o->applied = NULL;
  return KILN_OK;
}

kiln_status kiln_optim_skip_nonfinite(kiln_optim *o, int on) {
  const char *fn = __func__;
  if (!o) return KILN_ERR_INVALID;
  kiln_ctx *ctx = o->ctx;
  if (!kiln__ok(ctx)) return ctx->status;
  if (ctx->in_step)
    return kiln__error(ctx, KILN_ERR_STATE,
                       "%s: the option is set outside a step (before kiln_step_begin or after "
                       "kiln_step_end)",
                       fn);
  if (kiln_params_count(o->params) != o->n)
    return kiln__error(ctx, KILN_ERR_STATE,
                       "%s: the parameter list changed (%d parameters, the optimizer was made for "
                       "%d)",
                       fn, kiln_params_count(o->params), o->n);
  if ((on != 0) == (o->found != NULL)) return KILN_OK;
  return on ? turn_on(o, fn) : turn_off(o);
}

int64_t kiln_optim_skipped_steps(kiln_optim *o) {
  if (!o) return -1;
  if (!o->skipped) return 0;
  float v = 0.f;
  if (kiln_tensor_to_host(o->skipped, &v, sizeof v) != KILN_OK) return -1;
  return (int64_t)v;
}

bool kiln__guard_check(kiln_optim *o, kiln__updates_fn upd) {
  const char *fn = "kiln_optim_step";
  kiln_tensor *in[2] = {o->found, kiln_full(o->ctx, KILN_SHAPE(1), 0.f)};
  if (!in[1] || !kiln__update(KILN__OP_ASSIGN, fn, 2, in)) return false;
  for (int i = 0; i < o->n; i++) {
    if (!upd(o, i)) continue;
    kiln_tensor *g[2] = {kiln_tensor_grad(kiln_params_get(o->params, i)), o->found};
    if (!kiln__update(KILN__OP_FOUND_INF, fn, 2, g)) return false;
  }
  kiln_tensor *c[2] = {o->skipped, o->found};
  return kiln__update(KILN__OP_ACCUM, fn, 2, c) != NULL;
}

bool kiln__guard_advance(kiln_optim *o, kiln__updates_fn upd) {
  kiln_tensor *inc = kiln_add_scalar(kiln_neg(o->found), 1.f); /* 0 in a skipped step */
  if (!inc) return false;
  for (int i = 0; i < o->n; i++) {
    if (!upd(o, i)) continue;
    kiln_tensor *in[2] = {o->applied[i], inc};
    if (!kiln__update(KILN__OP_ACCUM, "kiln_optim_step", 2, in)) return false;
  }
  return true;
}

void kiln__guard_restart(kiln_optim *o, int i) {
  float zero = 0.f;
  if (o->applied && o->applied[i]) kiln_tensor_copy_from_host(o->applied[i], &zero, sizeof zero);
}

void kiln__guard_restore(kiln_optim *o) {
  for (int i = 0; o->applied && i < o->n; i++) {
    float v = (float)o->count[i];
    if (o->applied[i]) kiln_tensor_copy_from_host(o->applied[i], &v, sizeof v);
  }
}

int64_t kiln__guard_count(const kiln_optim *o, int i) {
  float v;
  if (!o->applied || !o->applied[i] || !o->ctx->has_gpu ||
      kiln_tensor_to_host(o->applied[i], &v, sizeof v) != KILN_OK)
    return o->count[i];
  return (int64_t)v;
}

void kiln__guard_free(kiln_optim *o) {
  if (o->anchor->alive)
    free_tensors(o, o->found, o->skipped, o->applied);
  else
    free(o->applied); /* kiln_ctx_free freed the tensors */
  o->found = o->skipped = NULL;
  o->applied = NULL;
}
