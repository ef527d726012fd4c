/*
 * mnist_cnn: trains a convolutional network on MNIST (or any data set in MNIST's idx format with
 * 28x28 images, such as Fashion-MNIST) and reports test loss and accuracy. Two recipes:
 *
 *   cnn   (the default) the `cnn` workload of docs/design.md, pytorch/examples' MNIST net:
 *         conv 1->32 3x3, ReLU, conv 32->64 3x3, ReLU, max pool 2, dropout 0.25, flatten,
 *         fc 9216->128, ReLU, dropout 0.5, fc 128->10. Adam lr 1e-3 with cosine decay to 0,
 *         batch 128, 5 epochs.
 *   fast  the fast MNIST recipe: conv 1->24 5x5, max pool 2, ReLU, conv 24->32 3x3, max pool 2,
 *         ReLU, fc 800->256, ReLU, fc 256->10. Adam lr 1e-2, betas 0.7/0.9, a one-cycle schedule
 *         over the run's steps, batch 256 (the last, partial batch dropped), one epoch.
 *
 *   mnist_cnn [DATA_DIR] [--recipe cnn|fast] [--epochs N] [--lr LR] [--batch N]
 *             [--label-smoothing F] [--seed N]
 *             [--seeds N] [--save PATH] [--resume PATH] [--eval-only PATH] [--log PATH]
 *             [--stop-after N] [--save-weights PATH] [--dump-logits PATH]
 *
 * DATA_DIR defaults to $KILN_MNIST, else data/mnist, else the source tree's data/mnist (the copy
 * shipped with kiln; examples/mnist_data.h). The whole data set lives on the GPU, as images
 * (N, 28, 28, 1), channels last, which the nets take as they are. Pixels are
 * normalised with pytorch/examples' mean and standard deviation (0.1307, 0.3081) and the layers
 * carry its names (conv1, conv2, fc1, fc2), so a state_dict of the same PyTorch net saved with
 * safetensors loads with --eval-only (bench/torch_cnn_roundtrip.py checks both directions).
 *
 * The training time printed is the wall time of the training loops, synchronised with the GPU,
 * without data loading and evaluation: "total" counts every step, "warm" all but the first (which
 * compiles the step's kernels and captures its graph). --seeds N trains N times, with seeds
 * seed .. seed + N - 1, and prints each run's accuracy and time and their medians.
 * --save writes a training checkpoint after every epoch; --resume continues one; --eval-only
 * evaluates a checkpoint or a weights file; --log appends metrics as JSON lines; --stop-after N
 * ends the run after epoch N (the schedule still spans --epochs); --save-weights writes the
 * parameters (safetensors, PyTorch's names and layouts) at the end; --dump-logits writes the
 * logits of the first 16 test images, in evaluation mode, as (16, 10) little-endian f32.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kiln.h"
#include "mnist_data.h"

#define PIXEL_MEAN 0.1307f /* pytorch/examples' normalisation */
#define PIXEL_STD 0.3081f
#define DUMP_IMAGES 16

typedef struct net {
  int fast; /* 0: the cnn recipe's net, 1: the fast recipe's */
  kiln_params *params;
  kiln_conv2d_layer conv1, conv2;
  kiln_linear fc1, fc2;
} net;

typedef struct config {
  int fast, epochs, stop_after, nseeds;
  int64_t batch;
  float lr;
  float label_smoothing;
  const char *save, *resume, *eval_only, *save_weights, *dump_logits;
  FILE *log;
} config;

typedef struct result {
  double test_loss, test_acc, train_loss;
  double total_s, first_s, compile_ms; /* training loops only */
  int64_t steps;
} result;

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void die(kiln_ctx *ctx, const char *what) {
  fprintf(stderr, "mnist_cnn: %s: %s\n", what,
          ctx && kiln_ctx_error(ctx) ? kiln_ctx_error(ctx) : "?");
  exit(1);
}

static void usage(const char *argv0, int status) {
  fprintf(status ? stderr : stdout,
          "usage: %s [DATA_DIR] [--recipe cnn|fast] [--epochs N] [--lr LR] [--batch N]\n"
          "          [--label-smoothing F] [--seed N] [--seeds N] [--save PATH] [--resume PATH] "
          "[--eval-only PATH]\n"
          "          [--log PATH] [--stop-after N] [--save-weights PATH] [--dump-logits PATH]\n"
          "\n"
          "  DATA_DIR            MNIST idx files (default $KILN_MNIST, else data/mnist, else\n"
          "                      the copy in kiln's source tree)\n"
          "  --recipe cnn|fast   cnn: pytorch/examples' net, Adam 1e-3, batch 128, 5 epochs;\n"
          "                      fast: the fast recipe, Adam 1e-2 one-cycle, batch 256, 1 epoch\n"
          "  --epochs, --lr, --batch   override the recipe's\n"
          "  --label-smoothing F cross-entropy towards uniform targets (default 0)\n"
          "  --seed N            seeds initialisation, shuffling and dropout (default 0)\n"
          "  --seeds N           train N times (seeds seed .. seed+N-1); print the medians\n"
          "  --save PATH         write a training checkpoint after every epoch\n"
          "  --resume PATH       continue from such a checkpoint\n"
          "  --eval-only PATH    evaluate a checkpoint or a weights file (safetensors)\n"
          "  --log PATH          append metrics as JSON lines\n"
          "  --stop-after N      end after epoch N (the schedule still spans --epochs)\n"
          "  --save-weights PATH write the parameters at the end (PyTorch names and layouts)\n"
          "  --dump-logits PATH  write the first %d test images' logits, in evaluation mode,\n"
          "                      as (%d, 10) little-endian f32\n",
          argv0, DUMP_IMAGES, DUMP_IMAGES);
  exit(status);
}

static kiln_status net_init(net *n, kiln_ctx *ctx, int fast) {
  memset(n, 0, sizeof *n);
  n->fast = fast;
  n->params = kiln_params_new(ctx);
  if (!n->params) return kiln_ctx_status(ctx);
  /* pytorch/examples' net, or the fast recipe's (conv 1->24 5x5, conv 24->32 3x3, fc 800->256) */
  int64_t c1 = fast ? 24 : 32, c2 = fast ? 32 : 64, flat = fast ? 800 : 9216;
  int64_t hidden = fast ? 256 : 128;
  kiln_status st;
  if ((st = kiln_conv2d_layer_init(
           &n->conv1, n->params,
           &(kiln_conv2d_layer_options){
               .name = "conv1", .in = 1, .out = c1, .kernel = fast ? 5 : 3})) ||
      (st = kiln_conv2d_layer_init(
           &n->conv2, n->params,
           &(kiln_conv2d_layer_options){.name = "conv2", .in = c1, .out = c2, .kernel = 3})) ||
      (st = kiln_linear_init(&n->fc1, n->params,
                             &(kiln_linear_options){.name = "fc1", .in = flat, .out = hidden})) ||
      (st = kiln_linear_init(&n->fc2, n->params,
                             &(kiln_linear_options){.name = "fc2", .in = hidden, .out = 10})))
    return st;
  return KILN_OK;
}

/* x (B, 28, 28, 1), the data set's images, to (B, 10) logits. Dropout follows
 * kiln_training(ctx). */
static kiln_tensor *forward(const net *n, kiln_tensor *x) {
  if (!x) return NULL;
  const kiln_pool2d_options pool2 = {.kernel_h = 2, .kernel_w = 2};
  kiln_tensor *h = x;
  if (!n->fast) {
    h = kiln_relu(kiln_conv2d_layer_forward(&n->conv1, h)); /* (B, 26, 26, 32) */
    h = kiln_relu(kiln_conv2d_layer_forward(&n->conv2, h)); /* (B, 24, 24, 64) */
    h = kiln_max_pool2d(h, &pool2);                         /* (B, 12, 12, 64) */
    h = kiln_dropout(h, 0.25f, KILN_TRAINING_MODE);
    h = kiln_flatten(h);                            /* (B, 9216), in (C, H, W) order */
    h = kiln_relu(kiln_linear_forward(&n->fc1, h)); /* (B, 128) */
    h = kiln_dropout(h, 0.5f, KILN_TRAINING_MODE);
    return kiln_linear_forward(&n->fc2, h); /* (B, 10) */
  }
  h = kiln_conv2d_layer_forward(&n->conv1, h);                  /* (B, 24, 24, 24) */
  h = kiln_relu(kiln_max_pool2d(h, &pool2));                    /* (B, 12, 12, 24) */
  h = kiln_conv2d_layer_forward(&n->conv2, h);                  /* (B, 10, 10, 32) */
  h = kiln_relu(kiln_max_pool2d(h, &pool2));                    /* (B, 5, 5, 32) */
  h = kiln_relu(kiln_linear_forward(&n->fc1, kiln_flatten(h))); /* (B, 256) */
  return kiln_linear_forward(&n->fc2, h);                       /* (B, 10) */
}

/* forward as kiln_evaluate calls it */
static kiln_tensor *forward_fn(void *n, kiln_tensor *x) { return forward(n, x); }

/* Test loss and accuracy, in batches of 1000, in evaluation mode and without gradients
 * (kiln_evaluate). */
static void evaluate(kiln_ctx *ctx, net *n, kiln_loader *test, double *loss, double *acc) {
  kiln_eval_result r;
  if (kiln_evaluate(ctx, test, forward_fn, n, NULL, &r) != KILN_OK) die(ctx, "evaluation");
  *loss = r.loss;
  *acc = r.accuracy;
}

/* Writes the logits of the first DUMP_IMAGES test images, in evaluation mode, to path as
 * (DUMP_IMAGES, 10) little-endian f32, row after row. */
static void dump_logits(kiln_ctx *ctx, const net *n, kiln_dataset *test, const char *path) {
  if (kiln_dataset_size(test) < DUMP_IMAGES) {
    fprintf(stderr, "mnist_cnn: --dump-logits needs %d test images\n", DUMP_IMAGES);
    exit(1);
  }
  float logits_h[DUMP_IMAGES * 10];
  kiln_eval_begin(ctx); /* model.eval() and torch.no_grad() */
  kiln_step_begin(ctx);
  kiln_tensor *x =
      kiln_slice(kiln_dataset_images(test), 0, 0, DUMP_IMAGES, 1); /* (16, 28, 28, 1) */
  kiln_tensor *logits = forward(n, x);                             /* (16, 10) */
  kiln_status st = kiln_step_end(ctx);
  if (st == KILN_OK) st = kiln_tensor_to_host(logits, logits_h, sizeof logits_h);
  kiln_eval_end(ctx);
  if (st != KILN_OK) die(ctx, "computing the logits to dump");
  unsigned char bytes[sizeof logits_h];
  for (int i = 0; i < DUMP_IMAGES * 10; i++) {
    uint32_t u;
    memcpy(&u, &logits_h[i], 4);
    for (int k = 0; k < 4; k++)
      bytes[4 * i + k] = (unsigned char)(u >> (8 * k));
  }
  FILE *f = fopen(path, "wb");
  if (!f || fwrite(bytes, 1, sizeof bytes, f) != sizeof bytes || fclose(f) != 0) {
    perror(path);
    exit(1);
  }
  printf("wrote the logits of the first %d test images to %s\n", DUMP_IMAGES, path);
}

/* What a run leaves behind, when asked: its weights and the logits of a few test images. */
static void write_outputs(kiln_ctx *ctx, const config *c, const net *n, kiln_dataset *test) {
  if (c->save_weights) {
    if (kiln_params_save(n->params, c->save_weights, KILN_DTYPE_F32) != KILN_OK)
      die(ctx, "saving the weights");
    printf("saved the weights to %s\n", c->save_weights);
  }
  if (c->dump_logits) dump_logits(ctx, n, test, c->dump_logits);
}

static void save_checkpoint(kiln_ctx *ctx, const config *c, const net *n, const kiln_optim *opt,
                            int epoch, int64_t step) {
  kiln_meta *meta = kiln_meta_new();
  char buf[32];
  snprintf(buf, sizeof buf, "%d", epoch);
  kiln_meta_set(meta, "epoch", buf);
  snprintf(buf, sizeof buf, "%lld", (long long)step);
  kiln_meta_set(meta, "step", buf);
  snprintf(buf, sizeof buf, "%lld", (long long)c->batch);
  kiln_meta_set(meta, "batch", buf);
  kiln_meta_set(meta, "recipe", c->fast ? "fast" : "cnn");
  if (kiln_checkpoint_save(c->save, n->params, opt, meta) != KILN_OK) die(ctx, "saving");
  kiln_meta_free(meta);
  printf("saved %s\n", c->save);
}

/* One training run (or, with --eval-only, one evaluation) from seed. verbose: 2 prints the model
 * and every epoch, 1 the model only, 0 nothing. */
static result run(kiln_ctx *ctx, const config *c, kiln_dataset *train, kiln_dataset *test,
                  kiln_loader *test_loader, uint64_t seed, int verbose) {
  result r = {0};
  kiln_manual_seed(ctx, seed);
  kiln_set_training(ctx, 1);
  net n;
  if (net_init(&n, ctx, c->fast) != KILN_OK) die(ctx, "making the model");
  kiln_adam_options ao = kiln_adam_defaults();
  ao.lr = c->lr;
  if (c->fast) {
    ao.beta1 = 0.7f;
    ao.beta2 = 0.9f;
  }
  kiln_optim *opt = kiln_adam_new(n.params, &ao);
  /* the fast recipe drops the last, partial batch: every step has one signature, one graph */
  kiln_loader *loader = kiln_loader_new(
      train,
      &(kiln_loader_options){.batch = c->batch, .shuffle = 1, .seed = seed, .drop_last = c->fast});
  if (!opt || !loader) die(ctx, "making the optimizer and the loader");

  int64_t ntrain = kiln_dataset_size(train);
  int64_t steps_per_epoch = kiln_loader_batches(loader), total_steps = steps_per_epoch * c->epochs;
  int64_t step = 0;
  int first_epoch = 1;
  if (c->eval_only) {
    /* a training checkpoint or a plain weights file: kiln_params_load takes either's weights */
    if (kiln_params_load(n.params, c->eval_only) != KILN_OK) die(ctx, "loading the weights");
  } else if (c->resume) {
    kiln_meta *meta = kiln_meta_new();
    if (kiln_checkpoint_load(c->resume, n.params, opt, meta) != KILN_OK) die(ctx, "resuming");
    const char *e = kiln_meta_get(meta, "epoch"), *st = kiln_meta_get(meta, "step");
    const char *b = kiln_meta_get(meta, "batch"), *rc = kiln_meta_get(meta, "recipe");
    if (!e || !st || !b || atoll(b) != c->batch || !rc ||
        strcmp(rc, c->fast ? "fast" : "cnn") != 0) {
      fprintf(stderr, "mnist_cnn: %s was not written by mnist_cnn --recipe %s with batch %lld\n",
              c->resume, c->fast ? "fast" : "cnn", (long long)c->batch);
      exit(1);
    }
    first_epoch = atoi(e) + 1;
    step = atoll(st);
    printf("resumed %s: epoch %d done, step %lld\n", c->resume, first_epoch - 1, (long long)step);
    kiln_meta_free(meta);
  }
  if (c->eval_only) {
    evaluate(ctx, &n, test_loader, &r.test_loss, &r.test_acc);
    printf("%s: test loss %.4f | test accuracy %.2f%%\n", c->eval_only, r.test_loss,
           100.0 * r.test_acc);
    if (c->log)
      fprintf(c->log, "{\"eval\": \"%s\", \"test_loss\": %.6f, \"test_accuracy\": %.6f}\n",
              c->eval_only, r.test_loss, r.test_acc);
    write_outputs(ctx, c, &n, test);
    kiln_loader_free(loader);
    kiln_optim_free(opt);
    kiln_params_free(n.params);
    return r;
  }
  if (verbose > 0) {
    char seeds[64];
    if (c->nseeds > 1)
      snprintf(seeds, sizeof seeds, "seeds %llu to %llu", (unsigned long long)seed,
               (unsigned long long)seed + (unsigned long long)c->nseeds - 1);
    else
      snprintf(seeds, sizeof seeds, "seed %llu", (unsigned long long)seed);
    printf("%s net (%lld parameters), batch %lld, Adam lr %g (betas %g/%g) with %s, %d epoch%s, "
           "%s\n",
           c->fast ? "fast-recipe" : "pytorch/examples MNIST",
           (long long)kiln_params_numel(n.params), (long long)c->batch, c->lr, ao.beta1, ao.beta2,
           c->fast ? "a one-cycle schedule" : "cosine decay", c->epochs, c->epochs == 1 ? "" : "s",
           seeds);
  }
  /* the schedule runs from the optimizer's step count, so a resumed run goes on where it
   * stopped; the rate is a step value, so the step graph is captured once */
  kiln_schedule sched = {.kind = c->fast ? KILN_SCHEDULE_ONE_CYCLE : KILN_SCHEDULE_COSINE,
                         .base_lr = c->lr,
                         .total_steps = total_steps,
                         /* the recipe keeps beta1 at 0.7 (torch's cycle_momentum=False) */
                         .no_cycle_momentum = 1};
  kiln_optim_set_schedule(opt, &sched);
  if (kiln_ctx_error(ctx)) die(ctx, "setting the schedule");

  double t_start = now_s();
  int timed_first = 0;
  r.test_acc = NAN;
  for (int epoch = first_epoch; epoch <= c->epochs; epoch++) {
    kiln_exec_stats s0, s1;
    kiln_stats(ctx, &s0);
    double t0 = now_s(), tlast = t0, lsum = 0;
    int64_t seen = 0, seen_last = 0, nread = 0, epoch_steps = 0;
    kiln_loader_start(loader, epoch);
    for (;;) {
      kiln_step_begin(ctx);
      kiln_tensor *x, *y;
      if (!kiln_loader_next(loader, &x, &y)) break;
      kiln_tensor *loss =
          kiln_cross_entropy(forward(&n, x), y, KILN_REDUCTION_MEAN, c->label_smoothing);
      kiln_optim_zero_grad(opt);
      kiln_backward(loss);
      kiln_optim_step(opt);
      if (kiln_step_end(ctx) != KILN_OK) die(ctx, "training step");
      seen += kiln_tensor_dim(x, 0);
      step++;
      epoch_steps++;
      if (!timed_first) { /* the first step compiles and captures: time it apart */
        if (kiln_sync(ctx) != KILN_OK) die(ctx, "training step");
        r.first_s = now_s() - t0;
        timed_first = 1;
      }
      /* reading the loss waits for the GPU: the cnn recipe reads it every 25 steps, the fast
       * recipe only at the end of the epoch */
      if (c->fast ? epoch_steps == steps_per_epoch : step % 25 == 0) {
        float l = kiln_tensor_item(loss);
        lsum += l;
        nread++;
        if (c->log)
          fprintf(c->log,
                  "{\"seed\": %llu, \"step\": %lld, \"epoch\": %d, \"loss\": %.6f, "
                  "\"lr\": %.6g, \"time\": %.3f}\n",
                  (unsigned long long)seed, (long long)step, epoch, l, kiln_optim_lr(opt),
                  now_s() - t_start);
      }
      if (verbose > 1 && !c->fast && step % 100 == 0) {
        double t = now_s();
        printf("epoch %2d [%6lld/%lld]  running loss %.4f  %8.0f samples/s\n", epoch,
               (long long)seen, (long long)ntrain, nread ? lsum / nread : NAN,
               (seen - seen_last) / (t - tlast));
        fflush(stdout);
        tlast = t;
        seen_last = seen;
      }
    }
    if (kiln_sync(ctx) != KILN_OK) die(ctx, "training");
    double train_s = now_s() - t0;
    kiln_stats(ctx, &s1);
    r.total_s += train_s;
    r.compile_ms += s1.compile_ms - s0.compile_ms;
    r.steps += epoch_steps;
    r.train_loss = nread ? lsum / nread : NAN;
    evaluate(ctx, &n, test_loader, &r.test_loss, &r.test_acc);
    if (verbose > 1) {
      printf("epoch %2d done: train loss %.4f | test loss %.4f | test accuracy %.2f%% | %.3f s "
             "(%.0f samples/s)\n",
             epoch, r.train_loss, r.test_loss, 100.0 * r.test_acc, train_s, seen / train_s);
      fflush(stdout);
    }
    if (c->log) {
      fprintf(c->log,
              "{\"seed\": %llu, \"step\": %lld, \"epoch\": %d, \"train_loss\": %.6f, "
              "\"test_loss\": %.6f, \"test_accuracy\": %.6f, \"lr\": %.6g, \"train_s\": %.4f, "
              "\"time\": %.3f}\n",
              (unsigned long long)seed, (long long)step, epoch, r.train_loss, r.test_loss,
              r.test_acc, kiln_optim_lr(opt), train_s, now_s() - t_start);
      fflush(c->log);
    }
    if (c->save) save_checkpoint(ctx, c, &n, opt, epoch, step);
    if (epoch == c->stop_after) {
      printf("stopping after epoch %d of %d\n", epoch, c->epochs);
      break;
    }
  }
  if (isnan(r.test_acc)) /* nothing left to train (a finished run resumed) */
    evaluate(ctx, &n, test_loader, &r.test_loss, &r.test_acc);
  write_outputs(ctx, c, &n, test);
  kiln_loader_free(loader);
  kiln_optim_free(opt);
  kiln_params_free(n.params);
  return r;
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

static double median(double *v, int n) {
  qsort(v, (size_t)n, sizeof *v, cmp_double);
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

int main(int argc, char **argv) {
  const char *dir = NULL;
  config c = {.epochs = -1, .batch = -1, .lr = -1.f, .nseeds = 1};
  uint64_t seed = 0;
  const char *log_path = NULL, *recipe = "cnn";
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
    if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) usage(argv[0], 0);
    if (a[0] != '-') {
      dir = a;
      continue;
    }
    if (!v) usage(argv[0], 2);
    i++;
    if (strcmp(a, "--recipe") == 0)
      recipe = v;
    else if (strcmp(a, "--epochs") == 0)
      c.epochs = atoi(v);
    else if (strcmp(a, "--lr") == 0)
      c.lr = strtof(v, NULL);
    else if (strcmp(a, "--label-smoothing") == 0)
      c.label_smoothing = strtof(v, NULL);
    else if (strcmp(a, "--batch") == 0)
      c.batch = atoll(v);
    else if (strcmp(a, "--seed") == 0)
      seed = strtoull(v, NULL, 0);
    else if (strcmp(a, "--seeds") == 0)
      c.nseeds = atoi(v);
    else if (strcmp(a, "--save") == 0)
      c.save = v;
    else if (strcmp(a, "--resume") == 0)
      c.resume = v;
    else if (strcmp(a, "--eval-only") == 0)
      c.eval_only = v;
    else if (strcmp(a, "--log") == 0)
      log_path = v;
    else if (strcmp(a, "--stop-after") == 0)
      c.stop_after = atoi(v);
    else if (strcmp(a, "--save-weights") == 0)
      c.save_weights = v;
    else if (strcmp(a, "--dump-logits") == 0)
      c.dump_logits = v;
    else
      usage(argv[0], 2);
  }
  if (strcmp(recipe, "cnn") != 0 && strcmp(recipe, "fast") != 0) {
    fprintf(stderr, "mnist_cnn: --recipe is cnn or fast, not %s\n", recipe);
    return 2;
  }
  c.fast = strcmp(recipe, "fast") == 0;
  if (c.epochs < 0) c.epochs = c.fast ? 1 : 5;
  if (c.batch < 0) c.batch = c.fast ? 256 : 128;
  if (c.lr < 0) c.lr = c.fast ? 1e-2f : 1e-3f;
  if (c.epochs < 1 || c.batch < 1 || !(c.lr > 0) || c.nseeds < 1 || c.nseeds > 1000) {
    fprintf(stderr,
            "mnist_cnn: epochs %d, batch %lld, lr %g and seeds %d must be positive (seeds at "
            "most 1000)\n",
            c.epochs, (long long)c.batch, c.lr, c.nseeds);
    return 2;
  }
  if (c.nseeds > 1 && (c.save || c.resume || c.eval_only || c.save_weights || c.dump_logits)) {
    fprintf(stderr,
            "mnist_cnn: --save, --resume, --eval-only, --save-weights and --dump-logits "
            "take one seed, not --seeds %d\n",
            c.nseeds);
    return 2;
  }
  if (log_path && !(c.log = fopen(log_path, "a"))) {
    perror(log_path);
    return 1;
  }

  /* the data first: a missing data set is reported as such, with or without a GPU */
  dir = mnist_data_dir(dir);
  kiln_mnist train_h, test_h;
  mnist_data_read("mnist_cnn", dir, &train_h, &test_h);
  if (train_h.rows != 28 || train_h.cols != 28 || test_h.rows != 28 || test_h.cols != 28) {
    fprintf(stderr, "mnist_cnn: %s has %lldx%lld images; the nets take 28x28\n", dir,
            (long long)train_h.rows, (long long)train_h.cols);
    return 1;
  }

  kiln_ctx *ctx = kiln_ctx_new(NULL);
  if (!ctx || kiln_ctx_error(ctx)) die(ctx, "no usable GPU");
  kiln_dataset *train = kiln_dataset_from_mnist(ctx, &train_h, PIXEL_MEAN, PIXEL_STD);
  kiln_dataset *test = kiln_dataset_from_mnist(ctx, &test_h, PIXEL_MEAN, PIXEL_STD);
  kiln_mnist_free(&train_h);
  kiln_mnist_free(&test_h);
  if (!train || !test) die(ctx, "uploading the data set");
  kiln_loader *test_loader = kiln_loader_new(test, &(kiln_loader_options){.batch = 1000});
  if (!test_loader) die(ctx, "making the test loader");
  printf("kiln %s mnist_cnn --recipe %s: %s (%lld train, %lld test images)\n", kiln_version(),
         recipe, dir, (long long)kiln_dataset_size(train), (long long)kiln_dataset_size(test));

  double *acc = malloc((size_t)c.nseeds * sizeof *acc);
  double *total = malloc((size_t)c.nseeds * sizeof *total);
  double *warm = malloc((size_t)c.nseeds * sizeof *warm);
  if (!acc || !total || !warm) {
    fprintf(stderr, "mnist_cnn: out of host memory\n");
    return 1;
  }
  int reached = 0;
  result r = {0};
  for (int k = 0; k < c.nseeds; k++) {
    uint64_t s = seed + (uint64_t)k;
    r = run(ctx, &c, train, test, test_loader, s, c.nseeds == 1 ? 2 : k == 0);
    if (c.eval_only) break;
    if (k + 1 < c.nseeds && kiln_graphs(ctx)) {
      /* the next seed's model is new tensors, so new step signatures: let this seed's graphs go
       * (graphs off frees them at the next step's beginning) rather than fill the cache */
      kiln_set_graphs(ctx, 0);
      kiln_step_begin(ctx);
      if (kiln_step_end(ctx) != KILN_OK) die(ctx, "dropping the step graphs");
      kiln_set_graphs(ctx, 1);
    }
    acc[k] = r.test_acc;
    total[k] = r.total_s;
    warm[k] = r.total_s - r.first_s;
    reached += r.test_acc >= 0.99;
    if (c.nseeds > 1) {
      printf("seed %llu: test accuracy %.2f%% | training %.3f s total, %.3f s warm (first step "
             "%.3f s, NVRTC %.0f ms)\n",
             (unsigned long long)s, 100.0 * r.test_acc, r.total_s, warm[k], r.first_s,
             r.compile_ms);
      fflush(stdout);
    }
    if (c.log)
      fprintf(c.log,
              "{\"seed\": %llu, \"recipe\": \"%s\", \"test_accuracy\": %.6f, \"test_loss\": "
              "%.6f, \"train_s\": %.4f, \"warm_s\": %.4f, \"first_step_s\": %.4f, "
              "\"compile_ms\": %.1f, \"steps\": %lld}\n",
              (unsigned long long)s, recipe, r.test_acc, r.test_loss, r.total_s, warm[k], r.first_s,
              r.compile_ms, (long long)r.steps);
  }
  if (!c.eval_only) {
    if (c.nseeds == 1)
      printf("final: test accuracy %.2f%%, test loss %.4f; training %.3f s total, %.3f s warm "
             "(%lld steps; the first, with compile and capture, %.3f s; NVRTC %.0f ms)\n",
             100.0 * r.test_acc, r.test_loss, r.total_s, r.total_s - r.first_s, (long long)r.steps,
             r.first_s, r.compile_ms);
    else {
      double lo = acc[0], hi = acc[0];
      for (int k = 1; k < c.nseeds; k++) {
        lo = acc[k] < lo ? acc[k] : lo;
        hi = acc[k] > hi ? acc[k] : hi;
      }
      printf("final: median of %d seeds: test accuracy %.2f%% (min %.2f%%, max %.2f%%; %d of %d "
             "at 99.00%% or more); training %.3f s total, %.3f s warm\n",
             c.nseeds, 100.0 * median(acc, c.nseeds), 100.0 * lo, 100.0 * hi, reached, c.nseeds,
             median(total, c.nseeds), median(warm, c.nseeds));
    }
  }
  if (c.log) fclose(c.log);
  kiln_mem_stats ms;
  kiln_memory_stats(ctx, &ms);
  printf("peak device memory %.1f MiB\n", ms.peak / 1048576.0);
  free(acc);
  free(total);
  free(warm);
  kiln_loader_free(test_loader);
  kiln_dataset_free(train);
  kiln_dataset_free(test);
  kiln_ctx_free(ctx);
  return 0;
}
