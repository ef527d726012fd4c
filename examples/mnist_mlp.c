/*
 * mnist_mlp: trains a 784-512-512-10 ReLU MLP on MNIST (or any data set in MNIST's idx format,
 * such as Fashion-MNIST) with SGD and Nesterov momentum, batch 128, and reports test loss and
 * accuracy after every epoch.
 *
 *   mnist_mlp [DATA_DIR] [--epochs N] [--lr LR] [--batch N] [--seed N]
 *             [--save PATH] [--resume PATH] [--eval-only PATH] [--log PATH] [--stop-after N]
 *
 * DATA_DIR defaults to $KILN_MNIST, else data/mnist, else the source tree's data/mnist (the copy
 * shipped with kiln; examples/mnist_data.h). The whole data set lives on the GPU.
 * --save writes a training checkpoint after every epoch; --resume continues one (bitwise as the
 * uninterrupted run); --eval-only evaluates a checkpoint or a weights file; --log appends metrics
 * as JSON lines (tools/plot_log.py draws them); --stop-after N ends the run after epoch N, as an
 * interruption would (the schedule still spans --epochs).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kiln.h"
#include "mnist_data.h"

typedef struct mlp {
  kiln_params *params;
  kiln_linear fc1, fc2, fc3;
} mlp;

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void die(kiln_ctx *ctx, const char *what) {
  fprintf(stderr, "mnist_mlp: %s: %s\n", what, kiln_ctx_error(ctx) ? kiln_ctx_error(ctx) : "?");
  exit(1);
}

static void usage(const char *argv0) {
  fprintf(stderr,
          "usage: %s [DATA_DIR] [--epochs N] [--lr LR] [--batch N] [--seed N] [--save PATH]\n"
          "          [--resume PATH] [--eval-only PATH] [--log PATH] [--stop-after N]\n",
          argv0);
  exit(2);
}

/* x (B, 28, 28, 1), the data set's images, to (B, 10) logits. */
static kiln_tensor *forward(const mlp *m, kiln_tensor *x) {
  kiln_tensor *h = kiln_relu(kiln_linear_forward(&m->fc1, kiln_flatten(x))); /* (B, 784): a view */
  h = kiln_relu(kiln_linear_forward(&m->fc2, h));
  return kiln_linear_forward(&m->fc3, h); /* (B, 10) logits */
}

/* forward as kiln_evaluate calls it */
static kiln_tensor *forward_fn(void *m, kiln_tensor *x) { return forward(m, x); }

/* Test loss and accuracy, in batches of 1000, in evaluation mode (kiln_evaluate). */
static void evaluate(kiln_ctx *ctx, mlp *m, kiln_loader *test, double *loss, double *acc) {
  kiln_eval_result r;
  if (kiln_evaluate(ctx, test, forward_fn, m, NULL, &r) != KILN_OK) die(ctx, "evaluation");
  *loss = r.loss;
  *acc = r.accuracy;
}

int main(int argc, char **argv) {
  const char *dir = NULL;
  int epochs = 10;
  int64_t batch = 128;
  float lr = 0.05f;
  uint64_t seed = 0;
  const char *save = NULL, *resume = NULL, *eval_only = NULL, *log_path = NULL;
  int stop_after = 0;
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
    if (a[0] != '-') {
      dir = a;
      continue;
    }
    if (!v) usage(argv[0]);
    i++;
    if (strcmp(a, "--epochs") == 0)
      epochs = atoi(v);
    else if (strcmp(a, "--lr") == 0)
      lr = strtof(v, NULL);
    else if (strcmp(a, "--batch") == 0)
      batch = atoll(v);
    else if (strcmp(a, "--seed") == 0)
      seed = strtoull(v, NULL, 0);
    else if (strcmp(a, "--save") == 0)
      save = v;
    else if (strcmp(a, "--resume") == 0)
      resume = v;
    else if (strcmp(a, "--eval-only") == 0)
      eval_only = v;
    else if (strcmp(a, "--log") == 0)
      log_path = v;
    else if (strcmp(a, "--stop-after") == 0)
      stop_after = atoi(v);
    else
      usage(argv[0]);
  }
  if (epochs < 1 || batch < 1 || !(lr > 0)) {
    fprintf(stderr, "mnist_mlp: epochs %d, batch %lld and lr %g must be positive\n", epochs,
            (long long)batch, lr);
    return 2;
  }
  FILE *log = NULL;
  if (log_path && !(log = fopen(log_path, "a"))) {
    perror(log_path);
    return 1;
  }

  /* the data first: a missing data set is reported as such, with or without a GPU */
  dir = mnist_data_dir(dir);
  kiln_mnist train_h, test_h;
  mnist_data_read("mnist_mlp", dir, &train_h, &test_h);

  kiln_ctx *ctx = kiln_ctx_new(NULL);
  if (!ctx || kiln_ctx_error(ctx)) die(ctx, "no usable GPU");
  kiln_manual_seed(ctx, seed);
  /* the training pixels' mean and standard deviation, scaled to [0, 1] (NAN: computed from
   * them), normalise both sets */
  kiln_dataset *train = kiln_dataset_from_mnist(ctx, &train_h, NAN, NAN);
  kiln_normalize norm = kiln_dataset_normalization(train);
  float mean = norm.channels ? norm.mean[0] : NAN, std = norm.channels ? norm.std[0] : NAN;
  kiln_dataset *test = train ? kiln_dataset_from_mnist(ctx, &test_h, mean, std) : NULL;
  kiln_mnist_free(&train_h);
  kiln_mnist_free(&test_h);
  if (!train || !test) die(ctx, "uploading the data set");
  kiln_loader *loader =
      kiln_loader_new(train, &(kiln_loader_options){.batch = batch, .shuffle = 1, .seed = seed});
  kiln_loader *test_loader = kiln_loader_new(test, &(kiln_loader_options){.batch = 1000});
  if (!loader || !test_loader) die(ctx, "making the loaders");

  mlp m = {.params = kiln_params_new(ctx)};
  if (kiln_linear_init(&m.fc1, m.params,
                       &(kiln_linear_options){.name = "fc1", .in = 784, .out = 512}) ||
      kiln_linear_init(&m.fc2, m.params,
                       &(kiln_linear_options){.name = "fc2", .in = 512, .out = 512}) ||
      kiln_linear_init(&m.fc3, m.params,
                       &(kiln_linear_options){.name = "fc3", .in = 512, .out = 10}))
    die(ctx, "making the model");
  kiln_sgd_options so = kiln_sgd_defaults(lr);
  so.momentum = 0.9f;
  so.nesterov = 1;
  so.weight_decay = 5e-4f;
  kiln_optim *opt = kiln_sgd_new(m.params, &so);
  if (!opt) die(ctx, "making the optimizer");

  int64_t ntrain = kiln_dataset_size(train), steps_per_epoch = kiln_loader_batches(loader);
  int64_t total_steps = steps_per_epoch * epochs, step = 0;
  int first_epoch = 1;
  if (eval_only) {
    /* a training checkpoint or a plain weights file: kiln_params_load takes either's weights */
    if (kiln_params_load(m.params, eval_only) != KILN_OK) die(ctx, "loading the weights");
  } else if (resume) {
    kiln_meta *meta = kiln_meta_new();
    if (kiln_checkpoint_load(resume, m.params, opt, meta) != KILN_OK) die(ctx, "resuming");
    const char *e = kiln_meta_get(meta, "epoch"), *st = kiln_meta_get(meta, "step");
    const char *b = kiln_meta_get(meta, "batch");
    if (!e || !st || !b || atoll(b) != batch) {
      fprintf(stderr, "mnist_mlp: %s was not written by mnist_mlp with batch %lld\n", resume,
              (long long)batch);
      return 1;
    }
    first_epoch = atoi(e) + 1;
    step = atoll(st);
    printf("resumed %s: epoch %d done, step %lld\n", resume, first_epoch - 1, (long long)step);
    kiln_meta_free(meta);
  }
  printf("kiln %s mnist_mlp: %s (%lld train, %lld test images; pixel mean %.4f std %.4f)\n",
         kiln_version(), dir, (long long)ntrain, (long long)kiln_dataset_size(test), mean, std);
  if (eval_only) {
    double tl, ta;
    evaluate(ctx, &m, test_loader, &tl, &ta);
    printf("%s: test loss %.4f | test accuracy %.2f%%\n", eval_only, tl, 100.0 * ta);
    if (log)
      fprintf(log, "{\"eval\": \"%s\", \"test_loss\": %.6f, \"test_accuracy\": %.6f}\n", eval_only,
              tl, ta);
    return 0;
  }
  printf("784-512-512-10 ReLU MLP (%lld parameters), batch %lld, SGD Nesterov momentum 0.9, "
         "lr %g with cosine decay, weight decay 5e-4, %d epochs\n",
         (long long)kiln_params_numel(m.params), (long long)batch, lr, epochs);
  /* cosine decay over the whole run, from the optimizer's step count (so a resumed run goes on
   * where it stopped); the rate is a step value: the step graph is captured once */
  kiln_optim_set_schedule(opt, &(kiln_schedule){.kind = KILN_SCHEDULE_COSINE,
                                                .base_lr = (float)lr,
                                                .total_steps = total_steps});
  double t_start = now_s();
  for (int epoch = first_epoch; epoch <= epochs; epoch++) {
    kiln_loader_start(loader, epoch);
    double t0 = now_s(), tlast = t0, lsum = 0;
    int64_t seen = 0, seen_last = 0, nread = 0;
    for (;;) {
      kiln_step_begin(ctx);
      kiln_tensor *x, *y;
      if (!kiln_loader_next(loader, &x, &y)) break;
      kiln_tensor *loss = kiln_cross_entropy(forward(&m, x), y, KILN_REDUCTION_MEAN, 0.f);
      kiln_optim_zero_grad(opt);
      kiln_backward(loss);
      kiln_optim_step(opt);
      if (kiln_step_end(ctx) != KILN_OK) die(ctx, "training step");
      seen += kiln_tensor_dim(x, 0);
      step++;
      /* reading the loss waits for the GPU: do it every 25 steps only */
      if (step % 25 == 0) {
        float l = kiln_tensor_item(loss);
        lsum += l;
        nread++;
        if (log)
          fprintf(log,
                  "{\"step\": %lld, \"epoch\": %d, \"loss\": %.6f, \"lr\": %.6g, "
                  "\"time\": %.3f}\n",
                  (long long)step, epoch, l, kiln_optim_lr(opt), now_s() - t_start);
      }
      if (step % 100 == 0) {
        double t = now_s();
        printf("epoch %2d [%6lld/%lld]  running loss %.4f  %8.0f samples/s\n", epoch,
               (long long)seen, (long long)ntrain, nread ? lsum / nread : NAN,
               (seen - seen_last) / (t - tlast));
        fflush(stdout);
        tlast = t;
        seen_last = seen;
      }
    }
    kiln_sync(ctx);
    double train_time = now_s() - t0;
    double tl, ta;
    evaluate(ctx, &m, test_loader, &tl, &ta);
    printf("epoch %2d done: train loss %.4f | test loss %.4f | test accuracy %.2f%% | %.2f s "
           "(%.0f samples/s)\n",
           epoch, nread ? lsum / nread : NAN, tl, 100.0 * ta, train_time, ntrain / train_time);
    fflush(stdout);
    if (log) {
      fprintf(log,
              "{\"step\": %lld, \"epoch\": %d, \"train_loss\": %.6f, \"test_loss\": %.6f, "
              "\"test_accuracy\": %.6f, \"lr\": %.6g, \"time\": %.3f}\n",
              (long long)step, epoch, nread ? lsum / nread : NAN, tl, ta, kiln_optim_lr(opt),
              now_s() - t_start);
      fflush(log);
    }
    if (save) {
      kiln_meta *meta = kiln_meta_new();
      char buf[32];
      snprintf(buf, sizeof buf, "%d", epoch);
      kiln_meta_set(meta, "epoch", buf);
      snprintf(buf, sizeof buf, "%lld", (long long)step);
      kiln_meta_set(meta, "step", buf);
      snprintf(buf, sizeof buf, "%lld", (long long)batch);
      kiln_meta_set(meta, "batch", buf);
      if (kiln_checkpoint_save(save, m.params, opt, meta) != KILN_OK) die(ctx, "saving");
      kiln_meta_free(meta);
      printf("saved %s\n", save);
    }
    if (epoch == stop_after) {
      printf("stopping after epoch %d of %d\n", epoch, epochs);
      break;
    }
  }
  if (log) fclose(log);
  kiln_mem_stats ms;
  kiln_memory_stats(ctx, &ms);
  printf("peak device memory %.1f MiB\n", ms.peak / 1048576.0);
  kiln_optim_free(opt);
  kiln_params_free(m.params);
  kiln_loader_free(loader);
  kiln_loader_free(test_loader);
  kiln_dataset_free(train);
  kiln_dataset_free(test);
  kiln_ctx_free(ctx);
  return 0;
}
