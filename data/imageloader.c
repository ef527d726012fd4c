/*
 * imageloader.c: the loader of an image folder (imagefolder.c). Its threads read and decode a
 * batch's files (imagefile.c) while the GPU runs the step before, draw each image's crop on the
 * host, and copy only the pixels the resize will read into pinned host memory; the batch's copy
 * to the device is queued by kiln_image_loader_next, which records the one kernel that resizes,
 * crops, flips and normalises the batch (kiln__resize_crop, fusion/render_augment.c).
 *
 * Two slots take turns: while the step of the batch in one runs, the threads fill the other. A
 * slot's pinned memory is written again only after its last copy is done (an event). The staged
 * pixels of a batch lie back to back in the slot; a batch that needs more room than the slot
 * has keeps the overflow in host memory until the main thread grows the slot (and the device
 * buffer: a new persistent tensor, so the step is captured again, rarely).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "imagefolder.h"

#define MAX_THREADS 32    /* decoding threads */
#define MAX_REPLACE 64    /* samples tried in place of a bad one */
#define RAW_MAX INT32_MAX /* a batch's staged bytes: i32 offsets in the kernel's table */

/* ---------------------------------------------------------------- crops */

/* torchvision's RandomResizedCrop box of an image rows x cols: (*y, *x) and *h x *w. */
static void random_crop(const kiln_image_loader_options *o, int rows, int cols, uint64_t *rng,
                        int *y, int *x, int *h, int *w) {
  double area = (double)rows * cols;
  double lr0 = log(o->ratio_min), lr1 = log(o->ratio_max);
  for (int t = 0; t < 10; t++) {
    double target =
        area * (o->scale_min + (o->scale_max - o->scale_min) * kiln__splitmix64_unit(rng));
    double ratio = exp(lr0 + (lr1 - lr0) * kiln__splitmix64_unit(rng));
    /* Python's round: half to even, as nearbyint */
    int cw = (int)nearbyint(sqrt(target * ratio)), ch = (int)nearbyint(sqrt(target / ratio));
    if (cw > 0 && cw <= cols && ch > 0 && ch <= rows) {
      *y = (int)(kiln__splitmix64_unit(rng) * (rows - ch + 1));
      *x = (int)(kiln__splitmix64_unit(rng) * (cols - cw + 1));
      *h = ch;
      *w = cw;
      return;
    }
  }
  /* the whole image, cut to the nearest allowed ratio, centred */
  double in_ratio = (double)cols / rows;
  *w = cols;
  *h = rows;
  if (in_ratio < o->ratio_min) {
    *h = (int)nearbyint(cols / o->ratio_min);
  } else if (in_ratio > o->ratio_max) {
    *w = (int)nearbyint(rows * o->ratio_max);
  }
  *h = *h < 1 ? 1 : (*h > rows ? rows : *h);
  *w = *w < 1 ? 1 : (*w > cols ? cols : *w);
  *y = (rows - *h) / 2;
  *x = (cols - *w) / 2;
}

/* The source pixels [*lo, *hi) that output coordinates [o0, o0 + n) of a source of `in` pixels
 * resized to rs read (the kernel's taps, augment.cuh), one pixel wider on each side against
 * rounding between the host's double and the device's float. */
static void taps_span(int o0, int n, int in, int rs, int *lo, int *hi) {
  double scale = (double)in / rs, fs = scale > 1 ? scale : 1;
  double c0 = (o0 + 0.5) * scale, c1 = (o0 + n - 1 + 0.5) * scale;
  int l = (int)floor(c0 - fs + 0.5) - 1, h = (int)floor(c1 + fs + 0.5) + 1;
  *lo = l < 0 ? 0 : l;
  *hi = h > in ? in : h;
}

/* ---------------------------------------------------------------- the loader */

typedef struct item {
  int64_t sample; /* the sample made (a replacement's, when its file was bad) */
  int32_t label;
  int32_t row[KILN__RESIZE_COLS]; /* its row of the kernel's table */
  int64_t at, bytes;              /* its staged pixels in the slot */
  uint8_t *spill;                 /* those pixels, when the slot had no room for them */
} item;

/* A batch being made, or made: the files of positions [pos, pos + count) of an epoch's order. */
typedef struct slot {
  uint8_t *host; /* staged pixels, cap bytes (pinned where it can be) */
  size_t cap;
  bool pinned;
  void *copied; /* an event after this slot's last copy to the device */
  int epoch;
  int64_t pos, count;
  item *items; /* (batch) */
  int next, finished;
  bool busy;    /* a batch is in it or being made */
  int64_t used; /* bytes staged */
  int64_t decoded;
  double seconds;
  char err[512]; /* a bad file with KILN_IMAGE_BAD_FAIL, or out of memory */
} slot;

struct kiln_image_loader {
  kiln_ctx *ctx;
  kiln__anchor *anchor;
  kiln_image_folder *f;
  kiln_image_loader_options o;
  int64_t n, B;
  int epoch;
  int64_t pos;
  int32_t *order; /* (n) this epoch's */
  slot slot[2];
  slot *filling;     /* the slot the threads work on (NULL: none) */
  slot *copied_last; /* the slot whose copy to the device was queued last */
  pthread_t *threads;
  int nthreads;
  pthread_mutex_t mu;
  pthread_cond_t work, done;
  bool quit;
  kiln_tensor *raw;    /* (raw_cap / 4) i32: the staged pixels on the device */
  kiln_tensor *table;  /* (B, KILN__RESIZE_COLS) i32 */
  kiln_tensor *labels; /* (B) i32 */
  int64_t raw_cap;
  void *copied;                      /* an event after the last table and label copies */
  int32_t *table_host, *labels_host; /* their host copies, pinned where they can be */
  bool table_pinned, labels_pinned;
  uint64_t undo_mark;
  kiln_image_loader_stats stats;
};

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* Makes item k of slot s: decodes its sample (or replacements), places its crop, stages the
 * pixels the kernel reads. Runs on a loader thread, without the lock but for the staging's room. */
static void make_item(kiln_image_loader *l, slot *s, int k) {
  const kiln_image_loader_options *o = &l->o;
  kiln_image_folder *f = l->f;
  item *it = &s->items[k];
  int64_t want = l->order[s->pos + k];
  uint8_t *px = NULL;
  int rows = 0, cols = 0;
  double t0 = now();
  int64_t tries = 0, sample = want;
  char why[256];
  for (; tries < MAX_REPLACE && tries < f->n; tries++) {
    sample = (want + tries) % f->n;
    /* a byte each, written only to 1 (a stale 0 decodes the file again) */
    if (f->o.bad == KILN_IMAGE_BAD_SKIP && __atomic_load_n(&f->bad[sample], __ATOMIC_RELAXED))
      continue;
    px = kiln__image_folder_decode(f, sample, &rows, &cols, why, sizeof why);
    pthread_mutex_lock(&l->mu);
    s->decoded++;
    pthread_mutex_unlock(&l->mu);
    if (px) break;
    bool fail = f->o.bad == KILN_IMAGE_BAD_FAIL;
    kiln__image_folder_mark_bad(f, sample, why, !fail, true); /* failing: the error names it */
    if (fail) {
      pthread_mutex_lock(&l->mu);
      if (!s->err[0]) snprintf(s->err, sizeof s->err, "%s: %s", f->paths[sample], why);
      pthread_mutex_unlock(&l->mu);
      return;
    }
  }
  if (!px) {
    pthread_mutex_lock(&l->mu);
    if (!s->err[0])
      snprintf(s->err, sizeof s->err,
               "no file among the %lld samples from %s (sample %lld) decodes", (long long)tries,
               f->paths[want], (long long)want);
    pthread_mutex_unlock(&l->mu);
    return;
  }
  /* the source (a crop, or the whole image), its resized size and the output's window in it */
  int y0 = 0, x0 = 0, h = rows, w = cols, rh, rw, oy = 0, ox = 0, flip = 0;
  if (o->transform == KILN_IMAGE_TRAIN) {
    uint64_t rng = o->seed * 0x9e3779b97f4a7c15ULL ^ (uint64_t)s->epoch * 0xd1b54a32d192ed03ULL ^
                   (uint64_t)want * 0xa0761d6478bd642fULL;
    random_crop(o, rows, cols, &rng, &y0, &x0, &h, &w);
    rh = o->height;
    rw = o->width;
    flip = !o->no_flip && kiln__splitmix64_unit(&rng) < 0.5;
  } else {
    /* Resize(resize): the shorter side to resize, the longer in proportion (truncated) */
    int64_t longer =
        rows <= cols ? (int64_t)o->resize * cols / rows : (int64_t)o->resize * rows / cols;
    if (longer > ((int64_t)1 << 24)) { /* a 1 x 60000 image, say: the kernel's sizes are ints */
      snprintf(why, sizeof why,
               "%d x %d pixels: resized to %d on its shorter side, the other would "
               "be %lld",
               rows, cols, o->resize, (long long)longer);
      free(px);
      pthread_mutex_lock(&l->mu);
      if (!s->err[0]) snprintf(s->err, sizeof s->err, "%s: %s", f->paths[sample], why);
      pthread_mutex_unlock(&l->mu);
      return;
    }
    rh = rows <= cols ? o->resize : (int)longer;
    rw = rows <= cols ? (int)longer : o->resize;
    /* CenterCrop: int(round((resized - size) / 2)), half to even */
    oy = (int)nearbyint((rh - o->height) / 2.0);
    ox = (int)nearbyint((rw - o->width) / 2.0);
  }
  int r0, r1, c0, c1;
  taps_span(oy, o->height, h, rh, &r0, &r1);
  taps_span(ox, o->width, w, rw, &c0, &c1);
  int64_t sw = c1 - c0, bytes = (int64_t)(r1 - r0) * sw * 3;
  pthread_mutex_lock(&l->mu);
  int64_t at = s->used;
  s->used += bytes;
  pthread_mutex_unlock(&l->mu);
  uint8_t *dst = at + bytes <= (int64_t)s->cap ? s->host + at : (it->spill = malloc((size_t)bytes));
  if (!dst) {
    pthread_mutex_lock(&l->mu);
    if (!s->err[0]) snprintf(s->err, sizeof s->err, "out of host memory");
    pthread_mutex_unlock(&l->mu);
    free(px);
    return;
  }
  for (int r = r0; r < r1; r++)
    memcpy(dst + (int64_t)(r - r0) * sw * 3, px + (((int64_t)(y0 + r) * cols) + x0 + c0) * 3,
           (size_t)sw * 3);
  free(px);
  it->sample = sample;
  it->label = f->label[sample];
  it->at = at;
  it->bytes = bytes;
  int32_t *row = it->row;
  memset(row, 0, sizeof it->row);
  row[KILN__RZ_ROWS] = h;
  row[KILN__RZ_COLS] = w;
  row[KILN__RZ_RROWS] = rh;
  row[KILN__RZ_RCOLS] = rw;
  row[KILN__RZ_OY] = oy;
  row[KILN__RZ_OX] = ox;
  row[KILN__RZ_R0] = r0;
  row[KILN__RZ_C0] = c0;
  row[KILN__RZ_SW] = (int32_t)sw;
  row[KILN__RZ_FLIP] = flip;
  pthread_mutex_lock(&l->mu);
  s->seconds += now() - t0;
  pthread_mutex_unlock(&l->mu);
}

static void *worker(void *arg) {
  kiln_image_loader *l = arg;
  pthread_mutex_lock(&l->mu);
  for (;;) {
    slot *s = l->filling;
    if (l->quit) break;
    if (!s || s->next >= s->count) {
      pthread_cond_wait(&l->work, &l->mu);
      continue;
    }
    int k = s->next++;
    pthread_mutex_unlock(&l->mu);
    make_item(l, s, k);
    pthread_mutex_lock(&l->mu);
    if (++s->finished == s->count) {
      l->filling = NULL;
      pthread_cond_broadcast(&l->done);
    }
  }
  pthread_mutex_unlock(&l->mu);
  return NULL;
}

/* The batch at pos of the current epoch, or 0 past its end. */
static int64_t batch_at(const kiln_image_loader *l, int64_t pos) {
  int64_t left = l->n - pos;
  if (left <= 0 || (l->o.drop_last && left < l->B)) return 0;
  return left < l->B ? left : l->B;
}

/* Hands the batch at pos to the threads in slot s (idle, its last copy done). */
static void submit(kiln_image_loader *l, slot *s, int64_t pos) {
  for (int k = 0; k < s->count; k++)
    free(s->items[k].spill);
  pthread_mutex_lock(&l->mu);
  KILN_ASSERT(!l->filling);
  s->epoch = l->epoch;
  s->pos = pos;
  s->count = batch_at(l, pos);
  memset(s->items, 0, (size_t)l->B * sizeof *s->items);
  s->next = s->finished = 0;
  s->used = s->decoded = 0;
  s->seconds = 0;
  s->err[0] = 0;
  s->busy = true;
  l->filling = s;
  pthread_cond_broadcast(&l->work);
  pthread_mutex_unlock(&l->mu);
}

/* Waits until the threads are done with slot s. */
static void finish(kiln_image_loader *l, slot *s) {
  pthread_mutex_lock(&l->mu);
  while (l->filling == s)
    pthread_cond_wait(&l->done, &l->mu);
  pthread_mutex_unlock(&l->mu);
}

/* Drops what a slot holds (its batch is not wanted), waiting for its threads. */
static void discard(kiln_image_loader *l, slot *s) {
  finish(l, s);
  s->busy = false;
}

/* Starts the threads on the batch at pos (if any) in a free slot whose last copy is done, the
 * slot other than `recent` (whose copy was queued last) where both are free; false with the
 * error set when waiting for that copy fails. */
static bool prefetch(kiln_image_loader *l, int64_t pos, const slot *recent, const char *fn) {
  if (batch_at(l, pos) == 0) return true;
  slot *s = NULL;
  for (int i = 0; i < 2; i++)
    if (!l->slot[i].busy && (!s || s == recent)) s = &l->slot[i];
  if (!s) return true;
  if (kiln__upload_wait(l->ctx, s->copied, fn) != KILN_OK) return false;
  submit(l, s, pos);
  return true;
}

void kiln_image_loader_start(kiln_image_loader *l, int epoch) {
  if (!l || !l->anchor->alive) return;
  for (int i = 0; i < 2; i++)
    if (l->slot[i].busy) discard(l, &l->slot[i]);
  for (int64_t i = 0; i < l->n; i++)
    l->order[i] = (int32_t)i;
  if (l->o.shuffle) {
    uint64_t state = l->o.seed * 0x9e3779b97f4a7c15ULL + (uint64_t)epoch * 0xd1b54a32d192ed03ULL;
    for (int64_t i = l->n - 1; i > 0; i--) {
      int64_t j = (int64_t)(kiln__splitmix64(&state) % (uint64_t)(i + 1));
      int32_t t = l->order[i];
      l->order[i] = l->order[j];
      l->order[j] = t;
    }
  }
  l->epoch = epoch;
  l->pos = 0;
  prefetch(l, 0, l->copied_last, "kiln_image_loader_start");
}

/* Gives slot s room for its used bytes on the host (moving the spilled items in) and on the
 * device (a new, larger buffer). */
static bool grow(kiln_image_loader *l, slot *s, const char *fn) {
  kiln_ctx *ctx = l->ctx;
  if (s->used > RAW_MAX)
    return !kiln__error(ctx, KILN_ERR_INVALID,
                        "%s: the batch at %lld stages %lld bytes of pixels, more than %lld: a "
                        "smaller batch or max_pixels",
                        fn, (long long)s->pos, (long long)s->used, (long long)RAW_MAX);
  if (s->used > (int64_t)s->cap) {
    size_t cap = 2 * (size_t)s->used;
    cap = cap > RAW_MAX ? RAW_MAX : cap;
    bool pinned;
    uint8_t *h = kiln__host_alloc(ctx, cap, &pinned);
    if (!h) return !kiln__error(ctx, KILN_ERR_OOM, "%s: out of host memory for %zu bytes", fn, cap);
    memcpy(h, s->host, s->cap);
    for (int k = 0; k < s->count; k++)
      if (s->items[k].spill) {
        memcpy(h + s->items[k].at, s->items[k].spill, (size_t)s->items[k].bytes);
        free(s->items[k].spill);
        s->items[k].spill = NULL;
      }
    kiln__host_free(s->host, s->pinned);
    s->host = h;
    s->cap = cap;
    s->pinned = pinned;
  }
  if (s->used > l->raw_cap) {
    int64_t cap = ((int64_t)s->cap + 3) / 4;
    kiln_tensor *raw = kiln__tensor_persistent(ctx, KILN_DTYPE_I32, 1, &cap, false);
    if (!raw) return false;
    /* the old buffer's readers (steps already queued) finish first, and the step graphs that
     * read it go with it (they would never replay, and they hold their memory) */
    if (kiln_sync(ctx) != KILN_OK) {
      kiln_tensor_free(raw);
      return false;
    }
    kiln__forget_step_graphs(ctx);
    kiln_tensor_free(l->raw);
    kiln_tensor_set_name(raw, "image_loader.pixels");
    l->raw = raw;
    l->raw_cap = cap * 4;
  }
  return true;
}

static void undo_pos(void *obj, void *saved) {
  ((kiln_image_loader *)obj)->pos = *(int64_t *)saved;
}

int kiln_image_loader_next(kiln_image_loader *l, kiln_tensor **x, kiln_tensor **y) {
  const char *fn = __func__;
  if (!l || !l->anchor->alive) return 0;
  kiln_ctx *ctx = l->ctx;
  if (!kiln__ok(ctx)) return 0;
  if (!x || !y) return kiln__error(ctx, KILN_ERR_INVALID, "%s: NULL x or y", fn), 0;
  int64_t b = batch_at(l, l->pos);
  if (b == 0) return 0;
  if (ctx->in_step && !kiln__undo_logged(ctx, &l->undo_mark)) {
    /* a failed step gives its batch back */
    int64_t *saved = malloc(sizeof *saved);
    if (!saved) return kiln__error(ctx, KILN_ERR_OOM, "%s: out of host memory", fn), 0;
    *saved = l->pos;
    if (!kiln__undo_push(ctx, undo_pos, l, saved, &l->undo_mark)) return 0;
  }
  /* the slot holding this batch (decoded ahead), else one made now */
  slot *s = NULL;
  for (int i = 0; i < 2; i++) {
    slot *c = &l->slot[i];
    if (c->busy && (c->epoch != l->epoch || c->pos != l->pos))
      discard(l, c);
    else if (c->busy)
      s = c;
  }
  if (!s) {
    if (!prefetch(l, l->pos, l->copied_last, fn)) return 0;
    s = l->slot[0].busy ? &l->slot[0] : &l->slot[1];
    KILN_ASSERT(s->busy && s->pos == l->pos);
  }
  double t0 = now();
  finish(l, s);
  l->stats.wait_seconds += now() - t0;
  l->stats.decoded += s->decoded;
  l->stats.decode_seconds += s->seconds;
  if (s->err[0]) {
    s->busy = false;
    return kiln__error(ctx, KILN_ERR_FORMAT, "%s: %s", fn, s->err), 0;
  }
  if (!grow(l, s, fn)) {
    s->busy = false;
    return 0;
  }
  /* the table and the labels: their host copies are written once the last copy is done */
  if (kiln__upload_wait(ctx, l->copied, fn) != KILN_OK) return 0;
  for (int k = 0; k < s->count; k++) {
    item *it = &s->items[k];
    it->row[KILN__RZ_OFFSET] = (int32_t)it->at;
    memcpy(l->table_host + (int64_t)k * KILN__RESIZE_COLS, it->row, sizeof it->row);
    l->labels_host[k] = it->label;
  }
  size_t tbytes = (size_t)s->count * KILN__RESIZE_COLS * sizeof(int32_t);
  if (kiln__upload(l->raw, 0, s->host, (size_t)s->used, s->pinned, &s->copied, fn) != KILN_OK ||
      kiln__upload(l->table, 0, l->table_host, tbytes, l->table_pinned, &l->copied, fn) !=
          KILN_OK ||
      kiln__upload(l->labels, 0, l->labels_host, (size_t)s->count * sizeof(int32_t),
                   l->labels_pinned, &l->copied, fn) != KILN_OK) {
    s->busy = false;
    return 0;
  }
  s->busy = false;
  l->copied_last = s;
  l->stats.images += s->count;
  l->stats.bytes_copied += s->used + (int64_t)tbytes;
  /* the next batch decodes while this one's step runs */
  if (!prefetch(l, l->pos + b, s, fn)) return 0;
  kiln_tensor *table = b == l->B ? l->table : kiln_slice(l->table, 0, 0, b, 1);
  kiln_tensor *labels = b == l->B ? l->labels : kiln_slice(l->labels, 0, 0, b, 1);
  kiln_tensor *img = table ? kiln__resize_crop(l->raw, table, l->o.height, l->o.width, l->o.mean,
                                               l->o.std, l->o.dtype, fn)
                           : NULL;
  if (!img || !labels) return 0;
  l->pos += b;
  *x = img;
  *y = labels;
  return 1;
}

int64_t kiln_image_loader_batches(const kiln_image_loader *l) {
  if (!l) return 0;
  return l->n / l->B + (!l->o.drop_last && l->n % l->B != 0);
}

kiln_image_loader_stats kiln_image_loader_stats_get(const kiln_image_loader *l) {
  kiln_image_loader_stats none = {0};
  if (!l) return none;
  kiln_image_loader_stats s = l->stats;
  s.threads = l->nthreads;
  return s;
}

/* The options with their defaults filled in; false with the error set when they make no sense. */
static bool loader_options(kiln_ctx *ctx, const kiln_image_loader_options *in,
                           kiln_image_loader_options *o, const char *fn) {
  static const float imagenet_mean[3] = {0.485f, 0.456f, 0.406f};
  static const float imagenet_std[3] = {0.229f, 0.224f, 0.225f};
  *o = *in;
  if (!o->height) o->height = 224;
  if (!o->width) o->width = 224;
  if (o->scale_min == 0.f) o->scale_min = 0.08f;
  if (o->scale_max == 0.f) o->scale_max = 1.f;
  if (o->ratio_min == 0.f) o->ratio_min = 3.f / 4.f;
  if (o->ratio_max == 0.f) o->ratio_max = 4.f / 3.f;
  /* Resize's default keeps the crop's 224 of 256: the larger side of the crop, times 8 / 7 */
  int side = o->height > o->width ? o->height : o->width;
  if (!o->resize && side > 0) o->resize = (int)((int64_t)side * 8 / 7);
  bool stats = false;
  for (int c = 0; c < 3; c++)
    stats = stats || o->mean[c] != 0.f || o->std[c] != 0.f;
  if (!stats) {
    memcpy(o->mean, imagenet_mean, sizeof o->mean);
    memcpy(o->std, imagenet_std, sizeof o->std);
  }
  if (o->batch <= 0 || o->batch > INT32_MAX)
    return !kiln__error(ctx, KILN_ERR_INVALID, "%s: batch %lld must be in 1 .. 2^31 - 1", fn,
                        (long long)o->batch);
  if (!kiln__flag_ok(ctx, fn, NULL, "shuffle", o->shuffle) ||
      !kiln__flag_ok(ctx, fn, NULL, "drop_last", o->drop_last) ||
      !kiln__flag_ok(ctx, fn, NULL, "no_flip", o->no_flip))
    return false;
  if (o->height < 1 || o->width < 1 || o->height > 65536 || o->width > 65536)
    return !kiln__error(ctx, KILN_ERR_INVALID, "%s: height %d and width %d must be in 1 .. 65536",
                        fn, o->height, o->width);
  if (o->transform != KILN_IMAGE_TRAIN && o->transform != KILN_IMAGE_EVAL)
    return !kiln__error(ctx, KILN_ERR_INVALID,
                        "%s: unknown transform %d (KILN_IMAGE_TRAIN or KILN_IMAGE_EVAL)", fn,
                        (int)o->transform);
  if (!(o->scale_min > 0.f && o->scale_min <= o->scale_max && o->scale_max <= 1.f))
    return !kiln__error(ctx, KILN_ERR_INVALID,
                        "%s: scale [%g, %g]: it needs 0 < scale_min <= scale_max <= 1", fn,
                        o->scale_min, o->scale_max);
  if (!(o->ratio_min > 0.f && o->ratio_min <= o->ratio_max && isfinite(o->ratio_max)))
    return !kiln__error(ctx, KILN_ERR_INVALID,
                        "%s: ratio [%g, %g]: it needs 0 < ratio_min <= ratio_max, finite", fn,
                        o->ratio_min, o->ratio_max);
  if (o->transform == KILN_IMAGE_EVAL &&
      (o->resize < o->height || o->resize < o->width || o->resize > 65536))
    return !kiln__error(ctx, KILN_ERR_INVALID,
                        "%s: resize %d: the shorter side must be resized to at least the crop's "
                        "height %d and width %d (and at most 65536)",
                        fn, o->resize, o->height, o->width);
  for (int c = 0; c < 3; c++)
    if (!isfinite(o->mean[c]) || !(o->std[c] > 0.f) || !isfinite(o->std[c]))
      return !kiln__error(ctx, KILN_ERR_INVALID,
                          "%s: channel %d's mean %g must be finite and its std %g finite and > 0",
                          fn, c, o->mean[c], o->std[c]);
  if (o->dtype != KILN_DTYPE_F32 && o->dtype != KILN_DTYPE_BF16)
    return !kiln__error(ctx, KILN_ERR_DTYPE, "%s: dtype %s: the images are f32 or bf16", fn,
                        kiln_dtype_name(o->dtype));
  if (o->threads < 0)
    return !kiln__error(ctx, KILN_ERR_INVALID, "%s: threads %d must be >= 0 (0: the processors)",
                        fn, o->threads);
  if (!o->threads) {
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    o->threads = cpus < 1 ? 1 : (int)(cpus > MAX_THREADS ? MAX_THREADS : cpus);
  }
  if (o->threads > MAX_THREADS) o->threads = MAX_THREADS;
  return true;
}

kiln_image_loader *kiln_image_loader_new(kiln_image_folder *f, const kiln_image_loader_options *o) {
  const char *fn = __func__;
  if (!f) return NULL;
  kiln_ctx *ctx = f->ctx;
  if (!kiln__ok(ctx)) return NULL;
  if (!o)
    return kiln__error(ctx, KILN_ERR_INVALID, "%s: NULL options (batch is required)", fn), NULL;
  kiln_image_loader_options opt;
  if (!loader_options(ctx, o, &opt, fn)) return NULL;
  kiln_image_loader *l = calloc(1, sizeof *l);
  if (!l) return kiln__error(ctx, KILN_ERR_OOM, "%s: out of host memory", fn), NULL;
  l->ctx = ctx;
  l->anchor = kiln__ctx_anchor(ctx);
  l->f = f;
  l->o = opt;
  l->n = f->n;
  l->B = opt.batch;
  pthread_mutex_init(&l->mu, NULL);
  pthread_cond_init(&l->work, NULL);
  pthread_cond_init(&l->done, NULL);
  f->loaders++;
  /* room for three times the output's pixels an image, to start with (a crop or an image a
   * little larger than the output): it doubles when a batch needs more */
  int64_t per = (int64_t)opt.height * opt.width * 3 * 3;
  int64_t cap64 = l->B > RAW_MAX / per ? RAW_MAX : l->B * per;
  size_t cap = (size_t)cap64;
  int64_t words = ((int64_t)cap + 3) / 4, tshape[2] = {l->B, KILN__RESIZE_COLS};
  bool ok = (l->order = malloc((size_t)l->n * sizeof *l->order)) != NULL;
  for (int i = 0; ok && i < 2; i++) {
    l->slot[i].items = calloc((size_t)l->B, sizeof(item));
    l->slot[i].host = kiln__host_alloc(ctx, cap, &l->slot[i].pinned);
    l->slot[i].cap = cap;
    ok = l->slot[i].items && l->slot[i].host;
  }
  ok = ok &&
       (l->table_host = kiln__host_alloc(ctx, (size_t)l->B * KILN__RESIZE_COLS * sizeof(int32_t),
                                         &l->table_pinned)) &&
       (l->labels_host = kiln__host_alloc(ctx, (size_t)l->B * sizeof(int32_t), &l->labels_pinned));
  if (!ok) {
    kiln__error(ctx, KILN_ERR_OOM, "%s: out of host memory for a batch of %lld", fn,
                (long long)l->B);
  } else {
    l->raw = kiln__tensor_persistent(ctx, KILN_DTYPE_I32, 1, &words, false);
    l->table = kiln__tensor_persistent(ctx, KILN_DTYPE_I32, 2, tshape, false);
    l->labels = kiln__tensor_persistent(ctx, KILN_DTYPE_I32, 1, &l->B, false);
    ok = l->raw && l->table && l->labels;
  }
  if (ok) {
    l->raw_cap = words * 4;
    kiln_tensor_set_name(l->raw, "image_loader.pixels");
    kiln_tensor_set_name(l->table, "image_loader.table");
    kiln_tensor_set_name(l->labels, "image_loader.labels");
    l->threads = calloc((size_t)opt.threads, sizeof *l->threads);
    ok = l->threads != NULL;
    if (!ok) kiln__error(ctx, KILN_ERR_OOM, "%s: out of host memory", fn);
  }
  for (int t = 0; ok && t < opt.threads; t++) {
    int e = pthread_create(&l->threads[t], NULL, worker, l);
    if (e)
      ok = !kiln__error(ctx, KILN_ERR_OOM, "%s: cannot start a thread: %s", fn, strerror(e));
    else
      l->nthreads++;
  }
  if (!ok) {
    kiln_image_loader_free(l);
    return NULL;
  }
  kiln_image_loader_start(l, 0);
  return l;
}

void kiln_image_loader_free(kiln_image_loader *l) {
  if (!l) return;
  pthread_mutex_lock(&l->mu);
  l->quit = true;
  pthread_cond_broadcast(&l->work);
  pthread_mutex_unlock(&l->mu);
  for (int t = 0; t < l->nthreads; t++)
    pthread_join(l->threads[t], NULL);
  free(l->threads);
  bool alive = l->anchor && l->anchor->alive;
  if (alive) { /* else kiln_ctx_free freed the tensors, and the stream is gone */
    kiln__undo_forget(l->ctx, l);
    for (int i = 0; i < 2; i++)
      kiln__upload_wait(l->ctx, l->slot[i].copied, __func__);
    kiln__upload_wait(l->ctx, l->copied, __func__);
    kiln_tensor_free(l->raw);
    kiln_tensor_free(l->table);
    kiln_tensor_free(l->labels);
  }
  for (int i = 0; i < 2; i++) {
    slot *s = &l->slot[i];
    if (s->items)
      for (int64_t k = 0; k < l->B; k++)
        free(s->items[k].spill);
    free(s->items);
    kiln__host_free(s->host, s->pinned);
    if (alive) kiln__event_free(s->copied);
  }
  kiln__host_free(l->table_host, l->table_pinned);
  kiln__host_free(l->labels_host, l->labels_pinned);
  if (alive) kiln__event_free(l->copied);
  free(l->order);
  pthread_mutex_destroy(&l->mu);
  pthread_cond_destroy(&l->work);
  pthread_cond_destroy(&l->done);
  l->f->loaders--;
  if (l->anchor) kiln__anchor_release(l->anchor);
  free(l);
}
