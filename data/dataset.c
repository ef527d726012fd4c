/*
 * dataset.c: data sets held on the device (uploaded once) and batches gathered there. A loader
 * shuffles each epoch on the host from its seed, uploads the epoch's order once (one process's
 * shard of it when there are several: shard.c), and each batch is a slice of that order and a
 * row gather: nothing per batch crosses the bus. A batch's
 * data-set indices (for augmentation that depends on the sample) are a gather of that slice too.
 * Host data come in the readers' types (uint8 labels checked against the classes) and are
 * normalised by given statistics or by their own, which the data set keeps. kiln_evaluate
 * (evaluate.c) reads an epoch's batches without moving the loader, through dataset.h.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../core/internal.h"
#include "dataset.h"
#include "shard.h"

struct kiln_dataset {
  kiln_ctx *ctx;
  kiln__anchor *anchor;
  int64_t n;
  kiln_tensor *images; /* (n, ...) f32, or bf16 (kiln_dataset_set_dtype) */
  kiln_tensor *labels; /* (n) i32 */
  int norm_channels;   /* the normalisation it was made with: 0 none */
  float *norm;         /* (2 norm_channels): the means, then the standard deviations */
};

struct kiln_loader {
  kiln_ctx *ctx;
  kiln__anchor *anchor;
  kiln_dataset *ds;
  int64_t batch, pos;
  bool shuffle, drop_last;
  uint64_t seed;
  kiln_tensor *order; /* (epoch_n) i32: this epoch's order, or its shard */
  kiln_tensor *iota;  /* (n) i32: 0, 1, ..., n - 1, the table kiln_loader_indices gathers from */
  int32_t *host_order;
  int rank, world; /* this process's shard of each epoch (world 0: the whole order) */
  int64_t epoch_n; /* samples an epoch gives: the shard's, or the data set's */
  int32_t *shard;  /* (epoch_n) with world > 0: this epoch's shard of host_order */
  int64_t last_start, last_count; /* the slice of the order the last batch took (count 0: none) */
  uint64_t undo_mark;             /* the step's undo log holds pos (core/undo.c) */
  kiln_tensor *eval_loss, *eval_hits; /* kiln_evaluate's sums, () f32 each, or NULL */
};

/* ---------------------------------------------------------------- data sets from host memory */

/* Checks host images of shape (n, ...) for fn: a known type, data, at least one sample of at
 * least one value, and channels (the entries of a per-channel mean and std) 1 or the last axis's
 * size (0 too when zero_ok: no normalisation). *n gets the samples, *total the values. */
static bool host_images_ok(kiln_ctx *ctx, const char *fn, kiln_host_type type, kiln_shape shape,
                           const void *images, int channels, bool zero_ok, int64_t *n,
                           int64_t *total) {
  char sh[96];
  if (type != KILN_HOST_F32 && type != KILN_HOST_U8)
    return !kiln__error(ctx, KILN_ERR_INVALID, "%s: unknown host type %d", fn, (int)type);
  if (!images) return !kiln__error(ctx, KILN_ERR_INVALID, "%s: NULL images", fn);
  if (shape.ndim < 1 || shape.ndim > KILN_MAX_DIMS)
    return !kiln__error(ctx, KILN_ERR_SHAPE,
                        "%s: images of %d dims; they need 1 to %d, the first the sample", fn,
                        shape.ndim, KILN_MAX_DIMS);
  if (!kiln__valid_shape(ctx, fn, shape.ndim, shape.d)) return false;
  *n = shape.d[0];
  *total = kiln__numel(shape.ndim, shape.d);
  if (*n <= 0 || *total <= 0)
    return !kiln__error(ctx, KILN_ERR_SHAPE, "%s: images %s hold no values: an empty data set", fn,
                        kiln_shape_str(shape, sh, sizeof sh));
  int64_t last = shape.ndim > 1 ? shape.d[shape.ndim - 1] : 1;
  if (!((channels == 0 && zero_ok) || channels == 1 || (channels > 0 && channels == last)))
    return !kiln__error(ctx, KILN_ERR_SHAPE,
                        "%s: %d channels for images %s: channels are the last axis (%lld), or 1 "
                        "for every value together%s",
                        fn, channels, kiln_shape_str(shape, sh, sizeof sh), (long long)last,
                        zero_ok ? " (0: no normalisation)" : "");
  return true;
}

/* Value i of host images, u8 pixels scaled to [0, 1]. */
static inline float host_value(kiln_host_type type, const void *images, int64_t i) {
  return type == KILN_HOST_U8 ? (float)((const uint8_t *)images)[i] / 255.f
                              : ((const float *)images)[i];
}

/* The per-channel population mean and standard deviation of the total values of checked host
 * images into mean and std (channels each); false with the error set, naming fn. */
static bool image_stats(kiln_ctx *ctx, const char *fn, kiln_host_type type, const void *images,
                        int64_t total, int channels, float *mean, float *std) {
  double *acc = calloc((size_t)channels * 2, sizeof *acc);
  uint64_t *hist = type == KILN_HOST_U8 ? calloc((size_t)channels * 256, sizeof *hist) : NULL;
  if (!acc || (type == KILN_HOST_U8 && !hist)) {
    free(acc);
    free(hist);
    return !kiln__error(ctx, KILN_ERR_OOM, "%s: out of host memory", fn);
  }
  double *sum = acc, *dev = acc + channels;
  int64_t per = total / channels; /* values of each channel */
  if (type == KILN_HOST_U8) {
    /* a histogram per channel: the sums are exact, whatever the count */
    const uint8_t *p = images;
    for (int64_t i = 0; i < total; i++)
      hist[(channels == 1 ? 0 : i % channels) * 256 + p[i]]++;
    for (int c = 0; c < channels; c++) {
      for (int v = 0; v < 256; v++)
        sum[c] += (double)hist[c * 256 + v] * (v / 255.0);
      double mu = sum[c] / (double)per;
      for (int v = 0; v < 256; v++)
        dev[c] += (double)hist[c * 256 + v] * (v / 255.0 - mu) * (v / 255.0 - mu);
    }
  } else {
    /* two passes in double: the mean, then the squared deviations from it */
    const float *p = images;
    for (int64_t i = 0; i < total; i++) {
      if (!isfinite(p[i])) {
        free(acc);
        return !kiln__error(ctx, KILN_ERR_INVALID, "%s: value %lld is %g: no statistics", fn,
                            (long long)i, p[i]);
      }
      sum[channels == 1 ? 0 : i % channels] += p[i];
    }
    for (int64_t i = 0; i < total; i++) {
      int64_t c = channels == 1 ? 0 : i % channels;
      double d = p[i] - sum[c] / (double)per;
      dev[c] += d * d;
    }
  }
  for (int c = 0; c < channels; c++) {
    mean[c] = (float)(sum[c] / (double)per);
    std[c] = (float)sqrt(dev[c] / (double)per);
  }
  free(acc);
  free(hist);
  return true;
}

/* n host labels checked and copied as i32 (malloc'd); NULL with the error set, naming fn. */
static int32_t *host_labels(kiln_ctx *ctx, const char *fn, kiln_host_labels lb, int64_t n) {
  if (!lb.i32 == !lb.u8)
    return kiln__error(ctx, KILN_ERR_INVALID, "%s: %s", fn,
                       lb.i32 ? "labels given both as i32 and as u8 (set one of them)"
                              : "NULL labels (set .i32 or .u8 of kiln_host_labels)"),
           NULL;
  if (lb.classes < 0 || lb.classes > INT32_MAX)
    return kiln__error(ctx, KILN_ERR_INVALID,
                       "%s: %lld classes (0: not checked; else 1 to 2^31 - 1)", fn,
                       (long long)lb.classes),
           NULL;
  int32_t *y = malloc((size_t)n * sizeof *y);
  if (!y)
    return kiln__error(ctx, KILN_ERR_OOM, "%s: out of host memory for %lld labels", fn,
                       (long long)n),
           NULL;
  for (int64_t i = 0; i < n; i++) {
    int64_t v = lb.u8 ? lb.u8[i] : lb.i32[i];
    if (v < 0 || (lb.classes > 0 && v >= lb.classes)) {
      free(y);
      if (v < 0)
        return kiln__error(ctx, KILN_ERR_INVALID, "%s: record %lld: label %lld is negative", fn,
                           (long long)i, (long long)v),
               NULL;
      return kiln__error(ctx, KILN_ERR_INVALID,
                         "%s: record %lld: label %lld is outside [0, %lld), the classes", fn,
                         (long long)i, (long long)v, (long long)lb.classes),
             NULL;
    }
    y[i] = (int32_t)v;
  }
  return y;
}

/* The normalisation norm asks for, as (2 channels) floats (means, then standard deviations;
 * malloc'd; computed from the images when norm->from_data), *channels its count (0: none, and
 * NULL returned). false with the error set, naming fn. */
static bool host_norm(kiln_ctx *ctx, const char *fn, kiln_host_type type, const void *images,
                      int64_t total, const kiln_normalize *norm, float **out, int *channels) {
  *out = NULL;
  *channels = norm ? norm->channels : 0;
  if (*channels == 0) {
    if (norm && norm->from_data)
      return !kiln__error(ctx, KILN_ERR_INVALID,
                          "%s: a normalisation from the data of 0 channels (channels: the last "
                          "axis's size, or 1 for every value together)",
                          fn);
    return true;
  }
  int c = *channels;
  if (norm->from_data && (norm->mean || norm->std))
    return !kiln__error(ctx, KILN_ERR_INVALID,
                        "%s: a normalisation from the data (from_data 1) with a %s given: leave "
                        "mean and std NULL",
                        fn, norm->mean ? "mean" : "std");
  if (!norm->from_data && (!norm->mean || !norm->std))
    return !kiln__error(ctx, KILN_ERR_INVALID,
                        "%s: a normalisation of %d channels without %s (from_data 1 computes both "
                        "from the images)",
                        fn, c, !norm->mean ? "its mean" : "its std");
  float *v = malloc((size_t)c * 2 * sizeof *v);
  if (!v) return !kiln__error(ctx, KILN_ERR_OOM, "%s: out of host memory", fn);
  if (norm->from_data) {
    if (!image_stats(ctx, fn, type, images, total, c, v, v + c)) {
      free(v);
      return false;
    }
    for (int k = 0; k < c; k++)
      if (!(v[c + k] > 0.f)) {
        double value = v[k];
        free(v);
        return !kiln__error(ctx, KILN_ERR_INVALID,
                            "%s: channel %d of the images is constant (%g): its standard "
                            "deviation is 0, so it cannot be normalised by its own statistics",
                            fn, k, value);
      }
  } else {
    for (int k = 0; k < c; k++) {
      if (!isfinite(norm->mean[k]) || !(norm->std[k] > 0.f) || !isfinite(norm->std[k])) {
        free(v);
        return !kiln__error(ctx, KILN_ERR_INVALID,
                            "%s: channel %d's mean %g must be finite and its std %g finite and > 0",
                            fn, k, norm->mean[k], norm->std[k]);
      }
      v[k] = norm->mean[k];
      v[c + k] = norm->std[k];
    }
  }
  *out = v;
  return true;
}

kiln_dataset *kiln__dataset_from_host(kiln_ctx *ctx, const char *fn, kiln_host_type type,
                                      kiln_shape shape, const void *images, kiln_host_labels labels,
                                      const kiln_normalize *norm) {
  int channels = norm ? norm->channels : 0;
  int64_t n = 0, total = 0;
  if (!host_images_ok(ctx, fn, type, shape, images, channels, true, &n, &total)) return NULL;
  int32_t *y = host_labels(ctx, fn, labels, n);
  if (!y) return NULL;
  float *nv;
  if (!host_norm(ctx, fn, type, images, total, norm, &nv, &channels)) {
    free(y);
    return NULL;
  }
  float *x = malloc((size_t)total * sizeof *x);
  kiln_dataset *ds = calloc(1, sizeof *ds);
  if (!x || !ds) {
    free(x);
    free(ds);
    free(y);
    free(nv);
    return kiln__error(ctx, KILN_ERR_OOM, "%s: out of host memory for %lld values", fn,
                       (long long)total),
           NULL;
  }
  /* channels last: the channel of value i is i modulo their count */
  for (int64_t i = 0; i < total; i++) {
    float v = host_value(type, images, i);
    if (channels > 0) {
      int c = channels == 1 ? 0 : (int)(i % channels);
      v = (v - nv[c]) / nv[channels + c];
    }
    x[i] = v;
  }
  ds->ctx = ctx;
  ds->anchor = kiln__ctx_anchor(ctx);
  ds->n = n;
  ds->norm_channels = channels;
  ds->norm = nv;
  ds->images = kiln_tensor_from_host(ctx, KILN_DTYPE_F32, shape, x);
  ds->labels = kiln_tensor_from_host(ctx, KILN_DTYPE_I32, KILN_SHAPE(n), y);
  free(x);
  free(y);
  if (!ds->images || !ds->labels) {
    kiln_dataset_free(ds);
    return NULL;
  }
  kiln_tensor_set_name(ds->images, "images");
  kiln_tensor_set_name(ds->labels, "labels");
  return ds;
}

kiln_dataset *kiln_dataset_from_host(kiln_ctx *ctx, kiln_host_type type, kiln_shape shape,
                                     const void *images, kiln_host_labels labels,
                                     const kiln_normalize *norm) {
  if (!ctx) return NULL;
  if (!kiln__ok(ctx)) return NULL;
  return kiln__dataset_from_host(ctx, __func__, type, shape, images, labels, norm);
}

kiln_normalize kiln_dataset_normalization(const kiln_dataset *ds) {
  if (!ds || ds->norm_channels == 0) return (kiln_normalize){0};
  return (kiln_normalize){
      .channels = ds->norm_channels, .mean = ds->norm, .std = ds->norm + ds->norm_channels};
}

kiln_dataset *kiln_dataset_from_mnist(kiln_ctx *ctx, const kiln_mnist *m, float mean, float std) {
  const char *fn = __func__;
  if (!kiln__ok(ctx)) return NULL;
  if (!m || !m->images || !m->labels || m->n <= 0)
    return kiln__error(ctx, KILN_ERR_INVALID, "%s: empty data set", fn), NULL;
  bool from_data = isnan(mean) && isnan(std);
  if (!from_data && (!isfinite(mean) || !(std > 0.f) || !isfinite(std)))
    return kiln__error(ctx, KILN_ERR_INVALID,
                       "%s: mean %g and std %g: the mean must be finite and the std finite and > "
                       "0, or both NAN (computed from the images)",
                       fn, mean, std),
           NULL;
  int64_t dims[3] = {m->n, m->rows, m->cols};
  if (m->rows <= 0 || m->cols <= 0 || !kiln__numel_ok(3, dims))
    return kiln__error(ctx, KILN_ERR_INVALID,
                       "%s: %lld images of %lld x %lld is no data set kiln can hold", fn,
                       (long long)m->n, (long long)m->rows, (long long)m->cols),
           NULL;
  kiln_normalize norm = {.channels = 1, .mean = &mean, .std = &std};
  if (from_data) norm = (kiln_normalize){.channels = 1, .from_data = 1};
  return kiln__dataset_from_host(ctx, fn, KILN_HOST_U8, KILN_SHAPE(m->n, m->rows, m->cols, 1),
                                 m->images, (kiln_host_labels){.u8 = m->labels}, &norm);
}

kiln_status kiln_image_stats(kiln_ctx *ctx, kiln_host_type type, kiln_shape shape,
                             const void *images, int channels, float *mean, float *std) {
  const char *fn = __func__;
  if (!ctx) return KILN_ERR_INVALID;
  if (!kiln__ok(ctx)) return ctx->status;
  int64_t n = 0, total = 0;
  if (!host_images_ok(ctx, fn, type, shape, images, channels, false, &n, &total))
    return ctx->status;
  if (!mean || !std)
    return kiln__error(ctx, KILN_ERR_INVALID, "%s: NULL %s", fn, !mean ? "mean" : "std");
  return image_stats(ctx, fn, type, images, total, channels, mean, std) ? KILN_OK : ctx->status;
}

kiln_dataset *kiln_mnist_load(kiln_ctx *ctx, const char *dir, const char *split, float mean,
                              float std) {
  kiln_mnist m;
  if (kiln_mnist_read(ctx, dir, split, &m) != KILN_OK) return NULL;
  kiln_dataset *ds = kiln_dataset_from_mnist(ctx, &m, mean, std);
  kiln_mnist_free(&m);
  return ds;
}

int64_t kiln_dataset_size(const kiln_dataset *ds) { return ds ? ds->n : 0; }
kiln_tensor *kiln_dataset_images(const kiln_dataset *ds) { return ds ? ds->images : NULL; }
kiln_tensor *kiln_dataset_labels(const kiln_dataset *ds) { return ds ? ds->labels : NULL; }

void kiln_dataset_free(kiln_dataset *ds) {
  if (!ds) return;
  if (ds->anchor->alive) { /* else kiln_ctx_free freed them */
    kiln_tensor_free(ds->images);
    kiln_tensor_free(ds->labels);
  }
  kiln__anchor_release(ds->anchor);
  free(ds->norm);
  free(ds);
}

kiln_status kiln_dataset_set_dtype(kiln_dataset *ds, kiln_dtype dtype) {
  const char *fn = __func__;
  if (!ds) return KILN_ERR_INVALID;
  kiln_ctx *ctx = ds->ctx;
  if (!ds->anchor->alive) return KILN_ERR_STATE; /* its context is gone */
  if (!kiln__ok(ctx)) return ctx->status;
  kiln_tensor *old = ds->images;
  if (dtype != KILN_DTYPE_F32 && dtype != KILN_DTYPE_BF16)
    return kiln__error(ctx, KILN_ERR_DTYPE, "%s: %s; a data set's images are f32 or bf16", fn,
                       kiln_dtype_name(dtype));
  if (old->dtype == dtype) return KILN_OK;
  if (ctx->in_step)
    return kiln__error(ctx, KILN_ERR_STATE,
                       "%s: inside a step; convert a data set before kiln_step_begin", fn);
  /* through the host: the images read back, converted there (bf16 rounded to nearest even, as
   * a cast on the device rounds; bf16 to f32 exact), the new tensor made before the old one goes
   * (a failure changes nothing) */
  int64_t n = kiln_tensor_numel(old);
  size_t osize = kiln_dtype_size(old->dtype), nsize = kiln_dtype_size(dtype);
  void *from = malloc((size_t)n * osize), *to = malloc((size_t)n * nsize);
  kiln_status st = from && to
                       ? kiln_tensor_to_host(old, from, (size_t)n * osize)
                       : kiln__error(ctx, KILN_ERR_OOM, "%s: out of host memory for %lld values",
                                     fn, (long long)n);
  for (int64_t i = 0; st == KILN_OK && i < n; i++) {
    if (dtype == KILN_DTYPE_BF16)
      ((uint16_t *)to)[i] = kiln_bf16_from_f32(((const float *)from)[i]);
    else
      ((float *)to)[i] = kiln_bf16_to_f32(((const uint16_t *)from)[i]);
  }
  kiln_tensor *t =
      st == KILN_OK ? kiln_tensor_from_host(ctx, dtype, kiln_tensor_shape(old), to) : NULL;
  free(from);
  free(to);
  if (!t) return kiln_ctx_status(ctx);
  kiln_tensor_set_name(t, "images");
  kiln_tensor_free(old);
  ds->images = t;
  return KILN_OK;
}

kiln_loader *kiln_loader_new(kiln_dataset *ds, const kiln_loader_options *o) {
  const char *fn = __func__;
  if (!ds) return NULL;
  kiln_ctx *ctx = ds->ctx;
  if (!kiln__ok(ctx)) return NULL;
  if (!o)
    return kiln__error(ctx, KILN_ERR_INVALID, "%s: NULL options (batch is required)", fn), NULL;
  /* a batch larger than the data set is one partial batch (none with drop_last), as PyTorch's */
  if (o->batch <= 0)
    return kiln__error(ctx, KILN_ERR_INVALID, "%s: batch %lld must be > 0", fn,
                       (long long)o->batch),
           NULL;
  if (!kiln__flag_ok(ctx, fn, NULL, "shuffle", o->shuffle) ||
      !kiln__flag_ok(ctx, fn, NULL, "drop_last", o->drop_last))
    return NULL;
  if (o->world < 0 || o->rank < 0 || (o->world > 0 ? o->rank >= o->world : o->rank != 0))
    return kiln__error(ctx, KILN_ERR_INVALID,
                       "%s: rank %d of world %d: the rank must be in [0, world) (world 0: one "
                       "process, rank 0)",
                       fn, o->rank, o->world),
           NULL;
  int64_t epoch_n = o->world > 0 ? kiln__shard_count(ds->n, o->world, false) : ds->n;
  if (epoch_n < 0 || epoch_n > INT32_MAX)
    return kiln__error(ctx, KILN_ERR_INVALID, "%s: %lld samples over world %d", fn,
                       (long long)ds->n, o->world),
           NULL;
  kiln_loader *l = calloc(1, sizeof *l);
  int32_t *h = malloc((size_t)ds->n * sizeof *h);
  int32_t *shard = o->world > 0 ? malloc((size_t)epoch_n * sizeof *shard) : NULL;
  if (!l || !h || (o->world > 0 && !shard)) {
    free(l);
    free(h);
    free(shard);
    return kiln__error(ctx, KILN_ERR_OOM, "%s: out of host memory", fn), NULL;
  }
  l->ds = ds;
  l->ctx = ctx;
  l->anchor = kiln__ctx_anchor(ctx);
  l->batch = o->batch;
  l->shuffle = o->shuffle;
  l->drop_last = o->drop_last;
  l->seed = o->seed;
  l->host_order = h;
  l->rank = o->rank;
  l->world = o->world;
  l->epoch_n = epoch_n;
  l->shard = shard;
  l->order = kiln__tensor_persistent(ctx, KILN_DTYPE_I32, 1, &epoch_n, false); /* or the shard */
  l->iota = kiln__tensor_persistent(ctx, KILN_DTYPE_I32, 1, &ds->n, false);
  if (!l->order || !l->iota) {
    kiln_loader_free(l);
    return NULL;
  }
  for (int64_t i = 0; i < ds->n; i++)
    h[i] = (int32_t)i;
  if (kiln_tensor_copy_from_host(l->iota, h, (size_t)ds->n * sizeof *h) != KILN_OK) {
    kiln_loader_free(l);
    return NULL;
  }
  kiln_loader_start(l, 0);
  return l;
}

void kiln_loader_start(kiln_loader *l, int epoch) {
  if (!l) return;
  int64_t n = l->ds->n;
  for (int64_t i = 0; i < n; i++)
    l->host_order[i] = (int32_t)i;
  if (l->shuffle) {
    /* Fisher-Yates from splitmix64 seeded by (seed, epoch) */
    uint64_t state = l->seed * 0x9e3779b97f4a7c15ULL + (uint64_t)epoch * 0xd1b54a32d192ed03ULL;
    for (int64_t i = n - 1; i > 0; i--) {
      int64_t j = (int64_t)(kiln__splitmix64(&state) % (uint64_t)(i + 1));
      int32_t t = l->host_order[i];
      l->host_order[i] = l->host_order[j];
      l->host_order[j] = t;
    }
  }
  const int32_t *order = l->host_order;
  if (l->world > 0) { /* this rank's shard: the same order on every rank, their own parts */
    kiln__shard_order(l->host_order, n, l->rank, l->world, false, l->shard);
    order = l->shard;
  }
  kiln_tensor_copy_from_host(l->order, order, (size_t)l->epoch_n * sizeof(int32_t));
  l->pos = 0;
  l->last_count = 0;
}

static void undo_pos(void *obj, void *saved) { ((kiln_loader *)obj)->pos = *(int64_t *)saved; }

int kiln_loader_next(kiln_loader *l, kiln_tensor **x, kiln_tensor **y) {
  if (!l || !x || !y) return 0;
  if (l->ctx->in_step && !kiln__undo_logged(l->ctx, &l->undo_mark)) {
    /* a failed step gives its batches back */
    int64_t *saved = malloc(sizeof *saved);
    if (!saved) return kiln__error(l->ctx, KILN_ERR_OOM, "kiln_loader_next: out of host memory"), 0;
    *saved = l->pos;
    if (!kiln__undo_push(l->ctx, undo_pos, l, saved, &l->undo_mark)) return 0;
  }
  int64_t left = l->epoch_n - l->pos;
  if (left <= 0 || (l->drop_last && left < l->batch)) return 0;
  int64_t b = left < l->batch ? left : l->batch;
  /* the whole order tensor, read from the batch's offset: the offset is a step value, so every
   * full batch of an epoch has the same signature and replays the same step graph */
  *x = kiln__index_select_at(l->ds->images, l->order, l->pos, b, __func__);
  *y = kiln__index_select_at(l->ds->labels, l->order, l->pos, b, __func__);
  l->last_start = l->pos;
  l->last_count = b;
  l->pos += b;
  return *x && *y;
}

kiln_tensor *kiln_loader_indices(kiln_loader *l) {
  if (!l || !l->anchor->alive || !kiln__ok(l->ctx)) return NULL;
  if (l->last_count == 0)
    return kiln__error(l->ctx, KILN_ERR_STATE,
                       "kiln_loader_indices: no batch of this epoch yet (call kiln_loader_next "
                       "first)"),
           NULL;
  /* iota[order[start + k]] = order[start + k]: the slice as a gather whose start is a step value,
   * as the batch's own (a view at the slice's offset would make every batch a new signature) */
  return kiln__index_select_at(l->iota, l->order, l->last_start, l->last_count, __func__);
}

int64_t kiln_loader_batches(const kiln_loader *l) {
  if (!l) return 0;
  int64_t n = l->epoch_n;
  return n / l->batch + (!l->drop_last && n % l->batch != 0);
}

void kiln_loader_free(kiln_loader *l) {
  if (!l) return;
  if (l->anchor->alive) { /* else kiln_ctx_free freed the order */
    kiln__undo_forget(l->ctx, l);
    kiln_tensor_free(l->order);
    kiln_tensor_free(l->iota);
    kiln_tensor_free(l->eval_loss);
    kiln_tensor_free(l->eval_hits);
  }
  free(l->host_order);
  free(l->shard);
  kiln__anchor_release(l->anchor);
  free(l);
}

/* ---------------------------------------------------------------- for kiln_evaluate */

kiln_ctx *kiln__loader_ctx(const kiln_loader *l) { return l->ctx; }

int64_t kiln__loader_rows(const kiln_loader *l) {
  return l->batch < l->epoch_n ? l->batch : l->epoch_n;
}

bool kiln__loader_batch_at(kiln_loader *l, int64_t k, kiln_tensor **x, kiln_tensor **y,
                           const char *fn) {
  KILN_ASSERT(k >= 0 && k < kiln_loader_batches(l));
  int64_t start = k * kiln__loader_rows(l), left = l->epoch_n - start;
  int64_t b = left < l->batch ? left : l->batch;
  *x = kiln__index_select_at(l->ds->images, l->order, start, b, fn);
  *y = kiln__index_select_at(l->ds->labels, l->order, start, b, fn);
  return *x && *y;
}

bool kiln__loader_eval_sums(kiln_loader *l, kiln_tensor **loss, kiln_tensor **hits) {
  if (!l->eval_loss) l->eval_loss = kiln_tensor_new(l->ctx, KILN_DTYPE_F32, KILN_SCALAR_SHAPE);
  if (!l->eval_hits) l->eval_hits = kiln_tensor_new(l->ctx, KILN_DTYPE_F32, KILN_SCALAR_SHAPE);
  *loss = l->eval_loss;
  *hits = l->eval_hits;
  return *loss && *hits;
}
