/*
 * test_gpu_muon.c: Muon on a GPU. Steps against a float64 host reference of the same maths
 * (momentum, Nesterov or not, the Newton-Schulz iteration worked on the transpose when rows >
 * cols, weight normalisation, decoupled weight decay, the rate's shape scale, a group's rate) for
 * 2-D and 4-D weights with rows < cols and rows > cols, the momentum buffers included;
 * graph-mode steps bitwise equal to steps without graphs under schedules; Muon (the filters) and
 * SGD (the rest) over one parameter list training a small convolutional net; a checkpoint round
 * trip of the momentum buffers; bad options and a refused step changing nothing.
 * Without a GPU every test skips, saying why.
 */
#include <math.h>
#include <string.h>

#include "helpers.h"
#include "optim/optim.h" /* kiln__optim_state: the momentum buffers */

/* ---------------------------------------------------------------- the setup */

/* Four matrices for Muon, wide and tall, 2-D and 4-D (read as (rows, rest)), and a bias it
 * leaves alone; loss = sum(p c) + 0.5 sum(q p^2) over each, so that each gradient is c + q p,
 * known on the host. */
#define NP 5
static const kiln_shape shapes[NP] = {
    {2, {6, 10}}, {2, {12, 5}}, {4, {8, 3, 3, 3}}, {4, {32, 2, 2, 2}}, {1, {7}}};
static const char *const names[NP] = {"w", "t", "cw", "ct", "b"};
#define NM 4 /* the first NM are matrices */

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
    s->p[k] = th_rand(ctx, shapes[k], 40 + k, -1.f, 1.f, &s->ph[k]);
    s->c[k] = th_rand(ctx, shapes[k], 50 + k, -1.f, 1.f, &s->ch[k]);
    s->q[k] = th_rand(ctx, shapes[k], 60 + k, 0.1f, 1.f, &s->qh[k]);
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

/* One training step of every optimizer given (n of them). */
static kiln_status setup_step(setup *s, kiln_optim **o, int n) {
  kiln_step_begin(s->ctx);
  kiln_params_zero_grad(s->params);
  cr_assert_eq(kiln_backward(setup_loss(s)), KILN_OK, "%s", th_err(s->ctx));
  for (int k = 0; k < n; k++)
    kiln_optim_step(o[k]);
  return kiln_step_end(s->ctx);
}

static int select_bias(const char *name, const kiln_tensor *t, void *user) {
  (void)t;
  (void)user;
  return strcmp(name, "b") == 0;
}

/* A Muon optimizer over the setup's list with the bias excluded. */
static kiln_optim *muon_of(setup *s, const kiln_muon_options *mo) {
  kiln_optim *o = kiln_muon_new(s->params, mo);
  cr_assert_not_null(o, "%s", th_err(s->ctx));
  cr_assert_eq(kiln_optim_add_group(o, select_bias, NULL, &(kiln_param_group){.exclude = 1}), 1,
               "%s", th_err(s->ctx));
  return o;
}

/* ---------------------------------------------------------------- the float64 reference */

/* (r, k) x (k, c) -> (r, c), row-major; bt: b is given as (c, k) and read transposed. */
static void mm(const double *a, const double *b, double *out, int64_t r, int64_t k, int64_t c,
               bool bt) {
  for (int64_t i = 0; i < r; i++)
    for (int64_t j = 0; j < c; j++) {
      double t = 0;
      for (int64_t l = 0; l < k; l++)
        t += a[i * k + l] * (bt ? b[j * k + l] : b[l * c + j]);
      out[i * c + j] = t;
    }
}

/* The Newton-Schulz iteration of u (rows, cols) into out, as Keller Jordan and torch write it:
 * X = u / (||u|| + eps), transposed when rows > cols; A = X X^T, B = b A + c A A, X = a X + B X;
 * transposed back. */
static void ref_ns(const double *u, int64_t rows, int64_t cols, const kiln_muon_options *o,
                   double *out) {
  bool tall = rows > cols;
  int64_t r = tall ? cols : rows, c = tall ? rows : cols, n = rows * cols;
  double *x = malloc((size_t)n * sizeof *x), *bx = malloc((size_t)n * sizeof *bx);
  double *a = malloc((size_t)(r * r) * sizeof *a), *aa = malloc((size_t)(r * r) * sizeof *aa);
  double *b = malloc((size_t)(r * r) * sizeof *b);
  double norm = 0;
  for (int64_t i = 0; i < n; i++)
    norm += u[i] * u[i];
  norm = sqrt(norm) + (double)o->eps;
  for (int64_t i = 0; i < r; i++)
    for (int64_t j = 0; j < c; j++)
      x[i * c + j] = (tall ? u[j * cols + i] : u[i * cols + j]) / norm;
  for (int s = 0; s < o->ns_steps; s++) {
    mm(x, x, a, r, c, r, true);
    mm(a, a, aa, r, r, r, false);
    for (int64_t i = 0; i < r * r; i++)
      b[i] = (double)o->ns_b * a[i] + (double)o->ns_c * aa[i];
    mm(b, x, bx, r, r, c, false);
    for (int64_t i = 0; i < n; i++)
      x[i] = (double)o->ns_a * x[i] + bx[i];
  }
  for (int64_t i = 0; i < r; i++)
    for (int64_t j = 0; j < c; j++)
      out[tall ? j * cols + i : i * cols + j] = x[i * c + j];
  free(x);
  free(bx);
  free(a);
  free(aa);
  free(b);
}

/* The reference's state: parameters and momentum buffers in float64. */
typedef struct ref {
  double *p[NP], *buf[NP];
} ref;

static void ref_init(ref *r, const setup *s) {
  for (int k = 0; k < NP; k++) {
    r->p[k] = malloc((size_t)s->n[k] * sizeof(double));
    r->buf[k] = calloc((size_t)s->n[k], sizeof(double));
    for (int64_t i = 0; i < s->n[k]; i++)
      r->p[k][i] = s->ph[k][i];
  }
}

static void ref_free(ref *r) {
  for (int k = 0; k < NP; k++) {
    free(r->p[k]);
    free(r->buf[k]);
  }
}

/* One Muon step of matrix k with options o (resolved: no zero fields) and rate lr. */
static void ref_step(ref *r, const setup *s, int k, const kiln_muon_options *o, double lr) {
  int64_t n = s->n[k], rows = shapes[k].d[0], cols = n / rows;
  double *p = r->p[k], *buf = r->buf[k], mom = (double)o->momentum;
  double *u = malloc((size_t)n * sizeof *u), *x = malloc((size_t)n * sizeof *x);
  for (int64_t i = 0; i < n; i++) {
    double g = s->ch[k][i] + (double)s->qh[k][i] * p[i];
    buf[i] = mom * buf[i] + g;
    u[i] = o->no_nesterov ? buf[i] : g + mom * buf[i];
  }
  if (o->normalize_weight) {
    double sq = 0;
    for (int64_t i = 0; i < n; i++)
      sq += p[i] * p[i];
    double f = sqrt((double)rows) / sqrt(sq);
    for (int64_t i = 0; i < n; i++)
      p[i] *= f;
  }
  ref_ns(u, rows, cols, o, x);
  double R = (double)rows, C = (double)cols, scale = 1;
  if (o->adjust_lr == KILN_MUON_ADJUST_ORIGINAL) scale = sqrt(R > C ? R / C : 1.0);
  if (o->adjust_lr == KILN_MUON_ADJUST_MATCH_RMS_ADAMW) scale = 0.2 * sqrt(R > C ? R : C);
  for (int64_t i = 0; i < n; i++)
    p[i] = p[i] * (1 - lr * (double)o->weight_decay) - lr * scale * x[i];
  free(u);
  free(x);
}

/* Asserts the parameters and Muon's momentum buffers against the reference (the bias, excluded,
 * bitwise as it started). */
static void assert_matches(setup *s, kiln_optim *o, const ref *r, const char *what, double atol,
                           double rtol) {
  for (int k = 0; k < NP; k++) {
    char label[96];
    float *got = th_read(s->p[k]);
    if (k < NM) {
      snprintf(label, sizeof label, "%s: %s", what, names[k]);
      th_assert_close(got, r->p[k], s->n[k], atol, rtol, label);
      const char *sname = NULL;
      kiln_tensor *buf = kiln__optim_state(o, k, 0, &sname);
      cr_assert_not_null(buf, "%s has no momentum buffer", names[k]);
      cr_assert_str_eq(sname, "momentum_buffer");
      float *bh = th_read(buf);
      snprintf(label, sizeof label, "%s: %s's momentum buffer", what, names[k]);
      th_assert_close(bh, r->buf[k], s->n[k], atol, rtol, label);
      free(bh);
    } else {
      cr_assert(memcmp(got, s->ph[k], (size_t)s->n[k] * sizeof *got) == 0,
                "%s: the excluded bias changed", what);
      const char *sname = NULL;
      cr_assert_null(kiln__optim_state(o, k, 0, &sname), "the excluded bias has a buffer");
    }
    free(got);
  }
}

/* Four steps of Muon with options mo (and its defaults resolved by hand into want) against the
 * reference; the rate halves before step 3, and "t" may have a group rate of its own. An f32
 * iteration matches within f32 rounding; a bf16 one (ns_dtype) within what bf16's 8 bits leave
 * of the update, a few percent of it. */
static void check_against_reference(const kiln_muon_options *mo, const kiln_muon_options *want,
                                    float t_scale) {
  bool bf16 = mo->ns_dtype == KILN_DTYPE_BF16;
  double atol = bf16 ? 0.05 * want->lr : 2e-5, rtol = bf16 ? 1e-2 : 1e-4;
  TH_GPU_CTX(ctx);
  setup s;
  setup_init(&s, ctx);
  kiln_optim *o = muon_of(&s, mo);
  if (t_scale != 1.f)
    cr_assert_eq(
        kiln_optim_add_group(o, kiln_select_prefix, "t", &(kiln_param_group){.lr_scale = t_scale}),
        1);
  ref r;
  ref_init(&r, &s);
  for (int t = 1; t <= 4; t++) {
    if (t == 3) kiln_optim_set_lr(o, want->lr * 0.5f);
    float lr = kiln_optim_lr(o);
    cr_assert_eq(setup_step(&s, &o, 1), KILN_OK, "step %d: %s", t, th_err(ctx));
    for (int k = 0; k < NM; k++) {
      double rate = k == 1 && t_scale != 1.f ? (double)(float)((double)lr * t_scale) : (double)lr;
      ref_step(&r, &s, k, want, rate);
    }
    char what[32];
    snprintf(what, sizeof what, "step %d", t);
    assert_matches(&s, o, &r, what, atol, rtol);
  }
  cr_assert_eq(kiln_optim_steps(o), 4);
  ref_free(&r);
  kiln_optim_free(o);
  setup_free(&s);
  th_ctx_free(ctx);
}

Test(gpu_muon, defaults_against_float64) {
  /* torch's defaults but the rate: Nesterov, decay 0.1, five iterations, the original scale */
  kiln_muon_options mo = {.lr = 0.05f};
  kiln_muon_options want = kiln_muon_defaults();
  want.lr = 0.05f;
  check_against_reference(&mo, &want, 1.f);
}

Test(gpu_muon, airbench_form_against_float64) {
  /* airbench94_muon's: normalised weights, no shape scale, momentum 0.6, three iterations; here
   * without Nesterov and without decay */
  kiln_muon_options mo = {.lr = 0.1f,
                          .momentum = 0.6f,
                          .no_nesterov = 1,
                          .weight_decay = KILN_ZERO,
                          .ns_steps = 3,
                          .adjust_lr = KILN_MUON_ADJUST_NONE,
                          .normalize_weight = 1};
  kiln_muon_options want = mo;
  want.eps = 1e-7f;
  want.ns_a = 3.4445f;
  want.ns_b = -4.775f;
  want.ns_c = 2.0315f;
  want.weight_decay = 0.f;
  check_against_reference(&mo, &want, 1.f);
}

Test(gpu_muon, bf16_iteration_against_float64) {
  /* airbench94_muon's iteration in bf16: tensor-core products, each result rounded */
  kiln_muon_options mo = {.lr = 0.05f, .ns_steps = 3, .ns_dtype = KILN_DTYPE_BF16};
  kiln_muon_options want = kiln_muon_defaults();
  want.lr = mo.lr;
  want.ns_steps = 3;
  check_against_reference(&mo, &want, 1.f);
}

Test(gpu_muon, moonshot_scale_group_rate_and_normalised_weights_against_float64) {
  kiln_muon_options mo = {.lr = 0.02f,
                          .momentum = 0.8f,
                          .weight_decay = 0.05f,
                          .ns_steps = 4,
                          .adjust_lr = KILN_MUON_ADJUST_MATCH_RMS_ADAMW,
                          .normalize_weight = 1};
  kiln_muon_options want = kiln_muon_defaults();
  want.lr = mo.lr;
  want.momentum = mo.momentum;
  want.weight_decay = mo.weight_decay;
  want.ns_steps = mo.ns_steps;
  want.adjust_lr = mo.adjust_lr;
  want.normalize_weight = 1;
  check_against_reference(&mo, &want, 2.f);
}

/* ---------------------------------------------------------------- graphs */

/* Steps under a cosine rate and a one-cycle momentum (both step values), graphs on or off;
 * returns every parameter's and buffer's values (malloc'd), in order. */
static void schedule_run(kiln_ctx *ctx, bool graphs, int steps, float **out) {
  kiln_set_graphs(ctx, graphs);
  setup s;
  setup_init(&s, ctx);
  kiln_optim *o = muon_of(&s, &(kiln_muon_options){.lr = 0.05f, .normalize_weight = 1});
  cr_assert_eq(
      kiln_optim_add_group(o, kiln_select_prefix, "c", &(kiln_param_group){.lr_scale = 0.5f}), 2);
  kiln_schedule sc = {.kind = KILN_SCHEDULE_ONE_CYCLE, .base_lr = 0.08f, .total_steps = 40};
  kiln_optim_set_schedule(o, &sc);
  th_assert_ok(ctx);
  for (int t = 0; t < steps; t++)
    cr_assert_eq(setup_step(&s, &o, 1), KILN_OK, "graphs %d, step %d: %s", graphs, t, th_err(ctx));
  for (int k = 0; k < NM; k++) {
    const char *sname;
    out[k] = th_read(s.p[k]);
    out[NM + k] = th_read(kiln__optim_state(o, k, 0, &sname));
  }
  kiln_optim_free(o);
  setup_free(&s);
}

Test(gpu_muon, graph_replays_are_bitwise_the_eager_steps) {
  TH_GPU_CTX(cg);
  TH_GPU_CTX(ce);
  enum { STEPS = 8 };
  float *g[2 * NM], *e[2 * NM];
  schedule_run(cg, true, STEPS, g);
  schedule_run(ce, false, STEPS, e);
  for (int k = 0; k < 2 * NM; k++) {
    int64_t n = 1;
    for (int d = 0; d < shapes[k % NM].ndim; d++)
      n *= shapes[k % NM].d[d];
    for (int64_t i = 0; i < n; i++)
      cr_assert(memcmp(&g[k][i], &e[k][i], 4) == 0, "%s%s[%lld]: %.9g with graphs, %.9g without",
                names[k % NM], k < NM ? "" : "'s buffer", (long long)i, g[k][i], e[k][i]);
    free(g[k]);
    free(e[k]);
  }
  kiln_exec_stats st;
  kiln_stats(cg, &st);
  cr_assert_eq(st.graph_captures, 1, "one capture, whatever the rate and momentum (%llu)",
               (unsigned long long)st.graph_captures);
  cr_assert_eq(st.graph_replays, STEPS - 1);
  th_ctx_free(cg);
  th_ctx_free(ce);
}

/* ---------------------------------------------------------------- Muon and SGD */

static int select_filters(const char *name, const kiln_tensor *t, void *user) {
  (void)name;
  (void)user;
  return kiln_tensor_ndim(t) == 4;
}
static int select_others(const char *name, const kiln_tensor *t, void *user) {
  return !select_filters(name, t, user);
}

/* A small convolutional net memorises a batch of random images: Muon trains its filters, (16, 27)
 * and (32, 16) as matrices (airbench's way: normalised weights, momentum 0.6, three iterations),
 * and SGD with Nesterov momentum the bias and the linear layer, both stepping in every (captured)
 * step. (A float64 transcription of this net and its optimizers, its own random draws, takes
 * the loss from 1.39 to under 0.01 in 60 steps.) */
Test(gpu_muon, muon_and_sgd_train_a_conv_net) {
  TH_GPU_CTX(ctx);
  kiln_params *p = kiln_params_new(ctx);
  kiln_conv2d_layer c1, c2;
  kiln_linear fc;
  kiln_manual_seed(ctx, 3);
  cr_assert_eq(
      kiln_conv2d_layer_init(&c1, p,
                             &(kiln_conv2d_layer_options){
                                 .name = "c1", .in = 3, .out = 16, .kernel = 3, .padding = 1}),
      KILN_OK);
  cr_assert_eq(
      kiln_conv2d_layer_init(&c2, p,
                             &(kiln_conv2d_layer_options){
                                 .name = "c2", .in = 16, .out = 32, .kernel = 1, .no_bias = 1}),
      KILN_OK);
  cr_assert_eq(
      kiln_linear_init(&fc, p, &(kiln_linear_options){.name = "fc", .in = 4 * 4 * 32, .out = 4}),
      KILN_OK);
  enum { B = 8 };
  kiln_tensor *x = th_rand(ctx, KILN_SHAPE(B, 4, 4, 3), 70, -1.f, 1.f, NULL);
  int32_t labels[B];
  for (int i = 0; i < B; i++)
    labels[i] = (i * 7 + 3) % 4;
  kiln_tensor *y = kiln_tensor_from_host(ctx, KILN_DTYPE_I32, KILN_SHAPE(B), labels);
  cr_assert_not_null(y);
  kiln_optim *mu = kiln_muon_new(p, &(kiln_muon_options){.lr = 0.05f,
                                                         .momentum = 0.6f,
                                                         .weight_decay = KILN_ZERO,
                                                         .ns_steps = 3,
                                                         .adjust_lr = KILN_MUON_ADJUST_NONE,
                                                         .normalize_weight = 1});
  kiln_optim *sgd =
      kiln_sgd_new(p, &(kiln_sgd_options){.lr = 0.01f, .momentum = 0.9f, .nesterov = 1});
  cr_assert(mu && sgd, "%s", th_err(ctx));
  cr_assert_eq(kiln_optim_add_group(mu, select_others, NULL, &(kiln_param_group){.exclude = 1}), 3);
  cr_assert_eq(kiln_optim_add_group(sgd, select_filters, NULL, &(kiln_param_group){.exclude = 1}),
               2);
  int np = kiln_params_count(p);
  float *before[8];
  for (int i = 0; i < np; i++)
    before[i] = th_read(kiln_params_get(p, i));
  enum { STEPS = 60 };
  float first = 0, last = 0;
  for (int t = 0; t < STEPS; t++) {
    kiln_step_begin(ctx);
    kiln_optim_zero_grad(mu);
    kiln_tensor *h = kiln_relu(kiln_conv2d_layer_forward(&c1, x));
    h = kiln_relu(kiln_conv2d_layer_forward(&c2, h));
    kiln_tensor *logits = kiln_linear_forward(&fc, kiln_flatten(h));
    kiln_tensor *loss = kiln_cross_entropy(logits, y, KILN_REDUCTION_MEAN, 0.f);
    cr_assert_eq(kiln_backward(loss), KILN_OK, "%s", th_err(ctx));
    cr_assert_eq(kiln_optim_step(mu), KILN_OK, "%s", th_err(ctx));
    cr_assert_eq(kiln_optim_step(sgd), KILN_OK, "%s", th_err(ctx));
    cr_assert_eq(kiln_step_end(ctx), KILN_OK, "step %d: %s", t, th_err(ctx));
    float l = kiln_tensor_item(loss);
    cr_assert(isfinite(l), "step %d: loss %g: %s", t, l, th_err(ctx));
    if (t == 0) first = l;
    last = l;
  }
  cr_log_info("loss %.4f -> %.4f in %d steps", first, last, STEPS);
  cr_assert_lt(last, 0.25f * first, "the loss went from %g to %g", first, last);
  /* every parameter moved, each by its own optimizer: all of a filter (Muon's update is dense) */
  for (int i = 0; i < np; i++) {
    kiln_tensor *t = kiln_params_get(p, i);
    float *after = th_read(t);
    int64_t moved = 0, m = kiln_tensor_numel(t);
    for (int64_t j = 0; j < m; j++)
      moved += after[j] != before[i][j];
    if (kiln_tensor_ndim(t) == 4)
      cr_assert_eq(moved, m, "%s: %lld of %lld values moved", kiln_params_name(p, i),
                   (long long)moved, (long long)m);
    else
      cr_assert_gt(moved, m / 2, "%s: %lld of %lld values moved", kiln_params_name(p, i),
                   (long long)moved, (long long)m);
    free(after);
    free(before[i]);
  }
  /* the filters are Muon's: normalised to norm sqrt(rows) before each step, so they stay near it
   */
  float *wc1 = th_read(c1.weight);
  double sq = 0;
  for (int64_t i = 0; i < kiln_tensor_numel(c1.weight); i++)
    sq += (double)wc1[i] * wc1[i];
  cr_assert_lt(fabs(sqrt(sq) / 4.0 - 1), 0.2, "c1's filters have norm %g, sqrt(16) = 4 expected",
               sqrt(sq));
  cr_assert_eq(kiln_optim_steps(mu), STEPS);
  cr_assert_eq(kiln_optim_steps(sgd), STEPS);
  kiln_exec_stats st;
  kiln_stats(ctx, &st);
  cr_assert_eq(st.graph_captures, 1, "%llu captures", (unsigned long long)st.graph_captures);
  free(wc1);
  kiln_optim_free(mu);
  kiln_optim_free(sgd);
  kiln_params_free(p);
  kiln_tensor_free(x);
  kiln_tensor_free(y);
  th_ctx_free(ctx);
}

/* ---------------------------------------------------------------- checkpoints */

/* Every parameter of s bitwise its value in want, the run's without the checkpoint (freed). */
static void expect_resumed_as_straight(setup *s, float **want) {
  for (int k = 0; k < NP; k++) {
    float *got = th_read(s->p[k]);
    for (int64_t i = 0; i < s->n[k]; i++)
      cr_assert(memcmp(&got[i], &want[k][i], 4) == 0, "%s[%lld]: resumed %.9g, straight %.9g",
                names[k], (long long)i, got[i], want[k][i]);
    free(got);
    free(want[k]);
  }
}

Test(gpu_muon, checkpoint_round_trip_of_the_momentum_buffers) {
  TH_GPU_CTX(ctx);
  setup s;
  setup_init(&s, ctx);
  kiln_muon_options mo = {.lr = 0.03f, .momentum = 0.9f, .normalize_weight = 1};
  kiln_optim *o = muon_of(&s, &mo);
  char dir[256], path[300];
  th_tmpdir(dir, sizeof dir, "muon");
  snprintf(path, sizeof path, "%s/ckpt.safetensors", dir);
  for (int t = 0; t < 3; t++)
    cr_assert_eq(setup_step(&s, &o, 1), KILN_OK, "%s", th_err(ctx));
  cr_assert_eq(kiln_checkpoint_save(path, s.params, o, NULL), KILN_OK, "%s", th_err(ctx));
  float *saved[NM];
  for (int k = 0; k < NM; k++) {
    const char *sname;
    saved[k] = th_read(kiln__optim_state(o, k, 0, &sname));
  }
  for (int t = 0; t < 3; t++)
    cr_assert_eq(setup_step(&s, &o, 1), KILN_OK, "%s", th_err(ctx));
  float *want[NP];
  for (int k = 0; k < NP; k++)
    want[k] = th_read(s.p[k]);

  /* an SGD optimizer cannot take Muon's state: an error naming both, nothing loaded */
  kiln_optim *sgd = kiln_sgd_new(s.params, &(kiln_sgd_options){.lr = 0.1f, .momentum = 0.9f});
  cr_assert_not_null(sgd);
  cr_assert_neq(kiln_checkpoint_load(path, s.params, sgd, NULL), KILN_OK);
  cr_assert(strstr(th_err(ctx), "muon") && strstr(th_err(ctx), "sgd"), "%s", th_err(ctx));
  kiln_ctx_clear_error(ctx);
  kiln_optim_free(sgd);
  float *still = th_read(s.p[0]);
  cr_assert(memcmp(still, want[0], (size_t)s.n[0] * sizeof *still) == 0);
  free(still);

  /* loaded: the buffers are the saved ones, and the last three steps repeat bitwise */
  cr_assert_eq(kiln_checkpoint_load(path, s.params, o, NULL), KILN_OK, "%s", th_err(ctx));
  cr_assert_eq(kiln_optim_steps(o), 3);
  for (int k = 0; k < NM; k++) {
    const char *sname;
    float *b = th_read(kiln__optim_state(o, k, 0, &sname));
    cr_assert(memcmp(b, saved[k], (size_t)s.n[k] * sizeof *b) == 0,
              "%s's momentum buffer is not the saved one", names[k]);
    free(b);
    free(saved[k]);
  }
  for (int t = 0; t < 3; t++)
    cr_assert_eq(setup_step(&s, &o, 1), KILN_OK, "%s", th_err(ctx));
  expect_resumed_as_straight(&s, want);
  kiln_optim_free(o);
  setup_free(&s);
  th_ctx_free(ctx);
}

static int select_not_bias(const char *name, const kiln_tensor *t, void *user) {
  return !select_bias(name, t, user);
}

/* Muon for the matrices beside SGD for the bias, both in one checkpoint
 * (kiln_checkpoint_save_optims): loaded after three more steps, with other rates set meanwhile,
 * each optimizer gets back its buffers, rate and step count, and the three steps repeat bitwise.
 * The list in the other order is refused and loads nothing. */
Test(gpu_muon, muon_and_sgd_resume_bitwise_from_one_checkpoint) {
  TH_GPU_CTX(ctx);
  setup s;
  setup_init(&s, ctx);
  kiln_optim *mu = muon_of(&s, &(kiln_muon_options){.lr = 0.03f, .momentum = 0.9f});
  kiln_optim *sgd =
      kiln_sgd_new(s.params, &(kiln_sgd_options){.lr = 0.1f, .momentum = 0.9f, .nesterov = 1});
  cr_assert_not_null(sgd, "%s", th_err(ctx));
  cr_assert_eq(kiln_optim_add_group(sgd, select_not_bias, NULL, &(kiln_param_group){.exclude = 1}),
               NP - 1, "%s", th_err(ctx));
  kiln_optim *both[2] = {mu, sgd}, *swapped[2] = {sgd, mu};
  char dir[256], path[300];
  th_tmpdir(dir, sizeof dir, "muon-sgd");
  snprintf(path, sizeof path, "%s/ckpt.safetensors", dir);
  for (int t = 0; t < 3; t++)
    cr_assert_eq(setup_step(&s, both, 2), KILN_OK, "%s", th_err(ctx));
  kiln_optim_set_lr(sgd, 0.05f); /* the rate the checkpoint holds, not the one made with */
  cr_assert_eq(kiln_checkpoint_save_optims(path, s.params, both, 2, NULL), KILN_OK, "%s",
               th_err(ctx));
  for (int t = 0; t < 3; t++)
    cr_assert_eq(setup_step(&s, both, 2), KILN_OK, "%s", th_err(ctx));
  float *want[NP];
  for (int k = 0; k < NP; k++)
    want[k] = th_read(s.p[k]);

  cr_assert_neq(kiln_checkpoint_load_optims(path, s.params, swapped, 2, NULL), KILN_OK);
  cr_assert(strstr(th_err(ctx), "muon") && strstr(th_err(ctx), "sgd"), "%s", th_err(ctx));
  kiln_ctx_clear_error(ctx);
  cr_assert(kiln_optim_steps(mu) == 6 && kiln_optim_steps(sgd) == 6, "a refused load changed "
                                                                     "the step counts");
  float *still = th_read(s.p[0]);
  cr_assert(memcmp(still, want[0], (size_t)s.n[0] * sizeof *still) == 0);
  free(still);

  kiln_optim_set_lr(mu, 1.f);
  kiln_optim_set_lr(sgd, 1.f);
  cr_assert_eq(kiln_checkpoint_load_optims(path, s.params, both, 2, NULL), KILN_OK, "%s",
               th_err(ctx));
  cr_assert(kiln_optim_steps(mu) == 3 && kiln_optim_steps(sgd) == 3);
  cr_assert(kiln_optim_lr(mu) == 0.03f && kiln_optim_lr(sgd) == 0.05f, "rates %g and %g",
            kiln_optim_lr(mu), kiln_optim_lr(sgd));
  for (int t = 0; t < 3; t++)
    cr_assert_eq(setup_step(&s, both, 2), KILN_OK, "%s", th_err(ctx));
  expect_resumed_as_straight(&s, want);
  kiln_optim_free(mu);
  kiln_optim_free(sgd);
  setup_free(&s);
  th_ctx_free(ctx);
}

/* ---------------------------------------------------------------- errors */

Test(gpu_muon, bad_options_and_a_refused_step_change_nothing) {
  TH_GPU_CTX(ctx);
  setup s;
  setup_init(&s, ctx);
  kiln_muon_options bad[] = {{.lr = -0.1f},      {.momentum = 1.5f},
                             {.ns_steps = 1000}, {.weight_decay = NAN},
                             {.eps = -1.f},      {.ns_dtype = KILN_DTYPE_I32}};
  const char *want[] = {"lr -0.1",          "momentum 1.5", "ns_steps 1000",
                        "weight_decay nan", "eps -1",       "ns_dtype i32"};
  for (size_t k = 0; k < sizeof bad / sizeof bad[0]; k++) {
    cr_assert_null(kiln_muon_new(s.params, &bad[k]), "case %zu made an optimizer", k);
    cr_assert(strstr(th_err(ctx), "kiln_muon_new") && strstr(th_err(ctx), want[k]),
              "case %zu: '%s' lacks '%s'", k, th_err(ctx), want[k]);
    kiln_ctx_clear_error(ctx);
  }
  /* two optimizers in one step, one of which may not train the bias: the step fails, runs
   * nothing, and the good optimizer's count is as it was */
  kiln_optim *good = muon_of(&s, &(kiln_muon_options){.lr = 0.05f});
  kiln_optim *all = kiln_muon_new(s.params, &(kiln_muon_options){.lr = 0.05f});
  cr_assert_not_null(all, "%s", th_err(ctx));
  kiln_optim *both[2] = {good, all};
  cr_assert_eq(setup_step(&s, both, 1), KILN_OK, "%s", th_err(ctx));
  int64_t n;
  float *before = th_params_values(s.params, &n);
  kiln_status st = setup_step(&s, both, 2);
  cr_assert_eq(st, KILN_ERR_SHAPE, "status %s: %s", kiln_status_name(st), th_err(ctx));
  cr_assert(strstr(th_err(ctx), "kiln_optim_step") && strstr(th_err(ctx), "b has 1"), "%s",
            th_err(ctx));
  kiln_ctx_clear_error(ctx);
  float *after = th_params_values(s.params, &n);
  cr_assert(memcmp(before, after, (size_t)n * sizeof *before) == 0,
            "a failed step changed the parameters");
  cr_assert_eq(kiln_optim_steps(good), 1, "the failed step's count was undone");
  cr_assert_eq(kiln_optim_steps(all), 0);
  /* and the context goes on */
  cr_assert_eq(setup_step(&s, both, 1), KILN_OK, "%s", th_err(ctx));
  cr_assert_eq(kiln_optim_steps(good), 2);
  free(before);
  free(after);
  kiln_optim_free(good);
  kiln_optim_free(all);
  setup_free(&s);
  th_ctx_free(ctx);
}
