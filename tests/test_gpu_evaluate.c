/*
 * test_gpu_evaluate.c: kiln_evaluate on the GPU against a float64 reference: the mean
 * cross-entropy (with and without label smoothing) and the count of correct predictions of a
 * linear classifier over a loader's epoch, in order, shuffled and with drop_last; the forward
 * pass in evaluation mode (a dropout layer passes its input through) and the training mode given
 * back; the loader left where it was; a second evaluation replaying the first one's step graphs;
 * a module through kiln_module_call; a bf16 autocast forward pass; a label out of range reported
 * as an error that leaves the result alone; a count past 2^24 samples, still exact. Skips without
 * a GPU.
 */
#include <math.h>
#include <string.h>

#include "helpers.h"

enum { N = 50, F = 6, C = 4, B = 16 }; /* samples of (2, 3, 1), classes, batch */

typedef struct model {
  kiln_linear fc;  /* F -> C */
  float drop;      /* dropout after it, following the training mode (0: none) */
  kiln_dtype seen; /* the last logits' dtype */
} model;

static kiln_tensor *model_forward(void *p, kiln_tensor *x) {
  model *m = p;
  kiln_tensor *z = kiln_linear_forward(&m->fc, kiln_flatten(x)); /* (B, C) */
  if (m->drop > 0.f) z = kiln_dropout(z, m->drop, KILN_TRAINING_MODE);
  if (z) m->seen = kiln_tensor_dtype(z);
  return z;
}

/* The data and the weights, and the float64 reference's per-sample logits. */
typedef struct fixture {
  float x[N * F], w[C * F], b[C];
  int32_t y[N];
  double z[N][C];
} fixture;

static void fixture_init(fixture *f) {
  th_fill(f->x, N * F, 3, -1.f, 1.f);
  th_fill(f->w, C * F, 4, -1.f, 1.f);
  th_fill(f->b, C, 5, -0.5f, 0.5f);
  th_rng r = {.s = 6};
  for (int i = 0; i < N; i++)
    f->y[i] = th_rng_below(&r, C);
  for (int i = 0; i < N; i++)
    for (int c = 0; c < C; c++) {
      double s = f->b[c];
      for (int k = 0; k < F; k++)
        s += (double)f->x[i * F + k] * f->w[c * F + k];
      f->z[i][c] = s;
    }
}

/* The reference over samples [0, n): mean loss (label smoothing ls) and correct predictions;
 * *close counts the samples whose two largest logits are within margin. */
static double ref_eval(const fixture *f, int n, double ls, int64_t *correct, double margin,
                       int *close) {
  double loss = 0;
  *correct = 0;
  if (close) *close = 0;
  for (int i = 0; i < n; i++) {
    double m = f->z[i][0], lse = 0, mean_nll = 0;
    int arg = 0;
    for (int c = 1; c < C; c++)
      if (f->z[i][c] > m) m = f->z[i][c], arg = c;
    for (int c = 0; c < C; c++)
      lse += exp(f->z[i][c] - m);
    lse = m + log(lse);
    for (int c = 0; c < C; c++)
      mean_nll += (lse - f->z[i][c]) / C;
    loss += (1 - ls) * (lse - f->z[i][f->y[i]]) + ls * mean_nll;
    *correct += arg == f->y[i];
    double second = -INFINITY;
    for (int c = 0; c < C; c++)
      if (c != arg && f->z[i][c] > second) second = f->z[i][c];
    if (close && m - second < margin) (*close)++;
  }
  return loss / n;
}

static kiln_exec_stats stats_of(kiln_ctx *ctx) {
  kiln_exec_stats s;
  kiln_stats(ctx, &s);
  return s;
}

static void set_weights(model *m, const fixture *f) {
  cr_assert_eq(kiln_tensor_copy_from_host(m->fc.weight, f->w, sizeof f->w), KILN_OK);
  cr_assert_eq(kiln_tensor_copy_from_host(m->fc.bias, f->b, sizeof f->b), KILN_OK);
}

Test(gpu_evaluate, loss_and_accuracy_match_a_float64_reference, .timeout = 300) {
  TH_GPU_CTX(ctx);
  static fixture f;
  fixture_init(&f);
  int64_t want_correct, correct48;
  int close;
  double want = ref_eval(&f, N, 0, &want_correct, 1e-3, &close);
  cr_assert_eq(close, 0, "the test data has near ties: pick other seeds");
  double want48 = ref_eval(&f, 48, 0, &correct48, 0, NULL);
  double want_ls = ref_eval(&f, N, 0.2, &(int64_t){0}, 0, NULL);
  cr_assert(want_correct > 0 && want_correct < N, "a classifier neither all right nor all wrong");
  kiln_dataset *ds = kiln_dataset_from_host(ctx, KILN_HOST_F32, KILN_SHAPE(N, 2, 3, 1), f.x,
                                            (kiln_host_labels){.i32 = f.y, .classes = C}, NULL);
  kiln_params *p = kiln_params_new(ctx);
  model m = {0};
  cr_assert_eq(kiln_linear_init(&m.fc, p, &(kiln_linear_options){.name = "fc", .in = F, .out = C}),
               KILN_OK);
  set_weights(&m, &f);
  kiln_loader *in_order =
      kiln_loader_new(ds, &(kiln_loader_options){.batch = B}); /* 16, 16, 16, 2 */
  kiln_loader *shuffled = kiln_loader_new(
      ds, &(kiln_loader_options){.batch = B, .shuffle = 1, .seed = 9}); /* the same samples */
  kiln_loader *dropping =
      kiln_loader_new(ds, &(kiln_loader_options){.batch = B, .drop_last = 1}); /* the first 48 */
  cr_assert(ds && in_order && shuffled && dropping, "%s", th_err(ctx));
  struct {
    kiln_loader *l;
    kiln_eval_options o;
    double loss;
    int64_t correct, samples;
  } cases[] = {
      {in_order, {0}, want, want_correct, N},
      {shuffled, {0}, want, want_correct, N},
      {dropping, {0}, want48, correct48, 48},
      {in_order, {.label_smoothing = 0.2f}, want_ls, want_correct, N},
      {in_order, {.loss = KILN_EVAL_NO_LOSS}, NAN, want_correct, N},
  };
  for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
    kiln_eval_result r;
    cr_assert_eq(kiln_evaluate(ctx, cases[k].l, model_forward, &m, &cases[k].o, &r), KILN_OK,
                 "case %zu: %s", k, th_err(ctx));
    cr_assert_eq(r.samples, cases[k].samples, "case %zu: %lld samples", k, (long long)r.samples);
    cr_assert_eq(r.correct, cases[k].correct, "case %zu: %lld correct, want %lld", k,
                 (long long)r.correct, (long long)cases[k].correct);
    cr_assert_float_eq(r.accuracy, (double)cases[k].correct / (double)cases[k].samples, 1e-12);
    if (isnan(cases[k].loss))
      cr_assert(isnan(r.loss), "case %zu: no loss asked for, %g given", k, r.loss);
    else
      cr_assert(fabs(r.loss - cases[k].loss) <= 1e-5 * cases[k].loss + 1e-6,
                "case %zu: loss %.9g, want %.9g", k, r.loss, cases[k].loss);
    cr_assert(kiln_training(ctx) && kiln_grad_enabled(ctx), "case %zu: modes not given back", k);
  }
  kiln_loader_free(dropping);
  kiln_loader_free(shuffled);
  kiln_loader_free(in_order);
  kiln_params_free(p);
  kiln_dataset_free(ds);
  th_ctx_free(ctx);
}

/* Dropout is off inside (evaluation mode), the training mode comes back, the loader stays where
 * it was, and a second evaluation of the same loader replays the step graphs of the first. */
Test(gpu_evaluate, evaluation_mode_an_unmoved_loader_and_replayed_graphs, .timeout = 300) {
  TH_GPU_CTX(ctx);
  static fixture f;
  fixture_init(&f);
  int64_t want_correct;
  double want = ref_eval(&f, N, 0, &want_correct, 0, NULL);
  kiln_dataset *ds = kiln_dataset_from_host(ctx, KILN_HOST_F32, KILN_SHAPE(N, 2, 3, 1), f.x,
                                            (kiln_host_labels){.i32 = f.y}, NULL);
  kiln_params *p = kiln_params_new(ctx);
  model m = {.drop = 0.5f};
  cr_assert_eq(kiln_linear_init(&m.fc, p, &(kiln_linear_options){.name = "fc", .in = F, .out = C}),
               KILN_OK);
  set_weights(&m, &f);
  kiln_loader *l = kiln_loader_new(ds, &(kiln_loader_options){.batch = B});
  cr_assert_not_null(l, "%s", th_err(ctx));
  /* the loader one batch into its epoch */
  kiln_step_begin(ctx);
  kiln_tensor *x, *y;
  cr_assert(kiln_loader_next(l, &x, &y));
  cr_assert_eq(kiln_step_end(ctx), KILN_OK, "%s", th_err(ctx));
  kiln_eval_result r[3];
  kiln_exec_stats s[3];
  for (int k = 0; k < 3; k++) {
    s[k] = stats_of(ctx);
    cr_assert_eq(kiln_evaluate(ctx, l, model_forward, &m, NULL, &r[k]), KILN_OK, "%s", th_err(ctx));
    cr_assert(kiln_training(ctx), "the training mode was not given back");
    cr_assert_eq(r[k].correct, want_correct, "dropout ran: %lld correct, want %lld",
                 (long long)r[k].correct, (long long)want_correct);
    cr_assert(fabs(r[k].loss - want) <= 1e-5 * want + 1e-6, "loss %.9g, want %.9g", r[k].loss,
              want);
  }
  cr_assert(r[1].loss == r[0].loss && r[2].loss == r[0].loss, "evaluations differ");
  if (kiln_graphs(ctx)) {
    kiln_exec_stats end = stats_of(ctx);
    cr_assert_eq(end.graph_captures, s[2].graph_captures, "the third evaluation captured a graph");
    cr_assert_eq(end.graph_replays - s[2].graph_replays, 4, "%llu replays for 4 batches",
                 (unsigned long long)(end.graph_replays - s[2].graph_replays));
  }
  /* the loader goes on with its second batch: rows 16 to 31 */
  kiln_step_begin(ctx);
  cr_assert(kiln_loader_next(l, &x, &y));
  cr_assert_eq(kiln_step_end(ctx), KILN_OK, "%s", th_err(ctx));
  float *xv = th_read(x);
  cr_assert(memcmp(xv, f.x + B * F, sizeof(float) * B * F) == 0, "not the loader's second batch");
  free(xv);
  kiln_loader_free(l);
  kiln_params_free(p);
  kiln_dataset_free(ds);
  th_ctx_free(ctx);
}

/* A module through kiln_module_call gives what the same layer gives through a callback of one's
 * own; a bf16 autocast forward pass comes close to the f32 reference. */
Test(gpu_evaluate, a_module_and_a_bf16_forward_pass, .timeout = 300) {
  TH_GPU_CTX(ctx);
  static fixture f;
  fixture_init(&f);
  int64_t want_correct;
  int close;
  double want = ref_eval(&f, N, 0, &want_correct, 0.1, &close);
  kiln_dataset *ds = kiln_dataset_from_host(ctx, KILN_HOST_F32, KILN_SHAPE(N, 2, 3, 1), f.x,
                                            (kiln_host_labels){.i32 = f.y, .classes = C}, NULL);
  kiln_loader *l = kiln_loader_new(ds, &(kiln_loader_options){.batch = B});
  kiln_params *p = kiln_params_new(ctx);
  model m = {0};
  cr_assert_eq(kiln_linear_init(&m.fc, p, &(kiln_linear_options){.name = "fc", .in = F, .out = C}),
               KILN_OK);
  set_weights(&m, &f);
  kiln_module *net = kiln_sequential_new(p);
  kiln_seq_flatten(net);
  kiln_seq_linear(net, &(kiln_linear_options){.name = "head", .in = F, .out = C});
  cr_assert_not_null(l, "%s", th_err(ctx));
  cr_assert_eq(kiln_tensor_copy_from_host(kiln_params_find(p, "head.weight"), f.w, sizeof f.w),
               KILN_OK);
  cr_assert_eq(kiln_tensor_copy_from_host(kiln_params_find(p, "head.bias"), f.b, sizeof f.b),
               KILN_OK);
  kiln_eval_result a, b;
  cr_assert_eq(kiln_evaluate(ctx, l, model_forward, &m, NULL, &a), KILN_OK, "%s", th_err(ctx));
  cr_assert_eq(kiln_evaluate(ctx, l, kiln_module_call, net, NULL, &b), KILN_OK, "%s", th_err(ctx));
  cr_assert(a.loss == b.loss && a.correct == b.correct,
            "module: loss %.9g, %lld correct; "
            "callback: %.9g, %lld",
            b.loss, (long long)b.correct, a.loss, (long long)a.correct);
  /* bf16: the logits are bf16, the loss within bf16's rounding, and only near ties may flip */
  kiln_eval_result h;
  cr_assert_eq(kiln_evaluate(ctx, l, model_forward, &m,
                             &(kiln_eval_options){.autocast = KILN_DTYPE_BF16}, &h),
               KILN_OK, "%s", th_err(ctx));
  cr_assert_eq(m.seen, KILN_DTYPE_BF16, "the forward pass ran outside an autocast region");
  cr_assert(fabs(h.loss - want) <= 2e-2 * want, "bf16 loss %.6g, want %.6g", h.loss, want);
  cr_assert(llabs(h.correct - want_correct) <= close, "bf16: %lld correct, want %lld (+-%d)",
            (long long)h.correct, (long long)want_correct, close);
  kiln_module_free(net);
  kiln_loader_free(l);
  kiln_params_free(p);
  kiln_dataset_free(ds);
  th_ctx_free(ctx);
}

/* A label the logits have no class for is found on the device and reported when the sums are
 * read: an error naming it, the result untouched, the modes given back; accuracy alone counts it
 * as a wrong prediction. */
Test(gpu_evaluate, a_label_out_of_range_is_an_error, .timeout = 300) {
  TH_GPU_CTX(ctx);
  static fixture f;
  fixture_init(&f);
  int64_t want_correct;
  ref_eval(&f, N, 0, &want_correct, 0, NULL);
  /* sample 0's label becomes C; was it predicted right before? (the first maximum wins) */
  int bad = 0, arg = 0;
  for (int c = 1; c < C; c++)
    if (f.z[bad][c] > f.z[bad][arg]) arg = c;
  int was_right = arg == f.y[bad];
  f.y[bad] = C;
  kiln_dataset *ds = kiln_dataset_from_host(ctx, KILN_HOST_F32, KILN_SHAPE(N, 2, 3, 1), f.x,
                                            (kiln_host_labels){.i32 = f.y}, NULL);
  kiln_loader *l = kiln_loader_new(ds, &(kiln_loader_options){.batch = B});
  kiln_params *p = kiln_params_new(ctx);
  model m = {0};
  cr_assert_eq(kiln_linear_init(&m.fc, p, &(kiln_linear_options){.name = "fc", .in = F, .out = C}),
               KILN_OK);
  set_weights(&m, &f);
  cr_assert_not_null(l, "%s", th_err(ctx));
  kiln_eval_result r, s;
  memset(&r, 0x5a, sizeof r);
  s = r;
  cr_assert_neq(kiln_evaluate(ctx, l, model_forward, &m, NULL, &r), KILN_OK);
  char want[64];
  snprintf(want, sizeof want, "a label is %d", C);
  cr_assert_not_null(strstr(th_err(ctx), want), "%s", th_err(ctx));
  cr_assert(memcmp(&r, &s, sizeof r) == 0, "the result was written");
  cr_assert(kiln_training(ctx) && kiln_grad_enabled(ctx));
  kiln_ctx_clear_error(ctx);
  cr_assert_eq(
      kiln_evaluate(ctx, l, model_forward, &m, &(kiln_eval_options){.loss = KILN_EVAL_NO_LOSS}, &r),
      KILN_OK, "%s", th_err(ctx));
  cr_assert_eq(r.correct, want_correct - was_right);
  kiln_loader_free(l);
  kiln_params_free(p);
  kiln_dataset_free(ds);
  th_ctx_free(ctx);
}

/* Past 2^24 samples an f32 count stops holding every integer: the sums are read out before
 * then, so the count stays exact. 2^24 + 1001 samples of one value, x = 1, whose logits are
 * (-1, 1); every 100000th label is 0 (wrong), the others 1 (right): 2^24 + 833 right, an odd
 * count that no f32 holds. */
Test(gpu_evaluate, counts_past_2_24_samples_stay_exact, .timeout = 300) {
  TH_GPU_CTX(ctx);
  const int64_t n = ((int64_t)1 << 24) + 1001, wrong = (n + 99999) / 100000;
  float *x = malloc((size_t)n * sizeof *x);
  int32_t *y = malloc((size_t)n * sizeof *y);
  cr_assert(x && y);
  for (int64_t i = 0; i < n; i++) {
    x[i] = 1.f;
    y[i] = i % 100000 != 0;
  }
  kiln_dataset *ds = kiln_dataset_from_host(ctx, KILN_HOST_F32, KILN_SHAPE(n, 1), x,
                                            (kiln_host_labels){.i32 = y, .classes = 2}, NULL);
  free(x);
  free(y);
  kiln_loader *l =
      kiln_loader_new(ds, &(kiln_loader_options){.batch = (int64_t)1 << 20}); /* 17 batches */
  kiln_params *p = kiln_params_new(ctx);
  model m = {0};
  cr_assert_eq(kiln_linear_init(&m.fc, p, &(kiln_linear_options){.name = "fc", .in = 1, .out = 2}),
               KILN_OK);
  float w[2] = {-1.f, 1.f}, b[2] = {0.f, 0.f};
  cr_assert_eq(kiln_tensor_copy_from_host(m.fc.weight, w, sizeof w), KILN_OK);
  cr_assert_eq(kiln_tensor_copy_from_host(m.fc.bias, b, sizeof b), KILN_OK);
  cr_assert(ds && l, "%s", th_err(ctx));
  kiln_eval_result r;
  cr_assert_eq(kiln_evaluate(ctx, l, model_forward, &m, NULL, &r), KILN_OK, "%s", th_err(ctx));
  cr_assert_eq(n - wrong, ((int64_t)1 << 24) + 833);
  cr_assert_eq(r.samples, n);
  cr_assert_eq(r.correct, n - wrong, "%lld correct, want %lld", (long long)r.correct,
               (long long)(n - wrong));
  double right = log1p(exp(-2.0)), bad = log1p(exp(2.0));
  double want = ((double)(n - wrong) * right + (double)wrong * bad) / (double)n;
  cr_assert(fabs(r.loss - want) <= 1e-4 * want, "loss %.9g, want %.9g", r.loss, want);
  kiln_loader_free(l);
  kiln_params_free(p);
  kiln_dataset_free(ds);
  th_ctx_free(ctx);
}
