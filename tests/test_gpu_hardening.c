/*
 * test_gpu_hardening.c: the probes of issue 13 that need a GPU: out-of-range labels and row
 * indices found on the device (eager and in a replayed step graph), a failed checkpoint load and
 * a failed step that leave parameters and optimizer state bitwise as they were, out of memory in
 * an eager step after backward and the update, a cached cubin that checks out but does not load,
 * and a checkpoint of a parameter with a long name. Without a GPU every test skips, saying why.
 */
#include <math.h>
#include <string.h>
#include <unistd.h>

#include "inspect.h"
#include "optim/optim.h"

TestSuite(gpu_hardening, .fini = th_remove_tmpdirs);

/* A 200 GB intermediate: more than the device holds. */
#define HUGE_ROWS ((int64_t)1 << 26)
#define HUGE_COLS ((int64_t)800)

/* A two-layer MLP 6 -> 5 -> 3 on a batch of 8, Adam. */
typedef struct net {
  kiln_params *p;
  kiln_linear l1, l2;
  kiln_optim *o;
  kiln_tensor *x, *y;
} net;

static void net_init(kiln_ctx *ctx, net *m, const char *name1) {
  kiln_manual_seed(ctx, 11);
  m->p = kiln_params_new(ctx);
  cr_assert_eq(
      kiln_linear_init(&m->l1, m->p, &(kiln_linear_options){.name = name1, .in = 6, .out = 5}),
      KILN_OK, "%s", th_err(ctx));
  cr_assert_eq(
      kiln_linear_init(&m->l2, m->p, &(kiln_linear_options){.name = "l2", .in = 5, .out = 3}),
      KILN_OK, "%s", th_err(ctx));
  m->o = kiln_adam_new(m->p, NULL);
  m->x = th_rand(ctx, KILN_SHAPE(8, 6), 5, -1.f, 1.f, NULL);
  int32_t y[8] = {0, 1, 2, 0, 1, 2, 0, 1};
  m->y = kiln_tensor_from_host(ctx, KILN_DTYPE_I32, KILN_SHAPE(8), y);
  cr_assert(m->o && m->y, "%s", th_err(ctx));
}

/* One training step; returns kiln_step_end's status (and the loss through *loss). */
static kiln_status net_step(kiln_ctx *ctx, net *m, bool huge, kiln_tensor **loss) {
  kiln_step_begin(ctx);
  kiln_optim_zero_grad(m->o);
  kiln_tensor *h = kiln_relu(kiln_linear_forward(&m->l1, m->x));
  kiln_tensor *l = kiln_cross_entropy(kiln_linear_forward(&m->l2, h), m->y, KILN_REDUCTION_MEAN, 0);
  cr_assert_eq(kiln_backward(l), KILN_OK, "%s", th_err(ctx));
  cr_assert_eq(kiln_optim_step(m->o), KILN_OK, "%s", th_err(ctx));
  if (huge) /* after backward and the update: a value the device cannot hold */
    cr_assert_not_null(kiln_full(ctx, KILN_SHAPE(HUGE_ROWS, HUGE_COLS), 1.f));
  if (loss) *loss = l;
  return kiln_step_end(ctx);
}

static void net_free(net *m) {
  kiln_optim_free(m->o);
  kiln_params_free(m->p);
  kiln_tensor_free(m->x);
  kiln_tensor_free(m->y);
}

/* ---------------------------------------------------------------- 3. labels and indices */

static void check_bad_labels(bool graphs) {
  TH_GPU_CTX(ctx);
  kiln_set_graphs(ctx, graphs);
  kiln_tensor *logits = th_rand(ctx, KILN_SHAPE(4, 10), 3, -1.f, 1.f, NULL);
  int32_t good[4] = {1, 2, 3, 9}, bad[4] = {1, 10, 3, -1};
  kiln_tensor *labels = kiln_tensor_from_host(ctx, KILN_DTYPE_I32, KILN_SHAPE(4), good);
  for (int round = 0; round < 3; round++) { /* good, bad (replayed in graph mode), good */
    cr_assert_eq(kiln_tensor_copy_from_host(labels, round == 1 ? bad : good, sizeof good), KILN_OK);
    kiln_step_begin(ctx);
    kiln_tensor *loss = kiln_cross_entropy(logits, labels, KILN_REDUCTION_MEAN, 0.f);
    cr_assert_eq(kiln_step_end(ctx), KILN_OK, "%s", th_err(ctx)); /* nothing waits on the host */
    float v;
    kiln_status s = kiln_tensor_to_host(loss, &v, sizeof v);
    if (round == 1) {
      cr_assert_eq(s, KILN_ERR_INVALID,
                   "graphs %d: labels {1, 10, 3, -1} for 10 classes read as "
                   "a loss of %g",
                   graphs, v);
      TH_ASSERT_ERROR(ctx, KILN_ERR_INVALID, "kiln_cross_entropy", "[0, 10)");
      const char *e = kiln_ctx_error(ctx);
      cr_assert(strstr(e, "label is 10") || strstr(e, "label is -1"), "%s", e);
      kiln_ctx_clear_error(ctx);
    } else {
      cr_assert_eq(s, KILN_OK, "graphs %d, round %d: %s", graphs, round, th_err(ctx));
    }
  }
  kiln_exec_stats st;
  kiln_stats(ctx, &st);
  if (graphs) cr_assert_eq(st.graph_captures, 1u, "the bad labels ran in the replayed graph");
  kiln_tensor_free(logits);
  kiln_tensor_free(labels);
  th_ctx_free(ctx);
}

Test(gpu_hardening, labels_out_of_range_eager) { check_bad_labels(false); }
Test(gpu_hardening, labels_out_of_range_in_a_graph) { check_bad_labels(true); }

Test(gpu_hardening, row_indices_out_of_range) {
  TH_GPU_CTX_EAGER(ctx);
  kiln_tensor *table = th_rand(ctx, KILN_SHAPE(3, 4), 9, -1.f, 1.f, NULL);
  int32_t rows[2] = {5, -3};
  kiln_tensor *idx = kiln_tensor_from_host(ctx, KILN_DTYPE_I32, KILN_SHAPE(2), rows);
  kiln_tensor *g = kiln_index_select(table, idx);
  cr_assert_not_null(g);
  float out[8];
  cr_assert_eq(kiln_tensor_to_host(g, out, sizeof out), KILN_ERR_INVALID,
               "rows {5, -3} of a (3,4) table read without an error");
  TH_ASSERT_ERROR(ctx, KILN_ERR_INVALID, "kiln_index_select", "[0, 3)");
  kiln_ctx_clear_error(ctx);
  kiln_tensor_free(table);
  kiln_tensor_free(idx);
  th_ctx_free(ctx);
}

/* ---------------------------------------------------------------- 4, 5. nothing changes */

/* Every parameter and optimizer state tensor of m, read to the host. */
static float *state_of(net *m, int64_t *n) {
  float *p = th_params_values(m->p, n);
  int64_t k = *n;
  for (int i = 0; i < kiln_params_count(m->p); i++)
    for (int w = 0; w < 2; w++) {
      const char *name;
      kiln_tensor *t = kiln__optim_state(m->o, i, w, &name);
      float *h = th_read(t);
      int64_t c = kiln_tensor_numel(t);
      p = realloc(p, (size_t)(k + c) * sizeof *p);
      cr_assert_not_null(p);
      memcpy(p + k, h, (size_t)c * sizeof *h);
      free(h);
      k += c;
    }
  *n = k;
  return p;
}

static void assert_same_state(net *m, const float *before, int64_t n, const char *what) {
  int64_t k;
  float *now = state_of(m, &k);
  cr_assert_eq(k, n);
  cr_assert(memcmp(now, before, (size_t)n * sizeof *now) == 0, "%s changed the state", what);
  free(now);
}

Test(gpu_hardening, a_failed_checkpoint_load_changes_nothing) {
  TH_GPU_CTX(ctx);
  char dir[256], path[1200], bad[1200];
  th_tmpdir(dir, sizeof dir, "ckpt");
  snprintf(path, sizeof path, "%s/c.safetensors", dir);
  snprintf(bad, sizeof bad, "%s/bad.safetensors", dir);
  net m;
  net_init(ctx, &m, "l1");
  for (int s = 0; s < 3; s++)
    cr_assert_eq(net_step(ctx, &m, false, NULL), KILN_OK, "%s", th_err(ctx));
  cr_assert_eq(kiln_checkpoint_save(path, m.p, m.o, NULL), KILN_OK, "%s", th_err(ctx));
  /* the same file with the rate "nan" (the JSON keeps its length: spaces after the string) */
  size_t len;
  char *b = th_read_whole(path, &len);
  char *lr = strstr(b + 8, "\"kiln.optim.lr\":\"");
  cr_assert_not_null(lr);
  char *v = lr + strlen("\"kiln.optim.lr\":\""), *end = strchr(v, '"');
  cr_assert(end && end - v >= 3, "the rate is '%.*s'", (int)(end - v), v);
  size_t vl = (size_t)(end - v);
  memcpy(v, "nan\"", 4);
  memset(v + 4, ' ', vl - 3);
  th_write_whole(bad, b, len);
  free(b);
  /* two more steps, then the bad load: parameters, state, counts and seed stay as they were */
  for (int s = 0; s < 2; s++)
    cr_assert_eq(net_step(ctx, &m, false, NULL), KILN_OK, "%s", th_err(ctx));
  int64_t n;
  float *before = state_of(&m, &n);
  uint64_t seed = ctx->seed, off = ctx->philox_offset;
  cr_assert_eq(kiln_checkpoint_load(bad, m.p, m.o, NULL), KILN_ERR_FORMAT);
  TH_ASSERT_ERROR(ctx, KILN_ERR_FORMAT, "kiln.optim.lr", "nan");
  kiln_ctx_clear_error(ctx);
  assert_same_state(&m, before, n, "a failed checkpoint load");
  cr_assert_eq(kiln_optim_steps(m.o), 5, "the step count went %lld",
               (long long)kiln_optim_steps(m.o));
  cr_assert(ctx->seed == seed && ctx->philox_offset == off);
  /* and the good one still loads */
  cr_assert_eq(kiln_checkpoint_load(path, m.p, m.o, NULL), KILN_OK, "%s", th_err(ctx));
  cr_assert_eq(kiln_optim_steps(m.o), 3);
  free(before);
  unlink(path);
  unlink(bad);
  net_free(&m);
  th_ctx_free(ctx);
}

static void check_failed_step(bool graphs) {
  TH_GPU_CTX(ctx);
  kiln_set_graphs(ctx, graphs);
  net m;
  net_init(ctx, &m, "l1");
  for (int s = 0; s < 2; s++)
    cr_assert_eq(net_step(ctx, &m, false, NULL), KILN_OK, "%s", th_err(ctx));
  int64_t n;
  float *before = state_of(&m, &n);
  cr_assert_eq(net_step(ctx, &m, true, NULL), KILN_ERR_OOM, "graphs %d: %s", graphs, th_err(ctx));
  kiln_ctx_clear_error(ctx);
  cr_assert_eq(kiln_optim_steps(m.o), 2, "graphs %d: a failed step advanced the optimizer to %lld",
               graphs, (long long)kiln_optim_steps(m.o));
  for (int i = 0; i < kiln_params_count(m.p); i++)
    cr_assert_eq(kiln__optim_count(m.o, i), 2);
  assert_same_state(&m, before, n, "a failed step");
  /* the next step is the third, with the third step's bias correction */
  kiln_tensor *loss;
  cr_assert_eq(net_step(ctx, &m, false, &loss), KILN_OK, "%s", th_err(ctx));
  cr_assert_eq(kiln_optim_steps(m.o), 3);
  cr_assert(isfinite(kiln_tensor_item(loss)), "%s", th_err(ctx));
  free(before);
  net_free(&m);
  th_ctx_free(ctx); /* and teardown after an eager OOM frees only what it owns */
}

Test(gpu_hardening, a_failed_step_in_a_graph_changes_nothing) { check_failed_step(true); }
Test(gpu_hardening, out_of_memory_in_an_eager_step_changes_nothing) { check_failed_step(false); }

/* ---------------------------------------------------------------- 8. a bad cached cubin */

Test(gpu_hardening, a_cached_cubin_that_does_not_load_is_compiled_again) {
  char cache[256];
  th_tmpdir(cache, sizeof cache, "cache");
  cr_assert_eq(setenv("KILN_CACHE_DIR", cache, 1), 0);
  float h[5] = {1, -2, 3, -4, 5}, out[5];
  for (int round = 0; round < 2; round++) {
    TH_GPU_CTX_EAGER(ctx);
    kiln_tensor *x = kiln_tensor_from_host(ctx, KILN_DTYPE_F32, KILN_SHAPE(5), h);
    kiln_tensor *y = kiln_neg(x);
    cr_assert_eq(kiln_tensor_to_host(y, out, sizeof out), KILN_OK, "round %d: %s", round,
                 th_err(ctx));
    for (int i = 0; i < 5; i++)
      cr_assert_eq(out[i], -h[i]);
    kiln_exec_stats st;
    kiln_stats(ctx, &st);
    cr_assert_eq(st.kernels_compiled, 1u, "round %d", round);
    kiln_tensor_free(x);
    th_ctx_free(ctx);
    if (round == 1) break;
    /* garbage where the cubin was, its checksum made to match: it checks out, and fails to load */
    char files[2][1200];
    cr_assert_eq(th_list_files(cache, ".cubin", files, 2), 1);
    size_t len;
    char *b = th_read_whole(files[0], &len);
    const size_t header =
        40; /* compile.c's cache_header: magic, key, arch, nvrtc, size, checksum */
    cr_assert_gt(len, header);
    for (size_t i = header; i < len; i++)
      b[i] = (char)(i * 131 + 7);
    uint64_t sum = kiln__hash(b + header, len - header, 0);
    memcpy(b + header - 8, &sum, 8);
    th_write_whole(files[0], b, len);
    free(b);
  }
  unsetenv("KILN_CACHE_DIR");
}

/* ---------------------------------------------------------------- 13. long names */

Test(gpu_hardening, an_adam_checkpoint_of_a_long_parameter_name) {
  TH_GPU_CTX(ctx);
  char dir[256], path[1200], name[151];
  th_tmpdir(dir, sizeof dir, "ckpt");
  snprintf(path, sizeof path, "%s/c.safetensors", dir);
  memset(name, 'w', 150);
  name[150] = 0;
  net m;
  net_init(ctx, &m, name);
  cr_assert_eq(net_step(ctx, &m, false, NULL), KILN_OK, "%s", th_err(ctx));
  cr_assert_eq(kiln_checkpoint_save(path, m.p, m.o, NULL), KILN_OK, "%s", th_err(ctx));
  int64_t n;
  float *saved = state_of(&m, &n);
  cr_assert_eq(net_step(ctx, &m, false, NULL), KILN_OK, "%s", th_err(ctx));
  cr_assert_eq(kiln_checkpoint_load(path, m.p, m.o, NULL), KILN_OK, "%s", th_err(ctx));
  assert_same_state(&m, saved, n, "nothing: the load");
  free(saved);
  unlink(path);
  net_free(&m);
  th_ctx_free(ctx);
}
