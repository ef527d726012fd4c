/*
 * evaluate.c: kiln_evaluate, a classifier's mean loss and accuracy over a loader's epoch in
 * evaluation mode. Each batch is a step that adds its summed loss and its count of correct
 * predictions into two persistent sums the loader keeps (kiln_assign), so that no step reads
 * anything on the host and every full batch has one signature (one step graph, replayed); the
 * host reads the sums at the end, and whenever the count could pass 2^24, where f32 stops
 * holding every integer. The model is reached through a callback, so this file needs nothing
 * of nn/ (kiln_module_call adapts a module).
 */
#include <math.h>

#include "../core/internal.h"
#include "dataset.h"

#define EXACT_COUNT ((int64_t)1 << 24) /* an f32 sum of counts is exact up to here */

/* What one kiln_evaluate call carries from batch to batch. */
typedef struct eval_run {
  kiln_ctx *ctx;
  kiln_loader *loader;
  kiln_forward_fn forward;
  void *model;
  const kiln_eval_options *o;
  kiln_tensor *loss_sum, *hit_sum; /* () f32 each, persistent: the sums on the device */
  int64_t classes;                 /* the logits' C, from the first batch */
} eval_run;

static bool zero_sums(eval_run *r) {
  float z = 0.f;
  return kiln_tensor_copy_from_host(r->loss_sum, &z, sizeof z) == KILN_OK &&
         kiln_tensor_copy_from_host(r->hit_sum, &z, sizeof z) == KILN_OK;
}

/* Adds the device sums to *loss and *correct and zeroes them. */
static kiln_status drain(eval_run *r, int64_t batches, double *loss, int64_t *correct) {
  if (!kiln_ctx_has_gpu(r->ctx))
    return kiln__error(r->ctx, KILN_ERR_STATE,
                       "kiln_evaluate: the context has no GPU: its %lld batches were recorded, "
                       "planned and compiled, but their loss and accuracy cannot be read",
                       (long long)batches);
  float l, h;
  if (kiln_tensor_to_host(r->loss_sum, &l, sizeof l) != KILN_OK ||
      kiln_tensor_to_host(r->hit_sum, &h, sizeof h) != KILN_OK)
    return r->ctx->status;
  *loss += l;
  *correct += (int64_t)h;
  return zero_sums(r) ? KILN_OK : r->ctx->status;
}

/* Records batch k inside an open step: the forward pass, its checks, and the sums' updates.
 * *rows gets the batch's samples. */
static kiln_status record_batch(eval_run *r, int64_t k, int64_t *rows) {
  kiln_ctx *ctx = r->ctx;
  const char *fn = "kiln_evaluate";
  kiln_tensor *x, *y;
  if (!kiln__loader_batch_at(r->loader, k, &x, &y, fn)) return ctx->status;
  int64_t b = kiln_tensor_dim(x, 0);
  *rows = b;
  if (r->o->autocast == KILN_DTYPE_BF16) kiln_autocast_begin(ctx, KILN_DTYPE_BF16);
  kiln_tensor *logits = r->forward(r->model, x);
  if (r->o->autocast == KILN_DTYPE_BF16 && ctx->autocast_depth > 0) kiln_autocast_end(ctx);
  char xs[96], ls[96];
  if (!logits)
    return kiln__ok(ctx) ? kiln__error(ctx, KILN_ERR_INVALID,
                                       "%s: forward returned NULL for batch %lld (x %s) and set "
                                       "no error",
                                       fn, (long long)k, kiln__shape_of(x, xs, sizeof xs))
                         : ctx->status;
  if (!kiln__ok(ctx)) return ctx->status;
  if (logits->ndim != 2 || logits->shape[0] != b || logits->shape[1] < 1)
    return kiln__error(
        ctx, KILN_ERR_SHAPE,
        "%s: forward gave %s for batch %lld (x %s): logits must be (%lld, C), C >= 1", fn,
        kiln__shape_of(logits, ls, sizeof ls), (long long)k, kiln__shape_of(x, xs, sizeof xs),
        (long long)b);
  if (logits->dtype != KILN_DTYPE_F32 && logits->dtype != KILN_DTYPE_BF16)
    return kiln__error(ctx, KILN_ERR_DTYPE,
                       "%s: forward gave %s logits %s for batch %lld: they must be f32 or bf16", fn,
                       kiln_dtype_name(logits->dtype), kiln__shape_of(logits, ls, sizeof ls),
                       (long long)k);
  if (r->classes == 0) r->classes = logits->shape[1];
  if (logits->shape[1] != r->classes)
    return kiln__error(ctx, KILN_ERR_SHAPE,
                       "%s: forward gave %s for batch %lld, %lld classes where batch 0's logits "
                       "had %lld",
                       fn, kiln__shape_of(logits, ls, sizeof ls), (long long)k,
                       (long long)logits->shape[1], (long long)r->classes);
  /* i32 argmax against i32 labels compares exactly */
  kiln_tensor *hits = kiln_sum(kiln_eq(kiln_argmax(logits, 1, 0), y), KILN_ALL_AXES, 0);
  kiln_assign(r->hit_sum, kiln_add(r->hit_sum, hits));
  if (r->o->loss == KILN_EVAL_CROSS_ENTROPY) {
    kiln_tensor *loss = kiln_cross_entropy(logits, y, KILN_REDUCTION_SUM, r->o->label_smoothing);
    kiln_assign(r->loss_sum, kiln_add(r->loss_sum, loss));
  }
  return ctx->status;
}

/* The checks that come before anything changes. */
static kiln_status check_call(kiln_ctx *ctx, kiln_loader *loader, kiln_forward_fn forward,
                              const kiln_eval_options *o, const kiln_eval_result *out) {
  const char *fn = "kiln_evaluate";
  if (!loader) return kiln__error(ctx, KILN_ERR_INVALID, "%s: NULL loader", fn);
  if (!forward)
    return kiln__error(ctx, KILN_ERR_INVALID,
                       "%s: NULL forward (a kiln_forward_fn; kiln_module_call for a module)", fn);
  if (!out) return kiln__error(ctx, KILN_ERR_INVALID, "%s: NULL out", fn);
  if (kiln__loader_ctx(loader) != ctx)
    return kiln__error(ctx, KILN_ERR_INVALID, "%s: the loader belongs to another context", fn);
  if (o->loss != KILN_EVAL_CROSS_ENTROPY && o->loss != KILN_EVAL_NO_LOSS)
    return kiln__error(ctx, KILN_ERR_INVALID, "%s: unknown loss %d", fn, (int)o->loss);
  if (!(o->label_smoothing >= 0.f && o->label_smoothing <= 1.f))
    return kiln__error(ctx, KILN_ERR_INVALID, "%s: label_smoothing %g is not in [0, 1]", fn,
                       o->label_smoothing);
  if (o->autocast != KILN_DTYPE_F32 && o->autocast != KILN_DTYPE_BF16)
    return kiln__error(ctx, KILN_ERR_INVALID,
                       "%s: autocast %s: 0 (none) or KILN_DTYPE_BF16 (a bf16 autocast region)", fn,
                       kiln_dtype_name(o->autocast));
  /* an open step that recorded nothing (a loop that opened it, then found its loader done)
   * holds nothing to lose; one that recorded something would be dropped half run */
  if (ctx->in_step && ctx->trace.n > 0)
    return kiln__error(ctx, KILN_ERR_STATE,
                       "%s: called inside an open step that has recorded %d ops (kiln_step_begin "
                       "without kiln_step_end); it runs steps of its own",
                       fn, ctx->trace.n);
  if (ctx->autocast_depth > 0)
    return kiln__error(ctx, KILN_ERR_STATE,
                       "%s: %d autocast region%s open; a step may not end inside one: ask for "
                       "options .autocast = KILN_DTYPE_BF16 instead",
                       fn, ctx->autocast_depth, ctx->autocast_depth == 1 ? " is" : "s are");
  if (kiln__loader_rows(loader) > EXACT_COUNT)
    return kiln__error(ctx, KILN_ERR_INVALID,
                       "%s: batches of %lld samples: more than 2^24, where an f32 count of "
                       "correct predictions stops being exact",
                       fn, (long long)kiln__loader_rows(loader));
  if (kiln_loader_batches(loader) == 0)
    return kiln__error(ctx, KILN_ERR_INVALID,
                       "%s: the loader's epoch has no batch (batches of %lld, the last partial one "
                       "dropped)",
                       fn, (long long)kiln__loader_rows(loader));
  return KILN_OK;
}

kiln_status kiln_evaluate(kiln_ctx *ctx, kiln_loader *loader, kiln_forward_fn forward, void *model,
                          const kiln_eval_options *o, kiln_eval_result *out) {
  static const kiln_eval_options defaults = {0};
  if (!ctx) return KILN_ERR_INVALID;
  if (!kiln__ok(ctx)) return ctx->status;
  if (!o) o = &defaults;
  if (check_call(ctx, loader, forward, o, out) != KILN_OK) return ctx->status;
  eval_run r = {.ctx = ctx, .loader = loader, .forward = forward, .model = model, .o = o};
  if (!kiln__loader_eval_sums(loader, &r.loss_sum, &r.hit_sum) || !zero_sums(&r))
    return ctx->status;

  int64_t nb = kiln_loader_batches(loader), full = kiln__loader_rows(loader);
  int64_t samples = 0, pending = 0, correct = 0;
  double loss = 0;
  kiln_status s = KILN_OK;
  kiln_eval_begin(ctx);
  for (int64_t k = 0; k < nb && s == KILN_OK; k++) {
    /* read the sums out before the count could pass what f32 holds exactly */
    if (pending > 0 && pending + full > EXACT_COUNT) {
      s = drain(&r, k, &loss, &correct);
      pending = 0;
      if (s != KILN_OK) break;
    }
    int64_t rows = 0;
    kiln_step_begin(ctx);
    s = record_batch(&r, k, &rows);
    kiln_status e = kiln_step_end(ctx); /* a failed step runs nothing and is undone */
    if (s == KILN_OK) s = e;
    samples += rows;
    pending += rows;
  }
  if (s == KILN_OK) s = drain(&r, nb, &loss, &correct);
  kiln_eval_end(ctx);
  if (s != KILN_OK) return s;
  double n = (double)samples;
  *out = (kiln_eval_result){
      .loss = o->loss == KILN_EVAL_CROSS_ENTROPY ? loss / n : NAN,
      .accuracy = (double)correct / n,
      .correct = correct,
      .samples = samples,
  };
  return KILN_OK;
}
