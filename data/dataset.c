/*
 * dataset.c: data sets held on the device (uploaded once) and batches gathered there. A loader
 * shuffles each epoch on the host from its seed, uploads the epoch's order once, and each batch
 * is a slice of that order and a row gather: nothing per batch crosses the bus.
 */
#include <stdlib.h>
#include <string.h>

#include "../core/internal.h"

struct kiln_dataset {
  kiln_ctx *ctx;
  kiln__anchor *anchor;
  int64_t n;
  kiln_tensor *images; /* (n, features) f32 */
  kiln_tensor *labels; /* (n) i32 */
};

struct kiln_loader {
  kiln_ctx *ctx;
  kiln__anchor *anchor;
  kiln_dataset *ds;
  int64_t batch, pos;
  bool shuffle, drop_last;
  uint64_t seed;
  kiln_tensor *order; /* (n) i32: this epoch's order */
  int32_t *host_order;
  uint64_t undo_mark; /* the step's undo log holds pos (core/undo.c) */
};

kiln_dataset *kiln_dataset_from_mnist(kiln_ctx *ctx, const kiln_mnist *m, float mean, float std) {
  if (!kiln__ok(ctx)) return NULL;
  if (!m || !m->images || m->n <= 0)
    return kiln__error(ctx, KILN_ERR_INVALID, "kiln_dataset_from_mnist: empty data set"), NULL;
  if (!(std > 0.f))
    return kiln__error(ctx, KILN_ERR_INVALID, "kiln_dataset_from_mnist: std %g must be > 0", std),
           NULL;
  int64_t dims[3] = {m->n, m->rows, m->cols};
  if (m->rows <= 0 || m->cols <= 0 || !kiln__numel_ok(3, dims))
    return kiln__error(ctx, KILN_ERR_INVALID,
                       "kiln_dataset_from_mnist: %lld images of %lld x %lld is no data set kiln "
                       "can hold",
                       (long long)m->n, (long long)m->rows, (long long)m->cols),
           NULL;
  int64_t feat = m->rows * m->cols;
  float *x = malloc((size_t)(m->n * feat) * sizeof *x);
  int32_t *y = malloc((size_t)m->n * sizeof *y);
  kiln_dataset *ds = calloc(1, sizeof *ds);
  if (!x || !y || !ds) {
    free(x);
    free(y);
    free(ds);
    return kiln__error(ctx, KILN_ERR_OOM, "kiln_dataset_from_mnist: out of host memory"), NULL;
  }
  for (int64_t i = 0; i < m->n * feat; i++)
    x[i] = ((float)m->images[i] / 255.f - mean) / std;
  for (int64_t i = 0; i < m->n; i++)
    y[i] = m->labels[i];
  ds->ctx = ctx;
  ds->anchor = kiln__ctx_anchor(ctx);
  ds->n = m->n;
  ds->images = kiln_tensor_from_host(ctx, KILN_DTYPE_F32, KILN_SHAPE(m->n, feat), x);
  ds->labels = kiln_tensor_from_host(ctx, KILN_DTYPE_I32, KILN_SHAPE(m->n), y);
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
  free(ds);
}

kiln_loader *kiln_loader_new(kiln_dataset *ds, int64_t batch, int shuffle, uint64_t seed,
                             int drop_last) {
  if (!ds) return NULL;
  kiln_ctx *ctx = ds->ctx;
  if (!kiln__ok(ctx)) return NULL;
  if (batch <= 0 || batch > ds->n)
    return kiln__error(ctx, KILN_ERR_INVALID, "kiln_loader_new: batch %lld not in [1, %lld]",
                       (long long)batch, (long long)ds->n),
           NULL;
  kiln_loader *l = calloc(1, sizeof *l);
  int32_t *h = malloc((size_t)ds->n * sizeof *h);
  if (!l || !h) {
    free(l);
    free(h);
    return kiln__error(ctx, KILN_ERR_OOM, "kiln_loader_new: out of host memory"), NULL;
  }
  l->ds = ds;
  l->ctx = ctx;
  l->anchor = kiln__ctx_anchor(ctx);
  l->batch = batch;
  l->shuffle = shuffle != 0;
  l->drop_last = drop_last != 0;
  l->seed = seed;
  l->host_order = h;
  l->order = kiln__tensor_persistent(ctx, KILN_DTYPE_I32, 1, &ds->n, false);
  if (!l->order) {
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
  kiln_tensor_copy_from_host(l->order, l->host_order, (size_t)n * sizeof(int32_t));
  l->pos = 0;
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
  int64_t n = l->ds->n, left = n - l->pos;
  if (left <= 0 || (l->drop_last && left < l->batch)) return 0;
  int64_t b = left < l->batch ? left : l->batch;
  /* the whole order tensor, read from the batch's offset: the offset is a step value, so every
   * full batch of an epoch has the same signature and replays the same step graph */
  *x = kiln__index_select_at(l->ds->images, l->order, l->pos, b, __func__);
  *y = kiln__index_select_at(l->ds->labels, l->order, l->pos, b, __func__);
  l->pos += b;
  return *x && *y;
}

int64_t kiln_loader_batches(const kiln_loader *l) {
  if (!l) return 0;
  int64_t n = l->ds->n;
  return l->drop_last ? n / l->batch : (n + l->batch - 1) / l->batch;
}

void kiln_loader_free(kiln_loader *l) {
  if (!l) return;
  if (l->anchor->alive) { /* else kiln_ctx_free freed the order */
    kiln__undo_forget(l->ctx, l);
    kiln_tensor_free(l->order);
  }
  free(l->host_order);
  kiln__anchor_release(l->anchor);
  free(l);
}
