/*
 * test_gpu_trace.c: timeline traces on a GPU (issue 26). Traced steps of an MLP and a small CNN
 * in each mode (unfused, fused, graph) have every launch kiln_stats counts exactly once, each
 * given to its group, named as kiln names it and inside its step's span; a traced run computes
 * bitwise what an untraced one does; a long trace keeps its last KILN_TRACE_STEPS steps;
 * KILN_TRACE traces a context from kiln_ctx_new to kiln_ctx_free; one context of a process is
 * traced at a time. Without a GPU every test skips, saying why; with one, CUPTI must load.
 */
#include <cjson/cJSON.h>
#include <stdlib.h>
#include <string.h>

#include "helpers.h"
#include "internal.h"

TestSuite(gpu_trace, .fini = th_remove_tmpdirs);

#define BATCH 64

/* A model: the benchmark MLP, or conv 3x3 1->8, ReLU, max pool 2, conv 3x3 8->16, ReLU,
 * dropout, flatten, linear to 10 (on 12x12 images), with Adam. */
typedef struct model {
  bool cnn;
  th_mlp mlp;
  kiln_params *p;
  kiln_conv2d_layer c1, c2;
  kiln_linear fc;
  kiln_optim *opt;
  kiln_tensor *x, *y;
} model;

static void model_init(model *m, kiln_ctx *ctx, bool cnn) {
  memset(m, 0, sizeof *m);
  m->cnn = cnn;
  kiln_manual_seed(ctx, 5);
  if (!cnn) {
    th_mlp_init(ctx, &m->mlp);
    m->x = th_rand(ctx, KILN_SHAPE(BATCH, 784), 1, -1, 1, NULL);
  } else {
    m->p = kiln_params_new(ctx);
    cr_assert_eq(kiln_conv2d_layer_init(
                     &m->c1, m->p,
                     &(kiln_conv2d_layer_options){.name = "c1", .in = 1, .out = 8, .kernel = 3}),
                 KILN_OK);
    cr_assert_eq(kiln_conv2d_layer_init(
                     &m->c2, m->p,
                     &(kiln_conv2d_layer_options){.name = "c2", .in = 8, .out = 16, .kernel = 3}),
                 KILN_OK);
    cr_assert_eq(
        kiln_linear_init(&m->fc, m->p,
                         &(kiln_linear_options){.name = "fc", .in = 3 * 3 * 16, .out = 10}),
        KILN_OK);
    kiln_adam_options o = kiln_adam_defaults();
    m->opt = kiln_adam_new(m->p, &o);
    m->x = th_rand(ctx, KILN_SHAPE(BATCH, 12, 12, 1), 1, -1, 1, NULL);
  }
  int32_t yh[BATCH];
  for (int i = 0; i < BATCH; i++)
    yh[i] = (i * 7 + 3) % 10;
  m->y = kiln_tensor_from_host(ctx, KILN_DTYPE_I32, KILN_SHAPE(BATCH), yh);
  th_assert_ok(ctx);
}

static kiln_tensor *model_step(model *m) {
  if (!m->cnn) return th_mlp_record_step(&m->mlp, m->x, m->y);
  const kiln_pool2d_options pool = {.kernel_h = 2, .kernel_w = 2};
  kiln_tensor *h = kiln_relu(kiln_conv2d_layer_forward(&m->c1, m->x)); /* (B, 10, 10, 8) */
  h = kiln_max_pool2d(h, &pool);                                       /* (B, 5, 5, 8) */
  h = kiln_relu(kiln_conv2d_layer_forward(&m->c2, h));                 /* (B, 3, 3, 16) */
  h = kiln_dropout(kiln_flatten(h), 0.25f, 1);
  kiln_tensor *loss =
      kiln_cross_entropy(kiln_linear_forward(&m->fc, h), m->y, KILN_REDUCTION_MEAN, 0.f);
  kiln_optim_zero_grad(m->opt);
  kiln_backward(loss);
  kiln_optim_step(m->opt);
  return loss;
}

static kiln_params *model_params(model *m) { return m->cnn ? m->p : m->mlp.params; }

static void model_free(model *m) {
  if (m->cnn) {
    kiln_optim_free(m->opt);
    kiln_params_free(m->p);
  } else {
    th_mlp_free(&m->mlp);
  }
  kiln_tensor_free(m->x);
  kiln_tensor_free(m->y);
}

static void set_mode(kiln_ctx *ctx, int mode) {
  kiln_set_fusion(ctx, mode > 0);
  kiln_set_graphs(ctx, mode == 2);
}

static cJSON *parse(const char *path) {
  char *text = th_read_whole(path, NULL);
  cJSON *doc = cJSON_Parse(text);
  free(text);
  cr_assert_not_null(doc, "%s is not JSON", path);
  return doc;
}
static const cJSON *get(const cJSON *o, const char *k) {
  return cJSON_GetObjectItemCaseSensitive(o, k);
}
static double num(const cJSON *o, const char *k, double dflt) {
  const cJSON *v = get(o, k);
  return cJSON_IsNumber(v) ? v->valuedouble : dflt;
}
static const char *str(const cJSON *o, const char *k) {
  const cJSON *v = get(o, k);
  return cJSON_IsString(v) ? v->valuestring : "";
}
static bool is_device(const cJSON *e) {
  const char *c = str(e, "cat");
  return strcmp(str(e, "ph"), "X") == 0 &&
         (!strcmp(c, "kernel") || !strcmp(c, "memset") || !strcmp(c, "memcpy"));
}

#define STEPS 4

/* Traces STEPS steps of the model in mode after two untraced ones, and checks the file against
 * what kiln_stats counted. */
static void every_launch_once(bool cnn, int mode) {
  static const char *const modes[3] = {"unfused", "fused", "graph"};
  TH_GPU_CTX(ctx);
  set_mode(ctx, mode);
  model m;
  model_init(&m, ctx, cnn);
  for (int s = 0; s < 2; s++) { /* compiles, and the graph's capture */
    kiln_step_begin(ctx);
    model_step(&m);
    cr_assert_eq(kiln_step_end(ctx), KILN_OK, "%s", th_err(ctx));
  }
  cr_assert_eq(kiln_sync(ctx), KILN_OK);
  char dir[256], path[512];
  th_tmpdir(dir, sizeof dir, "gputrace");
  snprintf(path, sizeof path, "%s/t.json", dir);
  cr_assert_eq(kiln_trace_begin(ctx, path), KILN_OK, "%s", th_err(ctx));
  uint64_t launched[STEPS];
  int64_t step[STEPS];
  for (int s = 0; s < STEPS; s++) {
    kiln_exec_stats a, b;
    kiln_stats(ctx, &a);
    kiln_step_begin(ctx);
    step[s] = (int64_t)ctx->gen - 2;
    model_step(&m);
    cr_assert_eq(kiln_step_end(ctx), KILN_OK, "%s", th_err(ctx));
    cr_assert_eq(kiln_sync(ctx), KILN_OK);
    kiln_stats(ctx, &b);
    launched[s] = b.kernels_launched - a.kernels_launched;
  }
  cr_assert_eq(kiln_trace_end(ctx), KILN_OK, "%s", th_err(ctx));
  cJSON *doc = parse(path);
  const cJSON *evs = get(doc, "traceEvents"), *other = get(doc, "otherData"), *e;
  cr_assert_eq(num(other, "unattributed", -1), 0,
               "device records of kiln's launches not given to "
               "a group");
  cr_assert_eq(num(other, "dropped_records", -1), 0);
  cr_assert_str_eq(str(other, "mode"), modes[mode]);
  for (int s = 0; s < STEPS; s++) {
    /* the launches of the step: an eager launch's id, or a replay's id and the group */
    uint64_t keys[4096];
    int nk = 0, replays = 0;
    double t0 = -1, t1 = -1;
    cJSON_ArrayForEach(e, evs) {
      const cJSON *args = get(e, "args");
      if (strcmp(str(e, "ph"), "X") == 0 && !strcmp(str(e, "cat"), "step") &&
          num(args, "step", -9) == step[s]) {
        t0 = num(e, "ts", 0);
        t1 = t0 + num(e, "dur", 0);
      }
      if (!is_device(e) || num(args, "step", -9) != step[s] || !get(args, "launch")) continue;
      const char *launch = str(args, "launch");
      cr_assert(get(args, "group"), "a record of kiln's launch without its group: %s",
                str(e, "name"));
      cr_assert_null(get(args, "graph_mismatch"), "%s", str(args, "graph_mismatch"));
      cr_assert_str_eq(str(args, "mode"), modes[mode]);
      if (mode == 2) cr_assert_str_eq(launch, "graph replay", "step %lld", (long long)step[s]);
      replays += strcmp(launch, "graph replay") == 0;
      uint64_t key = (uint64_t)num(args, "launch_id", 0) * 100000 + (uint64_t)num(args, "group", 0);
      bool seen = false;
      for (int k = 0; k < nk && !seen; k++)
        seen = keys[k] == key;
      if (!seen) {
        cr_assert_lt(nk, 4096);
        keys[nk++] = key;
      }
      /* kiln's names: a generated kernel's is its own, a library call's names the call */
      const char *kind = str(args, "kind");
      if (!strcmp(str(e, "cat"), "kernel")) {
        if (!strcmp(kind, "gemm"))
          cr_assert(!strncmp(str(e, "name"), "cublas", 6), "%s", str(e, "name"));
        else
          cr_assert(!strncmp(str(e, "name"), "k_", 2) && !get(args, "kernel"), "%s (kernel %s)",
                    str(e, "name"), str(args, "kernel"));
      }
    }
    cr_assert_eq((uint64_t)nk, launched[s],
                 "%s %s step %lld: %d launches in the trace, kiln_stats counted %llu",
                 cnn ? "cnn" : "mlp", modes[mode], (long long)step[s], nk,
                 (unsigned long long)launched[s]);
    cr_assert(t0 >= 0, "no span for step %lld", (long long)step[s]);
    cJSON_ArrayForEach(e, evs) {
      if (is_device(e) && num(get(e, "args"), "step", -9) == step[s])
        cr_assert(num(e, "ts", 0) >= t0 && num(e, "ts", 0) + num(e, "dur", 0) <= t1 + 1e-3,
                  "%s outside its step's span", str(e, "name"));
    }
    (void)replays;
  }
  cJSON_Delete(doc);
  model_free(&m);
  th_ctx_free(ctx);
}

Test(gpu_trace, mlp_unfused_every_launch_once) { every_launch_once(false, 0); }
Test(gpu_trace, mlp_fused_every_launch_once) { every_launch_once(false, 1); }
Test(gpu_trace, mlp_graph_every_launch_once) { every_launch_once(false, 2); }
Test(gpu_trace, cnn_unfused_every_launch_once) { every_launch_once(true, 0); }
Test(gpu_trace, cnn_fused_every_launch_once) { every_launch_once(true, 1); }
Test(gpu_trace, cnn_graph_every_launch_once) { every_launch_once(true, 2); }

/* The losses and parameters of 6 steps, traced or not. */
static float *run(bool cnn, int mode, bool traced, const char *path, int64_t *n, float *losses) {
  TH_GPU_CTX(ctx);
  set_mode(ctx, mode);
  model m;
  model_init(&m, ctx, cnn);
  if (traced) cr_assert_eq(kiln_trace_begin(ctx, path), KILN_OK, "%s", th_err(ctx));
  for (int s = 0; s < 6; s++) {
    kiln_step_begin(ctx);
    kiln_tensor *loss = model_step(&m);
    cr_assert_eq(kiln_step_end(ctx), KILN_OK, "%s", th_err(ctx));
    losses[s] = kiln_tensor_item(loss);
  }
  if (traced) cr_assert_eq(kiln_trace_end(ctx), KILN_OK, "%s", th_err(ctx));
  float *v = th_params_values(model_params(&m), n);
  model_free(&m);
  th_ctx_free(ctx);
  return v;
}

static void bitwise(bool cnn, int mode) {
  char dir[256], path[512];
  th_tmpdir(dir, sizeof dir, "gputrace");
  snprintf(path, sizeof path, "%s/t.json", dir);
  float la[6], lb[6];
  int64_t na, nb;
  float *a = run(cnn, mode, false, path, &na, la), *b = run(cnn, mode, true, path, &nb, lb);
  cr_assert_eq(na, nb);
  cr_assert(memcmp(la, lb, sizeof la) == 0, "traced losses differ");
  cr_assert(memcmp(a, b, (size_t)na * sizeof *a) == 0, "traced parameters differ");
  free(a);
  free(b);
}

Test(gpu_trace, a_traced_run_is_bitwise_an_untraced_one) {
  for (int mode = 0; mode < 3; mode++) {
    bitwise(false, mode);
    bitwise(true, mode);
  }
}

Test(gpu_trace, a_long_trace_keeps_its_last_steps) {
  setenv("KILN_TRACE_STEPS", "3", 1);
  TH_GPU_CTX(ctx);
  model m;
  model_init(&m, ctx, false);
  char dir[256], path[512];
  th_tmpdir(dir, sizeof dir, "gputrace");
  snprintf(path, sizeof path, "%s/t.json", dir);
  cr_assert_eq(kiln_trace_begin(ctx, path), KILN_OK, "%s", th_err(ctx));
  for (int s = 0; s < 50; s++) {
    kiln_step_begin(ctx);
    model_step(&m);
    cr_assert_eq(kiln_step_end(ctx), KILN_OK, "%s", th_err(ctx));
  }
  cr_assert_eq(kiln_trace_end(ctx), KILN_OK, "%s", th_err(ctx));
  unsetenv("KILN_TRACE_STEPS");
  cJSON *doc = parse(path);
  const cJSON *e;
  bool steps[50] = {false};
  cJSON_ArrayForEach(e, get(doc, "traceEvents")) {
    if (!is_device(e)) continue;
    int s = (int)num(get(e, "args"), "step", -9);
    cr_assert(s >= 47 && s <= 49, "step %d kept", s);
    steps[s] = true;
  }
  cr_assert(steps[47] && steps[48] && steps[49]);
  cr_assert_eq(num(get(doc, "otherData"), "first_step", -9), 47);
  cJSON_Delete(doc);
  model_free(&m);
  th_ctx_free(ctx);
}

Test(gpu_trace, kiln_trace_traces_a_context_from_new_to_free) {
  char dir[256], path[512];
  th_tmpdir(dir, sizeof dir, "gputrace");
  snprintf(path, sizeof path, "%s/env.json", dir);
  setenv("KILN_TRACE", path, 1);
  TH_GPU_CTX(ctx);
  unsetenv("KILN_TRACE");
  cr_assert_not_null(ctx->prof, "KILN_TRACE began no trace");
  model m;
  model_init(&m, ctx, false);
  for (int s = 0; s < 3; s++) {
    kiln_step_begin(ctx);
    model_step(&m);
    cr_assert_eq(kiln_step_end(ctx), KILN_OK, "%s", th_err(ctx));
  }
  model_free(&m);
  th_ctx_free(ctx); /* writes the file */
  cJSON *doc = parse(path);
  int kernels[3] = {0}, before = 0;
  const cJSON *e;
  cJSON_ArrayForEach(e, get(doc, "traceEvents")) {
    if (!is_device(e)) continue;
    int s = (int)num(get(e, "args"), "step", -9);
    if (s < 0)
      before++; /* the model's uploads */
    else if (s < 3 && !strcmp(str(e, "cat"), "kernel"))
      kernels[s]++;
  }
  cr_assert(before > 0 && kernels[0] > 0 && kernels[1] > 0 && kernels[2] > 0,
            "uploads %d, kernels %d %d %d", before, kernels[0], kernels[1], kernels[2]);
  cJSON_Delete(doc);
}

Test(gpu_trace, one_context_is_traced_at_a_time) {
  TH_GPU_CTX(a);
  kiln_ctx *b = kiln_ctx_new(NULL);
  char dir[256], pa[512], pb[512];
  th_tmpdir(dir, sizeof dir, "gputrace");
  snprintf(pa, sizeof pa, "%s/a.json", dir);
  snprintf(pb, sizeof pb, "%s/b.json", dir);
  cr_assert_eq(kiln_trace_begin(a, pa), KILN_OK, "%s", th_err(a));
  cr_assert_eq(kiln_trace_begin(a, pa), KILN_ERR_STATE, "a context traced twice");
  kiln_ctx_clear_error(a);
  cr_assert_eq(kiln_trace_begin(b, pb), KILN_ERR_STATE);
  cr_assert(strstr(kiln_ctx_error(b), "another context"), "%s", kiln_ctx_error(b));
  kiln_ctx_clear_error(b);
  cr_assert_eq(kiln_trace_end(a), KILN_OK, "%s", th_err(a));
  cr_assert_eq(kiln_trace_begin(b, pb), KILN_OK, "%s", th_err(b));
  cr_assert_eq(kiln_trace_end(b), KILN_OK, "%s", th_err(b));
  cJSON_Delete(parse(pa));
  cJSON_Delete(parse(pb));
  th_ctx_free(b);
  th_ctx_free(a);
}
