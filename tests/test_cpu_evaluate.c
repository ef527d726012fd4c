/*
 * test_cpu_evaluate.c: evaluation without a GPU. kiln_eval_begin / kiln_eval_end switch training
 * and gradients off and give back what they found, nesting and across steps, and refuse an
 * unbalanced end; kiln_evaluate runs the forward callback once per batch of the loader's epoch in
 * evaluation mode, plans and compiles its steps, then says it cannot read them without a GPU;
 * every bad argument and every bad forward is an error naming kiln_evaluate and the values, and
 * leaves the result, the loader, the training mode and the no-grad depth as they were.
 */
#include <string.h>

#include "inspect.h"

TestSuite(evaluate);

/* ---------------------------------------------------------------- evaluation mode */

Test(evaluate, eval_mode_switches_training_and_gradients_and_gives_them_back) {
  kiln_ctx *ctx = th_cpu_ctx();
  cr_assert(kiln_training(ctx) && kiln_grad_enabled(ctx));
  kiln_eval_begin(ctx);
  cr_assert(!kiln_training(ctx) && !kiln_grad_enabled(ctx), "model.eval() and torch.no_grad()");
  /* inside: a region that switches training on again gets evaluation mode back from a nested
   * region's end, and the outer end gives back the training mode it found */
  kiln_set_training(ctx, 1);
  kiln_eval_begin(ctx);
  cr_assert(!kiln_training(ctx) && !kiln_grad_enabled(ctx));
  kiln_eval_end(ctx);
  cr_assert(kiln_training(ctx), "the inner end gives back what the inner begin found");
  cr_assert(!kiln_grad_enabled(ctx), "the outer no-grad region is still open");
  kiln_set_training(ctx, 0);
  kiln_eval_end(ctx);
  cr_assert(kiln_training(ctx) && kiln_grad_enabled(ctx));
  /* from evaluation mode, it stays in evaluation mode */
  kiln_set_training(ctx, 0);
  kiln_eval_begin(ctx);
  kiln_eval_end(ctx);
  cr_assert(!kiln_training(ctx) && kiln_grad_enabled(ctx));
  kiln_set_training(ctx, 1);
  /* a region spans steps: dropout passes its input through and nothing is differentiated */
  kiln_tensor *w = th_param(ctx, KILN_SHAPE(4, 8));
  kiln_eval_begin(ctx);
  for (int step = 0; step < 2; step++) {
    kiln_step_begin(ctx);
    int32_t n0 = th_tlen(ctx);
    kiln_tensor *y = kiln_dropout(kiln_relu(w), 0.5f, KILN_TRAINING_MODE);
    cr_assert_not_null(y, "%s", th_err(ctx));
    cr_assert_eq(th_count_ops(ctx, n0, th_tlen(ctx), KILN__OP_DROPOUT), 0, "step %d", step);
    cr_assert_eq(kiln_backward(kiln_sum(y, KILN_ALL_AXES, 0)), KILN_ERR_STATE,
                 "no gradient in a no-grad region");
    kiln_ctx_clear_error(ctx);
    cr_assert_eq(kiln_step_end(ctx), KILN_OK, "%s", th_err(ctx));
  }
  kiln_eval_end(ctx);
  cr_assert(kiln_training(ctx) && kiln_grad_enabled(ctx));
  th_assert_ok(ctx);
  th_free_scratch();
  th_ctx_free(ctx);
}

Test(evaluate, an_unbalanced_eval_end_is_an_error_that_changes_nothing) {
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_eval_end(ctx);
  TH_ASSERT_ERROR(ctx, KILN_ERR_STATE, "kiln_eval_end", "no evaluation region is open");
  kiln_ctx_clear_error(ctx);
  cr_assert(kiln_training(ctx) && kiln_grad_enabled(ctx));
  /* a stray kiln_no_grad_end inside closes the region's no-grad region: its end refuses */
  kiln_eval_begin(ctx);
  kiln_no_grad_end(ctx);
  th_assert_ok(ctx);
  kiln_eval_end(ctx);
  TH_ASSERT_ERROR(ctx, KILN_ERR_STATE, "kiln_eval_end", "region 1", "was closed already");
  kiln_ctx_clear_error(ctx);
  cr_assert(!kiln_training(ctx), "a failed end changes nothing");
  kiln_no_grad_begin(ctx);
  kiln_eval_end(ctx);
  th_assert_ok(ctx);
  cr_assert(kiln_training(ctx) && kiln_grad_enabled(ctx));
  /* 64 regions nest; the 65th is refused and opens nothing */
  for (int i = 0; i < 64; i++)
    kiln_eval_begin(ctx);
  th_assert_ok(ctx);
  kiln_eval_begin(ctx);
  TH_ASSERT_ERROR(ctx, KILN_ERR_STATE, "kiln_eval_begin", "64 evaluation regions");
  kiln_ctx_clear_error(ctx);
  for (int i = 0; i < 64; i++) {
    cr_assert(!kiln_grad_enabled(ctx), "region %d", i);
    kiln_eval_end(ctx);
  }
  th_assert_ok(ctx);
  cr_assert(kiln_training(ctx) && kiln_grad_enabled(ctx), "the 65th begin opened no region");
  kiln_eval_begin(NULL);
  kiln_eval_end(NULL);
  th_ctx_free(ctx);
}

/* ---------------------------------------------------------------- kiln_evaluate */

/* How a probe's forward misbehaves. */
enum {
  GOOD,        /* (B, 3) logits */
  NULL_QUIET,  /* NULL and no error */
  ROWS,        /* (B - 1, 3) */
  RANK,        /* (B, 3, 1) */
  INT_LOGITS,  /* (B, 1) i32 */
  CLASSES,     /* (B, 3), then (B, 2) from the second batch */
  FAILING_OP,  /* an op of its own fails (kiln_matmul of mismatched shapes) */
  LEAVES_CAST, /* opens an autocast region and leaves it open */
};

/* A model whose forward records what it saw: the modes it ran in and the batches it got. */
typedef struct probe {
  kiln_linear fc; /* 4 -> 3 */
  int mode, calls, saw_training, saw_grad;
  int64_t rows[8];
} probe;

static kiln_tensor *probe_forward(void *model, kiln_tensor *x) {
  probe *p = model;
  kiln_ctx *ctx = kiln_tensor_ctx(x);
  p->saw_training |= kiln_training(ctx);
  p->saw_grad |= kiln_grad_enabled(ctx);
  int64_t b = kiln_tensor_dim(x, 0);
  if (p->calls < 8) p->rows[p->calls] = b;
  p->calls++;
  kiln_tensor *logits = kiln_linear_forward(&p->fc, kiln_flatten(x)); /* (B, 3) */
  switch (p->mode) {
  case NULL_QUIET: return NULL;
  case ROWS: return kiln_slice(logits, 0, 0, b - 1, 1);
  case RANK: return kiln_reshape(logits, KILN_SHAPE(b, 3, 1));
  case INT_LOGITS: return kiln_argmax(logits, 1, 1);
  case CLASSES: return p->calls > 1 ? kiln_slice(logits, 1, 0, 2, 1) : logits;
  case FAILING_OP: return kiln_matmul(logits, logits);
  case LEAVES_CAST: kiln_autocast_begin(ctx, KILN_DTYPE_BF16); return logits;
  }
  return logits;
}

/* Ten 2x2 images (labels i % 3) as a data set of (10, 2, 2, 1). */
static kiln_dataset *ten_images(kiln_ctx *ctx) {
  uint8_t images[10 * 4], labels[10];
  for (int i = 0; i < 40; i++)
    images[i] = (uint8_t)(i * 7);
  for (int i = 0; i < 10; i++)
    labels[i] = (uint8_t)(i % 3);
  kiln_dataset *ds = kiln_dataset_from_host(ctx, KILN_HOST_U8, KILN_SHAPE(10, 2, 2, 1), images,
                                            (kiln_host_labels){.u8 = labels, .classes = 3},
                                            &(kiln_normalize){.channels = 1, .from_data = 1});
  cr_assert_not_null(ds, "%s", th_err(ctx));
  return ds;
}

/* The batches left in the loader's epoch (taking them). */
static int batches_left(kiln_ctx *ctx, kiln_loader *l) {
  int n = 0;
  for (;;) {
    kiln_step_begin(ctx);
    kiln_tensor *x, *y;
    int got = kiln_loader_next(l, &x, &y);
    cr_assert_eq(kiln_step_end(ctx), KILN_OK, "%s", th_err(ctx));
    if (!got) return n;
    n++;
  }
}

static kiln_eval_result sentinel(void) {
  kiln_eval_result r;
  memset(&r, 0xab, sizeof r);
  return r;
}

/* Asserts that a failed kiln_evaluate left what it must: the result, the modes, no open step. */
static void assert_untouched(kiln_ctx *ctx, const kiln_eval_result *r, int training) {
  kiln_eval_result s = sentinel();
  cr_assert(memcmp(r, &s, sizeof s) == 0, "the result was written");
  cr_assert_eq(kiln_training(ctx), training, "the training mode was not given back");
  cr_assert(kiln_grad_enabled(ctx), "the no-grad depth was not given back");
}

Test(evaluate, runs_every_batch_in_evaluation_mode_and_cannot_read_without_a_gpu, .timeout = 300) {
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_dataset *ds = ten_images(ctx);
  kiln_params *params = kiln_params_new(ctx);
  probe p = {0};
  cr_assert_eq(
      kiln_linear_init(&p.fc, params, &(kiln_linear_options){.name = "fc", .in = 4, .out = 3}),
      KILN_OK);
  kiln_loader *l = kiln_loader_new(
      ds, &(kiln_loader_options){.batch = 4, .shuffle = 1, .seed = 5}); /* batches of 4, 4, 2 */
  cr_assert_not_null(l, "%s", th_err(ctx));
  /* the loader is one batch into its epoch: kiln_evaluate runs all three and leaves it there */
  kiln_step_begin(ctx);
  kiln_tensor *x, *y;
  cr_assert(kiln_loader_next(l, &x, &y));
  cr_assert_eq(kiln_step_end(ctx), KILN_OK, "%s", th_err(ctx));
  for (int training = 1; training >= 0; training--) {
    kiln_set_training(ctx, training);
    memset(&p.calls, 0, sizeof p - offsetof(probe, calls));
    kiln_exec_stats s0, s1;
    kiln_stats(ctx, &s0);
    kiln_eval_result r = sentinel();
    cr_assert_eq(kiln_evaluate(ctx, l, probe_forward, &p, NULL, &r), KILN_ERR_STATE);
    TH_ASSERT_ERROR(ctx, KILN_ERR_STATE, "kiln_evaluate", "no GPU", "3 batches",
                    "recorded, planned and compiled");
    kiln_ctx_clear_error(ctx);
    assert_untouched(ctx, &r, training);
    cr_assert_eq(p.calls, 3);
    cr_assert(p.rows[0] == 4 && p.rows[1] == 4 && p.rows[2] == 2, "batches of %lld, %lld, %lld",
              (long long)p.rows[0], (long long)p.rows[1], (long long)p.rows[2]);
    cr_assert(!p.saw_training && !p.saw_grad, "forward ran in training mode or with gradients");
    kiln_stats(ctx, &s1);
    cr_assert_geq(s1.flushes, s0.flushes + 3, "each batch is a step of its own");
    cr_assert_gt(s1.groups, s0.groups, "the steps were planned");
  }
  kiln_set_training(ctx, 1);
  /* a module, through kiln_module_call; with drop_last, the full batches only */
  kiln_module *net = kiln_sequential_new(params);
  kiln_seq_flatten(net);
  kiln_seq_linear(net, &(kiln_linear_options){.name = "head", .in = 4, .out = 3});
  kiln_seq_dropout(net, 0.5f);
  kiln_loader *dl = kiln_loader_new(ds, &(kiln_loader_options){.batch = 4, .drop_last = 1});
  cr_assert_not_null(dl, "%s", th_err(ctx));
  kiln_eval_result r = sentinel();
  /* inside a step opened with nothing recorded, as a loop leaves it when its loader runs out */
  kiln_step_begin(ctx);
  cr_assert_eq(kiln_evaluate(ctx, dl, kiln_module_call, net,
                             &(kiln_eval_options){.label_smoothing = 0.1f}, &r),
               KILN_ERR_STATE);
  TH_ASSERT_ERROR(ctx, KILN_ERR_STATE, "kiln_evaluate", "2 batches");
  kiln_ctx_clear_error(ctx);
  assert_untouched(ctx, &r, 1);
  cr_assert_eq(batches_left(ctx, l), 2, "the loader moved");
  kiln_loader_free(dl);
  kiln_module_free(net);
  kiln_loader_free(l);
  kiln_params_free(params);
  kiln_dataset_free(ds);
  th_ctx_free(ctx);
}

Test(evaluate, bad_arguments_are_errors_that_change_nothing) {
  kiln_ctx *ctx = th_cpu_ctx(), *other = th_cpu_ctx();
  kiln_dataset *ds = ten_images(ctx), *ods = ten_images(other);
  kiln_params *params = kiln_params_new(ctx);
  probe p = {0};
  cr_assert_eq(
      kiln_linear_init(&p.fc, params, &(kiln_linear_options){.name = "fc", .in = 4, .out = 3}),
      KILN_OK);
  kiln_loader *l = kiln_loader_new(ds, &(kiln_loader_options){.batch = 4}),
              *ol = kiln_loader_new(ods, &(kiln_loader_options){.batch = 4});
  kiln_loader *empty = kiln_loader_new(
      ds, &(kiln_loader_options){.batch = 16, .drop_last = 1}); /* drop_last: no batch at all */
  cr_assert(l && ol && empty, "%s", th_err(ctx));
  kiln_eval_result r = sentinel();
  struct {
    kiln_loader *loader;
    kiln_forward_fn forward;
    kiln_eval_options o;
    kiln_eval_result *out;
    kiln_status status;
    const char *what, *what2;
  } cases[] = {
      {NULL, probe_forward, {0}, &r, KILN_ERR_INVALID, "NULL loader", ""},
      {l, NULL, {0}, &r, KILN_ERR_INVALID, "NULL forward", "kiln_module_call"},
      {l, probe_forward, {0}, NULL, KILN_ERR_INVALID, "NULL out", ""},
      {ol, probe_forward, {0}, &r, KILN_ERR_INVALID, "another context", ""},
      {empty, probe_forward, {0}, &r, KILN_ERR_INVALID, "no batch", "batches of 10"},
      {l, probe_forward, {.loss = 7}, &r, KILN_ERR_INVALID, "unknown loss 7", ""},
      {l,
       probe_forward,
       {.label_smoothing = 1.5f},
       &r,
       KILN_ERR_INVALID,
       "label_smoothing 1.5",
       ""},
      {l, probe_forward, {.label_smoothing = NAN}, &r, KILN_ERR_INVALID, "label_smoothing nan", ""},
      {l, probe_forward, {.autocast = KILN_DTYPE_I32}, &r, KILN_ERR_INVALID, "autocast i32", ""},
  };
  for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
    int32_t n0 = th_tlen(ctx);
    cr_assert_eq(
        kiln_evaluate(ctx, cases[k].loader, cases[k].forward, &p, &cases[k].o, cases[k].out),
        cases[k].status, "case %zu", k);
    TH_ASSERT_ERROR(ctx, cases[k].status, "kiln_evaluate", cases[k].what, cases[k].what2);
    kiln_ctx_clear_error(ctx);
    assert_untouched(ctx, &r, 1);
    cr_assert_eq(th_tlen(ctx), n0, "case %zu recorded something", k);
    cr_assert_eq(p.calls, 0, "case %zu ran the forward pass", k);
  }
  /* inside an open step that recorded something, or an open autocast region (where no step
   * may end) */
  kiln_step_begin(ctx);
  cr_assert_not_null(kiln_full(ctx, KILN_SHAPE(2), 1.f));
  int32_t recorded = th_tlen(ctx);
  cr_assert_eq(kiln_evaluate(ctx, l, probe_forward, &p, NULL, &r), KILN_ERR_STATE);
  TH_ASSERT_ERROR(ctx, KILN_ERR_STATE, "kiln_evaluate",
                  "inside an open step that has recorded 1 ops");
  cr_assert_eq(th_tlen(ctx), recorded, "the open step lost its ops");
  kiln_ctx_clear_error(ctx);
  cr_assert_eq(kiln_step_end(ctx), KILN_OK, "%s", th_err(ctx));
  kiln_autocast_begin(ctx, KILN_DTYPE_BF16);
  cr_assert_eq(kiln_evaluate(ctx, l, probe_forward, &p, NULL, &r), KILN_ERR_STATE);
  TH_ASSERT_ERROR(ctx, KILN_ERR_STATE, "kiln_evaluate", "1 autocast region is open",
                  ".autocast = KILN_DTYPE_BF16");
  kiln_ctx_clear_error(ctx);
  kiln_autocast_end(ctx);
  assert_untouched(ctx, &r, 1);
  /* a failed context: its error stands, nothing runs */
  kiln_eval_end(ctx);
  cr_assert_eq(kiln_evaluate(ctx, l, probe_forward, &p, NULL, &r), KILN_ERR_STATE);
  TH_ASSERT_ERROR(ctx, KILN_ERR_STATE, "kiln_eval_end");
  kiln_ctx_clear_error(ctx);
  cr_assert_eq(p.calls, 0);
  cr_assert_eq(kiln_evaluate(NULL, l, probe_forward, &p, NULL, &r), KILN_ERR_INVALID);
  assert_untouched(ctx, &r, 1);
  kiln_loader_free(empty);
  kiln_loader_free(ol);
  kiln_loader_free(l);
  kiln_params_free(params);
  kiln_dataset_free(ods);
  kiln_dataset_free(ds);
  th_ctx_free(other);
  th_ctx_free(ctx);
}

Test(evaluate, a_bad_forward_is_an_error_that_changes_nothing, .timeout = 300) {
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_dataset *ds = ten_images(ctx);
  kiln_params *params = kiln_params_new(ctx);
  probe p = {0};
  cr_assert_eq(
      kiln_linear_init(&p.fc, params, &(kiln_linear_options){.name = "fc", .in = 4, .out = 3}),
      KILN_OK);
  kiln_loader *l = kiln_loader_new(ds, &(kiln_loader_options){.batch = 4});
  cr_assert_not_null(l, "%s", th_err(ctx));
  struct {
    int mode;
    kiln_status status;
    int calls; /* forward calls before the error */
    const char *what, *what2;
  } cases[] = {
      {NULL_QUIET, KILN_ERR_INVALID, 1, "forward returned NULL for batch 0 (x [4,2,2,1])",
       "no error"},
      {ROWS, KILN_ERR_SHAPE, 1, "forward gave [3,3] for batch 0", "must be (4, C)"},
      {RANK, KILN_ERR_SHAPE, 1, "forward gave [4,3,1]", "must be (4, C)"},
      {INT_LOGITS, KILN_ERR_DTYPE, 1, "i32 logits [4,1]", "f32 or bf16"},
      {CLASSES, KILN_ERR_SHAPE, 2, "[4,2] for batch 1, 2 classes", "batch 0's logits had 3"},
      {FAILING_OP, KILN_ERR_SHAPE, 1, "kiln_matmul", "[4,3]"},
      {LEAVES_CAST, KILN_ERR_STATE, 1, "kiln_step_end: 1 autocast region is open", ""},
  };
  for (int training = 1; training >= 0; training--) {
    kiln_set_training(ctx, training);
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
      p.mode = cases[k].mode;
      p.calls = 0;
      kiln_eval_result r = sentinel();
      cr_assert_eq(kiln_evaluate(ctx, l, probe_forward, &p, NULL, &r), cases[k].status,
                   "case %zu: %s", k, th_err(ctx));
      TH_ASSERT_ERROR(ctx, cases[k].status, cases[k].what, cases[k].what2);
      kiln_ctx_clear_error(ctx);
      if (p.mode == LEAVES_CAST) kiln_autocast_end(ctx); /* the forward's own region */
      th_assert_ok(ctx);
      assert_untouched(ctx, &r, training);
      cr_assert_eq(p.calls, cases[k].calls, "case %zu: %d calls", k, p.calls);
      /* the failed step is closed: a step of the caller's own runs */
      kiln_step_begin(ctx);
      cr_assert_not_null(kiln_relu(kiln_dataset_images(ds)));
      cr_assert_eq(kiln_step_end(ctx), KILN_OK, "case %zu: %s", k, th_err(ctx));
    }
  }
  kiln_set_training(ctx, 1);
  cr_assert_eq(batches_left(ctx, l), 3, "the loader moved");
  kiln_loader_free(l);
  kiln_params_free(params);
  kiln_dataset_free(ds);
  th_ctx_free(ctx);
}
