/*
 * test_gpu_init_optim.c: on a GPU, the initialisers' values (mean, standard deviation and bounds
 * of large tensors against torch's formulas, for linear and convolution shapes; the same seed
 * giving the same values), parameter groups (SGD with momentum and AdamW steps against a float64
 * reference with each group's rate and weight decay, excluded parameters bitwise unchanged, a
 * checkpoint round trip with groups), and gradient clipping by global norm (the norm against a
 * float64 reference, gradients scaled when it exceeds max_norm and bitwise unchanged when not,
 * and graph-mode steps with a changing norm bitwise equal to steps without graphs).
 * Without a GPU every test skips, saying why.
 */
#include <math.h>
#include <string.h>

#include "helpers.h"

/* ---------------------------------------------------------------- initialisers */

typedef struct moments {
  double mean, std, min, max;
} moments;

static moments moments_of(const float *v, int64_t n) {
  moments m = {0, 0, INFINITY, -INFINITY};
  for (int64_t i = 0; i < n; i++) {
    m.mean += v[i];
    m.min = v[i] < m.min ? v[i] : m.min;
    m.max = v[i] > m.max ? v[i] : m.max;
  }
  m.mean /= (double)n;
  for (int64_t i = 0; i < n; i++)
    m.std += (v[i] - m.mean) * (v[i] - m.mean);
  m.std = sqrt(m.std / (double)n);
  return m;
}

/* Asserts t's values are U(-bound, bound) (lo and hi when given) or N(mean, std): the sample
 * mean within 6 standard errors, the standard deviation within 1%, and the bounds. */
static void assert_uniform(kiln_tensor *t, double lo, double hi, const char *what) {
  int64_t n = kiln_tensor_numel(t);
  float *v = th_read(t);
  moments m = moments_of(v, n);
  double std = (hi - lo) / sqrt(12.0);
  cr_assert_geq(m.min, lo, "%s: min %.9g below %.9g", what, m.min, lo);
  cr_assert_lt(m.max, hi, "%s: max %.9g not below %.9g", what, m.max, hi);
  cr_assert_lt(m.min, lo + (hi - lo) * 1e-3, "%s: min %.9g far from %.9g", what, m.min, lo);
  cr_assert_gt(m.max, hi - (hi - lo) * 1e-3, "%s: max %.9g far from %.9g", what, m.max, hi);
  cr_assert_lt(fabs(m.mean - (lo + hi) / 2), 6 * std / sqrt((double)n), "%s: mean %.9g", what,
               m.mean);
  cr_assert_lt(fabs(m.std / std - 1), 0.01, "%s: std %.9g, want %.9g", what, m.std, std);
  free(v);
}

static void assert_normal(kiln_tensor *t, double mean, double std, const char *what) {
  int64_t n = kiln_tensor_numel(t);
  float *v = th_read(t);
  moments m = moments_of(v, n);
  cr_assert_lt(fabs(m.mean - mean), 6 * std / sqrt((double)n), "%s: mean %.9g, want %.9g", what,
               m.mean, mean);
  cr_assert_lt(fabs(m.std / std - 1), 0.01, "%s: std %.9g, want %.9g", what, m.std, std);
  int64_t within = 0; /* a normal's mass within one standard deviation: 0.682689 */
  for (int64_t i = 0; i < n; i++)
    within += fabs(v[i] - mean) <= std;
  cr_assert_lt(fabs((double)within / (double)n - 0.682689), 0.005, "%s: %.5f within 1 std", what,
               (double)within / (double)n);
  cr_assert_gt(m.max - mean, 4 * std, "%s: tails reach past 4 std", what);
  cr_assert_lt(m.min - mean, -4 * std, "%s: tails reach past 4 std", what);
  free(v);
}

Test(gpu_init, uniform_normal_constant) {
  TH_GPU_CTX(ctx);
  kiln_tensor *t = kiln_tensor_new(ctx, KILN_DTYPE_F32, KILN_SHAPE(1024, 1024));
  cr_assert_eq(kiln_init_uniform(t, -0.5f, 1.5f), KILN_OK, "%s", th_err(ctx));
  assert_uniform(t, -0.5, 1.5, "uniform(-0.5, 1.5)");
  cr_assert_eq(kiln_init_normal(t, 0.3f, 2.f), KILN_OK, "%s", th_err(ctx));
  assert_normal(t, 0.3, 2.0, "normal(0.3, 2)");
  cr_assert_eq(kiln_init_constant(t, -1.25f), KILN_OK, "%s", th_err(ctx));
  float *v = th_read(t);
  for (int64_t i = 0; i < kiln_tensor_numel(t); i++)
    cr_assert_eq(v[i], -1.25f, "[%lld] = %g", (long long)i, v[i]);
  free(v);
  /* a failed call leaves the values */
  cr_assert_eq(kiln_init_normal(t, 0.f, -1.f), KILN_ERR_INVALID);
  kiln_ctx_clear_error(ctx);
  v = th_read(t);
  cr_assert_eq(v[0], -1.25f);
  cr_assert_eq(v[kiln_tensor_numel(t) - 1], -1.25f);
  free(v);
  kiln_tensor_free(t);
  th_ctx_free(ctx);
}

Test(gpu_init, kaiming_and_xavier_follow_torchs_formulas) {
  TH_GPU_CTX(ctx);
  /* a linear weight (out, in) = (512, 2048): fan_in 2048, fan_out 512 */
  kiln_tensor *lin = kiln_tensor_new(ctx, KILN_DTYPE_F32, KILN_SHAPE(512, 2048));
  /* a convolution weight (Cout, Cin / groups, kh, kw) = (256, 128, 3, 3): fan_in 1152, fan_out
   * 2304 */
  kiln_tensor *conv = kiln_tensor_new(ctx, KILN_DTYPE_F32, KILN_SHAPE(256, 128, 3, 3));
  double b;

  /* torch's kaiming_uniform_(w): leaky_relu with a = 0, fan_in: bound sqrt(6 / fan_in) */
  cr_assert_eq(kiln_init_kaiming_uniform(lin, 0.f, KILN_FAN_IN, 0), KILN_OK, "%s", th_err(ctx));
  b = sqrt(6.0 / 2048);
  assert_uniform(lin, -b, b, "kaiming_uniform linear fan_in");
  /* nn.Linear's own init: a = sqrt(5), bound 1 / sqrt(fan_in) */
  cr_assert_eq(kiln_init_kaiming_uniform(lin, sqrtf(5.f), KILN_FAN_IN, 0), KILN_OK);
  b = 1.0 / sqrt(2048.0);
  assert_uniform(lin, -b * (1 + 1e-6), b * (1 + 1e-6), "kaiming_uniform a=sqrt(5)");
  /* fan_out, tanh on a convolution: bound (5/3) sqrt(3 / 2304) */
  cr_assert_eq(kiln_init_kaiming_uniform(conv, 0.f, KILN_FAN_OUT, KILN_NONLINEARITY_TANH), KILN_OK);
  b = 5.0 / 3.0 * sqrt(3.0 / 2304);
  assert_uniform(conv, -b, b, "kaiming_uniform conv fan_out tanh");

  /* kaiming_normal_: std gain / sqrt(fan) */
  cr_assert_eq(kiln_init_kaiming_normal(conv, 0.f, KILN_FAN_OUT, KILN_NONLINEARITY_RELU), KILN_OK);
  assert_normal(conv, 0.0, sqrt(2.0) / sqrt(2304.0), "kaiming_normal conv fan_out relu");
  cr_assert_eq(kiln_init_kaiming_normal(lin, 0.2f, KILN_FAN_IN, 0), KILN_OK);
  assert_normal(lin, 0.0, sqrt(2.0 / (1 + (double)0.2f * 0.2f)) / sqrt(2048.0),
                "kaiming_normal linear leaky 0.2");

  /* xavier: std gain sqrt(2 / (fan_in + fan_out)); gain 0 means 1 */
  cr_assert_eq(kiln_init_xavier_uniform(lin, 0.f), KILN_OK);
  b = sqrt(3.0) * sqrt(2.0 / (2048 + 512));
  assert_uniform(lin, -b, b, "xavier_uniform linear");
  float gain = kiln_init_gain(KILN_NONLINEARITY_TANH, 0.f);
  cr_assert_eq(kiln_init_xavier_uniform(conv, gain), KILN_OK);
  b = (double)gain * sqrt(3.0) * sqrt(2.0 / (1152 + 2304));
  assert_uniform(conv, -b, b, "xavier_uniform conv tanh gain");
  cr_assert_eq(kiln_init_xavier_normal(conv, 0.f), KILN_OK);
  assert_normal(conv, 0.0, sqrt(2.0 / (1152 + 2304)), "xavier_normal conv");
  cr_assert_eq(kiln_init_xavier_normal(lin, 2.f), KILN_OK);
  assert_normal(lin, 0.0, 2.0 * sqrt(2.0 / (2048 + 512)), "xavier_normal linear gain 2");
  kiln_tensor_free(lin);
  kiln_tensor_free(conv);
  th_ctx_free(ctx);
}

/* The values of each initialiser of a (64, 32, 3, 3) tensor on a context seeded with seed. */
static float *init_all(kiln_ctx *ctx, uint64_t seed) {
  kiln_manual_seed(ctx, seed);
  kiln_tensor *t = kiln_tensor_new(ctx, KILN_DTYPE_F32, KILN_SHAPE(64, 32, 3, 3));
  int64_t n = kiln_tensor_numel(t);
  float *all = malloc((size_t)(6 * n) * sizeof *all);
  cr_assert_not_null(all);
  for (int k = 0; k < 6; k++) {
    kiln_status s = k == 0   ? kiln_init_uniform(t, -1.f, 1.f)
                    : k == 1 ? kiln_init_normal(t, 0.f, 1.f)
                    : k == 2 ? kiln_init_kaiming_uniform(t, 0.f, KILN_FAN_IN, 0)
                    : k == 3 ? kiln_init_kaiming_normal(t, 0.f, KILN_FAN_OUT, 0)
                    : k == 4 ? kiln_init_xavier_uniform(t, 0.f)
                             : kiln_init_xavier_normal(t, 0.f);
    cr_assert_eq(s, KILN_OK, "%s", th_err(ctx));
    float *v = th_read(t);
    memcpy(all + k * n, v, (size_t)n * sizeof *v);
    free(v);
  }
  kiln_tensor_free(t);
  return all;
}

Test(gpu_init, the_same_seed_gives_the_same_values) {
  TH_GPU_CTX(a);
  TH_GPU_CTX(b);
  int64_t n = 6 * 64 * 32 * 3 * 3;
  float *va = init_all(a, 7), *vb = init_all(b, 7), *vc = init_all(a, 8), *vd = init_all(a, 7);
  cr_assert(memcmp(va, vb, (size_t)n * sizeof *va) == 0, "two contexts seeded alike differ");
  cr_assert(memcmp(va, vd, (size_t)n * sizeof *va) == 0, "reseeding does not repeat the values");
  int64_t same = 0;
  for (int64_t i = 0; i < n; i++)
    same += va[i] == vc[i];
  cr_assert_lt(same, n / 100, "seeds 7 and 8 agree on %lld of %lld values", (long long)same,
               (long long)n);
  free(va);
  free(vb);
  free(vc);
  free(vd);
  th_ctx_free(a);
  th_ctx_free(b);
}

/* ---------------------------------------------------------------- parameter groups */

/* Three parameters: "w" (5, 7) in the optimizer's own group, "b" (7) in the no-decay group,
 * "frozen.w" (3, 4) excluded; loss = sum(p * c) + 0.5 sum(q p^2) over each, so that each
 * gradient is c + q p, known on the host. */
#define NP 3
static const kiln_shape shapes[NP] = {{2, {5, 7}}, {1, {7}}, {2, {3, 4}}};
static const char *const names[NP] = {"w", "b", "frozen.w"};

typedef struct setup {
  kiln_ctx *ctx;
  kiln_params *params;
  kiln_tensor *p[NP], *c[NP], *q[NP];
  float *ph[NP], *ch[NP], *qh[NP];
  int64_t n[NP];
} setup;

static void setup_init(setup *s, kiln_ctx *ctx) {
  memset(s, 0, sizeof *s);
  s->ctx = ctx;
  s->params = kiln_params_new(ctx);
  for (int k = 0; k < NP; k++) {
    s->p[k] = th_rand(ctx, shapes[k], 10 + k, -1.f, 1.f, &s->ph[k]);
    s->c[k] = th_rand(ctx, shapes[k], 20 + k, -1.f, 1.f, &s->ch[k]);
    s->q[k] = th_rand(ctx, shapes[k], 30 + k, 0.1f, 1.f, &s->qh[k]);
    s->n[k] = kiln_tensor_numel(s->p[k]);
    cr_assert_eq(kiln_params_add(s->params, names[k], s->p[k]), KILN_OK);
  }
}

static kiln_tensor *setup_loss(setup *s) {
  kiln_tensor *loss = NULL;
  for (int k = 0; k < NP; k++) {
    kiln_tensor *p = s->p[k];
    kiln_tensor *l = kiln_add(
        kiln_sum(kiln_mul(p, s->c[k]), KILN_ALL_AXES, 0),
        kiln_mul_scalar(kiln_sum(kiln_mul(s->q[k], kiln_mul(p, p)), KILN_ALL_AXES, 0), 0.5f));
    loss = loss ? kiln_add(loss, l) : l;
  }
  return loss;
}

static void setup_free(setup *s) {
  kiln_params_free(s->params);
  for (int k = 0; k < NP; k++) {
    kiln_tensor_free(s->c[k]);
    kiln_tensor_free(s->q[k]);
    free(s->ph[k]);
    free(s->ch[k]);
    free(s->qh[k]);
  }
}

static void setup_step(setup *s, kiln_optim *o) {
  kiln_step_begin(s->ctx);
  kiln_optim_zero_grad(o);
  cr_assert_eq(kiln_backward(setup_loss(s)), KILN_OK, "%s", th_err(s->ctx));
  cr_assert_eq(kiln_optim_step(o), KILN_OK, "%s", th_err(s->ctx));
  cr_assert_eq(kiln_step_end(s->ctx), KILN_OK, "%s", th_err(s->ctx));
}

/* Steps an optimizer with groups: "b" in the no-decay group (lr_scale and weight_decay as
 * given), "frozen." excluded; checks against float64 transcriptions of torch's rules with each
 * parameter's rate and decay. */
static void check_groups(bool adamw) {
  TH_GPU_CTX(ctx);
  setup s;
  setup_init(&s, ctx);
  kiln_sgd_options so = {.lr = 0.05f, .momentum = 0.9f, .weight_decay = 0.01f};
  kiln_adam_options ao = {.lr = 0.01f, .weight_decay = 0.1f};
  kiln_param_group nd = {.lr_scale = 2.f, .weight_decay = KILN_ZERO};
  if (adamw) nd = (kiln_param_group){.lr_scale = 0.5f, .weight_decay = 0.3f};
  kiln_optim *o = adamw ? kiln_adamw_new(s.params, &ao) : kiln_sgd_new(s.params, &so);
  cr_assert_not_null(o, "%s", th_err(ctx));
  cr_assert_eq(kiln_optim_add_group(o, kiln_select_no_decay, NULL, &nd), 1);
  cr_assert_eq(
      kiln_optim_add_group(o, kiln_select_prefix, "frozen.", &(kiln_param_group){.exclude = 1}), 1);
  float base = adamw ? ao.lr : so.lr, wd = adamw ? ao.weight_decay : so.weight_decay;
  double lr[NP] = {base, (double)base * nd.lr_scale, 0};
  double dec[NP] = {wd, adamw ? nd.weight_decay : 0.0, 0};
  double *P[NP], *M1[NP], *M2[NP];
  for (int k = 0; k < NP; k++) {
    P[k] = calloc((size_t)s.n[k], sizeof(double));
    M1[k] = calloc((size_t)s.n[k], sizeof(double));
    M2[k] = calloc((size_t)s.n[k], sizeof(double));
    for (int64_t i = 0; i < s.n[k]; i++)
      P[k][i] = s.ph[k][i];
  }
  for (int t = 1; t <= 4; t++) {
    if (t == 3) { /* the groups' rates follow the optimizer's */
      kiln_optim_set_lr(o, base * 0.5f);
      lr[0] = (double)(base * 0.5f);
      lr[1] = (double)(base * 0.5f) * nd.lr_scale;
    }
    setup_step(&s, o);
    for (int k = 0; k < 2; k++)
      for (int64_t i = 0; i < s.n[k]; i++) {
        double g = s.ch[k][i] + s.qh[k][i] * P[k][i];
        if (!adamw) {
          double d = g + dec[k] * P[k][i];
          M1[k][i] = t == 1 ? d : so.momentum * M1[k][i] + d;
          P[k][i] -= lr[k] * M1[k][i];
        } else {
          P[k][i] *= 1 - lr[k] * dec[k];
          double b1 = 0.9f, b2 = 0.999f; /* torch's defaults, as the f32 kiln holds */
          M1[k][i] = b1 * M1[k][i] + (1 - b1) * g;
          M2[k][i] = b2 * M2[k][i] + (1 - b2) * g * g;
          double bc1 = 1 - pow(b1, t), bc2 = 1 - pow(b2, t);
          P[k][i] -= (lr[k] / bc1) * M1[k][i] / (sqrt(M2[k][i]) / sqrt(bc2) + 1e-8);
        }
      }
  }
  for (int k = 0; k < NP; k++) {
    float *got = th_read(s.p[k]);
    if (k < 2)
      th_assert_close(got, P[k], s.n[k], 1e-5, 1e-4, names[k]);
    else
      cr_assert(memcmp(got, s.ph[k], (size_t)s.n[k] * sizeof *got) == 0,
                "the excluded parameter changed");
    free(got);
    free(P[k]);
    free(M1[k]);
    free(M2[k]);
  }
  kiln_optim_free(o);
  setup_free(&s);
  th_ctx_free(ctx);
}

Test(gpu_groups, sgd_momentum_with_groups) { check_groups(false); }
Test(gpu_groups, adamw_with_groups) { check_groups(true); }

Test(gpu_groups, checkpoint_round_trip_with_groups) {
  TH_GPU_CTX(ctx);
  setup s;
  setup_init(&s, ctx);
  kiln_optim *o = kiln_adamw_new(s.params, &(kiln_adam_options){.lr = 0.02f});
  cr_assert_not_null(o, "%s", th_err(ctx));
  cr_assert_eq(
      kiln_optim_add_group(o, kiln_select_no_decay, NULL,
                           &(kiln_param_group){.lr_scale = 3.f, .weight_decay = KILN_ZERO}),
      1);
  cr_assert_eq(
      kiln_optim_add_group(o, kiln_select_prefix, "frozen.", &(kiln_param_group){.exclude = 1}), 1);
  char dir[256], path[300];
  th_tmpdir(dir, sizeof dir, "groups");
  snprintf(path, sizeof path, "%s/ckpt.safetensors", dir);
  for (int t = 0; t < 3; t++)
    setup_step(&s, o);
  cr_assert_eq(kiln_checkpoint_save(path, s.params, o, NULL), KILN_OK, "%s", th_err(ctx));
  for (int t = 0; t < 3; t++)
    setup_step(&s, o);
  float *want[NP];
  for (int k = 0; k < NP; k++)
    want[k] = th_read(s.p[k]);

  /* an optimizer without the exclusion finds no state for "frozen.w": an error, nothing loaded */
  kiln_optim *plain = kiln_adamw_new(s.params, &(kiln_adam_options){.lr = 0.02f});
  cr_assert_not_null(plain);
  cr_assert_neq(kiln_checkpoint_load(path, s.params, plain, NULL), KILN_OK);
  cr_assert_eq(kiln_ctx_status(ctx), KILN_ERR_FORMAT);
  cr_assert(strstr(th_err(ctx), "optim/frozen.w") != NULL, "the message '%s' lacks the name",
            th_err(ctx));
  kiln_ctx_clear_error(ctx);
  kiln_optim_free(plain);
  float *still = th_read(s.p[0]);
  cr_assert(memcmp(still, want[0], (size_t)s.n[0] * sizeof *still) == 0);
  free(still);

  /* the same groups: loaded, the last three steps repeat bitwise */
  cr_assert_eq(kiln_checkpoint_load(path, s.params, o, NULL), KILN_OK, "%s", th_err(ctx));
  cr_assert_eq(kiln_optim_steps(o), 3);
  for (int t = 0; t < 3; t++)
    setup_step(&s, o);
  for (int k = 0; k < NP; k++) {
    float *got = th_read(s.p[k]);
    for (int64_t i = 0; i < s.n[k]; i++)
      cr_assert(memcmp(&got[i], &want[k][i], 4) == 0, "%s[%lld]: resumed %.9g, straight %.9g",
                names[k], (long long)i, got[i], want[k][i]);
    if (k == 2) cr_assert(memcmp(got, s.ph[k], (size_t)s.n[k] * sizeof *got) == 0);
    free(got);
    free(want[k]);
  }
  kiln_optim_free(o);
  setup_free(&s);
  th_ctx_free(ctx);
}

/* ---------------------------------------------------------------- clipping */

/* Every gradient of the setup, read to the host (malloc'd), in parameter order. */
static void read_grads(setup *s, float **g) {
  for (int k = 0; k < NP; k++) {
    kiln_tensor *gt = kiln_tensor_grad(s->p[k]);
    cr_assert_not_null(gt);
    g[k] = th_read(gt);
  }
}

Test(gpu_clip, scales_above_max_norm_and_leaves_gradients_below) {
  TH_GPU_CTX(ctx);
  setup s;
  setup_init(&s, ctx);
  kiln_tensor *stat = kiln_tensor_new(ctx, KILN_DTYPE_F32, KILN_SHAPE(4));
  cr_assert_eq(kiln_params_add_buffer(s.params, "bn.running_mean", stat), KILN_OK);
  /* the gradients unclipped, and the norm in float64 from them */
  kiln_step_begin(ctx);
  kiln_params_zero_grad(s.params);
  cr_assert_eq(kiln_backward(setup_loss(&s)), KILN_OK, "%s", th_err(ctx));
  cr_assert_eq(kiln_step_end(ctx), KILN_OK, "%s", th_err(ctx));
  float *g0[NP];
  read_grads(&s, g0);
  double sq = 0;
  for (int k = 0; k < NP; k++)
    for (int64_t i = 0; i < s.n[k]; i++) {
      double want = s.ch[k][i] + (double)s.qh[k][i] * s.ph[k][i];
      cr_assert_lt(fabs(g0[k][i] - want), 1e-6, "the gradient is c + q p");
      sq += (double)g0[k][i] * g0[k][i];
    }
  double norm = sqrt(sq);

  for (int clip = 0; clip < 2; clip++) {
    float max_norm = (float)(clip ? norm / 4 : norm * 4);
    kiln_step_begin(ctx);
    kiln_params_zero_grad(s.params);
    cr_assert_eq(kiln_backward(setup_loss(&s)), KILN_OK, "%s", th_err(ctx));
    kiln_tensor *total = kiln_clip_grad_norm(s.params, max_norm);
    cr_assert_not_null(total, "%s", th_err(ctx));
    cr_assert_eq(kiln_step_end(ctx), KILN_OK, "%s", th_err(ctx));
    float got = kiln_tensor_item(total);
    cr_assert_lt(fabs(got - norm), 1e-5 * norm, "total norm %.9g, float64 %.9g", got, norm);
    float *g1[NP];
    read_grads(&s, g1);
    double coef = (double)max_norm / ((double)got + 1e-6);
    for (int k = 0; k < NP; k++) {
      for (int64_t i = 0; i < s.n[k]; i++) {
        if (!clip) {
          cr_assert(memcmp(&g1[k][i], &g0[k][i], 4) == 0,
                    "%s.grad[%lld]: %.9g, unclipped %.9g: below max_norm it must not change",
                    names[k], (long long)i, g1[k][i], g0[k][i]);
          continue;
        }
        double want = g0[k][i] * coef;
        cr_assert_leq(fabs(g1[k][i] - want), 1e-6 * fabs(want) + 1e-30,
                      "%s.grad[%lld]: %.9g, want %.9g (coefficient %.9g)", names[k], (long long)i,
                      g1[k][i], want, coef);
      }
      free(g1[k]);
    }
    /* the clipped gradients' norm is max_norm */
    if (clip) {
      kiln_step_begin(ctx);
      kiln_tensor *again = kiln_clip_grad_norm(s.params, 1e30f);
      cr_assert_eq(kiln_step_end(ctx), KILN_OK, "%s", th_err(ctx));
      cr_assert_float_eq(kiln_tensor_item(again), max_norm, 1e-5 * max_norm);
    }
  }
  for (int k = 0; k < NP; k++)
    free(g0[k]);
  setup_free(&s);
  th_ctx_free(ctx);
}

/* Steps with clipping (a changing norm: the data scale goes up and down, so that some steps clip
 * and some do not) and SGD with groups; returns the norms and the final parameters. */
static void clip_run(kiln_ctx *ctx, bool graphs, float *norms, int steps, float **params) {
  kiln_set_graphs(ctx, graphs);
  setup s;
  setup_init(&s, ctx);
  /* a small rate: the parameters move little, so the data scale decides which steps clip */
  kiln_optim *o = kiln_sgd_new(s.params, &(kiln_sgd_options){.lr = 1e-3f, .momentum = 0.9f});
  cr_assert_not_null(o, "%s", th_err(ctx));
  cr_assert_eq(
      kiln_optim_add_group(o, kiln_select_no_decay, NULL, &(kiln_param_group){.lr_scale = 0.5f}),
      1);
  float *scaled = malloc((size_t)s.n[0] * sizeof *scaled);
  for (int t = 0; t < steps; t++) {
    float f = t % 3 == 0 ? 0.1f : (t % 3 == 1 ? 1.f : 6.f); /* norms about 3.6, 5 and 21 */
    for (int64_t i = 0; i < s.n[0]; i++)
      scaled[i] = s.ch[0][i] * f;
    kiln_step_begin(ctx);
    /* the next "batch" into an input tensor first, so that the step stays one graph */
    cr_assert_eq(kiln_tensor_copy_from_host(s.c[0], scaled, (size_t)s.n[0] * sizeof *scaled),
                 KILN_OK);
    kiln_optim_zero_grad(o);
    cr_assert_eq(kiln_backward(setup_loss(&s)), KILN_OK, "%s", th_err(ctx));
    kiln_tensor *total = kiln_clip_grad_norm(s.params, 8.f);
    cr_assert_eq(kiln_optim_step(o), KILN_OK, "%s", th_err(ctx));
    cr_assert_eq(kiln_step_end(ctx), KILN_OK, "%s", th_err(ctx));
    norms[t] = kiln_tensor_item(total);
    cr_assert(isfinite(norms[t]), "%s", th_err(ctx));
  }
  for (int k = 0; k < NP; k++)
    params[k] = th_read(s.p[k]);
  free(scaled);
  kiln_optim_free(o);
  setup_free(&s);
}

Test(gpu_clip, graph_replays_are_bitwise_the_eager_steps) {
  TH_GPU_CTX(cg);
  TH_GPU_CTX(ce);
  enum { STEPS = 12 };
  float ng[STEPS], ne[STEPS], *pg[NP], *pe[NP];
  clip_run(cg, true, ng, STEPS, pg);
  clip_run(ce, false, ne, STEPS, pe);
  int clipped = 0;
  for (int t = 0; t < STEPS; t++) {
    cr_assert(memcmp(&ng[t], &ne[t], 4) == 0, "step %d: norm %.9g with graphs, %.9g without", t,
              ng[t], ne[t]);
    clipped += ng[t] > 8.f;
  }
  cr_assert(clipped > 0 && clipped < STEPS, "%d of %d steps clipped: want some, not all", clipped,
            STEPS);
  for (int k = 0; k < NP; k++) {
    int64_t n = 1;
    for (int d = 0; d < shapes[k].ndim; d++)
      n *= shapes[k].d[d];
    for (int64_t i = 0; i < n; i++)
      cr_assert(memcmp(&pg[k][i], &pe[k][i], 4) == 0, "%s[%lld]: %.9g with graphs, %.9g without",
                names[k], (long long)i, pg[k][i], pe[k][i]);
    free(pg[k]);
    free(pe[k]);
  }
  kiln_exec_stats st;
  kiln_stats(cg, &st);
  cr_assert_eq(st.graph_captures, 1, "one capture, whatever the norm (%llu)",
               (unsigned long long)st.graph_captures);
  cr_assert_eq(st.graph_replays, STEPS - 1);
  th_ctx_free(cg);
  th_ctx_free(ce);
}
