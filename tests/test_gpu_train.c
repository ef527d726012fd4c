/*
 * test_gpu_train.c: optimizers against float64 references of PyTorch's update rules, failed steps
 * that must leave parameters untouched (out of memory, bad shapes), layers' init, data loading on
 * the device, step lifetimes, and a short MNIST run that must learn (its test loss and accuracy
 * counted by a loop of its own and by kiln_evaluate alike).
 */
#include <math.h>
#include <string.h>

#include "helpers.h"

#define N 37 /* parameter elements: not a multiple of a warp or a vector */

/* loss = sum(p * w) + 0.5 * sum(q * p^2): its gradient is w + q * p, known on the host. */
static kiln_tensor *quad_loss(kiln_tensor *p, kiln_tensor *w, kiln_tensor *q) {
  return kiln_add(kiln_sum(kiln_mul(p, w), KILN_ALL_AXES, 0),
                  kiln_mul_scalar(kiln_sum(kiln_mul(q, kiln_mul(p, p)), KILN_ALL_AXES, 0), 0.5f));
}

typedef struct opt_case {
  const char *name;
  int adam; /* 0 SGD, 1 Adam, 2 AdamW */
  kiln_sgd_options sgd;
  kiln_adam_options ad;
} opt_case;

/* Runs five steps in kiln and in a float64 transcription of torch.optim's single-tensor rules. */
static void check_optimizer(const opt_case *c) {
  TH_GPU_CTX(ctx);
  float *ph, *wh, *qh;
  kiln_tensor *p = th_rand(ctx, KILN_SHAPE(N), 1, -1.f, 1.f, &ph);
  kiln_tensor *w = th_rand(ctx, KILN_SHAPE(N), 2, -1.f, 1.f, &wh);
  kiln_tensor *q = th_rand(ctx, KILN_SHAPE(N), 3, 0.1f, 1.f, &qh);
  kiln_tensor_set_requires_grad(p, 1);
  kiln_params *params = kiln_params_new(ctx);
  cr_assert_eq(kiln_params_add(params, "p", p), KILN_OK);
  kiln_optim *o = c->adam == 0   ? kiln_sgd_new(params, &c->sgd)
                  : c->adam == 1 ? kiln_adam_new(params, &c->ad)
                                 : kiln_adamw_new(params, &c->ad);
  cr_assert_not_null(o, "%s: %s", c->name, kiln_ctx_error(ctx));
  double P[N], M1[N] = {0}, M2[N] = {0};
  for (int i = 0; i < N; i++)
    P[i] = ph[i];
  for (int t = 1; t <= 5; t++) {
    kiln_step_begin(ctx);
    kiln_optim_zero_grad(o);
    cr_assert_eq(kiln_backward(quad_loss(p, w, q)), KILN_OK, "%s", kiln_ctx_error(ctx));
    cr_assert_eq(kiln_optim_step(o), KILN_OK, "%s", kiln_ctx_error(ctx));
    cr_assert_eq(kiln_step_end(ctx), KILN_OK, "%s", kiln_ctx_error(ctx));
    for (int i = 0; i < N; i++) {
      double g = wh[i] + qh[i] * P[i];
      if (c->adam == 0) {
        const kiln_sgd_options *s = &c->sgd;
        double d = g + s->weight_decay * P[i];
        if (s->momentum > 0) {
          M1[i] = t == 1 ? d : s->momentum * M1[i] + (1 - s->dampening) * d;
          d = s->nesterov ? d + s->momentum * M1[i] : M1[i];
        }
        P[i] -= s->lr * d;
      } else {
        const kiln_adam_options *a = &c->ad;
        if (c->adam == 2)
          P[i] *= 1 - a->lr * a->weight_decay;
        else
          g += a->weight_decay * P[i];
        M1[i] = a->beta1 * M1[i] + (1 - a->beta1) * g;
        M2[i] = a->beta2 * M2[i] + (1 - a->beta2) * g * g;
        double bc1 = 1 - pow(a->beta1, t), bc2 = 1 - pow(a->beta2, t);
        P[i] -= (a->lr / bc1) * M1[i] / (sqrt(M2[i]) / sqrt(bc2) + a->eps);
      }
    }
  }
  float *got = th_read(p);
  th_assert_close(got, P, N, 1e-5, 1e-4, c->name);
  cr_assert_eq(kiln_optim_steps(o), 5);
  free(got);
  free(ph);
  free(wh);
  free(qh);
  kiln_optim_free(o);
  kiln_params_free(params);
  kiln_tensor_free(w);
  kiln_tensor_free(q);
  th_ctx_free(ctx);
}

Test(gpu_train, sgd_plain) {
  opt_case c = {.name = "sgd", .sgd = kiln_sgd_defaults(0.1f)};
  check_optimizer(&c);
}
Test(gpu_train, sgd_momentum_dampening_weight_decay) {
  opt_case c = {.name = "sgd momentum", .sgd = kiln_sgd_defaults(0.05f)};
  c.sgd.momentum = 0.8f;
  c.sgd.dampening = 0.3f;
  c.sgd.weight_decay = 0.01f;
  check_optimizer(&c);
}
Test(gpu_train, sgd_nesterov) {
  opt_case c = {.name = "sgd nesterov", .sgd = kiln_sgd_defaults(0.05f)};
  c.sgd.momentum = 0.9f;
  c.sgd.nesterov = 1;
  c.sgd.weight_decay = 5e-4f;
  check_optimizer(&c);
}
Test(gpu_train, adam) {
  opt_case c = {.name = "adam", .adam = 1, .ad = kiln_adam_defaults()};
  c.ad.lr = 0.01f;
  c.ad.weight_decay = 0.1f;
  check_optimizer(&c);
}
Test(gpu_train, adamw) {
  opt_case c = {.name = "adamw", .adam = 2, .ad = kiln_adamw_defaults()};
  c.ad.lr = 0.01f;
  c.ad.beta1 = 0.7f; /* the fast MNIST recipe's betas */
  c.ad.beta2 = 0.9f;
  check_optimizer(&c);
}

Test(gpu_train, optimizer_bad_options) {
  TH_GPU_CTX(ctx);
  kiln_params *params = kiln_params_new(ctx);
  kiln_sgd_options s = kiln_sgd_defaults(0.1f);
  s.nesterov = 1; /* without momentum: PyTorch refuses it too */
  cr_assert_null(kiln_sgd_new(params, &s));
  cr_assert_eq(kiln_ctx_status(ctx), KILN_ERR_INVALID);
  cr_assert(strstr(kiln_ctx_error(ctx), "Nesterov") != NULL, "%s", kiln_ctx_error(ctx));
  kiln_ctx_clear_error(ctx);
  kiln_adam_options a = kiln_adam_defaults();
  a.beta2 = 1.f;
  cr_assert_null(kiln_adam_new(params, &a));
  cr_assert(strstr(kiln_ctx_error(ctx), "betas") != NULL, "%s", kiln_ctx_error(ctx));
  kiln_params_free(params);
  th_ctx_free(ctx);
}

/* A small model, its parameters and one training step that may be made to fail. */
typedef struct small {
  kiln_params *params;
  kiln_linear l1, l2;
  kiln_optim *opt;
  kiln_tensor *x, *y;
} small;

static void small_init(kiln_ctx *ctx, small *m) {
  m->params = kiln_params_new(ctx);
  cr_assert_eq(kiln_linear_init(&m->l1, m->params,
                                &(kiln_linear_options){.name = "l1", .in = 20, .out = 16}),
               KILN_OK);
  cr_assert_eq(
      kiln_linear_init(&m->l2, m->params, &(kiln_linear_options){.name = "l2", .in = 16, .out = 5}),
      KILN_OK);
  kiln_sgd_options s = kiln_sgd_defaults(0.1f);
  s.momentum = 0.9f;
  m->opt = kiln_sgd_new(m->params, &s);
  m->x = th_rand(ctx, KILN_SHAPE(8, 20), 11, -1.f, 1.f, NULL);
  int32_t lab[8] = {0, 1, 2, 3, 4, 0, 1, 2};
  m->y = kiln_tensor_from_host(ctx, KILN_DTYPE_I32, KILN_SHAPE(8), lab);
  cr_assert_not_null(m->opt);
  cr_assert_not_null(m->y);
}

static kiln_tensor *small_loss(small *m) {
  kiln_tensor *h = kiln_relu(kiln_linear_forward(&m->l1, m->x));
  return kiln_cross_entropy(kiln_linear_forward(&m->l2, h), m->y, KILN_REDUCTION_MEAN, 0.f);
}

/* Records forward, backward and update; the caller ends the step. */
static void small_record_step(small *m) {
  kiln_optim_zero_grad(m->opt);
  kiln_backward(small_loss(m));
  kiln_optim_step(m->opt);
}

static void small_free(small *m) {
  kiln_optim_free(m->opt);
  kiln_params_free(m->params);
  kiln_tensor_free(m->x);
  kiln_tensor_free(m->y);
}

static int count_changed(const float *a, const float *b, int64_t n) {
  int c = 0;
  for (int64_t i = 0; i < n; i++)
    c += a[i] != b[i];
  return c;
}

Test(gpu_train, out_of_memory_step_changes_nothing) {
  TH_GPU_CTX(ctx);
  small m;
  small_init(ctx, &m);
  int64_t n;
  float *before = th_params_values(m.params, &n);
  kiln_exec_stats s0, s1;
  kiln_stats(ctx, &s0);
  kiln_step_begin(ctx);
  small_record_step(&m);
  /* 2^38 floats = 1 TiB: more than any GPU holds */
  kiln_tensor *huge = kiln_full(ctx, KILN_SHAPE(1 << 19, 1 << 19), 1.f);
  cr_assert_not_null(huge);
  kiln_status st = kiln_step_end(ctx);
  cr_assert_eq(st, KILN_ERR_OOM, "status %s: %s", kiln_status_name(st), kiln_ctx_error(ctx));
  cr_assert(strstr(kiln_ctx_error(ctx), "out of device memory") != NULL, "%s", kiln_ctx_error(ctx));
  cr_assert(strstr(kiln_ctx_error(ctx), "[524288,524288]") != NULL, "%s", kiln_ctx_error(ctx));
  kiln_stats(ctx, &s1);
  cr_assert_eq(s1.kernels_launched, s0.kernels_launched, "a failed step launched kernels");
  kiln_ctx_clear_error(ctx);
  float *after = th_params_values(m.params, &n);
  cr_assert_eq(count_changed(before, after, n), 0, "parameters changed by a failed step");
  /* the context is usable: a good step changes the parameters */
  kiln_step_begin(ctx);
  small_record_step(&m);
  cr_assert_eq(kiln_step_end(ctx), KILN_OK, "%s", kiln_ctx_error(ctx));
  float *later = th_params_values(m.params, &n);
  cr_assert_gt(count_changed(before, later, n), n / 2);
  /* a persistent tensor that does not fit is an error, not a crash, and leaves the ctx usable */
  kiln_tensor *big = kiln_tensor_new(ctx, KILN_DTYPE_F32, KILN_SHAPE(1 << 19, 1 << 19));
  cr_assert_null(big);
  cr_assert_eq(kiln_ctx_status(ctx), KILN_ERR_OOM);
  kiln_ctx_clear_error(ctx);
  kiln_tensor *ok = kiln_tensor_new(ctx, KILN_DTYPE_F32, KILN_SHAPE(1000));
  cr_assert_not_null(ok, "%s", kiln_ctx_error(ctx));
  kiln_tensor_free(ok);
  free(before);
  free(after);
  free(later);
  small_free(&m);
  th_ctx_free(ctx);
}

Test(gpu_train, bad_shape_step_changes_nothing) {
  TH_GPU_CTX(ctx);
  small m;
  small_init(ctx, &m);
  int64_t n;
  float *before = th_params_values(m.params, &n);
  kiln_step_begin(ctx);
  small_record_step(&m);
  kiln_tensor *bad = kiln_matmul(m.x, m.x); /* (8,20) x (8,20) */
  cr_assert_null(bad);
  cr_assert_str_eq(kiln_ctx_error(ctx), "kiln_matmul: inner dims differ: [8,20] x [8,20]");
  cr_assert_null(kiln_relu(bad)); /* the chain fails once */
  cr_assert_eq(kiln_step_end(ctx), KILN_ERR_SHAPE);
  kiln_ctx_clear_error(ctx);
  float *after = th_params_values(m.params, &n);
  cr_assert_eq(count_changed(before, after, n), 0, "parameters changed by a failed step");
  free(before);
  free(after);
  small_free(&m);
  th_ctx_free(ctx);
}

Test(gpu_train, linear_init_matches_pytorch_bounds) {
  TH_GPU_CTX(ctx);
  kiln_params *p = kiln_params_new(ctx);
  kiln_linear l;
  cr_assert_eq(kiln_linear_init(&l, p, &(kiln_linear_options){.name = "fc", .in = 784, .out = 512}),
               KILN_OK);
  float *w = th_read(l.weight), *b = th_read(l.bias);
  double bound = 1.0 / sqrt(784.0), s = 0, s2 = 0, mx = 0;
  int64_t n = 784 * 512;
  for (int64_t i = 0; i < n; i++) {
    s += w[i];
    s2 += (double)w[i] * w[i];
    if (fabs(w[i]) > mx) mx = fabs(w[i]);
  }
  cr_assert_leq(mx, bound);
  cr_assert_gt(mx, 0.99 * bound);
  cr_assert_lt(fabs(s / n), 0.01 * bound);
  cr_assert_lt(fabs(sqrt(s2 / n) - bound / sqrt(3.0)), 0.01 * bound);
  for (int i = 0; i < 512; i++)
    cr_assert_leq(fabs(b[i]), bound);
  cr_assert_str_eq(kiln_params_name(p, 0), "fc.weight");
  cr_assert_str_eq(kiln_params_name(p, 1), "fc.bias");
  cr_assert_eq(kiln_params_numel(p), 784 * 512 + 512);
  free(w);
  free(b);
  kiln_params_free(p);
  th_ctx_free(ctx);
}

/* A synthetic MNIST-format set whose first pixel and label encode the record's index. */
static void synthetic(kiln_mnist *m, int64_t n) {
  m->n = n;
  m->rows = 2;
  m->cols = 2;
  m->images = calloc((size_t)n * 4, 1);
  m->labels = malloc((size_t)n);
  for (int64_t i = 0; i < n; i++) {
    m->images[i * 4] = (uint8_t)i;
    m->images[i * 4 + 3] = 255;
    m->labels[i] = (uint8_t)(i % 10);
  }
}

Test(gpu_train, loader_covers_every_record_once_per_epoch) {
  TH_GPU_CTX(ctx);
  kiln_mnist m;
  synthetic(&m, 250);
  kiln_dataset *ds = kiln_dataset_from_mnist(ctx, &m, 0.f, 1.f);
  cr_assert_not_null(ds, "%s", kiln_ctx_error(ctx));
  kiln_loader *l =
      kiln_loader_new(ds, &(kiln_loader_options){.batch = 64, .shuffle = 1, .seed = 5});
  cr_assert_eq(kiln_loader_batches(l), 4);
  int first_epoch[250];
  for (int epoch = 0; epoch < 2; epoch++) {
    int seen[250] = {0}, order[250], k = 0, nb = 0;
    kiln_loader_start(l, epoch);
    kiln_tensor *x, *y;
    for (;;) {
      kiln_step_begin(ctx);
      if (!kiln_loader_next(l, &x, &y)) break;
      int64_t b = kiln_tensor_dim(x, 0);
      cr_assert_eq(b, nb < 3 ? 64 : 250 - 192, "batch %d has %lld rows", nb, (long long)b);
      cr_assert_eq(kiln_step_end(ctx), KILN_OK, "%s", kiln_ctx_error(ctx));
      float *xv = th_read(x);
      int32_t *yv = th_read_i32(y);
      for (int64_t i = 0; i < b; i++) {
        int idx = (int)lroundf(xv[i * 4] * 255.f);
        cr_assert_float_eq(xv[i * 4 + 3], 1.f, 1e-6);
        cr_assert_eq(yv[i], idx % 10, "labels follow their images");
        seen[idx]++;
        order[k++] = idx;
      }
      free(xv);
      free(yv);
      nb++;
    }
    cr_assert_eq(nb, 4);
    for (int i = 0; i < 250; i++)
      cr_assert_eq(seen[i], 1, "record %d seen %d times", i, seen[i]);
    if (epoch == 0) {
      memcpy(first_epoch, order, sizeof order);
      int inplace = 0;
      for (int i = 0; i < 250; i++)
        inplace += order[i] == i;
      cr_assert_lt(inplace, 20, "the order is not shuffled");
    } else {
      cr_assert_neq(memcmp(first_epoch, order, sizeof order), 0, "epochs reshuffle");
    }
  }
  kiln_loader_free(l);
  kiln_dataset_free(ds);
  kiln_mnist_free(&m);
  th_ctx_free(ctx);
}

Test(gpu_train, step_releases_intermediates_and_stales_handles) {
  /* eager steps give their memory back; a graph keeps its arena (test_gpu_graph.c) */
  TH_GPU_CTX_EAGER(ctx);
  kiln_tensor *a = th_rand(ctx, KILN_SHAPE(1000, 100), 4, -1.f, 1.f, NULL);
  /* a first flush makes the context's step-values buffer, which stays */
  kiln_step_begin(ctx);
  (void)kiln_neg(a);
  cr_assert_eq(kiln_step_end(ctx), KILN_OK);
  kiln_step_begin(ctx);
  kiln_sync(ctx);
  kiln_mem_stats m0, m1, m2;
  kiln_memory_stats(ctx, &m0);
  kiln_step_begin(ctx);
  kiln_tensor *b = kiln_exp(kiln_mul(a, a));
  cr_assert_eq(kiln_step_end(ctx), KILN_OK);
  kiln_memory_stats(ctx, &m1);
  /* exp's output is in use; mul's lived in the fused kernel's registers and took no memory */
  cr_assert_geq(m1.in_use, m0.in_use + 400000, "the step's output is in use");
  cr_assert_lt(m1.in_use, m0.in_use + 2 * 400000, "the fused intermediate took memory");
  kiln_step_begin(ctx);
  kiln_memory_stats(ctx, &m2);
  cr_assert_eq(m2.in_use, m0.in_use, "kiln_step_begin gives the step's memory back");
  cr_assert_gt(m2.cached, 0);
  cr_assert_null(kiln_relu(b));
  cr_assert_eq(kiln_ctx_status(ctx), KILN_ERR_STATE);
  cr_assert(strstr(kiln_ctx_error(ctx), "stale") != NULL, "%s", kiln_ctx_error(ctx));
  kiln_ctx_clear_error(ctx);
  kiln_tensor_free(a);
  th_ctx_free(ctx);
}

/* The benchmark MLP on image-shaped batches, as kiln_evaluate calls it. */
static kiln_tensor *mlp_on_images(void *m, kiln_tensor *x) {
  return th_mlp_logits(m, kiln_flatten(x)); /* (B, 28, 28, 1) to (B, 784): a view */
}

Test(gpu_train, mnist_one_epoch_learns, .timeout = 600) {
  const char *dir = getenv("KILN_MNIST");
  if (!dir || !*dir) cr_skip_test("KILN_MNIST is not set: no MNIST data to train on");
  TH_GPU_CTX(ctx);
  kiln_set_tf32(ctx, 1);
  kiln_dataset *train = kiln_mnist_load(ctx, dir, "train", 0.1307f, 0.3081f);
  kiln_dataset *test = kiln_mnist_load(ctx, dir, "t10k", 0.1307f, 0.3081f);
  cr_assert_not_null(train, "%s", kiln_ctx_error(ctx));
  cr_assert_not_null(test, "%s", kiln_ctx_error(ctx));
  th_mlp m;
  th_mlp_init(ctx, &m);
  kiln_loader *loader =
      kiln_loader_new(train, &(kiln_loader_options){.batch = 128, .shuffle = 1, .seed = 1});
  th_assert_ok(ctx);
  double first = 0, last = 0;
  int steps = 0, nb = (int)kiln_loader_batches(loader);
  for (;;) {
    kiln_step_begin(ctx);
    kiln_tensor *x, *y;
    if (!kiln_loader_next(loader, &x, &y)) break;
    kiln_tensor *loss = th_mlp_record_step(&m, kiln_flatten(x), y); /* (B, 28, 28, 1) rows */
    cr_assert_eq(kiln_step_end(ctx), KILN_OK, "%s", kiln_ctx_error(ctx));
    if (steps < 20) first += kiln_tensor_item(loss) / 20;
    if (steps >= nb - 20) last += kiln_tensor_item(loss) / 20;
    steps++;
  }
  cr_assert_eq(steps, 469);
  cr_assert_lt(last, 0.5 * first, "loss fell from %.4f to %.4f only", first, last);
  /* test accuracy, without gradients */
  kiln_no_grad_begin(ctx);
  kiln_loader *tl = kiln_loader_new(test, &(kiln_loader_options){.batch = 1000});
  double correct = 0, loss_sum = 0;
  for (;;) {
    kiln_step_begin(ctx);
    kiln_tensor *x, *y;
    if (!kiln_loader_next(tl, &x, &y)) break;
    kiln_tensor *logits = th_mlp_logits(&m, kiln_flatten(x));
    kiln_tensor *hit = kiln_eq(kiln_argmax(logits, 1, 0), y); /* i32 against i32, exactly */
    kiln_tensor *n = kiln_sum(hit, KILN_ALL_AXES, 0);
    kiln_tensor *l = kiln_cross_entropy(logits, y, KILN_REDUCTION_SUM, 0.f);
    cr_assert_eq(kiln_step_end(ctx), KILN_OK, "%s", kiln_ctx_error(ctx));
    correct += kiln_tensor_item(n);
    loss_sum += kiln_tensor_item(l);
  }
  kiln_no_grad_end(ctx);
  th_assert_ok(ctx);
  /* kiln_evaluate counts the same predictions, on the device, with the mean loss beside them */
  kiln_eval_result r;
  cr_assert_eq(kiln_evaluate(ctx, tl, mlp_on_images, &m, NULL, &r), KILN_OK, "%s",
               kiln_ctx_error(ctx));
  cr_assert_eq(r.samples, 10000);
  cr_assert_eq((double)r.correct, correct, "kiln_evaluate: %lld correct, the loop %.0f",
               (long long)r.correct, correct);
  cr_assert(fabs(r.loss - loss_sum / 10000) <= 1e-5 * loss_sum / 10000,
            "kiln_evaluate: test loss %.7g, the loop %.7g", r.loss, loss_sum / 10000);
  double acc = correct / 10000.0;
  cr_log_info("one epoch: loss %.4f -> %.4f, test accuracy %.2f%%", first, last, 100 * acc);
  cr_assert_gt(acc, 0.95, "test accuracy %.4f after one epoch", acc);
  kiln_loader_free(tl);
  kiln_loader_free(loader);
  th_mlp_free(&m);
  kiln_dataset_free(train);
  kiln_dataset_free(test);
  th_ctx_free(ctx);
}
