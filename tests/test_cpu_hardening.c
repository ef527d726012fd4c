/*
 * test_cpu_hardening.c: the probes of bad input, misuse and faults that broke kiln once (issue 13),
 * each as a regression test that needs no GPU: stale handles of any age, sizes that overflow,
 * failed steps and loads that must change nothing, schedules and gradcheck misuse, parameter
 * lists and free order, hostile safetensors and MNIST files, the kernel cache's directory and
 * entries, and the small traps of the public macros.
 */
#include <dirent.h>
#include <math.h>
#include <stdio.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include "fusion/engine.h"
#include "idx.h"
#include "inspect.h"
#include "io/safetensors.h"
#include "optim/optim.h"

TestSuite(hardening, .fini = th_remove_tmpdirs);

/* ---------------------------------------------------------------- 1. stale handles */

Test(hardening, stale_handles_of_any_age_are_errors) {
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_tensor *a = th_f32(ctx, KILN_SHAPE(4, 4));
  kiln_step_begin(ctx);
  kiln_tensor *x = kiln_add(a, a);
  cr_assert_not_null(x);
  /* two steps on: a handle of the new step may not take x's place */
  kiln_step_begin(ctx);
  kiln_step_begin(ctx);
  kiln_tensor *y = kiln_sum(a, KILN_ALL_AXES, 0);
  cr_assert_not_null(y);
  cr_assert_neq(x, y, "a new handle took a stale one's address");
  TH_EXPECT_FAIL(ctx, kiln_mul_scalar(x, 2.f), KILN_ERR_STATE, "kiln_mul_scalar",
                 "stale tensor handle");
  /* far older: 20 steps of 1000 handles each retire x's memory; x still says it is stale, and
   * no new handle ever had its address */
  for (int s = 0; s < 20; s++) {
    kiln_step_begin(ctx);
    for (int k = 0; k < 1000; k++) {
      kiln_tensor *z = kiln_neg(a);
      cr_assert(z && z != x, "step %d, handle %d: %p", s, k, (void *)z);
    }
  }
  TH_EXPECT_FAIL(ctx, kiln_mul_scalar(x, 2.f), KILN_ERR_STATE, "kiln_mul_scalar",
                 "stale tensor handle");
  /* the accessors say so too, instead of answering from dead memory */
  cr_assert_eq(kiln_tensor_numel(x), 0);
  TH_ASSERT_ERROR(ctx, KILN_ERR_STATE, "kiln_tensor_numel", "stale");
  kiln_ctx_clear_error(ctx);
  cr_assert_eq(kiln_tensor_ctx(x), ctx, "a stale handle still names its context");
  float v;
  cr_assert_eq(kiln_tensor_to_host(x, &v, sizeof v), KILN_ERR_STATE);
  th_free_scratch();
  th_ctx_free(ctx);
}

/* A persistent tensor used or freed after kiln_tensor_free is an error naming the function (its
 * handle stays readable and says it was freed: no read of freed memory, which ASan reported),
 * however many steps and tensors later; its chunk of handles is retired once nothing in it lives,
 * and a live persistent tensor keeps its chunk (and its values) however many steps pass. */
Test(hardening, freed_persistent_tensors_are_errors_not_freed_memory) {
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_tensor *keep = kiln_tensor_new(ctx, KILN_DTYPE_F32, KILN_SHAPE(3));
  kiln_tensor *t = kiln_tensor_new(ctx, KILN_DTYPE_F32, KILN_SHAPE(4, 4));
  cr_assert(keep && t, "%s", th_err(ctx));
  kiln_tensor_free(t);
  kiln_tensor_free(t); /* twice */
  TH_ASSERT_ERROR(ctx, KILN_ERR_STATE, "kiln_tensor_free", "freed already");
  kiln_ctx_clear_error(ctx);
  kiln_step_begin(ctx);
  TH_EXPECT_FAIL(ctx, kiln_relu(t), KILN_ERR_STATE, "kiln_relu", "a freed tensor");
  cr_assert_eq(kiln_tensor_numel(t), 0);
  TH_ASSERT_ERROR(ctx, KILN_ERR_STATE, "kiln_tensor_numel", "freed");
  kiln_ctx_clear_error(ctx);
  /* many steps with a tensor made and freed in each, and intermediates: t's chunk is retired (its
   * handle then reads as stale), no new tensor takes t's address, keep stays whole */
  for (int s = 0; s < 40; s++) {
    kiln_step_begin(ctx);
    kiln_tensor *u = kiln_tensor_new(ctx, KILN_DTYPE_F32, KILN_SHAPE(2));
    cr_assert(u && u != t, "step %d", s);
    for (int k = 0; k < 200; k++)
      cr_assert_not_null(kiln_neg(keep));
    kiln_tensor_free(u);
  }
  TH_EXPECT_FAIL(ctx, kiln_relu(t), KILN_ERR_STATE, "kiln_relu", "tensor");
  cr_assert_eq(kiln_tensor_numel(keep), 3, "%s", th_err(ctx));
  cr_assert_not_null(kiln_relu(keep), "%s", th_err(ctx));
  kiln_tensor_free(keep);
  th_free_scratch();
  th_ctx_free(ctx);
}

/* ---------------------------------------------------------------- 2. sizes that overflow */

Test(hardening, element_counts_that_overflow_are_errors) {
  kiln_ctx *ctx = th_cpu_ctx();
  int64_t big = (int64_t)1 << 32;
  cr_assert_null(kiln_tensor_new(ctx, KILN_DTYPE_F32, KILN_SHAPE(big, big)));
  TH_ASSERT_ERROR(ctx, KILN_ERR_SHAPE, "kiln_tensor_new", "2^58");
  kiln_ctx_clear_error(ctx);
  cr_assert_null(kiln_tensor_new(ctx, KILN_DTYPE_F32, KILN_SHAPE(3, (int64_t)1 << 62)));
  TH_ASSERT_ERROR(ctx, KILN_ERR_SHAPE, "kiln_tensor_new");
  kiln_ctx_clear_error(ctx);
  /* a zero dim does not excuse the others: their strides would still overflow */
  cr_assert_null(kiln_tensor_new(ctx, KILN_DTYPE_F32, KILN_SHAPE(0, big, big)));
  kiln_ctx_clear_error(ctx);
  kiln_tensor *a = th_f32(ctx, KILN_SHAPE(16));
  TH_EXPECT_FAIL(ctx, kiln_reshape(a, KILN_SHAPE(((int64_t)1 << 60) + 1, 16)), KILN_ERR_SHAPE,
                 "kiln_reshape", "2^58");
  TH_EXPECT_FAIL(ctx, kiln_full(ctx, KILN_SHAPE(big, big), 1.f), KILN_ERR_SHAPE, "kiln_full");
  kiln_tensor *one = th_f32(ctx, KILN_SHAPE(1, 1));
  TH_EXPECT_FAIL(ctx, kiln_expand(one, KILN_SHAPE(big, big)), KILN_ERR_SHAPE, "kiln_expand");
  /* broadcasting two valid shapes into one too large */
  kiln_tensor *col = th_f32(ctx, KILN_SHAPE((int64_t)1 << 30, 1));
  kiln_tensor *row = th_f32(ctx, KILN_SHAPE(1, (int64_t)1 << 30));
  TH_EXPECT_FAIL(ctx, kiln_add(col, row), KILN_ERR_SHAPE, "kiln_add", "2^58");
  /* a product whose result is too large */
  kiln_tensor *m = th_f32(ctx, KILN_SHAPE(INT32_MAX, 1)),
              *n = th_f32(ctx, KILN_SHAPE(1, INT32_MAX));
  TH_EXPECT_FAIL(ctx, kiln_matmul(m, n), KILN_ERR_SHAPE, "kiln_matmul");
  kiln_params *p = kiln_params_new(ctx);
  kiln_linear l;
  cr_assert_eq(
      kiln_linear_init(
          &l, p,
          &(kiln_linear_options){.name = "huge", .in = (int64_t)1 << 40, .out = (int64_t)1 << 40}),
      KILN_ERR_SHAPE);
  TH_ASSERT_ERROR(ctx, KILN_ERR_SHAPE, "kiln_linear_init");
  kiln_ctx_clear_error(ctx);
  cr_assert_eq(kiln_params_count(p), 0, "a failed init adds nothing");
  kiln_params_free(p);
  /* a shape with more dims than kiln takes: the message does not read past the shape */
  kiln_shape seven = {.ndim = 7};
  TH_EXPECT_FAIL(ctx, kiln_expand(one, seven), KILN_ERR_SHAPE, "kiln_expand", "[7 dims?]");
  th_free_scratch();
  th_ctx_free(ctx);
}

/* A safetensors file in memory: an 8-byte length, the header padded with spaces, then data. */
static uint8_t *st_bytes(const char *header, size_t data, size_t *len) {
  size_t hl = strlen(header), padded = (hl + 7) & ~(size_t)7;
  *len = 8 + padded + data;
  uint8_t *b = calloc(1, *len);
  cr_assert_not_null(b);
  for (int i = 0; i < 8; i++)
    b[i] = (uint8_t)((uint64_t)padded >> (8 * i));
  memcpy(b + 8, header, hl);
  memset(b + 8 + hl, ' ', padded - hl);
  return b;
}

static void expect_st_error(const char *header, size_t data, const char *want) {
  kiln_ctx *ctx = th_cpu_ctx();
  size_t len;
  uint8_t *b = st_bytes(header, data, &len);
  kiln__st_file f;
  cr_assert_eq(kiln__st_parse(ctx, "t", "mem", b, len, &f), KILN_ERR_FORMAT, "%s accepted", header);
  TH_ASSERT_ERROR(ctx, KILN_ERR_FORMAT, want);
  free(b);
  th_ctx_free(ctx);
}

Test(hardening, hostile_safetensors_headers) {
  /* 2^32 x 2^32 elements in zero bytes: the product is checked, not wrapped */
  expect_st_error("{\"w\":{\"dtype\":\"F32\",\"shape\":[4294967296,4294967296],"
                  "\"data_offsets\":[0,0]}}",
                  0, "'w'");
  /* a NUL in a name, raw or escaped, would load "w\0EVIL" into w */
  expect_st_error("{\"w\\u0000EVIL\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", 4,
                  "NUL");
  /* garbage after the header's JSON (only spaces pad it) */
  expect_st_error("{\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}xx", 4,
                  "not space padding");
}

/* The timeout is a guard, not a measurement: 400000 entries take about a second here and under
 * a minute with the sanitizers, but pairwise comparison (8e10 name comparisons) takes minutes. */
Test(hardening, many_header_entries_are_checked_in_n_log_n, .timeout = 120) {
  /* 400000 zero-size entries, the last a duplicate of an early one: refused, in time */
  int n = 400000;
  kiln__sb h = {0};
  kiln__sb_printf(&h, "{");
  for (int i = 0; i < n; i++)
    kiln__sb_printf(&h, "%s\"t%d\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[0,0]}",
                    i ? "," : "", i == n - 1 ? 7 : i);
  kiln__sb_printf(&h, "}");
  cr_assert(!h.oom);
  expect_st_error(h.s, 0, "'t7' appears twice");
  kiln__sb_free(&h);
}

Test(hardening, a_safetensors_file_is_checked_before_it_is_read, .timeout = 60) {
  char dir[256];
  th_tmpdir(dir, sizeof dir, "st");
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_params *p = kiln_params_new(ctx);
  kiln_linear l;
  cr_assert_eq(kiln_linear_init(&l, p, &(kiln_linear_options){.name = "fc", .in = 2, .out = 2}),
               KILN_OK);
  /* a directory is an I/O error, not an allocation of 2^63 bytes */
  cr_assert_eq(kiln_params_load(p, dir), KILN_ERR_IO);
  TH_ASSERT_ERROR(ctx, KILN_ERR_IO, "kiln_params_load", "not a regular file");
  kiln_ctx_clear_error(ctx);
  /* a 3 GB sparse file whose length field is all ones: refused from its first 8 bytes */
  char path[1200];
  snprintf(path, sizeof path, "%s/huge.safetensors", dir);
  FILE *f = fopen(path, "wb");
  cr_assert_not_null(f);
  unsigned char ff[8] = {0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff};
  cr_assert_eq(fwrite(ff, 1, 8, f), 8u);
  cr_assert_eq(ftruncate(fileno(f), (off_t)3 << 30), 0);
  fclose(f);
  cr_assert_eq(kiln_params_load(p, path), KILN_ERR_FORMAT);
  TH_ASSERT_ERROR(ctx, KILN_ERR_FORMAT, "header length");
  kiln_ctx_clear_error(ctx);
  unlink(path);
  kiln_params_free(p);
  th_ctx_free(ctx);
}

/* ---------------------------------------------------------------- 4. checkpoint metadata */

/* Writes a checkpoint of fc (2 -> 2, bias) with Adam state and the metadata given, by hand (a
 * no-GPU context cannot save), as kiln_checkpoint_save lays it out. */
static void write_checkpoint(const char *path, const char *lr, const char *steps,
                             const char *seed) {
  kiln_ctx *ctx = th_cpu_ctx();
  float w[4] = {1, 2, 3, 4}, b[2] = {5, 6};
  int64_t ws[2] = {2, 2}, bs[1] = {2};
  kiln__st_out t[6] = {
      {"fc.weight", KILN_DTYPE_F32, 2, ws, w},
      {"fc.bias", KILN_DTYPE_F32, 1, bs, b},
      {"optim/fc.weight/exp_avg", KILN_DTYPE_F32, 2, ws, w},
      {"optim/fc.weight/exp_avg_sq", KILN_DTYPE_F32, 2, ws, w},
      {"optim/fc.bias/exp_avg", KILN_DTYPE_F32, 1, bs, b},
      {"optim/fc.bias/exp_avg_sq", KILN_DTYPE_F32, 1, bs, b},
  };
  cJSON *m = cJSON_CreateObject();
  cJSON_AddStringToObject(m, "kiln.format", KILN__CKPT_FORMAT);
  cJSON_AddStringToObject(m, "kiln.rng.seed", seed);
  cJSON_AddStringToObject(m, "kiln.rng.philox_offset", "5");
  cJSON_AddStringToObject(m, "kiln.rng.host", "77");
  cJSON_AddStringToObject(m, "kiln.optim", "adam");
  cJSON_AddStringToObject(m, "kiln.optim.lr", lr);
  cJSON_AddStringToObject(m, "kiln.optim.steps", steps);
  cJSON_AddStringToObject(m, "kiln.optim.count/fc.weight", "3");
  cJSON_AddStringToObject(m, "kiln.optim.count/fc.bias", "3");
  cr_assert_eq(kiln__st_write(ctx, "t", path, 6, t, m), KILN_OK, "%s", th_err(ctx));
  cJSON_Delete(m);
  th_ctx_free(ctx);
}

Test(hardening, a_failed_checkpoint_load_changes_nothing) {
  char dir[256], path[1200];
  th_tmpdir(dir, sizeof dir, "ckpt");
  snprintf(path, sizeof path, "%s/c.safetensors", dir);
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_params *p = kiln_params_new(ctx);
  kiln_linear l;
  cr_assert_eq(kiln_linear_init(&l, p, &(kiln_linear_options){.name = "fc", .in = 2, .out = 2}),
               KILN_OK);
  kiln_optim *o = kiln_adam_new(p, NULL);
  cr_assert_not_null(o);
  kiln__optim_restore(o, 9, (int64_t[]){9, 9});
  kiln_manual_seed(ctx, 123);
  const char *bad[][3] = {
      {"nan", "4", "1"},    {"garbage", "4", "1"}, {"0.001", "-1", "1"},
      {"-0.5", "4", "1"},   {"inf", "4", "1"},     {"0.001", "4", "100000000000000000000000"},
      {"0.001", "4x", "1"}, {"0.001", "2", "1"}, /* counts of 3 after 2 steps */
  };
  for (size_t k = 0; k < sizeof bad / sizeof bad[0]; k++) {
    write_checkpoint(path, bad[k][0], bad[k][1], bad[k][2]);
    cr_assert_eq(kiln_checkpoint_load(path, p, o, NULL), KILN_ERR_FORMAT,
                 "lr '%s', steps '%s', seed '%s' accepted", bad[k][0], bad[k][1], bad[k][2]);
    TH_ASSERT_ERROR(ctx, KILN_ERR_FORMAT, "kiln_checkpoint_load", "metadata");
    kiln_ctx_clear_error(ctx);
    cr_assert_eq(kiln_optim_steps(o), 9, "case %zu: the step count changed", k);
    cr_assert_eq(kiln__optim_count(o, 0), 9);
    cr_assert_float_eq(kiln_optim_lr(o), 1e-3f, 0.f, "case %zu: the rate changed", k);
    cr_assert_eq(ctx->seed, 123u, "case %zu: the seed changed", k);
  }
  /* the same file with good metadata loads (its tensors: a no-GPU context keeps no data) */
  write_checkpoint(path, "0.25", "4", "8");
  cr_assert_eq(kiln_checkpoint_load(path, p, o, NULL), KILN_OK, "%s", th_err(ctx));
  cr_assert_eq(kiln_optim_steps(o), 4);
  cr_assert_eq(kiln__optim_count(o, 1), 3);
  cr_assert_float_eq(kiln_optim_lr(o), 0.25f, 0.f);
  cr_assert_eq(ctx->seed, 8u);
  unlink(path);
  kiln_optim_free(o);
  kiln_params_free(p);
  th_ctx_free(ctx);
}

/* ---------------------------------------------------------------- 5. a failed step */

Test(hardening, a_failed_step_leaves_no_host_state) {
  kiln_ctx *ctx = th_cpu_ctx();
  th_net m;
  th_net_init(&m, ctx, 8, 2, (int64_t[]){6, 4, 3});
  kiln_optim *o = kiln_adamw_new(m.params, NULL);
  kiln_schedule s = {.kind = KILN_SCHEDULE_COSINE, .base_lr = 0.5f, .total_steps = 10};
  kiln_optim_set_schedule(o, &s);
  uint64_t philox = ctx->philox_offset, host = ctx->host_rng;
  float lr = kiln_optim_lr(o);
  /* every step fails at kiln_step_end (a node reads a tensor freed under it: nothing of the
   * step can be planned): each must leave the state as it was */
  for (int round = 0; round < 3; round++) {
    kiln_step_begin(ctx);
    kiln_tensor *doomed = th_f32(ctx, KILN_SHAPE(3));
    cr_assert_not_null(kiln_relu(doomed));
    kiln_optim_zero_grad(o);
    kiln_tensor *h = kiln_dropout(th_net_logits(&m), 0.5f, 1);
    kiln_tensor *loss = kiln_cross_entropy(h, m.y, KILN_REDUCTION_MEAN, 0.f);
    cr_assert_eq(kiln_backward(loss), KILN_OK, "%s", th_err(ctx));
    cr_assert_eq(kiln_optim_step(o), KILN_OK, "%s", th_err(ctx));
    cr_assert_eq(kiln_optim_steps(o), 1, "recorded: the step counts");
    cr_assert_neq(ctx->philox_offset, philox);
    kiln_tensor_free(doomed);
    cr_assert_eq(kiln_step_end(ctx), KILN_ERR_STATE, "a step reading a freed tensor cannot run");
    TH_ASSERT_ERROR(ctx, KILN_ERR_STATE, "freed");
    kiln_ctx_clear_error(ctx);
    cr_assert_eq(kiln_optim_steps(o), 0, "round %d: a failed step advanced the optimizer", round);
    cr_assert_eq(kiln__optim_count(o, 0), 0);
    cr_assert_float_eq(kiln_optim_lr(o), lr, 0.f, "the rate the step found");
    cr_assert_eq(ctx->philox_offset, philox, "dropout's offset went back");
    cr_assert_eq(ctx->host_rng, host);
    for (int i = 0; i < kiln_params_count(m.params); i++)
      cr_assert_null(kiln_tensor_grad(kiln_params_get(m.params, i)),
                     "a failed step left a gradient flag");
  }
  /* a recording error fails the step the same way */
  kiln_step_begin(ctx);
  cr_assert_eq(kiln_optim_step(o), KILN_OK);
  cr_assert_null(kiln_reshape(m.x, KILN_SHAPE(7, 7)));
  cr_assert_neq(kiln_step_end(ctx), KILN_OK);
  kiln_ctx_clear_error(ctx);
  cr_assert_eq(kiln_optim_steps(o), 0);
  kiln_optim_free(o);
  th_net_free(&m);
  th_ctx_free(ctx);
}

/* ---------------------------------------------------------------- 6, 7. schedules, gradcheck */

Test(hardening, schedules_and_rates_are_checked) {
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_params *p = kiln_params_new(ctx);
  kiln_linear l;
  cr_assert_eq(kiln_linear_init(&l, p, &(kiln_linear_options){.name = "fc", .in = 2, .out = 2}),
               KILN_OK);
  kiln_optim *o = kiln_sgd_new(p, &(kiln_sgd_options){.lr = 0.1f});
  kiln_schedule bad[] = {
      {.kind = KILN_SCHEDULE_CONSTANT, .base_lr = -5.f},
      {.kind = KILN_SCHEDULE_STEP, .base_lr = 0.1f, .step_size = 2, .gamma = NAN},
      {.kind = KILN_SCHEDULE_STEP, .base_lr = 0.1f, .step_size = 0, .gamma = 0.5f},
      {.kind = KILN_SCHEDULE_COSINE, .base_lr = INFINITY, .total_steps = 10},
      {.kind = KILN_SCHEDULE_ONE_CYCLE, .base_lr = 0.1f, .total_steps = 0},
      {.kind = KILN_SCHEDULE_WARMUP_LINEAR, .base_lr = 0.1f, .total_steps = 5, .warmup_steps = 9},
      {.kind = (kiln_schedule_kind)99, .base_lr = 0.1f},
  };
  for (size_t k = 0; k < sizeof bad / sizeof bad[0]; k++) {
    kiln_optim_set_schedule(o, &bad[k]);
    TH_ASSERT_ERROR(ctx, KILN_ERR_INVALID, "kiln_optim_set_schedule");
    kiln_ctx_clear_error(ctx);
    kiln_step_begin(ctx);
    cr_assert_eq(kiln_optim_step(o), KILN_OK, "case %zu: %s", k, th_err(ctx));
    cr_assert_float_eq(kiln_optim_lr(o), 0.1f, 0.f, "case %zu: a refused schedule set the rate", k);
  }
  kiln_optim_set_lr(o, NAN);
  TH_ASSERT_ERROR(ctx, KILN_ERR_INVALID, "kiln_optim_set_lr");
  kiln_ctx_clear_error(ctx);
  cr_assert_float_eq(kiln_optim_lr(o), 0.1f, 0.f);
  kiln_optim_free(o);
  kiln_params_free(p);
  th_ctx_free(ctx);
}

static kiln_tensor *null_without_error(kiln_tensor *const *in, void *user) {
  (void)in, (void)user;
  return NULL;
}

Test(hardening, gradcheck_refuses_what_it_cannot_check) {
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_tensor *x = th_param(ctx, KILN_SHAPE(3));
  cr_assert_eq(kiln_gradcheck(ctx, NULL, 1, &x, NULL, NULL, NULL, 0), KILN_ERR_INVALID);
  TH_ASSERT_ERROR(ctx, KILN_ERR_INVALID, "kiln_gradcheck", "fn NULL");
  kiln_ctx_clear_error(ctx);
  cr_assert_eq(kiln_gradcheck(ctx, null_without_error, 1, NULL, NULL, NULL, NULL, 0),
               KILN_ERR_INVALID);
  kiln_ctx_clear_error(ctx);
  cr_assert_eq(kiln_gradcheck(ctx, null_without_error, 1, &x, NULL, NULL, NULL, 0),
               KILN_ERR_INVALID);
  TH_ASSERT_ERROR(ctx, KILN_ERR_INVALID, "kiln_gradcheck", "returned NULL");
  kiln_ctx_clear_error(ctx);
  th_free_scratch();
  th_ctx_free(ctx);
}

/* ---------------------------------------------------------------- 9. misuse */

Test(hardening, a_tensor_in_a_list_twice_or_freed_by_hand_is_an_error) {
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_params *p = kiln_params_new(ctx), *q = kiln_params_new(ctx);
  kiln_tensor *w = th_new(ctx, KILN_DTYPE_F32, KILN_SHAPE(2));
  cr_assert_eq(kiln_params_add(p, "a", w), KILN_OK);
  cr_assert_eq(kiln_params_add(p, "b", w), KILN_ERR_INVALID);
  TH_ASSERT_ERROR(ctx, KILN_ERR_INVALID, "kiln_params_add", "owns already");
  kiln_ctx_clear_error(ctx);
  cr_assert_eq(kiln_params_add(q, "a", w), KILN_ERR_INVALID, "nor in a second list");
  kiln_ctx_clear_error(ctx);
  kiln_tensor_free(w);
  TH_ASSERT_ERROR(ctx, KILN_ERR_INVALID, "kiln_tensor_free", "parameter list");
  kiln_ctx_clear_error(ctx);
  cr_assert_eq(kiln_params_count(p), 1);
  kiln_params_free(p);
  kiln_params_free(q);
  th_ctx_free(ctx);
}

Test(hardening, a_tensor_freed_under_the_tape_stops_backward) {
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_tensor *w = th_new(ctx, KILN_DTYPE_F32, KILN_SHAPE(3));
  kiln_tensor *v = th_new(ctx, KILN_DTYPE_F32, KILN_SHAPE(3));
  kiln_tensor_set_requires_grad(w, 1);
  kiln_step_begin(ctx);
  kiln_tensor *loss = kiln_sum(kiln_mul(w, v), KILN_ALL_AXES, 0);
  kiln_tensor_free(v); /* the tape's mul reads it */
  cr_assert_eq(kiln_backward(loss), KILN_ERR_STATE);
  TH_ASSERT_ERROR(ctx, KILN_ERR_STATE, "kiln_backward", "freed");
  kiln_ctx_clear_error(ctx);
  cr_assert_eq(kiln__engine_compile(ctx, 0, ctx->trace.n), KILN_ERR_STATE,
               "nor can the step's nodes be run");
  kiln_ctx_clear_error(ctx);
  kiln_tensor_free(w);
  th_ctx_free(ctx);
}

Test(hardening, any_free_order_is_safe) {
  /* the context first, its objects after. A read of freed memory here is seen only by a
   * KILN_SANITIZE build (or valgrind): in a plain build it reads glibc's free-list bytes where a
   * tensor's magic was, and kiln_tensor_free refuses the "handle" without harm. */
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_params *p = kiln_params_new(ctx);
  kiln_linear l;
  cr_assert_eq(kiln_linear_init(&l, p, &(kiln_linear_options){.name = "fc", .in = 3, .out = 2}),
               KILN_OK);
  kiln_optim *o = kiln_sgd_new(p, &(kiln_sgd_options){.lr = 0.1f, .momentum = 0.9f});
  uint8_t images[2 * 2 * 2] = {1, 2, 3, 4, 5, 6, 7, 8}, labels[2] = {1, 2};
  kiln_mnist mn = {.n = 2, .rows = 2, .cols = 2, .images = images, .labels = labels};
  kiln_dataset *ds = kiln_dataset_from_mnist(ctx, &mn, 0.f, 1.f);
  kiln_loader *ld =
      kiln_loader_new(ds, &(kiln_loader_options){.batch = 1, .shuffle = 1, .seed = 3});
  cr_assert(o && ds && ld, "%s", th_err(ctx));
  kiln_ctx_free(ctx); /* it frees every tensor; the objects free their own memory after it */
  kiln_loader_free(ld);
  kiln_dataset_free(ds);
  kiln_optim_free(o);
  kiln_params_free(p);
}

Test(hardening, data_set_sizes_that_wrap_are_errors) {
  kiln_ctx *ctx = th_cpu_ctx();
  uint8_t px[4] = {0}, lb[1] = {0};
  kiln_mnist mn = {.n = (int64_t)1 << 40,
                   .rows = (int64_t)1 << 20,
                   .cols = (int64_t)1 << 20,
                   .images = px,
                   .labels = lb};
  cr_assert_null(kiln_dataset_from_mnist(ctx, &mn, 0.f, 1.f));
  TH_ASSERT_ERROR(ctx, KILN_ERR_INVALID, "kiln_dataset_from_mnist");
  kiln_ctx_clear_error(ctx);
  th_ctx_free(ctx);
}

/* ---------------------------------------------------------------- 12. MNIST files */

/* The process's virtual memory now, in bytes (VmSize), or 0 if it cannot be read. */
static uint64_t vm_size(void) {
  FILE *f = fopen("/proc/self/status", "r");
  char line[256];
  unsigned long long kb = 0;
  while (f && fgets(line, sizeof line, f))
    if (sscanf(line, "VmSize: %llu kB", &kb) == 1) break;
  if (f) fclose(f);
  return (uint64_t)kb << 10;
}

Test(hardening, a_small_gz_cannot_inflate_past_its_header) {
  char dir[256];
  th_tmpdir(dir, sizeof dir, "mnist");
  th_blob im = th_idx_images(TH_IDX_N, TH_IDX_ROWS, TH_IDX_COLS);
  th_idx_put(dir, TH_IDX_IMAGES, im, true);
  /* 5 labels declared, 256 MiB of zeros after them, gzipped to some 256 KB */
  size_t n = 8 + ((size_t)256 << 20);
  unsigned char *lab = calloc(1, n);
  cr_assert_not_null(lab);
  th_be32_put(lab, 0x801);
  th_be32_put(lab + 4, 5);
  th_blob b = {lab, n};
  th_idx_put(dir, TH_IDX_LABELS, b, true);
  free(lab);
  free(im.p);
  /* The read may use 64 MiB more address space than the process has now: far more than the
   * files' declared contents, far less than the zeros they inflate to. */
  kiln_ctx *ctx = th_cpu_ctx();
  uint64_t now = vm_size();
  cr_assert_gt(now, 0, "cannot read VmSize from /proc/self/status");
  struct rlimit was;
  cr_assert_eq(getrlimit(RLIMIT_AS, &was), 0);
  struct rlimit cap = {.rlim_cur = now + ((uint64_t)64 << 20), .rlim_max = was.rlim_max};
  if (was.rlim_cur != RLIM_INFINITY && was.rlim_cur < cap.rlim_cur) cap.rlim_cur = was.rlim_cur;
  cr_assert_eq(setrlimit(RLIMIT_AS, &cap), 0);
  kiln_mnist m;
  kiln_status s = kiln_mnist_read(ctx, dir, "train", &m);
  cr_assert_eq(setrlimit(RLIMIT_AS, &was), 0);
  cr_assert_eq(s, KILN_ERR_FORMAT, "status '%s', want 'bad file format': %s", kiln_status_name(s),
               th_err(ctx));
  TH_ASSERT_ERROR(ctx, KILN_ERR_FORMAT, "kiln_mnist_read", TH_IDX_LABELS ".gz", "trailing bytes");
  kiln_ctx_clear_error(ctx);
  th_ctx_free(ctx);
  th_remove_dir(dir);
}

/* A FIFO where a file should be: refused at once (a blocking open would wait for a writer
 * forever; the timeout turns such a hang into a failure). */
Test(hardening, fifos_are_not_files, .timeout = 60) {
  char dir[256];
  th_idx_synthetic(dir, sizeof dir, false);
  char path[1200];
  snprintf(path, sizeof path, "%s/" TH_IDX_LABELS, dir);
  cr_assert_eq(unlink(path), 0);
  cr_assert_eq(mkfifo(path, 0644), 0);
  TH_EXPECT_MNIST_ERROR(dir, KILN_ERR_IO, TH_IDX_LABELS, "not a regular file");
  snprintf(path, sizeof path, "%s/weights.safetensors", dir);
  cr_assert_eq(mkfifo(path, 0644), 0);
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_params *p = kiln_params_new(ctx);
  kiln_linear l;
  cr_assert_eq(kiln_linear_init(&l, p, &(kiln_linear_options){.name = "fc", .in = 2, .out = 2}),
               KILN_OK);
  cr_assert_eq(kiln_params_load(p, path), KILN_ERR_IO);
  TH_ASSERT_ERROR(ctx, KILN_ERR_IO, "kiln_params_load", "not a regular file");
  kiln_ctx_clear_error(ctx);
  kiln_params_free(p);
  th_ctx_free(ctx);
  th_remove_dir(dir);
}

Test(hardening, mnist_paths_long_or_not_files) {
  char dir[256];
  th_idx_synthetic(dir, sizeof dir, false);
  /* an images "file" that is a directory is an I/O error */
  char path[1200];
  snprintf(path, sizeof path, "%s/" TH_IDX_IMAGES, dir);
  cr_assert_eq(unlink(path), 0);
  cr_assert_eq(mkdir(path, 0755), 0);
  TH_EXPECT_MNIST_ERROR(dir, KILN_ERR_IO, TH_IDX_IMAGES, "not a regular file");
  rmdir(path);
  th_remove_dir(dir);
  /* a directory path far longer than any fixed buffer */
  char base[256];
  th_tmpdir(base, sizeof base, "longpath");
  kiln__sb deep = {0};
  kiln__sb_printf(&deep, "%s", base);
  for (int i = 0; i < 12; i++) {
    kiln__sb_printf(&deep, "/%0200d", i);
    cr_assert_eq(mkdir(deep.s, 0755), 0, "%s", deep.s);
  }
  cr_assert_gt(deep.n, 2000u);
  th_blob im = th_idx_images(TH_IDX_N, TH_IDX_ROWS, TH_IDX_COLS), lb = th_idx_labels(TH_IDX_N);
  kiln__sb f = {0};
  kiln__sb_printf(&f, "%s/" TH_IDX_IMAGES, deep.s);
  th_write_whole(f.s, im.p, im.n);
  f.n = 0;
  kiln__sb_printf(&f, "%s/" TH_IDX_LABELS, deep.s);
  th_write_whole(f.s, lb.p, lb.n);
  kiln__sb_free(&f);
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_mnist mn;
  cr_assert_eq(kiln_mnist_read(ctx, deep.s, "train", &mn), KILN_OK, "%s", th_err(ctx));
  cr_assert_eq(mn.n, TH_IDX_N);
  kiln_mnist_free(&mn);
  th_ctx_free(ctx);
  free(im.p);
  free(lb.p);
  char cmd[300];
  snprintf(cmd, sizeof cmd, "rm -rf %s", base);
  cr_assert_eq(system(cmd), 0);
  kiln__sb_free(&deep);
}

/* ---------------------------------------------------------------- 13. long names */

Test(hardening, names_are_not_cut) {
  kiln_ctx *ctx = th_cpu_ctx();
  char name[301];
  memset(name, 'n', 300);
  name[300] = 0;
  kiln_tensor *t = th_new(ctx, KILN_DTYPE_F32, KILN_SHAPE(2));
  kiln_tensor_set_name(t, name);
  cr_assert_str_eq(kiln_tensor_name(t), name);
  kiln_params *p = kiln_params_new(ctx);
  cr_assert_eq(kiln_params_add(p, name, t), KILN_OK);
  cr_assert_eq(kiln_params_find(p, name), t);
  kiln_optim *o = kiln_adam_new(p, NULL);
  cr_assert_not_null(o);
  const char *what;
  kiln_tensor *m = kiln__optim_state(o, 0, 0, &what);
  cr_assert_eq(strlen(kiln_tensor_name(m)), 300 + strlen(".exp_avg"));
  kiln_optim_free(o);
  kiln_params_free(p);
  th_ctx_free(ctx);
}

/* ---------------------------------------------------------------- 14. the kernel cache */

/* The path of the one .cubin file in dir (malloc'd), asserting there is exactly one. */
static char *only_cubin(const char *dir) {
  DIR *d = opendir(dir);
  cr_assert_not_null(d, "cannot open %.100s...", dir);
  char *found = NULL;
  int n = 0;
  for (struct dirent *e; (e = readdir(d));) {
    size_t l = strlen(e->d_name);
    if (l < 6 || strcmp(e->d_name + l - 6, ".cubin") != 0) continue;
    n++;
    kiln__sb p = {0};
    kiln__sb_printf(&p, "%s/%s", dir, e->d_name);
    free(found);
    found = p.s;
  }
  closedir(d);
  cr_assert_eq(n, 1, "%d cache entries under the long path", n);
  return found;
}

Test(hardening, kernel_cache_entries_and_directories, .timeout = 300) {
  char cache[256];
  th_tmpdir(cache, sizeof cache, "cache");
  /* a cache path longer than any fixed buffer still caches */
  kiln__sb dir = {0};
  kiln__sb_printf(&dir, "%s", cache);
  for (int i = 0; i < 6; i++)
    kiln__sb_printf(&dir, "/%0200d", i);
  cr_assert_gt(dir.n, 1200u);
  cr_assert_eq(setenv("KILN_CACHE_DIR", dir.s, 1), 0);
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_tensor *a = th_f32(ctx, KILN_SHAPE(7));
  cr_assert_not_null(kiln_tanh(a));
  cr_assert_eq(kiln__engine_compile(ctx, 0, ctx->trace.n), KILN_OK, "%s", th_err(ctx));
  char *entry = only_cubin(dir.s);
  th_free_scratch();
  th_ctx_free(ctx);
  /* the entry replaced by a FIFO: opened without blocking, passed over, compiled again */
  cr_assert_eq(unlink(entry), 0);
  cr_assert_eq(mkfifo(entry, 0644), 0);
  ctx = th_cpu_ctx();
  a = th_f32(ctx, KILN_SHAPE(7));
  cr_assert_not_null(kiln_tanh(a));
  cr_assert_eq(kiln__engine_compile(ctx, 0, ctx->trace.n), KILN_OK, "%s", th_err(ctx));
  kiln_exec_stats st;
  kiln_stats(ctx, &st);
  cr_assert_eq(st.kernels_compiled, 1u, "the FIFO was not passed over");
  th_free_scratch();
  th_ctx_free(ctx);
  unlink(entry);
  free(entry);
  /* an unusable cache directory (a file's path) warns and still compiles */
  char file[1200];
  snprintf(file, sizeof file, "%s/a-file", cache);
  th_write_whole(file, "x", 1);
  cr_assert_eq(setenv("KILN_CACHE_DIR", file, 1), 0);
  ctx = th_cpu_ctx();
  a = th_f32(ctx, KILN_SHAPE(7));
  cr_assert_not_null(kiln_sigmoid(a));
  cr_assert_eq(kiln__engine_compile(ctx, 0, ctx->trace.n), KILN_OK, "%s", th_err(ctx));
  th_free_scratch();
  th_ctx_free(ctx);
  unsetenv("KILN_CACHE_DIR");
  char cmd[400];
  snprintf(cmd, sizeof cmd, "rm -rf %s", cache);
  cr_assert_eq(system(cmd), 0);
  kiln__sb_free(&dir);
}

/* ---------------------------------------------------------------- 15. small traps */

Test(hardening, empty_shapes_and_axes_and_a_zeroed_layer) {
  kiln_shape s = KILN_SHAPE();
  kiln_axes ax = KILN_AXES();
  cr_assert_eq(s.ndim, 0, "KILN_SHAPE() is a scalar's shape");
  cr_assert_eq(ax.n, 0, "KILN_AXES() is every axis");
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_tensor *a = th_f32(ctx, KILN_SHAPE(2, 3));
  th_assert_shape(kiln_sum(a, KILN_AXES(), 0), KILN_SCALAR_SHAPE);
  kiln_tensor *sc = kiln_tensor_new(ctx, KILN_DTYPE_F32, KILN_SHAPE());
  cr_assert_eq(kiln_tensor_ndim(sc), 0);
  kiln_tensor_free(sc);
  kiln_linear l = {0};
  cr_assert_null(kiln_linear_forward(&l, a));
  TH_ASSERT_ERROR(ctx, KILN_ERR_INVALID, "kiln_linear_forward", "no weight");
  kiln_ctx_clear_error(ctx);
  th_free_scratch();
  th_ctx_free(ctx);
}
