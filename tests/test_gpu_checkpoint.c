/*
 * test_gpu_checkpoint.c: parameters and checkpoints through safetensors on the GPU: round trips
 * for f32 and bf16 over every rank, loads that must change nothing (wrong names, shapes, dtypes,
 * damaged files), bitwise resume of training, a checkpoint's weights loaded without an optimizer
 * (and non-strictly into a larger model), and a round trip through PyTorch.
 */
#define _GNU_SOURCE /* memmem */
#include <math.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "helpers.h"

/* A parameter list with one tensor of each rank 0..6, element i = i * 0.25 - 3. */
static kiln_params *ranked(kiln_ctx *ctx) {
  kiln_params *p = kiln_params_new(ctx);
  for (int r = 0; r <= 6; r++) {
    kiln_shape s = {.ndim = r};
    for (int d = 0; d < r; d++)
      s.d[d] = 2 + (r + d) % 3;
    int64_t n = 1;
    for (int d = 0; d < r; d++)
      n *= s.d[d];
    float *h = malloc((size_t)n * sizeof *h);
    for (int64_t i = 0; i < n; i++)
      h[i] = (float)i * 0.25f - 3.f;
    kiln_tensor *t = kiln_tensor_from_host(ctx, KILN_DTYPE_F32, s, h);
    free(h);
    char name[32];
    snprintf(name, sizeof name, "layer%d.weight", r);
    cr_assert_eq(kiln_params_add(p, name, t), KILN_OK, "%s", kiln_ctx_error(ctx));
  }
  return p;
}

static void scramble(kiln_params *p) {
  for (int i = 0; i < kiln_params_count(p); i++) {
    kiln_tensor *t = kiln_params_get(p, i);
    int64_t n = kiln_tensor_numel(t);
    float *h = malloc((size_t)n * sizeof *h);
    th_fill(h, n, 99 + i, -5.f, 5.f);
    cr_assert_eq(kiln_tensor_copy_from_host(t, h, (size_t)n * sizeof *h), KILN_OK);
    free(h);
  }
}

Test(gpu_checkpoint, params_round_trip_f32_and_bf16_every_rank) {
  TH_GPU_CTX(ctx);
  char dir[64], path[128];
  th_tmpdir(dir, sizeof dir, "ckpt");
  kiln_params *p = ranked(ctx);
  int64_t n;
  float *orig = th_params_values(p, &n);
  for (int bf = 0; bf < 2; bf++) {
    snprintf(path, sizeof path, "%s/p%d.safetensors", dir, bf);
    cr_assert_eq(kiln_params_save(p, path, bf ? KILN_DTYPE_BF16 : KILN_DTYPE_F32), KILN_OK, "%s",
                 kiln_ctx_error(ctx));
    kiln_params *q = ranked(ctx);
    scramble(q);
    cr_assert_eq(kiln_params_load(q, path), KILN_OK, "%s", kiln_ctx_error(ctx));
    int64_t m;
    float *got = th_params_values(q, &m);
    cr_assert_eq(m, n);
    /* the values i/4 - 3 are exact in bf16 up to 8 significant bits: small ones round-trip */
    for (int64_t i = 0; i < n; i++) {
      double tol = bf ? fabs(orig[i]) / 128.0 : 0.0;
      cr_assert(fabs(got[i] - orig[i]) <= tol, "%s element %lld: %g vs %g", bf ? "bf16" : "f32",
                (long long)i, got[i], orig[i]);
    }
    free(got);
    kiln_params_free(q);
    unlink(path);
  }
  free(orig);
  kiln_params_free(p);
  rmdir(dir);
  th_ctx_free(ctx);
}

/* A load that must fail with a message containing want and change nothing. */
static void load_refused(kiln_ctx *ctx, kiln_params *q, const char *path, const char *want) {
  int64_t n;
  float *before = th_params_values(q, &n);
  kiln_status s = kiln_params_load(q, path);
  cr_assert_neq(s, KILN_OK, "loaded a file that should be refused (%s)", want);
  cr_assert(strstr(kiln_ctx_error(ctx), want) != NULL, "message '%s' lacks '%s'",
            kiln_ctx_error(ctx), want);
  kiln_ctx_clear_error(ctx);
  float *after = th_params_values(q, &n);
  cr_assert_eq(memcmp(before, after, (size_t)n * sizeof *before), 0,
               "a refused load changed values");
  free(before);
  free(after);
}

Test(gpu_checkpoint, mismatched_or_damaged_files_load_nothing) {
  TH_GPU_CTX(ctx);
  char dir[64], path[128], bad[160];
  th_tmpdir(dir, sizeof dir, "ckpt");
  snprintf(path, sizeof path, "%s/p.safetensors", dir);
  kiln_params *p = ranked(ctx);
  cr_assert_eq(kiln_params_save(p, path, KILN_DTYPE_F32), KILN_OK);
  /* wrong shape: a model whose layer3 differs */
  kiln_params *q = kiln_params_new(ctx);
  for (int i = 0; i < kiln_params_count(p); i++) {
    kiln_shape s = kiln_tensor_shape(kiln_params_get(p, i));
    if (i == 3) s.d[0] += 1;
    kiln_params_add(q, kiln_params_name(p, i), th_rand(ctx, s, 5 + i, -1.f, 1.f, NULL));
  }
  load_refused(ctx, q, path, "tensor 'layer3.weight' is [2,3,4] in the file, [3,3,4] in the model");
  kiln_params_free(q);
  /* a model with one more parameter: missing in the file */
  q = ranked(ctx);
  kiln_params_add(q, "extra.bias", th_rand(ctx, KILN_SHAPE(4), 3, -1.f, 1.f, NULL));
  load_refused(ctx, q, path, "has no tensor 'extra.bias'");
  kiln_params_free(q);
  /* a model with one parameter fewer: the file has a tensor it lacks */
  q = kiln_params_new(ctx);
  for (int i = 0; i < 6; i++)
    kiln_params_add(q, kiln_params_name(p, i),
                    th_rand(ctx, kiln_tensor_shape(kiln_params_get(p, i)), i, -1.f, 1.f, NULL));
  load_refused(ctx, q, path, "has tensor 'layer6.weight', which the model lacks");
  kiln_params_free(q);
  /* damaged copies of the good file */
  uint8_t *buf;
  size_t len;
  FILE *f = fopen(path, "rb");
  fseek(f, 0, SEEK_END);
  len = (size_t)ftell(f);
  fseek(f, 0, SEEK_SET);
  buf = malloc(len);
  cr_assert_eq(fread(buf, 1, len, f), len);
  fclose(f);
  q = ranked(ctx);
  scramble(q);
  snprintf(bad, sizeof bad, "%s/truncated.safetensors", dir);
  f = fopen(bad, "wb");
  fwrite(buf, 1, len - 10, f);
  fclose(f);
  load_refused(ctx, q, bad, "truncated");
  snprintf(bad, sizeof bad, "%s/i32.safetensors", dir);
  char *dt = memmem(buf, len, "\"F32\"", 5);
  cr_assert_not_null(dt);
  memcpy(dt, "\"I32\"", 5);
  f = fopen(bad, "wb");
  fwrite(buf, 1, len, f);
  fclose(f);
  load_refused(ctx, q, bad, "parameters load from f32 or bf16");
  load_refused(ctx, q, "/nonexistent/p.safetensors", "cannot open");
  kiln_params_free(q);
  free(buf);
  kiln_params_free(p);
  char cmd[200];
  snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
  cr_assert_eq(system(cmd), 0);
  th_ctx_free(ctx);
}

/* A small classifier with dropout, trained on fixed random data; returns each step's loss. */
typedef struct run {
  kiln_params *p;
  kiln_linear l1, l2;
  kiln_optim *o;
  kiln_tensor *x, *y;
} run;

static void run_init(kiln_ctx *ctx, run *r, int adam) {
  kiln_manual_seed(ctx, 17);
  r->p = kiln_params_new(ctx);
  kiln_linear_init(&r->l1, r->p, &(kiln_linear_options){.name = "fc1", .in = 30, .out = 24});
  kiln_linear_init(&r->l2, r->p, &(kiln_linear_options){.name = "fc2", .in = 24, .out = 6});
  if (adam) {
    kiln_adam_options a = kiln_adamw_defaults();
    a.lr = 0.01f;
    r->o = kiln_adamw_new(r->p, &a);
  } else {
    kiln_sgd_options s = kiln_sgd_defaults(0.05f);
    s.momentum = 0.9f;
    s.nesterov = 1;
    r->o = kiln_sgd_new(r->p, &s);
  }
  r->x = th_rand(ctx, KILN_SHAPE(16, 30), 7, -1.f, 1.f, NULL);
  int32_t lab[16];
  for (int i = 0; i < 16; i++)
    lab[i] = (i * 5) % 6;
  r->y = kiln_tensor_from_host(ctx, KILN_DTYPE_I32, KILN_SHAPE(16), lab);
  th_assert_ok(ctx);
}

static float run_step(kiln_ctx *ctx, run *r, int step) {
  kiln_optim_set_lr(r->o, kiln_optim_lr(r->o) * 0.97f); /* a schedule the checkpoint must keep */
  kiln_step_begin(ctx);
  kiln_tensor *h = kiln_dropout(kiln_relu(kiln_linear_forward(&r->l1, r->x)), 0.25f, 1);
  kiln_tensor *loss =
      kiln_cross_entropy(kiln_linear_forward(&r->l2, h), r->y, KILN_REDUCTION_MEAN, 0.05f);
  kiln_optim_zero_grad(r->o);
  kiln_backward(loss);
  kiln_optim_step(r->o);
  cr_assert_eq(kiln_step_end(ctx), KILN_OK, "step %d: %s", step, kiln_ctx_error(ctx));
  return kiln_tensor_item(loss);
}

static void run_free(run *r) {
  kiln_optim_free(r->o);
  kiln_params_free(r->p);
  kiln_tensor_free(r->x);
  kiln_tensor_free(r->y);
}

static void check_resume(int adam) {
  TH_GPU_CTX(ctx);
  char dir[64], path[128];
  th_tmpdir(dir, sizeof dir, "ckpt");
  snprintf(path, sizeof path, "%s/ckpt.safetensors", dir);
  run a;
  run_init(ctx, &a, adam);
  float la[30];
  kiln_meta *meta = kiln_meta_new();
  for (int s = 0; s < 30; s++) {
    la[s] = run_step(ctx, &a, s);
    if (s == 11) {
      kiln_meta_set(meta, "step", "12");
      cr_assert_eq(kiln_checkpoint_save(path, a.p, a.o, meta), KILN_OK, "%s", kiln_ctx_error(ctx));
    }
  }
  int64_t n;
  float *pa = th_params_values(a.p, &n);
  run_free(&a);
  /* a fresh model and optimizer, other RNG state, then the checkpoint */
  run b;
  run_init(ctx, &b, adam);
  kiln_manual_seed(ctx, 12345);
  kiln_meta *got = kiln_meta_new();
  cr_assert_eq(kiln_checkpoint_load(path, b.p, b.o, got), KILN_OK, "%s", kiln_ctx_error(ctx));
  cr_assert_str_eq(kiln_meta_get(got, "step"), "12");
  cr_assert_null(kiln_meta_get(got, "kiln.format"), "kiln's own keys are not the caller's");
  cr_assert_eq(kiln_optim_steps(b.o), 12);
  for (int s = 12; s < 30; s++) {
    float l = run_step(ctx, &b, s);
    cr_assert_eq(memcmp(&l, &la[s], sizeof l), 0, "step %d: resumed loss %.9g, uninterrupted %.9g",
                 s, l, la[s]);
  }
  float *pb = th_params_values(b.p, &n);
  cr_assert_eq(memcmp(pa, pb, (size_t)n * sizeof *pa), 0, "parameters differ after the resume");
  /* the checkpoint refuses another optimizer */
  run c;
  run_init(ctx, &c, !adam);
  cr_assert_neq(kiln_checkpoint_load(path, c.p, c.o, NULL), KILN_OK);
  cr_assert(strstr(kiln_ctx_error(ctx), "optimizer state") != NULL, "%s", kiln_ctx_error(ctx));
  kiln_ctx_clear_error(ctx);
  run_free(&c);
  /* the checkpoint's weights, without an optimizer: kiln_params_load, and kiln_checkpoint_load
   * with a NULL one; then non-strict into a model with one more parameter, which keeps its own */
  int64_t nc;
  float *at12;
  {
    run w;
    run_init(ctx, &w, adam);
    kiln_checkpoint_load(path, w.p, w.o, NULL);
    at12 = th_params_values(w.p, &nc);
    run_free(&w);
  }
  for (int how = 0; how < 3; how++) {
    kiln_manual_seed(ctx, 99); /* other initial values than the checkpoint's */
    kiln_params *q = kiln_params_new(ctx);
    kiln_linear l1, l2;
    kiln_linear_init(&l1, q, &(kiln_linear_options){.name = "fc1", .in = 30, .out = 24});
    kiln_linear_init(&l2, q, &(kiln_linear_options){.name = "fc2", .in = 24, .out = 6});
    float extra_h[3] = {0.5f, -1.5f, 2.5f};
    if (how == 2)
      cr_assert_eq(
          kiln_params_add(q, "extra",
                          kiln_tensor_from_host(ctx, KILN_DTYPE_F32, KILN_SHAPE(3), extra_h)),
          KILN_OK);
    kiln_load_options lo = {.non_strict = 1};
    kiln_status st = how == 0   ? kiln_params_load(q, path)
                     : how == 1 ? kiln_checkpoint_load(path, q, NULL, NULL)
                                : kiln_params_load_with(q, path, &lo);
    cr_assert_eq(st, KILN_OK, "load %d: %s", how, kiln_ctx_error(ctx));
    int64_t nd;
    float *pd = th_params_values(q, &nd);
    cr_assert_eq(nd, nc + (how == 2 ? 3 : 0));
    cr_assert_eq(memcmp(pd, at12, (size_t)nc * sizeof *pd), 0, "load %d: not the checkpoint's",
                 how);
    if (how == 2) {
      cr_assert(lo.missing == 1 && lo.unexpected == 0, "%d %d", lo.missing, lo.unexpected);
      cr_assert_eq(memcmp(pd + nc, extra_h, sizeof extra_h), 0, "the extra parameter changed");
    }
    free(pd);
    kiln_params_free(q);
  }
  free(at12);
  free(pa);
  free(pb);
  kiln_meta_free(meta);
  kiln_meta_free(got);
  run_free(&b);
  unlink(path);
  rmdir(dir);
  th_ctx_free(ctx);
}

Test(gpu_checkpoint, resume_is_bitwise_sgd) { check_resume(0); }
Test(gpu_checkpoint, resume_is_bitwise_adamw) { check_resume(1); }

Test(gpu_checkpoint, pytorch_reads_and_writes_our_files, .timeout = 300) {
  TH_GPU_CTX(ctx);
  char dir[64], a[128], b[128], cmd[600];
  th_tmpdir(dir, sizeof dir, "ckpt");
  snprintf(a, sizeof a, "%s/kiln.safetensors", dir);
  snprintf(b, sizeof b, "%s/torch.safetensors", dir);
  kiln_params *p = ranked(ctx);
  for (int bf = 0; bf < 2; bf++) {
    cr_assert_eq(kiln_params_save(p, a, bf ? KILN_DTYPE_BF16 : KILN_DTYPE_F32), KILN_OK);
    snprintf(cmd, sizeof cmd, "python3 '%s/tests/torch_roundtrip.py' '%s' '%s'", KILN_SOURCE_DIR, a,
             b);
    int rc = system(cmd);
    if (WEXITSTATUS(rc) == 2) cr_skip_test("PyTorch or safetensors is not installed");
    cr_assert_eq(rc, 0, "the PyTorch side failed (%s)", cmd);
    kiln_params *q = ranked(ctx);
    cr_assert_eq(kiln_params_load(q, b), KILN_OK, "%s", kiln_ctx_error(ctx));
    int64_t n;
    float *want = th_params_values(p, &n), *got = th_params_values(q, &n);
    for (int64_t i = 0; i < n; i++) {
      double tol = bf ? fabs(want[i]) / 64.0 : 0.0;
      cr_assert(fabs(got[i] - 2.0 * want[i]) <= tol, "element %lld: %g, want %g", (long long)i,
                got[i], 2.0 * want[i]);
    }
    free(want);
    free(got);
    kiln_params_free(q);
  }
  kiln_params_free(p);
  unlink(a);
  unlink(b);
  rmdir(dir);
  th_ctx_free(ctx);
}
