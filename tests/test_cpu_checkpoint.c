/*
 * test_cpu_checkpoint.c: which files a parameter list loads, without a GPU (a no-GPU context
 * checks every name, shape and dtype and drops the copies; test_gpu_checkpoint.c checks values).
 * Strict loads refuse a missing or an extra tensor, naming it; non-strict ones (torch's
 * strict=False) pass both over and count them, but still refuse a shape that differs. A training
 * checkpoint's weights load without an optimizer, through kiln_params_load and through
 * kiln_checkpoint_load with a NULL optimizer, its optimizer state passed over; a plain file with
 * such a tensor is still refused.
 */
#include <string.h>
#include <unistd.h>

#include "helpers.h"
#include "inspect.h"
#include "io/safetensors.h"
#include "optim/optim.h"

TestSuite(checkpoint_names, .fini = th_remove_tmpdirs);

/* Writes the tensors named in names (each f32 of shape {2, 3}, "b" of shape {4}) to path, as a
 * training checkpoint when ckpt. */
static void write_file(kiln_ctx *ctx, const char *path, const char *const *names, int n,
                       bool ckpt) {
  static const float data[6] = {1, 2, 3, 4, 5, 6};
  static const int64_t mat[2] = {2, 3}, vec[1] = {4};
  kiln__st_out t[8];
  for (int i = 0; i < n; i++) {
    bool b = strcmp(names[i], "b") == 0;
    t[i] = (kiln__st_out){.name = names[i],
                          .dtype = KILN_DTYPE_F32,
                          .ndim = b ? 1 : 2,
                          .shape = b ? vec : mat,
                          .data = data};
  }
  cJSON *meta = cJSON_CreateObject();
  if (ckpt) {
    cJSON_AddStringToObject(meta, "kiln.format", KILN__CKPT_FORMAT);
    cJSON_AddStringToObject(meta, "kiln.rng.seed", "7");
    cJSON_AddStringToObject(meta, "kiln.rng.philox_offset", "3");
    cJSON_AddStringToObject(meta, "kiln.rng.host", "11");
    cJSON_AddStringToObject(meta, "kiln.optim", "sgd");
    cJSON_AddStringToObject(meta, "epoch", "4");
  }
  cr_assert_eq(kiln__st_write(ctx, "test", path, n, t, meta), KILN_OK, "%s", th_err(ctx));
  cJSON_Delete(meta);
}

/* A parameter list of "a" (2, 3), "b" (4) and, when with_c, "c" (2, 3). */
static kiln_params *model(kiln_ctx *ctx, bool with_c) {
  kiln_params *p = kiln_params_new(ctx);
  cr_assert_eq(kiln_params_add(p, "a", th_new(ctx, KILN_DTYPE_F32, KILN_SHAPE(2, 3))), KILN_OK);
  cr_assert_eq(kiln_params_add(p, "b", th_new(ctx, KILN_DTYPE_F32, KILN_SHAPE(4))), KILN_OK);
  if (with_c)
    cr_assert_eq(kiln_params_add(p, "c", th_new(ctx, KILN_DTYPE_F32, KILN_SHAPE(2, 3))), KILN_OK);
  return p;
}

Test(checkpoint_names, strict_loads_refuse_and_non_strict_ones_count) {
  char dir[256], path[512];
  th_tmpdir(dir, sizeof dir, "ckpt-names");
  snprintf(path, sizeof path, "%s/w.safetensors", dir);
  kiln_ctx *ctx = th_cpu_ctx();
  write_file(ctx, path, (const char *const[]){"a", "b"}, 2, false);
  /* the model has c, the file not */
  kiln_params *p = model(ctx, true);
  cr_assert_eq(kiln_params_load(p, path), KILN_ERR_FORMAT);
  cr_assert(strstr(th_err(ctx), "no tensor 'c'"), "%s", th_err(ctx));
  kiln_ctx_clear_error(ctx);
  kiln_load_options o = {.non_strict = 1, .missing = -1, .unexpected = -1};
  cr_assert_eq(kiln_params_load_with(p, path, &o), KILN_OK, "%s", th_err(ctx));
  cr_assert(o.missing == 1 && o.unexpected == 0, "missing %d, unexpected %d", o.missing,
            o.unexpected);
  o = (kiln_load_options){0}; /* strict, as kiln_params_load */
  cr_assert_eq(kiln_params_load_with(p, path, &o), KILN_ERR_FORMAT);
  kiln_ctx_clear_error(ctx);
  kiln_params_free(p);
  /* the file has z, the model not */
  write_file(ctx, path, (const char *const[]){"a", "b", "z"}, 3, false);
  p = model(ctx, false);
  cr_assert_eq(kiln_params_load(p, path), KILN_ERR_FORMAT);
  cr_assert(strstr(th_err(ctx), "'z', which the model lacks") && strstr(th_err(ctx), "non-strict"),
            "%s", th_err(ctx));
  kiln_ctx_clear_error(ctx);
  o = (kiln_load_options){.non_strict = 1};
  cr_assert_eq(kiln_params_load_with(p, path, &o), KILN_OK, "%s", th_err(ctx));
  cr_assert(o.missing == 0 && o.unexpected == 1, "missing %d, unexpected %d", o.missing,
            o.unexpected);
  kiln_params_free(p);
  /* a shape that differs is an error either way */
  write_file(ctx, path, (const char *const[]){"b", "a"}, 2, false);
  p = kiln_params_new(ctx);
  cr_assert_eq(kiln_params_add(p, "a", th_new(ctx, KILN_DTYPE_F32, KILN_SHAPE(3, 2))), KILN_OK);
  o = (kiln_load_options){.non_strict = 1, .missing = -1};
  cr_assert_eq(kiln_params_load_with(p, path, &o), KILN_ERR_FORMAT);
  cr_assert(strstr(th_err(ctx), "'a' is [2,3] in the file, [3,2] in the model"), "%s", th_err(ctx));
  cr_assert_eq(o.missing, -1, "a failed load sets nothing");
  kiln_ctx_clear_error(ctx);
  kiln_params_free(p);
  th_ctx_free(ctx);
}

Test(checkpoint_names, a_training_checkpoint_loads_its_weights_without_an_optimizer) {
  char dir[256], path[512];
  th_tmpdir(dir, sizeof dir, "ckpt-weights");
  snprintf(path, sizeof path, "%s/c.safetensors", dir);
  kiln_ctx *ctx = th_cpu_ctx();
  const char *const names[] = {"a", "b", "optim/a/momentum"};
  write_file(ctx, path, names, 3, true);
  kiln_params *p = model(ctx, false);
  cr_assert_eq(kiln_params_load(p, path), KILN_OK, "%s", th_err(ctx));
  kiln_meta *meta = kiln_meta_new();
  cr_assert_eq(kiln_checkpoint_load(path, p, NULL, meta), KILN_OK, "%s", th_err(ctx));
  cr_assert_str_eq(kiln_meta_get(meta, "epoch"), "4");
  kiln_meta_free(meta);
  /* non-strict into a larger model: its own tensor stays, the optimizer state is passed over */
  kiln_params *q = model(ctx, true);
  kiln_load_options lo = {.non_strict = 1};
  cr_assert_eq(kiln_params_load_with(q, path, &lo), KILN_OK, "%s", th_err(ctx));
  cr_assert(lo.missing == 1 && lo.unexpected == 0, "missing %d, unexpected %d", lo.missing,
            lo.unexpected);
  kiln_params_free(q);
  /* the same tensor in a plain parameter file is an extra one */
  write_file(ctx, path, names, 3, false);
  cr_assert_eq(kiln_params_load(p, path), KILN_ERR_FORMAT);
  cr_assert(strstr(th_err(ctx), "'optim/a/momentum', which the model lacks"), "%s", th_err(ctx));
  kiln_ctx_clear_error(ctx);
  kiln_params_free(p);
  th_ctx_free(ctx);
}

/* Writes a checkpoint of model(ctx, false) with two optimizers' state, as
 * kiln_checkpoint_save_optims lays it out: SGD with momentum for "b" (optimizer 0), Muon for "a"
 * (optimizer 1). bad 1 leaves kiln.optims out (the file then holds one optimizer's), bad 2 gives
 * "a" more Muon updates than Muon's steps, bad 3 says kiln.optims is 1 (never written: 2 or more).
 */
static void write_two(kiln_ctx *ctx, const char *path, int bad) {
  static const float data[6] = {1, 2, 3, 4, 5, 6};
  static const int64_t mat[2] = {2, 3}, vec[1] = {4};
  kiln__st_out t[4] = {{"a", KILN_DTYPE_F32, 2, mat, data},
                       {"b", KILN_DTYPE_F32, 1, vec, data},
                       {"optim/b/momentum_buffer", KILN_DTYPE_F32, 1, vec, data},
                       {"optim1/a/momentum_buffer", KILN_DTYPE_F32, 2, mat, data}};
  static const char *const kv[][2] = {{"kiln.format", KILN__CKPT_FORMAT},
                                      {"kiln.rng.seed", "7"},
                                      {"kiln.rng.philox_offset", "3"},
                                      {"kiln.rng.host", "11"},
                                      {"kiln.optims", "2"},
                                      {"kiln.optim", "sgd"},
                                      {"kiln.optim.lr", "0.5"},
                                      {"kiln.optim.steps", "7"},
                                      {"kiln.optim.count/a", "0"},
                                      {"kiln.optim.count/b", "7"},
                                      {"kiln.optim1", "muon"},
                                      {"kiln.optim1.lr", "0.25"},
                                      {"kiln.optim1.steps", "6"},
                                      {"kiln.optim1.count/a", "6"},
                                      {"kiln.optim1.count/b", "0"},
                                      {"epoch", "3"}};
  cJSON *meta = cJSON_CreateObject();
  for (size_t i = 0; i < sizeof kv / sizeof *kv; i++) {
    if (bad == 1 && strcmp(kv[i][0], "kiln.optims") == 0) continue;
    bool over = bad == 2 && strcmp(kv[i][0], "kiln.optim1.count/a") == 0;
    bool one = bad == 3 && strcmp(kv[i][0], "kiln.optims") == 0;
    cJSON_AddStringToObject(meta, kv[i][0], over ? "9" : one ? "1" : kv[i][1]);
  }
  cr_assert_eq(kiln__st_write(ctx, "test", path, 4, t, meta), KILN_OK, "%s", th_err(ctx));
  cJSON_Delete(meta);
}

/* Several optimizers in one checkpoint (kiln_checkpoint_load_optims): each gets its own rate,
 * steps and counts, in order; a list that differs in length, kinds or order, a bad count, or a
 * bad list (NULL, repeated, over another parameter list, too long) is an error naming it, and
 * nothing changes. Without optimizers the weights load, every optimizer's state passed over. */
Test(checkpoint_names, several_optimizers_load_each_its_own_state) {
  char dir[256], path[512];
  th_tmpdir(dir, sizeof dir, "ckpt-optims");
  snprintf(path, sizeof path, "%s/c.safetensors", dir);
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_params *p = model(ctx, false);
  kiln_optim *sgd = kiln_sgd_new(p, &(kiln_sgd_options){.lr = 0.1f, .momentum = 0.9f});
  kiln_optim *muon = kiln_muon_new(p, &(kiln_muon_options){.lr = 0.02f, .momentum = 0.95f});
  cr_assert(sgd && muon, "%s", th_err(ctx));
  kiln_param_group exclude = {.exclude = 1};
  cr_assert_eq(kiln_optim_add_group(sgd, kiln_select_prefix, "a", &exclude), 1, "%s", th_err(ctx));
  cr_assert_eq(kiln_optim_add_group(muon, kiln_select_prefix, "b", &exclude), 1, "%s", th_err(ctx));
  kiln_optim *both[2] = {sgd, muon};
  write_two(ctx, path, 0);

  /* lists that do not match the file: nothing changes */
  kiln_params *other = model(ctx, false);
  kiln_optim *stranger = kiln_sgd_new(other, &(kiln_sgd_options){.lr = 0.1f, .momentum = 0.9f});
  cr_assert_not_null(stranger);
  struct {
    kiln_optim *o[3];
    int n;
    kiln_status st;
    const char *says;
  } refused[] = {
      {{sgd}, 1, KILN_ERR_FORMAT, "holds the state of 2 optimizers; one is given"},
      {{sgd, muon, sgd}, 3, KILN_ERR_INVALID, "optimizers 0 and 2 are the same one"},
      {{muon, sgd},
       2,
       KILN_ERR_FORMAT,
       "its optimizer 0 holds sgd state; the optimizer given there "
       "is muon"},
      {{sgd, sgd}, 2, KILN_ERR_INVALID, "optimizers 0 and 1 are the same one"},
      {{sgd, NULL}, 2, KILN_ERR_INVALID, "optimizer 1 is NULL"},
      {{sgd, stranger}, 2, KILN_ERR_INVALID, "optimizer 1 (sgd) updates another parameter list"},
      {{sgd, muon}, 17, KILN_ERR_INVALID, "17 optimizers"},
      {{sgd, muon}, -1, KILN_ERR_INVALID, "-1 optimizers"},
  };
  for (size_t c = 0; c < sizeof refused / sizeof *refused; c++) {
    cr_assert_eq(kiln_checkpoint_load_optims(path, p, refused[c].o, refused[c].n, NULL),
                 refused[c].st, "case %zu accepted", c);
    TH_ASSERT_ERROR(ctx, refused[c].st, "kiln_checkpoint_load_optims", refused[c].says);
    kiln_ctx_clear_error(ctx);
    cr_assert(kiln_optim_steps(sgd) == 0 && kiln_optim_steps(muon) == 0, "case %zu", c);
    cr_assert_eq(ctx->seed != 7, true, "case %zu: the seed changed", c);
  }
  cr_assert_eq(kiln_checkpoint_load(path, p, sgd, NULL), KILN_ERR_FORMAT);
  TH_ASSERT_ERROR(ctx, KILN_ERR_FORMAT, "kiln_checkpoint_load", "load it with all of them");
  kiln_ctx_clear_error(ctx);
  cr_assert_eq(kiln_checkpoint_save_optims(path, p, both, 17, NULL), KILN_ERR_INVALID);
  TH_ASSERT_ERROR(ctx, KILN_ERR_INVALID, "kiln_checkpoint_save_optims", "17 optimizers");
  kiln_ctx_clear_error(ctx);
  for (int bad = 1; bad <= 3; bad++) {
    write_two(ctx, path, bad);
    cr_assert_eq(kiln_checkpoint_load_optims(path, p, both, 2, NULL), KILN_ERR_FORMAT);
    TH_ASSERT_ERROR(ctx, KILN_ERR_FORMAT, "kiln_checkpoint_load_optims",
                    bad == 1   ? "holds the state of 1 optimizer; 2 are given"
                    : bad == 2 ? "kiln.optim1.count/a is no update count"
                               : "kiln.optims is '1'");
    kiln_ctx_clear_error(ctx);
    cr_assert(kiln_optim_steps(sgd) == 0 && kiln_optim_steps(muon) == 0, "bad %d", bad);
  }
  cr_assert_eq(kiln_checkpoint_load(path, p, sgd, NULL), KILN_ERR_FORMAT, "kiln.optims 1 loaded");
  TH_ASSERT_ERROR(ctx, KILN_ERR_FORMAT, "kiln_checkpoint_load", "from 2 to 16");
  kiln_ctx_clear_error(ctx);

  /* the right list: each optimizer its own scalars */
  write_two(ctx, path, 0);
  kiln_meta *meta = kiln_meta_new();
  cr_assert_eq(kiln_checkpoint_load_optims(path, p, both, 2, meta), KILN_OK, "%s", th_err(ctx));
  cr_assert_str_eq(kiln_meta_get(meta, "epoch"), "3");
  cr_assert(kiln_optim_steps(sgd) == 7 && kiln_optim_steps(muon) == 6, "steps %lld and %lld",
            (long long)kiln_optim_steps(sgd), (long long)kiln_optim_steps(muon));
  cr_assert_float_eq(kiln_optim_lr(sgd), 0.5f, 0.f);
  cr_assert_float_eq(kiln_optim_lr(muon), 0.25f, 0.f);
  cr_assert(kiln__optim_count(sgd, 1) == 7 && kiln__optim_count(muon, 0) == 6);
  cr_assert_eq(ctx->seed, 7u);
  /* the weights alone: every optimizer's state passed over */
  cr_assert_eq(kiln_checkpoint_load(path, p, NULL, NULL), KILN_OK, "%s", th_err(ctx));
  cr_assert_eq(kiln_params_load(p, path), KILN_OK, "%s", th_err(ctx));
  kiln_meta_free(meta);
  kiln_optim_free(stranger);
  kiln_params_free(other);
  kiln_optim_free(sgd);
  kiln_optim_free(muon);
  kiln_params_free(p);
  th_ctx_free(ctx);
}
