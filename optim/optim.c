/*
 * optim.c: SGD (momentum, dampening, Nesterov, weight decay), Adam and AdamW with PyTorch's
 * semantics. kiln_optim_step records one in-place update node per parameter; the update rules
 * themselves are device code (fusion/device/optim.cuh), called with the nodes' named attributes.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../core/internal.h"
#include "optim.h"

typedef enum kind { SGD, ADAM, ADAMW } kind;

struct kiln_optim {
  kind kind;
  kiln_ctx *ctx;
  kiln__anchor *anchor;
  kiln_params *params;
  kiln_sgd_options sgd;
  kiln_adam_options adam;
  float lr;
  int64_t steps;
  int n;
  kiln_tensor **s1, **s2; /* momentum buffer; Adam's m and v */
  int64_t *count;         /* updates each parameter has had */
  bool scheduled;
  kiln_schedule schedule;
  uint64_t undo_mark; /* the step's undo log holds its state (core/undo.c) */
};

static double cos_anneal(double from, double to, double pct) {
  return to + (from - to) / 2.0 * (cos(M_PI * pct) + 1.0);
}

float kiln_schedule_lr(const kiln_schedule *s, int64_t t) {
  if (!s) return 0.f;
  double base = s->base_lr, T = (double)(s->total_steps > 0 ? s->total_steps : 1);
  if (t < 0) t = 0;
  switch (s->kind) {
  case KILN_SCHEDULE_STEP:
    return (float)(base *
                   pow((double)s->gamma, (double)(t / (s->step_size > 0 ? s->step_size : 1))));
  case KILN_SCHEDULE_COSINE: {
    double tt = (double)t < T ? (double)t : T;
    return (float)(s->min_lr + (base - s->min_lr) * (1.0 + cos(M_PI * tt / T)) / 2.0);
  }
  case KILN_SCHEDULE_WARMUP_LINEAR: {
    double w = (double)s->warmup_steps;
    if ((double)t < w) return (float)(base * (double)t / w);
    double left = (T - (double)t) / (T - w > 0 ? T - w : 1.0);
    return (float)(base * (left > 0 ? left : 0));
  }
  case KILN_SCHEDULE_ONE_CYCLE: {
    double pct = s->pct_start > 0 ? s->pct_start : 0.3,
           div = s->div_factor > 0 ? s->div_factor : 25;
    double fdiv = s->final_div_factor > 0 ? s->final_div_factor : 1e4;
    double lo = base / div, end = lo / fdiv, up = pct * T - 1.0, last = T - 1.0;
    if ((double)t <= up) return (float)cos_anneal(lo, base, up > 0 ? (double)t / up : 1.0);
    double q = last - up > 0 ? ((double)t - up) / (last - up) : 1.0;
    return (float)cos_anneal(base, end, q < 1.0 ? q : 1.0);
  }
  case KILN_SCHEDULE_CONSTANT:
  default: return (float)base;
  }
}

/* Whether schedule s is one kiln_schedule_lr can follow; else an error naming the field. */
static bool schedule_ok(kiln_ctx *ctx, const kiln_schedule *s) {
  const char *fn = "kiln_optim_set_schedule";
  bool total = s->kind == KILN_SCHEDULE_COSINE || s->kind == KILN_SCHEDULE_WARMUP_LINEAR ||
               s->kind == KILN_SCHEDULE_ONE_CYCLE;
  if (s->kind < KILN_SCHEDULE_CONSTANT || s->kind > KILN_SCHEDULE_ONE_CYCLE)
    return kiln__error(ctx, KILN_ERR_INVALID, "%s: unknown schedule kind %d", fn, (int)s->kind),
           false;
  if (!(s->base_lr >= 0.f && isfinite(s->base_lr)))
    return kiln__error(ctx, KILN_ERR_INVALID, "%s: base_lr %g must be finite and >= 0", fn,
                       s->base_lr),
           false;
  if (!(s->min_lr >= 0.f && isfinite(s->min_lr)))
    return kiln__error(ctx, KILN_ERR_INVALID, "%s: min_lr %g must be finite and >= 0", fn,
                       s->min_lr),
           false;
  if (total && s->total_steps <= 0)
    return kiln__error(ctx, KILN_ERR_INVALID, "%s: total_steps %lld must be > 0 for this schedule",
                       fn, (long long)s->total_steps),
           false;
  if (s->kind == KILN_SCHEDULE_STEP &&
      (s->step_size <= 0 || !(s->gamma >= 0.f) || !isfinite(s->gamma)))
    return kiln__error(ctx, KILN_ERR_INVALID,
                       "%s: a step schedule needs step_size > 0 (got %lld) and a finite gamma >= "
                       "0 (got %g)",
                       fn, (long long)s->step_size, s->gamma),
           false;
  if (s->kind == KILN_SCHEDULE_WARMUP_LINEAR &&
      (s->warmup_steps < 0 || s->warmup_steps > s->total_steps))
    return kiln__error(ctx, KILN_ERR_INVALID, "%s: warmup_steps %lld not in [0, total_steps %lld]",
                       fn, (long long)s->warmup_steps, (long long)s->total_steps),
           false;
  if (s->kind == KILN_SCHEDULE_ONE_CYCLE &&
      (!(s->pct_start >= 0.f && s->pct_start < 1.f) || !(s->div_factor >= 0.f) ||
       !isfinite(s->div_factor) || !(s->final_div_factor >= 0.f) || !isfinite(s->final_div_factor)))
    return kiln__error(ctx, KILN_ERR_INVALID,
                       "%s: one-cycle pct_start %g must be in [0, 1), div_factor %g and "
                       "final_div_factor %g finite and >= 0 (0: torch's default)",
                       fn, s->pct_start, s->div_factor, s->final_div_factor),
           false;
  return true;
}

void kiln_optim_set_schedule(kiln_optim *o, const kiln_schedule *s) {
  if (!o || !kiln__ok(o->ctx)) return;
  if (s && !schedule_ok(o->ctx, s)) return; /* the schedule stays as it was */
  o->scheduled = s != NULL;
  if (s) o->schedule = *s;
}

kiln_sgd_options kiln_sgd_defaults(float lr) {
  return (kiln_sgd_options){
      .lr = lr, .momentum = 0.f, .dampening = 0.f, .weight_decay = 0.f, .nesterov = 0};
}
kiln_adam_options kiln_adam_defaults(void) {
  return (kiln_adam_options){
      .lr = 1e-3f, .beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-8f, .weight_decay = 0.f};
}
kiln_adam_options kiln_adamw_defaults(void) {
  kiln_adam_options o = kiln_adam_defaults();
  o.weight_decay = 1e-2f;
  return o;
}

static kiln_optim *make(kind k, kiln_params *params, const char *fn) {
  kiln_ctx *ctx = kiln_params_ctx(params);
  if (!ctx || !kiln__ok(ctx)) return NULL;
  kiln_optim *o = calloc(1, sizeof *o);
  int n = kiln_params_count(params);
  if (o) {
    o->s1 = calloc((size_t)n + 1, sizeof *o->s1);
    o->s2 = calloc((size_t)n + 1, sizeof *o->s2);
    o->count = calloc((size_t)n + 1, sizeof *o->count);
  }
  if (!o || !o->s1 || !o->s2 || !o->count) {
    if (o) {
      free(o->s1);
      free(o->s2);
      free(o->count);
    }
    free(o);
    kiln__error(ctx, KILN_ERR_OOM, "%s: out of host memory", fn);
    return NULL;
  }
  o->kind = k;
  o->ctx = ctx;
  o->anchor = kiln__ctx_anchor(ctx);
  o->params = params;
  o->n = n;
  return o;
}

/* State tensors, zero-filled, one per parameter. */
static bool make_state(kiln_optim *o, kiln_tensor **s, const char *suffix) {
  for (int i = 0; i < o->n; i++) {
    kiln_tensor *p = kiln_params_get(o->params, i);
    if (kiln_params_is_buffer(o->params, i)) continue; /* never trained: no state */
    s[i] = kiln__tensor_persistent(o->ctx, KILN_DTYPE_F32, p->ndim, p->shape, true);
    if (!s[i]) return false;
    char *name = kiln__strf("%s.%s", kiln__name(p), suffix);
    if (!name) return !kiln__error(o->ctx, KILN_ERR_OOM, "kiln: out of host memory");
    kiln_tensor_set_name(s[i], name);
    free(name);
  }
  return true;
}

kiln_optim *kiln_sgd_new(kiln_params *params, const kiln_sgd_options *opts) {
  const char *fn = __func__;
  kiln_ctx *ctx = kiln_params_ctx(params);
  if (!ctx || !kiln__ok(ctx)) return NULL;
  kiln_sgd_options s = opts ? *opts : kiln_sgd_defaults(1e-3f);
  if (!(s.lr >= 0.f) || !(s.momentum >= 0.f) || !(s.weight_decay >= 0.f))
    return kiln__error(ctx, KILN_ERR_INVALID,
                       "%s: lr %g, momentum %g and weight_decay %g must be >= 0", fn, s.lr,
                       s.momentum, s.weight_decay),
           NULL;
  if (s.nesterov && (s.momentum <= 0.f || s.dampening != 0.f))
    return kiln__error(ctx, KILN_ERR_INVALID,
                       "%s: Nesterov momentum needs momentum > 0 and dampening 0 (got %g, %g)", fn,
                       s.momentum, s.dampening),
           NULL;
  kiln_optim *o = make(SGD, params, fn);
  if (!o) return NULL;
  o->sgd = s;
  o->lr = s.lr;
  if (s.momentum > 0.f && !make_state(o, o->s1, "momentum_buffer")) {
    kiln_optim_free(o);
    return NULL;
  }
  return o;
}

static kiln_optim *adam_new(kind k, kiln_params *params, const kiln_adam_options *opts,
                            const char *fn) {
  kiln_ctx *ctx = kiln_params_ctx(params);
  if (!ctx || !kiln__ok(ctx)) return NULL;
  kiln_adam_options a = opts ? *opts : (k == ADAMW ? kiln_adamw_defaults() : kiln_adam_defaults());
  if (!(a.lr >= 0.f) || !(a.eps >= 0.f) || !(a.weight_decay >= 0.f) ||
      !(a.beta1 >= 0.f && a.beta1 < 1.f) || !(a.beta2 >= 0.f && a.beta2 < 1.f))
    return kiln__error(ctx, KILN_ERR_INVALID,
                       "%s: lr %g, eps %g, weight_decay %g must be >= 0 and betas %g, %g in "
                       "[0, 1)",
                       fn, a.lr, a.eps, a.weight_decay, a.beta1, a.beta2),
           NULL;
  kiln_optim *o = make(k, params, fn);
  if (!o) return NULL;
  o->adam = a;
  o->lr = a.lr;
  if (!make_state(o, o->s1, "exp_avg") || !make_state(o, o->s2, "exp_avg_sq")) {
    kiln_optim_free(o);
    return NULL;
  }
  return o;
}

kiln_optim *kiln_adam_new(kiln_params *params, const kiln_adam_options *o) {
  return adam_new(ADAM, params, o, __func__);
}
kiln_optim *kiln_adamw_new(kiln_params *params, const kiln_adam_options *o) {
  return adam_new(ADAMW, params, o, __func__);
}

/* What a failed step undoes of an optimizer: its step count, rate and per-parameter counts. */
typedef struct saved_state {
  int64_t steps;
  float lr;
  int64_t count[]; /* o->n */
} saved_state;

static void undo_step(void *obj, void *saved) {
  kiln_optim *o = obj;
  const saved_state *s = saved;
  o->steps = s->steps;
  o->lr = s->lr;
  memcpy(o->count, s->count, (size_t)o->n * sizeof *o->count);
}

/* Logs the optimizer's state once per step, before the step changes it. */
static bool log_state(kiln_optim *o) {
  if (!o->ctx->in_step || kiln__undo_logged(o->ctx, &o->undo_mark)) return true;
  saved_state *s = malloc(sizeof *s + (size_t)o->n * sizeof s->count[0]);
  if (!s) return !kiln__error(o->ctx, KILN_ERR_OOM, "kiln_optim_step: out of host memory");
  s->steps = o->steps;
  s->lr = o->lr;
  memcpy(s->count, o->count, (size_t)o->n * sizeof *o->count);
  return kiln__undo_push(o->ctx, undo_step, o, s, &o->undo_mark);
}

kiln_status kiln_optim_step(kiln_optim *o) {
  if (!o) return KILN_ERR_INVALID;
  kiln_ctx *ctx = o->ctx;
  if (!kiln__ok(ctx) || !log_state(o)) return ctx->status;
  if (o->scheduled) {
    float lr = kiln_schedule_lr(&o->schedule, o->steps);
    if (!(lr >= 0.f && isfinite(lr)))
      return kiln__error(ctx, KILN_ERR_INVALID,
                         "kiln_optim_step: the schedule gives lr %g at step %lld", lr,
                         (long long)o->steps);
    o->lr = lr;
  }
  if (kiln_params_count(o->params) != o->n)
    return kiln__error(ctx, KILN_ERR_STATE,
                       "kiln_optim_step: the parameter list changed (%d parameters, the optimizer "
                       "was made for %d)",
                       kiln_params_count(o->params), o->n);
  for (int i = 0; i < o->n; i++) {
    kiln_tensor *p = kiln_params_get(o->params, i);
    kiln_tensor *g = kiln_tensor_grad(p);
    if (!g || kiln_params_is_buffer(o->params, i)) continue; /* left alone, as in PyTorch */
    kiln__node *n;
    if (o->kind == SGD) {
      const kiln_sgd_options *s = &o->sgd;
      if (s->momentum > 0.f) {
        kiln_tensor *in[3] = {p, g, o->s1[i]};
        n = kiln__update(KILN__OP_SGD_MOMENTUM, __func__, 3, in);
        if (!n) return ctx->status;
        KILN__F(n, SGD_MOMENTUM, lr) = o->lr;
        KILN__F(n, SGD_MOMENTUM, momentum) = s->momentum;
        KILN__F(n, SGD_MOMENTUM, dampening) = s->dampening;
        KILN__F(n, SGD_MOMENTUM, weight_decay) = s->weight_decay;
        /* the first step copies the gradient into the buffer: a step value, not structure */
        KILN__F(n, SGD_MOMENTUM, first) = o->count[i] == 0 ? 1.f : 0.f;
        KILN__I(n, SGD_MOMENTUM, nesterov) = s->nesterov != 0;
      } else {
        kiln_tensor *in[2] = {p, g};
        n = kiln__update(KILN__OP_SGD, __func__, 2, in);
        if (!n) return ctx->status;
        KILN__F(n, SGD, lr) = o->lr;
        KILN__F(n, SGD, weight_decay) = s->weight_decay;
      }
    } else {
      const kiln_adam_options *a = &o->adam;
      kiln_tensor *in[4] = {p, g, o->s1[i], o->s2[i]};
      n = kiln__update(KILN__OP_ADAM, __func__, 4, in);
      if (!n) return ctx->status;
      double t = (double)(o->count[i] + 1);
      double bc1 = 1.0 - pow((double)a->beta1, t), bc2 = 1.0 - pow((double)a->beta2, t);
      KILN__F(n, ADAM, lr) = o->lr;
      KILN__F(n, ADAM, beta1) = a->beta1;
      KILN__F(n, ADAM, beta2) = a->beta2;
      KILN__F(n, ADAM, eps) = a->eps;
      KILN__F(n, ADAM, weight_decay) = a->weight_decay;
      KILN__F(n, ADAM, step_size) = (float)(o->lr / bc1);
      KILN__F(n, ADAM, bc2_sqrt) = (float)sqrt(bc2);
      KILN__I(n, ADAM, decoupled) = o->kind == ADAMW;
    }
    o->count[i]++;
  }
  o->steps++;
  return ctx->status;
}

void kiln_optim_zero_grad(kiln_optim *o) {
  if (o) kiln_params_zero_grad(o->params);
}
void kiln_optim_set_lr(kiln_optim *o, float lr) {
  if (!o) return;
  if (!(lr >= 0.f && isfinite(lr))) {
    kiln__error(o->ctx, KILN_ERR_INVALID, "kiln_optim_set_lr: lr %g must be finite and >= 0", lr);
    return;
  }
  o->lr = lr;
}
float kiln_optim_lr(const kiln_optim *o) { return o ? o->lr : 0.f; }
int64_t kiln_optim_steps(const kiln_optim *o) { return o ? o->steps : 0; }

void kiln_optim_free(kiln_optim *o) {
  if (!o) return;
  for (int i = 0; i < o->n && o->anchor->alive; i++) { /* else kiln_ctx_free freed them */
    kiln_tensor_free(o->s1[i]);
    kiln_tensor_free(o->s2[i]);
  }
  if (o->anchor->alive) kiln__undo_forget(o->ctx, o);
  free(o->s1);
  free(o->s2);
  free(o->count);
  kiln__anchor_release(o->anchor);
  free(o);
}

/* ---------------------------------------------------------------- for checkpoints (optim.h) */

const char *kiln__optim_kind(const kiln_optim *o) {
  return o->kind == SGD ? "sgd" : (o->kind == ADAM ? "adam" : "adamw");
}

kiln_tensor *kiln__optim_state(const kiln_optim *o, int i, int which, const char **name) {
  if (i < 0 || i >= o->n) return NULL;
  if (o->kind == SGD) {
    *name = "momentum_buffer";
    return which == 0 ? o->s1[i] : NULL;
  }
  *name = which == 0 ? "exp_avg" : "exp_avg_sq";
  return which == 0 ? o->s1[i] : o->s2[i];
}

int64_t kiln__optim_count(const kiln_optim *o, int i) {
  return i >= 0 && i < o->n ? o->count[i] : 0;
}

void kiln__optim_restore(kiln_optim *o, int64_t steps, const int64_t *counts) {
  o->steps = steps;
  for (int i = 0; i < o->n; i++)
    o->count[i] = counts[i];
}
