/*
 * optim.c: SGD (momentum, dampening, Nesterov, weight decay), Adam, AdamW and Muon with PyTorch's
 * semantics and defaults (zero options fields), parameter groups (a rate scale and a weight
 * decay of their own per parameter, or none of this optimizer's updates), and learning-rate
 * schedules (the one-cycle one cycling the momentum or beta1 too, as torch's OneCycleLR).
 * kiln_optim_step records one in-place update node per parameter; the update rules themselves
 * are device code (fusion/device/optim.cuh), called with the nodes' named attributes. Muon
 * records, between its buffers' and its parameters' updates, the Newton-Schulz iteration as
 * matrix products and elementwise ops.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../core/internal.h"
#include "optim.h"
#include "optimizer.h"

static double cos_anneal(double from, double to, double pct) {
  return to + (from - to) / 2.0 * (cos(M_PI * pct) + 1.0);
}

static bool needs_total(kiln_schedule_kind k) {
  return k == KILN_SCHEDULE_COSINE || k == KILN_SCHEDULE_WARMUP_LINEAR ||
         k == KILN_SCHEDULE_ONE_CYCLE;
}

static bool cycles_momentum(const kiln_schedule *s) {
  return s->kind == KILN_SCHEDULE_ONE_CYCLE && !s->no_cycle_momentum;
}

/* s with its zero fields given PyTorch's defaults (kiln.h's rule) into r; base_lr 0 becomes lr,
 * the optimizer's rate (torch's schedulers start from it). False, with why filled, for a field
 * that has no default and is not set, or a value out of range. */
static bool schedule_resolve(const kiln_schedule *s, float lr, kiln_schedule *r, char *why,
                             size_t wn) {
  *r = *s;
  if (s->kind < KILN_SCHEDULE_CONSTANT || s->kind > KILN_SCHEDULE_ONE_CYCLE)
    return snprintf(why, wn, "unknown schedule kind %d", (int)s->kind), false;
  bool one_cycle = s->kind == KILN_SCHEDULE_ONE_CYCLE;
  if (one_cycle && s->base_lr == 0.f && !signbit(s->base_lr))
    return snprintf(why, wn,
                    "a one-cycle schedule needs base_lr (torch's max_lr), which has no default"),
           false;
  r->base_lr = kiln__opt_or(s->base_lr, lr);
  r->gamma = kiln__opt_or(s->gamma, 0.1f);
  r->pct_start = kiln__opt_or(s->pct_start, 0.3f);
  r->div_factor = kiln__opt_or(s->div_factor, 25.f);
  r->final_div_factor = kiln__opt_or(s->final_div_factor, 1e4f);
  r->base_momentum = kiln__opt_or(s->base_momentum, 0.85f);
  r->max_momentum = kiln__opt_or(s->max_momentum, 0.95f);
  if (!(r->base_lr >= 0.f && isfinite(r->base_lr)))
    return snprintf(why, wn, "base_lr %g must be finite and >= 0", r->base_lr), false;
  if (!(r->min_lr >= 0.f && isfinite(r->min_lr)))
    return snprintf(why, wn, "min_lr %g must be finite and >= 0", r->min_lr), false;
  if (needs_total(s->kind) && s->total_steps <= 0)
    return snprintf(why, wn, "total_steps %lld must be > 0 for this schedule (it has no default)",
                    (long long)s->total_steps),
           false;
  if (s->kind == KILN_SCHEDULE_STEP && s->step_size <= 0)
    return snprintf(why, wn, "a step schedule needs step_size > 0 (got %lld; it has no default)",
                    (long long)s->step_size),
           false;
  if (s->kind == KILN_SCHEDULE_STEP && !(r->gamma >= 0.f && isfinite(r->gamma)))
    return snprintf(why, wn, "a step schedule needs a finite gamma >= 0 (got %g)", r->gamma), false;
  if (s->kind == KILN_SCHEDULE_WARMUP_LINEAR &&
      (s->warmup_steps < 0 || s->warmup_steps > s->total_steps))
    return snprintf(why, wn, "warmup_steps %lld not in [0, total_steps %lld]",
                    (long long)s->warmup_steps, (long long)s->total_steps),
           false;
  if (one_cycle && !(r->pct_start >= 0.f && r->pct_start < 1.f))
    return snprintf(why, wn, "one-cycle pct_start %g must be in [0, 1) (0: torch's 0.3)",
                    r->pct_start),
           false;
  if (one_cycle && (!(r->div_factor > 0.f) || !isfinite(r->div_factor) ||
                    !(r->final_div_factor > 0.f) || !isfinite(r->final_div_factor)))
    return snprintf(why, wn,
                    "one-cycle div_factor %g and final_div_factor %g must be finite and > 0 (0: "
                    "torch's 25 and 1e4)",
                    r->div_factor, r->final_div_factor),
           false;
  if (cycles_momentum(r) && (!(r->base_momentum >= 0.f && r->base_momentum < 1.f) ||
                             !(r->max_momentum >= 0.f && r->max_momentum < 1.f)))
    return snprintf(why, wn,
                    "one-cycle base_momentum %g and max_momentum %g must be in [0, 1) (0: torch's "
                    "0.85 and 0.95)",
                    r->base_momentum, r->max_momentum),
           false;
  return true;
}

/* The position of step t in a one-cycle schedule r: the phase (0 rising, 1 falling) and how far
 * into it, as torch's OneCycleLR (two phases, cosine annealing). */
static double one_cycle_pct(const kiln_schedule *r, int64_t t, int *phase) {
  double T = (double)r->total_steps, up = (double)r->pct_start * T - 1.0, last = T - 1.0;
  if ((double)t <= up) {
    *phase = 0;
    return up > 0 ? (double)t / up : 1.0;
  }
  *phase = 1;
  double q = last - up > 0 ? ((double)t - up) / (last - up) : 1.0;
  return q < 1.0 ? q : 1.0; /* past total_steps it stays at the end (torch raises) */
}

/* The rate at step t of a resolved schedule r. */
static double resolved_lr(const kiln_schedule *r, int64_t t) {
  double base = r->base_lr, T = (double)r->total_steps;
  if (t < 0) t = 0;
  switch (r->kind) {
  case KILN_SCHEDULE_STEP: return base * pow((double)r->gamma, (double)(t / r->step_size));
  case KILN_SCHEDULE_COSINE: {
    double tt = (double)t < T ? (double)t : T;
    return r->min_lr + (base - r->min_lr) * (1.0 + cos(M_PI * tt / T)) / 2.0;
  }
  case KILN_SCHEDULE_WARMUP_LINEAR: {
    double w = (double)r->warmup_steps;
    if ((double)t < w) return base * (double)t / w;
    double left = (T - (double)t) / (T - w > 0 ? T - w : 1.0);
    return base * (left > 0 ? left : 0);
  }
  case KILN_SCHEDULE_ONE_CYCLE: {
    double lo = base / r->div_factor, end = lo / r->final_div_factor;
    int phase;
    double pct = one_cycle_pct(r, t, &phase);
    return phase == 0 ? cos_anneal(lo, base, pct) : cos_anneal(base, end, pct);
  }
  case KILN_SCHEDULE_CONSTANT:
  default: return base;
  }
}

/* The momentum (SGD) or beta1 (Adam) at step t of a resolved one-cycle schedule r that cycles
 * it: from max_momentum down to base_momentum while the rate rises, and back. */
static double resolved_momentum(const kiln_schedule *r, int64_t t) {
  int phase;
  double pct = one_cycle_pct(r, t < 0 ? 0 : t, &phase);
  return phase == 0 ? cos_anneal(r->max_momentum, r->base_momentum, pct)
                    : cos_anneal(r->base_momentum, r->max_momentum, pct);
}

float kiln_schedule_lr(const kiln_schedule *s, int64_t t) {
  kiln_schedule r;
  char why[160];
  if (!s || !schedule_resolve(s, 0.f, &r, why, sizeof why)) return NAN;
  return (float)resolved_lr(&r, t);
}

float kiln_schedule_momentum(const kiln_schedule *s, int64_t t) {
  kiln_schedule r;
  char why[160];
  if (!s || !schedule_resolve(s, 0.f, &r, why, sizeof why) || !cycles_momentum(&r)) return NAN;
  return (float)resolved_momentum(&r, t);
}

void kiln_optim_set_schedule(kiln_optim *o, const kiln_schedule *s) {
  if (!o || !kiln__ok(o->ctx)) return;
  kiln_schedule r;
  char why[200];
  if (s && !schedule_resolve(s, o->lr, &r, why, sizeof why)) {
    kiln__error(o->ctx, KILN_ERR_INVALID, "kiln_optim_set_schedule: %s", why);
    return; /* the schedule stays as it was */
  }
  if (s && cycles_momentum(&r) && o->kind == KILN__OPTIM_SGD && !(o->sgd.momentum > 0.f)) {
    kiln__error(o->ctx, KILN_ERR_INVALID,
                "kiln_optim_set_schedule: a one-cycle schedule cycles the momentum (torch's "
                "cycle_momentum), but this SGD optimizer was made with momentum 0 and keeps no "
                "momentum buffers: make it with momentum > 0, or set no_cycle_momentum");
    return;
  }
  o->scheduled = s != NULL;
  if (s) o->schedule = r;
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

static void free_arrays(kiln_optim *o) {
  free(o->s1);
  free(o->s2);
  free(o->count);
  free(o->lr_scale);
  free(o->wd);
  free(o->wd_set);
  free(o->excluded);
  free(o->group);
  free(o->mark);
  free(o->up);
}

static kiln_optim *make(kiln__optim_algo k, kiln_params *params, const char *fn) {
  kiln_ctx *ctx = kiln_params_ctx(params);
  if (!ctx || !kiln__ok(ctx)) return NULL;
  kiln_optim *o = calloc(1, sizeof *o);
  int n = kiln_params_count(params);
  size_t m = (size_t)n + 1;
  if (o) {
    o->s1 = calloc(m, sizeof *o->s1);
    o->s2 = calloc(m, sizeof *o->s2);
    o->count = calloc(m, sizeof *o->count);
    o->lr_scale = malloc(m * sizeof *o->lr_scale);
    o->wd = calloc(m, sizeof *o->wd);
    o->wd_set = calloc(m, sizeof *o->wd_set);
    o->excluded = calloc(m, sizeof *o->excluded);
    o->group = calloc(m, sizeof *o->group);
    o->mark = calloc(m, sizeof *o->mark);
    o->up = calloc(2 * m, sizeof *o->up);
  }
  if (!o || !o->s1 || !o->s2 || !o->count || !o->lr_scale || !o->wd || !o->wd_set || !o->excluded ||
      !o->group || !o->mark || !o->up) {
    if (o) free_arrays(o);
    free(o);
    kiln__error(ctx, KILN_ERR_OOM, "%s: out of host memory", fn);
    return NULL;
  }
  for (int i = 0; i < n; i++)
    o->lr_scale[i] = 1.f; /* every parameter in the optimizer's own group */
  o->kind = k;
  o->ctx = ctx;
  o->anchor = kiln__ctx_anchor(ctx);
  o->params = params;
  o->n = n;
  return o;
}

/* Parameter i's zero-filled state tensor named "<param>.<suffix>", or NULL with the error set. */
static kiln_tensor *state_of(kiln_optim *o, int i, const char *suffix) {
  kiln_tensor *p = kiln_params_get(o->params, i);
  kiln_tensor *s = kiln__tensor_persistent(o->ctx, KILN_DTYPE_F32, p->ndim, p->shape, true);
  if (!s) return NULL;
  char *name = kiln__strf("%s.%s", kiln__name(p), suffix);
  if (!name) {
    kiln_tensor_free(s);
    kiln__error(o->ctx, KILN_ERR_OOM, "kiln: out of host memory");
    return NULL;
  }
  kiln_tensor_set_name(s, name);
  free(name);
  return s;
}

/* The names of the optimizer's state tensors (NULL: it keeps none or only one). */
static const char *state_suffix(const kiln_optim *o, int which) {
  if (o->kind == KILN__OPTIM_SGD)
    return which == 0 && o->sgd.momentum > 0.f ? "momentum_buffer" : NULL;
  if (o->kind == KILN__OPTIM_MUON) return which == 0 ? "momentum_buffer" : NULL;
  return which == 0 ? "exp_avg" : "exp_avg_sq";
}

/* State tensors, zero-filled, one per parameter. */
static bool make_state(kiln_optim *o, kiln_tensor **s, const char *suffix) {
  for (int i = 0; i < o->n; i++) {
    if (kiln_params_is_buffer(o->params, i)) continue; /* never trained: no state */
    if (!(s[i] = state_of(o, i, suffix))) return false;
  }
  return true;
}

kiln_optim *kiln_sgd_new(kiln_params *params, const kiln_sgd_options *opts) {
  const char *fn = __func__;
  kiln_ctx *ctx = kiln_params_ctx(params);
  if (!ctx || !kiln__ok(ctx)) return NULL;
  kiln_sgd_options s = opts ? *opts : kiln_sgd_defaults(1e-3f);
  s.lr = kiln__opt_or(s.lr, 1e-3f); /* torch's default rate; the other fields' defaults are 0 */
  s.momentum = kiln__opt_or(s.momentum, 0.f);
  s.dampening = kiln__opt_or(s.dampening, 0.f);
  s.weight_decay = kiln__opt_or(s.weight_decay, 0.f);
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
  kiln_optim *o = make(KILN__OPTIM_SGD, params, fn);
  if (!o) return NULL;
  o->sgd = s;
  o->lr = s.lr;
  if (s.momentum > 0.f && !make_state(o, o->s1, "momentum_buffer")) {
    kiln_optim_free(o);
    return NULL;
  }
  return o;
}

static kiln_optim *adam_new(kiln__optim_algo k, kiln_params *params, const kiln_adam_options *opts,
                            const char *fn) {
  kiln_ctx *ctx = kiln_params_ctx(params);
  if (!ctx || !kiln__ok(ctx)) return NULL;
  kiln_adam_options a =
      opts ? *opts : (k == KILN__OPTIM_ADAMW ? kiln_adamw_defaults() : kiln_adam_defaults());
  /* zero fields take torch's defaults; KILN_ZERO asks for an exact 0 */
  a.lr = kiln__opt_or(a.lr, 1e-3f);
  a.beta1 = kiln__opt_or(a.beta1, 0.9f);
  a.beta2 = kiln__opt_or(a.beta2, 0.999f);
  a.eps = kiln__opt_or(a.eps, 1e-8f);
  a.weight_decay = kiln__opt_or(a.weight_decay, k == KILN__OPTIM_ADAMW ? 1e-2f : 0.f);
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
  return adam_new(KILN__OPTIM_ADAM, params, o, __func__);
}
kiln_optim *kiln_adamw_new(kiln_params *params, const kiln_adam_options *o) {
  return adam_new(KILN__OPTIM_ADAMW, params, o, __func__);
}

/* The Newton-Schulz iteration's steps: torch refuses 100 or more. */
#define MUON_MAX_NS_STEPS 99

/* An option out of range: the error naming it and its value, and NULL. */
static kiln_optim *refuse(kiln_ctx *ctx, const char *fn, const char *field, double v,
                          const char *want) {
  kiln__error(ctx, KILN_ERR_INVALID, "%s: %s %g must be %s", fn, field, v, want);
  return NULL;
}

kiln_muon_options kiln_muon_defaults(void) {
  return (kiln_muon_options){.lr = 1e-3f,
                             .momentum = 0.95f,
                             .no_nesterov = 0,
                             .weight_decay = 0.1f,
                             .eps = 1e-7f,
                             .ns_steps = 5,
                             .ns_a = 3.4445f,
                             .ns_b = -4.775f,
                             .ns_c = 2.0315f,
                             .adjust_lr = KILN_MUON_ADJUST_ORIGINAL,
                             .normalize_weight = 0,
                             .ns_dtype = KILN_DTYPE_F32};
}

kiln_optim *kiln_muon_new(kiln_params *params, const kiln_muon_options *opts) {
  const char *fn = __func__;
  kiln_ctx *ctx = kiln_params_ctx(params);
  if (!ctx || !kiln__ok(ctx)) return NULL;
  kiln_muon_options m = opts ? *opts : kiln_muon_defaults();
  /* zero fields take torch's defaults; KILN_ZERO asks for an exact 0 */
  m.lr = kiln__opt_or(m.lr, 1e-3f);
  m.momentum = kiln__opt_or(m.momentum, 0.95f);
  m.weight_decay = kiln__opt_or(m.weight_decay, 0.1f);
  m.eps = kiln__opt_or(m.eps, 1e-7f);
  m.ns_a = kiln__opt_or(m.ns_a, 3.4445f);
  m.ns_b = kiln__opt_or(m.ns_b, -4.775f);
  m.ns_c = kiln__opt_or(m.ns_c, 2.0315f);
  if (m.ns_steps == 0) m.ns_steps = 5;
  if (!(m.lr >= 0.f) || !isfinite(m.lr)) return refuse(ctx, fn, "lr", m.lr, "finite and >= 0");
  if (!(m.momentum >= 0.f && m.momentum < 1.f))
    return refuse(ctx, fn, "momentum", m.momentum, "in [0, 1)");
  if (!(m.weight_decay >= 0.f) || !isfinite(m.weight_decay))
    return refuse(ctx, fn, "weight_decay", m.weight_decay, "finite and >= 0");
  if (!(m.eps >= 0.f) || !isfinite(m.eps)) return refuse(ctx, fn, "eps", m.eps, "finite and >= 0");
  if (!isfinite(m.ns_a)) return refuse(ctx, fn, "ns_a", m.ns_a, "finite");
  if (!isfinite(m.ns_b)) return refuse(ctx, fn, "ns_b", m.ns_b, "finite");
  if (!isfinite(m.ns_c)) return refuse(ctx, fn, "ns_c", m.ns_c, "finite");
  if (m.ns_steps < 1 || m.ns_steps > MUON_MAX_NS_STEPS)
    return kiln__error(ctx, KILN_ERR_INVALID, "%s: ns_steps %d must be in 1..%d (0: 5)", fn,
                       m.ns_steps, MUON_MAX_NS_STEPS),
           NULL;
  if (m.adjust_lr < KILN_MUON_ADJUST_ORIGINAL || m.adjust_lr > KILN_MUON_ADJUST_MATCH_RMS_ADAMW)
    return kiln__error(ctx, KILN_ERR_INVALID,
                       "%s: adjust_lr %d is none of KILN_MUON_ADJUST_ORIGINAL, _NONE and "
                       "_MATCH_RMS_ADAMW",
                       fn, (int)m.adjust_lr),
           NULL;
  if (m.ns_dtype != KILN_DTYPE_F32 && m.ns_dtype != KILN_DTYPE_BF16)
    return kiln__error(ctx, KILN_ERR_DTYPE,
                       "%s: ns_dtype %s: the Newton-Schulz iteration runs in f32 or bf16", fn,
                       kiln_dtype_name(m.ns_dtype)),
           NULL;
  kiln_optim *o = make(KILN__OPTIM_MUON, params, fn);
  if (!o) return NULL;
  o->muon = m;
  o->lr = m.lr;
  if (!make_state(o, o->s1, "momentum_buffer")) {
    kiln_optim_free(o);
    return NULL;
  }
  return o;
}

/* ---------------------------------------------------------------- parameter groups */

int kiln_select_no_decay(const char *name, const kiln_tensor *t, void *user) {
  (void)name;
  (void)user;
  return kiln_tensor_ndim(t) < 2;
}

int kiln_select_prefix(const char *name, const kiln_tensor *t, void *user) {
  (void)t;
  const char *prefix = user;
  return name && prefix && strncmp(name, prefix, strlen(prefix)) == 0;
}

/* Whether this optimizer can train parameter i: Muon only matrices, 2 dims or more. */
static bool muon_takes(const kiln_optim *o, int i) {
  return o->kind != KILN__OPTIM_MUON || kiln_tensor_ndim(kiln_params_get(o->params, i)) >= 2;
}

/* The error for a parameter Muon cannot train; returns true. */
static bool muon_refuses(kiln_optim *o, int i, const char *fn) {
  kiln__error(o->ctx, KILN_ERR_SHAPE,
              "%s: Muon trains matrices (2 dims or more), and %s has %d: exclude it from the Muon "
              "optimizer with a group (exclude = 1, e.g. by kiln_select_no_decay) and train it "
              "with another",
              fn, kiln_params_name(o->params, i), kiln_tensor_ndim(kiln_params_get(o->params, i)));
  return true;
}

/* The error for parameter i, selected again while an earlier group trains it; returns true. */
static bool already_grouped(kiln_optim *o, int i, const char *fn) {
  char wd[32] = "the optimizer's";
  if (o->wd_set[i]) snprintf(wd, sizeof wd, "%g", o->wd[i]);
  kiln__error(o->ctx, KILN_ERR_INVALID,
              "%s: %s is already in group %d (lr_scale %g, weight_decay %s): a parameter is in "
              "one group at most, as in torch.optim (only an excluded one may be selected again)",
              fn, kiln_params_name(o->params, i), o->group[i], o->lr_scale[i], wd);
  return true;
}

int kiln_optim_add_group(kiln_optim *o, kiln_param_select select, void *user,
                         const kiln_param_group *group) {
  const char *fn = __func__;
  if (!o) return -1;
  kiln_ctx *ctx = o->ctx;
  if (!kiln__ok(ctx)) return -1;
  if (ctx->in_step)
    return kiln__error(ctx, KILN_ERR_STATE,
                       "%s: groups are set up outside a step (before kiln_step_begin or after "
                       "kiln_step_end)",
                       fn),
           -1;
  if (kiln_params_count(o->params) != o->n)
    return kiln__error(ctx, KILN_ERR_STATE,
                       "%s: the parameter list changed (%d parameters, the optimizer was made for "
                       "%d)",
                       fn, kiln_params_count(o->params), o->n),
           -1;
  if (!select) return kiln__error(ctx, KILN_ERR_INVALID, "%s: NULL select function", fn), -1;
  kiln_param_group g = group ? *group : (kiln_param_group){0};
  float scale = kiln__opt_or(g.lr_scale, 1.f);
  bool wd_set = g.weight_decay != 0.f || signbit(g.weight_decay);
  float wd = kiln__opt_or(g.weight_decay, 0.f);
  if (!(scale >= 0.f) || !isfinite(scale) || !(wd >= 0.f) || !isfinite(wd))
    return kiln__error(ctx, KILN_ERR_INVALID,
                       "%s: lr_scale %g and weight_decay %g must be finite and >= 0", fn,
                       g.lr_scale, g.weight_decay),
           -1;
  /* which parameters the group takes, and the state tensors that parameters coming back from
   * an exclusion need, all before anything changes */
  size_t m = (size_t)o->n + 1;
  bool *sel = calloc(m, sizeof *sel);
  kiln_tensor **n1 = calloc(m, sizeof *n1), **n2 = calloc(m, sizeof *n2);
  int count = 0;
  bool ok = sel && n1 && n2;
  if (!ok) kiln__error(ctx, KILN_ERR_OOM, "%s: out of host memory", fn);
  for (int i = 0; ok && i < o->n; i++) {
    if (kiln_params_is_buffer(o->params, i)) continue; /* never trained, in no group */
    sel[i] = select(kiln_params_name(o->params, i), kiln_params_get(o->params, i), user) != 0;
    count += sel[i];
    if (sel[i] && o->group[i] && !o->excluded[i]) {
      ok = !already_grouped(o, i, fn);
      continue;
    }
    if (sel[i] && !g.exclude && !muon_takes(o, i)) {
      ok = !muon_refuses(o, i, fn);
      continue;
    }
    if (!sel[i] || g.exclude || !o->excluded[i]) continue;
    const char *s0 = state_suffix(o, 0), *s1 = state_suffix(o, 1);
    ok = (!s0 || (n1[i] = state_of(o, i, s0))) && (!s1 || (n2[i] = state_of(o, i, s1)));
  }
  for (int i = 0; i < o->n && ok; i++) {
    if (!sel[i]) continue;
    if (g.exclude && !o->excluded[i]) { /* its state goes, and a later return starts afresh */
      kiln_tensor_free(o->s1[i]);
      kiln_tensor_free(o->s2[i]);
      o->s1[i] = o->s2[i] = NULL;
      o->count[i] = 0;
      kiln__guard_restart(o, i);
    } else if (!g.exclude && o->excluded[i]) {
      o->s1[i] = n1[i];
      o->s2[i] = n2[i];
      n1[i] = n2[i] = NULL;
    }
    o->excluded[i] = g.exclude != 0;
    o->lr_scale[i] = scale;
    o->wd_set[i] = wd_set;
    o->wd[i] = wd;
    o->group[i] = o->ngroups + 1;
  }
  if (ok) o->ngroups++;
  for (int i = 0; n1 && n2 && i < o->n; i++) { /* what a failure left unused */
    kiln_tensor_free(n1[i]);
    kiln_tensor_free(n2[i]);
  }
  free(sel);
  free(n1);
  free(n2);
  return ok ? count : -1;
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

/* Parameter i's weight decay: its group's, else the optimizer's. */
static float decay_of(const kiln_optim *o, int i) {
  if (o->wd_set[i]) return o->wd[i];
  return o->kind == KILN__OPTIM_SGD
             ? o->sgd.weight_decay
             : (o->kind == KILN__OPTIM_MUON ? o->muon.weight_decay : o->adam.weight_decay);
}

/* Whether parameter i gets an update this step: it has a gradient, is no buffer and is not
 * excluded by a group. */
static bool updates(const kiln_optim *o, int i) {
  return kiln_tensor_grad(kiln_params_get(o->params, i)) && !kiln_params_is_buffer(o->params, i) &&
         !o->excluded[i];
}

/* Parameter i's rate: its group's scale of the optimizer's (and its schedule's) rate. */
static float rate_of(const kiln_optim *o, int i) {
  return o->lr_scale[i] == 1.f ? o->lr : (float)((double)o->lr * o->lr_scale[i]);
}

/* Records parameter i's update with the rate lr (its group's) and momentum or beta1 mom (the
 * schedule's when cyc). With kiln_optim_skip_nonfinite on, the guarded form: it reads the step's
 * flag and (SGD with momentum, Adam) the parameter's count of updates on the device. */
static bool record_update(kiln_optim *o, int i, float lr, bool cyc, float mom) {
  kiln_tensor *p = kiln_params_get(o->params, i);
  kiln_tensor *in[6] = {p, kiln_tensor_grad(p), o->s1[i], o->s2[i]};
  bool guard = o->found != NULL, momentum = o->kind == KILN__OPTIM_SGD && o->sgd.momentum > 0.f;
  int nin = o->kind == KILN__OPTIM_SGD ? (momentum ? 3 : 2) : 4;
  kiln__op op = o->kind != KILN__OPTIM_SGD ? (guard ? KILN__OP_ADAM_GUARDED : KILN__OP_ADAM)
                : momentum ? (guard ? KILN__OP_SGD_MOMENTUM_GUARDED : KILN__OP_SGD_MOMENTUM)
                           : (guard ? KILN__OP_SGD_GUARDED : KILN__OP_SGD);
  if (guard) in[nin++] = o->found;
  if (guard && (momentum || o->kind != KILN__OPTIM_SGD)) in[nin++] = o->applied[i];
  kiln__node *n = kiln__update(op, "kiln_optim_step", nin, in);
  if (!n) return false;
  KILN__F_NAMED(n, "lr") = lr;
  KILN__F_NAMED(n, "weight_decay") = decay_of(o, i);
  if (momentum) {
    const kiln_sgd_options *s = &o->sgd;
    KILN__F_NAMED(n, "momentum") = cyc ? mom : s->momentum;
    KILN__F_NAMED(n, "dampening") = s->dampening;
    KILN__I_NAMED(n, "nesterov") = s->nesterov != 0;
    /* the first step copies the gradient into the buffer: a step value, not structure (guarded:
     * the device's count says) */
    if (!guard) KILN__F(n, SGD_MOMENTUM, first) = o->count[i] == 0 ? 1.f : 0.f;
  } else if (o->kind != KILN__OPTIM_SGD) {
    const kiln_adam_options *a = &o->adam;
    float beta1 = cyc ? mom : a->beta1; /* torch corrects the bias with the current beta1 */
    KILN__F_NAMED(n, "beta1") = beta1;
    KILN__F_NAMED(n, "beta2") = a->beta2;
    KILN__F_NAMED(n, "eps") = a->eps;
    KILN__I_NAMED(n, "decoupled") = o->kind == KILN__OPTIM_ADAMW;
    if (!guard) { /* guarded, the device corrects the bias from its count */
      double t = (double)(o->count[i] + 1);
      double bc1 = 1.0 - pow((double)beta1, t), bc2 = 1.0 - pow((double)a->beta2, t);
      KILN__F(n, ADAM, step_size) = (float)(lr / bc1);
      KILN__F(n, ADAM, bc2_sqrt) = (float)sqrt(bc2);
    }
  }
  o->count[i]++;
  return true;
}

/* ---------------------------------------------------------------- Muon */

/* Whether Muon updates parameter i this step (a matrix with no elements has nothing to do). */
static bool muon_updates(const kiln_optim *o, int i) {
  return updates(o, i) && kiln_tensor_numel(kiln_params_get(o->params, i)) > 0;
}

/* Parameter i as a matrix: rows its first dim, cols the product of the others. */
static void muon_matrix(const kiln_optim *o, int i, int64_t *rows, int64_t *cols) {
  const kiln_tensor *p = kiln_params_get(o->params, i);
  *rows = kiln_tensor_dim(p, 0);
  *cols = kiln_tensor_numel(p) / *rows;
}

/* The scale of parameter i's rate for its shape (kiln_muon_adjust_lr). */
static float muon_scale(const kiln_optim *o, int i) {
  int64_t rows, cols;
  muon_matrix(o, i, &rows, &cols);
  double r = (double)rows, c = (double)cols;
  switch (o->muon.adjust_lr) {
  case KILN_MUON_ADJUST_NONE: return 1.f;
  case KILN_MUON_ADJUST_MATCH_RMS_ADAMW: return (float)(0.2 * sqrt(r > c ? r : c));
  case KILN_MUON_ADJUST_ORIGINAL:
  default: return (float)sqrt(r > c ? r / c : 1.0);
  }
}

/* Parameter i's orthogonalised update X, in its shape (a view of the (rows, cols) result), from
 * its gradient and its momentum buffer, already updated: u (the Nesterov look-ahead, or the
 * buffer) over its Frobenius norm, then ns_steps Newton-Schulz iterations on the Gram matrix of
 * the short side. Every step is an op: products (cuBLAS), sums and elementwise kernels. */
static kiln_tensor *muon_orthogonalise(const kiln_optim *o, int i, float mom) {
  const kiln_muon_options *m = &o->muon;
  kiln_tensor *p = kiln_params_get(o->params, i);
  int64_t rows, cols;
  muon_matrix(o, i, &rows, &cols);
  kiln_shape mat = KILN_SHAPE(rows, cols);
  kiln_tensor *u = kiln_reshape(o->s1[i], mat); /* (rows, cols) */
  if (!m->no_nesterov)
    u = kiln_add(kiln_reshape(kiln_tensor_grad(p), mat), kiln_mul_scalar(u, mom));
  kiln_tensor *norm = kiln_sqrt(kiln_sum(kiln_mul(u, u), KILN_ALL_AXES, 0)); /* () */
  kiln_tensor *x = kiln_div(u, kiln_add_scalar(norm, m->eps));               /* (rows, cols) */
  /* the iteration in m->ns_dtype (bf16: tensor-core products, each result rounded to bf16),
   * X back in f32 for the parameter's update */
  x = kiln_cast(x, m->ns_dtype);
  bool tall = rows > cols; /* then X^T's iteration, transposed: A = X^T X and X = a X + X B */
  for (int k = 0; k < m->ns_steps; k++) {
    kiln_tensor *xt = kiln_transpose(x, 0, 1);
    kiln_tensor *a = tall ? kiln_matmul(xt, x) : kiln_matmul(x, xt); /* (short, short) */
    kiln_tensor *aa = kiln_matmul(a, a);
    kiln_tensor *b = kiln_add(kiln_mul_scalar(a, m->ns_b), kiln_mul_scalar(aa, m->ns_c));
    /* the product first, so that a X and the sum after it are one kernel; B is symmetric, so
     * that X B is the transpose of B X^T */
    kiln_tensor *bx = tall ? kiln_matmul(x, b) : kiln_matmul(b, x);
    x = kiln_add(kiln_mul_scalar(x, m->ns_a), bx);
  }
  return kiln_reshape(kiln_cast(x, KILN_DTYPE_F32), kiln_tensor_shape(p));
}

/* The factor that scales parameter i to Frobenius norm sqrt(rows) (normalize_weight), () */
static kiln_tensor *muon_weight_factor(const kiln_optim *o, int i) {
  kiln_tensor *p = kiln_params_get(o->params, i);
  int64_t rows, cols;
  muon_matrix(o, i, &rows, &cols);
  kiln_tensor *sq = kiln_sum(kiln_mul(p, p), KILN_ALL_AXES, 0);
  return kiln_mul_scalar(kiln_rsqrt(sq), (float)sqrt((double)rows));
}

/* Muon's in-place update op of a by b: its guarded form, reading the step's flag, while
 * kiln_optim_skip_nonfinite is on. */
static kiln__node *muon_update(kiln_optim *o, kiln__op op, kiln__op guarded, kiln_tensor *a,
                               kiln_tensor *b) {
  kiln_tensor *in[3] = {a, b, o->found};
  return kiln__update(o->found ? guarded : op, "kiln_optim_step", o->found ? 3 : 2, in);
}

/* Muon's step with momentum mom, in phases: every momentum buffer, every update X, every weight
 * normalisation, every parameter's step. Each buffer and parameter is read before it is written,
 * and each phase's in-place updates are consecutive nodes, which the planner batches into one
 * multi-tensor launch (the parameters' steps one per distinct rate, decay and shape scale,
 * recorded together). False, with the error set, when something fails. */
static bool muon_step(kiln_optim *o, float mom) {
  const char *fn = "kiln_optim_step";
  for (int i = 0; i < o->n; i++) /* before anything is recorded */
    if (!kiln_params_is_buffer(o->params, i) && !o->excluded[i] && !muon_takes(o, i))
      return !muon_refuses(o, i, fn);
  const kiln_muon_options *m = &o->muon;
  kiln_tensor **x = o->up, **f = o->up + o->n; /* each parameter's X and weight factor */
  memset(o->up, 0, 2 * (size_t)o->n * sizeof *o->up);
  kiln_no_grad_begin(o->ctx);
  bool ok = !o->found || kiln__guard_check(o, muon_updates);
  for (int i = 0; i < o->n && ok; i++) {
    if (!muon_updates(o, i)) continue;
    kiln__node *n = muon_update(o, KILN__OP_MUON_MOMENTUM, KILN__OP_MUON_MOMENTUM_GUARDED, o->s1[i],
                                kiln_tensor_grad(kiln_params_get(o->params, i)));
    if ((ok = n != NULL)) KILN__F_NAMED(n, "momentum") = mom;
  }
  for (int i = 0; i < o->n && ok; i++) {
    if (!muon_updates(o, i)) continue;
    x[i] = muon_orthogonalise(o, i, mom);
    f[i] = m->normalize_weight ? muon_weight_factor(o, i) : NULL;
    ok = x[i] && (f[i] || !m->normalize_weight);
  }
  for (int i = 0; i < o->n && ok && m->normalize_weight; i++) {
    if (!muon_updates(o, i)) continue;
    ok = muon_update(o, KILN__OP_SCALE, KILN__OP_SCALE_GUARDED, kiln_params_get(o->params, i),
                     f[i]) != NULL;
  }
  memset(o->mark, 0, (size_t)o->n * sizeof *o->mark);
  for (int i = 0; i < o->n && ok; i++) {
    if (o->mark[i] || !muon_updates(o, i)) continue;
    float lr = rate_of(o, i), wd = decay_of(o, i), scale = muon_scale(o, i);
    for (int j = i; j < o->n && ok; j++) {
      if (o->mark[j] || !muon_updates(o, j) || rate_of(o, j) != lr || decay_of(o, j) != wd ||
          muon_scale(o, j) != scale)
        continue;
      o->mark[j] = true;
      kiln__node *n =
          muon_update(o, KILN__OP_MUON, KILN__OP_MUON_GUARDED, kiln_params_get(o->params, j), x[j]);
      if (!(ok = n != NULL)) break;
      KILN__F_NAMED(n, "lr") = lr;
      KILN__F_NAMED(n, "scale") = scale;
      KILN__F_NAMED(n, "weight_decay") = wd;
    }
  }
  ok = ok && (!o->found || kiln__guard_advance(o, muon_updates));
  kiln_no_grad_end(o->ctx);
  for (int i = 0; i < o->n && ok; i++)
    o->count[i] += muon_updates(o, i);
  return ok;
}

kiln_status kiln_optim_step(kiln_optim *o) {
  if (!o) return KILN_ERR_INVALID;
  kiln_ctx *ctx = o->ctx;
  if (!kiln__ok(ctx) || !log_state(o)) return ctx->status;
  if (o->scheduled) {
    float lr = (float)resolved_lr(&o->schedule, o->steps);
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
  /* a one-cycle schedule cycles SGD's or Muon's momentum or Adam's beta1 too (a step value, as
   * the rate) */
  bool cyc = o->scheduled && cycles_momentum(&o->schedule);
  float mom = cyc ? (float)resolved_momentum(&o->schedule, o->steps) : 0.f;
  if (o->kind == KILN__OPTIM_MUON) {
    if (muon_step(o, cyc ? mom : o->muon.momentum)) o->steps++;
    return ctx->status;
  }
  /* Parameters of one group are recorded one after another, so that the planner can batch
   * their updates (equal attributes) into one multi-tensor launch; without groups this is the
   * list's order. Parameters without a gradient are left alone, as in PyTorch. */
  if (o->found && !kiln__guard_check(o, updates)) return ctx->status;
  memset(o->mark, 0, (size_t)o->n * sizeof *o->mark);
  for (int i = 0; i < o->n; i++) {
    if (o->mark[i] || !updates(o, i)) continue;
    for (int j = i; j < o->n; j++) {
      if (o->mark[j] || !updates(o, j) || o->lr_scale[j] != o->lr_scale[i] ||
          decay_of(o, j) != decay_of(o, i))
        continue;
      o->mark[j] = true;
      if (!record_update(o, j, rate_of(o, j), cyc, mom)) return ctx->status;
    }
  }
  if (o->found && !kiln__guard_advance(o, updates)) return ctx->status;
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
  kiln__guard_free(o);
  if (o->anchor->alive) kiln__undo_forget(o->ctx, o);
  free_arrays(o);
  kiln__anchor_release(o->anchor);
  free(o);
}

/* ---------------------------------------------------------------- for checkpoints (optim.h) */

const kiln_params *kiln__optim_params(const kiln_optim *o) { return o->params; }

const char *kiln__optim_kind(const kiln_optim *o) {
  static const char *const names[] = {[KILN__OPTIM_SGD] = "sgd",
                                      [KILN__OPTIM_ADAM] = "adam",
                                      [KILN__OPTIM_ADAMW] = "adamw",
                                      [KILN__OPTIM_MUON] = "muon"};
  return names[o->kind];
}

kiln_tensor *kiln__optim_state(const kiln_optim *o, int i, int which, const char **name) {
  if (i < 0 || i >= o->n) return NULL;
  if (o->kind == KILN__OPTIM_SGD || o->kind == KILN__OPTIM_MUON) {
    *name = "momentum_buffer";
    return which == 0 ? o->s1[i] : NULL;
  }
  *name = which == 0 ? "exp_avg" : "exp_avg_sq";
  return which == 0 ? o->s1[i] : o->s2[i];
}

int64_t kiln__optim_count(const kiln_optim *o, int i) {
  return i >= 0 && i < o->n ? kiln__guard_count(o, i) : 0;
}

void kiln__optim_restore(kiln_optim *o, int64_t steps, const int64_t *counts) {
  o->steps = steps;
  for (int i = 0; i < o->n; i++)
    o->count[i] = counts[i];
  kiln__guard_restore(o);
}
