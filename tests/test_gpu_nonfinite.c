/*
 * test_gpu_nonfinite.c: non-finite steps on a GPU.
 *
 * Skipping them (kiln_optim_skip_nonfinite): a step whose gradients hold NaN leaves every
 * parameter and the optimizer's state (buffers, moments, counts) bitwise as it was, one skip is
 * counted, and later steps are bitwise those of a run that never saw that batch, for SGD (plain,
 * damped momentum, Nesterov), Adam, AdamW and Muon, in eager steps and in replayed step graphs;
 * one non-finite gradient skips every parameter, and a skipped first step leaves SGD's next step
 * its first; with finite gradients the option agrees with the plain updates within rounding;
 * the counts on the device reach checkpoints and come back when the option is turned off.
 *
 * Anomaly mode (kiln_set_anomaly): a NaN in a batch is named at the first node that reads it, and
 * the step's updates do not run; NaN and Inf made inside a step (a log, an exp's overflow, a
 * gradient) are named with their op, the function that recorded them and, for a gradient, its
 * forward node; infinities from a -inf mask made in the step pass, within a flush and across
 * flushes, and a persistent tensor's do not; a clean step is bitwise the unfused one and
 * captures no graph. Without a GPU every test skips, saying why.
 */
#include <math.h>
#include <string.h>

#include "inspect.h"
#include "optim/optim.h"     /* kiln__optim_state, kiln__optim_count */
#include "optim/optimizer.h" /* the option's tensors */

TestSuite(gpu_skip, .fini = th_remove_tmpdirs);

/* ---------------------------------------------------------------- a small classifier */

enum { B = 16, IN = 8, HID = 16, OUT = 4, BAD_AT = 21 }; /* BAD_AT: in row 2 of x */

typedef enum kind { SGD_PLAIN, SGD_DAMPED, SGD_NESTEROV, ADAM, ADAMW, MUON } kind;

typedef struct net {
  kiln_ctx *ctx;
  kiln_params *params;
  kiln_linear l1, l2;
  kiln_tensor *x, *y; /* (B, IN) f32, (B) i32: each step's batch is copied in */
  kiln_optim *o;
} net;

static kiln_optim *make_optim(kind k, kiln_params *p) {
  kiln_optim *o = NULL;
  switch (k) {
  case SGD_PLAIN: return kiln_sgd_new(p, &(kiln_sgd_options){.lr = 0.1f, .weight_decay = 1e-3f});
  case SGD_DAMPED:
    return kiln_sgd_new(
        p, &(kiln_sgd_options){
               .lr = 0.1f, .momentum = 0.9f, .dampening = 0.25f, .weight_decay = 1e-3f});
  case SGD_NESTEROV:
    return kiln_sgd_new(p, &(kiln_sgd_options){.lr = 0.1f, .momentum = 0.9f, .nesterov = 1});
  case ADAM: return kiln_adam_new(p, &(kiln_adam_options){.lr = 1e-2f});
  case ADAMW: return kiln_adamw_new(p, &(kiln_adam_options){.lr = 1e-2f, .weight_decay = 0.1f});
  case MUON:
    o = kiln_muon_new(p, &(kiln_muon_options){.lr = 0.02f, .ns_steps = 3, .normalize_weight = 1});
    cr_assert_not_null(o);
    cr_assert_eq(
        kiln_optim_add_group(o, kiln_select_no_decay, NULL, &(kiln_param_group){.exclude = 1}), 2);
    return o;
  }
  return NULL;
}

/* The net on ctx with fixed parameters, optimizer k (skipping non-finite steps when skip). */
static void net_init(net *m, kiln_ctx *ctx, kind k, bool graphs, bool skip) {
  memset(m, 0, sizeof *m);
  m->ctx = ctx;
  kiln_set_graphs(ctx, graphs);
  m->params = kiln_params_new(ctx);
  cr_assert_eq(kiln_linear_init(&m->l1, m->params,
                                &(kiln_linear_options){.name = "fc1", .in = IN, .out = HID}),
               KILN_OK, "%s", th_err(ctx));
  cr_assert_eq(kiln_linear_init(&m->l2, m->params,
                                &(kiln_linear_options){.name = "fc2", .in = HID, .out = OUT}),
               KILN_OK, "%s", th_err(ctx));
  for (int i = 0; i < kiln_params_count(m->params); i++) {
    kiln_tensor *p = kiln_params_get(m->params, i);
    int64_t n = kiln_tensor_numel(p);
    float *v = malloc((size_t)n * sizeof *v);
    th_fill(v, n, 100 + (uint64_t)i, -0.5f, 0.5f);
    cr_assert_eq(kiln_tensor_copy_from_host(p, v, (size_t)n * sizeof *v), KILN_OK);
    free(v);
  }
  m->x = kiln_tensor_new(ctx, KILN_DTYPE_F32, KILN_SHAPE(B, IN));
  m->y = kiln_tensor_new(ctx, KILN_DTYPE_I32, KILN_SHAPE(B));
  kiln_tensor_set_name(m->x, "x");
  m->o = make_optim(k, m->params);
  cr_assert_not_null(m->o, "%s", th_err(ctx));
  if (skip) cr_assert_eq(kiln_optim_skip_nonfinite(m->o, 1), KILN_OK, "%s", th_err(ctx));
}

static void net_free(net *m) {
  kiln_optim_free(m->o);
  kiln_params_free(m->params);
  kiln_tensor_free(m->x);
  kiln_tensor_free(m->y);
}

/* One training step on batch t (with *poison at x's element BAD_AT when given): its status. */
static kiln_status net_step(net *m, int t, const float *poison) {
  float xs[B * IN];
  int32_t ys[B];
  th_fill(xs, B * IN, 1000 + (uint64_t)t, -1.f, 1.f);
  for (int i = 0; i < B; i++)
    ys[i] = (t * 7 + i * 3) % OUT;
  if (poison) xs[BAD_AT] = *poison;
  kiln_step_begin(m->ctx);
  cr_assert_eq(kiln_tensor_copy_from_host(m->x, xs, sizeof xs), KILN_OK, "%s", th_err(m->ctx));
  cr_assert_eq(kiln_tensor_copy_from_host(m->y, ys, sizeof ys), KILN_OK, "%s", th_err(m->ctx));
  kiln_optim_zero_grad(m->o);
  kiln_tensor *h = kiln_relu(kiln_linear_forward(&m->l1, m->x));
  kiln_tensor *loss =
      kiln_cross_entropy(kiln_linear_forward(&m->l2, h), m->y, KILN_REDUCTION_MEAN, 0.f);
  cr_assert_eq(kiln_backward(loss), KILN_OK, "%s", th_err(m->ctx));
  cr_assert_eq(kiln_optim_step(m->o), KILN_OK, "%s", th_err(m->ctx));
  return kiln_step_end(m->ctx);
}

/* Every value a step may change, concatenated: the parameters, the optimizer's state tensors and
 * (with the option on) its counts on the device; *n gets how many. */
static float *snapshot(net *m, int64_t *n) {
  kiln_tensor *ts[64];
  int nt = 0;
  for (int i = 0; i < kiln_params_count(m->params); i++)
    ts[nt++] = kiln_params_get(m->params, i);
  for (int i = 0; i < kiln_params_count(m->params); i++)
    for (int w = 0; w < 2; w++) {
      const char *name;
      kiln_tensor *s = kiln__optim_state(m->o, i, w, &name);
      if (s) ts[nt++] = s;
    }
  for (int i = 0; m->o->applied && i < kiln_params_count(m->params); i++)
    if (m->o->applied[i]) ts[nt++] = m->o->applied[i];
  *n = 0;
  for (int k = 0; k < nt; k++)
    *n += kiln_tensor_numel(ts[k]);
  float *all = malloc((size_t)*n * sizeof *all), *at = all;
  for (int k = 0; k < nt; k++) {
    float *v = th_read(ts[k]);
    memcpy(at, v, (size_t)kiln_tensor_numel(ts[k]) * sizeof *v);
    at += kiln_tensor_numel(ts[k]);
    free(v);
  }
  return all;
}

static void assert_bitwise(const float *a, const float *b, int64_t n, const char *what) {
  for (int64_t i = 0; i < n; i++)
    cr_assert(memcmp(&a[i], &b[i], sizeof *a) == 0, "%s: value %lld is %.9g, want %.9g", what,
              (long long)i, a[i], b[i]);
}

/* ---------------------------------------------------------------- skipping non-finite steps */

/* Steps over batches 0, 1, a poisoned one (batch 9 with a NaN) and 2, 3 when bad, else 0..3,
 * asserting around the poisoned step that nothing changed; returns the final snapshot. */
static float *skip_run(kind k, bool graphs, bool bad, int64_t *n) {
  TH_GPU_CTX(ctx);
  net m;
  net_init(&m, ctx, k, graphs, true);
  const float nan = NAN;
  int64_t n0;
  float *start = snapshot(&m, &n0);
  for (int t = 0; t < 4; t++) {
    if (bad && t == 2) {
      int64_t nb, na;
      float *before = snapshot(&m, &nb);
      cr_assert_eq(net_step(&m, 9, &nan), KILN_OK, "a skipped step is no error: %s", th_err(ctx));
      float *after = snapshot(&m, &na);
      cr_assert_eq(na, nb);
      assert_bitwise(after, before, na, "the skipped step changed a value");
      cr_assert_eq(kiln_optim_skipped_steps(m.o), 1, "%s", th_err(ctx));
      free(before);
      free(after);
    }
    cr_assert_eq(net_step(&m, t, NULL), KILN_OK, "%s", th_err(ctx));
  }
  float *end = snapshot(&m, n);
  cr_assert_eq(*n, n0);
  bool moved = false;
  for (int64_t i = 0; i < *n && !moved; i++)
    moved = end[i] != start[i];
  cr_assert(moved, "the finite steps trained");
  cr_assert_eq(kiln_optim_skipped_steps(m.o), bad ? 1 : 0, "%s", th_err(ctx));
  cr_assert_eq(kiln_optim_steps(m.o), bad ? 5 : 4, "the schedule's step counts every call");
  for (int i = 0; i < kiln_params_count(m.params); i++) /* the updates applied */
    if (m.o->applied[i])
      cr_assert_eq(kiln__optim_count(m.o, i),
                   k == MUON && kiln_tensor_ndim(kiln_params_get(m.params, i)) < 2 ? 0 : 4,
                   "parameter %d: %lld updates", i, (long long)kiln__optim_count(m.o, i));
  if (graphs) {
    kiln_exec_stats st;
    kiln_stats(ctx, &st);
    cr_assert_eq(st.graph_captures, 1, "the poisoned step replays the one graph");
    cr_assert_eq(st.graph_replays, bad ? 4u : 3u);
  }
  free(start);
  net_free(&m);
  th_ctx_free(ctx);
  return end;
}

/* The four runs of kind k: with and without the poisoned batch, eager and with graphs. */
static void check_skip(kind k) {
  int64_t n[4];
  float *eb = skip_run(k, false, true, &n[0]), *ec = skip_run(k, false, false, &n[1]);
  float *gb = skip_run(k, true, true, &n[2]), *gc = skip_run(k, true, false, &n[3]);
  cr_assert(n[0] == n[1] && n[0] == n[2] && n[0] == n[3]);
  assert_bitwise(eb, ec, n[0], "eager: the run with a skipped step against the one without");
  assert_bitwise(gb, gc, n[0], "graphs: the run with a skipped step against the one without");
  assert_bitwise(gb, eb, n[0], "the graph run against the eager one");
  free(eb);
  free(ec);
  free(gb);
  free(gc);
}

Test(gpu_skip, sgd) { check_skip(SGD_PLAIN); }
Test(gpu_skip, sgd_damped_momentum) { check_skip(SGD_DAMPED); }
Test(gpu_skip, sgd_nesterov) { check_skip(SGD_NESTEROV); }
Test(gpu_skip, adam) { check_skip(ADAM); }
Test(gpu_skip, adamw) { check_skip(ADAMW); }
Test(gpu_skip, muon) { check_skip(MUON); }

Test(gpu_skip, one_nonfinite_gradient_skips_every_parameter) {
  TH_GPU_CTX(ctx);
  kiln_params *ps = kiln_params_new(ctx);
  float *w0[2], c[2][8];
  kiln_tensor *w[2], *ct[2];
  for (int k = 0; k < 2; k++) {
    w[k] = th_rand(ctx, KILN_SHAPE(8), 10 + (uint64_t)k, 0.5f, 1.f, &w0[k]);
    kiln_tensor_set_requires_grad(w[k], 1);
    cr_assert_eq(kiln_params_add(ps, k ? "w2" : "w1", w[k]), KILN_OK);
    th_fill(c[k], 8, 20 + (uint64_t)k, -1.f, 1.f);
    ct[k] = kiln_tensor_new(ctx, KILN_DTYPE_F32, KILN_SHAPE(8));
  }
  /* damped momentum: the first applied step copies the gradient into the buffer (no damping) */
  kiln_optim *o =
      kiln_sgd_new(ps, &(kiln_sgd_options){.lr = 0.5f, .momentum = 0.9f, .dampening = 0.5f});
  cr_assert_eq(kiln_optim_skip_nonfinite(o, 1), KILN_OK, "%s", th_err(ctx));
  for (int s = 0; s < 2; s++) {
    float c1[8];
    memcpy(c1, c[1], sizeof c1);
    if (s == 0) c1[2] = INFINITY; /* only w2's gradient is not finite */
    cr_assert_eq(kiln_tensor_copy_from_host(ct[0], c[0], sizeof c[0]), KILN_OK);
    cr_assert_eq(kiln_tensor_copy_from_host(ct[1], c1, sizeof c1), KILN_OK);
    kiln_step_begin(ctx);
    kiln_optim_zero_grad(o);
    kiln_tensor *loss = kiln_add(kiln_sum(kiln_mul(w[0], ct[0]), KILN_ALL_AXES, 0),
                                 kiln_sum(kiln_mul(w[1], ct[1]), KILN_ALL_AXES, 0));
    cr_assert_eq(kiln_backward(loss), KILN_OK, "%s", th_err(ctx));
    cr_assert_eq(kiln_optim_step(o), KILN_OK);
    cr_assert_eq(kiln_step_end(ctx), KILN_OK, "%s", th_err(ctx));
    cr_assert_eq(kiln_optim_skipped_steps(o), 1);
    for (int k = 0; k < 2; k++) {
      float *v = th_read(w[k]), *buf;
      const char *name;
      buf = th_read(kiln__optim_state(o, k, 0, &name));
      for (int i = 0; i < 8; i++) {
        if (s == 0) { /* skipped: both parameters and buffers as they were */
          cr_assert(memcmp(&v[i], &w0[k][i], 4) == 0, "w%d[%d] moved in the skipped step", k + 1,
                    i);
          cr_assert_eq(buf[i], 0.f, "w%d's buffer[%d] moved in the skipped step", k + 1, i);
        } else { /* then the first applied step: buffer = g exactly, p = p0 - lr g */
          cr_assert(memcmp(&buf[i], &c[k][i], 4) == 0, "w%d's buffer[%d] %.9g, want g %.9g", k + 1,
                    i, buf[i], c[k][i]);
          double want = (double)w0[k][i] - 0.5 * (double)c[k][i];
          cr_assert(fabs(v[i] - want) <= 1e-6 * (1 + fabs(want)), "w%d[%d] %.9g, want %.9g", k + 1,
                    i, v[i], want);
        }
      }
      free(v);
      free(buf);
    }
  }
  for (int k = 0; k < 2; k++) {
    free(w0[k]);
    kiln_tensor_free(ct[k]);
  }
  kiln_optim_free(o);
  kiln_params_free(ps);
  th_ctx_free(ctx);
}

Test(gpu_skip, finite_steps_agree_with_the_plain_updates) {
  const kind kinds[] = {SGD_DAMPED, SGD_NESTEROV, ADAM, ADAMW, MUON};
  for (size_t q = 0; q < sizeof kinds / sizeof *kinds; q++) {
    TH_GPU_CTX(cs);
    TH_GPU_CTX(cp);
    net s, p;
    net_init(&s, cs, kinds[q], false, true);
    net_init(&p, cp, kinds[q], false, false);
    for (int t = 0; t < 4; t++) {
      cr_assert_eq(net_step(&s, t, NULL), KILN_OK, "%s", th_err(cs));
      cr_assert_eq(net_step(&p, t, NULL), KILN_OK, "%s", th_err(cp));
    }
    int64_t ns, np;
    float *a = snapshot(&s, &ns), *b = snapshot(&p, &np);
    cr_assert_gt(ns, np, "the option's counts come last");
    /* Adam's bias corrections in f32 on the device, against double on the host */
    for (int64_t i = 0; i < np; i++)
      cr_assert(fabsf(a[i] - b[i]) <= 1e-6f + 1e-5f * fabsf(b[i]),
                "kind %d, value %lld: %.9g, %.9g", (int)kinds[q], (long long)i, a[i], b[i]);
    free(a);
    free(b);
    net_free(&s);
    net_free(&p);
    th_ctx_free(cs);
    th_ctx_free(cp);
  }
}

Test(gpu_skip, counts_reach_checkpoints_and_come_back) {
  TH_GPU_CTX(ctx);
  net m;
  net_init(&m, ctx, ADAM, true, true);
  const float inf = INFINITY;
  cr_assert_eq(net_step(&m, 0, NULL), KILN_OK, "%s", th_err(ctx));
  cr_assert_eq(net_step(&m, 1, &inf), KILN_OK, "%s", th_err(ctx));
  cr_assert_eq(net_step(&m, 2, NULL), KILN_OK, "%s", th_err(ctx));
  cr_assert_eq(kiln_optim_skipped_steps(m.o), 1, "an Inf in the batch is skipped too");
  cr_assert_eq(kiln_optim_steps(m.o), 3);
  for (int i = 0; i < 4; i++)
    cr_assert_eq(kiln__optim_count(m.o, i), 2, "parameter %d", i);

  /* a checkpoint holds the updates applied; an optimizer without the option loads them */
  char dir[256], path[512];
  th_tmpdir(dir, sizeof dir, "skip-ckpt");
  snprintf(path, sizeof path, "%s/ckpt.safetensors", dir);
  cr_assert_eq(kiln_checkpoint_save(path, m.params, m.o, NULL), KILN_OK, "%s", th_err(ctx));
  kiln_optim *o2 = kiln_adam_new(m.params, &(kiln_adam_options){.lr = 1e-2f});
  cr_assert_eq(kiln_checkpoint_load(path, m.params, o2, NULL), KILN_OK, "%s", th_err(ctx));
  for (int i = 0; i < 4; i++)
    cr_assert_eq(kiln__optim_count(o2, i), 2);
  /* with the option turned on, the loaded counts are the device's */
  cr_assert_eq(kiln_optim_skip_nonfinite(o2, 1), KILN_OK, "%s", th_err(ctx));
  for (int i = 0; i < 4; i++)
    cr_assert_eq(kiln__optim_count(o2, i), 2);
  kiln_optim_free(o2);

  /* off: the counts come back to the host; nothing is skipped any more */
  cr_assert_eq(kiln_optim_skip_nonfinite(m.o, 0), KILN_OK, "%s", th_err(ctx));
  cr_assert_null(m.o->applied);
  cr_assert_eq(kiln_optim_skipped_steps(m.o), 0);
  for (int i = 0; i < 4; i++)
    cr_assert_eq(kiln__optim_count(m.o, i), 2);
  cr_assert_eq(net_step(&m, 3, NULL), KILN_OK, "%s", th_err(ctx));
  for (int i = 0; i < 4; i++)
    cr_assert_eq(kiln__optim_count(m.o, i), 3);
  net_free(&m);
  th_ctx_free(ctx);
}

/* ---------------------------------------------------------------- anomaly mode */

/* The context's error holds s (asserted, with the error shown). */
static void assert_error_has(kiln_ctx *ctx, const char *s) {
  const char *e = kiln_ctx_error(ctx);
  cr_assert(e && strstr(e, s), "the error lacks \"%s\": %s", s, e ? e : "no error set");
}

Test(gpu_anomaly, names_the_first_node_that_reads_a_nan_batch) {
  TH_GPU_CTX(ctx); /* graphs on: anomaly mode runs the steps eagerly */
  net m;
  net_init(&m, ctx, SGD_DAMPED, true, false);
  kiln_set_anomaly(ctx, 1);
  cr_assert_eq(net_step(&m, 0, NULL), KILN_OK, "a clean step: %s", th_err(ctx));
  int64_t n;
  float *before = snapshot(&m, &n);
  int64_t steps = kiln_optim_steps(m.o);
  const float nan = NAN;
  cr_assert_eq(net_step(&m, 1, &nan), KILN_ERR_NONFINITE, "%s", th_err(ctx));
  /* the first node that reads x (through no view) */
  int32_t at = -1;
  for (int32_t i = 0; i < th_tlen(ctx) && at < 0; i++) {
    kiln__node *nd = th_node(ctx, i);
    for (int q = 0; q < nd->nin && at < 0; q++)
      if (nd->in[q] == m.x && kiln__ops[nd->op].kind != KILN__KIND_VIEW) at = i;
  }
  cr_assert_eq(th_node(ctx, at)->op, KILN__OP_MATMUL, "fc1's product reads x first");
  char want[200];
  snprintf(want, sizeof want, "node #%d of the step, matmul [%d,%d] f32 (recorded by kiln_matmul)",
           at, B, HID);
  assert_error_has(ctx, want);
  snprintf(want, sizeof want, "wrote NaN first at element %d of its output", BAD_AT / IN * HID);
  assert_error_has(ctx, want);
  snprintf(want, sizeof want, "0: 'x' [%d,%d] f32, from outside the step, holds NaN at element %d",
           B, IN, BAD_AT);
  assert_error_has(ctx, want);
  snprintf(want, sizeof want,
           "1: 'fc1.weight' [%d,%d] f32, from outside the step (through a view), finite", HID, IN);
  assert_error_has(ctx, want);
  assert_error_has(ctx, "; no in-place update after it ran");
  cr_assert_eq(kiln_ctx_status(ctx), KILN_ERR_NONFINITE);
  /* the step stopped before its updates: parameters and buffers as they were, and a failed step
   * leaves no host state behind */
  kiln_ctx_clear_error(ctx);
  int64_t na;
  float *after = snapshot(&m, &na);
  assert_bitwise(after, before, n, "a value changed in the stopped step");
  cr_assert_eq(kiln_optim_steps(m.o), steps);
  /* the next clean batch trains */
  cr_assert_eq(net_step(&m, 2, NULL), KILN_OK, "%s", th_err(ctx));
  free(after);
  after = snapshot(&m, &na);
  cr_assert(memcmp(after, before, (size_t)n * sizeof *after) != 0, "the clean step trained");
  kiln_exec_stats st;
  kiln_stats(ctx, &st);
  cr_assert_eq(st.graph_captures, 0, "anomaly mode captures no graph");
  free(before);
  free(after);
  net_free(&m);
  th_ctx_free(ctx);
}

/* Runs the step recorded so far; asserts it fails naming each of the strings (NULL-ended). */
static void expect_anomaly(kiln_ctx *ctx, const char *const *want) {
  cr_assert_eq(kiln_step_end(ctx), KILN_ERR_NONFINITE, "%s", th_err(ctx));
  for (int i = 0; want[i]; i++)
    assert_error_has(ctx, want[i]);
  kiln_ctx_clear_error(ctx);
}

Test(gpu_anomaly, names_nan_and_inf_made_inside_a_step) {
  TH_GPU_CTX(ctx);
  kiln_set_anomaly(ctx, 1);
  float *xv;
  kiln_tensor *x = th_rand(ctx, KILN_SHAPE(64), 3, 0.f, 1.f, &xv);
  char a[160], b[160], c[160];

  /* the log of a negative number: NaN, from finite inputs */
  kiln_step_begin(ctx);
  kiln_tensor *s = kiln_sum(kiln_log(kiln_add_scalar(x, -10.f)), KILN_ALL_AXES, 0);
  cr_assert_not_null(s);
  int32_t log_node = th_tlen(ctx) - 2;
  cr_assert_eq(th_node(ctx, log_node)->op, KILN__OP_LOG);
  snprintf(a, sizeof a, "node #%d of the step, log [64] f32 (recorded by kiln_log)", log_node);
  snprintf(b, sizeof b, "0: node #%d (add_scalar [64] f32), finite", log_node - 1);
  expect_anomaly(ctx, (const char *[]){a, b, "wrote NaN first at element 0", NULL});

  /* an exp that overflows: +Inf where x 1000 > log(FLT_MAX) */
  int first = -1;
  for (int i = 0; i < 64 && first < 0; i++)
    if (isinf(expf(xv[i] * 1000.f))) first = i;
  cr_assert_geq(first, 0);
  kiln_step_begin(ctx);
  s = kiln_sum(kiln_exp(kiln_mul_scalar(x, 1000.f)), KILN_ALL_AXES, 0);
  int32_t exp_node = th_tlen(ctx) - 2;
  snprintf(a, sizeof a, "node #%d of the step, exp [64] f32 (recorded by kiln_exp)", exp_node);
  snprintf(b, sizeof b, "wrote +Inf first at element %d of its output", first);
  expect_anomaly(ctx, (const char *[]){a, b, NULL});

  /* a gradient: sqrt's at 0 is 0.5 / sqrt(0) = +Inf, in the division its backward records */
  float wv[8] = {1.f, 2.f, 3.f, 0.f, 4.f, 5.f, 6.f, 7.f};
  kiln_tensor *w = kiln_tensor_from_host(ctx, KILN_DTYPE_F32, KILN_SHAPE(8), wv);
  kiln_tensor_set_requires_grad(w, 1);
  kiln_step_begin(ctx);
  kiln_tensor *r = kiln_sqrt(w);
  int32_t sqrt_node = th_tlen(ctx) - 1;
  cr_assert_eq(kiln_backward(kiln_sum(r, KILN_ALL_AXES, 0)), KILN_OK, "%s", th_err(ctx));
  int32_t div_node = -1;
  for (int32_t i = sqrt_node + 1; i < th_tlen(ctx); i++)
    if (th_node(ctx, i)->op == KILN__OP_DIV) div_node = i;
  cr_assert_geq(div_node, 0);
  snprintf(a, sizeof a, "node #%d of the step, div [8] f32 (recorded by kiln_div", div_node);
  snprintf(b, sizeof b, "in kiln_backward of node #%d (sqrt)", sqrt_node);
  snprintf(c, sizeof c, "1: node #%d (sqrt [8] f32), finite", sqrt_node);
  expect_anomaly(ctx, (const char *[]){a, b, c, "wrote +Inf first at element 3", NULL});
  kiln_tensor_free(w);
  kiln_tensor_free(x);
  free(xv);
  th_ctx_free(ctx);
}

Test(gpu_anomaly, infinities_from_a_mask_made_in_the_step_pass) {
  TH_GPU_CTX_EAGER(ctx); /* a value read inside a step */
  kiln_set_anomaly(ctx, 1);
  enum { R = 4, C = 8 };
  float cv[R * C], xv0[R * C];
  for (int i = 0; i < R * C; i++)
    cv[i] = (i % 3 == 0) ? 0.f : 1.f; /* every row keeps some */
  th_fill(xv0, R * C, 5, -1.f, 1.f);
  kiln_tensor *cond = kiln_tensor_from_host(ctx, KILN_DTYPE_F32, KILN_SHAPE(R, C), cv);
  kiln_tensor *x = kiln_tensor_from_host(ctx, KILN_DTYPE_F32, KILN_SHAPE(R, C), xv0);
  kiln_tensor_set_requires_grad(x, 1);

  /* a -inf mask through where, softmax and their gradients, in one flush */
  kiln_step_begin(ctx);
  kiln_tensor *p =
      kiln_softmax(kiln_where(cond, x, kiln_full(ctx, KILN_SHAPE(R, C), -INFINITY)), 1);
  cr_assert_eq(kiln_backward(kiln_sum(kiln_mul(p, x), KILN_ALL_AXES, 0)), KILN_OK);
  cr_assert_eq(kiln_step_end(ctx), KILN_OK, "%s", th_err(ctx));
  float *pv = th_read(p), *gv = th_read(kiln_tensor_grad(x));
  for (int r = 0; r < R; r++) {
    double sum = 0;
    for (int j = 0; j < C; j++) {
      int i = r * C + j;
      cr_assert(cv[i] != 0.f || pv[i] == 0.f, "p[%d] = %g under the mask", i, pv[i]);
      cr_assert(isfinite(gv[i]), "grad[%d] = %g", i, gv[i]);
      sum += pv[i];
    }
    cr_assert(fabs(sum - 1) < 1e-5, "row %d sums to %.9g", r, sum);
  }
  free(pv);
  free(gv);

  /* across flushes: the masked values read, then softmax in the step's next flush */
  kiln_step_begin(ctx);
  kiln_tensor *m = kiln_where(cond, x, kiln_full(ctx, KILN_SHAPE(R, C), -INFINITY));
  float mv[R * C];
  cr_assert_eq(kiln_tensor_to_host(m, mv, sizeof mv), KILN_OK, "%s", th_err(ctx));
  cr_assert(isinf(mv[0]) && mv[0] < 0);
  p = kiln_softmax(m, 1);
  cr_assert_eq(kiln_step_end(ctx), KILN_OK, "%s", th_err(ctx));

  /* a persistent tensor's -inf is no constant of the step: the first node it reaches is named */
  float mk[R * C];
  for (int i = 0; i < R * C; i++)
    mk[i] = cv[i] != 0.f ? 0.f : -INFINITY;
  kiln_tensor *mask = kiln_tensor_from_host(ctx, KILN_DTYPE_F32, KILN_SHAPE(R, C), mk);
  kiln_tensor_set_name(mask, "mask");
  kiln_step_begin(ctx);
  cr_assert_not_null(kiln_softmax(kiln_add(x, mask), 1));
  expect_anomaly(ctx, (const char *[]){"add [4,8] f32 (recorded by kiln_add)",
                                       "wrote -Inf first at element 0",
                                       "1: 'mask' [4,8] f32, from outside the step, holds -Inf at "
                                       "element 0",
                                       NULL});
  kiln_tensor_free(mask);
  kiln_tensor_free(cond);
  kiln_tensor_free(x);
  th_ctx_free(ctx);
}

Test(gpu_anomaly, a_clean_step_is_the_unfused_one) {
  TH_GPU_CTX(ca); /* graphs on, anomaly mode */
  TH_GPU_CTX(cb); /* fusion and graphs off */
  net a, b;
  net_init(&a, ca, ADAM, true, false);
  net_init(&b, cb, ADAM, false, false);
  kiln_set_anomaly(ca, 1);
  kiln_set_fusion(cb, 0);
  for (int t = 0; t < 3; t++) {
    cr_assert_eq(net_step(&a, t, NULL), KILN_OK, "%s", th_err(ca));
    cr_assert_eq(net_step(&b, t, NULL), KILN_OK, "%s", th_err(cb));
  }
  int64_t na, nb;
  float *va = snapshot(&a, &na), *vb = snapshot(&b, &nb);
  cr_assert_eq(na, nb);
  assert_bitwise(va, vb, na, "anomaly mode against the unfused steps");
  kiln_exec_stats st;
  kiln_stats(ca, &st);
  cr_assert_eq(st.graph_captures, 0);
  cr_assert_eq(st.eager_steps, 3);
  free(va);
  free(vb);
  net_free(&a);
  net_free(&b);
  th_ctx_free(ca);
  th_ctx_free(cb);
}
