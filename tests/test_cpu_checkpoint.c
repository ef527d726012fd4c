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
