/*
 * imagefolder: trains a ResNet (torchvision's ResNet-18, or a narrower one) on a folder of your
 * own images, root/<class>/<image>.{jpg,jpeg,png} (torchvision's ImageFolder layout), and prints
 * how fast loading and training each go, so that you see which one limits.
 *
 *   imagefolder DIR [--val DIR] [--epochs N] [--batch N] [--size N] [--width N] [--lr F]
 *               [--threads N] [--seed N] [--steps N] [--save PATH] [--resume PATH]
 *               [--eval-only PATH] [--log PATH] [--f32] [--no-gpu]
 *
 * DIR is the training folder, or a folder holding train/ and val/ (ImageNet's layout); --val
 * names the evaluation folder otherwise (none: no evaluation). Training images get torchvision's
 * RandomResizedCrop(size) and a random flip, evaluation images Resize(size * 8 / 7) and
 * CenterCrop(size), both normalised with ImageNet's means and deviations; decoding runs on
 * --threads host threads (default: the processors) while the GPU runs the step before, the
 * crops and resizes on the GPU (kiln_image_loader). The model is examples/resnet.h's: --width
 * 64 (the default) is ResNet-18, smaller widths narrower copies; images of 64 pixels or less get
 * a 3x3 stride-1 stem without max pool. Training: cross-entropy with label smoothing 0.1, SGD with
 * Nesterov momentum 0.9, lr --lr (default 0.1 per 256 images) on a cosine schedule over the run,
 * weight decay 5e-5, the forward pass in bf16 autocast (--f32: f32 throughout).
 *
 * Each epoch prints the training loss, the images per second of training (the steps' wall time,
 * synchronised with the GPU; and of the steps after its first, timed apart: the run's first step
 * records, compiles and captures the step) and what loading could give (images decoded per
 * second of the decoding threads' time, times the threads), the seconds the steps waited for
 * decoding, and the evaluation accuracy. --steps N stops after N training steps. --save writes a
 * checkpoint after every epoch, --resume continues one, --eval-only evaluates a checkpoint or a
 * weights file, --log appends each epoch's figures as a JSON line. --no-gpu runs the data path and
 * records, plans and compiles every step without a GPU (nothing is computed: no loss, no accuracy).
 */
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#include "kiln.h"
#include "resnet.h"

#define MOMENTUM 0.9f
#define WEIGHT_DECAY 5e-5f
#define LABEL_SMOOTHING 0.1f
#define LOSS_EVERY 50 /* steps between loss reads */

typedef struct config {
  const char *train, *val, *save, *resume, *eval_only, *log;
  int epochs, size, width, threads, f32, no_gpu;
  int64_t batch, max_steps;
  float lr;
  uint64_t seed;
} config;

static void die(kiln_ctx *ctx, const char *what) {
  fprintf(stderr, "imagefolder: %s: %s\n", what,
          ctx && kiln_ctx_error(ctx) ? kiln_ctx_error(ctx) : "failed");
  exit(1);
}

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static void usage(const char *argv0) {
  fprintf(stderr,
          "usage: %s DIR [--val DIR] [--epochs N] [--batch N] [--size N] [--width N] [--lr F]\n"
          "          [--threads N] [--seed N] [--steps N] [--save PATH] [--resume PATH]\n"
          "          [--eval-only PATH] [--log PATH] [--f32] [--no-gpu]\n"
          "  DIR               the training folder, DIR/<class>/<image>.{jpg,jpeg,png}, or a\n"
          "                    folder holding train/ and val/\n"
          "  --val DIR         the evaluation folder (default: DIR/val when DIR has one)\n"
          "  --epochs N        epochs (default 1)\n"
          "  --batch N         images a step (default 128)\n"
          "  --size N          the images' side as the network sees them (default 224)\n"
          "  --width N         the ResNet's first width: 64 is ResNet-18 (default 64)\n"
          "  --lr F            the peak learning rate (default 0.1 per 256 images)\n"
          "  --threads N       decoding threads (default: the processors)\n"
          "  --seed N          the random seed (default 0)\n"
          "  --steps N         stop after N training steps\n"
          "  --save PATH       write a training checkpoint after every epoch\n"
          "  --resume PATH     continue from such a checkpoint\n"
          "  --eval-only PATH  evaluate a checkpoint or a weights file (safetensors)\n"
          "  --log PATH        append each epoch's figures as a JSON line\n"
          "  --f32             train in f32 (default: bf16 autocast)\n"
          "  --no-gpu          run the data path and compile the steps without a GPU\n",
          argv0);
  exit(2);
}

/* A positive integer flag value, or usage. */
static int64_t positive(const char *argv0, const char *flag, const char *v) {
  char *end;
  long long x = strtoll(v, &end, 10);
  if (*v == 0 || *end != 0 || x <= 0) {
    fprintf(stderr, "imagefolder: %s needs a positive integer, not %s\n", flag, v);
    usage(argv0);
  }
  return x;
}

static config parse(int argc, char **argv) {
  config c = {.epochs = 1, .size = 224, .width = 64, .batch = 128};
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
    bool takes = true;
    if (strcmp(a, "--f32") == 0)
      c.f32 = 1, takes = false;
    else if (strcmp(a, "--no-gpu") == 0)
      c.no_gpu = 1, takes = false;
    else if (a[0] != '-') {
      if (c.train) usage(argv[0]);
      c.train = a;
      takes = false;
    } else if (!v)
      usage(argv[0]);
    else if (strcmp(a, "--val") == 0)
      c.val = v;
    else if (strcmp(a, "--epochs") == 0)
      c.epochs = (int)positive(argv[0], a, v);
    else if (strcmp(a, "--batch") == 0)
      c.batch = positive(argv[0], a, v);
    else if (strcmp(a, "--size") == 0)
      c.size = (int)positive(argv[0], a, v);
    else if (strcmp(a, "--width") == 0)
      c.width = (int)positive(argv[0], a, v);
    else if (strcmp(a, "--threads") == 0)
      c.threads = (int)positive(argv[0], a, v);
    else if (strcmp(a, "--steps") == 0)
      c.max_steps = positive(argv[0], a, v);
    else if (strcmp(a, "--seed") == 0)
      c.seed = strtoull(v, NULL, 10);
    else if (strcmp(a, "--lr") == 0) {
      c.lr = strtof(v, NULL);
      if (!(c.lr > 0.f) || !isfinite(c.lr)) usage(argv[0]);
    } else if (strcmp(a, "--save") == 0)
      c.save = v;
    else if (strcmp(a, "--resume") == 0)
      c.resume = v;
    else if (strcmp(a, "--eval-only") == 0)
      c.eval_only = v;
    else if (strcmp(a, "--log") == 0)
      c.log = v;
    else
      usage(argv[0]);
    if (takes) i++;
  }
  if (!c.train) usage(argv[0]);
  if (c.size > 4096 || c.width > 1024 || c.epochs > 100000) {
    fprintf(stderr,
            "imagefolder: --size %d (at most 4096), --width %d (at most 1024) or --epochs "
            "%d is too large\n",
            c.size, c.width, c.epochs);
    exit(2);
  }
  if (c.no_gpu && (c.save || c.resume || c.eval_only)) {
    fprintf(stderr, "imagefolder: --save, --resume and --eval-only read the weights, which needs "
                    "a GPU (not --no-gpu)\n");
    exit(2);
  }
  if (!c.lr) c.lr = 0.1f * (float)c.batch / 256.f;
  return c;
}

static bool is_dir(const char *path) {
  struct stat st;
  return stat(path, &st) == 0 && S_ISDIR(st.st_mode);
}

/* ---------------------------------------------------------------- evaluation */

/* Top-1 accuracy over the folder (NAN without a GPU: nothing runs). */
static double evaluate(kiln_ctx *ctx, const resnet *net, kiln_image_loader *l, const config *c) {
  kiln_set_training(ctx, 0);
  kiln_image_loader_start(l, 0);
  int64_t right = 0, seen = 0;
  kiln_tensor *x, *y;
  for (;;) {
    kiln_step_begin(ctx);
    if (!kiln_image_loader_next(l, &x, &y)) break;
    kiln_no_grad_begin(ctx);
    if (!c->f32) kiln_autocast_begin(ctx, KILN_DTYPE_BF16);
    kiln_tensor *logits = resnet_forward(net, x);
    if (!c->f32) kiln_autocast_end(ctx);
    kiln_tensor *hits = kiln_sum(kiln_eq(kiln_argmax(logits, 1, 0), y), KILN_ALL_AXES, 0);
    kiln_no_grad_end(ctx);
    if (kiln_step_end(ctx) != KILN_OK) die(ctx, "evaluating");
    if (!c->no_gpu) right += (int64_t)kiln_tensor_item(hits);
    seen += kiln_tensor_shape(y).d[0];
  }
  kiln_step_end(ctx);
  if (kiln_ctx_error(ctx)) die(ctx, "evaluating");
  kiln_set_training(ctx, 1);
  return c->no_gpu || seen == 0 ? NAN : (double)right / (double)seen;
}

/* ---------------------------------------------------------------- checkpoints */

static void save(kiln_ctx *ctx, const config *c, kiln_params *p, kiln_optim *o, int epoch,
                 int64_t step, int classes) {
  kiln_meta *meta = kiln_meta_new();
  char buf[48];
  snprintf(buf, sizeof buf, "%d", epoch);
  kiln_meta_set(meta, "epoch", buf);
  snprintf(buf, sizeof buf, "%lld", (long long)step);
  kiln_meta_set(meta, "step", buf);
  snprintf(buf, sizeof buf, "%d %d %d %lld", c->width, c->size, classes, (long long)c->batch);
  kiln_meta_set(meta, "width size classes batch", buf);
  if (kiln_checkpoint_save(c->save, p, o, meta) != KILN_OK) die(ctx, "saving");
  kiln_meta_free(meta);
  printf("saved %s\n", c->save);
}

/* Loads --resume or --eval-only; returns the epoch to start from and sets *step. */
static int load(kiln_ctx *ctx, const config *c, kiln_params *p, kiln_optim *o, int classes,
                int64_t *step) {
  const char *path = c->resume ? c->resume : c->eval_only;
  kiln_meta *meta = kiln_meta_new();
  int first = 0;
  if (kiln_checkpoint_load(path, p, o, meta) != KILN_OK) {
    if (!c->eval_only) die(ctx, "resuming");
    kiln_ctx_clear_error(ctx); /* not a checkpoint: a weights file */
    if (kiln_params_load(p, path) != KILN_OK) die(ctx, "loading the weights");
  } else if (c->resume) {
    const char *e = kiln_meta_get(meta, "epoch"), *st = kiln_meta_get(meta, "step");
    const char *shape = kiln_meta_get(meta, "width size classes batch");
    char want[96];
    snprintf(want, sizeof want, "%d %d %d %lld", c->width, c->size, classes, (long long)c->batch);
    if (!e || !st || !shape || strcmp(shape, want) != 0) {
      fprintf(stderr,
              "imagefolder: %s was not written by a run with --width %d --size %d --batch %lld "
              "on %d classes\n",
              path, c->width, c->size, (long long)c->batch, classes);
      exit(1);
    }
    first = atoi(e) + 1;
    *step = atoll(st);
    printf("resumed %s: epoch %d done, step %lld\n", path, first, (long long)*step);
  }
  kiln_meta_free(meta);
  return first;
}

/* ---------------------------------------------------------------- training */

int main(int argc, char **argv) {
  config c = parse(argc, argv);
  kiln_ctx *ctx = kiln_ctx_new(c.no_gpu ? &(kiln_ctx_options){.no_gpu = 1} : NULL);
  if (!ctx) return 1;
  if (!c.no_gpu && !kiln_ctx_has_gpu(ctx))
    die(ctx, "no GPU (--no-gpu runs the data path and compiles the steps without one)");
  kiln_manual_seed(ctx, c.seed);
  /* the folders: DIR/train and DIR/val, or DIR and --val */
  char train_dir[4096], val_dir[4096];
  snprintf(train_dir, sizeof train_dir, "%s/train", c.train);
  snprintf(val_dir, sizeof val_dir, "%s/val", c.train);
  bool split = is_dir(train_dir) && is_dir(val_dir);
  const char *tdir = split ? train_dir : c.train, *vdir = c.val ? c.val : split ? val_dir : NULL;
  kiln_image_folder *train = kiln_image_folder_open(ctx, tdir, NULL);
  kiln_image_folder *val = vdir ? kiln_image_folder_open(ctx, vdir, NULL) : NULL;
  if (!train || (vdir && !val)) die(ctx, "opening the images");
  int classes = kiln_image_folder_classes(train);
  if (val && kiln_image_folder_classes(val) != classes) {
    fprintf(stderr, "imagefolder: %s has %d classes and %s %d\n", tdir, classes, vdir,
            kiln_image_folder_classes(val));
    return 1;
  }
  kiln_dtype dt = c.f32 ? KILN_DTYPE_F32 : KILN_DTYPE_BF16;
  kiln_image_loader_options lo = {.batch = c.batch,
                                  .height = c.size,
                                  .width = c.size,
                                  .shuffle = 1,
                                  .drop_last = 1,
                                  .seed = c.seed,
                                  .dtype = dt,
                                  .threads = c.threads};
  kiln_image_loader *tl = kiln_image_loader_new(train, &lo);
  lo.transform = KILN_IMAGE_EVAL;
  lo.shuffle = lo.drop_last = 0;
  kiln_image_loader *vl = val ? kiln_image_loader_new(val, &lo) : NULL;
  if (!tl || (val && !vl)) die(ctx, "making the loaders");
  int64_t per_epoch = kiln_image_loader_batches(tl);
  if (per_epoch == 0) {
    fprintf(stderr, "imagefolder: %lld images make no batch of %lld\n",
            (long long)kiln_image_folder_size(train), (long long)c.batch);
    return 1;
  }
  /* the model and its optimizer */
  kiln_params *p = kiln_params_new(ctx);
  resnet net;
  if (!p || resnet_init(&net, p, c.width, classes, c.size <= 64) != KILN_OK)
    die(ctx, "making the model");
  kiln_optim *opt = kiln_sgd_new(
      p, &(kiln_sgd_options){
             .lr = c.lr, .momentum = MOMENTUM, .weight_decay = WEIGHT_DECAY, .nesterov = 1});
  int64_t total = per_epoch * c.epochs;
  if (c.max_steps && c.max_steps < total) total = c.max_steps;
  kiln_optim_set_schedule(opt,
                          &(kiln_schedule){.kind = KILN_SCHEDULE_COSINE, .total_steps = total});
  if (!opt || kiln_ctx_error(ctx)) die(ctx, "making the optimizer");
  printf("%s: %lld images of %d classes%s%s; ResNet of width %d on %dx%d images, %lld "
         "parameters and buffers; batch %lld, %s%s\n",
         tdir, (long long)kiln_image_folder_size(train), classes, vdir ? ", evaluated on " : "",
         vdir ? vdir : "", c.width, c.size, c.size, (long long)kiln_params_numel(p),
         (long long)c.batch, c.f32 ? "f32" : "bf16 autocast",
         c.no_gpu ? " (no GPU: the steps are compiled, nothing runs)" : "");
  int64_t step = 0;
  int first = c.resume || c.eval_only ? load(ctx, &c, p, opt, classes, &step) : 0;
  if (c.eval_only) {
    kiln_image_loader *el = vl ? vl : NULL;
    if (!el) {
      lo.transform = KILN_IMAGE_EVAL;
      el = kiln_image_loader_new(train, &lo);
      if (!el) die(ctx, "making the loader");
    }
    printf("accuracy %.2f%% on %s\n", 100 * evaluate(ctx, &net, el, &c), vl ? vdir : tdir);
    if (el != vl) kiln_image_loader_free(el);
  }
  FILE *log = c.log ? fopen(c.log, "a") : NULL;
  if (c.log && !log) {
    perror(c.log);
    return 1;
  }
  kiln_set_training(ctx, 1);
  for (int epoch = first; !c.eval_only && epoch < c.epochs && step < total; epoch++) {
    kiln_image_loader_stats s0 = kiln_image_loader_stats_get(tl);
    kiln_image_loader_start(tl, epoch);
    /* the epoch's first step (the run's first records, compiles and captures) timed apart */
    double t0 = now(), loss_sum = 0, first_s = NAN;
    int64_t images = 0, losses = 0, first_images = 0;
    kiln_tensor *x, *y;
    for (;;) {
      kiln_step_begin(ctx);
      if (step >= total || !kiln_image_loader_next(tl, &x, &y)) break;
      if (!c.f32) kiln_autocast_begin(ctx, KILN_DTYPE_BF16);
      kiln_tensor *logits = resnet_forward(&net, x);
      if (!c.f32) kiln_autocast_end(ctx);
      kiln_tensor *loss = kiln_cross_entropy(logits, y, KILN_REDUCTION_MEAN, LABEL_SMOOTHING);
      kiln_optim_zero_grad(opt);
      kiln_backward(loss);
      kiln_optim_step(opt);
      if (kiln_step_end(ctx) != KILN_OK) die(ctx, "training");
      step++;
      images += kiln_tensor_shape(y).d[0];
      if (!first_images) {
        if (kiln_sync(ctx) != KILN_OK) die(ctx, "training");
        first_s = now() - t0, first_images = images;
      }
      if (!c.no_gpu && (step % LOSS_EVERY == 0 || step == total)) {
        loss_sum += kiln_tensor_item(loss); /* a read waits for the step */
        losses++;
      }
    }
    kiln_step_end(ctx);
    if (kiln_ctx_error(ctx)) die(ctx, "training");
    if (kiln_sync(ctx) != KILN_OK) die(ctx, "training");
    double seconds = now() - t0;
    /* the steps after the first: what training keeps up once compiled */
    double rest = images > first_images ? (images - first_images) / (seconds - first_s) : NAN;
    kiln_image_loader_stats s = kiln_image_loader_stats_get(tl);
    double decoded = (double)(s.decoded - s0.decoded);
    double cpu = s.decode_seconds - s0.decode_seconds, waited = s.wait_seconds - s0.wait_seconds;
    double acc = vl ? evaluate(ctx, &net, vl, &c) : NAN;
    /* what loading could give: the threads' rate, all of them busy */
    double can = cpu > 0 ? decoded / cpu * s.threads : NAN;
    if (c.no_gpu)
      printf("epoch %d (no GPU: no loss):", epoch + 1);
    else
      printf("epoch %d: loss %.4f;", epoch + 1, losses ? loss_sum / (double)losses : NAN);
    printf(" training %lld images in %.2f s: %.0f images/s, %.0f after the first step (%.2f s); "
           "loading could give %.0f images/s (%d threads, %.0f files decoded in %.2f "
           "thread-seconds), the steps waited %.2f s for it",
           (long long)images, seconds, images / seconds, rest, first_s, can, s.threads, decoded,
           cpu, waited);
    if (vl && !c.no_gpu) printf("; accuracy %.2f%%", 100 * acc);
    printf("\n");
    if (log) {
      fprintf(log,
              "{\"epoch\": %d, \"step\": %lld, \"loss\": %.6g, \"images\": %lld, \"seconds\": "
              "%.4f, \"images_per_s\": %.1f, \"first_step_s\": %.4f, \"images_per_s_after_first\": "
              "%.1f, \"decoded\": %.0f, \"decode_thread_s\": %.4f, \"loading_images_per_s\": %.1f, "
              "\"waited_s\": %.4f, \"accuracy\": %.6g}\n",
              epoch + 1, (long long)step, losses ? loss_sum / (double)losses : -1.0,
              (long long)images, seconds, images / seconds, first_images ? first_s : -1.0,
              isnan(rest) ? -1.0 : rest, decoded, cpu, cpu > 0 ? can : -1.0, waited,
              vl && !c.no_gpu ? acc : -1.0);
      fflush(log);
    }
    if (c.save) save(ctx, &c, p, opt, epoch, step, classes);
  }
  if (log) fclose(log);
  int64_t bad = kiln_image_folder_bad_count(train) + kiln_image_folder_bad_count(val);
  if (bad) printf("%lld bad files were skipped (listed above)\n", (long long)bad);
  kiln_image_loader_free(tl);
  kiln_image_loader_free(vl);
  kiln_image_folder_free(train);
  kiln_image_folder_free(val);
  kiln_optim_free(opt);
  kiln_params_free(p);
  kiln_ctx_free(ctx);
  return 0;
}
